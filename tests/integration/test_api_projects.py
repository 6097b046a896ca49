"""The identity API's project, user and domain look-ups through the real handler (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs, urlsplit

import openstack.connection
import pytest
import requests
from keystoneauth1 import session as ks_session
from keystoneauth1 import token_endpoint
from openstackclient.identity import common as identity_common
from requests.adapters import BaseAdapter
from test_api_support import ADMIN, ALICE, BASE_URL, BOB, STAGE, Caller, call, create_server, mocked_cloud

from ferry import auth


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


def test_admins_list_the_projects_ferry_knows_and_look_any_project_up(cloud):
    auth.issue_token("carol", "project-c", ["member"])
    create_server(ALICE)
    assert call("PUT", "/v2.1/os-quota-sets/project-q", caller=ADMIN, body={"quota_set": {"cores": 3}}).status == 200

    listed = call("GET", "/identity/v3/projects", caller=ADMIN).body["projects"]
    assert {"project-a", "project-c", "project-q"} <= {p["id"] for p in listed}  # a server, a token, a quota
    shown = call("GET", "/identity/v3/projects/project-c", caller=ADMIN)
    assert shown.status == 200
    assert {k: shown.body["project"][k] for k in ("id", "name", "domain_id", "enabled")} == \
        {"id": "project-c", "name": "project-c", "domain_id": "default", "enabled": True}
    # a project with nothing yet (about to get a quota or a flavor) is one too, by id or by name
    assert call("GET", "/identity/v3/projects/project-new", caller=ADMIN).status == 200
    assert [p["id"] for p in call("GET", "/identity/v3/projects", caller=ADMIN,
                                  query={"name": "project-new"}).body["projects"]] == ["project-new"]
    assert call("GET", "/identity/v3/projects/not%20an%20id", caller=ADMIN).status == 404


def test_a_member_sees_only_her_own_project(cloud):
    create_server(ALICE)
    create_server(BOB)

    assert call("GET", "/identity/v3/projects/project-a", caller=ALICE).status == 200
    assert call("GET", "/identity/v3/projects/project-b", caller=ALICE).status == 404
    assert [p["id"] for p in call("GET", "/identity/v3/projects", caller=ALICE).body["projects"]] == ["project-a"]
    assert call("GET", "/identity/v3/projects", caller=ALICE, query={"name": "project-b"}).body["projects"] == []


# --- users ------------------------------------------------------------------------------------------


def test_admins_look_any_user_up_by_id_or_name_and_list_the_users_ferry_knows(cloud):
    # GIVEN a user with a token only and one owning a server
    auth.issue_token("carol", "project-c", ["member"])
    create_server(BOB)

    # WHEN an admin looks a user up as the CLI does (`--user U`: by id, then by name)
    shown = call("GET", "/identity/v3/users/carol", caller=ADMIN)
    named = call("GET", "/identity/v3/users", caller=ADMIN, query={"name": "dave"})
    listed = call("GET", "/identity/v3/users", caller=ADMIN)

    # THEN the name is the id; any well-formed id is a user; the list holds those Ferry knows
    assert shown.status == 200
    assert {k: shown.body["user"][k] for k in ("id", "name", "domain_id", "enabled")} == \
        {"id": "carol", "name": "carol", "domain_id": "default", "enabled": True}
    assert shown.body["user"]["links"]["self"].endswith("/identity/v3/users/carol")
    assert [u["id"] for u in named.body["users"]] == ["dave"]
    assert {"bob", "carol"} <= {u["id"] for u in listed.body["users"]}
    assert call("GET", "/identity/v3/users/not%20an%20id", caller=ADMIN).status == 404


def test_a_member_looks_up_only_herself_and_is_refused_another_user_as_keystone_refuses(cloud):
    create_server(ALICE)

    assert call("GET", "/identity/v3/users/alice", caller=ALICE).body["user"]["id"] == "alice"
    assert [u["id"] for u in call("GET", "/identity/v3/users", caller=ALICE).body["users"]] == ["alice"]
    # another user is 403, which clients take as "use the name as the id"
    other = call("GET", "/identity/v3/users/bob", caller=ALICE)
    assert other.status == 403 and "identity:get_user" in other.body["forbidden"]["message"]
    assert call("GET", "/identity/v3/users", caller=ALICE, query={"name": "bob"}).status == 403


# --- domains ----------------------------------------------------------------------------------------


class _ThroughTheHandler(BaseAdapter):
    """A transport for ``requests`` that hands each request to the API function as ``caller``."""

    def __init__(self, caller: Caller) -> None:
        super().__init__()
        self.caller = caller

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        url = urlsplit(request.url or "")
        answer = call(request.method or "GET", url.path.removeprefix(f"/{STAGE}"), caller=self.caller,
                      query=parse_qs(url.query))
        response = requests.Response()
        response.status_code, response.url, response.request = answer.status, request.url or "", request
        response.headers.update(answer.headers)
        response._content = json.dumps(answer.body).encode() if answer.body is not None else b""
        return response

    def close(self) -> None:
        pass


def _identity_proxy(caller: Caller) -> Any:
    """openstacksdk's identity proxy, as the CLI builds it, over the API function."""
    identity = f"{BASE_URL}/identity/v3"
    session = ks_session.Session(auth=token_endpoint.Token(identity, "token"))
    session.session.mount("https://", _ThroughTheHandler(caller))
    return openstack.connection.Connection(session=session, identity_endpoint_override=identity,
                                           identity_api_version="3").identity


@pytest.mark.parametrize("domain", ["default", "Default"])
@pytest.mark.parametrize("caller", [ADMIN, ALICE], ids=["admin", "member"])
def test_the_cli_finds_a_user_in_the_default_domain(cloud, caller, domain):
    # GIVEN carol, who has a token
    auth.issue_token("carol", "project-c", ["member"])
    user = "carol" if caller is ADMIN else caller.user_id

    # WHEN the CLI looks her up as `server list --user U --user-domain <id or name>` does (the domain first)
    found = identity_common.find_user_id_sdk(_identity_proxy(caller), user, domain)

    # THEN the domain is found and so is the user
    assert found == user


def test_there_is_one_domain_default_by_id_and_by_name(cloud):
    shown = call("GET", "/identity/v3/domains/default", caller=ALICE)
    other = call("GET", "/identity/v3/domains/other", caller=ADMIN)

    assert shown.status == 200
    assert {k: shown.body["domain"][k] for k in ("id", "name", "enabled")} == \
        {"id": "default", "name": "Default", "enabled": True}
    assert shown.body["domain"]["links"]["self"].endswith("/identity/v3/domains/default")
    assert (other.status, other.body["itemNotFound"]["message"]) == (404, "Could not find domain: other.")
    assert [d["id"] for d in call("GET", "/identity/v3/domains", caller=ALICE).body["domains"]] == ["default"]
    for name in ("Default", "default"):
        assert [d["id"] for d in call("GET", "/identity/v3/domains", caller=ADMIN,
                                      query={"name": name}).body["domains"]] == ["default"]
    assert call("GET", "/identity/v3/domains", caller=ADMIN, query={"name": "other"}).body["domains"] == []
    assert call("GET", "/identity/v3/domains", caller=None).status == 401
