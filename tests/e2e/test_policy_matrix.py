"""Every action the compute API exposes, as every kind of caller, answers as the default policy says.

The matrix is built from :data:`ferry.policy.DEFAULT_RULES`: each rule names the request that
checks it (:data:`PROBES`), and the expected answer follows from the rule's word:

* no token: 401 (the gateway refuses before the API runs);
* ``admin``: an admin passes, the owner ``demo`` is refused with 403;
* ``admin_or_owner``: the admin and the owner pass; ``alt`` (a member of another project) gets
  403 for a project target (quotas) and 404 for another project's server or server group,
  which it must not learn exists, whatever the rule;
* ``member`` / ``@``: every caller with a token passes.

"Passes" means authorisation went through: the answer is not 401 or 403 (and not 404 for a
server the caller may see). Probes are chosen to be refused early or to be harmless once
authorised (an unknown flavor, the server's own host, a state conflict), so nothing moves.
A new rule without a probe, or a new route no probe exercises, fails the coverage tests.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import Servers
from sqlalchemy import delete

from ferry import policy
from ferry.api import openapi
from ferry.store.api_models import Volume
from ferry.store.db import api_session

pytestmark = pytest.mark.e2e

IDENTITIES = ("admin", "demo", "alt", None)
OWNER_PROJECT = "demo"
OTHER_PROJECT = "e2e-policy-other"
NO_SUCH_UUID = "00000000-0000-4000-8000-000000000000"


@dataclass(frozen=True)
class Probe:
    """One request: ``path`` is the route with ``{server_id}`` etc. filled from the module's resources.

    ``server``: the server the path names (``active``, ``shutoff`` or ``fresh``: booted for this
    request, so deleting it costs nothing), or None. ``project``: the project a quota request names,
    or owning the group. ``group``: the path names a server group ``demo`` makes for this request
    (and the admin deletes after it).
    ``passes``: statuses an authorised caller may get besides any non-401/403/404 (e.g. 404 for an
    unknown aggregate looked up after the policy check). ``values``: path values of this probe only.
    """

    method: str
    route: str
    body: Any = None
    query: dict[str, str] = field(default_factory=dict)
    server: str | None = None
    project: str | None = None
    passes: frozenset[int] = frozenset()
    values: dict[str, str] = field(default_factory=dict)
    group: bool = False


V = "/v2.1"
VOLUME = "/volume/v3"
S = f"{V}/servers/{{server_id}}"
NOT_FOUND = frozenset({404})
_action = f"{S}/action"
GROUP = f"{V}/os-server-groups/{{group_id}}"

# rule -> the request that checks it.
PROBES: dict[str, Probe] = {
    # servers
    "os_compute_api:servers:index": Probe("GET", f"{V}/servers"),
    "os_compute_api:servers:detail": Probe("GET", f"{V}/servers/detail"),
    "os_compute_api:servers:index:get_all_tenants": Probe("GET", f"{V}/servers", query={"all_tenants": "1"}),
    "os_compute_api:servers:detail:get_all_tenants": Probe("GET", f"{V}/servers/detail", query={"all_tenants": "1"}),
    "os_compute_api:servers:show": Probe("GET", S, server="active"),
    "os_compute_api:servers:create": Probe("POST", f"{V}/servers", body={"server": {
        "name": "e2e-policy", "flavorRef": "no-such-flavor", "networks": "auto"}}),
    "os_compute_api:servers:delete": Probe("DELETE", S, server="fresh"),
    "os_compute_api:servers:update": Probe("PUT", S, body={"server": {"name": "e2e-policy-active"}}, server="active"),
    "os_compute_api:servers:start": Probe("POST", _action, body={"os-start": None}, server="active"),
    "os_compute_api:servers:stop": Probe("POST", _action, body={"os-stop": None}, server="shutoff"),
    "os_compute_api:os-admin-actions:reset_state": Probe("POST", _action, body={"os-resetState": {"state": "active"}},
                                                         server="active"),
    "os_compute_api:os-instance-actions:list": Probe("GET", f"{S}/os-instance-actions", server="active"),
    "os_compute_api:os-instance-actions:show": Probe("GET", f"{S}/os-instance-actions/{{request_id}}",
                                                     server="active"),
    # moves: each refused once authorised (unknown flavor, not resized, the server's own host)
    "os_compute_api:servers:resize": Probe("POST", _action, body={"resize": {"flavorRef": "no-such-flavor"}},
                                           server="active"),
    "os_compute_api:servers:confirm_resize": Probe("POST", _action, body={"confirmResize": None}, server="active"),
    "os_compute_api:servers:revert_resize": Probe("POST", _action, body={"revertResize": None}, server="active"),
    "os_compute_api:os-migrate-server:migrate": Probe("POST", _action, body={"migrate": {"host": "{host}"}},
                                                      server="active"),
    "os_compute_api:os-migrate-server:migrate:host": Probe("POST", _action, body={"migrate": {"host": "{host}"}},
                                                           server="active"),
    "os_compute_api:os-migrations:index": Probe("GET", f"{V}/os-migrations"),
    "os_compute_api:servers:migrations:index": Probe("GET", f"{S}/migrations", server="active"),
    "os_compute_api:servers:migrations:show": Probe("GET", f"{S}/migrations/{{migration_id}}", server="active",
                                                    passes=NOT_FOUND),
    # no server migrates live: an authorised caller gets Nova's 409
    "os_compute_api:servers:migrations:delete": Probe("DELETE", f"{S}/migrations/{{migration_id}}",
                                                      server="active"),
    "os_compute_api:servers:migrations:force_complete": Probe(
        "POST", f"{S}/migrations/{{migration_id}}/action", body={"force_complete": None}, server="active"),
    # flavors
    "os_compute_api:os-flavor-manage:create": Probe("POST", f"{V}/flavors", body={"flavor": {}}),
    "os_compute_api:os-flavor-manage:update": Probe("PUT", f"{V}/flavors/{{flavor_id}}", body={"flavor": {}}),
    "os_compute_api:os-flavor-manage:delete": Probe("DELETE", f"{V}/flavors/{{flavor_id}}", passes=NOT_FOUND,
                                                    values={"flavor_id": "e2e-no-such-flavor"}),
    "os_compute_api:os-flavor-access": Probe("GET", f"{V}/flavors/{{flavor_id}}/os-flavor-access",
                                             passes=NOT_FOUND),  # a public flavor has no access list
    "os_compute_api:os-flavor-access:add_tenant_access": Probe(
        "POST", f"{V}/flavors/{{flavor_id}}/action", body={"addTenantAccess": {"tenant": OTHER_PROJECT}}),
    "os_compute_api:os-flavor-access:remove_tenant_access": Probe(
        "POST", f"{V}/flavors/{{flavor_id}}/action", body={"removeTenantAccess": {"tenant": OTHER_PROJECT}},
        passes=NOT_FOUND),
    "os_compute_api:os-flavor-extra-specs:index": Probe("GET", f"{V}/flavors/{{flavor_id}}/os-extra_specs"),
    "os_compute_api:os-flavor-extra-specs:show": Probe("GET", f"{V}/flavors/{{flavor_id}}/os-extra_specs/{{key}}",
                                                       passes=NOT_FOUND),
    "os_compute_api:os-flavor-extra-specs:create": Probe("POST", f"{V}/flavors/{{flavor_id}}/os-extra_specs",
                                                         body={}),
    "os_compute_api:os-flavor-extra-specs:update": Probe("PUT", f"{V}/flavors/{{flavor_id}}/os-extra_specs/{{key}}",
                                                         body={}),
    "os_compute_api:os-flavor-extra-specs:delete": Probe(
        "DELETE", f"{V}/flavors/{{flavor_id}}/os-extra_specs/{{key}}", passes=NOT_FOUND),
    # quotas and limits (a project target: another project is 403, not 404)
    "os_compute_api:os-quota-sets:show": Probe("GET", f"{V}/os-quota-sets/{{project_id}}", project=OWNER_PROJECT),
    "os_compute_api:os-quota-sets:detail": Probe("GET", f"{V}/os-quota-sets/{{project_id}}/detail",
                                                 project=OWNER_PROJECT),
    "os_compute_api:os-quota-sets:defaults": Probe("GET", f"{V}/os-quota-sets/{{project_id}}/defaults",
                                                   project=OWNER_PROJECT),
    "os_compute_api:os-quota-sets:update": Probe("PUT", f"{V}/os-quota-sets/{{project_id}}", body={},
                                                 project=OWNER_PROJECT),
    "os_compute_api:os-quota-sets:delete": Probe("DELETE", f"{V}/os-quota-sets/{{project_id}}",
                                                 project=OTHER_PROJECT),
    "os_compute_api:limits": Probe("GET", f"{V}/limits"),
    "os_compute_api:limits:other_project": Probe("GET", f"{V}/limits", query={"tenant_id": OTHER_PROJECT}),
    # volume attachments (the volume is unknown: 404 once authorised)
    "os_compute_api:os-volumes-attachments:index": Probe("GET", f"{S}/os-volume_attachments", server="active"),
    "os_compute_api:os-volumes-attachments:show": Probe("GET", f"{S}/os-volume_attachments/{{volume_id}}",
                                                        server="active", passes=NOT_FOUND),
    "os_compute_api:os-volumes-attachments:create": Probe(
        "POST", f"{S}/os-volume_attachments", body={"volumeAttachment": {"volumeId": NO_SUCH_UUID}},
        server="active", passes=NOT_FOUND),
    "os_compute_api:os-volumes-attachments:delete": Probe("DELETE", f"{S}/os-volume_attachments/{{volume_id}}",
                                                          server="active", passes=NOT_FOUND),
    # host aggregates (an unknown aggregate, or a body refused after the policy)
    "os_compute_api:os-aggregates:index": Probe("GET", f"{V}/os-aggregates"),
    "os_compute_api:os-aggregates:create": Probe("POST", f"{V}/os-aggregates", body={"aggregate": {}}),
    "os_compute_api:os-aggregates:show": Probe("GET", f"{V}/os-aggregates/{{aggregate_id}}", passes=NOT_FOUND),
    "os_compute_api:os-aggregates:update": Probe("PUT", f"{V}/os-aggregates/{{aggregate_id}}",
                                                 body={"aggregate": {}}),
    "os_compute_api:os-aggregates:delete": Probe("DELETE", f"{V}/os-aggregates/{{aggregate_id}}", passes=NOT_FOUND),
    "os_compute_api:os-aggregates:add_host": Probe("POST", f"{V}/os-aggregates/{{aggregate_id}}/action",
                                                   body={"add_host": {"host": "{host}"}}, passes=NOT_FOUND),
    "os_compute_api:os-aggregates:remove_host": Probe("POST", f"{V}/os-aggregates/{{aggregate_id}}/action",
                                                      body={"remove_host": {"host": "{host}"}}, passes=NOT_FOUND),
    "os_compute_api:os-aggregates:set_metadata": Probe("POST", f"{V}/os-aggregates/{{aggregate_id}}/action",
                                                       body={"set_metadata": {"metadata": {}}}, passes=NOT_FOUND),
    # server groups (demo's own, made for the request; an empty body is refused after the policy)
    "os_compute_api:os-server-groups:index": Probe("GET", f"{V}/os-server-groups"),
    "os_compute_api:os-server-groups:create": Probe("POST", f"{V}/os-server-groups", body={"server_group": {}}),
    "os_compute_api:os-server-groups:show": Probe("GET", GROUP, project=OWNER_PROJECT, group=True),
    "os_compute_api:os-server-groups:delete": Probe("DELETE", GROUP, project=OWNER_PROJECT, group=True),
    # compute services (a path that is not a uuid: 400 once authorised)
    "os_compute_api:os-services:list": Probe("GET", f"{V}/os-services"),
    "os_compute_api:os-services:update": Probe("PUT", f"{V}/os-services/{{service_id}}", body={}),
    "os_compute_api:os-services:delete": Probe("DELETE", f"{V}/os-services/{{service_id}}"),
    # drains
    "ferry:drains:create": Probe("POST", f"{V}/ferry/drains", body={}),
    "ferry:drains:list": Probe("GET", f"{V}/ferry/drains"),
    "ferry:drains:show": Probe("GET", f"{V}/ferry/drains/{{drain_id}}", passes=NOT_FOUND),
    "ferry:drains:action": Probe("POST", f"{V}/ferry/drains/{{drain_id}}/action", body={"pause": None},
                                 passes=NOT_FOUND),
    # volume look-ups (Block Storage v3)
    "volume:get_all": Probe("GET", f"{VOLUME}/volumes/detail"),
    # demo's own volume: another project's member is told 404, as for a server
    "volume:get": Probe("GET", f"{VOLUME}/volumes/{{volume_id}}", values={"volume_id": "{demo_volume}"}),
}

# Rules that more than one route checks: their other routes.
MORE_PROBES: list[tuple[str, Probe]] = [
    ("volume:get_all", Probe("GET", f"{VOLUME}/volumes")),
]

# Routes without a policy rule of their own: any caller with a token.
TOKEN_ONLY: dict[str, Probe] = {
    "flavors:index": Probe("GET", f"{V}/flavors"),
    "flavors:detail": Probe("GET", f"{V}/flavors/detail"),
    "flavors:show": Probe("GET", f"{V}/flavors/{{flavor_id}}"),
    "images:index": Probe("GET", f"{V}/images"),
    "images:show": Probe("GET", f"{V}/images/{{image_id}}"),
    # a member sees her own project only: another is 404, as if unknown
    "identity:projects:index": Probe("GET", "/identity/v3/projects"),
    "identity:projects:show": Probe("GET", "/identity/v3/projects/{project_id}", passes=NOT_FOUND,
                                    values={"project_id": OWNER_PROJECT}),
    # a member may look up only herself: another user is 403, Keystone's answer (clients then use the name)
    "identity:users:index": Probe("GET", "/identity/v3/users"),
    "identity:users:show": Probe("GET", "/identity/v3/users/{user_id}", passes=frozenset({403}),
                                 values={"user_id": "{demo_user}"}),
    # the one domain, default: every caller with a token may look it up
    "identity:domains:index": Probe("GET", "/identity/v3/domains"),
    "identity:domains:show": Probe("GET", "/identity/v3/domains/{domain_id}", values={"domain_id": "default"}),
}

# Rules that decide what an answer shows or what a workflow may do, not whether a request is
# allowed: they have no status to check here.
NOT_A_REQUEST = {
    "os_compute_api:servers:create:zero_disk_flavor": "checked on create with a zero-disk flavor (boots a server)",
    "os_compute_api:os-extended-server-attributes": "which fields a server shows",
    "os_compute_api:servers:show:host_status": "which fields a server shows",
    "compute:servers:create:requested_destination": "checked on create with a host (boots a server)",
    "os_compute_api:os-instance-actions:events": "which fields an event shows",
    "os_compute_api:os-instance-actions:events:details": "which fields an event shows",
    "compute:servers:resize:cross_cell": "whether the scheduler may pick another cell",
    "os_compute_api:os-server-groups:index:all_projects": "whose groups a list shows (others get their own)",
    "volume_extension:volume_tenant_attribute": "which fields a volume shows",
}

# What the probes put in the paths besides the module's resources (unknown ids, refused after the policy).
PATH_VALUES = {"key": "e2e-no-such-key", "migration_id": "1",
               "aggregate_id": "999999", "service_id": "not-a-uuid", "drain_id": NO_SUCH_UUID,
               "volume_id": NO_SUCH_UUID}


def test_every_default_rule_has_a_probe_or_a_reason():
    assert set(PROBES) | set(NOT_A_REQUEST) == set(policy.DEFAULT_RULES)
    assert not set(PROBES) & set(NOT_A_REQUEST)


def test_every_route_that_needs_a_token_is_probed():
    probed = {(p.method, p.route) for p in [*PROBES.values(), *TOKEN_ONLY.values(), *(p for _, p in MORE_PROBES)]}
    needs_token = {(m, p) for m, p in openapi.routes() if p not in openapi.PUBLIC_PATHS}

    assert needs_token - probed == set()


def _expected(rule: str | None, identity: str | None, probe: Probe) -> str:
    """``"401"``, ``"403"``, ``"404"`` or ``"pass"``."""
    if identity is None:
        return "401"
    if (probe.server is not None or probe.group) and identity == "alt":
        return "404"  # another project's server or group does not exist for the caller, whatever the rule
    word = policy.MEMBER if rule is None else policy.DEFAULT_RULES[rule]
    if word == policy.NOBODY:
        return "403"
    if word in (policy.MEMBER, policy.ANYONE) or identity == "admin":
        return "pass"
    if word == policy.ADMIN_OR_OWNER:
        owner = OWNER_PROJECT if probe.server is not None else probe.project
        return "pass" if owner in (None, identity) else "403"
    return "403"


@pytest.fixture(scope="module")
def resources(local_stack):
    """An ACTIVE and a SHUTOFF server of ``demo``, and the other values the probes' paths need."""
    helper = Servers(local_stack)
    demo_volume = str(uuid.uuid4())
    try:
        active = helper.boot("demo", name="e2e-policy-active")
        shutoff = helper.boot("demo", name="e2e-policy-shutoff")["id"]
        assert helper.action(shutoff, {"os-stop": None}).status_code == 202
        helper.wait_for_status(shutoff, "SHUTOFF")
        actions = helper.api("admin").get(f"/servers/{active['id']}/os-instance-actions").json()["instanceActions"]
        with api_session() as session:
            session.add(Volume(id=demo_volume, name="e2e-policy-volume", size_gb=1,
                               project_id=local_stack.seeded.identities["demo"].project_id,
                               path=str(local_stack.state_dir / "volumes" / demo_volume)))
        yield {"helper": helper, "active": active["id"], "shutoff": shutoff, "demo_volume": demo_volume,
               "demo_user": local_stack.seeded.identities["demo"].user_id,
               "host": active["OS-EXT-SRV-ATTR:host"], "request_id": actions[0]["request_id"],
               "flavor_id": local_stack.seeded.flavors[0], "image_id": local_stack.seeded.image["id"]}
        seeded = {f: helper.api("admin").get(f"/flavors/{f}").status_code for f in local_stack.seeded.flavors}
        assert set(seeded.values()) == {200}, f"a probe changed the seeded flavors: {seeded}"
    finally:
        helper.delete_all()
        with api_session() as session:
            session.execute(delete(Volume).where(Volume.id == demo_volume))


