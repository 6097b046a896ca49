"""What the end-to-end tests of moves share: the seeded flavors, disk digests, a booted server, compute
services switched off to steer boots, and a flavor per cell's hardware generation."""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from blake3 import blake3
from sqlalchemy import select

from ferry.store.api_models import Port, PortBinding
from ferry.store.cell_models import Migration
from ferry.store.db import api_session, cell_session

TINY, SMALL, MEDIUM, LARGE = "1", "2", "3", "4"
FLAVORS = {  # the seeded flavors, as placement amounts
    TINY: {"VCPU": 1, "MEMORY_MB": 256, "DISK_GB": 1},
    SMALL: {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 2},
    MEDIUM: {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 4},
    LARGE: {"VCPU": 4, "MEMORY_MB": 2048, "DISK_GB": 10},
}
GiB = 2**30


_ZEROS = memoryview(bytes(4 * 2**20))


def root_digest(path: Path, size: int, algorithm: str = "blake3") -> str:
    """Digest of the first ``size`` bytes of a disk (what the guest wrote before the move).

    Holes count as the zeros they read as, so a copy whose zero blocks became holes has the same
    digest; they are fed to the hash without being read. BLAKE3 on all cores by default (a
    1 GiB disk in a tenth of the time SHA-256 takes); ``"sha256"`` to compare with an image's.
    """
    digest: Any = blake3(max_threads=blake3.AUTO) if algorithm == "blake3" else hashlib.new(algorithm)
    with open(path, "rb") as disk:
        fd, end = disk.fileno(), min(size, os.fstat(disk.fileno()).st_size)
        position = 0
        while position < end:
            try:
                data = min(os.lseek(fd, position, os.SEEK_DATA), end)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: only a hole is left
                    raise
                data = end
            while position < data:
                step = min(len(_ZEROS), data - position)
                digest.update(_ZEROS[:step])
                position += step
            hole = min(os.lseek(fd, position, os.SEEK_HOLE), end) if position < end else end
            while position < hole:
                chunk = os.pread(fd, min(len(_ZEROS), hole - position), position)
                if not chunk:
                    raise AssertionError(f"{path} shrank while it was read")
                digest.update(chunk)
                position += len(chunk)
    return str(digest.hexdigest())


def host_of(server: dict[str, Any]) -> str:
    return server["OS-EXT-SRV-ATTR:host"]


def cell_of(stack, host: str) -> str:
    return stack.hosts[host]


def migrations_of(server_id: str, cell: str) -> list[Migration]:
    with cell_session(cell) as session:
        rows = session.scalars(select(Migration).where(Migration.instance_uuid == server_id)
                               .order_by(Migration.id)).all()
        session.expunge_all()
        return list(rows)


def port_bindings(server_id: str) -> set[tuple[str, str]]:
    """``(host, status)`` of every binding of the server's ports."""
    with api_session() as session:
        rows = session.execute(select(PortBinding.host, PortBinding.status).join(Port, Port.id == PortBinding.port_id)
                               .where(Port.device_id == server_id))
        return {(host, status) for host, status in rows}


def assert_lives_only_on(stack, records, server_id: str, host: str, flavor: str) -> None:
    """The server's allocation is exactly ``flavor`` on ``host``; no other host keeps anything of it."""
    assert records.allocations(server_id) == {records.provider(host): FLAVORS[flavor]}
    for other in stack.hosts:
        if other != host:
            assert not records.instance_dir(other, server_id).exists(), f"disks left on {other}"
            assert not (stack.instances_dir(other) / f"{server_id}_resize").exists(), f"old disks left on {other}"
    assert not (stack.instances_dir(host) / f"{server_id}_resize").exists()
    assert records.instance_dir(host, server_id).is_dir()


def resize_to_verify(servers, server_id: str, body: dict[str, Any], identity: str = "demo") -> dict[str, Any]:
    response = servers.action(server_id, body, identity)
    assert response.status_code == 202, response.text
    return servers.wait_for_status(server_id, "VERIFY_RESIZE", timeout=120)


