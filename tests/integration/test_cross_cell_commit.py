"""CompleteMoveAcrossCells and its rollbacks when the switch is interrupted, the owner settles the move
meanwhile, or S3 fails: the cross-cell steps of ``statemachine/resize.asl.json`` on a real store with two
cells (moto for queues, the image bucket and the notification bus), run as ``test_cross_cell_steps`` runs them.

The source copy is hidden whenever the instance mapping names the target cell, unless a revert owns it;
the temporary snapshot is deleted once the move is settled either way, best effort, so S3 can neither roll
back a finished move nor keep a rolled-back move's rows in the target cell.
"""

from __future__ import annotations

import uuid as uuidlib
from typing import Any

import pytest
from botocore.exceptions import ClientError
from sqlalchemy import select
from test_cross_cell_steps import (  # noqa: F401 - the two_cells fixture
    TARGET_HOST,
    allow_cross_cell,
    complete_move_failing_at,
    images_left,
    roll_back,
    rows,
    run,
    server_in_cell1,
    two_cells,
)
from test_resize_steps import (  # noqa: F401 - the cloud fixture
    BIG,
    PROJECT,
    USER,
    cloud,
    host_result,
    make_server,
    prepare_move,
)
from verify_resize_helpers import accept_delete

from ferry import errors, images, workflows
from ferry.compute import instances, migration_states, moves, states
from ferry.store.cell_models import BlockDeviceMapping, Instance, Migration
from ferry.store.db import cell_session
from ferry.workflows import confirm_resize, cross_cell, cross_cell_settle, delete, resize, revert_resize

pytestmark = pytest.mark.usefixtures("two_cells")


def image_backed_server_in_cell1() -> tuple[str, dict[str, Any]]:
    """An image-backed server that may move to cell2: its move writes a temporary snapshot."""
    uuid = make_server()
    allow_cross_cell(uuid)
    return uuid, prepare_move(uuid, BIG, requested_host=TARGET_HOST)


def switch_then_die(doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """CompleteMoveAcrossCells switching the mapping to the target cell, then dying before it hides the source copy."""
    complete_move_failing_at("_hide_source", doc, monkeypatch)
    assert instances.cell_of(doc["instance_uuid"]).name == "cell2"


def confirm_as_the_owner(uuid: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The owner confirms the server it sees in VERIFY_RESIZE; returns the confirm execution's input."""
    return _accepted(moves.begin_confirm, uuid, monkeypatch)


def revert_as_the_owner(uuid: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The owner reverts the server it sees in VERIFY_RESIZE; returns the revert execution's input."""
    return _accepted(moves.begin_revert, uuid, monkeypatch)


def _accepted(accept: Any, uuid: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    started: list[dict[str, Any]] = []

    def start_execution(arn: str, name: str, payload: dict[str, Any]) -> str:
        started.append({**payload, "execution_name": name})
        return name

    with monkeypatch.context() as patched:
        patched.setattr(workflows, "start_execution", start_execution)
        accept(instances.cell_of(uuid).name, uuid, request_id=f"req-{uuidlib.uuid4()}", user_id=USER,
               project_id=PROJECT)
    return started[0]


def s3_unavailable(*args: Any) -> bool:
    raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "S3 is unavailable"}}, "DeleteObject")


@pytest.mark.parametrize("then", ["CompleteMoveAcrossCells retried", "CheckMoveCommitted"])
def test_a_confirm_landing_between_the_switch_and_hiding_the_source_copy_still_confirms(monkeypatch, then):
    # GIVEN CompleteMoveAcrossCells switched the mapping, then died before hiding the source copy
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    switch_then_die(doc, monkeypatch)
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][:3] == (False, states.ACTIVE, states.RESIZE_FINISH)
    # AND the owner confirmed the server the API shows in VERIFY_RESIZE in the target cell
    confirm = confirm_as_the_owner(uuid, monkeypatch)
    assert rows("cell2", uuid, inp["migration_uuid"])["migration"][0] == migration_states.CONFIRMING

    # WHEN the step runs again, or its Catch asks whether the move committed
    if then == "CompleteMoveAcrossCells retried":
        assert cross_cell.complete_move(doc) == {}
    else:
        assert cross_cell.check_move_committed({**doc, "error": {"Error": "Sandbox.Timedout", "Cause": "x"}}) \
            == {"committed": True}

    # THEN the move stands with the source copy hidden, no task, and no snapshot left
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][:3] == (True, states.ACTIVE, None)
    assert images_left() == []
    # AND the confirm removes the source copy and confirms
    confirm["move"] = confirm_resize.check_resize_to_confirm(confirm)
    confirm_resize.finish_confirm(confirm)
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"] is None
    assert rows("cell2", uuid, inp["migration_uuid"])["migration"][0] == migration_states.CONFIRMED
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"][:4] == (False, states.ACTIVE, None, TARGET_HOST)


