"""Steps of the boot workflow (``statemachine/boot.asl.json``).

SelectDestinations → BindResourcesAtDest → SpawnOnHost (host agent) → FinishBuild.
A failure after the claim runs DestroyAtDest (host agent) → UnbindResourcesAtDest →
RescheduleBuild while alternates remain, else FailBuild. A FinishBuild that failed goes
through CheckBuildCommitted first: a build that committed stands. Every step takes the
workflow's state document and is safe to run twice.

A server may be deleted while it is built (the API accepts a delete in task ``scheduling`` or
``spawning``): the steps then claim nothing more, and FailBuild only releases the claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import OperationalError

from ferry import errors, hosts, images, network, placement, scheduler, volumes
from ferry.compute import actions, instances, states
from ferry.observability import logger
from ferry.store.api_models import (
    BuildRequest,
    CellMapping,
    InstanceMapping,
    Port,
    PortBinding,
    RequestSpec,
    ResourceProvider,
    Volume,
    VolumeAttachment,
    utcnow,
)
from ferry.store.cell_models import BlockDeviceMapping, Instance, InstanceFault, Tag
from ferry.store.db import CELL0_NAME, all_cells, api_session, cell_session
from ferry.workflows import error_message, fault_details, owner_cause

EVENT_SCHEDULE = "conductor_schedule_and_build_instances"
EVENT_BUILD = "compute__do_build_and_run_instance"

_INSTANCE_FIELDS = {c.key for c in Instance.__table__.columns} - {"id", "deleted", "deleted_at"}
_INSTANCE_FIELDS |= {"metadata_items"}
_BDM_FIELDS = {c.key for c in BlockDeviceMapping.__table__.columns} - {"id", "deleted"}


def _destination(selection: scheduler.Selection, alternates: list[scheduler.Selection]) -> dict[str, Any]:
    return {
        "host": selection.host,
        "node": selection.node,
        "cell": selection.cell,
        "queue_url": hosts.queue_url(selection.host),
        "alternates": [alt.to_dict() for alt in alternates],
    }


def _existing_claim(instance_uuid: str) -> scheduler.Selection | None:
    """The selection an earlier run of this step already claimed (a retried invocation)."""
    claimed = placement.get_allocations(instance_uuid)
    if not claimed:
        return None
    rp_uuid, resources = next(iter(claimed.items()))
    with api_session() as session:
        provider = session.scalars(select(ResourceProvider).where(ResourceProvider.uuid == rp_uuid)).one()
        cell = session.scalars(select(CellMapping.name).where(CellMapping.id == provider.cell_id)).one()
        return scheduler.Selection(host=provider.host, node=provider.name, cell=cell, provider_uuid=rp_uuid,
                                   allocations={rp_uuid: resources})


def select_destinations(event: dict[str, Any]) -> dict[str, Any]:
    """Schedule the new server, claim the host, and create the instance in that host's cell.

    Returns the destination ``{host, node, cell, queue_url, alternates}``, or
    ``{"abandoned": true}`` when the server was deleted before it was scheduled.

    Raises:
        NoValidHost: no host passes the filters with room for the flavor.
    """
    uuid = event["instance_uuid"]
    with api_session() as session:
        build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == uuid)).one_or_none()
        spec_row = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == uuid)).one_or_none()
    chosen = _existing_claim(uuid)
    alternates: list[scheduler.Selection] = []
    if chosen is None:
        if build is None or spec_row is None:
            logger.info("server deleted before it was scheduled", extra={"instance_uuid": uuid})
            return {"abandoned": True}
        selections = scheduler.select_destinations(spec_row.spec)
        chosen, alternates = selections[0], selections[1:]
    elif build is None and _mapped_cell(uuid)[1]:
        # An earlier run claimed and failed before the hand-over; the owner deleted the server since.
        logger.info("server deleted after its host was claimed; claim released", extra={"instance_uuid": uuid})
        _remove_unmapped_copy(uuid, chosen.cell)
        placement.delete_allocations(uuid)
        return {"abandoned": True}
    else:
        # An earlier run claimed (its answer lost): its alternates are listed again.
        alternates = scheduler.alternates_for(spec_row.spec, chosen) if spec_row is not None else []
    if build is not None and not _materialize(build, chosen, event["request_id"]):
        placement.delete_allocations(uuid)
        return {"abandoned": True}
    return _destination(chosen, alternates)


def _materialize(build: BuildRequest, selection: scheduler.Selection, request_id: str) -> bool:
    """Create the instance in the selection's cell from its build request; point the mapping there.

    Returns False when the API deleted the build request meanwhile (the server was deleted):
    the cell copy is removed again and nothing is left behind. So it is when the hand-over
    fails (a retry of the step copies it again).
    """
    uuid = build.instance_uuid
    _create_in_cell(build, selection.cell, request_id, host=selection.host, node=selection.node,
                    vm_state=states.BUILDING, task_state=states.SCHEDULING)
    try:
        handed_over = _hand_over(uuid, selection.cell)
    except errors.BuildRequestChanged:
        _remove_unmapped_copy(uuid, selection.cell)
        raise
    return handed_over or not _remove_unmapped_copy(uuid, selection.cell)


def _mapped_cell(uuid: str) -> tuple[str | None, bool]:
    """``(cell, deleted)``: the cell the server's instance mapping names (None: it is gone,
    dropped with its build request, or names no cell once the build request is gone, the API
    having deleted the server before it was handed over), and whether the mapping says the server
    was deleted (any of those, or queued for delete)."""
    with api_session() as session:
        mapping = session.scalars(select(InstanceMapping).where(InstanceMapping.instance_uuid == uuid)).one_or_none()
        cell = mapping.cell.name if mapping is not None and mapping.cell is not None else None
        return cell, cell is None or bool(mapping is not None and mapping.queued_for_delete)


def _remove_unmapped_copy(uuid: str, cell: str) -> bool:
    """Delete the server's copy in ``cell`` unless its mapping names that cell (an earlier run of
    the step handed it over); False when it does (nothing is deleted then)."""
    with api_session() as session:
        cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == cell)).one()
        mapping = session.scalars(select(InstanceMapping).where(InstanceMapping.instance_uuid == uuid)).one_or_none()
        if mapping is not None and mapping.cell_id == cell_id:
            return False
    with cell_session(cell) as session:
        if instances.purge(session, uuid):
            logger.info("copy never handed over removed", extra={"instance_uuid": uuid, "cell": cell})
    return True


class _BuildRequestChanged(Exception):
    """The build request changed while it was handed over (the hand-over is rolled back)."""


def _hand_over(uuid: str, cell: str) -> bool:
    """Point the server's mapping at ``cell``, where its instance was copied from the build
    request, and delete the build request; False when the build request is gone (the server was
    deleted, or an earlier run of the step handed it over).

    What the owner may change on a build request (a rename, ``PUT /servers/{id}``) may have
    changed since the copy. So the copy is given the build request's current values first, and
    the build request is deleted only if it still holds them (the delete waits for a change
    under way and returns the row as that left it); otherwise nothing is committed and this is
    tried again. A change the API accepted is never lost, and a retry of the step finds the
    copy complete.

    Raises:
        BuildRequestChanged: the build request kept changing (the step is retried).
    """
    for _attempt in range(3):
        with api_session() as session:
            build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == uuid)).one_or_none()
            if build is None:
                return False
            wanted = _updatable(build.instance)
        with cell_session(cell) as session:
            session.execute(update(Instance).where(Instance.uuid == uuid).values(**wanted)
                            .execution_options(synchronize_session=False))
        try:
            with api_session() as session:
                stmt = delete(BuildRequest).where(BuildRequest.instance_uuid == uuid).returning(BuildRequest.instance)
                deleted = session.scalars(stmt).first()
                if deleted is None:
                    return False
                if _updatable(deleted) != wanted:
                    raise _BuildRequestChanged
                cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == cell)).one()
                session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == uuid)
                                .values(cell_id=cell_id))
            return True
        except _BuildRequestChanged:
            logger.info("build request changed during its hand-over; trying again", extra={"instance_uuid": uuid})
    raise errors.BuildRequestChanged(f"The build request of server {uuid} kept changing while it was handed over.")


def _updatable(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of an instance (or a build request's) its owner may change."""
    return {column: fields.get(column) for column in instances.UPDATABLE.values()}


