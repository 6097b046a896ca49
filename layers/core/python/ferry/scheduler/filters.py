"""Host filters: each decides, for one candidate host, whether the request may land there.

A filter is a small class with ``host_passes(host_state, spec)``. :data:`FILTERS` lists the
enabled filters in the order they run; :func:`register` adds one. A requested destination
runs through every filter like any other host.
"""

from __future__ import annotations

import datetime as dt
import operator
from collections.abc import Callable
from typing import ClassVar

from ferry import config
from ferry.compute import aggregates, server_groups
from ferry.scheduler.host_state import HostState, SchedulingSpec
from ferry.store.api_models import utcnow

AGGREGATE_SPEC_SCOPE = "aggregate_instance_extra_specs"


class BaseHostFilter:
    """A filter; subclasses implement :meth:`host_passes`."""

    name: ClassVar[str] = "BaseHostFilter"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.__name__

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        raise NotImplementedError

    def filter_all(self, hosts: list[HostState], spec: SchedulingSpec) -> list[HostState]:
        """The hosts that pass, in their original order."""
        return [host for host in hosts if self.host_passes(host, spec)]


FILTERS: list[type[BaseHostFilter]] = []


def register(cls: type[BaseHostFilter]) -> type[BaseHostFilter]:
    """Enable a filter class (it runs after the ones registered before it)."""
    if cls not in FILTERS:
        FILTERS.append(cls)
    return cls


def enabled_filters() -> list[BaseHostFilter]:
    """One instance of every enabled filter, in running order."""
    return [cls() for cls in FILTERS]


@register
class ComputeFilter(BaseHostFilter):
    """Only hosts whose compute service is enabled, not forced down, and heard from recently."""

    def __init__(self, now: dt.datetime | None = None) -> None:
        self.now = now or utcnow()
        self.down_after = dt.timedelta(seconds=config.get().service_down_time)

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        service = host_state.service
        if service is None or service.disabled or service.forced_down or service.last_seen_at is None:
            return False
        return self.now - service.last_seen_at <= self.down_after


@register
class IgnoreHostsFilter(BaseHostFilter):
    """Leaves out the hosts the request says to ignore (for example the source of a cold migration)."""

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        return host_state.host not in spec.ignore_hosts


def aggregate_spec_key(key: str) -> str | None:
    """The aggregate metadata key a flavor extra spec asks about, or None when it is scoped elsewhere."""
    if ":" not in key:
        return key
    scope, _, rest = key.partition(":")
    return rest if scope == AGGREGATE_SPEC_SCOPE else None


# Extra spec value operators: the first word of the value, then the operand(s).
_NUMERIC_OPS: dict[str, Callable[[float, float], bool]] = {
    "=": operator.ge,  # at least: "= 4" is met by 4 or more
    "==": operator.eq, "!=": operator.ne, ">=": operator.ge, "<=": operator.le,
}
_STRING_OPS: dict[str, Callable[[str, str], bool]] = {
    "s==": operator.eq, "s!=": operator.ne, "s<": operator.lt, "s<=": operator.le, "s>": operator.gt,
    "s>=": operator.ge,
}


def value_matches(required: str, value: str) -> bool:
    """Whether one offered aggregate ``value`` satisfies the extra spec value ``required``.

    ``required`` is a plain value (equal, surrounding spaces ignored), or an operator and its
    operand: ``= n`` (a number at least n), ``== n``, ``!= n``, ``>= n``, ``<= n`` (numbers),
    ``s== t``, ``s!= t``, ``s< t``, ``s<= t``, ``s> t``, ``s>= t`` (strings), ``<in> t`` (the
    value contains t), ``<all-in> t u …`` (it contains each), ``<or> a <or> b …`` (it is one of
    them). A number that does not parse matches nothing.
    """
    words = required.split()
    if not words:
        return value == required
    op, operands = words[0], words[1:]
    if op == "<or>":
        return value in {part.strip() for part in required.split("<or>") if part.strip()}
    if op == "<in>":
        return bool(operands) and operands[0] in value
    if op == "<all-in>":
        return bool(operands) and all(word in value for word in operands)
    if op in _NUMERIC_OPS and operands:
        try:
            return _NUMERIC_OPS[op](float(value), float(operands[0]))
        except ValueError:
            return False
    if op in _STRING_OPS and operands:
        return _STRING_OPS[op](value, operands[0])
    return value == required.strip()


def spec_matches(required: str, offered: set[str]) -> bool:
    """Whether one of the ``offered`` aggregate values satisfies the extra spec value ``required``."""
    return any(value_matches(required, value) for value in offered)


@register
class AggregateInstanceExtraSpecsFilter(BaseHostFilter):
    """Flavor extra specs (``aggregate_instance_extra_specs:`` or unscoped) must match the host's aggregates.

    A host's offer for a key is every value (comma-separated lists split) that any of its
    aggregates has for that key; a host in no aggregate with that key fails.
    """

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        for key, required in spec.extra_specs.items():
            metadata_key = aggregate_spec_key(key)
            if metadata_key is None:
                continue
            offered = {
                value.strip()
                for metadata in host_state.aggregates
                if metadata_key in metadata
                for value in metadata[metadata_key].split(",")
            }
            if not offered or not spec_matches(str(required), offered):
                return False
        return True


@register
class AvailabilityZoneFilter(BaseHostFilter):
    """A server asked for in a zone lands, and moves, only on hosts of that zone (their aggregates'
    zone; a host in no aggregate with a zone is in the default zone)."""

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        return spec.availability_zone is None or aggregates.zone_in(host_state.aggregates) == spec.availability_zone


@register
class SameHostFilter(BaseHostFilter):
    """With a ``same_host`` hint, only hosts running one of the named instances."""

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        return spec.same_host is None or host_state.host in spec.same_host


@register
class DifferentHostFilter(BaseHostFilter):
    """With a ``different_host`` hint, only hosts running none of the named instances."""

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        return host_state.host not in spec.different_host


@register
class ServerGroupAffinityFilter(BaseHostFilter):
    """An affinity group's members share one host: once other members are placed, only their hosts pass."""

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        if spec.group_policy != server_groups.AFFINITY:
            return True
        return server_groups.allows(spec.group_policy, spec.group_max_per_host, spec.group_hosts, host_state.host)


@register
class ServerGroupAntiAffinityFilter(BaseHostFilter):
    """An anti-affinity group's members keep apart: a host with as many other members as the
    group allows on one (one, unless its ``max_server_per_host`` rule says more) is left out."""

    def host_passes(self, host_state: HostState, spec: SchedulingSpec) -> bool:
        if spec.group_policy != server_groups.ANTI_AFFINITY:
            return True
        return server_groups.allows(spec.group_policy, spec.group_max_per_host, spec.group_hosts, host_state.host)
