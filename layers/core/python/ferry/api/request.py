"""What a route needs from the current API Gateway proxy event: caller, version, body, URLs.

``prepare`` runs as the resolver's middleware: it names the request (``req-<uuid>``),
negotiates the microversion of ``/v2.1`` (and ``/volume/v3``) requests and puts both in the resolver's
context, refuses a NUL character in the path or the query string, and stamps the response with the
request id and version headers.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import BaseRouter
from aws_lambda_powertools.metrics import MetricUnit

from ferry import auth, errors, validation
from ferry.api import schemas
from ferry.api.microversions import MIN_VERSION, VOLUME_SERVICE, APIVersion, negotiate, response_headers
from ferry.observability import logger, metrics

API_PREFIX = "/v2.1"
VOLUME_PREFIX = "/volume/v3"
REQUEST_ID_HEADERS = ("x-openstack-request-id", "x-compute-request-id")

_TRUE = frozenset({"1", "t", "true", "on", "y", "yes"})
_FALSE = frozenset({"0", "f", "false", "off", "n", "no"})


@dataclass(frozen=True)
class ViewContext:
    """What views need to render: who asks, at which version, and the base of links."""

    ctx: auth.RequestContext
    version: APIVersion
    base_url: str

    def at_least(self, version: str) -> bool:
        return self.version.at_least(version)

    @property
    def api_url(self) -> str:
        return self.base_url + API_PREFIX


def _request_context(router: BaseRouter) -> dict[str, Any]:
    return router.current_event.raw_event.get("requestContext") or {}


def _request_id(router: BaseRouter) -> str:
    aws_id = _request_context(router).get("requestId")
    try:
        return f"req-{uuid.UUID(aws_id)}"
    except (TypeError, ValueError, AttributeError):
        return auth.new_request_id()


def common_headers(context: dict[str, Any]) -> dict[str, str]:
    """Headers every response carries: the request id and, under /v2.1 and /volume/v3, the version used."""
    headers = {name: context["request_id"] for name in REQUEST_ID_HEADERS} if "request_id" in context else {}
    if "microversion" in context:
        headers.update(response_headers(context["microversion"]))
    if "volume_version" in context:
        headers.update(response_headers(context["volume_version"], VOLUME_SERVICE))
    return headers


def prepare(app: BaseRouter, next_middleware: Callable[[BaseRouter], Response]) -> Response:
    """Middleware: request id and microversion into the context, their headers onto the response.

    Raises:
        BadRequest / NotAcceptable: the requested microversion is malformed or unsupported.
    """
    request_id = _request_id(app)
    app.append_context(request_id=request_id)
    logger.append_keys(request_id=request_id)
    metrics.add_metric(name="ApiRequest", unit=MetricUnit.Count, value=1)
    path = app.current_event.path or ""
    if path == API_PREFIX or path.startswith(API_PREFIX + "/"):
        app.append_context(microversion=negotiate(app.current_event.headers))
    elif path == VOLUME_PREFIX or path.startswith(VOLUME_PREFIX + "/"):
        app.append_context(volume_version=negotiate(app.current_event.headers, VOLUME_SERVICE))
    refuse_nul(app)
    response = next_middleware(app)
    response.headers.update(common_headers(app.context))
    return response


NUL = "\x00"


def refuse_nul(router: BaseRouter) -> None:
    """Refuse a NUL character in the path (as the gateway passes it, percent-encoded or not, and
    its path parameters) or in a query parameter's name or value, before any route looks anything
    up: no id or filter holds one, and not every database takes one in a query.

    Raises:
        BadRequest: the path or a query parameter holds a NUL character.
    """
    event = router.current_event
    path = event.path or ""
    path_parameters = (event.raw_event.get("pathParameters") or {}).values()
    if NUL in unquote(path) or any(NUL in str(value) for value in path_parameters):
        raise errors.BadRequest("Invalid request path: it may not contain a NUL character.")
    for name, values in query(router).items():
        if NUL in name or any(NUL in value for value in values):
            shown = name.replace(NUL, "\\x00")
            raise errors.BadRequest(f"Invalid input for query parameters {shown}: "
                                    "a NUL character is not allowed.")


def caller(router: BaseRouter) -> auth.RequestContext:
    """The authenticated caller (from the authorizer's context).

    Raises:
        Unauthorized: the event carries no identity.
    """
    authorizer = _request_context(router).get("authorizer")
    return auth.context_from_authorizer(authorizer, request_id=router.context.get("request_id"))


def version(router: BaseRouter) -> APIVersion:
    """The microversion negotiated for this request."""
    return router.context.get("microversion", MIN_VERSION)


def base_url(router: BaseRouter) -> str:
    """``scheme://host[/stage]`` as the client reached the API (no trailing slash)."""
    headers = router.current_event.headers  # case-insensitive
    request_context = _request_context(router)
    scheme = (headers.get("x-forwarded-proto") or "https").split(",")[0].strip()
    host = headers.get("host") or request_context.get("domainName") or "localhost"
    stage = request_context.get("stage")
    # Through the execute-api domain the stage is part of the URL; through a custom domain it is not.
    prefix = f"/{stage}" if stage and stage != "$default" and (request_context.get("path") or "").startswith(
        f"/{stage}/") else ""
    return f"{scheme}://{host}{prefix}"


def view_context(router: BaseRouter) -> ViewContext:
    return ViewContext(ctx=caller(router), version=version(router), base_url=base_url(router))


def query(router: BaseRouter) -> dict[str, list[str]]:
    """The query string, every parameter as the list of its values."""
    event = router.current_event
    multi = event.multi_value_query_string_parameters or {}
    single = event.query_string_parameters or {}
    return {**{k: [v] for k, v in single.items()}, **{k: list(v) for k, v in multi.items()}}


def last(params: dict[str, list[str]], name: str) -> str | None:
    """The last value of query parameter ``name`` (Nova reads the last of repeated values)."""
    values = params.get(name)
    return values[-1] if values else None


def is_true(value: str) -> bool:
    """Whether a lenient boolean parameter is one of Nova's true spellings (anything else is
    false, never an error)."""
    return value.strip().lower() in _TRUE


def flag(name: str, value: Any) -> bool:
    """A body's boolean: a JSON boolean as it is, else one of the spellings :func:`parse_bool` takes."""
    return value if isinstance(value, bool) else parse_bool(name, str(value))


def parse_bool(name: str, value: str) -> bool:
    """A query parameter as a boolean (Nova's strict spellings).

    Raises:
        BadRequest: not a recognised boolean.
    """
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise errors.BadRequest(f"Invalid value '{value}' for {name}: expected a boolean.")


def bounded_int(name: str, value: int | str, minimum: int, maximum: int) -> int:
    """A body's integer field (a number or a string of digits, as the schema let through) within
    its bounds (the schema checks a number's, not a string's).

    Raises:
        BadRequest: out of bounds, in Nova's words.
    """
    number = int(value)
    if number < minimum:
        raise errors.BadRequest(f"Invalid input for field/attribute {name}. Value: {value}. "
                                f"{value} is less than the minimum of {minimum}")
    if number > maximum:
        raise errors.BadRequest(f"Invalid input for field/attribute {name}. Value: {value}. "
                                f"{value} is greater than the maximum of {maximum}")
    return number


def parse_timestamp(name: str, value: str | None) -> dt.datetime | None:
    """An ISO 8601 query parameter as naive UTC (None when absent).

    Raises:
        BadRequest: not a timestamp.
    """
    if value is None:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.strip().replace(" ", "+"))
        if parsed.tzinfo is not None:
            # A time near the ends of the calendar may have no UTC equivalent (OverflowError).
            parsed = parsed.astimezone(dt.UTC).replace(tzinfo=None)
    except (ValueError, OverflowError) as exc:
        raise errors.BadRequest(f"Invalid input for query parameters {name}. Value: {value}. "
                                f"'{value}' is not a 'date-time'") from exc
    return parsed


