"""The servers API through the real handler with API Gateway proxy events (SQLite and PostgreSQL)."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import hashlib
import ipaddress
import re
import time
import uuid
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import delete as sql_delete
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from test_api_support import (
    ADMIN,
    ALICE,
    BOB,
    Caller,
    add_host,
    api_rows,
    call,
    cell_away,
    create_server,
    mocked_cloud,
)

from ferry import config, errors, quotas, workflows
from ferry.auth import RequestContext
from ferry.compute import aggregates, server_filters, states
from ferry.compute import api as compute_api
from ferry.store.api_models import (
    AggregateHost,
    BuildRequest,
    CellMapping,
    InstanceMapping,
    Network,
    Port,
    RequestSpec,
    Volume,
    VolumeAttachment,
    utcnow,
)
from ferry.store.cell_models import (
    BlockDeviceMapping,
    Instance,
    InstanceAction,
    InstanceActionEvent,
    InstanceFault,
    Migration,
    Service,
    Tag,
)
from ferry.store.db import api_session, cell_session
from ferry.workflows import boot, delete, power


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


def schedule(server_id: str, cell: str = "cell1", *, host: str = "host1", vm_state: str = states.ACTIVE,
             power_state: int = states.RUNNING, hidden_copy_in: str | None = None,
             launched: bool | None = None) -> None:
    """Do what the boot workflow does: the instance in a cell, the mapping pointing there; launched
    (by default) unless it is building or in error."""
    if launched is None:
        launched = vm_state not in (states.BUILDING, states.ERROR)
    with api_session() as session:
        build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == server_id)).one()
        fields = {k: v for k, v in build.instance.items() if k != "metadata"}
        metadata, tags = build.instance.get("metadata", {}), list(build.tags)
        session.delete(build)
        cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == cell)).one()
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server_id)
                        .values(cell_id=cell_id))
    with cell_session(cell) as session:
        session.add(Instance(uuid=server_id, **{**fields, "vm_state": vm_state, "task_state": None,
                                                "power_state": power_state, "host": host, "node": host,
                                                "launched_at": utcnow() if launched else None,
                                                "metadata_items": metadata}))
        session.add_all(Tag(instance_uuid=server_id, tag=tag) for tag in tags)
    if hidden_copy_in:
        with cell_session(hidden_copy_in) as session:
            session.add(Instance(uuid=server_id, **{**fields, "display_name": "stale-copy", "hidden": True,
                                                    "vm_state": states.STOPPED, "host": "elsewhere"}))


def instance(server_id: str, cell: str = "cell1") -> Instance:
    with cell_session(cell) as session:
        return session.scalars(select(Instance).where(Instance.uuid == server_id)).one()


# --- create ----------------------------------------------------------------------------------------


def test_create_records_the_build_and_starts_the_boot_workflow(cloud):
    response = call("POST", "/v2.1/servers", version="2.90", body={
        "server": {"name": "web", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto",
                   "metadata": {"role": "web"}, "tags": ["blue"], "key_name": "ignored"},
        "os:scheduler_hints": {"different_host": [str(uuid.uuid4())]}})

    assert response.status == 202
    server = response.body["server"]
    assert set(server) == {"id", "links", "adminPass", "OS-DCF:diskConfig", "security_groups"}
    assert response.header("Location") == f"https://abc123.execute-api.us-east-1.amazonaws.com/local/v2.1/servers/" \
                                          f"{server['id']}"
    mapping = api_rows(InstanceMapping, instance_uuid=server["id"])[0]
    assert (mapping.cell_id, mapping.project_id, mapping.user_id) == (None, "project-a", "alice")
    build = api_rows(BuildRequest, instance_uuid=server["id"])[0]
    assert build.instance["vm_state"] == "building" and build.instance["task_state"] == "scheduling"
    assert build.instance["power_state"] == 0 and build.instance["image_ref"] == cloud.image_id
    assert build.instance["metadata"] == {"role": "web"} and build.tags == ["blue"]
    assert {k: build.instance["flavor"][k] for k in ("flavorid", "name", "vcpus", "memory_mb", "root_gb")} == \
        {"flavorid": "1", "name": "m1.small", "vcpus": 1, "memory_mb": 512, "root_gb": 1}
    spec = api_rows(RequestSpec, instance_uuid=server["id"])[0].spec
    assert spec["image"] == {"id": cloud.image_id} and spec["is_bfv"] is False
    assert (spec["ignore_hosts"], spec["requested_destination"], spec["allowed_cells"], spec["group"]) == \
        ([], None, None, None)
    assert set(spec["scheduler_hints"]) == {"different_host"}
    port = api_rows(Port, device_id=server["id"])[0]
    network = api_rows(Network, id=port.network_id)[0]
    assert network.name == "shared" and network.shared
    assert port.mac_address.startswith("fa:16:3e:") and len(port.mac_address) == 17
    assert ipaddress.ip_address(port.fixed_ip) in ipaddress.ip_network(network.cidr)
    [execution] = cloud.executions("boot")
    assert execution["name"] == f"boot-{server['id']}"
    assert execution["input"]["instance_uuid"] == server["id"]
    assert execution["input"]["request_id"] == response.header("x-openstack-request-id")


def test_a_new_server_shows_as_build_from_its_build_request(cloud):
    server_id = create_server(tags=["blue"])

    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]

    assert (shown["status"], shown["OS-EXT-STS:vm_state"], shown["OS-EXT-STS:task_state"]) == \
        ("BUILD", "building", "scheduling")
    assert shown["flavor"] == {"vcpus": 1, "ram": 512, "disk": 1, "ephemeral": 0, "swap": 0,
                               "original_name": "m1.small", "extra_specs": {}}
    assert shown["tags"] == ["blue"] and shown["hostId"] == ""
    assert list(shown["addresses"]) == ["shared"]


def test_two_servers_get_distinct_addresses_on_the_shared_network(cloud):
    first, second = create_server(name="a"), create_server(name="b")

    ports = [api_rows(Port, device_id=s)[0] for s in (first, second)]
    assert ports[0].fixed_ip != ports[1].fixed_ip
    assert ports[0].network_id == ports[1].network_id
    assert len(api_rows(Network, name="shared")) == 1


@pytest.mark.parametrize("size", ["99999999999", 2**31])
def test_create_refuses_a_root_volume_larger_than_a_volume_can_be(cloud, size):
    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "huge", "flavorRef": "1", "networks": "none", "block_device_mapping_v2": [{
            "source_type": "image", "destination_type": "volume", "uuid": cloud.image_id, "boot_index": 0,
            "volume_size": size}]}})

    assert response.status == 400 and "volume_size" in response.body["badRequest"]["message"]
    assert api_rows(Volume) == [] and api_rows(BuildRequest) == []


@pytest.mark.parametrize("version", ["2.32", "2.42"])
def test_device_tags_asked_at_create_are_kept(cloud, version):
    with api_session() as session:
        session.add(Network(id="11111111-1111-4111-8111-111111111111", name="private", cidr="192.168.7.0/24",
                            project_id="project-a", shared=False))
    response = call("POST", "/v2.1/servers", version=version, body={"server": {
        "name": "tagged", "flavorRef": "1", "networks": [{"uuid": "11111111-1111-4111-8111-111111111111",
                                                          "tag": "nic-0"}],
        "block_device_mapping_v2": [{"source_type": "image", "destination_type": "volume", "uuid": cloud.image_id,
                                     "boot_index": 0, "volume_size": 1, "tag": "root-disk"}]}})

    assert response.status == 202, response.body
    server_id = response.body["server"]["id"]
    [bdm] = api_rows(BuildRequest, instance_uuid=server_id)[0].block_device_mappings
    assert bdm["tag"] == "root-disk"
    [network] = api_rows(RequestSpec, instance_uuid=server_id)[0].spec["requested_networks"]
    assert network["tag"] == "nic-0"


@pytest.mark.parametrize(("version", "status"), [("2.66", 400), ("2.67", 202)])
def test_a_block_devices_volume_type_is_taken_from_2_67(cloud, version, status):
    response = call("POST", "/v2.1/servers", version=version, body={"server": {
        "name": "typed", "flavorRef": "1", "networks": "auto", "block_device_mapping_v2": [{
            "source_type": "image", "destination_type": "volume", "uuid": cloud.image_id, "boot_index": 0,
            "volume_size": 1, "volume_type": "__DEFAULT__"}]}})

    assert response.status == status, response.body
    assert len(api_rows(InstanceMapping)) == (1 if status == 202 else 0)


def test_create_volume_backed_server_creates_the_root_volume(cloud):
    server_id = create_server(block_device_mapping_v2=[{
        "source_type": "image", "destination_type": "volume", "uuid": cloud.image_id, "boot_index": 0,
        "volume_size": 3, "delete_on_termination": True}])

    [bdm] = api_rows(BuildRequest, instance_uuid=server_id)[0].block_device_mappings
    [volume] = api_rows(Volume, id=bdm["volume_id"])
    assert (volume.size_gb, volume.image_id, volume.project_id) == (3, cloud.image_id, "project-a")
    assert volume.path.endswith(f"volumes/{volume.id}")
    assert (bdm["source_type"], bdm["destination_type"], bdm["boot_index"]) == ("image", "volume", 0)
    assert api_rows(VolumeAttachment, instance_uuid=server_id)[0].status == "reserved"
    assert api_rows(RequestSpec, instance_uuid=server_id)[0].spec["is_bfv"] is True
    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]
    assert shown["image"] == ""
    assert shown["os-extended-volumes:volumes_attached"] == [{"id": volume.id, "delete_on_termination": True}]


def test_create_as_the_openstack_cli_sends_it_is_an_image_backed_boot(cloud):
    server_id = create_server(block_device_mapping_v2=[{
        "uuid": cloud.image_id, "boot_index": 0, "source_type": "image", "destination_type": "local",
        "delete_on_termination": True}])

    [bdm] = api_rows(BuildRequest, instance_uuid=server_id)[0].block_device_mappings
    assert (bdm["source_type"], bdm["destination_type"], bdm["image_id"]) == ("image", "local", cloud.image_id)
    assert api_rows(RequestSpec, instance_uuid=server_id)[0].spec["is_bfv"] is False
    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]
    assert shown["image"]["id"] == cloud.image_id


def test_create_from_an_existing_volume_reserves_it(cloud):
    with api_session() as session:
        session.add(Volume(id="7d2c3a52-0000-4000-8000-000000000001", project_id="project-a", size_gb=2,
                           status="available", path="/tmp/v1"))
    create_server(block_device_mapping_v2=[{"source_type": "volume", "destination_type": "volume",
                                            "uuid": "7d2c3a52-0000-4000-8000-000000000001", "boot_index": "0"}])

    assert api_rows(Volume, id="7d2c3a52-0000-4000-8000-000000000001")[0].status == "reserved"
    again = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "b", "flavorRef": "1", "networks": "none", "block_device_mapping_v2": [{
            "source_type": "volume", "destination_type": "volume", "uuid": "7d2c3a52-0000-4000-8000-000000000001",
            "boot_index": 0}]}})
    assert again.status == 400 and "not available" in again.body["badRequest"]["message"]


def test_a_fixed_ip_is_chosen_by_admins_and_the_networks_owner_only(cloud):
    # GIVEN Alice's server on the shared network, and a network of Alice's own
    alice = create_server(ALICE, networks="auto")
    [taken] = [p.fixed_ip for p in api_rows(Port, device_id=alice)]
    shared = api_rows(Port, device_id=alice)[0].network_id
    with api_session() as session:
        session.add(Network(id="11111111-1111-4111-8111-111111111111", name="private", cidr="192.168.7.0/24",
                            project_id="project-a", shared=False))

    def boot(caller, network: str, fixed_ip: str):
        return call("POST", "/v2.1/servers", caller=caller, version="2.90", body={"server": {
            "name": "b", "flavorRef": "1", "imageRef": cloud.image_id,
            "networks": [{"uuid": network, "fixed_ip": fixed_ip}]}})

    # THEN Bob may not choose an address on the shared network (he would learn Alice's, or take one),
    refused = boot(BOB, shared, taken)
    assert refused.status == 403 and "fixed IP" in refused.body["forbidden"]["message"]
    assert boot(BOB, shared, "10.0.200.7").status == 403
    # Alice may on her own network, and an admin anywhere
    assert boot(ALICE, "11111111-1111-4111-8111-111111111111", "192.168.7.9").status == 202
    assert boot(ADMIN, shared, taken).status == 400  # taken already: Nova's FixedIpAlreadyInUse


def test_a_fixed_ip_already_in_use_is_400_as_nova_answers_it(cloud):
    with api_session() as session:
        session.add(Network(id="11111111-1111-4111-8111-111111111111", name="private", cidr="192.168.7.0/24",
                            project_id="project-a", shared=False))

    def boot():
        return call("POST", "/v2.1/servers", version="2.90", body={"server": {
            "name": "b", "flavorRef": "1", "imageRef": cloud.image_id,
            "networks": [{"uuid": "11111111-1111-4111-8111-111111111111", "fixed_ip": "192.168.7.9"}]}})

    first, second = boot(), boot()

    assert first.status == 202, first.body
    assert second.status == 400, second.body
    assert second.body["badRequest"]["message"] == \
        "Fixed IP address 192.168.7.9 is already in use on network 11111111-1111-4111-8111-111111111111."
    assert [p.fixed_ip for p in api_rows(Port, network_id="11111111-1111-4111-8111-111111111111")] == \
        ["192.168.7.9"]


def test_create_with_a_network_list_and_an_existing_port(cloud):
    with api_session() as session:
        session.add(Network(id="11111111-1111-4111-8111-111111111111", name="private", cidr="192.168.7.0/24",
                            project_id="project-a", shared=False))
        session.add(Port(id="22222222-2222-4222-8222-222222222222", network_id="11111111-1111-4111-8111-111111111111",
                         project_id="project-a", mac_address="fa:16:3e:aa:bb:cc", fixed_ip="192.168.7.50"))

    server_id = create_server(networks=[{"uuid": "11111111-1111-4111-8111-111111111111"},
                                        {"port": "22222222-2222-4222-8222-222222222222"}])

    ports = {p.id: p for p in api_rows(Port, device_id=server_id)}
    assert len(ports) == 2 and ports["22222222-2222-4222-8222-222222222222"].fixed_ip == "192.168.7.50"
    spec = api_rows(RequestSpec, instance_uuid=server_id)[0].spec
    assert [n["preexisting"] for n in spec["requested_networks"]] == [False, True]
    taken = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "b", "flavorRef": "1", "imageRef": cloud.image_id,
        "networks": [{"port": "22222222-2222-4222-8222-222222222222"}]}})
    assert taken.status == 409
    private = call("POST", "/v2.1/servers", caller=BOB, version="2.90", body={"server": {
        "name": "b", "flavorRef": "1", "imageRef": cloud.image_id,
        "networks": [{"uuid": "11111111-1111-4111-8111-111111111111"}]}})
    assert private.status == 400


BAD_BODIES = {
    "unknown key": ("2.90", {"server": {"name": "x", "flavorRef": "1", "networks": "auto", "colour": "red"}}),
    "networks missing from 2.37": ("2.37", {"server": {"name": "x", "flavorRef": "1"}}),
    "tags before 2.52": ("2.51", {"server": {"name": "x", "flavorRef": "1", "networks": "auto", "tags": ["a"]}}),
    "empty name": ("2.90", {"server": {"name": "", "flavorRef": "1", "networks": "auto"}}),
    "networks not auto/none": ("2.90", {"server": {"name": "x", "flavorRef": "1", "networks": "all"}}),
    "two block devices": ("2.90", {"server": {"name": "x", "flavorRef": "1", "networks": "auto",
                                              "block_device_mapping_v2": [{"source_type": "blank"}] * 2}}),
}


@pytest.mark.parametrize("version, where, tag, accepted", [
    ("2.31", "block device", "root", False), ("2.32", "block device", "root", True),
    ("2.33", "block device", "root", False), ("2.41", "block device", "root", False),
    ("2.42", "block device", "root", True), ("2.31", "network", "nic", False), ("2.32", "network", "nic", True),
    ("2.36", "network", "nic", True), ("2.37", "network", "nic", False), ("2.41", "network", "nic", False),
    ("2.42", "network", "nic", True), ("2.42", "port", "nic", True), ("2.42", "network", "a/b", False),
])
def test_device_tags_are_taken_at_the_versions_nova_takes_them(cloud, version, where, tag, accepted):
    with api_session() as session:
        session.add(Network(id="11111111-1111-4111-8111-111111111111", name="private", cidr="192.168.7.0/24",
                            project_id="project-a", shared=False))
        session.add(Port(id="22222222-2222-4222-8222-222222222222", network_id="11111111-1111-4111-8111-111111111111",
                         project_id="project-a", mac_address="fa:16:3e:aa:bb:cc", fixed_ip="192.168.7.50"))
    network: dict = {"port": "22222222-2222-4222-8222-222222222222"} if where == "port" else {
        "uuid": "11111111-1111-4111-8111-111111111111"}
    root = {"source_type": "image", "destination_type": "volume", "uuid": cloud.image_id, "boot_index": 0,
            "volume_size": 1}
    if where == "block device":
        root["tag"] = tag
    else:
        network["tag"] = tag

    response = call("POST", "/v2.1/servers", version=version, body={"server": {
        "name": "tagged", "flavorRef": "1", "networks": [network], "block_device_mapping_v2": [root]}})

    if accepted:
        assert response.status == 202, response.body
    else:
        assert response.status == 400
        assert "tag" in response.body["badRequest"]["message"]
        assert api_rows(BuildRequest) == [] and api_rows(Volume) == []


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_a_bad_body_is_refused_and_nothing_is_written(cloud, case):
    version, body = BAD_BODIES[case]
    if "imageRef" not in body["server"]:
        body["server"]["imageRef"] = cloud.image_id

    response = call("POST", "/v2.1/servers", version=version, body=body)

    assert response.status == 400
    assert response.body["badRequest"]["code"] == 400 and response.body["badRequest"]["message"]
    for model in (InstanceMapping, BuildRequest, RequestSpec, Port, Volume):
        assert api_rows(model) == []
    assert cloud.executions("boot") == []


@pytest.mark.parametrize("field", ["flavorRef", "imageRef"])
def test_unknown_flavor_or_image_is_400(cloud, field):
    body = {"name": "x", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto",
            field: "does-not-exist"}

    response = call("POST", "/v2.1/servers", version="2.90", body={"server": body})

    assert response.status == 400
    assert api_rows(InstanceMapping) == [] and cloud.executions("boot") == []


@pytest.mark.parametrize("root", ["flavor", "volume"])
def test_an_image_larger_than_the_disk_it_would_fill_is_400_and_nothing_is_built(cloud, monkeypatch, root):
    # GIVEN an image whose disk is 5 GiB (its virtual size), and a 1 GiB flavor disk or new volume
    read = compute_api.images.get_image
    monkeypatch.setattr(compute_api.images, "get_image", lambda image_id: {**read(image_id),
                                                                            "virtual_size": 5 * 2**30})
    body = {"name": "x", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto"}
    if root == "volume":
        body = {"name": "x", "flavorRef": "1", "networks": "auto", "block_device_mapping_v2": [{
            "source_type": "image", "destination_type": "volume", "uuid": cloud.image_id, "boot_index": 0,
            "volume_size": 1}]}

    response = call("POST", "/v2.1/servers", version="2.90", body={"server": body})

    assert response.status == 400, response.body
    assert f"is {2**30} bytes, image is {5 * 2**30} bytes" in response.body["badRequest"]["message"]
    assert api_rows(InstanceMapping) == [] and api_rows(Volume) == [] and cloud.executions("boot") == []


def test_a_workflow_that_cannot_start_leaves_nothing_behind(cloud, monkeypatch):
    def refuse(*_args, **_kwargs):
        raise errors.WorkflowNotConfigured("No state machine is configured for this operation.")
    monkeypatch.setattr(workflows, "start_execution", refuse)

    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "x", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto"}})

    assert response.status == 500 and "computeFault" in response.body
    for model in (InstanceMapping, BuildRequest, RequestSpec, Port):
        assert api_rows(model) == []


def test_a_quota_recount_that_fails_leaves_nothing_behind(cloud, monkeypatch):
    # GIVEN counting usage again after the build request is written fails (a cell's database out of reach)
    def unreachable(*_args, **_kwargs):
        raise OperationalError("SELECT", {}, ConnectionRefusedError("cell database unreachable"))
    monkeypatch.setattr(quotas, "recheck", unreachable)

    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "x", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto"}})

    # THEN the boot is refused and nothing it wrote stays (no workflow would ever take it)
    assert response.status == 503 and "serviceUnavailable" in response.body
    for model in (InstanceMapping, BuildRequest, RequestSpec, Port):
        assert api_rows(model) == []
    assert cloud.executions("boot") == []


# --- show and list ---------------------------------------------------------------------------------


def test_another_projects_server_is_not_found(cloud):
    server_id = create_server(ALICE)
    schedule(server_id)

    for method, path, body in (("GET", f"/v2.1/servers/{server_id}", None),
                               ("DELETE", f"/v2.1/servers/{server_id}", None),
                               ("POST", f"/v2.1/servers/{server_id}/action", {"os-stop": None})):
        response = call(method, path, caller=BOB, body=body)
        assert response.status == 404, (method, path)
        assert response.body["itemNotFound"]["code"] == 404
    assert call("GET", f"/v2.1/servers/{server_id}", caller=ADMIN).status == 200
    assert instance(server_id).task_state is None


def test_a_name_in_the_path_is_not_found_so_clients_search_by_name(cloud):
    create_server(name="db-1")

    assert call("GET", "/v2.1/servers/db-1").status == 404
    found = call("GET", "/v2.1/servers/detail", query={"name": "db-1"}).body["servers"]
    assert [s["name"] for s in found] == ["db-1"]


def test_list_filters_by_name_as_a_regular_expression(cloud):
    for name in ("web-1", "web-2", "db-1"):
        create_server(name=name)

    listed = call("GET", "/v2.1/servers", query={"name": "^web"}).body["servers"]

    assert sorted(s["name"] for s in listed) == ["web-1", "web-2"]
    assert set(listed[0]) == {"id", "name", "links"}


def test_a_name_filter_that_backtracks_for_ever_is_400_within_the_lists_budget(cloud, monkeypatch):
    # GIVEN a server whose name makes a backtracking expression take exponential time
    monkeypatch.setattr(server_filters, "MATCH_SECONDS", 0.2)
    create_server(name="a" * 40 + "!")
    started = time.monotonic()

    response = call("GET", "/v2.1/servers", query={"name": "(a|a)+$"})

    # THEN the list answers 400 once its matching budget is spent, instead of holding the function
    assert response.status == 400, response.body
    assert "takes too long to match" in response.body["badRequest"]["message"]
    assert time.monotonic() - started < 30
    assert call("GET", "/v2.1/servers", query={"name": "a+!$"}).body["servers"]  # a sane one matches


def test_a_name_filter_reads_as_pythons_regular_expressions_do(cloud):
    # Braces that are no quantifier are characters (never another engine's fuzzy matching), and
    # a "[" in a set is a character (never a POSIX class)
    for name in ("job-{id}", "db-{e}", "db-1", "web:1", "web-22"):
        create_server(name=name)

    def names(expression: str) -> list[str]:
        response = call("GET", "/v2.1/servers", query={"name": expression})
        assert response.status == 200, response.body
        return sorted(s["name"] for s in response.body["servers"])

    assert names("job-{id}") == ["job-{id}"]
    assert names("db-{e}") == ["db-{e}"]
    assert names("web-2{2}") == ["web-22"]
    assert names("web[[:]1") == ["web:1"]


def test_a_name_filter_that_is_no_regular_expression_is_400(cloud):
    response = call("GET", "/v2.1/servers", query={"name": "web("})

    assert response.status == 400 and "Invalid name filter" in response.body["badRequest"]["message"]


def test_a_reader_of_the_project_reads_its_servers_and_changes_nothing(cloud):
    add_host("host1")
    server_id = create_server(ALICE)
    schedule(server_id)
    carol = Caller("carol", "project-a", ("reader",))

    assert [s["id"] for s in call("GET", "/v2.1/servers", caller=carol).body["servers"]] == [server_id]
    assert call("GET", f"/v2.1/servers/{server_id}", caller=carol).status == 200
    for method, path, body in (("DELETE", f"/v2.1/servers/{server_id}", None),
                               ("POST", f"/v2.1/servers/{server_id}/action", {"os-stop": None}),
                               ("PUT", f"/v2.1/servers/{server_id}", {"server": {"name": "renamed"}}),
                               ("POST", "/v2.1/servers", {"server": {"name": "x", "flavorRef": "1",
                                                                      "imageRef": cloud.image_id,
                                                                      "networks": "auto"}})):
        response = call(method, path, caller=carol, body=body, version="2.90")
        assert response.status == 403, (method, path, response.body)
    row = instance(server_id)
    assert (row.display_name, row.task_state) == ("vm1", None)


def test_only_admins_list_all_projects(cloud):
    create_server(ALICE, name="alice-vm")
    create_server(BOB, name="bob-vm")

    assert [s["name"] for s in call("GET", "/v2.1/servers/detail", caller=BOB).body["servers"]] == ["bob-vm"]
    everyone = call("GET", "/v2.1/servers/detail", caller=ADMIN, query={"all_tenants": "1"}).body["servers"]
    assert sorted(s["name"] for s in everyone) == ["alice-vm", "bob-vm"]
    assert call("GET", "/v2.1/servers/detail", caller=ADMIN).body["servers"] == []
    refused = call("GET", "/v2.1/servers/detail", caller=BOB, query={"all_tenants": "True"})
    assert refused.status == 403 and "get_all_tenants" in refused.body["forbidden"]["message"]


def test_list_pages_with_limit_and_marker_newest_first(cloud):
    ids = [create_server(name=f"vm{i}") for i in range(3)]

    first = call("GET", "/v2.1/servers", query={"limit": "2"}).body
    second = call("GET", "/v2.1/servers", query={"limit": "2", "marker": first["servers"][-1]["id"]}).body

    assert [s["id"] for s in first["servers"] + second["servers"]] == list(reversed(ids))
    assert first["servers_links"][0]["rel"] == "next"
    assert "servers_links" not in second
    assert call("GET", "/v2.1/servers", query={"marker": str(uuid.uuid4())}).status == 400


def test_list_filters_by_status(cloud):
    active, building = create_server(name="a"), create_server(name="b")
    schedule(active)

    assert [s["id"] for s in call("GET", "/v2.1/servers/detail", query={"status": "ACTIVE"}).body["servers"]] == \
        [active]
    assert [s["id"] for s in call("GET", "/v2.1/servers/detail", query={"status": "BUILD"}).body["servers"]] == \
        [building]


@pytest.mark.parametrize(("counts", "message"), [
    ({"min_count": "0"}, "min_count. Value: 0. 0 is less than the minimum of 1"),
    ({"max_count": "99999999999"}, "greater than the maximum of 2147483647"),
    ({"min_count": 2, "max_count": 1}, "min_count must be <= max_count"),
])
def test_create_refuses_counts_out_of_range(cloud, counts, message):
    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "many", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "none", **counts}})

    assert response.status == 400 and message in response.body["badRequest"]["message"]
    assert api_rows(BuildRequest) == []


def test_admins_see_the_status_of_a_servers_host_from_2_16(cloud):
    placed = {}
    for name, host, service in (("up", "host-up", {}), ("off", "host-off", {"disabled": True}),
                                ("down", "host-down", {"forced_down": True}),
                                ("quiet", "host-quiet", {"last_seen_at": dt.datetime(2020, 1, 1)})):
        placed[name] = create_server(name=name)
        schedule(placed[name], host=host)
        with cell_session("cell1") as session:
            session.add(Service(host=host, **{"last_seen_at": utcnow(), **service}))
    placed["waiting"] = create_server(name="waiting")
    placed["elsewhere"] = create_server(name="elsewhere")  # the same host name in another cell
    schedule(placed["elsewhere"], "cell2", host="host-off")
    with cell_session("cell2") as session:
        session.add(Service(host="host-off", last_seen_at=utcnow()))

    def status(server_id: str, caller=ADMIN, version: str = "2.16"):
        return call("GET", f"/v2.1/servers/{server_id}", caller=caller, version=version).body["server"].get(
            "host_status")

    assert {name: status(server_id) for name, server_id in placed.items()} == \
        {"up": "UP", "off": "MAINTENANCE", "down": "DOWN", "quiet": "UNKNOWN", "waiting": "", "elsewhere": "UP"}
    assert status(placed["up"], caller=ALICE) is None  # admins only
    assert status(placed["up"], version="2.15") is None
    listed = call("GET", "/v2.1/servers/detail", caller=ADMIN, version="2.16", query={"all_tenants": "1"})
    assert {s["name"]: s["host_status"] for s in listed.body["servers"]}["off"] == "MAINTENANCE"


@pytest.mark.parametrize("name", [
    "   ", " leading", "trailing ", "bell\x07",
    "\u00a0no-break space first", "ideographic space last\u3000", "delete\x7f", "zero\u200bwidth",
    "line\u2028separator", "private\ue000use", "unassigned\u0378", "emoji-\U0001f600"])
def test_create_refuses_a_name_nova_refuses(cloud, name):
    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": name, "flavorRef": "1", "imageRef": cloud.image_id, "networks": "none"}})

    assert response.status == 400 and "name" in response.body["badRequest"]["message"]
    assert api_rows(BuildRequest) == []


def test_a_name_with_a_no_break_space_last_is_refused_in_novas_words(cloud):
    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "vm\u00a0", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "none"}})

    assert response.body["badRequest"]["message"] == (
        "An invalid 'name' value was provided. The name must be: printable characters. "
        "Can not start or end with whitespace.")


@pytest.mark.parametrize("name", ["café ☕ 中文", "inner\u3000space", "a", "Ωμέγα-1"])
def test_create_takes_printable_names_in_any_script(cloud, name):
    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": name, "flavorRef": "1", "imageRef": cloud.image_id, "networks": "none"}})

    assert response.status == 202, response.body


@pytest.mark.parametrize("zone", ["bogus", "empty-zone", "disabled-zone"])
def test_create_refuses_an_availability_zone_no_enabled_host_is_in(cloud, zone):
    aggregates.create_aggregate("empty", "empty-zone")
    disabled = aggregates.create_aggregate("disabled", "disabled-zone")
    with api_session() as session:
        session.add(AggregateHost(aggregate_id=disabled.id, host="host-off"))
    with cell_session("cell1") as session:
        session.add(Service(host="host-off", disabled=True, last_seen_at=utcnow()))

    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "nowhere", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "none",
        "availability_zone": zone}})

    assert response.status == 400
    assert response.body["badRequest"]["message"] == "The requested availability zone is not available"
    assert api_rows(BuildRequest) == [] and api_rows(InstanceMapping) == []


def test_a_server_shows_the_zone_of_its_host(cloud):
    zone = aggregates.create_aggregate("zone-1", "az1")
    with api_session() as session:  # as aggregates.add_host records it
        session.add(AggregateHost(aggregate_id=zone.id, host="host1"))
    with cell_session("cell1") as session:
        session.add(Service(host="host1", last_seen_at=utcnow()))
    pinned = create_server(name="pinned", availability_zone="az1")
    waiting = create_server(name="waiting", availability_zone="az1")
    anywhere = create_server(name="anywhere")
    schedule(pinned, host="host1")
    schedule(anywhere, host="host2")

    def zone_of(server_id: str) -> str:
        return call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]["OS-EXT-AZ:availability_zone"]

    assert (zone_of(pinned), zone_of(waiting), zone_of(anywhere)) == ("az1", "az1", "nova")
    detail = {s["name"]: s for s in call("GET", "/v2.1/servers/detail", version="2.96").body["servers"]}
    assert {name: s["pinned_availability_zone"] for name, s in detail.items()} == \
        {"pinned": "az1", "waiting": "az1", "anywhere": None}
    assert sorted(_listed({"availability_zone": "az1"}, version="2.83")) == ["pinned", "waiting"]
    assert _listed({"availability_zone": "nova"}, version="2.83") == ["anywhere"]


def _listed(query: dict, *, caller=ALICE, version: str | None = "2.90") -> list[str]:
    response = call("GET", "/v2.1/servers/detail", caller=caller, query=query, version=version)
    assert response.status == 200, response.body
    return [s["name"] for s in response.body["servers"]]


def test_list_filters_by_flavor_and_image_ids(cloud):
    create_server(name="small")
    create_server(name="medium", flavorRef="2")

    assert _listed({"flavor": "2"}) == ["medium"]
    assert _listed({"flavor": "http://compute/v2.1/flavors/1"}) == ["small"]
    assert _listed({"flavor": "no-such-flavor"}) == []
    assert sorted(_listed({"image": cloud.image_id})) == ["medium", "small"]
    assert sorted(_listed({"image": f"http://image/v2/images/{cloud.image_id}"})) == ["medium", "small"]
    assert _listed({"image": str(uuid.uuid4())}) == []


def test_list_filters_by_the_time_of_the_last_change(cloud):
    old, new = create_server(name="old"), create_server(name="new")
    for server_id, changed in ((old, dt.datetime(2020, 1, 1)), (new, dt.datetime(2030, 1, 1))):
        schedule(server_id)
        with cell_session("cell1") as session:
            session.execute(update(Instance).where(Instance.uuid == server_id).values(updated_at=changed))

    assert _listed({"changes-since": "2025-01-01T00:00:00Z"}) == ["new"]
    assert _listed({"changes-before": "2025-01-01T00:00:00+00:00"}) == ["old"]
    assert _listed({"changes-since": "2020-01-01T00:00:00", "changes-before": "2020-01-01T00:00:00"}) == ["old"]
    # changes-before does not exist before 2.66
    assert sorted(_listed({"changes-before": "2025-01-01T00:00:00"}, version="2.65")) == ["new", "old"]
    bad = call("GET", "/v2.1/servers", query={"changes-since": "yesterday"}, version="2.90")
    assert bad.status == 400 and "changes-since" in bad.body["badRequest"]["message"]
    crossed = call("GET", "/v2.1/servers", query={"changes-since": "2030-01-01", "changes-before": "2020-01-01"},
                   version="2.90")
    assert crossed.status == 400


@pytest.mark.parametrize(("path", "caller", "version", "name", "value"), [
    ("/v2.1/servers/detail", ALICE, "2.90", "changes-since", "0001-01-01T00:00:00+01:00"),
    ("/v2.1/servers", ALICE, "2.66", "changes-before", "9999-12-31T23:59:59-01:00"),
    ("/v2.1/os-migrations", ADMIN, "2.80", "changes-since", "0001-01-01T00:00:00+01:00"),
    ("/v2.1/servers/{server_id}/os-instance-actions", ALICE, "2.96", "changes-before", "9999-12-31T23:59:59-01:00"),
])
def test_a_time_filter_with_no_utc_equivalent_is_400_as_any_bad_timestamp(cloud, path, caller, version, name, value):
    # GIVEN a timestamp that is well-formed but, once moved to UTC, falls outside the calendar
    server_id = create_server()

    response = call("GET", path.format(server_id=server_id), caller=caller, version=version, query={name: value})

    # THEN it is refused in the words used for any timestamp that is not one
    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == \
        f"Invalid input for query parameters {name}. Value: {value}. '{value}' is not a 'date-time'"


def test_list_filters_by_tags(cloud):
    create_server(name="ab", tags=["a", "b"])
    create_server(name="a", tags=["a"])
    create_server(name="none")
    schedule(create_server(name="scheduled-b", tags=["b"]))

    assert sorted(_listed({"tags": "a,b"})) == ["ab"]
    assert sorted(_listed({"tags-any": "a,b"})) == ["a", "ab", "scheduled-b"]
    assert sorted(_listed({"not-tags": "a,b"})) == ["a", "none", "scheduled-b"]
    assert sorted(_listed({"not-tags-any": "a"})) == ["none", "scheduled-b"]
    assert sorted(_listed({"tags": "b"})) == ["ab", "scheduled-b"]
    shown = call("GET", "/v2.1/servers/detail", query={"tags": "b"}, version="2.90").body["servers"]
    assert {s["name"]: s["tags"] for s in shown} == {"ab": ["a", "b"], "scheduled-b": ["b"]}


def test_list_filters_by_fixed_address_either_family(cloud):
    first, second, third = create_server(name="first"), create_server(name="second"), create_server(name="third")
    with api_session() as session:
        session.execute(update(Port).where(Port.device_id == first).values(fixed_ip="10.0.0.15"))
        session.execute(update(Port).where(Port.device_id == second).values(fixed_ip="10.0.1.5"))
        session.execute(update(Port).where(Port.device_id == third).values(fixed_ip="fd00::15"))

    assert _listed({"ip": r"10\.0\.0\."}) == ["first"]
    assert _listed({"ip": r"0\.0\.15"}) == ["first"]  # found anywhere in the address
    assert _listed({"ip": "15"}) == ["first"]  # an IPv4 filter never matches an IPv6 address
    assert _listed({"ip6": "fd00::"}) == ["third"]
    assert sorted(_listed({"ip": r"^10\.0\.1\.", "ip6": "::15$"})) == ["second", "third"]  # either
    assert call("GET", "/v2.1/servers", query={"ip": "("}, version="2.90").status == 400


def test_list_filters_meant_for_admins_are_dropped_for_members_and_applied_for_admins(cloud):
    on_one, on_two = create_server(name="on-one"), create_server(name="on-two")
    schedule(on_one, host="host1")
    schedule(on_two, host="host2", vm_state=states.STOPPED, power_state=states.SHUTDOWN)

    assert sorted(_listed({"host": "host1"})) == ["on-one", "on-two"]  # a member's host filter is dropped
    assert _listed({"host": "host1", "all_tenants": "1"}, caller=ADMIN) == ["on-one"]
    assert _listed({"node": "host2", "all_tenants": "1"}, caller=ADMIN) == ["on-two"]
    assert _listed({"uuid": on_two, "all_tenants": "1"}, caller=ADMIN) == ["on-two"]
    # vm_state, task_state, power_state, user_id, key_name, availability_zone: members from 2.83
    assert sorted(_listed({"vm_state": "stopped"}, version="2.82")) == ["on-one", "on-two"]
    assert _listed({"vm_state": "stopped"}, version="2.83") == ["on-two"]
    assert _listed({"power_state": "1"}, version="2.83") == ["on-one"]
    assert _listed({"user_id": "someone-else"}, version="2.83") == []
    assert call("GET", "/v2.1/servers", query={"power_state": "on"}, version="2.83").status == 400
    assert call("GET", "/v2.1/servers", query={"power_state": "\u00b2"}, version="2.83").status == 400


def test_list_filters_by_lock_from_2_73(cloud):
    locked, free = create_server(name="locked"), create_server(name="free")
    for server_id in (locked, free):
        schedule(server_id)
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == locked).values(locked=True, locked_by="admin"))

    assert _listed({"locked": "true"}) == ["locked"]
    assert _listed({"locked": "false"}) == ["free"]
    assert sorted(_listed({"locked": "true"}, version="2.72")) == ["free", "locked"]
    # a sort key from 2.73, ignored before
    assert _listed({"sort_key": "locked", "sort_dir": "desc"}, version="2.73") == ["locked", "free"]
    assert _listed({"sort_key": "locked", "sort_dir": "asc"}, version="2.96") == ["free", "locked"]
    assert _listed({"sort_key": "locked", "sort_dir": "asc"}, version="2.72") == ["free", "locked"]  # by created_at
    assert call("GET", "/v2.1/servers", query={"locked": "maybe"}, version="2.90").status == 400


def test_list_refuses_what_it_cannot_filter_by_and_unknown_parameters_from_2_75(cloud):
    create_server(name="vm")

    unsupported = call("GET", "/v2.1/servers", query={"config_drive": "true"}, version="2.90")
    assert unsupported.status == 400
    assert unsupported.body["badRequest"]["message"] == "Ferry does not filter servers by config_drive."
    unknown = call("GET", "/v2.1/servers", query={"colour": "blue"}, version="2.75")
    assert unknown.status == 400 and "'colour' was unexpected" in unknown.body["badRequest"]["message"]
    assert _listed({"colour": "blue"}, version="2.74") == ["vm"]
    for refused in ("description", "instance_name", "locked_by", "created_at"):
        response = call("GET", "/v2.1/servers", caller=ADMIN, query={refused: "x"}, version="2.90")
        assert response.body["badRequest"]["message"] == f"Ferry does not filter servers by {refused}."
    # what the CLI's `server list` sends by default
    assert _listed({"deleted": "False", "all_tenants": "False"}) == ["vm"]
    assert _listed({"deleted": "", "all_tenants": "1"}, caller=ADMIN) == ["vm"]  # not true: live servers
    assert _listed({"deleted": "True"}) == ["vm"]  # admins only: dropped for a member, as in Nova


def test_list_filters_by_name_hostname_description_and_image_ref_for_admins(cloud):
    create_server(name="web-1", hostname="alpha", description="front end")
    create_server(name="db-1", hostname="beta")
    image_id = create_server(name="other-image")
    with api_session() as session:
        build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == image_id)).one()
        build.instance = {**build.instance, "image_ref": "another-image"}

    def admin(query: dict) -> list[str]:
        return sorted(_listed({**query, "all_tenants": "1"}, caller=ADMIN))

    assert admin({"display_name": "^web"}) == ["web-1"]
    assert admin({"hostname": "et"}) == ["db-1"]
    assert admin({"display_description": "front"}) == ["web-1"]
    assert admin({"display_description": "."}) == ["web-1"]  # no description: no match
    assert admin({"image_ref": "another-image"}) == ["other-image"]
    assert admin({"display_name": "-1$", "hostname": "^a"}) == ["web-1"]  # every filter holds
    assert sorted(_listed({"hostname": "nothing"}, version="2.89")) == ["db-1", "other-image", "web-1"]  # dropped
    assert _listed({"hostname": "^al"}) == ["web-1"]  # members may from 2.90, as in Nova
    assert call("GET", "/v2.1/servers", caller=ADMIN, query={"hostname": "("}, version="2.90").status == 400


def test_deleted_servers_are_listed_with_a_time_window_or_deleted_true(cloud):
    gone, _, _ = deleted_server(cloud)
    live = create_server(name="live")
    schedule(live)
    since = (utcnow() - dt.timedelta(hours=1)).isoformat()

    assert _listed({}) == ["live"]
    windowed = call("GET", "/v2.1/servers/detail", query={"changes-since": since}, version="2.90").body["servers"]
    assert {s["id"]: s["status"] for s in windowed} == {gone: "DELETED", live: "ACTIVE"}
    [shown] = [s for s in windowed if s["id"] == gone]
    assert shown["OS-EXT-STS:vm_state"] == "deleted" and shown["OS-SRV-USG:terminated_at"]
    # progress is shown only in Nova's progress statuses
    assert "progress" not in shown and [s["progress"] for s in windowed if s["id"] == live] == [0]
    assert [s["id"] for s in call("GET", "/v2.1/servers", query={"changes-before": utcnow().isoformat()},
                                  version="2.90").body["servers"]] == [live, gone]
    only = call("GET", "/v2.1/servers", caller=ADMIN, query={"deleted": "yes", "all_tenants": "1"}, version="2.90")
    assert [s["id"] for s in only.body["servers"]] == [gone]
    assert _listed({"deleted": "true", "soft_deleted": "true", "all_tenants": "1"}, caller=ADMIN) == ["vm1"]
    assert _listed({"deleted": "false", "changes-since": since, "all_tenants": "1"}, caller=ADMIN) == ["live"]
    assert _listed({"deleted": "true"}) == ["live"]  # a member's deleted is dropped
    by_status = call("GET", "/v2.1/servers", caller=ADMIN, query={"status": "deleted", "all_tenants": "1"},
                     version="2.90")
    assert [s["id"] for s in by_status.body["servers"]] == [gone]  # status=DELETED: deleted ones only
    refused = call("GET", "/v2.1/servers", query={"status": "DELETED"}, version="2.90")
    assert refused.status == 403 and "Only administrators may list deleted instances" in refused.body["forbidden"][
        "message"]
    assert call("GET", f"/v2.1/servers/{gone}", version="2.90").status == 404


def test_server_groups_are_shown_for_one_server_only_from_2_71(cloud):
    server_id = create_server(name="vm")
    schedule(server_id)

    def keys(method: str, path: str, version: str, body: dict | None = None) -> set[str]:
        answer = call(method, path, version=version, body=body).body
        return set(answer["server"] if "server" in answer else answer["servers"][0])

    assert "server_groups" in keys("GET", f"/v2.1/servers/{server_id}", "2.71")
    assert "server_groups" in keys("PUT", f"/v2.1/servers/{server_id}", "2.96", {"server": {"name": "vm2"}})
    assert "server_groups" not in keys("GET", "/v2.1/servers/detail", "2.96")  # as Nova's list
    assert "server_groups" not in keys("GET", f"/v2.1/servers/{server_id}", "2.70")


def test_list_sorts_by_the_keys_asked_for(cloud):
    for name in ("b", "c", "a"):
        create_server(name=name)

    assert _listed({"sort_key": "display_name", "sort_dir": "asc"}) == ["a", "b", "c"]
    assert _listed({"sort_key": "display_name"}) == ["c", "b", "a"]  # descending by default
    assert _listed({"sort_key": ["created_at"], "sort_dir": ["asc"]}) == ["b", "c", "a"]
    assert call("GET", "/v2.1/servers", query={"sort_key": "host"}, version="2.90").status == 403
    assert call("GET", "/v2.1/servers", caller=ADMIN, query={"sort_key": "host"}, version="2.90").status == 200
    assert call("GET", "/v2.1/servers", query={"sort_key": "kernel_id"}, version="2.90").body["badRequest"][
        "message"] == "Ferry does not sort servers by kernel_id."
    assert call("GET", "/v2.1/servers", query={"sort_key": "colour"}, version="2.90").status == 400
    assert _listed({"sort_key": ["id", "display_name"], "sort_dir": ["asc", "asc"]}, version="2.74") == [
        "a", "b", "c"]  # id ignored until 2.75
    refused = call("GET", "/v2.1/servers", query={"sort_key": "vcpus"}, version="2.75")
    assert (refused.status, refused.body["badRequest"]["message"]) == (400, "Invalid sort key vcpus.")
    assert _listed({"sort_dir": "asc"}) == ["b", "c", "a"]  # created_at when no key is given
    assert call("GET", "/v2.1/servers", query={"sort_key": "display_name", "sort_dir": "up"},
                version="2.90").status == 400
    first = call("GET", "/v2.1/servers", query={"sort_key": "display_name", "sort_dir": "asc", "limit": "2"},
                 version="2.90").body
    after = call("GET", "/v2.1/servers", query={"sort_key": "display_name", "sort_dir": "asc", "limit": "2",
                                                "marker": first["servers"][-1]["id"]}, version="2.90").body
    assert [s["name"] for s in first["servers"] + after["servers"]] == ["a", "b", "c"]


def test_list_pads_sort_directions_with_the_first_one(cloud):
    older, newer, other = create_server(name="twin"), create_server(name="twin"), create_server(name="other")
    listed = call("GET", "/v2.1/servers", query={"sort_key": ["display_name", "created_at"], "sort_dir": "asc"},
                  version="2.90").body["servers"]
    assert [s["id"] for s in listed] == [other, older, newer]


def test_list_pages_from_a_marker_that_no_longer_passes_the_filters(cloud):
    ids = [create_server(name=f"vm{i}") for i in range(3)]
    for server_id in ids:
        schedule(server_id)
    first = call("GET", "/v2.1/servers", query={"status": "ACTIVE", "limit": "1"}, version="2.90").body
    marker = first["servers"][0]["id"]
    with cell_session("cell1") as session:  # the marker's server stops between the pages
        session.execute(update(Instance).where(Instance.uuid == marker).values(vm_state=states.STOPPED))

    rest = call("GET", "/v2.1/servers", query={"status": "ACTIVE", "marker": marker}, version="2.90")

    assert rest.status == 200 and [s["id"] for s in rest.body["servers"]] == list(reversed(ids))[1:]


def test_list_pages_from_a_marker_deleted_since_the_page_before(cloud):
    ids = [create_server(name=f"vm{i}") for i in range(3)]
    for server_id in ids:
        schedule(server_id)
    marker = call("GET", "/v2.1/servers", query={"limit": "1"}, version="2.90").body["servers"][0]["id"]
    assert marker == ids[-1]
    assert call("DELETE", f"/v2.1/servers/{marker}").status == 204
    with api_session() as session:  # the delete finished
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == marker)
                        .values(queued_for_delete=True))
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == marker).values(deleted=True,
                                                                              vm_state=states.DELETED))

    rest = call("GET", "/v2.1/servers", query={"marker": marker}, version="2.90")

    assert rest.status == 200 and [s["id"] for s in rest.body["servers"]] == [ids[1], ids[0]]
    unknown = call("GET", "/v2.1/servers", query={"marker": str(uuid.uuid4())}, version="2.90")
    assert unknown.status == 400


def _every_page(ctx: RequestContext, filters: server_filters.ServerFilters, limit: int) -> list[str]:
    """The ids of every page of a newest-first list, ``limit`` at a time, each page after the last one's marker."""
    ids: list[str] = []
    while True:
        page = compute_api.list_servers(ctx, dataclasses.replace(filters, limit=limit, marker=ids[-1] if ids else None))
        ids += [server.uuid for server in page]
        if len(page) < limit:
            return ids


