"""``ferry`` on bad input: one line on standard error and an exit status that says so, never a traceback.

Also: standard output is the command's answer alone (Ferry's log lines go to standard error), so
``ferry audit --json`` can be read by a program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy.engine.url
from sqlalchemy import event, insert
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session

from ferry import cli, config
from ferry.store import db
from ferry.store.api_models import CellMapping

ROOT = Path(__file__).resolve().parents[2]

COMMANDS_READING_THE_STORE = [
    ["db", "sync"],
    ["cell", "list"],
    ["cell", "update", "cell1", "--disable"],
    ["cell", "create", "cell1", "--database-url", "sqlite:////nonexistent/ferry-cell1.sqlite"],
    ["host", "map", "compute1", "--cell", "cell1"],
    ["host", "rebind", "compute1"],
    ["volume", "list"],
    ["volume", "forget", "00000000-0000-4000-8000-000000000000"],
    ["audit", "--no-storage"],
    ["token", "issue", "--user", "alice", "--project", "demo"],
    ["token", "list"],
    ["token", "revoke", "--expired"],
]


@pytest.fixture
def api_database(tmp_path: Path, monkeypatch) -> Iterator[Callable[[str], None]]:
    """``point_at(url)`` points the API database at ``url`` for the next command."""
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("FERRY_IMAGE_BUCKET", "ferry-test-images")

    def point_at(url: str) -> None:
        monkeypatch.setenv("FERRY_API_DATABASE_URL", url)
        config.reset()

    yield point_at
    db.dispose_all()
    config.reset()


def not_a_database(path: Path) -> str:
    """The SQLite URL of a file that is no database."""
    path.write_bytes(b"not a database\n" * 512)
    return f"sqlite:///{path}"


@pytest.mark.parametrize("url", [
    "not a database url",  # cannot be read
    "nosuchdialect://ferry@db.example/ferry_api",  # no such kind of database
    "{not_a_database}",  # cannot be opened
    "postgresql+psycopg2://ferry:s3cret@127.0.0.1:1/ferry_api",  # nothing listens there
    "postgresql://ferry:s3cret@127.0.0.1:1/ferry_api",  # psycopg 3's, not installed (or nothing listens there)
], ids=["unreadable", "unknown-dialect", "not-a-database", "unreachable", "driver"])
@pytest.mark.parametrize("argv", COMMANDS_READING_THE_STORE, ids=lambda argv: " ".join(argv[:3]))
def test_a_database_that_cannot_be_used_is_one_line_and_exit_3(api_database, tmp_path, capsys, argv, url):
    api_database(url.format(not_a_database=not_a_database(tmp_path / "api.sqlite")))

    assert cli.main(argv) == cli.EXIT_CANNOT_RUN == 3

    captured = capsys.readouterr()
    assert captured.err.startswith("ferry: cannot use the database: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert "s3cret" not in captured.err


@pytest.mark.parametrize("argv", COMMANDS_READING_THE_STORE, ids=lambda argv: " ".join(argv[:3]))
def test_a_sqlite_directory_that_cannot_be_made_is_one_line_and_exit_3(api_database, tmp_path, capsys, argv):
    # GIVEN an API database whose directory cannot be made (a regular file stands where it would be)
    (tmp_path / "taken").write_text("a file, not a directory\n")
    api_database(f"sqlite:///{tmp_path / 'taken' / 'ferry' / 'api.sqlite'}")

    # WHEN a command uses it
    status = cli.main(argv)

    # THEN it cannot run (exit 3): one line naming the directory, no traceback
    err = capsys.readouterr().err
    assert status == cli.EXIT_CANNOT_RUN
    assert err.startswith("ferry: cannot use the database: ") and str(tmp_path / "taken") in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("url", [
    "postgresql+psycopg2://ferry:s3cr@t:pw@db.example/ferry_api",  # an unencoded "@" then ":" in the password
    "postgresql+psycopg2://ferry:s3cret@db.example:port/ferry_api",  # a port that is no number
    "sqlite://ferry:s3cret@db.example:abc/ferry_api",
], ids=["at-then-colon", "port", "sqlite-port"])
@pytest.mark.parametrize("argv", COMMANDS_READING_THE_STORE, ids=lambda argv: " ".join(argv[:3]))
def test_a_url_whose_port_cannot_be_read_is_one_line_and_exit_3_without_the_password(api_database, capsys, argv,
                                                                                     url):
    # GIVEN an API database URL whose parse takes part of the password (or a word) for the port
    api_database(url)

    # WHEN a command uses it
    status = cli.main(argv)

    # THEN it cannot run (exit 3): one line that says what to do, no traceback, no part of the password
    err = capsys.readouterr().err
    assert status == cli.EXIT_CANNOT_RUN
    assert err.startswith("ferry: cannot use the database: ") and "cannot be read" in err and "percent-encode" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "s3cr" not in err and "pw@" not in err


def test_a_cell_url_whose_port_cannot_be_read_is_one_line_and_exit_3_and_maps_nothing(api_database, tmp_path,
                                                                                      capsys):
    # GIVEN a working API database, and a cell URL with an unencoded "@" then ":" in its password
    api_database(f"sqlite:///{tmp_path / 'api.sqlite'}")
    assert cli.main(["db", "sync"]) == 0
    capsys.readouterr()

    # WHEN the cell is created with it
    status = cli.main(["cell", "create", "cell1", "--database-url",
                       "postgresql+psycopg2://ferry:s3cr@t:pw@db.example/ferry_cell1"])

    # THEN it cannot run, says so in one line without the password, and no cell is mapped
    err = capsys.readouterr().err
    assert status == cli.EXIT_CANNOT_RUN and err.startswith("ferry: cannot use the database: ")
    assert "s3cr" not in err and err.count("\n") == 1
    assert cli.main(["cell", "list"]) == 0 and capsys.readouterr().out == ""


def test_a_sqlite_url_with_a_host_is_refused_without_a_directory_made_for_it(api_database, tmp_path, capsys,
                                                                             monkeypatch):
    # GIVEN a SQLite URL written like a server's (SQLite takes no host, user or password)
    monkeypatch.chdir(tmp_path)
    api_database("sqlite://ferry:s3cret@db.example/ferry_api")

    # WHEN a command uses it
    assert cli.main(["cell", "list"]) == cli.EXIT_CANNOT_RUN

    # THEN it is refused in one line, its password hidden, and nothing was made in the working directory
    err = capsys.readouterr().err
    assert err.startswith("ferry: cannot use the database: Invalid SQLite URL") and "s3cret" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_cell_database_that_cannot_be_used_is_one_line_and_exit_3_and_maps_nothing(api_database, tmp_path,
                                                                                     capsys):
    api_database(f"sqlite:///{tmp_path / 'api.sqlite'}")

    cell1 = not_a_database(tmp_path / "cell1.sqlite")

    assert cli.main(["cell", "create", "cell1", "--database-url", cell1]) == 3
    assert capsys.readouterr().err.startswith("ferry: cannot use the database: ")

    assert cli.main(["cell", "list"]) == 0
    assert capsys.readouterr().out == ""



def test_a_cell_whose_sqlite_file_is_gone_is_one_line_and_exit_3_and_no_empty_file_is_made(api_database, tmp_path,
                                                                                           capsys):
    # GIVEN a cell whose SQLite file was removed (or is on a volume not mounted)
    api_database(f"sqlite:///{tmp_path / 'api.sqlite'}")
    cell1 = tmp_path / "cell1.sqlite"
    assert cli.main(["cell", "create", "cell1", "--database-url", f"sqlite:///{cell1}"]) == 0
    capsys.readouterr()
    db.dispose_all()
    cell1.unlink()

    # WHEN the audit reads it
    status = cli.main(["audit", "--no-storage"])

    # THEN it cannot run, says which file, and makes no empty database in its place
    err = capsys.readouterr().err
    assert status == cli.EXIT_CANNOT_RUN
    assert err.startswith("ferry: cannot use the database: ") and str(cell1) in err and "does not exist" in err
    assert err.count("\n") == 1
    assert not cell1.exists()


@pytest.mark.parametrize("where", ["api", "cell"])
def test_a_url_quoted_whole_in_its_error_is_shown_without_its_password(api_database, tmp_path, capsys, monkeypatch,
                                                                       where):
    # GIVEN a URL SQLAlchemy cannot parse, and a SQLAlchemy that quotes such a URL in its error (2.0 did)
    unreadable = "ferry:s3cret@db.example/ferry_api"
    parse = sqlalchemy.engine.url._parse_url

    def quoting(name, *args, **kwargs):
        if name != unreadable:
            return parse(name, *args, **kwargs)
        raise ArgumentError(f"Could not parse SQLAlchemy URL from string '{name}'")

    monkeypatch.setattr(sqlalchemy.engine.url, "_parse_url", quoting)
    api_database(unreadable if where == "api" else f"sqlite:///{tmp_path / 'api.sqlite'}")
    argv = ["cell", "list"] if where == "api" else ["cell", "create", "cell1", "--database-url", unreadable]

    # WHEN a command uses it
    assert cli.main(argv) == cli.EXIT_CANNOT_RUN

    # THEN the one line names it, its password hidden
    assert capsys.readouterr().err == ("ferry: cannot use the database: "
                                       "Could not parse SQLAlchemy URL from string '***@db.example/ferry_api'\n")

def test_a_cell_created_meanwhile_by_another_command_is_refused_in_one_line_without_its_password(
    api_database, tmp_path, capsys
):
    # GIVEN another `ferry cell create cell1` that maps the cell between this one's check and its insert
    api_database(f"sqlite:///{tmp_path / 'api.sqlite'}")
    url = f"sqlite:///{tmp_path / 'cell1.sqlite'}?password=s3cret"

    def racing(session, _flush_context, _instances):
        if any(isinstance(added, CellMapping) for added in session.new):
            session.connection().execute(insert(CellMapping).values(
                name="cell1", uuid="00000000-0000-4000-8000-000000000001",
                database_connection=f"sqlite:///{tmp_path / 'other.sqlite'}"))

    event.listen(Session, "before_flush", racing)
    try:
        # WHEN this one inserts the mapping
        status = cli.main(["cell", "create", "cell1", "--database-url", url])
    finally:
        event.remove(Session, "before_flush", racing)

    # THEN it is refused (exit 1) in one line, not called a database that cannot be used, and no
    # traceback shows the statement's parameters (the URL, with a password in it)
    err = capsys.readouterr().err
    assert status == 1 and "the database refused it" in err and "cannot use the database" not in err
    assert "s3cret" not in err and "Traceback" not in err


def test_audit_json_on_standard_output_is_the_report_alone(tmp_path):
    """GIVEN a clean store WHEN ``ferry audit --json`` runs as a process THEN its standard output is JSON."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("FERRY_", "POWERTOOLS_", "AWS_"))}
    env.update(FERRY_STATE_DIR=str(tmp_path), FERRY_API_DATABASE_URL=f"sqlite:///{tmp_path / 'api.sqlite'}",
               POWERTOOLS_LOG_LEVEL="INFO")

    def ferry(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ferry.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    assert ferry("db", "sync").returncode == 0
    audited = ferry("audit", "--json", "--no-storage", "--grace", "0")

    assert audited.returncode == 0, audited.stderr
    assert json.loads(audited.stdout)["clean"] is True
    assert "audit finished" in audited.stderr  # the log line, where it belongs
