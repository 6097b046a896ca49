"""``/servers``: create, show, list, delete, server actions and instance actions.

Server actions (``POST /servers/{id}/action``) are looked up by the body's single key in
:data:`ACTIONS`; a module adds one with :func:`server_action`.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors, policy
from ferry.api import request, schemas, server_query, views
from ferry.api.microversions import APIVersion
from ferry.auth import RequestContext
from ferry.compute import admin_actions, instances, server_groups, services
from ferry.compute import api as compute_api

router = Router()

ActionHandler = Callable[[RequestContext, compute_api.Location, Any, APIVersion], Response]


@dataclass(frozen=True)
class ServerAction:
    name: str
    schema: dict[str, Any]
    handler: ActionHandler
    # (microversion, schema): the body's schema from that microversion on.
    later: tuple[str, dict[str, Any]] | None = None

    def schema_at(self, version: APIVersion) -> dict[str, Any]:
        if self.later is not None and version.at_least(self.later[0]):
            return self.later[1]
        return self.schema


ACTIONS: dict[str, ServerAction] = {}


def server_action(name: str, schema: dict[str, Any],
                  later: tuple[str, dict[str, Any]] | None = None) -> Callable[[ActionHandler], ActionHandler]:
    """Register ``handler(ctx, location, value, version) -> Response`` for the action ``name``.

    ``value`` is what the body holds under ``name``, already checked against ``schema`` (or, from
    the microversion ``later`` names, its schema), before the server is looked up, as Nova checks
    a body first.
    """
    def register(handler: ActionHandler) -> ActionHandler:
        ACTIONS[name] = ServerAction(name=name, schema=schema, handler=handler, later=later)
        return handler
    return register


# --- list and show ---------------------------------------------------------------------------------


def _list(detail: bool) -> Response:
    view = request.view_context(router)
    kind = "detail" if detail else "index"
    policy.enforce(view.ctx, f"os_compute_api:servers:{kind}")
    params = request.query(router)
    filters = server_query.parse(view, params)
    if filters.all_tenants:
        policy.enforce(view.ctx, f"os_compute_api:servers:{kind}:get_all_tenants")
    # From 2.69 the servers of a cell whose database does not answer are listed UNKNOWN (Nova's
    # partial records); before, they are left out.
    page = compute_api.list_page(view.ctx, filters, unknown=view.at_least("2.69"))
    if detail:
        _add_host_status(view, page.servers)
    render = views.server_detail if detail else views.server_summary
    body: dict[str, Any] = {"servers": [
        render(view, item) if isinstance(item, compute_api.Server) else views.unknown_server(view, item, detail=detail)
        for item in page.items]}
    next_link = views.next_link(view, "servers/detail" if detail else "servers", params,
                                page.ids, compute_api.page_size(filters.limit))
    if next_link:
        body["servers_links"] = next_link
    return request.json_response(200, body)


def _add_host_status(view: request.ViewContext, servers: list[compute_api.Server]) -> None:
    """From 2.16, each server's ``host_status`` for the callers the policy allows (admins)."""
    if not view.at_least("2.16"):
        return
    allowed = [s for s in servers if policy.check(view.ctx, "os_compute_api:servers:show:host_status", s.target)]
    by_cell: dict[str, set[str]] = {}
    for server in allowed:
        if server.cell and server.host:
            by_cell.setdefault(server.cell, set()).add(server.host)
    statuses = services.host_statuses(by_cell)
    for server in allowed:
        server.host_status = statuses.get((server.cell or "", server.host or ""), services.HOST_NONE)


@router.get("/servers")
def list_servers() -> Response:
    return _list(detail=False)


@router.get("/servers/detail")
def list_servers_detail() -> Response:
    return _list(detail=True)


def _groups(view: request.ViewContext, server: compute_api.Server | compute_api.UnknownServer) -> list[str]:
    """The server groups a single server's view names (from 2.71; not read before)."""
    return server_groups.groups_of(server.uuid) if view.at_least("2.71") else []


@router.get("/servers/<server_id>")
def show_server(server_id: str) -> Response:
    view = request.view_context(router)
    # From 2.69 a server whose cell does not answer is shown UNKNOWN (Nova's partial record).
    server = compute_api.show_server(view.ctx, server_id, unknown=view.at_least("2.69"))
    policy.enforce(view.ctx, "os_compute_api:servers:show", server.target)
    if isinstance(server, compute_api.UnknownServer):
        return request.json_response(200, {"server": views.unknown_server(view, server, detail=True, one=True,
                                                                          groups=_groups(view, server))})
    _add_host_status(view, [server])
    return request.json_response(200, {"server": views.server_detail(view, server, one=True,
                                                                     groups=_groups(view, server))})


# --- create ----------------------------------------------------------------------------------------


