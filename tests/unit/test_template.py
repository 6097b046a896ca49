"""template.yaml against the code: cfn-lint, handlers, state machine files and settings agree.

The template is the single source of truth for function folders, state machine definitions and
the AWS resource names the code reads from its environment; these tests fail when either side
drifts from the other.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import cfnlint.api
import pytest

from ferry import config, deliveries, drains, images, protocol
from ferry.local.template import load_template, resolve
from ferry.workflows import auto_confirm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_PATH = ROOT / "template.yaml"
TEMPLATE = resolve(TEMPLATE_PATH)

FUNCTION_DIRS = sorted(p for p in (ROOT / "functions").iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
ASL_FILES = sorted((ROOT / "statemachine").glob("*.asl.json"))
PLACEHOLDER = re.compile(r"\$\{([^}]+)\}")

# Settings whose names end like this name an AWS resource (or where one lives), so the template,
# which creates the resources, must hand them to the functions. Tunables (ratios, multipliers,
# flags) keep working defaults and need not be in the template.
RESOURCE_SETTING_SUFFIXES = ("_ARN", "_URL", "_BUCKET", "_BUS", "_TABLE", "_PREFIX")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _module_level_names(source: str) -> set[str]:
    """Names bound at the top level of a module (functions, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _settings_read_by_config() -> set[str]:
    """Every FERRY_* variable name ferry/config.py mentions (it reads each with os.environ)."""
    tree = ast.parse(Path(config.__file__).read_text())
    constants = (node.value for node in ast.walk(tree) if isinstance(node, ast.Constant))
    return {value for value in constants if isinstance(value, str) and re.fullmatch(r"FERRY_[A-Z0-9_]+", value)}


def _settings_set_by_template() -> set[str]:
    """Every FERRY_* variable the template sets, in Globals or on any function."""
    return {name for f in TEMPLATE.functions.values() for name in f.environment if name.startswith("FERRY_")}


def test_functions_run_outside_a_vpc_unless_given_subnets_and_then_all_in_them():
    assert {lid: f.vpc_config for lid, f in TEMPLATE.functions.items() if f.vpc_config is not None} == {}

    placed = resolve(TEMPLATE_PATH, parameters={"FunctionSubnetIds": "subnet-1,subnet-2",
                                                "FunctionSecurityGroupIds": "sg-1"})

    assert {lid: f.vpc_config for lid, f in placed.functions.items()
            if f.vpc_config != {"SubnetIds": ["subnet-1", "subnet-2"], "SecurityGroupIds": ["sg-1"]}} == {}


def _rule_holds(node, parameters: dict[str, list[str]]) -> bool:
    """A rule's condition or assertion, as CloudFormation evaluates it (an empty list parameter is [""])."""
    (function, argument), = node.items()
    if function == "Fn::Not":
        return not _rule_holds(argument[0], parameters)
    if function == "Fn::Contains":
        listed, wanted = argument
        return wanted in parameters[listed["Ref"]]
    raise AssertionError(f"no evaluation of {function} here")


@pytest.mark.parametrize(("subnets", "groups", "accepted"), [
    ([""], [""], True), (["subnet-1"], ["sg-1"], True), (["subnet-1", "subnet-2"], [""], False),
])
def test_subnets_for_the_functions_are_refused_without_security_groups(subnets, groups, accepted):
    rule = RAW["Rules"]["FunctionSecurityGroupsWithSubnets"]
    parameters = {"FunctionSubnetIds": subnets, "FunctionSecurityGroupIds": groups}

    applies = _rule_holds(rule["RuleCondition"], parameters)

    assert (not applies or all(_rule_holds(a["Assert"], parameters) for a in rule["Assertions"])) is accepted


def test_every_function_has_the_core_layer_and_the_policy_layer_when_one_is_given():
    core = TEMPLATE.functions["ApiFunction"].layers
    assert len(core) == 1
    assert {lid: f.layers for lid, f in TEMPLATE.functions.items() if f.layers != core} == {}

    policy_layer = "arn:aws:lambda:us-east-1:123456789012:layer:ferry-policy:3"
    given = resolve(TEMPLATE_PATH, parameters={"PolicyLayerArn": policy_layer})

    assert {lid: f.layers for lid, f in given.functions.items() if f.layers != (*core, policy_layer)} == {}


def test_template_passes_cfn_lint():
    matches = cfnlint.api.lint_file(TEMPLATE_PATH)

    assert [str(m) for m in matches] == []


def test_function_folders_and_definition_files_exist():
    assert FUNCTION_DIRS, "functions/ holds no handler folder"
    assert ASL_FILES, "statemachine/ holds no *.asl.json"


@pytest.mark.parametrize("folder", FUNCTION_DIRS, ids=_rel)
def test_function_folder_is_the_code_of_exactly_one_function(folder):
    users = [lid for lid, f in TEMPLATE.functions.items() if f.code_dir == folder]

    assert len(users) == 1, f"{_rel(folder)} is the CodeUri of {users or 'no function'}"


@pytest.mark.parametrize("logical_id", sorted(TEMPLATE.functions))
def test_function_code_uri_holds_its_handler(logical_id):
    function = TEMPLATE.functions[logical_id]

    assert function.code_dir.parent == ROOT / "functions", f"{logical_id}: CodeUri must be functions/<step>/"
    assert function.handler == "app.handler", f"{logical_id}: Handler must be app.handler"
    assert function.module_path.is_file(), f"{logical_id}: {function.module_path} does not exist"
    assert function.handler_attribute in _module_level_names(function.module_path.read_text()), (
        f"{logical_id}: {_rel(function.module_path)} has no module-level {function.handler_attribute}"
    )


def test_each_python_layer_builds_with_the_package_on_lambdas_import_path():
    # A python BuildMethod puts what ContentUri holds into the layer's python/ folder, which Lambda
    # puts on the import path: the package and its requirements.txt are at ContentUri's top.
    layers = {lid: r for lid, r in load_template(TEMPLATE_PATH)["Resources"].items()
              if r["Type"] == "AWS::Serverless::LayerVersion"}
    assert layers, "the template has no layer"
    for logical_id, layer in layers.items():
        assert str(layer["Metadata"]["BuildMethod"]).startswith("python"), logical_id
        content = ROOT / layer["Properties"]["ContentUri"]
        assert (content / "ferry" / "__init__.py").is_file(), f"{logical_id}: no ferry package at {content}"
        assert (content / "requirements.txt").is_file(), f"{logical_id}: no requirements.txt at {content}"


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_definition_file_is_used_by_a_state_machine(asl_file):
    users = [lid for lid, m in TEMPLATE.state_machines.items() if m.definition_uri == asl_file]

    assert users, f"{_rel(asl_file)} is not the DefinitionUri of any state machine"


@pytest.mark.parametrize("logical_id", sorted(TEMPLATE.state_machines))
def test_state_machine_definition_exists_and_its_placeholders_match_its_substitutions(logical_id):
    machine = TEMPLATE.state_machines[logical_id]
    assert machine.definition_uri is not None and machine.definition_uri.is_file(), (
        f"{logical_id}: DefinitionUri {machine.definition_uri} does not exist"
    )

    placeholders = set(PLACEHOLDER.findall(machine.raw_definition()))

    assert placeholders == set(machine.substitutions), (
        f"{logical_id}: used but not substituted {sorted(placeholders - set(machine.substitutions))}, "
        f"substituted but not used {sorted(set(machine.substitutions) - placeholders)}"
    )


def test_every_resource_setting_the_code_reads_is_set_by_the_template():
    resource_settings = {name for name in _settings_read_by_config() if name.endswith(RESOURCE_SETTING_SUFFIXES)}

    assert resource_settings - _settings_set_by_template() == set()


def test_every_setting_the_template_sets_is_read_by_the_code():
    assert _settings_set_by_template() - _settings_read_by_config() == set()


# The functions that record drains (refusing a callback_url without the callback secret) or
# announce them (signing callbacks): the API, the webhook and BeginDrain record drains, and finish
# one whose workflow ended; PlanDrain announces drain.start, FinishDrain the end.
SIGNS_DRAIN_CALLBACKS = ("ApiFunction", "DrainWebhookFunction", "BeginDrainFunction", "PlanDrainFunction",
                         "FinishDrainFunction")


@pytest.mark.parametrize("logical_id", SIGNS_DRAIN_CALLBACKS)
def test_functions_that_sign_drain_callbacks_get_the_callback_secret(logical_id):
    environment = TEMPLATE.functions[logical_id].environment

    assert RAW["Resources"][logical_id]["Properties"]["Environment"]["Variables"]["FERRY_CALLBACK_SECRET"] == {
        "Ref": "DrainCallbackSecret"}
    assert "FERRY_CALLBACK_ALLOW_PRIVATE" in environment


def test_only_the_webhook_function_gets_the_webhook_secret():
    """Whoever holds it starts drains as an admin: the functions that only sign callbacks never get it."""
    holders = [lid for lid, function in TEMPLATE.functions.items() if "FERRY_WEBHOOK_SECRET" in function.environment]

    assert holders == ["DrainWebhookFunction"]
    assert RAW["Resources"]["DrainWebhookFunction"]["Properties"]["Environment"]["Variables"][
        "FERRY_WEBHOOK_SECRET"] == {"Ref": "DrainWebhookSecret"}


def test_the_callback_secret_is_a_parameter_of_its_own_hidden_and_empty_by_default():
    parameters = RAW["Parameters"]

    assert parameters["DrainCallbackSecret"]["NoEcho"] is True and parameters["DrainCallbackSecret"]["Default"] == ""
    assert parameters["DrainCallbackAllowPrivateAddresses"]["Default"] == "false"
    assert set(parameters["DrainCallbackAllowPrivateAddresses"]["AllowedValues"]) == {"true", "false"}


# The longest a Lambda function may run.
LAMBDA_MAX_TIMEOUT = 900
# PlanDrain runs the scheduler once per server; docs/benchmarks.md measures one placement at 42-65 ms
# at the median and up to some 104 ms at p95 (100,000 hosts, PostgreSQL).
PLAN_SECONDS_PER_SERVER = 0.15


# The memory from which Lambda gives a function one whole vCPU (less gets a share of one).
ONE_VCPU_MB = 1769
# How long API Gateway waits for its integration or authorizer.
API_GATEWAY_LIMIT_SECONDS = 29


def test_plan_drain_has_time_to_plan_the_largest_drain():
    function = TEMPLATE.functions["PlanDrainFunction"]

    # The figure is measured on a whole core: less memory would stretch it.
    assert function.memory_size >= ONE_VCPU_MB
    assert drains.MAX_SERVERS * PLAN_SECONDS_PER_SERVER <= function.timeout <= LAMBDA_MAX_TIMEOUT


@pytest.mark.parametrize("logical_id", ["ApiFunction", "AuthorizerFunction", "DrainWebhookFunction"])
def test_functions_behind_api_gateway_end_before_it_gives_up(logical_id):
    assert TEMPLATE.functions[logical_id].timeout < API_GATEWAY_LIMIT_SECONDS


def test_no_function_asks_for_more_time_than_lambda_gives():
    assert {lid: f.timeout for lid, f in TEMPLATE.functions.items() if not 1 <= f.timeout <= LAMBDA_MAX_TIMEOUT} == {}


def test_the_image_bucket_expires_transfers_where_the_code_writes_them_and_aborts_open_uploads():
    rules = load_template(TEMPLATE_PATH)["Resources"]["ImageBucket"]["Properties"]["LifecycleConfiguration"]["Rules"]

    assert any(r.get("Prefix") == images.TRANSFER_PREFIX and r.get("ExpirationInDays") for r in rules)
    assert any("AbortIncompleteMultipartUpload" in r and not r.get("Prefix") for r in rules)


def _agent_policy() -> dict:
    return load_template(TEMPLATE_PATH)["Resources"]["HostAgentPolicy"]["Properties"]["PolicyDocument"]


def test_the_host_agent_policy_grants_what_the_agent_guide_lists():
    # docs/host-agent.md lists, for operators, the actions an agent's identity needs
    guide = (ROOT / "docs" / "host-agent.md").read_text().split("### AWS permissions", 1)[1].split("\n### ", 1)[0]
    listed = {action for row in guide.splitlines() if row.startswith("| ") and ":" in row
              for action in re.findall(r"`([a-z0-9]+:[A-Za-z]+)`", row.split("|")[2])}
    granted: set[str] = set()
    for statement in _agent_policy()["Statement"]:
        if statement["Effect"] == "Allow":
            actions = statement["Action"]
            granted.update([actions] if isinstance(actions, str) else actions)

    assert listed and listed == granted


def test_the_host_agent_policy_covers_the_host_queues_and_keeps_the_reports_queue_send_only():
    statements = {s["Sid"]: s for s in _agent_policy()["Statement"]}

    own = statements["OwnQueue"]["Resource"]["Fn::Sub"]
    assert own == "arn:${AWS::Partition}:sqs:${AWS::Region}:${AWS::AccountId}:" + _host_queue_prefix_reference() + "*"
    denied = statements["ReportsAreSendOnly"]
    assert denied["Effect"] == "Deny" and "sqs:ReceiveMessage" in denied["Action"]
    assert {r["Fn::GetAtt"][0] for r in denied["Resource"]} == {"HostReportsQueue", "HostReportsDeadLetterQueue"}
    assert TEMPLATE.outputs["HostAgentPolicyArn"].startswith("arn:aws:iam::")


def test_the_delivery_table_keys_and_expires_records_by_the_attributes_the_code_writes():
    table = load_template(TEMPLATE_PATH)["Resources"]["IdempotencyTable"]["Properties"]

    assert [k["AttributeName"] for k in table["KeySchema"]] == [deliveries.KEY_ATTRIBUTE]
    assert {a["AttributeName"]: a["AttributeType"] for a in table["AttributeDefinitions"]} == {
        deliveries.KEY_ATTRIBUTE: "S"}
    assert table["TimeToLiveSpecification"] == {"AttributeName": deliveries.EXPIRY_ATTRIBUTE, "Enabled": True}


# --- names written once: the host queue prefix, the state machines' names -------------------------

RAW = load_template(TEMPLATE_PATH)
SAM_TYPES_WITH_ROLES = {"AWS::Serverless::Function", "AWS::Serverless::StateMachine"}


def _host_queue_prefix_definition() -> tuple[str, str]:
    """Where the prefix the functions get is defined: (logical id, attribute) of the resource holding it.

    Fails when the template writes the prefix into Globals instead of taking it from one definition.
    """
    value = RAW["Globals"]["Function"]["Environment"]["Variables"]["FERRY_HOST_QUEUE_PREFIX"]
    assert isinstance(value, dict) and "Fn::GetAtt" in value, (
        f"Globals write FERRY_HOST_QUEUE_PREFIX out ({value}) instead of taking it from its one definition"
    )
    logical_id, attribute = value["Fn::GetAtt"]
    return logical_id, attribute


def _host_queue_prefix_reference() -> str:
    """How a !Sub names the prefix: ``${<definition>.<attribute>}``."""
    logical_id, attribute = _host_queue_prefix_definition()
    return f"${{{logical_id}.{attribute}}}"


def _host_queue_prefix_as_written() -> str:
    """The prefix's text where it is defined (``ferry-${Stage}-host-``), following the references to it."""
    node = RAW["Globals"]["Function"]["Environment"]["Variables"]["FERRY_HOST_QUEUE_PREFIX"]
    while "Fn::GetAtt" in node:
        logical_id, attribute = node["Fn::GetAtt"]
        node = RAW["Resources"][logical_id]["Properties"][attribute]
    return node["Fn::Sub"]


def _strings(node, path=()):
    """Every string in ``node`` (keys excluded) with the path of keys and indexes to it."""
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _strings(value, (*path, index))


def _policy_strings():
    """(logical id, text) of every string in an IAM policy: SAM ``Policies`` and IAM ``PolicyDocument``s."""
    for logical_id, resource in RAW["Resources"].items():
        properties = resource.get("Properties") or {}
        for key in ("Policies", "PolicyDocument"):
            for _, text in _strings(properties.get(key)):
                yield logical_id, text


def _granted_strings(logical_id: str):
    """(path, text) of every string in a function's ``Policies``, and in the documents of the
    managed policies it attaches by reference."""
    policies = RAW["Resources"][logical_id]["Properties"].get("Policies") or []
    yield from _strings(policies)
    for item in policies:
        managed = RAW["Resources"].get(item.get("Ref", "")) if isinstance(item, dict) else None
        if managed is not None and managed["Type"] == "AWS::IAM::ManagedPolicy":
            yield from _strings(managed["Properties"]["PolicyDocument"])


def _referenced_resources(node) -> set[str]:
    """The resources a property value names through Ref, GetAtt or a !Sub variable."""
    names: set[str] = set()
    if isinstance(node, list):
        for item in node:
            names |= _referenced_resources(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "Ref" and isinstance(value, str):
                names.add(value)
            elif key == "Fn::GetAtt":
                names.add(value[0] if isinstance(value, list) else value.split(".", 1)[0])
            elif key == "Fn::Sub":
                text = value[0] if isinstance(value, list) else value
                names |= {v.split(".", 1)[0] for v in PLACEHOLDER.findall(text)}
                names |= _referenced_resources(value[1:] if isinstance(value, list) else [])
            else:
                names |= _referenced_resources(value)
    return names & set(RAW["Resources"])


def _holder(logical_id: str, path: tuple) -> str:
    """The resource SAM puts a property in: a function's or state machine's Policies go to its role."""
    if RAW["Resources"][logical_id]["Type"] in SAM_TYPES_WITH_ROLES and path[:1] == ("Policies",):
        return logical_id + "Role"
    return logical_id


def _dependencies() -> dict[str, set[str]]:
    """Which resource waits for which once SAM has transformed the template.

    cfn-lint's circular-dependency check (E3004) skips every cycle through an AWS::Serverless::*
    resource, so this models what SAM makes of them: a function or state machine waits for its
    role, the role holds the Policies (and so waits for what they name), and an API whose routes
    run a function waits for that function.
    """
    graph: dict[str, set[str]] = {}
    function_globals = RAW["Globals"]["Function"]
    for logical_id, resource in RAW["Resources"].items():
        properties = dict(resource.get("Properties") or {})
        depends_on = resource.get("DependsOn") or []
        graph.setdefault(logical_id, set()).update([depends_on] if isinstance(depends_on, str) else depends_on)
        if resource["Type"] in SAM_TYPES_WITH_ROLES:
            role = logical_id + "Role"
            graph[logical_id].add(role)
            graph.setdefault(role, set()).update(_referenced_resources(properties.pop("Policies", [])))
        for event in (properties.pop("Events", None) or {}).values():
            for api in _referenced_resources((event.get("Properties") or {}).get("RestApiId")):
                graph.setdefault(api, set()).add(logical_id)
        if resource["Type"] == "AWS::Serverless::Function":
            graph[logical_id] |= _referenced_resources(function_globals)
        graph[logical_id] |= _referenced_resources(properties)
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def test_the_host_queue_prefix_is_written_once():
    prefix = _host_queue_prefix_as_written()
    sections = {"Globals": RAW["Globals"], **{lid: r.get("Properties") for lid, r in RAW["Resources"].items()}}

    # The reports queues' names start with the prefix too (hence the agent policy's Deny): taken from it.
    written = [(where, path) for where, section in sections.items()
               for path, text in _strings(section) if prefix in text]

    assert len(written) == 1, f"{prefix} is written {len(written)} times: {written}"
    assert written == [(_host_queue_prefix_definition()[0], ("Value", "Fn::Sub"))]


def test_no_policy_writes_out_the_host_queue_prefix():
    prefix = _host_queue_prefix_as_written()
    policies = list(_policy_strings())

    assert [(lid, text) for lid, text in policies if prefix in text] == []
    assert sum(_host_queue_prefix_reference() in text for _, text in policies) >= 2, "no policy names the host queues"


@pytest.mark.parametrize(("output", "variable"), [
    ("HostQueuePrefix", "FERRY_HOST_QUEUE_PREFIX"),
    ("HostReportsQueueUrl", "FERRY_HOST_REPORTS_QUEUE_URL"),
    ("ImageBucketName", "FERRY_IMAGE_BUCKET"),
    ("MetricsNamespace", "POWERTOOLS_METRICS_NAMESPACE"),
])
@pytest.mark.parametrize("stage", ["local", "prod"])
def test_an_output_gives_operators_what_the_functions_are_set_to(output, variable, stage):
    """What a host agent (or ferry audit) must be started with is an output of the stack."""
    model = TEMPLATE if stage == TEMPLATE.stage else resolve(TEMPLATE_PATH, stage=stage)

    assert RAW["Outputs"].get(output, {}).get("Description"), f"no output {output} with a Description"
    assert {f.environment[variable] for f in model.functions.values()} == {model.outputs[output]}


def test_the_host_queue_prefix_output_follows_the_stage():
    assert resolve(TEMPLATE_PATH, stage="prod").outputs["HostQueuePrefix"] == "ferry-prod-host-"


def test_the_template_has_no_circular_dependency_once_sam_gives_functions_and_state_machines_roles():
    graph = _dependencies()

    assert [lid for lid in graph if any(_reaches(graph, dep, lid) for dep in graph[lid])] == []


def test_state_machines_are_named_by_reference_except_where_a_reference_would_be_circular():
    """A literal name stays only where the state machine waits for its holder (its own role, say)."""
    graph = _dependencies()
    machines = {lid: r["Properties"]["Name"]["Fn::Sub"] for lid, r in RAW["Resources"].items()
                if r["Type"] == "AWS::Serverless::StateMachine"}
    literals = {lid: re.compile(re.escape(name) + r"(?![\w-])") for lid, name in machines.items()}

    written = [(_holder(lid, path), machine)
               for lid, resource in RAW["Resources"].items()
               for path, text in _strings(resource.get("Properties"))
               for machine, literal in literals.items()
               if literal.search(text) and (lid, path) != (machine, ("Name", "Fn::Sub"))]

    assert [(holder, machine) for holder, machine in written if not _reaches(graph, machine, holder)] == []


# The functions that may undo a move or confirm a drain accepted and never started: RecordFailure and
# FinishDrain, and the API, the drain webhook and BeginDrain, which finish a drain whose workflow ended
# (one of the same hosts, for the last two). Each asks
# Step Functions whether the move's workflow runs first, so it needs the three machines' ARNs and
# the right to describe their executions; without an ARN Ferry takes the workflow as not running.
UNDOES_DRAIN_MOVES = ("RecordFailureFunction", "FinishDrainFunction", "ApiFunction", "DrainWebhookFunction",
                      "BeginDrainFunction", "PrepareMoveFunction")
MOVE_MACHINES = {"FERRY_RESIZE_STATE_MACHINE_ARN": "ResizeStateMachine",
                 "FERRY_CONFIRM_RESIZE_STATE_MACHINE_ARN": "ConfirmResizeStateMachine",
                 "FERRY_REVERT_RESIZE_STATE_MACHINE_ARN": "RevertResizeStateMachine"}


@pytest.mark.parametrize("logical_id", UNDOES_DRAIN_MOVES)
def test_a_function_that_undoes_a_drains_moves_can_tell_whether_their_workflows_run(logical_id):
    environment = TEMPLATE.functions[logical_id].environment
    described = {text for _path, text in _granted_strings(logical_id) if ":execution:" in text}

    assert {name: bool(environment.get(name)) for name in MOVE_MACHINES} == dict.fromkeys(MOVE_MACHINES, True)
    for machine in MOVE_MACHINES.values():
        assert any(f":execution:${{{machine}.Name}}:*" in text for text in described), machine


def test_a_grant_several_resources_need_is_a_managed_policy_written_once():
    """An inline statement two functions or state machines repeat would have to be changed in each."""
    holders: dict[str, list[str]] = {}
    for logical_id, resource in RAW["Resources"].items():
        for item in (resource.get("Properties") or {}).get("Policies") or []:
            for statement in item.get("Statement", []) if isinstance(item, dict) else []:
                holders.setdefault(json.dumps(statement, sort_keys=True), []).append(logical_id)

    assert {statement: ids for statement, ids in holders.items() if len(ids) > 1} == {}


def test_every_managed_policy_the_stack_defines_is_attached_or_given_as_an_output():
    managed = {lid for lid, r in RAW["Resources"].items() if r["Type"] == "AWS::IAM::ManagedPolicy"}
    attached = {item["Ref"] for r in RAW["Resources"].values()
                for item in (r.get("Properties") or {}).get("Policies") or []
                if isinstance(item, dict) and "Ref" in item}
    given = {o["Value"]["Ref"] for o in RAW["Outputs"].values() if isinstance(o["Value"], dict) and "Ref" in o["Value"]}

    assert managed - attached - given == set()


def test_a_function_that_starts_workflows_may_describe_their_executions():
    """workflows.start_execution describes an execution whose start answered an error."""
    machines = [lid for lid, r in RAW["Resources"].items() if r["Type"] == "AWS::Serverless::StateMachine"]
    missing = []
    for logical_id in TEMPLATE.functions:
        policies = RAW["Resources"][logical_id]["Properties"].get("Policies") or []
        starts = [m for m in machines for item in policies if isinstance(item, dict) and item.get(
            "StepFunctionsExecutionPolicy", {}).get("StateMachineName") == {"Fn::GetAtt": [m, "Name"]}]
        described = {text for _path, text in _granted_strings(logical_id) if ":execution:" in text}
        missing += [(logical_id, m) for m in starts
                    if not any(f":execution:${{{m}.Name}}:*" in text for text in described)]

    assert missing == []


# --- operator alarms -----------------------------------------------------------------------------

_PUBLISHED = re.compile(r'(?:add_metric\(name=|_emit(?:_host)?_metric\(|single_metric\(\s*name=)"(\w+)"')
_ALARM_QUERY = re.compile(r'SELECT SUM\((\w+)\) FROM "\$\{MetricsNamespace\}"')
# Metrics to watch that raise no alarm: they count what clients send (bad tokens, unsigned or
# replayed webhook deliveries) or failures a step's Retry or Catch already handles.
_WATCHED_WITHOUT_ALARM = {"StepFailed", "WebhookRefused", "TokenRejected"}
# Alarms on what no Ferry function counts: a sum of AWS metrics.
_ALARMS_ON_AWS_METRICS = {"WorkflowStoppedAlarm"}


def _metrics_published() -> set[str]:
    """Every metric name the functions, the host agents and the workflows (a putMetricData Task) publish."""
    sources = [*(ROOT / "layers" / "core" / "python" / "ferry").rglob("*.py"), *(ROOT / "hostagent").rglob("*.py")]
    names = {name for path in sources for name in _PUBLISHED.findall(path.read_text())}
    names |= {name for path in (ROOT / "statemachine").glob("*.asl.json")
              for name in re.findall(r'"MetricName": "(\w+)"', path.read_text())}
    return names | {f"AutoConfirm{outcome.capitalize()}" for outcome in auto_confirm.OUTCOMES}


def _metrics_to_watch() -> set[str]:
    """The metrics of the table in docs/operations.md#metrics-to-watch (dimensions left out)."""
    section = (ROOT / "docs" / "operations.md").read_text().split("## Metrics to watch", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`(\w+)`", re.sub(r"\(.*?\)", "", cell))}


def _metric_alarms() -> dict[str, str]:
    """``{logical id: metric}`` of the alarms on Ferry's own metrics."""
    found = {}
    for logical_id, resource in RAW["Resources"].items():
        if resource["Type"] == "AWS::CloudWatch::Alarm" and "Metrics" in resource["Properties"] \
                and logical_id not in _ALARMS_ON_AWS_METRICS:
            [query] = resource["Properties"]["Metrics"]
            match = _ALARM_QUERY.fullmatch(query["Expression"]["Fn::Sub"])
            assert match, f"{logical_id}: not a sum of one metric in the stack's namespace"
            found[logical_id] = match.group(1)
    return found


def test_every_operator_alarm_counts_a_metric_the_code_publishes_and_notifies_the_operators_topic():
    alarms = _metric_alarms()
    assert alarms

    assert set(alarms.values()) <= _metrics_published()
    for logical_id, resource in RAW["Resources"].items():
        if resource["Type"] == "AWS::CloudWatch::Alarm":
            assert resource["Properties"]["AlarmActions"] == [{"Ref": "OperatorAlarmTopic"}], logical_id
            assert resource["Properties"]["TreatMissingData"] == "notBreaching", logical_id
    for logical_id, metric in alarms.items():
        assert RAW["Resources"][logical_id]["Properties"]["AlarmName"] == {"Fn::Sub": f"ferry-${{Stage}}-{metric}"}


@pytest.mark.parametrize("function", ["AuthorizerFunction", "ApiFunction"])
def test_the_functions_api_gateway_waits_for_have_an_alarm_on_their_own_errors(function):
    # Their failures and timeouts count no ApiFault: API Gateway answers for them (not a client's
    # 5xx, such as the webhook's 503 when it is off, which anyone can cause).
    alarms = [r["Properties"] for r in RAW["Resources"].values() if r["Type"] == "AWS::CloudWatch::Alarm"
              and r["Properties"].get("Namespace") == "AWS/Lambda"
              and r["Properties"]["Dimensions"] == [{"Name": "FunctionName", "Value": {"Ref": function}}]]

    assert [a["MetricName"] for a in alarms] == ["Errors"]


def test_every_metric_to_watch_has_an_alarm_unless_clients_cause_it():
    watched, alarmed = _metrics_to_watch(), set(_metric_alarms().values())

    assert watched <= _metrics_published() and "HostCleanupFailed" in watched
    assert watched - alarmed == _WATCHED_WITHOUT_ALARM
    assert alarmed <= watched


def test_a_stopped_execution_of_every_workflow_raises_the_workflow_stopped_alarm():
    # A stopped execution runs no Catch and counts no WorkflowNotSettled: Step Functions' own
    # count of it is what tells the operators, for every state machine of the stack.
    alarm = RAW["Resources"]["WorkflowStoppedAlarm"]["Properties"]
    machines = {logical_id for logical_id, resource in RAW["Resources"].items()
                if resource["Type"] == "AWS::Serverless::StateMachine"}
    stats = [query["MetricStat"] for query in alarm["Metrics"] if "MetricStat" in query]
    [total] = [query for query in alarm["Metrics"] if query.get("ReturnData")]

    assert len(machines) >= 8
    assert {(stat["Metric"]["Namespace"], stat["Metric"]["MetricName"], stat["Stat"]) for stat in stats} == {
        ("AWS/States", "ExecutionsAborted", "Sum")}
    assert sorted(stat["Metric"]["Dimensions"][0]["Value"]["Ref"] for stat in stats) == sorted(machines)
    assert total["Expression"] == "SUM(METRICS())"
    assert alarm["AlarmName"] == {"Fn::Sub": "ferry-${Stage}-WorkflowStopped"}


def test_what_api_gateway_answers_itself_is_in_the_compute_apis_error_shape():
    responses = RAW["Resources"]["ComputeApi"]["Properties"]["GatewayResponses"]

    assert {"MISSING_AUTHENTICATION_TOKEN", "UNAUTHORIZED", "ACCESS_DENIED"} <= set(responses)
    for kind, spec in responses.items():
        [(error_kind, error)] = json.loads(spec["ResponseTemplates"]["application/json"]).items()
        assert error["code"] == int(spec["StatusCode"]) and error["message"], kind
        assert error_kind in {"itemNotFound", "error", "forbidden", "computeFault", "overLimit",
                              "serviceUnavailable"}, kind
    # A token that could not be checked (the authorizer failed) may be sent again: 503, as
    # keystonemiddleware answers when the identity service is out of reach
    failure = json.loads(responses["AUTHORIZER_FAILURE"]["ResponseTemplates"]["application/json"])
    assert (responses["AUTHORIZER_FAILURE"]["StatusCode"], list(failure)) == (503, ["serviceUnavailable"])
    assert TEMPLATE.apis["ComputeApi"].gateway_responses["MISSING_AUTHENTICATION_TOKEN"].status == 404


def test_the_compute_api_is_throttled_by_its_parameters_and_says_when_to_retry():
    [setting] = RAW["Resources"]["ComputeApi"]["Properties"]["MethodSettings"]
    assert (setting["ResourcePath"], setting["HttpMethod"]) == ("/*", "*")
    assert setting["ThrottlingRateLimit"] == {"Ref": "ApiThrottleRate"}
    assert setting["ThrottlingBurstLimit"] == {"Ref": "ApiThrottleBurst"}

    throttled = TEMPLATE.apis["ComputeApi"].gateway_responses["THROTTLED"]
    assert throttled.status == 429 and ("Retry-After", "1") in throttled.headers
    assert TEMPLATE.apis["ComputeApi"].throttle.rate == RAW["Parameters"]["ApiThrottleRate"]["Default"]



def test_the_stage_is_what_the_installation_guide_says_and_every_name_made_from_it_fits():
    """Lower-case letters, digits and hyphens (docs/installation.md); the longest such stage still names
    every function, queue, state machine and the bucket within AWS's limits."""
    stage = RAW["Parameters"]["Stage"]
    pattern, longest = re.compile(stage["AllowedPattern"]), stage["MaxLength"]

    assert all(pattern.fullmatch(name) for name in ("local", "prod", "eu-west-2", "qa7", stage["Default"]))
    assert not any(pattern.fullmatch(name) for name in ("", "Prod", "prod_1", "prod.eu", "prod 1", "prød"))
    assert "lower-case letters, digits and hyphens" in stage["ConstraintDescription"]
    assert "lower-case letters, digits and hyphens" in (ROOT / "docs" / "installation.md").read_text()
    model = resolve(TEMPLATE_PATH, stage="s" * longest)
    assert max(len(f.name) for f in model.functions.values()) == 64  # the limit: one character more would not fit
    assert max(len(q.name) for q in model.queues.values()) <= 80
    assert max(len(m.name) for m in model.state_machines.values()) <= 80
    assert max(len(b.name) for b in model.buckets.values()) <= 63


def test_the_host_name_no_agent_serves_is_that_of_the_host_reports_queue():
    queue = load_template(TEMPLATE_PATH)["Resources"]["HostReportsQueue"]["Properties"]["QueueName"]
    assert queue == {"Fn::Sub": f"${{HostQueuePrefix.Value}}{protocol.REPORTS_HOST}"}


# --- logs, the image bucket's life and transport, the reports' concurrency -------------------------

# The retentions CloudWatch Logs accepts (PutRetentionPolicy), in days.
CLOUDWATCH_RETENTIONS = [1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557,
                         2922, 3288, 3653]


def _installation_parameters() -> set[str]:
    """The parameters the table of docs/installation.md's "Deploy the stack" describes."""
    section = (ROOT / "docs" / "installation.md").read_text().split("## 3. Deploy the stack", 1)[1].split("\n## ")[0]
    return {row.split("`")[1] for row in section.splitlines() if row.startswith("| `")}


def test_every_function_logs_to_the_stacks_log_group_which_expires_its_logs():
    logging = RAW["Globals"]["Function"]["LoggingConfig"]
    [(group_id, group)] = [(lid, r) for lid, r in RAW["Resources"].items() if r["Type"] == "AWS::Logs::LogGroup"]
    retention = RAW["Parameters"]["LogRetentionDays"]

    assert logging == {"LogGroup": {"Ref": group_id}}
    assert [lid for lid in TEMPLATE.functions if "LoggingConfig" in RAW["Resources"][lid]["Properties"]] == []
    assert group["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}
    name = group["Properties"]["LogGroupName"]["Fn::Sub"]
    assert "${Stage}" in name and not name.lstrip("/").startswith("aws/"), "Lambda writes no custom group aws/…"
    assert retention["AllowedValues"] == CLOUDWATCH_RETENTIONS and retention["Default"] in CLOUDWATCH_RETENTIONS
    assert "LogRetentionDays" in _installation_parameters()


def test_the_image_bucket_outlives_the_stack_and_refuses_plain_http():
    bucket = RAW["Resources"]["ImageBucket"]
    [policy] = [r["Properties"] for r in RAW["Resources"].values()
                if r["Type"] == "AWS::S3::BucketPolicy" and r["Properties"]["Bucket"] == {"Ref": "ImageBucket"}]
    [statement] = policy["PolicyDocument"]["Statement"]

    # Kept when the stack goes, not when its first create rolls back (the next create of the stage
    # would find the bucket's name taken)
    assert (bucket["DeletionPolicy"], bucket["UpdateReplacePolicy"]) == ("RetainExceptOnCreate", "Retain")
    assert (statement["Effect"], statement["Principal"], statement["Action"]) == ("Deny", "*", "s3:*")
    assert statement["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert statement["Resource"] == [{"Fn::GetAtt": ["ImageBucket", "Arn"]}, {"Fn::Sub": "${ImageBucket.Arn}/*"}]
    guide = (ROOT / "docs" / "installation.md").read_text().split("## Removing the stack", 1)[1].split("\n## ")[0]
    assert "ferry-<stage>-images" in guide


def test_host_reports_are_applied_a_bounded_number_at_a_time():
    """A burst of reports waits in the queue rather than taking every database connection."""
    [event] = [e for e in RAW["Resources"]["ReportHostStateFunction"]["Properties"]["Events"].values()
               if e["Type"] == "SQS"]
    parameter = RAW["Parameters"]["HostReportsMaxConcurrency"]

    assert event["Properties"]["ScalingConfig"] == {"MaximumConcurrency": {"Ref": "HostReportsMaxConcurrency"}}
    assert 2 <= parameter["MinValue"] <= parameter["Default"] <= parameter["MaxValue"] <= 1000  # Lambda's bounds
    assert "HostReportsMaxConcurrency" in _installation_parameters()


def test_the_own_queue_policy_leaves_an_agent_its_queue_its_dead_letter_queue_and_the_reports_queue_only():
    policy = RAW["Resources"]["HostAgentOwnQueuePolicy"]["Properties"]["PolicyDocument"]
    statement, untagged = policy["Statement"]
    own = "${HostQueuePrefix.Value}${!aws:PrincipalTag/ferry-host}"
    agent_actions = set(next(s for s in RAW["Resources"]["HostAgentPolicy"]["Properties"]["PolicyDocument"][
        "Statement"] if s["Sid"] == "OwnQueue")["Action"])

    assert statement["Effect"] == "Deny" and agent_actions | {"sqs:SendMessage"} == set(statement["Action"])
    [queue, dead_letters, reports] = statement["NotResource"]
    assert queue["Fn::Sub"].endswith(":" + own) and dead_letters["Fn::Sub"].endswith(":" + own + protocol.DLQ_SUFFIX)
    assert reports == {"Fn::GetAtt": ["HostReportsQueue", "Arn"]}
    # without the tag, every queue is denied outright
    assert (untagged["Effect"], untagged["Resource"]) == ("Deny", "*")
    assert set(untagged["Action"]) == set(statement["Action"])
    assert untagged["Condition"] == {"Null": {"aws:PrincipalTag/ferry-host": "true"}}
