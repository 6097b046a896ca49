"""Request filters narrow placement's query exactly as the host filters they stand for would."""

from __future__ import annotations

import random

from placement_helpers import add_aggregate, add_compute, request_spec

from ferry import placement
from ferry.scheduler import build_spec, filters, request_filter
from ferry.scheduler.host_state import HostState, SchedulingSpec, attach_aggregates

VALUES = ["gen1", "gen2", "gen3", "ssd", "hdd"]


def random_requirement(rng: random.Random) -> str:
    form = rng.random()
    if form < 0.35:
        return "<or> " + " <or> ".join(rng.sample(VALUES, rng.randint(1, 3)))
    if form < 0.55:
        return "<in> " + rng.choice(["gen", "en2", "ss", "d", "x"])
    return rng.choice(VALUES)


def test_aggregates_for_extra_specs_match_the_aggregate_filter_host_by_host(store):
    rng = random.Random(5)
    hosts = [f"host-{n}" for n in range(12)]
    for host in hosts:
        add_compute(host)
    for n in range(8):
        metadata = {key: ",".join(rng.sample(VALUES, rng.randint(1, 2)))
                    for key in rng.sample(["hw_generation", "disk", "zone"], rng.randint(1, 2))}
        add_aggregate(f"agg-{n}", rng.sample(hosts, rng.randint(1, 5)), metadata)
    states = [HostState(host=host, node=host, cell="cell1", cell_id=0, provider_uuid=host) for host in hosts]
    attach_aggregates(states)
    aggregate_filter = filters.AggregateInstanceExtraSpecsFilter()

    for _ in range(40):
        extra_specs = {rng.choice(["hw_generation", "aggregate_instance_extra_specs:disk", "zone"]):
                       random_requirement(rng) for _ in range(rng.randint(1, 2))}
        extra_specs["hw:cpu_policy"] = "dedicated"  # scoped elsewhere: no aggregate asked about it
        spec = build_spec(request_spec(flavor={"vcpus": 1, "memory_mb": 512, "extra_specs": extra_specs}))
        request = request_filter.placement_request(spec)
        narrowed = {candidate.host for batch in placement.allocation_candidates(request, limit=1000)
                    for candidate in batch}

        assert narrowed == {state.host for state in states if aggregate_filter.host_passes(state, spec)}, extra_specs


def test_narrowing_is_left_out_when_asked_and_for_an_empty_same_host(store):
    spec = SchedulingSpec(instance_uuid="i", project_id="p", user_id="u", flavor={}, resources={"VCPU": 1},
                          extra_specs={"hw_generation": "gen1"}, same_host=frozenset(), group_policy="affinity",
                          group_hosts={"host-a": 1, "host-b": 1})

    narrowed = request_filter.placement_request(spec, exclude_consumers=["i", "i"])
    plain = request_filter.placement_request(spec, narrow=False)

    assert narrowed.hosts == frozenset({"host-a", "host-b"})
    assert narrowed.member_of == (frozenset(),)
    assert narrowed.exclude_consumers == ("i",)
    assert request_filter.is_narrowed(narrowed)
    assert (plain.hosts, plain.member_of) == (None, ())
    assert not request_filter.is_narrowed(plain)
