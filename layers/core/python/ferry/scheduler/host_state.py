"""The scheduler's view of a request and of the candidate hosts, and the queries that fill them in.

Placement hands the scheduler allocation candidates (providers with room for the request, a
bounded batch at a time); each becomes a :class:`HostState`, and the services (one query per
cell, the cells side by side) and aggregate metadata (one query) are read for those hosts only.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from ferry import config, errors, placement
from ferry.compute import instances, server_groups
from ferry.store import db
from ferry.store.api_models import AggregateHost, AggregateMetadata, CellMapping
from ferry.store.cell_models import Instance, Service

# Tables read on every scheduling request, with Core statements on plain connections: the ORM's
# per-session and per-statement work would be a large share of these small reads.
_CELL = CellMapping.__table__
_SERVICE = Service.__table__
_AGG_HOST = AggregateHost.__table__
_AGG_META = AggregateMetadata.__table__

# Threads that read the cell databases side by side: one pool per process (a forked child cannot
# use its parent's threads), created on first use and shared by the requests after.
_CELL_READER_THREADS = 8
_cell_readers: tuple[int, ThreadPoolExecutor] | None = None
_cell_readers_lock = threading.Lock()


def _cell_reader_pool() -> ThreadPoolExecutor:
    global _cell_readers
    with _cell_readers_lock:
        if _cell_readers is None or _cell_readers[0] != os.getpid():
            _cell_readers = (os.getpid(), ThreadPoolExecutor(max_workers=_CELL_READER_THREADS,
                                                             thread_name_prefix="ferry-cell-read"))
        return _cell_readers[1]


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
    # The server's group (see ferry.compute.server_groups): its uuid and policy, how many members
    # an anti-affinity group allows on one host, and how many other members each host holds.
    group_uuid: str | None = None
    group_policy: str | None = None
    group_max_per_host: int = 1
    group_hosts: Mapping[str, int] = field(default_factory=dict)
    source_cell: str | None = None
    # A move that may not leave its source cell: it lands there even while the cell is disabled
    # (Nova's requested destination cell without allow_cross_cell_move).
    held_to_source_cell: bool = False
    # The zone the server was asked for at creation (it stays there when it moves), or None.
    availability_zone: str | None = None
    # A multiplier for CrossCellWeigher that wins over the aggregates' and the default (a drain's).
    cross_cell_weight_multiplier: float | None = None


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


def _held_to_source_cell(request_spec: Mapping[str, Any]) -> bool:
    """Whether a move's request may not leave its source cell: its ``may_leave_cell`` (a spec
    written before it was recorded: whether its source cell is the only cell it allows)."""
    source = request_spec.get("source_cell")
    if not source:
        return False
    if "may_leave_cell" in request_spec:
        return not request_spec["may_leave_cell"]
    return list(request_spec.get("allowed_cells") or []) == [source]


def build_spec(request_spec: Mapping[str, Any]) -> SchedulingSpec:
    """Turn a request spec dict into a :class:`SchedulingSpec` (resolving the scheduler hints)."""
    flavor = request_spec["flavor"]
    hints = request_spec.get("scheduler_hints") or {}
    destination = request_spec.get("requested_destination") or {}
    group = server_groups.scheduling_group(request_spec.get("group"), request_spec["instance_uuid"])
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
        group_uuid=group.uuid if group else None,
        group_policy=group.policy if group else None,
        group_max_per_host=group.max_per_host if group else 1,
        group_hosts=dict(group.hosts) if group else {},
        source_cell=request_spec.get("source_cell"),
        held_to_source_cell=_held_to_source_cell(request_spec),
        availability_zone=request_spec.get("availability_zone") or None,
        cross_cell_weight_multiplier=request_spec.get("cross_cell_move_weight_multiplier"),
    )


# --- candidates and what the filters read about them ------------------------------------------


def host_states(candidates: Iterable[placement.Candidate]) -> list[HostState]:
    """One :class:`HostState` per allocation candidate (service and aggregates not read yet)."""
    return [
        HostState(host=c.host, node=c.name, cell=c.cell, cell_id=c.cell_id, provider_uuid=c.uuid, free=dict(c.free))
        for c in candidates
    ]


def _services_in_cell(url: str, hosts: list[str]) -> dict[str, ServiceState]:
    """``{host: ServiceState}`` of the given hosts' compute services in the cell database at ``url``."""
    with db.engine_for(url).connect() as connection:
        return {
            host: ServiceState(disabled=disabled, forced_down=forced_down, last_seen_at=last_seen_at)
            for host, disabled, forced_down, last_seen_at in connection.execute(
                select(_SERVICE.c.host, _SERVICE.c.disabled, _SERVICE.c.forced_down, _SERVICE.c.last_seen_at)
                .where(_SERVICE.c.host.in_(hosts))
            )
        }


def attach_services(hosts: list[HostState]) -> None:
    """Fill in each host's compute service: one query per cell for that cell's hosts, the cells side by side."""
    by_cell: dict[int, list[HostState]] = defaultdict(list)
    for host in hosts:
        by_cell[host.cell_id].append(host)
    if not by_cell:
        return
    with db.engine_for(config.get().api_database_url).connect() as connection:
        urls = dict(connection.execute(
            select(_CELL.c.id, _CELL.c.database_connection).where(_CELL.c.id.in_(sorted(by_cell)))
        ).all())
    names = {cell_id: sorted({host.host for host in cell_hosts}) for cell_id, cell_hosts in by_cell.items()}
    if len(by_cell) == 1:
        found = {cell_id: _services_in_cell(urls[cell_id], names[cell_id]) for cell_id in by_cell}
    else:
        # Each cell is its own database: waiting on them one after the other would add up.
        pool = _cell_reader_pool()
        futures = {cell_id: pool.submit(_services_in_cell, urls[cell_id], names[cell_id]) for cell_id in by_cell}
        found = {cell_id: future.result() for cell_id, future in futures.items()}
    for cell_id, cell_hosts in by_cell.items():
        services = found[cell_id]
        for host in cell_hosts:
            host.service = services.get(host.host)


def attach_aggregates(hosts: list[HostState]) -> None:
    """Fill in the metadata of every aggregate each host belongs to (one query for these hosts)."""
    if not hosts:
        return
    with db.engine_for(config.get().api_database_url).connect() as connection:
        rows = connection.execute(
            select(_AGG_HOST.c.host, _AGG_META.c.aggregate_id, _AGG_META.c.key, _AGG_META.c.value)
            .join_from(_AGG_HOST, _AGG_META, _AGG_META.c.aggregate_id == _AGG_HOST.c.aggregate_id)
            .where(_AGG_HOST.c.host.in_(sorted({host.host for host in hosts})))
        ).all()
    metadata: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for host, aggregate_id, key, value in rows:
        metadata[host][aggregate_id][key] = value
    for host_state in hosts:
        per_aggregate = metadata.get(host_state.host)
        host_state.aggregates = [dict(per_aggregate[k]) for k in sorted(per_aggregate)] if per_aggregate else []
