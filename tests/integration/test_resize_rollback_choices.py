"""How a failed move restores its source guest, executed by moto's ASL interpreter.

The states are the real ones of ``statemachine/resize.asl.json``: the choice after the
destination's clean-up (WasSourceTouched within a cell, WasSourceSnapshotted across cells) and
the Pass states it may go through. The restore Task is replaced by a Pass that outputs the
arguments its message would carry, and the states after the rollback by Succeed states named
after them, so an execution shows whether the source guest is restored and powered on.

When the destination's clean-up failed (``cleanup_error``) after the guest there may have been
made (``finish`` within a cell on another host, ``spawn`` across cells), a guest of the server
may still run there: the source guest is then restored but not powered on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from asl_pieces import deployed_definition, moto_sfn, run_piece

from ferry import protocol

SAME_CELL = ("WasSourceTouched", "FinishRevertOnSourceHost", "RevertResizeOnDestHost")
CROSS_CELL = ("WasSourceSnapshotted", "FinishCrossCellRevertOnSourceHost", "DestroyOnDestHost")
CLEANUP_ERROR = {"Error": "States.Timeout", "Cause": ""}


@pytest.fixture
def sfn(monkeypatch) -> Iterator[Any]:
    yield from moto_sfn(monkeypatch)


def _run(sfn: Any, start: str, restore: str, document: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
    """Run from the choice ``start`` on ``document``: ``(states entered, args sent to restore or None)``."""
    states = deployed_definition("resize.asl.json")["States"]
    kept = {start: states[start]}
    for rule in states[start]["Choices"]:
        if states[rule["Next"]]["Type"] == "Pass":
            kept[rule["Next"]] = states[rule["Next"]]
    sent = states[restore]["Parameters"]["MessageBody"]["args.$"]
    kept[restore] = {"Type": "Pass", "Parameters": {"args.$": sent}, "End": True}
    entered, output = run_piece(sfn, kept, start, document)
    return entered, output["args"] if entered[-1] == restore else None


def restore_args(power_on: bool) -> dict[str, Any]:
    """``move.restore_args`` as ValidateMoveInput builds it, valid for finish_revert_resize."""
    args = {"migration_uuid": "0b8c4d1e-2f3a-4b5c-8d6e-7f8091a2b3c4", "name": "vm1",
            "flavor": {"flavorid": "1", "name": "ferry.tiny", "vcpus": 1, "memory_mb": 512, "root_gb": 1,
                       "ephemeral_gb": 0, "swap": 0},
            "ports": [{"id": "port-1", "mac_address": "fa:16:3e:00:00:01"}],
            "volumes": [{"volume_id": "vol-1", "path": "/srv/volumes/vol-1", "device": "vdb", "boot_index": None}],
            "power_on": power_on}
    protocol.validate(args, protocol.FINISH_REVERT_RESIZE_ARGS_SCHEMA)
    return args


def same_cell(*reached: str, power_on: bool = True, same_host: bool = False, **extra: Any) -> dict[str, Any]:
    """A same-cell move's document after RevertResizeOnDestHost, having reached the steps named."""
    doc: dict[str, Any] = {"instance_uuid": "i", "migration_uuid": "m", "cell": "cell1",
                           "move": {"restore_args": restore_args(power_on)},
                           "destination": {"host": "cell1-host2", "cell": "cell1", "same_host": same_host},
                           "error": {"Error": "Ferry.HypervisorError", "Cause": "it broke"}, **extra}
    for key in reached:
        doc[key] = {"args": {}}
    return doc


def cross_cell(*reached: str, power_on: bool = True, **extra: Any) -> dict[str, Any]:
    """A cross-cell move's document after DestroyOnDestHost (or WasSpawnSent), having reached the steps named."""
    doc: dict[str, Any] = {"instance_uuid": "i", "migration_uuid": "m", "cell": "cell1",
                           "move": {"restore_args": restore_args(power_on)},
                           "destination": {"host": "cell2-host1", "cell": "cell2", "same_host": False},
                           "error": {"Error": "Ferry.HypervisorError", "Cause": "it broke"}, **extra}
    for key in reached:
        doc[key] = {"args": {}}
    return doc


