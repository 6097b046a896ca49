"""Small builders for placement and scheduler tests: compute hosts, aggregates, instances, specs."""

from __future__ import annotations

import datetime as dt
import uuid as uuidlib
from typing import Any

from sqlalchemy import func, select

from ferry import placement
from ferry.store import setup
from ferry.store.api_models import (
    Aggregate,
    AggregateHost,
    AggregateMetadata,
    Allocation,
    CellMapping,
    InstanceGroup,
    InstanceGroupMember,
    InstanceMapping,
    Inventory,
    utcnow,
)
from ferry.store.cell_models import Instance, Service
from ferry.store.db import api_session, cell_session

PROJECT = "project-a"
USER = "user-a"


def cell_id(cell: str) -> int:
    with api_session() as session:
        return session.scalars(select(CellMapping.id).where(CellMapping.name == cell)).one()


def add_compute(host: str, cell: str = "cell1", *, vcpus: int = 8, memory_mb: int = 8192, disk_gb: int = 100,
                reserved: dict[str, int] | None = None, ratio: float = 1.0, service: bool = True,
                disabled: bool = False, forced_down: bool = False, last_seen_at: dt.datetime | None = None,
                node: str | None = None) -> str:
    """Map ``host`` to ``cell``, give it a provider with the given inventory (allocation ratio ``ratio``
    for every class) and, unless ``service=False``, a compute service that reported just now."""
    setup.map_host(host, cell)
    reserved = reserved or {}
    inventory = {
        rc: {"total": total, "reserved": reserved.get(rc, 0), "allocation_ratio": ratio}
        for rc, total in ((placement.VCPU, vcpus), (placement.MEMORY_MB, memory_mb), (placement.DISK_GB, disk_gb))
    }
    rp_uuid = placement.ensure_provider(host, node or host, cell_id(cell), inventory)
    if service:
        with cell_session(cell) as session:
            session.add(Service(host=host, disabled=disabled, forced_down=forced_down,
                                last_seen_at=last_seen_at or utcnow()))
    return rp_uuid


def add_aggregate(name: str, hosts: list[str], metadata: dict[str, str]) -> None:
    with api_session() as session:
        aggregate = Aggregate(name=name)
        aggregate.hosts = [AggregateHost(host=host) for host in hosts]
        aggregate.metadata_items = [AggregateMetadata(key=k, value=v) for k, v in metadata.items()]
        session.add(aggregate)


def add_instance(host: str, cell: str = "cell1", instance_uuid: str | None = None) -> str:
    """An instance record on ``host`` in ``cell`` with its instance mapping."""
    instance_uuid = instance_uuid or str(uuidlib.uuid4())
    with cell_session(cell) as session:
        session.add(Instance(uuid=instance_uuid, display_name="vm", project_id=PROJECT, user_id=USER,
                             flavor={}, host=host, node=host))
    with api_session() as session:
        session.add(InstanceMapping(instance_uuid=instance_uuid, project_id=PROJECT, user_id=USER,
                                    cell_id=cell_id(cell)))
    return instance_uuid


def flavor(vcpus: int = 2, memory_mb: int = 2048, root_gb: int = 10, ephemeral_gb: int = 0, swap: int = 0,
           extra_specs: dict[str, str] | None = None) -> dict[str, Any]:
    return {"flavorid": f"f-{vcpus}-{memory_mb}-{root_gb}", "name": f"test.{vcpus}c{memory_mb}m", "vcpus": vcpus,
            "memory_mb": memory_mb, "root_gb": root_gb, "ephemeral_gb": ephemeral_gb, "swap": swap,
            "extra_specs": extra_specs or {}}


def request_spec(instance_uuid: str | None = None, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "instance_uuid": instance_uuid or str(uuidlib.uuid4()),
        "project_id": PROJECT,
        "user_id": USER,
        "flavor": flavor(),
        "is_bfv": False,
        "ignore_hosts": [],
        "requested_destination": None,
        "allowed_cells": None,
        "scheduler_hints": {},
        "group": None,
    }
    spec.update(overrides)
    return spec


def resources(vcpus: int = 2, memory_mb: int = 2048, disk_gb: int = 10) -> dict[str, int]:
    return {placement.VCPU: vcpus, placement.MEMORY_MB: memory_mb, placement.DISK_GB: disk_gb}


def assert_used_counters_match_allocations() -> None:
    """Every inventory's ``used`` counter equals the sum of the allocations of its provider and class."""
    with api_session() as session:
        counters = {
            (rp_id, rc): used
            for rp_id, rc, used in session.execute(
                select(Inventory.resource_provider_id, Inventory.resource_class, Inventory.used))
            if used
        }
        sums = {
            (rp_id, rc): int(total)
            for rp_id, rc, total in session.execute(
                select(Allocation.resource_provider_id, Allocation.resource_class, func.sum(Allocation.used))
                .group_by(Allocation.resource_provider_id, Allocation.resource_class))
        }
    assert counters == sums



def add_group(policy: str, rules: dict[str, int] | None = None) -> str:
    """A server group of PROJECT with ``policy``; returns its uuid."""
    with api_session() as session:
        group = InstanceGroup(name="group", project_id=PROJECT, user_id=USER, policy=policy, rules=rules or {})
        session.add(group)
        session.flush()
        return group.uuid


def join_group(group_uuid: str, instance_uuid: str | None = None) -> str:
    """Make ``instance_uuid`` (a new uuid by default) a member of the group; returns it."""
    instance_uuid = instance_uuid or str(uuidlib.uuid4())
    with api_session() as session:
        group_id = session.scalars(select(InstanceGroup.id).where(InstanceGroup.uuid == group_uuid)).one()
        session.add(InstanceGroupMember(group_id=group_id, instance_uuid=instance_uuid))
    return instance_uuid


def place_member(group_uuid: str, rp_uuid: str) -> str:
    """A member of the group whose allocations are on ``rp_uuid`` (an earlier boot placed it there)."""
    member = join_group(group_uuid)
    placement.claim(member, PROJECT, USER, {rp_uuid: resources()})
    return member
