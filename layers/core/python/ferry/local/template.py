"""Reading ``template.yaml`` and resolving it for a deployment on this machine.

:func:`resolve` turns the SAM template into a typed :class:`LocalTemplate`: every intrinsic
function is evaluated with local physical ids (a queue's ``Ref`` is its URL on the local
endpoint, a function's its name, a state machine's its ARN, ...), ``Globals`` are merged into
each function, and the pieces the local stack plays itself — API routes and authorizers, SQS
event sources, schedules — are pulled out of the functions' ``Events``. Nothing here knows
Ferry's resources: add a queue or a function to the template and the local stack has it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ferry.errors import TemplateError

DEFAULT_REGION = "us-east-1"
DEFAULT_ACCOUNT_ID = "123456789012"
DEFAULT_STAGE = "local"
DEFAULT_ENDPOINT_URL = "http://127.0.0.1:4566"
PARTITION = "aws"

# The parameter SAM templates conventionally use for the stage; set from ``stage`` when declared.
STAGE_PARAMETER = "Stage"

FUNCTION_TYPES = {"AWS::Serverless::Function", "AWS::Lambda::Function"}
QUEUE_TYPES = {"AWS::SQS::Queue"}
BUCKET_TYPES = {"AWS::S3::Bucket"}
TABLE_TYPES = {"AWS::DynamoDB::Table", "AWS::Serverless::SimpleTable"}
EVENT_BUS_TYPES = {"AWS::Events::EventBus"}
STATE_MACHINE_TYPES = {"AWS::Serverless::StateMachine", "AWS::StepFunctions::StateMachine"}
API_TYPES = {"AWS::Serverless::Api"}
LAYER_TYPES = {"AWS::Serverless::LayerVersion", "AWS::Lambda::LayerVersion"}
MANAGED_POLICY_TYPES = {"AWS::IAM::ManagedPolicy"}
TOPIC_TYPES = {"AWS::SNS::Topic"}
# A parameter's Value is how a template names a derived string once (``!GetAtt P.Value``).
PARAMETER_TYPES = {"AWS::SSM::Parameter"}

# Where each resource type keeps its physical name.
NAME_PROPERTIES = {
    **dict.fromkeys(FUNCTION_TYPES, "FunctionName"),
    **dict.fromkeys(QUEUE_TYPES, "QueueName"),
    **dict.fromkeys(BUCKET_TYPES, "BucketName"),
    **dict.fromkeys(TABLE_TYPES, "TableName"),
    **dict.fromkeys(EVENT_BUS_TYPES, "Name"),
    "AWS::Serverless::StateMachine": "Name",
    "AWS::StepFunctions::StateMachine": "StateMachineName",
    **dict.fromkeys(API_TYPES, "Name"),
    **dict.fromkeys(LAYER_TYPES, "LayerName"),
    **dict.fromkeys(MANAGED_POLICY_TYPES, "ManagedPolicyName"),
    **dict.fromkeys(TOPIC_TYPES, "TopicName"),
    **dict.fromkeys(PARAMETER_TYPES, "Name"),
}

# What Lambda accepts as an SQS event source's ScalingConfig.MaximumConcurrency.
MIN_MAXIMUM_CONCURRENCY = 2
MAX_MAXIMUM_CONCURRENCY = 1000

_RATE = re.compile(r"^rate\(\s*(\d+)\s+(minute|minutes|hour|hours|day|days)\s*\)$")
_RATE_UNITS = {"minute": 60, "minutes": 60, "hour": 3600, "hours": 3600, "day": 86400, "days": 86400}
_SUB_VARIABLE = re.compile(r"\$\{([^}]*)\}")

# A sentinel for AWS::NoValue: the key holding it disappears from its mapping.
_NO_VALUE = object()


# --- YAML with CloudFormation's short tags ------------------------------------------------------


class _TemplateLoader(yaml.SafeLoader):
    """A safe YAML loader that turns ``!Ref x`` into ``{"Ref": "x"}``, ``!Sub s`` into ``{"Fn::Sub": s}``..."""


def _short_tag(loader: _TemplateLoader, tag_suffix: str, node: yaml.Node) -> dict[str, Any]:
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    if tag_suffix in ("Ref", "Condition"):
        return {tag_suffix: value}
    if tag_suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{tag_suffix}": value}


_TemplateLoader.add_multi_constructor("!", _short_tag)


def load_template(path: str | Path) -> dict[str, Any]:
    """Parse a CloudFormation/SAM template (YAML or JSON, short tags allowed) into plain data.

    Raises:
        TemplateError: the file is not a template.
    """
    text = Path(path).read_text()
    try:
        document = yaml.load(text, Loader=_TemplateLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise TemplateError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("Resources"), dict):
        raise TemplateError(f"{path}: a template needs a Resources mapping.")
    return document


# --- the resolved model -------------------------------------------------------------------------


@dataclass(frozen=True)
class Function:
    """A Lambda function: where its code is, which handler runs, and with what environment."""

    logical_id: str
    name: str
    arn: str
    code_dir: Path
    handler: str
    runtime: str
    timeout: int
    memory_size: int
    environment: dict[str, str]
    events: dict[str, dict[str, Any]]
    # Its network interfaces' subnets and security groups (None: outside any VPC; the local stack ignores it).
    vpc_config: dict[str, Any] | None = None
    # The ARNs of its layers (the local stack puts the core layer's package on the path itself).
    layers: tuple[str, ...] = ()

    @property
    def module_path(self) -> Path:
        """The file holding the handler (``app.handler`` → ``<code_dir>/app.py``)."""
        module, _, _ = self.handler.rpartition(".")
        return self.code_dir / (module.replace(".", "/") + ".py")

    @property
    def handler_attribute(self) -> str:
        return self.handler.rpartition(".")[2]


@dataclass(frozen=True)
class Queue:
    logical_id: str
    name: str
    url: str
    arn: str
    attributes: dict[str, str]
    dead_letter_arn: str | None = None
    max_receive_count: int | None = None

    @property
    def fifo(self) -> bool:
        return self.attributes.get("FifoQueue", "false") == "true"


@dataclass(frozen=True)
class Bucket:
    logical_id: str
    name: str
    arn: str
    versioning: str | None = None


@dataclass(frozen=True)
class Table:
    logical_id: str
    name: str
    arn: str
    key_schema: list[dict[str, str]]
    attribute_definitions: list[dict[str, str]]
    billing_mode: str = "PAY_PER_REQUEST"
    global_secondary_indexes: list[dict[str, Any]] = field(default_factory=list)
    ttl_attribute: str | None = None


@dataclass(frozen=True)
class EventBus:
    logical_id: str
    name: str
    arn: str


@dataclass(frozen=True)
class StateMachine:
    """A state machine; :meth:`definition` is its ASL with ``DefinitionSubstitutions`` filled in."""

    logical_id: str
    name: str
    arn: str
    definition_uri: Path | None
    substitutions: dict[str, str]
    inline_definition: str | None = None

    def raw_definition(self) -> str:
        """The ASL text as written (file or inline), before substitution.

        Raises:
            TemplateError: the definition file does not exist.
        """
        if self.inline_definition is not None:
            return self.inline_definition
        if self.definition_uri is None or not self.definition_uri.is_file():
            raise TemplateError(f"State machine {self.logical_id}: no definition at {self.definition_uri}.")
        return self.definition_uri.read_text()

    def definition(self) -> str:
        """The ASL text with every ``${Key}`` of ``DefinitionSubstitutions`` replaced."""
        return substitute_definition(self.raw_definition(), self.substitutions)


@dataclass(frozen=True)
class Authorizer:
    """A Lambda authorizer of an API (REQUEST or TOKEN) and where its identity comes from."""

    name: str
    function: str
    payload_type: str
    identity_headers: tuple[str, ...] = ()
    identity_query_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class GatewayResponse:
    """A ``GatewayResponses`` entry: its status code and JSON body, None where the entry gives none
    (the answer's own default then applies, as on AWS), and its static headers."""

    status: int | None
    body: str | None
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Throttle:
    """A stage's throttle (``MethodSettings`` for every method): requests per second, and at once."""

    rate: float
    burst: int


@dataclass(frozen=True)
class Api:
    logical_id: str
    name: str
    rest_api_id: str
    stage_name: str
    default_authorizer: str | None
    authorizers: dict[str, Authorizer]
    gateway_responses: dict[str, GatewayResponse] = field(default_factory=dict)
    throttle: Throttle | None = None


@dataclass(frozen=True)
class Route:
    """One ``Api`` event: method and path template, the function behind it, its authorizer if any."""

    api: str | None
    method: str
    path: str
    function: str
    event_name: str
    authorizer: Authorizer | None


@dataclass(frozen=True)
class SqsEventSource:
    """An ``SQS`` event: its queue, batch, and how many batches may run at once
    (``ScalingConfig.MaximumConcurrency``; None when the mapping does not set it)."""

    function: str
    queue: str
    batch_size: int
    report_batch_item_failures: bool
    enabled: bool = True
    maximum_batching_window_seconds: int = 0
    maximum_concurrency: int | None = None


@dataclass(frozen=True)
class Schedule:
    """A ``Schedule``/``ScheduleV2`` event; ``rate_seconds`` is None for expressions other than rate()."""

    function: str
    event_name: str
    expression: str
    rate_seconds: int | None
    enabled: bool
    input: Any = None
    kind: str = "Schedule"


@dataclass(frozen=True)
class LocalTemplate:
    """The template resolved for one local deployment."""

    path: Path
    stage: str
    region: str
    account_id: str
    stack_name: str
    endpoint_url: str
    parameters: dict[str, Any]
    functions: dict[str, Function]
    queues: dict[str, Queue]
    buckets: dict[str, Bucket]
    tables: dict[str, Table]
    event_buses: dict[str, EventBus]
    state_machines: dict[str, StateMachine]
    apis: dict[str, Api]
    routes: list[Route]
    sqs_event_sources: list[SqsEventSource]
    schedules: list[Schedule]
    outputs: dict[str, Any]

    def function_named(self, name_or_arn: str) -> Function | None:
        """The function with this name or ARN (a qualified ARN counts), or None."""
        for function in self.functions.values():
            if name_or_arn in (function.name, function.arn) or name_or_arn.startswith(function.arn + ":"):
                return function
        return None

    def queue_with_arn(self, arn: str) -> Queue | None:
        return next((q for q in self.queues.values() if q.arn == arn), None)

    def environment(self) -> dict[str, str]:
        """The union of every function's environment.

        Raises:
            TemplateError: two functions give one variable different values.
        """
        union: dict[str, str] = {}
        owner: dict[str, str] = {}
        for function in self.functions.values():
            for key, value in function.environment.items():
                if key in union and union[key] != value:
                    raise TemplateError(
                        f"{function.logical_id} and {owner[key]} set {key} differently; "
                        "the local stack runs every function in one process and needs one value."
                    )
                union[key] = value
                owner[key] = function.logical_id
        return union


def substitute_definition(text: str, substitutions: Mapping[str, str]) -> str:
    """Replace ``${Key}`` in an ASL text for every key of ``substitutions`` (others are left alone)."""
    return _SUB_VARIABLE.sub(lambda m: substitutions.get(m.group(1), m.group(0)), text)


def rate_seconds(expression: str) -> int | None:
    """Seconds between runs of a ``rate(N unit)`` expression; None for cron() and anything else."""
    match = _RATE.match(expression.strip())
    if match is None:
        return None
    return int(match.group(1)) * _RATE_UNITS[match.group(2)]


# --- resolution ---------------------------------------------------------------------------------


def _local_id(*parts: str) -> str:
    """A stable 10-character id, like API Gateway's, for a local resource."""
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:10]


