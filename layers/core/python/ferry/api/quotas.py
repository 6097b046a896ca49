"""``/os-quota-sets/{project_id}`` (+ ``/defaults``, ``/detail``) and ``/limits``.

Project-level quotas only: a ``user_id`` query parameter is not supported (400), since Ferry
keeps no per-user quotas.
"""

from __future__ import annotations

from collections.abc import Mapping

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import auth, errors, policy, quotas
from ferry.api import request, schemas, views
from ferry.api.request import ViewContext

router = Router()

# The query parameters of a quota set's show and detail, and of the limits (Nova's schemas refuse
# any other from 2.75; before, others are ignored).
QUOTA_SET_PARAMETERS: Mapping[str, str] = {"user_id": "2.1"}
LIMITS_PARAMETERS: Mapping[str, str] = {"tenant_id": "2.1"}


def _resources(view: ViewContext) -> list[str]:
    return views.quota_resources(view, quotas.RESOURCES, quotas.INJECTED_FILE_RESOURCES)


def _refuse_unknown(view: ViewContext, known: Mapping[str, str]) -> None:
    """Raises BadRequest for the first (by name) query parameter not in ``known``, from 2.75.

    Called before the policy, as Nova checks its query schema first.
    """
    request.refuse_unknown_from_strict(request.query(router), known, view)


def _valid_project(project_id: str) -> None:
    """Raises BadRequest for a project id no project can have (one the identity API would not
    find): its quotas would be written under it, and it would be listed as a project. A project
    a token was issued for before ids were narrowed keeps its quotas.

    Called after the policy, as Nova verifies the project with the identity service then.
    """
    if not auth.IDENTITY_ID.fullmatch(project_id) and not auth.list_tokens(project_id=project_id):
        raise errors.BadRequest(f"Project ID {project_id} is not a valid project.")


def _project_only() -> None:
    if request.query(router).get("user_id"):
        raise errors.BadRequest("Per-user quotas are not supported; quotas are set per project.")


def _usage(project_id: str) -> dict[str, int]:
    """What the project uses of the counted resources, its server groups included."""
    return {**quotas.usage(project_id), quotas.SERVER_GROUPS: quotas.server_groups_used(project_id)}


@router.get("/os-quota-sets/<project_id>")
def show_quota_set(project_id: str) -> Response:
    view = request.view_context(router)
    _refuse_unknown(view, QUOTA_SET_PARAMETERS)
    policy.enforce(view.ctx, "os_compute_api:os-quota-sets:show", {"project_id": project_id})
    _valid_project(project_id)
    _project_only()
    body = views.quota_set(view, quotas.limits(project_id), _resources(view), project_id)
    return request.json_response(200, {"quota_set": body})


@router.get("/os-quota-sets/<project_id>/detail")
def show_quota_set_detail(project_id: str) -> Response:
    view = request.view_context(router)
    _refuse_unknown(view, QUOTA_SET_PARAMETERS)
    policy.enforce(view.ctx, "os_compute_api:os-quota-sets:detail", {"project_id": project_id})
    _valid_project(project_id)
    _project_only()
    body = views.quota_set_detail(view, quotas.limits(project_id), _usage(project_id), _resources(view),
                                  project_id)
    return request.json_response(200, {"quota_set": body})


@router.get("/os-quota-sets/<project_id>/defaults")
def show_quota_defaults(project_id: str) -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, "os_compute_api:os-quota-sets:defaults", {"project_id": project_id})
    _valid_project(project_id)
    body = views.quota_set(view, quotas.defaults(), _resources(view), project_id)
    return request.json_response(200, {"quota_set": body})


@router.put("/os-quota-sets/<project_id>")
def update_quota_set(project_id: str) -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, "os_compute_api:os-quota-sets:update", {"project_id": project_id})
    _valid_project(project_id)
    _project_only()
    resources = _resources(view)
    wanted = dict(request.body(router, schemas.quota_set_update(resources))["quota_set"])
    force = wanted.pop("force", False)
    force = request.flag("force", force)
    values = quotas.update(project_id, {k: request.bounded_int(k, v, -1, schemas.MAX_INT) for k, v in wanted.items()},
                           force=force)
    return request.json_response(200, {"quota_set": views.quota_set(view, values, resources)})


@router.delete("/os-quota-sets/<project_id>")
def delete_quota_set(project_id: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "os_compute_api:os-quota-sets:delete", {"project_id": project_id})
    _valid_project(project_id)
    _project_only()  # else ``?user_id=`` would reset the whole project's overrides
    quotas.reset(project_id)
    return request.empty(202)


def _limits_project(view: ViewContext) -> str:
    """The project ``/limits`` is about: ``tenant_id`` when given (whichever project it names, as
    Nova checks ``os_compute_api:limits:other_project`` whenever it is), else the caller's.

    Raises:
        Forbidden: ``tenant_id`` is given and the caller may not use it.
    """
    params = request.query(router)
    if "tenant_id" not in params:
        return view.ctx.project_id
    project_id = request.last(params, "tenant_id") or ""
    policy.enforce(view.ctx, "os_compute_api:limits:other_project", {"project_id": project_id})
    return project_id


@router.get("/limits")
def show_limits() -> Response:
    view = request.view_context(router)
    _refuse_unknown(view, LIMITS_PARAMETERS)
    policy.enforce(view.ctx, "os_compute_api:limits")
    project_id = _limits_project(view)
    absolute = views.absolute_limits(view, quotas.limits(project_id), _usage(project_id))
    return request.json_response(200, {"limits": {"rate": [], "absolute": absolute}})
