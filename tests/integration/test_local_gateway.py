"""The local API Gateway: routing from the template, the REQUEST authorizer, the REST proxy event."""

from __future__ import annotations

import base64
import json
import socket
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from ferry.errors import LocalStackError, TemplateError
from ferry.local.gateway import ApiGateway
from ferry.local.runtime import FunctionRunner
from ferry.local.template import resolve

TEMPLATE = """
Transform: AWS::Serverless-2016-10-31
Parameters:
  Stage: {Type: String, Default: local}
Resources:
  Api:
    Type: AWS::Serverless::Api
    Properties:
      StageName: !Ref Stage
      Auth:
        DefaultAuthorizer: Tokens
        Authorizers:
          Tokens:
            FunctionArn: !GetAtt AuthorizerFunction.Arn
            FunctionPayloadType: REQUEST
            Identity: {Headers: [X-Auth-Token], ReauthorizeEvery: 0}
  AuthorizerFunction:
    Type: AWS::Serverless::Function
    Properties: {FunctionName: gw-authorizer, CodeUri: functions/authorizer/, Handler: app.handler}
  EchoFunction:
    Type: AWS::Serverless::Function
    Properties:
      FunctionName: gw-echo
      CodeUri: functions/echo/
      Handler: app.handler
      Events:
        Root:
          Type: Api
          Properties: {RestApiId: !Ref Api, Path: /v9, Method: GET, Auth: {Authorizer: NONE}}
        RootSlash:
          Type: Api
          Properties: {RestApiId: !Ref Api, Path: /v9/, Method: GET, Auth: {Authorizer: NONE}}
        Item:
          Type: Api
          Properties: {RestApiId: !Ref Api, Path: "/v9/items/{item_id}", Method: GET}
        Everything:
          Type: Api
          Properties: {RestApiId: !Ref Api, Path: "/v9/{proxy+}", Method: ANY}
"""

AUTHORIZER = """
def handler(event, context):
    token = event["headers"].get("X-Auth-Token") or event["headers"].get("x-auth-token")
    effect = {"good": "Allow", "deny": "Deny"}.get(token)
    if effect is None:
        if token == "broken":
            raise RuntimeError("the token store is down")
        raise Exception("Unauthorized")
    context_values = {"user_id": "u-1", "project_id": "p-1", "admin": False, "level": 3}
    if token == "deny":
        context_values = {}
    arn = event["methodArn"]
    return {
        "principalId": "u-1",
        "policyDocument": {
            "Version": "2012-10-17",
            "Statement": [{"Action": "execute-api:Invoke", "Effect": effect, "Resource": arn.split("/")[0] + "/*"}],
        },
        "context": context_values,
    }
"""

ECHO = """
import base64
import json
import threading
import time

calls = []
running = {"now": 0, "most": 0}
counting = threading.Lock()

def handler(event, context):
    calls.append(event)
    if event["path"].endswith("/slow"):
        with counting:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
        time.sleep(0.05)
        with counting:
            running["now"] -= 1
        return {"statusCode": 200, "body": json.dumps({"most": running["most"]})}
    if event["path"].endswith("/explode"):
        raise RuntimeError("boom")
    malformed = {
        "dict-body": {"statusCode": 200, "body": {"servers": []}},
        "no-status": {"body": "{}"},
        "string-status": {"statusCode": "200", "body": "{}"},
        "boolean-status": {"statusCode": True, "body": "{}"},
        "list-headers": {"statusCode": 200, "headers": [["X-A", "1"]], "body": "{}"},
    }
    if event["path"].rsplit("/", 1)[-1] in malformed:
        return malformed[event["path"].rsplit("/", 1)[-1]]
    if event["path"].endswith("/binary"):
        return {"statusCode": 200, "headers": {"Content-Type": "application/octet-stream"},
                "body": base64.b64encode(b"\\x00\\x01\\xff").decode(), "isBase64Encoded": True}
    return {
        "statusCode": 201 if event["httpMethod"] == "POST" else 200,
        "headers": {"Content-Type": "application/json", "X-Single": "one"},
        "multiValueHeaders": {"X-Multi": ["a", "b"]},
        "body": json.dumps({"event": event}),
    }
"""


GATEWAY_RESPONSES = """
      GatewayResponses:
        UNAUTHORIZED:
          StatusCode: 401
          ResponseTemplates: {application/json: '{"error": {"code": 401, "message": "Authenticate first."}}'}
        MISSING_AUTHENTICATION_TOKEN:
          StatusCode: 404
          ResponseTemplates: {application/json: '{"itemNotFound": {"code": 404, "message": "Not here."}}'}
        DEFAULT_4XX:
          StatusCode: 403
          ResponseTemplates: {application/json: '{"forbidden": {"code": 403, "message": "Not for you."}}'}
"""

