"""Same-cell resize, cold migrate, confirm and revert driven by the real clients: openstacksdk and the CLI.

Each client works only from the stack's clouds.yaml, as an operator's would. After every step the
test reads back what the client shows (status, flavor, host for admins, the migrations it lists)
and what Ferry holds behind it: the server's placement allocation is exactly its flavor on the
host it lives on, and no other host keeps its disks or a ``<uuid>_resize`` directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from move_helpers import FLAVORS, MEDIUM, SMALL, TINY, assert_lives_only_on, cell_of, host_of
from sqlalchemy import select

from ferry.store.api_models import Flavor
from ferry.store.db import api_session

# openstacksdk warns about its own deprecations on nearly every call.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning"),
]

OPENSTACK = Path(sys.executable).with_name("openstack")
CLI_TIMEOUT_SECONDS = 180
MOVE_TIMEOUT_SECONDS = 120
FLAVOR_NAMES = {TINY: "ferry.tiny", SMALL: "ferry.small", MEDIUM: "ferry.medium"}


def flavor_db_id(flavorid: str) -> int:
    """The flavor's row id, which migrations carry as ``old_instance_type_id``/``new_instance_type_id``."""
    with api_session() as session:
        return session.scalars(select(Flavor.id).where(Flavor.flavorid == flavorid)).one()


def other_host_in_cell(local_stack, host: str) -> str:
    [other] = [h for h, cell in local_stack.hosts.items() if cell == cell_of(local_stack, host) and h != host]
    return other


# --- openstacksdk -----------------------------------------------------------------------------------


@pytest.fixture
def sdk(local_stack, monkeypatch) -> Iterator[Callable[[str], Any]]:
    """``sdk(identity)``: an openstacksdk connection to the cloud ``ferry-<identity>``, closed after the test."""
    import openstack

    monkeypatch.setenv("OS_CLIENT_CONFIG_FILE", str(local_stack.clouds_yaml))
    connections: dict[str, Any] = {}

    def connect(identity: str) -> Any:
        if identity not in connections:
            connections[identity] = openstack.connect(cloud=local_stack.cloud(identity))
        return connections[identity]

    try:
        yield connect
    finally:
        for connection in connections.values():
            connection.close()


def sdk_wait(conn: Any, server_id: str, status: str) -> Any:
    """Wait through openstacksdk until the server shows ``status``; ERROR fails at once."""
    server = conn.compute.get_server(server_id)
    return conn.compute.wait_for_server(server, status=status, failures=["ERROR"], interval=0.5,
                                       wait=MOVE_TIMEOUT_SECONDS)


def assert_sdk_shows(server: Any, status: str, flavor: str) -> None:
    assert server.status == status
    assert server.task_state is None
    assert server.vm_state == ("resized" if status == "VERIFY_RESIZE" else "active")
    assert server.power_state == 1
    assert server.flavor.original_name == FLAVOR_NAMES[flavor]
    assert (server.flavor.vcpus, server.flavor.ram, server.flavor.disk) == (
        FLAVORS[flavor]["VCPU"], FLAVORS[flavor]["MEMORY_MB"], FLAVORS[flavor]["DISK_GB"])


