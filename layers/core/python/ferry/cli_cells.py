"""``ferry db``, ``ferry cell`` and ``ferry host``: set up the store of a deployment.

What an operator runs once per deployment, and again after an upgrade or when hardware is
added, where the control plane's settings are (``FERRY_API_DATABASE_URL``, as the template's
``ApiDatabaseUrl`` gives the functions):

- ``ferry db sync``: the API database and every mapped cell's database to the newest schema;
- ``ferry cell create NAME --database-url URL``: a cell's database migrated and mapped (``cell0``
  holds the servers that were never scheduled; every deployment needs it);
- ``ferry cell list``: the mapped cells (passwords hidden; a disabled one marked so);
- ``ferry cell update NAME --disable|--enable``: whether the scheduler sends new servers, and
  moves from other cells, to the cell;
- ``ferry host map HOST --cell NAME``: which cell a compute host belongs to, ahead of its agent
  (whose first report maps its host to the cell it names with ``--cell``, when unmapped);
- ``ferry host rebind HOST``: the host's reports taken from the sender of its next report (see
  :func:`ferry.hosts.apply_report`).

Each is idempotent: run again, it changes nothing. A cell is never re-pointed at another
database, and a host never moved to another cell by these commands: both would strand the
servers recorded there, so they are refused (exit status 1) with what is mapped now. So are a
cell with a blank name, the database of another cell or the API database however its URL spells
it (another driver, the default port named or not, a SQLite path with ``.`` or ``//`` in it: both
cells would list the same servers), a SQLite file named by a relative path or an in-memory SQLite
database (each process would open its own), a SQLite URI (``?uri=true``: give the file's absolute path
instead), and a host name no agent can serve; nothing is written then.

Exit statuses: 0 success, 1 refused, 2 bad usage, 3 could not run (a database that cannot be
reached, or a URL that cannot be read: see :mod:`ferry.cli`).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING, Any

from ferry import config, errors, protocol

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

# A URL's scheme, as it starts the URL.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Query parameters that carry a secret (psycopg2 takes ``?password=``, libpq ``sslpassword``).
_SECRET_PARAMETER = re.compile(r"pass|secret|token", re.IGNORECASE)


def hidden_url(url: str) -> str:
    """``url`` with its password, and any query parameter named like a secret, shown as ``***``, to print.

    A URL SQLAlchemy cannot parse, or with more than one ``@`` (a password holding an unencoded
    one, which the parse splits at the wrong place), shows ``***`` for all that lies between its
    scheme and its last ``@``: more than the password, never less.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    def mask_all(text: str) -> str:
        """All up to the last ``@`` (a password may hold ``/``, ``?`` or ``@``), then any query."""
        before, at, after = text.rpartition("@")
        if at:
            scheme = _SCHEME.match(before)
            text = f"{scheme.group(0) if scheme else ''}***@{after}"
        base, _, query = text.partition("?")
        return base + ("?***" if query else "")

    if url.count("@") > 1:
        return mask_all(url)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return mask_all(url)
    query = {key: ("***" if _SECRET_PARAMETER.search(key) else value) for key, value in parsed.query.items()}
    return parsed.set(query=query).render_as_string(hide_password=True).replace("=%2A%2A%2A", "=***")


# The port a server database listens on when its URL names none, by SQLAlchemy backend.
_DEFAULT_PORTS = {"postgresql": 5432, "mysql": 3306, "mariadb": 3306, "mssql": 1433, "oracle": 1521}


def _sqlite_uri(parsed: URL) -> bool:
    """Whether SQLite reads the path of ``parsed`` as a URI (``?uri=true``, as SQLAlchemy reads the flag)."""
    from sqlalchemy.util import asbool

    return bool(asbool(parsed.query.get("uri", False)))


def unusable_sqlite_form(url: str) -> str | None:
    """Why ``url`` cannot name a cell's SQLite database, or None (a file by its absolute path, or no SQLite):

    - ``"memory"``: an in-memory database (``sqlite://``, ``:memory:``, a URI's ``mode=memory``), which
      each process would open for itself, empty;
    - ``"uri"``: a SQLite URI (``sqlite:///file:…?uri=true``), whose file is not told apart from another
      cell's (a URI's path may be relative, percent-encoded or carry a host): refused rather than read;
    - ``"relative"``: a file named by a relative path (``sqlite:///cell1.sqlite``): each process would open
      its own file, wherever it runs.

    Raises:
        DatabaseUrlUnreadable, ArgumentError: SQLAlchemy cannot read the URL.
    """
    from ferry.store.db import parse_url

    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    path, uri = parsed.database or "", _sqlite_uri(parsed)
    if path in ("", ":memory:") or uri and (path == "file::memory:" or parsed.query.get("mode") == "memory"):
        return "memory"
    if uri:
        return "uri"
    return None if path.startswith("/") else "relative"


