"""Signed requests (ferry.signing): what verify accepts and refuses, and signed callbacks."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from trickling_receiver import trickling_receiver

from ferry import errors, signing

SECRET = "s3cret-for-tests"
NOW = 1_700_000_000
BODY = b'{"drain": {"host": "h1"}}'


def _headers(body: bytes = BODY, *, secret: str = SECRET, at: int = NOW, delivery: str = "d-1") -> dict[str, str]:
    return signing.signed_headers(secret, body, delivery_id=delivery, now=at)


# --- sign and verify ---------------------------------------------------------------------------


def test_sign_is_hmac_sha256_of_timestamp_dot_body():
    expected = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()

    assert signing.sign(SECRET, NOW, BODY) == f"sha256={expected}"


def test_signed_headers_verify_and_name_the_delivery():
    headers = _headers()

    verified = signing.verify(SECRET, headers, BODY, now=NOW)

    assert set(headers) == {"X-Ferry-Timestamp", "X-Ferry-Signature", "X-Ferry-Delivery"}
    assert verified == signing.SignedRequest(
        timestamp=NOW, signature=headers["X-Ferry-Signature"].removeprefix("sha256="), delivery="d-1"
    )


def test_signed_headers_make_a_new_delivery_id_when_none_is_given():
    first = signing.signed_headers(SECRET, BODY, now=NOW)["X-Ferry-Delivery"]
    second = signing.signed_headers(SECRET, BODY, now=NOW)["X-Ferry-Delivery"]

    assert first and second and first != second


def test_a_str_body_is_its_utf8_bytes():
    text = '{"drain": {"host": "hôte"}}'

    assert signing.verify(SECRET, _headers(text.encode()), text, now=NOW).timestamp == NOW


def test_tampered_body_is_refused():
    headers = _headers()

    with pytest.raises(errors.WebhookSignatureInvalid, match="does not match the body"):
        signing.verify(SECRET, headers, BODY.replace(b"h1", b"h2"), now=NOW)


def test_tampered_timestamp_is_refused():
    headers = _headers()
    headers["X-Ferry-Timestamp"] = str(NOW + 1)

    with pytest.raises(errors.WebhookSignatureInvalid, match="does not match"):
        signing.verify(SECRET, headers, BODY, now=NOW)


def test_wrong_secret_is_refused():
    with pytest.raises(errors.WebhookSignatureInvalid):
        signing.verify(SECRET, _headers(secret="another-secret"), BODY, now=NOW)


def test_an_empty_secret_neither_signs_nor_verifies():
    with pytest.raises(errors.WebhookNotConfigured):
        signing.sign("", NOW, BODY)
    # A signature made with an empty key must not pass for a receiver without a secret.
    forged = {
        "X-Ferry-Timestamp": str(NOW),
        "X-Ferry-Signature": "sha256=" + hmac.new(b"", f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest(),
    }
    with pytest.raises(errors.WebhookNotConfigured):
        signing.verify("", forged, BODY, now=NOW)


def test_stale_timestamp_is_refused_with_its_age():
    headers = _headers(at=NOW - 412)

    with pytest.raises(errors.WebhookTimestampStale) as raised:
        signing.verify(SECRET, headers, BODY, now=NOW)

    assert raised.value.message == "X-Ferry-Timestamp is 412 s old; requests older than 300 s are refused."
    assert raised.value.http_status == 401


def test_future_timestamp_is_refused():
    with pytest.raises(errors.WebhookTimestampStale, match="301 s in the future"):
        signing.verify(SECRET, _headers(at=NOW + 301), BODY, now=NOW)


def test_timestamps_within_max_age_either_way_are_accepted():
    assert signing.verify(SECRET, _headers(at=NOW - 300), BODY, now=NOW).timestamp == NOW - 300
    assert signing.verify(SECRET, _headers(at=NOW + 300), BODY, now=NOW).timestamp == NOW + 300


def test_max_age_is_the_callers_choice():
    with pytest.raises(errors.WebhookTimestampStale, match="older than 10 s"):
        signing.verify(SECRET, _headers(at=NOW - 11), BODY, now=NOW, max_age=10)


@pytest.mark.parametrize("missing", ["X-Ferry-Timestamp", "X-Ferry-Signature"])
def test_missing_signature_headers_are_refused(missing):
    headers = _headers()
    del headers[missing]

    with pytest.raises(errors.WebhookSignatureInvalid, match=f"{missing} is missing"):
        signing.verify(SECRET, headers, BODY, now=NOW)


def test_no_headers_at_all_are_refused():
    with pytest.raises(errors.WebhookSignatureInvalid, match="is missing"):
        signing.verify(SECRET, None, BODY, now=NOW)


def test_the_delivery_id_is_not_required_to_verify():
    headers = _headers()
    del headers["X-Ferry-Delivery"]

    assert signing.verify(SECRET, headers, BODY, now=NOW).delivery is None


@pytest.mark.parametrize(
    ("timestamp", "signature", "complaint"),
    [
        ("yesterday", None, "must be unix seconds"),
        ("-5", None, "must be unix seconds"),
        ("1700000000.5", None, "must be unix seconds"),
        (None, "md5=abc", "must be 'sha256=' followed by"),
        (None, "sha256=" + "g" * 64, "must be 'sha256=' followed by"),
        (None, "sha256=" + "é" * 64, "must be 'sha256=' followed by"),
    ],
)
def test_malformed_signature_headers_are_refused(timestamp, signature, complaint):
    headers = _headers()
    if timestamp is not None:
        headers["X-Ferry-Timestamp"] = timestamp
    if signature is not None:
        headers["X-Ferry-Signature"] = signature

    with pytest.raises(errors.WebhookSignatureInvalid, match=complaint):
        signing.verify(SECRET, headers, BODY, now=NOW)


def test_header_names_are_matched_whatever_their_case():
    headers = {name.lower(): value for name, value in _headers().items()}
    upper = {name.upper(): value for name, value in _headers().items()}

    assert signing.verify(SECRET, headers, BODY, now=NOW).delivery == "d-1"
    assert signing.verify(SECRET, upper, BODY, now=NOW).delivery == "d-1"


def test_upper_case_hex_digits_are_the_same_signature():
    headers = _headers()
    digest = headers["X-Ferry-Signature"].removeprefix("sha256=")
    headers["X-Ferry-Signature"] = "sha256=" + digest.upper()

    assert signing.verify(SECRET, headers, BODY, now=NOW).signature == digest


def test_verify_compares_digests_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(signing.hmac, "compare_digest", spy)

    signing.verify(SECRET, _headers(), BODY, now=NOW)

    assert len(compared) == 1


# --- callbacks ---------------------------------------------------------------------------------


@dataclass
class Receiver:
    url: str
    status: int = 200
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An HTTP server on loopback that records what is POSTed to it and answers ``status``."""
    state = Receiver(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the base class's naming
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            state.received.append((dict(self.headers.items()), body))
            self.send_response(state.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/drain-events?token=abc"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_callback_posts_json_the_receiver_can_verify(receiver):
    document = {"drain": {"id": "d1", "status": "completed"}}

    assert signing.post_callback(receiver.url, document, SECRET, delivery_id="drain-d1-completed",
                                 allow_private=True) is True

    [(headers, body)] = receiver.received
    verified = signing.verify(SECRET, headers, body)
    assert json.loads(body) == document
    assert signing.header(headers, "Content-Type") == "application/json"
    assert verified.delivery == "drain-d1-completed"


def test_callback_under_another_secret_fails_the_receivers_check(receiver):
    assert signing.post_callback(receiver.url, {"drain": {}}, "not-the-receivers-secret", allow_private=True) is True

    [(headers, body)] = receiver.received
    with pytest.raises(errors.WebhookSignatureInvalid):
        signing.verify(SECRET, headers, body)


def test_callback_answered_with_an_error_status_returns_false(receiver):
    receiver.status = 500

    assert signing.post_callback(receiver.url, {"drain": {}}, SECRET, allow_private=True) is False
    assert len(receiver.received) == 1


def test_callback_is_not_redirected(receiver):
    receiver.status = 307

    assert signing.post_callback(receiver.url, {"drain": {}}, SECRET, allow_private=True) is False
    assert len(receiver.received) == 1


def test_callback_to_a_closed_port_returns_false_without_raising():
    with ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler) as server:
        port = server.server_address[1]
    # The port was free a moment ago and nothing listens on it now.

    assert signing.post_callback(f"http://127.0.0.1:{port}/cb", {"drain": {}}, SECRET, allow_private=True) is False


@pytest.mark.parametrize("url", ["file:///etc/passwd", "not a url", "http://[::1"])
def test_callback_to_an_unusable_url_returns_false_without_raising(url):
    assert signing.post_callback(url, {"drain": {}}, SECRET) is False


def test_callback_without_a_secret_returns_false_and_sends_nothing(receiver):
    assert signing.post_callback(receiver.url, {"drain": {}}, "") is False
    assert receiver.received == []


def test_failed_callback_counts_a_metric_and_logs_without_the_query(monkeypatch):
    counted: list[str] = []
    logged: list[dict[str, Any]] = []
    monkeypatch.setattr(signing.metrics, "add_metric", lambda name, **_: counted.append(name))
    monkeypatch.setattr(signing.logger, "warning", lambda message, extra: logged.append(extra))

    assert signing.post_callback("http://127.0.0.1:9/cb?token=secret-token", {"x": 1}, SECRET) is False

    assert counted == ["CallbackFailed"]
    assert logged[0]["url"] == "http://127.0.0.1:9/cb"


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/cb path?token=secret-token",
                                 "http://127.0.0.1:9/cb\r\nX-Injected: x?token=secret-token"])
