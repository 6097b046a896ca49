"""The resize state machine from template.yaml, started directly with boto3 on moto's Step Functions executor.

The Lambda tasks run the real handlers in this process (the local stack's runtime); the host
operations are answered by a stand-in that follows the host agent protocol to the letter
(arguments and results checked against ``ferry.protocol``): the agent's own tests cover the
libvirt and disk work, these cover the orchestration, the reschedule and the rollback
branches end to end.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sqlalchemy import select
from test_resize_steps import (
    BIG,
    DISKS,
    HOSTS,
    SOURCE,
    events_of,
    faults_of,
    instance,
    make_server,
    migration,
    prepare_move,
    report,
    snapshot,
    used_on,
)

from ferry import config, faults, notifications, placement, protocol
from ferry.compute import states
from ferry.local import provision, runtime, template
from ferry.store.api_models import Network
from ferry.store.cell_models import Instance
from ferry.store.db import api_session, cell_session
from ferry.workflows import resize

ROOT = Path(__file__).resolve().parents[2]
WAIT = 60.0


class HostStandIn:
    """Answers each host's queue as the agent would: SendTaskSuccess with the protocol's result, or
    SendTaskFailure with the error armed for (host, operation)."""

    def __init__(self, aws: runtime.LocalAws, queue_urls: dict[str, str]) -> None:
        self.sqs, self.sfn = aws.client("sqs"), aws.client("stepfunctions")
        self.queue_urls = queue_urls
        self.failures: dict[tuple[str, str], str] = {}
        self.received: list[tuple[str, str]] = []
        self.args: dict[tuple[str, str], dict[str, Any]] = {}  # the last arguments of each (host, operation)
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> HostStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = True
            for host, url in list(self.queue_urls.items()):
                for message in self.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages") or []:
                    idle = False
                    self.sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
                    self._answer(host, json.loads(message["Body"]))
            if idle:
                self._stop.wait(0.05)

    def _answer(self, host: str, body: dict[str, Any]) -> None:
        operation, args, token = body["operation"], body["args"], body["task_token"]
        self.received.append((host, operation))
        self.args[(host, operation)] = args
        try:
            protocol.validate(body, protocol.OPERATION_SCHEMA)
            protocol.validate(args, protocol.ARGS_SCHEMAS[operation])
        except jsonschema.ValidationError as exc:
            self.problems.append(f"{host} {operation}: {exc.message}")
            self.sfn.send_task_failure(taskToken=token, error="Ferry.InvalidOperation", cause=exc.message)
            return
        error = self.failures.get((host, operation))
        if error:
            self.sfn.send_task_failure(taskToken=token, error=error, cause=f"{operation} failed on {host}")
            return
        result = self.result(host, body)
        schema = protocol.RESULT_SCHEMAS.get(operation, protocol.RESULT_SCHEMA)
        protocol.validate(result, schema)
        self.sfn.send_task_success(taskToken=token, output=json.dumps(result))

    def result(self, host: str, body: dict[str, Any]) -> dict[str, Any]:
        """What the agent answers for a host operation that succeeded."""
        operation, args = body["operation"], body["args"]
        result: dict[str, Any] = {"instance_uuid": body["instance_uuid"], "host": host, "node": host,
                                  "power_state": states.NOSTATE}
        if operation == protocol.PREP_RESIZE:
            result["claimed"] = True
        elif operation == protocol.RESIZE_INSTANCE:
            with cell_session("cell1") as session:
                running = session.scalars(select(Instance.power_state).where(
                    Instance.uuid == body["instance_uuid"])).one() == states.RUNNING
            result.update(power_state=states.SHUTDOWN, was_running=running, disks=DISKS)
        elif operation in (protocol.FINISH_RESIZE, protocol.FINISH_REVERT_RESIZE):
            result["power_state"] = states.RUNNING if args["power_on"] else states.SHUTDOWN
            if operation == protocol.FINISH_RESIZE:
                result["disks"] = args["disks"]
        return result


class Cloud:
    def __init__(self, model: template.LocalTemplate, aws: runtime.LocalAws, hosts: HostStandIn,
                 tap_url: str) -> None:
        self.model, self.aws, self.hosts, self.tap_url = model, aws, hosts, tap_url
        self.sfn = aws.client("stepfunctions")
        self.arn = model.state_machines["ResizeStateMachine"].arn

    def start(self, document: dict[str, Any], name: str) -> str:
        return self.sfn.start_execution(stateMachineArn=self.arn, name=name, input=json.dumps(document))[
            "executionArn"]

    def finish(self, execution_arn: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT
        while True:
            described = self.sfn.describe_execution(executionArn=execution_arn)
            if described["status"] != "RUNNING":
                return described
            assert time.monotonic() < deadline, f"{execution_arn} still running"
            time.sleep(0.1)

    def move(self, inp: dict[str, Any]) -> dict[str, Any]:
        """Start the execution as the API names it, without ``execution_name`` (the workflow fills it in)."""
        document = {k: v for k, v in inp.items() if k != "execution_name"}
        return self.finish(self.start(document, inp["execution_name"]))

    def notifications(self) -> list[dict[str, Any]]:
        """What reached the template's notification bus (through a rule with a queue target)."""
        sqs, found = self.aws.client("sqs"), []
        while messages := sqs.receive_message(QueueUrl=self.tap_url, MaxNumberOfMessages=10).get("Messages"):
            for message in messages:
                found.append(json.loads(message["Body"])["detail"])
                sqs.delete_message(QueueUrl=self.tap_url, ReceiptHandle=message["ReceiptHandle"])
        return found

    def state_input(self, execution_arn: str, state: str) -> dict[str, Any]:
        """The document ``state`` was entered with (the first time)."""
        history = self.sfn.get_execution_history(executionArn=execution_arn, maxResults=1000)["events"]
        return json.loads(next(e["stateEnteredEventDetails"]["input"] for e in history
                               if e.get("stateEnteredEventDetails", {}).get("name") == state))

    def states_entered(self, execution_arn: str) -> list[str]:
        history = self.sfn.get_execution_history(executionArn=execution_arn, maxResults=1000)["events"]
        return [e["stateEnteredEventDetails"]["name"] for e in history if "stateEnteredEventDetails" in e]


