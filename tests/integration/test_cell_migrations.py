"""The cell database migrations create exactly the tables the models describe, and keep what is there."""

from __future__ import annotations

import datetime as dt
import re

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from ferry.store import migrate
from ferry.store.cell_models import CellBase
from ferry.store.db import engine_for


def test_migrated_cell_databases_match_the_models(store):
    for url in store.cells.values():
        with engine_for(url).connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, CellBase.metadata) == []


def test_the_description_column_is_added_to_existing_instances(tmp_path):
    url = f"sqlite:///{tmp_path / 'cell.sqlite'}"
    migrate.upgrade("cell", url, "0001_cell")
    with engine_for(url).begin() as connection:
        connection.execute(text(
            "INSERT INTO instances (uuid, display_name, project_id, user_id, flavor, vm_state, power_state, metadata, "
            "locked, hidden, deleted, created_at) VALUES ('u-1', 'before', 'p', 'u', '{}', 'active', 1, '{}', "
            "0, 0, 0, :now)"), {"now": dt.datetime(2026, 1, 1)})

    migrate.upgrade("cell", url)

    with engine_for(url).connect() as connection:
        row = connection.execute(text("SELECT display_name, display_description FROM instances")).one()
    assert tuple(row) == ("before", None)


def test_servers_that_exist_get_a_hostname_from_their_name_and_a_reservation_id(tmp_path):
    url = f"sqlite:///{tmp_path / 'cell.sqlite'}"
    migrate.upgrade("cell", url, "0002_cell")
    with engine_for(url).begin() as connection:
        for uuid, name in (("u-1", "Web Server_1"), ("u-2", "☕")):
            connection.execute(text(
                "INSERT INTO instances (uuid, display_name, project_id, user_id, flavor, vm_state, power_state, "
                "metadata, locked, hidden, deleted, created_at) VALUES (:uuid, :name, 'p', 'u', '{}', 'active', 1, "
                "'{}', 0, 0, 0, :now)"), {"uuid": uuid, "name": name, "now": dt.datetime(2026, 1, 1)})

    migrate.upgrade("cell", url)

    with engine_for(url).connect() as connection:
        rows = connection.execute(text("SELECT uuid, hostname, reservation_id, user_data FROM instances "
                                       "ORDER BY uuid")).all()
    assert [(r.uuid, r.hostname, r.user_data) for r in rows] == [("u-1", "web-server-1", None),
                                                                 ("u-2", "Server-u-2", None)]
    assert all(re.fullmatch(r"r-[a-z0-9]{8}", r.reservation_id) for r in rows)
    assert rows[0].reservation_id != rows[1].reservation_id