# Entries that leave out their status code or their JSON body: API Gateway's own apply to what is left out.
PARTIAL_GATEWAY_RESPONSES = """
      GatewayResponses:
        UNAUTHORIZED:
          ResponseTemplates: {application/json: '{"error": {"code": 401, "message": "Authenticate first."}}'}
        MISSING_AUTHENTICATION_TOKEN:
          StatusCode: 404
        DEFAULT_4XX:
          ResponseTemplates: {text/plain: 'Not for you.'}
"""


# A stage throttle of 2 requests at once, refilled at 1 a minute, and what API Gateway answers over it.
THROTTLE = """
      MethodSettings:
        - {ResourcePath: "/*", HttpMethod: "*", ThrottlingRateLimit: 0.0166, ThrottlingBurstLimit: 2}
      GatewayResponses:
        THROTTLED:
          StatusCode: 429
          ResponseParameters: {Headers: {Retry-After: "'60'"}}
          ResponseTemplates: {application/json: '{"overLimit": {"code": 429, "message": "Slow down."}}'}
"""


def write_app(root: Path, gateway_responses: str = "") -> Path:
    for name, code in {"authorizer": AUTHORIZER, "echo": ECHO}.items():
        (root / "functions" / name).mkdir(parents=True)
        (root / "functions" / name / "app.py").write_text(textwrap.dedent(code))
    template = textwrap.dedent(TEMPLATE)
    if gateway_responses:
        anchor = "            Identity: {Headers: [X-Auth-Token], ReauthorizeEvery: 0}\n"
        template = template.replace(anchor, anchor + gateway_responses.lstrip("\n"), 1)
    (root / "template.yaml").write_text(template)
    return root / "template.yaml"


@pytest.fixture
def gateway(tmp_path) -> Iterator[ApiGateway]:
    model = resolve(write_app(tmp_path))
    with ApiGateway(model, FunctionRunner(model), port=0) as running:
        yield running


def _event(response: requests.Response) -> dict:
    return response.json()["event"]


def test_a_route_without_authorizer_needs_no_token(gateway):
    response = requests.get(gateway.url + "/v9")
    assert response.status_code == 200
    event = _event(response)
    assert event["resource"] == "/v9"
    assert "authorizer" not in event["requestContext"]
    assert _event(requests.get(gateway.url + "/v9/"))["resource"] == "/v9/"


def test_a_missing_token_is_401_without_calling_the_authorizer(gateway):
    response = requests.get(gateway.url + "/v9/servers")
    assert response.status_code == 401
    assert response.json() == {"message": "Unauthorized"}


def test_an_authorizer_raising_unauthorized_is_401(gateway):
    response = requests.get(gateway.url + "/v9/servers", headers={"X-Auth-Token": "stranger"})
    assert response.status_code == 401
    assert response.json() == {"message": "Unauthorized"}


def test_an_authorizer_failing_otherwise_is_500(gateway):
    response = requests.get(gateway.url + "/v9/servers", headers={"X-Auth-Token": "broken"})
    assert response.status_code == 500


def test_a_deny_policy_is_403(gateway):
    response = requests.get(gateway.url + "/v9/servers", headers={"X-Auth-Token": "deny"})
    assert response.status_code == 403
    assert "explicit deny" in response.json()["Message"]


def test_an_allowed_request_reaches_the_function_with_the_authorizer_context(gateway):
    response = requests.get(gateway.url + "/v9/servers/detail", headers={"X-Auth-Token": "good"})
    assert response.status_code == 200
    authorizer = _event(response)["requestContext"]["authorizer"]
    assert authorizer == {"user_id": "u-1", "project_id": "p-1", "admin": "false", "level": 3, "principalId": "u-1"}


def test_the_authorizer_gets_a_request_event_with_the_method_arn(gateway, monkeypatch):
    seen = []
    original = gateway.runner.invoke

    def spy(name, event, **kwargs):
        invocation = original(name, event, **kwargs)
        if name == "AuthorizerFunction":
            seen.append(event)
        return invocation

    monkeypatch.setattr(gateway.runner, "invoke", spy)
    requests.post(gateway.url + "/v9/servers/abc/action?x=1", headers={"X-Auth-Token": "good"}, json={})
    (event,) = seen
    assert event["type"] == "REQUEST"
    assert event["methodArn"] == (
        f"arn:aws:execute-api:us-east-1:123456789012:{gateway.rest_api_id}/local/POST/v9/servers/abc/action"
    )
    assert event["headers"]["X-Auth-Token"] == "good"
    assert event["multiValueHeaders"]["X-Auth-Token"] == ["good"]
    assert event["queryStringParameters"] == {"x": "1"}
    assert event["path"] == "/v9/servers/abc/action"
    assert event["httpMethod"] == "POST"
    assert event["requestContext"]["stage"] == "local"