def time_window(since: str | None, before: str | None) -> tuple[dt.datetime | None, dt.datetime | None]:
    """``changes-since`` and ``changes-before`` (each None when not asked for) as naive UTC.

    Raises:
        BadRequest: either is not a timestamp, or the window ends before it starts.
    """
    changes_since = parse_timestamp("changes-since", since)
    changes_before = parse_timestamp("changes-before", before)
    if changes_since and changes_before and changes_since > changes_before:
        raise errors.BadRequest("The value of changes-since must be less than or equal to changes-before.")
    return changes_since, changes_before


def parse_limit(value: str | None) -> int | None:
    """The ``limit`` query parameter.

    Raises:
        BadRequest: not a non-negative integer.
    """
    if value is None:
        return None
    try:
        limit = int(value)
    except ValueError as exc:
        raise errors.BadRequest("limit param must be an integer") from exc
    if limit < 0:
        raise errors.BadRequest("limit param must be positive")
    return limit


def non_negative_int(name: str, value: str | None) -> int | None:
    """A query parameter Nova's schema takes as a non-negative integer (None when absent).

    Raises:
        BadRequest: not a string of digits, in the words of Nova's query schema.
    """
    if value is None:
        return None
    if not value.isascii() or not value.isdigit():
        raise errors.BadRequest(f"Invalid input for query parameters {name}. Value: {value}. "
                                f"'{value}' does not match '^[0-9]*$'")
    return int(value)


