"""How the boot workflow handles a failed last step and passing AWS errors, executed by moto's ASL interpreter.

The states are the real ones of ``statemachine/boot.asl.json``, as the template deploys them. A
Lambda Task that fails is replaced by a Parallel state with the Task's ``Retry``, ``Catch``,
``ResultPath`` and ``Next`` whose one branch fails with the given error (each attempt enters that
branch's state, so the attempts can be counted); a Lambda Task that answers is replaced by a Pass
state putting the answer where the Task would. The states the piece leads to are Succeed states
named after them, so an execution shows whether it ended built or went on to destroy the guest.
The waits between Retry attempts are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from asl_pieces import answering, attempt, deployed_definition, failing, moto_sfn_skipping_retry_waits, path, run_piece

DOCUMENT = {"instance_uuid": "i", "request_id": "r", "execution_name": "boot-i",
            "destination": {"host": "cell1-host1", "node": "cell1-host1", "cell": "cell1", "queue_url": "q",
                            "alternates": []},
            "guest": {"spawn_args": {}}, "spawn": {"power_state": 1}}


@pytest.fixture
def sfn(monkeypatch) -> Iterator[Any]:
    yield from moto_sfn_skipping_retry_waits(monkeypatch)


@pytest.fixture
def states() -> dict[str, Any]:
    return deployed_definition("boot.asl.json")["States"]


def finish_build_failing(sfn: Any, states: dict[str, Any], error: str, check: dict[str, Any]) -> tuple[list[str], Any]:
    """Run FinishBuild failing with ``error`` through CheckBuildCommitted (``check`` in its place)."""
    kept = {"FinishBuild": failing("FinishBuild", states["FinishBuild"], error), "CheckBuildCommitted": check,
            "WasBuildCommitted": states["WasBuildCommitted"]}
    kept.update({catcher["Next"]: {"Type": "Succeed"} for catcher in check.get("Catch", [])})
    return run_piece(sfn, kept, "FinishBuild", DOCUMENT)


@pytest.mark.parametrize("error", ["Sandbox.Timedout", "Lambda.ServiceException", "Ferry.UnexpectedTaskState"])
def test_a_finish_build_that_failed_after_it_committed_ends_built_and_never_destroys_the_guest(sfn, states, error):
    # GIVEN FinishBuild fails at every attempt (its commit landed, its answer never did)
    # WHEN CheckBuildCommitted finds the build committed
    check = answering(states["CheckBuildCommitted"], {"committed": True})
    entered, output = finish_build_failing(sfn, states, error, check)

    # THEN the execution ends built: no destroy is sent, nothing is unbound or released
    assert path(entered) == ["FinishBuild", "CheckBuildCommitted", "WasBuildCommitted", "Built"]
    assert output["error"]["Error"] == error


def test_a_finish_build_that_had_not_committed_is_rolled_back_from_the_spawn(sfn, states):
    check = answering(states["CheckBuildCommitted"], {"committed": False})
    entered, output = finish_build_failing(sfn, states, "Ferry.UnexpectedTaskState", check)

    assert path(entered) == ["FinishBuild", "CheckBuildCommitted", "WasBuildCommitted", "DestroyAtDest"]
    assert output["error"]["Error"] == "Ferry.UnexpectedTaskState"  # what FailBuild records


def test_a_build_whose_commit_cannot_be_checked_is_not_rolled_back(sfn, states):
    # GIVEN FinishBuild failed and whether it committed cannot be read (the cell's store is out)
    check = failing("CheckBuildCommitted", states["CheckBuildCommitted"], "Ferry.InjectedFault")
    entered, output = finish_build_failing(sfn, states, "Ferry.UnexpectedTaskState", check)

    # THEN after waiting out minutes of outage, it ends without destroying anything: the server may
    # be ACTIVE on its host (ferry audit reports what is left to settle)
    assert path(entered) == ["FinishBuild", "CheckBuildCommitted", "CountBuildOutcomeUnknown"]
    assert entered.count(attempt("CheckBuildCommitted")) > 10
    assert output["commit_error"]["Error"] == "Ferry.InjectedFault"
    # counted for the operators' alarm, then failed
    assert states["CountBuildOutcomeUnknown"]["Next"] == "BuildOutcomeUnknown"
    assert states["BuildOutcomeUnknown"]["Type"] == "Fail"


@pytest.mark.parametrize(("name", "error", "attempts"), [
    ("FinishBuild", "Lambda.ServiceException", 4),
    ("FinishBuild", "Lambda.TooManyRequestsException", 4),
    ("FinishBuild", "Lambda.AWSLambdaException", 4),
    ("FinishBuild", "Lambda.SdkClientException", 4),
    ("FinishBuild", "Sandbox.Timedout", 4),  # the function's own timeout
    ("FinishBuild", "Ferry.InjectedFault", 3),  # the step is idempotent: any error is tried again
    ("BindResourcesAtDest", "Lambda.ServiceException", 4),
    ("BindResourcesAtDest", "Lambda.TooManyRequestsException", 4),
    ("RescheduleBuild", "Lambda.ServiceException", 4),
    ("RescheduleBuild", "Lambda.TooManyRequestsException", 4),
    ("RescheduleBuild", "Ferry.AllocationConflict", 4),  # a claim that lost a race is tried again
])
def test_a_passing_error_of_an_idempotent_step_is_retried_before_it_is_caught(sfn, states, name, error, attempts):
    state = states[name]
    [catcher] = state["Catch"]
    kept = {name: failing(name, state, error), catcher["Next"]: {"Type": "Succeed"}}
    entered, _output = run_piece(sfn, kept, name, DOCUMENT)

    assert entered.count(attempt(name)) == attempts
    assert path(entered) == [name, catcher["Next"]]