@pytest.mark.parametrize("batch", [1, 2, 3, 500])
def test_a_newest_first_list_pages_as_a_list_sorted_by_creation_time_does(cloud, monkeypatch, batch):
    # GIVEN two projects' servers in two cells, created at times that tie (so the uuid decides),
    # servers not scheduled yet at the same times, a hidden copy in the other cell, a visible
    # copy in a cell the server is not mapped to (a move between cells switching), and a server
    # being deleted; cells read ``batch`` servers at a time
    monkeypatch.setattr(compute_api, "_LIST_BATCH", batch)
    names = [f"vm{i}" for i in range(14)]
    ids = {name: create_server(ALICE if i % 2 else BOB, name=name) for i, name in enumerate(names)}
    moments = [utcnow() - dt.timedelta(minutes=minutes) for minutes in (1, 2, 3)]
    for i, name in enumerate(names):
        if i < 10:
            schedule(ids[name], "cell1" if i % 3 else "cell2", hidden_copy_in="cell1" if i % 3 == 0 else None)
            with cell_session("cell1" if i % 3 else "cell2") as session:
                session.execute(update(Instance).where(Instance.uuid == ids[name], Instance.hidden.is_(False))
                                .values(created_at=moments[i % 3]))
        else:
            with api_session() as session:
                session.execute(update(BuildRequest).where(BuildRequest.instance_uuid == ids[name])
                                .values(created_at=moments[i % 3]))
    with api_session() as session:
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == ids["vm4"])
                        .values(queued_for_delete=True))
    stray = instance(ids["vm5"], "cell1")
    with cell_session("cell2") as session:
        session.add(Instance(uuid=stray.uuid, display_name="stray-copy", project_id=stray.project_id,
                             user_id=stray.user_id, flavor=stray.flavor, vm_state=states.ACTIVE,
                             created_at=moments[0]))
    admin = RequestContext(user_id="root", project_id="admin-project", roles=("admin",))
    alice = RequestContext(user_id="alice", project_id="project-a", roles=("member",))

    for ctx, all_tenants in ((admin, True), (alice, False)):
        for pattern in (None, "vm1[0-9]*$|vm[2468]"):
            filters = server_filters.ServerFilters(
                all_tenants=all_tenants,
                name=server_filters.SearchPattern("name", pattern, server_filters.MatchBudget()) if pattern else None)
            # WHEN the list is read a page at a time in its default order, THEN it holds the servers
            # the general path sorted by creation time lists, in its order, whatever the page's size
            general = compute_api.list_servers(ctx, dataclasses.replace(filters, sort=(("created_at", "desc"),)))
            expected = [s.uuid for s in general]
            assert expected and ids["vm4"] not in expected and "stray-copy" not in {s.name for s in general}
            for limit in (1, 2, 3, 7, 1000):
                assert _every_page(ctx, filters, limit) == expected, (ctx.project_id, pattern, limit)


