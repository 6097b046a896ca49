"""``/os-migrations``, ``/servers/{id}/migrations`` and the move actions in ``os-instance-actions``."""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import select, update
from test_api_moves import action, active_server, resized_server, start_move_cloud, write_policy
from test_api_support import ADMIN, ALICE, BOB, call, cell_away, mocked_cloud

from ferry.compute import actions, migration_states, moves
from ferry.compute import api as compute_api
from ferry.store.cell_models import InstanceAction, Migration
from ferry.store.db import cell_session

BASE_FIELDS = {"id", "instance_uuid", "source_compute", "source_node", "dest_compute", "dest_node", "dest_host",
               "old_instance_type_id", "new_instance_type_id", "status", "created_at", "updated_at"}
T0 = dt.datetime(2026, 1, 1, 12, 0, 0)


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    for mocked in mocked_cloud(monkeypatch, tmp_path):
        yield start_move_cloud(mocked, monkeypatch)


def add_migration(cell: str = "cell1", *, minutes: int = 0, **values: Any) -> str:
    fields: dict[str, Any] = {
        "instance_uuid": "11111111-1111-4111-8111-111111111111", "source_compute": "host1", "source_node": "host1",
        "dest_compute": "host2", "dest_node": "host2", "dest_host": "host2", "status": migration_states.FINISHED,
        "migration_type": migration_states.RESIZE, "old_instance_type_id": 1, "new_instance_type_id": 2,
        "user_id": "alice",
        "project_id": "project-a", "created_at": T0 + dt.timedelta(minutes=minutes)}
    fields.update(values)
    with cell_session(cell) as session:
        migration = Migration(**fields)
        session.add(migration)
        session.flush()
        return migration.uuid


def listed(version: str = "2.80", caller=ADMIN, **query: Any):
    response = call("GET", "/v2.1/os-migrations", caller=caller, version=version, query=query)
    assert response.status == 200, response.body
    return response.body["migrations"]


# --- access -----------------------------------------------------------------------------------------


def test_os_migrations_is_for_admins_unless_the_policy_file_says_otherwise(cloud, tmp_path, monkeypatch):
    add_migration()

    refused = call("GET", "/v2.1/os-migrations", caller=ALICE, version="2.80")
    assert refused.status == 403
    assert refused.body["forbidden"]["message"] == \
        "Policy doesn't allow os_compute_api:os-migrations:index to be performed."

    write_policy(tmp_path, monkeypatch, {"os_compute_api:os-migrations:index": "member"})
    assert len(listed(caller=ALICE)) == 1

    # admin_or_owner on a rule no project owns (every project's migrations) is admins only, not everyone
    write_policy(tmp_path, monkeypatch, {"os_compute_api:os-migrations:index": "admin_or_owner"})
    assert call("GET", "/v2.1/os-migrations", caller=ALICE, version="2.80").status == 403
    assert call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.80").status == 200


# --- fields per microversion -----------------------------------------------------------------------


@pytest.mark.parametrize(("version", "extra"), [
    ("2.1", set()),
    ("2.22", set()),
    ("2.23", {"migration_type"}),
    ("2.58", {"migration_type"}),
    ("2.59", {"migration_type", "uuid"}),
    ("2.79", {"migration_type", "uuid"}),
    ("2.80", {"migration_type", "uuid", "user_id", "project_id"}),
])
def test_migration_fields_follow_the_microversion(cloud, version, extra):
    uuid = add_migration(migration_type=migration_states.MIGRATION, old_instance_type_id=1, new_instance_type_id=1)

    [shown] = listed(version)

    assert set(shown) == BASE_FIELDS | extra
    assert (shown["status"], shown["source_compute"], shown["dest_compute"], shown["dest_host"]) == \
        ("finished", "host1", "host2", "host2")
    assert (shown["old_instance_type_id"], shown["new_instance_type_id"]) == (1, 1)
    assert shown["created_at"] == "2026-01-01T12:00:00.000000" and shown["updated_at"] is None
    if "uuid" in extra:
        assert shown["uuid"] == uuid
    if "migration_type" in extra:
        assert shown["migration_type"] == "migration"
    if "user_id" in extra:
        assert (shown["user_id"], shown["project_id"]) == ("alice", "project-a")


