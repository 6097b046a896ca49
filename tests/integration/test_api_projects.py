"""The identity API's project look-ups through the real handler (SQLite and PostgreSQL)."""

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
