"""Fault injection: fail a named workflow step or host operation on purpose.

Off unless ``FERRY_FAULT_INJECTION`` is set to a file path. The file holds JSON,
``{"<point>": {"mode": "once" | "always", "error": "<error name>"}}`` (``DiskCopyFailed``
or ``Ferry.DiskCopyFailed``); a point is a
Lambda step's name (``PrepResizeAtDest``); for a host operation, the name of the Task state that
sent it (``FinishResizeOnDestHost``, on any host), ``<host>:<operation>``
(``cell1-host2:finish_resize``), or ``*:<operation>`` for that operation on any host. A ``once``
fault disarms itself when it fires. Tests and drills arm faults with :func:`arm` and
:func:`disarm_all`; production deployments never set the variable, and then :func:`check` is
a dictionary look-up that returns.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ferry import errors

ENV_VAR = "FERRY_FAULT_INJECTION"
ONCE = "once"
ALWAYS = "always"


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


def arm(point: str, mode: str = ONCE, error: str = "InjectedFault") -> None:
    """Make ``point`` fail (``once`` or ``always``) with the typed error named ``error``."""
    path = _path()
    if path is None:
        raise errors.InvalidOperation(f"Fault injection is off: set {ENV_VAR} to a file path.")
    if mode not in (ONCE, ALWAYS):
        raise errors.InvalidOperation(f"Unknown fault mode {mode!r}: use {ONCE!r} or {ALWAYS!r}.")
    with _locked(path) as faults:
        faults[point] = {"mode": mode, "error": error}


def disarm_all() -> None:
    """Remove every armed fault."""
    path = _path()
    if path is not None:
        with _locked(path) as faults:
            faults.clear()


def check(*points: str) -> None:
    """Raise the armed error if any of ``points`` is armed (a ``once`` fault is used up).

    Raises:
        FerryError: the subclass named by the armed fault (``InjectedFault`` by default).
    """
    path = _path()
    if path is None or not path.exists():
        return
    fired: tuple[str, dict[str, Any]] | None = None
    with _locked(path) as faults:
        for point in points:
            if point in faults:
                fired = point, faults[point]
                if fired[1].get("mode") == ONCE:
                    del faults[point]
                break
    if fired is None:
        return
    point, fault = fired
    name = str(fault.get("error"))
    registry = errors.FerryError.registry
    error_class = registry.get(name) or registry.get(errors.PREFIX + name) or errors.InjectedFault
    raise error_class(f"Fault injected at {point}.")


def host_points(host: str, operation: str, operation_id: str = "") -> tuple[str, ...]:
    """The points a host operation checks: the Task state that sent it, this host's, and any host's.

    ``operation_id`` is ``<execution>/<state>/<host>`` as the state machines format it.
    """
    parts = operation_id.split("/")
    state = (parts[1],) if len(parts) == 3 and parts[1] else ()
    return (*state, f"{host}:{operation}", f"*:{operation}")
