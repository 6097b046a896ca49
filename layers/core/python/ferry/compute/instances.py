"""Instance records: look-ups through the instance mapping and compare-and-swap updates."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, delete, false, or_, select, update
from sqlalchemy.orm import Session

from ferry import errors
from ferry.store.api_models import CellMapping, InstanceMapping
from ferry.store.cell_models import (
    BlockDeviceMapping,
    Instance,
    InstanceAction,
    InstanceActionEvent,
    InstanceFault,
    Migration,
    Tag,
)
from ferry.store.db import api_session, cell_session

# What a server's owner may change (PUT /servers/{id}): the API's name of each field, and its column.
UPDATABLE = {"name": "display_name", "description": "display_description", "hostname": "hostname"}
# The longest hostname made from a server's name (one DNS label).
HOSTNAME_LENGTH = 63


def new_reservation_id() -> str:
    """A create request's id, as Nova makes them: ``r-`` and eight lower-case letters or digits."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "r-" + "".join(secrets.choice(alphabet) for _ in range(8))


def default_hostname(name: str, instance_uuid: str) -> str:
    """The hostname a server gets when it asks for none, made from its name as Nova makes it:
    Latin-1 only, spaces, underscores and dots become hyphens, other characters that are not
    word characters go, lower case, no hyphen or dot at either end, at most 63 characters;
    ``Server-<uuid>`` when nothing is left."""
    latin = name.encode("latin-1", "ignore").decode("latin-1")[:HOSTNAME_LENGTH]
    hostname = re.sub(r"[^\w.-]+", "", re.sub(r"[ _.]", "-", latin)).lower().strip(".-")
    return hostname or f"Server-{instance_uuid}"[:HOSTNAME_LENGTH]


def cell_of(instance_uuid: str) -> CellMapping:
    """The cell the instance mapping names for ``instance_uuid``.

    Raises:
        InstanceNotFound: no mapping, or the mapping names no cell yet.
    """
    with api_session() as session:
        mapping = session.scalars(
            select(InstanceMapping).where(InstanceMapping.instance_uuid == instance_uuid)
        ).one_or_none()
        if mapping is None or mapping.cell is None:
            raise errors.InstanceNotFound(f"Instance {instance_uuid} could not be found.")
        return mapping.cell


def purge(session: Session, instance_uuid: str) -> bool:
    """Delete every row of the instance in this cell session: the instance, its actions and their
    events, faults, block device mappings, tags and migrations (idempotent). Whether there was
    an instance or an action to delete."""
    action_ids = list(session.scalars(select(InstanceAction.id).where(InstanceAction.instance_uuid == instance_uuid)))
    if action_ids:
        session.execute(delete(InstanceActionEvent).where(InstanceActionEvent.action_id.in_(action_ids)))
        session.execute(delete(InstanceAction).where(InstanceAction.id.in_(action_ids)))
    for model in (BlockDeviceMapping, Tag, InstanceFault, Migration):
        session.execute(delete(model).where(model.instance_uuid == instance_uuid))
    deleted = cast(CursorResult[Any], session.execute(delete(Instance).where(Instance.uuid == instance_uuid)))
    return deleted.rowcount > 0 or bool(action_ids)


def by_cell(instance_uuids: Iterable[str], *,
            queued_for_delete: bool | None = None) -> list[tuple[CellMapping, list[str]]]:
    """The cells ``instance_uuids`` are mapped to, each with its uuids (those mapped to no cell
    are left out; ``queued_for_delete`` keeps only the mappings with that flag). For reading
    many servers with one query per cell; call it outside any API database session."""
    wanted = set(instance_uuids)
    if not wanted:
        return []
    grouped: dict[int, list[str]] = {}
    with api_session() as session:
        query = select(InstanceMapping.instance_uuid, InstanceMapping.cell_id).where(
            InstanceMapping.instance_uuid.in_(wanted))
        if queued_for_delete is not None:
            query = query.where(InstanceMapping.queued_for_delete.is_(queued_for_delete))
        for uuid, cell_id in session.execute(query):
            if cell_id is not None:
                grouped.setdefault(cell_id, []).append(uuid)
        cells = {c.id: c for c in session.scalars(select(CellMapping).where(CellMapping.id.in_(grouped)))}
    return [(cells[cell_id], sorted(uuids)) for cell_id, uuids in sorted(grouped.items())]