@pytest.mark.parametrize("then", ["CompleteMoveAcrossCells retried", "CheckMoveCommitted"])
def test_a_revert_flipping_back_while_the_switch_is_finished_keeps_its_source_copy_visible(monkeypatch, then):
    # GIVEN the switch died before hiding the source copy, and a revert has written the source cell's
    # migration copy (reverting) but not yet switched the mapping back
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    switch_then_die(doc, monkeypatch)
    for cell in ("cell1", "cell2"):
        with cell_session(cell) as session:
            session.scalars(select(Migration).where(Migration.uuid == inp["migration_uuid"])).one().status = \
                migration_states.REVERTING
    with cell_session("cell1") as session:
        session.scalars(select(Instance).where(Instance.uuid == uuid)).one().task_state = states.RESIZE_REVERTING

    # WHEN the step runs again, or its Catch asks
    if then == "CompleteMoveAcrossCells retried":
        cross_cell.complete_move(doc)
    else:
        assert cross_cell.check_move_committed({**doc, "error": {"Error": "Sandbox.Timedout", "Cause": "x"}}) \
            == {"committed": True}

    # THEN the copy the revert owns is left to it
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][:3] == (False, states.ACTIVE,
                                                                          states.RESIZE_REVERTING)


@pytest.mark.parametrize("revert_seen_in", ["the migration copy", "the instance row"])
def test_hiding_the_source_copy_is_one_conditional_update_a_revert_wins(revert_seen_in):
    # GIVEN a source copy a revert has taken: its migration copy reverted, or (what a concurrent update
    # re-reads on PostgreSQL) the copy's task resize_reverting
    uuid, inp = server_in_cell1()
    run(inp, until="CompleteMoveAcrossCells")
    with cell_session("cell1") as session:
        if revert_seen_in == "the migration copy":
            session.scalars(select(Migration).where(Migration.uuid == inp["migration_uuid"])).one().status = \
                migration_states.REVERTED
        else:
            session.scalars(select(Instance).where(Instance.uuid == uuid)).one().task_state = \
                states.RESIZE_REVERTING

    # THEN hiding it changes nothing
    assert cross_cell_settle.hide_source_copy("cell1", uuid, inp["migration_uuid"]) is False
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is False

    # AND without the revert it hides the copy, once
    with cell_session("cell1") as session:
        session.scalars(select(Migration).where(Migration.uuid == inp["migration_uuid"])).one().status = \
            migration_states.FINISHED
        session.scalars(select(Instance).where(Instance.uuid == uuid)).one().task_state = states.RESIZE_FINISH
    assert cross_cell_settle.hide_source_copy("cell1", uuid, inp["migration_uuid"]) is True
    assert cross_cell_settle.hide_source_copy("cell1", uuid, inp["migration_uuid"]) is False  # already hidden
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][:3] == (True, states.ACTIVE, None)


def test_an_s3_failure_deleting_the_snapshot_does_not_fail_the_finished_move(monkeypatch):
    # GIVEN a move at its last step, and S3 failing to delete
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    monkeypatch.setattr(images, "delete_image", s3_unavailable)

    # WHEN CompleteMoveAcrossCells runs
    assert cross_cell.complete_move(doc) == {}

    # THEN the move is finished, and committed; the snapshot is left for ferry audit --fix
    assert instances.cell_of(uuid).name == "cell2"
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] == (False, states.RESIZED, None, TARGET_HOST,
                                                                      BIG["flavorid"])
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is True
    assert cross_cell.check_move_committed({**doc, "error": {"Error": "x", "Cause": "x"}}) == {"committed": True}
    assert images_left() == [doc["snapshot_prep"]["args"]["snapshot"]["key"]]


