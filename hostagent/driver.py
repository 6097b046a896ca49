"""The hypervisor driver: what the host agent asks of a hypervisor, and its libvirt implementation.

The agent talks to :class:`Driver` only. :class:`LibvirtDriver` implements it over a libvirt URI:
``qemu:///system`` on a real hypervisor, ``test:///<absolute path to a node XML>`` on one machine
(each open of such a URI is a fresh, independent hypervisor; :func:`write_test_node_xml` writes one).

A guest is named ``instance-<uuid>`` and carries the instance uuid as its libvirt ``<uuid>``. Its
``<metadata>`` holds a ``ferry:instance`` element (namespace :data:`METADATA_NS`) recording the
instance's display name, flavor, local disks, volumes and ports, so the host can tell what each
guest is without asking the database.

Every libvirt failure surfaces as :class:`ferry.errors.HypervisorError`; an operation on a guest
the hypervisor does not know raises :class:`ferry.errors.GuestNotFound`. A call that finds the
connection dropped (libvirtd restarted) is made once more on a new connection.

Disks are raw, on virtio: a block device (a volume's path, usually) as ``type='block'``, anything
else as a file; with ``cache='none'`` where the storage takes O_DIRECT and ``writethrough`` where
it does not. Guests get ``<cpu mode=...>`` (``cpu_mode``), and ports are plugged into
``port_bridge`` as Open vSwitch or Linux bridge ports on a tap device named after the port.
"""

from __future__ import annotations

import abc
import functools
import mmap
import os
import stat
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import libvirt

from ferry import errors
from ferry.observability import logger

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

# Guests that cannot act on a shutdown request (libvirt refuses one unless the guest runs): a
# power off pulls their plug at once.
_DEAF_TO_SHUTDOWN = frozenset({libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PMSUSPENDED})

METADATA_NS = "urn:ferry:instance:1"
METADATA_PREFIX = "ferry"
ET.register_namespace(METADATA_PREFIX, METADATA_NS)
# libvirt's test driver reads a guest's run state from this namespace in its node description.
TEST_DRIVER_NS = "http://libvirt.org/schemas/domain/test/1.0"
ET.register_namespace("test", TEST_DRIVER_NS)

# Disk roles; local disks get fixed device names (moved around a volume's: place_local_disks), volumes bring theirs.
ROOT = "root"
EPHEMERAL = "ephemeral"
SWAP = "swap"
VOLUME = "volume"
LOCAL_DEVICES = {ROOT: "vda", EPHEMERAL: "vdb", SWAP: "vdc"}

# How a guest sees the host's CPU, written as ``<cpu mode='...'/>``; "none" writes no ``<cpu>``
# element (KVM then gives the guest QEMU's generic qemu64 model).
CPU_MODES = ("host-model", "host-passthrough", "none")
# How a port is plugged into the bridge named by ``port_bridge``: an Open vSwitch port carrying
# the port id (what an OVS agent looks for), or a port of a Linux bridge.
PORT_VIF_TYPES = ("ovs", "bridge")

_FLAVOR_INT_FIELDS = ("vcpus", "memory_mb", "root_gb", "ephemeral_gb", "swap")
_FLAVOR_STR_FIELDS = ("flavorid", "name")


def guest_name(instance_uuid: str) -> str:
    """The libvirt domain name of an instance's guest."""
    return f"instance-{instance_uuid}"


def tap_device(port_id: str) -> str:
    """The host's tap device of a port: ``tap`` and the port id's first 11 characters (15 at most, as Linux allows)."""
    return f"tap{port_id[:11]}"


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


def place_local_disks(guest_disks: list[DiskSpec]) -> tuple[DiskSpec, ...]:
    """``guest_disks`` with each local disk whose device (:data:`LOCAL_DEVICES`) a volume uses (a
    root volume booted as ``vdb``, say) moved to the lowest ``vdX`` free, as Nova's libvirt driver
    places local disks around the root device; the same volumes always give the same places."""
    taken = {short_device(d.device) for d in guest_disks if d.kind == VOLUME}
    placed = []
    for disk in guest_disks:
        if disk.kind != VOLUME and short_device(disk.device) in taken:
            free = next(f"vd{letter}" for letter in "abcdefghijklmnopqrstuvwxyz" if f"vd{letter}" not in taken)
            disk = replace(disk, device=free)
        if disk.kind != VOLUME:
            taken.add(short_device(disk.device))
        placed.append(disk)
    return tuple(placed)


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


