"""The state machines: valid ASL, a sound graph, and the workflow rules Ferry keeps.

Each ``statemachine/*.asl.json`` is filled in with the values the template substitutes for a
local deployment and compiled by moto's ASL parser (the one that rejects a definition at
CreateStateMachine). The parser does not follow transitions, so the graph is checked here, in
every scope: the top level, each Parallel branch and each Map's ItemProcessor (or Iterator).
The rules are described in docs/development.md.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser

from ferry.local.template import resolve

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = resolve(ROOT / "template.yaml")
ASL_FILES = sorted((ROOT / "statemachine").glob("*.asl.json"))

HOST_OPERATION = "arn:aws:states:::sqs:sendMessage.waitForTaskToken"
# States that end a scope or branch by their type: no Next, no End.
TERMINAL_TYPES = {"Succeed", "Fail", "Choice"}
# States that do work and can fail on their own.
WORK_TYPES = {"Task", "Parallel", "Map"}
# The Task that counts, for the operators' alarm, an execution ending without settling what it changed.
COUNT_NOT_SETTLED = "arn:aws:states:::aws-sdk:cloudwatch:putMetricData"
# Every Fail state that ends an execution with what it changed left for ferry audit, per workflow.
NOT_SETTLED = {"boot": ["BuildOutcomeUnknown", "RollbackFailed"], "confirm_resize": ["RollbackFailed"],
               "delete": ["RollbackFailed"], "power": ["RollbackFailed"],
               "resize": ["MoveOutcomeUnknown", "RollbackFailed"], "revert_resize": ["RollbackFailed"],
               "volume_attachment": ["VolumeOutcomeUnknown", "RollbackFailed"], "drain": ["ReportLost"]}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _definition_text(asl_file: Path) -> str:
    machine = next((m for m in TEMPLATE.state_machines.values() if m.definition_uri == asl_file), None)
    assert machine is not None, f"{_rel(asl_file)} is not the DefinitionUri of any state machine"
    return machine.definition()


def _definition(asl_file: Path) -> dict[str, Any]:
    return json.loads(_definition_text(asl_file))


def _scopes(machine: dict[str, Any], where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """The machine and every nested state machine in it, each with a readable location."""
    yield where or "top level", machine
    for name, state in machine["States"].items():
        for index, branch in enumerate(state.get("Branches", [])):
            yield from _scopes(branch, f"{where}{name}.Branches[{index}].")
        for key in ("ItemProcessor", "Iterator"):
            if key in state:
                yield from _scopes(state[key], f"{where}{name}.{key}.")


def _transitions(state: dict[str, Any]) -> list[str]:
    """Every state name this state can move to."""
    targets = [state["Next"]] if "Next" in state else []
    if "Default" in state:
        targets.append(state["Default"])
    targets += [rule["Next"] for rule in state.get("Choices", [])]
    targets += [catcher["Next"] for catcher in state.get("Catch", [])]
    return targets


def _reachable(states: dict[str, Any], start: str) -> set[str]:
    seen = {start}
    queue = deque([start])
    while queue:
        for target in _transitions(states[queue.popleft()]):
            if target in states and target not in seen:
                seen.add(target)
                queue.append(target)
    return seen


def _is_terminal_rollback(states: dict[str, Any], name: str) -> bool:
    """A rollback step (its Comment says so) after which nothing that does work can run (a count
    for the operators' alarm is no work)."""
    if "rollback" not in states[name].get("Comment", "").lower():
        return False
    after = _reachable(states, name) - {name}
    return not any(states[other]["Type"] in WORK_TYPES and not _is_count(states[other]) for other in after)


def _is_count(state: dict[str, Any]) -> bool:
    return state.get("Resource") == COUNT_NOT_SETTLED


def _ending(states: dict[str, Any], name: str) -> dict[str, Any]:
    """The state ``name`` leads to once past a count for the operators' alarm, if it is one."""
    state = states[name]
    return states[state["Next"]] if _is_count(state) else state


def test_definition_files_exist():
    assert ASL_FILES, "statemachine/ holds no *.asl.json"


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_definition_compiles_with_moto_asl_parser(asl_file):
    text = _definition_text(asl_file)
    assert "${" not in text, "a placeholder was left without a substitution"

    AmazonStateLanguageParser.parse(text)


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_transition_targets_a_state_of_its_scope(asl_file):
    dangling = []
    for where, scope in _scopes(_definition(asl_file)):
        states = scope["States"]
        if scope["StartAt"] not in states:
            dangling.append(f"{where}: StartAt -> {scope['StartAt']}")
        for name, state in states.items():
            dangling += [f"{where}{name} -> {target}" for target in _transitions(state) if target not in states]

    assert dangling == []


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_state_either_moves_on_or_ends(asl_file):
    wrong = [
        f"{where}{name}"
        for where, scope in _scopes(_definition(asl_file))
        for name, state in scope["States"].items()
        if state["Type"] not in TERMINAL_TYPES and ("Next" in state) == bool(state.get("End"))
    ]

    assert wrong == [], "each needs exactly one of Next and End"


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_state_is_reachable_from_start_at(asl_file):
    unreachable = []
    for where, scope in _scopes(_definition(asl_file)):
        states = scope["States"]
        if scope["StartAt"] in states:
            unreachable += [f"{where}{name}" for name in set(states) - _reachable(states, scope["StartAt"])]

    assert sorted(unreachable) == []


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_task_catches_its_failures_unless_it_is_a_terminal_rollback(asl_file):
    uncaught = [
        f"{where}{name}"
        for where, scope in _scopes(_definition(asl_file))
        for name, state in scope["States"].items()
        if state["Type"] == "Task" and not state.get("Catch") and not _is_terminal_rollback(scope["States"], name)
    ]

    assert uncaught == []


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_host_operation_has_a_timeout_and_a_heartbeat(asl_file):
    unbounded = [
        f"{where}{name}"
        for where, scope in _scopes(_definition(asl_file))
        for name, state in scope["States"].items()
        if state.get("Resource") == HOST_OPERATION
        and not (
            {"TimeoutSeconds", "TimeoutSecondsPath"} & state.keys()
            and {"HeartbeatSeconds", "HeartbeatSecondsPath"} & state.keys()
        )
    ]

    assert unbounded == []


# The host operations that move a disk's bytes (image or snapshot transfers, disk copies): they
# wait the template's HostDiskOpTimeoutSeconds, every other host operation HostOpTimeoutSeconds.
DISK_OPERATIONS = {"spawn", "resize_instance", "finish_resize", "prep_snapshot_based_resize_at_source"}


def test_a_host_operation_that_moves_a_disk_waits_the_disk_timeout_and_every_other_the_host_timeout():
    disk, other = (int(TEMPLATE.parameters[name]) for name in ("HostDiskOpTimeoutSeconds", "HostOpTimeoutSeconds"))
    assert disk > other
    waits = {
        f"{_rel(asl_file)}:{where}{name}": (state["Parameters"]["MessageBody"]["operation"], state["TimeoutSeconds"])
        for asl_file in ASL_FILES for where, scope in _scopes(_definition(asl_file))
        for name, state in scope["States"].items() if state.get("Resource") == HOST_OPERATION
        and "operation" in state["Parameters"]["MessageBody"]
    }

    wrong = {name: wait for name, wait in waits.items() if wait[1] != (disk if wait[0] in DISK_OPERATIONS else other)}
    assert wrong == {}
    assert {operation for operation, _ in waits.values()} >= DISK_OPERATIONS


def test_rollback_step_is_terminal_only_when_no_work_can_follow():
    states = {
        "Claim": {"Type": "Task", "Resource": "x", "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Release"}]},
        "Release": {"Type": "Task", "Comment": "rollback of Claim", "Resource": "x", "Next": "Failed"},
        "Unbind": {"Type": "Task", "Comment": "rollback of Bind", "Resource": "x", "Next": "Release"},
        "Failed": {"Type": "Fail", "Error": "Ferry.BuildFailed"},
    }

    assert _is_terminal_rollback(states, "Release")
    assert not _is_terminal_rollback(states, "Unbind"), "Release, a Task, runs after it"
    assert not _is_terminal_rollback(states, "Claim"), "its Comment does not mark it as a rollback"


