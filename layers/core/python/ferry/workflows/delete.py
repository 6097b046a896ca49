"""Steps of the delete workflow (``statemachine/delete.asl.json``).

DestroyAtHost (host agent, skipped for a server on no host) → FinishDelete; a destroy that
fails runs FailDelete so the owner sees ERROR with a fault and can delete again.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from ferry import network, placement
from ferry.compute import actions, instances, states
from ferry.store.api_models import InstanceMapping, Volume, VolumeAttachment, utcnow
from ferry.store.cell_models import BlockDeviceMapping, Instance
from ferry.store.db import api_session, cell_session
from ferry.workflows import error_message

EVENT_TERMINATE = "compute_terminate_instance"


def finish_delete(event: dict[str, Any]) -> dict[str, Any]:
    """Release the server's ports, volumes and allocations and mark it deleted (idempotent)."""
    uuid, cell = event["instance_uuid"], event["cell"]
    with cell_session(cell) as session:
        bdms = list(session.scalars(select(BlockDeviceMapping).where(
            BlockDeviceMapping.instance_uuid == uuid, BlockDeviceMapping.deleted.is_(False))))
        delete_on_termination = {b.volume_id for b in bdms if b.volume_id and b.delete_on_termination}
    with api_session() as session:
        network.release_ports(session, uuid, network.requested_networks(session, uuid))
        for attachment in session.scalars(select(VolumeAttachment).where(VolumeAttachment.instance_uuid == uuid)):
            volume = session.get(Volume, attachment.volume_id)
            session.delete(attachment)
            if volume is not None:
                volume.status = "deleting" if volume.id in delete_on_termination else "available"
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == uuid)
                        .values(queued_for_delete=True))
    placement.delete_allocations(uuid)
    now = utcnow()
    with cell_session(cell) as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one_or_none()
        if instance is None or instance.deleted:
            return {}
        instance.vm_state, instance.task_state, instance.power_state = states.DELETED, None, states.NOSTATE
        instance.deleted, instance.deleted_at, instance.terminated_at = True, now, now
        session.execute(update(BlockDeviceMapping).where(BlockDeviceMapping.instance_uuid == uuid)
                        .values(deleted=True))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_TERMINATE,
                             host=event.get("host"))
    return {}


def fail_delete(event: dict[str, Any]) -> dict[str, Any]:
    """Record a failed delete: ERROR with a fault naming the host, task cleared so delete can be retried."""
    uuid, cell = event["instance_uuid"], event["cell"]
    error = event.get("error") or {}
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        if instance.task_state != states.DELETING:
            return {}
        instances.update_cas(session, uuid, {"vm_state": states.ERROR, "task_state": None},
                             expected_task_state=(states.DELETING,))
        instances.add_fault(session, uuid, error_message(error), host=event.get("host"))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=EVENT_TERMINATE,
                             host=event.get("host"), error=error or None)
    return {}
