"""Steps of the confirm workflow (``statemachine/confirm_resize.asl.json``).

CheckResizeToConfirm → ConfirmAtSource (host agent: the source forgets its old guest and
``<uuid>_resize``) → FinishConfirm (the migration's allocation, the source's port bindings and
volume attachments go; migration ``confirmed``; ACTIVE or SHUTOFF from the power state).

Failures:

* the first step refuses input that does not match ``confirm_resize.input.schema.json``, or
  records that are not those of a confirm under way, and changes nothing;
* any other failure before the source host was asked (RestoreVerifyResize): the migration goes
  back to ``finished``, so the server stays in VERIFY_RESIZE and the confirm can be asked again;
* a failure at or after the source host (FailConfirm): the server is left usable where it runs,
  on the destination with its new flavor (ACTIVE or SHUTOFF, not ERROR as Nova would), the
  migration goes to ``error`` and keeps its allocation on the source, whose disks may still be
  there (unless the source had removed them in a move within a cell: then what the migration
  held there is released), and the instance fault says what is left where. An operator cleans up by starting this
  workflow again for that migration: a migration in ``error`` whose allocation is still held and
  whose server runs on its destination is accepted, and confirmed without touching the server.

The helpers :func:`release_source`, :func:`migration_of` and :func:`settle_identity` are shared with the revert and
delete workflows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ferry import errors, hosts, network, notifications, placement, validation, volumes
from ferry.compute import actions, instances, migration_states, states
from ferry.observability import logger
from ferry.store.api_models import RequestSpec, ResourceProvider
from ferry.store.cell_models import Instance, InstanceAction, Migration
from ferry.store.db import api_session, cell_session
from ferry.workflows import cross_cell_settle, error_message, fault_details, owner_cause, resize

EVENT_CONFIRM = "compute_confirm_resize"

INPUT_SCHEMA: dict[str, Any] = json.loads(
    Path(__file__).with_name("confirm_resize.input.schema.json").read_text())


# What the first step's handler accepts: the step checks the input against its schema itself,
# so that a refusal has the one error name the state machine matches on.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


# --- shared with revert and delete ----------------------------------------------------------------


def validate_input(event: dict[str, Any], schema: dict[str, Any]) -> None:
    """Check an execution's input against the schema beside its state machine.

    Raises:
        InvalidWorkflowInput: it does not match (the message says where).
    """
    try:
        validation.check(event, schema)
    except validation.SchemaMismatch as exc:
        where = exc.where()
        raise errors.InvalidWorkflowInput(f"Execution input{' at ' + where if where else ''}: {exc.message}") from exc


def migration_of(session: Session, instance_uuid: str, migration_uuid: str) -> Migration:
    """The migration ``migration_uuid`` of ``instance_uuid`` in this cell session.

    Raises:
        MigrationNotFound: no such migration, or it is another instance's.
    """
    migration = session.scalars(select(Migration).where(
        Migration.uuid == migration_uuid, Migration.deleted.is_(False))).one_or_none()
    if migration is None or migration.instance_uuid != instance_uuid:
        raise errors.MigrationNotFound(f"Migration {migration_uuid} of instance {instance_uuid} could not be found.")
    return migration


def live_instance(session: Session, instance_uuid: str) -> Instance | None:
    """The visible, undeleted instance, or None."""
    return session.scalars(select(Instance).where(
        Instance.uuid == instance_uuid, Instance.deleted.is_(False), Instance.hidden.is_(False))).one_or_none()


def settle_identity(event: dict[str, Any], migration_uuid: str | None = None) -> str:
    """The identity of a confirm's or revert's notifications (:func:`ferry.notifications.message_id`).

    The migration and the request: a step run again announces the same event under the same
    ``message_id``, while the same migration confirmed again under another request (the
    clean-up of a failed confirm, a delete) is another event.
    """
    return f"{migration_uuid or event['migration_uuid']}/{event['request_id']}"


def host_ref(host: str, node: str | None) -> dict[str, Any]:
    """``{host, node, queue_url}`` of a move's side, for the host operations of a state machine."""
    return {"host": host, "node": node or host, "queue_url": hosts.queue_url(host)}


