"""The cell database migrations create exactly the tables the models describe, and keep what is there."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.exc import IntegrityError

from ferry.compute.instances import default_hostname
from ferry.store import db, migrate
from ferry.store.cell_models import CellBase, InstanceAction, InstanceActionEvent
from ferry.store.db import engine_for

NOW = dt.datetime(2026, 1, 1)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_cell_url(request, tmp_path) -> Iterator[str]:
    """The URL of an empty database, on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'cell.sqlite'}"
        yield url
        forget_engine(url)
    else:
        yield from empty_pg_database(request.getfixturevalue("pg_base_url"))


def empty_pg_database(base_url: str) -> Iterator[str]:
    """A new empty PostgreSQL database's URL; the database is dropped after."""
    name = f"ferry_mig_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base_url + "postgres", isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
        yield base_url + name
        forget_engine(base_url + name)
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    finally:
        admin.dispose()


def forget_engine(url: str) -> None:
    """Close the process's connections to ``url`` and forget its engine."""
    with db._lock:
        engine = db._engines.pop(url, None)
    if engine is not None:
        engine.dispose()


def insert_instance(connection: Any, instance_uuid: str, name: str) -> None:
    """A server row as the schema of 0001_cell has it."""
    connection.execute(text(
        "INSERT INTO instances (uuid, display_name, project_id, user_id, flavor, vm_state, power_state, metadata, "
        "locked, hidden, deleted, created_at) VALUES (:uuid, :name, 'p', 'u', '{}', 'active', 1, '{}', "
        ":no, :no, :no, :now)"), {"uuid": instance_uuid, "name": name, "no": False, "now": NOW})


def insert_action(connection: Any, instance_uuid: str, request_id: str, **values: Any) -> int:
    """An action row (without the unique constraint of 0005_cell, copies are allowed); its id."""
    row = {"action": "create", "user_id": None, "project_id": None, "start_time": NOW, "finish_time": None,
           "message": None, "updated_at": None, **values, "instance_uuid": instance_uuid, "request_id": request_id}
    connection.execute(text(
        "INSERT INTO instance_actions (action, instance_uuid, request_id, user_id, project_id, start_time, "
        "finish_time, message, updated_at) VALUES (:action, :instance_uuid, :request_id, :user_id, :project_id, "
        ":start_time, :finish_time, :message, :updated_at)"), row)
    return connection.execute(text("SELECT max(id) FROM instance_actions")).scalar_one()


def insert_event(connection: Any, action_id: int, event: str, **values: Any) -> None:
    row = {"start_time": NOW, "finish_time": None, "result": None, "traceback": None, "host": None,
           "details": None, **values, "action_id": action_id, "event": event}
    connection.execute(text(
        "INSERT INTO instance_actions_events (action_id, event, start_time, finish_time, result, traceback, host, "
        "details) VALUES (:action_id, :event, :start_time, :finish_time, :result, :traceback, :host, :details)"), row)


def test_migrated_cell_databases_match_the_models(store):
    for url in store.cells.values():
        with engine_for(url).connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, CellBase.metadata) == []


def test_the_description_column_is_added_to_existing_instances(empty_cell_url):
    url = empty_cell_url
    migrate.upgrade("cell", url, "0001_cell")
    with engine_for(url).begin() as connection:
        insert_instance(connection, "u-1", "before")

    migrate.upgrade("cell", url)

    with engine_for(url).connect() as connection:
        row = connection.execute(text("SELECT display_name, display_description FROM instances")).one()
    assert tuple(row) == ("before", None)


def test_servers_that_exist_get_a_hostname_from_their_name_and_a_reservation_id(empty_cell_url):
    url = empty_cell_url
    migrate.upgrade("cell", url, "0002_cell")
    with engine_for(url).begin() as connection:
        for instance_uuid, name in (("u-1", "Web Server_1"), ("u-2", "☕")):
            insert_instance(connection, instance_uuid, name)

    migrate.upgrade("cell", url)

    with engine_for(url).connect() as connection:
        rows = connection.execute(text("SELECT uuid, hostname, reservation_id, user_data FROM instances "
                                       "ORDER BY uuid")).all()
    assert [(r.uuid, r.hostname, r.user_data) for r in rows] == [("u-1", "web-server-1", None),
                                                                 ("u-2", "Server-u-2", None)]
    assert all(re.fullmatch(r"r-[a-z0-9]{8}", r.reservation_id) for r in rows)
    assert rows[0].reservation_id != rows[1].reservation_id


