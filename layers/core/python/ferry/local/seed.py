"""The default topology and data of a fresh local stack (idempotent: seeding twice changes nothing).

* cells ``cell0`` (no hosts, where unschedulable servers live) and ``cell1``..``cellN``, one
  SQLite file each under the state directory, with ``hosts_per_cell`` hosts each named
  ``cell<N>-host<M>``;
* four public flavors with the ids ``1``..``4``;
* a small bootable raw image with deterministic content, uploaded to the image bucket;
* the shared network;
* tokens for an admin, a member of project ``demo`` and one of project ``alt``;
* ``clouds.yaml`` with the clouds ``ferry-admin``, ``ferry-demo`` and ``ferry-alt``.

What was seeded is recorded in ``<state>/seed.json``; its tokens are reused when seeding again.
The process environment must already point Ferry's store and AWS clients at the local stack
(:class:`ferry.local.stack.LocalStack` does that before seeding).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select

from ferry import auth, errors, images
from ferry.compute import api as compute_api
from ferry.store import setup
from ferry.store.api_models import Flavor, Network
from ferry.store.db import CELL0_NAME, api_session

log = logging.getLogger("ferry-local")

SECTOR = 512
IMAGE_MARKER = b"FERRY-LOCAL-TEST-IMAGE"
DEFAULT_IMAGE_NAME = "ferry-test-raw"
DEFAULT_IMAGE_SIZE_MIB = 4
SHARED_NETWORK_CIDR = "10.0.0.0/20"  # room for the benchmarks' thousands of servers
CLOUD_PREFIX = "ferry-"


@dataclass(frozen=True)
class FlavorSeed:
    flavorid: str
    name: str
    vcpus: int
    memory_mb: int
    root_gb: int
    ephemeral_gb: int = 0
    swap: int = 0


DEFAULT_FLAVORS: tuple[FlavorSeed, ...] = (
    FlavorSeed("1", "ferry.tiny", 1, 256, 1),
    FlavorSeed("2", "ferry.small", 1, 512, 2),
    FlavorSeed("3", "ferry.medium", 2, 1024, 4),
    FlavorSeed("4", "ferry.large", 4, 2048, 8, ephemeral_gb=1, swap=128),
)


@dataclass(frozen=True)
class Identity:
    """A seeded user: who they are and the token that stands for them."""

    user_id: str
    project_id: str
    roles: tuple[str, ...]
    token: str = ""


DEFAULT_IDENTITIES: dict[str, Identity] = {
    "admin": Identity("admin", "admin", ("admin", "member")),
    "demo": Identity("demo-user", "demo", ("member",)),
    "alt": Identity("alt-user", "alt", ("member",)),
}


@dataclass
class SeedResult:
    """What :func:`seed` made (also written to ``<state>/seed.json``)."""

    cells: list[str]
    hosts: dict[str, str]
    flavors: list[str]
    image: dict[str, Any]
    network_id: str
    identities: dict[str, Identity]
    clouds_yaml: str
    api_url: str
    identity_url: str
    volume_url: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> dict[str, str]:
        return {name: identity.token for name, identity in self.identities.items()}


def host_name(cell: str, index: int) -> str:
    """The local host name of the ``index``-th host (1-based) of ``cell``."""
    return f"{cell}-host{index}"


def topology(cells: int, hosts_per_cell: int) -> dict[str, str]:
    """Every local host and its cell: ``{"cell1-host1": "cell1", ...}``."""
    return {host_name(f"cell{c}", h): f"cell{c}" for c in range(1, cells + 1) for h in range(1, hosts_per_cell + 1)}


def write_test_image(path: Path, size_mib: int = DEFAULT_IMAGE_SIZE_MIB) -> str:
    """Write a raw disk image with deterministic content; returns its SHA-256.

    Sector 0 is a boot sector (the marker string, the ``55 AA`` signature); every other sector
    holds its own number repeated, so a copy that moves or loses sectors is caught.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with path.open("wb") as out:
        boot = bytearray(SECTOR)
        boot[: len(IMAGE_MARKER)] = IMAGE_MARKER
        boot[510:512] = b"\x55\xaa"
        out.write(boot)
        digest.update(boot)
        for sector in range(1, size_mib * 1024 * 1024 // SECTOR):
            data = struct.pack("<Q", sector) * (SECTOR // 8)
            out.write(data)
            digest.update(data)
    return digest.hexdigest()


def _previous(state_dir: Path) -> dict[str, Any]:
    record = state_dir / "seed.json"
    if not record.is_file():
        return {}
    try:
        return json.loads(record.read_text())
    except ValueError:
        return {}


def _ensure_flavors(flavors: tuple[FlavorSeed, ...]) -> list[str]:
    with api_session() as session:
        existing = set(session.scalars(select(Flavor.flavorid)))
    for flavor in flavors:
        if flavor.flavorid in existing:
            continue
        try:
            compute_api.create_flavor(
                name=flavor.name,
                vcpus=flavor.vcpus,
                memory_mb=flavor.memory_mb,
                root_gb=flavor.root_gb,
                ephemeral_gb=flavor.ephemeral_gb,
                swap=flavor.swap,
                flavorid=flavor.flavorid,
            )
        except errors.FlavorExists:
            pass  # created concurrently, or the name was taken by hand: leave it
    return [f.flavorid for f in flavors]


def _ensure_network() -> str:
    with api_session() as session:
        network = session.scalars(
            select(Network).where(Network.name == compute_api.SHARED_NETWORK_NAME, Network.shared.is_(True))
        ).first()
        if network is None:
            network = Network(
                id=compute_api.SHARED_NETWORK_ID,
                name=compute_api.SHARED_NETWORK_NAME,
                cidr=SHARED_NETWORK_CIDR,
                shared=True,
                project_id=None,
            )
            session.add(network)
            session.flush()
        return network.id


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable and writable by its owner only (it holds tokens).

    The file is created with mode 0600 rather than made private after writing, so that no other
    user can open it even for a moment; an existing file loses any wider mode before it is written.
    """
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "w") as file:
        file.write(text)


def clouds_document(api_url: str, identity_url: str, volume_url: str,
                    identities: dict[str, Identity]) -> dict[str, Any]:
    """A clouds.yaml document with one cloud per identity (``ferry-<name>``), token auth."""
    return {
        "clouds": {
            f"{CLOUD_PREFIX}{name}": {
                "auth_type": "admin_token",
                "auth": {"endpoint": api_url, "token": identity.token},
                "identity_api_version": 3,
                "identity_endpoint_override": identity_url,
                "volume_api_version": 3,
                "block_storage_endpoint_override": volume_url,
            }
            for name, identity in identities.items()
        }
    }


def seed(
    state_dir: str | Path,
    *,
    api_url: str,
    identity_url: str,
    volume_url: str,
    cells: int = 2,
    hosts_per_cell: int = 2,
    flavors: tuple[FlavorSeed, ...] = DEFAULT_FLAVORS,
    identities: dict[str, Identity] | None = None,
    image_name: str = DEFAULT_IMAGE_NAME,
    image_size_mib: int = DEFAULT_IMAGE_SIZE_MIB,
) -> SeedResult:
    """Create the local stack's cells, hosts, flavors, image, network, tokens and clouds.yaml.

    Args:
        state_dir: where the SQLite files, the image file, seed.json and clouds.yaml go.
        api_url: the compute endpoint clients use (``http://127.0.0.1:8774/v2.1``).
        identity_url: the identity endpoint override (``http://127.0.0.1:8774/identity/v3``).
        volume_url: the block-storage endpoint override (``http://127.0.0.1:8774/volume/v3``).
        cells, hosts_per_cell: the topology (cell0 comes on top, without hosts).
        flavors, identities, image_name, image_size_mib: what else to seed.

    Raises:
        botocore.exceptions.ClientError: the image upload failed.
    """
    state = Path(state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    previous = _previous(state)

    setup.init_api_database()
    cell_names = [CELL0_NAME] + [f"cell{c}" for c in range(1, cells + 1)]
    for name in cell_names:
        setup.create_cell(name)
    hosts = topology(cells, hosts_per_cell)
    for host, cell in hosts.items():
        setup.map_host(host, cell)

    flavor_ids = _ensure_flavors(flavors)
    network_id = _ensure_network()

    image_path = state / "images" / f"{image_name}.raw"
    sha256 = write_test_image(image_path, image_size_mib)
    # moto keeps the bucket in memory: after a restart the image is uploaded again under its old id,
    # so servers booted from it still find it.
    old_image = previous.get("image") or {}
    same_image = {"image_id": old_image["id"]} if old_image.get("name") == image_name and old_image.get("id") else {}
    image = images.register_image(image_path, image_name, **same_image)
    if image.get("os_hash_value") not in (None, sha256):
        log.warning("image %s in the bucket differs from %s", image_name, image_path)

    old_tokens = (previous.get("tokens") or {}) if isinstance(previous, dict) else {}
    seeded: dict[str, Identity] = {}
    for name, identity in (identities or DEFAULT_IDENTITIES).items():
        token = auth.issue_token(identity.user_id, identity.project_id, identity.roles, token=old_tokens.get(name))
        seeded[name] = Identity(identity.user_id, identity.project_id, tuple(identity.roles), token)

    clouds_yaml = state / "clouds.yaml"
    clouds = clouds_document(api_url, identity_url, volume_url, seeded)
    write_private(clouds_yaml, yaml.safe_dump(clouds, sort_keys=False))

    result = SeedResult(
        cells=cell_names,
        hosts=hosts,
        flavors=flavor_ids,
        image={"id": image["id"], "name": image_name, "sha256": sha256, "path": str(image_path)},
        network_id=network_id,
        identities=seeded,
        clouds_yaml=str(clouds_yaml),
        api_url=api_url,
        identity_url=identity_url,
        volume_url=volume_url,
    )
    record = asdict(result)
    record["tokens"] = result.tokens
    write_private(state / "seed.json", json.dumps(record, indent=2))
    log.info(
        "seeded %d cells, %d hosts, %d flavors, image %s", len(cell_names), len(hosts), len(flavor_ids), image["id"]
    )
    return result
