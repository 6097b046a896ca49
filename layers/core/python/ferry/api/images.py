"""``/v2.1/images``: the image look-ups clients make against the compute endpoint (Image v2 shapes)."""

from __future__ import annotations

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors
from ferry import images as image_store
from ferry.api import request

router = Router()


@router.get("/images")
def list_images() -> Response:
    ctx = request.caller(router)
    names = request.query(router).get("name")
    name = names[-1] if names else None
    shown = [image for image in image_store.list_images(name=name)
             if image_store.visible_to(image, ctx.project_id, is_admin=ctx.is_admin)]
    return request.json_response(200, {"images": shown})


@router.get("/images/<image_id>")
def show_image(image_id: str) -> Response:
    ctx = request.caller(router)
    image = image_store.get_image(image_id)
    if not image_store.visible_to(image, ctx.project_id, is_admin=ctx.is_admin):
        raise errors.ImageNotFound(f"Image {image_id} could not be found.")
    return request.json_response(200, image)