def test_openstacksdk_resizes_confirms_reverts_and_migrates_a_server(local_stack, servers, records, sdk):
    demo, admin = sdk("demo"), sdk("admin")
    created = demo.compute.create_server(name=f"e2e-sdk-move-{uuid.uuid4().hex[:8]}", flavor_id=TINY,
                                         image_id=local_stack.seeded.image["id"], networks="auto")
    servers.created.append(created.id)
    server_id = created.id
    sdk_wait(demo, server_id, "ACTIVE")
    first_host = admin.compute.get_server(server_id).compute_host
    second_host = other_host_in_cell(local_stack, first_host)

    # GIVEN an ACTIVE tiny server, WHEN its owner resizes it to small and confirms
    demo.compute.resize_server(server_id, SMALL)
    resized = sdk_wait(demo, server_id, "VERIFY_RESIZE")
    assert_sdk_shows(resized, "VERIFY_RESIZE", SMALL)
    assert admin.compute.get_server(server_id).compute_host == second_host
    assert records.allocations(server_id) == {records.provider(second_host): FLAVORS[SMALL]}

    demo.compute.confirm_server_resize(server_id)
    confirmed = sdk_wait(demo, server_id, "ACTIVE")
    # THEN it runs with the new flavor on the destination, and only there
    assert_sdk_shows(confirmed, "ACTIVE", SMALL)
    assert admin.compute.get_server(server_id).compute_host == second_host
    assert_lives_only_on(local_stack, records, server_id, second_host, SMALL)

    # WHEN it is resized again (to medium) and the owner reverts
    demo.compute.resize_server(server_id, MEDIUM)
    assert_sdk_shows(sdk_wait(demo, server_id, "VERIFY_RESIZE"), "VERIFY_RESIZE", MEDIUM)
    assert admin.compute.get_server(server_id).compute_host == first_host
    assert records.allocations(server_id) == {records.provider(first_host): FLAVORS[MEDIUM]}

    demo.compute.revert_server_resize(server_id)
    reverted = sdk_wait(demo, server_id, "ACTIVE")
    # THEN it is back with the old flavor on the host it was resized from
    assert_sdk_shows(reverted, "ACTIVE", SMALL)
    assert admin.compute.get_server(server_id).compute_host == second_host
    assert_lives_only_on(local_stack, records, server_id, second_host, SMALL)

    # WHEN an admin cold-migrates it and reverts
    admin.compute.migrate_server(server_id)
    migrated = sdk_wait(admin, server_id, "VERIFY_RESIZE")
    assert_sdk_shows(migrated, "VERIFY_RESIZE", SMALL)
    assert migrated.compute_host == first_host
    assert records.allocations(server_id) == {records.provider(first_host): FLAVORS[SMALL]}

    admin.compute.revert_server_resize(server_id)
    back = sdk_wait(admin, server_id, "ACTIVE")
    # THEN it is on the source again, same flavor
    assert_sdk_shows(back, "ACTIVE", SMALL)
    assert back.compute_host == second_host
    assert_lives_only_on(local_stack, records, server_id, second_host, SMALL)

    # os-migrations, as the SDK lists it: newest first, each with its final status
    listed = list(admin.compute.migrations(server_id=server_id))
    assert [(m.migration_type, m.status) for m in listed] == [
        ("migration", "reverted"), ("resize", "reverted"), ("resize", "confirmed")]
    assert [(m.source_compute, m.dest_compute) for m in listed] == [
        (second_host, first_host), (second_host, first_host), (first_host, second_host)]
    assert [(m.old_flavor_id, m.new_flavor_id) for m in listed] == [
        (flavor_db_id(SMALL), flavor_db_id(SMALL)), (flavor_db_id(SMALL), flavor_db_id(MEDIUM)),
        (flavor_db_id(TINY), flavor_db_id(SMALL))]
    assert all(m.server_id == server_id for m in listed)
    # Nova's shape: the integer ``id`` stays the SDK object's id; ``uuid`` (2.59) is there besides it.
    assert [m.id for m in listed] == sorted((m.id for m in listed), reverse=True)
    assert len({str(uuid.UUID(m.uuid)) for m in listed}) == 3
    identities = local_stack.seeded.identities
    assert [(m.user_id, m.project_id) for m in listed] == [
        (identities["admin"].user_id, identities["admin"].project_id),
        (identities["demo"].user_id, identities["demo"].project_id),
        (identities["demo"].user_id, identities["demo"].project_id)]
    assert [m.status for m in admin.compute.migrations(server_id=server_id, migration_type="migration")] == [
        "reverted"]
    assert [m.migration_type for m in admin.compute.migrations(server_id=server_id, status="confirmed")] == [
        "resize"]


# --- the openstack CLI ------------------------------------------------------------------------------


