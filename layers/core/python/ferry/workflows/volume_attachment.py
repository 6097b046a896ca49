"""Attaching and detaching volumes: what ``os-volume_attachments`` accepts, and the steps of
``statemachine/volume_attachment.asl.json``.

Attach: the API checks the volume (``available``) and the server (ACTIVE, SHUTOFF or
VERIFY_RESIZE, no task), takes both with compare-and-swaps — the volume ``available`` and held
by no attachment → ``attaching``, the server's task_state none → ``attaching_volume`` — writes
the block device mapping and a ``reserved`` attachment on the server's host, records
``attach_volume`` and starts the workflow: CheckVolumeOperation → AttachAtHost (host agent) →
FinishVolumeOperation (the attachment ``attached``, the volume ``in-use``, the task cleared). A
server in VERIFY_RESIZE also gets a ``reserved`` attachment on its migration's source host, so a
revert restores the old guest with the volume; a confirm drops it.

Detach: the volume ``in-use`` and held by an attachment of this server → ``detaching`` (a
mapping alone may be stale), the task none → ``detaching_volume``; then CheckVolumeOperation →
DetachAtHost → FinishVolumeOperation (every attachment of the volume to the server goes — both
hosts' in VERIFY_RESIZE —, the volume ``available`` once nothing holds it, the mapping deleted).

Why a task state: Nova sets none while attaching, and relies on Cinder's volume status to refuse
a second attach of the same volume. Ferry's workflows read the attachments of a server in
VERIFY_RESIZE when it is reverted or confirmed, so an attach racing a revert could be lost;
the task state makes a confirm, revert, resize or delete wait (409) until the attachment is
settled, and a second attach or detach on the same server gets 409 too. The task states
``attaching_volume`` and ``detaching_volume`` are Ferry's; the server's status stays what its
vm_state says (ACTIVE, SHUTOFF, VERIFY_RESIZE).

Failures roll back: a failed attach is detached on the host again and its records removed
(volume ``available``), or kept attached (``in-use``) when that detach fails too, for a detach to
free; a failed detach leaves the volume attached (``in-use``). Either way the
task is cleared and the instance action's event records the error. FinishVolumeOperation writes
the API database, then the cell; when only the first committed, the rollback follows it: an
attach's ``in-use`` volume is freed with the rest, a detach's records already say detached (the
host did detach it), so its mapping is deleted rather than kept. When the cell's part committed
too and the step failed after (its answer lost), CheckVolumeCommitted lets the operation stand.

Devices are chosen by Ferry, as Nova's libvirt driver does: the first free ``vdX`` after the
local disks (``vda`` root, ``vdb`` ephemeral, ``vdc`` swap); a requested device name is ignored.
"""

from __future__ import annotations

import json
import uuid as uuidlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, delete, select, update
from sqlalchemy.orm import Session

from ferry import config, errors, hosts, volumes, workflows
from ferry.auth import RequestContext
from ferry.compute import actions, instances, migration_states, states
from ferry.compute.api import Location
from ferry.observability import logger
from ferry.store.api_models import CellMapping, Volume, VolumeAttachment
from ferry.store.cell_models import BlockDeviceMapping, Instance, Migration
from ferry.store.db import api_session, cell_session
from ferry.volumes import ATTACHING, AVAILABLE, DETACHING, ERROR_DETACHING, IN_USE
from ferry.workflows import error_message, fault_details, owner_cause
from ferry.workflows.confirm_resize import VOLUME_TASK_STATES, live_instance, validate_input

ATTACH = "attach"
DETACH = "detach"

# Task states while a volume is attached or detached (Ferry's; see the module docstring). A
# confirm settles a server under them (confirm_resize.VOLUME_TASK_STATES).
ATTACHING_VOLUME, DETACHING_VOLUME = VOLUME_TASK_STATES
_TASK_STATE = {ATTACH: ATTACHING_VOLUME, DETACH: DETACHING_VOLUME}

