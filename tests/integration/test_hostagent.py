"""The host agent end to end: Step Functions task tokens, its SQS queue, the libvirt test driver, real disk files.

Each test runs an agent in a thread against moto (SQS, S3, CloudWatch and Step Functions executing a one-state
machine that sends the operation with ``sqs:sendMessage.waitForTaskToken``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto_credentials import REGION, use_moto_credentials

from ferry import config, errors, protocol
from ferry.local.runtime import moto_heartbeat_fixes
from hostagent import agent as agent_module
from hostagent import disks
from hostagent.agent import UNSURE_REDELIVERY_SECONDS, HostAgent, Operation, default_volumes_dirs, ensure_host_queue
from hostagent.driver import RUNNING, SHUTDOWN, CallUnderWay, LibvirtDriver, write_test_node_xml
from hostagent.journal import SUCCEEDED

BUCKET = "ferry-images"
QUEUE_PREFIX = "ferry-test-host-"
MiB = 2**20
GiB = 2**30
FLAVOR = {
    "flavorid": "2",
    "name": "m1.small",
    "vcpus": 2,
    "memory_mb": 1024,
    "root_gb": 1,
    "ephemeral_gb": 1,
    "swap": 64,
}
WAIT = 30.0


def wait_for(condition: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"gave up waiting for {what}")


class Recorder:
    """A boto3 client that records the calls made through it (and can run a hook on one)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.hooks: dict[str, Callable[[dict[str, Any]], None]] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name == "exceptions" or not callable(attr):
            return attr

        def call(**kwargs: Any) -> Any:
            self.calls.append((name, kwargs))
            hook = self.hooks.get(name)
            if hook:
                hook(kwargs)
            return attr(**kwargs)

        return call

    def called(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for call, kwargs in self.calls if call == name]


class ObservedDriver(LibvirtDriver):
    """The libvirt driver, counting guest definitions and able to hold power_on (or power_off) until released."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.defined = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.off_gate: threading.Event | None = None
        self.off_entered = threading.Event()

    def define_guest(self, spec):  # type: ignore[no-untyped-def]
        self.defined += 1
        super().define_guest(spec)

    def power_on(self, instance_uuid: str) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT), "power_on was never released"
        super().power_on(instance_uuid)

    def power_off(self, instance_uuid: str, timeout: float = 60.0, clean_shutdown: bool = True) -> None:
        self.off_entered.set()
        if self.off_gate is not None:
            assert self.off_gate.wait(WAIT), "power_off was never released"
        super().power_off(instance_uuid, timeout=timeout, clean_shutdown=clean_shutdown)


@dataclass
class Host:
    agent: HostAgent
    driver: ObservedDriver
    sqs: Recorder
    sfn: Recorder
    s3: Any
    cloudwatch: Recorder
    reports_url: str
    state_machine_arn: str
    instances_dir: Path
    thread: threading.Thread
    errors: list[BaseException] = field(default_factory=list)

    @property
    def queue_url(self) -> str:
        assert self.agent.queue_url
        return self.agent.queue_url

    def execute(
        self, operation: str, instance_uuid: str, args: dict[str, Any], operation_id: str | None = None
    ) -> dict[str, Any]:
        """Run the operation through Step Functions and return the finished execution."""
        arn = self.start(operation, instance_uuid, args, operation_id)
        return self.finished(arn)

    def start(self, operation: str, instance_uuid: str, args: dict[str, Any], operation_id: str | None = None) -> str:
        payload = {
            "operation": operation,
            "operation_id": operation_id or f"{uuid.uuid4()}:{operation}",
            "instance_uuid": instance_uuid,
            "args": args,
        }
        return self.sfn.start_execution(
            stateMachineArn=self.state_machine_arn, name=str(uuid.uuid4()), input=json.dumps(payload)
        )["executionArn"]

    def finished(self, execution_arn: str) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            described = self.sfn.describe_execution(executionArn=execution_arn)
            return described if described["status"] != "RUNNING" else None

        return wait_for(done, f"execution {execution_arn}")

    def image(self, content: bytes, key: str | None = None) -> dict[str, str]:
        key = key or f"images/{uuid.uuid4()}.raw"
        self.s3.put_object(Bucket=BUCKET, Key=key, Body=content)
        return {"id": key, "bucket": BUCKET, "key": key, "sha256": hashlib.sha256(content).hexdigest()}

    def idle(self) -> bool:
        """Whether the agent holds no operation and its queue is empty: a message sent now is a
        delivery of its own, not a copy joined to a claim still being ended (and settled with it)."""
        with self.agent._claims_guard:
            if self.agent._claims:
                return False
        return self.queue_is_empty()

    def queue_is_empty(self) -> bool:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return attrs["ApproximateNumberOfMessages"] == "0" and attrs["ApproximateNumberOfMessagesNotVisible"] == "0"

    def reports(self) -> list[dict[str, Any]]:
        messages = self.sqs.receive_message(QueueUrl=self.reports_url, MaxNumberOfMessages=10).get("Messages", [])
        return [json.loads(m["Body"]) for m in messages]


def spawn_args(image: dict[str, str] | None, **changes: Any) -> dict[str, Any]:
    args = {
        "name": "web-1",
        "flavor": FLAVOR,
        "image": image,
        "ports": [
            {"id": "port-1", "mac_address": "fa:16:3e:11:22:33"},
            {"id": "port-2", "mac_address": "fa:16:3e:44:55:66"},
        ],
        "volumes": [],
        "power_on": True,
    }
    args.update(changes)
    return args


def state_machine_definition(queue_url: str) -> str:
    return json.dumps(
        {
            "StartAt": "HostOperation",
            "States": {
                "HostOperation": {
                    "Type": "Task",
                    "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
                    "HeartbeatSeconds": 30,
                    "Parameters": {
                        "QueueUrl": queue_url,
                        "MessageBody": {
                            "operation.$": "$.operation",
                            "operation_id.$": "$.operation_id",
                            "instance_uuid.$": "$.instance_uuid",
                            "args.$": "$.args",
                            "task_token.$": "$$.Task.Token",
                        },
                    },
                    "End": True,
                }
            },
        }
    )


@pytest.fixture
def cloud(monkeypatch) -> Iterator[None]:
    use_moto_credentials(monkeypatch)
    # As in the local stack: moto sends a task's message before it can take the task's heartbeat,
    # so an agent that heartbeats at once would otherwise be told the task is gone, now and then.
    for (owner, attribute), replacement in moto_heartbeat_fixes().items():
        monkeypatch.setattr(owner, attribute, replacement)
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        yield


@pytest.fixture
def host(cloud, tmp_path, request) -> Iterator[Host]:
    """An agent running in a thread; ``HostAgent`` options may come as the fixture's indirect parameter."""
    sqs = Recorder(boto3.client("sqs", region_name=REGION))
    sfn = Recorder(boto3.client("stepfunctions", region_name=REGION))
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=BUCKET)
    cloudwatch = Recorder(boto3.client("cloudwatch", region_name=REGION))
    reports_url = sqs.create_queue(QueueName="ferry-test-host-reports")["QueueUrl"]
    instances_dir = tmp_path / "instances"
    driver = ObservedDriver(
        write_test_node_xml(tmp_path / "node.xml", vcpus=16, memory_mb=32768), disk_path=instances_dir
    )
    agent = HostAgent(
        host="compute1",
        node="compute1",
        cell="cell1",
        queue_url=None,
        reports_queue_url=reports_url,
        driver=driver,
        instances_dir=instances_dir,
        state_dir=tmp_path / "state",
        queue_prefix=QUEUE_PREFIX,
        sqs=sqs,
        stepfunctions=sfn,
        s3=s3,
        cloudwatch=cloudwatch,
        **{
            "poll_wait_seconds": 0,
            "idle_wait_seconds": 0.02,
            "keepalive_interval": 0.1,
            "report_interval": 3600,
            "heartbeat_interval": 3600,
            **getattr(request, "param", {}),
        },
    )
    agent.start()
    assert agent.queue_url
    state_machine_arn = sfn.create_state_machine(
        name="host-operation",
        definition=state_machine_definition(agent.queue_url),
        roleArn="arn:aws:iam::123456789012:role/ferry-test",
    )["stateMachineArn"]
    failures: list[BaseException] = []

    def run() -> None:
        try:
            agent.run()
        except BaseException as exc:  # surfaced by the fixture's teardown
            failures.append(exc)

    thread = threading.Thread(target=run, name="host-agent", daemon=True)
    thread.start()
    env = Host(
        agent=agent,
        driver=driver,
        sqs=sqs,
        sfn=sfn,
        s3=s3,
        cloudwatch=cloudwatch,
        reports_url=reports_url,
        state_machine_arn=state_machine_arn,
        instances_dir=instances_dir,
        thread=thread,
        errors=failures,
    )
    yield env
    for gate in (driver.gate, driver.off_gate):
        if gate is not None:
            gate.set()
    agent.stop()
    thread.join(WAIT)
    assert not thread.is_alive(), "the agent did not stop"
    assert failures == []
    driver.close()


def output(execution: dict[str, Any]) -> dict[str, Any]:
    assert execution["status"] == "SUCCEEDED", execution
    return json.loads(execution["output"])


def failure(execution: dict[str, Any]) -> str:
    assert execution["status"] == "FAILED", execution
    return str(execution["error"])


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def journal_entry(host: Host, operation_id: str):
    assert host.agent.journal is not None
    return host.agent.journal.get(operation_id)


# --- spawn ---------------------------------------------------------------------------------------


