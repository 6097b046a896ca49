"""Drains in the store: requests, plans that count what they placed, move slots and limits, actions.

The workflow around these (nested resize and confirm executions on real agents) is exercised
end to end in tests/e2e/test_drains.py.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import uuid

import pytest
from moto import mock_aws
from placement_helpers import (
    PROJECT,
    USER,
    add_compute,
    add_group,
    add_instance,
    flavor,
    join_group,
    request_spec,
    resources,
)
from sqlalchemy import select, update
from test_api_support import ADMIN as API_ADMIN
from test_api_support import add_host, call, mocked_cloud
from trickling_receiver import trickling_receiver

from ferry import aws, config, drains, errors, notifications, placement
from ferry.auth import RequestContext
from ferry.compute import actions, instances, moves, services
from ferry.compute import api as compute_api
from ferry.store import setup
from ferry.store.api_models import CellMapping, Drain, DrainServer, InstanceMapping
from ferry.store.cell_models import Instance, InstanceAction, Migration
from ferry.store.db import api_session, cell_session
from ferry.workflows import drain as drain_steps
from ferry.workflows import resize

ADMIN = RequestContext(user_id="op", project_id="ops", roles=("admin",))
SMALL = flavor(vcpus=1, memory_mb=2048, root_gb=1)
CALLBACK_SECRET = "callback-secret-for-tests"
WEBHOOK_SECRET = "webhook-secret-for-tests"


@pytest.fixture(autouse=True)
def callbacks_configured(monkeypatch):
    """Drains may name a callback URL: the stack's DrainCallbackSecret is set (the webhook's secret too,
    which callbacks must never be signed with)."""
    monkeypatch.setenv("FERRY_CALLBACK_SECRET", CALLBACK_SECRET)
    monkeypatch.setenv("FERRY_WEBHOOK_SECRET", WEBHOOK_SECRET)
    config.reset()


def _server_on(host: str, rp_uuid: str, cell: str = "cell1", size: dict | None = None) -> str:
    uuid = add_instance(host, cell)
    size = size or SMALL
    with cell_session(cell) as session:
        session.execute(update(Instance).where(Instance.uuid == uuid).values(vm_state="active", flavor=size))
    placement.claim(uuid, PROJECT, USER, {rp_uuid: resources(size["vcpus"], size["memory_mb"], size["root_gb"])})
    return uuid


def _record(request: dict, **kwargs) -> str:
    drain_uuid, created = drains.record_drain(ADMIN, request, origin="api", **kwargs)
    assert created
    return drain_uuid


def _servers(drain_uuid: str) -> dict[str, DrainServer]:
    with api_session() as session:
        drain = session.scalars(select(Drain).where(Drain.uuid == drain_uuid)).one()
        rows = session.scalars(select(DrainServer).where(DrainServer.drain_id == drain.id)).all()
        for row in rows:
            session.expunge(row)
        return {row.instance_uuid: row for row in rows}


def test_a_plan_counts_the_servers_placed_before_it(store):
    source = add_compute("source", memory_mb=16384)
    add_compute("small-dest", memory_mb=4096)
    moving = [_server_on("source", source) for _ in range(3)]
    drain = _record({"host": "source", "dry_run": True})

    result = drains.plan(drain)

    # small-dest has room for two of them: the third has nowhere to go.
    assert result["fits"] is False and result["unplaceable"] == 1 and len(result["servers"]) == 2
    rows = _servers(drain)
    assert set(rows) == set(moving)
    assert sorted(row.state for row in rows.values()) == ["pending", "pending", "unplaceable"]
    assert {row.planned_host for row in rows.values() if row.state == "pending"} == {"small-dest"}
    [unplaced] = [row for row in rows.values() if row.state == "unplaceable"]
    assert "No valid host" in unplaced.error
    view = drains.get_view(drain)
    assert view["status"] == "planned" and view["plan"]["fits"] is False
    assert [u["id"] for u in view["plan"]["unplaceable"]] == [unplaced.instance_uuid]
    # A dry run disables nothing and claims nothing.
    assert not any(s.disabled for s in services.list_services())
    assert placement.get_allocations(moving[0]) == {source: resources(1, 2048, 1)}


@pytest.mark.parametrize("max_per_host", [None, 2])
def test_a_plan_keeps_anti_affinity_members_apart_where_it_planned_them(store, max_per_host):
    # GIVEN two members of an anti-affinity group, on two drained hosts, and two hosts to go to,
    # one with far more room (the one each would be sent to on its own)
    group = add_group("anti-affinity", {"max_server_per_host": max_per_host} if max_per_host else None)
    members = []
    for name in ("source-a", "source-b"):
        members.append(_server_on(name, add_compute(name)))
        join_group(group, members[-1])
    add_compute("roomy", memory_mb=65536)
    add_compute("small", memory_mb=8192)
    with api_session() as session:
        for member in members:
            compute_api.save_request_spec(session, member, request_spec(member, group={"uuid": group}))
    drain = _record({"hosts": ["source-a", "source-b"], "dry_run": True})

    # WHEN the drain is planned
    drains.plan(drain)

    # THEN the second member planned is kept off the host the first was planned to (unless the
    # group lets two share a host)
    planned = sorted(row.planned_host for row in _servers(drain).values())
    assert planned == (["roomy", "roomy"] if max_per_host else ["roomy", "small"])


def test_the_largest_servers_are_planned_first(store):
    source = add_compute("source", memory_mb=16384, vcpus=16)
    add_compute("dest", memory_mb=4096, vcpus=16)
    small = _server_on("source", source)
    large = _server_on("source", source, size=flavor(vcpus=1, memory_mb=4096, root_gb=1))
    drain = _record({"host": "source", "dry_run": True})

    drains.plan(drain)

    rows = _servers(drain)
    assert rows[large].state == "pending" and rows[large].planned_host == "dest"
    assert rows[small].state == "unplaceable"


def test_servers_that_cannot_move_are_named_in_the_plan(store):
    source = add_compute("source")
    add_compute("dest")
    busy = _server_on("source", source)
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == busy).values(vm_state="error"))
    drain = _record({"host": "source", "dry_run": True})

    assert drains.plan(drain)["fits"] is False
    assert "error" in _servers(drain)[busy].error


def test_starting_disables_the_hosts_and_a_plan_that_does_not_fit_gives_them_back(store):
    source = add_compute("source")
    _server_on("source", source)  # no other host: nowhere to go
    drain = _record({"host": "source", "reason": "retire"})

    started = drains.start(drain)

    assert started["proceed"] is False and started["fits"] is False
    assert not any(s.disabled for s in services.list_services(host="source"))
    report = drains.finish(drain)
    assert report["status"] == "failed" and "does not fit" in report["message"]


def test_starting_a_drain_that_fits_disables_its_hosts_with_the_reason(store):
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source", "reason": "retire"})

    started = drains.start(drain)

    assert started["proceed"] is True and started["max_concurrency"] == drains.DEFAULT_MAX_CONCURRENCY
    [service] = services.list_services(host="source")
    assert service.disabled and service.disabled_reason == f"drain {drain}: retire"
    assert drains.get_view(drain)["status"] == "running"


def test_move_what_fits_moves_the_servers_that_fit(store):
    source = add_compute("source", memory_mb=16384)
    add_compute("dest", memory_mb=2048)
    _server_on("source", source)
    _server_on("source", source)
    drain = _record({"host": "source", "move_what_fits": True})

    started = drains.start(drain)

    assert started["proceed"] is True and len(started["servers"]) == 1 and started["fits"] is False


def test_move_slots_respect_the_per_host_limits_pause_and_cancel(store):
    source = add_compute("source", memory_mb=16384)
    add_compute("dest", memory_mb=16384)
    uuids = [_server_on("source", source) for _ in range(3)]
    drain = _record({"host": "source", "max_per_source_host": 2})
    drains.start(drain)

    first, second, third = (drains.acquire_slot(drain, uuid) for uuid in uuids)

    assert (first.action, second.action, third.action) == ("move", "move", "wait")
    assert first.migration_uuid != second.migration_uuid and first.request_id.startswith("req-")
    # The same step run again hands out the same attempt.
    assert drains.acquire_slot(drain, uuids[0]) == first
    assert drains.act(drain, "pause")["status"] == "paused"
    assert drains.act(drain, "pause")["status"] == "paused"  # asked twice: no change, no error
    with api_session() as session:
        session.execute(update(DrainServer).where(DrainServer.instance_uuid == uuids[0]).values(state="done"))
    assert drains.acquire_slot(drain, uuids[2]).action == "wait"  # a slot is free, but paused
    assert drains.act(drain, "resume")["status"] == "running"
    assert drains.acquire_slot(drain, uuids[2]).action == "move"
    drains.act(drain, "cancel")
    with pytest.raises(errors.DrainInvalidState):
        drains.act(drain, "pause")


def test_a_waiting_iteration_waits_longer_the_longer_it_has_run_so_its_history_lasts_for_days(store):
    source = add_compute("source", memory_mb=16384)
    add_compute("dest", memory_mb=16384)
    uuids = [_server_on("source", source) for _ in range(2)]
    drain = _record({"host": "source", "max_per_source_host": 1})
    drains.start(drain)
    now = dt.datetime(2026, 1, 1, 12, 0, 0)

    def looks(poll: int, started: dt.datetime) -> int:
        return drains.wait_seconds(poll, started.isoformat(timespec="milliseconds") + "Z", now=now)

    # GIVEN an iteration waiting for its host's one slot
    assert drain_steps.acquire_slot({"drain_uuid": drain, "instance_uuid": uuids[0], "poll_seconds": 10,
                                     "iteration_started_at": "2026-01-01T12:00:00.000Z"})["action"] == "move"
    waiting = drain_steps.acquire_slot({"drain_uuid": drain, "instance_uuid": uuids[1], "poll_seconds": 10,
                                        "iteration_started_at": "2026-01-01T12:00:00.000Z"})

    # THEN it waits DrainPollSeconds at first, then a sixtieth of the time it has run, at most five minutes
    assert waiting["action"] == "wait" and waiting["wait_seconds"] >= 10
    assert looks(10, now - dt.timedelta(seconds=30)) == 10
    assert looks(10, now - dt.timedelta(hours=1)) == 60
    assert looks(10, now - dt.timedelta(days=2)) == 300
    assert looks(600, now - dt.timedelta(days=2)) == 600  # a longer poll is kept
    assert drains.wait_seconds(None, "not a time") == 10
    # and the looks over a week, about nine history events each, stay within the 25,000 an execution has
    ran, looked = 0, 0
    while ran < 7 * 86400:
        ran += looks(10, now - dt.timedelta(seconds=ran))
        looked += 1
    assert looked * 9 < 25_000


def test_cancel_settles_pending_servers_as_cancelled(store):
    source = add_compute("source")
    add_compute("dest")
    uuids = [_server_on("source", source) for _ in range(2)]
    drain = _record({"host": "source", "max_per_dest_host": 1})
    drains.start(drain)
    assert drains.acquire_slot(drain, uuids[0]).action == "move"
    assert drains.acquire_slot(drain, uuids[1]).action == "wait"  # dest takes one at a time

    drains.act(drain, "cancel")

    assert drains.acquire_slot(drain, uuids[1]).action == "stop"
    assert _servers(drain)[uuids[1]].state == "cancelled"


def test_requests_are_checked_before_anything_is_written(store):
    add_compute("source")
    with pytest.raises(errors.BadRequest, match="no-such-host"):
        drains.record_drain(ADMIN, {"host": "no-such-host"}, origin="api")
    with pytest.raises(errors.BadRequest, match="exactly one"):
        drains.record_drain(ADMIN, {"host": "source", "cell": "cell1"}, origin="api")
    with pytest.raises(errors.BadRequest, match="max_concurrency"):
        drains.record_drain(ADMIN, {"host": "source", "max_concurrency": 0}, origin="api")
    with pytest.raises(errors.Forbidden, match="compute:servers:resize:cross_cell"):
        drains.record_drain(ADMIN, {"cell": "cell1"}, origin="api")
    assert drains.list_views() == []


def test_one_drain_per_host_at_a_time_and_the_idempotency_key_answers_with_the_first(store):
    add_compute("source")
    first = _record({"host": "source"}, idempotency_key="delivery-1")

    again, created = drains.record_drain(ADMIN, {"host": "source"}, origin="webhook", idempotency_key="delivery-1")
    assert (again, created) == (first, False)
    with pytest.raises(errors.DrainInvalidState, match=first):
        drains.record_drain(ADMIN, {"hosts": ["source"]}, origin="api")
    # A dry run may look while the drain runs.
    assert drains.record_drain(ADMIN, {"host": "source", "dry_run": True}, origin="api")[1] is True


def _started_with_two(**options) -> tuple[str, str, str]:
    """A started drain of host ``source`` (``options`` added to the request), with two servers there."""
    source = add_compute("source")
    add_compute("dest")
    first, second = _server_on("source", source), _server_on("source", source)
    drain = _record({"host": "source", **options})
    drains.start(drain)
    return drain, first, second


def test_finishing_settles_what_the_map_left_pending_or_moving(store):
    drain, moving, pending = _started_with_two()
    assert drains.acquire_slot(drain, moving).action == "move"

    report = drains.finish(drain)

    assert report["status"] == "failed"
    rows = _servers(drain)
    assert rows[pending].state == "cancelled" and "ended before" in rows[pending].error
    assert rows[moving].state == "failed" and "could not record" in rows[moving].error
    assert drains.finish(drain) == report  # run again: the same report


def test_an_iteration_that_cannot_record_its_move_settles_its_server_and_frees_its_host_slot(store):
    # GIVEN one move at a time onto the destination, taken by a server whose iteration then
    # could not record the move's result (RecordFailure failed after its retries)
    drain, stuck, waiting = _started_with_two(max_per_dest_host=1)
    assert drains.acquire_slot(drain, stuck).action == "move"
    assert drains.acquire_slot(drain, waiting).action == "wait"

    # WHEN the iteration ends through SettleServer (twice: Step Functions may run it again)
    error = {"Error": "OperationalError", "Cause": json.dumps({"errorMessage": "could not connect to server"})}
    drains.settle_server(drain, stuck, error)
    settled = drains.settle_server(drain, stuck, error)

    # THEN the server is failed with the error, its slot is free, and the drain reports it
    assert settled["state"] == "failed"
    assert "could not record the result" in settled["error"] and "could not connect to server" in settled["error"]
    assert drains.acquire_slot(drain, waiting).action == "move"
    assert drains.finish(drain)["status"] == "failed"
    [shown] = [server for server in drains.get_view(drain)["servers"] if server["id"] == stuck]
    assert (shown["state"], shown["error"]) == ("failed", settled["error"])


def test_a_moving_server_is_not_settled_while_its_move_still_runs(store, monkeypatch):
    # GIVEN one move at a time onto the destination, taken by a server whose move's workflow
    # still runs after RecordFailure gave up waiting for it
    drain, stuck, waiting = _started_with_two(max_per_dest_host=1)
    slot = drains.acquire_slot(drain, stuck).to_dict()
    assert slot["action"] == "move"
    drains.prepare_move(drain, stuck, slot)  # the move accepted; its workflow then began
    running = {"status": "RUNNING", "input": "{}"}
    monkeypatch.setattr(drains.moves, "move_execution", lambda instance_uuid, migration_uuid: running)
    error = {"Error": "Ferry.MoveStillRunning", "Cause": "still runs"}

    # WHEN SettleServer runs, THEN it waits for the move: the server keeps its slot
    with pytest.raises(errors.MoveStillRunning):
        drains.settle_server(drain, stuck, error)
    assert drains.acquire_slot(drain, waiting).action == "wait"

    # and once the move's workflow has ended, the server is settled and its slot freed
    running["status"] = "FAILED"
    assert drains.settle_server(drain, stuck, error)["state"] == "failed"
    assert drains.acquire_slot(drain, waiting).action == "move"


def test_settling_fails_a_server_whose_move_never_started_and_leaves_a_settled_one(store):
    drain, pending, done = _started_with_two()
    with api_session() as session:
        session.execute(update(DrainServer).where(DrainServer.instance_uuid == done).values(state="done"))

    failed = drains.settle_server(drain, pending, {"Error": "Ferry.DrainNotFound", "Cause": "the drain is gone"})

    assert failed == {"state": "failed", "error": "The drain could not start this server's move (the drain is gone)."}
    assert drains.settle_server(drain, done, None) == {"state": "done", "error": None}
    assert drains.settle_server(str(uuid.uuid4()), pending, None) == {"state": None, "error": None}


@pytest.fixture
def bus(aws_test_credentials, monkeypatch):
    """The notification bus on moto, read back through a rule that forwards to a queue."""
    monkeypatch.setenv("FERRY_NOTIFICATION_BUS", "ferry-test-notifications")
    config.reset()
    with mock_aws():
        aws.reset()
        events, sqs = aws.client("events"), aws.client("sqs")
        events.create_event_bus(Name="ferry-test-notifications")
        url = sqs.create_queue(QueueName="tap")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        events.put_rule(Name="tap", EventBusName="ferry-test-notifications",
                        EventPattern=json.dumps({"source": [notifications.SOURCE]}))
        events.put_targets(Rule="tap", EventBusName="ferry-test-notifications", Targets=[{"Id": "q", "Arn": arn}])

        def received() -> list[dict]:
            messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages") or []
            return [json.loads(m["Body"]) for m in messages]

        yield received
        aws.reset()
    config.reset()


def test_a_drain_publishes_one_grouped_event_when_it_starts_and_one_when_it_ends(store, bus):
    source = add_compute("source")
    add_compute("dest")
    uuid = _server_on("source", source)
    drain = _record({"host": "source"})

    drains.start(drain)
    drains.finish(drain)
    drains.finish(drain)  # a step run twice announces the same end again

    events = bus()
    assert [e["detail-type"] for e in events] == ["drain.start", "drain.error", "drain.error"]
    end, again = events[1]["detail"], events[2]["detail"]
    assert end["priority"] == "ERROR" and end["payload"]["drain_id"] == drain
    assert end["payload"]["counts"]["cancelled"] == 1
    assert [s["id"] for s in end["payload"]["servers"]] == [uuid]
    assert again["message_id"] == end["message_id"] != events[0]["detail"]["message_id"]
    assert again["payload"] == end["payload"]


class _FunctionKilled(BaseException):
    """The Lambda runtime ending a function at its timeout: nothing after it runs, no handler catches it."""


def test_a_cancelled_drain_whose_finish_died_before_giving_its_hosts_back_gets_them_back_from_the_retry(
        store, bus, monkeypatch):
    # GIVEN a drain cancelled before any move, whose FinishDrain committed ``cancelled`` an hour
    # ago and was then killed while giving its hosts back, before it announced the end
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source"})
    assert drains.start(drain)["proceed"] is True
    drains.act(drain, "cancel")

    def killed(_drain_uuid):
        raise _FunctionKilled

    with monkeypatch.context() as patched:
        patched.setattr(drains, "give_back_targets", killed)
        with pytest.raises(_FunctionKilled):
            drains.finish(drain)
    hour_ago = drains.utcnow() - dt.timedelta(hours=1)
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == drain).values(finished_at=hour_ago, updated_at=hour_ago))
    assert drains.get_view(drain)["status"] == "cancelled"
    assert all(s.disabled for s in services.list_services(host="source"))
    assert [e["detail-type"] for e in bus()] == ["drain.start"]

    # WHEN Step Functions retries FinishDrain, and (its answer lost too) once more
    first = drains.finish(drain)
    again = drains.finish(drain)

    # THEN the retry gives the hosts back, and each run announces the same end: one message_id,
    # one body (giving the hosts back changed nothing the drain shows)
    assert first == again and first["status"] == "cancelled"
    assert not any(s.disabled for s in services.list_services(host="source"))
    ends = [e["detail"] for e in bus()]
    assert [end["event_type"] for end in ends] == ["drain.end", "drain.end"]
    assert ends[0]["message_id"] == ends[1]["message_id"]
    assert ends[0]["payload"] == ends[1]["payload"]
    assert ends[1]["payload"]["updated_at"] == ends[1]["payload"]["finished_at"] == drains._iso(hour_ago)


def test_a_final_event_lost_after_the_status_was_committed_is_announced_again_by_the_retry(
        store, bus, monkeypatch):
    # GIVEN a drain whose FinishDrain committed its final status, then failed before its
    # announcement went out (the function timed out while publishing, say)
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source", "callback_url": "https://ops.example.com/ferry"})
    posted: list[tuple[dict, str | None]] = []
    monkeypatch.setattr(drains.signing, "post_callback",
                        lambda _url, document, _secret, delivery_id=None, **_: posted.append((document, delivery_id)))
    drains.start(drain)

    def timed_out(*_args, **_kwargs):
        raise RuntimeError("Task timed out after 30.00 seconds")

    with monkeypatch.context() as patched:
        patched.setattr(drains.notifications, "notify_drain", timed_out)
        with pytest.raises(RuntimeError):
            drains.finish(drain)
    assert drains.get_view(drain)["status"] == "failed"
    assert [e["detail-type"] for e in bus()] == ["drain.start"]

    # WHEN Step Functions retries FinishDrain, and (its answer lost too) once more
    first = drains.finish(drain)
    again = drains.finish(drain)

    # THEN the final event goes out at each run, as the same event: one message_id, one delivery id
    assert first == again and first["status"] == "failed"
    events = bus()
    assert [e["detail-type"] for e in events] == ["drain.error", "drain.error"]
    assert events[0]["detail"]["message_id"] == events[1]["detail"]["message_id"]
    assert events[0]["detail"]["payload"]["status"] == "failed"
    assert [document["event_type"] for document, _delivery in posted] == ["drain.start", "drain.error", "drain.error"]
    assert posted[1][1] == posted[2][1] == events[0]["detail"]["message_id"]
    assert posted[0][1] != posted[1][1]


def test_a_callback_urls_query_is_shown_to_nobody_but_posted_to(store, bus, monkeypatch):
    # GIVEN a drain whose callback URL carries a token in its query
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    url = "https://ops.example.com:8443/ferry?token=s3cret"
    drain = _record({"host": "source", "callback_url": url})
    posted: list[str] = []
    monkeypatch.setattr(drains.signing, "post_callback",
                        lambda to, _document, _secret, delivery_id=None, **_: posted.append(to))

    # WHEN it starts and ends
    drains.start(drain)
    drains.finish(drain)

    # THEN the callbacks go to the URL as given, while the views and the notifications show it without its query
    assert posted == [url, url]
    shown = "https://ops.example.com:8443/ferry"
    assert drains.get_view(drain)["options"]["callback_url"] == shown
    assert [v["options"]["callback_url"] for v in drains.list_views()] == [shown]
    assert [e["detail"]["payload"]["options"]["callback_url"] for e in bus()] == [shown, shown]


@pytest.fixture
def move_machines(aws_test_credentials, monkeypatch):
    """Resize and confirm state machines on moto whose executions run until they are stopped (moto
    does not play them here), named in the configuration as the template names them for
    RecordFailure: ``(client, {"resize": arn, "confirm": arn, "revert": arn})``."""
    with mock_aws():
        aws.reset()
        sfn = aws.client("stepfunctions")
        arns = {}
        for kind, name, variable in (("resize", "resize", "FERRY_RESIZE_STATE_MACHINE_ARN"),
                                     ("confirm", "confirm-resize", "FERRY_CONFIRM_RESIZE_STATE_MACHINE_ARN"),
                                     ("revert", "revert-resize", "FERRY_REVERT_RESIZE_STATE_MACHINE_ARN")):
            arns[kind] = sfn.create_state_machine(
                name=f"ferry-test-{name}", roleArn="arn:aws:iam::123456789012:role/ferry-test",
                definition=json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Succeed"}}}))["stateMachineArn"]
            monkeypatch.setenv(variable, arns[kind])
        config.reset()
        yield sfn, arns
        aws.reset()
    config.reset()


def _prepared_move(**request) -> tuple[str, str, dict, dict]:
    """A drain of host ``source`` (one retry, and ``request``) whose one server's move was accepted,
    as PrepareMove leaves it: ``(drain, server, slot, move)``, the move being ``{"name", "input"}``
    of its execution."""
    source = add_compute("source")
    add_compute("dest")
    server = _server_on("source", source)
    drain = _record({"host": "source", "retries": 1, **request})
    drains.start(drain)
    slot = drains.acquire_slot(drain, server).to_dict()
    return drain, server, slot, drains.prepare_move(drain, server, slot)


def _move_records(server: str, migration_uuid: str, cell: str = "cell1") -> tuple[str | None, str]:
    with cell_session(cell) as session:
        task_state = session.scalars(select(Instance.task_state).where(Instance.uuid == server)).one()
        status = session.scalars(select(Migration.status).where(Migration.uuid == migration_uuid)).one()
    return task_state, status


def _moved_to_dest(server: str, migration_uuid: str, vm_state: str, migration: str) -> None:
    """The server's records as its move's workflows leave them on host ``dest``."""
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server)
                        .values(host="dest", node="dest", vm_state=vm_state, task_state=None))
        session.execute(update(Migration).where(Migration.uuid == migration_uuid).values(status=migration))


@pytest.mark.parametrize("step", ["RecordMoved", "RecordFailure"])
def test_a_drain_that_leaves_moves_unconfirmed_takes_one_its_owner_confirmed_already_as_moved(store, move_machines,
                                                                                               step):
    # GIVEN a drain that leaves its moves in VERIFY_RESIZE, whose server moved and whose owner
    # confirmed it before the drain recorded the move
    drain, server, slot, _move = _prepared_move(confirm=False)
    _moved_to_dest(server, slot["migration_uuid"], "active", "confirmed")

    # WHEN the drain records it (RecordMoved, or RecordFailure after RecordMoved's store was out of reach)
    if step == "RecordMoved":
        drain_steps.record_moved({"drain_uuid": drain, "instance_uuid": server, "slot": slot})
    else:
        outcome = drains.record_failure(drain, server, slot, {"Error": "Ferry.DatabaseUnavailable", "Cause": "x"})
        assert outcome["state"] == "done"

    # THEN it is moved, and the drain completes
    row = _servers(drain)[server]
    assert (row.state, row.dest_host) == ("done", "dest")
    assert drains.finish(drain)["status"] == "completed"


def test_a_drain_that_leaves_moves_unconfirmed_does_not_take_a_settled_server_whose_confirm_failed(store,
                                                                                                  move_machines):
    # RecordMoved judges as RecordFailure does: settled on dest, its migration in error, is not moved as asked
    drain, server, slot, _move = _prepared_move(confirm=False)
    _moved_to_dest(server, slot["migration_uuid"], "active", "error")

    with pytest.raises(errors.MoveNotPrepared):
        drain_steps.record_moved({"drain_uuid": drain, "instance_uuid": server, "slot": slot})


def test_a_failed_wait_for_a_move_whose_workflow_still_runs_undoes_nothing_until_it_has_ended(store, move_machines):
    # GIVEN a drained server whose move was accepted and whose resize execution runs, while the
    # RunMove step that waited for it failed (the nested-execution integration, not the move)
    sfn, arns = move_machines
    drain, server, slot, move = _prepared_move()
    execution = sfn.start_execution(stateMachineArn=arns["resize"], name=move["name"], input=json.dumps(move["input"]))
    assert sfn.describe_execution(executionArn=execution["executionArn"])["status"] == "RUNNING"
    error = {"Error": "States.Runtime", "Cause": "the nested execution could not be followed"}

    # WHEN RecordFailure runs: it refuses to record anything while that workflow runs
    with pytest.raises(errors.MoveStillRunning):
        drains.record_failure(drain, server, slot, error)

    # THEN the move is as it was accepted: still the workflow's to finish or roll back
    assert _move_records(server, slot["migration_uuid"]) == ("resize_prep", "pre-migrating")
    assert _servers(drain)[server].state == "moving"

    # WHEN the workflow has ended without leaving its first state (stopped), RecordFailure runs again
    sfn.stop_execution(executionArn=execution["executionArn"])
    outcome = drains.record_failure(drain, server, slot, error)

    # THEN the accepted move is undone and the server tried again
    assert _move_records(server, slot["migration_uuid"]) == (None, "error")
    assert outcome["retry"] is True and _servers(drain)[server].state == "pending"


def test_a_failed_move_whose_workflow_never_started_is_undone_and_tried_again(store, move_machines):
    drain, server, slot, _move = _prepared_move()

    outcome = drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "throttled"})

    assert _move_records(server, slot["migration_uuid"]) == (None, "error")
    assert outcome == {"retry": True, "confirm": False, "state": "pending", "error": "throttled"}


def test_a_failed_wait_for_a_move_that_finished_goes_on_to_confirm_it_once(store, move_machines):
    drain, server, slot, _move = _prepared_move()
    # the move's workflow ended with the server resized onto dest, but RunMove did not learn it
    _moved_to_dest(server, slot["migration_uuid"], "resized", "finished")
    lost = {"Error": "States.Runtime", "Cause": "lost track"}

    # WHEN RecordFailure runs for the failed RunMove: the drain confirms, so it goes on to the confirm
    outcome = drains.record_failure(drain, server, slot, lost)

    assert outcome == {"retry": False, "confirm": True, "state": "moving", "error": None}
    assert _servers(drain)[server].state == "moving"
    assert _move_records(server, slot["migration_uuid"]) == (None, "finished")

    # WHEN the confirm this attempt went on to failed too (it was undone, the move waits again)
    outcome = drains.record_failure(drain, server, slot, lost, confirm_slot=slot["request_id"])

    # THEN the server is failed, with the advice, rather than sent to confirm again
    assert outcome == {"retry": False, "confirm": False, "state": "failed",
                       "error": "lost track. The move itself finished on dest: confirm or revert it."}
    assert _servers(drain)[server].dest_host == "dest"
    assert _move_records(server, slot["migration_uuid"]) == (None, "finished")


def test_a_move_the_drain_lost_track_of_is_confirmed_and_recorded_done(store, move_machines):
    # GIVEN RunMove failed after the move finished, and RecordFailure sent the try to its confirm
    drain, server, slot, _move = _prepared_move()
    _moved_to_dest(server, slot["migration_uuid"], "resized", "finished")
    lost = {"Error": "States.Runtime", "Cause": "lost track"}
    assert drain_steps.record_failure({"drain_uuid": drain, "instance_uuid": server, "slot": slot, "error": lost,
                                       "confirm_slot": None})["confirm"] is True

    # WHEN the iteration goes on as after a RunMove that succeeded: PrepareConfirm, the confirm
    # workflow (done here by hand), RecordMoved
    confirm = drain_steps.prepare_confirm({"drain_uuid": drain, "instance_uuid": server, "slot": slot})
    assert _move_records(server, slot["migration_uuid"]) == (None, "confirming")
    assert confirm["input"]["request_id"] == f"{slot['request_id']}-confirm"
    _moved_to_dest(server, slot["migration_uuid"], "active", "confirmed")
    drain_steps.record_moved({"drain_uuid": drain, "instance_uuid": server, "slot": slot})

    # THEN the server is done on dest, with no error left from the lost step
    row = _servers(drain)[server]
    assert (row.state, row.dest_host, row.error) == ("done", "dest", None)


@pytest.mark.parametrize("other_move", [None, "into the host", "resized out of the host"])
def test_a_drain_completes_only_when_its_host_holds_nothing_else(store, move_machines, other_move):
    # GIVEN a drain of host source whose one server moved and was confirmed; and, begun before the
    # drain, another server's move into source (finished: VERIFY_RESIZE there), or a resize of a
    # server from source awaiting its confirm on dest (a revert would bring it back)
    drain, server, slot, _move = _prepared_move()
    _moved_to_dest(server, slot["migration_uuid"], "active", "confirmed")
    drain_steps.record_moved({"drain_uuid": drain, "instance_uuid": server, "slot": slot})
    other = None
    if other_move is not None:
        into = other_move == "into the host"
        other = add_instance("source" if into else "dest")
        with cell_session("cell1") as session:
            session.execute(update(Instance).where(Instance.uuid == other).values(vm_state="resized"))
            session.add(Migration(uuid=str(uuid.uuid4()), instance_uuid=other, status="finished",
                                  migration_type="migration", source_compute="dest" if into else "source",
                                  dest_compute="source" if into else "dest"))

    # WHEN the drain finishes
    report = drains.finish(drain)

    # THEN it is completed only when source holds nothing and has no resize that could come back;
    # otherwise it failed, naming the servers
    if other is None:
        assert report["status"] == "completed", report
    else:
        assert report["status"] == "failed" and other in report["message"], report
        assert report["message"].startswith("All 1 servers moved, but source still holds 1 server(s)")


def test_a_drain_whose_host_only_waits_for_another_servers_confirm_fails_and_keeps_the_host_disabled(store):
    # GIVEN host source holds no server, but a resize of one off it awaits its confirm (a revert
    # would bring it back)
    add_compute("source")
    add_compute("dest")
    other = add_instance("dest")
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == other).values(vm_state="resized"))
        session.add(Migration(uuid=str(uuid.uuid4()), instance_uuid=other, status="finished",
                              migration_type="resize", source_compute="source", dest_compute="dest"))
    drain = _record({"host": "source"})

    # WHEN the drain plans nothing to move and finishes
    assert drains.start(drain)["proceed"] is False
    report = drains.finish(drain)

    # THEN it failed, naming that server, and source stays disabled: it is not empty yet
    assert report["status"] == "failed" and other in report["message"]
    assert all(s.disabled for s in services.list_services(host="source"))


@pytest.mark.parametrize("leftover", ["deleted server", "server reset to active", "move no longer running"])
def test_a_migration_record_no_live_server_shows_does_not_fail_a_drain(store, move_machines, leftover):
    # GIVEN a drain of source whose one server moved; and a migration touching source that no live
    # server shows any more: its server deleted, or reset by an admin, or its move's task gone
    drain, server, slot, _move = _prepared_move()
    _moved_to_dest(server, slot["migration_uuid"], "active", "confirmed")
    drain_steps.record_moved({"drain_uuid": drain, "instance_uuid": server, "slot": slot})
    other = add_instance("dest")
    status = "migrating" if leftover == "move no longer running" else "finished"
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == other).values(
            vm_state="resized" if leftover == "deleted server" else "active",
            deleted=leftover == "deleted server"))
        session.add(Migration(uuid=str(uuid.uuid4()), instance_uuid=other, status=status,
                              migration_type="migration", source_compute="source", dest_compute="dest"))

    # THEN the drain completes
    assert drains.finish(drain)["status"] == "completed"


def test_an_execution_started_before_confirms_were_marked_never_goes_on_to_a_confirm(store, move_machines):
    # GIVEN a drain execution of the state machine before MarkConfirm: its RecordFailure event
    # has no confirm_slot, and its RetryChoice would settle a server sent to its confirm
    drain, server, slot, _move = _prepared_move()
    _moved_to_dest(server, slot["migration_uuid"], "resized", "finished")

    outcome = drain_steps.record_failure({"drain_uuid": drain, "instance_uuid": server, "slot": slot,
                                          "error": {"Error": "States.Runtime", "Cause": "lost track"}})

    # THEN the server is failed with the advice, as before, not left moving
    assert (outcome["confirm"], outcome["state"]) == (False, "failed")
    assert _servers(drain)[server].state == "failed"


def test_a_failed_wait_for_a_move_still_under_way_waits_for_it_and_never_undoes_it(store, move_machines):
    # GIVEN a move past its first state (migrating) whose resize execution runs, RunMove failed
    sfn, arns = move_machines
    drain, server, slot, move = _prepared_move()
    execution = sfn.start_execution(stateMachineArn=arns["resize"], name=move["name"], input=json.dumps(move["input"]))
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server).values(task_state="resize_migrating"))
        session.execute(update(Migration).where(Migration.uuid == slot["migration_uuid"]).values(status="migrating"))
    error = {"Error": "States.Runtime", "Cause": "lost track"}

    with pytest.raises(errors.MoveStillRunning):
        drains.record_failure(drain, server, slot, error)
    assert _servers(drain)[server].state == "moving"

    # WHEN that execution has ended leaving the move where it was (stopped by hand, say)
    sfn.stop_execution(executionArn=execution["executionArn"])
    outcome = drains.record_failure(drain, server, slot, error)

    # THEN the server is failed and the move left as it is, for an operator: never undone here
    assert outcome == {"retry": False, "confirm": False, "state": "failed", "error": "lost track"}
    assert _move_records(server, slot["migration_uuid"]) == ("resize_migrating", "migrating")


def _confirm_prepared(drain: str, server: str, slot: dict) -> dict:
    """The server moved to dest and the drain's confirm accepted, as PrepareConfirm leaves it."""
    _moved_to_dest(server, slot["migration_uuid"], "resized", "finished")
    return drains.prepare_confirm(drain, server, slot)