# Nova's instance action and event names.
ACTION_ATTACH = "attach_volume"
ACTION_DETACH = "detach_volume"
EVENT_ATTACH = "compute_attach_volume"
EVENT_DETACH = "compute_detach_volume"
_EVENT = {ATTACH: EVENT_ATTACH, DETACH: EVENT_DETACH}


ATTACHABLE_VM_STATES = (states.ACTIVE, states.STOPPED, states.RESIZED)
# The host agent's local disks: root, ephemeral, swap.
_LOCAL_DEVICES = frozenset({"vda", "vdb", "vdc"})

INPUT_SCHEMA: dict[str, Any] = json.loads(
    Path(__file__).with_name("volume_attachment.input.schema.json").read_text())


@dataclass(frozen=True)
class Attachment:
    """A volume attached to a server, as ``os-volume_attachments`` shows it."""

    volume_id: str
    server_id: str
    device: str | None
    delete_on_termination: bool
    attachment_id: str | None
    bdm_uuid: str
    tag: str | None = None

    @property
    def device_path(self) -> str | None:
        return volumes.device_path(self.device)


def _attachment(bdm: BlockDeviceMapping) -> Attachment:
    return Attachment(volume_id=str(bdm.volume_id), server_id=bdm.instance_uuid, device=bdm.device_name,
                      delete_on_termination=bool(bdm.delete_on_termination), attachment_id=bdm.attachment_id,
                      bdm_uuid=bdm.uuid, tag=bdm.tag)


def _volume_bdms(session: Session, instance_uuid: str) -> list[BlockDeviceMapping]:
    return list(session.scalars(select(BlockDeviceMapping).where(
        BlockDeviceMapping.instance_uuid == instance_uuid, BlockDeviceMapping.deleted.is_(False),
        BlockDeviceMapping.destination_type == "volume", BlockDeviceMapping.volume_id.is_not(None))
        .order_by(BlockDeviceMapping.id)))


def _bdm_of(session: Session, instance_uuid: str, volume_id: str) -> BlockDeviceMapping | None:
    return next((b for b in _volume_bdms(session, instance_uuid) if b.volume_id == volume_id), None)


def _cell_of(location: Location, action: str) -> CellMapping:
    if location.cell is None:
        raise errors.InstanceInvalidState(
            f"Cannot '{action}' instance {location.instance_uuid} while it is in vm_state {states.BUILDING}")
    return location.cell


# --- reads -------------------------------------------------------------------------------------


def list_attachments(location: Location) -> list[Attachment]:
    """The volumes attached to the server at ``location`` (a server still building has none).

    ``attachment_id`` is that of the attachment on the server's host now, as the volume API
    shows it: a move makes a new attachment on the destination and its confirm (or revert)
    drops the other, while the block device mapping keeps the id it was written with.
    """
    if location.cell is None:
        return []
    uuid = location.instance_uuid
    with cell_session(location.cell) as session:
        bdms = _volume_bdms(session, uuid)
        host = session.scalars(select(Instance.host).where(Instance.uuid == uuid)).first()
        found = [_attachment(b) for b in bdms]
    if not found or host is None:
        return found
    with api_session() as session:
        live = dict(session.execute(select(VolumeAttachment.volume_id, VolumeAttachment.id).where(
            VolumeAttachment.instance_uuid == uuid, VolumeAttachment.host == host)).all())
    return [replace(a, attachment_id=live.get(a.volume_id, a.attachment_id)) for a in found]


def get_attachment(location: Location, volume_id: str) -> Attachment:
    """The attachment of ``volume_id`` to the server at ``location``.

    Raises:
        VolumeNotAttached: the volume is not attached to this server.
    """
    for attachment in list_attachments(location):
        if attachment.volume_id == volume_id:
            return attachment
    raise errors.VolumeNotAttached(f"Volume {volume_id} is not attached to server {location.instance_uuid}.")


