"""The cross-cell steps of the resize workflow against a real store with two cells.

The steps run as the cross-cell branch of ``statemachine/resize.asl.json`` runs them, with
moto for queues, the image bucket and the notification bus; host results follow the protocol.
"""

from __future__ import annotations

import hashlib
from types import ModuleType
from typing import Any

import pytest
from cross_cell_helpers import events_in
from sqlalchemy import select, update
from test_resize_steps import (  # noqa: F401 - the cloud fixture
    BIG,
    PROJECT,
    boot_from_volume,
    cloud,
    host_result,
    instance,
    make_server,
    prepare_move,
    report,
)

from ferry import aws, config, errors, placement, protocol, quotas
from ferry.compute import instances, states
from ferry.store import db
from ferry.store.api_models import RequestSpec
from ferry.store.cell_models import BlockDeviceMapping, Instance, InstanceAction, InstanceFault, Migration, Tag
from ferry.store.db import api_session, cell_session
from ferry.workflows import cross_cell, resize

TARGET_HOST = "cell2-host1"


@pytest.fixture
def two_cells(cloud, monkeypatch):  # noqa: F811 - the fixture imported above
    monkeypatch.setattr(resize, "CROSS_CELL_SCHEDULING", True)
    aws.client("sqs").create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, TARGET_HOST))
    report(TARGET_HOST, "cell2", memory_mb=16384)
    return cloud


def allow_cross_cell(uuid: str) -> None:
    with api_session() as session:
        row = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == uuid)).one()
        row.spec = {**row.spec, "allow_cross_cell_move": True}


def rows(cell: str, uuid: str, migration_uuid: str) -> dict[str, Any]:
    with cell_session(cell) as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
        migration = session.scalars(select(Migration).where(Migration.uuid == migration_uuid)).one_or_none()
        return {
            "instance": None if instance is None else (instance.hidden, instance.vm_state, instance.task_state,
                                                       instance.host, instance.flavor["flavorid"]),
            "migration": None if migration is None else (migration.status, migration.cross_cell_move,
                                                         migration.dest_compute),
            "bdms": sorted(b.uuid for b in session.scalars(select(BlockDeviceMapping).where(
                BlockDeviceMapping.instance_uuid == uuid))),
            "tags": sorted(session.scalars(select(Tag.tag).where(Tag.instance_uuid == uuid))),
            "actions": sorted(session.scalars(select(InstanceAction.request_id).where(
                InstanceAction.instance_uuid == uuid))),
        }


def server_in_cell1(flavor: dict | None = None, running: bool = True) -> tuple[str, dict[str, Any]]:
    uuid = make_server(volume=True, power_state=states.RUNNING if running else states.SHUTDOWN,
                       vm_state=states.ACTIVE if running else states.STOPPED)
    with cell_session("cell1") as session:
        session.add(Tag(instance_uuid=uuid, tag="blue"))
    allow_cross_cell(uuid)
    return uuid, prepare_move(uuid, flavor or BIG, requested_host=TARGET_HOST)


def run(inp: dict[str, Any], until: str | None = None, twice: bool = False) -> dict[str, Any]:
    """The cross-cell branch step by step; stops before ``until`` as its Catch would see the document."""
    doc = resize.validate_input({"input": inp, "execution_name": inp["execution_name"]})
    steps = [
        ("SelectMoveDestinations", "destination", resize.select_destinations),
        ("TargetDBSetup", "target", cross_cell.target_db_setup),
        ("PrepResizeAtDest", "prep", cross_cell.prep_resize_at_dest),
        ("PrepResizeOnDestHost", "claim", lambda d: host_result(d, TARGET_HOST, 0, claimed=True)),
        ("PrepResizeAtSource", "snapshot_prep", cross_cell.prep_resize_at_source),
        ("PrepSnapshotResizeOnSourceHost", "snapshotted", _snapshot_on_source),
        ("FinishResizeAtDest", "spawn", cross_cell.finish_resize_at_dest),
        ("SpawnOnDestHost", "spawned", lambda d: host_result(
            d, TARGET_HOST, states.RUNNING if d["spawn"]["args"]["power_on"] else states.SHUTDOWN)),
        ("CompleteMoveAcrossCells", None, cross_cell.complete_move),
    ]
    for name, key, fn in steps:
        if name == until:
            return doc
        result = fn(doc)
        if twice:
            result = fn(doc)
        if key:
            doc[key] = result
    return doc


