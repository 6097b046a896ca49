"""Concurrent claims on PostgreSQL: racing writers never over-commit a provider, and the used counters
stay equal to the allocations."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from placement_helpers import (
    PROJECT,
    USER,
    add_compute,
    assert_used_counters_match_allocations,
    flavor,
    request_spec,
    resources,
)

from ferry import errors, placement, scheduler
from ferry.placement import VCPU

RACERS = 20


def _claim_last_slot(rp_uuid: str, barrier) -> str:  # noqa: ANN001 - a threading or manager barrier
    """Claim one vCPU for a fresh consumer once every racer is ready; report how it went."""
    barrier.wait(timeout=60)
    try:
        placement.claim(str(uuid.uuid4()), PROJECT, USER, {rp_uuid: {VCPU: 1}})
    except errors.InsufficientCapacity:
        return "full"
    return "claimed"


def _fill_all_but_one(rp_uuid: str) -> None:
    placement.claim(str(uuid.uuid4()), PROJECT, USER, {rp_uuid: resources(vcpus=7, memory_mb=1024, disk_gb=1)})


def test_twenty_threads_racing_for_the_last_vcpu_only_one_wins(pg_store):
    rp = add_compute("host-a", vcpus=8)
    _fill_all_but_one(rp)
    barrier = threading.Barrier(RACERS)

    with ThreadPoolExecutor(max_workers=RACERS) as pool:
        outcomes = list(pool.map(lambda _: _claim_last_slot(rp, barrier), range(RACERS)))

    assert outcomes.count("claimed") == 1
    assert outcomes.count("full") == RACERS - 1
    assert placement.usages(rp)[VCPU] == 8
    assert_used_counters_match_allocations()


def test_processes_racing_for_the_last_vcpu_only_one_wins(pg_store):
    rp = add_compute("host-a", vcpus=8)
    _fill_all_but_one(rp)
    racers = 6
    # Spawned workers start clean (no inherited connections) and read the store from the environment.
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(racers)
        with ProcessPoolExecutor(max_workers=racers, mp_context=context) as pool:
            outcomes = list(pool.map(_claim_last_slot, [rp] * racers, [barrier] * racers))

    assert outcomes.count("claimed") == 1
    assert placement.usages(rp)[VCPU] == 8
    assert_used_counters_match_allocations()


def test_concurrent_moves_and_claims_keep_usage_within_capacity(pg_store):
    # Ten instances on host-a move to host-b (4 vCPU free) while ten fresh claims race for host-b too.
    source = add_compute("host-a", vcpus=32)
    dest = add_compute("host-b", vcpus=4)
    instances = [str(uuid.uuid4()) for _ in range(10)]
    for instance in instances:
        placement.claim(instance, PROJECT, USER, {source: {VCPU: 1}})
    barrier = threading.Barrier(20)

    def move(instance: str) -> str:
        barrier.wait(timeout=60)
        try:
            placement.claim_for_move(instance, str(uuid.uuid4()), PROJECT, USER, {dest: {VCPU: 1}})
        except errors.InsufficientCapacity:
            return "full"
        return "claimed"

    def fresh(_: int) -> str:
        return _claim_last_slot(dest, barrier)

    with ThreadPoolExecutor(max_workers=20) as pool:
        moved = [pool.submit(move, instance) for instance in instances]
        claimed = [pool.submit(fresh, n) for n in range(10)]
        outcomes = [f.result() for f in moved + claimed]

    assert outcomes.count("claimed") == 4
    assert placement.usages(dest)[VCPU] == 4
    assert placement.usages(source)[VCPU] == 10
    assert_used_counters_match_allocations()


def test_concurrent_scheduling_fills_hosts_exactly_to_capacity(pg_store):
    # Four hosts with room for two servers each; twelve requests at once: eight land, four find no host.
    providers = [add_compute(f"host-{n}", vcpus=2, memory_mb=4096, disk_gb=40) for n in range(4)]
    barrier = threading.Barrier(12)

    def schedule(_: int) -> str:
        barrier.wait(timeout=60)
        try:
            scheduler.select_destinations(request_spec(flavor=flavor(vcpus=1, memory_mb=1024, root_gb=10)))
        except errors.NoValidHost:
            return "no host"
        return "claimed"

    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(schedule, range(12)))

    assert outcomes.count("claimed") == 8
    assert [placement.usages(rp)[VCPU] for rp in providers] == [2, 2, 2, 2]
    assert_used_counters_match_allocations()
