"""The libvirt driver on libvirt's test driver: guests, power, devices, capacity, errors."""

from __future__ import annotations

import threading
import uuid
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

import libvirt
import pytest
from flavors import SMALL as FLAVOR

from ferry import errors
from hostagent.driver import (
    METADATA_NS,
    RUNNING,
    SHUTDOWN,
    VOLUME,
    DiskSpec,
    GuestSpec,
    LibvirtDriver,
    PortSpec,
    guest_name,
    write_test_node_xml,
)

WAIT = 30.0


@pytest.fixture
def driver(tmp_path):
    uri = write_test_node_xml(tmp_path / "node.xml", vcpus=12, memory_mb=24576)
    drv = LibvirtDriver(uri, disk_path=tmp_path / "instances")
    yield drv
    drv.close()


def _spec(instance_uuid: str, tmp_path, **changes) -> GuestSpec:
    base = GuestSpec(
        instance_uuid=instance_uuid,
        display_name="web 1",
        flavor=FLAVOR,
        disks=(DiskSpec(kind="root", path=str(tmp_path / "disk"), device="vda", boot=True),),
        ports=(PortSpec(port_id="port-1", mac_address="fa:16:3e:00:00:01"),),
    )
    return GuestSpec(**{**base.__dict__, **changes})


def _domain_xml(driver: LibvirtDriver, instance_uuid: str, flags: int = 0) -> ET.Element:
    return ET.fromstring(driver.connection.lookupByUUIDString(instance_uuid).XMLDesc(flags))


def test_each_test_hypervisor_is_independent_and_sized_by_its_node_xml(tmp_path):
    uri = write_test_node_xml(tmp_path / "node.xml", vcpus=6, memory_mb=8192)
    first = LibvirtDriver(uri, disk_path=tmp_path)
    second = LibvirtDriver(uri, disk_path=tmp_path)
    try:
        first.define_guest(_spec(str(uuid.uuid4()), tmp_path))
        capacity = first.host_capacity()
        assert (capacity.vcpus, capacity.memory_mb) == (6, 8192)
        assert capacity.disk_gb > 0
        assert len(first.list_guests()) == 1
        assert second.list_guests() == []
    finally:
        first.close()
        second.close()


def test_defined_guest_has_flavor_resources_disks_ports_and_ferry_metadata(driver, tmp_path):
    instance_uuid = str(uuid.uuid4())
    driver.define_guest(_spec(instance_uuid, tmp_path))

    root = _domain_xml(driver, instance_uuid)
    assert root.get("type") == "test"
    assert root.findtext("name") == guest_name(instance_uuid)
    assert root.findtext("uuid") == instance_uuid
    assert root.findtext("vcpu") == "2"
    assert int(root.findtext("memory") or 0) == 1024 * 1024  # KiB
    disk = root.find("devices/disk")
    assert disk is not None and disk.find("source").get("file") == str(tmp_path / "disk")
    assert disk.find("target").get("dev") == "vda"
    assert [m.get("address") for m in root.findall("devices/interface/mac")] == ["fa:16:3e:00:00:01"]
    assert root.find(f"metadata/{{{METADATA_NS}}}instance/{{{METADATA_NS}}}uuid").text == instance_uuid

    spec = driver.guest_spec(instance_uuid)
    assert spec.flavor == FLAVOR
    assert spec.display_name == "web 1"
    assert [p.port_id for p in spec.ports] == ["port-1"]
    assert driver.guest_exists(instance_uuid)
    assert driver.guest_power_state(instance_uuid) == SHUTDOWN


def test_redefining_a_guest_keeps_its_uuid_and_changes_its_flavor(driver, tmp_path):
    instance_uuid = str(uuid.uuid4())
    driver.define_guest(_spec(instance_uuid, tmp_path))
    bigger = {**FLAVOR, "flavorid": "3", "vcpus": 4, "memory_mb": 2048}
    driver.define_guest(_spec(instance_uuid, tmp_path, flavor=bigger))

    assert driver.list_guests() == [instance_uuid]
    root = _domain_xml(driver, instance_uuid)
    assert root.findtext("vcpu") == "4"
    assert driver.guest_spec(instance_uuid).flavor["flavorid"] == "3"