def test_spawn_creates_a_running_guest_with_the_flavor_ports_and_sparse_disks(host):
    content = os.urandom(MiB) + bytes(2 * MiB) + b"end of image"
    instance_uuid = str(uuid.uuid4())

    result = output(host.execute("spawn", instance_uuid, spawn_args(host.image(content))))

    assert result == {"instance_uuid": instance_uuid, "host": "compute1", "node": "compute1", "power_state": RUNNING}
    assert host.driver.guest_power_state(instance_uuid) == RUNNING
    dom = host.driver.connection.lookupByUUIDString(instance_uuid)
    state, max_mem_kib, _mem, vcpus, _cpu_time = dom.info()
    assert (vcpus, max_mem_kib) == (2, 1024 * 1024)
    xml = dom.XMLDesc(0)
    assert "fa:16:3e:11:22:33" in xml and "fa:16:3e:44:55:66" in xml
    directory = disks.instance_dir(host.instances_dir, instance_uuid)
    root, eph, swap = directory / "disk", directory / "disk.eph0", directory / "disk.swap"
    assert os.path.getsize(root) == 1 * GiB
    assert os.path.getsize(eph) == 1 * GiB
    assert os.path.getsize(swap) == 64 * MiB
    assert allocated(root) < 8 * MiB and allocated(eph) == 0 and allocated(swap) == 0
    with open(root, "rb") as f:
        assert f.read(len(content)) == content
    assert [(d.kind, d.device, d.path) for d in host.driver.guest_spec(instance_uuid).disks] == [
        ("root", "vda", str(root)),
        ("ephemeral", "vdb", str(eph)),
        ("swap", "vdc", str(swap)),
    ]
    assert wait_for(host.queue_is_empty, "the message to be deleted")


def test_a_spawn_answers_once_its_new_instance_directory_is_synced_in_the_instances_directory(host, monkeypatch):
    synced: list[tuple[Path, list[str]]] = []  # each directory synced, with what it then held
    real_sync_dir = disks.sync_dir

    def recording(directory):  # type: ignore[no-untyped-def]
        synced.append((Path(directory), sorted(os.listdir(directory))))
        real_sync_dir(directory)

    monkeypatch.setattr(disks, "sync_dir", recording)
    instance_uuid = str(uuid.uuid4())

    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))

    assert any(path == host.instances_dir and instance_uuid in names for path, names in synced)


def test_spawn_without_power_on_leaves_the_guest_shut_off(host):
    instance_uuid = str(uuid.uuid4())
    args = spawn_args(host.image(b"x" * 4096), power_on=False, flavor={**FLAVOR, "ephemeral_gb": 0, "swap": 0})

    result = output(host.execute("spawn", instance_uuid, args))

    assert result["power_state"] == SHUTDOWN
    directory = disks.instance_dir(host.instances_dir, instance_uuid)
    assert sorted(p.name for p in directory.iterdir()) == ["disk", "spawn.json"]


def test_volume_backed_spawn_boots_from_the_volume_without_a_root_disk(host):
    instance_uuid = str(uuid.uuid4())
    volume = {"volume_id": "vol-1", "path": "/dev/mapper/vol-1", "device": "/dev/vda", "boot_index": 0}
    args = spawn_args(None, volumes=[volume], flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})

    output(host.execute("spawn", instance_uuid, args))

    spec = host.driver.guest_spec(instance_uuid)
    assert [(d.kind, d.device, d.volume_id, d.boot) for d in spec.disks] == [("volume", "vda", "vol-1", True)]
    assert not (disks.instance_dir(host.instances_dir, instance_uuid) / "disk").exists()


@pytest.mark.parametrize("message", ["current", "older"])
def test_spawn_creates_a_new_volume_from_its_source_image(host, message):
    instance_uuid = str(uuid.uuid4())
    content = os.urandom(MiB) + b"volume image"
    path = host.instances_dir.parent / "volumes" / "vol-2"
    volume = {
        "volume_id": "vol-2",
        "path": str(path),
        "device": "/dev/vda",
        "boot_index": 0,
        "size_gb": 1,
        "source_image": host.image(content),
    }
    if message == "current":  # an older message named no source: its source image alone tells a new volume
        volume["source_type"] = "image"
    args = spawn_args(None, volumes=[volume], flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})

    output(host.execute("spawn", instance_uuid, args))

    assert os.path.getsize(path) == GiB
    with open(path, "rb") as f:
        assert f.read(len(content)) == content
    assert [d.path for d in host.driver.guest_spec(instance_uuid).disks] == [str(path)]


def test_a_volume_whose_image_is_corrupt_is_not_left_behind(host):
    instance_uuid = str(uuid.uuid4())
    path = host.instances_dir.parent / "volumes" / "vol-3"
    image = {**host.image(os.urandom(MiB)), "sha256": "0" * 64}
    volume = {
        "volume_id": "vol-3",
        "path": str(path),
        "device": "/dev/vda",
        "boot_index": 0,
        "size_gb": 1,
        "source_image": image,
    }
    args = spawn_args(None, volumes=[volume], flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})

    assert failure(host.execute("spawn", instance_uuid, args)) == "Ferry.ImageDownloadFailed"

    assert not path.exists()
    assert not host.driver.guest_exists(instance_uuid)


def test_the_same_spawn_run_again_keeps_its_guest_without_redefining_it(host):
    instance_uuid, operation_id = str(uuid.uuid4()), f"{uuid.uuid4()}:spawn"
    args = spawn_args(host.image(b"boot" * 1024))
    output(host.execute("spawn", instance_uuid, args, operation_id=operation_id))
    host.driver.power_off(instance_uuid)

    # run again as after a crash before its answer was journaled
    again = host.agent.spawn(Operation("spawn", operation_id, instance_uuid, args, None))

    assert again["power_state"] == RUNNING
    assert host.driver.defined == 1


@pytest.mark.parametrize("left", ["guest and disks", "disks only"])
def test_a_spawn_replaces_what_an_earlier_operation_left(host, left):
    instance_uuid = str(uuid.uuid4())
    old, new = b"old!" * 1024, b"new!" * 1024
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(old))))
    if left == "disks only":
        host.driver.destroy(instance_uuid)
    root = disks.root_disk_path(host.instances_dir, instance_uuid)
    assert root.read_bytes()[:len(old)] == old

    result = output(host.execute("spawn", instance_uuid, spawn_args(host.image(new))))

    assert result["power_state"] == RUNNING
    assert root.read_bytes()[:len(new)] == new  # never the earlier operation's disk
    assert host.driver.defined == 2


def test_a_spawn_run_again_that_fails_removes_what_its_first_attempt_made(host):
    instance_uuid, operation_id = str(uuid.uuid4()), f"{uuid.uuid4()}:spawn"
    volume_path = host.instances_dir.parent / "volumes" / "vol-4"
    volume_path.parent.mkdir(parents=True, exist_ok=True)
    volume_path.write_bytes(b"made by the first attempt")
    directory = disks.instance_dir(host.instances_dir, instance_uuid)
    directory.mkdir(parents=True)
    made = list(disks.file_identity(volume_path))
    (directory / "spawn.json").write_text(json.dumps({"operation_id": operation_id,
                                                      "created_volumes": [str(volume_path)],
                                                      "created_volume_files": {str(volume_path): made}}))
    volume = {"volume_id": "vol-4", "path": str(volume_path), "device": "/dev/vda", "boot_index": 0, "size_gb": 1,
              "source_type": "blank"}
    args = spawn_args(None, volumes=[volume], ports=[{"id": "port-1", "mac_address": "not-a-mac"}],
                      flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})

    assert failure(host.execute("spawn", instance_uuid, args, operation_id=operation_id)) == "Ferry.HypervisorError"

    assert not directory.exists() and not volume_path.exists()
    assert not host.driver.guest_exists(instance_uuid)



class Crash(BaseException):
    """The agent's process dying at that point (nothing after it runs, no handler catches it)."""


def test_a_spawn_run_again_after_a_crash_right_after_its_volume_file_took_its_name_removes_that_file(
    host, monkeypatch
):
    # GIVEN a spawn whose agent died right after the new volume's file took its name
    instance_uuid, operation_id = str(uuid.uuid4()), f"{uuid.uuid4()}:spawn"
    volume_path = host.instances_dir.parent / "volumes" / "vol-4"
    volume = {"volume_id": "vol-4", "path": str(volume_path), "device": "/dev/vda", "boot_index": 0, "size_gb": 1,
              "source_type": "blank"}
    args = spawn_args(None, volumes=[volume], ports=[{"id": "port-1", "mac_address": "not-a-mac"}],
                      flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})
    link = os.link

    def link_then_crash(src, dst, *link_args, **kwargs):
        link(src, dst, *link_args, **kwargs)
        raise Crash

    with monkeypatch.context() as patched:
        patched.setattr(os, "link", link_then_crash)
        with pytest.raises(Crash):
            host.agent.spawn(Operation("spawn", operation_id, instance_uuid, args, None))
    assert volume_path.exists()

    # WHEN the spawn, run again, fails
    assert failure(host.execute("spawn", instance_uuid, args, operation_id=operation_id)) == "Ferry.HypervisorError"

    # THEN the file its first attempt made is known as its own and removed
    assert not volume_path.exists()
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()

def new_volume_spawn(host: Host, *names: str) -> tuple[dict[str, Any], list[Path]]:
    """Spawn arguments of a server booting from new volumes the spawn makes, whose power on fails."""
    paths = [host.instances_dir.parent / "volumes" / name for name in names]
    volumes = [{"volume_id": path.name, "path": str(path), "device": f"/dev/vd{'abcd'[i]}",
                "boot_index": 0 if i == 0 else None, "size_gb": 1, "source_type": "blank"}
               for i, path in enumerate(paths)]
    return spawn_args(None, volumes=volumes, flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0}), paths


def refuse_power_on(_instance_uuid: str) -> None:
    raise errors.HypervisorError("power on failed: no")


def test_a_failed_spawn_whose_guest_cannot_be_destroyed_leaves_its_volume_file_to_the_destroy_that_follows(
        host, monkeypatch):
    # GIVEN two spawns that made their volume's file and failed, whose undo could not destroy the guest
    rolled_back, retried = str(uuid.uuid4()), str(uuid.uuid4())
    rolled_back_args, (rolled_back_volume,) = new_volume_spawn(host, "vol-5")
    retried_args, (retried_volume,) = new_volume_spawn(host, "vol-8")
    retried_id = f"{uuid.uuid4()}:spawn"

    def refused(_uuid: str) -> None:
        raise errors.HypervisorError("destroy failed: busy")

    with monkeypatch.context() as patched:
        patched.setattr(host.driver, "power_on", refuse_power_on)
        patched.setattr(host.driver, "destroy", refused)
        assert failure(host.execute("spawn", rolled_back, rolled_back_args)) == "Ferry.HypervisorError"
        assert failure(host.execute("spawn", retried, retried_args, operation_id=retried_id)) \
            == "Ferry.HypervisorError"
    assert host.driver.guest_exists(rolled_back) and rolled_back_volume.exists(), "the guest may still write it"

    # WHEN the first is destroyed by the workflow's rollback, and the second run again (it succeeds)
    # before its server is deleted, its volume kept
    output(host.execute("destroy", rolled_back, {}))
    assert output(host.execute("spawn", retried, retried_args, operation_id=retried_id))["power_state"] == RUNNING
    output(host.execute("destroy", retried, {}))

    # THEN the volume file the failed spawn made goes with its guest and directory; the file of the
    # spawn that succeeded is its volume's, and stays
    assert not host.driver.guest_exists(rolled_back)
    assert not rolled_back_volume.exists()
    assert not disks.instance_dir(host.instances_dir, rolled_back).exists()
    assert retried_volume.exists()