@pytest.mark.parametrize("then", ["CompleteMoveAcrossCells retried", "CheckMoveCommitted"])
def test_the_snapshot_goes_on_every_path_that_finishes_the_move(monkeypatch, then):
    # GIVEN the switch died before it hid the source copy and deleted the snapshot
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    switch_then_die(doc, monkeypatch)
    assert images_left() != []

    if then == "CompleteMoveAcrossCells retried":
        cross_cell.complete_move(doc)
    else:
        assert cross_cell.check_move_committed({**doc, "error": {"Error": "x", "Cause": "x"}}) == {"committed": True}

    assert images_left() == []
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is True


def test_a_move_not_committed_keeps_its_snapshot_until_its_rollback():
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")

    assert cross_cell.check_move_committed({**doc, "error": {"Error": "x", "Cause": "x"}}) == {"committed": False}
    assert images_left() == [doc["snapshot_prep"]["args"]["snapshot"]["key"]]
    roll_back(doc)
    assert images_left() == []


def test_a_rollback_with_s3_failing_still_removes_the_target_cell_copies(monkeypatch):
    # GIVEN a move that failed at its last step, and S3 failing to delete
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    monkeypatch.setattr(images, "delete_image", s3_unavailable)

    # WHEN RollbackTargetCell runs (and RollbackMove after it)
    roll_back(doc)

    # THEN the target cell holds nothing of the server; only the snapshot is left, for ferry audit --fix
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell2", uuid, inp["migration_uuid"]) == {"instance": None, "migration": None, "bdms": [], "tags": [],
                                                          "actions": []}
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"] == (False, states.ACTIVE, None, "cell1-host1", "1")
    assert images_left() == [doc["snapshot_prep"]["args"]["snapshot"]["key"]]


def test_a_rollback_whose_target_cell_does_not_answer_still_deletes_the_snapshot(monkeypatch):
    # GIVEN a move that failed at its last step, and the target cell's database not answering
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")

    def target_away(*_args, **_kwargs):
        raise errors.DatabaseUnavailable("RollbackTargetCell: the database could not serve the step for a moment.")

    # WHEN RollbackTargetCell fails for good (its Catch goes on to RollbackMove)
    with monkeypatch.context() as patched:
        patched.setattr(cross_cell_settle, "hard_delete_copy", target_away)
        with pytest.raises(errors.DatabaseUnavailable):
            cross_cell.rollback_target_cell(doc)
    resize.rollback_move({**doc, "error": {"Error": "Ferry.HypervisorError", "Cause": "it broke"},
                          "restored": doc.get("restored") or {}})

    # THEN the snapshot, which does not depend on that cell, is gone all the same
    assert images_left() == []
    assert instances.cell_of(uuid).name == "cell1"


def test_a_move_to_a_cell_holding_an_earlier_moves_copy_replaces_it():
    # GIVEN an earlier move to cell2 whose RollbackTargetCell never ran (RollbackMove did): cell2 keeps its
    # hidden copy, block device mapping and migration (still pre-migrating)
    uuid, first = server_in_cell1()
    doc = run(first, until="PrepResizeOnDestHost")
    resize.rollback_move({**doc, "error": {"Error": "Ferry.HypervisorError", "Cause": "it broke"}})
    assert rows("cell2", uuid, first["migration_uuid"])["migration"][0] == migration_states.PRE_MIGRATING
    # AND the volume was detached since
    with cell_session("cell1") as session:
        for bdm in session.scalars(select(BlockDeviceMapping).where(BlockDeviceMapping.instance_uuid == uuid)):
            session.delete(bdm)
    with cell_session("cell1") as session:
        session.scalars(select(Instance).where(Instance.uuid == uuid)).one().display_name = "renamed"

    # WHEN a new move to cell2 sets up the target cell
    second = prepare_move(uuid, BIG, requested_host=TARGET_HOST)
    run(second, until="PrepResizeAtDest", twice=True)

    # THEN cell2 holds this move's copy only: no stale mapping, no earlier migration, the current name
    target = rows("cell2", uuid, second["migration_uuid"])
    assert target["bdms"] == rows("cell1", uuid, second["migration_uuid"])["bdms"] == []
    assert target["instance"][0] is True and target["migration"][0] == migration_states.PRE_MIGRATING
    assert rows("cell2", uuid, first["migration_uuid"])["migration"] is None
    assert rows("cell1", uuid, first["migration_uuid"])["migration"][0] == migration_states.ERROR
    with cell_session("cell2") as session:
        assert session.scalars(select(Instance.display_name).where(Instance.uuid == uuid)).one() == "renamed"