class Cli:
    """``openstack --os-cloud ferry-<identity> ...`` with the stack's clouds.yaml as the only configuration."""

    def __init__(self, clouds_yaml: Path, workdir: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OS_")}
        # No user-wide clouds.yaml or cache may leak in.
        self.env.update(OS_CLIENT_CONFIG_FILE=str(clouds_yaml), HOME=str(workdir), XDG_CONFIG_HOME=str(workdir))

    def run(self, identity: str, *args: str) -> str:
        """Run the command and return its standard output; a non-zero exit fails the test with what it printed."""
        command = [str(OPENSTACK), "--os-cloud", f"ferry-{identity}", *args]
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=CLI_TIMEOUT_SECONDS,
                                stdin=subprocess.DEVNULL)
        assert result.returncode == 0, (f"openstack {' '.join(command[3:])} exited {result.returncode}:\n"
                                        f"{result.stdout}\n{result.stderr}")
        return result.stdout

    def json(self, identity: str, *args: str) -> Any:
        return json.loads(self.run(identity, *args, "-f", "json"))

    def show(self, identity: str, server: str) -> dict[str, Any]:
        return self.json(identity, "server", "show", server)


@pytest.fixture
def cli(local_stack, tmp_path) -> Cli:
    if not OPENSTACK.exists():
        pytest.fail(f"{OPENSTACK} is missing: python-openstackclient belongs in the dev dependencies")
    return Cli(local_stack.clouds_yaml, tmp_path)


def assert_cli_shows(shown: dict[str, Any], status: str, flavor: str, host: str | None = None) -> None:
    assert shown["status"] == status
    assert shown["OS-EXT-STS:task_state"] is None
    assert shown["OS-EXT-STS:vm_state"] == ("resized" if status == "VERIFY_RESIZE" else "active")
    assert shown["flavor"]["original_name"] == FLAVOR_NAMES[flavor]
    assert (shown["flavor"]["vcpus"], shown["flavor"]["ram"], shown["flavor"]["disk"]) == (
        FLAVORS[flavor]["VCPU"], FLAVORS[flavor]["MEMORY_MB"], FLAVORS[flavor]["DISK_GB"])
    if host is not None:
        assert shown["OS-EXT-SRV-ATTR:host"] == host


