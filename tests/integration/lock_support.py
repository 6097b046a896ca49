"""Whether a step leaves a cell open to other writers while it waits for the API database."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from ferry import placement


def open_to_writers(url: str) -> bool:
    """Whether another writer gets into the cell database at ``url`` at once: no transaction holds
    SQLite's write lock on its file, nor (PostgreSQL) has written to its instances or migrations."""
    if url.startswith("sqlite"):
        other = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=0.2, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            other.close()
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            try:
                connection.execute(text("LOCK TABLE instances, migrations IN SHARE ROW EXCLUSIVE MODE NOWAIT"))
                return True
            except OperationalError:
                return False
            finally:
                connection.rollback()
    finally:
        engine.dispose()


def looked_at_while_releasing(monkeypatch: pytest.MonkeyPatch, url: str) -> list[bool]:
    """Make every release of a consumer's allocations first look whether the cell database at
    ``url`` is open to other writers (:func:`open_to_writers`); the answers, one per release."""
    answers: list[bool] = []
    release = placement.delete_allocations

    def release_and_look(consumer_uuid: str) -> None:
        answers.append(open_to_writers(url))
        release(consumer_uuid)

    monkeypatch.setattr(placement, "delete_allocations", release_and_look)
    return answers
