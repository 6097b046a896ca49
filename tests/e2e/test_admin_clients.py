"""Operators' tools against the local stack: host aggregates and compute services through the
``openstack`` CLI and openstacksdk.

Every test puts back what it changed (services enabled again, its aggregates deleted), so the
tests that share the stack after it see the hosts as the stack made them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

OPENSTACK = Path(sys.executable).with_name("openstack")
CLI_TIMEOUT_SECONDS = 120
MICROVERSION = {"OpenStack-API-Version": "compute 2.81"}


class AdminCli:
    """Runs ``openstack --os-cloud ferry-admin ...`` with only the stack's clouds.yaml for configuration."""

    def __init__(self, clouds_yaml: Path, cloud: str, workdir: Path) -> None:
        self.cloud = cloud
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OS_")}
        self.env.update(OS_CLIENT_CONFIG_FILE=str(clouds_yaml), HOME=str(workdir), XDG_CONFIG_HOME=str(workdir))

    def attempt(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(OPENSTACK), "--os-cloud", self.cloud, *args], env=self.env, capture_output=True,
                              text=True, timeout=CLI_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        result = self.attempt(*args)
        assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stderr}"
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-f", "json").stdout)


@pytest.fixture
def cli(local_stack, tmp_path) -> AdminCli:
    if not OPENSTACK.exists():
        pytest.fail(f"{OPENSTACK} is missing: python-openstackclient belongs in the dev dependencies")
    return AdminCli(local_stack.clouds_yaml, local_stack.cloud("admin"), tmp_path)


@pytest.fixture
def admin_api(local_stack):
    session = local_stack.session("admin")
    session.headers.update(MICROVERSION)
    return session


@pytest.fixture
def restore_services(admin_api) -> Iterator[None]:
    """Every compute service enabled and not forced down after the test, whatever it did."""
    yield
    for service in admin_api.get("/os-services").json()["services"]:
        if service["status"] != "enabled" or service["forced_down"]:
            response = admin_api.put(f"/os-services/{service['id']}", json={"status": "enabled",
                                                                             "forced_down": False})
            assert response.status_code == 200, response.text


@pytest.fixture
def aggregate_names(admin_api) -> Iterator[list[str]]:
    """Names of the aggregates a test makes; whichever still exist afterwards are emptied and deleted."""
    names: list[str] = []
    yield names
    for aggregate in admin_api.get("/os-aggregates").json()["aggregates"]:
        if aggregate["name"] not in names:
            continue
        for host in aggregate["hosts"]:
            admin_api.post(f"/os-aggregates/{aggregate['id']}/action", json={"remove_host": {"host": host}})
        response = admin_api.delete(f"/os-aggregates/{aggregate['id']}")
        assert response.status_code == 200, response.text


def test_the_cli_manages_an_aggregate_from_create_to_delete(cli, local_stack, aggregate_names):
    name = f"e2e-gen9-{uuid.uuid4().hex[:8]}"
    zone = f"e2e-zone-{uuid.uuid4().hex[:8]}"
    host = sorted(local_stack.hosts)[0]
    aggregate_names.append(name)

    created = cli.json("aggregate", "create", "--zone", zone, "--property", "hw_generation=gen9", name)
    assert (created["name"], created["availability_zone"]) == (name, zone)
    assert created["properties"] == {"hw_generation": "gen9", "availability_zone": zone}

    added = cli.json("aggregate", "add", "host", name, host)
    assert added["hosts"] == [host]
    cli.run("aggregate", "set", "--property", "ssd=true", name)

    shown = cli.json("aggregate", "show", name)
    assert (shown["name"], shown["availability_zone"], shown["hosts"]) == (name, zone, [host])
    assert shown["properties"] == {"hw_generation": "gen9", "ssd": "true"}
    assert str(uuid.UUID(shown["uuid"])) == shown["uuid"]

    listed = {a["Name"]: a for a in cli.json("aggregate", "list", "--long")}
    assert listed[name]["Availability Zone"] == zone
    assert listed[name]["Hosts"] == [host]
    assert listed[name]["Properties"] == {"hw_generation": "gen9", "ssd": "true"}

    # The host's compute service now reports the aggregate's zone.
    services = {s["Host"]: s for s in cli.json("compute", "service", "list")}
    assert services[host]["Zone"] == zone

    refused = cli.attempt("aggregate", "delete", name)
    assert refused.returncode != 0
    assert name in {a["Name"] for a in cli.json("aggregate", "list")}

    cli.run("aggregate", "set", "--property", "ssd=false", "--name", f"{name}-b", name)
    aggregate_names.append(f"{name}-b")
    assert cli.json("aggregate", "show", f"{name}-b")["properties"]["ssd"] == "false"
    removed = cli.json("aggregate", "remove", "host", f"{name}-b", host)
    assert removed["hosts"] == []
    cli.run("aggregate", "delete", f"{name}-b")
    assert {name, f"{name}-b"}.isdisjoint(a["Name"] for a in cli.json("aggregate", "list"))


