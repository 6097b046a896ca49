"""Each function's role grants the AWS calls its code makes, found by reading the code.

The template gives every function its own role (SAM ``Policies``); a call the role does not
allow works on the local stack (moto checks no IAM) and fails on AWS with AccessDenied. So this
test reads the code, as a static analysis, and compares what it calls with what the role allows.

How the calls are found:

- **Roots.** A function's roots are its handler (``Handler: app.handler``) and the top-level
  code of its ``functions/<step>/app.py``, with the names they refer to
  (``boot.bind_resources_at_dest``, ``get_resolver``, ``hosts.apply_report``, ...).
- **Call graph.** Over the ``ferry`` package, by name: a module-level function, class or
  variable reaches every ``ferry`` name its body (or value) refers to, called or not, so
  callbacks, tables of functions and the like are followed. ``module.name`` and bare names are
  resolved through the module's imports (those inside functions too); a class counts as a whole
  (all its methods); a reference to a module itself (``(moves,)``) reaches the module. Reaching
  anything of a module reaches that module's top-level statements (they ran at import) and the
  definitions it registers with a decorator at import time (API routes, ``@server_action``,
  scheduler filters): decorators known to register nothing (``dataclass``, ``property``, ...)
  do not count.
- **Calls.** A reached body that calls ``aws.client("<service>")`` calls what is called on the
  result: ``aws.client("sqs").get_queue_url(...)``, or ``s3 = aws.client("s3")`` then
  ``s3.head_object(...)`` / ``s3.get_paginator("list_objects_v2")`` in the same body, or the
  helpers of :mod:`ferry.aws` it hands the client to (:data:`HELPER_OPERATIONS`). Each
  operation maps to its IAM action(s) (:data:`IAM_ACTIONS`, else the operation's CamelCase name).
- **Grants.** A role's ``Allow`` actions come from the SAM policy templates it uses
  (:data:`SAM_POLICY_TEMPLATES`), the managed policies it attaches by ``Ref`` and its inline
  statements. For S3, EventBridge and DynamoDB the grant must also name the stack's one bucket,
  bus or table the code is pointed at (``FERRY_IMAGE_BUCKET``, ...).

Limits (what it can miss or over-count):

- It over-approximates: a name referred to counts as called, whatever branch it sits in, so a
  role may be asked for a grant only a path it never takes needs. Then the grant is still due
  (or the reference moved): the code can take that path.
- It misses calls made through names it cannot resolve: methods called on objects whose class
  is never named in a reached body (the class is then not reached), overrides in subclasses
  of a class that is reached only by its base's name, ``getattr`` by string, a
  client stored in an attribute or returned (such a client, with no operation found on it, fails
  the test as an unknown operation rather than pass), AWS calls by third-party code (Powertools
  metrics go to the log, not to an API), and modules' import-time code of modules merely
  imported, not referred to.
- Step Functions and SQS grants are checked by action only: which state machine or queue a call
  reaches is decided at run time (an ARN from the environment, a host's queue).
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from test_template import _referenced_resources

from ferry.local.template import load_template, resolve

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_PATH = ROOT / "template.yaml"
TEMPLATE = resolve(TEMPLATE_PATH)
RAW = load_template(TEMPLATE_PATH)
PACKAGE_DIR = ROOT / "layers" / "core" / "python" / "ferry"

# botocore service name -> IAM service prefix.
IAM_PREFIX = {"stepfunctions": "states", "s3": "s3", "sqs": "sqs", "events": "events", "dynamodb": "dynamodb"}
# Operations whose IAM action is not their CamelCase name (the others' is: start_execution -> StartExecution).
IAM_ACTIONS = {
    ("s3", "head_object"): {"s3:GetObject"},
    ("s3", "list_objects_v2"): {"s3:ListBucket"},
    ("s3", "list_objects"): {"s3:ListBucket"},
    ("s3", "copy_object"): {"s3:GetObject", "s3:PutObject"},
    ("s3", "copy"): {"s3:GetObject", "s3:PutObject"},
    ("s3", "upload_part_copy"): {"s3:GetObject", "s3:PutObject"},
    ("s3", "create_multipart_upload"): {"s3:PutObject"},
    ("s3", "upload_part"): {"s3:PutObject"},
    ("s3", "complete_multipart_upload"): {"s3:PutObject"},
    ("s3", "delete_objects"): {"s3:DeleteObject"},
    ("s3", "list_multipart_uploads"): {"s3:ListBucketMultipartUploads"},
    ("sqs", "send_message_batch"): {"sqs:SendMessage"},
    ("sqs", "delete_message_batch"): {"sqs:DeleteMessage"},
    ("dynamodb", "transact_write_items"): {"dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem"},
}
# The helpers of ferry.aws that are handed an S3 client, and what they call on it.
HELPER_OPERATIONS = {
    "abort_uploads": {("s3", "list_multipart_uploads"), ("s3", "abort_multipart_upload")},
    "upload_fileobj": {("s3", "put_object"), ("s3", "create_multipart_upload"), ("s3", "upload_part"),
                       ("s3", "complete_multipart_upload"), ("s3", "abort_multipart_upload")},
}
# The rest of ferry.aws: makes a client, or calls no AWS API.
AWS_MODULE_OTHERS = {"client", "reset"}
# The SAM policy templates the template uses: their actions (SAM's policy_templates.json).
SAM_POLICY_TEMPLATES = {
    "S3ReadPolicy": {"s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation", "s3:GetObjectVersion",
                     "s3:GetLifecycleConfiguration"},
    "S3WritePolicy": {"s3:PutObject", "s3:PutObjectAcl", "s3:PutLifecycleConfiguration"},
    "S3CrudPolicy": {"s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation", "s3:GetObjectVersion", "s3:PutObject",
                     "s3:PutObjectAcl", "s3:GetLifecycleConfiguration", "s3:PutLifecycleConfiguration",
                     "s3:DeleteObject"},
    "EventBridgePutEventsPolicy": {"events:PutEvents"},
    "StepFunctionsExecutionPolicy": {"states:StartExecution"},
    "DynamoDBCrudPolicy": {"dynamodb:GetItem", "dynamodb:DeleteItem", "dynamodb:PutItem", "dynamodb:Scan",
                           "dynamodb:Query", "dynamodb:UpdateItem", "dynamodb:BatchWriteItem",
                           "dynamodb:BatchGetItem", "dynamodb:DescribeTable", "dynamodb:ConditionCheckItem"},
    "DynamoDBReadPolicy": {"dynamodb:GetItem", "dynamodb:Scan", "dynamodb:Query", "dynamodb:BatchGetItem",
                           "dynamodb:DescribeTable"},
    "LambdaInvokePolicy": {"lambda:InvokeFunction"},
    "SQSSendMessagePolicy": {"sqs:SendMessage*"},
}
# Services whose calls reach one resource of the stack, which a grant must name.
SERVICE_RESOURCE = {"s3": "ImageBucket", "events": "NotificationBus", "dynamodb": "IdempotencyTable"}
# Decorators that register nothing at import time.
INERT_DECORATORS = {"dataclass", "property", "staticmethod", "classmethod", "contextmanager", "cache", "lru_cache",
                    "cached_property", "wraps", "abstractmethod", "overload", "total_ordering", "setter"}
UNKNOWN = "<unknown>"


# --- the call graph over ferry -------------------------------------------------------------------

Node = tuple[str, str]  # (module, top-level name); the name "" is the module's top-level code


@dataclass
class Module:
    name: str
    tree: ast.Module
    aliases: dict[str, str] = field(default_factory=dict)  # local name -> dotted ferry name
    definitions: dict[str, ast.AST] = field(default_factory=dict)  # top-level name -> its statement


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parse(name: str, source: str) -> Module:
    module = Module(name, ast.parse(source))
    package = name if name in PACKAGES else name.rpartition(".")[0]
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ferry":
                    local = alias.asname or alias.name.split(".")[0]
                    module.aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up one level for each dot after the first
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] == "ferry":
                for alias in node.names:
                    module.aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    for statement in module.tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.definitions[statement.name] = statement
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                for bound in ast.walk(target):
                    if isinstance(bound, ast.Name):
                        module.definitions[bound.id] = statement
    return module


PACKAGES = {_module_name(p) for p in PACKAGE_DIR.rglob("__init__.py")}
MODULES = {_module_name(p): _parse(_module_name(p), p.read_text()) for p in PACKAGE_DIR.rglob("*.py")}


def _resolve_dotted(dotted: str, seen: frozenset[str] = frozenset()) -> Node | None:
    """The node a dotted ferry name stands for (``ferry.images.image_location``), None if unknown."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        if module_name in MODULES:
            rest = parts[cut:]
            if not rest:
                return (module_name, "")
            module = MODULES[module_name]
            if rest[0] in module.definitions:
                return (module_name, rest[0])  # a class's method counts as its class
            if rest[0] in module.aliases and dotted not in seen:  # a name the module imported (re-exported)
                return _resolve_dotted(".".join([module.aliases[rest[0]], *rest[1:]]), seen | {dotted})
            return None
    return None


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]`` when it is a name followed by attributes; else None."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


