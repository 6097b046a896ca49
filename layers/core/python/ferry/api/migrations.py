"""``/os-migrations`` (admins) and ``/servers/{id}/migrations`` (in-progress live migrations).

``GET /os-migrations`` lists the migrations of every cell: filters ``host`` (source or
destination), ``status`` (repeatable), ``migration_type``, ``instance_uuid``,
``source_compute``; from 2.59 newest first with ``limit``/``marker``/``changes-since``
(``changes-before`` from 2.66); ``user_id``/``project_id`` filters from 2.80. Fields follow
the microversion (``migration_type`` 2.23, ``uuid`` 2.59, ``user_id``/``project_id`` 2.80).
As in Nova, from 2.59 a query parameter the microversion does not know is refused (400);
before 2.59 it is ignored. ``hidden`` is taken and changes nothing: cross-cell copies are
merged by uuid.

Ferry has no live migration, so a server's in-progress live migrations are always none, and
aborting or forcing one to complete is refused (409) as Nova refuses it for a server whose task
is not ``migrating``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors, policy
from ferry.api import request, schemas, views
from ferry.api.request import ViewContext
from ferry.compute import api as compute_api
from ferry.compute import moves

router = Router()

MAX_LIMIT = 1000

# Query parameters known from 2.59 (Nova's schemas refuse any other from then on), by the
# microversion they come with.
PARAMETERS: Mapping[str, str] = {
    **{name: "2.59" for name in ("hidden", "host", "instance_uuid", "source_compute", "status", "migration_type",
                                 "limit", "marker", "changes-since")},
    "changes-before": "2.66",
    "user_id": "2.80",
    "project_id": "2.80",
}


def _refuse_unknown(view: ViewContext, params: dict[str, list[str]]) -> None:
    """Raises BadRequest for the first (by name) parameter the microversion does not know, from 2.59."""
    if view.at_least("2.59"):
        request.refuse_unknown(params, PARAMETERS, view.version)


def _filters(view: ViewContext, params: dict[str, list[str]]) -> moves.MigrationFilters:
    def last(name: str) -> str | None:
        return request.last(params, name)

    changes_since, changes_before = request.time_window(last("changes-since") if view.at_least("2.59") else None,
                                                        last("changes-before") if view.at_least("2.66") else None)
    by_owner = view.at_least("2.80")
    return moves.MigrationFilters(
        host=last("host"), statuses=tuple(params["status"]) if params.get("status") else None,
        migration_type=last("migration_type"), instance_uuid=last("instance_uuid"),
        source_compute=last("source_compute"), user_id=last("user_id") if by_owner else None,
        project_id=last("project_id") if by_owner else None, changes_since=changes_since,
        changes_before=changes_before)


@router.get("/os-migrations")
def list_migrations() -> Response:
    view = request.view_context(router)
    params = request.query(router)
    _refuse_unknown(view, params)  # the query is checked before the policy, as Nova checks its schema first
    policy.enforce(view.ctx, "os_compute_api:os-migrations:index", policy.NO_PROJECT)
    filters = _filters(view, params)
    paged = view.at_least("2.59")
    limit = marker = None
    if paged:
        requested = request.parse_limit(params["limit"][-1]) if params.get("limit") else None
        limit = MAX_LIMIT if requested is None else min(requested, MAX_LIMIT)
        marker = params["marker"][-1] if params.get("marker") else None
    found = moves.list_migrations(filters, newest_first=paged, limit=limit, marker=marker)
    body: dict[str, Any] = {"migrations": [views.migration(view, m) for m in found]}
    if paged and limit is not None:
        links = views.next_link(view, "os-migrations", params, [m["uuid"] for m in found], limit)
        if links:
            body["migrations_links"] = links
    return request.json_response(200, body)


def _server_migrations_supported(view: ViewContext, since: str = "2.23") -> None:
    if not view.at_least(since):
        raise errors.NotFound("The resource could not be found.")


@router.get("/servers/<server_id>/migrations")
def list_server_migrations(server_id: str) -> Response:
    view = request.view_context(router)
    _server_migrations_supported(view)
    location = compute_api.locate(view.ctx, server_id)
    policy.enforce(view.ctx, "os_compute_api:servers:migrations:index", location.target)
    return request.json_response(200, {"migrations": []})


@router.get("/servers/<server_id>/migrations/<migration_id>")
def show_server_migration(server_id: str, migration_id: str) -> Response:
    view = request.view_context(router)
    _server_migrations_supported(view)
    location = compute_api.locate(view.ctx, server_id)
    policy.enforce(view.ctx, "os_compute_api:servers:migrations:show", location.target)
    raise errors.NotFound(f"In-progress live migration {migration_id} is not found for server "
                          f"{location.instance_uuid}.")


@router.delete("/servers/<server_id>/migrations/<migration_id>")
def abort_server_migration(server_id: str, migration_id: str) -> Response:
    """Abort a live migration (2.24): always 409, as Nova answers for a server not migrating live."""
    view = request.view_context(router)
    _server_migrations_supported(view, "2.24")
    location = compute_api.locate(view.ctx, server_id)
    policy.enforce(view.ctx, "os_compute_api:servers:migrations:delete", location.target)
    compute_api.refuse_live_migration_action(view.ctx, server_id, "abort live migration")


@router.post("/servers/<server_id>/migrations/<migration_id>/action")
def force_complete_server_migration(server_id: str, migration_id: str) -> Response:
    """Force a live migration to complete (2.22): always 409, as Nova answers for a server not migrating live."""
    view = request.view_context(router)
    _server_migrations_supported(view, "2.22")
    request.body(router, schemas.FORCE_COMPLETE_ACTION)
    location = compute_api.locate(view.ctx, server_id)
    policy.enforce(view.ctx, "os_compute_api:servers:migrations:force_complete", location.target)
    compute_api.refuse_live_migration_action(view.ctx, server_id, "force_complete")