# Tasks a confirm accepts and settles the server under without ending them: a volume attach or
# detach that raced the confirm's acceptance (the confirm sets no task, as in Nova). Named as in
# :mod:`ferry.workflows.volume_attachment`.
VOLUME_TASK_STATES = ("attaching_volume", "detaching_volume")
SETTLEABLE_TASK_STATES: tuple[str | None, ...] = (None, *VOLUME_TASK_STATES)


def settled_values(instance: Instance) -> dict[str, Any]:
    """What a confirmed server looks like: vm_state from its power state, no move flavors, and no
    task unless a volume attach or detach is under way (its own workflow ends it)."""
    values: dict[str, Any] = {"vm_state": states.vm_state_from_power(instance.power_state), "old_flavor": None,
                              "new_flavor": None, "old_vm_state": None}
    if instance.task_state is None:
        values["task_state"] = None
    return values


def settle(session: Session, instance: Instance | None) -> None:
    """Settle a server still in vm_state ``resized`` as a confirm does (compare-and-swap); a
    server in another state (being deleted, already settled) is left alone."""
    if instance is None or instance.vm_state != states.RESIZED or instance.task_state not in SETTLEABLE_TASK_STATES:
        return
    instances.update_cas(session, instance.uuid, settled_values(instance),
                         expected_task_state=(instance.task_state,), expected_vm_state=(states.RESIZED,))


def release_source(instance_uuid: str, migration_uuid: str, source_host: str, same_host: bool) -> None:
    """Forget the source side of a move in the records (idempotent).

    The migration's allocation is dropped, and unless the move stayed on one host the
    server's port bindings and volume attachments on ``source_host`` go.
    """
    placement.delete_allocations(migration_uuid)
    if same_host:
        return
    with api_session() as session:
        network.unbind(session, instance_uuid, source_host)
        volumes.detach_from(session, instance_uuid, source_host)


def keep_flavor_in_spec(instance_uuid: str, flavor: dict[str, Any]) -> None:
    """Record ``flavor`` (the one a confirmed move leaves the server) in its request spec, which
    held the flavor it was booted with: what the API shows of a server whose cell does not
    answer (2.69) is read from there. Idempotent."""
    with api_session() as session:
        row = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == instance_uuid)
                              .with_for_update()).one_or_none()
        if row is not None and (row.spec or {}).get("flavor") != flavor:
            row.spec = {**(row.spec or {}), "flavor": flavor}


def _flavor_left(instance: Instance | None, migration: Migration, settled: str) -> dict[str, Any] | None:
    """The flavor the move of ``migration`` leaves the server, for :func:`keep_flavor_in_spec`:
    None without a server, or once the migration is ``settled`` (the step ran before) and a
    newer move holds the server (its flavor is that move's, not confirmed yet)."""
    if instance is None or not instance.flavor:
        return None
    if migration.status == settled and instance.new_flavor is not None:
        return None
    return dict(instance.flavor)


def describe_allocations(consumer_uuid: str) -> str:
    """``"VCPU 1, MEMORY_MB 512 on host1"`` for every provider a consumer uses, or ``"none"``."""
    held = placement.get_allocations(consumer_uuid)
    if not held:
        return "none"
    with api_session() as session:
        names = {row.uuid: row.name for row in session.execute(
            select(ResourceProvider.uuid, ResourceProvider.name).where(ResourceProvider.uuid.in_(list(held))))}
    return "; ".join(", ".join(f"{rc} {amount}" for rc, amount in sorted(resources.items()))
                     + f" on {names.get(rp, rp)}" for rp, resources in sorted(held.items()))


# --- steps -------------------------------------------------------------------------------------------


def _is_leftover(instance: Instance, migration: Migration) -> bool:
    """A migration a failed confirm left in ``error``, or one being confirmed whose server an admin
    reset meanwhile (os-resetState: no task, no longer resized): its server runs on the
    destination, settled, and the migration still holds its allocation on the source. The confirm
    cleans the source up all the same (refused, the migration would stay ``confirming``, holding
    the source, with nothing running for it)."""
    # A reset may set ERROR (the default of ``openstack server set --state``); a failed confirm's
    # own leftover has its server settled by the failure, never ERROR by it.
    settled = (states.ACTIVE, states.STOPPED, states.ERROR) if migration.status == migration_states.CONFIRMING \
        else (states.ACTIVE, states.STOPPED)
    return (migration.status in (migration_states.ERROR, migration_states.CONFIRMING)
            and instance.host == migration.dest_compute
            and instance.vm_state in settled and instance.task_state is None
            and bool(placement.get_allocations(migration.uuid)))