@pytest.fixture
def cloud(sqlite_store, tmp_path, monkeypatch) -> Iterator[Cloud]:
    with running_cloud(sqlite_store, tmp_path, monkeypatch) as started:
        yield started


@contextmanager
def running_cloud(sqlite_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  stand_in: type[HostStandIn] = HostStandIn,
                  more_hosts: dict[str, tuple[str, int]] | None = None) -> Iterator[Cloud]:
    """The template deployed on moto with HOSTS reporting in cell1 (and ``more_hosts``: name -> cell, memory),
    each answered by ``stand_in``."""
    monkeypatch.setenv("FERRY_FAULT_INJECTION", str(tmp_path / "faults.json"))
    port = runtime.free_port()
    model = template.resolve(ROOT / "template.yaml", endpoint_url=f"http://127.0.0.1:{port}", parameters={
        "FerryStateDir": str(tmp_path), "ApiDatabaseUrl": sqlite_store.api_url,
        "HostOpTimeoutSeconds": 30, "HostOpHeartbeatSeconds": 20})
    aws = runtime.LocalAws(model, port=port).start()
    try:
        provision.provision(model, aws.client)
        sqs = aws.client("sqs")
        urls = {host: sqs.create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, host))[
            "QueueUrl"] for host in HOSTS}
        for host, memory in HOSTS.items():
            report(host, memory_mb=memory)
        for host, (cell, memory) in (more_hosts or {}).items():
            urls[host] = sqs.create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix,
                                                                              host))["QueueUrl"]
            report(host, cell, memory_mb=memory)
        with api_session() as session:
            session.add(Network(id="net-1", name="shared", cidr="10.0.0.0/24"))
        bus = model.event_buses["NotificationBus"].name
        tap = sqs.create_queue(QueueName="notifications-tap")["QueueUrl"]
        tap_arn = sqs.get_queue_attributes(QueueUrl=tap, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        events = aws.client("events")
        events.put_rule(Name="tap", EventBusName=bus, EventPattern=json.dumps({"source": [notifications.SOURCE]}))
        events.put_targets(Rule="tap", EventBusName=bus, Targets=[{"Id": "tap", "Arn": tap_arn}])
        with stand_in(aws, urls) as answering:
            yield Cloud(model, aws, answering, tap)
        assert answering.problems == []
    finally:
        faults.disarm_all()
        aws.stop()


def test_a_resize_started_directly_reaches_verify_resize(cloud):
    uuid = make_server(volume=True)
    inp = prepare_move(uuid, BIG)

    described = cloud.move(inp)

    assert described["status"] == "SUCCEEDED", described
    server = instance(uuid)
    assert states.api_status(server.vm_state, server.task_state) == "VERIFY_RESIZE"
    assert (server.host, server.flavor, server.power_state) == ("cell1-host2", BIG, states.RUNNING)
    assert migration(inp["migration_uuid"]).status == "finished"
    assert cloud.hosts.received == [("cell1-host2", "prep_resize"), (SOURCE, "resize_instance"),
                                    ("cell1-host2", "finish_resize")]
    assert placement.get_allocations(inp["migration_uuid"]) == {
        placement.provider_by_host(SOURCE): {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 1}}
    assert used_on("cell1-host2") == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}
    assert {result for result, _host, _done in events_of(uuid).values()} == {"Success"}
    assert cloud.states_entered(described["executionArn"]) == [
        "ValidateMoveInput", "SelectMoveDestinations", "IsMoveAcrossCells", "PrepResizeAtDest", "PrepResizeOnDestHost",
        "ResizeInstanceAtSource", "ResizeInstanceOnSourceHost", "FinishResizeAtDest", "FinishResizeOnDestHost",
        "MarkResized", "Resized"]
    assert [n["event_type"] for n in cloud.notifications()] == [
        "instance.resize_prep.start", "instance.resize_prep.end", "instance.resize.start", "instance.resize.end",
        "instance.resize_finish.start", "instance.resize_finish.end"]


