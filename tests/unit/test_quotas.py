"""Quota arithmetic and messages (no database)."""

from __future__ import annotations

import pytest

from ferry import config, errors, quotas
from ferry.compute import states
from ferry.store.cell_models import Instance

SMALL = {"vcpus": 1, "memory_mb": 512}
MEDIUM = {"vcpus": 2, "memory_mb": 1024}
ODD = {"vcpus": 4, "memory_mb": 256}


@pytest.fixture(autouse=True)
def fresh_settings():
    """Settings are cached: read them again after the test changed the environment."""
    yield
    config.reset()


def test_the_message_is_novas():
    message = quotas.over_quota_message([quotas.Headroom("cores", limit=20, used=18, requested=4)])

    assert message == "Quota exceeded for cores: Requested 4, but already used 18 of 20 cores"


def test_the_message_lists_every_resource_over_in_order():
    message = quotas.over_quota_message([quotas.Headroom("ram", 1024, 512, 3584),
                                         quotas.Headroom("cores", 2, 1, 3)])

    assert message == "Quota exceeded for cores, ram: Requested 3, 3584, but already used 1, 512 of 2, 1024 cores, ram"


@pytest.mark.parametrize(("limit", "used", "requested", "over"), [
    (20, 18, 2, False), (20, 18, 3, True), (-1, 10**9, 10**9, False), (0, 0, 1, True), (0, 0, 0, False),
])
def test_headroom(limit, used, requested, over):
    assert quotas.Headroom("cores", limit, used, requested).over is over


@pytest.mark.parametrize(("vm_state", "task_state", "expected"), [
    (states.ACTIVE, None, (2, 1024)),
    (states.ACTIVE, states.RESIZE_PREP, (4, 1024)),
    (states.ACTIVE, states.RESIZE_MIGRATED, (4, 1024)),
    (states.RESIZED, None, (4, 1024)),
    (states.RESIZED, states.RESIZE_REVERTING, (4, 1024)),
    (states.STOPPED, None, (2, 1024)),
])
def test_a_moving_server_counts_the_larger_of_each_resource(vm_state, task_state, expected):
    instance = Instance(flavor=MEDIUM, old_flavor=ODD, new_flavor=MEDIUM, vm_state=vm_state, task_state=task_state)

    assert quotas.instance_usage(instance) == expected


def test_a_server_without_move_flavors_counts_its_flavor():
    assert quotas.instance_usage(Instance(flavor=SMALL, vm_state=states.RESIZED)) == (1, 512)


def test_defaults_are_novas_and_can_be_changed(monkeypatch):
    for name in ("FERRY_QUOTA_INSTANCES", "FERRY_QUOTA_CORES", "FERRY_QUOTA_RAM"):
        monkeypatch.delenv(name, raising=False)
    config.reset()
    assert {k: quotas.defaults()[k] for k in ("instances", "cores", "ram")} == \
        {"instances": 10, "cores": 20, "ram": 51200}

    monkeypatch.setenv("FERRY_QUOTA_INSTANCES", "3")
    monkeypatch.setenv("FERRY_QUOTA_RAM", "-1")
    config.reset()
    assert (quotas.defaults()["instances"], quotas.defaults()["ram"]) == (3, -1)


@pytest.mark.parametrize("value", ["ten", "-2", "1.5"])
def test_an_invalid_default_is_refused(monkeypatch, value):
    monkeypatch.setenv("FERRY_QUOTA_CORES", value)
    config.reset()

    with pytest.raises(errors.InvalidQuotaDefault):
        quotas.defaults()


def test_upsize_deltas_count_growth_only():
    from ferry.compute.moves import upsize_deltas

    assert upsize_deltas(SMALL, MEDIUM) == {"cores": 1, "ram": 512}
    assert upsize_deltas(MEDIUM, SMALL) == {}
    assert upsize_deltas(MEDIUM, ODD) == {"cores": 2}
