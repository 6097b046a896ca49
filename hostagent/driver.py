"""The hypervisor driver: what the host agent asks of a hypervisor, and its libvirt implementation.

The agent talks to :class:`Driver` only. :class:`LibvirtDriver` implements it over a libvirt URI:
``qemu:///system`` on a real hypervisor, ``test:///<absolute path to a node XML>`` on one machine
(each open of such a URI is a fresh, independent hypervisor; :func:`write_test_node_xml` writes one).

A guest is named ``instance-<uuid>`` and carries the instance uuid as its libvirt ``<uuid>``. Its
``<metadata>`` holds a ``ferry:instance`` element (namespace :data:`METADATA_NS`) recording the
instance's display name, flavor, local disks, volumes and ports, so the host can tell what each
guest is without asking the database.

Every libvirt failure surfaces as :class:`ferry.errors.HypervisorError`; an operation on a guest
the hypervisor does not know raises :class:`ferry.errors.GuestNotFound`.
"""

from __future__ import annotations

import abc
import os
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import libvirt

from ferry import errors

# Nova's power_state numbers.
NOSTATE = 0
RUNNING = 1
PAUSED = 3
SHUTDOWN = 4
CRASHED = 6
SUSPENDED = 7

_POWER_STATE_BY_LIBVIRT_STATE = {
    libvirt.VIR_DOMAIN_NOSTATE: NOSTATE,
    libvirt.VIR_DOMAIN_RUNNING: RUNNING,
    libvirt.VIR_DOMAIN_BLOCKED: RUNNING,
    libvirt.VIR_DOMAIN_PAUSED: PAUSED,
    libvirt.VIR_DOMAIN_SHUTDOWN: SHUTDOWN,
    libvirt.VIR_DOMAIN_SHUTOFF: SHUTDOWN,
    libvirt.VIR_DOMAIN_CRASHED: CRASHED,
    libvirt.VIR_DOMAIN_PMSUSPENDED: SUSPENDED,
}

METADATA_NS = "urn:ferry:instance:1"
METADATA_PREFIX = "ferry"
ET.register_namespace(METADATA_PREFIX, METADATA_NS)
# libvirt's test driver reads a guest's run state from this namespace in its node description.
TEST_DRIVER_NS = "http://libvirt.org/schemas/domain/test/1.0"
ET.register_namespace("test", TEST_DRIVER_NS)

# Disk roles; local disks get fixed device names, volumes bring theirs.
ROOT = "root"
EPHEMERAL = "ephemeral"
SWAP = "swap"
VOLUME = "volume"
LOCAL_DEVICES = {ROOT: "vda", EPHEMERAL: "vdb", SWAP: "vdc"}

_FLAVOR_INT_FIELDS = ("vcpus", "memory_mb", "root_gb", "ephemeral_gb", "swap")
_FLAVOR_STR_FIELDS = ("flavorid", "name")


def guest_name(instance_uuid: str) -> str:
    """The libvirt domain name of an instance's guest."""
    return f"instance-{instance_uuid}"


def short_device(device: str) -> str:
    """A target device name without its ``/dev/`` prefix (``/dev/vdb`` -> ``vdb``)."""
    return device.removeprefix("/dev/")


@dataclass(frozen=True)
class DiskSpec:
    """One disk of a guest: a file on this host (local disk) or an attached volume's path."""

    kind: str
    path: str
    device: str
    volume_id: str | None = None
    boot: bool = False


@dataclass(frozen=True)
class PortSpec:
    """One network port of a guest."""

    port_id: str
    mac_address: str


@dataclass(frozen=True)
class GuestSpec:
    """Everything needed to define an instance's guest."""

    instance_uuid: str
    display_name: str
    flavor: dict[str, Any]
    disks: tuple[DiskSpec, ...] = ()
    ports: tuple[PortSpec, ...] = ()

    @property
    def vcpus(self) -> int:
        return int(self.flavor["vcpus"])

    @property
    def memory_mb(self) -> int:
        return int(self.flavor["memory_mb"])


