#!/usr/bin/env python3
"""Benchmark the server list: a page of ``GET /servers/detail`` over 10,000 to 100,000 servers.

For each size, builds a throw-away store (SQLite files in a temporary directory, and PostgreSQL
databases too when FERRY_TEST_PG_URL is set) with that many servers spread over the cells and
over 50 projects, then times :func:`ferry.compute.api.list_servers` in its default order (newest
first) for a page of 1,000 of every project's (an admin's ``--all-projects``) from the start and
from a marker half-way down, and a page of one project's; and, for comparison, the same first
page sorted by a key the default order does not use (``display_name``), which reads every server.
Prints p50/p95/max in milliseconds.

    .venv/bin/python scripts/bench/bench_list.py [--servers 10000,100000] [--cells 2] [--runs 10]
        [--backends sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import insert, select

from ferry.auth import RequestContext
from ferry.compute import api as compute_api
from ferry.compute.server_filters import ServerFilters
from ferry.observability import logger
from ferry.store import db
from ferry.store.api_models import CellMapping, InstanceMapping, utcnow
from ferry.store.cell_models import Instance

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scheduler  # noqa: E402 - the sibling modules of this script
from bench_scheduler import settle, stores, time_runs  # noqa: E402
from machine import print_header  # noqa: E402

PROJECTS = 50
FLAVOR = {"id": 1, "flavorid": "b1", "name": "bench.medium", "vcpus": 2, "memory_mb": 4096, "root_gb": 40}
ADMIN = RequestContext(user_id="bench", project_id="admin", roles=("admin",))
MEMBER = RequestContext(user_id="bench", project_id="project-7", roles=("member",))


def populate(servers: int, cells: tuple[str, ...]) -> list[str]:
    """``servers`` servers over ``cells`` and the projects, one a second apart (bulk inserts); their
    uuids, newest first."""
    with db.api_session() as session:
        cell_ids = {c.name: c.id for c in session.scalars(select(CellMapping).where(CellMapping.name.in_(cells)))}
    start = utcnow()
    rows = [(str(uuid.uuid4()), cells[n % len(cells)], f"project-{n % PROJECTS}",
             start - dt.timedelta(seconds=servers - n)) for n in range(servers)]
    for offset in range(0, servers, 5000):
        chunk = rows[offset:offset + 5000]
        with db.api_session() as session:
            session.execute(insert(InstanceMapping), [
                {"instance_uuid": u, "cell_id": cell_ids[cell], "project_id": project, "user_id": "bench",
                 "queued_for_delete": False} for u, cell, project, _at in chunk])
        for cell in cells:
            with db.cell_session(cell) as session:
                session.execute(insert(Instance), [
                    {"uuid": u, "project_id": project, "user_id": "bench", "display_name": f"vm-{u[:8]}",
                     "vm_state": "active", "power_state": 1, "host": f"{cell}-host1", "node": f"{cell}-host1",
                     "flavor": FLAVOR, "created_at": at} for u, c, project, at in chunk if c == cell])
    return [u for u, _cell, _project, _at in reversed(rows)]


def bench(backend: str, servers: int, cells: tuple[str, ...], runs: int) -> None:
    started = time.perf_counter()
    newest_first = populate(servers, cells)
    settle()
    print(f"{backend}: {servers} servers in {len(cells)} cells and {PROJECTS} projects built in "
          f"{time.perf_counter() - started:.1f} s; {runs} runs each", flush=True)
    every = ServerFilters(all_tenants=True, limit=1000)
    middle = newest_first[len(newest_first) // 2]
    time_runs("all projects, first page", runs, lambda: compute_api.list_servers(ADMIN, every))
    time_runs("all projects, page half-way", runs,
              lambda: compute_api.list_servers(ADMIN, dataclasses.replace(every, marker=middle)))
    time_runs("one project, first page", runs, lambda: compute_api.list_servers(MEMBER, ServerFilters(limit=1000)))
    time_runs("all projects by name (reads all)", max(1, runs // 5),
              lambda: compute_api.list_servers(ADMIN, dataclasses.replace(every, sort=(("display_name", "asc"),))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="10000,100000", help="comma-separated server counts")
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--backends", default="sqlite,postgresql")
    args = parser.parse_args(argv)
    cells = tuple(f"cell{n}" for n in range(1, args.cells + 1))
    bench_scheduler.CELLS = cells  # what its settle() and postgres_databases() go through
    logger.setLevel("WARNING")
    backends = args.backends.split(",")
    pg_url = os.environ.get("FERRY_TEST_PG_URL")
    print_header("server list: a page of GET /servers/detail", pg_url)
    for servers in (int(n) for n in args.servers.split(",")):
        for backend in stores(backends, cells, pg_url):
            bench(backend, servers, cells, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
