"""The libvirt driver against a fake QEMU hypervisor: what libvirt's test driver cannot show.

The fakes hold what a libvirtd holds (guests, their persistent and running definitions) and
answer as QEMU's driver does where Ferry depends on it: a live detach the guest ignores, a
shutdown request that is lost, a daemon restart that kills every open connection.
"""

from __future__ import annotations

import copy
import errno
import os
import stat
import threading
import uuid
import xml.etree.ElementTree as ET
from typing import Any

import libvirt
import pytest
from flavors import SMALL as FLAVOR

from ferry import errors
from hostagent import driver as driver_module
from hostagent.__main__ import build_parser
from hostagent.driver import (
    PAUSED,
    RUNNING,
    SHUTDOWN,
    SUSPENDED,
    VOLUME,
    DiskSpec,
    GuestSpec,
    LibvirtDriver,
    PortSpec,
    tap_device,
)

PORT_ID = "3f1c0a52-7d4e-4b8e-9a51-0c2d6e8f9a10"

CAPABILITIES = """<capabilities>
  <host><cpu><arch>x86_64</arch></cpu></host>
  <guest><os_type>hvm</os_type><arch name='x86_64'><domain type='qemu'/><domain type='kvm'/></arch></guest>
</capabilities>"""


def libvirt_error(code: int, domain: int = libvirt.VIR_FROM_QEMU, message: str = "failed") -> libvirt.libvirtError:
    exc = libvirt.libvirtError(message)
    exc.err = (code, domain, message, libvirt.VIR_ERR_ERROR, None, None, None, 0, 0)
    return exc


def connection_lost() -> libvirt.libvirtError:
    return libvirt_error(
        libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_FROM_RPC, "End of file while reading data: Input/output error"
    )


class Guest:
    """A guest as libvirtd keeps it."""

    def __init__(self, root: ET.Element) -> None:
        self.persistent = root
        self.live: ET.Element | None = None
        self.state = libvirt.VIR_DOMAIN_SHUTOFF
        # Live detach requests answered with success while the device stays (None: ignore them all).
        self.ignored_live_detaches: int | None = 0
        # Shutdown requests after which the guest stops (None: it never does).
        self.stops_after_requests: int | None = 1
        self.failures: dict[str, list[libvirt.libvirtError]] = {}
        self.calls: list[tuple[str, Any]] = []

    @property
    def active(self) -> bool:
        return self.state != libvirt.VIR_DOMAIN_SHUTOFF

    def stop(self) -> None:
        self.state, self.live = libvirt.VIR_DOMAIN_SHUTOFF, None

    def called(self, name: str) -> list[Any]:
        return [arg for call, arg in self.calls if call == name]


class FakeHypervisor:
    """One libvirtd: its guests outlive the connections opened to it."""

    def __init__(self) -> None:
        self.guests: dict[str, Guest] = {}
        self.connections: list[FakeConnection] = []
        self.refuse_opens = 0

    def open(self, uri: str) -> FakeConnection:
        if self.refuse_opens:
            self.refuse_opens -= 1
            raise libvirt_error(libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_FROM_RPC, "Failed to connect socket")
        conn = FakeConnection(self)
        self.connections.append(conn)
        return conn

    def restart(self) -> None:
        for conn in self.connections:
            conn.dead = True


class FakeConnection:
    def __init__(self, hypervisor: FakeHypervisor) -> None:
        self.hypervisor = hypervisor
        self.dead = False
        self.closed = False

    def check(self) -> None:
        if self.dead or self.closed:
            raise connection_lost()

    def getType(self) -> str:  # noqa: N802
        return "QEMU"

    def getCapabilities(self) -> str:  # noqa: N802
        return CAPABILITIES

    def getInfo(self) -> list[Any]:  # noqa: N802
        self.check()
        return ["x86_64", 65536, 32, 2000, 1, 1, 32, 1]

    def isAlive(self) -> int:  # noqa: N802
        return 0 if self.dead or self.closed else 1

    def close(self) -> int:
        self.closed = True
        return 0

    def lookupByUUIDString(self, instance_uuid: str) -> FakeDomain:  # noqa: N802
        self.check()
        if instance_uuid not in self.hypervisor.guests:
            raise libvirt_error(libvirt.VIR_ERR_NO_DOMAIN, message="Domain not found")
        return FakeDomain(self, self.hypervisor.guests[instance_uuid])

    def defineXML(self, xml: str) -> FakeDomain:  # noqa: N802
        self.check()
        root = ET.fromstring(xml)
        instance_uuid = root.findtext("uuid") or ""
        guest = self.hypervisor.guests.get(instance_uuid)
        if guest is None:
            guest = self.hypervisor.guests[instance_uuid] = Guest(root)
        guest.persistent = root
        return FakeDomain(self, guest)

    def listAllDomains(self) -> list[FakeDomain]:  # noqa: N802
        self.check()
        return [FakeDomain(self, guest) for guest in self.hypervisor.guests.values()]