@dataclass(frozen=True)
class HostCapacity:
    """What a host offers guests, before allocation ratios and reservations."""

    vcpus: int
    memory_mb: int
    disk_gb: int


class Driver(abc.ABC):
    """What the host agent needs from a hypervisor. Every method is safe to repeat."""

    @abc.abstractmethod
    def define_guest(self, spec: GuestSpec) -> None:
        """Define (or redefine, keeping the uuid) the guest of ``spec.instance_uuid``; it stays powered off.

        Raises:
            HypervisorError: the hypervisor refused the definition.
        """

    @abc.abstractmethod
    def power_on(self, instance_uuid: str) -> None:
        """Start the guest; a running guest is left alone.

        Raises:
            GuestNotFound, HypervisorError.
        """

    @abc.abstractmethod
    def power_off(self, instance_uuid: str, timeout: float = 60.0, clean_shutdown: bool = True) -> None:
        """Stop the guest: ask it to shut down, and pull the plug after ``timeout`` seconds.

        A stopped guest is left alone; ``clean_shutdown=False`` pulls the plug at once.

        Raises:
            GuestNotFound, HypervisorError.
        """

    @abc.abstractmethod
    def destroy(self, instance_uuid: str) -> None:
        """Stop and undefine the guest. An absent guest is already destroyed.

        Raises:
            HypervisorError.
        """

    @abc.abstractmethod
    def guest_exists(self, instance_uuid: str) -> bool:
        """Whether the hypervisor knows the instance's guest."""

    @abc.abstractmethod
    def guest_power_state(self, instance_uuid: str) -> int:
        """The guest's Nova power_state (RUNNING, SHUTDOWN, ...).

        Raises:
            GuestNotFound, HypervisorError.
        """

    @abc.abstractmethod
    def guest_spec(self, instance_uuid: str) -> GuestSpec:
        """The guest's current (persistent) definition as Ferry recorded it.

        Raises:
            GuestNotFound, HypervisorError.
        """

    @abc.abstractmethod
    def list_guests(self) -> list[str]:
        """The instance uuids of every guest the hypervisor knows, running or not."""

    def guest_memory_mb(self, instance_uuid: str) -> int:
        """The memory the guest is defined with, in MiB (whether or not it runs).

        Raises:
            GuestNotFound, HypervisorError.
        """
        return self.guest_spec(instance_uuid).memory_mb

    @abc.abstractmethod
    def attach_volume(self, instance_uuid: str, disk: DiskSpec) -> None:
        """Attach a volume (``disk.kind == VOLUME``); attaching it again is a no-op.

        Raises:
            GuestNotFound, HypervisorError.
        """

    @abc.abstractmethod
    def detach_volume(self, instance_uuid: str, volume_id: str) -> None:
        """Detach a volume; a volume not attached is already detached.

        Raises:
            GuestNotFound, HypervisorError.
        """

    @abc.abstractmethod
    def attach_interface(self, instance_uuid: str, port: PortSpec) -> None:
        """Plug a port into the guest; plugging it again is a no-op.

        Raises:
            GuestNotFound, HypervisorError.
        """

    @abc.abstractmethod
    def detach_interface(self, instance_uuid: str, port_id: str) -> None:
        """Unplug a port; a port not plugged is already unplugged.

        Raises:
            GuestNotFound, HypervisorError.
        """

    @abc.abstractmethod
    def host_capacity(self) -> HostCapacity:
        """The host's vCPUs, memory and instance disk space.

        Raises:
            HypervisorError.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the hypervisor connection."""


# --- libvirt ------------------------------------------------------------------------------------


def _ignore_libvirt_error(_ctx: Any, _error: Any) -> None:
    # libvirt's default handler prints every error to stderr, including the expected "no domain"
    # of a lookup; errors reach us as exceptions anyway.
    return None


libvirt.registerErrorHandler(_ignore_libvirt_error, None)