def test_a_newest_first_page_reads_about_its_size_whatever_the_number_of_servers(cloud, monkeypatch):
    # GIVEN ten servers in each of two cells (two projects' own)
    for i in range(20):
        schedule(create_server(ALICE if i % 2 else BOB, name=f"vm{i}"), "cell1" if i % 2 else "cell2")
    read: list[str] = []
    made = compute_api._server_from_instance

    def counted(row: Instance, cell: str) -> compute_api.Server:
        read.append(row.uuid)
        return made(row, cell)

    monkeypatch.setattr(compute_api, "_server_from_instance", counted)

    # WHEN a page of two is listed, THEN each cell read two servers, not all its servers
    page = call("GET", "/v2.1/servers", caller=ADMIN, query={"limit": "2", "all_tenants": "1"}).body["servers"]
    assert len(page) == 2 and len(read) == 4, len(read)

    # WHEN most servers fail a filter, THEN the cells are read on, a batch at a time, until the page fills
    read.clear()
    monkeypatch.setattr(compute_api, "_LIST_BATCH", 4)
    page = call("GET", "/v2.1/servers", caller=ADMIN, query={"limit": "2", "all_tenants": "1", "name": "vm[01]$"},
                version="2.90").body["servers"]
    assert sorted(s["name"] for s in page) == ["vm0", "vm1"] and 4 < len(read) <= 20, len(read)


