"""The host aggregates API through the real handler (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid

import pytest
from placement_helpers import add_compute, add_instance, flavor, request_spec
from sqlalchemy import func, select
from test_api_support import ADMIN, ALICE, call, mocked_cloud

from ferry import errors, scheduler
from ferry.store.api_models import Aggregate, AggregateHost, AggregateMetadata
from ferry.store.db import api_session

AGGREGATES = "/v2.1/os-aggregates"


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


@pytest.fixture
def computes(cloud):
    """Three compute hosts: two in cell1, one in cell2."""
    for host, cell in (("compute-1", "cell1"), ("compute-2", "cell1"), ("compute-3", "cell2")):
        add_compute(host, cell)
    return ["compute-1", "compute-2", "compute-3"]


def admin(method: str, path: str, **options):
    options.setdefault("version", "2.81")
    return call(method, path, caller=ADMIN, **options)


def create(name: str, zone: str | None = None, **options) -> dict:
    body: dict = {"name": name}
    if zone is not None:
        body["availability_zone"] = zone
    response = admin("POST", AGGREGATES, body={"aggregate": body}, **options)
    assert response.status == 200, response.body
    return response.body["aggregate"]


def action(aggregate_id: int, name: str, argument: dict, **options):
    return admin("POST", f"{AGGREGATES}/{aggregate_id}/action", body={name: argument}, **options)


def stored() -> dict[str, tuple[list[str], dict[str, str]]]:
    """Every aggregate as the database has it: name → (hosts, metadata)."""
    with api_session() as session:
        return {a.name: (sorted(h.host for h in a.hosts), a.metadata_dict)
                for a in session.scalars(select(Aggregate))}


def error(response, kind: str) -> str:
    return response.body[kind]["message"]


# --- create, show, list ---------------------------------------------------------------------------


def test_create_answers_novas_shape_without_members_and_stores_the_zone_as_metadata(cloud):
    created = create("gen3", "zone-a")

    assert set(created) == {"id", "uuid", "name", "availability_zone", "created_at", "updated_at", "deleted",
                            "deleted_at"}
    assert (created["name"], created["availability_zone"], created["deleted"], created["deleted_at"]) == \
        ("gen3", "zone-a", False, None)
    assert str(uuid.UUID(created["uuid"])) == created["uuid"]
    assert created["updated_at"] is None and "T" in created["created_at"]
    assert stored() == {"gen3": ([], {"availability_zone": "zone-a"})}


def test_show_and_list_carry_hosts_metadata_and_uuid_from_2_41(computes):
    created = create("gen3")
    action(created["id"], "add_host", {"host": "compute-1"})

    shown = admin("GET", f"{AGGREGATES}/{created['id']}").body["aggregate"]
    listed = admin("GET", AGGREGATES).body["aggregates"]
    old = admin("GET", f"{AGGREGATES}/{created['id']}", version="2.40").body["aggregate"]

    assert shown["hosts"] == ["compute-1"] and shown["metadata"] == {} and shown["availability_zone"] is None
    assert shown["uuid"] == created["uuid"] and shown["updated_at"] is not None
    assert listed == [shown]
    assert "uuid" not in old and old["hosts"] == ["compute-1"]


def test_list_is_oldest_first(cloud):
    for name in ("b", "a", "c"):
        create(name)

    assert [a["name"] for a in admin("GET", AGGREGATES).body["aggregates"]] == ["b", "a", "c"]


def test_a_duplicate_name_is_409_and_creates_nothing(cloud):
    create("gen3")

    response = admin("POST", AGGREGATES, body={"aggregate": {"name": "gen3", "availability_zone": "z"}})

    assert response.status == 409
    assert error(response, "conflictingRequest") == "Aggregate gen3 already exists."
    assert stored() == {"gen3": ([], {})}


@pytest.mark.parametrize("body", [
    None,
    {},
    {"aggregate": {}},
    {"aggregate": {"name": ""}},
    {"aggregate": {"name": " padded"}},
    {"aggregate": {"name": "x" * 256}},
    {"aggregate": {"name": "ok", "availability_zone": "a:b"}},
    {"aggregate": {"name": "ok", "availability_zone": ""}},
    {"aggregate": {"name": "ok", "extra": 1}},
    {"aggregate": {"name": 7}},
])
def test_a_bad_create_body_is_400_and_creates_nothing(cloud, body):
    response = admin("POST", AGGREGATES, body=body)

    assert response.status == 400
    assert error(response, "badRequest")
    assert stored() == {}


def test_unknown_aggregates_are_404_and_a_non_integer_id_400(cloud):
    for method, path, body in (("GET", f"{AGGREGATES}/42", None),
                               ("PUT", f"{AGGREGATES}/42", {"aggregate": {"name": "x"}}),
                               ("DELETE", f"{AGGREGATES}/42", None),
                               ("POST", f"{AGGREGATES}/42/action", {"set_metadata": {"metadata": {"a": "b"}}})):
        response = admin(method, path, body=body)
        assert response.status == 404, (method, path)
        assert error(response, "itemNotFound") == "Aggregate 42 could not be found."

    assert admin("GET", f"{AGGREGATES}/gen3").status == 400


@pytest.mark.parametrize("aggregate_id", ["99999999999999999999999", "2147483648"])
def test_an_aggregate_id_beyond_the_column_is_404_as_any_unknown_id(cloud, aggregate_id):
    for method, path, body in (("GET", f"{AGGREGATES}/{aggregate_id}", None),
                               ("PUT", f"{AGGREGATES}/{aggregate_id}", {"aggregate": {"name": "x"}}),
                               ("DELETE", f"{AGGREGATES}/{aggregate_id}", None),
                               ("POST", f"{AGGREGATES}/{aggregate_id}/action",
                                {"set_metadata": {"metadata": {"a": "b"}}})):
        response = admin(method, path, body=body)
        assert response.status == 404, (method, response.body)
        assert error(response, "itemNotFound") == f"Aggregate {aggregate_id} could not be found."
    assert stored() == {}


def test_members_are_refused_every_aggregate_request(computes):
    created = create("gen3")
    requests = [
        ("GET", AGGREGATES, None, "index"),
        ("POST", AGGREGATES, {"aggregate": {"name": "mine"}}, "create"),
        ("GET", f"{AGGREGATES}/{created['id']}", None, "show"),
        ("PUT", f"{AGGREGATES}/{created['id']}", {"aggregate": {"name": "mine"}}, "update"),
        ("DELETE", f"{AGGREGATES}/{created['id']}", None, "delete"),
        ("POST", f"{AGGREGATES}/{created['id']}/action", {"add_host": {"host": "compute-1"}}, "add_host"),
        ("POST", f"{AGGREGATES}/{created['id']}/action", {"remove_host": {"host": "compute-1"}}, "remove_host"),
        ("POST", f"{AGGREGATES}/{created['id']}/action", {"set_metadata": {"metadata": {"a": "b"}}},
         "set_metadata"),
    ]
    for method, path, body, rule in requests:
        response = call(method, path, caller=ALICE, body=body)
        assert response.status == 403, rule
        assert error(response, "forbidden") == \
            f"Policy doesn't allow os_compute_api:os-aggregates:{rule} to be performed."
    assert stored() == {"gen3": ([], {})}


# --- update and delete ----------------------------------------------------------------------------


def test_update_renames_and_changes_the_zone(cloud):
    created = create("gen3", "zone-a")

    renamed = admin("PUT", f"{AGGREGATES}/{created['id']}", body={"aggregate": {"name": "gen4", "availability_zone":
                                                                                "zone-b"}})
    assert renamed.status == 200
    assert (renamed.body["aggregate"]["name"], renamed.body["aggregate"]["availability_zone"]) == ("gen4", "zone-b")
    assert renamed.body["aggregate"]["metadata"] == {"availability_zone": "zone-b"}
    assert stored() == {"gen4": ([], {"availability_zone": "zone-b"})}


def test_a_zone_cannot_be_removed_by_update_or_metadata_and_nothing_changes(cloud):
    """GIVEN an aggregate in a zone, WHEN a null zone is asked for, THEN 400 in Nova's words for each path."""
    created = create("gen3", "zone-a")

    by_update = admin("PUT", f"{AGGREGATES}/{created['id']}", body={"aggregate": {"availability_zone": None}})
    renaming = admin("PUT", f"{AGGREGATES}/{created['id']}", body={"aggregate": {"name": "gen4",
                                                                                "availability_zone": None}})
    by_metadata = action(created["id"], "set_metadata", {"metadata": {"availability_zone": None, "ssd": "true"}})

    reason = "Reason: Aggregate {} does not support empty named availability zone."
    assert by_update.status == 400
    assert error(by_update, "badRequest") == f"Cannot update aggregate {created['id']}. {reason.format('gen3')}"
    # Nova renames before it looks at the zone, so its refusal names the new name.
    assert renaming.status == 400
    assert error(renaming, "badRequest") == f"Cannot update aggregate {created['id']}. {reason.format('gen4')}"
    assert by_metadata.status == 400
    assert error(by_metadata, "badRequest") == \
        f"Cannot update metadata of aggregate {created['id']}. {reason.format('gen3')}"
    assert stored() == {"gen3": ([], {"availability_zone": "zone-a"})}
    assert admin("GET", f"{AGGREGATES}/{created['id']}").body["aggregate"]["updated_at"] is None