def _snapshot_on_source(doc: dict[str, Any]) -> dict[str, Any]:
    """What the source host does to S3, then answers: an image object of the root disk."""
    snap = doc["snapshot_prep"]["args"]["snapshot"]
    args_schema = protocol.ARGS_SCHEMAS[protocol.PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE]
    protocol.validate(doc["snapshot_prep"]["args"], args_schema)
    snapshot = None
    if snap is not None:
        body = b"root disk"
        digest = hashlib.sha256(body).hexdigest()
        aws.client("s3").put_object(Bucket=snap["bucket"], Key=snap["key"], Body=body,
                                    Metadata={"image-id": snap["image_id"], "sha256": digest})
        snapshot = {"image_id": snap["image_id"], "sha256": digest, "size": len(body)}
    return host_result(doc, doc["move"]["source"]["host"], 0, was_running=True, snapshot=snapshot)


def test_prep_at_dest_tells_the_destination_a_volume_backed_server_has_no_root_disk_there(two_cells):
    # GIVEN a volume-backed server moving to another cell, and an image-backed one
    bfv, inp = server_in_cell1()
    boot_from_volume(bfv)
    _image_backed, other = server_in_cell1()

    # WHEN PrepCrossCellAtDest builds the destination's prep_resize arguments
    prep = run(inp, until="PrepResizeOnDestHost")["prep"]["args"]

    # THEN only the volume-backed server's say it has no root disk there
    assert prep["is_bfv"] is True
    protocol.validate(prep, protocol.ARGS_SCHEMAS[protocol.PREP_RESIZE])
    assert run(other, until="PrepResizeOnDestHost")["prep"]["args"]["is_bfv"] is False


def images_left() -> list[str]:
    listed = aws.client("s3").list_objects_v2(Bucket=config.get().image_bucket, Prefix="images/")
    return [o["Key"] for o in listed.get("Contents", [])]


def roll_back(doc: dict[str, Any]) -> None:
    """What the Catch branches run after the host rollbacks: the target cell, then RollbackMove."""
    doc = {**doc, "error": {"Error": "Ferry.HypervisorError", "Cause": "it broke"}}
    if "snapshot_prep" in doc:
        doc["restored"] = host_result(doc, doc["move"]["source"]["host"], states.RUNNING)
    cross_cell.rollback_target_cell(doc)
    resize.rollback_move(doc)


def usage_before_each_call(monkeypatch: pytest.MonkeyPatch, project_id: str, module: ModuleType,
                           *names: str) -> list[dict[str, int]]:
    """The project's quota usage as counted just before every call of ``module``'s functions ``names``.

    Each of those functions is one write of a switch between cells, so the list holds the usage at
    every moment between two of its writes (the caller adds the one after the last).
    """
    seen: list[dict[str, int]] = []

    def watch(write: Any) -> Any:
        def watched(*args: Any, **kwargs: Any) -> Any:
            seen.append(quotas.usage(project_id))
            return write(*args, **kwargs)
        return watched

    for name in names:
        monkeypatch.setattr(module, name, watch(getattr(module, name)))
    return seen