def test_power_on_and_off_change_the_power_state_and_repeat_safely(driver, tmp_path):
    instance_uuid = str(uuid.uuid4())
    driver.define_guest(_spec(instance_uuid, tmp_path))

    driver.power_on(instance_uuid)
    driver.power_on(instance_uuid)
    assert driver.guest_power_state(instance_uuid) == RUNNING
    driver.power_off(instance_uuid, timeout=5)
    driver.power_off(instance_uuid, timeout=5)
    assert driver.guest_power_state(instance_uuid) == SHUTDOWN
    driver.power_on(instance_uuid)
    driver.power_off(instance_uuid, clean_shutdown=False)
    assert driver.guest_power_state(instance_uuid) == SHUTDOWN


def test_destroy_removes_a_running_guest_and_accepts_an_absent_one(driver, tmp_path):
    instance_uuid = str(uuid.uuid4())
    driver.define_guest(_spec(instance_uuid, tmp_path))
    driver.power_on(instance_uuid)

    driver.destroy(instance_uuid)
    driver.destroy(instance_uuid)

    assert not driver.guest_exists(instance_uuid)
    assert driver.list_guests() == []


def test_operations_on_an_unknown_guest_raise_guest_not_found(driver):
    missing = str(uuid.uuid4())
    assert not driver.guest_exists(missing)
    for call in (driver.power_on, driver.power_off, driver.guest_power_state, driver.guest_spec):
        with pytest.raises(errors.GuestNotFound):
            call(missing)


def test_a_definition_libvirt_refuses_raises_hypervisor_error(driver, tmp_path):
    instance_uuid = str(uuid.uuid4())
    bad = _spec(instance_uuid, tmp_path, ports=(PortSpec(port_id="p", mac_address="not-a-mac"),))

    with pytest.raises(errors.HypervisorError) as caught:
        driver.define_guest(bad)

    assert caught.value.name == "Ferry.HypervisorError"
    assert not driver.guest_exists(instance_uuid)


def test_attach_and_detach_volume_redefine_the_guest_on_the_test_driver(driver, tmp_path):
    instance_uuid = str(uuid.uuid4())
    driver.define_guest(_spec(instance_uuid, tmp_path))
    volume = DiskSpec(kind=VOLUME, path=str(tmp_path / "vol-1"), device="/dev/vdb", volume_id="vol-1")

    driver.attach_volume(instance_uuid, volume)
    driver.attach_volume(instance_uuid, volume)

    root = _domain_xml(driver, instance_uuid, libvirt.VIR_DOMAIN_XML_INACTIVE)
    assert root.findtext("uuid") == instance_uuid
    assert [d.findtext("serial") for d in root.findall("devices/disk")] == [None, "vol-1"]
    assert [d.volume_id for d in driver.guest_spec(instance_uuid).disks] == [None, "vol-1"]

    driver.detach_volume(instance_uuid, "vol-1")
    driver.detach_volume(instance_uuid, "vol-1")

    root = _domain_xml(driver, instance_uuid, libvirt.VIR_DOMAIN_XML_INACTIVE)
    assert [d.find("target").get("dev") for d in root.findall("devices/disk")] == ["vda"]
    assert [d.volume_id for d in driver.guest_spec(instance_uuid).disks] == [None]


def test_a_volume_detached_from_a_guest_that_does_not_exist_is_already_detached(driver, tmp_path):
    # GIVEN an instance with no guest on this host (never spawned here, or its host reinstalled)
    instance_uuid = str(uuid.uuid4())
    volume = DiskSpec(kind=VOLUME, path=str(tmp_path / "vol-1"), device="/dev/vdb", volume_id="vol-1")

    # WHEN the volume is detached from it, THEN that succeeds (twice): no guest can hold the volume
    driver.detach_volume(instance_uuid, "vol-1")
    driver.detach_volume(instance_uuid, "vol-1")
    assert not driver.guest_exists(instance_uuid)
    # while an attach to it still fails
    with pytest.raises(errors.GuestNotFound):
        driver.attach_volume(instance_uuid, volume)
    assert not driver.guest_exists(instance_uuid)


