"""Engines and sessions for the API database and the cell databases.

One engine per database URL per process (Lambda containers and the agent reuse them
across invocations). SQLite files get WAL and a busy timeout so the local stack's
threads and processes share them; PostgreSQL is used as is.
"""

from __future__ import annotations

import functools
import os
import re
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event, make_url, select
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from ferry import LAMBDA_VARIABLE, config, errors
from ferry.observability import logger
from ferry.store.api_models import CellMapping

# Instances that could not be scheduled live in cell0, a cell with no hosts (as in Nova).
CELL0_NAME = "cell0"

_engines: dict[str, Engine] = {}

# Seconds a new PostgreSQL connection may take: a database that does not answer fails the request
# or step (which Step Functions retries) instead of holding it until the function's timeout.
CONNECT_TIMEOUT = 10
# Connections per database a process keeps open between requests, and opens beyond them at a peak
# (the scheduler reads cells side by side). A Lambda execution environment serves one request at a
# time, and every idle connection it keeps counts against PostgreSQL's max_connections for as long
# as the environment lives: one is kept there (docs/installation.md#database-connections).
LAMBDA_POOL = {"pool_size": 1, "max_overflow": 4}
PROCESS_POOL = {"pool_size": 5, "max_overflow": 20}


# PostgreSQL's SQLSTATEs after which the same transaction run again may well succeed: the
# connection's class (08), serialization_failure, deadlock_detected, too_many_connections,
# lock_not_available, and the server shutting down or starting (57P01-57P03).
_TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "53300", "55P03", "57P01", "57P02", "57P03"})


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database could not be reached or its connection was lost (not a
    deadlock, a conflict or a lock wait, which a step run again gets past)."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated or isinstance(exc, InterfaceError):
        return True
    if not isinstance(exc, OperationalError) or isinstance(exc.orig, sqlite3.OperationalError):
        return False
    code = getattr(exc.orig, "pgcode", None)
    return code is None or code.startswith("08")


def left_out(exc: DBAPIError, cell: CellMapping, what: str, **extra: Any) -> None:
    """In a read across cells, leave ``cell`` out when ``exc`` says its database does not answer
    for the moment (:func:`transient`): logged as leaving out its ``what`` (``extra`` added to
    the line), as Nova reads every cell and skips one that does not respond. Any other error is
    raised.

    Raises:
        DBAPIError: ``exc``, when it is not of the moment.
    """
    if not transient(exc):
        raise exc
    logger.warning(f"cell database does not answer; its {what} are left out",
                   extra={"cell": cell.name, "error": type(exc).__name__, **extra})


