"""At-least-once delivery: every host message delivered twice, every Lambda step run twice, and the same end.

SQS delivers a message more than once now and then, and Step Functions retries a Lambda step
whose answer was lost. The local stack can do both on purpose (``ferry.local.runtime``):
``FERRY_LOCAL_DUPLICATE_DELIVERY`` puts every host operation message on its queue twice,
``FERRY_LOCAL_INVOKE_TWICE`` runs every Lambda step's handler twice with the same event. Under
each, one server goes through a boot, a resize confirmed, a resize reverted, a resize to the
other cell confirmed and a delete, and every outcome is what the same workflows give undisturbed:
the host, the flavor and the root disk's bytes after each, placement, port bindings, migration
records, nothing left on any host, and ``ferry audit`` clean. The switches are read on every
call, set for one test and always unset after it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing

import pytest
from move_helpers import (
    CROSS_CELL_RULE,
    FLAVORS,
    MEDIUM,
    SMALL,
    TINY,
    GiB,
    assert_lives_only_on,
    boot_with_digest,
    generation_flavors,
    host_of,
    migrations_of,
    port_bindings,
    resize_to_verify,
    root_digest,
)

from ferry import audit, config, protocol
from ferry.local.runtime import DUPLICATE_DELIVERY_ENV, INVOKE_TWICE_ENV

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def generation_flavor(local_stack) -> Iterator[dict[str, str]]:
    """``{cell: flavor id}``: a flavor of the small size that only that cell's hosts offer."""
    with generation_flavors(local_stack) as flavors:
        yield flavors


def journal_attempts(local_stack, server_id: str) -> dict[str, list[tuple[str, str, int]]]:
    """``{host: [(operation, status, attempts)]}`` of the server's operations in every host's journal."""
    found = {}
    for host in local_stack.hosts:
        journal = local_stack.host_state_dir(host) / "journal.sqlite"
        with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as conn:
            rows = conn.execute("SELECT operation, status, attempts FROM operations WHERE instance_uuid = ? "
                                "ORDER BY started_at", (server_id,)).fetchall()
        if rows:
            found[host] = [tuple(row) for row in rows]
    return found


