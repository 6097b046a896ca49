"""The local stack's reading of template.yaml: every resource appears, every intrinsic is resolved."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from moto_credentials import REGION, use_moto_credentials

from ferry.errors import TemplateError
from ferry.local import provision
from ferry.local import template as tpl

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
ENDPOINT = "http://127.0.0.1:4566"


@pytest.fixture(scope="module")
def raw() -> dict:
    return tpl.load_template(TEMPLATE)


@pytest.fixture(scope="module")
def model() -> tpl.LocalTemplate:
    return tpl.resolve(TEMPLATE, parameters={"FerryStateDir": "/srv/ferry-state"}, endpoint_url=ENDPOINT)


def _of_type(raw: dict, *types: str) -> set[str]:
    return {lid for lid, res in raw["Resources"].items() if res["Type"] in types}


def _unresolved(value) -> bool:
    """Whether an intrinsic function or a ${...} survived resolution anywhere in ``value``."""
    text = json.dumps(value, default=str)
    return "${" in text or '"Ref"' in text or '"Fn::' in text


def test_every_function_queue_and_state_machine_of_the_template_is_in_the_model(raw, model):
    assert set(model.functions) == _of_type(raw, *tpl.FUNCTION_TYPES)
    assert set(model.queues) == _of_type(raw, *tpl.QUEUE_TYPES)
    assert set(model.state_machines) == _of_type(raw, *tpl.STATE_MACHINE_TYPES)
    assert set(model.buckets) == _of_type(raw, *tpl.BUCKET_TYPES)
    assert set(model.tables) == _of_type(raw, *tpl.TABLE_TYPES)
    assert set(model.event_buses) == _of_type(raw, *tpl.EVENT_BUS_TYPES)


def test_state_machine_definitions_have_every_substitution_filled(model):
    assert model.state_machines
    for machine in model.state_machines.values():
        definition = machine.definition()
        assert "${" not in definition, machine.logical_id
        json.loads(definition)
        for value in machine.substitutions.values():
            assert "${" not in value


def test_lambda_arns_in_definitions_name_functions_of_the_template(model):
    arns = {f.arn for f in model.functions.values()}
    for machine in model.state_machines.values():
        for key, value in machine.substitutions.items():
            if value.startswith("arn:aws:lambda:"):
                assert value in arns, f"{machine.logical_id}.{key}"


def test_nothing_is_left_unresolved_in_functions_queues_and_outputs(model):
    for function in model.functions.values():
        assert not _unresolved(function.environment), function.logical_id
        assert not _unresolved(function.events), function.logical_id
    for queue in model.queues.values():
        assert not _unresolved(queue.attributes)
    assert not _unresolved(model.outputs)


def test_every_function_gets_the_global_environment_and_keeps_its_own(raw, model):
    global_keys = set(raw["Globals"]["Function"]["Environment"]["Variables"])
    for lid, function in model.functions.items():
        assert global_keys <= set(function.environment), lid
        own = (raw["Resources"][lid]["Properties"].get("Environment") or {}).get("Variables") or {}
        assert set(own) <= set(function.environment), lid


def test_what_the_local_stack_does_not_play_is_read_without_a_fault(raw, model):
    """The functions' log group (and their LoggingConfig) and the image bucket's policy: AWS keeps the
    logs and enforces the policy; the local stack does neither, and reading them changes nothing."""
    assert _of_type(raw, "AWS::Logs::LogGroup") and _of_type(raw, "AWS::S3::BucketPolicy")
    assert "LoggingConfig" in raw["Globals"]["Function"]
    for lid, function in model.functions.items():
        assert function.environment["FERRY_IMAGE_BUCKET"] == model.buckets["ImageBucket"].name, lid


def test_the_local_stack_provisions_the_image_bucket_without_its_tls_only_policy(model, monkeypatch):
    """The template's ImageBucketPolicy denies requests without TLS. moto takes the policy but, checking
    object requests against it, does not evaluate aws:SecureTransport and refuses them all; the local
    stack, whose endpoint is plain HTTP anyway, must leave it out."""
    use_moto_credentials(monkeypatch)
    with mock_aws():
        provision.provision(model, lambda service: boto3.client(service, region_name=REGION))
        s3 = boto3.client("s3", region_name=REGION)
        bucket = model.buckets["ImageBucket"].name

        with pytest.raises(ClientError) as raised:
            s3.get_bucket_policy(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="images/probe", Body=b"probe")

        assert raised.value.response["Error"]["Code"] == "NoSuchBucketPolicy"
        assert s3.get_object(Bucket=bucket, Key="images/probe")["Body"].read() == b"probe"


def test_parameter_overrides_reach_the_environment(raw, model):
    variables = raw["Globals"]["Function"]["Environment"]["Variables"]
    state_dir_keys = [k for k, v in variables.items() if v == {"Ref": "FerryStateDir"}]
    assert state_dir_keys
    for function in model.functions.values():
        for key in state_dir_keys:
            assert function.environment[key] == "/srv/ferry-state"


def test_local_physical_ids_follow_the_resource_type(model):
    for queue in model.queues.values():
        assert queue.url == f"{ENDPOINT}/{model.account_id}/{queue.name}"
        assert queue.arn == f"arn:aws:sqs:us-east-1:123456789012:{queue.name}"
    for function in model.functions.values():
        assert function.arn == f"arn:aws:lambda:us-east-1:123456789012:function:{function.name}"
        assert function.module_path.is_file(), function.logical_id
    for machine in model.state_machines.values():
        assert machine.arn == f"arn:aws:states:us-east-1:123456789012:stateMachine:{machine.name}"
    names = [q.name for q in model.queues.values()] + [f.name for f in model.functions.values()]
    assert all(f"-{model.stage}-" in name for name in names)


def test_refs_in_the_environment_are_the_local_physical_ids(raw, model):
    by_ref = {}
    for function_id in model.functions:
        props = raw["Resources"][function_id]["Properties"]
        variables = {
            **raw["Globals"]["Function"]["Environment"]["Variables"],
            **((props.get("Environment") or {}).get("Variables") or {}),
        }
        for key, value in variables.items():
            if isinstance(value, dict) and set(value) == {"Ref"} and value["Ref"] in raw["Resources"]:
                by_ref[(function_id, key)] = value["Ref"]
    assert by_ref
    expected = {
        **{lid: q.url for lid, q in model.queues.items()},
        **{lid: m.arn for lid, m in model.state_machines.items()},
        **{lid: b.name for lid, b in model.buckets.items()},
        **{lid: t.name for lid, t in model.tables.items()},
        **{lid: e.name for lid, e in model.event_buses.items()},
        **{lid: f.name for lid, f in model.functions.items()},
    }
    for (function_id, key), target in by_ref.items():
        assert model.functions[function_id].environment[key] == expected[target], (function_id, key)


def test_api_routes_carry_the_default_authorizer_unless_turned_off(raw, model):
    declared = []
    for lid, res in raw["Resources"].items():
        for name, event in ((res.get("Properties") or {}).get("Events") or {}).items():
            if event["Type"] == "Api":
                declared.append((lid, name, (event["Properties"].get("Auth") or {}).get("Authorizer")))
    assert len(model.routes) == len(declared)
    routes = {(r.function, r.event_name): r for r in model.routes}
    for lid, name, authorizer in declared:
        route = routes[(lid, name)]
        api = model.apis[route.api]
        if authorizer == "NONE":
            assert route.authorizer is None
        else:
            assert route.authorizer is not None
            assert route.authorizer.name == (authorizer or api.default_authorizer)
            assert route.authorizer.function in model.functions


def test_sqs_event_sources_map_template_queues_to_functions(raw, model):
    declared = [
        (lid, event["Properties"])
        for lid, res in raw["Resources"].items()
        for event in ((res.get("Properties") or {}).get("Events") or {}).values()
        if event["Type"] == "SQS"
    ]
    assert len(model.sqs_event_sources) == len(declared)
    for source in model.sqs_event_sources:
        assert source.queue in model.queues
        assert source.function in model.functions


def test_an_unknown_parameter_is_refused():
    with pytest.raises(TemplateError):
        tpl.resolve(TEMPLATE, parameters={"NoSuchParameter": "x"})


def test_the_report_mapping_runs_as_many_batches_at_once_as_the_template_allows(raw, model):
    (source,) = [s for s in model.sqs_event_sources if s.function == "ReportHostStateFunction"]
    assert source.maximum_concurrency == int(raw["Parameters"]["HostReportsMaxConcurrency"]["Default"])
    raised = tpl.resolve(TEMPLATE, parameters={"HostReportsMaxConcurrency": 7})
    assert [s.maximum_concurrency for s in raised.sqs_event_sources if s.function == source.function] == [7]


@pytest.mark.parametrize(
    ("stage", "parameters", "refused"),
    [
        ("local", {"HostReportsMaxConcurrency": 1}, "HostReportsMaxConcurrency=.* less than its MinValue 2"),
        ("local", {"HostReportsMaxConcurrency": 1001}, "HostReportsMaxConcurrency=.* more than its MaxValue 1000"),
        ("Dev", {}, "Stage='Dev' does not match its AllowedPattern .*: lower-case letters"),
        ("local", {"Stage": "my_stage"}, "Stage='my_stage' does not match"),
        ("local", {"Stage": "a" * 32}, "Stage=.* is longer than its MaxLength 31"),
        ("local", {"MetricsNamespace": "Ferry Metrics"}, "MetricsNamespace=.* does not match"),
        ("local", {"ApiThrottleRate": "fast"}, "ApiThrottleRate='fast' is not a number"),
    ],
)
def test_a_value_sam_deploy_would_refuse_is_refused_locally(stage, parameters, refused):
    with pytest.raises(TemplateError, match=refused):
        tpl.resolve(TEMPLATE, stage=stage, parameters=parameters)


def test_the_stage_names_every_resource():
    model = tpl.resolve(TEMPLATE, stage="qa")
    assert all("-qa-" in f.name for f in model.functions.values())
    assert all(":stateMachine:" in m.arn and "-qa-" in m.name for m in model.state_machines.values())


# --- intrinsic functions on a small template ----------------------------------------------------


SMALL = """
Transform: AWS::Serverless-2016-10-31
Parameters:
  Stage: {Type: String, Default: local}
  Wide: {Type: String, Default: "no", AllowedValues: ["yes", "no"]}
  Retention: {Type: Number, Default: 60}
