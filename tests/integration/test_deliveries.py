"""ferry.deliveries: each webhook delivery answered once, over moto's DynamoDB and the template's table."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from moto import mock_aws

from ferry import aws, deliveries, errors
from ferry.local.template import resolve

ROOT = Path(__file__).resolve().parents[2]
REQUEST = {"host": "h1", "reason": "disk replacement"}
# A Lambda context with a minute left.
MINUTE_LEFT = SimpleNamespace(get_remaining_time_in_millis=lambda: 60_000)


@pytest.fixture
def table(aws_test_credentials) -> Iterator[str]:
    spec = resolve(ROOT / "template.yaml").tables["IdempotencyTable"]
    with mock_aws():
        aws.reset()
        aws.client("dynamodb").create_table(TableName=spec.name, KeySchema=spec.key_schema,
                                            AttributeDefinitions=spec.attribute_definitions,
                                            BillingMode=spec.billing_mode)
        yield spec.name
        aws.reset()


class Runs:
    """A run that records its calls and answers with their count."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict[str, object]:
        self.calls += 1
        return {"status": 202, "body": {"drain": {"id": f"drain-{self.calls}"}}}


def record(table: str, delivery: str) -> dict[str, object]:
    key = {deliveries.KEY_ATTRIBUTE: {"S": deliveries.KEY_PREFIX + delivery}}
    return aws.client("dynamodb").get_item(TableName=table, Key=key, ConsistentRead=True).get("Item", {})


def test_the_first_request_runs_and_later_ones_get_its_answer(table):
    run = Runs()

    first = deliveries.answer_once(table, "d1", REQUEST, run)
    # The same request with its keys in another order is the same request.
    again = deliveries.answer_once(table, "d1", dict(reversed(list(REQUEST.items()))), run)

    assert first == deliveries.Answer({"status": 202, "body": {"drain": {"id": "drain-1"}}}, repeated=False)
    assert again == deliveries.Answer(first.document, repeated=True)
    assert run.calls == 1
    stored = record(table, "d1")
    assert stored["status"] == {"S": deliveries.COMPLETED}
    assert "claim_expiration" not in stored
    assert int(stored[deliveries.EXPIRY_ATTRIBUTE]["N"]) >= time.time() + deliveries.ANSWER_SECONDS - 5


def test_another_request_under_a_used_delivery_id_is_a_conflict(table):
    run = Runs()
    deliveries.answer_once(table, "d1", REQUEST, run)

    with pytest.raises(errors.WebhookDeliveryConflict, match="already used for a different drain request"):
        deliveries.answer_once(table, "d1", {**REQUEST, "reason": "something else"}, run)
    assert run.calls == 1


def test_a_delivery_being_answered_is_a_conflict_for_a_second_request(table):
    run = Runs()

    def first_run():
        with pytest.raises(errors.WebhookDeliveryConflict, match="being answered right now"):
            deliveries.answer_once(table, "d1", REQUEST, run, MINUTE_LEFT)
        return {"status": 202, "body": {}}

    answer = deliveries.answer_once(table, "d1", REQUEST, first_run, MINUTE_LEFT)

    assert answer.repeated is False
    assert run.calls == 0, "the second request ran nothing"


def test_a_claim_outlives_its_invocation_only_until_that_invocation_would_have_timed_out(table):
    run = Runs()
    dying = SimpleNamespace(get_remaining_time_in_millis=lambda: -2_000)  # its deadline has passed

    def abandoned_run():
        # Meanwhile the sender retries: the dead invocation's claim has lapsed, the retry runs.
        retried = deliveries.answer_once(table, "d1", REQUEST, run)
        assert retried.repeated is False
        return {"status": 202, "body": {}}

    deliveries.answer_once(table, "d1", REQUEST, abandoned_run, dying)
    assert run.calls == 1


def test_a_failed_run_withdraws_its_claim_so_the_sender_may_try_again(table):
    def failing():
        raise errors.DrainInvalidState("host h1 is already being drained")

    with pytest.raises(errors.DrainInvalidState):
        deliveries.answer_once(table, "d1", REQUEST, failing)
    assert record(table, "d1") == {}

    run = Runs()
    assert deliveries.answer_once(table, "d1", REQUEST, run).repeated is False
    assert run.calls == 1


def test_an_answer_older_than_its_keeping_time_is_not_answered_again(table, monkeypatch):
    run = Runs()
    deliveries.answer_once(table, "d1", REQUEST, run)
    later = time.time() + deliveries.ANSWER_SECONDS + 60  # DynamoDB may not have deleted it yet
    monkeypatch.setattr(deliveries.time, "time", lambda: later)

    answer = deliveries.answer_once(table, "d1", {**REQUEST, "reason": "a new request"}, run)

    assert (answer.repeated, run.calls) == (False, 2)


def test_an_answer_that_cannot_be_stored_still_goes_back(table, monkeypatch):
    client = aws.client("dynamodb")

    def unavailable(**kwargs):
        raise client.exceptions.ProvisionedThroughputExceededException(
            {"Error": {"Code": "ProvisionedThroughputExceededException", "Message": "slow down"}}, "UpdateItem")

    monkeypatch.setattr(client, "update_item", unavailable)
    run = Runs()

    answer = deliveries.answer_once(table, "d1", REQUEST, run)

    assert (answer.repeated, run.calls) == (False, 1)
    assert record(table, "d1")["status"] == {"S": deliveries.IN_PROGRESS}, "the claim stays until it lapses"
