"""The signed drain webhook (functions/drain_webhook, ferry.webhook) over moto and a real store.

The function's settings, the idempotency table and the drain state machine's name come from
template.yaml. The drain state machine is a placeholder that does not run: the tests count the
executions the webhook starts and the drains it records.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from moto import mock_aws
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from test_api_support import function

from ferry import aws, config, errors, signing
from ferry import drains as drains_module
from ferry.local.gateway import ApiGateway
from ferry.local.runtime import FunctionRunner
from ferry.local.stack import LocalStack
from ferry.local.template import LocalTemplate, resolve
from ferry.store import setup
from ferry.store.api_models import Drain
from ferry.store.db import api_session

ROOT = Path(__file__).resolve().parents[2]
SECRET = "webhook-secret-for-tests"
CALLBACK_SECRET = "callback-secret-for-tests"
PASS_DEFINITION = json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Succeed"}}})
# What the function itself sets (the rest is Globals, which the test store replaces).
FUNCTION_SETTINGS = ("FERRY_WEBHOOK_SECRET", "FERRY_CALLBACK_SECRET", "FERRY_IDEMPOTENCY_TABLE",
                     "FERRY_DRAIN_STATE_MACHINE_ARN")


class LambdaContext:
    function_name = "ferry-local-drain-webhook"
    memory_limit_in_mb = 512
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:ferry-local-drain-webhook"

    def __init__(self) -> None:
        self.aws_request_id = str(uuid.uuid4())

    def get_remaining_time_in_millis(self) -> int:
        return 60_000


@dataclass
class Cloud:
    model: LocalTemplate
    sfn: Any
    dynamodb: Any
    drain_machine_arn: str
    table: str

    def executions(self) -> list[dict[str, Any]]:
        """Executions of the drain state machine, with their parsed input."""
        listed = self.sfn.list_executions(stateMachineArn=self.drain_machine_arn)["executions"]
        return [{"name": e["name"], "input": json.loads(
            self.sfn.describe_execution(executionArn=e["executionArn"])["input"])} for e in listed]


def _template(secret: str, callback_secret: str = CALLBACK_SECRET) -> LocalTemplate:
    return resolve(ROOT / "template.yaml",
                   parameters={"DrainWebhookSecret": secret, "DrainCallbackSecret": callback_secret})


@pytest.fixture
def cloud(aws_test_credentials, sqlite_store, monkeypatch) -> Iterator[Cloud]:
    """moto with the template's idempotency table and a placeholder drain state machine; hosts h1
    and h2 in cell1; the webhook function's settings from the template."""
    model = _template(SECRET)
    webhook = model.functions["DrainWebhookFunction"]
    for name in FUNCTION_SETTINGS:
        monkeypatch.setenv(name, webhook.environment[name])
    table = model.tables["IdempotencyTable"]
    machine = model.state_machines["DrainStateMachine"]
    with mock_aws():
        aws.reset()
        config.reset()
        dynamodb = aws.client("dynamodb")
        dynamodb.create_table(TableName=table.name, KeySchema=table.key_schema,
                              AttributeDefinitions=table.attribute_definitions, BillingMode=table.billing_mode)
        sfn = aws.client("stepfunctions")
        arn = sfn.create_state_machine(name=machine.name, definition=PASS_DEFINITION,
                                       roleArn="arn:aws:iam::123456789012:role/ferry-test")["stateMachineArn"]
        assert arn == webhook.environment["FERRY_DRAIN_STATE_MACHINE_ARN"]
        for host in ("h1", "h2"):
            setup.map_host(host, "cell1")
        yield Cloud(model=model, sfn=sfn, dynamodb=dynamodb, drain_machine_arn=arn, table=table.name)
        aws.reset()
    config.reset()


def _body(drain: dict[str, Any] | None = None) -> bytes:
    return json.dumps({"drain": drain if drain is not None else {"host": "h1", "reason": "disk replacement"}}).encode()