def _create_in_cell(build: BuildRequest, cell: str, request_id: str, **values: Any) -> None:
    """Create the server's instance in ``cell`` from its build request (unless a run before did).

    The instance was created when the server was, as Nova's keeps its build request's
    ``created_at``: the server's ``created`` does not move when it is scheduled, and a listing
    paged by it (the default sort) skips no server scheduled between two pages.
    """
    uuid = build.instance_uuid
    fields = {k: v for k, v in build.instance.items() if k in _INSTANCE_FIELDS}
    if "metadata" in build.instance:
        fields["metadata_items"] = build.instance["metadata"]
    fields.update(values, uuid=uuid, created_at=build.created_at)
    with cell_session(cell) as session:
        if session.scalars(select(Instance.id).where(Instance.uuid == uuid)).one_or_none() is None:
            session.add(Instance(**fields))
            for bdm in build.block_device_mappings or []:
                session.add(BlockDeviceMapping(instance_uuid=uuid, **{k: v for k, v in bdm.items()
                                                                       if k in _BDM_FIELDS}))
            for tag in build.tags or []:
                session.add(Tag(instance_uuid=uuid, tag=tag))
        actions.start_action(session, instance_uuid=uuid, action=actions.CREATE, request_id=request_id,
                             user_id=fields.get("user_id"), project_id=fields.get("project_id"))
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=EVENT_SCHEDULE)


