#!/usr/bin/env python3
"""Benchmark the scheduler: select_destinations for one request over 1,000 to 100,000 compute hosts.

For each size, builds a throw-away store (SQLite files in a temporary directory, and PostgreSQL
databases too when FERRY_TEST_PG_URL is set, e.g. ``postgresql+psycopg2://ferry@127.0.0.1:55432/``),
fills it with hosts spread over the cells (10 by default), their inventories, services, two
aggregates and five existing instances' allocations per host (with the inventories' ``used``
counters to match), then times ``select_destinations`` without the claim, with an aggregate extra
spec, and with the claim, and prints p50/p95/max in milliseconds and the median CPU time of this
process per call. Before timing, the process's heap is frozen (``gc.freeze``) as a Ferry function's
is on its first invocation; ``--no-freeze`` measures without.

    .venv/bin/python scripts/bench/bench_scheduler.py [--hosts 1000,10000,100000] [--cells 10] [--runs 30]
        [--backends sqlite,postgresql] [--max-placement-results N] [--profile DIR] [--no-freeze]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, insert, select, text, update

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import print_header  # noqa: E402 - the sibling modules of this script
from stats import summary  # noqa: E402

INSTANCES_PER_HOST = 5
INSTANCE_USAGE = {placement.VCPU: 2, placement.MEMORY_MB: 4096, placement.DISK_GB: 40}
CELLS: tuple[str, ...] = ()  # set by main() from --cells


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
                                       "allocation_ratio": ratio,
                                       "used": INSTANCES_PER_HOST * INSTANCE_USAGE[rc]})
            for _ in range(INSTANCES_PER_HOST):
                consumer = str(uuid.uuid4())
                for rc, used in INSTANCE_USAGE.items():
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


def settle() -> None:
    """Bring the freshly loaded store to a steady state before timing, as a running cloud's would be.

    Right after the bulk load, SQLite reads pages through a large write-ahead log until it is
    checkpointed, and PostgreSQL's autovacuum works through the new tables while the series run;
    both made the first series of a size the slowest.
    """
    urls = [config.get().api_database_url, *(db.cell_url(cell) for cell in CELLS)]
    for url in urls:
        engine = db.engine_for(url)
        if engine.dialect.name == "sqlite":
            raw = engine.raw_connection()  # outside any transaction: a checkpoint cannot run inside one
            try:
                raw.cursor().execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                raw.close()
        else:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.exec_driver_sql("VACUUM ANALYZE")


def touch_services() -> None:
    """Mark every compute service as seen now, so none is down (by heartbeat age) while a large run lasts."""
    now = utcnow()
    for cell in CELLS:
        with db.cell_session(cell) as session:
            session.execute(update(Service).values(last_seen_at=now))


def spec(extra_specs: dict[str, str] | None = None) -> dict:
    return {
        "instance_uuid": str(uuid.uuid4()), "project_id": "bench", "user_id": "bench",
        "flavor": {"flavorid": "b1", "name": "bench.medium", "vcpus": 2, "memory_mb": 4096, "root_gb": 40,
                   "ephemeral_gb": 0, "swap": 0, "extra_specs": extra_specs or {}},
        "is_bfv": False, "ignore_hosts": [], "requested_destination": None, "allowed_cells": None,
        "scheduler_hints": {}, "group": None,
    }


def time_runs(label: str, runs: int, call) -> dict[str, float]:  # noqa: ANN001 - a zero-argument callable
    """Time ``runs`` calls after one warm-up: wall-clock p50/p95/max, and the median CPU time of this process.

    The CPU time leaves out what other processes take from a shared machine (and PostgreSQL's own
    work, which runs in the server), so it is the steadier figure when the load is high.
    """
    touch_services()
    call()  # warm-up: the first call pays for connections and statement compilation
    samples, cpu = [], []
    for _ in range(runs):
        started, started_cpu = time.perf_counter(), time.process_time()
        call()
        samples.append((time.perf_counter() - started) * 1000)
        cpu.append((time.process_time() - started_cpu) * 1000)
    figures = summary(samples)
    figures["cpu_p50"] = summary(cpu)["p50"]
    print(f"  {label:<34} p50 {figures['p50']:8.1f} ms   p95 {figures['p95']:8.1f} ms   max {figures['max']:8.1f} ms"
          f"   cpu p50 {figures['cpu_p50']:7.1f} ms", flush=True)
    return figures


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
    try:
        with admin.connect() as conn:
            for name in names.values():
                conn.execute(text(f"CREATE DATABASE {name}"))
        yield {kind: base_url + name for kind, name in names.items()}
    finally:
        db.dispose_all()
        with admin.connect() as conn:
            for name in names.values():
                conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


def stores(backends: list[str], cells: tuple[str, ...], pg_url: str | None) -> Iterator[str]:
    """Configure a throw-away store of ``cells`` for each backend asked for, in turn; yields the
    backend's name while it is configured (PostgreSQL skipped, said, without ``pg_url``)."""
    if "sqlite" in backends:
        with tempfile.TemporaryDirectory(prefix="ferry-bench-") as tmp:
            state = Path(tmp)
            urls = {name: f"sqlite:///{state / f'cell-{name}.sqlite'}" for name in cells}
            with configured(f"sqlite:///{state / 'api.sqlite'}", urls, state):
                yield "sqlite"
    if "postgresql" not in backends:
        return
    if not pg_url:
        print("postgresql: skipped (set FERRY_TEST_PG_URL to include it)")
        return
    with tempfile.TemporaryDirectory(prefix="ferry-bench-") as tmp, postgres_databases(pg_url) as pg_urls:
        with configured(pg_urls["api"], {c: pg_urls[c] for c in cells}, Path(tmp)):
            yield "postgresql"