def check_resize_to_confirm(event: dict[str, Any]) -> dict[str, Any]:
    """Check that the records are those of a confirm under way and name the hosts.

    Accepts a migration in ``confirming`` of a server in vm_state ``resized`` on the migration's
    destination with no task, or with the task of a volume attach or detach: the confirm's
    acceptance sets no task, so an attach that checked the server just before the migration went
    ``confirming`` may take the server just after. Refusing then would leave the migration
    ``confirming`` with nothing running for it; the confirm goes on instead, and the volume
    operation keeps its task and ends it (see :data:`SETTLEABLE_TASK_STATES`). Also accepts a
    migration a failed confirm left in ``error`` (see the module's docstring). Records the start
    of ``compute_confirm_resize`` and sends ``instance.resize_confirm.start``.

    Returns:
        ``{"source": {host, node, queue_url}, "dest": {host, node}, "same_host": bool}``.

    Raises:
        InvalidWorkflowInput, MigrationNotFound, InstanceNotFound, UnexpectedMigrationState: refused,
            nothing changed.
        ComputeServiceUnavailable: the source host is down (the confirm can be asked again later).
    """
    validate_input(event, INPUT_SCHEMA)
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    with cell_session(event["cell"]) as session:
        # The API undoing a confirm whose start answered an error takes this lock too: either it
        # sees this step's event and lets the confirm stand, or this step sees it undone (its
        # action forgotten: a newer request may have taken the migration since).
        actions.lock_server(session, uuid)
        migration = migration_of(session, uuid, migration_uuid)
        instance = live_instance(session, uuid)
        if instance is None:
            raise errors.InstanceNotFound(f"Instance {uuid} could not be found.")
        confirming = (migration.status == migration_states.CONFIRMING and instance.vm_state == states.RESIZED
                      and instance.task_state in SETTLEABLE_TASK_STATES and instance.host == migration.dest_compute)
        if not confirming and not _is_leftover(instance, migration):
            raise errors.UnexpectedMigrationState(
                f"Migration {migration_uuid} is {migration.status} and instance {uuid} is in vm_state "
                f"{instance.vm_state} task_state {instance.task_state} on {instance.host}: not a confirm under way.")
        if migration.status == migration_states.CONFIRMING and actions.find(session, uuid, event["request_id"]) is None:
            # A confirm the API undid; the migration is another request's now. (The clean-up of a
            # failed confirm's migration may be started by hand, under a request of its own.)
            raise errors.UnexpectedMigrationState(
                f"Request {event['request_id']} of instance {uuid} is not the confirm under way (it was undone); "
                f"nothing was done.")
        source, dest = str(migration.source_compute), str(migration.dest_compute)
        cells = cross_cell_settle.cells_of(migration, event["cell"])
        if not hosts.host_is_up_from(session, event["cell"], source, here=not cells):
            # The owner reads this in the fault: the host is named in its details and the log.
            logger.info("confirm refused: the source host is down", extra={"instance_uuid": uuid, "host": source})
            raise errors.ComputeServiceUnavailable(f"The source host of migration {migration_uuid} is down.")
        if cells:
            actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"],
                                event=cross_cell_settle.EVENT_CONFIRM)
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"],
                            event=cross_cell_settle.EVENT_CONFIRM_AT_SOURCE if cells else EVENT_CONFIRM, host=source)
        payload = notifications.instance_payload(instance, migration_uuid=migration_uuid)
        move = {"source": host_ref(source, migration.source_node),
                "dest": {"host": dest, "node": migration.dest_node or dest}, "same_host": source == dest}
        if cells:
            move["cross_cell"] = cells
    publisher = notifications.conductor_publisher() if cells else notifications.compute_publisher(source)
    notifications.notify(notifications.RESIZE_CONFIRM_START, instance_uuid=uuid, publisher_id=publisher,
                         payload=payload, identity=settle_identity(event))
    return move


def _confirm_events(cells: dict[str, str] | None, source: str) -> list[tuple[str, str | None]]:
    """The events a confirm records, innermost first: Nova's snapshot-based names for a cross-cell move."""
    if cells:
        return [(cross_cell_settle.EVENT_CONFIRM_AT_SOURCE, source), (cross_cell_settle.EVENT_CONFIRM, None)]
    return [(EVENT_CONFIRM, source)]