def bind_resources_at_dest(event: dict[str, Any]) -> dict[str, Any]:
    """Bind the server's ports and volumes to the destination host; build the guest spec for the agent."""
    uuid, dest = event["instance_uuid"], event["destination"]
    host = dest["host"]
    with cell_session(dest["cell"]) as session:
        instances.update_cas(session, uuid, {"task_state": states.SPAWNING, "host": host, "node": dest["node"]},
                             expected_task_state=(states.SCHEDULING, states.SPAWNING))
        instance = instances.get(session, uuid)
        actions.start_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_BUILD,
                            host=host)
        bdms = list(session.scalars(select(BlockDeviceMapping).where(
            BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.deleted.is_(False),
            BlockDeviceMapping.destination_type == "volume").order_by(BlockDeviceMapping.boot_index)))
        name, flavor, image_ref = instance.display_name, instance.flavor, instance.image_ref
    is_bfv = any(b.boot_index == 0 for b in bdms)
    with api_session() as session:
        # Under the mapping's row lock: a delete that finished since the task was swapped (its host
        # down, so at once) released the ports and volumes and queued the mapping in one
        # transaction; binding them again would leave them held by a deleted server.
        # (The column alone: the mapping's cell is eagerly joined, and PostgreSQL locks no outer join.)
        queued = session.scalars(select(InstanceMapping.queued_for_delete)
                                 .where(InstanceMapping.instance_uuid == uuid).with_for_update()).one_or_none()
        if queued is None or queued:
            raise errors.UnexpectedTaskState(f"Instance {uuid} was deleted while it was being built.")
        ports = network.guest_ports(session, uuid)
        for port in ports:
            if not any(b.host == host for b in port.bindings):
                port.bindings.append(PortBinding(host=host, status="ACTIVE", vif_details={"type": "ethernet"}))
        volume_args = _attach_volumes(session, uuid, host, bdms)
        port_args = [{"id": p.id, "mac_address": p.mac_address, "network_id": p.network_id,
                      "fixed_ip": p.fixed_ip} for p in ports]
    _record_devices(dest["cell"], uuid, volume_args)
    image = None if is_bfv or not image_ref else images.image_location(image_ref)
    return {"spawn_args": {"name": name, "flavor": _flavor_args(flavor), "image": image, "ports": port_args,
                           "volumes": volume_args, "power_on": True}}


