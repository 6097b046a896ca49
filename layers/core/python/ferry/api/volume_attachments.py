"""``/servers/{id}/os-volume_attachments``: list, show, attach and detach volumes (Nova's shapes).

Attach answers 200 with the attachment (its device is chosen by Ferry, as Nova's libvirt driver
does) while the volume_attachment workflow attaches it on the host; detach answers 202. See
:mod:`ferry.workflows.volume_attachment` for what is checked and how concurrent requests are
refused. Volume swap (``PUT``) is not supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors, policy
from ferry.api import request, schemas
from ferry.api.microversions import APIVersion
from ferry.api.request import ViewContext
from ferry.compute import api as compute_api
from ferry.workflows import volume_attachment
from ferry.workflows.volume_attachment import Attachment

router = Router()

# Nova's device name pattern (the name itself is then ignored: Ferry picks the device).
_DEVICE = {"type": ["string", "null"], "pattern": "(^/dev/x{0,1}[a-z]{0,1}d{0,1})([a-z]+)[0-9]*$"}


def attach_schema(version: APIVersion) -> dict[str, Any]:
    """The body of ``POST /servers/{id}/os-volume_attachments`` at ``version`` (no extra keys)."""
    attachment: dict[str, Any] = {
        "type": "object",
        "properties": {"volumeId": schemas.UUID, "device": _DEVICE},
        "required": ["volumeId"],
        "additionalProperties": False,
    }
    if version.at_least("2.49"):
        attachment["properties"]["tag"] = schemas.TAG
    if version.at_least("2.79"):
        attachment["properties"]["delete_on_termination"] = {"type": "boolean"}
    return {"type": "object", "properties": {"volumeAttachment": attachment}, "required": ["volumeAttachment"],
            "additionalProperties": False}


def attachment_view(view: ViewContext, attachment: Attachment) -> dict[str, Any]:
    """An attachment as Nova lists and shows it at the request's microversion."""
    body: dict[str, Any] = {"device": attachment.device_path, "serverId": attachment.server_id,
                            "volumeId": attachment.volume_id}
    if not view.at_least("2.89"):
        body["id"] = attachment.volume_id
    if view.at_least("2.70"):
        body["tag"] = attachment.tag
    if view.at_least("2.79"):
        body["delete_on_termination"] = attachment.delete_on_termination
    if view.at_least("2.89"):
        body["attachment_id"] = attachment.attachment_id
        body["bdm_uuid"] = attachment.bdm_uuid
    return body


def created_view(view: ViewContext, attachment: Attachment) -> dict[str, Any]:
    """The attachment an attach answers with: Nova's create response keeps ``id`` and never
    shows ``attachment_id``/``bdm_uuid`` (only list and show change at 2.89)."""
    body: dict[str, Any] = {"id": attachment.volume_id, "device": attachment.device_path,
                            "serverId": attachment.server_id, "volumeId": attachment.volume_id}
    if view.at_least("2.70"):
        body["tag"] = attachment.tag
    if view.at_least("2.79"):
        body["delete_on_termination"] = attachment.delete_on_termination
    return body


def _volume_id(value: str) -> str:
    volume_id = compute_api.normalize_uuid(value)
    if volume_id is None:
        raise errors.VolumeNotAttached(f"Volume {value} is not attached to this server.")
    return volume_id


def _located(view_or_ctx: Any, server_id: str, kind: str) -> compute_api.Location:
    ctx = getattr(view_or_ctx, "ctx", view_or_ctx)
    location = compute_api.locate(ctx, server_id)
    policy.enforce(ctx, f"os_compute_api:os-volumes-attachments:{kind}", location.target)
    return location


# The list's query parameters (Nova's schema refuses any other from 2.75; before, others are ignored).
LIST_PARAMETERS: Mapping[str, str] = {"limit": "2.1", "offset": "2.1"}


@router.get("/servers/<server_id>/os-volume_attachments")
def list_volume_attachments(server_id: str) -> Response:
    """``limit`` and ``offset`` page as Nova's ``limited`` does: a limit of 0 or none is the
    largest page (1000)."""
    view = request.view_context(router)
    params = request.query(router)
    request.refuse_unknown_from_strict(params, LIST_PARAMETERS, view)
    limit = request.non_negative_int("limit", request.last(params, "limit"))
    offset = request.non_negative_int("offset", request.last(params, "offset")) or 0
    location = _located(view, server_id, "index")
    attachments = volume_attachment.list_attachments(location)
    page = attachments[offset:offset + compute_api.page_size(limit or None)]
    return request.json_response(200, {"volumeAttachments": [attachment_view(view, a) for a in page]})


@router.get("/servers/<server_id>/os-volume_attachments/<volume_id>")
def show_volume_attachment(server_id: str, volume_id: str) -> Response:
    view = request.view_context(router)
    location = _located(view, server_id, "show")
    attachment = volume_attachment.get_attachment(location, _volume_id(volume_id))
    return request.json_response(200, {"volumeAttachment": attachment_view(view, attachment)})


@router.post("/servers/<server_id>/os-volume_attachments")
def attach_volume(server_id: str) -> Response:
    view = request.view_context(router)
    document = request.body(router, attach_schema(view.version))
    location = _located(view, server_id, "create")
    wanted = document["volumeAttachment"]
    attachment = volume_attachment.begin_attach(
        view.ctx, location, str(compute_api.normalize_uuid(wanted["volumeId"])),
        delete_on_termination=bool(wanted.get("delete_on_termination", False)), tag=wanted.get("tag"))
    return request.json_response(200, {"volumeAttachment": created_view(view, attachment)})


@router.delete("/servers/<server_id>/os-volume_attachments/<volume_id>")
def detach_volume(server_id: str, volume_id: str) -> Response:
    ctx = request.caller(router)
    location = _located(ctx, server_id, "delete")
    volume_attachment.begin_detach(ctx, location, _volume_id(volume_id))
    return request.empty(202)
