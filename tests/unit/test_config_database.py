"""Where the functions find the API database."""

from __future__ import annotations

import pytest

from ferry import config, errors


def test_a_function_on_aws_lambda_without_a_database_url_refuses_to_start(monkeypatch):
    monkeypatch.setenv("AWS_EXECUTION_ENV", "AWS_Lambda_python3.11")
    monkeypatch.setenv("FERRY_API_DATABASE_URL", "")

    with pytest.raises(errors.DatabaseNotConfigured, match="ApiDatabaseUrl"):
        config.load()


def test_a_function_on_aws_lambda_uses_the_url_it_is_given(monkeypatch):
    monkeypatch.setenv("AWS_EXECUTION_ENV", "AWS_Lambda_python3.11")
    monkeypatch.setenv("FERRY_API_DATABASE_URL", "postgresql+psycopg2://ferry@db.example/ferry_api")

    assert config.load().api_database_url == "postgresql+psycopg2://ferry@db.example/ferry_api"


def test_elsewhere_an_empty_url_is_sqlite_under_the_state_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_EXECUTION_ENV", raising=False)
    monkeypatch.delenv("FERRY_API_DATABASE_URL", raising=False)
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path))

    assert config.load().api_database_url == f"sqlite:///{tmp_path / 'api.sqlite'}"