def _resolve_chain(module: Module, chain: list[str]) -> Node | None:
    head, rest = chain[0], chain[1:]
    if head in module.definitions:
        return (module.name, head)
    if head in module.aliases:
        return _resolve_dotted(".".join([module.aliases[head], *rest]))
    return None


def _references(module: Module, body: ast.AST) -> set[Node]:
    """Every ferry node ``body`` refers to (by a bare name or a dotted one)."""
    found: set[Node] = set()
    for node in ast.walk(body):
        if isinstance(node, (ast.Attribute, ast.Name)):
            chain = _chain(node)
            if chain is not None:
                target = _resolve_chain(module, chain)
                if target is not None:
                    found.add(target)
    return found


def _decorator_name(decorator: ast.AST) -> str:
    if isinstance(decorator, ast.Call):
        decorator = decorator.func
    chain = _chain(decorator) or [""]
    return chain[-1]


def _registered_at_import(module: Module) -> set[Node]:
    """Top-level definitions a decorator does something with at import (a route, a registry)."""
    return {(module.name, statement.name) for statement in module.tree.body
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and any(_decorator_name(d) not in INERT_DECORATORS for d in statement.decorator_list)}


def _top_level_code(module: Module) -> list[ast.stmt]:
    """What runs at import besides defining functions and classes (their decorators included)."""
    code: list[ast.stmt] = []
    for statement in module.tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            code.extend(ast.Expr(d) for d in statement.decorator_list)
        elif not isinstance(statement, (ast.Import, ast.ImportFrom)):
            code.append(statement)
    return code