# --- accepting an attach or a detach -----------------------------------------------------------


def _check_server(ctx: RequestContext, session: Session, instance_uuid: str, action: str) -> Any:
    instance = instances.get(session, instance_uuid)
    if instance.locked and not ctx.is_admin:
        raise errors.InstanceIsLocked(f"Instance {instance_uuid} is locked")
    if instance.vm_state not in ATTACHABLE_VM_STATES:
        raise errors.InstanceInvalidState(
            f"Cannot '{action}' instance {instance_uuid} while it is in vm_state {instance.vm_state}")
    if instance.task_state is not None:
        raise errors.InstanceInvalidState(
            f"Cannot '{action}' instance {instance_uuid} while it is in task_state {instance.task_state}")
    if not instance.host:
        raise errors.InstanceInvalidState(f"Cannot '{action}' instance {instance_uuid}: it is on no host")
    if instance.vm_state == states.RESIZED and _settling(session, instance_uuid):
        raise errors.InstanceInvalidState(
            f"Cannot '{action}' instance {instance_uuid} while its resize is being confirmed or reverted")
    return instance


def _settling(session: Session, instance_uuid: str) -> bool:
    """Whether the server's newest migration is being confirmed or reverted."""
    status = session.scalars(select(Migration.status).where(
        Migration.instance_uuid == instance_uuid, Migration.deleted.is_(False))
        .order_by(Migration.created_at.desc(), Migration.id.desc()).limit(1)).first()
    return status in (migration_states.CONFIRMING, migration_states.REVERTING)


def _take_server(ctx: RequestContext, session: Session, instance_uuid: str, action: str, task_state: str) -> None:
    """Compare-and-swap: no task → ``task_state``, vm_state still attachable (else 409)."""
    try:
        instances.update_cas(session, instance_uuid, {"task_state": task_state}, expected_task_state=(None,),
                             expected_vm_state=ATTACHABLE_VM_STATES)
    except errors.UnexpectedTaskState as exc:
        _check_server(ctx, session, instance_uuid, action)  # raises the precise 409
        raise errors.InstanceInvalidState(str(exc)) from exc


def _swap_in(session: Session, volume_id: str, expected: tuple[str, ...], status: str,
             *holders: ColumnElement[bool]) -> bool:
    """Compare-and-swap in one statement: the volume's status ``expected`` (and ``holders``, who
    holds it: :func:`volumes.unheld`, :func:`volumes.held_by`) → ``status``. Whether it swapped."""
    result = cast(CursorResult[Any], session.execute(
        update(Volume).where(Volume.id == volume_id, Volume.status.in_(expected), *holders).values(status=status)
        .execution_options(synchronize_session=False)))
    return result.rowcount == 1


def _swap_volume_status(volume_id: str, expected: str, status: str, *holders: ColumnElement[bool]) -> bool:
    with api_session() as session:
        return _swap_in(session, volume_id, (expected,), status, *holders)


def _source_of_resize(session: Session, instance_uuid: str, host: str) -> str | None:
    """The source host of the server's finished migration when it is elsewhere (VERIFY_RESIZE)."""
    migration = session.scalars(select(Migration).where(
        Migration.instance_uuid == instance_uuid, Migration.deleted.is_(False),
        Migration.status == migration_states.FINISHED)
        .order_by(Migration.created_at.desc(), Migration.id.desc())).first()
    if migration is None or not migration.source_compute or migration.source_compute == host:
        return None
    return migration.source_compute


def _next_device(session: Session, instance_uuid: str) -> str:
    used = _LOCAL_DEVICES | {b.device_name.removeprefix("/dev/") for b in _volume_bdms(session, instance_uuid)
                             if b.device_name}
    for letter in "defghijklmnopqrstuvwxyz":
        if f"vd{letter}" not in used:
            return f"vd{letter}"
    raise errors.Conflict(f"Instance {instance_uuid} has no free device for another volume.")


