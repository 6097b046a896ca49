"""Connection pools: what a process keeps open to each PostgreSQL database between requests."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from ferry import LAMBDA_VARIABLE
from ferry.store import db

URL = "postgresql+psycopg2://ferry@127.0.0.1:1/ferry_pools_test"  # never connected to


@pytest.fixture
def engines():
    db.dispose_all()
    yield
    db.dispose_all()


@pytest.mark.parametrize(("in_lambda", "kept", "peak"), [(True, 1, 5), (False, 5, 25)])
def test_a_lambda_environment_keeps_one_connection_per_database(engines, monkeypatch, in_lambda, kept, peak):
    if in_lambda:
        monkeypatch.setenv(LAMBDA_VARIABLE, "ferry-test-api")
    else:
        monkeypatch.delenv(LAMBDA_VARIABLE, raising=False)

    pool = db.engine_for(URL).pool

    assert (pool.size(), pool.size() + pool._max_overflow) == (kept, peak)  # type: ignore[attr-defined]


def test_a_database_that_does_not_answer_fails_the_connection_within_a_bound(engines, monkeypatch):
    made = []
    monkeypatch.setattr(db, "create_engine", lambda url, **options: made.append(options) or create_engine(
        url, **options))

    db.engine_for(URL)

    [options] = made
    assert options["connect_args"] == {"connect_timeout": db.CONNECT_TIMEOUT} and options["pool_pre_ping"] is True


def test_a_connect_timeout_the_url_gives_is_kept(engines, monkeypatch):
    made = []
    monkeypatch.setattr(db, "create_engine", lambda url, **options: made.append(options) or create_engine(
        url, **options))

    db.engine_for(URL + "?connect_timeout=3")

    assert made[0]["connect_args"] == {}