# --- order, filters, paging -------------------------------------------------------------------------


def test_newest_first_from_2_59_across_cells(cloud):
    oldest = add_migration("cell1", minutes=0)
    middle = add_migration("cell2", minutes=5, source_compute="host3", dest_compute="host3")
    newest = add_migration("cell1", minutes=10)

    assert [m["uuid"] for m in listed("2.59")] == [newest, middle, oldest]
    assert {m["id"] for m in listed("2.58")} == {m["id"] for m in listed("2.59")}
    assert len(listed("2.58")) == 3


def test_a_cell_whose_database_does_not_answer_is_left_out_of_the_list(cloud, monkeypatch):
    # GIVEN migrations in cell1 and cell2, and a move between them whose visible copy is in
    # cell2; then cell2's database stops answering
    kept = [add_migration("cell1", minutes=0), add_migration("cell1", minutes=10)]
    add_migration("cell2", minutes=5, source_compute="host3", dest_compute="host3")
    shared = "55555555-5555-4555-8555-555555555555"
    add_migration("cell1", uuid=shared, minutes=7, status="post-migrating", hidden=True, cross_cell_move=True)
    add_migration("cell2", uuid=shared, minutes=7, status="finished", cross_cell_move=True)
    assert shared in [m["uuid"] for m in listed("2.59")]
    cell_away(monkeypatch, moves, "cell2")

    # WHEN the migrations are listed, THEN cell1's are (not a 500), in both orders, and not the
    # move's stale hidden copy, filtered or not
    assert [m["uuid"] for m in listed("2.59")] == kept[::-1]
    assert [m["uuid"] for m in listed("2.80", limit="1", marker=kept[1])] == kept[:1]
    assert len(listed("2.58")) == 2
    assert listed("2.59", status="post-migrating") == []

    # AND a database error that is not of the moment still fails the list
    cell_away(monkeypatch, moves, "cell2", broken=True)
    assert call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.80").status == 500


def test_oldest_first_below_2_59(cloud):
    add_migration("cell1", minutes=10, status="confirmed")
    add_migration("cell1", minutes=0, status="reverted")

    assert [m["status"] for m in listed("2.58")] == ["reverted", "confirmed"]


def test_filters(cloud):
    a = add_migration(minutes=1, status="finished", migration_type=migration_states.RESIZE)
    b = add_migration(minutes=2, status="confirmed", migration_type=migration_states.MIGRATION, source_compute="host2",
                      dest_compute="host9")
    c = add_migration("cell2", minutes=3, status="error", instance_uuid="22222222-2222-4222-8222-222222222222",
                      source_compute="host3", dest_compute=None, user_id="bob", project_id="project-b")

    def uuids(**query: Any) -> list[str]:
        return [m["uuid"] for m in listed(**query)]

    assert uuids(host="host2") == [b, a]  # as source or as destination
    assert uuids(host="host3") == [c]
    assert uuids(status="confirmed") == [b]
    assert uuids(status=["confirmed", "error"]) == [c, b]
    assert uuids(migration_type="resize") == [c, a]
    assert uuids(migration_type="migration") == [b]
    assert uuids(instance_uuid="22222222-2222-4222-8222-222222222222") == [c]
    assert uuids(source_compute="host1") == [a]
    assert uuids(project_id="project-b") == [c] and uuids(user_id="alice") == [b, a]
    assert len(listed("2.58", project_id="project-b")) == 3  # owner filters come with 2.80 (ignored before 2.59)
    assert uuids(status="finished", host="host1") == [a]
    assert uuids(status="nothing-like-it") == []


def test_paging_with_limit_and_marker(cloud):
    made = [add_migration(minutes=i) for i in range(5)]
    newest_first = list(reversed(made))

    first = call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.59", query={"limit": "2", "status": "finished"})
    assert [m["uuid"] for m in first.body["migrations"]] == newest_first[:2]
    [link] = first.body["migrations_links"]
    assert link["rel"] == "next"
    assert "limit=2" in link["href"] and f"marker={newest_first[1]}" in link["href"] and "status=finished" in link[
        "href"]

    second = listed("2.59", limit="2", marker=newest_first[1])
    last = listed("2.59", limit="2", marker=newest_first[3])
    assert [m["uuid"] for m in second] == newest_first[2:4]
    assert [m["uuid"] for m in last] == newest_first[4:]