# --- steps that must outlast an outage of the store ---------------------------------------------

# A store outage of a few minutes must not leave a task, a migration or a drain slot stuck: these
# steps are idempotent, and are retried on any error for at least this long before giving up.
OUTAGE_SECONDS = 240
# (definition, state): the rollback tails, the check before rolling back a move whose last step
# failed, and a drain iteration's bookkeeping.
OUTLAST_AN_OUTAGE = [
    ("resize", "RollbackMove"), ("resize", "CheckMoveCommitted"),
    ("confirm_resize", "RestoreVerifyResize"), ("confirm_resize", "FailConfirm"),
    ("revert_resize", "RestoreVerifyResize"), ("revert_resize", "FailRevert"),
    ("drain", "BeginDrain"), ("drain", "PlanDrain"), ("drain", "AcquireSlot"), ("drain", "FinishDrain"),
    ("drain", "RecordFailure"), ("drain", "SettleServer"),
    ("boot", "FailBuild"), ("boot", "CheckBuildCommitted"), ("delete", "FailDelete"), ("power", "FailPowerAction"),
    ("volume_attachment", "CheckVolumeCommitted"), ("volume_attachment", "FailVolumeOperation"),
]


def _states_named(workflow: str) -> dict[str, dict[str, Any]]:
    """Every state of ``statemachine/<workflow>.asl.json``, nested scopes included (names are unique)."""
    found: dict[str, dict[str, Any]] = {}
    for _where, scope in _scopes(_definition(ROOT / "statemachine" / f"{workflow}.asl.json")):
        found.update(scope["States"])
    return found


