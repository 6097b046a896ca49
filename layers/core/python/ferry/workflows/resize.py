"""Steps of the same-cell resize and cold migrate workflow (``statemachine/resize.asl.json``).

Forward, to VERIFY_RESIZE::

    ValidateMoveInput → SelectMoveDestinations → PrepResizeAtDest → prep_resize (destination host)
    → ResizeInstanceAtSource → resize_instance (source host) → FinishResizeAtDest
    → finish_resize (destination host) → MarkResized

A resize claim the destination host refuses (``Ferry.ResizeClaimFailed``) reschedules to the
next alternate (:func:`reschedule_move`) unless a host was requested. Any other failure rolls
back the finished steps in reverse: ``revert_resize`` on the destination host once anything
may be there, ``finish_revert_resize`` on the source host once ``resize_instance`` was sent,
then :func:`rollback_move` puts records, allocations, port bindings and volume attachments
back as they were before the move. When ``revert_resize`` failed after ``finish_resize`` may
have been sent, a guest of the server may still run on the destination: the source guest is
restored without powering it on and the server goes to ERROR until an operator has destroyed
the other.

Each step takes the workflow's state document and returns what the state machine stores
under its ``ResultPath``. The document holds the execution input and, as the move goes on:

``move``
    from ValidateMoveInput: the source (host, node, queue, power state, and ``allocated``:
    whether the server held allocations when the move started), the transfer location and the
    arguments that restore the source guest.
``destination``
    from SelectMoveDestinations (or RescheduleMove): host, node, cell, provider, queue,
    ``same_host``, the alternates left, ``claimed`` (the destination claim, ``{rp_uuid: {rc:
    n}}``) and ``claim_generation``, the instance consumer's generation while it held exactly
    that claim (None when it did not by the time it was read). A document written before
    ``claimed`` was recorded lacks it, and maybe ``claim_generation`` too (see
    :func:`_restore_allocations`).
``prep``, ``resize``, ``finish``
    the host operation arguments built by PrepResizeAtDest, ResizeInstanceAtSource and
    FinishResizeAtDest.
``claim``, ``resized``, ``finished``
    the results of ``prep_resize``, ``resize_instance`` and ``finish_resize``.
``error``, ``cleanup_error``, ``restore_error``, ``restored``
    what went wrong, and what the rollback host operations answered.

Which of these keys are present tells :func:`rollback_move` how far the move got. Every step
is idempotent: the records are compare-and-swapped on the states a step moves from *or to*,
and placement and binding changes are no-ops when already done.

The ``Catch`` of the last step (MarkResized, or CompleteMoveAcrossCells across cells) goes
through :func:`ferry.workflows.cross_cell.check_move_committed` before any rollback: a step that
failed after it committed (a lost response, a timeout) has put the server in VERIFY_RESIZE,
where its owner may already confirm or revert it, so the move stands.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from aws_lambda_powertools.metrics import MetricUnit
from sqlalchemy import CursorResult, select, update
from sqlalchemy.orm import Session

from ferry import config, errors, hosts, images, network, notifications, placement, scheduler, validation, volumes
from ferry.compute import actions, instances, states
from ferry.compute.migration_states import (
    CONFIRMED,
    CONFIRMING,
    ERROR,
    FINISHED,
    MIGRATING,
    MIGRATION,
    POST_MIGRATING,
    PRE_MIGRATING,
    RESIZE,
    REVERTED,
    REVERTING,
)
from ferry.observability import logger, metrics
from ferry.store.api_models import RequestSpec
from ferry.store.cell_models import BlockDeviceMapping, Instance, InstanceAction, InstanceActionEvent, Migration
from ferry.store.db import all_cells, api_session, cell_session
from ferry.workflows import error_message, fault_details, owner_cause

# Instance action events, in the order the move records them (Nova's names).
EVENT_MIGRATE = "conductor_migrate_server"
EVENT_PREP = "compute_prep_resize"
EVENT_RESIZE = "compute_resize_instance"
EVENT_FINISH = "compute_finish_resize"
EVENTS = (EVENT_MIGRATE, EVENT_PREP, EVENT_RESIZE, EVENT_FINISH)
# A move to another cell records these instead (Nova's snapshot-based resize).
EVENT_PREP_AT_DEST_CROSS_CELL = "compute_prep_snapshot_based_resize_at_dest"
EVENT_PREP_AT_SOURCE_CROSS_CELL = "compute_prep_snapshot_based_resize_at_source"
EVENT_FINISH_AT_DEST_CROSS_CELL = "compute_finish_snapshot_based_resize_at_dest"
CROSS_CELL_EVENTS = (EVENT_MIGRATE, EVENT_PREP_AT_DEST_CROSS_CELL, EVENT_PREP_AT_SOURCE_CROSS_CELL,
                     EVENT_FINISH_AT_DEST_CROSS_CELL)

# Whether moves the API allowed to cross cells (compute:servers:resize:cross_cell) are scheduled across
# cells; the state machine routes a destination in another cell to the cross-cell steps (issue 4).
CROSS_CELL_SCHEDULING = True

# Migration statuses a move under way can be in; rollback leaves any other alone.
_IN_PROGRESS = (PRE_MIGRATING, MIGRATING, POST_MIGRATING, FINISHED)

INPUT_SCHEMA: dict[str, Any] = json.loads(
    Path(__file__).with_name("resize.input.schema.json").read_text(encoding="utf-8"))

# What every step after ValidateMoveInput receives (the handlers validate it).
STEP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["instance_uuid", "migration_uuid", "cell", "request_id", "move"],
    "properties": {
        "instance_uuid": {"type": "string", "minLength": 1},
        "migration_uuid": {"type": "string", "minLength": 1},
        "cell": {"type": "string", "minLength": 1},
        "request_id": {"type": "string"},
        "move": {"type": "object", "required": ["source", "transfer", "restore_args"]},
        "destination": {"type": "object", "required": ["host", "node", "cell", "provider_uuid", "same_host"]},
    },
}

# ValidateMoveInput gets ``{"input": <execution input>, "execution_name": <name>}``.
VALIDATE_EVENT_SCHEMA: dict[str, Any] = {"type": "object", "required": ["input"]}

# RollbackMove also runs when validation itself broke: then it has the raw input, without ``move``.
ROLLBACK_SCHEMA: dict[str, Any] = {
    **STEP_SCHEMA,
    "required": [key for key in STEP_SCHEMA["required"] if key != "move"],
}

_HOST_FLAVOR_FIELDS = ("flavorid", "name", "vcpus", "memory_mb", "root_gb", "ephemeral_gb", "swap")


# --- small helpers ------------------------------------------------------------------------------


def host_flavor(flavor: Mapping[str, Any]) -> dict[str, Any]:
    """The flavor fields a host operation takes (``protocol.FLAVOR_SCHEMA``)."""
    return {key: flavor[key] for key in _HOST_FLAVOR_FIELDS}


def _get_migration(session: Session, migration_uuid: str) -> Migration | None:
    return session.scalars(select(Migration).where(Migration.uuid == migration_uuid,
                                                   Migration.deleted.is_(False))).one_or_none()


def _update_migration(session: Session, migration_uuid: str, values: dict[str, Any],
                      expected_status: Iterable[str]) -> None:
    """Update the migration only if its status is one of ``expected_status`` (one UPDATE).

    Raises:
        UnexpectedTaskState: the migration is in another status (another operation owns it).
    """
    expected = list(expected_status)
    stmt = (update(Migration).where(Migration.uuid == migration_uuid, Migration.status.in_(expected))
            .values(**values).execution_options(synchronize_session=False))
    if cast(CursorResult[Any], session.execute(stmt)).rowcount != 1:
        current = _get_migration(session, migration_uuid)
        status = current.status if current is not None else "missing"
        raise errors.UnexpectedTaskState(
            f"Cannot update migration {migration_uuid}: it is {status}, not one of {', '.join(expected)}.")
    session.expire_all()


def _source(event: Mapping[str, Any]) -> dict[str, Any]:
    return cast(dict[str, Any], event["move"]["source"])


def _ports(session: Session, instance_uuid: str) -> list[dict[str, Any]]:
    return [{"id": port.id, "mac_address": port.mac_address}
            for port in network.guest_ports(session, instance_uuid)]


def _volumes_on(host: str, instance_uuid: str, cell: str) -> list[dict[str, Any]]:
    """The server's volumes attached (or reserved) on ``host``, as host operations take them."""
    with cell_session(cell) as session:
        boot_index = {b.volume_id: b.boot_index for b in session.scalars(select(BlockDeviceMapping).where(
            BlockDeviceMapping.instance_uuid == instance_uuid, BlockDeviceMapping.deleted.is_(False),
            BlockDeviceMapping.volume_id.is_not(None)))}
    with api_session() as session:
        return [{"volume_id": volume.id, "path": volume.path, "device": attachment.device,
                 "boot_index": boot_index.get(volume.id)}
                for volume, attachment in volumes.attached_volumes(session, instance_uuid, host)]