def test_a_callback_to_a_url_the_http_client_refuses_logs_the_errors_type_not_its_message(monkeypatch, url):
    # GIVEN a URL the HTTP client refuses with a message that repeats its path and query
    logged: list[dict[str, Any]] = []
    monkeypatch.setattr(signing.logger, "warning", lambda message, extra: logged.append(extra))

    assert signing.post_callback(url, {"x": 1}, SECRET) is False

    [extra] = logged
    assert extra["error"] == "InvalidURL"
    assert "secret-token" not in json.dumps(extra)


def test_a_callback_answered_with_an_error_status_logs_the_status(receiver, monkeypatch):
    logged: list[dict[str, Any]] = []
    monkeypatch.setattr(signing.logger, "warning", lambda message, extra: logged.append(extra))
    receiver.status = 503

    assert signing.post_callback(receiver.url, {"drain": {}}, SECRET, allow_private=True) is False

    [extra] = logged
    assert (extra["error"], extra["status"]) == ("HTTPError", 503)
    assert "token" not in json.dumps(extra)


# --- exact ages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [signing.MAX_AGE_SECONDS + 0.5, -(signing.MAX_AGE_SECONDS + 0.5)])
def test_a_timestamp_half_a_second_past_max_age_either_way_is_refused(offset):
    # Not rounded down to whole seconds: the webhook keeps a signature's nonce until the last
    # moment it is accepted, and a moment later it must not be.
    with pytest.raises(errors.WebhookTimestampStale):
        signing.verify(SECRET, _headers(), BODY, now=NOW + offset)


