"""The scheduler against a real store (SQLite and PostgreSQL): filters, weighers, claims, alternates."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from placement_helpers import (
    PROJECT,
    USER,
    add_aggregate,
    add_compute,
    add_group,
    add_instance,
    assert_used_counters_match_allocations,
    flavor,
    join_group,
    place_member,
    request_spec,
    resources,
)
from sqlalchemy import update

from ferry import config, errors, placement, scheduler
from ferry.placement import VCPU
from ferry.scheduler import manager
from ferry.store.api_models import CellMapping, utcnow
from ferry.store.cell_models import Service
from ferry.store.db import api_session, cell_session


@pytest.fixture
def attempts(monkeypatch):
    def set_attempts(n: int) -> None:
        monkeypatch.setenv("FERRY_SCHEDULER_MAX_ATTEMPTS", str(n))
        config.reset()

    return set_attempts


def hosts_of(selections: list[scheduler.Selection]) -> list[str]:
    return [s.host for s in selections]


def test_capacity_prefilter_excludes_full_hosts(store):
    full = add_compute("host-full", vcpus=4, memory_mb=16384)
    add_compute("host-free", vcpus=4, memory_mb=4096)
    placement.claim(str(uuid.uuid4()), PROJECT, USER, {full: {VCPU: 3}})

    selections = scheduler.select_destinations(request_spec(flavor=flavor(vcpus=2)))

    assert hosts_of(selections) == ["host-free"]


def test_a_server_never_gets_more_vcpus_than_its_host_has_cores(store):
    # GIVEN an idle 2-core host overcommitted 4.0 (8 vCPUs to hand out) and a busy 8-core one
    add_compute("host-two-cores", vcpus=2, memory_mb=65536, ratio=4.0)
    busy = add_compute("host-eight-cores", vcpus=8, memory_mb=8192)
    placement.claim(str(uuid.uuid4()), PROJECT, USER, {busy: {VCPU: 4}})

    # WHEN a 4-vCPU server is scheduled, THEN only the host with 4 cores or more is considered
    selections = scheduler.select_destinations(request_spec(flavor=flavor(vcpus=4)), claim=False)

    assert hosts_of(selections) == ["host-eight-cores"]


def test_no_valid_host_message_counts_what_each_stage_removed(store):
    add_compute("host-small", vcpus=1)
    add_compute("host-disabled", disabled=True)

    with pytest.raises(errors.NoValidHost) as caught:
        scheduler.select_destinations(request_spec(flavor=flavor(vcpus=2)))

    assert "2 compute node(s)" in caught.value.message
    assert "PlacementCapacity removed 1" in caught.value.message
    assert "ComputeFilter removed 1" in caught.value.message
    assert caught.value.details["removed"]["ComputeFilter"] == 1


def test_disabled_forced_down_silent_and_unknown_services_get_nothing(store):
    add_compute("host-disabled", memory_mb=65536, disabled=True)
    add_compute("host-forced-down", memory_mb=65536, forced_down=True)
    add_compute("host-silent", memory_mb=65536, last_seen_at=utcnow() - dt.timedelta(minutes=10))
    add_compute("host-no-service", memory_mb=65536, service=False)
    add_compute("host-up", memory_mb=4096)

    assert hosts_of(scheduler.select_destinations(request_spec())) == ["host-up"]


def test_aggregate_extra_specs_must_match_host_aggregates(store):
    add_compute("host-gen1", memory_mb=65536)
    add_compute("host-gen2")
    add_compute("host-gen2-hdd")
    add_aggregate("gen1", ["host-gen1"], {"hw_generation": "gen1", "ssd": "true"})
    add_aggregate("gen2", ["host-gen2", "host-gen2-hdd"], {"hw_generation": "gen2,gen2b"})
    add_aggregate("fast-disks", ["host-gen2"], {"ssd": "true"})
    wanted = flavor(extra_specs={"aggregate_instance_extra_specs:hw_generation": "gen2b", "ssd": "true",
                                 "hw:cpu_policy": "dedicated"})

    assert hosts_of(scheduler.select_destinations(request_spec(flavor=wanted))) == ["host-gen2"]


def test_a_server_asked_for_in_a_zone_lands_there_and_one_in_the_default_zone_outside_every_zone(store):
    add_compute("host-az1")
    add_compute("host-big", memory_mb=65536)  # the weighers' favourite, in no zone
    add_aggregate("zone-1", ["host-az1"], {"availability_zone": "az1"})

    assert hosts_of(scheduler.select_destinations(request_spec(availability_zone="az1"))) == ["host-az1"]
    assert hosts_of(scheduler.select_destinations(request_spec(availability_zone="nova"))) == ["host-big"]
    with pytest.raises(errors.NoValidHost):
        scheduler.select_destinations(request_spec(availability_zone="az2"))


def test_ignore_hosts_are_never_chosen(store):
    add_compute("host-a", memory_mb=65536)
    add_compute("host-b")

    assert hosts_of(scheduler.select_destinations(request_spec(ignore_hosts=["host-a"]))) == ["host-b"]


def test_requested_host_is_chosen_only_when_it_passes_filters(store):
    add_compute("host-big", memory_mb=65536)
    add_compute("host-target")
    add_compute("host-disabled", disabled=True)

    chosen = scheduler.select_destinations(request_spec(requested_destination={"host": "host-target"}))
    assert hosts_of(chosen) == ["host-target"]

    with pytest.raises(errors.NoValidHost, match="ComputeFilter removed 1"):
        scheduler.select_destinations(request_spec(requested_destination={"host": "host-disabled"}))
    with pytest.raises(errors.NoValidHost, match="IgnoreHostsFilter removed 1"):
        scheduler.select_destinations(request_spec(requested_destination={"host": "host-target"},
                                                   ignore_hosts=["host-target"]))


def test_cell0_and_cells_not_allowed_are_left_out(store):
    add_compute("host-cell1", "cell1", memory_mb=65536)
    add_compute("host-cell2", "cell2")

    assert hosts_of(scheduler.select_destinations(request_spec(allowed_cells=["cell2"]))) == ["host-cell2"]
    with pytest.raises(errors.NoValidHost, match="no compute node"):
        scheduler.select_destinations(request_spec(allowed_cells=["cell2"],
                                                   requested_destination={"host": "host-cell1"}))


def test_a_disabled_cell_takes_only_moves_held_to_it(store):
    # GIVEN cell2 disabled, with room, and cell1 with room
    add_compute("host-cell1", "cell1", memory_mb=65536)
    add_compute("host-cell2", "cell2", memory_mb=65536)
    with api_session() as session:
        session.execute(update(CellMapping).where(CellMapping.name == "cell2").values(disabled=True))

    # THEN a new server, and a move from cell1 that may change cells, never land in it
    assert hosts_of(scheduler.select_destinations(request_spec(), claim=False)) == ["host-cell1"]
    with pytest.raises(errors.NoValidHost):
        scheduler.select_destinations(request_spec(allowed_cells=["cell2"]), claim=False)
    with pytest.raises(errors.NoValidHost):
        scheduler.select_destinations(request_spec(allowed_cells=["cell2"], source_cell="cell1"), claim=False)
    # and a move of one of its servers that may leave it goes elsewhere, as the cell is being emptied
    moved = scheduler.select_destinations(request_spec(allowed_cells=["cell1", "cell2"], source_cell="cell2"),
                                          claim=False)
    assert hosts_of(moved) == ["host-cell1"]
    # but a move that may not leave it still lands in it, as in Nova (a requested destination cell),
    # whether its spec says so or (written before it did) allows its source cell alone
    for said in ({"may_leave_cell": False}, {}):
        held = scheduler.select_destinations(request_spec(allowed_cells=["cell2"], source_cell="cell2", **said),
                                             claim=False)
        assert hosts_of(held) == ["host-cell2"]
    # and one that may leave it finds no host there even when its cell is the only one it lists
    # (a deployment of one cell), as Nova, with the cross-cell policy, schedules to enabled cells only
    with pytest.raises(errors.NoValidHost):
        scheduler.select_destinations(request_spec(allowed_cells=["cell2"], source_cell="cell2", may_leave_cell=True),
                                      claim=False)


def test_affinity_group_stays_on_members_hosts(store):
    add_compute("host-a", memory_mb=65536)
    group = add_group("affinity")
    place_member(group, add_compute("host-member", memory_mb=65536))

    assert hosts_of(scheduler.select_destinations(request_spec(join_group(group), group={"uuid": group}))) == [
        "host-member"]


def test_anti_affinity_group_avoids_members_hosts(store, attempts):
    attempts(5)
    group = add_group("anti-affinity")
    place_member(group, add_compute("host-a", memory_mb=65536))
    add_compute("host-b")
    place_member(group, add_compute("host-c", memory_mb=65536))

    assert hosts_of(scheduler.select_destinations(request_spec(join_group(group), group={"uuid": group}))) == [
        "host-b"]
    with pytest.raises(errors.NoValidHost, match="ServerGroupAntiAffinityFilter removed 1"):
        scheduler.select_destinations(request_spec(join_group(group), group={"uuid": group},
                                                   requested_destination={"host": "host-a"}))


def test_same_host_and_different_host_hints_follow_the_named_instances(store, attempts):
    attempts(5)
    add_compute("host-a")
    add_compute("host-b", "cell2")
    add_compute("host-c")
    on_a = add_instance("host-a")
    on_b = add_instance("host-b", "cell2")

    same = scheduler.select_destinations(request_spec(scheduler_hints={"same_host": [on_b]}))
    assert hosts_of(same) == ["host-b"]
    different = scheduler.select_destinations(request_spec(scheduler_hints={"different_host": [on_a, on_b]}))
    assert hosts_of(different) == ["host-c"]
    with pytest.raises(errors.NoValidHost, match="SameHostFilter"):
        scheduler.select_destinations(request_spec(scheduler_hints={"same_host": [str(uuid.uuid4())]}))


def test_chosen_host_is_claimed_and_alternates_follow_in_weighed_order(store, attempts):
    attempts(3)
    for n, memory in enumerate([4096, 8192, 16384, 32768, 65536]):
        add_compute(f"host-{n}", memory_mb=memory)
    add_compute("host-other-cell", "cell2", memory_mb=50000)
    spec = request_spec()

    selections = scheduler.select_destinations(spec)

    assert hosts_of(selections) == ["host-4", "host-3", "host-2"]
    chosen = selections[0]
    assert placement.get_allocations(spec["instance_uuid"]) == chosen.allocations
    assert chosen.allocations == {chosen.provider_uuid: resources()}
    for alternate in selections[1:]:
        assert alternate.allocations == {alternate.provider_uuid: resources()}
        assert VCPU not in placement.usages(alternate.provider_uuid)
        assert alternate.cell == "cell1"


def test_claim_false_writes_nothing(store):
    rp = add_compute("host-a")
    spec = request_spec()
    generation = placement.get_provider(rp).generation

    selections = scheduler.select_destinations(spec, claim=False)

    assert hosts_of(selections) == ["host-a"]
    assert placement.get_allocations(spec["instance_uuid"]) == {}
    assert placement.get_provider(rp).generation == generation


def test_volume_backed_server_needs_no_root_disk(store):
    add_compute("host-a", disk_gb=5)
    spec = request_spec(flavor=flavor(root_gb=20), is_bfv=True)

    chosen = scheduler.select_destinations(spec)[0]

    assert chosen.allocations[chosen.provider_uuid] == {VCPU: 2, placement.MEMORY_MB: 2048}


def test_host_filled_by_a_concurrent_request_is_skipped_for_the_next(store, monkeypatch, attempts):
    attempts(3)
    roomy = add_compute("host-roomy", memory_mb=65536)
    add_compute("host-next")
    original = manager._filter

    def another_request_fills_the_best_host(spec, migration_uuid):
        filtered = original(spec, migration_uuid)
        placement.claim(str(uuid.uuid4()), PROJECT, USER, {roomy: {VCPU: 8}})
        return filtered

    monkeypatch.setattr(manager, "_filter", another_request_fills_the_best_host)
    spec = request_spec()
    selections = scheduler.select_destinations(spec)

    assert hosts_of(selections) == ["host-next"]
    assert set(placement.get_allocations(spec["instance_uuid"])) == {selections[0].provider_uuid}


def test_move_hands_source_to_migration_and_claims_destination_together(store):
    source = add_compute("host-src", memory_mb=65536)
    add_compute("host-dst")
    instance, migration = str(uuid.uuid4()), str(uuid.uuid4())
    placement.claim(instance, PROJECT, USER, {source: resources()})
    spec = request_spec(instance, flavor=flavor(vcpus=4, memory_mb=4096), ignore_hosts=["host-src"])

    first = scheduler.select_destinations(spec, migration_uuid=migration)
    again = scheduler.select_destinations(spec, migration_uuid=migration)  # a redelivered step

    dest = first[0].provider_uuid
    assert hosts_of(first) == hosts_of(again) == ["host-dst"]
    assert placement.get_allocations(migration) == {source: resources()}
    assert placement.get_allocations(instance) == {dest: resources(vcpus=4, memory_mb=4096)}


def test_failed_move_claim_leaves_source_allocations_with_the_instance(store, monkeypatch):
    source = add_compute("host-src")
    dest = add_compute("host-dst")
    instance, migration = str(uuid.uuid4()), str(uuid.uuid4())
    placement.claim(instance, PROJECT, USER, {source: resources()})
    original = manager._filter

    def destination_fills_up(spec, migration_uuid):
        filtered = original(spec, migration_uuid)
        placement.claim(str(uuid.uuid4()), PROJECT, USER, {dest: {VCPU: 8}})
        return filtered

    monkeypatch.setattr(manager, "_filter", destination_fills_up)
    with pytest.raises(errors.NoValidHost, match="filled up before the claim"):
        scheduler.select_destinations(request_spec(instance, ignore_hosts=["host-src"]), migration_uuid=migration)

    assert placement.get_allocations(instance) == {source: resources()}
    assert placement.get_allocations(migration) == {}


def test_same_host_resize_fits_only_when_old_and_new_fit_together(store):
    rp = add_compute("host-only", vcpus=8)
    instance = str(uuid.uuid4())
    placement.claim(instance, PROJECT, USER, {rp: resources(vcpus=4)})

    with pytest.raises(errors.NoValidHost, match="PlacementCapacity removed 1"):
        scheduler.select_destinations(request_spec(instance, flavor=flavor(vcpus=6)), migration_uuid=str(uuid.uuid4()))

    migration = str(uuid.uuid4())
    scheduler.select_destinations(request_spec(instance, flavor=flavor(vcpus=4)), migration_uuid=migration)
    assert placement.get_allocations(migration) == {rp: resources(vcpus=4)}
    assert placement.get_allocations(instance) == {rp: resources(vcpus=4)}
    assert placement.usages(rp)[VCPU] == 8


def test_weighers_prefer_free_ram_unless_the_multiplier_is_negative(store, monkeypatch, attempts):
    attempts(3)
    add_compute("host-small", memory_mb=4096, vcpus=16)
    add_compute("host-medium", memory_mb=8192, vcpus=16)
    add_compute("host-large", memory_mb=16384, vcpus=16)

    assert hosts_of(scheduler.select_destinations(request_spec(), claim=False)) == [
        "host-large", "host-medium", "host-small"]

    monkeypatch.setenv("FERRY_RAM_WEIGHT_MULTIPLIER", "-1.0")
    config.reset()
    assert hosts_of(scheduler.select_destinations(request_spec(), claim=False)) == [
        "host-small", "host-medium", "host-large"]


def test_cpu_weigher_breaks_ram_ties(store, attempts):
    attempts(2)
    add_compute("host-few-cpus", vcpus=4)
    add_compute("host-many-cpus", vcpus=32)

    assert hosts_of(scheduler.select_destinations(request_spec(), claim=False)) == [
        "host-many-cpus", "host-few-cpus"]


def test_cross_cell_weigher_keeps_a_move_in_its_source_cell(store, attempts):
    attempts(2)
    add_compute("host-cell1", "cell1", memory_mb=65536)
    add_compute("host-cell2", "cell2", memory_mb=4096)

    spec = request_spec(source_cell="cell2")
    assert hosts_of(scheduler.select_destinations(spec, claim=False)) == ["host-cell2"]
    assert hosts_of(scheduler.select_destinations(request_spec(), claim=False))[0] == "host-cell1"


def test_a_move_finds_room_in_its_source_cell_beyond_placement_s_sample_of_every_cell(store, monkeypatch):
    """Candidates come in samples of every allowed cell: the one free host of the source cell is
    rarely in a sample of 5 among 31, yet a move that may leave its cell stays when it can."""
    monkeypatch.setenv("FERRY_MAX_PLACEMENT_RESULTS", "5")
    config.reset()
    add_compute("host-source", "cell1")
    for index in range(30):
        add_compute(f"host-other-{index}", "cell2")

    chosen = {scheduler.select_destinations(request_spec(allowed_cells=["cell1", "cell2"], source_cell="cell1"),
                                            claim=False)[0].host for _ in range(20)}

    assert chosen == {"host-source"}


def test_negative_cross_cell_multiplier_prefers_other_cells(store, monkeypatch):
    monkeypatch.setenv("FERRY_CROSS_CELL_MOVE_WEIGHT_MULTIPLIER", "-1000000")
    config.reset()
    add_compute("host-cell1", "cell1", memory_mb=4096)
    add_compute("host-cell2", "cell2", memory_mb=65536)

    chosen = scheduler.select_destinations(request_spec(source_cell="cell2"), claim=False)[0]
    assert chosen.host == "host-cell1"


def test_a_negative_multiplier_finds_the_other_cells_beyond_placement_s_sample_of_every_cell(store, monkeypatch):
    """The mirror of the source cell first: with a negative multiplier (a cell being emptied) the
    one free host of another allowed cell is rarely in a sample of 5 among 31, yet it is chosen."""
    monkeypatch.setenv("FERRY_MAX_PLACEMENT_RESULTS", "5")
    monkeypatch.setenv("FERRY_CROSS_CELL_MOVE_WEIGHT_MULTIPLIER", "-1000000")
    config.reset()
    add_compute("host-other", "cell2")
    for index in range(30):
        add_compute(f"host-source-{index}", "cell1")

    chosen = {scheduler.select_destinations(request_spec(allowed_cells=["cell1", "cell2"], source_cell="cell1"),
                                            claim=False)[0].host for _ in range(20)}
    # A drain's own multiplier does the same with the default setting, every cell allowed.
    monkeypatch.delenv("FERRY_CROSS_CELL_MOVE_WEIGHT_MULTIPLIER")
    config.reset()
    drain_spec = {**request_spec(source_cell="cell1"), "cross_cell_move_weight_multiplier": -1.0}
    planned = {manager.plan_destination(drain_spec).host for _ in range(20)}

    assert chosen == {"host-other"}
    assert planned == {"host-other"}


def test_aggregate_cross_cell_multiplier_overrides_config_with_the_smallest_value(store):
    add_compute("host-draining", "cell2", memory_mb=65536)
    add_compute("host-keep", "cell2", memory_mb=2048)
    add_compute("host-cell1", "cell1", memory_mb=4096)
    add_aggregate("drain", ["host-draining"], {"cross_cell_move_weight_multiplier": "-2000000"})
    add_aggregate("ordinary", ["host-draining"], {"cross_cell_move_weight_multiplier": "10"})

    # host-keep: +1e6; host-cell1: -1e6; host-draining: +1 * min(-2e6, 10) = -2e6.
    best = scheduler.select_destinations(request_spec(source_cell="cell2"), claim=False)[0]
    next_best = scheduler.select_destinations(request_spec(source_cell="cell2", ignore_hosts=["host-keep"]),
                                              claim=False)[0]
    assert (best.host, next_best.host) == ("host-keep", "host-cell1")


def test_claim_alternate_moves_the_claim_from_the_failed_destination(store, attempts):
    attempts(2)
    add_compute("host-first", memory_mb=65536)
    add_compute("host-second")
    spec = request_spec()
    first, alternate = scheduler.select_destinations(spec)

    claimed = scheduler.claim_alternate(spec, scheduler.Selection.from_dict(alternate.to_dict()))

    assert claimed.host == "host-second"
    assert placement.get_allocations(spec["instance_uuid"]) == alternate.allocations
    assert VCPU not in placement.usages(first.provider_uuid)


def test_claim_alternate_rechecks_filters_and_keeps_the_old_claim_on_failure(store, attempts):
    attempts(2)
    add_compute("host-first", memory_mb=65536)
    add_compute("host-second", "cell1")
    spec = request_spec()
    first, alternate = scheduler.select_destinations(spec)
    with cell_session("cell1") as session:
        session.execute(update(Service).where(Service.host == "host-second").values(disabled=True))

    with pytest.raises(errors.NoValidHost, match="ComputeFilter removed 1"):
        scheduler.claim_alternate(spec, alternate)
    assert placement.get_allocations(spec["instance_uuid"]) == first.allocations


def test_claim_alternate_for_a_move_keeps_the_source_with_the_migration(store, attempts):
    attempts(2)
    source = add_compute("host-src")
    add_compute("host-first", memory_mb=65536)
    add_compute("host-second")
    instance, migration = str(uuid.uuid4()), str(uuid.uuid4())
    placement.claim(instance, PROJECT, USER, {source: resources()})
    spec = request_spec(instance, ignore_hosts=["host-src"])
    first, alternate = scheduler.select_destinations(spec, migration_uuid=migration)

    scheduler.claim_alternate(spec, alternate, migration_uuid=migration)

    assert placement.get_allocations(migration) == {source: resources()}
    assert placement.get_allocations(instance) == alternate.allocations
    assert VCPU not in placement.usages(first.provider_uuid)


# --- placement's candidates: the cap, further batches, narrowing --------------------------------


@pytest.fixture
def placement_results(monkeypatch):
    def set_limit(n: int) -> None:
        monkeypatch.setenv("FERRY_MAX_PLACEMENT_RESULTS", str(n))
        config.reset()

    return set_limit


@pytest.fixture
def hosts_read(monkeypatch):
    """The hosts the scheduler built a HostState for, one list per batch placement returned."""
    batches: list[list[str]] = []
    original = manager.host_states

    def recording(candidates):
        states = original(candidates)
        batches.append([state.host for state in states])
        return states

    monkeypatch.setattr(manager, "host_states", recording)
    return batches


def test_scheduler_reads_no_more_than_max_placement_results_hosts(store, attempts, placement_results, hosts_read):
    attempts(3)
    placement_results(3)
    for n in range(10):
        add_compute(f"host-{n}", memory_mb=4096 + 1024 * n)

    selections = scheduler.select_destinations(request_spec())

    assert [len(batch) for batch in hosts_read] == [3]
    assert hosts_of(selections) == sorted(hosts_read[0], key=lambda host: -int(host.split("-")[1]))
    assert_used_counters_match_allocations()


def test_another_batch_is_read_when_too_few_hosts_of_the_first_pass(store, attempts, placement_results,
                                                                   hosts_read):
    attempts(2)
    placement_results(2)
    for n in range(8):
        add_compute(f"host-{n}", disabled=n not in (2, 6))

    selections = scheduler.select_destinations(request_spec(), claim=False)

    assert sorted(hosts_of(selections)) == ["host-2", "host-6"]
    assert all(len(batch) <= 2 for batch in hosts_read)


def test_equally_good_hosts_share_the_requests(store, placement_results):
    placement_results(2)
    for n in range(8):
        add_compute(f"host-{n}")

    chosen = {scheduler.select_destinations(request_spec(), claim=False)[0].host for _ in range(30)}

    assert len(chosen) > 1


def test_same_host_hint_and_affinity_group_ask_placement_for_their_hosts_only(store, attempts, placement_results,
                                                                            hosts_read):
    attempts(3)
    placement_results(2)
    providers = [add_compute(f"host-{n}", memory_mb=65536 if n == 0 else 8192) for n in range(6)]
    on_4 = add_instance("host-4")
    group = add_group("affinity")
    place_member(group, providers[3])
    place_member(group, providers[5])

    assert hosts_of(scheduler.select_destinations(request_spec(scheduler_hints={"same_host": [on_4]}))) == [
        "host-4"]
    spec = request_spec(join_group(group), group={"uuid": group})
    assert sorted(hosts_of(scheduler.select_destinations(spec, claim=False))) == ["host-3", "host-5"]
    assert [sorted(batch) for batch in hosts_read] == [["host-4"], ["host-3", "host-5"]]


def test_aggregate_extra_spec_asks_placement_for_the_aggregate_hosts(store, placement_results, hosts_read):
    placement_results(2)
    for n in range(6):
        add_compute(f"host-{n}", memory_mb=65536 if n < 3 else 8192)
    add_aggregate("gen2", ["host-4"], {"hw_generation": "gen2"})
    add_aggregate("gen1", ["host-0", "host-1", "host-2"], {"hw_generation": "gen1"})

    wanted = flavor(extra_specs={"aggregate_instance_extra_specs:hw_generation": "<or> gen2 <or> gen3"})
    assert hosts_of(scheduler.select_destinations(request_spec(flavor=wanted))) == ["host-4"]
    assert hosts_read == [["host-4"]]


def test_narrowed_request_that_fails_still_counts_each_filter(store, placement_results):
    placement_results(2)
    add_compute("host-gen2", disabled=True)
    for n in range(4):
        add_compute(f"host-{n}")
    add_aggregate("gen2", ["host-gen2"], {"hw_generation": "gen2"})

    with pytest.raises(errors.NoValidHost) as caught:
        scheduler.select_destinations(request_spec(flavor=flavor(extra_specs={"hw_generation": "gen2"})))

    assert "5 compute node(s)" in caught.value.message
    assert caught.value.details["removed"] == {"PlacementCapacity": 0, "ComputeFilter": 1, "IgnoreHostsFilter": 0,
                                               "AggregateInstanceExtraSpecsFilter": 4}


def test_moves_and_alternates_keep_used_counters_equal_to_allocations(store, attempts):
    attempts(2)
    source = add_compute("host-src")
    add_compute("host-first", memory_mb=65536)
    add_compute("host-second")
    instance, migration = str(uuid.uuid4()), str(uuid.uuid4())
    placement.claim(instance, PROJECT, USER, {source: resources()})
    spec = request_spec(instance, ignore_hosts=["host-src"])

    first, alternate = scheduler.select_destinations(spec, migration_uuid=migration)
    assert_used_counters_match_allocations()
    scheduler.claim_alternate(spec, alternate, migration_uuid=migration)
    assert_used_counters_match_allocations()
    placement.move_allocations(migration, instance)
    assert_used_counters_match_allocations()
    assert placement.usages(alternate.provider_uuid) == {} and placement.usages(first.provider_uuid) == {}
    assert placement.usages(source) == resources()
