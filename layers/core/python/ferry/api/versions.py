"""Discovery documents clients read before anything else (no token needed)."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry.api import request
from ferry.api.microversions import MAX_VERSION, MIN_VERSION, VOLUME_VERSION

IDENTITY_VERSION = "v3.14"
# When v2.1 last changed its shape, as Nova names it (microversions came after).
V21_UPDATED = "2013-07-23T11:33:21Z"

router = Router()


def version_document(base_url: str) -> dict[str, Any]:
    """``GET /v2.1``: the versions served; the self link ends with a slash, as clients expect."""
    return {"version": {"id": "v2.1", "status": "CURRENT", "version": str(MAX_VERSION),
                        "min_version": str(MIN_VERSION), "updated": V21_UPDATED,
                        "links": [{"rel": "self", "href": f"{base_url}{request.API_PREFIX}/"}]}}


def identity_document(base_url: str) -> dict[str, Any]:
    """``GET /identity/v3``: enough of an identity version document for clients' discovery."""
    return {"version": {"id": IDENTITY_VERSION, "status": "stable",
                        "links": [{"rel": "self", "href": f"{base_url}/identity/v3"}]}}


def volume_document(base_url: str) -> dict[str, Any]:
    """``GET /volume/v3``: the Block Storage version served (the volume look-ups, at 3.0 only)."""
    return {"version": {"id": "v3.0", "status": "CURRENT", "version": str(VOLUME_VERSION),
                        "min_version": str(VOLUME_VERSION),
                        "links": [{"rel": "self", "href": f"{base_url}{request.VOLUME_PREFIX}"}]}}


@router.get("/")
def list_versions() -> dict[str, Any]:
    """``GET /``: the major versions served, for clients given the server's root (v2.1 only:
    Ferry serves no v2.0)."""
    return {"versions": [version_document(request.base_url(router))["version"]]}


@router.get(request.API_PREFIX)
def show_version() -> dict[str, Any]:
    return version_document(request.base_url(router))


@router.get("/identity/v3")
def show_identity_version() -> dict[str, Any]:
    return identity_document(request.base_url(router))


@router.get(request.VOLUME_PREFIX)
def show_volume_version() -> dict[str, Any]:
    return volume_document(request.base_url(router))