def _expected_wait(rule: dict[str, Any]) -> float:
    """How long a Retry rule waits in all before giving up, on average (full jitter halves each wait)."""
    interval, rate = rule.get("IntervalSeconds", 1), rule.get("BackoffRate", 2.0)
    cap = rule.get("MaxDelaySeconds", float("inf"))
    total = sum(min(interval * rate ** attempt, cap) for attempt in range(rule.get("MaxAttempts", 3)))
    return total / 2 if rule.get("JitterStrategy") == "FULL" else total


def test_expected_wait_counts_backoff_the_cap_and_jitter():
    assert _expected_wait({"IntervalSeconds": 1, "MaxAttempts": 3, "BackoffRate": 2}) == 7
    assert _expected_wait({"IntervalSeconds": 2, "MaxAttempts": 4, "BackoffRate": 2, "MaxDelaySeconds": 5}) == 16
    assert _expected_wait({"IntervalSeconds": 2, "MaxAttempts": 2, "JitterStrategy": "FULL"}) == 3


@pytest.mark.parametrize(("workflow", "name"), OUTLAST_AN_OUTAGE, ids=[f"{w}:{n}" for w, n in OUTLAST_AN_OUTAGE])
def test_idempotent_clean_up_steps_retry_every_error_for_minutes(workflow, name):
    state = _states_named(workflow)[name]
    [rule] = [rule for rule in state.get("Retry", []) if "States.ALL" in rule["ErrorEquals"]]

    assert _expected_wait(rule) >= OUTAGE_SECONDS
    assert rule.get("JitterStrategy") == "FULL", "many executions retrying a store that comes back: spread them"
    assert rule.get("MaxDelaySeconds", 0) <= 120, "a store that is back is used within two minutes"


ROLLBACK_TAILS = [("resize", "RollbackMove"), ("confirm_resize", "RestoreVerifyResize"),
                  ("confirm_resize", "FailConfirm"), ("revert_resize", "RestoreVerifyResize"),
                  ("revert_resize", "FailRevert"), ("boot", "FailBuild"), ("delete", "FailDelete"),
                  ("power", "FailPowerAction"), ("volume_attachment", "FailVolumeOperation")]