def finish_confirm(event: dict[str, Any]) -> dict[str, Any]:
    """Drop what the source held for the move; migration ``confirmed``; the server settles.

    The server (if still resized) gets vm_state from its power state and no move flavors; a
    volume attach or detach keeps its task (its own workflow ends it). A server being deleted
    meanwhile is left to its delete. Idempotent: a confirmed migration ends the step at once.
    After a cross-cell move the source cell's hidden copy of the server (and of the migration)
    is hard-deleted first.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    move = event["move"]
    source = move["source"]["host"]
    cells = cross_cell_settle.cross_cell(event)
    with cell_session(cell) as session:
        flavor = _flavor_left(live_instance(session, uuid), migration_of(session, uuid, migration_uuid),
                              migration_states.CONFIRMED)
    if flavor is not None:  # before the migration is confirmed, so that a run again after that does it too
        keep_flavor_in_spec(uuid, flavor)
    with cell_session(cell) as session:
        confirmed = migration_of(session, uuid, migration_uuid).status == migration_states.CONFIRMED
        # Confirmed already: by this step's earlier run, or by a delete that came meanwhile (its
        # ConfirmBeforeDelete). This request's action still ends, once, announced once committed.
        closed = _close_confirm(session, event, cells, source) if confirmed else None
    if confirmed:
        if closed is not None:
            _announce_confirmed(event, cells, source, closed["payload"])
        return {}
    if cells:
        cross_cell_settle.hard_delete_copy(cells["source_cell"], uuid, migration_uuid)
    release_source(uuid, migration_uuid, source, move["same_host"])
    payload = None
    with cell_session(cell) as session:
        migration = migration_of(session, uuid, migration_uuid)
        if migration.status == migration_states.CONFIRMED:
            return {}
        settle(session, live_instance(session, uuid))
        instance = live_instance(session, uuid)
        migration = migration_of(session, uuid, migration_uuid)
        migration.status = migration_states.CONFIRMED
        for name, host in _confirm_events(cells, source):
            actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=name, host=host)
        if instance is not None:
            payload = notifications.instance_payload(instance, migration_uuid=migration_uuid)
    logger.info("resize confirmed", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                           "cross_cell": bool(cells)})
    _announce_confirmed(event, cells, source, payload)
    return {}


def _close_confirm(session: Session, event: dict[str, Any], cells: dict[str, str] | None,
                   source: str) -> dict[str, Any] | None:
    """End the confirm's events (Success) in ``session``, unless this request did already (None);
    ``{"payload"}`` of its end, to announce once the session commits."""
    uuid, request_id = event["instance_uuid"], event["request_id"]
    if actions.event_finished(session, uuid, request_id, _confirm_events(cells, "")[-1][0]) \
            or actions.find(session, uuid, request_id) is None:
        return None
    for name, host in _confirm_events(cells, source):
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=name, host=host)
    instance = live_instance(session, uuid)
    return {"payload": notifications.instance_payload(instance, migration_uuid=event["migration_uuid"])
            if instance else None}


def _announce_confirmed(event: dict[str, Any], cells: dict[str, str] | None, source: str,
                        payload: dict[str, Any] | None) -> None:
    """``instance.resize_confirm.end``: from the conductor after a move between cells, else the source."""
    publisher = notifications.conductor_publisher() if cells else notifications.compute_publisher(source)
    notifications.notify(notifications.RESIZE_CONFIRM_END, instance_uuid=event["instance_uuid"],
                         publisher_id=publisher, payload=payload, identity=settle_identity(event))


def fail_confirm(event: dict[str, Any]) -> dict[str, Any]:
    """Rollback tail of a confirm that failed at or after the source host.

    The server stays where it runs, on the destination with its new flavor, and settles as a
    confirm would (ACTIVE or SHUTOFF, never ERROR); the migration goes to ``error``; the fault
    says what is left on the source. Once the source host of a move within the cell has removed
    the old guest and disks (``confirmed_at_source``: what failed came after), what the migration
    held there, its allocation, the source's port bindings and volume attachments, is released as
    a confirm releases it, when it can be (:func:`_release_cleaned_source`); otherwise (and after
    a move between cells, whose source cell copy may be what failed) the migration keeps whatever
    it still holds, for a confirm of it run again.
    """
    uuid, migration_uuid, request_id = event["instance_uuid"], event["migration_uuid"], event["request_id"]
    error = event.get("error") or {}
    cause = error_message(error)
    move = event.get("move") or {}
    cells = cross_cell_settle.cross_cell(event)
    where = cross_cell_settle.where_things_are(uuid, cells) if cells else ""
    with cell_session(event["cell"]) as session:
        # The server keeps the move's flavor: recorded as a confirm records it.
        flavor = _flavor_left(live_instance(session, uuid), migration_of(session, uuid, migration_uuid),
                              migration_states.ERROR)
    if flavor is not None:  # before the migration is put in error, so that a run again does it too
        keep_flavor_in_spec(uuid, flavor)
    # Between cells the source cell's copy may be what failed: a confirm run again, accepted while
    # the migration holds its allocation, removes it and the rest.
    released = not cells and "confirmed_at_source" in event and _release_cleaned_source(event)
    with cell_session(event["cell"]) as session:
        migration = migration_of(session, uuid, migration_uuid)
        if migration.status == migration_states.CONFIRMED or actions.event_finished(session, uuid, request_id,
                                                                 _confirm_events(cells, "")[-1][0]):
            return {}
        source = str(migration.source_compute)
        dest = str(migration.dest_compute)
        held = describe_allocations(migration_uuid)
        if "confirmed_at_source" in event:
            message = (f"Confirming the resize failed after the source host removed the old guest and disks: "
                       f"{owner_cause(error)}")
            released_text = ("; what the migration held there (its allocation, the source's port bindings "
                             "and volume attachments) was released" if released else "")
            details = (f"The server runs on {dest} with its new flavor; source host {source} removed the old "
                       f"guest and disks{released_text}. Migration {migration_uuid} is in error; "
                       f"its allocation: {held}.")
        else:
            message = f"Confirming the resize failed on the source host: {owner_cause(error)}"
            details = (f"The server runs on {dest} with its new flavor. Host {source} may still hold the old "
                       f"guest and the disks in {uuid}_resize. Migration {migration_uuid} is in error and keeps "
                       f"its allocation ({held}) until a confirm of that migration, run again, cleans up.")
        if cells:
            details = f"{details} {where}"
        instance = live_instance(session, uuid)
        settle(session, instance)
        migration = migration_of(session, uuid, migration_uuid)
        migration.status = migration_states.ERROR
        if instance is not None:
            instances.add_fault(session, uuid, message, host=source, details=fault_details(error, details))
        for name, host in _confirm_events(cells, move.get("source", {}).get("host", source)):
            actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=name, host=host,
                                 error=error or {"Error": errors.ConfirmResizeFailed.__name__, "Cause": message})
    logger.warning("confirm failed", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                            "cause": cause, "migration_allocation": held})
    return {}


def _release_cleaned_source(event: dict[str, Any]) -> bool:
    """For FailConfirm once the source host removed the old guest and disks: release what the
    migration holds there (:func:`release_source`), as FinishConfirm would have, while the
    migration is still ``confirming``; a run again after FailConfirm committed finds it in
    ``error`` and leaves the source to whatever holds it since (a newer move may have come back
    to that host). Whether it was released: a release that fails is logged and left for a
    confirm of the migration run again (what FinishConfirm failed on may fail here too)."""
    uuid, migration_uuid, move = event["instance_uuid"], event["migration_uuid"], event["move"]
    with cell_session(event["cell"]) as session:
        if migration_of(session, uuid, migration_uuid).status != migration_states.CONFIRMING:
            return False
    try:
        release_source(uuid, migration_uuid, move["source"]["host"], move["same_host"])
    except Exception as exc:  # noqa: BLE001 - the failure is recorded below whatever the release does
        logger.warning("what the migration holds on the cleaned source could not be released",
                       extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                              "error": f"{type(exc).__name__}: {exc}"})
        return False
    return True


# Events of the revert workflow, for the shared rollback below.
EVENT_REVERT = "compute_revert_resize"


def _newest_settle_request(session: Session, instance_uuid: str) -> str | None:
    """The request id of the instance's newest confirm or revert (accepted with its migration's status)."""
    return session.scalars(
        select(InstanceAction.request_id)
        .where(InstanceAction.instance_uuid == instance_uuid,
               InstanceAction.action.in_((actions.CONFIRM_RESIZE, actions.REVERT_RESIZE)))
        .order_by(InstanceAction.id.desc()).limit(1)
    ).first()


def restore_verify_resize(event: dict[str, Any]) -> dict[str, Any]:
    """Rollback of a confirm or revert that failed before the server left VERIFY_RESIZE.

    Used by both workflows: when the first step failed for another reason than a refusal, and
    by the revert when the destination could not clean up (the server still runs there), or
    when a cross-cell revert could not make the source cell's copy the server again (that is
    undone first: the mapping names the target cell again, whose copy is visible). The
    migration goes back from ``confirming``/``reverting`` to ``finished`` and the task from
    ``resize_reverting`` to none, so the owner can confirm or revert again; the event records the
    error and a fault says what happened. Nothing is done when the migration is in neither state
    (a refused execution, or this step run before).
    """
    uuid, migration_uuid, request_id = event["instance_uuid"], event["migration_uuid"], event["request_id"]
    error = event.get("error") or {}
    cause = error_message(error)
    with cell_session(event["cell"]) as session:
        newest = _newest_settle_request(session, uuid)
    if newest not in (None, request_id):
        # This step ran late (its first answer was lost): the migration's state is a newer
        # confirm's or revert's now, not this one's to put back.
        logger.warning("a newer confirm or revert owns the migration; nothing restored",
                       extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "request_id": request_id,
                              "newer_request_id": newest})
        return {}
    cells = cross_cell_settle.cross_cell(event)
    # What every event this rollback ends records, when the failure came with no error of its own.
    recorded = error or {"Error": "Error", "Cause": cause}
    cross_cell_settle.undo_flip(event, recorded)
    with cell_session(event["cell"]) as session:
        migration = migration_of(session, uuid, migration_uuid)
        if migration.status not in (migration_states.CONFIRMING, migration_states.REVERTING):
            return {}
        reverting = migration.status == migration_states.REVERTING
        name, verb = (EVENT_REVERT, "Reverting") if reverting else (EVENT_CONFIRM, "Confirming")
        if cells or migration.cross_cell_move:  # failed before the move was read (no $.move): still cross-cell
            name = cross_cell_settle.EVENT_REVERT if reverting else cross_cell_settle.EVENT_CONFIRM
        source, dest = migration.source_compute, migration.dest_compute
        if reverting and cells:
            message = f"Reverting the resize failed; the server stays in its target cell: {owner_cause(error)}"
            details = (f"The server stays in VERIFY_RESIZE on {dest} in cell {cells['target_cell']}; its old disks "
                       f"are still on {source}. Revert again to retry.")
        elif reverting and "move" in event:
            message = f"Reverting the resize failed on the destination host: {owner_cause(error)}"
            details = (f"The server stays in VERIFY_RESIZE on {dest}; its old disks are still on {source}. "
                       f"Revert again to retry.")
        else:
            message = f"{verb} the resize failed before any host was changed: {owner_cause(error)}"
            details = (f"The server stays in VERIFY_RESIZE on {dest} (source host {source}). Confirm or revert "
                       f"it again.")
        try:  # only over the status read: a delete's confirm may have settled the migration since
            resize._update_migration(session, migration_uuid, {"status": migration_states.FINISHED},
                                     (migration_states.CONFIRMING, migration_states.REVERTING))
        except errors.UnexpectedTaskState:
            logger.warning("migration settled meanwhile; nothing restored",
                           extra={"instance_uuid": uuid, "migration_uuid": migration_uuid})
            return {}
        instance = live_instance(session, uuid)
        if reverting and instance is not None:
            try:
                instances.update_cas(session, uuid, {"task_state": None},
                                     expected_task_state=(states.RESIZE_REVERTING,))
            except errors.UnexpectedTaskState:
                logger.warning("task changed meanwhile; left as is", extra={"instance_uuid": uuid})
        if instance is not None:
            instances.add_fault(session, uuid, message, host=dest, details=fault_details(error, details))
        if not reverting and name == cross_cell_settle.EVENT_CONFIRM:  # the source host's part, if it began
            actions.finish_started_event(session, instance_uuid=uuid, request_id=request_id,
                                         event=cross_cell_settle.EVENT_CONFIRM_AT_SOURCE, error=recorded)
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=name,
                             host=dest if reverting else source, error=recorded)
    logger.warning("confirm or revert rolled back to VERIFY_RESIZE",
                   extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "cause": cause})
    return {}
