"""``/flavors``: list, show, create, update (description), delete, and extra specs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors, policy, validation
from ferry.api import request, schemas, views
from ferry.compute import api as compute_api

router = Router()

# The list's query parameters (Nova's schema refuses any other from 2.75; before, others are ignored).
LIST_PARAMETERS: Mapping[str, str] = dict.fromkeys(
    ("is_public", "minRam", "minDisk", "limit", "marker", "sort_key", "sort_dir"), "2.1")


def _is_public(value: str | None) -> bool | None:
    """Nova's ``is_public`` filter: absent means public only, ``none`` means all."""
    if value is None:
        return True
    if value.strip().lower() == "none":
        return None
    try:
        return request.parse_bool("is_public", value)
    except errors.BadRequest as exc:
        raise errors.BadRequest(f"Invalid is_public filter [{value}]") from exc


def _int_param(name: str, value: str | None) -> int | None:
    """``minDisk`` or ``minRam``: an integer (negative ones are taken, as Nova takes them) the
    databases can compare with a column.

    Raises:
        BadRequest: not an integer, or beyond an integer column.
    """
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError as exc:
        raise errors.BadRequest(f"Invalid {name} filter [{value}]") from exc
    return request.bounded_int(name, number, validation.MIN_INT, validation.MAX_INT)


def _rxtx_factor(value: float | str) -> float:
    """A new flavor's ``rxtx_factor`` (a number, or a string of digits the schema's bounds do not
    check), above 0 and at most what a database float column holds, as Nova bounds it.

    Raises:
        BadRequest: out of bounds.
    """
    factor = float(value)
    if not 0 < factor <= schemas.MAX_FLOAT:
        raise errors.BadRequest(f"Invalid input received: 'rxtx_factor' argument must be a float between 0 and "
                                f"{schemas.MAX_FLOAT:g}")
    return factor


def _list(detail: bool) -> Response:
    view = request.view_context(router)
    query = request.query(router)
    request.refuse_unknown_from_strict(query, LIST_PARAMETERS, view)
    params = {k: v[-1] for k, v in query.items() if v}
    limit = request.parse_limit(params.get("limit"))
    flavors = compute_api.list_flavors(
        view.ctx, is_public=_is_public(params.get("is_public")), min_disk=_int_param("minDisk", params.get("minDisk")),
        min_ram=_int_param("minRam", params.get("minRam")), limit=limit, marker=params.get("marker"),
        sort_key=params.get("sort_key") or "flavorid", sort_dir=params.get("sort_dir") or "asc")
    render = views.flavor_detail if detail else views.flavor_summary
    body: dict[str, Any] = {"flavors": [render(view, flavor) for flavor in flavors]}
    links = views.next_link(view, "flavors/detail" if detail else "flavors", query,
                            [f.flavorid for f in flavors], compute_api.page_size(limit))
    if links:
        body["flavors_links"] = links
    return request.json_response(200, body)


@router.get("/flavors")
def list_flavors() -> Response:
    return _list(detail=False)


@router.get("/flavors/detail")
def list_flavors_detail() -> Response:
    return _list(detail=True)


@router.get("/flavors/<flavor_id>")
def show_flavor(flavor_id: str) -> Response:
    view = request.view_context(router)
    flavor = compute_api.get_flavor(flavor_id, view.ctx)
    return request.json_response(200, {"flavor": views.flavor_detail(view, flavor)})


@router.post("/flavors")
def create_flavor() -> Response:
    view = request.view_context(router)
    policy.enforce(view.ctx, "os_compute_api:os-flavor-manage:create", policy.NO_PROJECT)
    flavor = request.body(router, schemas.flavor_create(view.version))["flavor"]
    request.require_printable(flavor, "flavor", "name")
    request.require_printable(flavor, "flavor", "description", text=True)
    is_public = flavor.get("os-flavor-access:is_public", True)
    def number(name: str, minimum: int, default: int | None = None) -> int:
        value = flavor.get(name, default)
        return request.bounded_int(name, value if value not in (None, "") else 0, minimum, schemas.MAX_INT)

    created = compute_api.create_flavor(
        name=flavor["name"], vcpus=number("vcpus", 1), memory_mb=number("ram", 1), root_gb=number("disk", 0),
        ephemeral_gb=number("OS-FLV-EXT-DATA:ephemeral", 0, 0), swap=number("swap", 0, 0),
        flavorid=None if flavor.get("id") is None else str(flavor["id"]),
        rxtx_factor=_rxtx_factor(flavor.get("rxtx_factor", 1.0)),
        is_public=is_public if isinstance(is_public, bool) else request.parse_bool("is_public", is_public),
        description=flavor.get("description"))
    return request.json_response(200, {"flavor": views.flavor_detail(view, created)})


