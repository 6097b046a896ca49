#!/usr/bin/env python3
"""Benchmark a drain: empty hosts of the local stack, servers moved and confirmed, then audit.

Brings up the local stack in a temporary directory on free ports (``--cells`` × ``--hosts``
hosts, agents as processes), boots ``--servers`` tiny servers onto the first ``--drain-hosts``
hosts (the other hosts disabled meanwhile, as an operator steers them; a local host holds 32
tiny servers unless ``--host-*`` make it bigger), lifts the admin project's quota for the run,
and drains those hosts through ``POST /ferry/drains`` with ``--concurrency``. Prints the
drain's total time, moves per minute, the median and p95 of each server's move (from its
``started_at`` to ``finished_at``), and what ``ferry audit`` finds afterwards (it must be nothing).

    .venv/bin/python scripts/bench/bench_drain.py [--servers 100] [--drain-hosts 5] [--concurrency 20]
        [--cells 2] [--hosts 10] [--host-vcpus 8] [--host-memory-mb 16384] [--host-disk-gb 200]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import print_header  # noqa: E402 - the sibling modules of this script
from stats import summary  # noqa: E402

TINY = "1"
POLL = 0.5
MAX_POLL_ERRORS = 20
SERVICES = {"OpenStack-API-Version": "compute 2.53"}


class Cloud:
    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.api = requests.Session()
        self.api.headers["X-Auth-Token"] = stack.seeded.tokens["admin"]
        self.api.headers["OpenStack-API-Version"] = "compute latest"

    def url(self, path: str) -> str:
        return self.stack.api_url + path

    def call(self, method: str, path: str, expected: tuple[int, ...], **kwargs: Any) -> Any:
        response = self.api.request(method, self.url(path), timeout=60, **kwargs)
        if response.status_code not in expected:
            raise RuntimeError(f"{method} {path} answered {response.status_code}: {response.text}")
        return response.json() if response.content else None

    def set_hosts_enabled(self, hosts: list[str], enabled: bool) -> None:
        services = self.call("GET", "/os-services", (200,), headers=SERVICES)["services"]
        for service in services:
            if service["host"] in hosts:
                body = {"status": "enabled"} if enabled else {"status": "disabled", "disabled_reason": "bench"}
                self.call("PUT", f"/os-services/{service['id']}", (200,), json=body, headers=SERVICES)

    def boot_many(self, count: int, batch: int = 20) -> list[str]:
        ids: list[str] = []
        project = self.stack.seeded.identities["admin"].project_id
        self.call("PUT", f"/os-quota-sets/{project}", (200,),
                  json={"quota_set": {"instances": -1, "cores": -1, "ram": -1}})
        while len(ids) < count:
            wave = []
            for index in range(min(batch, count - len(ids))):
                body = {"server": {"name": f"bench-{len(ids) + index}", "flavorRef": TINY,
                                   "imageRef": self.stack.seeded.image["id"], "networks": "auto"}}
                wave.append(self.call("POST", "/servers", (202,), json=body)["server"]["id"])
            for server_id in wave:
                self.wait_status(server_id, "ACTIVE")
            ids.extend(wave)
            print(f"  booted {len(ids)}/{count}", flush=True)
        return ids

    def wait_status(self, server_id: str, status: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            server = self.call("GET", f"/servers/{server_id}", (200,))["server"]
            if server["status"] == status and server["OS-EXT-STS:task_state"] is None:
                return
            if server["status"] == "ERROR" or time.monotonic() > deadline:
                raise RuntimeError(f"server {server_id} is {server['status']}: {server.get('fault')}")
            time.sleep(POLL)


def _seconds(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    parse = lambda value: dt.datetime.fromisoformat(value.rstrip("Z"))  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=100)
    parser.add_argument("--drain-hosts", type=int, default=5, help="hosts to drain (the servers boot on them)")
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=10, help="hosts per cell")
    parser.add_argument("--host-vcpus", type=int, default=None, help="each host's vCPUs (default: the local "
                        "stack's small hypervisor, 8)")
    parser.add_argument("--host-memory-mb", type=int, default=None, help="each host's memory (default 16384)")
    parser.add_argument("--host-disk-gb", type=int, default=None, help="each host's disk (default 200)")
    args = parser.parse_args(argv)
    print_header(f"drain: {args.servers} servers off {args.drain_hosts} hosts of {args.cells} cells x "
                 f"{args.hosts} hosts, concurrency {args.concurrency}")

    from ferry import audit
    from ferry.local.stack import LocalStack, default_host_capacity
    from ferry.observability import logger
    from hostagent.driver import HostCapacity

    logger.setLevel("WARNING")
    small = default_host_capacity()
    capacity = HostCapacity(args.host_vcpus or small.vcpus, args.host_memory_mb or small.memory_mb,
                            args.host_disk_gb or small.disk_gb)
    print(f"  each host: {capacity.vcpus} vCPUs, {capacity.memory_mb} MiB, {capacity.disk_gb} GB")
    with tempfile.TemporaryDirectory(prefix="ferry-bench-drain-") as tmp:
        started = time.perf_counter()
        stack = LocalStack(Path(tmp), cells=args.cells, hosts_per_cell=args.hosts, moto_port=0, api_port=0,
                           agent_mode="process", host_op_timeout_seconds=300, host_op_heartbeat_seconds=60,
                           parameters={"DrainPollSeconds": 1}, host_capacity=capacity)
        stack.start()
        failed = False
        poll_errors: list[str] = []
        try:
            print(f"  stack up in {time.perf_counter() - started:.1f} s", flush=True)
            cloud = Cloud(stack)
            hosts = sorted(stack.seeded.hosts)
            sources, others = hosts[:args.drain_hosts], hosts[args.drain_hosts:]
            cloud.set_hosts_enabled(others, False)
            try:
                cloud.boot_many(args.servers)
            finally:
                cloud.set_hosts_enabled(others, True)
            begun = time.perf_counter()
            drain = cloud.call("POST", "/ferry/drains", (202,),
                               json={"drain": {"hosts": sources, "max_concurrency": args.concurrency,
                                               "reason": "benchmark"}})["drain"]
            while True:
                try:
                    view = cloud.call("GET", f"/ferry/drains/{drain['id']}", (200,))["drain"]
                except RuntimeError as exc:  # as an operator's poll would, try again; reported below
                    poll_errors.append(str(exc))
                    if len(poll_errors) > MAX_POLL_ERRORS:
                        raise
                    time.sleep(POLL)
                    continue
                if view["status"] in ("completed", "failed", "cancelled"):
                    break
                time.sleep(POLL)
            elapsed = time.perf_counter() - begun
            problems = audit.run_audit(grace_seconds=0).problems
        except BaseException:
            failed = True
            raise
        finally:
            stack.stop()
            if failed or poll_errors:
                kept = Path(tempfile.gettempdir()) / f"ferry-bench-drain-logs-{int(time.time())}"
                shutil.copytree(stack.logs_dir, kept, dirs_exist_ok=True)
                print(f"  the stack's logs are kept in {kept}", flush=True)
    moves = [s for s in (_seconds(x["started_at"], x["finished_at"]) for x in view["servers"]) if s is not None]
    figures = summary(moves) if moves else {"p50": 0.0, "p95": 0.0}
    counts = view["counts"]
    print(f"\n  drain {view['status']}: {counts['done']}/{counts['total']} moved, {counts['failed']} failed, "
          f"in {elapsed:.1f} s = {counts['done'] / elapsed * 60:.1f} moves per minute")
    print(f"  one server's move and confirm: median {figures['p50']:.2f} s, p95 {figures['p95']:.2f} s")
    print(f"  ferry audit afterwards: {len(problems)} problem(s)")
    for problem in problems[:10]:
        print(f"    {problem}")
    print(f"  polls of the drain that failed: {len(poll_errors)}")
    for error in poll_errors[:5]:
        print(f"    {error}")
    return 0 if view["status"] == "completed" and not problems else 1


if __name__ == "__main__":
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    sys.exit(main())
