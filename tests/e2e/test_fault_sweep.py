"""A fault at every Task state of every workflow: the operation completes or leaves the server as it was.

The states are read from ``statemachine/*.asl.json`` (Map iterations included), so a state
added later is in the sweep without touching this file. Each workflow is driven by one or more
*routes*: the branch it takes at each Choice (the Default where the route names none), and a
scenario on the local stack that makes an undisturbed execution take that route. A Task state
on a route is *forward*; every other Task state is a *rollback* state, reached only through a
``Catch``, and needs a trigger in :data:`TRIGGERS` (the meta-test fails for one without).

Each case arms one fault (``ferry.faults``, by the state's name: a Lambda step, or the host
operation the state sends) and runs its scenario:

- a forward state that retries every error (``States.ALL``) fails once: the retry absorbs it
  and the outcome is the undisturbed one;
- any other forward state fails always: the workflow's failure path runs, and the server is
  left as it was (or, where Nova's behaviour says so, in ERROR or with the work done);
- a rollback state fails once while its trigger fails the forward path: the clean-up's retry
  absorbs it, and the outcome is the trigger's.

A nested execution (a drain's ``RunMove``) is failed by failing the first state of the
workflow it starts. Every case checks that the armed state ran, that the server is in an
allowed outcome (compared field by field with a snapshot taken before), and that after the
server is deleted ``ferry audit`` finds nothing anywhere and no host keeps a file of it.
The number of states covered is printed at the end of the run (``conftest.py``).

The same routes also run undisturbed but twice over: every host operation message delivered
twice (``FERRY_LOCAL_DUPLICATE_DELIVERY``), then every Lambda step run twice with the same event
(``FERRY_LOCAL_INVOKE_TWICE``); each must end exactly as an undisturbed run, leaking nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from move_helpers import (
    CROSS_CELL_RULE,
    FLAVORS,
    SMALL,
    TINY,
    GiB,
    disabled_services,
    generation_flavors,
    host_of,
    migrations_of,
    only_hosts_enabled,
    port_bindings,
    resize_to_verify,
    root_digest,
    set_service,
)
from sqlalchemy import select

from ferry import audit, config, faults
from ferry.local.runtime import DUPLICATE_DELIVERY_ENV, INVOKE_TWICE_ENV
from ferry.store.api_models import Volume, VolumeAttachment
from ferry.store.db import api_session

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ASL_DIR = ROOT / "statemachine"
ALL_ERRORS = "States.ALL"


# --- the states, from the definitions -------------------------------------------------------------


def load_definition(workflow: str) -> dict[str, Any]:
    """``statemachine/<workflow>.asl.json`` with its template placeholders filled in (ARNs quoted, numbers not)."""
    text = re.sub(r'"\$\{(\w+)\}"', r'"\1"', (ASL_DIR / f"{workflow}.asl.json").read_text())
    return json.loads(re.sub(r"\$\{\w+\}", "0", text))


WORKFLOWS = sorted(p.name.removesuffix(".asl.json") for p in ASL_DIR.glob("*.asl.json"))


@dataclass(frozen=True)
class TaskState:
    workflow: str
    name: str
    definition: dict[str, Any] = field(compare=False, repr=False)

    @property
    def id(self) -> str:
        return f"{self.workflow}:{self.name}"

    @property
    def retries_everything(self) -> bool:
        return any(ALL_ERRORS in rule["ErrorEquals"] for rule in self.definition.get("Retry", []))

    @property
    def nested_workflow(self) -> str | None:
        """The workflow a ``states:startExecution`` Task starts, or None."""
        if not self.definition["Resource"].startswith("arn:aws:states:::states:startExecution"):
            return None
        placeholder = self.definition["Parameters"]["StateMachineArn"]  # e.g. ResizeStateMachineArn
        return re.sub(r"(?<!^)([A-Z])", r"_\1", placeholder.removesuffix("StateMachineArn")).lower()


def _states_of(machine: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, state in machine["States"].items():
        yield name, state
        if state["Type"] == "Map":
            yield from _states_of(state.get("ItemProcessor") or state["Iterator"])


# A Task that only counts an execution ending unsettled, for the operators' alarm: it changes
# nothing, its own failure ends the execution where it would have ended anyway (tested by
# tests/integration/test_not_settled_count.py), and no fault of a step leads to it on purpose.
COUNT_NOT_SETTLED = "arn:aws:states:::aws-sdk:cloudwatch:putMetricData"


def task_states() -> list[TaskState]:
    return [TaskState(workflow, name, state) for workflow in WORKFLOWS
            for name, state in _states_of(load_definition(workflow))
            if state["Type"] == "Task" and state["Resource"] != COUNT_NOT_SETTLED]


# How each workflow is driven: per route, the branch taken at each Choice that does not take its Default.
ROUTES: dict[str, dict[str, dict[str, str]]] = {
    "boot": {"boot": {}},
    "confirm_resize": {"confirm": {}},
    "delete": {"delete": {"OnAHost": "DestroyAtHost"},
               "delete-resized": {"ConfirmFirst": "ConfirmAtSource", "OnAHost": "DestroyAtHost"}},
    "drain": {"drain": {"Proceed": "MoveServers", "SlotChoice": "PrepareMove", "ConfirmChoice": "MarkConfirm"}},
    "power": {"stop": {}},
    "resize": {"resize": {"IsMoveAcrossCells": "PrepResizeAtDest"}, "resize-cross-cell": {}},
    "revert_resize": {"revert": {}, "revert-cross-cell": {"BetweenCells": "FlipToSourceCell"}},
    "volume_attachment": {"attach": {"AttachOrDetach": "AttachAtHost"}, "detach": {}},
}


def route_states(machine: dict[str, Any], route: dict[str, str]) -> list[str]:
    """The Task states an undisturbed execution taking ``route`` enters, in order."""
    entered: list[str] = []
    name: str | None = machine["StartAt"]
    while name is not None:
        state = machine["States"][name]
        if state["Type"] == "Task":
            entered.append(name)
        if state["Type"] == "Map":
            entered += route_states(state.get("ItemProcessor") or state["Iterator"], route)
        if state["Type"] == "Choice":
            name = route.get(name, state.get("Default"))
        else:
            name = state.get("Next")
    return entered


def forward_routes() -> dict[str, str]:
    """``{state id: route}``: the first route of its workflow that enters the state."""
    found: dict[str, str] = {}
    for workflow, routes in ROUTES.items():
        machine = load_definition(workflow)
        for route, choices in routes.items():
            for name in route_states(machine, choices):
                found.setdefault(f"{workflow}:{name}", route)
    return found


# A rollback state runs when its trigger fails the forward path: (route, [(point, mode, error)]).
TRIGGERS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "boot:CheckBuildCommitted": ("boot", [("FinishBuild", faults.ALWAYS, "InjectedFault")]),
    "boot:DestroyAtDest": ("boot", [("FinishBuild", faults.ALWAYS, "InjectedFault")]),
    "boot:UnbindResourcesAtDest": ("boot", [("BindResourcesAtDest", faults.ALWAYS, "InjectedFault")]),
    "boot:RescheduleBuild": ("boot", [("SpawnOnHost", faults.ONCE, "SpawnFailed")]),
    "boot:FailBuild": ("boot", [("SelectDestinations", faults.ALWAYS, "NoValidHost")]),
    "confirm_resize:RestoreVerifyResize": ("confirm", [("CheckResizeToConfirm", faults.ALWAYS, "InjectedFault")]),
    "confirm_resize:FailConfirm": ("confirm", [("ConfirmAtSource", faults.ALWAYS, "InjectedFault")]),
    "delete:FailDelete": ("delete", [("DestroyAtHost", faults.ALWAYS, "InjectedFault")]),
    "drain:RecordFailure": ("drain", [("PrepareMove", faults.ALWAYS, "InjectedFault")]),
    "drain:SettleServer": ("drain", [("AcquireSlot", faults.ALWAYS, "InjectedFault")]),
    "power:FailPowerAction": ("stop", [("SetPowerAtHost", faults.ALWAYS, "InjectedFault")]),
    "resize:RescheduleMove": ("resize-cross-cell", [("PrepCrossCellOnDestHost", faults.ONCE, "ResizeClaimFailed")]),
    "resize:DestroyOnDestHost": ("resize-cross-cell", [("CompleteMoveAcrossCells", faults.ALWAYS, "InjectedFault")]),
    "resize:FinishCrossCellRevertOnSourceHost": ("resize-cross-cell",
                                                 [("FinishCrossCellAtDest", faults.ALWAYS, "InjectedFault")]),
    "resize:RollbackTargetCell": ("resize-cross-cell", [("PrepCrossCellAtDest", faults.ALWAYS, "InjectedFault")]),
    "resize:RevertResizeOnDestHost": ("resize", [("MarkResized", faults.ALWAYS, "InjectedFault")]),
    "resize:FinishRevertOnSourceHost": ("resize", [("MarkResized", faults.ALWAYS, "InjectedFault")]),
    "resize:RollbackMove": ("resize", [("PrepResizeAtDest", faults.ALWAYS, "InjectedFault")]),
    "resize:CheckMoveCommitted": ("resize", [("MarkResized", faults.ALWAYS, "InjectedFault")]),
    "revert_resize:RestoreVerifyResize": ("revert", [("RevertAtDest", faults.ALWAYS, "HypervisorError")]),
    "revert_resize:FailRevert": ("revert", [("FinishRevertAtSource", faults.ALWAYS, "InjectedFault")]),
    "volume_attachment:CheckVolumeCommitted": ("attach", [("FinishVolumeOperation", faults.ALWAYS,
                                                            "InjectedFault")]),
    "volume_attachment:DetachAfterFailedAttach": ("attach", [("FinishVolumeOperation", faults.ALWAYS,
                                                               "InjectedFault")]),
    "volume_attachment:FailVolumeOperation": ("detach", [("DetachAtHost", faults.ALWAYS, "InjectedFault")]),
}


@dataclass(frozen=True)
class Case:
    state: TaskState
    route: str
    faults: tuple[tuple[str, str, str], ...]  # (point, mode, error) to arm
    entered: tuple[str, ...]  # "<workflow>:<state>" that must have run
    undisturbed: bool  # the outcome must be the undisturbed one

    @property
    def id(self) -> str:
        return self.state.id


def plan_case(state: TaskState, forward: dict[str, str]) -> Case:
    if state.id in forward:
        route = forward[state.id]
        if state.retries_everything:
            return Case(state, route, ((state.name, faults.ONCE, "InjectedFault"),), (state.id,), True)
        nested = state.nested_workflow
        if nested is not None:  # fail the execution it starts, at that workflow's first state
            first = load_definition(nested)["StartAt"]
            return Case(state, route, ((first, faults.ALWAYS, "InjectedFault"),), (state.id, f"{nested}:{first}"),
                        False)
        return Case(state, route, ((state.name, faults.ALWAYS, "InjectedFault"),), (state.id,), False)
    route, trigger = TRIGGERS[state.id]
    armed = (*trigger, (state.name, faults.ONCE, "InjectedFault"))
    return Case(state, route, armed, (state.id,), False)


STATES = task_states()
FORWARD = forward_routes()
CASES = [plan_case(state, FORWARD) for state in STATES if state.id in FORWARD or state.id in TRIGGERS]


def test_every_task_state_of_every_workflow_has_a_case():
    ids = [state.id for state in STATES]
    assert len(ids) == len(set(ids)), "two Task states of one workflow share a name"
    without = sorted(set(ids) - set(FORWARD) - set(TRIGGERS))
    assert not without, f"rollback states without a trigger in TRIGGERS: {without}"
    assert not set(TRIGGERS) & set(FORWARD), "a state with a trigger is on a forward route"
    assert set(TRIGGERS) <= set(ids), f"triggers of states that do not exist: {sorted(set(TRIGGERS) - set(ids))}"
    for _route, trigger in TRIGGERS.values():
        for point, _mode, _error in trigger:
            assert any(state.name == point for state in STATES), point
    assert [case.id for case in CASES] == ids


def test_a_fault_is_armed_by_the_state_name_its_step_checks():
    """A Lambda Task state's name is the name its function checks (``step_handler(..., "<name>")``)."""
    checked = set()
    for app in (ROOT / "functions").glob("*/app.py"):
        checked |= set(re.findall(r'step_handler\(\s*[\w.]+,\s*"(\w+)"', app.read_text()))
    lambdas = {s.name for s in STATES if not s.definition["Resource"].startswith("arn:aws:states:::")}
    assert lambdas <= checked, sorted(lambdas - checked)
    hosts = {s.name for s in STATES if s.definition["Resource"].startswith("arn:aws:states:::sqs:")}
    for state in STATES:
        if state.name in hosts:  # the agent reads the state's name from the operation id it is sent
            operation_id = state.definition["Parameters"]["MessageBody"]["operation_id.$"]
            assert f"/{state.name}/" in operation_id, state.id


