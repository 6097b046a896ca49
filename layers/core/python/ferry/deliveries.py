"""Each drain webhook delivery answered once: a conditional record per delivery id in DynamoDB.

The first request with a delivery id claims it (an ``INPROGRESS`` record, put only if no live
record exists), runs, and stores its answer (``COMPLETED``); every later request with that id
within :data:`ANSWER_SECONDS` gets the stored answer and runs nothing. A claim whose run fails is
deleted, so that the sender may try again. A claim left behind by an invocation that died lapses
when that invocation's time would have run out. The record keeps a digest of the request: the
same delivery id with another request is a conflict, never an answer to the wrong question.

The records live in the template's ``IdempotencyTable`` (partition key ``id``; time-to-live
attribute ``expiration``, in seconds since the epoch), beside the webhook's one-time
signatures. Calls go through the function's botocore client (:func:`ferry.aws.client`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ferry import aws, errors
from ferry.observability import logger

KEY_PREFIX = "drain-webhook-delivery#"
# IdempotencyTable's partition key and time-to-live attribute (template.yaml).
KEY_ATTRIBUTE = "id"
EXPIRY_ATTRIBUTE = "expiration"
# The record's own attributes: its state, when an unfinished claim lapses, the request's digest
# and the stored answer.
STATUS_ATTRIBUTE = "status"
CLAIM_ATTRIBUTE = "claim_expiration"
DIGEST_ATTRIBUTE = "request_digest"
ANSWER_ATTRIBUTE = "answer"
# A delivery's answer is kept this long: a sender retrying within it gets the first answer.
ANSWER_SECONDS = 24 * 60 * 60
# How long a claim holds when the invocation's own deadline is unknown (Lambda's longest timeout).
CLAIM_SECONDS = 15 * 60

IN_PROGRESS = "INPROGRESS"
COMPLETED = "COMPLETED"


@dataclass(frozen=True)
class Answer:
    """What a delivery was answered; ``repeated`` when it came from the record, not from a run."""

    document: dict[str, Any]
    repeated: bool


def answer_once(table: str, delivery: str, request: Mapping[str, Any],
                run: Callable[[], dict[str, Any]], context: Any = None) -> Answer:
    """``run()``'s answer for the first request with ``delivery``; the stored answer for later ones.

    ``run`` must return what JSON holds (the answer is stored as JSON). ``context`` is the Lambda
    context, whose remaining time bounds the claim.

    Raises:
        WebhookDeliveryConflict: the delivery is being answered right now, or was answered for a
            different request.
        Whatever ``run`` raises, after the claim is withdrawn.
    """
    client = aws.client("dynamodb")
    key = {KEY_ATTRIBUTE: {"S": KEY_PREFIX + delivery}}
    digest = _digest(request)
    now = time.time()
    try:
        client.put_item(
            TableName=table,
            Item={**key, EXPIRY_ATTRIBUTE: {"N": str(int(now) + ANSWER_SECONDS)},
                  STATUS_ATTRIBUTE: {"S": IN_PROGRESS},
                  CLAIM_ATTRIBUTE: {"N": str(int(now + _claim_seconds(context)))},
                  DIGEST_ATTRIBUTE: {"S": digest}},
            # DynamoDB deletes expired items late: an expired record counts as gone.
            ConditionExpression="attribute_not_exists(#key) OR #expiry < :now "
                                "OR (#status = :in_progress AND #claim < :now)",
            ExpressionAttributeNames={"#key": KEY_ATTRIBUTE, "#expiry": EXPIRY_ATTRIBUTE,
                                      "#status": STATUS_ATTRIBUTE, "#claim": CLAIM_ATTRIBUTE},
            ExpressionAttributeValues={":now": {"N": str(int(now))}, ":in_progress": {"S": IN_PROGRESS}},
            ReturnValuesOnConditionCheckFailure="ALL_OLD",
        )
    except client.exceptions.ConditionalCheckFailedException as exc:
        record = exc.response.get("Item") or client.get_item(TableName=table, Key=key,
                                                             ConsistentRead=True).get("Item") or {}
        return _earlier_answer(delivery, digest, record)
    try:
        document = run()
    except BaseException:
        _withdraw(client, table, key, delivery)
        raise
    try:
        client.update_item(
            TableName=table, Key=key,
            UpdateExpression="SET #status = :completed, #answer = :answer, #expiry = :expiry REMOVE #claim",
            ExpressionAttributeNames={"#status": STATUS_ATTRIBUTE, "#answer": ANSWER_ATTRIBUTE,
                                      "#expiry": EXPIRY_ATTRIBUTE, "#claim": CLAIM_ATTRIBUTE},
            ExpressionAttributeValues={":completed": {"S": COMPLETED}, ":answer": {"S": json.dumps(document)},
                                       ":expiry": {"N": str(int(time.time()) + ANSWER_SECONDS)}},
        )
    except Exception:
        # The run happened and its answer goes back; a retry after the claim lapses runs again,
        # and ferry.drains answers it with the drain this run recorded (same idempotency key).
        logger.exception("the delivery's answer was not stored", extra={"delivery": delivery})
    return Answer(document, repeated=False)


def _withdraw(client: Any, table: str, key: Mapping[str, Any], delivery: str) -> None:
    """Delete a claim whose run failed, so that the sender may try again; the run's error goes on."""
    try:
        client.delete_item(TableName=table, Key=key)
    except Exception:
        logger.exception("the failed delivery's claim was not withdrawn; it lapses with the invocation",
                         extra={"delivery": delivery})


def _earlier_answer(delivery: str, digest: str, record: Mapping[str, Any]) -> Answer:
    """The stored answer of a record that kept this delivery's put out, or why there is none."""
    if record.get(DIGEST_ATTRIBUTE, {}).get("S") != digest:
        raise errors.WebhookDeliveryConflict(
            f"Delivery {delivery!r} was already used for a different drain request; "
            f"a new request needs a new delivery id."
        )
    if record.get(STATUS_ATTRIBUTE, {}).get("S") != COMPLETED or ANSWER_ATTRIBUTE not in record:
        raise errors.WebhookDeliveryConflict(
            f"Delivery {delivery!r} is being answered right now; send it again later to get its answer."
        )
    return Answer(json.loads(record[ANSWER_ATTRIBUTE]["S"]), repeated=True)


def _digest(request: Mapping[str, Any]) -> str:
    """The SHA-256 of the request as canonical JSON (key order and spacing do not count)."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _claim_seconds(context: Any) -> float:
    remaining = getattr(context, "get_remaining_time_in_millis", None)
    return remaining() / 1000 if callable(remaining) else CLAIM_SECONDS