def test_a_server_scheduled_while_a_page_is_read_is_listed_once(cloud, monkeypatch):
    # GIVEN a server not scheduled yet whose copy is already in cell1 (the boot writes it before it
    # points the mapping at it), and the hand-over done right after the list read the build requests
    server_id = create_server(name="vm")
    with api_session() as session:
        build = session.scalars(select(BuildRequest).where(BuildRequest.instance_uuid == server_id)).one()
        fields = {k: v for k, v in build.instance.items() if k not in ("metadata", "tags")}
        created = build.created_at
    with cell_session("cell1") as session:
        session.add(Instance(uuid=server_id, **{**fields, "vm_state": states.ACTIVE, "task_state": None,
                                                "created_at": created}))
    builds = compute_api._builds_newest_first

    def handed_over_after(project, after):  # noqa: ANN001, ANN202 - the function it stands for
        listed = builds(project, after)
        with api_session() as session:
            session.execute(sql_delete(BuildRequest).where(BuildRequest.instance_uuid == server_id))
            cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == "cell1")).one()
            session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server_id)
                            .values(cell_id=cell_id))
        return listed

    monkeypatch.setattr(compute_api, "_builds_newest_first", handed_over_after)

    # WHEN the servers are listed, THEN it is listed once, from its cell
    listed = call("GET", "/v2.1/servers/detail").body["servers"]
    assert [(s["id"], s["status"]) for s in listed] == [(server_id, "ACTIVE")]


