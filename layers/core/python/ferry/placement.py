"""Placement: resource providers, their inventories, and the allocations consumers hold on them.

One resource provider stands for one compute node. Its ``generation`` changes on every
inventory or allocation write, and every write is a compare-and-swap on the generation it
read (``UPDATE ... WHERE generation = :seen`` with the row count checked), so two writers
that both saw room for the last free slot cannot both take it: the second one's swap finds a
newer generation, its transaction rolls back, and it starts again from a fresh read, where
the slot is gone. Consumers (instances and migrations) carry a generation too, so a caller
that read a consumer's allocations before writing can ask for the write to fail if they
changed meanwhile.

:func:`set_allocations` is the one write primitive (placement's ``POST /allocations``);
:func:`claim`, :func:`claim_for_move`, :func:`move_allocations`, :func:`revert_move_allocations` and
:func:`delete_allocations` are built on the same transaction.

Each inventory row carries ``used``, the sum of its provider's allocations of that class. The
write transaction that changes allocations recomputes it for the providers it touched, after the
generation swap that serialises writers of those providers, so it always equals the sum of the
allocation rows. :func:`allocation_candidates` reads it to answer "which providers have room"
without summing allocations, a bounded window of providers at a time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import random
import time
import uuid as uuidlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import (
    ColumnElement,
    CursorResult,
    Delete,
    Integer,
    Select,
    Update,
    and_,
    case,
    delete,
    exists,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from ferry import config, errors
from ferry.observability import logger
from ferry.store.api_models import (
    AggregateHost,
    Allocation,
    CellMapping,
    Consumer,
    HostMapping,
    Inventory,
    ResourceProvider,
)
from ferry.store.db import CELL0_NAME, api_session, engine_for

VCPU = "VCPU"
MEMORY_MB = "MEMORY_MB"
DISK_GB = "DISK_GB"
RESOURCE_CLASSES = (VCPU, MEMORY_MB, DISK_GB)

_INVENTORY_FIELDS = ("total", "reserved", "min_unit", "max_unit", "step_size", "allocation_ratio")
# A missing max_unit is not here: it defaults to the class's total (see _inventory_record).
_INVENTORY_DEFAULTS = {"reserved": 0, "min_unit": 1, "step_size": 1}

# PostgreSQL SQLSTATEs after which the whole transaction may simply be run again.
_RETRYABLE_PGCODES = {"40001", "40P01"}  # serialization_failure, deadlock_detected
# Seconds: the longest pause before retry n (from 0) is min(CAP, BASE * 2**n), the pause a random part of it.
_RETRY_PAUSE_BASE = 0.01
_RETRY_PAUSE_CAP = 0.5

T = TypeVar("T")
Allocations = dict[str, dict[str, int]]
# A check a claim runs in its own transaction before writing (see :func:`claim`).
Guard = Callable[[Session], None]


class _GenerationConflict(Exception):
    """Another writer changed a provider or consumer between our read and our write (internal)."""


@dataclass(frozen=True)
class Provider:
    """A resource provider as stored: ``name`` is the compute node's name."""

    uuid: str
    name: str
    host: str
    cell_id: int | None
    generation: int


# --- capacity arithmetic ------------------------------------------------------------------------


def capacity(total: int, reserved: int, allocation_ratio: float) -> float:
    """How much of a resource class a provider can hand out: ``(total - reserved) * allocation_ratio``."""
    return (total - reserved) * allocation_ratio


def default_allocation_ratio(resource_class: str) -> float:
    """The configured allocation ratio for ``resource_class`` (1.0 for classes without a setting)."""
    settings = config.get()
    return {
        VCPU: settings.cpu_allocation_ratio,
        MEMORY_MB: settings.ram_allocation_ratio,
        DISK_GB: settings.disk_allocation_ratio,
    }.get(resource_class, 1.0)


def resources_from_flavor(flavor: Mapping[str, Any], is_bfv: bool) -> dict[str, int]:
    """The resources a server of ``flavor`` consumes, as placement amounts.

    DISK_GB is the root disk (nothing when the server boots from a volume) plus the ephemeral
    disk plus swap (MB, rounded up to whole GB). Classes with a zero amount are left out.

    Params:
        flavor: a dict with ``vcpus``, ``memory_mb``, ``root_gb``, ``ephemeral_gb``, ``swap``.
        is_bfv: whether the root disk is a volume (so not on the host).
    """
    disk_gb = (0 if is_bfv else int(flavor.get("root_gb") or 0)) + int(flavor.get("ephemeral_gb") or 0)
    disk_gb += math.ceil(int(flavor.get("swap") or 0) / 1024)
    amounts = {VCPU: int(flavor.get("vcpus") or 0), MEMORY_MB: int(flavor.get("memory_mb") or 0), DISK_GB: disk_gb}
    return {rc: amount for rc, amount in amounts.items() if amount}


# --- the retrying transaction -------------------------------------------------------------------


def _is_retryable(exc: DBAPIError) -> bool:
    return getattr(exc.orig, "pgcode", None) in _RETRYABLE_PGCODES


def _in_transaction(work: Callable[[Session], T], what: str) -> T:
    """Run ``work`` in one API database transaction, again from the start on a generation conflict.

    Raises:
        AllocationConflict: the conflicts outlasted ``placement_max_retries`` retries.
    """
    retries = config.get().placement_max_retries
    for attempt in range(retries + 1):
        try:
            with api_session() as session:
                return work(session)
        except _GenerationConflict as exc:
            reason = str(exc)
        except DBAPIError as exc:
            if not _is_retryable(exc):
                raise
            reason = type(exc.orig).__name__
        logger.info("placement write conflicted, retrying",
                    extra={"operation": what, "attempt": attempt + 1, "reason": reason})
        if attempt < retries:
            # Writers that lost together would collide again if they all retried at once: only
            # one of them wins each round, so a burst of claims on one provider would use up the
            # retries of the last ones. A random, growing pause spreads them out.
            time.sleep(random.uniform(0, min(_RETRY_PAUSE_CAP, _RETRY_PAUSE_BASE * 2 ** attempt)))
    logger.warning("placement write gave up after conflicts", extra={"operation": what, "retries": retries})
    raise errors.AllocationConflict(
        f"{what}: resource provider or consumer generations kept changing; gave up after {retries} retries.",
        retries=retries,
    )