def _networks(server: dict[str, Any]) -> str | list[dict[str, Any]]:
    networks = server.get("networks", compute_api.NETWORKS_AUTO)
    if isinstance(networks, str):
        return networks
    wanted = []
    for item in networks:
        entry = {k: v for k, v in item.items() if k in ("uuid", "port", "fixed_ip", "tag") and v is not None}
        if "uuid" not in entry and "port" not in entry:
            raise errors.BadRequest("Each requested network needs a network uuid or a port.")
        if "port" in entry:
            entry.pop("uuid", None)
        wanted.append(entry)
    return wanted


def _user_data(value: str | None) -> str | None:
    """User data as sent, once it is known to be base64 as Nova checks it (characters outside the
    alphabet, such as line breaks, are skipped; the padding must be right).

    Raises:
        BadRequest: not base64.
    """
    if value is None:
        return None
    try:
        base64.b64decode(value)
    except (binascii.Error, ValueError) as exc:
        raise errors.BadRequest("User data needs to be valid base 64.") from exc
    return value


def _require_printable(server: dict[str, Any]) -> None:
    """A server's name and description, where given, as Nova takes them (see request.require_printable)."""
    request.require_printable(server, "server", "name")
    request.require_printable(server, "server", "description", text=True)


def boot_request(document: dict[str, Any], version: APIVersion) -> compute_api.BootRequest:
    """The domain's view of a create body already checked against the schema (at ``version``:
    below 2.19 a server's description is its name, as in Nova).

    Raises:
        BadRequest: ``min_count`` above ``max_count``.
    """
    server = document["server"]
    min_count = request.bounded_int("min_count", server.get("min_count", 1), 1, schemas.MAX_INT)
    max_count = request.bounded_int("max_count", server.get("max_count", min_count), 1, schemas.MAX_INT)
    if min_count > max_count:
        raise errors.BadRequest("min_count must be <= max_count")
    bdms = [{**bdm, "delete_on_termination": request.flag("delete_on_termination",
                                                   bdm.get("delete_on_termination", False))}
            for bdm in server.get("block_device_mapping_v2", [])]
    hints = document.get("os:scheduler_hints") or document.get("OS-SCH-HNT:scheduler_hints") or {}
    return compute_api.BootRequest(
        name=server["name"], flavor_ref=str(server["flavorRef"]), image_ref=server.get("imageRef") or None,
        description=server.get("description") if version.at_least("2.19") else server["name"],
        hostname=server.get("hostname"), user_data=_user_data(server.get("user_data")),
        reservation_id=instances.new_reservation_id(),
        networks=_networks(server), metadata=dict(server.get("metadata", {})), key_name=server.get("key_name"),
        availability_zone=server.get("availability_zone"), block_device_mapping=bdms,
        tags=list(server.get("tags", [])), scheduler_hints=dict(hints), requested_host=server.get("host"),
        requested_node=server.get("hypervisor_hostname"), min_count=min_count, max_count=max_count)


@router.post("/servers")
def create_server() -> Response:
    view = request.view_context(router)
    document = request.body(router, schemas.server_create(view.version))
    _require_printable(document["server"])
    policy.enforce(view.ctx, "os_compute_api:servers:create",
                   {"project_id": view.ctx.project_id, "user_id": view.ctx.user_id})
    boot = boot_request(document, view.version)
    server_id = compute_api.create_servers(view.ctx, boot)[0]  # of several, the first, as Nova answers
    requested = document["server"]
    if request.flag("return_reservation_id", requested.get("return_reservation_id", False)):
        return request.json_response(202, {"reservation_id": boot.reservation_id})
    body = {"server": {
        "id": server_id,
        "links": views.links(view, "servers", server_id),
        "adminPass": requested.get("adminPass") or secrets.token_urlsafe(9),
        "OS-DCF:diskConfig": requested.get("OS-DCF:diskConfig", "MANUAL"),
        "security_groups": requested.get("security_groups") or [{"name": "default"}],
    }}
    return request.json_response(202, body, headers={"Location": f"{view.api_url}/servers/{server_id}"})


@router.put("/servers/<server_id>")
def update_server(server_id: str) -> Response:
    """Rename a server, or change its description (2.19) or hostname (2.90); the server back, as
    ``GET`` shows it from 2.75, without the extensions' fields before (as Nova)."""
    view = request.view_context(router)
    body = request.body(router, schemas.server_update(view.version))["server"]
    _require_printable(body)
    location = compute_api.locate(view.ctx, server_id)
    policy.enforce(view.ctx, "os_compute_api:servers:update", location.target)
    changes = {k: v for k, v in body.items() if k in instances.UPDATABLE}
    server = compute_api.update_server(view.ctx, location, changes)
    if view.at_least("2.75"):
        _add_host_status(view, [server])
    return request.json_response(200, {"server": views.server_detail(
        view, server, one=True, groups=_groups(view, server), extended=view.at_least("2.75"))})