def _matches(existing: ET.Element, wanted: ET.Element) -> bool:
    # As QEMU's driver: a disk by its target, an interface by its MAC.
    if existing.tag != wanted.tag:
        return False
    if wanted.tag == "disk":
        return existing.find("target").get("dev") == wanted.find("target").get("dev")  # type: ignore[union-attr]
    return existing.find("mac").get("address") == wanted.find("mac").get("address")  # type: ignore[union-attr]


class FakeDomain:
    """A handle on a guest, valid only while its connection lives."""

    def __init__(self, conn: FakeConnection, guest: Guest) -> None:
        self.conn = conn
        self.guest = guest

    def _call(self, name: str, arg: Any = None) -> None:
        self.conn.check()
        self.guest.calls.append((name, arg))
        pending = self.guest.failures.get(name)
        if pending:
            raise pending.pop(0)

    def UUIDString(self) -> str:  # noqa: N802
        return self.guest.persistent.findtext("uuid") or ""

    def isActive(self) -> int:  # noqa: N802
        self.conn.check()
        return int(self.guest.active)

    def state(self) -> list[int]:
        self._call("state")
        return [self.guest.state, 0]

    def maxMemory(self) -> int:  # noqa: N802
        return 1024 * 1024

    def create(self) -> int:
        self._call("create")
        self.guest.state, self.guest.live = libvirt.VIR_DOMAIN_RUNNING, copy.deepcopy(self.guest.persistent)
        return 0

    def resume(self) -> int:
        self._call("resume")
        self.guest.state = libvirt.VIR_DOMAIN_RUNNING
        return 0

    def pMWakeup(self, flags: int = 0) -> int:  # noqa: N802
        self._call("pMWakeup", flags)
        self.guest.state = libvirt.VIR_DOMAIN_RUNNING
        return 0

    def shutdown(self) -> int:
        self._call("shutdown")
        if not self.guest.active:
            raise libvirt_error(libvirt.VIR_ERR_OPERATION_INVALID, message="domain is not running")
        if self.guest.stops_after_requests is not None and len(self.guest.called("shutdown")) >= (
            self.guest.stops_after_requests
        ):
            self.guest.stop()
        return 0

    def destroy(self) -> int:
        self._call("destroy")
        if not self.guest.active:
            raise libvirt_error(libvirt.VIR_ERR_OPERATION_INVALID, message="domain is not running")
        self.guest.stop()
        return 0

    def undefineFlags(self, flags: int = 0) -> int:  # noqa: N802
        self._call("undefineFlags", flags)
        del self.conn.hypervisor.guests[self.UUIDString()]
        return 0

    def XMLDesc(self, flags: int = 0) -> str:  # noqa: N802
        self.conn.check()
        inactive = flags & libvirt.VIR_DOMAIN_XML_INACTIVE or self.guest.live is None
        root = self.guest.persistent if inactive else self.guest.live
        return ET.tostring(root, encoding="unicode")  # type: ignore[arg-type]

    def _roots(self, flags: int) -> list[ET.Element]:
        roots = []
        if flags & libvirt.VIR_DOMAIN_AFFECT_CONFIG:
            roots.append(self.guest.persistent)
        if flags & libvirt.VIR_DOMAIN_AFFECT_LIVE:
            if self.guest.live is None:
                raise libvirt_error(libvirt.VIR_ERR_OPERATION_INVALID, message="domain is not running")
            roots.append(self.guest.live)
        return roots

    def attachDeviceFlags(self, xml: str, flags: int = 0) -> int:  # noqa: N802
        self._call("attachDeviceFlags", (xml, flags))
        device = ET.fromstring(xml)
        roots = self._roots(flags)
        for root in roots:
            if any(_matches(existing, device) for existing in root.find("devices")):  # type: ignore[union-attr]
                raise libvirt_error(libvirt.VIR_ERR_OPERATION_FAILED, message="target already exists")
        for root in roots:
            root.find("devices").append(copy.deepcopy(device))  # type: ignore[union-attr]
        return 0

    def detachDeviceFlags(self, xml: str, flags: int = 0) -> int:  # noqa: N802
        self._call("detachDeviceFlags", (xml, flags))
        device = ET.fromstring(xml)
        for root in self._roots(flags):
            devices = root.find("devices")
            found = [existing for existing in devices if _matches(existing, device)]  # type: ignore[union-attr]
            if not found:
                raise libvirt_error(libvirt.VIR_ERR_DEVICE_MISSING, message="device not found")
            if root is self.guest.live and self.guest.ignored_live_detaches != 0:
                if self.guest.ignored_live_detaches is not None:
                    self.guest.ignored_live_detaches -= 1
                continue
            devices.remove(found[0])  # type: ignore[union-attr]
        return 0

    def setMetadata(self, kind: int, xml: str, prefix: str, uri: str, flags: int = 0) -> int:  # noqa: N802
        self._call("setMetadata", flags)
        for root in self._roots(flags):
            metadata = root.find("metadata")
            for old in metadata.findall(f"{{{uri}}}instance"):  # type: ignore[union-attr]
                metadata.remove(old)  # type: ignore[union-attr]
            metadata.append(ET.fromstring(xml))  # type: ignore[union-attr]
        return 0


