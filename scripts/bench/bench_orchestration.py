#!/usr/bin/env python3
"""Benchmark orchestration overhead: same-cell resizes on the local stack, API call to VERIFY_RESIZE.

Brings up the local stack (``ferry.local.stack.LocalStack``) in a temporary directory on free
ports, one cell of two hosts, agents as processes (``--agent-mode thread`` for threads), boots
one tiny server and then, ``--runs`` times: resizes it to the small flavor through the compute
API (timed from the POST until the server shows VERIFY_RESIZE with no task), and reverts it to
the tiny flavor (untimed) so the next run starts alike. Each resize's execution history gives
the time spent in each state (entered to exited); the table shows each state's median and p95.

    .venv/bin/python scripts/bench/bench_orchestration.py [--runs 20] [--agent-mode process]
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--profile", type=Path, help="write a cProfile of the stack's process over the runs here")
    args = parser.parse_args(argv)
    print_header(f"orchestration: same-cell resize to VERIFY_RESIZE on the local stack, {args.runs} runs")

    from ferry.local.stack import LocalStack
    from ferry.observability import logger

    logger.setLevel("WARNING")
    with tempfile.TemporaryDirectory(prefix="ferry-bench-stack-") as tmp:
        started = time.perf_counter()
        stack = LocalStack(Path(tmp), cells=1, hosts_per_cell=2, moto_port=0, api_port=0,
                           agent_mode=args.agent_mode, host_op_timeout_seconds=60, host_op_heartbeat_seconds=30)
        stack.start()
        try:
            print(f"  stack up in {time.perf_counter() - started:.1f} s (agents as {args.agent_mode}es)", flush=True)
            cloud = Cloud(stack)
            server_id = cloud.boot()
            profiler = None
            if args.profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            totals, per_state, seen = [], defaultdict(list), set()
            for run in range(args.runs):
                begun = time.perf_counter()
                cloud.action(server_id, {"resize": {"flavorRef": SMALL}})
                cloud.wait_for(server_id, "VERIFY_RESIZE")
                totals.append(time.perf_counter() - begun)
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
          f"(target: median under 1 s: {'met' if figures['p50'] < 1 else 'missed'})")
    print(f"\n  time per state of the resize workflow ({len(per_state and next(iter(per_state.values())))} "
          f"executions read):")
    print(f"    {'state':<36} {'median':>8} {'p95':>8}")
    for state, samples in sorted(per_state.items(), key=lambda item: -summary(item[1])["p50"]):
        s = summary(samples)
        print(f"    {state:<36} {s['p50']:7.2f}s {s['p95']:7.2f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    sys.exit(main())