def _rowcount(session: Session, stmt: Update | Delete) -> int:
    """Run a DML statement and return how many rows it matched."""
    result = cast(CursorResult[Any], session.execute(stmt))
    return result.rowcount


def _bump_provider(session: Session, provider_id: int, seen: int, **values: Any) -> None:
    stmt = (
        update(ResourceProvider)
        .where(ResourceProvider.id == provider_id, ResourceProvider.generation == seen)
        .values(generation=seen + 1, **values)
        .execution_options(synchronize_session=False)
    )
    if _rowcount(session, stmt) != 1:
        raise _GenerationConflict(f"resource provider {provider_id} changed after generation {seen}")


def _read_provider_generations(session: Session, provider_ids: set[int]) -> dict[int, int]:
    """Generations of the given providers, read before anything the write depends on."""
    if not provider_ids:
        return {}
    rows = session.execute(
        select(ResourceProvider.id, ResourceProvider.generation).where(ResourceProvider.id.in_(provider_ids))
    )
    return {row.id: row.generation for row in rows}


def _refresh_used(session: Session, provider_ids: Iterable[int]) -> None:
    """Set ``used`` of every inventory of the given providers to the sum of their allocations.

    Runs after the providers' generation swap in the same transaction: any other writer of these
    providers waits for (or conflicts with) this one, so the sum read here is the one committed.
    """
    ids = sorted(set(provider_ids))
    if not ids:
        return
    allocated = (
        select(func.coalesce(func.sum(Allocation.used), 0))
        .where(Allocation.resource_provider_id == Inventory.resource_provider_id,
               Allocation.resource_class == Inventory.resource_class)
        .scalar_subquery()
    )
    session.execute(
        update(Inventory).where(Inventory.resource_provider_id.in_(ids)).values(used=allocated)
        .execution_options(synchronize_session=False)
    )


# --- inventories --------------------------------------------------------------------------------


