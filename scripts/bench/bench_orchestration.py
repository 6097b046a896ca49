#!/usr/bin/env python3
"""Benchmark orchestration overhead: resizes on the local stack, API call to VERIFY_RESIZE.

Brings up the local stack (``ferry.local.stack.LocalStack``) in a temporary directory on free
ports, agents as processes (``--agent-mode thread`` for threads), boots one tiny server and
then, ``--runs`` times: resizes it through the compute API (timed from the POST until the
server shows VERIFY_RESIZE with no task), and reverts it (untimed) so the next run starts
alike. Each resize's execution history gives the time spent in each state (entered to exited);
the table shows each state's median and p95.

Same cell (default): one cell of two hosts, tiny to small. ``--cross-cell``: two cells of one
host each, the policy allowing cross-cell resizes, and a small flavor only the second cell's
host offers (an aggregate ``hw_generation=cell2`` and the flavor's matching extra spec), as an
operator would steer a move to new hardware; the server is booted in the first cell.

Powertools metrics are off in the benchmark's process (``POWERTOOLS_METRICS_DISABLED``) so
that their output does not bury the figures.

    .venv/bin/python scripts/bench/bench_orchestration.py [--runs 50] [--cross-cell] [--agent-mode process]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import print_header  # noqa: E402 - the sibling modules of this script
from stats import summary  # noqa: E402

TINY, SMALL = "1", "2"
POLL = 0.02
WAIT = 120.0
CROSS_CELL_RULE = "compute:servers:resize:cross_cell"
SERVICES = {"OpenStack-API-Version": "compute 2.53"}


class Cloud:
    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.api = requests.Session()
        self.api.headers["X-Auth-Token"] = stack.seeded.tokens["admin"]
        self.api.headers["OpenStack-API-Version"] = "compute latest"
        self.sfn = stack.aws.client("stepfunctions")
        self.resize_arn = stack.model.state_machines["ResizeStateMachine"].arn

    def url(self, path: str) -> str:
        return self.stack.api_url + path

    def server(self, server_id: str) -> dict[str, Any]:
        response = self.api.get(self.url(f"/servers/{server_id}"), timeout=30)
        response.raise_for_status()
        return response.json()["server"]

    def wait_for(self, server_id: str, status: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT
        while True:
            server = self.server(server_id)
            if server["status"] == status and server["OS-EXT-STS:task_state"] is None:
                return server
            if server["status"] == "ERROR":
                raise RuntimeError(f"server went to ERROR: {server.get('fault')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server still {server['status']}/{server['OS-EXT-STS:task_state']}")
            time.sleep(POLL)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
        response = self.api.request(method, self.url(path), json=body, headers=headers, timeout=30)
        if response.status_code >= 300:
            raise RuntimeError(f"{method} {path} answered {response.status_code}: {response.text}")
        return response.json() if response.content else {}

    def set_enabled(self, host: str, enabled: bool) -> None:
        services = self.call("GET", "/os-services?binary=nova-compute", headers=SERVICES)["services"]
        [service] = [s for s in services if s["host"] == host]
        self.call("PUT", f"/os-services/{service['id']}", {"status": "enabled" if enabled else "disabled"},
                  headers=SERVICES)

    def generation_flavor(self, cell: str) -> str:
        """A small flavor that only ``cell``'s hosts offer (aggregate metadata and extra spec)."""
        aggregate = self.call("POST", "/os-aggregates", {"aggregate": {"name": f"bench-{cell}"}})["aggregate"]["id"]
        for host in sorted(h for h, c in self.stack.seeded.hosts.items() if c == cell):
            self.call("POST", f"/os-aggregates/{aggregate}/action", {"add_host": {"host": host}})
        self.call("POST", f"/os-aggregates/{aggregate}/action",
                  {"set_metadata": {"metadata": {"hw_generation": cell}}})
        flavor = self.call("POST", "/flavors", {"flavor": {"name": f"bench.small.{cell}", "id": f"small-{cell}",
                                                           "vcpus": 1, "ram": 512, "disk": 2}})["flavor"]["id"]
        self.call("POST", f"/flavors/{flavor}/os-extra_specs",
                  {"extra_specs": {"aggregate_instance_extra_specs:hw_generation": cell}})
        return str(flavor)

    def boot(self) -> str:
        body = {"server": {"name": "bench", "flavorRef": TINY, "imageRef": self.stack.seeded.image["id"],
                           "networks": "auto"}}
        response = self.api.post(self.url("/servers"), json=body, timeout=30)
        response.raise_for_status()
        server_id = response.json()["server"]["id"]
        self.wait_for(server_id, "ACTIVE")
        return server_id

    def action(self, server_id: str, body: dict[str, Any]) -> None:
        response = self.api.post(self.url(f"/servers/{server_id}/action"), json=body, timeout=30)
        if response.status_code != 202:
            raise RuntimeError(f"{body} answered {response.status_code}: {response.text}")

    def latest_resize_execution(self, server_id: str, known: set[str]) -> str | None:
        for page in self.sfn.get_paginator("list_executions").paginate(stateMachineArn=self.resize_arn):
            for execution in page["executions"]:
                if server_id in execution["name"] and execution["executionArn"] not in known:
                    return execution["executionArn"]
        return None

    def state_durations(self, execution_arn: str) -> dict[str, float]:
        """Seconds from each state's entry to its exit (summed when a state runs more than once)."""
        events = []
        for page in self.sfn.get_paginator("get_execution_history").paginate(executionArn=execution_arn):
            events.extend(page["events"])
        entered: dict[str, Any] = {}
        durations: dict[str, float] = defaultdict(float)
        for event in events:
            details = event.get("stateEnteredEventDetails") or event.get("stateExitedEventDetails")
            if not details:
                continue
            name = details["name"]
            if event["type"].endswith("StateEntered"):
                entered[name] = event["timestamp"]
            elif name in entered:
                durations[name] += (event["timestamp"] - entered.pop(name)).total_seconds()
        return dict(durations)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--agent-mode", choices=("process", "thread"), default="process")
    parser.add_argument("--cross-cell", action="store_true", help="resize between two cells (one host each)")
    parser.add_argument("--profile", type=Path, help="write a cProfile of the stack's process over the runs here")
    args = parser.parse_args(argv)
    kind = "cross-cell" if args.cross_cell else "same-cell"
    target_ms = 2 if args.cross_cell else 1
    print_header(f"orchestration: {kind} resize to VERIFY_RESIZE on the local stack, {args.runs} runs")

    from ferry.local.stack import POLICY_FILE_PARAMETER, LocalStack
    from ferry.observability import logger

    logger.setLevel("WARNING")
    with tempfile.TemporaryDirectory(prefix="ferry-bench-stack-") as tmp:
        started = time.perf_counter()
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(json.dumps({CROSS_CELL_RULE: "admin_or_owner"} if args.cross_cell else {}) + "\n")
        stack = LocalStack(Path(tmp) / "stack", cells=2 if args.cross_cell else 1,
                           hosts_per_cell=1 if args.cross_cell else 2, moto_port=0, api_port=0,
                           agent_mode=args.agent_mode, host_op_timeout_seconds=60, host_op_heartbeat_seconds=30,
                           parameters={POLICY_FILE_PARAMETER: str(policy)})
        stack.start()
        try:
            print(f"  stack up in {time.perf_counter() - started:.1f} s (agents as {args.agent_mode}es)", flush=True)
            cloud = Cloud(stack)
            target_flavor, far = SMALL, ""
            if args.cross_cell:
                [far] = [h for h, c in stack.seeded.hosts.items() if c == "cell2"]
                target_flavor = cloud.generation_flavor("cell2")
                cloud.set_enabled(far, False)
                server_id = cloud.boot()
                cloud.set_enabled(far, True)
            else:
                server_id = cloud.boot()
            profiler = None
            if args.profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            totals, per_state, seen = [], defaultdict(list), set()
            for run in range(args.runs):
                begun = time.perf_counter()
                cloud.action(server_id, {"resize": {"flavorRef": target_flavor}})
                resized = cloud.wait_for(server_id, "VERIFY_RESIZE")
                totals.append(time.perf_counter() - begun)
                if args.cross_cell and resized["OS-EXT-SRV-ATTR:host"] != far:
                    raise RuntimeError(f"the resize stayed on {resized['OS-EXT-SRV-ATTR:host']}, not {far}")
                arn = cloud.latest_resize_execution(server_id, seen)
                if arn:
                    seen.add(arn)
                    for state, seconds in cloud.state_durations(arn).items():
                        per_state[state].append(seconds)
                print(f"  run {run + 1:3d}: {totals[-1]:6.2f} s", flush=True)
                cloud.action(server_id, {"revertResize": None})
                cloud.wait_for(server_id, "ACTIVE")
            if profiler:
                profiler.disable()
                args.profile.parent.mkdir(parents=True, exist_ok=True)
                profiler.dump_stats(str(args.profile))
                print(f"  profile of the stack's process: {args.profile}")
        finally:
            stack.stop()
    figures = summary(totals)
    print(f"\n  API call -> VERIFY_RESIZE: median {figures['p50']:.2f} s, p95 {figures['p95']:.2f} s, "
          f"min {figures['min']:.2f} s, max {figures['max']:.2f} s "
          f"(target: median under {target_ms} s: {'met' if figures['p50'] < target_ms else 'missed'})")
    print(f"\n  time per state of the resize workflow ({len(per_state and next(iter(per_state.values())))} "
          f"executions read):")
    print(f"    {'state':<36} {'median':>8} {'p95':>8}")
    for state, samples in sorted(per_state.items(), key=lambda item: -summary(item[1])["p50"]):
        s = summary(samples)
        print(f"    {state:<36} {s['p50']:7.2f}s {s['p95']:7.2f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("POWERTOOLS_METRICS_DISABLED", "true")
    sys.exit(main())