def test_a_cell_whose_database_does_not_answer_is_left_out_of_the_list(cloud, monkeypatch):
    # GIVEN a server in cell1 and one in cell2, whose database stops answering
    in_cell1, in_cell2 = create_server(name="one"), create_server(name="two")
    schedule(in_cell1)
    schedule(in_cell2, "cell2")
    cell_away(monkeypatch, compute_api, "cell2")

    # WHEN the servers are listed (before 2.69), THEN cell1's are, and cell2's are left out (not a 500)
    assert _listed({}, version="2.68") == ["one"]

    # AND a database error that is not of the moment still fails the list
    cell_away(monkeypatch, compute_api, "cell2", broken=True)
    assert call("GET", "/v2.1/servers/detail", version="2.90").status == 500


def _unknown_setup(monkeypatch, *, away: bool = True) -> tuple[list[str], list[str], str]:
    """Alice's servers made in turn in cell1, cell2, cell1, cell2, then one of Bob's in cell2,
    whose database then stops answering (unless not ``away``); (Alice's newest first, cell2's of
    them newest first, Bob's)."""
    alices = []
    for name, cell in (("a", "cell1"), ("b", "cell2"), ("c", "cell1"), ("d", "cell2")):
        alices.insert(0, create_server(name=name))
        schedule(alices[0], cell)
    bobs = create_server(BOB, name="bobs")
    schedule(bobs, "cell2")
    if away:
        cell_away(monkeypatch, compute_api, "cell2")
    return alices, [alices[0], alices[2]], bobs


def _walk(query: dict[str, str], version: str = "2.69", on_page=None) -> list[str]:  # noqa: ANN001
    """The ids of every page of Alice's server list, following its next links (``on_page`` called
    with the page's number after each)."""
    seen, query = [], dict(query)
    for number in range(10):
        body = call("GET", "/v2.1/servers", query=query, version=version).body
        seen += [s["id"] for s in body["servers"]]
        if not body.get("servers_links"):
            return seen
        query = {k: v[0] for k, v in parse_qs(urlsplit(body["servers_links"][0]["href"]).query).items()}
        if on_page:
            on_page(number)
    raise AssertionError(f"the list did not end: {seen}")


def test_a_servers_mapping_and_build_request_are_made_at_one_moment(cloud):
    # GIVEN servers accepted by one request (the instance keeps its build request's time, so a
    # server is in one place in the list whether its cell answers or not)
    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "many", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto",
        "min_count": 3}})
    assert response.status == 202, response.body

    # THEN each one's mapping and build request were made at the same moment
    with api_session() as session:
        mapped = dict(session.execute(select(InstanceMapping.instance_uuid, InstanceMapping.created_at)).all())
        built = dict(session.execute(select(BuildRequest.instance_uuid, BuildRequest.created_at)).all())
    assert len(mapped) == 3 and mapped == built


@pytest.mark.parametrize("sort", [None, "display_name"])
def test_from_2_69_the_servers_of_a_cell_that_does_not_answer_are_listed_unknown(cloud, monkeypatch, sort):
    # GIVEN servers in cell1 and in cell2, whose database stops answering
    alices, in_cell2, bobs = _unknown_setup(monkeypatch)
    in_cell1 = [u for u in alices if u not in in_cell2]
    sorting = {"sort_key": sort, "sort_dir": "asc"} if sort else {}

    def listed(path: str, version: str, caller: Caller = ALICE, **query: str) -> list[dict]:
        response = call("GET", path, caller=caller, query={**sorting, **query}, version=version)
        assert response.status == 200, response.body
        return response.body["servers"]

    # WHEN they are listed from 2.69, THEN cell2's (the caller's only) are shown UNKNOWN: the id
    # and links, and in the detailed list the project and creation; in the default order in
    # their place by when they were made, in another after the servers read
    expected = alices if not sort else [*in_cell1[::-1], *in_cell2]
    summary = listed("/v2.1/servers", "2.69")
    assert [(s["id"], s.get("status")) for s in summary] == [
        (u, "UNKNOWN" if u in in_cell2 else None) for u in expected]
    assert all(set(s) == {"id", "status", "links"} for s in summary if s["id"] in in_cell2)
    detail = listed("/v2.1/servers/detail", "2.90")
    assert [s["id"] for s in detail] == expected
    unknown = [s for s in detail if s["id"] in in_cell2]
    assert all(set(s) == {"id", "status", "links", "tenant_id", "created"} and s["tenant_id"] == ALICE.project_id
               and s["status"] == "UNKNOWN" for s in unknown)
    assert unknown[0]["links"][0]["href"].endswith(f"/servers/{in_cell2[0]}")
    assert all(s["status"] == "ACTIVE" for s in detail if s["id"] in in_cell1)

    # AND an admin listing every project sees Bob's too; the filters that need the server do not
    # hold them back (as Nova's), the uuid's does; deleted servers only, and before 2.69, none
    every = listed("/v2.1/servers", "2.69", ADMIN, all_tenants="1")
    assert {s["id"] for s in every if s.get("status") == "UNKNOWN"} == {*in_cell2, bobs}
    assert {s["id"] for s in listed("/v2.1/servers", "2.69", name="^a$")} == {in_cell1[-1], *in_cell2}
    assert [s["id"] for s in listed("/v2.1/servers", "2.69", ADMIN, all_tenants="1", uuid=bobs)] == [bobs]
    assert listed("/v2.1/servers", "2.69", ADMIN, all_tenants="1", deleted="true") == []
    assert [s["id"] for s in listed("/v2.1/servers", "2.68")] == [u for u in expected if u in in_cell1]


def test_from_2_69_a_server_of_a_cell_that_does_not_answer_is_shown_unknown(cloud, monkeypatch):
    # GIVEN a server in cell2, asked for a zone, whose database then stops answering
    server_id = create_server(name="far")
    schedule(server_id, "cell2")
    with api_session() as session:
        created = session.scalars(select(InstanceMapping.created_at)
                                  .where(InstanceMapping.instance_uuid == server_id)).one()
        spec = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == server_id)).one()
        spec.spec = {**spec.spec, "availability_zone": "zone-a"}
    before = call("GET", f"/v2.1/servers/{server_id}", version="2.71").body["server"]
    cell_away(monkeypatch, compute_api, "cell2")

    # WHEN it is shown from 2.69, THEN what the API database knows of it is, status UNKNOWN
    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.71")
    assert shown.status == 200, shown.body
    server = shown.body["server"]
    assert set(server) == {"id", "status", "links", "tenant_id", "user_id", "created", "flavor", "image",
                           "OS-EXT-AZ:availability_zone", "OS-EXT-STS:power_state", "server_groups"}
    assert (server["id"], server["status"], server["tenant_id"], server["user_id"]) == (
        server_id, "UNKNOWN", ALICE.project_id, ALICE.user_id)
    assert server["created"] == created.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert (server["flavor"], server["image"], server["links"]) == (before["flavor"], before["image"], before["links"])
    assert server["image"]["id"] == cloud.image_id
    assert (server["OS-EXT-AZ:availability_zone"], server["OS-EXT-STS:power_state"], server["server_groups"]) == (
        "zone-a", 0, [])
    assert set(call("GET", f"/v2.1/servers/{server_id}", version="2.69").body["server"]) == set(server) - {
        "server_groups"}
    # (a zone or user not known is Nova's UNKNOWN)
    with api_session() as session:
        spec = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == server_id)).one()
        spec.spec = {**spec.spec, "availability_zone": None}
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server_id).values(user_id=None))
    unknown = call("GET", f"/v2.1/servers/{server_id}", version="2.71").body["server"]
    assert (unknown["OS-EXT-AZ:availability_zone"], unknown["user_id"]) == ("UNKNOWN", "UNKNOWN")

    # AND another project's is still not found, and before 2.69 the show is refused for the moment (503)
    assert call("GET", f"/v2.1/servers/{server_id}", caller=BOB, version="2.71").status == 404
    assert call("GET", f"/v2.1/servers/{server_id}", version="2.68").status == 503


@pytest.mark.parametrize("sort", [None, "display_name"])
def test_unknown_servers_are_paged_on_by_marker(cloud, monkeypatch, sort):
    # GIVEN servers of a cell that answers and of one that does not
    alices, in_cell2, bobs = _unknown_setup(monkeypatch)
    in_cell1 = [u for u in alices if u not in in_cell2]
    query = {"limit": "1", **({"sort_key": sort, "sort_dir": "asc"} if sort else {})}

    # WHEN the list is read a server at a time, THEN every server is listed once, and the list ends
    assert _walk(query) == (alices if not sort else [*in_cell1[::-1], *in_cell2])

    # AND a marker naming another project's server is not found; one being deleted meanwhile in
    # the cell that does not answer pages on from its place
    assert call("GET", "/v2.1/servers", query={"marker": bobs}, version="2.69").status == 400
    with api_session() as session:
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == in_cell2[0])
                        .values(queued_for_delete=True))
    page = call("GET", "/v2.1/servers", query={"marker": in_cell2[0]}, version="2.69")
    assert page.status == 200 and [s["id"] for s in page.body["servers"]] == alices[1:]


@pytest.mark.parametrize("change", ["goes away", "comes back"])
def test_a_cell_that_goes_away_or_comes_back_between_pages_loses_no_server_and_repeats_none(cloud, monkeypatch,
                                                                                            change):
    # GIVEN Alice's servers made in turn in cell1 and cell2, cell2 answering or not
    alices, _in_cell2, _bobs = _unknown_setup(monkeypatch, away=False)
    outage = pytest.MonkeyPatch()
    if change == "comes back":
        cell_away(outage, compute_api, "cell2")

    # WHEN cell2 goes away, or comes back, after the first page of a server at a time
    def turn(number: int) -> None:
        if number == 0:
            if change == "goes away":
                cell_away(outage, compute_api, "cell2")
            else:
                outage.undo()

    # THEN every server is listed once, in its place
    try:
        assert _walk({"limit": "1"}, on_page=turn) == alices
    finally:
        outage.undo()


def test_a_status_filter_selects_states_as_nova_does(cloud):
    ids = {name: create_server(name=name) for name in ("resizing", "stopping", "verify", "stopped")}
    for server_id in ids.values():
        schedule(server_id)
    changes = {"resizing": (states.ACTIVE, states.RESIZE_MIGRATING), "stopping": (states.ACTIVE, states.POWERING_OFF),
               "verify": (states.RESIZED, None), "stopped": (states.STOPPED, None)}
    with cell_session("cell1") as session:
        for name, (vm_state, task_state) in changes.items():
            session.execute(update(Instance).where(Instance.uuid == ids[name])
                            .values(vm_state=vm_state, task_state=task_state))

    def by_status(*statuses: str, version: str = "2.90") -> list[str]:
        return sorted(_listed({"status": list(statuses)}, version=version))

    # ACTIVE is the vm_state whatever the task: a server being resized or stopped is ACTIVE to the filter
    assert by_status("ACTIVE") == ["resizing", "stopping"]
    assert by_status("resize") == ["resizing"]
    assert by_status("SHUTOFF", "verify_resize") == ["stopped", "verify"]
    assert by_status("REBOOT") == []  # Nova's, and no Ferry server's
    assert by_status("BOGUS", version="2.37") == []
    for unknown in ("BOGUS", "", " ACTIVE"):  # as Nova reads them: whole, any case
        refused = call("GET", "/v2.1/servers", query={"status": unknown}, version="2.38")
        assert refused.status == 400 and refused.body["badRequest"]["message"] == "Invalid status value"
    # a status that stands for any task keeps the task_state filter (members may from 2.83)
    assert sorted(_listed({"status": "ACTIVE", "task_state": states.POWERING_OFF}, version="2.83")) == ["stopping"]


def test_the_next_link_keeps_the_filters_and_follows_the_largest_page(cloud, monkeypatch):
    for name in ("web-1", "web-2", "web-3", "db-1"):
        create_server(name=name)
    monkeypatch.setattr(compute_api, "MAX_LIST_LIMIT", 2)

    page = call("GET", "/v2.1/servers", query={"name": "^web", "limit": "5"}, version="2.90").body
    assert len(page["servers"]) == 2  # the largest page, though more was asked for
    href = page["servers_links"][0]["href"]
    query = parse_qs(urlsplit(href).query)
    assert query == {"name": ["^web"], "limit": ["2"], "marker": [page["servers"][-1]["id"]]}
    rest = call("GET", "/v2.1/servers", query={k: v[-1] for k, v in query.items()}, version="2.90").body
    assert [s["name"] for s in rest["servers"]] == ["web-1"] and "servers_links" not in rest


