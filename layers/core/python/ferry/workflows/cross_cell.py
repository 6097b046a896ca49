"""Steps of a resize or cold migrate to another cell (the cross-cell branch of ``statemachine/resize.asl.json``).

After SelectMoveDestinations picks a host in another cell than the instance's, the move goes::

    TargetDBSetup → PrepCrossCellAtDest (prep_resize at the destination host)
    → PrepResizeAtSource (prep_snapshot_based_resize_at_source at the source host)
    → FinishCrossCellAtDest (spawn at the destination host) → CompleteMoveAcrossCells

The source cell's records stay the ones the API reads until CompleteMoveAcrossCells: then the
target cell's copy becomes visible, the instance mapping names the target cell and the source
copy is hidden, in that order; the temporary snapshot goes after that, best effort, so an S3
failure cannot roll back a move that finished. A failure rolls back in reverse: ``destroy`` at
the destination once the spawn may have run, ``finish_revert_resize`` at the source once its
guest may be gone, then :func:`rollback_target_cell` (the mapping and hidden flags, the target
copies, then the snapshot object) and the same-cell ``rollback_move`` for the rest.

The state document is the same-cell one with ``target`` (what TargetDBSetup copied),
``snapshot_prep`` / ``snapshotted`` (the source host operation's arguments and result) and
``spawn`` / ``spawned`` (the destination's).

:func:`check_move_committed` serves both branches: it runs when the last step of either failed,
before any rollback (see :mod:`ferry.workflows.resize`).
"""

from __future__ import annotations

import uuid as uuidlib
from typing import Any, cast

from aws_lambda_powertools.metrics import MetricUnit
from botocore.exceptions import BotoCoreError, ClientError
from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from ferry import config, errors, images, network, notifications, volumes
from ferry.compute import actions, instances, states
from ferry.compute.migration_states import (
    CONFIRMED,
    CONFIRMING,
    ERROR,
    FAILED,
    FINISHED,
    MIGRATING,
    POST_MIGRATING,
    PRE_MIGRATING,
    REVERTED,
    REVERTING,
)
from ferry.observability import logger, metrics
from ferry.store.api_models import CellMapping, InstanceMapping
from ferry.store.cell_models import (
    BlockDeviceMapping,
    Instance,
    InstanceAction,
    InstanceActionEvent,
    Migration,
    Tag,
)
from ferry.store.db import api_session, cell_session
from ferry.workflows import cross_cell_settle, error_message, resize
from ferry.workflows.resize import (
    EVENT_FINISH_AT_DEST_CROSS_CELL,
    EVENT_PREP_AT_DEST_CROSS_CELL,
    EVENT_PREP_AT_SOURCE_CROSS_CELL,
)

SNAPSHOT_SUFFIX = "-resize-temp"


def _target(event: dict[str, Any]) -> str:
    return cast(str, event["destination"]["cell"])


def snapshot_image_id(migration_uuid: str) -> str:
    """The id of the move's temporary snapshot: the same for every run of the move's steps."""
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"ferry:cross-cell-snapshot:{migration_uuid}"))


def _delete_snapshot(uuid: str, migration_uuid: str) -> None:
    """Delete the move's temporary snapshot, best effort, once nothing of the move needs it.

    Only called when the move is settled either way (switched to the target cell, or being rolled
    back, nothing spawning from it any more): an S3 failure then is logged and counted
    (``SnapshotDeleteFailed``) and never fails the step. ``ferry audit`` reports the image left
    behind (``snapshot_image_orphan``, its migration no longer moving) and ``ferry audit --fix``
    deletes it.
    """
    image_id = snapshot_image_id(migration_uuid)
    try:
        images.delete_image(image_id)
    except (ClientError, BotoCoreError):
        logger.exception("the move's temporary snapshot could not be deleted: ferry audit --fix removes it",
                         extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "image_id": image_id})
        metrics.add_metric(name="SnapshotDeleteFailed", unit=MetricUnit.Count, value=1)


# --- TargetDBSetup ------------------------------------------------------------------------------