def test_update_to_a_taken_name_is_409_and_changes_nothing(cloud):
    create("gen3")
    other = create("gen4", "zone-a")

    response = admin("PUT", f"{AGGREGATES}/{other['id']}", body={"aggregate": {"name": "gen3",
                                                                              "availability_zone": "zone-b"}})

    assert response.status == 409
    assert stored() == {"gen3": ([], {}), "gen4": ([], {"availability_zone": "zone-a"})}


def test_a_zone_set_by_metadata_follows_the_name_rule_too(cloud):
    created = create("gen5")

    response = action(created["id"], "set_metadata", {"metadata": {"availability_zone": "zone\u200b5"}})

    assert response.status == 400
    assert stored() == {"gen5": ([], {})}


@pytest.mark.parametrize("body", [{"aggregate": {}}, {"aggregate": {"hosts": ["x"]}}, {"name": "x"},
                                  {"aggregate": {"name": ""}}, {"aggregate": {"name": "gen\u200b4"}},
                                  {"aggregate": {"name": "gen4", "availability_zone": "\u00a0zone"}}])
def test_a_bad_update_body_is_400(cloud, body):
    created = create("gen3")

    response = admin("PUT", f"{AGGREGATES}/{created['id']}", body=body)

    assert response.status == 400
    assert stored() == {"gen3": ([], {})}


