"""Confirm, revert, delete and auto-confirm of a server moved between cells, step by step on a
real store (SQLite and PostgreSQL), and what the API shows of it meanwhile.

Each test starts from the records a cross-cell move leaves (``cross_cell_helpers``), accepts the
operation through the compute API's own code and drives the steps as the state machines do,
with what the host agents would answer.
"""

from __future__ import annotations

import datetime as dt
import uuid as uuidlib
from typing import Any

import pytest
from cross_cell_helpers import (
    CROSS_DEST,
    SOURCE_CELL,
    TARGET_CELL,
    add_target_host,
    copy_in,
    events_in,
    leftovers,
    make_cross_cell,
    mapped_cell,
    migration_in,
)
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from test_cross_cell_steps import read_cells, usage_before_each_call
from verify_resize_helpers import (
    NEW,
    NEW_USAGE,
    OLD,
    OLD_USAGE,
    PROJECT,
    SOURCE,
    USER,
    accept_delete,
    attachments,
    bindings,
    host_down,
    host_result,
    make_volume,
    mocked_aws,
    provider,
    usage,
)

from ferry import errors, placement, quotas, workflows
from ferry.auth import RequestContext
from ferry.compute import api as compute_api
from ferry.compute import migration_states, moves, states
from ferry.compute.server_filters import ServerFilters
from ferry.store.cell_models import InstanceAction, InstanceActionEvent, Migration
from ferry.store.db import cell_session
from ferry.workflows import auto_confirm, confirm_resize, cross_cell_settle, delete, revert_resize
from ferry.workflows.cross_cell_settle import (
    EVENT_CONFIRM,
    EVENT_CONFIRM_AT_SOURCE,
    EVENT_FINISH_REVERT_AT_SOURCE,
    EVENT_REVERT,
    EVENT_REVERT_AT_DEST,
)

NOTHING = {"instances": 0, "bdms": 0, "tags": 0, "actions": 0, "migrations": 0}


@pytest.fixture
def cloud(store, monkeypatch):
    with mocked_aws(monkeypatch) as tap:
        add_target_host()
        yield tap


def begin(kind: str, moved, monkeypatch) -> dict[str, Any]:
    started: list[dict[str, Any]] = []

    def start_execution(arn: str, name: str, payload: dict[str, Any]) -> str:
        started.append({**payload, "execution_name": name})
        return name

    accept = moves.begin_confirm if kind == "confirm" else moves.begin_revert
    with monkeypatch.context() as patched:
        patched.setattr(workflows, "start_execution", start_execution)
        accept(mapped_cell(moved.instance_uuid), moved.instance_uuid, request_id=f"req-{uuidlib.uuid4()}",
               user_id=USER, project_id=PROJECT)
    return started[0]


# --- confirm -------------------------------------------------------------------------------------


def test_confirm_removes_the_source_cell_copy_and_keeps_the_server_on_the_destination(cloud, monkeypatch,
                                                                                     tmp_path):
    moved = make_cross_cell(tmp_path)
    event = begin("confirm", moved, monkeypatch)
    assert event["cell"] == TARGET_CELL
    event = {**event, "move": confirm_resize.check_resize_to_confirm(event)}
    assert event["move"]["cross_cell"] == {"source_cell": SOURCE_CELL, "target_cell": TARGET_CELL}
    event["confirmed_at_source"] = host_result(SOURCE, moved.instance_uuid)

    confirm_resize.finish_confirm(event)
    confirm_resize.finish_confirm(event)  # delivered twice: the same end state

    assert leftovers(SOURCE_CELL, moved.instance_uuid) == NOTHING
    row = copy_in(TARGET_CELL, moved.instance_uuid)
    assert (row.vm_state, row.task_state, row.host, row.flavor, row.hidden) == (states.ACTIVE, None, CROSS_DEST,
                                                                                 NEW, False)
    assert mapped_cell(moved.instance_uuid) == TARGET_CELL
    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.CONFIRMED
    assert placement.get_allocations(moved.migration_uuid) == {}
    assert (usage(SOURCE), usage(CROSS_DEST)) == ({}, NEW_USAGE)
    assert bindings(moved.instance_uuid) == {CROSS_DEST: "ACTIVE"}
    assert attachments(moved.instance_uuid) == {CROSS_DEST: "attached"}
    recorded = events_in(TARGET_CELL, moved.instance_uuid)
    assert (recorded[EVENT_CONFIRM], recorded[EVENT_CONFIRM_AT_SOURCE]) == ("Success", "Success")
    assert "compute_confirm_resize" not in recorded