def test_a_detach_waiting_for_the_guest_to_let_go_stalls_no_other_driver_call(tmp_path, monkeypatch):
    # GIVEN a running guest with a volume, on a driver that detaches live and waits for the guest
    uri = write_test_node_xml(tmp_path / "node.xml", vcpus=12, memory_mb=24576)
    drv = LibvirtDriver(uri, disk_path=tmp_path / "instances", live_device_updates=True, device_detach_attempts=1,
                        device_detach_timeout=0.05, device_poll_interval=0.01)
    instance_uuid, other_uuid = str(uuid.uuid4()), str(uuid.uuid4())
    volume = DiskSpec(kind=VOLUME, path=str(tmp_path / "vol-1"), device="/dev/vdb", volume_id="vol-1")
    base = _spec(instance_uuid, tmp_path)
    drv.define_guest(_spec(instance_uuid, tmp_path, disks=(*base.disks, volume)))
    drv.power_on(instance_uuid)
    drv.define_guest(_spec(other_uuid, tmp_path))
    waiting, others_done = threading.Event(), threading.Event()
    finished_while_waiting: list[bool] = []
    live_device, looks = drv._live_device, []

    def held_in_the_wait(dom, wanted):  # type: ignore[no-untyped-def]
        looks.append(wanted)
        if len(looks) == 2:  # the first look once the request is sent: the detach waits for the guest
            waiting.set()
            finished_while_waiting.append(others_done.wait(WAIT))
        return live_device(dom, wanted)

    monkeypatch.setattr(drv, "_live_device", held_in_the_wait)

    def other_calls() -> None:
        # the reporter's listing, a read of the same guest, a change of another guest
        drv.list_guests()
        drv.guest_power_state(instance_uuid)
        drv.destroy(other_uuid)
        others_done.set()

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            detaching = pool.submit(drv.detach_volume, instance_uuid, "vol-1")
            assert waiting.wait(WAIT), "the detach never waited"

            # WHEN other driver calls are made meanwhile
            pool.submit(other_calls).result(timeout=2 * WAIT)
            with suppress(errors.HypervisorError):  # the test driver may not release the device
                detaching.result(timeout=2 * WAIT)

        # THEN they all finished while the detach was still waiting
        assert finished_while_waiting == [True]
        assert not drv.guest_exists(other_uuid)
    finally:
        drv.close()


def test_attach_volume_on_a_used_device_is_refused(driver, tmp_path):
    instance_uuid = str(uuid.uuid4())
    driver.define_guest(_spec(instance_uuid, tmp_path))
    clash = DiskSpec(kind=VOLUME, path=str(tmp_path / "vol-2"), device="vda", volume_id="vol-2")

    with pytest.raises(errors.InvalidOperation):
        driver.attach_volume(instance_uuid, clash)
    assert [d.volume_id for d in driver.guest_spec(instance_uuid).disks] == [None]


def test_attach_and_detach_interface_keep_the_guest_running(driver, tmp_path):
    instance_uuid = str(uuid.uuid4())
    driver.define_guest(_spec(instance_uuid, tmp_path))
    driver.power_on(instance_uuid)

    driver.attach_interface(instance_uuid, PortSpec(port_id="port-2", mac_address="fa:16:3e:00:00:02"))
    root = _domain_xml(driver, instance_uuid, libvirt.VIR_DOMAIN_XML_INACTIVE)
    assert [m.get("address") for m in root.findall("devices/interface/mac")] == [
        "fa:16:3e:00:00:01",
        "fa:16:3e:00:00:02",
    ]

    driver.detach_interface(instance_uuid, "port-1")
    root = _domain_xml(driver, instance_uuid, libvirt.VIR_DOMAIN_XML_INACTIVE)
    assert [m.get("address") for m in root.findall("devices/interface/mac")] == ["fa:16:3e:00:00:02"]
    assert [p.port_id for p in driver.guest_spec(instance_uuid).ports] == ["port-2"]
    assert driver.guest_power_state(instance_uuid) == RUNNING


