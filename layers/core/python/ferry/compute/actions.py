"""Instance actions and their events (what ``os-instance-actions`` shows).

The API records the action when it accepts a request; each workflow step records its
event (``compute_prep_resize``, …) with its result. Recording is idempotent per
(action, event) so a retried step does not add a second event.
"""

from __future__ import annotations

import datetime as dt
import traceback as tb
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ferry import errors
from ferry.store.api_models import utcnow
from ferry.store.cell_models import Instance, InstanceAction, InstanceActionEvent

# Action names (as Nova's instance_actions).
CREATE = "create"
DELETE = "delete"
STOP = "stop"
START = "start"
RESIZE = "resize"
MIGRATE = "migrate"
CONFIRM_RESIZE = "confirmResize"
REVERT_RESIZE = "revertResize"
# What an os-resetState records (it has no events).
RESET_STATE = "resetState"

SUCCESS = "Success"
ERROR = "Error"


def start_action(session: Session, *, instance_uuid: str, action: str, request_id: str,
                 user_id: str | None, project_id: str | None) -> InstanceAction:
    """Record that ``action`` was accepted for an instance (idempotent per request id).

    Two deliveries of one step may both find no action and insert one: the second insert is refused
    by the (instance_uuid, request_id) constraint once the first commits, in a savepoint so that the
    rest of its transaction stands, and the action the first recorded is returned.
    """
    existing = _action(session, instance_uuid, request_id)
    if existing is not None:
        return existing
    record = InstanceAction(instance_uuid=instance_uuid, action=action, request_id=request_id,
                            user_id=user_id, project_id=project_id)
    session.flush()
    try:
        with session.begin_nested():
            session.add(record)
    except IntegrityError:
        recorded = _action(session, instance_uuid, request_id)
        if recorded is None:  # refused for another reason than the other delivery's action
            raise
        return recorded
    return record


def forget_action(session: Session, instance_uuid: str, request_id: str) -> None:
    """Remove an action and its events: the request that recorded it was undone before it took effect."""
    action = _action(session, instance_uuid, request_id)
    if action is not None:
        session.execute(delete(InstanceActionEvent).where(InstanceActionEvent.action_id == action.id))
        session.delete(action)
        session.flush()


def find(session: Session, instance_uuid: str, request_id: str) -> InstanceAction | None:
    """The instance's action recorded under ``request_id``, if any."""
    return _action(session, instance_uuid, request_id)


def newest_request_id(session: Session, instance_uuid: str, action: str) -> str | None:
    """The request id of the instance's newest ``action`` (None when it has none)."""
    return session.scalars(select(InstanceAction.request_id).where(
        InstanceAction.instance_uuid == instance_uuid, InstanceAction.action == action)
        .order_by(InstanceAction.id.desc()).limit(1)).first()


def end_open_events(session: Session, instance_uuid: str, action: str, error: dict[str, Any]) -> list[str]:
    """End with ``error`` every event of the instance's newest ``action`` that no step ended (its
    workflow stopped without settling the request); the names of those ended, in order."""
    newest = session.scalars(select(InstanceAction).where(
        InstanceAction.instance_uuid == instance_uuid, InstanceAction.action == action)
        .order_by(InstanceAction.id.desc()).limit(1)).first()
    if newest is None:
        return []
    open_events = session.execute(select(InstanceActionEvent.event, InstanceActionEvent.host).where(
        InstanceActionEvent.action_id == newest.id, InstanceActionEvent.finish_time.is_(None))
        .order_by(InstanceActionEvent.id)).all()
    for name, host in open_events:
        finish_event(session, instance_uuid=instance_uuid, request_id=newest.request_id, event=name, host=host,
                     error=error)
    return [name for name, _host in open_events]