# --- a callback's deadline -----------------------------------------------------------------------


def test_a_callback_whose_receiver_trickles_its_answer_gives_up_at_its_deadline(monkeypatch):
    # GIVEN a receiver that would take some 6 s to answer, a byte at a time (each read is quick)
    monkeypatch.setattr(signing, "CALLBACK_TIMEOUT_SECONDS", 1.0)
    url, stop = trickling_receiver(0.15)

    # WHEN a callback is posted to it
    started = time.monotonic()
    delivered = signing.post_callback(url, {"event_type": "drain.end"}, SECRET, allow_private=True)
    took = time.monotonic() - started
    stop()

    # THEN the POST as a whole ends at its deadline, not delivered
    assert delivered is False
    assert took < signing.CALLBACK_TIMEOUT_SECONDS + 0.5


def test_a_callback_whose_hosts_name_server_never_answers_gives_up_at_its_deadline(monkeypatch):
    # GIVEN a receiver's name whose lookup would take 5 s (a name server that does not answer)
    monkeypatch.setattr(signing, "CALLBACK_TIMEOUT_SECONDS", 1.0)
    lookup = socket.getaddrinfo

    def slow_lookup(host, *args, **kwargs):
        if host == "receiver.example":
            time.sleep(5)
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_lookup)

    # WHEN a callback is posted to it
    started = time.monotonic()
    delivered = signing.post_callback("https://receiver.example/drain-events", {"event_type": "drain.end"}, SECRET)

    # THEN it gives up at its deadline, not delivered
    assert delivered is False
    assert time.monotonic() - started < signing.CALLBACK_TIMEOUT_SECONDS + 0.5


def test_a_callback_to_a_host_name_is_looked_up_and_delivered(receiver):
    url = receiver.url.replace("127.0.0.1", "localhost")

    assert signing.post_callback(url, {"event_type": "drain.end"}, SECRET, allow_private=True) is True
    assert len(receiver.received) == 1


# --- where a callback may connect ----------------------------------------------------------------

