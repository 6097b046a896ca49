"""``ferry db``, ``ferry cell`` and ``ferry host``: a deployment's store set up from nothing, idempotently."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from ferry import cli, cli_cells, config, hosts
from ferry.store import db, migrate


@pytest.fixture
def empty_deployment(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """Settings pointing at an API database that does not exist yet."""
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("FERRY_API_DATABASE_URL", f"sqlite:///{tmp_path / 'api.sqlite'}")
    config.reset()
    yield tmp_path
    db.dispose_all()
    config.reset()


def tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_a_deployment_is_set_up_from_nothing_and_every_step_can_run_again(empty_deployment, capsys):
    cell1 = f"sqlite:///{empty_deployment / 'cell1.sqlite'}"

    assert cli.main(["db", "sync"]) == 0
    assert "cell_mappings" in tables(config.get().api_database_url)
    for _ in range(2):
        assert cli.main(["cell", "create", "cell1", "--database-url", cell1]) == 0
        assert cli.main(["host", "map", "compute1", "--cell", "cell1"]) == 0
    assert cli.main(["db", "sync"]) == 0

    assert "instances" in tables(cell1) and "migrations" in tables(cell1)
    assert hosts.cell_of_host("compute1") == "cell1"
    out = capsys.readouterr().out
    assert "cell cell1 database sqlite:///" in out and "created and mapped" in out
    assert "host compute1: cell cell1" in out
    assert cli.main(["cell", "list"]) == 0
    assert capsys.readouterr().out == f"cell1\t{cell1}\n"


def test_a_cell_is_never_re_pointed_and_a_host_never_moved(empty_deployment, capsys):
    first, other = (f"sqlite:///{empty_deployment / name}" for name in ("cell1.sqlite", "other.sqlite"))
    assert cli.main(["cell", "create", "cell1", "--database-url", first]) == 0
    assert cli.main(["cell", "create", "cell2", "--database-url", other]) == 0
    assert cli.main(["host", "map", "compute1", "--cell", "cell1"]) == 0
    capsys.readouterr()

    assert cli.main(["cell", "create", "cell1", "--database-url", other]) == 1
    assert "cell cell1 is mapped to sqlite:///" in capsys.readouterr().err
    assert cli.main(["host", "map", "compute1", "--cell", "cell2"]) == 1
    assert "host compute1 is mapped to cell cell1" in capsys.readouterr().err
    assert cli.main(["host", "map", "compute2", "--cell", "cell9"]) == 1
    assert "no cell named cell9" in capsys.readouterr().err

    assert hosts.cell_of_host("compute1") == "cell1" and hosts.cell_of_host("compute2") is None
    assert capsys.readouterr().out == "" and cli.main(["cell", "list"]) == 0
    assert capsys.readouterr().out == f"cell1\t{first}\ncell2\t{other}\n"


def test_a_database_password_is_never_printed():
    hidden = cli_cells.hidden_url("postgresql+psycopg2://ferry:s3cret@db.example/cell1")

    assert "s3cret" not in hidden and hidden.startswith("postgresql+psycopg2://ferry:***@db.example/cell1")


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://ferry@db.example/cell1?password=s3cret&sslmode=require",
     "postgresql://ferry@db.example/cell1?password=***&sslmode=require"),
    ("postgresql://ferry@db.example/cell1?sslpassword=s3cret", "postgresql://ferry@db.example/cell1?sslpassword=***"),
    ("postgresql://ferry:pa@s3cret@db.example/cell1", "postgresql://***@db.example/cell1"),
    ("no url at all ferry:s3cret@db.example", "***@db.example"),
    ("mysql://ferry:pa/s3cret@db.example:port/cell1", "mysql://***@db.example:port/cell1"),
    ("postgresql://ferry:a@b/s3cret@db.example/cell1", "postgresql://***@db.example/cell1"),
    ("postgresql://ferry:s3?cret@db.example/cell1?application_name=ops@site", "postgresql://***@site"),
    ("postgresql://ferry:s3?cr@et@db.example/cell1", "postgresql://***@db.example/cell1"),
], ids=["query", "ssl-query", "unencoded-at", "unparsed", "unparsed-slash", "at-and-slash", "question-mark",
        "question-mark-and-at"])
def test_a_password_in_a_query_or_holding_an_at_sign_is_never_printed(url, shown):
    assert cli_cells.hidden_url(url) == shown


def test_set_up_commands_need_their_arguments():
    for argv in (["cell", "create", "cell1"], ["host", "map", "compute1"], ["db"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2


def test_a_database_mapped_to_another_cell_is_refused_naming_that_cell(empty_deployment, capsys):
    cell1 = f"sqlite:///{empty_deployment / 'cell1.sqlite'}"
    assert cli.main(["cell", "create", "cell1", "--database-url", cell1]) == 0
    capsys.readouterr()

    # a typo of cell1's name, with cell1's database: both cells would list the same servers
    assert cli.main(["cell", "create", "cel1", "--database-url", f" {cell1} "]) == 1

    captured = capsys.readouterr()
    assert captured.err == f"ferry: {cell1} is the database of cell cell1; two cells never share one " \
                           f"(both would list the same servers).\n"
    assert captured.out == "" and cli.main(["cell", "list"]) == 0
    assert capsys.readouterr().out == f"cell1\t{cell1}\n"
    assert cli.main(["cell", "create", "cell1", "--database-url", f"{cell1} "]) == 0  # the same cell, again


@pytest.mark.parametrize(("name", "url"), [
    ("", "{cell}"), ("   ", "{cell}"), (" cell1", "{cell}"), ("cell1", ""), ("cell1", "  "),
])
def test_a_blank_cell_name_or_database_url_is_refused_and_nothing_is_written(empty_deployment, capsys, name, url):
    api = empty_deployment / "api.sqlite"

    assert cli.main(["cell", "create", name, "--database-url", url.format(cell=empty_deployment / "c.sqlite")]) == 1

    err = capsys.readouterr().err
    assert err.startswith("ferry: ") and err.count("\n") == 1
    assert not api.exists() and not (empty_deployment / "c.sqlite").exists()
    assert list(empty_deployment.iterdir()) == []  # not even a default database for an empty URL


@pytest.mark.parametrize("host", ["bad host!", "compute1-dlq", "compute/1", "reports", "", "a" * 254])
def test_a_host_name_no_agent_can_serve_is_refused(empty_deployment, capsys, host):
    assert cli.main(["cell", "create", "cell1", "--database-url", f"sqlite:///{empty_deployment / 'c1.sqlite'}"]) == 0
    capsys.readouterr()

    assert cli.main(["host", "map", host, "--cell", "cell1"]) == 1

    err = capsys.readouterr().err
    assert err.startswith(f"ferry: {host!r} is not a host name an agent can serve") and err.count("\n") == 1
    assert hosts.cell_of_host(host) is None


def test_a_host_mapped_meanwhile_to_another_cell_is_not_moved(empty_deployment, capsys, monkeypatch):
    # GIVEN two cells, and a host the command reads as unmapped, whose first report maps it to
    # cell1 before the command's write
    from ferry.store import setup

    for name in ("cell1", "cell2"):
        assert cli.main(["cell", "create", name, "--database-url", f"sqlite:///{empty_deployment / name}.sqlite"]) == 0
    capsys.readouterr()
    mapping = setup.map_host

    def report_maps_it_first(host, cell):
        mapping(host, "cell1")
        mapping(host, cell)

    monkeypatch.setattr(setup, "map_host", report_maps_it_first)

    # WHEN the operator maps it to cell2, THEN it is refused and the host stays in cell1
    assert cli.main(["host", "map", "compute7", "--cell", "cell2"]) == 1
    assert "is mapped to cell cell1" in capsys.readouterr().err
    assert hosts.cell_of_host("compute7") == "cell1"


def test_a_cell_on_the_api_database_or_on_a_database_of_another_schema_is_refused_in_one_line(empty_deployment,
                                                                                             capsys):
    api_url = config.get().api_database_url
    assert cli.main(["db", "sync"]) == 0
    capsys.readouterr()

    assert cli.main(["cell", "create", "cell1", "--database-url", api_url]) == 1
    assert "is the API database" in capsys.readouterr().err

    # a database another API schema was migrated into (a copy of the API database, say)
    other = f"sqlite:///{empty_deployment / 'copy.sqlite'}"
    migrate.upgrade("api", other)
    assert cli.main(["cell", "create", "cell1", "--database-url", other]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ferry: ") and "is not a cell database Ferry can migrate" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert cli.main(["cell", "list"]) == 0 and capsys.readouterr().out == ""


@pytest.mark.parametrize("spelling", ["{dir}/./cell1.sqlite", "{dir}//cell1.sqlite", "{dir}/sub/../cell1.sqlite",
                                      "{dir}/cell1.sqlite?uri=false"],
                         ids=["dot", "double-slash", "dot-dot", "uri-false"])
def test_a_sqlite_file_of_another_cell_spelled_otherwise_is_refused(empty_deployment, capsys, spelling):
    # GIVEN cell1 on a SQLite file
    cell1 = f"sqlite:///{empty_deployment / 'cell1.sqlite'}"
    (empty_deployment / "sub").mkdir()
    assert cli.main(["cell", "create", "cell1", "--database-url", cell1]) == 0
    capsys.readouterr()

    # WHEN cell2 is created on the same file, its path written another way
    other = "sqlite:///" + spelling.format(dir=empty_deployment)
    status = cli.main(["cell", "create", "cell2", "--database-url", other])

    # THEN it is refused naming cell1, and only cell1 is mapped
    assert status == 1
    assert "is the database of cell cell1; two cells never share one" in capsys.readouterr().err
    assert cli.main(["cell", "list"]) == 0 and capsys.readouterr().out == f"cell1\t{cell1}\n"


@pytest.mark.parametrize("other", [
    "postgresql+psycopg2://ferry:s3cret@db.example:5432/ferry_cell1",  # the default port named
    "postgresql://admin@DB.example/ferry_cell1",  # another driver, user and case of the host
], ids=["default-port", "driver-user-host-case"])
def test_a_server_database_of_another_cell_spelled_otherwise_is_refused_before_it_is_reached(empty_deployment,
                                                                                              capsys, other):
    # GIVEN cell1 mapped to a PostgreSQL database named without its port
    from ferry.store import setup
    from ferry.store.api_models import CellMapping

    setup.init_api_database()
    with db.api_session() as session:
        session.add(CellMapping(name="cell1", uuid="00000000-0000-4000-8000-000000000001",
                                database_connection="postgresql+psycopg2://ferry:s3cret@db.example/ferry_cell1"))

    # WHEN cell2 is created on the same database written another way
    status = cli.main(["cell", "create", "cell2", "--database-url", other])

    # THEN it is refused naming cell1 (nothing tried to reach the database), without the password
    err = capsys.readouterr().err
    assert status == 1 and "is the database of cell cell1" in err and "s3cret" not in err


def test_the_api_database_spelled_otherwise_is_refused_as_a_cell(empty_deployment, capsys):
    # GIVEN the API database at <dir>/api.sqlite
    assert cli.main(["db", "sync"]) == 0
    capsys.readouterr()

    # WHEN a cell is created on it, its path written with "./"
    status = cli.main(["cell", "create", "cell1", "--database-url", f"sqlite:///{empty_deployment}/./api.sqlite"])

    # THEN it is refused as the API database and no cell is mapped
    assert status == 1 and "is the API database" in capsys.readouterr().err
    assert cli.main(["cell", "list"]) == 0 and capsys.readouterr().out == ""


@pytest.mark.parametrize("url", ["sqlite:///cell1.sqlite", "sqlite:///cell1.sqlite?uri=false"],
                         ids=["path", "uri-false"])
def test_a_sqlite_file_named_by_a_relative_path_is_refused_and_nothing_is_written(empty_deployment, capsys,
                                                                                 monkeypatch, url):
    # GIVEN a working directory of its own
    monkeypatch.chdir(empty_deployment)

    # WHEN a cell is created on a SQLite file named by a relative path
    status = cli.main(["cell", "create", "cell1", "--database-url", url])

    # THEN it is refused in one line asking for the absolute path, and no file was made
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1
    assert "relative path" in err and "absolute path" in err
    assert list(empty_deployment.iterdir()) == []


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", " sqlite:///:memory:?timeout=5 ",
                                 "sqlite:///file:cell1?mode=memory&uri=true", "sqlite:///file::memory:?uri=true"],
                         ids=["empty", "memory", "memory-with-options", "uri-mode-memory", "uri-memory"])
def test_an_in_memory_sqlite_database_is_refused_and_nothing_is_written(empty_deployment, capsys, monkeypatch, url):
    # GIVEN a working directory of its own
    monkeypatch.chdir(empty_deployment)

    # WHEN a cell is created on an in-memory SQLite database (each process would open its own, empty)
    status = cli.main(["cell", "create", "mem", "--database-url", url])

    # THEN it is refused in one line asking for a file, and nothing was written
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1
    assert err.startswith("ferry: ") and "in-memory" in err and "absolute path" in err
    assert list(empty_deployment.iterdir()) == []


@pytest.mark.parametrize("spelling", ["file:{dir}/cell1.sqlite?uri=true", "file:{dir}/./cell1.sqlite?uri=1",
                                      "file://{dir}/cell1.sqlite?uri=true&mode=rw", "file:cellrel.sqlite?uri=true"],
                         ids=["absolute", "dot", "authority", "relative"])
def test_a_sqlite_uri_is_refused_and_nothing_is_written(empty_deployment, capsys, monkeypatch, spelling):
    # GIVEN cell1 on a SQLite file, and a working directory of its own
    cell1 = f"sqlite:///{empty_deployment / 'cell1.sqlite'}"
    assert cli.main(["cell", "create", "cell1", "--database-url", cell1]) == 0
    capsys.readouterr()
    monkeypatch.chdir(empty_deployment)
    before = sorted(empty_deployment.iterdir())

    # WHEN cell2 is created on a SQLite URI (uri=true), cell1's file or a relative one
    other = "sqlite:///" + spelling.format(dir=empty_deployment)
    status = cli.main(["cell", "create", "cell2", "--database-url", other])

    # THEN it is refused in one line asking for the file's absolute path, and only cell1 is mapped
    err = capsys.readouterr().err
    assert status == 1 and err.count("\n") == 1
    assert err.startswith("ferry: ") and "uri=true" in err and "absolute path" in err
    assert sorted(empty_deployment.iterdir()) == before
    assert cli.main(["cell", "list"]) == 0 and capsys.readouterr().out == f"cell1\t{cell1}\n"


def test_a_cell_is_disabled_and_enabled_for_scheduling_idempotently(empty_deployment, capsys):
    cell1 = f"sqlite:///{empty_deployment / 'cell1.sqlite'}"
    assert cli.main(["cell", "create", "cell1", "--database-url", cell1]) == 0
    capsys.readouterr()

    # WHEN cell1 is disabled twice, THEN it is disabled (the second time says so) and listed as such
    assert cli.main(["cell", "update", "cell1", "--disable"]) == 0
    assert cli.main(["cell", "update", "cell1", "--disable"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("cell cell1: disabled") and second.endswith("(it was already)")
    assert cli.main(["cell", "list"]) == 0 and capsys.readouterr().out == f"cell1\t{cell1}\tdisabled\n"

    # WHEN it is enabled, THEN it is listed as before
    assert cli.main(["cell", "update", "cell1", "--enable"]) == 0
    assert capsys.readouterr().out == "cell cell1: enabled\n"
    assert cli.main(["cell", "list"]) == 0 and capsys.readouterr().out == f"cell1\t{cell1}\n"


@pytest.mark.parametrize(("argv", "said"), [
    (["cell", "update", "cell9", "--disable"], "no cell named cell9"),
    (["cell", "update", "cell0", "--disable"], "cell0 holds servers that were never scheduled"),
], ids=["unknown", "cell0"])
def test_a_cell_that_cannot_be_disabled_is_refused_in_one_line_and_nothing_changes(empty_deployment, capsys, argv,
                                                                                     said):
    cell1 = f"sqlite:///{empty_deployment / 'cell1.sqlite'}"
    assert cli.main(["cell", "create", "cell1", "--database-url", cell1]) == 0
    capsys.readouterr()

    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert said in err and len(err.splitlines()) == 1
    assert cli.main(["cell", "list"]) == 0 and capsys.readouterr().out == f"cell1\t{cell1}\n"


def test_a_cell_update_says_which_way(empty_deployment, capsys):
    # Neither or both of --disable and --enable is a usage error (argparse's exit 2), changing nothing.
    assert cli.main(["cell", "create", "cell1", "--database-url", f"sqlite:///{empty_deployment / 'c.sqlite'}"]) == 0
    for argv in (["cell", "update", "cell1"], ["cell", "update", "cell1", "--disable", "--enable"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2
