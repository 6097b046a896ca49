"""Choosing a destination: placement's allocation candidates, filters, weighers, then the claim.

Placement answers with the providers that have room, a bounded batch at a time (see
:func:`ferry.placement.allocation_candidates`); the filters and weighers see only those, so a
request costs about the same in a cloud of 1,000 or 100,000 hosts.

The claim is what makes a choice real: the scheduler walks the weighed hosts and claims the
first one placement accepts. A host that filled up since placement listed it (another
request claimed it first) is skipped for the next. For a move, the same placement
transaction also hands the instance's current allocations to the migration, so the source
stays held by the migration and the destination by the instance, with no moment in between.
A member of a server group with a hard policy is claimed only while its group's policy allows
the host (:func:`ferry.compute.server_groups.claim_guard`); when another member was placed
meanwhile, the search runs again with that member's host known (up to three searches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ferry import config, errors, placement
from ferry.compute import server_groups
from ferry.observability import logger
from ferry.scheduler import filters as host_filters
from ferry.scheduler import request_filter
from ferry.scheduler import weighers as host_weighers
from ferry.scheduler.host_state import (
    HostState,
    SchedulingSpec,
    attach_aggregates,
    attach_services,
    build_spec,
    host_states,
)
from ferry.scheduler.selection import Selection

CAPACITY_STAGE = "PlacementCapacity"
# How many times a search runs when other members of the server's group were placed during it.
_GROUP_SEARCHES = 3


@dataclasses.dataclass
class _Filtered:
    """The hosts that passed every filter, and what it took to find them.

    ``seen`` counts the candidates placement returned and ``removed_by_filters`` what each host
    filter that ran removed of them. When no host passed, every candidate in scope was seen.
    """

    hosts: list[HostState]
    request: placement.CandidateRequest
    seen: int
    removed_by_filters: list[tuple[str, int]]
    _in_scope: int | None = None

    @property
    def in_scope(self) -> int:
        """How many compute nodes the request could consider before capacity (counted when first asked)."""
        if self._in_scope is None:
            self._in_scope = placement.count_in_scope(self.request)
        return self._in_scope

    @property
    def removed(self) -> list[tuple[str, int]]:
        """``(stage, hosts removed)`` for placement's capacity check and each filter, in order.

        Exact once every candidate was seen (the case whenever no host passed).
        """
        return [(CAPACITY_STAGE, max(self.in_scope - self.seen, 0)), *self.removed_by_filters]


def _replaced_consumers(spec: SchedulingSpec, migration_uuid: str | None) -> list[str]:
    """Consumers whose current allocations the claim replaces, so they do not count as used.

    Without a migration the instance's own claim is replaced. With one, the instance's current
    allocations move to the migration (and keep counting) unless the migration already holds
    allocations from an earlier run, in which case the instance's are replaced.
    """
    if migration_uuid is None or placement.get_allocations(migration_uuid):
        return [spec.instance_uuid]
    return []


def _fits(host: HostState, resources: Mapping[str, int]) -> bool:
    return all(host.free.get(rc, 0.0) >= amount for rc, amount in resources.items())


def _filter_candidates(spec: SchedulingSpec, request: placement.CandidateRequest,
                       pending: Mapping[str, Mapping[str, int]] | None = None) -> _Filtered:
    """Run the host filters over placement's candidates, a batch at a time, until enough pass.

    Enough is ``scheduler_max_attempts`` hosts (the choice and its alternates); a batch is
    ``max_placement_results`` candidates, so usually one batch is read. Only when too few pass
    does the next batch follow, until placement has no more. ``pending`` (``{provider uuid:
    {resource class: amount}}``) is taken off the candidates' free resources first, and a
    candidate it leaves too small is dropped: a plan counts what it placed before.
    """
    settings = config.get()
    enough = _enough()
    filters = host_filters.enabled_filters()
    removed: dict[str, int] = {}
    passed: list[HostState] = []
    seen = 0
    for batch in placement.allocation_candidates(request, limit=settings.max_placement_results):
        seen += len(batch)
        hosts = host_states(batch)
        if pending:
            for host in hosts:
                for rc, amount in pending.get(host.provider_uuid, {}).items():
                    host.free[rc] = host.free.get(rc, 0.0) - amount
            hosts = [host for host in hosts if _fits(host, spec.resources)]
        attach_services(hosts)
        attach_aggregates(hosts)
        for host_filter in filters:
            if not hosts:
                break
            before = len(hosts)
            hosts = host_filter.filter_all(hosts, spec)
            removed[host_filter.name] = removed.get(host_filter.name, 0) + before - len(hosts)
        passed.extend(hosts)
        if len(passed) >= enough:
            break
    logger.info("scheduler stages", extra={"instance_uuid": spec.instance_uuid, "candidates": seen,
                                           "removed": removed, "remaining": len(passed)})
    return _Filtered(hosts=passed, request=request, seen=seen, removed_by_filters=list(removed.items()))


def _filter(spec: SchedulingSpec, excluded: list[str],
            pending: Mapping[str, Mapping[str, int]] | None = None) -> _Filtered:
    """The hosts that can take ``spec``: placement's candidates through every host filter.

    ``excluded`` are the consumers whose allocations count as free (see
    :func:`_replaced_consumers`); ``pending`` is counted as used (see :func:`_filter_candidates`).
    Placement's query is narrowed by the request's host restrictions (see
    :mod:`ferry.scheduler.request_filter`). When that leaves no host, the search runs once more
    without the narrowing, so the error counts what each filter removed (a failing request pays
    for a full pass, a succeeding one does not). A move between cells searches the cells the
    cross-cell weigher favours first (see :func:`_favoured_cells`) and every allowed cell only
    when those give fewer than ``scheduler_max_attempts`` hosts.
    """
    request = request_filter.placement_request(spec, exclude_consumers=excluded)
    preferred: list[HostState] = []
    favoured = _favoured_cells(spec, request)
    if favoured is not None:
        # Placement's batches sample every allowed cell; a host of the favoured cells that is not
        # in the sample would never be weighed. So those cells are searched first, and only their
        # hosts the cross-cell weigher favours (their aggregates may set another multiplier) count.
        weigher = host_weighers.CrossCellWeigher()
        in_favoured = _filter_candidates(spec, favoured, pending)
        preferred = [host for host in in_favoured.hosts
                     if weigher.weigh(host, spec) * weigher.multiplier(host, spec) > 0]
        if len(preferred) >= _enough():
            return dataclasses.replace(in_favoured, hosts=preferred)
    filtered = _filter_candidates(spec, request, pending)
    if not filtered.hosts and request_filter.is_narrowed(request):
        filtered = _filter_candidates(
            spec, request_filter.placement_request(spec, exclude_consumers=excluded, narrow=False), pending)
    if preferred:
        found = {host.provider_uuid for host in preferred}
        filtered.hosts = preferred + [host for host in filtered.hosts if host.provider_uuid not in found]
    return filtered


def _enough() -> int:
    """How many hosts a search wants: the choice and its alternates (``scheduler_max_attempts``)."""
    return max(config.get().scheduler_max_attempts, 1)


def _favoured_cells(spec: SchedulingSpec,
                    request: placement.CandidateRequest) -> placement.CandidateRequest | None:
    """``request`` narrowed to the cells the cross-cell weigher favours, searched first; None when none are.

    Only a move that may leave its cell (it has a source cell, names no cell or host, and more
    than one cell is allowed) has favoured cells: its source cell when the multiplier (the
    request's own, else ``cross_cell_move_weight_multiplier``) is positive, the other allowed
    cells when it is negative (the source cell is being emptied).
    """
    if not spec.source_cell or request.cell is not None or request.host is not None:
        return None
    if request.cells is not None and (spec.source_cell not in request.cells or len(request.cells) < 2):
        return None
    multiplier = spec.cross_cell_weight_multiplier
    if multiplier is None:
        multiplier = config.get().cross_cell_move_weight_multiplier
    if multiplier > 0:
        return dataclasses.replace(request, cell=spec.source_cell)
    if multiplier < 0:
        return dataclasses.replace(request, exclude_cell=spec.source_cell)
    return None


def _explain(spec: SchedulingSpec, filtered: _Filtered, raced: int = 0, group_refused: int = 0) -> str:
    """Why no host is left, stage by stage."""
    where = f"host {spec.requested_host}" if spec.requested_host else "the allowed cells"
    if filtered.in_scope == 0:
        return f"{errors.NoValidHost.MESSAGE_START} for {spec.instance_uuid}: no compute node in {where}."
    parts = [f"{name} removed {count}" for name, count in filtered.removed if count]
    if raced:
        parts.append(f"{raced} filled up before the claim")
    if group_refused:
        parts.append(f"{group_refused} refused by the server group's policy when claimed (another member took a "
                     f"place meanwhile)")
    return (f"{errors.NoValidHost.MESSAGE_START} for {spec.instance_uuid}: {filtered.in_scope} compute node(s) "
            f"in {where}; " + ", ".join(parts) + ".")


def _selection(host: HostState, spec: SchedulingSpec) -> Selection:
    allocations = {host.provider_uuid: dict(spec.resources)} if spec.resources else {}
    return Selection(host=host.host, node=host.node, cell=host.cell, provider_uuid=host.provider_uuid,
                     allocations=allocations)


def _claim(selection: Selection, spec: SchedulingSpec, migration_uuid: str | None) -> None:
    """Claim ``selection``; for a member of a group with a hard policy, only while the policy still allows it.

    Raises:
        GroupPolicyConflict: another member of the group took a place since the hosts were read.
    """
    guard = None
    if spec.group_uuid and spec.group_policy in server_groups.POLICIES:
        guard = server_groups.claim_guard(spec.group_uuid, spec.instance_uuid, selection.host)
    if migration_uuid is None:
        placement.claim(spec.instance_uuid, spec.project_id, spec.user_id, selection.allocations, guard=guard)
    else:
        placement.claim_for_move(spec.instance_uuid, migration_uuid, spec.project_id, spec.user_id,
                                 selection.allocations, guard=guard)


def _claim_first(ranked: list[HostState], spec: SchedulingSpec,
                 migration_uuid: str | None) -> tuple[int | None, int, int]:
    """Claim the first of ``ranked`` that takes the claim.

    A host the server group's policy refuses (another member was placed since the hosts were
    read) is passed over like one that filled up: the claim re-checks the policy each time, so
    walking on finds the hosts still open to it (an anti-affinity group's) without a new search.

    Returns:
        ``(index claimed or None, hosts lost to other requests, hosts the group's policy refused)``.
    """
    raced = group_refused = 0
    for index, host in enumerate(ranked):
        try:
            _claim(_selection(host, spec), spec, migration_uuid)
        except errors.GroupPolicyConflict as exc:
            group_refused += 1
            logger.info("host no longer fits the server group, trying the next host", extra={
                "instance_uuid": spec.instance_uuid, "host": host.host, "reason": exc.message})
            continue
        except (errors.InsufficientCapacity, errors.ResourceProviderNotFound) as exc:
            raced += 1
            logger.info("claim lost to a concurrent request, trying the next host",
                        extra={"instance_uuid": spec.instance_uuid, "host": host.host, "reason": exc.message})
            continue
        return index, raced, group_refused
    return None, raced, group_refused


def select_destinations(request_spec: Mapping[str, Any], *, claim: bool = True,
                        migration_uuid: str | None = None) -> list[Selection]:
    """Choose a destination for the request, claim it, and list alternates for reschedules.

    Params:
        request_spec: instance_uuid, project_id, user_id, flavor, is_bfv, ignore_hosts,
            requested_destination, allowed_cells, scheduler_hints, group, source_cell (see
            :func:`ferry.scheduler.host_state.build_spec`).
        claim: claim the chosen host for the instance; with False nothing is written.
        migration_uuid: for a move, the migration that takes over the instance's current
            allocations in the same transaction as the destination claim.

    Returns:
        The chosen destination first, then up to ``scheduler_max_attempts - 1`` alternates: later
        hosts in weighed order in the chosen host's cell (a reschedule stays in that cell),
        not claimed, each with the allocations a claim on it would hold.

    Raises:
        NoValidHost: no host passed, or every passing host filled up before the claim; the
            message says how many hosts each stage removed.
        AllocationConflict: placement kept conflicting.
    """
    group_refused = 0
    for search in range(_GROUP_SEARCHES):
        spec = build_spec(request_spec)
        filtered = _filter(spec, _replaced_consumers(spec, migration_uuid))
        ranked = [host for host, _ in host_weighers.weigh_hosts(filtered.hosts, spec)]
        if not ranked:
            message = _explain(spec, filtered)
            logger.info("no valid host", extra={"instance_uuid": spec.instance_uuid, "reason": message})
            raise errors.NoValidHost(message, removed=dict(filtered.removed))
        if not claim:
            chosen_index = 0
            break
        claimed, raced, refused = _claim_first(ranked, spec, migration_uuid)
        if claimed is not None:
            chosen_index = claimed
            break
        group_refused += refused
        if not refused or search == _GROUP_SEARCHES - 1:
            message = _explain(spec, filtered, raced, group_refused)
            raise errors.NoValidHost(message, removed=dict(filtered.removed), raced=raced)
        # Another member of the group was placed meanwhile: its host changes which hosts pass.
        logger.info("server group changed during the search, searching again",
                    extra={"instance_uuid": spec.instance_uuid, "group_uuid": spec.group_uuid})

    chosen = ranked[chosen_index]
    max_alternates = max(config.get().scheduler_max_attempts - 1, 0)
    alternates = [host for host in ranked[chosen_index + 1:] if host.cell == chosen.cell][:max_alternates]
    logger.info("destination selected", extra={"instance_uuid": spec.instance_uuid, "host": chosen.host,
                                               "node": chosen.node, "cell": chosen.cell, "claimed": claim,
                                               "alternates": [alt.host for alt in alternates]})
    return [_selection(chosen, spec)] + [_selection(alt, spec) for alt in alternates]


def alternates_for(request_spec: Mapping[str, Any], chosen: Selection, *,
                   migration_uuid: str | None = None) -> list[Selection]:
    """The alternates for a destination an earlier run claimed (its answer lost): the hosts of
    ``chosen``'s cell that pass now, in weighed order, without ``chosen``, as
    :func:`select_destinations` lists them; claims nothing. None pass: an empty list."""
    spec = build_spec(request_spec)
    spec = dataclasses.replace(spec, ignore_hosts=spec.ignore_hosts | {chosen.host}, allowed_cells=(chosen.cell,))
    filtered = _filter(spec, _replaced_consumers(spec, migration_uuid))
    ranked = [host for host, _ in host_weighers.weigh_hosts(filtered.hosts, spec)]
    return [_selection(host, spec) for host in ranked[:max(config.get().scheduler_max_attempts - 1, 0)]]


def plan_destination(request_spec: Mapping[str, Any],
                     pending: Mapping[str, Mapping[str, int]] | None = None,
                     planned_members: Iterable[tuple[str, str]] = ()) -> Selection:
    """Where the scheduler would put ``request_spec`` now, with ``pending`` counted as used; claims nothing.

    The same candidates, filters and weighers as :func:`select_destinations`; the instance's own
    allocations keep counting (a move holds its source until it is confirmed). A drain's plan
    calls this once per server, adding each choice to ``pending`` before the next, and giving
    the moves it planned for the server's group's other members (``(from host, to host)``), which
    the group's policy counts as it will once they are under way (:func:`server_groups.with_planned`).

    Raises:
        NoValidHost: no host passes with room left.
    """
    spec = build_spec(request_spec)
    planned = list(planned_members)
    if spec.group_policy is not None and planned:
        spec = dataclasses.replace(
            spec, group_hosts=server_groups.with_planned(spec.group_policy, spec.group_hosts, planned))
    filtered = _filter(spec, [], pending)
    ranked = [host for host, _ in host_weighers.weigh_hosts(filtered.hosts, spec)]
    if not ranked:
        raise errors.NoValidHost(_explain(spec, filtered), removed=dict(filtered.removed))
    return _selection(ranked[0], spec)


def claim_alternate(request_spec: Mapping[str, Any], selection: Selection, *,
                    migration_uuid: str | None = None) -> Selection:
    """Move the instance's claim from the destination that failed to the alternate ``selection``.

    The alternate runs through the capacity check and every filter again (it was chosen a
    while ago). The claim replaces the instance's allocations in one transaction, so the failed
    destination is released exactly when the alternate is claimed. With ``migration_uuid``
    the migration keeps (or, if it does not hold them yet, takes over) the source allocations.

    Returns:
        The claimed Selection.

    Raises:
        NoValidHost: the alternate no longer passes or has no room left.
        AllocationConflict: placement kept conflicting.
    """
    spec = dataclasses.replace(build_spec(request_spec), requested_host=selection.host,
                               requested_node=selection.node, requested_cell=selection.cell)
    filtered = _filter(spec, _replaced_consumers(spec, migration_uuid))
    if not filtered.hosts:
        raise errors.NoValidHost(_explain(spec, filtered), removed=dict(filtered.removed))
    chosen = _selection(filtered.hosts[0], spec)
    try:
        _claim(chosen, spec, migration_uuid)
    except (errors.InsufficientCapacity, errors.ResourceProviderNotFound) as exc:
        raise errors.NoValidHost(_explain(spec, filtered, raced=1), removed=dict(filtered.removed)) from exc
    except errors.GroupPolicyConflict as exc:
        raise errors.NoValidHost(_explain(spec, filtered, group_refused=1), removed=dict(filtered.removed)) from exc
    logger.info("alternate claimed", extra={"instance_uuid": spec.instance_uuid, "host": chosen.host,
                                            "node": chosen.node})
    return chosen