def test_the_cli_disables_a_host_and_the_scheduler_skips_it(cli, local_stack, servers, restore_services):
    hosts = sorted(local_stack.hosts)
    listed = {s["Host"]: s for s in cli.json("compute", "service", "list")}
    assert set(listed) == set(hosts)
    assert {(s["Binary"], s["Status"], s["State"]) for s in listed.values()} == {("nova-compute", "enabled", "up")}

    # Every host but one disabled: a new server can only land on that one.
    keep = hosts[-1]
    for host in hosts[:-1]:
        cli.run("compute", "service", "set", "--disable", "--disable-reason", "e2e maintenance", host, "nova-compute")
    long = {s["Host"]: s for s in cli.json("compute", "service", "list", "--long")}
    for host in hosts[:-1]:
        assert (long[host]["Status"], long[host]["Disabled Reason"]) == ("disabled", "e2e maintenance")
    assert (long[keep]["Status"], long[keep]["Disabled Reason"]) == ("enabled", None)

    server = servers.boot(name="e2e-disabled-hosts")
    assert server["OS-EXT-SRV-ATTR:host"] == keep

    cli.run("compute", "service", "set", "--enable", hosts[0], "nova-compute")
    enabled = {s["Host"]: s for s in cli.json("compute", "service", "list", "--long", "--host", hosts[0])}
    assert list(enabled) == [hosts[0]]
    assert (enabled[hosts[0]]["Status"], enabled[hosts[0]]["Disabled Reason"]) == ("enabled", None)


def test_the_cli_places_a_server_on_a_named_host_and_lists_one_projects_servers(cli, local_stack, servers):
    host = sorted(local_stack.hosts)[-1]
    name = f"e2e-placed-{uuid.uuid4().hex[:8]}"
    created = cli.json("--os-compute-api-version", "2.74", "server", "create", "--flavor", "ferry.tiny",
                       "--image", local_stack.seeded.image["name"], "--nic", "none", "--host", host, "--wait", name)
    servers.created.append(created["id"])

    shown = cli.json("--os-compute-api-version", "2.74", "server", "show", name)
    assert (shown["status"], shown["OS-EXT-SRV-ATTR:host"], shown["host_status"]) == ("ACTIVE", host, "UP")

    # the admin lists the project demo's servers, the CLI looking the project up first
    demo_server = servers.boot(name="e2e-project-list")
    listed = {s["ID"] for s in cli.json("server", "list", "--project", "demo")}
    assert demo_server["id"] in listed and created["id"] not in listed

    # a deleted server is listed again with --deleted (admins only)
    cli.run("server", "delete", "--wait", name)
    deleted = {s["ID"]: s["Status"] for s in cli.json("server", "list", "--deleted", "--all-projects")}
    assert deleted.get(created["id"]) == "DELETED" and demo_server["id"] not in deleted


# openstacksdk warns about its own deprecations on nearly every call.
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")
def test_openstacksdk_drives_aggregates_and_services(local_stack, monkeypatch, aggregate_names, restore_services):
    import openstack

    monkeypatch.setenv("OS_CLIENT_CONFIG_FILE", str(local_stack.clouds_yaml))
    host = sorted(local_stack.hosts)[1]
    name = f"e2e-sdk-{uuid.uuid4().hex[:8]}"
    aggregate_names.append(name)
    conn = openstack.connect(cloud=local_stack.cloud("admin"))
    try:
        aggregate = conn.compute.create_aggregate(name=name)
        conn.compute.add_host_to_aggregate(aggregate, host)
        conn.compute.set_aggregate_metadata(aggregate, {"ssd": "true"})
        found = conn.compute.find_aggregate(name, ignore_missing=False)
        assert (found.id, found.hosts, found.metadata) == (aggregate.id, [host], {"ssd": "true"})
        conn.compute.remove_host_from_aggregate(aggregate, host)
        conn.compute.delete_aggregate(aggregate)
        assert conn.compute.find_aggregate(name) is None

        service = next(iter(conn.compute.services(host=host, binary="nova-compute")))
        conn.compute.disable_service(service, host, "nova-compute", "sdk check")
        disabled = next(iter(conn.compute.services(host=host)))
        assert (disabled.id, disabled.status, disabled.disabled_reason) == (service.id, "disabled", "sdk check")
        conn.compute.enable_service(service, host, "nova-compute")
        assert next(iter(conn.compute.services(host=host))).status == "enabled"
    finally:
        conn.close()


def test_the_cli_looks_projects_up_for_quotas_and_private_flavors(cli, admin_api):
    # quota show/set and flavor create --project look the project up in the identity API first
    cores = admin_api.get("/os-quota-sets/alt").json()["quota_set"]["cores"]
    try:
        cli.run("quota", "set", "--cores", str(cores + 7), "alt")
        assert admin_api.get("/os-quota-sets/alt").json()["quota_set"]["cores"] == cores + 7
        cli.run("quota", "show", "--compute", "alt")
    finally:
        assert admin_api.put("/os-quota-sets/alt", json={"quota_set": {"cores": cores}}).status_code == 200

    name = f"e2e-private-{uuid.uuid4().hex[:8]}"
    created = cli.json("flavor", "create", "--private", "--project", "alt", "--vcpus", "1", "--ram", "256",
                       "--disk", "1", name)
    try:
        assert created["os-flavor-access:is_public"] is False
        assert admin_api.get(f"/flavors/{created['id']}/os-flavor-access").json() == \
            {"flavor_access": [{"flavor_id": created["id"], "tenant_id": "alt"}]}
        assert cli.json("flavor", "show", name)["access_project_ids"] == ["alt"]
        cli.run("flavor", "unset", "--project", "alt", name)
        assert admin_api.get(f"/flavors/{created['id']}/os-flavor-access").json() == {"flavor_access": []}
    finally:
        cli.run("flavor", "delete", name)