def _execution_name(operation: str, instance_uuid: str, request_id: str) -> str:
    return f"{operation}-{instance_uuid}-{request_id.removeprefix('req-')}"[:80]


def _start(cell: str, instance_uuid: str, request_id: str, operation: str, volume_id: str) -> None:
    payload = {"instance_uuid": instance_uuid, "cell": cell, "request_id": request_id, "operation": operation,
               "volume_id": volume_id}
    workflows.start_execution(config.get().volume_attachment_state_machine_arn,
                              _execution_name(operation, instance_uuid, request_id), payload)


def _visible_volume(ctx: RequestContext, volume_id: str) -> tuple[str, int]:
    """``(status, size_gb)`` of a volume the caller may use.

    Raises:
        VolumeNotFound: no such volume, or another project's and the caller is no admin.
    """
    with api_session() as session:
        volume = volumes.visible(session, ctx, volume_id)
        return volume.status, volume.size_gb


def begin_attach(ctx: RequestContext, location: Location, volume_id: str, *,
                 delete_on_termination: bool = False, tag: str | None = None) -> Attachment:
    """Accept an attach of ``volume_id`` to the server at ``location`` and start the workflow.

    Returns:
        The attachment as it will be (its device is chosen here).

    Raises:
        VolumeNotFound: no such volume, or another project's (404).
        VolumeInUse: the volume is not ``available``, or a server holds it (400).
        InstanceIsLocked, InstanceInvalidState: the server is locked, building, on no host, in
            another vm_state, or busy (409).
        Anything starting the execution raises, after everything written here is undone.
    """
    uuid, request_id = location.instance_uuid, ctx.request_id
    cell = _cell_of(location, ACTION_ATTACH)
    status, size_gb = _visible_volume(ctx, volume_id)
    if status != AVAILABLE:
        raise errors.VolumeInUse(f"Invalid volume: volume '{volume_id}' status must be 'available'. "
                                 f"Currently in '{status}'")
    with cell_session(cell) as session:
        _check_server(ctx, session, uuid, ACTION_ATTACH)
    # No attachment may hold it either: a boot's reservation, or a server whose records a failed
    # operation left behind, holds a volume whatever its status says.
    if not _swap_volume_status(volume_id, AVAILABLE, ATTACHING, volumes.unheld()):
        raise errors.VolumeInUse(f"Invalid volume: volume '{volume_id}' status must be 'available' "
                                 f"and no server may hold it.")
    attachment_id = str(uuidlib.uuid4())
    try:
        with cell_session(cell) as session:
            _take_server(ctx, session, uuid, ACTION_ATTACH, ATTACHING_VOLUME)
            instance = instances.get(session, uuid)
            host = str(instance.host)
            source = _source_of_resize(session, uuid, host) if instance.vm_state == states.RESIZED else None
            device = _next_device(session, uuid)
            bdm = BlockDeviceMapping(instance_uuid=uuid, source_type="volume", destination_type="volume",
                                     device_name=device, boot_index=None, volume_id=volume_id,
                                     volume_size=size_gb, delete_on_termination=delete_on_termination,
                                     attachment_id=attachment_id, tag=tag)
            session.add(bdm)
            actions.start_action(session, instance_uuid=uuid, action=ACTION_ATTACH, request_id=request_id,
                                 user_id=ctx.user_id, project_id=ctx.project_id)
            session.flush()
            attachment = _attachment(bdm)
        with api_session() as session:
            for where in filter(None, (host, source)):
                session.add(VolumeAttachment(id=attachment_id if where == host else str(uuidlib.uuid4()),
                                             volume_id=volume_id, instance_uuid=uuid, host=where, device=device,
                                             status=volumes.RESERVED))
        _start(cell.name, uuid, request_id, ATTACH, volume_id)
    except errors.InstanceInvalidState:
        _swap_volume_status(volume_id, ATTACHING, AVAILABLE)
        raise
    except Exception:
        if not _undo_attach(cell.name, uuid, volume_id, request_id, attachment_id):
            logger.warning("starting the attach answered an error, but it began; the request stands",
                           extra={"instance_uuid": uuid, "volume_id": volume_id})
            return attachment
        logger.exception("attach did not start; undone", extra={"instance_uuid": uuid, "volume_id": volume_id})
        raise
    logger.info("attach accepted", extra={"instance_uuid": uuid, "volume_id": volume_id, "device": device})
    return attachment


