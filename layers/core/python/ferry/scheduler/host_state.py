"""The scheduler's view of a request and of the candidate hosts, and the queries that build them.

The capacity pre-filter is one SQL query over resource providers, inventories and
allocations: it groups by provider and keeps only those where every requested resource class
still has room, so the filters and weighers only ever see hosts that could take the server.
Services are then read with one query per cell and aggregate metadata with one query in all.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Integer, and_, case, func, literal, or_, select

from ferry import errors, placement
from ferry.compute import instances
from ferry.store import db
from ferry.store.api_models import (
    AggregateHost,
    AggregateMetadata,
    Allocation,
    CellMapping,
    HostMapping,
    Inventory,
    ResourceProvider,
)
from ferry.store.cell_models import Instance, Service


@dataclass(frozen=True)
class ServiceState:
    """The parts of a compute service record the filters look at."""

    disabled: bool
    forced_down: bool
    last_seen_at: dt.datetime | None


@dataclass
class HostState:
    """One candidate compute node: where it is, what it has free, its service and aggregates.

    ``free`` is ``{resource_class: capacity - used}`` counting every allocation except those the
    claim will replace. ``aggregates`` holds the metadata of each aggregate the host is in.
    """

    host: str
    node: str
    cell: str
    cell_id: int
    provider_uuid: str
    free: dict[str, float] = field(default_factory=dict)
    service: ServiceState | None = None
    aggregates: list[dict[str, str]] = field(default_factory=list)

    @property
    def free_ram_mb(self) -> float:
        return self.free.get(placement.MEMORY_MB, 0.0)

    @property
    def free_vcpus(self) -> float:
        return self.free.get(placement.VCPU, 0.0)


@dataclass(frozen=True)
class SchedulingSpec:
    """A request spec with what the filters need worked out once (hosts of hinted instances).

    ``same_host`` is None when the hint was not given; otherwise the hosts of the named
    instances that could be found (possibly none, so no host passes).
    """

    instance_uuid: str
    project_id: str
    user_id: str
    flavor: Mapping[str, Any]
    resources: Mapping[str, int]
    extra_specs: Mapping[str, str] = field(default_factory=dict)
    ignore_hosts: frozenset[str] = frozenset()
    requested_host: str | None = None
    requested_node: str | None = None
    requested_cell: str | None = None
    allowed_cells: tuple[str, ...] | None = None
    same_host: frozenset[str] | None = None
    different_host: frozenset[str] = frozenset()
    group_policy: str | None = None
    group_hosts: frozenset[str] = frozenset()
    source_cell: str | None = None


def hosts_of_instances(instance_uuids: Iterable[str]) -> set[str]:
    """The hosts the given instances live on (instances that cannot be found are left out).

    Each instance is looked up in the cell its instance mapping names; one query per cell.
    """
    by_cell: dict[str, set[str]] = defaultdict(set)
    urls: dict[str, str] = {}
    for uuid in set(instance_uuids):
        try:
            cell = instances.cell_of(uuid)
        except errors.InstanceNotFound:
            continue
        by_cell[cell.name].add(uuid)
        urls[cell.name] = cell.database_connection
    hosts: set[str] = set()
    for cell_name, uuids in by_cell.items():
        with db.session_for(urls[cell_name]) as session:
            hosts.update(
                host
                for host in session.scalars(
                    select(Instance.host).where(Instance.uuid.in_(uuids), Instance.deleted.is_(False))
                )
                if host
            )
    return hosts


def build_spec(request_spec: Mapping[str, Any]) -> SchedulingSpec:
    """Turn a request spec dict into a :class:`SchedulingSpec` (resolving the scheduler hints)."""
    flavor = request_spec["flavor"]
    hints = request_spec.get("scheduler_hints") or {}
    destination = request_spec.get("requested_destination") or {}
    group = request_spec.get("group") or {}
    allowed = request_spec.get("allowed_cells")
    same_host = hints.get("same_host")
    if isinstance(same_host, str):
        same_host = [same_host]
    different_host = hints.get("different_host") or []
    if isinstance(different_host, str):
        different_host = [different_host]
    return SchedulingSpec(
        instance_uuid=request_spec["instance_uuid"],
        project_id=request_spec.get("project_id") or "",
        user_id=request_spec.get("user_id") or "",
        flavor=flavor,
        resources=placement.resources_from_flavor(flavor, bool(request_spec.get("is_bfv"))),
        extra_specs=dict(flavor.get("extra_specs") or {}),
        ignore_hosts=frozenset(request_spec.get("ignore_hosts") or ()),
        requested_host=destination.get("host"),
        requested_node=destination.get("node"),
        requested_cell=destination.get("cell"),
        allowed_cells=None if allowed is None else tuple(allowed),
        same_host=None if not same_host else frozenset(hosts_of_instances(same_host)),
        different_host=frozenset(hosts_of_instances(different_host)) if different_host else frozenset(),
        group_policy=group.get("policy"),
        group_hosts=frozenset(group.get("hosts") or ()),
        source_cell=request_spec.get("source_cell"),
    )


# --- the capacity pre-filter --------------------------------------------------------------------


def _placement_scope(spec: SchedulingSpec) -> list[Any]:
    """WHERE clauses that limit providers to the allowed cells and the requested destination."""
    clauses: list[Any] = [CellMapping.disabled.is_(False)]
    if spec.allowed_cells is None:
        clauses.append(CellMapping.name != db.CELL0_NAME)
    else:
        clauses.append(CellMapping.name.in_(spec.allowed_cells))
    if spec.requested_cell:
        clauses.append(CellMapping.name == spec.requested_cell)
    if spec.requested_host:
        clauses.append(ResourceProvider.host == spec.requested_host)
    if spec.requested_node:
        clauses.append(ResourceProvider.name == spec.requested_node)
    return clauses


def count_in_scope(spec: SchedulingSpec) -> int:
    """How many compute nodes the request could consider before capacity is looked at."""
    with db.api_session() as session:
        return session.scalar(
            select(func.count(ResourceProvider.id))
            .join(HostMapping, HostMapping.host == ResourceProvider.host)
            .join(CellMapping, CellMapping.id == HostMapping.cell_id)
            .where(*_placement_scope(spec))
        ) or 0


def hosts_with_capacity(spec: SchedulingSpec, *, exclude_consumers: Iterable[str] = ()) -> list[HostState]:
    """The compute nodes in scope with room for ``spec.resources``, in one query.

    Params:
        spec: the request.
        exclude_consumers: consumers whose allocations do not count as used (the ones the
            claim will replace).
    """
    excluded = sorted(set(exclude_consumers))
    usage_query = select(
        Allocation.resource_provider_id.label("rp_id"),
        Allocation.resource_class.label("rc"),
        func.sum(Allocation.used).label("used"),
    ).group_by(Allocation.resource_provider_id, Allocation.resource_class)
    if excluded:
        usage_query = usage_query.where(Allocation.consumer_uuid.not_in(excluded))
    usage = usage_query.subquery("usage")

    room = (Inventory.total - Inventory.reserved) * Inventory.allocation_ratio
    used = func.coalesce(usage.c.used, 0)
    free = room - used

    def free_of(rc: str) -> Any:
        return func.max(case((Inventory.resource_class == rc, free))).label(f"free_{rc}")

    query = (
        select(
            ResourceProvider.uuid,
            ResourceProvider.name,
            ResourceProvider.host,
            CellMapping.id.label("cell_id"),
            CellMapping.name.label("cell_name"),
            *(free_of(rc) for rc in placement.RESOURCE_CLASSES),
        )
        .join(HostMapping, HostMapping.host == ResourceProvider.host)
        .join(CellMapping, CellMapping.id == HostMapping.cell_id)
        .join(Inventory, Inventory.resource_provider_id == ResourceProvider.id)
        .outerjoin(usage, and_(usage.c.rp_id == Inventory.resource_provider_id, usage.c.rc == Inventory.resource_class))
        .where(*_placement_scope(spec))
        .group_by(ResourceProvider.id, ResourceProvider.uuid, ResourceProvider.name, ResourceProvider.host,
                  CellMapping.id, CellMapping.name)
    )
    if spec.resources:
        fits_one_class = [
            and_(
                Inventory.resource_class == rc,
                used + amount <= room,
                Inventory.min_unit <= amount,
                Inventory.max_unit >= amount,
                literal(amount, Integer) % Inventory.step_size == 0,
            )
            for rc, amount in sorted(spec.resources.items())
        ]
        classes_that_fit = func.sum(case((or_(*fits_one_class), 1), else_=0))
        query = query.having(classes_that_fit == len(spec.resources))

    with db.api_session() as session:
        rows = session.execute(query).all()
    return [
        HostState(
            host=row.host,
            node=row.name,
            cell=row.cell_name,
            cell_id=row.cell_id,
            provider_uuid=row.uuid,
            free={rc: float(getattr(row, f"free_{rc}")) for rc in placement.RESOURCE_CLASSES
                  if getattr(row, f"free_{rc}") is not None},
        )
        for row in rows
    ]


def attach_services(hosts: list[HostState]) -> None:
    """Fill in each host's compute service: one query per cell, not per host."""
    by_cell: dict[int, list[HostState]] = defaultdict(list)
    for host in hosts:
        by_cell[host.cell_id].append(host)
    if not by_cell:
        return
    with db.api_session() as session:
        urls = dict(session.execute(
            select(CellMapping.id, CellMapping.database_connection).where(CellMapping.id.in_(by_cell))
        ).all())
    for cell_id, cell_hosts in by_cell.items():
        with db.session_for(urls[cell_id]) as session:
            services = {
                row.host: ServiceState(disabled=row.disabled, forced_down=row.forced_down,
                                       last_seen_at=row.last_seen_at)
                for row in session.execute(
                    select(Service.host, Service.disabled, Service.forced_down, Service.last_seen_at)
                )
            }
        for host in cell_hosts:
            host.service = services.get(host.host)


def attach_aggregates(hosts: list[HostState]) -> None:
    """Fill in the metadata of every aggregate each host belongs to (one query in all)."""
    if not hosts:
        return
    with db.api_session() as session:
        rows = session.execute(
            select(AggregateHost.host, AggregateMetadata.aggregate_id, AggregateMetadata.key, AggregateMetadata.value)
            .join(AggregateMetadata, AggregateMetadata.aggregate_id == AggregateHost.aggregate_id)
        ).all()
    metadata: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for host, aggregate_id, key, value in rows:
        metadata[host][aggregate_id][key] = value
    for host_state in hosts:
        per_aggregate = metadata.get(host_state.host)
        host_state.aggregates = [dict(per_aggregate[k]) for k in sorted(per_aggregate)] if per_aggregate else []
