"""Placement's allocation candidates and its per-inventory ``used`` counter, on SQLite and PostgreSQL."""

from __future__ import annotations

import random
import uuid

import pytest
from placement_helpers import (
    PROJECT,
    USER,
    add_aggregate,
    add_compute,
    assert_used_counters_match_allocations,
    cell_id,
    resources,
)
from sqlalchemy import select, update

from ferry import errors, placement
from ferry.placement import DISK_GB, MEMORY_MB, VCPU, CandidateRequest
from ferry.store import migrate
from ferry.store.api_models import AggregateHost, CellMapping
from ferry.store.db import api_session, engine_for


def new_uuid() -> str:
    return str(uuid.uuid4())


def every_candidate(request: CandidateRequest, limit: int = 1000,
                    pivot: str | None = None) -> list[placement.Candidate]:
    return [candidate for batch in placement.allocation_candidates(request, limit=limit, pivot=pivot)
            for candidate in batch]


def hosts(candidates: list[placement.Candidate]) -> set[str]:
    return {candidate.host for candidate in candidates}


# --- which providers are candidates -------------------------------------------------------------


def test_only_providers_with_room_for_every_class_are_candidates(store):
    roomy = add_compute("host-roomy", vcpus=8, memory_mb=8192, disk_gb=100)
    add_compute("host-no-ram", vcpus=8, memory_mb=1024, disk_gb=100)
    add_compute("host-no-disk", vcpus=8, memory_mb=8192, disk_gb=5)
    busy = add_compute("host-busy", vcpus=4, memory_mb=8192, disk_gb=100)
    placement.claim(new_uuid(), PROJECT, USER, {busy: {VCPU: 3}})

    found = every_candidate(CandidateRequest(resources=resources(vcpus=2)))

    assert hosts(found) == {"host-roomy"}
    (candidate,) = found
    assert (candidate.uuid, candidate.name, candidate.cell, candidate.cell_id) == (
        roomy, "host-roomy", "cell1", cell_id("cell1"))
    assert candidate.free == {VCPU: 8.0, MEMORY_MB: 8192.0, DISK_GB: 100.0}


def test_reserved_ratio_and_unit_limits_decide_the_fit(store):
    add_compute("host-reserved", vcpus=4, reserved={VCPU: 3})
    overcommit = add_compute("host-overcommit", vcpus=4, ratio=4.0)
    for _ in range(3):
        placement.claim(new_uuid(), PROJECT, USER, {overcommit: {VCPU: 4}})  # 12 of 16 in use
    add_compute("host-two-cores", vcpus=2, ratio=4.0)  # room for 8, but no server larger than 2
    with_step = add_compute("host-step")
    placement.ensure_provider("host-step", "host-step", cell_id("cell1"), {
        VCPU: {"total": 8, "step_size": 4, "allocation_ratio": 1.0},
        MEMORY_MB: {"total": 8192, "allocation_ratio": 1.0}, DISK_GB: {"total": 100, "allocation_ratio": 1.0}})
    add_compute("host-max-unit")
    placement.ensure_provider("host-max-unit", "host-max-unit", cell_id("cell1"), {
        VCPU: {"total": 8, "max_unit": 1, "allocation_ratio": 1.0},
        MEMORY_MB: {"total": 8192, "allocation_ratio": 1.0}, DISK_GB: {"total": 100, "allocation_ratio": 1.0}})

    assert hosts(every_candidate(CandidateRequest(resources=resources(vcpus=2)))) == {"host-overcommit",
                                                                                      "host-two-cores"}
    assert hosts(every_candidate(CandidateRequest(resources=resources(vcpus=4)))) == {"host-overcommit",
                                                                                      "host-step"}
    assert every_candidate(CandidateRequest(resources=resources(vcpus=5))) == []
    assert placement.get_provider(with_step).name == "host-step"


def test_classes_not_requested_are_reported_but_not_required(store):
    add_compute("host-a", vcpus=4, memory_mb=4096, disk_gb=1)

    (candidate,) = every_candidate(CandidateRequest(resources={VCPU: 1, MEMORY_MB: 512}))

    assert candidate.free == {VCPU: 4.0, MEMORY_MB: 4096.0, DISK_GB: 1.0}


