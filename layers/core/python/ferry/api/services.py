"""``/os-services`` (admins): the compute services of every cell.

``GET /os-services[?host=&binary=]``; from 2.53 ``PUT``/``DELETE /os-services/{uuid}``;
below 2.53 ``PUT /os-services/enable``, ``/disable``, ``/disable-log-reason`` (and, from 2.11,
``/force-down``) naming the service by host and binary, and ``DELETE /os-services/{id}`` by
its integer id. What the requests do is in :mod:`ferry.compute.services`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors, policy
from ferry.api import request, schemas
from ferry.api.request import ViewContext
from ferry.api.views import isotime_micro
from ferry.compute import services
from ferry.compute.services import ServiceRecord

router = Router()

RULE = "os_compute_api:os-services:{}"

_REASON = {"type": "string", "minLength": 1, "maxLength": 255}

UPDATE = {
    "type": "object",
    "properties": {"status": {"enum": ["enabled", "disabled"]}, "disabled_reason": _REASON,
                   "forced_down": schemas.BOOLEAN},
    "additionalProperties": False,
}

_LEGACY_NAMING = {"host": {"type": "string", "minLength": 1, "maxLength": 255},
                  "binary": {"type": "string", "minLength": 1, "maxLength": 255}}
LEGACY_UPDATE = {
    "type": "object",
    "properties": {**_LEGACY_NAMING, "disabled_reason": _REASON},
    "required": ["host", "binary"],
    "additionalProperties": False,
}
# From 2.11 every pre-2.53 action takes the one body of Nova's ``service_update_v211``: a
# ``forced_down`` anywhere (only ``force-down`` reads it) and a reason anywhere (only
# ``disable-log-reason`` records it).
LEGACY_UPDATE_V211 = {
    **LEGACY_UPDATE,
    "properties": {**_LEGACY_NAMING, "disabled_reason": _REASON, "forced_down": schemas.BOOLEAN},
}
# The body ``force-down`` needs (published in the OpenAPI document): the missing ``forced_down`` is
# found in code rather than by the schema, to refuse it in Nova's words.
LEGACY_FORCE_DOWN = {**LEGACY_UPDATE_V211, "required": ["host", "binary", "forced_down"]}
LEGACY_ACTIONS = ("enable", "disable", "disable-log-reason", "force-down")

# The list's query parameters (Nova's schema refuses any other from 2.75; before, others are ignored).
LIST_PARAMETERS: Mapping[str, str] = {"host": "2.1", "binary": "2.1"}


def service_view(view: ViewContext, record: ServiceRecord) -> dict[str, Any]:
    """A service in Nova's shape: ``id`` is the uuid from 2.53, ``forced_down`` shown from 2.11."""
    shown: dict[str, Any] = {
        "id": record.uuid if view.at_least("2.53") else record.id,
        "binary": record.binary, "host": record.host, "zone": record.zone,
        "status": "disabled" if record.disabled else "enabled", "state": "up" if record.up else "down",
        "updated_at": isotime_micro(record.updated_at), "disabled_reason": record.disabled_reason,
    }
    if view.at_least("2.11"):
        shown["forced_down"] = record.forced_down
    return shown


@router.get("/os-services")
def list_services() -> Response:
    view = request.view_context(router)
    params = request.query(router)
    # the query is checked before the policy, as Nova checks its schema first
    request.refuse_unknown_from_strict(params, LIST_PARAMETERS, view)
    policy.enforce(view.ctx, RULE.format("list"), policy.NO_PROJECT)
    host = params["host"][-1] if params.get("host") else None
    binary = params["binary"][-1] if params.get("binary") else None
    # A cell whose database does not answer is left out, as Nova lists services; from 2.69 its
    # hosts are listed UNKNOWN (Nova's partial records).
    found = services.list_answering(host=host, binary=binary, unknown=view.at_least("2.69"))
    return request.json_response(200, {"services": [
        service_view(view, s) if isinstance(s, ServiceRecord) else {"binary": s.binary, "host": s.host,
                                                                    "status": "UNKNOWN"}
        for s in found]})


def _service_uuid(value: str) -> str:
    """The service uuid in the path (2.53+).

    Raises:
        BadRequest: not a uuid.
    """
    try:
        request.validate(value, schemas.UUID)
    except errors.BadRequest as exc:
        raise errors.BadRequest(f"Invalid uuid {value}") from exc
    return value


