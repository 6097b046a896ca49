"""``/os-aggregates`` (admins): host aggregates, their hosts and metadata.

``GET``/``POST /os-aggregates``, ``GET``/``PUT``/``DELETE /os-aggregates/{id}`` and
``POST /os-aggregates/{id}/action`` with exactly one of ``add_host``, ``remove_host`` or
``set_metadata``. Aggregates are named by their integer id in the path; ``uuid`` is shown
from 2.41. What the requests do is in :mod:`ferry.compute.aggregates`.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors, policy
from ferry.api import request
from ferry.api.request import ViewContext
from ferry.api.views import isotime_micro
from ferry.compute import aggregates
from ferry.compute.aggregates import AggregateRecord

router = Router()

RULE = "os_compute_api:os-aggregates:{}"

# Printable, without leading or trailing blanks (Nova's ``name``); a zone also without ``:``,
# which server create uses to separate zone, host and node.
_NAME = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^(?![ \\t])[^\\x00-\\x1f\\x7f]*(?<![ \\t])$"}
_ZONE = {"oneOf": [{**_NAME, "pattern": "^(?![ \\t])[^\\x00-\\x1f\\x7f:]*(?<![ \\t])$"}, {"type": "null"}]}
_HOST = {"type": "string", "minLength": 1, "maxLength": 255}

CREATE = {
    "type": "object",
    "properties": {"aggregate": {
        "type": "object", "properties": {"name": _NAME, "availability_zone": _ZONE},
        "required": ["name"], "additionalProperties": False}},
    "required": ["aggregate"],
    "additionalProperties": False,
}

UPDATE = {
    "type": "object",
    "properties": {"aggregate": {
        "type": "object", "properties": {"name": _NAME, "availability_zone": _ZONE},
        "minProperties": 1, "additionalProperties": False}},
    "required": ["aggregate"],
    "additionalProperties": False,
}

_HOST_ACTION = {"type": "object", "properties": {"host": _HOST}, "required": ["host"], "additionalProperties": False}

ACTIONS: dict[str, dict[str, Any]] = {
    "add_host": _HOST_ACTION,
    "remove_host": _HOST_ACTION,
    "set_metadata": {
        "type": "object",
        "properties": {"metadata": {
            "type": "object",
            "patternProperties": {"^[a-zA-Z0-9-_:. ]{1,255}$": {"type": ["string", "null"], "maxLength": 255}},
            "additionalProperties": False}},
        "required": ["metadata"],
        "additionalProperties": False,
    },
}

ACTION_BODY = {"type": "object", "minProperties": 1, "maxProperties": 1}


def aggregate_view(view: ViewContext, record: AggregateRecord, *, with_members: bool = True) -> dict[str, Any]:
    """An aggregate in Nova's shape; a created one is shown without ``hosts`` and ``metadata``."""
    shown: dict[str, Any] = {
        "id": record.id, "name": record.name, "availability_zone": record.availability_zone,
        "created_at": isotime_micro(record.created_at), "updated_at": isotime_micro(record.updated_at),
        "deleted": False, "deleted_at": None,
    }
    if with_members:
        shown["hosts"] = list(record.hosts)
        shown["metadata"] = dict(record.metadata)
    if view.at_least("2.41"):
        shown["uuid"] = record.uuid
    return shown


def _aggregate_id(value: str) -> int:
    """The integer id in the path (a name or uuid is refused, as Nova does; clients then list).

    Raises:
        BadRequest: not an integer.
        NotFound: an integer beyond the id column, which no aggregate can have.
    """
    try:
        number = int(value)
    except ValueError as exc:
        raise errors.BadRequest(f"Invalid aggregate id {value}: id must be an integer.") from exc
    if not request.fits_int_column(number):
        raise errors.NotFound(f"Aggregate {value} could not be found.")
    return number


def _answer(view: ViewContext, record: AggregateRecord, **options: bool) -> Response:
    return request.json_response(200, {"aggregate": aggregate_view(view, record, **options)})


@router.get("/os-aggregates")
def list_aggregates() -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, RULE.format("index"), policy.NO_PROJECT)
    return request.json_response(200, {"aggregates": [aggregate_view(view, a) for a in aggregates.list_aggregates()]})


@router.post("/os-aggregates")
def create_aggregate() -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, RULE.format("create"), policy.NO_PROJECT)
    wanted = request.body(router, CREATE)["aggregate"]
    request.require_printable(wanted, "aggregate", "name", "availability_zone")
    created = aggregates.create_aggregate(wanted["name"], wanted.get("availability_zone"))
    return _answer(view, created, with_members=False)


@router.get("/os-aggregates/<aggregate_id>")
def show_aggregate(aggregate_id: str) -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, RULE.format("show"), policy.NO_PROJECT)
    return _answer(view, aggregates.get_aggregate(_aggregate_id(aggregate_id)))


@router.put("/os-aggregates/<aggregate_id>")
def update_aggregate(aggregate_id: str) -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, RULE.format("update"), policy.NO_PROJECT)
    number = _aggregate_id(aggregate_id)
    wanted = request.body(router, UPDATE)["aggregate"]
    request.require_printable(wanted, "aggregate", "name", "availability_zone")
    return _answer(view, aggregates.update_aggregate(number, **wanted))


@router.delete("/os-aggregates/<aggregate_id>")
def delete_aggregate(aggregate_id: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, RULE.format("delete"), policy.NO_PROJECT)
    aggregates.delete_aggregate(_aggregate_id(aggregate_id))
    return request.empty(200)


@router.post("/os-aggregates/<aggregate_id>/action")
def aggregate_action(aggregate_id: str) -> Response:
    view = request.view_context(router)
    body = request.body(router, ACTION_BODY)
    name, argument = next(iter(body.items()))
    if name not in ACTIONS:
        raise errors.BadRequest(f"There is no such action: {name}")
    policy.enforce(view.ctx, RULE.format(name), policy.NO_PROJECT)
    number = _aggregate_id(aggregate_id)
    request.validate(body, {"type": "object", "properties": {name: ACTIONS[name]}})
    if name == "add_host":
        record = aggregates.add_host(number, argument["host"])
    elif name == "remove_host":
        record = aggregates.remove_host(number, argument["host"])
    else:
        request.require_printable(argument["metadata"], "set_metadata/metadata", "availability_zone")
        record = aggregates.set_metadata(number, argument["metadata"])
    return _answer(view, record)
