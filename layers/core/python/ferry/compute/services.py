"""Compute services: one per host agent, in the cell database of the host's cell.

Operators list them across every cell, disable and enable them (a disabled host gets no new
servers: the scheduler's ComputeFilter skips it; servers already there are not touched),
force them down (the host counts as down at once, without waiting for its heartbeat to age)
and delete the record of a host that has left the cloud.

Ferry runs one kind of service, the host agent; the compute API calls it ``nova-compute``
so that clients written for Nova find it under the name they expect.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, or_, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ferry import errors, hosts
from ferry.compute import aggregates
from ferry.observability import logger
from ferry.store import db
from ferry.store.api_models import (
    AggregateHost,
    Allocation,
    CellMapping,
    HostMapping,
    Inventory,
    ResourceProvider,
    utcnow,
)
from ferry.store.cell_models import Instance, Migration, Service
from ferry.store.db import all_cells, api_session, cell_session

COMPUTE_BINARY = "nova-compute"
# A migration in one of these statuses no longer involves its hosts.
MIGRATION_DONE_STATUSES = ("confirmed", "reverted", "error", "failed", "completed", "cancelled", "done")
UNCHANGED: Any = object()


@dataclass(frozen=True)
class ServiceRecord:
    """A compute service as the API shows it, with the cell it lives in."""

    cell: str
    id: int
    uuid: str
    host: str
    binary: str
    zone: str
    disabled: bool
    disabled_reason: str | None
    forced_down: bool
    up: bool
    updated_at: dt.datetime | None
    created_at: dt.datetime


def _record(cell: str, service: Service, zone: str, now: dt.datetime) -> ServiceRecord:
    # The heartbeat is what changes a service most often; Nova shows it as the update time.
    stamps = [t for t in (service.updated_at, service.last_seen_at) if t is not None]
    return ServiceRecord(
        cell=cell, id=service.id, uuid=service.uuid, host=service.host, binary=COMPUTE_BINARY, zone=zone,
        disabled=service.disabled, disabled_reason=service.disabled_reason, forced_down=service.forced_down,
        up=hosts.is_up(service, now), updated_at=max(stamps) if stamps else None, created_at=service.created_at)


@dataclass(frozen=True)
class UnknownService:
    """The compute service of a host mapped to a cell whose database does not answer: its host
    is all that is known (the API database's host mapping), shown with status ``UNKNOWN`` from
    2.69 (Nova's partial record of a down cell)."""

    host: str
    binary: str = COMPUTE_BINARY


def _find(*criteria: Any, down: list[CellMapping] | None = None) -> list[tuple[str, Service]]:
    """Services matching ``criteria`` in every cell (cell0 has none), as ``(cell name, service)``.
    With ``down``, a cell whose database does not answer is left out (logged) and added to it;
    without, its error is raised."""
    found: list[tuple[str, Service]] = []
    for cell in all_cells(include_cell0=False):
        try:
            with cell_session(cell) as session:
                found += [(cell.name, s)
                          for s in session.scalars(select(Service).where(*criteria).order_by(Service.id))]
        except DBAPIError as exc:
            if down is None:
                raise
            db.left_out(exc, cell, "services")
            down.append(cell)
    return found


def _records(found: list[tuple[str, Service]]) -> list[ServiceRecord]:
    zones = aggregates.zones_of_hosts({s.host for _, s in found})
    now = utcnow()
    return [_record(cell, s, zones[s.host], now) for cell, s in found]


# A server's host_status (2.16), from its host's compute service, as Nova words it.
HOST_UP, HOST_DOWN, HOST_MAINTENANCE, HOST_UNKNOWN, HOST_NONE = "UP", "DOWN", "MAINTENANCE", "UNKNOWN", ""


def host_statuses(hosts_by_cell: Mapping[str, Iterable[str]]) -> dict[tuple[str, str], str]:
    """The status of each ``(cell, host)`` for the servers on it, read in those cells only:
    ``DOWN`` when forced down, ``MAINTENANCE`` when disabled, ``UP`` when heard from recently,
    else ``UNKNOWN``; ``""`` for a host without a compute service."""
    statuses: dict[tuple[str, str], str] = {}
    now = utcnow()
    for cell, names in hosts_by_cell.items():
        wanted = sorted(set(names))
        statuses.update(((cell, host), HOST_NONE) for host in wanted)
        if not wanted:
            continue
        with cell_session(cell) as session:
            found = list(session.scalars(select(Service).where(Service.host.in_(wanted))))
        for service in found:
            statuses[(cell, service.host)] = _host_status(service, now)
    return statuses


def _host_status(service: Service, now: dt.datetime) -> str:
    if service.forced_down:
        return HOST_DOWN
    if service.disabled:
        return HOST_MAINTENANCE
    return HOST_UP if hosts.is_up(service, now) else HOST_UNKNOWN


def available_zones() -> set[str]:
    """The zones a server may be asked for: those with an enabled compute service (Nova's
    available zones; a disabled zone, or one with no hosts, leaves a server nowhere to go)."""
    return {record.zone for record in list_services() if not record.disabled}


def list_services(host: str | None = None, binary: str | None = None) -> list[ServiceRecord]:
    """Every compute service, cell by cell, optionally only ``host``'s or only ``binary``'s.

    Raises:
        DBAPIError: a cell's database does not answer (see :func:`list_answering`).
    """
    if binary is not None and binary != COMPUTE_BINARY:
        return []
    return _records(_find(*([Service.host == host] if host is not None else [])))


def list_answering(host: str | None = None, binary: str | None = None, *,
                   unknown: bool = False) -> list[ServiceRecord | UnknownService]:
    """:func:`list_services` without the cells whose database does not answer (as Nova lists
    services), and with ``unknown`` (2.69) an :class:`UnknownService` for each host mapped to one
    of them (``host``'s only, if given) after the others."""
    if binary is not None and binary != COMPUTE_BINARY:
        return []
    down: list[CellMapping] = []
    found: list[ServiceRecord | UnknownService] = []
    found += _records(_find(*([Service.host == host] if host is not None else []), down=down))
    if unknown and down:
        with api_session() as session:
            query = select(HostMapping.host).where(HostMapping.cell_id.in_([cell.id for cell in down]))
            if host is not None:
                query = query.where(HostMapping.host == host)
            found += [UnknownService(name) for name in session.scalars(query.order_by(HostMapping.id))]
    return found


def get_by_uuid(service_uuid: str) -> ServiceRecord:
    """The service with ``service_uuid``.

    Raises:
        NotFound: no cell has it.
    """
    found = _find(Service.uuid == service_uuid)
    if not found:
        raise errors.NotFound(f"Service {service_uuid} could not be found.")
    return _records(found[:1])[0]


def get_by_id(service_id: int) -> ServiceRecord:
    """The service with the integer ``service_id`` (the pre-2.53 identifier).

    Raises:
        NotFound: no cell has it.
        BadRequest: several cells have a service with that id (use the uuid from 2.53).
    """
    found = _find(Service.id == service_id)
    if not found:
        raise errors.NotFound(f"Service {service_id} could not be found.")
    if len(found) > 1:
        raise errors.BadRequest(f"Service id {service_id} refers to multiple services.")
    return _records(found)[0]


def get_by_host(host: str, binary: str) -> ServiceRecord:
    """The ``binary`` service of ``host`` (the pre-2.53 way of naming one).

    Raises:
        NotFound: the host has no such service.
    """
    found = list_services(host=host, binary=binary)
    if not found:
        raise errors.NotFound(f"Service {binary} on host {host} could not be found.")
    return found[0]


def update_service(service: ServiceRecord, *, disabled: bool = UNCHANGED, disabled_reason: str | None = UNCHANGED,
                   forced_down: bool = UNCHANGED) -> ServiceRecord:
    """Enable or disable a service (with a reason) and/or force it down or up.

    Enabling clears the reason. The agent's heartbeat never changes these fields.

    Raises:
        NotFound: the service was deleted meanwhile.
    """
    with cell_session(service.cell) as session:
        row = session.scalars(select(Service).where(Service.uuid == service.uuid).with_for_update()).one_or_none()
        if row is None:
            raise errors.NotFound(f"Service {service.uuid} could not be found.")
        if disabled is not UNCHANGED:
            row.disabled = disabled
            row.disabled_reason = disabled_reason if disabled and disabled_reason is not UNCHANGED else None
        if forced_down is not UNCHANGED:
            row.forced_down = forced_down
        row.updated_at = utcnow()
        session.flush()
        updated = _records([(service.cell, row)])[0]
    logger.info("compute service updated", extra={"host": service.host, "disabled": updated.disabled,
                                                  "disabled_reason": updated.disabled_reason,
                                                  "forced_down": updated.forced_down})
    return updated


def change_disabled_from(service: ServiceRecord, reason_prefix: str, *, disabled: bool,
                         disabled_reason: str | None = None) -> bool:
    """Enable the service, or disable it with another reason, only while it is disabled with a
    reason starting with ``reason_prefix`` (checked and written under the row's lock: another
    writer's change is never undone). Whether it changed."""
    with cell_session(service.cell) as session:
        row = session.scalars(select(Service).where(Service.uuid == service.uuid).with_for_update()).one_or_none()
        if row is None or not row.disabled or not (row.disabled_reason or "").startswith(reason_prefix):
            return False
        row.disabled, row.disabled_reason = disabled, disabled_reason if disabled else None
        row.updated_at = utcnow()
    logger.info("compute service updated", extra={"host": service.host, "disabled": disabled,
                                                  "disabled_reason": disabled_reason if disabled else None,
                                                  "was": reason_prefix})
    return True


def _busy(host: str) -> str | None:
    """Why ``host``'s service cannot be deleted now, or None."""
    for cell in all_cells(include_cell0=False):
        with cell_session(cell) as session:
            if session.scalars(select(Instance.id).where(Instance.host == host, Instance.deleted.is_(False))
                               .limit(1)).first() is not None:
                return ("Unable to delete compute service that is hosting instances. "
                        "Migrate or delete the instances first.")
            if session.scalars(select(Migration.id).where(
                    or_(Migration.source_compute == host, Migration.dest_compute == host),
                    Migration.status.not_in(MIGRATION_DONE_STATUSES), Migration.deleted.is_(False))
                    .limit(1)).first() is not None:
                return ("Unable to delete compute service that has in-progress migrations. "
                        "Complete the migrations or delete the instances first.")
    return None


def _lock_providers(session: Session, host: str) -> list[int]:
    """The ids of ``host``'s resource providers, locked until the transaction ends: a claim writes
    its provider's row first (the generation), so one under way is waited for and then counted, and
    one that comes later finds no provider."""
    return list(session.scalars(select(ResourceProvider.id).where(ResourceProvider.host == host)
                                .order_by(ResourceProvider.id).with_for_update()))


def _forget_host(session: Session, host: str) -> None:
    """The API database's side of a deleted compute host: providers, aggregate memberships, mapping.

    Raises:
        Conflict: the host's resource provider still holds allocations.
    """
    providers = _lock_providers(session, host)
    if providers and session.scalar(select(func.count()).select_from(Allocation)
                                    .where(Allocation.resource_provider_id.in_(providers))):
        raise errors.Conflict(f"Unable to delete compute service: the resource provider of host {host} still "
                              f"has allocations.")
    if providers:
        session.execute(delete(Inventory).where(Inventory.resource_provider_id.in_(providers)))
        session.execute(delete(ResourceProvider).where(ResourceProvider.id.in_(providers)))
    session.execute(delete(AggregateHost).where(AggregateHost.host == host))
    session.execute(delete(HostMapping).where(HostMapping.host == host))


def delete_service(service: ServiceRecord) -> None:
    """Delete the record of a compute host that has left: its service, resource provider, aggregate
    memberships and host mapping. A host agent still running registers its host again.

    The API database's side is committed first and the service last: until the service is gone the
    delete can be asked again (each step finds what is left of its part), so one that failed half
    way is finished by asking again rather than leaving a provider and mapping without a service.

    Raises:
        Conflict: the host still runs servers, takes part in a migration, or holds allocations.
        NotFound: the service was deleted meanwhile.
    """
    reason = _busy(service.host)
    if reason:
        raise errors.Conflict(reason)
    with api_session() as api:
        # The allocation check and the removal share one transaction: a claim that lands on the host
        # meanwhile either shows up here (and the delete is refused) or finds no provider left.
        _forget_host(api, service.host)
        cell = api.scalars(select(CellMapping).where(CellMapping.name == service.cell)).one()
    with cell_session(cell) as session:
        deleted = session.execute(delete(Service).where(Service.uuid == service.uuid))
        if not getattr(deleted, "rowcount", 0):
            raise errors.NotFound(f"Service {service.uuid} could not be found.")
    logger.info("compute service deleted", extra={"host": service.host, "cell": service.cell})