@pytest.mark.parametrize(("workflow", "name"), ROLLBACK_TAILS, ids=[f"{w}:{n}" for w, n in ROLLBACK_TAILS])
def test_a_rollback_tail_that_fails_for_good_fails_the_execution_with_a_typed_error(workflow, name):
    states = _states_named(workflow)
    [catcher] = states[name]["Catch"]
    failed = _ending(states, catcher["Next"])

    assert catcher["ErrorEquals"] == ["States.ALL"]
    assert catcher["ResultPath"] != "$.error", "the move's own error stays in the document"
    assert failed["Type"] == "Fail" and failed["Error"].startswith("Ferry.")
    assert catcher["Next"] != states[name]["Next"], "a rollback that failed is told apart from a failure rolled back"


def test_a_move_whose_last_step_failed_is_rolled_back_only_when_that_step_had_not_committed():
    states = _states_named("resize")

    for last in ("MarkResized", "CompleteMoveAcrossCells"):
        assert [c["Next"] for c in states[last]["Catch"]] == ["CheckMoveCommitted"], last
    check = states["CheckMoveCommitted"]
    choice = states[check["Next"]]
    assert choice["Type"] == "Choice"
    committed = [rule["Next"] for rule in choice["Choices"]
                 if rule["Variable"] == f"{check['ResultPath']}.committed" and rule.get("BooleanEquals") is True]
    assert [states[target]["Type"] for target in committed] == ["Succeed"]
    rollbacks = {rule["Next"] for rule in choice["Choices"]} - set(committed) | {choice["Default"]}
    assert rollbacks == {"RevertResizeOnDestHost", "WasSpawnSent"}  # each branch's own rollback
    # When it cannot tell, nothing is rolled back: no host operation or rollback runs after it.
    [unknown] = [c["Next"] for c in check["Catch"]]
    assert _ending(states, unknown)["Type"] == "Fail"


@pytest.mark.parametrize("workflow", sorted(NOT_SETTLED))
def test_an_execution_ending_unsettled_is_counted_for_the_operators_alarm_on_its_only_way_there(workflow):
    asl_file = ROOT / "statemachine" / f"{workflow}.asl.json"
    states = _states_named(workflow)
    counts = {name: state for name, state in states.items() if _is_count(state)}

    assert sorted(counts) == sorted(f"Count{fail}" for fail in NOT_SETTLED[workflow])
    for fail in NOT_SETTLED[workflow]:
        count = counts[f"Count{fail}"]
        assert states[fail]["Type"] == "Fail"
        # Every way to the Fail state goes through its count; a count that fails ends there too.
        assert {name for name, state in states.items() if fail in _transitions(state)} == {f"Count{fail}"}
        assert count["Next"] == fail and count["ResultPath"] is None
        assert count["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": None, "Next": fail}]
        # A throttled put is tried again, briefly: the execution's end waits seconds at most.
        [retry] = count["Retry"]
        assert retry["ErrorEquals"] == ["States.ALL"] and _expected_wait(retry) < 10
        [datum] = count["Parameters"]["MetricData"]
        assert count["Parameters"]["Namespace"] == TEMPLATE.parameters["MetricsNamespace"]
        assert (datum["MetricName"], datum["Unit"], datum["Value"]) == ("WorkflowNotSettled", "Count", 1)
        # The Workflow dimension is the state machine's name without the stack's prefix.
        machine = next(m for m in TEMPLATE.state_machines.values() if m.definition_uri == asl_file)
        named = machine.name.removeprefix(f"ferry-{TEMPLATE.stage}-")
        assert datum["Dimensions"] == [{"Name": "Workflow", "Value": named}, {"Name": "State", "Value": fail}]


