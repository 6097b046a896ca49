"""Accepting moves: resize, cold migrate, confirm and revert.

Each ``begin_*`` function checks the request, writes the records the workflow starts from
(compare-and-swap on the instance's task_state or the migration's status, so a second
operation on a busy server gets 409 and never a corrupted record), records the instance
action and starts the workflow's execution. When the execution cannot be started, what was
written is undone and the error is raised: a refused or failed request leaves nothing behind.

Execution names are ``<kind>-<instance uuid>-<first 8 characters of the migration uuid>``,
so a retried start of the same move cannot run its workflow twice. Every execution gets
``instance_uuid``, ``migration_uuid``, ``cell`` and ``request_id`` (resize and migrate also
``requested_host``, ``user_id`` and ``project_id``).
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult, delete, select, update
from sqlalchemy.orm import Session

from ferry import config, errors, workflows
from ferry.compute import actions, instances, states
from ferry.observability import logger
from ferry.store.cell_models import Instance, InstanceAction, InstanceActionEvent, Migration
from ferry.store.db import cell_session

# Migration statuses (Nova's).
PRE_MIGRATING = "pre-migrating"
MIGRATING = "migrating"
POST_MIGRATING = "post-migrating"
FINISHED = "finished"
CONFIRMING = "confirming"
CONFIRMED = "confirmed"
REVERTING = "reverting"
REVERTED = "reverted"
ERROR = "error"

# Migration types.
RESIZE = "resize"
MIGRATION = "migration"

# Statuses of a migration whose confirm or revert is under way.
_SETTLING = (CONFIRMING, REVERTING)


def move_execution_name(kind: str, instance_uuid: str, migration_uuid: str) -> str:
    """``<kind>-<instance uuid>-<first 8 of the migration uuid>`` (within Step Functions' 80 characters)."""
    return f"{kind}-{instance_uuid}-{migration_uuid[:8]}"


def _invalid_state(action: str, instance_uuid: str, attr: str, state: Any) -> errors.InstanceInvalidState:
    return errors.InstanceInvalidState(f"Cannot '{action}' instance {instance_uuid} while it is in {attr} {state}")


def _latest_migration(session: Session, instance_uuid: str) -> Migration | None:
    """The instance's newest resize or cold-migration record in this cell."""
    return session.scalars(
        select(Migration)
        .where(Migration.instance_uuid == instance_uuid, Migration.deleted.is_(False),
               Migration.migration_type.in_((RESIZE, MIGRATION)))
        .order_by(Migration.created_at.desc(), Migration.id.desc())
        .limit(1)
    ).first()


def _swap_migration_status(session: Session, migration_uuid: str, expected: str, status: str) -> bool:
    """Set a migration's status only if it still is ``expected`` (one UPDATE statement)."""
    result = cast(CursorResult[Any], session.execute(
        update(Migration).where(Migration.uuid == migration_uuid, Migration.status == expected)
        .values(status=status).execution_options(synchronize_session=False)))
    session.expire_all()
    return result.rowcount == 1


def _forget_action(session: Session, instance_uuid: str, request_id: str) -> None:
    action = session.scalars(select(InstanceAction).where(
        InstanceAction.instance_uuid == instance_uuid, InstanceAction.request_id == request_id)).one_or_none()
    if action is not None:
        session.execute(delete(InstanceActionEvent).where(InstanceActionEvent.action_id == action.id))
        session.delete(action)


def _check_settle_state(session: Session, action: str, instance_uuid: str) -> tuple[Instance, Migration]:
    """The instance and its finished migration, for a confirm or a revert.

    Raises:
        InstanceNotFound: no such (visible) instance in this cell.
        InstanceInvalidState: vm_state is not ``resized`` or a task is in progress.
        MigrationInProgress: a confirm or revert of the migration is already under way.
        InstanceNotResized: the instance has no finished migration.
    """
    instance = instances.get(session, instance_uuid)
    if instance.vm_state != states.RESIZED:
        raise _invalid_state(action, instance_uuid, "vm_state", instance.vm_state)
    if instance.task_state is not None:
        raise _invalid_state(action, instance_uuid, "task_state", instance.task_state)
    migration = _latest_migration(session, instance_uuid)
    if migration is not None and migration.status in _SETTLING:
        raise errors.MigrationInProgress(
            f"Cannot '{action}' instance {instance_uuid}: its migration {migration.uuid} is {migration.status}.")
    if migration is None or migration.status != FINISHED:
        raise errors.InstanceNotResized()
    return instance, migration


def _settle_payload(cell: str, instance_uuid: str, migration_uuid: str, request_id: str) -> dict[str, Any]:
    return {"instance_uuid": instance_uuid, "migration_uuid": migration_uuid, "cell": cell, "request_id": request_id}


def begin_confirm(cell: str, instance_uuid: str, *, request_id: str, user_id: str | None,
                  project_id: str | None) -> str:
    """Accept a confirm of a resized server and start the confirm workflow.

    The server must be in vm_state ``resized`` with no task; its newest migration goes from
    ``finished`` to ``confirming`` (compare-and-swap: of two concurrent confirms or a confirm
    and a revert, one loses with 409). The ``confirmResize`` action is recorded under
    ``request_id``. The instance's task_state is not changed (as in Nova).

    Params:
        cell: the name of the cell the instance lives in.
        request_id: the request id the action and its events are recorded under.
        user_id, project_id: who asked (None for the automatic confirm).

    Returns:
        The migration's uuid.

    Raises:
        InstanceNotFound: no such instance in the cell.
        InstanceInvalidState: vm_state is not ``resized`` or a task is in progress (409).
        MigrationInProgress: a confirm or revert is already under way (409).
        InstanceNotResized: there is no finished migration (400).
        Anything starting the execution raises, after the migration is put back to ``finished``.
    """
    with cell_session(cell) as session:
        _instance, migration = _check_settle_state(session, actions.CONFIRM_RESIZE, instance_uuid)
        migration_uuid = migration.uuid
        if not _swap_migration_status(session, migration_uuid, FINISHED, CONFIRMING):
            raise errors.MigrationInProgress(
                f"Cannot 'confirmResize' instance {instance_uuid}: another operation took migration "
                f"{migration_uuid} first.")
        actions.start_action(session, instance_uuid=instance_uuid, action=actions.CONFIRM_RESIZE,
                             request_id=request_id, user_id=user_id, project_id=project_id)
    name = move_execution_name("confirm", instance_uuid, migration_uuid)
    try:
        workflows.start_execution(config.get().confirm_resize_state_machine_arn, name,
                                  _settle_payload(cell, instance_uuid, migration_uuid, request_id))
    except Exception:
        logger.exception("confirm workflow did not start; undoing", extra={"instance_uuid": instance_uuid})
        with cell_session(cell) as session:
            _swap_migration_status(session, migration_uuid, CONFIRMING, FINISHED)
            _forget_action(session, instance_uuid, request_id)
        raise
    logger.info("confirm accepted", extra={"instance_uuid": instance_uuid, "migration_uuid": migration_uuid})
    return migration_uuid


def begin_revert(cell: str, instance_uuid: str, *, request_id: str, user_id: str | None,
                 project_id: str | None) -> str:
    """Accept a revert of a resized server and start the revert workflow.

    As :func:`begin_confirm`, with the migration going ``finished`` → ``reverting`` and the
    instance's task_state None → ``resize_reverting`` (both compare-and-swap, in one
    transaction), the ``revertResize`` action, and the revert workflow. The old flavor is
    the instance's own copy (``old_flavor``), so a revert works after that flavor was deleted.

    Returns:
        The migration's uuid.

    Raises:
        InstanceNotFound, InstanceInvalidState, MigrationInProgress, InstanceNotResized: as
            :func:`begin_confirm`.
        InstanceNotResized: also when the instance has no record of its old flavor (400).
        Anything starting the execution raises, after the instance and migration are put back.
    """
    with cell_session(cell) as session:
        instance, migration = _check_settle_state(session, actions.REVERT_RESIZE, instance_uuid)
        if not instance.old_flavor:
            raise errors.InstanceNotResized(
                f"Cannot revert instance {instance_uuid}: the flavor it had before the resize is not known.")
        migration_uuid = migration.uuid
        if not _swap_migration_status(session, migration_uuid, FINISHED, REVERTING):
            raise errors.MigrationInProgress(
                f"Cannot 'revertResize' instance {instance_uuid}: another operation took migration "
                f"{migration_uuid} first.")
        try:
            instances.update_cas(session, instance_uuid, {"task_state": states.RESIZE_REVERTING},
                                 expected_task_state=(None,), expected_vm_state=(states.RESIZED,))
        except errors.UnexpectedTaskState as exc:
            # The session's transaction rolls back, so the migration keeps "finished".
            raise errors.InstanceInvalidState(str(exc)) from exc
        actions.start_action(session, instance_uuid=instance_uuid, action=actions.REVERT_RESIZE,
                             request_id=request_id, user_id=user_id, project_id=project_id)
    name = move_execution_name("revert", instance_uuid, migration_uuid)
    try:
        workflows.start_execution(config.get().revert_resize_state_machine_arn, name,
                                  _settle_payload(cell, instance_uuid, migration_uuid, request_id))
    except Exception:
        logger.exception("revert workflow did not start; undoing", extra={"instance_uuid": instance_uuid})
        with cell_session(cell) as session:
            _swap_migration_status(session, migration_uuid, REVERTING, FINISHED)
            try:
                instances.update_cas(session, instance_uuid, {"task_state": None},
                                     expected_task_state=(states.RESIZE_REVERTING,))
            except errors.UnexpectedTaskState:
                logger.warning("state changed meanwhile; left as is", extra={"instance_uuid": instance_uuid})
            _forget_action(session, instance_uuid, request_id)
        raise
    logger.info("revert accepted", extra={"instance_uuid": instance_uuid, "migration_uuid": migration_uuid})
    return migration_uuid
