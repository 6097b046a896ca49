"""Signed HTTP requests: the drain webhook checks them, drain callbacks send them.

A signed request carries three headers:

- ``X-Ferry-Timestamp``: when it was signed, in unix seconds;
- ``X-Ferry-Signature``: ``sha256=<hex HMAC-SHA256(secret, f"{timestamp}." + raw body bytes)>``;
- ``X-Ferry-Delivery``: the sender's unique id of the delivery (the receiver's idempotency key).

The timestamp is signed with the body, so a captured request can be replayed only for the
:data:`MAX_AGE_SECONDS` either side of the receiver's clock; receivers that must refuse even
that remember the signatures they accepted (see :mod:`ferry.webhook`). The delivery id is not
signed: it names the sender's attempt, and a receiver answers the same delivery once.

A callback connects only to globally routable addresses, checked on each address its host
resolves to, right before connecting (see :func:`address_refusal`): a drain's requester names
the URL, and must not make Ferry's functions POST into their own network.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import io
import ipaddress
import json
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any
from urllib import request as urlrequest
from urllib.error import URLError
from urllib.parse import urlsplit

from aws_lambda_powertools.metrics import MetricUnit

from ferry import errors
from ferry.observability import logger, metrics

TIMESTAMP_HEADER = "X-Ferry-Timestamp"
SIGNATURE_HEADER = "X-Ferry-Signature"
DELIVERY_HEADER = "X-Ferry-Delivery"
SCHEME = "sha256"
# How far a request's timestamp may lie from the receiver's clock, either way.
MAX_AGE_SECONDS = 300
# The whole of a callback's POST (connect, TLS handshake, send, the answer's status and headers)
# ends within this, however slowly the receiver answers: announcing a drain's end waits for it.
CALLBACK_TIMEOUT_SECONDS = 10.0

_SIGNATURE = re.compile(rf"^{SCHEME}=([0-9a-fA-F]{{64}})$")
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")


@dataclass(frozen=True)
class SignedRequest:
    """What :func:`verify` established about a request.

    ``signature`` is the lower-case hex digest (without ``sha256=``); ``delivery`` the
    ``X-Ferry-Delivery`` header as sent, or None without one (:func:`verify` does not require it).
    """

    timestamp: int
    signature: str
    delivery: str | None


def _key(secret: str | bytes) -> bytes:
    if not secret:
        raise errors.WebhookNotConfigured()
    return secret.encode() if isinstance(secret, str) else secret


def _digest(secret: str | bytes, timestamp: int | str, body: bytes | str) -> str:
    raw = body.encode() if isinstance(body, str) else body
    return hmac.new(_key(secret), f"{timestamp}.".encode() + raw, hashlib.sha256).hexdigest()


def sign(secret: str | bytes, timestamp: int | str, body: bytes | str) -> str:
    """The ``X-Ferry-Signature`` value of ``body`` signed at ``timestamp`` (unix seconds).

    Raises:
        WebhookNotConfigured: ``secret`` is empty (an empty key would let anybody sign).
    """
    return f"{SCHEME}={_digest(secret, timestamp, body)}"


def signed_headers(
    secret: str | bytes, body: bytes | str, delivery_id: str | None = None, now: float | None = None
) -> dict[str, str]:
    """The three headers of a signed request with ``body``.

    Args:
        delivery_id: the delivery's id; a new random one when omitted (a retry of the same
            delivery must pass the id of the first attempt).
        now: the signing time (default: this machine's clock).

    Raises:
        WebhookNotConfigured: ``secret`` is empty.
    """
    timestamp = int(time.time() if now is None else now)
    return {
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret, timestamp, body),
        DELIVERY_HEADER: delivery_id or str(uuid.uuid4()),
    }


def header(headers: Mapping[str, Any] | None, name: str) -> str | None:
    """The value of header ``name`` in ``headers`` whatever its case (None when absent)."""
    wanted = name.lower()
    for key, value in (headers or {}).items():
        if key.lower() == wanted:
            return None if value is None else str(value)
    return None


def verify(
    secret: str | bytes,
    headers: Mapping[str, Any] | None,
    body: bytes | str,
    now: float | None = None,
    max_age: int = MAX_AGE_SECONDS,
) -> SignedRequest:
    """Check that ``body`` with ``headers`` was signed with ``secret`` within ``max_age`` seconds.

    The signature is checked before the timestamp's age, so only a correctly signed request
    learns that its clock is off. Header names are matched whatever their case; digests are
    compared in constant time.

    Args:
        headers: the request's headers.
        body: the raw body bytes as received (a str is taken as its UTF-8 encoding).
        now: the receiver's time (default: this machine's clock).
        max_age: seconds a timestamp may lie in the past or in the future.

    Returns:
        The request's timestamp, signature digest and delivery id.

    Raises:
        WebhookNotConfigured: ``secret`` is empty.
        WebhookSignatureInvalid: a signature header is missing or malformed, or the signature
            does not match.
        WebhookTimestampStale: the signature matches but the timestamp is more than ``max_age``
            seconds old or ahead (compared exactly, not in whole seconds).
    """
    key = _key(secret)
    raw_timestamp = header(headers, TIMESTAMP_HEADER)
    raw_signature = header(headers, SIGNATURE_HEADER)
    if raw_timestamp is None:
        raise errors.WebhookSignatureInvalid(f"{TIMESTAMP_HEADER} is missing; signed requests carry it.")
    if raw_signature is None:
        raise errors.WebhookSignatureInvalid(f"{SIGNATURE_HEADER} is missing; signed requests carry it.")
    raw_timestamp = raw_timestamp.strip()
    if not _TIMESTAMP.match(raw_timestamp):
        raise errors.WebhookSignatureInvalid(
            f"{TIMESTAMP_HEADER} must be unix seconds (a whole number), not {raw_timestamp[:40]!r}."
        )
    found = _SIGNATURE.match(raw_signature.strip())
    if found is None:
        raise errors.WebhookSignatureInvalid(
            f"{SIGNATURE_HEADER} must be '{SCHEME}=' followed by the 64 hex digits of an HMAC-SHA256."
        )
    given = found.group(1).lower()
    expected = _digest(key, raw_timestamp, body)
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise errors.WebhookSignatureInvalid(
            f"{SIGNATURE_HEADER} does not match the body and {TIMESTAMP_HEADER} under the configured secret."
        )
    timestamp = int(raw_timestamp)
    # Compared exactly: a receiver that remembers signatures until timestamp + max_age (see
    # ferry.webhook) must never accept one a moment later.
    age = (time.time() if now is None else now) - timestamp
    if age > max_age:
        raise errors.WebhookTimestampStale(
            f"{TIMESTAMP_HEADER} is {age:.0f} s old; requests older than {max_age} s are refused."
        )
    if -age > max_age:
        raise errors.WebhookTimestampStale(
            f"{TIMESTAMP_HEADER} is {-age:.0f} s in the future; requests more than {max_age} s ahead of "
            f"this server's clock are refused."
        )
    return SignedRequest(timestamp=timestamp, signature=given, delivery=header(headers, DELIVERY_HEADER))


class _Deadline:
    """A moment after which a callback's POST gives up, whatever the receiver does."""

    def __init__(self, seconds: float) -> None:
        self._at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left until the deadline.

        Raises:
            TimeoutError: none are left.
        """
        left = self._at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the callback's deadline passed")
        return left


class _DeadlineSocket:
    """A connected socket whose every send and receive is bounded by what is left of a deadline.

    A socket's own timeout bounds each call, and a receiver answering a byte at a time makes
    every call short: only a bound recomputed at each call keeps the whole POST within the
    deadline. Everything else goes to the socket itself.
    """

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock, self._deadline = sock, deadline
        self._io_refs, self._closed = 0, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def _bounded(self) -> socket.socket:
        self._sock.settimeout(self._deadline.left())
        return self._sock

    def sendall(self, data: Any, *args: Any) -> None:
        self._bounded().sendall(data, *args)

    def recv_into(self, buffer: Any, *args: Any) -> int:
        return self._bounded().recv_into(buffer, *args)

    def recv(self, *args: Any) -> bytes:
        return self._bounded().recv(*args)

    def makefile(self, mode: str = "rb", *_args: Any, **_kwargs: Any) -> io.BufferedReader:
        """A binary reader of the answer (all http.client asks for), reading through the deadline."""
        self._io_refs += 1
        return io.BufferedReader(socket.SocketIO(self, "rb"))  # type: ignore[arg-type]

    def _decref_socketios(self) -> None:
        self._io_refs -= 1
        if self._closed and self._io_refs <= 0:
            self._sock.close()

    def close(self) -> None:
        """Close the socket once the readers made from it are closed too (as a socket does)."""
        self._closed = True
        if self._io_refs <= 0:
            self._sock.close()


def _addresses(host: str, port: int, deadline: _Deadline) -> list[tuple[Any, ...]]:
    """The socket addresses of ``host``, looked up within what is left of ``deadline``.

    The resolver takes no timeout (a name server that never answers holds it for as long as the
    system's resolver retries): it runs on a thread of its own, left to end by itself when the
    deadline passes first.

    Raises:
        TimeoutError: the lookup outlasted the deadline.
        OSError: the name does not resolve.
    """
    found: queue.Queue[list[tuple[Any, ...]] | OSError] = queue.Queue(maxsize=1)

    def look_up() -> None:
        try:
            found.put([info[4] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)])
        except OSError as exc:
            found.put(exc)

    threading.Thread(target=look_up, name="callback-lookup", daemon=True).start()
    try:
        result = found.get(timeout=deadline.left())
    except queue.Empty:
        raise TimeoutError("looking up the callback's host outlasted its deadline") from None
    if isinstance(result, OSError):
        raise result
    return result


# The kinds of address DrainCallbackAllowPrivateAddresses lets a callback reach (never the others).
PRIVATE_KINDS = ("loopback", "private", "shared")
# RFC 6598's shared address space (carrier-grade NAT): neither private nor global.
_SHARED = ipaddress.ip_network("100.64.0.0/10")
# RFC 1122's "this network": connecting to one reaches this machine or nothing.
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
# The private networks a deployment numbers its own hosts in (RFC 1918, RFC 4193 and the
# deprecated site-local fec0::/10). Python's ``is_private`` is wider: the documentation,
# benchmarking and protocol-assignment ranges count there, and are only "not globally routable" here.
_PRIVATE = tuple(ipaddress.ip_network(net) for net in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7", "fec0::/10"))


# The instance metadata service's IPv6 address (inside fc00::/7, yet never a receiver's):
# refused even where private addresses are allowed, as its IPv4 169.254.169.254 is.
_METADATA_V6 = ipaddress.ip_address("fd00:ec2::254")


class AddressRefused(OSError):
    """Every address a callback's host resolves to is one callbacks may not reach.

    Never leaves :func:`post_callback`, which logs it (with the reasons) as not delivered.
    """


def _kind_of(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """The kind of a non-global address (``loopback``, ``private``, …), or None for a global one."""
    if address.is_unspecified or (address.version == 4 and address in _THIS_NETWORK):
        return "unspecified"
    if address == _METADATA_V6:
        return "the instance metadata service"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast:
        return "multicast"
    if address.version == 4 and address in _SHARED:
        return "shared"
    if address.is_reserved:
        return "reserved"
    if any(address in network for network in _PRIVATE if network.version == address.version):
        return "private"
    if not address.is_global:
        return "not globally routable"
    return None


def address_refusal(address: str, *, allow_private: bool = False) -> str | None:
    """Why a callback may not connect to ``address`` (an IP address as the resolver gives it), or
    None when it may.

    Refused: loopback, private (RFC 1918, fc00::/7), shared (100.64.0.0/10), link-local
    (169.254.0.0/16, including the instance metadata service, and fe80::/10), multicast,
    reserved, unspecified and any other address that is not globally routable, and the IPv6
    forms embedding such an IPv4 address (IPv4-mapped ``::ffff:a.b.c.d``, 6to4). With
    ``allow_private``, loopback, private and shared addresses are allowed (receivers inside the
    stack's network); the others stay refused, and so does the instance metadata service's IPv6
    address (``fd00:ec2::254``), private though it is.
    """
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return f"{address} is not an IP address"
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        parsed = parsed.ipv4_mapped  # the socket connects to the IPv4 address itself
    kinds = [_kind_of(parsed)]
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.sixtofour is not None:
        kinds.append(_kind_of(parsed.sixtofour))  # a relay forwards to the IPv4 address it embeds
    refused = [kind for kind in kinds if kind and not (allow_private and kind in PRIVATE_KINDS)]
    return f"{address} is {refused[0]}" if refused else None


def _connection_class(base: type[http.client.HTTPConnection], req: _CallbackRequest) -> Any:
    """``base`` (HTTP or HTTPS) looking its host up, connecting only to the addresses
    :func:`address_refusal` allows, shaking hands, sending and reading within the request's deadline.

    Each address refused is noted in ``req.refused``; when every one is, no connection is made
    and :class:`AddressRefused` is raised.
    """
    deadline = req.deadline

    def create_connection(address: tuple[str, int], _timeout: Any = None,
                          source_address: tuple[str, int] | None = None) -> socket.socket:
        failed: OSError | None = None
        for found in _addresses(address[0], address[1], deadline):
            # Checked on the address connected to, after the lookup: a name may resolve anywhere.
            if (why := address_refusal(str(found[0]), allow_private=req.allow_private)) is not None:
                req.refused.append(why)
                continue
            try:  # a numeric address: connecting looks nothing up
                sock = socket.create_connection(found[:2], deadline.left(), source_address)
            except TimeoutError:
                raise
            except OSError as exc:  # the next address, as socket.create_connection does
                failed = exc
                continue
            sock.settimeout(deadline.left())  # the TLS handshake that follows gets what is left
            return sock
        if failed is not None:
            raise failed
        if req.refused:
            raise AddressRefused(f"callbacks go to globally routable addresses only: {'; '.join(req.refused)}")
        raise OSError(f"{address[0]} has no address")

    class DeadlineConnection(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            self._create_connection = create_connection
            super().connect()
            self.sock = _DeadlineSocket(self.sock, deadline)  # type: ignore[has-type, arg-type]

    return DeadlineConnection


class _CallbackRequest(urlrequest.Request):
    """A callback's request, with the deadline its connection keeps, whether it may reach private
    addresses, and the addresses it refused (with why)."""

    def __init__(self, *args: Any, deadline: _Deadline, allow_private: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = deadline
        self.allow_private = allow_private
        self.refused: list[str] = []


class _NoRedirects(urlrequest.HTTPRedirectHandler):
    """Callbacks are not followed to another URL: a redirect would turn the POST into a GET
    without its body, and the receiver named is the one meant to get it."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class _DeadlineHTTPHandler(urlrequest.HTTPHandler):
    def http_open(self, req: _CallbackRequest) -> Any:  # type: ignore[override]
        return self.do_open(_connection_class(http.client.HTTPConnection, req), req)


class _DeadlineHTTPSHandler(urlrequest.HTTPSHandler):
    def https_open(self, req: _CallbackRequest) -> Any:  # type: ignore[override]
        return self.do_open(_connection_class(http.client.HTTPSConnection, req), req,
                            context=self._context)  # type: ignore[attr-defined]


@cache
def _opener() -> urlrequest.OpenerDirector:
    """The HTTP client of callbacks: no redirects, no proxy (a proxy from the environment would
    be the address checked, and would reach any address for it), and every request within its
    deadline."""
    return urlrequest.build_opener(urlrequest.ProxyHandler({}), _NoRedirects, _DeadlineHTTPHandler,
                                   _DeadlineHTTPSHandler)


def redacted_url(url: str) -> str:
    """``url`` without its query and credentials, fit for logs and views (a query may carry a token)."""
    try:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"
    except ValueError:
        return "<unparseable URL>"


def post_callback(url: str, document: Any, secret: str | bytes, delivery_id: str | None = None, *,
                  allow_private: bool = False) -> bool:
    """POST ``document`` as JSON to ``url``, signed with ``secret`` (the headers of :func:`signed_headers`).

    Never raises: a callback that cannot be delivered (no secret, a URL that is not http(s),
    a host that resolves only to addresses :func:`address_refusal` refuses, a connection error,
    no answer within :data:`CALLBACK_TIMEOUT_SECONDS` in all, an answer other than 2xx) is
    logged and counted (``CallbackFailed``) and reported by the result. The log names the URL
    without its query and credentials, the error's type, the receiver's status and the
    addresses refused (with why), never the error's message: the HTTP client's may repeat the
    whole URL (``InvalidURL``), token and all.

    Args:
        delivery_id: ``X-Ferry-Delivery`` (default: a new random id).
        allow_private: also connect to loopback, private and shared addresses (the stack's
            ``DrainCallbackAllowPrivateAddresses``).

    Returns:
        True when the receiver answered 2xx.
    """
    where = redacted_url(url)
    delivery = delivery_id or str(uuid.uuid4())
    request: _CallbackRequest | None = None
    try:
        if urlsplit(url).scheme not in ("http", "https"):
            raise ValueError("callback URLs must be http or https")
        body = json.dumps(document).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "ferry-callback",
            **signed_headers(secret, body, delivery_id=delivery),
        }
        deadline = _Deadline(CALLBACK_TIMEOUT_SECONDS)
        request = _CallbackRequest(url, data=body, headers=headers, method="POST", deadline=deadline,
                                   allow_private=allow_private)
        with _opener().open(request, timeout=CALLBACK_TIMEOUT_SECONDS) as response:
            status = response.status
        if not 200 <= status < 300:
            raise ValueError(f"the receiver answered {status}")
    except Exception as exc:
        metrics.add_metric(name="CallbackFailed", unit=MetricUnit.Count, value=1)
        answered = getattr(exc, "code", None)  # an HTTPError's status: the receiver answered, not 2xx
        # urllib wraps what connecting raised (refused, timed out, no address) in a URLError: name that.
        cause = exc.reason if isinstance(exc, URLError) and isinstance(exc.reason, BaseException) else exc
        refused = request.refused if request is not None else []
        logger.warning(
            "callback not delivered",
            extra={"url": where, "delivery": delivery, "error": type(cause).__name__,
                   **({"status": answered} if isinstance(answered, int) else {}),
                   **({"refused_addresses": refused} if refused else {})},
        )
        return False
    metrics.add_metric(name="CallbackDelivered", unit=MetricUnit.Count, value=1)
    logger.info("callback delivered", extra={"url": where, "delivery": delivery, "status": status})
    return True
