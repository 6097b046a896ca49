"""``ferry drain …``: empty a host or a cell, and follow the drain, through the compute API.

Unlike ``ferry audit``, this command does not read the store: it talks to the compute API as the
``openstack`` CLI does, with the same ``clouds.yaml`` (``--os-cloud``, default ``$OS_CLOUD``), so
it needs an admin's credentials and none of the control plane's settings. Requests go through
openstacksdk's compute proxy, which prefixes the compute endpoint: ``{compute}/ferry/drains…``.
docs/drains.md describes the routes, the drain's view and what each status means.

Exit statuses: 0 success; 1 an error answer, a drain that ended ``failed`` or ``cancelled``, or a
dry run whose plan would be refused; 2 bad usage; 130 when ``watch`` is interrupted (the drain
goes on).
"""

from __future__ import annotations

import argparse
import datetime as dt
import http
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TextIO

from ferry import arguments

DRAINS = "/ferry/drains"
STATUSES = ("planning", "planned", "running", "paused", "cancelling", "cancelled", "completed", "failed")
# A drain in one of these changes no more: ``watch`` returns. ``planned`` is a dry run's end.
FINAL_STATUSES = frozenset({"planned", "completed", "failed", "cancelled"})
COUNTS = ("total", "done", "failed", "in_progress", "left", "cancelled", "unplaceable", "gone")
ACTIONS = ("pause", "resume", "cancel")
DEFAULT_INTERVAL = 2.0
# Consecutive 5xx answers or connection failures ``watch`` rides out before it gives up.
WATCH_TRANSIENT_LIMIT = 5
BAR_WIDTH = 24


class Response(Protocol):
    """What the compute proxy answers (a ``requests.Response``)."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


class ComputeProxy(Protocol):
    """The part of openstacksdk's compute proxy this command uses."""

    def get(self, url: str, **kwargs: Any) -> Response: ...

    def post(self, url: str, **kwargs: Any) -> Response: ...


class Connection(Protocol):
    """An ``openstack.connection.Connection``, or a test's stand-in."""

    @property
    def compute(self) -> ComputeProxy: ...


