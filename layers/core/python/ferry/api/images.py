"""``/v2.1/images``: the image look-ups clients make against the compute endpoint (Image v2 shapes)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors
from ferry import images as image_store
from ferry.api import request

router = Router()

# Glance's operator for "any of these" in a filter's value: ``id=in:<id>,<id>``.
IN_OPERATOR = "in:"
# The most ids one ``in:`` filter names: each is one look-up in the bucket, and a request must end
# well within API Gateway's 29 seconds.
MAX_IDS = 200


def _ids(value: str) -> list[str]:
    """The image ids an ``id`` filter names: one id, or ``in:`` and ids separated by commas
    (each may be quoted, as Glance allows).

    Raises:
        BadRequest: more than :data:`MAX_IDS` ids.
    """
    if not value.startswith(IN_OPERATOR):
        return [value]
    wanted = (part.strip().strip('"') for part in value[len(IN_OPERATOR):].split(","))
    ids = list(dict.fromkeys(image_id for image_id in wanted if image_id))
    if len(ids) > MAX_IDS:
        raise errors.BadRequest(f"An id filter names at most {MAX_IDS} images ({len(ids)} given).")
    return ids


def _by_id(image_ids: list[str]) -> list[dict[str, Any]]:
    """The images among ``image_ids`` that exist, oldest first as the list orders them (each is
    looked up alone: the bucket is not listed)."""
    found = []
    for image_id in image_ids:
        try:
            found.append(image_store.get_image(image_id))
        except errors.ImageNotFound:
            continue
    return sorted(found, key=lambda image: (image["created_at"] or "", image["id"]))


@router.get("/images")
def list_images() -> Response:
    """``?name=`` (exact) and ``?id=`` (``<id>`` or ``in:<id>,<id>``, as ``openstack server list``
    sends it) narrow the list; both together give the images matching both."""
    ctx = request.caller(router)
    params = request.query(router)
    name = request.last(params, "name")
    wanted = request.last(params, "id")
    candidates = image_store.list_images(name=name) if wanted is None else \
        [image for image in _by_id(_ids(wanted)) if name is None or image["name"] == name]
    shown = [image for image in candidates if image_store.visible_to(image, ctx.project_id, is_admin=ctx.is_admin)]
    return request.json_response(200, {"images": shown})


@router.get("/images/<image_id>")
def show_image(image_id: str) -> Response:
    ctx = request.caller(router)
    image = image_store.get_image(image_id)
    if not image_store.visible_to(image, ctx.project_id, is_admin=ctx.is_admin):
        raise errors.ImageNotFound(f"Image {image_id} could not be found.")
    return request.json_response(200, image)