def test_a_marker_that_is_not_listed_is_400(cloud):
    add_migration()

    response = call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.59",
                    query={"marker": "99999999-9999-4999-8999-999999999999"})

    assert response.status == 400
    assert response.body["badRequest"]["message"] == \
        "Marker 99999999-9999-4999-8999-999999999999 could not be found."


def test_limit_and_marker_are_ignored_below_2_59(cloud):
    for i in range(3):
        add_migration(minutes=i)

    response = call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.58", query={"limit": "1", "marker": "x"})

    assert response.status == 200 and len(response.body["migrations"]) == 3
    assert "migrations_links" not in response.body


def test_changes_since_and_before(cloud):
    add_migration(minutes=0)
    late = add_migration(minutes=30)

    assert [m["uuid"] for m in listed("2.59", **{"changes-since": "2026-01-01T12:10:00Z"})] == [late]
    assert len(listed("2.58", **{"changes-before": "2026-01-01T12:10:00Z"})) == 2  # changes-before is 2.66+
    assert len(listed("2.66", **{"changes-before": "2026-01-01T12:10:00Z"})) == 1
    bad = call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.66",
               query={"changes-since": "2026-01-02T00:00:00", "changes-before": "2026-01-01T00:00:00"})
    assert bad.status == 400
    assert call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.59",
                query={"changes-since": "yesterday"}).status == 400


def test_hidden_cross_cell_copies_are_listed_once(cloud):
    server_id, _ = resized_server()  # lives in cell1
    shared = "33333333-3333-4333-8333-333333333333"
    add_migration("cell1", uuid=shared, instance_uuid=server_id, status="finished", cross_cell_move=True)
    add_migration("cell2", uuid=shared, instance_uuid=server_id, status="post-migrating", hidden=True,
                  cross_cell_move=True)
    both_visible = "44444444-4444-4444-8444-444444444444"
    add_migration("cell1", uuid=both_visible, instance_uuid=server_id, status="finished", minutes=1)
    add_migration("cell2", uuid=both_visible, instance_uuid=server_id, status="migrating", minutes=1)

    shown = {m["uuid"]: m["status"] for m in listed("2.59", instance_uuid=server_id)}

    assert shown[shared] == "finished"
    assert shown[both_visible] == "finished"  # the copy in the cell the server lives in
    assert len(listed("2.59", instance_uuid=server_id)) == 3


def cross_cell_copies(server_id: str, shown: dict[str, Any], stale: dict[str, Any]) -> str:
    """A cross-cell migration of ``server_id`` (which lives in cell1): the copy a list shows in
    cell1, an out-of-date hidden one in cell2."""
    uuid = "55555555-5555-4555-8555-555555555555"
    add_migration("cell1", uuid=uuid, instance_uuid=server_id, cross_cell_move=True, **shown)
    add_migration("cell2", uuid=uuid, instance_uuid=server_id, cross_cell_move=True, hidden=True, **stale)
    return uuid


def test_filters_apply_to_the_copy_the_list_shows_not_to_a_stale_one(cloud):
    # GIVEN a cross-cell migration being confirmed, whose other cell still holds it as finished
    server_id = active_server()
    uuid = cross_cell_copies(
        server_id,
        shown={"status": "confirming", "updated_at": T0 + dt.timedelta(minutes=1), "dest_compute": "host2"},
        stale={"status": "finished", "updated_at": T0 + dt.timedelta(minutes=60), "dest_compute": "host7"})
    assert [(m["uuid"], m["status"]) for m in listed("2.80")] == [(uuid, "confirming")]

    # WHEN the list is filtered THEN the shown copy decides, as in the unfiltered list
    assert listed("2.80", status="finished") == []
    assert [(m["uuid"], m["status"]) for m in listed("2.80", status="confirming")] == [(uuid, "confirming")]
    assert [m["status"] for m in listed("2.80", status=["finished", "confirming"])] == ["confirming"]
    assert listed("2.80", **{"changes-since": "2026-01-01T12:30:00Z"}) == []
    assert [m["uuid"] for m in listed("2.80", **{"changes-before": "2026-01-01T12:30:00Z"})] == [uuid]
    assert listed("2.80", host="host7") == []
    assert [m["status"] for m in listed("2.80", host="host2", status="confirming")] == ["confirming"]
    assert [m["status"] for m in listed("2.58", status="confirming")] == ["confirming"]
    assert listed("2.58", status="finished") == []