def _accepted_long_ago(server: str, request_id: str) -> None:
    with cell_session(instances.cell_of(server).name) as session:
        session.execute(update(InstanceAction).where(InstanceAction.instance_uuid == server,
                                                     InstanceAction.request_id == request_id)
                        .values(start_time=dt.datetime(2020, 1, 1)))


def _confirm_action_recorded(server: str, request_id: str) -> bool:
    with cell_session(instances.cell_of(server).name) as session:
        return actions.find(session, server, request_id) is not None


def test_a_failed_wait_for_the_drains_confirm_waits_for_it_and_records_the_server_done_once_confirmed(
        store, move_machines):
    # GIVEN a drained server moved to dest whose confirm the drain started, while the RunConfirm
    # step that waited for the confirm execution failed and that execution still runs
    sfn, arns = move_machines
    drain, server, slot, _move = _prepared_move()
    confirm = _confirm_prepared(drain, server, slot)
    execution = sfn.start_execution(stateMachineArn=arns["confirm"], name=confirm["name"],
                                    input=json.dumps(confirm["input"]))
    error = {"Error": "States.Runtime", "Cause": "the nested execution could not be followed"}

    # WHEN RecordFailure runs: it records and undoes nothing while the confirm runs
    with pytest.raises(errors.MoveStillRunning):
        drains.record_failure(drain, server, slot, error, confirm_slot=slot["request_id"])
    assert _servers(drain)[server].state == "moving"
    assert _move_records(server, slot["migration_uuid"]) == (None, "confirming")

    # WHEN the confirm has ended, having confirmed the move, and RecordFailure runs again
    _moved_to_dest(server, slot["migration_uuid"], "active", "confirmed")
    sfn.stop_execution(executionArn=execution["executionArn"])
    outcome = drains.record_failure(drain, server, slot, error, confirm_slot=slot["request_id"])

    # THEN the server is recorded done on dest, as RecordMoved would have
    assert outcome == {"retry": False, "confirm": False, "state": "done", "error": None}
    row = _servers(drain)[server]
    assert (row.state, row.dest_host, row.error) == ("done", "dest", None)
    assert row.finished_at is not None


