"""Host filters on hand-built host states (no database)."""

from __future__ import annotations

import datetime as dt

import pytest

from ferry import config
from ferry.scheduler import filters
from ferry.scheduler.host_state import HostState, SchedulingSpec, ServiceState

NOW = dt.datetime(2030, 1, 1, 12, 0, 0)


def host(name: str = "host-a", **fields) -> HostState:
    return HostState(host=name, node=name, cell="cell1", cell_id=1, provider_uuid=f"rp-{name}", **fields)


def spec(**fields) -> SchedulingSpec:
    return SchedulingSpec(instance_uuid="i-1", project_id="p", user_id="u", flavor={}, resources={}, **fields)


def up(**fields) -> ServiceState:
    values = {"disabled": False, "forced_down": False, "last_seen_at": NOW - dt.timedelta(seconds=5)}
    values.update(fields)
    return ServiceState(**values)


@pytest.fixture(autouse=True)
def down_time(monkeypatch):
    monkeypatch.setenv("FERRY_SERVICE_DOWN_TIME", "60")
    config.reset()
    yield
    config.reset()


@pytest.mark.parametrize(
    ("service", "passes"),
    [
        (up(), True),
        (up(disabled=True), False),
        (up(forced_down=True), False),
        (up(last_seen_at=NOW - dt.timedelta(seconds=61)), False),
        (up(last_seen_at=None), False),
        (None, False),
    ],
)
def test_compute_filter_wants_an_enabled_live_service(service, passes):
    assert filters.ComputeFilter(now=NOW).host_passes(host(service=service), spec()) is passes


def test_aggregate_spec_key_takes_own_scope_and_unscoped_keys_only():
    assert filters.aggregate_spec_key("aggregate_instance_extra_specs:ssd") == "ssd"
    assert filters.aggregate_spec_key("ssd") == "ssd"
    assert filters.aggregate_spec_key("hw:cpu_policy") is None


@pytest.mark.parametrize(
    ("required", "offered", "matches"),
    [
        ("gen2", {"gen2"}, True),
        ("gen2", {"gen1"}, False),
        (" gen2 ", {"gen2"}, True),
        ("<or> gen1 <or> gen3", {"gen3"}, True),
        ("<or> gen1 <or> gen3", {"gen2"}, False),
        ("<in> nvme", {"ssd-nvme"}, True),
        ("<in> nvme", {"ssd-sata"}, False),
        ("= 3", {"4"}, True),  # "=" means at least
        ("= 3", {"2"}, False),
        (">= 3", {"3"}, True),
        ("<= 3", {"4"}, False),
        ("== 4", {"4.0"}, True),  # numbers compare as numbers
        ("!= 4", {"5"}, True),
        ("= 3", {"three"}, False),  # a value that is no number matches no numeric operator
        ("s== gen4", {"gen4"}, True),
        ("s!= gen4", {"gen4"}, False),
        ("s< b", {"a"}, True),
        ("s>= b", {"a"}, False),
        ("<all-in> avx2 sse4", {"avx2,sse4,aes"}, True),
        ("<all-in> avx2 avx512", {"avx2,sse4"}, False),
        ("<in> nvme extra", {"ssd-nvme"}, True),  # <in> looks for its first word
        ("> 3", {"> 3"}, True),  # no operator: the whole value must be equal
    ],
)
def test_spec_matches(required, offered, matches):
    assert filters.spec_matches(required, offered) is matches


def test_aggregate_extra_specs_use_union_of_host_aggregates():
    aggregated = host(aggregates=[{"gen": "gen1,gen2"}, {"ssd": "true"}])
    check = filters.AggregateInstanceExtraSpecsFilter().host_passes

    assert check(aggregated, spec(extra_specs={"aggregate_instance_extra_specs:gen": "gen2", "ssd": "true"}))
    assert not check(aggregated, spec(extra_specs={"gen": "gen3"}))
    assert not check(host(), spec(extra_specs={"ssd": "true"}))
    assert check(host(), spec(extra_specs={"hw:cpu_policy": "dedicated"}))


def test_hint_and_group_filters():
    a, b = host("host-a"), host("host-b")
    assert not filters.IgnoreHostsFilter().host_passes(a, spec(ignore_hosts=frozenset({"host-a"})))
    assert filters.SameHostFilter().host_passes(a, spec())
    assert not filters.SameHostFilter().host_passes(a, spec(same_host=frozenset()))
    assert filters.SameHostFilter().host_passes(b, spec(same_host=frozenset({"host-b"})))
    assert not filters.DifferentHostFilter().host_passes(b, spec(different_host=frozenset({"host-b"})))

    affinity = spec(group_policy="affinity", group_hosts={"host-a": 1})
    assert filters.ServerGroupAffinityFilter().host_passes(a, affinity)
    assert not filters.ServerGroupAffinityFilter().host_passes(b, affinity)
    assert filters.ServerGroupAffinityFilter().host_passes(b, spec(group_policy="affinity"))
    anti = spec(group_policy="anti-affinity", group_hosts={"host-a": 1})
    assert not filters.ServerGroupAntiAffinityFilter().host_passes(a, anti)
    assert filters.ServerGroupAntiAffinityFilter().host_passes(b, anti)
    assert filters.ServerGroupAntiAffinityFilter().host_passes(a, affinity)
    two_per_host = spec(group_policy="anti-affinity", group_max_per_host=2, group_hosts={"host-a": 1, "host-b": 2})
    assert filters.ServerGroupAntiAffinityFilter().host_passes(a, two_per_host)
    assert not filters.ServerGroupAntiAffinityFilter().host_passes(b, two_per_host)


def test_a_server_asked_for_in_a_zone_passes_only_hosts_of_that_zone():
    zone_filter = filters.AvailabilityZoneFilter()
    in_az1 = host(aggregates=[{"ssd": "true"}, {"availability_zone": "az1"}])
    in_none = host(aggregates=[{"ssd": "true"}])

    assert zone_filter.host_passes(in_az1, spec(availability_zone="az1"))
    assert not zone_filter.host_passes(in_none, spec(availability_zone="az1"))
    assert zone_filter.host_passes(in_none, spec(availability_zone="nova"))  # the default zone
    assert not zone_filter.host_passes(in_az1, spec(availability_zone="nova"))
    assert zone_filter.host_passes(in_az1, spec()) and zone_filter.host_passes(in_none, spec())


def test_every_filter_is_enabled_in_order():
    assert [f.name for f in filters.enabled_filters()] == [
        "ComputeFilter", "IgnoreHostsFilter", "AggregateInstanceExtraSpecsFilter", "AvailabilityZoneFilter",
        "SameHostFilter",
        "DifferentHostFilter", "ServerGroupAffinityFilter", "ServerGroupAntiAffinityFilter",
    ]
