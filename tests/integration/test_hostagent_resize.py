"""Resize, cold migrate, confirm and revert on the host side: two agents, two test hypervisors, real disk files.

Each agent stands for one host (its own ``test:///`` hypervisor, instances directory and queue);
S3 and SQS are moto. Operations go through the host's queue and are answered to a recording
Step Functions client, so each result is what a workflow would receive.

Disk checksums cover every byte of a disk, zeros included, so most tests shrink the flavor's
gigabyte to a few MiB (the agent sizes disks with ``disks.GiB``); the tests that ask for
``full_size_disks`` use real gigabytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from botocore.exceptions import ReadTimeoutError
from digest_helpers import MOVES, block_digest
from moto import mock_aws
from moto_credentials import REGION, use_moto_credentials

from ferry import errors, faults, protocol
from hostagent import agent as agent_module
from hostagent import disks
from hostagent.agent import HostAgent
from hostagent.driver import NOSTATE, RUNNING, SHUTDOWN, LibvirtDriver, write_test_node_xml
from hostagent.moves import read_record, write_record

IMAGES = "ferry-images"
TRANSFERS = "ferry-transfers"
MiB = 2**20
HOST_MEMORY_MB = 8192
OLD = {"flavorid": "2", "name": "m1.small", "vcpus": 1, "memory_mb": 512, "root_gb": 1, "ephemeral_gb": 1, "swap": 64}
NEW = {
    "flavorid": "3",
    "name": "m1.medium",
    "vcpus": 2,
    "memory_mb": 1024,
    "root_gb": 2,
    "ephemeral_gb": 2,
    "swap": 128,
}
PORTS = [{"id": "port-1", "mac_address": "fa:16:3e:11:22:33"}]
EPHEMERAL_DATA = b"ephemeral data that must travel"
EPHEMERAL_OFFSET = 3 * MiB


class TaskTimedOut(Exception):
    """What Step Functions answers for a Task that no longer waits."""


class RecordingStepFunctions:
    """Receives the agents' answers, by task token; or, once ``gave_up``, refuses them as Step Functions would.

    ``heartbeats_left``, when set, is how many more task heartbeats are taken before the Task
    times out (heartbeats then answer ``TaskTimedOut``).
    """

    exceptions = SimpleNamespace(TaskTimedOut=TaskTimedOut, InvalidToken=TaskTimedOut, TaskDoesNotExist=TaskTimedOut)

    def __init__(self) -> None:
        self.answers: dict[str, tuple[dict[str, Any] | None, str | None, str | None]] = {}
        self.gave_up = False
        self.heartbeats_left: int | None = None

    def send_task_success(self, taskToken: str, output: str) -> None:  # noqa: N803 - boto3's names
        if self.gave_up:
            raise TaskTimedOut(taskToken)
        self.answers[taskToken] = (json.loads(output), None, None)

    def send_task_failure(self, taskToken: str, error: str, cause: str) -> None:  # noqa: N803
        if self.gave_up:
            raise TaskTimedOut(taskToken)
        self.answers[taskToken] = (None, error, cause)

    def send_task_heartbeat(self, taskToken: str) -> None:  # noqa: N803
        if self.heartbeats_left is not None:
            if self.heartbeats_left <= 0:
                raise TaskTimedOut(taskToken)
            self.heartbeats_left -= 1


class CountingDriver(LibvirtDriver):
    """The libvirt driver, counting guest definitions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.defined = 0

    def define_guest(self, spec):  # type: ignore[no-untyped-def]
        self.defined += 1
        super().define_guest(spec)


@dataclass
class Host:
    name: str
    agent: HostAgent
    driver: CountingDriver
    instances_dir: Path
    cloud: Cloud

    def deliver(self, operation: str, instance_uuid: str, args: dict[str, Any]) -> str:
        """Send the operation to this host's queue and let the agent take it; return its task token."""
        token = f"token-{uuid.uuid4()}"
        body = {
            "operation": operation,
            "operation_id": f"{uuid.uuid4()}:{operation}",
            "instance_uuid": instance_uuid,
            "args": args,
            "task_token": token,
        }
        assert self.agent.queue_url
        self.cloud.sqs.send_message(QueueUrl=self.agent.queue_url, MessageBody=json.dumps(body))
        (message,) = self.cloud.sqs.receive_message(QueueUrl=self.agent.queue_url, MaxNumberOfMessages=1)["Messages"]
        self.agent.process_message(message)
        return token

    def call(self, operation: str, instance_uuid: str, args: dict[str, Any]) -> tuple[dict | None, str | None]:
        """Send the operation to this host's queue, let the agent take it, and return (result, error name)."""
        result, error, _cause = self.cloud.sfn.answers[self.deliver(operation, instance_uuid, args)]
        if result is not None:
            protocol.validate(result, protocol.RESULT_SCHEMAS.get(operation, protocol.RESULT_SCHEMA))
            assert (result["instance_uuid"], result["host"], result["node"]) == (instance_uuid, self.name, self.name)
        return result, error

    def abandoned(self, operation: str, instance_uuid: str, args: dict[str, Any]) -> None:
        """Run the operation as if its Task timed out while it ran (after the heartbeat that let it
        start): no answer is taken, the message is deleted."""
        self.cloud.sfn.gave_up, self.cloud.sfn.heartbeats_left = True, 1
        try:
            token = self.deliver(operation, instance_uuid, args)
        finally:
            self.cloud.sfn.gave_up, self.cloud.sfn.heartbeats_left = False, None
        assert token not in self.cloud.sfn.answers
        assert self.cloud.sqs.receive_message(QueueUrl=self.agent.queue_url).get("Messages") is None

    def ok(self, operation: str, instance_uuid: str, args: dict[str, Any]) -> dict[str, Any]:
        result, error = self.call(operation, instance_uuid, args)
        assert error is None, f"{operation} failed: {error}"
        assert result is not None
        return result

    def fails(self, operation: str, instance_uuid: str, args: dict[str, Any]) -> str:
        result, error = self.call(operation, instance_uuid, args)
        assert result is None, f"{operation} succeeded: {result}"
        assert error is not None
        return error

    def live(self, instance_uuid: str) -> Path:
        return disks.instance_dir(self.instances_dir, instance_uuid)

    def kept(self, instance_uuid: str) -> Path:
        return disks.resize_dir(self.instances_dir, instance_uuid)

    def instance_dirs(self) -> list[str]:
        return sorted(p.name for p in self.instances_dir.iterdir() if p.is_dir() and p.name != disks.IMAGE_CACHE_DIR)


@dataclass
class Cloud:
    sqs: Any
    s3: Any
    sfn: RecordingStepFunctions
    tmp_path: Path
    hosts: list[Host] = field(default_factory=list)

    def add_host(self, name: str, **options: Any) -> Host:
        root = self.tmp_path / name
        instances_dir = root / "instances"
        driver = CountingDriver(
            write_test_node_xml(root / "node.xml", vcpus=8, memory_mb=HOST_MEMORY_MB), disk_path=instances_dir
        )
        agent = HostAgent(
            host=name,
            node=name,
            cell="cell1",
            queue_url=None,
            reports_queue_url="",
            driver=driver,
            instances_dir=instances_dir,
            state_dir=root / "state",
            queue_prefix="ferry-resize-test-",
            sqs=self.sqs,
            stepfunctions=self.sfn,
            s3=self.s3,
            poll_wait_seconds=0,
            **{"keepalive_interval": 3600, "visibility_timeout": 7200, "power_off_timeout": 5, **options},
        )
        agent.start()
        host = Host(name, agent, driver, instances_dir, self)
        self.hosts.append(host)
        return host

    def transfer_keys(self, prefix: str) -> list[str]:
        listed = self.s3.list_objects_v2(Bucket=TRANSFERS, Prefix=prefix + "/")
        return sorted(o["Key"] for o in listed.get("Contents", []))


@pytest.fixture
def cloud(monkeypatch, tmp_path) -> Iterator[Cloud]:
    use_moto_credentials(monkeypatch)
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=IMAGES)
        s3.create_bucket(Bucket=TRANSFERS)
        world = Cloud(
            sqs=boto3.client("sqs", region_name=REGION), s3=s3, sfn=RecordingStepFunctions(), tmp_path=tmp_path
        )
        yield world
        for host in world.hosts:
            host.driver.close()


SCALED_GIB = 16 * MiB


@pytest.fixture
def full_size_disks() -> None:
    """Disks of real gigabytes for this test."""
    assert disks.GiB == 2**30


@pytest.fixture(autouse=True)
def scaled_disks(request, monkeypatch) -> None:
    if "full_size_disks" not in request.fixturenames:
        monkeypatch.setattr(disks, "GiB", SCALED_GIB)


@pytest.fixture
def source(cloud) -> Host:
    return cloud.add_host("compute1")