def test_a_drains_confirm_whose_workflow_never_started_is_undone_and_the_server_waits_in_verify_resize(
        store, move_machines):
    # GIVEN the drain accepted the confirm, but RunConfirm could not start its execution
    drain, server, slot, _move = _prepared_move()
    confirm = _confirm_prepared(drain, server, slot)
    request_id = confirm["input"]["request_id"]
    assert _move_records(server, slot["migration_uuid"]) == (None, "confirming")
    assert _confirm_action_recorded(server, request_id)

    error = {"Error": "StepFunctions.SdkClientException", "Cause": "throttled"}

    # WHEN RecordFailure runs at once: Step Functions may not show a just-started execution yet
    with pytest.raises(errors.MoveStillRunning):
        drains.record_failure(drain, server, slot, error, confirm_slot=slot["request_id"])
    assert _move_records(server, slot["migration_uuid"]) == (None, "confirming")

    # WHEN it runs again once the grace has passed
    _accepted_long_ago(server, request_id)
    outcome = drains.record_failure(drain, server, slot, error, confirm_slot=slot["request_id"])

    # THEN the confirm is undone: the server can be confirmed or reverted again, as advised
    assert _move_records(server, slot["migration_uuid"]) == (None, "finished")
    assert not _confirm_action_recorded(server, request_id)
    assert outcome == {"retry": False, "confirm": False, "state": "failed",
                       "error": "throttled. The move itself finished on dest: confirm or revert it."}


def test_a_drains_confirm_whose_workflow_ended_half_way_is_left_as_it_is(store, move_machines):
    # GIVEN the drain's confirm execution ran and ended (stopped) leaving the migration confirming
    sfn, arns = move_machines
    drain, server, slot, _move = _prepared_move()
    confirm = _confirm_prepared(drain, server, slot)
    execution = sfn.start_execution(stateMachineArn=arns["confirm"], name=confirm["name"],
                                    input=json.dumps(confirm["input"]))
    sfn.stop_execution(executionArn=execution["executionArn"])

    outcome = drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "lost track"},
                                    confirm_slot=slot["request_id"])

    # THEN nothing is undone (the confirm may have cleaned up the source): no advice either
    assert _move_records(server, slot["migration_uuid"]) == (None, "confirming")
    assert outcome == {"retry": False, "confirm": False, "state": "failed", "error": "lost track"}


def test_another_requests_confirm_is_waited_for_and_not_taken_over(store, move_machines):
    # GIVEN the moved server's owner confirmed it (the name taken by an earlier attempt, so its
    # execution has a suffixed name) while the drain was about to
    sfn, arns = move_machines
    drain, server, slot, _move = _prepared_move()
    _moved_to_dest(server, slot["migration_uuid"], "resized", "finished")
    base = moves.move_execution_name("confirm", server, slot["migration_uuid"])
    sfn.start_execution(stateMachineArn=arns["confirm"], name=base, input=json.dumps({"request_id": "req-earlier"}))
    sfn.stop_execution(executionArn=f"{arns['confirm'].replace(':stateMachine:', ':execution:')}:{base}")
    owner = moves.prepare_confirm("cell1", server, slot["migration_uuid"], request_id="req-owner",
                                  user_id=USER, project_id=PROJECT)
    assert owner.name != base
    sfn.start_execution(stateMachineArn=arns["confirm"], name=owner.name, input=json.dumps(owner.input))

    # WHEN the drain's PrepareConfirm runs: the confirm is another request's
    with pytest.raises(errors.MigrationInProgress):
        drains.prepare_confirm(drain, server, slot)

    # THEN RecordFailure waits for that confirm while it runs, and never undoes it
    with pytest.raises(errors.MoveStillRunning):
        drains.record_failure(drain, server, slot, {"Error": "Ferry.MigrationInProgress", "Cause": "taken"},
                              confirm_slot=slot["request_id"])
    assert _move_records(server, slot["migration_uuid"]) == (None, "confirming")
    assert _confirm_action_recorded(server, "req-owner")


@pytest.mark.parametrize(("confirm", "vm_state", "migration"), [
    (True, "active", "confirmed"),  # RecordMoved ran out of retries after the confirm
    (True, "stopped", "confirmed"),
    (False, "resized", "finished"),  # RunMove lost the result of a move the drain keeps in VERIFY_RESIZE
])
def test_a_failed_step_after_the_move_completed_as_asked_records_the_server_done(
        store, move_machines, confirm, vm_state, migration):
    drain, server, slot, _move = _prepared_move(confirm=confirm)
    _moved_to_dest(server, slot["migration_uuid"], vm_state, migration)

    outcome = drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "lost track"})

    assert outcome == {"retry": False, "confirm": False, "state": "done", "error": None}
    assert _servers(drain)[server].dest_host == "dest"


@pytest.mark.parametrize(("confirm", "vm_state", "migration"), [
    (True, "active", "error"),  # the confirm failed late: not confirmed
    (False, "active", "error"),  # its owner's confirm failed late: neither waiting nor confirmed
    (True, "resized", "confirmed"),
])
def test_a_failed_step_records_the_server_failed_when_its_move_is_not_as_the_drain_asked(
        store, move_machines, confirm, vm_state, migration):
    drain, server, slot, _move = _prepared_move(confirm=confirm)
    _moved_to_dest(server, slot["migration_uuid"], vm_state, migration)

    outcome = drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "lost track"})

    assert outcome == {"retry": False, "confirm": False, "state": "failed", "error": "lost track"}
    assert _servers(drain)[server].dest_host == "dest"


def test_a_confirm_without_the_action_that_took_it_is_never_undone(store, move_machines):
    drain, server, slot, _move = _prepared_move()
    _moved_to_dest(server, slot["migration_uuid"], "resized", "confirming")  # no confirmResize action

    outcome = drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "lost track"})

    assert _move_records(server, slot["migration_uuid"]) == (None, "confirming")
    assert outcome == {"retry": False, "confirm": False, "state": "failed", "error": "lost track"}


def test_a_revert_under_way_is_waited_for(store, move_machines):
    # GIVEN the owner reverted the moved server before the drain could confirm it
    drain, server, slot, _move = _prepared_move()
    _moved_to_dest(server, slot["migration_uuid"], "resized", "finished")
    moves.begin_revert("cell1", server, request_id="req-revert", user_id=USER, project_id=PROJECT)
    assert _move_records(server, slot["migration_uuid"]) == ("resize_reverting", "reverting")
    with pytest.raises(errors.InstanceInvalidState):
        drains.prepare_confirm(drain, server, slot)

    # THEN RecordFailure waits while the revert's workflow (started by begin_revert) runs
    with pytest.raises(errors.MoveStillRunning):
        drains.record_failure(drain, server, slot, {"Error": "Ferry.InstanceInvalidState", "Cause": "reverting"},
                              confirm_slot=slot["request_id"])
    assert _servers(drain)[server].state == "moving"


def test_a_failed_move_still_under_way_keeps_its_action(store, move_machines):
    drain, server, slot, _move = _prepared_move()
    with cell_session("cell1") as session:
        session.execute(update(Migration).where(Migration.uuid == slot["migration_uuid"]).values(status="migrating"))

    drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "lost track"})

    assert _move_records(server, slot["migration_uuid"]) == ("resize_prep", "migrating")
    assert _confirm_action_recorded(server, slot["request_id"])


def _switch_to_cell2(server: str, migration_uuid: str) -> None:
    """What a cross-cell move leaves once it has switched: the server resized on dest in cell2,
    its copy in cell1 hidden, the migration finished (a move between cells) in both, the mapping
    on cell2."""
    _moved_to_dest(server, migration_uuid, "resized", "finished")
    with cell_session("cell1") as session:
        session.execute(update(Migration).where(Migration.uuid == migration_uuid).values(cross_cell_move=True))
    copies = []
    with cell_session("cell1") as session:
        for model, column in ((Instance, Instance.uuid), (Migration, Migration.instance_uuid)):
            row = session.scalars(select(model).where(column == server)).one()
            copies.append(model(**{a.key: getattr(row, a.key) for a in model.__mapper__.column_attrs if a.key != "id"}))
        session.execute(update(Instance).where(Instance.uuid == server).values(hidden=True))
    with cell_session("cell2") as session:
        session.add_all(copies)
    with api_session() as session:
        cell2 = session.scalars(select(CellMapping.id).where(CellMapping.name == "cell2")).one()
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server).values(cell_id=cell2))


@pytest.mark.parametrize("started", [True, False])
def test_after_a_cross_cell_move_the_drains_confirm_is_waited_for_or_undone_in_the_new_cell(
        store, move_machines, started):
    sfn, arns = move_machines
    drain, server, slot, _move = _prepared_move()
    _switch_to_cell2(server, slot["migration_uuid"])
    confirm = drains.prepare_confirm(drain, server, slot)
    assert confirm["input"]["cell"] == "cell2"
    error = {"Error": "States.Runtime", "Cause": "lost track"}

    if started:  # the confirm runs: RecordFailure waits
        sfn.start_execution(stateMachineArn=arns["confirm"], name=confirm["name"], input=json.dumps(confirm["input"]))
        with pytest.raises(errors.MoveStillRunning):
            drains.record_failure(drain, server, slot, error, confirm_slot=slot["request_id"])
        return
    # it never started: undone in cell2, where the server now is
    _accepted_long_ago(server, confirm["input"]["request_id"])
    outcome = drains.record_failure(drain, server, slot, error, confirm_slot=slot["request_id"])
    assert outcome["state"] == "failed" and outcome["error"].endswith("confirm or revert it.")
    with cell_session("cell2") as session:
        assert session.scalars(select(Migration.status).where(Migration.uuid == slot["migration_uuid"])).one() \
            == "finished"
    assert not _confirm_action_recorded(server, confirm["input"]["request_id"])


# --- drains whose workflow is gone, and drains cancelled early --------------------------------------


@pytest.fixture
def drain_machine(aws_test_credentials, monkeypatch):
    """A drain state machine on moto whose executions run until they are stopped (moto does not
    play them here), named in the configuration: ``(client, arn)``."""
    with mock_aws():
        aws.reset()
        sfn = aws.client("stepfunctions")
        arn = sfn.create_state_machine(
            name="ferry-test-drain", roleArn="arn:aws:iam::123456789012:role/ferry-test",
            definition=json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Succeed"}}}))["stateMachineArn"]
        monkeypatch.setenv("FERRY_DRAIN_STATE_MACHINE_ARN", arn)
        config.reset()
        yield sfn, arn
        aws.reset()
    config.reset()


def _running_drain(sfn, arn: str, host: str, **request) -> tuple[str, str]:
    """A drain of ``host`` (``request`` added) as the API leaves it: recorded, its execution started,
    planned and running."""
    drain = _record({"host": host, **request})
    name = f"drain-{drain}"
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == drain).values(execution_name=name))
    execution = sfn.start_execution(stateMachineArn=arn, name=name, input=json.dumps({"drain_uuid": drain}))
    drains.start(drain)
    return drain, execution["executionArn"]


def test_a_drain_whose_workflow_ended_without_finishing_it_is_finished_failed_and_frees_its_hosts(
        store, drain_machine):
    sfn, arn = drain_machine
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    first, execution = _running_drain(sfn, arn, "source")
    with pytest.raises(errors.DrainInvalidState):  # its workflow runs: the host is its
        drains.record_drain(ADMIN, {"host": "source"}, origin="api")

    sfn.stop_execution(executionArn=execution)  # stopped by hand, before FinishDrain

    with pytest.raises(errors.DrainInvalidState, match="while it is failed"):
        drains.act(first, "pause")
    view = drains.get_view(first)
    assert view["status"] == "failed" and f"drain-{first} ended aborted" in view["message"]
    assert view["servers"][0]["state"] == "cancelled"
    second = _record({"host": "source"})
    assert drains.get_view(second)["status"] == "planning"


def test_a_new_drain_finishes_an_overlapping_one_whose_workflow_ended(store, drain_machine):
    sfn, arn = drain_machine
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    first, execution = _running_drain(sfn, arn, "source")
    sfn.stop_execution(executionArn=execution)

    second = _record({"host": "source"})

    assert drains.get_view(first)["status"] == "failed"
    assert second != first


def test_a_drain_whose_execution_never_showed_up_holds_its_hosts_only_for_a_while(store, drain_machine):
    add_compute("source")
    drain = _record({"host": "source"})  # named drain-<id>, and no such execution was started
    with pytest.raises(errors.DrainInvalidState):  # it may still show up
        drains.record_drain(ADMIN, {"host": "source"}, origin="api")

    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == drain).values(
            created_at=drains.utcnow() - drains.UNSTARTED_GRACE - dt.timedelta(seconds=1)))
    _record({"host": "source"})

    view = drains.get_view(drain)
    assert view["status"] == "failed" and "never started" in view["message"]


def test_a_drain_cancelled_while_it_plans_disables_nothing(store):
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source"})
    drains.act(drain, "cancel")

    started = drains.start(drain)

    assert started["proceed"] is False
    assert not any(s.disabled for s in services.list_services(host="source"))
    assert drains.finish(drain)["status"] == "cancelled"


