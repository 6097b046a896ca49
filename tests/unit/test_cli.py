"""The ``ferry`` command line: ``ferry audit`` prints the report and exits 0 when clean, 1 when problems remain."""

from __future__ import annotations

import json
import tomllib
import uuid
from pathlib import Path

import pytest

from ferry import audit as audit_module
from ferry import cli, hosts, placement
from ferry.store.api_models import utcnow

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--grace", "0", "--no-storage"]


@pytest.fixture
def with_stray_allocation(sqlite_store) -> str:
    """A host with an allocation of a consumer that is no server and no migration."""
    hosts.apply_report({"kind": "inventory", "host": "h1", "node": "h1", "cell": "cell1",
                        "sent_at": utcnow().isoformat(),
                        "inventory": {"VCPU": {"total": 4}, "MEMORY_MB": {"total": 4096}, "DISK_GB": {"total": 10}}})
    consumer = str(uuid.uuid4())
    placement.claim(consumer, "p1", "u1", {placement.provider_by_host("h1"): {"VCPU": 1, "MEMORY_MB": 512}})
    return consumer


def test_audit_of_a_clean_store_exits_0(sqlite_store, capsys):
    assert cli.main(["audit", *QUIET]) == 0

    out = capsys.readouterr().out
    assert out.strip().endswith("clean")
    assert "SKIPPED" in out  # no state machine configured: said, not hidden


def test_a_strict_audit_that_could_not_run_every_check_exits_4_and_a_complete_one_0(sqlite_store, capsys,
                                                                                       monkeypatch):
    # GIVEN no state machine configured: the stuck-migration checks are skipped
    assert cli.main(["audit", "--strict", *QUIET]) == cli.EXIT_AUDIT_INCOMPLETE
    assert "SKIPPED" in capsys.readouterr().out

    # WHEN nothing is skipped, THEN a clean strict audit exits 0
    monkeypatch.setattr(audit_module, "_running_executions", lambda skipped: set())
    monkeypatch.setattr(audit_module, "_unlisted_move_machines", lambda: [])
    assert cli.main(["audit", "--strict", *QUIET]) == 0, capsys.readouterr().out


def test_audit_with_a_problem_exits_1_and_names_it(with_stray_allocation, capsys):
    assert cli.main(["audit", *QUIET]) == 1

    out = capsys.readouterr().out
    assert f"FIXABLE  allocation_orphan allocation/{with_stray_allocation}" in out
    assert "1 problem(s)" in out


def test_audit_json_is_the_structured_report(with_stray_allocation, capsys):
    assert cli.main(["audit", "--json", *QUIET]) == 1

    report = json.loads(capsys.readouterr().out)
    assert report["clean"] is False
    assert report["problems"] == [{
        "kind": "allocation_orphan", "resource": f"allocation/{with_stray_allocation}", "fixable": True,
        "message": report["problems"][0]["message"], "hint": "ferry audit --fix deletes it"}]
    assert report["repairs"] == []


def test_audit_fix_repairs_says_what_it_did_and_exits_0(with_stray_allocation, capsys):
    assert cli.main(["audit", "--fix", *QUIET]) == 0

    out = capsys.readouterr().out
    assert f"FIXED    allocation_orphan allocation/{with_stray_allocation}: deleted the allocations" in out
    assert placement.get_allocations(with_stray_allocation) == {}
    assert cli.main(["audit", *QUIET]) == 0


def test_the_default_grace_leaves_fresh_records_alone(with_stray_allocation, capsys):
    assert cli.main(["audit", "--no-storage"]) == 0


def test_audit_of_the_bucket_refuses_to_guess_which_bucket(with_stray_allocation, monkeypatch, capsys):
    monkeypatch.delenv("FERRY_IMAGE_BUCKET", raising=False)

    assert cli.main(["audit", "--fix", "--grace", "0"]) == 2

    assert "FERRY_IMAGE_BUCKET is not set" in capsys.readouterr().err
    assert placement.get_allocations(with_stray_allocation) != {}  # nothing was checked, nothing repaired


def test_ferry_without_a_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main([])

    assert exited.value.code == 2
    assert "<command>" in capsys.readouterr().err


def test_commands_are_a_list_others_can_extend():
    names = [name for name, _add in cli.COMMANDS]
    parser = cli.build_parser()

    assert names == ["audit", "drain", "db", "cell", "host", "volume", "image", "token"]
    assert parser.parse_args(["audit", "--fix", "--json"]).handler is not None


def test_the_console_script_is_registered():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

    assert scripts["ferry"] == "ferry.cli:main"


@pytest.mark.parametrize("grace", ["-5", "-0.1", "nan", "inf", "soon"])
def test_a_grace_that_is_no_number_of_seconds_from_0_is_a_usage_error(sqlite_store, capsys, grace):
    with pytest.raises(SystemExit) as exited:
        cli.main(["audit", "--no-storage", "--grace", grace])

    assert exited.value.code == 2
    assert "argument --grace" in capsys.readouterr().err


def test_the_admin_extra_installs_what_ferry_drain_and_the_openstack_cli_need_and_the_tests_get_it_too():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    assert {requirement.split(">=")[0] for requirement in extras["admin"]} == {"openstacksdk",
                                                                               "python-openstackclient"}
    assert set(extras["admin"]) <= set(extras["dev"])


def test_a_command_without_the_api_database_url_says_which_database_it_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FERRY_API_DATABASE_URL", raising=False)
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path))
    from ferry import config
    config.reset()

    assert cli.main(["db", "sync"]) == 0

    assert f"FERRY_API_DATABASE_URL is not set: using sqlite:///{tmp_path}/api.sqlite" in capsys.readouterr().err
    config.reset()


def test_a_number_setting_that_is_no_number_is_one_line_naming_it_and_exit_2(sqlite_store, monkeypatch, capsys):
    # GIVEN FERRY_SERVICE_DOWN_TIME written with a unit, as a person may
    from ferry import config
    monkeypatch.setenv("FERRY_SERVICE_DOWN_TIME", "1m")
    config.reset()

    # WHEN any command reads the settings
    for argv in (["audit", *QUIET], ["cell", "list"]):
        status = cli.main(argv)

        # THEN it says which variable in one line, with no traceback, and exits as for bad usage
        err = capsys.readouterr().err
        assert status == 2
        assert err == ("ferry: FERRY_SERVICE_DOWN_TIME='1m' is not a whole number; unset it for the default (60), "
                       "or give a whole number\n")
    config.reset()


@pytest.mark.parametrize("grace", ["1e20", "3153600001"])
def test_a_grace_beyond_a_century_is_a_usage_error_not_an_overflow(sqlite_store, capsys, grace):
    # GIVEN a grace too large for any date arithmetic
    # WHEN the audit is asked with it
    with pytest.raises(SystemExit) as exited:
        cli.main(["audit", "--no-storage", "--grace", grace])

    # THEN argparse refuses it (exit 2), naming the option
    assert exited.value.code == 2
    assert "argument --grace" in capsys.readouterr().err