def test_a_move_to_a_cell_holding_a_visible_copy_an_earlier_move_left_replaces_it(monkeypatch):
    # GIVEN an earlier move to cell2 whose CompleteMoveAcrossCells showed the target copy and died before
    # switching the mapping, and whose rollback could not reach cell2 (RollbackMove ran, RollbackTargetCell not)
    uuid, first = server_in_cell1()
    doc = run(first, until="CompleteMoveAcrossCells")
    complete_move_failing_at("_map_to", doc, monkeypatch)
    assert cross_cell.check_move_committed({**doc, "error": {"Error": "x", "Cause": "x"}}) == {"committed": False}
    resize.rollback_move({**doc, "error": {"Error": "RuntimeError", "Cause": "the database was lost"},
                          "restored": host_result(doc, doc["move"]["source"]["host"], states.RUNNING)})
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell2", uuid, first["migration_uuid"])["instance"][:2] == (False, states.RESIZED)

    # WHEN a new move to cell2 sets up the target cell
    second = prepare_move(uuid, BIG, requested_host=TARGET_HOST)
    run(second, until="PrepResizeAtDest", twice=True)

    # THEN cell2 holds this move's hidden copy of the server as it is now, and none of the earlier move's records
    target = rows("cell2", uuid, second["migration_uuid"])
    assert target["instance"] == (True, states.ACTIVE, states.RESIZE_PREP, "cell1-host1", "1")
    assert target["migration"][0] == migration_states.PRE_MIGRATING
    assert rows("cell2", uuid, first["migration_uuid"])["migration"] is None
    assert rows("cell1", uuid, first["migration_uuid"])["migration"][0] == migration_states.ERROR
    assert instances.cell_of(uuid).name == "cell1"


def test_a_visible_copy_in_the_target_cell_the_mapping_names_is_never_removed():
    # GIVEN a visible copy in cell2, and (against what validate_input checked) the mapping naming cell2
    uuid, first = server_in_cell1()
    run(first)
    cross_cell._map_to(uuid, "cell2")

    # WHEN a new move's TargetDBSetup finds it
    with pytest.raises(errors.MoveNotPrepared):
        cross_cell._purge_stale_copy("cell2", uuid, str(uuidlib.uuid4()))

    # THEN it is left as it is
    assert rows("cell2", uuid, first["migration_uuid"])["instance"][:2] == (False, states.RESIZED)


def test_a_switch_still_running_after_the_move_was_found_not_committed_switches_nothing(monkeypatch):
    # GIVEN a cross-cell move whose CompleteMoveAcrossCells Step Functions gave up on, and
    # CheckMoveCommitted found it not committed (the rollback may begin)
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    assert cross_cell.check_move_committed({**doc, "error": {"Error": "x", "Cause": "x"}}) == {"committed": False}

    # WHEN the invocation Step Functions gave up on runs on (or one starts late)
    with pytest.raises(errors.UnexpectedMigrationState, match="found not committed"):
        cross_cell.complete_move(doc)

    # THEN the server is still cell1's, its copy there visible and this move's, the target copy hidden
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][:3] == (False, states.ACTIVE, states.RESIZE_FINISH)
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"][0] is True
    # asked again, CheckMoveCommitted answers the same; the rollback leaves nothing in cell2
    assert cross_cell.check_move_committed({**doc, "error": {"Error": "x", "Cause": "x"}}) == {"committed": False}
    roll_back(doc)
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] is None
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][:3] == (False, states.ACTIVE, None)


