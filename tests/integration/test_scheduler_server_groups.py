"""Server groups in the scheduler against a real store: hard policies filter, soft ones weigh, and a
member's claim re-checks its group's policy so concurrent members never break it."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from placement_helpers import (
    PROJECT,
    USER,
    add_compute,
    add_group,
    flavor,
    join_group,
    place_member,
    request_spec,
    resources,
)

from ferry import config, errors, placement, scheduler
from ferry.compute import server_groups
from ferry.scheduler import manager


def spec_for(group_uuid: str, instance_uuid: str | None = None) -> dict:
    return request_spec(instance_uuid or join_group(group_uuid), group={"uuid": group_uuid})


def chosen(spec: dict, **options) -> str:
    return scheduler.select_destinations(spec, **options)[0].host


@pytest.fixture
def three_hosts(store):
    return {name: add_compute(name, vcpus=16, memory_mb=65536) for name in ("host-a", "host-b", "host-c")}


def test_anti_affinity_keeps_members_off_each_others_hosts(three_hosts):
    group = add_group(server_groups.ANTI_AFFINITY)
    place_member(group, three_hosts["host-a"])
    place_member(group, three_hosts["host-b"])

    assert chosen(spec_for(group)) == "host-c"
    with pytest.raises(errors.NoValidHost, match="ServerGroupAntiAffinityFilter removed 3"):
        chosen(spec_for(group))


def test_anti_affinity_allows_max_server_per_host_members_on_one_host(store):
    only = add_compute("host-a", vcpus=16, memory_mb=65536)
    group = add_group(server_groups.ANTI_AFFINITY, {server_groups.MAX_SERVER_PER_HOST: 2})
    place_member(group, only)

    assert chosen(spec_for(group)) == "host-a"
    with pytest.raises(errors.NoValidHost):
        chosen(spec_for(group))


def test_affinity_puts_members_with_the_others_and_a_first_member_anywhere(three_hosts):
    group = add_group(server_groups.AFFINITY)
    first = chosen(spec_for(group))

    assert {chosen(spec_for(group)) for _ in range(3)} == {first}


def test_a_members_own_place_does_not_count_when_it_moves(store):
    # GIVEN the only member of an anti-affinity group, on the only host
    only = add_compute("host-a", vcpus=16, memory_mb=65536)
    group = add_group(server_groups.ANTI_AFFINITY)
    member = place_member(group, only)

    # WHEN it is resized (on its own host), THEN its own place does not count against it
    assert chosen(spec_for(group, member), claim=False) == "host-a"
    # but another member there does
    place_member(group, only)
    with pytest.raises(errors.NoValidHost):
        chosen(spec_for(group, member), claim=False)


def test_affinity_member_of_a_full_group_cannot_move_elsewhere(three_hosts):
    group = add_group(server_groups.AFFINITY)
    place_member(group, three_hosts["host-a"])
    mover = place_member(group, three_hosts["host-a"])

    spec = spec_for(group, mover)
    spec["ignore_hosts"] = ["host-a"]  # a migrate leaves its own host out

    with pytest.raises(errors.NoValidHost, match="ServerGroupAffinityFilter"):
        scheduler.select_destinations(spec, migration_uuid=str(uuid.uuid4()))
    assert placement.get_allocations(mover) == {three_hosts["host-a"]: resources()}


def test_soft_policies_weigh_but_never_refuse(store, monkeypatch):
    # The members use room on their host, which the RAM and vCPU weighers count against it: the
    # groups' weighers are given more weight than both, as an operator who wants them to win does.
    monkeypatch.setenv("FERRY_SOFT_AFFINITY_WEIGHT_MULTIPLIER", "10")
    monkeypatch.setenv("FERRY_SOFT_ANTI_AFFINITY_WEIGHT_MULTIPLIER", "10")
    config.reset()
    a = add_compute("host-a", vcpus=16, memory_mb=65536)
    add_compute("host-b", vcpus=16, memory_mb=65536)
    together = add_group(server_groups.SOFT_AFFINITY)
    place_member(together, a)
    assert chosen(spec_for(together), claim=False) == "host-a"

    apart = add_group(server_groups.SOFT_ANTI_AFFINITY)
    place_member(apart, a)
    assert chosen(spec_for(apart), claim=False) == "host-b"
    # Both hosts taken: still placed (on one of them), never refused.
    place_member(apart, placement.provider_by_host("host-b"))
    assert chosen(spec_for(apart), claim=False) in {"host-a", "host-b"}


def moved_to_host_b(group: str, provider: str) -> tuple[str, str]:
    """(member, migration): a new member of ``group`` on ``provider`` (host-a's), its move claimed on host-b."""
    mover = place_member(group, provider)
    migration = str(uuid.uuid4())
    spec = spec_for(group, mover)
    spec["ignore_hosts"] = ["host-a", "host-c"]
    assert chosen(spec, migration_uuid=migration) == "host-b"
    return mover, migration


def test_a_moving_member_holds_its_source_until_the_move_ends_so_a_revert_never_joins_another(three_hosts):
    # GIVEN an anti-affinity member on host-a moving to host-b (its source held by the migration)
    group = add_group(server_groups.ANTI_AFFINITY)
    mover, migration = moved_to_host_b(group, three_hosts["host-a"])

    # WHEN another member is booted, THEN neither the source nor the destination is free for it
    newcomer = join_group(group)
    assert chosen(spec_for(group, newcomer)) == "host-c"

    # and the move reverted puts the mover back alone on its source
    placement.revert_move_allocations(migration, mover, claimed={three_hosts["host-b"]: resources()})
    assert placement.get_allocations(mover) == {three_hosts["host-a"]: resources()}
    assert placement.get_allocations(newcomer) == {three_hosts["host-c"]: resources()}


def test_an_affinity_member_on_the_move_draws_newcomers_to_where_it_goes(store):
    # GIVEN the only member of an affinity group moved from host-a, the host the weighers prefer, to host-b
    roomy = add_compute("host-a", vcpus=16, memory_mb=131072)
    add_compute("host-b", vcpus=16, memory_mb=65536)
    add_compute("host-c", vcpus=16, memory_mb=65536)
    group = add_group(server_groups.AFFINITY)
    mover, migration = moved_to_host_b(group, roomy)

    # WHEN another member is booted while it waits in VERIFY_RESIZE
    newcomer = join_group(group)

    # THEN it joins the mover on its destination, where the confirm leaves it
    assert chosen(spec_for(group, newcomer)) == "host-b"
    placement.delete_allocations(migration)
    assert {host for member in (mover, newcomer) for host in placement.get_allocations(member)} \
        == {placement.provider_by_host("host-b")}


def test_a_deleted_group_constrains_nothing(three_hosts):
    group = add_group(server_groups.ANTI_AFFINITY)
    for name in ("host-a", "host-b", "host-c"):
        place_member(group, three_hosts[name])
    spec = spec_for(group)
    server_groups.delete_group(group)

    assert chosen(spec) in three_hosts


def test_a_member_placed_during_the_search_sends_the_claim_elsewhere(three_hosts, monkeypatch):
    # GIVEN an anti-affinity group, and another member claiming the first choice while the scheduler
    # ranks the hosts (after it read where the members are)
    group = add_group(server_groups.ANTI_AFFINITY)
    real_filter = manager._filter
    rival: dict[str, str] = {}

    def filter_then_rival_claims(spec, excluded, pending=None):
        filtered = real_filter(spec, excluded, pending)
        if not rival:
            best = manager.host_weighers.weigh_hosts(filtered.hosts, spec)[0][0]
            rival["host"] = best.host
            place_member(group, best.provider_uuid)
        return filtered

    monkeypatch.setattr(manager, "_filter", filter_then_rival_claims)
    member = join_group(group)

    # WHEN the member is scheduled, THEN its claim is refused there and it lands on another host
    spec = spec_for(group, member)
    host = chosen(spec)
    assert host != rival["host"]
    assert placement.get_allocations(member) == {three_hosts[host]: resources()}


def test_the_guard_refuses_a_claim_that_breaks_the_policy_and_writes_nothing(three_hosts):
    group = add_group(server_groups.AFFINITY)
    place_member(group, three_hosts["host-a"])
    member = join_group(group)
    guard = server_groups.claim_guard(group, member, "host-b")

    with pytest.raises(errors.GroupPolicyConflict, match="host-b"):
        placement.claim(member, PROJECT, USER, {three_hosts["host-b"]: resources()}, guard=guard)
    assert placement.get_allocations(member) == {}


def test_alternates_of_an_anti_affinity_member_are_checked_again_when_claimed(three_hosts):
    group = add_group(server_groups.ANTI_AFFINITY)
    member = join_group(group)
    spec = spec_for(group, member)
    first, *alternates = scheduler.select_destinations(spec)
    assert alternates
    place_member(group, three_hosts[alternates[0].host])  # another member took the alternate meanwhile

    with pytest.raises(errors.NoValidHost, match="ServerGroupAntiAffinityFilter removed 1"):
        scheduler.claim_alternate(spec, alternates[0])
    assert placement.get_allocations(member) == {three_hosts[first.host]: resources()}


def _boot_member(group: str, barrier: threading.Barrier) -> str:
    spec = spec_for(group)
    spec["flavor"] = flavor(vcpus=1, memory_mb=512, root_gb=1)
    barrier.wait(timeout=60)
    try:
        return scheduler.select_destinations(spec)[0].host
    except errors.NoValidHost:
        return "none"


def test_members_booted_at_once_never_share_a_host(pg_store):
    # GIVEN six roomy hosts and an anti-affinity group
    for index in range(6):
        add_compute(f"host-{index}", vcpus=64, memory_mb=262144)
    group = add_group(server_groups.ANTI_AFFINITY)
    racers = 8
    barrier = threading.Barrier(racers)

    # WHEN eight members are scheduled at the same moment
    with ThreadPoolExecutor(max_workers=racers) as pool:
        outcomes = list(pool.map(lambda _: _boot_member(group, barrier), range(racers)))

    # THEN six got a host each, all different, and the two left found none
    placed = [host for host in outcomes if host != "none"]
    assert len(placed) == len(set(placed)) == 6
    assert outcomes.count("none") == 2



@pytest.mark.parametrize(("policy", "counted"), [
    ("anti-affinity", {"src": 2, "dest-1": 1, "dest-2": 1}),
    ("soft-anti-affinity", {"src": 2, "dest-1": 1, "dest-2": 1}),
    ("affinity", {"dest-1": 1, "dest-2": 1}),
    ("soft-affinity", {"dest-1": 1, "dest-2": 1}),
])
def test_members_planned_to_move_count_where_their_policy_counts_a_move_under_way(policy, counted):
    # Two members on src planned to move away: keeping apart they count on both ends (a revert
    # brings them back unasked), keeping together where they go only.
    planned = [("src", "dest-1"), ("src", "dest-2")]

    assert server_groups.with_planned(policy, {"src": 2}, planned) == counted