def test_the_launch_index_comes_and_goes_with_0007_and_servers_keep_their_rows(empty_cell_url):
    # GIVEN a server made before 0007
    url = empty_cell_url
    migrate.upgrade("cell", url, "0006_cell")
    with engine_for(url).begin() as connection:
        insert_instance(connection, "u-1", "before")

    # WHEN the cell is upgraded, THEN it has no launch index (shown as 0)
    migrate.upgrade("cell", url)
    with engine_for(url).connect() as connection:
        assert tuple(connection.execute(text("SELECT display_name, launch_index FROM instances")).one()) == (
            "before", None)

    # WHEN 0007 is undone, THEN the column is gone and the server is still there
    cfg = migrate.alembic_config("cell", url)
    with engine_for(url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, "0006_cell")
    with engine_for(url).connect() as connection:
        assert "launch_index" not in {c["name"] for c in inspect(connection).get_columns("instances")}
        assert connection.execute(text("SELECT display_name FROM instances")).scalar_one() == "before"


def test_the_list_indexes_come_and_go_with_0008_and_servers_keep_their_rows(empty_cell_url):
    # GIVEN a server made before 0008
    url = empty_cell_url
    migrate.upgrade("cell", url, "0007_cell")
    with engine_for(url).begin() as connection:
        insert_instance(connection, "u-1", "before")
    listing = {"ix_instances_deleted_created_at_uuid", "ix_instances_project_id_deleted_created_at_uuid"}

    # WHEN the cell is upgraded, THEN the servers are indexed newest first (every project's, and each's)
    migrate.upgrade("cell", url)
    with engine_for(url).connect() as connection:
        assert listing <= {index["name"] for index in inspect(connection).get_indexes("instances")}

    # WHEN 0008 is undone, THEN the indexes are gone and the server is still there
    cfg = migrate.alembic_config("cell", url)
    with engine_for(url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, "0007_cell")
    with engine_for(url).connect() as connection:
        assert not listing & {index["name"] for index in inspect(connection).get_indexes("instances")}
        assert connection.execute(text("SELECT display_name FROM instances")).scalar_one() == "before"


def test_the_indexes_the_list_indexes_begin_with_go_with_0009_and_come_back_when_it_is_undone(empty_cell_url):
    # GIVEN a server made before 0009
    url = empty_cell_url
    migrate.upgrade("cell", url, "0008_cell")
    with engine_for(url).begin() as connection:
        insert_instance(connection, "u-1", "before")
    prefixes = {("instances", "deleted"), ("instances", "project_id")}
    assert prefixes <= single_column_indexes(url, prefixes)

    # WHEN the cell is upgraded, THEN deleted and project_id have no index of their own
    migrate.upgrade("cell", url)
    assert not prefixes & single_column_indexes(url, prefixes)
    if url.startswith("sqlite"):  # a project's servers are still read by index
        with engine_for(url).connect() as connection:
            plan = " ".join(str(row[-1]) for row in connection.execute(text(
                "EXPLAIN QUERY PLAN SELECT count(*) FROM instances WHERE project_id = 'p' AND deleted = 0")))
        assert "ix_instances_project_id_deleted_created_at_uuid" in plan

    # WHEN 0009 is undone, THEN they are back and the server is still there
    cfg = migrate.alembic_config("cell", url)
    with engine_for(url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, "0008_cell")
    assert prefixes <= single_column_indexes(url, prefixes)
    with engine_for(url).connect() as connection:
        assert connection.execute(text("SELECT display_name FROM instances")).scalar_one() == "before"