Conditions:
  IsWide: !Equals [!Ref Wide, "yes"]
Globals:
  Function:
    Timeout: 5
    Layers: [shared]
    Environment:
      Variables:
        SHARED: !Sub "${AWS::Region}/${AWS::AccountId}/${AWS::Partition}/${AWS::StackName}"
        LITERAL: !Sub "${!NotAVariable}-${Stage}"
Resources:
  Dlq:
    Type: AWS::SQS::Queue
  Work:
    Type: AWS::SQS::Queue
    Properties:
      QueueName: !Join ["-", [app, !Ref Stage, work]]
      MessageRetentionPeriod: !Ref Retention
      VisibilityTimeout: !If [IsWide, 300, 30]
      RedrivePolicy: {deadLetterTargetArn: !GetAtt Dlq.Arn, maxReceiveCount: 3}
  OnlyWhenWide:
    Type: AWS::SQS::Queue
    Condition: IsWide
  Worker:
    Type: AWS::Serverless::Function
    Properties:
      FunctionName: !Sub "app-${Stage}-worker"
      CodeUri: fn/worker/
      Handler: app.handler
      Timeout: 30
      Layers: [own]
      Environment:
        Variables:
          WORK_URL: !Ref Work
          WORK_NAME: !GetAtt Work.QueueName
          MACHINE: !Ref Machine
          MACHINE_NAME: !GetAtt Machine.Name
          PAIR: !Sub ["${A}:${Work.Arn}", {A: !Select [1, !Split [",", "x,y,z"]]}]
          MAYBE: !If [IsWide, wide, !Ref AWS::NoValue]
      Events:
        Jobs:
          Type: SQS
          Properties: {Queue: !GetAtt Work.Arn, BatchSize: 5}
        Tick:
          Type: Schedule
          Properties: {Schedule: rate(5 minutes), Input: '{"kind": "tick"}'}
        Daily:
          Type: ScheduleV2
          Properties: {ScheduleExpression: "cron(0 3 * * ? *)"}
  Machine:
    Type: AWS::Serverless::StateMachine
    Properties:
      Name: !Sub "app-${Stage}-machine"
      Definition:
        StartAt: Go
        States:
          Go: {Type: Task, Resource: "${WorkerArn}", End: true}
      DefinitionSubstitutions:
        WorkerArn: !GetAtt Worker.Arn