def target_db_setup(event: dict[str, Any]) -> dict[str, Any]:
    """Copy the instance (hidden), its BDMs, tags, actions and events and the migration into the target cell.

    The copies keep their uuids; the migration is marked ``cross_cell_move`` in both cells.
    What this move already copied into the target cell is left as it is, so a re-run copies
    nothing twice. A copy of the server there that is not this move's (an earlier move's
    leftover: no copy of this migration beside it), hidden or visible, is hard-deleted first and
    copied afresh, so none of its block device mappings, tags or migrations outlive it (see
    :func:`_purge_stale_copy`).

    Returns:
        ``{"cell": <target cell>}``.

    Raises:
        MoveNotPrepared: the migration is missing, or the instance mapping names the target cell.
    """
    uuid, migration_uuid, cell, target = event["instance_uuid"], event["migration_uuid"], event["cell"], _target(event)
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        copy_instance = cross_cell_settle.columns(instance)
        migration = resize._get_migration(session, migration_uuid)
        if migration is None:
            raise errors.MoveNotPrepared(f"Migration {migration_uuid} does not exist.")
        migration.cross_cell_move = True
        copy_migration = cross_cell_settle.columns(migration)
        bdms = [cross_cell_settle.columns(b) for b in session.scalars(select(BlockDeviceMapping).where(
            BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.deleted.is_(False)))]
        tags = [t.tag for t in session.scalars(select(Tag).where(Tag.instance_uuid == uuid))]
        acts = _actions_of(session, uuid)
    _purge_stale_copy(target, uuid, migration_uuid)
    with cell_session(target) as session:
        if session.scalars(select(Instance.id).where(Instance.uuid == uuid)).first() is None:
            session.add(Instance(**{**copy_instance, "hidden": True}))
        if session.scalars(select(Migration.id).where(Migration.uuid == migration_uuid)).first() is None:
            session.add(Migration(**{**copy_migration, "cross_cell_move": True}))
        have = set(session.scalars(select(BlockDeviceMapping.uuid).where(BlockDeviceMapping.instance_uuid == uuid)))
        session.add_all(BlockDeviceMapping(**b) for b in bdms if b["uuid"] not in have)
        have_tags = set(session.scalars(select(Tag.tag).where(Tag.instance_uuid == uuid)))
        session.add_all(Tag(instance_uuid=uuid, tag=t) for t in tags if t not in have_tags)
        _sync_actions(session, uuid, acts)
    logger.info("target cell prepared", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                               "source_cell": cell, "target_cell": target})
    return {"cell": target}


def _purge_stale_copy(target: str, uuid: str, migration_uuid: str) -> None:
    """Hard-delete what ``target`` holds of the server unless this move copied it (see :func:`target_db_setup`).

    A visible copy there is stale as well, and is hidden, then removed as a hidden one is: the
    instance mapping names the source cell (``validate_input`` checked it, and the server's task,
    this move's, keeps any other move from switching it), so the API never shows that copy. It is
    an earlier move's, whose CompleteMoveAcrossCells showed it and died before switching the mapping
    while its RollbackTargetCell could not reach this cell; adopted, its block device mappings and
    migrations would become the server's. Removing it is safer than refusing the move: only rows
    nothing reads go (no host, port or volume is touched), where a refusal would leave the server
    unable to move to this cell until a person removed them. The mapping is read again first.

    Raises:
        MoveNotPrepared: the instance mapping names the target cell (the copy there is the server).
        CellCopyNotHidden: the copy was shown again between hiding and removing it.
    """
    with cell_session(target) as session:
        if session.scalars(select(Migration.id).where(Migration.uuid == migration_uuid)).first() is not None:
            return  # a re-run of this move's TargetDBSetup
        copy = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
        visible = copy is not None and not copy.hidden and not copy.deleted
    if visible:
        if instances.cell_of(uuid).name == target:
            raise errors.MoveNotPrepared(f"Instance {uuid} is mapped to cell {target}, the move's target cell.")
        with cell_session(target) as session:
            session.execute(update(Instance).where(Instance.uuid == uuid, Instance.hidden.is_(False))
                            .values(hidden=True))
        logger.warning("an earlier move left a visible copy of the server in the target cell: hidden",
                       extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "target_cell": target})
    if cross_cell_settle.hard_delete_copy(target, uuid, migration_uuid):
        logger.warning("an earlier move's copy of the server was left in the target cell: replaced",
                       extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "target_cell": target})