def boot_with_digest(local_stack, servers, flavor: str = TINY, **extra: Any) -> tuple[dict[str, Any], str]:
    """Boot a server and return it with the digest of its root disk (empty when volume-backed)."""
    server = servers.boot(flavor=flavor, **extra)
    root = local_stack.instances_dir(host_of(server)) / server["id"] / "disk"
    digest = root_digest(root, FLAVORS[flavor]["DISK_GB"] * GiB) if root.exists() else ""
    return server, digest


# --- compute services, to steer where servers boot ------------------------------------------------

SERVICES_MICROVERSION = {"OpenStack-API-Version": "compute 2.53"}


def compute_services(admin) -> list[dict[str, Any]]:
    listed = admin.get("/os-services", params={"binary": "nova-compute"}, headers=SERVICES_MICROVERSION)
    assert listed.status_code == 200, listed.text
    return listed.json()["services"]


def set_service(admin, host: str, *, disabled: bool, reason: str | None = None) -> None:
    [service] = [s for s in compute_services(admin) if s["host"] == host]
    body: dict[str, Any] = {"status": "disabled" if disabled else "enabled"}
    if disabled and reason:
        body["disabled_reason"] = reason
    changed = admin.put(f"/os-services/{service['id']}", json=body, headers=SERVICES_MICROVERSION)
    assert changed.status_code == 200, changed.text


def disabled_services(admin) -> dict[str, bool]:
    return {s["host"]: s["status"] == "disabled" for s in compute_services(admin)}


@contextmanager
def only_hosts_enabled(local_stack, hosts: set[str]) -> Iterator[None]:
    """Every other compute host disabled while the block runs, then enabled again."""
    admin = local_stack.session("admin")
    others = sorted(set(local_stack.hosts) - hosts)
    for host in others:
        set_service(admin, host, disabled=True, reason="e2e: steer boots")
    try:
        yield
    finally:
        for host in others:
            set_service(admin, host, disabled=False)


# --- a flavor per cell's hardware generation --------------------------------------------------------

CROSS_CELL_RULE = "compute:servers:resize:cross_cell"


@contextmanager
def generation_flavors(local_stack) -> Iterator[dict[str, str]]:
    """``{cell: flavor id}``: a flavor of the small size that only that cell's hosts offer.

    Set up as an operator would: an aggregate per cell with ``hw_generation=<cell>``
    (``os-aggregates``) and the flavor's matching extra spec; all removed afterwards.
    """
    cells = sorted(set(local_stack.hosts.values()))
    admin = local_stack.session("admin")
    aggregates: list[tuple[int, list[str]]] = []
    flavors: dict[str, str] = {}
    try:
        for cell in cells:
            created = admin.post("/os-aggregates", json={"aggregate": {"name": f"e2e-generation-{cell}"}})
            assert created.status_code == 200, created.text
            aggregate, members = created.json()["aggregate"]["id"], []
            aggregates.append((aggregate, members))
            for host in sorted(h for h, c in local_stack.hosts.items() if c == cell):
                added = admin.post(f"/os-aggregates/{aggregate}/action", json={"add_host": {"host": host}})
                assert added.status_code == 200, added.text
                members.append(host)
            tagged = admin.post(f"/os-aggregates/{aggregate}/action",
                                json={"set_metadata": {"metadata": {"hw_generation": cell}}})
            assert tagged.status_code == 200, tagged.text
            small = FLAVORS[SMALL]
            created = admin.post("/flavors", json={"flavor": {
                "name": f"e2e.small.{cell}", "id": f"small-{cell}", "vcpus": small["VCPU"],
                "ram": small["MEMORY_MB"], "disk": small["DISK_GB"]}})
            assert created.status_code == 200, created.text
            flavors[cell] = created.json()["flavor"]["id"]
            spec = admin.post(f"/flavors/{flavors[cell]}/os-extra_specs", json={
                "extra_specs": {"aggregate_instance_extra_specs:hw_generation": cell}})
            assert spec.status_code == 200, spec.text
        yield flavors
    finally:
        for flavor in flavors.values():
            admin.delete(f"/flavors/{flavor}")
        for aggregate, members in aggregates:
            for host in members:
                admin.post(f"/os-aggregates/{aggregate}/action", json={"remove_host": {"host": host}})
            admin.delete(f"/os-aggregates/{aggregate}")