def database_identity(url: str) -> tuple[str, ...]:
    """What tells the database ``url`` names from another: its kind of database (the backend, whatever the
    driver), host (case aside), port (the backend's default when the URL names none) and database name;
    for a SQLite file, its absolute path with ``.``, ``..``, repeated ``/`` and symbolic links resolved
    (a relative path resolved here). User, password and options never make two databases of one.

    Raises:
        DatabaseUrlUnreadable, ArgumentError: SQLAlchemy cannot read the URL.
    """
    from pathlib import Path

    from ferry.store.db import parse_url

    parsed = parse_url(url.strip())
    backend = parsed.get_backend_name()
    database = parsed.database or ""
    if backend == "sqlite":
        if _sqlite_uri(parsed) or database in ("", ":memory:"):
            return backend, "uri" if _sqlite_uri(parsed) else "memory", database
        return backend, "file", str(Path(database).resolve())
    host = (parsed.host or str(parsed.query.get("host") or "")).lower()
    port = parsed.port or _DEFAULT_PORTS.get(backend)
    return backend, host, str(port or ""), database


def _refused(message: str) -> int:
    print(f"ferry: {message}", file=sys.stderr)
    return 1


def _cells() -> list[Any]:
    from sqlalchemy import select

    from ferry.store.api_models import CellMapping
    from ferry.store.db import api_session

    with api_session() as session:
        return list(session.scalars(select(CellMapping).order_by(CellMapping.name)))


def _run_db_sync(_args: argparse.Namespace) -> int:
    from ferry.store import migrate, setup

    setup.init_api_database()
    print(f"API database {hidden_url(config.get().api_database_url)}: up to date")
    for cell in _cells():
        migrate.upgrade("cell", cell.database_connection)
        print(f"cell {cell.name} database {hidden_url(cell.database_connection)}: up to date")
    return 0


def _run_cell_create(args: argparse.Namespace) -> int:
    from ferry.store import setup

    name, url = args.name, args.database_url.strip()
    if not name.strip() or name != name.strip():
        return _refused(f"{name!r} is no cell name: a cell's name is not blank and has no space at either end.")
    if not url:
        return _refused("--database-url is blank: give the cell database's SQLAlchemy URL.")
    sqlite_form = unusable_sqlite_form(url)
    if sqlite_form == "memory":
        return _refused(f"{hidden_url(url)} is an in-memory SQLite database, which each process would open for "
                        f"itself, empty: give a file by its absolute path (sqlite:////path/to/{name}.sqlite).")
    if sqlite_form == "uri":
        return _refused(f"{hidden_url(url)} is a SQLite URI (uri=true), which a cell's database is not given as: "
                        f"give the file by its absolute path (sqlite:////path/to/{name}.sqlite).")
    if sqlite_form == "relative":
        return _refused(f"{hidden_url(url)} names its SQLite file by a relative path, which each process would "
                        f"look for where it runs: give the absolute path (sqlite:////path/to/{name}.sqlite).")
    # Compared as databases, not as strings: one database has many spellings (a default port named or not,
    # a path with "." or "//" in it).
    identity = database_identity(url)
    if identity == database_identity(config.get().api_database_url):
        return _refused(f"{hidden_url(url)} is the API database; a cell's database is a database of its own.")
    setup.init_api_database()
    cells = _cells()
    existing = next((cell for cell in cells if cell.name == name), None)
    if existing is not None and existing.database_connection.strip() != url:
        return _refused(f"cell {name} is mapped to {hidden_url(existing.database_connection)}; "
                        f"a cell is never re-pointed at another database.")
    holder = next((cell for cell in cells
                   if cell.name != name and database_identity(cell.database_connection) == identity), None)
    if holder is not None:
        return _refused(f"{hidden_url(url)} is the database of cell {holder.name}; two cells never share one "
                        f"(both would list the same servers).")
    from alembic.util import CommandError

    try:
        setup.create_cell(name, url)
    except CommandError as exc:  # the database holds a schema no cell revision knows
        return _refused(f"{hidden_url(url)} is not a cell database Ferry can migrate ({exc}): give an empty "
                        f"database, or one an earlier `ferry cell create` made.")
    print(f"cell {name} database {hidden_url(url)}: {'up to date' if existing is not None else 'created and mapped'}")
    return 0


def _run_cell_list(_args: argparse.Namespace) -> int:
    for cell in _cells():
        print(f"{cell.name}\t{hidden_url(cell.database_connection)}" + ("\tdisabled" if cell.disabled else ""))
    return 0


