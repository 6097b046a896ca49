"""Steps of the delete workflow (``statemachine/delete.asl.json``).

FindResizeToConfirm → (a server with a resize to settle) ConfirmAtSource (host agent, skipped
when the source host is down) → ConfirmBeforeDelete → DestroyAtHost (host agent, skipped for a
server on no host) → FinishDelete; a step that fails runs FailDelete so the owner sees ERROR
with a fault and can delete again.

A server deleted in VERIFY_RESIZE is confirmed first, as Nova does: the source forgets the old
guest and disks, the migration's allocation and the source's bindings and attachments go, and
the migration is ``confirmed``. Whether there is such a migration is read from the store by the
first step, so the compute API's delete call does not need to know. After a move between cells
the source cell's hidden copy is hard-deleted as a confirm does (the source cell is found through
the source host's mapping and passed on as ``confirm.source_cell``).
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ferry import errors, hosts, network, notifications, placement, volumes
from ferry.compute import actions, instances, migration_states, server_groups, states
from ferry.observability import logger, metrics
from ferry.store import db
from ferry.store.api_models import InstanceMapping, Volume, VolumeAttachment, utcnow
from ferry.store.cell_models import BlockDeviceMapping, Instance, Migration
from ferry.store.db import CELL0_NAME, api_session, cell_session
from ferry.workflows import confirm_resize, cross_cell_settle, fault_details, owner_cause

EVENT_TERMINATE = "compute_terminate_instance"

# Migrations a delete settles first: awaiting confirmation or being confirmed, or left in error by
# a failed confirm or revert while still holding their allocation.
_TO_CONFIRM = (migration_states.FINISHED, migration_states.CONFIRMING)


def find_resize_to_confirm(event: dict[str, Any]) -> dict[str, Any]:
    """The server's migration a delete must confirm first, or ``{}`` when there is none.

    The delete's first step: it takes the request first (the server still ``deleting`` under
    this request's action, ``compute_terminate_instance`` started: :func:`actions.take_request`).
    The migration is the newest that is ``finished`` or ``confirming``, or in ``error`` while
    still holding an allocation. Records the start of ``compute_confirm_resize`` (after a move
    between cells ``compute_confirm_snapshot_based_resize_at_source``) under the delete's action
    and sends ``instance.resize_confirm.start``.

    Returns:
        ``{"migration_uuid", "host" (the source), "queue_url" (None when the source is down: its
        clean-up is skipped), "same_host", "event" (the event's name)}`` or ``{}``.
    """
    uuid = event["instance_uuid"]
    with cell_session(event["cell"]) as session:
        actions.take_request(session, instance_uuid=uuid, request_id=event["request_id"],
                             task_states=(states.DELETING,), event=EVENT_TERMINATE, host=event.get("host"))
        candidates = session.scalars(select(Migration).where(
            Migration.instance_uuid == uuid, Migration.deleted.is_(False),
            Migration.status.in_((*_TO_CONFIRM, migration_states.ERROR)))
            .order_by(Migration.created_at.desc(), Migration.id.desc()))
        migration = next((m for m in candidates
                          if m.status in _TO_CONFIRM or placement.get_allocations(m.uuid)), None)
        if migration is None:
            return {}
        source = str(migration.source_compute)
        cells = cross_cell_settle.cells_of(migration, event["cell"])
        if cells and cells["source_cell"] == event["cell"]:
            # A revert between cells gave the server back to its source cell and then failed: what
            # is left of the move (the hidden copy, the guest and disks) is on the destination.
            source = str(migration.dest_compute)
            cells = {"source_cell": cross_cell_settle.cell_of_host(source), "target_cell": event["cell"]}
        if cells:
            up = hosts.host_is_up_from(session, event["cell"], source)
            event_name = cross_cell_settle.EVENT_CONFIRM_AT_SOURCE
        else:
            up = hosts.service_is_up(session, source)
            event_name = confirm_resize.EVENT_CONFIRM
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"],
                            event=event_name, host=source)
        instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
        payload = notifications.instance_payload(instance, migration_uuid=migration.uuid) if instance else None
        found: dict[str, Any] = {"migration_uuid": migration.uuid, "host": source,
                                 "same_host": migration.source_compute == migration.dest_compute, "event": event_name}
        if cells:
            found["source_cell"] = cells["source_cell"]
    if not up:
        logger.warning("source host is down: its old disks stay until it is cleaned up",
                       extra={"instance_uuid": uuid, "host": source, "migration_uuid": found["migration_uuid"]})
    notifications.notify(notifications.RESIZE_CONFIRM_START, instance_uuid=uuid,
                         publisher_id=notifications.compute_publisher(source), payload=payload,
                         identity=confirm_resize.settle_identity(event, found["migration_uuid"]))
    return {**found, "queue_url": hosts.queue_url(source) if up else None}


def confirm_before_delete(event: dict[str, Any]) -> dict[str, Any]:
    """Drop the migration's allocation and the source's bindings and attachments; migration
    ``confirmed`` (one left in ``error`` keeps that status). After a cross-cell move the source
    cell's hidden copy of the server is hard-deleted first. Idempotent."""
    uuid, found = event["instance_uuid"], event["confirm"]
    migration_uuid, source = found["migration_uuid"], found["host"]
    if found.get("source_cell"):
        cross_cell_settle.hard_delete_copy(found["source_cell"], uuid, migration_uuid)
    confirm_resize.release_source(uuid, migration_uuid, source, found["same_host"])
    event_name = found.get("event", confirm_resize.EVENT_CONFIRM)
    with cell_session(event["cell"]) as session:
        if actions.event_finished(session, uuid, event["request_id"], event_name):
            return {}  # this step ran before
        migration = confirm_resize.migration_of(session, uuid, migration_uuid)
        if migration.status in _TO_CONFIRM:
            migration.status = migration_states.CONFIRMED
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"],
                             event=event_name, host=source)
        instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
        payload = notifications.instance_payload(instance, migration_uuid=migration_uuid) if instance else None
    notifications.notify(notifications.RESIZE_CONFIRM_END, instance_uuid=uuid,
                         publisher_id=notifications.compute_publisher(source), payload=payload,
                         identity=confirm_resize.settle_identity(event, migration_uuid))
    return {}


def finish_delete(event: dict[str, Any]) -> dict[str, Any]:
    """Release the server's ports, volumes and allocations and mark it deleted (idempotent).

    Volumes: see :func:`_release_volumes`.

    The allocations go with every migration of the server too: an older move whose confirm
    failed (migration ``error``) still holds its source host's, and the server that held them
    is gone. The server's cell has a record of each (a move between cells keeps one in both).
    Such a move between cells also left the server's hidden copy in its other cell: it is
    hard-deleted (:func:`_remove_copies_elsewhere`).
    """
    uuid, cell = event["instance_uuid"], event["cell"]
    _remove_copies_elsewhere(cell, uuid)
    removed = set((event.get("destroyed") or {}).get("volumes_removed") or [])
    with cell_session(cell) as session:
        bdms = list(session.scalars(select(BlockDeviceMapping).where(
            BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.deleted.is_(False))))
        record = session.execute(select(Instance.launched_at).where(Instance.uuid == uuid)).first()
        # A server whose record is gone counts as launched: only what its owner asked for goes.
        launched = record is None or record.launched_at is not None
        doomed = instances.volumes_deleted_with(session, uuid, launched=launched)
        made_for_it = {b.volume_id for b in bdms if b.volume_id and b.source_type == "image"}
    # Released before the mapping is queued for delete, which makes the server 404: a server
    # shown gone holds nothing any more.
    placement.delete_allocations(uuid)
    for migration_uuid in _migrations_of(cell, uuid):
        if placement.get_allocations(migration_uuid):
            placement.delete_allocations(migration_uuid)
            logger.info("allocation of an earlier move released with the server",
                        extra={"instance_uuid": uuid, "migration_uuid": migration_uuid})
    with api_session() as session:
        # The mapping's row first, as BindResourcesAtDest takes it before binding ports and volumes:
        # one order, so a build's bind and this release wait for each other instead of deadlocking,
        # and a bind that went first is released here in full.
        session.execute(select(InstanceMapping.id).where(InstanceMapping.instance_uuid == uuid).with_for_update())
        network.release_ports(session, uuid, network.requested_networks(session, uuid))
        # A server in cell0 was never scheduled: no host ever wrote a volume made for it.
        _release_volumes(session, uuid, doomed, removed, made_for_it if cell == CELL0_NAME else set())
        server_groups.remove_member(session, uuid)
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == uuid)
                        .values(queued_for_delete=True))
    _mark_deleted(event)
    return {}