"""


@pytest.fixture
def small(tmp_path) -> Path:
    (tmp_path / "fn/worker").mkdir(parents=True)
    (tmp_path / "fn/worker/app.py").write_text("def handler(event, context):\n    return event\n")
    path = tmp_path / "template.yaml"
    path.write_text(textwrap.dedent(SMALL))
    return path


def test_sub_fills_pseudo_parameters_and_keeps_escaped_literals(small):
    model = tpl.resolve(small, stack_name="app-stack")
    env = model.functions["Worker"].environment
    assert env["SHARED"] == "us-east-1/123456789012/aws/app-stack"
    assert env["LITERAL"] == "${NotAVariable}-local"
    assert env["PAIR"] == "y:arn:aws:sqs:us-east-1:123456789012:app-local-work"


def test_refs_and_get_atts_give_local_physical_ids(small):
    model = tpl.resolve(small, endpoint_url="http://127.0.0.1:9999")
    env = model.functions["Worker"].environment
    assert env["WORK_URL"] == "http://127.0.0.1:9999/123456789012/app-local-work"
    assert env["WORK_NAME"] == "app-local-work"
    assert env["MACHINE"] == "arn:aws:states:us-east-1:123456789012:stateMachine:app-local-machine"
    assert env["MACHINE_NAME"] == "app-local-machine"


def test_conditions_choose_values_drop_no_value_and_skip_resources(small):
    narrow = tpl.resolve(small)
    wide = tpl.resolve(small, parameters={"Wide": "yes"})
    assert narrow.queues["Work"].attributes["VisibilityTimeout"] == "30"
    assert wide.queues["Work"].attributes["VisibilityTimeout"] == "300"
    assert "MAYBE" not in narrow.functions["Worker"].environment
    assert wide.functions["Worker"].environment["MAYBE"] == "wide"
    assert "OnlyWhenWide" not in narrow.queues
    assert "OnlyWhenWide" in wide.queues


def test_a_parameter_outside_its_allowed_values_is_refused(small):
    with pytest.raises(TemplateError):
        tpl.resolve(small, parameters={"Wide": "maybe"})


CONSTRAINED = """
Parameters:
  Name:
    Type: String
    Default: abc
    AllowedPattern: "[a-z]+"
    MinLength: 2
    MaxLength: 5
    ConstraintDescription: two to five lower-case letters
  Count: {Type: Number, Default: 5, MinValue: 2, MaxValue: 10}
  Secret: {Type: String, Default: hidden, NoEcho: true, MinLength: 4}
  Zones: {Type: CommaDelimitedList, Default: "a,b", AllowedPattern: "[a-z]"}