def test_confirm_that_fails_at_the_source_keeps_both_copies_and_says_where_they_are(cloud, monkeypatch, tmp_path):
    moved = make_cross_cell(tmp_path)
    event = begin("confirm", moved, monkeypatch)
    event = {**event, "move": confirm_resize.check_resize_to_confirm(event),
             "error": {"Error": "Ferry.HypervisorError", "Cause": "disk busy"}}

    confirm_resize.fail_confirm(event)
    confirm_resize.fail_confirm(event)

    row = copy_in(TARGET_CELL, moved.instance_uuid)
    assert (row.vm_state, row.task_state, row.hidden) == (states.ACTIVE, None, False)
    assert copy_in(SOURCE_CELL, moved.instance_uuid).hidden is True
    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.ERROR
    assert placement.get_allocations(moved.migration_uuid) != {}
    assert events_in(TARGET_CELL, moved.instance_uuid)[EVENT_CONFIRM] == "Error"


# --- revert --------------------------------------------------------------------------------------


def _revert_until_flipped(moved, monkeypatch) -> dict[str, Any]:
    event = begin("revert", moved, monkeypatch)
    event = {**event, "move": revert_resize.check_resize_to_revert(event)}
    assert event["move"]["cross_cell"] == {"source_cell": SOURCE_CELL, "target_cell": TARGET_CELL}
    return event


def _flipped_then_failed(moved, monkeypatch, error: dict[str, str]) -> dict[str, Any]:
    """A revert flipped to the source cell whose next step failed with ``error``, as its Catch sees it."""
    event = _revert_until_flipped(moved, monkeypatch)
    event["flipped"] = cross_cell_settle.flip_to_source_cell(event)
    return {**event, "error": error}


def test_revert_brings_the_server_back_to_its_source_cell_and_host(cloud, monkeypatch, tmp_path):
    moved = make_cross_cell(tmp_path)
    extra_volume = make_volume(tmp_path)
    with cell_session(TARGET_CELL) as session:  # a volume attached while resized
        from ferry.store.cell_models import BlockDeviceMapping

        session.add(BlockDeviceMapping(instance_uuid=moved.instance_uuid, source_type="volume",
                                       destination_type="volume", device_name="vde", volume_id=extra_volume))
    event = _revert_until_flipped(moved, monkeypatch)

    event["flipped"] = cross_cell_settle.flip_to_source_cell(event)
    assert cross_cell_settle.flip_to_source_cell(event) == event["flipped"]  # twice: the same
    assert mapped_cell(moved.instance_uuid) == SOURCE_CELL
    assert (copy_in(SOURCE_CELL, moved.instance_uuid).hidden, copy_in(TARGET_CELL, moved.instance_uuid).hidden) \
        == (False, True)
    assert migration_in(SOURCE_CELL, moved.migration_uuid).status == migration_states.REVERTING

    event["reverted_at_dest"] = host_result(CROSS_DEST, moved.instance_uuid)
    event["restore"] = revert_resize.revert_resources_to_source(event)
    assert revert_resize.revert_resources_to_source(event) == event["restore"]
    args = event["restore"]["finish_args"]
    assert args["power_on"] is True and args["flavor"]["flavorid"] == OLD["flavorid"]
    assert {v["volume_id"] for v in args["volumes"]} == {moved.volume_id, extra_volume}
    event["restored"] = host_result(SOURCE, moved.instance_uuid, states.RUNNING)
    revert_resize.finish_revert(event)
    revert_resize.finish_revert(event)

    assert leftovers(TARGET_CELL, moved.instance_uuid) == NOTHING
    assert mapped_cell(moved.instance_uuid) == SOURCE_CELL
    row = copy_in(SOURCE_CELL, moved.instance_uuid)
    assert (row.vm_state, row.task_state, row.host, row.flavor, row.hidden) == (states.ACTIVE, None, SOURCE, OLD,
                                                                                 False)
    assert (row.old_flavor, row.new_flavor, row.old_vm_state) == (None, None, None)
    assert migration_in(SOURCE_CELL, moved.migration_uuid).status == migration_states.REVERTED
    assert leftovers(SOURCE_CELL, moved.instance_uuid)["bdms"] == 2
    assert placement.get_allocations(moved.migration_uuid) == {}
    assert (usage(SOURCE), usage(CROSS_DEST)) == (OLD_USAGE, {})
    assert bindings(moved.instance_uuid) == {SOURCE: "ACTIVE"}
    assert attachments(moved.instance_uuid) == {SOURCE: "attached"}  # both volumes, on the source only
    recorded = events_in(SOURCE_CELL, moved.instance_uuid)
    assert [recorded[e] for e in (EVENT_REVERT, EVENT_REVERT_AT_DEST, EVENT_FINISH_REVERT_AT_SOURCE)] \
        == ["Success"] * 3
    assert recorded["conductor_resize_instance"] == "Success"  # the move's own action came back too


