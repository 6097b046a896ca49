"""API Gateway (REST, Lambda proxy integration, Lambda authorizers) for the local stack.

Requests are matched against the template's ``Api`` events (``{name}`` and ``{proxy+}``
templates; literal paths beat parameters, parameters beat greedy ``{proxy+}``, a method beats
``ANY``). A route with an authorizer first gets the authorizer's decision; then the route's
function receives the REST proxy event (payload version 1.0) and its response is written back.
Clients call the paths as the template declares them (``/v2.1/...``), as through a custom
domain: there is no stage prefix.

Authorizer decisions are not cached (the template's ``ReauthorizeEvery: 0``; other values are
ignored locally). Answers follow API Gateway: an unknown route is 403 ``Missing Authentication
Token``, a missing identity source or ``Unauthorized`` from the authorizer 401, a policy that
does not allow the call 403, an authorizer or integration that fails 500 / 502, a request over
the stage's throttle (``MethodSettings`` for ``/*`` and ``*``: rate and burst, one token bucket)
429; the API's ``GatewayResponses`` replace the answers API Gateway gives itself, as they do on AWS.
A function's response that is not a valid Lambda proxy response (no integer ``statusCode``, a
``body`` that is not a string, ...) is 502, as on AWS.

``stop()`` also closes the keep-alive connections still open: a pooled client connection gets
no answer from a stopped gateway, whose process may no longer point at the local AWS.
"""

from __future__ import annotations

import base64
import datetime as dt
import fnmatch
import hashlib
import json
import logging
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ferry.local.runtime import FunctionRunner, port_taken
from ferry.local.template import Authorizer, LocalTemplate, Route

log = logging.getLogger("ferry-local")

_PARAMETER = re.compile(r"\{([^}/]+?)(\+?)\}")
# How long stop() waits for the connections' handlers once their sockets are shut down.
STOP_TIMEOUT = 5.0


@dataclass(frozen=True)
class _CompiledRoute:
    route: Route
    pattern: re.Pattern[str]
    rank: tuple[int, int, int]


def _compile(route: Route) -> _CompiledRoute:
    regex, position, greedy = "", 0, 0
    for match in _PARAMETER.finditer(route.path):
        regex += re.escape(route.path[position : match.start()])
        name, plus = match.group(1), match.group(2)
        regex += f"(?P<{name}>.+)" if plus else f"(?P<{name}>[^/]+)"
        greedy += bool(plus)
        position = match.end()
    regex += re.escape(route.path[position:])
    literal_segments = sum(1 for part in route.path.split("/") if part and "{" not in part)
    # Most specific first: no greedy parameter, more literal segments, a method rather than ANY.
    rank = (greedy, -literal_segments, int(route.method == "ANY"))
    return _CompiledRoute(route, re.compile(f"^{regex}$"), rank)


@dataclass(frozen=True)
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


def _json_response(status: int, document: Any, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(status, [("Content-Type", "application/json"), *(headers or [])], json.dumps(document).encode())


class _TokenBucket:
    """API Gateway's throttle: ``burst`` requests at once, refilled at ``rate`` per second."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.capacity = rate, float(burst)
        self.tokens, self.stamp = float(burst), time.monotonic()
        self.lock = threading.Lock()

    def take(self) -> bool:
        """Whether a request may pass now (it takes a token)."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens < 1:
                return False
            self.tokens -= 1
            return True


class _Server(ThreadingHTTPServer):
    """An HTTP server that knows its open connections, so that stopping closes them too.

    A ``ThreadingHTTPServer`` stops accepting on ``shutdown()``, but each keep-alive connection
    is served by its own thread until the client closes it.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 stopping: threading.Event) -> None:
        super().__init__(address, handler)
        self.stopping = stopping
        self._open: dict[socket.socket, threading.Thread] = {}
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve a new connection on a thread of its own, remembered until the connection closes."""
        if self.stopping.is_set():
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name="api-connection", daemon=True)
        with self._open_lock:
            self._open[request] = thread
        thread.start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.pop(request, None)

    def close_connections(self, timeout: float) -> None:
        """Shut every open connection down (its handler's next read or write fails), then wait up to
        ``timeout`` seconds for their handlers to end."""
        with self._open_lock:
            open_now = dict(self._open)
        for connection in open_now:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the client closed it already
        deadline = time.monotonic() + timeout
        for thread in open_now.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        left = sum(thread.is_alive() for thread in open_now.values())
        if left:
            log.warning("%d API connection(s) still being served %.0f s after the gateway stopped", left, timeout)


