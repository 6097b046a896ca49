"""The real clients against the local stack: the ``openstack`` CLI and openstacksdk, configured by its clouds.yaml."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from ferry import cli as ferry_cli
from ferry.store.api_models import Volume
from ferry.store.db import api_session

pytestmark = pytest.mark.e2e

OPENSTACK = Path(sys.executable).with_name("openstack")
CLI_TIMEOUT_SECONDS = 120


class OpenStackCli:
    """Runs ``openstack --os-cloud <cloud> ...`` with only the stack's clouds.yaml for configuration."""

    def __init__(self, clouds_yaml: Path, cloud: str, workdir: Path) -> None:
        self.cloud = cloud
        self.workdir = workdir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OS_")}
        # No user-wide clouds.yaml or cache may leak in.
        self.env.update(OS_CLIENT_CONFIG_FILE=str(clouds_yaml), HOME=str(workdir), XDG_CONFIG_HOME=str(workdir))

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [str(OPENSTACK), "--os-cloud", self.cloud, *args]
        result = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=CLI_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL
        )
        assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{result.stderr}"
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-f", "json").stdout)


@pytest.fixture
def cli(local_stack, tmp_path) -> OpenStackCli:
    if not OPENSTACK.exists():
        pytest.fail(f"{OPENSTACK} is missing: python-openstackclient belongs in the dev dependencies")
    return OpenStackCli(local_stack.clouds_yaml, local_stack.cloud("demo"), tmp_path)


def test_the_openstack_cli_drives_a_server_through_its_life(cli, servers, local_stack):
    name = f"e2e-cli-{uuid.uuid4().hex[:8]}"
    image = local_stack.seeded.image
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    flavors = {f["Name"]: f for f in cli.json("flavor", "list")}
    assert set(flavors) == {"ferry.tiny", "ferry.small", "ferry.medium", "ferry.large"}
    assert (flavors["ferry.tiny"]["ID"], flavors["ferry.tiny"]["VCPUs"], flavors["ferry.tiny"]["RAM"]) == ("1", 1, 256)

    created = cli.json("server", "create", "--flavor", "ferry.tiny", "--image", image["name"], "--nic", "auto",
                       "--wait", name)
    server_id = created["id"]
    servers.created.append(server_id)  # deleted at the end should a later step fail
    assert created["status"] == "ACTIVE"
    assert created["name"] == name

    listed = {s["ID"]: s for s in cli.json("server", "list")}
    assert listed[server_id]["Name"] == name
    assert listed[server_id]["Status"] == "ACTIVE"
    assert listed[server_id]["Flavor"] == "ferry.tiny"
    # the CLI's filters reach the API, which applies them (flavor and image names become ids)
    assert server_id in {s["ID"] for s in cli.json("server", "list", "--flavor", "ferry.tiny", "--image",
                                                    image["name"], "--status", "ACTIVE", "--long")}
    assert server_id not in {s["ID"] for s in cli.json("server", "list", "--flavor", "ferry.small")}
    assert server_id not in {s["ID"] for s in cli.json("server", "list", "--changes-since", "2999-01-01T00:00:00Z")}

    shown = cli.json("server", "show", name)
    assert shown["id"] == server_id
    assert shown["status"] == "ACTIVE"
    assert shown["OS-EXT-STS:power_state"] in (1, "Running")
    assert shown["flavor"]["original_name"] == "ferry.tiny"
    assert image["id"] in shown["image"]

    # renamed and described, as server set does it (PUT /servers/{id}); then found by the new name
    renamed = f"{name}-renamed"
    cli.run("server", "set", "--name", renamed, "--description", "e2e: renamed by the CLI", name)
    described = cli.json("server", "show", renamed)
    assert (described["id"], described["description"]) == (server_id, "e2e: renamed by the CLI")
    name = renamed

    cli.run("server", "stop", name)
    servers.wait_for_status(server_id, "SHUTOFF")
    stopped = cli.json("server", "show", name)
    assert stopped["status"] == "SHUTOFF"
    assert stopped["OS-EXT-STS:power_state"] in (4, "Shutdown")

    cli.run("server", "start", name)
    servers.wait_for_status(server_id, "ACTIVE")
    assert cli.json("server", "show", name, "-c", "status") == {"status": "ACTIVE"}

    cli.run("server", "delete", "--wait", name)
    assert servers.show(server_id, "demo") is None
    assert server_id not in {s["ID"] for s in cli.json("server", "list")}
    # a client polling for changes sees the deletion
    changed = {s["ID"]: s["Status"] for s in cli.json("server", "list", "--changes-since", started)}
    assert changed.get(server_id) == "DELETED"


# openstacksdk warns about its own deprecations on nearly every call.
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")
def test_openstacksdk_boots_stops_starts_and_deletes_a_server(local_stack, servers, monkeypatch):
    import openstack

    monkeypatch.setenv("OS_CLIENT_CONFIG_FILE", str(local_stack.clouds_yaml))
    conn = openstack.connect(cloud=local_stack.cloud("demo"))
    try:
        flavor = conn.compute.find_flavor("ferry.tiny", ignore_missing=False)
        image = conn.image.find_image(local_stack.seeded.image["name"], ignore_missing=False)
        server = conn.compute.create_server(name="e2e-sdk", flavor_id=flavor.id, image_id=image.id, networks="auto")
        servers.created.append(server.id)

        server = conn.compute.wait_for_server(server, status="ACTIVE", interval=0.5, wait=90)
        assert server.flavor.original_name == "ferry.tiny"
        conn.compute.stop_server(server)
        server = conn.compute.wait_for_server(server, status="SHUTOFF", interval=0.5, wait=90)
        assert server.power_state == 4
        conn.compute.start_server(server)
        server = conn.compute.wait_for_server(server, status="ACTIVE", interval=0.5, wait=90)
        assert server.power_state == 1
        conn.compute.delete_server(server)
        conn.compute.wait_for_delete(server, interval=0.5, wait=90)
        assert conn.compute.find_server(server.id) is None
    finally:
        conn.close()


