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

from ferry import cli, config
from ferry.store import db

ROOT = Path(__file__).resolve().parents[2]

COMMANDS_READING_THE_STORE = [
    ["db", "sync"],
    ["cell", "list"],
    ["cell", "create", "cell1", "--database-url", "sqlite://"],
    ["host", "map", "compute1", "--cell", "cell1"],
    ["volume", "list"],
    ["volume", "forget", "00000000-0000-4000-8000-000000000000"],
    ["audit", "--no-storage"],
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
@pytest.mark.parametrize("argv", COMMANDS_READING_THE_STORE, ids=lambda argv: " ".join(argv[:2]))
def test_a_database_that_cannot_be_used_is_one_line_and_exit_3(api_database, tmp_path, capsys, argv, url):
    api_database(url.format(not_a_database=not_a_database(tmp_path / "api.sqlite")))

    assert cli.main(argv) == cli.EXIT_CANNOT_RUN == 3

    captured = capsys.readouterr()
    assert captured.err.startswith("ferry: cannot use the database: ")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert "s3cret" not in captured.err


def test_a_cell_database_that_cannot_be_used_is_one_line_and_exit_3_and_maps_nothing(api_database, tmp_path,
                                                                                     capsys):
    api_database(f"sqlite:///{tmp_path / 'api.sqlite'}")

    cell1 = not_a_database(tmp_path / "cell1.sqlite")

    assert cli.main(["cell", "create", "cell1", "--database-url", cell1]) == 3
    assert capsys.readouterr().err.startswith("ferry: cannot use the database: ")

    assert cli.main(["cell", "list"]) == 0
    assert capsys.readouterr().out == ""


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
