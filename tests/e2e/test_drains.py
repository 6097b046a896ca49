"""Drains on the local stack: empty a host or a cell through ``/ferry/drains``.

Servers are put on the host to drain as an operator would: every other compute service is
disabled (``os-services``) while they boot. After each drain: the drained host is disabled, its
placement usage is zero, every server lives elsewhere in the power state it had, and the drain's
record lists each server's result. A plan that does not fit moves nothing and gives the hosts back.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
from move_helpers import CROSS_CELL_RULE, TINY, disabled_services, host_of, only_hosts_enabled, set_service

from ferry import errors, faults, signing

pytestmark = pytest.mark.e2e

FINAL = {"planned", "completed", "failed", "cancelled"}


# --- helpers -------------------------------------------------------------------------------------


@pytest.fixture
def enabled_again(local_stack) -> Iterator[None]:
    """Whatever a drain disabled is enabled again after the test."""
    yield
    admin = local_stack.session("admin")
    for host, disabled in disabled_services(admin).items():
        if disabled:
            set_service(admin, host, disabled=False)


def _boot_on(local_stack, servers, host: str, count: int, *, identities=("demo", "alt"), volume_backed: int = 0,
             stopped: int = 0) -> list[dict[str, Any]]:
    """``count`` servers on ``host``: the first ``volume_backed`` from a volume, the last ``stopped`` stopped."""
    booted = []
    with only_hosts_enabled(local_stack, {host}):
        for index in range(count):
            extra: dict[str, Any] = {}
            if index < volume_backed:
                extra = {"imageRef": "", "block_device_mapping_v2": [{
                    "source_type": "image", "destination_type": "volume", "uuid": local_stack.seeded.image["id"],
                    "boot_index": 0, "volume_size": 1, "delete_on_termination": True}]}
            identity = identities[index % len(identities)]
            server = servers.boot(identity, flavor=TINY, name=f"drain-{index}", **extra)
            assert host_of(server) == host
            booted.append(server)
    for server in booted[count - stopped:]:
        assert servers.action(server["id"], {"os-stop": None}, identity="admin").status_code == 202
        servers.wait_for_status(server["id"], "SHUTOFF")
    return [servers.show(s["id"]) for s in booted]


def _start(local_stack, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    answer = local_stack.session("admin").post("/ferry/drains", json={"drain": body})
    assert answer.status_code in (200, 202), answer.text
    return answer.status_code, answer.json()["drain"]


def _show(local_stack, drain_id: str) -> dict[str, Any]:
    shown = local_stack.session("admin").get(f"/ferry/drains/{drain_id}")
    assert shown.status_code == 200, shown.text
    return shown.json()["drain"]


def _wait_final(local_stack, drain_id: str, timeout: float = 300) -> dict[str, Any]:
    return local_stack.wait_for(lambda: (d := _show(local_stack, drain_id))["status"] in FINAL and d, timeout=timeout,
                                interval=0.25)


def _act(local_stack, drain_id: str, action: str) -> dict[str, Any]:
    answer = local_stack.session("admin").post(f"/ferry/drains/{drain_id}/action", json={action: None})
    assert answer.status_code == 202, answer.text
    return answer.json()["drain"]


def _status_of(servers, server_id: str) -> str:
    shown = servers.show(server_id)
    assert shown is not None
    return shown["status"]


def _a_host(local_stack, cell: str | None = None) -> str:
    return sorted(h for h, c in local_stack.hosts.items() if cell is None or c == cell)[0]


# --- host drains ---------------------------------------------------------------------------------


def test_a_host_drain_moves_ten_servers_and_keeps_their_power_states(local_stack, servers, records, enabled_again):
    host = _a_host(local_stack)
    booted = _boot_on(local_stack, servers, host, 10, volume_backed=1, stopped=3)
    before = {s["id"]: s["status"] for s in booted}
    assert sorted(before.values()).count("SHUTOFF") == 3

    status, drain = _start(local_stack, {"host": host, "reason": "e2e: decommission", "max_concurrency": 4})
    assert status == 202 and drain["status"] in ("planning", "running")
    finished = _wait_final(local_stack, drain["id"])

    assert finished["status"] == "completed", finished
    assert finished["counts"] == {"total": 10, "done": 10, "failed": 0, "in_progress": 0, "left": 0,
                                  "cancelled": 0, "unplaceable": 0, "gone": 0}
    assert {s["id"] for s in finished["servers"]} == set(before)
    for server in finished["servers"]:
        assert server["state"] == "done" and server["source_host"] == host and server["dest_host"] != host
        shown = servers.show(server["id"])
        assert host_of(shown) == server["dest_host"]
        assert shown["status"] == before[server["id"]]
    assert disabled_services(local_stack.session("admin"))[host] is True
    assert records.usages(host) == {}
    assert finished["average_move_seconds"] is not None and finished["eta_seconds"] is None


def test_a_dry_run_that_does_not_fit_names_the_servers_and_moves_nothing(local_stack, servers, records,
                                                                         enabled_again):
    cell = local_stack.hosts[_a_host(local_stack)]
    cell_hosts = sorted(h for h, c in local_stack.hosts.items() if c == cell)
    booted = _boot_on(local_stack, servers, cell_hosts[0], 2)
    usage_before = {h: records.usages(h) for h in cell_hosts}

    # Without the cross-cell policy, draining both hosts of a cell leaves the servers nowhere to go.
    status, plan = _start(local_stack, {"hosts": cell_hosts, "dry_run": True})

    assert status == 200 and plan["status"] == "planned" and plan["plan"]["fits"] is False
    assert {u["id"] for u in plan["plan"]["unplaceable"]} == {s["id"] for s in booted}
    assert all("No valid host" in u["reason"] for u in plan["plan"]["unplaceable"])
    assert not any(disabled_services(local_stack.session("admin"))[h] for h in cell_hosts)

    # The same drain for real fails fast, and gives the hosts back.
    status, drain = _start(local_stack, {"hosts": cell_hosts})
    failed = _wait_final(local_stack, drain["id"], timeout=60)

    assert failed["status"] == "failed" and "does not fit" in failed["message"]
    assert failed["counts"]["done"] == 0
    assert not any(disabled_services(local_stack.session("admin"))[h] for h in cell_hosts)
    assert {h: records.usages(h) for h in cell_hosts} == usage_before
    assert {host_of(servers.show(s["id"])) for s in booted} == {cell_hosts[0]}


def test_a_failed_move_is_rolled_back_and_reported_while_the_rest_complete(local_stack, servers, records,
                                                                          enabled_again):
    host = _a_host(local_stack)
    booted = _boot_on(local_stack, servers, host, 3)
    faults.arm("*:finish_resize", faults.ONCE, "SpawnFailed")
    try:
        _status, drain = _start(local_stack, {"host": host, "max_concurrency": 1, "retries": 0})
        finished = _wait_final(local_stack, drain["id"])
    finally:
        faults.disarm_all()

    assert finished["status"] == "failed"
    by_state: dict[str, list[dict[str, Any]]] = {}
    for server in finished["servers"]:
        by_state.setdefault(server["state"], []).append(server)
    assert len(by_state["failed"]) == 1 and len(by_state["done"]) == 2, finished["servers"]
    [failed] = by_state["failed"]
    assert "SpawnFailed" in failed["error"] or "spawn" in failed["error"].lower()
    shown = servers.show(failed["id"])
    assert host_of(shown) == host and shown["status"] == "ACTIVE"  # rolled back to its source
    assert records.usages(host) != {}  # the failed one still lives there
    assert {s["id"] for s in booted} == {s["id"] for s in finished["servers"]}


def test_a_move_that_fails_once_is_retried(local_stack, servers, enabled_again):
    host = _a_host(local_stack)
    _boot_on(local_stack, servers, host, 2)
    faults.arm("*:finish_resize", faults.ONCE, "SpawnFailed")
    try:
        _status, drain = _start(local_stack, {"host": host, "max_concurrency": 1, "retries": 1})
        finished = _wait_final(local_stack, drain["id"])
    finally:
        faults.disarm_all()

    assert finished["status"] == "completed", finished
    assert sorted(s["attempts"] for s in finished["servers"]) == [1, 2]


def test_pause_resume_and_cancel(local_stack, servers, enabled_again):
    host = _a_host(local_stack)
    booted = _boot_on(local_stack, servers, host, 4)
    _status, drain = _start(local_stack, {"host": host, "max_concurrency": 1})
    local_stack.wait_for(lambda: _show(local_stack, drain["id"])["status"] == "running", timeout=60)

    paused = _act(local_stack, drain["id"], "pause")
    assert paused["status"] == "paused"
    # The move in flight finishes; no new one starts while paused.
    settled = local_stack.wait_for(lambda: (d := _show(local_stack, drain["id"]))["counts"]["in_progress"] == 0 and d,
                                   timeout=120, interval=0.25)
    done_while_paused = settled["counts"]["done"]
    time.sleep(4)
    still = _show(local_stack, drain["id"])
    assert still["counts"]["done"] == done_while_paused and still["counts"]["in_progress"] == 0
    assert local_stack.session("admin").post(f"/ferry/drains/{drain['id']}/action",
                                             json={"resume": None}).status_code == 202

    local_stack.wait_for(lambda: _show(local_stack, drain["id"])["counts"]["done"] > done_while_paused,
                         timeout=120, interval=0.25)
    cancelled = _act(local_stack, drain["id"], "cancel")
    assert cancelled["status"] == "cancelling"
    final = _wait_final(local_stack, drain["id"])

    assert final["status"] == "cancelled"
    counts = final["counts"]
    assert counts["done"] + counts["cancelled"] == 4 and counts["cancelled"] >= 1, final
    for server in final["servers"]:
        shown = servers.show(server["id"])
        expected_host = server["dest_host"] if server["state"] == "done" else host
        assert host_of(shown) == expected_host and shown["status"] == "ACTIVE"
    assert {s["id"] for s in booted} == {s["id"] for s in final["servers"]}
    # A drain that ended takes no more actions.
    refused = local_stack.session("admin").post(f"/ferry/drains/{drain['id']}/action", json={"resume": None})
    assert refused.status_code == 409


def test_a_cell_drain_moves_servers_to_the_other_cell(local_stack, servers, records, enabled_again):
    source = _a_host(local_stack)
    cell = local_stack.hosts[source]
    booted = _boot_on(local_stack, servers, source, 2, stopped=1)
    before = {s["id"]: s["status"] for s in booted}
    with local_stack.override_policy({CROSS_CELL_RULE: "admin"}):
        _status, drain = _start(local_stack, {"cell": cell, "max_concurrency": 2})
        finished = _wait_final(local_stack, drain["id"])

    assert finished["status"] == "completed", finished
    assert finished["target"] == {"kind": "cell", "names": [cell]}
    for server in finished["servers"]:
        shown = servers.show(server["id"])
        assert local_stack.hosts[host_of(shown)] != cell
        assert shown["status"] == before[server["id"]]
    cell_hosts = [h for h, c in local_stack.hosts.items() if c == cell]
    assert all(disabled_services(local_stack.session("admin"))[h] for h in cell_hosts)
    assert all(records.usages(h) == {} for h in cell_hosts)


def test_a_cell_drain_needs_the_cross_cell_policy(local_stack):
    cell = local_stack.hosts[_a_host(local_stack)]
    before = len(local_stack.session("admin").get("/ferry/drains").json()["drains"])
    refused = local_stack.session("admin").post("/ferry/drains", json={"drain": {"cell": cell}})

    assert refused.status_code == 403 and CROSS_CELL_RULE in refused.text
    assert len(local_stack.session("admin").get("/ferry/drains").json()["drains"]) == before


@pytest.mark.parametrize("body, status", [
    ({}, 400),
    ({"host": "no-such-host"}, 400),
    ({"host": "x", "cell": "y"}, 400),
    ({"host": "x", "max_concurrency": 0}, 400),
    ({"host": "x", "surprise": True}, 400),
])
def test_bad_drain_requests_are_refused_and_start_nothing(local_stack, body, status):
    before = len(local_stack.session("admin").get("/ferry/drains").json()["drains"])
    answer = local_stack.session("admin").post("/ferry/drains", json={"drain": body})

    assert answer.status_code == status and "message" in next(iter(answer.json().values()))
    assert len(local_stack.session("admin").get("/ferry/drains").json()["drains"]) == before


def test_only_admins_drain(local_stack):
    host = _a_host(local_stack)
    assert local_stack.session("demo").post("/ferry/drains", json={"drain": {"host": host}}).status_code == 403
    assert local_stack.session("demo").get("/ferry/drains").status_code == 403
    assert local_stack.session(None).get("/ferry/drains").status_code == 401


# --- the webhook, callbacks, and executions started directly ---------------------------------------


@contextmanager
def callback_receiver() -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    """A local HTTP endpoint that keeps every POST (headers, body) it gets."""
    received: list[tuple[dict[str, str], bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append((dict(self.headers.items()), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/drain-events", received
    finally:
        server.shutdown()
        server.server_close()


def _webhook_secret(local_stack) -> str:
    return local_stack.stack.webhook_secret or local_stack.stack.webhook_secret_file.read_text().strip()


def _callback_secret(local_stack) -> str:
    return local_stack.stack.callback_secret or local_stack.stack.callback_secret_file.read_text().strip()


def _drain_count(local_stack) -> int:
    return len(local_stack.session("admin").get("/ferry/drains").json()["drains"])


def test_a_signed_webhook_starts_one_drain_and_its_callback_is_signed(local_stack, servers, enabled_again):
    host = _a_host(local_stack)
    _boot_on(local_stack, servers, host, 1)
    secret = _webhook_secret(local_stack)
    before = _drain_count(local_stack)
    with callback_receiver() as (url, received):
        body = json.dumps({"drain": {"host": host, "reason": "e2e: webhook", "callback_url": url}}).encode()
        headers = {**signing.signed_headers(secret, body, delivery_id=str(uuid.uuid4())),
                   "Content-Type": "application/json"}
        first = requests.post(local_stack.stack.webhook_url, data=body, headers=headers, timeout=60)
        again = requests.post(local_stack.stack.webhook_url, data=body, headers=headers, timeout=60)

        assert first.status_code == 202, first.text
        assert again.status_code == 202 and again.json()["drain"]["id"] == first.json()["drain"]["id"]
        assert _drain_count(local_stack) == before + 1
        finished = _wait_final(local_stack, first.json()["drain"]["id"])
        assert finished["status"] == "completed" and finished["origin"] == "webhook"
        local_stack.wait_for(lambda: len(received) >= 2, timeout=30)

    assert [json.loads(body)["event_type"] for _headers, body in received] == ["drain.start", "drain.end"]
    for posted_headers, posted_body in received:
        # signed with the callback secret, never with the webhook's (a receiver could start drains with it)
        signing.verify(_callback_secret(local_stack), posted_headers, posted_body)
        with pytest.raises(errors.WebhookSignatureInvalid):
            signing.verify(secret, posted_headers, posted_body)
    assert json.loads(received[1][1])["drain"]["counts"]["done"] == 1

    tampered = {**headers, "X-Ferry-Delivery": str(uuid.uuid4()), "X-Ferry-Signature": "sha256=" + "0" * 64}
    refused = requests.post(local_stack.stack.webhook_url, data=body, headers=tampered, timeout=60)
    assert refused.status_code == 401 and _drain_count(local_stack) == before + 1


def _drain_state_machine(local_stack) -> str:
    machines = local_stack.client("stepfunctions").list_state_machines()["stateMachines"]
    [arn] = [m["stateMachineArn"] for m in machines if m["name"].endswith("-drain")]
    return arn


def _execution_result(local_stack, arn: str, name: str, payload: dict[str, Any]) -> dict[str, Any]:
    sfn = local_stack.client("stepfunctions")
    execution = sfn.start_execution(stateMachineArn=arn, name=name, input=json.dumps(payload))["executionArn"]
    return local_stack.wait_for(
        lambda: (d := sfn.describe_execution(executionArn=execution))["status"] != "RUNNING" and d, timeout=60)


def test_a_drain_started_directly_on_the_state_machine(local_stack):
    host = _a_host(local_stack)
    arn = _drain_state_machine(local_stack)
    before = _drain_count(local_stack)
    name = f"e2e-direct-{uuid.uuid4()}"

    done = _execution_result(local_stack, arn, name, {"drain": {"host": host, "dry_run": True}})

    assert done["status"] == "SUCCEEDED", done
    [drain] = [d for d in local_stack.session("admin").get("/ferry/drains").json()["drains"]
               if d["origin"] == "execution" and d["target"]["names"] == [host] and d["status"] == "planned"][:1]
    assert drain["dry_run"] is True and _drain_count(local_stack) == before + 1

    refused = _execution_result(local_stack, arn, f"e2e-direct-{uuid.uuid4()}", {"drain": {"host": "no-such-host"}})
    assert refused["status"] == "FAILED" and _drain_count(local_stack) == before + 1
    malformed = _execution_result(local_stack, arn, f"e2e-direct-{uuid.uuid4()}", {"drain_uuid": "not-a-uuid"})
    assert malformed["status"] == "FAILED" and _drain_count(local_stack) == before + 1


# --- the ferry drain command, with the openstack CLI's clouds.yaml ----------------------------------

FERRY = Path(sys.executable).with_name("ferry")


def _ferry(local_stack, tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OS_")}
    env.update(OS_CLIENT_CONFIG_FILE=str(local_stack.clouds_yaml), OS_CLOUD="ferry-admin", HOME=str(tmp_path))
    return subprocess.run([str(FERRY), "drain", *args], env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_the_ferry_command_drains_a_host_and_watches_it_to_the_end(local_stack, servers, tmp_path, enabled_again):
    host = _a_host(local_stack)
    [server] = _boot_on(local_stack, servers, host, 1)

    planned = _ferry(local_stack, tmp_path, "start", "--host", host, "--dry-run")
    assert planned.returncode == 0, planned.stderr
    assert server["id"] in planned.stdout or "drain-0" in planned.stdout
    watched = _ferry(local_stack, tmp_path, "start", "--host", host, "--reason", "e2e: cli", "--watch")

    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "completed" in watched.stdout
    listed = json.loads(_ferry(local_stack, tmp_path, "list", "--json").stdout)
    [mine] = [d for d in listed["drains"] if d["reason"] == "e2e: cli"]
    assert mine["status"] == "completed" and mine["counts"]["done"] == 1
    assert host_of(servers.show(server["id"])) != host
