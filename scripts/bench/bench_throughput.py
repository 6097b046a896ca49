#!/usr/bin/env python3
"""Benchmark throughput: many resizes at once on the local stack, confirmed, then audit.

Brings up the local stack in a temporary directory on free ports (``--cells`` × ``--hosts``
hosts, agents as processes), lifts the admin project's quota, boots ``--servers`` tiny servers
(the scheduler spreads them), then asks for all their resizes to ``--flavor`` at once (one
thread per request, ``--clients`` at a time) and waits until every server waits in
VERIFY_RESIZE; confirms them all and waits until they are ACTIVE. Prints moves per minute
(from the first resize request to the last server in VERIFY_RESIZE), each move's median and p95,
the time every state of the resize workflow took summed over all executions (the step that
limits the rate is at the top), and what ``ferry audit`` finds afterwards (it must be nothing).

    .venv/bin/python scripts/bench/bench_throughput.py [--servers 200] [--cells 2] [--hosts 10]
        [--flavor 2] [--clients 50]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_drain import Cloud  # noqa: E402 - the sibling modules of this script
from machine import print_header  # noqa: E402
from stats import summary  # noqa: E402

SMALL = "2"


def wait_all(cloud: Cloud, server_ids: list[str], status: str, timeout: float) -> dict[str, float]:
    """Poll until every server shows ``status`` with no task; returns when each got there (perf_counter)."""
    reached: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(reached) < len(server_ids):
        listed = cloud.call("GET", "/servers/detail?all_tenants=1&limit=1000", (200,))["servers"]
        now = time.perf_counter()
        for server in listed:
            if server["id"] in reached or server["id"] not in server_ids:
                continue
            if server["status"] == "ERROR":
                raise RuntimeError(f"server {server['id']} went to ERROR: {server.get('fault')}")
            if server["status"] == status and server["OS-EXT-STS:task_state"] is None:
                reached[server["id"]] = now
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(server_ids) - len(reached)} servers not {status} after {timeout} s")
        time.sleep(0.5)
    return reached


def state_times(stack: Any, since: float) -> dict[str, list[float]]:
    """Seconds each state of the resize workflow took (entered → exited), per state, over its executions."""
    from ferry import config

    sfn = stack.aws.client("stepfunctions")
    arn = config.get().resize_state_machine_arn
    times: dict[str, list[float]] = defaultdict(list)
    for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=arn):
        for execution in page["executions"]:
            if execution["startDate"].timestamp() < since:
                continue
            entered: dict[str, Any] = {}
            history = sfn.get_paginator("get_execution_history").paginate(executionArn=execution["executionArn"])
            for event in (e for p in history for e in p["events"]):
                if "stateEnteredEventDetails" in event:
                    entered[event["stateEnteredEventDetails"]["name"]] = event["timestamp"]
                elif "stateExitedEventDetails" in event:
                    name = event["stateExitedEventDetails"]["name"]
                    if name in entered:
                        times[name].append((event["timestamp"] - entered.pop(name)).total_seconds())
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=200)
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=10, help="hosts per cell")
    parser.add_argument("--flavor", default=SMALL, help="flavor to resize to (moves stay in their cell)")
    parser.add_argument("--clients", type=int, default=50, help="resize requests in flight at once")
    args = parser.parse_args(argv)
    print_header(f"throughput: {args.servers} concurrent resizes on {args.cells} cells x {args.hosts} hosts")

    from ferry import audit
    from ferry.local.stack import LocalStack
    from ferry.observability import logger

    logger.setLevel("WARNING")
    with tempfile.TemporaryDirectory(prefix="ferry-bench-throughput-") as tmp:
        started = time.perf_counter()
        stack = LocalStack(Path(tmp), cells=args.cells, hosts_per_cell=args.hosts, moto_port=0, api_port=0,
                           agent_mode="process", host_op_timeout_seconds=600, host_op_heartbeat_seconds=120)
        stack.start()
        try:
            print(f"  stack up in {time.perf_counter() - started:.1f} s", flush=True)
            cloud = Cloud(stack)
            server_ids = cloud.boot_many(args.servers)
            since = time.time()
            begun = time.perf_counter()
            asked: dict[str, float] = {}

            def resize(server_id: str) -> None:
                asked[server_id] = time.perf_counter()
                cloud.call("POST", f"/servers/{server_id}/action", (202,), json={"resize": {"flavorRef": args.flavor}})

            with ThreadPoolExecutor(max_workers=args.clients) as pool:
                list(pool.map(resize, server_ids))
            reached = wait_all(cloud, server_ids, "VERIFY_RESIZE", timeout=60 * 60)
            elapsed = max(reached.values()) - begun
            for server_id in server_ids:
                cloud.call("POST", f"/servers/{server_id}/action", (204,), json={"confirmResize": None})
            wait_all(cloud, server_ids, "ACTIVE", timeout=30 * 60)
            per_state = state_times(stack, since)
            problems = audit.run_audit(grace_seconds=0).problems
        finally:
            stack.stop()
    moves = summary([reached[s] - asked[s] for s in server_ids])
    print(f"\n  {len(server_ids)} resizes to VERIFY_RESIZE in {elapsed:.1f} s = "
          f"{len(server_ids) / elapsed * 60:.1f} moves per minute")
    print(f"  one resize, request to VERIFY_RESIZE: median {moves['p50']:.2f} s, p95 {moves['p95']:.2f} s")
    print("  time per state, summed over all executions (median per execution):")
    for name, seconds in sorted(per_state.items(), key=lambda item: -sum(item[1]))[:10]:
        print(f"    {name:32} {sum(seconds):8.1f} s  (median {summary(seconds)['p50']:.2f} s)")
    print(f"  ferry audit afterwards: {len(problems)} problem(s)")
    for problem in problems[:10]:
        print(f"    {problem}")
    return 0 if not problems else 1


if __name__ == "__main__":
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    sys.exit(main())
