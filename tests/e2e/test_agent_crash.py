"""A host agent killed (SIGKILL) in the middle of a long host operation, then started again, finishes the move.

Each test catches one agent in one operation: the agent is first restarted with a short
visibility timeout (so its message comes back seconds after the crash, well inside the task's
heartbeat) and with a disk throttle or an operation delay (so the operation is still running when
its journal shows it started). The test waits for that, kills the agent, and starts it again as
it normally runs. The message becomes visible again, the agent runs the operation again from
what the interrupted attempt left, and the workflow goes on as if nothing happened: the server
reaches VERIFY_RESIZE (or ACTIVE, for a boot) with the bytes its root disk had, confirm or
revert works, and ``ferry audit`` finds nothing.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from move_helpers import (
    CROSS_CELL_RULE,
    FLAVORS,
    SMALL,
    TINY,
    GiB,
    assert_lives_only_on,
    host_of,
    only_hosts_enabled,
    port_bindings,
    root_digest,
)

from ferry import audit, config
from hostagent.agent import OPERATION_DELAY_ENV
from hostagent.disks import THROTTLE_ENV

pytestmark = pytest.mark.e2e

MiB = 2**20
# A drilled agent's messages come back this many seconds after it dies (the tasks' heartbeat is 30 s).
DRILL_VISIBILITY_SECONDS = 4
# Data the "guest" writes to its root disk before a move, so that the disk takes a while to send.
WRITTEN_MIB = 16


class Drill:
    """One agent restarted for a crash drill, killed when caught, and always left running as usual."""

    def __init__(self, local_stack, records) -> None:
        self.local_stack = local_stack
        self.records = records
        self.drilled: set[str] = set()

    def arm(self, host: str, environment: dict[str, str], direct_copies: bool = True) -> None:
        """Restart ``host``'s agent slowed down by ``environment``, with a short visibility timeout
        (and, with ``direct_copies=False``, offering no direct copies: moves to it go through S3)."""
        self.drilled.add(host)
        self.local_stack.stack.restart_agent(host, environment, visibility_timeout=DRILL_VISIBILITY_SECONDS,
                                             direct_copies=direct_copies)

    def catch(self, host: str, server_id: str, operation: str, also: Any = None) -> None:
        """Wait until ``host``'s journal shows ``operation`` of the server started (and ``also()`` holds), then kill."""

        def caught() -> bool:
            started = (operation, "in_progress") in self.records.host_operations(host, server_id)
            return started and (also is None or bool(also()))

        self.local_stack.wait_for(caught, timeout=90, interval=0.05)
        self.local_stack.stack.kill_agent(host)

    def restart(self, host: str) -> None:
        """Start ``host``'s agent again as it normally runs."""
        self.local_stack.stack.restart_agent(host)
        self.drilled.discard(host)

    def disarm(self) -> None:
        for host in sorted(self.drilled):
            self.restart(host)


@pytest.fixture
def drill(local_stack, records) -> Iterator[Drill]:
    running = Drill(local_stack, records)
    try:
        yield running
    finally:
        running.disarm()


def attempts(local_stack, host: str, server_id: str, operation: str) -> list[tuple[str, int]]:
    """``(status, attempts)`` of the server's ``operation`` entries in ``host``'s journal."""
    journal = local_stack.host_state_dir(host) / "journal.sqlite"
    with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as conn:
        return list(conn.execute("SELECT status, attempts FROM operations WHERE instance_uuid = ? AND operation = ? "
                                 "ORDER BY started_at", (server_id, operation)))


def partial_files(*directories: Path) -> list[Path]:
    """The temporary files of disk writes under way in ``directories``."""
    return [found for directory in directories if directory.is_dir() for found in directory.glob(".*.part")]


def sent_directly(local_stack, host: str, server_id: str) -> set[bool]:
    """How ``host``'s agent sent the server's disks (its "disk sent" log records): directly or not."""
    routes = set()
    for line in local_stack.stack.agent_log(host).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("message") == "disk sent" and record.get("instance_uuid") == server_id:
            routes.add(bool(record.get("direct")))
    return routes


def transfers_left(local_stack) -> list[str]:
    listed = local_stack.client("s3").list_objects_v2(Bucket=config.get().image_bucket, Prefix="transfers/")
    return [item["Key"] for item in listed.get("Contents", [])]