@pytest.fixture
def volume(local_stack, capsys) -> Iterator[dict[str, str]]:
    """A new file-backed volume of the project ``demo``, registered with ``ferry volume`` as an
    operator does; forgotten and its file removed afterwards."""
    name, shared = f"e2e-data-{uuid.uuid4().hex[:8]}", local_stack.state_dir / "volumes"
    shared.mkdir(exist_ok=True)
    assert ferry_cli.main(["volume", "register", "--project", local_stack.seeded.identities["demo"].project_id,
                           "--size-gb", "1", "--new-file-in", str(shared), "--name", name]) == 0
    with api_session() as session:
        volume_id, recorded = session.execute(select(Volume.id, Volume.path).where(Volume.name == name)).one()
    path = shared / volume_id
    assert recorded == str(path) and path.is_file()
    yield {"id": volume_id, "name": name}
    assert ferry_cli.main(["volume", "forget", volume_id]) == 0
    path.unlink()


def test_the_cli_looks_volumes_up_to_attach_detach_and_boot_from_them(cli, servers, local_stack, volume):
    def status() -> str:
        return cli.json("volume", "show", volume["name"], "-c", "status")["status"]

    listed = {v["ID"]: v for v in cli.json("volume", "list")}
    assert (listed[volume["id"]]["Name"], listed[volume["id"]]["Status"]) == (volume["name"], "available")
    server = servers.boot(name="e2e-cli-volume")

    # the CLI finds the volume by name in the Block Storage API, then attaches it through the compute API
    attached = cli.json("server", "add", "volume", server["id"], volume["name"])
    assert attached["Volume ID"] == volume["id"]
    local_stack.wait_for(lambda: status() == "in-use")
    [attachment] = cli.json("volume", "show", volume["name"])["attachments"]
    assert (attachment["server_id"], attachment["device"], attachment["host_name"]) == (
        server["id"], attached["Device"], None)  # hosts are for admins
    admin = OpenStackCli(local_stack.clouds_yaml, local_stack.cloud("admin"), cli.workdir)
    [seen_by_admin] = admin.json("volume", "show", volume["id"])["attachments"]
    assert seen_by_admin["host_name"] == servers.show(server["id"], "admin")["OS-EXT-SRV-ATTR:host"]
    # another project's member does not find it
    other = OpenStackCli(local_stack.clouds_yaml, local_stack.cloud("alt"), cli.workdir)
    assert volume["id"] not in {v["ID"] for v in other.json("volume", "list")}

    cli.run("server", "remove", "volume", server["id"], volume["name"])
    local_stack.wait_for(lambda: status() == "available")

    booted = cli.json("server", "create", "--flavor", "ferry.tiny", "--volume", volume["name"], "--nic", "none",
                      "--wait", "e2e-cli-from-volume")
    servers.created.append(booted["id"])
    assert booted["status"] == "ACTIVE"
    assert [v["id"] for v in cli.json("server", "show", booted["id"])["volumes_attached"]] == [volume["id"]]
    cli.run("server", "delete", "--wait", booted["id"])
    assert status() == "available"


def test_the_cli_keeps_an_anti_affinity_groups_servers_apart(cli, servers, local_stack):
    # GIVEN an anti-affinity group made with the CLI
    name = f"e2e-apart-{uuid.uuid4().hex[:8]}"
    group = cli.json("server", "group", "create", "--policy", "anti-affinity", name)
    assert (group["name"], group["policy"]) == (name, "anti-affinity")
    assert group["id"] in {g["ID"] for g in cli.json("server", "group", "list")}

    # WHEN two servers are booted into it with the group hint, in one request
    cli.json("server", "create", "--flavor", "ferry.tiny", "--image", local_stack.seeded.image["name"],
             "--nic", "none", "--hint", f"group={group['id']}", "--min", "2", "--max", "2", name)
    named = {s["Name"]: s["ID"] for s in cli.json("server", "list", "--name", f"^{name}-")}
    assert sorted(named) == [f"{name}-1", f"{name}-2"]
    booted = [named[f"{name}-1"], named[f"{name}-2"]]
    servers.created.extend(booted)
    for server_id in booted:
        servers.wait_for_status(server_id, "ACTIVE")

    # THEN they run on two hosts, and the group lists both
    shown = [servers.show(server_id) for server_id in booted]
    assert len({server["OS-EXT-SRV-ATTR:host"] for server in shown}) == 2
    assert [server["OS-EXT-SRV-ATTR:launch_index"] for server in shown] == [0, 1]  # kept from the build
    assert sorted(cli.json("server", "group", "show", group["id"])["members"]) == sorted(booted)

    # a deleted server leaves the group; the group goes, its other server stays
    cli.run("server", "delete", "--wait", booted[0])
    assert cli.json("server", "group", "show", group["id"])["members"] == [booted[1]]
    cli.run("server", "group", "delete", group["id"])
    assert group["id"] not in {g["ID"] for g in cli.json("server", "group", "list")}
    assert servers.show(booted[1])["status"] == "ACTIVE"