def _event(body: bytes | None, headers: dict[str, str], *, base64_body: bool = False) -> dict[str, Any]:
    """A REST API (v1) proxy event for POST /webhooks/drain (no authorizer on this route)."""
    all_headers = {"Host": "abc123.execute-api.us-east-1.amazonaws.com", "Content-Type": "application/json",
                   **headers}
    if body is None:
        text = None
    elif base64_body:
        text = base64.b64encode(body).decode()
    else:
        text = body.decode()
    return {
        "resource": "/webhooks/drain",
        "path": "/webhooks/drain",
        "httpMethod": "POST",
        "headers": all_headers,
        "multiValueHeaders": {k: [v] for k, v in all_headers.items()},
        "queryStringParameters": None,
        "multiValueQueryStringParameters": None,
        "pathParameters": None,
        "stageVariables": None,
        "requestContext": {"resourcePath": "/webhooks/drain", "httpMethod": "POST", "stage": "local",
                           "requestId": str(uuid.uuid4()), "identity": {"sourceIp": "127.0.0.1"}},
        "body": text,
        "isBase64Encoded": base64_body,
    }


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: Any
    text: str


def post(body: bytes | None, headers: dict[str, str], *, base64_body: bool = False) -> Answer:
    """Invoke the webhook function as API Gateway does."""
    result = function("drain_webhook").handler(_event(body, headers, base64_body=base64_body), LambdaContext())
    return Answer(result["statusCode"], result["headers"], json.loads(result["body"]), result["body"])


def signed(body: bytes, delivery: str | None = None, *, secret: str = SECRET, at: float | None = None
           ) -> dict[str, str]:
    return signing.signed_headers(secret, body, delivery_id=delivery or str(uuid.uuid4()), now=at)


def drains() -> list[Drain]:
    with api_session() as session:
        found = list(session.scalars(select(Drain)))
        session.expunge_all()
        return found


def assert_nothing_started(cloud: Cloud) -> None:
    assert drains() == []
    assert cloud.executions() == []


def assert_fault(answer: Answer, status: int, kind: str, message_part: str) -> None:
    assert answer.status == status, answer.body
    assert answer.headers["Content-Type"] == "application/json"
    assert list(answer.body) == [kind]
    assert answer.body[kind]["code"] == status
    assert message_part in answer.body[kind]["message"]


# --- accepted ----------------------------------------------------------------------------------


def test_a_signed_request_starts_exactly_one_drain(cloud):
    body = _body()

    answer = post(body, signed(body, "delivery-1"))

    assert answer.status == 202, answer.body
    assert answer.headers["Content-Type"] == "application/json"
    [drain] = drains()
    assert answer.body["drain"]["id"] == drain.uuid
    assert (drain.origin, drain.idempotency_key, drain.targets, drain.reason) == (
        "webhook", "webhook:delivery-1", ["h1"], "disk replacement")
    assert drain.user_id == "ferry-webhook"
    [execution] = cloud.executions()
    assert execution["name"] == f"drain-{drain.uuid}"
    assert execution["input"]["drain_uuid"] == drain.uuid


def test_the_same_delivery_again_gets_the_first_answer_and_starts_nothing(cloud):
    body = _body()
    headers = signed(body, "delivery-1")
    first = post(body, headers)

    again = post(body, headers)
    # A sender's retry signs the same delivery anew: a later timestamp, another signature.
    resigned = post(body, signed(body, "delivery-1", at=time.time() + 5))

    assert first.status == 202
    assert (again.status, again.text) == (first.status, first.text)
    assert (resigned.status, resigned.body) == (first.status, first.body)
    assert [d.uuid for d in drains()] == [first.body["drain"]["id"]]
    assert len(cloud.executions()) == 1