def test_a_cold_migrate_of_a_stopped_server_stays_off(cloud):
    uuid = make_server(vm_state=states.STOPPED, power_state=states.SHUTDOWN)
    inp = prepare_move(uuid)

    described = cloud.move(inp)

    assert described["status"] == "SUCCEEDED", described
    server = instance(uuid)
    assert (server.vm_state, server.power_state, server.host) == ("resized", states.SHUTDOWN, "cell1-host2")


def test_a_refused_resize_claim_is_rescheduled_to_the_alternate(cloud):
    cloud.hosts.failures[("cell1-host2", "prep_resize")] = "Ferry.ResizeClaimFailed"
    uuid = make_server()
    inp = prepare_move(uuid, BIG)

    described = cloud.move(inp)

    assert described["status"] == "SUCCEEDED", described
    assert instance(uuid).host == "cell1-host3"
    assert used_on("cell1-host2") == {}
    assert used_on("cell1-host3") == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}
    assert ("cell1-host2", "revert_resize") not in cloud.hosts.received
    assert "RescheduleMove" in cloud.states_entered(described["executionArn"])


def test_a_refused_claim_on_a_requested_host_is_not_rescheduled(cloud):
    cloud.hosts.failures[("cell1-host3", "prep_resize")] = "Ferry.ResizeClaimFailed"
    uuid = make_server()
    before = snapshot(uuid)

    described = cloud.move(prepare_move(uuid, requested_host="cell1-host3"))

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.ResizeClaimFailed")
    assert snapshot(uuid) == before
    assert "RescheduleMove" not in cloud.states_entered(described["executionArn"])


def test_a_failed_finish_rolls_back_through_both_hosts_and_leaves_the_server_as_before(cloud):
    cloud.hosts.failures[("cell1-host2", "finish_resize")] = "Ferry.DiskCopyFailed"
    uuid = make_server(volume=True)
    before = snapshot(uuid)
    inp = prepare_move(uuid, BIG)

    described = cloud.move(inp)

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.DiskCopyFailed")
    assert cloud.hosts.received[-2:] == [("cell1-host2", "revert_resize"), (SOURCE, "finish_revert_resize")]
    assert snapshot(uuid) == before
    assert migration(inp["migration_uuid"]).status == "error"
    [fault] = faults_of(uuid)
    # the owner reads the failure's name, not the host's words (admins read them in the details)
    assert (fault.message, fault.details) == ("Ferry.DiskCopyFailed", "Cause: finish_resize failed on cell1-host2")
    assert events_of(uuid)[resize.EVENT_FINISH][0] == "Error"
    assert [n["event_type"] for n in cloud.notifications()][-1] == "instance.resize.error"


def test_a_source_that_cannot_be_restored_leaves_the_server_in_error(cloud):
    cloud.hosts.failures[("cell1-host2", "finish_resize")] = "Ferry.DiskCopyFailed"
    cloud.hosts.failures[(SOURCE, "finish_revert_resize")] = "Ferry.HypervisorError"
    uuid = make_server()

    described = cloud.move(prepare_move(uuid, BIG))

    assert described["status"] == "FAILED"
    server = instance(uuid)
    assert (server.vm_state, server.task_state, server.host) == ("error", None, SOURCE)
    assert placement.get_allocations(uuid) == {placement.provider_by_host(SOURCE): {"VCPU": 1, "MEMORY_MB": 512,
                                                                                    "DISK_GB": 1}}
    assert f"{uuid}_resize on {SOURCE}" in faults_of(uuid)[0].details