def test_revert_of_a_stopped_server_keeps_it_stopped(cloud, monkeypatch, tmp_path):
    moved = make_cross_cell(tmp_path, old_vm_state=states.STOPPED)
    event = _revert_until_flipped(moved, monkeypatch)
    event["flipped"] = cross_cell_settle.flip_to_source_cell(event)
    event["reverted_at_dest"] = host_result(CROSS_DEST, moved.instance_uuid)
    event["restore"] = revert_resize.revert_resources_to_source(event)
    assert event["restore"]["finish_args"]["power_on"] is False
    event["restored"] = host_result(SOURCE, moved.instance_uuid, states.SHUTDOWN)
    revert_resize.finish_revert(event)

    assert copy_in(SOURCE_CELL, moved.instance_uuid).vm_state == states.STOPPED


def _flip_failing_before_the_mapping(event: dict, monkeypatch) -> None:
    """Run FlipToSourceCell with the API database failing when the mapping is switched (half way)."""
    with monkeypatch.context() as patched:
        def broken(instance_uuid: str, cell: str) -> None:
            raise RuntimeError("API database unreachable")

        patched.setattr(cross_cell_settle, "_point_mapping_at", broken)
        with pytest.raises(RuntimeError):
            cross_cell_settle.flip_to_source_cell(event)


def test_flip_that_fails_half_way_is_undone_and_the_server_stays_in_verify_resize(cloud, monkeypatch, tmp_path):
    moved = make_cross_cell(tmp_path)
    event = _revert_until_flipped(moved, monkeypatch)
    _flip_failing_before_the_mapping(event, monkeypatch)
    assert copy_in(SOURCE_CELL, moved.instance_uuid).hidden is False  # half way: both visible

    event["error"] = {"Error": "RuntimeError", "Cause": "API database unreachable"}
    confirm_resize.restore_verify_resize(event)
    confirm_resize.restore_verify_resize(event)

    assert mapped_cell(moved.instance_uuid) == TARGET_CELL
    target, source = copy_in(TARGET_CELL, moved.instance_uuid), copy_in(SOURCE_CELL, moved.instance_uuid)
    assert (target.hidden, target.vm_state, target.task_state, target.host) == (False, states.RESIZED, None,
                                                                                 CROSS_DEST)
    assert (source.hidden, source.task_state) == (True, None)
    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.FINISHED
    assert migration_in(SOURCE_CELL, moved.migration_uuid).status == migration_states.FINISHED
    assert (usage(SOURCE), usage(CROSS_DEST)) == (OLD_USAGE, NEW_USAGE)
    assert events_in(TARGET_CELL, moved.instance_uuid)[EVENT_REVERT] == "Error"
    begin("revert", moved, monkeypatch)  # and it can be reverted again


# The server in VERIFY_RESIZE (or reverting) counts the larger of its flavors, once.
COUNTED_ONCE = {"instances": 1, "cores": NEW["vcpus"], "ram": NEW["memory_mb"]}


