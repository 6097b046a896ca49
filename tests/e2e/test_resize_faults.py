"""What the owner sees when the host side of a confirm or a revert fails, or a move's last step.

A fault at every Task state of every workflow is in ``test_fault_sweep.py``; these follow
failures through to what the owner does next: a revert whose destination fails stays in
VERIFY_RESIZE and can be retried; a confirm whose source fails leaves the server confirmed on
its destination, the source's allocation held by the migration, and a delete cleans up all; a
move whose last step failed after it committed stays in VERIFY_RESIZE and can be confirmed; a
move whose destination cannot be cleaned up once its guest was made there leaves the source's
guest shut off and the server in ERROR, so that two guests of it never run at once.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from conftest import AGENT_REPORT_INTERVAL_SECONDS
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
from sqlalchemy import select

from ferry import audit, config, faults, hosts, notifications
from ferry.store.cell_models import Service
from ferry.store.db import cell_session
from ferry.workflows import resize

pytestmark = pytest.mark.e2e


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


def test_a_revert_whose_destination_fails_stays_verify_resize_and_can_be_retried(local_stack, servers, records,
                                                                                 boot, armed):
    server, digest = boot(TINY)
    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    # The destination cannot destroy the new guest (a HypervisorError: nothing there was removed)
    armed("*:revert_resize", faults.ALWAYS, "HypervisorError")

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    again = servers.wait_for_status(server["id"], "VERIFY_RESIZE", timeout=120)
    assert host_of(again) == host_of(resized)
    [migration] = migrations_of(server["id"], local_stack.hosts[host_of(server)])
    assert migration.status == "finished"

    faults.disarm_all()
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


def test_a_move_whose_last_step_failed_after_committing_stands_and_can_be_confirmed(local_stack, servers, records,
                                                                                    boot, monkeypatch):
    # GIVEN MarkResized commits VERIFY_RESIZE and then fails (here: while publishing its notification)
    server, digest = boot(TINY)
    publish = resize._publish

    def commit_then_fail(*pending: dict[str, Any]) -> None:
        if any(item["event_type"] == notifications.RESIZE_FINISH_END for item in pending):
            raise RuntimeError("MarkResized failed after its commit")
        publish(*pending)

    monkeypatch.setattr(resize, "_publish", commit_then_fail)
    sfn = local_stack.client("stepfunctions")

    def ended() -> list[dict[str, Any]]:
        executions = [e for e in sfn.list_executions(stateMachineArn=config.get().resize_state_machine_arn)[
            "executions"] if server["id"] in e["name"]]
        return executions if executions and all(e["status"] != "RUNNING" for e in executions) else []

    # WHEN the server is resized
    assert servers.action(server["id"], {"resize": {"flavorRef": SMALL}}).status_code == 202
    [execution] = local_stack.wait_for(ended, timeout=120)
    monkeypatch.undo()

    # THEN the move stands: VERIFY_RESIZE on the destination, whose guest and disks are there
    assert execution["status"] == "SUCCEEDED"
    resized = servers.show(server["id"])
    dest = host_of(resized)
    assert resized["status"] == "VERIFY_RESIZE" and dest != host_of(server)
    assert root_digest(records.instance_dir(dest, server["id"]) / "disk", FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    assert (local_stack.instances_dir(host_of(server)) / f"{server['id']}_resize").exists()
    # AND the owner can confirm it
    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    confirmed = servers.wait_for_status(server["id"], "ACTIVE", timeout=120)
    assert host_of(confirmed) == dest and confirmed["flavor"]["original_name"] == "ferry.small"
    assert records.allocations(server["id"]) == {records.provider(dest): FLAVORS[SMALL]}


def guests_reported(local_stack, host: str, after: dt.datetime) -> list[str]:
    """The guests ``host``'s agent reported in its first inventory report sent after ``after`` (naive UTC)."""

    def fresh() -> dict[str, Any] | None:
        with cell_session(local_stack.hosts[host]) as session:
            service = session.scalars(select(Service).where(Service.host == host)).one()
            view = hosts.host_view(service)
        return view if view and hosts.report_time(view["sent_at"]) > after else None

    return list(local_stack.wait_for(fresh, timeout=AGENT_REPORT_INTERVAL_SECONDS * 4, interval=1)["guests"])


def test_a_destination_that_cannot_be_cleaned_up_leaves_the_source_guest_off_and_the_server_in_error(
        local_stack, servers, records, boot, armed):
    # GIVEN a resize whose last step fails after finish_resize made the guest on the destination, and whose
    # destination then cannot be cleaned up (every revert_resize there fails, as when its agent is down)
    server, digest = boot(TINY)
    source = host_of(server)
    armed("MarkResized", faults.ALWAYS)
    armed("*:revert_resize", faults.ALWAYS)

    # WHEN the move rolls back
    assert servers.action(server["id"], {"resize": {"flavorRef": SMALL}}).status_code == 202
    failed = servers.wait_for_status(server["id"], "ERROR", timeout=180)

    # THEN the server is in ERROR on its source with its old flavor, its guest there restored but shut off
    [migration] = migrations_of(server["id"], local_stack.hosts[source])
    dest = migration.dest_compute
    assert migration.status == "error" and dest != source
    assert host_of(failed) == source and failed["flavor"]["original_name"] == "ferry.tiny"
    assert failed["OS-EXT-STS:power_state"] == 4
    assert ("finish_revert_resize", "succeeded") in records.host_operations(source, server["id"])
    assert root_digest(records.instance_dir(source, server["id"]) / "disk", FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    assert records.allocations(server["id"]) == {records.provider(source): FLAVORS[TINY]}
    assert port_bindings(server["id"]) == {(source, "ACTIVE")}
    # AND the fault says that a guest of it may still run on the destination, and what to do first
    assert failed["fault"]["message"] == ("Resize failed and the destination host could not be cleaned up: "
                                          "a guest of this server may still run there.")
    assert f"Destroy the guest on {dest} first" in failed["fault"]["details"]
    # AND the destination does hold it, which the audit reports (from a report it trusts to show the rollback)
    settled = dt.datetime.now(dt.UTC).replace(tzinfo=None) + dt.timedelta(seconds=audit.DEFAULT_CLOCK_SKEW_SECONDS + 1)
    assert server["id"] in guests_reported(local_stack, dest, settled)
    found = {(p.kind, p.resource) for p in audit.run_audit(grace_seconds=0).problems}
    assert (audit.GUEST_ORPHAN, f"host/{dest}/guest/{server['id']}") in found

    # WHEN the server is deleted THEN the destination's next report gets its guest and disks destroyed
    faults.disarm_all()
    assert servers.delete(server["id"]).status_code == 204
    servers.wait_until_gone(server["id"])
    local_stack.wait_for(lambda: not records.instance_dir(dest, server["id"]).exists(),
                         timeout=AGENT_REPORT_INTERVAL_SECONDS * 6, interval=1)
    assert server["id"] not in guests_reported(local_stack, dest, dt.datetime.now(dt.UTC).replace(tzinfo=None))
