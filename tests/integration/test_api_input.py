"""What the API refuses of any request before a route looks anything up, through the real handler
(SQLite and PostgreSQL): a NUL character in the path or the query string."""

from __future__ import annotations

import pytest
from test_api_support import ADMIN, ALICE, api_rows, call, create_server, mocked_cloud

from ferry.store.api_models import InstanceMapping


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


@pytest.mark.parametrize(("caller", "path", "query"), [
    (ALICE, "/v2.1/servers", {"marker": "\x00"}),
    (ALICE, "/v2.1/servers/detail", {"marker": "abc\x00def"}),
    (ADMIN, "/v2.1/servers", {"all_tenants": "1", "uuid": "\x00"}),
    (ADMIN, "/v2.1/servers", {"all_tenants": "1", "project_id": "project-a\x00"}),
    (ALICE, "/v2.1/servers/detail", {"flavor": "\x00"}),
    (ADMIN, "/v2.1/os-migrations", {"instance_uuid": "\x00"}),
    (ALICE, "/v2.1/flavors", {"marker": "\x00"}),
    (ALICE, "/v2.1/servers", {"name": ["vm", "\x00"]}),  # any of a repeated parameter's values
    (ALICE, "/v2.1/servers", {"na\x00me": "vm"}),  # and in a name
])
def test_a_nul_character_in_a_query_parameter_is_400(cloud, caller, path, query):
    create_server(name="vm")

    response = call("GET", path, caller=caller, query=query, version="2.90")

    assert response.status == 400, response.body
    assert "NUL character" in response.body["badRequest"]["message"]


@pytest.mark.parametrize("path", [
    "/v2.1/servers/\x00",  # as a gateway passes a decoded path
    "/v2.1/servers/%00",  # and as API Gateway's REST API passes it, still percent-encoded
    "/v2.1/flavors/\x00",
    "/v2.1/flavors/1%00",
    "/v2.1/os-server-groups/%00",
    "/v2.1/os-server-groups/\x00/",
])
def test_a_nul_character_in_the_path_is_400(cloud, path):
    response = call("GET", path, version="2.90")

    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == "Invalid request path: it may not contain a NUL character."
    assert response.header("x-openstack-request-id").startswith("req-")
    assert response.header("OpenStack-API-Version") == "compute 2.90"


@pytest.mark.parametrize("where", ["path", "query"])
def test_a_nul_character_refused_changes_nothing(cloud, where):
    # GIVEN a server, and its delete with a NUL in its path, or in a query parameter the delete
    # would otherwise ignore (and go on)
    server_id = create_server(name="vm")

    if where == "path":
        response = call("DELETE", f"/v2.1/servers/{server_id}%00")
    else:
        response = call("DELETE", f"/v2.1/servers/{server_id}", query={"force": "\x00"})

    assert response.status == 400
    assert api_rows(InstanceMapping, instance_uuid=server_id)[0].queued_for_delete is False


def test_a_percent_sign_without_nul_is_looked_up_as_before(cloud):
    assert call("GET", "/v2.1/servers/%2500", version="2.90").status == 404
    assert call("GET", "/v2.1/servers", query={"name": "%00"}, version="2.90").status == 200