def test_the_proxy_event_has_the_rest_v1_shape(gateway):
    response = requests.post(
        gateway.url + "/v9/servers/abc/action?tag=a&tag=b&limit=5",
        headers={"X-Auth-Token": "good", "X-Custom": "yes"},
        data=json.dumps({"migrate": None}),
    )
    assert response.status_code == 201
    event = _event(response)
    assert event["resource"] == "/v9/{proxy+}"
    assert event["path"] == "/v9/servers/abc/action"
    assert event["httpMethod"] == "POST"
    assert event["pathParameters"] == {"proxy": "servers/abc/action"}
    assert event["queryStringParameters"] == {"tag": "b", "limit": "5"}
    assert event["multiValueQueryStringParameters"] == {"tag": ["a", "b"], "limit": ["5"]}
    assert event["headers"]["X-Custom"] == "yes"
    assert event["headers"]["X-Forwarded-Proto"] == "http"
    assert event["multiValueHeaders"]["X-Custom"] == ["yes"]
    assert event["stageVariables"] is None
    assert json.loads(event["body"]) == {"migrate": None}
    assert event["isBase64Encoded"] is False
    context = event["requestContext"]
    assert context["resourcePath"] == "/v9/{proxy+}"
    assert context["httpMethod"] == "POST"
    assert context["stage"] == "local"
    assert context["identity"]["sourceIp"] == "127.0.0.1"
    assert response.headers["x-amzn-RequestId"] == context["requestId"]


def test_a_literal_or_parameter_route_beats_the_greedy_one(gateway):
    event = _event(requests.get(gateway.url + "/v9/items/42", headers={"X-Auth-Token": "good"}))
    assert event["resource"] == "/v9/items/{item_id}"
    assert event["pathParameters"] == {"item_id": "42"}


def test_an_unknown_path_is_403_missing_authentication_token(gateway):
    response = requests.get(gateway.url + "/nowhere")
    assert response.status_code == 403
    assert response.json() == {"message": "Missing Authentication Token"}
    assert requests.post(gateway.url + "/v9").status_code == 403


def test_the_function_response_is_written_back(gateway):
    response = requests.get(gateway.url + "/v9/anything", headers={"X-Auth-Token": "good"})
    assert response.headers["X-Single"] == "one"
    assert response.headers["X-Multi"] == "a, b"
    binary = requests.get(gateway.url + "/v9/binary", headers={"X-Auth-Token": "good"})
    assert binary.content == b"\x00\x01\xff"
    assert binary.headers["Content-Type"] == "application/octet-stream"


def test_a_function_gets_one_request_at_a_time_as_one_lambda_environment_does(gateway):
    def call(_index: int) -> int:
        response = requests.get(gateway.url + "/v9/slow", headers={"X-Auth-Token": "good"})
        assert response.status_code == 200
        return int(response.json()["most"])

    with ThreadPoolExecutor(max_workers=6) as pool:
        most = max(pool.map(call, range(12)))
    assert most == 1


def test_a_function_error_is_502(gateway):
    response = requests.get(gateway.url + "/v9/explode", headers={"X-Auth-Token": "good"})
    assert response.status_code == 502
    assert response.json() == {"message": "Internal server error"}


def test_a_binary_request_body_arrives_base64_encoded(gateway):
    response = requests.put(gateway.url + "/v9/blob", headers={"X-Auth-Token": "good"}, data=b"\xff\xfe\x00")
    event = _event(response)
    assert event["isBase64Encoded"] is True
    assert base64.b64decode(event["body"]) == b"\xff\xfe\x00"