REFUSED = {
    "127.0.0.1": "loopback", "127.8.9.10": "loopback", "::1": "loopback",
    "10.1.2.3": "private", "172.16.0.1": "private", "192.168.1.1": "private", "fd00::1": "private",
    "100.64.0.1": "shared", "100.127.255.254": "shared",
    "169.254.169.254": "link-local", "fe80::1": "link-local", "fd00:ec2::254": "the instance metadata service",
    "224.0.0.1": "multicast", "ff02::1": "multicast",
    "240.0.0.1": "reserved", "255.255.255.255": "reserved",
    "0.0.0.0": "unspecified", "0.1.2.3": "unspecified", "::": "unspecified",
    "::ffff:127.0.0.1": "loopback", "::ffff:10.0.0.1": "private", "::ffff:169.254.169.254": "link-local",
    "::ffff:100.64.0.1": "shared", "2002:a9fe:a9fe::1": "link-local",
    # documentation, benchmarking and protocol-assignment ranges: no deployment's own hosts
    "192.0.2.1": "not globally routable", "198.51.100.7": "not globally routable",
    "203.0.113.9": "not globally routable", "198.18.0.1": "not globally routable",
    "192.0.0.1": "not globally routable", "2001:db8::1": "not globally routable",
}


@pytest.mark.parametrize(("address", "kind"), REFUSED.items())
def test_a_callback_may_not_connect_to_an_address_that_is_not_globally_routable(address, kind):
    assert signing.address_refusal(address) == f"{address} is {kind}"


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "::ffff:93.184.216.34"])
def test_a_callback_may_connect_to_a_globally_routable_address(address):
    assert signing.address_refusal(address) is None


@pytest.mark.parametrize(("address", "allowed"), [
    ("127.0.0.1", True), ("::1", True), ("10.1.2.3", True), ("fd00::1", True), ("100.64.0.1", True),
    ("::ffff:192.168.0.7", True),
    ("169.254.169.254", False), ("fd00:ec2::254", False),
    ("fe80::1", False), ("224.0.0.1", False), ("240.0.0.1", False), ("0.0.0.0", False),
    ("192.0.2.1", False), ("198.18.0.1", False), ("2001:db8::1", False), ("::ffff:203.0.113.9", False),
])
def test_allowing_private_addresses_allows_loopback_private_and_shared_ones_only(address, allowed):
    assert (signing.address_refusal(address, allow_private=True) is None) is allowed


def _resolving(monkeypatch, name: str, addresses: list[str]) -> list[tuple[str, int]]:
    """Make ``name`` resolve to ``addresses``; return the addresses connected to from now on (each refused)."""
    lookup = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):
        if host != name:
            return lookup(host, port, *args, **kwargs)
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port, 0, 0) if ":" in a else (a, port)) for a in addresses]

    connected: list[tuple[str, int]] = []

    def connect(address, *_args, **_kwargs):
        connected.append(tuple(address))
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(socket, "create_connection", connect)
    return connected


def _warnings(monkeypatch) -> list[dict[str, Any]]:
    logged: list[dict[str, Any]] = []
    monkeypatch.setattr(signing.logger, "warning", lambda message, extra: logged.append(extra))
    return logged


def test_a_callback_to_a_loopback_receiver_is_not_delivered_and_makes_no_connection(receiver, monkeypatch):
    logged = _warnings(monkeypatch)

    assert signing.post_callback(receiver.url, {"drain": {}}, SECRET) is False

    assert receiver.received == []
    [extra] = logged
    assert extra["error"] == "AddressRefused" and extra["refused_addresses"] == ["127.0.0.1 is loopback"]
    assert "token" not in json.dumps(extra)


@pytest.mark.parametrize("allow_private", [False, True])
def test_a_host_name_resolving_to_the_metadata_service_is_refused_after_the_lookup(monkeypatch, allow_private):
    # GIVEN a public-looking name that resolves to the instance metadata service
    connected = _resolving(monkeypatch, "receiver.example", ["169.254.169.254", "::ffff:169.254.169.254"])
    logged = _warnings(monkeypatch)

    # WHEN a callback is posted to it (whether or not private addresses are allowed)
    delivered = signing.post_callback("http://receiver.example/latest/meta-data/", {"drain": {}}, SECRET,
                                      allow_private=allow_private)

    # THEN nothing is connected to, and the log says why
    assert delivered is False and connected == []
    [extra] = logged
    assert extra["error"] == "AddressRefused"
    assert extra["refused_addresses"] == ["169.254.169.254 is link-local", "::ffff:169.254.169.254 is link-local"]


def test_each_address_a_name_resolves_to_is_checked_before_it_is_tried(monkeypatch):
    # GIVEN a name that resolves to a private address, then a global one (which refuses the connection)
    connected = _resolving(monkeypatch, "receiver.example", ["10.0.0.5", "93.184.216.34"])
    logged = _warnings(monkeypatch)

    # WHEN a callback is posted to it
    delivered = signing.post_callback("https://receiver.example/hook", {"drain": {}}, SECRET)

    # THEN only the global address is tried
    assert delivered is False and connected == [("93.184.216.34", 443)]
    [extra] = logged
    assert extra["error"] == "ConnectionRefusedError" and extra["refused_addresses"] == ["10.0.0.5 is private"]