def _forced_down(value: bool | str) -> bool:
    """``forced_down`` as given: a boolean, or one of the spellings of one the schema lets through."""
    return request.flag("forced_down", value)


def _changes(wanted: Mapping[str, Any]) -> dict[str, Any]:
    """What a 2.53+ body changes, read as Nova reads it: a reason counts with ``status: disabled``
    only, is refused with ``status: enabled`` and ignored without a status.

    Raises:
        BadRequest: a reason with ``status: enabled``, or neither ``status`` nor ``forced_down``.
    """
    changes: dict[str, Any] = {}
    if wanted.get("status") == "enabled":
        if wanted.get("disabled_reason"):
            raise errors.BadRequest("Specifying 'disabled_reason' with status 'enabled' is invalid.")
        changes.update(disabled=False, disabled_reason=None)
    elif wanted.get("status") == "disabled":
        changes.update(disabled=True, disabled_reason=wanted.get("disabled_reason"))
    if "forced_down" in wanted:
        changes["forced_down"] = _forced_down(wanted["forced_down"])
    if not changes:
        raise errors.BadRequest("No updates were requested. Fields 'status' or 'forced_down' should be specified.")
    return changes


def _update(view: ViewContext, service_id: str) -> Response:
    service_uuid = _service_uuid(service_id)
    wanted = request.body(router, UPDATE)
    service = services.get_by_uuid(service_uuid)  # an unknown service is 404 before the body's sense is read
    updated = services.update_service(service, **_changes(wanted))
    return request.json_response(200, {"service": service_view(view, updated)})


def _force_down(wanted: Mapping[str, Any]) -> Response:
    """``PUT /os-services/force-down`` (2.11–2.52).

    Raises:
        BadRequest: no ``forced_down`` in the body.
    """
    if "forced_down" not in wanted:
        raise errors.BadRequest("Missing forced_down field")
    forced_down = _forced_down(wanted["forced_down"])
    service = services.get_by_host(wanted["host"], wanted["binary"])
    services.update_service(service, forced_down=forced_down)
    return request.json_response(200, {"service": {
        "host": wanted["host"], "binary": wanted["binary"], "forced_down": forced_down}})


def _legacy_update(view: ViewContext, action: str) -> Response:
    """The pre-2.53 forms; the body is checked before the action is looked up, as in Nova.

    Raises:
        BadRequest: the body does not match the microversion's schema, or lacks what the action needs.
        NotFound: an unknown action (``force-down`` is one below 2.11), host or binary.
    """
    wanted = request.body(router, LEGACY_UPDATE_V211 if view.at_least("2.11") else LEGACY_UPDATE)
    if action not in LEGACY_ACTIONS or (action == "force-down" and not view.at_least("2.11")):
        raise errors.NotFound("Unknown action")
    if action == "force-down":
        return _force_down(wanted)
    reason = wanted.get("disabled_reason")
    if action == "disable-log-reason" and reason is None:
        raise errors.BadRequest("Missing disabled reason field")
    if action != "disable-log-reason":
        reason = None  # only disable-log-reason records one (Nova ignores it elsewhere)
    service = services.get_by_host(wanted["host"], wanted["binary"])
    disabled = action != "enable"
    services.update_service(service, disabled=disabled, disabled_reason=reason)
    shown = {"host": wanted["host"], "binary": wanted["binary"], "status": "disabled" if disabled else "enabled"}
    if reason is not None:
        shown["disabled_reason"] = reason
    return request.json_response(200, {"service": shown})


@router.put("/os-services/<service_id>")
def update_service(service_id: str) -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, RULE.format("update"), policy.NO_PROJECT)
    if view.at_least("2.53"):
        return _update(view, service_id)
    return _legacy_update(view, service_id)


@router.delete("/os-services/<service_id>")
def delete_service(service_id: str) -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, RULE.format("delete"), policy.NO_PROJECT)
    if view.at_least("2.53"):
        service = services.get_by_uuid(_service_uuid(service_id))
    else:
        try:
            number = int(service_id)
        except ValueError as exc:
            raise errors.BadRequest(f"Invalid service id {service_id}: it must be an integer below 2.53.") from exc
        if not request.fits_int_column(number):
            raise errors.NotFound(f"Service {service_id} could not be found.")
        service = services.get_by_id(number)
    services.delete_service(service)
    return request.empty(204)