# From this microversion Nova's query schemas take no parameter they do not name (before, the
# others are ignored).
STRICT_QUERY = "2.75"


def refuse_unknown_from_strict(params: Mapping[str, Any], known: Mapping[str, str], view: ViewContext) -> None:
    """:func:`refuse_unknown` from :data:`STRICT_QUERY` on; nothing before it.

    Raises:
        BadRequest: see :func:`refuse_unknown`.
    """
    if view.at_least(STRICT_QUERY):
        refuse_unknown(params, known, view.version)


def refuse_unknown(params: Mapping[str, Any], known: Mapping[str, str], version: APIVersion) -> None:
    """Refuse a query naming a parameter ``version`` does not know, as Nova's query schemas without
    additional properties do.

    Params:
        known: every parameter taken, with the microversion it comes with.

    Raises:
        BadRequest: for the first such parameter by name.
    """
    for name in sorted(params):
        since = known.get(name)
        if since is None or not version.at_least(since):
            raise errors.BadRequest(f"Invalid input for query parameters {name}. "
                                    f"Additional properties are not allowed ('{name}' was unexpected)")


def fits_int_column(number: int) -> bool:
    """Whether ``number`` fits the databases' integer columns: an id beyond them names nothing
    stored (and cannot even be compared with one on every database)."""
    return validation.MIN_INT <= number <= validation.MAX_INT


def validate(document: Any, schema: dict[str, Any]) -> None:
    """Check ``document`` against a JSON schema.

    Raises:
        BadRequest: it does not match; the message names the field and what is wrong.
    """
    try:
        validation.check(document, schema)
    except validation.SchemaMismatch as error:
        raise invalid_input(error.where(), error.instance, error.message) from None


def require_printable(document: Mapping[str, Any], prefix: str, *fields: str, text: bool = False) -> None:
    """Check that each of ``fields`` of ``document`` (where given) is a name Nova takes (``text``:
    a description, where spaces may be anywhere), refused in Nova's words.

    Raises:
        BadRequest: a control, format or unassigned character, or (a name) whitespace at an end.
    """
    for field in fields:
        value = document.get(field)
        if not isinstance(value, str):
            continue
        if text and not schemas.is_printable_text(value):
            raise invalid_input(f"{prefix}/{field}", value, schemas.PRINTABLE_TEXT_RULE)
        if not text and not schemas.is_printable_name(value):
            raise errors.BadRequest(f"An invalid '{field}' value was provided. The {field} must be: "
                                    f"{schemas.PRINTABLE_NAME_RULE}")


def invalid_input(field: str, value: Any, reason: str) -> errors.BadRequest:
    """The error for a bad value, worded as Nova words it (``field`` empty for the whole body)."""
    shown = json.dumps(value, default=str)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    if field:
        return errors.BadRequest(f"Invalid input for field/attribute {field}. Value: {shown}. {reason}")
    return errors.BadRequest(f"Invalid input. {reason}")


def body(router: BaseRouter, schema: dict[str, Any]) -> Any:
    """The JSON body, checked against ``schema``.

    Raises:
        BadRequest: the body is not JSON or does not match.
    """
    try:
        raw = router.current_event.decoded_body
        document = json.loads(raw) if raw not in (None, "") else None
    except ValueError as exc:  # not UTF-8 (UnicodeDecodeError is a ValueError) or not JSON
        raise errors.BadRequest("Malformed request body") from exc
    validate(document, schema)
    return document


def empty(status_code: int) -> Response:
    """A response without a body (202 for accepted actions, 204 for deletes)."""
    return Response(status_code=status_code, content_type=None, body=None)


def json_response(status_code: int, document: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status_code=status_code, content_type="application/json", body=document, headers=headers)
