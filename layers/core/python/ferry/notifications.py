"""Versioned notifications about servers, published to the notification bus (EventBridge).

Each notification is Nova-like: an ``event_type`` (``instance.resize.start``), a
``publisher_id`` (``compute:<host>`` for work a host does, ``conductor:<host>`` for steps the
orchestrator runs), a priority, a timestamp, a message id and a versioned payload describing
the server. It is one EventBridge event on the bus named by ``config.get().notification_bus``,
with source ``ferry.compute`` and the event type as its detail type, so a rule can route on
``detail-type`` alone.

Notifications are informational: a failure to publish is logged and counted
(``NotificationPublishFailed``) and never fails the step that sent it. They go out at least once:
a step that runs again publishes its events again, under the same ``message_id`` when the event
has an identity of its own (see :func:`message_id`), so consumers can drop the repeats.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from ferry import LAMBDA_VARIABLE, aws, config
from ferry.compute import states
from ferry.observability import logger, metrics
from ferry.store.cell_models import Instance

SOURCE = "ferry.compute"
PAYLOAD_VERSION = "1.0"
INFO = "INFO"
ERROR = "ERROR"

# Event types (Nova's names).
RESIZE_PREP_START = "instance.resize_prep.start"
RESIZE_PREP_END = "instance.resize_prep.end"
RESIZE_START = "instance.resize.start"
RESIZE_END = "instance.resize.end"
RESIZE_ERROR = "instance.resize.error"
RESIZE_FINISH_START = "instance.resize_finish.start"
RESIZE_FINISH_END = "instance.resize_finish.end"
RESIZE_CONFIRM_START = "instance.resize_confirm.start"
RESIZE_CONFIRM_END = "instance.resize_confirm.end"
RESIZE_REVERT_START = "instance.resize_revert.start"
RESIZE_REVERT_END = "instance.resize_revert.end"

# The namespace of the message ids derived from an event's identity (uuid5).
_MESSAGE_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "ferry:notification")

_FLAVOR_FIELDS = ("flavorid", "name", "vcpus", "memory_mb", "root_gb", "ephemeral_gb", "swap", "extra_specs")


def compute_publisher(host: str | None) -> str:
    """``compute:<host>``: the publisher of work done on (or for) a compute host."""
    return f"compute:{host or 'unknown'}"


def conductor_publisher() -> str:
    """``conductor:<where this runs>``: the publisher of steps the orchestrator runs itself."""
    return f"conductor:{os.environ.get(LAMBDA_VARIABLE) or socket.gethostname()}"


def _iso(value: dt.datetime | None) -> str | None:
    return value.replace(tzinfo=dt.UTC).isoformat() if value is not None else None


def _timestamp(at: dt.datetime | None) -> str:
    """A notification's ``timestamp``: ``at`` (a naive UTC value, as the store keeps them), or now."""
    return _iso(at) or dt.datetime.now(dt.UTC).isoformat()


