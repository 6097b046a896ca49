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
from sqlalchemy import select

from ferry import config, errors, placement, scheduler
from ferry.compute import services
from ferry.placement import VCPU
from ferry.store.api_models import Allocation, ResourceProvider
from ferry.store.db import api_session

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


# --- generation conflicts are retried and lose nothing --------------------------------------------


def test_thirty_concurrent_claims_on_one_provider_all_land(pg_store):
    # Room for everyone: every writer but one per round loses the generation swap and must retry.
    rp = add_compute("host-a", vcpus=64)
    consumers = [str(uuid.uuid4()) for _ in range(30)]
    barrier = threading.Barrier(len(consumers))

    def claim(consumer: str) -> None:
        barrier.wait(timeout=60)
        placement.claim(consumer, PROJECT, USER, {rp: {VCPU: 1}})

    with ThreadPoolExecutor(max_workers=len(consumers)) as pool:
        list(pool.map(claim, consumers))

    assert placement.usages(rp)[VCPU] == len(consumers)
    assert all(placement.get_allocations(c) == {rp: {VCPU: 1}} for c in consumers)
    assert_used_counters_match_allocations()


def test_concurrent_claims_moves_reverts_and_confirms_keep_every_allocation(pg_store, monkeypatch):
    # On two providers at once: ten instances start a move to host-b (source handed to the
    # migration), ten moved ones revert (their migration's source allocation goes back to the
    # instance), ten moved ones confirm (the migration's allocation is dropped), ten fresh claims.
    # Forty writers released together: each round of conflicts has one winner per provider, so
    # the last of them may need some thirty attempts. What is checked here is that every write
    # lands and nothing is lost, so the retry budget covers the burst; giving up after the
    # configured retries is tested on its own.
    monkeypatch.setenv("FERRY_PLACEMENT_MAX_RETRIES", "40")
    config.reset()
    source = add_compute("host-a", vcpus=64)
    dest = add_compute("host-b", vcpus=64)
    old, new = {VCPU: 1}, {VCPU: 2}
    starting = [(str(uuid.uuid4()), str(uuid.uuid4())) for _ in range(10)]
    reverting = [(str(uuid.uuid4()), str(uuid.uuid4())) for _ in range(10)]
    confirming = [(str(uuid.uuid4()), str(uuid.uuid4())) for _ in range(10)]
    fresh = [str(uuid.uuid4()) for _ in range(10)]
    for instance, _ in starting:
        placement.claim(instance, PROJECT, USER, {source: old})
    for instance, migration in reverting + confirming:
        placement.claim(instance, PROJECT, USER, {source: old})
        placement.claim_for_move(instance, migration, PROJECT, USER, {dest: new})
    work = ([lambda i=i, m=m: placement.claim_for_move(i, m, PROJECT, USER, {dest: new}) for i, m in starting]
            + [lambda i=i, m=m: placement.move_allocations(m, i) for i, m in reverting]
            + [lambda m=m: placement.delete_allocations(m) for _, m in confirming]
            + [lambda c=c: placement.claim(c, PROJECT, USER, {source: old}) for c in fresh])
    barrier = threading.Barrier(len(work))

    def run(job) -> None:  # noqa: ANN001 - a closure
        barrier.wait(timeout=60)
        job()

    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        list(pool.map(run, work))

    for instance, migration in starting:
        assert placement.get_allocations(instance) == {dest: new}
        assert placement.get_allocations(migration) == {source: old}
    for instance, migration in reverting:
        assert placement.get_allocations(instance) == {source: old}
        assert placement.get_allocations(migration) == {}
    for instance, migration in confirming:
        assert placement.get_allocations(instance) == {dest: new}
        assert placement.get_allocations(migration) == {}
    for consumer in fresh:
        assert placement.get_allocations(consumer) == {source: old}
    # host-a: 10 migrations, 10 reverted instances, 10 fresh; host-b: 10 started, 10 confirmed.
    assert placement.usages(source)[VCPU] == 30
    assert placement.usages(dest)[VCPU] == 40
    assert_used_counters_match_allocations()


def _paused_after_reading(monkeypatch, reads: int):  # noqa: ANN001, ANN202 - pytest's monkeypatch
    """Make the next thread that calls ``pause.arm()`` stop after its ``reads``-th read of a
    consumer's allocations (first attempt only) until ``pause.release()``."""
    original = placement._allocations_of
    paused, go = threading.Event(), threading.Event()
    armed: dict[int, int] = {}

    def reading(session, consumer_uuid):  # noqa: ANN001, ANN202
        held = original(session, consumer_uuid)
        me = threading.get_ident()
        if me in armed:
            armed[me] += 1
            if armed[me] == reads:
                paused.set()
                assert go.wait(timeout=30)
        return held

    monkeypatch.setattr(placement, "_allocations_of", reading)

    class Pause:
        @staticmethod
        def arm() -> None:
            armed[threading.get_ident()] = 0

        @staticmethod
        def wait_until_paused() -> None:
            assert paused.wait(timeout=30)

        @staticmethod
        def release() -> None:
            go.set()

    return Pause


def _in_thread(job) -> tuple[threading.Thread, list[BaseException]]:  # noqa: ANN001
    failures: list[BaseException] = []

    def run() -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, failures