def test_the_same_signature_under_another_delivery_is_a_replay(cloud):
    body = _body()
    headers = signed(body, "delivery-1")
    first = post(body, headers)

    replay = post(body, {**headers, "X-Ferry-Delivery": "delivery-2"})

    assert first.status == 202
    assert_fault(replay, 409, "conflictingRequest", "already used by another delivery")
    assert len(drains()) == 1
    assert len(cloud.executions()) == 1


def test_a_replay_is_refused_before_any_drain_is_made(cloud):
    body = _body()
    headers = signed(body, "delivery-1")
    first = post(body, headers)
    # The drain finished; its hosts may be drained again, but not by replaying the old request.
    with api_session() as session:
        session.scalars(select(Drain)).one().status = "completed"

    replay = post(body, {**headers, "X-Ferry-Delivery": "delivery-2"})

    assert first.status == 202
    assert_fault(replay, 409, "conflictingRequest", "already used by another delivery")
    assert len(drains()) == 1
    assert len(cloud.executions()) == 1


def test_a_used_signature_is_kept_until_its_timestamp_can_no_longer_be_accepted(cloud):
    body = _body()
    headers = signed(body, "delivery-1")

    post(body, headers)

    digest = headers["X-Ferry-Signature"].removeprefix("sha256=")
    item = cloud.dynamodb.get_item(TableName=cloud.table, Key={"id": {"S": f"webhook-signature#{digest}"}})["Item"]
    assert item["delivery"] == {"S": "delivery-1"}
    assert int(item["expiration"]["N"]) == int(headers["X-Ferry-Timestamp"]) + signing.MAX_AGE_SECONDS + 60


def test_a_signature_made_ahead_of_the_clock_keeps_its_nonce_until_it_can_no_longer_be_accepted(cloud, monkeypatch):
    # GIVEN a request signed at 1301, first used at 1000.9 (300.1 s ahead of Ferry's clock, as a
    # check rounding to whole seconds accepts it)
    from ferry import webhook

    body = _body()
    headers = signed(body, "delivery-1", at=1301)
    used = signing.SignedRequest(timestamp=1301, signature=headers["X-Ferry-Signature"].removeprefix("sha256="),
                                 delivery="delivery-1")
    monkeypatch.setattr(webhook.time, "time", lambda: 1000.9)
    webhook._spend_signature(cloud.table, used, "delivery-1")

    # WHEN it is replayed under another delivery id at 1601.0, when its signature is still accepted
    monkeypatch.setattr(webhook.time, "time", lambda: 1601.0)
    replayed = signing.verify(SECRET, {**headers, "X-Ferry-Delivery": "delivery-2"}, body, now=1601.0)

    # THEN its nonce is still there: the replay is refused
    with pytest.raises(errors.WebhookReplayed):
        webhook._spend_signature(cloud.table, replayed, "delivery-2")


def test_a_base64_encoded_body_is_verified_on_its_bytes(cloud):
    body = _body({"host": "h2"})

    answer = post(body, signed(body), base64_body=True)

    assert answer.status == 202, answer.body
    assert [d.targets for d in drains()] == [["h2"]]


def test_a_dry_run_answers_200_with_the_plan_and_starts_no_execution(cloud):
    body = _body({"host": "h1", "dry_run": True})

    answer = post(body, signed(body))

    assert answer.status == 200, answer.body
    [drain] = drains()
    assert drain.dry_run is True
    assert answer.body["drain"]["id"] == drain.uuid
    assert cloud.executions() == []


def test_a_delivery_id_is_never_taken_for_a_drain_started_another_way(cloud):
    # GIVEN a drain of h2 recorded by an execution started directly (its key names the execution)
    other, _created = drains_module.record_drain(drains_module.operator_context(None), {"host": "h2"},
                                                 origin="execution", idempotency_key="execution:drain-x",
                                                 execution_name="drain-x")

    # WHEN a delivery whose id reads like that key asks to drain h1
    body = _body()
    answer = post(body, signed(body, "execution:drain-x"))

    # THEN it starts its own drain, of h1
    assert answer.status == 202, answer.body
    assert answer.body["drain"]["id"] != other and answer.body["drain"]["target"]["names"] == ["h1"]