def _flavor_args(flavor: dict[str, Any]) -> dict[str, Any]:
    keys = ("flavorid", "name", "vcpus", "memory_mb", "root_gb", "ephemeral_gb", "swap")
    return {k: flavor[k] for k in keys}


# The sources of a volume the build creates (Nova's blank and image block devices): the host makes
# its file. Any other volume exists already; the host is never asked to make it anew.
_CREATED_BY_BUILD = ("blank", "image")


def _attach_volumes(session: Any, uuid: str, host: str, bdms: list[BlockDeviceMapping]) -> list[dict[str, Any]]:
    """Attach the server's volumes to ``host`` in the records; the spawn's ``volumes``.

    Each names its ``source_type``; only a volume the build creates carries its ``size_gb`` (and
    its ``source_image``), which asks the host to make its file when it is missing.
    """
    result = []
    for index, bdm in enumerate(bdms):
        volume = session.get(Volume, bdm.volume_id)
        if volume is None:
            raise errors.SpawnFailed(f"Volume {bdm.volume_id} of instance {uuid} does not exist.")
        attachment = next((a for a in volume.attachments if a.instance_uuid == uuid), None)
        device = bdm.device_name or f"vd{chr(ord('a') + index)}"
        if attachment is None:
            attachment = VolumeAttachment(volume_id=volume.id, instance_uuid=uuid)
            volume.attachments.append(attachment)
        attachment.host, attachment.device, attachment.status = host, device, "attached"
        volume.status = volumes.IN_USE
        entry = {"volume_id": volume.id, "path": volume.path, "device": device, "boot_index": bdm.boot_index,
                 "source_type": bdm.source_type}
        if bdm.source_type in _CREATED_BY_BUILD:
            entry["size_gb"] = volume.size_gb
        if bdm.boot_index == 0 and bdm.source_type == "image" and bdm.image_id:
            entry["source_image"] = images.image_location(bdm.image_id)
        result.append(entry)
    return result


def _record_devices(cell: str, uuid: str, volume_args: list[dict[str, Any]]) -> None:
    """Write the device each volume was given where its mapping named none, so that the server's
    volume attachments show it (``/dev/vda`` for the root volume, as Nova's do)."""
    with cell_session(cell) as session:
        for entry in volume_args:
            session.execute(update(BlockDeviceMapping).where(
                BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.volume_id == entry["volume_id"],
                BlockDeviceMapping.deleted.is_(False), BlockDeviceMapping.device_name.is_(None))
                .values(device_name=entry["device"]).execution_options(synchronize_session=False))


def unbind_resources_at_dest(event: dict[str, Any]) -> dict[str, Any]:
    """Rollback of BindResourcesAtDest (and of FinishBuild's ports): drop the destination's port
    bindings and volume attachments; the ports, bound nowhere now, are DOWN."""
    uuid, host = event["instance_uuid"], event["destination"]["host"]
    with api_session() as session:
        port_ids = select(Port.id).where(Port.device_id == uuid)
        session.execute(delete(PortBinding).where(PortBinding.port_id.in_(port_ids), PortBinding.host == host))
        session.execute(update(Port).where(Port.device_id == uuid).values(status="DOWN"))
        for attachment in session.scalars(select(VolumeAttachment).where(
                VolumeAttachment.instance_uuid == uuid, VolumeAttachment.host == host)):
            attachment.host, attachment.status = None, volumes.RESERVED
    return {}