def test_undoing_a_failed_spawn_removes_every_volume_file_it_can_and_keeps_listed_one_it_cannot(host, monkeypatch):
    # GIVEN a spawn that made two volume files and failed, the first of which cannot be removed at first
    instance_uuid = str(uuid.uuid4())
    args, (stuck, other) = new_volume_spawn(host, "vol-6", "vol-7")
    remove, refused = disks.remove_file_made, []

    def refused_once(path, identity):  # type: ignore[no-untyped-def]
        if Path(path).name == stuck.name and not refused:
            refused.append(path)
            raise OSError(16, "Device or resource busy")
        return remove(path, identity)

    monkeypatch.setattr(host.driver, "power_on", refuse_power_on)
    monkeypatch.setattr(disks, "remove_file_made", refused_once)

    # WHEN the spawn's undo runs
    assert failure(host.execute("spawn", instance_uuid, args)) == "Ferry.HypervisorError"

    # THEN the other file is gone, and the one left stays listed for the destroy that follows
    assert refused and stuck.exists() and not other.exists()
    assert not host.driver.guest_exists(instance_uuid)
    output(host.execute("destroy", instance_uuid, {}))
    assert not stuck.exists()
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()


def test_corrupt_image_fails_with_image_download_failed_and_leaves_no_files(host):
    instance_uuid = str(uuid.uuid4())
    image = {**host.image(os.urandom(MiB)), "sha256": hashlib.sha256(b"another image").hexdigest()}

    error = failure(host.execute("spawn", instance_uuid, spawn_args(image)))

    assert error == "Ferry.ImageDownloadFailed"
    assert not host.driver.guest_exists(instance_uuid)
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()
    assert [p for p in host.instances_dir.rglob("*") if p.is_file()] == []


def test_hypervisor_refusal_fails_with_hypervisor_error_and_leaves_nothing(host):
    instance_uuid = str(uuid.uuid4())
    args = spawn_args(host.image(b"x" * 4096), ports=[{"id": "port-1", "mac_address": "not-a-mac"}])

    error = failure(host.execute("spawn", instance_uuid, args))

    assert error == "Ferry.HypervisorError"
    assert not host.driver.guest_exists(instance_uuid)
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()


# --- power and destroy ---------------------------------------------------------------------------


def test_power_off_and_power_on_change_the_power_state(host):
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))

    assert output(host.execute("power_off", instance_uuid, {}))["power_state"] == SHUTDOWN
    assert host.driver.guest_power_state(instance_uuid) == SHUTDOWN
    assert output(host.execute("power_off", instance_uuid, {"timeout": 1}))["power_state"] == SHUTDOWN

    assert output(host.execute("power_on", instance_uuid, {}))["power_state"] == RUNNING
    assert host.driver.guest_power_state(instance_uuid) == RUNNING


def test_power_on_of_an_unknown_guest_fails_with_guest_not_found(host):
    assert failure(host.execute("power_on", str(uuid.uuid4()), {})) == "Ferry.GuestNotFound"


def test_destroy_removes_the_guest_and_its_instance_directory_and_repeats_safely(host):
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))

    assert output(host.execute("destroy", instance_uuid, {}))["power_state"] == 0
    assert output(host.execute("destroy", instance_uuid, {}))["power_state"] == 0

    assert not host.driver.guest_exists(instance_uuid)
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()


def test_destroy_of_an_absent_guest_removes_leftover_disks(host):
    instance_uuid = str(uuid.uuid4())
    disks.create_sparse(disks.root_disk_path(host.instances_dir, instance_uuid), MiB)

    output(host.execute("destroy", instance_uuid, {}))

    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()


def test_destroy_keeping_disks_removes_only_the_guest(host):
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))

    output(host.execute("destroy", instance_uuid, {"keep_disks": True}))

    assert not host.driver.guest_exists(instance_uuid)
    assert (disks.instance_dir(host.instances_dir, instance_uuid) / "disk").exists()


def logged(caplog: pytest.LogCaptureFixture, message: str, volume_id: str) -> bool:
    """Whether the agent logged ``message`` about the volume ``volume_id``."""
    return any(record.getMessage() == message and getattr(record, "volume_id", None) == volume_id
               for record in caplog.records)


def test_destroy_removes_the_files_of_the_volumes_deleted_with_the_server_and_repeats_safely(host, caplog):
    # GIVEN a server booted from a new volume the host made, a volume in the volumes directory whose
    # path is not such a file, and one named like such a file but outside the volumes directories
    instance_uuid = str(uuid.uuid4())
    path = host.instances_dir.parent / "volumes" / "vol-4"
    boot_volume = {"volume_id": "vol-4", "path": str(path), "device": "/dev/vda", "boot_index": 0, "size_gb": 1,
                   "source_type": "blank"}
    foreign = host.instances_dir.parent / "volumes" / "storage" / "vol-5.img"
    refused = host.instances_dir.parent / "storage" / "vol-19"
    for volume_file in (foreign, refused):
        volume_file.parent.mkdir(parents=True, exist_ok=True)
        volume_file.write_bytes(b"the storage's own")
    args = spawn_args(None, volumes=[boot_volume], flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})
    output(host.execute("spawn", instance_uuid, args))
    assert path.is_file()
    doomed = {"volumes": [{"volume_id": "vol-4", "path": str(path)},
                          {"volume_id": "vol-5", "path": str(foreign)},
                          {"volume_id": "vol-19", "path": str(refused)}]}

    # WHEN the server is destroyed with the three volumes, twice (a redelivered or retried destroy)
    first = output(host.execute("destroy", instance_uuid, doomed))
    again = output(host.execute("destroy", instance_uuid, doomed))

    # THEN the host's file is gone and named; what it did not make, or may not remove, is left and not named
    assert first["volumes_removed"] == again["volumes_removed"] == ["vol-4"]
    assert not path.exists()
    assert foreign.read_bytes() == refused.read_bytes() == b"the storage's own"
    assert logged(caplog, "volume left to its storage: no file the hosts made", "vol-5")
    assert logged(caplog, "volume file not removed: refused", "vol-19")
    assert not host.driver.guest_exists(instance_uuid)


@pytest.mark.parametrize("kind", ["directory", "link", "other name"])
def test_a_volume_path_that_is_no_file_named_after_the_volume_is_never_removed(tmp_path, kind):
    target = tmp_path / "target"
    target.write_bytes(b"data")
    path = tmp_path / "vol-6"
    if kind == "directory":
        path.mkdir()
    elif kind == "link":
        path.symlink_to(target)
    else:
        path = target

    assert disks.remove_volume_file(path, "vol-6") is False
    assert path.exists() and target.read_bytes() == b"data"


def test_an_absent_volume_file_is_gone_only_beside_the_volumes_marker(tmp_path):
    # an empty directory may be a mount point whose storage is not mounted here: nothing is told
    assert disks.remove_volume_file(tmp_path / "vol-7", "vol-7") is False
    assert disks.remove_volume_file(tmp_path / "unmounted" / "vol-7", "vol-7") is False

    protocol.mark_volume_dir(tmp_path)

    assert disks.remove_volume_file(tmp_path / "vol-7", "vol-7") is True
    assert disks.remove_volume_file(tmp_path / "data-01", "vol-7") is False  # a device, not a file hosts made


def test_a_spawn_that_makes_a_volume_file_marks_its_directory(host):
    path = host.instances_dir.parent / "volumes" / "vol-9"

    output(host.execute("spawn", str(uuid.uuid4()), volume_boot_args("vol-9", path)))

    assert path.is_file() and (path.parent / protocol.VOLUME_DIR_MARKER).is_file()


@pytest.mark.parametrize("message", ["older", "current"])
def test_a_spawn_never_makes_a_blank_file_for_an_existing_volume_whose_file_is_missing(host, message):
    # GIVEN a server booting from an existing volume whose file is not on this host, as
    # BindResourcesAtDest asks it: before (every volume with its size), or now (its source named)
    path = host.instances_dir.parent / "volumes" / "vol-x"
    volume = {"volume_id": "vol-x", "path": str(path), "device": "/dev/vda", "boot_index": 0,
              **({"size_gb": 1} if message == "older" else {"source_type": "volume"})}
    args = spawn_args(None, volumes=[volume], flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})
    instance_uuid = str(uuid.uuid4())

    # WHEN it is spawned, THEN the spawn fails and makes nothing: no blank disk in place of the owner's data
    assert failure(host.execute("spawn", instance_uuid, args)) == "Ferry.SpawnFailed"
    assert not path.exists() and not (path.parent / protocol.VOLUME_DIR_MARKER).exists()
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()
    assert not host.driver.guest_exists(instance_uuid)


@pytest.mark.parametrize("kind", ["empty", "from an image"])
def test_a_spawn_never_writes_over_a_volume_file_another_attempt_made_meanwhile(host, monkeypatch, kind):
    # GIVEN a spawn making a volume file, and another attempt to boot the server (rescheduled to
    # another host while this one ran long) that makes the same file while this one writes it
    path = host.instances_dir.parent / "volumes" / "vol-31"
    volume = {"volume_id": "vol-31", "path": str(path), "device": "/dev/vda", "boot_index": 0, "size_gb": 1,
              "source_type": "blank"}
    if kind == "from an image":
        volume.update(source_type="image", source_image=host.image(os.urandom(MiB)))
    args = spawn_args(None, volumes=[volume], flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})
    sweep = disks.remove_abandoned_parts

    def other_attempt_makes_it(directory: Path, name: str | None = None) -> list[Path]:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"the volume another host booted from")
        return sweep(directory, name)

    monkeypatch.setattr(disks, "remove_abandoned_parts", other_attempt_makes_it)
    instance_uuid = str(uuid.uuid4())

    # WHEN the spawn finishes writing
    error = failure(host.execute("spawn", instance_uuid, args))

    # THEN it fails, leaving the other attempt's file as it was, and nothing of its own
    assert error == "Ferry.SpawnFailed"
    assert path.read_bytes() == b"the volume another host booted from"
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(disks.PART_SUFFIX)] == []
    assert not host.driver.guest_exists(instance_uuid)
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()