def test_allocations_of_excluded_consumers_count_as_free(store):
    rp = add_compute("host-a", vcpus=4)
    instance = new_uuid()
    placement.claim(instance, PROJECT, USER, {rp: resources(vcpus=3)})
    request = CandidateRequest(resources=resources(vcpus=4))

    assert every_candidate(request) == []
    (candidate,) = every_candidate(CandidateRequest(resources=resources(vcpus=4), exclude_consumers=(instance,)))
    assert candidate.free[VCPU] == 4.0


def test_scope_limits_cells_hosts_nodes_and_aggregates(store):
    add_compute("host-1a", "cell1")
    add_compute("host-1b", "cell1")
    add_compute("host-2a", "cell2")
    add_compute("host-0", "cell0")
    add_aggregate("pair", ["host-1b", "host-2a"], {"ssd": "true"})
    with api_session() as session:
        pair = session.scalar(select(AggregateHost.aggregate_id).where(AggregateHost.host == "host-2a"))
    need = resources()

    assert hosts(every_candidate(CandidateRequest(resources=need))) == {"host-1a", "host-1b", "host-2a"}
    assert hosts(every_candidate(CandidateRequest(resources=need, cells=("cell2", "cell0")))) == {"host-2a", "host-0"}
    assert hosts(every_candidate(CandidateRequest(resources=need, cell="cell1"))) == {"host-1a", "host-1b"}
    assert hosts(every_candidate(CandidateRequest(resources=need, exclude_cell="cell1"))) == {"host-2a"}
    assert hosts(every_candidate(CandidateRequest(resources=need, cells=("cell2", "cell0"), exclude_cell="cell2"))) == {
        "host-0"}
    assert hosts(every_candidate(CandidateRequest(resources=need, host="host-1b"))) == {"host-1b"}
    assert hosts(every_candidate(CandidateRequest(resources=need, node="host-2a"))) == {"host-2a"}
    assert hosts(every_candidate(CandidateRequest(resources=need, hosts=frozenset({"host-1a", "host-0"})))) == {
        "host-1a"}
    # An aggregate small enough becomes a host list; a larger one stays a membership test: same answer.
    by_members = CandidateRequest(resources=need, member_of=(frozenset({pair}),))
    assert hosts(every_candidate(by_members, limit=10)) == {"host-1b", "host-2a"}
    assert hosts(every_candidate(by_members, limit=1)) == {"host-1b", "host-2a"}
    assert every_candidate(CandidateRequest(resources=need, member_of=(frozenset(),))) == []
    assert placement.count_in_scope(CandidateRequest(resources=need)) == 3
    assert placement.count_in_scope(by_members) == 2
    assert placement.count_in_scope(CandidateRequest(resources=need, exclude_cell="cell2")) == 2


def test_disabled_cells_give_no_candidates(store):
    add_compute("host-1a", "cell1")
    add_compute("host-2a", "cell2")
    with api_session() as session:
        session.execute(update(CellMapping).where(CellMapping.name == "cell2").values(disabled=True))

    assert hosts(every_candidate(CandidateRequest(resources=resources()))) == {"host-1a"}
    assert hosts(every_candidate(CandidateRequest(resources=resources(), cells=("cell2",)))) == set()
    # A request that may take a disabled cell (a move held to its own cell) has its candidates.
    assert hosts(every_candidate(CandidateRequest(resources=resources(), cells=("cell2",), include_disabled=True))) \
        == {"host-2a"}


# --- batches, the cap and fairness --------------------------------------------------------------


def test_batches_hold_at_most_the_limit_and_cover_each_fitting_provider_once(store):
    for n in range(23):
        add_compute(f"host-{n:02d}", "cell1" if n % 2 else "cell2", vcpus=1 if n % 5 == 0 else 8)
    fitting = {f"host-{n:02d}" for n in range(23) if n % 5 != 0}
    rng = random.Random(7)

    for limit in (1, 3, 4, 18, 1000):
        pivot = placement.random_pivot(rng)
        batches = list(placement.allocation_candidates(CandidateRequest(resources=resources()), limit=limit,
                                                       pivot=pivot))
        seen = [candidate.host for batch in batches for candidate in batch]
        assert all(0 < len(batch) <= limit for batch in batches)
        assert all(len(batch) == limit for batch in batches[:-1])
        assert len(seen) == len(set(seen))
        assert set(seen) == fitting


