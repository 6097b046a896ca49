"""What an operation left on its host when its workflow gave up while the agent was down.

A host operation that makes a guest or sends disks (``spawn``, ``finish_resize``,
``resize_instance``, ``prep_snapshot_based_resize_at_source``) may be cut short by the agent's
death, or its answer may never leave, and the agent come back only once the Task has timed out.
The message then comes back to a host whose workflow no longer waits: what the operation did is
taken back, and a take-back cut short goes on when the message comes back again.

The two agents and their cloud are those of ``test_hostagent_resize.py``.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest
import test_hostagent_resize
from botocore.exceptions import ClientError
from test_hostagent_resize import OLD, PORTS, Host, boot, direct_resize, finish_args, image, logical_sha256

from ferry import errors
from hostagent import agent as agent_module
from hostagent import disks
from hostagent.agent import Operation
from hostagent.driver import RUNNING
from hostagent.journal import IN_PROGRESS, SUCCEEDED, TAKEN_BACK, TAKING_BACK

cloud = test_hostagent_resize.cloud
source = test_hostagent_resize.source
dest = test_hostagent_resize.dest
scaled_disks = test_hostagent_resize.scaled_disks


class Crash(BaseException):
    """The agent's process dying at that point: nothing after it runs, no handler catches it."""


def spawn_args(host: Host) -> dict[str, Any]:
    return {"name": "web-1", "flavor": OLD, "image": image(host.cloud, os.urandom(1024) + b"root disk"),
            "ports": PORTS, "volumes": [], "power_on": True}


def message(operation: str, instance_uuid: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"operation": operation, "operation_id": f"{uuid.uuid4()}:{operation}", "instance_uuid": instance_uuid,
            "args": args, "task_token": f"token-{uuid.uuid4()}"}


def deliver(host: Host, body: dict[str, Any]) -> None:
    """Put ``body`` on the host's queue and let its agent take it (a redelivery, when sent again)."""
    queue = host.agent.queue_url
    assert queue
    host.cloud.sqs.send_message(QueueUrl=queue, MessageBody=json.dumps(body))
    (received,) = host.cloud.sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=1)["Messages"]
    host.agent.process_message(received)


def gave_up(host: Host) -> None:
    """The workflow stops waiting: its Task timed out (heartbeats and answers are refused)."""
    host.cloud.sfn.gave_up, host.cloud.sfn.heartbeats_left = True, 0


def queue_is_empty(host: Host) -> bool:
    return host.cloud.sqs.receive_message(QueueUrl=host.agent.queue_url).get("Messages") is None


def status(host: Host, body: dict[str, Any]) -> str:
    assert host.agent.journal is not None
    entry = host.agent.journal.get(body["operation_id"])
    assert entry is not None
    return entry.status