def _undo_attach(cell: str, instance_uuid: str, volume_id: str, request_id: str, attachment_id: str) -> bool:
    """Undo an attach whose workflow did not start, or that failed before it could; whether it did
    (see :func:`_undo_in_cell`). Only what this request wrote goes: its mapping is the one carrying
    its ``attachment_id``, and the volume, ``attaching`` since this request took it, is held by no
    other request."""
    with cell_session(cell) as session:
        if not _undo_in_cell(session, instance_uuid, request_id, ATTACHING_VOLUME):
            return False
        session.execute(delete(BlockDeviceMapping).where(BlockDeviceMapping.instance_uuid == instance_uuid,
                                                         BlockDeviceMapping.volume_id == volume_id,
                                                         BlockDeviceMapping.attachment_id == attachment_id,
                                                         BlockDeviceMapping.deleted.is_(False)))
    with api_session() as session:
        session.execute(delete(VolumeAttachment).where(VolumeAttachment.volume_id == volume_id,
                                                       VolumeAttachment.instance_uuid == instance_uuid))
    _swap_volume_status(volume_id, ATTACHING, AVAILABLE)
    return True


def _undo_in_cell(session: Session, instance_uuid: str, request_id: str, task_state: str) -> bool:
    """The server's part of undoing an accepted attach or detach (task cleared, action forgotten),
    done first and under the server's row lock, which the workflow's first step takes too
    (:func:`actions.take_request`): False, and nothing undone, when that step took the request
    (its workflow began after all, though its start answered an error). Once this commits, the
    step finds the request undone and changes nothing.

    A request whose action is not recorded never took the server (the transaction that takes the
    task records the action too, and it did not commit): the server's task, if any, is another
    request's, and is left alone."""
    if actions.request_taken(session, instance_uuid, request_id):
        return False
    if actions.find(session, instance_uuid, request_id) is None:
        return True
    try:
        instances.update_cas(session, instance_uuid, {"task_state": None}, expected_task_state=(task_state,))
    except errors.UnexpectedTaskState:
        logger.warning("task changed meanwhile; left as is", extra={"instance_uuid": instance_uuid})
    actions.forget_action(session, instance_uuid, request_id)
    return True


