"""Projects on the local stack see only their own servers; an admin sees every project's when asking for it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_another_projects_server_is_not_found_and_not_listed(servers):
    server = servers.boot("demo", name="e2e-tenancy")
    server_id = server["id"]
    alt = servers.api("alt")

    response = alt.get(f"/servers/{server_id}")
    assert response.status_code == 404, response.text
    assert response.json()["itemNotFound"]["code"] == 404
    for path in ("/servers", "/servers/detail"):
        listed = alt.get(path)
        assert listed.status_code == 200, listed.text
        assert server_id not in {s["id"] for s in listed.json()["servers"]}
    # all_tenants is an admin's filter: a member asking for it is refused.
    assert alt.get("/servers/detail", params={"all_tenants": "1"}).status_code == 403
    assert alt.get(f"/servers/{server_id}/os-instance-actions").status_code == 404


def test_another_project_can_neither_stop_nor_delete_the_server(servers):
    server_id = servers.boot("demo", name="e2e-tenancy-actions")["id"]

    assert servers.action(server_id, {"os-stop": None}, identity="alt").status_code == 404
    assert servers.delete(server_id, identity="alt").status_code == 404

    after = servers.show(server_id)
    assert after["status"] == "ACTIVE"
    assert after["OS-EXT-STS:task_state"] is None
    assert after["OS-EXT-STS:power_state"] == 1


def test_admin_sees_the_server_with_all_tenants_only(servers):
    server_id = servers.boot("demo", name="e2e-tenancy-admin")["id"]
    admin = servers.api("admin")

    everyone = admin.get("/servers/detail", params={"all_tenants": "1"})
    assert everyone.status_code == 200, everyone.text
    listed = {s["id"]: s for s in everyone.json()["servers"]}
    assert listed[server_id]["tenant_id"] == "demo"
    own = admin.get("/servers/detail")
    assert server_id not in {s["id"] for s in own.json()["servers"]}
    demo_only = admin.get("/servers/detail", params={"all_tenants": "1", "project_id": "demo"})
    assert server_id in {s["id"] for s in demo_only.json()["servers"]}
    alt_only = admin.get("/servers/detail", params={"all_tenants": "1", "project_id": "alt"})
    assert server_id not in {s["id"] for s in alt_only.json()["servers"]}
    shown = admin.get(f"/servers/{server_id}")
    assert shown.status_code == 200
    assert shown.json()["server"]["tenant_id"] == "demo"