@pytest.mark.parametrize("order", ["oldest first", "newest first"])
def test_the_flip_back_to_the_source_cell_counts_the_server_once_at_every_moment(cloud, monkeypatch, tmp_path,
                                                                                  order):
    # GIVEN a revert about to make the source cell's copy the server again; usage read in either cell order
    moved = make_cross_cell(tmp_path)
    event = _revert_until_flipped(moved, monkeypatch)
    read_cells(monkeypatch, order)
    seen = usage_before_each_call(monkeypatch, PROJECT, cross_cell_settle, "_set_hidden", "_point_mapping_at")

    # WHEN FlipToSourceCell shows the source copy, switches the mapping and hides the target copy
    cross_cell_settle.flip_to_source_cell(event)
    seen.append(quotas.usage(PROJECT))

    # THEN between every two writes the project uses one server
    assert seen == [COUNTED_ONCE] * 4
    assert mapped_cell(moved.instance_uuid) == SOURCE_CELL


def test_a_flip_undone_half_way_counts_the_server_once_at_every_moment(cloud, monkeypatch, tmp_path):
    # GIVEN a FlipToSourceCell that showed the source copy and failed before switching the mapping
    moved = make_cross_cell(tmp_path)
    event = _revert_until_flipped(moved, monkeypatch)
    _flip_failing_before_the_mapping(event, monkeypatch)
    assert quotas.usage(PROJECT) == COUNTED_ONCE

    # WHEN its rollback puts the server back in VERIFY_RESIZE in the target cell
    seen = usage_before_each_call(monkeypatch, PROJECT, cross_cell_settle, "_set_hidden", "_point_mapping_at")
    confirm_resize.restore_verify_resize({**event, "error": {"Error": "RuntimeError", "Cause": "unreachable"}})
    seen.append(quotas.usage(PROJECT))

    # THEN the server counted once at every moment
    assert seen == [COUNTED_ONCE] * 4
    assert mapped_cell(moved.instance_uuid) == TARGET_CELL


def test_revert_whose_destination_could_not_destroy_its_guest_is_undone_and_can_be_reverted_again(
        cloud, monkeypatch, tmp_path):
    # GIVEN a revert flipped to the source cell, whose DestroyAtDest failed with the guest intact
    moved = make_cross_cell(tmp_path)
    first = _flipped_then_failed(moved, monkeypatch, {"Error": "Ferry.HypervisorError", "Cause": "cannot destroy"})

    # WHEN its Catch runs RestoreVerifyResize (twice: delivered again)
    confirm_resize.restore_verify_resize(first)
    confirm_resize.restore_verify_resize(first)

    # THEN the server is in VERIFY_RESIZE in the target cell, every event of the revert ended there
    assert mapped_cell(moved.instance_uuid) == TARGET_CELL
    target = copy_in(TARGET_CELL, moved.instance_uuid)
    assert (target.hidden, target.vm_state, target.task_state) == (False, states.RESIZED, None)
    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.FINISHED
    assert (usage(SOURCE), usage(CROSS_DEST)) == (OLD_USAGE, NEW_USAGE)
    assert open_events(TARGET_CELL, moved.instance_uuid, first["request_id"]) == []
    assert {e: events_in(TARGET_CELL, moved.instance_uuid)[e] for e in (EVENT_REVERT, EVENT_REVERT_AT_DEST)} \
        == {EVENT_REVERT: "Error", EVENT_REVERT_AT_DEST: "Error"}

    # AND a second revert that succeeds leaves the first one's events ended in the source cell
    second = _revert_until_flipped(moved, monkeypatch)
    second["flipped"] = cross_cell_settle.flip_to_source_cell(second)
    second["reverted_at_dest"] = host_result(CROSS_DEST, moved.instance_uuid)
    second["restore"] = revert_resize.revert_resources_to_source(second)
    second["restored"] = host_result(SOURCE, moved.instance_uuid, states.RUNNING)
    revert_resize.finish_revert(second)
    assert mapped_cell(moved.instance_uuid) == SOURCE_CELL
    assert [open_events(SOURCE_CELL, moved.instance_uuid, r["request_id"]) for r in (first, second)] == [[], []]


def test_confirm_rolled_back_to_verify_resize_ends_the_source_hosts_event_too(cloud, monkeypatch, tmp_path):
    # GIVEN a cross-cell confirm whose first step started both events, refused by the source's agent
    moved = make_cross_cell(tmp_path)
    event = begin("confirm", moved, monkeypatch)
    event = {**event, "move": confirm_resize.check_resize_to_confirm(event),
             "error": {"Error": "Ferry.InvalidOperation", "Cause": "refused"}}

    # WHEN RestoreVerifyResize runs
    confirm_resize.restore_verify_resize(event)

    # THEN neither event stays open
    assert open_events(TARGET_CELL, moved.instance_uuid, event["request_id"]) == []
    recorded = events_in(TARGET_CELL, moved.instance_uuid)
    assert (recorded[EVENT_CONFIRM], recorded[EVENT_CONFIRM_AT_SOURCE]) == ("Error", "Error")