def _edges(module: Module, name: str) -> set[Node]:
    if name == "":
        body: ast.AST = ast.Module(body=_top_level_code(module), type_ignores=[])
        return _references(module, body) | _registered_at_import(module)
    statement = module.definitions[name]
    value = statement.value if isinstance(statement, (ast.Assign, ast.AnnAssign)) else statement
    return (_references(module, value) if value is not None else set()) | {(module.name, "")}


def _reached(root: Module, entry: str) -> set[Node]:
    """Every node a handler module ``root`` reaches from its top-level code and its ``entry`` point."""
    modules = {**MODULES, root.name: root}
    seen: set[Node] = set()
    todo = deque([(root.name, ""), *([(root.name, entry)] if entry in root.definitions else [])])
    while todo:
        node = todo.popleft()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(_edges(modules[node[0]], node[1]) - seen)
    return seen


# --- the AWS calls in a body ---------------------------------------------------------------------


def _is_client_call(module: Module, node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (chain := _chain(node.func)) is not None \
        and _resolve_chain(module, chain) == ("ferry.aws", "client")


def _constant(node: ast.AST | None) -> str:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else UNKNOWN


def _operation(call: ast.Call, attribute: str) -> str:
    return _constant(call.args[0] if call.args else None) if attribute == "get_paginator" else attribute


def _aws_operations(module: Module, name: str) -> set[tuple[str, str]]:
    """The (service, operation) pairs the body of ``module.name`` calls on the clients it makes."""
    if module.name == "ferry.aws" and name in HELPER_OPERATIONS:
        return set(HELPER_OPERATIONS[name])
    if name == "":
        body: ast.AST = ast.Module(body=_top_level_code(module), type_ignores=[])
    else:
        body = module.definitions[name]
    parents = {child: parent for parent in ast.walk(body) for child in ast.iter_child_nodes(parent)}
    operations: set[tuple[str, str]] = set()
    for call in (n for n in ast.walk(body) if _is_client_call(module, n)):
        assert isinstance(call, ast.Call)
        service = _constant(call.args[0] if call.args else None)
        parent = parents.get(call)
        found: set[str] = set()
        if isinstance(parent, ast.Attribute) and isinstance(outer := parents.get(parent), ast.Call) \
                and outer.func is parent:
            found.add(_operation(outer, parent.attr))  # aws.client("sqs").get_queue_url(...)
        variable = _bound_to(call, parents)
        if variable is not None:
            found |= _operations_on(module, body, variable, service)
        operations |= {(service, operation) for operation in found or {UNKNOWN}}
    return operations


def _bound_to(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> str | None:
    """The variable ``x = aws.client(...)`` (or ``x, y = aws.client(...), ...``) binds the client to."""
    parent = parents.get(call)
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0], ast.Name):
        return parent.targets[0].id
    if isinstance(parent, ast.Tuple) and isinstance(assign := parents.get(parent), ast.Assign):
        [target] = assign.targets
        if isinstance(target, ast.Tuple) and len(target.elts) == len(parent.elts):
            bound = target.elts[parent.elts.index(call)]
            return bound.id if isinstance(bound, ast.Name) else None
    return None


