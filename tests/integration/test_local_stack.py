"""The whole local stack from template.yaml: it comes up with every host reporting and goes away cleanly."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import sys
from pathlib import Path

import boto3
import pytest
import requests
import yaml
from moto import mock_aws
from sqlalchemy import func, select

from ferry import aws, config
from ferry.errors import HostsNotReporting, LocalStackError
from ferry.local import runtime, seed, stack
from ferry.local.stack import LocalStack


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_the_stack_comes_up_with_every_host_reporting_and_stops_without_leftovers(tmp_path):
    before = os.environ.get("AWS_ENDPOINT_URL")
    local = LocalStack(tmp_path / "state", cells=2, hosts_per_cell=1, moto_port=0, api_port=0)
    local.start()
    try:
        assert local.reporting_hosts() == {"cell1-host1", "cell2-host1"}
        assert local.seeded.cells == ["cell0", "cell1", "cell2"]
        assert requests.get(local.api_url, timeout=30).status_code == 200
        flavors = requests.get(
            local.api_url + "/flavors", headers={"X-Auth-Token": local.seeded.tokens["demo"]}, timeout=30
        )
        assert sorted(f["id"] for f in flavors.json()["flavors"]) == ["1", "2", "3", "4"]
        assert requests.get(local.api_url + "/flavors", timeout=30).status_code == 401
        clouds = yaml.safe_load(local.clouds_yaml.read_text())["clouds"]
        assert set(clouds) == {"ferry-admin", "ferry-demo", "ferry-alt"}
        for name, cloud in clouds.items():
            assert cloud["auth_type"] == "admin_token"
            assert cloud["auth"] == {"endpoint": local.api_url, "token": local.seeded.tokens[name[len("ferry-") :]]}
            assert cloud["identity_endpoint_override"] == local.identity_url
            assert "compute_api_version" not in cloud
        agents = [agent.process for agent in local.agents.values()]
        assert (local.logs_dir / "stack.log").is_file()
        assert all((local.logs_dir / f"agent-{host}.log").is_file() for host in local.agents)
        assert local.node_xml("cell1-host1").is_file()
    finally:
        local.stop()
    assert all(process.poll() is not None for process in agents)
    assert not _listening(local.api_port)
    assert not _listening(local.moto_port)
    assert os.environ.get("AWS_ENDPOINT_URL") == before


def test_restarting_on_the_same_state_keeps_tokens_image_and_flavors(tmp_path):
    state = tmp_path / "state"
    first = LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread")
    with first:
        tokens, image = first.seeded.tokens, first.seeded.image
    second = LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread")
    with second:
        assert second.seeded.tokens == tokens
        assert second.seeded.image["id"] == image["id"]
        from ferry.store.api_models import Flavor
        from ferry.store.db import api_session

        with api_session() as session:
            assert session.scalar(select(func.count()).select_from(Flavor)) == len(seed.DEFAULT_FLAVORS)
        response = requests.get(
            second.api_url + f"/images/{image['id']}", headers={"X-Auth-Token": tokens["admin"]}, timeout=30
        )
        assert response.status_code == 200
        assert not any(agent.alive() is False for agent in second.agents.values())
    assert json.loads((state / "seed.json").read_text())["tokens"] == tokens


def test_the_seed_image_is_a_deterministic_bootable_raw_disk(tmp_path):
    first = seed.write_test_image(tmp_path / "a.raw", size_mib=1)
    second = seed.write_test_image(tmp_path / "b.raw", size_mib=1)
    assert first == second
    data = (tmp_path / "a.raw").read_bytes()
    assert len(data) == 1024 * 1024
    assert data.startswith(seed.IMAGE_MARKER)
    assert data[510:512] == b"\x55\xaa"


def test_the_default_topology_names_hosts_after_their_cell():
    assert seed.topology(2, 2) == {
        "cell1-host1": "cell1",
        "cell1-host2": "cell1",
        "cell2-host1": "cell2",
        "cell2-host2": "cell2",
    }


def test_fresh_wipes_only_a_state_directory_the_stack_made(tmp_path):
    # GIVEN a project with its own logs/
    project = tmp_path / "project"
    (project / "logs").mkdir(parents=True)
    (project / "precious.txt").write_text("keep me")

    # WHEN --fresh names it, THEN it is refused by name
    with pytest.raises(LocalStackError, match=f"Not wiping {project}: it holds neither"):
        stack._wipe(project)
    assert (project / "precious.txt").exists()

    # GIVEN a state directory the stack made, and one it seeded; WHEN --fresh names them, THEN they go
    made = tmp_path / "made"
    stack.claim_state_dir(made)
    (made / "logs").mkdir()
    seeded = tmp_path / "seeded"
    seeded.mkdir()
    (seeded / "seed.json").write_text("{}")
    stack._wipe(made)
    stack._wipe(seeded)
    assert not made.exists() and not seeded.exists()


def test_fresh_refuses_a_git_work_tree_a_home_and_the_root_whatever_they_hold(tmp_path, monkeypatch):
    # GIVEN directories a state directory was once put in by mistake (--state-dir .)
    checkout, home = tmp_path / "checkout", tmp_path / "home"
    for place in (checkout, home):
        place.mkdir()
        (place / "seed.json").write_text("{}")
    (checkout / ".git").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(stack.shutil, "rmtree", lambda path: pytest.fail(f"{path} was wiped"))

    # WHEN --fresh names them, THEN each is refused by name
    with pytest.raises(LocalStackError, match=f"Not wiping {checkout}: it is a git work tree"):
        stack._wipe(checkout)
    with pytest.raises(LocalStackError, match=f"Not wiping {home}: it is a home directory"):
        stack._wipe(home)
    with pytest.raises(LocalStackError, match="Not wiping /: it is the root directory"):
        stack._wipe(Path("/"))


def test_a_start_in_an_existing_directory_does_not_mark_it_as_the_stacks(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    stack.claim_state_dir(tmp_path)
    assert not (tmp_path / stack.STATE_MARKER).exists()
    with pytest.raises(LocalStackError):
        stack._wipe(tmp_path)


def test_the_default_template_is_the_checkouts():
    assert stack.default_template_path() == Path(__file__).resolve().parents[2] / "template.yaml"


class _SilentAgent:
    """An agent that runs but never reports."""

    def alive(self) -> bool:
        return True

    def signal_stop(self) -> None:
        pass

    def wait(self, timeout: float) -> None:
        pass


def test_a_restart_is_ready_only_once_its_own_agents_reported(tmp_path, monkeypatch):
    # GIVEN a state directory whose hosts reported in an earlier run
    state = tmp_path / "state"
    with LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread") as first:
        assert first.reporting_hosts() == {"cell1-host1"}

    # WHEN the stack starts on it again and its agent never reports
    monkeypatch.setattr(LocalStack, "_start_agent", lambda self, host, cell, *args: _SilentAgent())
    again = LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread", ready_timeout=3)

    # THEN the earlier run's heartbeat does not make it ready
    with pytest.raises(HostsNotReporting, match="cell1-host1"):
        again.start()


def _refuse_moto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack.LocalAws, "start", lambda self: pytest.fail("moto was started"))


def test_a_busy_api_port_stops_the_start_before_moto_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # main's handlers stay out of the test run
    _refuse_moto(monkeypatch)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LocalStackError, match=f"127.0.0.1:{port} is in use .*--api-port"):
            LocalStack(tmp_path / "state", moto_port=0, api_port=port).start()

        code = stack.main(["--state-dir", str(tmp_path / "cli"), "--api-port", str(port), "--moto-port", "0"])

    assert code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ferry-local: Port 127.0.0.1:{port} is in use") and "--api-port" in line


@pytest.mark.parametrize(("option", "value", "refused"), [
    ("--api-port", "70000", "70000 is not in 0..65535"), ("--moto-port", "70000", "70000 is not in 0..65535"),
    ("--api-port", "-1", "-1 is not in 0..65535"), ("--moto-port", "-1", "-1 is not in 0..65535"),
    ("--cells", "0", "0 is less than 1"), ("--hosts-per-cell", "-2", "-2 is less than 1"),
])
def test_an_argument_out_of_range_is_a_usage_error_before_anything_starts(tmp_path, monkeypatch, capsys, option,
                                                                          value, refused):
    # a port that is no TCP port, a stack of no cells or no hosts
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # main's handlers stay out of the test run
    _refuse_moto(monkeypatch)

    with pytest.raises(SystemExit) as exited:
        stack.main(["--state-dir", str(tmp_path / "state"), option, value])

    # argparse's usage error: the usage line, then one line naming the option
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == f"ferry-local: error: argument {option}: {refused}"
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("port", [70000, -1])
def test_a_port_out_of_range_given_to_the_stack_is_refused_naming_the_option(port):
    with pytest.raises(LocalStackError, match=f"Port {port} is no TCP port: .*--moto-port"):
        runtime.check_port("127.0.0.1", port, "--moto-port")


@pytest.mark.parametrize("option", ["--template", "--policy-file"])
def test_a_missing_file_stops_the_start_in_one_line_before_anything_starts(tmp_path, monkeypatch, capsys, option):
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    _refuse_moto(monkeypatch)
    missing = tmp_path / "nonexistent.yaml"

    code = stack.main(["--state-dir", str(tmp_path / "state"), option, str(missing), "--api-port", "0",
                       "--moto-port", "0"])

    assert code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ferry-local: ") and str(missing) in line and option in line
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("fresh", [[], ["--fresh"]], ids=["kept", "fresh"])
def test_a_state_dir_that_is_a_file_stops_the_start_in_one_line_and_is_left_alone(tmp_path, monkeypatch, capsys,
                                                                                   fresh):
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    _refuse_moto(monkeypatch)
    regular = tmp_path / "state"
    regular.write_text("a file, not a directory\n")

    code = stack.main(["--state-dir", str(regular), "--api-port", "0", "--moto-port", "0", *fresh])

    assert code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ferry-local: {regular} is not a directory") and "--state-dir" in line
    assert regular.read_text() == "a file, not a directory\n"


@pytest.mark.parametrize("value", ["fast", "0"])
def test_a_rate_scale_that_is_not_a_number_above_zero_stops_the_start_before_moto_starts(tmp_path, monkeypatch, value):
    monkeypatch.setenv("FERRY_LOCAL_RATE_SCALE", value)
    _refuse_moto(monkeypatch)
    with pytest.raises(LocalStackError, match="FERRY_LOCAL_RATE_SCALE must be a number above 0"):
        LocalStack(tmp_path / "state", moto_port=0, api_port=0).start()


def test_without_libvirt_python_the_stack_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "libvirt", None)  # import libvirt now fails as without the package
    monkeypatch.delitem(sys.modules, "hostagent.driver", raising=False)
    with pytest.raises(LocalStackError, match="libvirt-dev and pkg-config, then run `make bootstrap`"):
        LocalStack(tmp_path / "state")

    assert stack.main(["--state-dir", str(tmp_path / "cli")]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ferry-local: The host agent cannot be loaded")


def _environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if entry)


def test_an_agent_process_gets_only_the_ferry_variables_an_agent_on_aws_gets(tmp_path, monkeypatch):
    # GIVEN a drill's fault file, which agents must see, and a switch of the stack's own
    monkeypatch.setenv("FERRY_FAULT_INJECTION", str(tmp_path / "faults.json"))
    monkeypatch.setenv("FERRY_LOCAL_DUPLICATE_DELIVERY", "0")
    local = LocalStack(tmp_path / "state", cells=1, hosts_per_cell=1, moto_port=0, api_port=0)
    with local:
        # WHEN the stack spawns its agent
        environ = _environ_of(local.agents["cell1-host1"].process.pid)
        functions = local.model.environment()

    # THEN it gets the queues, the state directory and the drill switch, none of the functions'
    # settings (database, webhook and callback secrets, state machines, image bucket), and the local AWS
    assert {name for name in environ if name.startswith("FERRY_")} == {
        "FERRY_HOST_QUEUE_PREFIX",
        "FERRY_HOST_REPORTS_QUEUE_URL",
        "FERRY_STATE_DIR",
        "FERRY_FAULT_INJECTION",
    }
    assert environ["FERRY_HOST_QUEUE_PREFIX"] == functions["FERRY_HOST_QUEUE_PREFIX"]
    assert {"FERRY_API_DATABASE_URL", "FERRY_WEBHOOK_SECRET", "FERRY_CALLBACK_SECRET", "FERRY_IMAGE_BUCKET"} <= set(
        functions)
    assert environ["AWS_ENDPOINT_URL"] == local.aws_endpoint_url
    assert environ["AWS_ACCESS_KEY_ID"] == "testing" and environ["AWS_REGION"] == local.model.region
    assert environ["PATH"] == os.environ["PATH"]


def test_the_stack_signs_callbacks_with_a_secret_of_their_own_and_lets_them_reach_loopback(tmp_path):
    # GIVEN a stack given its callback secret, and one left to make its own
    with LocalStack(tmp_path / "given", cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread",
                    callback_secret="given-callback-secret") as given:
        given_functions = {lid: f.environment for lid, f in given.model.functions.items()}
    with LocalStack(tmp_path / "made", cells=1, hosts_per_cell=1, moto_port=0, api_port=0,
                    agent_mode="thread") as made:
        made_secret, made_webhook_secret = made.callback_secret, made.webhook_secret
        made_finish = made.model.functions["FinishDrainFunction"].environment

    # THEN the functions that sign callbacks get it (the webhook's secret stays with the webhook),
    # callbacks may reach the stack's own receivers on 127.0.0.1, and only a made secret is kept
    for logical_id in ("ApiFunction", "DrainWebhookFunction", "PlanDrainFunction", "FinishDrainFunction"):
        assert given_functions[logical_id]["FERRY_CALLBACK_SECRET"] == "given-callback-secret", logical_id
        assert given_functions[logical_id]["FERRY_CALLBACK_ALLOW_PRIVATE"] == "true", logical_id
    assert "FERRY_WEBHOOK_SECRET" not in given_functions["FinishDrainFunction"]
    assert not (tmp_path / "given" / "callback-secret").exists()
    assert made_secret and made_secret != made_webhook_secret and made_finish["FERRY_CALLBACK_SECRET"] == made_secret
    kept = tmp_path / "made" / "callback-secret"
    assert kept.read_text().strip() == made_secret and kept.stat().st_mode & 0o777 == 0o600


def test_ferry_local_takes_a_callback_secret(monkeypatch, tmp_path):
    started: dict[str, object] = {}

    class Refused(LocalStack):
        def __init__(self, state_dir, **options):
            started.update(options)
            raise LocalStackError("stop here")

    monkeypatch.setattr(stack, "LocalStack", Refused)

    assert stack.main(["--state-dir", str(tmp_path / "state"), "--callback-secret", "from-the-command-line"]) == 1
    assert started["callback_secret"] == "from-the-command-line"


def test_the_files_holding_tokens_are_never_readable_by_others(
    sqlite_store, aws_test_credentials, tmp_path, monkeypatch
):
    # GIVEN a umask that leaves new files readable by everyone, and a spy on every open of the token files
    state = tmp_path / "state"
    private = {state / "clouds.yaml", state / "seed.json"}
    modes: dict[Path, list[int]] = {}
    real_os_open, real_io_open = os.open, io.open

    def note(path: object) -> None:
        if isinstance(path, (str, Path)) and Path(path) in private:
            modes.setdefault(Path(path), []).append(Path(path).stat().st_mode & 0o777)

    def spy_os_open(path, flags, mode=0o777, *args, **kwargs):
        fd = real_os_open(path, flags, mode, *args, **kwargs)
        note(path)
        return fd

    def spy_io_open(file, *args, **kwargs):
        opened = real_io_open(file, *args, **kwargs)
        note(file)
        return opened

    monkeypatch.setattr(os, "open", spy_os_open)
    monkeypatch.setattr(io, "open", spy_io_open)
    previous_umask = os.umask(0o022)
    try:
        with mock_aws():
            aws.reset()
            boto3.client("s3").create_bucket(Bucket=config.get().image_bucket)
            # WHEN seeding writes clouds.yaml and seed.json
            seed.seed(
                state,
                api_url="http://api",
                identity_url="http://identity",
                volume_url="http://volume",
                cells=1,
                hosts_per_cell=1,
            )
    finally:
        os.umask(previous_umask)
        aws.reset()

    # THEN each was owner-only from the moment it was opened for writing
    assert set(modes) == private
    assert all(mode == 0o600 for opened in modes.values() for mode in opened), modes