def read_cells(monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """Make quota counting read the cells newest first, should ``order`` say so."""
    if order == "newest first":
        monkeypatch.setattr(quotas, "all_cells", lambda **kw: list(reversed(db.all_cells(**kw))))


# A server of BIG's vCPUs and RAM (the larger of its flavors while it moves), counted once.
COUNTED_ONCE = {"instances": 1, "cores": BIG["vcpus"], "ram": BIG["memory_mb"]}


def test_the_scheduler_picks_another_cell_only_when_the_move_may_cross_cells(two_cells):
    uuid = make_server()
    inp = prepare_move(uuid, BIG, requested_host=TARGET_HOST)

    with pytest.raises(errors.NoValidHost):
        resize.select_destinations(resize.validate_input({"input": inp, "execution_name": "x"}))


def test_target_db_setup_copies_the_server_hidden_and_runs_twice_the_same(two_cells):
    uuid, inp = server_in_cell1()
    doc = run(inp, until="PrepResizeAtDest", twice=True)

    source, target = rows("cell1", uuid, inp["migration_uuid"]), rows("cell2", uuid, inp["migration_uuid"])
    assert doc["destination"]["cell"] == "cell2"
    assert target["instance"][0] is True and source["instance"][0] is False
    assert target["migration"][1] is True and source["migration"][1] is True
    assert (target["bdms"], target["tags"], target["actions"]) == (source["bdms"], source["tags"], source["actions"])
    assert target["tags"] == ["blue"]
    assert instances.cell_of(uuid).name == "cell1"


def test_a_move_across_cells_reaches_verify_resize_in_the_target_cell(two_cells):
    uuid, inp = server_in_cell1()

    # the conductor's event spans the whole move between cells, as Nova's cross-cell task does
    doc = run(inp, until="CompleteMoveAcrossCells", twice=True)
    assert events_in("cell1", uuid)[resize.EVENT_MIGRATE] is None
    cross_cell.complete_move(doc)
    cross_cell.complete_move(doc)
    assert events_in("cell2", uuid) == dict.fromkeys(resize.CROSS_CELL_EVENTS, "Success")

    target, source = rows("cell2", uuid, inp["migration_uuid"]), rows("cell1", uuid, inp["migration_uuid"])
    assert target["instance"] == (False, states.RESIZED, None, TARGET_HOST, BIG["flavorid"])
    # The source copy is hidden where it was: on the source host, with the old flavor, no task.
    assert source["instance"] == (True, states.ACTIVE, None, "cell1-host1", "1")
    assert target["migration"][0] == source["migration"][0] == "finished"
    assert instances.cell_of(uuid).name == "cell2"
    assert images_left() == []
    assert doc["spawn"]["args"]["image"]["id"] == cross_cell.snapshot_image_id(inp["migration_uuid"])
    assert placement.get_allocations(inp["migration_uuid"]) == {
        placement.provider_by_host("cell1-host1"): {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 1}}


@pytest.mark.parametrize("status", ["confirming", "reverting", "reverted"])
def test_complete_move_run_again_after_a_confirm_or_revert_took_over_changes_nothing(two_cells, status):
    """A redelivered CompleteMoveAcrossCells must leave a confirm or a revert (mapping flipped back) alone."""
    uuid, inp = server_in_cell1()
    doc = run(inp)
    for cell in ("cell1", "cell2"):
        with cell_session(cell) as session:
            session.scalars(select(Migration).where(Migration.uuid == inp["migration_uuid"])).one().status = status
            if status != "confirming":  # the revert has shown the source copy again and mapped it back
                session.scalars(select(Instance).where(Instance.uuid == uuid)).one().hidden = cell == "cell2"
    if status != "confirming":
        cross_cell._map_to(uuid, "cell1")
    before = (rows("cell1", uuid, inp["migration_uuid"]), rows("cell2", uuid, inp["migration_uuid"]),
              instances.cell_of(uuid).name)

    assert cross_cell.complete_move(doc) == {}

    assert (rows("cell1", uuid, inp["migration_uuid"]), rows("cell2", uuid, inp["migration_uuid"]),
            instances.cell_of(uuid).name) == before


def complete_move_failing_at(step: str, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """CompleteMoveAcrossCells failing when it reaches its ``step`` (``_map_to``, ``_hide_source``):
    the database lost, or the function dead, what came before that step done."""

    def lost(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the connection to the database was lost")

    with monkeypatch.context() as patched:
        patched.setattr(cross_cell, step, lost)
        with pytest.raises(RuntimeError):
            cross_cell.complete_move(doc)


def test_a_complete_move_that_failed_after_switching_the_mapping_stands_and_the_source_copy_is_hidden(
        two_cells, monkeypatch):
    # GIVEN CompleteMoveAcrossCells switched the instance mapping to the target cell, then failed
    uuid, inp = server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    complete_move_failing_at("_hide_source", doc, monkeypatch)
    assert instances.cell_of(uuid).name == "cell2"
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is False  # both copies visible

    # WHEN its Catch asks before rolling back
    answer = cross_cell.check_move_committed({**doc, "error": {"Error": "Sandbox.Timedout", "Cause": "timed out"}})

    # THEN the move stands, finished as the step would have finished it
    assert answer == {"committed": True}
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is True
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] == (False, states.RESIZED, None, TARGET_HOST,
                                                                      BIG["flavorid"])
    assert events_in("cell2", uuid) == dict.fromkeys(resize.CROSS_CELL_EVENTS, "Success")


def test_the_switch_is_refused_when_the_source_copy_is_no_longer_the_moves(two_cells):
    # GIVEN an admin's os-resetState cleared the source copy's task while the destination spawned
    uuid, inp = server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == uuid).values(task_state=None, vm_state=states.ERROR))

    # WHEN CompleteMoveAcrossCells runs, THEN it refuses to switch: nothing of the move is finished
    with pytest.raises(errors.UnexpectedTaskState):
        cross_cell.complete_move(doc)
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell1", uuid, inp["migration_uuid"])["migration"][0] == "post-migrating"
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"][0] is True  # the target copy stays hidden
    assert cross_cell.check_move_committed({**doc, "error": {"Error": "Ferry.UnexpectedTaskState",
                                                             "Cause": "x"}}) == {"committed": False}