def bench(backend: str, hosts: int, runs: int, profile: Path | None = None, freeze: bool = True) -> None:
    started = time.perf_counter()
    populate(hosts)
    settle()
    gc.collect()
    if freeze:  # what a Ferry function does with its startup heap on its first invocation (ferry.handlers)
        gc.freeze()
    print(f"{backend}: {hosts} hosts in {len(CELLS)} cells built and settled in "
          f"{time.perf_counter() - started:.1f} s; {runs} runs each", flush=True)
    time_runs("select_destinations(claim=False)", runs, lambda: scheduler.select_destinations(spec(), claim=False))
    time_runs("with aggregate extra spec", runs,
              lambda: scheduler.select_destinations(spec({"hw_generation": "gen2"}), claim=False))
    time_runs("select_destinations(claim=True)", runs, lambda: scheduler.select_destinations(spec()))
    if profile is not None:
        import cProfile
        import pstats

        out = profile / f"scheduler-{backend}-{hosts}.prof"
        cProfile.runctx("scheduler.select_destinations(spec())", globals(), {"spec": spec}, str(out))
        print(f"  profile of one claimed call: {out}")
        pstats.Stats(str(out)).sort_stats("cumulative").print_stats(15)
    gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    global CELLS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1000,10000", help="comma-separated host counts (default 1000,10000)")
    parser.add_argument("--cells", type=int, default=10)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--profile", type=Path, help="write a cProfile of one claimed call per size here")
    parser.add_argument("--max-placement-results", type=int,
                        help="placement's batch of candidates (FERRY_MAX_PLACEMENT_RESULTS; default: the setting's)")
    parser.add_argument("--no-freeze", dest="freeze", action="store_false",
                        help="leave the process's objects to the collector's full passes (as before ferry.handlers "
                             "froze the startup heap)")
    args = parser.parse_args(argv)
    if args.max_placement_results is not None:
        os.environ["FERRY_MAX_PLACEMENT_RESULTS"] = str(args.max_placement_results)
    CELLS = tuple(f"cell{n}" for n in range(1, args.cells + 1))
    logger.setLevel("WARNING")  # the per-stage scheduler logs would drown the numbers
    backends = args.backends.split(",")
    pg_url = os.environ.get("FERRY_TEST_PG_URL")
    print_header("scheduler: select_destinations", pg_url)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    for hosts in (int(h) for h in args.hosts.split(",")):
        for backend in stores(backends, CELLS, pg_url):
            bench(backend, hosts, args.runs, args.profile, args.freeze)
    return 0


if __name__ == "__main__":
    sys.exit(main())