def test_a_dry_run_whose_plan_failed_is_planned_when_its_delivery_comes_again(cloud, monkeypatch):
    # GIVEN a dry run whose plan failed, a database away for the moment (the sender got a 503:
    # try again)
    body = _body({"host": "h1", "dry_run": True})
    headers = signed(body, "delivery-dry")
    plan = drains_module.plan

    def failing(drain_uuid):
        raise OperationalError("SELECT", {}, ConnectionRefusedError("database unreachable"))

    monkeypatch.setattr(drains_module, "plan", failing)
    refused = post(body, headers)
    assert refused.status == 503, refused.body
    assert "try again" in refused.body["serviceUnavailable"]["message"]
    monkeypatch.setattr(drains_module, "plan", plan)

    # WHEN the sender tries the same delivery again
    answer = post(body, headers)

    # THEN it is planned, not answered as planning for ever
    assert answer.status == 200, answer.body
    assert answer.body["drain"]["status"] == "planned"
    [drain] = drains()
    assert drain.status == "planned"


def test_a_dry_run_its_first_try_abandoned_is_failed_and_its_delivery_again_plans_a_new_one(cloud, monkeypatch):
    # GIVEN a dry run whose function died while planning it, over 2 minutes ago
    body = _body({"host": "h1", "dry_run": True})
    headers = signed(body, "delivery-dry")
    def killed(drain_uuid):
        raise OperationalError("SELECT", {}, ConnectionRefusedError("database unreachable"))

    with monkeypatch.context() as patched:
        patched.setattr(drains_module, "plan", killed)
        assert post(body, headers).status == 503
    [abandoned] = drains()
    long_ago = drains_module.utcnow() - drains_module.DRY_RUN_PLANNING_LIMIT - dt.timedelta(seconds=1)
    with api_session() as session:
        session.execute(update(Drain).where(Drain.id == abandoned.id).values(created_at=long_ago, updated_at=long_ago))

    # WHEN the sender tries the same delivery again
    answer = post(body, signed(body, "delivery-dry"))

    # THEN the abandoned one is failed, and a new dry run is planned
    assert answer.status == 200, answer.body
    assert answer.body["drain"]["status"] == "planned" and answer.body["drain"]["id"] != abandoned.uuid
    statuses = {d.uuid: (d.status, d.message) for d in drains()}
    assert statuses[abandoned.uuid] == ("failed", drains_module.DRY_RUN_ABANDONED)


def test_a_refused_drain_is_not_remembered_for_its_delivery(cloud):
    body = _body({"host": "nowhere"})
    headers = signed(body, "delivery-1")

    refused = post(body, headers)
    again = post(body, headers)

    assert_fault(refused, 400, "badRequest", "nowhere")
    assert again.status == 400
    assert_nothing_started(cloud)


# --- refused -----------------------------------------------------------------------------------


def test_the_same_delivery_with_another_body_after_its_record_expired_is_refused(cloud):
    # GIVEN a delivery answered more than 24 hours ago: its record in the table has expired
    first_body, other_body = _body({"host": "h1"}), _body({"host": "h2"})
    first = post(first_body, signed(first_body, "delivery-1"))
    cloud.dynamodb.delete_item(TableName=cloud.table, Key={"id": {"S": "drain-webhook-delivery#delivery-1"}})

    # WHEN the same delivery id comes with another body, and then with the first one again
    answer = post(other_body, signed(other_body, "delivery-1"))
    repeated = post(first_body, signed(first_body, "delivery-1", at=time.time() + 1))

    # THEN the drain the delivery id recorded refuses the other body, and names itself to the first
    assert_fault(answer, 409, "conflictingRequest", "was used for a different drain request")
    assert repeated.status == 200 and repeated.body["drain"]["id"] == first.body["drain"]["id"]
    assert [d.targets for d in drains()] == [["h1"]]
    assert len(cloud.executions()) == 1