def _inventory_record(resource_class: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A complete inventory row for ``resource_class`` from a report (defaults filled in).

    A missing ``max_unit`` is the class's ``total`` (never below ``min_unit``), as Nova's libvirt
    driver reports it: overcommit lets more servers share a host, but no single allocation gets
    more than the host physically has, whatever the allocation ratio.

    Raises:
        BadRequest: a field is missing, not a number, or out of range.
    """
    if "total" not in spec:
        raise errors.BadRequest(f"Inventory of {resource_class} has no total.")
    record: dict[str, Any] = {}
    for field in ("total", "reserved", "min_unit", "max_unit", "step_size"):
        # total and min_unit come first, so they are read (and checked) before max_unit's default.
        default = max(record["total"], record["min_unit"]) if field == "max_unit" else _INVENTORY_DEFAULTS.get(field)
        value = spec.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise errors.BadRequest(f"Inventory field {field} of {resource_class} must be an integer.")
        record[field] = value
    ratio = spec.get("allocation_ratio")
    record["allocation_ratio"] = float(default_allocation_ratio(resource_class) if ratio is None else ratio)
    if record["total"] < 0 or record["reserved"] < 0:
        raise errors.BadRequest(f"Inventory of {resource_class}: total and reserved must not be negative.")
    if record["allocation_ratio"] <= 0:
        raise errors.BadRequest(f"Inventory of {resource_class}: allocation_ratio must be positive.")
    if not 1 <= record["min_unit"] <= record["max_unit"] or record["step_size"] < 1:
        raise errors.BadRequest(
            f"Inventory of {resource_class}: need 1 <= min_unit <= max_unit and step_size >= 1."
        )
    return record


def ensure_provider(host: str, node: str, cell_id: int | None, inventories: Mapping[str, Mapping[str, Any]],
                    reported_at: dt.datetime | None = None) -> str:
    """Create or update the resource provider of compute node ``node`` and replace its inventory.

    The provider is named after the node and records its host and cell. Missing
    ``allocation_ratio`` values come from the configured ``*_allocation_ratio`` and a missing
    ``max_unit`` is the class's ``total``; resource classes absent from ``inventories`` are
    removed. The inventory is not written (and the generation stays) when the provider already
    looks like this, so periodic reports do not disturb concurrent claims; with ``reported_at``
    the report's time is written all the same (one small update of the provider's row).

    Params:
        host: the compute host.
        node: the compute node (the provider's unique name).
        cell_id: the id of the host's cell mapping.
        inventories: ``{resource_class: {"total", "reserved"?, "allocation_ratio"?, "min_unit"?,
            "max_unit"?, "step_size"?}}``.
        reported_at: when the host's report was queued. An inventory reported before the one the
            provider has is left unwritten: reports of one host applied side by side (batches
            run at once) keep the newest inventory whatever order they finish in.

    Returns:
        The provider's uuid.

    Raises:
        BadRequest: an inventory field is invalid.
        InventoryInUse: a class that has allocations would be removed. A capacity below what is
            already allocated is taken, with a warning: nothing more fits until enough is freed.
        AllocationConflict: the provider kept changing under the update.
    """
    wanted = {rc: _inventory_record(rc, spec) for rc, spec in inventories.items()}

    def work(session: Session) -> str:
        row = session.execute(
            select(ResourceProvider.id, ResourceProvider.uuid, ResourceProvider.host, ResourceProvider.cell_id,
                   ResourceProvider.generation).where(ResourceProvider.name == node)
        ).one_or_none()
        if row is None:
            try:
                provider_id, provider_uuid = session.execute(
                    insert(ResourceProvider)
                    .values(name=node, host=host, cell_id=cell_id, generation=0, inventory_reported_at=reported_at)
                    .returning(ResourceProvider.id, ResourceProvider.uuid)
                ).one()
            except IntegrityError as exc:
                raise _GenerationConflict(f"resource provider {node} was created concurrently") from exc
            generation, current = 0, {}
        else:
            provider_id, provider_uuid, generation = row.id, row.uuid, row.generation
            if reported_at is not None and not _newest_report(session, provider_id, reported_at):
                if session.scalar(select(ResourceProvider.id).where(ResourceProvider.id == provider_id)) is None:
                    raise _GenerationConflict(f"resource provider {node} was removed concurrently")
                return provider_uuid
            current = {
                inv.resource_class: {field: getattr(inv, field) for field in _INVENTORY_FIELDS}
                for inv in session.scalars(select(Inventory).where(Inventory.resource_provider_id == provider_id))
            }
            if current == wanted and row.host == host and row.cell_id == cell_id:
                return provider_uuid

        used = dict(
            session.execute(
                select(Allocation.resource_class, func.sum(Allocation.used))
                .where(Allocation.resource_provider_id == provider_id)
                .group_by(Allocation.resource_class)
            ).all()
        )
        for rc, amount in used.items():
            record = wanted.get(rc)
            if record is None:
                if amount:
                    raise errors.InventoryInUse(
                        f"Resource provider {node}: {amount} {rc} are allocated; the class cannot be removed.",
                        provider=provider_uuid, resource_class=rc, used=amount, capacity=0,
                    )
                continue
            room = capacity(record["total"], record["reserved"], record["allocation_ratio"])
            if amount > room:
                # The host is what it is (a lower ratio, more reserved, a smaller disk): take it as
                # it reports, so that nothing more is placed there until enough is freed.
                logger.warning(
                    "inventory below what is allocated: no new claim fits until enough is freed",
                    extra={"provider": provider_uuid, "node": node, "resource_class": rc, "used": amount,
                           "capacity": room},
                )

        _bump_provider(session, provider_id, generation, host=host, cell_id=cell_id)
        removed = set(current) - set(wanted)
        if removed:
            session.execute(
                delete(Inventory).where(Inventory.resource_provider_id == provider_id,
                                        Inventory.resource_class.in_(removed))
            )
        for rc, record in wanted.items():
            if rc not in current:
                session.execute(insert(Inventory).values(resource_provider_id=provider_id, resource_class=rc,
                                                         used=int(used.get(rc, 0)), **record))
            elif current[rc] != record:
                session.execute(
                    update(Inventory)
                    .where(Inventory.resource_provider_id == provider_id, Inventory.resource_class == rc)
                    .values(**record)
                )
        return provider_uuid

    provider_uuid = _in_transaction(work, f"update inventory of {node}")
    logger.debug("resource provider ensured", extra={"host": host, "node": node, "provider": provider_uuid})
    return provider_uuid


def _newest_report(session: Session, provider_id: int, reported_at: dt.datetime) -> bool:
    """Record ``reported_at`` as the provider's newest inventory report unless a newer one was
    applied; whether it is the newest. The conditional write locks the provider's row until the
    transaction ends, so two reports of one provider apply one after the other, in either order."""
    result = session.execute(
        update(ResourceProvider)
        .where(ResourceProvider.id == provider_id,
               or_(ResourceProvider.inventory_reported_at.is_(None),
                   ResourceProvider.inventory_reported_at <= reported_at))
        .values(inventory_reported_at=reported_at))
    return bool(cast(CursorResult[Any], result).rowcount)


# --- allocations --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Change:
    consumer: str
    project_id: str | None
    user_id: str | None
    allocations: Allocations
    check_generation: bool
    expected_generation: int | None
    # For a migration's consumer created by the change: the instance it moves.
    moves_instance: str | None = None


_NOT_GIVEN = object()


def _normalise_change(consumer: str, change: Mapping[str, Any]) -> _Change:
    """Validate one consumer's entry of :func:`set_allocations` and drop zero amounts.

    Raises:
        BadRequest: amounts that are not non-negative integers, or a malformed entry.
    """
    raw = change.get("allocations")
    if not isinstance(raw, Mapping):
        raise errors.BadRequest(f"Consumer {consumer}: allocations must be an object.")
    allocations: Allocations = {}
    for rp_uuid, resources in raw.items():
        if not isinstance(resources, Mapping):
            raise errors.BadRequest(f"Consumer {consumer}: resources on {rp_uuid} must be an object.")
        kept: dict[str, int] = {}
        for rc, amount in resources.items():
            if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
                raise errors.BadRequest(f"Consumer {consumer}: {rc} on {rp_uuid} must be a non-negative integer.")
            if amount:
                kept[rc] = amount
        if kept:
            allocations[rp_uuid] = kept
    expected = change.get("consumer_generation", _NOT_GIVEN)
    return _Change(
        consumer=consumer,
        project_id=change.get("project_id"),
        user_id=change.get("user_id"),
        allocations=allocations,
        check_generation=expected is not _NOT_GIVEN,
        expected_generation=None if expected is _NOT_GIVEN else expected,  # type: ignore[arg-type]
    )


def _write_allocations(session: Session, changes: list[_Change], *,
                       based_on: Mapping[str, Allocations] | None = None) -> None:
    """Replace the allocations of every consumer in ``changes`` inside ``session``'s transaction.

    ``based_on`` gives, for consumers whose allocations the caller read to build ``changes`` (a
    move hands over what the source held), the allocations it read: if they are no longer what
    the consumer holds once the providers are locked, the write is stale and is run again.
    Every provider of those allocations must be among the ones the changes touch.

    Raises:
        _GenerationConflict: a provider or consumer changed after it was read (the caller retries).
        InsufficientCapacity / ResourceProviderNotFound / AllocationConflict / BadRequest: see
            :func:`set_allocations`.
    """
    names = sorted(c.consumer for c in changes)
    consumers = {
        row.uuid: row
        for row in session.execute(
            select(Consumer.uuid, Consumer.generation, Consumer.project_id, Consumer.user_id)
            .where(Consumer.uuid.in_(names))
        )
    }
    for change in changes:
        row = consumers.get(change.consumer)
        actual = row.generation if row is not None else None
        if change.check_generation and actual != change.expected_generation:
            # The caller decided on a state it read earlier; running again would not change that.
            raise errors.AllocationConflict(
                f"Consumer {change.consumer} has generation {actual}, not the expected "
                f"{change.expected_generation}: its allocations changed meanwhile.",
                consumer=change.consumer, expected=change.expected_generation, actual=actual,
            )
        if row is None and change.allocations and not (change.project_id and change.user_id):
            raise errors.BadRequest(f"Consumer {change.consumer} is new: project_id and user_id are required.")

    requested_uuids = {rp for c in changes for rp in c.allocations}
    providers = {
        row.uuid: row.id
        for row in session.execute(
            select(ResourceProvider.uuid, ResourceProvider.id).where(ResourceProvider.uuid.in_(requested_uuids))
        )
    }
    missing = requested_uuids - set(providers)
    if missing:
        raise errors.ResourceProviderNotFound(f"Resource provider {sorted(missing)[0]} could not be found.")
    released_ids = set(
        session.scalars(
            select(Allocation.resource_provider_id).where(Allocation.consumer_uuid.in_(names)).distinct()
        )
    )
    requested_ids = set(providers.values())
    # Generations first: whatever committed after this read fails the swap below.
    generations = _read_provider_generations(session, requested_ids | released_ids)

    _check_capacity(session, changes, providers, names)

    for provider_id in sorted(generations):
        _bump_provider(session, provider_id, generations[provider_id])
    # The swaps above hold the providers' rows until commit, so anything that changes these
    # consumers' allocations from now on waits for this transaction and then finds a new generation.
    for consumer, expected in (based_on or {}).items():
        if _allocations_of(session, consumer) != expected:
            raise _GenerationConflict(f"consumer {consumer}'s allocations changed after they were read")
    for change in sorted(changes, key=lambda c: c.consumer):
        _write_consumer(session, change, consumers.get(change.consumer))

    deleted_from = set(session.scalars(
        delete(Allocation).where(Allocation.consumer_uuid.in_(names)).returning(Allocation.resource_provider_id)
    ))
    if deleted_from - set(generations):
        # A claim for one of these consumers committed after their allocations were read (a
        # consumer not yet recorded has no generation to swap): its provider was neither checked
        # nor will its usage be refreshed, so start again from what is there now.
        raise _GenerationConflict(f"allocations of {names} were written after they were read")
    rows = [
        {"resource_provider_id": providers[rp_uuid], "consumer_uuid": change.consumer, "resource_class": rc,
         "used": amount}
        for change in changes
        for rp_uuid, resources in change.allocations.items()
        for rc, amount in resources.items()
    ]
    if rows:
        session.execute(insert(Allocation), rows)
    _refresh_used(session, generations)


def _check_capacity(session: Session, changes: list[_Change], providers: dict[str, int], names: list[str]) -> None:
    """Raise InsufficientCapacity unless every requested amount fits its provider's inventory.

    What these consumers already hold there counts as fitting: a provider whose capacity shrank
    below its usage still takes a write that adds nothing to it (a move handed back, a smaller
    claim), never one that adds. The same holds for ``max_unit``, which follows the host's size:
    an allocation made before the host shrank may be handed back and forth, not made anew.
    """
    requested: dict[tuple[int, str], int] = defaultdict(int)
    for change in changes:
        for rp_uuid, resources in change.allocations.items():
            for rc, amount in resources.items():
                requested[(providers[rp_uuid], rc)] += amount
    if not requested:
        return
    provider_ids = {rp_id for rp_id, _ in requested}
    inventories = {
        (inv.resource_provider_id, inv.resource_class): inv
        for inv in session.scalars(select(Inventory).where(Inventory.resource_provider_id.in_(provider_ids)))
    }
    used_by_others = _usage(session, provider_ids, Allocation.consumer_uuid.not_in(names))
    held = _usage(session, provider_ids, Allocation.consumer_uuid.in_(names))
    uuid_of = {rp_id: rp_uuid for rp_uuid, rp_id in providers.items()}
    for change in changes:
        for rp_uuid, resources in change.allocations.items():
            for rc, amount in resources.items():
                key = (providers[rp_uuid], rc)
                inv = inventories.get(key)
                if inv is None:
                    raise errors.InsufficientCapacity(
                        f"Resource provider {rp_uuid} has no inventory of {rc}.", provider=rp_uuid, resource_class=rc
                    )
                too_large = amount > inv.max_unit and requested[key] > held.get(key, 0)
                if amount < inv.min_unit or too_large or amount % inv.step_size:
                    raise errors.InsufficientCapacity(
                        f"{amount} {rc} on resource provider {rp_uuid} is outside min_unit {inv.min_unit}, "
                        f"max_unit {inv.max_unit}, step_size {inv.step_size}.",
                        provider=rp_uuid, resource_class=rc,
                    )
    for (rp_id, rc), amount in sorted(requested.items()):
        inv = inventories[(rp_id, rc)]
        room = capacity(inv.total, inv.reserved, inv.allocation_ratio)
        used = used_by_others.get((rp_id, rc), 0)
        if used + amount > room and amount > held.get((rp_id, rc), 0):
            raise errors.InsufficientCapacity(
                f"Resource provider {uuid_of[rp_id]} cannot fit {amount} {rc}: {used} of {room:g} in use.",
                provider=uuid_of[rp_id], resource_class=rc, requested=amount, used=used, capacity=room,
            )


def _usage(session: Session, provider_ids: set[int], consumers: ColumnElement[bool]) -> dict[tuple[int, str], int]:
    """``{(provider id, resource class): amount}`` that the ``consumers`` matched use on those providers."""
    return {
        (row.resource_provider_id, row.resource_class): row.used
        for row in session.execute(
            select(Allocation.resource_provider_id, Allocation.resource_class, func.sum(Allocation.used).label("used"))
            .where(Allocation.resource_provider_id.in_(provider_ids), consumers)
            .group_by(Allocation.resource_provider_id, Allocation.resource_class)
        )
    }


def _write_consumer(session: Session, change: _Change, row: Any) -> None:
    """Create, bump or delete the consumer record of ``change`` with a compare-and-swap."""
    if row is None:
        if not change.allocations:
            return
        try:
            session.execute(
                insert(Consumer).values(uuid=change.consumer, project_id=change.project_id,
                                        user_id=change.user_id, generation=1, instance_uuid=change.moves_instance)
            )
        except IntegrityError as exc:
            raise _GenerationConflict(f"consumer {change.consumer} was created concurrently") from exc
        return
    condition = (Consumer.uuid == change.consumer, Consumer.generation == row.generation)
    stmt: Update | Delete
    if change.allocations:
        stmt = update(Consumer).where(*condition).values(
            generation=row.generation + 1,
            project_id=change.project_id or row.project_id,
            user_id=change.user_id or row.user_id,
        )
    else:
        stmt = delete(Consumer).where(*condition)
    if _rowcount(session, stmt.execution_options(synchronize_session=False)) != 1:
        raise _GenerationConflict(f"consumer {change.consumer} changed after generation {row.generation}")


def set_allocations(changes: Mapping[str, Mapping[str, Any]]) -> None:
    """Replace the allocations of every consumer named, all or nothing, in one transaction.

    The capacity of each (provider, resource class) is checked against what other consumers
    use: ``used_by_others + requested <= (total - reserved) * allocation_ratio``, and each
    amount against the inventory's ``min_unit``, ``max_unit`` and ``step_size``. Every provider
    that gains or loses allocations, and every consumer named, gets a new generation; a
    consumer left without allocations is deleted. When a generation changed under the write,
    the whole transaction runs again (up to ``placement_max_retries`` times).

    Params:
        changes: ``{consumer_uuid: {"project_id", "user_id", "allocations": {rp_uuid: {rc: n}},
            "consumer_generation"?}}``. An empty ``allocations`` removes the consumer's
            allocations. ``project_id``/``user_id`` are needed only for a new consumer. With
            ``consumer_generation`` (an int, or None for "the consumer must not exist yet") the
            write happens only if the consumer still has that generation.

    Raises:
        InsufficientCapacity: an amount does not fit (not retried).
        AllocationConflict: generations kept changing, or a consumer's generation is not the one
            given in ``consumer_generation``.
        ResourceProviderNotFound: an allocation names an unknown provider.
        BadRequest: malformed changes.
    """
    normalised = [_normalise_change(consumer, change) for consumer, change in changes.items()]
    if not normalised:
        return
    _in_transaction(lambda session: _write_allocations(session, normalised), "set allocations")


def claim(consumer_uuid: str, project_id: str, user_id: str, allocations: Mapping[str, Mapping[str, int]],
          *, consumer_generation: Any = _NOT_GIVEN, guard: Guard | None = None) -> None:
    """Replace ``consumer_uuid``'s allocations with ``allocations`` (``{rp_uuid: {rc: n}}``).

    ``guard`` runs first in the claim's transaction (each time it is tried); what it raises
    leaves everything as it was.

    Raises: as :func:`set_allocations`, and what ``guard`` raises.
    """
    change: dict[str, Any] = {"project_id": project_id, "user_id": user_id, "allocations": allocations}
    if consumer_generation is not _NOT_GIVEN:
        change["consumer_generation"] = consumer_generation
    if guard is None:
        set_allocations({consumer_uuid: change})
        return
    wanted = [_normalise_change(consumer_uuid, change)]

    def work(session: Session) -> None:
        guard(session)
        _write_allocations(session, wanted)

    _in_transaction(work, "set allocations")


def claim_for_move(instance_uuid: str, migration_uuid: str, project_id: str, user_id: str,
                   allocations: Mapping[str, Mapping[str, int]], *, guard: Guard | None = None) -> None:
    """Hand the instance's current allocations to its migration and claim ``allocations`` for it.

    In one transaction: unless the migration already holds allocations (an earlier run of the
    same move did this), the instance's current allocations become the migration's (its
    consumer records the instance it moves); then the instance's allocations are replaced with
    ``allocations``. When both land on one provider (a same-host resize) they must fit together.
    ``guard``: as for :func:`claim`.

    Raises: as :func:`set_allocations`, and what ``guard`` raises.
    """
    wanted = _normalise_change(instance_uuid, {"project_id": project_id, "user_id": user_id,
                                               "allocations": allocations})

    def work(session: Session) -> None:
        if guard is not None:
            guard(session)
        changes = [wanted]
        read = {migration_uuid: _allocations_of(session, migration_uuid)}
        if not read[migration_uuid]:
            held = read[instance_uuid] = _allocations_of(session, instance_uuid)
            if held:
                changes.append(_Change(migration_uuid, project_id, user_id, held, False, None,
                                       moves_instance=instance_uuid))
        _write_allocations(session, changes, based_on=read)

    _in_transaction(work, f"claim for migration {migration_uuid}")


def move_allocations(source_consumer: str, target_consumer: str) -> None:
    """Give ``target_consumer`` exactly the allocations ``source_consumer`` holds; the source ends with none.

    Atomic; a no-op when the source holds nothing (the move already happened), so it can run twice,
    and when source and target are the same consumer.

    Raises: as :func:`set_allocations`.
    """
    if source_consumer == target_consumer:
        return
    _in_transaction(lambda session: _hand_over(session, source_consumer, target_consumer),
                    f"move allocations {source_consumer} -> {target_consumer}")


def _hand_over(session: Session, source_consumer: str, target_consumer: str) -> bool:
    """In ``session``'s transaction, replace the target's allocations with the source's; the source ends with none.

    Returns:
        Whether the source held anything (nothing is written when it did not).
    """
    held = _allocations_of(session, source_consumer)
    if not held:
        return False
    owner = session.execute(
        select(Consumer.project_id, Consumer.user_id).where(Consumer.uuid == source_consumer)
    ).one()
    _write_allocations(session, [
        _Change(source_consumer, None, None, {}, False, None),
        _Change(target_consumer, owner.project_id, owner.user_id, held, False, None),
    ], based_on={source_consumer: held})
    return True


def revert_move_allocations(migration_uuid: str, instance_uuid: str, *,
                            claimed: Mapping[str, Mapping[str, int]] | None,
                            claim_generation: int | None = None, same_host: bool = False) -> None:
    """Undo a move's allocations: the instance gets back what the migration holds, and its destination claim goes.

    One transaction. When the migration holds allocations (the instance's on the source, handed
    over by :func:`claim_for_move`), they replace whatever the instance holds and the migration
    ends with none. When it holds none (the server held no allocation when the move started, or
    an operator removed the migration's since), there is nothing to give back, but the
    destination claim is dropped all the same: the instance's allocations are removed if they
    are still exactly ``claimed`` and, when ``claim_generation`` is given, its consumer still has
    that generation. The generation alone would not do: a consumer left without allocations is
    deleted and a new one starts again at generation 1, so an allocation written since the claim
    went (an operator giving the server its allocation back) can have the claim's generation.
    Nor would the allocations alone on one host: there the server's own allocation given back is
    the claim's when the two flavors are the same size, so a ``same_host`` move drops the claim
    only at ``claim_generation``. Allocations that are not the claim (an earlier run already
    gave the instance its source allocation back or dropped the claim, an operator wrote them)
    are left alone. No other consumer is touched, and running it again changes nothing more.

    Params:
        migration_uuid: the move's migration (consumer of the source allocation).
        instance_uuid: the server (consumer of the destination claim).
        claimed: the destination claim, ``{rp_uuid: {rc: n}}``; None (or empty) when it is not
            known: then the claim goes only in place of a source allocation handed back.
        claim_generation: the instance consumer's generation while it held ``claimed``; None
            when not known (then the allocations alone decide, unless ``same_host``).
        same_host: the destination is the source's provider (a resize on one host).

    Raises:
        AllocationConflict: the instance's allocations changed while its claim was being
            dropped, or generations kept changing (as :func:`set_allocations`).
    """
    claim = {rp_uuid: {rc: int(n) for rc, n in resources.items() if n}
             for rp_uuid, resources in (claimed or {}).items() if any(resources.values())}

    def claim_dropped(session: Session) -> bool:
        if _hand_over(session, migration_uuid, instance_uuid):
            return False
        if not claim or (same_host and claim_generation is None):
            return False
        generation = session.scalars(
            select(Consumer.generation).where(Consumer.uuid == instance_uuid)
        ).one_or_none()
        if generation is None or (claim_generation is not None and generation != claim_generation):
            return False
        if _allocations_of(session, instance_uuid) != claim:
            return False
        _write_allocations(session, [_Change(instance_uuid, None, None, {}, True, generation)],
                           based_on={instance_uuid: claim})
        return True

    if _in_transaction(claim_dropped, f"revert allocations of migration {migration_uuid}"):
        # Nova logs the same situation ("Did not find resource allocations for migration") and
        # keeps the claim; the server keeps no allocation instead, as an operator left it.
        logger.warning("migration held no allocation to give back; the instance's destination claim was dropped",
                       extra={"migration_uuid": migration_uuid, "instance_uuid": instance_uuid})


def delete_allocations(consumer_uuid: str) -> None:
    """Remove every allocation of ``consumer_uuid`` and the consumer (a no-op when it has none)."""
    set_allocations({consumer_uuid: {"allocations": {}}})


# --- reads --------------------------------------------------------------------------------------


def _allocations_of(session: Session, consumer_uuid: str) -> Allocations:
    rows = session.execute(
        select(ResourceProvider.uuid, Allocation.resource_class, Allocation.used)
        .join(ResourceProvider, ResourceProvider.id == Allocation.resource_provider_id)
        .where(Allocation.consumer_uuid == consumer_uuid)
    )
    held: Allocations = defaultdict(dict)
    for rp_uuid, rc, used in rows:
        held[rp_uuid][rc] = used
    return dict(held)


def get_allocations(consumer_uuid: str) -> Allocations:
    """``{rp_uuid: {rc: amount}}`` held by ``consumer_uuid`` (empty when none)."""
    with api_session() as session:
        return _allocations_of(session, consumer_uuid)


def consumer_generation(consumer_uuid: str) -> int | None:
    """The consumer's generation, or None when it holds no allocations (for read-then-write callers)."""
    with api_session() as session:
        return session.scalars(select(Consumer.generation).where(Consumer.uuid == consumer_uuid)).one_or_none()


def consumer_allocations(consumer_uuid: str) -> tuple[int | None, Allocations]:
    """The consumer's generation and its allocations, read in one statement so they belong together.

    ``(None, {})`` when it holds no allocations.
    """
    with api_session() as session:
        rows = session.execute(
            select(Consumer.generation, ResourceProvider.uuid, Allocation.resource_class, Allocation.used)
            .select_from(Consumer)
            .join(Allocation, Allocation.consumer_uuid == Consumer.uuid, isouter=True)
            .join(ResourceProvider, ResourceProvider.id == Allocation.resource_provider_id, isouter=True)
            .where(Consumer.uuid == consumer_uuid)
        ).all()
    held: Allocations = defaultdict(dict)
    for _generation, rp_uuid, rc, used in rows:
        if rp_uuid is not None:
            held[rp_uuid][rc] = used
    return (rows[0].generation if rows else None), dict(held)


def _provider_id(session: Session, rp_uuid: str) -> int:
    provider_id = session.scalars(select(ResourceProvider.id).where(ResourceProvider.uuid == rp_uuid)).one_or_none()
    if provider_id is None:
        raise errors.ResourceProviderNotFound(f"Resource provider {rp_uuid} could not be found.")
    return provider_id


def usages(rp_uuid: str) -> dict[str, int]:
    """``{rc: amount allocated}`` on the provider; classes nobody uses are left out.

    Raises:
        ResourceProviderNotFound: no such provider.
    """
    with api_session() as session:
        provider_id = _provider_id(session, rp_uuid)
        rows = session.execute(
            select(Inventory.resource_class, Inventory.used).where(Inventory.resource_provider_id == provider_id)
        ).all()
        return {rc: int(used) for rc, used in rows if used}


def get_inventories(rp_uuid: str) -> dict[str, dict[str, Any]]:
    """``{rc: {total, reserved, min_unit, max_unit, step_size, allocation_ratio}}`` of the provider.

    Raises:
        ResourceProviderNotFound: no such provider.
    """
    with api_session() as session:
        provider_id = _provider_id(session, rp_uuid)
        return {
            inv.resource_class: {field: getattr(inv, field) for field in _INVENTORY_FIELDS}
            for inv in session.scalars(select(Inventory).where(Inventory.resource_provider_id == provider_id))
        }


def _provider_where(*criteria: Any) -> Provider | None:
    with api_session() as session:
        row = session.scalars(select(ResourceProvider).where(*criteria).order_by(ResourceProvider.id)).first()
        if row is None:
            return None
        return Provider(uuid=row.uuid, name=row.name, host=row.host, cell_id=row.cell_id, generation=row.generation)


def get_provider(rp_uuid: str) -> Provider:
    """The provider with uuid ``rp_uuid``.

    Raises:
        ResourceProviderNotFound: no such provider.
    """
    provider = _provider_where(ResourceProvider.uuid == rp_uuid)
    if provider is None:
        raise errors.ResourceProviderNotFound(f"Resource provider {rp_uuid} could not be found.")
    return provider


def provider_by_host(host: str) -> str:
    """The uuid of ``host``'s resource provider (its first node's; libvirt hosts have one node).

    Raises:
        ResourceProviderNotFound: the host has no provider.
    """
    provider = _provider_where(ResourceProvider.host == host)
    if provider is None:
        raise errors.ResourceProviderNotFound(f"Host {host} has no resource provider.")
    return provider.uuid


def provider_by_node(node: str) -> str:
    """The uuid of compute node ``node``'s resource provider.

    Raises:
        ResourceProviderNotFound: the node has no provider.
    """
    provider = _provider_where(ResourceProvider.name == node)
    if provider is None:
        raise errors.ResourceProviderNotFound(f"Compute node {node} has no resource provider.")
    return provider.uuid


def host_of_node(node: str) -> str | None:
    """The host of compute node ``node`` (its resource provider's), or None when there is no such node."""
    provider = _provider_where(ResourceProvider.name == node)
    return provider.host if provider is not None else None


# --- allocation candidates ----------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateRequest:
    """What a request asks of placement: the resources, and where they may come from.

    Params:
        resources: ``{resource_class: amount}``, all from one provider.
        cells: names of the cells candidates may be in; None for every cell but cell0. Cells
            marked disabled give no candidates unless ``include_disabled``.
        cell, host, node: only candidates in this cell, on this host, on this compute node.
        exclude_cell: no candidates in this cell.
        hosts: only candidates on one of these hosts (None: any host).
        member_of: for each entry, the candidate's host must be in at least one of these
            aggregates (ids); every entry must hold.
        exclude_consumers: consumers whose allocations count as free (those a claim replaces).
        include_disabled: candidates in disabled cells too (a move held to its server's own cell,
            which a disabled cell still takes, as Nova's requested destination cell does).
    """

    resources: Mapping[str, int] = dataclasses.field(default_factory=dict)
    cells: tuple[str, ...] | None = None
    cell: str | None = None
    host: str | None = None
    node: str | None = None
    hosts: frozenset[str] | None = None
    member_of: tuple[frozenset[int], ...] = ()
    exclude_consumers: tuple[str, ...] = ()
    exclude_cell: str | None = None
    include_disabled: bool = False


@dataclass(frozen=True)
class Candidate:
    """A provider with room for the request: where it is and ``{resource_class: free}`` of each class it has."""

    uuid: str
    name: str
    host: str
    cell_id: int
    cell: str
    free: dict[str, float]


# The largest window of providers read per query, as a multiple of the batch size (the window
# grows when few providers in it fit).
_MAX_WINDOW_FACTOR = 16


# The candidate queries are Core statements on plain connections: they run on every scheduling
# request, and the ORM's per-statement and per-session work is a large share of their cost.
_RP = ResourceProvider.__table__
_INV = Inventory.__table__
_ALLOC = Allocation.__table__
_HOST_MAP = HostMapping.__table__
_CELL = CellMapping.__table__
_AGG_HOST = AggregateHost.__table__


@contextmanager
def _api_reader() -> Iterator[Connection]:
    """A connection to the API database for reads; its transaction ends (rolled back) on exit."""
    with engine_for(config.get().api_database_url).connect() as connection:
        yield connection


def _scope(request: CandidateRequest) -> list[ColumnElement[bool]]:
    """WHERE clauses for the cells, host, node, host set and aggregates of ``request``."""
    clauses: list[ColumnElement[bool]] = [] if request.include_disabled else [_CELL.c.disabled.is_(False)]
    if request.cells is None:
        clauses.append(_CELL.c.name != CELL0_NAME)
    else:
        clauses.append(_CELL.c.name.in_(request.cells))
    if request.cell:
        clauses.append(_CELL.c.name == request.cell)
    if request.exclude_cell:
        clauses.append(_CELL.c.name != request.exclude_cell)
    if request.host:
        clauses.append(_RP.c.host == request.host)
    if request.node:
        clauses.append(_RP.c.name == request.node)
    if request.hosts is not None:
        clauses.append(_RP.c.host.in_(sorted(request.hosts)))
    for aggregate_ids in request.member_of:
        clauses.append(exists().where(_AGG_HOST.c.host == _RP.c.host,
                                      _AGG_HOST.c.aggregate_id.in_(sorted(aggregate_ids))))
    return clauses


def _in_cells() -> Any:
    """Providers joined to their host's cell (the host mapping is the authority on it)."""
    return _RP.join(_HOST_MAP, _HOST_MAP.c.host == _RP.c.host).join(_CELL, _CELL.c.id == _HOST_MAP.c.cell_id)


def count_in_scope(request: CandidateRequest) -> int:
    """How many providers ``request``'s scope holds, capacity not considered (one count over them all)."""
    with _api_reader() as connection:
        return connection.scalar(
            select(func.count(_RP.c.id)).select_from(_in_cells()).where(*_scope(request))
        ) or 0


def _credits(connection: Connection, consumers: Iterable[str]) -> dict[str, dict[int, int]]:
    """``{rc: {provider_id: amount}}`` the given consumers hold (their allocations count as free)."""
    names = sorted(set(consumers))
    held: dict[str, dict[int, int]] = defaultdict(dict)
    if names:
        for rp_id, rc, amount in connection.execute(
            select(_ALLOC.c.resource_provider_id, _ALLOC.c.resource_class, func.sum(_ALLOC.c.used))
            .where(_ALLOC.c.consumer_uuid.in_(names))
            .group_by(_ALLOC.c.resource_provider_id, _ALLOC.c.resource_class)
        ):
            held[rc][rp_id] = int(amount)
    return dict(held)


def _candidate_query(request: CandidateRequest,
                     credits: Mapping[str, Mapping[int, int]]) -> tuple[Select[Any], list[str]]:
    """The query for providers in scope with room for every requested class, and the classes it reports free of.

    One inventory join per class: inner (with the fit conditions) for the requested classes,
    outer for the others, so the free amount of every class the provider has comes back.
    """
    classes = list(RESOURCE_CLASSES) + sorted(rc for rc in request.resources if rc not in RESOURCE_CLASSES)
    free_columns: list[Any] = []
    conditions: list[ColumnElement[bool]] = []
    joined = _in_cells()
    for n, rc in enumerate(classes):
        inv = _INV.alias(f"inv_{n}")
        room = (inv.c.total - inv.c.reserved) * inv.c.allocation_ratio
        used: Any = inv.c.used
        held = credits.get(rc)
        if held:
            released = case(*((inv.c.resource_provider_id == rp_id, amount) for rp_id, amount in sorted(held.items())),
                            else_=0)
            used = inv.c.used - released
        free_columns.append(room - used)
        amount = request.resources.get(rc)
        joined = joined.join(inv, and_(inv.c.resource_provider_id == _RP.c.id, inv.c.resource_class == rc),
                             isouter=amount is None)
        if amount is not None:
            conditions += [used + amount <= room, inv.c.min_unit <= amount, inv.c.max_unit >= amount,
                           literal(amount, Integer) % inv.c.step_size == 0]
    if not request.resources:
        # A provider without any inventory is no candidate, even for a request that needs nothing.
        conditions.append(exists().where(_INV.c.resource_provider_id == _RP.c.id))
    query = (
        select(_RP.c.uuid, _RP.c.name, _RP.c.host, _CELL.c.id, _CELL.c.name, *free_columns)
        .select_from(joined)
        .where(*_scope(request), *conditions)
        .order_by(_RP.c.uuid)
    )
    return query, classes


def _candidate(row: Any, classes: list[str]) -> Candidate:
    free = {rc: float(value) for rc, value in zip(classes, row[5:], strict=True) if value is not None}
    return Candidate(uuid=row[0], name=row[1], host=row[2], cell_id=row[3], cell=row[4], free=free)


def _narrow_to_hosts(connection: Connection, request: CandidateRequest, limit: int) -> CandidateRequest:
    """Turn aggregate memberships that cover at most ``limit`` hosts into a host set (an indexed lookup)."""
    hosts = request.hosts
    kept: list[frozenset[int]] = []
    for aggregate_ids in request.member_of:
        members = set(connection.scalars(
            select(_AGG_HOST.c.host).where(_AGG_HOST.c.aggregate_id.in_(sorted(aggregate_ids)))
            .distinct().limit(limit + 1)
        ))
        if len(members) > limit:
            kept.append(aggregate_ids)
        else:
            hosts = frozenset(members) if hosts is None else hosts & members
    if hosts is request.hosts:
        return request
    return dataclasses.replace(request, hosts=hosts, member_of=tuple(kept))


def random_pivot(rng: random.Random | None = None) -> str:
    """A uniformly random point in the space of provider uuids, where a walk over them starts."""
    return str(uuidlib.UUID(int=(rng or random).getrandbits(128)))


def allocation_candidates(request: CandidateRequest, *, limit: int,
                          pivot: str | None = None) -> Iterator[list[Candidate]]:
    """The providers with room for ``request``, in batches of at most ``limit``, each provider once.

    Providers are walked in the order of their (random) uuids starting at ``pivot`` (random when
    not given) and wrapping around, so every fitting provider is equally likely to be in the first
    batch and requests spread over the fitting hosts. The walk reads a bounded window of
    providers per query (a uuid range on its index, the inventories by their unique index, the
    ``used`` counters instead of the allocations), so a batch costs about the same at 1,000 or
    100,000 providers as long as a fair share of them fits. A request narrowed to a host, a node
    or a small set of hosts is answered in one query. Nothing is held open between batches.

    Params:
        request: what to look for (:class:`CandidateRequest`).
        limit: the largest batch (``max_placement_results``).
        pivot: where the walk starts (a uuid string), for repeatable results.

    Yields:
        Lists of :class:`Candidate`; the last one may be shorter, none is empty.
    """
    limit = max(limit, 1)
    pivot = pivot or random_pivot()
    uuid_column = _RP.c.uuid
    first_window: tuple[list[Any], str | None] | None = None
    with _api_reader() as connection:
        credits = _credits(connection, request.exclude_consumers)
        request = _narrow_to_hosts(connection, request, limit)
        query, classes = _candidate_query(request, credits)
        few = bool(request.host or request.node or request.hosts is not None)
        if few:
            rows = list(connection.execute(query).all())
        else:
            first_window = _read_window(connection, query, [uuid_column >= pivot], limit)

    if few:
        ordered = sorted(rows, key=lambda row: (row[0] < pivot, row[0]))
        for start in range(0, len(ordered), limit):
            yield [_candidate(row, classes) for row in ordered[start:start + limit]]
        return

    buffer: list[Candidate] = []
    window = limit
    scanned = fitted = 0
    # The two arcs of the circle of uuids: from the pivot up, then from the bottom to the pivot.
    for low, high in ((pivot, None), (None, pivot)):
        lower: ColumnElement[bool] | None = None if low is None else uuid_column >= low
        while True:
            if first_window is not None:
                (rows, end), first_window = first_window, None
            else:
                bounds = [c for c in (lower, None if high is None else uuid_column < high) if c is not None]
                with _api_reader() as connection:
                    rows, end = _read_window(connection, query, bounds, window)
            buffer.extend(_candidate(row, classes) for row in rows)
            while len(buffer) >= limit:
                yield buffer[:limit]
                buffer = buffer[limit:]
            if end is None:
                break
            lower = uuid_column > end
            # Size the next window for what the batch still needs, at the share that fitted so far.
            scanned, fitted = scanned + window, fitted + len(rows)
            share = fitted / scanned if fitted else 1 / _MAX_WINDOW_FACTOR
            window = min(max(math.ceil((limit - len(buffer)) / share), 1), limit * _MAX_WINDOW_FACTOR)
    if buffer:
        yield buffer


def _read_window(connection: Connection, query: Select[Any], bounds: list[ColumnElement[bool]],
                 window: int) -> tuple[list[Any], str | None]:
    """The fitting rows among the next ``window`` providers within ``bounds`` (uuid order), and the last uuid read.

    The last uuid is None when fewer than ``window`` providers were left within the bounds.
    """
    uuid_column = _RP.c.uuid
    end = connection.scalar(select(uuid_column).where(*bounds).order_by(uuid_column).offset(window - 1).limit(1))
    if end is not None:
        bounds = [*bounds, uuid_column <= end]
    return list(connection.execute(query.where(*bounds)).all()), end
