"""A database failure of the moment fails a step as ``Ferry.DatabaseUnavailable``, which the
state machines retry; any other database error is the step's own."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from ferry import errors, handlers
from ferry.store import db

CONTEXT = SimpleNamespace(function_name="ferry-test-step", memory_limit_in_mb=128, aws_request_id="lambda-req-1",
                          invoked_function_arn="arn:aws:lambda:us-east-1:123456789012:function:ferry-test-step")
EVENT = {"instance_uuid": "i-1", "request_id": "req-1"}


class PgError(Exception):
    """A driver error as psycopg2 raises it: the server's SQLSTATE in ``pgcode``."""

    def __init__(self, pgcode: str | None, message: str = "server said no") -> None:
        super().__init__(message)
        self.pgcode = pgcode


def failing_with(exc: Exception):
    def step(_event):
        raise exc
    return handlers.step_handler(step, "PrepResizeAtDest")


def sqlite_locked(tmp_path) -> OperationalError:
    """The error SQLite gives a writer while another connection holds the write lock."""
    path = tmp_path / "locked.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0})
    try:
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO t VALUES (1)"))
    except OperationalError as exc:
        return exc
    finally:
        holder.close()
        engine.dispose()
    raise AssertionError("the write was not refused")


def test_a_step_whose_database_is_locked_for_a_moment_fails_as_database_unavailable(tmp_path):
    locked = sqlite_locked(tmp_path)

    with pytest.raises(errors.DatabaseUnavailable) as raised:
        failing_with(locked)(EVENT, CONTEXT)

    assert raised.value.name == "Ferry.DatabaseUnavailable"
    assert raised.value.message == ("PrepResizeAtDest: the database could not serve the step for a moment "
                                    "(database is locked).")
    assert raised.value.__cause__ is locked


def test_a_database_that_refuses_the_connection_is_unavailable_for_a_moment():
    engine = create_engine("postgresql+psycopg2://ferry@127.0.0.1:1/none", connect_args={"connect_timeout": 2})
    with pytest.raises(OperationalError) as refused:
        engine.connect()
    engine.dispose()

    assert db.transient(refused.value)
    with pytest.raises(errors.DatabaseUnavailable, match="could not serve the step"):
        failing_with(refused.value)(EVENT, CONTEXT)


@pytest.mark.parametrize("pgcode", ["40001", "40P01", "55P03", "53300", "57P01", "08006", None])
def test_postgresql_failures_of_the_moment_are_transient(pgcode):
    assert db.transient(OperationalError("UPDATE instances", {}, PgError(pgcode)))


@pytest.mark.parametrize("error", [
    OperationalError("SELECT", {}, PgError("57014", "canceling statement due to statement timeout")),
    OperationalError("SELECT", {}, sqlite3.OperationalError("no such table: instances")),
    ProgrammingError("SELECT", {}, PgError("42P01", "relation does not exist")),
    IntegrityError("INSERT", {}, PgError("23505", "duplicate key")),
    ValueError("not a database error"),
], ids=["statement-timeout", "sqlite-no-table", "undefined-table", "unique-violation", "other"])
def test_other_errors_are_the_steps_own_and_pass_through_unchanged(error):
    assert not db.transient(error)
    with pytest.raises(type(error)) as raised:
        failing_with(error)(EVENT, CONTEXT)
    assert raised.value is error