def test_the_same_delivery_with_another_body_is_refused(cloud):
    first_body, other_body = _body({"host": "h1"}), _body({"host": "h2"})
    post(first_body, signed(first_body, "delivery-1"))

    answer = post(other_body, signed(other_body, "delivery-1"))

    assert_fault(answer, 409, "conflictingRequest", "already used for a different drain request")
    assert [d.targets for d in drains()] == [["h1"]]
    assert len(cloud.executions()) == 1


def test_a_bad_signature_is_refused(cloud):
    body = _body()

    answer = post(body, signed(body, secret="not-the-secret"))

    assert_fault(answer, 401, "unauthorized", "does not match")
    assert_nothing_started(cloud)


def test_a_tampered_body_is_refused(cloud):
    body = _body()
    headers = signed(body)

    answer = post(body.replace(b"h1", b"h2"), headers)

    assert_fault(answer, 401, "unauthorized", "does not match")
    assert_nothing_started(cloud)


def test_a_stale_timestamp_is_refused(cloud):
    body = _body()

    answer = post(body, signed(body, at=time.time() - 400))

    assert_fault(answer, 401, "unauthorized", "s old; requests older than 300 s are refused")
    assert_nothing_started(cloud)


def test_a_timestamp_from_the_future_is_refused(cloud):
    body = _body()

    answer = post(body, signed(body, at=time.time() + 400))

    assert_fault(answer, 401, "unauthorized", "in the future")
    assert_nothing_started(cloud)


def test_missing_signature_headers_are_refused(cloud):
    answer = post(_body(), {"X-Ferry-Delivery": "delivery-1"})

    assert_fault(answer, 401, "unauthorized", "X-Ferry-Timestamp is missing")
    assert_nothing_started(cloud)


def test_malformed_json_is_refused(cloud):
    body = b'{"drain": {"host": "h1"'

    answer = post(body, signed(body))

    assert_fault(answer, 400, "badRequest", "not valid JSON")
    assert_nothing_started(cloud)


@pytest.mark.parametrize(
    ("document", "complaint"),
    [
        ({"host": "h1", "max_concurrency": 0}, "at max_concurrency: is less than the minimum of 1"),
        ({"host": "h1", "color": "blue"}, "Additional properties are not allowed"),
        ({"reason": "no target"}, "name exactly one of 'host', 'hosts' or 'cell'"),
        (None, '"drain" is a required property'),
    ],
)
def test_a_body_that_is_not_a_drain_request_is_refused(cloud, document, complaint):
    body = json.dumps({"drain": document} if document is not None else {"host": "h1"}).encode()

    answer = post(body, signed(body))

    assert_fault(answer, 400, "badRequest", complaint)
    assert_nothing_started(cloud)


TOKEN = "t0ken-n0t-to-be-repeated"
CALLBACK = f"https://ops.example.com/ferry?token={TOKEN}"
# Bodies the schema refuses for their callback URL or their shape; each refusal's wording by the
# schema would repeat the URL (pattern, maxLength) or the whole drain (oneOf).
BAD_DRAINS = {
    "space in the URL": {"host": "h1", "callback_url": CALLBACK + " x"},
    "URL over 2048 characters": {"host": "h1", "callback_url": CALLBACK + "a" * 2048},
    "host and cell both named": {"host": "h1", "cell": "cell1", "callback_url": CALLBACK},
}


def logged(caplog, capsys) -> str:
    """Everything logged: the records with their extra fields, and the JSON lines Powertools printed."""
    return "\n".join(str(vars(record)) for record in caplog.records) + capsys.readouterr().out


@pytest.mark.parametrize("drain", BAD_DRAINS.values(), ids=BAD_DRAINS.keys())
def test_a_refused_drain_request_repeats_its_callback_url_neither_in_the_answer_nor_in_the_log(
        cloud, caplog, capsys, drain):
    body = _body(drain)

    answer = post(body, signed(body))

    assert_fault(answer, 400, "badRequest", "Invalid drain request")
    assert TOKEN not in answer.text
    assert TOKEN not in logged(caplog, capsys)
    assert_nothing_started(cloud)


