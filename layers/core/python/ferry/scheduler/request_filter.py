"""Request filters: a request's host restrictions, turned into placement's query before any host is read.

Placement returns a bounded batch of candidates, so a restriction that only a few hosts meet
(a ``same_host`` hint, an affinity group's hosts, a flavor extra spec only one aggregate
satisfies) must narrow the query itself, or the batch would hold none of those hosts. Each
narrowing here is exactly one host filter's condition, so a host placement leaves out would
have failed that filter anyway; the host filters still run on every candidate.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select

from ferry import placement
from ferry.compute import server_groups
from ferry.scheduler.filters import aggregate_spec_key, spec_matches
from ferry.scheduler.host_state import SchedulingSpec
from ferry.store import db
from ferry.store.api_models import AggregateMetadata


def aggregates_for_extra_specs(extra_specs: dict[str, str]) -> tuple[frozenset[int], ...]:
    """For each aggregate-scoped extra spec, the aggregates whose metadata satisfies it.

    A host passes ``AggregateInstanceExtraSpecsFilter`` for one extra spec exactly when one of
    its aggregates' own values satisfies it (every form of value, plain, ``<or>`` and ``<in>``,
    asks whether *some* offered value fits), so membership in one of these aggregates is the
    same test. An extra spec no aggregate satisfies gives an empty set: no host passes.
    """
    wanted = [(key, str(required)) for key, required in
              ((aggregate_spec_key(k), v) for k, v in sorted(extra_specs.items())) if key is not None]
    if not wanted:
        return ()
    with db.api_session() as session:
        rows = session.execute(
            select(AggregateMetadata.aggregate_id, AggregateMetadata.key, AggregateMetadata.value)
            .where(AggregateMetadata.key.in_(sorted({key for key, _ in wanted})))
        ).all()
    return tuple(
        frozenset(aggregate_id for aggregate_id, key, value in rows
                  if key == wanted_key and spec_matches(required, {part.strip() for part in value.split(",")}))
        for wanted_key, required in wanted
    )


def _hosts(spec: SchedulingSpec) -> frozenset[str] | None:
    """The hosts ``SameHostFilter`` and ``ServerGroupAffinityFilter`` leave, or None when they leave any.

    An empty ``same_host`` set is not narrowed here: no host passes, and the filter says so.
    """
    hosts: frozenset[str] | None = None
    if spec.same_host:
        hosts = spec.same_host
    if spec.group_policy == server_groups.AFFINITY and spec.group_hosts:
        members = frozenset(spec.group_hosts)
        hosts = members if hosts is None else hosts & members
    return hosts


def placement_request(spec: SchedulingSpec, *, exclude_consumers: Iterable[str] = (),
                      narrow: bool = True) -> placement.CandidateRequest:
    """What to ask placement for ``spec``: its resources in its cells (and requested destination).

    Params:
        spec: the request.
        exclude_consumers: consumers whose allocations the claim replaces (they count as free).
        narrow: also apply the host restrictions of the hints, the group and the aggregate
            extra specs (see the module docstring); without, placement applies only capacity
            and scope, and the host filters decide the rest.
    """
    return placement.CandidateRequest(
        resources=dict(spec.resources),
        cells=spec.allowed_cells,
        cell=spec.requested_cell,
        host=spec.requested_host,
        node=spec.requested_node,
        hosts=_hosts(spec) if narrow else None,
        member_of=aggregates_for_extra_specs(dict(spec.extra_specs)) if narrow else (),
        exclude_consumers=tuple(sorted(set(exclude_consumers))),
        # As Nova's requested destination cell: a move that may not leave its cell lands there
        # even while the cell is disabled (disabling stops boots and moves in from other cells).
        include_disabled=spec.held_to_source_cell,
    )


def is_narrowed(request: placement.CandidateRequest) -> bool:
    """Whether ``request`` carries host restrictions beyond capacity and scope."""
    return request.hosts is not None or bool(request.member_of)
