"""The flavors API through the real handler (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value
from test_api_support import ADMIN, ALICE, BOB, api_rows, call, flavor_named, mocked_cloud

from ferry.compute import api as compute_api
from ferry.store.api_models import Flavor, FlavorExtraSpec, FlavorProject
from ferry.store.db import api_session


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


@pytest.fixture
def private_flavor(cloud):
    flavor = compute_api.create_flavor(name="secret", vcpus=4, memory_mb=4096, root_gb=10, flavorid="9",
                                       is_public=False)
    return flavor.flavorid


def names(response) -> list[str]:
    return [f["name"] for f in response.body["flavors"]]


def test_is_public_filter_follows_nova_for_admins_and_members(private_flavor):
    assert names(call("GET", "/v2.1/flavors/detail", caller=ADMIN, query={"is_public": "None"})) == \
        ["m1.small", "m1.medium", "secret"]
    assert names(call("GET", "/v2.1/flavors/detail", caller=ADMIN, query={"is_public": "False"})) == ["secret"]
    assert names(call("GET", "/v2.1/flavors/detail", caller=ADMIN, query={"is_public": "True"})) == \
        ["m1.small", "m1.medium"]
    assert names(call("GET", "/v2.1/flavors/detail", caller=ADMIN)) == ["m1.small", "m1.medium"]
    assert names(call("GET", "/v2.1/flavors/detail", caller=ALICE, query={"is_public": "None"})) == \
        ["m1.small", "m1.medium"]
    assert call("GET", "/v2.1/flavors", caller=ADMIN, query={"is_public": "maybe"}).status == 400


def test_flavors_sort_and_page_as_nova_does(cloud):
    compute_api.create_flavor(name="a.big", vcpus=1, memory_mb=8192, root_gb=1, flavorid="0")
    assert names(call("GET", "/v2.1/flavors/detail", query={"sort_key": "memory_mb", "sort_dir": "desc"})) == \
        ["a.big", "m1.medium", "m1.small"]
    assert names(call("GET", "/v2.1/flavors", query={"sort_key": "name"})) == ["a.big", "m1.medium", "m1.small"]
    assert names(call("GET", "/v2.1/flavors", query={"sort_key": "id", "sort_dir": "desc"})) == \
        ["a.big", "m1.medium", "m1.small"]  # the internal id: creation order
    assert names(call("GET", "/v2.1/flavors")) == ["a.big", "m1.small", "m1.medium"]  # flavor id ascending
    # no flavor has a vcpu_weight (null on each, as on Nova's unless set): the internal id decides
    assert names(call("GET", "/v2.1/flavors", query={"sort_key": "vcpu_weight", "sort_dir": "desc"})) == \
        ["a.big", "m1.medium", "m1.small"]
    assert names(call("GET", "/v2.1/flavors", query={"sort_key": "vcpu_weight"})) == ["m1.small", "m1.medium", "a.big"]
    assert call("GET", "/v2.1/flavors", query={"sort_dir": "sideways"}).status == 400
    assert call("GET", "/v2.1/flavors", query={"sort_dir": "DESC"}).status == 400  # Nova's exact values only
    assert call("GET", "/v2.1/flavors", query={"sort_key": "colour"}).status == 400

    first = call("GET", "/v2.1/flavors", query={"limit": "1"}).body
    assert [f["id"] for f in first["flavors"]] == ["0"]
    assert first["flavors_links"][0]["href"].endswith("/v2.1/flavors?limit=1&marker=0")
    rest = call("GET", "/v2.1/flavors", query={"limit": "2", "marker": "0"}).body
    assert [f["id"] for f in rest["flavors"]] == ["1", "2"]
    assert "flavors_links" not in call("GET", "/v2.1/flavors").body


@pytest.mark.parametrize("path", ["/v2.1/flavors", "/v2.1/flavors/detail"])
def test_an_unknown_list_parameter_is_refused_from_2_75_and_ignored_before(cloud, path):
    refused = call("GET", path, version="2.75", query={"minRam": "1", "colour": "red"})
    ignored = call("GET", path, version="2.74", query={"minRam": "1", "colour": "red"})
    known = call("GET", path, version="2.75", query={
        "is_public": "True", "minRam": "1", "minDisk": "0", "limit": "5", "marker": "1", "sort_key": "flavorid",
        "sort_dir": "asc"})

    assert refused.status == 400
    assert refused.body["badRequest"]["message"] == (
        "Invalid input for query parameters colour. Additional properties are not allowed ('colour' was unexpected)")
    assert ignored.status == 200 and names(ignored) == ["m1.small", "m1.medium"]
    assert known.status == 200 and names(known) == ["m1.medium"]


def test_flavor_detail_has_the_fields_clients_read(cloud):
    flavor = call("GET", "/v2.1/flavors/detail", version="2.61").body["flavors"][0]

    assert {k: flavor[k] for k in ("id", "name", "vcpus", "ram", "disk", "OS-FLV-EXT-DATA:ephemeral", "swap",
                                   "os-flavor-access:is_public", "description", "extra_specs")} == \
        {"id": "1", "name": "m1.small", "vcpus": 1, "ram": 512, "disk": 1, "OS-FLV-EXT-DATA:ephemeral": 0,
         "swap": "", "os-flavor-access:is_public": True, "description": None, "extra_specs": {}}
    assert call("GET", "/v2.1/flavors/detail", version="2.75").body["flavors"][0]["swap"] == 0
    assert set(call("GET", "/v2.1/flavors").body["flavors"][0]) == {"id", "name", "links"}


def test_show_finds_flavors_by_id_only(cloud):
    assert call("GET", "/v2.1/flavors/2").body["flavor"]["name"] == "m1.medium"

    by_name = call("GET", "/v2.1/flavors/m1.medium")
    assert by_name.status == 404 and by_name.body["itemNotFound"]["code"] == 404


def test_admin_creates_a_flavor_with_a_generated_id_and_description(cloud):
    response = call("POST", "/v2.1/flavors", caller=ADMIN, version="2.55", body={"flavor": {
        "name": "m1.large", "ram": 2048, "vcpus": 4, "disk": 20, "id": None, "swap": 512,
        "OS-FLV-EXT-DATA:ephemeral": 5, "description": "for databases"}})

    assert response.status == 200
    created = response.body["flavor"]
    assert str(uuid.UUID(created["id"])) == created["id"]
    assert (created["ram"], created["swap"], created["OS-FLV-EXT-DATA:ephemeral"], created["description"]) == \
        (2048, 512, 5, "for databases")
    assert call("GET", f"/v2.1/flavors/{created['id']}").body["flavor"]["name"] == "m1.large"


def test_a_flavor_id_given_as_a_number_is_its_text(cloud):
    response = call("POST", "/v2.1/flavors", caller=ADMIN, body={"flavor": {
        "name": "numbered", "ram": 512, "vcpus": 1, "disk": 1, "id": 42}})

    assert response.status == 200, response.body
    assert response.body["flavor"]["id"] == "42"
    assert call("GET", "/v2.1/flavors/42").body["flavor"]["name"] == "numbered"
    assert call("POST", "/v2.1/flavors", caller=ADMIN, body={"flavor": {
        "name": "again", "ram": 512, "vcpus": 1, "disk": 1, "id": "42"}}).status == 409


@pytest.mark.parametrize(("field", "value", "message"), [
    ("ram", 10**20, "greater than the maximum of 2147483647"),
    ("ram", "99999999999", "greater than the maximum of 2147483647"),
    ("vcpus", "0", "less than the minimum of 1"),
    ("disk", -1, "less than the minimum of 0"),
])
def test_flavor_numbers_out_of_range_are_400_and_create_nothing(cloud, field, value, message):
    body = {"name": "huge", "ram": 512, "vcpus": 1, "disk": 1, field: value}

    response = call("POST", "/v2.1/flavors", caller=ADMIN, body={"flavor": body})

    assert response.status == 400 and message in response.body["badRequest"]["message"]
    assert flavor_named("huge") is None


@pytest.mark.parametrize(("value", "message"), [
    (3.5e38, "Invalid input for field/attribute flavor/rxtx_factor. Value: 3.5e+38. "
             "3.5e+38 is greater than the maximum of 3.40282e+38"),
    ("9" * 40, "Invalid input received: 'rxtx_factor' argument must be a float between 0 and 3.40282e+38"),
    ("0", "Invalid input received: 'rxtx_factor' argument must be a float between 0 and 3.40282e+38"),
])
def test_an_rxtx_factor_beyond_novas_bounds_is_400_and_creates_nothing(cloud, value, message):
    body = {"name": "fast", "ram": 512, "vcpus": 1, "disk": 1, "rxtx_factor": value}

    response = call("POST", "/v2.1/flavors", caller=ADMIN, body={"flavor": body})

    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == message
    assert flavor_named("fast") is None


def test_the_largest_rxtx_factor_nova_takes_is_taken(cloud):
    body = {"name": "fast", "ram": 512, "vcpus": 1, "disk": 1, "rxtx_factor": "340282000000000000000000000000000000000"}

    response = call("POST", "/v2.1/flavors", caller=ADMIN, body={"flavor": body})

    assert response.status == 200, response.body
    assert response.body["flavor"]["rxtx_factor"] == 3.40282e38


@pytest.mark.parametrize("path", ["/v2.1/flavors", "/v2.1/flavors/detail"])
@pytest.mark.parametrize("name", ["minDisk", "minRam"])
@pytest.mark.parametrize(("value", "bound"), [("99999999999999999999999", "greater than the maximum of 2147483647"),
                                              ("-99999999999999999999999", "less than the minimum of -2147483648")])
def test_a_min_filter_beyond_an_integer_column_is_400(cloud, path, name, value, bound):
    response = call("GET", path, query={name: value})

    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == \
        f"Invalid input for field/attribute {name}. Value: {value}. {value} is {bound}"


def test_min_filters_within_the_column_still_filter(cloud):
    assert names(call("GET", "/v2.1/flavors/detail", query={"minDisk": "2"})) == ["m1.medium"]
    assert names(call("GET", "/v2.1/flavors/detail", query={"minRam": "2147483647"})) == []
    assert names(call("GET", "/v2.1/flavors/detail", query={"minRam": "-5"})) == ["m1.small", "m1.medium"]


@pytest.mark.parametrize("name", [" m1.edge", "m1.edge\u00a0", "m1\u200bedge", "m1\x7fedge"])
def test_flavor_names_nova_refuses_are_400_and_create_nothing(cloud, name):
    response = call("POST", "/v2.1/flavors", caller=ADMIN, body={"flavor": {
        "name": name, "ram": 512, "vcpus": 1, "disk": 1}})

    assert response.status == 400
    message = response.body["badRequest"]["message"]
    assert message.startswith("Invalid input for field/attribute flavor/name.") or message == (
        "An invalid 'name' value was provided. The name must be: printable characters. "
        "Can not start or end with whitespace.")
    assert flavor_named(name) is None


def test_duplicate_flavor_is_409(cloud):
    response = call("POST", "/v2.1/flavors", caller=ADMIN, body={"flavor": {
        "name": "m1.small", "ram": 1, "vcpus": 1, "disk": 0}})

    assert response.status == 409
    assert response.body["conflictingRequest"]["message"] == "Flavor with name m1.small already exists."


def test_members_may_not_manage_flavors(cloud):
    create = call("POST", "/v2.1/flavors", caller=ALICE, body={"flavor": {
        "name": "mine", "ram": 1, "vcpus": 1, "disk": 0}})
    delete = call("DELETE", "/v2.1/flavors/1", caller=ALICE)
    specs = call("POST", "/v2.1/flavors/1/os-extra_specs", caller=ALICE, body={"extra_specs": {"a": "b"}})

    for response, rule in ((create, "os-flavor-manage:create"), (delete, "os-flavor-manage:delete"),
                           (specs, "os-flavor-extra-specs:create")):
        assert response.status == 403
        assert response.body["forbidden"]["message"] == f"Policy doesn't allow os_compute_api:{rule} to be performed."
    assert flavor_named("mine") is None and flavor_named("m1.small") is not None
    assert compute_api.get_extra_specs("1") == {}


def test_admin_deletes_a_flavor(cloud):
    assert call("DELETE", "/v2.1/flavors/2", caller=ADMIN).status == 202

    assert flavor_named("m1.medium") is None
    assert call("DELETE", "/v2.1/flavors/2", caller=ADMIN).status == 404


def test_extra_specs_are_set_by_admins_and_read_by_members(cloud):
    created = call("POST", "/v2.1/flavors/1/os-extra_specs", caller=ADMIN,
                   body={"extra_specs": {"hw:cpu_policy": "dedicated", "aggregate_instance_extra_specs:gen": 3}})
    call("POST", "/v2.1/flavors/1/os-extra_specs", caller=ADMIN, body={"extra_specs": {"hw:cpu_policy": "shared"}})

    assert created.status == 200
    assert call("GET", "/v2.1/flavors/1/os-extra_specs").body == {
        "extra_specs": {"hw:cpu_policy": "shared", "aggregate_instance_extra_specs:gen": "3"}}
    assert call("GET", "/v2.1/flavors/1/os-extra_specs/hw:cpu_policy").body == {"hw:cpu_policy": "shared"}
    assert call("DELETE", "/v2.1/flavors/1/os-extra_specs/hw:cpu_policy", caller=ADMIN).status == 200
    assert call("GET", "/v2.1/flavors/1/os-extra_specs/hw:cpu_policy").status == 404
    bad = call("POST", "/v2.1/flavors/1/os-extra_specs", caller=ADMIN, body={"extra_specs": {"bad/key": "x"}})
    assert bad.status == 400


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v2.1/flavors/1/os-extra_specs", {"extra_specs": {"hw:cpu_realtime": True}}),
    ("POST", "/v2.1/flavors/1/os-extra_specs", {"extra_specs": {"gen": 3, "ssd": False}}),
    ("PUT", "/v2.1/flavors/1/os-extra_specs/ssd", {"ssd": True}),
])
def test_a_boolean_extra_spec_value_is_400_as_nova_takes_strings_and_numbers_only(cloud, method, path, body):
    response = call(method, path, caller=ADMIN, body=body)

    assert response.status == 400
    assert "is not of type" in response.body["badRequest"]["message"]
    assert compute_api.get_extra_specs("1") == {}


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v2.1/flavors/1/os-extra_specs", {"extra_specs": {"gen": int("9" * 256)}}),
    ("POST", "/v2.1/flavors/1/os-extra_specs", {"extra_specs": {"ssd": "yes", "gen": int("9" * 300)}}),
    ("PUT", "/v2.1/flavors/1/os-extra_specs/gen", {"gen": int("9" * 256)}),
])
def test_a_number_longer_than_255_characters_written_out_is_400_and_stores_nothing(cloud, method, path, body):
    # WHEN an admin sets a number that, written out as the value is stored, takes over 255 characters
    response = call(method, path, caller=ADMIN, body=body)

    # THEN it is refused as Nova refuses it, and no spec of the request is stored
    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == \
        "Invalid input received: extra_specs value has more than 255 characters."
    assert compute_api.get_extra_specs("1") == {}


def test_a_first_extra_spec_written_by_a_concurrent_request_is_updated_not_a_server_error(cloud, monkeypatch):
    # GIVEN another request commits the key hw:cpu_policy after this request read the flavor and its
    # specs: the row is in the database, the first read of the flavor is made to have missed it
    with api_session() as session:
        flavor_id = session.scalars(select(Flavor.id).where(Flavor.flavorid == "1")).one()
        session.add(FlavorExtraSpec(flavor_id=flavor_id, key="hw:cpu_policy", value="shared"))
    read = compute_api._flavor
    reads: list[str] = []

    def read_before_the_other_committed(session: Session, flavorid: str) -> Flavor:
        flavor = read(session, flavorid)
        reads.append(flavorid)
        if len(reads) == 1:
            set_committed_value(flavor, "extra_specs", [s for s in flavor.extra_specs if s.key != "hw:cpu_policy"])
        return flavor

    monkeypatch.setattr(compute_api, "_flavor", read_before_the_other_committed)

    # WHEN this request sets the same key (and another) for the first time
    response = call("POST", "/v2.1/flavors/1/os-extra_specs", caller=ADMIN,
                    body={"extra_specs": {"hw:cpu_policy": "dedicated", "gen": 3}})

    # THEN its insert meets the other's row, and it is written again as an update: one row, its value
    assert response.status == 200, response.body
    assert compute_api.get_extra_specs("1") == {"hw:cpu_policy": "dedicated", "gen": "3"}
    assert [spec.value for spec in api_rows(FlavorExtraSpec, key="hw:cpu_policy")] == ["dedicated"]


def test_a_server_keeps_its_flavor_after_the_flavor_is_deleted(cloud):
    server = call("POST", "/v2.1/servers", version="2.90", body={"server": {
        "name": "vm", "flavorRef": "2", "imageRef": cloud.image_id, "networks": "none"}}).body["server"]

    call("DELETE", "/v2.1/flavors/2", caller=ADMIN)

    shown = call("GET", f"/v2.1/servers/{server['id']}", version="2.90").body["server"]
    assert shown["flavor"]["original_name"] == "m1.medium" and shown["flavor"]["vcpus"] == 2


# --- flavor access -----------------------------------------------------------------------------------


def _access(flavor_id: str, action: str | None = None, project: str = "project-a", caller=ADMIN,
            version: str | None = None):
    if action is None:
        return call("GET", f"/v2.1/flavors/{flavor_id}/os-flavor-access", caller=caller, version=version)
    return call("POST", f"/v2.1/flavors/{flavor_id}/action", caller=caller, body={action: {"tenant": project}},
                version=version)


def test_admins_give_and_take_away_a_projects_access_to_a_private_flavor(private_flavor):
    assert _access(private_flavor).body == {"flavor_access": []}

    added = _access(private_flavor, "addTenantAccess")
    assert added.status == 200
    assert added.body == {"flavor_access": [{"flavor_id": "9", "tenant_id": "project-a"}]}
    assert _access(private_flavor, "addTenantAccess", "project-b").body["flavor_access"] == [
        {"flavor_id": "9", "tenant_id": "project-a"}, {"flavor_id": "9", "tenant_id": "project-b"}]

    again = _access(private_flavor, "addTenantAccess")
    assert again.status == 409
    assert again.body["conflictingRequest"]["message"] == \
        "Flavor access already exists for flavor 9 and project project-a combination."
    removed = _access(private_flavor, "removeTenantAccess")
    assert removed.status == 200 and removed.body == {"flavor_access": [{"flavor_id": "9", "tenant_id": "project-b"}]}
    assert _access(private_flavor, "removeTenantAccess").status == 404


@pytest.mark.parametrize(("request_", "status"), [
    (lambda: _access("1"), 404),  # a public flavor has no access list
    (lambda: _access("1", "addTenantAccess", version="2.7"), 409),
    (lambda: _access("no-such-flavor", "addTenantAccess"), 404),
    (lambda: _access("9", caller=ALICE), 403),
    (lambda: _access("9", "addTenantAccess", caller=ALICE), 403),
    (lambda: call("POST", "/v2.1/flavors/9/action", caller=ADMIN, body={"addTenantAccess": {}}), 400),
    (lambda: call("POST", "/v2.1/flavors/9/action", caller=ADMIN, body={"grant": {"tenant": "p"}}), 400),
])
def test_flavor_access_refusals_change_nothing(private_flavor, request_, status):
    assert request_().status == status
    assert _access(private_flavor).body == {"flavor_access": []}


@pytest.mark.parametrize("version", [None, "2.6"])
def test_access_to_a_public_flavor_is_recorded_below_2_7_as_nova_records_it(cloud, version):
    # WHEN an admin gives a project access to a public flavor below 2.7
    added = _access("1", "addTenantAccess", version=version)

    # THEN it is recorded and listed back, as Nova does; a second time it exists already
    assert added.status == 200, added.body
    assert added.body == {"flavor_access": [{"flavor_id": "1", "tenant_id": "project-a"}]}
    assert [row.project_id for row in api_rows(FlavorProject)] == ["project-a"]
    assert _access("1", "addTenantAccess", version=version).status == 409
    # the flavor stays public: everyone's, with no access list to show
    assert call("GET", "/v2.1/flavors/1", caller=BOB).status == 200
    assert _access("1", version=version).status == 404
    # and the access can be taken away again
    removed = _access("1", "removeTenantAccess", version=version)
    assert removed.status == 200 and removed.body == {"flavor_access": []}
    assert api_rows(FlavorProject) == []


def test_a_private_flavor_is_for_the_projects_with_access_only(cloud, private_flavor):
    def visible(caller) -> tuple[int, bool]:
        listed = names(call("GET", "/v2.1/flavors/detail", caller=caller, query={"is_public": "None"}))
        return call("GET", "/v2.1/flavors/9", caller=caller).status, "secret" in listed

    def boot(caller) -> int:
        return call("POST", "/v2.1/servers", caller=caller, version="2.90", body={"server": {
            "name": "on-secret", "flavorRef": "9", "imageRef": cloud.image_id, "networks": "none"}}).status

    assert visible(ALICE) == (404, False) and boot(ALICE) == 400
    assert call("GET", "/v2.1/flavors/9/os-extra_specs", caller=ALICE).status == 404
    assert "secret" not in names(call("GET", "/v2.1/flavors/detail", caller=ADMIN))  # admin's project: no access
    _access(private_flavor, "addTenantAccess")
    _access(private_flavor, "addTenantAccess", ADMIN.project_id)
    assert "secret" in names(call("GET", "/v2.1/flavors/detail", caller=ADMIN))  # as Nova: now it has access
    assert call("GET", "/v2.1/flavors/9/os-extra_specs", caller=ALICE).status == 200

    assert visible(ALICE) == (200, True) and boot(ALICE) == 202
    assert visible(BOB) == (404, False) and boot(BOB) == 400
    assert visible(ADMIN) == (200, True)


def test_a_project_id_the_identity_look_up_finds_can_be_given_access(private_flavor):
    assert call("GET", "/identity/v3/projects/team.a@example", caller=ADMIN).status == 200
    assert _access(private_flavor, "addTenantAccess", "team.a@example").status == 200
    assert _access(private_flavor, "addTenantAccess", "not a project").status == 400
