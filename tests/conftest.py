"""Shared fixtures: databases on SQLite and on a real PostgreSQL server on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from moto_credentials import use_moto_credentials
from sqlalchemy import create_engine, text

from ferry import config
from ferry.store import db, migrate, setup

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def pg_base_url() -> Iterator[str]:
    """Base URL of the test PostgreSQL server (started by scripts/test-postgres.sh if needed)."""
    url = os.environ.get("FERRY_TEST_PG_URL")
    if not url:
        out = subprocess.run(
            [str(ROOT / "scripts/test-postgres.sh"), "start"], cwd=ROOT, check=True, capture_output=True, text=True
        )
        url = out.stdout.strip().splitlines()[-1]
    yield url
    for template in list(_templates.values()):
        _drop_databases(url, [template])
    _templates.clear()
    for spares in _pg_spares.values():
        for api_url, cell_urls in spares:
            _drop_databases(url, [u.rsplit("/", 1)[1] for u in (api_url, *cell_urls.values())])
    _pg_spares.clear()


_templates: dict[str, str] = {}


def _drop_databases(base_url: str, names: list[str]) -> None:
    """Drop test databases (a test's store, a worker's templates) so the server does not fill the disk."""
    if not names:
        return
    admin = create_engine(base_url + "postgres", isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            for name in names:
                conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    finally:
        admin.dispose()


def _pg_database(base_url: str, kind: str) -> str:
    """A fresh PostgreSQL database of ``kind`` (api/cell), cloned from a migrated template."""
    admin = create_engine(base_url + "postgres", isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            template = _templates.get(kind)
            if template is None:
                template = f"ferry_tpl_{kind}_{os.getpid()}"
                conn.execute(text(f"DROP DATABASE IF EXISTS {template}"))
                conn.execute(text(f"CREATE DATABASE {template}"))
                migrate.upgrade(kind, base_url + template)
                db.engine_for(base_url + template).dispose()
                db._engines.pop(base_url + template, None)
                _templates[kind] = template
            name = f"ferry_{kind}_{uuid.uuid4().hex[:12]}"
            conn.execute(text(f"CREATE DATABASE {name} TEMPLATE {template}"))
    finally:
        admin.dispose()
    return base_url + name


_sqlite_templates: dict[str, Path] = {}


def _sqlite_database(path: Path, kind: str) -> str:
    """A SQLite database of ``kind`` (api/cell) at ``path``: a copy of one migrated once per process.

    Running the migrations for every test's four databases was most of a store's set-up time.
    """
    template = _sqlite_templates.get(kind)
    if template is None:
        template = Path(tempfile.mkdtemp(prefix="ferry-tests-")) / f"{kind}.sqlite"
        url = f"sqlite:///{template}"
        migrate.upgrade(kind, url)
        db.engine_for(url).dispose()
        db._engines.pop(url, None)
        _sqlite_templates[kind] = template
    shutil.copyfile(template, path)
    return f"sqlite:///{path}"


@dataclass
class Store:
    """A migrated API database and cells, configured as the process's store."""

    backend: str
    api_url: str
    cells: dict[str, str] = field(default_factory=dict)


# PostgreSQL stores a test left empty, by their cells' names, for the next test of this process:
# emptying a database takes a fraction of the time creating one from a template does.
_pg_spares: dict[tuple[str, ...], list[tuple[str, dict[str, str]]]] = {}


def _empty_databases(urls: list[str]) -> bool:
    """Empty every table of these databases but the migration version; False when that cannot be done.

    A connection a test left open (a thread still at work) holds its locks: the wait is bounded,
    and such databases are dropped instead of kept.
    """
    for url in urls:
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text("SET lock_timeout = '5s'"))
                tables = [name for (name,) in conn.execute(text(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'"))]
                if tables:
                    quoted = ", ".join(f'"{table}"' for table in tables)
                    conn.execute(text(f"TRUNCATE {quoted} RESTART IDENTITY CASCADE"))
        except Exception:
            return False
        finally:
            engine.dispose()
    return True


def _make_store(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request, cells=("cell0", "cell1", "cell2")
):
    if backend == "postgres":
        base = request.getfixturevalue("pg_base_url")
        spares = _pg_spares.get(tuple(cells))
        if spares:
            api_url, cell_urls = spares.pop()
        else:
            api_url = _pg_database(base, "api")
            cell_urls = {name: _pg_database(base, "cell") for name in cells}
    else:
        api_url = _sqlite_database(tmp_path / "api.sqlite", "api")
        cell_urls = {name: _sqlite_database(tmp_path / f"cell-{name}.sqlite", "cell") for name in cells}
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("FERRY_API_DATABASE_URL", api_url)
    config.reset()
    setup.init_api_database()
    for name, url in cell_urls.items():
        setup.create_cell(name, url)
    return Store(backend=backend, api_url=api_url, cells=cell_urls)


def _finish_store(store: Store) -> None:
    """Close every connection of the test's store; empty its PostgreSQL databases for the next test
    (or drop them, when they cannot be emptied)."""
    db.dispose_all()
    config.reset()
    if store.backend == "postgres":
        urls = [store.api_url, *store.cells.values()]
        if _empty_databases(urls):
            _pg_spares.setdefault(tuple(store.cells), []).append((store.api_url, dict(store.cells)))
            return
        base = store.api_url.rsplit("/", 1)[0] + "/"
        _drop_databases(base, [url.rsplit("/", 1)[1] for url in urls])


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path, monkeypatch) -> Iterator[Store]:
    """The store on SQLite and on PostgreSQL (each test using it runs twice)."""
    made = _make_store(request.param, tmp_path, monkeypatch, request)
    yield made
    _finish_store(made)


@pytest.fixture
def sqlite_store(request, tmp_path, monkeypatch) -> Iterator[Store]:
    """The store on SQLite files only (unit tests and the local stack)."""
    made = _make_store("sqlite", tmp_path, monkeypatch, request)
    yield made
    _finish_store(made)


@pytest.fixture
def pg_store(request, tmp_path, monkeypatch) -> Iterator[Store]:
    """The store on PostgreSQL only (concurrency tests)."""
    made = _make_store("postgres", tmp_path, monkeypatch, request)
    yield made
    _finish_store(made)


@pytest.fixture
def aws_test_credentials(monkeypatch) -> None:
    """The region and placeholder credentials botocore needs under moto, no endpoint override."""
    use_moto_credentials(monkeypatch)