def test_delete_is_refused_while_the_aggregate_has_hosts(computes):
    created = create("gen3")
    action(created["id"], "add_host", {"host": "compute-1"})
    action(created["id"], "set_metadata", {"metadata": {"ssd": "true"}})

    refused = admin("DELETE", f"{AGGREGATES}/{created['id']}")
    assert refused.status == 400
    assert error(refused, "badRequest") == \
        f"Cannot remove aggregate {created['id']}. Reason: Host aggregate is not empty."
    assert stored() == {"gen3": (["compute-1"], {"ssd": "true"})}

    action(created["id"], "remove_host", {"host": "compute-1"})
    deleted = admin("DELETE", f"{AGGREGATES}/{created['id']}")
    assert deleted.status == 200 and deleted.body is None
    assert stored() == {}
    with api_session() as session:
        assert session.scalar(select(func.count()).select_from(AggregateMetadata)) == 0
    assert admin("GET", f"{AGGREGATES}/{created['id']}").status == 404


# --- hosts ----------------------------------------------------------------------------------------


def test_add_and_remove_hosts_of_any_cell(computes):
    created = create("gen3")

    first = action(created["id"], "add_host", {"host": "compute-1"})
    second = action(created["id"], "add_host", {"host": "compute-3"})
    assert first.status == 200 and first.body["aggregate"]["hosts"] == ["compute-1"]
    assert second.body["aggregate"]["hosts"] == ["compute-1", "compute-3"]

    removed = action(created["id"], "remove_host", {"host": "compute-1"})
    assert removed.status == 200 and removed.body["aggregate"]["hosts"] == ["compute-3"]
    assert stored() == {"gen3": (["compute-3"], {})}


def test_adding_an_unknown_host_is_404(computes):
    created = create("gen3")
    add_compute("no-service", "cell1", service=False)

    for host in ("nowhere", "no-service"):
        response = action(created["id"], "add_host", {"host": host})
        assert response.status == 404
        assert error(response, "itemNotFound") == f"Compute host {host} could not be found."
    assert stored() == {"gen3": ([], {})}


def test_adding_a_member_again_is_409(computes):
    created = create("gen3")
    action(created["id"], "add_host", {"host": "compute-1"})

    again = action(created["id"], "add_host", {"host": "compute-1"})

    assert again.status == 409
    assert error(again, "conflictingRequest") == f"Aggregate {created['id']} already has host compute-1."
    assert stored() == {"gen3": (["compute-1"], {})}


def test_removing_a_stranger_an_unknown_host_or_from_an_unknown_aggregate_is_404_in_novas_words(computes):
    created = create("gen3")
    action(created["id"], "add_host", {"host": "compute-1"})

    stranger = action(created["id"], "remove_host", {"host": "compute-2"})
    unknown = action(created["id"], "remove_host", {"host": "nowhere"})
    elsewhere = action(42, "remove_host", {"host": "compute-1"})

    for response, host, aggregate_id in ((stranger, "compute-2", created["id"]),
                                         (unknown, "nowhere", created["id"]), (elsewhere, "compute-1", 42)):
        assert response.status == 404, host
        assert error(response, "itemNotFound") == f"Cannot remove host {host} in aggregate {aggregate_id}"
    assert stored() == {"gen3": (["compute-1"], {})}