@contextmanager
def _hypervisor_errors(action: str, instance_uuid: str | None = None) -> Iterator[None]:
    try:
        yield
    except libvirt.libvirtError as exc:
        raise errors.HypervisorError(
            f"{action} failed: {exc.get_error_message() or exc}",
            action=action,
            instance_uuid=instance_uuid,
            code=exc.get_error_code(),
        ) from exc


def write_test_node_xml(path: str | os.PathLike[str], vcpus: int, memory_mb: int, keep_guests: bool = False) -> str:
    """Write a node description for libvirt's test driver and return its ``test:///`` URI.

    Each open of the URI is a fresh hypervisor with ``vcpus`` CPUs and ``memory_mb`` MiB of memory
    and no guests, unless ``keep_guests``: then the guests an earlier description holds (saved by
    a :class:`LibvirtDriver` with ``persist_test_guests``) are defined again, in the state they
    were saved in, as a real hypervisor keeps its guests when its agent restarts. The file is
    replaced atomically, so a running hypervisor never reads half of it.
    """
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    node = ET.Element("node")
    cpu = ET.SubElement(node, "cpu")
    for tag, value in (
        ("mhz", 2000),
        ("model", "x86_64"),
        ("nodes", 1),
        ("sockets", 1),
        ("cores", vcpus),
        ("threads", 1),
        ("active", vcpus),
    ):
        ET.SubElement(cpu, tag).text = str(value)
    ET.SubElement(node, "memory").text = str(memory_mb * 1024)
    if keep_guests and target.exists():
        node.extend(ET.parse(target).getroot().findall("domain"))
    _replace_file(target, ET.tostring(node))
    return f"test://{target}"


def _replace_file(target: Path, content: bytes) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "wb") as out:
        out.write(content)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)