def test_a_destination_that_may_still_run_the_guest_leaves_the_source_guest_off_and_the_server_in_error(cloud):
    # GIVEN finish_resize fails on the destination, and so does its revert after every retry
    cloud.hosts.failures[("cell1-host2", "finish_resize")] = "Ferry.HypervisorError"
    cloud.hosts.failures[("cell1-host2", "revert_resize")] = "Ferry.HostOperationFailed"
    uuid = make_server(volume=True)
    before = snapshot(uuid)
    inp = prepare_move(uuid, BIG)

    described = cloud.move(inp)

    # THEN the source guest is restored with every argument as recorded but not powered on
    assert (described["status"], described["error"]) == ("FAILED", "Ferry.HypervisorError")
    entered = cloud.states_entered(described["executionArn"])
    assert entered[-5:] == ["WasSourceTouched", "KeepSourceGuestOff", "FinishRevertOnSourceHost", "RollbackMove",
                            "MoveFailed"]
    recorded = cloud.state_input(described["executionArn"], "KeepSourceGuestOff")["move"]["restore_args"]
    assert recorded["power_on"] is True and recorded["volumes"]
    assert cloud.hosts.args[(SOURCE, "finish_revert_resize")] == {**recorded, "power_on": False}
    # and the server is in ERROR, shut off on its source, its allocations and records otherwise as before
    record = {**before["record"], "vm_state": states.ERROR, "power_state": states.SHUTDOWN}
    assert snapshot(uuid) == {**before, "record": record}
    [fault] = faults_of(uuid)
    assert "the destination host could not be cleaned up" in fault.message
    assert "Destroy the guest on cell1-host2 first" in fault.details


def test_a_destination_that_failed_to_clean_up_before_finish_resize_was_sent_leaves_the_server_as_before(cloud):
    cloud.hosts.failures[(SOURCE, "resize_instance")] = "Ferry.DiskCopyFailed"
    cloud.hosts.failures[("cell1-host2", "revert_resize")] = "Ferry.HostOperationFailed"
    uuid = make_server(volume=True)
    before = snapshot(uuid)

    described = cloud.move(prepare_move(uuid, BIG))

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.DiskCopyFailed")
    assert "KeepSourceGuestOff" not in cloud.states_entered(described["executionArn"])
    assert cloud.hosts.args[(SOURCE, "finish_revert_resize")]["power_on"] is True
    assert snapshot(uuid) == before
    [fault] = faults_of(uuid)
    assert "cell1-host2" in fault.details and "may remain there" in fault.details


def test_a_failure_injected_in_the_last_step_is_rolled_back(cloud):
    faults.arm("MarkResized", error="HypervisorError")
    uuid = make_server()
    before = snapshot(uuid)

    described = cloud.move(prepare_move(uuid, BIG))

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.HypervisorError")
    assert snapshot(uuid) == before


def test_no_valid_host_fails_the_execution_and_the_server_stays_as_it_was(cloud):
    uuid = make_server()
    before = snapshot(uuid)

    described = cloud.move(prepare_move(uuid, {**BIG, "flavorid": "9", "vcpus": 64}))

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.NoValidHost")
    assert snapshot(uuid) == before
    assert faults_of(uuid) == []
    assert cloud.hosts.received == []


def test_input_that_does_not_match_the_schema_fails_and_changes_nothing(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    before = snapshot(uuid)

    described = cloud.finish(cloud.start({"instance_uuid": uuid, "cell": "cell1"}, "resize-bad-input"))

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.InvalidWorkflowInput")
    assert snapshot(uuid) == before
    assert migration(inp["migration_uuid"]).status == "pre-migrating"
    assert cloud.states_entered(described["executionArn"]) == ["ValidateMoveInput", "MoveRefused"]


def test_a_move_the_api_did_not_prepare_fails_and_changes_nothing(cloud):
    uuid = make_server()
    before = snapshot(uuid)
    inp = prepare_move(uuid, BIG)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=None))

    described = cloud.move(inp)

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.MoveNotPrepared")
    assert {k: v for k, v in snapshot(uuid).items() if k != "record"} == {
        k: v for k, v in before.items() if k != "record"}
    assert migration(inp["migration_uuid"]).status == "pre-migrating"