def _sync_actions(session: Session, uuid: str, acts: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> None:
    """Upsert the instance's actions and their events into ``session``'s cell (by request id and event name)."""
    for action, evs in acts:
        row = session.scalars(select(InstanceAction).where(InstanceAction.instance_uuid == uuid,
                                                           InstanceAction.request_id == action["request_id"])
                              ).one_or_none()
        if row is None:
            row = InstanceAction(**action)
            session.add(row)
            session.flush()
        else:
            row.finish_time, row.message = action["finish_time"], action["message"]
        for ev in evs:
            existing = session.scalars(select(InstanceActionEvent).where(
                InstanceActionEvent.action_id == row.id, InstanceActionEvent.event == ev["event"])).one_or_none()
            if existing is None:
                session.add(InstanceActionEvent(action_id=row.id, **ev))
            else:
                for key in ("finish_time", "result", "traceback", "host", "details"):
                    setattr(existing, key, ev[key])
    session.flush()


def _actions_of(session: Session, uuid: str) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    acts = []
    for action in session.scalars(select(InstanceAction).where(InstanceAction.instance_uuid == uuid)):
        evs = [cross_cell_settle.columns(e, "action_id") for e in session.scalars(select(InstanceActionEvent).where(
            InstanceActionEvent.action_id == action.id))]
        acts.append((cross_cell_settle.columns(action), evs))
    return acts


# CheckMoveCommitted's mark on the target cell's copy of a migration whose move it found not
# committed: the move is rolled back from then on, and a CompleteMoveAcrossCells still running
# (its invocation outlived Step Functions' wait for it) must not switch it. RollbackTargetCell
# removes the copy with its mark.
ABANDONED = FAILED


def _map_to(uuid: str, cell: str, move: dict[str, Any] | None = None) -> None:
    """Map the instance to ``cell``; for the switch of ``move`` (its step's event), only while the
    move is not abandoned, checked under the mapping's lock (:func:`_require_not_abandoned`)."""
    with api_session() as session:
        if move is not None:
            _require_not_abandoned(session, move)
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == uuid)
                        .values(cell_id=_cell_in(session, cell).id))


def _cell_in(session: Session, name: str) -> CellMapping:
    """The cell ``name``'s mapping, read in ``session`` (a second API session would wait on it)."""
    return session.scalars(select(CellMapping).where(CellMapping.name == name)).one()


def _lock_mapping(session: Session, uuid: str) -> str | None:
    """Lock the instance mapping's row (the switch and CheckMoveCommitted take turns on it); the
    name of the cell it names, or None without a mapping or a cell."""
    session.scalars(select(InstanceMapping.id).where(InstanceMapping.instance_uuid == uuid)
                    .with_for_update()).first()
    return session.scalars(select(CellMapping.name).join(InstanceMapping, InstanceMapping.cell_id == CellMapping.id)
                           .where(InstanceMapping.instance_uuid == uuid)).first()


def _require_not_abandoned(session: Session, event: dict[str, Any]) -> None:
    """Lock the instance mapping (in ``session``, the API database's) and refuse a switch of a move
    CheckMoveCommitted has abandoned, or whose target copy is gone (rolled back).

    Raises:
        UnexpectedMigrationState: the move is being rolled back; nothing was written.
    """
    _lock_mapping(session, event["instance_uuid"])
    with cell_session(_cell_in(session, _target(event))) as cell:  # its mapping read here: one API session
        status = cell.scalars(select(Migration.status).where(Migration.uuid == event["migration_uuid"])).first()
    if status is None or status == ABANDONED:
        raise _abandoned(event)


def _abandoned(event: dict[str, Any]) -> errors.UnexpectedMigrationState:
    """The refusal of a switch of a move CheckMoveCommitted abandoned."""
    return errors.UnexpectedMigrationState(
        f"Migration {event['migration_uuid']} was found not committed and is being rolled back: "
        f"instance {event['instance_uuid']} is not switched to cell {_target(event)}.")


