"""Steps of the drain workflow (``statemachine/drain.asl.json``); the logic is in :mod:`ferry.drains`.

The workflow: BeginDrain (load or record the drain) → PlanDrain (disable the targets, plan) →
a ``Map`` over the planned servers, each iteration AcquireSlot (wait while paused or a host
limit is reached) → PrepareMove → the resize workflow as a nested execution → PrepareConfirm →
the confirm workflow as a nested execution → RecordMoved, with RecordFailure deciding on a
retry, and SettleServer recording the server failed when that bookkeeping itself fails (the
iteration never ends with its server counted as moving) → FinishDrain (status, notification,
callback).
"""

from __future__ import annotations

from typing import Any

from ferry import drains

_UUID = {"type": "string", "minLength": 1}

BEGIN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["input", "execution_name"],
    "properties": {"input": {"type": "object"}, "execution_name": {"type": "string", "minLength": 1}},
}
DRAIN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["drain"],
    "properties": {"drain": {"type": "object", "required": ["drain_uuid"], "properties": {"drain_uuid": _UUID}}},
}
SERVER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["drain_uuid", "instance_uuid"],
    "properties": {"drain_uuid": _UUID, "instance_uuid": _UUID, "slot": {"type": "object"},
                   "confirm_slot": {"type": ["string", "null"]},
                   "poll_seconds": {"type": "integer", "minimum": 1},
                   "iteration_started_at": {"type": "string"}},
}


def begin_drain(event: dict[str, Any]) -> dict[str, Any]:
    """BeginDrain: ``{"drain_uuid", "dry_run"}`` of the drain this execution runs."""
    return drains.begin(event["input"], event["execution_name"])


def plan_drain(event: dict[str, Any]) -> dict[str, Any]:
    """PlanDrain: disable the targets, plan, and say whether to move (see :func:`ferry.drains.start`)."""
    return drains.start(event["drain"]["drain_uuid"])


def acquire_slot(event: dict[str, Any]) -> dict[str, Any]:
    """AcquireSlot: ``move``, ``wait`` or ``stop`` for one server, and whether to confirm; a
    ``wait`` says for how long (``wait_seconds``, see :func:`drains.wait_seconds`)."""
    slot = drains.acquire_slot(event["drain_uuid"], event["instance_uuid"]).to_dict()
    if slot["action"] == "wait":
        slot["wait_seconds"] = drains.wait_seconds(event.get("poll_seconds"), event.get("iteration_started_at"))
    return slot


def prepare_move(event: dict[str, Any]) -> dict[str, Any]:
    """PrepareMove: accept the cold migration; the nested resize execution's name and input."""
    return drains.prepare_move(event["drain_uuid"], event["instance_uuid"], event["slot"])


def prepare_confirm(event: dict[str, Any]) -> dict[str, Any]:
    """PrepareConfirm: accept the confirm; the nested confirm execution's name and input."""
    return drains.prepare_confirm(event["drain_uuid"], event["instance_uuid"], event["slot"])


def record_moved(event: dict[str, Any]) -> dict[str, Any]:
    """RecordMoved: the server is on its new host (confirmed unless the drain keeps VERIFY_RESIZE)."""
    return drains.record_moved(event["drain_uuid"], event["instance_uuid"],
                               confirmed=bool(event["slot"].get("confirm")),
                               migration_uuid=event["slot"].get("migration_uuid"))


def record_failure(event: dict[str, Any]) -> dict[str, Any]:
    """RecordFailure: note the failed attempt; ``{"retry": bool, "confirm": bool, …}``.

    An execution started before the drain state machine marked its confirms (no ``confirm_slot``
    key, where a newer one passes null) cannot go on to a confirm: its RetryChoice does not know
    the way. Its tries are taken as having gone to their confirm already.
    """
    slot = event.get("slot") or {}
    confirm_slot = event["confirm_slot"] if "confirm_slot" in event else slot.get("request_id")
    return drains.record_failure(event["drain_uuid"], event["instance_uuid"], slot, event.get("error"), confirm_slot)


def settle_server(event: dict[str, Any]) -> dict[str, Any]:
    """SettleServer: the iteration ends without moving its server; a server not yet settled is failed."""
    return drains.settle_server(event["drain_uuid"], event["instance_uuid"], event.get("error"))


def finish_drain(event: dict[str, Any]) -> dict[str, Any]:
    """FinishDrain: settle the status, announce it, return the report."""
    return drains.finish(event["drain"]["drain_uuid"], event.get("error"))