def has_events(session: Session, instance_uuid: str, request_id: str) -> bool:
    """Whether a step of the action recorded under ``request_id`` began (recorded an event)."""
    action = _action(session, instance_uuid, request_id)
    return action is not None and session.scalars(select(InstanceActionEvent.id).where(
        InstanceActionEvent.action_id == action.id).limit(1)).first() is not None


def take_request(session: Session, *, instance_uuid: str, request_id: str, task_states: tuple[str, ...],
                 event: str, host: str | None = None) -> None:
    """The first step of a workflow the API started: record ``event``'s start once the request is
    seen still in force (the server's task one of ``task_states``, the request's action recorded),
    under the server's row lock. The API, undoing a request whose start it could not confirm,
    takes the same lock and leaves a request whose workflow recorded an event
    (:func:`has_events`): either the step sees the request undone, or the API sees it begun.

    Raises:
        UnexpectedTaskState: the request was undone (or the server is gone); nothing is recorded.
    """
    instance = _locked_instance(session, instance_uuid)
    if instance is None or instance.deleted or instance.task_state not in task_states \
            or _action(session, instance_uuid, request_id) is None:
        raise errors.UnexpectedTaskState(
            f"Instance {instance_uuid} is not under request {request_id} any more "
            f"(task_state {instance.task_state if instance else None}); nothing was done.")
    start_event(session, instance_uuid=instance_uuid, request_id=request_id, event=event, host=host)


def lock_server(session: Session, instance_uuid: str) -> None:
    """Take the server's row lock for the rest of the transaction (see :func:`request_taken`); the
    server, if the session read it before, now has the values read under the lock."""
    _locked_instance(session, instance_uuid)


def _locked_instance(session: Session, instance_uuid: str) -> Instance | None:
    """The server read under its row lock. The row read replaces what the session holds of it:
    otherwise a server the session loaded before would keep the values it had then, and a check
    "under the lock" would check those."""
    return session.scalars(select(Instance).where(Instance.uuid == instance_uuid).with_for_update()
                           .execution_options(populate_existing=True)).one_or_none()


def request_taken(session: Session, instance_uuid: str, request_id: str) -> bool:
    """Whether a workflow step took the request (:func:`take_request`, or a first step that
    records its event after :func:`lock_server`), read under the server's row lock, which that
    step takes too: once this answers False in a transaction that goes on to undo the request,
    the step finds it undone."""
    lock_server(session, instance_uuid)
    return has_events(session, instance_uuid, request_id)


def superseded(session: Session, instance_uuid: str, request_id: str, event: str) -> bool:
    """Whether a step that ends the request's ``event`` must leave the server alone, read under
    the server's row lock: the event has ended already (the step committed before, and Step
    Functions runs it again), the request's action is gone (the API undid the request), or a newer
    request's action was recorded since, other than an os-resetState (one cleared the task, and a
    new request took the server). The task the server has then, if any, is another request's; a
    reset alone leaves the step to record what its host did."""
    lock_server(session, instance_uuid)
    action = _action(session, instance_uuid, request_id)
    return action is None or _event_ended(session, action, event) or _newer_than(session, action)


def ended(session: Session, instance_uuid: str, request_id: str, event: str) -> bool:
    """Whether the request's ``event`` has ended, or its action is gone (see :func:`superseded`)."""
    action = _action(session, instance_uuid, request_id)
    return action is None or _event_ended(session, action, event)


def overtaken(session: Session, instance_uuid: str, request_id: str) -> bool:
    """Whether a newer request than ``request_id`` (not an os-resetState) recorded its action on the
    server: the server's task, if any, is that request's (see :func:`superseded`)."""
    action = _action(session, instance_uuid, request_id)
    return action is not None and _newer_than(session, action)


def event_finished(session: Session, instance_uuid: str, request_id: str, event: str) -> bool:
    """Whether the action ``request_id`` already recorded the end of ``event`` (a step that ran before)."""
    action = _action(session, instance_uuid, request_id)
    return action is not None and _event_ended(session, action, event)


