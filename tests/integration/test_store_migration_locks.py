"""``ferry db sync`` on PostgreSQL while the functions keep serving: every revision commits on its
own, a revision waits for a table's lock only so long (and is tried again), and two upgrades of
one database take turns."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import ProgrammingError
from test_cell_migrations import empty_pg_database

from ferry.store import migrate
from ferry.store.db import engine_for

pytestmark = pytest.mark.postgres

HEAD = ScriptDirectory.from_config(migrate.alembic_config("cell", "sqlite://")).get_current_head()


@pytest.fixture
def cell_url(pg_base_url) -> Iterator[str]:
    yield from empty_pg_database(pg_base_url)


@pytest.fixture
def quick_lock_waits(monkeypatch) -> None:
    """Lock waits of a fraction of a second, so that a test of them takes no longer."""
    monkeypatch.setattr(migrate, "LOCK_TIMEOUT", "200ms")
    monkeypatch.setattr(migrate, "RETRY_PAUSE_SECONDS", 0.5)


def version_of(url: str) -> str | None:
    with engine_for(url).connect() as connection:
        if not inspect(connection).has_table("alembic_version"):
            return None
        return connection.execute(text("SELECT version_num FROM alembic_version")).scalar_one_or_none()


def columns_of(url: str, table: str) -> set[str]:
    with engine_for(url).connect() as connection:
        return {column["name"] for column in inspect(connection).get_columns(table)}


def test_two_upgrades_of_one_database_take_turns(cell_url):
    # GIVEN an upgrade of the database under way (its advisory lock held)
    holder = create_engine(cell_url)
    with holder.connect() as held:
        held.execute(text("SELECT pg_advisory_lock(:key)"), {"key": migrate.ADVISORY_LOCK_KEYS["cell"]})
        held.commit()

        # WHEN two more upgrades start together
        with ThreadPoolExecutor(2) as pool:
            upgrades = [pool.submit(migrate.upgrade, "cell", cell_url) for _ in range(2)]
            time.sleep(1.0)

            # THEN both wait, having changed nothing, and both succeed once the first is done
            assert not any(upgrade.done() for upgrade in upgrades)
            assert version_of(cell_url) is None
            held.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": migrate.ADVISORY_LOCK_KEYS["cell"]})
            held.commit()
            for upgrade in upgrades:
                upgrade.result(timeout=60)
    holder.dispose()
    assert version_of(cell_url) == HEAD


def test_each_revision_commits_on_its_own(cell_url):
    # GIVEN a cell at 0002 where 0004's column exists already (so that 0004 fails)
    migrate.upgrade("cell", cell_url, "0002_cell")
    with engine_for(cell_url).begin() as connection:
        connection.execute(text("ALTER TABLE block_device_mappings ADD COLUMN tag VARCHAR(255)"))

    # WHEN the upgrade fails at 0004
    with pytest.raises(ProgrammingError):
        migrate.upgrade("cell", cell_url)

    # THEN 0003 stays applied
    assert version_of(cell_url) == "0003_cell"
    assert {"hostname", "reservation_id", "user_data"} <= columns_of(cell_url, "instances")


def test_a_revision_that_cannot_lock_its_table_gives_up_and_says_to_sync_again(cell_url, quick_lock_waits):
    # GIVEN a cell at 0002 and a long transaction reading the table 0004 alters
    migrate.upgrade("cell", cell_url, "0002_cell")
    reader, pool = create_engine(cell_url), ThreadPoolExecutor(1)
    try:
        with reader.connect() as long_transaction:
            long_transaction.execute(text("SELECT count(*) FROM block_device_mappings"))

            # WHEN the cell is upgraded
            error = pool.submit(migrate.upgrade, "cell", cell_url).exception(timeout=20)

            # THEN it gives up after its tries, saying to run it again; 0003 is applied, and the
            # transaction goes on
            assert isinstance(error, migrate.SchemaLockTimeout)
            assert "run `ferry db sync` again" in str(error)
            assert version_of(cell_url) == "0003_cell"
            long_transaction.execute(text("SELECT count(*) FROM block_device_mappings"))
            long_transaction.rollback()
    finally:
        pool.shutdown()  # once the transaction is over: an upgrade still waiting for it goes on
        reader.dispose()

    # AND the connection went back to the pool with neither the lock timeout nor the advisory lock
    with engine_for(cell_url).connect() as connection:
        assert connection.execute(text("SHOW lock_timeout")).scalar_one() == "0"
    _assert_advisory_lock_free(cell_url)

    # AND once the transaction is over, the upgrade goes on from there
    migrate.upgrade("cell", cell_url)
    assert version_of(cell_url) == HEAD


def test_a_revision_that_waited_too_long_is_tried_again(cell_url, quick_lock_waits, monkeypatch):
    # GIVEN a cell at 0003 and a transaction reading the table 0004 alters, over in under a second
    migrate.upgrade("cell", cell_url, "0003_cell")
    pauses: list[float] = []
    monkeypatch.setattr(migrate, "time", SimpleNamespace(sleep=lambda seconds: (pauses.append(seconds),
                                                                                 time.sleep(seconds))))
    reader = create_engine(cell_url)
    with reader.connect() as short_transaction:
        short_transaction.execute(text("SELECT count(*) FROM block_device_mappings"))
        ended = threading.Timer(0.45, short_transaction.rollback)
        ended.start()

        # WHEN the cell is upgraded meanwhile
        migrate.upgrade("cell", cell_url)
        ended.join()
    reader.dispose()

    # THEN its first try timed out and a later one succeeded
    assert pauses and len(pauses) < migrate.LOCK_ATTEMPTS
    assert version_of(cell_url) == HEAD


def test_a_revision_whose_lock_wait_deadlocked_with_a_step_is_tried_again(cell_url, monkeypatch):
    # GIVEN a cell at 0004 and a step forgetting an action: its events first, then the action
    migrate.upgrade("cell", cell_url, "0004_cell")
    monkeypatch.setattr(migrate, "RETRY_PAUSE_SECONDS", 0.5)
    step = create_engine(cell_url)
    with step.connect() as forgetting:
        forgetting.execute(text("DELETE FROM instance_actions_events WHERE action_id = -1"))

        # WHEN 0005 takes its tables meanwhile (the actions', then waits for the events'), and the
        # step goes on to the actions' table: a cycle PostgreSQL breaks by failing one side
        upgrading = threading.Thread(target=migrate.upgrade, args=("cell", cell_url))
        upgrading.start()
        time.sleep(0.3)
        try:
            forgetting.execute(text("DELETE FROM instance_actions WHERE id = -1"))
            forgetting.commit()
        except Exception:  # noqa: BLE001 - the step may be the side PostgreSQL fails
            forgetting.rollback()
        upgrading.join(30)
    step.dispose()

    # THEN the sync still reaches the head (tried again when it was the side that failed)
    assert version_of(cell_url) == HEAD


def _assert_advisory_lock_free(url: str) -> None:
    other = create_engine(url)
    try:
        with other.connect() as connection:
            key = migrate.ADVISORY_LOCK_KEYS["cell"]
            assert connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar_one()
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
    finally:
        other.dispose()


def test_a_statement_timeout_the_database_gives_does_not_cut_off_an_upgrade(cell_url, monkeypatch):
    # GIVEN a database whose sessions have a short statement_timeout (as the functions' role may)
    with engine_for(cell_url).connect() as connection:
        name = connection.execute(text("SELECT current_database()")).scalar_one()
        connection.execute(text(f"ALTER DATABASE {name} SET statement_timeout = '250ms'"))
        connection.commit()
    engine_for(cell_url).dispose()
    seen: list[str] = []
    run = migrate._run

    def look_then_run(cfg, connection, revision) -> None:
        seen.append(connection.execute(text("SHOW statement_timeout")).scalar_one())
        connection.commit()  # as the upgrade's connection is given to the revisions: no transaction begun
        run(cfg, connection, revision)

    monkeypatch.setattr(migrate, "_run", look_then_run)

    # WHEN the cell is upgraded
    migrate.upgrade("cell", cell_url)

    # THEN its revisions ran with none, and the connection went back to the pool with the database's
    assert seen == ["0"] and version_of(cell_url) == HEAD
    with engine_for(cell_url).connect() as connection:
        assert connection.execute(text("SHOW statement_timeout")).scalar_one() == "250ms"
