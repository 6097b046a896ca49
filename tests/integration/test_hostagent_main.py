"""``python -m hostagent`` as a process: configured from flags and environment, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer
from moto_credentials import CREDENTIALS, REGION

from ferry import config, protocol
from hostagent import __main__ as agent_main
from hostagent.__main__ import build_parser
from hostagent.journal import Journal

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def moto_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def test_help_describes_the_agent():
    out = subprocess.run(
        [sys.executable, "-m", "hostagent", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "--libvirt-uri" in out.stdout and "--report-interval" in out.stdout
    assert out.stdout.startswith("usage: ferry-hostagent ")
    assert "(default: None)" not in out.stdout  # an option without a default says what it falls back to
    assert "(default: 20)" in out.stdout  # --poll-wait-seconds' own default is shown


def test_each_volumes_directory_is_given_with_a_flag_of_its_own():
    args = build_parser().parse_args(["--volumes-dir", "/srv/volumes", "--volumes-dir", "/mnt/fast-volumes"])

    assert args.volumes_dirs == [Path("/srv/volumes"), Path("/mnt/fast-volumes")]
    assert build_parser().parse_args([]).volumes_dirs is None  # the agent's defaults


class RecordedAgent:
    """Stands in for HostAgent: records how ``python -m hostagent`` configures the agent, and runs nothing."""

    built: list[dict[str, Any]] = []

    def __init__(self, **options: Any) -> None:
        self.built.append(options)

    def install_signal_handlers(self) -> None:
        pass

    def run(self) -> None:
        pass


@pytest.fixture
def configured(tmp_path, monkeypatch) -> Iterator[list[dict[str, Any]]]:
    """The options ``main`` builds its agent with, FERRY_STATE_DIR being ``tmp_path/stack`` (as in the local stack)."""
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path / "stack"))
    monkeypatch.setenv("FERRY_HOST_QUEUE_PREFIX", "ferry-test-host-")
    config.reset()
    monkeypatch.setattr(agent_main, "HostAgent", RecordedAgent)
    RecordedAgent.built = []
    yield RecordedAgent.built
    config.reset()


def agent_flags(tmp_path: Path) -> list[str]:
    return ["--host", "compute1", "--state-dir", str(tmp_path / "state"), "--instances-dir",
            str(tmp_path / "disks" / "instances")]


def test_by_default_an_agent_makes_volume_files_where_the_compute_api_of_its_state_directory_places_them(
        configured, tmp_path):
    assert agent_main.main(agent_flags(tmp_path)) == 0

    (options,) = configured
    # ferry.compute.api places a volume it makes at <FERRY_STATE_DIR>/volumes/<id>
    assert options["volumes_dirs"] == [config.get().state_dir / protocol.VOLUMES_DIR,
                                       tmp_path / "disks" / protocol.VOLUMES_DIR]


def test_volumes_directories_given_replace_the_defaults(configured, tmp_path):
    flags = ["--volumes-dir", str(tmp_path / "a"), "--volumes-dir", str(tmp_path / "b" / ".." / "c")]

    assert agent_main.main([*agent_flags(tmp_path), *flags]) == 0

    (options,) = configured
    assert options["volumes_dirs"] == [tmp_path / "a", tmp_path / "c"]


@pytest.mark.parametrize(("host", "tag"), [
    ("compute1", "compute1"),
    ("compute1.example.org", protocol.host_queue_name("ferry-test-host-", "compute1.example.org")[16:]),
])
def test_the_queue_tag_is_the_hosts_queue_name_after_the_prefix_and_nothing_starts(configured, tmp_path, capsys,
                                                                                   host, tag):
    flags = ["--host", host, "--state-dir", str(tmp_path / "state"), "--print-queue-tag"]

    assert agent_main.main(flags) == 0

    assert capsys.readouterr().out == f"{tag}\n"
    assert "ferry-test-host-" + tag == protocol.host_queue_name("ferry-test-host-", host)
    assert configured == [] and not (tmp_path / "state").exists()  # no agent, nothing set up


def test_an_agent_without_its_queue_prefix_or_queue_refuses_to_start(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FERRY_HOST_QUEUE_PREFIX", raising=False)
    monkeypatch.setattr(agent_main, "HostAgent", RecordedAgent)
    RecordedAgent.built = []

    with pytest.raises(SystemExit) as refused:
        agent_main.main(agent_flags(tmp_path))

    assert refused.value.code == 2 and RecordedAgent.built == []
    assert "FERRY_HOST_QUEUE_PREFIX is not set" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # nothing was set up
    # a queue named on the command line needs no prefix
    assert agent_main.main([*agent_flags(tmp_path), "--queue-url", "http://127.0.0.1:1/queue/compute1"]) == 0
    assert [options["queue_url"] for options in RecordedAgent.built] == ["http://127.0.0.1:1/queue/compute1"]


@pytest.mark.parametrize(("host", "reports_queue", "refusal"), [
    ("compute/1", "", "is not a host name"),
    ("compute1-dlq", "", "is not a host name"),
    ("reports", "http://127.0.0.1:1/000000000000/ferry-test-host-reports", "would poll the host reports queue"),
])
def test_an_agent_refuses_a_host_whose_queue_cannot_be_its_own(configured, tmp_path, monkeypatch, capsys, host,
                                                              reports_queue, refusal):
    monkeypatch.setenv("FERRY_HOST_REPORTS_QUEUE_URL", reports_queue)
    config.reset()

    with pytest.raises(SystemExit) as refused:
        agent_main.main(["--host", host, "--state-dir", str(tmp_path / "state")])

    assert refused.value.code == 2 and configured == []
    assert refusal in capsys.readouterr().err


@pytest.mark.parametrize("queue_flags", [[], ["--queue-url", "http://127.0.0.1:1/000000000000/anything"]],
                         ids=["queue-from-prefix", "queue-url"])
def test_an_agent_refuses_the_host_name_reports_whatever_else_it_is_given(configured, tmp_path, monkeypatch, capsys,
                                                                          queue_flags):
    """``<prefix>reports`` is the stack's host reports queue, even when this agent is not told its URL."""
    monkeypatch.delenv("FERRY_HOST_REPORTS_QUEUE_URL", raising=False)
    config.reset()

    with pytest.raises(SystemExit) as refused:
        agent_main.main(["--host", "reports", "--state-dir", str(tmp_path / "state"), *queue_flags])

    assert refused.value.code == 2 and configured == []
    assert "would poll the host reports queue" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [
    ["--disk-overcommit-ratio", "0"],
    ["--disk-overcommit-ratio", "-1.5"],
    ["--heartbeat-interval", "0"],
    ["--report-interval", "0"],
    ["--report-interval", "nan"],
    ["--keepalive-interval", "-1"],
    ["--visibility-timeout", "0"],
    ["--poll-wait-seconds", "21"],
    ["--poll-wait-seconds", "-1"],
    ["--vcpus", "-4"],
    ["--reserved-memory-mb", "-512"],
    ["--image-cache-max-age", "-1"],
], ids=lambda flags: " ".join(flags))
def test_an_agent_refuses_a_value_that_cannot_work_before_it_opens_the_hypervisor(configured, tmp_path, monkeypatch,
                                                                                  capsys, flags):
    opened: list[str] = []
    monkeypatch.setattr(agent_main, "LibvirtDriver", lambda uri, **_options: opened.append(uri))

    with pytest.raises(SystemExit) as refused:
        agent_main.main([*agent_flags(tmp_path), *flags])

    assert refused.value.code == 2 and configured == [] and opened == []
    assert f"argument {flags[0]}: " in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # nothing was set up


