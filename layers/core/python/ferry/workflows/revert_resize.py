"""Steps of the revert workflow (``statemachine/revert_resize.asl.json``).

CheckResizeToRevert → RevertAtDest (host agent: the destination forgets the new guest and
disks) → RevertResourcesToSource (the migration's allocation goes back to the instance in place
of its destination allocation, ports and volumes go back to the source, the instance record
points at the source with its old flavor) → FinishRevertAtSource (host agent: the old guest is
restored from ``<uuid>_resize``, powered on if it was running) → FinishRevert (vm_state as
before the resize, migration ``reverted``).

Failures:

* the first step refuses input that does not match ``revert_resize.input.schema.json``, or
  records that are not those of a revert under way, and changes nothing;
* any other failure of the first step, or of the destination's clean-up within a cell
  (RestoreVerifyResize in :mod:`ferry.workflows.confirm_resize`): the server stays in
  VERIFY_RESIZE on the destination, the migration goes back to ``finished`` and the revert can
  be asked again;
* a failure once the destination is cleaned up, and between cells any failure after the flip to
  the source cell, the destination's destroy included (FailRevert): the server goes to ERROR, the
  migration to ``error``, and the fault says whether the destination still has the guest and
  where the disks and the allocations are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from sqlalchemy import select
from sqlalchemy.orm import Session

from ferry import errors, hosts, images, network, notifications, placement, volumes
from ferry.compute import actions, instances, migration_states, states
from ferry.observability import logger, metrics
from ferry.store.api_models import Volume, VolumeAttachment
from ferry.store.cell_models import BlockDeviceMapping, Instance, Migration
from ferry.store.db import api_session, cell_session
from ferry.workflows import cross_cell_settle, error_message, fault_details, owner_cause
from ferry.workflows.confirm_resize import (
    EVENT_REVERT,
    describe_allocations,
    host_ref,
    live_instance,
    migration_of,
    settle_identity,
    validate_input,
)

EVENT_FINISH_REVERT = "compute_finish_revert_resize"

INPUT_SCHEMA: dict[str, Any] = json.loads(
    Path(__file__).with_name("revert_resize.input.schema.json").read_text())

_FLAVOR_KEYS = ("flavorid", "name", "vcpus", "memory_mb", "root_gb", "ephemeral_gb", "swap")


def check_resize_to_revert(event: dict[str, Any]) -> dict[str, Any]:
    """Check that the records are those of a revert under way and name the hosts.

    Wants a migration in ``reverting`` of a server in vm_state ``resized``, task
    ``resize_reverting``, on the migration's destination, with its old flavor recorded; both
    hosts must be up (a revert that cannot reach the source would leave the server nowhere).
    Records the start of ``compute_revert_resize`` and sends ``instance.resize_revert.start``.

    Returns:
        ``{"source": {host, node, queue_url}, "dest": {host, node, queue_url}, "same_host": bool,
        "transfer": {bucket, prefix}, "claimed": {rp_uuid: {rc: n}}, "claim_generation": int |
        None}``: the last two are the instance's destination allocation and its consumer's
        generation, read together, when that allocation is exactly the move's claim (the new
        flavor on the destination node's provider); ``{}`` and None otherwise (it holds nothing, or
        an allocation an operator set). They tell :func:`revert_resources_to_source` whether that
        allocation is still to be dropped.

    Raises:
        InvalidWorkflowInput, MigrationNotFound, InstanceNotFound, UnexpectedMigrationState: refused,
            nothing changed.
        ComputeServiceUnavailable: a host is down (the revert can be asked again later).
    """
    validate_input(event, INPUT_SCHEMA)
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    with cell_session(event["cell"]) as session:
        # The API undoing a revert whose start answered an error takes this lock too: either it
        # sees this step's event and lets the revert stand, or this step sees it undone (its
        # action forgotten: a newer request may have taken the migration since).
        actions.lock_server(session, uuid)
        migration = migration_of(session, uuid, migration_uuid)
        instance = live_instance(session, uuid)
        if instance is None:
            raise errors.InstanceNotFound(f"Instance {uuid} could not be found.")
        if not (migration.status == migration_states.REVERTING and instance.vm_state == states.RESIZED
                and instance.task_state == states.RESIZE_REVERTING and instance.host == migration.dest_compute
                and instance.old_flavor):
            raise errors.UnexpectedMigrationState(
                f"Migration {migration_uuid} is {migration.status} and instance {uuid} is in vm_state "
                f"{instance.vm_state} task_state {instance.task_state} on {instance.host}: not a revert under way.")
        if actions.find(session, uuid, event["request_id"]) is None:
            # A revert the API undid; the migration is another request's now.
            raise errors.UnexpectedMigrationState(
                f"Request {event['request_id']} of instance {uuid} is not the revert under way (it was undone); "
                f"nothing was done.")
        source, dest = str(migration.source_compute), str(migration.dest_compute)
        cells = cross_cell_settle.cells_of(migration, event["cell"])
        for host in {source, dest}:
            if not hosts.host_is_up_from(session, event["cell"], host, here=not cells):
                # The owner reads this in the fault: the host is named in its details and the log.
                logger.info("revert refused: a host of the move is down", extra={"instance_uuid": uuid, "host": host})
                raise errors.ComputeServiceUnavailable(
                    f"The {'source' if host == source else 'destination'} host of migration {migration_uuid} is down.")
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"],
                            event=cross_cell_settle.EVENT_REVERT if cells else EVENT_REVERT,
                            host=None if cells else dest)
        payload = notifications.instance_payload(instance, migration_uuid=migration_uuid)
        generation, claimed = placement.consumer_allocations(uuid)
        if claimed != _destination_claim(session, instance, migration):
            # Not this move's claim (an operator set the server's allocation meanwhile): the revert keeps it.
            generation, claimed = None, {}
        move = {"source": host_ref(source, migration.source_node), "dest": host_ref(dest, migration.dest_node),
                "same_host": source == dest, "transfer": images.transfer_location(migration_uuid),
                "claimed": claimed, "claim_generation": generation}
        if cells:
            move["cross_cell"] = cells
    publisher = notifications.conductor_publisher() if cells else notifications.compute_publisher(dest)
    notifications.notify(notifications.RESIZE_REVERT_START, instance_uuid=uuid, publisher_id=publisher,
                         payload=payload, identity=settle_identity(event))
    return move


def _destination_claim(session: Session, instance: Instance, migration: Migration) -> placement.Allocations | None:
    """What the move's destination claim holds: the new flavor on the destination node's provider (None: unknown)."""
    if not instance.new_flavor or not migration.dest_node:
        return None
    try:
        rp_uuid = placement.provider_by_node(migration.dest_node)
    except errors.ResourceProviderNotFound:
        return None
    return {rp_uuid: placement.resources_from_flavor(instance.new_flavor, instances.is_bfv(session, instance.uuid))}


def _revert_events(cells: dict[str, str] | None) -> tuple[str, str]:
    """The events of the destination's and the source's part of a revert (Nova's names for each kind of move)."""
    if cells:
        return cross_cell_settle.EVENT_REVERT_AT_DEST, cross_cell_settle.EVENT_FINISH_REVERT_AT_SOURCE
    return EVENT_REVERT, EVENT_FINISH_REVERT


def revert_resources_to_source(event: dict[str, Any]) -> dict[str, Any]:
    """Move allocations, ports, volumes and the instance record back to the source (idempotent).

    * placement: the migration's allocation (the old flavor on the source) becomes the
      instance's, replacing its destination allocation, in one transaction; a migration that
      holds none (the server held no allocation, an operator removed it) gives nothing back,
      and the destination allocation goes all the same when it is unchanged since
      CheckResizeToRevert read it as the move's claim (the same allocations at the same consumer
      generation), so the server ends with none; an allocation that was not the claim then, or
      was written since (an operator giving the server its allocation back), is kept. A document
      from before CheckResizeToRevert recorded the allocation (``claimed``) keeps it too;
    * ports: the source's binding is active again and, unless the move stayed on one host, the
      destination's goes;
    * volumes: the destination's attachments go, and every volume of the server (including
      one attached while it was resized) has a completed attachment on the source;
    * instance: host and node of the source, flavor = the old flavor (its own copy, so a
      deleted flavor does not matter); the task stays ``resize_reverting``.

    After a cross-cell move the records are those of the source cell (FlipToSourceCell made its
    copy the server again) and the target cell's hidden copy is hard-deleted first.

    Returns:
        ``{"finish_args": …}``, the arguments of ``finish_revert_resize`` at the source.
    """
    uuid, migration_uuid, cell = event["instance_uuid"], event["migration_uuid"], cross_cell_settle.revert_cell(event)
    move = event["move"]
    source, dest, same_host = move["source"]["host"], move["dest"]["host"], move["same_host"]
    cells = cross_cell_settle.cross_cell(event)
    if cells:
        cross_cell_settle.hard_delete_copy(cells["target_cell"], uuid, migration_uuid)
    reverted_event, finish_event = _revert_events(cells)
    with cell_session(cell) as session:
        bdms = list(session.scalars(select(BlockDeviceMapping).where(
            BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.deleted.is_(False),
            BlockDeviceMapping.destination_type == "volume", BlockDeviceMapping.volume_id.is_not(None))))
        boot_index = {b.volume_id: b.boot_index for b in bdms}
        device_of = {b.volume_id: b.device_name for b in bdms}
    placement.revert_move_allocations(migration_uuid, uuid, claimed=move.get("claimed"),
                                      claim_generation=move.get("claim_generation"), same_host=same_host)
    with api_session() as session:
        network.activate(session, uuid, source)
        if not same_host:
            network.unbind(session, uuid, dest)
            volumes.detach_from(session, uuid, dest)
        present = {a.volume_id for a in volumes.attachments(session, uuid, source)}
        # A mapping may outlive its detach (one whose cell part never committed): a volume another
        # server holds now is left to it, not given to two guests. The volumes' rows are locked
        # first, as an attach swaps a volume's status: the two wait for each other.
        session.execute(select(Volume.id).where(Volume.id.in_(sorted(device_of))).order_by(Volume.id)
                        .with_for_update())
        elsewhere = set(session.scalars(select(VolumeAttachment.volume_id).where(
            VolumeAttachment.volume_id.in_(device_of), VolumeAttachment.instance_uuid != uuid)))
        if elsewhere:
            logger.warning("volumes another server holds are not attached back", extra={
                "instance_uuid": uuid, "migration_uuid": migration_uuid, "volume_ids": sorted(elsewhere)})
        for volume_id, device in device_of.items():
            if volume_id not in present and volume_id not in elsewhere:
                session.add(VolumeAttachment(volume_id=volume_id, instance_uuid=uuid, host=source, device=device,
                                             status=volumes.RESERVED))
        session.flush()
        volumes.complete_on(session, uuid, source)
        ports = [{"id": p.id, "mac_address": p.mac_address} for p in network.guest_ports(session, uuid)]
        attached = [{"volume_id": v.id, "path": v.path, "device": a.device or device_of.get(v.id) or "",
                     "boot_index": boot_index.get(v.id)} for v, a in volumes.attached_volumes(session, uuid, source)]
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        old_flavor = dict(instance.old_flavor or {})
        if instance.host != source or instance.flavor != old_flavor:
            instances.update_cas(session, uuid, {"host": source, "node": move["source"]["node"],
                                                 "flavor": old_flavor},
                                 expected_task_state=(states.RESIZE_REVERTING,))
            instance = instances.get(session, uuid)
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=reverted_event,
                             host=dest)
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"],
                            event=finish_event, host=source)
        power_on = (instance.old_vm_state or states.ACTIVE) != states.STOPPED
        finish_args = {"migration_uuid": migration_uuid, "name": instance.display_name,
                       "flavor": {k: old_flavor[k] for k in _FLAVOR_KEYS}, "ports": ports, "volumes": attached,
                       "power_on": power_on}
    return {"finish_args": finish_args}