class LibvirtDriver(Driver):
    """:class:`Driver` over a libvirt connection.

    Args:
        uri: the libvirt URI (``qemu:///system``, ``test:///<node xml>``).
        disk_path: the directory whose filesystem holds instance disks (its size is the host's disk).
        live_device_updates: attach and detach devices on running guests with libvirt's live calls.
            ``None`` chooses from the connection: the test driver cannot, so devices change there by
            redefining the persistent definition (the running guest sees them on its next boot).
        shutdown_poll_interval: how often :meth:`power_off` checks whether the guest has stopped.
        persist_test_guests: on libvirt's test driver opened from a node description file, write
            the guests and their run state back into that file after every change, so that a
            restarted agent (:func:`write_test_node_xml` with ``keep_guests``) finds them again.
            Ignored on other drivers, which keep their guests themselves.

    Raises:
        HypervisorError: the connection cannot be opened.
    """

    def __init__(
        self,
        uri: str,
        disk_path: str | os.PathLike[str] | None = None,
        live_device_updates: bool | None = None,
        shutdown_poll_interval: float = 0.5,
        persist_test_guests: bool = False,
    ) -> None:
        self.uri = uri
        self.disk_path = Path(disk_path) if disk_path is not None else None
        self.shutdown_poll_interval = shutdown_poll_interval
        self._lock = threading.RLock()
        with _hypervisor_errors("open connection"):
            self._conn = libvirt.open(uri)
            self._conn_type = self._conn.getType()
            self._domain_type, self._arch = self._guest_type()
        self.live_device_updates = (
            live_device_updates if live_device_updates is not None else self._conn_type.upper() != "TEST"
        )
        node_file = uri[len("test://") :] if uri.startswith("test:///") else ""
        self._test_node_file = (
            Path(node_file)
            if persist_test_guests and self._conn_type.upper() == "TEST" and node_file != "/default"
            else None
        )

    def _save_test_guests(self) -> None:
        """Write the guests and their run state into the test node description (``persist_test_guests``)."""
        if self._test_node_file is None:
            return
        with self._lock, _hypervisor_errors("save the test hypervisor's guests"):
            node = ET.parse(self._test_node_file).getroot()
            for old in node.findall("domain"):
                node.remove(old)
            for dom in self._conn.listAllDomains():
                domain = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
                ET.SubElement(domain, f"{{{TEST_DRIVER_NS}}}runstate").text = str(dom.state()[0])
                node.append(domain)
            _replace_file(self._test_node_file, ET.tostring(node))

    # -- connection and lookups

    @property
    def connection(self) -> libvirt.virConnect:
        """The open libvirt connection (reopened if a remote daemon dropped it)."""
        with self._lock:
            # The test driver's state lives in the connection: never reopen it.
            if self._conn_type.upper() != "TEST" and not self._conn.isAlive():
                with _hypervisor_errors("reopen connection"):
                    self._conn = libvirt.open(self.uri)
            return self._conn

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except libvirt.libvirtError:
                pass

    def _guest_type(self) -> tuple[str, str | None]:
        """The domain type and architecture for hvm guests, from the hypervisor's capabilities."""
        caps = ET.fromstring(self._conn.getCapabilities())
        host_arch = caps.findtext("host/cpu/arch")
        candidates: list[tuple[str, str | None]] = []
        for guest in caps.findall("guest"):
            if guest.findtext("os_type") != "hvm":
                continue
            arch = guest.find("arch")
            if arch is None:
                continue
            arch_name = arch.get("name")
            for domain in arch.findall("domain"):
                domain_type = domain.get("type")
                if domain_type:
                    candidates.append((domain_type, arch_name))
        if not candidates:
            return self._conn_type.lower(), None
        preferred = [c for c in candidates if c[1] == host_arch] or candidates
        for domain_type, arch_name in preferred:
            if domain_type == "kvm":
                return domain_type, arch_name
        return preferred[0]

    def _lookup(self, instance_uuid: str) -> libvirt.virDomain | None:
        try:
            return self.connection.lookupByUUIDString(instance_uuid)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise errors.HypervisorError(
                f"lookup failed: {exc.get_error_message() or exc}",
                instance_uuid=instance_uuid,
                code=exc.get_error_code(),
            ) from exc

    def _domain(self, instance_uuid: str) -> libvirt.virDomain:
        dom = self._lookup(instance_uuid)
        if dom is None:
            raise errors.GuestNotFound(
                f"No guest for instance {instance_uuid} on this host.", instance_uuid=instance_uuid
            )
        return dom

    # -- guest XML

    def guest_xml(self, spec: GuestSpec) -> str:
        """The libvirt domain XML for ``spec``."""
        domain = ET.Element("domain", type=self._domain_type)
        ET.SubElement(domain, "name").text = guest_name(spec.instance_uuid)
        ET.SubElement(domain, "uuid").text = spec.instance_uuid
        if spec.display_name:
            # A title must be one line.
            ET.SubElement(domain, "title").text = " ".join(spec.display_name.split())
        metadata = ET.SubElement(domain, "metadata")
        metadata.append(_metadata_element(spec))
        ET.SubElement(domain, "memory", unit="MiB").text = str(spec.memory_mb)
        ET.SubElement(domain, "vcpu").text = str(spec.vcpus)
        os_el = ET.SubElement(domain, "os")
        os_type = ET.SubElement(os_el, "type")
        os_type.text = "hvm"
        if self._arch:
            os_type.set("arch", self._arch)
        if self._domain_type != "test":
            features = ET.SubElement(domain, "features")
            ET.SubElement(features, "acpi")
            ET.SubElement(features, "apic")
        ET.SubElement(domain, "on_poweroff").text = "destroy"
        ET.SubElement(domain, "on_reboot").text = "restart"
        ET.SubElement(domain, "on_crash").text = "destroy"
        devices = ET.SubElement(domain, "devices")
        for disk in spec.disks:
            devices.append(_disk_element(disk))
        for port in spec.ports:
            devices.append(_interface_element(port))
        return ET.tostring(domain, encoding="unicode")

    # -- Driver

    def define_guest(self, spec: GuestSpec) -> None:
        _check_devices(spec)
        with self._lock, _hypervisor_errors("define guest", spec.instance_uuid):
            self.connection.defineXML(self.guest_xml(spec))
        self._save_test_guests()

    def power_on(self, instance_uuid: str) -> None:
        with self._lock:
            dom = self._domain(instance_uuid)
            with _hypervisor_errors("power on", instance_uuid):
                if not dom.isActive():
                    dom.create()
        self._save_test_guests()

    def power_off(self, instance_uuid: str, timeout: float = 60.0, clean_shutdown: bool = True) -> None:
        dom = self._domain(instance_uuid)
        with _hypervisor_errors("power off", instance_uuid):
            if not dom.isActive():
                return
            if clean_shutdown:
                dom.shutdown()
                deadline = time.monotonic() + timeout
                while dom.isActive() and time.monotonic() < deadline:
                    time.sleep(self.shutdown_poll_interval)
            if dom.isActive():
                dom.destroy()
        self._save_test_guests()

    def destroy(self, instance_uuid: str) -> None:
        with self._lock:
            dom = self._lookup(instance_uuid)
            if dom is None:
                return
            with _hypervisor_errors("destroy", instance_uuid):
                if dom.isActive():
                    dom.destroy()
                self._undefine(dom)
        self._save_test_guests()

    @staticmethod
    def _undefine(dom: libvirt.virDomain) -> None:
        # Drivers accept different undefine flags (the test driver refuses NVRAM and checkpoints):
        # use the most thorough set the driver takes.
        basic = libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
        thorough = basic | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM | libvirt.VIR_DOMAIN_UNDEFINE_CHECKPOINTS_METADATA
        try:
            dom.undefineFlags(thorough)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() not in (libvirt.VIR_ERR_INVALID_ARG, libvirt.VIR_ERR_NO_SUPPORT):
                raise
            dom.undefineFlags(basic)

    def guest_exists(self, instance_uuid: str) -> bool:
        return self._lookup(instance_uuid) is not None

    def guest_power_state(self, instance_uuid: str) -> int:
        dom = self._domain(instance_uuid)
        with _hypervisor_errors("read power state", instance_uuid):
            state, _reason = dom.state()
        return _POWER_STATE_BY_LIBVIRT_STATE.get(state, NOSTATE)

    def guest_spec(self, instance_uuid: str) -> GuestSpec:
        dom = self._domain(instance_uuid)
        with _hypervisor_errors("read guest definition", instance_uuid):
            root = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        return _spec_from_xml(root, instance_uuid)

    def list_guests(self) -> list[str]:
        with _hypervisor_errors("list guests"):
            return sorted(dom.UUIDString() for dom in self.connection.listAllDomains())

    def guest_memory_mb(self, instance_uuid: str) -> int:
        # From the definition itself, so guests Ferry did not define count too.
        dom = self._domain(instance_uuid)
        with _hypervisor_errors("read guest memory", instance_uuid):
            return int(dom.maxMemory()) // 1024

    def attach_volume(self, instance_uuid: str, disk: DiskSpec) -> None:
        if disk.kind != VOLUME or not disk.volume_id:
            raise errors.InvalidOperation("Only volumes can be attached to a guest.", instance_uuid=instance_uuid)
        with self._lock:
            spec = self.guest_spec(instance_uuid)
            if any(d.volume_id == disk.volume_id for d in spec.disks):
                return
            new_spec = replace(spec, disks=spec.disks + (disk,))
            _check_devices(new_spec)
            self._change_device(
                instance_uuid, new_spec, ET.tostring(_disk_element(disk), encoding="unicode"), attach=True
            )

    def detach_volume(self, instance_uuid: str, volume_id: str) -> None:
        with self._lock:
            spec = self.guest_spec(instance_uuid)
            found = [d for d in spec.disks if d.volume_id == volume_id]
            if not found:
                return
            new_spec = replace(spec, disks=tuple(d for d in spec.disks if d.volume_id != volume_id))
            self._change_device(
                instance_uuid, new_spec, ET.tostring(_disk_element(found[0]), encoding="unicode"), attach=False
            )

    def attach_interface(self, instance_uuid: str, port: PortSpec) -> None:
        with self._lock:
            spec = self.guest_spec(instance_uuid)
            if any(p.port_id == port.port_id for p in spec.ports):
                return
            new_spec = replace(spec, ports=spec.ports + (port,))
            self._change_device(
                instance_uuid, new_spec, ET.tostring(_interface_element(port), encoding="unicode"), attach=True
            )

    def detach_interface(self, instance_uuid: str, port_id: str) -> None:
        with self._lock:
            spec = self.guest_spec(instance_uuid)
            found = [p for p in spec.ports if p.port_id == port_id]
            if not found:
                return
            new_spec = replace(spec, ports=tuple(p for p in spec.ports if p.port_id != port_id))
            self._change_device(
                instance_uuid, new_spec, ET.tostring(_interface_element(found[0]), encoding="unicode"), attach=False
            )

    def _change_device(self, instance_uuid: str, new_spec: GuestSpec, device_xml: str, attach: bool) -> None:
        dom = self._domain(instance_uuid)
        action = "attach device" if attach else "detach device"
        with _hypervisor_errors(action, instance_uuid):
            active = bool(dom.isActive())
            if self.live_device_updates:
                flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG | (libvirt.VIR_DOMAIN_AFFECT_LIVE if active else 0)
                if attach:
                    dom.attachDeviceFlags(device_xml, flags)
                else:
                    dom.detachDeviceFlags(device_xml, flags)
                dom.setMetadata(
                    libvirt.VIR_DOMAIN_METADATA_ELEMENT,
                    ET.tostring(_metadata_element(new_spec), encoding="unicode"),
                    METADATA_PREFIX,
                    METADATA_NS,
                    flags,
                )
            else:
                self._redefine(dom, new_spec, device_xml, attach)
        self._save_test_guests()

    def _redefine(self, dom: libvirt.virDomain, new_spec: GuestSpec, device_xml: str, attach: bool) -> None:
        """Edit the persistent definition in place (keeping the uuid and everything libvirt added)."""
        root = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        devices = root.find("devices")
        if devices is None:
            devices = ET.SubElement(root, "devices")
        device = ET.fromstring(device_xml)
        if attach:
            devices.append(device)
        else:
            for existing in list(devices):
                if _same_device(existing, device):
                    devices.remove(existing)
        metadata = root.find("metadata")
        if metadata is None:
            metadata = ET.SubElement(root, "metadata")
        for old in metadata.findall(f"{{{METADATA_NS}}}instance"):
            metadata.remove(old)
        metadata.append(_metadata_element(new_spec))
        self.connection.defineXML(ET.tostring(root, encoding="unicode"))

    def host_capacity(self) -> HostCapacity:
        with _hypervisor_errors("read host capacity"):
            _model, memory_mb, cpus, *_rest = self.connection.getInfo()
        disk_gb = 0
        if self.disk_path is not None:
            self.disk_path.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(self.disk_path)
            disk_gb = st.f_blocks * st.f_frsize // 2**30
        return HostCapacity(vcpus=int(cpus), memory_mb=int(memory_mb), disk_gb=int(disk_gb))


