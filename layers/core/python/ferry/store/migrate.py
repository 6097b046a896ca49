"""Schema migrations (Alembic) for the API database and the cell databases.

Alembic is imported when a migration runs, not with this module: every Lambda handler imports
the store, and only set-up paths migrate (importing Alembic costs a cold start ~0.4 s).

On PostgreSQL an upgrade runs while the functions of the release before keep serving, so it
holds each table's lock only briefly: every revision commits on its own, a revision that cannot
have a table's lock within :data:`LOCK_TIMEOUT` gives up (and is tried again) rather than queue
behind a long transaction with every request queued behind it, and two upgrades of one database
take turns (a session advisory lock). SQLite (local stacks and tests) runs the whole upgrade in
one transaction, whose ``BEGIN IMMEDIATE`` makes concurrent upgrades take turns there, with its
foreign keys off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError, OperationalError

from ferry.store.db import engine_for

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).parent / "migrations"

# Keys of the PostgreSQL advisory lock an upgrade of each kind of database holds ("ferryapi" and
# "ferrycel" in ASCII): fixed, so that every `ferry db sync` of a database waits for the one before.
ADVISORY_LOCK_KEYS = {"api": 0x6665727279617069, "cell": 0x666572727963656C}
# How long a schema change may wait for a table's lock before it gives up (PostgreSQL's
# lock_timeout), how often a revision is tried, and the pause between tries.
LOCK_TIMEOUT = "5s"
LOCK_ATTEMPTS = 3
RETRY_PAUSE_SECONDS = 2.0
# PostgreSQL's SQLSTATEs of a lock a revision did not get: not granted within lock_timeout
# (lock_not_available), or a wait that closed a cycle with a function's transaction, which PostgreSQL
# broke by failing the revision (deadlock_detected).
_LOCK_NOT_HAD = frozenset({"55P03", "40P01"})


class SchemaLockTimeout(OperationalError):
    """A revision did not have a table's lock, :data:`LOCK_ATTEMPTS` times in all: a long transaction
    held it (:data:`LOCK_TIMEOUT`), or the wait closed a deadlock PostgreSQL broke. The revisions
    before it are applied; running the upgrade again goes on from there."""

    def __init__(self, kind: str, cause: OperationalError) -> None:
        message = (f"the {kind} database's schema change did not get a table's lock {LOCK_ATTEMPTS} times (a long "
                   f"transaction held it past {LOCK_TIMEOUT}, or a deadlock with a running step); the revisions "
                   f"before it are applied: run `ferry db sync` again")
        super().__init__(cause.statement, None, RuntimeError(message))


def alembic_config(kind: str, url: str) -> Config:
    """An Alembic config for ``kind`` (``api`` or ``cell``) at ``url``."""
    if kind not in ("api", "cell"):
        raise ValueError(f"unknown database kind {kind!r}")
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS / kind))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(kind: str, url: str, revision: str = "head") -> None:
    """Bring the ``kind`` database at ``url`` to ``revision`` (idempotent).

    Raises:
        SchemaLockTimeout: (PostgreSQL) a revision never had its table's lock; the ones before it
            are applied.
    """
    cfg = alembic_config(kind, url)
    engine = engine_for(url)
    if engine.dialect.name == "sqlite":
        with engine.connect() as connection, _foreign_keys_off(connection), connection.begin():
            _run(cfg, connection, revision)
        return
    with engine.connect() as connection, _upgrade_lock(connection, kind):
        _run_retrying(cfg, connection, revision, kind)


def _run(cfg: Config, connection: Connection, revision: str) -> None:
    from alembic import command

    cfg.attributes["connection"] = connection
    command.upgrade(cfg, revision)


def _run_retrying(cfg: Config, connection: Connection, revision: str, kind: str) -> None:
    """Run the upgrade; when a revision's lock wait times out, run it again from where it stopped
    (every revision before it committed), :data:`LOCK_ATTEMPTS` times in all."""
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            _run(cfg, connection, revision)
            return
        except OperationalError as exc:
            connection.rollback()
            if getattr(exc.orig, "pgcode", None) not in _LOCK_NOT_HAD:
                raise
            if attempt == LOCK_ATTEMPTS:
                raise SchemaLockTimeout(kind, exc) from exc
            time.sleep(RETRY_PAUSE_SECONDS)


@contextmanager
def _foreign_keys_off(connection: Connection) -> Iterator[None]:
    """SQLite's foreign keys off for the upgrade (as Alembic advises for batch mode): a revision
    that rebuilds a table drops the old one, and that would delete or refuse the rows of the tables
    referencing it. The pragma is set before the upgrade's transaction begins (inside one SQLite
    ignores it), on the driver's connection so that nothing begins one first."""
    driver = connection.connection.driver_connection
    assert driver is not None
    driver.execute("PRAGMA foreign_keys=OFF")
    try:
        yield
    finally:
        driver.execute("PRAGMA foreign_keys=ON")


@contextmanager
def _upgrade_lock(connection: Connection, kind: str) -> Iterator[None]:
    """Hold ``kind``'s advisory lock (waiting for an upgrade that holds it) with lock_timeout set and
    no statement_timeout, for the connection's session; all are undone after, since the connection
    goes back to the pool. (The role the functions use may carry a statement_timeout,
    docs/installation.md#database-connections: a revision's index build or backfill outlasts it.)"""
    key = ADVISORY_LOCK_KEYS[kind]
    connection.execute(text("SELECT set_config('statement_timeout', '0', false)"))
    connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
    try:
        connection.execute(text("SELECT set_config('lock_timeout', :timeout, false)"), {"timeout": LOCK_TIMEOUT})
        connection.commit()
        yield
    finally:
        _release(connection, key)


def _release(connection: Connection, key: int) -> None:
    """Give the advisory lock back and reset the timeouts; a connection that cannot is discarded
    (closing its session releases the lock and forgets the settings)."""
    try:
        connection.rollback()
        connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
        connection.execute(text("RESET lock_timeout"))
        connection.execute(text("RESET statement_timeout"))
        connection.commit()
    except DBAPIError:
        connection.invalidate()