def test_every_fail_state_a_rollback_or_a_commit_check_fails_into_is_counted():
    """A rollback, or the check whether a last step committed, that fails for good ends the
    execution unsettled: the Fail state it leads to is one of NOT_SETTLED (so it is counted)."""
    for asl_file in ASL_FILES:
        workflow = asl_file.name.removesuffix(".asl.json")
        states = _states_named(workflow)
        ends = set()
        for name, state in states.items():
            checks_commit = name.startswith("Check") and name.endswith("Committed")
            if "rollback" in state.get("Comment", "").lower() or checks_commit:
                for catcher in state.get("Catch", []):
                    target = catcher["Next"]
                    ends.add(states[target]["Next"] if _is_count(states[target]) else target)
        failing = {end for end in ends if states[end]["Type"] == "Fail"}
        assert failing <= set(NOT_SETTLED.get(workflow, [])), workflow


def test_a_drain_iteration_cannot_end_with_its_server_still_moving():
    states = _states_named("drain")["MoveServers"]["ItemProcessor"]["States"]

    # Every failure leads to a step that records the server's fate, never straight to the end.
    targets = {catcher["Next"] for state in states.values() for catcher in state.get("Catch", [])}
    assert targets <= {"RecordFailure", "SettleServer", "WaitToSettle"}
    assert [c["Next"] for c in states["RecordFailure"]["Catch"]] == ["SettleServer"]
    # SettleServer records it; if even that fails, the iteration waits and settles again.
    assert states["SettleServer"]["Next"] == "ServerSettled"
    unsettled = {name: state for name, state in states.items() if name != "SettleServer"}
    for catcher in states["SettleServer"]["Catch"]:
        assert "SettleServer" in _reachable(states, catcher["Next"])
        assert "ServerSettled" not in _reachable(unsettled, catcher["Next"])


def test_a_revert_goes_back_to_verify_resize_only_when_the_destination_removed_nothing():
    # A confirm after the server went back to VERIFY_RESIZE deletes the source's disks: only an
    # error that says the destination's guest is intact (HypervisorError: it could not be
    # destroyed; InvalidOperation: the agent refused the message; States.Runtime: none was made)
    # may lead there; a timeout or any other failure may come after it was destroyed, and so may a
    # send SQS refused after a try that timed out (a Catch sees only the last error).
    # Between cells (DestroyAtDest) the flip is undone first.
    for name in ("RevertAtDest", "DestroyAtDest"):
        state = _definition(ROOT / "statemachine" / "revert_resize.asl.json")["States"][name]
        catches = [(catcher["ErrorEquals"], catcher["Next"]) for catcher in state["Catch"]]
        assert catches == [(["Ferry.HypervisorError", "Ferry.InvalidOperation", "States.Runtime"],
                            "RestoreVerifyResize"), (["States.ALL"], "FailRevert")], name


# --- a host operation's message SQS refused ------------------------------------------------------

# The errors Step Functions' SQS integration fails a send with when SQS answered with an error
# (AmazonSQSException, or the error's own name): throttling, a queue being recreated.
SQS_REFUSALS = ["SQS.AmazonSQSException", "SQS.QueueDoesNotExistException"]
# (definition, state, where a failure after which the host may have acted goes): the first host
# operation of a confirm or a revert, whose failure leaves the server in VERIFY_RESIZE only when
# it shows the host ran nothing.
FIRST_HOST_OPERATIONS = [("confirm_resize", "ConfirmAtSource", "FailConfirm"),
                         ("revert_resize", "DestroyAtDest", "FailRevert"),
                         ("revert_resize", "RevertAtDest", "FailRevert")]


def _catch_target(state: dict[str, Any], error: str) -> str | None:
    """Where the state's Catch sends ``error``: the first catcher naming it or States.ALL."""
    return next((catcher["Next"] for catcher in state.get("Catch", [])
                 if error in catcher["ErrorEquals"] or "States.ALL" in catcher["ErrorEquals"]), None)


_MISSING = object()


