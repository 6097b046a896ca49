"""Helpers for the API tests: API Gateway proxy events, the real handlers, a mocked cloud.

No tests here; ``test_api_*``, ``test_auth_*`` and ``test_images_*`` import from it (each
defines its ``cloud`` fixture as ``yield from mocked_cloud(...)`` over ``store``). The
handlers are loaded from ``functions/<name>/app.py`` as the template names them, so the
tests exercise exactly what API Gateway invokes.
"""

from __future__ import annotations

import importlib.util
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from moto import mock_aws
from moto_credentials import use_moto_credentials
from sqlalchemy import select
from sqlalchemy.exc import OperationalError, ProgrammingError

from ferry import aws, config, hosts, images, protocol
from ferry.compute import api as compute_api
from ferry.store.api_models import Flavor, utcnow
from ferry.store.cell_models import Service
from ferry.store.db import api_session, cell_session

ROOT = Path(__file__).resolve().parents[2]
API_HOST = "abc123.execute-api.us-east-1.amazonaws.com"
STAGE = "local"
BASE_URL = f"https://{API_HOST}/{STAGE}"
ACCOUNT = "123456789012"
ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/ferry-test"
PASS_DEFINITION = json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Succeed"}}})
IMAGE_BYTES = b"ferry-api-test-image" * 512

_functions: dict[str, ModuleType] = {}


def function(name: str) -> ModuleType:
    """The Lambda module ``functions/<name>/app.py`` (loaded once)."""
    if name not in _functions:
        spec = importlib.util.spec_from_file_location(f"ferry_function_{name}", ROOT / "functions" / name / "app.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _functions[name] = module
    return _functions[name]


class LambdaContext:
    function_name = "ferry-test-api"
    memory_limit_in_mb = 512
    invoked_function_arn = f"arn:aws:lambda:us-east-1:{ACCOUNT}:function:ferry-test-api"

    def __init__(self) -> None:
        self.aws_request_id = str(uuid.uuid4())


@dataclass(frozen=True)
class Caller:
    user_id: str
    project_id: str
    roles: tuple[str, ...] = ("member",)

    @property
    def authorizer(self) -> dict[str, Any]:
        """What API Gateway puts in requestContext.authorizer after our authorizer allowed the call."""
        return {"principalId": self.user_id, "user_id": self.user_id, "project_id": self.project_id,
                "roles": ",".join(self.roles), "integrationLatency": 0}


ALICE = Caller("alice", "project-a")
BOB = Caller("bob", "project-b")
ADMIN = Caller("root", "admin-project", ("admin", "member"))


def proxy_event(method: str, path: str, *, caller: Caller | None = ALICE, body: Any = None, raw_body: str | None = None,
                headers: dict[str, str] | None = None, query: dict[str, str | list[str]] | None = None,
                version: str | None = None, custom_domain: str | None = None) -> dict[str, Any]:
    """A REST API (v1) proxy event as API Gateway sends it for ``method path``.

    With ``custom_domain`` the request came through that domain name (no stage in its path).
    """
    all_headers = {"Host": API_HOST, "X-Forwarded-Proto": "https", "Accept": "application/json"}
    if version is not None:
        all_headers.update({"OpenStack-API-Version": f"compute {version}", "X-OpenStack-Nova-API-Version": version})
    if custom_domain is not None:
        all_headers["Host"] = custom_domain
    all_headers.update(headers or {})
    multi_query = {k: (v if isinstance(v, list) else [v]) for k, v in (query or {}).items()}
    request_context: dict[str, Any] = {
        "accountId": ACCOUNT, "apiId": "abc123", "stage": STAGE,
        "path": path if custom_domain else f"/{STAGE}{path}",
        "resourcePath": path if path in ("/", "/v2.1", "/v2.1/", "/identity/v3", "/volume/v3") else "/v2.1/{proxy+}",
        "httpMethod": method, "requestId": str(uuid.uuid4()), "domainName": custom_domain or API_HOST,
        "identity": {"sourceIp": "127.0.0.1"},
    }
    if caller is not None:
        request_context["authorizer"] = caller.authorizer
    return {
        "resource": request_context["resourcePath"],
        "path": path,
        "httpMethod": method,
        "headers": all_headers,
        "multiValueHeaders": {k: [v] for k, v in all_headers.items()},
        "queryStringParameters": {k: v[-1] for k, v in multi_query.items()} or None,
        "multiValueQueryStringParameters": multi_query or None,
        "pathParameters": {"proxy": path.removeprefix("/v2.1/")} if path.startswith("/v2.1/") else None,
        "stageVariables": None,
        "requestContext": request_context,
        "body": raw_body if raw_body is not None else (json.dumps(body) if body is not None else None),
        "isBase64Encoded": False,
    }


@dataclass
class ApiResponse:
    status: int
    headers: dict[str, str]
    body: Any

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers.items() if k.lower() == name.lower()), None)