def queued(local_stack) -> dict[str, int]:
    """Messages still on each host's queue and dead-letter queue (visible or in flight)."""
    sqs = local_stack.client("sqs")
    counts = {}
    for host in local_stack.hosts:
        name = protocol.host_queue_name(config.get().host_queue_prefix, host)
        for queue in (name, f"{name}-dlq"):
            url = sqs.get_queue_url(QueueName=queue)["QueueUrl"]
            attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=[
                "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
            counts[queue] = sum(int(value) for value in attributes.values())
    return counts


def other_cell(local_stack, cell: str) -> str:
    [other] = sorted(set(local_stack.hosts.values()) - {cell})
    return other


def assert_digest(records, host: str, server_id: str, digest: str) -> None:
    root = records.instance_dir(host, server_id) / "disk"
    assert root_digest(root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest


def run_the_workflows(local_stack, servers, records, generation_flavor) -> str:
    """Boot, resize + confirm, resize + revert, resize to the other cell + confirm, delete; check each end.

    Returns the server's id.
    """
    server, digest = boot_with_digest(local_stack, servers, TINY)
    server_id, source = server["id"], host_of(server)
    cell = local_stack.hosts[source]
    assert server["OS-EXT-STS:power_state"] == 1
    assert_lives_only_on(local_stack, records, server_id, source, TINY)
    assert port_bindings(server_id) == {(source, "ACTIVE")}

    resized = resize_to_verify(servers, server_id, {"resize": {"flavorRef": SMALL}})
    dest = host_of(resized)
    assert local_stack.hosts[dest] == cell and dest != source
    assert servers.action(server_id, {"confirmResize": None}).status_code == 204
    confirmed = servers.wait_for_status(server_id, "ACTIVE")
    assert host_of(confirmed) == dest and confirmed["flavor"]["original_name"] == "ferry.small"
    assert confirmed["OS-EXT-STS:power_state"] == 1
    assert_lives_only_on(local_stack, records, server_id, dest, SMALL)
    assert port_bindings(server_id) == {(dest, "ACTIVE")}
    assert_digest(records, dest, server_id, digest)

    resize_to_verify(servers, server_id, {"resize": {"flavorRef": MEDIUM}})
    assert servers.action(server_id, {"revertResize": None}).status_code == 202
    reverted = servers.wait_for_status(server_id, "ACTIVE")
    assert host_of(reverted) == dest and reverted["flavor"]["original_name"] == "ferry.small"
    assert reverted["OS-EXT-STS:power_state"] == 1
    assert_lives_only_on(local_stack, records, server_id, dest, SMALL)
    assert port_bindings(server_id) == {(dest, "ACTIVE")}
    assert_digest(records, dest, server_id, digest)
    assert [m.status for m in migrations_of(server_id, cell)] == ["confirmed", "reverted"]

    target_cell = other_cell(local_stack, cell)
    with local_stack.override_policy({CROSS_CELL_RULE: "admin_or_owner"}):
        moved = resize_to_verify(servers, server_id, {"resize": {"flavorRef": generation_flavor[target_cell]}})
        assert local_stack.hosts[host_of(moved)] == target_cell
        assert servers.action(server_id, {"confirmResize": None}).status_code == 204
        across = servers.wait_for_status(server_id, "ACTIVE")
    there = host_of(across)
    assert there == host_of(moved) and across["flavor"]["original_name"] == f"e2e.small.{target_cell}"
    assert across["OS-EXT-STS:power_state"] == 1
    assert_lives_only_on(local_stack, records, server_id, there, SMALL)
    assert port_bindings(server_id) == {(there, "ACTIVE")}
    assert_digest(records, there, server_id, digest)
    assert [m.status for m in migrations_of(server_id, target_cell) if m.cross_cell_move] == ["confirmed"]
    images = servers.api("admin").get("/images").json()["images"]
    assert not [i for i in images if i["name"].endswith("-resize-temp")]

    ports = records.ports(server_id)
    assert servers.delete(server_id).status_code == 204
    servers.wait_until_gone(server_id)
    assert records.allocations(server_id) == {}
    assert not any(records.port_exists(port) for port in ports)
    for host in local_stack.hosts:
        assert not records.instance_dir(host, server_id).exists(), host
        assert not (local_stack.instances_dir(host) / f"{server_id}_resize").exists(), host
    audit.assert_consistent(grace_seconds=0)
    return server_id


def test_every_host_message_delivered_twice_ends_as_an_undisturbed_run(local_stack, servers, records,
                                                                      generation_flavor, monkeypatch):
    monkeypatch.setenv(DUPLICATE_DELIVERY_ENV, "1")

    server_id = run_the_workflows(local_stack, servers, records, generation_flavor)

    # Each copy after the first was answered from the journal: no operation ran twice.
    operations = journal_attempts(local_stack, server_id)
    assert operations and all(attempts == 1 for done in operations.values() for _, _, attempts in done), operations
    assert all(status == "succeeded" for done in operations.values() for _, status, _ in done), operations
    # ... and deleted: nothing waits on a queue, nothing was dead-lettered.
    local_stack.wait_for(lambda: not any(queued(local_stack).values()), timeout=30)


def test_every_lambda_step_run_twice_ends_as_an_undisturbed_run(local_stack, servers, records, generation_flavor,
                                                               monkeypatch):
    monkeypatch.setenv(INVOKE_TWICE_ENV, "1")

    server_id = run_the_workflows(local_stack, servers, records, generation_flavor)

    operations = journal_attempts(local_stack, server_id)
    assert all(status == "succeeded" for done in operations.values() for _, status, _ in done), operations
