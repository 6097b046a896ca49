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


@pytest.mark.parametrize(("variable", "value", "said"), [
    ("FERRY_SERVICE_DOWN_TIME", "1m", "is not a whole number"),
    ("FERRY_SCHEDULER_MAX_ATTEMPTS", "3.5", "is not a whole number"),
    ("FERRY_CPU_ALLOCATION_RATIO", "four", "is not a finite number"),
    ("FERRY_RAM_ALLOCATION_RATIO", "inf", "is not a finite number"),
])
def test_a_number_setting_that_is_no_number_is_one_typed_error_naming_its_variable(monkeypatch, variable, value,
                                                                                   said):
    # GIVEN a number setting given a value that is not one (a unit written after it, say)
    monkeypatch.setenv(variable, value)

    # WHEN the settings are read
    with pytest.raises(errors.SettingInvalid) as raised:
        config.load()

    # THEN the error names the variable and what it holds, and no ValueError from deep inside escapes
    assert raised.value.message.startswith(f"{variable}={value!r} {said}")