def _run_cell_update(args: argparse.Namespace) -> int:
    from ferry.store import setup
    from ferry.store.db import CELL0_NAME

    if args.name == CELL0_NAME:
        return _refused(f"{CELL0_NAME} holds servers that were never scheduled; nothing is ever scheduled to it, "
                        f"so it is neither enabled nor disabled.")
    try:
        changed = setup.set_cell_disabled(args.name, args.disable)
    except errors.CellNotFound:
        return _refused(f"no cell named {args.name}; `ferry cell list` shows the mapped cells.")
    state = ("disabled: no new server and no move from another cell lands in it; moves held to it go on"
             if args.disable else "enabled")
    print(f"cell {args.name}: {state}{'' if changed else ' (it was already)'}")
    return 0


def _run_host_map(args: argparse.Namespace) -> int:
    from sqlalchemy import select

    from ferry.store import setup
    from ferry.store.api_models import CellMapping
    from ferry.store.db import api_session

    if not protocol.is_host_name(args.host) or args.host == protocol.REPORTS_HOST:
        return _refused(f"{args.host!r} is not a host name an agent can serve: letters, digits, '-' and '_' in "
                        f"labels separated by dots, not ending in {protocol.DLQ_SUFFIX}, and not "
                        f"{protocol.REPORTS_HOST}.")
    with api_session() as session:
        cell = session.scalars(select(CellMapping.id).where(CellMapping.name == args.cell)).one_or_none()
    if cell is None:
        return _refused(f"no cell named {args.cell}; create it first with `ferry cell create`.")
    try:
        setup.map_host(args.host, args.cell)
    except errors.HostMappedElsewhere as exc:  # checked where the mapping is written, under its row's lock
        return _refused(exc.message)
    print(f"host {args.host}: cell {args.cell}")
    return 0


def _run_host_rebind(args: argparse.Namespace) -> int:
    from ferry import hosts

    try:
        hosts.rebind(args.host)
    except errors.HostNotMapped:
        return _refused(f"host {args.host} is not mapped to a cell; `ferry host map` maps it.")
    print(f"host {args.host}: its reports are taken from the sender of its next report")
    return 0


def add_db(commands: Any) -> None:
    parser = commands.add_parser("db", help="bring the databases to the newest schema",
                                 description="Migrate the API database and every mapped cell's database.")
    sub = parser.add_subparsers(dest="db_command", metavar="<db command>", required=True)
    sync = sub.add_parser("sync", help="migrate the API database and every cell database (idempotent)")
    sync.set_defaults(handler=_run_db_sync)


def add_cell(commands: Any) -> None:
    parser = commands.add_parser("cell", help="create, list, disable and enable cells",
                                 description="A cell is a database of servers and the hosts mapped to it.")
    sub = parser.add_subparsers(dest="cell_command", metavar="<cell command>", required=True)
    create = sub.add_parser("create", help="migrate a cell's database and map it (idempotent)")
    create.add_argument("name", help="the cell's name (cell0 holds servers that were never scheduled)")
    create.add_argument("--database-url", required=True, metavar="URL",
                        help="the cell database's SQLAlchemy URL, e.g. postgresql+psycopg2://ferry:pw@db/ferry_cell1")
    create.set_defaults(handler=_run_cell_create)
    listing = sub.add_parser("list", help="the mapped cells and their databases (passwords hidden); "
                                          "a disabled cell is marked so")
    listing.set_defaults(handler=_run_cell_list)
    update = sub.add_parser("update", help="disable or enable a cell for scheduling (idempotent)",
                            description="A disabled cell takes no new server and no move from another cell; "
                                        "a move of one of its servers that may not leave it still lands there.")
    update.add_argument("name", help="the cell's name")
    switch = update.add_mutually_exclusive_group(required=True)
    switch.add_argument("--disable", dest="disable", action="store_true", help="stop scheduling to the cell")
    switch.add_argument("--enable", dest="disable", action="store_false", help="schedule to the cell again")
    update.set_defaults(handler=_run_cell_update)


def add_host(commands: Any) -> None:
    parser = commands.add_parser("host", help="map compute hosts to cells, re-bind their reports",
                                 description="Record which cell a compute host belongs to, and whose reports "
                                             "are the host's.")
    sub = parser.add_subparsers(dest="host_command", metavar="<host command>", required=True)
    mapping = sub.add_parser("map", help="map a host to a cell (idempotent; never moves a mapped host)")
    mapping.add_argument("host", help="the compute host's name, as its agent reports it (--host)")
    mapping.add_argument("--cell", required=True, help="the cell's name")
    mapping.set_defaults(handler=_run_host_map)
    rebind = sub.add_parser("rebind", help="take a host's reports from the sender of its next report (idempotent)",
                            description="A host's reports are taken from the sender of its first one (SQS's "
                                        "SenderId); after its agent's identity changed (a replaced machine, new "
                                        "credentials) its reports are refused until the host is re-bound.")
    rebind.add_argument("host", help="the compute host's name")
    rebind.set_defaults(handler=_run_host_rebind)