def _notify(event_type: str, instance: Instance, publisher_id: str, **extra: Any) -> dict[str, Any]:
    """Build the payload now (inside the session); the caller publishes it after the commit.

    The move's ``migration_uuid`` (in ``extra``) is the event's identity: every copy of it (a
    step run again) carries the same ``message_id`` (:func:`ferry.notifications.message_id`).
    """
    payload = notifications.instance_payload(instance, **extra)
    return {"event_type": event_type, "instance_uuid": instance.uuid, "publisher_id": publisher_id,
            "payload": payload, "identity": extra.get("migration_uuid")}


def _publish(*pending: dict[str, Any]) -> None:
    for item in pending:
        notifications.notify(item["event_type"], instance_uuid=item["instance_uuid"],
                             publisher_id=item["publisher_id"], payload=item["payload"],
                             identity=item.get("identity"))


def _move_extra(instance: Instance, migration_uuid: str) -> dict[str, Any]:
    return {"migration_uuid": migration_uuid, "old_flavor": notifications.flavor_payload(instance.old_flavor),
            "new_flavor": notifications.flavor_payload(instance.new_flavor)}


def _prep_end(instance: Instance, migration: Migration) -> dict[str, Any] | None:
    """``instance.resize_prep.end`` for a prep that started and has not ended, else None (read in the session).

    A prep starts when PrepResizeAtDest records its destination on the migration (it sends the
    start right after). It ends when ResizeInstanceAtSource moves the server on from
    ``resize_prep`` (it sends the end), or when RescheduleMove clears the refused destination
    (it sends the end, with this). So a migration naming a destination while the server is still
    in ``resize_prep`` is a prep whose end is owed, from that destination as its start was; once
    it is sent the record says so, and a step run again sends no second end.
    """
    if migration.dest_compute is None or instance.task_state != states.RESIZE_PREP:
        return None
    return _notify(notifications.RESIZE_PREP_END, instance, notifications.compute_publisher(migration.dest_compute),
                   **_move_extra(instance, migration.uuid))


# --- ValidateMoveInput --------------------------------------------------------------------------


def _refuse(message: str) -> errors.MoveNotPrepared:
    logger.warning("resize execution refused", extra={"reason": message})
    return errors.MoveNotPrepared(message)


def validate_input(event: dict[str, Any]) -> dict[str, Any]:
    """Check the execution input and the records the API prepared; return the state document.

    Reads only. The input must match ``statemachine/resize.input.schema.json``; the migration
    must be this instance's, ``pre-migrating``, of type ``resize`` or ``migration`` and from the
    instance's host; the instance must be mapped to ``cell``, in task_state ``resize_prep`` with
    ``old_flavor``, ``new_flavor`` and ``old_vm_state`` (active or stopped) recorded.

    Params:
        event: ``{"input": <execution input>, "execution_name": <the execution's name>}``.

    Returns:
        The input (``execution_name``, ``user_id`` and ``project_id`` filled in) plus ``move``.

    Raises:
        InvalidWorkflowInput: the input does not match the schema.
        MoveNotPrepared: the migration or instance is missing or not in the expected state.
    """
    raw = event.get("input")
    try:
        validation.check(raw, INPUT_SCHEMA)
    except validation.SchemaMismatch as exc:
        where = exc.where() or "the input"
        raise errors.InvalidWorkflowInput(f"Invalid resize input at {where}: {exc.message}") from exc
    document: dict[str, Any] = {"user_id": None, "project_id": None, **cast(dict[str, Any], raw)}
    document.setdefault("execution_name", event.get("execution_name"))
    uuid, migration_uuid, cell = document["instance_uuid"], document["migration_uuid"], document["cell"]
    try:
        mapped = instances.cell_of(uuid).name
    except errors.InstanceNotFound as exc:
        raise _refuse(f"Instance {uuid} has no instance mapping to a cell.") from exc
    if mapped != cell:
        raise _refuse(f"Instance {uuid} lives in cell {mapped}, not {cell}.")
    with cell_session(cell) as session:
        migration = _get_migration(session, migration_uuid)
        if migration is None or migration.instance_uuid != uuid:
            raise _refuse(f"Migration {migration_uuid} of instance {uuid} does not exist in cell {cell}.")
        if migration.status != PRE_MIGRATING:
            raise _refuse(f"Migration {migration_uuid} is {migration.status}, not {PRE_MIGRATING}.")
        if migration.migration_type not in (RESIZE, MIGRATION):
            raise _refuse(f"Migration {migration_uuid} is a {migration.migration_type}, not a resize or migration.")
        try:
            instance = instances.get(session, uuid)
        except errors.InstanceNotFound as exc:
            raise _refuse(f"Instance {uuid} does not exist in cell {cell}.") from exc
        if instance.task_state != states.RESIZE_PREP:
            raise _refuse(f"Instance {uuid} is in task_state {instance.task_state}, not {states.RESIZE_PREP}.")
        if not instance.old_flavor or not instance.new_flavor:
            raise _refuse(f"Instance {uuid} has no old_flavor/new_flavor recorded for the move.")
        if instance.old_vm_state not in (states.ACTIVE, states.STOPPED):
            raise _refuse(f"Instance {uuid} has old_vm_state {instance.old_vm_state}, not active or stopped.")
        if not instance.host or instance.host != migration.source_compute:
            raise _refuse(f"Migration {migration_uuid} starts from {migration.source_compute}, "
                          f"but instance {uuid} is on {instance.host}.")
        source: dict[str, Any] = {"host": instance.host, "node": migration.source_node or instance.node,
                  "power_state": instance.power_state, "vm_state": instance.vm_state}
        name, old_flavor = instance.display_name, instance.old_flavor
        power_on = instance.old_vm_state != states.STOPPED
        migration_type = migration.migration_type
    with api_session() as session:
        ports = _ports(session, uuid)
    source["queue_url"] = hosts.queue_url(source["host"])
    # A server can hold no allocation (an operator removed it): then the migration takes none from it,
    # and what the instance holds later is this move's claim only when it is exactly one (an operator
    # may give the allocation back meanwhile; see _claimed_selection and _restore_allocations).
    source["allocated"] = bool(placement.get_allocations(uuid))
    document["move"] = {
        "migration_type": migration_type,
        "source": source,
        "transfer": images.transfer_location(migration_uuid),
        "restore_args": {"migration_uuid": migration_uuid, "name": name, "flavor": host_flavor(old_flavor),
                         "ports": ports, "volumes": _volumes_on(source["host"], uuid, cell),
                         "power_on": power_on},
    }
    return document