def finish_revert(event: dict[str, Any]) -> dict[str, Any]:
    """The server is back as it was: vm_state from before the resize, the power state the source
    reported, no task, no move flavors; migration ``reverted`` (idempotent)."""
    uuid, migration_uuid = event["instance_uuid"], event["migration_uuid"]
    source = event["move"]["source"]["host"]
    cells = cross_cell_settle.cross_cell(event)
    with cell_session(cross_cell_settle.revert_cell(event)) as session:
        migration = migration_of(session, uuid, migration_uuid)
        if migration.status == migration_states.REVERTED:
            return {}
        instance = instances.get(session, uuid)
        vm_state = instance.old_vm_state or states.ACTIVE
        default_power = states.SHUTDOWN if vm_state == states.STOPPED else states.RUNNING
        power_state = int((event.get("restored") or {}).get("power_state", default_power))
        instances.update_cas(session, uuid, {"vm_state": vm_state, "task_state": None, "power_state": power_state,
                                             "old_flavor": None, "new_flavor": None, "old_vm_state": None},
                             expected_task_state=(states.RESIZE_REVERTING,))
        migration = migration_of(session, uuid, migration_uuid)
        migration.status = migration_states.REVERTED
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"],
                             event=_revert_events(cells)[1], host=source)
        if cells:
            actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"],
                                 event=cross_cell_settle.EVENT_REVERT)
        payload = notifications.instance_payload(instances.get(session, uuid), migration_uuid=migration_uuid)
    logger.info("resize reverted", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                          "cross_cell": bool(cells)})
    publisher = notifications.conductor_publisher() if cells else notifications.compute_publisher(source)
    notifications.notify(notifications.RESIZE_REVERT_END, instance_uuid=uuid, publisher_id=publisher,
                         payload=payload, identity=settle_identity(event))
    return {}


