"""The identity API's project and user look-ups through the real handler (SQLite and PostgreSQL)."""

from __future__ import annotations

import pytest
from test_api_support import ADMIN, ALICE, BOB, call, create_server, mocked_cloud

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