def test_the_api_index_of_a_cells_servers_by_acceptance_comes_and_goes_with_0012(empty_cell_url):
    # GIVEN an API database at the head
    url = empty_cell_url
    migrate.upgrade("api", url)
    name = "ix_instance_mappings_cell_listing"

    def indexes() -> dict[str, list[str]]:
        with engine_for(url).connect() as connection:
            return {i["name"]: i["column_names"] for i in inspect(connection).get_indexes("instance_mappings")}

    # THEN a cell's mappings are indexed by acceptance, and a list of a cell's servers reads by it
    assert indexes()[name] == ["cell_id", "queued_for_delete", "created_at", "instance_uuid"]
    if url.startswith("sqlite"):
        with engine_for(url).connect() as connection:
            plan = " ".join(str(row[-1]) for row in connection.execute(text(
                "EXPLAIN QUERY PLAN SELECT instance_uuid FROM instance_mappings WHERE cell_id = 1 AND "
                "queued_for_delete = 0 ORDER BY created_at DESC, instance_uuid DESC LIMIT 10")))
        assert name in plan and "TEMP B-TREE" not in plan, plan

    # WHEN 0012 is undone, THEN the index is gone
    cfg = migrate.alembic_config("api", url)
    with engine_for(url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, "0011_api")
    assert name not in indexes()


NAMES = ["Web Server_1", "☕", "", "..db.01..", "Ünïcode façade", "x" * 80, "a b_c.d", "ß²µ-ºª", "  -_-  ", "web"]


def test_every_server_is_filled_in_as_before_however_many_there_are(empty_cell_url):
    # GIVEN more servers than one statement fills in, with names of every kind, at 0002
    url = empty_cell_url
    migrate.upgrade("cell", url, "0002_cell")
    servers = {f"u-{n:04d}": NAMES[n % len(NAMES)] + ("" if n < len(NAMES) else f" {n}") for n in range(457)}
    with engine_for(url).begin() as connection:
        for instance_uuid, name in servers.items():
            insert_instance(connection, instance_uuid, name)

    # WHEN the cell is upgraded
    migrate.upgrade("cell", url)

    # THEN each has the hostname its name gave before, and a reservation id of its own
    with engine_for(url).connect() as connection:
        rows = connection.execute(text("SELECT uuid, hostname, reservation_id FROM instances")).all()
    assert {r.uuid: r.hostname for r in rows} == {u: default_hostname(name, u) for u, name in servers.items()}
    assert all(re.fullmatch(r"r-[a-z0-9]{8}", r.reservation_id) for r in rows)
    assert len({r.reservation_id for r in rows}) == len(rows)


def test_a_requests_copies_of_an_action_become_one_with_every_event(empty_cell_url):
    # GIVEN a request whose action two deliveries recorded three times, each copy with events,
    # beside actions that are no copies (another request of the server, the request on another server)
    url = empty_cell_url
    migrate.upgrade("cell", url, "0004_cell")
    t = [NOW + dt.timedelta(minutes=m) for m in range(10)]
    with engine_for(url).begin() as connection:
        oldest = insert_action(connection, "u-1", "req-1", start_time=t[1])
        second = insert_action(connection, "u-1", "req-1", user_id="alice", start_time=t[0], finish_time=t[5],
                               updated_at=t[5])
        third = insert_action(connection, "u-1", "req-1", project_id="demo", start_time=t[2], message="Error",
                              finish_time=t[4], updated_at=t[6])
        other_request = insert_action(connection, "u-1", "req-2")
        other_server = insert_action(connection, "u-2", "req-1")
        insert_event(connection, oldest, "compute_boot", start_time=t[2])
        insert_event(connection, second, "compute_boot", start_time=t[1], finish_time=t[5], result="Success",
                     host="h1", details="ok")
        insert_event(connection, third, "compute_boot", start_time=t[3], finish_time=t[4], result="Error",
                     details="HypervisorError: boom", traceback="Traceback …")
        insert_event(connection, second, "schedule", start_time=t[0], finish_time=t[1], result="Success")
        insert_event(connection, other_request, "compute_stop")
        insert_event(connection, other_server, "compute_boot")

    # WHEN the cell is upgraded
    migrate.upgrade("cell", url)

    # THEN the oldest action stands for the request, with what every copy recorded
    with engine_for(url).connect() as connection:
        a, e = InstanceAction, InstanceActionEvent
        actions = connection.execute(select(a.id, a.instance_uuid, a.request_id, a.user_id, a.project_id,
                                            a.start_time, a.finish_time, a.message, a.updated_at).order_by(a.id)).all()
        events = connection.execute(select(e.action_id, e.event, e.start_time, e.finish_time, e.result, e.host,
                                           e.details, e.traceback).order_by(e.action_id, e.event)).all()
    assert [tuple(a) for a in actions] == [
        (oldest, "u-1", "req-1", "alice", "demo", t[0], t[5], "Error", t[6]),
        (other_request, "u-1", "req-2", None, None, NOW, None, None, None),
        (other_server, "u-2", "req-1", None, None, NOW, None, None, None)]
    assert [tuple(e) for e in events] == [
        (oldest, "compute_boot", t[1], t[5], "Error", "h1", "HypervisorError: boom", "Traceback …"),
        (oldest, "schedule", t[0], t[1], "Success", None, None, None),
        (other_request, "compute_stop", NOW, None, None, None, None, None),
        (other_server, "compute_boot", NOW, None, None, None, None, None)]


