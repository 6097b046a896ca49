"""The signed drain webhook: ``POST /webhooks/drain`` starts a drain without a token.

Monitoring or an operator's tooling sends ``{"drain": {...}}`` (:data:`ferry.drains.REQUEST_SCHEMA`)
signed with the shared secret (:mod:`ferry.signing`). The webhook answers in this order:

1. no secret configured (``FERRY_WEBHOOK_SECRET`` from the template's ``DrainWebhookSecret``), or
   the same as the callback secret (``FERRY_CALLBACK_SECRET``), which receivers hold: 503;
2. a missing, malformed or wrong signature: 401; a timestamp over 5 minutes off either way: 401;
3. a missing or too long ``X-Ferry-Delivery``, a body that is not JSON or not a drain request, or
   one naming a ``callback_url`` while no callback secret is set (``FERRY_CALLBACK_SECRET``, the
   template's ``DrainCallbackSecret``; callbacks are signed with it, never with this secret): 400;
4. the same delivery id again: the first answer, and nothing is started again (a record per
   delivery in ``FERRY_IDEMPOTENCY_TABLE``, 24 hours, :mod:`ferry.deliveries`); the same
   delivery id with another body, or while its first request is still being answered: 409;
5. a signature another delivery already used (a captured request sent again under a new
   delivery id): 409. Accepted signatures are kept as one-time nonces in the same table until
   their signed timestamp is 6 minutes old, past the last moment it is accepted;
6. otherwise :func:`ferry.drains.create_drain` as :func:`ferry.drains.webhook_context`: its
   status (202 started, 200 dry run) and ``{"drain": view}``.

Refusals are the compute API's faults, ``{"<kind>": {"code": N, "message": "..."}}``; a refused
request starts nothing and records nothing but, from step 5 on, the signature's nonce.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit

from ferry import aws, config, deliveries, drains, errors, signing
from ferry.observability import logger, metrics
from ferry.store import db

TABLE_VARIABLE = "FERRY_IDEMPOTENCY_TABLE"
DELIVERY_MAX_LENGTH = 128
# A signature is accepted until its signed timestamp + MAX_AGE_SECONDS (ferry.signing compares
# exactly): its nonce is kept until then, and this margin longer (clock steps between functions).
SIGNATURE_NONCE_MARGIN_SECONDS = 60
SIGNATURE_KEY_PREFIX = "webhook-signature#"

def handle(event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
    """Answer one API Gateway REST proxy event (payload 1.0) for ``POST /webhooks/drain``.

    Never raises: every outcome is a proxy response with a JSON body.
    """
    request_id = _request_id(event, context)
    try:
        answer = _start_drain_once(event, context)
    except Exception as exc:
        return _fault(exc, request_id)
    drain = answer["body"].get("drain") or {}
    details = {"status": answer["status"], "drain": drain.get("id"), "delivery": answer["delivery"]}
    if answer.get("repeated"):
        metrics.add_metric(name="WebhookDeliveryRepeated", unit=MetricUnit.Count, value=1)
        logger.info("drain webhook delivery repeated: answered as before", extra=details)
    else:
        metrics.add_metric(name="WebhookDrainAccepted", unit=MetricUnit.Count, value=1)
        logger.info("drain webhook accepted", extra=details)
    return _response(answer["status"], answer["body"])


def _start_drain_once(event: Mapping[str, Any], context: Any) -> dict[str, Any]:
    secret = config.get().webhook_secret
    if not secret:
        raise errors.WebhookNotConfigured()
    if secret == config.get().callback_secret:
        # Every callback's receiver would hold what starts drains as an admin.
        raise errors.WebhookNotConfigured("The drain webhook is off: DrainWebhookSecret is the same as "
                                          "DrainCallbackSecret, which every callback's receiver holds.")
    table = config.get().idempotency_table
    if not table:
        raise errors.WebhookNotConfigured(f"The drain webhook is not configured: {TABLE_VARIABLE} is not set.")
    body = _raw_body(event)
    signed = signing.verify(secret, _headers(event), body)
    delivery = signed.delivery
    if not delivery or len(delivery) > DELIVERY_MAX_LENGTH:
        raise errors.WebhookRequestInvalid(
            f"{signing.DELIVERY_HEADER} must name the delivery in 1 to {DELIVERY_MAX_LENGTH} characters"
            + (f", not {len(delivery)}." if delivery else "; it is missing.")
        )
    request = _drain_request(body)
    answer = deliveries.answer_once(
        table, delivery, request,
        lambda: _start_drain(delivery=delivery, request=request, signed=signed, table=table),
        context,
    )
    return {**answer.document, "repeated": answer.repeated, "delivery": delivery}


def _start_drain(*, delivery: str, request: dict[str, Any], signed: signing.SignedRequest,
                 table: str) -> dict[str, Any]:
    """Run once per delivery id (:mod:`ferry.deliveries` keeps the answer): spend the signature,
    start the drain. Raising withdraws the delivery's claim, so the sender may try it again.
    """
    _spend_signature(table, signed, delivery)
    status, document = drains.create_drain(
        drains.webhook_context(), request, origin="webhook", idempotency_key=f"webhook:{delivery}"
    )
    # Stored in the table as JSON and sent as JSON: keep only what JSON holds.
    return {"status": status, "body": json.loads(json.dumps(document, default=str))}


def _spend_signature(table: str, signed: signing.SignedRequest, delivery: str) -> None:
    """Record ``signed``'s signature as used by ``delivery`` (a conditional put).

    The delivery that first used a signature may use it again (its first attempt failed after
    this point and the sender retries the same signed request). The nonce lives until the
    signature can no longer be accepted (:func:`nonce_expiry`), however far ahead of this
    server's clock the request was signed.

    Raises:
        WebhookReplayed: another delivery used the signature, and its nonce has not expired.
    """
    now = time.time()
    client = aws.client("dynamodb")
    try:
        client.put_item(
            TableName=table,
            Item={
                deliveries.KEY_ATTRIBUTE: {"S": SIGNATURE_KEY_PREFIX + signed.signature},
                deliveries.EXPIRY_ATTRIBUTE: {"N": str(nonce_expiry(signed.timestamp))},
                "delivery": {"S": delivery},
            },
            # DynamoDB deletes expired items late: an expired nonce counts as gone.
            ConditionExpression="attribute_not_exists(#key) OR #expiry < :now OR #delivery = :delivery",
            ExpressionAttributeNames={"#key": deliveries.KEY_ATTRIBUTE, "#expiry": deliveries.EXPIRY_ATTRIBUTE,
                                      "#delivery": "delivery"},
            ExpressionAttributeValues={":now": {"N": repr(now)}, ":delivery": {"S": delivery}},
        )
    except client.exceptions.ConditionalCheckFailedException as exc:
        raise errors.WebhookReplayed(
            f"This {signing.SIGNATURE_HEADER} was already used by another delivery: the request is a replay "
            f"and is refused. Sign every delivery anew."
        ) from exc


def nonce_expiry(timestamp: int) -> int:
    """When the nonce of a signature made at ``timestamp`` (unix seconds) lapses: after the last
    moment :func:`ferry.signing.verify` accepts it, :data:`SIGNATURE_NONCE_MARGIN_SECONDS` on."""
    return timestamp + signing.MAX_AGE_SECONDS + SIGNATURE_NONCE_MARGIN_SECONDS


def _headers(event: Mapping[str, Any]) -> dict[str, Any]:
    """The request's headers (the last value of a repeated one, as API Gateway's ``headers``)."""
    headers = event.get("headers")
    if headers:
        return dict(headers)
    return {name: values[-1] for name, values in (event.get("multiValueHeaders") or {}).items() if values}


def _raw_body(event: Mapping[str, Any]) -> bytes:
    """The body's bytes as the sender signed them."""
    body = event.get("body")
    if body is None:
        return b""
    if event.get("isBase64Encoded"):
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise errors.WebhookRequestInvalid("The body is marked base64-encoded but is not base64.") from exc
    return str(body).encode()


