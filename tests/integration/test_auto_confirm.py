"""Automatic confirmation after ``resize_confirm_window`` (SQLite and PostgreSQL), and the local
stack playing the template's schedule for it."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid as uuidlib
from typing import Any

import pytest
from sqlalchemy import select
from verify_resize_helpers import (
    CELL,
    ROOT,
    SOURCE,
    host_down,
    instance_row,
    make_resized,
    migration_row,
    mocked_aws,
    set_instance,
    set_migration,
)

from ferry import config, workflows
from ferry.compute import migration_states, moves, states
from ferry.local import template
from ferry.local.pollers import Pollers, ScheduleRunner
from ferry.local.runtime import FunctionRunner
from ferry.store.api_models import utcnow
from ferry.store.cell_models import Migration
from ferry.store.db import cell_session
from ferry.workflows import auto_confirm

WINDOW = 600
LONG_AGO = utcnow() - dt.timedelta(seconds=2 * WINDOW)


class Started:
    """The confirm executions the automatic confirm started (Step Functions is not called)."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []

    def __call__(self, arn: str, name: str, payload: dict[str, Any]) -> str:
        self.payloads.append({**payload, "execution_name": name})
        return f"{arn}:{name}"

    def instances(self) -> list[str]:
        return [p["instance_uuid"] for p in self.payloads]


@pytest.fixture
def started(store, monkeypatch):
    with mocked_aws(monkeypatch):
        monkeypatch.setenv("FERRY_RESIZE_CONFIRM_WINDOW", str(WINDOW))
        config.reset()
        recorder = Started()
        monkeypatch.setattr(workflows, "start_execution", recorder)
        yield recorder


def expired(**instance: Any):
    """A server in VERIFY_RESIZE whose migration finished longer ago than the window."""
    resized = make_resized()
    set_migration(resized.migration_uuid, updated_at=LONG_AGO)
    if instance:
        set_instance(resized.instance_uuid, **instance)
    return resized


def test_only_migrations_older_than_the_window_are_confirmed(started):
    old = expired()
    recent = make_resized()

    result = auto_confirm.run()

    assert result == {"window": WINDOW, "confirmed": 1, "skipped": 0, "errored": 0, "failed": 0}
    assert started.instances() == [old.instance_uuid]
    assert started.payloads[0]["request_id"].startswith(f"req-auto-confirm-{old.migration_uuid}-")
    assert migration_row(old.migration_uuid).status == migration_states.CONFIRMING
    assert migration_row(recent.migration_uuid).status == migration_states.FINISHED


def test_a_confirm_that_failed_early_is_tried_again_as_a_new_request(started):
    """Its workflow put the migration back to finished; the same request id would name the closed execution."""
    old = expired()
    auto_confirm.run()
    set_migration(old.migration_uuid, status=migration_states.FINISHED, updated_at=LONG_AGO)  # RestoreVerifyResize

    assert auto_confirm.run()["confirmed"] == 1

    first, again = (payload["request_id"] for payload in started.payloads)
    assert first != again
    assert migration_row(old.migration_uuid).status == migration_states.CONFIRMING


def test_a_window_of_zero_turns_it_off(started, monkeypatch):
    expired()
    monkeypatch.setenv("FERRY_RESIZE_CONFIRM_WINDOW", "0")
    config.reset()

    assert auto_confirm.run()["confirmed"] == 0
    assert started.payloads == []


def test_nova_skip_rules(started):
    deleted = expired(deleted=True)
    busy = expired(task_state=states.RESIZE_REVERTING)
    not_resized = expired(vm_state=states.ACTIVE)
    ready = expired()

    result = auto_confirm.run()

    assert (result["confirmed"], result["skipped"], result["errored"]) == (1, 2, 1)
    assert started.instances() == [ready.instance_uuid]
    assert migration_row(deleted.migration_uuid).status == migration_states.FINISHED
    assert migration_row(busy.migration_uuid).status == migration_states.FINISHED
    assert migration_row(not_resized.migration_uuid).status == migration_states.ERROR
    assert instance_row(not_resized.instance_uuid).vm_state == states.ACTIVE


def test_a_migration_whose_source_host_is_down_is_left_for_a_later_run(started):
    # GIVEN an expired resize whose source host sends no heartbeat
    resized = expired()
    host_down(SOURCE)

    result = auto_confirm.run()

    # THEN nothing is started (no failed action, no fault every minute); the next run looks again
    assert (result["confirmed"], result["skipped"]) == (0, 1)
    assert started.payloads == []
    assert migration_row(resized.migration_uuid).status == migration_states.FINISHED