def fail_revert(event: dict[str, Any]) -> dict[str, Any]:
    """Rollback tail of a revert that failed once the destination may have been cleaned up.

    No host may run the server any more (the destination's step failed in a way that does not
    say the guest is still there, or came through), so it goes to ERROR (task cleared) and the migration to
    ``error``; the fault says which step failed, what the destination and the source hold, where
    the instance record points and which allocations the instance and the migration hold. The
    run that puts the server in ERROR counts ``ServerLeftInError`` (a run again finds the
    migration in ``error`` and does nothing).
    """
    uuid, migration_uuid, request_id = event["instance_uuid"], event["migration_uuid"], event["request_id"]
    error = event.get("error") or {}
    cause = error_message(error)
    cells = cross_cell_settle.cross_cell(event)
    where = cross_cell_settle.where_things_are(uuid, cells) + " " if cells else ""
    reverted_event, finish_event = _revert_events(cells)
    with cell_session(cross_cell_settle.revert_cell(event)) as session:
        migration = migration_of(session, uuid, migration_uuid)
        if migration.status != migration_states.REVERTING:
            return {}
        source, dest = migration.source_compute, migration.dest_compute
        on_dest = f"The new guest and its disks on {dest} were removed."
        if "restored" in event:
            step, on_source = "recording the result", f"The old guest was restored on {source}."
            event_name = finish_event
        elif "restore" in event:
            step, on_source = ("restoring the old guest on the source host",
                               f"The old disks are in {uuid}_resize on {source}, or already back in its "
                               f"instance directory.")
            event_name = finish_event
        elif "reverted_at_dest" not in event:
            # The destination's step failed (DestroyAtDest; RevertAtDest past a HypervisorError, a
            # timeout above all): it may have destroyed the guest before it failed.
            step, on_source = ("removing the new guest and its disks on the destination host",
                               f"The old disks are in {uuid}_resize on {source}.")
            on_dest, event_name = f"The new guest and its disks may still be on {dest}, or gone.", reverted_event
        else:
            step, on_source = ("moving allocations, ports and volumes back to the source host",
                               f"The old disks are in {uuid}_resize on {source}.")
            event_name = reverted_event
        instance = live_instance(session, uuid)
        details = (f"{on_dest} {on_source} {where}"
                   f"The instance record points at {instance.host if instance else 'nothing'}. "
                   f"Allocations: instance {describe_allocations(uuid)}; migration {migration_uuid} "
                   f"{describe_allocations(migration_uuid)}.")
        message = f"Reverting the resize failed while {step}: {owner_cause(error)}"
        left_in_error = False
        if instance is not None:
            try:
                instances.update_cas(session, uuid, {"vm_state": states.ERROR, "task_state": None},
                                     expected_task_state=(states.RESIZE_REVERTING,))
                left_in_error = True
            except errors.UnexpectedTaskState:
                logger.warning("task changed meanwhile; vm_state left as is", extra={"instance_uuid": uuid})
            instances.add_fault(session, uuid, message, host=instance.host, details=fault_details(error, details))
        migration = migration_of(session, uuid, migration_uuid)
        migration.status = migration_states.ERROR
        failure = error or {"Error": errors.RevertResizeFailed.__name__, "Cause": message}
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=event_name,
                             host=source if event_name == finish_event else dest, error=failure)
        if cells:
            actions.finish_event(session, instance_uuid=uuid, request_id=request_id,
                                 event=cross_cell_settle.EVENT_REVERT, error=failure)
    if left_in_error:
        metrics.add_metric(name="ServerLeftInError", unit=MetricUnit.Count, value=1)
    logger.error("revert failed", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid, "cause": cause,
                                         "details": details})
    return {}
