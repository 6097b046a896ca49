"""Nova's multiple create through the API handler: min_count/max_count servers in one request,
as many as the quota leaves room for, each its own build and boot workflow (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest
from test_api_support import ADMIN, api_rows, call, mocked_cloud

from ferry import quotas, workflows
from ferry.compute import api as compute_api
from ferry.store.api_models import BuildRequest, InstanceGroupMember, InstanceMapping, Port, RequestSpec, Volume

SERVERS = "/v2.1/servers"


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


def create(cloud, version: str = "2.90", hints: dict[str, Any] | None = None, **server: Any):
    body: dict[str, Any] = {"server": {"name": "web", "flavorRef": "1", "imageRef": cloud.image_id,
                                       "networks": "auto", **server}}
    if hints is not None:
        body["os:scheduler_hints"] = hints
    return call("POST", SERVERS, body=body, version=version)


def listed(query: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    servers = call("GET", f"{SERVERS}/detail", query=query or {}, version="2.90").body["servers"]
    return {server["name"]: server for server in servers}


def assert_nothing_written(cloud) -> None:
    assert api_rows(InstanceMapping) == [] and api_rows(BuildRequest) == [] and api_rows(RequestSpec) == []
    assert api_rows(Port) == [] and api_rows(InstanceGroupMember) == []
    assert cloud.executions("boot") == []


def test_max_count_servers_are_made_named_after_the_request_with_one_reservation(cloud):
    response = create(cloud, max_count=3)

    assert response.status == 202
    servers = listed()
    assert sorted(servers) == ["web-1", "web-2", "web-3"]
    assert response.body["server"]["id"] == servers["web-1"]["id"]  # the first, as Nova answers
    assert sorted(e["input"]["instance_uuid"] for e in cloud.executions("boot")) == sorted(
        s["id"] for s in servers.values())
    # one reservation, which the list filters by; each server its own hostname, port and launch index
    as_admin = listed_as_admin()
    assert {name: s["OS-EXT-SRV-ATTR:launch_index"] for name, s in as_admin.items()} == {
        "web-1": 0, "web-2": 1, "web-3": 2}
    reservation = {s["OS-EXT-SRV-ATTR:reservation_id"] for s in as_admin.values()}
    assert len(reservation) == 1
    assert sorted(listed({"reservation_id": reservation.pop()})) == ["web-1", "web-2", "web-3"]
    assert sorted(s["OS-EXT-SRV-ATTR:hostname"] for s in servers.values()) == ["web-1", "web-2", "web-3"]
    assert len({port.device_id for port in api_rows(Port)}) == 3


def listed_as_admin() -> dict[str, dict[str, Any]]:
    servers = call("GET", f"{SERVERS}/detail", caller=ADMIN, query={"all_tenants": "1"}, version="2.90")
    return {server["name"]: server for server in servers.body["servers"]}


def test_one_server_keeps_its_name(cloud):
    assert create(cloud, min_count=1, max_count=1).status == 202

    assert list(listed()) == ["web"]


def test_as_many_as_the_quota_allows_are_made_from_min_count_up(cloud):
    quotas.update("project-a", {"instances": 2})

    assert create(cloud, min_count=1, max_count=5).status == 202

    assert sorted(listed()) == ["web-1", "web-2"]


def test_min_count_over_the_quota_is_refused_and_nothing_is_written(cloud):
    quotas.update("project-a", {"cores": 3})  # three servers of one vCPU fit, four do not

    response = create(cloud, min_count=4, max_count=6)

    assert response.status == 403
    assert response.body["forbidden"]["message"] == (
        "Quota exceeded for cores: Requested 4, but already used 0 of 3 cores")
    assert_nothing_written(cloud)


def test_return_reservation_id_answers_the_reservation_of_all_of_them(cloud):
    response = create(cloud, max_count=2, return_reservation_id=True)

    assert list(response.body) == ["reservation_id"]
    assert sorted(listed({"reservation_id": response.body["reservation_id"]})) == ["web-1", "web-2"]


@pytest.mark.parametrize(("server", "message"), [
    ({"networks": [{"port": "22222222-2222-4222-8222-222222222222"}]}, "single configured port ID"),
    ({"networks": [{"uuid": "11111111-1111-4111-8111-111111111111", "fixed_ip": "10.0.0.9"}]},
     "max_count cannot be greater than 1 if an fixed_ip is specified."),
    ({"hostname": "web"}, "Cannot set the hostname of more than one server"),
    ({"imageRef": "", "block_device_mapping_v2": [{"boot_index": 0, "uuid": "33333333-3333-4333-8333-333333333333",
                                                   "source_type": "volume", "destination_type": "volume"}]},
     "Cannot attach one or more volumes to multiple instances"),
], ids=["port", "fixed ip", "hostname", "volume"])
def test_what_one_request_cannot_give_several_servers_is_refused(cloud, server, message):
    response = create(cloud, max_count=2, **server)

    assert response.status == 400
    assert message in response.body["badRequest"]["message"]
    assert_nothing_written(cloud)


def test_servers_from_an_image_volume_get_a_volume_each(cloud):
    bdm = [{"boot_index": 0, "uuid": cloud.image_id, "source_type": "image", "destination_type": "volume",
            "volume_size": 1, "delete_on_termination": True}]

    assert create(cloud, max_count=2, imageRef="", block_device_mapping_v2=bdm).status == 202

    assert len(api_rows(Volume)) == 2


def test_min_count_above_what_one_request_makes_is_refused(cloud, monkeypatch):
    monkeypatch.setattr(compute_api, "MAX_SERVERS_PER_CREATE", 3)
    quotas.update("project-a", {"instances": -1, "cores": -1, "ram": -1})

    refused = create(cloud, min_count=4, max_count=4)
    capped = create(cloud, min_count=1, max_count=1000)

    assert refused.status == 400 and "min_count may be at most 3" in refused.body["badRequest"]["message"]
    assert capped.status == 202
    assert sorted(listed()) == ["web-1", "web-2", "web-3"]


def test_a_group_that_cannot_take_them_all_refuses_the_request(cloud):
    group = call("POST", "/v2.1/os-server-groups", version="2.64",
                 body={"server_group": {"name": "g", "policy": "anti-affinity"}}).body["server_group"]["id"]
    quotas.update("project-a", {"server_group_members": 2})

    refused = create(cloud, max_count=3, hints={"group": group})
    accepted = create(cloud, max_count=2, hints={"group": group})

    assert refused.status == 403
    assert accepted.status == 202
    shown = call("GET", f"/v2.1/os-server-groups/{group}", version="2.64").body["server_group"]["members"]
    assert sorted(shown) == sorted(s["id"] for s in listed().values())


def refusing_the_second_start(monkeypatch) -> list[str]:
    """Step Functions refusing every start after the first; returns the servers started."""
    real_start, started = workflows.start_execution, []

    def start(arn, name, payload):
        if len(started) == 1:
            raise RuntimeError("Step Functions is unavailable")
        started.append(payload["instance_uuid"])
        return real_start(arn, name, payload)

    monkeypatch.setattr(workflows, "start_execution", start)
    return started


def test_a_workflow_that_does_not_start_takes_its_server_and_the_later_ones_back(cloud, monkeypatch):
    started = refusing_the_second_start(monkeypatch)

    # WHEN at least two servers are asked for, THEN the request fails, and only the first server is left
    response = create(cloud, min_count=2, max_count=3)

    assert response.status == 500
    assert [s["id"] for s in listed().values()] == started
    assert [m.instance_uuid for m in api_rows(InstanceMapping)] == started
    assert {p.device_id for p in api_rows(Port)} == set(started)


def test_servers_started_before_a_workflow_failed_are_the_answer_when_min_count_of_them_were(cloud, monkeypatch):
    started = refusing_the_second_start(monkeypatch)

    response = create(cloud, min_count=1, max_count=3)

    assert response.status == 202 and response.body["server"]["id"] == started[0]
    assert [s["id"] for s in listed().values()] == started
    assert [m.instance_uuid for m in api_rows(InstanceMapping)] == started


def test_long_names_give_each_server_a_hostname_of_its_own(cloud):
    assert create(cloud, name="a" * 70, max_count=3).status == 202

    hostnames = sorted(s["OS-EXT-SRV-ATTR:hostname"] for s in listed().values())
    assert hostnames == ["a" * 61 + "-1", "a" * 61 + "-2", "a" * 61 + "-3"]
    assert create(cloud, name="日本", max_count=2).status == 202  # nothing Latin-1 left: Server-<uuid> each
    assert len({s["OS-EXT-SRV-ATTR:hostname"] for s in listed().values()}) == 5
