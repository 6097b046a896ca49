"""Fuzz every operation of the compute API with schemathesis, from the document the API serves.

Each operation gets a few generated requests that match the document (positive) and a few that
do not (negative), as the admin and as the member ``demo``. Every answer must be documented:
no 5xx, a documented status, a documented content type, headers and body schema.

What the fuzzer may touch, so that the session's other tests and ``ferry audit`` still pass:

* Requests naming a flavor, host aggregate or project to change (``PUT``/``DELETE`` of a
  flavor, its extra specs, an aggregate and its actions, a project's quotas) have that path
  parameter pinned to a flavor, aggregate or project created for the fuzz, never a seeded one
  (a generated ``1`` would otherwise be the seeded flavor ``1``).
* Compute services are not changed or deleted at all (``PUT``/``DELETE /os-services/{id}``
  are left out): below 2.53 a generated integer id deletes a seeded host.
* Server requests run against generated ids and against one server booted for the fuzz
  (``DELETE`` of that server excepted), so actions reach a real server.
* A valid ``os-resetState`` is not sent: it sets a server's state whatever its records say (a
  move's migration and allocations stay as they were, as in Nova), which the session's audit
  would report. Its refusals (invalid bodies) are fuzzed.
* At the end every server, flavor, aggregate and drain the fuzz created is deleted (servers are
  waited for), the fuzz project's quotas are reset, and the seeded flavors are checked intact.

The run is bounded by a fixed number of examples per operation and a derandomized seed (about
1,800 requests, under two minutes locally). Negative cases may drop the token: their 401 is
checked against the document too.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 8
IDENTITIES = ("admin", "demo")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]

# (method, path): never run (see the docstring).
EXCLUDED = {("PUT", "/v2.1/os-services/{service_id}"), ("DELETE", "/v2.1/os-services/{service_id}")}
# Path parameters that, for writes, always name the fuzz's own resource.
PINNED_FOR_WRITES = ("flavor_id", "aggregate_id", "project_id")


def _settings() -> Callable[[Any], Any]:
    return settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def _inventory(admin: requests.Session) -> dict[str, set[str]]:
    def ids(path: str, key: str, **params: str) -> set[str]:
        response = admin.get(path, params=params)
        assert response.status_code == 200, response.text
        return {str(item["id"]) for item in response.json()[key]}

    return {"servers": ids("/servers", "servers", all_tenants="1"),
            "flavors": ids("/flavors", "flavors", is_public="None"),
            "aggregates": ids("/os-aggregates", "aggregates"),
            "drains": ids("/ferry/drains", "drains")}


def _clean_up(local_stack, admin: requests.Session, before: dict[str, set[str]], project: str) -> None:
    after = _inventory(admin)
    for drain_id in after["drains"] - before["drains"]:
        admin.post(f"/ferry/drains/{drain_id}/action", json={"cancel": None})
    for server_id in after["servers"] - before["servers"]:
        # A move the fuzz started refuses the delete (409) until it has settled.
        local_stack.wait_for(lambda sid=server_id: admin.delete(f"/servers/{sid}").status_code in (204, 404),
                             timeout=180, interval=2)
    for server_id in after["servers"] - before["servers"]:
        local_stack.wait_for(lambda sid=server_id: admin.get(f"/servers/{sid}").status_code == 404, timeout=180)
    for aggregate_id in after["aggregates"] - before["aggregates"]:
        shown = admin.get(f"/os-aggregates/{aggregate_id}")
        for host in shown.json()["aggregate"]["hosts"] if shown.status_code == 200 else []:
            admin.post(f"/os-aggregates/{aggregate_id}/action", json={"remove_host": {"host": host}})
        assert admin.delete(f"/os-aggregates/{aggregate_id}").status_code in (200, 404)
    for flavor_id in after["flavors"] - before["flavors"]:
        assert admin.delete(f"/flavors/{flavor_id}").status_code in (202, 404)
    assert admin.delete(f"/os-quota-sets/{project}").status_code == 202


def test_every_operation_answers_as_documented(local_stack, servers):
    admin = local_stack.session("admin")
    admin.headers["OpenStack-API-Version"] = "compute latest"
    before = _inventory(admin)
    seeded_flavors = {f["id"]: f for f in admin.get("/flavors/detail").json()["flavors"]}
    target_server = servers.boot("demo", name="e2e-fuzz")["id"]
    flavor = admin.post("/flavors", json={"flavor": {"name": f"e2e-fuzz-{uuid.uuid4().hex[:8]}", "ram": 64,
                                                     "vcpus": 1, "disk": 1}})
    assert flavor.status_code == 200, flavor.text
    aggregate = admin.post("/os-aggregates", json={"aggregate": {"name": f"e2e-fuzz-{uuid.uuid4().hex[:8]}"}})
    assert aggregate.status_code == 200, aggregate.text
    pinned = {"flavor_id": flavor.json()["flavor"]["id"], "aggregate_id": str(aggregate.json()["aggregate"]["id"]),
              "project_id": "e2e-fuzz-project"}

    schema = schemathesis.openapi.from_url(f"{local_stack.api_url}/openapi.json")
    base_url = local_stack.api_url.removesuffix("/v2.1")
    failures: dict[tuple[str, str, str], str] = {}
    runs = 0
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            method, path = operation.method.upper(), operation.path
            if (method, path) in EXCLUDED:
                continue
            names = {p.name for p in operation.path_parameters}
            variants: list[dict[str, str]] = []
            writes = method != "GET"
            if writes and names & set(PINNED_FOR_WRITES):
                variants.append({n: pinned[n] for n in names if n in pinned})
            else:
                variants.append({})
                if "server_id" in names and not (method == "DELETE" and path.endswith("{server_id}")):
                    variants.append({"server_id": target_server})
            for identity in IDENTITIES:
                session = requests.Session()
                token = {"X-Auth-Token": local_stack.tokens[identity]}
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    for fixed in variants:
                        label = f"{method} {path} as {identity} ({mode.value}{', pinned' if fixed else ''})"
                        runs += 1
                        _fuzz(operation, mode, fixed, session, token, base_url, label, failures)
    finally:
        _clean_up(local_stack, admin, before, pinned["project_id"])
        servers.delete_all()

    assert runs > 100
    after = {f["id"]: f for f in admin.get("/flavors/detail").json()["flavors"]}
    assert {k: after.get(k) for k in seeded_flavors} == seeded_flavors
    assert not failures, "\n\n".join(f"{label}\n{message}" for label, message in sorted(
        (f"{k[0]} [{k[1]}]", v) for k, v in failures.items()))


def _fuzz(operation, mode, fixed: dict[str, str], session: requests.Session, token: dict[str, str], base_url: str,
          label: str,
          failures: dict[tuple[str, str, str], str]) -> None:
    """Run the operation's generated cases; record the first failure of each kind instead of stopping."""
    try:
        strategy = operation.as_strategy(generation_mode=mode, path_parameters=fixed or None)
    except Exception as exc:  # an operation with nothing to negate has no negative cases
        if mode is GenerationMode.NEGATIVE:
            return
        failures[(label, "strategy", type(exc).__name__)] = str(exc)
        return

    @_settings()
    @given(case=strategy)
    def run(case) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "os-resetState" in case.body:
            return
        if fixed:
            case.path_parameters = {**(case.path_parameters or {}), **fixed}
        try:
            # The token replaces the one generated for the security scheme.
            response = case.call(base_url=base_url, session=session, headers=token, timeout=60)
            case.validate_response(response, checks=CHECKS, headers=token)
        except Exception as exc:  # record and go on: one report for the whole run
            key = (label, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            failures.setdefault(key, f"{exc}\n{case.as_curl_command()}")

    try:
        run()
    except Exception as exc:  # generation itself failed (e.g. an unsatisfiable negative schema)
        if mode is not GenerationMode.NEGATIVE:
            failures[(label, "generation", type(exc).__name__)] = str(exc)