@pytest.fixture
def dest(cloud) -> Host:
    return cloud.add_host("compute2")


# --- helpers ------------------------------------------------------------------------------------


def image(cloud: Cloud, content: bytes) -> dict[str, str]:
    key = f"images/{uuid.uuid4()}.raw"
    cloud.s3.put_object(Bucket=IMAGES, Key=key, Body=content)
    return {"id": key, "bucket": IMAGES, "key": key, "sha256": hashlib.sha256(content).hexdigest()}


@dataclass
class Server:
    uuid: str
    root_sha256: str | None
    root_digest: str | None  # the block digest the agents report
    flavor: dict[str, Any]
    volumes: list[dict[str, Any]]


def boot(host: Host, flavor: dict[str, Any] = OLD, running: bool = True, volumes: list | None = None) -> Server:
    """Spawn a server on ``host``, with data in its ephemeral disk and junk in its swap."""
    instance_uuid = str(uuid.uuid4())
    boot_image = None if volumes else image(host.cloud, os.urandom(MiB) + b"root disk")
    args = {
        "name": "web-1",
        "flavor": flavor,
        "image": boot_image,
        "ports": PORTS,
        "volumes": volumes or [],
        "power_on": running,
    }
    host.ok("spawn", instance_uuid, args)
    live = host.live(instance_uuid)
    if flavor["ephemeral_gb"]:
        with open(live / disks.EPHEMERAL_DISK, "r+b") as f:
            f.seek(EPHEMERAL_OFFSET)
            f.write(EPHEMERAL_DATA)
    if flavor["swap"]:
        with open(live / disks.SWAP_DISK, "r+b") as f:
            f.write(b"swap junk" * 1000)
    root = live / disks.ROOT_DISK
    if not root.exists():
        return Server(instance_uuid, None, None, flavor, volumes or [])
    return Server(instance_uuid, logical_sha256(root), block_digest(root, algorithm=MOVES), flavor, volumes or [])


def transfer(migration_uuid: str) -> dict[str, str]:
    return {"bucket": TRANSFERS, "prefix": f"moves/{migration_uuid}"}


def resize_args(migration_uuid: str, dest: Host, same_host: bool = False) -> dict[str, Any]:
    args: dict[str, Any] = {"migration_uuid": migration_uuid, "dest_host": dest.name, "same_host": same_host}
    if not same_host:
        args["transfer"] = transfer(migration_uuid)
    return args


def finish_args(
    migration_uuid: str, server: Server, moved: dict[str, Any], flavor: dict[str, Any] = NEW, same_host: bool = False
) -> dict[str, Any]:
    args: dict[str, Any] = {
        "migration_uuid": migration_uuid,
        "name": "web-1",
        "flavor": flavor,
        "old_flavor": server.flavor,
        "same_host": same_host,
        "disks": moved["disks"],
        "ports": PORTS,
        "volumes": server.volumes,
        "power_on": moved["was_running"],
    }
    if not same_host:
        args["transfer"] = transfer(migration_uuid)
    return args


def revert_args(migration_uuid: str, same_host: bool = False) -> dict[str, Any]:
    args: dict[str, Any] = {"migration_uuid": migration_uuid, "same_host": same_host}
    if not same_host:
        args["transfer"] = transfer(migration_uuid)
    return args


def finish_revert_args(migration_uuid: str, server: Server, power_on: bool) -> dict[str, Any]:
    return {
        "migration_uuid": migration_uuid,
        "name": "web-1",
        "flavor": server.flavor,
        "ports": PORTS,
        "volumes": server.volumes,
        "power_on": power_on,
    }


def move(source: Host, dest: Host, server: Server, flavor: dict[str, Any] = NEW) -> tuple[str, dict, dict]:
    """Prep, resize and finish: the workflow up to VERIFY_RESIZE. Returns (migration, resized, finished)."""
    same_host = source is dest
    migration_uuid = str(uuid.uuid4())
    dest.ok("prep_resize", server.uuid, {"migration_uuid": migration_uuid, "flavor": flavor, "same_host": same_host})
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest, same_host))
    finished = dest.ok("finish_resize", server.uuid, finish_args(migration_uuid, server, resized, flavor, same_host))
    return migration_uuid, resized, finished