def test_a_drain_cancelled_after_it_disabled_its_hosts_gives_them_back(store):
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source"})
    drains.disable_targets(drain)  # PlanDrain had begun when the cancel came
    drains.act(drain, "cancel")

    assert drains.start(drain)["proceed"] is False

    assert not any(s.disabled for s in services.list_services(host="source"))


def test_a_drain_whose_plan_failed_gives_its_hosts_back(store):
    # GIVEN a drain that disabled its host, whose PlanDrain then failed for good
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source"})
    drains.disable_targets(drain)

    # WHEN FinishDrain runs with the error (twice: a retry)
    report = drains.finish(drain, error={"Error": "OperationalError", "Cause": "database unreachable"})
    drains.finish(drain, error={"Error": "OperationalError", "Cause": "database unreachable"})

    # THEN the drain failed having moved nothing, and its host takes builds again
    assert report["status"] == "failed"
    assert not any(s.disabled for s in services.list_services(host="source"))


def test_a_drain_whose_workflow_failed_gives_its_hosts_back_at_a_later_look_without_the_error(store, monkeypatch):
    # GIVEN a drain whose PlanDrain failed, finished as failed by FinishDrain, which then died
    # before it gave the host back (its retries too)
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source"})
    drains.disable_targets(drain)

    def died(_drain_uuid):
        raise RuntimeError("Task timed out after 60.00 seconds")

    with monkeypatch.context() as patched:
        patched.setattr(drains, "give_back_targets", died)
        drains.finish(drain, error={"Error": "OperationalError", "Cause": "database unreachable"})
    assert all(s.disabled for s in services.list_services(host="source"))

    # WHEN the drain is finished again by a later look, which knows no step's error
    drains.finish(drain)

    # THEN the record says its workflow failed before any move: its host is given back
    assert not any(s.disabled for s in services.list_services(host="source"))


def test_a_drain_that_failed_after_trying_a_move_keeps_its_hosts_disabled(store):
    source = add_compute("source")
    add_compute("dest")
    server = _server_on("source", source)
    drain = _record({"host": "source"})
    assert drains.start(drain)["proceed"] is True
    assert drains.acquire_slot(drain, server).action == "move"

    drains.finish(drain, error={"Error": "States.Runtime", "Cause": "the Map failed"})

    assert all(s.disabled for s in services.list_services(host="source"))


def test_a_drain_that_ended_before_it_gave_its_host_back_never_enables_it_under_a_newer_drain(store):
    # GIVEN drain A disabled host source and was cancelled, its FinishDrain dying before it gave
    # the host back; then drain B of source was accepted (A being final)
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    first = _record({"host": "source"})
    drains.disable_targets(first)
    drains.act(first, "cancel")
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == first).values(status="cancelled"))
    second = _record({"host": "source", "reason": "again"})

    # WHEN B disables its targets, and A's FinishDrain retry then gives A's hosts back
    drains.disable_targets(second)
    assert drains.give_back_targets(first) == []

    # THEN source stays disabled, for B
    [service] = services.list_services(host="source")
    assert service.disabled and service.disabled_reason == f"drain {second}: again"


def test_a_host_an_ended_drain_still_owed_back_is_given_back_by_the_drain_that_took_it_over(store):
    # GIVEN drain A disabled host source and was cancelled, its FinishDrain dying before it gave
    # the host back; drain B of source took the service over
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    first = _record({"host": "source"})
    drains.disable_targets(first)
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == first).values(status="cancelled"))
    second = _record({"host": "source"})
    assert drains.disable_targets(second) == ["source"]

    # WHEN B fails before any move (its plan could not be made)
    drains.finish(second, error={"Error": "OperationalError", "Cause": "database unreachable"})

    # THEN source is given back: neither drain leaves it disabled
    assert not any(s.disabled for s in services.list_services(host="source"))
    assert drains.give_back_targets(first) == []


def test_a_host_an_ended_drain_kept_disabled_is_not_given_back_by_the_drain_that_took_it_over(store):
    # GIVEN drain A tried a move off source and failed (it keeps source disabled); drain B of source
    # took the service over
    source = add_compute("source")
    add_compute("dest")
    server = _server_on("source", source)
    first = _record({"host": "source"})
    assert drains.start(first)["proceed"] is True
    assert drains.acquire_slot(first, server).action == "move"
    drains.finish(first, error={"Error": "States.Runtime", "Cause": "the Map failed"})
    second = _record({"host": "source"})
    assert drains.disable_targets(second) == []

    # WHEN B fails before any move, THEN source stays disabled (now in B's name)
    drains.finish(second, error={"Error": "OperationalError", "Cause": "database unreachable"})
    [service] = services.list_services(host="source")
    assert service.disabled and service.disabled_reason == f"drain {second}"


def test_a_service_disabled_by_hand_or_by_a_running_drain_is_not_taken_over(store):
    add_compute("source")
    [service] = services.list_services(host="source")
    services.update_service(service, disabled=True, disabled_reason="drain maintenance by hand")
    drain = _record({"host": "source"})

    assert drains.disable_targets(drain) == []

    [service] = services.list_services(host="source")
    assert service.disabled_reason == "drain maintenance by hand"


def test_a_drain_of_more_servers_than_its_workflow_state_holds_is_refused(store, monkeypatch):
    # GIVEN a drain moves at most two servers (5,000 in a deployment), and host source holds three
    monkeypatch.setattr(drains, "MAX_SERVERS", 2)
    source = add_compute("source", memory_mb=16384)
    add_compute("dest", memory_mb=16384)
    accepted = _record({"host": "source"})  # while it held fewer
    for _ in range(3):
        _server_on("source", source)

    # WHEN a drain of source is asked for, THEN it is refused, and nothing recorded or disabled
    with pytest.raises(errors.DrainTooLarge, match="source hold 3 servers, and a drain moves at most 2"):
        drains.record_drain(ADMIN, {"host": "source", "dry_run": True}, origin="api")
    # and a drain accepted before they came fails at its plan, before anything is written
    with pytest.raises(errors.DrainTooLarge):
        drains.plan(accepted)
    assert _servers(accepted) == {}
    assert errors.DrainTooLarge("x").http_status == 400


def test_a_second_execution_of_a_drain_is_refused(store):
    add_compute("source")
    drain = _record({"host": "source"}, execution_name="drain-first")

    assert drains.begin({"drain_uuid": drain}, "drain-first")["drain_uuid"] == drain
    with pytest.raises(errors.DrainInvalidState, match="run by execution drain-first"):
        drains.begin({"drain_uuid": drain}, "drain-again")


def _created_without_its_workflow(monkeypatch, **create) -> dict:
    """A drain of host ``source`` whose creation (``create`` its arguments) had its workflow's start
    refused; its view, failed."""
    add_compute("source")

    def refused(*_args, **_kwargs):
        raise RuntimeError("throttled")

    with monkeypatch.context() as patched:
        patched.setattr(drains.workflows, "start_execution", refused)
        with pytest.raises(RuntimeError):
            drains.create_drain(ADMIN, {"host": "source"}, **create)
    [failed] = drains.list_views()
    assert failed["status"] == "failed"
    return failed


def test_a_drain_whose_workflow_did_not_start_gives_up_its_key(store, drain_machine, monkeypatch):
    failed = _created_without_its_workflow(monkeypatch, origin="webhook", idempotency_key="delivery-1")

    status, body = drains.create_drain(ADMIN, {"host": "source"}, origin="webhook", idempotency_key="delivery-1")

    assert status == 202 and body["drain"]["id"] != failed["id"]


def test_a_drain_whose_start_answered_an_error_but_runs_is_not_marked_failed(store, drain_machine, monkeypatch):
    sfn, arn = drain_machine
    add_compute("source")
    real_start = drains.workflows.start_execution

    def lost_answer(machine, name, payload):
        real_start(machine, name, payload)
        raise RuntimeError("read timeout")

    monkeypatch.setattr(drains.workflows, "start_execution", lost_answer)

    status, body = drains.create_drain(ADMIN, {"host": "source"}, origin="api")

    assert status == 202 and body["drain"]["status"] == "planning"


def test_a_drain_that_ended_before_moving_everything_counts_the_servers_not_moved(store):
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    _server_on("source", source)
    drain = _record({"host": "source"})
    drains.start(drain)

    report = drains.finish(drain)  # the Map ended with both servers still pending

    assert report["status"] == "failed"
    assert report["message"] == "0 of 2 servers moved; 0 failed, 0 could not be placed, 2 not moved."


def test_a_cell_drain_beside_a_host_drain_is_refused_for_that_cell_at_once(store, monkeypatch):
    monkeypatch.setattr(drains.policy, "check", lambda *_args, **_kwargs: True)  # cross-cell moves allowed
    add_compute("source")
    add_compute("elsewhere", cell="cell2")
    _record({"host": "source"})

    with pytest.raises(errors.DrainInvalidState, match="is draining source"):
        drains.record_drain(ADMIN, {"cell": "cell1"}, origin="api")
    assert drains.get_view(_record({"cell": "cell2"}))["status"] == "planning"


def test_a_drain_is_recorded_with_the_name_of_its_execution(store):
    add_compute("source")

    drain = _record({"host": "source"})

    with api_session() as session:
        name = session.scalars(select(Drain.execution_name).where(Drain.uuid == drain)).one()
    assert name == f"drain-{drain}"


def test_a_delivery_retried_after_its_first_attempt_died_before_the_start_starts_the_drain(store, drain_machine):
    sfn, arn = drain_machine
    add_compute("source")
    drain, created = drains.record_drain(ADMIN, {"host": "source"}, origin="webhook", idempotency_key="delivery-2")
    assert created  # ... and the function died here, before it started the workflow

    status, body = drains.create_drain(ADMIN, {"host": "source"}, origin="webhook", idempotency_key="delivery-2")

    assert status == 200 and body["drain"]["id"] == drain
    assert sfn.describe_execution(executionArn=f"{arn.replace(':stateMachine:', ':execution:')}:drain-{drain}")


def test_a_start_step_functions_cannot_account_for_leaves_the_drain_planning_with_its_key(
        store, drain_machine, monkeypatch):
    add_compute("source")

    def refused(*_args, **_kwargs):
        raise RuntimeError("throttled")

    monkeypatch.setattr(drains.workflows, "start_execution", refused)
    monkeypatch.setattr(drains.workflows, "describe_execution", refused)
    with pytest.raises(RuntimeError):
        drains.create_drain(ADMIN, {"host": "source"}, origin="webhook", idempotency_key="delivery-3")

    [view] = drains.list_views()
    assert view["status"] == "planning"
    with api_session() as session:
        assert session.scalars(select(Drain.idempotency_key).where(Drain.uuid == view["id"])).one() == "delivery-3"


def test_a_drain_cancelled_once_running_but_before_any_move_gives_its_hosts_back(store):
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source"})
    assert drains.start(drain)["proceed"] is True
    drains.act(drain, "cancel")

    assert drains.finish(drain)["status"] == "cancelled"

    assert not any(s.disabled for s in services.list_services(host="source"))


def test_a_server_tried_again_is_planned_again_before_the_per_host_limit_counts_it(store, move_machines):
    source = add_compute("source", memory_mb=16384)
    for host in ("d1", "d2"):
        add_compute(host, memory_mb=3072)  # room for one server each
    first, second = _server_on("source", source), _server_on("source", source)
    drain = _record({"host": "source", "retries": 1, "max_per_dest_host": 1})
    drains.start(drain)
    planned = {uuid: row.planned_host for uuid, row in _servers(drain).items()}
    assert set(planned.values()) == {"d1", "d2"}
    slot = drains.acquire_slot(drain, first).to_dict()
    drains.prepare_move(drain, first, slot)
    assert drains.acquire_slot(drain, second).action == "move"
    # the first's attempt fails before its workflow started, and its host is disabled meanwhile
    assert drains.record_failure(drain, first, slot, {"Error": "States.Runtime", "Cause": "throttled"})["retry"]
    [service] = services.list_services(host=planned[first])
    services.update_service(service, disabled=True)

    # planned again onto the second's host, where the one move allowed is under way: it waits,
    # to be planned afresh at its next look
    assert drains.acquire_slot(drain, first).action == "wait"
    assert _servers(drain)[first].planned_host is None
    with api_session() as session:  # the second's move ended
        session.execute(update(DrainServer).where(DrainServer.instance_uuid == second).values(state="done"))
    assert drains.acquire_slot(drain, first).action == "move"
    assert _servers(drain)[first].planned_host == planned[second]


@pytest.mark.parametrize("retries", [1, 2])
def test_a_server_no_host_takes_for_another_try_waits_while_tries_are_left_then_fails(store, move_machines,
                                                                                       retries):
    drain, server, slot, _move = _prepared_move(retries=retries)
    assert drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "throttled"})["retry"]
    [service] = services.list_services(host="dest")
    services.update_service(service, disabled=True)

    if retries == 2:  # the plan uses up a try, and one is left: it waits for the next look
        assert drains.acquire_slot(drain, server).action == "wait"
        assert (_servers(drain)[server].state, _servers(drain)[server].attempts) == ("pending", 2)
    assert drains.acquire_slot(drain, server).action == "stop"  # the plan uses up the last try

    row = _servers(drain)[server]
    assert row.state == "failed" and row.error.startswith("No host takes it for another try")
    assert row.attempts == retries + 1  # every try, the moves and the looks that found no host


@pytest.mark.parametrize("retries", [1, 2])
def test_a_plan_that_found_no_host_counts_as_a_try_when_a_host_comes_back(store, move_machines, retries):
    # GIVEN a server whose move failed, and whose next look found no host
    drain, server, slot, _move = _prepared_move(retries=retries)
    assert drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "throttled"})["retry"]
    [service] = services.list_services(host="dest")
    services.update_service(service, disabled=True)
    drains.acquire_slot(drain, server)

    # WHEN a host takes servers again
    services.update_service(service, disabled=False)
    again = drains.acquire_slot(drain, server)

    # THEN it is moved only while a try is left: never more than retries + 1 tries in all
    if retries == 1:
        assert again.action == "stop" and _servers(drain)[server].state == "failed"
    else:
        assert (again.action, again.attempt) == ("move", 3)
    assert _servers(drain)[server].attempts <= retries + 1


# --- a drain that ended keeps its records as announced ---------------------------------------------


def _stopped_with_a_move_accepted(sfn, arn: str) -> tuple[str, str, dict]:
    """A drain of host ``source`` whose one server's move PrepareMove accepted, after which the
    drain's workflow was stopped (its server's iteration goes on): ``(drain, server, slot)``."""
    source = add_compute("source")
    add_compute("dest")
    server = _server_on("source", source)
    drain, execution = _running_drain(sfn, arn, "source")
    slot = drains.acquire_slot(drain, server).to_dict()
    drains.prepare_move(drain, server, slot)
    sfn.stop_execution(executionArn=execution)
    return drain, server, slot


def _warned_late(caplog, drain: str, server: str | None, step: str) -> bool:
    return any(record.levelname == "WARNING" and getattr(record, "drain", None) == drain
               and getattr(record, "instance_uuid", None) == server and getattr(record, "step", None) == step
               for record in caplog.records)


def test_a_move_that_completes_after_its_drain_ended_changes_nothing_in_the_drain(store, drain_machine, caplog):
    # GIVEN a drain finished as failed while one server's move was under way
    drain, server, slot = _stopped_with_a_move_accepted(*drain_machine)
    assert drains.finish_if_workflow_ended(drain)
    announced = drains.get_view(drain)
    assert announced["status"] == "failed" and announced["servers"][0]["state"] == "failed"

    # WHEN the move completes and its iteration records it, then settles and looks for a slot
    _moved_to_dest(server, slot["migration_uuid"], "active", "confirmed")
    recorded = drain_steps.record_moved({"drain_uuid": drain, "instance_uuid": server, "slot": slot})
    settled = drains.settle_server(drain, server, {"Error": "States.Runtime", "Cause": "late"})
    again = drains.acquire_slot(drain, server)

    # THEN the step is done, and the drain's records stay as its final event announced them
    assert recorded["state"] == "failed" and recorded["dest_host"] is None
    assert settled == {"state": "failed", "error": announced["servers"][0]["error"]}
    assert again.action == "stop"
    after = drains.get_view(drain)
    assert after["servers"] == announced["servers"] and after["counts"] == announced["counts"]
    assert (after["status"], after["message"]) == (announced["status"], announced["message"])
    assert _warned_late(caplog, drain, server, "RecordMoved")


@pytest.mark.parametrize("ended_while_recording", [False, True])
def test_a_move_that_failed_after_its_drain_ended_records_nothing_and_leaves_the_server_free(
        store, drain_machine, monkeypatch, caplog, ended_while_recording):
    drain, server, slot = _stopped_with_a_move_accepted(*drain_machine)
    if ended_while_recording:
        # GIVEN the drain is found ended while RecordFailure looks where the server is
        where_now = drains._where_now

        def ended_meanwhile(*args, **kwargs):
            drains.finish_if_workflow_ended(drain)
            return where_now(*args, **kwargs)

        monkeypatch.setattr(drains, "_where_now", ended_meanwhile)
    else:
        # GIVEN the drain was finished before RecordFailure runs
        assert drains.finish_if_workflow_ended(drain)

    # WHEN the move's workflow never started (RunMove failed) and RecordFailure runs
    outcome = drain_steps.record_failure({"drain_uuid": drain, "instance_uuid": server, "slot": slot,
                                          "error": {"Error": "States.Runtime", "Cause": "throttled"},
                                          "confirm_slot": None})

    # THEN the iteration settles, the drain's record is as announced, and the move the drain
    # accepted is undone (the server is not left busy in resize_prep)
    row = _servers(drain)[server]
    assert drains.get_view(drain)["status"] == "failed"
    assert (row.state, row.error) == ("failed", "The drain could not record the result of this server's move; "
                                                "see the server's actions and migrations.")
    assert outcome == {"retry": False, "confirm": False, "state": "failed", "error": row.error}
    assert _move_records(server, slot["migration_uuid"]) == (None, "error")
    assert _warned_late(caplog, drain, server, "RecordFailure")