def test_sparse_fits_are_found_past_windows_of_providers_that_do_not_fit(store):
    for n in range(40):
        add_compute(f"host-{n:02d}", vcpus=8 if n in (3, 17, 38) else 1)

    for pivot in ("00000000-0000-0000-0000-000000000000", "80000000-0000-0000-0000-000000000000",
                  "ffffffff-ffff-ffff-ffff-ffffffffffff"):
        batches = list(placement.allocation_candidates(CandidateRequest(resources=resources(vcpus=4)), limit=2,
                                                       pivot=pivot))
        assert [len(batch) for batch in batches] == [2, 1]
        assert {c.host for batch in batches for c in batch} == {"host-03", "host-17", "host-38"}


def test_first_batch_starts_at_the_pivot_so_requests_spread(store):
    for n in range(12):
        add_compute(f"host-{n:02d}")
    request = CandidateRequest(resources=resources())
    pivot = "40000000-0000-0000-0000-000000000000"

    first = next(placement.allocation_candidates(request, limit=3, pivot=pivot))
    again = next(placement.allocation_candidates(request, limit=3, pivot=pivot))
    everyone = sorted(every_candidate(request), key=lambda c: c.uuid)
    after_pivot = [c for c in everyone if c.uuid >= pivot] + [c for c in everyone if c.uuid < pivot]

    assert [c.uuid for c in first] == [c.uuid for c in again] == [c.uuid for c in after_pivot[:3]]
    # Random pivots reach every host first sooner or later. The providers' uuids are random too, so a
    # fixed number of draws would miss a host whose predecessors sit close together (a few % of runs
    # at 60 draws): draw until all were seen, within a bound no spread-out walk comes near.
    rng = random.Random(3)
    hosts = {f"host-{n:02d}" for n in range(12)}
    firsts: set[str] = set()
    for _ in range(2000):
        firsts |= {c.host for c in next(placement.allocation_candidates(request, limit=3,
                                                                        pivot=placement.random_pivot(rng)))}
        if firsts == hosts:
            break
    assert firsts == hosts


def test_a_host_list_is_capped_and_rotated_like_the_walk(store):
    for n in range(6):
        add_compute(f"host-{n}")
    request = CandidateRequest(resources=resources(), hosts=frozenset({"host-1", "host-2", "host-4", "host-5"}))

    batches = list(placement.allocation_candidates(request, limit=3))

    assert [len(batch) for batch in batches] == [3, 1]
    assert {c.host for batch in batches for c in batch} == {"host-1", "host-2", "host-4", "host-5"}


# --- the used counter ---------------------------------------------------------------------------


def test_used_counter_follows_claims_moves_deletes_and_refusals(store):
    source = add_compute("host-src", vcpus=8)
    dest = add_compute("host-dst", vcpus=8)
    instance, migration, other = new_uuid(), new_uuid(), new_uuid()

    placement.claim(instance, PROJECT, USER, {source: resources(vcpus=2)})
    placement.claim(other, PROJECT, USER, {source: resources(vcpus=1), dest: {VCPU: 1}})
    assert_used_counters_match_allocations()
    assert placement.usages(source) == {VCPU: 3, MEMORY_MB: 4096, DISK_GB: 20}

    placement.claim_for_move(instance, migration, PROJECT, USER, {dest: resources(vcpus=4)})
    assert_used_counters_match_allocations()
    assert placement.usages(dest)[VCPU] == 5

    with pytest.raises(errors.InsufficientCapacity):
        placement.claim(new_uuid(), PROJECT, USER, {dest: {VCPU: 4}})
    with pytest.raises(errors.AllocationConflict):
        placement.claim(instance, PROJECT, USER, {dest: {VCPU: 1}}, consumer_generation=99)
    with pytest.raises(errors.ResourceProviderNotFound):
        placement.claim(instance, PROJECT, USER, {new_uuid(): {VCPU: 1}})
    assert_used_counters_match_allocations()
    assert placement.usages(dest)[VCPU] == 5

    placement.move_allocations(migration, instance)  # a revert: the source again, the destination freed
    assert_used_counters_match_allocations()
    assert placement.usages(dest)[VCPU] == 1
    placement.set_allocations({other: {"allocations": {dest: {VCPU: 2}}},
                               instance: {"allocations": {source: resources(vcpus=3)}}})
    assert_used_counters_match_allocations()
    placement.delete_allocations(other)
    placement.delete_allocations(instance)
    assert_used_counters_match_allocations()
    assert placement.usages(source) == {} and placement.usages(dest) == {}


