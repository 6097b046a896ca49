"""Confirming, reverting and deleting a server after a move between cells.

A cross-cell move leaves the server in both cell databases under one uuid: the target cell's
copy visible (VERIFY_RESIZE on the destination), the source cell's copy hidden (the old flavor
on the source host), the instance mapping naming the target cell, and the migration
(``cross_cell_move``) in both cells. The confirm, revert and delete workflows use the helpers
here when the migration they settle is such a move:

* confirm and delete hard-delete the source cell's copy (:func:`hard_delete_copy`; a copy the move
  left visible after it switched the instance mapping is hidden first, see :func:`hide_source_copy`);
* revert first brings the source cell's copy up to date and makes it the server again
  (:func:`flip_to_source_cell`, step FlipToSourceCell), then hard-deletes the target cell's copy;
  a failure of that step is undone by :func:`undo_flip` (the server stays in VERIFY_RESIZE in the
  target cell).

Nova's event names are used: ``conductor_*_snapshot_based_resize`` for the whole operation and
``compute_*_snapshot_based_resize_at_source``/``_at_dest`` for each host's part.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult, delete, or_, select, update
from sqlalchemy.orm import Session

from ferry import errors, hosts
from ferry.compute import actions, instances, migration_states, states
from ferry.observability import logger
from ferry.store.api_models import CellMapping, InstanceMapping
from ferry.store.cell_models import (
    BlockDeviceMapping,
    Instance,
    InstanceAction,
    InstanceActionEvent,
    Migration,
)
from ferry.store.db import api_session, cell_session

EVENT_CONFIRM = "conductor_confirm_snapshot_based_resize"
EVENT_CONFIRM_AT_SOURCE = "compute_confirm_snapshot_based_resize_at_source"
EVENT_REVERT = "conductor_revert_snapshot_based_resize"
EVENT_REVERT_AT_DEST = "compute_revert_snapshot_based_resize_at_dest"
EVENT_FINISH_REVERT_AT_SOURCE = "compute_finish_revert_snapshot_based_resize_at_source"

# Columns of an instance that the owner can change while it is resized, carried back to the
# source cell's copy by a revert.
_CARRIED_COLUMNS = ("display_name", "display_description", "hostname", "metadata_items", "locked", "locked_by",
                    "key_name", "old_flavor", "new_flavor", "old_vm_state", "power_state")
_BDM_COLUMNS = ("uuid", "source_type", "destination_type", "device_name", "boot_index", "volume_id", "image_id", "tag",
                "volume_size", "guest_format", "delete_on_termination", "attachment_id")


def cell_of_host(host: str) -> str:
    """The name of the cell ``host`` is mapped to.

    Raises:
        ComputeHostNotFound: the host is not mapped.
    """
    cell = hosts.cell_of_host(host)
    if cell is None:
        raise errors.ComputeHostNotFound(f"Compute host {host} could not be found.")
    return cell


def cells_of(migration: Migration, target_cell: str) -> dict[str, str] | None:
    """``{"source_cell", "target_cell"}`` of a cross-cell migration, or None for a move within a cell."""
    if not migration.cross_cell_move:
        return None
    return {"source_cell": cell_of_host(str(migration.source_compute)), "target_cell": target_cell}


def cross_cell(event: dict[str, Any]) -> dict[str, str] | None:
    """The cells of the move an execution settles, as its first step named them (None: same cell)."""
    return (event.get("move") or {}).get("cross_cell")


def revert_cell(event: dict[str, Any]) -> str:
    """The cell a revert's record of the server is in: the source cell once FlipToSourceCell ran."""
    cells = cross_cell(event)
    if cells is not None and "flipped" in event:
        return cells["source_cell"]
    return str(event["cell"])


def _copy_of(session: Session, instance_uuid: str) -> Instance | None:
    return session.scalars(select(Instance).where(Instance.uuid == instance_uuid)).one_or_none()


def columns(row: Any, *skip: str) -> dict[str, Any]:
    """A row's column values by attribute name, without the surrogate key and ``skip``."""
    mapper = row.__class__.__mapper__
    return {attr.key: getattr(row, attr.key) for attr in mapper.column_attrs if attr.key not in ("id", *skip)}


def carry_older_migrations(cell: str, instance_uuid: str, migration_uuid: str) -> None:
    """Copy the server's earlier migrations in ``cell`` to the cell it lives in, where they are missing.

    A copy about to be removed takes the history of the server's earlier moves with it otherwise
    (``os-migrations`` would lose them, or list records of a server no cell holds).
    """
    try:
        home = instances.cell_of(instance_uuid).name
    except errors.InstanceNotFound:
        return
    if home == cell:
        return
    with cell_session(cell) as session:
        older = [columns(m) for m in session.scalars(select(Migration).where(
            Migration.instance_uuid == instance_uuid, Migration.uuid != migration_uuid))]
    if not older:
        return
    with cell_session(home) as session:
        present = set(session.scalars(select(Migration.uuid).where(Migration.instance_uuid == instance_uuid)))
        session.add_all(Migration(**values) for values in older if values["uuid"] not in present)