@pytest.fixture
def hypervisor(monkeypatch: pytest.MonkeyPatch) -> FakeHypervisor:
    hv = FakeHypervisor()
    monkeypatch.setattr(libvirt, "open", hv.open)
    return hv


def make_driver(tmp_path: Any, **options: Any) -> LibvirtDriver:
    timings: dict[str, Any] = {
        "shutdown_poll_interval": 0.001,
        "shutdown_retry_interval": 0.01,
        "destroy_retry_interval": 0.0,
        "device_detach_timeout": 0.02,
        "device_poll_interval": 0.001,
    }
    return LibvirtDriver("qemu:///system", disk_path=tmp_path / "instances", **{**timings, **options})


@pytest.fixture
def drv(hypervisor: FakeHypervisor, tmp_path: Any) -> LibvirtDriver:
    return make_driver(tmp_path)


def _spec(tmp_path: Any, **changes: Any) -> GuestSpec:
    base = GuestSpec(
        instance_uuid=str(uuid.uuid4()),
        display_name="web 1",
        flavor=FLAVOR,
        disks=(DiskSpec(kind="root", path=str(tmp_path / "instances" / "disk"), device="vda", boot=True),),
        ports=(PortSpec(port_id=PORT_ID, mac_address="fa:16:3e:00:00:01"),),
    )
    return GuestSpec(**{**base.__dict__, **changes})


def replace_disks(spec: GuestSpec, disks: tuple[DiskSpec, ...]) -> GuestSpec:
    return GuestSpec(**{**spec.__dict__, "disks": disks})


def _running_guest(hypervisor: FakeHypervisor, drv: LibvirtDriver, tmp_path: Any) -> tuple[str, Guest]:
    spec = _spec(tmp_path)
    drv.define_guest(spec)
    drv.power_on(spec.instance_uuid)
    return spec.instance_uuid, hypervisor.guests[spec.instance_uuid]


def _volume(tmp_path: Any, volume_id: str = "vol-1") -> DiskSpec:
    return DiskSpec(kind=VOLUME, path=str(tmp_path / volume_id), device="/dev/vdb", volume_id=volume_id)


def _serials(root: ET.Element | None) -> list[str | None]:
    assert root is not None
    return [d.findtext("serial") for d in root.findall("devices/disk")]


def _pretend_block_devices(monkeypatch: pytest.MonkeyPatch, *paths: str) -> None:
    real_stat = os.stat

    def fake_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path) in paths:
            return os.stat_result((stat.S_IFBLK | 0o660, 0, 0, 1, 0, 6, 0, 0, 0, 0))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(driver_module.os, "stat", fake_stat)


# -- disks


def test_a_volume_on_a_block_device_is_declared_as_a_block_device(monkeypatch, drv, tmp_path):
    volume = DiskSpec(kind=VOLUME, path="/dev/mapper/vol-1", device="vdb", volume_id="vol-1")
    _pretend_block_devices(monkeypatch, volume.path)
    spec = _spec(tmp_path)

    root = ET.fromstring(drv.guest_xml(replace_disks(spec, spec.disks + (volume,))))

    local, block = root.findall("devices/disk")
    assert local.get("type") == "file" and local.find("source").get("file") == spec.disks[0].path
    assert block.get("type") == "block"
    assert block.find("source").attrib == {"dev": "/dev/mapper/vol-1"}
    assert block.find("driver").get("cache") == "none"


