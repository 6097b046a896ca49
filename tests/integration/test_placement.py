"""Placement against a real store (SQLite and PostgreSQL): inventories, claims, moves, conflicts."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from placement_helpers import PROJECT, USER, add_compute, assert_used_counters_match_allocations, cell_id, resources
from sqlalchemy import delete as sa_delete

from ferry import config, errors, placement
from ferry.placement import DISK_GB, MEMORY_MB, VCPU
from ferry.store.api_models import Inventory, ResourceProvider


def new_uuid() -> str:
    return str(uuid.uuid4())


def test_ensure_provider_creates_provider_with_configured_ratios(store, monkeypatch):
    monkeypatch.setenv("FERRY_CPU_ALLOCATION_RATIO", "3.0")
    config.reset()
    rp = placement.ensure_provider("host-a", "node-a", cell_id("cell1"),
                                   {VCPU: {"total": 8}, MEMORY_MB: {"total": 4096, "reserved": 512}})

    provider = placement.get_provider(rp)
    assert (provider.name, provider.host, provider.cell_id) == ("node-a", "host-a", cell_id("cell1"))
    inventories = placement.get_inventories(rp)
    assert inventories[VCPU]["allocation_ratio"] == 3.0
    assert inventories[MEMORY_MB]["reserved"] == 512
    assert placement.provider_by_host("host-a") == rp
    assert placement.provider_by_node("node-a") == rp


def test_an_inventory_reported_before_the_one_the_provider_has_is_not_written(store):
    # GIVEN a provider whose inventory came from a report queued at 12:00:10
    at = dt.datetime(2026, 1, 1, 12, 0, 10)
    rp = placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 16}}, reported_at=at)

    # WHEN a report queued before it is applied, THEN the inventory stays the newer one's
    placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 4}},
                              reported_at=at - dt.timedelta(seconds=5))
    assert placement.get_inventories(rp)[VCPU]["total"] == 16
    # an unchanged inventory reported later still counts as the newest (an older one cannot come back)
    placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 16}},
                              reported_at=at + dt.timedelta(seconds=10))
    placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 8}},
                              reported_at=at + dt.timedelta(seconds=5))
    assert placement.get_inventories(rp)[VCPU]["total"] == 16
    # and a newer one is written
    placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 8}},
                              reported_at=at + dt.timedelta(seconds=20))
    assert placement.get_inventories(rp)[VCPU]["total"] == 8


def test_a_report_whose_provider_was_removed_meanwhile_registers_the_host_again(store, monkeypatch):
    # GIVEN a provider, removed (its service deleted) while a report of its host waits for its row
    at = dt.datetime(2026, 1, 1, 12, 0, 10)
    placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 16}}, reported_at=at)
    newest, removed = placement._newest_report, []

    def removed_first(session, provider_id, reported_at):
        if not removed:
            removed.append(provider_id)
            session.execute(sa_delete(Inventory).where(Inventory.resource_provider_id == provider_id))
            session.execute(sa_delete(ResourceProvider).where(ResourceProvider.id == provider_id))
        return newest(session, provider_id, reported_at)

    monkeypatch.setattr(placement, "_newest_report", removed_first)

    # WHEN the report is applied
    rp = placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 8}},
                                   reported_at=at + dt.timedelta(seconds=10))

    # THEN the host has a provider again, with the report's inventory
    assert removed and placement.provider_by_host("host-a") == rp
    assert placement.get_inventories(rp)[VCPU]["total"] == 8


def test_ensure_provider_unchanged_report_keeps_generation(store):
    inventory = {VCPU: {"total": 8}, MEMORY_MB: {"total": 4096}}
    rp = placement.ensure_provider("host-a", "host-a", cell_id("cell1"), inventory)
    generation = placement.get_provider(rp).generation

    assert placement.ensure_provider("host-a", "host-a", cell_id("cell1"), inventory) == rp
    assert placement.get_provider(rp).generation == generation

    placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 16}})
    assert placement.get_provider(rp).generation == generation + 1
    assert set(placement.get_inventories(rp)) == {VCPU}


def test_removing_a_class_with_allocations_is_refused(store):
    rp = add_compute("host-a", vcpus=8)
    placement.claim(new_uuid(), PROJECT, USER, {rp: resources(vcpus=6)})

    with pytest.raises(errors.InventoryInUse):
        placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 8, "allocation_ratio": 1.0}})
    assert set(placement.get_inventories(rp)) == {VCPU, MEMORY_MB, DISK_GB}


def test_a_capacity_below_usage_is_taken_and_only_writes_that_add_nothing_fit_there(store):
    """A host reporting less (fewer cores, a lower ratio, more reserved) is believed; what it holds
    can still move back, though above the new max_unit."""
    rp = add_compute("host-a", vcpus=8)
    server, migration = new_uuid(), new_uuid()
    placement.claim(server, PROJECT, USER, {rp: resources(vcpus=6)})
    shrunk = {VCPU: {"total": 5, "allocation_ratio": 1.0}, MEMORY_MB: {"total": 8192, "allocation_ratio": 1.0},
              DISK_GB: {"total": 100, "allocation_ratio": 1.0}}

    placement.ensure_provider("host-a", "host-a", cell_id("cell1"), shrunk)

    assert placement.get_inventories(rp)[VCPU]["total"] == 5
    with pytest.raises(errors.InsufficientCapacity):
        placement.claim(new_uuid(), PROJECT, USER, {rp: resources(vcpus=1)})
    # The server's allocation handed to a migration and back adds nothing to the provider.
    placement.move_allocations(server, migration)
    placement.move_allocations(migration, server)
    assert placement.get_allocations(server)[rp][VCPU] == 6
    with pytest.raises(errors.InsufficientCapacity):
        placement.set_allocations({server: {"allocations": {rp: resources(vcpus=7)}}})
    assert_used_counters_match_allocations()


def test_claim_is_all_or_nothing_across_resource_classes(store):
    rp = add_compute("host-a", vcpus=4, memory_mb=4096)
    consumer = new_uuid()

    with pytest.raises(errors.InsufficientCapacity):
        placement.claim(consumer, PROJECT, USER, {rp: resources(vcpus=8, memory_mb=1024)})

    assert placement.get_allocations(consumer) == {}
    assert placement.usages(rp) == {}
    assert placement.consumer_generation(consumer) is None


def test_set_allocations_is_all_or_nothing_across_consumers(store):
    small = add_compute("host-a", vcpus=4)
    big = add_compute("host-b", vcpus=16)
    first, second = new_uuid(), new_uuid()

    with pytest.raises(errors.InsufficientCapacity):
        placement.set_allocations({
            first: {"project_id": PROJECT, "user_id": USER, "allocations": {big: resources(vcpus=8)}},
            second: {"project_id": PROJECT, "user_id": USER, "allocations": {small: resources(vcpus=8)}},
        })

    assert placement.get_allocations(first) == {}
    assert VCPU not in placement.usages(big)


def test_reserved_and_allocation_ratio_bound_capacity(store):
    # (4 - 1) * 2.0 = 6 vCPUs can be handed out (at most 4, the host's cores, to one consumer).
    rp = add_compute("host-a", vcpus=4, reserved={VCPU: 1}, ratio=2.0)
    placement.claim(new_uuid(), PROJECT, USER, {rp: {VCPU: 4}})

    with pytest.raises(errors.InsufficientCapacity):
        placement.claim(new_uuid(), PROJECT, USER, {rp: {VCPU: 3}})
    placement.claim(new_uuid(), PROJECT, USER, {rp: {VCPU: 2}})
    assert placement.usages(rp)[VCPU] == 6


def test_one_allocation_never_exceeds_the_host_s_physical_total_whatever_the_ratio(store):
    # GIVEN a 4-core host overcommitted 4.0 (16 vCPUs to hand out) that reports no max_unit
    rp = add_compute("host-a", vcpus=4, memory_mb=4096, disk_gb=40, ratio=4.0)
    assert {rc: inv["max_unit"] for rc, inv in placement.get_inventories(rp).items()} == {
        VCPU: 4, MEMORY_MB: 4096, DISK_GB: 40}

    # WHEN one consumer asks for more than the host has, THEN it does not fit
    with pytest.raises(errors.InsufficientCapacity, match="max_unit 4"):
        placement.claim(new_uuid(), PROJECT, USER, {rp: {VCPU: 5}})
    # while the overcommitted capacity still goes to consumers of at most the host's size
    for _ in range(4):
        placement.claim(new_uuid(), PROJECT, USER, {rp: {VCPU: 4}})
    assert placement.usages(rp)[VCPU] == 16


def test_a_reported_max_unit_is_kept(store):
    rp = placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {
        VCPU: {"total": 8, "max_unit": 2, "allocation_ratio": 4.0},
        MEMORY_MB: {"total": 4096, "max_unit": 8192, "allocation_ratio": 4.0}})

    inventories = placement.get_inventories(rp)
    assert (inventories[VCPU]["max_unit"], inventories[MEMORY_MB]["max_unit"]) == (2, 8192)
    placement.claim(new_uuid(), PROJECT, USER, {rp: {MEMORY_MB: 6144}})
    with pytest.raises(errors.InsufficientCapacity):
        placement.claim(new_uuid(), PROJECT, USER, {rp: {VCPU: 3}})


def test_min_unit_max_unit_and_step_size_are_enforced(store):
    rp = placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {
        MEMORY_MB: {"total": 8192, "min_unit": 256, "max_unit": 4096, "step_size": 256, "allocation_ratio": 1.0},
    })
    for amount in (128, 8192, 300):
        with pytest.raises(errors.InsufficientCapacity):
            placement.claim(new_uuid(), PROJECT, USER, {rp: {MEMORY_MB: amount}})
    placement.claim(new_uuid(), PROJECT, USER, {rp: {MEMORY_MB: 512}})
    assert placement.usages(rp)[MEMORY_MB] == 512


def test_claim_without_inventory_of_a_class_fails(store):
    rp = placement.ensure_provider("host-a", "host-a", cell_id("cell1"), {VCPU: {"total": 4}})
    with pytest.raises(errors.InsufficientCapacity):
        placement.claim(new_uuid(), PROJECT, USER, {rp: {VCPU: 1, DISK_GB: 1}})


def test_claim_on_unknown_provider_is_not_found(store):
    with pytest.raises(errors.ResourceProviderNotFound):
        placement.claim(new_uuid(), PROJECT, USER, {new_uuid(): {VCPU: 1}})


def test_reclaim_replaces_own_allocations_and_bumps_generations(store):
    first = add_compute("host-a", vcpus=4)
    second = add_compute("host-b", vcpus=4)
    consumer = new_uuid()
    placement.claim(consumer, PROJECT, USER, {first: resources(vcpus=4)})
    generations = (placement.get_provider(first).generation, placement.get_provider(second).generation)
    consumer_generation = placement.consumer_generation(consumer)

    # The consumer's own 4 vCPUs do not count against it: the same claim fits again.
    placement.claim(consumer, PROJECT, USER, {first: resources(vcpus=4)})
    placement.claim(consumer, PROJECT, USER, {second: resources(vcpus=3)})

    assert placement.get_allocations(consumer) == {second: resources(vcpus=3)}
    assert VCPU not in placement.usages(first)
    assert placement.get_provider(first).generation == generations[0] + 2
    assert placement.get_provider(second).generation == generations[1] + 1
    assert placement.consumer_generation(consumer) == consumer_generation + 2


def test_zero_amounts_are_ignored(store):
    rp = add_compute("host-a")
    consumer = new_uuid()
    placement.claim(consumer, PROJECT, USER, {rp: {VCPU: 1, DISK_GB: 0}})
    assert placement.get_allocations(consumer) == {rp: {VCPU: 1}}


def test_negative_amount_is_a_bad_request(store):
    rp = add_compute("host-a")
    with pytest.raises(errors.BadRequest):
        placement.claim(new_uuid(), PROJECT, USER, {rp: {VCPU: -1}})


def test_delete_allocations_is_idempotent_and_removes_consumer(store):
    rp = add_compute("host-a")
    consumer = new_uuid()
    placement.claim(consumer, PROJECT, USER, {rp: resources()})

    placement.delete_allocations(consumer)
    placement.delete_allocations(consumer)

    assert placement.get_allocations(consumer) == {}
    assert placement.consumer_generation(consumer) is None
    assert VCPU not in placement.usages(rp)


def test_move_allocations_gives_target_exactly_the_source_allocations(store):
    source_rp = add_compute("host-a")
    dest_rp = add_compute("host-b")
    instance, migration = new_uuid(), new_uuid()
    placement.claim(instance, PROJECT, USER, {source_rp: resources(vcpus=2)})
    placement.claim(migration, PROJECT, USER, {dest_rp: resources(vcpus=1)})

    placement.move_allocations(instance, migration)
    placement.move_allocations(instance, migration)  # already moved: nothing changes

    assert placement.get_allocations(migration) == {source_rp: resources(vcpus=2)}
    assert placement.get_allocations(instance) == {}
    assert VCPU not in placement.usages(dest_rp)


def test_move_allocations_failing_midway_changes_nothing(store, monkeypatch):
    rp = add_compute("host-a")
    instance, migration = new_uuid(), new_uuid()
    placement.claim(instance, PROJECT, USER, {rp: resources()})
    original = placement._write_consumer

    def fail_on_target(session, change, row):
        original(session, change, row)
        if change.consumer == migration:
            raise RuntimeError("database went away")

    monkeypatch.setattr(placement, "_write_consumer", fail_on_target)
    with pytest.raises(RuntimeError):
        placement.move_allocations(instance, migration)

    assert placement.get_allocations(instance) == {rp: resources()}
    assert placement.get_allocations(migration) == {}


def test_claim_for_move_hands_source_to_migration_and_is_repeatable(store):
    source_rp = add_compute("host-a")
    dest_rp = add_compute("host-b")
    instance, migration = new_uuid(), new_uuid()
    placement.claim(instance, PROJECT, USER, {source_rp: resources(vcpus=2)})

    for _ in range(2):
        placement.claim_for_move(instance, migration, PROJECT, USER, {dest_rp: resources(vcpus=4)})

    assert placement.get_allocations(migration) == {source_rp: resources(vcpus=2)}
    assert placement.get_allocations(instance) == {dest_rp: resources(vcpus=4)}


@pytest.mark.parametrize("same_host", [False, True], ids=["other-host", "same-host"])
def test_revert_move_gives_the_source_back_in_place_of_the_claim_and_runs_twice_the_same(store, same_host):
    source_rp = add_compute("host-a")
    dest_rp = source_rp if same_host else add_compute("host-b")
    instance, migration, neighbour = new_uuid(), new_uuid(), new_uuid()
    placement.claim(instance, PROJECT, USER, {source_rp: resources(vcpus=2)})
    placement.claim(neighbour, PROJECT, USER, {source_rp: resources(vcpus=1), dest_rp: resources(vcpus=1)})
    # Old and new the same size: on one host, only the generation tells the claim from what came back.
    placement.claim_for_move(instance, migration, PROJECT, USER, {dest_rp: resources(vcpus=2)})
    generation, claimed = placement.consumer_allocations(instance)
    assert claimed == {dest_rp: resources(vcpus=2)}

    for _ in range(2):
        placement.revert_move_allocations(migration, instance, claimed=claimed, claim_generation=generation)

    assert placement.get_allocations(instance) == {source_rp: resources(vcpus=2)}
    assert placement.get_allocations(migration) == {}
    assert placement.get_allocations(neighbour) == {source_rp: resources(vcpus=1), dest_rp: resources(vcpus=1)}
    assert_used_counters_match_allocations()


@pytest.mark.parametrize("same_host", [False, True], ids=["other-host", "same-host"])
def test_revert_move_with_nothing_to_give_back_drops_the_claim_and_runs_twice_the_same(store, same_host):
    # GIVEN a server that held no allocation (an operator removed it) and its claim on the destination
    source_rp = add_compute("host-a")
    dest_rp = source_rp if same_host else add_compute("host-b")
    instance, migration, neighbour = new_uuid(), new_uuid(), new_uuid()
    placement.claim(neighbour, PROJECT, USER, {source_rp: resources(vcpus=1), dest_rp: resources(vcpus=1)})
    placement.claim_for_move(instance, migration, PROJECT, USER, {dest_rp: resources(vcpus=2)})
    generation, claimed = placement.consumer_allocations(instance)
    assert placement.get_allocations(migration) == {}

    # WHEN the move is reverted, twice
    for _ in range(2):
        placement.revert_move_allocations(migration, instance, claimed=claimed, claim_generation=generation)

    # THEN the claim is gone and nobody else's allocations changed
    assert placement.get_allocations(instance) == {}
    assert placement.consumer_generation(instance) is None
    assert placement.get_allocations(neighbour) == {source_rp: resources(vcpus=1), dest_rp: resources(vcpus=1)}
    assert placement.usages(dest_rp)[VCPU] == 1
    assert_used_counters_match_allocations()


def test_revert_move_leaves_allocations_that_changed_since_the_claim_alone(store):
    source_rp = add_compute("host-a")
    dest_rp = add_compute("host-b")
    instance, migration = new_uuid(), new_uuid()
    placement.claim_for_move(instance, migration, PROJECT, USER, {dest_rp: resources(vcpus=2)})
    generation, claimed = placement.consumer_allocations(instance)
    placement.claim(instance, PROJECT, USER, {source_rp: resources(vcpus=1)})  # rewritten since

    placement.revert_move_allocations(migration, instance, claimed=claimed, claim_generation=generation)
    placement.revert_move_allocations(migration, instance, claimed=claimed)
    placement.revert_move_allocations(migration, instance, claimed=None)

    assert placement.get_allocations(instance) == {source_rp: resources(vcpus=1)}


def test_revert_move_keeps_an_allocation_recreated_at_the_generation_the_claim_had(store):
    # GIVEN a server that held no allocation, whose destination claim (a new consumer, so generation 1)
    # a revert dropped
    source_rp = add_compute("host-a")
    dest_rp = add_compute("host-b")
    instance, migration = new_uuid(), new_uuid()
    placement.claim_for_move(instance, migration, PROJECT, USER, {dest_rp: resources(vcpus=2)})
    generation, claimed = placement.consumer_allocations(instance)
    placement.revert_move_allocations(migration, instance, claimed=claimed, claim_generation=generation)
    assert placement.consumer_allocations(instance) == (None, {})
    # and an operator gave the server its allocation back since: a new consumer at the claim's generation
    placement.claim(instance, PROJECT, USER, {source_rp: resources(vcpus=1)})
    assert placement.consumer_generation(instance) == generation

    # WHEN the revert runs again (delivered twice)
    placement.revert_move_allocations(migration, instance, claimed=claimed, claim_generation=generation)

    # THEN the allocation is not the claim, whatever its generation: it stays
    assert placement.get_allocations(instance) == {source_rp: resources(vcpus=1)}
    assert_used_counters_match_allocations()


def test_revert_move_on_one_host_drops_the_claim_only_at_its_generation(store):
    # GIVEN a server without allocations resized on its host, the old and new flavors the same size: the claim
    # looks exactly like the server's own allocation an operator would give back
    rp = add_compute("host-a")
    instance, migration = new_uuid(), new_uuid()
    placement.claim_for_move(instance, migration, PROJECT, USER, {rp: resources(vcpus=2)})
    generation, claimed = placement.consumer_allocations(instance)

    # WHEN the move is reverted knowing the allocations alone, then knowing the generation too
    placement.revert_move_allocations(migration, instance, claimed=claimed, same_host=True)
    kept = placement.get_allocations(instance)
    placement.revert_move_allocations(migration, instance, claimed=claimed, claim_generation=generation,
                                      same_host=True)

    # THEN the allocations alone do not drop it; the generation recorded with the claim does
    assert kept == claimed
    assert placement.get_allocations(instance) == {}
    assert_used_counters_match_allocations()


def test_same_host_move_must_fit_old_and_new_together(store):
    rp = add_compute("host-a", vcpus=6)
    instance, migration = new_uuid(), new_uuid()
    placement.claim(instance, PROJECT, USER, {rp: resources(vcpus=2)})

    with pytest.raises(errors.InsufficientCapacity):
        placement.claim_for_move(instance, migration, PROJECT, USER, {rp: resources(vcpus=5)})
    assert placement.get_allocations(instance) == {rp: resources(vcpus=2)}
    assert placement.get_allocations(migration) == {}

    placement.claim_for_move(instance, migration, PROJECT, USER, {rp: resources(vcpus=4)})
    assert placement.usages(rp)[VCPU] == 6


def test_generation_conflicts_are_retried_then_raise_allocation_conflict(store, monkeypatch):
    monkeypatch.setenv("FERRY_PLACEMENT_MAX_RETRIES", "3")
    config.reset()
    rp = add_compute("host-a")
    reads = []
    original = placement._read_provider_generations

    def concurrent_writer_bumps_after_read(session, provider_ids):
        # As if another claim committed right after this read: the generation seen is stale.
        reads.append(provider_ids)
        return {pid: generation - 1 for pid, generation in original(session, provider_ids).items()}

    monkeypatch.setattr(placement, "_read_provider_generations", concurrent_writer_bumps_after_read)
    consumer = new_uuid()
    with pytest.raises(errors.AllocationConflict):
        placement.claim(consumer, PROJECT, USER, {rp: resources()})

    assert len(reads) == 4
    assert placement.get_allocations(consumer) == {}
    assert VCPU not in placement.usages(rp)


def test_one_generation_conflict_is_retried_successfully(store, monkeypatch):
    rp = add_compute("host-a")
    original = placement._read_provider_generations
    calls = []

    def stale_once(session, provider_ids):
        calls.append(1)
        seen = original(session, provider_ids)
        return {pid: g - 1 for pid, g in seen.items()} if len(calls) == 1 else seen

    monkeypatch.setattr(placement, "_read_provider_generations", stale_once)
    consumer = new_uuid()
    placement.claim(consumer, PROJECT, USER, {rp: resources()})

    assert len(calls) == 2
    assert placement.get_allocations(consumer) == {rp: resources()}


def test_stale_consumer_generation_is_a_conflict(store):
    rp = add_compute("host-a")
    consumer = new_uuid()
    placement.claim(consumer, PROJECT, USER, {rp: resources(vcpus=1)}, consumer_generation=None)
    seen = placement.consumer_generation(consumer)
    placement.claim(consumer, PROJECT, USER, {rp: resources(vcpus=2)})

    with pytest.raises(errors.AllocationConflict):
        placement.claim(consumer, PROJECT, USER, {rp: resources(vcpus=3)}, consumer_generation=seen)
    placement.claim(consumer, PROJECT, USER, {rp: resources(vcpus=3)}, consumer_generation=seen + 1)
    assert placement.get_allocations(consumer) == {rp: resources(vcpus=3)}


def test_provider_lookups_raise_not_found(store):
    with pytest.raises(errors.ResourceProviderNotFound):
        placement.provider_by_host("nowhere")
    with pytest.raises(errors.ResourceProviderNotFound):
        placement.usages(new_uuid())