def test_a_failed_spawn_leaves_a_volume_file_another_attempt_put_in_place_of_its_own(host, monkeypatch):
    # GIVEN a spawn that made a volume file, which another attempt replaced before the spawn failed
    path = host.instances_dir.parent / "volumes" / "vol-32"
    args = {**volume_boot_args("vol-32", path), "ports": [{"id": "port-1", "mac_address": "not-a-mac"}]}
    define = host.driver.define_guest

    def replaced_then_define(spec):  # type: ignore[no-untyped-def]
        assert path.is_file()
        other = path.with_name("vol-32.other")
        other.write_bytes(b"another attempt's volume")
        os.replace(other, path)
        define(spec)

    monkeypatch.setattr(host.driver, "define_guest", replaced_then_define)
    instance_uuid = str(uuid.uuid4())

    # WHEN the spawn fails and is undone
    assert failure(host.execute("spawn", instance_uuid, args)) == "Ferry.HypervisorError"

    # THEN the file it did not make is left
    assert path.read_bytes() == b"another attempt's volume"
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()


def test_a_failed_spawn_removes_the_volume_file_it_made(host):
    path = host.instances_dir.parent / "volumes" / "vol-33"
    args = {**volume_boot_args("vol-33", path), "ports": [{"id": "port-1", "mac_address": "not-a-mac"}]}

    assert failure(host.execute("spawn", str(uuid.uuid4()), args)) == "Ferry.HypervisorError"

    assert not path.exists()


def test_a_cached_image_a_new_volume_is_copied_from_is_not_pruned_meanwhile(host, monkeypatch):
    # GIVEN an image in the cache that no spawn used for more than its max age
    volume_image = host.image(os.urandom(MiB))
    output(host.execute("spawn", str(uuid.uuid4()), spawn_args(volume_image)))
    cached = host.agent.instances_dir / disks.IMAGE_CACHE_DIR / volume_image["sha256"]
    day_and_a_bit = time.time() - 25 * 3600
    os.utime(cached, (day_and_a_bit, day_and_a_bit))
    path = host.instances_dir.parent / "volumes" / "vol-34"
    volume = {"volume_id": "vol-34", "path": str(path), "device": "/dev/vdd", "size_gb": 1,
              "source_image": volume_image}
    create_root_disk, pruned = disks.create_root_disk, []

    def pruned_while_copying(s3, image, size, dest, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(dest) == path:
            pruned.extend(host.agent.prune_image_cache())  # the reporter thread's prune, right then
        return create_root_disk(s3, image, size, dest, *args, **kwargs)

    monkeypatch.setattr(disks, "create_root_disk", pruned_while_copying)

    # WHEN a spawn makes a volume from it (beside a root disk from another image)
    output(host.execute("spawn", str(uuid.uuid4()), spawn_args(host.image(b"x" * 4096), volumes=[volume])))

    # THEN the prune kept it, and the spawn marked it used
    assert pruned == []
    assert cached.exists() and cached.stat().st_mtime > day_and_a_bit + 3600


def test_a_volume_file_that_cannot_be_removed_is_left_and_the_destroy_goes_on(host, caplog):
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))
    blocked = host.instances_dir.parent / "volumes" / "not-a-directory"  # in the volumes directory: may be removed
    blocked.parent.mkdir(exist_ok=True)
    blocked.write_bytes(b"")

    result = output(host.execute("destroy", instance_uuid, {"volumes": [
        {"volume_id": "vol-8", "path": str(blocked / "vol-8")}]}))

    assert result["volumes_removed"] == []
    assert logged(caplog, "volume file not removed", "vol-8")  # the removal failed; it was not refused
    assert not logged(caplog, "volume file not removed: refused", "vol-8")
    assert not host.driver.guest_exists(instance_uuid)
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()


# --- volume files --------------------------------------------------------------------------------


class HeldImageStore:
    """An S3 client serving one object that stops after its first half until ``go`` is set."""

    def __init__(self, content: bytes, go: threading.Event) -> None:
        self.content = content
        self.go = go
        self.holding = threading.Event()

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:  # noqa: N803 - boto3's names
        return {"Body": self}

    def iter_chunks(self, chunk_size: int) -> Iterator[bytes]:
        half = len(self.content) // 2
        self.holding.set()  # the write holds its temporary file by now
        yield self.content[:half]
        assert self.go.wait(WAIT), "the write was never let go on"
        yield self.content[half:]

    def close(self) -> None:
        pass


@pytest.fixture
def stack_state_dir(tmp_path, monkeypatch) -> Iterator[Path]:
    """``FERRY_STATE_DIR`` as the local stack sets it for its compute API and its agents."""
    state_dir = tmp_path / "stack"
    monkeypatch.setenv("FERRY_STATE_DIR", str(state_dir))
    config.reset()
    yield state_dir
    config.reset()


def another_agent(host: Host, tmp_path: Path, name: str, **options: Any) -> HostAgent:
    """An agent beside the host's, on the same hypervisor and queue, with instances in ``tmp_path/name``."""
    return HostAgent(host=name, node=name, cell="cell1", queue_url=host.queue_url, reports_queue_url="",
                     driver=host.driver, instances_dir=tmp_path / name, state_dir=tmp_path / f"{name}-state",
                     sqs=host.sqs, stepfunctions=host.sfn, s3=host.s3, **options)


def volume_boot_args(volume_id: str, path: Path) -> dict[str, Any]:
    """A spawn booting from a new blank 1 GiB volume the host makes at ``path``."""
    volume = {"volume_id": volume_id, "path": str(path), "device": "/dev/vda", "boot_index": 0, "size_gb": 1,
              "source_type": "blank"}
    return spawn_args(None, volumes=[volume], flavor={**FLAVOR, "root_gb": 0, "ephemeral_gb": 0, "swap": 0})


def escaping(tmp_path: Path, volumes: Path, escape: str, name: str) -> Path:
    """A path for the volume file ``name`` that lands in ``tmp_path/outside``, spelled as ``escape`` says."""
    outside = tmp_path / "outside"
    volumes.mkdir(exist_ok=True)
    if escape == "elsewhere":
        return outside / name
    if escape == "dot-dot":
        return Path(f"{volumes}/../outside/{name}")
    outside.mkdir(exist_ok=True)
    (volumes / "linked").symlink_to(outside)
    return volumes / "linked" / name


ESCAPES = ["elsewhere", "dot-dot", "linked directory"]


@pytest.mark.parametrize("escape", ESCAPES)
def test_a_spawn_refuses_to_make_a_volume_file_outside_the_volumes_directories(host, tmp_path, escape):
    instance_uuid = str(uuid.uuid4())
    path = escaping(tmp_path, host.instances_dir.parent / "volumes", escape, "vol-10")

    error = failure(host.execute("spawn", instance_uuid, volume_boot_args("vol-10", path)))

    assert error == "Ferry.InvalidOperation"
    outside = tmp_path / "outside"
    assert not outside.exists() or list(outside.iterdir()) == []  # not even a temporary file or a marker
    assert not disks.instance_dir(host.instances_dir, instance_uuid).exists()
    assert not host.driver.guest_exists(instance_uuid)


def test_volume_files_are_made_in_any_configured_volumes_directory_and_only_there(host, tmp_path):
    agent = another_agent(host, tmp_path, "compute2", volumes_dirs=[tmp_path / "shared-a", tmp_path / "shared-b"])
    made = tmp_path / "shared-b" / "vol-11"
    default = tmp_path / "volumes" / "vol-12"  # one of the defaults, which the configured directories replace

    agent.spawn(Operation("spawn", f"{uuid.uuid4()}:spawn", str(uuid.uuid4()), volume_boot_args("vol-11", made), None))
    with pytest.raises(errors.InvalidOperation):
        agent.spawn(Operation("spawn", f"{uuid.uuid4()}:spawn", str(uuid.uuid4()),
                              volume_boot_args("vol-12", default), None))

    assert made.is_file() and os.path.getsize(made) == GiB
    assert not default.exists()


def test_an_agent_given_no_volumes_directories_makes_volume_files_only_beside_its_instances_directory(
        host, stack_state_dir, tmp_path):
    agent = another_agent(host, tmp_path, "compute2")
    beside = tmp_path / protocol.VOLUMES_DIR / "vol-20"
    placed = stack_state_dir / protocol.VOLUMES_DIR / "vol-21"  # python -m hostagent's default adds it, not HostAgent

    agent.spawn(Operation("spawn", f"{uuid.uuid4()}:spawn", str(uuid.uuid4()), volume_boot_args("vol-20", beside),
                          None))
    with pytest.raises(errors.InvalidOperation):
        agent.spawn(Operation("spawn", f"{uuid.uuid4()}:spawn", str(uuid.uuid4()),
                              volume_boot_args("vol-21", placed), None))

    assert beside.is_file()
    assert not placed.parent.exists()


def test_the_default_volumes_directories_hold_where_the_compute_api_places_volumes(host, stack_state_dir, tmp_path):
    # configured as python -m hostagent configures an agent given no --volumes-dir (the local stack's agents)
    agent = another_agent(host, tmp_path, "compute2",
                          volumes_dirs=default_volumes_dirs(config.get().state_dir, tmp_path / "compute2"))
    volume_id = str(uuid.uuid4())
    placed = stack_state_dir / "volumes" / volume_id  # ferry.compute.api's path for a volume it makes
    elsewhere = tmp_path / "elsewhere" / volume_id

    agent.spawn(Operation("spawn", f"{uuid.uuid4()}:spawn", str(uuid.uuid4()), volume_boot_args(volume_id, placed),
                          None))
    with pytest.raises(errors.InvalidOperation):
        agent.spawn(Operation("spawn", f"{uuid.uuid4()}:spawn", str(uuid.uuid4()),
                              volume_boot_args(volume_id, elsewhere), None))

    assert placed.is_file()
    assert not elsewhere.parent.exists()


