"""``python -m hostagent`` as a process: configured from flags and environment, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from hostagent.journal import Journal

ROOT = Path(__file__).resolve().parents[2]
REGION = "us-east-1"


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


def test_agent_process_reports_runs_operations_and_exits_cleanly_on_sigterm(moto_endpoint, tmp_path):
    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION}
    sqs = boto3.client(
        "sqs",
        endpoint_url=moto_endpoint,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    reports_url = sqs.create_queue(QueueName="ferry-main-host-reports")["QueueUrl"]
    env = {
        **os.environ,
        **credentials,
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