def test_a_move_whose_last_step_ended_its_events_and_failed_before_the_switch_ends_them_in_error(
        two_cells, monkeypatch):
    # GIVEN CompleteMoveAcrossCells ended the move's events in the source cell, then failed
    # before it switched the instance mapping
    uuid, inp = server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    complete_move_failing_at("_map_to", doc, monkeypatch)
    assert events_in("cell1", uuid)[resize.EVENT_MIGRATE] == "Success"

    # WHEN its Catch finds it not committed and the move is rolled back
    assert cross_cell.check_move_committed({**doc, "error": {"Error": "Sandbox.Timedout", "Cause": "x"}}) == {
        "committed": False}
    roll_back(doc)

    # THEN the conductor's event, spanning the move, failed with it
    assert instances.cell_of(uuid).name == "cell1"
    assert events_in("cell1", uuid)[resize.EVENT_MIGRATE] == "Error"


def test_a_complete_move_that_failed_before_switching_the_mapping_is_rolled_back(two_cells):
    uuid, inp = server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")

    answer = cross_cell.check_move_committed({**doc, "error": {"Error": "Ferry.InjectedFault", "Cause": "x"}})

    assert answer == {"committed": False}
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is False


def test_a_rollback_after_target_db_setup_refused_leaves_a_server_living_in_the_target_cell_alone(two_cells):
    # GIVEN a server another move took to cell2 (VERIFY_RESIZE there), and a move of it from cell1
    # whose TargetDBSetup then fails (the server is no longer cell1's)
    uuid, inp = server_in_cell1()
    doc = {**run(inp, until="TargetDBSetup"), "migration_uuid": "00000000-0000-4000-8000-00000000beef"}
    run(inp)
    assert instances.cell_of(uuid).name == "cell2"
    before = rows("cell2", uuid, inp["migration_uuid"])
    with pytest.raises((errors.InstanceNotFound, errors.MoveNotPrepared)):  # the source copy is hidden there
        cross_cell.target_db_setup(doc)

    # WHEN the Catch rolls the target cell back
    cross_cell.rollback_target_cell({**doc, "error": {"Error": "Ferry.MoveNotPrepared", "Cause": "x"}})

    # THEN the server stays where it lives, its records there untouched
    assert instances.cell_of(uuid).name == "cell2"
    assert rows("cell2", uuid, inp["migration_uuid"]) == before
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"][0] is True  # the old copy stays hidden


