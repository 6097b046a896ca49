"""Host weighers: they order the hosts that passed the filters, best first.

Each weigher gives a host a raw weight; weighers with ``normalise`` set have their raw weights
mapped onto [0, 1] across the candidates (all 0 when every candidate weighs the same). The
host's total is the sum of each weigher's weight times its multiplier for that host.
:data:`WEIGHERS` lists the enabled weighers; :func:`register` adds one.
"""

from __future__ import annotations

from typing import ClassVar

from ferry import config
from ferry.compute import server_groups
from ferry.observability import logger
from ferry.scheduler.host_state import HostState, SchedulingSpec

CROSS_CELL_MULTIPLIER_KEY = "cross_cell_move_weight_multiplier"


class BaseWeigher:
    """A weigher; subclasses implement :meth:`weigh` and :meth:`multiplier`."""

    normalise: ClassVar[bool] = True

    def weigh(self, host_state: HostState, spec: SchedulingSpec) -> float:
        raise NotImplementedError

    def multiplier(self, host_state: HostState, spec: SchedulingSpec) -> float:
        return 1.0


WEIGHERS: list[type[BaseWeigher]] = []


def register(cls: type[BaseWeigher]) -> type[BaseWeigher]:
    """Enable a weigher class."""
    if cls not in WEIGHERS:
        WEIGHERS.append(cls)
    return cls


def enabled_weighers() -> list[BaseWeigher]:
    """One instance of every enabled weigher."""
    return [cls() for cls in WEIGHERS]


def normalise(values: list[float]) -> list[float]:
    """Map ``values`` linearly onto [0, 1]; all 0 when they are all equal."""
    if not values:
        return []
    low, high = min(values), max(values)
    if high == low:
        return [0.0 for _ in values]
    return [(value - low) / (high - low) for value in values]


def weigh_hosts(hosts: list[HostState], spec: SchedulingSpec,
                weighers: list[BaseWeigher] | None = None) -> list[tuple[HostState, float]]:
    """``(host, total weight)`` for every host, heaviest first (ties by host and node name)."""
    weighers = enabled_weighers() if weighers is None else weighers
    totals = [0.0 for _ in hosts]
    for weigher in weighers:
        raw = [weigher.weigh(host, spec) for host in hosts]
        weights = normalise(raw) if weigher.normalise else raw
        for index, host in enumerate(hosts):
            totals[index] += weights[index] * weigher.multiplier(host, spec)
    ranked = sorted(zip(hosts, totals, strict=True), key=lambda pair: (-pair[1], pair[0].host, pair[0].node))
    return ranked


@register
class RAMWeigher(BaseWeigher):
    """Prefers hosts with more free RAM (a negative multiplier stacks servers instead)."""

    def weigh(self, host_state: HostState, spec: SchedulingSpec) -> float:
        return host_state.free_ram_mb

    def multiplier(self, host_state: HostState, spec: SchedulingSpec) -> float:
        return config.get().ram_weight_multiplier


@register
class CPUWeigher(BaseWeigher):
    """Prefers hosts with more free vCPUs."""

    def weigh(self, host_state: HostState, spec: SchedulingSpec) -> float:
        return host_state.free_vcpus

    def multiplier(self, host_state: HostState, spec: SchedulingSpec) -> float:
        return config.get().cpu_weight_multiplier


@register
class CrossCellWeigher(BaseWeigher):
    """For a move, +1 for hosts in the source cell and -1 for the others (nothing without a source cell).

    The multiplier is the request's own (a cell drain sets a negative one), else the smallest
    value any of the host's aggregates sets under ``cross_cell_move_weight_multiplier``, else
    that setting (a negative one pushes moves out of a cell).
    """

    normalise = False

    def weigh(self, host_state: HostState, spec: SchedulingSpec) -> float:
        if not spec.source_cell:
            return 0.0
        return 1.0 if host_state.cell == spec.source_cell else -1.0

    def multiplier(self, host_state: HostState, spec: SchedulingSpec) -> float:
        if spec.cross_cell_weight_multiplier is not None:
            return float(spec.cross_cell_weight_multiplier)
        overrides: list[float] = []
        for metadata in host_state.aggregates:
            raw = metadata.get(CROSS_CELL_MULTIPLIER_KEY)
            if raw is None:
                continue
            try:
                overrides.append(float(raw))
            except ValueError:
                logger.warning("aggregate weight multiplier is not a number",
                               extra={"host": host_state.host, "key": CROSS_CELL_MULTIPLIER_KEY, "value": raw})
        return min(overrides) if overrides else config.get().cross_cell_move_weight_multiplier


@register
class ServerGroupSoftAffinityWeigher(BaseWeigher):
    """For a ``soft-affinity`` group, prefers the hosts with more of the other members."""

    def weigh(self, host_state: HostState, spec: SchedulingSpec) -> float:
        if spec.group_policy != server_groups.SOFT_AFFINITY:
            return 0.0
        return float(spec.group_hosts.get(host_state.host, 0))

    def multiplier(self, host_state: HostState, spec: SchedulingSpec) -> float:
        return config.get().soft_affinity_weight_multiplier


@register
class ServerGroupSoftAntiAffinityWeigher(BaseWeigher):
    """For a ``soft-anti-affinity`` group, prefers the hosts with fewer of the other members."""

    def weigh(self, host_state: HostState, spec: SchedulingSpec) -> float:
        if spec.group_policy != server_groups.SOFT_ANTI_AFFINITY:
            return 0.0
        return -float(spec.group_hosts.get(host_state.host, 0))

    def multiplier(self, host_state: HostState, spec: SchedulingSpec) -> float:
        return config.get().soft_anti_affinity_weight_multiplier