def _lives_in_without_this_move(uuid: str, target: str, migration_uuid: str) -> bool:
    """Whether the instance mapping names ``target`` while ``target`` holds no copy of this move's
    migration: the server is there by another move's doing (this one's switch always copies its
    migration first)."""
    try:
        if instances.cell_of(uuid).name != target:
            return False
    except errors.InstanceNotFound:  # no mapping (the server's delete finished): nothing lives there
        return False
    with cell_session(target) as session:
        return session.scalars(select(Migration.id).where(Migration.uuid == migration_uuid)).first() is None


def rollback_target_cell(event: dict[str, Any]) -> dict[str, Any]:
    """Undo the cross-cell parts of a failed move: the server is the source cell's again, and only there.

    Maps the instance back to the source cell, shows the source copies again (instance and
    migration), hard-deletes the target cell's copies, and last deletes the temporary snapshot,
    best effort (an S3 failure leaves the image to ``ferry audit --fix``, never the target
    cell's rows to a later move). The snapshot goes also when the cells' work fails (a target
    cell that does not answer: at each failed try, as nothing spawns from it any more and it
    depends on neither cell). Safe to run whatever
    the move reached, and twice. A server the mapping names in the target cell without this
    move's migration there is left alone (only the snapshot goes): TargetDBSetup refused to
    prepare over it.
    """
    uuid, migration_uuid, cell, target = event["instance_uuid"], event["migration_uuid"], event["cell"], _target(event)
    if target == cell:
        return {}
    try:
        if _lives_in_without_this_move(uuid, target, migration_uuid):
            # TargetDBSetup refused to touch the target cell (MoveNotPrepared): what it holds of the
            # server is the server, which another move took there, not this move's copy.
            logger.error("the server lives in the move's target cell by another move: its records there are "
                         "left alone",
                         extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "target_cell": target})
            return {}
        _map_to(uuid, cell)
        with cell_session(cell) as session:
            session.execute(update(Instance).where(Instance.uuid == uuid).values(hidden=False))
            session.execute(update(Migration).where(Migration.uuid == migration_uuid).values(hidden=False))
        with cell_session(target) as session:  # it may have been shown already: it is a copy again
            session.execute(update(Instance).where(Instance.uuid == uuid).values(hidden=True))
        cross_cell_settle.hard_delete_copy(target, uuid, migration_uuid)
        logger.info("target cell cleaned up", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                                     "target_cell": target})
    finally:
        _delete_snapshot(uuid, migration_uuid)
    return {}


# --- PrepCrossCellAtDest ------------------------------------------------------------------------


def _update_both(event: dict[str, Any], values: dict[str, Any], expected: tuple[str, ...]) -> None:
    """The same migration change in the source cell (compare-and-swapped) and in the target copy."""
    with cell_session(event["cell"]) as session:
        resize._update_migration(session, event["migration_uuid"], values, expected)
    with cell_session(_target(event)) as session:
        session.execute(update(Migration).where(Migration.uuid == event["migration_uuid"]).values(**values))


def prep_resize_at_dest(event: dict[str, Any]) -> dict[str, Any]:
    """Record the destination on both migration copies, bind ports (INACTIVE) and reserve volumes there.

    Records ``compute_prep_snapshot_based_resize_at_dest`` and sends ``instance.resize_prep.start``
    (``compute:<dest>``) once the destination is recorded on the migration, as a move within a
    cell does (its end is owed from then on: see :func:`ferry.workflows.resize._prep_end`).

    Returns:
        ``{"args": <prep_resize arguments>}`` for the destination host (``is_bfv`` as for a move
        within a cell).
    """
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    dest, source = event["destination"], resize._source(event)
    with cell_session(event["cell"]) as session:
        instance = instances.get(session, uuid)
        if instance.task_state != states.RESIZE_PREP:
            raise errors.UnexpectedTaskState(f"Instance {uuid} is in task_state {instance.task_state}, "
                                             f"not {states.RESIZE_PREP}.")
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"],
                            event=EVENT_PREP_AT_DEST_CROSS_CELL, host=dest["host"])
        new_flavor = cast(dict[str, Any], instance.new_flavor)
        is_bfv = instances.is_bfv(session, uuid)
        start = resize._notify(notifications.RESIZE_PREP_START, instance,
                               notifications.compute_publisher(dest["host"]),
                               **resize._move_extra(instance, migration_uuid))
    _update_both(event, {"dest_compute": dest["host"], "dest_node": dest["node"], "dest_host": dest["host"]},
                 (PRE_MIGRATING,))
    resize._publish(start)
    with api_session() as session:
        network.bind_inactive(session, uuid, dest["host"])
        volumes.reserve_on(session, uuid, source["host"], dest["host"])
    return {"args": {"migration_uuid": migration_uuid, "flavor": resize.host_flavor(new_flavor),
                     "same_host": False, "is_bfv": is_bfv}}