# --- SelectMoveDestinations ---------------------------------------------------------------------


def _move_facts(session: Session, instance: Instance, migration: Migration) -> dict[str, Any]:
    """What :func:`_move_spec` needs of the instance and its migration, read in their cell's ``session``."""
    return {"uuid": instance.uuid, "host": instance.host, "project_id": instance.project_id,
            "user_id": instance.user_id, "new_flavor": instance.new_flavor,
            "migration_type": migration.migration_type, "is_bfv": instances.is_bfv(session, instance.uuid)}


def _move_spec(facts: Mapping[str, Any], cell: str, requested_host: str | None) -> dict[str, Any]:
    """The scheduler request for the move (``facts``: see :func:`_move_facts`): the new flavor, the
    source excluded unless allowed.

    It reads the API database: called with no cell session open (SQLite's writers take their
    files one at a time, and a step holding the API database waits for a cell the other way).
    """
    with api_session() as session:
        row = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == facts["uuid"])).one_or_none()
        base = dict(row.spec or {}) if row is not None else {}
    ignore: set[str] = set()
    same_host_allowed = facts["migration_type"] == RESIZE and config.get().allow_resize_to_same_host
    if not same_host_allowed:
        ignore.add(facts["host"] or "")
    ignore.discard("")
    # Every cell but cell0 when the API allowed a cross-cell move; CrossCellWeigher prefers the source cell.
    cross_cell = CROSS_CELL_SCHEDULING and base.get("allow_cross_cell_move")
    allowed_cells = [c.name for c in all_cells(include_cell0=False)] if cross_cell else [cell]
    return {
        **base,
        "instance_uuid": facts["uuid"],
        "project_id": facts["project_id"],
        "user_id": facts["user_id"],
        "flavor": facts["new_flavor"],
        "is_bfv": bool(base.get("is_bfv", facts["is_bfv"])),
        "ignore_hosts": sorted(ignore),
        "requested_destination": {"host": requested_host} if requested_host else None,
        "allowed_cells": allowed_cells,
        "source_cell": cell,
        "may_leave_cell": bool(cross_cell),
    }


def _destination(selection: scheduler.Selection, alternates: list[scheduler.Selection], source_host: str,
                 instance_uuid: str) -> dict[str, Any]:
    """The state document's ``destination`` for a claimed selection (read after the claim)."""
    generation, held = placement.consumer_allocations(instance_uuid)
    return {
        "host": selection.host,
        "node": selection.node,
        "cell": selection.cell,
        "provider_uuid": selection.provider_uuid,
        "queue_url": hosts.queue_url(selection.host),
        "same_host": selection.host == source_host,
        "alternates": [alt.to_dict() for alt in alternates],
        "claimed": selection.allocations,
        "claim_generation": generation if held == selection.allocations else None,
    }


def _claim_provider(held: placement.Allocations, spec: Mapping[str, Any]) -> placement.Provider | None:
    """The provider of ``held`` when ``held`` is exactly what a claim of this move holds, else None.

    A claim of the move is the new flavor's resources (as the scheduler derives them from the
    flavor and ``is_bfv``) on one provider whose host the move may go to: not one of the spec's
    ``ignore_hosts`` (which hold the source unless the move may stay there), and the requested
    host when one was asked for. The server's own allocation on the source, as an operator gives
    it back, is not one, unless the move may stay on the source and the two flavors are the same
    size: the allocations alone do not tell those apart (callers that know more say so).
    """
    if len(held) != 1:
        return None
    [(rp_uuid, resources)] = held.items()
    if resources != placement.resources_from_flavor(spec["flavor"], bool(spec["is_bfv"])):
        return None
    try:
        provider = placement.get_provider(rp_uuid)
    except errors.ResourceProviderNotFound:
        return None
    requested = (spec.get("requested_destination") or {}).get("host")
    if provider.host in spec["ignore_hosts"] or (requested and provider.host != requested):
        return None
    return provider