def hide_source_copy(cell: str, instance_uuid: str, migration_uuid: str) -> bool:
    """Hide the server's copy in ``cell``, the source cell of move ``migration_uuid``, with no task.

    Only while ``cell`` holds that move's migration (``cross_cell_move``, not deleted): once a
    confirm removed the move's records there, the copy in ``cell`` can only be a newer move's (one
    back to ``cell``, which may be the server), never this move's source copy. Nothing changes
    either when a revert owns that copy (``cell``'s copy of the migration is ``reverting`` or
    ``reverted``, or the copy's task is ``resize_reverting``: FlipToSourceCell writes both in one
    transaction and then makes the copy the server again), when the copy runs any task but this
    move's last (``resize_finish``: an os-resetState and a newer move may have given it another),
    or when the copy is gone. The
    conditions are part of the one UPDATE, and the task is on the row it updates (a concurrent
    write of it is re-read before the update applies), so a revert flipping the server back at
    the same moment is never undone by it. Idempotent.

    Returns:
        Whether the copy changed (it was visible, or ran a task).
    """
    of_this_move = select(Migration.id).where(
        Migration.uuid == migration_uuid, Migration.instance_uuid == instance_uuid,
        Migration.cross_cell_move.is_(True), Migration.deleted.is_(False)).exists()
    owned_by_revert = select(Migration.id).where(
        Migration.uuid == migration_uuid,
        Migration.status.in_((migration_states.REVERTING, migration_states.REVERTED))).exists()
    with cell_session(cell) as session:
        result = cast(CursorResult[Any], session.execute(
            update(Instance)
            .where(Instance.uuid == instance_uuid, Instance.deleted.is_(False), of_this_move, ~owned_by_revert,
                   or_(Instance.task_state.is_(None), Instance.task_state == states.RESIZE_FINISH),
                   or_(Instance.hidden.is_(False), Instance.task_state.is_not(None)))
            .values(hidden=True, task_state=None)))
        return result.rowcount > 0


def _hide_copy_left_visible(cell: str, instance_uuid: str, migration_uuid: str) -> bool:
    """Hide the visible copy in ``cell`` when it is a move's source copy that the move failed to hide.

    That is when the instance mapping names another cell (the move switched it: the copy there is
    the server) and ``cell`` holds the move's migration, which no revert owns. CompleteMoveAcrossCells
    that died between the switch and hiding the source, with the owner confirming meanwhile, left
    servers so; their confirm or delete would otherwise fail on the visible copy every time.

    Returns:
        Whether the copy is hidden now.
    """
    try:
        home = instances.cell_of(instance_uuid).name
    except errors.InstanceNotFound:
        return False
    if home == cell:
        return False
    with cell_session(cell) as session:
        status = session.scalars(select(Migration.status).where(
            Migration.uuid == migration_uuid, Migration.instance_uuid == instance_uuid,
            Migration.cross_cell_move.is_(True))).one_or_none()
    # hide_source_copy refuses a copy a revert owns.
    if status is None or not hide_source_copy(cell, instance_uuid, migration_uuid):
        return False
    logger.warning("a move's source copy was still visible after the mapping switch: hidden before its removal",
                   extra={"instance_uuid": instance_uuid, "cell": cell, "mapped_cell": home,
                          "migration_uuid": migration_uuid})
    return True


def hard_delete_copy(cell: str, instance_uuid: str, migration_uuid: str) -> bool:
    """Remove a hidden copy of a server from ``cell``: the instance row, its block device mappings,
    tags, actions and their events, faults, and its migrations (idempotent). The server's earlier
    migrations are copied first to the cell it lives in, so its history stays listed.

    A visible copy is hidden first when it is the source copy of move ``migration_uuid`` that the
    move left visible after switching the instance mapping to another cell (see
    :func:`_hide_copy_left_visible`); any other visible copy is the server and is kept.

    Returns:
        Whether anything was removed.

    Raises:
        CellCopyNotHidden: the server's row in that cell is visible (it is the server, not a copy).
    """
    with cell_session(cell) as session:
        instance = _copy_of(session, instance_uuid)
        visible = instance is not None and not instance.hidden and not instance.deleted
    if visible and not _hide_copy_left_visible(cell, instance_uuid, migration_uuid):
        raise errors.CellCopyNotHidden(
            f"Instance {instance_uuid} is visible in cell {cell}: it is not a copy to remove.")
    carry_older_migrations(cell, instance_uuid, migration_uuid)
    with cell_session(cell) as session:
        removed = instances.purge(session, instance_uuid)
    if removed:
        logger.info("copy of the server removed from a cell",
                    extra={"instance_uuid": instance_uuid, "cell": cell, "migration_uuid": migration_uuid})
    return removed