def call(method: str, path: str, **options: Any) -> ApiResponse:
    """Invoke the API function with a proxy event; the JSON body is parsed."""
    result = function("api").handler(proxy_event(method, path, **options), LambdaContext())
    headers = {k: v[-1] for k, v in (result.get("multiValueHeaders") or {}).items()}
    headers.update(result.get("headers") or {})
    body = json.loads(result["body"]) if result.get("body") else None
    return ApiResponse(status=result["statusCode"], headers=headers, body=body)


@dataclass
class Cloud:
    """A mocked AWS side (S3 image bucket, state machines, host queues) over the test store."""

    sfn: Any
    image_id: str
    state_machines: dict[str, str]

    def executions(self, workflow: str) -> list[dict[str, Any]]:
        """Executions started on a workflow's state machine, each with its parsed ``input``."""
        arn = self.state_machines[workflow]
        listed = self.sfn.list_executions(stateMachineArn=arn)["executions"]
        return [{"name": e["name"], "input": json.loads(self.sfn.describe_execution(
            executionArn=e["executionArn"])["input"])} for e in listed]


def mocked_cloud(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Cloud]:
    """Body of each module's ``cloud`` fixture (use it over the ``store`` fixture).

    moto for S3, SQS and Step Functions, three dummy state machines (they do not run), the
    image ``cirros`` and the flavors ``1`` (m1.small) and ``2`` (m1.medium).
    """
    use_moto_credentials(monkeypatch)
    with mock_aws():
        aws.reset()
        hosts._queue_urls.clear()
        sfn = aws.client("stepfunctions")
        machines = {}
        for workflow in ("boot", "delete", "power"):
            arn = sfn.create_state_machine(name=f"ferry-test-{workflow}", definition=PASS_DEFINITION,
                                           roleArn=ROLE_ARN)["stateMachineArn"]
            monkeypatch.setenv(f"FERRY_{workflow.upper()}_STATE_MACHINE_ARN", arn)
            machines[workflow] = arn
        config.reset()
        aws.client("s3").create_bucket(Bucket=config.get().image_bucket)
        image_path = tmp_path / "cirros.raw"
        image_path.write_bytes(IMAGE_BYTES)
        image = images.register_image(image_path, "cirros")
        compute_api.create_flavor(name="m1.small", vcpus=1, memory_mb=512, root_gb=1, flavorid="1")
        compute_api.create_flavor(name="m1.medium", vcpus=2, memory_mb=1024, root_gb=2, flavorid="2")
        yield Cloud(sfn=sfn, image_id=image["id"], state_machines=machines)
        aws.reset()
        hosts._queue_urls.clear()


def add_host(host: str, cell: str = "cell1", *, up: bool = True) -> None:
    """A compute host with its agent queue and a service record (recent heartbeat when ``up``)."""
    aws.client("sqs").create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, host))
    with cell_session(cell) as session:
        session.add(Service(host=host, last_seen_at=utcnow() if up else None))


def create_server(caller: Caller = ALICE, *, name: str = "vm1", version: str = "2.90", **server: Any) -> str:
    """Create a server through the API; returns its id."""
    body = {"server": {"name": name, "flavorRef": "1", "networks": "auto", **server}}
    if "imageRef" not in body["server"] and "block_device_mapping_v2" not in body["server"]:
        body["server"]["imageRef"] = _image_id()
    response = call("POST", "/v2.1/servers", caller=caller, body=body, version=version)
    assert response.status == 202, response.body
    return response.body["server"]["id"]


def _image_id() -> str:
    return images.list_images(name="cirros")[0]["id"]


def flavor_named(name: str) -> Flavor | None:
    with api_session() as session:
        return session.scalars(select(Flavor).where(Flavor.name == name)).one_or_none()


def api_rows(model: Any, **where: Any) -> list[Any]:
    """The API database's rows of ``model`` whose columns equal ``where``."""
    with api_session() as session:
        query = select(model)
        for key, value in where.items():
            query = query.where(getattr(model, key) == value)
        return list(session.scalars(query))


def cell_away(monkeypatch: pytest.MonkeyPatch, module: ModuleType, away: str, *, broken: bool = False) -> None:
    """Make ``module``'s ``cell_session`` find cell ``away``'s database not answering (a
    connection refused); with ``broken``, every cell's refusing a statement for good instead (an
    error that is not of the moment)."""
    opened = module.cell_session

    def session_for(cell: Any) -> Any:
        if broken:
            raise ProgrammingError("SELECT", {}, Exception("relation does not exist"))
        if getattr(cell, "name", cell) == away:
            raise OperationalError("SELECT", {}, ConnectionRefusedError("could not connect to server"))
        return opened(cell)

    monkeypatch.setattr(module, "cell_session", session_for)