def _claimed_selection(instance_uuid: str, migration_uuid: str, cell: str, spec: Mapping[str, Any],
                       allocated_on: str | None) -> scheduler.Selection | None:
    """The destination an earlier run of this step claimed, None when none did.

    The migration then holds the source allocation and the instance the claim. A migration that
    holds nothing (the server held none when the move started, or its allocation was removed
    since ValidateMoveInput) was given nothing, so what the instance holds is an earlier run's
    claim only when it is exactly what a claim of this move holds (:func:`_claim_provider`): an
    operator may have given the server its allocation back since, as ``ferry audit`` advises,
    and that allocation is the server's to hand to the migration, not a destination that skipped
    the filters. Nor is the allocation of a server that held one on its source host when the
    move started (``allocated_on``, as ValidateMoveInput read it), still there: a claim would
    have handed it to the migration, so it is the server's own, even when the new flavor is the
    same size and the move may stay on that host.
    """
    claimed = placement.get_allocations(instance_uuid)
    if not placement.get_allocations(migration_uuid):
        provider = _claim_provider(claimed, spec)
        if provider is None or (allocated_on is not None and provider.host == allocated_on):
            return None
        rp_uuid, resources = provider.uuid, claimed[provider.uuid]
    else:
        if not claimed:
            return None
        rp_uuid, resources = next(iter(claimed.items()))
        provider = placement.get_provider(rp_uuid)
    host_cell = hosts.cell_of_host(provider.host) if provider.host else None
    return scheduler.Selection(host=provider.host, node=provider.name, cell=host_cell or cell, provider_uuid=rp_uuid,
                               allocations={rp_uuid: resources})


def _load(session: Session, event: Mapping[str, Any]) -> tuple[Instance, Migration]:
    instance = instances.get(session, event["instance_uuid"])
    migration = _get_migration(session, event["migration_uuid"])
    if migration is None:
        raise errors.MoveNotPrepared(f"Migration {event['migration_uuid']} does not exist.")
    return instance, migration


def select_destinations(event: dict[str, Any]) -> dict[str, Any]:
    """Schedule the move and claim the destination: the source allocation moves to the migration.

    One placement transaction hands the instance's allocation on the source to the migration
    and claims the chosen destination for the instance with the new flavor. The source is
    excluded for a cold migrate, and for a resize unless ``allow_resize_to_same_host``; a
    requested host is the only candidate (the filters still run on it). Records the
    ``conductor_migrate_server`` event, and ends it for a destination in the server's cell (the
    conductor's part ends once the move is handed to the hosts); to another cell it spans the
    whole move, as Nova's cross-cell task does, ended by CompleteMoveAcrossCells or the rollback.
    Run again, it finds the claim of an earlier run (see
    :func:`_claimed_selection`) and claims nothing more.

    Returns:
        The destination ``{host, node, cell, provider_uuid, queue_url, same_host, alternates,
        claimed, claim_generation}``: ``claimed`` is the claim, ``claim_generation`` the instance
        consumer's generation while it held exactly that (None when it did not when read).

    Raises:
        NoValidHost: no host passes the filters with room for the new flavor.
        UnexpectedTaskState: the instance is no longer in ``resize_prep``.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    with cell_session(cell) as session:
        instance, migration = _load(session, event)
        if instance.task_state != states.RESIZE_PREP or migration.status != PRE_MIGRATING:
            raise errors.UnexpectedTaskState(
                f"Instance {uuid} is in task_state {instance.task_state} with migration {migration.status}: "
                f"it is not waiting to be scheduled.")
        # The instance's row is swapped (and so locked) before the event is recorded, and both are
        # committed before anything is claimed: compute.moves.abandon_prepared_move relies on it.
        instances.update_cas(session, uuid, {"task_state": states.RESIZE_PREP},
                             expected_task_state=(states.RESIZE_PREP,))
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_MIGRATE)
        facts = _move_facts(session, instance, migration)
        source_host = cast(str, instance.host)
    # The API database is read once the cell's transaction ended (one database at a time).
    spec = _move_spec(facts, cell, event.get("requested_host"))
    allocated = ((event.get("move") or {}).get("source") or {}).get("allocated")
    chosen = _claimed_selection(uuid, migration_uuid, cell, spec, source_host if allocated else None)
    if chosen is None:
        selections = scheduler.select_destinations(spec, migration_uuid=migration_uuid)
        chosen, alternates = selections[0], selections[1:]
    else:  # an earlier run claimed (its answer lost): its alternates are listed again
        alternates = scheduler.alternates_for(spec, chosen, migration_uuid=migration_uuid)
    if chosen.cell == cell:
        with cell_session(cell) as session:
            actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_MIGRATE)
    logger.info("move scheduled", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                         "source": source_host, "destination": chosen.host})
    return _destination(chosen, alternates, source_host, uuid)


# --- PrepResizeAtDest ---------------------------------------------------------------------------


def prep_resize_at_dest(event: dict[str, Any]) -> dict[str, Any]:
    """Record the destination on the migration, bind ports (INACTIVE) and reserve volumes there.

    Records the ``compute_prep_resize`` event and sends ``instance.resize_prep.start``
    (publisher ``compute:<dest>``) as soon as the destination is recorded on the migration: a
    destination recorded there has had its start, whose end ResizeInstanceAtSource sends, or
    RescheduleMove or RollbackMove when the prep goes no further (:func:`_prep_end`).

    Returns:
        ``{"args": <prep_resize arguments>}`` for the destination host; ``is_bfv`` tells its claim
        that a volume-backed server's root disk is not on the host.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    dest, source = event["destination"], _source(event)
    with cell_session(cell) as session:
        instance, _migration = _load(session, event)
        if instance.task_state != states.RESIZE_PREP:
            raise errors.UnexpectedTaskState(f"Instance {uuid} is in task_state {instance.task_state}, "
                                             f"not {states.RESIZE_PREP}.")
        _update_migration(session, migration_uuid, {"dest_compute": dest["host"], "dest_node": dest["node"],
                                                     "dest_host": dest["host"]}, (PRE_MIGRATING,))
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_PREP,
                            host=dest["host"])
        new_flavor = cast(dict[str, Any], instance.new_flavor)
        is_bfv = instances.is_bfv(session, uuid)
        start = _notify(notifications.RESIZE_PREP_START, instance, notifications.compute_publisher(dest["host"]),
                        **_move_extra(instance, migration_uuid))
    _publish(start)
    with api_session() as session:
        network.bind_inactive(session, uuid, dest["host"])
        volumes.reserve_on(session, uuid, source["host"], dest["host"])
    return {"args": {"migration_uuid": migration_uuid, "flavor": host_flavor(new_flavor),
                     "same_host": dest["same_host"], "is_bfv": is_bfv}}


# --- RescheduleMove -----------------------------------------------------------------------------


def _release_destination(instance_uuid: str, dest_host: str, source_host: str) -> None:
    """Drop the destination's port bindings and volume attachments; the source's bindings are active again."""
    with api_session() as session:
        if dest_host != source_host:
            network.unbind(session, instance_uuid, dest_host)
            volumes.detach_from(session, instance_uuid, dest_host)
        for port in network.instance_ports(session, instance_uuid):
            for binding in port.bindings:
                if binding.host == source_host:
                    binding.status = network.ACTIVE