def test_a_stale_copy_that_alone_passes_a_filter_does_not_hide_the_shown_one(cloud):
    server_id = active_server()
    uuid = cross_cell_copies(server_id, shown={"status": "confirmed"}, stale={"status": "confirming"})
    other = add_migration("cell2", minutes=5, status="confirmed", source_compute="host3", dest_compute="host3")

    assert [(m["uuid"], m["status"]) for m in listed("2.80", status="confirmed")] == \
        [(other, "confirmed"), (uuid, "confirmed")]
    assert listed("2.80", status="confirming") == []


def test_the_next_page_follows_a_marker_that_no_longer_passes_the_filters(cloud):
    # GIVEN three finished migrations and the first page of the finished ones
    oldest, middle, newest = (add_migration(minutes=i) for i in range(3))
    first = call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.59", query={"status": "finished", "limit": "1"})
    assert [m["uuid"] for m in first.body["migrations"]] == [newest]
    next_query = parse_qs(urlsplit(first.body["migrations_links"][0]["href"]).query)
    assert next_query == {"status": ["finished"], "limit": ["1"], "marker": [newest]}

    # WHEN the marker's migration is confirmed before the next page is asked for
    with cell_session("cell1") as session:
        session.execute(update(Migration).where(Migration.uuid == newest).values(status="confirmed"))

    # THEN the next page continues after the marker's place in the order
    assert [m["uuid"] for m in listed("2.59", **next_query)] == [middle]
    assert [m["uuid"] for m in listed("2.59", status="finished", marker=newest)] == [middle, oldest]
    assert [m["uuid"] for m in listed("2.59", status="finished", marker=middle)] == [oldest]
    assert listed("2.59", host="host9", marker=newest) == []  # a marker that no filter would keep
    assert [m["uuid"] for m in listed("2.59", marker=newest)] == [middle, oldest]
    missing = call("GET", "/v2.1/os-migrations", caller=ADMIN, version="2.59",
                   query={"status": "finished", "marker": "99999999-9999-4999-8999-999999999999"})
    assert missing.status == 400
    assert missing.body["badRequest"]["message"] == \
        "Marker 99999999-9999-4999-8999-999999999999 could not be found."


def test_a_cross_cell_marker_stands_where_the_unfiltered_list_shows_it(cloud):
    server_id = active_server()
    before = add_migration("cell2", minutes=-5, source_compute="host3", dest_compute="host3")
    uuid = cross_cell_copies(server_id, shown={"status": "confirming"}, stale={"status": "finished"})
    after = add_migration("cell2", minutes=5, source_compute="host3", dest_compute="host3")
    assert [m["uuid"] for m in listed("2.59")] == [after, uuid, before]

    assert [m["uuid"] for m in listed("2.59", status="finished", marker=uuid)] == [before]
    assert [m["uuid"] for m in listed("2.59", status="finished", marker=after)] == [before]


# --- query parameters -------------------------------------------------------------------------------


def unexpected(name: str) -> str:
    return f"Invalid input for query parameters {name}. Additional properties are not allowed ('{name}' was unexpected)"


@pytest.mark.parametrize(("version", "name"), [
    ("2.59", "foo"),
    ("2.80", "migration-type"),  # a typo of migration_type
    ("2.80", "server_id"),
    ("2.59", "changes-before"),  # from 2.66
    ("2.65", "changes-before"),
    ("2.79", "user_id"),  # from 2.80
    ("2.79", "project_id"),
    ("2.96", "sort_key"),
])
def test_unknown_query_parameters_are_refused_from_2_59(cloud, version, name):
    add_migration()

    response = call("GET", "/v2.1/os-migrations", caller=ADMIN, version=version, query={name: "resize"})

    assert response.status == 400
    assert response.body["badRequest"]["message"] == unexpected(name)


