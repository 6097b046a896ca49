"""The real clients against the local stack: the ``openstack`` CLI and openstacksdk, configured by its clouds.yaml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

OPENSTACK = Path(sys.executable).with_name("openstack")
CLI_TIMEOUT_SECONDS = 120


class OpenStackCli:
    """Runs ``openstack --os-cloud <cloud> ...`` with only the stack's clouds.yaml for configuration."""

    def __init__(self, clouds_yaml: Path, cloud: str, workdir: Path) -> None:
        self.cloud = cloud
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
