"""The API database migration 0007 records the drains final before it as announced (SQLite and PostgreSQL).

Those drains are not announced again at the first look after the upgrade; the drains still under
way are announced as they end.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy import create_engine, text

from ferry.store import db, migrate

DRAINS = sa.table(
    "drains", sa.column("uuid", sa.String), sa.column("status", sa.String), sa.column("target_kind", sa.String),
    sa.column("targets", sa.JSON), sa.column("dry_run", sa.Boolean), sa.column("options", sa.JSON),
    sa.column("allow_cross_cell", sa.Boolean), sa.column("disabled_hosts", sa.JSON), sa.column("origin", sa.String),
    sa.column("user_id", sa.String), sa.column("project_id", sa.String), sa.column("roles", sa.JSON),
    sa.column("request_id", sa.String), sa.column("version", sa.Integer), sa.column("created_at", sa.DateTime),
    sa.column("updated_at", sa.DateTime), sa.column("finished_at", sa.DateTime),
    sa.column("announced_at", sa.DateTime))

CREATED = dt.datetime(2026, 11, 20, 8, 0, 0)
UPDATED = dt.datetime(2026, 11, 20, 9, 30, 0)
ENDED = dt.datetime(2026, 11, 20, 9, 0, 0, 123456)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def api_url(request, tmp_path) -> Iterator[str]:
    """An empty API database, on SQLite or on the test PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'api.sqlite'}"
        return
    base = request.getfixturevalue("pg_base_url")
    name = f"ferry_api_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base + "postgres", isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}"))
        yield base + name
    finally:
        db.engine_for(base + name).dispose()
        db._engines.pop(base + name, None)
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def _drain(name: str, status: str, *, finished_at: dt.datetime | None, dry_run: bool = False) -> dict:
    return {"uuid": name, "status": status, "target_kind": "host", "targets": ["compute-1"], "dry_run": dry_run,
            "options": {}, "allow_cross_cell": False, "disabled_hosts": [], "origin": "api", "user_id": "op",
            "project_id": "ops", "roles": ["admin"], "request_id": f"req-{name}", "version": 1,
            "created_at": CREATED, "updated_at": UPDATED, "finished_at": finished_at}


def test_drains_final_before_the_migration_are_recorded_announced_when_they_ended(api_url):
    migrate.upgrade("api", api_url, "0006_api")
    with db.engine_for(api_url).begin() as connection:
        connection.execute(sa.insert(DRAINS), [
            _drain("failed", "failed", finished_at=ENDED),
            _drain("completed", "completed", finished_at=ENDED),
            _drain("dry-run", "planned", finished_at=ENDED, dry_run=True),
            _drain("no-end-time", "cancelled", finished_at=None),
            _drain("running", "running", finished_at=None),
            _drain("planning", "planning", finished_at=None)])

    migrate.upgrade("api", api_url)

    with db.engine_for(api_url).connect() as connection:
        announced = dict(connection.execute(sa.select(DRAINS.c.uuid, DRAINS.c.announced_at)).all())
    assert announced == {"failed": ENDED, "completed": ENDED, "dry-run": ENDED, "no-end-time": UPDATED,
                         "running": None, "planning": None}


def test_the_migration_is_undone_by_dropping_the_column(api_url):
    from alembic import command

    migrate.upgrade("api", api_url)
    config = migrate.alembic_config("api", api_url)
    with db.engine_for(api_url).begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0006_api")

    with db.engine_for(api_url).connect() as connection:
        columns = {column["name"] for column in sa.inspect(connection).get_columns("drains")}
    assert "announced_at" not in columns and "finished_at" in columns