def _mark_deleted(event: dict[str, Any]) -> None:
    """The cell's part of a delete, once the API database's is committed: the server deleted, its
    block device mappings with it, the delete's event finished (idempotent)."""
    uuid, cell = event["instance_uuid"], event["cell"]
    now = utcnow()
    with cell_session(cell) as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
        if instance is None or instance.deleted:
            return
        instance.vm_state, instance.task_state, instance.power_state = states.DELETED, None, states.NOSTATE
        instance.deleted, instance.deleted_at, instance.terminated_at = True, now, now
        session.execute(update(BlockDeviceMapping).where(BlockDeviceMapping.instance_uuid == uuid)
                        .values(deleted=True))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_TERMINATE,
                             host=event.get("host"))


def _release_volumes(session: Session, uuid: str, doomed: set[str], removed: set[str], unwritten: set[str]) -> None:
    """Detach the server's volumes in the records; delete those deleted with it that are gone.

    A volume deleted with the server (``delete_on_termination``, or made from an image for a
    server never launched: :func:`ferry.compute.instances.volumes_deleted_with`; in ``doomed``) is
    deleted once a host removed its file (``removed``). A volume made for the server that no host ever wrote
    (``unwritten``: the server was never scheduled) is deleted whatever its flag, as it never
    existed but in the records. One whose file may remain (the host was down, the server was
    still being built, the volume is no file the hosts make) is left ``deleting`` for an
    operator. A volume another server holds stays as it is. Other volumes become ``available``.
    """
    mine = list(session.scalars(select(VolumeAttachment).where(VolumeAttachment.instance_uuid == uuid)))
    held = {a.volume_id for a in mine}
    for attachment in mine:
        session.delete(attachment)
    session.flush()
    for volume_id in sorted(held | doomed | unwritten):
        volume = session.get(Volume, volume_id)
        where = {"instance_uuid": uuid, "volume_id": volume_id}
        if volume is None:
            continue
        if session.scalars(select(VolumeAttachment.id).where(VolumeAttachment.volume_id == volume_id)).first():
            if volume_id in removed:
                logger.error("volume file removed while another server holds it", extra=where)
            elif volume_id in doomed:
                logger.warning("volume kept: another server holds it", extra=where)
            continue
        if volume_id not in held and volume_id not in unwritten and volume.status != volumes.DELETING:
            continue  # detached from the server before (its mapping outlived the detach): not the server's
        if volume_id in unwritten or (volume_id in doomed and volume_id in removed):
            session.delete(volume)
            logger.info("volume deleted with its server", extra=where)
        elif volume_id not in doomed:
            volume.status = volumes.AVAILABLE
        else:
            volume.status = volumes.DELETING
            logger.warning("volume left deleting: its file may remain", extra={**where, "path": volume.path})