def reschedule_move(event: dict[str, Any]) -> dict[str, Any]:
    """Move the instance's claim from the destination that refused it to the next alternate.

    The failed destination's port bindings and volume reservations are dropped, and its prep
    ends (``instance.resize_prep.end`` from ``compute:<refused host>``, once: the run that clears
    the destination from the migration sends it); the migration keeps the source allocation.
    What the instance holds now decides what the migration gets, not what it held at
    ValidateMoveInput: this move's claim (the refused destination's as it recorded it, or
    exactly what a claim of the move holds there or on an alternate) just moves,
    since handing it over would leave the migration holding a claim as if it were the source
    allocation; anything else (the server's allocation, given back since it was removed) goes
    to the migration unless it holds one already, as for a server that kept its allocation.
    Alternates that no longer fit are skipped. Never reschedules a move to a requested host.

    Returns:
        The new destination, with the alternates after it.

    Raises:
        NoValidHost: a host was requested, or no alternate can take the claim.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    failed, source_host = event["destination"], _source(event)["host"]
    if event.get("requested_host"):
        raise errors.NoValidHost(f"Host {event['requested_host']} was requested: the move is not rescheduled.")
    alternates = [scheduler.Selection.from_dict(a) for a in failed.get("alternates") or []]
    held = placement.get_allocations(uuid)
    for index, alternate in enumerate(alternates):
        if alternate.provider_uuid in held and failed["provider_uuid"] not in held:
            return _destination(alternate, alternates[index + 1:], source_host, uuid)  # an earlier run claimed it
    _release_destination(uuid, failed["host"], source_host)
    with cell_session(cell) as session:
        instance, migration = _load(session, event)
        prep_end = _prep_end(instance, migration)
        _update_migration(session, migration_uuid, {"dest_compute": None, "dest_node": None, "dest_host": None},
                          (PRE_MIGRATING,))
        facts = _move_facts(session, instance, migration)
    spec = _move_spec(facts, cell, None)
    if prep_end is not None:
        _publish(prep_end)
    source_holder = None if _is_move_claim(held, failed, spec) else migration_uuid
    spec = {**spec, "ignore_hosts": sorted({*spec["ignore_hosts"], failed["host"]})}
    reasons = []
    for index, alternate in enumerate(alternates):
        try:
            chosen = scheduler.claim_alternate(spec, alternate, migration_uuid=source_holder)
        except errors.NoValidHost as exc:
            reasons.append(exc.message)
            continue
        logger.info("move rescheduled", extra={"instance_uuid": uuid, "from": failed["host"], "to": chosen.host})
        return _destination(chosen, alternates[index + 1:], source_host, uuid)
    raise errors.NoValidHost("No alternate host could take the move. " + " ".join(reasons))


def _is_move_claim(held: placement.Allocations, destination: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
    """Whether ``held`` is this move's claim: ``destination``'s as it recorded it, or exactly what a claim of
    the move holds (:func:`_claim_provider`) on ``destination`` or one of its alternates."""
    if held and held == destination.get("claimed"):
        return True
    provider = _claim_provider(held, spec)
    return provider is not None and provider.uuid in {
        destination["provider_uuid"], *(alt["provider_uuid"] for alt in destination.get("alternates") or [])}


# --- ResizeInstanceAtSource ---------------------------------------------------------------------


def resize_instance_at_source(event: dict[str, Any]) -> dict[str, Any]:
    """Close the prep step and start the copy: task ``resize_migrating``, migration ``migrating``.

    Sends ``instance.resize_prep.end`` (``compute:<dest>``) and ``instance.resize.start``
    (``compute:<source>``) and records the ``compute_resize_instance`` event.

    Returns:
        ``{"args": <resize_instance arguments>}`` for the source host.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    dest, source = event["destination"], _source(event)
    request_id = event["request_id"]
    with cell_session(cell) as session:
        instances.update_cas(session, uuid, {"task_state": states.RESIZE_MIGRATING},
                             expected_task_state=(states.RESIZE_PREP, states.RESIZE_MIGRATING))
        _update_migration(session, migration_uuid, {"status": MIGRATING}, (PRE_MIGRATING, MIGRATING))
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=EVENT_PREP, host=dest["host"])
        actions.start_event(session, instance_uuid=uuid, request_id=request_id, event=EVENT_RESIZE,
                            host=source["host"])
        instance = instances.get(session, uuid)
        extra = _move_extra(instance, migration_uuid)
        pending = [
            _notify(notifications.RESIZE_PREP_END, instance, notifications.compute_publisher(dest["host"]), **extra),
            _notify(notifications.RESIZE_START, instance, notifications.compute_publisher(source["host"]), **extra),
        ]
    _publish(*pending)
    args = {"migration_uuid": migration_uuid, "dest_host": dest["host"], "same_host": dest["same_host"],
            "transfer": event["move"]["transfer"], "clean_shutdown": True}
    offer = (event.get("claim") or {}).get("direct")
    if offer and not dest["same_host"]:
        args["direct"] = offer  # the destination's directory, should the source see its storage
    return {"args": args}


# --- FinishResizeAtDest -------------------------------------------------------------------------