# --- the scenarios ------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """What can be seen of one server: the API's view, placement, its files on every host, ports, volumes."""

    status: str | None
    host: str | None
    flavor: str | None
    power_state: int | None
    allocations: dict[str, Any]
    files: set[tuple[str, str]]
    bindings: set[tuple[str, str]]
    volumes: list[str]
    digest: str


def take_snapshot(local_stack, servers, records, server_id: str) -> Snapshot:
    shown = servers.show(server_id)
    files = {(host, entry.name) for host in local_stack.hosts for entry in local_stack.instances_dir(host).glob(
        f"{server_id}*")}
    held = {"instance": records.allocations(server_id)}
    for cell in sorted(set(local_stack.hosts.values())):
        for migration in migrations_of(server_id, cell):
            if allocations := records.allocations(migration.uuid):
                held[migration.uuid] = allocations
    digest = ""
    if shown is not None and host_of(shown):
        root = records.instance_dir(host_of(shown), server_id) / "disk"
        if root.exists():
            digest = root_digest(root, FLAVORS[TINY]["DISK_GB"] * GiB)
    return Snapshot(
        status=shown and shown["status"], host=shown and host_of(shown),
        flavor=shown and shown["flavor"]["original_name"], power_state=shown and shown["OS-EXT-STS:power_state"],
        allocations=held if shown else {}, files=files, bindings=port_bindings(server_id),
        volumes=sorted(v["id"] for v in shown["os-extended-volumes:volumes_attached"]) if shown else [],
        digest=digest)