# --- PrepResizeAtSource -------------------------------------------------------------------------


def prep_resize_at_source(event: dict[str, Any]) -> dict[str, Any]:
    """Task ``resize_migrating``, migration ``migrating``: the source snapshots and stops the guest next.

    Finishes the destination's prep event, records ``compute_prep_snapshot_based_resize_at_source``
    and sends ``instance.resize_prep.end`` (``compute:<dest>``) and ``instance.resize.start``
    (``compute:<source>``).

    Returns:
        ``{"args": <prep_snapshot_based_resize_at_source arguments>}``: the snapshot
        ``<display name>-resize-temp`` to write, or none for a volume-backed server.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    dest, source, request_id = event["destination"], resize._source(event), event["request_id"]
    with cell_session(cell) as session:
        instances.update_cas(session, uuid, {"task_state": states.RESIZE_MIGRATING},
                             expected_task_state=(states.RESIZE_PREP, states.RESIZE_MIGRATING))
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id,
                             event=EVENT_PREP_AT_DEST_CROSS_CELL, host=dest["host"])
        actions.start_event(session, instance_uuid=uuid, request_id=request_id,
                            event=EVENT_PREP_AT_SOURCE_CROSS_CELL, host=source["host"])
        instance = instances.get(session, uuid)
        bfv = instances.is_bfv(session, uuid) or not instance.image_ref
        name, project_id = instance.display_name, instance.project_id
        extra = resize._move_extra(instance, migration_uuid)
        pending = [
            resize._notify(notifications.RESIZE_PREP_END, instance, notifications.compute_publisher(dest["host"]),
                           **extra),
            resize._notify(notifications.RESIZE_START, instance, notifications.compute_publisher(source["host"]),
                           **extra),
        ]
    _update_both(event, {"status": MIGRATING}, (PRE_MIGRATING, MIGRATING))
    resize._publish(*pending)
    snapshot = None
    if not bfv:
        image_id = snapshot_image_id(migration_uuid)
        snapshot = {"bucket": config.get().image_bucket, "key": f"{images.PREFIX}{image_id}",
                    "data_prefix": images.data_prefix(image_id), "image_id": image_id,
                    "name": f"{name}{SNAPSHOT_SUFFIX}", "owner": project_id}
    return {"args": {"migration_uuid": migration_uuid, "snapshot": snapshot, "clean_shutdown": True}}


# --- FinishCrossCellAtDest ----------------------------------------------------------------------


def finish_resize_at_dest(event: dict[str, Any]) -> dict[str, Any]:
    """The source guest is gone and the snapshot is written: spawn at the destination next.

    Migration ``post-migrating``, task ``resize_migrated`` (``instance.resize.end``,
    ``compute:<source>``), then task ``resize_finish``, the
    ``compute_finish_snapshot_based_resize_at_dest`` event and ``instance.resize_finish.start``
    (``compute:<dest>``).

    Returns:
        ``{"args": <spawn arguments>}``: the new flavor, the snapshot (none when volume-backed),
        the ports, the volumes reserved on the destination, and ``power_on`` if it was running.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    dest, source, request_id = event["destination"], resize._source(event), event["request_id"]
    snapshotted = event.get("snapshotted") or {}
    pending = []
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        if instance.task_state == states.RESIZE_MIGRATING:
            instances.update_cas(session, uuid, {"task_state": states.RESIZE_MIGRATED},
                                 expected_task_state=(states.RESIZE_MIGRATING,))
            actions.finish_event(session, instance_uuid=uuid, request_id=request_id,
                                 event=EVENT_PREP_AT_SOURCE_CROSS_CELL, host=source["host"])
            instance = instances.get(session, uuid)
        # On every run: one that failed after its commit (retried) did not publish it; a repeat
        # carries the same message id.
        pending.append(resize._notify(notifications.RESIZE_END, instance,
                                      notifications.compute_publisher(source["host"]),
                                      **resize._move_extra(instance, migration_uuid)))
        instances.update_cas(session, uuid, {"task_state": states.RESIZE_FINISH},
                             expected_task_state=(states.RESIZE_MIGRATED, states.RESIZE_FINISH))
        actions.start_event(session, instance_uuid=uuid, request_id=request_id,
                            event=EVENT_FINISH_AT_DEST_CROSS_CELL, host=dest["host"])
        instance = instances.get(session, uuid)
        pending.append(resize._notify(notifications.RESIZE_FINISH_START, instance,
                                      notifications.compute_publisher(dest["host"]),
                                      **resize._move_extra(instance, migration_uuid)))
        name, flavor = instance.display_name, cast(dict[str, Any], instance.new_flavor)
        power_on = bool(snapshotted.get("was_running", instance.old_vm_state != states.STOPPED))
    _update_both(event, {"status": POST_MIGRATING}, (MIGRATING, POST_MIGRATING))
    with api_session() as session:
        ports = resize._ports(session, uuid)
    snap = snapshotted.get("snapshot")
    image = None
    if snap:
        image = {"id": snap["image_id"], "bucket": config.get().image_bucket,
                 "key": f"{images.PREFIX}{snap['image_id']}", "sha256": snap["sha256"],
                 "cache": False}  # deleted once the move settles: no host keeps a copy
    resize._publish(*pending)
    return {"args": {"name": name, "flavor": resize.host_flavor(flavor), "image": image, "ports": ports,
                     "volumes": resize._volumes_on(dest["host"], uuid, cell), "power_on": power_on}}