def _point_mapping_at(instance_uuid: str, cell: str) -> None:
    with api_session() as session:
        cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == cell)).one()
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == instance_uuid)
                        .values(cell_id=cell_id))


def _set_hidden(cell: str, instance_uuid: str, hidden: bool, values: dict[str, Any] | None = None) -> None:
    with cell_session(cell) as session:
        session.execute(update(Instance).where(Instance.uuid == instance_uuid, Instance.deleted.is_(False))
                        .values(hidden=hidden, **(values or {})))


def _sync_actions(target: Session, source: Session, instance_uuid: str) -> None:
    """Actions and events recorded in the target cell while resized, written into the source cell."""
    for action in target.scalars(select(InstanceAction).where(InstanceAction.instance_uuid == instance_uuid)
                                 .order_by(InstanceAction.id)):
        copy = source.scalars(select(InstanceAction).where(
            InstanceAction.instance_uuid == instance_uuid, InstanceAction.request_id == action.request_id,
            InstanceAction.action == action.action)).one_or_none()
        if copy is None:
            copy = InstanceAction(action=action.action, instance_uuid=instance_uuid, request_id=action.request_id,
                                  user_id=action.user_id, project_id=action.project_id,
                                  start_time=action.start_time)
            source.add(copy)
            source.flush()
        copy.finish_time, copy.message = action.finish_time, action.message
        for event in target.scalars(select(InstanceActionEvent).where(InstanceActionEvent.action_id == action.id)):
            mirror = source.scalars(select(InstanceActionEvent).where(
                InstanceActionEvent.action_id == copy.id, InstanceActionEvent.event == event.event)).one_or_none()
            if mirror is None:
                mirror = InstanceActionEvent(action_id=copy.id, event=event.event, start_time=event.start_time)
                source.add(mirror)
            for column in ("finish_time", "result", "traceback", "host", "details"):
                setattr(mirror, column, getattr(event, column))
    source.flush()


def _sync_bdms(target: Session, source: Session, instance_uuid: str) -> None:
    """The source cell's block device mappings become those of the target cell (a volume attached
    or detached while the server was resized is kept or dropped)."""
    current = [{column: getattr(b, column) for column in _BDM_COLUMNS} for b in target.scalars(
        select(BlockDeviceMapping).where(BlockDeviceMapping.instance_uuid == instance_uuid,
                                         BlockDeviceMapping.deleted.is_(False)).order_by(BlockDeviceMapping.id))]
    source.execute(delete(BlockDeviceMapping).where(BlockDeviceMapping.instance_uuid == instance_uuid))
    source.flush()
    for values in current:
        source.add(BlockDeviceMapping(instance_uuid=instance_uuid, **values))
    source.flush()


def flip_to_source_cell(event: dict[str, Any]) -> dict[str, Any]:
    """FlipToSourceCell: make the source cell's copy the server again, for a cross-cell revert.

    In order, each write absolute so the step can run twice: block device mappings, actions and
    events and the migration (status ``reverting``) are written into the source cell; the source
    copy takes the target copy's owner-visible fields, vm_state ``resized`` and task
    ``resize_reverting`` and becomes visible; the instance mapping names the source cell; the
    target copy is hidden. The start of ``compute_revert_snapshot_based_resize_at_dest`` is
    recorded. A failure is undone by :func:`undo_flip`.

    Returns:
        ``{"cell": <source cell>}`` (the state machine keeps it as ``$.flipped``).

    Raises:
        InstanceNotFound: a copy is missing in one of the cells.
    """
    cells = cross_cell(event)
    assert cells is not None, "FlipToSourceCell runs for cross-cell moves only"
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    source_cell, target_cell = cells["source_cell"], cells["target_cell"]
    dest = event["move"]["dest"]["host"]
    with cell_session(target_cell) as target, cell_session(source_cell) as source:
        visible = _copy_of(target, uuid)
        hidden = _copy_of(source, uuid)
        if visible is None or visible.deleted or hidden is None or hidden.deleted:
            # Its owner may read this in a fault: the cell is named by its part in the move only.
            raise errors.InstanceNotFound(
                f"Instance {uuid} has no copy in the move's {'source' if visible is not None else 'target'} cell.")
        _sync_bdms(target, source, uuid)
        _sync_actions(target, source, uuid)
        migration = target.scalars(select(Migration).where(Migration.uuid == migration_uuid)).one()
        copied = {c: getattr(migration, c) for c in ("source_compute", "source_node", "dest_compute", "dest_node",
                                                     "dest_host", "old_instance_type_id", "new_instance_type_id",
                                                     "migration_type", "user_id", "project_id")}
        mirror = source.scalars(select(Migration).where(Migration.uuid == migration_uuid)).one_or_none()
        if mirror is None:
            mirror = Migration(uuid=migration_uuid, instance_uuid=uuid, cross_cell_move=True, hidden=False,
                               status=migration_states.REVERTING, **copied)
            source.add(mirror)
        for column, value in copied.items():
            setattr(mirror, column, value)
        mirror.status = migration_states.REVERTING
        for column in _CARRIED_COLUMNS:
            setattr(hidden, column, getattr(visible, column))
        hidden.vm_state, hidden.task_state = states.RESIZED, states.RESIZE_REVERTING
    _set_hidden(source_cell, uuid, False)
    _point_mapping_at(uuid, source_cell)
    _set_hidden(target_cell, uuid, True)
    with cell_session(source_cell) as session:
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"],
                            event=EVENT_REVERT_AT_DEST, host=dest)
    logger.info("server flipped back to its source cell",
                extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "cell": source_cell})
    return {"cell": source_cell}