def _value_at(document: dict[str, Any], path: str) -> Any:
    value: Any = document
    for key in path.removeprefix("$.").split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _matches(rule: dict[str, Any], document: dict[str, Any]) -> bool:
    """A Choice rule of the kinds these definitions use, evaluated as Step Functions does."""
    if "And" in rule:
        return all(_matches(inner, document) for inner in rule["And"])
    if "Or" in rule:
        return any(_matches(inner, document) for inner in rule["Or"])
    if "Not" in rule:
        return not _matches(rule["Not"], document)
    value = _value_at(document, rule["Variable"])
    if "IsPresent" in rule:
        return (value is not _MISSING) == rule["IsPresent"]
    assert value is not _MISSING, f"{rule['Variable']} is read without IsPresent first: States.Runtime"
    if "IsString" in rule:
        return isinstance(value, str) == rule["IsString"]
    if "BooleanEquals" in rule:
        assert isinstance(value, bool), f"{rule['Variable']} is not a boolean: States.Runtime"
        return value == rule["BooleanEquals"]
    if "StringMatches" in rule:
        assert "\\" not in rule["StringMatches"], "escapes are not evaluated here"
        pattern = ".*".join(re.escape(part) for part in rule["StringMatches"].split("*"))
        return isinstance(value, str) and re.fullmatch(pattern, value, re.DOTALL) is not None
    raise AssertionError(f"a Choice rule this test does not evaluate: {rule}")


def _choose(state: dict[str, Any], document: dict[str, Any]) -> str:
    assert state["Type"] == "Choice"
    return next((rule["Next"] for rule in state["Choices"] if _matches(rule, document)), state["Default"])


def test_a_choice_rule_is_evaluated_as_step_functions_does():
    state = {"Type": "Choice", "Default": "No", "Choices": [{"And": [
        {"Variable": "$.e.Cause", "IsPresent": True},
        {"Or": [{"Variable": "$.e.Cause", "StringMatches": "*refused*"},
                {"Not": {"Variable": "$.e.Cause", "IsString": True}}]}], "Next": "Yes"}]}

    assert _choose(state, {"e": {"Cause": "Connection refused (Connection refused)"}}) == "Yes"
    assert _choose(state, {"e": {"Cause": "a.b refused? [x]"}}) == "Yes"
    assert _choose(state, {"e": {"Cause": 3}}) == "Yes"
    assert _choose(state, {"e": {"Cause": "Read timed out"}}) == "No"
    assert _choose(state, {"e": {}}) == "No"


@pytest.mark.parametrize(("workflow", "name", "failed"), FIRST_HOST_OPERATIONS,
                         ids=[f"{w}:{n}" for w, n, _ in FIRST_HOST_OPERATIONS])
def test_a_send_sqs_refused_is_tried_again_then_fails_as_a_failure_after_which_the_host_may_have_acted(
        workflow, name, failed):
    state = _states_named(workflow)[name]

    assert state["Resource"] == HOST_OPERATION
    for error in SQS_REFUSALS:
        rule = _retrier_for(state, error)
        assert rule is not None, f"{error} (SQS throttling, a queue being recreated) is not tried again"
        assert 1 <= rule.get("IntervalSeconds", 1) <= 2 and rule.get("MaxAttempts", 3) == 3, error
        assert rule.get("BackoffRate", 2.0) == 2, error
        # The Catch sees only the last error: a refusal after a try that timed out (and may have
        # run) must not read as a send that never happened.
        assert _catch_target(state, error) == failed, error
    # The agent refused the message (before running it), or no message could be made.
    for error in ("Ferry.InvalidOperation", "States.Runtime"):
        assert _catch_target(state, error) == "RestoreVerifyResize", error
    # A timeout, a failure the agent answered, or one SQS's client gave (a lost reply among them),
    # may come after the host changed something.
    for error in ("States.Timeout", "Ferry.HostOperationFailed", "Ferry.GuestNotFound", "SQS.SdkClientException"):
        assert _catch_target(state, error) == failed, error
    assert state["Catch"][-1]["ErrorEquals"] == ["States.ALL"] and state["Catch"][-1]["Next"] == failed
    assert all("States.ALL" not in catcher["ErrorEquals"] for catcher in state["Catch"][:-1])