def test_unknown_query_parameters_are_ignored_below_2_59(cloud):
    add_migration(minutes=0)
    add_migration(minutes=1, migration_type=migration_states.MIGRATION)

    assert len(listed("2.58", foo="bar", **{"migration-type": "resize"})) == 2
    assert len(listed("2.1", user_id="nobody", **{"changes-since": "2030-01-01T00:00:00Z"})) == 2


def test_the_query_is_checked_before_the_policy(cloud):
    refused = call("GET", "/v2.1/os-migrations", caller=ALICE, version="2.80", query={"foo": "bar"})
    forbidden = call("GET", "/v2.1/os-migrations", caller=ALICE, version="2.80", query={"host": "host1"})

    assert (refused.status, refused.body["badRequest"]["message"]) == (400, unexpected("foo"))
    assert forbidden.status == 403


def test_every_parameter_the_clients_send_is_taken(cloud):
    uuid = add_migration(minutes=1)
    marker = add_migration(minutes=2)
    # openstacksdk's Migration query parameters (``openstack server migration list`` uses them),
    # and ``hidden`` from Nova's schema
    query = {"host": "host1", "status": "finished", "migration_type": "resize",
             "instance_uuid": "11111111-1111-4111-8111-111111111111", "source_compute": "host1",
             "user_id": "alice", "project_id": "project-a", "changes-since": "2026-01-01T00:00:00Z",
             "changes-before": "2026-01-02T00:00:00Z", "limit": "5", "marker": marker, "hidden": "0"}

    assert [m["uuid"] for m in listed("2.80", **query)] == [uuid]
    assert [m["uuid"] for m in listed("2.96", **query)] == [uuid]
    assert len(listed("2.59", **{k: v for k, v in query.items() if k not in (
        "changes-before", "user_id", "project_id")})) == 1


def test_moves_made_through_the_api_are_listed(cloud):
    resize_server = active_server()
    migrate_server = active_server()
    assert action(resize_server, {"resize": {"flavorRef": "2"}}).status == 202
    assert action(migrate_server, {"migrate": None}, caller=ADMIN).status == 202

    shown = {m["instance_uuid"]: m for m in listed("2.80")}

    assert (shown[resize_server]["migration_type"], shown[resize_server]["status"]) == ("resize", "pre-migrating")
    assert shown[resize_server]["old_instance_type_id"] != shown[resize_server]["new_instance_type_id"]
    assert (shown[migrate_server]["migration_type"], shown[migrate_server]["user_id"]) == ("migration", "root")
    assert shown[migrate_server]["old_instance_type_id"] == shown[migrate_server]["new_instance_type_id"]


# --- a server's migrations --------------------------------------------------------------------------


def test_a_servers_migrations_are_in_progress_live_migrations_only(cloud):
    server_id, migration_uuid = resized_server()

    listed_for_server = call("GET", f"/v2.1/servers/{server_id}/migrations", caller=ADMIN, version="2.80")
    shown = call("GET", f"/v2.1/servers/{server_id}/migrations/1", caller=ADMIN, version="2.80")

    assert (listed_for_server.status, listed_for_server.body) == (200, {"migrations": []})
    assert shown.status == 404
    assert shown.body["itemNotFound"]["message"] == \
        f"In-progress live migration 1 is not found for server {server_id}."


def test_aborting_or_forcing_a_live_migration_is_409_as_for_a_server_not_migrating_live(cloud):
    server_id, _ = resized_server()
    abort, force = f"/v2.1/servers/{server_id}/migrations/1", f"/v2.1/servers/{server_id}/migrations/1/action"

    aborted = call("DELETE", abort, caller=ADMIN, version="2.80")
    forced = call("POST", force, caller=ADMIN, body={"force_complete": None}, version="2.80")

    assert (aborted.status, aborted.body["conflictingRequest"]["message"]) == (
        409, f"Cannot 'abort live migration' instance {server_id} while it is in task_state None")
    assert (forced.status, forced.body["conflictingRequest"]["message"]) == (
        409, f"Cannot 'force_complete' instance {server_id} while it is in task_state None")
    # before their microversions there is no such resource; a member may not; a bad body is 400
    assert call("DELETE", abort, caller=ADMIN, version="2.23").status == 404
    assert call("POST", force, caller=ADMIN, body={"force_complete": None}, version="2.21").status == 404
    assert call("DELETE", abort, caller=ALICE, version="2.80").status == 403
    assert call("POST", force, caller=ALICE, body={"force_complete": None}, version="2.80").status == 403
    assert call("POST", force, caller=ADMIN, body={"force_complete": 1}, version="2.80").status == 400
    assert call("DELETE", "/v2.1/servers/00000000-0000-4000-8000-000000000000/migrations/1", caller=ADMIN,
                version="2.80").status == 404