def undo_flip(event: dict[str, Any], error: dict[str, Any]) -> None:
    """Rollback of FlipToSourceCell (idempotent, and harmless when it never ran).

    The target copy is the server again (visible, the mapping names its cell), the source copy is
    hidden with no task, and the source cell's copy of the migration is ``finished`` again; the
    destination's event the flip started goes back with the server (:func:`_return_dest_event`,
    ended with ``error``); the caller then puts the target cell's records back to VERIFY_RESIZE.
    """
    cells = cross_cell(event)
    if cells is None:
        return
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    _set_hidden(cells["target_cell"], uuid, False)
    _point_mapping_at(uuid, cells["target_cell"])
    _set_hidden(cells["source_cell"], uuid, True, {"task_state": None})
    with cell_session(cells["source_cell"]) as session:
        session.execute(update(Migration).where(Migration.uuid == migration_uuid,
                                                Migration.status == migration_states.REVERTING)
                        .values(status=migration_states.FINISHED))
    _return_dest_event(cells, uuid, event["request_id"], error)
    logger.warning("revert between cells undone: the server stays in its target cell",
                   extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "cell": cells["target_cell"]})


def _return_dest_event(cells: dict[str, str], instance_uuid: str, request_id: str, error: dict[str, Any]) -> None:
    """The ``_at_dest`` event FlipToSourceCell started in the source cell, ended with ``error`` in
    the target cell (the server's record again), then dropped from the source cell's hidden copy,
    which a later flip fills from the target cell: the undone revert's action does not show it
    running for ever. Written before it is dropped, so a step run twice loses nothing."""
    with cell_session(cells["source_cell"]) as session:
        started = session.execute(
            select(InstanceActionEvent.id, InstanceActionEvent.start_time, InstanceActionEvent.host)
            .join(InstanceAction, InstanceAction.id == InstanceActionEvent.action_id)
            .where(InstanceAction.instance_uuid == instance_uuid, InstanceAction.request_id == request_id,
                   InstanceActionEvent.event == EVENT_REVERT_AT_DEST)).first()
    if started is None:
        return
    with cell_session(cells["target_cell"]) as session:
        actions.start_event(session, instance_uuid=instance_uuid, request_id=request_id, event=EVENT_REVERT_AT_DEST,
                            host=started.host, start_time=started.start_time)
        actions.finish_event(session, instance_uuid=instance_uuid, request_id=request_id, event=EVENT_REVERT_AT_DEST,
                             host=started.host, error=error)
    with cell_session(cells["source_cell"]) as session:
        session.execute(delete(InstanceActionEvent).where(InstanceActionEvent.id == started.id))


def where_things_are(instance_uuid: str, cells: dict[str, str]) -> str:
    """``"The instance mapping names cell2; cell1 holds a visible copy; …"`` for a fault's details."""
    with api_session() as session:
        mapping = session.scalars(select(InstanceMapping).where(
            InstanceMapping.instance_uuid == instance_uuid)).one_or_none()
        mapped = mapping.cell.name if mapping is not None and mapping.cell is not None else "no cell"
    parts = [f"The instance mapping names {mapped}."]
    for cell in (cells["source_cell"], cells["target_cell"]):
        with cell_session(cell) as session:
            copy = _copy_of(session, instance_uuid)
            if copy is None or copy.deleted:
                parts.append(f"{cell} holds no copy.")
            else:
                parts.append(f"{cell} holds a {'hidden' if copy.hidden else 'visible'} copy on {copy.host}.")
    return " ".join(parts)


def instance_in(cell: str, instance_uuid: str) -> Instance:
    """The visible instance in ``cell`` (see :func:`ferry.compute.instances.get`)."""
    with cell_session(cell) as session:
        return instances.get(session, instance_uuid)