def flavor_payload(flavor: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The flavor fields a notification carries (None when there is no flavor)."""
    if not flavor:
        return None
    return {key: flavor.get(key) for key in _FLAVOR_FIELDS if key in flavor}


def instance_payload(instance: Instance, **extra: Any) -> dict[str, Any]:
    """The payload describing ``instance`` as it is now (state, flavor, host, timestamps).

    Params:
        instance: the cell database record (read inside its session).
        extra: more fields for this event (``new_flavor``, ``migration_uuid``, …); they win over
            the instance's own.
    """
    payload: dict[str, Any] = {
        "instance_uuid": instance.uuid,
        "display_name": instance.display_name,
        "project_id": instance.project_id,
        "user_id": instance.user_id,
        "state": instance.vm_state,
        "task_state": instance.task_state,
        "power_state": states.POWER_STATE_NAMES.get(instance.power_state, str(instance.power_state)),
        "old_vm_state": instance.old_vm_state,
        "host": instance.host,
        "node": instance.node,
        "availability_zone": instance.availability_zone,
        "image_uuid": instance.image_ref,
        "flavor": flavor_payload(instance.flavor),
        "metadata": dict(instance.metadata_items or {}),
        "locked": bool(instance.locked),
        "created_at": _iso(instance.created_at),
        "updated_at": _iso(instance.updated_at),
        "launched_at": _iso(instance.launched_at),
        "terminated_at": _iso(instance.terminated_at),
    }
    payload.update(extra)
    return payload


def _document(event_type: str, publisher_id: str, payload: Mapping[str, Any], priority: str | None,
              message_id: str | None = None, at: dt.datetime | None = None) -> dict[str, Any]:
    return {
        "message_id": message_id or str(uuid.uuid4()),
        "event_type": event_type,
        "publisher_id": publisher_id,
        "priority": priority or (ERROR if event_type.endswith(".error") else INFO),
        "timestamp": _timestamp(at),
        "payload_version": PAYLOAD_VERSION,
        "payload": dict(payload),
    }


def notify_drain(event_type: str, *, drain_uuid: str, payload: dict[str, Any], message_id: str | None = None,
                 timestamp: dt.datetime | None = None) -> None:
    """Publish a drain's grouped notification (``drain.start``, ``drain.end``, ``drain.error``); never raises.

    The payload is the drain's summary: status, counts and each server's result (as many as the
    bus takes, see :func:`_fit_on_the_bus`).

    Params:
        message_id: the event's identity (default: a new one). A drain passes the same id each
            time it announces the same event again, so consumers can drop the repeats.
        timestamp: when the event happened (naive values are UTC; default: now). A drain passes
            the time it ended with its end, so every copy of that event carries the same one.
    """
    document = _document(event_type, conductor_publisher(), {**payload, "drain_id": drain_uuid}, None, message_id,
                         timestamp)
    _put(event_type, _fit_on_the_bus(document), subject=f"drain {drain_uuid}")


# EventBridge refuses an entry above 256 KiB; this leaves room for its other fields.
_LARGEST_DETAIL_BYTES = 240 * 1024


def _fit_on_the_bus(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with as many of its drain's servers as the bus takes: the servers that did not
    move first, then the others; ``servers_omitted`` counts those left out (the drain's record,
    ``GET /v2.1/ferry/drains/{id}``, and its callback have them all). The plan's list of the
    servers that could not be placed, which repeats theirs, goes first."""
    if _size(document) <= _LARGEST_DETAIL_BYTES:
        return document
    payload = dict(document["payload"])
    plan = payload.get("plan")
    if isinstance(plan, dict) and plan.get("unplaceable"):
        payload["plan"] = {**plan, "unplaceable": [], "unplaceable_omitted": len(plan["unplaceable"])}
    servers = sorted(payload.get("servers") or [], key=lambda server: server.get("state") == "done")
    kept: list[dict[str, Any]] = []
    base = _size({**document, "payload": {**payload, "servers": [], "servers_omitted": len(servers)}})
    for server in servers:
        size = _size(server) + 2
        if base + size > _LARGEST_DETAIL_BYTES:
            break
        kept.append(server)
        base += size
    logger.warning("drain notification too large for the bus: servers left out",
                   extra={"drain": payload.get("drain_id"), "kept": len(kept), "omitted": len(servers) - len(kept)})
    return {**document, "payload": {**payload, "servers": kept, "servers_omitted": len(servers) - len(kept)}}


def _size(value: Any) -> int:
    return len(json.dumps(value, default=str))


def message_id(event_type: str, instance_uuid: str, publisher_id: str, identity: str) -> str:
    """The ``message_id`` of an instance notification with an identity: the same for every copy of the event.

    A uuid5 over the event type, the server, the publisher and ``identity``, what tells this
    event from the server's other events of that type from that publisher (a move's migration
    uuid; a confirm's or revert's migration uuid and request id). A step run twice publishes the
    event again under the same id; another move, confirm or revert of the server gets new ones.
    """
    return str(uuid.uuid5(_MESSAGE_ID_NAMESPACE, "\n".join((event_type, instance_uuid, publisher_id, identity))))


def notify(event_type: str, *, instance_uuid: str, publisher_id: str, payload: dict[str, Any] | None = None,
           priority: str | None = None, identity: str | None = None) -> None:
    """Publish one notification to the notification bus; never raises.

    Params:
        event_type: ``instance.<action>.<phase>`` (see the constants of this module).
        instance_uuid: the server the notification is about (always in the payload).
        publisher_id: ``compute:<host>`` or ``conductor:<host>``.
        payload: what to say about the server, usually :func:`instance_payload`.
        priority: ``INFO``, or ``ERROR`` (the default for ``*.error`` event types).
        identity: what makes the event one of its own (see :func:`message_id`): with it the
            ``message_id`` is derived, and every copy of the event carries the same; without it,
            each publication gets a new random one.
    """
    document = _document(event_type, publisher_id, {**(payload or {}), "instance_uuid": instance_uuid}, priority,
                         message_id(event_type, instance_uuid, publisher_id, identity) if identity else None)
    _put(event_type, document, subject=instance_uuid)


def _put(event_type: str, document: dict[str, Any], *, subject: str) -> None:
    """Put one notification on the bus; a failure is logged and counted, never raised."""
    bus = config.get().notification_bus
    try:
        response = aws.client("events").put_events(Entries=[{
            "Source": SOURCE,
            "DetailType": event_type,
            "Detail": json.dumps(document, default=str),
            "EventBusName": bus,
            "Resources": [],
        }])
        failed = [e for e in response.get("Entries", []) if e.get("ErrorCode")]
        if response.get("FailedEntryCount") or failed:
            reason = (failed[0].get("ErrorMessage") or failed[0].get("ErrorCode")) if failed else "unknown"
            raise RuntimeError(f"the bus refused the event: {reason}")
    except Exception as exc:  # noqa: BLE001 - a lost notification must never fail the step that sent it
        metrics.add_metric(name="NotificationPublishFailed", unit=MetricUnit.Count, value=1)
        logger.warning("notification not published", extra={
            "event_type": event_type, "subject": subject, "bus": bus,
            "error": f"{type(exc).__name__}: {exc}"})
        return
    logger.debug("notification published", extra={"event_type": event_type, "subject": subject,
                                                   "message_id": document["message_id"]})