def _fill(text: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        text = text.replace("{" + name + "}", value)
    return text


def _request(local_stack, resources, identity: str | None, probe: Probe):
    helper: Servers = resources["helper"]
    values = {**PATH_VALUES, **{k: v for k, v in resources.items() if isinstance(v, str)}}
    values = {k: _fill(v, values) for k, v in {**values, **probe.values}.items()}
    if probe.server == "fresh":
        created = helper.create({"server": {"name": "e2e-policy-fresh", "flavorRef": values["flavor_id"],
                                            "imageRef": values["image_id"], "networks": "auto"}}, "demo")
        assert created.status_code == 202, created.text
        values["server_id"] = created.json()["server"]["id"]
    elif probe.server is not None:
        values["server_id"] = resources[probe.server]
    if probe.project is not None:
        values["project_id"] = probe.project
    if probe.group:
        made = helper.api("demo").post("/os-server-groups", json={"server_group": {
            "name": "e2e-policy-group", "policy": "anti-affinity"}})
        assert made.status_code == 200, made.text
        values["group_id"] = made.json()["server_group"]["id"]
        try:
            return _send(local_stack, identity, probe, values)
        finally:
            helper.api("admin").delete(f"/os-server-groups/{values['group_id']}")
    return _send(local_stack, identity, probe, values)


def _send(local_stack, identity: str | None, probe: Probe, values: dict[str, str]):
    path = _fill(probe.route, values)
    # Compute paths are relative to the session's /v2.1; identity and volume paths sit beside it.
    path = path.removeprefix(V) if path.startswith(V + "/") else local_stack.api_url.removesuffix(V) + path
    body = probe.body
    if body is not None:
        body = _fill_body(body, values)
    session = local_stack.session(identity)
    session.headers["OpenStack-API-Version"] = "compute latest"
    return session.request(probe.method, path, params=probe.query, json=body)


def _fill_body(body: Any, values: dict[str, str]) -> Any:
    if isinstance(body, dict):
        return {k: _fill_body(v, values) for k, v in body.items()}
    return _fill(body, values) if isinstance(body, str) else body


MATRIX = [pytest.param(rule, identity, probe,
                       id=f"{rule or f'{probe.method} {probe.route}'}-{identity or 'no-token'}")
          for rule, probe in [*PROBES.items(), *MORE_PROBES, *((None, p) for p in TOKEN_ONLY.values())]
          for identity in IDENTITIES]


@pytest.mark.parametrize(("rule", "identity", "probe"), MATRIX)
def test_the_answer_follows_the_default_policy(local_stack, resources, rule, identity, probe):
    expected = _expected(rule, identity, probe)

    response = _request(local_stack, resources, identity, probe)

    status = response.status_code
    assert status < 500, response.text
    if expected == "pass":
        refused = {401, 403} if probe.server is None else {401, 403, 404}
        assert status not in refused - probe.passes, f"{identity} was refused: {status} {response.text}"
    else:
        assert status == int(expected), f"{identity}: expected {expected}, got {status} {response.text}"
    if status == 404 and probe.server is not None and identity == "alt":
        assert "itemNotFound" in response.json()  # the API's own not-found, not a gateway answer