def begin_detach(ctx: RequestContext, location: Location, volume_id: str) -> None:
    """Accept a detach of ``volume_id`` from the server at ``location`` and start the workflow.

    Raises:
        VolumeNotAttached: the volume is not attached to this server (404).
        BadRequest: it is the server's root volume (400).
        VolumeInUse: the volume is not ``in-use`` (being attached or detached), or no attachment
            of this server holds it (the mapping is stale) (400).
        InstanceIsLocked, InstanceInvalidState: as :func:`begin_attach` (409).
        Anything starting the execution raises, after everything written here is undone.
    """
    uuid, request_id = location.instance_uuid, ctx.request_id
    cell = _cell_of(location, ACTION_DETACH)
    with cell_session(cell) as session:
        bdm = _bdm_of(session, uuid, volume_id)
        if bdm is None:
            raise errors.VolumeNotAttached(f"Volume {volume_id} is not attached to server {uuid}.")
        if bdm.boot_index == 0:
            raise errors.BadRequest("Cannot detach a root device volume")
        _check_server(ctx, session, uuid, ACTION_DETACH)
    # This server must hold it: a block device mapping alone may be stale (another server may
    # hold the volume now), and detaching would free the volume under that server.
    if not _swap_volume_status(volume_id, IN_USE, DETACHING, volumes.held_by(uuid)):
        raise errors.VolumeInUse(f"Invalid volume: volume '{volume_id}' status must be 'in-use' "
                                 f"and attached to server {uuid}.")
    try:
        with cell_session(cell) as session:
            _take_server(ctx, session, uuid, ACTION_DETACH, DETACHING_VOLUME)
            actions.start_action(session, instance_uuid=uuid, action=ACTION_DETACH, request_id=request_id,
                                 user_id=ctx.user_id, project_id=ctx.project_id)
    except Exception:
        _swap_volume_status(volume_id, DETACHING, IN_USE)
        raise
    try:
        _start(cell.name, uuid, request_id, DETACH, volume_id)
    except Exception:
        with cell_session(cell) as session:
            undone = _undo_in_cell(session, uuid, request_id, DETACHING_VOLUME)
        if not undone:
            logger.warning("starting the detach answered an error, but it began; the request stands",
                           extra={"instance_uuid": uuid, "volume_id": volume_id})
            return
        _swap_volume_status(volume_id, DETACHING, IN_USE)
        logger.exception("detach did not start; undone", extra={"instance_uuid": uuid, "volume_id": volume_id})
        raise
    logger.info("detach accepted", extra={"instance_uuid": uuid, "volume_id": volume_id})


# --- steps -------------------------------------------------------------------------------------


def check_volume_operation(event: dict[str, Any]) -> dict[str, Any]:
    """Check that the records are those of the attach or detach under way; build the host's arguments.

    Returns:
        ``{"host", "queue_url", "args"}``: ``args`` of ``attach_volume`` (``{"volume": {volume_id,
        path, device, size_gb}}``) or ``detach_volume`` (``{"volume_id"}``).

    Raises:
        InvalidWorkflowInput, InstanceNotFound, UnexpectedTaskState, VolumeNotAttached: refused,
            nothing changed.
    """
    validate_input(event, INPUT_SCHEMA)
    uuid, operation, volume_id = event["instance_uuid"], event["operation"], event["volume_id"]
    with cell_session(event["cell"]) as session:
        instance = live_instance(session, uuid)
        if instance is None:
            raise errors.InstanceNotFound(f"Instance {uuid} could not be found.")
        if instance.task_state != _TASK_STATE[operation] or not instance.host:
            raise errors.UnexpectedTaskState(
                f"Instance {uuid} is in task_state {instance.task_state} on {instance.host}: "
                f"not a volume {operation} under way.")
        bdm = _bdm_of(session, uuid, volume_id)
        if bdm is None:
            raise errors.VolumeNotAttached(f"Volume {volume_id} has no block device mapping on server {uuid}.")
        host, device = str(instance.host), str(bdm.device_name)
        # Under the server's row lock, as the API's undo of a request whose start it could not
        # confirm: either this sees the request undone, or the undo sees it taken.
        actions.take_request(session, instance_uuid=uuid, request_id=event["request_id"],
                             task_states=(_TASK_STATE[operation],), event=_EVENT[operation], host=host)
    with api_session() as session:
        volume = session.get(Volume, volume_id)
        if volume is None:
            raise errors.VolumeNotFound(f"Volume {volume_id} could not be found.")
        args: dict[str, Any] = (
            {"volume": {"volume_id": volume.id, "path": volume.path, "device": device, "size_gb": volume.size_gb}}
            if operation == ATTACH else {"volume_id": volume.id})
    return {"host": host, "queue_url": hosts.queue_url(host), "args": args}


def _record_attached(session: Session, uuid: str, volume_id: str, host: str | None) -> None:
    """The server's attachments of the volume on ``host`` are ``attached``, the volume ``in-use``
    (from ``attaching``) and held by the server."""
    for attachment in volumes.attachments(session, uuid, host):
        if attachment.volume_id == volume_id:
            attachment.status = volumes.ATTACHED
    session.flush()
    _swap_in(session, volume_id, (ATTACHING,), IN_USE, volumes.held_by(uuid))