def _operations_on(module: Module, body: ast.AST, variable: str, service: str) -> set[str]:
    found: set[str] = set()
    for call in (n for n in ast.walk(body) if isinstance(n, ast.Call)):
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == variable:
            found.add(_operation(call, func.attr))
        elif any(isinstance(a, ast.Name) and a.id == variable for a in call.args):
            chain = _chain(func)
            target = _resolve_chain(module, chain) if chain else None
            if target is not None and target[0] == "ferry.aws" and target[1] in HELPER_OPERATIONS:
                found |= {op for svc, op in HELPER_OPERATIONS[target[1]] if svc == service}
    return found


def _iam_actions(service: str, operation: str) -> set[str]:
    if (service, operation) in IAM_ACTIONS:
        return IAM_ACTIONS[(service, operation)]
    camel = "".join(part.capitalize() for part in operation.split("_"))
    return {f"{IAM_PREFIX.get(service, service)}:{camel}"}


def _handler_module(logical_id: str) -> Module:
    path = TEMPLATE.functions[logical_id].module_path
    return _parse(f"functions.{path.parent.name}.app", path.read_text())


def _calls_of(logical_id: str) -> dict[tuple[str, str], set[Node]]:
    """``{(service, operation): the nodes that make the call}`` of a function's code."""
    root = _handler_module(logical_id)
    modules = {**MODULES, root.name: root}
    calls: dict[tuple[str, str], set[Node]] = {}
    for node in _reached(root, TEMPLATE.functions[logical_id].handler_attribute):
        for call in _aws_operations(modules[node[0]], node[1]):
            calls.setdefault(call, set()).add(node)
    return calls


# --- what a role allows --------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    actions: frozenset[str]
    resources: frozenset[str]  # the template's resources the grant names
    source: str


def _statement_grants(statements: list[dict[str, Any]], source: str) -> Iterator[Grant]:
    for statement in statements:
        if statement.get("Effect") == "Allow":
            actions = statement.get("Action", [])
            yield Grant(frozenset([actions] if isinstance(actions, str) else actions),
                        frozenset(_referenced_resources(statement.get("Resource"))), source)


def _grants_of(logical_id: str) -> list[Grant]:
    grants: list[Grant] = []
    for item in RAW["Resources"][logical_id]["Properties"].get("Policies") or []:
        assert isinstance(item, dict), f"{logical_id}: a policy by name ({item}) is not read by this test"
        if "Statement" in item:
            grants += _statement_grants(item["Statement"], f"{logical_id} inline")
        elif "Ref" in item:
            managed = RAW["Resources"][item["Ref"]]
            assert managed["Type"] == "AWS::IAM::ManagedPolicy", item
            grants += _statement_grants(managed["Properties"]["PolicyDocument"]["Statement"], item["Ref"])
        else:
            [(template, parameters)] = item.items()
            assert template in SAM_POLICY_TEMPLATES, (
                f"{logical_id}: add {template}'s actions (SAM's policy_templates.json) to SAM_POLICY_TEMPLATES")
            grants.append(Grant(frozenset(SAM_POLICY_TEMPLATES[template]),
                                frozenset(_referenced_resources(parameters)), template))
    return grants