def finish_resize_at_dest(event: dict[str, Any]) -> dict[str, Any]:
    """The disks left the source: switch the server to the destination and start finishing there.

    Migration ``post-migrating`` and task ``resize_migrated`` with host and node switched to the
    destination (``instance.resize.end``, ``compute:<source>``), then task ``resize_finish``, the
    ``compute_finish_resize`` event and ``instance.resize_finish.start`` (``compute:<dest>``).

    Returns:
        ``{"args": <finish_resize arguments>}``: the new flavor, the disks ``resize_instance``
        sent, the ports and the volumes reserved on the destination, and ``power_on`` when the
        guest was running.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    dest, source = event["destination"], _source(event)
    request_id, resized = event["request_id"], event.get("resized") or {}
    pending = []
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        if instance.task_state == states.RESIZE_MIGRATING:
            _update_migration(session, migration_uuid, {"status": POST_MIGRATING}, (MIGRATING, POST_MIGRATING))
            instances.update_cas(session, uuid, {"task_state": states.RESIZE_MIGRATED, "host": dest["host"],
                                                 "node": dest["node"]},
                                 expected_task_state=(states.RESIZE_MIGRATING,))
            actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=EVENT_RESIZE,
                                 host=source["host"])
            instance = instances.get(session, uuid)
        # On every run: one that failed after its commit (retried) did not publish it; a repeat
        # carries the same message id.
        pending.append(_notify(notifications.RESIZE_END, instance, notifications.compute_publisher(source["host"]),
                               **_move_extra(instance, migration_uuid)))
        instances.update_cas(session, uuid, {"task_state": states.RESIZE_FINISH},
                             expected_task_state=(states.RESIZE_MIGRATED, states.RESIZE_FINISH))
        actions.start_event(session, instance_uuid=uuid, request_id=request_id, event=EVENT_FINISH,
                            host=dest["host"])
        instance = instances.get(session, uuid)
        pending.append(_notify(notifications.RESIZE_FINISH_START, instance,
                               notifications.compute_publisher(dest["host"]), **_move_extra(instance, migration_uuid)))
        name, flavor, old_flavor = instance.display_name, instance.new_flavor, instance.old_flavor
        power_on = bool(resized.get("was_running", instance.old_vm_state != states.STOPPED))
    with api_session() as session:
        ports = _ports(session, uuid)
    _publish(*pending)
    return {"args": {
        "migration_uuid": migration_uuid, "name": name, "flavor": host_flavor(cast(dict[str, Any], flavor)),
        "old_flavor": host_flavor(cast(dict[str, Any], old_flavor)), "same_host": dest["same_host"],
        "transfer": event["move"]["transfer"], "disks": resized.get("disks") or {}, "ports": ports,
        "volumes": _volumes_on(dest["host"], uuid, cell), "power_on": power_on,
        **({"direct": True} if resized.get("direct") else {}),
    }}


# --- MarkResized --------------------------------------------------------------------------------


# A migration in one of these has been marked resized: the owner may have confirmed or reverted since.
MARKED = (FINISHED, CONFIRMING, CONFIRMED, REVERTING, REVERTED)


def mark_resized(event: dict[str, Any]) -> dict[str, Any]:
    """VERIFY_RESIZE: destination bindings active, attachments attached, new flavor, migration ``finished``.

    The power state is the one ``finish_resize`` reported (4 for a server that was stopped).
    Finishes the ``compute_finish_resize`` event (and so the action) and sends
    ``instance.resize_finish.end`` (``compute:<dest>``).
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    dest = event["destination"]
    finished = event.get("finished") or {}
    with cell_session(cell) as session:
        _instance, migration = _load(session, event)
        ran_before = migration.status in MARKED  # a confirm or revert may already have taken over
    if ran_before:
        # Its end is announced again while the move waits in VERIFY_RESIZE: the run that
        # committed may have failed before it published it (same message id).
        announce_finished(event, cell)
        return {}
    with api_session() as session:
        network.activate(session, uuid, dest["host"])
        volumes.complete_on(session, uuid, dest["host"])
    with cell_session(cell) as session:
        instance, migration = _load(session, event)
        if migration.status in MARKED:
            return {}
        default_power = states.SHUTDOWN if instance.old_vm_state == states.STOPPED else states.RUNNING
        power_state = int(finished.get("power_state", default_power))
        instances.update_cas(session, uuid, {"vm_state": states.RESIZED, "task_state": None,
                                             "flavor": instance.new_flavor, "power_state": power_state},
                             expected_task_state=(states.RESIZE_FINISH,))
        _update_migration(session, migration_uuid, {"status": FINISHED}, (POST_MIGRATING,))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_FINISH,
                             host=dest["host"])
        instance = instances.get(session, uuid)
        end = _notify(notifications.RESIZE_FINISH_END, instance, notifications.compute_publisher(dest["host"]),
                      **_move_extra(instance, migration_uuid))
    _publish(end)
    logger.info("server resized", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                         "host": dest["host"], "power_state": power_state})
    return {}


def announce_finished(event: dict[str, Any], cell: str) -> None:
    """Send ``instance.resize_finish.end`` (``compute:<dest>``) for a move found committed, again.

    The move's last step sends it after its commit (CompleteMoveAcrossCells only after the switch
    and hiding the source copy), so a run that failed or died in between never did; this runs
    when the move is found committed. The event carries the same ``message_id`` as any copy
    sent before (its identity is the move's migration), so a consumer drops it if it was. Only
    while the move waits in VERIFY_RESIZE (``cell``'s migration ``finished``, the server visible
    there): once a confirm or revert took over, a late end would contradict what it announced.
    """
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    with cell_session(cell) as session:
        migration = _get_migration(session, migration_uuid)
        if migration is None or migration.status != FINISHED:
            return
        try:
            moved = instances.get(session, uuid)
        except errors.InstanceNotFound:
            return
        publisher = notifications.compute_publisher(event["destination"]["host"])
        end = _notify(notifications.RESIZE_FINISH_END, moved, publisher, **_move_extra(moved, migration_uuid))
    try:
        _publish(end)
    except Exception:  # best effort: the move stands whether or not its end is announced again
        logger.exception("the end of a committed move could not be announced again",
                         extra={"instance_uuid": uuid, "migration_uuid": migration_uuid})


# --- RollbackMove -------------------------------------------------------------------------------


def is_cross_cell(event: Mapping[str, Any]) -> bool:
    """Whether the move's destination is in another cell than the instance's."""
    return bool(event.get("destination")) and event["destination"]["cell"] != event["cell"]


def _failed_step(event: Mapping[str, Any]) -> tuple[str, str | None]:
    """The event of the step that failed and the host it ran for, from how far the move got."""
    if "destination" not in event:
        return EVENT_MIGRATE, None
    if is_cross_cell(event):
        if "target" not in event:  # TargetDBSetup: the orchestrator's copy into the target cell
            return EVENT_MIGRATE, None
        if "claim" not in event:
            return EVENT_PREP_AT_DEST_CROSS_CELL, event["destination"]["host"]
        if "snapshotted" not in event:
            return EVENT_PREP_AT_SOURCE_CROSS_CELL, _source(event)["host"]
        return EVENT_FINISH_AT_DEST_CROSS_CELL, event["destination"]["host"]
    if "claim" not in event:
        return EVENT_PREP, event["destination"]["host"]
    if "resized" not in event:
        return EVENT_RESIZE, _source(event)["host"]
    return EVENT_FINISH, event["destination"]["host"]