@dataclass
class Run:
    """One case on the local stack: its server, what it looked like before, and what to clean up."""

    local_stack: Any
    servers: Any
    records: Any
    cleanup: ExitStack
    server_id: str = ""
    host: str = ""
    volume_id: str = ""
    drain_id: str = ""

    def boot(self, host: str | None = None) -> dict[str, Any]:
        with ExitStack() as steer:
            if host is not None:
                steer.enter_context(only_hosts_enabled(self.local_stack, {host}))
            server = self.servers.boot(flavor=TINY, name="fault-sweep")
        self.server_id, self.host = server["id"], host_of(server)
        return server

    def cross_cell_flavor(self) -> str:
        self.cleanup.enter_context(self.local_stack.override_policy({CROSS_CELL_RULE: "admin_or_owner"}))
        flavors = self.cleanup.enter_context(generation_flavors(self.local_stack))
        [other] = sorted(set(self.local_stack.hosts.values()) - {self.local_stack.hosts[self.host]})
        return flavors[other]

    def new_volume(self) -> str:
        self.volume_id = str(uuid.uuid4())
        with api_session() as session:
            session.add(Volume(id=self.volume_id, project_id=self.local_stack.seeded.identities["demo"].project_id,
                               size_gb=1, path=str(self.local_stack.state_dir / "volumes" / self.volume_id)))
        return self.volume_id

    def attached_hosts(self) -> set[str]:
        with api_session() as session:
            return set(session.scalars(select(VolumeAttachment.host).where(
                VolumeAttachment.instance_uuid == self.server_id, VolumeAttachment.volume_id == self.volume_id)))

    def action(self, body: dict[str, Any]) -> None:
        response = self.servers.action(self.server_id, body)
        assert response.status_code in (202, 204), response.text


