"""What the libvirt driver writes for QEMU, accepted and run by libvirt's test driver too."""

from __future__ import annotations

import threading
import time
import uuid
import xml.etree.ElementTree as ET

import libvirt
import pytest
from flavors import TINY as FLAVOR

from hostagent.driver import RUNNING, SHUTDOWN, DiskSpec, GuestSpec, LibvirtDriver, PortSpec, write_test_node_xml

PORT_ID = "5b0e9c3a-1f2d-4e6a-8b7c-9d0e1f2a3b4c"


def _driver(tmp_path, **options) -> LibvirtDriver:
    return LibvirtDriver(write_test_node_xml(tmp_path / "node.xml", vcpus=4, memory_mb=8192), **options)


def _spec() -> GuestSpec:
    return GuestSpec(
        instance_uuid=str(uuid.uuid4()),
        display_name="db 1",
        flavor=FLAVOR,
        disks=(DiskSpec(kind="root", path="/var/lib/ferry/instances/disk", device="vda", boot=True),),
        ports=(PortSpec(port_id=PORT_ID, mac_address="fa:16:3e:00:00:0a"),),
    )


def _live(drv: LibvirtDriver, instance_uuid: str) -> ET.Element:
    return ET.fromstring(drv.connection.lookupByUUIDString(instance_uuid).XMLDesc(0))


@pytest.mark.parametrize("mode", ["host-model", "host-passthrough"])
def test_the_test_driver_runs_a_guest_with_a_cpu_mode(tmp_path, mode):
    drv = _driver(tmp_path, cpu_mode=mode)
    try:
        spec = _spec()
        drv.define_guest(spec)
        drv.power_on(spec.instance_uuid)

        assert _live(drv, spec.instance_uuid).find("cpu").get("mode") == mode
        assert drv.guest_power_state(spec.instance_uuid) == RUNNING
    finally:
        drv.close()


@pytest.mark.parametrize("vif_type", ["ovs", "bridge"])
def test_the_test_driver_runs_a_guest_with_ports_on_a_bridge(tmp_path, vif_type):
    drv = _driver(tmp_path, port_bridge="br-int", port_vif_type=vif_type)
    try:
        spec = _spec()
        drv.define_guest(spec)
        drv.power_on(spec.instance_uuid)

        interface = _live(drv, spec.instance_uuid).find("devices/interface")
        assert interface.get("type") == "bridge"
        assert interface.find("target").get("dev") == "tap5b0e9c3a-1f"
        assert (interface.find("virtualport") is not None) == (vif_type == "ovs")
        drv.detach_interface(spec.instance_uuid, PORT_ID)
        assert _live(drv, spec.instance_uuid).find("devices/interface") is not None, "changes at the next boot"
        assert drv.guest_spec(spec.instance_uuid).ports == ()
    finally:
        drv.close()


def test_power_on_resumes_a_guest_paused_on_the_test_driver(tmp_path):
    drv = _driver(tmp_path)
    try:
        spec = _spec()
        drv.define_guest(spec)
        drv.power_on(spec.instance_uuid)
        dom = drv.connection.lookupByUUIDString(spec.instance_uuid)
        dom.suspend()
        assert dom.state()[0] == libvirt.VIR_DOMAIN_PAUSED

        drv.power_on(spec.instance_uuid)
        assert drv.guest_power_state(spec.instance_uuid) == RUNNING

        dom.suspend()
        drv.power_off(spec.instance_uuid, timeout=5)
        assert drv.guest_power_state(spec.instance_uuid) == SHUTDOWN
    finally:
        drv.close()


class _RefusingShutdown:
    """A test-driver guest that libvirt refuses a shutdown request for, as QEMU's driver does unless
    the guest runs (the test driver cannot suspend a guest to RAM); it reports ``state`` while it runs."""

    def __init__(self, dom: libvirt.virDomain, state: int) -> None:
        self._dom, self._state = dom, state
        self.shutdown_requests = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._dom, name)

    def state(self) -> list[int]:
        return [self._state, 0] if self._dom.isActive() else self._dom.state()

    def shutdown(self) -> int:
        self.shutdown_requests += 1
        exc = libvirt.libvirtError("Requested operation is not valid: domain is not running")
        exc.err = (libvirt.VIR_ERR_OPERATION_INVALID, libvirt.VIR_FROM_QEMU, "domain is not running",
                   libvirt.VIR_ERR_ERROR, None, None, None, 0, 0)
        raise exc


@pytest.mark.parametrize(("state", "requests"), [
    (libvirt.VIR_DOMAIN_PMSUSPENDED, 0),  # suspended to RAM: it cannot take a request, so none is sent
    (libvirt.VIR_DOMAIN_RUNNING, 1),  # suspended or paused meanwhile: the request is refused
])
def test_power_off_pulls_the_plug_of_a_guest_that_cannot_take_a_shutdown_request(tmp_path, monkeypatch, state,
                                                                                  requests):
    drv = _driver(tmp_path)
    try:
        spec = _spec()
        drv.define_guest(spec)
        drv.power_on(spec.instance_uuid)
        guest = _RefusingShutdown(drv.connection.lookupByUUIDString(spec.instance_uuid), state)
        monkeypatch.setattr(drv, "_domain", lambda _uuid: guest)

        drv.power_off(spec.instance_uuid, timeout=5)

        assert not guest.isActive()
        assert guest.shutdown_requests == requests
    finally:
        drv.close()


class _HeldDriver(LibvirtDriver):
    """The driver, holding every guest look-up until ``gate`` is set (a hypervisor that hangs)."""

    gate: threading.Event
    held: threading.Event

    def _domain(self, instance_uuid: str) -> libvirt.virDomain:
        self.held.set()
        assert self.gate.wait(30), "the look-up was never released"
        return super()._domain(instance_uuid)


def test_the_calls_under_way_are_known_with_the_time_they_may_take(tmp_path):
    # GIVEN a guest, and a hypervisor that holds its look-ups
    drv = _HeldDriver(write_test_node_xml(tmp_path / "node.xml", vcpus=4, memory_mb=8192))
    drv.gate, drv.held = threading.Event(), threading.Event()
    spec = _spec()
    drv.define_guest(spec)
    assert drv.calls_under_way() == []

    # WHEN a power-on and a power-off with a 5 s timeout hang in it
    calls = [threading.Thread(target=drv.power_on, args=(spec.instance_uuid,)),
             threading.Thread(target=drv.power_off, args=(spec.instance_uuid,), kwargs={"timeout": 5.0})]
    calls[0].start()
    assert drv.held.wait(30)
    calls[1].start()
    deadline = time.monotonic() + 30
    while len(drv.calls_under_way()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)

    # THEN both are under way, oldest first, each with what it may take (inner calls are not listed)
    under_way = drv.calls_under_way()
    assert [(c.method, c.allowed) for c in under_way] == [("power_on", 0.0), ("power_off", 5.0)]
    assert under_way[0].seconds >= under_way[1].seconds > 0

    # AND once they return, none is
    drv.gate.set()
    for call in calls:
        call.join(30)
    assert drv.calls_under_way() == []
    assert drv.guest_power_state(spec.instance_uuid) in (RUNNING, SHUTDOWN)
