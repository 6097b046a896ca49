"""Discovery documents, microversion negotiation and the error shapes, through the real handler."""

from __future__ import annotations

import pytest
from test_api_support import ADMIN, ALICE, BASE_URL, call, mocked_cloud

from ferry.api import servers as server_routes
from ferry.compute import api as compute_api

VARY = "OpenStack-API-Version, X-OpenStack-Nova-API-Version"


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


@pytest.mark.parametrize("path", ["/v2.1", "/v2.1/"])
def test_version_document_needs_no_token_and_links_to_itself_with_a_slash(path):
    response = call("GET", path, caller=None)

    assert response.status == 200
    assert response.body == {"version": {"id": "v2.1", "status": "CURRENT", "version": "2.96", "min_version": "2.1",
                                         "updated": "2013-07-23T11:33:21Z",
                                         "links": [{"rel": "self", "href": f"{BASE_URL}/v2.1/"}]}}


def test_the_root_lists_the_major_versions_without_a_token():
    response = call("GET", "/", caller=None)

    assert response.status == 200
    assert response.body == {"versions": [call("GET", "/v2.1", caller=None).body["version"]]}
    assert response.body["versions"][0]["links"] == [{"rel": "self", "href": f"{BASE_URL}/v2.1/"}]


def test_version_document_behind_a_custom_domain_has_no_stage_in_its_link():
    response = call("GET", "/v2.1", caller=None, custom_domain="compute.example.org")

    assert response.body["version"]["links"][0]["href"] == "https://compute.example.org/v2.1/"


def test_identity_version_document():
    response = call("GET", "/identity/v3", caller=None)

    assert response.body == {"version": {"id": "v3.14", "status": "stable",
                                         "links": [{"rel": "self", "href": f"{BASE_URL}/identity/v3"}]}}
    assert response.header("OpenStack-API-Version") is None


@pytest.mark.parametrize("headers, used", [
    ({}, "2.1"),
    ({"OpenStack-API-Version": "compute 2.60"}, "2.60"),
    ({"X-OpenStack-Nova-API-Version": "2.37"}, "2.37"),
    ({"OpenStack-API-Version": "placement 1.30, compute 2.79", "X-OpenStack-Nova-API-Version": "2.2"}, "2.79"),
    ({"OpenStack-API-Version": "compute latest"}, "2.96"),
])
def test_the_version_used_is_echoed_in_both_headers_and_vary(headers, used):
    response = call("GET", "/v2.1", caller=None, headers=headers)

    assert response.header("OpenStack-API-Version") == f"compute {used}"
    assert response.header("X-OpenStack-Nova-API-Version") == used
    assert response.header("Vary") == VARY


@pytest.mark.parametrize("requested", ["2.97", "3.0", "2.0"])
def test_a_version_outside_the_range_is_406(requested):
    response = call("GET", "/v2.1", caller=None, headers={"OpenStack-API-Version": f"compute {requested}"})

    assert response.status == 406
    assert response.body == {"computeFault": {"code": 406, "message": (
        f"Version {requested} is not supported by the API. Minimum is 2.1 and maximum is 2.96.")}}


def test_a_malformed_version_is_400():
    response = call("GET", "/v2.1", caller=None, headers={"X-OpenStack-Nova-API-Version": "two"})

    assert response.status == 400 and "invalid format" in response.body["badRequest"]["message"]


def test_errors_have_novas_shape(cloud, monkeypatch):
    malformed = call("POST", "/v2.1/servers", raw_body="{not json")
    unauthenticated = call("GET", "/v2.1/servers", caller=None)
    forbidden = call("POST", "/v2.1/flavors", body={"flavor": {"name": "x", "ram": 1, "vcpus": 1, "disk": 0}})
    missing = call("GET", "/v2.1/servers/4b8cbb4c-0000-4000-8000-00000000beef")
    no_route = call("GET", "/v2.1/no-such-collection")

    assert malformed.status == 400
    assert malformed.body == {"badRequest": {"code": 400, "message": "Malformed request body"}}
    assert unauthenticated.status == 401 and unauthenticated.body["unauthorized"]["code"] == 401
    assert forbidden.status == 403 and forbidden.body["forbidden"]["code"] == 403
    assert missing.status == 404 and missing.body["itemNotFound"]["code"] == 404
    assert no_route.status == 404 and no_route.body["itemNotFound"]["code"] == 404
    for response in (malformed, forbidden, missing, no_route):
        assert response.header("x-openstack-request-id").startswith("req-")
        assert response.header("Vary") == VARY


@pytest.mark.parametrize(("method", "path"), [
    ("PATCH", "/v2.1/servers/4b8cbb4c-0000-4000-8000-00000000beef"),
    ("DELETE", "/v2.1/os-migrations"),
    ("GET", "/v2.1/servers/4b8cbb4c-0000-4000-8000-00000000beef/action"),
    ("PATCH", "/v2.1/no-such-collection"),
])
def test_a_path_or_a_method_no_route_takes_is_404_as_novas_router_answers(cloud, method, path):
    response = call(method, path, caller=ADMIN, version="2.90")

    assert response.status == 404, response.body
    assert response.body["itemNotFound"]["code"] == 404
    assert response.header("x-openstack-request-id").startswith("req-")


def test_an_unexpected_error_is_a_500_without_internals(cloud, monkeypatch):
    def explode(*_args, **_kwargs):
        raise RuntimeError("password=hunter2 in /secret/path")
    monkeypatch.setattr(compute_api, "list_page", explode)

    response = call("GET", "/v2.1/servers/detail", caller=ALICE)

    assert response.status == 500
    message = response.body["computeFault"]["message"]
    assert "hunter2" not in message and "RuntimeError" not in message
    assert response.header("x-openstack-request-id") in message


def test_a_bad_action_body_is_400_with_the_schema_message(cloud):
    response = call("POST", "/v2.1/servers/4b8cbb4c-0000-4000-8000-00000000beef/action",
                    body={"os-stop": {"force": True}})

    assert response.status == 400
    assert "os-stop" in response.body["badRequest"]["message"]
    assert set(server_routes.ACTIONS) >= {"os-stop", "os-start"}