@dataclass(frozen=True)
class Scenario:
    """How a route is driven: ``prepare`` sets the server up, ``act`` starts the workflow, ``done`` tells
    the undisturbed outcome, ``failed`` the outcomes allowed when the workflow fails."""

    prepare: Callable[[Run], None]
    act: Callable[[Run], None]
    done: Callable[[Run, Snapshot, Snapshot], bool]
    failed: frozenset[str] = frozenset({"before"})


def _boot_only(run: Run) -> None:
    response = run.servers.create({"server": {"name": "fault-sweep", "flavorRef": TINY, "networks": "auto",
                                              "imageRef": run.local_stack.seeded.image["id"]}})
    assert response.status_code == 202, response.text
    run.server_id = response.json()["server"]["id"]


def _resized(cross_cell: bool) -> Callable[[Run], None]:
    def prepare(run: Run) -> None:
        run.boot()
        flavor = run.cross_cell_flavor() if cross_cell else SMALL
        resize_to_verify(run.servers, run.server_id, {"resize": {"flavorRef": flavor}})
    return prepare


def _resize(cross_cell: bool) -> Callable[[Run], None]:
    def act(run: Run) -> None:
        run.action({"resize": {"flavorRef": run.cross_cell_flavor() if cross_cell else SMALL}})
    return act