def open_events(cell: str, instance_uuid: str, request_id: str) -> list[str]:
    """The events of the server's request ``request_id`` not ended in ``cell``."""
    with cell_session(cell) as session:
        return list(session.scalars(select(InstanceActionEvent.event)
                                    .join(InstanceAction, InstanceAction.id == InstanceActionEvent.action_id)
                                    .where(InstanceAction.instance_uuid == instance_uuid,
                                           InstanceAction.request_id == request_id,
                                           InstanceActionEvent.finish_time.is_(None))))


def test_revert_that_fails_at_the_destination_after_the_flip_is_error_with_the_cells_in_the_fault(
        cloud, monkeypatch, tmp_path):
    # A timeout at the destination: its guest may be gone, so the revert cannot be undone.
    moved = make_cross_cell(tmp_path)
    event = _flipped_then_failed(moved, monkeypatch, {"Error": "States.Timeout", "Cause": "no answer"})

    revert_resize.fail_revert(event)
    revert_resize.fail_revert(event)

    row = copy_in(SOURCE_CELL, moved.instance_uuid)
    assert (row.vm_state, row.task_state, row.hidden) == (states.ERROR, None, False)
    assert migration_in(SOURCE_CELL, moved.migration_uuid).status == migration_states.ERROR
    from verify_resize_helpers import faults  # noqa: F401 - cell1 is the helpers' cell

    fault = faults(moved.instance_uuid)[-1]
    assert "may still be on cell2-host1" in fault.details
    assert f"The instance mapping names {SOURCE_CELL}." in fault.details
    assert f"{TARGET_CELL} holds a hidden copy on {CROSS_DEST}." in fault.details


# --- delete --------------------------------------------------------------------------------------


def test_delete_in_verify_resize_cleans_both_cells_and_both_hosts(cloud, tmp_path):
    moved = make_cross_cell(tmp_path)
    event: dict[str, Any] = {"instance_uuid": moved.instance_uuid, "cell": TARGET_CELL, "request_id": "req-del",
                             "host": CROSS_DEST}
    accept_delete(moved.instance_uuid, "req-del", TARGET_CELL)
    event["confirm"] = delete.find_resize_to_confirm(event)
    assert event["confirm"]["source_cell"] == SOURCE_CELL and event["confirm"]["queue_url"]

    delete.confirm_before_delete(event)
    delete.confirm_before_delete(event)
    delete.finish_delete(event)

    assert leftovers(SOURCE_CELL, moved.instance_uuid) == NOTHING
    assert copy_in(TARGET_CELL, moved.instance_uuid).deleted is True
    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.CONFIRMED
    assert placement.get_allocations(moved.instance_uuid) == {}
    assert placement.get_allocations(moved.migration_uuid) == {}
    assert (usage(SOURCE), usage(CROSS_DEST)) == ({}, {})
    assert attachments(moved.instance_uuid) == {}


def test_delete_records_the_snapshot_based_confirm_and_keeps_the_earlier_moves(cloud, tmp_path):
    moved = make_cross_cell(tmp_path)
    earlier = str(uuidlib.uuid4())
    with cell_session(SOURCE_CELL) as session:  # a move within the source cell, before this one
        session.add(Migration(uuid=earlier, instance_uuid=moved.instance_uuid, source_compute=SOURCE,
                              source_node=SOURCE, dest_compute=SOURCE, dest_node=SOURCE,
                              status=migration_states.CONFIRMED,
                              migration_type=migration_states.MIGRATION, user_id=USER, project_id=PROJECT))
    accept_delete(moved.instance_uuid, "req-del", TARGET_CELL)
    event: dict[str, Any] = {"instance_uuid": moved.instance_uuid, "cell": TARGET_CELL, "request_id": "req-del",
                             "host": CROSS_DEST}
    event["confirm"] = delete.find_resize_to_confirm(event)

    delete.confirm_before_delete(event)

    assert events_in(TARGET_CELL, moved.instance_uuid)[EVENT_CONFIRM_AT_SOURCE] == "Success"
    assert confirm_resize.EVENT_CONFIRM not in events_in(TARGET_CELL, moved.instance_uuid)
    assert leftovers(SOURCE_CELL, moved.instance_uuid) == NOTHING
    assert migration_in(TARGET_CELL, earlier).status == migration_states.CONFIRMED