def _allows(grants: list[Grant], service: str, action: str) -> bool:
    resource = SERVICE_RESOURCE.get(service)
    return any(fnmatch.fnmatch(action.lower(), granted.lower())
               and (resource is None or resource in grant.resources)
               for grant in grants for granted in grant.actions)


def _missing(logical_id: str) -> list[str]:
    grants = _grants_of(logical_id)
    missing = []
    for (service, operation), where in sorted(_calls_of(logical_id).items()):
        callers = ", ".join(sorted(f"{m}.{n}" if n else m for m, n in where))
        if UNKNOWN in (service, operation):
            missing.append(f"{service}.{operation}: not understood, in {callers}")
            continue
        for action in sorted(_iam_actions(service, operation)):
            if not _allows(grants, service, action):
                on = f" on {SERVICE_RESOURCE[service]}" if service in SERVICE_RESOURCE else ""
                missing.append(f"{action}{on} ({service}.{operation} in {callers})")
    return missing


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("logical_id", sorted(TEMPLATE.functions))
def test_a_functions_role_allows_every_aws_call_its_code_makes(logical_id):
    assert _missing(logical_id) == []


def test_the_analysis_finds_the_image_read_of_a_boots_bind_step():
    """BindResourcesAtDest reads the image's location (images.image_location -> head_object)."""
    calls = _calls_of("BindResourcesAtDestFunction")

    assert ("ferry.images", "_head") in calls[("s3", "head_object")]
    assert _allows(_grants_of("BindResourcesAtDestFunction"), "s3", "s3:GetObject")


def test_the_analysis_reports_a_role_without_the_grant_its_code_needs(monkeypatch):
    """What the test above would have said before the bind step had its grant."""
    properties = dict(RAW["Resources"]["BindResourcesAtDestFunction"]["Properties"])
    properties.pop("Policies", None)
    monkeypatch.setitem(RAW["Resources"], "BindResourcesAtDestFunction",
                        {**RAW["Resources"]["BindResourcesAtDestFunction"], "Properties": properties})

    assert any(line.startswith("s3:GetObject on ImageBucket (s3.head_object in ferry.images._head")
               for line in _missing("BindResourcesAtDestFunction"))


def test_the_analysis_sees_each_kind_of_call_the_functions_make():
    """A blind analysis passes everything: each service the code uses is found where it is known to be."""
    def services(logical_id: str) -> set[str]:
        return {service for service, _ in _calls_of(logical_id)}

    assert "s3" in services("ApiFunction")  # image look-ups
    assert {"s3"} <= services("CheckMoveCommittedFunction")  # deletes a cross-cell snapshot
    assert {"stepfunctions", "events"} <= services("ApiFunction")
    assert "dynamodb" in services("DrainWebhookFunction")
    assert "sqs" in services("ReportHostStateFunction")
    assert ("sqs", "send_message_batch") in _calls_of("ReportHostStateFunction")
    assert "s3" not in services("SelectDestinationsFunction")  # a boot's scheduling reads no image


def test_the_helpers_of_ferry_aws_that_take_a_client_are_known():
    """A new helper handed a client would hide its calls from the analysis: list them here."""
    public = {name for name, statement in MODULES["ferry.aws"].definitions.items()
              if isinstance(statement, ast.FunctionDef)}

    assert public == set(HELPER_OPERATIONS) | AWS_MODULE_OTHERS


def test_the_code_makes_clients_only_through_ferry_aws():
    """boto3 or botocore clients made elsewhere would be invisible to the analysis."""
    makers = re.compile(r"\bboto3\.client\(|\bcreate_client\(|\bboto3\.resource\(")
    places = [str(path.relative_to(ROOT)) for path in PACKAGE_DIR.rglob("*.py")
              if makers.search(path.read_text()) and _module_name(path) != "ferry.aws"
              and not _module_name(path).startswith("ferry.local")]

    assert places == []