def test_a_block_volume_attached_and_detached_live_is_sent_as_a_block_device(monkeypatch, hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    volume = DiskSpec(kind=VOLUME, path="/dev/sdz", device="vdb", volume_id="vol-1")
    _pretend_block_devices(monkeypatch, volume.path)

    drv.attach_volume(instance_uuid, volume)
    drv.detach_volume(instance_uuid, "vol-1")

    (attached, _flags), = guest.called("attachDeviceFlags")
    assert ET.fromstring(attached).get("type") == "block"
    for detached, _flags in guest.called("detachDeviceFlags"):
        disk = ET.fromstring(detached)
        assert disk.get("type") == "block" and disk.find("source").get("dev") == "/dev/sdz"
    assert _serials(guest.persistent) == [None] and _serials(guest.live) == [None]


def test_disks_use_writethrough_where_o_direct_is_refused(monkeypatch, hypervisor, tmp_path):
    real_open = os.open
    probes: list[str] = []

    def no_direct_open(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            probes.append(str(path))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(driver_module.os, "open", no_direct_open)
    drv = make_driver(tmp_path)
    spec = _spec(tmp_path)

    first = ET.fromstring(drv.guest_xml(spec))
    second = ET.fromstring(drv.guest_xml(spec))

    assert first.find("devices/disk/driver").get("cache") == "writethrough"
    assert second.find("devices/disk/driver").get("cache") == "writethrough"
    assert len(probes) == 1, "the instances directory is probed once"
    assert not [p for p in (tmp_path).rglob(".ferry-direct-io-*")], "the probe file is removed"


def test_disks_use_cache_none_where_o_direct_works(monkeypatch, hypervisor, tmp_path):
    monkeypatch.setattr(driver_module, "_supports_direct_io", lambda directory: True)
    drv = make_driver(tmp_path)

    root = ET.fromstring(drv.guest_xml(_spec(tmp_path)))

    assert root.find("devices/disk/driver").get("cache") == "none"


def test_the_direct_io_probe_answers_for_a_directory_not_yet_created(tmp_path):
    assert isinstance(driver_module._supports_direct_io(tmp_path / "not" / "yet"), bool)
    assert list(tmp_path.iterdir()) == []


# -- live detach


def test_a_live_detach_the_guest_ignores_is_sent_again_until_the_device_leaves(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    drv.attach_volume(instance_uuid, _volume(tmp_path))
    guest.ignored_live_detaches = 2

    drv.detach_volume(instance_uuid, "vol-1")

    live_requests = [f for _xml, f in guest.called("detachDeviceFlags") if f == libvirt.VIR_DOMAIN_AFFECT_LIVE]
    assert len(live_requests) == 3
    assert _serials(guest.live) == [None] and _serials(guest.persistent) == [None]
    assert [d.volume_id for d in drv.guest_spec(instance_uuid).disks] == [None]


def test_a_device_the_running_guest_keeps_fails_the_detach_and_stays_recorded(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    drv.attach_volume(instance_uuid, _volume(tmp_path))
    guest.ignored_live_detaches = None

    with pytest.raises(errors.HypervisorError, match="still has the device"):
        drv.detach_volume(instance_uuid, "vol-1")

    assert len(guest.called("detachDeviceFlags")) == drv.device_detach_attempts
    assert _serials(guest.live) == [None, "vol-1"]
    assert _serials(guest.persistent) == [None, "vol-1"], "the next boot still has it too"
    assert [d.volume_id for d in drv.guest_spec(instance_uuid).disks] == [None, "vol-1"]


def test_a_device_gone_when_a_detach_is_sent_again_counts_as_detached(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    drv.attach_volume(instance_uuid, _volume(tmp_path))
    guest.failures["detachDeviceFlags"] = [libvirt_error(libvirt.VIR_ERR_OPERATION_FAILED, message="in progress")]
    guest.ignored_live_detaches = 0

    drv.detach_volume(instance_uuid, "vol-1")

    # The refused request left the device in place; the second one removed it.
    assert _serials(guest.live) == [None]
    assert [d.volume_id for d in drv.guest_spec(instance_uuid).disks] == [None]


def test_a_detach_of_a_stopped_guest_changes_its_persistent_definition_only(hypervisor, drv, tmp_path):
    spec = _spec(tmp_path)
    drv.define_guest(spec)
    guest = hypervisor.guests[spec.instance_uuid]
    drv.attach_volume(spec.instance_uuid, _volume(tmp_path))

    drv.detach_volume(spec.instance_uuid, "vol-1")

    assert [f for _xml, f in guest.called("attachDeviceFlags")] == [libvirt.VIR_DOMAIN_AFFECT_CONFIG]
    assert [f for _xml, f in guest.called("detachDeviceFlags")] == [libvirt.VIR_DOMAIN_AFFECT_CONFIG]
    assert _serials(guest.persistent) == [None]


# -- attach / detach retried after a crash between the device and the metadata


def test_an_attach_interrupted_before_the_metadata_converges_when_retried(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.failures["setMetadata"] = [libvirt_error(libvirt.VIR_ERR_INTERNAL_ERROR, message="agent died here")]
    with pytest.raises(errors.HypervisorError):
        drv.attach_volume(instance_uuid, _volume(tmp_path))
    assert _serials(guest.live) == [None, "vol-1"]
    assert [d.volume_id for d in drv.guest_spec(instance_uuid).disks] == [None]

    drv.attach_volume(instance_uuid, _volume(tmp_path))
    drv.attach_volume(instance_uuid, _volume(tmp_path))

    assert len(guest.called("attachDeviceFlags")) == 1, "the device is not attached twice"
    assert _serials(guest.live) == [None, "vol-1"] and _serials(guest.persistent) == [None, "vol-1"]
    assert [d.volume_id for d in drv.guest_spec(instance_uuid).disks] == [None, "vol-1"]


def test_an_attach_that_reached_only_the_persistent_definition_completes_live(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.persistent.find("devices").append(drv.disk_element(_volume(tmp_path)))

    drv.attach_volume(instance_uuid, _volume(tmp_path))

    assert [f for _xml, f in guest.called("attachDeviceFlags")] == [libvirt.VIR_DOMAIN_AFFECT_LIVE]
    assert _serials(guest.live) == [None, "vol-1"] and _serials(guest.persistent) == [None, "vol-1"]


def test_a_detach_interrupted_before_the_metadata_converges_when_retried(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    drv.attach_volume(instance_uuid, _volume(tmp_path))
    guest.failures["setMetadata"] = [libvirt_error(libvirt.VIR_ERR_INTERNAL_ERROR, message="agent died here")]
    with pytest.raises(errors.HypervisorError):
        drv.detach_volume(instance_uuid, "vol-1")
    assert _serials(guest.live) == [None] and _serials(guest.persistent) == [None]
    detaches = len(guest.called("detachDeviceFlags"))

    drv.detach_volume(instance_uuid, "vol-1")
    drv.detach_volume(instance_uuid, "vol-1")

    assert len(guest.called("detachDeviceFlags")) == detaches, "nothing is detached twice"
    assert [d.volume_id for d in drv.guest_spec(instance_uuid).disks] == [None]


def test_a_detach_removes_a_volume_the_guest_has_but_the_metadata_lacks(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.failures["setMetadata"] = [libvirt_error(libvirt.VIR_ERR_INTERNAL_ERROR, message="agent died here")]
    with pytest.raises(errors.HypervisorError):
        drv.attach_volume(instance_uuid, _volume(tmp_path))

    drv.detach_volume(instance_uuid, "vol-1")

    assert _serials(guest.live) == [None] and _serials(guest.persistent) == [None]


def test_an_interface_attach_retried_after_a_crash_is_not_plugged_twice(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    port = PortSpec(port_id="9d2e4c1a-0000-4000-8000-000000000002", mac_address="fa:16:3e:00:00:02")
    guest.failures["setMetadata"] = [libvirt_error(libvirt.VIR_ERR_INTERNAL_ERROR, message="agent died here")]
    with pytest.raises(errors.HypervisorError):
        drv.attach_interface(instance_uuid, port)

    drv.attach_interface(instance_uuid, port)
    drv.detach_interface(instance_uuid, PORT_ID)

    assert len(guest.called("attachDeviceFlags")) == 1
    assert [p.port_id for p in drv.guest_spec(instance_uuid).ports] == [port.port_id]
    assert [m.get("address") for m in guest.live.findall("devices/interface/mac")] == ["fa:16:3e:00:00:02"]


# -- CPU


@pytest.mark.parametrize("mode", ["host-model", "host-passthrough"])
def test_guests_get_the_configured_cpu_mode(hypervisor, tmp_path, mode):
    drv = make_driver(tmp_path, cpu_mode=mode)

    root = ET.fromstring(drv.guest_xml(_spec(tmp_path)))

    assert root.get("type") == "kvm"
    assert [cpu.attrib for cpu in root.findall("cpu")] == [{"mode": mode}]


def test_cpu_mode_host_model_is_the_default_and_none_writes_no_cpu_element(hypervisor, drv, tmp_path):
    assert ET.fromstring(drv.guest_xml(_spec(tmp_path))).find("cpu").get("mode") == "host-model"
    assert ET.fromstring(make_driver(tmp_path, cpu_mode="none").guest_xml(_spec(tmp_path))).find("cpu") is None


def test_unknown_cpu_mode_or_vif_type_is_refused(hypervisor, tmp_path):
    with pytest.raises(ValueError):
        make_driver(tmp_path, cpu_mode="custom")
    with pytest.raises(ValueError):
        make_driver(tmp_path, port_vif_type="macvtap")


# -- power


def test_power_off_asks_again_until_the_guest_shuts_down(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.stops_after_requests = 3

    drv.power_off(instance_uuid, timeout=5)

    assert len(guest.called("shutdown")) == 3
    assert guest.called("destroy") == []
    assert drv.guest_power_state(instance_uuid) == SHUTDOWN


def test_power_off_pulls_the_plug_after_the_timeout(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.stops_after_requests = None

    drv.power_off(instance_uuid, timeout=0.05)

    assert len(guest.called("shutdown")) >= 2
    assert len(guest.called("destroy")) == 1
    assert drv.guest_power_state(instance_uuid) == SHUTDOWN


def test_a_guest_that_stops_before_the_shutdown_request_is_powered_off(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    real_state = FakeDomain.state

    def state_then_stop(self: FakeDomain) -> list[int]:
        answer = real_state(self)
        guest.stop()  # between isActive() and shutdown()
        return answer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeDomain, "state", state_then_stop)
        mp.setattr(FakeDomain, "isActive", lambda self: 1 if not self.guest.called("shutdown") else 0)
        drv.power_off(instance_uuid, timeout=5)

    assert len(guest.called("shutdown")) == 1
    assert guest.called("destroy") == []


def test_a_guest_that_stops_before_destroy_is_powered_off(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.failures["destroy"] = [libvirt_error(libvirt.VIR_ERR_OPERATION_INVALID, message="domain is not running")]
    real_call = FakeDomain._call

    def stop_on_destroy(self: FakeDomain, name: str, arg: Any = None) -> None:
        if name == "destroy":
            guest.stop()
        real_call(self, name, arg)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FakeDomain, "_call", stop_on_destroy)
        drv.power_off(instance_uuid, clean_shutdown=False)

    assert len(guest.called("destroy")) == 1
    assert drv.guest_power_state(instance_uuid) == SHUTDOWN


def test_destroy_is_tried_again_while_qemu_is_slow_to_exit(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    busy = "Failed to terminate process 4242 with SIGKILL: Device or resource busy"
    guest.failures["destroy"] = [libvirt_error(libvirt.VIR_ERR_SYSTEM_ERROR, message=busy) for _ in range(2)]

    drv.power_off(instance_uuid, clean_shutdown=False)

    assert len(guest.called("destroy")) == 3
    assert drv.guest_power_state(instance_uuid) == SHUTDOWN


def test_destroy_gives_up_after_its_attempts(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.failures["destroy"] = [libvirt_error(libvirt.VIR_ERR_SYSTEM_ERROR, message="busy") for _ in range(5)]

    with pytest.raises(errors.HypervisorError) as caught:
        drv.power_off(instance_uuid, clean_shutdown=False)

    assert caught.value.details["code"] == libvirt.VIR_ERR_SYSTEM_ERROR
    assert len(guest.called("destroy")) == drv.destroy_attempts


def test_a_paused_guest_is_destroyed_without_a_shutdown_request(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.state = libvirt.VIR_DOMAIN_PAUSED

    drv.power_off(instance_uuid, timeout=5)

    assert guest.called("shutdown") == []
    assert len(guest.called("destroy")) == 1


@pytest.mark.parametrize(
    ("state", "call"),
    [(libvirt.VIR_DOMAIN_PAUSED, "resume"), (libvirt.VIR_DOMAIN_PMSUSPENDED, "pMWakeup")],
)
def test_power_on_resumes_a_paused_or_wakes_a_suspended_guest(hypervisor, drv, tmp_path, state, call):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.state = state
    assert drv.guest_power_state(instance_uuid) in (PAUSED, SUSPENDED)

    drv.power_on(instance_uuid)

    assert len(guest.called(call)) == 1
    assert len(guest.called("create")) == 1, "only the first start created the guest"
    assert drv.guest_power_state(instance_uuid) == RUNNING


# -- connection


def test_the_first_call_after_a_daemon_restart_reconnects_and_succeeds(hypervisor, drv, tmp_path):
    instance_uuid, _guest = _running_guest(hypervisor, drv, tmp_path)
    old = hypervisor.connections[-1]
    hypervisor.restart()
    # The dead connection still claims to be alive: the failing call is what tells.
    old.isAlive = lambda: 1  # type: ignore[method-assign]

    assert drv.guest_power_state(instance_uuid) == RUNNING

    assert len(hypervisor.connections) == 2 and old.closed
    drv.power_off(instance_uuid, timeout=5)
    assert len(hypervisor.connections) == 2


def test_a_call_repeated_on_a_new_connection_is_timed_from_its_repeat(hypervisor, drv, tmp_path, monkeypatch):
    # GIVEN a dead connection that still claims to be alive, and reopening it that takes 15 minutes
    instance_uuid, _guest = _running_guest(hypervisor, drv, tmp_path)
    old = hypervisor.connections[-1]
    hypervisor.restart()
    old.isAlive = lambda: 1  # type: ignore[method-assign]
    clock = [1000.0]
    monkeypatch.setattr(driver_module.time, "monotonic", lambda: clock[0])
    reconnect, domain, seen = drv._reconnect, drv._domain, []

    def slow_reconnect(*args, **kwargs):  # type: ignore[no-untyped-def]
        clock[0] += 900
        return reconnect(*args, **kwargs)

    def looked_up(uuid):  # type: ignore[no-untyped-def]
        seen.append([(call.method, call.seconds) for call in drv.calls_under_way()])
        return domain(uuid)

    monkeypatch.setattr(drv, "_reconnect", slow_reconnect)
    monkeypatch.setattr(drv, "_domain", looked_up)

    # WHEN a call fails on it and is repeated on a new one
    assert drv.guest_power_state(instance_uuid) == RUNNING

    # THEN the repeat counts from its own start (the hung-hypervisor watch does not see 15 minutes)
    assert seen == [[("guest_power_state", 0.0)], [("guest_power_state", 0.0)]]
    assert drv.calls_under_way() == []


def test_a_dead_connection_is_reopened_before_the_call(hypervisor, drv, tmp_path):
    instance_uuid, _guest = _running_guest(hypervisor, drv, tmp_path)
    hypervisor.restart()

    drv.attach_volume(instance_uuid, _volume(tmp_path))

    assert len(hypervisor.connections) == 2
    assert [d.volume_id for d in drv.guest_spec(instance_uuid).disks] == [None, "vol-1"]


def test_a_call_that_lost_its_connection_keeps_the_one_another_call_reopened(hypervisor, drv, tmp_path, monkeypatch):
    # GIVEN a detach waiting for the guest to let go when libvirtd restarts, and another call
    # (the reporter's, in its own thread) that reopens the connection meanwhile
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    drv.attach_volume(instance_uuid, _volume(tmp_path))
    guest.ignored_live_detaches = 1
    live_device, looks = drv._live_device, []

    def restarted_in_the_wait(dom, wanted):  # type: ignore[no-untyped-def]
        looks.append(wanted)
        if len(looks) == 2:
            hypervisor.restart()
            other = threading.Thread(target=drv.list_guests)
            other.start()
            other.join(30)
        return live_device(dom, wanted)

    monkeypatch.setattr(drv, "_live_device", restarted_in_the_wait)

    # WHEN the detach finds its connection gone
    drv.detach_volume(instance_uuid, "vol-1")

    # THEN it runs again on the connection the other call opened, which stays open
    assert len(hypervisor.connections) == 2 and not hypervisor.connections[-1].closed
    assert _serials(guest.live) == [None] and _serials(guest.persistent) == [None]


def test_a_daemon_still_down_fails_the_call_with_hypervisor_error(hypervisor, drv, tmp_path):
    instance_uuid, _guest = _running_guest(hypervisor, drv, tmp_path)
    hypervisor.restart()
    hypervisor.refuse_opens = 1

    with pytest.raises(errors.HypervisorError, match="reopen connection"):
        drv.guest_power_state(instance_uuid)
    assert drv.guest_power_state(instance_uuid) == RUNNING


def test_a_connection_lost_in_the_middle_of_a_call_is_retried_once(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.failures["state"] = [connection_lost(), connection_lost()]

    with pytest.raises(errors.HypervisorError):
        drv.guest_power_state(instance_uuid)
    assert len(hypervisor.connections) == 2, "one reconnection, one retry"


def test_a_closed_client_socket_is_a_lost_connection(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    closed = libvirt_error(libvirt.VIR_ERR_INTERNAL_ERROR, libvirt.VIR_FROM_RPC, "client socket is closed")
    guest.failures["state"] = [closed]

    assert drv.guest_power_state(instance_uuid) == RUNNING
    assert len(hypervisor.connections) == 2


def test_qemu_monitor_end_of_file_is_not_a_lost_connection(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    monitor = libvirt_error(libvirt.VIR_ERR_OPERATION_FAILED, libvirt.VIR_FROM_QEMU, "End of file from qemu monitor")
    guest.failures["state"] = [monitor]

    with pytest.raises(errors.HypervisorError, match="qemu monitor"):
        drv.guest_power_state(instance_uuid)
    assert len(hypervisor.connections) == 1


def test_other_libvirt_errors_are_not_retried(hypervisor, drv, tmp_path):
    instance_uuid, guest = _running_guest(hypervisor, drv, tmp_path)
    guest.failures["state"] = [libvirt_error(libvirt.VIR_ERR_INTERNAL_ERROR, message="boom")]

    with pytest.raises(errors.HypervisorError, match="boom"):
        drv.guest_power_state(instance_uuid)
    assert len(hypervisor.connections) == 1


# -- ports


def test_without_a_bridge_ports_are_ethernet_taps_named_after_the_port(hypervisor, drv, tmp_path):
    interface = ET.fromstring(drv.guest_xml(_spec(tmp_path))).find("devices/interface")

    assert interface.get("type") == "ethernet"
    assert interface.find("target").get("dev") == "tap3f1c0a52-7d" == tap_device(PORT_ID)
    assert interface.find("mac").get("address") == "fa:16:3e:00:00:01"
    assert interface.find("source") is None and interface.find("virtualport") is None


def test_ovs_ports_are_plugged_into_the_bridge_with_their_port_id(hypervisor, tmp_path):
    drv = make_driver(tmp_path, port_bridge="br-int")

    interface = ET.fromstring(drv.guest_xml(_spec(tmp_path))).find("devices/interface")

    assert interface.get("type") == "bridge"
    assert interface.find("source").attrib == {"bridge": "br-int"}
    assert interface.find("virtualport").get("type") == "openvswitch"
    assert interface.find("virtualport/parameters").attrib == {"interfaceid": PORT_ID}
    assert interface.find("target").get("dev") == tap_device(PORT_ID)
    assert interface.find("mac").get("address") == "fa:16:3e:00:00:01"


def test_linux_bridge_ports_have_no_virtualport(hypervisor, tmp_path):
    drv = make_driver(tmp_path, port_bridge="brq0a1b2c3d", port_vif_type="bridge")

    interface = ET.fromstring(drv.guest_xml(_spec(tmp_path))).find("devices/interface")

    assert interface.get("type") == "bridge"
    assert interface.find("source").get("bridge") == "brq0a1b2c3d"
    assert interface.find("virtualport") is None
    assert interface.find("target").get("dev") == tap_device(PORT_ID)


def test_agent_options_reach_the_driver_defaults():
    default = build_parser().parse_args([])
    chosen = build_parser().parse_args(
        ["--cpu-mode", "host-passthrough", "--port-bridge", "br-int", "--port-vif-type", "bridge"]
    )

    assert (default.cpu_mode, default.port_bridge, default.port_vif_type) == ("host-model", None, "ovs")
    assert (chosen.cpu_mode, chosen.port_bridge, chosen.port_vif_type) == ("host-passthrough", "br-int", "bridge")