def test_a_visible_copy_is_never_hard_deleted(cloud, tmp_path):
    from ferry import errors

    moved = make_cross_cell(tmp_path)
    with pytest.raises(errors.CellCopyNotHidden):
        cross_cell_settle.hard_delete_copy(TARGET_CELL, moved.instance_uuid, moved.migration_uuid)
    assert leftovers(TARGET_CELL, moved.instance_uuid)["instances"] == 1


# --- auto-confirm --------------------------------------------------------------------------------


def test_auto_confirm_confirms_a_cross_cell_move_once_from_the_mapped_cell(cloud, monkeypatch, tmp_path):
    moved = make_cross_cell(tmp_path)
    long_ago = dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(hours=2)
    for cell in (SOURCE_CELL, TARGET_CELL):
        with cell_session(cell) as session:
            session.execute(update(Migration).values(created_at=long_ago, updated_at=long_ago))
    monkeypatch.setenv("FERRY_RESIZE_CONFIRM_WINDOW", "60")
    from ferry import config

    config.reset()
    started: list[dict[str, Any]] = []
    monkeypatch.setattr(workflows, "start_execution",
                        lambda arn, name, payload: started.append(payload) or name)

    outcome = auto_confirm.run()

    assert (outcome["confirmed"], outcome["skipped"], outcome["failed"]) == (1, 0, 0)
    assert [(p["cell"], p["migration_uuid"]) for p in started] == [(TARGET_CELL, moved.migration_uuid)]
    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.CONFIRMING


# --- what the API shows --------------------------------------------------------------------------


def test_api_shows_the_mapped_copy_only_and_one_migration_per_uuid(cloud, tmp_path):
    moved = make_cross_cell(tmp_path)
    ctx = RequestContext(user_id=USER, project_id=PROJECT, roles=("admin",))

    server = compute_api.get_server(ctx, moved.instance_uuid)
    listed = [s for s in compute_api.list_servers(ctx, ServerFilters(all_tenants=True))
              if s.uuid == moved.instance_uuid]
    migrations = [m for m in moves.list_migrations(moves.MigrationFilters()) if m["uuid"] == moved.migration_uuid]

    assert (server.host, server.cell, server.flavor["flavorid"]) == (CROSS_DEST, TARGET_CELL, NEW["flavorid"])
    assert [(s.host, s.cell) for s in listed] == [(CROSS_DEST, TARGET_CELL)]
    assert len(migrations) == 1 and migrations[0]["cross_cell_move"] is True
    with cell_session(SOURCE_CELL) as session:  # the hidden copy's migration wins nothing even when newer
        session.execute(update(Migration).values(status=migration_states.ERROR))
    merged = [m for m in moves.list_migrations(moves.MigrationFilters()) if m["uuid"] == moved.migration_uuid]
    assert [m["status"] for m in merged] == [migration_states.FINISHED]


@pytest.mark.parametrize("kind", ["confirm", "revert"])
def test_a_settle_that_fails_at_its_first_step_records_the_cross_cell_event(cloud, monkeypatch, tmp_path, kind):
    """The step failed before it read the move: the migration still says it is a move between cells."""
    moved = make_cross_cell(tmp_path)
    event = begin(kind, moved, monkeypatch)
    host_down(SOURCE)  # after the API accepted the request
    check = confirm_resize.check_resize_to_confirm if kind == "confirm" else revert_resize.check_resize_to_revert
    with pytest.raises(errors.ComputeServiceUnavailable):
        check(event)

    confirm_resize.restore_verify_resize({**event, "error": {"Error": "Ferry.ComputeServiceUnavailable",
                                                             "Cause": "the source host is down"}})

    recorded = events_in(TARGET_CELL, moved.instance_uuid)
    expected = cross_cell_settle.EVENT_CONFIRM if kind == "confirm" else cross_cell_settle.EVENT_REVERT
    assert expected in recorded
    assert not {confirm_resize.EVENT_CONFIRM, confirm_resize.EVENT_REVERT} & set(recorded)
    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.FINISHED


