"""Automatic confirmation of resizes left unconfirmed (Nova's ``resize_confirm_window``).

A scheduled function runs :func:`run` every minute. With ``resize_confirm_window`` (seconds,
``FERRY_RESIZE_CONFIRM_WINDOW``) above zero it looks in every cell for migrations that have
been ``finished`` for longer than the window and confirms each through the compute API's own
path (:func:`ferry.compute.moves.begin_confirm`, request id
``req-auto-confirm-<migration uuid>-<8 random hex digits>``, new for every attempt),
with Nova's rules:

* the instance is gone (deleted, or not in this cell) → skipped, logged;
* the instance has a task in progress → skipped, logged (the next run looks again);
* the instance is not in vm_state ``resized`` → the migration is set to ``error``, as Nova does;
  so is a migration that is no longer the server's newest (it was reset and moved again since);
* the migration's source host is down → skipped, logged (the confirm would fail there and
  record a failed action and a fault every minute; the next run looks again);
* otherwise the confirm of that migration is started.

A failure with one migration is logged and counted and never stops the others. A cross-cell
move's migration is recorded in both cells; only the record in the cell the instance mapping
names is confirmed, once.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from sqlalchemy import func, select

from ferry import config, errors
from ferry.compute import instances, migration_states, moves, states
from ferry.observability import logger, metrics
from ferry.store.api_models import utcnow
from ferry.store.cell_models import Instance, Migration
from ferry.store.db import all_cells, cell_session

CONFIRMED = "confirmed"
SKIPPED = "skipped"
ERRORED = "errored"
FAILED = "failed"
OUTCOMES = (CONFIRMED, SKIPPED, ERRORED, FAILED)


@dataclass(frozen=True)
class Unconfirmed:
    """A migration waiting for confirmation longer than the window."""

    cell: str
    migration_uuid: str
    instance_uuid: str


def request_id_for(migration_uuid: str) -> str:
    """The request id of one automatic confirm of the migration: a new one for every attempt.

    A confirm whose workflow failed early puts the migration back to ``finished``; the next
    attempt is another request, with an execution of its own (the name of a closed execution
    cannot be started again).
    """
    return f"req-auto-confirm-{migration_uuid}-{uuid.uuid4().hex[:8]}"


def unconfirmed(cell: str, older_than: dt.datetime) -> list[Unconfirmed]:
    """The visible migrations of ``cell`` that are ``finished`` and unchanged since ``older_than``."""
    changed = func.coalesce(Migration.updated_at, Migration.created_at)
    with cell_session(cell) as session:
        rows = session.execute(select(Migration.uuid, Migration.instance_uuid).where(
            Migration.status == migration_states.FINISHED, Migration.deleted.is_(False), Migration.hidden.is_(False),
            changed < older_than).order_by(changed, Migration.id)).all()
    return [Unconfirmed(cell, str(row.uuid), str(row.instance_uuid)) for row in rows]


def confirm_one(found: Unconfirmed) -> str:
    """Apply Nova's rules to one unconfirmed migration; returns its outcome (see :data:`OUTCOMES`)."""
    context = {"cell": found.cell, "migration_uuid": found.migration_uuid, "instance_uuid": found.instance_uuid}
    with cell_session(found.cell) as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == found.instance_uuid,
                                                          Instance.hidden.is_(False))).one_or_none()
        if instance is None or instance.deleted:
            logger.info("auto-confirm skipped: the instance is gone", extra=context)
            return SKIPPED
        if instance.task_state is not None:
            logger.info("auto-confirm skipped: the instance is busy",
                        extra={**context, "task_state": instance.task_state})
            return SKIPPED
        migration = session.scalars(select(Migration).where(Migration.uuid == found.migration_uuid)).one()
        if instance.vm_state != states.RESIZED:
            _set_error(migration)
            logger.warning("auto-confirm: instance not in resized; migration set to error",
                           extra={**context, "vm_state": instance.vm_state})
            return ERRORED
    try:
        moves.begin_confirm(found.cell, found.instance_uuid, request_id=request_id_for(found.migration_uuid),
                            user_id=None, project_id=None, migration_uuid=found.migration_uuid)
    except errors.UnexpectedMigrationState:
        with cell_session(found.cell) as session:
            _set_error(session.scalars(select(Migration).where(Migration.uuid == found.migration_uuid)).one())
        logger.warning("auto-confirm: the migration is not the server's newest; migration set to error", extra=context)
        return ERRORED
    except errors.ComputeServiceUnavailable:
        logger.info("auto-confirm skipped: the migration's source host is down", extra=context)
        return SKIPPED
    except (errors.InstanceInvalidState, errors.MigrationInProgress) as exc:
        # The owner (or an admin) confirmed, reverted or changed the server since it was read: the
        # next run reads it again.
        logger.info("auto-confirm skipped: the server changed meanwhile", extra={**context, "reason": exc.message})
        return SKIPPED
    logger.info("resize confirmed automatically", extra=context)
    return CONFIRMED


def _set_error(migration: Migration) -> None:
    """A migration no confirm can settle any more goes to ``error`` (still ``finished`` only)."""
    if migration.status == migration_states.FINISHED:
        migration.status = migration_states.ERROR


def _is_the_servers_copy(found: Unconfirmed, seen: set[str]) -> bool:
    """Whether this record of a migration is the one to confirm: a cross-cell move has one in each
    cell, and only the copy in the cell the instance mapping names is taken (once per run)."""
    if found.migration_uuid in seen:
        return False
    try:
        mapped = instances.cell_of(found.instance_uuid).name
    except errors.InstanceNotFound:
        mapped = found.cell  # its rules say what to do with a server that is gone
    if mapped != found.cell:
        return False
    seen.add(found.migration_uuid)
    return True


def run(now: dt.datetime | None = None) -> dict[str, Any]:
    """Confirm every resize unconfirmed for longer than ``resize_confirm_window`` (0: do nothing).

    Returns:
        ``{"window": seconds, "confirmed": n, "skipped": n, "errored": n, "failed": n}``.
    """
    window = config.get().resize_confirm_window
    counts: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})
    if window <= 0:
        return {"window": window, **counts}
    older_than = (now or utcnow()) - dt.timedelta(seconds=window)
    seen: set[str] = set()
    for cell in all_cells(include_cell0=False):
        try:
            found = [m for m in unconfirmed(cell.name, older_than) if _is_the_servers_copy(m, seen)]
        except Exception:  # noqa: BLE001 - one unreachable cell must not stop the others
            logger.exception("auto-confirm could not read a cell", extra={"cell": cell.name})
            counts[FAILED] += 1
            continue
        for migration in found:
            try:
                counts[confirm_one(migration)] += 1
            except Exception:  # noqa: BLE001 - each migration on its own; the next run tries again
                logger.exception("auto-confirm failed", extra={"cell": migration.cell,
                                                               "migration_uuid": migration.migration_uuid})
                counts[FAILED] += 1
    for outcome in OUTCOMES:
        metrics.add_metric(name=f"AutoConfirm{outcome.capitalize()}", unit=MetricUnit.Count, value=counts[outcome])
    logger.info("auto-confirm run", extra={"window": window, **counts})
    return {"window": window, **counts}