# --- XML helpers --------------------------------------------------------------------------------


def _check_devices(spec: GuestSpec) -> None:
    seen: set[str] = set()
    for disk in spec.disks:
        dev = short_device(disk.device)
        if dev in seen:
            raise errors.InvalidOperation(
                f"Two disks of instance {spec.instance_uuid} use device {dev}.", instance_uuid=spec.instance_uuid
            )
        seen.add(dev)


def _disk_element(disk: DiskSpec) -> ET.Element:
    el = ET.Element("disk", type="file", device="disk")
    ET.SubElement(el, "driver", name="qemu", type="raw", cache="none")
    ET.SubElement(el, "source", file=disk.path)
    ET.SubElement(el, "target", dev=short_device(disk.device), bus="virtio")
    if disk.volume_id:
        # The serial is how a guest (and an operator) tells which volume is which.
        ET.SubElement(el, "serial").text = disk.volume_id
    if disk.boot:
        ET.SubElement(el, "boot", order="1")
    return el


def _interface_element(port: PortSpec) -> ET.Element:
    el = ET.Element("interface", type="ethernet")
    ET.SubElement(el, "mac", address=port.mac_address)
    ET.SubElement(el, "model", type="virtio")
    return el


def _same_device(existing: ET.Element, wanted: ET.Element) -> bool:
    if existing.tag != wanted.tag:
        return False
    if wanted.tag == "disk":
        target, wanted_target = existing.find("target"), wanted.find("target")
        return target is not None and wanted_target is not None and target.get("dev") == wanted_target.get("dev")
    if wanted.tag == "interface":
        mac, wanted_mac = existing.find("mac"), wanted.find("mac")
        return (
            mac is not None
            and wanted_mac is not None
            and (mac.get("address") or "").lower() == (wanted_mac.get("address") or "").lower()
        )
    return False