def test_a_scheduled_server_shows_from_the_cell_its_mapping_names(cloud):
    server_id = create_server(tags=["blue"], metadata={"k": "v"})
    schedule(server_id, "cell1", host="host1", hidden_copy_in="cell2")

    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]
    listed = call("GET", "/v2.1/servers/detail", version="2.90").body["servers"]
    as_admin = call("GET", f"/v2.1/servers/{server_id}", caller=ADMIN, version="2.90").body["server"]
    old = call("GET", f"/v2.1/servers/{server_id}", version="2.25").body["server"]

    assert (shown["status"], shown["name"], shown["tags"], shown["metadata"]) == ("ACTIVE", "vm1", ["blue"],
                                                                                 {"k": "v"})
    assert [s["name"] for s in listed] == ["vm1"]
    assert shown["hostId"] == hashlib.sha224(b"project-ahost1").hexdigest() == as_admin["hostId"]
    assert "OS-EXT-SRV-ATTR:host" not in shown
    assert (as_admin["OS-EXT-SRV-ATTR:host"], as_admin["OS-EXT-SRV-ATTR:hypervisor_hostname"]) == ("host1", "host1")
    assert as_admin["OS-EXT-SRV-ATTR:instance_name"].startswith("instance-")
    assert old["flavor"]["id"] == "1" and "original_name" not in old["flavor"] and "tags" not in old


def test_an_errored_server_shows_its_fault_with_details_for_admins(cloud):
    server_id = create_server()
    schedule(server_id, vm_state=states.ERROR)
    with cell_session("cell1") as session:
        session.add(InstanceFault(instance_uuid=server_id, code=500, message=(
            "No valid host was found for x: 40 compute node(s) in the allowed cells; RamFilter removed 40."),
            details="Traceback: ..."))

    member_view = call("GET", f"/v2.1/servers/{server_id}").body["server"]
    admin_view = call("GET", f"/v2.1/servers/{server_id}", caller=ADMIN).body["server"]

    # the member reads Nova's words, not the cloud's host counts; the admin reads it all
    assert member_view["status"] == "ERROR"
    assert member_view["fault"]["message"] == "No valid host was found. There are not enough hosts available."
    assert "details" not in member_view["fault"]
    assert admin_view["fault"]["details"] == "Traceback: ..."
    assert "RamFilter removed 40" in admin_view["fault"]["message"]


def test_a_failed_build_shows_its_owner_the_error_name_and_its_admin_the_host_and_database_text(cloud):
    # GIVEN a build that failed on the host with an error naming a host path and a database endpoint
    server_id = create_server()
    [execution] = cloud.executions("boot")
    cause = ("libvirt: cannot open /var/lib/ferry/instances/x/disk: permission denied; "
             "recording it failed: db.internal:5432 refused the connection")
    boot.fail_build({**execution["input"], "error": {"Error": "Ferry.HypervisorError", "Cause": cause}})

    # WHEN its owner and an admin read it
    member_view = call("GET", f"/v2.1/servers/{server_id}").body["server"]
    admin_view = call("GET", f"/v2.1/servers/{server_id}", caller=ADMIN).body["server"]

    # THEN the owner reads the error's name only; the admin reads the text in the details
    assert member_view["status"] == "ERROR"
    assert member_view["fault"]["message"] == "Ferry.HypervisorError"
    assert "/var/lib/ferry" not in str(member_view["fault"]) and "db.internal" not in str(member_view["fault"])
    assert admin_view["fault"]["message"] == "Ferry.HypervisorError"
    assert cause in admin_view["fault"]["details"]


def test_an_owner_reads_why_a_build_was_refused_or_found_no_host_but_only_the_name_of_a_timeout(cloud):
    # GIVEN three failed builds: refused with an error written for the owner, no valid host, a Lambda timeout
    refused, unplaced, timed_out = create_server(name="a"), create_server(name="b"), create_server(name="c")
    executions = {e["input"]["instance_uuid"]: e["input"] for e in cloud.executions("boot")}
    refusal = "Image abc cannot boot a flavor with a root disk smaller than 20 GiB."
    timeout = "Task timed out after 30.00 seconds in arn:aws:lambda:us-east-1:123456789012:function:ferry-spawn"
    for server_id, error in ((refused, {"Error": "Ferry.BadRequest", "Cause": refusal}),
                             (unplaced, {"Error": "Ferry.NoValidHost", "Cause": "RamFilter removed 40 hosts."}),
                             (timed_out, {"Error": "States.Timeout", "Cause": timeout})):
        boot.fail_build({**executions[server_id], "error": error})

    def fault(server_id: str, caller: Caller = ALICE) -> dict[str, str]:
        return call("GET", f"/v2.1/servers/{server_id}", caller=caller).body["server"]["fault"]

    # THEN the owner reads the refusal, Nova's words for no valid host, and the timeout's name only
    assert fault(refused)["message"] == fault(refused, ADMIN)["message"] == refusal
    assert "details" not in fault(refused, ADMIN)
    assert fault(unplaced)["message"] == "No valid host was found. There are not enough hosts available."
    assert fault(unplaced, ADMIN)["message"] == "No valid host was found. RamFilter removed 40 hosts."
    assert fault(timed_out)["message"] == "States.Timeout" and "123456789012" not in str(fault(timed_out))
    # AND the admin reads the timeout's text in the details
    assert fault(timed_out, ADMIN)["details"] == f"Cause: {timeout}"


def test_a_deleted_server_shows_its_fault_to_an_admin_listing_deleted_servers(cloud):
    # GIVEN a server in ERROR with a fault, then deleted to the end
    add_host("host1")
    server_id = create_server()
    schedule(server_id, vm_state=states.ERROR)
    with cell_session("cell1") as session:
        session.add(InstanceFault(instance_uuid=server_id, code=500, message="Build of instance failed",
                                  details="Traceback: ..."))
    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204
    [execution] = cloud.executions("delete")
    delete.finish_delete(execution["input"])

    listed = call("GET", "/v2.1/servers/detail", caller=ADMIN, query={"all_tenants": "1", "deleted": "true"},
                  version="2.90")

    # THEN its fault shows, as Nova shows a DELETED server's
    assert listed.status == 200, listed.body
    [shown] = listed.body["servers"]
    assert (shown["id"], shown["status"]) == (server_id, "DELETED")
    assert shown["fault"]["message"] == "Build of instance failed" and shown["fault"]["details"] == "Traceback: ..."
    assert call("GET", f"/v2.1/servers/{server_id}", caller=ADMIN, version="2.90").status == 404  # as any deleted


# --- stop and start --------------------------------------------------------------------------------


def test_stop_then_start_use_compare_and_swap_and_start_the_power_workflow(cloud):
    add_host("host1")
    server_id = create_server()
    schedule(server_id)

    stopped = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-stop": None}, headers={"Accept": ""})
    again = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-stop": None})
    start = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-start": None})

    assert stopped.status == 202 and stopped.body is None
    assert instance(server_id).task_state == states.POWERING_OFF
    assert again.status == 409
    assert again.body["conflictingRequest"]["message"] == \
        f"Cannot 'stop' instance {server_id} while it is in task_state powering-off"
    assert start.status == 409
    assert start.body["conflictingRequest"]["message"] == \
        f"Cannot 'start' instance {server_id} while it is in vm_state active"
    [execution] = cloud.executions("power")
    request_id = stopped.header("x-openstack-request-id")
    assert execution["name"] == f"power-{server_id}-{request_id.removeprefix('req-')}"
    assert {k: execution["input"][k] for k in ("instance_uuid", "request_id", "cell", "host", "operation")} == \
        {"instance_uuid": server_id, "request_id": request_id, "cell": "cell1", "host": "host1",
         "operation": "power_off"}
    assert execution["input"]["queue_url"].endswith("host1")
    with cell_session("cell1") as session:
        recorded = session.scalars(select(InstanceAction).where(InstanceAction.request_id == request_id)).one()
    assert recorded.action == "stop"


@pytest.mark.parametrize("began", [True, False])
@pytest.mark.parametrize("body", [{"os-stop": None}, "delete"])
def test_a_request_whose_start_answered_an_error_stands_only_if_its_workflow_took_it(cloud, monkeypatch, began,
                                                                                    body):
    # GIVEN starting the workflow answers an error and Step Functions cannot show the execution;
    # it began (its first step took the request) or it did not
    add_host("host1")
    server_id = create_server()
    schedule(server_id)

    def start(arn, name, payload):
        if began:
            first_step = power.begin_power_action if body != "delete" else delete.find_resize_to_confirm
            first_step(payload)
        raise RuntimeError("Step Functions answered 500 and does not show the execution")

    monkeypatch.setattr(workflows, "start_execution", start)

    # WHEN the request is made
    if body == "delete":
        answer = call("DELETE", f"/v2.1/servers/{server_id}")
    else:
        answer = call("POST", f"/v2.1/servers/{server_id}/action", body=body)

    # THEN a request its workflow took stands (accepted); one it did not take is undone (500, no task)
    task = states.DELETING if body == "delete" else states.POWERING_OFF
    if began:
        assert answer.status in (202, 204), answer.body
        assert instance(server_id).task_state == task
    else:
        assert answer.status == 500
        assert instance(server_id).task_state is None


@pytest.mark.parametrize("body", [{"os-stop": None}, "delete"])
def test_the_first_step_of_a_request_the_api_undid_changes_nothing(cloud, monkeypatch, body):
    # GIVEN the API undid a request whose start answered an error, while its workflow had in fact begun
    add_host("host1")
    server_id = create_server()
    schedule(server_id)
    started: list[dict] = []

    def start(arn, name, payload):
        started.append(payload)
        raise RuntimeError("Step Functions answered 500")

    monkeypatch.setattr(workflows, "start_execution", start)
    if body == "delete":
        call("DELETE", f"/v2.1/servers/{server_id}")
    else:
        call("POST", f"/v2.1/servers/{server_id}/action", body=body)
    assert instance(server_id).task_state is None

    # WHEN the workflow's first step runs, THEN it refuses, and nothing is recorded
    first_step = power.begin_power_action if body != "delete" else delete.find_resize_to_confirm
    with pytest.raises(errors.UnexpectedTaskState):
        first_step(started[0])
    assert instance(server_id).task_state is None
    with cell_session("cell1") as session:
        assert session.scalars(select(InstanceActionEvent)).all() == []


def test_start_powers_on_a_stopped_server(cloud):
    add_host("host1")
    server_id = create_server()
    schedule(server_id, vm_state=states.STOPPED, power_state=states.SHUTDOWN)

    assert call("POST", f"/v2.1/servers/{server_id}/action", body={"os-start": None}).status == 202

    assert instance(server_id).task_state == states.POWERING_ON
    assert cloud.executions("power")[0]["input"]["operation"] == "power_on"


@pytest.mark.parametrize(("body", "vm_state"), [({"os-stop": None}, states.ACTIVE),
                                              ({"os-start": None}, states.STOPPED)])
def test_a_server_with_no_host_is_not_ready_to_be_stopped_or_started(cloud, body, vm_state):
    # GIVEN a server its failed build left with no host, its state set back by an admin
    server_id = create_server()
    schedule(server_id, vm_state=vm_state)
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server_id).values(host=None, node=None))

    response = call("POST", f"/v2.1/servers/{server_id}/action", body=body)

    # THEN 409 as Nova's check of the instance's host answers, and nothing changed or started
    assert response.status == 409
    assert response.body["conflictingRequest"]["message"] == f"Instance {server_id} is not ready"
    assert (instance(server_id).vm_state, instance(server_id).task_state) == (vm_state, None)
    assert cloud.executions("power") == []


def test_a_locked_server_refuses_members_but_not_admins(cloud):
    add_host("host1")
    server_id = create_server()
    schedule(server_id)
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server_id).values(locked=True))

    member = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-stop": None})
    admin = call("POST", f"/v2.1/servers/{server_id}/action", caller=ADMIN, body={"os-stop": None})

    assert member.status == 409 and member.body["conflictingRequest"]["message"] == \
        f"Instance {server_id} is locked"
    assert admin.status == 202


def test_an_unknown_action_is_400(cloud):
    server_id = create_server()

    response = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-reboot-twice": None})

    assert response.status == 400
    assert response.body["badRequest"]["message"] == "There is no such action: os-reboot-twice"


# --- delete ----------------------------------------------------------------------------------------


def test_deleting_an_unscheduled_server_removes_it_at_once(cloud):
    server_id = create_server()

    response = call("DELETE", f"/v2.1/servers/{server_id}")

    assert response.status == 204
    assert api_rows(BuildRequest) == [] and api_rows(Port) == []
    assert api_rows(InstanceMapping, instance_uuid=server_id)[0].queued_for_delete is True
    assert call("GET", f"/v2.1/servers/{server_id}").status == 404
    assert call("GET", "/v2.1/servers").body["servers"] == []
    assert cloud.executions("delete") == []


def test_deleting_an_unscheduled_volume_backed_server_releases_its_volume(cloud):
    with api_session() as session:
        session.add(Volume(id="7d2c3a52-0000-4000-8000-000000000002", project_id="project-a", size_gb=2,
                           status="available", path="/tmp/v2"))
    server_id = create_server(block_device_mapping_v2=[{
        "source_type": "volume", "destination_type": "volume", "uuid": "7d2c3a52-0000-4000-8000-000000000002",
        "boot_index": 0}])

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    assert api_rows(Volume, id="7d2c3a52-0000-4000-8000-000000000002")[0].status == "available"
    assert api_rows(VolumeAttachment) == []


def test_deleting_a_scheduled_server_starts_the_delete_workflow(cloud):
    add_host("host1")
    server_id = create_server()
    schedule(server_id)

    response = call("DELETE", f"/v2.1/servers/{server_id}")

    assert response.status == 204
    assert instance(server_id).task_state == states.DELETING
    [execution] = cloud.executions("delete")
    request_id = response.header("x-openstack-request-id")
    assert len(execution["name"]) <= 80
    assert {k: execution["input"][k] for k in ("instance_uuid", "request_id", "cell", "host")} == \
        {"instance_uuid": server_id, "request_id": request_id, "cell": "cell1", "host": "host1"}
    with cell_session("cell1") as session:
        assert session.scalars(select(InstanceAction.action).where(InstanceAction.request_id == request_id)).one() \
            == "delete"