def test_a_drain_that_ended_starts_no_more_moves(store, drain_machine):
    sfn, arn = drain_machine
    source = add_compute("source")
    add_compute("dest")
    server = _server_on("source", source)
    drain, execution = _running_drain(sfn, arn, "source")
    slot = drains.acquire_slot(drain, server).to_dict()  # the iteration got its slot ...
    sfn.stop_execution(executionArn=execution)
    assert drains.finish_if_workflow_ended(drain)  # ... and the drain was finished before its PrepareMove

    with pytest.raises(errors.DrainInvalidState, match="starts no more moves"):
        drain_steps.prepare_move({"drain_uuid": drain, "instance_uuid": server, "slot": slot})

    with cell_session("cell1") as session:
        assert session.scalars(select(Instance.task_state).where(Instance.uuid == server)).one() is None
        assert session.scalars(select(Migration).where(Migration.uuid == slot["migration_uuid"])).first() is None
    outcome = drain_steps.record_failure({"drain_uuid": drain, "instance_uuid": server, "slot": slot,
                                          "error": {"Error": "Ferry.DrainInvalidState", "Cause": "ended"},
                                          "confirm_slot": None})
    assert (outcome["retry"], outcome["confirm"], outcome["state"]) == (False, False, "failed")


def _workflow_ended(drain: str) -> None:
    """Finish ``drain`` as :func:`drains.finish_if_workflow_ended` does once its execution was stopped."""
    ended = errors.DrainWorkflowEnded(f"its execution drain-{drain} ended aborted before the drain was finished.")
    drains.finish(drain, error={"Error": ended.name, "Cause": ended.message})


@pytest.mark.parametrize("ended_while_planning", [False, True])
def test_a_drain_that_ended_is_neither_disabled_nor_planned_again_when_its_execution_runs_plandrain_again(
        store, drain_machine, monkeypatch, caplog, ended_while_planning):
    sfn, arn = drain_machine
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    announced: list[dict] = []
    if ended_while_planning:
        # GIVEN the drain's execution stopped while its PlanDrain ran, and the drain finished
        # (someone acted on it) before that step wrote its plan
        drain = _record({"host": "source"})
        execution = sfn.start_execution(stateMachineArn=arn, name=f"drain-{drain}",
                                        input=json.dumps({"drain_uuid": drain}))["executionArn"]
        sfn.stop_execution(executionArn=execution)
        instances_on = drains._instances_on

        def ended_meanwhile(*args, **kwargs):
            assert drains.finish_if_workflow_ended(drain)
            announced.append(drains.get_view(drain))
            return instances_on(*args, **kwargs)

        monkeypatch.setattr(drains, "_instances_on", ended_meanwhile)
    else:
        # GIVEN a drain finished as failed after its workflow was stopped, its host then enabled
        # again by the operator, and the execution redriven from PlanDrain
        drain, execution = _running_drain(sfn, arn, "source")
        sfn.stop_execution(executionArn=execution)
        assert drains.finish_if_workflow_ended(drain)
        announced.append(drains.get_view(drain))
        [service] = services.list_services(host="source")
        services.update_service(service, disabled=False)

    # WHEN PlanDrain runs, and the workflow goes on as its answer says
    plan = drain_steps.plan_drain({"drain": {"drain_uuid": drain}})
    report = drain_steps.finish_drain({"drain": {"drain_uuid": drain}})

    # THEN nothing moves, and the drain's records stay as its end announced them
    assert plan["proceed"] is False and plan["servers"] == []
    view = drains.get_view(drain)
    assert view == announced[0] and view["status"] == "failed"
    assert report == {"status": "failed", "counts": view["counts"], "message": view["message"]}
    assert _warned_late(caplog, drain, None, "PlanDrain")
    # a drain that failed before any move gave its hosts back, and this late run disables none again
    assert not any(s.disabled for s in services.list_services(host="source"))


def test_a_move_that_finished_after_its_drain_ended_still_goes_on_to_its_confirm(store, move_machines):
    # GIVEN a drain that confirms its moves, finished as failed while one server's move was under
    # way; the move then finished (VERIFY_RESIZE on dest) but the RunMove that waited for it failed
    drain, server, slot, _move = _prepared_move()
    _workflow_ended(drain)
    announced = drains.get_view(drain)
    _moved_to_dest(server, slot["migration_uuid"], "resized", "finished")
    lost = {"Error": "States.Runtime", "Cause": "lost track"}

    # WHEN RecordFailure runs for the failed RunMove
    outcome = drain_steps.record_failure({"drain_uuid": drain, "instance_uuid": server, "slot": slot,
                                          "error": lost, "confirm_slot": None})

    # THEN it goes on to the confirm (once for the attempt), which PrepareConfirm accepts
    assert (outcome["retry"], outcome["confirm"]) == (False, True)
    assert drain_steps.record_failure({"drain_uuid": drain, "instance_uuid": server, "slot": slot,
                                       "error": lost, "confirm_slot": slot["request_id"]})["confirm"] is False
    confirm = drain_steps.prepare_confirm({"drain_uuid": drain, "instance_uuid": server, "slot": slot})
    assert confirm["input"]["request_id"] == f"{slot['request_id']}-confirm"
    assert _move_records(server, slot["migration_uuid"]) == (None, "confirming")

    # WHEN the confirm workflow (done here by hand) confirms it and RecordMoved runs
    _moved_to_dest(server, slot["migration_uuid"], "active", "confirmed")
    drain_steps.record_moved({"drain_uuid": drain, "instance_uuid": server, "slot": slot})

    # THEN the drain's records are as its end announced them
    assert drains.get_view(drain) == announced
    assert _servers(drain)[server].state == "failed"


@pytest.mark.parametrize("step", ["AcquireSlot", "PrepareMove"])
def test_a_plan_made_for_another_try_while_the_drain_ended_is_not_written(store, move_machines, monkeypatch,
                                                                           caplog, step):
    # GIVEN a server to be tried again (its first try failed before its workflow started) ...
    drain, server, slot, _move = _prepared_move()
    assert drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "throttled"})["retry"]
    if step == "PrepareMove":
        # ... its next attempt handed out with no plan yet (by AcquireSlot before it planned retries)
        migration_uuid, request_id = drains._attempt_ids(drain, server, 2)
        with api_session() as session:
            session.execute(update(DrainServer).where(DrainServer.instance_uuid == server)
                            .values(state="moving", attempts=2, migration_uuid=migration_uuid))
        slot = {**slot, "migration_uuid": migration_uuid, "request_id": request_id, "attempt": 2}
    # ... and the drain finished (its workflow ended) while the server is planned again
    announced: list[dict] = []
    plan_server = drains.plan_server

    def ended_meanwhile(*args, **kwargs):
        _workflow_ended(drain)
        announced.append(drains.get_view(drain))
        return plan_server(*args, **kwargs)

    monkeypatch.setattr(drains, "plan_server", ended_meanwhile)

    # WHEN the step plans it
    if step == "AcquireSlot":
        assert drains.acquire_slot(drain, server).action == "stop"
    else:
        with pytest.raises(errors.DrainInvalidState, match="no longer moves"):
            drains.prepare_move(drain, server, slot)
        with cell_session("cell1") as session:
            assert session.scalars(select(Migration).where(Migration.uuid == slot["migration_uuid"])).first() is None

    # THEN the plan is not written: the drain's records stay as its end announced them
    assert drains.get_view(drain) == announced[0]
    assert _servers(drain)[server].planned_host is None
    assert _warned_late(caplog, drain, server, step)


# --- retries --------------------------------------------------------------------------------------


def test_a_retry_prefers_another_host_than_the_one_its_failed_try_went_to(store, move_machines):
    # GIVEN a server whose first try failed on the host it was planned to, another host as good
    source = add_compute("source", memory_mb=16384)
    for host in ("d1", "d2"):
        add_compute(host)
    server = _server_on("source", source)
    drain = _record({"host": "source", "retries": 2})
    drains.start(drain)
    slot = drains.acquire_slot(drain, server).to_dict()
    failed_at = drains.prepare_move(drain, server, slot)["input"]["requested_host"]
    with cell_session("cell1") as session:  # the move was scheduled there before it failed
        session.execute(update(Migration).where(Migration.uuid == slot["migration_uuid"])
                        .values(dest_compute=failed_at))
    assert drains.record_failure(drain, server, slot, {"Error": "Ferry.SpawnFailed", "Cause": "no"})["retry"]

    # WHEN it is tried again THEN it goes to the other host
    retry = drains.acquire_slot(drain, server).to_dict()
    other = ({"d1", "d2"} - {failed_at}).pop()
    assert retry["action"] == "move" and _servers(drain)[server].planned_host == other

    # and when that try fails too and no other host takes it, back to the one it last failed on
    # rather than nowhere
    with cell_session("cell1") as session:
        session.execute(update(Migration).where(Migration.uuid == retry["migration_uuid"])
                        .values(dest_compute=other))
    assert drains.record_failure(drain, server, retry, {"Error": "Ferry.SpawnFailed", "Cause": "no"})["retry"]
    [service] = services.list_services(host=failed_at)
    services.update_service(service, disabled=True)
    assert drains.acquire_slot(drain, server).action == "move"
    assert _servers(drain)[server].planned_host == other


@pytest.mark.parametrize("other", ["waiting", "moving, unclaimed", "moving, claimed"])
def test_a_retry_keeps_off_the_host_planned_for_a_group_member_not_claimed_there_yet(store, move_machines, other):
    # GIVEN two anti-affinity members on drained hosts, planned to the roomiest host and the next
    # roomiest, and a third host with less room
    group = add_group("anti-affinity")
    members = []
    for name in ("source-a", "source-b"):
        members.append(_server_on(name, add_compute(name)))
        join_group(group, members[-1])
    for host, memory_mb in (("roomy", 65536), ("next", 16384), ("last", 8192)):
        add_compute(host, memory_mb=memory_mb)
    with api_session() as session:
        for member in members:
            compute_api.save_request_spec(session, member, request_spec(member, group={"uuid": group}))
    drain = _record({"hosts": ["source-a", "source-b"], "retries": 1})
    drains.start(drain)
    plan = _servers(drain)
    [first] = [m for m in members if plan[m].planned_host == "roomy"]
    [waiting] = [m for m in members if m != first]
    assert plan[waiting].planned_host == "next"

    # WHEN the first one's move fails on the roomiest host and it is tried again, the other
    # member still waiting for its turn, or moving with its destination not claimed yet (or
    # claimed, where the scheduler counts it)
    slot = drains.acquire_slot(drain, first).to_dict()
    if other != "waiting":
        assert drains.acquire_slot(drain, waiting).action == "move"
    if other == "moving, claimed":
        placement.claim(waiting, PROJECT, USER, {placement.provider_by_host("next"): resources(1, 2048, 1)})
    drains.prepare_move(drain, first, slot)
    with cell_session("cell1") as session:
        session.execute(update(Migration).where(Migration.uuid == slot["migration_uuid"])
                        .values(dest_compute="roomy"))
    assert drains.record_failure(drain, first, slot, {"Error": "Ferry.SpawnFailed", "Cause": "no"})["retry"]
    retry = drains.acquire_slot(drain, first).to_dict()

    # THEN it goes to the host no member is planned to, not to the other member's
    rows = _servers(drain)
    assert retry["action"] == "move" and rows[first].planned_host == "last"
    assert (rows[waiting].state, rows[waiting].planned_host) == ("pending" if other == "waiting" else "moving", "next")


def test_a_retry_recorded_with_the_plan_of_its_failed_try_is_planned_afresh(store, move_machines):
    # GIVEN a server whose first try failed, its retry's row pending again with the host of the
    # failed try kept, a host that takes no servers now
    source = add_compute("source", memory_mb=16384)
    for host in ("d1", "d2"):
        add_compute(host)
    server = _server_on("source", source)
    drain = _record({"host": "source", "retries": 1})
    drains.start(drain)
    slot = drains.acquire_slot(drain, server).to_dict()
    stale = drains.prepare_move(drain, server, slot)["input"]["requested_host"]
    assert drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "throttled"})["retry"]
    with api_session() as session:
        session.execute(update(DrainServer).where(DrainServer.instance_uuid == server)
                        .values(planned_host=stale, planned_cell="cell1"))
    [service] = services.list_services(host=stale)
    services.update_service(service, disabled=True)

    # WHEN its iteration looks for a slot again and prepares the move
    retry = drains.acquire_slot(drain, server).to_dict()
    move = drains.prepare_move(drain, server, retry)

    # THEN the retry goes to a host that takes it now, as a retry record_failure recorded would
    other = ({"d1", "d2"} - {stale}).pop()
    assert retry["action"] == "move" and retry["attempt"] == 2
    assert _servers(drain)[server].planned_host == other
    assert move["input"]["requested_host"] == other


# --- a drain's end is announced once it is final, whoever finished it -----------------------------


def _killed(*_args, **_kwargs):
    raise _FunctionKilled


def _drain_times(drain: str) -> tuple[dt.datetime | None, dt.datetime | None]:
    """``(finished_at, announced_at)`` of the drain as recorded."""
    with api_session() as session:
        return session.execute(select(Drain.finished_at, Drain.announced_at).where(Drain.uuid == drain)).one()


def _callbacks(monkeypatch) -> list[tuple[str, str | None]]:
    """``(event type, delivery id)`` of every callback the drains post from now on."""
    posted: list[tuple[str, str | None]] = []

    def post(_url, document, _secret, delivery_id=None, **_options):
        posted.append((document["event_type"], delivery_id))
        return True

    monkeypatch.setattr(drains.signing, "post_callback", post)
    return posted


def _ended_unannounced(drain_machine, bus, monkeypatch, finish_by, **request) -> str:
    """A drain of host ``source`` whose workflow was stopped, then finished by ``finish_by(drain)``
    in a function killed between committing the drain's end and announcing it."""
    sfn, arn = drain_machine
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain, execution = _running_drain(sfn, arn, "source", **request)
    sfn.stop_execution(executionArn=execution)
    with monkeypatch.context() as patched:
        patched.setattr(drains.notifications, "notify_drain", _killed)
        with pytest.raises(_FunctionKilled):
            finish_by(drain)
    assert drains.get_view(drain)["status"] == "failed"
    assert [e["detail-type"] for e in bus()] == ["drain.start"]
    return drain


def test_a_look_after_a_finish_that_died_before_announcing_announces_the_end_once(
        store, bus, drain_machine, monkeypatch):
    # GIVEN a drain whose workflow was stopped, finished by someone's action whose function was
    # killed between committing the drain's end and announcing it
    posted = _callbacks(monkeypatch)
    drain = _ended_unannounced(drain_machine, bus, monkeypatch, lambda d: drains.act(d, "pause"),
                               callback_url="https://ops.example.com/ferry")
    assert _drain_times(drain)[1] is None

    # WHEN someone acts on it again, and once more
    for _look in range(2):
        with pytest.raises(errors.DrainInvalidState, match="while it is failed"):
            drains.act(drain, "pause")

    # THEN the first of those looks announces its end (the notification, stamped with the time
    # the drain ended, and the callback, as one event), and the second announces nothing more
    finished_at, announced_at = _drain_times(drain)
    [end] = [e["detail"] for e in bus()]
    assert end["event_type"] == "drain.error" and end["payload"]["status"] == "failed"
    assert end["timestamp"] == finished_at.replace(tzinfo=dt.UTC).isoformat()
    assert posted[1:] == [("drain.error", end["message_id"])]
    assert announced_at is not None


def test_a_final_drain_whose_end_was_not_announced_is_left_to_its_workflow_while_that_runs(
        store, bus, drain_machine, monkeypatch):
    # GIVEN a drain whose FinishDrain committed its end and was killed before announcing it,
    # while its execution still runs (FinishDrain is retried)
    sfn, arn = drain_machine
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain, execution = _running_drain(sfn, arn, "source")
    with monkeypatch.context() as patched:
        patched.setattr(drains.notifications, "notify_drain", _killed)
        with pytest.raises(_FunctionKilled):
            drains.finish(drain)
    assert [e["detail-type"] for e in bus()] == ["drain.start"]

    # WHEN someone acts on it: the retry of its FinishDrain announces it, not the look
    with pytest.raises(errors.DrainInvalidState):
        drains.act(drain, "cancel")
    assert bus() == []

    # WHEN the execution ends without that retry (stopped by hand), and someone acts on it again
    sfn.stop_execution(executionArn=execution)
    with pytest.raises(errors.DrainInvalidState):
        drains.act(drain, "cancel")

    # THEN that look announces the end
    assert [e["detail-type"] for e in bus()] == ["drain.error"]
    assert _drain_times(drain)[1] is not None