def boot_written(local_stack, servers, **extra: Any) -> tuple[dict[str, Any], str]:
    """A TINY server whose root disk holds WRITTEN_MIB of fresh data; returns it and its disk's digest."""
    server = servers.boot(flavor=TINY, **extra)
    root = local_stack.instances_dir(host_of(server)) / server["id"] / "disk"
    with open(root, "r+b") as disk:
        disk.seek(64 * MiB)
        disk.write(os.urandom(WRITTEN_MIB * MiB))
    return server, root_digest(root, FLAVORS[TINY]["DISK_GB"] * GiB)


def other_host_of_cell(local_stack, host: str) -> str:
    [other] = [h for h, c in local_stack.hosts.items() if c == local_stack.hosts[host] and h != host]
    return other


def start_resize(servers, server_id: str, body: dict[str, Any], identity: str = "demo",
                 headers: dict[str, str] | None = None) -> None:
    response = servers.api(identity).post(f"/servers/{server_id}/action", json=body, headers=headers or {})
    assert response.status_code == 202, response.text


def finish_and_check(local_stack, servers, records, server_id: str, finish: str, source: str, dest: str,
                     digest: str) -> None:
    """From VERIFY_RESIZE on ``dest``: confirm or revert, then the server lives only where it should, unchanged."""
    assert servers.action(server_id, {finish: None}).status_code in (202, 204)
    done = servers.wait_for_status(server_id, "ACTIVE", timeout=120)
    host, flavor = (dest, SMALL) if finish == "confirmResize" else (source, TINY)
    assert host_of(done) == host and done["OS-EXT-STS:power_state"] == 1
    assert_lives_only_on(local_stack, records, server_id, host, flavor)
    assert port_bindings(server_id) == {(host, "ACTIVE")}
    assert root_digest(records.instance_dir(host, server_id) / "disk", FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    audit.assert_consistent(grace_seconds=0)


# --- same cell: the destination's claim and finish, the source's disk copy ----------------------------


@pytest.mark.parametrize(("operation", "at", "finish", "route"), [
    ("prep_resize", "dest", "revertResize", "direct"),
    ("resize_instance", "source", "confirmResize", "direct"),
    ("resize_instance", "source", "confirmResize", "s3"),
    ("finish_resize", "dest", "confirmResize", "s3"),
])
def test_an_agent_killed_during_a_move_operation_finishes_it_after_restart(local_stack, servers, records, drill,
                                                                            operation, at, finish, route):
    """``route``: the disks are copied straight into the destination's directory (every host of the
    local stack sees the others'), or go through S3 (the destination offers no direct copy)."""
    server, digest = boot_written(local_stack, servers)
    source = host_of(server)
    dest = other_host_of_cell(local_stack, source)
    victim = source if at == "source" else dest
    if route == "s3" and victim != dest:
        drill.arm(dest, {}, direct_copies=False)
    if operation == "prep_resize":
        drill.arm(victim, {OPERATION_DELAY_ENV: "prep_resize=60"})
        mid_way = None
    else:
        drill.arm(victim, {THROTTLE_ENV: "4"}, direct_copies=route == "direct")
        if at == "dest":  # writing the disk it receives
            mid_way = lambda: partial_files(records.instance_dir(dest, server["id"]))  # noqa: E731
        else:  # sending the disk: the guest is off and undefined, its directory set aside, a part written
            incoming = local_stack.instances_dir(dest) / f"{server['id']}_incoming"
            mid_way = lambda: (  # noqa: E731
                (local_stack.instances_dir(source) / f"{server['id']}_resize").is_dir()
                and (route == "s3" or bool(partial_files(incoming))))

    start_resize(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    drill.catch(victim, server["id"], operation, mid_way)
    drill.restart(victim)

    resized = servers.wait_for_status(server["id"], "VERIFY_RESIZE", timeout=120)
    assert host_of(resized) == dest and resized["flavor"]["original_name"] == "ferry.small"
    assert resized["OS-EXT-STS:power_state"] == 1
    dest_root = records.instance_dir(dest, server["id"]) / "disk"
    assert dest_root.stat().st_size == FLAVORS[SMALL]["DISK_GB"] * GiB
    assert root_digest(dest_root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    assert attempts(local_stack, victim, server["id"], operation) == [("succeeded", 2)]
    assert not partial_files(records.instance_dir(dest, server["id"]))
    assert not (local_stack.instances_dir(dest) / f"{server['id']}_incoming").exists()
    assert transfers_left(local_stack) == []
    assert sent_directly(local_stack, source, server["id"]) == {route == "direct"}

    finish_and_check(local_stack, servers, records, server["id"], finish, source, dest, digest)


# --- boot ----------------------------------------------------------------------------------------------


def test_an_agent_killed_while_spawning_a_server_finishes_the_boot_after_restart(local_stack, servers, records,
                                                                                  drill):
    host = sorted(local_stack.hosts)[0]
    drill.arm(host, {THROTTLE_ENV: "1"})
    with only_hosts_enabled(local_stack, {host}):
        response = servers.create({"server": {"name": "crash-boot", "flavorRef": TINY, "networks": "auto",
                                              "imageRef": local_stack.seeded.image["id"]}})
        assert response.status_code == 202, response.text
        server_id = response.json()["server"]["id"]
        instance_dir = records.instance_dir(host, server_id)
        drill.catch(host, server_id, "spawn",
                    lambda: partial_files(instance_dir, local_stack.instances_dir(host) / "_base"))
        drill.restart(host)
        server = servers.wait_for_status(server_id, "ACTIVE", timeout=120)

    assert host_of(server) == host and server["OS-EXT-STS:power_state"] == 1
    assert attempts(local_stack, host, server_id, "spawn") == [("succeeded", 2)]
    image = local_stack.seeded.image
    assert root_digest(instance_dir / "disk", Path(image["path"]).stat().st_size, "sha256") == image["sha256"]
    assert not partial_files(instance_dir, local_stack.instances_dir(host) / "_base")
    assert records.allocations(server_id) == {records.provider(host): FLAVORS[TINY]}
    assert port_bindings(server_id) == {(host, "ACTIVE")}
    audit.assert_consistent(grace_seconds=0)


# --- between cells: the snapshot's upload at the source, its download by the destination's spawn --------


@pytest.mark.parametrize(("operation", "at", "finish"), [
    ("prep_snapshot_based_resize_at_source", "source", "confirmResize"),
    ("spawn", "dest", "revertResize"),
])
def test_an_agent_killed_during_a_move_between_cells_finishes_it_after_restart(local_stack, servers, records, drill,
                                                                                operation, at, finish):
    server, digest = boot_written(local_stack, servers)
    source = host_of(server)
    dest = sorted(h for h, c in local_stack.hosts.items() if c != local_stack.hosts[source])[0]
    victim = source if at == "source" else dest
    drill.arm(victim, {THROTTLE_ENV: "4"})
    if at == "dest":
        mid_way = lambda: partial_files(records.instance_dir(dest, server["id"]),  # noqa: E731
                                        local_stack.instances_dir(dest) / "_base")
    else:
        mid_way = lambda: (local_stack.instances_dir(source) / f"{server['id']}_resize").is_dir()  # noqa: E731

    with local_stack.override_policy({CROSS_CELL_RULE: "admin_or_owner"}):
        start_resize(servers, server["id"], {"migrate": {"host": dest}}, "admin",
                     headers={"OpenStack-API-Version": "compute 2.56"})
        drill.catch(victim, server["id"], operation, mid_way)
        drill.restart(victim)
        resized = servers.wait_for_status(server["id"], "VERIFY_RESIZE", timeout=120)
        assert host_of(resized) == dest and resized["OS-EXT-STS:power_state"] == 1
        dest_root = records.instance_dir(dest, server["id"]) / "disk"
        assert root_digest(dest_root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
        assert attempts(local_stack, victim, server["id"], operation)[-1] == ("succeeded", 2)

        assert servers.action(server["id"], {finish: None}).status_code in (202, 204)
        done = servers.wait_for_status(server["id"], "ACTIVE", timeout=120)

    host = dest if finish == "confirmResize" else source
    assert host_of(done) == host and done["OS-EXT-STS:power_state"] == 1
    assert_lives_only_on(local_stack, records, server["id"], host, TINY)
    assert port_bindings(server["id"]) == {(host, "ACTIVE")}
    assert root_digest(records.instance_dir(host, server["id"]) / "disk", FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    images = servers.api("admin").get("/images").json()["images"]
    assert not [i for i in images if i["name"].endswith("-resize-temp")]
    audit.assert_consistent(grace_seconds=0)
