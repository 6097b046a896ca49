"""The shape every workflow step's Lambda handler shares: validate, call one function, return.

``functions/<step>/app.py`` is then two lines::

    from ferry.handlers import step_handler
    from ferry.workflows import boot
    handler = step_handler(boot.finish_build, "FinishBuild")

Every handler (``step_handler``'s, and the others through :func:`lambda_entry`) freezes the
heap its imports built on its first invocation (:func:`freeze_startup_heap`).

A fault armed for the step's name (:mod:`ferry.faults`, off unless configured) fails it
before it runs. Typed errors propagate unchanged: their class name (``Ferry.NoValidHost``, …) is the
``errorType`` the state machine's ``Retry``/``Catch`` match on. A database failure of the moment
(:func:`ferry.store.db.transient`) becomes ``Ferry.DatabaseUnavailable``, which every state running
a step retries; any other error is the step's.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError

import ferry
from ferry import errors, faults, validation
from ferry.observability import logger, metrics, timed_step
from ferry.store import db

# Every step receives the workflow's state document; these keys are always present.
STEP_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["instance_uuid", "request_id"],
    "properties": {"instance_uuid": {"type": "string", "minLength": 1}, "request_id": {"type": "string"}},
}


_heap_frozen = False


def freeze_startup_heap() -> None:
    """Exempt what the process has built so far from the cyclic garbage collector, once per process.

    A function's modules, SQLAlchemy and the ORM mappings are some 100,000 objects that live as
    long as its environment. A full collection walks every tracked object, so each full pass
    that fell inside an invocation added tens of milliseconds to it (the scheduler's p95 was three
    times its median). :func:`gc.freeze` moves them to the permanent generation; collections go on
    over what invocations allocate. In a Lambda environment the collector was paused while the
    modules loaded (:mod:`ferry`); it runs again from here.
    """
    global _heap_frozen
    if not _heap_frozen:
        gc.freeze()
        _heap_frozen = True
        if ferry.collector_paused_for_startup:
            ferry.collector_paused_for_startup = False
            gc.enable()


def lambda_entry(handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap a module's Lambda handler so that its first invocation first freezes the startup heap."""

    @functools.wraps(handler)
    def entry(event: Any, context: Any) -> Any:
        freeze_startup_heap()
        return handler(event, context)

    return entry


def step_handler(
    step: Callable[[dict[str, Any]], Any], name: str, schema: dict[str, Any] | None = None
) -> Callable[[dict[str, Any], Any], Any]:
    """Wrap ``step(event) -> result`` as a Lambda handler named ``name`` in logs and metrics."""

    @logger.inject_lambda_context(clear_state=True)
    @metrics.log_metrics
    def handler(event: dict[str, Any], context: Any) -> Any:
        try:
            validation.check(event, schema or STEP_EVENT_SCHEMA)
        except validation.SchemaMismatch as exc:
            raise errors.InvalidStepInput(f"{name}: {exc.message}") from exc
        # The request id (``req-…``, what ``openstack server event list`` shows) and the move's
        # migration find every step's lines of one request; a key without a value is left out.
        logger.append_keys(step=name, instance_uuid=event.get("instance_uuid"),
                           execution=event.get("execution_name"), request_id=event.get("request_id"),
                           migration_uuid=event.get("migration_uuid"))
        metrics.add_dimension(name="Step", value=name)
        with timed_step(name):
            faults.check(name)
            try:
                return step(event)
            except DBAPIError as exc:
                if not db.transient(exc):
                    raise
                reason = str(exc.orig).strip().splitlines()[0][:200] if exc.orig is not None else type(exc).__name__
                logger.warning("database unavailable for a moment; the step is retried", extra={"error": reason})
                raise errors.DatabaseUnavailable(
                    f"{name}: the database could not serve the step for a moment ({reason}).") from exc

    handler.__name__ = f"{name}_handler"
    return lambda_entry(handler)