def _ended(event: dict[str, Any]) -> bool:
    """Whether the request's operation is over (:func:`ferry.compute.actions.ended`): run again after
    it committed, the step must touch neither database (the volume's records, and the task, may be
    a newer request's by now). A request overtaken by a newer one (after an os-resetState) still
    settles its volume, which no other request takes while it is ``attaching`` or ``detaching``,
    and leaves the server's task and events alone (:func:`ferry.compute.actions.overtaken`)."""
    with cell_session(event["cell"]) as session:
        over = actions.ended(session, event["instance_uuid"], event["request_id"], _EVENT[event["operation"]])
    if over:
        logger.info(f"volume {event['operation']} step: the request is over, nothing to do",
                    extra={"instance_uuid": event["instance_uuid"], "volume_id": event["volume_id"],
                           "request_id": event["request_id"]})
    return over


def finish_volume_operation(event: dict[str, Any]) -> dict[str, Any]:
    """Record a done attach (attachment ``attached`` on the server's host, volume ``in-use``) or
    detach (every attachment to the server gone, volume ``available`` unless another server still
    holds it, mapping deleted); the task is cleared. Idempotent: once the request is over (this
    step committed) it changes nothing; see :func:`_ended` for a request overtaken.

    The API database's part commits first, then the cell's: when the cell's fails for good,
    FailVolumeOperation finds the volume's records already finished and settles the cell's to
    match (:func:`fail_volume_operation`)."""
    uuid, operation, volume_id = event["instance_uuid"], event["operation"], event["volume_id"]
    host = event["volume_op"]["host"]
    if _ended(event):
        return {}
    with api_session() as session:
        mine = [a for a in volumes.attachments(session, uuid) if a.volume_id == volume_id]
        if operation == ATTACH:
            _record_attached(session, uuid, volume_id, host)
        else:
            for attachment in mine:
                session.delete(attachment)
            session.flush()
            if not _swap_in(session, volume_id, (DETACHING,), AVAILABLE, volumes.unheld()):
                _swap_in(session, volume_id, (DETACHING,), IN_USE)  # another server still holds it
    with cell_session(event["cell"]) as session:
        instance = live_instance(session, uuid)
        if instance is None or instance.task_state != _TASK_STATE[operation] \
                or actions.overtaken(session, uuid, event["request_id"]):
            return {}
        if operation == DETACH:
            session.execute(update(BlockDeviceMapping).where(
                BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.volume_id == volume_id)
                .values(deleted=True).execution_options(synchronize_session=False))
        instances.update_cas(session, uuid, {"task_state": None}, expected_task_state=(_TASK_STATE[operation],))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=_EVENT[operation],
                             host=host)
    logger.info(f"volume {operation} done", extra={"instance_uuid": uuid, "volume_id": volume_id})
    return {}


def check_volume_committed(event: dict[str, Any]) -> dict[str, Any]:
    """Whether FinishVolumeOperation committed before it failed (its ``Catch`` comes here).

    One that failed after its cell part committed (its response lost, the function timed out)
    has finished the operation: the attach is recorded ``in-use`` and the guest sees the volume,
    or the detach is recorded done. Rolling an attach back then would detach the volume from the
    guest and free it while the server's block device mapping still lists it. So the operation
    stands. Committed means the operation's event finished ``Success``: FinishVolumeOperation
    records it in the transaction that clears the task, its last write.

    Returns:
        ``{"committed": bool}``.
    """
    uuid, operation = event["instance_uuid"], event["operation"]
    with cell_session(event["cell"]) as session:
        result = actions.event_result(session, uuid, event["request_id"], _EVENT[operation])
    committed = result == actions.SUCCESS
    if committed:
        logger.warning(f"FinishVolumeOperation failed after it committed: the {operation} stands",
                       extra={"instance_uuid": uuid, "volume_id": event["volume_id"],
                              "error": error_message(event.get("error") or {})})
    return {"committed": committed}