def test_the_openstack_cli_resizes_confirms_reverts_and_migrates_a_server(local_stack, servers, records, cli):
    name = f"e2e-cli-move-{uuid.uuid4().hex[:8]}"
    server_id = servers.boot(flavor=TINY, name=name)["id"]
    first_host = host_of(servers.show(server_id))
    second_host = other_host_in_cell(local_stack, first_host)

    # resize by flavor name, waiting in the CLI; the owner names the server by its name
    output = cli.run("demo", "server", "resize", "--flavor", "ferry.small", "--wait", name)
    assert "Complete" in output
    assert_cli_shows(cli.show("demo", name), "VERIFY_RESIZE", SMALL)
    assert_cli_shows(cli.show("admin", server_id), "VERIFY_RESIZE", SMALL, host=second_host)
    assert records.allocations(server_id) == {records.provider(second_host): FLAVORS[SMALL]}

    cli.run("demo", "server", "resize", "confirm", name)
    servers.wait_for_status(server_id, "ACTIVE")
    assert_cli_shows(cli.show("demo", name), "ACTIVE", SMALL)
    assert_cli_shows(cli.show("admin", server_id), "ACTIVE", SMALL, host=second_host)
    assert_lives_only_on(local_stack, records, server_id, second_host, SMALL)

    # resize by flavor id, without waiting in the CLI, then revert
    cli.run("demo", "server", "resize", "--flavor", MEDIUM, name)
    servers.wait_for_status(server_id, "VERIFY_RESIZE", timeout=MOVE_TIMEOUT_SECONDS)
    assert_cli_shows(cli.show("admin", server_id), "VERIFY_RESIZE", MEDIUM, host=first_host)
    assert records.allocations(server_id) == {records.provider(first_host): FLAVORS[MEDIUM]}

    cli.run("demo", "server", "resize", "revert", name)
    servers.wait_for_status(server_id, "ACTIVE")
    assert_cli_shows(cli.show("demo", name), "ACTIVE", SMALL)
    assert_cli_shows(cli.show("admin", server_id), "ACTIVE", SMALL, host=second_host)
    assert_lives_only_on(local_stack, records, server_id, second_host, SMALL)

    # cold migrate, the scheduler's choice, waiting in the CLI; then revert (the admin names the server by id:
    # a name only finds servers of the caller's own project)
    output = cli.run("admin", "server", "migrate", "--wait", server_id)
    assert "Complete" in output
    assert_cli_shows(cli.show("admin", server_id), "VERIFY_RESIZE", SMALL, host=first_host)
    assert records.allocations(server_id) == {records.provider(first_host): FLAVORS[SMALL]}

    cli.run("admin", "server", "resize", "revert", server_id)
    servers.wait_for_status(server_id, "ACTIVE")
    assert_cli_shows(cli.show("admin", server_id), "ACTIVE", SMALL, host=second_host)
    assert_lives_only_on(local_stack, records, server_id, second_host, SMALL)

    # cold migrate to a named host (2.56), then the owner confirms
    cli.run("admin", "--os-compute-api-version", "2.56", "server", "migrate", "--host", first_host, server_id)
    servers.wait_for_status(server_id, "VERIFY_RESIZE", timeout=MOVE_TIMEOUT_SECONDS)
    assert_cli_shows(cli.show("admin", server_id), "VERIFY_RESIZE", SMALL, host=first_host)
    assert records.allocations(server_id) == {records.provider(first_host): FLAVORS[SMALL]}

    cli.run("demo", "server", "resize", "confirm", name)
    servers.wait_for_status(server_id, "ACTIVE")
    assert_cli_shows(cli.show("admin", server_id), "ACTIVE", SMALL, host=first_host)
    assert_lives_only_on(local_stack, records, server_id, first_host, SMALL)

    # the moves as `server migration list` prints them (the CLI asks for 2.80: Id, UUID and Type columns)
    listed = cli.json("admin", "server", "migration", "list", "--server", server_id)
    assert list(listed[0]) == ["Id", "UUID", "Source Node", "Dest Node", "Source Compute", "Dest Compute",
                               "Dest Host", "Status", "Server UUID", "Old Flavor", "New Flavor", "Type",
                               "Created At", "Updated At"]
    small, medium, tiny = flavor_db_id(SMALL), flavor_db_id(MEDIUM), flavor_db_id(TINY)
    assert [(m["Type"], m["Status"], m["Source Compute"], m["Dest Compute"], m["Dest Host"], m["Old Flavor"],
             m["New Flavor"]) for m in listed] == [
        ("migration", "confirmed", second_host, first_host, first_host, small, small),
        ("migration", "reverted", second_host, first_host, first_host, small, small),
        ("resize", "reverted", second_host, first_host, first_host, small, medium),
        ("resize", "confirmed", first_host, second_host, second_host, tiny, small),
    ]
    assert all(m["Server UUID"] == server_id and m["Source Node"] == m["Source Compute"]
               and m["Dest Node"] == m["Dest Compute"] for m in listed)
    assert len({m["UUID"] for m in listed}) == 4 and [m["Id"] for m in listed] == sorted(
        (m["Id"] for m in listed), reverse=True)

    # filters the CLI turns into query parameters (--type cold-migration is migration_type=migration)
    reverted_migrations = cli.json("admin", "server", "migration", "list", "--server", server_id,
                                   "--type", "cold-migration", "--status", "reverted")
    assert [(m["Type"], m["Status"]) for m in reverted_migrations] == [("migration", "reverted")]
    on_host = cli.json("admin", "server", "migration", "list", "--host", second_host, "--type", "resize")
    assert {(m["Server UUID"], m["Status"]) for m in on_host if m["Server UUID"] == server_id} == {
        (server_id, "reverted"), (server_id, "confirmed")}

    # at 2.1 the CLI prints no Id, UUID or Type, and the API lists oldest first
    oldest_first = cli.json("admin", "--os-compute-api-version", "2.1", "server", "migration", "list",
                            "--server", server_id)
    assert "Type" not in oldest_first[0] and "UUID" not in oldest_first[0]
    assert [m["Status"] for m in oldest_first] == ["confirmed", "reverted", "reverted", "confirmed"]