def reschedule_build(event: dict[str, Any]) -> dict[str, Any]:
    """Move the claim to the next alternate host that takes it after a failed spawn (Nova's build
    reschedule): an alternate that no longer fits (filled meanwhile, disabled, down) is skipped.

    The server is taken off the failed host (task ``scheduling``) before an alternate is
    claimed, so a server deleted meanwhile claims nothing. Run again, it claims again (the claim
    replaces the server's own).

    Raises:
        NoValidHost: no alternate is left, or none of them takes the claim (the workflow then
            fails the build).
        UnexpectedTaskState: the server is no longer being built (it is being deleted).
    """
    uuid, dest = event["instance_uuid"], event["destination"]
    # Alternates of a build stay in the cell the build started in (its instance lives there).
    alternates = [alternate for alternate in map(scheduler.Selection.from_dict, dest.get("alternates", []))
                  if alternate.cell == dest["cell"]]
    if not alternates:
        raise errors.NoValidHost("No alternate host is left to reschedule to.")
    with cell_session(dest["cell"]) as session:
        instances.update_cas(session, uuid, {"host": None, "node": None, "task_state": states.SCHEDULING},
                             expected_task_state=(states.SPAWNING, states.SCHEDULING))
    with api_session() as session:
        spec = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == uuid)).one().spec
    spec = {**spec, "ignore_hosts": sorted(set(spec.get("ignore_hosts") or []) | {dest["host"]})}
    reasons = []
    for index, alternate in enumerate(alternates):
        try:
            chosen = scheduler.claim_alternate(spec, alternate)
        except errors.NoValidHost as exc:
            reasons.append(exc.message)
            continue
        logger.info("build rescheduled", extra={"instance_uuid": uuid, "from": dest["host"], "to": chosen.host})
        return _destination(chosen, alternates[index + 1:])
    raise errors.NoValidHost("No alternate host could take the build. " + " ".join(reasons))


def finish_build(event: dict[str, Any]) -> dict[str, Any]:
    """Mark the spawned server ACTIVE (SHUTOFF if its host reported it off) with that power state.

    The ports are marked ACTIVE first, in the API database; the cell's commit comes last, so a
    step that fails after it has nothing left undone (CheckBuildCommitted then lets the build
    stand). Run again after it committed, it changes nothing. A server an admin settled by hand
    while it spawned (os-resetState) keeps the states the admin gave it, and is recorded launched
    all the same (its guest runs: a delete must treat it as a server that ran, keeping a root
    volume not meant to go with it).

    Raises:
        UnexpectedTaskState: the server is no longer spawning (it is being deleted), or no longer
            on this destination (a late run after the build was rescheduled).
        InstanceNotFound: the server is gone.
    """
    uuid, dest = event["instance_uuid"], event["destination"]
    with cell_session(dest["cell"]) as session:
        instance = instances.get(session, uuid)
        settled_by_hand = _build_committed(instance, dest["host"])
        if settled_by_hand and instance.launched_on == dest["host"]:
            return {}  # this step committed before
        if instance.host != dest["host"]:
            raise errors.UnexpectedTaskState(
                f"Instance {uuid} is being built on {instance.host}, not on {dest['host']}.")
    _record_built(event, settled_by_hand=settled_by_hand)
    return {}


def _record_built(event: dict[str, Any], *, settled_by_hand: bool) -> None:
    """FinishBuild's writes: the ports ACTIVE, in the API database; then, in the cell, the server
    launched on the destination (with the spawn's states unless an admin ``settled_by_hand`` it)
    and the build's event ended."""
    uuid, dest = event["instance_uuid"], event["destination"]
    power_state = int(event.get("spawn", {}).get("power_state", states.RUNNING))
    with api_session() as session:
        session.execute(update(Port).where(Port.device_id == uuid).values(status="ACTIVE"))
    with cell_session(dest["cell"]) as session:
        launched = {"launched_at": utcnow(), "launched_on": dest["host"]}
        if settled_by_hand:
            session.execute(update(Instance).where(Instance.uuid == uuid, Instance.host == dest["host"],
                                                   Instance.launched_on.is_(None)).values(**launched))
        else:
            instances.update_cas(session, uuid, {
                "vm_state": states.vm_state_from_power(power_state), "task_state": None, "power_state": power_state,
                **launched}, expected_task_state=(states.SPAWNING,))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_BUILD,
                             host=dest["host"])