@pytest.mark.parametrize("delivery", [None, "", "x" * 129])
def test_a_missing_or_overlong_delivery_id_is_refused(cloud, delivery):
    body = _body()
    headers = signed(body)
    if delivery is None:
        del headers["X-Ferry-Delivery"]
    else:
        headers["X-Ferry-Delivery"] = delivery

    answer = post(body, headers)

    assert_fault(answer, 400, "badRequest", "X-Ferry-Delivery must name the delivery in 1 to 128 characters")
    assert_nothing_started(cloud)


def test_a_callback_url_is_refused_while_callbacks_are_not_configured(cloud, monkeypatch):
    # GIVEN a stack with the webhook's secret and an empty DrainCallbackSecret
    monkeypatch.setenv("FERRY_CALLBACK_SECRET", _template(SECRET, "").functions["DrainWebhookFunction"].environment[
        "FERRY_CALLBACK_SECRET"])
    config.reset()
    body = _body({"host": "h1", "callback_url": CALLBACK})
    headers = signed(body, "delivery-1")

    # WHEN a signed request names a callback URL
    answer = post(body, headers)

    # THEN it is refused before its signature is spent, and never repeats the URL
    assert_fault(answer, 400, "badRequest", "Drain callbacks are not configured")
    assert TOKEN not in answer.text
    assert_nothing_started(cloud)
    digest = headers["X-Ferry-Signature"].removeprefix("sha256=")
    nonce = {"id": {"S": f"webhook-signature#{digest}"}}
    assert "Item" not in cloud.dynamodb.get_item(TableName=cloud.table, Key=nonce)


def test_a_callback_url_with_credentials_is_refused(cloud):
    body = _body({"host": "h1", "callback_url": f"https://hook:pa55@ops.example.com/ferry?token={TOKEN}"})

    answer = post(body, signed(body))

    assert_fault(answer, 400, "badRequest", "at callback_url: must not carry a user name or password")
    assert TOKEN not in answer.text and "pa55" not in answer.text
    assert_nothing_started(cloud)


def test_the_webhook_function_holds_both_secrets_and_the_other_drain_functions_only_the_callbacks(cloud):
    functions = cloud.model.functions
    webhook = functions["DrainWebhookFunction"].environment

    assert (webhook["FERRY_WEBHOOK_SECRET"], webhook["FERRY_CALLBACK_SECRET"]) == (SECRET, CALLBACK_SECRET)
    for logical_id in ("ApiFunction", "BeginDrainFunction", "PlanDrainFunction", "FinishDrainFunction"):
        assert functions[logical_id].environment["FERRY_CALLBACK_SECRET"] == CALLBACK_SECRET, logical_id
        assert "FERRY_WEBHOOK_SECRET" not in functions[logical_id].environment, logical_id


def test_without_a_secret_the_webhook_refuses_everything(cloud, monkeypatch):
    monkeypatch.setenv("FERRY_WEBHOOK_SECRET", _template("").functions["DrainWebhookFunction"].environment[
        "FERRY_WEBHOOK_SECRET"])
    config.reset()
    body = _body()

    answer = post(body, signed(body))

    assert_fault(answer, 503, "computeFault", "no webhook secret is set")
    assert_nothing_started(cloud)


def test_a_webhook_secret_the_same_as_the_callback_secret_turns_the_webhook_off(cloud, monkeypatch):
    # GIVEN a stack deployed with one secret for both: every callback's receiver holds it
    functions = _template(SECRET, SECRET).functions
    monkeypatch.setenv("FERRY_CALLBACK_SECRET", functions["DrainWebhookFunction"].environment["FERRY_CALLBACK_SECRET"])
    config.reset()
    body = _body()

    # WHEN a request signed with it comes
    answer = post(body, signed(body))

    # THEN it starts nothing, and the operator reads why
    assert_fault(answer, 503, "computeFault", "DrainWebhookSecret is the same as DrainCallbackSecret")
    assert_nothing_started(cloud)


