"""The resize state machine from template.yaml moving a server to another cell, on moto's Step Functions executor.

The same deployment and protocol-checked stand-in agent as ``test_resize_workflow``; the stand-in
also answers ``prep_snapshot_based_resize_at_source`` (it writes the snapshot object to the image
bucket, as the source host does) and ``spawn``, and fails a host operation a fault is armed for
(``<host>:<operation>``), as the agent does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select
from test_cross_cell_steps import TARGET_HOST, allow_cross_cell, images_left, rows
from test_resize_steps import BIG, SOURCE, make_server, prepare_move, snapshot
from test_resize_workflow import Cloud, HostStandIn, running_cloud

from ferry import errors, faults, placement, protocol
from ferry.compute import instances, states
from ferry.local import runtime
from ferry.store.cell_models import Instance
from ferry.store.db import cell_session

ROOT_DISK = b"root disk of the source guest"
OTHER_TARGET_HOST = "cell2-host2"
# More memory than any cell1 host has: only the cell2 hosts fit.
HUGE = {**BIG, "flavorid": "8", "name": "ferry.huge", "memory_mb": 12288}


class CrossCellHostStandIn(HostStandIn):
    """The stand-in agent, with the source's snapshot and the destination's spawn of a cross-cell move."""

    def __init__(self, aws: runtime.LocalAws, queue_urls: dict[str, str]) -> None:
        super().__init__(aws, queue_urls)
        self.s3 = aws.client("s3")

    def _answer(self, host: str, body: dict[str, Any]) -> None:
        try:
            faults.check(*faults.host_points(host, body["operation"]))
        except errors.FerryError as exc:
            self.received.append((host, body["operation"]))
            self.sfn.send_task_failure(taskToken=body["task_token"], error=type(exc).__name__, cause=str(exc))
            return
        super()._answer(host, body)

    def result(self, host: str, body: dict[str, Any]) -> dict[str, Any]:
        operation, args = body["operation"], body["args"]
        if operation == protocol.PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE:
            with cell_session("cell1") as session:
                running = session.scalars(select(Instance.power_state).where(
                    Instance.uuid == body["instance_uuid"])).one() == states.RUNNING
            snapshot_written = None
            if args["snapshot"] is not None:
                snap, digest = args["snapshot"], hashlib.sha256(ROOT_DISK).hexdigest()
                self.s3.put_object(Bucket=snap["bucket"], Key=snap["key"], Body=ROOT_DISK,
                                   Metadata={"image-id": snap["image_id"], "sha256": digest})
                snapshot_written = {"image_id": snap["image_id"], "sha256": digest, "size": len(ROOT_DISK)}
            return {"instance_uuid": body["instance_uuid"], "host": host, "node": host,
                    "power_state": states.SHUTDOWN, "was_running": running, "snapshot": snapshot_written}
        if operation == protocol.SPAWN:
            return {"instance_uuid": body["instance_uuid"], "host": host, "node": host,
                    "power_state": states.RUNNING if args["power_on"] else states.SHUTDOWN}
        return super().result(host, body)


@pytest.fixture
def cloud(sqlite_store, tmp_path, monkeypatch) -> Iterator[Cloud]:
    with running_cloud(sqlite_store, tmp_path, monkeypatch, stand_in=CrossCellHostStandIn,
                       more_hosts={TARGET_HOST: ("cell2", 16384), OTHER_TARGET_HOST: ("cell2", 16384)}) as started:
        yield started


def server_that_may_cross_cells() -> str:
    """An image-backed server in cell1 whose request spec allows a move to another cell."""
    uuid = make_server()
    allow_cross_cell(uuid)
    return uuid


def to_target_host(uuid: str) -> dict[str, Any]:
    """The API's preparation of a resize to BIG on the cell2 host."""
    return prepare_move(uuid, BIG, requested_host=TARGET_HOST)


CROSS_CELL_STATES = ["TargetDBSetup", "PrepCrossCellAtDest", "PrepCrossCellOnDestHost", "PrepResizeAtSource",
                     "PrepSnapshotResizeOnSourceHost", "FinishCrossCellAtDest", "SpawnOnDestHost",
                     "CompleteMoveAcrossCells"]


def test_a_move_across_cells_reaches_verify_resize_with_the_mapping_in_the_target_cell(cloud):
    uuid = server_that_may_cross_cells()
    inp = to_target_host(uuid)

    described = cloud.move(inp)

    assert described["status"] == "SUCCEEDED", described
    assert cloud.states_entered(described["executionArn"]) == [
        "ValidateMoveInput", "SelectMoveDestinations", "IsMoveAcrossCells", *CROSS_CELL_STATES, "Resized"]
    assert cloud.hosts.received == [(TARGET_HOST, "prep_resize"), (SOURCE, "prep_snapshot_based_resize_at_source"),
                                    (TARGET_HOST, "spawn")]
    assert instances.cell_of(uuid).name == "cell2"
    target, source = rows("cell2", uuid, inp["migration_uuid"]), rows("cell1", uuid, inp["migration_uuid"])
    assert target["instance"] == (False, states.RESIZED, None, TARGET_HOST, BIG["flavorid"])
    assert source["instance"][0] is True
    assert target["migration"][:2] == source["migration"][:2] == ("finished", True)
    assert images_left() == []
    assert placement.get_allocations(inp["migration_uuid"]) == {
        placement.provider_by_host(SOURCE): {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 1}}
    assert placement.get_allocations(uuid) == {
        placement.provider_by_host(TARGET_HOST): {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}}


def test_a_move_that_may_not_cross_cells_stays_in_its_cell(cloud):
    uuid = make_server()

    described = cloud.move(prepare_move(uuid, BIG))

    assert described["status"] == "SUCCEEDED", described
    assert "TargetDBSetup" not in cloud.states_entered(described["executionArn"])
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell2", uuid, "none")["instance"] is None


