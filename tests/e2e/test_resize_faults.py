"""A failure injected at any step of a same-cell move leaves the server exactly as it was.

The forward steps are read from the resize state machine itself, so a step added later is
covered without touching this file. Each test arms one fault (``ferry.faults``), moves a
running server, and checks: the server is ACTIVE on its source with its old flavor and the
same root disk bytes, placement holds exactly that flavor there and nothing for the migration,
no host keeps a guest directory or ``<uuid>_resize`` for it, its ports are bound only on the
source, and the migration is in ``error`` with the failed step recorded in the action.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from move_helpers import (
    FLAVORS,
    SMALL,
    TINY,
    GiB,
    boot_with_digest,
    host_of,
    migrations_of,
    port_bindings,
    resize_to_verify,
    root_digest,
)

from ferry import faults

pytestmark = pytest.mark.e2e

ASL = Path(__file__).resolve().parents[2] / "statemachine" / "resize.asl.json"


def _same_cell_route(state: dict[str, Any]) -> str | None:
    """At the Choice that splits same-cell from cross-cell moves, the same-cell route (else None).

    A move between hosts of one cell never enters the cross-cell branch; its states are covered
    by the state-machine tests of cross-cell moves.
    """
    for rule in state.get("Choices", []):
        if rule.get("Variable") == "$.destination.cell" and rule.get("StringEqualsPath") == "$.cell":
            return str(rule["Next"])
    return None


def forward_fault_points() -> list[str]:
    """The fault point of every Task state on a same-cell move's forward path (not reached only by a Catch)."""
    text = re.sub(r"\$\{\w+\}", "0", ASL.read_text())
    machine = json.loads(text)
    states, seen, todo, points = machine["States"], set(), [machine["StartAt"]], []
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        state = states[name]
        if state["Type"] == "Task":
            if state["Resource"].startswith("arn:aws:states:::sqs:"):
                points.append(f"*:{state['Parameters']['MessageBody']['operation']}")
            else:
                points.append(name)
        same_cell = _same_cell_route(state)
        if same_cell is not None:
            todo.append(same_cell)
            continue
        todo += [state[key] for key in ("Next", "Default") if key in state]
        todo += [choice["Next"] for choice in state.get("Choices", [])]
    return points


POINTS = forward_fault_points()


def test_the_forward_path_has_every_step_of_a_move():
    assert POINTS[:2] == ["ValidateMoveInput", "SelectMoveDestinations"]
    assert {"*:prep_resize", "*:resize_instance", "*:finish_resize", "MarkResized"} <= set(POINTS)
    assert "TargetDBSetup" not in POINTS


def assert_as_before(local_stack, servers, records, server: dict[str, Any], digest: str) -> None:
    source = host_of(server)
    after = servers.wait_for_status(server["id"], "ACTIVE", timeout=120)
    assert host_of(after) == source and after["flavor"]["original_name"] == "ferry.tiny"
    assert after["OS-EXT-STS:power_state"] == 1
    assert records.allocations(server["id"]) == {records.provider(source): FLAVORS[TINY]}
    for host in local_stack.hosts:
        assert not (local_stack.instances_dir(host) / f"{server['id']}_resize").exists(), host
        if host != source:
            assert not records.instance_dir(host, server["id"]).exists(), host
    root = records.instance_dir(source, server["id"]) / "disk"
    assert root_digest(root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    assert port_bindings(server["id"]) == {(source, "ACTIVE")}


@pytest.fixture
def boot(servers, local_stack):
    return lambda flavor=TINY, **extra: boot_with_digest(local_stack, servers, flavor, **extra)


@pytest.fixture
def armed():
    yield faults.arm
    faults.disarm_all()


@pytest.mark.parametrize("point", POINTS)
def test_a_failed_step_leaves_the_server_as_it_was(local_stack, servers, records, boot, armed, point):
    server, digest = boot(TINY)
    cell = local_stack.hosts[host_of(server)]
    armed(point, faults.ALWAYS)

    response = servers.action(server["id"], {"resize": {"flavorRef": SMALL}})
    assert response.status_code == 202, response.text
    [migration] = local_stack.wait_for(
        lambda: [m for m in migrations_of(server["id"], cell) if m.status == "error"], timeout=120)

    assert_as_before(local_stack, servers, records, server, digest)
    assert not records.consumer_exists(migration.uuid)
    detail = servers.api("admin").get(f"/servers/{server['id']}/os-instance-actions").json()["instanceActions"]
    [resize_action] = [a for a in detail if a["action"] == "resize"]
    assert resize_action["message"] is not None

    faults.disarm_all()
    resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})  # the server can still move
    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    assert_as_before(local_stack, servers, records, server, digest)


def test_a_revert_whose_destination_fails_stays_verify_resize_and_can_be_retried(local_stack, servers, records,
                                                                                 boot, armed):
    server, digest = boot(TINY)
    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    armed("*:revert_resize")

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    again = servers.wait_for_status(server["id"], "VERIFY_RESIZE", timeout=120)
    assert host_of(again) == host_of(resized)
    [migration] = migrations_of(server["id"], local_stack.hosts[host_of(server)])
    assert migration.status == "finished"

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    assert_as_before(local_stack, servers, records, server, digest)


def test_a_confirm_whose_source_fails_keeps_the_server_and_delete_cleans_up(local_stack, servers, records,
                                                                           boot, armed):
    server, _ = boot(TINY)
    source = host_of(server)
    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    armed("*:confirm_resize")

    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    confirmed = servers.wait_for_status(server["id"], "ACTIVE", timeout=120)
    assert host_of(confirmed) == host_of(resized) and confirmed["flavor"]["original_name"] == "ferry.small"
    [migration] = migrations_of(server["id"], local_stack.hosts[source])
    assert migration.status == "error"
    assert records.allocations(migration.uuid) == {records.provider(source): FLAVORS[TINY]}

    assert servers.delete(server["id"]).status_code == 204
    servers.wait_until_gone(server["id"])
    assert not records.consumer_exists(migration.uuid) and records.allocations(server["id"]) == {}
    for host in (source, host_of(resized)):
        assert not records.instance_dir(host, server["id"]).exists()
        assert not (local_stack.instances_dir(host) / f"{server['id']}_resize").exists()
