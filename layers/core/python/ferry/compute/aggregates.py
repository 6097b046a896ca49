"""Host aggregates: named groups of compute hosts with metadata (API database).

The scheduler matches flavor extra specs against aggregate metadata and reads per-aggregate
weigher overrides from it; this module is what operators change them through. An aggregate's
availability zone is its metadata key ``availability_zone``, as in Nova, so setting it through
the metadata and through the aggregate's own field are the same thing.

A host may be in several aggregates but in one availability zone only: adding a host, or
giving an aggregate a zone, is refused when it would put one of its hosts in two zones.
Changing the zone of an aggregate whose hosts run servers is refused too (the servers would
silently change zone). Once given, a zone can be changed but not removed, as in Nova.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ferry import errors
from ferry.hosts import is_compute_host
from ferry.observability import logger
from ferry.store.api_models import Aggregate, AggregateHost, AggregateMetadata, CellMapping, HostMapping, utcnow
from ferry.store.cell_models import Instance
from ferry.store.db import api_session, cell_session

AZ_KEY = "availability_zone"
# Nova's default availability zone: hosts in no aggregate with a zone are in it.
DEFAULT_AVAILABILITY_ZONE = "nova"

# Operator-facing names of the actions, used in the messages of refused requests.
ACTION_ADD_HOST = "add host to"
ACTION_UPDATE = "update"
ACTION_UPDATE_META = "update metadata of"


@dataclass(frozen=True)
class AggregateRecord:
    """An aggregate as the API shows it (hosts in the order they were added)."""

    id: int
    uuid: str
    name: str
    hosts: list[str]
    metadata: dict[str, str]
    created_at: dt.datetime
    updated_at: dt.datetime | None
    availability_zone: str | None


def _record(aggregate: Aggregate) -> AggregateRecord:
    metadata = aggregate.metadata_dict
    return AggregateRecord(
        id=aggregate.id, uuid=aggregate.uuid, name=aggregate.name,
        hosts=[h.host for h in sorted(aggregate.hosts, key=lambda h: h.id)], metadata=metadata,
        created_at=aggregate.created_at, updated_at=aggregate.updated_at, availability_zone=metadata.get(AZ_KEY))


def _load(session: Session, aggregate_id: int, *, for_update: bool = False) -> Aggregate:
    query = select(Aggregate).where(Aggregate.id == aggregate_id)
    if for_update:
        query = query.with_for_update()
    aggregate = session.scalars(query).one_or_none()
    if aggregate is None:
        raise errors.NotFound(f"Aggregate {aggregate_id} could not be found.")
    return aggregate


def _refused(action: str, aggregate_id: int, reason: str, error: type[errors.FerryError]) -> errors.FerryError:
    return error(f"Cannot {action} aggregate {aggregate_id}. Reason: {reason}.")


def _zones_elsewhere(session: Session, hosts: Iterable[str], aggregate_id: int | None) -> dict[str, set[str]]:
    """The zones other aggregates give each of ``hosts``."""
    hosts = list(hosts)
    if not hosts:
        return {}
    query = (select(AggregateHost.host, AggregateMetadata.value)
             .join(AggregateMetadata, AggregateMetadata.aggregate_id == AggregateHost.aggregate_id)
             .where(AggregateHost.host.in_(hosts), AggregateMetadata.key == AZ_KEY))
    if aggregate_id is not None:
        query = query.where(AggregateHost.aggregate_id != aggregate_id)
    zones: dict[str, set[str]] = {}
    for host, zone in session.execute(query):
        zones.setdefault(host, set()).add(zone)
    return zones


def _check_zone_change(session: Session, aggregate: Aggregate, hosts: list[str], new_zone: str | None,
                       action: str, error: type[errors.FerryError]) -> None:
    """Refuse a zone that is empty or none, would put one of ``hosts`` in two zones, or move servers.

    As in Nova, an aggregate's zone can be changed but not taken away: ``None`` (which would remove
    the ``availability_zone`` key) is refused like an empty name.

    Raises:
        ``error``: the zone is empty or ``None``, conflicts with another aggregate's, or (except when
            a host is added) the zone changes while the hosts run servers.
    """
    if new_zone is None or not new_zone.strip():
        raise _refused(action, aggregate.id, f"Aggregate {aggregate.name} does not support empty named "
                                             f"availability zone", error)
    conflicting = sorted({zone for zones in _zones_elsewhere(session, hosts, aggregate.id).values()
                          for zone in zones if zone != new_zone})
    if conflicting:
        raise _refused(action, aggregate.id, f"One or more hosts already in availability zone(s) {conflicting}",
                       error)
    current = aggregate.metadata_dict.get(AZ_KEY)
    if action != ACTION_ADD_HOST and current != new_zone and hosts_have_servers(session, hosts):
        raise _refused(action, aggregate.id, "One or more hosts contain instances in this zone", error)


def hosts_have_servers(api: Session, hosts: Iterable[str]) -> bool:
    """Whether any of ``hosts`` runs a server that is not deleted (looked up in the hosts' cells).

    ``api`` is the caller's open API database session: the cells are read through it, so that no
    second API session waits on the first one's lock.
    """
    hosts = list(hosts)
    if not hosts:
        return False
    cells = list(api.scalars(select(CellMapping).join(HostMapping, HostMapping.cell_id == CellMapping.id)
                        .where(HostMapping.host.in_(hosts)).distinct()))
    for cell in cells:
        with cell_session(cell) as session:
            found = session.scalars(select(Instance.id).where(Instance.host.in_(hosts),
                                                              Instance.deleted.is_(False)).limit(1)).first()
            if found is not None:
                return True
    return False


def _touch(aggregate: Aggregate) -> None:
    # Host and metadata rows live in their own tables: the aggregate's update time is set by hand.
    aggregate.updated_at = utcnow()



def _flush_or_conflict(session: Session, message: str) -> None:
    """Write pending changes; a unique constraint they break (a concurrent request) is a 409.

    Raises:
        Conflict: with ``message``.
    """
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError as exc:
        raise errors.Conflict(message) from exc

def list_aggregates() -> list[AggregateRecord]:
    """Every aggregate, oldest first."""
    with api_session() as session:
        return [_record(a) for a in session.scalars(select(Aggregate).order_by(Aggregate.id))]


def get_aggregate(aggregate_id: int) -> AggregateRecord:
    """One aggregate.

    Raises:
        NotFound: no aggregate has that id.
    """
    with api_session() as session:
        return _record(_load(session, aggregate_id))


def create_aggregate(name: str, availability_zone: str | None = None) -> AggregateRecord:
    """Create an aggregate, with its availability zone as metadata when one is given.

    Raises:
        Conflict: an aggregate has that name already.
    """
    with api_session() as session:
        aggregate = Aggregate(name=name)
        if availability_zone is not None:
            aggregate.metadata_items = [AggregateMetadata(key=AZ_KEY, value=availability_zone)]
        try:
            with session.begin_nested():
                session.add(aggregate)
        except IntegrityError as exc:
            raise errors.Conflict(f"Aggregate {name} already exists.") from exc
        session.refresh(aggregate)
        record = _record(aggregate)
    logger.info("aggregate created", extra={"aggregate_id": record.id, "aggregate_name": name,
                                            "availability_zone": availability_zone})
    return record


_UNCHANGED: Any = object()


def update_aggregate(aggregate_id: int, *, name: str = _UNCHANGED,
                     availability_zone: str | None = _UNCHANGED) -> AggregateRecord:
    """Rename an aggregate and/or change its availability zone.

    The name is written first, as Nova saves it before it checks the zone: a taken name is a 409
    whatever the zone, and a refused zone names the aggregate by its new name. A refusal leaves
    the aggregate as it was.

    Raises:
        NotFound: no such aggregate.
        Conflict: another aggregate has the new name.
        BadRequest: the new zone is ``None`` (a zone cannot be removed), conflicts with another
            aggregate of its hosts, or its hosts run servers.
    """
    with api_session() as session:
        aggregate = _load(session, aggregate_id, for_update=True)
        if name is not _UNCHANGED:
            aggregate.name = name
            _flush_or_conflict(session, f"Aggregate {name} already exists.")
        if availability_zone is not _UNCHANGED:
            hosts = [h.host for h in aggregate.hosts]
            _check_zone_change(session, aggregate, hosts, availability_zone, ACTION_UPDATE, errors.BadRequest)
            _set_metadata_items(aggregate, {AZ_KEY: availability_zone})
        _touch(aggregate)
        session.flush()
        session.refresh(aggregate)
        record = _record(aggregate)
    logger.info("aggregate updated", extra={"aggregate_id": aggregate_id})
    return record


def delete_aggregate(aggregate_id: int) -> None:
    """Delete an aggregate that has no hosts (its metadata goes with it).

    Raises:
        NotFound: no such aggregate.
        BadRequest: it still has hosts.
    """
    with api_session() as session:
        aggregate = _load(session, aggregate_id, for_update=True)
        if aggregate.hosts:
            raise errors.BadRequest(f"Cannot remove aggregate {aggregate_id}. Reason: Host aggregate is not empty.")
        session.delete(aggregate)
    logger.info("aggregate deleted", extra={"aggregate_id": aggregate_id})


def add_host(aggregate_id: int, host: str) -> AggregateRecord:
    """Put a compute host in an aggregate.

    Raises:
        NotFound: no such aggregate, or ``host`` is not a compute host.
        Conflict: the host is in the aggregate already, or is in another availability zone.
    """
    known = is_compute_host(host)  # read before the aggregate is locked (its own sessions)
    with api_session() as session:
        aggregate = _load(session, aggregate_id, for_update=True)
        if not known:
            raise errors.NotFound(f"Compute host {host} could not be found.")
        if any(h.host == host for h in aggregate.hosts):
            raise errors.Conflict(f"Aggregate {aggregate_id} already has host {host}.")
        zone = aggregate.metadata_dict.get(AZ_KEY)
        if zone is not None:  # an aggregate without a zone puts its hosts in none
            _check_zone_change(session, aggregate, [host], zone, ACTION_ADD_HOST, errors.Conflict)
        aggregate.hosts.append(AggregateHost(host=host))
        _touch(aggregate)
        _flush_or_conflict(session, f"Aggregate {aggregate_id} already has host {host}.")
        session.refresh(aggregate)
        record = _record(aggregate)
    logger.info("host added to aggregate", extra={"aggregate_id": aggregate_id, "host": host})
    return record


def remove_host(aggregate_id: int, host: str) -> AggregateRecord:
    """Take a host out of an aggregate (a member whose compute service is gone too).

    Raises:
        NotFound: no such aggregate, or ``host`` is not one of its members; both in Nova's one
            message, which does not tell them apart.
    """
    not_found = errors.NotFound(f"Cannot remove host {host} in aggregate {aggregate_id}")
    with api_session() as session:
        try:
            aggregate = _load(session, aggregate_id, for_update=True)
        except errors.NotFound as exc:
            raise not_found from exc
        member = next((h for h in aggregate.hosts if h.host == host), None)
        if member is None:
            raise not_found
        aggregate.hosts.remove(member)
        _touch(aggregate)
        session.flush()
        session.refresh(aggregate)
        record = _record(aggregate)
    logger.info("host removed from aggregate", extra={"aggregate_id": aggregate_id, "host": host})
    return record


def _set_metadata_items(aggregate: Aggregate, changes: Mapping[str, str | None]) -> None:
    items = {item.key: item for item in aggregate.metadata_items}
    for key, value in changes.items():
        item = items.get(key)
        if value is None:
            if item is not None:
                aggregate.metadata_items.remove(item)
        elif item is None:
            aggregate.metadata_items.append(AggregateMetadata(key=key, value=value))
        else:
            item.value = value


def set_metadata(aggregate_id: int, metadata: Mapping[str, str | None]) -> AggregateRecord:
    """Set metadata keys of an aggregate; a ``None`` value removes its key (absent keys are ignored).

    Raises:
        NotFound: no such aggregate.
        BadRequest: a new ``availability_zone`` is ``None`` (a zone cannot be removed), conflicts
            with another aggregate of its hosts, or its hosts run servers.
    """
    with api_session() as session:
        aggregate = _load(session, aggregate_id, for_update=True)
        if AZ_KEY in metadata:
            hosts = [h.host for h in aggregate.hosts]
            _check_zone_change(session, aggregate, hosts, metadata[AZ_KEY], ACTION_UPDATE_META, errors.BadRequest)
        _set_metadata_items(aggregate, metadata)
        _touch(aggregate)
        session.flush()
        session.refresh(aggregate)
        record = _record(aggregate)
    logger.info("aggregate metadata set", extra={"aggregate_id": aggregate_id, "keys": sorted(metadata)})
    return record


def zones_of_hosts(hosts: Iterable[str]) -> dict[str, str]:
    """The availability zone of each host: its aggregates' zone, else the default zone."""
    hosts = list(hosts)
    zones = dict.fromkeys(hosts, DEFAULT_AVAILABILITY_ZONE)
    if not hosts:
        return zones
    with api_session() as session:
        for host, found in _zones_elsewhere(session, hosts, None).items():
            zones[host] = sorted(found)[0]
    return zones


def zone_in(metadata: Iterable[Mapping[str, str]]) -> str:
    """The zone a host is in, from the metadata of its aggregates (the default zone when none has one)."""
    return min((m[AZ_KEY] for m in metadata if AZ_KEY in m), default=DEFAULT_AVAILABILITY_ZONE)