def _build_committed(instance: Instance, host: str) -> bool:
    """Whether the build on ``host`` stands: FinishBuild's commit there happened (only it sets
    ``launched_on`` in a boot, and with it a settled vm_state; the task is not asked, the owner may
    have started another since), or an admin settled the server there by hand while it was
    spawning (os-resetState: vm_state no longer building), whose guest must not be destroyed
    under it, whatever its owner has asked of it since (a stop, a move: the task is not asked
    either)."""
    if instance.vm_state == states.BUILDING:
        return False
    return instance.launched_on == host or (instance.host == host and not instance.deleted)


def check_build_committed(event: dict[str, Any]) -> dict[str, Any]:
    """Whether FinishBuild committed before it failed (the ``Catch`` of FinishBuild comes here).

    A FinishBuild that failed after its commit (its response lost, the function timed out) has
    made the server ACTIVE on the destination, where its owner may already use it: rolling the
    build back then would destroy the guest the records point at. So the build stands. A server
    deleted after the commit counts as committed too (its delete cleans up after it). So does one
    an admin settled on the destination by hand while it spawned (os-resetState), whose guest
    runs there: if FinishBuild's commit never came, it is recorded here as FinishBuild would have
    (ports ACTIVE, launched, the build's event ended).

    Returns:
        ``{"committed": bool}``.
    """
    uuid, dest = event["instance_uuid"], event["destination"]
    with cell_session(dest["cell"]) as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
        committed = instance is not None and _build_committed(instance, dest["host"])
        # Settled by an admin while it spawned, FinishBuild's commit never made: recorded as it
        # would have (launched, so that a delete keeps a root volume not meant to go with it).
        unrecorded = committed and instance is not None and instance.launched_on != dest["host"]
    if unrecorded:
        try:
            _record_built(event, settled_by_hand=True)
        except Exception:  # noqa: BLE001 - the outcome is known: the build stands whatever this record does
            logger.exception("a build settled by hand could not be recorded launched: ferry audit reports its "
                             "open event", extra={"instance_uuid": uuid, "host": dest["host"]})
    if committed:
        logger.warning("FinishBuild failed after it committed, or an admin settled the server there by hand: the "
                       "build stands", extra={"instance_uuid": uuid, "host": dest["host"],
                                              "error": error_message(event.get("error") or {})})
    return {"committed": committed}