def _restore_allocations(event: Mapping[str, Any], source_node: str | None) -> None:
    """The instance gets back exactly what the migration holds on the source; the destination claim goes.

    When the migration holds nothing to give back (the server held no allocation when the move
    started, or an operator removed the migration's since), the instance's allocations are
    dropped only when they are provably this move's destination claim (see
    :func:`ferry.placement.revert_move_allocations`):

    * the claim the ``destination`` recorded, held at the generation recorded with it;
    * a ``destination`` written before claims were recorded: the instance holds the
      destination's provider and not the source's, as the rollback then checked;
    * for a server that held no allocation when the move started: exactly what a claim of this
      move holds (:func:`_claim_provider`), on the destination or one of its alternates when the
      document names one. That covers a SelectMoveDestinations or RescheduleMove that failed
      after its claim and so did not record it.

    On the source's provider (a move on one host) only the first, at its recorded generation,
    will do: there the allocation an operator gives back can equal a claim. Anything else (an
    allocation an operator gave the server back meanwhile) is left alone.
    """
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    dest = event.get("destination")
    try:
        source_provider = placement.provider_by_node(source_node) if source_node else None
    except errors.ResourceProviderNotFound:
        source_provider = None
    recorded = dest is not None and "claimed" in dest
    unallocated = ((event.get("move") or {}).get("source") or {}).get("allocated") is False
    held = placement.get_allocations(uuid) if unallocated or (dest is not None and not recorded) else {}
    claimed: placement.Allocations | None = None
    generation = None
    if dest is not None and recorded:
        claimed, generation = dest["claimed"], dest.get("claim_generation")
    elif dest is not None and dest["provider_uuid"] in held and source_provider not in held:
        claimed, generation = held, dest.get("claim_generation")
    if unallocated and held and held != claimed and _is_unrecorded_claim(event, held):
        claimed, generation = held, None
    # On the source's provider the server's own allocation given back is a claim's when the two flavors are
    # the same size: there only the generation recorded with the claim tells them apart.
    same_host = bool(dest is not None and dest["same_host"]) or source_provider in (claimed or {})
    placement.revert_move_allocations(migration_uuid, uuid, claimed=claimed, claim_generation=generation,
                                      same_host=same_host)


def _is_unrecorded_claim(event: Mapping[str, Any], held: placement.Allocations) -> bool:
    """Whether ``held`` is exactly what a claim of this move holds, where the move may have claimed."""
    with cell_session(event["cell"]) as session:
        instance, migration = _load(session, event)
        if not instance.new_flavor:
            return False
        facts = _move_facts(session, instance, migration)
    spec = _move_spec(facts, event["cell"], event.get("requested_host"))
    dest = event.get("destination")
    return _claim_provider(held, spec) is not None if dest is None else _is_move_claim(held, dest, spec)


def _close_events(session: Session, event: Mapping[str, Any], failed: str, host: str | None,
                  error: dict[str, Any]) -> None:
    """Finish the failed step's event with the error; earlier steps' events that were left open
    succeeded, except a move between cells' ``conductor_migrate_server``, which spans the whole
    move and fails with it (also when the move's last step had ended it). A later step's event
    still open was begun by an attempt a reschedule gave up (the refused host's prep, when the
    move then failed before the alternate's prep began it again): it ends with the error too."""
    uuid, request_id = event["instance_uuid"], event["request_id"]
    action = session.scalars(select(InstanceAction).where(InstanceAction.instance_uuid == uuid,
                                                          InstanceAction.request_id == request_id)).one_or_none()
    if action is None:
        return
    finished = dict(session.execute(select(InstanceActionEvent.event, InstanceActionEvent.finish_time).where(
        InstanceActionEvent.action_id == action.id)).all())
    open_events = {name for name, at in finished.items() if at is None}
    cross_cell = is_cross_cell(event)
    order = CROSS_CELL_EVENTS if cross_cell else EVENTS
    at = order.index(failed)
    for name in order[:at]:
        if name in open_events and not (cross_cell and name == EVENT_MIGRATE):
            actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=name)
    actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=failed, host=host, error=error)
    for name in order[at + 1:]:
        if name in open_events:
            actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=name, error=error)
    # Ended Error whether open or ended by a CompleteMoveAcrossCells that failed before its switch.
    if cross_cell and failed != EVENT_MIGRATE and EVENT_MIGRATE in finished:
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=EVENT_MIGRATE, error=error)


def _guest_may_run_at_dest(event: Mapping[str, Any]) -> bool:
    """Whether a guest of the server may still run on the destination after the rollback.

    True when cleaning up the destination failed (``cleanup_error``) once the guest there may
    have been made: across cells once ``spawn`` may have been sent (``spawn`` present), within a
    cell once ``finish_resize`` may have been sent (``finish`` present) to another host. On the
    source host itself the restore replaces the guest (a host has one guest per instance). The
    state machine decides the same way (WasSourceTouched, WasSourceSnapshotted) and then restores
    the source guest without powering it on.
    """
    dest = event.get("destination")
    if not event.get("cleanup_error") or not dest:
        return False
    if is_cross_cell(event):
        return "spawn" in event
    return "finish" in event and not dest["same_host"]


def _fault(event: Mapping[str, Any], source_host: str, error: dict[str, Any], *,
           guest_left_at_dest: bool, was_running: bool) -> tuple[str, str | None]:
    """The fault's message and details: what failed, and what is left on which host.

    The message is the owner's to read too: the failure's cause as :func:`owner_cause` words it,
    or a summary; host names and the failure's full text are in the details (admins only).

    ``guest_left_at_dest``: a guest of the server may still run on the destination (the source's
    was restored shut off); ``was_running`` (the server ran before the move) then words what to
    do once that guest is destroyed.
    """
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    dest_host = (event.get("destination") or {}).get("host")
    message = error_message(error)
    notes = []
    cleanup_error, restore_error = event.get("cleanup_error"), event.get("restore_error")
    if event.get("reschedule_error"):
        notes.append(f"Rescheduling to an alternate host failed: {error_message(event['reschedule_error'])}")
    if event.get("target_cleanup_error"):
        notes.append(f"Cleaning up target cell {(event.get('destination') or {}).get('cell')} failed "
                     f"({error_message(event['target_cleanup_error'])}): its copies of the server, the "
                     f"instance mapping or the move's snapshot may remain.")
    if cleanup_error and not guest_left_at_dest:
        notes.append(f"Cleaning up destination host {dest_host} failed ({error_message(cleanup_error)}): the "
                     f"guest, disks or transfer objects of migration {migration_uuid} may remain there.")
    if restore_error:
        where = "the destination host may still hold a guest and disks" if cleanup_error else \
            "the destination host was cleaned up"
        summary = (f"Resize failed and the server could not be restored on its source host: its disks are kept "
                   f"in {uuid}_resize there, no guest is defined there; {where}.")
        notes.insert(0, f"Restoring the guest on source host {source_host} failed "
                        f"({error_message(restore_error)}); its disks are kept in {uuid}_resize on {source_host}. "
                        f"The move failed with: {message}")
        return summary, " ".join(notes)
    if guest_left_at_dest:
        summary = ("Resize failed and the destination host could not be cleaned up: a guest of this server may "
                   "still run there.")
        # A reset to active leaves the guest shut off; the stop records it so, and only a stopped server starts.
        reset = (f"then reset the server's state (openstack server set --state active {uuid}) and record its "
                 f"guest shut off (openstack server stop {uuid})")
        then = (f"{reset}, and start it (openstack server start {uuid})." if was_running else
                f"{reset}; it was stopped before the move.")
        notes.insert(0, f"Cleaning up destination host {dest_host} failed ({error_message(event['cleanup_error'])}): a "
                        f"guest of this server may still run there, with its ports and volumes, and its disks "
                        f"may remain. The guest on source host {source_host} is restored with the old flavor but "
                        f"not powered on, so that the two never run at once. Destroy the guest on {dest_host} "
                        f"first (ferry audit reports it as guest_orphan; virsh destroy {uuid}; virsh undefine "
                        f"{uuid}), {then} The move failed with: {message}")
        return summary, " ".join(notes)
    return owner_cause(error), fault_details(error, " ".join(notes) or None)