def _attached(run: Run) -> None:
    run.boot()
    _attach(run)
    run.local_stack.wait_for(lambda: run.attached_hosts() == {run.host})
    run.servers.wait_for_status(run.server_id, "ACTIVE")


def _attach(run: Run) -> None:
    volume = run.volume_id or run.new_volume()
    response = run.servers.api("demo").post(f"/servers/{run.server_id}/os-volume_attachments",
                                            json={"volumeAttachment": {"volumeId": volume}})
    assert response.status_code == 200, response.text


def _detach(run: Run) -> None:
    response = run.servers.api("demo").delete(f"/servers/{run.server_id}/os-volume_attachments/{run.volume_id}")
    assert response.status_code == 202, response.text


def _drained(run: Run) -> None:
    run.boot(host=sorted(run.local_stack.hosts)[0])


def _drain(run: Run) -> None:
    answer = run.local_stack.session("admin").post("/ferry/drains", json={"drain": {"host": run.host, "retries": 0}})
    assert answer.status_code in (200, 202), answer.text
    run.drain_id = answer.json()["drain"]["id"]
    run.cleanup.callback(_enable_all, run.local_stack)


def _enable_all(local_stack) -> None:
    admin = local_stack.session("admin")
    for host, disabled in disabled_services(admin).items():
        if disabled:
            set_service(admin, host, disabled=False)


def _moved(before: Snapshot, after: Snapshot) -> bool:
    return after.host != before.host and after.digest == before.digest


