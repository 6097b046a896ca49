"""``/v2.1/images``: the image look-ups clients make against the compute endpoint (Image v2 shapes)."""

from __future__ import annotations

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import images as image_store
from ferry.api import request

router = Router()


@router.get("/images")
def list_images() -> Response:
    request.caller(router)
    names = request.query(router).get("name")
    name = names[-1] if names else None
    return request.json_response(200, {"images": image_store.list_images(name=name)})


@router.get("/images/<image_id>")
def show_image(image_id: str) -> Response:
    request.caller(router)
    return request.json_response(200, image_store.get_image(image_id))
