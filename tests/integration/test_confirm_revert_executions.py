"""The confirm, revert, delete and volume attachment state machines run by moto's executor.

The real template is resolved for this test's store and played by the local runtime (moto
with the handlers patched in), so the ASL files, their substitutions, Retry/Catch and JSONPath
run as they would on AWS. A fake host agent answers each host operation from the host queues,
succeeding or failing as the test asks. SQLite only: the steps' logic runs on both databases in
the ``test_*_steps.py`` modules.
"""

from __future__ import annotations

import json
import threading
import time
import uuid as uuidlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
from verify_resize_helpers import (
    DEST,
    NEW_USAGE,
    OLD_USAGE,
    OTHER,
    PROJECT,
    ROOT,
    SOURCE,
    USER,
    attachments,
    bindings,
    instance_row,
    make_resized,
    make_volume,
    migration_row,
    report,
    snapshot,
    usage,
)

from ferry import aws, hosts, placement, protocol
from ferry.auth import RequestContext
from ferry.compute import api as compute_api
from ferry.compute import migration_states, moves, states
from ferry.local import provision, runtime, template
from ferry.store.api_models import Network
from ferry.store.db import api_session
from ferry.workflows import volume_attachment

HOST_OP_SECONDS = 20


@dataclass
class FakeAgents:
    """Answers every operation sent to the hosts' queues; ``failures[(host, operation)]`` makes one fail."""

    sqs: Any
    sfn: Any
    queues: dict[str, str]
    failures: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    received: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            for host, url in self.queues.items():
                for message in self.sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10,
                                                        WaitTimeSeconds=0).get("Messages") or []:
                    self.sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
                    self.answer(host, json.loads(message["Body"]))
            time.sleep(0.05)

    def answer(self, host: str, body: dict[str, Any]) -> None:
        operation, args = body["operation"], body["args"]
        self.received.append((host, operation, args))
        failure = self.failures.get((host, operation))
        if failure is not None:
            self.sfn.send_task_failure(taskToken=body["task_token"], error=failure[0], cause=failure[1])
            return
        power = states.SHUTDOWN if operation == protocol.FINISH_REVERT_RESIZE and not args["power_on"] else (
            states.RUNNING if operation in (protocol.FINISH_REVERT_RESIZE, protocol.ATTACH_VOLUME) else states.NOSTATE)
        result = {"instance_uuid": body["instance_uuid"], "host": host, "node": host, "power_state": power}
        self.sfn.send_task_success(taskToken=body["task_token"], output=json.dumps(result))

    def operations(self) -> list[tuple[str, str]]:
        return [(host, operation) for host, operation, _ in self.received]


@dataclass
class Stack:
    model: template.LocalTemplate
    sfn: Any
    agents: FakeAgents

    def arn(self, machine: str) -> str:
        return self.model.state_machines[machine].arn

    def wait(self, machine: str, name_prefix: str, timeout: float = 60) -> dict[str, Any]:
        """The first execution of ``machine`` whose name starts with ``name_prefix``, once it ended."""
        deadline = time.monotonic() + timeout
        while True:
            listed = self.sfn.list_executions(stateMachineArn=self.arn(machine))["executions"]
            found = [e for e in listed if e["name"].startswith(name_prefix)]
            if found:
                described = self.sfn.describe_execution(executionArn=found[0]["executionArn"])
                if described["status"] != "RUNNING":
                    return described
            assert time.monotonic() < deadline, f"{machine} {name_prefix} did not end"
            time.sleep(0.1)

    def run(self, machine: str, document: dict[str, Any]) -> dict[str, Any]:
        name = str(uuidlib.uuid4())
        self.sfn.start_execution(stateMachineArn=self.arn(machine), name=name, input=json.dumps(document))
        return self.wait(machine, name)


