#!/usr/bin/env python3
"""Benchmark the scheduler: select_destinations over a cloud of 2,000 compute hosts.

Builds a throw-away store (SQLite files in a temporary directory, and a PostgreSQL database
too when FERRY_TEST_PG_URL is set, e.g. ``postgresql+psycopg2://ferry@127.0.0.1:55432/``),
fills it with hosts spread over two cells, their inventories, services, a few aggregates and
some existing allocations, then times ``select_destinations`` with and without the claim and
prints p50/p95 in milliseconds.

    .venv/bin/python scripts/bench/bench_scheduler.py [--hosts 2000] [--runs 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, insert, select, text

from ferry import config, placement, scheduler
from ferry.observability import logger
from ferry.store import db, setup
from ferry.store.api_models import (
    Aggregate,
    AggregateHost,
    AggregateMetadata,
    Allocation,
    CellMapping,
    HostMapping,
    Inventory,
    ResourceProvider,
    utcnow,
)
from ferry.store.cell_models import Service

CELLS = ("cell1", "cell2")
INSTANCES_PER_HOST = 5


def populate(hosts: int) -> None:
    """Map ``hosts`` compute hosts over the cells with inventory, services and allocations (bulk inserts)."""
    now = utcnow()
    with db.api_session() as session:
        cell_ids = dict(session.execute(select(CellMapping.name, CellMapping.id)).all())
        names = [f"compute-{n:05d}" for n in range(hosts)]
        cell_of = {name: CELLS[n % len(CELLS)] for n, name in enumerate(names)}
        session.execute(insert(HostMapping), [{"host": h, "cell_id": cell_ids[cell_of[h]], "created_at": now}
                                              for h in names])
        session.execute(insert(ResourceProvider), [
            {"uuid": str(uuid.uuid4()), "name": h, "host": h, "cell_id": cell_ids[cell_of[h]], "generation": 1,
             "created_at": now} for h in names])
        provider_ids = dict(session.execute(select(ResourceProvider.name, ResourceProvider.id)).all())
        inventory_rows, allocation_rows = [], []
        for n, h in enumerate(names):
            size = 1 + n % 4
            for rc, total, ratio in ((placement.VCPU, 16 * size, 4.0), (placement.MEMORY_MB, 32768 * size, 1.0),
                                     (placement.DISK_GB, 500 * size, 1.0)):
                inventory_rows.append({"resource_provider_id": provider_ids[h], "resource_class": rc, "total": total,
                                       "reserved": 0, "min_unit": 1, "max_unit": total, "step_size": 1,
                                       "allocation_ratio": ratio})
            for _ in range(INSTANCES_PER_HOST):
                consumer = str(uuid.uuid4())
                for rc, used in ((placement.VCPU, 2), (placement.MEMORY_MB, 4096), (placement.DISK_GB, 40)):
                    allocation_rows.append({"resource_provider_id": provider_ids[h], "consumer_uuid": consumer,
                                            "resource_class": rc, "used": used})
        session.execute(insert(Inventory), inventory_rows)
        session.execute(insert(Allocation), allocation_rows)
        for generation in ("gen1", "gen2"):
            aggregate = Aggregate(name=f"hw-{generation}")
            members = names[: hosts // 2] if generation == "gen1" else names[hosts // 2:]
            aggregate.hosts = [AggregateHost(host=h) for h in members]
            aggregate.metadata_items = [AggregateMetadata(key="hw_generation", value=generation)]
            session.add(aggregate)
    for cell in CELLS:
        with db.cell_session(cell) as session:
            session.execute(insert(Service), [
                {"uuid": str(uuid.uuid4()), "host": h, "binary": "ferry-compute", "disabled": n % 50 == 0,
                 "forced_down": False, "last_seen_at": now, "details": {}, "created_at": now}
                for n, h in enumerate(names) if cell_of[h] == cell])


def spec(extra_specs: dict[str, str] | None = None) -> dict:
    return {
        "instance_uuid": str(uuid.uuid4()), "project_id": "bench", "user_id": "bench",
        "flavor": {"flavorid": "b1", "name": "bench.medium", "vcpus": 2, "memory_mb": 4096, "root_gb": 40,
                   "ephemeral_gb": 0, "swap": 0, "extra_specs": extra_specs or {}},
        "is_bfv": False, "ignore_hosts": [], "requested_destination": None, "allowed_cells": None,
        "scheduler_hints": {}, "group": None,
    }


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def time_runs(label: str, runs: int, call) -> None:  # noqa: ANN001 - a zero-argument callable
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1000)
    print(f"  {label:<34} p50 {statistics.median(samples):8.1f} ms   p95 {percentile(samples, 0.95):8.1f} ms")


@contextmanager
def configured(api_url: str, cell_urls: dict[str, str], state_dir: Path) -> Iterator[None]:
    os.environ["FERRY_STATE_DIR"] = str(state_dir)
    os.environ["FERRY_API_DATABASE_URL"] = api_url
    config.reset()
    setup.init_api_database()
    for name, url in cell_urls.items():
        setup.create_cell(name, url)
    try:
        yield
    finally:
        db.dispose_all()
        config.reset()


@contextmanager
def postgres_databases(base_url: str) -> Iterator[dict[str, str]]:
    admin = create_engine(base_url + "postgres", isolation_level="AUTOCOMMIT")
    names = {kind: f"ferry_bench_{kind}_{uuid.uuid4().hex[:8]}" for kind in ("api", *CELLS)}
    with admin.connect() as conn:
        for name in names.values():
            conn.execute(text(f"CREATE DATABASE {name}"))
    try:
        yield {kind: base_url + name for kind, name in names.items()}
    finally:
        db.dispose_all()
        with admin.connect() as conn:
            for name in names.values():
                conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


def bench(backend: str, hosts: int, runs: int) -> None:
    started = time.perf_counter()
    populate(hosts)
    print(f"{backend}: {hosts} hosts built in {time.perf_counter() - started:.1f} s; {runs} runs each")
    time_runs("select_destinations(claim=False)", runs, lambda: scheduler.select_destinations(spec(), claim=False))
    time_runs("with aggregate extra spec", runs,
              lambda: scheduler.select_destinations(spec({"hw_generation": "gen2"}), claim=False))
    time_runs("select_destinations(claim=True)", runs, lambda: scheduler.select_destinations(spec()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    logger.setLevel("WARNING")  # the per-stage scheduler logs would drown the numbers

    with tempfile.TemporaryDirectory(prefix="ferry-bench-") as tmp:
        state = Path(tmp)
        cells = {name: f"sqlite:///{state / f'cell-{name}.sqlite'}" for name in CELLS}
        with configured(f"sqlite:///{state / 'api.sqlite'}", cells, state):
            bench("sqlite", args.hosts, args.runs)
        pg_url = os.environ.get("FERRY_TEST_PG_URL")
        if pg_url:
            with postgres_databases(pg_url) as urls:
                with configured(urls["api"], {c: urls[c] for c in CELLS}, state):
                    bench("postgresql", args.hosts, args.runs)
        else:
            print("postgresql: skipped (set FERRY_TEST_PG_URL to include it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
