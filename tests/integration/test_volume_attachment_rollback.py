"""How the volume attachment workflow handles a failed last step, executed by moto's ASL interpreter.

The states are the real ones of ``statemachine/volume_attachment.asl.json``, as the template
deploys them; failing and answering Lambda Tasks are stood in for as ``asl_pieces`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from asl_pieces import answering, attempt, deployed_definition, failing, moto_sfn_skipping_retry_waits, path, run_piece

DOCUMENT = {"instance_uuid": "i", "request_id": "r", "cell": "cell1", "operation": "attach", "volume_id": "v",
            "volume_op": {"host": "cell1-host1", "queue_url": "q", "args": {}}, "attached": {}}


@pytest.fixture
def sfn(monkeypatch) -> Iterator[Any]:
    yield from moto_sfn_skipping_retry_waits(monkeypatch)


@pytest.fixture
def states() -> dict[str, Any]:
    return deployed_definition("volume_attachment.asl.json")["States"]


def finish_failing(sfn: Any, states: dict[str, Any], check: dict[str, Any], operation: str = "attach"
                   ) -> tuple[list[str], Any]:
    """Run FinishVolumeOperation failing at every attempt through CheckVolumeCommitted (``check`` in its place)."""
    kept = {"FinishVolumeOperation": failing("FinishVolumeOperation", states["FinishVolumeOperation"],
                                             "Sandbox.Timedout"),
            "CheckVolumeCommitted": check, "WasVolumeOperationCommitted": states["WasVolumeOperationCommitted"],
            "UndoAttach": states["UndoAttach"]}
    kept.update({name: {"Type": "Succeed"} for name in ("Done", "DetachAfterFailedAttach", "FailVolumeOperation")})
    kept.update({catcher["Next"]: {"Type": "Succeed"} for catcher in check.get("Catch", [])})
    return run_piece(sfn, kept, "FinishVolumeOperation", {**DOCUMENT, "operation": operation})


@pytest.mark.parametrize("operation", ["attach", "detach"])
def test_an_operation_that_committed_before_its_last_step_failed_ends_done(sfn, states, operation):
    # GIVEN FinishVolumeOperation fails at every attempt (its commit landed, its answer never did)
    # WHEN CheckVolumeCommitted finds it committed
    entered, _ = finish_failing(sfn, states, answering(states["CheckVolumeCommitted"], {"committed": True}),
                                operation)

    # THEN the execution ends done: the volume is not detached again, nothing is rolled back
    assert path(entered) == ["FinishVolumeOperation", "CheckVolumeCommitted", "WasVolumeOperationCommitted", "Done"]


@pytest.mark.parametrize(("operation", "rollback"), [("attach", "DetachAfterFailedAttach"),
                                                     ("detach", "FailVolumeOperation")])
def test_an_operation_that_had_not_committed_is_rolled_back(sfn, states, operation, rollback):
    entered, output = finish_failing(sfn, states, answering(states["CheckVolumeCommitted"], {"committed": False}),
                                     operation)

    assert path(entered) == ["FinishVolumeOperation", "CheckVolumeCommitted", "WasVolumeOperationCommitted",
                             "UndoAttach", rollback]
    assert output["error"]["Error"] == "Sandbox.Timedout"  # what FailVolumeOperation records


def test_an_operation_whose_commit_cannot_be_checked_is_not_rolled_back(sfn, states):
    # GIVEN whether FinishVolumeOperation committed cannot be read (the cell's store is out)
    check = failing("CheckVolumeCommitted", states["CheckVolumeCommitted"], "Ferry.InjectedFault")
    entered, output = finish_failing(sfn, states, check)

    # THEN after minutes of retries it ends without detaching the volume from the guest
    assert path(entered) == ["FinishVolumeOperation", "CheckVolumeCommitted", "CountVolumeOutcomeUnknown"]
    assert entered.count(attempt("CheckVolumeCommitted")) > 10
    assert output["commit_error"]["Error"] == "Ferry.InjectedFault"
    # counted for the operators' alarm, then failed
    assert states["CountVolumeOutcomeUnknown"]["Next"] == "VolumeOutcomeUnknown"
    assert states["VolumeOutcomeUnknown"]["Type"] == "Fail"