def fail_volume_operation(event: dict[str, Any]) -> dict[str, Any]:
    """Rollback tail: a failed attach leaves no attachment (volume ``available`` unless another
    server holds it, mapping removed), also when FinishVolumeOperation recorded the volume
    ``in-use`` before its cell part failed; but one whose detach at the host failed too
    (``cleanup_error``: the guest may still see the volume) stays attached, ``in-use`` with its
    mapping, for a detach to free it: freed, another server could attach it beside this guest.
    A failed detach leaves the volume attached
    (``in-use``), unless the host already detached it: when FinishVolumeOperation's API part
    recorded that (no attachment of the server left) the mapping is deleted too, else the volume
    is ``error_detaching`` (the fault says so). The task is cleared, the event and a fault record
    the error. Idempotent, as :func:`finish_volume_operation` is."""
    uuid, operation, volume_id = event["instance_uuid"], event["operation"], event["volume_id"]
    error = event.get("error") or {}
    cause = error_message(error)
    host = (event.get("volume_op") or {}).get("host")
    if _ended(event):
        return {}
    detached_at_host = operation == DETACH and "detached" in event
    records_detached = False
    details = None
    kept = operation == ATTACH and bool(event.get("cleanup_error"))
    if kept:
        with api_session() as session:
            _record_attached(session, uuid, volume_id, host)
        details = (f"Detaching the volume again on {host} failed ({error_message(event['cleanup_error'])}); "
                   f"the guest may still see it, so it stays attached: detach it to free it.")
    elif operation == ATTACH:
        with api_session() as session:
            session.execute(delete(VolumeAttachment).where(VolumeAttachment.volume_id == volume_id,
                                                           VolumeAttachment.instance_uuid == uuid))
            # ``in-use`` when FinishVolumeOperation's API part committed and its cell part did not.
            _swap_in(session, volume_id, (ATTACHING, IN_USE), AVAILABLE, volumes.unheld())
    else:
        with api_session() as session:
            # A detach was accepted only while the server held the volume, and only
            # FinishVolumeOperation's API part drops its attachments (after the host detached it).
            records_detached = not any(a.volume_id == volume_id for a in volumes.attachments(session, uuid))
        if records_detached:
            details = (f"Host {host} detached the volume and its attachment records are gone; the block device "
                       f"mapping is removed to match.")
        elif detached_at_host:
            _swap_volume_status(volume_id, DETACHING, ERROR_DETACHING)
            details = f"Host {host} detached the volume, but the records could not be updated."
        else:
            _swap_volume_status(volume_id, DETACHING, IN_USE)
    with cell_session(event["cell"]) as session:
        instance = live_instance(session, uuid)
        if instance is None or instance.task_state != _TASK_STATE[operation] \
                or actions.overtaken(session, uuid, event["request_id"]):
            return {}
        if operation == ATTACH and not kept:
            session.execute(delete(BlockDeviceMapping).where(
                BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.volume_id == volume_id,
                BlockDeviceMapping.deleted.is_(False)))
        elif records_detached:
            session.execute(update(BlockDeviceMapping).where(
                BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.volume_id == volume_id)
                .values(deleted=True).execution_options(synchronize_session=False))
        instances.update_cas(session, uuid, {"task_state": None}, expected_task_state=(_TASK_STATE[operation],))
        instances.add_fault(session, uuid, f"Volume {operation} of {volume_id} failed: {owner_cause(error)}",
                            host=host, details=fault_details(error, details))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=_EVENT[operation],
                             host=host, error=error or {"Error": errors.VolumeOperationFailed.__name__,
                                                        "Cause": cause})
    logger.warning(f"volume {operation} failed", extra={"instance_uuid": uuid, "volume_id": volume_id,
                                                        "cause": cause})
    return {}