def test_a_new_drain_of_the_same_host_announces_the_end_an_earlier_request_finished_and_did_not_announce(
        store, bus, drain_machine, monkeypatch):
    # GIVEN a drain whose workflow was stopped, finished by a request for a new drain of its host
    # that was killed before it announced the end
    first = _ended_unannounced(drain_machine, bus, monkeypatch,
                               lambda _d: drains.record_drain(ADMIN, {"host": "source"}, origin="api"))

    # WHEN the request is made again
    second = _record({"host": "source"})

    # THEN the first drain's end is announced, and the new drain recorded
    [end] = [e["detail"] for e in bus()]
    assert (end["event_type"], end["payload"]["drain_id"]) == ("drain.error", first)
    assert second != first and drains.get_view(second)["status"] == "planning"


def test_every_announcement_of_a_drains_end_carries_the_time_it_ended(store, bus):
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source"})
    drains.start(drain)

    drains.finish(drain)
    drains.finish(drain)  # FinishDrain run again

    _start, end, again = [e["detail"] for e in bus()]
    finished_at, announced_at = _drain_times(drain)
    assert end["timestamp"] == again["timestamp"] == finished_at.replace(tzinfo=dt.UTC).isoformat()
    assert end["message_id"] == again["message_id"]
    assert announced_at >= finished_at


def test_a_drain_whose_workflow_did_not_start_is_not_announced_by_a_later_look(
        store, bus, drain_machine, monkeypatch):
    # GIVEN a drain marked failed by the request whose start of its workflow was refused (that
    # request answered the error)
    failed = _created_without_its_workflow(monkeypatch, origin="api")

    # WHEN someone acts on it, and a new drain of its host is made
    with pytest.raises(errors.DrainInvalidState):
        drains.act(failed["id"], "cancel")
    _record({"host": "source"})

    # THEN nothing is announced for it
    assert bus() == []


# --- what a drain's iterations accepted and never started is undone when the drain finishes ------


def test_finishing_a_drain_undoes_a_move_its_iteration_accepted_and_never_started(store, move_machines):
    # GIVEN a drained server whose move PrepareMove accepted, its iteration then ended (stopped,
    # say) before RunMove started the move's workflow
    drain, server, slot, _move = _prepared_move()
    assert _move_records(server, slot["migration_uuid"]) == ("resize_prep", "pre-migrating")
    with cell_session("cell1") as session:
        assert actions.find(session, server, slot["request_id"]) is not None

    # WHEN FinishDrain runs, and runs again
    report = drains.finish(drain)
    again = drains.finish(drain)

    # THEN the server is failed in the drain's report, and the move undone: the server is free
    assert report == again and report["status"] == "failed"
    row = _servers(drain)[server]
    assert row.state == "failed" and "could not record" in row.error
    assert _move_records(server, slot["migration_uuid"]) == (None, "error")
    with cell_session("cell1") as session:
        assert actions.find(session, server, slot["request_id"]) is None


def test_a_look_that_finishes_a_drain_whose_workflow_ended_undoes_the_move_its_iteration_left_accepted(
        store, drain_machine):
    # GIVEN a drain whose workflow was stopped after one server's move was accepted, and before
    # that move's workflow was started
    drain, server, slot = _stopped_with_a_move_accepted(*drain_machine)

    # WHEN someone acts on it
    with pytest.raises(errors.DrainInvalidState):
        drains.act(drain, "pause")

    # THEN the drain is failed and the move it accepted undone
    assert drains.get_view(drain)["status"] == "failed"
    assert _servers(drain)[server].state == "failed"
    assert _move_records(server, slot["migration_uuid"]) == (None, "error")


def test_a_finish_run_again_undoes_the_move_a_run_that_died_left_accepted(store, move_machines, monkeypatch):
    # GIVEN a drain whose FinishDrain committed its end, then was killed while undoing the move an
    # iteration had accepted and never started
    drain, server, slot, _move = _prepared_move()
    with monkeypatch.context() as patched:
        patched.setattr(drains.moves, "abandon_prepared_move", _killed)
        with pytest.raises(_FunctionKilled):
            drains.finish(drain)
    assert drains.get_view(drain)["status"] == "failed"
    assert _move_records(server, slot["migration_uuid"]) == ("resize_prep", "pre-migrating")

    # WHEN FinishDrain is retried
    drains.finish(drain)

    # THEN the move is undone
    assert _move_records(server, slot["migration_uuid"]) == (None, "error")


@pytest.mark.parametrize("ended", [False, True])
def test_finishing_a_drain_leaves_a_move_whose_workflow_started_to_that_workflow(
        store, move_machines, caplog, ended):
    # GIVEN a drained server whose move's workflow started: it runs, or it got past accepting the
    # move and then ended (stopped half-way)
    sfn, arns = move_machines
    drain, server, slot, move = _prepared_move()
    execution = sfn.start_execution(stateMachineArn=arns["resize"], name=move["name"], input=json.dumps(move["input"]))
    if ended:
        with cell_session("cell1") as session:
            session.execute(update(Instance).where(Instance.uuid == server).values(task_state="resize_migrating"))
            session.execute(update(Migration).where(Migration.uuid == slot["migration_uuid"])
                            .values(status="migrating"))
        sfn.stop_execution(executionArn=execution["executionArn"])

    # WHEN the drain finishes
    assert drains.finish(drain)["status"] == "failed"

    # THEN the move is as its workflow left it
    expected = ("resize_migrating", "migrating") if ended else ("resize_prep", "pre-migrating")
    assert _move_records(server, slot["migration_uuid"]) == expected
    left_to_it = [r for r in caplog.records if "left to its workflow" in r.getMessage()
                  and getattr(r, "instance_uuid", None) == server]
    assert bool(left_to_it) is not ended


def _stopped_once_scheduling_began(move_machines) -> tuple[str, str, dict]:
    """A drained server whose move's workflow started, began scheduling (SelectMoveDestinations
    recorded its event) and was stopped: ``(drain, server, slot)``."""
    sfn, arns = move_machines
    drain, server, slot, move = _prepared_move()
    execution = sfn.start_execution(stateMachineArn=arns["resize"], name=move["name"], input=json.dumps(move["input"]))
    with cell_session("cell1") as session:
        actions.start_event(session, instance_uuid=server, request_id=slot["request_id"], event=resize.EVENT_MIGRATE)
    sfn.stop_execution(executionArn=execution["executionArn"])
    return drain, server, slot


def test_finishing_a_drain_leaves_a_move_whose_workflow_stopped_while_it_was_being_scheduled(store, move_machines,
                                                                                            caplog):
    # GIVEN a drained server whose move's workflow started, began scheduling (SelectMoveDestinations
    # recorded its event: a claim may have followed, or may still be on its way) and was stopped
    # before it left resize_prep
    drain, server, slot = _stopped_once_scheduling_began(move_machines)

    # WHEN the drain finishes
    assert drains.finish(drain)["status"] == "failed"

    # THEN the move is not undone as if it never started: ferry audit reports it (instance_task_stuck)
    assert _move_records(server, slot["migration_uuid"]) == ("resize_prep", "pre-migrating")
    assert any("its workflow ran and ended" in r.getMessage() and getattr(r, "instance_uuid", None) == server
               for r in caplog.records)


def test_finishing_a_drain_leaves_a_move_whose_scheduling_began_after_the_drain_first_looked(
        store, move_machines, monkeypatch, caplog):
    # GIVEN a drained server whose stopped move's SelectMoveDestinations committed its first event
    # just after FinishDrain read the move's events (the read finds none)
    drain, server, slot = _stopped_once_scheduling_began(move_machines)
    real_has_events, reads = actions.has_events, []

    def read_before_the_event(*args):
        reads.append(args)
        return False if len(reads) == 1 else real_has_events(*args)

    monkeypatch.setattr(actions, "has_events", read_before_the_event)

    # WHEN the drain finishes
    assert drains.finish(drain)["status"] == "failed"

    # THEN the undo's own transaction sees the event: the move is left as it was, for ferry audit
    assert _move_records(server, slot["migration_uuid"]) == ("resize_prep", "pre-migrating")
    assert len(reads) == 2
    assert any("its workflow ran and ended" in r.getMessage() and getattr(r, "instance_uuid", None) == server
               for r in caplog.records)


def test_finishing_a_drain_leaves_a_move_that_began_scheduling_though_its_execution_is_not_shown_yet(
        store, move_machines, caplog):
    # GIVEN a drained server whose move's first step recorded its event while Step Functions does
    # not show the execution yet (its reads lag)
    drain, server, slot, _move = _prepared_move()
    with cell_session("cell1") as session:
        actions.start_event(session, instance_uuid=server, request_id=slot["request_id"], event=resize.EVENT_MIGRATE)

    # WHEN the drain finishes
    assert drains.finish(drain)["status"] == "failed"

    # THEN the move is left to its workflow, not undone under it
    assert _move_records(server, slot["migration_uuid"]) == ("resize_prep", "pre-migrating")
    assert any("its workflow ran and ended" in r.getMessage() and getattr(r, "instance_uuid", None) == server
               for r in caplog.records)


@pytest.mark.postgres
def test_a_move_undone_while_it_is_being_scheduled_claims_nothing(pg_store, move_machines, monkeypatch):
    # GIVEN a drained server whose move's SelectMoveDestinations has read the move as waiting to
    # be scheduled, when FinishDrain undoes the move (its workflow stopped, no step recorded yet)
    sfn, arns = move_machines
    drain, server, slot, move = _prepared_move()
    execution = sfn.start_execution(stateMachineArn=arns["resize"], name=move["name"], input=json.dumps(move["input"]))
    sfn.stop_execution(executionArn=execution["executionArn"])
    held = placement.get_allocations(server)
    real_load, undone = resize._load, []

    def load_then_undo(session, event):
        loaded = real_load(session, event)
        undone.append(moves.abandon_prepared_move("cell1", server, slot["migration_uuid"], slot["request_id"]))
        return loaded

    monkeypatch.setattr(resize, "_load", load_then_undo)
    monkeypatch.setattr(resize.hosts, "queue_url", lambda host: f"https://sqs.test/{host}")

    # WHEN the step goes on to record its event and claim
    with pytest.raises(errors.UnexpectedTaskState):
        resize.select_destinations(move["input"])

    # THEN the move stays undone and nothing was claimed: the server holds its allocation, the
    # migration nothing
    assert undone == [True]
    assert _move_records(server, slot["migration_uuid"]) == (None, "error")
    assert placement.get_allocations(server) == held
    assert placement.get_allocations(slot["migration_uuid"]) == {}


def test_a_move_the_drain_cannot_undo_is_logged_and_its_end_announced_anyway(store, bus, monkeypatch, caplog):
    drain, server, slot, _move = _prepared_move()

    def unreachable(*_args, **_kwargs):
        raise RuntimeError("the cell database is out of reach")

    monkeypatch.setattr(drains.moves, "abandon_prepared_move", unreachable)

    assert drains.finish(drain)["status"] == "failed"

    assert [e["detail-type"] for e in bus()] == ["drain.start", "drain.error"]
    assert _drain_times(drain)[1] is not None
    assert any(r.levelname == "ERROR" and "never started" in r.getMessage()
               and getattr(r, "instance_uuid", None) == server for r in caplog.records)
    assert _move_records(server, slot["migration_uuid"]) == ("resize_prep", "pre-migrating")


def test_finishing_a_drain_of_hosts_in_two_cells_undoes_each_move_in_its_servers_cell(store, move_machines):
    # GIVEN a drain of a host in cell1 and one in cell2, one server's move accepted on each, and
    # both iterations ended before their moves' workflows started
    servers: dict[str, tuple[str, dict]] = {}
    for cell in ("cell1", "cell2"):
        source = add_compute(f"source-{cell}", cell)
        add_compute(f"dest-{cell}", cell)
        servers[cell] = (_server_on(f"source-{cell}", source, cell=cell), {})
    drain = _record({"hosts": ["source-cell1", "source-cell2"]})
    drains.start(drain)
    for cell, (server, slot) in servers.items():
        slot.update(drains.acquire_slot(drain, server).to_dict())
        drains.prepare_move(drain, server, slot)
        assert _move_records(server, slot["migration_uuid"], cell) == ("resize_prep", "pre-migrating")

    # WHEN the drain finishes
    drains.finish(drain)

    # THEN each move is undone in its server's cell
    for cell, (server, slot) in servers.items():
        assert _move_records(server, slot["migration_uuid"], cell) == (None, "error")


# --- a slow callback, dry runs, the plan's order, disabling -----------------------------------------


def test_a_drain_whose_callback_receiver_answers_a_byte_at_a_time_finishes_at_the_callbacks_deadline(
        store, bus, monkeypatch):
    # GIVEN a drain whose callback receiver (on loopback, which the stack allows) would take some
    # 6 s to answer each POST
    monkeypatch.setenv("FERRY_CALLBACK_ALLOW_PRIVATE", "true")
    config.reset()
    monkeypatch.setattr(drains.signing, "CALLBACK_TIMEOUT_SECONDS", 1.0)
    url, stop = trickling_receiver(0.15, "/ferry?token=s3cret")
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source", "callback_url": url})
    drains.start(drain)

    # WHEN it finishes
    started = time.monotonic()
    report = drains.finish(drain)
    took = time.monotonic() - started
    stop()

    # THEN the callback gives up at its deadline, and the end is recorded announced
    assert report["status"] == "failed"
    assert took < drains.signing.CALLBACK_TIMEOUT_SECONDS + 1.0
    assert _drain_times(drain)[1] is not None


def test_a_drains_end_is_recorded_announced_before_its_callback_is_posted(store, bus, monkeypatch):
    # GIVEN a drain whose FinishDrain is killed while it posts the callback (the receiver hangs)
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source", "callback_url": "https://ops.example.com/ferry"})
    drains.start(drain)
    with monkeypatch.context() as patched:
        patched.setattr(drains.signing, "post_callback", _killed)
        with pytest.raises(_FunctionKilled):
            drains.finish(drain)

    # THEN the end counts as announced: no later look posts it again inline
    assert _drain_times(drain)[1] is not None
    assert [e["detail-type"] for e in bus()] == ["drain.start", "drain.error"]


def test_a_dry_run_of_more_servers_than_one_request_plans_in_time_is_refused_before_it_is_recorded(
        store, monkeypatch):
    monkeypatch.setattr(drains, "MAX_DRY_RUN_SERVERS", 2)
    source = add_compute("source", memory_mb=16384)
    add_compute("dest", memory_mb=16384)
    for _ in range(3):
        _server_on("source", source)

    with pytest.raises(errors.DrainTooLarge, match="a dry run plans at most 2: dry-run fewer hosts at once"):
        drains.create_drain(ADMIN, {"host": "source", "dry_run": True}, origin="api")

    assert drains.list_views() == []
    assert drains.record_drain(ADMIN, {"host": "source"}, origin="api")[1]  # a real drain of them is taken
    # and so is a dry run started on the state machine: PlanDrain plans it, with its own time
    assert drains.record_drain(drains.operator_context(), {"host": "source", "dry_run": True},
                               origin=drains.EXECUTION_ORIGIN, execution_name="drain-x")[1]


def _dry_run_whose_plan_died(monkeypatch, key: str | None = None) -> str:
    """A dry run of host ``source`` whose function died while planning it."""
    add_compute("source")
    with monkeypatch.context() as patched:
        patched.setattr(drains, "plan", _killed)
        with pytest.raises(_FunctionKilled):
            drains.create_drain(ADMIN, {"host": "source", "dry_run": True}, origin="webhook", idempotency_key=key)
    [view] = drains.list_views()
    assert view["status"] == "planning"
    return view["id"]


def test_a_dry_run_left_planning_by_a_function_that_ended_is_failed_when_next_read(store, monkeypatch):
    # GIVEN a dry run whose function died while planning it, just over 2 minutes ago
    drain = _dry_run_whose_plan_died(monkeypatch, key="webhook:d1")
    assert drains.get_view(drain)["status"] == "planning"  # within the limit, it may still be planned
    long_ago = drains.utcnow() - drains.DRY_RUN_PLANNING_LIMIT - dt.timedelta(seconds=1)
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == drain).values(created_at=long_ago, updated_at=long_ago))

    # WHEN it is read
    view = drains.get_view(drain)

    # THEN it is shown and recorded failed, saying why, and its key is given up
    assert (view["status"], view["message"]) == ("failed", drains.DRY_RUN_ABANDONED)
    assert [v["status"] for v in drains.list_views()] == ["failed"]
    with api_session() as session:
        recorded = session.scalars(select(Drain).where(Drain.uuid == drain)).one()
        assert (recorded.status, recorded.idempotency_key) == ("failed", None)
        assert recorded.finished_at is not None


@pytest.mark.parametrize("action", ["pause", "resume", "cancel"])
def test_a_dry_run_takes_no_action(store, monkeypatch, action):
    # GIVEN a dry run whose plan failed (still planning), and one planned
    planning = _dry_run_whose_plan_died(monkeypatch)
    add_compute("dest")
    _status, planned = drains.create_drain(ADMIN, {"host": "dest", "dry_run": True}, origin="api")

    # WHEN an operator acts on them THEN each is refused (409), and stays as it was
    for drain, status in ((planning, "planning"), (planned["drain"]["id"], "planned")):
        with pytest.raises(errors.DrainInvalidState, match="it is a dry run"):
            drains.act(drain, action)
        assert drains.get_view(drain)["status"] == status