def test_agent_process_reports_runs_operations_and_exits_cleanly_on_sigterm(moto_endpoint, tmp_path):
    sqs = boto3.client(
        "sqs",
        endpoint_url=moto_endpoint,
        region_name=REGION,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )
    reports_url = sqs.create_queue(QueueName="ferry-main-host-reports")["QueueUrl"]
    env = {
        **os.environ,
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": moto_endpoint,
        "FERRY_STATE_DIR": str(tmp_path),
        "FERRY_HOST_QUEUE_PREFIX": "ferry-main-host-",
        "FERRY_HOST_REPORTS_QUEUE_URL": reports_url,
    }
    log = (tmp_path / "agent.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hostagent",
            "--host",
            "compute9",
            "--cell",
            "cell2",
            "--vcpus",
            "4",
            "--memory-mb",
            "4096",
            "--poll-wait-seconds",
            "1",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        inventory = None
        deadline = time.monotonic() + 60
        while inventory is None and time.monotonic() < deadline and proc.poll() is None:
            for message in sqs.receive_message(QueueUrl=reports_url, WaitTimeSeconds=1, MaxNumberOfMessages=10).get(
                "Messages", []
            ):
                report = json.loads(message["Body"])
                if report["kind"] == "inventory":
                    inventory = report
        assert inventory is not None, (tmp_path / "agent.log").read_text()
        assert (inventory["host"], inventory["node"], inventory["cell"]) == ("compute9", "compute9", "cell2")
        assert inventory["inventory"]["VCPU"] == {"total": 4, "reserved": 0}
        assert inventory["inventory"]["MEMORY_MB"] == {"total": 4096, "reserved": 512}

        queue_url = sqs.get_queue_url(QueueName="ferry-main-host-compute9")["QueueUrl"]
        destroy = {
            "operation": "destroy",
            "operation_id": "op-1",
            "instance_uuid": str(uuid.uuid4()),
            "args": {},
            "task_token": None,
        }
        sqs.send_message(QueueUrl=queue_url, MessageBody=json.dumps(destroy))
        journal = Journal(tmp_path / "hosts" / "compute9" / "journal.sqlite")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ((entry := journal.get("op-1")) and entry.finished):
            time.sleep(0.05)
        entry = journal.get("op-1")
        assert entry is not None and entry.status == "succeeded"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_the_disk_headroom_check_is_on_unless_turned_off():
    from hostagent.__main__ import build_parser

    default = build_parser().parse_args([])
    relaxed = build_parser().parse_args(["--no-disk-headroom-check", "--disk-overcommit-ratio", "2.5"])

    assert (default.disk_headroom_check, default.disk_overcommit_ratio) == (True, 1.0)
    assert (relaxed.disk_headroom_check, relaxed.disk_overcommit_ratio) == (False, 2.5)


def test_the_hung_hypervisor_watch_is_on_unless_turned_off(capsys):
    from hostagent.__main__ import build_parser

    assert build_parser().parse_args([]).hypervisor_call_timeout == 600
    assert build_parser().parse_args(["--hypervisor-call-timeout", "0"]).hypervisor_call_timeout == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--hypervisor-call-timeout", "-1"])
    assert "--hypervisor-call-timeout" in capsys.readouterr().err


class _Stoppable:
    """What ``stop_with_parent`` needs of an agent."""

    host = "compute9"

    def __init__(self) -> None:
        self.stopped = threading.Event()

    @property
    def stopping(self) -> bool:
        return self.stopped.is_set()

    def stop(self) -> None:
        self.stopped.set()


def test_an_agent_watching_its_parent_stops_only_when_the_parent_is_another():
    from hostagent.__main__ import stop_with_parent

    kept, orphaned = _Stoppable(), _Stoppable()
    stop_with_parent(kept, os.getppid(), interval=0.01)
    watcher = stop_with_parent(orphaned, -1, interval=0.01)  # no process has that id: the parent is gone

    watcher.join(timeout=5)
    assert orphaned.stopped.is_set()
    assert not kept.stopped.wait(0.2)
    kept.stop()


# Started by the test, it starts an agent with --parent-pid of itself, then exits when its stdin closes.
MIDDLE = r"""
import os, subprocess, sys
log = open(sys.argv[1], "ab")
agent = subprocess.Popen([sys.executable, "-m", "hostagent", *sys.argv[2:], "--parent-pid", str(os.getpid())],
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
print(agent.pid, flush=True)
sys.stdin.read()
"""


def _exited(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever took it over to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_an_agent_started_with_parent_pid_stops_when_that_process_exits(moto_endpoint, tmp_path):
    """The local stack starts its agents so: killed, it leaves none behind polling for ever."""
    env = {
        **os.environ,
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": moto_endpoint,
        "FERRY_STATE_DIR": str(tmp_path),
        "FERRY_HOST_QUEUE_PREFIX": "ferry-orphan-host-",
        "FERRY_HOST_REPORTS_QUEUE_URL": "",
    }  # fmt: skip
    log = tmp_path / "agent.log"
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, str(log), "--host", "compute8", "--poll-wait-seconds", "1"],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert middle.stdout is not None and middle.stdin is not None
    agent_pid = int(middle.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while b"host agent started" not in (log.read_bytes() if log.exists() else b""):
            assert time.monotonic() < deadline and not _exited(agent_pid), log.read_text()
            time.sleep(0.1)

        middle.stdin.close()  # the agent's parent exits, as a killed local stack would
        assert middle.wait(timeout=30) == 0

        deadline = time.monotonic() + 30
        while not _exited(agent_pid):
            assert time.monotonic() < deadline, "the agent outlived its parent: " + log.read_text()
            time.sleep(0.1)
        text = log.read_text()
        assert "the process that started this agent has exited" in text
        assert "host agent stopped" in text, "it stops as on SIGTERM, not by being killed"
    finally:
        if not _exited(agent_pid):
            os.kill(agent_pid, signal.SIGKILL)