def _q(tag: str) -> str:
    return f"{{{METADATA_NS}}}{tag}"


def _metadata_element(spec: GuestSpec) -> ET.Element:
    inst = ET.Element(_q("instance"))
    ET.SubElement(inst, _q("uuid")).text = spec.instance_uuid
    ET.SubElement(inst, _q("name")).text = spec.display_name
    flavor = ET.SubElement(inst, _q("flavor"))
    for key in _FLAVOR_STR_FIELDS + _FLAVOR_INT_FIELDS:
        if key in spec.flavor:
            flavor.set(key, str(spec.flavor[key]))
    disks = ET.SubElement(inst, _q("disks"))
    for disk in spec.disks:
        attrs = {"kind": disk.kind, "device": short_device(disk.device), "path": disk.path}
        if disk.volume_id:
            attrs["volume_id"] = disk.volume_id
        if disk.boot:
            attrs["boot"] = "true"
        ET.SubElement(disks, _q("disk"), attrs)
    ports = ET.SubElement(inst, _q("ports"))
    for port in spec.ports:
        ET.SubElement(ports, _q("port"), id=port.port_id, mac_address=port.mac_address)
    return inst


def _spec_from_xml(root: ET.Element, instance_uuid: str) -> GuestSpec:
    inst = root.find(f"metadata/{_q('instance')}")
    if inst is None:
        raise errors.HypervisorError(
            f"The guest of instance {instance_uuid} has no Ferry metadata.", instance_uuid=instance_uuid
        )
    flavor: dict[str, Any] = {}
    flavor_el = inst.find(_q("flavor"))
    if flavor_el is not None:
        for key in _FLAVOR_STR_FIELDS:
            if key in flavor_el.attrib:
                flavor[key] = flavor_el.attrib[key]
        for key in _FLAVOR_INT_FIELDS:
            if key in flavor_el.attrib:
                flavor[key] = int(flavor_el.attrib[key])
    disks = tuple(
        DiskSpec(
            kind=el.get("kind", VOLUME),
            path=el.get("path", ""),
            device=el.get("device", ""),
            volume_id=el.get("volume_id"),
            boot=el.get("boot") == "true",
        )
        for el in inst.findall(f"{_q('disks')}/{_q('disk')}")
    )
    ports = tuple(
        PortSpec(port_id=el.get("id", ""), mac_address=el.get("mac_address", ""))
        for el in inst.findall(f"{_q('ports')}/{_q('port')}")
    )
    return GuestSpec(
        instance_uuid=instance_uuid,
        display_name=inst.findtext(_q("name")) or "",
        flavor=flavor,
        disks=disks,
        ports=ports,
    )