# --- CompleteMoveAcrossCells --------------------------------------------------------------------


def _hide_source(cell: str, uuid: str, migration_uuid: str) -> None:
    """Hide the source cell's copy, with no task, unless a revert owns it (conditional, idempotent).

    See :func:`ferry.workflows.cross_cell_settle.hide_source_copy`.
    """
    cross_cell_settle.hide_source_copy(cell, uuid, migration_uuid)


def _mapped_to_target(event: dict[str, Any]) -> bool:
    """Whether the instance mapping names the target cell; a server gone from the mapping counts as
    moved (it can only have been deleted once the target copy was the server)."""
    try:
        return instances.cell_of(event["instance_uuid"]).name == _target(event)
    except errors.InstanceNotFound:
        return True


def _finish_switch(event: dict[str, Any]) -> None:
    """The end of a switch that committed: the source copy hidden when the mapping names the target
    cell (and no revert owns it), ``instance.resize_finish.end`` sent (see
    :func:`ferry.workflows.resize.announce_finished`), then the snapshot deleted, best effort."""
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    if _mapped_to_target(event):
        _hide_source(event["cell"], uuid, migration_uuid)
        resize.announce_finished(event, _target(event))
    _delete_snapshot(uuid, migration_uuid)


def _abandon_unless_switched(event: dict[str, Any]) -> bool:
    """Under the instance mapping's lock, where CompleteMoveAcrossCells switches it: True when the
    switch (or a settle) happened after all; else the target copy of the migration is marked
    :data:`ABANDONED` (the switch then refuses), and False."""
    with api_session() as session:
        mapped = _lock_mapping(session, event["instance_uuid"])
        source, target = _cell_in(session, event["cell"]), _cell_in(session, _target(event))
        if mapped in (None, target.name) or _settled_since(event, (source, target)):
            return True
        with cell_session(target) as cell:
            cell.execute(update(Migration).where(Migration.uuid == event["migration_uuid"]).values(status=ABANDONED))
    logger.info("move abandoned: its rollback may begin", extra={
        "instance_uuid": event["instance_uuid"], "migration_uuid": event["migration_uuid"]})
    return False