def logical_sha256(path: Path, count: int | None = None) -> str:
    """The sha256 of the first ``count`` bytes of a file (all of it by default), reading only its data."""
    size = os.path.getsize(path) if count is None else count
    assert os.path.getsize(path) >= size, f"{path} is shorter than expected"
    hasher = hashlib.sha256()
    position = 0
    with open(path, "rb") as f:
        for start, end in disks.data_segments(f.fileno(), size):
            hasher.update(bytes(start - position))
            f.seek(start)
            hasher.update(f.read(end - start))
            position = end
    for _ in range((size - position) // MiB):
        hasher.update(bytes(MiB))
    hasher.update(bytes((size - position) % MiB))
    return hasher.hexdigest()


def read_at(path: Path, offset: int, count: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(count)


def assert_guest_has_flavor(host: Host, instance_uuid: str, flavor: dict[str, Any]) -> None:
    spec = host.driver.guest_spec(instance_uuid)
    assert spec.flavor == flavor
    assert host.driver.guest_memory_mb(instance_uuid) == flavor["memory_mb"]
    dom = host.driver.connection.lookupByUUIDString(instance_uuid)
    assert dom.info()[3] == flavor["vcpus"]


# --- resize across hosts ----------------------------------------------------------------------


def test_resize_to_a_bigger_flavor_moves_the_disks_and_defines_the_new_guest_at_the_destination(
    cloud, source, dest, full_size_disks
):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())

    claim = dest.ok("prep_resize", server.uuid, {"migration_uuid": migration_uuid, "flavor": NEW, "same_host": False})
    assert claim["claimed"] is True and claim["power_state"] == NOSTATE

    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    assert resized["was_running"] is True
    assert resized["power_state"] == NOSTATE
    assert set(resized["disks"]) == {"root", "ephemeral"}
    assert resized["disks"]["root"] == {"sha256": server.root_digest, "size": disks.GiB, "digest": MOVES}
    assert resized["disks"]["ephemeral"]["size"] == disks.GiB
    assert not source.driver.guest_exists(server.uuid)
    assert not source.live(server.uuid).exists()
    assert sorted(p.name for p in source.kept(server.uuid).iterdir() if p.name.startswith("disk")) == [
        "disk",
        "disk.eph0",
        "disk.swap",
    ]
    prefix = transfer(migration_uuid)["prefix"]
    assert cloud.transfer_keys(prefix) == [
        f"{prefix}/ephemeral",
        f"{prefix}/ephemeral.manifest.json",
        f"{prefix}/root",
        f"{prefix}/root.manifest.json",
    ]

    finished = dest.ok("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))

    assert finished["power_state"] == RUNNING
    live = dest.live(server.uuid)
    root, ephemeral, swap = live / disks.ROOT_DISK, live / disks.EPHEMERAL_DISK, live / disks.SWAP_DISK
    assert os.path.getsize(root) == 2 * disks.GiB
    assert logical_sha256(root, disks.GiB) == server.root_sha256
    assert finished["disks"]["root"] == {"sha256": block_digest(root, algorithm=MOVES), "size": 2 * disks.GiB,
                                         "digest": MOVES}
    assert os.path.getsize(ephemeral) == 2 * disks.GiB
    assert read_at(ephemeral, EPHEMERAL_OFFSET, len(EPHEMERAL_DATA)) == EPHEMERAL_DATA
    assert os.path.getsize(swap) == 128 * MiB
    assert os.stat(swap).st_blocks == 0, "swap is created afresh, never copied"
    assert_guest_has_flavor(dest, server.uuid, NEW)
    spec = dest.driver.guest_spec(server.uuid)
    assert [(d.kind, d.path, d.boot) for d in spec.disks] == [
        ("root", str(root), True),
        ("ephemeral", str(ephemeral), False),
        ("swap", str(swap), False),
    ]
    assert [(p.port_id, p.mac_address) for p in spec.ports] == [("port-1", "fa:16:3e:11:22:33")]
    assert cloud.transfer_keys(prefix) == []
    # The source still holds the old disks until the owner confirms or reverts.
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256


def test_a_stopped_server_stays_stopped_at_the_destination(source, dest):
    server = boot(source, running=False)

    _migration, resized, finished = move(source, dest, server)

    assert resized["was_running"] is False
    assert finished["power_state"] == SHUTDOWN
    assert dest.driver.guest_power_state(server.uuid) == SHUTDOWN


def test_cold_migrate_keeps_the_flavor_and_the_disk_sizes(source, dest):
    server = boot(source)

    _migration, _resized, finished = move(source, dest, server, flavor=OLD)

    live = dest.live(server.uuid)
    assert os.path.getsize(live / disks.ROOT_DISK) == disks.GiB
    assert finished["disks"]["root"]["sha256"] == server.root_digest
    assert_guest_has_flavor(dest, server.uuid, OLD)
    assert finished["power_state"] == RUNNING


def test_a_flavor_that_adds_an_ephemeral_disk_gets_a_new_one(source, dest):
    old = {**OLD, "ephemeral_gb": 0, "swap": 0}
    server = boot(source, flavor=old)

    _migration, resized, finished = move(source, dest, server)

    assert set(resized["disks"]) == {"root"}
    ephemeral = dest.live(server.uuid) / disks.EPHEMERAL_DISK
    assert os.path.getsize(ephemeral) == 2 * disks.GiB and os.stat(ephemeral).st_blocks == 0
    assert finished["disks"]["ephemeral"]["size"] == 2 * disks.GiB


def test_a_smaller_flavor_never_shrinks_the_disks(source, dest):
    server = boot(source, flavor={**OLD, "root_gb": 2})

    move(source, dest, server, flavor={**NEW, "root_gb": 1, "ephemeral_gb": 0})

    live = dest.live(server.uuid)
    assert os.path.getsize(live / disks.ROOT_DISK) == 2 * disks.GiB
    assert read_at(live / disks.EPHEMERAL_DISK, EPHEMERAL_OFFSET, len(EPHEMERAL_DATA)) == EPHEMERAL_DATA


@pytest.mark.parametrize("root_device, local", [("/dev/vdb", {"ephemeral": "vda", "swap": "vdc"}),
                                                  ("vdc", {"ephemeral": "vdb", "swap": "vda"})])
def test_local_disks_go_around_a_root_volume_booted_on_their_device(cloud, source, dest, root_device, local):
    # GIVEN a server booted from a volume on the device an ephemeral disk or swap takes
    volume = {"volume_id": "vol-1", "path": "/dev/mapper/vol-1", "device": root_device, "boot_index": 0}
    server = boot(source, flavor={**OLD, "root_gb": 0, "ephemeral_gb": 1, "swap": 64}, volumes=[volume])
    spawned = devices(source, server)

    # WHEN it is resized to a flavor with both
    move(source, dest, server, flavor={**NEW, "root_gb": 0, "ephemeral_gb": 2, "swap": 128})

    # THEN on both hosts the volume keeps its device and each local disk takes one that is free
    assert spawned == devices(dest, server) == {**local, "vol-1": root_device.removeprefix("/dev/")}


def devices(host: Host, server: Server) -> dict[str, str]:
    """Each disk of the server's guest on ``host`` (a volume by its id) and its device."""
    return {d.volume_id or d.kind: d.device.removeprefix("/dev/") for d in host.driver.guest_spec(server.uuid).disks}


def test_a_volume_backed_server_moves_without_a_root_disk(cloud, source, dest):
    volume = {"volume_id": "vol-1", "path": "/dev/mapper/vol-1", "device": "/dev/vda", "boot_index": 0}
    server = boot(source, flavor={**OLD, "root_gb": 0, "ephemeral_gb": 0, "swap": 0}, volumes=[volume])

    migration_uuid, resized, finished = move(source, dest, server, flavor={**NEW, "root_gb": 0, "ephemeral_gb": 0})

    assert resized["disks"] == {} and finished["disks"] == {}
    assert cloud.transfer_keys(transfer(migration_uuid)["prefix"]) == []
    spec = dest.driver.guest_spec(server.uuid)
    assert [(d.kind, d.volume_id, d.boot) for d in spec.disks] == [("swap", None, False), ("volume", "vol-1", True)]
    assert not (dest.live(server.uuid) / disks.ROOT_DISK).exists()
    assert finished["power_state"] == RUNNING


def test_a_sparse_disk_uploads_only_its_data(cloud, source, dest, full_size_disks):
    server = boot(source, flavor={**OLD, "ephemeral_gb": 0, "swap": 0})
    migration_uuid = str(uuid.uuid4())
    sent: list[int] = []

    def count(params, **_kwargs):
        body = params.get("Body", b"")
        sent.append(len(body) if isinstance(body, bytes) else len(body.read()))
        if hasattr(body, "seek"):
            body.seek(0)

    for operation in ("PutObject", "UploadPart"):
        cloud.s3.meta.events.register(f"before-parameter-build.s3.{operation}", count)

    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))

    prefix = transfer(migration_uuid)["prefix"]
    data_size = cloud.s3.head_object(Bucket=TRANSFERS, Key=f"{prefix}/root")["ContentLength"]
    manifest = json.loads(cloud.s3.get_object(Bucket=TRANSFERS, Key=f"{prefix}/root.manifest.json")["Body"].read())
    assert resized["disks"]["root"]["size"] == manifest["size"] == disks.GiB
    assert data_size == sum(length for _offset, length in manifest["extents"])
    assert data_size < 2 * MiB
    assert sum(sent) < 2 * MiB + 4096, "a 1 GiB disk holding 1 MiB of data sends about 1 MiB"


# --- confirm and revert -------------------------------------------------------------------------


def test_confirm_removes_the_old_side_and_leaves_the_destination_alone(source, dest):
    server = boot(source)
    migration_uuid, _resized, _finished = move(source, dest, server)

    confirmed = source.ok("confirm_resize", server.uuid, {"migration_uuid": migration_uuid, "same_host": False})
    again = source.ok("confirm_resize", server.uuid, {"migration_uuid": migration_uuid, "same_host": False})

    assert confirmed == again
    assert confirmed["power_state"] == NOSTATE
    assert not source.driver.guest_exists(server.uuid)
    assert source.instance_dirs() == []
    assert dest.driver.guest_power_state(server.uuid) == RUNNING
    assert dest.instance_dirs() == [server.uuid]


@pytest.mark.parametrize("running", [True, False], ids=["running", "stopped"])
def test_revert_restores_the_old_guest_at_the_source(cloud, source, dest, running):
    server = boot(source, running=running)
    migration_uuid, resized, _finished = move(source, dest, server)

    reverted = dest.ok("revert_resize", server.uuid, revert_args(migration_uuid))
    assert reverted["power_state"] == NOSTATE
    assert not dest.driver.guest_exists(server.uuid)
    assert dest.instance_dirs() == []
    assert cloud.transfer_keys(transfer(migration_uuid)["prefix"]) == []

    restored = source.ok(
        "finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, resized["was_running"])
    )

    assert restored["power_state"] == (RUNNING if running else SHUTDOWN)
    assert_guest_has_flavor(source, server.uuid, OLD)
    live = source.live(server.uuid)
    assert source.instance_dirs() == [server.uuid]
    assert logical_sha256(live / disks.ROOT_DISK) == server.root_sha256
    assert os.path.getsize(live / disks.ROOT_DISK) == disks.GiB
    assert read_at(live / disks.EPHEMERAL_DISK, EPHEMERAL_OFFSET, len(EPHEMERAL_DATA)) == EPHEMERAL_DATA
    assert [d.kind for d in source.driver.guest_spec(server.uuid).disks] == ["root", "ephemeral", "swap"]
    assert sorted(p.name for p in live.iterdir()) == ["disk", "disk.eph0", "disk.swap", "spawn.json"]


@pytest.mark.parametrize("failing", ["transfer", "directories"])
def test_a_revert_that_destroyed_the_new_guest_goes_on_whatever_it_cannot_remove_after(
        cloud, source, dest, monkeypatch, failing):
    # GIVEN a moved server whose destination cannot delete the transfer objects (S3 down), or its
    # directories, once it has destroyed the new guest
    server = boot(source)
    migration_uuid, resized, _finished = move(source, dest, server)
    if failing == "transfer":
        def unreachable(*_args, **_kwargs):
            raise ReadTimeoutError(endpoint_url="https://s3.test")
        monkeypatch.setattr(disks, "delete_transfer", unreachable)
    else:
        real_remove = disks.remove_dir

        def stuck(path):
            if path == dest.live(server.uuid):
                raise OSError(16, "Device or resource busy")
            return real_remove(path)
        monkeypatch.setattr(disks, "remove_dir", stuck)

    # WHEN the destination reverts
    reverted = dest.ok("revert_resize", server.uuid, revert_args(migration_uuid))

    # THEN it answers done (an error would leave the server in VERIFY_RESIZE on a host that no longer
    # holds it), and the source restores the old guest from its kept disks
    assert reverted["power_state"] == NOSTATE
    assert not dest.driver.guest_exists(server.uuid)
    restored = source.ok("finish_revert_resize", server.uuid,
                         finish_revert_args(migration_uuid, server, resized["was_running"]))
    assert restored["power_state"] == RUNNING
    assert logical_sha256(source.live(server.uuid) / disks.ROOT_DISK) == server.root_sha256