@pytest.mark.parametrize("escape", ESCAPES)
def test_destroy_never_removes_a_volume_file_outside_the_volumes_directories(host, tmp_path, escape):
    # GIVEN a file that looks like one a host made (named after the volume, its directory marked), outside
    path = escaping(tmp_path, host.instances_dir.parent / "volumes", escape, "vol-13")
    target = tmp_path / "outside" / "vol-13"
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(b"not the host's to remove")
    protocol.mark_volume_dir(target.parent)

    # WHEN a server is destroyed with it
    result = output(host.execute("destroy", str(uuid.uuid4()), {"volumes": [{"volume_id": "vol-13",
                                                                              "path": str(path)}]}))

    # THEN the destroy goes on and the file is left, not named as removed
    assert result["volumes_removed"] == []
    assert target.read_bytes() == b"not the host's to remove"


def test_a_failed_spawn_never_removes_a_file_outside_the_volumes_directories_that_its_record_names(host, tmp_path):
    instance_uuid, operation_id = str(uuid.uuid4()), f"{uuid.uuid4()}:spawn"
    outside = tmp_path / "outside" / "vol-14"
    outside.parent.mkdir()
    outside.write_bytes(b"not the host's to remove")
    directory = disks.instance_dir(host.instances_dir, instance_uuid)
    directory.mkdir(parents=True)
    (directory / "spawn.json").write_text(json.dumps({"operation_id": operation_id,
                                                      "created_volumes": [str(outside)]}))
    args = {**volume_boot_args("vol-14", outside), "ports": [{"id": "port-1", "mac_address": "not-a-mac"}]}

    assert failure(host.execute("spawn", instance_uuid, args, operation_id=operation_id)) == "Ferry.HypervisorError"

    assert outside.read_bytes() == b"not the host's to remove"
    assert not directory.exists()


def test_an_agent_starting_removes_what_interrupted_volume_writes_left_but_not_a_write_under_way(host, tmp_path):
    # GIVEN, in the volumes directory, what a write killed mid-way left, and another write under way
    volumes = host.instances_dir.parent / "volumes"
    volumes.mkdir(exist_ok=True)
    abandoned = volumes / ".vol-15.k3j4h5ab.part"
    abandoned.write_bytes(b"half a volume")
    content, go = os.urandom(MiB), threading.Event()
    store = HeldImageStore(content, go)
    with ThreadPoolExecutor(max_workers=1) as pool:
        writing = pool.submit(disks.download_image, store, BUCKET, "images/vol-16", volumes / "vol-16",
                              hashlib.sha256(content).hexdigest())
        assert store.holding.wait(WAIT), "the write never began"
        under_way = list(volumes.glob(".vol-16.*.part"))
        assert len(under_way) == 1

        # WHEN an agent starts on the same storage (this host restarted, or another host)
        another_agent(host, tmp_path, "compute2").start()

        # THEN the abandoned part is gone, and the write under way goes on untouched
        assert not abandoned.exists()
        assert list(volumes.glob(".vol-16.*.part")) == under_way
        go.set()
        assert writing.result(WAIT) == len(content)
    assert (volumes / "vol-16").read_bytes() == content
    assert list(volumes.glob(".*.part")) == []


def test_a_spawn_making_a_volume_first_removes_what_an_interrupted_write_of_it_left(host):
    volumes = host.instances_dir.parent / "volumes"
    volumes.mkdir(exist_ok=True)
    leftover = volumes / ".vol-17.a1b2c3d4.part"
    leftover.write_bytes(b"an interrupted write")
    other = volumes / ".vol-18.e5f6a7b8.part"
    other.write_bytes(b"another volume's")

    output(host.execute("spawn", str(uuid.uuid4()), volume_boot_args("vol-17", volumes / "vol-17")))

    assert (volumes / "vol-17").is_file()
    assert not leftover.exists()
    assert other.exists()  # another volume's: swept when that one is written, or when an agent starts


def test_a_volume_file_is_written_in_its_directory_as_resolved_right_before_the_write(host, tmp_path, monkeypatch):
    # GIVEN a volume whose path goes through a link to a directory within the volumes directory
    volumes = host.instances_dir.parent / "volumes"
    (volumes / "real").mkdir(parents=True)
    (volumes / "linked").symlink_to(volumes / "real")
    outside = tmp_path / "outside"
    outside.mkdir()
    sweep = disks.remove_abandoned_parts

    def swap_then_sweep(directory: Path, name: str | None = None) -> list[Path]:
        # WHEN the link is pointed outside once the spawn checked the path, before the file is written
        (volumes / "linked").unlink()
        (volumes / "linked").symlink_to(outside)
        return sweep(directory, name)

    monkeypatch.setattr(disks, "remove_abandoned_parts", swap_then_sweep)

    output(host.execute("spawn", str(uuid.uuid4()), volume_boot_args("vol-22", volumes / "linked" / "vol-22")))

    # THEN the file is where the check found the directory to be, and nothing is written outside
    assert (volumes / "real" / "vol-22").is_file()
    assert list(outside.iterdir()) == []


# --- at-least-once delivery ----------------------------------------------------------------------


def test_redelivered_message_resends_the_recorded_result_without_redoing_the_work(host):
    instance_uuid = str(uuid.uuid4())
    operation_id = f"{uuid.uuid4()}:spawn"
    args = spawn_args(host.image(b"x" * 4096))
    first = output(host.execute("spawn", instance_uuid, args, operation_id=operation_id))
    (answer,) = host.sfn.called("send_task_success")
    wait_for(host.idle, "the first delivery to be settled")

    # The same message again, as SQS delivers it when a delete is lost.
    body = {
        "operation": "spawn",
        "operation_id": operation_id,
        "instance_uuid": instance_uuid,
        "args": args,
        "task_token": answer["taskToken"],
    }
    host.sqs.send_message(QueueUrl=host.queue_url, MessageBody=json.dumps(body))
    wait_for(lambda: len(host.sfn.called("send_task_success")) == 2, "the answer to be sent again")

    resent = host.sfn.called("send_task_success")[1]
    assert resent["taskToken"] == answer["taskToken"]
    assert json.loads(resent["output"]) == first
    assert host.driver.defined == 1
    assert journal_entry(host, operation_id).attempts == 1
    assert wait_for(host.queue_is_empty, "the redelivered message to be deleted")


def test_a_recorded_failure_is_resent_to_a_redelivery_and_retried_for_a_new_task(host):
    instance_uuid = str(uuid.uuid4())
    operation_id = f"{uuid.uuid4()}:power_on"
    assert failure(host.execute("power_on", instance_uuid, {}, operation_id=operation_id)) == "Ferry.GuestNotFound"
    (answer,) = host.sfn.called("send_task_failure")
    wait_for(host.idle, "the first delivery to be settled")
    body = {
        "operation": "power_on",
        "operation_id": operation_id,
        "instance_uuid": instance_uuid,
        "args": {},
        "task_token": answer["taskToken"],
    }
    host.sqs.send_message(QueueUrl=host.queue_url, MessageBody=json.dumps(body))
    wait_for(lambda: len(host.sfn.called("send_task_failure")) == 2, "the failure to be sent again")
    assert journal_entry(host, operation_id).attempts == 1

    # The workflow retries the step: same operation id, new task token, and now the guest exists.
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096), power_on=False)))
    retried = output(host.execute("power_on", instance_uuid, {}, operation_id=operation_id))

    assert retried["power_state"] == RUNNING
    assert journal_entry(host, operation_id).attempts == 2


def test_an_operation_interrupted_by_a_crash_runs_again(host):
    instance_uuid = str(uuid.uuid4())
    operation_id = f"{uuid.uuid4()}:spawn"
    assert host.agent.journal is not None
    host.agent.journal.start(operation_id, "spawn", instance_uuid, "token-of-the-lost-attempt")

    result = output(
        host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096)), operation_id=operation_id)
    )

    assert result["power_state"] == RUNNING
    entry = journal_entry(host, operation_id)
    assert entry.status == SUCCEEDED and entry.attempts == 2


def _destroy_cut_short(host: Host, instance_uuid: str) -> None:
    host.driver.destroy(instance_uuid)
    disks.remove_instance_dir(host.instances_dir, instance_uuid)


def _revert_args(_host: Host) -> dict[str, Any]:
    migration_uuid = str(uuid.uuid4())
    return {"migration_uuid": migration_uuid, "same_host": False,
            "transfer": {"bucket": BUCKET, "prefix": f"moves/{migration_uuid}"}}


# How each operation's earlier run was cut short once it had removed something (destroy: the
# guest and its disks; the revert on a move's destination: the guest, its disks still there),
# and the arguments it runs with.
_CUT_SHORT = {
    "destroy": (_destroy_cut_short, lambda _host: {"keep_disks": False}),
    "revert_resize": (lambda host, instance_uuid: host.driver.destroy(instance_uuid), _revert_args),
}


@pytest.mark.parametrize("operation", sorted(_CUT_SHORT))
@pytest.mark.parametrize("earlier", ["cut short", "failed", "none"])
def test_an_operation_failing_in_the_hypervisor_after_a_run_cut_short_does_not_say_nothing_was_removed(
        host, monkeypatch, operation, earlier):
    # GIVEN a server whose operation ran before and was cut short after removing something (or
    # whose earlier run failed and ended, or that never ran: nothing was removed)
    cut_short, arguments = _CUT_SHORT[operation]
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))
    operation_id = f"{uuid.uuid4()}:{operation}"
    assert host.agent.journal is not None
    if earlier != "none":
        host.agent.journal.start(operation_id, operation, instance_uuid, "token-of-the-earlier-attempt")
    if earlier == "cut short":
        cut_short(host, instance_uuid)
    elif earlier == "failed":
        host.agent.journal.fail(operation_id, "Ferry.HypervisorError", "the hypervisor failed")

    # WHEN it runs now with the hypervisor failing
    def hypervisor_down(_instance_uuid: str) -> None:
        raise errors.HypervisorError("Cannot recv data: Connection reset by peer")

    monkeypatch.setattr(host.driver, "destroy", hypervisor_down)
    failed = failure(host.execute(operation, instance_uuid, arguments(host), operation_id=operation_id))

    # THEN only a run with no earlier one cut short says the hypervisor failed, which says nothing
    # was removed (a revert goes back to VERIFY_RESIZE on it, where a confirm deletes the source's
    # disks); after a run cut short the failure is one that may have removed something
    assert failed == ("Ferry.HostOperationFailed" if earlier == "cut short" else "Ferry.HypervisorError")