def test_a_host_cannot_be_in_two_availability_zones(computes):
    zone_a = create("rack-a", "zone-a")
    zone_b = create("rack-b", "zone-b")
    plain = create("ssd")
    action(zone_a["id"], "add_host", {"host": "compute-1"})
    action(plain["id"], "add_host", {"host": "compute-2"})

    refused = action(zone_b["id"], "add_host", {"host": "compute-1"})
    assert refused.status == 409
    assert error(refused, "conflictingRequest") == (
        f"Cannot add host to aggregate {zone_b['id']}. Reason: One or more hosts already in availability "
        f"zone(s) ['zone-a'].")
    # A host may be in any number of aggregates without a zone, and in another of the same zone.
    assert action(plain["id"], "add_host", {"host": "compute-1"}).status == 200
    assert action(create("rack-a2", "zone-a")["id"], "add_host", {"host": "compute-1"}).status == 200

    # Giving the aggregate of compute-1 and compute-2 a zone other than zone-a is refused too.
    by_update = admin("PUT", f"{AGGREGATES}/{plain['id']}", body={"aggregate": {"availability_zone": "zone-b"}})
    by_metadata = action(plain["id"], "set_metadata", {"metadata": {"availability_zone": "zone-b"}})
    assert by_update.status == 400 and by_metadata.status == 400
    assert "One or more hosts already in availability zone(s) ['zone-a']" in error(by_update, "badRequest")
    assert stored()["ssd"] == (["compute-1", "compute-2"], {})
    assert stored()["rack-b"] == ([], {"availability_zone": "zone-b"})


def test_the_zone_of_hosts_that_run_servers_cannot_change(computes):
    created = create("rack", "zone-a")
    action(created["id"], "add_host", {"host": "compute-3"})
    add_instance("compute-3", "cell2")

    for response in (admin("PUT", f"{AGGREGATES}/{created['id']}", body={"aggregate": {"availability_zone": "z"}}),
                     action(created["id"], "set_metadata", {"metadata": {"availability_zone": "z"}})):
        assert response.status == 400
        assert error(response, "badRequest").endswith("Reason: One or more hosts contain instances in this zone.")
    assert stored() == {"rack": (["compute-3"], {"availability_zone": "zone-a"})}
    # The same zone again, or a rename, is fine.
    same_zone = {"aggregate": {"name": "rack-1", "availability_zone": "zone-a"}}
    assert admin("PUT", f"{AGGREGATES}/{created['id']}", body=same_zone).status == 200


@pytest.mark.parametrize("body", [
    {"add_host": {}},
    {"add_host": {"host": ""}},
    {"add_host": {"host": "compute-1", "extra": 1}},
    {"add_host": "compute-1"},
    {"remove_host": {"hosts": ["compute-1"]}},
    {"set_metadata": {"metadata": {"bad/key": "x"}}},
    {"set_metadata": {"metadata": {"k": "v" * 256}}},
    {"set_metadata": {"metadata": {"k": 1}}},
    {"set_metadata": {"metadata": {"availability_zone": ""}}},
    {"set_metadata": {"metadata": ["k"]}},
    {"set_metadata": {}},
    {"add_host": {"host": "compute-1"}, "remove_host": {"host": "compute-1"}},
    {"cache": []},
    {},
])
def test_a_bad_action_is_400_and_changes_nothing(computes, body):
    created = create("gen3")

    response = admin("POST", f"{AGGREGATES}/{created['id']}/action", body=body)

    assert response.status == 400
    assert error(response, "badRequest")
    assert stored() == {"gen3": ([], {})}


# --- metadata and the scheduler -------------------------------------------------------------------


def test_set_metadata_adds_replaces_and_removes_keys(cloud):
    created = create("gen3", "zone-a")

    action(created["id"], "set_metadata", {"metadata": {"ssd": "true", "gen": "3"}})
    response = action(created["id"], "set_metadata", {"metadata": {"ssd": None, "gen": "4", "absent": None,
                                                                   "availability_zone": "zone-b"}})

    assert response.status == 200
    shown = response.body["aggregate"]
    assert shown["metadata"] == {"gen": "4", "availability_zone": "zone-b"}
    assert shown["availability_zone"] == "zone-b"
    assert stored() == {"gen3": ([], {"gen": "4", "availability_zone": "zone-b"})}


def test_hosts_and_metadata_set_through_the_api_steer_the_scheduler(computes):
    created = create("gen3")
    action(created["id"], "add_host", {"host": "compute-2"})
    action(created["id"], "set_metadata", {"metadata": {"hw_generation": "gen3"}})

    spec = request_spec(flavor=flavor(extra_specs={"aggregate_instance_extra_specs:hw_generation": "gen3"}))
    assert [s.host for s in scheduler.select_destinations(spec)] == ["compute-2"]

    action(created["id"], "remove_host", {"host": "compute-2"})
    with api_session() as session:
        assert session.scalar(select(func.count()).select_from(AggregateHost)) == 0
    with pytest.raises(errors.NoValidHost):
        scheduler.select_destinations(spec)