@pytest.mark.parametrize("broken", ["power-state", "destroy-after-an-earlier-run"])
def test_a_revert_that_destroyed_the_new_guest_never_answers_a_hypervisor_error(cloud, source, dest, monkeypatch,
                                                                                broken):
    # GIVEN a moved server whose destination's libvirt answers errors once the new guest is gone
    # (reading its power state), or that an earlier run of the revert destroyed before its agent died
    server = boot(source)
    migration_uuid, _resized, _finished = move(source, dest, server)
    if broken == "destroy-after-an-earlier-run":
        dest.driver.destroy(server.uuid)
        disks.remove_dir(dest.live(server.uuid))

    def libvirt_restarting(*_args, **_kwargs):
        raise errors.HypervisorError("Cannot recv data: Connection reset by peer")

    # WHEN the destination reverts, THEN it answers done (a HypervisorError sends the server back to
    # VERIFY_RESIZE, where a confirm would delete its only disks on the source)
    with monkeypatch.context() as patched:
        patched.setattr(dest.driver, "destroy" if broken != "power-state" else "guest_exists", libvirt_restarting)
        reverted = dest.ok("revert_resize", server.uuid, revert_args(migration_uuid))
    assert reverted["power_state"] == NOSTATE
    assert not dest.driver.guest_exists(server.uuid) and not dest.live(server.uuid).exists()