def test_server_migrations_need_2_23_a_known_server_and_the_policy(cloud):
    server_id, _ = resized_server()

    assert call("GET", f"/v2.1/servers/{server_id}/migrations", caller=ADMIN, version="2.22").status == 404
    assert call("GET", "/v2.1/servers/00000000-0000-4000-8000-000000000000/migrations", caller=ADMIN,
                version="2.80").status == 404
    assert call("GET", f"/v2.1/servers/{server_id}/migrations", caller=ALICE, version="2.80").status == 403
    assert call("GET", f"/v2.1/servers/{server_id}/migrations", caller=BOB, version="2.80").status == 404


# --- instance actions of moves ----------------------------------------------------------------------


def record_events(server_id: str, request_id: str, names: list[str], *, error_on: str | None = None) -> None:
    """What the workflow steps record under the action of ``request_id``."""
    with cell_session("cell1") as session:
        for name in names:
            actions.start_event(session, instance_uuid=server_id, request_id=request_id, event=name, host="host2")
            failure = RuntimeError("No valid host was found.") if name == error_on else None
            actions.finish_event(session, instance_uuid=server_id, request_id=request_id, event=name,
                                 host="host2", error=failure)


def _action_ids(server_id: str, query: dict, version: str = "2.90") -> tuple[list[str], list[dict]]:
    response = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions", query=query, version=version)
    assert response.status == 200, response.body
    return [a["request_id"] for a in response.body["instanceActions"]], response.body.get("links", [])


def test_instance_actions_page_from_2_58_and_filter_by_their_last_change(cloud, monkeypatch):
    server_id = active_server()
    resize_id = action(server_id, {"resize": {"flavorRef": "2"}}).header("x-openstack-request-id")
    with cell_session("cell1") as session:
        session.execute(update(InstanceAction).where(InstanceAction.request_id == resize_id)
                        .values(start_time=dt.datetime(2020, 1, 1), updated_at=None))
        for request_id in ("req-stop", "req-start"):
            actions.start_action(session, instance_uuid=server_id, action=request_id[4:], request_id=request_id,
                                 user_id="u", project_id="p")
    newest_first = _action_ids(server_id, {})[0]
    assert newest_first == ["req-start", "req-stop", resize_id]

    first, links = _action_ids(server_id, {"limit": "1"})
    assert first == newest_first[:1]
    query = parse_qs(urlsplit(links[0]["href"]).query)
    assert query == {"limit": ["1"], "marker": first}
    rest, _ = _action_ids(server_id, {"limit": "5", "marker": first[0]})
    assert rest == newest_first[1:]
    assert _action_ids(server_id, {"limit": "1"}, version="2.57") == (newest_first, [])  # no paging before 2.58
    with monkeypatch.context() as patched:
        patched.setattr(compute_api, "MAX_LIST_LIMIT", 2)
        assert _action_ids(server_id, {}, version="2.57")[0] == newest_first  # nor a largest page
        assert _action_ids(server_id, {})[0] == newest_first[:2]
    bad_marker = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions", query={"marker": "req-none"},
                      version="2.90")
    assert bad_marker.status == 400

    # a marker is found whether or not it passes the time filters
    assert _action_ids(server_id, {"marker": "req-start", "changes-before": "2021-01-01T00:00:00Z"})[0] == \
        [resize_id]

    # the last change: an event started on an action moves it
    assert _action_ids(server_id, {"changes-before": "2021-01-01T00:00:00Z"})[0] == [resize_id]
    record_events(server_id, resize_id, ["conductor_migrate_server"])
    assert resize_id in _action_ids(server_id, {"changes-since": "2021-01-01T00:00:00Z"})[0]
    assert _action_ids(server_id, {"changes-before": "2021-01-01T00:00:00Z"})[0] == []
    assert call("GET", f"/v2.1/servers/{server_id}/os-instance-actions", query={"changes-since": "soon"},
                version="2.90").status == 400


