"""Server actions that move a server: ``resize``, ``migrate``, ``confirmResize``, ``revertResize``.

Each action checks its policy against the server's project, calls :mod:`ferry.compute.moves`
and answers at once: the move itself runs in its workflow. A destination that cannot be
found is reported by the workflow (the action's event records NoValidHost and the server
stays where it was), never by the request.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response

from ferry import policy
from ferry.api import request, schemas
from ferry.api.microversions import APIVersion
from ferry.api.servers import server_action
from ferry.auth import RequestContext
from ferry.compute import moves
from ferry.compute.api import Location

TARGETED_MIGRATE_VERSION = "2.56"


def _target(location: Location) -> dict[str, Any]:
    return location.target


@server_action("resize", schemas.RESIZE_ACTION)
def resize(ctx: RequestContext, location: Location, value: dict[str, Any], _version: APIVersion) -> Response:
    """202; 400 bad flavor or disks, 403 policy or quota, 404, 409 state, lock or host down."""
    policy.enforce(ctx, "os_compute_api:servers:resize", _target(location))
    moves.begin_resize(ctx, location, str(value["flavorRef"]))
    return request.empty(202)


@server_action("migrate", schemas.MIGRATE_ACTION_ANY, later=(TARGETED_MIGRATE_VERSION, schemas.MIGRATE_ACTION_V256))
def migrate(ctx: RequestContext, location: Location, value: Any, version: APIVersion) -> Response:
    """202; ``host`` is read from 2.56 only; 400 unknown or same host. One rule decides, as in
    Nova: ``…:migrate:host`` when a host is named, else ``…:migrate``."""
    host = None
    if version.at_least(TARGETED_MIGRATE_VERSION):
        host = (value or {}).get("host")
    rule = "os_compute_api:os-migrate-server:migrate:host" if host else "os_compute_api:os-migrate-server:migrate"
    policy.enforce(ctx, rule, _target(location))
    moves.begin_migrate(ctx, location, host or None)
    return request.empty(202)


@server_action("confirmResize", schemas.NULL_ACTION)
def confirm_resize(ctx: RequestContext, location: Location, _value: Any, _version: APIVersion) -> Response:
    """204 (Nova answers confirm with no content); 400 not resized, 409 wrong state."""
    policy.enforce(ctx, "os_compute_api:servers:confirm_resize", _target(location))
    moves.confirm_resize(ctx, location)
    return request.empty(204)


@server_action("revertResize", schemas.NULL_ACTION)
def revert_resize(ctx: RequestContext, location: Location, _value: Any, _version: APIVersion) -> Response:
    """202; 400 not resized, 409 wrong state."""
    policy.enforce(ctx, "os_compute_api:servers:revert_resize", _target(location))
    moves.revert_resize(ctx, location)
    return request.empty(202)