def crashing_after(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    """``owner.name`` does its work, then the agent dies."""
    real = getattr(owner, name)

    def then_crash(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(owner, name, then_crash)


def spawn_cut_short_after_power_on(host: Host, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, Any]]:
    """A spawn whose agent died right after it powered the guest on; its instance and message."""
    instance_uuid = str(uuid.uuid4())
    body = message("spawn", instance_uuid, spawn_args(host))
    with monkeypatch.context() as patched:
        crashing_after(patched, host.driver, "power_on")
        with pytest.raises(Crash):
            deliver(host, body)
    return instance_uuid, body


def test_a_spawn_cut_short_after_power_on_and_found_given_up_takes_back_its_running_guest(cloud, dest, monkeypatch):
    # GIVEN a spawn whose agent died right after it powered the guest on
    instance_uuid, body = spawn_cut_short_after_power_on(dest, monkeypatch)
    assert dest.driver.guest_power_state(instance_uuid) == RUNNING and status(dest, body) == IN_PROGRESS

    # WHEN the message comes back once the workflow has given up on it
    gave_up(dest)
    deliver(dest, body)

    # THEN the guest nobody owns and its disks are gone, nothing is answered and the message is settled
    assert not dest.driver.guest_exists(instance_uuid)
    assert dest.instance_dirs() == []
    assert body["task_token"] not in cloud.sfn.answers
    assert queue_is_empty(dest)
    assert status(dest, body) == TAKEN_BACK


@pytest.mark.parametrize("died_after", ["the disks came in", "the guest was defined"])
def test_a_finish_resize_cut_short_and_found_given_up_takes_back_what_it_made(
        cloud, source, dest, monkeypatch, died_after):
    # GIVEN a finish_resize whose agent died part-way
    server = boot(source)
    migration_uuid, _claim, resized = direct_resize(source, dest, server)
    body = message("finish_resize", server.uuid, {**finish_args(migration_uuid, server, resized), "direct": True})
    with monkeypatch.context() as patched:
        if died_after == "the disks came in":
            crashing_after(patched, dest.agent, "_receive_disks")
        else:
            crashing_after(patched, dest.driver, "define_guest")
        with pytest.raises(Crash):
            deliver(dest, body)
    assert (dest.live(server.uuid) / disks.ROOT_DISK).exists()

    # WHEN its message comes back after the workflow rolled the server back to its source
    gave_up(dest)
    deliver(dest, body)

    # THEN neither the guest, its directory nor the copied disks stay; the source keeps its disks
    assert not dest.driver.guest_exists(server.uuid)
    assert dest.instance_dirs() == []
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256


def test_a_spawn_whose_result_was_journaled_but_never_answered_is_taken_back_once_given_up_and_an_answered_one_not(
        cloud, dest, monkeypatch):
    # GIVEN a spawn whose agent died between journaling its result and answering it, and another
    # spawn answered (the workflow took its result) whose message was not deleted
    unanswered, answered = str(uuid.uuid4()), str(uuid.uuid4())
    lost = message("spawn", unanswered, spawn_args(dest))
    taken = message("spawn", answered, spawn_args(dest))
    assert dest.agent.journal is not None
    with monkeypatch.context() as patched:
        crashing_after(patched, dest.agent.journal, "succeed")
        with pytest.raises(Crash):
            deliver(dest, lost)
    deliver(dest, taken)
    assert status(dest, lost) == SUCCEEDED and cloud.sfn.answers[taken["task_token"]][0] is not None

    # WHEN both messages come back after their Tasks closed
    gave_up(dest)
    deliver(dest, lost)
    deliver(dest, taken)

    # THEN what the unanswered spawn made is taken back rather than answered; the answered one's guest runs on
    assert not dest.driver.guest_exists(unanswered)
    assert lost["task_token"] not in cloud.sfn.answers
    assert status(dest, lost) == TAKEN_BACK
    assert dest.driver.guest_power_state(answered) == RUNNING
    assert dest.instance_dirs() == [answered]
    assert status(dest, taken) == SUCCEEDED


def test_a_spawn_whose_answer_is_refused_as_timed_out_takes_back_its_guest(cloud, dest):
    # GIVEN a workflow that still waits when the spawn starts and ends, but times out before its answer
    instance_uuid = str(uuid.uuid4())
    body = message("spawn", instance_uuid, spawn_args(dest))
    cloud.sfn.gave_up = True

    # WHEN the spawn runs and its answer is refused
    deliver(dest, body)

    # THEN the guest it made is taken back
    assert not dest.driver.guest_exists(instance_uuid)
    assert dest.instance_dirs() == []
    assert status(dest, body) == TAKEN_BACK


class TimedOutAfterARetry(test_hostagent_resize.TaskTimedOut, ClientError):
    """``TaskTimedOut`` as botocore raises it after trying the call again itself (its first
    attempt's response lost): ``RetryAttempts`` says so."""

    def __init__(self) -> None:
        ClientError.__init__(self, {"Error": {"Code": "TaskTimedOut", "Message": "Task Timed Out"},
                                    "ResponseMetadata": {"HTTPStatusCode": 400, "RetryAttempts": 1}},
                             "SendTaskSuccess")


def test_a_spawn_whose_answer_was_taken_though_its_response_was_lost_keeps_its_guest(cloud, dest, monkeypatch):
    # GIVEN Step Functions takes the spawn's success, its response is lost, and the client's own
    # retry of the call is refused: the token was spent by the first attempt
    instance_uuid = str(uuid.uuid4())
    body = message("spawn", instance_uuid, spawn_args(dest))
    take = cloud.sfn.send_task_success

    def taken_then_refused(**kwargs: Any) -> None:
        take(**kwargs)
        raise TimedOutAfterARetry()

    monkeypatch.setattr(cloud.sfn, "send_task_success", taken_then_refused)

    # WHEN the spawn runs and is answered
    deliver(dest, body)

    # THEN the workflow went on with the guest, and the guest stays: a refusal after a retry proves nothing
    assert body["task_token"] in cloud.sfn.answers
    assert dest.driver.guest_power_state(instance_uuid) == RUNNING
    assert status(dest, body) == SUCCEEDED and queue_is_empty(dest)


def test_a_take_back_cut_short_goes_on_when_the_message_comes_back(cloud, dest, monkeypatch):
    # GIVEN a spawn cut short, found given up, whose take-back the agent died during
    instance_uuid, body = spawn_cut_short_after_power_on(dest, monkeypatch)
    gave_up(dest)
    with monkeypatch.context() as patched:
        crashing_after(patched, dest.driver, "destroy")
        with pytest.raises(Crash):
            deliver(dest, body)
    assert not dest.driver.guest_exists(instance_uuid) and dest.instance_dirs() == [instance_uuid]
    assert status(dest, body) == TAKING_BACK

    # WHEN the message comes back again
    deliver(dest, body)

    # THEN the take-back is finished
    assert dest.instance_dirs() == []
    assert status(dest, body) == TAKEN_BACK
    assert queue_is_empty(dest)


def test_a_take_back_that_fails_leaves_the_message_to_try_again(cloud, dest, monkeypatch):
    # GIVEN a spawn cut short and found given up, whose guest cannot be destroyed at first (a failed
    # take-back's message comes back TAKE_BACK_RETRY_SECONDS later: at once here)
    monkeypatch.setattr(agent_module, "UNSURE_REDELIVERY_SECONDS", 0)
    monkeypatch.setattr(agent_module, "TAKE_BACK_RETRY_SECONDS", 0)
    instance_uuid, body = spawn_cut_short_after_power_on(dest, monkeypatch)
    gave_up(dest)

    def refused(_instance_uuid: str) -> None:
        raise errors.HypervisorError("destroy failed: the daemon is busy")

    with monkeypatch.context() as patched:
        patched.setattr(dest.driver, "destroy", refused)
        deliver(dest, body)
    assert dest.driver.guest_power_state(instance_uuid) == RUNNING and status(dest, body) == TAKING_BACK

    # WHEN the message comes back and the hypervisor answers again
    (again,) = cloud.sqs.receive_message(QueueUrl=dest.agent.queue_url, MaxNumberOfMessages=1)["Messages"]
    dest.agent.process_message(again)

    # THEN the guest and its disks are gone
    assert not dest.driver.guest_exists(instance_uuid)
    assert dest.instance_dirs() == []
    assert status(dest, body) == TAKEN_BACK
    assert queue_is_empty(dest)


def test_a_late_take_back_leaves_the_guest_a_later_spawn_made(cloud, dest):
    # GIVEN a spawn cut short whose instance a later spawn (another operation) made again on this host
    instance_uuid = str(uuid.uuid4())
    earlier = message("spawn", instance_uuid, spawn_args(dest))
    later = message("spawn", instance_uuid, spawn_args(dest))
    deliver(dest, later)

    # WHEN the earlier spawn's take-back runs
    dest.agent.take_back_guest(Operation("spawn", earlier["operation_id"], instance_uuid, earlier["args"], None))

    # THEN the later spawn's guest and disks stay
    assert dest.driver.guest_power_state(instance_uuid) == RUNNING
    assert dest.instance_dirs() == [instance_uuid]


def test_a_late_take_back_of_a_finish_resize_leaves_what_a_later_move_made(cloud, source, dest):
    # GIVEN a server moved to the destination by a later move than the one being taken back
    server = boot(source)
    earlier = str(uuid.uuid4())
    test_hostagent_resize.move(source, dest, server)
    args = finish_args(earlier, server, {"disks": {}, "was_running": True})

    # WHEN the earlier move's finish_resize is taken back
    dest.agent.take_back_guest(Operation("finish_resize", f"{earlier}:finish", server.uuid, args, None))

    # THEN the later move's guest and disks stay
    assert dest.driver.guest_power_state(server.uuid) == RUNNING
    assert dest.instance_dirs() == [server.uuid]



def stopped_streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Collects the bytes moved so far by each disk stream that stopped as its operation was abandoned."""
    stopped: list[int] = []
    real = disks._Pace.moved

    def watching(pace: disks._Pace, count: int) -> None:
        try:
            real(pace, count)
        except errors.OperationAbandoned:
            stopped.append(pace._moved)
            raise

    monkeypatch.setattr(disks._Pace, "moved", watching)
    return stopped


@pytest.mark.parametrize(("way", "mib_per_second"), [("straight into the destination's directory", "2"),
                                                     ("through the transfer", "0.5")])
def test_a_resize_instance_whose_workflow_gives_up_while_it_sends_stops_sending_and_takes_back_what_it_sent(
        cloud, dest, monkeypatch, way, mib_per_second):
    # GIVEN a source whose agent beats its tasks' heartbeats often, and a server on it whose disks
    # stream slowly (a drill's throttle: its first chunk takes two seconds)
    source = cloud.add_host("compute3", keepalive_interval=0.3)
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    args = test_hostagent_resize.resize_args(migration_uuid, dest)
    if way == "straight into the destination's directory":
        args["direct"] = dest.ok("prep_resize", server.uuid,
                                 {"migration_uuid": migration_uuid, "flavor": test_hostagent_resize.NEW,
                                  "same_host": False})["direct"]
    monkeypatch.setenv(disks.THROTTLE_ENV, mib_per_second)
    stopped = stopped_streams(monkeypatch)

    # WHEN its Task times out once the operation started (the first keepalive beat is refused)
    cloud.sfn.gave_up, cloud.sfn.heartbeats_left = True, 1
    body = message("resize_instance", server.uuid, args)
    deliver(source, body)

    # THEN the stream under way stopped rather than sending every disk to its end, what was sent
    # is gone, the disks kept for the rollback's revert are whole, and nothing was answered
    assert len(stopped) == 1
    assert status(source, body) == TAKEN_BACK
    assert body["task_token"] not in cloud.sfn.answers
    assert queue_is_empty(source)
    assert not disks.incoming_dir(dest.instances_dir, server.uuid).exists()
    assert cloud.transfer_keys(test_hostagent_resize.transfer(migration_uuid)["prefix"]) == []
    assert not cloud.s3.list_multipart_uploads(Bucket=test_hostagent_resize.TRANSFERS).get("Uploads")
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256