class DrainError(Exception):
    """Ends the command with a one-line message for the operator (exit status 1).

    ``status`` is the HTTP status of an error answer (None when no answer came); ``transient``
    says a later try may succeed (5xx, 429, the connection failed), which ``watch`` rides out.
    """

    def __init__(self, message: str, *, status: int | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.transient = transient


# --- talking to the API -------------------------------------------------------------------------


def connect(cloud: str | None) -> Connection:
    """The openstacksdk connection for ``cloud`` from clouds.yaml (None: ``$OS_CLOUD``/``OS_*``).

    Raises:
        DrainError: openstacksdk is not installed, or the cloud is not configured (unknown, or
            lacking what its authentication needs, such as ``auth_url``).
    """
    try:
        import openstack
        from keystoneauth1 import exceptions as ksa
    except ImportError as exc:
        raise DrainError("ferry drain needs openstacksdk: install Ferry's wheel with its admin extra, "
                         "'<wheel>[admin]' (docs/installation.md)") from exc
    try:
        return openstack.connect(cloud=cloud)
    except (openstack.exceptions.SDKException, ksa.ClientException) as exc:
        if cloud is None:
            raise DrainError(f"no cloud given (--os-cloud, or OS_CLOUD) and the OS_* variables are not enough: "
                             f"{exc}") from exc
        raise DrainError(f"cannot use cloud {cloud}: {exc}") from exc


def _client_errors() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """(errors worth another try, every client error) of keystoneauth and openstacksdk."""
    try:
        from keystoneauth1 import exceptions as ksa
        from openstack import exceptions as sdk
    except ImportError:
        return (), ()
    return (ksa.ConnectionError,), (ksa.ClientException, sdk.SDKException)


def describe_error(status: int, document: Any, text: str = "") -> str:
    """One line for an error answer: ``HTTP 409 Conflict: <the fault's message>``.

    ``document`` is the decoded body: Nova's fault shape ``{"<kind>": {"code", "message"}}`` (any
    kind), or ``{"message": …}`` as gateways answer; otherwise the first line of ``text``.
    """
    try:
        head = f"HTTP {status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        head = f"HTTP {status}"
    message = None
    if isinstance(document, Mapping):
        if isinstance(document.get("message"), str):
            message = document["message"]
        else:
            for fault in document.values():
                if isinstance(fault, Mapping) and isinstance(fault.get("message"), str):
                    message = fault["message"]
                    break
    if message is None and text.strip():
        message = text.strip().splitlines()[0][:200]
    return f"{head}: {message}" if message else head


def _request(conn: Connection, method: str, path: str, body: Any = None) -> dict[str, Any]:
    """``method path`` on the compute endpoint; the decoded JSON answer.

    Raises:
        DrainError: an error answer, an answer that is not a JSON object, or no answer.
    """
    retryable, client_errors = _client_errors()
    kwargs: dict[str, Any] = {"raise_exc": False}
    if body is not None:
        kwargs["json"] = body
    try:
        # The proxy itself is made on first use, which authenticates and looks the compute
        # endpoint up: an identity endpoint out of reach fails here.
        compute = conn.compute
        response = (compute.post if method == "POST" else compute.get)(path, **kwargs)
    except client_errors as exc:
        raise DrainError(f"{method} {path}: {exc}", transient=isinstance(exc, retryable)) from exc
    status = response.status_code
    try:
        document = response.json()
    except ValueError:
        document = None
    if status >= 400:
        raise DrainError(describe_error(status, document, response.text or ""), status=status,
                         transient=status >= 500 or status == 429)
    if not isinstance(document, dict):
        raise DrainError(f"HTTP {status}: {method} {path} answered no JSON document")
    return document


def _drain_path(drain_id: str) -> str:
    return f"{DRAINS}/{urllib.parse.quote(drain_id, safe='')}"


def _the_drain(document: dict[str, Any]) -> dict[str, Any]:
    view = document.get("drain")
    if not isinstance(view, dict):
        raise DrainError("the answer has no drain in it")
    return view


def get_drain(conn: Connection, drain_id: str) -> dict[str, Any]:
    """The drain's view, with its servers."""
    return _the_drain(_request(conn, "GET", _drain_path(drain_id)))


# --- the request a start sends ------------------------------------------------------------------


def drain_request(args: argparse.Namespace) -> dict[str, Any]:
    """The body of ``POST /ferry/drains`` for the parsed ``start`` arguments.

    Only what the operator gave is sent, so the API's defaults apply to the rest. One ``--host``
    is ``host``, several are ``hosts`` (each once, in order).
    """
    drain: dict[str, Any] = {}
    if args.cell is not None:
        drain["cell"] = args.cell
    else:
        hosts = list(dict.fromkeys(args.host))
        if len(hosts) == 1:
            drain["host"] = hosts[0]
        else:
            drain["hosts"] = hosts
    if args.reason is not None:
        drain["reason"] = args.reason
    if args.dry_run:
        drain["dry_run"] = True
    for key in ("max_concurrency", "max_per_source_host", "max_per_dest_host", "retries", "callback_url"):
        value = getattr(args, key)
        if value is not None:
            drain[key] = value
    if args.no_confirm:
        drain["confirm"] = False
    if args.move_what_fits:
        drain["move_what_fits"] = True
    return {"drain": drain}


# --- rendering ----------------------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    """``45s``, ``6m 05s``, ``2h 03m``, ``1d 04h``; ``--`` when unknown."""
    if seconds is None:
        return "--"
    left = max(0, round(seconds))
    if left < 60:
        return f"{left}s"
    minutes, secs = divmod(left, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def _counts(view: Mapping[str, Any]) -> dict[str, int]:
    counts = view.get("counts") or {}
    return {key: int(counts.get(key) or 0) for key in COUNTS}


def settled(counts: Mapping[str, int]) -> int:
    """Servers whose fate is decided: done, failed, cancelled, unplaceable or gone (deleted during the drain)."""
    return sum(counts.get(key, 0) for key in ("done", "failed", "cancelled", "unplaceable", "gone"))


def settled_percent(counts: Mapping[str, int]) -> int:
    """How much of the drain is settled (see :func:`settled`), floored: 100 only when every server
    is. An empty drain is 100."""
    total = counts.get("total", 0)
    if total <= 0:
        return 100
    return max(0, min(100, settled(counts) * 100 // total))


def progress_line(view: Mapping[str, Any], *, bar: bool = True, width: int = BAR_WIDTH) -> str:
    """One line of progress: status, bar, percentage, done/failed of total, in progress, ETA.

    ``running  [######..................]  25%  10 done, 1 failed of 44, 3 in progress  ETA 6m 05s``
    """
    counts = _counts(view)
    status = view.get("status") or "?"
    if status == "planning" and not counts["total"]:
        # Nothing is planned yet: an empty drain would read 100%.
        return "  ".join([status, *(["[" + "." * width + "]"] if bar else []), "  0%",
                          "finding a destination for every server"])
    percent = settled_percent(counts)
    parts = [status]
    if bar:
        total = counts["total"]
        filled = max(0, min(width, width * settled(counts) // total)) if total > 0 else width
        parts.append("[" + "#" * filled + "." * (width - filled) + "]")
    parts.append(f"{percent:3d}%")
    summary = f"{counts['done']} done, {counts['failed']} failed of {counts['total']}"
    if counts["in_progress"] or status not in FINAL_STATUSES:
        summary += f", {counts['in_progress']} in progress"
    for key in ("unplaceable", "cancelled", "gone"):
        if counts[key]:
            summary += f", {counts[key]} {key}"
    parts.append(summary)
    if status not in FINAL_STATUSES:
        parts.append(f"ETA {format_duration(view.get('eta_seconds'))}")
    return "  ".join(parts)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart; the last column is not padded."""
    widths = [max([len(header), *(len(row[i]) for row in rows)]) for i, header in enumerate(headers)]
    lines = []
    for row in [list(headers), *rows]:
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return lines


def _text(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _target(view: Mapping[str, Any]) -> str:
    target = view.get("target") or {}
    names = ", ".join(str(name) for name in target.get("names") or [])
    return f"{target.get('kind') or '?'} {names}".strip()


def _unplaceable_reasons(view: Mapping[str, Any]) -> dict[str, str]:
    plan = view.get("plan") or {}
    return {str(item.get("id")): _text(item.get("reason")) for item in plan.get("unplaceable") or []}


def render_plan(view: Mapping[str, Any]) -> str:
    """A dry run's plan: each server's source and planned host (or why it cannot be placed), and
    whether the plan fits."""
    servers = list(view.get("servers") or [])
    reasons = _unplaceable_reasons(view)
    unplaceable = (view.get("plan") or {}).get("unplaceable") or []
    known = {str(server.get("id")) for server in servers}
    servers += [{"id": item.get("id"), "name": item.get("name"), "state": "unplaceable"}
                for item in unplaceable if str(item.get("id")) not in known]
    lines = [f"Plan of drain {view.get('id')} ({_target(view)}): {len(servers)} server(s)"
             + (", dry run: nothing moved" if view.get("dry_run") else "")]
    if servers:
        rows = []
        for server in servers:
            source = _text(server.get("source_host"))
            if server.get("planned_host") and str(server.get("id")) not in reasons:
                where = f"{source} → {server['planned_host']}"
            else:
                reason = reasons.get(str(server.get("id"))) or _text(server.get("error"))
                where = f"{source} → cannot be placed: {reason}"
            rows.append([_text(server.get("name")), _text(server.get("id")), where])
        lines += [""] + _table(["SERVER", "ID", "SOURCE → PLANNED HOST"], rows) + [""]
    options = view.get("options") or {}
    fits = (view.get("plan") or {}).get("fits")
    if fits:
        lines.append("The plan fits: every server has a destination.")
    else:
        placeable = len(servers) - len(unplaceable)
        lines.append(f"The plan does not fit: {len(unplaceable)} of {len(servers)} server(s) cannot be placed.")
        if not placeable:
            lines.append("No server can be placed: a drain would move nothing.")
        elif options.get("move_what_fits"):
            lines.append(f"With move_what_fits the drain moves the {placeable} that can be placed and reports "
                         "the others.")
        else:
            lines.append(f"A drain with these options changes nothing; --move-what-fits moves the {placeable} "
                         "that can be placed and reports the others.")
    return "\n".join(lines)


def _options_line(options: Mapping[str, Any]) -> str:
    def limit(value: Any) -> str:
        return "no limit" if value is None else str(value)

    parts = [f"max concurrency {_text(options.get('max_concurrency'))}",
             f"per source host {limit(options.get('max_per_source_host'))}",
             f"per destination host {limit(options.get('max_per_dest_host'))}",
             "confirm" if options.get("confirm", True) else "no confirm (servers stay in VERIFY_RESIZE)",
             f"move what fits {'yes' if options.get('move_what_fits') else 'no'}",
             f"retries {_text(options.get('retries'))}"]
    if options.get("callback_url"):
        parts.append(f"callback {options['callback_url']}")
    return ", ".join(parts)


def render_view(view: Mapping[str, Any]) -> str:
    """``ferry drain show``: the drain's fields, progress, and one row per server."""
    if view.get("status") == "planned":
        return render_plan(view)
    fields: list[tuple[str, str]] = [
        ("target", _target(view)),
        ("reason", _text(view.get("reason"))),
        ("options", _options_line(view.get("options") or {})),
        ("progress", progress_line(view)),
        ("created", _text(view.get("created_at"))),
        ("started", _text(view.get("started_at"))),
        ("finished", _text(view.get("finished_at"))),
    ]
    if view.get("status") not in FINAL_STATUSES:
        fields.append(("eta", f"{_text(view.get('eta'))} (in {format_duration(view.get('eta_seconds'))})"))
    fields.append(("average move", format_duration(view.get("average_move_seconds"))))
    plan = view.get("plan") or {}
    if plan.get("unplaceable"):
        fields.append(("plan", f"does not fit: {len(plan['unplaceable'])} server(s) cannot be placed"))
    if view.get("message"):
        fields.append(("message", str(view["message"])))
    if view.get("disabled_hosts"):
        fields.append(("disabled", ", ".join(str(host) for host in view["disabled_hosts"])))
    lines = [f"Drain {view.get('id')}  {view.get('status')}"]
    lines += [f"  {name:<13}{value}" for name, value in fields]
    servers = view.get("servers") or []
    if servers:
        reasons = _unplaceable_reasons(view)
        rows = []
        for server in servers:
            if server.get("dest_host"):
                destination = str(server["dest_host"])
            elif server.get("planned_host") and server.get("state") != "gone":  # a deleted server goes nowhere
                destination = f"{server['planned_host']} (planned)"
            else:
                destination = "-"
            error = server.get("error") or reasons.get(str(server.get("id")))
            rows.append([_text(server.get("name")), _text(server.get("id")), _text(server.get("source_host")),
                         destination, _text(server.get("state")), _text(server.get("attempts")), _text(error)])
        lines += [""] + _table(["SERVER", "ID", "SOURCE", "DESTINATION", "STATE", "ATTEMPTS", "ERROR"], rows)
    return "\n".join(lines)


def render_list(views: Sequence[Mapping[str, Any]]) -> str:
    """``ferry drain list``: one row per drain, newest first as the API gives them."""
    if not views:
        return "No drains."
    rows = []
    for view in views:
        counts = _counts(view)
        rows.append([_text(view.get("id")), _text(view.get("status")), _target(view),
                     f"{counts['done']}/{counts['total']}", str(counts["failed"]),
                     _text(view.get("created_at")), _text(view.get("reason"))])
    return "\n".join(_table(["ID", "STATUS", "TARGET", "DONE", "FAILED", "CREATED", "REASON"], rows))


def _elapsed(view: Mapping[str, Any]) -> float | None:
    try:
        started = dt.datetime.fromisoformat(str(view["started_at"]))
        finished = dt.datetime.fromisoformat(str(view["finished_at"]))
    except (KeyError, TypeError, ValueError):
        return None
    if (started.tzinfo is None) != (finished.tzinfo is None):
        return None
    return (finished - started).total_seconds()


def render_summary(view: Mapping[str, Any]) -> str:
    """What ``watch`` prints at the end: the outcome, the counts, each server that failed, and each
    server deleted during the drain (``gone``)."""
    counts = _counts(view)
    took = _elapsed(view)
    line = (f"Drain {view.get('id')} {view.get('status')}: {counts['done']} done, {counts['failed']} failed, "
            f"{counts['cancelled']} cancelled, {counts['unplaceable']} unplaceable"
            + (f", {counts['gone']} gone" if counts["gone"] else "") + f" of {counts['total']}")
    if took is not None:
        line += f" in {format_duration(took)}"
    lines = [line + "."]
    if view.get("message"):
        lines.append(str(view["message"]))
    for server in view.get("servers") or []:
        if server.get("state") == "failed":
            lines.append(f"  failed: {_text(server.get('name'))} ({server.get('id')}) on "
                         f"{_text(server.get('source_host'))}: {_text(server.get('error'))}")
        elif server.get("state") == "gone":
            lines.append(f"  gone: {_text(server.get('name'))} ({server.get('id')}) was on "
                         f"{_text(server.get('source_host'))}: deleted during the drain")
    return "\n".join(lines)


def exit_status(view: Mapping[str, Any]) -> int:
    """0 for a completed drain, or a dry run whose plan fits (or that moves what fits); else 1."""
    status = view.get("status")
    if status == "completed":
        return 0
    if status == "planned":
        fits = bool((view.get("plan") or {}).get("fits"))
        return 0 if fits or (view.get("options") or {}).get("move_what_fits") else 1
    return 1


# --- watch --------------------------------------------------------------------------------------


def _server_event(server: Mapping[str, Any]) -> str:
    name = f"{_text(server.get('name'))} ({server.get('id')})"
    state = server.get("state")
    source = _text(server.get("source_host"))
    if state == "moving":
        attempt = int(server.get("attempts") or 0)
        again = f", attempt {attempt}" if attempt > 1 else ""
        return f"{name}: moving {source} → {_text(server.get('dest_host') or server.get('planned_host'))}{again}"
    if state == "done":
        return f"{name}: done, now on {_text(server.get('dest_host'))}"
    if state == "failed":
        dest = server.get("dest_host")
        where = f"now on {_text(dest)}" if dest and dest != server.get("source_host") else f"back on {source}"
        return f"{name}: failed after {_text(server.get('attempts'))} attempt(s), {where}: " \
               f"{_text(server.get('error'))}"
    if state == "gone":  # deleted: on no host any more, neither moved nor back on its source
        return f"{name}: gone, deleted during the drain (it was on {source})"
    if state == "pending" and server.get("error"):
        return f"{name}: will be tried again after: {server['error']}"
    return f"{name}: {state}" + (f": {server['error']}" if server.get("error") else "")


def _server_changes(before: Mapping[str, str] | None, view: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The servers' states now, and a line for each server whose state changed since ``before``.

    The first look only sets the baseline; a server seen for the first time (the plan was just
    made) is announced unless it is merely pending.
    """
    now: dict[str, str] = {}
    events = []
    for server in view.get("servers") or []:
        key, state = str(server.get("id")), str(server.get("state"))
        now[key] = state
        if before is None or before.get(key) == state or (key not in before and state == "pending"):
            continue
        events.append(_server_event(server))
    return now, events


def watch(conn: Connection, drain_id: str, *, interval: float = DEFAULT_INTERVAL, out: TextIO | None = None,
          tty: bool | None = None, sleep: Callable[[float], object] = time.sleep) -> int:
    """Follow a drain until its status is final; returns :func:`exit_status` of its last view.

    On a terminal ``out`` one progress line is redrawn in place, with a line above it for each
    server that changes state; otherwise a progress line is printed whenever the status or the
    counts change. Up to :data:`WATCH_TRANSIENT_LIMIT` consecutive transient failures are retried.

    Raises:
        DrainError: an error answer, or too many transient failures in a row.
    """
    out = sys.stdout if out is None else out
    tty = out.isatty() if tty is None else tty
    states: dict[str, str] | None = None
    last_key: tuple[Any, ...] | None = None
    failures = 0
    while True:
        try:
            view = get_drain(conn, drain_id)
        except DrainError as exc:
            failures += 1
            if not exc.transient or failures > WATCH_TRANSIENT_LIMIT:
                if tty:
                    out.write("\n")
                raise
            out.write(("\r\x1b[K" if tty else "") + f"retrying ({failures}/{WATCH_TRANSIENT_LIMIT}): {exc}\n")
            sleep(interval)
            continue
        failures = 0
        states, events = _server_changes(states, view)
        if tty:
            for event in events:
                out.write(f"\r\x1b[K{event}\n")
            out.write(f"\r\x1b[K{progress_line(view)}")
        else:
            for event in events:
                out.write(event + "\n")
            counts = _counts(view)
            key = (view.get("status"), *(counts[name] for name in COUNTS))
            if key != last_key:
                stamp = f"{view['updated_at']}  " if view.get("updated_at") else ""
                out.write(stamp + progress_line(view, bar=False) + "\n")
                last_key = key
        out.flush()
        if view.get("status") in FINAL_STATUSES:
            if tty:
                out.write("\n")
            out.write(render_summary(view) + "\n")
            out.flush()
            return exit_status(view)
        sleep(interval)


# --- the subcommands ----------------------------------------------------------------------------


def _print_json(document: Any) -> None:
    print(json.dumps(document, indent=2, sort_keys=True))


def _start(conn: Connection, args: argparse.Namespace) -> int:
    document = _request(conn, "POST", DRAINS, drain_request(args))
    view = _the_drain(document)
    if args.json:
        _print_json(document)
        return exit_status(view) if view.get("status") in ("planned", "failed", "cancelled") else 0
    if view.get("status") == "planned":
        print(render_plan(view))
        return exit_status(view)
    counts = _counts(view)
    if view.get("status") == "planning" and not counts["total"]:
        print(f"Drain {view.get('id')} planning: {_target(view)}.")
    else:
        print(f"Drain {view.get('id')} {view.get('status')}: {_target(view)}, {counts['total']} server(s).")
    if view.get("message"):
        print(view["message"])
    reasons = _unplaceable_reasons(view)
    for server_id, reason in reasons.items():
        print(f"  cannot be placed, left where it is: {server_id}: {reason}")
    if view.get("status") in ("failed", "cancelled"):
        return 1
    if args.watch:
        return _watch_to_the_end(conn, str(view.get("id")), args.interval)
    print(f"Follow it with: ferry drain watch {view.get('id')}")
    return 0


def _list(conn: Connection, args: argparse.Namespace) -> int:
    path = DRAINS + (f"?{urllib.parse.urlencode({'status': args.status})}" if args.status else "")
    document = _request(conn, "GET", path)
    if args.json:
        _print_json(document)
        return 0
    views = document.get("drains")
    if not isinstance(views, list):
        raise DrainError("the answer has no list of drains in it")
    print(render_list(views))
    return 0


def _show(conn: Connection, args: argparse.Namespace) -> int:
    document = _request(conn, "GET", _drain_path(args.drain_id))
    if args.json:
        _print_json(document)
    else:
        print(render_view(_the_drain(document)))
    return 0


def _watch(conn: Connection, args: argparse.Namespace) -> int:
    return _watch_to_the_end(conn, args.drain_id, args.interval)


def _watch_to_the_end(conn: Connection, drain_id: str, interval: float) -> int:
    """Watch the drain until it ends; Ctrl-C stops watching, never the drain."""
    try:
        return watch(conn, drain_id, interval=interval)
    except KeyboardInterrupt:
        print(f"\nStopped watching; the drain goes on (ferry drain watch {drain_id}).")
        return 130


_AFTER_ACTION = {
    "pause": "No new moves start; the {n} in progress finish. Resume with: ferry drain resume {id}",
    "resume": "Moves start again.",
    "cancel": "No new moves start; the {n} in progress finish, then the drain reports.",
}


def _action(conn: Connection, args: argparse.Namespace) -> int:
    document = _request(conn, "POST", f"{_drain_path(args.drain_id)}/action", {args.action: None})
    if args.json:
        _print_json(document)
        return 0
    view = _the_drain(document)
    counts = _counts(view)
    print(f"Drain {view.get('id')} {view.get('status')}: {counts['done']} done, {counts['failed']} failed "
          f"of {counts['total']}, {counts['in_progress']} in progress.")
    print(_AFTER_ACTION[args.action].format(n=counts["in_progress"], id=view.get("id")))
    return 0


def _handler(run: Callable[[Connection, argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A ``ferry`` handler: makes the connection, runs ``run``, turns a DrainError into exit 1."""

    def handle(args: argparse.Namespace) -> int:
        try:
            return run(connect(args.os_cloud), args)
        except DrainError as exc:
            print(f"ferry drain: {exc}", file=sys.stderr)
            return 1
        except BrokenPipeError:
            # The reader left (``ferry drain list | head``): nothing more to say, even at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    return handle


# --- the parser ---------------------------------------------------------------------------------


def add_drain(commands: Any) -> None:
    """Add ``ferry drain`` and its subcommands to ``commands`` (the ``ferry`` sub-parsers)."""
    parser = commands.add_parser(
        "drain", help="empty a host or a cell: cold-migrate every server away, and follow it",
        description="Start, follow, pause, resume and cancel drains through the compute API (admin only), "
                    "with the openstack CLI's clouds.yaml. See docs/drains.md.")
    sub = parser.add_subparsers(dest="drain_command", metavar="<subcommand>", required=True)
    cloud = argparse.ArgumentParser(add_help=False)
    cloud.add_argument("--os-cloud", default=os.environ.get("OS_CLOUD"), metavar="CLOUD",
                       help="the cloud in clouds.yaml, as for the openstack CLI (default: $OS_CLOUD)")
    interval = argparse.ArgumentParser(add_help=False)
    interval.add_argument("--interval", type=arguments.more_than_zero, default=DEFAULT_INTERVAL, metavar="SECONDS",
                          help="seconds between two looks at the drain (default: %(default)g)")

    start = sub.add_parser("start", parents=[cloud, interval], help="drain hosts or a cell (or plan it: --dry-run)",
                           description="Disable the hosts (or the cell's hosts), plan where every server goes, "
                                       "move them with bounded concurrency and confirm each move.")
    target = start.add_mutually_exclusive_group(required=True)
    target.add_argument("--host", action="append", metavar="HOST", help="a host to drain (repeat for several)")
    target.add_argument("--cell", metavar="CELL", help="drain every host of this cell")
    start.add_argument("--reason", help="why: kept with the drain and shown by list and show")
    start.add_argument("--dry-run", action="store_true", help="plan only: print where each server would go")
    start.add_argument("--max-concurrency", type=arguments.whole(1, 100), metavar="N",
                       help="moves under way at once, 1..100 (API default: 5)")
    start.add_argument("--max-per-source-host", type=arguments.whole(1, 1000), metavar="N",
                       help="moves at once off one host, 1..1000 (default: no limit)")
    start.add_argument("--max-per-dest-host", type=arguments.whole(1, 1000), metavar="N",
                       help="moves at once onto one host, 1..1000 (default: no limit)")
    start.add_argument("--no-confirm", action="store_true",
                       help="leave each moved server in VERIFY_RESIZE instead of confirming it")
    start.add_argument("--move-what-fits", action="store_true",
                       help="when not every server can be placed, move the others (default: change nothing)")
    start.add_argument("--retries", type=arguments.whole(0, 5), metavar="N",
                       help="tries after a server's failed move, 0..5 (API default: 1)")
    start.add_argument("--callback-url", metavar="URL", help="POST a signed notice here when the drain starts and ends")
    shown = start.add_mutually_exclusive_group()
    shown.add_argument("--watch", action="store_true", help="follow the drain until it ends (as `ferry drain watch`)")
    shown.add_argument("--json", action="store_true", help="print the API's answer as JSON")
    start.set_defaults(handler=_handler(_start))

    listing = sub.add_parser("list", parents=[cloud], help="list drains, newest first")
    listing.add_argument("--status", choices=STATUSES, help="only drains in this status")
    listing.add_argument("--json", action="store_true", help="print the API's answer as JSON")
    listing.set_defaults(handler=_handler(_list))

    show = sub.add_parser("show", parents=[cloud], help="a drain, with each of its servers")
    show.add_argument("drain_id", metavar="ID")
    show.add_argument("--json", action="store_true", help="print the API's answer as JSON")
    show.set_defaults(handler=_handler(_show))

    follow = sub.add_parser("watch", parents=[cloud, interval], help="follow a drain until it ends",
                            description="Show a drain's progress until it ends. Exit status 0 when it completed, "
                                        "1 when it failed or was cancelled.")
    follow.add_argument("drain_id", metavar="ID")
    follow.set_defaults(handler=_handler(_watch))

    helps = {"pause": "start no new moves; the moves under way finish",
             "resume": "start moves again after a pause",
             "cancel": "start no new moves; the moves under way finish, then the drain reports"}
    for action in ACTIONS:
        acting = sub.add_parser(action, parents=[cloud], help=helps[action])
        acting.add_argument("drain_id", metavar="ID")
        acting.add_argument("--json", action="store_true", help="print the API's answer as JSON")
        acting.set_defaults(handler=_handler(_action), action=action)