Resources:
  Work: {Type: AWS::SQS::Queue}
"""


@pytest.mark.parametrize(
    ("parameters", "refused"),
    [
        ({"Name": "Abc"}, "Name='Abc' does not match its AllowedPattern \\[a-z\\]\\+: two to five lower-case letters"),
        ({"Name": "ab1"}, "Name='ab1' does not match"),  # the whole value must match, not a part of it
        ({"Name": "a"}, "Name='a' is shorter than its MinLength 2: two to five"),
        ({"Name": "abcdef"}, "Name='abcdef' is longer than its MaxLength 5"),
        ({"Count": 1}, "Count='1' is less than its MinValue 2"),
        ({"Count": "11"}, "Count='11' is more than its MaxValue 10"),
        ({"Count": "many"}, "Count='many' is not a number"),
        ({"Zones": "a,bc"}, "Zones='bc' does not match"),
    ],
)
def test_a_parameter_breaking_its_constraints_is_refused_as_cloudformation_refuses_it(tmp_path, parameters, refused):
    path = tmp_path / "template.yaml"
    path.write_text(textwrap.dedent(CONSTRAINED))
    assert tpl.resolve(path).parameters["Count"] == "5"
    with pytest.raises(TemplateError, match=refused):
        tpl.resolve(path, parameters=parameters)


def test_a_no_echo_parameter_breaking_its_constraints_is_refused_without_its_value(tmp_path):
    path = tmp_path / "template.yaml"
    path.write_text(textwrap.dedent(CONSTRAINED).replace("Default: hidden", "Default: abc"))
    with pytest.raises(TemplateError, match="Secret is shorter than its MinLength 4") as refused:
        tpl.resolve(path)
    assert "abc" not in str(refused.value)


def test_an_event_source_concurrency_lambda_refuses_is_refused(small):
    small.write_text(
        small.read_text().replace(
            "{Queue: !GetAtt Work.Arn, BatchSize: 5}",
            "{Queue: !GetAtt Work.Arn, BatchSize: 5, ScalingConfig: {MaximumConcurrency: 1}}",
        )
    )
    with pytest.raises(TemplateError, match="Worker.Jobs: ScalingConfig.MaximumConcurrency '1'"):
        tpl.resolve(small)


def test_globals_merge_lists_and_let_the_function_override_scalars(small):
    function = tpl.resolve(small).functions["Worker"]
    assert function.timeout == 30
    assert set(function.environment) >= {"SHARED", "LITERAL", "WORK_URL"}


def test_a_queue_without_a_name_gets_one_from_the_stack_and_redrives_to_its_dlq(small):
    model = tpl.resolve(small)
    dlq, work = model.queues["Dlq"], model.queues["Work"]
    assert dlq.name == f"{model.stack_name}-Dlq"
    assert work.dead_letter_arn == dlq.arn
    assert work.max_receive_count == 3
    assert json.loads(work.attributes["RedrivePolicy"]) == {"deadLetterTargetArn": dlq.arn, "maxReceiveCount": 3}
    assert work.attributes["MessageRetentionPeriod"] == "60"


def test_inline_definitions_are_substituted(small):
    machine = tpl.resolve(small).state_machines["Machine"]
    definition = json.loads(machine.definition())
    assert definition["States"]["Go"]["Resource"] == "arn:aws:lambda:us-east-1:123456789012:function:app-local-worker"


def test_events_become_sqs_sources_and_schedules(small):
    model = tpl.resolve(small)
    (source,) = model.sqs_event_sources
    assert (source.function, source.queue, source.batch_size, source.report_batch_item_failures) == (
        "Worker",
        "Work",
        5,
        False,
    )
    schedules = {s.event_name: s for s in model.schedules}
    assert schedules["Tick"].rate_seconds == 300
    assert schedules["Tick"].input == {"kind": "tick"}
    assert schedules["Daily"].rate_seconds is None
    assert schedules["Daily"].kind == "ScheduleV2"


@pytest.mark.parametrize(
    ("expression", "seconds"),
    [
        ("rate(1 minute)", 60),
        ("rate(10 minutes)", 600),
        ("rate(2 hours)", 7200),
        ("rate(1 day)", 86400),
        ("cron(0 3 * * ? *)", None),
        ("rate(soon)", None),
    ],
)
def test_rate_expressions(expression, seconds):
    assert tpl.rate_seconds(expression) == seconds


def test_functions_that_set_one_variable_differently_are_refused(small, tmp_path):
    text = small.read_text().replace(
        "  Machine:\n",
        "  Other:\n    Type: AWS::Serverless::Function\n    Properties:\n      CodeUri: fn/worker/\n"
        "      Handler: app.handler\n      Environment: {Variables: {WORK_NAME: other}}\n  Machine:\n",
    )
    small.write_text(text)
    model = tpl.resolve(small)
    with pytest.raises(TemplateError):
        model.environment()
