"""The shape every workflow step's Lambda handler shares: validate, call one function, return.

``functions/<step>/app.py`` is then two lines::

    from ferry.handlers import step_handler
    from ferry.workflows import boot
    handler = step_handler(boot.finish_build, "FinishBuild")

A fault armed for the step's name (:mod:`ferry.faults`, off unless configured) fails it
before it runs. Typed errors propagate unchanged: their class name (``Ferry.NoValidHost``, …) is the
``errorType`` the state machine's ``Retry``/``Catch`` match on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ferry import errors, faults, validation
from ferry.observability import logger, metrics, timed_step

# Every step receives the workflow's state document; these keys are always present.
STEP_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["instance_uuid", "request_id"],
    "properties": {"instance_uuid": {"type": "string", "minLength": 1}, "request_id": {"type": "string"}},
}


class InvalidStepInput(errors.FerryError):
    """A workflow step received input that does not match its schema."""


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
            raise InvalidStepInput(f"{name}: {exc.message}") from exc
        logger.append_keys(step=name, instance_uuid=event.get("instance_uuid"),
                           execution=event.get("execution_name"))
        metrics.add_dimension(name="Step", value=name)
        with timed_step(name):
            faults.check(name)
            return step(event)

    handler.__name__ = f"{name}_handler"
    return handler
