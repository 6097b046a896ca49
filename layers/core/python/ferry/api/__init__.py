"""The compute API (Nova v2.1 with microversions) on Powertools' ``APIGatewayRestResolver``.

Routes parse the request, enforce policy, call :mod:`ferry.compute.api` and render. Every
error leaves through :func:`fault_response` as Nova's ``{"<kind>": {"code", "message"}}``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from aws_lambda_powertools.event_handler import APIGatewayRestResolver, Response
from aws_lambda_powertools.event_handler.exceptions import NotFoundError
from aws_lambda_powertools.metrics import MetricUnit

from ferry import errors
from ferry.api import (
    aggregates,
    block_storage,
    domains,
    drains,
    flavors,
    images,
    migrations,
    moves,
    openapi,
    projects,
    quotas,
    request,
    server_groups,
    servers,
    services,
    users,
    versions,
    volume_attachments,
)
from ferry.observability import logger, metrics
from ferry.store import db

# Server actions register themselves with ``servers.server_action`` when their module is imported.
_ACTION_MODULES = (moves,)


def fault_response(exc: Exception, context: dict[str, Any]) -> Response:
    """The API's answer to an exception: typed errors keep their status, kind and message, but
    for a 500 (an error of the deployment: a policy file, a setting, a workflow not configured)
    and anything else, which is a 500 ``computeFault`` whose message names only the request id:
    what went wrong stays in the log, where the operator finds it by that id. A database that
    does not answer for the moment (:func:`ferry.store.db.transient`: a cell down, a lock not
    had in time) is a 503 saying so, which the caller may try again."""
    request_id = context.get("request_id", "unknown")
    unavailable = db.unavailable(exc, request_id)
    if isinstance(exc, NotFoundError):
        status, kind, message = 404, errors.NotFound.api_kind, "The resource could not be found."
    elif unavailable is not None:
        status, kind, message = unavailable.http_status, unavailable.api_kind, unavailable.message
    elif isinstance(exc, errors.FerryError) and exc.http_status != 500:
        status, kind, message = exc.http_status, exc.api_kind, exc.message
    else:
        status, kind = 500, errors.FerryError.api_kind
        message = f"Unexpected API Error. Please report it to the operator with the request id {request_id}."
    if status >= 500:
        metrics.add_metric(name="ApiFault", unit=MetricUnit.Count, value=1)
        logger.error("request failed", exc_info=exc, extra={"status": status, "error": type(exc).__name__})
    else:
        logger.info("request refused", extra={"status": status, "error": type(exc).__name__, "reason": message})
    return Response(status_code=status, content_type="application/json",
                    body={kind: {"code": status, "message": message}}, headers=request.common_headers(context))


@cache
def get_resolver() -> APIGatewayRestResolver:
    """The process's resolver with every route (one per process: routers are module-level)."""
    app = APIGatewayRestResolver()
    app.use(middlewares=[request.prepare])
    app.include_router(versions.router)
    app.include_router(openapi.router)
    app.include_router(projects.router)
    app.include_router(users.router)
    app.include_router(domains.router)
    app.include_router(block_storage.router)
    for module in (servers, flavors, images, migrations, quotas, volume_attachments, aggregates, services,
                   server_groups, drains):
        app.include_router(module.router, prefix=request.API_PREFIX)

    @app.exception_handler(Exception)
    def handle_error(exc: Exception) -> Response:
        return fault_response(exc, app.context)

    return app