def _event_ended(session: Session, action: InstanceAction, event: str) -> bool:
    return session.scalars(select(InstanceActionEvent.finish_time).where(
        InstanceActionEvent.action_id == action.id, InstanceActionEvent.event == event)).first() is not None


def _newer_than(session: Session, action: InstanceAction) -> bool:
    return session.scalars(select(InstanceAction.id).where(
        InstanceAction.instance_uuid == action.instance_uuid, InstanceAction.id > action.id,
        InstanceAction.action != RESET_STATE).limit(1)).first() is not None


def event_result(session: Session, instance_uuid: str, request_id: str, event: str) -> str | None:
    """The result of the action's ``event`` (``Success``, ``Error``; None while unfinished or unknown)."""
    action = _action(session, instance_uuid, request_id)
    if action is None:
        return None
    return session.scalars(select(InstanceActionEvent.result).where(
        InstanceActionEvent.action_id == action.id, InstanceActionEvent.event == event)).first()


def _action(session: Session, instance_uuid: str, request_id: str) -> InstanceAction | None:
    return session.scalars(select(InstanceAction).where(
        InstanceAction.instance_uuid == instance_uuid, InstanceAction.request_id == request_id)).one_or_none()


def start_event(session: Session, *, instance_uuid: str, request_id: str, event: str,
                host: str | None = None, start_time: dt.datetime | None = None) -> None:
    """Record that a step began, now or at ``start_time`` (no-op if the action is unknown or the event exists)."""
    action = _action(session, instance_uuid, request_id)
    if action is None:
        return
    existing = session.scalars(select(InstanceActionEvent).where(
        InstanceActionEvent.action_id == action.id, InstanceActionEvent.event == event)).one_or_none()
    if existing is None:
        session.add(InstanceActionEvent(action_id=action.id, event=event, host=host,
                                        start_time=start_time or utcnow()))
        action.updated_at = utcnow()
        session.flush()


def finish_started_event(session: Session, *, instance_uuid: str, request_id: str, event: str,
                         error: dict[str, Any]) -> None:
    """End ``event`` with ``error`` if the request started it and it is still open (a rollback's
    inner step, which may never have begun: none is recorded then)."""
    action = _action(session, instance_uuid, request_id)
    if action is None:
        return
    record = session.scalars(select(InstanceActionEvent).where(
        InstanceActionEvent.action_id == action.id, InstanceActionEvent.event == event,
        InstanceActionEvent.finish_time.is_(None))).one_or_none()
    if record is not None:
        finish_event(session, instance_uuid=instance_uuid, request_id=request_id, event=event, host=record.host,
                     error=error)


def finish_event(session: Session, *, instance_uuid: str, request_id: str, event: str,
                 host: str | None = None, error: BaseException | dict[str, Any] | None = None) -> None:
    """Record a step's end: ``Success``, or ``Error`` with the error's name and message.

    A failed event marks its action's ``message`` ``Error`` (the error itself stays on the event).
    """
    action = _action(session, instance_uuid, request_id)
    if action is None:
        return
    record = session.scalars(select(InstanceActionEvent).where(
        InstanceActionEvent.action_id == action.id, InstanceActionEvent.event == event)).one_or_none()
    if record is None:
        record = InstanceActionEvent(action_id=action.id, event=event, host=host)
        session.add(record)
    record.finish_time = utcnow()
    record.host = host or record.host
    if error is None:
        record.result = SUCCESS
    else:
        record.result = ERROR
        if isinstance(error, BaseException):
            record.details = f"{type(error).__name__}: {error}"
            record.traceback = "".join(tb.format_exception(error))
        else:
            record.details = f"{error.get('Error', 'Error')}: {error.get('Cause', '')}"
        # The action says only that it failed: the details may name hosts and internals, so they
        # stay on the event, where the events:details policy decides who reads them.
        action.message = ERROR
    action.finish_time = utcnow()
    session.flush()
