"""Steps of the power workflow (``statemachine/power.asl.json``): os-stop and os-start.

BeginPowerAction → SetPowerAtHost (host agent) → FinishPowerAction; a failure runs
FailPowerAction, except a request the API undid before its workflow began, which changes nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from ferry import protocol
from ferry.compute import actions, instances, states
from ferry.store.db import cell_session
from ferry.workflows import fault_details, owner_cause

_TASK_STATE = {protocol.POWER_OFF: states.POWERING_OFF, protocol.POWER_ON: states.POWERING_ON}
_EVENT = {protocol.POWER_OFF: "compute_stop_instance", protocol.POWER_ON: "compute_start_instance"}
_EXPECTED_POWER = {protocol.POWER_OFF: states.SHUTDOWN, protocol.POWER_ON: states.RUNNING}
# What the server is once the operation is done, whatever power state its host then reports (Nova's
# stop and start set these; the power state is recorded beside them).
_VM_STATE = {protocol.POWER_OFF: states.STOPPED, protocol.POWER_ON: states.ACTIVE}

POWER_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["instance_uuid", "request_id", "cell", "operation"],
    "properties": {"operation": {"enum": sorted(_TASK_STATE)}},
}


def begin_power_action(event: dict[str, Any]) -> dict[str, Any]:
    """Take the request before the host acts: the server still ``powering-off`` (``-on``) under
    this request's action, its event started (:func:`actions.take_request`).

    Raises:
        UnexpectedTaskState: the API undid the request meanwhile; nothing was done.
    """
    uuid, operation = event["instance_uuid"], event["operation"]
    with cell_session(event["cell"]) as session:
        actions.take_request(session, instance_uuid=uuid, request_id=event["request_id"],
                             task_states=(_TASK_STATE[operation],), event=_EVENT[operation], host=event.get("host"))
    return {}


def _task_left(session: Session, event: dict[str, Any], error: dict[str, Any] | None) -> tuple[bool, str | None]:
    """``(settle, task)``: whether a step ending the power action's event settles the server, from
    which task: its own, or none once an os-resetState cleared it (a reset alone leaves the step to
    record what its host did). Not once the request is over (:func:`actions.superseded`: the step
    committed before, the API undid the request, or a newer request took the server, which is
    left alone while this request's event still ends, with ``error`` or success, as the host
    answered), nor from another task."""
    uuid, operation, request_id = event["instance_uuid"], event["operation"], event["request_id"]
    if actions.superseded(session, uuid, request_id, _EVENT[operation]):
        if not actions.ended(session, uuid, request_id, _EVENT[operation]):
            actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event=_EVENT[operation],
                                 host=event.get("host"), error=error)
        return False, None
    task = instances.get(session, uuid).task_state
    return task in (_TASK_STATE[operation], None), task


def finish_power_action(event: dict[str, Any]) -> dict[str, Any]:
    """Settle vm_state by the operation (stopped, active) and record the power state the host
    reported; for a server an admin reset meanwhile, the power state only (the vm_state is the
    admin's, as Nova leaves it). Idempotent: once the request is over (this step committed, or a
    newer request took the server, whose action's event it only ends: :func:`_task_left`) it
    changes nothing."""
    uuid, operation = event["instance_uuid"], event["operation"]
    power_state = int(event.get("result", {}).get("power_state", _EXPECTED_POWER[operation]))
    with cell_session(event["cell"]) as session:
        settle, task = _task_left(session, event, None)
        if not settle:
            return {}
        settled = {"power_state": power_state} if task is None else {
            "vm_state": _VM_STATE[operation], "power_state": power_state, "task_state": None}
        instances.update_cas(session, uuid, settled, expected_task_state=(task,))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=_EVENT[operation],
                             host=event.get("host"))
    return {}


def fail_power_action(event: dict[str, Any]) -> dict[str, Any]:
    """Clear the task state of a failed power action and record the fault; vm_state is kept,
    unless the host did it (its answer, ``result``, is in the event: FinishPowerAction failed
    after it), when the server is settled as FinishPowerAction would have (Ferry has no periodic
    power-state sync that would correct it later). Nothing is done for a request that is over
    (:func:`actions.superseded`: the API undid it, this step committed before, or a newer request
    took the server): a task there is another's, and only this request's event ends. A server an
    admin reset meanwhile gets the fault all the same (:func:`_task_left`)."""
    uuid, operation = event["instance_uuid"], event["operation"]
    error = event.get("error") or {}
    with cell_session(event["cell"]) as session:
        settle, task = _task_left(session, event, error or None)
        if not settle:
            return {}
        done_at_host: dict[str, Any] = {}
        if isinstance(event.get("result"), dict) and "power_state" in event["result"]:
            done_at_host = {"power_state": int(event["result"]["power_state"])}
            if task is not None:  # a reset's vm_state is the admin's
                done_at_host["vm_state"] = _VM_STATE[operation]
        instances.update_cas(session, uuid, {"task_state": None, **done_at_host}, expected_task_state=(task,))
        instances.add_fault(session, uuid, owner_cause(error), host=event.get("host"), details=fault_details(error))
        actions.finish_event(session, instance_uuid=uuid, request_id=event["request_id"], event=_EVENT[operation],
                             host=event.get("host"), error=error or None)
    return {}

