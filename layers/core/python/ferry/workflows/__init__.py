"""Workflow steps (one module per state machine) and starting executions."""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ferry import aws, errors
from ferry.observability import logger

# The statuses of an execution that goes on: running, or failed and waiting to be redriven.
RUNNING_STATUSES = frozenset({"RUNNING", "PENDING_REDRIVE"})


def is_running(execution: dict[str, Any]) -> bool:
    """Whether a described execution goes on (:data:`RUNNING_STATUSES`)."""
    return execution.get("status") in RUNNING_STATUSES


def execution_arn(state_machine_arn: str, name: str) -> str:
    """The ARN of the execution ``name`` of ``state_machine_arn``."""
    return state_machine_arn.replace(":stateMachine:", ":execution:") + f":{name}"


def describe_execution(state_machine_arn: str, name: str) -> dict[str, Any] | None:
    """Step Functions' description of the execution ``name`` (its ``status``, ``input``…); None when there is none."""
    sfn = aws.client("stepfunctions")
    try:
        return dict(sfn.describe_execution(executionArn=execution_arn(state_machine_arn, name)))
    except sfn.exceptions.ExecutionDoesNotExist:
        return None


def start_execution(state_machine_arn: str, name: str, payload: dict[str, Any]) -> str:
    """Start ``state_machine_arn`` with ``payload`` under the execution name ``name``.

    The name makes the start idempotent: Step Functions answers a second start with the same
    name and input with the running execution, so a retried API call cannot start a workflow
    twice. It refuses the name (``ExecutionAlreadyExists``) when its execution has ended, or was
    started with another input: the first is this start's own execution, already over; the
    second is another request's, and nothing was started for this one. ``name`` is also passed
    in the payload as ``execution_name`` (host operation ids derive from it). A start that
    answered an error but whose execution exists with this input counts as started.

    Returns:
        The execution ARN.

    Raises:
        WorkflowNotConfigured: no state machine ARN.
        ExecutionNameTaken: an execution with another input holds the name (the caller's undo runs).
    """
    if not state_machine_arn:
        raise errors.WorkflowNotConfigured("No state machine is configured for this operation.")
    body = {**payload, "execution_name": name}
    sfn = aws.client("stepfunctions")
    try:
        response = sfn.start_execution(stateMachineArn=state_machine_arn, name=name, input=json.dumps(body))
    except sfn.exceptions.ExecutionAlreadyExists as exc:
        try:
            held = describe_execution(state_machine_arn, name)
        except (ClientError, BotoCoreError):
            held = None
        # Not described (Step Functions reads are eventually consistent, or the read failed): taken
        # for this start's own, since undoing a request whose workflow does run is the worse mistake.
        if held is not None and json.loads(held.get("input") or "null") != body:
            raise errors.ExecutionNameTaken(
                f"The execution name {name} is taken by another request's workflow; nothing was started.") from exc
        logger.info("execution already started", extra={"execution": name})
        return execution_arn(state_machine_arn, name)
    except (ClientError, BotoCoreError) as exc:
        # The answer may be what was lost (a timeout, a throttled retry), not the start: undoing a
        # request whose workflow runs would pull its records from under it.
        if not _started_as(state_machine_arn, name, body):
            raise
        logger.warning("starting the execution answered an error, but it was started",
                       extra={"execution": name, "error": str(exc)})
        return execution_arn(state_machine_arn, name)
    logger.info("execution started", extra={"execution": name, "state_machine": state_machine_arn})
    return response["executionArn"]


def _started_as(state_machine_arn: str, name: str, body: dict[str, Any]) -> bool:
    """Whether the execution ``name`` exists with ``body`` as its input (False when that cannot be read)."""
    try:
        held = describe_execution(state_machine_arn, name)
    except (ClientError, BotoCoreError):
        return False
    return held is not None and json.loads(held.get("input") or "null") == body


def error_message(error: dict[str, Any]) -> str:
    """The human part of a Step Functions error ``{Error, Cause}`` (a Lambda's Cause is JSON)."""
    cause = error.get("Cause") or ""
    try:
        parsed = json.loads(cause)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and "errorMessage" in parsed:
        cause = parsed["errorMessage"]
    name = error.get("Error", "")
    if name == errors.NoValidHost.__name__ and not cause.startswith(errors.NoValidHost.MESSAGE_START):
        cause = f"{errors.NoValidHost.MESSAGE_START}. {cause}".strip()
    return cause or name or "Unknown error"


def owner_cause(error: dict[str, Any]) -> str:
    """The cause of a Step Functions error ``{Error, Cause}`` as a server's owner may read it in a fault.

    The error's message (:func:`error_message`) when its name is an error written for the owner
    (:meth:`ferry.errors.FerryError.readable_by_owner`: a request refused, not found, in conflict; no
    valid host); else its name alone (``Ferry.HypervisorError``, ``States.Timeout``): the text of
    such an error may name a host's paths, libvirt's output, an AWS account or ARN, or a database
    server. :func:`fault_details` puts that text where only admins read it.
    """
    name = str(error.get("Error") or "")
    if errors.FerryError.readable_by_owner(name):
        return error_message(error)
    return name or "Unknown error"


def fault_details(error: dict[str, Any], details: str | None = None) -> str | None:
    """A fault's details (only admins read them): ``details``, then the error's full message
    when the owner reads less of it (:func:`owner_cause`)."""
    cause = error_message(error)
    if owner_cause(error) == cause:
        return details
    return f"{details} Cause: {cause}" if details else f"Cause: {cause}"