def test_an_operation_without_a_task_token_is_done_and_journaled(host):
    instance_uuid = str(uuid.uuid4())
    operation_id = f"{uuid.uuid4()}:spawn"
    body = {
        "operation": "spawn",
        "operation_id": operation_id,
        "instance_uuid": instance_uuid,
        "args": spawn_args(host.image(b"x" * 4096)),
        "task_token": None,
    }

    host.sqs.send_message(QueueUrl=host.queue_url, MessageBody=json.dumps(body))

    wait_for(lambda: (e := journal_entry(host, operation_id)) is not None and e.finished, "the operation to end")
    assert journal_entry(host, operation_id).result["power_state"] == RUNNING
    assert host.driver.guest_power_state(instance_uuid) == RUNNING
    assert wait_for(host.queue_is_empty, "the message to be deleted")


def heartbeat_tokens(host: Host) -> set[str]:
    return {call["taskToken"] for call in host.sfn.called("send_task_heartbeat")}


@dataclass
class HeldOperation:
    """An operation running on the agent, held mid-way, and what it was started with."""

    operation: str
    operation_id: str
    args: dict[str, Any]
    execution: str
    token: str
    tokens_before: set[str]


def held_snapshot_prep(host: Host, instance_uuid: str) -> HeldOperation:
    """Spawn ``instance_uuid`` and start its snapshot prep (it takes back what it sent if its workflow
    gives up), held while it powers the guest off (``host.driver.off_gate``)."""
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))
    host.driver.off_gate = threading.Event()
    operation, operation_id = protocol.PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE, f"{uuid.uuid4()}:prep"
    args = {"migration_uuid": str(uuid.uuid4()), "snapshot": None}
    before = heartbeat_tokens(host)
    execution = host.start(operation, instance_uuid, args, operation_id=operation_id)
    assert host.driver.off_entered.wait(WAIT)
    (token,) = heartbeat_tokens(host) - before
    return HeldOperation(operation, operation_id, args, execution, token, before)


@pytest.mark.parametrize("host", [{"max_workers": 2, "max_waiting": 1}], indirect=True)
def test_copies_of_a_running_operation_leave_the_waiting_slots_to_other_instances(host):
    # GIVEN a cross-cell move's snapshot prep (it takes back what it sent if its workflow gives up) held
    # mid-way on one of two workers
    busy, other = str(uuid.uuid4()), str(uuid.uuid4())
    output(host.execute("spawn", other, spawn_args(host.image(b"x" * 4096))))
    held = held_snapshot_prep(host, busy)
    running = held.execution

    # WHEN SQS delivers its message again, more often than the agent has slots left
    for _ in range(host.agent.max_workers + host.agent.max_waiting):
        copy_of(host, held.operation, held.operation_id, busy, held.args, held.token)

    # THEN another instance's operation is still taken, and runs on the free worker meanwhile
    destroyed = host.start("destroy", other, {})
    assert wait_for(lambda: host.sfn.describe_execution(executionArn=destroyed)["status"] != "RUNNING",
                    "the other instance's operation to run")
    assert output(host.finished(destroyed))["instance_uuid"] == other
    assert host.sfn.describe_execution(executionArn=running)["status"] == "RUNNING"
    # and once the operation ends it has run once, its copies gone with its message
    host.driver.off_gate.set()
    assert output(host.finished(running))["was_running"] is True
    assert journal_entry(host, held.operation_id).attempts == 1
    assert wait_for(host.queue_is_empty, "the copies to be deleted")


@pytest.mark.parametrize("host", [{"max_workers": 2, "max_waiting": 1}], indirect=True)
def test_a_retry_of_a_running_operation_has_its_task_heartbeat_and_is_answered_once_it_ends(host):
    busy = str(uuid.uuid4())
    held = held_snapshot_prep(host, busy)
    first = held.execution

    # the same operation, a new task
    retry = host.start(held.operation, busy, held.args, operation_id=held.operation_id)

    wait_for(lambda: heartbeat_tokens(host) - held.tokens_before - {held.token}, "the retry's task to be heartbeat")
    host.driver.off_gate.set()
    assert output(host.finished(first)) == output(host.finished(retry))
    assert journal_entry(host, held.operation_id).attempts == 1
    assert wait_for(host.queue_is_empty, "both messages to be deleted")


def copy_of(host: Host, operation: str, operation_id: str, instance_uuid: str, args: dict[str, Any],
            token: str) -> None:
    """Send the message of an operation again, with ``token``: a copy SQS delivers, or a retry's message."""
    body = {"operation": operation, "operation_id": operation_id, "instance_uuid": instance_uuid, "args": args,
            "task_token": token}
    host.sqs.send_message(QueueUrl=host.queue_url, MessageBody=json.dumps(body))


@pytest.mark.parametrize(("host", "waits_for"), [({"max_workers": 1, "max_waiting": 2}, "a worker"),
                                                 ({"max_workers": 2, "max_waiting": 1}, "its instance's lock")],
                         indirect=["host"])
def test_copies_of_an_operation_still_waiting_take_no_slot(host, waits_for):
    # GIVEN an operation running (held), and another one waiting for the worker or for the running one's instance
    busy, other, later = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    output(host.execute("spawn", busy, spawn_args(host.image(b"x" * 4096), power_on=False)))
    host.driver.gate = threading.Event()
    host.driver.entered.clear()
    running = host.start("power_on", busy, {})
    assert host.driver.entered.wait(WAIT)
    before = heartbeat_tokens(host)
    operation, instance_uuid = ("destroy", other) if waits_for == "a worker" else ("power_off", busy)
    operation_id = f"{uuid.uuid4()}:{operation}"
    waiting = host.start(operation, instance_uuid, {}, operation_id=operation_id)
    (token,) = wait_for(lambda: heartbeat_tokens(host) - before, "the waiting operation to be taken")

    # WHEN SQS delivers its message again, as often as the agent has slots
    slots = host.agent.max_workers + host.agent.max_waiting
    for _ in range(slots):
        copy_of(host, operation, operation_id, instance_uuid, {}, token)
    wait_for(lambda: len(host.agent._claims[operation_id].copies) == slots, "the copies to be received")

    # THEN another instance's operation is still taken (and runs on a free worker, if there is one)
    taken = heartbeat_tokens(host)
    last = host.start("destroy", later, {})
    wait_for(lambda: heartbeat_tokens(host) - taken, "the other instance's operation to be taken")
    if waits_for == "its instance's lock":
        assert output(host.finished(last))["instance_uuid"] == later
        assert host.sfn.describe_execution(executionArn=running)["status"] == "RUNNING"
    # and once the running operation ends, the waiting one runs once, its copies gone with its message
    host.driver.gate.set()
    assert output(host.finished(running))["power_state"] == RUNNING
    assert output(host.finished(waiting))["instance_uuid"] == instance_uuid
    assert output(host.finished(last))["instance_uuid"] == later
    assert journal_entry(host, operation_id).attempts == 1
    assert wait_for(host.queue_is_empty, "the copies to be deleted")


def visibility_changes(host: Host, since: int = 0) -> list[tuple[str, int]]:
    """(receipt handle, visibility timeout) of each ChangeMessageVisibility the agent made after its call ``since``."""
    return [(kwargs["ReceiptHandle"], kwargs["VisibilityTimeout"]) for call, kwargs in host.sqs.calls[since:]
            if call == "change_message_visibility"]


@pytest.mark.parametrize("host", [{"max_workers": 1, "max_waiting": 2}], indirect=True)
def test_stopping_settles_the_copies_of_an_operation_that_never_ran(host):
    # GIVEN an operation waiting for the busy worker, with a copy of its message and a retry's message
    busy, other = str(uuid.uuid4()), str(uuid.uuid4())
    output(host.execute("spawn", busy, spawn_args(host.image(b"x" * 4096), power_on=False)))
    host.driver.gate = threading.Event()
    host.driver.entered.clear()
    running = host.start("power_on", busy, {})
    assert host.driver.entered.wait(WAIT)
    before = heartbeat_tokens(host)
    operation_id = f"{uuid.uuid4()}:destroy"
    host.start("destroy", other, {}, operation_id=operation_id)
    (token,) = wait_for(lambda: heartbeat_tokens(host) - before, "the waiting operation to be taken")
    copy_of(host, "destroy", operation_id, other, {}, token)
    host.start("destroy", other, {}, operation_id=operation_id)  # the workflow retries: another token
    claim = wait_for(lambda: (c := host.agent._claims.get(operation_id)) and len(c.copies) == 2 and c,
                     "both copies to be received")
    (same,) = [receipt for receipt, copy_token in claim.copies.values() if copy_token == token]
    (retried,) = [receipt for receipt, copy_token in claim.copies.values() if copy_token != token]
    since = len(host.sqs.calls)

    # WHEN the agent stops before the operation gets the worker
    host.agent.stop()
    host.driver.gate.set()
    host.thread.join(WAIT)

    # THEN the message and its copy come back soon for the next agent, and the retry's at once
    assert not host.thread.is_alive()
    assert output(host.finished(running))["power_state"] == RUNNING
    changes = visibility_changes(host, since)
    assert (claim.receipt, UNSURE_REDELIVERY_SECONDS) in changes
    assert (same, UNSURE_REDELIVERY_SECONDS) in changes
    assert (retried, 0) in changes
    deleted = {kwargs["ReceiptHandle"] for kwargs in host.sqs.called("delete_message")}
    assert not deleted & {claim.receipt, same, retried}
    assert journal_entry(host, operation_id) is None  # it never ran


