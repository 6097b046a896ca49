"""``/volume/v3``: the Block Storage (Cinder v3) volume look-ups clients make, in Cinder's shapes.

Ferry has no Block Storage service; volumes are its own records (the root volumes it makes on
boot, and volumes an operator registers), attached through the compute API. The ``openstack``
CLI looks a volume up here before ``server add volume``, ``server remove volume`` and ``server
create --volume``, and ``volume list``/``volume show`` read from here. Only reading is served, at
version 3.0, under the project-less URLs (``/volume/v3/volumes``, not ``/v3/{project_id}/…``).

Listing is Cinder's: a member lists her project's volumes; an admin too, unless she asks for
``all_tenants`` (then every project's, or ``project_id``'s). ``name``, ``status`` and
``bootable`` filter; other filters are refused (400) rather than ignored, so a list never looks
filtered when it is not. Newest first, paged with ``limit`` and ``marker`` (a volume id).
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors, policy
from ferry import volumes as volume_store
from ferry.api import request, views
from ferry.auth import RequestContext
from ferry.compute import aggregates
from ferry.compute import api as compute_api
from ferry.store.api_models import Volume
from ferry.store.db import api_session

router = Router()

PREFIX = request.VOLUME_PREFIX
# Volumes have no type in Ferry; Cinder names its built-in default type so.
DEFAULT_VOLUME_TYPE = "__DEFAULT__"
# The query parameters a volume list understands; any other is refused.
_LIST_PARAMETERS = frozenset({"all_tenants", "project_id", "name", "status", "bootable", "limit", "marker"})


def _links(base_url: str, volume_id: str) -> list[dict[str, str]]:
    return [{"rel": "self", "href": f"{base_url}{PREFIX}/volumes/{volume_id}"},
            {"rel": "bookmark", "href": f"{base_url}/volume/volumes/{volume_id}"}]


def _attachments(volume: Volume) -> list[dict[str, Any]]:
    """The volume's attachments that are in place, one per host (a server in VERIFY_RESIZE has
    its volume attached on both hosts, as in Cinder during a Nova resize)."""
    return [{"id": volume.id, "attachment_id": a.id, "volume_id": volume.id, "server_id": a.instance_uuid,
             "host_name": a.host, "device": volume_store.device_path(a.device),
             "attached_at": views.isotime(a.updated_at or a.created_at)}
            for a in sorted(volume.attachments, key=lambda a: (a.created_at, a.id))
            if a.status == volume_store.ATTACHED]


def volume_view(ctx: RequestContext, base_url: str, volume: Volume) -> dict[str, Any]:
    """A volume as Cinder v3.0 shows it in ``GET /volumes/{id}`` and ``/volumes/detail``."""
    body: dict[str, Any] = {
        "id": volume.id, "name": volume.name, "description": None, "status": volume.status, "size": volume.size_gb,
        "availability_zone": aggregates.DEFAULT_AVAILABILITY_ZONE, "volume_type": DEFAULT_VOLUME_TYPE,
        "bootable": "true" if volume.image_id else "false", "encrypted": False, "multiattach": False,
        "metadata": {}, "snapshot_id": None, "source_volid": None, "consistencygroup_id": None,
        "replication_status": None, "user_id": None, "attachments": _attachments(volume),
        "created_at": views.isotime(volume.created_at), "updated_at": views.isotime(volume.updated_at),
        "links": _links(base_url, volume.id),
    }
    if volume.image_id:
        body["volume_image_metadata"] = {"image_id": volume.image_id}
    if policy.check(ctx, "volume_extension:volume_tenant_attribute", {"project_id": volume.project_id}):
        body["os-vol-tenant-attr:tenant_id"] = volume.project_id
    return body


def _summary(base_url: str, volume: Volume) -> dict[str, Any]:
    return {"id": volume.id, "name": volume.name, "links": _links(base_url, volume.id)}


def _list(detail: bool) -> Response:
    ctx = request.caller(router)
    policy.enforce(ctx, "volume:get_all", {"project_id": ctx.project_id})
    params = request.query(router)
    unknown = sorted(set(params) - _LIST_PARAMETERS)
    if unknown:
        raise errors.BadRequest(f"Invalid filters {', '.join(unknown)} are found in query options.")
    every_project = ctx.is_admin and request.parse_bool("all_tenants", request.last(params, "all_tenants") or "0")
    project_id = request.last(params, "project_id") if every_project else ctx.project_id
    bootable = request.last(params, "bootable")
    limit = request.parse_limit(request.last(params, "limit"))
    marker = request.last(params, "marker")
    base_url = request.base_url(router)
    with api_session() as session:
        found = volume_store.listed(session, project_id=project_id, name=request.last(params, "name"),
                                    status=request.last(params, "status"),
                                    bootable=None if bootable is None else request.parse_bool("bootable", bootable))
        after = compute_api.after_marker(found, marker, key=lambda v: v.id,
                                         missing=f"Marker {marker} could not be found.", error=errors.NotFound)
        page = after[:compute_api.page_size(limit)]
        items = [volume_view(ctx, base_url, v) if detail else _summary(base_url, v) for v in page]
    document: dict[str, Any] = {"volumes": items}
    more = views.next_link_at(f"{base_url}{PREFIX}/volumes{'/detail' if detail else ''}", params,
                              [v.id for v in page], compute_api.page_size(limit))
    if more:
        document["volumes_links"] = more
    return request.json_response(200, document)


@router.get(f"{PREFIX}/volumes")
def list_volumes() -> Response:
    return _list(detail=False)


@router.get(f"{PREFIX}/volumes/detail")
def list_volumes_detail() -> Response:
    return _list(detail=True)


@router.get(f"{PREFIX}/volumes/<volume_id>")
def show_volume(volume_id: str) -> Response:
    ctx = request.caller(router)
    with api_session() as session:
        volume = volume_store.visible(session, ctx, volume_id)
        policy.enforce(ctx, "volume:get", {"project_id": volume.project_id})
        return request.json_response(200, {"volume": volume_view(ctx, request.base_url(router), volume)})