def test_a_move_does_not_hand_over_allocations_that_changed_after_it_read_them(pg_store, monkeypatch):
    # GIVEN an instance on host-a, and a move of its allocations to its migration that has read them
    source = add_compute("host-a", vcpus=16)
    dest = add_compute("host-b", vcpus=16)
    instance, migration = str(uuid.uuid4()), str(uuid.uuid4())
    placement.claim(instance, PROJECT, USER, {source: {VCPU: 1}})
    pause = _paused_after_reading(monkeypatch, reads=1)

    def move() -> None:
        pause.arm()
        placement.move_allocations(instance, migration)

    thread, failures = _in_thread(move)
    pause.wait_until_paused()
    # WHEN the instance's allocations change before the move writes
    placement.claim(instance, PROJECT, USER, {dest: {VCPU: 3}})
    pause.release()
    thread.join(timeout=60)

    # THEN the move hands over what the instance holds now: the committed claim is not lost
    assert failures == []
    assert placement.get_allocations(migration) == {dest: {VCPU: 3}}
    assert placement.get_allocations(instance) == {}
    assert placement.usages(dest)[VCPU] == 3
    assert VCPU not in placement.usages(source)
    assert_used_counters_match_allocations()


def test_a_step_delivered_twice_at_once_hands_the_source_to_the_migration_once(pg_store, monkeypatch):
    # GIVEN a claim for a move that has seen the migration holding nothing (reads=1), and the same
    # step delivered again, racing it to host-c
    source = add_compute("host-a", vcpus=16)
    dest_b = add_compute("host-b", vcpus=16)
    dest_c = add_compute("host-c", vcpus=16)
    instance, migration = str(uuid.uuid4()), str(uuid.uuid4())
    placement.claim(instance, PROJECT, USER, {source: {VCPU: 1}})
    pause = _paused_after_reading(monkeypatch, reads=1)

    def first_delivery() -> None:
        pause.arm()
        placement.claim_for_move(instance, migration, PROJECT, USER, {dest_b: {VCPU: 2}})

    thread, failures = _in_thread(first_delivery)
    pause.wait_until_paused()
    # WHEN the second delivery claims for the same migration first
    placement.claim_for_move(instance, migration, PROJECT, USER, {dest_c: {VCPU: 2}})
    pause.release()
    thread.join(timeout=60)

    # THEN the migration holds the source allocation (never a destination), the instance one destination
    assert failures == []
    assert placement.get_allocations(migration) == {source: {VCPU: 1}}
    assert placement.get_allocations(instance) == {dest_b: {VCPU: 2}}
    assert VCPU not in placement.usages(dest_c)
    assert_used_counters_match_allocations()


def test_deleting_a_consumer_s_allocations_while_its_first_claim_commits_leaves_no_phantom_usage(
    pg_store, monkeypatch
):
    """A consumer not yet recorded has no generation to swap: the delete sees the claim it did not read."""
    rp = add_compute("h1", vcpus=8)
    consumer = str(uuid.uuid4())
    read_generations = placement._read_provider_generations
    claimed = threading.Event()

    def claim_meanwhile(session, provider_ids):  # noqa: ANN001 - placement's own session
        generations = read_generations(session, provider_ids)
        if not claimed.is_set():
            claimed.set()
            racer = threading.Thread(target=placement.claim, args=(consumer, PROJECT, USER, {rp: {VCPU: 4}}))
            racer.start()
            racer.join()
        return generations

    monkeypatch.setattr(placement, "_read_provider_generations", claim_meanwhile)
    placement.delete_allocations(consumer)

    assert claimed.is_set()
    assert placement.get_allocations(consumer) == {}
    assert_used_counters_match_allocations()


def test_a_claim_racing_the_delete_of_its_hosts_service_finds_no_provider(pg_store, monkeypatch):
    # GIVEN a host with no servers whose service is being deleted, and a claim on it arriving just
    # after the delete read the host's providers
    rp = add_compute("host-a", vcpus=8)
    service = services.get_by_host("host-a", services.COMPUTE_BINARY)
    real_lock, claimed = services._lock_providers, []

    def claim_on_host_a():
        try:
            placement.claim(str(uuid.uuid4()), PROJECT, USER, {rp: {VCPU: 1}})
            claimed.append("claimed")
        except errors.ResourceProviderNotFound:
            claimed.append("no provider")

    def lock_then_race(session, host):
        locked = real_lock(session, host)
        racer = threading.Thread(target=claim_on_host_a)
        racer.start()
        racer.join(timeout=1)  # it waits for the delete's lock (without one, it would commit now)
        threads.append(racer)
        return locked

    threads: list[threading.Thread] = []
    monkeypatch.setattr(services, "_lock_providers", lock_then_race)

    # WHEN the delete goes on
    services.delete_service(service)

    # THEN it removed the host, and the claim, let through afterwards, found no provider (no 500,
    # no allocation left on a provider that is gone)
    threads[0].join(timeout=30)
    assert claimed == ["no provider"]
    with api_session() as session:
        assert session.scalars(select(ResourceProvider).where(ResourceProvider.host == "host-a")).all() == []
        assert session.scalars(select(Allocation)).all() == []