# --- retries of Lambda's own transient errors, and of host operations ----------------------------

# What Lambda's service answers when it fails (not the function): always worth another try.
LAMBDA_TRANSIENT_ERRORS = ("Lambda.ServiceException", "Lambda.TooManyRequestsException",
                           "Lambda.AWSLambdaException", "Lambda.SdkClientException")
# And a database failure of the moment, as every step handler names it (ferry.handlers).
TRANSIENT_STEP_ERRORS = (*LAMBDA_TRANSIENT_ERRORS, "Ferry.DatabaseUnavailable")


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_host_operation_sends_again_when_sqs_refused_its_message(asl_file):
    # A refused send (throttling, a queue being recreated) ran nothing on the host; the agent's
    # journal makes a message sent twice run once.
    not_again = [
        f"{where}{name}: {error}"
        for where, scope in _scopes(_definition(asl_file))
        for name, state in scope["States"].items() if state.get("Resource") == HOST_OPERATION
        for error in SQS_REFUSALS if _retrier_for(state, error) is None
    ]

    assert not_again == []


def _retrier_for(state: dict[str, Any], error: str) -> dict[str, Any] | None:
    """The Retry rule Step Functions applies to ``error``: the first naming it or ``States.ALL``."""
    return next((rule for rule in state.get("Retry", [])
                 if error in rule["ErrorEquals"] or "States.ALL" in rule["ErrorEquals"]), None)


def _is_lambda_task(state: dict[str, Any]) -> bool:
    resource = state.get("Resource", "")
    return state["Type"] == "Task" and (":lambda:" in resource and ":function:" in resource
                                         or resource.startswith("arn:aws:states:::lambda:invoke"))


def test_the_retrier_for_an_error_is_the_first_rule_that_matches_it():
    state = {"Retry": [{"ErrorEquals": ["Ferry.Refused"], "MaxAttempts": 0},
                       {"ErrorEquals": ["Lambda.ServiceException"], "MaxAttempts": 2},
                       {"ErrorEquals": ["States.ALL"], "MaxAttempts": 5}]}

    assert _retrier_for(state, "Ferry.Refused")["MaxAttempts"] == 0
    assert _retrier_for(state, "Lambda.ServiceException")["MaxAttempts"] == 2
    assert _retrier_for(state, "Lambda.SdkClientException")["MaxAttempts"] == 5
    assert _retrier_for({"Retry": state["Retry"][:2]}, "Lambda.SdkClientException") is None


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_lambda_task_retries_lambdas_and_the_databases_transient_errors(asl_file):
    """Each of the five is retried, by a rule naming it or by one on States.ALL, never left to the Catch."""
    unretried = [
        f"{where}{name}: {error}"
        for where, scope in _scopes(_definition(asl_file))
        for name, state in scope["States"].items() if _is_lambda_task(state)
        for error in TRANSIENT_STEP_ERRORS
        if (rule := _retrier_for(state, error)) is None or rule.get("MaxAttempts", 3) < 1
    ]

    assert unretried == []


# How long a database failover takes (RDS Multi-AZ, Aurora): a step's retries of a database
# failure of the moment outlast one on average.
FAILOVER_SECONDS = 60


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_lambda_task_outlasts_a_database_failover_with_a_retrier_of_its_own(asl_file):
    """Not the one of Lambda's errors (it would share their attempts), and spread out (full jitter)."""
    short = [
        f"{where}{name}"
        for where, scope in _scopes(_definition(asl_file))
        for name, state in scope["States"].items() if _is_lambda_task(state)
        if (rule := _retrier_for(state, "Ferry.DatabaseUnavailable")) is None
        or _expected_wait(rule) < FAILOVER_SECONDS or rule.get("JitterStrategy") != "FULL"
        or (rule["ErrorEquals"] != ["Ferry.DatabaseUnavailable"] and "States.ALL" not in rule["ErrorEquals"])
    ]

    assert short == []


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_lambda_task_is_found_as_one(asl_file):
    """The test above checks nothing if it recognises no Lambda Task."""
    tasks = [state for _where, scope in _scopes(_definition(asl_file)) for state in scope["States"].values()
             if state["Type"] == "Task" and not state["Resource"].startswith("arn:aws:states:::")]

    assert tasks and all(_is_lambda_task(state) for state in tasks)