@router.put("/flavors/<flavor_id>")
def update_flavor(flavor_id: str) -> Response:
    view = request.view_context(router)
    if not view.at_least("2.55"):
        raise errors.NotFound("The resource could not be found.")
    policy.enforce(view.ctx, "os_compute_api:os-flavor-manage:update", policy.NO_PROJECT)
    wanted = request.body(router, schemas.FLAVOR_UPDATE)["flavor"]
    request.require_printable(wanted, "flavor", "description", text=True)
    description = wanted["description"]
    updated = compute_api.update_flavor_description(flavor_id, description)
    return request.json_response(200, {"flavor": views.flavor_detail(view, updated)})


@router.delete("/flavors/<flavor_id>")
def delete_flavor(flavor_id: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "os_compute_api:os-flavor-manage:delete", policy.NO_PROJECT)
    compute_api.delete_flavor(flavor_id)
    return request.empty(202)


# --- extra specs -----------------------------------------------------------------------------------


def _spec_values(specs: dict[str, Any]) -> dict[str, str]:
    """Extra spec values as stored: every one a string (the schema lets numbers through too, and
    bounds strings only: :func:`ferry.compute.api.set_extra_specs` bounds a number written out)."""
    return {key: str(value) for key, value in specs.items()}


@router.get("/flavors/<flavor_id>/os-extra_specs")
def list_extra_specs(flavor_id: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "os_compute_api:os-flavor-extra-specs:index")
    return request.json_response(200, {"extra_specs": compute_api.get_extra_specs(flavor_id, ctx)})


@router.post("/flavors/<flavor_id>/os-extra_specs")
def create_extra_specs(flavor_id: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "os_compute_api:os-flavor-extra-specs:create", policy.NO_PROJECT)
    specs = _spec_values(request.body(router, schemas.EXTRA_SPECS_CREATE)["extra_specs"])
    compute_api.set_extra_specs(flavor_id, specs)
    return request.json_response(200, {"extra_specs": specs})


@router.get("/flavors/<flavor_id>/os-extra_specs/<key>")
def show_extra_spec(flavor_id: str, key: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "os_compute_api:os-flavor-extra-specs:show")
    specs = compute_api.get_extra_specs(flavor_id, ctx)
    if key not in specs:
        raise errors.NotFound(f"Flavor {flavor_id} has no extra specs with key {key}.")
    return request.json_response(200, {key: specs[key]})


@router.put("/flavors/<flavor_id>/os-extra_specs/<key>")
def update_extra_spec(flavor_id: str, key: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "os_compute_api:os-flavor-extra-specs:update", policy.NO_PROJECT)
    spec = _spec_values(request.body(router, schemas.EXTRA_SPEC_UPDATE))
    if key not in spec:
        raise errors.BadRequest("Request body and URI mismatch")
    compute_api.set_extra_specs(flavor_id, spec)
    return request.json_response(200, spec)


@router.delete("/flavors/<flavor_id>/os-extra_specs/<key>")
def delete_extra_spec(flavor_id: str, key: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "os_compute_api:os-flavor-extra-specs:delete", policy.NO_PROJECT)
    compute_api.delete_extra_spec(flavor_id, key)
    return request.empty(200)


# --- flavor access ---------------------------------------------------------------------------------


def _access(flavor_id: str, projects: list[str]) -> Response:
    return request.json_response(200, {"flavor_access": [{"flavor_id": flavor_id, "tenant_id": project}
                                                         for project in projects]})


@router.get("/flavors/<flavor_id>/os-flavor-access")
def list_flavor_access(flavor_id: str) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "os_compute_api:os-flavor-access", policy.NO_PROJECT)
    return _access(flavor_id, compute_api.flavor_projects(flavor_id))


@router.post("/flavors/<flavor_id>/action")
def flavor_action(flavor_id: str) -> Response:
    """``addTenantAccess`` / ``removeTenantAccess`` ``{"tenant": <project id>}``.

    Access to a public flavor is refused (409) from 2.7; below, it is recorded, as Nova does.
    """
    view = request.view_context(router)
    ctx = view.ctx
    body = request.body(router, schemas.FLAVOR_ACTION)
    if "addTenantAccess" in body:
        policy.enforce(ctx, "os_compute_api:os-flavor-access:add_tenant_access", policy.NO_PROJECT)
        return _access(flavor_id, compute_api.add_flavor_access(flavor_id, body["addTenantAccess"]["tenant"],
                                                                refuse_public=view.at_least("2.7")))
    policy.enforce(ctx, "os_compute_api:os-flavor-access:remove_tenant_access", policy.NO_PROJECT)
    return _access(flavor_id, compute_api.remove_flavor_access(flavor_id, body["removeTenantAccess"]["tenant"]))