# --- delete and actions ----------------------------------------------------------------------------


@router.delete("/servers/<server_id>")
def delete_server(server_id: str) -> Response:
    ctx = request.caller(router)
    location = compute_api.locate(ctx, server_id)
    policy.enforce(ctx, "os_compute_api:servers:delete", location.target)
    compute_api.delete_server(ctx, location)
    return request.empty(204)


@router.post("/servers/<server_id>/action")
def server_action_request(server_id: str) -> Response:
    ctx = request.caller(router)
    document = request.body(router, schemas.SERVER_ACTION)
    name, value = next(iter(document.items()))
    action = ACTIONS.get(name)
    if action is None:
        raise errors.BadRequest(f"There is no such action: {name}")
    version = request.version(router)
    request.validate({name: value}, {"type": "object", "properties": {name: action.schema_at(version)}})
    location = compute_api.locate(ctx, server_id)
    return action.handler(ctx, location, value, version)


@server_action("os-stop", schemas.NULL_ACTION)
def stop(ctx: RequestContext, location: compute_api.Location, _value: Any, _version: APIVersion) -> Response:
    policy.enforce(ctx, "os_compute_api:servers:stop", location.target)
    compute_api.stop_server(ctx, location)
    return request.empty(202)


@server_action("os-start", schemas.NULL_ACTION)
def start(ctx: RequestContext, location: compute_api.Location, _value: Any, _version: APIVersion) -> Response:
    policy.enforce(ctx, "os_compute_api:servers:start", location.target)
    compute_api.start_server(ctx, location)
    return request.empty(202)


@server_action("os-resetState", schemas.RESET_STATE_ACTION)
def reset_state(ctx: RequestContext, location: compute_api.Location, value: dict[str, str],
                _version: APIVersion) -> Response:
    """202 (admins by default): the server takes vm_state ``active`` or ``error`` and loses its task,
    whatever its state, task or lock; 409 while it is still being scheduled."""
    policy.enforce(ctx, "os_compute_api:os-admin-actions:reset_state", location.target)
    admin_actions.reset_state(ctx, location, value["state"])
    return request.empty(202)


# --- instance actions ------------------------------------------------------------------------------


def _action_server(view: request.ViewContext, server_id: str) -> compute_api.Location:
    """The server whose actions are asked for; from 2.21 a deleted server's as well."""
    return compute_api.locate(view.ctx, server_id, read_deleted=view.at_least("2.21"))


# Query parameters of the action list, by the microversion they come with: from 2.58 Nova's
# schema refuses any other (before, every parameter is ignored).
ACTION_LIST_PARAMETERS: Mapping[str, str] = {
    "limit": "2.58", "marker": "2.58", "changes-since": "2.58", "changes-before": "2.66"}


@router.get("/servers/<server_id>/os-instance-actions")
def list_instance_actions(server_id: str) -> Response:
    view = request.view_context(router)
    params = request.query(router)
    # Paging and the time filters exist from 2.58 (changes-before from 2.66), as in Nova, whose
    # schema checks the query before the server is looked up.
    paged = view.at_least("2.58")
    if paged:
        request.refuse_unknown(params, ACTION_LIST_PARAMETERS, view.version)
    location = _action_server(view, server_id)
    policy.enforce(view.ctx, "os_compute_api:os-instance-actions:list", location.target)

    def last(name: str) -> str | None:
        return request.last(params, name)

    limit = compute_api.page_size(request.parse_limit(last("limit"))) if paged else None
    since, before = request.time_window(last("changes-since") if paged else None,
                                        last("changes-before") if view.at_least("2.66") else None)
    actions = compute_api.list_instance_actions(location, limit=limit, marker=last("marker") if paged else None,
                                                changes_since=since, changes_before=before)
    body: dict[str, Any] = {"instanceActions": [views.instance_action(view, a) for a in actions]}
    if limit is not None:
        links = views.next_link(view, f"servers/{server_id}/os-instance-actions", params,
                                [a["request_id"] for a in actions], limit)
        if links:
            body["links"] = links
    return request.json_response(200, body)


@router.get("/servers/<server_id>/os-instance-actions/<request_id>")
def show_instance_action(server_id: str, request_id: str) -> Response:
    view = request.view_context(router)
    location = _action_server(view, server_id)
    policy.enforce(view.ctx, "os_compute_api:os-instance-actions:show", location.target)
    action = compute_api.get_instance_action(location, request_id)
    body = views.instance_action(view, action)
    # Below 2.51 the events are shown only to callers the events policy allows (admins by default).
    if view.at_least("2.51") or policy.check(view.ctx, "os_compute_api:os-instance-actions:events",
                                             {"project_id": location.project_id}):
        body["events"] = views.instance_action_events(view, action["events"], location.project_id)
    return request.json_response(200, {"instanceAction": body})