def test_a_destination_that_may_still_run_the_guest_gets_the_source_guest_restored_powered_off(sfn):
    # GIVEN finish_resize may have been sent to another host and the destination's clean-up failed
    doc = same_cell("prep", "resize", "finish", cleanup_error=CLEANUP_ERROR)

    # WHEN the rollback restores the source guest
    entered, args = _run(sfn, *SAME_CELL[:2], doc)

    # THEN with every argument as recorded, but not powered on
    assert entered == ["WasSourceTouched", "KeepSourceGuestOff", "FinishRevertOnSourceHost"]
    assert args == {**restore_args(True), "power_on": False}
    protocol.validate(args, protocol.FINISH_REVERT_RESIZE_ARGS_SCHEMA)


def test_a_cross_cell_destination_that_may_still_run_the_guest_gets_the_source_guest_restored_powered_off(sfn):
    doc = cross_cell("target", "prep", "claim", "snapshot_prep", "snapshotted", "spawn", cleanup_error=CLEANUP_ERROR)

    entered, args = _run(sfn, *CROSS_CELL[:2], doc)

    assert entered == ["WasSourceSnapshotted", "KeepCrossCellSourceGuestOff", "FinishCrossCellRevertOnSourceHost"]
    assert args == {**restore_args(True), "power_on": False}
    protocol.validate(args, protocol.FINISH_REVERT_RESIZE_ARGS_SCHEMA)


@pytest.mark.parametrize("doc", [
    same_cell("prep", "resize", "finish"),
    same_cell("prep", "resize", cleanup_error=CLEANUP_ERROR),  # finish_resize never sent: nothing runs there
    same_cell("prep", "resize", "finish", same_host=True, cleanup_error=CLEANUP_ERROR),  # the restore replaces it
], ids=["cleaned-up", "finish-not-sent", "same-host"])
def test_otherwise_the_source_guest_is_restored_as_it_was(sfn, doc):
    entered, args = _run(sfn, *SAME_CELL[:2], doc)

    assert entered == ["WasSourceTouched", "FinishRevertOnSourceHost"]
    assert args == restore_args(True)


@pytest.mark.parametrize("doc", [
    cross_cell("target", "prep", "claim", "snapshot_prep", "snapshotted", "spawn"),
    cross_cell("target", "prep", "claim", "snapshot_prep", cleanup_error=CLEANUP_ERROR),
], ids=["cleaned-up", "spawn-not-sent"])
def test_otherwise_the_cross_cell_source_guest_is_restored_as_it_was(sfn, doc):
    entered, args = _run(sfn, *CROSS_CELL[:2], doc)

    assert entered == ["WasSourceSnapshotted", "FinishCrossCellRevertOnSourceHost"]
    assert args == restore_args(True)


def test_a_server_that_was_stopped_stays_off_either_way(sfn):
    for doc in (same_cell("prep", "resize", "finish", power_on=False),
                same_cell("prep", "resize", "finish", power_on=False, cleanup_error=CLEANUP_ERROR)):
        _entered, args = _run(sfn, *SAME_CELL[:2], doc)
        assert args == restore_args(False)


@pytest.mark.parametrize(("start", "restore", "doc", "after"), [
    (*SAME_CELL[:2], same_cell("prep", cleanup_error=CLEANUP_ERROR), "RollbackMove"),
    (*CROSS_CELL[:2], cross_cell("target", "prep", cleanup_error=CLEANUP_ERROR), "RollbackTargetCell"),
], ids=["same-cell", "cross-cell"])
def test_a_source_never_touched_is_not_restored(sfn, start, restore, doc, after):
    entered, args = _run(sfn, start, restore, doc)

    assert (entered, args) == ([start, after], None)


@pytest.mark.parametrize(("choice", "restore", "cleanup"), [SAME_CELL, CROSS_CELL], ids=["same-cell", "cross-cell"])
def test_a_failed_destination_clean_up_is_recorded_and_leads_to_the_restore_choice(choice, restore, cleanup):
    states = deployed_definition("resize.asl.json")["States"]
    [catcher] = states[cleanup]["Catch"]

    assert (catcher["ErrorEquals"], catcher["ResultPath"], catcher["Next"]) == (["States.ALL"], "$.cleanup_error",
                                                                                 choice)
    assert states[cleanup]["Next"] == choice
    # Each Pass before the restore turns power_on off and leaves every other argument as recorded.
    for rule in states[choice]["Choices"]:
        if states[rule["Next"]]["Type"] == "Pass":
            passed = states[rule["Next"]]
            assert passed["Next"] == restore
            assert (passed["Result"], passed["ResultPath"]) == (False, "$.move.restore_args.power_on")