SCENARIOS: dict[str, Scenario] = {
    "boot": Scenario(lambda run: None, _boot_only, lambda run, b, a: a.status == "ACTIVE",
                     failed=frozenset({"error"})),
    "resize": Scenario(Run.boot, _resize(False),
                       lambda run, b, a: a.status == "VERIFY_RESIZE" and a.flavor == "ferry.small" and _moved(b, a)),
    "resize-cross-cell": Scenario(Run.boot, _resize(True),
                                  lambda run, b, a: a.status == "VERIFY_RESIZE" and _moved(b, a)),
    "confirm": Scenario(_resized(False), lambda run: run.action({"confirmResize": None}),
                        lambda run, b, a: a.status == "ACTIVE" and a.host == b.host and a.flavor == b.flavor,
                        failed=frozenset({"before", "done", "error"})),
    "revert": Scenario(_resized(False), lambda run: run.action({"revertResize": None}),
                       lambda run, b, a: a.status == "ACTIVE" and a.flavor == "ferry.tiny" and _moved(b, a),
                       failed=frozenset({"before", "error"})),
    "revert-cross-cell": Scenario(_resized(True), lambda run: run.action({"revertResize": None}),
                                  lambda run, b, a: a.status == "ACTIVE" and a.flavor == "ferry.tiny"
                                  and _moved(b, a), failed=frozenset({"before", "error"})),
    "delete": Scenario(Run.boot, lambda run: run.servers.delete(run.server_id),
                       lambda run, b, a: a.status is None, failed=frozenset({"error"})),
    "delete-resized": Scenario(_resized(False), lambda run: run.servers.delete(run.server_id),
                               lambda run, b, a: a.status is None, failed=frozenset({"error"})),
    "stop": Scenario(Run.boot, lambda run: run.action({"os-stop": None}),
                     lambda run, b, a: a.status == "SHUTOFF" and a.power_state == 4),
    "attach": Scenario(Run.boot, _attach, lambda run, b, a: a.volumes == [run.volume_id]),
    "detach": Scenario(_attached, _detach, lambda run, b, a: a.volumes == []),
    # A drain whose confirm fails leaves the moved server waiting in VERIFY_RESIZE (docs/drains.md).
    "drain": Scenario(_drained, _drain, lambda run, b, a: a.status == "ACTIVE" and _moved(b, a),
                      failed=frozenset({"before", "awaiting confirm"})),
}


def test_every_route_has_a_scenario():
    assert {route for routes in ROUTES.values() for route in routes} == set(SCENARIOS)


# --- running a case -------------------------------------------------------------------------------------


def _state_machines() -> dict[str, str]:
    settings = config.get()
    return {workflow: getattr(settings, f"{workflow}_state_machine_arn") for workflow in WORKFLOWS}