def test_an_image_backed_server_is_snapshotted_and_spawned_from_the_snapshot(two_cells):
    uuid = make_server()
    allow_cross_cell(uuid)
    inp = prepare_move(uuid, BIG, requested_host=TARGET_HOST)

    doc = run(inp, until="CompleteMoveAcrossCells")

    snap = doc["snapshot_prep"]["args"]["snapshot"]
    assert snap["name"] == "vm1-resize-temp"
    with cell_session("cell1") as session:  # only the server's project may see or boot its snapshot
        assert snap["owner"] == session.scalars(select(Instance.project_id).where(Instance.uuid == uuid)).one()
    assert doc["spawn"]["args"]["image"]["id"] == snap["image_id"]
    assert doc["spawn"]["args"]["image"]["cache"] is False  # the destination keeps no copy of it
    assert images_left() == [snap["key"]]
    cross_cell.complete_move(doc)
    assert images_left() == []


@pytest.mark.parametrize("stage", ["PrepResizeAtDest", "PrepResizeOnDestHost", "PrepResizeAtSource",
                                   "PrepSnapshotResizeOnSourceHost", "FinishResizeAtDest", "SpawnOnDestHost",
                                   "CompleteMoveAcrossCells", None])
def test_a_failure_at_any_cross_cell_stage_leaves_the_server_in_its_cell_as_before(two_cells, stage):
    uuid = make_server()
    allow_cross_cell(uuid)
    allocations_before = placement.get_allocations(uuid)
    inp = prepare_move(uuid, BIG, requested_host=TARGET_HOST)

    doc = run(inp, until=stage)
    roll_back(doc)
    roll_back(doc)

    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] is None
    assert rows("cell2", uuid, inp["migration_uuid"])["migration"] is None
    source = rows("cell1", uuid, inp["migration_uuid"])
    assert source["instance"] == (False, states.ACTIVE, None, "cell1-host1", "1")
    assert source["migration"][0] == "error"
    assert images_left() == []
    assert placement.get_allocations(uuid) == allocations_before
    assert placement.get_allocations(inp["migration_uuid"]) == {}
    # the conductor's event, spanning the whole move between cells, failed with it
    assert events_in("cell1", uuid)[resize.EVENT_MIGRATE] == "Error"


def test_a_failed_target_db_setup_is_the_conductors_migrate_event_not_a_destination_step(two_cells):
    # GIVEN a move across cells whose copy into the target cell failed
    uuid, inp = server_in_cell1()
    doc = run(inp, until="TargetDBSetup")

    # WHEN it is rolled back
    roll_back(doc)

    # THEN the error is on the orchestrator's event, and no destination step is shown as having run
    assert events_in("cell1", uuid) == {resize.EVENT_MIGRATE: "Error"}
    assert fault_in_cell1(uuid).host == "cell1-host1"


def test_a_rescheduled_move_whose_next_target_db_setup_fails_ends_the_refused_hosts_prep_event(two_cells):
    # GIVEN a move across cells whose destination refused its claim after PrepCrossCellAtDest began
    # its event, rescheduled (ForgetRefusedClaim keeps only the request and the new destination)
    uuid, inp = server_in_cell1()
    doc = run(inp, until="PrepResizeOnDestHost")
    kept = ("instance_uuid", "migration_uuid", "cell", "request_id", "requested_host", "execution_name", "user_id",
            "project_id", "move", "destination")
    rescheduled = {key: doc[key] for key in kept if key in doc}

    # WHEN the copy into the target cell fails this time and the move is rolled back
    roll_back(rescheduled)

    # THEN no event of the move is left open: the refused host's prep ends with the move's error
    recorded = events_in("cell1", uuid)
    assert recorded[resize.EVENT_MIGRATE] == "Error"
    assert recorded[resize.EVENT_PREP_AT_DEST_CROSS_CELL] == "Error"


def fault_in_cell1(uuid: str) -> InstanceFault:
    with cell_session("cell1") as session:
        [fault] = session.scalars(select(InstanceFault).where(InstanceFault.instance_uuid == uuid))
        return fault


