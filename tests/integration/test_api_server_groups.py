"""Server groups through the real API handler: /os-server-groups at each microversion, their quotas,
the ``group`` scheduler hint at create, and members leaving with their server (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from test_api_support import ADMIN, ALICE, BOB, ApiResponse, Caller, api_rows, call, create_server, mocked_cloud

from ferry import images, quotas
from ferry.store.api_models import (
    BuildRequest,
    InstanceGroup,
    InstanceGroupMember,
    InstanceMapping,
    Port,
    RequestSpec,
)

CAROL = Caller("carol", "project-a")  # ALICE's project, another user
GROUPS = "/v2.1/os-server-groups"


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


def post_group(group: dict[str, Any], *, caller: Caller = ALICE, version: str = "2.64") -> ApiResponse:
    return call("POST", GROUPS, caller=caller, body={"server_group": group}, version=version)


def make_group(caller: Caller = ALICE, *, name: str = "web", policy: str = "anti-affinity", **extra: Any) -> str:
    """Create a group at 2.64; returns its id."""
    response = post_group({"name": name, "policy": policy, **extra}, caller=caller)
    assert response.status == 200, response.body
    return response.body["server_group"]["id"]


def boot(caller: Caller = ALICE, *, hints: dict[str, Any], key: str = "os:scheduler_hints") -> ApiResponse:
    """POST /servers with scheduler hints beside ``server``."""
    image = images.list_images(name="cirros")[0]["id"]
    body = {"server": {"name": "vm", "flavorRef": "1", "networks": "auto", "imageRef": image}, key: hints}
    return call("POST", "/v2.1/servers", caller=caller, body=body, version="2.90")


def members(group_id: str, caller: Caller = ALICE) -> list[str]:
    response = call("GET", f"{GROUPS}/{group_id}", caller=caller, version="2.64")
    assert response.status == 200, response.body
    return response.body["server_group"]["members"]


def listed(caller: Caller = ALICE, query: dict[str, str] | None = None, version: str = "2.64") -> list[str]:
    response = call("GET", GROUPS, caller=caller, query=query, version=version)
    assert response.status == 200, response.body
    return [g["name"] for g in response.body["server_groups"]]


def server_groups_shown(server_id: str, version: str = "2.71") -> Any:
    response = call("GET", f"/v2.1/servers/{server_id}", version=version)
    assert response.status == 200, response.body
    return response.body["server"].get("server_groups", "absent")


def nothing_booted() -> bool:
    models = (InstanceMapping, BuildRequest, RequestSpec, Port, InstanceGroupMember)
    return all(api_rows(model) == [] for model in models)


# --- create ----------------------------------------------------------------------------------------


def test_create_below_2_64_takes_a_list_of_one_policy_and_shows_policies_and_empty_metadata(cloud):
    response = post_group({"name": "db", "policies": ["affinity"]}, version="2.1")

    assert response.status == 200
    shown = response.body["server_group"]
    assert set(shown) == {"id", "name", "policies", "members", "metadata"}
    assert (shown["name"], shown["policies"], shown["members"], shown["metadata"]) == ("db", ["affinity"], [], {})
    [row] = api_rows(InstanceGroup)
    assert (row.uuid, row.policy, row.project_id, row.user_id) == (shown["id"], "affinity", "project-a", "alice")


@pytest.mark.parametrize(("version", "policy"), [("2.1", "soft-affinity"), ("2.14", "soft-anti-affinity")])
def test_soft_policies_are_refused_below_2_15(cloud, version, policy):
    response = post_group({"name": "g", "policies": [policy]}, version=version)

    assert response.status == 400
    assert api_rows(InstanceGroup) == []


@pytest.mark.parametrize("policies", [["affinity", "anti-affinity"], ["affinity", "affinity"], [], ["spread"]])
def test_create_below_2_64_refuses_anything_but_one_known_policy(cloud, policies):
    response = post_group({"name": "g", "policies": policies}, version="2.1")

    assert response.status == 400
    assert api_rows(InstanceGroup) == []


@pytest.mark.parametrize("policy", ["soft-affinity", "soft-anti-affinity"])
def test_soft_policies_are_accepted_from_2_15(cloud, policy):
    response = post_group({"name": "g", "policies": [policy]}, version="2.15")

    assert response.status == 200
    assert response.body["server_group"]["policies"] == [policy]
    assert [row.policy for row in api_rows(InstanceGroup)] == [policy]


@pytest.mark.parametrize("bound", [3, "3"])  # a string of digits is stored as a number
def test_create_at_2_64_takes_a_policy_and_a_bound_per_host(cloud, bound):
    response = post_group({"name": "spread", "policy": "anti-affinity", "rules": {"max_server_per_host": bound}})

    assert response.status == 200
    shown = response.body["server_group"]
    assert (shown["policy"], shown["rules"]) == ("anti-affinity", {"max_server_per_host": 3})
    assert "policies" not in shown and "metadata" not in shown
    assert api_rows(InstanceGroup)[0].rules == {"max_server_per_host": 3}


def test_a_group_without_rules_shows_empty_rules_at_2_64(cloud):
    shown = post_group({"name": "g", "policy": "soft-affinity"}).body["server_group"]

    assert (shown["policy"], shown["rules"]) == ("soft-affinity", {})
    assert api_rows(InstanceGroup)[0].rules == {}


@pytest.mark.parametrize(("group", "message"), [
    ({"policy": "affinity", "rules": {"max_server_per_host": 2}}, "Only anti-affinity policy supports rules."),
    ({"policy": "soft-anti-affinity", "rules": {"max_server_per_host": 2}},
     "Only anti-affinity policy supports rules."),
    ({"policy": "anti-affinity", "rules": {"max_server_per_host": 0}}, "max_server_per_host"),
    ({"policy": "anti-affinity", "rules": {"max_server_per_host": "0"}}, "max_server_per_host"),
    ({"policy": "anti-affinity", "rules": {"max_server_per_host": -1}}, "max_server_per_host"),
    ({"policy": "anti-affinity", "rules": {"max_server_per_host": "two"}}, "max_server_per_host"),
    ({"policy": "anti-affinity", "rules": {"max_servers": 2}}, "max_servers"),
    ({"policies": ["anti-affinity"]}, "policies"),  # the old field is gone at 2.64
])
def test_create_at_2_64_refuses_rules_that_do_not_fit(cloud, group, message):
    response = post_group({"name": "g", **group})

    assert response.status == 400
    assert message in response.body["badRequest"]["message"]
    assert api_rows(InstanceGroup) == []


def test_the_policy_field_is_refused_below_2_64(cloud):
    response = post_group({"name": "g", "policy": "anti-affinity"}, version="2.63")

    assert response.status == 400
    assert api_rows(InstanceGroup) == []


@pytest.mark.parametrize("name", ["", " leading", "trailing ", "tab\tinside", "x" * 256])
def test_create_refuses_a_name_nova_does_not_take(cloud, name):
    response = post_group({"name": name, "policy": "affinity"})

    assert response.status == 400
    assert api_rows(InstanceGroup) == []


@pytest.mark.parametrize(("version", "keys"), [
    ("2.1", {"id", "name", "members", "policies", "metadata"}),
    ("2.12", {"id", "name", "members", "policies", "metadata"}),
    ("2.13", {"id", "name", "members", "policies", "metadata", "project_id", "user_id"}),
    ("2.64", {"id", "name", "members", "policy", "rules", "project_id", "user_id"}),
])
def test_a_group_is_shown_in_the_shape_of_the_microversion(cloud, version, keys):
    group_id = make_group(rules={"max_server_per_host": 2})

    shown = call("GET", f"{GROUPS}/{group_id}", version=version).body["server_group"]
    listed_one = call("GET", GROUPS, version=version).body["server_groups"][0]

    assert set(shown) == keys and listed_one == shown
    if "project_id" in keys:
        assert (shown["project_id"], shown["user_id"]) == ("project-a", "alice")
    if "policies" in keys:
        assert shown["policies"] == ["anti-affinity"] and shown["metadata"] == {}


# --- list, show, delete ----------------------------------------------------------------------------


def test_a_list_holds_the_callers_project_groups_only(cloud):
    make_group(name="a1")
    make_group(CAROL, name="a2")
    make_group(BOB, name="b1")

    assert listed(ALICE) == ["a1", "a2"]  # CAROL's too: same project
    assert listed(BOB) == ["b1"]
    assert listed(BOB, {"all_projects": "True"}) == ["b1"]  # a member's all_projects is ignored


def test_an_admin_lists_every_project_only_with_all_projects(cloud):
    make_group(name="a1")
    make_group(BOB, name="b1")
    make_group(ADMIN, name="mine")

    assert listed(ADMIN) == ["mine"]
    assert listed(ADMIN, {"all_projects": "1"}) == ["a1", "b1", "mine"]
    assert listed(ADMIN, {"all_projects": ""}) == ["a1", "b1", "mine"]  # present is enough, as in Nova


def test_a_list_is_paged_by_limit_and_offset(cloud):
    for name in ("g1", "g2", "g3"):
        make_group(name=name)

    assert listed(query={"limit": "2"}) == ["g1", "g2"]
    assert listed(query={"limit": "1", "offset": "1"}) == ["g2"]
    assert listed(query={"offset": "2"}) == ["g3"]
    assert listed(query={"offset": "3"}) == []
    for bad in ({"limit": "-1"}, {"limit": "x"}, {"offset": "-1"}):
        assert call("GET", GROUPS, query=bad, version="2.64").status == 400


def test_an_offset_or_limit_beyond_any_list_is_an_empty_page_or_the_largest_one(cloud):
    for name in ("g1", "g2"):
        make_group(name=name)
    huge = str(2**63)  # beyond a 64-bit SQL integer

    beyond = call("GET", GROUPS, query={"offset": huge}, version="2.64")
    both = call("GET", GROUPS, query={"offset": huge, "limit": huge}, version="2.64")

    assert (beyond.status, beyond.body) == (200, {"server_groups": []})  # as Nova answers
    assert (both.status, both.body) == (200, {"server_groups": []})
    assert listed(query={"limit": huge}) == ["g1", "g2"]
    assert listed(ADMIN, {"all_projects": "1", "offset": huge}) == []


def test_an_unknown_query_parameter_is_refused_from_2_75(cloud):
    make_group()

    assert call("GET", GROUPS, query={"name": "web"}, version="2.74").status == 200
    assert call("GET", GROUPS, query={"name": "web"}, version="2.75").status == 400


def test_another_projects_group_is_not_found_to_a_member(cloud):
    group_id = make_group()

    # As in Nova, whose look-up is scoped to the caller's project: the group's existence is not told.
    for method in ("GET", "DELETE"):
        response = call(method, f"{GROUPS}/{group_id}", caller=BOB, version="2.64")
        assert response.status == 404
        assert response.body["itemNotFound"]["message"] == f"Instance group {group_id} could not be found."

    assert [row.uuid for row in api_rows(InstanceGroup)] == [group_id]
    assert call("GET", f"{GROUPS}/{group_id}", caller=CAROL, version="2.64").status == 200  # same project


def test_an_admin_shows_and_deletes_another_projects_group(cloud):
    group_id = make_group()

    assert call("GET", f"{GROUPS}/{group_id}", caller=ADMIN, version="2.64").status == 200
    response = call("DELETE", f"{GROUPS}/{group_id}", caller=ADMIN, version="2.64")

    assert response.status == 204 and response.body is None
    assert api_rows(InstanceGroup) == []
    assert call("GET", f"{GROUPS}/{group_id}", version="2.64").status == 404


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_an_unknown_group_is_not_found(cloud, method):
    missing = str(uuid.uuid4())

    response = call(method, f"{GROUPS}/{missing}", version="2.64")

    assert response.status == 404
    assert response.body["itemNotFound"]["message"] == f"Instance group {missing} could not be found."


# --- quotas ----------------------------------------------------------------------------------------


def test_a_group_over_the_projects_server_groups_quota_is_refused_and_not_created(cloud):
    quotas.update("project-a", {"server_groups": 1})
    make_group(name="first")

    response = post_group({"name": "second", "policy": "affinity"}, caller=CAROL)

    assert response.status == 403
    assert response.body["forbidden"]["message"] == "Quota exceeded, too many server groups."
    assert [row.name for row in api_rows(InstanceGroup)] == ["first"]
    make_group(BOB, name="elsewhere")  # another project's quota is its own


def test_a_group_that_lost_the_race_for_the_last_place_is_removed_again(cloud, monkeypatch):
    # GIVEN a quota of one, and a concurrent create that took the place after this one's first count
    quotas.update("project-a", {"server_groups": 1})
    make_group(CAROL, name="rival")
    counts, real_count = iter([0]), quotas.server_groups_used

    def first_count_misses_the_rival(project_id, session=None):
        faked = next(counts, None)
        return real_count(project_id, session) if faked is None else faked

    monkeypatch.setattr(quotas, "server_groups_used", first_count_misses_the_rival)

    # WHEN this create counts again after writing, THEN it is refused and its group is gone
    response = post_group({"name": "late", "policy": "affinity"})

    assert response.status == 403
    assert [row.name for row in api_rows(InstanceGroup)] == ["rival"]


def test_the_server_groups_quota_is_not_set_below_the_groups_in_use_unless_forced(cloud):
    make_group(name="a1")
    make_group(name="a2")

    refused = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN, body={"quota_set": {"server_groups": 1}})
    forced = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN,
                  body={"quota_set": {"server_groups": 1, "force": True}})

    assert refused.status == 400
    assert refused.body["badRequest"]["message"] == (
        "Quota limit 1 for server_groups must be greater than or equal to already used and reserved 2.")
    assert (forced.status, forced.body["quota_set"]["server_groups"]) == (200, 1)


def test_a_zero_server_groups_quota_set_through_the_api_refuses_the_first_group(cloud):
    assert call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN,
                body={"quota_set": {"server_groups": 0}}).status == 200

    assert post_group({"name": "g", "policy": "affinity"}).status == 403
    assert api_rows(InstanceGroup) == []


def test_limits_and_quota_detail_count_the_projects_groups(cloud):
    make_group(name="a1")
    make_group(CAROL, name="a2")
    make_group(BOB, name="b1")

    absolute = call("GET", "/v2.1/limits", version="2.64").body["limits"]["absolute"]
    detail = call("GET", "/v2.1/os-quota-sets/project-a/detail", caller=ADMIN, version="2.64").body["quota_set"]

    assert (absolute["totalServerGroupsUsed"], absolute["maxServerGroups"]) == (2, 10)
    assert detail["server_groups"]["in_use"] == 2


# --- the group scheduler hint ----------------------------------------------------------------------


@pytest.mark.parametrize("key", ["os:scheduler_hints", "OS-SCH-HNT:scheduler_hints"])
def test_a_server_booted_with_the_group_hint_joins_the_group(cloud, key):
    group_id = make_group()

    response = boot(hints={"group": group_id}, key=key)

    assert response.status == 202, response.body
    server_id = response.body["server"]["id"]
    assert members(group_id) == [server_id]
    spec = api_rows(RequestSpec, instance_uuid=server_id)[0].spec
    assert spec["group"] == {"uuid": group_id}
    assert "group" not in spec["scheduler_hints"]


def test_a_single_servers_view_names_its_group_from_2_71(cloud):
    group_id = make_group()
    member = boot(hints={"group": group_id}).body["server"]["id"]
    loner = create_server(name="loner")

    assert server_groups_shown(member) == [group_id]
    assert server_groups_shown(loner) == []
    assert server_groups_shown(member, version="2.70") == "absent"
    detail = call("GET", "/v2.1/servers/detail", version="2.71").body["servers"]
    assert all("server_groups" not in server for server in detail)  # a single server's view only, as in Nova
    assert api_rows(RequestSpec, instance_uuid=loner)[0].spec["group"] is None


@pytest.mark.parametrize("caller", [ALICE, BOB])
def test_a_server_naming_a_group_it_may_not_join_is_refused_and_not_created(cloud, caller):
    # GIVEN ALICE's group; ALICE names an unknown one, BOB names ALICE's
    alices = make_group()
    named = str(uuid.uuid4()) if caller is ALICE else alices

    response = boot(caller, hints={"group": named})

    assert response.status == 400
    assert response.body["badRequest"]["message"] == f"Instance group {named} could not be found."
    assert nothing_booted()
    assert cloud.executions("boot") == []


def test_an_admin_may_boot_into_another_projects_group(cloud):
    group_id = make_group()

    response = boot(ADMIN, hints={"group": group_id})

    assert response.status == 202, response.body
    assert members(group_id) == [response.body["server"]["id"]]


@pytest.mark.parametrize("hint", ["not-a-uuid", "", 42, [str(uuid.uuid4())]])
def test_a_group_hint_that_is_not_a_uuid_is_refused(cloud, hint):
    response = boot(hints={"group": hint})

    assert response.status == 400
    assert nothing_booted()


def test_a_server_over_the_group_members_quota_is_refused_and_not_created(cloud):
    # GIVEN one member per group and user, and ALICE's server in the group
    quotas.update("project-a", {"server_group_members": 1})
    group_id = make_group()
    first = boot(hints={"group": group_id}).body["server"]["id"]

    # WHEN ALICE boots a second member
    response = boot(hints={"group": group_id})

    # THEN it is refused and nothing of it is left; another user still has room
    assert response.status == 403
    assert response.body["forbidden"]["message"] == "Quota exceeded, too many servers in group"
    assert [m.instance_uuid for m in api_rows(InstanceMapping)] == [first]
    assert [b.instance_uuid for b in api_rows(BuildRequest)] == [first]
    assert members(group_id) == [first]
    carols = boot(CAROL, hints={"group": group_id})
    assert carols.status == 202, carols.body
    assert members(group_id) == [first, carols.body["server"]["id"]]


def test_a_server_deleted_as_a_build_request_leaves_its_group_and_frees_its_place(cloud):
    quotas.update("project-a", {"server_group_members": 1})
    group_id = make_group()
    server_id = boot(hints={"group": group_id}).body["server"]["id"]

    assert call("DELETE", f"/v2.1/servers/{server_id}").status == 204

    assert members(group_id) == []
    assert api_rows(InstanceGroupMember) == []
    assert boot(hints={"group": group_id}).status == 202  # the member quota counts it no more


def test_deleting_a_group_keeps_its_servers_in_no_group(cloud):
    group_id = make_group()
    server_id = boot(hints={"group": group_id}).body["server"]["id"]

    assert call("DELETE", f"{GROUPS}/{group_id}", version="2.64").status == 204

    assert api_rows(InstanceGroup) == [] and api_rows(InstanceGroupMember) == []
    assert [b.instance_uuid for b in api_rows(BuildRequest)] == [server_id]
    assert server_groups_shown(server_id) == []
    assert call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]["status"] == "BUILD"


def test_members_are_listed_in_the_order_they_joined(cloud):
    group_id = make_group(policy="soft-affinity")
    joined = [boot(hints={"group": group_id}).body["server"]["id"] for _ in range(3)]

    assert members(group_id) == joined
    assert call("GET", GROUPS, version="2.1").body["server_groups"][0]["members"] == joined
