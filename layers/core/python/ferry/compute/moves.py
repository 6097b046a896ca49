"""Accepting moves: resize, cold migrate, confirm and revert.

Each ``begin_*`` function checks the request, writes the records the workflow starts from
(compare-and-swap on the instance's task_state or the migration's status, so a second
operation on a busy server gets 409 and never a corrupted record), records the instance
action and starts the workflow's execution. When the execution cannot be started, what was
written is undone and the error is raised: a refused or failed request leaves nothing behind.

Execution names are ``<kind>-<instance uuid>-<first 8 characters of the migration uuid>``,
so a retried start of the same request cannot run its workflow twice (a confirm or revert
asked again by a new request, after an earlier attempt's workflow gave the migration back,
gets ``-`` and 8 hex digits of its request id's SHA-256 appended). Every execution gets
``instance_uuid``, ``migration_uuid``, ``cell`` and ``request_id`` (resize and migrate also
``requested_host``, ``user_id`` and ``project_id``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from botocore.exceptions import BotoCoreError, ClientError
from sqlalchemy import CursorResult, Select, delete, func, or_, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ferry import config, errors, hosts, images, policy, quotas, workflows
from ferry.auth import RequestContext
from ferry.compute import actions, flavor_access, instances, states
from ferry.compute import api as compute_api
from ferry.compute.migration_states import (
    CONFIRMED,
    CONFIRMING,
    ERROR,
    FINISHED,
    MIGRATION,
    MOVING,
    PRE_MIGRATING,
    RESIZE,
    REVERTING,
    SETTLING,
)
from ferry.observability import logger
from ferry.store import db
from ferry.store.api_models import CellMapping, Flavor, InstanceMapping, new_uuid, utcnow
from ferry.store.cell_models import (
    BlockDeviceMapping,
    Instance,
    Migration,
    Service,
)
from ferry.store.db import all_cells, api_session, cell_session


def move_execution_name(kind: str, instance_uuid: str, migration_uuid: str) -> str:
    """``<kind>-<instance uuid>-<first 8 of the migration uuid>`` (within Step Functions' 80 characters)."""
    return f"{kind}-{instance_uuid}-{migration_uuid[:8]}"


def _fresh_execution_name(state_machine_arn: str, name: str, request_id: str) -> str:
    """``name``, or ``name-<8 hex digits of the request id's SHA-256>`` when an execution of that
    name exists for another request.

    A confirm or revert whose workflow failed early puts the migration back to ``finished`` so
    it can be asked again; Step Functions keeps an execution's name for 90 days, so the next
    request needs a name of its own. The same request started again keeps its name (starting
    it twice is then a no-op). The name is found with at most one look-up, however often the
    migration was asked before (the automatic confirm asks every minute while a host is down).
    """
    if not state_machine_arn:
        return name
    existing = workflows.describe_execution(state_machine_arn, name)
    if existing is None or _request_of(existing) == request_id:
        return name
    return _suffixed(name, request_id)


def _settle_execution(state_machine_arn: str, kind: str, instance_uuid: str, migration_uuid: str,
                      request_id: str) -> dict[str, Any] | None:
    """The execution of the ``kind`` (confirm/revert) workflow started for ``request_id``, under
    the name :func:`_fresh_execution_name` gave it; None when none was started."""
    name = move_execution_name(kind, instance_uuid, migration_uuid)
    existing = workflows.describe_execution(state_machine_arn, name)
    if existing is None or _request_of(existing) == request_id:
        return existing
    return workflows.describe_execution(state_machine_arn, _suffixed(name, request_id))


def _request_of(execution: dict[str, Any]) -> str | None:
    return cast(str | None, json.loads(execution.get("input") or "{}").get("request_id"))


def _suffixed(name: str, request_id: str) -> str:
    return f"{name}-{hashlib.sha256(request_id.encode()).hexdigest()[:8]}"


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


def _check_settle_state(session: Session, action: str, instance_uuid: str) -> tuple[Instance, Migration]:
    """The instance and its finished migration, for a confirm or a revert.

    A server busy with a task, or whose confirm or revert is already under way, is a conflict
    (409). A revert checks vm_state ``resized`` first, as Nova does (409 otherwise, so also for
    a server that was never resized). A confirm of a server with no task and no finished
    migration (one that was never resized, say) is 400, "has not been resized": the contract's
    answer where Nova says 409 for a server that is not in vm_state ``resized``.

    Raises:
        InstanceNotFound: no such (visible) instance in this cell.
        InstanceInvalidState: a task is in progress, or vm_state is not ``resized``.
        MigrationInProgress: a confirm or revert of the migration is already under way.
        InstanceNotResized: the instance has no finished migration.
    """
    instance = instances.get(session, instance_uuid)
    if action == actions.REVERT_RESIZE and instance.vm_state != states.RESIZED:
        raise _invalid_state(action, instance_uuid, "vm_state", instance.vm_state)
    if instance.task_state is not None:
        raise _invalid_state(action, instance_uuid, "task_state", instance.task_state)
    migration = _latest_migration(session, instance_uuid)
    if migration is not None and migration.status in SETTLING:
        raise errors.MigrationInProgress(
            f"Cannot '{action}' instance {instance_uuid}: its migration {migration.uuid} is {migration.status}.")
    if migration is None or migration.status != FINISHED:
        raise errors.InstanceNotResized()
    if instance.vm_state != states.RESIZED:
        raise _invalid_state(action, instance_uuid, "vm_state", instance.vm_state)
    return instance, migration


def _check_source_up(session: Session, cell: str, migration: Migration) -> None:
    """Refuse a confirm (409, Nova's words) while the migration's source host is down, before the
    migration is touched, as Nova does: the confirm's work is on that host. Within a cell the
    service is read in ``session`` (no API session is opened inside it); the source of a move
    between cells in the cell the host is mapped to.

    Raises:
        ComputeServiceUnavailable: the source host's compute service sends no heartbeats.
    """
    source = str(migration.source_compute)
    if not hosts.host_is_up_from(session, cell, source, here=not migration.cross_cell_move):
        logger.info("confirm refused: the source host is down", extra={
            "instance_uuid": migration.instance_uuid, "migration_uuid": migration.uuid, "host": source})
        raise errors.ComputeServiceUnavailable("Service is unavailable at this time.")


def _settle_payload(cell: str, instance_uuid: str, migration_uuid: str, request_id: str) -> dict[str, Any]:
    return {"instance_uuid": instance_uuid, "migration_uuid": migration_uuid, "cell": cell, "request_id": request_id}


def _accept_confirm(cell: str, instance_uuid: str, *, request_id: str, user_id: str | None,
                    project_id: str | None, expected: str | None = None) -> str:
    with cell_session(cell) as session:
        _instance, migration = _check_settle_state(session, actions.CONFIRM_RESIZE, instance_uuid)
        migration_uuid = migration.uuid
        if expected is not None and migration_uuid != expected:
            raise errors.UnexpectedMigrationState(
                f"Instance {instance_uuid}'s newest migration is {migration_uuid}, not {expected}.")
        _check_source_up(session, cell, migration)
        if not _swap_migration_status(session, migration_uuid, FINISHED, CONFIRMING):
            raise errors.MigrationInProgress(
                f"Cannot 'confirmResize' instance {instance_uuid}: another operation took migration "
                f"{migration_uuid} first.")
        actions.start_action(session, instance_uuid=instance_uuid, action=actions.CONFIRM_RESIZE,
                             request_id=request_id, user_id=user_id, project_id=project_id)
    return migration_uuid


def begin_confirm(cell: str, instance_uuid: str, *, request_id: str, user_id: str | None,
                  project_id: str | None, migration_uuid: str | None = None) -> str:
    """Accept a confirm of a resized server and start the confirm workflow.

    The server must be in vm_state ``resized`` with no task; its newest migration goes from
    ``finished`` to ``confirming`` (compare-and-swap: of two concurrent confirms or a confirm
    and a revert, one loses with 409). The ``confirmResize`` action is recorded under
    ``request_id``. The instance's task_state is not changed (as in Nova).

    Params:
        cell: the name of the cell the instance lives in.
        request_id: the request id the action and its events are recorded under.
        user_id, project_id: who asked (None for the automatic confirm).
        migration_uuid: the migration to confirm, which must be the server's newest (the
            automatic confirm names the one whose window ran out); None takes the newest.

    Returns:
        The migration's uuid.

    Raises:
        InstanceNotFound: no such instance in the cell.
        InstanceInvalidState: vm_state is not ``resized`` or a task is in progress (409).
        MigrationInProgress: a confirm or revert is already under way (409).
        InstanceNotResized: there is no finished migration (400).
        UnexpectedMigrationState: ``migration_uuid`` is not the server's newest migration.
        ComputeServiceUnavailable: the migration's source host is down (409).
        Anything starting the execution raises, after the migration is put back to ``finished``.
    """
    migration_uuid = _accept_confirm(cell, instance_uuid, request_id=request_id, user_id=user_id,
                                     project_id=project_id, expected=migration_uuid)

    def undo(session: Session) -> None:
        _swap_migration_status(session, migration_uuid, CONFIRMING, FINISHED)

    _start_settle("confirm", config.get().confirm_resize_state_machine_arn, cell, instance_uuid,
                  migration_uuid, request_id, undo)
    return migration_uuid


def prepare_confirm(cell: str, instance_uuid: str, migration_uuid: str, *, request_id: str,
                    user_id: str | None, project_id: str | None) -> PreparedExecution:
    """Accept a confirm as :func:`begin_confirm` does, but leave starting the workflow to the caller.

    Idempotent: when this request already took ``migration_uuid`` (its action is recorded and
    the migration is ``confirming`` or ``confirmed``), the same execution is returned and
    nothing is written. The execution is named as :func:`begin_confirm` names it, so a name an
    earlier confirm's execution holds is not asked for again.

    Raises:
        What :func:`begin_confirm` raises; UnexpectedMigrationState when the server's newest
        migration is not ``migration_uuid``; MigrationInProgress also when another request
        confirmed it or is confirming it.
    """
    payload = _settle_payload(cell, instance_uuid, migration_uuid, request_id)
    with cell_session(cell) as session:
        migration = session.scalars(select(Migration).where(Migration.uuid == migration_uuid)).one_or_none()
        taken = migration is not None and migration.status in (CONFIRMING, CONFIRMED)
        if taken and actions.find(session, instance_uuid, request_id) is None:
            raise errors.MigrationInProgress(
                f"Cannot 'confirmResize' instance {instance_uuid}: another request took migration "
                f"{migration_uuid} ({migration.status if migration else None}).")
    if not taken:
        _accept_confirm(cell, instance_uuid, request_id=request_id, user_id=user_id, project_id=project_id,
                        expected=migration_uuid)
    name = _fresh_execution_name(config.get().confirm_resize_state_machine_arn,
                                 move_execution_name("confirm", instance_uuid, migration_uuid), request_id)
    return PreparedExecution(name, {**payload, "execution_name": name})


# How long a confirm accepted moments ago may stay out of Step Functions' answers (DescribeExecution
# is eventually consistent) before its workflow is taken for one that never started.
SETTLE_START_GRACE = dt.timedelta(seconds=60)


def abandon_prepared_confirm(cell: str, instance_uuid: str, migration_uuid: str, request_id: str) -> bool:
    """Wait for the migration's confirm or revert, and undo a confirm :func:`prepare_confirm`
    accepted under ``request_id`` whose workflow never started.

    The confirm or revert under way is the one its newest ``confirmResize``/``revertResize``
    action recorded. While that workflow runs, nothing is done. A confirm of ``request_id``
    whose workflow never started (at least :data:`SETTLE_START_GRACE` after it was accepted)
    gives the migration back, ``confirming`` to ``finished``, and its action is forgotten, so the
    server waits in VERIFY_RESIZE for a confirm or revert as before. Whatever ran is left as it
    left things, and another request's confirm or revert is never undone here. Without the
    state machine configured (steps run in-process) there is no execution to ask about.

    Returns:
        Whether anything was undone.

    Raises:
        MoveStillRunning: the confirm or revert workflow runs, or the confirm was accepted too
            recently to tell.
    """
    settings = config.get()
    with cell_session(cell) as session:
        status = session.scalars(select(Migration.status).where(Migration.uuid == migration_uuid)).first()
        if status not in SETTLING:
            return False
        kind, action, state_machine_arn = (
            ("confirm", actions.CONFIRM_RESIZE, settings.confirm_resize_state_machine_arn) if status == CONFIRMING
            else ("revert", actions.REVERT_RESIZE, settings.revert_resize_state_machine_arn))
        owner = actions.newest_request_id(session, instance_uuid, action)
        recorded = actions.find(session, instance_uuid, owner) if owner else None
        if not state_machine_arn or recorded is None:
            return False
        accepted_at = recorded.start_time
    execution = _settle_execution(state_machine_arn, kind, instance_uuid, migration_uuid, owner or "")
    if execution is not None:
        if workflows.is_running(execution):
            raise errors.MoveStillRunning(
                f"The {kind} workflow of move {migration_uuid} of server {instance_uuid} still runs.")
        return False
    if kind != "confirm" or owner != request_id:
        return False
    if utcnow() - accepted_at < SETTLE_START_GRACE:
        raise errors.MoveStillRunning(
            f"The confirm of move {migration_uuid} of server {instance_uuid} was accepted moments ago; "
            f"whether its workflow started is not known yet.")
    with cell_session(cell) as session:
        if not _swap_migration_status(session, migration_uuid, CONFIRMING, FINISHED):
            return False
        actions.forget_action(session, instance_uuid, request_id)
    logger.warning("confirm workflow never started; confirm undone",
                   extra={"instance_uuid": instance_uuid, "migration_uuid": migration_uuid})
    return True


def _start_settle(kind: str, arn: str, cell: str, instance_uuid: str, migration_uuid: str, request_id: str,
                  undo: Callable[[Session], None]) -> None:
    """Start the ``kind`` (confirm/revert) workflow; if it does not start, ``undo`` the acceptance and re-raise.

    Undone under the server's row lock, and only when the workflow's first step did not take the
    request (its event recorded under the same lock): a workflow that began though its start
    answered an error goes on, and the request stands as accepted. Otherwise its first step,
    run late, finds the migration given back and changes nothing."""
    try:
        name = _fresh_execution_name(arn, move_execution_name(kind, instance_uuid, migration_uuid), request_id)
        workflows.start_execution(arn, name, _settle_payload(cell, instance_uuid, migration_uuid, request_id))
    except Exception:
        with cell_session(cell) as session:
            taken = actions.request_taken(session, instance_uuid, request_id)
            if not taken:
                undo(session)
                actions.forget_action(session, instance_uuid, request_id)
        if taken:
            logger.warning(f"starting the {kind} answered an error, but it began; the request stands",
                           extra={"instance_uuid": instance_uuid, "migration_uuid": migration_uuid})
            return
        logger.exception(f"{kind} workflow did not start; undone", extra={"instance_uuid": instance_uuid})
        raise
    logger.info(f"{kind} accepted", extra={"instance_uuid": instance_uuid, "migration_uuid": migration_uuid})


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
            :func:`begin_confirm`, except that vm_state not ``resized`` is checked first (409).
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
    def undo(session: Session) -> None:
        _swap_migration_status(session, migration_uuid, REVERTING, FINISHED)
        try:
            instances.update_cas(session, instance_uuid, {"task_state": None},
                                 expected_task_state=(states.RESIZE_REVERTING,))
        except errors.UnexpectedTaskState:
            logger.warning("state changed meanwhile; left as is", extra={"instance_uuid": instance_uuid})

    _start_settle("revert", config.get().revert_resize_state_machine_arn, cell, instance_uuid,
                  migration_uuid, request_id, undo)
    return migration_uuid


# --- resize and cold migrate ----------------------------------------------------------------------


_MOVABLE_VM_STATES = (states.ACTIVE, states.STOPPED)


@dataclass(frozen=True)
class _Move:
    """What a resize or migrate request asks for (its flavor is looked up once the server may move)."""

    action: str
    flavor_ref: str | None  # None: keep the current flavor (cold migrate)
    requested_host: str | None = None


def _resizable_flavor(ctx: RequestContext, flavor_ref: str) -> dict[str, Any]:
    """The snapshot of the flavor a resize asks for.

    Raises:
        BadRequest: no such flavor, a disabled one, or a private one the caller cannot use
            (Nova's "Unable to locate requested flavor.").
    """
    with api_session() as session:
        flavor = session.scalars(select(Flavor).where(Flavor.flavorid == compute_api.ref_id(str(flavor_ref)))
                                 ).one_or_none()
        if flavor is None or flavor.disabled or not flavor_access.usable(ctx, flavor):
            raise errors.BadRequest("Unable to locate requested flavor.")
        return compute_api.flavor_snapshot(flavor)


def _check_requested_host(host: str, cell: str | None) -> None:
    """A migrate's named host must be a compute host mapped to a cell with a service record there.

    Args:
        host: the host named.
        cell: the only cell the host may be in (the server's, when the caller may not move it
            to another cell), or None for any cell.

    Raises:
        ComputeHostNotFound: it is not, or it is in another cell than ``cell`` (as Nova looks
            the host up only in the server's cell then).
    """
    if not hosts.is_compute_host(host) or (cell is not None and hosts.cell_of_host(host) != cell):
        raise errors.ComputeHostNotFound(f"Compute host {host} could not be found.")


def _is_volume_backed(session: Session, instance: Instance) -> bool:
    root = session.scalars(select(BlockDeviceMapping).where(
        BlockDeviceMapping.instance_uuid == instance.uuid, BlockDeviceMapping.deleted.is_(False),
        BlockDeviceMapping.boot_index == 0)).first()
    if root is not None:
        return root.destination_type == "volume"
    return not instance.image_ref


def _check_disks_fit(current: dict[str, Any], new_flavor: dict[str, Any], *, volume_backed: bool) -> None:
    """Refuse flavors that cannot hold the server's disks, before anything moves.

    Args:
        current: the server's flavor snapshot.
        new_flavor: the snapshot of the flavor asked for.
        volume_backed: whether the server boots from a volume (its root disk is not the flavor's).

    Raises:
        CannotResizeDisk: a zero root disk for an image-backed server that has one (Nova's
            rule), or a smaller root (image-backed) or ephemeral disk: disks never shrink.
    """
    old_root, new_root = int(current.get("root_gb") or 0), int(new_flavor.get("root_gb") or 0)
    if not volume_backed and new_root == 0 and old_root != 0:
        raise errors.CannotResizeDisk(
            "Server disk was unable to be resized because: Resize to zero disk flavor is not allowed.")
    if not volume_backed and 0 < new_root < old_root:
        raise errors.CannotResizeDisk(
            f"Server disk was unable to be resized because: the root disk cannot shrink "
            f"(flavor {current.get('name')} has {old_root} GB, {new_flavor.get('name')} {new_root} GB).")
    old_ephemeral, new_ephemeral = int(current.get("ephemeral_gb") or 0), int(new_flavor.get("ephemeral_gb") or 0)
    if new_ephemeral < old_ephemeral:
        raise errors.CannotResizeDisk(
            f"Server disk was unable to be resized because: the ephemeral disk cannot shrink "
            f"(flavor {current.get('name')} has {old_ephemeral} GB, {new_flavor.get('name')} {new_ephemeral} GB).")


def upsize_deltas(old_flavor: dict[str, Any], new_flavor: dict[str, Any]) -> dict[str, int]:
    """The cores and RAM a resize adds (only growth counts against quota, as in Nova)."""
    deltas = {quotas.CORES: int(new_flavor.get("vcpus") or 0) - int(old_flavor.get("vcpus") or 0),
              quotas.RAM: int(new_flavor.get("memory_mb") or 0) - int(old_flavor.get("memory_mb") or 0)}
    return {resource: delta for resource, delta in deltas.items() if delta > 0}


def _check_movable(ctx: RequestContext, session: Session, instance: Instance, action: str) -> None:
    """Nova's order: lock, state, then the source host must be up (all 409).

    Raises:
        InstanceIsLocked, InstanceInvalidState, ComputeServiceUnavailable.
    """
    if instance.locked and not ctx.is_admin:
        raise errors.InstanceIsLocked(f"Instance {instance.uuid} is locked")
    if instance.vm_state not in _MOVABLE_VM_STATES:
        raise _invalid_state(action, instance.uuid, "vm_state", instance.vm_state)
    if instance.task_state is not None:
        raise _invalid_state(action, instance.uuid, "task_state", instance.task_state)
    if not instance.host:
        raise _invalid_state(action, instance.uuid, "host", None)
    service = session.scalars(select(Service).where(Service.host == instance.host)).one_or_none()
    if service is None or not hosts.is_up(service):
        # Nova's words: the owner is not told the host's name (the log is).
        logger.info("move refused: the server's host is down", extra={"instance_uuid": instance.uuid,
                                                                       "host": instance.host})
        raise errors.ComputeServiceUnavailable("Service is unavailable at this time.")


def _remember_cross_cell_choice(ctx: RequestContext, location: compute_api.Location) -> None:
    """Record in the request spec whether this caller may move the server to another cell.

    The policy (``compute:servers:resize:cross_cell``) is the caller's, so it is decided here
    and read by the scheduling step (``allow_cross_cell_move``), as Nova's API decides it.
    """
    allowed = policy.check(ctx, CROSS_CELL_RULE, location.target)
    with api_session() as session:
        try:
            spec = compute_api.load_request_spec(session, location.instance_uuid)
        except errors.NotFound:
            spec = {"instance_uuid": location.instance_uuid, "project_id": location.project_id,
                    "user_id": location.user_id}
        spec["allow_cross_cell_move"] = allowed
        compute_api.save_request_spec(session, location.instance_uuid, spec)


CROSS_CELL_RULE = "compute:servers:resize:cross_cell"


@dataclass(frozen=True)
class PreparedExecution:
    """A workflow execution a caller starts itself (a drain, as a nested execution): its name and input."""

    name: str
    input: dict[str, Any]


def _accept_move(ctx: RequestContext, location: compute_api.Location, move: _Move,
                 migration_uuid: str) -> tuple[CellMapping, dict[str, Any], dict[str, Any]]:
    """Check and record a move (everything but starting its workflow).

    Returns:
        The cell, the resize workflow's input, and the instance's fields as they were (for undo).
    """
    uuid = location.instance_uuid
    if location.cell is None:
        raise _invalid_state(move.action, uuid, "vm_state", states.BUILDING)
    cell = location.cell
    # Checks read the cell, then the API database and other cells; the writes follow in a
    # transaction of their own (SQLite allows one writer per file: no nested sessions).
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        _check_movable(ctx, session, instance, move.action)
        current = dict(instance.flavor or {})
        volume_backed = _is_volume_backed(session, instance)
        source_host, project_id, image_ref = instance.host, instance.project_id, instance.image_ref
    new_flavor = current
    if move.flavor_ref is not None:
        # Only a server that may move has its flavor looked at (409 before 400, as Nova answers).
        new_flavor = _resizable_flavor(ctx, move.flavor_ref)
        # The internal id, as Nova compares; and the flavor id, since SQLite gives a deleted flavor's
        # internal id to the next flavor made (PostgreSQL never does).
        if (new_flavor.get("id"), new_flavor.get("flavorid")) == (current.get("id"), current.get("flavorid")):
            raise errors.CannotResizeToSameFlavor()
        _check_disks_fit(current, new_flavor, volume_backed=volume_backed)
    if move.requested_host is not None:
        cross_cell_allowed = policy.check(ctx, CROSS_CELL_RULE, location.target)
        _check_requested_host(move.requested_host, None if cross_cell_allowed else cell.name)
        if move.requested_host == source_host:
            raise errors.CannotMigrateToSameHost()
    deltas = upsize_deltas(current, new_flavor)
    quotas.check(project_id, deltas)
    if move.flavor_ref is not None and not volume_backed:  # after the quota, as Nova checks it
        _check_image_still_fits(image_ref, new_flavor)
    with cell_session(cell) as session:
        instance = instances.get(session, uuid)
        previous = {"old_flavor": instance.old_flavor, "new_flavor": instance.new_flavor,
                    "old_vm_state": instance.old_vm_state}
        try:
            instances.update_cas(session, uuid, {"task_state": states.RESIZE_PREP, "old_flavor": current,
                                                 "new_flavor": new_flavor, "old_vm_state": instance.vm_state},
                                 expected_task_state=(None,), expected_vm_state=_MOVABLE_VM_STATES)
        except errors.UnexpectedTaskState as exc:
            raise errors.InstanceInvalidState(
                f"Cannot '{move.action}' instance {uuid}: another operation changed it first.") from exc
        if instance.host != source_host or dict(instance.flavor or {}) != current:
            raise errors.InstanceInvalidState(f"Cannot '{move.action}' instance {uuid}: it moved meanwhile.")
        _refuse_beside_a_live_migration(session, uuid, move.action)
        session.add(Migration(
            uuid=migration_uuid, instance_uuid=uuid, source_compute=instance.host, source_node=instance.node,
            status=PRE_MIGRATING, migration_type=RESIZE if move.flavor_ref is not None else MIGRATION,
            old_instance_type_id=current.get("id"), new_instance_type_id=new_flavor.get("id"),
            user_id=ctx.user_id, project_id=ctx.project_id, hidden=False, cross_cell_move=False))
        actions.start_action(session, instance_uuid=uuid, action=move.action, request_id=ctx.request_id,
                             user_id=ctx.user_id, project_id=ctx.project_id)
    try:
        # A concurrent request took the room (OverQuota), or the count could not be made (the API
        # database out of reach, say: a cell's is left out of it): no workflow would ever take the move.
        quotas.recheck(project_id, deltas)
        _remember_cross_cell_choice(ctx, location)
    except Exception:
        _undo_move(cell, uuid, migration_uuid, ctx.request_id, previous, forget_migration=True)
        raise
    payload = _move_payload(ctx, uuid, migration_uuid, cell.name, move.requested_host)
    logger.info("move accepted", extra={"instance_uuid": uuid, "migration_uuid": migration_uuid,
                                        "action": move.action, "flavor": new_flavor.get("flavorid")})
    return cell, payload, previous


def _check_image_still_fits(image_ref: str | None, new_flavor: dict[str, Any]) -> None:
    """Refuse (400) a resize of an image-backed server to a flavor its image does not fit (its
    ``min_ram``, ``min_disk`` and size), as Nova checks. Nova reads the image's properties it kept
    at boot; Ferry reads the image, so one deleted since is not checked, nor one S3 cannot show
    now (logged: the move's own steps do not need the image).

    Raises:
        BadRequest: Nova's messages (``Flavor's memory is too small for requested image.``, …).
    """
    if not image_ref:
        return
    try:
        image = images.get_image(image_ref)
    except errors.ImageNotFound:
        return
    except (BotoCoreError, ClientError) as exc:
        logger.warning("the image was not read; the resize is not checked against it",
                       extra={"image_id": image_ref, "error": str(exc)})
        return
    compute_api.check_image_fits(image, int(new_flavor.get("memory_mb") or 0), int(new_flavor.get("root_gb") or 0))


def _refuse_beside_a_live_migration(session: Session, uuid: str, action: str) -> None:
    """Refuse a move of a server another move's workflow may still act on: one of its migrations
    is still moving, or being confirmed or reverted (after an os-resetState cleared its task). That
    workflow's steps and rollback would otherwise act on the server, and on its allocations, under
    the new move.

    Raises:
        MigrationInProgress: 409; nothing written.
    """
    live = session.scalars(select(Migration).where(
        Migration.instance_uuid == uuid, Migration.status.in_((*MOVING, *SETTLING)),
        Migration.deleted.is_(False)).order_by(Migration.created_at.desc()).limit(1)).first()
    if live is not None:
        raise errors.MigrationInProgress(
            f"Cannot '{action}' instance {uuid}: its migration {live.uuid} is still {live.status}. Its "
            f"workflow settles it; ferry audit --fix settles one whose workflow ended without (migration_stuck).")


def _move_payload(ctx: RequestContext, instance_uuid: str, migration_uuid: str, cell: str,
                  requested_host: str | None) -> dict[str, Any]:
    return {"instance_uuid": instance_uuid, "migration_uuid": migration_uuid, "cell": cell,
            "request_id": ctx.request_id, "requested_host": requested_host, "user_id": ctx.user_id,
            "project_id": ctx.project_id}


def _begin_move(ctx: RequestContext, location: compute_api.Location, move: _Move) -> str:
    migration_uuid = new_uuid()
    cell, payload, previous = _accept_move(ctx, location, move, migration_uuid)
    uuid = location.instance_uuid
    try:
        workflows.start_execution(config.get().resize_state_machine_arn,
                                  move_execution_name("resize", uuid, migration_uuid), payload)
    except Exception:
        logger.exception("resize workflow did not start; undoing", extra={"instance_uuid": uuid})
        # Unless it did start after all (a step of it recorded): then it is the workflow's to
        # finish, and the request was accepted.
        if _undo_move(cell, uuid, migration_uuid, ctx.request_id, previous, forget_migration=False,
                      unless_begun=True):
            raise
        logger.warning("the resize workflow runs after all: the move stands", extra={"instance_uuid": uuid})
    return migration_uuid


def prepare_migrate(ctx: RequestContext, location: compute_api.Location, host: str | None,
                    migration_uuid: str) -> PreparedExecution:
    """Accept a cold migration as :func:`begin_migrate` does, but leave starting the workflow to the caller.

    Idempotent on ``migration_uuid``: when that migration was already recorded for the server
    (the caller's step ran before), the same execution is returned and nothing is written.

    Returns:
        The resize workflow's execution name and input (``execution_name`` included).

    Raises:
        What :func:`begin_migrate` raises.
    """
    uuid = location.instance_uuid
    name = move_execution_name("resize", uuid, migration_uuid)
    if location.cell is not None and migration_exists(location.cell, migration_uuid):
        payload = _move_payload(ctx, uuid, migration_uuid, location.cell.name, host)
        return PreparedExecution(name, {**payload, "execution_name": name})
    _cell, payload, _previous = _accept_move(
        ctx, location, _Move(action=actions.MIGRATE, flavor_ref=None, requested_host=host), migration_uuid)
    return PreparedExecution(name, {**payload, "execution_name": name})


def migration_exists(cell: str | CellMapping, migration_uuid: str) -> bool:
    """Whether the cell has a migration record ``migration_uuid``."""
    with cell_session(cell) as session:
        return session.scalars(select(Migration.id).where(Migration.uuid == migration_uuid)).first() is not None


def move_execution(instance_uuid: str, migration_uuid: str) -> dict[str, Any] | None:
    """The resize workflow's execution of this move as Step Functions describes it; None when it
    never started.

    Without a resize state machine configured (steps run in-process, no Step Functions) there is
    no execution to ask about, and None is returned.
    """
    state_machine_arn = config.get().resize_state_machine_arn
    if not state_machine_arn:
        return None
    return workflows.describe_execution(state_machine_arn, move_execution_name("resize", instance_uuid,
                                                                                migration_uuid))


def abandon_prepared_move(cell: str, instance_uuid: str, migration_uuid: str, request_id: str) -> bool:
    """Undo a move :func:`prepare_migrate` accepted whose workflow never began scheduling it.

    Only a move still waiting to be scheduled (task_state ``resize_prep``, migration
    ``pre-migrating``) is undone: the instance gets its task back to None, the migration is
    marked ``error`` and the action forgotten. A move whose workflow ran is its workflow's to
    finish or roll back; one whose workflow ended without doing so (stopped, timed out) is
    undone only if it never began scheduling (its action records no step, so it claimed
    nothing), else left as it is, for ``ferry audit`` to report (``instance_task_stuck``,
    ``migration_stuck``); one whose workflow still runs is never undone here.

    Returns:
        Whether anything was undone.

    Raises:
        MoveStillRunning: the migration is still under way (``pre-migrating``, ``migrating``,
            ``post-migrating``) and the move's workflow runs; the caller asks again once it has
            ended.
    """
    with cell_session(cell) as session:
        status = session.scalars(select(Migration.status).where(Migration.uuid == migration_uuid)).first()
        if status not in MOVING:
            return False
        try:
            task_state = instances.get(session, instance_uuid).task_state
        except errors.InstanceNotFound:  # after a cross-cell move's switch the copy here is hidden
            task_state = None
        undoable = status == PRE_MIGRATING and task_state == states.RESIZE_PREP
        # ferry.workflows.resize.select_destinations commits the move's first event before it claims.
        begun = undoable and actions.has_events(session, instance_uuid, request_id)
    # Step Functions is asked only about a move still under way (not after a failed confirm, say).
    ran = move_execution(instance_uuid, migration_uuid)
    if ran is not None and workflows.is_running(ran):
        raise errors.MoveStillRunning(
            f"The workflow of move {migration_uuid} of server {instance_uuid} still runs.")
    if not undoable:
        return False
    # What the flavors were before is not known here; they only matter while a move is under way.
    # A step recorded means the workflow ran, also when Step Functions does not show it yet.
    if begun or not _undo_move(cell, instance_uuid, migration_uuid, request_id, None, forget_migration=False,
                               unless_begun=True):
        logger.warning("move not undone: its workflow ran and ended without finishing or rolling it back",
                       extra={"instance_uuid": instance_uuid, "migration_uuid": migration_uuid,
                              "ended": ran.get("status") if ran else None})
        return False
    return True


def _undo_move(cell: str | CellMapping, instance_uuid: str, migration_uuid: str, request_id: str,
               previous: dict[str, Any] | None, *, forget_migration: bool, unless_begun: bool = False) -> bool:
    """Put an accepted move back: task_state None with the flavors as they were (``previous``;
    None leaves them), the action forgotten, and the migration deleted (``forget_migration``) or
    marked ``error``.

    ``unless_begun`` leaves everything as it is when a step of the move recorded an event. The
    check follows the instance's compare-and-swap in the same transaction: SelectMoveDestinations
    swaps the same row before it records its event, so either it finds the move undone and
    claims nothing, or its event is committed and seen here.

    Returns:
        Whether the move was undone.
    """
    with cell_session(cell) as session:
        try:
            instances.update_cas(session, instance_uuid, {"task_state": None, **(previous or {})},
                                 expected_task_state=(states.RESIZE_PREP,))
        except errors.UnexpectedTaskState:
            logger.warning("state changed meanwhile; left as is", extra={"instance_uuid": instance_uuid})
        if unless_begun and actions.has_events(session, instance_uuid, request_id):
            session.rollback()
            return False
        if forget_migration:
            session.execute(delete(Migration).where(Migration.uuid == migration_uuid))
        else:
            _swap_migration_status(session, migration_uuid, PRE_MIGRATING, ERROR)
        actions.forget_action(session, instance_uuid, request_id)
    return True


def begin_resize(ctx: RequestContext, location: compute_api.Location, flavor_ref: str) -> str:
    """Accept a resize of the server at ``location`` to the flavor ``flavor_ref`` and start the resize workflow.

    Checks, in Nova's order, before anything is written: the server is unlocked (or the
    caller an admin), in vm_state ``active`` or ``stopped`` with no task, and its host is up
    (409 otherwise); the flavor exists, is enabled and usable by the caller, differs from the
    current one, and can hold the server's disks (400); the growth in cores and RAM fits the
    project's quota (403); an image-backed server's image fits the flavor (400).

    Then, in the cell: task_state None → ``resize_prep`` (compare-and-swap, so a second move
    gets 409) with ``old_flavor`` = the current flavor, ``new_flavor`` = the target flavor
    and ``old_vm_state`` = the vm_state; a migration (``pre-migrating``, type ``resize``,
    source host and node, the flavors' ids, the caller's user and project); the ``resize``
    action. The quota is checked again (a concurrent request may have taken the room; if so
    all of it is removed and the request gets 403), the cross-cell policy is recorded in the
    request spec, and the execution ``resize-<server>-<migration[:8]>`` starts. If it cannot
    start, the instance is put back, the migration marked ``error``, the action forgotten,
    and the error raised.

    Returns:
        The migration's uuid.

    Raises:
        InstanceIsLocked, InstanceInvalidState, ComputeServiceUnavailable: 409.
        BadRequest, CannotResizeToSameFlavor, CannotResizeDisk: 400.
        OverQuota: 403.
    """
    return _begin_move(ctx, location, _Move(action=actions.RESIZE, flavor_ref=flavor_ref))


def begin_migrate(ctx: RequestContext, location: compute_api.Location, host: str | None = None) -> str:
    """Accept a cold migration of the server at ``location`` and start the resize workflow.

    As :func:`begin_resize` with the flavor unchanged (``new_flavor`` = the current flavor,
    migration type ``migration``, action ``migrate``, no quota check). ``host`` (2.56+, the
    caller has checked the policy) must be a known compute host other than the server's
    own, and in the server's cell unless ``compute:servers:resize:cross_cell`` lets the caller
    move it to another cell; the workflow gets it as ``requested_host``.

    Returns:
        The migration's uuid.

    Raises:
        InstanceIsLocked, InstanceInvalidState, ComputeServiceUnavailable: 409.
        ComputeHostNotFound, CannotMigrateToSameHost: 400.
    """
    return _begin_move(ctx, location, _Move(action=actions.MIGRATE, flavor_ref=None, requested_host=host))


def confirm_resize(ctx: RequestContext, location: compute_api.Location) -> str:
    """``confirmResize`` from the API: the lock check, then :func:`begin_confirm`.

    Raises:
        InstanceIsLocked: locked, and the caller is not an admin (409).
        And what :func:`begin_confirm` raises.
    """
    cell = _settle_cell(ctx, location, actions.CONFIRM_RESIZE)
    return begin_confirm(cell, location.instance_uuid, request_id=ctx.request_id, user_id=ctx.user_id,
                         project_id=ctx.project_id)


def revert_resize(ctx: RequestContext, location: compute_api.Location) -> str:
    """``revertResize`` from the API: the lock check, then :func:`begin_revert`.

    Raises:
        InstanceIsLocked: locked, and the caller is not an admin (409).
        And what :func:`begin_revert` raises.
    """
    cell = _settle_cell(ctx, location, actions.REVERT_RESIZE)
    return begin_revert(cell, location.instance_uuid, request_id=ctx.request_id, user_id=ctx.user_id,
                        project_id=ctx.project_id)


def _settle_cell(ctx: RequestContext, location: compute_api.Location, action: str) -> str:
    if location.cell is None:
        raise _invalid_state(action, location.instance_uuid, "vm_state", states.BUILDING)
    with cell_session(location.cell) as session:
        instance = instances.get(session, location.instance_uuid)
        if instance.locked and not ctx.is_admin:
            raise errors.InstanceIsLocked(f"Instance {instance.uuid} is locked")
    return location.cell.name


# --- listing migrations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MigrationFilters:
    """What ``GET /os-migrations`` asks for (None: no filter)."""

    host: str | None = None  # the source or the destination
    statuses: tuple[str, ...] | None = None
    migration_type: str | None = None
    instance_uuid: str | None = None
    source_compute: str | None = None
    user_id: str | None = None
    project_id: str | None = None
    changes_since: dt.datetime | None = None
    changes_before: dt.datetime | None = None


MIGRATION_FIELDS = ("id", "uuid", "instance_uuid", "source_compute", "source_node", "dest_compute", "dest_node",
                    "dest_host", "old_instance_type_id", "new_instance_type_id", "status", "migration_type",
                    "created_at", "updated_at", "user_id", "project_id", "hidden", "cross_cell_move")


def _migration_query(filters: MigrationFilters) -> Select[Any]:
    query = select(Migration).where(Migration.deleted.is_(False))
    if filters.host is not None:
        query = query.where(or_(Migration.source_compute == filters.host, Migration.dest_compute == filters.host))
    if filters.statuses:
        query = query.where(Migration.status.in_(filters.statuses))
    for column, value in ((Migration.migration_type, filters.migration_type),
                          (Migration.instance_uuid, filters.instance_uuid),
                          (Migration.source_compute, filters.source_compute),
                          (Migration.user_id, filters.user_id), (Migration.project_id, filters.project_id)):
        if value is not None:
            query = query.where(column == value)
    changed = func.coalesce(Migration.updated_at, Migration.created_at)
    if filters.changes_since is not None:
        query = query.where(changed >= filters.changes_since)
    if filters.changes_before is not None:
        query = query.where(changed <= filters.changes_before)
    return query


def list_migrations(filters: MigrationFilters, *, newest_first: bool = False, limit: int | None = None,
                    marker: str | None = None) -> list[dict[str, Any]]:
    """Migrations of every cell (cell0 has none), as plain records.

    A migration copied into another cell for a cross-cell move is listed once: the visible
    copy wins over a hidden one, and of two copies the one in the cell the instance lives in.
    The filters apply to that copy (the one an unfiltered list shows), never to a stale one.
    Without ``newest_first`` they come oldest first (per cell, as Nova lists them before 2.59);
    with it newest first by creation (then id, then uuid), which paging relies on: ``marker``
    is the uuid of the last migration of the previous page, found whether or not it passes
    the filters (it may have changed since), and the page starts after its place in the order.

    Raises:
        BadRequest: no cell holds the marker.
        ValueError: a marker without ``newest_first`` (only that order can be paged).
    """
    if marker is not None and not newest_first:
        raise ValueError("a marker pages the newest-first order only")
    after = None if marker is None else _marker_key(marker)
    skipped: list[str] = []
    copies = _copies_by_uuid(_migration_query(filters), skipped)
    filtered = filters != MigrationFilters()
    if filtered:
        # The query found the copies that pass; a migration is listed when its preferred copy
        # is one of them. Only a cross-cell move has copies in other cells (every copy is
        # marked), so only those are looked up again by uuid.
        passing = {(cell, record["id"]) for group in copies.values() for record, cell in group}
        _add_other_copies(copies, [uuid for uuid, group in copies.items()
                                   if any(record["cross_cell_move"] for record, _ in group)], skipped)
    located = _instance_cells({copy[0]["instance_uuid"] for group in copies.values() for copy in group
                               if len(group) > 1})
    merged = []
    for group in copies.values():
        if skipped and all(record["hidden"] for record, _ in group):
            continue  # its visible copy is in a cell that did not answer: the hidden one is stale
        record, cell = _preferred_copy(group, located)
        if not filtered or (cell, record["id"]) in passing:
            merged.append(record)
    if newest_first:
        merged.sort(key=_newest_first_key, reverse=True)
    if after is not None:
        merged = [m for m in merged if _newest_first_key(m) < after]
    if limit is not None:
        merged = merged[:limit]
    return merged


def _newest_first_key(record: dict[str, Any]) -> tuple[dt.datetime, int, str]:
    return record["created_at"], record["id"], record["uuid"]


def _copies_by_uuid(query: Select[Any],
                    skipped: list[str] | None = None) -> dict[str, list[tuple[dict[str, Any], str]]]:
    """The rows ``query`` selects in every cell, as ``(record, cell)`` by migration uuid; uuids in
    the order first seen (cell by cell, each oldest first). A cell whose database does not answer
    is left out (logged, and named in ``skipped``), as Nova lists migrations: its migrations are
    missing until it answers again, rather than every list failing."""
    copies: dict[str, list[tuple[dict[str, Any], str]]] = {}
    for cell in all_cells(include_cell0=False):
        try:
            with cell_session(cell) as session:
                rows = [({name: getattr(row, name) for name in MIGRATION_FIELDS}, row.uuid)
                        for row in session.scalars(query.order_by(Migration.created_at, Migration.id))]
        except DBAPIError as exc:
            db.left_out(exc, cell, "migrations")
            if skipped is not None:
                skipped.append(cell.name)
            continue
        for record, uuid in rows:
            copies.setdefault(uuid, []).append((record, cell.name))
    return copies


def _add_other_copies(copies: dict[str, list[tuple[dict[str, Any], str]]], uuids: list[str],
                      skipped: list[str]) -> None:
    """Add to ``copies`` the copies of ``uuids`` it does not hold yet, from every cell (one that
    does not answer named in ``skipped``)."""
    held = {(cell, record["id"]) for uuid in uuids for record, cell in copies[uuid]}
    for start in range(0, len(uuids), 500):
        query = select(Migration).where(Migration.deleted.is_(False), Migration.uuid.in_(uuids[start:start + 500]))
        for uuid, group in _copies_by_uuid(query, skipped).items():
            copies[uuid].extend(copy for copy in group if (copy[1], copy[0]["id"]) not in held)


def _marker_key(marker: str) -> tuple[dt.datetime, int, str]:
    """Where the migration ``marker`` stands in the newest-first order: that of the copy an
    unfiltered list shows, whatever the filters.

    Raises:
        BadRequest: no cell holds it.
    """
    group = _copies_by_uuid(select(Migration).where(Migration.deleted.is_(False), Migration.uuid == marker)).get(marker)
    if not group:
        raise errors.BadRequest(f"Marker {marker} could not be found.")
    located = _instance_cells({group[0][0]["instance_uuid"]}) if len(group) > 1 else {}
    return _newest_first_key(_preferred_copy(group, located)[0])


def _instance_cells(instance_uuids: set[str]) -> dict[str, str]:
    if not instance_uuids:
        return {}
    with api_session() as session:
        rows = session.scalars(select(InstanceMapping).where(InstanceMapping.instance_uuid.in_(instance_uuids)))
        return {row.instance_uuid: row.cell.name for row in rows if row.cell is not None}


def _preferred_copy(group: list[tuple[dict[str, Any], str]],
                    located: dict[str, str]) -> tuple[dict[str, Any], str]:
    """The copy a list shows, with its cell: a visible one over a hidden one, then the one in the
    cell the instance lives in, then the one changed last."""
    def rank(item: tuple[dict[str, Any], str]) -> tuple[bool, bool, dt.datetime]:
        record, cell = item
        return (not record["hidden"], located.get(record["instance_uuid"]) == cell,
                record["updated_at"] or record["created_at"])
    return max(group, key=rank)