def test_a_refusal_is_logged_and_counted(cloud, monkeypatch):
    from ferry import webhook

    counted: list[str] = []
    add_metric = webhook.metrics.add_metric

    def spy(name: str, **kwargs: Any) -> None:
        counted.append(name)
        add_metric(name=name, **kwargs)

    monkeypatch.setattr(webhook.metrics, "add_metric", spy)
    body = _body()

    post(body, signed(body, secret="not-the-secret"))
    post(body, signed(body, "delivery-1"))
    post(body, signed(body, "delivery-1"))

    assert counted == ["WebhookRefused", "WebhookDrainAccepted", "WebhookDeliveryRepeated"]


# --- through the local API gateway -------------------------------------------------------------


def test_the_local_gateway_routes_the_webhook_without_a_token(cloud):
    gateway = ApiGateway(cloud.model, FunctionRunner(cloud.model), port=0).start()
    try:
        body = _body()
        answer = requests.post(f"{gateway.url}/webhooks/drain", data=body, headers=signed(body), timeout=30)
        token_route = requests.get(f"{gateway.url}/v2.1/servers", timeout=30)
    finally:
        gateway.stop()

    assert answer.status_code == 202, answer.text
    assert answer.headers["Content-Type"] == "application/json"
    assert answer.json()["drain"]["id"] == drains()[0].uuid
    assert len(cloud.executions()) == 1
    # The compute API beside it still wants a token.
    assert token_route.status_code == 401


def test_the_local_stack_keeps_a_webhook_secret_and_serves_the_webhook(tmp_path):
    state = tmp_path / "state"
    with LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread") as stack:
        secret_file = stack.webhook_secret_file
        secret = stack.webhook_secret
        callback_secret = stack.callback_secret
        table = stack.model.tables["IdempotencyTable"].name
        dynamodb = stack.aws.client("dynamodb")
        ttl = dynamodb.describe_time_to_live(TableName=table)["TimeToLiveDescription"]
        body = json.dumps({"drain": {"host": "cell1-host1", "dry_run": True}}).encode()
        planned = requests.post(stack.webhook_url, data=body, headers=signed(body, secret=secret), timeout=60)
        unsigned = requests.post(stack.webhook_url, data=body, headers={"X-Ferry-Delivery": "d"}, timeout=60)
    with LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread") as again:
        kept = again.webhook_secret
        kept_callback_secret = again.callback_secret

    assert secret_file == state.resolve() / "webhook-secret"
    assert secret and secret_file.read_text().strip() == secret
    assert secret_file.stat().st_mode & 0o777 == 0o600
    # and a callback secret of its own beside it, kept the same way
    callback_file = state.resolve() / "callback-secret"
    assert callback_secret and callback_secret != secret and kept_callback_secret == callback_secret
    assert callback_file.read_text().strip() == callback_secret and callback_file.stat().st_mode & 0o777 == 0o600
    assert ttl == {"TimeToLiveStatus": "ENABLED", "AttributeName": "expiration"}
    assert planned.status_code == 200, planned.text
    assert planned.json()["drain"]["status"] == "planned"
    assert unsigned.status_code == 401
    assert kept == secret


def test_a_webhook_secret_given_to_the_local_stack_is_used_and_not_kept(tmp_path):
    state = tmp_path / "state"
    with LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread",
                    webhook_secret="given-secret") as stack:
        body = _body({"host": "cell1-host1", "dry_run": True})
        answer = requests.post(stack.webhook_url, data=body, headers=signed(body, secret="given-secret"), timeout=60)

    assert answer.status_code == 200, answer.text
    assert not (state / "webhook-secret").exists()
