"""A server's life on the local stack: boot, stop, start and delete through the compute API.

Each test checks the API's answer and what lies behind it: placement's allocations, the ports,
the instance's disk files on its host and the host agent's journal.
"""

from __future__ import annotations

import pytest

from ferry.local.seed import IMAGE_MARKER

pytestmark = pytest.mark.e2e

GiB = 2**30
RUNNING = 1
SHUTDOWN = 4
TINY = "1"
# The flavor with an ephemeral disk and swap (see ferry.local.seed.DEFAULT_FLAVORS).
LARGE = "4"


def _flavor_resources(servers, flavor_id: str) -> dict[str, int]:
    """What placement should hold for a server of the flavor, from the flavor the API shows."""
    response = servers.api("demo").get(f"/flavors/{flavor_id}")
    assert response.status_code == 200, response.text
    flavor = response.json()["flavor"]
    disk = flavor["disk"] + flavor["OS-FLV-EXT-DATA:ephemeral"] + -(-int(flavor["swap"] or 0) // 1024)
    return {"VCPU": flavor["vcpus"], "MEMORY_MB": flavor["ram"], "DISK_GB": disk}


def _plus(usage: dict[str, int], extra: dict[str, int]) -> dict[str, int]:
    total = dict(usage)
    for rc, amount in extra.items():
        total[rc] = total.get(rc, 0) + amount
    return total


def test_boot_makes_an_active_server_whose_host_holds_exactly_the_flavor(servers, records, local_stack):
    # GIVEN the usage of every host before the boot
    before = records.usages_by_host()
    expected = _flavor_resources(servers, TINY)

    # WHEN the demo user boots a tiny server
    server = servers.boot("demo", flavor=TINY, name="e2e-boot")

    # THEN it is ACTIVE and running on one of the stack's hosts
    host = server["OS-EXT-SRV-ATTR:host"]
    assert host in local_stack.hosts
    assert server["OS-EXT-STS:vm_state"] == "active"
    assert server["OS-EXT-STS:power_state"] == RUNNING
    assert server["tenant_id"] == "demo"
    assert server["flavor"]["original_name"] == "ferry.tiny"
    assert server["addresses"]["shared"], server["addresses"]

    # AND placement holds exactly the flavor, for this server, on that host and nowhere else
    assert records.allocations(server["id"]) == {records.provider(host): expected}
    after = records.usages_by_host()
    assert after[host] == _plus(before[host], expected)
    assert {h: u for h, u in after.items() if h != host} == {h: u for h, u in before.items() if h != host}

    # AND the root disk is a real file on that host, the flavor's size, starting with the image
    root = records.instance_dir(host, server["id"]) / "disk"
    assert root.is_file()
    assert root.stat().st_size == 1 * GiB
    with root.open("rb") as disk:
        assert disk.read(len(IMAGE_MARKER)) == IMAGE_MARKER
    assert not any(records.instance_dir(h, server["id"]).exists() for h in local_stack.hosts if h != host)
    assert records.host_operations(host, server["id"]) == [("spawn", "succeeded")]

    # AND one port is plugged into it
    assert len(records.ports(server["id"])) == 1


def test_boot_is_recorded_as_a_create_action_with_its_events(servers):
    server = servers.boot("demo", name="e2e-actions")

    response = servers.api("demo").get(f"/servers/{server['id']}/os-instance-actions")
    assert response.status_code == 200, response.text
    actions = response.json()["instanceActions"]
    assert [a["action"] for a in actions] == ["create"]
    create = actions[0]
    assert create["instance_uuid"] == server["id"]
    assert create["project_id"] == "demo"
    assert create["user_id"] == server["user_id"]

    detail = servers.api("demo").get(f"/servers/{server['id']}/os-instance-actions/{create['request_id']}")
    assert detail.status_code == 200, detail.text
    events = {e["event"]: e for e in detail.json()["instanceAction"]["events"]}
    assert set(events) == {"conductor_schedule_and_build_instances", "compute__do_build_and_run_instance"}
    assert all(e["result"] == "Success" and e["finish_time"] for e in events.values()), events


def test_boot_with_ephemeral_and_swap_creates_those_disks_and_claims_them(servers, records):
    expected = _flavor_resources(servers, LARGE)

    server = servers.boot("demo", flavor=LARGE, name="e2e-large")

    host = server["OS-EXT-SRV-ATTR:host"]
    assert records.allocations(server["id"]) == {records.provider(host): expected}
    directory = records.instance_dir(host, server["id"])
    assert (directory / "disk").stat().st_size == 8 * GiB
    assert (directory / "disk.eph0").stat().st_size == 1 * GiB
    assert (directory / "disk.swap").stat().st_size == 128 * 2**20


def test_stop_shuts_the_server_off_and_start_runs_it_again(servers, records):
    server = servers.boot("demo", name="e2e-power")
    server_id, host = server["id"], server["OS-EXT-SRV-ATTR:host"]
    allocations = records.allocations(server_id)

    response = servers.action(server_id, {"os-stop": None})
    assert response.status_code == 202, response.text
    stopped = servers.wait_for_status(server_id, "SHUTOFF")
    assert stopped["OS-EXT-STS:vm_state"] == "stopped"
    assert stopped["OS-EXT-STS:power_state"] == SHUTDOWN
    assert stopped["OS-EXT-SRV-ATTR:host"] == host
    # A stopped server keeps its resources and its disks.
    assert records.allocations(server_id) == allocations
    assert (records.instance_dir(host, server_id) / "disk").is_file()

    # Stopping a stopped server is a conflict, as in Nova.
    assert servers.action(server_id, {"os-stop": None}).status_code == 409

    response = servers.action(server_id, {"os-start": None})
    assert response.status_code == 202, response.text
    started = servers.wait_for_status(server_id, "ACTIVE")
    assert started["OS-EXT-STS:vm_state"] == "active"
    assert started["OS-EXT-STS:power_state"] == RUNNING
    assert started["OS-EXT-SRV-ATTR:host"] == host
    assert records.allocations(server_id) == allocations

    assert records.host_operations(host, server_id) == [
        ("spawn", "succeeded"), ("power_off", "succeeded"), ("power_on", "succeeded")]
    actions = servers.api("demo").get(f"/servers/{server_id}/os-instance-actions").json()["instanceActions"]
    assert sorted(a["action"] for a in actions) == ["create", "start", "stop"]


def test_delete_removes_the_server_its_allocations_disks_and_port(servers, records):
    before = records.usages_by_host()
    server = servers.boot("demo", name="e2e-delete")
    server_id, host = server["id"], server["OS-EXT-SRV-ATTR:host"]
    ports = records.ports(server_id)
    assert len(ports) == 1
    assert records.instance_dir(host, server_id).is_dir()

    response = servers.delete(server_id)
    assert response.status_code == 204, response.text
    servers.wait_until_gone(server_id)

    assert servers.show(server_id, "demo") is None
    assert servers.api("demo").get(f"/servers/{server_id}").json()["itemNotFound"]["code"] == 404
    listed = servers.api("demo").get("/servers").json()["servers"]
    assert server_id not in {s["id"] for s in listed}
    assert records.allocations(server_id) == {}
    assert not records.consumer_exists(server_id)
    assert records.usages_by_host() == before
    assert not records.instance_dir(host, server_id).exists()
    assert records.ports(server_id) == []
    assert not any(records.port_exists(port) for port in ports)
    assert records.host_operations(host, server_id)[-1] == ("destroy", "succeeded")