def _drain_request(body: bytes) -> dict[str, Any]:
    """The drain request of a body ``{"drain": {...}}``.

    Raises:
        WebhookRequestInvalid: the body is not JSON, or is not a drain request (worded as the
            API words it, never repeating what was sent: see :func:`ferry.drains.refusal_of`), or
            names a callback URL while callbacks are not configured.
    """
    try:
        document = json.loads(body)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise errors.WebhookRequestInvalid(f"The body is not valid JSON: {exc}.") from exc
    return drains.request_of(document, errors.WebhookRequestInvalid)


def _request_id(event: Mapping[str, Any], context: Any) -> str:
    return str((event.get("requestContext") or {}).get("requestId") or getattr(context, "aws_request_id", "unknown"))


def _response(status: int, document: Any) -> dict[str, Any]:
    return {
        "statusCode": status,
        "headers": {"Content-Type": "application/json"},
        # Sorted, so a repeated delivery's answer (read back from the table) is byte for byte the first.
        "body": json.dumps(document, sort_keys=True),
        "isBase64Encoded": False,
    }


def _fault(exc: Exception, request_id: str) -> dict[str, Any]:
    """The compute API's fault shape (see ``ferry.api.fault_response``) for a refusal or a failure."""
    answered = db.unavailable(exc, request_id) or exc  # a database away for the moment: 503, try again
    if isinstance(answered, errors.FerryError):
        status, kind, message = answered.http_status, answered.api_kind, answered.message
    else:
        status, kind = 500, errors.FerryError.api_kind
        message = f"Unexpected error. Please report it to the operator with the request id {request_id}."
    if status >= 500 and not isinstance(exc, errors.WebhookNotConfigured):
        metrics.add_metric(name="WebhookFault", unit=MetricUnit.Count, value=1)
        logger.error("drain webhook failed", exc_info=exc, extra={"status": status, "error": type(exc).__name__})
    else:
        metrics.add_metric(name="WebhookRefused", unit=MetricUnit.Count, value=1)
        metrics.add_metadata(key="reason", value=type(exc).__name__)
        logger.warning("drain webhook refused", extra={"status": status, "error": type(exc).__name__,
                                                       "reason": message})
    return _response(status, {kind: {"code": status, "message": message}})