def test_the_apis_gateway_responses_replace_api_gateways_own_answers(tmp_path):
    # GIVEN an API whose template sets its own answers for a missing token, an unknown path, and
    # (DEFAULT_4XX) every other error API Gateway answers itself
    model = resolve(write_app(tmp_path, GATEWAY_RESPONSES))
    with ApiGateway(model, FunctionRunner(model), port=0) as gateway:
        # WHEN API Gateway answers itself, THEN it answers as the template says
        missing = requests.get(gateway.url + "/v9/servers")
        unknown = requests.get(gateway.url + "/nowhere")
        denied = requests.get(gateway.url + "/v9/servers", headers={"X-Auth-Token": "deny"})
        allowed = requests.get(gateway.url + "/v9/servers", headers={"X-Auth-Token": "good"})

    assert (missing.status_code, missing.json()) == (401, {"error": {"code": 401, "message": "Authenticate first."}})
    assert (unknown.status_code, unknown.json()) == (404, {"itemNotFound": {"code": 404, "message": "Not here."}})
    assert (denied.status_code, denied.json()) == (403, {"forbidden": {"code": 403, "message": "Not for you."}})
    assert allowed.status_code == 200


def test_a_gateway_response_without_a_status_or_a_json_body_keeps_api_gateways_own(tmp_path):
    # GIVEN an API whose gateway responses leave out a status code, a body, or the JSON body
    model = resolve(write_app(tmp_path, PARTIAL_GATEWAY_RESPONSES))
    with ApiGateway(model, FunctionRunner(model), port=0) as gateway:
        # WHEN API Gateway answers itself
        missing = requests.get(gateway.url + "/v9/servers")
        unknown = requests.get(gateway.url + "/nowhere")
        denied = requests.get(gateway.url + "/v9/servers", headers={"X-Auth-Token": "deny"})

    # THEN what an entry gives replaces API Gateway's own answer, and only that
    assert (missing.status_code, missing.json()) == (401, {"error": {"code": 401, "message": "Authenticate first."}})
    assert (unknown.status_code, unknown.json()) == (404, {"message": "Missing Authentication Token"})
    assert denied.status_code == 403 and set(denied.json()) == {"Message"}



def test_a_request_over_the_stage_throttle_is_429_before_any_function_runs(tmp_path):
    # GIVEN a stage that takes 2 requests at once and one more a minute
    model = resolve(write_app(tmp_path, THROTTLE))
    assert model.apis["Api"].throttle is not None and model.apis["Api"].throttle.burst == 2
    with ApiGateway(model, FunctionRunner(model), port=0) as gateway:
        # WHEN a third request comes at once
        first, second = (requests.get(gateway.url + "/v9") for _ in range(2))
        third = requests.get(gateway.url + "/v9/servers", headers={"X-Auth-Token": "good"})

    # THEN the first two reach their function, the third is the template's THROTTLED answer
    assert (first.status_code, second.status_code) == (200, 200)
    assert (third.status_code, third.json()) == (429, {"overLimit": {"code": 429, "message": "Slow down."}})
    assert third.headers["Retry-After"] == "60"


def test_a_gateway_response_header_must_be_a_static_value(tmp_path):
    with pytest.raises(TemplateError, match="Retry-After is not a static value"):
        resolve(write_app(tmp_path, THROTTLE.replace("\"'60'\"", "method.request.header.Wait")))


@pytest.mark.parametrize("case", ["dict-body", "no-status", "string-status", "boolean-status", "list-headers"])
def test_a_malformed_proxy_response_is_502_as_api_gateway_answers_it(gateway, case):
    # GIVEN a function returning a body that is not a string, or no integer statusCode, ...
    # WHEN it is called through the API
    response = requests.get(gateway.url + f"/v9/{case}", headers={"X-Auth-Token": "good"})

    # THEN the client gets API Gateway's 502, not the function's status with the body's repr
    assert response.status_code == 502
    assert response.json() == {"message": "Internal server error"}


def test_a_kept_alive_connection_gets_no_answer_once_the_gateway_stopped(tmp_path):
    # GIVEN a client whose connection to the gateway is kept alive in its pool
    model = resolve(write_app(tmp_path))
    gateway = ApiGateway(model, FunctionRunner(model), port=0).start()
    session = requests.Session()
    try:
        assert session.get(gateway.url + "/v9", timeout=10).status_code == 200
    finally:
        # WHEN the gateway stops
        gateway.stop()

    # THEN the pooled connection is served no more, and no thread serves one
    with pytest.raises(requests.ConnectionError):
        session.get(gateway.url + "/v9", timeout=10)
    session.close()
    assert not [thread for thread in threading.enumerate() if thread.name == "api-connection"]


def test_a_taken_port_is_a_local_stack_error_naming_the_option_to_choose_another(tmp_path):
    model = resolve(write_app(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LocalStackError, match=f"127.0.0.1:{port} is in use .*--api-port"):
            ApiGateway(model, FunctionRunner(model), port=port).start()