def hosts_of(instance_uuids: Iterable[str]) -> dict[str, str | None]:
    """The host of each live server among ``instance_uuids``, read with one query per cell they
    are mapped to; a server with no host, still being scheduled, or gone is given None. Call it
    outside any API database session."""
    wanted = set(instance_uuids)
    found: dict[str, str | None] = dict.fromkeys(wanted)
    for cell, uuids in by_cell(wanted):
        with cell_session(cell) as session:
            rows = session.execute(select(Instance.uuid, Instance.host).where(
                Instance.uuid.in_(uuids), Instance.deleted.is_(False), Instance.hidden.is_(False)))
            for uuid, host in rows:
                found[uuid] = host
    return found


def get(session: Session, instance_uuid: str, *, include_hidden: bool = False) -> Instance:
    """The live instance ``instance_uuid`` in this cell session.

    Raises:
        InstanceNotFound: no such (visible, undeleted) instance.
    """
    query = select(Instance).where(Instance.uuid == instance_uuid, Instance.deleted.is_(False))
    if not include_hidden:
        query = query.where(Instance.hidden.is_(False))
    instance = session.scalars(query).one_or_none()
    if instance is None:
        raise errors.InstanceNotFound(f"Instance {instance_uuid} could not be found.")
    return instance


def update_cas(
    session: Session,
    instance_uuid: str,
    values: dict[str, Any],
    *,
    expected_task_state: Iterable[str | None] | None = None,
    expected_vm_state: Iterable[str] | None = None,
) -> None:
    """Update an instance only if its task_state (and vm_state) are among the expected ones.

    ``expected_task_state`` lists the allowed task states (``None`` in the list means "no task");
    leaving the argument out accepts any. The check and the write are one UPDATE statement, so
    two concurrent operations can never both pass it.

    Raises:
        UnexpectedTaskState: the instance is in another state (or gone).
    """
    stmt = update(Instance).where(Instance.uuid == instance_uuid, Instance.deleted.is_(False))
    if expected_task_state is not None:
        expected = list(expected_task_state)
        named = [s for s in expected if s is not None]
        allowed = [Instance.task_state.in_(named)] if named else []
        if None in expected:
            allowed.append(Instance.task_state.is_(None))
        stmt = stmt.where(or_(*allowed) if allowed else false())
    if expected_vm_state is not None:
        stmt = stmt.where(Instance.vm_state.in_(list(expected_vm_state)))
    stmt = stmt.values(**values).execution_options(synchronize_session=False)
    result = cast(CursorResult[Any], session.execute(stmt))
    if result.rowcount != 1:
        current = session.scalars(select(Instance).where(Instance.uuid == instance_uuid)).one_or_none()
        state = (current.vm_state, current.task_state) if current else ("missing", None)
        raise errors.UnexpectedTaskState(
            f"Cannot update instance {instance_uuid}: it is in vm_state {state[0]} task_state {state[1]}.",
        )
    session.expire_all()


def add_fault(session: Session, instance_uuid: str, error: BaseException | str, *, host: str | None = None,
              code: int = 500, details: str | None = None) -> InstanceFault:
    """Record an instance fault (what the API shows as ``fault`` on an ERROR server)."""
    message = error.message if isinstance(error, errors.FerryError) else str(error)
    fault = InstanceFault(instance_uuid=instance_uuid, code=code, message=message[:255],
                          details=details, host=host)
    session.add(fault)
    return fault


def is_bfv(session: Session, instance_uuid: str) -> bool:
    """Whether the instance boots from a volume (its boot device is one)."""
    return session.scalars(select(BlockDeviceMapping.id).where(
        BlockDeviceMapping.instance_uuid == instance_uuid, BlockDeviceMapping.deleted.is_(False),
        BlockDeviceMapping.boot_index == 0, BlockDeviceMapping.destination_type == "volume")).first() is not None


def volumes_deleted_with(session: Session, instance_uuid: str, *, launched: bool) -> set[str]:
    """The volumes that go when the server is deleted: those its owner asked for
    (``delete_on_termination``), and, of a server never ``launched``, those made from an image for
    it. No spawn of it finished writing one of these, so it holds nothing of the owner's (a
    failed spawn removes its file); left ``available`` it would boot a server as an empty disk."""
    goes: ColumnElement[bool] = BlockDeviceMapping.delete_on_termination.is_(True)
    if not launched:
        goes = or_(goes, BlockDeviceMapping.source_type == "image")
    return set(session.scalars(select(BlockDeviceMapping.volume_id).where(
        BlockDeviceMapping.instance_uuid == instance_uuid, BlockDeviceMapping.deleted.is_(False),
        BlockDeviceMapping.volume_id.is_not(None), goes)))