def test_an_expired_migration_that_is_not_the_servers_newest_is_set_to_error_and_the_newest_kept(started):
    # GIVEN a server whose expired migration was followed by a newer one, finished moments ago
    # (its state was reset and it was resized again)
    old = expired()
    newer = str(uuidlib.uuid4())
    with cell_session(CELL) as session:
        first = session.scalars(select(Migration).where(Migration.uuid == old.migration_uuid)).one()
        session.add(Migration(**{c.key: getattr(first, c.key) for c in Migration.__table__.columns
                                 if c.key not in ("id", "uuid", "created_at", "updated_at")}, uuid=newer))

    result = auto_confirm.run()

    # THEN the newer migration keeps its whole window: only the old one is settled, to error
    assert (result["confirmed"], result["errored"]) == (0, 1)
    assert started.payloads == []
    assert migration_row(old.migration_uuid).status == migration_states.ERROR
    assert migration_row(newer).status == migration_states.FINISHED


def test_one_failing_confirm_does_not_stop_the_others(started, monkeypatch):
    first, second = expired(), expired()
    real = moves.begin_confirm

    def begin_confirm(cell: str, instance_uuid: str, **kwargs: Any) -> str:
        if instance_uuid == first.instance_uuid:
            raise RuntimeError("cell database unreachable")
        return real(cell, instance_uuid, **kwargs)

    monkeypatch.setattr(moves, "begin_confirm", begin_confirm)

    result = auto_confirm.run()

    assert (result["confirmed"], result["failed"]) == (1, 1)
    assert started.instances() == [second.instance_uuid]
    assert migration_row(first.migration_uuid).status == migration_states.FINISHED


@pytest.mark.parametrize("meanwhile", ["revert", "stop"])
def test_a_server_its_owner_settled_or_changed_meanwhile_is_skipped_not_counted_failed(started, monkeypatch,
                                                                                      meanwhile):
    # GIVEN an expired resize whose owner reverts it (or whose server changes) right after the run read it
    resized = expired()
    real = moves.begin_confirm

    def owner_first(cell: str, instance_uuid: str, **kwargs: Any) -> str:
        if meanwhile == "revert":
            set_migration(resized.migration_uuid, status=migration_states.REVERTING)
            set_instance(instance_uuid, task_state=states.RESIZE_REVERTING)
        else:
            set_instance(instance_uuid, vm_state=states.ACTIVE)
        return real(cell, instance_uuid, **kwargs)

    monkeypatch.setattr(moves, "begin_confirm", owner_first)

    # WHEN the automatic confirm runs on
    result = auto_confirm.run()

    # THEN the server is left to what its owner did, counted skipped: no failure to alarm on
    assert (result["confirmed"], result["skipped"], result["failed"]) == (0, 1, 0)
    assert started.payloads == []


def test_a_migration_confirmed_meanwhile_is_not_confirmed_twice(started):
    resized = expired()
    auto_confirm.run()

    result = auto_confirm.run()

    assert result["confirmed"] == 0
    assert len(started.payloads) == 1 and migration_row(resized.migration_uuid).status == migration_states.CONFIRMING


# --- the template's schedule on the local stack ------------------------------------------------------


def auto_confirm_schedule() -> tuple[template.LocalTemplate, template.Schedule]:
    model = template.resolve(ROOT / "template.yaml")
    [schedule] = [s for s in model.schedules if s.function == "AutoConfirmFunction"]
    return model, schedule


def test_the_template_schedules_auto_confirm_every_minute_and_passes_the_window():
    model, schedule = auto_confirm_schedule()
    function = model.functions["AutoConfirmFunction"]

    assert (schedule.rate_seconds, schedule.enabled) == (60, True)
    assert function.environment["FERRY_RESIZE_CONFIRM_WINDOW"] == "0"
    overridden = template.resolve(ROOT / "template.yaml", parameters={"ResizeConfirmWindow": 5})
    assert overridden.functions["AutoConfirmFunction"].environment["FERRY_RESIZE_CONFIRM_WINDOW"] == "5"


def test_the_local_stack_runs_the_scheduled_handler_which_confirms(started):
    resized = expired()
    model, schedule = auto_confirm_schedule()
    runner = ScheduleRunner(schedule, model, FunctionRunner(model), rate_scale=1)

    runner.run_once()

    assert started.instances() == [resized.instance_uuid]


def test_the_local_stack_plays_the_schedule_at_its_scaled_rate():
    model, _ = auto_confirm_schedule()
    calls: list[Any] = []
    seen = threading.Event()

    class Recorder:
        def invoke(self, name: str, event: Any) -> Any:
            if name == model.functions["AutoConfirmFunction"].name:
                calls.append(event)
                if len(calls) >= 2:
                    seen.set()
            return type("Invocation", (), {"failed": False, "error": None})()

    pollers = Pollers(model, Recorder(), lambda service: None, rate_scale=0.001)  # type: ignore[arg-type]
    pollers.workers = [w for w in pollers.workers if isinstance(w, ScheduleRunner)]
    started_at = time.monotonic()
    pollers.start()
    try:
        assert seen.wait(10)
    finally:
        pollers.stop()
    assert time.monotonic() - started_at < 10
    assert calls[0]["detail-type"] == "Scheduled Event"