@pytest.mark.parametrize("host", [{"keepalive_interval": 20.0}], indirect=True)
def test_a_retry_of_a_running_operation_has_its_task_heartbeat_within_a_second_not_at_the_next_beat(host):
    busy = str(uuid.uuid4())
    output(host.execute("spawn", busy, spawn_args(host.image(b"x" * 4096))))
    host.driver.off_gate = threading.Event()
    operation_id = f"{uuid.uuid4()}:power_off"
    before = heartbeat_tokens(host)
    first = host.start("power_off", busy, {}, operation_id=operation_id)
    assert host.driver.off_entered.wait(WAIT)
    (token,) = heartbeat_tokens(host) - before
    # the keepalive's first beat is over: the next one is 20 s away
    wait_for(lambda: (host.agent._claims[operation_id].receipt, host.agent.visibility_timeout)
             in visibility_changes(host), "the keepalive's first beat")

    retry = host.start("power_off", busy, {}, operation_id=operation_id)  # the same operation, a new task

    wait_for(lambda: heartbeat_tokens(host) - before - {token}, "the retry's task to be heartbeat")
    host.driver.off_gate.set()
    assert output(host.finished(first)) == output(host.finished(retry))
    assert journal_entry(host, operation_id).attempts == 1


def test_a_message_handed_out_again_while_its_operation_runs_is_kept_by_its_newest_receipt_only(host):
    # GIVEN an operation running (held)
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096), power_on=False)))
    host.driver.gate = threading.Event()
    host.driver.entered.clear()
    operation_id = f"{uuid.uuid4()}:power_on"
    running = host.start("power_on", instance_uuid, {}, operation_id=operation_id)
    assert host.driver.entered.wait(WAIT)
    claim = host.agent._claims[operation_id]
    old = claim.receipt
    resume, paused = threading.Event(), threading.Event()

    def pause_the_keepalive(kwargs: dict[str, Any]) -> None:
        if kwargs["VisibilityTimeout"] == host.agent.visibility_timeout and not paused.is_set():
            paused.set()
            assert resume.wait(WAIT)

    host.sqs.hooks["change_message_visibility"] = pause_the_keepalive
    assert paused.wait(WAIT)

    # WHEN its message's visibility lapses (the keepalive stalled) and SQS hands the message out again
    host.sqs._client.change_message_visibility(QueueUrl=host.queue_url, ReceiptHandle=old, VisibilityTimeout=0)
    wait_for(lambda: claim.receipt != old, "the message to be received again")
    since = len(host.sqs.calls)
    resume.set()

    # THEN only its newest receipt is kept invisible, and the message is settled by it
    wait_for(lambda: len(visibility_changes(host, since)) >= 2, "two more beats")
    assert {receipt for receipt, _timeout in visibility_changes(host, since)} == {claim.receipt}
    host.driver.gate.set()
    assert output(host.finished(running))["power_state"] == RUNNING
    assert wait_for(host.queue_is_empty, "the message to be deleted")
    assert [kwargs["ReceiptHandle"] for kwargs in host.sqs.called("delete_message")][-1] == claim.receipt
    assert old not in {receipt for receipt, _timeout in visibility_changes(host, since)}
    assert journal_entry(host, operation_id).attempts == 1


# --- invalid messages ----------------------------------------------------------------------------


def test_unknown_operation_fails_with_invalid_operation_and_is_deleted(host):
    error = failure(host.execute("reboot", str(uuid.uuid4()), {}))

    assert error == "Ferry.InvalidOperation"
    assert wait_for(host.queue_is_empty, "the poison message to be deleted")


def test_invalid_spawn_arguments_fail_with_invalid_operation(host):
    assert failure(host.execute("spawn", str(uuid.uuid4()), {"name": "no flavor"})) == "Ferry.InvalidOperation"


def test_a_message_that_is_not_json_is_deleted_and_the_agent_keeps_working(host):
    host.sqs.send_message(QueueUrl=host.queue_url, MessageBody="this is not an operation")
    wait_for(host.queue_is_empty, "the poison message to be deleted")

    instance_uuid = str(uuid.uuid4())
    assert output(host.execute("destroy", instance_uuid, {}))["instance_uuid"] == instance_uuid


# --- keepalive and stopping ----------------------------------------------------------------------


def test_a_long_operation_sends_task_heartbeats_and_extends_the_message_visibility(host):
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096), power_on=False)))
    gate = host.driver.gate = threading.Event()
    heartbeat_sent, visibility_extended = threading.Event(), threading.Event()

    def release_when_both_seen(seen: threading.Event) -> None:
        # The operation cannot end before the agent heartbeats the task and extends the message's visibility.
        seen.set()
        if heartbeat_sent.is_set() and visibility_extended.is_set():
            gate.set()

    host.sfn.hooks["send_task_heartbeat"] = lambda _kwargs: release_when_both_seen(heartbeat_sent)
    host.sqs.hooks["change_message_visibility"] = lambda _kwargs: release_when_both_seen(visibility_extended)

    assert output(host.execute("power_on", instance_uuid, {}))["power_state"] == RUNNING

    assert host.sfn.called("send_task_heartbeat")
    extended = host.sqs.called("change_message_visibility")
    assert extended and all(call["VisibilityTimeout"] == host.agent.visibility_timeout for call in extended)


@contextmanager
def stuck_visibility_extensions(host: Host) -> Iterator[threading.Event]:
    """SQS holds every ChangeMessageVisibility the keepalive makes until the block ends (however long
    it runs); yields an event set once one is held."""
    held, release = threading.Event(), threading.Event()

    def slow_sqs(kwargs: dict[str, Any]) -> None:
        if kwargs["VisibilityTimeout"] == host.agent.visibility_timeout:
            held.set()
            release.wait()  # set when the block ends, whatever happens in it

    host.sqs.hooks["change_message_visibility"] = slow_sqs
    try:
        yield held
    finally:
        release.set()
        del host.sqs.hooks["change_message_visibility"]


def test_a_slow_sqs_holds_back_no_task_heartbeat_of_a_running_operation(host):
    # GIVEN an operation held running, and SQS stuck in the keepalive's first visibility extension
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096), power_on=False)))
    host.driver.gate = threading.Event()
    host.driver.entered.clear()
    before = heartbeat_tokens(host)
    with stuck_visibility_extensions(host) as held:
        running = host.start("power_on", instance_uuid, {})
        assert host.driver.entered.wait(WAIT)
        (token,) = wait_for(lambda: heartbeat_tokens(host) - before, "the operation to be taken")
        assert held.wait(WAIT)
        beats = len([c for c in host.sfn.called("send_task_heartbeat") if c["taskToken"] == token])

        # WHEN the keepalive beats on (every 0.1 s here) THEN the task is heartbeat again and again
        # while SQS still holds the first extension
        wait_for(lambda: len([c for c in host.sfn.called("send_task_heartbeat") if c["taskToken"] == token])
                 >= beats + 3, "task heartbeats while SQS is stuck")
        host.driver.gate.set()
        assert output(host.finished(running))["power_state"] == RUNNING


def test_an_operation_answers_although_its_keepalive_is_stuck_in_sqs(host, monkeypatch):
    monkeypatch.setattr(agent_module, "KEEPALIVE_JOIN_SECONDS", 0)
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096), power_on=False)))
    host.driver.gate = threading.Event()
    host.driver.entered.clear()
    with stuck_visibility_extensions(host) as held:
        running = host.start("power_on", instance_uuid, {})
        assert host.driver.entered.wait(WAIT)
        assert held.wait(WAIT)

        host.driver.gate.set()  # the operation ends while SQS still holds the keepalive

        assert output(host.finished(running))["power_state"] == RUNNING


def test_an_operation_waiting_for_the_busy_worker_has_its_task_heartbeat_meanwhile(host):
    busy, waiting = str(uuid.uuid4()), str(uuid.uuid4())
    output(host.execute("spawn", busy, spawn_args(host.image(b"x" * 4096), power_on=False)))
    assert host.agent.max_workers == 1
    host.driver.gate = threading.Event()
    running = host.start("power_on", busy, {})
    def beating_tokens() -> set[str]:
        return {call["taskToken"] for call in host.sfn.called("send_task_heartbeat")}

    spawned = beating_tokens()
    wait_for(lambda: beating_tokens() - spawned, "the busy operation to run")
    before = beating_tokens()

    queued = host.start("destroy", waiting, {})

    wait_for(lambda: beating_tokens() - before, "the waiting operation's task to be heartbeat")
    assert host.sfn.describe_execution(executionArn=queued)["status"] == "RUNNING"  # it has not run
    host.driver.gate.set()
    assert output(host.finished(running))["power_state"] == RUNNING
    assert output(host.finished(queued))["instance_uuid"] == waiting


def test_an_instance_lock_is_forgotten_once_no_operation_holds_or_waits_for_it(host):
    for _ in range(3):
        output(host.execute("destroy", str(uuid.uuid4()), {}))

    assert host.agent._instance_locks == {}


def test_stopping_lets_the_running_operation_finish(host):
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096), power_on=False)))
    host.driver.gate = threading.Event()
    host.driver.entered.clear()

    execution_arn = host.start("power_on", instance_uuid, {})
    assert host.driver.entered.wait(WAIT)
    host.agent.stop()
    host.driver.gate.set()
    host.thread.join(WAIT)

    assert not host.thread.is_alive()
    assert output(host.finished(execution_arn))["power_state"] == RUNNING
    assert host.queue_is_empty()


def test_stopping_leaves_an_operation_waiting_for_the_worker_to_the_next_agent(host):
    busy, waiting = str(uuid.uuid4()), str(uuid.uuid4())
    for instance_uuid in (busy, waiting):
        output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096), power_on=False)))
    host.driver.gate = threading.Event()
    host.driver.entered.clear()
    running = host.start("power_on", busy, {})
    assert host.driver.entered.wait(WAIT)
    before = {call["taskToken"] for call in host.sfn.called("send_task_heartbeat")}
    queued = host.start("destroy", waiting, {})
    wait_for(lambda: {call["taskToken"] for call in host.sfn.called("send_task_heartbeat")} - before,
             "the waiting operation to be taken")

    host.agent.stop()
    host.driver.gate.set()
    host.thread.join(WAIT)

    assert not host.thread.is_alive()
    assert output(host.finished(running))["power_state"] == RUNNING
    assert host.driver.guest_exists(waiting)  # not destroyed: it never ran
    assert host.sfn.describe_execution(executionArn=queued)["status"] == "RUNNING"


