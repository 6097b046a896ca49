"""moto as the local AWS, with Lambda invocations running the functions' real handlers.

:class:`LocalAws` starts a ``ThreadedMotoServer`` in this process, turns on moto's Step
Functions executor and its Docker-less Lambda backend, and replaces that backend's ``invoke``
(which only echoes the payload) with a call to the function's handler through a
:class:`FunctionRunner`. State machines then run their ``Task`` states — a Lambda ARN as
``Resource`` or ``arn:aws:states:::lambda:invoke`` — against Ferry's code, and a typed error
(``Ferry.NoValidHost``) reaches ``Retry``/``Catch`` as the ``errorType`` it would have on AWS.

Environment: every function sees the union of the template's function environments, set once
in ``os.environ`` when the runtime starts (:meth:`LocalTemplate.environment` refuses two
functions giving one variable different values). Setting variables per invocation would need
a process-wide lock around every handler, which serialises the whole stack and deadlocks when
one handler waits on another (a synchronous execution calling back into Lambda).

At-least-once drills: AWS delivers SQS messages and invokes Lambda steps at least once, and
Ferry must end the same when it happens twice. Two switches, read on every call so a test can
turn them on and off while the stack runs:

* ``FERRY_LOCAL_DUPLICATE_DELIVERY=1``: every host operation message (a message with an
  ``operation_id`` on a host's queue) is put on the queue twice.
* ``FERRY_LOCAL_INVOKE_TWICE=1``: every invocation through Lambda's Invoke API (the workflows'
  Lambda steps, and asynchronous invocations) runs the handler twice with the same event and
  returns the second outcome, as a Step Functions retry after a lost response would.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import boto3
from botocore.config import Config

from ferry import aws, config, protocol
from ferry.errors import LocalStackError, TemplateError
from ferry.local.template import Function, LocalTemplate

log = logging.getLogger("ferry-local")

DUPLICATE_DELIVERY_ENV = "FERRY_LOCAL_DUPLICATE_DELIVERY"
INVOKE_TWICE_ENV = "FERRY_LOCAL_INVOKE_TWICE"
# Multiplies the wait before each Retry attempt of the state machines (read at every wait; 1 when unset).
RETRY_SCALE_ENV = "FERRY_LOCAL_RETRY_SCALE"
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}
MOTO_CONFIG = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}


# --- running handlers ---------------------------------------------------------------------------


def switched_on(variable: str) -> bool:
    """Whether the environment variable ``variable`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")


class LambdaContext:
    """What a Python handler receives as ``context`` on Lambda (the attributes Powertools reads)."""

    def __init__(self, function: Function, request_id: str | None = None) -> None:
        self.function_name = function.name
        self.function_version = "$LATEST"
        self.invoked_function_arn = function.arn
        self.memory_limit_in_mb = function.memory_size
        self.aws_request_id = request_id or str(uuid.uuid4())
        self.log_group_name = f"/aws/lambda/{function.name}"
        self.log_stream_name = f"{time.strftime('%Y/%m/%d')}/[$LATEST]{uuid.uuid4().hex}"
        self.identity = None
        self.client_context = None
        self._deadline = time.monotonic() + function.timeout

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


@dataclass(frozen=True)
class Invocation:
    """The outcome of one invocation: the handler's result, or Lambda's error document."""

    function: str
    request_id: str
    result: Any = None
    error: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def payload(self) -> bytes:
        """What Lambda's Invoke API returns as ``Payload``."""
        return json.dumps(self.error if self.error is not None else self.result).encode()


def error_document(exc: BaseException, request_id: str = "") -> dict[str, Any]:
    """Lambda's document for an unhandled exception; ``errorType`` is the class name Catch matches on."""
    tb = exc.__traceback__
    # The first frame is the runner calling the handler, which Lambda's own runtime does not show.
    tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    return {
        "errorType": type(exc).__name__,
        "errorMessage": str(exc),
        "stackTrace": traceback.format_list(traceback.extract_tb(tb)),
        "requestId": request_id,
    }


class FunctionRunner:
    """Calls the template's functions' handlers in this process.

    Each function's ``app.py`` is imported once per execution environment, by file path, under a
    module name of its own (every function has an ``app`` module), with its code folder first on
    ``sys.path`` while it imports, as Lambda's task root would be. Environment 0 serves every
    caller unless told otherwise; an event source running batches at once gives each of its
    threads an environment of its own, since on Lambda concurrent invocations never share a
    module's state (a batch processor at module level, say).
    """

    def __init__(self, functions: Mapping[str, Function] | LocalTemplate) -> None:
        if isinstance(functions, LocalTemplate):
            functions = functions.functions
        self._functions = dict(functions)
        self._handlers: dict[tuple[str, int], Callable[[Any, Any], Any]] = {}
        self._import_lock = threading.Lock()

    def function(self, name_or_arn: str) -> Function | None:
        """The function with this logical id, name or (possibly qualified) ARN."""
        if name_or_arn in self._functions:
            return self._functions[name_or_arn]
        for function in self._functions.values():
            if name_or_arn in (function.name, function.arn) or name_or_arn.startswith(function.arn + ":"):
                return function
        return None

    def handler(self, function: Function, environment: int = 0) -> Callable[[Any, Any], Any]:
        """The function's handler in execution environment ``environment``, imported on first use.

        Raises:
            TemplateError: the handler file or attribute does not exist.
        """
        with self._import_lock:
            found = self._handlers.get((function.logical_id, environment))
            if found is None:
                found = getattr(self._import(function, environment), function.handler_attribute, None)
                if not callable(found):
                    raise TemplateError(f"{function.logical_id}: {function.module_path} has no {function.handler}.")
                self._handlers[(function.logical_id, environment)] = found
            return found

    @staticmethod
    def _import(function: Function, environment: int) -> ModuleType:
        path = function.module_path
        if not path.is_file():
            raise TemplateError(f"{function.logical_id}: no handler file at {path}.")
        module_name = f"ferry_local_functions.{function.logical_id}"
        if environment:
            module_name += f"__environment{environment}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        sys.path.insert(0, str(function.code_dir))
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        finally:
            sys.path.remove(str(function.code_dir))
        return module

    def invoke_step(self, name_or_arn: str, event: Any) -> Invocation:
        """Run a function as Lambda's Invoke API does: once, or twice with :data:`INVOKE_TWICE_ENV` on.

        Twice means two invocations of the handler with equal events (each its own copy) and the
        second's outcome returned: what a workflow sees when Lambda ran a step but its answer was
        lost and the step was retried.

        Raises:
            TemplateError: no function has this name, or its handler cannot be found.
        """
        if switched_on(INVOKE_TWICE_ENV):
            first = self.invoke(name_or_arn, copy.deepcopy(event))
            log.info("%s invoked twice: first %s", first.function, "failed" if first.failed else "succeeded")
            return self.invoke(name_or_arn, copy.deepcopy(event))
        return self.invoke(name_or_arn, event)

    def invoke(
        self, name_or_arn: str, event: Any, *, request_id: str | None = None, environment: int = 0
    ) -> Invocation:
        """Run a function's handler on ``event`` in execution environment ``environment``; an
        exception becomes Lambda's error document.

        Raises:
            TemplateError: no function has this name, or its handler cannot be found.
        """
        function = self.function(name_or_arn)
        if function is None:
            raise TemplateError(f"No function {name_or_arn} in the template.")
        context = LambdaContext(function, request_id)
        handler = self.handler(function, environment)
        request_id = context.aws_request_id
        try:
            result = handler(event, context)
        except Exception as exc:
            log.info("%s raised %s: %s", function.name, type(exc).__name__, exc)
            return Invocation(function.name, request_id, error=error_document(exc, request_id))
        try:
            json.dumps(result)
        except (TypeError, ValueError) as exc:
            error = {"errorType": "Runtime.MarshalError", "errorMessage": f"Unable to marshal response: {exc}"}
            return Invocation(function.name, request_id, error=error)
        return Invocation(function.name, request_id, result=result)


# --- moto's Lambda backend, running real handlers -----------------------------------------------

_runner: FunctionRunner | None = None
_original_invoke: Callable[..., Any] | None = None


def _invoke_handler(
    self: Any, function_name: str, qualifier: str | None, body: Any, headers: Any, response_headers: Any
) -> bytes | None:
    """``LambdaSimpleBackend.invoke``, running the function's handler when the template has it."""
    runner = _runner
    fn = self.get_function(function_name, qualifier)  # raises moto's ResourceNotFound like Lambda
    function = runner.function(fn.function_name) if runner else None
    if function is None:
        assert _original_invoke is not None
        return _original_invoke(self, function_name, qualifier, body, headers, response_headers)
    if isinstance(body, bytes):
        body = body.decode()
    event = json.loads(body) if body else {}
    invocation_type = (headers or {}).get("X-Amz-Invocation-Type", "RequestResponse")
    if invocation_type == "DryRun":
        return b""
    if invocation_type == "Event":
        threading.Thread(target=runner.invoke_step, args=(function.name, event), daemon=True).start()  # type: ignore[union-attr]
        return b""
    invocation = runner.invoke_step(function.name, event)  # type: ignore[union-attr]
    if invocation.failed:
        response_headers["x-amz-function-error"] = "Unhandled"
    response_headers["x-amz-executed-version"] = "$LATEST"
    payload = invocation.payload()
    response_headers["Content-Length"] = str(len(payload))
    return payload


class ThreadMetricsProvider:
    """Powertools' EMF metrics provider, one per thread, behind the provider ``Metrics`` delegates to.

    On Lambda an environment runs one invocation at a time and Powertools keeps one metric set
    per process. The local stack runs every function's invocations on threads of one process,
    where that one set would mix them: a step's ``Step`` dimension overwritten by another's, one
    flushed line carrying several steps' durations. With this provider each thread adds to and
    flushes its own set. ``log_metrics`` decorates a handler once, at import, on whichever thread
    imported it, so the decorator picks the thread's provider at each call.
    """

    def __init__(self, namespace: str | None, service: str | None) -> None:
        self.namespace, self.service = namespace, service
        self._local = threading.local()

    def current(self) -> Any:
        """This thread's provider, made on the thread's first metric."""
        provider = getattr(self._local, "provider", None)
        if provider is None:
            from aws_lambda_powertools.metrics.provider.cloudwatch_emf.cloudwatch import (
                AmazonCloudWatchEMFProvider,
            )

            provider = self._local.provider = AmazonCloudWatchEMFProvider(namespace=self.namespace,
                                                                          service=self.service)
        return provider

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current(), name)

    def log_metrics(self, lambda_handler: Callable[..., Any] | None = None, **options: Any) -> Any:
        """Powertools' ``log_metrics``, flushing the metrics of the thread that runs the handler."""
        if lambda_handler is None:
            return lambda handler: self.log_metrics(handler, **options)
        handler = lambda_handler

        @functools.wraps(handler)
        def decorate(event: Any, context: Any, *args: Any, **kwargs: Any) -> Any:
            return self.current().log_metrics(handler, **options)(event, context, *args, **kwargs)

        return decorate


_shared_metrics_provider: Any = None


def isolate_metrics_per_thread() -> None:
    """Give ``ferry.observability.metrics`` a provider per thread (see :class:`ThreadMetricsProvider`)."""
    global _shared_metrics_provider
    from ferry.observability import metrics

    if not isinstance(metrics.provider, ThreadMetricsProvider):
        _shared_metrics_provider = metrics.provider
        metrics.provider = ThreadMetricsProvider(  # type: ignore[assignment]
            _shared_metrics_provider.namespace, _shared_metrics_provider.service)


def share_metrics_again() -> None:
    """Give ``ferry.observability.metrics`` back its one process-wide provider."""
    global _shared_metrics_provider
    from ferry.observability import metrics

    if _shared_metrics_provider is not None:
        metrics.provider = _shared_metrics_provider
        _shared_metrics_provider = None


def install_lambda_patch(runner: FunctionRunner) -> None:
    """Make moto's Docker-less Lambda run ``runner``'s handlers (process-wide until removed).

    The functions' metrics are kept per thread from then on (:func:`isolate_metrics_per_thread`).
    """
    global _runner, _original_invoke
    from moto.awslambda_simple.models import LambdaSimpleBackend

    isolate_metrics_per_thread()

    if _original_invoke is None:
        _original_invoke = LambdaSimpleBackend.invoke
        LambdaSimpleBackend.invoke = _invoke_handler  # type: ignore[method-assign]
    _runner = runner


def remove_lambda_patch() -> None:
    """Give moto its own ``invoke`` back, and the functions' metrics their one shared provider."""
    global _runner, _original_invoke
    from moto.awslambda_simple.models import LambdaSimpleBackend

    if _original_invoke is not None:
        LambdaSimpleBackend.invoke = _original_invoke  # type: ignore[method-assign]
    _original_invoke = None
    _runner = None
    share_metrics_again()


# --- fixes to moto's Step Functions, each as small as it can be --------------------------------

_moto_fixes: dict[tuple[Any, str], Any] = {}


def _sfn_send_task_failure(self: Any) -> Any:
    """SendTaskFailure keeping the ``cause`` (moto drops it; Ferry's faults are built from it)."""
    from moto.core.responses import EmptyResult

    self.stepfunction_backend.send_task_failure(
        self._get_param("taskToken"), error=self._get_param("error"), cause=self._get_param("cause")
    )
    return EmptyResult()


def _sfn_operation(service_action_name: str | None, task: Any) -> Any:
    import botocore.session

    action = task._get_boto_service_action(service_action_name)
    model = botocore.session.get_session().get_service_model("stepfunctions")
    name = next(op for op in model.operation_names if op.lower() == action.replace("_", ""))
    return model.operation_model(name)


def _sfn_task_parameters(original: Callable[..., None]) -> Callable[..., None]:
    def normalise(
        self: Any, parameters: dict, boto_service_name: str | None = None, service_action_name: str | None = None
    ) -> None:
        original(self, parameters, boto_service_name, service_action_name)
        # moto's copy never maps the ASL's "StateMachineArn" onto boto's "stateMachineArn".
        self._to_boto_request(parameters, _sfn_operation(service_action_name, self).input_shape)

    return normalise


def _sfn_task_response(
    self: Any, response: Any, boto_service_name: str | None = None, service_action_name: str | None = None
) -> None:
    # ...nor boto's "executionArn"/"output" back onto the ASL's "ExecutionArn"/"Output".
    self._from_boto_response(response, _sfn_operation(service_action_name, self).output_shape)


def _sfn_started_executions(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    def started(self: Any, execution_status: Any = None) -> list[Any]:
        # An execution being created has no worker yet (and no task token): moto's SendTask* would
        # fail on it with a 500 ('NoneType' object has no attribute 'callback_pool_manager').
        return [e for e in original(self, execution_status) if e.exec_worker is not None]

    return started


def _task_closed(callback_id: str) -> Exception:
    from moto.core.exceptions import AWSError

    # moto's own TaskTimedOut/TaskDoesNotExist cannot be raised (they lack the message AWSError needs).
    return AWSError(f"Task Timed Out: '{callback_id[:16]}...' does not exist anymore", exception_type="TaskTimedOut")


# The history a distributed Map's iterations write to, while its run lasts (see _sfn_map_run_history).
_map_run_history = threading.local()


def _sfn_map_run_history(eval_body: Callable[..., Any]) -> Callable[..., Any]:
    """A distributed Map run whose iterations' states land in the execution's own history.

    moto runs the iterations but hands them a history nobody can read; on AWS each is a child
    execution with its own. Kept in the parent's, as an inline Map's are, ``get_execution_history``
    shows every state a drain's iterations entered (what the fault sweep checks).
    """
    def run(self: Any, env: Any) -> Any:
        _map_run_history.manager = env.event_manager
        try:
            return eval_body(self, env)
        finally:
            _map_run_history.manager = None
    return run


def _sfn_iteration_history() -> Any:
    """The history a distributed Map run's iterations write to (the execution's own, see above)."""
    from moto.stepfunctions.parser.asl.eval.event.event_manager import EventManager

    manager = getattr(_map_run_history, "manager", None)
    return manager if manager is not None else EventManager()


def _sfn_notify_once(self: Any, callback_id: str, outcome: Any) -> bool:
    """``CallbackPoolManager.notify`` refusing an answer to a closed task with ``TaskTimedOut``, as Step Functions does.

    moto would accept a second answer silently (overwriting the first), and answer a task that
    timed out with a 500.
    """
    endpoint = self._pool.get(callback_id)
    if endpoint is None:
        return False
    if endpoint.consumer_error is not None or endpoint.get_outcome() is not None:
        raise _task_closed(callback_id)
    endpoint.notify(outcome=outcome)
    return True


def _sfn_heartbeat(self: Any, callback_id: str) -> bool:
    """``CallbackPoolManager.heartbeat``: an open task takes a heartbeat, a closed one answers ``TaskTimedOut``.

    moto sends a Task's SQS message before it sets up the task's heartbeat timer; a heartbeat in
    between (an agent checking at once whether the task is still awaited) found no timer and was
    refused with InvalidToken, and a closed task's heartbeat failed with a 500.
    """
    endpoint = self._pool.get(callback_id)
    if endpoint is None:
        return False
    if endpoint.consumer_error is not None or endpoint.get_outcome() is not None:
        raise _task_closed(callback_id)
    endpoint.notify_heartbeat()  # without a timer yet there is nothing to reset
    return True


def _is_host_operation(body: str) -> bool:
    try:
        message = json.loads(body)
    except ValueError:
        return False
    return isinstance(message, dict) and "operation" in message and "operation_id" in message


def _sqs_send_message(original: Callable[..., Any]) -> Callable[..., Any]:
    def send(self: Any, queue_name: str, message_body: str, *args: Any, **kwargs: Any) -> Any:
        sent = original(self, queue_name, message_body, *args, **kwargs)
        if switched_on(DUPLICATE_DELIVERY_ENV) and _is_host_operation(message_body):
            prefix = config.get().host_queue_prefix
            if not prefix or (queue_name.startswith(prefix) and not queue_name.endswith(protocol.DLQ_SUFFIX)):
                log.info("host operation message put on %s twice", queue_name)
                original(self, queue_name, message_body, *args, **kwargs)
        return sent

    return send


def _sfn_token_per_attempt(original: Callable[..., None]) -> Callable[..., None]:
    def evaluate(self: Any, env: Any) -> None:
        # Step Functions gives every attempt of a waitForTaskToken task its own token; moto keeps the
        # first one across Retry attempts, so a host answering the retried operation would answer
        # the attempt that already failed.
        data = env.states.context_object.context_object_data
        if "Task" in data and data.get("State", {}).get("RetryCount"):
            env.callback_pool_manager.add(env.states.context_object.update_task_token())
        original(self, env)

    return evaluate


def _sfn_close_timed_out_task(original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(self: Any, env: Any, timeout_seconds: int, callback_endpoint: Any, heartbeat_endpoint: Any) -> Any:
        from moto.stepfunctions.parser.asl.eval.callback.callback import (
            CallbackConsumerError,
            CallbackConsumerTimeout,
            CallbackOutcomeTimedOut,
        )

        outcome = original(self, env, timeout_seconds, callback_endpoint, heartbeat_endpoint)
        # Step Functions closes a task that timed out (no answer, or no heartbeat): a late heartbeat
        # or answer gets TaskTimedOut. moto would accept both until the execution ends.
        if isinstance(outcome, CallbackConsumerError):
            callback_endpoint.report(outcome)
        elif isinstance(outcome, CallbackOutcomeTimedOut):
            callback_endpoint.report(CallbackConsumerTimeout())
        return outcome

    return wait


def retry_scale() -> float:
    """:data:`RETRY_SCALE_ENV` as a number (1 when unset).

    Raises:
        LocalStackError: it is not a number at least 0.
    """
    value = os.environ.get(RETRY_SCALE_ENV) or "1"
    try:
        scale = float(value)
    except ValueError:
        scale = -1.0
    if not 0 <= scale < float("inf"):
        raise LocalStackError(f"{RETRY_SCALE_ENV} must be a number at least 0, not {value!r}.")
    return scale


class ScaledRetryClock:
    """The ``time`` module as moto's Retry evaluation sees it: its waits last :func:`retry_scale` times
    as long (end-to-end runs then spend seconds, not minutes, in backoff)."""

    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self._sleep = sleep

    def sleep(self, seconds: float) -> None:
        self._sleep(seconds * retry_scale())

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def moto_heartbeat_fixes() -> dict[tuple[Any, str], Any]:
    """The part of :func:`install_moto_fixes` an agent's heartbeats need, as ``{(owner, attribute): replacement}``.

    For harnesses that run moto without the rest of the fixes (the host agent's own tests): a
    task's heartbeat sent at once is taken (not refused as an unknown token), and answers and
    heartbeats do not fail while an execution is being created.
    """
    from moto.stepfunctions.parser.asl.eval.callback.callback import CallbackPoolManager
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend

    return {
        (StepFunctionsParserBackend, "_get_executions"): _sfn_started_executions(
            StepFunctionsParserBackend._get_executions
        ),
        (CallbackPoolManager, "heartbeat"): _sfn_heartbeat,
    }


def install_moto_fixes() -> None:
    """Patch what Ferry's workflows need and moto 5.2 gets wrong (process-wide until removed).

    * SendTaskFailure loses its ``cause``.
    * ``arn:aws:states:::states:startExecution(.sync|.sync:2)`` tasks fail with a KeyError: the
      Step Functions integration passes ASL-cased parameters to boto3 and reads boto-cased output.
    * SendTaskSuccess/Failure/Heartbeat fail with a 500 while any execution is being created or
      when the task timed out, and a second answer to a task that already has one is accepted
      (and overwrites it); Step Functions answers ``TaskTimedOut`` to a closed task.
    * A waitForTaskToken task keeps its token across Retry attempts (Step Functions issues a new one),
      and stays open after it timed out (Step Functions closes it).
    * A distributed Map's iterations write no readable history (on AWS: child executions); here
      they write to the execution's own, as an inline Map's do.

    Also the switch :data:`DUPLICATE_DELIVERY_ENV`, on SQS's SendMessage, and the factor
    :data:`RETRY_SCALE_ENV` on the waits between Retry attempts.
    """
    from moto.sqs.models import SQSBackend
    from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration import distributed_iteration_component
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_callback import (
        StateTaskServiceCallback,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_sfn import (
        StateTaskServiceSfn,
    )
    from moto.stepfunctions.parser.asl.eval.callback.callback import CallbackPoolManager
    from moto.stepfunctions.responses import StepFunctionResponse

    if _moto_fixes:
        return
    replacements = {
        (StepFunctionResponse, "send_task_failure"): _sfn_send_task_failure,
        (StateTaskServiceSfn, "_normalise_parameters"): _sfn_task_parameters(StateTaskServiceSfn._normalise_parameters),
        (StateTaskServiceSfn, "_normalise_response"): _sfn_task_response,
        **moto_heartbeat_fixes(),
        (CallbackPoolManager, "notify"): _sfn_notify_once,
        (SQSBackend, "send_message"): _sqs_send_message(SQSBackend.send_message),
        (StateTaskServiceCallback, "_eval_execution"): _sfn_token_per_attempt(StateTaskServiceCallback._eval_execution),
        (StateTaskServiceCallback, "_eval_wait_for_task_token"): _sfn_close_timed_out_task(
            StateTaskServiceCallback._eval_wait_for_task_token
        ),
        (retrier_decl, "time"): ScaledRetryClock(),
        (distributed_iteration_component.DistributedIterationComponent, "_eval_body"): _sfn_map_run_history(
            distributed_iteration_component.DistributedIterationComponent._eval_body
        ),
        (distributed_iteration_component, "EventManager"): _sfn_iteration_history,
    }
    for (owner, attribute), replacement in replacements.items():
        _moto_fixes[(owner, attribute)] = owner.__dict__.get(attribute)
        setattr(owner, attribute, replacement)


def remove_moto_fixes() -> None:
    """Undo :func:`install_moto_fixes`."""
    for (owner, attribute), original in _moto_fixes.items():
        if original is None:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, original)
    _moto_fixes.clear()


# --- the server -----------------------------------------------------------------------------------


_shared_session: boto3.session.Session | None = None
_session_lock = threading.Lock()


def _session() -> boto3.session.Session:
    # One session for the process: botocore then parses each service's model once, not per client.
    global _shared_session
    if _shared_session is None:
        _shared_session = boto3.session.Session()
    return _shared_session


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port(host: str, port: int, option: str = "--moto-port") -> None:
    """Refuse a port this process cannot listen on, before anything is started on the other.

    Raises:
        LocalStackError: the port is taken (or not ours to bind), or is no TCP port (outside
            0..65535); the message names ``option``, the command line's way to choose another.
    """
    if not 0 <= port <= 65535:
        raise LocalStackError(f"Port {port} is no TCP port: choose one from 1 to 65535 with {option} "
                              f"(0 picks a free one).")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise port_taken(host, port, exc, option) from exc


def port_taken(host: str, port: int, exc: OSError, option: str) -> LocalStackError:
    """The error for a port that could not be bound, with the option that picks another."""
    return LocalStackError(
        f"Port {host}:{port} is in use ({exc.strerror}): stop what listens there, or choose another "
        f"port with {option} (0 picks a free one)."
    )


class LocalAws:
    """moto on ``127.0.0.1:<port>`` in this process, running the template's handlers.

    ``start()`` resets moto's state, so the runtime begins empty; :mod:`ferry.local.provision`
    then creates the template's resources. Only one runtime per process: moto's backends and
    configuration are process-wide.

    Args:
        model: the resolved template (its functions' handlers and environment).
        port: the moto port; 0 picks a free one.
        host: the address to listen on.
        extra_environment: more variables for handlers (and anything else in this process).
    """

    def __init__(
        self,
        model: LocalTemplate,
        *,
        port: int = 4566,
        host: str = "127.0.0.1",
        extra_environment: Mapping[str, str] | None = None,
    ) -> None:
        self.model = model
        self.host = host
        self.port = port
        self.runner = FunctionRunner(model)
        self._extra = dict(extra_environment or {})
        self._server: Any = None
        self._clients: dict[tuple[str, str], Any] = {}
        self._saved_environ: dict[str, str | None] = {}
        self._saved_config: dict[str, Any] = {}

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def environment(self) -> dict[str, str]:
        """The variables the runtime sets: AWS endpoint, fake credentials, region, functions' environment."""
        return {
            **self.model.environment(),
            **self._extra,
            **FAKE_CREDENTIALS,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": self.model.region,
            "AWS_REGION": self.model.region,
            "MOTO_PORT": str(self.port),
        }

    def client(self, service: str) -> Any:
        """A boto3 client for ``service`` on this runtime (independent of ``os.environ``; cached)."""
        with _session_lock:
            key = (service, self.endpoint_url)
            found = self._clients.get(key)
            if found is None:
                found = _session().client(
                    service,
                    region_name=self.model.region,
                    endpoint_url=self.endpoint_url,
                    aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                    aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                    config=Config(retries={"max_attempts": 3, "mode": "standard"}),
                )
                self._clients[key] = found
            return found

    def start(self) -> LocalAws:
        """Start moto, configure it, install the Lambda patch and set the environment.

        Raises:
            LocalStackError: the port is taken, or :data:`RETRY_SCALE_ENV` is not a number at least 0.
            TemplateError: the functions' environments conflict.
        """
        from moto.core.config import default_user_config
        from moto.moto_api._internal.models import moto_api_backend
        from moto.server import ThreadedMotoServer

        self.model.environment()  # refuse conflicting function environments before starting anything
        retry_scale()  # and a retry scale that would fail an execution's first Retry
        if self.port:
            check_port(self.host, self.port)
        self._server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        if self.model.endpoint_url != self.endpoint_url:
            log.warning(
                "the template was resolved for %s, moto listens on %s", self.model.endpoint_url, self.endpoint_url
            )
        self._saved_config = {key: default_user_config.get(key) for key in MOTO_CONFIG}  # type: ignore[misc]
        moto_api_backend.reset()
        moto_api_backend.set_config(copy.deepcopy(MOTO_CONFIG))
        # The server's request log would print a line per AWS call.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        install_lambda_patch(self.runner)
        install_moto_fixes()
        values = self.environment()
        self._saved_environ = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        config.reset()
        aws.reset()
        log.info("moto listening on %s", self.endpoint_url)
        return self

    def stop(self) -> None:
        """Stop running executions, the server and the patch; restore the environment and moto's config."""
        from moto.core.config import default_user_config

        if self._server is None:
            return
        self._stop_executions()
        remove_lambda_patch()
        remove_moto_fixes()
        self._server.stop()
        self._server = None
        for key, value in self._saved_config.items():
            if value is not None:
                default_user_config[key] = value  # type: ignore[literal-required]
        for key, old in self._saved_environ.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        config.reset()
        aws.reset()

    def _stop_executions(self) -> None:
        """Abort executions still running so their worker threads stop calling a closing server."""
        try:
            sfn = self.client("stepfunctions")
            for machine in sfn.list_state_machines()["stateMachines"]:
                pages = sfn.get_paginator("list_executions").paginate(
                    stateMachineArn=machine["stateMachineArn"], statusFilter="RUNNING"
                )
                for page in pages:
                    for execution in page["executions"]:
                        sfn.stop_execution(executionArn=execution["executionArn"], cause="local stack stopping")
        except Exception:  # noqa: BLE001 - best effort while shutting down
            log.warning("could not stop running executions", exc_info=True)

    def __enter__(self) -> LocalAws:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
