"""``/volume/v3``: the Block Storage (Cinder v3) volume look-ups clients make, in Cinder's shapes.

Ferry has no Block Storage service; volumes are its own records (the root volumes it makes on
boot, and volumes an operator registers), attached through the compute API. The ``openstack``
CLI looks a volume up here before ``server add volume``, ``server remove volume`` and ``server
create --volume``, and ``volume list``/``volume show`` read from here. Only reading is served, at
version 3.0, under the project-less URLs (``/volume/v3/volumes``, not ``/v3/{project_id}/…``).

Listing is Cinder's: a member lists her project's volumes; an admin too, unless she asks for
``all_tenants`` (then every project's, or ``project_id``'s). ``name``, ``status``, ``bootable``
and ``metadata`` filter; other filters are refused (400) rather than ignored, so a list never
looks filtered when it is not. Newest first, paged with ``limit`` and ``marker`` (a volume id,
found whether or not it still passes the filters).

Every Ferry volume can be booted from, so every volume is ``bootable``. Ferry keeps no volume
metadata: a ``metadata`` filter naming any key matches nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router
from sqlalchemy.orm import Session

from ferry import errors, policy
from ferry import volumes as volume_store
from ferry.api import request, views
from ferry.auth import RequestContext
from ferry.compute import aggregates, instances
from ferry.compute import api as compute_api
from ferry.store.api_models import Volume, VolumeAttachment
from ferry.store.db import api_session

router = Router()

PREFIX = request.VOLUME_PREFIX
# Volumes have no type in Ferry; Cinder names its built-in default type so.
DEFAULT_VOLUME_TYPE = "__DEFAULT__"
# The query parameters a volume list understands; any other is refused.
_LIST_PARAMETERS = frozenset({"all_tenants", "project_id", "name", "status", "bootable", "metadata", "limit",
                              "marker"})


def _links(base_url: str, volume_id: str) -> list[dict[str, str]]:
    return [{"rel": "self", "href": f"{base_url}{PREFIX}/volumes/{volume_id}"},
            {"rel": "bookmark", "href": f"{base_url}/volume/volumes/{volume_id}"}]


def _attachments(ctx: RequestContext, volume: Volume, hosts: Mapping[str, str | None]) -> list[dict[str, Any]]:
    """The volume's attachments in place, one per server: the one on the server's host (during
    VERIFY_RESIZE the other host keeps one too, for a revert or for the source's clean-up, which
    Cinder does not show), else the newest. The host is shown to those who may see servers'
    hosts (admins), as in Cinder. ``hosts`` holds each server's host (:func:`_server_hosts`)."""
    chosen: dict[str, VolumeAttachment] = {}
    for attachment in sorted(volume.attachments, key=lambda a: (a.created_at, a.id)):
        if attachment.status != volume_store.ATTACHED:
            continue
        server = attachment.instance_uuid
        kept = chosen.get(server)
        if kept is None or kept.host != hosts.get(server):
            chosen[server] = attachment
    show_host = policy.check(ctx, "os_compute_api:os-extended-server-attributes", {"project_id": volume.project_id})
    return [{"id": volume.id, "attachment_id": a.id, "volume_id": volume.id, "server_id": a.instance_uuid,
             "host_name": a.host if show_host else None, "device": volume_store.device_path(a.device),
             "attached_at": views.isotime_micro(a.updated_at or a.created_at)}
            for a in chosen.values()]


def _server_hosts(volumes: Iterable[Volume]) -> dict[str, str | None]:
    """The host of each server the volumes are attached to, read in the servers' cells (one
    query per cell); call it once the API database is let go."""
    return instances.hosts_of(a.instance_uuid for v in volumes for a in v.attachments
                              if a.status == volume_store.ATTACHED)


def volume_view(ctx: RequestContext, base_url: str, volume: Volume, hosts: Mapping[str, str | None]) -> dict[str, Any]:
    """A volume as Cinder v3.0 shows it in ``GET /volumes/{id}`` and ``/volumes/detail``;
    ``hosts`` as :func:`_server_hosts` gives them."""
    body: dict[str, Any] = {
        "id": volume.id, "name": volume.name, "description": None, "status": volume.status, "size": volume.size_gb,
        "availability_zone": aggregates.DEFAULT_AVAILABILITY_ZONE, "volume_type": DEFAULT_VOLUME_TYPE,
        "bootable": "true", "encrypted": False, "multiattach": False,
        "metadata": {}, "snapshot_id": None, "source_volid": None, "consistencygroup_id": None,
        "replication_status": None, "user_id": None,
        "attachments": _attachments(ctx, volume, hosts),
        "created_at": views.isotime_micro(volume.created_at), "updated_at": views.isotime_micro(volume.updated_at),
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
    metadata = request.last(params, "metadata")
    limit = request.parse_limit(request.last(params, "limit"))
    marker = request.last(params, "marker")
    base_url = request.base_url(router)
    with api_session() as session:
        found = volume_store.listed(session, project_id=project_id, name=request.last(params, "name"),
                                    status=request.last(params, "status"))
        if (bootable is not None and not request.parse_bool("bootable", bootable)) or _names_metadata(metadata):
            found = []
        if marker is not None:
            found = _after(session, ctx, found, marker)
        page = found[:compute_api.page_size(limit)]
    # Rendered once the API database is let go: the servers' hosts are read in their cells.
    hosts = _server_hosts(page) if detail else {}
    items = [volume_view(ctx, base_url, v, hosts) if detail else _summary(base_url, v) for v in page]
    document: dict[str, Any] = {"volumes": items}
    more = views.next_link_at(f"{base_url}{PREFIX}/volumes{'/detail' if detail else ''}", params,
                              [v.id for v in page], compute_api.page_size(limit))
    if more:
        document["volumes_links"] = more
    return request.json_response(200, document)


def _after(session: Session, ctx: RequestContext, found: list[Volume], marker: str) -> list[Volume]:
    """The volumes of ``found`` (newest first) after ``marker``, which need not be among them
    (a volume that no longer passes the filters still marks its place).

    Raises:
        VolumeNotFound: no volume ``marker`` the caller may see.
    """
    ids = [v.id for v in found]
    if marker in ids:
        return found[ids.index(marker) + 1:]
    last = volume_store.visible(session, ctx, marker, missing=f"Marker {marker} could not be found.")
    return [v for v in found if (v.created_at, v.id) < (last.created_at, last.id)]


def _names_metadata(value: str | None) -> bool:
    """Whether a ``metadata`` filter names a key (``{}`` or none names none).

    Raises:
        BadRequest: not a JSON object.
    """
    if value is None:
        return False
    try:
        wanted = json.loads(value.replace("'", '"'))
    except ValueError:
        wanted = None
    if not isinstance(wanted, dict):
        raise errors.BadRequest(f"Invalid metadata filter {value}: must be a JSON object.")
    return bool(wanted)


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
    view = volume_view(ctx, request.base_url(router), volume, _server_hosts([volume]))
    return request.json_response(200, {"volume": view})
