"""``/os-server-groups``: server groups, which keep their members on one host or apart.

``GET``/``POST /os-server-groups``, ``GET``/``DELETE /os-server-groups/{id}``. Below 2.64 a
group is created with ``policies`` (a list of exactly one policy) and shown with ``policies``
and an empty ``metadata``; from 2.64 with ``policy`` and ``rules`` (``max_server_per_host``, for
``anti-affinity`` only). The soft policies come with 2.15; ``project_id`` and ``user_id`` are
shown from 2.13. A list holds the caller's project's groups, every project's for an admin who
asks with ``all_projects``, paged by ``limit`` and ``offset``. What the requests do is in
:mod:`ferry.compute.server_groups`.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors, policy, validation
from ferry.api import request, schemas
from ferry.api.microversions import APIVersion
from ferry.api.request import ViewContext
from ferry.auth import RequestContext
from ferry.compute import server_groups
from ferry.compute.api import normalize_uuid
from ferry.compute.server_groups import GroupRecord

router = Router()

RULE = "os_compute_api:os-server-groups:{}"
MAX_LIMIT = 1000
# No list holds more groups than their integer ids number: an offset beyond is an empty page, and
# the database is never asked for an offset its integers cannot hold.
MAX_OFFSET = validation.MAX_INT

# The microversions that change a group's shape.
SOFT_POLICIES_FROM = "2.15"
OWNER_SHOWN_FROM = "2.13"
POLICY_FIELD_FROM = "2.64"

# Query parameters of the list (Nova's schema refuses any other from 2.75).
LIST_PARAMETERS = {"all_projects": "2.1", "limit": "2.1", "offset": "2.1"}


def create_schema(version: APIVersion) -> dict[str, Any]:
    """The body of ``POST /os-server-groups`` at ``version``."""
    allowed = list(server_groups.POLICIES)
    if version.at_least(SOFT_POLICIES_FROM):
        allowed += server_groups.SOFT_POLICIES
    if version.at_least(POLICY_FIELD_FROM):
        group = {
            "type": "object",
            "properties": {
                "name": schemas.PRINTABLE_NAME, "policy": {"type": "string", "enum": allowed},
                "rules": {"type": "object",
                          "properties": {server_groups.MAX_SERVER_PER_HOST: schemas.POSITIVE_INT},
                          "additionalProperties": False}},
            "required": ["name", "policy"],
            "additionalProperties": False,
        }
    else:
        group = {
            "type": "object",
            "properties": {
                "name": schemas.PRINTABLE_NAME,
                "policies": {"type": "array", "items": {"type": "string", "enum": allowed},
                             "minItems": 1, "maxItems": 1, "uniqueItems": True}},
            "required": ["name", "policies"],
            "additionalProperties": False,
        }
    return {"type": "object", "properties": {"server_group": group}, "required": ["server_group"],
            "additionalProperties": False}


def group_view(view: ViewContext, record: GroupRecord) -> dict[str, Any]:
    """A group in Nova's shape at the view's microversion."""
    shown: dict[str, Any] = {"id": record.uuid, "name": record.name, "members": list(record.members)}
    if view.at_least(POLICY_FIELD_FROM):
        shown["policy"] = record.policy
        shown["rules"] = dict(record.rules)
    else:
        shown["policies"] = [record.policy]
        shown["metadata"] = {}
    if view.at_least(OWNER_SHOWN_FROM):
        shown["project_id"] = record.project_id
        shown["user_id"] = record.user_id
    return shown


def _rules(policy_name: str, rules: dict[str, Any] | None) -> dict[str, int]:
    """The rules of a 2.64 create, checked against its policy (``max_server_per_host`` as an integer).

    Raises:
        BadRequest: rules for a policy other than ``anti-affinity``, or a bound out of range.
    """
    if not rules:
        return {}
    if policy_name != server_groups.ANTI_AFFINITY:
        raise errors.BadRequest("Only anti-affinity policy supports rules.")
    name = server_groups.MAX_SERVER_PER_HOST
    return {name: request.bounded_int(name, rules[name], 1, schemas.MAX_INT)} if name in rules else {}


def _group_id(value: str) -> str:
    """The group id in the path, as groups are stored (a uuid in any spelling, canonical)."""
    return normalize_uuid(value) or value


def _scope(ctx: RequestContext) -> str | None:
    """The project whose groups ``ctx`` may name: its own, every project's (None) for an admin.
    Another project's group is 404 to a member, as in Nova, whose look-up is scoped so."""
    return None if ctx.is_admin else ctx.project_id


@router.get("/os-server-groups")
def list_groups() -> Response:
    view = request.view_context(router)
    params = request.query(router)
    request.refuse_unknown_from_strict(params, LIST_PARAMETERS, view)
    policy.enforce(view.ctx, RULE.format("index"))
    every_project = "all_projects" in params and policy.check(view.ctx, RULE.format("index:all_projects"),
                                                                policy.NO_PROJECT)
    limit = request.non_negative_int("limit", request.last(params, "limit"))
    offset = request.non_negative_int("offset", request.last(params, "offset")) or 0
    # No limit, or 0, is the most a page holds (Nova's ``limited``); a larger one too.
    found = server_groups.list_groups(None if every_project else view.ctx.project_id,
                                      limit=min(limit or MAX_LIMIT, MAX_LIMIT), offset=min(offset, MAX_OFFSET))
    return request.json_response(200, {"server_groups": [group_view(view, g) for g in found]})


@router.post("/os-server-groups")
def create_group() -> Response:
    view = request.view_context(router)
    wanted = request.body(router, create_schema(view.version))["server_group"]  # before the policy, as Nova
    policy.enforce(view.ctx, RULE.format("create"), {"project_id": view.ctx.project_id,
                                                     "user_id": view.ctx.user_id})
    request.require_printable(wanted, "server_group", "name")
    if view.at_least(POLICY_FIELD_FROM):
        policy_name, rules = wanted["policy"], _rules(wanted["policy"], wanted.get("rules"))
    else:
        policy_name, rules = wanted["policies"][0], {}
    created = server_groups.create_group(view.ctx, wanted["name"], policy_name, rules)
    return request.json_response(200, {"server_group": group_view(view, created)})


@router.get("/os-server-groups/<group_id>")
def show_group(group_id: str) -> Response:
    view = request.view_context(router)
    found = server_groups.get_group(_group_id(group_id), _scope(view.ctx))
    policy.enforce(view.ctx, RULE.format("show"), {"project_id": found.project_id})
    return request.json_response(200, {"server_group": group_view(view, found)})


@router.delete("/os-server-groups/<group_id>")
def delete_group(group_id: str) -> Response:
    ctx = request.caller(router)
    found = server_groups.get_group(_group_id(group_id), _scope(ctx))
    policy.enforce(ctx, RULE.format("delete"), {"project_id": found.project_id})
    server_groups.delete_group(found.uuid)
    return request.empty(204)
