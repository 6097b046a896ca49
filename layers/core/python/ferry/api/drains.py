"""``/ferry/drains`` (admins): start, list, show, pause, resume and cancel drains.

``POST /ferry/drains`` with ``{"drain": {...}}`` (see :data:`ferry.drains.REQUEST_SCHEMA`)
answers 202 with the drain it started, or 200 with the plan of a dry run (400 for a
``callback_url`` while callbacks are not configured: :func:`ferry.drains.check_callbacks_configured`);
``GET /ferry/drains[?status=]``, ``GET /ferry/drains/{id}`` (a drain whose workflow ended without
finishing it is shown finished: :func:`ferry.drains.show`); ``POST /ferry/drains/{id}/action``
with ``{"pause": null}``, ``{"resume": null}`` or ``{"cancel": null}`` answers 202. What they
do is in :mod:`ferry.drains`; docs/drains.md is the operator's guide.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import drains, errors, policy
from ferry.api import request, schemas

router = Router()

RULE = "ferry:drains:{}"

# What the route parses: any JSON. ferry.drains.request_of checks it, and its refusals never
# repeat what was sent (a callback URL's query may carry a token).
_ANY_JSON: dict[str, Any] = {}
ACTION = {
    "type": "object",
    "minProperties": 1,
    "maxProperties": 1,
    "propertyNames": {"enum": list(drains.ACTIONS)},
    # An action takes no arguments: its value is null, as in {"pause": null}.
    "properties": {name: schemas.NULL_ACTION for name in drains.ACTIONS},
}


def _drain_id(value: str) -> str:
    try:
        request.validate(value, schemas.UUID)
    except errors.BadRequest as exc:
        raise errors.DrainNotFound(f"Drain {value} could not be found.") from exc
    return value


@router.post("/ferry/drains")
def create_drain() -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, RULE.format("create"), policy.NO_PROJECT)
    wanted = drains.request_of(request.body(router, _ANY_JSON))
    status, document = drains.create_drain(ctx, wanted, origin="api")
    return request.json_response(status, document)


@router.get("/ferry/drains")
def list_drains() -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, RULE.format("list"), policy.NO_PROJECT)
    params = request.query(router)
    status = params["status"][-1] if params.get("status") else None
    if status is not None and status not in drains.FINAL_STATUSES | drains.UNFINISHED_STATUSES:
        known = ", ".join(sorted(drains.FINAL_STATUSES | drains.UNFINISHED_STATUSES))
        raise errors.BadRequest(f"Invalid drain status {status!r}: one of {known}.")
    limit = request.parse_limit(params["limit"][-1]) if params.get("limit") else None
    return request.json_response(200, {"drains": drains.list_views(status=status, limit=limit)})


@router.get("/ferry/drains/<drain_id>")
def show_drain(drain_id: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, RULE.format("show"), policy.NO_PROJECT)
    return request.json_response(200, {"drain": drains.show(_drain_id(drain_id))})


@router.post("/ferry/drains/<drain_id>/action")
def drain_action(drain_id: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, RULE.format("action"), policy.NO_PROJECT)
    wanted = request.body(router, ACTION)
    action = next(iter(wanted))
    return request.json_response(202, {"drain": drains.act(_drain_id(drain_id), action)})