def _settled_since(event: dict[str, Any], cells: tuple[str | CellMapping, ...] | None = None) -> bool:
    """Whether the owner has confirmed or reverted the move since this step first ran (on either copy).

    A migration in ``error`` counts too. Before the switch only this execution's own RollbackMove
    puts it there, once CheckMoveCommitted has answered (``statemachine/resize.asl.json``;
    auto-confirm and ``ferry audit --fix`` leave it alone while the source copy has its task and
    this execution runs): a late run of this step then finds the move rolled back and must not
    switch it. After the switch a confirm or revert
    that failed did (FailConfirm; FailRevert, with the server ERROR in the source cell and the target
    copy possibly gone): rolling the move back would then act on what that settle left.

    ``cells``: the source and target cells' mappings, when the caller holds an API session.
    """
    settling = (CONFIRMING, CONFIRMED, REVERTING, REVERTED, ERROR)
    for cell in cells or (event["cell"], _target(event)):
        with cell_session(cell) as session:
            status = session.scalars(select(Migration.status).where(Migration.uuid == event["migration_uuid"])).first()
        if status in settling:
            return True
    return False


def _require_move_task(cell: str, uuid: str) -> None:
    """Refuse to switch a server whose source copy is no longer this move's (``resize_finish``).

    Raises:
        UnexpectedTaskState: an os-resetState, or a move started after it, changed the task.
    """
    with cell_session(cell) as session:
        task_state = instances.get(session, uuid).task_state
    if task_state != states.RESIZE_FINISH:
        raise errors.UnexpectedTaskState(
            f"Instance {uuid} is in task_state {task_state}, not {states.RESIZE_FINISH}: the move is not switched.")


def complete_move(event: dict[str, Any]) -> dict[str, Any]:
    """VERIFY_RESIZE in the target cell: the target copy shows, the mapping follows, the snapshot goes.

    Brings the target copy up to date (vm_state resized, task None, new flavor, destination host
    and node, the power state ``spawn`` reported, the actions and events) and shows it; maps the
    instance to the target cell; hides the source copy; both migration copies ``finished``; the
    destination's port bindings active and volume attachments attached; the move's
    ``conductor_migrate_server`` event ends with its last step's. Sends
    ``instance.resize_finish.end`` (``compute:<dest>``). Last, once the move has committed,
    deletes the temporary snapshot, best effort: an S3 failure is logged and cannot fail (and so
    roll back) the finished move.

    Run again after the switch (or after a confirm or revert took over), it only finishes what is
    left: the source copy hidden if the mapping names the target cell and no revert owns the
    copy, and the snapshot deleted.
    """
    uuid, migration_uuid, cell, target = event["instance_uuid"], event["migration_uuid"], event["cell"], _target(event)
    dest, request_id = event["destination"], event["request_id"]
    spawned = event.get("spawned") or {}
    if _settled_since(event) or _mapped_to_target(event):
        # An earlier run switched the mapping, and a confirm or revert may have taken over since:
        # finish the switch without undoing either.
        _finish_switch(event)
        return {}
    _require_move_task(cell, uuid)  # before anything is written (and again where the source cell is)
    with api_session() as session:
        _require_not_abandoned(session, event)  # and again where the mapping is switched
        network.activate(session, uuid, dest["host"])
        volumes.complete_on(session, uuid, dest["host"])
    with cell_session(cell) as session:
        # The source copy must still be this move's (an os-resetState, or a move started after it,
        # changed its task): the switch is then refused, and CheckMoveCommitted rolls the move back.
        instances.update_cas(session, uuid, {"task_state": states.RESIZE_FINISH},
                             expected_task_state=(states.RESIZE_FINISH,))
        instance = instances.get(session, uuid)
        default_power = states.SHUTDOWN if instance.old_vm_state == states.STOPPED else states.RUNNING
        resized = {**cross_cell_settle.columns(instance, "hidden", "uuid", "created_at"), "vm_state": states.RESIZED,
                   "task_state": None, "flavor": instance.new_flavor, "host": dest["host"], "node": dest["node"],
                   "power_state": int(spawned.get("power_state", default_power))}
        resize._update_migration(session, migration_uuid, {"status": FINISHED}, (POST_MIGRATING, FINISHED))
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id,
                             event=EVENT_FINISH_AT_DEST_CROSS_CELL, host=dest["host"])
        # The conductor's event spans the whole move between cells (see resize.select_destinations).
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=resize.EVENT_MIGRATE)
        acts = _actions_of(session, uuid)
    # The source copy keeps its host and old flavor: it is what a revert restores.
    with cell_session(target) as session:
        finished = update(Migration).where(Migration.uuid == migration_uuid, Migration.status != ABANDONED)
        if cast(CursorResult[Any], session.execute(finished.values(status=FINISHED))).rowcount != 1:
            raise _abandoned(event)
        session.execute(update(Instance).where(Instance.uuid == uuid).values(**resized, hidden=False))
        _sync_actions(session, uuid, acts)
        moved = instances.get(session, uuid)
        end = resize._notify(notifications.RESIZE_FINISH_END, moved, notifications.compute_publisher(dest["host"]),
                             **resize._move_extra(moved, migration_uuid))
    _map_to(uuid, target, move=event)
    _hide_source(cell, uuid, migration_uuid)
    resize._publish(end)
    logger.info("server resized across cells", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                                      "host": dest["host"], "target_cell": target})
    _delete_snapshot(uuid, migration_uuid)
    return {}