class ApiGateway:
    """The template's REST API on ``host:port``, calling handlers through ``runner``.

    Args:
        model: the resolved template (routes, authorizers, stage, region, account).
        runner: runs the functions' handlers.
        host, port: where to listen (port 0 picks a free one).
        api: the logical id of the API to serve (default: the only one with routes).
    """

    def __init__(
        self,
        model: LocalTemplate,
        runner: FunctionRunner,
        *,
        host: str = "127.0.0.1",
        port: int = 8774,
        api: str | None = None,
    ) -> None:
        self.model = model
        self.runner = runner
        self.host = host
        self.port = port
        routes = [r for r in model.routes if api is None or r.api == api]
        self.api = model.apis.get(api or (routes[0].api if routes and routes[0].api else ""))
        self._routes = sorted((_compile(r) for r in routes), key=lambda c: c.rank)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Lambda gives each execution environment one event at a time, and the handlers rely on it
        # (Powertools' router keeps the current request on the class): one environment per function.
        self._environments: dict[str, threading.Lock] = {}
        self._environments_lock = threading.Lock()
        throttle = self.api.throttle if self.api else None
        self._throttle = _TokenBucket(throttle.rate, throttle.burst) if throttle else None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def stage(self) -> str:
        return self.api.stage_name if self.api else self.model.stage

    @property
    def rest_api_id(self) -> str:
        return self.api.rest_api_id if self.api else "local"

    @property
    def stopping(self) -> bool:
        """Whether ``stop()`` has begun: requests still arriving on open connections are not served."""
        return self._stopping.is_set()

    def start(self) -> ApiGateway:
        """Listen and serve in a background thread.

        Raises:
            LocalStackError: the port is taken.
        """
        gateway = self

        class Handler(_RequestHandler):
            pass

        Handler.gateway = gateway
        self._stopping.clear()
        try:
            self._server = _Server((self.host, self.port), Handler, self._stopping)
        except OSError as exc:
            raise port_taken(self.host, self.port, exc, "--api-port") from exc
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="api-gateway", daemon=True
        )
        self._thread.start()
        log.info("API gateway listening on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop listening, close the open connections and wait (bounded) for their handlers."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.close_connections(STOP_TIMEOUT)
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> ApiGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # request handling

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]] | None:
        """The route for ``method path`` and its path parameters, or None."""
        for compiled in self._routes:
            if compiled.route.method not in (method, "ANY"):
                continue
            found = compiled.pattern.match(path)
            if found:
                return compiled.route, {k: unquote(v) for k, v in found.groupdict().items()}
        return None

    def _gateway_response(self, kind: str, status: int, document: Any) -> Response:
        """What API Gateway answers itself for ``kind`` (``UNAUTHORIZED``, …): the API's
        ``GatewayResponses`` entry for it (or ``DEFAULT_4XX`` / ``DEFAULT_5XX``), else ``status``
        with API Gateway's own ``document``; an entry without a status or a JSON template keeps
        ``status`` or ``document`` for what it leaves out."""
        responses = self.api.gateway_responses if self.api else {}
        chosen = responses.get(kind) or responses.get("DEFAULT_5XX" if status >= 500 else "DEFAULT_4XX")
        if chosen is None:
            return _json_response(status, document)
        return Response(status if chosen.status is None else chosen.status,
                        [("Content-Type", "application/json"), *chosen.headers],
                        json.dumps(document).encode() if chosen.body is None else chosen.body.encode())

    def handle(
        self, method: str, raw_path: str, headers: list[tuple[str, str]], body: bytes, source_ip: str
    ) -> Response:
        """Answer one HTTP request the way API Gateway would."""
        split = urlsplit(raw_path)
        path = split.path or "/"
        matched = self.match(method, path)
        if matched is None:
            return self._gateway_response("MISSING_AUTHENTICATION_TOKEN", 403,
                                          {"message": "Missing Authentication Token"})
        route, path_parameters = matched
        if self._throttle is not None and not self._throttle.take():
            return self._gateway_response("THROTTLED", 429, {"message": "Too Many Requests"})
        query = parse_qsl(split.query, keep_blank_values=True)
        request_id = str(uuid.uuid4())
        headers = self._forwarded(headers, source_ip)
        event = self._proxy_event(route, method, path, headers, query, path_parameters, body, source_ip, request_id)
        if route.authorizer is not None:
            denied, context = self._authorize(route.authorizer, event)
            if denied is not None:
                return denied
            event["requestContext"]["authorizer"] = context
        with self._environment(route.function):
            invocation = self.runner.invoke(route.function, event, request_id=request_id)
        if invocation.failed:
            log.warning("%s %s: %s failed: %s", method, path, route.function, invocation.error)
            return _json_response(502, {"message": "Internal server error"})
        return self._integration_response(route, invocation.result, request_id)

    def _environment(self, function: str) -> threading.Lock:
        """The lock of ``function``'s one execution environment (requests to it run one at a time)."""
        with self._environments_lock:
            return self._environments.setdefault(function, threading.Lock())

    def _forwarded(self, headers: list[tuple[str, str]], source_ip: str) -> list[tuple[str, str]]:
        """The client's headers plus the X-Forwarded-* ones API Gateway adds (the API builds links from them)."""
        added = {"x-forwarded-for", "x-forwarded-proto", "x-forwarded-port"}
        forwarded_for = ", ".join([v for k, v in headers if k.lower() == "x-forwarded-for"] + [source_ip])
        kept = [(k, v) for k, v in headers if k.lower() not in added]
        return [
            *kept,
            ("X-Forwarded-For", forwarded_for),
            ("X-Forwarded-Port", str(self.port)),
            ("X-Forwarded-Proto", "http"),
        ]

    def _proxy_event(
        self,
        route: Route,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        query: list[tuple[str, str]],
        path_parameters: dict[str, str],
        body: bytes,
        source_ip: str,
        request_id: str,
    ) -> dict[str, Any]:
        single_headers: dict[str, str] = {}
        multi_headers: dict[str, list[str]] = {}
        for name, value in headers:
            single_headers[name] = value
            multi_headers.setdefault(name, []).append(value)
        single_query: dict[str, str] = {}
        multi_query: dict[str, list[str]] = {}
        for name, value in query:
            single_query[name] = value
            multi_query.setdefault(name, []).append(value)
        try:
            text, is_base64 = (body.decode("utf-8"), False) if body else (None, False)
        except UnicodeDecodeError:
            text, is_base64 = base64.b64encode(body).decode(), True
        now = dt.datetime.now(dt.UTC)
        lower_headers = {k.lower(): v for k, v in single_headers.items()}
        return {
            "resource": route.path,
            "path": path,
            "httpMethod": method,
            "headers": single_headers or None,
            "multiValueHeaders": multi_headers or None,
            "queryStringParameters": single_query or None,
            "multiValueQueryStringParameters": multi_query or None,
            "pathParameters": path_parameters or None,
            "stageVariables": None,
            "requestContext": {
                "resourceId": _resource_id(route.path),
                "resourcePath": route.path,
                "httpMethod": method,
                "extendedRequestId": request_id,
                "requestTime": now.strftime("%d/%b/%Y:%H:%M:%S +0000"),
                "requestTimeEpoch": int(now.timestamp() * 1000),
                "path": path,
                "accountId": self.model.account_id,
                "protocol": "HTTP/1.1",
                "stage": self.stage,
                "domainPrefix": self.host,
                "domainName": lower_headers.get("host", f"{self.host}:{self.port}"),
                "requestId": request_id,
                "apiId": self.rest_api_id,
                "identity": {
                    "sourceIp": source_ip,
                    "userAgent": lower_headers.get("user-agent"),
                    "accountId": None,
                    "caller": None,
                    "user": None,
                    "userArn": None,
                },
            },
            "body": text,
            "isBase64Encoded": is_base64,
        }

    def _method_arn(self, method: str, path: str) -> str:
        return (
            f"arn:aws:execute-api:{self.model.region}:{self.model.account_id}:"
            f"{self.rest_api_id}/{self.stage}/{method}/{path.lstrip('/')}"
        )

    def _authorize(self, authorizer: Authorizer, event: dict[str, Any]) -> tuple[Response | None, dict[str, Any]]:
        """Run the authorizer: (None, context) to go on, or (the error response, {})."""
        headers = {k.lower(): v for k, v in (event["headers"] or {}).items()}
        query = event["queryStringParameters"] or {}
        if any(not headers.get(h.lower()) for h in authorizer.identity_headers) or any(
            not query.get(q) for q in authorizer.identity_query_strings
        ):
            return self._gateway_response("UNAUTHORIZED", 401, {"message": "Unauthorized"}), {}
        method_arn = self._method_arn(event["httpMethod"], event["path"])
        if authorizer.payload_type == "REQUEST":
            request = {
                "type": "REQUEST",
                "methodArn": method_arn,
                **{k: v for k, v in event.items() if k not in ("body", "isBase64Encoded")},
            }
        else:
            token_header = authorizer.identity_headers[0] if authorizer.identity_headers else "Authorization"
            request = {
                "type": "TOKEN",
                "methodArn": method_arn,
                "authorizationToken": headers.get(token_header.lower()),
            }
        with self._environment(authorizer.function):
            invocation = self.runner.invoke(authorizer.function, request)
        if invocation.failed:
            assert invocation.error is not None
            if invocation.error.get("errorMessage") == "Unauthorized":
                return self._gateway_response("UNAUTHORIZED", 401, {"message": "Unauthorized"}), {}
            log.warning("authorizer %s failed: %s", authorizer.name, invocation.error)
            return self._gateway_response("AUTHORIZER_FAILURE", 500, {"message": None}), {}
        policy = invocation.result if isinstance(invocation.result, dict) else {}
        decision = _policy_decision(policy.get("policyDocument") or {}, method_arn)
        if decision == "Deny":
            return self._gateway_response("ACCESS_DENIED", 403, {
                "Message": "User is not authorized to access this resource with an explicit deny"}), {}
        if decision != "Allow":
            return self._gateway_response(
                "ACCESS_DENIED", 403, {"Message": "User is not authorized to access this resource"}), {}
        context: dict[str, Any] = {}
        for key, value in (policy.get("context") or {}).items():
            if isinstance(value, (dict, list)):
                log.warning("authorizer %s returned a non-scalar context value %s", authorizer.name, key)
                return self._gateway_response("AUTHORIZER_CONFIGURATION_ERROR", 500, {"message": None}), {}
            context[key] = ("true" if value else "false") if isinstance(value, bool) else value
        context["principalId"] = policy.get("principalId")
        return None, context

    def _integration_response(self, route: Route, result: Any, request_id: str) -> Response:
        """The function's Lambda proxy response as HTTP, or 502 for a malformed one (as API Gateway)."""
        fault = _proxy_response_fault(result)
        if fault is not None:
            log.warning("%s returned a malformed proxy response (%s): %r", route.function, fault, result)
            return _json_response(502, {"message": "Internal server error"})
        headers: list[tuple[str, str]] = []
        for name, values in (result.get("multiValueHeaders") or {}).items():
            headers.extend((name, str(v)) for v in values)
        multi_names = {name.lower() for name, _ in headers}
        for name, value in (result.get("headers") or {}).items():
            if name.lower() not in multi_names:
                headers.append((name, str(value)))
        body = result.get("body") or ""
        raw = base64.b64decode(body) if result.get("isBase64Encoded") else body.encode()
        if not any(name.lower() == "content-type" for name, _ in headers):
            headers.append(("Content-Type", "application/json"))
        headers.append(("x-amzn-RequestId", request_id))
        return Response(result["statusCode"], headers, raw)