# (definition, state) of the host operations a workflow sends again after a timeout or a hypervisor
# error: they are idempotent (the agent journals each operation id, and a second stop or start
# finds the guest already so), and the workflow does nothing else meanwhile.
RETRIED_HOST_OPERATIONS = [
    ("power", "SetPowerAtHost"),
    ("delete", "ConfirmAtSource"), ("delete", "DestroyAtHost"),
    ("volume_attachment", "AttachAtHost"), ("volume_attachment", "DetachAtHost"),
    ("confirm_resize", "ConfirmAtSource"),
    ("revert_resize", "DestroyAtDest"), ("revert_resize", "RevertAtDest"), ("revert_resize", "FinishRevertAtSource"),
]


@pytest.mark.parametrize(("workflow", "name"), RETRIED_HOST_OPERATIONS,
                         ids=[f"{w}:{n}" for w, n in RETRIED_HOST_OPERATIONS])
def test_idempotent_host_operations_retry_a_timeout_and_a_hypervisor_error(workflow, name):
    state = _states_named(workflow)[name]

    assert state["Resource"] == HOST_OPERATION
    for error in ("States.Timeout", "Ferry.HypervisorError"):
        rule = _retrier_for(state, error)
        assert rule is not None and rule.get("MaxAttempts", 3) >= 1, error


def test_a_power_action_retries_its_host_operation_as_a_delete_does():
    """os-stop and os-start are idempotent on the host (a stopped guest stays stopped, a running one runs).

    A delete also retries the HostOperationFailed an agent answers for a destroy whose earlier run
    was cut short (a power action never gets one for that)."""
    deletes = [{**retrier, "ErrorEquals": [e for e in retrier["ErrorEquals"] if e != "Ferry.HostOperationFailed"]}
               for retrier in _states_named("delete")["DestroyAtHost"]["Retry"]]
    assert _states_named("power")["SetPowerAtHost"].get("Retry") == deletes


# --- the drain's plan: one long Lambda step ------------------------------------------------------

# How a Lambda step that ran out of time (or memory) fails: Sandbox.Timedout (Lambda.Unknown from
# older runtimes); States.Timeout if the Task's own TimeoutSeconds ran out first.
OUT_OF_TIME_ERRORS = ("Sandbox.Timedout", "Lambda.Unknown", "States.Timeout")


def test_plan_drain_has_its_functions_whole_timeout_and_runs_out_of_it_at_most_twice():
    """A plan that used its 15 minutes is tried once more (a slow store), not 14 times like a short outage."""
    state = _states_named("drain")["PlanDrain"]
    function_timeout = TEMPLATE.functions["PlanDrainFunction"].timeout

    assert state.get("TimeoutSeconds", function_timeout) >= function_timeout
    for error in OUT_OF_TIME_ERRORS:
        rule = _retrier_for(state, error)
        assert rule is not None and rule.get("MaxAttempts", 3) <= 1, error
    assert "FinishDrain" in {catcher["Next"] for catcher in state["Catch"] if "States.ALL" in catcher["ErrorEquals"]}


def test_a_delete_failed_delete_finished_after_all_ends_deleted_and_a_failed_one_fails():
    states = _states_named("delete")
    after = states[states["FailDelete"]["Next"]]

    assert states["FailDelete"]["ResultPath"] == "$.failed"
    assert _choose(after, {"failed": {"finished": True}}) == "Deleted"
    assert _choose(after, {"failed": {}}) == "DeleteFailed"
    assert states["Deleted"]["Type"] == "Succeed" and states["DeleteFailed"]["Type"] == "Fail"
