"""Pure placement arithmetic: flavor to resources, capacity."""

from __future__ import annotations

from ferry import placement
from ferry.placement import DISK_GB, MEMORY_MB, VCPU


def flavor(**fields):
    base = {"vcpus": 2, "memory_mb": 2048, "root_gb": 20, "ephemeral_gb": 5, "swap": 1500}
    base.update(fields)
    return base


def test_disk_is_root_plus_ephemeral_plus_swap_rounded_up_to_gb():
    assert placement.resources_from_flavor(flavor(), is_bfv=False) == {VCPU: 2, MEMORY_MB: 2048, DISK_GB: 27}


def test_volume_backed_root_disk_is_not_on_the_host():
    assert placement.resources_from_flavor(flavor(), is_bfv=True)[DISK_GB] == 7


def test_zero_amounts_are_left_out():
    resources = placement.resources_from_flavor(flavor(root_gb=0, ephemeral_gb=0, swap=0), is_bfv=False)
    assert resources == {VCPU: 2, MEMORY_MB: 2048}


def test_swap_of_exactly_one_gb_adds_one():
    assert placement.resources_from_flavor(flavor(root_gb=0, ephemeral_gb=0, swap=1024), is_bfv=False)[DISK_GB] == 1


def test_capacity_subtracts_reserved_before_applying_the_ratio():
    assert placement.capacity(total=16, reserved=4, allocation_ratio=1.5) == 18