# --- CheckMoveCommitted ---------------------------------------------------------------------------


def check_move_committed(event: dict[str, Any]) -> dict[str, Any]:
    """Whether the move's last step committed before it failed (both branches' CheckMoveCommitted).

    The ``Catch`` of MarkResized and of CompleteMoveAcrossCells comes here before any rollback. A
    step that committed and then failed (its response lost, the function timed out after the
    commit) has put the server in VERIFY_RESIZE on the destination, where its owner may already
    be confirming or reverting it: rolling the move back then would destroy the guest the records
    point at. So the move stands, and the execution ends as an undisturbed one would.

    Committed means, within one cell, that the migration is ``finished`` or beyond (a confirm or
    revert that failed since left it ``error``); across cells,
    that the instance mapping names the target cell (the switch that makes the target copy the
    server), or that either migration copy is being (or was) confirmed or reverted, or is in
    ``error`` (see :func:`_settled_since`). A committed move between cells is finished here as
    the step would have finished it: the source copy hidden whenever the mapping names the target
    cell (also when a confirm has taken over meanwhile; not when a revert owns the copy),
    ``instance.resize_finish.end`` sent while the move waits in VERIFY_RESIZE (the failed step may
    not have sent it; a copy it did send has the same ``message_id``), and the temporary snapshot
    deleted, best effort. A move not committed keeps its snapshot for RollbackTargetCell to
    delete. Within one cell the same end is sent when the migration is ``finished``.

    A move between cells found not committed is abandoned, under the instance mapping's lock:
    its target copy of the migration is marked :data:`ABANDONED`, so a CompleteMoveAcrossCells
    still running (its invocation outlived Step Functions' wait) never switches the mapping to the
    copy the rollback removes. Run again, it answers the same.

    Returns:
        ``{"committed": bool}``.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    if not resize.is_cross_cell(event):
        with cell_session(cell) as session:
            migration = resize._get_migration(session, migration_uuid)
            # ``error`` too: before MarkResized commits nothing but this execution's own RollbackMove,
            # after CheckMoveCommitted answered, puts the migration there; after it, a confirm or
            # revert that failed did (FailConfirm, FailRevert), and the guest on the destination may
            # be the server's only one.
            committed = migration is not None and migration.status in (*resize.MARKED, ERROR)
        if committed:
            resize.announce_finished(event, cell)
    else:
        committed = _abandon_unless_switched(event)
        if committed:
            _finish_switch(event)
    if committed:
        logger.warning("the move's last step failed after it committed: the move stands",
                       extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                              "error": error_message(event.get("error") or {})})
    return {"committed": committed}