def test_deleting_a_server_on_a_down_host_deletes_locally(cloud):
    add_host("host1", up=False)
    server_id = create_server()
    schedule(server_id)

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    [execution] = cloud.executions("delete")
    assert "host" not in execution["input"]


def volume_backed_server_on(host: str | None, root: dict, *, up: bool = True, vm_state: str = states.ACTIVE,
                            cell: str = "cell1") -> tuple[str, Volume]:
    """A server booted on ``host`` from the volume ``root`` describes; the server and its volume."""
    if host is not None:
        add_host(host, up=up)
    server_id = create_server(block_device_mapping_v2=[{"destination_type": "volume", "boot_index": 0, **root}])
    [bdm] = api_rows(BuildRequest, instance_uuid=server_id)[0].block_device_mappings
    schedule(server_id, cell, host=host, vm_state=vm_state)
    with cell_session(cell) as session:  # what the boot workflow copies into the cell
        columns = {c.key for c in BlockDeviceMapping.__table__.columns} - {"id"}
        session.add(BlockDeviceMapping(instance_uuid=server_id, **{k: v for k, v in bdm.items() if k in columns}))
    with api_session() as session:  # and binds on the host
        session.execute(update(VolumeAttachment).where(VolumeAttachment.instance_uuid == server_id)
                        .values(host=host, status="attached"))
        session.execute(update(Volume).values(status="in-use"))
    return server_id, api_rows(Volume, id=bdm["volume_id"])[0]


@pytest.mark.parametrize("host_up", [True, False])
def test_a_volume_deleted_with_its_server_goes_once_its_host_removed_its_file(cloud, host_up):
    server_id, volume = volume_backed_server_on("host1", {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1, "delete_on_termination": True},
        up=host_up)

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    [execution] = cloud.executions("delete")
    assert execution["input"]["delete_volumes"] == [{"volume_id": volume.id, "path": volume.path}]
    destroyed = {"destroyed": {"volumes_removed": [volume.id]}} if host_up else {}
    delete.finish_delete({**execution["input"], **destroyed})
    delete.finish_delete({**execution["input"], **destroyed})
    assert api_rows(VolumeAttachment) == []
    if host_up:
        assert api_rows(Volume) == []
    else:  # no host removed its file: the volume stays, to be seen
        assert api_rows(Volume, id=volume.id)[0].status == "deleting"


@pytest.mark.parametrize("delete_on_termination", [True, False])
def test_a_volume_made_for_a_server_that_was_never_scheduled_goes_with_it(cloud, delete_on_termination):
    server_id, volume = volume_backed_server_on(None, {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1,
        "delete_on_termination": delete_on_termination}, vm_state=states.ERROR, cell="cell0")

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    [execution] = cloud.executions("delete")
    assert "host" not in execution["input"]  # buried in cell0: no host ever wrote its file
    delete.finish_delete(execution["input"])
    assert api_rows(Volume) == [] and api_rows(VolumeAttachment) == []


@pytest.mark.parametrize("host_up", [True, False])
def test_a_volume_made_from_an_image_for_a_server_that_never_launched_goes_with_it(cloud, host_up):
    # GIVEN a server whose build failed on its host (ERROR, never launched), booted from a volume
    # made from an image that its owner did not ask to delete with it
    server_id, volume = volume_backed_server_on("host1", {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1, "delete_on_termination": False},
        up=host_up, vm_state=states.ERROR)

    # WHEN it is deleted
    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    # THEN its host is asked to remove the volume's file, and the volume goes once it did; a host
    # that could not be asked leaves it deleting, never available without its image in it
    [execution] = cloud.executions("delete")
    expected = [{"volume_id": volume.id, "path": volume.path}]
    assert execution["input"]["delete_volumes"] == expected
    destroyed = {"destroyed": {"volumes_removed": [volume.id]}} if host_up else {}
    delete.finish_delete({**execution["input"], **destroyed})
    if host_up:
        assert api_rows(Volume) == []
    else:
        assert api_rows(Volume, id=volume.id)[0].status == "deleting"


def test_a_volume_made_from_an_image_for_a_server_that_launched_stays_available(cloud):
    server_id, volume = volume_backed_server_on("host1", {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1, "delete_on_termination": False})

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    [execution] = cloud.executions("delete")
    assert execution["input"]["delete_volumes"] == []
    delete.finish_delete({**execution["input"], "destroyed": {"volumes_removed": []}})
    assert api_rows(Volume, id=volume.id)[0].status == "available"


def test_a_volume_of_a_server_rescheduled_to_no_host_stays_deleting(cloud):
    # a spawn on some host may have written (or may still write) the file before the reschedule
    server_id, volume = volume_backed_server_on(None, {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1, "delete_on_termination": True},
        vm_state=states.ERROR)

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    [execution] = cloud.executions("delete")
    delete.finish_delete(execution["input"])
    assert api_rows(Volume, id=volume.id)[0].status == "deleting"


def test_a_server_deleted_while_it_is_built_leaves_its_volume_deleting(cloud):
    server_id, volume = volume_backed_server_on("host1", {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1, "delete_on_termination": True},
        vm_state=states.BUILDING)

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    # the host is not asked to remove the file: its spawn may still write it
    [execution] = cloud.executions("delete")
    assert execution["input"]["delete_volumes"] == []
    delete.finish_delete({**execution["input"], "destroyed": {"volumes_removed": []}})
    assert api_rows(Volume, id=volume.id)[0].status == "deleting"


def test_a_volume_another_server_holds_is_not_deleted_with_this_one(cloud):
    server_id, volume = volume_backed_server_on("host1", {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1, "delete_on_termination": True})
    with api_session() as session:
        session.add(VolumeAttachment(volume_id=volume.id, instance_uuid="another-server", host="host2",
                                     status="attached"))

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    [execution] = cloud.executions("delete")
    assert execution["input"]["delete_volumes"] == []
    delete.finish_delete({**execution["input"], "destroyed": {"volumes_removed": [volume.id]}})
    assert api_rows(Volume, id=volume.id)[0].status == "in-use"
    assert [a.instance_uuid for a in api_rows(VolumeAttachment)] == ["another-server"]


def test_a_volume_detached_before_is_not_deleted_with_the_server(cloud):
    # GIVEN a volume attached with delete_on_termination and detached again, its mapping left
    # behind (a detach whose cell half did not finish)
    server_id, volume = volume_backed_server_on("host1", {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1, "delete_on_termination": True})
    with api_session() as session:
        session.execute(VolumeAttachment.__table__.delete())
        session.execute(update(Volume).values(status="available"))

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    [execution] = cloud.executions("delete")
    assert execution["input"]["delete_volumes"] == []
    delete.finish_delete({**execution["input"], "destroyed": {"volumes_removed": []}})
    assert api_rows(Volume, id=volume.id)[0].status == "available"


def test_a_delete_whose_volume_list_cannot_be_read_puts_the_server_back(cloud, monkeypatch):
    add_host("host1")
    server_id = create_server()
    schedule(server_id)
    real = compute_api.api_session

    def gone_once_deleting(*args, **kwargs):  # the API database goes away once the delete is accepted
        if instance(server_id).task_state == states.DELETING:
            raise OperationalError("select", {}, Exception("API database went away"))
        return real(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(compute_api, "api_session", gone_once_deleting)
        response = call("DELETE", f"/v2.1/servers/{server_id}")

    assert response.status == 503  # a database that went away for the moment: the caller may try again
    assert instance(server_id).task_state is None and cloud.executions("delete") == []
    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204  # and it can be deleted again


def test_a_delete_tried_again_deletes_the_volume_its_first_try_left_deleting(cloud):
    server_id, volume = volume_backed_server_on("host1", {
        "source_type": "image", "uuid": cloud.image_id, "volume_size": 1, "delete_on_termination": True})
    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204
    [execution] = cloud.executions("delete")
    with api_session() as session:  # a first FinishDelete that ran before its host answered
        delete._release_volumes(session, server_id, {volume.id}, set(), set())
    assert api_rows(Volume, id=volume.id)[0].status == "deleting" and api_rows(VolumeAttachment) == []

    delete.finish_delete({**execution["input"], "destroyed": {"volumes_removed": [volume.id]}})

    assert api_rows(Volume) == []


def test_a_volume_kept_after_its_server_is_available_again(cloud):
    with api_session() as session:
        session.add(Volume(id="7d2c3a52-0000-4000-8000-00000000000a", project_id="project-a", size_gb=1,
                           status="available", path="/srv/volumes/7d2c3a52-0000-4000-8000-00000000000a"))
    server_id, volume = volume_backed_server_on("host1", {
        "source_type": "volume", "uuid": "7d2c3a52-0000-4000-8000-00000000000a"})

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    [execution] = cloud.executions("delete")
    assert execution["input"]["delete_volumes"] == []
    delete.finish_delete({**execution["input"], "destroyed": {"volumes_removed": []}})
    assert api_rows(VolumeAttachment) == []
    assert api_rows(Volume, id=volume.id)[0].status == "available"


def test_delete_is_refused_while_another_operation_runs_but_allowed_in_error(cloud):
    add_host("host1")
    busy, broken = create_server(name="busy"), create_server(name="broken")
    schedule(busy)
    schedule(broken, vm_state=states.ERROR)
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid.in_([busy, broken]))
                        .values(task_state=states.POWERING_OFF))

    refused = call("DELETE", f"/v2.1/servers/{busy}")
    accepted = call("DELETE", f"/v2.1/servers/{broken}")

    assert refused.status == 409 and instance(busy).task_state == states.POWERING_OFF
    assert accepted.status == 204 and instance(broken).task_state == states.DELETING


def test_a_delete_workflow_that_cannot_start_restores_the_task_state(cloud, monkeypatch):
    add_host("host1")
    server_id = create_server()
    schedule(server_id)
    monkeypatch.setenv("FERRY_DELETE_STATE_MACHINE_ARN", "")
    config.reset()

    response = call("DELETE", f"/v2.1/servers/{server_id}")

    assert response.status == 500  # the deployment's error stays in the log; the caller gets the request id
    assert response.body["computeFault"]["message"].startswith("Unexpected API Error.")
    assert response.header("x-openstack-request-id") in response.body["computeFault"]["message"]
    assert instance(server_id).task_state is None
    with cell_session("cell1") as session:
        assert session.scalars(select(InstanceAction)).all() == []


# --- instance actions ------------------------------------------------------------------------------


def test_instance_actions_list_and_show_with_events(cloud):
    add_host("host1")
    server_id = create_server()
    schedule(server_id)
    stop = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-stop": None})
    request_id = stop.header("x-openstack-request-id")
    with cell_session("cell1") as session:
        action_id = session.scalars(select(InstanceAction.id).where(InstanceAction.request_id == request_id)).one()
        session.add(InstanceActionEvent(action_id=action_id, event="compute_stop_instance", result="Success",
                                        host="host1", traceback="tb"))

    listed = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions", version="2.90").body
    shown = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{request_id}", version="2.90").body
    by_admin = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{request_id}", caller=ADMIN,
                    version="2.90").body

    assert [(a["action"], a["request_id"]) for a in listed["instanceActions"]] == [("stop", request_id)]
    [event] = shown["instanceAction"]["events"]
    assert (event["event"], event["result"]) == ("compute_stop_instance", "Success")
    assert "traceback" not in event and "host" not in event and event["hostId"]
    assert by_admin["instanceAction"]["events"][0]["traceback"] == "tb"
    assert call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/req-nope").status == 404


def deleted_server(cloud) -> tuple[str, str, str]:
    """A server stopped once, then deleted to the end (its delete workflow's last step run).

    Returns the server and the request ids of its stop and its delete.
    """
    add_host("host1")
    server_id = create_server()
    schedule(server_id)
    stop = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-stop": None})
    with cell_session("cell1") as session:  # what the power workflow ends with
        session.execute(update(Instance).where(Instance.uuid == server_id)
                        .values(vm_state=states.STOPPED, task_state=None, power_state=states.SHUTDOWN))
    removal = call("DELETE", f"/v2.1/servers/{server_id}")
    assert (stop.status, removal.status) == (202, 204)
    [execution] = cloud.executions("delete")
    delete.finish_delete(execution["input"])
    return server_id, stop.header("x-openstack-request-id"), removal.header("x-openstack-request-id")


def test_actions_of_a_deleted_server_are_shown_from_2_21(cloud):
    server_id, stop_id, delete_id = deleted_server(cloud)
    base = f"/v2.1/servers/{server_id}/os-instance-actions"

    listed = call("GET", base, version="2.21")
    shown = call("GET", f"{base}/{delete_id}", version="2.21")

    assert listed.status == 200, listed.body
    assert [(a["action"], a["request_id"]) for a in listed.body["instanceActions"]] == \
        [("delete", delete_id), ("stop", stop_id)]
    assert shown.status == 200 and shown.body["instanceAction"]["action"] == "delete"
    assert call("GET", f"{base}/{stop_id}", caller=ADMIN, version="2.21").status == 200
    assert call("GET", base, caller=BOB, version="2.21").status == 404
    assert call("GET", base, version="2.20").status == 404
    assert call("GET", f"{base}/{stop_id}", version="2.20").status == 404
    assert call("GET", f"/v2.1/servers/{server_id}", version="2.21").status == 404


@pytest.mark.parametrize(("version", "name"), [
    ("2.58", "foo"),
    ("2.96", "sort_key"),
    ("2.65", "changes-before"),  # from 2.66
    ("2.96", "server_id"),
])
def test_the_action_list_refuses_query_parameters_it_does_not_know_from_2_58(cloud, version, name):
    server_id = create_server()

    response = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions", version=version, query={name: "x"})

    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == (
        f"Invalid input for query parameters {name}. Additional properties are not allowed ('{name}' was unexpected)")