def test_a_late_restore_leaves_alone_the_confirm_that_took_the_migration_since(cloud, monkeypatch, tmp_path):
    """A revert's restore committed, its answer was lost, the owner confirmed: the retry must not undo that."""
    moved = make_cross_cell(tmp_path)
    revert = begin("revert", moved, monkeypatch)
    failed = {**revert, "error": {"Error": "Ferry.HypervisorError", "Cause": "the destination failed"}}
    confirm_resize.restore_verify_resize(failed)
    begin("confirm", moved, monkeypatch)

    confirm_resize.restore_verify_resize(failed)  # the state machine's retry of the step

    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.CONFIRMING
    assert mapped_cell(moved.instance_uuid) == TARGET_CELL


def test_a_delete_goes_on_when_the_cell_of_an_older_moves_copy_cannot_be_reached(cloud, monkeypatch, tmp_path):
    # GIVEN a server moved between cells whose confirm failed at the source, then deleted while
    # the source cell's database cannot be reached
    moved = make_cross_cell(tmp_path)
    event = begin("confirm", moved, monkeypatch)
    confirm_resize.fail_confirm({**event, "move": confirm_resize.check_resize_to_confirm(event),
                                 "error": {"Error": "Ferry.HypervisorError", "Cause": "the disk is busy"}})
    accept_delete(moved.instance_uuid, "req-delete", TARGET_CELL)
    removal = {"instance_uuid": moved.instance_uuid, "cell": TARGET_CELL, "request_id": "req-delete",
               "host": CROSS_DEST}

    def unreachable(cell: str, instance_uuid: str, migration_uuid: str) -> bool:
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused"))

    monkeypatch.setattr(cross_cell_settle, "hard_delete_copy", unreachable)

    # WHEN its FinishDelete runs, THEN the server is deleted; the copy is left for the audit
    delete.finish_delete(removal)
    assert copy_in(TARGET_CELL, moved.instance_uuid).deleted is True
    assert copy_in(SOURCE_CELL, moved.instance_uuid).hidden is True


def test_deleting_a_server_releases_what_an_older_failed_confirm_left_held(cloud, monkeypatch, tmp_path):
    """The failed confirm's migration keeps its source allocation; a newer move is the one the delete confirms."""
    moved = make_cross_cell(tmp_path)
    event = begin("confirm", moved, monkeypatch)
    confirm_resize.fail_confirm({**event, "move": confirm_resize.check_resize_to_confirm(event),
                                 "error": {"Error": "Ferry.HypervisorError", "Cause": "the disk is busy"}})
    assert placement.get_allocations(moved.migration_uuid)
    newer = str(uuidlib.uuid4())
    with cell_session(TARGET_CELL) as session:
        session.add(Migration(uuid=newer, instance_uuid=moved.instance_uuid, source_compute=CROSS_DEST,
                              source_node=CROSS_DEST, dest_compute=CROSS_DEST, dest_node=CROSS_DEST,
                              status=migration_states.FINISHED, migration_type="resize"))
    placement.claim(newer, PROJECT, USER, {provider(CROSS_DEST): {"VCPU": 1}})
    removal = {"instance_uuid": moved.instance_uuid, "cell": TARGET_CELL, "request_id": "req-delete",
               "host": CROSS_DEST}
    accept_delete(moved.instance_uuid, "req-delete", TARGET_CELL)
    removal["confirm"] = delete.find_resize_to_confirm(removal)
    assert removal["confirm"]["migration_uuid"] == newer

    delete.confirm_before_delete(removal)
    delete.finish_delete(removal)
    delete.finish_delete(removal)  # delivered twice: the same end state

    assert placement.get_allocations(moved.migration_uuid) == {}
    assert placement.get_allocations(newer) == {} and placement.get_allocations(moved.instance_uuid) == {}
    # and the source cell's hidden copy the failed confirm left is gone too (its migrations kept in the target cell)
    assert leftovers(SOURCE_CELL, moved.instance_uuid) == NOTHING
    assert migration_in(TARGET_CELL, moved.migration_uuid).status == migration_states.ERROR