@pytest.mark.parametrize("paused_at", ["_require_move_task", "_map_to"])
def test_a_switch_paused_while_the_move_is_found_not_committed_never_maps_the_server_to_the_target(
        monkeypatch, paused_at):
    # GIVEN a CompleteMoveAcrossCells paused before it writes anything (or just before it switches the
    # mapping), long enough for its Catch to ask CheckMoveCommitted
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    answers: list[dict[str, Any]] = []
    paused = getattr(cross_cell, paused_at)

    def check_meanwhile(*args: Any, **kwargs: Any) -> Any:
        if not answers:
            answers.append(cross_cell.check_move_committed({**doc, "error": {"Error": "x", "Cause": "x"}}))
        return paused(*args, **kwargs)

    monkeypatch.setattr(cross_cell, paused_at, check_meanwhile)

    # WHEN it goes on after CheckMoveCommitted answered
    with pytest.raises(errors.UnexpectedMigrationState):
        cross_cell.complete_move(doc)

    # THEN the move was not committed, the mapping still names cell1 and the source copy shows
    assert answers == [{"committed": False}]
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is False
    monkeypatch.undo()
    roll_back(doc)
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] is None
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][:3] == (False, states.ACTIVE, None)


def test_a_late_switch_of_an_older_move_never_hides_the_copy_a_newer_move_made_the_server(monkeypatch):
    # GIVEN a move to cell2, confirmed (cell1's copy and its migration gone)
    uuid, first = image_backed_server_in_cell1()
    doc = run(first)
    confirm = confirm_as_the_owner(uuid, monkeypatch)
    confirm["move"] = confirm_resize.check_resize_to_confirm(confirm)
    confirm_resize.finish_confirm(confirm)
    assert rows("cell1", uuid, first["migration_uuid"])["instance"] is None
    # AND a newer move back to cell1 made cell1's copy the server again (its own migration beside it)
    newer = str(uuidlib.uuid4())
    with cell_session("cell2") as session:
        row = session.scalars(select(Instance).where(Instance.uuid == uuid)).one()
        values = cross_cell_settle.columns(row)
        row.hidden = True
    with cell_session("cell1") as session:
        session.add(Instance(**{**values, "vm_state": states.RESIZED}))
        session.add(Migration(uuid=newer, instance_uuid=uuid, source_compute=TARGET_HOST, dest_compute="cell1-host1",
                              status=migration_states.FINISHED, migration_type="migration", cross_cell_move=True,
                              user_id=USER, project_id=PROJECT))
    cross_cell._map_to(uuid, "cell1")

    # WHEN the older move's switch finishes late (it read the mapping naming cell2 before the newer move's switch)
    monkeypatch.setattr(cross_cell, "_mapped_to_target", lambda event: True)
    cross_cell._finish_switch(doc)

    # THEN the server's copy in cell1 stays visible
    assert rows("cell1", uuid, newer)["instance"][:2] == (False, states.RESIZED)


def test_a_revert_that_failed_after_removing_the_target_copy_settled_the_move(monkeypatch):
    # GIVEN a move whose last step committed but whose answer was lost, so CheckMoveCommitted comes late
    uuid, inp = image_backed_server_in_cell1()
    doc = run(inp)
    # AND meanwhile the owner reverted: the revert flipped the server back to cell1, removed the target
    # copy, and failed restoring the source guest (FailRevert: server ERROR, migration error)
    revert = revert_as_the_owner(uuid, monkeypatch)
    revert["move"] = revert_resize.check_resize_to_revert(revert)
    revert["flipped"] = cross_cell_settle.flip_to_source_cell(revert)
    revert["reverted_at_dest"] = host_result(revert, TARGET_HOST, states.NOSTATE)
    revert["restore"] = revert_resize.revert_resources_to_source(revert)
    revert_resize.fail_revert({**revert, "error": {"Error": "Ferry.HypervisorError", "Cause": "cannot restore"}})
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] is None
    failed = rows("cell1", uuid, inp["migration_uuid"])
    assert (failed["instance"][:3], failed["migration"][0]) == ((False, states.ERROR, None), migration_states.ERROR)

    # WHEN the move's CheckMoveCommitted runs
    answer = cross_cell.check_move_committed({**doc, "error": {"Error": "Sandbox.Timedout", "Cause": "x"}})

    # THEN the move stands (its rollback never runs on the server the revert left), and nothing changed
    assert answer == {"committed": True}
    assert rows("cell1", uuid, inp["migration_uuid"]) == failed
    assert instances.cell_of(uuid).name == "cell1"