def rollback_move(event: dict[str, Any]) -> dict[str, Any]:
    """Rollback tail of a failed move: put the server back exactly as it was before the move.

    Allocations go back to the instance on the source with the old flavor (the destination
    claim and the migration consumer are gone); the destination's port bindings and volume
    attachments are dropped and the source's bindings are active; the instance gets its host,
    node, flavor, vm_state and power state back, task_state None; the migration becomes
    ``error``; the failed step's event records the error and ``instance.resize.error`` is sent,
    after the ``instance.resize_prep.end`` of a prep that started and never ended (see
    :func:`_prep_end`). An instance fault is recorded, except for a move the scheduler found no
    host for. The server goes to ERROR, with a fault saying what is left on which host, only when the source guest
    could not be restored (``restore_error``), or when a guest of the server may still run on the
    destination: its clean-up failed (``cleanup_error``) after ``spawn`` or ``finish_resize`` may
    have been sent to another host. The source guest was then restored shut off, and its power
    state says so; the fault tells the operator to destroy the destination's guest before
    resetting the state, stopping (which records the guest shut off) and, if it ran before the
    move, starting the server. The run that puts the server in ERROR counts ``ServerLeftInError``.
    A server a delete took meanwhile (reset to error while its move ran, then deleted) is put back
    on its source all the same, its task and vm_state left to the delete.
    Idempotent: a migration already in ``error`` means the rollback finished.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], event["cell"]
    dest = event.get("destination")
    error = event.get("error") or {}
    cause = {"Error": error.get("Error", "Error"), "Cause": error_message(error)}
    with cell_session(cell) as session:
        migration = _get_migration(session, migration_uuid)
        if migration is None or migration.status == ERROR:
            return {}
        if migration.status not in _IN_PROGRESS:
            logger.warning("move not rolled back: its migration moved on",
                           extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "status": migration.status})
            return {}
        source_host = cast(str, migration.source_compute)
        source_node = migration.source_node
        gone = session.scalars(select(Instance.id).where(Instance.uuid == uuid,
                                                          Instance.deleted.is_(False))).first() is None
    if gone:
        # Deleted meanwhile: its delete released the instance's allocations, unless this move's
        # claim landed after it (a server reset and deleted while the scheduler ran); the
        # migration's go too. Released with no cell transaction open (SQLite's writers take
        # their files one at a time, and a step holding the API database may wait for this
        # cell); the migration is put in error after, so a run again releases them too.
        placement.delete_allocations(uuid)
        placement.delete_allocations(migration_uuid)
        with cell_session(cell) as session:
            migration = _get_migration(session, migration_uuid)
            if migration is not None and migration.status in _IN_PROGRESS:
                _update_migration(session, migration_uuid, {"status": ERROR}, _IN_PROGRESS)
                # Its action still shows how the move ended (to admins reading deleted servers).
                _close_events(session, event, *_failed_step(event), cause)
        return {}
    _restore_allocations(event, source_node)
    if dest is not None:
        _release_destination(uuid, dest["host"], source_host)
    failed, failed_host = _failed_step(event)
    restore_failed = bool(event.get("restore_error"))
    # The source guest was restored shut off (WasSourceTouched, WasSourceSnapshotted): starting it is left to an
    # operator who has destroyed the destination's.
    guest_left_at_dest = not restore_failed and _guest_may_run_at_dest(event)
    scheduling_failed = failed == EVENT_MIGRATE and error.get("Error") == errors.NoValidHost.__name__
    restored = event.get("restored") or {}
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        vm_state = instance.old_vm_state if instance.old_vm_state in (states.ACTIVE, states.STOPPED) \
            else instance.vm_state
        was_running = instance.old_vm_state != states.STOPPED
        source = (event.get("move") or {}).get("source") or {}  # absent when validation itself failed
        power_state = int(restored.get("power_state", source.get("power_state", instance.power_state)))
        if restore_failed:
            vm_state, power_state = states.ERROR, states.NOSTATE
        elif guest_left_at_dest:
            vm_state, power_state = states.ERROR, int(restored.get("power_state", states.SHUTDOWN))
        migration = cast(Migration, _get_migration(session, migration_uuid))
        prep_end = _prep_end(instance, migration)
        restored_values: dict[str, Any] = {
            "host": source_host, "node": source_node, "flavor": instance.old_flavor or instance.flavor,
            "power_state": power_state, "old_flavor": None, "new_flavor": None, "old_vm_state": None}
        if instance.task_state == states.DELETING:
            # A delete took the server meanwhile (reset to error while its move ran, then
            # deleted): it is put back on its source as any rolled-back server, but its task and
            # vm_state stay the delete's, which ends in ERROR should it fail.
            logger.warning("move rolled back under a delete that took the server meanwhile",
                           extra={"instance_uuid": uuid, "migration_uuid": migration_uuid})
            instances.update_cas(session, uuid, restored_values, expected_task_state=(states.DELETING,))
        else:
            instances.update_cas(session, uuid, {**restored_values, "vm_state": vm_state, "task_state": None})
        _update_migration(session, migration_uuid, {"status": ERROR}, _IN_PROGRESS)
        _close_events(session, event, failed, failed_host, cause)
        fault_message, details = _fault(event, source_host, error, guest_left_at_dest=guest_left_at_dest,
                                        was_running=was_running)
        if not scheduling_failed or restore_failed or event.get("cleanup_error"):
            instances.add_fault(session, uuid, fault_message, host=failed_host or source_host, details=details)
        instance = instances.get(session, uuid)
        publisher = (notifications.conductor_publisher() if failed_host is None
                     else notifications.compute_publisher(failed_host))
        pending = _notify(notifications.RESIZE_ERROR, instance, publisher, migration_uuid=migration_uuid,
                          fault={"message": fault_message, "error": cause["Error"], "details": details})
    if restore_failed or guest_left_at_dest:
        metrics.add_metric(name="ServerLeftInError", unit=MetricUnit.Count, value=1)
    _publish(*(item for item in (prep_end, pending) if item is not None))
    logger.warning("move rolled back", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                              "failed_event": failed, "error": cause["Error"],
                                              "vm_state": vm_state, "guest_may_run_at_dest": guest_left_at_dest})
    return {}