def test_finish_revert_recreates_a_missing_swap(source, dest):
    server = boot(source)
    migration_uuid, resized, _finished = move(source, dest, server)
    dest.ok("revert_resize", server.uuid, revert_args(migration_uuid))
    (source.kept(server.uuid) / disks.SWAP_DISK).unlink()

    source.ok("finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, True))

    assert os.path.getsize(source.live(server.uuid) / disks.SWAP_DISK) == 64 * MiB


# --- on the same host ---------------------------------------------------------------------------


def test_same_host_resize_then_confirm_keeps_the_resized_guest(cloud, source):
    server = boot(source)

    migration_uuid, resized, finished = move(source, source, server)

    assert cloud.transfer_keys("moves") == []
    assert finished["power_state"] == RUNNING
    assert_guest_has_flavor(source, server.uuid, NEW)
    live, kept = source.live(server.uuid), source.kept(server.uuid)
    assert os.path.getsize(live / disks.ROOT_DISK) == 2 * disks.GiB
    assert logical_sha256(live / disks.ROOT_DISK, disks.GiB) == server.root_sha256
    assert os.path.getsize(kept / disks.ROOT_DISK) == disks.GiB
    assert resized["disks"]["root"]["sha256"] == server.root_digest

    confirmed = source.ok("confirm_resize", server.uuid, {"migration_uuid": migration_uuid, "same_host": True})

    assert confirmed["power_state"] == RUNNING
    assert source.driver.guest_power_state(server.uuid) == RUNNING
    assert_guest_has_flavor(source, server.uuid, NEW)
    assert source.instance_dirs() == [server.uuid]
    assert os.path.getsize(live / disks.ROOT_DISK) == 2 * disks.GiB


def test_same_host_resize_then_revert_restores_the_old_guest(source):
    server = boot(source)
    migration_uuid, resized, _finished = move(source, source, server)

    reverted = source.ok("revert_resize", server.uuid, revert_args(migration_uuid, same_host=True))

    assert reverted["power_state"] == NOSTATE
    assert not source.driver.guest_exists(server.uuid)
    assert source.instance_dirs() == [f"{server.uuid}_resize"]

    restored = source.ok(
        "finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, resized["was_running"])
    )

    assert restored["power_state"] == RUNNING
    assert_guest_has_flavor(source, server.uuid, OLD)
    assert source.instance_dirs() == [server.uuid]
    live = source.live(server.uuid)
    assert os.path.getsize(live / disks.ROOT_DISK) == disks.GiB
    assert logical_sha256(live / disks.ROOT_DISK) == server.root_sha256


def test_same_host_revert_before_anything_moved_leaves_the_server_alone(source):
    server = boot(source)

    reverted = source.ok("revert_resize", server.uuid, revert_args(str(uuid.uuid4()), same_host=True))

    assert reverted["power_state"] == RUNNING
    assert source.driver.guest_power_state(server.uuid) == RUNNING
    assert logical_sha256(source.live(server.uuid) / disks.ROOT_DISK) == server.root_sha256


def test_same_host_finish_without_kept_disks_fails_and_keeps_the_live_ones(source):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    source.driver.destroy(server.uuid)  # the guest is gone but its disks were never moved aside
    moved = {"was_running": True, "disks": {"root": {"sha256": server.root_digest, "size": disks.GiB,
                                                     "digest": MOVES}}}

    error = source.fails("finish_resize", server.uuid, finish_args(migration_uuid, server, moved, same_host=True))

    assert error == "Ferry.DiskCopyFailed"
    assert logical_sha256(source.live(server.uuid) / disks.ROOT_DISK) == server.root_sha256


# --- direct copies into the destination's directory -----------------------------------------------


def direct_resize(source: Host, dest: Host, server: Server, offer: dict[str, Any] | None = None,
                  flavor: dict[str, Any] = NEW) -> tuple[str, dict, dict]:
    """Prep at the destination, then resize_instance with the destination's offer (or ``offer``)."""
    migration_uuid = str(uuid.uuid4())
    prep = {"migration_uuid": migration_uuid, "flavor": flavor, "same_host": False}
    claim = dest.ok("prep_resize", server.uuid, prep)
    args = {**resize_args(migration_uuid, dest), "direct": offer or claim["direct"]}
    return migration_uuid, claim, source.ok("resize_instance", server.uuid, args)


def test_a_source_that_sees_the_destinations_directory_copies_the_disks_straight_in(
    cloud, source, dest, full_size_disks
):
    server = boot(source)

    migration_uuid, claim, resized = direct_resize(source, dest, server)

    marker = json.loads((dest.instances_dir / disks.HOST_MARKER).read_text())
    assert claim["direct"] == {"instances_dir": str(dest.instances_dir.resolve()), "token": marker["token"]}
    assert marker["host"] == dest.name
    assert resized["direct"] is True
    assert resized["disks"]["root"] == {"sha256": server.root_digest, "size": disks.GiB, "digest": MOVES}
    assert cloud.transfer_keys(transfer(migration_uuid)["prefix"]) == []
    incoming = disks.incoming_dir(dest.instances_dir, server.uuid)
    assert sorted(p.name for p in incoming.iterdir()) == ["disk", "disk.blocks", "disk.eph0", "disk.eph0.blocks"]
    assert os.stat(incoming / disks.ROOT_DISK).st_blocks * 512 < 8 * MiB, "holes stay holes"

    finished = dest.ok("finish_resize", server.uuid,
                       {**finish_args(migration_uuid, server, resized), "direct": True})

    assert finished["power_state"] == RUNNING
    live = dest.live(server.uuid)
    root, ephemeral = live / disks.ROOT_DISK, live / disks.EPHEMERAL_DISK
    assert logical_sha256(root, disks.GiB) == server.root_sha256
    assert finished["disks"]["root"] == {"sha256": block_digest(root, algorithm=MOVES), "size": 2 * disks.GiB,
                                         "digest": MOVES}
    assert finished["disks"]["ephemeral"] == {"sha256": block_digest(ephemeral, algorithm=MOVES),
                                              "size": 2 * disks.GiB, "digest": MOVES}
    assert read_at(ephemeral, EPHEMERAL_OFFSET, len(EPHEMERAL_DATA)) == EPHEMERAL_DATA
    assert dest.instance_dirs() == [server.uuid], "the incoming directory is gone once the disks are in place"
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256, "kept for a revert"


def test_a_direct_move_whose_copied_disks_cannot_be_removed_once_in_place_still_finishes(
        cloud, source, dest, monkeypatch):
    # GIVEN disks copied straight into the destination, whose incoming directory then cannot be removed
    server = boot(source)
    migration_uuid, _claim, resized = direct_resize(source, dest, server)
    incoming, real_remove = disks.incoming_dir(dest.instances_dir, server.uuid), disks.remove_dir

    def stuck(path):
        if path == incoming:
            raise OSError(13, "Permission denied")
        return real_remove(path)

    monkeypatch.setattr(disks, "remove_dir", stuck)

    # WHEN the destination finishes the move
    finished = dest.ok("finish_resize", server.uuid, {**finish_args(migration_uuid, server, resized), "direct": True})

    # THEN the resized guest runs (a failure here would roll back a move that had finished)
    assert finished["power_state"] == RUNNING
    assert dest.driver.guest_power_state(server.uuid) == RUNNING


def test_what_a_step_writes_is_synced_with_its_directory_before_the_host_answers(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(disks, "sync_dir", lambda directory: synced.append(Path(directory)))

    write_record(tmp_path, {"migration_uuid": "m-1"})
    disks.host_token(tmp_path, "compute-1")  # written through the agent's temporary-file rename

    assert synced == [tmp_path, tmp_path]
    assert read_record(tmp_path) == {"migration_uuid": "m-1"}


def test_the_directories_a_move_makes_are_synced_in_the_instances_directory_before_the_host_answers(
        source, dest, monkeypatch):
    synced: list[tuple[Path, list[str]]] = []  # each directory synced, with what it then held
    real_sync_dir = disks.sync_dir

    def recording(directory):  # type: ignore[no-untyped-def]
        synced.append((Path(directory), sorted(os.listdir(directory))))
        real_sync_dir(directory)

    server = boot(source)
    monkeypatch.setattr(disks, "sync_dir", recording)

    migration_uuid, _claim, resized = direct_resize(source, dest, server)
    dest.ok("finish_resize", server.uuid, {**finish_args(migration_uuid, server, resized), "direct": True})

    held = [names for path, names in synced if path == dest.instances_dir]
    assert any(f"{server.uuid}{disks.INCOMING_SUFFIX}" in names for names in held), "the direct copy's directory"
    assert any(server.uuid in names for names in held), "the new live directory"


def test_an_offer_the_source_cannot_verify_sends_the_disks_through_the_transfer(cloud, source, dest):
    server = boot(source)
    offer = {"instances_dir": str(dest.instances_dir.resolve()), "token": "not-the-destinations"}

    migration_uuid, _claim, resized = direct_resize(source, dest, server, offer)

    assert "direct" not in resized
    assert len(cloud.transfer_keys(transfer(migration_uuid)["prefix"])) == 4
    assert dest.instance_dirs() == []
    finished = dest.ok("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))
    assert logical_sha256(dest.live(server.uuid) / disks.ROOT_DISK, disks.GiB) == server.root_sha256
    assert finished["disks"]["root"]["size"] == 2 * disks.GiB


@pytest.mark.parametrize("path", ["transfer", "direct", "same_host"])
def test_disks_sent_by_an_agent_older_than_blake3_digests_are_checked_by_sha256_blocks(cloud, source, dest, path):
    """A sender before BLAKE3 block digests reports no ``digest``: its SHA-256 block digests still check the move."""
    server = boot(source)
    target = source if path == "same_host" else dest
    if path == "direct":
        migration_uuid, _claim, resized = direct_resize(source, dest, server)
    else:
        migration_uuid = str(uuid.uuid4())
        target.ok("prep_resize", server.uuid,
                  {"migration_uuid": migration_uuid, "flavor": NEW, "same_host": path == "same_host"})
        resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, target, path == "same_host"))
    kept = source.kept(server.uuid)
    incoming = disks.incoming_dir(dest.instances_dir, server.uuid)
    old_style: dict[str, dict[str, Any]] = {}
    for kind in resized["disks"]:  # what the older sender would have left: SHA-256 block digests, unnamed
        disk = kept / disks.DISK_FILES[kind]
        if path == "transfer":
            sent = disks.upload_disk(cloud.s3, disk, TRANSFERS, transfer(migration_uuid)["prefix"], kind,
                                     algorithm=disks.BLOCK_SHA256)
        elif path == "direct":
            sent = disks.copy_to_host(disk, incoming / disks.DISK_FILES[kind], algorithm=disks.BLOCK_SHA256)
        else:
            sent = disks.Transferred(size=disk.stat().st_size, sha256=block_digest(disk), data_bytes=0)
        old_style[kind] = {"sha256": sent.sha256, "size": sent.size}
    assert old_style["root"]["sha256"] == block_digest(kept / disks.ROOT_DISK) != server.root_digest
    args = finish_args(migration_uuid, server, {**resized, "disks": old_style}, same_host=path == "same_host")
    if path == "direct":
        args["direct"] = True

    finished = target.ok("finish_resize", server.uuid, args)

    root = target.live(server.uuid) / disks.ROOT_DISK
    assert logical_sha256(root, disks.GiB) == server.root_sha256
    assert finished["disks"]["root"] == {"sha256": block_digest(root), "size": 2 * disks.GiB,
                                         "digest": disks.BLOCK_SHA256}


def test_a_disk_digest_this_agent_does_not_know_is_refused_before_anything_moves(source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    resized["disks"]["root"]["digest"] = "md5-blocks"

    error = dest.fails("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))

    assert error == "Ferry.InvalidOperation"
    assert dest.instance_dirs() == [] and not dest.driver.guest_exists(server.uuid)
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256


def test_a_direct_copy_that_does_not_match_what_the_source_reported_fails_and_revert_clears_it(cloud, source, dest):
    server = boot(source)
    migration_uuid, _claim, resized = direct_resize(source, dest, server)
    blocks = disks.incoming_dir(dest.instances_dir, server.uuid) / (disks.ROOT_DISK + disks.BLOCKS_SUFFIX)
    spoiled = bytearray(blocks.read_bytes())
    spoiled[0] ^= 0x01
    blocks.write_bytes(bytes(spoiled))

    error = dest.fails("finish_resize", server.uuid, {**finish_args(migration_uuid, server, resized), "direct": True})

    assert error == "Ferry.DiskCopyFailed"
    assert not dest.driver.guest_exists(server.uuid)
    assert dest.instance_dirs() == [f"{server.uuid}_incoming"]
    dest.ok("revert_resize", server.uuid, revert_args(migration_uuid))
    assert dest.instance_dirs() == []
    restored = source.ok("finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, True))
    assert restored["power_state"] == RUNNING
    assert logical_sha256(source.live(server.uuid) / disks.ROOT_DISK) == server.root_sha256


def test_a_direct_resize_run_again_copies_again_and_a_destroy_clears_what_came_in(cloud, source, dest):
    server = boot(source)
    migration_uuid, claim, first = direct_resize(source, dest, server)
    args = {**resize_args(migration_uuid, dest), "direct": claim["direct"]}

    again = source.ok("resize_instance", server.uuid, args)

    assert again["disks"] == first["disks"] and again["direct"] is True
    dest.ok("destroy", server.uuid, {})
    assert dest.instance_dirs() == []


def test_a_finish_after_a_resize_that_copied_directly_then_sent_through_the_transfer_removes_the_copy(
        cloud, source, dest, monkeypatch):
    # GIVEN a resize whose first run copied a disk straight into the destination and died, and whose
    # run again, the destination's directory out of its reach, sent the disks through the transfer
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    claim = dest.ok("prep_resize", server.uuid, {"migration_uuid": migration_uuid, "flavor": NEW, "same_host": False})
    args = {**resize_args(migration_uuid, dest), "direct": claim["direct"]}
    copy = disks.copy_to_host

    def copy_then_die(*copy_args, **kwargs):  # type: ignore[no-untyped-def]
        copy(*copy_args, **kwargs)
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(disks, "copy_to_host", copy_then_die)
        with pytest.raises(Killed):
            source.call("resize_instance", server.uuid, args)
    with monkeypatch.context() as patch:
        patch.setattr(disks, "reaches", lambda *_args: False)
        resized = source.ok("resize_instance", server.uuid, args)
    assert "direct" not in resized
    assert dest.instance_dirs() == [f"{server.uuid}_incoming"]

    # WHEN the destination finishes the move from the transfer
    finished = dest.ok("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))

    # THEN the disks the first run copied in are gone with the transfer
    assert finished["power_state"] == RUNNING
    assert dest.instance_dirs() == [server.uuid]
    assert cloud.transfer_keys(transfer(migration_uuid)["prefix"]) == []


def test_a_resize_whose_workflow_gave_up_takes_back_the_disks_it_copied_into_the_destination(cloud, source, dest):
    """The rollback empties the destination, but may do so before a late source finishes sending."""
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    claim = dest.ok("prep_resize", server.uuid, {"migration_uuid": migration_uuid, "flavor": NEW, "same_host": False})

    source.abandoned("resize_instance", server.uuid, {**resize_args(migration_uuid, dest), "direct": claim["direct"]})

    assert dest.instance_dirs() == []
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256, "kept for the revert"


def test_a_second_copy_of_a_delivered_resize_refused_its_answer_takes_nothing_back(cloud, source, dest):
    """Step Functions refuses an answer given twice as it refuses a late one: the move goes on with the copy."""
    server = boot(source)
    migration_uuid, claim, _resized = direct_resize(source, dest, server)
    body = {"operation": "resize_instance", "operation_id": f"{migration_uuid}:again", "instance_uuid": server.uuid,
            "args": {**resize_args(migration_uuid, dest), "direct": claim["direct"]}, "task_token": "token-twice"}
    queue = source.agent.queue_url
    for gave_up in (False, True):
        cloud.sfn.gave_up = gave_up
        cloud.sqs.send_message(QueueUrl=queue, MessageBody=json.dumps(body))
        (message,) = cloud.sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=1)["Messages"]
        source.agent.process_message(message)
    cloud.sfn.gave_up = False

    assert cloud.sfn.answers["token-twice"][1] is None
    assert dest.instance_dirs() == [f"{server.uuid}_incoming"]


def test_an_answer_taken_whose_response_was_lost_takes_nothing_back(cloud, source, dest, monkeypatch):
    """The retried answer is refused as a late one would be: the workflow took the first and needs the transfer."""
    monkeypatch.setattr(agent_module, "STEP_FUNCTIONS_RETRY_SECONDS", 0)
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    take = cloud.sfn.send_task_success
    calls: list[str] = []

    def taken_then_refused(taskToken: str, output: str) -> None:  # noqa: N803 - boto3's names
        calls.append(taskToken)
        if len(calls) == 1:
            take(taskToken=taskToken, output=output)
            raise ReadTimeoutError(endpoint_url="https://states.us-east-1.amazonaws.com")
        raise TaskTimedOut(taskToken)

    monkeypatch.setattr(cloud.sfn, "send_task_success", taken_then_refused)
    source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))

    assert len(calls) == 2
    assert len(cloud.transfer_keys(transfer(migration_uuid)["prefix"])) == 4


def test_a_resize_taken_back_runs_again_for_a_new_task_rather_than_answering_from_the_journal(cloud, source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    body = {"operation": "resize_instance", "operation_id": f"{migration_uuid}:resize", "instance_uuid": server.uuid,
            "args": resize_args(migration_uuid, dest)}
    queue = source.agent.queue_url

    def deliver(token: str) -> None:
        cloud.sqs.send_message(QueueUrl=queue, MessageBody=json.dumps({**body, "task_token": token}))
        (message,) = cloud.sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=1)["Messages"]
        source.agent.process_message(message)

    cloud.sfn.gave_up, cloud.sfn.heartbeats_left = True, 1  # the Task times out while it runs
    deliver("token-abandoned")
    cloud.sfn.gave_up, cloud.sfn.heartbeats_left = False, None
    assert cloud.transfer_keys(transfer(migration_uuid)["prefix"]) == []

    source.ok("finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, True))
    deliver("token-of-the-retry")  # the same operation, a new Task

    result, error, _cause = cloud.sfn.answers["token-of-the-retry"]
    assert error is None and result is not None
    assert len(cloud.transfer_keys(transfer(migration_uuid)["prefix"])) == 4  # sent again, not a stale answer


def test_a_resize_whose_workflow_gave_up_takes_back_its_transfer(cloud, source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())

    source.abandoned("resize_instance", server.uuid, resize_args(migration_uuid, dest))

    assert cloud.transfer_keys(transfer(migration_uuid)["prefix"]) == []
    assert source.instance_dirs() == [f"{server.uuid}_resize"]


def test_a_spawn_whose_workflow_gave_up_takes_back_its_guest(cloud, dest):
    # GIVEN a spawn whose Task timed out while it ran (the build was rolled back meanwhile)
    instance_uuid = str(uuid.uuid4())
    args = {"name": "web-1", "flavor": OLD, "image": image(cloud, os.urandom(MiB) + b"root disk"), "ports": PORTS,
            "volumes": [], "power_on": True}

    dest.abandoned("spawn", instance_uuid, args)

    # THEN no guest of it runs here, and its disks are gone
    assert not dest.driver.guest_exists(instance_uuid)
    assert dest.instance_dirs() == []


def test_a_finish_resize_whose_workflow_gave_up_takes_back_its_guest_and_the_source_keeps_its_disks(
        cloud, source, dest):
    # GIVEN a move whose finish at the destination ran past its Task's timeout: the workflow rolled
    # the server back to the source meanwhile
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))

    dest.abandoned("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))

    # THEN the guest it made is gone (it would write the volumes of the one the rollback restores)
    assert not dest.driver.guest_exists(server.uuid)
    assert dest.instance_dirs() == []
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256


def test_a_finish_resize_on_one_host_whose_workflow_gave_up_keeps_the_servers_only_guest(cloud, source):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, source))

    source.abandoned("finish_resize", server.uuid, finish_args(migration_uuid, server, resized, same_host=True))

    assert source.driver.guest_exists(server.uuid)