def fail_build(event: dict[str, Any]) -> dict[str, Any]:
    """Rollback tail of a failed boot: release the claim, set ERROR and record the fault.

    A server that was never scheduled is buried in cell0, as Nova does. When the destination
    could not be cleaned up (``cleanup_error``), or its ports and volumes not unbound from it
    (``unbind_error``), the fault says what may be left on which host. The fault's message is the
    cause as the owner may read it (:func:`ferry.workflows.owner_cause`); its details, read by
    admins only, hold the rest.
    A failed build gives back its networking with its claim, as Nova deallocates it: the ports
    Ferry made for the server are deleted, those its owner brought unbound and freed (the owner
    may boot again with them at once).
    A server deleted meanwhile (its mapping says so, its instance is gone or deleted, or its task
    is ``deleting``) is left to its delete: only the claim and the ports are released (those of a
    server whose mapping says so were released by its delete already), and its build's event
    ends with the error. One an
    admin reset while it was built (no task, no longer building) is set to ERROR all the same: the
    failed build left it no guest; unless it has moved to another host since, which leaves it, and
    the claim and ports it holds there, as they are. A server whose destination could not be
    cleaned up keeps its claim and ports: the guest may still run there, and the server's delete
    releases them with it.
    """
    uuid = event["instance_uuid"]
    error = event.get("error") or {}
    message = error_message(error)
    with api_session() as session:
        build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == uuid)).one_or_none()
    if build is not None:
        placement.delete_allocations(uuid)
        _remove_unhanded_copies(uuid)
        _bury_in_cell0(build, event["request_id"], message, error)
        return {}
    cell, deleted = _mapped_cell(uuid)
    if deleted:
        placement.delete_allocations(uuid)
        _remove_unhanded_copies(uuid)
        if cell is not None and cell != CELL0_NAME:
            # The server's create action shows how its build ended, as for one still being deleted.
            with cell_session(cell) as session:
                actions.finish_started_event(session, instance_uuid=uuid, request_id=event["request_id"],
                                             event=EVENT_BUILD, error=error)
        _deleted_meanwhile(uuid, message)
        return {}
    assert cell is not None
    host = event.get("destination", {}).get("host")
    left = []
    if event.get("cleanup_error"):
        left.append(f"Cleanup on host {host} failed ({error_message(event['cleanup_error'])}); "
                    f"the guest or its disks may remain there.")
    if event.get("unbind_error"):
        # Ports are released with the claim unless the guest may still run there (cleanup_error).
        kept = "ports and volumes stay bound" if event.get("cleanup_error") else "volumes stay attached"
        left.append(f"Unbinding its ports and volumes from host {host} failed "
                    f"({error_message(event['unbind_error'])}); its {kept} there until the server is deleted.")
    details = " ".join(left) or None
    # Read, then the claim and ports released in the API database with no cell transaction open
    # (SQLite's writers take their files one at a time, and a step holding the API database may
    # wait for this cell), then the server recorded as it is read again. The release comes before
    # the ERROR below, so that a run again after that commit has released them too.
    with cell_session(cell) as session:
        _reset, moved_on, left_on_host = _failed_build_state(
            session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none(), event)
    if not moved_on and not left_on_host:
        placement.delete_allocations(uuid)
        _release_network(uuid)
    with cell_session(cell) as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
        reset, moved_on, _left_on_host = _failed_build_state(instance, event)
        if instance is None or instance.deleted:
            actions.finish_started_event(session, instance_uuid=uuid, request_id=event["request_id"],
                                         event=EVENT_BUILD, error=error)
            _deleted_meanwhile(uuid, message)
            return {}
        if instance.task_state == states.DELETING:
            # Left to its delete, but in ERROR: should the delete not start after all (its task is
            # then put back), the server is a failed build to delete, not one still building.
            session.execute(update(Instance).where(Instance.uuid == uuid, Instance.task_state == states.DELETING)
                            .values(vm_state=states.ERROR).execution_options(synchronize_session=False))
            if actions.event_result(session, uuid, event["request_id"], EVENT_BUILD) is None:  # not on a run again
                instances.add_fault(session, uuid, owner_cause(error), host=instance.host,
                                    details=fault_details(error))
            actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_BUILD,
                                 host=instance.host, error=error or None)
            _deleted_meanwhile(uuid, message)
            return {}
        if instance.vm_state == states.ERROR and instance.task_state is None:
            return {}
        if moved_on:
            actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_BUILD,
                                 host=instance.host, error=error or None)
            logger.warning("build failed for a server reset and moved since; left as it is",
                           extra={"instance_uuid": uuid, "host": instance.host, "error": message})
            return {}
        instances.update_cas(session, uuid, {"vm_state": states.ERROR, "task_state": None},
                             expected_task_state=(None,) if reset else (states.SCHEDULING, states.SPAWNING),
                             expected_vm_state=(instance.vm_state,) if reset else None)
        instances.add_fault(session, uuid, owner_cause(error), host=instance.host,
                            details=fault_details(error, details))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_BUILD,
                             host=instance.host, error=error or None)
    return {}