def _merge_globals(global_props: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """SAM's Globals merge: mappings merge key by key, lists concatenate, the resource's own scalars win."""
    merged: dict[str, Any] = dict(global_props)
    for key, value in own.items():
        base = merged.get(key)
        if isinstance(base, Mapping) and isinstance(value, Mapping):
            merged[key] = _merge_globals(base, value)
        elif isinstance(base, list) and isinstance(value, list):
            merged[key] = base + value
        else:
            merged[key] = value
    return merged


def _stringify(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _check_parameter(name: str, spec: Mapping[str, Any], value: Any) -> None:
    """Refuse a parameter value (given or the default) that CloudFormation would refuse, so that a
    value the local stack starts with also deploys: ``AllowedValues``, ``AllowedPattern`` (the
    whole value must match), ``MinLength``/``MaxLength`` for strings, ``MinValue``/``MaxValue``
    for numbers. A list parameter is checked item by item.

    Raises:
        TemplateError: naming the parameter, the rule it breaks and its ``ConstraintDescription``
            (the value too, unless the parameter is ``NoEcho``).
    """
    for item in value if isinstance(value, list) else [value]:
        fault = _constraint_fault(spec, _stringify(item))
        if fault is None:
            continue
        shown = "" if spec.get("NoEcho") in (True, "true") else f"={item!r}"
        description = spec.get("ConstraintDescription")
        raise TemplateError(
            f"Template parameter {name}{shown} {fault}" + (f": {description}" if description else "") + "."
        )


def _constraint_fault(spec: Mapping[str, Any], item: str) -> str | None:
    """Which of the parameter's constraints ``item`` breaks, or None."""
    allowed = spec.get("AllowedValues")
    if allowed and item not in [_stringify(a) for a in allowed]:
        return f"is not one of {allowed}"
    if spec.get("Type", "String") == "Number":
        return _number_fault(spec, item)
    pattern = spec.get("AllowedPattern")
    if pattern is not None and re.fullmatch(str(pattern), item) is None:
        return f"does not match its AllowedPattern {pattern}"
    if "MinLength" in spec and len(item) < int(spec["MinLength"]):
        return f"is shorter than its MinLength {spec['MinLength']}"
    if "MaxLength" in spec and len(item) > int(spec["MaxLength"]):
        return f"is longer than its MaxLength {spec['MaxLength']}"
    return None


def _number_fault(spec: Mapping[str, Any], item: str) -> str | None:
    """Which of a Number parameter's constraints ``item`` breaks (being a number first), or None."""
    try:
        number = float(item)
    except ValueError:
        return "is not a number"
    if not math.isfinite(number):
        return "is not a number"
    if "MinValue" in spec and number < float(spec["MinValue"]):
        return f"is less than its MinValue {spec['MinValue']}"
    if "MaxValue" in spec and number > float(spec["MaxValue"]):
        return f"is more than its MaxValue {spec['MaxValue']}"
    return None


class _Resolver:
    """Evaluates intrinsic functions against one local deployment."""

    def __init__(
        self,
        document: dict[str, Any],
        *,
        stage: str,
        region: str,
        account_id: str,
        stack_name: str,
        endpoint_url: str,
        parameters: Mapping[str, Any],
    ) -> None:
        self.document = document
        self.resources: dict[str, dict[str, Any]] = document["Resources"]
        self.region = region
        self.account_id = account_id
        self.stack_name = stack_name
        self.endpoint_url = endpoint_url.rstrip("/")
        self.parameters = self._parameters(document.get("Parameters") or {}, stage, parameters)
        self._conditions: dict[str, bool] = {}
        self._names: dict[str, str] = {}
        self._naming: set[str] = set()
        self._intrinsics = self._functions()
        self.pseudo = {
            "AWS::Region": region,
            "AWS::AccountId": account_id,
            "AWS::Partition": PARTITION,
            "AWS::StackName": stack_name,
            "AWS::StackId": f"arn:{PARTITION}:cloudformation:{region}:{account_id}:stack/{stack_name}/"
            + _local_id(stack_name),
            "AWS::URLSuffix": "amazonaws.com",
        }

    @staticmethod
    def _parameters(declared: Mapping[str, Any], stage: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
        unknown = set(overrides) - set(declared)
        if unknown:
            raise TemplateError(f"Unknown template parameters: {', '.join(sorted(unknown))}.")
        values: dict[str, Any] = {}
        for name, spec in declared.items():
            if name in overrides:
                value = overrides[name]
            elif name == STAGE_PARAMETER:
                value = stage
            elif "Default" in spec:
                value = spec["Default"]
            else:
                raise TemplateError(f"Template parameter {name} has no default and no value was given.")
            kind = spec.get("Type", "String")
            if kind == "Number":
                value = _stringify(value)
            elif kind == "CommaDelimitedList" and isinstance(value, str):
                value = [item.strip() for item in value.split(",")] if value else []
            else:
                value = value if isinstance(value, list) else _stringify(value)
            _check_parameter(name, spec, value)
            values[name] = value
        return values

    # conditions

    def condition(self, name: str) -> bool:
        if name not in self._conditions:
            conditions = self.document.get("Conditions") or {}
            if name not in conditions:
                raise TemplateError(f"Unknown condition {name}.")
            self._conditions[name] = bool(self.value(conditions[name]))
        return self._conditions[name]

    def included(self, logical_id: str) -> bool:
        condition = self.resources[logical_id].get("Condition")
        return condition is None or self.condition(condition)

    # physical ids

    def name_of(self, logical_id: str) -> str:
        """The physical name of a resource (its name property, or one derived from the stack)."""
        if logical_id in self._names:
            return self._names[logical_id]
        if logical_id in self._naming:
            raise TemplateError(f"{logical_id}'s name depends on itself.")
        self._naming.add(logical_id)
        resource = self.resources[logical_id]
        prop = NAME_PROPERTIES.get(resource.get("Type", ""))
        raw = (resource.get("Properties") or {}).get(prop) if prop else None
        if raw is not None:
            name = _stringify(self.value(raw))
        else:
            name = f"{self.stack_name}-{logical_id}"
            if resource.get("Type") in BUCKET_TYPES:
                name = name.lower()[:63]
        self._naming.discard(logical_id)
        self._names[logical_id] = name
        return name

    def arn_of(self, logical_id: str) -> str:
        kind = self.resources[logical_id].get("Type", "")
        name = self.name_of(logical_id)
        prefix = f"arn:{PARTITION}"
        if kind in QUEUE_TYPES:
            return f"{prefix}:sqs:{self.region}:{self.account_id}:{name}"
        if kind in FUNCTION_TYPES:
            return f"{prefix}:lambda:{self.region}:{self.account_id}:function:{name}"
        if kind in STATE_MACHINE_TYPES:
            return f"{prefix}:states:{self.region}:{self.account_id}:stateMachine:{name}"
        if kind in BUCKET_TYPES:
            return f"{prefix}:s3:::{name}"
        if kind in TABLE_TYPES:
            return f"{prefix}:dynamodb:{self.region}:{self.account_id}:table/{name}"
        if kind in EVENT_BUS_TYPES:
            return f"{prefix}:events:{self.region}:{self.account_id}:event-bus/{name}"
        if kind in LAYER_TYPES:
            return f"{prefix}:lambda:{self.region}:{self.account_id}:layer:{name}:1"
        if kind in MANAGED_POLICY_TYPES:
            return f"{prefix}:iam::{self.account_id}:policy/{name}"
        if kind in TOPIC_TYPES:
            return f"{prefix}:sns:{self.region}:{self.account_id}:{name}"
        raise TemplateError(f"The local stack cannot give {logical_id} ({kind}) an ARN.")

    def queue_url(self, logical_id: str) -> str:
        return f"{self.endpoint_url}/{self.account_id}/{self.name_of(logical_id)}"

    def rest_api_id(self, logical_id: str) -> str:
        return _local_id(self.stack_name, logical_id)

    def ref(self, name: str) -> Any:
        if name in self.pseudo:
            return self.pseudo[name]
        if name == "AWS::NoValue":
            return _NO_VALUE
        if name in self.parameters:
            return self.parameters[name]
        if name not in self.resources:
            raise TemplateError(f"Ref to unknown name {name}.")
        kind = self.resources[name].get("Type", "")
        if kind in QUEUE_TYPES:
            return self.queue_url(name)
        if kind in STATE_MACHINE_TYPES or kind in LAYER_TYPES or kind in MANAGED_POLICY_TYPES or kind in TOPIC_TYPES:
            return self.arn_of(name)
        if kind in API_TYPES:
            return self.rest_api_id(name)
        if kind in NAME_PROPERTIES:
            return self.name_of(name)
        return name

    def get_att(self, logical_id: str, attribute: str) -> Any:
        if logical_id not in self.resources:
            raise TemplateError(f"GetAtt of unknown resource {logical_id}.")
        kind = self.resources[logical_id].get("Type", "")
        if attribute == "Arn":
            return self.arn_of(logical_id)
        if attribute in ("Name", "QueueName") and kind in NAME_PROPERTIES:
            return self.name_of(logical_id)
        if attribute == "QueueUrl" and kind in QUEUE_TYPES:
            return self.queue_url(logical_id)
        if attribute in ("DomainName", "RegionalDomainName") and kind in BUCKET_TYPES:
            return f"{self.name_of(logical_id)}.s3.amazonaws.com"
        if attribute == "RootResourceId" and kind in API_TYPES:
            return _local_id(self.stack_name, logical_id, "root")
        if attribute in ("Value", "Type") and kind in PARAMETER_TYPES:
            properties = self.resources[logical_id].get("Properties") or {}
            if attribute not in properties:
                raise TemplateError(f"GetAtt {logical_id}.{attribute}: the parameter sets no {attribute}.")
            return _stringify(self.value(properties[attribute]))
        raise TemplateError(f"The local stack cannot resolve GetAtt {logical_id}.{attribute}.")

    # intrinsic functions

    def value(self, node: Any) -> Any:
        """``node`` with every intrinsic function evaluated."""
        if isinstance(node, list):
            return [v for v in (self.value(item) for item in node) if v is not _NO_VALUE]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((key, arg),) = node.items()
            handler = self._intrinsics.get(key)
            if handler is not None:
                return handler(arg)
        resolved = {}
        for key, item in node.items():
            value = self.value(item)
            if value is not _NO_VALUE:
                resolved[key] = value
        return resolved

    def _functions(self) -> dict[str, Callable[[Any], Any]]:
        return {
            "Ref": lambda arg: self.ref(arg),
            "Fn::GetAtt": self._fn_get_att,
            "Fn::Sub": self._fn_sub,
            "Fn::If": self._fn_if,
            "Fn::Join": lambda arg: _stringify(self.value(arg[0])).join(_stringify(v) for v in self.value(arg[1])),
            "Fn::Select": lambda arg: self.value(arg[1])[int(self.value(arg[0]))],
            "Fn::Split": lambda arg: _stringify(self.value(arg[1])).split(self.value(arg[0])),
            "Fn::Equals": lambda arg: _stringify(self.value(arg[0])) == _stringify(self.value(arg[1])),
            "Fn::Not": lambda arg: not self.value(arg[0]),
            "Fn::And": lambda arg: all(self.value(a) for a in arg),
            "Fn::Or": lambda arg: any(self.value(a) for a in arg),
            "Condition": lambda arg: self.condition(arg),
            "Fn::FindInMap": self._fn_find_in_map,
            "Fn::Base64": lambda arg: base64.b64encode(_stringify(self.value(arg)).encode()).decode(),
            "Fn::GetAZs": lambda arg: [f"{self.region}{zone}" for zone in "abc"],
            "Fn::ToJsonString": lambda arg: json.dumps(self.value(arg)),
        }

    def _fn_get_att(self, arg: Any) -> Any:
        logical_id, attribute = self.value(arg) if isinstance(arg, list) else str(arg).split(".", 1)
        return self.get_att(logical_id, attribute)

    def _fn_if(self, arg: list[Any]) -> Any:
        name, when_true, when_false = arg
        return self.value(when_true if self.condition(name) else when_false)

    def _fn_find_in_map(self, arg: list[Any]) -> Any:
        map_name, top, second = (self.value(a) for a in arg[:3])
        try:
            return self.document["Mappings"][map_name][top][second]
        except KeyError as exc:
            raise TemplateError(f"FindInMap {map_name}/{top}/{second} has no value.") from exc

    def _fn_sub(self, arg: Any) -> str:
        if isinstance(arg, list):
            text, variables = arg[0], {k: self.value(v) for k, v in (arg[1] if len(arg) > 1 else {}).items()}
        else:
            text, variables = arg, {}

        def replace(match: re.Match[str]) -> str:
            inner = match.group(1)
            if inner.startswith("!"):
                return "${" + inner[1:] + "}"
            if inner in variables:
                return _stringify(variables[inner])
            if "." in inner and inner.split(".", 1)[0] in self.resources:
                logical_id, attribute = inner.split(".", 1)
                return _stringify(self.get_att(logical_id, attribute))
            return _stringify(self.ref(inner))

        return _SUB_VARIABLE.sub(replace, text)


class _Builder:
    """Builds the typed model from a resolver, one kind of resource at a time."""

    def __init__(self, resolver: _Resolver, base: Path) -> None:
        self.r = resolver
        self.base = base
        self.resources = {lid: res for lid, res in resolver.resources.items() if resolver.included(lid)}
        self.function_globals = ((resolver.document.get("Globals") or {}).get("Function")) or {}

    def props(self, logical_id: str) -> dict[str, Any]:
        return self.resources[logical_id].get("Properties") or {}

    def of_type(self, types: set[str]) -> list[str]:
        return [lid for lid, res in self.resources.items() if res.get("Type") in types]

    def functions(self) -> dict[str, Function]:
        functions: dict[str, Function] = {}
        for lid in self.of_type(FUNCTION_TYPES):
            is_sam = self.resources[lid]["Type"] == "AWS::Serverless::Function"
            raw = _merge_globals(self.function_globals, self.props(lid)) if is_sam else self.props(lid)
            resolved = self.r.value(raw)
            code_uri = resolved.get("CodeUri") or ""
            if not isinstance(code_uri, str):
                raise TemplateError(f"{lid}: the local stack runs CodeUri folders only, not {code_uri!r}.")
            variables = (resolved.get("Environment") or {}).get("Variables") or {}
            functions[lid] = Function(
                logical_id=lid,
                name=self.r.name_of(lid),
                arn=self.r.arn_of(lid),
                code_dir=(self.base / code_uri).resolve(),
                handler=resolved.get("Handler", "app.handler"),
                runtime=resolved.get("Runtime", "python3.11"),
                timeout=int(resolved.get("Timeout", 3)),
                memory_size=int(resolved.get("MemorySize", 128)),
                environment={k: _stringify(v) for k, v in variables.items()},
                events=resolved.get("Events") or {},
                vpc_config=resolved.get("VpcConfig"),
                layers=tuple(str(layer) for layer in resolved.get("Layers") or ()),
            )
        return functions

    def queues(self) -> dict[str, Queue]:
        queues: dict[str, Queue] = {}
        for lid in self.of_type(QUEUE_TYPES):
            resolved = self.r.value(self.props(lid))
            redrive = resolved.get("RedrivePolicy") or {}
            if isinstance(redrive, str):
                redrive = json.loads(redrive)
            skipped = ("QueueName", "RedrivePolicy", "Tags", "RedriveAllowPolicy")
            attributes = {key: _stringify(value) for key, value in resolved.items() if key not in skipped}
            if redrive:
                attributes["RedrivePolicy"] = json.dumps(
                    {
                        "deadLetterTargetArn": redrive["deadLetterTargetArn"],
                        "maxReceiveCount": int(redrive["maxReceiveCount"]),
                    }
                )
            queues[lid] = Queue(
                logical_id=lid,
                name=self.r.name_of(lid),
                url=self.r.queue_url(lid),
                arn=self.r.arn_of(lid),
                attributes=attributes,
                dead_letter_arn=redrive.get("deadLetterTargetArn"),
                max_receive_count=int(redrive["maxReceiveCount"]) if redrive else None,
            )
        return queues

    def buckets(self) -> dict[str, Bucket]:
        return {
            lid: Bucket(
                logical_id=lid,
                name=self.r.name_of(lid),
                arn=self.r.arn_of(lid),
                versioning=(self.r.value(self.props(lid).get("VersioningConfiguration")) or {}).get("Status"),
            )
            for lid in self.of_type(BUCKET_TYPES)
        }

    def tables(self) -> dict[str, Table]:
        tables: dict[str, Table] = {}
        for lid in self.of_type(TABLE_TYPES):
            resolved = self.r.value(self.props(lid))
            if self.resources[lid]["Type"] == "AWS::Serverless::SimpleTable":
                key = resolved.get("PrimaryKey") or {"Name": "id", "Type": "String"}
                attribute_type = {"String": "S", "Number": "N", "Binary": "B"}[key.get("Type", "String")]
                resolved = {
                    "KeySchema": [{"AttributeName": key["Name"], "KeyType": "HASH"}],
                    "AttributeDefinitions": [{"AttributeName": key["Name"], "AttributeType": attribute_type}],
                }
            ttl = resolved.get("TimeToLiveSpecification") or {}
            tables[lid] = Table(
                logical_id=lid,
                name=self.r.name_of(lid),
                arn=self.r.arn_of(lid),
                key_schema=resolved["KeySchema"],
                attribute_definitions=resolved["AttributeDefinitions"],
                billing_mode=resolved.get("BillingMode", "PAY_PER_REQUEST"),
                global_secondary_indexes=resolved.get("GlobalSecondaryIndexes") or [],
                ttl_attribute=ttl.get("AttributeName") if ttl.get("Enabled") in (True, "true") else None,
            )
        return tables

    def event_buses(self) -> dict[str, EventBus]:
        return {
            lid: EventBus(logical_id=lid, name=self.r.name_of(lid), arn=self.r.arn_of(lid))
            for lid in self.of_type(EVENT_BUS_TYPES)
        }

    def state_machines(self) -> dict[str, StateMachine]:
        machines: dict[str, StateMachine] = {}
        for lid in self.of_type(STATE_MACHINE_TYPES):
            raw = self.props(lid)
            uri = raw.get("DefinitionUri") or raw.get("DefinitionS3Location")
            inline = raw.get("Definition") or raw.get("DefinitionString")
            if uri is not None and not isinstance(uri, str):
                raise TemplateError(f"{lid}: the local stack reads DefinitionUri files only, not {uri!r}.")
            if inline is not None and not isinstance(inline, str):
                inline = json.dumps(self.r.value(inline), indent=2)
            substitutions = self.r.value(raw.get("DefinitionSubstitutions")) or {}
            machines[lid] = StateMachine(
                logical_id=lid,
                name=self.r.name_of(lid),
                arn=self.r.arn_of(lid),
                definition_uri=(self.base / uri).resolve() if uri else None,
                substitutions={k: _stringify(v) for k, v in substitutions.items()},
                inline_definition=inline,
            )
        return machines

    def apis(self, functions: Mapping[str, Function], stage: str) -> dict[str, Api]:
        function_by_arn = {f.arn: lid for lid, f in functions.items()}
        apis: dict[str, Api] = {}
        for lid in self.of_type(API_TYPES):
            resolved = self.r.value(self.props(lid))
            auth = resolved.get("Auth") or {}
            authorizers = {}
            for name, spec in (auth.get("Authorizers") or {}).items():
                target = function_by_arn.get(spec.get("FunctionArn", ""))
                if target is None:
                    raise TemplateError(f"{lid}: authorizer {name} does not point at a function of the template.")
                identity = spec.get("Identity") or {}
                headers = identity.get("Headers") or ([identity["Header"]] if "Header" in identity else [])
                authorizers[name] = Authorizer(
                    name=name,
                    function=target,
                    payload_type=spec.get("FunctionPayloadType", "TOKEN"),
                    identity_headers=tuple(headers),
                    identity_query_strings=tuple(identity.get("QueryStrings") or []),
                )
            default = auth.get("DefaultAuthorizer")
            if default and default not in authorizers:
                raise TemplateError(f"{lid}: DefaultAuthorizer {default} is not one the local stack plays.")
            apis[lid] = Api(
                logical_id=lid,
                name=self.r.name_of(lid),
                rest_api_id=self.r.rest_api_id(lid),
                stage_name=_stringify(resolved.get("StageName", stage)),
                default_authorizer=default,
                authorizers=authorizers,
                gateway_responses={kind: _gateway_response(lid, kind, spec)
                                   for kind, spec in (resolved.get("GatewayResponses") or {}).items()},
                throttle=_throttle(resolved.get("MethodSettings") or []),
            )
        return apis


def _gateway_response(api: str, kind: str, spec: Mapping[str, Any]) -> GatewayResponse:
    """A ``GatewayResponses`` entry; its headers must be static values (``"'1'"``)."""
    status = spec.get("StatusCode")
    body = (spec.get("ResponseTemplates") or {}).get("application/json")
    headers = []
    for name, value in ((spec.get("ResponseParameters") or {}).get("Headers") or {}).items():
        text = _stringify(value)
        if not (len(text) >= 2 and text[0] == text[-1] == "'"):
            raise TemplateError(f"{api}: GatewayResponses {kind}: header {name} is not a static value ('…'), "
                                f"the only kind the local stack plays.")
        headers.append((str(name), text[1:-1]))
    return GatewayResponse(None if status is None else int(status), None if body is None else str(body),
                           tuple(headers))


def _throttle(method_settings: list[Mapping[str, Any]]) -> Throttle | None:
    """The stage-wide throttle of ``MethodSettings`` (the entry for ``/*`` and ``*``), if any; the
    local stack plays no per-method settings."""
    for setting in method_settings:
        if setting.get("ResourcePath") == "/*" and setting.get("HttpMethod") == "*" \
                and "ThrottlingRateLimit" in setting:
            rate = float(_stringify(setting["ThrottlingRateLimit"]))
            burst = int(float(_stringify(setting.get("ThrottlingBurstLimit", rate))))
            return Throttle(rate=rate, burst=burst)
    return None


def _route(function: str, event_name: str, spec: Mapping[str, Any], apis: Mapping[str, Api]) -> Route:
    api = next((a for a in apis.values() if a.rest_api_id == spec.get("RestApiId")), None)
    wanted = (spec.get("Auth") or {}).get("Authorizer")
    if wanted is None and api is not None:
        wanted = api.default_authorizer
    authorizer = None
    if wanted not in (None, "NONE"):
        if api is None or wanted not in api.authorizers:
            raise TemplateError(f"{function}.{event_name}: authorizer {wanted} is not one the local stack plays.")
        authorizer = api.authorizers[wanted]
    return Route(
        api=api.logical_id if api else None,
        method=str(spec["Method"]).upper(),
        path=spec["Path"],
        function=function,
        event_name=event_name,
        authorizer=authorizer,
    )


def _sqs_source(function: str, event_name: str, spec: Mapping[str, Any], queues: Mapping[str, Queue]) -> SqsEventSource:
    queue = next((q for q in queues.values() if q.arn == spec.get("Queue")), None)
    if queue is None:
        raise TemplateError(f"{function}.{event_name}: the queue {spec.get('Queue')} is not in the template.")
    return SqsEventSource(
        function=function,
        queue=queue.logical_id,
        batch_size=int(spec.get("BatchSize", 10)),
        report_batch_item_failures="ReportBatchItemFailures" in (spec.get("FunctionResponseTypes") or []),
        enabled=spec.get("Enabled", True) not in (False, "false"),
        maximum_batching_window_seconds=int(spec.get("MaximumBatchingWindowInSeconds", 0)),
        maximum_concurrency=_maximum_concurrency(f"{function}.{event_name}", spec.get("ScalingConfig")),
    )


def _maximum_concurrency(event: str, scaling: Any) -> int | None:
    """``ScalingConfig.MaximumConcurrency`` of an SQS event, None when unset.

    Raises:
        TemplateError: it is not a whole number from 2 to 1000, which Lambda refuses.
    """
    if not isinstance(scaling, Mapping) or scaling.get("MaximumConcurrency") is None:
        return None
    raw = _stringify(scaling["MaximumConcurrency"])
    if not raw.isdigit() or not MIN_MAXIMUM_CONCURRENCY <= int(raw) <= MAX_MAXIMUM_CONCURRENCY:
        raise TemplateError(f"{event}: ScalingConfig.MaximumConcurrency {raw!r} is not a whole number from "
                            f"{MIN_MAXIMUM_CONCURRENCY} to {MAX_MAXIMUM_CONCURRENCY}.")
    return int(raw)


def _schedule(function: str, event_name: str, kind: str, spec: Mapping[str, Any]) -> Schedule:
    expression = str(spec.get("Schedule") if kind == "Schedule" else spec.get("ScheduleExpression"))
    enabled = spec.get("Enabled", True) not in (False, "false") and spec.get("State", "ENABLED") != "DISABLED"
    raw_input = spec.get("Input")
    return Schedule(
        function=function,
        event_name=event_name,
        expression=expression,
        rate_seconds=rate_seconds(expression),
        enabled=enabled,
        input=json.loads(raw_input) if isinstance(raw_input, str) else raw_input,
        kind=kind,
    )


def resolve(
    path: str | Path,
    *,
    stage: str = DEFAULT_STAGE,
    region: str = DEFAULT_REGION,
    account_id: str = DEFAULT_ACCOUNT_ID,
    parameters: Mapping[str, Any] | None = None,
    stack_name: str | None = None,
    endpoint_url: str = DEFAULT_ENDPOINT_URL,
) -> LocalTemplate:
    """Resolve the template at ``path`` for a local deployment.

    Args:
        path: the SAM template (code and definition paths are relative to its folder).
        stage: the deployment stage; fills the ``Stage`` parameter when the template has one.
        region, account_id: the local account the ARNs are built in.
        parameters: parameter overrides (values as strings or numbers).
        stack_name: ``AWS::StackName`` (default ``ferry-<stage>``).
        endpoint_url: the local AWS endpoint, the base of queue URLs.

    Raises:
        TemplateError: an unknown parameter, an intrinsic the local stack cannot evaluate, a
            reference to a missing resource, or an event the local stack cannot play.
    """
    path = Path(path).resolve()
    document = load_template(path)
    r = _Resolver(
        document,
        stage=stage,
        region=region,
        account_id=account_id,
        stack_name=stack_name or f"ferry-{stage}",
        endpoint_url=endpoint_url,
        parameters=parameters or {},
    )
    build = _Builder(r, path.parent)
    functions = build.functions()
    queues = build.queues()
    apis = build.apis(functions, stage)

    routes: list[Route] = []
    sqs_sources: list[SqsEventSource] = []
    schedules: list[Schedule] = []
    for lid, function in functions.items():
        for event_name, event in function.events.items():
            event_type = str(event.get("Type"))
            spec = event.get("Properties") or {}
            if event_type == "Api":
                routes.append(_route(lid, event_name, spec, apis))
            elif event_type == "SQS":
                sqs_sources.append(_sqs_source(lid, event_name, spec, queues))
            elif event_type in ("Schedule", "ScheduleV2"):
                schedules.append(_schedule(lid, event_name, event_type, spec))

    return LocalTemplate(
        path=path,
        stage=stage,
        region=region,
        account_id=account_id,
        stack_name=r.stack_name,
        endpoint_url=r.endpoint_url,
        parameters=dict(r.parameters),
        functions=functions,
        queues=queues,
        buckets=build.buckets(),
        tables=build.tables(),
        event_buses=build.event_buses(),
        state_machines=build.state_machines(),
        apis=apis,
        routes=routes,
        sqs_event_sources=sqs_sources,
        schedules=schedules,
        outputs={name: r.value(out.get("Value")) for name, out in (document.get("Outputs") or {}).items()},
    )
