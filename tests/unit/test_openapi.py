"""The OpenAPI document of the compute API: complete, valid, built from the routes' schemas, served without a token."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from openapi_spec_validator import validate

from ferry.api import aggregates, get_resolver, openapi, schemas, servers
from ferry.api.microversions import MAX_VERSION
from ferry.local.template import load_template

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


@pytest.fixture(scope="module")
def document() -> dict:
    return openapi.document("https://compute.example")


def _operations(document: dict) -> dict[tuple[str, str], dict]:
    return {(method.upper(), path): operation for path, item in document["paths"].items()
            for method, operation in item.items() if method in METHODS}


def test_every_route_of_the_router_is_in_the_document_and_nothing_else(document):
    app = get_resolver()
    served = {(route.method, route.openapi_path) for route in app._static_routes + app._dynamic_routes}

    assert served
    assert set(_operations(document)) == served


def test_the_document_is_a_valid_openapi_document(document):
    validate(document)
    assert document["openapi"].startswith("3.1")


def test_request_bodies_are_the_schemas_the_routes_check(document):
    operations = _operations(document)

    def body(method: str, path: str) -> dict:
        return operations[(method, f"/v2.1{path}")]["requestBody"]["content"]["application/json"]["schema"]

    assert body("POST", "/servers") == schemas.server_create(MAX_VERSION)
    assert body("POST", "/flavors") == schemas.flavor_create(MAX_VERSION)
    assert body("PUT", "/os-aggregates/{aggregate_id}") == aggregates.UPDATE
    actions = {next(iter(choice["required"])) for choice in body("POST", "/servers/{server_id}/action")["oneOf"]}
    assert actions == set(servers.ACTIONS) >= {"resize", "migrate", "confirmResize", "revertResize", "os-stop",
                                               "os-start", "os-resetState"}


def test_path_parameters_microversion_headers_and_errors_are_described(document):
    operation = _operations(document)[("GET", "/v2.1/servers/{server_id}/os-instance-actions/{request_id}")]
    parameters = operation["parameters"]

    assert [p["name"] for p in parameters if p.get("in") == "path"] == ["server_id", "request_id"]
    assert {"$ref": "#/components/parameters/microversion"} in parameters
    assert document["components"]["parameters"]["microversion"]["name"] == "OpenStack-API-Version"
    assert "compute latest" in document["components"]["parameters"]["microversion"]["schema"]["enum"]
    assert set(operation["responses"]) >= {"200", "400", "401", "403", "404"}
    fault = document["components"]["schemas"]["Fault"]
    assert fault["additionalProperties"]["required"] == ["code", "message"]


def test_only_discovery_and_the_document_need_no_token(document):
    public = {path for (_method, path), operation in _operations(document).items() if operation.get("security") == []}

    assert public == {"/", "/v2.1", "/identity/v3", "/volume/v3", "/v2.1/openapi.json"}
    assert document["security"] == [{"token": []}]


def test_the_template_serves_the_public_paths_without_the_authorizer():
    events = load_template(ROOT / "template.yaml")["Resources"]["ApiFunction"]["Properties"]["Events"]
    unauthenticated = {event["Properties"]["Path"] for event in events.values()
                       if event["Properties"].get("Auth", {}).get("Authorizer") == "NONE"}

    assert openapi.PUBLIC_PATHS <= unauthenticated


def test_the_resolver_serves_the_document_with_the_callers_base_url():
    event = {"resource": "/v2.1/openapi.json", "path": "/v2.1/openapi.json", "httpMethod": "GET",
             "headers": {"Host": "compute.example", "X-Forwarded-Proto": "https"},
             "multiValueHeaders": {}, "queryStringParameters": None, "multiValueQueryStringParameters": None,
             "pathParameters": None, "requestContext": {"requestId": "c6af9ac6-7b61-11e6-9a41-93e8deadbeef",
                                                        "path": "/v2.1/openapi.json", "stage": "prod"},
             "body": None, "isBase64Encoded": False}

    response = get_resolver().resolve(event, SimpleNamespace())

    assert response["statusCode"] == 200, response
    served = json.loads(response["body"])
    assert served["servers"] == [{"url": "https://compute.example"}]
    assert served["paths"].keys() == openapi.document().get("paths", {}).keys()


def test_a_body_that_is_not_utf8_is_a_bad_request_not_a_fault():
    """Found by the fuzz: the body decoded before the JSON parse could fail with a 500."""
    event = {"resource": "/v2.1/{proxy+}", "path": "/v2.1/os-aggregates", "httpMethod": "POST",
             "headers": {"Host": "compute.example"}, "multiValueHeaders": {}, "queryStringParameters": None,
             "multiValueQueryStringParameters": None, "pathParameters": None,
             "requestContext": {"requestId": "c6af9ac6-7b61-11e6-9a41-93e8deadbeef", "path": "/v2.1/os-aggregates",
                                "authorizer": {"user_id": "admin", "project_id": "admin", "roles": "admin"}},
             "body": base64.b64encode(b'{"aggregate": "\xbb"}').decode(), "isBase64Encoded": True}

    response = get_resolver().resolve(event, SimpleNamespace())

    assert response["statusCode"] == 400, response
    assert json.loads(response["body"]) == {"badRequest": {"code": 400, "message": "Malformed request body"}}