def _failed_build_state(instance: Instance | None, event: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    """How FailBuild finds the server: ``(reset, moved_on, left_on_host)``.

    ``reset``: an admin settled it by hand while it was being built (os-resetState: no task, no
    longer building). On this build's host, or on none (a reschedule had taken it off one), the
    build failed under it all the same and left it no guest. ``moved_on``: reset and on another
    host since: what the build left is not its state any more, and the claim it holds now is that
    host's, not the build's. ``left_on_host``: its destination could not be cleaned up and may
    still run the guest: the claim stays with the server (and its host) until its delete releases
    it, as for any server in ERROR.
    """
    live = instance is not None and not instance.deleted
    reset = live and instance is not None and instance.task_state is None \
        and instance.vm_state not in (states.BUILDING, states.ERROR)
    moved_on = reset and instance is not None and instance.host not in (
        None, event.get("destination", {}).get("host"))
    return reset, moved_on, bool(event.get("cleanup_error")) and live


def _error_name(error: dict[str, Any]) -> str:
    """A Step Functions error's name without Ferry's prefix (``Ferry.NoValidHost`` → ``NoValidHost``)."""
    return str(error.get("Error") or "").removeprefix(errors.PREFIX)


def _release_network(uuid: str) -> None:
    """Delete the ports Ferry made for the failed build's server, unbind and free those its owner
    brought (:func:`ferry.network.release_ports`, as a delete does; idempotent: a port released
    is the server's no more, and a later delete of the server finds none)."""
    with api_session() as session:
        # The mapping's row first, as BindResourcesAtDest and a delete's release take it.
        session.execute(select(InstanceMapping.id).where(InstanceMapping.instance_uuid == uuid).with_for_update())
        network.release_ports(session, uuid, network.requested_networks(session, uuid))


def _deleted_meanwhile(uuid: str, message: str) -> None:
    logger.info("build failed for a server deleted meanwhile: claim released, nothing else to record",
                extra={"instance_uuid": uuid, "error": message})


def _remove_unhanded_copies(uuid: str) -> None:
    """Delete the copies SelectDestinations made in cells but never handed over (its hand-over
    failed, or the step stopped between the two, until its retries ran out): the server is
    buried in cell0, and a copy left in a cell would be a second, unmapped server there. Where a
    database cannot be reached the copy stays (``ferry audit`` reports it); the burial goes on."""
    for cell in all_cells(include_cell0=False):
        try:
            _remove_unmapped_copy(uuid, cell.name)
        except OperationalError as exc:
            logger.warning("copy in the cell not checked: a copy never handed over may remain there",
                           extra={"instance_uuid": uuid, "cell": cell.name, "error": str(exc)})


def _bury_in_cell0(build: BuildRequest, request_id: str, message: str, error: dict[str, Any]) -> None:
    uuid = build.instance_uuid
    _create_in_cell(build, CELL0_NAME, request_id, vm_state=states.ERROR, task_state=None, host=None, node=None)
    with cell_session(CELL0_NAME) as session:
        # The copy is this burial's: a fault there is this step's, recorded by a run cut short after it.
        if session.scalars(select(InstanceFault.id).where(InstanceFault.instance_uuid == uuid)).first() is None:
            instances.add_fault(session, uuid, owner_cause(error), details=fault_details(error))
        # The schedule event names what failed: no valid host, or the step's own error.
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=EVENT_SCHEDULE,
                             error={"Error": _error_name(error) or errors.NoValidHost.__name__, "Cause": message})
    if not _hand_over(uuid, CELL0_NAME):
        _remove_unmapped_copy(uuid, CELL0_NAME)  # deleted meanwhile: no server to bury (its delete freed the ports)
        return
    # After the hand-over, so that a delete of the server takes the mapping's row as this does; run
    # again after a failure here, FailBuild finds the server in cell0 and releases them there.
    _release_network(uuid)