def unavailable(exc: BaseException, request_id: str) -> errors.DatabaseUnavailable | None:
    """What an API answers for ``exc`` when it is a database failure of the moment
    (:func:`transient`): a :class:`~ferry.errors.DatabaseUnavailable` (503) that tells the caller
    to try again and names the request id its log lines carry; None for any other error."""
    if not isinstance(exc, DBAPIError) or not transient(exc):
        return None
    return errors.DatabaseUnavailable(f"A database this request needs does not answer for the moment; try again "
                                      f"later. Request id {request_id}.")


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a database failure of the moment rather than of the request: a connection
    refused, lost or closed (:func:`unreachable`), a transaction PostgreSQL ended to break a
    deadlock or a serialization conflict, a lock not had within lock_timeout, SQLite's write lock
    not had within its busy timeout. A statement cancelled by statement_timeout is not: it would
    likely run as long again."""
    if unreachable(exc):
        return True
    if not isinstance(exc, OperationalError):
        return False
    if isinstance(exc.orig, sqlite3.OperationalError):
        return "locked" in str(exc.orig) or "busy" in str(exc.orig)
    return getattr(exc.orig, "pgcode", None) in _TRANSIENT_SQLSTATES


class DatabaseUrlUnreadable(ArgumentError):
    """A database URL SQLAlchemy cannot read: what it takes for the port is no number.

    An ``ArgumentError``, as SQLAlchemy raises for a URL it cannot read at all, so that whatever
    handles one handles both. Its message never quotes the URL: what was taken for the port is
    often part of a password.
    """


# A URL's scheme (``postgresql+psycopg2``), as it starts the URL.
_SCHEME = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*)://")


def parse_url(url: str) -> URL:
    """``url`` parsed as SQLAlchemy parses a database URL.

    Raises:
        DatabaseUrlUnreadable: what lies where the port goes is no number (typically a password
            holding an ``@`` or a ``:`` that is not percent-encoded, which the parse splits at the
            wrong place).
        ArgumentError: SQLAlchemy cannot read it at all.
    """
    try:
        return make_url(url)
    except ValueError:
        scheme = _SCHEME.match(url)
        raise DatabaseUrlUnreadable(
            f"the {scheme.group(1) + ' ' if scheme else ''}database URL cannot be read: its port, as read, is not "
            f"a number (percent-encode any '@', ':' or '/' in its user name or password, e.g. with "
            f"urllib.parse.quote_plus)") from None


def _pool_sizes() -> dict[str, int]:
    return LAMBDA_POOL if os.environ.get(LAMBDA_VARIABLE) else PROCESS_POOL
_lock = threading.Lock()


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # noqa: ANN001 - DBAPI hook
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def _make_directory_of(path: str) -> None:
    """Make the directory the SQLite file ``path`` goes in, if missing.

    Raises:
        ArgumentError: it cannot be made (a file stands in its way, no permission): as for any
            SQLite URL that cannot be used, so that a command says so in one line.
    """
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArgumentError(f"cannot make {exc.filename or Path(path).parent}, the directory of the SQLite file "
                            f"{path}: {exc.strerror or exc}") from exc


def engine_for(url: str) -> Engine:
    """The process's engine for ``url`` (created on first use).

    Raises:
        DatabaseUrlUnreadable: SQLAlchemy cannot read the URL's port (see :func:`parse_url`).
        ArgumentError: SQLAlchemy cannot read the URL, or SQLite cannot use it (the directory of
            its file cannot be made, say).
    """
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            parsed = parse_url(url)
            if url.startswith("sqlite"):
                # create_engine refuses a URL SQLite cannot use before any directory is made for it
                engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
                path = engine.url.database
                if path and path != ":memory:" and not engine.url.query.get("uri"):
                    _make_directory_of(path)
                event.listen(engine, "connect", _sqlite_pragmas)
                # SQLite's own BEGIN is deferred; take the write lock at BEGIN so that
                # read-then-write transactions serialise instead of failing on upgrade.
                event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
                event.listen(engine, "connect", _disable_pysqlite_begin)
            else:
                # A connect_timeout the URL gives is the operator's (connect_args would override it).
                given = "connect_timeout" in parsed.query
                engine = create_engine(url, pool_pre_ping=True,
                                       connect_args={} if given else {"connect_timeout": CONNECT_TIMEOUT},
                                       **_pool_sizes())
            _engines[url] = engine
        return engine


def _disable_pysqlite_begin(dbapi_connection, _record) -> None:  # noqa: ANN001 - DBAPI hook
    # Let the "begin" listener above issue BEGIN itself (SQLAlchemy's documented recipe).
    dbapi_connection.isolation_level = None


def dispose_all() -> None:
    """Close every pooled connection (tests and forked processes)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


@contextmanager
def session_for(url: str) -> Iterator[Session]:
    """A session in one transaction: committed on success, rolled back on any error."""
    factory = sessionmaker(bind=engine_for(url), expire_on_commit=False)
    with factory() as session, session.begin():
        yield session


@contextmanager
def api_session() -> Iterator[Session]:
    with session_for(config.get().api_database_url) as session:
        yield session


def cell_url(cell: str | int | CellMapping) -> str:
    """The database URL of a cell, given its name, id or mapping."""
    if isinstance(cell, CellMapping):
        return cell.database_connection
    with api_session() as session:
        column = CellMapping.id if isinstance(cell, int) else CellMapping.name
        mapping = session.scalars(select(CellMapping).where(column == cell)).one_or_none()
        if mapping is None:
            raise errors.CellNotFound(f"Cell {cell} could not be found.")
        return mapping.database_connection


@functools.lru_cache(maxsize=256)
def _sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names (parsed once per URL: every cell session asks); None for any
    other database, an in-memory one or a SQLite URI."""
    if not url.startswith("sqlite"):
        return None
    parsed = make_url(url)
    path = parsed.database
    return None if not path or path == ":memory:" or parsed.query.get("uri") else path


@contextmanager
def cell_session(cell: str | int | CellMapping) -> Iterator[Session]:
    """A session on ``cell``'s database.

    Raises:
        OperationalError: the cell's database is a SQLite file that is not there (removed, or on
            a volume not mounted): as SQLite answers a file it cannot open, rather than an empty
            database SQLite would make in its place (only migrating a cell makes its file).
    """
    url = cell_url(cell)
    _require_sqlite_file(url)
    with session_for(url) as session:
        yield session


def _require_sqlite_file(url: str) -> None:
    path = _sqlite_file(url)
    if path is None or os.path.exists(path):
        return
    raise OperationalError("connect", None, sqlite3.OperationalError(
        f"unable to open database file: {path} does not exist (a cell's SQLite file is made only when the cell "
        f"is created)"))


def all_cells(*, include_cell0: bool = True) -> list[CellMapping]:
    """Every mapped cell, oldest first; ``include_cell0=False`` leaves out cell0."""
    with api_session() as session:
        query = select(CellMapping).order_by(CellMapping.id)
        if not include_cell0:
            query = query.where(CellMapping.name != CELL0_NAME)
        return list(session.scalars(query))