HOST_OPERATIONS = {"PrepCrossCellOnDestHost": f"{TARGET_HOST}:prep_resize",
                   "PrepSnapshotResizeOnSourceHost": f"{SOURCE}:prep_snapshot_based_resize_at_source",
                   "SpawnOnDestHost": f"{TARGET_HOST}:spawn"}


@pytest.mark.parametrize("state", CROSS_CELL_STATES)
def test_a_failure_at_a_cross_cell_step_rolls_back_to_exactly_the_before_state(cloud, state):
    uuid = server_that_may_cross_cells()
    before = snapshot(uuid)
    used_on_target_before = placement.usages(placement.provider_by_host(TARGET_HOST))
    inp = to_target_host(uuid)
    faults.arm(HOST_OPERATIONS.get(state, state), error="HypervisorError")

    described = cloud.move(inp)

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.HypervisorError"), described
    assert cloud.states_entered(described["executionArn"])[-3:] == ["RollbackTargetCell", "RollbackMove",
                                                                     "MoveFailed"]
    assert snapshot(uuid) == before
    assert instances.cell_of(uuid).name == "cell1"
    target = rows("cell2", uuid, inp["migration_uuid"])
    assert (target["instance"], target["migration"], target["bdms"], target["actions"]) == (None, None, [], [])
    source = rows("cell1", uuid, inp["migration_uuid"])
    assert source["instance"] == (False, states.ACTIVE, None, SOURCE, "1")
    assert source["migration"][0] == "error"
    assert images_left() == []
    assert placement.get_allocations(inp["migration_uuid"]) == {}
    assert placement.usages(placement.provider_by_host(TARGET_HOST)) == used_on_target_before
    spawned = (TARGET_HOST, "spawn") in cloud.hosts.received
    assert ((TARGET_HOST, "destroy") in cloud.hosts.received) == spawned
    source_touched = state in CROSS_CELL_STATES[CROSS_CELL_STATES.index("PrepSnapshotResizeOnSourceHost"):]
    assert ((SOURCE, "finish_revert_resize") in cloud.hosts.received) == source_touched


def test_a_refused_claim_on_a_requested_host_in_another_cell_cleans_the_target_cell(cloud):
    cloud.hosts.failures[(TARGET_HOST, "prep_resize")] = "Ferry.ResizeClaimFailed"
    uuid = server_that_may_cross_cells()
    before = snapshot(uuid)
    inp = to_target_host(uuid)

    described = cloud.move(inp)

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.ResizeClaimFailed")
    entered = cloud.states_entered(described["executionArn"])
    assert entered[-5:] == ["CanReschedule", "IsTargetCellUsed", "RollbackTargetCell", "RollbackMove", "MoveFailed"]
    assert snapshot(uuid) == before
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] is None


def test_a_refused_claim_in_the_target_cell_is_rescheduled_to_an_alternate_there(cloud):
    faults.arm("*:prep_resize", error="ResizeClaimFailed")
    uuid = server_that_may_cross_cells()
    inp = prepare_move(uuid, HUGE)

    described = cloud.move(inp)

    assert described["status"] == "SUCCEEDED", described
    entered = cloud.states_entered(described["executionArn"])
    assert "RescheduleMove" in entered and entered.count("TargetDBSetup") == 2
    [(refused, _op), (chosen, _)] = [r for r in cloud.hosts.received if r[1] == "prep_resize"]
    assert {refused, chosen} == {TARGET_HOST, OTHER_TARGET_HOST}
    assert instances.cell_of(uuid).name == "cell2"
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"][:4] == (False, states.RESIZED, None, chosen)
    assert placement.usages(placement.provider_by_host(refused)) == {}
    assert list(placement.get_allocations(uuid)) == [placement.provider_by_host(chosen)]
    assert images_left() == []


def test_a_target_host_that_may_still_run_the_guest_leaves_the_source_guest_off_and_the_server_in_error(cloud):
    # GIVEN spawn fails on the target host, and so does its destroy after every retry
    uuid = server_that_may_cross_cells()
    allocations_before = placement.get_allocations(uuid)
    inp = to_target_host(uuid)
    faults.arm(f"{TARGET_HOST}:spawn", error="HypervisorError")
    faults.arm(f"{TARGET_HOST}:destroy", faults.ALWAYS, error="HostOperationFailed")

    described = cloud.move(inp)

    # THEN the source guest is restored with every argument as recorded but not powered on
    assert (described["status"], described["error"]) == ("FAILED", "Ferry.HypervisorError"), described
    entered = cloud.states_entered(described["executionArn"])
    assert entered[-6:] == ["WasSourceSnapshotted", "KeepCrossCellSourceGuestOff", "FinishCrossCellRevertOnSourceHost",
                            "RollbackTargetCell", "RollbackMove", "MoveFailed"]
    recorded = cloud.state_input(described["executionArn"], "KeepCrossCellSourceGuestOff")["move"]["restore_args"]
    assert recorded["power_on"] is True
    assert cloud.hosts.args[(SOURCE, "finish_revert_resize")] == {**recorded, "power_on": False}
    # and the server is back in its cell, in ERROR and shut off on its source, with its allocations
    assert instances.cell_of(uuid).name == "cell1"
    assert rows("cell2", uuid, inp["migration_uuid"])["instance"] is None
    assert rows("cell1", uuid, inp["migration_uuid"])["instance"] == (False, states.ERROR, None, SOURCE, "1")
    with cell_session("cell1") as session:
        assert session.scalars(select(Instance.power_state).where(Instance.uuid == uuid)).one() == states.SHUTDOWN
    assert placement.get_allocations(uuid) == allocations_before
    assert images_left() == []