def _proxy_response_fault(result: Any) -> str | None:
    """Why API Gateway would refuse ``result`` as a Lambda proxy response, or None for a valid one."""
    if not isinstance(result, dict):
        return "not an object"
    status = result.get("statusCode")
    if isinstance(status, bool) or not isinstance(status, int):
        return "statusCode is not an integer"
    if not 100 <= status <= 599:
        return "statusCode is not an HTTP status"
    if result.get("body") is not None and not isinstance(result["body"], str):
        return "body is not a string"
    if not isinstance(result.get("headers") or {}, dict):
        return "headers is not an object"
    multi = result.get("multiValueHeaders") or {}
    if not isinstance(multi, dict) or not all(isinstance(values, list) for values in multi.values()):
        return "multiValueHeaders is not an object of lists"
    return None


def _resource_id(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()[:6]


def _policy_decision(document: dict[str, Any], method_arn: str) -> str | None:
    """'Deny' if a statement denies ``method_arn``, else 'Allow' if one allows it, else None."""
    statements = document.get("Statement") or []
    if isinstance(statements, dict):
        statements = [statements]
    allowed = False
    for statement in statements:
        actions = statement.get("Action") or []
        resources = statement.get("Resource") or []
        actions = [actions] if isinstance(actions, str) else actions
        resources = [resources] if isinstance(resources, str) else resources
        if not any(fnmatch.fnmatchcase("execute-api:Invoke", a) for a in actions):
            continue
        if not any(fnmatch.fnmatchcase(method_arn, r) for r in resources):
            continue
        if statement.get("Effect") == "Deny":
            return "Deny"
        allowed = allowed or statement.get("Effect") == "Allow"
    return "Allow" if allowed else None


class _RequestHandler(BaseHTTPRequestHandler):
    gateway: ApiGateway
    protocol_version = "HTTP/1.1"
    server_version = "ferry-local-apigateway"

    def _serve(self) -> None:
        if self.gateway.stopping:
            # A request on a connection kept alive across stop(): closed unanswered, like one to a closed port.
            self.close_connection = True
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        started = time.monotonic()
        try:
            response = self.gateway.handle(
                self.command, self.path, list(self.headers.items()), body, self.client_address[0]
            )
        except Exception:
            log.exception("%s %s failed in the gateway", self.command, self.path)
            response = _json_response(500, {"message": "Internal server error"})
        self.send_response(response.status)
        for name, value in response.headers:
            if name.lower() not in ("content-length", "connection", "transfer-encoding"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)
        log.info("%s %s %d (%.0f ms)", self.command, self.path, response.status, (time.monotonic() - started) * 1000)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _serve

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        """Requests are logged once, by ``_serve``."""