# --- reports and the queue -----------------------------------------------------------------------


def test_the_agent_reports_inventory_and_heartbeat_when_it_starts(host):
    instance_uuid = str(uuid.uuid4())
    reports = {r["kind"]: r for r in host.reports()}

    inventory = reports["inventory"]
    protocol.validate(inventory, protocol.REPORT_SCHEMA)
    assert (inventory["host"], inventory["node"], inventory["cell"]) == ("compute1", "compute1", "cell1")
    assert inventory["inventory"]["VCPU"] == {"total": 16, "reserved": 0}
    assert inventory["inventory"]["MEMORY_MB"] == {"total": 32768, "reserved": 0}
    assert inventory["inventory"]["DISK_GB"]["total"] > 0
    assert inventory["guests"] == []
    assert reports["heartbeat"]["host"] == "compute1"

    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))
    assert host.agent.send_inventory()
    (later,) = [r for r in host.reports() if r["kind"] == "inventory"]
    assert later["guests"] == [instance_uuid]


def test_the_agent_creates_its_queue_with_a_dead_letter_queue(host):
    attrs = host.sqs.get_queue_attributes(QueueUrl=host.queue_url, AttributeNames=["All"])["Attributes"]
    redrive = json.loads(attrs["RedrivePolicy"])
    dlq_url = host.sqs.get_queue_url(QueueName=f"{QUEUE_PREFIX}compute1-dlq")["QueueUrl"]
    dlq_arn = host.sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]

    assert host.queue_url.endswith(protocol.host_queue_name(QUEUE_PREFIX, "compute1"))
    assert redrive["deadLetterTargetArn"] == dlq_arn
    assert int(redrive["maxReceiveCount"]) == 5


def test_ensuring_the_queue_again_keeps_it_and_applies_new_settings(host):
    again = ensure_host_queue(host.sqs, QUEUE_PREFIX, "compute1", visibility_timeout=300)

    assert again == host.queue_url
    attrs = host.sqs.get_queue_attributes(QueueUrl=again, AttributeNames=["VisibilityTimeout"])["Attributes"]
    assert attrs["VisibilityTimeout"] == "300"


def test_the_inventory_report_lists_the_instance_directories_but_not_the_image_cache(host):
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))
    (host.agent.instances_dir / f"{instance_uuid}_resize").mkdir()
    (host.agent.instances_dir / "stray-file").write_text("not a directory")
    host.reports()

    assert host.agent.send_inventory()
    (report,) = [r for r in host.reports() if r["kind"] == "inventory"]

    protocol.validate(report, protocol.REPORT_SCHEMA)
    assert (host.agent.instances_dir / "_base").is_dir()
    assert report["instance_dirs"] == sorted([instance_uuid, f"{instance_uuid}_resize"])


def test_a_cached_image_no_spawn_used_for_its_max_age_is_pruned_and_one_in_use_is_not(host):
    image = host.image(b"x" * 4096)
    output(host.execute("spawn", str(uuid.uuid4()), spawn_args(image)))
    cached = host.agent.instances_dir / disks.IMAGE_CACHE_DIR / image["sha256"]
    day_and_a_bit = time.time() - 25 * 3600
    os.utime(cached, (day_and_a_bit, day_and_a_bit))

    with host.agent._cached_image_in_use(image["sha256"]):  # a spawn copying from it right now
        assert host.agent.prune_image_cache() == []
    # A spawn that uses the cached image marks it used: it stays another day.
    output(host.execute("spawn", str(uuid.uuid4()), spawn_args(image)))
    assert host.agent.prune_image_cache() == []
    os.utime(cached, (day_and_a_bit, day_and_a_bit))

    assert host.agent.prune_image_cache() == [cached]
    assert not cached.exists()
    # The next spawn fetches it again.
    output(host.execute("spawn", str(uuid.uuid4()), spawn_args(image)))
    assert cached.exists()


def test_pruning_the_image_cache_leaves_recent_kept_and_temporary_files(tmp_path):
    old = time.time() - 3600
    files = {name: tmp_path / name for name in ("old", "recent", "kept", ".old.x1.part")}
    for name, path in files.items():
        path.write_bytes(b"x")
        if name != "recent":
            os.utime(path, (old, old))

    assert disks.prune_image_cache(tmp_path, 60, keep={"kept"}) == [files["old"]]
    assert disks.prune_image_cache(tmp_path / "absent", 60, keep=set()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old.x1.part", "kept", "recent"]


def test_a_message_handed_out_again_while_it_is_being_settled_goes_by_its_newest_receipt_too(host, monkeypatch):
    # GIVEN a snapshot prep (it may take back what it sent, so a copy is never answered from the
    # journal ahead of its run) whose message SQS hands out again just as its answer is being sent
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))
    operation, operation_id = protocol.PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE, f"{uuid.uuid4()}:prep"
    settle, again = host.agent._settle, {}

    def handed_out_again_first(op: Operation, receipt: str, *args: Any) -> bool:
        if op.operation_id == operation_id and not again:
            again["old"] = receipt
            claim = host.agent._claims[op.operation_id]
            host.sqs._client.change_message_visibility(QueueUrl=host.queue_url, ReceiptHandle=receipt,
                                                       VisibilityTimeout=0)
            wait_for(lambda: claim.receipt != receipt, "the message to be handed out again")
            again["newest"] = claim.receipt
        return settle(op, receipt, *args)

    monkeypatch.setattr(host.agent, "_settle", handed_out_again_first)

    # WHEN the operation is answered
    output(host.execute(operation, instance_uuid, {"migration_uuid": str(uuid.uuid4()), "snapshot": None},
                        operation_id=operation_id))

    # THEN its newest receipt is deleted as well: the message does not come back to be run or answered again
    wait_for(lambda: again["newest"] in {kwargs["ReceiptHandle"] for kwargs in host.sqs.called("delete_message")},
             "the newest receipt to be deleted")
    assert journal_entry(host, operation_id).attempts == 1


# --- a hung hypervisor ------------------------------------------------------------------------------


def hangs(host: Host, monkeypatch: pytest.MonkeyPatch, seconds: float, allowed: float = 0.0) -> None:
    """Have the driver report a power-on under way for ``seconds`` (asked to wait ``allowed``)."""
    monkeypatch.setattr(host.driver, "calls_under_way", lambda: [CallUnderWay("power_on", seconds, allowed)])


@pytest.mark.parametrize("host", [{"hypervisor_call_timeout": 60}], indirect=True)
def test_service_heartbeats_are_withheld_while_a_hypervisor_call_hangs(host, monkeypatch):
    # GIVEN a hypervisor call under way within its time, then past it (its own 30 s and 60 s more)
    while host.reports():  # the reports the agent sent as it started
        pass
    hangs(host, monkeypatch, seconds=80, allowed=30)
    assert host.agent.send_heartbeat() and [r["kind"] for r in host.reports()] == ["heartbeat"]
    hangs(host, monkeypatch, seconds=100, allowed=30)

    # WHEN the agent's heartbeats and inventory reports come, THEN none is sent (each would tell
    # the control plane the host is up: it goes down), and each look of its watch counts the hang
    assert not host.agent.send_heartbeat() and not host.agent.send_inventory()
    assert host.reports() == []
    assert host.agent.watch_hypervisor() and host.agent.watch_hypervisor()
    host.agent.metrics.flush()
    counted = [datum for call in host.cloudwatch.called("put_metric_data") for datum in call["MetricData"]
               if datum["MetricName"] == "HypervisorHung"]
    assert [(d["Values"], d["Counts"]) for d in counted] == [([1.0], [2.0])]  # the value 1, counted twice
    assert counted[0]["Dimensions"] == [{"Name": "Host", "Value": "compute1"}]

    # AND once the call returns they are sent again
    monkeypatch.setattr(host.driver, "calls_under_way", lambda: [])
    assert not host.agent.watch_hypervisor()
    assert host.agent.send_heartbeat() and host.agent.send_inventory()
    assert sorted(r["kind"] for r in host.reports()) == ["heartbeat", "inventory"]


@pytest.mark.parametrize("host", [{"hypervisor_call_timeout": 60, "max_workers": 2}], indirect=True)
def test_an_operations_task_is_not_heartbeat_while_the_hypervisor_hangs(host, monkeypatch):
    # GIVEN an operation held mid-way, its task heartbeat
    instance_uuid = str(uuid.uuid4())
    output(host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096), power_on=False)))
    host.driver.gate = threading.Event()
    host.driver.entered.clear()
    before = heartbeat_tokens(host)
    operation_id = f"{uuid.uuid4()}:power_on"
    running = host.start("power_on", instance_uuid, {}, operation_id=operation_id)
    assert host.driver.entered.wait(WAIT)
    (token,) = wait_for(lambda: heartbeat_tokens(host) - before, "the operation's task to be heartbeat")

    def beats() -> int:
        return sum(1 for call in host.sfn.called("send_task_heartbeat") if call["taskToken"] == token)

    # WHEN a hypervisor call hangs past its time, THEN the task is heartbeat no more (it times out
    # and its workflow rolls back without this host) and the operation's disk streams stop
    hangs(host, monkeypatch, seconds=61)
    time.sleep(0.3)  # a beat under way when it began may still land
    counted = beats()
    time.sleep(1.0)  # ten keepalive intervals
    assert beats() == counted
    assert host.agent._claims[operation_id].abandoned.is_set()

    # AND an operation that comes meanwhile, a worker free, is not started: its message comes back later
    left: list[tuple[str, bool | None]] = []
    record = host.agent._record_not_started
    monkeypatch.setattr(host.agent, "_record_not_started",
                        lambda op, awaited, context: (left.append((op.name, awaited)), record(op, awaited, context)))
    host.start("destroy", str(uuid.uuid4()), {})
    wait_for(lambda: left, "the other operation to be left for later")
    assert left == [("destroy", None)]

    # AND once it answers again the task is heartbeat again, and the operation ends
    monkeypatch.setattr(host.driver, "calls_under_way", lambda: [])
    wait_for(lambda: beats() > counted, "the task to be heartbeat again")
    host.driver.gate.set()
    assert output(host.finished(running))["power_state"] == RUNNING