def test_the_plan_takes_the_servers_round_robin_by_source_host_largest_first_on_each(store):
    # GIVEN three hosts holding 3, 2 and 1 servers of different sizes
    big, medium = flavor(vcpus=1, memory_mb=4096, root_gb=1), flavor(vcpus=1, memory_mb=3072, root_gb=1)
    providers = {host: add_compute(host, memory_mb=32768) for host in ("h1", "h2", "h3")}
    add_compute("dest", memory_mb=65536)
    h1 = [_server_on("h1", providers["h1"], size=size) for size in (SMALL, big, medium)]
    h2 = [_server_on("h2", providers["h2"], size=size) for size in (SMALL, medium)]
    h3 = [_server_on("h3", providers["h3"], size=big)]
    drain = _record({"hosts": ["h1", "h2", "h3"], "max_per_source_host": 1, "dry_run": True})

    # WHEN it is planned
    result = drains.plan(drain)

    # THEN the Map gets one server of each host in turn, each host's largest first
    expected = [h1[1], h3[0], h2[1], h1[2], h2[0], h1[0]]
    assert result["servers"] == expected
    assert [s["id"] for s in drains.get_view(drain)["servers"]] == expected


def test_a_service_an_operator_disables_while_the_drain_disables_it_keeps_the_operators_reason(store, monkeypatch):
    # GIVEN a drain of two hosts, and an operator who disables one of them right after the drain
    # read them enabled
    for host in ("h1", "h2"):
        add_compute(host)
    drain = _record({"hosts": ["h1", "h2"], "reason": "retire"})
    read = drains._target_services
    looks = []

    def operator_disables_h1_after_the_read(record):
        found = read(record)
        looks.append(found)
        if len(looks) == 2:
            services.update_service(services.get_by_host("h1", services.COMPUTE_BINARY), disabled=True,
                                    disabled_reason="operator: bad disk")
        return found

    monkeypatch.setattr(drains, "_target_services", operator_disables_h1_after_the_read)

    # WHEN the drain disables its hosts
    ours = drains.disable_targets(drain)

    # THEN h1 keeps the operator's reason and is not the drain's to give back
    assert ours == ["h2"]
    [h1] = services.list_services(host="h1")
    assert (h1.disabled, h1.disabled_reason) == (True, "operator: bad disk")
    assert drains.give_back_targets(drain) == ["h2"]
    [h1] = services.list_services(host="h1")
    assert (h1.disabled, h1.disabled_reason) == (True, "operator: bad disk")


# --- servers deleted during the drain -------------------------------------------------------------


def _deleted(server: str, how: str = "deleted", cell: str = "cell1") -> None:
    """The server's records once its owner deleted it: ``deleted`` as the delete workflow leaves
    them (mapping queued for delete, instance soft-deleted), or only one half of that
    (``mapping queued``, ``instance deleted``), or its mapping removed altogether (``purged``)."""
    if how in ("deleted", "mapping queued"):
        with api_session() as session:
            session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server)
                            .values(queued_for_delete=True))
    if how in ("deleted", "instance deleted"):
        with cell_session(cell) as session:
            session.execute(update(Instance).where(Instance.uuid == server)
                            .values(deleted=True, vm_state="deleted", task_state=None))
    if how == "purged":
        with api_session() as session:
            session.delete(session.scalars(select(InstanceMapping).where(
                InstanceMapping.instance_uuid == server)).one())


def _migrations_of(server: str) -> list[str]:
    with cell_session("cell1") as session:
        return list(session.scalars(select(Migration.uuid).where(Migration.instance_uuid == server)))


@pytest.mark.parametrize("how", ["deleted", "mapping queued", "instance deleted", "purged"])
def test_a_server_deleted_before_its_move_started_is_gone_and_no_move_starts(store, how):
    # GIVEN a running drain of two servers, one deleted by its owner before its turn
    drain, kept, deleted = _started_with_two()
    _deleted(deleted, how)

    # WHEN its iteration asks for a slot (twice: a step may run again)
    first = drains.acquire_slot(drain, deleted)
    again = drains.acquire_slot(drain, deleted)

    # THEN its iteration stops, no move is accepted, and the server is gone, not failed
    assert first.action == again.action == "stop"
    row = _servers(drain)[deleted]
    assert (row.state, row.attempts, row.migration_uuid) == ("gone", 0, None)
    assert row.error == "The server no longer exists: it was deleted before its move started."
    assert _migrations_of(deleted) == []
    # and the other server still moves
    assert drains.acquire_slot(drain, kept).action == "move"


def test_a_server_a_move_between_cells_took_back_while_it_was_looked_at_is_not_gone(store, monkeypatch):
    # GIVEN a drained server its owner moved to cell2 (mapping there, its cell1 copy hidden)
    drain, kept, server = _started_with_two()
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == server)).one()
        copy = {column.name: getattr(instance, column.name) for column in Instance.__table__.columns
                if column.name != "id"}
        instance.hidden = True
    with cell_session("cell2") as session:
        session.add(Instance(**{**copy, "hidden": False}))
    with api_session() as session:
        cell2 = session.scalars(select(CellMapping.id).where(CellMapping.name == "cell2")).one()
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server).values(cell_id=cell2))
    real, reverted = drains.cell_session, []

    def revert_first(cell):  # the owner's revert lands between the mapping's read and cell2's
        if not reverted:
            reverted.append(cell)
            with api_session() as session:
                cell1 = session.scalars(select(CellMapping.id).where(CellMapping.name == "cell1")).one()
                session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server)
                                .values(cell_id=cell1))
            with real("cell1") as session:
                session.execute(update(Instance).where(Instance.uuid == server).values(hidden=False))
            with real("cell2") as session:
                instances.purge(session, server)
        return real(cell)

    monkeypatch.setattr(drains, "cell_session", revert_first)

    # WHEN its iteration asks for a slot meanwhile
    slot = drains.acquire_slot(drain, server)

    # THEN the server, alive in cell1, is not recorded gone: it moves
    assert reverted == ["cell2"]
    assert slot.action == "move" and _servers(drain)[server].state == "moving"


def test_a_look_for_a_slot_reads_the_servers_cell_once(store, monkeypatch):
    # GIVEN a running drain of two servers
    drain, _other, server = _started_with_two()
    real, opened = drains.cell_session, []

    def counting(cell):
        opened.append(cell.name if isinstance(cell, CellMapping) else cell)
        return real(cell)

    monkeypatch.setattr(drains, "cell_session", counting)

    # WHEN one's iteration asks for a slot
    slot = drains.acquire_slot(drain, server)

    # THEN its cell was read once, for whether it is gone and whether its owner moved it off
    assert slot.action == "move"
    assert opened == ["cell1"]


def test_a_server_deleted_before_its_retry_is_gone_and_not_planned_again(store, move_machines):
    # GIVEN a server whose first try failed and rolled back, waiting for its retry
    drain, server, slot, _move = _prepared_move()
    assert drains.record_failure(drain, server, slot, {"Error": "States.Runtime", "Cause": "throttled"})["retry"]
    _deleted(server)

    # WHEN its iteration asks for a slot again
    assert drains.acquire_slot(drain, server).action == "stop"

    # THEN it is gone with its one try, and no second move was accepted
    row = _servers(drain)[server]
    assert (row.state, row.attempts, row.planned_host) == ("gone", 1, None)
    assert "before its next try started" in row.error
    assert _migrations_of(server) == [slot["migration_uuid"]]


def test_a_server_deleted_once_its_slot_was_taken_is_refused_by_preparemove_and_recorded_gone(store, move_machines):
    # GIVEN AcquireSlot handed out the move, and the server was deleted before PrepareMove ran
    drain, _kept, server = _started_with_two(retries=1)
    slot = drains.acquire_slot(drain, server).to_dict()
    _deleted(server)

    # WHEN PrepareMove runs: it accepts nothing
    with pytest.raises(errors.InstanceNotFound, match="deleted before its move started"):
        drains.prepare_move(drain, server, slot)
    assert _migrations_of(server) == []

    # THEN RecordFailure, where the workflow goes, records it gone without another try
    error = {"Error": "Ferry.InstanceNotFound", "Cause": f"Server {server} was deleted before its move started."}
    outcome = drains.record_failure(drain, server, slot, error)
    assert outcome["retry"] is False and outcome["confirm"] is False and outcome["state"] == "gone"
    assert drains.record_failure(drain, server, slot, error) == outcome  # run twice: the same


def test_a_server_deleted_after_its_move_failed_is_gone_and_not_tried_again(store, move_machines):
    # GIVEN a drain with a retry left whose server's move failed and rolled back, and whose owner
    # then deleted the server before RecordFailure ran
    drain, server, slot, _move = _prepared_move()
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server).values(task_state=None))
        session.execute(update(Migration).where(Migration.uuid == slot["migration_uuid"]).values(status="error"))
    _deleted(server)
    error = {"Error": "Ferry.HostOpTimeout", "Cause": "PrepResizeAtDest timed out"}

    # WHEN RecordFailure runs (twice: a step may run again)
    outcome = drains.record_failure(drain, server, slot, error)
    again = drains.record_failure(drain, server, slot, error)

    # THEN the server is gone, with the move's error, and not tried again
    assert outcome == again == {
        "retry": False, "confirm": False, "state": "gone",
        "error": "The server no longer exists (deleted during the drain): PrepResizeAtDest timed out"}
    row = _servers(drain)[server]
    assert (row.state, row.dest_host, row.attempts) == ("gone", None, 1)
    assert drains.acquire_slot(drain, server).action == "stop"


def test_a_drain_whose_only_other_servers_moved_completes_with_the_deleted_one_counted_gone(store, bus):
    # GIVEN a running drain of two servers: one moves, the other is deleted before its turn
    drain, moved, deleted = _started_with_two()
    assert drains.acquire_slot(drain, moved).action == "move"
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == moved).values(host="dest", node="dest"))
    drains.record_moved(drain, moved, confirmed=True)
    _deleted(deleted)
    assert drains.acquire_slot(drain, deleted).action == "stop"

    # WHEN the drain finishes
    report = drains.finish(drain)

    # THEN it completed, counting the deleted server gone and naming it so
    assert report["status"] == "completed"
    assert report["message"] == "All 2 servers left: 1 moved, 1 deleted during the drain."
    assert report["counts"] == {"total": 2, "done": 1, "failed": 0, "in_progress": 0, "left": 0, "cancelled": 0,
                                "unplaceable": 0, "gone": 1}
    view = drains.get_view(drain)
    assert {s["id"]: s["state"] for s in view["servers"]} == {moved: "done", deleted: "gone"}
    # and its end is announced as drain.end, with the server gone in the payload
    end = bus()[-1]
    assert end["detail-type"] == "drain.end"
    assert end["detail"]["payload"]["counts"]["gone"] == 1
    assert {s["id"]: s["state"] for s in end["detail"]["payload"]["servers"]}[deleted] == "gone"


def test_a_server_deleted_while_its_iteration_could_not_record_its_move_is_settled_gone(store):
    # GIVEN a server whose move slot was taken, deleted by its owner, and whose iteration's
    # bookkeeping then failed (SettleServer runs in place of RecordFailure)
    drain, deleted, other = _started_with_two()
    assert drains.acquire_slot(drain, deleted).action == "move"
    _deleted(deleted)
    error = {"Error": "OperationalError", "Cause": json.dumps({"errorMessage": "could not connect to server"})}

    # WHEN the iteration settles it (twice: a step may run again)
    settled = drains.settle_server(drain, deleted, error)
    again = drains.settle_server(drain, deleted, error)

    # THEN it is gone, not failed, and its slot is free
    assert settled == again == {"state": "gone", "error": drains.GONE_MESSAGE}
    assert drains.acquire_slot(drain, other).action == "move"


@pytest.mark.parametrize("left", ["moving", "pending"])
def test_a_server_the_map_left_unsettled_and_its_owner_deleted_is_gone_when_the_drain_finishes(store, bus, left):
    # GIVEN a drain whose one server moved and whose other, left moving or pending by the Map,
    # was deleted meanwhile
    drain, moved, deleted = _started_with_two()
    assert drains.acquire_slot(drain, moved).action == "move"
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == moved).values(host="dest", node="dest"))
    drains.record_moved(drain, moved, confirmed=True)
    if left == "moving":
        assert drains.acquire_slot(drain, deleted).action == "move"
    _deleted(deleted)

    # WHEN the drain finishes
    report = drains.finish(drain)

    # THEN the deleted server is gone and the drain completed: it left the host
    assert report["status"] == "completed"
    assert report["message"] == "All 2 servers left: 1 moved, 1 deleted during the drain."
    row = _servers(drain)[deleted]
    assert (row.state, row.error) == ("gone", drains.GONE_MESSAGE)
    assert bus()[-1]["detail-type"] == "drain.end"


def test_a_drain_with_a_deleted_server_and_a_failed_one_fails_naming_both(store):
    drain, failed, deleted = _started_with_two()
    with api_session() as session:
        session.execute(update(DrainServer).where(DrainServer.instance_uuid == failed)
                        .values(state="failed", error="boom"))
    _deleted(deleted)
    assert drains.acquire_slot(drain, deleted).action == "stop"

    report = drains.finish(drain)

    assert report["status"] == "failed"
    assert report["message"] == "0 of 2 servers moved; 1 failed, 0 could not be placed, 1 deleted during the drain."


@pytest.mark.parametrize("kept", [False, True])
def test_an_unplaceable_server_deleted_during_a_drain_that_moved_what_fits_is_gone_not_left_behind(store, bus, kept):
    # GIVEN a drain that moves what fits, whose one server moved and whose server in ERROR (not
    # placed) was deleted by its owner meanwhile (and, when ``kept``, another in ERROR still there)
    source = add_compute("source")
    add_compute("dest")
    moved, deleted = _server_on("source", source), _server_on("source", source)
    broken = [deleted] + ([_server_on("source", source)] if kept else [])
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid.in_(broken)).values(vm_state="error"))
    drain = _record({"host": "source", "move_what_fits": True})
    assert drains.start(drain)["servers"] == [moved]
    assert drains.acquire_slot(drain, moved).action == "move"
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == moved).values(host="dest", node="dest"))
    drains.record_moved(drain, moved, confirmed=True)
    _deleted(deleted)

    # WHEN the drain finishes
    report = drains.finish(drain)

    # THEN the deleted one left the host: gone, and not counted as a server that could not be placed
    row = _servers(drain)[deleted]
    assert row.state == "gone" and row.error.startswith(drains.GONE_MESSAGE)
    assert "no place for it" in row.error and "error" in row.error
    if kept:
        assert report["status"] == "failed"
        assert report["message"] == ("1 of 3 servers moved; 0 failed, 1 could not be placed, 1 deleted during "
                                     "the drain.")
    else:
        assert report["status"] == "completed"
        assert report["message"] == "All 2 servers left: 1 moved, 1 deleted during the drain."
        assert bus()[-1]["detail-type"] == "drain.end"


# --- servers their owner moved, or kept busy, before their turn ----------------------------------------


def _moved_by_its_owner(server: str, host: str, migration: str = "confirmed") -> str:
    """The server's records once its owner migrated it off host ``source`` to ``host`` (the
    scheduler took a host the drain does not drain): confirmed, or, with ``migration``
    ``finished``, waiting there in VERIFY_RESIZE for the owner's confirm. Its migration's id."""
    migration_uuid = str(uuid.uuid4())
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server).values(
            host=host, node=host, vm_state="resized" if migration == "finished" else "active", task_state=None))
        session.add(Migration(uuid=migration_uuid, instance_uuid=server, source_compute="source",
                              source_node="source", dest_compute=host, dest_node=host, status=migration,
                              migration_type="migration"))
    return migration_uuid


def _started_with_two_and_a_third_host(**options) -> tuple[str, str, str, str, str]:
    """:func:`_started_with_two` with hosts ``dest`` and ``other`` to go to: ``(drain, first, second,
    the host planned for second, the other one)``."""
    source = add_compute("source")
    add_compute("dest")
    add_compute("other")
    first, second = _server_on("source", source), _server_on("source", source)
    drain = _record({"host": "source", **options})
    drains.start(drain)
    planned = _servers(drain)[second].planned_host
    return drain, first, second, planned, ({"dest", "other"} - {planned}).pop()


def _moved_by_the_drain(drain: str, server: str) -> None:
    assert drains.acquire_slot(drain, server).action == "move"
    planned = _servers(drain)[server].planned_host
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server).values(host=planned, node=planned))
    drains.record_moved(drain, server, confirmed=True)


@pytest.mark.parametrize("to", ["another host", "the planned host"])
def test_a_server_its_owner_moved_off_the_host_before_its_turn_is_done_and_not_moved_again(store, to):
    # GIVEN a running drain of two servers: one moved by the drain, the other migrated by its
    # owner meanwhile to a host the drain does not drain
    drain, moved, server, planned, other = _started_with_two_and_a_third_host()
    _moved_by_the_drain(drain, moved)
    host = planned if to == "the planned host" else other
    owners = _moved_by_its_owner(server, host)

    # WHEN its turn comes (twice: a step may run again)
    first = drains.acquire_slot(drain, server)
    again = drains.acquire_slot(drain, server)

    # THEN its iteration stops: no move is accepted, and the server is done where its owner put it
    assert first.action == again.action == "stop"
    row = _servers(drain)[server]
    assert (row.state, row.dest_host, row.error, row.attempts) == ("done", host, None, 0)
    assert _migrations_of(server) == [owners]
    # and the drain completes: its host holds nothing
    report = drains.finish(drain)
    assert (report["status"], report["message"]) == ("completed", "All 2 servers moved.")


