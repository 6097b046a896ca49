"""Fault injection: fail a named workflow step or host operation on purpose, or make it time out.

Off unless ``FERRY_FAULT_INJECTION`` is set to a file path. The file holds JSON,
``{"<point>": {"mode": "once" | "always" | "timeout", "error": "<error name>"}}`` (``DiskCopyFailed``
or ``Ferry.DiskCopyFailed``); a point is a
Lambda step's name (``PrepResizeAtDest``); for a host operation, the name of the Task state that
sent it (``FinishResizeOnDestHost``, on any host), ``<host>:<operation>``
(``cell1-host2:finish_resize``), or ``*:<operation>`` for that operation on any host. A ``once``
fault disarms itself when it fires. Tests and drills arm faults with :func:`arm` and
:func:`disarm_all`; production deployments never set the variable, and then :func:`check` is
a dictionary look-up that returns.

A ``timeout`` fault makes the first step or operation that reaches its point time out instead of
failing; later ones at that point pass, until the point is armed again:

* A Lambda step raises :class:`InjectedTimeout`, whose class name is ``Sandbox.Timedout``: the
  ``errorType`` AWS Lambda reports when a function runs past its configured timeout, and so the
  error a Task state with a Lambda function's ARN sees. No ``Retry`` of Ferry's state machines
  names it (they retry ``Lambda.ServiceException`` and the like), so it goes to the ``Catch``
  (``States.ALL``) and the workflow rolls back, as on AWS. The step's own work does not run: the
  fault models a function stuck before it changed anything.
* The host agent takes the operation's message and holds it without an answer, a failure or a
  task heartbeat, so the Task state times out through its ``HeartbeatSeconds`` (or
  ``TimeoutSeconds``) with ``States.Timeout``. The hold is the host being away: it lasts until the
  fault is disarmed (or re-armed), or ``hold_seconds`` after it fired if it was armed with them;
  then the host "comes back" and the agent takes the message again like any other, and finds out
  that the workflow no longer waits for it (see :mod:`hostagent.agent`).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ferry import errors

ENV_VAR = "FERRY_FAULT_INJECTION"
ONCE = "once"
ALWAYS = "always"
TIMEOUT = "timeout"
MODES = (ONCE, ALWAYS, TIMEOUT)
# What AWS Lambda names the error of an invocation that ran past the function's timeout.
LAMBDA_TIMEOUT_ERROR = "Sandbox.Timedout"


class InjectedTimeout(Exception):
    """A point armed with :data:`TIMEOUT` fired: the step or operation times out.

    Not a :class:`ferry.errors.FerryError`: on AWS the error comes from Lambda, not from Ferry. Its
    class name is :data:`LAMBDA_TIMEOUT_ERROR`, which the local stack (like Lambda) reports as the
    invocation's ``errorType``.

    Attributes:
        point: the armed point that fired.
        fired_id: identifies this firing, for :func:`holding`.
    """

    def __init__(self, point: str, fired_id: str) -> None:
        self.point = point
        self.fired_id = fired_id
        super().__init__(f"Task timed out: fault injected at {point}.")


InjectedTimeout.__name__ = InjectedTimeout.__qualname__ = LAMBDA_TIMEOUT_ERROR


def _path() -> Path | None:
    raw = os.environ.get(ENV_VAR)
    return Path(raw) if raw else None


@contextmanager
def _locked(path: Path) -> Iterator[dict[str, Any]]:
    """The armed faults, read and written back under an exclusive lock (processes share the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(path.suffix + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            faults = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
            yield faults
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(faults))
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def arm(point: str, mode: str = ONCE, error: str = "InjectedFault", *, hold_seconds: float | None = None) -> None:
    """Make ``point`` fail (``once`` or ``always``) with the typed error named ``error``, or time out.

    Args:
        point: where (see the module's docstring).
        mode: :data:`ONCE`, :data:`ALWAYS` or :data:`TIMEOUT` (``error`` is then not used).
        error: the typed error a failure raises.
        hold_seconds: for :data:`TIMEOUT` only: a held host operation is let go this long after the
            fault fired even if it is still armed (default: only when disarmed).

    Raises:
        InvalidOperation: fault injection is off, or an unknown mode.
    """
    path = _path()
    if path is None:
        raise errors.InvalidOperation(f"Fault injection is off: set {ENV_VAR} to a file path.")
    if mode not in MODES:
        raise errors.InvalidOperation(f"Unknown fault mode {mode!r}: use one of {', '.join(map(repr, MODES))}.")
    fault: dict[str, Any] = {"mode": mode, "error": error}
    if mode == TIMEOUT and hold_seconds is not None:
        fault["hold_seconds"] = float(hold_seconds)
    with _locked(path) as faults:
        faults[point] = fault


def disarm(point: str) -> None:
    """Remove the fault armed at ``point``, if any (a host operation it holds is let go)."""
    path = _path()
    if path is not None:
        with _locked(path) as faults:
            faults.pop(point, None)


def disarm_all() -> None:
    """Remove every armed fault (host operations held by timeouts are let go)."""
    path = _path()
    if path is not None:
        with _locked(path) as faults:
            faults.clear()


def _fire(points: tuple[str, ...], modes: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """The first armed fault of ``modes`` among ``points``, marked as fired (a ``once`` fault removed)."""
    path = _path()
    if path is None or not path.exists():
        return None
    with _locked(path) as faults:
        for point in points:
            fault = faults.get(point)
            if fault is None or fault.get("mode") not in modes:
                continue
            if fault.get("mode") == TIMEOUT:
                if "fired_id" in fault:
                    continue  # it holds another operation already; this one passes
                fault.update(fired_id=uuid.uuid4().hex, fired_at=time.time())
                return point, dict(fault)
            if fault.get("mode") == ONCE:
                del faults[point]
            return point, fault
    return None


def check(*points: str) -> None:
    """Raise the armed error if any of ``points`` is armed (a ``once`` fault is used up).

    Raises:
        InjectedTimeout: a :data:`TIMEOUT` fault fired.
        FerryError: the subclass named by the armed fault (``InjectedFault`` by default).
    """
    fired = _fire(points, MODES)
    if fired is None:
        return
    point, fault = fired
    if fault.get("mode") == TIMEOUT:
        raise InjectedTimeout(point, str(fault["fired_id"]))
    name = str(fault.get("error"))
    registry = errors.FerryError.registry
    error_class = registry.get(name) or registry.get(errors.PREFIX + name) or errors.InjectedFault
    raise error_class(f"Fault injected at {point}.")


def check_timeout(*points: str) -> None:
    """Like :func:`check`, for :data:`TIMEOUT` faults only (the others stay armed for :func:`check`).

    Raises:
        InjectedTimeout: a timeout fault fired.
    """
    fired = _fire(points, (TIMEOUT,))
    if fired is not None:
        point, fault = fired
        raise InjectedTimeout(point, str(fault["fired_id"]))


def holding(timeout: InjectedTimeout) -> bool:
    """Whether the timeout fault that raised ``timeout`` still holds its operation.

    False once its point is disarmed or armed again, or ``hold_seconds`` after it fired.
    """
    path = _path()
    if path is None or not path.exists():
        return False
    with _locked(path) as faults:
        fault = faults.get(timeout.point)
        if not fault or fault.get("fired_id") != timeout.fired_id:
            return False
        hold_seconds = fault.get("hold_seconds")
        return hold_seconds is None or time.time() < float(fault.get("fired_at", 0)) + float(hold_seconds)


def host_points(host: str, operation: str, operation_id: str = "") -> tuple[str, ...]:
    """The points a host operation checks: the Task state that sent it, this host's, and any host's.

    ``operation_id`` is ``<execution>/<state>/<host>`` as the state machines format it.
    """
    parts = operation_id.split("/")
    state = (parts[1],) if len(parts) == 3 and parts[1] else ()
    return (*state, f"{host}:{operation}", f"*:{operation}")