@dataclass(frozen=True)
class CallUnderWay:
    """A driver call that has not returned: its method, how long it has run, and how long it may
    take by what it was asked (a power-off's ``timeout``) before it counts as hung."""

    method: str
    seconds: float
    allowed: float


class Driver(abc.ABC):
    """What the host agent needs from a hypervisor. Every method is safe to repeat."""

    def calls_under_way(self) -> list[CallUnderWay]:
        """The calls into the hypervisor that have not returned yet (none known by default)."""
        return []

    @abc.abstractmethod
    def define_guest(self, spec: GuestSpec) -> None:
        """Define (or redefine, keeping the uuid) the guest of ``spec.instance_uuid``; it stays powered off.

        Raises:
            HypervisorError: the hypervisor refused the definition.
        """

    @abc.abstractmethod
    def power_on(self, instance_uuid: str) -> None:
        """Start the guest; a paused guest is resumed, a suspended one woken, a running one left alone.

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
        """Detach a volume; a volume not attached, or a guest that does not exist, is already detached.

        Raises:
            HypervisorError.
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


# Messages of libvirt's RPC client once the daemon has gone away (libvirtd restarted).
_CONNECTION_LOST_MESSAGES = ("End of file", "client socket is closed")


def _libvirt_cause(exc: BaseException) -> libvirt.libvirtError | None:
    """The libvirt error behind ``exc`` (itself, or the cause of a :class:`HypervisorError`)."""
    if isinstance(exc, libvirt.libvirtError):
        return exc
    cause = exc.__cause__
    return cause if isinstance(cause, libvirt.libvirtError) else None


def _is_connection_error(exc: libvirt.libvirtError) -> bool:
    """Whether ``exc`` says the connection to the daemon is gone, rather than the call failing.

    Only errors of the RPC layer count: QEMU's own "End of file from qemu monitor" (the guest's
    process died) is a failed call on a working connection.
    """
    if exc.get_error_domain() not in (libvirt.VIR_FROM_RPC, libvirt.VIR_FROM_REMOTE):
        return False
    if exc.get_error_code() == libvirt.VIR_ERR_SYSTEM_ERROR:
        return True
    message = exc.get_error_message() or str(exc)
    return any(lost in message for lost in _CONNECTION_LOST_MESSAGES)


_REOPEN = "reopen connection"