@pytest.mark.parametrize("to", ["another host", "the planned host"])
@pytest.mark.parametrize("when", ["before PrepareMove", "while PrepareMove accepts the move"])
def test_a_server_its_owner_moved_off_the_host_once_its_slot_was_taken_is_not_moved_again(
        store, move_machines, monkeypatch, to, when):
    # GIVEN AcquireSlot handed out the server's move, and its owner's migration to a host the
    # drain does not drain ended before PrepareMove ran, or while it ran (after its look, before
    # the move's acceptance swapped the server's task)
    drain, moved, server, planned, other = _started_with_two_and_a_third_host(retries=1)
    _moved_by_the_drain(drain, moved)
    slot = drains.acquire_slot(drain, server).to_dict()
    assert slot["action"] == "move"
    host = planned if to == "the planned host" else other
    if when == "before PrepareMove":
        _moved_by_its_owner(server, host)
    else:
        locate = drains.compute_api.locate

        def moved_meanwhile(*args, **kwargs):
            _moved_by_its_owner(server, host)
            return locate(*args, **kwargs)

        monkeypatch.setattr(drains.compute_api, "locate", moved_meanwhile)

    # WHEN PrepareMove runs: it leaves no move of the drain accepted
    with pytest.raises(errors.DrainInvalidState, match="left the drained hosts"):
        drains.prepare_move(drain, server, slot)
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == server)).one()
        ours = session.scalars(select(Migration.status).where(Migration.uuid == slot["migration_uuid"])).first()
    assert (instance.host, instance.task_state) == (host, None)
    # never accepted (refused as a move to the host it is on), or accepted from there and undone
    assert ours == ("error" if (when, to) == ("while PrepareMove accepts the move", "another host") else None)

    # THEN the server is done where its owner put it, and RecordFailure, where the workflow goes,
    # finds it so: no other try
    error = {"Error": "Ferry.DrainInvalidState", "Cause": "left"}
    assert drains.record_failure(drain, server, slot, error) == {"retry": False, "confirm": False, "state": "done",
                                                                  "error": None}
    row = _servers(drain)[server]
    assert (row.state, row.dest_host) == ("done", host)
    report = drains.finish(drain)
    assert (report["status"], report["message"]) == ("completed", "All 2 servers moved.")


def test_a_server_whose_owners_move_off_the_host_awaits_its_confirm_is_not_settled_as_left(store):
    # GIVEN a server its owner migrated off the drained host, waiting in VERIFY_RESIZE (a revert
    # would bring it back)
    drain, _moved, server, _planned, other = _started_with_two_and_a_third_host()
    _moved_by_its_owner(server, other, migration="finished")

    # WHEN its turn comes THEN it is not taken for a server that left
    assert drains.acquire_slot(drain, server).action == "move"
    assert _servers(drain)[server].state == "moving"


def _busy(server: str, task_state: str | None, vm_state: str = "active") -> None:
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server)
                        .values(task_state=task_state, vm_state=vm_state))


def _refused_while_busy(drain: str, server: str) -> tuple[dict, dict]:
    """The server's move handed out and refused by PrepareMove, its owner stopping it: ``(slot, error)``."""
    slot = drains.acquire_slot(drain, server).to_dict()
    _busy(server, "powering-off")
    with pytest.raises(errors.InstanceInvalidState) as refused:
        drains.prepare_move(drain, server, slot)
    return slot, {"Error": "Ferry.InstanceInvalidState", "Cause": refused.value.message}


def test_a_server_its_owner_was_stopping_when_its_turn_came_is_tried_again_after_a_wait(store, move_machines):
    # GIVEN a drain with two retries whose server's move was refused: its owner was stopping it
    drain, server, _other = _started_with_two(retries=2)
    slot, error = _refused_while_busy(drain, server)
    assert _migrations_of(server) == []

    # WHEN RecordFailure runs at once, the stop still under way
    outcome = drains.record_failure(drain, server, slot, error)

    # THEN the server is to be tried again, not failed
    assert outcome == {"retry": True, "confirm": False, "state": "pending", "error": error["Cause"]}
    # and its next look waits while the stop is under way
    looked = drain_steps.acquire_slot({"drain_uuid": drain, "instance_uuid": server, "poll_seconds": 10,
                                       "iteration_started_at": dt.datetime.now(dt.UTC).isoformat()})
    assert (looked["action"], looked["wait_seconds"]) == ("wait", 10)
    row = _servers(drain)[server]
    assert (row.state, row.error) == ("pending", "The server was busy (powering-off) when its next try came.")
    assert _migrations_of(server) == []
    # and a look that finds it busy still, after that wait, uses up a try and waits with one left
    assert drains.acquire_slot(drain, server).action == "wait"
    assert _servers(drain)[server].attempts == 2
    # and once the stop has finished, the last try moves it
    _busy(server, None, "stopped")
    retry = drains.acquire_slot(drain, server).to_dict()
    assert (retry["action"], retry["attempt"]) == ("move", 3)
    assert drains.prepare_move(drain, server, retry)["input"]["requested_host"] == "dest"
    assert _move_records(server, retry["migration_uuid"]) == ("resize_prep", "pre-migrating")


@pytest.mark.parametrize("retries", [0, 1])
def test_a_server_still_busy_once_its_tries_are_used_up_fails(store, move_machines, retries):
    # GIVEN a server whose move was refused, its owner stopping it, and a stop that does not end
    drain, server, _other = _started_with_two(retries=retries)
    slot, error = _refused_while_busy(drain, server)

    # WHEN RecordFailure runs, and the server's iteration looks again while it is still busy
    outcome = drains.record_failure(drain, server, slot, error)
    if retries:
        assert outcome["retry"] is True
        assert drains.acquire_slot(drain, server).action == "wait"  # the look right after the refusal: free
        assert drains.acquire_slot(drain, server).action == "stop"  # still busy: the try left is used up
    else:  # no try left: failed at once, as before
        assert outcome["retry"] is False

    # THEN it is failed, with what kept it from moving, and no move was accepted
    row = _servers(drain)[server]
    assert row.state == "failed"
    assert row.error == ("The server was busy (powering-off) when its next try came." if retries else error["Cause"])
    assert _migrations_of(server) == []


# --- callbacks: their secret and where they may go --------------------------------------------------


@pytest.fixture
def api_cloud(store, monkeypatch, tmp_path):
    """The API function over moto (see test_api_support.mocked_cloud), with host ``host1`` in cell1."""
    for cloud in mocked_cloud(monkeypatch, tmp_path):
        add_host("host1")
        setup.map_host("host1", "cell1")
        yield cloud


def _drain_uuids() -> list[str]:
    with api_session() as session:
        return list(session.scalars(select(Drain.uuid)))


def test_a_drain_naming_a_callback_url_is_refused_while_callbacks_are_not_configured(store, monkeypatch):
    # GIVEN a stack whose DrainCallbackSecret is empty (its webhook's secret set)
    monkeypatch.setenv("FERRY_CALLBACK_SECRET", "")
    config.reset()
    add_compute("source")

    # WHEN a drain names a callback URL
    with pytest.raises(errors.BadRequest, match="Drain callbacks are not configured") as refused:
        drains.record_drain(ADMIN, {"host": "source", "callback_url": "https://ops.example.com/ferry?token=s3cret"},
                            origin="api")

    # THEN it is refused and recorded nowhere, never repeating the URL; a drain without one is taken
    assert "DrainCallbackSecret" in refused.value.message and "s3cret" not in refused.value.message
    assert _drain_uuids() == []
    assert _record({"host": "source"})


def test_the_api_answers_400_to_a_callback_url_while_callbacks_are_not_configured(api_cloud, monkeypatch):
    monkeypatch.setenv("FERRY_CALLBACK_SECRET", "")
    config.reset()

    response = call("POST", "/v2.1/ferry/drains", caller=API_ADMIN,
                    body={"drain": {"host": "host1", "callback_url": "https://ops.example.com/ferry"}})

    assert response.status == 400, response.body
    assert "Drain callbacks are not configured" in response.body["badRequest"]["message"]
    assert _drain_uuids() == []


CREDENTIAL_URLS = ["https://hook:pa55@ops.example.com/ferry", "https://hook@ops.example.com:8443/ferry?t=1",
                   "https://ops.example.com@elsewhere.example/ferry"]


@pytest.mark.parametrize("url", CREDENTIAL_URLS)
def test_a_callback_url_with_credentials_is_refused_when_the_drain_is_asked(store, url):
    add_compute("source")

    with pytest.raises(errors.BadRequest, match="at callback_url: must not carry a user name or password") as refused:
        drains.record_drain(ADMIN, {"host": "source", "callback_url": url}, origin="api")

    assert "pa55" not in refused.value.message and "hook" not in refused.value.message
    assert _drain_uuids() == []
    # a query may carry a token, and an @ in it is no credential
    assert _record({"host": "source", "callback_url": "https://ops.example.com/ferry?to=ops@example.com"})


def test_the_api_answers_400_to_a_callback_url_with_credentials(api_cloud):
    response = call("POST", "/v2.1/ferry/drains", caller=API_ADMIN,
                    body={"drain": {"host": "host1", "callback_url": CREDENTIAL_URLS[0]}})

    assert response.status == 400, response.body
    assert "must not carry a user name or password" in response.body["badRequest"]["message"]
    assert "pa55" not in response.body["badRequest"]["message"]
    assert _drain_uuids() == []


@pytest.mark.parametrize("allow_private", [False, True])
def test_callbacks_are_signed_with_the_callback_secret_never_the_webhook_secret(store, bus, monkeypatch,
                                                                               allow_private):
    # GIVEN a stack with both secrets, callbacks to private addresses allowed or not
    monkeypatch.setenv("FERRY_CALLBACK_ALLOW_PRIVATE", str(allow_private).lower())
    config.reset()
    posted: list[tuple[str, str, bool]] = []

    def post(_url, document, secret, delivery_id=None, allow_private=False):
        posted.append((document["event_type"], secret, allow_private))
        return True

    monkeypatch.setattr(drains.signing, "post_callback", post)
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source", "callback_url": "https://ops.example.com/ferry"})

    # WHEN it starts and ends
    drains.start(drain)
    drains.finish(drain)

    # THEN each callback is signed with the callback secret, and goes where the stack allows
    assert posted == [("drain.start", CALLBACK_SECRET, allow_private), ("drain.error", CALLBACK_SECRET, allow_private)]


def test_a_callback_to_a_loopback_receiver_is_not_posted_unless_the_stack_allows_private_addresses(
        store, bus, monkeypatch):
    # GIVEN a drain whose callback receiver listens on 127.0.0.1
    url, stop = trickling_receiver(0.0, "/ferry")
    warned: list[tuple[str, dict]] = []
    warning = drains.signing.logger.warning

    def spy(message, *args, **kwargs):
        warned.append((message, kwargs.get("extra") or {}))
        warning(message, *args, **kwargs)

    monkeypatch.setattr(drains.signing.logger, "warning", spy)
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain = _record({"host": "source", "callback_url": url})

    # WHEN it starts (callbacks to globally routable addresses only, the default)
    drains.start(drain)
    stop()

    # THEN its drain.start is not posted: the address is refused before any connection
    [extra] = [extra for message, extra in warned if message == "callback not delivered"]
    assert extra["error"] == "AddressRefused" and extra["refused_addresses"] == ["127.0.0.1 is loopback"]


# --- an idempotency key stands for one request -------------------------------------------------------


@pytest.mark.parametrize("other", [{"host": "other"}, {"host": "source", "reason": "another"},
                                   {"host": "source", "dry_run": True}, {"host": "source", "max_concurrency": 2},
                                   {"host": "source", "callback_url": "https://ops.example.com/ferry"}])
def test_an_idempotency_key_used_again_with_another_request_is_refused(store, other):
    add_compute("source")
    add_compute("other")
    first = _record({"host": "source"}, idempotency_key="key-1")

    with pytest.raises(errors.DrainInvalidState, match="'key-1' was used for a different drain request") as refused:
        drains.record_drain(ADMIN, other, origin="api", idempotency_key="key-1")

    assert refused.value.http_status == 409 and first in refused.value.message
    assert _drain_uuids() == [first]


def test_an_idempotency_key_used_again_with_the_same_request_however_written_names_the_first_drain(store):
    add_compute("source")
    first = _record({"host": "source", "reason": "retire"}, idempotency_key="key-1")

    again = drains.record_drain(ADMIN, {"hosts": ["source"], "reason": "retire", "confirm": True, "max_concurrency": 5,
                                        "dry_run": False, "callback_url": None},
                                origin="api", idempotency_key="key-1")

    assert again == (first, False)


def test_a_drain_recorded_before_request_digests_is_named_by_its_key_whatever_the_request(store):
    add_compute("source")
    first = _record({"host": "source"}, idempotency_key="key-1")
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == first).values(request_digest=None))

    assert drains.record_drain(ADMIN, {"host": "other"}, origin="api", idempotency_key="key-1") == (first, False)


# --- show and list notice a drain whose workflow ended ------------------------------------------------


def _quiet_for(drain: str, minutes: float) -> None:
    """Record the drain as last changed ``minutes`` ago."""
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == drain)
                        .values(updated_at=drains.utcnow() - dt.timedelta(minutes=minutes)))


def _described(monkeypatch) -> list[str]:
    """The names of the drain executions described from now on."""
    names: list[str] = []
    describe = drains.workflows.describe_execution

    def spy(arn, name):
        names.append(name)
        return describe(arn, name)

    monkeypatch.setattr(drains.workflows, "describe_execution", spy)
    return names


def _stopped_drain(sfn, arn: str, host: str) -> str:
    add_compute(host)
    drain, execution = _running_drain(sfn, arn, host)
    sfn.stop_execution(executionArn=execution)  # stopped by hand, before FinishDrain
    return drain


def test_showing_a_quiet_drain_whose_workflow_ended_shows_it_finished(store, drain_machine):
    # GIVEN a running drain whose execution was stopped by hand, unchanged since for 10 minutes
    sfn, arn = drain_machine
    source = add_compute("source")
    add_compute("dest")
    _server_on("source", source)
    drain, execution = _running_drain(sfn, arn, "source")
    sfn.stop_execution(executionArn=execution)
    _quiet_for(drain, 10)

    # WHEN it is shown
    view = drains.show(drain)

    # THEN it shows the end its workflow met, as an action on it would have found it
    assert view["status"] == "failed" and f"drain-{drain} ended aborted" in view["message"]
    assert view["servers"][0]["state"] == "cancelled"


def test_listing_drains_finishes_the_quiet_ones_whose_workflow_ended_one_at_a_time(store, drain_machine,
                                                                                   monkeypatch):
    # GIVEN two drains whose executions were stopped, quiet for 10 and 20 minutes
    sfn, arn = drain_machine
    stopped = [_stopped_drain(sfn, arn, f"host-{minutes}") for minutes in (10, 20)]
    for drain, minutes in zip(stopped, (10, 20), strict=True):
        _quiet_for(drain, minutes)
    described = _described(monkeypatch)

    # WHEN they are listed, and listed again
    first = {view["id"]: view["status"] for view in drains.list_views()}
    asked_first = list(described)
    second = {view["id"]: view["status"] for view in drains.list_views()}

    # THEN each list asks about MAX_LOOKS_PER_LIST of them, quiet the longest first
    assert drains.MAX_LOOKS_PER_LIST == 1
    assert asked_first == [f"drain-{stopped[1]}"]
    assert [first[drain] for drain in stopped] == ["planning", "failed"]
    assert described[1:] == [f"drain-{stopped[0]}"]
    assert set(second.values()) == {"failed"}


def test_a_drain_changed_lately_or_whose_workflow_runs_is_shown_as_recorded(store, drain_machine, monkeypatch):
    # GIVEN a drain stopped a moment ago (its record changed lately), and one whose workflow runs, quiet for long
    sfn, arn = drain_machine
    recent = _stopped_drain(sfn, arn, "recent")
    add_compute("runs")
    running, _execution = _running_drain(sfn, arn, "runs")
    _quiet_for(running, 60)
    described = _described(monkeypatch)

    # WHEN they are shown and listed
    views = [drains.show(recent), drains.show(running), *drains.list_views()]

    # THEN only the quiet one's workflow is asked about (once for each look), and nothing changes
    assert described == [f"drain-{running}", f"drain-{running}"]
    assert {view["status"] for view in views} == {"planning"}


@pytest.mark.parametrize("failure", ["describe", "finish"])
def test_a_failed_look_at_a_quiet_drains_workflow_never_fails_show_or_list(store, drain_machine, monkeypatch,
                                                                            failure):
    # GIVEN a quiet drain whose execution was stopped, and Step Functions (or the finish) failing
    sfn, arn = drain_machine
    drain = _stopped_drain(sfn, arn, "source")
    _quiet_for(drain, 10)

    tried: list[str] = []

    def broken(*_args, **_kwargs):
        tried.append(failure)
        raise RuntimeError("ThrottlingException: Rate exceeded")

    if failure == "describe":
        monkeypatch.setattr(drains.workflows, "describe_execution", broken)
    else:
        monkeypatch.setattr(drains, "finish", broken)

    # WHEN it is shown and listed
    shown = drains.show(drain)
    [listed] = drains.list_views()

    # THEN each looked, and it is shown as recorded
    assert tried == [failure, failure]
    assert shown["status"] == listed["status"] == "planning"