# --- servers already left with both copies visible ---------------------------------------------------------


def test_a_confirm_that_failed_on_a_visible_source_copy_succeeds_when_asked_again(monkeypatch):
    # GIVEN the switch died before hiding the source copy and nothing hid it since (as before the fix), and
    # the owner's confirm failed on it at FinishConfirm: the migration is in error
    uuid, inp = image_backed_server_in_cell1()
    switch_then_die(run(inp, until="CompleteMoveAcrossCells"), monkeypatch)
    started = confirm_as_the_owner(uuid, monkeypatch)
    first = {**started, "move": confirm_resize.check_resize_to_confirm(started), "confirmed_at_source": {}}
    confirm_resize.fail_confirm({**first, "error": {"Error": "Ferry.CellCopyNotHidden", "Cause": "visible in cell1"}})
    assert rows("cell2", uuid, inp["migration_uuid"])["migration"][0] == migration_states.ERROR
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is False

    # WHEN the confirm workflow runs again for that migration
    again = {**started, "request_id": f"req-{uuidlib.uuid4()}"}
    again["move"] = confirm_resize.check_resize_to_confirm(again)
    confirm_resize.finish_confirm(again)

    # THEN the source copy is hidden and removed, and the move confirmed
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"] is None
    assert rows("cell1", uuid, inp["migration_uuid"])["migration"] is None
    assert rows("cell2", uuid, inp["migration_uuid"])["migration"][0] == migration_states.CONFIRMED


def test_a_delete_removes_a_source_copy_the_switch_left_visible(monkeypatch):
    uuid, inp = image_backed_server_in_cell1()
    switch_then_die(run(inp, until="CompleteMoveAcrossCells"), monkeypatch)
    removal: dict[str, Any] = {"instance_uuid": uuid, "cell": "cell2", "request_id": "req-delete",
                               "host": TARGET_HOST}
    accept_delete(uuid, "req-delete", "cell2")
    removal["confirm"] = delete.find_resize_to_confirm(removal)
    assert removal["confirm"]["source_cell"] == "cell1"

    delete.confirm_before_delete(removal)
    delete.finish_delete(removal)

    assert rows("cell1", uuid, inp["migration_uuid"])["instance"] is None
    assert rows("cell2", uuid, inp["migration_uuid"])["migration"][0] == migration_states.CONFIRMED


@pytest.mark.parametrize("owner", ["a revert", "the mapping"])
def test_a_visible_copy_a_revert_or_the_mapping_owns_is_never_hard_deleted(owner):
    # GIVEN a finished switch whose source copy is visible again: a revert flipping it back has written its
    # migration copy (reverting) but not yet switched the mapping; or the mapping names the source cell
    uuid, inp = image_backed_server_in_cell1()
    run(inp)
    with cell_session("cell1") as session:
        session.scalars(select(Instance).where(Instance.uuid == uuid)).one().hidden = False
        if owner == "a revert":
            session.scalars(select(Migration).where(Migration.uuid == inp["migration_uuid"])).one().status = \
                migration_states.REVERTING
    if owner == "the mapping":
        cross_cell._map_to(uuid, "cell1")

    with pytest.raises(errors.CellCopyNotHidden):
        cross_cell_settle.hard_delete_copy("cell1", uuid, inp["migration_uuid"])
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is False