def _remove_copies_elsewhere(cell: str, instance_uuid: str) -> None:
    """Hard-delete the server's hidden copies in the other cells of its moves between cells.

    The delete's confirm removes the newest move's; an older one whose confirm failed, the server
    moved again since, keeps its copy (with its block device mappings, actions and migrations)
    in its source cell otherwise. A visible copy there is another server's record, not this
    one's to remove: it is left and logged; so is a copy in a cell whose database cannot be
    reached (the delete goes on without it: ``ferry audit --fix`` removes it later). Idempotent.
    """
    with cell_session(cell) as session:
        moves = session.execute(select(Migration.uuid, Migration.source_compute, Migration.dest_compute).where(
            Migration.instance_uuid == instance_uuid, Migration.cross_cell_move.is_(True)).order_by(Migration.id)).all()
    # One removal per other cell (a cell holds one copy of the server), under that cell's newest move.
    cell_of = {host: hosts.cell_of_host(host) for _uuid, *ends in moves for host in ends if host}
    newest = {cell_of[host]: migration_uuid for migration_uuid, *ends in moves for host in ends if host}
    for other, migration_uuid in sorted((c, m) for c, m in newest.items() if c is not None and c != cell):
        try:
            cross_cell_settle.hard_delete_copy(other, instance_uuid, migration_uuid)
        except errors.CellCopyNotHidden:
            logger.warning("a visible copy of the server in another cell is left",
                           extra={"instance_uuid": instance_uuid, "cell": other, "migration_uuid": migration_uuid})
        except DBAPIError as exc:
            if not db.unreachable(exc):
                raise
            logger.warning("the server's copy in another cell is left: its database cannot be reached",
                           extra={"instance_uuid": instance_uuid, "cell": other, "migration_uuid": migration_uuid,
                                  "error": str(exc.orig or exc).splitlines()[0][:200]})


