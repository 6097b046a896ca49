"""Server groups (Nova's instance groups): servers the scheduler keeps on one host or apart.

A group has one policy. ``affinity`` puts every member on the host of the others; with
``anti-affinity`` no two members share a host, or at most ``max_server_per_host`` (a rule from
microversion 2.64). ``soft-affinity`` and ``soft-anti-affinity`` only weigh hosts: a host with
more members counts more (or less), and a host that breaks the wish is still taken when it is
the only one.

A server joins a group when it is created (the ``group`` scheduler hint) and leaves it when it
is deleted. Its boot and every later move (resize, migrate, between cells too, a drain's) are
scheduled against the hosts of the *other* members, so a lone member moves freely and a member
of an affinity group with others stays on their host (which needs
``FERRY_ALLOW_RESIZE_TO_SAME_HOST``, as in Nova).

Where a member is comes from placement: the host its allocations are on. A claim is what
places a server, so two members scheduled at once cannot both take a host that only one of
them may have: the claim of a member locks its group's row and checks the policy again in the
claim's own transaction (:func:`claim_guard`); the scheduler then searches again. A member on
the move counts on its destination from the claim and on its source (held by its migration)
until the move is confirmed or reverted, so a revert never lands it beside another member.

Quotas: ``server_groups`` per project and ``server_group_members`` per group and user, as
Nova counts them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ferry import errors, quotas
from ferry.auth import RequestContext
from ferry.observability import logger
from ferry.store.api_models import (
    Allocation,
    Consumer,
    InstanceGroup,
    InstanceGroupMember,
    InstanceMapping,
    ResourceProvider,
)
from ferry.store.db import api_session

AFFINITY = "affinity"
ANTI_AFFINITY = "anti-affinity"
SOFT_AFFINITY = "soft-affinity"
SOFT_ANTI_AFFINITY = "soft-anti-affinity"
# The policies from the first microversion, and those 2.15 adds.
POLICIES = (AFFINITY, ANTI_AFFINITY)
SOFT_POLICIES = (SOFT_AFFINITY, SOFT_ANTI_AFFINITY)

MAX_SERVER_PER_HOST = "max_server_per_host"



@dataclass(frozen=True)
class GroupRecord:
    """A group as the API shows it; ``members`` are the servers in it that are not deleted."""

    uuid: str
    name: str
    project_id: str
    user_id: str
    policy: str
    rules: dict[str, Any]
    members: list[str]
    created_at: dt.datetime


@dataclass(frozen=True)
class SchedulingGroup:
    """What the scheduler needs of a server's group: its policy and where the other members are.

    ``hosts`` maps each host to how many of the other members are on it.
    """

    uuid: str
    policy: str
    max_per_host: int
    hosts: Mapping[str, int]


def not_found(group_uuid: str) -> errors.ServerGroupNotFound:
    return errors.ServerGroupNotFound(f"Instance group {group_uuid} could not be found.")


def _live_members(session: Session, group_ids: Iterable[int]) -> dict[int, list[str]]:
    """The members of each group whose server is not deleted, in the order they joined."""
    ids = sorted(set(group_ids))
    members: dict[int, list[str]] = {group_id: [] for group_id in ids}
    if not ids:
        return members
    rows = session.execute(
        select(InstanceGroupMember.group_id, InstanceGroupMember.instance_uuid)
        .join(InstanceMapping, InstanceMapping.instance_uuid == InstanceGroupMember.instance_uuid)
        .where(InstanceGroupMember.group_id.in_(ids), InstanceMapping.queued_for_delete.is_(False))
        .order_by(InstanceGroupMember.id))
    for group_id, instance_uuid in rows:
        members[group_id].append(instance_uuid)
    return members


def _record(group: InstanceGroup, members: list[str]) -> GroupRecord:
    return GroupRecord(uuid=group.uuid, name=group.name, project_id=group.project_id, user_id=group.user_id,
                       policy=group.policy, rules=dict(group.rules or {}), members=members,
                       created_at=group.created_at)


def _over(resource: str, limit: int, used: int, requested: int) -> bool:
    return quotas.Headroom(resource, limit, used, requested).over


# Nova's words when a group, or a member of one, would go over its quota.
TOO_MANY_GROUPS = "Quota exceeded, too many server groups."
TOO_MANY_MEMBERS = "Quota exceeded, too many servers in group"


def create_group(ctx: RequestContext, name: str, policy: str, rules: Mapping[str, Any]) -> GroupRecord:
    """Create a group in the caller's project.

    Raises:
        OverQuota: the project has ``server_groups`` groups already (403).
    """
    limit = quotas.limits(ctx.project_id)[quotas.SERVER_GROUPS]
    with api_session() as session:
        if _over(quotas.SERVER_GROUPS, limit, quotas.server_groups_used(ctx.project_id, session), 1):
            raise errors.OverQuota(TOO_MANY_GROUPS)
        group = InstanceGroup(name=name, project_id=ctx.project_id, user_id=ctx.user_id, policy=policy,
                              rules=dict(rules))
        session.add(group)
        session.flush()
        record = _record(group, [])
    # Counted again once written: two creates may both have passed the check. The group goes in
    # a transaction of its own, which the refusal must not roll back.
    with api_session() as session:
        over = _over(quotas.SERVER_GROUPS, limit, quotas.server_groups_used(ctx.project_id, session), 0)
        if over:
            session.execute(delete(InstanceGroup).where(InstanceGroup.uuid == record.uuid))
    if over:
        raise errors.OverQuota(TOO_MANY_GROUPS)
    logger.info("server group created", extra={"group_uuid": record.uuid, "policy": policy})
    return record


def list_groups(project_id: str | None, *, limit: int | None = None, offset: int = 0) -> list[GroupRecord]:
    """The groups of ``project_id`` (every project's with None), oldest first, paged."""
    with api_session() as session:
        query = select(InstanceGroup).order_by(InstanceGroup.id).offset(offset)
        if project_id is not None:
            query = query.where(InstanceGroup.project_id == project_id)
        if limit is not None:
            query = query.limit(limit)
        groups = list(session.scalars(query))
        members = _live_members(session, (group.id for group in groups))
        return [_record(group, members[group.id]) for group in groups]


def get_group(group_uuid: str, project_id: str | None = None) -> GroupRecord:
    """One group: of ``project_id`` only when given (a member never learns another project's
    group exists), of any project with None (an admin; the caller checks the policy).

    Raises:
        ServerGroupNotFound: no such group (in ``project_id``).
    """
    with api_session() as session:
        query = select(InstanceGroup).where(InstanceGroup.uuid == group_uuid)
        if project_id is not None:
            query = query.where(InstanceGroup.project_id == project_id)
        group = session.scalars(query).one_or_none()
        if group is None:
            raise not_found(group_uuid)
        return _record(group, _live_members(session, [group.id])[group.id])


def delete_group(group_uuid: str) -> None:
    """Delete a group; its members stay as they are, in no group.

    Raises:
        ServerGroupNotFound: no such group.
    """
    with api_session() as session:
        group_id = session.scalar(select(InstanceGroup.id).where(InstanceGroup.uuid == group_uuid).with_for_update())
        if group_id is None:
            raise not_found(group_uuid)
        session.execute(delete(InstanceGroupMember).where(InstanceGroupMember.group_id == group_id))
        session.execute(delete(InstanceGroup).where(InstanceGroup.id == group_id))
    logger.info("server group deleted", extra={"group_uuid": group_uuid})


def groups_of(instance_uuid: str) -> list[str]:
    """The uuids of the groups a server is in (one at most)."""
    with api_session() as session:
        return list(session.scalars(
            select(InstanceGroup.uuid).join(InstanceGroupMember, InstanceGroupMember.group_id == InstanceGroup.id)
            .where(InstanceGroupMember.instance_uuid == instance_uuid)))


# --- membership -----------------------------------------------------------------------------------


def add_member(session: Session, ctx: RequestContext, group_uuid: str, instance_uuid: str) -> dict[str, str]:
    """Make a new server a member of ``group_uuid``, in the transaction that accepts it.

    The group's row is locked, so two servers joining at once are counted one after the other.

    Returns:
        The request spec's ``group`` entry.

    Raises:
        BadRequest: no such group, or another project's (an admin may name any).
        OverQuota: the caller has ``server_group_members`` servers in the group already.
    """
    row = session.execute(select(InstanceGroup.id, InstanceGroup.project_id)
                          .where(InstanceGroup.uuid == group_uuid).with_for_update()).first()
    if row is None or (row.project_id != ctx.project_id and not ctx.is_admin):
        raise errors.BadRequest(not_found(group_uuid).message)
    limit = quotas.limits(ctx.project_id, session)[quotas.SERVER_GROUP_MEMBERS]
    mine = session.scalar(
        select(func.count(InstanceGroupMember.id))
        .join(InstanceMapping, InstanceMapping.instance_uuid == InstanceGroupMember.instance_uuid)
        .where(InstanceGroupMember.group_id == row.id, InstanceMapping.user_id == ctx.user_id,
               InstanceMapping.queued_for_delete.is_(False))) or 0
    if _over(quotas.SERVER_GROUP_MEMBERS, limit, mine, 1):
        raise errors.OverQuota(TOO_MANY_MEMBERS)
    session.add(InstanceGroupMember(group_id=row.id, instance_uuid=instance_uuid))
    session.flush()
    return {"uuid": group_uuid}


def remove_member(session: Session, instance_uuid: str) -> None:
    """Take a deleted server out of its group (nothing when it is in none)."""
    session.execute(delete(InstanceGroupMember).where(InstanceGroupMember.instance_uuid == instance_uuid))


# --- scheduling ------------------------------------------------------------------------------------


def _max_per_host(policy: str, rules: Mapping[str, Any] | None) -> int:
    if policy != ANTI_AFFINITY:
        return 1
    return int((rules or {}).get(MAX_SERVER_PER_HOST) or 1)


def _member_hosts(session: Session, group_id: int, policy: str, instance_uuid: str) -> dict[str, int]:
    """How many members other than ``instance_uuid`` each host holds, by their allocations.

    A member on the move holds its destination (its own allocations) and its source (its
    migration's, until the move is confirmed or reverted). Keeping apart (anti-affinity), it
    counts on both, as a revert or a rollback puts it back on its source without asking the
    scheduler. Keeping together (affinity), it counts where it is going only, where a confirm
    leaves it (Nova counts a member by its host, the destination once the move finished): a
    newcomer put beside its source would be apart from it once the move is confirmed (a revert
    or a failed move's rollback, as in Nova, parts them).
    """
    members = set(session.scalars(select(InstanceGroupMember.instance_uuid).where(
        InstanceGroupMember.group_id == group_id, InstanceGroupMember.instance_uuid != instance_uuid)))
    if not members:
        return {}
    # consumer -> the member it places: each member's own, and (keeping apart) its moves' migrations.
    holders = {uuid: uuid for uuid in members}
    if policy in (ANTI_AFFINITY, SOFT_ANTI_AFFINITY):
        for migration, moved in session.execute(select(Consumer.uuid, Consumer.instance_uuid)
                                                .where(Consumer.instance_uuid.in_(sorted(members)))):
            holders[migration] = moved or migration
    rows = session.execute(
        select(ResourceProvider.host, Allocation.consumer_uuid).distinct()
        .join(Allocation, Allocation.resource_provider_id == ResourceProvider.id)
        .where(Allocation.consumer_uuid.in_(sorted(holders))))
    on_host: dict[str, set[str]] = {}
    for host, consumer in rows:
        on_host.setdefault(host, set()).add(holders[consumer])
    return {host: len(servers) for host, servers in on_host.items()}


def with_planned(policy: str, hosts: Mapping[str, int], planned: Iterable[tuple[str, str]]) -> dict[str, int]:
    """The members' hosts once the other members' planned moves (``(from host, to host)``) are
    counted, as :func:`_member_hosts` counts them once those moves are under way: keeping apart,
    a member counts where it goes as well as where it is; keeping together, where it goes only."""
    counted = dict(hosts)
    for source, dest in planned:
        counted[dest] = counted.get(dest, 0) + 1
        if policy in (AFFINITY, SOFT_AFFINITY) and counted.get(source, 0) > 0:
            counted[source] -= 1
            if not counted[source]:
                del counted[source]
    return counted


def scheduling_group(group: Mapping[str, Any] | None, instance_uuid: str) -> SchedulingGroup | None:
    """The group a request spec's ``group`` entry names, as the scheduler sees it for ``instance_uuid``.

    None when the entry names no group or the group was deleted since (the server is in none).
    """
    group_uuid = (group or {}).get("uuid")
    if not group_uuid:
        return None
    with api_session() as session:
        row = session.execute(select(InstanceGroup.id, InstanceGroup.policy, InstanceGroup.rules)
                              .where(InstanceGroup.uuid == group_uuid)).first()
        if row is None:
            return None
        return SchedulingGroup(uuid=group_uuid, policy=row.policy, max_per_host=_max_per_host(row.policy, row.rules),
                               hosts=_member_hosts(session, row.id, row.policy, instance_uuid))


def allows(policy: str, max_per_host: int, hosts: Mapping[str, int], host: str) -> bool:
    """Whether a hard policy lets a member go to ``host`` with the other members on ``hosts``
    (a soft policy always does)."""
    if policy == AFFINITY:
        return not hosts or host in hosts
    if policy == ANTI_AFFINITY:
        return hosts.get(host, 0) < max_per_host
    return True


def claim_guard(group_uuid: str, instance_uuid: str, host: str) -> Callable[[Session], None]:
    """A check for the claim's transaction: the group's policy still lets ``instance_uuid`` go to ``host``.

    It locks the group's row first, so the claims of one group's members happen one at a time
    and each sees where the ones before it went.

    Raises (when run):
        GroupPolicyConflict: another member was placed since the scheduler read the hosts.
    """
    def check(session: Session) -> None:
        row = session.execute(select(InstanceGroup.id, InstanceGroup.policy, InstanceGroup.rules)
                              .where(InstanceGroup.uuid == group_uuid).with_for_update()).first()
        if row is None:
            return
        hosts = _member_hosts(session, row.id, row.policy, instance_uuid)
        if not allows(row.policy, _max_per_host(row.policy, row.rules), hosts, host):
            raise errors.GroupPolicyConflict(
                f"Host {host} no longer fits the {row.policy} policy of server group {group_uuid}: "
                f"other members are on {sorted(hosts)}.", host=host)

    return check