def _failed_reopening(exc: BaseException) -> bool:
    """Whether ``exc`` is the failure to reopen the connection (the daemon is still down): no use trying again."""
    return isinstance(exc, errors.HypervisorError) and exc.details.get("action") == _REOPEN


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _reconnecting(
    method: Callable[Concatenate[LibvirtDriver, _P], _R],
) -> Callable[Concatenate[LibvirtDriver, _P], _R]:
    """Run a driver call again, once, on a new connection when the daemon dropped the old one.

    A restarted libvirtd leaves the agent holding a dead connection whose next call fails; the
    call is repeated from the start (every call looks its guest up again, so no handle of the old
    connection survives). Calls made from within a call are not repeated on their own.
    """

    @functools.wraps(method)
    def call(self: LibvirtDriver, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if getattr(self._calls, "active", False):
            return method(self, *args, **kwargs)
        self._calls.active = True
        thread = threading.get_ident()
        timeout = kwargs.get("timeout")
        allowed = float(timeout) if isinstance(timeout, int | float) else 0.0
        with self._under_way_guard:
            self._under_way[thread] = (method.__name__, time.monotonic(), allowed)
        try:
            used = self._conn
            try:
                return method(self, *args, **kwargs)
            except (errors.HypervisorError, libvirt.libvirtError) as exc:
                if not self._connection_lost(exc) or _failed_reopening(exc):
                    raise
                self._reconnect(stale=used)
            with self._under_way_guard:  # the call begins again, on the new connection
                self._under_way[thread] = (method.__name__, time.monotonic(), allowed)
            return method(self, *args, **kwargs)
        finally:
            self._calls.active = False
            with self._under_way_guard:
                self._under_way.pop(thread, None)

    return call


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


@dataclass
class _GuestLock:
    """The lock of one guest, and how many calls hold or wait for it (it goes when none does)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    users: int = 0


class LibvirtDriver(Driver):
    """:class:`Driver` over a libvirt connection.

    Args:
        uri: the libvirt URI (``qemu:///system``, ``test:///<node xml>``).
        disk_path: the directory whose filesystem holds instance disks (its size is the host's disk).
        live_device_updates: attach and detach devices on running guests with libvirt's live calls.
            ``None`` chooses from the connection: the test driver cannot, so devices change there by
            redefining the persistent definition (the running guest sees them on its next boot).
        shutdown_poll_interval: how often :meth:`power_off` checks whether the guest has stopped,
            and :meth:`power_on` whether a guest shutting down has.
        shutting_down_wait: seconds :meth:`power_on` waits for a guest that is shutting down
            (still active) to stop before it starts it again.
        persist_test_guests: on libvirt's test driver opened from a node description file, write
            the guests and their run state back into that file after every change, so that a
            restarted agent (:func:`write_test_node_xml` with ``keep_guests``) finds them again.
            Ignored on other drivers, which keep their guests themselves.
        cpu_mode: the CPU guests see, one of :data:`CPU_MODES`: ``host-model`` (the host's CPU
            model and features, still migratable between like hosts), ``host-passthrough`` (the
            host CPU exactly; moves only between identical hosts), ``none`` (no ``<cpu>`` element).
        port_bridge: the bridge ports are plugged into. ``None`` defines them as ``ethernet``
            interfaces: a tap device no bridge knows of, which is all the test driver needs.
        port_vif_type: how a port joins ``port_bridge``, one of :data:`PORT_VIF_TYPES`.
        shutdown_retry_interval: seconds between the shutdown requests :meth:`power_off` sends
            while it waits (a guest still booting, or busy, can miss one).
        destroy_attempts: how many times :meth:`power_off` and :meth:`destroy` try to stop a guest
            that libvirt failed to stop with a system error (QEMU slow to exit).
        destroy_retry_interval: seconds between those attempts.
        device_detach_attempts: how many detach requests a device of a running guest is sent before
            the detach fails (the guest must release the device; it may ignore a request).
        device_detach_timeout: seconds each request waits for the device to leave the running guest.
        device_poll_interval: how often the running guest's definition is read while waiting.

    Raises:
        HypervisorError: the connection cannot be opened.
        ValueError: an unknown ``cpu_mode`` or ``port_vif_type``.
    """

    def __init__(
        self,
        uri: str,
        disk_path: str | os.PathLike[str] | None = None,
        live_device_updates: bool | None = None,
        shutdown_poll_interval: float = 0.5,
        persist_test_guests: bool = False,
        *,
        cpu_mode: str = "host-model",
        port_bridge: str | None = None,
        port_vif_type: str = "ovs",
        shutdown_retry_interval: float = 10.0,
        destroy_attempts: int = 3,
        destroy_retry_interval: float = 1.0,
        device_detach_attempts: int = 3,
        device_detach_timeout: float = 10.0,
        device_poll_interval: float = 0.5,
        shutting_down_wait: float = 10.0,
    ) -> None:
        if cpu_mode not in CPU_MODES:
            raise ValueError(f"cpu_mode must be one of {', '.join(CPU_MODES)}, not {cpu_mode!r}.")
        if port_vif_type not in PORT_VIF_TYPES:
            raise ValueError(f"port_vif_type must be one of {', '.join(PORT_VIF_TYPES)}, not {port_vif_type!r}.")
        self.uri = uri
        self.disk_path = Path(os.path.abspath(disk_path)) if disk_path is not None else None
        self.shutdown_poll_interval = shutdown_poll_interval
        self.cpu_mode = cpu_mode
        self.port_bridge = port_bridge or None
        self.port_vif_type = port_vif_type
        self.shutdown_retry_interval = shutdown_retry_interval
        self.destroy_attempts = max(1, destroy_attempts)
        self.destroy_retry_interval = destroy_retry_interval
        self.device_detach_attempts = max(1, device_detach_attempts)
        self.device_detach_timeout = device_detach_timeout
        self.device_poll_interval = device_poll_interval
        self.shutting_down_wait = shutting_down_wait
        # Held only to swap the connection (reopen, close), never across a call on it: a driver call
        # that waits (a guest slow to release a device or to stop) must not stall the others.
        self._lock = threading.RLock()
        # One lock per guest being changed (_guest_lock), so that one guest's changes never interleave.
        self._guest_locks: dict[str, _GuestLock] = {}
        self._guest_locks_guard = threading.Lock()
        # Writers of the test node description (persist_test_guests), one at a time.
        self._save_lock = threading.Lock()
        # Whether O_DIRECT works, by directory holding disk files (see _cache_mode).
        self._direct_io: dict[Path, bool] = {}
        # Per thread: whether a driver call is running, so that only the outermost one is repeated
        # after a reconnection.
        self._calls = threading.local()
        # The outermost calls running, by thread: (method, when it began, seconds it may take).
        self._under_way: dict[int, tuple[str, float, float]] = {}
        self._under_way_guard = threading.Lock()
        with _hypervisor_errors("open connection"):
            self._conn = libvirt.open(uri)
            self._conn_type = self._conn.getType()
            self._domain_type, self._arch = self._guest_type()
        # The test driver's state lives in its connection: it is never reopened.
        self._is_test = self._conn_type.upper() == "TEST"
        self.live_device_updates = live_device_updates if live_device_updates is not None else not self._is_test
        node_file = uri[len("test://") :] if uri.startswith("test:///") else ""
        self._test_node_file = (
            Path(node_file) if persist_test_guests and self._is_test and node_file != "/default" else None
        )

    def _save_test_guests(self) -> None:
        """Write the guests and their run state into the test node description (``persist_test_guests``)."""
        if self._test_node_file is None:
            return
        with self._save_lock, _hypervisor_errors("save the test hypervisor's guests"):
            node = ET.parse(self._test_node_file).getroot()
            for old in node.findall("domain"):
                node.remove(old)
            for dom in self._conn.listAllDomains():
                domain = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
                ET.SubElement(domain, f"{{{TEST_DRIVER_NS}}}runstate").text = str(dom.state()[0])
                node.append(domain)
            _replace_file(self._test_node_file, ET.tostring(node))

    def calls_under_way(self) -> list[CallUnderWay]:
        """Every driver call running now (the outermost of each thread), oldest first."""
        now = time.monotonic()
        with self._under_way_guard:
            running = sorted(self._under_way.values(), key=lambda call: call[1])
        return [CallUnderWay(method, now - began, allowed) for method, began, allowed in running]

    # -- connection and lookups

    @property
    def connection(self) -> libvirt.virConnect:
        """The open libvirt connection (reopened if the daemon dropped it)."""
        with self._lock:
            if not self._is_test and not self._alive():
                self._reconnect()
            return self._conn

    def _alive(self) -> bool:
        try:
            return bool(self._conn.isAlive())
        except libvirt.libvirtError:
            return False

    def _connection_lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` (a libvirt error, or a HypervisorError caused by one) means the connection is gone."""
        if self._is_test:
            return False
        cause = _libvirt_cause(exc)
        if cause is None:
            return False
        return _is_connection_error(cause) or not self._alive()

    def _reconnect(self, stale: libvirt.virConnect | None = None) -> None:
        """Close the (dead) connection and open a new one; domain handles of the old one are void.

        Args:
            stale: the connection a call found gone; when another thread has replaced it already,
                the new one is kept (it may be in use).
        """
        with self._lock:
            if stale is not None and self._conn is not stale:
                return
            self.close()
            with _hypervisor_errors(_REOPEN):
                self._conn = libvirt.open(self.uri)

    @contextmanager
    def _guest_lock(self, instance_uuid: str) -> Iterator[None]:
        """Hold the guest ``instance_uuid`` for a change made of several libvirt calls (reading its
        definition, then changing it); other guests' calls and every read go on meanwhile."""
        with self._guest_locks_guard:
            held = self._guest_locks.setdefault(instance_uuid, _GuestLock())
            held.users += 1
        try:
            with held.lock:
                yield
        finally:
            with self._guest_locks_guard:
                held.users -= 1
                if not held.users:
                    del self._guest_locks[instance_uuid]

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
        if self.cpu_mode != "none":
            # Without it KVM offers the guest QEMU's generic qemu64 CPU, lacking most host features.
            ET.SubElement(domain, "cpu", mode=self.cpu_mode)
        ET.SubElement(domain, "on_poweroff").text = "destroy"
        ET.SubElement(domain, "on_reboot").text = "restart"
        ET.SubElement(domain, "on_crash").text = "destroy"
        devices = ET.SubElement(domain, "devices")
        for disk in spec.disks:
            devices.append(self.disk_element(disk))
        for port in spec.ports:
            devices.append(self.interface_element(port))
        return ET.tostring(domain, encoding="unicode")

    def disk_element(self, disk: DiskSpec) -> ET.Element:
        """The ``<disk>`` of ``disk``: a block device (``type='block'``) or a file, raw, on virtio."""
        block = _is_block_device(disk.path)
        el = ET.Element("disk", type="block" if block else "file", device="disk")
        ET.SubElement(el, "driver", name="qemu", type="raw", cache=self._cache_mode(disk.path, block))
        # QEMU refuses a block device given as a file.
        ET.SubElement(el, "source", {"dev" if block else "file": disk.path})
        ET.SubElement(el, "target", dev=short_device(disk.device), bus="virtio")
        if disk.volume_id:
            # The serial is how a guest (and an operator) tells which volume is which.
            ET.SubElement(el, "serial").text = disk.volume_id
        if disk.boot:
            ET.SubElement(el, "boot", order="1")
        return el

    def interface_element(self, port: PortSpec) -> ET.Element:
        """The ``<interface>`` of ``port``, plugged as ``port_bridge`` and ``port_vif_type`` say."""
        el = ET.Element("interface", type="ethernet" if self.port_bridge is None else "bridge")
        ET.SubElement(el, "mac", address=port.mac_address)
        if self.port_bridge is not None:
            ET.SubElement(el, "source", bridge=self.port_bridge)
            if self.port_vif_type == "ovs":
                # The interface id is how the network agent finds the port behind the tap.
                virtualport = ET.SubElement(el, "virtualport", type="openvswitch")
                ET.SubElement(virtualport, "parameters", interfaceid=port.port_id)
        ET.SubElement(el, "target", dev=tap_device(port.port_id))
        ET.SubElement(el, "model", type="virtio")
        return el

    def _cache_mode(self, path: str, block: bool) -> str:
        """``none`` (O_DIRECT, no host page cache) where the disk's storage takes it, else ``writethrough``."""
        if block:
            return "none"
        directory = Path(os.path.abspath(path)).parent
        if self.disk_path is not None and directory.is_relative_to(self.disk_path):
            directory = self.disk_path
        direct = self._direct_io.get(directory)
        if direct is None:  # two calls probing at once find the same
            direct = self._direct_io[directory] = _supports_direct_io(directory)
        return "none" if direct else "writethrough"

    # -- Driver

    @_reconnecting
    def define_guest(self, spec: GuestSpec) -> None:
        _check_devices(spec)
        with self._guest_lock(spec.instance_uuid), _hypervisor_errors("define guest", spec.instance_uuid):
            self.connection.defineXML(self.guest_xml(spec))
        self._save_test_guests()

    @_reconnecting
    def power_on(self, instance_uuid: str) -> None:
        """Start the guest; a paused guest is resumed and a suspended (S3) one woken; a running one is left alone.

        A guest shutting down (still active, but on its way off) is waited for, up to
        ``shutting_down_wait`` seconds, then started again: left alone, it would end off.

        Raises:
            GuestNotFound, HypervisorError (also: the guest shutting down did not stop in time).
        """
        with self._guest_lock(instance_uuid):
            dom = self._domain(instance_uuid)
            with _hypervisor_errors("power on", instance_uuid):
                state, _reason = dom.state()
                if state == libvirt.VIR_DOMAIN_SHUTDOWN:
                    self._wait_shut_down(dom, instance_uuid)
                if state == libvirt.VIR_DOMAIN_PAUSED:
                    dom.resume()
                elif state == libvirt.VIR_DOMAIN_PMSUSPENDED:
                    dom.pMWakeup(0)
                elif not dom.isActive():
                    try:
                        dom.create()
                    except libvirt.libvirtError as exc:
                        # Started by someone else since isActive().
                        if exc.get_error_code() != libvirt.VIR_ERR_OPERATION_INVALID or not dom.isActive():
                            raise
        self._save_test_guests()

    def _wait_shut_down(self, dom: libvirt.virDomain, instance_uuid: str) -> None:
        """Wait for a guest shutting down to stop, up to ``shutting_down_wait`` seconds.

        Raises:
            HypervisorError: it is still active then.
        """
        deadline = time.monotonic() + self.shutting_down_wait
        while dom.isActive():
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.HypervisorError(
                    f"power on failed: the guest is shutting down and did not stop within "
                    f"{self.shutting_down_wait:g} s",
                    action="power on",
                    instance_uuid=instance_uuid,
                )
            time.sleep(max(0.0, min(self.shutdown_poll_interval, left)))

    @_reconnecting
    def power_off(self, instance_uuid: str, timeout: float = 60.0, clean_shutdown: bool = True) -> None:
        """Stop the guest: ask it to shut down (again every ``shutdown_retry_interval``), then pull the plug.

        The plug is pulled after ``timeout`` seconds. A stopped guest is left alone;
        ``clean_shutdown=False`` pulls the plug at once, and so does a paused or suspended (S3)
        guest, which cannot react to the request (libvirt takes one only from a running guest),
        and one libvirt refuses the request for (paused or suspended meanwhile). A guest that
        stops by itself meanwhile is stopped as asked.

        Raises:
            GuestNotFound, HypervisorError.
        """
        dom = self._domain(instance_uuid)
        with _hypervisor_errors("power off", instance_uuid):
            state, _reason = dom.state()
            if not dom.isActive():
                return
            if clean_shutdown and state not in _DEAF_TO_SHUTDOWN:
                self._shut_down(dom, timeout)
            if dom.isActive():
                self._force_off(dom)
        self._save_test_guests()

    def _shut_down(self, dom: libvirt.virDomain, timeout: float) -> None:
        """Request a shutdown, again every ``shutdown_retry_interval``, until the guest stops or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        next_request = time.monotonic()
        while True:
            if time.monotonic() >= next_request:
                if not self._request_shutdown(dom):
                    return
                next_request = time.monotonic() + self.shutdown_retry_interval
            if not dom.isActive():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(max(0.0, min(self.shutdown_poll_interval, left, next_request - time.monotonic())))

    @staticmethod
    def _request_shutdown(dom: libvirt.virDomain) -> bool:
        """Send the guest a shutdown request; False if it had stopped already, or cannot take one
        (libvirt says the operation is invalid for it: paused or suspended since it was looked at)."""
        try:
            dom.shutdown()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_OPERATION_INVALID:
                return False
            raise
        return True

    def _force_off(self, dom: libvirt.virDomain) -> None:
        """Pull the plug, trying again while QEMU is slow to exit (libvirt then reports a system error)."""
        for attempt in range(1, self.destroy_attempts + 1):
            try:
                dom.destroy()
                return
            except libvirt.libvirtError as exc:
                if _stopped_meanwhile(dom, exc):
                    return
                if (
                    exc.get_error_code() != libvirt.VIR_ERR_SYSTEM_ERROR
                    or _is_connection_error(exc)
                    or attempt == self.destroy_attempts
                ):
                    raise
            time.sleep(self.destroy_retry_interval)

    @_reconnecting
    def destroy(self, instance_uuid: str) -> None:
        with self._guest_lock(instance_uuid):
            dom = self._lookup(instance_uuid)
            if dom is None:
                return
            with _hypervisor_errors("destroy", instance_uuid):
                if dom.isActive():
                    self._force_off(dom)
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

    @_reconnecting
    def guest_exists(self, instance_uuid: str) -> bool:
        return self._lookup(instance_uuid) is not None

    @_reconnecting
    def guest_power_state(self, instance_uuid: str) -> int:
        dom = self._domain(instance_uuid)
        with _hypervisor_errors("read power state", instance_uuid):
            state, _reason = dom.state()
        return _POWER_STATE_BY_LIBVIRT_STATE.get(state, NOSTATE)

    @_reconnecting
    def guest_spec(self, instance_uuid: str) -> GuestSpec:
        dom = self._domain(instance_uuid)
        with _hypervisor_errors("read guest definition", instance_uuid):
            root = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        return _spec_from_xml(root, instance_uuid)

    @_reconnecting
    def list_guests(self) -> list[str]:
        with _hypervisor_errors("list guests"):
            return sorted(dom.UUIDString() for dom in self.connection.listAllDomains())

    @_reconnecting
    def guest_memory_mb(self, instance_uuid: str) -> int:
        # From the definition itself, so guests Ferry did not define count too.
        dom = self._domain(instance_uuid)
        with _hypervisor_errors("read guest memory", instance_uuid):
            return int(dom.maxMemory()) // 1024

    # Attaching and detaching is a device change and a metadata change, two libvirt calls: an
    # attempt interrupted between them is completed by the next one, which reads from the guest's
    # definitions (persistent and running) whether the device is there and changes only what is
    # still to change.

    @_reconnecting
    def attach_volume(self, instance_uuid: str, disk: DiskSpec) -> None:
        if disk.kind != VOLUME or not disk.volume_id:
            raise errors.InvalidOperation("Only volumes can be attached to a guest.", instance_uuid=instance_uuid)
        with self._guest_lock(instance_uuid):
            spec = self.guest_spec(instance_uuid)
            known = next((d for d in spec.disks if d.volume_id == disk.volume_id), None)
            if known is not None and not self.live_device_updates:
                return
            new_spec = spec if known is not None else replace(spec, disks=spec.disks + (disk,))
            _check_devices(new_spec)
            self._change_device(instance_uuid, spec, new_spec, self.disk_element(known or disk), attach=True)

    @_reconnecting
    def detach_volume(self, instance_uuid: str, volume_id: str) -> None:
        with self._guest_lock(instance_uuid):
            try:
                spec = self.guest_spec(instance_uuid)
            except errors.GuestNotFound:
                # No guest holds the volume: so an attach that failed for want of a guest can be
                # undone, and a server without one can give its volumes back.
                logger.info("no guest to detach the volume from: already detached",
                            extra={"instance_uuid": instance_uuid, "volume_id": volume_id})
                return
            found = [d for d in spec.disks if d.volume_id == volume_id]
            if not found and not self.live_device_updates:
                return
            new_spec = replace(spec, disks=tuple(d for d in spec.disks if d.volume_id != volume_id))
            # A volume's disk is found by its serial, whatever its path or type.
            wanted = ET.Element("disk")
            ET.SubElement(wanted, "serial").text = volume_id
            self._change_device(instance_uuid, spec, new_spec, wanted, attach=False)

    @_reconnecting
    def attach_interface(self, instance_uuid: str, port: PortSpec) -> None:
        with self._guest_lock(instance_uuid):
            spec = self.guest_spec(instance_uuid)
            known = next((p for p in spec.ports if p.port_id == port.port_id), None)
            if known is not None and not self.live_device_updates:
                return
            new_spec = spec if known is not None else replace(spec, ports=spec.ports + (port,))
            self._change_device(instance_uuid, spec, new_spec, self.interface_element(known or port), attach=True)

    @_reconnecting
    def detach_interface(self, instance_uuid: str, port_id: str) -> None:
        with self._guest_lock(instance_uuid):
            spec = self.guest_spec(instance_uuid)
            found = [p for p in spec.ports if p.port_id == port_id]
            if not found and not self.live_device_updates:
                return
            new_spec = replace(spec, ports=tuple(p for p in spec.ports if p.port_id != port_id))
            # By its MAC when Ferry recorded the port, and by its tap device name in any case.
            wanted = ET.Element("interface")
            if found:
                ET.SubElement(wanted, "mac", address=found[0].mac_address)
            ET.SubElement(wanted, "target", dev=tap_device(port_id))
            self._change_device(instance_uuid, spec, new_spec, wanted, attach=False)

    def _change_device(
        self, instance_uuid: str, spec: GuestSpec, new_spec: GuestSpec, device: ET.Element, attach: bool
    ) -> None:
        dom = self._domain(instance_uuid)
        action = "attach device" if attach else "detach device"
        with _hypervisor_errors(action, instance_uuid):
            if not self.live_device_updates:
                self._redefine(dom, new_spec, device, attach)
            else:
                active = bool(dom.isActive())
                if attach:
                    self._attach_device(dom, device, active)
                else:
                    self._detach_device(dom, device, active, instance_uuid)
                if new_spec != spec:
                    # Only once the device is where it should be: metadata never claims a device
                    # the guest does not have.
                    dom.setMetadata(
                        libvirt.VIR_DOMAIN_METADATA_ELEMENT,
                        ET.tostring(_metadata_element(new_spec), encoding="unicode"),
                        METADATA_PREFIX,
                        METADATA_NS,
                        libvirt.VIR_DOMAIN_AFFECT_CONFIG | (libvirt.VIR_DOMAIN_AFFECT_LIVE if active else 0),
                    )
        self._save_test_guests()

    @staticmethod
    def _attach_device(dom: libvirt.virDomain, device: ET.Element, active: bool) -> None:
        """Attach ``device`` to the definitions (persistent, and running if ``active``) that lack it."""
        flags = 0
        if _find_device(_persistent_root(dom), device) is None:
            flags |= libvirt.VIR_DOMAIN_AFFECT_CONFIG
        if active and _find_device(_live_root(dom), device) is None:
            flags |= libvirt.VIR_DOMAIN_AFFECT_LIVE
        if flags:
            dom.attachDeviceFlags(ET.tostring(device, encoding="unicode"), flags)

    def _detach_device(self, dom: libvirt.virDomain, wanted: ET.Element, active: bool, instance_uuid: str) -> None:
        """Detach ``wanted`` from the running guest (waiting for it to leave), then from the persistent definition."""
        if active:
            self._detach_from_running_guest(dom, wanted, instance_uuid)
        device = _find_device(_persistent_root(dom), wanted)
        if device is not None:
            dom.detachDeviceFlags(ET.tostring(device, encoding="unicode"), libvirt.VIR_DOMAIN_AFFECT_CONFIG)

    def _detach_from_running_guest(self, dom: libvirt.virDomain, wanted: ET.Element, instance_uuid: str) -> None:
        """Ask the running guest to release the device until it is gone from its live definition.

        libvirt may answer a live detach before the guest has released the device (or the guest
        may ignore the request), so its answer proves nothing: the live definition does.

        Raises:
            HypervisorError: the device is still attached after ``device_detach_attempts`` requests.
        """
        last_error = ""
        for _attempt in range(self.device_detach_attempts):
            device = self._live_device(dom, wanted)
            if device is None:
                return
            try:
                dom.detachDeviceFlags(ET.tostring(device, encoding="unicode"), libvirt.VIR_DOMAIN_AFFECT_LIVE)
            except libvirt.libvirtError as exc:
                # The device may have left meanwhile, or QEMU refuses a request while an earlier one
                # is pending: the live definition decides.
                if _is_connection_error(exc):
                    raise
                last_error = f" ({exc.get_error_message() or exc})"
            deadline = time.monotonic() + self.device_detach_timeout
            while self._live_device(dom, wanted) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(self.device_poll_interval, left))
            else:
                return
        raise errors.HypervisorError(
            f"The running guest of instance {instance_uuid} still has the device after "
            f"{self.device_detach_attempts} detach requests{last_error}.",
            action="detach device",
            instance_uuid=instance_uuid,
        )

    @staticmethod
    def _live_device(dom: libvirt.virDomain, wanted: ET.Element) -> ET.Element | None:
        """The device matching ``wanted`` in the running guest's definition (None once the guest has stopped)."""
        if not dom.isActive():
            return None
        return _find_device(_live_root(dom), wanted)

    def _redefine(self, dom: libvirt.virDomain, new_spec: GuestSpec, device: ET.Element, attach: bool) -> None:
        """Edit the persistent definition in place (keeping the uuid and everything libvirt added)."""
        root = _persistent_root(dom)
        devices = root.find("devices")
        if devices is None:
            devices = ET.SubElement(root, "devices")
        if attach:
            if _find_device(root, device) is None:
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

    @_reconnecting
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


def _is_block_device(path: str) -> bool:
    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False


def _supports_direct_io(directory: Path) -> bool:
    """Whether files in ``directory`` (or its nearest existing parent) can be written with O_DIRECT.

    Some filesystems (tmpfs before Linux 6.6, some network and FUSE filesystems) refuse it, and
    QEMU then cannot open a disk with ``cache='none'``.
    """
    o_direct = getattr(os, "O_DIRECT", None)
    if o_direct is None:
        return False
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    try:
        fd, name = tempfile.mkstemp(prefix=".ferry-direct-io-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    try:
        direct = os.open(name, os.O_WRONLY | o_direct)
        try:
            # O_DIRECT wants an aligned buffer: an anonymous mapping is page-aligned.
            with mmap.mmap(-1, mmap.PAGESIZE) as block:
                os.write(direct, block)
        finally:
            os.close(direct)
    except OSError:
        return False
    finally:
        os.unlink(name)
    return True


def _stopped_meanwhile(dom: libvirt.virDomain, exc: libvirt.libvirtError) -> bool:
    """Whether a stop request failed only because the guest had stopped already."""
    return exc.get_error_code() == libvirt.VIR_ERR_OPERATION_INVALID and not dom.isActive()


def _persistent_root(dom: libvirt.virDomain) -> ET.Element:
    return ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))


def _live_root(dom: libvirt.virDomain) -> ET.Element:
    return ET.fromstring(dom.XMLDesc(0))


def _find_device(root: ET.Element, wanted: ET.Element) -> ET.Element | None:
    """The device of a domain definition that is ``wanted`` (see :func:`_same_device`)."""
    devices = root.find("devices")
    if devices is None:
        return None
    return next((existing for existing in devices if _same_device(existing, wanted)), None)


def _same_device(existing: ET.Element, wanted: ET.Element) -> bool:
    """Whether ``existing`` is the device ``wanted`` describes.

    A disk with a serial (a volume) is found by its serial, another by its target device; an
    interface by its MAC address or its target (tap) device.
    """
    if existing.tag != wanted.tag:
        return False
    if wanted.tag == "disk":
        wanted_serial = wanted.findtext("serial")
        if wanted_serial:
            return existing.findtext("serial") == wanted_serial
        return _attr(existing, "target", "dev") is not None and _attr(existing, "target", "dev") == _attr(
            wanted, "target", "dev"
        )
    if wanted.tag == "interface":
        mac, wanted_mac = _attr(existing, "mac", "address"), _attr(wanted, "mac", "address")
        if mac is not None and wanted_mac is not None and mac.lower() == wanted_mac.lower():
            return True
        tap = _attr(existing, "target", "dev")
        return tap is not None and tap == _attr(wanted, "target", "dev")
    return False


def _attr(el: ET.Element, child: str, name: str) -> str | None:
    found = el.find(child)
    return found.get(name) if found is not None else None


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