@pytest.fixture
def stack(sqlite_store, tmp_path) -> Iterator[Stack]:
    port = runtime.free_port()
    model = template.resolve(ROOT / "template.yaml", endpoint_url=f"http://127.0.0.1:{port}", parameters={
        "FerryStateDir": str(tmp_path), "ApiDatabaseUrl": sqlite_store.api_url,
        "HostOpTimeoutSeconds": HOST_OP_SECONDS, "HostOpHeartbeatSeconds": HOST_OP_SECONDS // 2})
    local = runtime.LocalAws(model, port=port).start()
    agents_thread = None
    try:
        provision.provision(model, local.client)
        hosts._queue_urls.clear()
        sqs = local.client("sqs")
        queues = {}
        for host in (SOURCE, DEST, OTHER):
            queues[host] = sqs.create_queue(QueueName=protocol.host_queue_name(
                model.functions["ApiFunction"].environment["FERRY_HOST_QUEUE_PREFIX"], host))["QueueUrl"]
            report(host)
        with api_session() as session:
            session.add(Network(id="net-1", name="shared", cidr="10.0.0.0/24"))
        agents = FakeAgents(sqs=sqs, sfn=local.client("stepfunctions"), queues=queues)
        agents_thread = threading.Thread(target=agents.run, daemon=True)
        agents_thread.start()
        yield Stack(model=model, sfn=local.client("stepfunctions"), agents=agents)
        agents._stop.set()
    finally:
        local.stop()
        hosts._queue_urls.clear()
        aws.reset()
        if agents_thread is not None:
            agents_thread.join(5)


def owner() -> RequestContext:
    return RequestContext(user_id=USER, project_id=PROJECT, roles=("member",))


def confirm(resized: Any, stack: Stack) -> dict[str, Any]:
    moves.begin_confirm("cell1", resized.instance_uuid, request_id=f"req-{uuidlib.uuid4()}", user_id=USER,
                        project_id=PROJECT)
    return stack.wait("ConfirmResizeStateMachine", f"confirm-{resized.instance_uuid}")


def revert(resized: Any, stack: Stack) -> dict[str, Any]:
    moves.begin_revert("cell1", resized.instance_uuid, request_id=f"req-{uuidlib.uuid4()}", user_id=USER,
                       project_id=PROJECT)
    return stack.wait("RevertResizeStateMachine", f"revert-{resized.instance_uuid}")


def test_a_confirm_runs_to_the_end(stack):
    resized = make_resized()

    execution = confirm(resized, stack)

    assert execution["status"] == "SUCCEEDED", execution
    [(host, operation, args)] = stack.agents.received
    assert (host, operation) == (SOURCE, protocol.CONFIRM_RESIZE)
    jsonschema.validate(args, protocol.ARGS_SCHEMAS[protocol.CONFIRM_RESIZE])
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED
    assert (usage(SOURCE), usage(DEST)) == ({}, NEW_USAGE)
    assert instance_row(resized.instance_uuid).vm_state == states.ACTIVE


def test_a_confirm_failing_at_the_source_ends_failed_with_the_migration_in_error(stack):
    resized = make_resized()
    stack.agents.failures[(SOURCE, protocol.CONFIRM_RESIZE)] = ("Ferry.HostOperationFailed", "disk busy")

    execution = confirm(resized, stack)

    assert (execution["status"], execution.get("error")) == ("FAILED", "Ferry.ConfirmResizeFailed")
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR
    assert instance_row(resized.instance_uuid).vm_state == states.ACTIVE
    assert usage(SOURCE) == OLD_USAGE


def test_a_confirm_started_by_hand_for_a_migration_nobody_confirms_is_refused(stack):
    resized = make_resized()
    before = snapshot(resized)

    execution = stack.run("ConfirmResizeStateMachine", {
        "instance_uuid": resized.instance_uuid, "migration_uuid": resized.migration_uuid, "cell": "cell1",
        "request_id": "req-by-hand"})

    assert (execution["status"], execution.get("error")) == ("FAILED", "Ferry.UnexpectedMigrationState")
    assert "not a confirm under way" in execution.get("cause", "")
    assert snapshot(resized) == before
    assert stack.agents.received == []


def test_a_revert_runs_to_the_end(stack, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)

    execution = revert(resized, stack)

    assert execution["status"] == "SUCCEEDED", execution
    assert stack.agents.operations() == [(DEST, protocol.REVERT_RESIZE), (SOURCE, protocol.FINISH_REVERT_RESIZE)]
    for _, operation, args in stack.agents.received:
        jsonschema.validate(args, protocol.ARGS_SCHEMAS[operation])
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host, row.power_state) == (states.ACTIVE, None, SOURCE, states.RUNNING)
    assert migration_row(resized.migration_uuid).status == migration_states.REVERTED
    assert (usage(SOURCE), usage(DEST)) == (OLD_USAGE, {})
    assert bindings(resized.instance_uuid) == {SOURCE: "ACTIVE"}
    assert attachments(resized.instance_uuid) == {SOURCE: "attached"}


def test_a_revert_the_destination_cannot_clean_up_leaves_verify_resize(stack):
    resized = make_resized()
    stack.agents.failures[(DEST, protocol.REVERT_RESIZE)] = ("Ferry.HypervisorError", "device busy")

    execution = revert(resized, stack)

    assert (execution["status"], execution.get("error")) == ("FAILED", "Ferry.RevertResizeFailed")
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host) == (states.RESIZED, None, DEST)
    assert migration_row(resized.migration_uuid).status == migration_states.FINISHED
    assert (usage(SOURCE), usage(DEST)) == (OLD_USAGE, NEW_USAGE)


def test_a_revert_whose_destination_failed_otherwise_is_error_never_verify_resize(stack):
    # Any failure but a HypervisorError may come after the destination destroyed the guest
    resized = make_resized()
    stack.agents.failures[(DEST, protocol.REVERT_RESIZE)] = ("Ferry.HostOperationFailed", "lost its answer")

    execution = revert(resized, stack)

    assert (execution["status"], execution.get("error")) == ("FAILED", "Ferry.RevertResizeFailed")
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state) == (states.ERROR, None)
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR


def test_a_revert_the_source_cannot_finish_is_error(stack):
    resized = make_resized()
    stack.agents.failures[(SOURCE, protocol.FINISH_REVERT_RESIZE)] = ("Ferry.GuestNotFound", "no kept disks")

    execution = revert(resized, stack)

    assert (execution["status"], execution.get("error")) == ("FAILED", "Ferry.RevertResizeFailed")
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state) == (states.ERROR, None)
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR


def test_a_stopped_server_reverted_stays_shutoff(stack):
    resized = make_resized(old_vm_state=states.STOPPED)

    assert revert(resized, stack)["status"] == "SUCCEEDED"

    assert stack.agents.received[-1][2]["power_on"] is False
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.power_state) == (states.STOPPED, states.SHUTDOWN)


def test_deleting_a_resized_server_confirms_at_the_source_then_destroys_at_the_destination(stack):
    resized = make_resized()
    location = compute_api.locate(owner(), resized.instance_uuid)

    compute_api.delete_server(owner(), location)
    execution = stack.wait("DeleteStateMachine", f"delete-{resized.instance_uuid}")

    assert execution["status"] == "SUCCEEDED", execution
    assert stack.agents.operations() == [(SOURCE, protocol.CONFIRM_RESIZE), (DEST, protocol.DESTROY)]
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED
    assert placement.get_allocations(resized.migration_uuid) == {}
    assert placement.get_allocations(resized.instance_uuid) == {}
    assert (usage(SOURCE), usage(DEST)) == ({}, {})
    assert bindings(resized.instance_uuid) == {}
    assert instance_row(resized.instance_uuid).deleted


def test_a_delete_started_without_the_volumes_to_delete_still_runs_to_the_end(stack, monkeypatch):
    # GIVEN a delete whose input an API function of an earlier release made (no delete_volumes)
    resized = make_resized()
    started: list[dict[str, Any]] = []
    monkeypatch.setattr(compute_api, "_start_or_undo", lambda arn, name, payload, *a, **k: started.append(payload))
    compute_api.delete_server(owner(), compute_api.locate(owner(), resized.instance_uuid))
    [payload] = started
    assert payload.pop("delete_volumes") == []

    execution = stack.run("DeleteStateMachine", payload)

    # THEN the host destroys the server, asked to remove no volume file, and the server is deleted
    assert execution["status"] == "SUCCEEDED", execution
    assert [args for host, operation, args in stack.agents.received if operation == protocol.DESTROY] == [
        {"volumes": []}]
    assert instance_row(resized.instance_uuid).deleted


def test_a_volume_attach_runs_on_the_servers_host(stack, tmp_path):
    resized = make_resized()
    volume_id = make_volume(tmp_path)

    volume_attachment.begin_attach(owner(), compute_api.locate(owner(), resized.instance_uuid), volume_id)
    execution = stack.wait("VolumeAttachmentStateMachine", f"attach-{resized.instance_uuid}")

    assert execution["status"] == "SUCCEEDED", execution
    [(host, operation, args)] = stack.agents.received
    assert (host, operation, args["volume"]["volume_id"]) == (DEST, protocol.ATTACH_VOLUME, volume_id)
    assert attachments(resized.instance_uuid) == {DEST: "attached", SOURCE: "reserved"}
    assert instance_row(resized.instance_uuid).task_state is None


def test_a_failed_volume_attach_is_detached_again_and_leaves_no_attachment(stack, tmp_path):
    resized = make_resized()
    volume_id = make_volume(tmp_path)
    stack.agents.failures[(DEST, protocol.ATTACH_VOLUME)] = ("Ferry.HostOperationFailed", "no such device")

    volume_attachment.begin_attach(owner(), compute_api.locate(owner(), resized.instance_uuid), volume_id)
    execution = stack.wait("VolumeAttachmentStateMachine", f"attach-{resized.instance_uuid}")

    assert (execution["status"], execution.get("error")) == ("FAILED", "Ferry.VolumeOperationFailed")
    assert stack.agents.operations() == [(DEST, protocol.ATTACH_VOLUME), (DEST, protocol.DETACH_VOLUME)]
    assert attachments(resized.instance_uuid) == {}
    assert instance_row(resized.instance_uuid).task_state is None


def test_a_revert_rolled_back_to_verify_resize_can_be_asked_again(stack):
    resized = make_resized()
    stack.agents.failures[(DEST, protocol.REVERT_RESIZE)] = ("Ferry.HypervisorError", "device busy")
    assert revert(resized, stack)["status"] == "FAILED"
    del stack.agents.failures[(DEST, protocol.REVERT_RESIZE)]

    moves.begin_revert("cell1", resized.instance_uuid, request_id=f"req-{uuidlib.uuid4()}", user_id=USER,
                       project_id=PROJECT)
    deadline = time.monotonic() + 60
    while migration_row(resized.migration_uuid).status == migration_states.REVERTING and time.monotonic() < deadline:
        time.sleep(0.2)

    assert migration_row(resized.migration_uuid).status == migration_states.REVERTED