def test_used_counter_survives_inventory_reports(store):
    rp = add_compute("host-a", vcpus=8)
    placement.claim(new_uuid(), PROJECT, USER, {rp: resources(vcpus=3)})

    placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {
        VCPU: {"total": 16, "allocation_ratio": 1.0}, MEMORY_MB: {"total": 8192, "allocation_ratio": 1.0},
        DISK_GB: {"total": 100, "allocation_ratio": 1.0}, "CUSTOM_GPU": {"total": 1}})

    assert_used_counters_match_allocations()
    assert placement.usages(rp) == {VCPU: 3, MEMORY_MB: 2048, DISK_GB: 10}
    (candidate,) = every_candidate(CandidateRequest(resources={VCPU: 13, "CUSTOM_GPU": 1}))
    assert candidate.free[VCPU] == 13.0
    assert candidate.free["CUSTOM_GPU"] == 1.0


def test_random_operations_keep_the_counter_equal_to_the_allocations(store):
    rng = random.Random(11)
    providers = [add_compute(f"host-{n}", vcpus=6, memory_mb=6144, disk_gb=60) for n in range(4)]
    consumers = [new_uuid() for _ in range(6)]
    for _ in range(60):
        consumer = rng.choice(consumers)
        action = rng.random()
        try:
            if action < 0.5:
                placement.claim(consumer, PROJECT, USER, {rng.choice(providers): resources(
                    vcpus=rng.randint(1, 3), memory_mb=1024 * rng.randint(1, 3), disk_gb=10 * rng.randint(1, 3))})
            elif action < 0.7:
                placement.claim_for_move(consumer, new_uuid(), PROJECT, USER,
                                         {rng.choice(providers): resources(vcpus=1, memory_mb=512, disk_gb=5)})
            elif action < 0.85:
                placement.move_allocations(consumer, rng.choice(consumers))  # sometimes to itself: nothing moves
            else:
                placement.delete_allocations(consumer)
        except errors.InsufficientCapacity:
            pass
    assert_used_counters_match_allocations()
    for rp in providers:
        usage = placement.usages(rp)
        assert usage.get(VCPU, 0) <= 6 and usage.get(MEMORY_MB, 0) <= 6144 and usage.get(DISK_GB, 0) <= 60


def test_migration_fills_the_counter_from_existing_allocations(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'api.sqlite'}"
    migrate.upgrade("api", url, "0002_api")
    with engine_for(url).begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO resource_providers (id, uuid, name, host, generation, created_at) "
            "VALUES (1, 'rp-1', 'n1', 'h1', 3, '2026-01-01'), (2, 'rp-2', 'n2', 'h2', 0, '2026-01-01')")
        connection.exec_driver_sql(
            "INSERT INTO inventories (resource_provider_id, resource_class, total, reserved, min_unit, max_unit, "
            "step_size, allocation_ratio) VALUES (1, 'VCPU', 8, 0, 1, 8, 1, 1.0), (1, 'MEMORY_MB', 4096, 0, 1, "
            "4096, 1, 1.0), (2, 'VCPU', 8, 0, 1, 8, 1, 1.0)")
        connection.exec_driver_sql(
            "INSERT INTO allocations (resource_provider_id, consumer_uuid, resource_class, used) VALUES "
            "(1, 'c1', 'VCPU', 2), (1, 'c2', 'VCPU', 3), (1, 'c1', 'MEMORY_MB', 1024)")

    migrate.upgrade("api", url)

    with engine_for(url).connect() as connection:
        rows = connection.exec_driver_sql(
            "SELECT resource_provider_id, resource_class, used FROM inventories ORDER BY 1, 2").all()
    assert [tuple(row) for row in rows] == [(1, "MEMORY_MB", 1024), (1, "VCPU", 5), (2, "VCPU", 0)]
    engine_for(url).dispose()