def test_the_action_list_ignores_unknown_query_parameters_below_2_58(cloud):
    server_id = create_server()

    response = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions", version="2.57",
                    query={"foo": "bar", "limit": "nonsense"})

    assert response.status == 200, response.body
    assert "instanceActions" in response.body


@pytest.mark.parametrize(("caller", "version", "shows_events"), [
    (ALICE, "2.1", False),
    (ALICE, "2.50", False),
    (ALICE, "2.51", True),
    (ADMIN, "2.1", True),
    (ADMIN, "2.50", True),
])
def test_events_below_2_51_are_shown_only_under_the_events_policy(cloud, caller, version, shows_events):
    add_host("host1")
    server_id = create_server()
    schedule(server_id)
    request_id = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-stop": None}
                      ).header("x-openstack-request-id")

    shown = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{request_id}", caller=caller,
                 version=version)

    assert shown.status == 200
    assert ("events" in shown.body["instanceAction"]) is shows_events


def test_the_events_policy_can_show_events_to_members_below_2_51(cloud, tmp_path, monkeypatch):
    add_host("host1")
    server_id = create_server()
    schedule(server_id)
    request_id = call("POST", f"/v2.1/servers/{server_id}/action", body={"os-stop": None}
                      ).header("x-openstack-request-id")
    (tmp_path / "policy.yaml").write_text('"os_compute_api:os-instance-actions:events": "member"\n')
    monkeypatch.setenv("FERRY_POLICY_FILE", str(tmp_path / "policy.yaml"))
    config.reset()

    shown = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{request_id}", version="2.50")

    assert shown.body["instanceAction"]["events"] == []


def test_domain_get_server_rereads_a_server_scheduled_meanwhile(cloud):
    server_id = create_server()
    schedule(server_id)
    ctx = RequestContext(user_id="alice", project_id="project-a")

    assert compute_api.get_server(ctx, server_id).cell == "cell1"
    with pytest.raises(errors.InstanceNotFound):
        compute_api.get_server(ctx, "not-a-uuid")


# --- update (PUT /servers/{id}) ---------------------------------------------------------------------


def _update(server_id: str, body: dict, *, caller=ALICE, version: str = "2.19"):
    return call("PUT", f"/v2.1/servers/{server_id}", caller=caller, version=version, body={"server": body})


def test_a_server_created_below_2_19_is_described_by_its_name(cloud):
    server_id = create_server(name="named", version="2.18", networks=[])

    assert call("GET", f"/v2.1/servers/{server_id}", version="2.19").body["server"]["description"] == "named"


def test_create_keeps_the_description_from_2_19(cloud):
    server_id = create_server(name="described", description="the build box")

    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.19").body["server"]
    assert shown["description"] == "the build box"
    schedule(server_id)
    assert instance(server_id).display_description == "the build box"
    assert call("GET", f"/v2.1/servers/{server_id}", version="2.19").body["server"]["description"] == "the build box"
    assert "description" not in call("GET", f"/v2.1/servers/{server_id}", version="2.18").body["server"]


def test_update_renames_a_server_and_changes_its_description(cloud):
    server_id = create_server(name="old-name")
    schedule(server_id, hidden_copy_in="cell2")

    response = _update(server_id, {"name": "new-name", "description": "  spaced  out  ", "accessIPv4": "10.0.0.9"})

    assert response.status == 200, response.body
    assert (response.body["server"]["name"], response.body["server"]["description"]) == (
        "new-name", "  spaced  out  ")
    assert response.body["server"]["id"] == server_id and response.body["server"]["status"] == "ACTIVE"
    assert (instance(server_id).display_name, instance(server_id).display_description) == (
        "new-name", "  spaced  out  ")
    assert instance(server_id, "cell2").display_name == "stale-copy"  # a hidden copy is not the server
    # a description of null clears it; a body naming nothing changes nothing
    assert _update(server_id, {"description": None}).body["server"]["description"] is None
    before = instance(server_id).updated_at
    assert _update(server_id, {}).body["server"]["name"] == "new-name"
    assert instance(server_id).updated_at == before


@pytest.mark.parametrize("version", ["2.74", "2.75"])
def test_update_answers_the_servers_extensions_only_from_2_75(cloud, version):
    # As Nova: from 2.75 PUT answers every field GET shows; before, the server without its
    # extensions' fields
    server_id = create_server(name="old-name")
    schedule(server_id)

    updated = call("PUT", f"/v2.1/servers/{server_id}", caller=ADMIN, version=version,
                   body={"server": {"name": "new-name"}}).body["server"]
    shown = call("GET", f"/v2.1/servers/{server_id}", caller=ADMIN, version=version).body["server"]

    extensions = {key for key in shown if key.startswith(("OS-EXT-", "OS-SRV-USG:", "os-extended-volumes:"))} | {
        "key_name", "config_drive", "security_groups", "host_status"}
    assert "OS-EXT-STS:vm_state" in extensions and "OS-EXT-SRV-ATTR:host" in extensions
    if version == "2.75":
        assert updated == shown
    else:
        assert not extensions & set(updated)
        assert {key: value for key, value in shown.items() if key not in extensions | {"addresses"}} == {
            key: value for key, value in updated.items() if key != "addresses"}
        assert all(set(address) == {"addr", "version"}
                   for addresses in updated["addresses"].values() for address in addresses)


def test_update_of_a_server_still_being_scheduled_changes_its_build_request(cloud):
    server_id = create_server(name="early")

    assert _update(server_id, {"name": "renamed-early"}).status == 200

    assert call("GET", f"/v2.1/servers/{server_id}").body["server"]["name"] == "renamed-early"
    schedule(server_id)  # the boot workflow copies the build request into the cell
    assert instance(server_id).display_name == "renamed-early"


@pytest.mark.parametrize(("body", "version"), [
    ({"name": " leading"}, "2.19"),
    ({"name": "zero\u200bwidth"}, "2.19"),
    ({"name": ""}, "2.19"),
    ({"description": "bell\x07"}, "2.19"),
    ({"description": "line one\nline two"}, "2.19"),
    ({"accessIPv4": 4}, "2.19"),
    ({"description": "x" * 256}, "2.19"),
    ({"description": "from 2.19 only"}, "2.18"),
    ({"hostname": "vm_1"}, "2.90"),
    ({"hostname": "vm1"}, "2.89"),
])
def test_update_refuses_what_it_does_not_take_and_changes_nothing(cloud, body, version):
    server_id = create_server(name="steady", description="kept")
    schedule(server_id)

    response = _update(server_id, body, version=version)

    assert response.status == 400, response.body
    assert (instance(server_id).display_name, instance(server_id).display_description) == ("steady", "kept")


def test_update_of_another_projects_server_is_not_found_but_an_admin_may(cloud):
    server_id = create_server(name="alices")
    schedule(server_id)

    assert _update(server_id, {"name": "bobs-now"}, caller=BOB).status == 404
    assert _update(server_id, {"name": "by-admin"}, caller=ADMIN).status == 200
    assert instance(server_id).display_name == "by-admin"
    assert _update(str(uuid.uuid4()), {"name": "nobody"}).status == 404


@pytest.mark.parametrize(("task_state", "cross_cell", "status"), [
    (states.RESIZE_FINISH, True, 409),  # the move is switching the server to the other cell's copy
    (states.RESIZE_REVERTING, True, 409),
    (states.RESIZE_FINISH, False, 200),  # within a cell there is one copy: nothing to lose
    (states.RESIZE_MIGRATING, True, 200),  # the switch copies the source's values, renames included
    (None, True, 200),  # VERIFY_RESIZE after a move between cells: no switch under way
])
def test_a_rename_is_refused_only_while_a_move_between_cells_switches_the_server(cloud, task_state, cross_cell,
                                                                                  status):
    server_id = create_server(name="mover")
    schedule(server_id)
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server_id).values(task_state=task_state))
        session.add(Migration(instance_uuid=server_id, status="post-migrating", migration_type="resize",
                              cross_cell_move=cross_cell, source_compute="host1", dest_compute="host9"))

    response = _update(server_id, {"name": "renamed-mid-move"})

    assert response.status == status, response.body
    assert instance(server_id).display_name == ("mover" if status == 409 else "renamed-mid-move")
    if status == 409:
        assert "moving between cells" in response.body["conflictingRequest"]["message"]


# --- hostname, reservation id, user data ------------------------------------------------------------


def _shown(server_id: str, *, caller=ADMIN, version: str = "2.90") -> dict:
    return call("GET", f"/v2.1/servers/{server_id}", caller=caller, version=version).body["server"]


def test_a_server_asks_for_its_hostname_from_2_90_and_everyone_sees_it_from_then(cloud):
    server_id = create_server(name="Web Server", hostname="web-01")

    assert _shown(server_id, caller=ALICE)["OS-EXT-SRV-ATTR:hostname"] == "web-01"
    assert "OS-EXT-SRV-ATTR:hostname" not in _shown(server_id, caller=ALICE, version="2.89")
    assert _shown(server_id, version="2.3")["OS-EXT-SRV-ATTR:hostname"] == "web-01"  # admins' from 2.3
    assert "OS-EXT-SRV-ATTR:hostname" not in _shown(server_id, version="2.2")
    # a rename keeps the hostname; PUT changes it from 2.90
    assert _update(server_id, {"name": "renamed"}, version="2.90").body["server"]["OS-EXT-SRV-ATTR:hostname"] \
        == "web-01"
    assert _update(server_id, {"hostname": "web-02"}, version="2.90").body["server"]["OS-EXT-SRV-ATTR:hostname"] \
        == "web-02"


@pytest.mark.parametrize(("name", "hostname"), [
    ("My Web_Server.1 é☕", "my-web-server-1-é"),
    ("--edge.", "edge"),
    ("x" * 70, "x" * 63),
])
def test_a_server_without_a_hostname_gets_one_made_from_its_name(cloud, name, hostname):
    server_id = create_server(name=name)

    assert _shown(server_id)["OS-EXT-SRV-ATTR:hostname"] == hostname


def test_a_name_with_nothing_for_a_hostname_gives_server_and_the_uuid(cloud):
    server_id = create_server(name="☕☕")

    assert _shown(server_id)["OS-EXT-SRV-ATTR:hostname"] == f"Server-{server_id}"


@pytest.mark.parametrize(("hostname", "version", "status"), [
    ("web_01", "2.90", 400), ("w", "2.90", 400), ("-web", "2.90", 400), ("web-", "2.90", 400),
    ("xn--bcher-kva", "2.90", 202), ("web.example.org", "2.90", 400), ("web.example.org", "2.94", 202),
    ("web_01.example", "2.94", 202), ("web 01", "2.94", 400), ("web-01", "2.89", 400),
])
def test_create_checks_the_hostname_as_nova_does_at_each_microversion(cloud, hostname, version, status):
    response = call("POST", "/v2.1/servers", version=version, body={"server": {
        "name": "h", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "none", "hostname": hostname}})

    assert response.status == status, response.body


def test_admins_see_the_extended_attributes_from_2_3(cloud):
    user_data = base64.b64encode(b"#cloud-config\n").decode()
    server_id = create_server(name="extended", user_data=user_data)

    building = _shown(server_id, version="2.3")
    assert building["OS-EXT-SRV-ATTR:root_device_name"] is None  # not yet in a cell
    buried = create_server(name="buried")
    schedule(buried, "cell0", host=None, vm_state=states.ERROR)
    assert _shown(buried, version="2.3")["OS-EXT-SRV-ATTR:root_device_name"] is None  # never on a host
    schedule(server_id)
    shown = _shown(server_id, version="2.3")
    assert re.fullmatch(r"r-[a-z0-9]{8}", shown["OS-EXT-SRV-ATTR:reservation_id"])
    assert {k: shown[k] for k in ("OS-EXT-SRV-ATTR:launch_index", "OS-EXT-SRV-ATTR:kernel_id",
                                  "OS-EXT-SRV-ATTR:ramdisk_id", "OS-EXT-SRV-ATTR:root_device_name",
                                  "OS-EXT-SRV-ATTR:user_data", "OS-EXT-SRV-ATTR:hostname")} == {
        "OS-EXT-SRV-ATTR:launch_index": 0, "OS-EXT-SRV-ATTR:kernel_id": "", "OS-EXT-SRV-ATTR:ramdisk_id": "",
        "OS-EXT-SRV-ATTR:root_device_name": "/dev/vda", "OS-EXT-SRV-ATTR:user_data": user_data,
        "OS-EXT-SRV-ATTR:hostname": "extended"}
    assert "OS-EXT-SRV-ATTR:reservation_id" not in _shown(server_id, caller=ALICE, version="2.3")


def test_user_data_may_be_line_wrapped_base64_as_nova_takes_it(cloud):
    wrapped = base64.encodebytes(b"x" * 100).decode()  # lines of 76 characters
    server_id = create_server(name="wrapped", user_data=wrapped)

    assert _shown(server_id, version="2.3")["OS-EXT-SRV-ATTR:user_data"] == wrapped


def test_user_data_must_be_base64(cloud):
    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "u", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "none", "user_data": "not base64!"}})

    assert response.status == 400
    assert response.body["badRequest"]["message"] == "User data needs to be valid base 64."
    assert api_rows(BuildRequest) == []


def test_return_reservation_id_answers_the_reservation_the_list_filters_by(cloud):
    create_server(name="other")
    response = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "reserved", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "none",
        "return_reservation_id": "True"}})

    assert response.status == 202
    assert list(response.body) == ["reservation_id"]
    reservation = response.body["reservation_id"]
    listed = call("GET", "/v2.1/servers", version="2.90", query={"reservation_id": reservation}).body["servers"]
    assert [s["name"] for s in listed] == ["reserved"]