def test_move_actions_are_listed_newest_first_with_their_events(cloud):
    server_id = active_server()
    resize = action(server_id, {"resize": {"flavorRef": "2"}})
    resize_id = resize.header("x-openstack-request-id")
    record_events(server_id, resize_id, ["conductor_migrate_server", "compute_prep_resize",
                                         "compute_resize_instance", "compute_finish_resize"])
    with cell_session("cell1") as session:
        migration = session.scalars(select(Migration)).one()
        migration.status = migration_states.FINISHED
        row = session.scalars(select(moves.Instance).where(moves.Instance.uuid == server_id)).one()
        row.vm_state, row.task_state = "resized", None
    revert = action(server_id, {"revertResize": None})
    revert_id = revert.header("x-openstack-request-id")
    record_events(server_id, revert_id, ["compute_revert_resize", "compute_finish_revert_resize"])

    listed_actions = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions", version="2.90")
    assert listed_actions.status == 200
    assert [(a["action"], a["request_id"]) for a in listed_actions.body["instanceActions"]] == \
        [("revertResize", revert_id), ("resize", resize_id)]

    member_view = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{resize_id}", version="2.90")
    admin_view = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{resize_id}", caller=ADMIN,
                      version="2.90")
    assert member_view.status == admin_view.status == 200
    events = member_view.body["instanceAction"]["events"]
    assert [e["event"] for e in events] == ["compute_finish_resize", "compute_resize_instance",
                                            "compute_prep_resize", "conductor_migrate_server"]  # newest first
    assert {e["result"] for e in events} == {"Success"}
    assert all("traceback" not in e and "host" not in e for e in events)
    assert all("traceback" in e and e["host"] == "host2" for e in admin_view.body["instanceAction"]["events"])


def test_a_no_valid_host_migrate_shows_the_error_in_its_event(cloud):
    server_id = active_server()
    migrate = action(server_id, {"migrate": None}, caller=ADMIN)
    request_id = migrate.header("x-openstack-request-id")
    record_events(server_id, request_id, ["conductor_migrate_server"], error_on="conductor_migrate_server")

    shown = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{request_id}", caller=ADMIN,
                 version="2.84").body["instanceAction"]

    assert shown["action"] == "migrate"
    [event] = shown["events"]
    assert (event["event"], event["result"]) == ("conductor_migrate_server", "Error")
    assert "No valid host was found." in event["details"]


def test_a_failed_action_says_only_error_and_keeps_the_details_on_its_event(cloud):
    server_id = active_server()
    resize = action(server_id, {"resize": {"flavorRef": "2"}})
    request_id = resize.header("x-openstack-request-id")
    record_events(server_id, request_id, ["conductor_migrate_server"], error_on="conductor_migrate_server")

    [listed_action] = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions",
                           version="2.90").body["instanceActions"]
    member_view = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{request_id}",
                       version="2.90").body["instanceAction"]
    admin_view = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{request_id}", caller=ADMIN,
                      version="2.90").body["instanceAction"]

    assert listed_action["message"] == member_view["message"] == admin_view["message"] == "Error"
    assert "details" not in member_view["events"][0]
    assert "No valid host was found." in admin_view["events"][0]["details"]


def test_confirm_action_is_recorded_under_the_request_id(cloud):
    server_id, _ = resized_server()

    confirm = action(server_id, {"confirmResize": None})

    request_id = confirm.header("x-openstack-request-id")
    shown = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions/{request_id}", version="2.90")
    assert shown.status == 200
    assert (shown.body["instanceAction"]["action"], shown.body["instanceAction"]["events"]) == ("confirmResize", [])
    with cell_session("cell1") as session:
        assert session.scalars(select(InstanceAction.action)).all() == ["confirmResize"]
