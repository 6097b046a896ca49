"""Enough of the identity API's projects for clients that look a project up before acting on it.

Ferry has no identity service: a project is an id that a token stands for or that owns
servers, and its name is its id. ``openstack quota show/set P``, ``flavor create --project P``,
``flavor set --project P`` and ``server list --project P`` look ``P`` up here first, by id and
then by name. Admins see every project; a member only her own (another is 404, as if unknown).
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import auth, errors
from ferry.api import request

router = Router()

PREFIX = "/identity/v3/projects"


def _project(base_url: str, project_id: str) -> dict[str, Any]:
    return {"id": project_id, "name": project_id, "domain_id": "default", "parent_id": "default",
            "description": "", "enabled": True, "is_domain": False, "tags": [], "options": {},
            "links": {"self": f"{base_url}{PREFIX}/{project_id}"}}


def _visible(ctx: auth.RequestContext, projects: list[str]) -> list[str]:
    return projects if ctx.is_admin else [p for p in projects if p == ctx.project_id]


@router.get(f"{PREFIX}/<project_id>")
def show_project(project_id: str) -> Response:
    ctx = request.caller(router)
    if not _visible(ctx, auth.known_projects(project_id)):
        raise errors.NotFound(f"Could not find project: {project_id}.")
    return request.json_response(200, {"project": _project(request.base_url(router), project_id)})


@router.get(PREFIX)
def list_projects() -> Response:
    """``?name=`` (or ``?id=``) narrows the list to that project."""
    ctx = request.caller(router)
    params = request.query(router)
    wanted = request.last(params, "name") or request.last(params, "id")
    projects = _visible(ctx, auth.known_projects(wanted))
    base_url = request.base_url(router)
    return request.json_response(200, {"projects": [_project(base_url, p) for p in projects],
                                       "links": {"self": f"{base_url}{PREFIX}", "next": None, "previous": None}})
