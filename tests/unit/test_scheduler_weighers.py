"""Weighers and Selection on hand-built host states (no database)."""

from __future__ import annotations

import json

import pytest

from ferry import config
from ferry.placement import MEMORY_MB, VCPU
from ferry.scheduler import Selection, weighers
from ferry.scheduler.host_state import HostState, SchedulingSpec


def host(name: str, cell: str = "cell1", ram: float = 1024, vcpus: float = 4, aggregates=None) -> HostState:
    return HostState(host=name, node=name, cell=cell, cell_id=1, provider_uuid=f"rp-{name}",
                     free={MEMORY_MB: ram, VCPU: vcpus}, aggregates=aggregates or [])


def spec(source_cell: str | None = None) -> SchedulingSpec:
    return SchedulingSpec(instance_uuid="i-1", project_id="p", user_id="u", flavor={}, resources={},
                          source_cell=source_cell)


@pytest.fixture(autouse=True)
def clean_config(monkeypatch):
    for name in ("RAM", "CPU", "CROSS_CELL_MOVE"):
        monkeypatch.delenv(f"FERRY_{name}_WEIGHT_MULTIPLIER", raising=False)
    config.reset()
    yield
    config.reset()


def test_normalise_maps_onto_unit_interval_and_flat_values_to_zero():
    assert weighers.normalise([10, 20, 30]) == [0.0, 0.5, 1.0]
    assert weighers.normalise([5, 5]) == [0.0, 0.0]
    assert weighers.normalise([]) == []


def test_ram_and_cpu_weights_are_normalised_then_multiplied(monkeypatch):
    monkeypatch.setenv("FERRY_CPU_WEIGHT_MULTIPLIER", "3.0")
    config.reset()
    ram_rich, cpu_rich = host("ram-rich", ram=8192, vcpus=2), host("cpu-rich", ram=1024, vcpus=16)

    ranked = weighers.weigh_hosts([ram_rich, cpu_rich], spec(), [weighers.RAMWeigher(), weighers.CPUWeigher()])

    assert [(h.host, w) for h, w in ranked] == [("cpu-rich", 3.0), ("ram-rich", 1.0)]


def test_ties_are_broken_by_host_name():
    ranked = weighers.weigh_hosts([host("b"), host("a")], spec())
    assert [h.host for h, _ in ranked] == ["a", "b"]


def test_cross_cell_weigher_is_plus_or_minus_one_times_multiplier():
    weigher = weighers.CrossCellWeigher()
    local, remote = host("local", "cell2"), host("remote", "cell1")

    assert weigher.weigh(local, spec("cell2")) * weigher.multiplier(local, spec("cell2")) == 1_000_000
    assert weigher.weigh(remote, spec("cell2")) * weigher.multiplier(remote, spec("cell2")) == -1_000_000
    assert weigher.weigh(local, spec()) == 0


def test_cross_cell_multiplier_takes_smallest_aggregate_override_and_skips_bad_values():
    weigher = weighers.CrossCellWeigher()
    key = weighers.CROSS_CELL_MULTIPLIER_KEY
    overridden = host("h", aggregates=[{key: "5"}, {key: "-7"}, {key: "lots"}, {"other": "1"}])

    assert weigher.multiplier(overridden, spec("cell1")) == -7
    assert weigher.multiplier(host("plain", aggregates=[{key: "lots"}]), spec("cell1")) == 1_000_000


def test_registry_enables_a_new_weigher(monkeypatch):
    monkeypatch.setattr(weighers, "WEIGHERS", list(weighers.WEIGHERS))

    @weighers.register
    class PreferB(weighers.BaseWeigher):
        normalise = False

        def weigh(self, host_state, spec):
            return 10.0 if host_state.host == "b" else 0.0

    assert PreferB in weighers.WEIGHERS
    assert [h.host for h, _ in weighers.weigh_hosts([host("a"), host("b")], spec())] == ["b", "a"]


def test_selection_survives_a_json_round_trip():
    selection = Selection(host="h", node="n", cell="cell1", provider_uuid="rp", allocations={"rp": {VCPU: 2}})
    assert Selection.from_dict(json.loads(json.dumps(selection.to_dict()))) == selection