def test_live_device_calls_failing_on_the_test_driver_raise_hypervisor_error(tmp_path):
    # The test driver has no live attach; forcing live calls shows their failures are typed.
    uri = write_test_node_xml(tmp_path / "node.xml", vcpus=2, memory_mb=2048)
    drv = LibvirtDriver(uri, live_device_updates=True)
    try:
        instance_uuid = str(uuid.uuid4())
        drv.define_guest(_spec(instance_uuid, tmp_path))
        with pytest.raises(errors.HypervisorError):
            drv.attach_interface(instance_uuid, PortSpec(port_id="port-2", mac_address="fa:16:3e:00:00:02"))
    finally:
        drv.close()


def test_an_unreachable_hypervisor_raises_hypervisor_error(tmp_path):
    with pytest.raises(errors.HypervisorError):
        LibvirtDriver(f"test://{tmp_path / 'missing-node.xml'}")


class _ShuttingDown:
    """A running test-driver guest that reports QEMU's "shutting down" state (still active) until it
    has been looked at ``polls`` times while active, and is then off; the test driver has no such state."""

    def __init__(self, dom: libvirt.virDomain, polls: int | None) -> None:
        self._dom, self._polls = dom, polls
        self._stopped = False
        self.started = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._dom, name)

    def state(self) -> list[int]:
        return self._dom.state() if self._stopped else [libvirt.VIR_DOMAIN_SHUTDOWN, 1]

    def isActive(self) -> bool:  # noqa: N802 - libvirt's name
        if not self._stopped and self._polls is not None:
            if self._polls == 0:
                self._dom.destroy()  # the guest's shutdown ends
                self._stopped = True
            else:
                self._polls -= 1
        return bool(self._dom.isActive())

    def create(self) -> int:
        self.started += 1
        return int(self._dom.create())


def _shutting_down_guest(drv: LibvirtDriver, tmp_path, monkeypatch, polls: int | None) -> _ShuttingDown:
    instance_uuid = str(uuid.uuid4())
    drv.define_guest(_spec(instance_uuid, tmp_path))
    drv.power_on(instance_uuid)
    guest = _ShuttingDown(drv.connection.lookupByUUIDString(instance_uuid), polls)
    monkeypatch.setattr(drv, "_domain", lambda _uuid: guest)
    return guest


def test_power_on_waits_for_a_guest_shutting_down_to_stop_then_starts_it_again(tmp_path, monkeypatch):
    # GIVEN a guest shutting down (still active) that stops after a few polls
    drv = LibvirtDriver(write_test_node_xml(tmp_path / "node.xml", vcpus=2, memory_mb=2048),
                        shutdown_poll_interval=0.01, shutting_down_wait=5)
    try:
        guest = _shutting_down_guest(drv, tmp_path, monkeypatch, polls=3)

        # WHEN it is powered on
        drv.power_on(guest.UUIDString())

        # THEN it is started again once it has stopped, and runs
        assert guest.started == 1
        assert drv.guest_power_state(guest.UUIDString()) == RUNNING
    finally:
        drv.close()


def test_power_on_of_a_guest_that_never_finishes_shutting_down_fails_with_hypervisor_error(tmp_path, monkeypatch):
    # GIVEN a guest shutting down that never stops
    drv = LibvirtDriver(write_test_node_xml(tmp_path / "node.xml", vcpus=2, memory_mb=2048),
                        shutdown_poll_interval=0.01, shutting_down_wait=0.2)
    try:
        guest = _shutting_down_guest(drv, tmp_path, monkeypatch, polls=None)

        # WHEN it is powered on
        with pytest.raises(errors.HypervisorError) as failed:
            drv.power_on(guest.UUIDString())

        # THEN the power on fails (never reported running while the guest ends off), and nothing was started
        assert "shutting down" in failed.value.message
        assert guest.started == 0
    finally:
        drv.close()