def test_a_request_cannot_record_a_second_action_on_a_server(empty_cell_url):
    url = empty_cell_url
    migrate.upgrade("cell", url)
    with engine_for(url).begin() as connection:
        insert_action(connection, "u-1", "req-1")
        insert_action(connection, "u-2", "req-1")

    with pytest.raises(IntegrityError), engine_for(url).begin() as connection:
        insert_action(connection, "u-1", "req-1")


def test_undoing_0005_on_sqlite_with_foreign_keys_on_is_refused_and_keeps_every_event(tmp_path):
    # GIVEN a SQLite cell at the head with an action and its event, its foreign keys on (as
    # Ferry's engines have them)
    url = f"sqlite:///{tmp_path / 'cell.sqlite'}"
    migrate.upgrade("cell", url)
    with engine_for(url).begin() as connection:
        insert_event(connection, insert_action(connection, "u-1", "req-1"), "compute_resize")
        head = connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one()

    # WHEN 0005 is undone through such a connection
    cfg = migrate.alembic_config("cell", url)
    with pytest.raises(RuntimeError, match="foreign keys"), engine_for(url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, "0004_cell")

    # THEN nothing was undone, and the event is still there
    with engine_for(url).connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM instance_actions_events")).scalar_one() == 1
        assert connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head
    forget_engine(url)


@pytest.mark.parametrize(("kind", "last", "indexed"), [
    ("cell", "0006_cell", {("migrations", "source_compute"), ("migrations", "dest_compute")}),
    ("api", "0009_api", {("host_mappings", "cell_id"), ("instance_mappings", "cell_id"),
                         ("resource_providers", "cell_id"), ("ports", "network_id"),
                         ("volume_attachments", "volume_id")}),
    ("api", "0010_api", {("instance_groups", "project_id"), ("instance_group_members", "group_id")}),
])
def test_the_host_and_foreign_key_indexes_come_and_go_with_their_revision(empty_cell_url, kind, last, indexed):
    # GIVEN a database at the head
    migrate.upgrade(kind, empty_cell_url)
    assert indexed <= single_column_indexes(empty_cell_url, indexed)

    # WHEN the revision is undone, THEN its indexes are gone and the revision before is current
    cfg = migrate.alembic_config(kind, empty_cell_url)
    with engine_for(empty_cell_url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, f"{last}-1")
    assert not indexed & single_column_indexes(empty_cell_url, indexed)
    with engine_for(empty_cell_url).connect() as connection:
        assert connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one() != last

    # WHEN it is done again, THEN they are back
    migrate.upgrade(kind, empty_cell_url)
    assert indexed <= single_column_indexes(empty_cell_url, indexed)


def single_column_indexes(url: str, wanted: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The (table, column) pairs of the tables named in ``wanted`` that have an index of their own
    (a table that is not there has none)."""
    with engine_for(url).connect() as connection:
        inspector = inspect(connection)
        return {(table, index["column_names"][0]) for table in {t for t, _ in wanted} if inspector.has_table(table)
                for index in inspector.get_indexes(table) if len(index["column_names"]) == 1}
