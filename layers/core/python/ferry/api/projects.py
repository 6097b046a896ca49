"""Enough of the identity API's projects for clients that look a project up before acting on it.

Ferry has no identity service: a project is an id, and its name is its id. ``openstack quota
show/set P``, ``flavor create --project P``, ``flavor set --project P`` and ``server list
--project P`` look ``P`` up here first, by id and then by name. To an admin every well-formed id
is a project (one that has nothing yet, about to get a quota or a flavor, included), and the list
holds the projects Ferry knows (:func:`ferry.auth.known_projects`). A member sees her own project
only: another is 404, as if unknown.
"""

from __future__ import annotations

import re
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import auth, errors
from ferry.api import request, schemas

router = Router()

PREFIX = "/identity/v3/projects"
PROJECT_ID = re.compile(schemas.PROJECT_ID_PATTERN)


def _project(base_url: str, project_id: str) -> dict[str, Any]:
    return {"id": project_id, "name": project_id, "domain_id": "default", "parent_id": "default",
            "description": "", "enabled": True, "is_domain": False, "tags": [], "options": {},
            "links": {"self": f"{base_url}{PREFIX}/{project_id}"}}


def _visible(ctx: auth.RequestContext, project_id: str | None) -> list[str]:
    """The projects the caller may see: all Ferry knows, or only ``project_id`` (for an admin,
    any well-formed id; for a member, her own)."""
    if not ctx.is_admin:
        own = ctx.project_id
        return [own] if own and project_id in (None, own) else []
    if project_id is None:
        return auth.known_projects()
    return [project_id] if PROJECT_ID.match(project_id) else []


@router.get(f"{PREFIX}/<project_id>")
def show_project(project_id: str) -> Response:
    ctx = request.caller(router)
    if not _visible(ctx, project_id):
        raise errors.NotFound(f"Could not find project: {project_id}.")
    return request.json_response(200, {"project": _project(request.base_url(router), project_id)})


@router.get(PREFIX)
def list_projects() -> Response:
    """``?name=`` (or ``?id=``) narrows the list to that project."""
    ctx = request.caller(router)
    params = request.query(router)
    projects = _visible(ctx, request.last(params, "name") or request.last(params, "id"))
    base_url = request.base_url(router)
    return request.json_response(200, {"projects": [_project(base_url, p) for p in projects],
                                       "links": {"self": f"{base_url}{PREFIX}", "next": None, "previous": None}})