def test_a_target_host_that_may_still_run_the_spawned_guest_leaves_the_server_in_error_shut_off_on_its_source(
        two_cells):
    # GIVEN a move across cells that failed after spawn may have been sent, and DestroyOnDestHost failed
    uuid, inp = server_in_cell1()
    allocations_before = placement.get_allocations(uuid)
    doc = run(inp, until="CompleteMoveAcrossCells")
    doc = {**doc, "error": {"Error": "Ferry.HypervisorError", "Cause": "it broke"},
           "cleanup_error": {"Error": "States.Timeout", "Cause": "no heartbeat from the agent"},
           # KeepCrossCellSourceGuestOff asked the source for the guest without powering it on
           "restored": host_result(doc, doc["move"]["source"]["host"], states.SHUTDOWN)}

    # WHEN the target cell and the move are rolled back (twice: a retry changes nothing)
    for _ in range(2):
        cross_cell.rollback_target_cell(doc)
        resize.rollback_move(doc)

    # THEN the server is back in its cell, on its source, in ERROR and shut off, with its allocations
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] is None
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"] == (False, states.ERROR, None, "cell1-host1", "1")
    assert instance(uuid).power_state == states.SHUTDOWN
    assert placement.get_allocations(uuid) == allocations_before
    assert placement.get_allocations(inp["migration_uuid"]) == {}
    # and the fault names the target host, the guest that may run there and what to do first
    fault = fault_in_cell1(uuid)
    assert fault.message == ("Resize failed and the destination host could not be cleaned up: a guest of "
                             "this server may still run there.")
    assert f"Destroy the guest on {TARGET_HOST} first" in fault.details and "guest_orphan" in fault.details
    assert f"openstack server set --state active {uuid}" in fault.details


def test_a_target_host_that_was_cleaned_up_leaves_the_server_active_as_before(two_cells):
    uuid, inp = server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")

    roll_back(doc)

    assert rows("cell1", uuid, inp["migration_uuid"])["instance"] == (False, states.ACTIVE, None, "cell1-host1", "1")
    assert instance(uuid).power_state == states.RUNNING


# --- quota usage while the server switches cells ----------------------------------------------------------


@pytest.mark.parametrize("order", ["oldest first", "newest first"])
def test_the_switch_to_the_target_cell_counts_the_server_once_at_every_moment(two_cells, monkeypatch, order):
    # GIVEN a move across cells about to make the target copy the server; usage read in either cell order
    uuid, inp = server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    read_cells(monkeypatch, order)
    seen = usage_before_each_call(monkeypatch, PROJECT, cross_cell, "_map_to", "_hide_source")

    # WHEN CompleteMoveAcrossCells shows the target copy, switches the mapping and hides the source copy
    cross_cell.complete_move(doc)
    seen.append(quotas.usage(PROJECT))

    # THEN between every two writes the project uses one server, never two (nor none)
    assert seen == [COUNTED_ONCE] * 3
    assert instances.cell_of(uuid).name == "cell2"


@pytest.mark.parametrize("then", ["retried", "rolled back"])
def test_a_switch_that_failed_between_its_writes_counts_the_server_once_until_it_is_settled(two_cells, monkeypatch,
                                                                                             then):
    # GIVEN CompleteMoveAcrossCells showed the target copy, then failed before switching the mapping
    uuid, inp = server_in_cell1()
    doc = run(inp, until="CompleteMoveAcrossCells")
    complete_move_failing_at("_map_to", doc, monkeypatch)
    assert [rows(cell, uuid, inp["migration_uuid"])["instance"][0] for cell in ("cell1", "cell2")] == [False, False]
    assert quotas.usage(PROJECT) == COUNTED_ONCE

    # WHEN the step runs again, or its Catch finds it uncommitted and rolls the move back
    seen = usage_before_each_call(monkeypatch, PROJECT, cross_cell, "_map_to", "_hide_source")
    if then == "retried":
        cross_cell.complete_move(doc)
    else:
        assert cross_cell.check_move_committed({**doc, "error": {"Error": "RuntimeError", "Cause": "lost"}}) \
            == {"committed": False}
        roll_back(doc)

    # THEN the server counted once at every moment: in its new cell, or back as it was
    assert seen == [COUNTED_ONCE] * (2 if then == "retried" else 1)
    settled = COUNTED_ONCE if then == "retried" else {"instances": 1, "cores": 1, "ram": 512}
    assert quotas.usage(PROJECT) == settled
    assert instances.cell_of(uuid).name == ("cell2" if then == "retried" else "cell1")