def _migrations_of(cell: str, instance_uuid: str) -> list[str]:
    """The uuids of the server's migration records in its cell."""
    with cell_session(cell) as session:
        return list(session.scalars(select(Migration.uuid).where(Migration.instance_uuid == instance_uuid)))


def fail_delete(event: dict[str, Any]) -> dict[str, Any]:
    """Record a failed delete: ERROR with a fault naming the host, task cleared so delete can be retried.

    Counts ``ServerLeftInError`` when this run puts the server in ERROR (a run again finds the
    task cleared and does nothing).

    A delete whose FinishDelete failed after the API database's part committed (the mapping
    queued for delete: ports, volumes and allocations released, the server 404 to its owner) is
    finished instead: left in ERROR, it could be neither seen nor deleted again, and would count
    against its project's quota.

    Returns:
        ``{"finished": True}`` when the delete was finished (the execution then succeeds), else ``{}``.
    """
    uuid, cell = event["instance_uuid"], event["cell"]
    error = event.get("error") or event.get("confirm_error") or {}
    host, details, event_name = event.get("host"), None, EVENT_TERMINATE
    if "confirm_error" in event:
        found = event.get("confirm") or {}
        host, event_name = found.get("host"), found.get("event", confirm_resize.EVENT_CONFIRM)
        details = (f"Confirming the resize on source host {host} failed before the server was destroyed; "
                   f"migration {found.get('migration_uuid')} keeps its allocation and the old disks may remain "
                   f"there. Delete the server again to retry.")
    with api_session() as session:
        queued = session.scalar(select(InstanceMapping.queued_for_delete).where(
            InstanceMapping.instance_uuid == uuid))
    newer_runs = False
    with cell_session(cell) as session:
        newer = actions.newest_request_id(session, uuid, actions.DELETE) not in (None, event["request_id"])
        if newer:
            # A newer delete was accepted meanwhile (a server in error takes one whatever its
            # task): this one records its failure, and leaves the server to that one while it
            # runs (task deleting).
            actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=event_name,
                                 host=host, error=error or None)
            instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
            newer_runs = instance is None or instance.deleted or instance.task_state == states.DELETING
    if newer and (newer_runs or not queued or "confirm_error" in event):
        return {}
    if queued and "confirm_error" not in event:
        # This delete released the server (or a newer one that ended without finishing did).
        logger.warning("delete failed after its server was released; finishing it",
                       extra={"instance_uuid": uuid, "error": error.get("Error")})
        _mark_deleted(event)
        return {"finished": True}
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        if instance.task_state != states.DELETING:
            return {}
        instances.update_cas(session, uuid, {"vm_state": states.ERROR, "task_state": None},
                             expected_task_state=(states.DELETING,))
        instances.add_fault(session, uuid, owner_cause(error), host=host, details=fault_details(error, details))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=event_name,
                             host=host, error=error or None)
    metrics.add_metric(name="ServerLeftInError", unit=MetricUnit.Count, value=1)
    logger.warning("delete failed: the server is in ERROR", extra={"instance_uuid": uuid, "host": host,
                                                                    "error": error.get("Error")})
    return {}