# --- failures and rollbacks ---------------------------------------------------------------------


def test_a_corrupted_transfer_fails_with_disk_copy_failed_and_leaves_nothing_at_the_destination(cloud, source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    key = f"{transfer(migration_uuid)['prefix']}/root"
    data = bytearray(cloud.s3.get_object(Bucket=TRANSFERS, Key=key)["Body"].read())
    data[12345] ^= 0x01
    cloud.s3.put_object(Bucket=TRANSFERS, Key=key, Body=bytes(data))

    error = dest.fails("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))

    assert error == "Ferry.DiskCopyFailed"
    assert not dest.driver.guest_exists(server.uuid)
    assert dest.instance_dirs() == []
    # Nothing of the source is touched: the transfer stays for a retry, the kept disks for a revert.
    assert len(cloud.transfer_keys(transfer(migration_uuid)["prefix"])) == 4
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256

    # The rollback: the destination forgets, the source comes back as it was.
    dest.ok("revert_resize", server.uuid, revert_args(migration_uuid))
    restored = source.ok("finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, True))
    assert restored["power_state"] == RUNNING
    assert cloud.transfer_keys(transfer(migration_uuid)["prefix"]) == []


def test_a_transfer_that_is_not_the_reported_disk_is_refused(source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    resized["disks"]["root"]["sha256"] = hashlib.sha256(b"another disk").hexdigest()

    error = dest.fails("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))

    assert error == "Ferry.DiskCopyFailed"
    assert dest.instance_dirs() == []


def test_a_hypervisor_refusal_at_the_destination_leaves_nothing_half_defined(cloud, source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    args = finish_args(migration_uuid, server, resized)
    args["ports"] = [{"id": "port-1", "mac_address": "not-a-mac"}]

    assert dest.fails("finish_resize", server.uuid, args) == "Ferry.HypervisorError"

    assert not dest.driver.guest_exists(server.uuid)
    assert dest.instance_dirs() == []
    assert len(cloud.transfer_keys(transfer(migration_uuid)["prefix"])) == 4


def test_finish_revert_rolls_back_a_resize_that_failed_before_the_disks_moved(source, dest, monkeypatch):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())

    def refuse(*_args, **_kwargs):
        raise errors.HypervisorError("power off failed")

    with monkeypatch.context() as patch:
        patch.setattr(source.driver, "power_off", refuse)
        assert (
            source.fails("resize_instance", server.uuid, resize_args(migration_uuid, dest)) == "Ferry.HypervisorError"
        )
    dest.ok("revert_resize", server.uuid, revert_args(migration_uuid))

    restored = source.ok("finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, True))

    assert restored["power_state"] == RUNNING
    assert_guest_has_flavor(source, server.uuid, OLD)
    assert source.instance_dirs() == [server.uuid]


def test_finish_revert_rolls_back_a_resize_whose_upload_failed(cloud, source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    args = {**resize_args(migration_uuid, dest), "transfer": {"bucket": "no-such-bucket", "prefix": "moves/x"}}

    assert source.fails("resize_instance", server.uuid, args) == "Ferry.DiskCopyFailed"
    assert not source.driver.guest_exists(server.uuid)

    restored = source.ok("finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, True))

    assert restored["power_state"] == RUNNING
    assert source.instance_dirs() == [server.uuid]
    assert logical_sha256(source.live(server.uuid) / disks.ROOT_DISK) == server.root_sha256


def test_revert_at_a_destination_that_has_nothing_succeeds(cloud, dest):
    instance_uuid = str(uuid.uuid4())

    reverted = dest.ok("revert_resize", instance_uuid, revert_args(str(uuid.uuid4())))

    assert reverted["power_state"] == NOSTATE
    assert dest.instance_dirs() == []


def test_finish_revert_without_anything_to_restore_fails_with_guest_not_found(source):
    server = Server(str(uuid.uuid4()), None, None, OLD, [])
    args = finish_revert_args(str(uuid.uuid4()), server, True)

    assert source.fails("finish_revert_resize", server.uuid, args) == "Ferry.GuestNotFound"
    assert source.instance_dirs() == []


def test_resize_of_an_unknown_instance_fails_with_guest_not_found(source, dest):
    error = source.fails("resize_instance", str(uuid.uuid4()), resize_args(str(uuid.uuid4()), dest))

    assert error == "Ferry.GuestNotFound"
    assert source.instance_dirs() == []


# --- re-runs converge ---------------------------------------------------------------------------


def test_every_operation_run_again_gives_the_same_result(cloud, source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    prep = {"migration_uuid": migration_uuid, "flavor": NEW, "same_host": False}

    assert dest.ok("prep_resize", server.uuid, prep) == dest.ok("prep_resize", server.uuid, prep)

    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    assert source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest)) == resized
    assert resized["was_running"] is True

    finished = dest.ok("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))
    defined = dest.driver.defined
    assert dest.ok("finish_resize", server.uuid, finish_args(migration_uuid, server, resized)) == finished
    assert dest.driver.defined == defined

    reverted = dest.ok("revert_resize", server.uuid, revert_args(migration_uuid))
    assert dest.ok("revert_resize", server.uuid, revert_args(migration_uuid)) == reverted

    back = finish_revert_args(migration_uuid, server, True)
    restored = source.ok("finish_revert_resize", server.uuid, back)
    defined = source.driver.defined
    assert source.ok("finish_revert_resize", server.uuid, back) == restored
    assert source.driver.defined == defined
    assert restored["power_state"] == RUNNING
    assert_guest_has_flavor(source, server.uuid, OLD)


def test_a_resize_interrupted_after_the_guest_was_undefined_still_reports_it_was_running(
    cloud, source, dest, monkeypatch
):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    real_rename = os.rename

    def crash(src, dst):
        raise OSError(5, "the host went down")

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", crash)
        error = source.fails("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    assert error == "Ferry.HostOperationFailed"
    assert os.rename is real_rename
    assert not source.driver.guest_exists(server.uuid) and source.live(server.uuid).exists()

    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))

    assert resized["was_running"] is True
    assert resized["disks"]["root"]["sha256"] == server.root_digest
    assert source.instance_dirs() == [f"{server.uuid}_resize"]


def test_a_finish_interrupted_before_the_guest_was_defined_runs_again_from_the_transfer(source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    # What an agent that died after fetching the disks leaves behind: disks, no guest.
    live = dest.live(server.uuid)
    live.mkdir(parents=True)
    (live / disks.ROOT_DISK).write_bytes(b"half a disk")

    finished = dest.ok("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))

    assert finished["power_state"] == RUNNING
    assert logical_sha256(live / disks.ROOT_DISK, disks.GiB) == server.root_sha256


class Killed(BaseException):
    """The agent process dying mid-operation: no ``except Exception`` cleanup runs."""


def test_a_direct_finish_killed_before_the_guest_was_defined_runs_again_from_the_direct_copy(
    source, dest, monkeypatch
):
    server = boot(source)
    migration_uuid, _claim, resized = direct_resize(source, dest, server)
    args = {**finish_args(migration_uuid, server, resized), "direct": True}

    def die(spec):
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(dest.driver, "define_guest", die)
        with pytest.raises(Killed):
            dest.call("finish_resize", server.uuid, args)
    assert not dest.driver.guest_exists(server.uuid)

    finished = dest.ok("finish_resize", server.uuid, args)

    assert finished["power_state"] == RUNNING
    assert logical_sha256(dest.live(server.uuid) / disks.ROOT_DISK, disks.GiB) == server.root_sha256
    assert dest.instance_dirs() == [server.uuid], "the direct copy goes once the guest is defined on it"


def test_a_kept_directory_left_by_an_earlier_move_does_not_block_a_new_one(source, dest):
    server = boot(source)
    stale = source.kept(server.uuid)
    stale.mkdir()
    (stale / disks.ROOT_DISK).write_bytes(b"old")

    _migration, resized, finished = move(source, dest, server)

    assert resized["disks"]["root"]["sha256"] == server.root_digest
    assert finished["power_state"] == RUNNING


def test_a_resize_that_finds_no_guest_leaves_the_disks_an_earlier_move_kept(source, dest):
    # GIVEN an earlier move's kept disks, and beside them a live directory with no guest and no record
    server = boot(source)
    source.ok("resize_instance", server.uuid, resize_args(str(uuid.uuid4()), dest))
    kept = source.kept(server.uuid)
    before = sorted(p.name for p in kept.iterdir())
    source.live(server.uuid).mkdir()

    # WHEN another move's resize_instance runs, THEN it fails and the kept disks are still there
    assert source.fails("resize_instance", server.uuid, resize_args(str(uuid.uuid4()), dest)) == "Ferry.GuestNotFound"
    assert sorted(p.name for p in kept.iterdir()) == before


# --- fault injection ----------------------------------------------------------------------------


@pytest.fixture
def armed(cloud, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, str(tmp_path / "faults.json"))
    yield
    faults.disarm_all()


def test_an_armed_fault_fails_the_operation_with_its_error_before_it_touches_anything(armed, source, dest):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    faults.arm("compute2:finish_resize", faults.ONCE, "DiskCopyFailed")

    assert dest.fails("finish_resize", server.uuid, finish_args(migration_uuid, server, resized)) == (
        "Ferry.DiskCopyFailed"
    )
    assert dest.instance_dirs() == [] and dest.driver.defined == 0

    # A once fault is used up: the retry goes through.
    assert dest.ok("finish_resize", server.uuid, finish_args(migration_uuid, server, resized))["power_state"] == RUNNING


def test_a_fault_armed_for_any_host_fails_that_operation_everywhere(armed, source, dest):
    server = boot(source)
    faults.arm("*:prep_resize", faults.ALWAYS, "ResizeClaimFailed")
    prep = {"migration_uuid": str(uuid.uuid4()), "flavor": NEW, "same_host": False}

    assert dest.fails("prep_resize", server.uuid, prep) == "Ferry.ResizeClaimFailed"
    assert source.fails("prep_resize", server.uuid, prep) == "Ferry.ResizeClaimFailed"
    faults.arm("compute1:power_off")
    assert source.fails("power_off", server.uuid, {}) == "Ferry.InjectedFault"
    assert source.driver.guest_power_state(server.uuid) == RUNNING


# --- the resize claim ---------------------------------------------------------------------------


def test_prep_resize_refuses_a_flavor_whose_memory_the_host_no_longer_has(source, dest):
    boot(dest, flavor={**OLD, "memory_mb": HOST_MEMORY_MB - 1024})
    server = boot(source)
    prep = {"migration_uuid": str(uuid.uuid4()), "flavor": {**NEW, "memory_mb": 2048}, "same_host": False}

    assert dest.fails("prep_resize", server.uuid, prep) == "Ferry.ResizeClaimFailed"
    assert dest.ok("prep_resize", server.uuid, {**prep, "flavor": {**NEW, "memory_mb": 1024}})["claimed"] is True


def test_prep_resize_on_the_same_host_does_not_count_the_instance_itself(source):
    server = boot(source, flavor={**OLD, "memory_mb": HOST_MEMORY_MB - 1024})
    prep = {"migration_uuid": str(uuid.uuid4()), "flavor": {**NEW, "memory_mb": HOST_MEMORY_MB}, "same_host": True}

    claim = source.ok("prep_resize", server.uuid, prep)

    assert claim["claimed"] is True and claim["power_state"] == RUNNING


def _free_gib(host: Host) -> int:
    st = os.statvfs(host.instances_dir)
    return st.f_bavail * st.f_frsize // disks.GiB


def test_prep_resize_refuses_disks_the_filesystem_cannot_hold(cloud, dest):
    too_big = {**NEW, "root_gb": _free_gib(dest) + 10}
    prep = {"migration_uuid": str(uuid.uuid4()), "flavor": too_big, "same_host": False}

    assert dest.fails("prep_resize", str(uuid.uuid4()), prep) == "Ferry.ResizeClaimFailed"

    thin = cloud.add_host("compute3", disk_overcommit_ratio=4.0)
    assert thin.ok("prep_resize", str(uuid.uuid4()), {**prep, "flavor": {**NEW, "root_gb": _free_gib(dest) * 2}})
    unchecked = cloud.add_host("compute4", disk_headroom_check=False)
    assert unchecked.ok("prep_resize", str(uuid.uuid4()), prep)["claimed"] is True
    assert thin.fails("prep_resize", str(uuid.uuid4()), {**prep, "flavor": {**NEW, "root_gb": _free_gib(dest) * 8}})


def test_prep_resize_counts_no_root_disk_for_a_volume_backed_server(dest):
    # GIVEN a flavor whose root disk the instances filesystem cannot hold
    too_big = {**NEW, "root_gb": _free_gib(dest) + 10}
    prep = {"migration_uuid": str(uuid.uuid4()), "flavor": too_big, "same_host": False}

    # WHEN the server being moved is volume-backed (its root disk is not on the host)
    claim = dest.ok("prep_resize", str(uuid.uuid4()), {**prep, "is_bfv": True})

    # THEN the claim passes, as placement counted no root disk; an image-backed server's does not
    assert claim["claimed"] is True
    assert dest.fails("prep_resize", str(uuid.uuid4()), {**prep, "is_bfv": False}) == "Ferry.ResizeClaimFailed"
    assert dest.fails("prep_resize", str(uuid.uuid4()), prep) == "Ferry.ResizeClaimFailed"
    # its ephemeral disk is still the host's to hold
    ephemeral = {**prep, "is_bfv": True, "flavor": {**NEW, "ephemeral_gb": _free_gib(dest) + 10}}
    assert dest.fails("prep_resize", str(uuid.uuid4()), ephemeral) == "Ferry.ResizeClaimFailed"


# --- volumes ------------------------------------------------------------------------------------


def test_attach_and_detach_a_volume_repeat_safely(source):
    server = boot(source)
    volume = {"volume_id": "vol-9", "path": "/dev/mapper/vol-9", "device": "/dev/vdd"}

    first = source.ok("attach_volume", server.uuid, {"volume": volume})
    assert source.ok("attach_volume", server.uuid, {"volume": volume}) == first

    spec = source.driver.guest_spec(server.uuid)
    assert [(d.volume_id, d.path, d.device) for d in spec.disks if d.kind == "volume"] == [
        ("vol-9", "/dev/mapper/vol-9", "vdd")
    ]
    assert first["power_state"] == RUNNING

    source.ok("detach_volume", server.uuid, {"volume_id": "vol-9"})
    source.ok("detach_volume", server.uuid, {"volume_id": "vol-9"})
    assert [d for d in source.driver.guest_spec(server.uuid).disks if d.kind == "volume"] == []


def test_attach_to_an_unknown_guest_fails_with_guest_not_found_and_a_detach_from_it_is_already_done(source):
    volume = {"volume_id": "vol-9", "path": "/dev/mapper/vol-9", "device": "/dev/vdd"}
    instance_uuid = str(uuid.uuid4())

    assert source.fails("attach_volume", instance_uuid, {"volume": volume}) == "Ferry.GuestNotFound"
    # The attach's undo (and a later detach) find no guest to take the volume from: nothing to do.
    assert source.ok("detach_volume", instance_uuid, {"volume_id": "vol-9"})["power_state"] == NOSTATE


def test_attach_on_a_device_in_use_fails_with_invalid_operation(source):
    server = boot(source)
    volume = {"volume_id": "vol-9", "path": "/dev/mapper/vol-9", "device": "/dev/vdb"}

    assert source.fails("attach_volume", server.uuid, {"volume": volume}) == "Ferry.InvalidOperation"


def test_volumes_follow_the_server_to_the_destination(source, dest):
    volume = {"volume_id": "vol-7", "path": "/dev/mapper/vol-7", "device": "/dev/vdd", "boot_index": None}
    server = boot(source, volumes=None)
    source.ok("attach_volume", server.uuid, {"volume": volume})
    server.volumes = [volume]

    move(source, dest, server)

    spec = dest.driver.guest_spec(server.uuid)
    assert [(d.kind, d.volume_id, d.boot) for d in spec.disks] == [
        ("root", None, True),
        ("ephemeral", None, False),
        ("swap", None, False),
        ("volume", "vol-7", False),
    ]


# --- what earlier moves left -------------------------------------------------------------------


def kept_by_another_move(host: Host, server: Server, content: bytes = b"an earlier move's disk") -> Path:
    """A kept directory an earlier move left (its confirm's clean-up failed), with its record."""
    stale = host.kept(server.uuid)
    stale.mkdir()
    (stale / disks.ROOT_DISK).write_bytes(content)
    (stale / "migration.json").write_text(json.dumps({"migration_uuid": str(uuid.uuid4()), "was_running": True}))
    return stale


def test_a_same_host_revert_leaves_the_server_alone_beside_disks_another_move_kept(source):
    server = boot(source)
    stale = kept_by_another_move(source, server)

    reverted = source.ok("revert_resize", server.uuid, revert_args(str(uuid.uuid4()), same_host=True))

    assert reverted["power_state"] == RUNNING
    assert source.driver.guest_power_state(server.uuid) == RUNNING
    assert logical_sha256(source.live(server.uuid) / disks.ROOT_DISK) == server.root_sha256
    assert stale.exists()


def test_finish_revert_never_puts_disks_another_move_kept_over_the_live_ones(source):
    server = boot(source)
    stale = kept_by_another_move(source, server)

    restored = source.ok("finish_revert_resize", server.uuid, finish_revert_args(str(uuid.uuid4()), server, True))

    assert restored["power_state"] == RUNNING
    assert logical_sha256(source.live(server.uuid) / disks.ROOT_DISK) == server.root_sha256
    assert (stale / disks.ROOT_DISK).read_bytes() == b"an earlier move's disk"


def test_finish_resize_replaces_a_guest_an_earlier_move_left_on_the_destination(source, dest):
    server = boot(source)
    earlier, _resized, _finished = move(source, dest, server)
    # rolled back while the destination was unreachable: its guest and disks stay there
    source.ok("finish_revert_resize", server.uuid, finish_revert_args(earlier, server, True))
    with open(source.live(server.uuid) / disks.ROOT_DISK, "r+b") as root:
        root.write(b"written after the earlier move")
    current = logical_sha256(source.live(server.uuid) / disks.ROOT_DISK)

    _migration, _resized, finished = move(source, dest, server)

    assert finished["power_state"] == RUNNING
    assert logical_sha256(dest.live(server.uuid) / disks.ROOT_DISK, disks.GiB) == current
    assert dest.driver.defined == 2


def test_a_same_host_finish_refuses_a_guest_it_did_not_define(source):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, source, same_host=True))
    source.ok("spawn", server.uuid, {"name": "web-1", "flavor": OLD, "image": None, "ports": PORTS,
                                     "volumes": [{"volume_id": "v", "path": "/dev/null", "device": "/dev/vda"}],
                                     "power_on": False})

    error = source.fails("finish_resize", server.uuid, finish_args(migration_uuid, server, resized, same_host=True))

    assert error == "Ferry.HostOperationFailed"
    assert source.kept(server.uuid).exists()


@pytest.mark.parametrize(("code", "raises"), [(errno.EINVAL, False), (errno.EOPNOTSUPP, False), (errno.EIO, True)])
def test_a_file_system_that_cannot_sync_a_directory_is_let_be_but_a_failing_disk_is_not(
        tmp_path, monkeypatch, code, raises):
    def refused(_fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(disks.os, "fsync", refused)

    if raises:
        with pytest.raises(OSError):
            disks.sync_dir(tmp_path)
    else:
        disks.sync_dir(tmp_path)



@pytest.mark.parametrize("ends", ["while it runs", "as it is answered"])
def test_a_finish_resize_the_workflow_retried_while_it_ran_is_the_retrys_outcome(cloud, source, dest, monkeypatch,
                                                                                  ends):
    # GIVEN a finish_resize whose first Task ends while it runs (its SQS send tried again, or timed
    # out), the workflow's retry (a message with a task of its own) arriving as a copy meanwhile
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    resized = source.ok("resize_instance", server.uuid, resize_args(migration_uuid, dest))
    body = {"operation": "finish_resize", "operation_id": f"{migration_uuid}/FinishResizeOnDestHost/compute2",
            "instance_uuid": server.uuid, "args": finish_args(migration_uuid, server, resized)}
    queue, ended = dest.agent.queue_url, set()
    heartbeat, succeed = cloud.sfn.send_task_heartbeat, cloud.sfn.send_task_success

    def beat(taskToken):  # noqa: N803 - boto3's keyword
        if taskToken in ended and ends == "while it runs":
            raise TaskTimedOut(taskToken)
        heartbeat(taskToken=taskToken)

    def answer(taskToken, output):  # noqa: N803 - boto3's keyword
        if taskToken in ended:
            raise TaskTimedOut(taskToken)
        succeed(taskToken=taskToken, output=output)

    monkeypatch.setattr(cloud.sfn, "send_task_heartbeat", beat)
    monkeypatch.setattr(cloud.sfn, "send_task_success", answer)

    def send(token: str) -> None:
        cloud.sqs.send_message(QueueUrl=queue, MessageBody=json.dumps({**body, "task_token": token}))

    def received() -> list[dict[str, Any]]:
        return cloud.sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=1).get("Messages", [])

    finish = dest.agent._handlers["finish_resize"]

    def retried_meanwhile(op):
        ended.add("first")
        send("retry")
        (copy,) = received()
        dest.agent.process_message(copy)  # joins the running claim
        return finish(op)

    monkeypatch.setitem(dest.agent._handlers, "finish_resize", retried_meanwhile)
    send("first")
    (first,) = received()

    # WHEN the first delivery's run ends, and the retry's copy comes back
    dest.agent.process_message(first)
    monkeypatch.setitem(dest.agent._handlers, "finish_resize", finish)
    for message in received():
        dest.agent.process_message(message)

    # THEN the retry is answered with what the run did, which stands: the guest is defined there
    result, error, cause = cloud.sfn.answers["retry"]
    assert error is None, (error, cause)
    assert result is not None and dest.driver.guest_exists(server.uuid)
    assert "first" not in cloud.sfn.answers