def executions_since(local_stack, since: dt.datetime, status: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The executions of every workflow started since ``since`` (only those in ``status`` when given)."""
    sfn = local_stack.client("stepfunctions")
    found = []
    for workflow, arn in _state_machines().items():
        pages = sfn.get_paginator("list_executions").paginate(
            stateMachineArn=arn, **({"statusFilter": status} if status else {}))
        for page in pages:
            found += [(workflow, e) for e in page["executions"] if e["startDate"] >= since]
    return found


def entered_states(local_stack, executions: list[tuple[str, dict[str, Any]]]) -> set[str]:
    sfn, entered = local_stack.client("stepfunctions"), set()
    for workflow, execution in executions:
        pages = sfn.get_paginator("get_execution_history").paginate(executionArn=execution["executionArn"])
        for page in pages:
            entered |= {f"{workflow}:{e['stateEnteredEventDetails']['name']}" for e in page["events"]
                        if "stateEnteredEventDetails" in e}
    return entered


def wait_until_settled(local_stack, since: dt.datetime) -> list[tuple[str, dict[str, Any]]]:
    """Every execution started since ``since``, once none of them runs any more."""

    def settled() -> list[tuple[str, dict[str, Any]]] | None:
        if executions_since(local_stack, since, "RUNNING"):  # the short list, while any runs
            return None
        executions = executions_since(local_stack, since)
        return executions if executions and all(e["status"] != "RUNNING" for _w, e in executions) else None

    return local_stack.wait_for(settled, timeout=300, interval=0.2)


def outcome_of(scenario: Scenario, run: Run, before: Snapshot, after: Snapshot) -> str:
    if after.status == "ERROR":
        return "error"
    if after == before:
        return "before"
    if scenario.done(run, before, after):
        return "done"
    if after.status == "VERIFY_RESIZE" and before.status != "VERIFY_RESIZE" and after.host != before.host:
        return "awaiting confirm"
    return "neither"


@pytest.fixture
def run(local_stack, servers, records) -> Iterator[Run]:
    with ExitStack() as cleanup:
        cleanup.callback(faults.disarm_all)
        yield Run(local_stack, servers, records, cleanup)


def prepared(run: Run, scenario: Scenario) -> Snapshot:
    """Set the scenario's server up; what it looks like once settled (nothing yet for a boot)."""
    scenario.prepare(run)
    if not run.server_id:
        return Snapshot(None, None, None, None, {}, set(), set(), [], "")
    run.servers.wait_for_status(run.server_id, run.servers.show(run.server_id)["status"])
    return take_snapshot(run.local_stack, run.servers, run.records, run.server_id)


def acted(run: Run, scenario: Scenario) -> set[str]:
    """Start the scenario's workflow and wait until every execution it led to ended; the states they entered."""
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    scenario.act(run)
    executions = wait_until_settled(run.local_stack, since)
    if run.drain_id:  # the drain's own execution ends once its record is final
        run.local_stack.wait_for(lambda: run.local_stack.session("admin").get(f"/ferry/drains/{run.drain_id}")
                                 .json()["drain"]["status"] in {"completed", "failed", "cancelled"}, timeout=120)
    return entered_states(run.local_stack, executions)


def settled(run: Run) -> Snapshot:
    if run.server_id and (shown := run.servers.show(run.server_id)) is not None:
        run.servers.wait_for_status(run.server_id, shown["status"], timeout=60)
    return take_snapshot(run.local_stack, run.servers, run.records, run.server_id)


def assert_nothing_left(run: Run) -> None:
    """Whatever happened, deleting the server leaves nothing behind anywhere."""
    run.servers.delete_all()
    for host in run.local_stack.hosts:
        assert not list(run.local_stack.instances_dir(host).glob(f"{run.server_id}*")), host
    if run.server_id:
        assert run.records.allocations(run.server_id) == {}
    run.cleanup.close()
    audit.assert_consistent(grace_seconds=0)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_fault_at_the_state_loses_nothing(run, case):
    scenario = SCENARIOS[case.route]
    before = prepared(run, scenario)
    for point, mode, error in case.faults:
        faults.arm(point, mode, error)

    entered = acted(run, scenario)
    faults.disarm_all()

    assert set(case.entered) <= entered, f"not run: {sorted(set(case.entered) - entered)}"
    after = settled(run)
    outcome = outcome_of(scenario, run, before, after)
    allowed = {"done"} if case.undisturbed else scenario.failed
    assert outcome in allowed, f"{outcome}: before {before}, after {after}"
    if outcome != "error" and after.digest and before.digest:
        assert after.digest == before.digest
    assert_nothing_left(run)


# --- at-least-once: every route with each host message delivered twice, each Lambda step run twice ----


@pytest.mark.parametrize("switch", [DUPLICATE_DELIVERY_ENV, INVOKE_TWICE_ENV], ids=["messages-twice", "steps-twice"])
@pytest.mark.parametrize("route", sorted(SCENARIOS))
def test_a_route_run_twice_over_ends_as_an_undisturbed_run(run, monkeypatch, route, switch):
    """SQS may deliver a message twice and Step Functions may run a step again: the outcome is the same."""
    scenario = SCENARIOS[route]
    before = prepared(run, scenario)
    monkeypatch.setenv(switch, "1")

    acted(run, scenario)
    monkeypatch.delenv(switch)

    after = settled(run)
    assert outcome_of(scenario, run, before, after) == "done", f"before {before}, after {after}"
    if after.digest and before.digest:
        assert after.digest == before.digest
    assert_nothing_left(run)
