"""Drains: empty hosts or a cell by cold-migrating every server elsewhere.

A drain is a record in the API database (``drains``, with one ``drain_servers`` row per
server) and an execution of ``statemachine/drain.asl.json``. The compute API, the signed
webhook and a direct StartExecution all create the same record; the workflow then

1. disables the targets' compute services (the reason names the drain), so nothing new lands;
2. plans: for each movable server, largest first, where the scheduler's own filters and weighers
   would put it given the capacity left after the servers planned before it;
3. moves each server in a ``Map`` with bounded concurrency (overall, and per source and
   destination host): a nested execution of the resize workflow (a cold migration to the planned
   host), then one of the confirm workflow unless the request keeps servers in VERIFY_RESIZE;
4. reports.

Statuses: ``planning`` → ``planned`` (a dry run) | ``running`` ⇄ ``paused`` → ``cancelling`` →
``cancelled``; ``running`` → ``completed`` (every server moved) | ``failed`` (some server could
not be moved, the plan did not fit, or the workflow failed). Server states: ``pending``,
``moving``, ``done``, ``failed``, ``cancelled``, ``unplaceable``, ``gone`` (deleted during the
drain: nothing left to move, and no failure).

A plan that does not fit fails the drain before anything moves and gives back the services it
disabled, unless the request says ``move_what_fits``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import uuid as uuidlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from aws_lambda_powertools.metrics import MetricUnit
from sqlalchemy import ColumnElement, CursorResult, and_, func, or_, select, update
from sqlalchemy.orm import Session

from ferry import config, errors, hosts, notifications, placement, policy, scheduler, signing, validation, workflows
from ferry.auth import RequestContext
from ferry.compute import api as compute_api
from ferry.compute import instances, migration_states, moves, services, states
from ferry.compute.moves import CROSS_CELL_RULE
from ferry.observability import logger, metrics
from ferry.store.api_models import (
    CellMapping,
    Drain,
    DrainServer,
    HostMapping,
    InstanceGroup,
    InstanceGroupMember,
    InstanceMapping,
    utcnow,
)
from ferry.store.cell_models import Instance, Migration, Service
from ferry.store.db import all_cells, api_session, cell_session

# Drain statuses.
PLANNING = "planning"
PLANNED = "planned"
RUNNING = "running"
PAUSED = "paused"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
COMPLETED = "completed"
FAILED = "failed"
FINAL_STATUSES = frozenset({PLANNED, CANCELLED, COMPLETED, FAILED})
# How the message of a drain its workflow failed begins (FinishDrain decides from it, at every run,
# whether the drain gives its hosts back).
WORKFLOW_FAILED = "The drain workflow failed:"
UNFINISHED_STATUSES = frozenset({PLANNING, RUNNING, PAUSED, CANCELLING})

# Server states.
PENDING = "pending"
MOVING = "moving"
DONE = "done"
SERVER_FAILED = "failed"
SERVER_CANCELLED = "cancelled"
UNPLACEABLE = "unplaceable"
# The server no longer exists (deleted during the drain, before its move started, while its
# move failed, or before the drain settled it): it has left the drained hosts, so it never fails the drain.
GONE = "gone"
GONE_MESSAGE = "The server no longer exists (deleted during the drain)."
SETTLED_STATES = frozenset({DONE, SERVER_FAILED, SERVER_CANCELLED, UNPLACEABLE, GONE})

HOST = "host"
CELL = "cell"

# Where a drain came from: the compute API, the webhook, or an execution started directly.
EXECUTION_ORIGIN = "execution"

RULE = "ferry:drains:{}"

# Notification event types: one each per drain.
DRAIN_START = "drain.start"
DRAIN_END = "drain.end"
DRAIN_ERROR = "drain.error"

DEFAULT_MAX_CONCURRENCY = 5
DEFAULT_RETRIES = 1
# A drain whose execution Step Functions does not know this long after it was recorded never
# started (its start failed without the drain being marked so).
UNSTARTED_GRACE = dt.timedelta(minutes=5)
# The cross-cell weight a cell drain's plan uses: other cells first.
CELL_DRAIN_CROSS_CELL_MULTIPLIER = -1_000_000.0
# A drain not final whose record has not changed for this long is asked about when it is shown or
# listed: its workflow may have ended (stopped, timed out, failed) without finishing it, and
# nothing else would (see finish_if_workflow_ended: one DescribeExecution while it runs).
QUIET_BEFORE_LOOK = dt.timedelta(minutes=5)
# How many such drains one list asks about (the one quiet the longest): a drain found ended is
# finished there and then (its servers looked up, its end announced), which a list answering
# within API Gateway's 29 s can afford once.
MAX_LOOKS_PER_LIST = 1

_NAME = {"type": "string", "minLength": 1, "maxLength": 255}
# An http(s) URL without whitespace or control characters: the HTTP client refuses those when the
# callback is sent (with a message that repeats the URL, query and all), so the request is refused now.
CALLBACK_URL_PATTERN = r"^https?://[^\s\x00-\x1f\x7f-\x9f]+$"
# A URL whose authority (up to the first /, ? or #) holds an @: user information before the host.
_CREDENTIALS = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@")
_LIMIT = {"type": ["integer", "null"], "minimum": 1, "maximum": 1000}

REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "host": _NAME,
        "hosts": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 100, "uniqueItems": True},
        "cell": _NAME,
        "reason": {"type": ["string", "null"], "maxLength": 255},
        "dry_run": {"type": "boolean"},
        "max_concurrency": {"type": "integer", "minimum": 1, "maximum": 100},
        "max_per_source_host": _LIMIT,
        "max_per_dest_host": _LIMIT,
        "confirm": {"type": "boolean"},
        "move_what_fits": {"type": "boolean"},
        "retries": {"type": "integer", "minimum": 0, "maximum": 5},
        "callback_url": {"type": ["string", "null"], "pattern": CALLBACK_URL_PATTERN, "maxLength": 2048},
    },
    "oneOf": [{"required": ["host"]}, {"required": ["hosts"]}, {"required": ["cell"]}],
    "additionalProperties": False,
}

INPUT_SCHEMA: dict[str, Any] = json.loads(
    Path(__file__).with_name("workflows").joinpath("drain.input.schema.json").read_text(encoding="utf-8"))


# --- identities -----------------------------------------------------------------------------------


def _service_context(user_id: str, request_id: str | None) -> RequestContext:
    """An operator identity of Ferry's own (role admin, project ``ferry``)."""
    return RequestContext(user_id=user_id, project_id="ferry", roles=("admin",),
                          **({"request_id": request_id} if request_id else {}))


def webhook_context(request_id: str | None = None) -> RequestContext:
    """Who a drain the webhook started runs as."""
    return _service_context("ferry-webhook", request_id)


def operator_context(request_id: str | None = None) -> RequestContext:
    """Who a drain started directly on the state machine runs as (its caller has the IAM right to)."""
    return _service_context("ferry-operator", request_id)


def _drain_context(drain: Drain, request_id: str) -> RequestContext:
    return RequestContext(user_id=drain.user_id, project_id=drain.project_id, roles=tuple(drain.roles),
                          request_id=request_id)


def _derived_uuid(*parts: object) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, "ferry-drain:" + ":".join(str(p) for p in parts)))


# --- creating ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Targets:
    kind: str
    names: list[str]
    cells: list[str]


# The plan travels through the drain workflow's state (PlanDrain's answer, the Map's items),
# which Step Functions caps at 256 KiB, about 6,000 server ids, and a state that outgrows it fails
# the execution past any Catch. So a drain moves at most this many servers.
MAX_SERVERS = 5000


# A dry run of the API or the webhook is planned inline, in their function, whose caller (API
# Gateway) waits 29 s at most: at 40 to 100 ms a server (docs/benchmarks.md), this many plan
# within 15 s. One started on the state machine is planned by PlanDrain, as a drain is.
MAX_DRY_RUN_SERVERS = 150
# A dry run still planning this long after it was recorded (or last planned again) was left by a
# function that ended (timed out, killed): it is failed when next read or acted on.
DRY_RUN_PLANNING_LIMIT = dt.timedelta(minutes=2)
DRY_RUN_ABANDONED = (f"The dry run's plan was not made within {DRY_RUN_PLANNING_LIMIT.seconds // 60} minutes: "
                     f"the function planning it ended. Nothing was disabled or moved: run it again.")


def _planned_inline(dry_run: bool, origin: str | None) -> bool:
    """Whether a drain is a dry run its request plans in its own function (not the state machine's)."""
    return dry_run and origin != EXECUTION_ORIGIN


def _check_size(targets_text: str, count: int, *, dry_run: bool = False) -> None:
    """Refuse a drain of more servers than its workflow holds, or (``dry_run``: planned inline) a
    dry run of more than its request's function plans in time.

    Raises:
        DrainTooLarge.
    """
    if count > MAX_SERVERS:
        raise errors.DrainTooLarge(
            f"{targets_text} hold {count} servers, and a drain moves at most {MAX_SERVERS}: drain fewer hosts "
            f"at a time.")
    if dry_run and count > MAX_DRY_RUN_SERVERS:
        raise errors.DrainTooLarge(
            f"{targets_text} hold {count} servers, and a dry run plans at most {MAX_DRY_RUN_SERVERS}: dry-run "
            f"fewer hosts at once.")


def _count_on(kind: str, names: list[str]) -> int:
    """How many visible servers the hosts or the cell ``names`` hold (those :func:`_instances_on` finds)."""
    count = 0
    for cell, cell_hosts in _by_cell(kind, names).items():
        with cell_session(cell) as session:
            count += session.scalars(select(func.count(Instance.id)).where(*_visible_on(kind, cell_hosts))).one()
    return count


def _by_cell(kind: str, names: list[str]) -> dict[str, list[str]]:
    """``{cell: its drained hosts}``: the drained cell (no hosts named), or the cells of the drained hosts."""
    if kind == CELL:
        return {names[0]: []}
    by_cell: dict[str, list[str]] = defaultdict(list)
    for host in names:
        if cell := hosts.cell_of_host(host):
            by_cell[cell].append(host)
    return by_cell


def _visible_on(kind: str, cell_hosts: list[str]) -> list[ColumnElement[bool]]:
    """The servers a drain moves in a cell: visible, on a host (one of ``cell_hosts`` for a host drain)."""
    criteria: list[ColumnElement[bool]] = [Instance.deleted.is_(False), Instance.hidden.is_(False),
                                           Instance.host.is_not(None)]
    if kind == HOST:
        criteria.append(Instance.host.in_(cell_hosts))
    return criteria


def _resolve_targets(request: Mapping[str, Any]) -> _Targets:
    """The hosts or the cell the request names, each checked to exist.

    Raises:
        BadRequest: an unknown host or cell, or cell0.
    """
    with api_session() as session:
        if "cell" in request:
            name = request["cell"]
            cell = session.scalars(select(CellMapping).where(CellMapping.name == name)).one_or_none()
            if cell is None or cell.uuid == "00000000-0000-0000-0000-000000000000" or name == "cell0":
                raise errors.BadRequest(f"Cell {name} does not exist or holds no compute hosts.")
            return _Targets(CELL, [name], [name])
        names = [request["host"]] if "host" in request else list(request["hosts"])
        found = dict(session.execute(
            select(HostMapping.host, CellMapping.name).join(CellMapping, HostMapping.cell_id == CellMapping.id)
            .where(HostMapping.host.in_(names))).all())
    missing = [name for name in names if name not in found]
    if missing:
        raise errors.BadRequest(f"Compute host {', '.join(missing)} could not be found.")
    return _Targets(HOST, names, sorted({found[name] for name in names}))


def _options(request: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "max_concurrency": request.get("max_concurrency", DEFAULT_MAX_CONCURRENCY),
        "max_per_source_host": request.get("max_per_source_host"),
        "max_per_dest_host": request.get("max_per_dest_host"),
        "confirm": request.get("confirm", True),
        "move_what_fits": request.get("move_what_fits", False),
        "retries": request.get("retries", DEFAULT_RETRIES),
        "callback_url": request.get("callback_url"),
    }


def _overlapping(session: Session, targets: _Targets, *, include_unannounced: bool = False) -> list[Drain]:
    """The drains not yet finished that drain one of the same hosts or the same cell; with
    ``include_unannounced``, also the finished ones among those whose end is not announced yet."""
    wanted: ColumnElement[bool] = Drain.status.in_(UNFINISHED_STATUSES)
    if include_unannounced:
        wanted = or_(wanted, and_(Drain.status.in_(FINAL_STATUSES), Drain.announced_at.is_(None)))
    candidates = session.scalars(select(Drain).where(Drain.dry_run.is_(False), wanted)).all()
    found = []
    for drain in candidates:
        if drain.target_kind == targets.kind and set(drain.targets) & set(targets.names):
            found.append(drain)
        elif CELL in (drain.target_kind, targets.kind) and set(_cells_of(session, drain)) & set(targets.cells):
            found.append(drain)
    return found


def _cells_of(session: Session, drain: Drain) -> list[str]:
    """The cells a drain works in (read in ``session``: a second session would wait on SQLite's lock)."""
    if drain.target_kind == CELL:
        return list(drain.targets)
    return sorted(set(session.scalars(select(CellMapping.name).join(HostMapping, HostMapping.cell_id == CellMapping.id)
                                      .where(HostMapping.host.in_(drain.targets)))))


# The body of ``POST /ferry/drains`` and of the webhook.
BODY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["drain"],
    "properties": {"drain": REQUEST_SCHEMA},
    "additionalProperties": False,
}


def validate_request(request: Any) -> None:
    """Check a drain request against :data:`REQUEST_SCHEMA`, and that its callback URL carries no
    credentials.

    Raises:
        BadRequest: worded by :func:`refusal_of` (never repeating what was sent).
    """
    _check(request, REQUEST_SCHEMA, errors.BadRequest)
    _check_callback_url(request, errors.BadRequest)


def request_of(body: Any, refusal: type[errors.BadRequest] = errors.BadRequest) -> dict[str, Any]:
    """The drain request of a body ``{"drain": {...}}`` (the API's and the webhook's).

    Raises:
        refusal: the body does not match :data:`BODY_SCHEMA`, worded by :func:`refusal_of`; its
            callback URL carries credentials; or it names a callback URL and callbacks are not
            configured (:func:`check_callbacks_configured`).
    """
    _check(body, BODY_SCHEMA, refusal)
    request: dict[str, Any] = body["drain"]
    _check_callback_url(request, refusal)
    check_callbacks_configured(request, refusal)
    return request


def _check_callback_url(request: Mapping[str, Any], refusal: type[errors.BadRequest]) -> None:
    """Refuse a callback URL with credentials (``user:password@host``): the HTTP client takes them
    for part of the host, so the callback could never be sent."""
    url = request.get("callback_url")
    if url and _CREDENTIALS.match(url):
        raise refusal("Invalid drain request at callback_url: must not carry a user name or password "
                      "(user:password@host), which callbacks cannot send; a token may go in the query.")


def check_callbacks_configured(request: Mapping[str, Any],
                               refusal: type[errors.BadRequest] = errors.BadRequest) -> None:
    """Refuse a drain request naming a ``callback_url`` when no callback secret is configured
    (the stack's ``DrainCallbackSecret``): its callbacks could not be signed.

    Raises:
        refusal: (400) callbacks are not configured.
    """
    if request.get("callback_url") and not config.get().callback_secret:
        raise refusal("Drain callbacks are not configured (the stack's DrainCallbackSecret is empty), so a drain "
                      "cannot name a callback_url: leave it out, or ask the operator to set DrainCallbackSecret.")


def request_digest(request: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of what a valid drain request asks, as an idempotency key stands for it.

    Normalised: ``host`` and ``hosts`` naming the same hosts (in any order) are the same targets,
    and an option left out is its default. Who asks is not part of it (nor, so, whether policy
    lets them move servers between cells): a key is used by one origin, whose identity is fixed,
    and a retry after a policy change still names the same request.
    """
    if "cell" in request:
        target = {"kind": CELL, "names": [request["cell"]]}
    else:
        target = {"kind": HOST, "names": sorted([request["host"]] if "host" in request else request["hosts"])}
    normalised = {"target": target, "reason": request.get("reason"), "dry_run": bool(request.get("dry_run", False)),
                  "options": _options(request)}
    return hashlib.sha256(json.dumps(normalised, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check(document: Any, schema: dict[str, Any], refusal: type[errors.BadRequest]) -> None:
    try:
        validation.check(document, schema)
    except validation.SchemaMismatch as exc:
        raise refusal(refusal_of(exc, schema)) from exc


def refusal_of(mismatch: validation.SchemaMismatch, schema: Mapping[str, Any]) -> str:
    """The message refusing a drain request or body that does not match ``schema``.

    Built from where the mismatch is and which keyword failed, with the limits the schema sets,
    never from what was sent: the schema's own messages repeat the value (a callback URL whose
    query may carry a token, or the whole request for ``oneOf``), and refusals are answered and
    logged. Paths inside ``{"drain": ...}`` are named as in the request itself.
    """
    path = list(mismatch.path)
    node = _schema_at(schema, path)
    subject = "Invalid drain request"
    if schema is BODY_SCHEMA:
        subject, path = (subject, path[1:]) if path[:1] == ["drain"] else (subject + " body", path)
    where = "/".join(str(part) for part in path)
    return f"{subject}{' at ' + where if where else ''}: {_keyword_rule(mismatch, node, where)}."


def _schema_at(schema: Mapping[str, Any], path: list[str | int]) -> Mapping[str, Any]:
    """The part of ``schema`` that checks the value at ``path`` (an empty schema when none does)."""
    node = schema
    for part in path:
        node = node.get("items", {}) if isinstance(part, int) else node.get("properties", {}).get(part, {})
    return node


def _keyword_rule(mismatch: validation.SchemaMismatch, node: Mapping[str, Any], where: str) -> str:
    """What the failed keyword of ``node`` asks for, in words."""
    keyword = mismatch.keyword
    if keyword == "pattern" and where == "callback_url":
        return "must be an http:// or https:// URL without spaces or control characters"
    if keyword == "oneOf":
        names = [name for choice in node.get("oneOf", []) for name in choice.get("required", [])]
        quoted = [f"'{name}'" for name in names]
        return "name exactly one of " + " or ".join(filter(None, [", ".join(quoted[:-1]), *quoted[-1:]]))
    if keyword == "required":
        given = mismatch.instance if isinstance(mismatch.instance, Mapping) else {}
        missing = [name for name in node.get("required", []) if name not in given]
        return f'"{missing[0] if missing else "?"}" is a required property'
    if keyword == "additionalProperties":
        return f"Additional properties are not allowed (it takes {', '.join(node.get('properties', {}))})"
    if keyword == "type":
        types = node.get("type")
        return "is not of type " + " or ".join(f'"{t}"' for t in (types if isinstance(types, list) else [types]))
    rules = {
        "minimum": "is less than the minimum of {}", "maximum": "is greater than the maximum of {}",
        "minLength": "is shorter than {} character(s)", "maxLength": "is longer than {} characters",
        "minItems": "names fewer than {} item(s)", "maxItems": "names more than {} items",
        "uniqueItems": "names an item more than once",
    }
    if keyword in rules:
        return rules[keyword].format(node.get(keyword))
    return f"does not match the schema ({keyword or 'unknown rule'})"


def record_drain(ctx: RequestContext, request: Mapping[str, Any], *, origin: str,
                 idempotency_key: str | None = None, execution_name: str | None = None) -> tuple[str, bool]:
    """Validate a drain request and write its record (status ``planning``); idempotent on the key.

    The drain records the request's digest (:func:`request_digest`): the same key again with the
    same request names the drain recorded the first time, with another request it is refused. A
    drain recorded before digests were (``request_digest`` null) is named whatever the request.

    Returns:
        The drain's id, and whether it was created now (False: the key named an existing one).

    Raises:
        BadRequest: the request does not match the schema, names an unknown host or cell, or
            names a callback URL while callbacks are not configured.
        DrainTooLarge: the hosts or the cell hold more than :data:`MAX_SERVERS` servers, or more
            than :data:`MAX_DRY_RUN_SERVERS` for a dry run (400).
        Forbidden: a cell drain, and the caller may not move servers between cells.
        DrainInvalidState: a drain of the same hosts or cell is under way, or the key was used
            for a different request (409).
    """
    validate_request(request)
    check_callbacks_configured(request)
    digest = request_digest(request)
    if idempotency_key:
        with api_session() as session:
            existing = session.execute(select(Drain.uuid, Drain.request_digest)
                                       .where(Drain.idempotency_key == idempotency_key)).first()
        if existing is not None and existing.request_digest not in (None, digest):
            raise errors.DrainInvalidState(
                f"The idempotency key {idempotency_key!r} was used for a different drain request (drain "
                f"{existing.uuid}): a new request needs a new key.")
        # A dry run its first try abandoned gives its key up: the request makes a new one.
        if existing is not None and not _fail_abandoned_dry_runs(existing.uuid):
            return existing.uuid, False
    targets = _resolve_targets(request)
    dry_run = bool(request.get("dry_run", False))
    _check_size(", ".join(targets.names), _count_on(targets.kind, targets.names),
                dry_run=_planned_inline(dry_run, origin))
    allow_cross_cell = policy.check(ctx, CROSS_CELL_RULE, {"project_id": ctx.project_id})
    if targets.kind == CELL and not allow_cross_cell:
        raise errors.Forbidden(
            f"Draining cell {targets.names[0]} moves its servers to other cells, and policy "
            f"{CROSS_CELL_RULE} does not allow that for you.")
    if not dry_run:
        # The drains in the way whose workflow ended are finished; and one finished by an earlier
        # look that died before it announced the end (this request's first try, say) is announced.
        with api_session() as session:
            others = [drain.uuid for drain in _overlapping(session, targets, include_unannounced=True)]
        for other in others:
            finish_if_workflow_ended(other)
    with api_session() as session:
        # Every drain's creation locks the cell mappings first, in one order: two requests for the
        # same hosts cannot both find them free (SQLite serialises writers anyway). NO KEY UPDATE,
        # so the rows' foreign-key readers (new mappings) are not held up.
        session.scalars(select(CellMapping.id).order_by(CellMapping.id).with_for_update(key_share=True)).all()
        if not dry_run and (busy := next(iter(_overlapping(session, targets)), None)) is not None:
            raise errors.DrainInvalidState(
                f"Drain {busy.uuid} ({busy.status}) is draining {', '.join(busy.targets)} already.")
        drain_uuid = str(uuidlib.uuid4())
        if execution_name is None and not dry_run:
            # Named with the drain, in the same transaction: a drain whose start never happened is
            # then still found out (finish_if_workflow_ended).
            execution_name = execution_name_of(drain_uuid)
        drain = Drain(uuid=drain_uuid, status=PLANNING, target_kind=targets.kind, targets=targets.names,
                      reason=request.get("reason"), dry_run=dry_run, options=_options(request),
                      allow_cross_cell=allow_cross_cell, disabled_hosts=[], origin=origin,
                      idempotency_key=idempotency_key, request_digest=digest, user_id=ctx.user_id,
                      project_id=ctx.project_id, roles=list(ctx.roles), request_id=ctx.request_id,
                      execution_name=execution_name, version=0)
        session.add(drain)
    logger.info("drain recorded", extra={"drain": drain_uuid, "targets": targets.names, "kind": targets.kind,
                                         "dry_run": dry_run, "origin": origin})
    return drain_uuid, True


def create_drain(ctx: RequestContext, request: Mapping[str, Any], *, origin: str,
                 idempotency_key: str | None = None) -> tuple[int, dict[str, Any]]:
    """Accept a drain from the API or the webhook.

    A dry run is planned at once and answered with the plan (200, status ``planned``; nothing is
    disabled or moved). Otherwise the drain workflow starts (execution ``drain-<id>``) and the
    answer is 202 with the drain as recorded. The same ``idempotency_key`` again with the same
    request answers with the drain it started the first time (200) and starts nothing more (with
    another request it is refused: :func:`record_drain`); a drain recorded by an
    attempt that died before its workflow started is started then, and a dry run whose plan
    failed is planned then (one left planning past :data:`DRY_RUN_PLANNING_LIMIT` is failed
    instead, giving its key up, and the request makes a new dry run).

    Returns:
        ``(http status, {"drain": view})``.

    Raises:
        What :func:`record_drain` raises; the start's error, after the drain is marked failed
        (and its key given up) when Step Functions says it did not start. When Step Functions
        cannot say, the drain stays ``planning`` with its key: the same request again starts
        it, or it is finished 5 minutes on (:func:`finish_if_workflow_ended`).
    """
    drain_uuid, created = record_drain(ctx, request, origin=origin, idempotency_key=idempotency_key)
    if not created:
        with api_session() as session:
            drain = _load(session, drain_uuid, for_update=True)
            unstarted = drain.status == PLANNING and not drain.dry_run and drain.execution_name is not None
            unplanned = drain.status == PLANNING and drain.dry_run  # its first try's plan failed
            if unplanned:  # planned again now: not abandoned while this plan is made
                drain.updated_at = utcnow()
            name = drain.execution_name
        if unstarted and name and _describe_execution(name)[0] == _MISSING:
            _start_workflow(drain_uuid, name, ctx)
        if unplanned:
            plan(drain_uuid)
        return 200, {"drain": get_view(drain_uuid, with_hosts=True)}
    if request.get("dry_run"):
        plan(drain_uuid)
        return 200, {"drain": get_view(drain_uuid, with_hosts=True)}
    _start_workflow(drain_uuid, execution_name_of(drain_uuid), ctx)
    return 202, {"drain": get_view(drain_uuid, with_hosts=True)}


def _start_workflow(drain_uuid: str, name: str, ctx: RequestContext) -> None:
    """Start the drain's execution ``name`` (idempotent by name); see :func:`create_drain` for errors."""
    try:
        workflows.start_execution(config.get().drain_state_machine_arn, name,
                                  {"drain_uuid": drain_uuid, "request_id": ctx.request_id})
    except Exception as exc:
        state, _described = _describe_execution(name)
        if state == _EXISTS:  # the answer was lost, not the start
            logger.warning("starting the drain workflow answered an error, but it runs",
                           extra={"drain": drain_uuid, "execution": name, "error": str(exc)})
            return
        logger.exception("drain workflow did not start", extra={"drain": drain_uuid, "known": state == _MISSING})
        if state == _MISSING:
            # The key is given up with the drain: the same request again starts a new drain. Its
            # end is this request's answer, not an announcement, so no later look announces it.
            _set_status(drain_uuid, FAILED, message=f"The drain workflow did not start: {exc}", release_key=True,
                        only_from=PLANNING, nothing_to_announce=True)
        raise


def execution_name_of(drain_uuid: str) -> str:
    """The name of the drain workflow's execution the API or the webhook starts for a drain."""
    return f"drain-{drain_uuid}"


# What Step Functions says of a drain's execution.
_EXISTS, _MISSING, _UNKNOWN = "exists", "missing", "unknown"


def _describe_execution(name: str) -> tuple[str, dict[str, Any] | None]:
    """Whether the drain execution ``name`` exists, is missing, or Step Functions cannot tell;
    and its description when it exists."""
    arn = config.get().drain_state_machine_arn
    if not arn:
        return _UNKNOWN, None
    try:
        described = workflows.describe_execution(arn, name)
    except Exception as exc:  # a describe that fails must not turn into the caller's error
        logger.warning("the drain's execution could not be described", extra={"execution": name, "error": str(exc)})
        return _UNKNOWN, None
    return (_EXISTS, described) if described is not None else (_MISSING, None)


def finish_if_workflow_ended(drain_uuid: str) -> bool:
    """Finish, as failed, a drain whose workflow ended without finishing it, or announce the end
    of a final drain that was never announced; return whether the drain is finished (now or before).

    A drain's workflow may end before its FinishDrain step ran: stopped by hand, timed out, or
    failed in a step that could not be retried (its store out of reach). Such a drain would stay
    unfinished for ever and hold its hosts against every later drain. A drain whose execution
    Step Functions does not know, :data:`UNSTARTED_GRACE` after it was recorded, never started.
    A final drain (not a dry run) whose end is not recorded announced (``announced_at``) while
    its workflow is no longer running (ended, or unknown to Step Functions) was finished by a
    process that died before its announcement went out: :func:`finish` runs again, and
    announces it. While its workflow runs, its FinishDrain announces it. Nothing is decided
    when Step Functions cannot be asked.
    """
    with api_session() as session:
        drain = _load(session, drain_uuid)
        final = drain.status in FINAL_STATUSES
        if final and (drain.dry_run or drain.announced_at is not None):
            return True
        name, recorded_at, dry_run = drain.execution_name, drain.created_at, drain.dry_run
    if dry_run or not name:
        return final
    state, described = _describe_execution(name)
    if state == _UNKNOWN:
        return final
    if described is not None and workflows.is_running(described):  # a redriven one goes on too
        return final
    if final:
        logger.warning("drain final but its end not announced, and its workflow no longer runs; announcing it",
                       extra={"drain": drain_uuid, "execution": name, "known": described is not None})
        finish(drain_uuid)
        return True
    if described is None:
        if utcnow() - recorded_at < UNSTARTED_GRACE:
            return False
        ended = "never started"
    else:
        ended = f"ended {str(described.get('status')).lower()}"
    logger.warning("drain workflow ended without finishing the drain", extra={"drain": drain_uuid, "execution": name,
                                                                             "ended": ended})
    ended_error = errors.DrainWorkflowEnded(f"its execution {name} {ended} before the drain was finished.")
    finish(drain_uuid, error={"Error": ended_error.name, "Cause": ended_error.message})
    return True


# --- reading -------------------------------------------------------------------------------------


def _load(session: Session, drain_uuid: str, *, for_update: bool = False) -> Drain:
    query = select(Drain).where(Drain.uuid == drain_uuid)
    if for_update:
        query = query.with_for_update()
    drain = session.scalars(query).one_or_none()
    if drain is None:
        raise errors.DrainNotFound(f"Drain {drain_uuid} could not be found.")
    return drain


def _servers(session: Session, drain: Drain) -> list[DrainServer]:
    return list(session.scalars(select(DrainServer).where(DrainServer.drain_id == drain.id)
                                .order_by(DrainServer.position, DrainServer.id)))


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.replace(microsecond=0).isoformat() + "Z"


def _counts(servers: Iterable[DrainServer]) -> dict[str, int]:
    states_seen = [s.state for s in servers]
    done, failed = states_seen.count(DONE), states_seen.count(SERVER_FAILED)
    moving, pending = states_seen.count(MOVING), states_seen.count(PENDING)
    return {"total": len(states_seen), "done": done, "failed": failed, "in_progress": moving,
            "left": pending + moving, "cancelled": states_seen.count(SERVER_CANCELLED),
            "unplaceable": states_seen.count(UNPLACEABLE), "gone": states_seen.count(GONE)}


def _eta(drain: Drain, servers: list[DrainServer], counts: Mapping[str, int],
         now: dt.datetime) -> tuple[float | None, float | None]:
    """``(average seconds per move, seconds left)`` from the moves finished so far."""
    durations = [(s.finished_at - s.started_at).total_seconds() for s in servers
                 if s.state == DONE and s.started_at and s.finished_at]
    if not durations:
        return None, None
    average = sum(durations) / len(durations)
    if drain.status in FINAL_STATUSES or not counts["left"]:
        return average, 0.0 if drain.status not in FINAL_STATUSES else None
    lanes = max(1, min(int(drain.options.get("max_concurrency") or 1), counts["left"]))
    waves = -(-counts["left"] // lanes)
    elapsed_in_flight = [(now - s.started_at).total_seconds() for s in servers if s.state == MOVING and s.started_at]
    head_start = min(sum(elapsed_in_flight) / len(elapsed_in_flight), average) if elapsed_in_flight else 0.0
    return average, max(waves * average - head_start, 0.0)


def _server_view(server: DrainServer) -> dict[str, Any]:
    return {"id": server.instance_uuid, "name": server.name, "cell": server.cell, "source_host": server.source_host,
            "planned_host": server.planned_host, "dest_host": server.dest_host, "state": server.state,
            "vm_state": server.vm_state, "migration_id": server.migration_uuid, "attempts": server.attempts,
            "error": server.error, "started_at": _iso(server.started_at), "finished_at": _iso(server.finished_at)}


def _view(drain: Drain, servers: list[DrainServer], *, with_servers: bool = True,
          with_hosts: bool = False) -> dict[str, Any]:
    """The drain in the API's shape; ``with_hosts`` adds ``disabled_hosts`` (the API's view, not
    the announced one: FinishDrain run again gives hosts back and announces the same view)."""
    now = utcnow()
    counts = _counts(servers)
    average, left = _eta(drain, servers, counts, now)
    view: dict[str, Any] = {
        "id": drain.uuid, "status": drain.status,
        "target": {"kind": drain.target_kind, "names": list(drain.targets)},
        "reason": drain.reason, "dry_run": drain.dry_run, "origin": drain.origin, "options": _shown_options(drain),
        "counts": counts, "created_at": _iso(drain.created_at), "started_at": _iso(drain.started_at),
        "finished_at": _iso(drain.finished_at), "updated_at": _iso(drain.updated_at),
        "average_move_seconds": None if average is None else round(average, 1),
        "eta_seconds": None if left is None else round(left, 1),
        "eta": None if left is None else _iso(now + dt.timedelta(seconds=left)),
        "message": drain.message,
        "plan": {"fits": drain.fits, "unplaceable": [
            {"id": s.instance_uuid, "name": s.name, "reason": s.error} for s in servers if s.state == UNPLACEABLE]},
    }
    if with_hosts:
        # The compute services this drain disabled and has not given back: after a cancel or a
        # failure an operator enables them from here.
        view["disabled_hosts"] = list(drain.disabled_hosts or [])
    if with_servers:
        view["servers"] = [_server_view(s) for s in servers]
    return view


def _shown_options(drain: Drain) -> dict[str, Any]:
    """The drain's options as views and notifications show them: the callback URL without its
    query and credentials, which may carry a token."""
    options = dict(drain.options)
    if options.get("callback_url"):
        options["callback_url"] = signing.redacted_url(options["callback_url"])
    return options


def get_view(drain_uuid: str, *, with_hosts: bool = False) -> dict[str, Any]:
    """The drain as recorded, in the API's shape, with its servers (a dry run abandoned for good
    failed first); ``with_hosts`` as in :func:`_view` (every answer of the API has them).

    Raises:
        DrainNotFound.
    """
    _fail_abandoned_dry_runs(drain_uuid)
    with api_session() as session:
        drain = _load(session, drain_uuid)
        return _view(drain, _servers(session, drain), with_hosts=with_hosts)


def show(drain_uuid: str) -> dict[str, Any]:
    """The drain as the API shows it (:func:`get_view`, with ``disabled_hosts``), once the view
    can be trusted to be current.

    A drain not final and unchanged for :data:`QUIET_BEFORE_LOOK` is first finished if its
    workflow ended without finishing it (:func:`finish_if_workflow_ended`), so the view shows
    that end; when Step Functions cannot be asked, it is shown as recorded.

    Raises:
        DrainNotFound.
    """
    _fail_abandoned_dry_runs(drain_uuid)
    with api_session() as session:
        quiet = _is_quiet(_load(session, drain_uuid), utcnow())
    if quiet:
        _finish_ended_workflows([drain_uuid])
    with api_session() as session:
        drain = _load(session, drain_uuid)
        return _view(drain, _servers(session, drain), with_hosts=True)


def list_views(status: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Every drain, newest first (optionally only those in ``status``), without their servers.

    Of the drains listed that are not final and unchanged for :data:`QUIET_BEFORE_LOOK`, the
    :data:`MAX_LOOKS_PER_LIST` quiet the longest are first finished if their workflow ended
    without finishing them, as :func:`show` does.
    """
    _fail_abandoned_dry_runs()
    views, quiet = _listed(status, limit)
    if quiet and _finish_ended_workflows(quiet[:MAX_LOOKS_PER_LIST]):
        views, _quiet = _listed(status, limit)
    return views


def _listed(status: str | None, limit: int | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The views :func:`list_views` answers, and the ids of the quiet drains among them (quiet the longest first)."""
    now = utcnow()
    with api_session() as session:
        query = select(Drain).order_by(Drain.created_at.desc(), Drain.id.desc())
        if status:
            query = query.where(Drain.status == status)
        if limit:
            query = query.limit(limit)
        drains = list(session.scalars(query))
        by_drain: dict[int, list[DrainServer]] = defaultdict(list)
        if drains:
            for server in session.scalars(select(DrainServer).where(DrainServer.drain_id.in_([d.id for d in drains]))):
                by_drain[server.drain_id].append(server)
        quiet = sorted((d for d in drains if _is_quiet(d, now)), key=_last_changed)
        return [_view(d, by_drain[d.id], with_servers=False, with_hosts=True) for d in drains], \
            [d.uuid for d in quiet]


def _last_changed(drain: Drain) -> dt.datetime:
    return drain.updated_at or drain.created_at


def _is_quiet(drain: Drain, now: dt.datetime) -> bool:
    """Whether a drain not final, run by a workflow, has not changed for :data:`QUIET_BEFORE_LOOK`
    (a running drain changes each time it starts a move; one whose workflow ended does not)."""
    return (drain.status in UNFINISHED_STATUSES and not drain.dry_run and drain.execution_name is not None
            and now - _last_changed(drain) >= QUIET_BEFORE_LOOK)


def _finish_ended_workflows(drain_uuids: list[str]) -> bool:
    """Finish each of the drains whose workflow ended without finishing it; return whether any
    was finished now. Never raises: a look that fails is logged, and the drain shown as recorded."""
    if not config.get().drain_state_machine_arn:  # nothing to ask: Step Functions is not configured
        return False
    finished = False
    for drain_uuid in drain_uuids:
        try:
            finished = finish_if_workflow_ended(drain_uuid) or finished
        except Exception:
            logger.exception("looking whether a quiet drain's workflow ended failed; it is shown as recorded",
                             extra={"drain": drain_uuid})
    return finished


def _fail_abandoned_dry_runs(drain_uuid: str | None = None) -> int:
    """Record ``failed`` the dry runs of the API and the webhook (``drain_uuid`` only, when given)
    left ``planning`` for more than :data:`DRY_RUN_PLANNING_LIMIT`, and return how many: the
    function that planned them ended before it wrote the plan, and nothing else would ever
    finish them (PlanDrain plans a dry run started on the state machine, for up to 15 minutes). Their key is given
    up, so the same webhook delivery again makes a new dry run. One conditional UPDATE: a plan
    written meanwhile is kept."""
    now = utcnow()
    where = [Drain.dry_run.is_(True), Drain.status == PLANNING, Drain.origin != EXECUTION_ORIGIN,
             func.coalesce(Drain.updated_at, Drain.created_at) < now - DRY_RUN_PLANNING_LIMIT]
    if drain_uuid is not None:
        where.append(Drain.uuid == drain_uuid)
    with api_session() as session:
        failed = cast(CursorResult[Any], session.execute(
            update(Drain).where(*where).values(status=FAILED, message=DRY_RUN_ABANDONED, finished_at=now,
                                               updated_at=now, announced_at=now, idempotency_key=None,
                                               version=Drain.version + 1)
            .execution_options(synchronize_session=False))).rowcount
    if failed:
        logger.warning("dry run left planning by a function that ended; recorded failed",
                       extra={"drain": drain_uuid, "count": failed})
    return failed


# --- pause, resume, cancel -----------------------------------------------------------------------

_TRANSITIONS = {
    "pause": ((RUNNING,), PAUSED),
    "resume": ((PAUSED,), RUNNING),
    "cancel": ((PLANNING, RUNNING, PAUSED), CANCELLING),
}
ACTIONS = tuple(_TRANSITIONS)


def act(drain_uuid: str, action: str) -> dict[str, Any]:
    """Pause, resume or cancel a drain (moves in flight always finish).

    Pause stops new moves from starting; resume lets them start again; cancel stops new moves
    for good, and the drain ends ``cancelled`` once the moves in flight finished. Asking for
    the status the drain is already in (pause twice) answers without change. A dry run takes
    no action: it moves nothing, and no workflow would settle it.

    A drain whose workflow ended without finishing it is finished first (failed), and then
    refuses every action; a final drain whose end was never announced is announced first (see
    :func:`finish_if_workflow_ended`).

    Raises:
        DrainNotFound; BadRequest for an unknown action; DrainInvalidState (409) when the
        drain's status does not allow the action, or the drain is a dry run.
    """
    if action not in _TRANSITIONS:
        raise errors.BadRequest(f"Unknown drain action {action!r}; use one of {', '.join(ACTIONS)}.")
    allowed_from, to = _TRANSITIONS[action]
    _fail_abandoned_dry_runs(drain_uuid)
    finish_if_workflow_ended(drain_uuid)  # a drain whose workflow is gone can no longer act (and is announced)
    with api_session() as session:
        drain = _load(session, drain_uuid, for_update=True)
        if drain.dry_run:
            # No workflow would ever settle it: a dry run cancelled would stay cancelling for ever.
            raise errors.DrainInvalidState(
                f"Cannot {action} drain {drain_uuid}: it is a dry run ({drain.status}), which moves nothing.")
        if drain.status != to:
            if drain.status not in allowed_from:
                raise errors.DrainInvalidState(f"Cannot {action} drain {drain_uuid} while it is {drain.status}.")
            drain.status = to
            drain.version += 1
            drain.updated_at = utcnow()
    logger.info("drain action", extra={"drain": drain_uuid, "action": action, "status": to})
    return get_view(drain_uuid, with_hosts=True)


def _set_status(drain_uuid: str, status: str, *, message: str | None = None, release_key: bool = False,
                only_from: str | None = None, nothing_to_announce: bool = False) -> None:
    """Write the drain's status (only while it is ``only_from``, when given).

    ``nothing_to_announce`` records a final status's end as announced: a drain that ends here
    without its end told otherwise would be announced by the next look at it
    (:func:`finish_if_workflow_ended`).
    """
    now = utcnow()
    values: dict[str, Any] = {"status": status, "updated_at": now, "version": Drain.version + 1}
    if message is not None:
        values["message"] = message
    if release_key:
        values["idempotency_key"] = None
    if status in FINAL_STATUSES:
        values["finished_at"] = now
        if nothing_to_announce:
            values["announced_at"] = now
    where = [Drain.uuid == drain_uuid] + ([Drain.status == only_from] if only_from else [])
    with api_session() as session:
        session.execute(update(Drain).where(*where).values(**values))


# --- planning ------------------------------------------------------------------------------------

_MOVABLE = (states.ACTIVE, states.STOPPED)


def _instances_on(drain: Drain) -> list[tuple[str, Instance, bool]]:
    """``(cell, instance, volume-backed)`` for every visible server on the drain's hosts or in its cell."""
    found: list[tuple[str, Instance, bool]] = []
    for cell, cell_hosts in _by_cell(drain.target_kind, list(drain.targets)).items():
        with cell_session(cell) as session:
            query = select(Instance).where(*_visible_on(drain.target_kind, cell_hosts))
            for instance in session.scalars(query.order_by(Instance.created_at, Instance.id)):
                found.append((cell, instance, instances.is_bfv(session, instance.uuid)))
                session.expunge(instance)
    return found


# The statuses of a migration that may still be open: under way, awaiting its confirm, being settled.
_OPEN_MOVE_STATUSES = (*migration_states.MOVING, migration_states.FINISHED, *migration_states.SETTLING)


def _shows(status: str, vm_state: str, task_state: str | None) -> bool:
    """Whether a live server in ``vm_state`` with ``task_state`` shows a move whose migration is
    ``status``: VERIFY_RESIZE for a finished one, a task for one under way or being settled."""
    return vm_state == states.RESIZED if status == migration_states.FINISHED else task_state is not None


def _left_on_targets(drain: Drain, own: set[str]) -> list[str]:
    """The servers the drain's hosts (or cell) still hold or may get back, other than through the
    drain's own moves: a server on them (one that moved there, or was kept there, since the plan),
    and one with a move or resize to or from them still open (a move that began before the drain,
    whose revert would bring the server back). A move is open while its server, alive, still
    shows it: in VERIFY_RESIZE for a finished one, with a task for one under way or being
    settled; a record a reset or deleted server left is not (``ferry audit`` reports those).
    Only the drained hosts' cells are read: a move records its migration in the cell of each
    host it touches. ``own`` names the migrations of the drain's own moves. Sorted ids."""
    left = {instance.uuid for _cell, instance, _bfv in _instances_on(drain)}
    candidates: list[tuple[str, str]] = []
    for cell in _by_cell(drain.target_kind, list(drain.targets)):
        with cell_session(cell) as session:
            query = select(Migration.uuid, Migration.instance_uuid, Migration.status).where(
                Migration.deleted.is_(False), Migration.status.in_(_OPEN_MOVE_STATUSES))
            if drain.target_kind == HOST:
                query = query.where(or_(Migration.source_compute.in_(drain.targets),
                                        Migration.dest_compute.in_(drain.targets)))
            candidates.extend((instance_uuid, status) for uuid, instance_uuid, status in session.execute(query)
                              if uuid not in own and instance_uuid not in left)
    left.update(uuid for uuid, status in candidates if _shows_open_move(uuid, status))
    return sorted(left)


def _shows_open_move(instance_uuid: str, status: str) -> bool:
    """Whether the server, alive, still shows a move whose migration is ``status``."""
    try:
        cell = instances.cell_of(instance_uuid)
    except errors.InstanceNotFound:
        return False
    with cell_session(cell) as session:
        live = session.execute(select(Instance.vm_state, Instance.task_state).where(
            Instance.uuid == instance_uuid, Instance.deleted.is_(False), Instance.hidden.is_(False))).first()
    return live is not None and _shows(status, live.vm_state, live.task_state)


def _unmovable_reason(instance: Instance) -> str | None:
    if instance.vm_state not in _MOVABLE:
        return f"The server is {instance.vm_state}; only active and stopped servers can be moved."
    if instance.task_state is not None:
        return f"The server is busy ({instance.task_state})."
    return None


def _plan_spec(drain: Drain, cell: str, instance: Instance, is_bfv: bool, base: Mapping[str, Any],
               cell_names: list[str]) -> dict[str, Any]:
    """The scheduler request the move would make, as the resize workflow builds it, minus the drained hosts."""
    ignore = {instance.host or ""}
    if drain.target_kind == HOST:
        ignore.update(drain.targets)
    ignore.discard("")
    if drain.target_kind == CELL:
        allowed = [name for name in cell_names if name != cell]
    elif drain.allow_cross_cell:
        allowed = list(cell_names)
    else:
        allowed = [cell]
    spec = {**base, "instance_uuid": instance.uuid, "project_id": instance.project_id, "user_id": instance.user_id,
            "flavor": instance.flavor, "is_bfv": bool(base.get("is_bfv", is_bfv)), "ignore_hosts": sorted(ignore),
            "requested_destination": None, "allowed_cells": allowed, "source_cell": cell,
            "may_leave_cell": drain.target_kind == CELL or bool(drain.allow_cross_cell)}
    if drain.target_kind == CELL:
        spec["cross_cell_move_weight_multiplier"] = CELL_DRAIN_CROSS_CELL_MULTIPLIER
    return spec


def _request_specs(instance_uuids: list[str]) -> dict[str, dict[str, Any]]:
    with api_session() as session:
        specs: dict[str, dict[str, Any]] = {}
        for uuid in instance_uuids:
            try:
                specs[uuid] = compute_api.load_request_spec(session, uuid)
            except errors.NotFound:
                specs[uuid] = {}
        return specs


def _size(instance: Instance) -> tuple[int, int, int]:
    flavor = instance.flavor or {}
    return (int(flavor.get("memory_mb") or 0), int(flavor.get("vcpus") or 0), int(flavor.get("root_gb") or 0))


def plan_server(drain: Drain, cell: str, instance: Instance, is_bfv: bool, base: Mapping[str, Any],
                pending: dict[str, dict[str, int]], cell_names: list[str],
                avoid: Iterable[str] = (),
                group_moves: dict[str, list[tuple[str, str]]] | None = None) -> tuple[scheduler.Selection | None, str]:
    """Where one server would go with ``pending`` counted as used; adds the choice to ``pending``.
    ``avoid`` names hosts not to choose. ``group_moves`` (server group uuid to the ``(from host,
    to host)`` of its members planned so far) is counted by the server's group policy, and the
    choice added to it.

    Returns:
        ``(selection, "")``, or ``(None, why not)``.
    """
    spec = _plan_spec(drain, cell, instance, is_bfv, base, cell_names)
    spec["ignore_hosts"] = sorted({*spec["ignore_hosts"], *avoid})
    group = (base.get("group") or {}).get("uuid")
    planned = (group_moves or {}).get(group, []) if group else []
    try:
        selection = scheduler.plan_destination(spec, pending, planned)
    except errors.NoValidHost as exc:
        return None, exc.message
    for rp_uuid, resources in selection.allocations.items():
        used = pending.setdefault(rp_uuid, {})
        for rc, amount in resources.items():
            used[rc] = used.get(rc, 0) + int(amount)
    if group_moves is not None and group:
        group_moves.setdefault(group, []).append((instance.host or "", selection.host))
    return selection, ""


def plan(drain_uuid: str) -> dict[str, Any]:
    """Plan the drain: one ``drain_servers`` row per server, with its planned host or why it has none.

    Servers are planned largest first (RAM, then vCPUs, then disk), each with the capacity the
    servers planned before it took counted as used. They are then moved (the plan's order, the
    Map's items) round-robin by source host, each host's largest first (see
    :func:`_round_robin_by_source`). Planning again replaces the earlier plan
    (a step run twice writes the same rows). A drain that is final by the time the plan would
    be written (finished meanwhile, its workflow having ended) keeps its rows as announced: the
    plan is not written, and the answer is what they record.

    Returns:
        ``{"fits", "servers": [instance uuids to move, in plan order], "unplaceable": n}``.
    """
    with api_session() as session:
        drain = _load(session, drain_uuid)
        session.expunge(drain)
    found = _instances_on(drain)
    inline = _planned_inline(drain.dry_run, drain.origin)
    try:  # servers came since the drain was accepted
        _check_size(", ".join(drain.targets), len(found), dry_run=inline)
    except errors.DrainTooLarge as exc:
        if inline:  # answered now: nothing to announce, and the same request is refused afresh
            _set_status(drain_uuid, FAILED, message=exc.message, release_key=True, only_from=PLANNING,
                        nothing_to_announce=True)
        raise
    specs = _request_specs([instance.uuid for _cell, instance, _bfv in found])
    cell_names = [c.name for c in all_cells(include_cell0=False)]
    pending: dict[str, dict[str, int]] = {}
    group_moves: dict[str, list[tuple[str, str]]] = {}
    rows: list[DrainServer] = []
    ordered = sorted(found, key=lambda item: _size(item[1]), reverse=True)
    for cell, instance, is_bfv in ordered:
        row = DrainServer(drain_id=drain.id, instance_uuid=instance.uuid, name=instance.display_name,
                          cell=cell, source_host=instance.host or "", vm_state=instance.vm_state, state=PENDING,
                          attempts=0)
        reason = _unmovable_reason(instance)
        selection = None
        if reason is None:
            selection, reason = plan_server(drain, cell, instance, is_bfv, specs[instance.uuid], pending, cell_names,
                                            group_moves=group_moves)
        if selection is None:
            row.state, row.error = UNPLACEABLE, reason
        else:
            row.planned_host, row.planned_cell = selection.host, selection.cell
        rows.append(row)
    rows = _round_robin_by_source(rows)
    for position, row in enumerate(rows):
        row.position = position
    fits = all(row.state != UNPLACEABLE for row in rows)
    with api_session() as session:
        live = _load(session, drain_uuid, for_update=True)
        if _ended_before(live, None, "PlanDrain"):
            recorded = _servers(session, live)
            return {"fits": live.fits, "servers": [row.instance_uuid for row in recorded if row.state == PENDING],
                    "unplaceable": sum(row.state == UNPLACEABLE for row in recorded)}
        for old in _servers(session, live):
            session.delete(old)
        session.flush()
        session.add_all(rows)
        live.fits = fits
        if live.dry_run:
            live.status, live.finished_at = PLANNED, utcnow()
        live.updated_at = utcnow()
        to_move = [row.instance_uuid for row in rows if row.state == PENDING]
    logger.info("drain planned", extra={"drain": drain_uuid, "servers": len(rows), "fits": fits,
                                        "unplaceable": len(rows) - len(to_move)})
    return {"fits": fits, "servers": to_move, "unplaceable": len(rows) - len(to_move)}


def _round_robin_by_source(rows: list[DrainServer]) -> list[DrainServer]:
    """``rows`` (largest first) taken one per source host in turn, each host's in their order.

    The Map starts its iterations in the plan's order: with every host's servers together, its
    concurrent slots would fill with one host's servers waiting for ``max_per_source_host``
    while the other hosts' servers queue behind them. Hosts take their turns in the order of
    their largest server.
    """
    by_host: dict[str, list[DrainServer]] = {}
    for row in rows:
        by_host.setdefault(row.source_host, []).append(row)
    turns = max((len(queue) for queue in by_host.values()), default=0)
    return [queue[turn] for turn in range(turns) for queue in by_host.values() if turn < len(queue)]


# --- disabling and giving back -------------------------------------------------------------------


def _target_services(drain: Drain) -> list[services.ServiceRecord]:
    """The compute services of the drained hosts, or of every host of the drained cell."""
    if drain.target_kind == HOST:
        return [record for host in drain.targets for record in services.list_services(host=host)]
    return [record for record in services.list_services() if record.cell == drain.targets[0]]


def disable_targets(drain_uuid: str) -> list[str]:
    """Disable the compute service of every drained host (the reason names the drain).

    Services disabled already (by an operator or an earlier run) are left as they are, and so is
    one disabled by someone else between the read and the write (the write is conditional); the
    ones this drain disabled are recorded so a drain that moves nothing can give them back. A service
    still disabled by a drain that has ended is taken over (its reason names this drain, not
    recorded as this drain's to give back, unless the ended drain still owed it back): the ended
    drain, giving back what it disabled, would otherwise enable it under this one.

    Returns:
        The hosts this drain has disabled.
    """
    with api_session() as session:
        drain = _load(session, drain_uuid)
        session.expunge(drain)
    reason = (f"drain {drain.uuid}" + (f": {drain.reason}" if drain.reason else ""))[:255]
    taken = [(record, other) for record in _target_services(drain)
             if record.disabled and (other := _drain_named_by(record.disabled_reason))
             and other != drain.uuid and _is_final(other)]
    # A host an ended drain still owes back (it moved nothing, and its give-back has not run or
    # failed) becomes this drain's to give back: recorded before the take-over, as below.
    owed = {record.host for record, other in taken if _owes_back(other, record.host)}
    if owed - set(drain.disabled_hosts):
        _record_disabled_hosts(drain_uuid, sorted(set(drain.disabled_hosts) | owed))
    for record, other in taken:
        services.change_disabled_from(record, f"drain {other}", disabled=True, disabled_reason=reason)
    # Read again: a service an ended drain gave back meanwhile is enabled now, and disabled below.
    enabled = [record for record in _target_services(drain) if not record.disabled]
    kept = set(drain.disabled_hosts) | owed
    # Recorded before any service changes, so a run that stops half-way can still give them back
    # (giving back enables only a service whose reason names this drain).
    meant = kept | {record.host for record in enabled}
    _record_disabled_hosts(drain_uuid, sorted(meant))
    ours = kept | {record.host for record in enabled if _disable_if_enabled(record, reason)}
    if ours != meant:  # someone else disabled some in between: those are not the drain's
        _record_disabled_hosts(drain_uuid, sorted(ours))
    return sorted(ours)


def _disable_if_enabled(record: services.ServiceRecord, reason: str) -> bool:
    """Disable the service with ``reason`` only while it is enabled (one conditional UPDATE), and
    say whether it was: one an operator disabled since it was read keeps the operator's reason,
    and is not the drain's to give back."""
    with cell_session(record.cell) as session:
        changed = cast(CursorResult[Any], session.execute(
            update(Service).where(Service.uuid == record.uuid, Service.disabled.is_(False))
            .values(disabled=True, disabled_reason=reason, updated_at=utcnow())
            .execution_options(synchronize_session=False))).rowcount == 1
    if changed:
        logger.info("compute service updated", extra={"host": record.host, "disabled": True,
                                                      "disabled_reason": reason})
    else:
        logger.info("compute service disabled by someone else meanwhile; left as it is",
                    extra={"host": record.host})
    return changed


def _drain_named_by(disabled_reason: str | None) -> str | None:
    """The drain a service's disabled reason names (``drain <id>[: reason]``), if any."""
    words = (disabled_reason or "").split(maxsplit=2)
    if len(words) < 2 or words[0] != "drain":
        return None
    candidate = words[1].rstrip(":")
    try:
        return str(uuidlib.UUID(candidate)) if len(candidate) == 36 else None
    except ValueError:
        return None


def _is_final(drain_uuid: str) -> bool:
    with api_session() as session:
        status = session.scalars(select(Drain.status).where(Drain.uuid == drain_uuid)).one_or_none()
    return status in FINAL_STATUSES


def _gives_back(drain: Drain, servers: list[DrainServer]) -> bool:
    """Whether a final drain gives its hosts back: cancelled, or failed by its workflow (its plan
    could not be made, its execution ended), before any move was tried. A drain that failed
    otherwise (its hosts still hold servers, its servers waited past its iterations' life) keeps
    them disabled."""
    return not any(server.attempts for server in servers) and (
        drain.status == CANCELLED
        or (drain.status == FAILED and (drain.message or "").startswith(WORKFLOW_FAILED)))


def _owes_back(drain_uuid: str, host: str) -> bool:
    """Whether the final drain ``drain_uuid`` gives ``host`` back and has not yet."""
    with api_session() as session:
        drain = _load(session, drain_uuid)
        return host in drain.disabled_hosts and _gives_back(drain, _servers(session, drain))


def give_back_targets(drain_uuid: str) -> list[str]:
    """Enable again the services this drain disabled, if they still carry its reason (idempotent:
    a service enabled since, or disabled again for another reason, is left as it is)."""
    with api_session() as session:
        drain = _load(session, drain_uuid)
        disabled = list(drain.disabled_hosts)
    enabled: list[str] = []
    for host in disabled:
        for record in services.list_services(host=host):
            # Conditional: a drain that took the service over since keeps it disabled.
            if services.change_disabled_from(record, f"drain {drain_uuid}", disabled=False):
                enabled.append(host)
    if disabled:
        _record_disabled_hosts(drain_uuid, [])
    return enabled


def _record_disabled_hosts(drain_uuid: str, disabled: list[str]) -> None:
    """Record the hosts this drain disabled, leaving its ``updated_at`` as it is: the list is
    bookkeeping the drain's view does not show, and a final drain's view stays as its end was
    announced (a FinishDrain run again gives hosts back, and announces the same view)."""
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == drain_uuid)
                        .values(disabled_hosts=disabled, updated_at=Drain.updated_at))


# --- move slots and results ----------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """What a Map iteration does next: ``move`` (with the attempt's ids), ``wait`` or ``stop``."""

    action: str
    migration_uuid: str | None = None
    request_id: str | None = None
    attempt: int = 0
    confirm: bool = True  # confirm the move (False: the server stays in VERIFY_RESIZE)

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.action, "migration_uuid": self.migration_uuid, "request_id": self.request_id,
                "attempt": self.attempt, "confirm": self.confirm}


# A waiting iteration looks again after DrainPollSeconds at first, then after a sixtieth of the
# time it has run, up to five minutes: each look writes about nine events into the iteration's
# execution history (25,000 at most), so it can wait for days (a long pause, a long queue for a
# host) rather than for hours, and a resume still takes effect within minutes.
_WAIT_GROWTH = 60
_LONGEST_WAIT_SECONDS = 300
_DEFAULT_POLL_SECONDS = 10


def wait_seconds(poll_seconds: int | None, iteration_started_at: str | None,
                 now: dt.datetime | None = None) -> int:
    """How long a waiting drain iteration that started at ``iteration_started_at`` (ISO 8601, as
    Step Functions gives ``$$.Execution.StartTime``) waits before it looks again."""
    poll = poll_seconds or _DEFAULT_POLL_SECONDS
    try:
        started = dt.datetime.fromisoformat(str(iteration_started_at))
    except ValueError:
        return poll
    if started.tzinfo is None:
        started = started.replace(tzinfo=dt.UTC)
    ran = ((now or utcnow()).replace(tzinfo=dt.UTC) - started).total_seconds()
    return int(min(max(poll, ran // _WAIT_GROWTH), max(poll, _LONGEST_WAIT_SECONDS)))


def _attempt_ids(drain_uuid: str, instance_uuid: str, attempt: int) -> tuple[str, str]:
    return (_derived_uuid(drain_uuid, instance_uuid, attempt),
            "req-" + _derived_uuid("request", drain_uuid, instance_uuid, attempt))


def _busy_hosts(session: Session, drain: Drain) -> tuple[dict[str, int], dict[str, int]]:
    """How many of the drain's moves are under way off each source host and onto each planned host."""
    sources: dict[str, int] = defaultdict(int)
    dests: dict[str, int] = defaultdict(int)
    for source_host, planned_host in session.execute(
            select(DrainServer.source_host, DrainServer.planned_host)
            .where(DrainServer.drain_id == drain.id, DrainServer.state == MOVING)):
        sources[source_host] += 1
        if planned_host:
            dests[planned_host] += 1
    return sources, dests


def acquire_slot(drain_uuid: str, instance_uuid: str) -> Slot:
    """Decide whether the server's move starts now, waits, or is not made.

    ``wait`` while the drain is paused or a per-host limit is reached; ``stop`` once the server
    is settled, the drain is being cancelled (a pending server is then ``cancelled``) or the
    drain has ended (final: nothing changes);
    ``move`` marks it ``moving`` and hands out the ids of this attempt; every answer says whether
    the drain confirms its moves. A pending server that no longer exists (deleted since it was
    planned, or since its last try) is recorded ``gone`` and gets ``stop``: no move starts for
    it, and it is neither planned again nor failed. A pending server that left the drained hosts
    by a move of its own (its owner resized or migrated it meanwhile: see :func:`_host_off_targets`)
    is recorded ``done`` where it is and gets ``stop``: it is not moved again. The drain row is locked
    (and its version bumped) so two iterations cannot both take the last slot of a host. A
    server already ``moving`` gets its attempt again (the step ran twice). A server to be tried
    again (its earlier attempt failed) is planned again first, so the per-host limits count the
    host it will go to; one no host takes any more fails (``stop``), and so does one still busy
    with an operation of its own (see :func:`_planned_again`). That holds for a retry whose
    row still names a planned host too (a retry recorded with the host of its failed attempt):
    PrepareMove plans only a server that has none, so the retry would otherwise go to that host
    unchecked.
    """
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        # A retry is planned afresh whatever host it has; a server without a plan is planned too.
        replan = server.state == PENDING and (server.attempts > 0 or server.planned_host is None) \
            and drain.status == RUNNING
        waiting = server.state == PENDING and drain.status not in FINAL_STATUSES
        kind, targets = drain.target_kind, list(drain.targets)
    # Read before the drain's row is taken again: the cells are read in sessions of their own.
    seen = _look(instance_uuid, kind, targets) if waiting else None
    if seen is not None and seen.gone:
        _record_gone_before_move(drain_uuid, instance_uuid)
        replan = False  # the look below answers stop for the server settled, or the drain ended
    elif seen is not None and seen.moved_off_to is not None:
        _record_moved_off(drain_uuid, instance_uuid, seen.moved_off_to, state=PENDING, step="AcquireSlot")
        replan = False
    if replan and (unplanned := _planned_again(drain_uuid, instance_uuid)) is not None:
        return Slot(unplanned, confirm=bool(drain.options.get("confirm", True)))
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        confirm = bool(drain.options.get("confirm", True))
        if server.state in SETTLED_STATES or _ended_before(drain, server, "AcquireSlot"):
            return Slot("stop", confirm=confirm)
        if server.state == MOVING:
            migration_uuid, request_id = _attempt_ids(drain_uuid, instance_uuid, server.attempts)
            return Slot("move", migration_uuid, request_id, server.attempts, confirm)
        if drain.status == CANCELLING:
            server.state, server.finished_at = SERVER_CANCELLED, utcnow()
            return Slot("stop", confirm=confirm)
        if drain.status == PAUSED or server.planned_host is None:  # resumed meanwhile: planned at the next look
            return Slot("wait", confirm=confirm)
        sources, dests = _busy_hosts(session, drain)
        per_source = drain.options.get("max_per_source_host")
        per_dest = drain.options.get("max_per_dest_host")
        if (per_source and sources[server.source_host] >= per_source) or (
                per_dest and server.planned_host and dests[server.planned_host] >= per_dest):
            if server.attempts:  # a server tried again is planned afresh at its next look, when it may go
                server.planned_host = server.planned_cell = None
            return Slot("wait", confirm=confirm)
        server.state = MOVING
        server.attempts += 1
        server.started_at = server.started_at or utcnow()
        server.migration_uuid, request_id = _attempt_ids(drain_uuid, instance_uuid, server.attempts)
        drain.version += 1
        return Slot("move", server.migration_uuid, request_id, server.attempts, confirm)


def _record_gone_before_move(drain_uuid: str, instance_uuid: str) -> None:
    """Record ``gone`` a server deleted before its (next) move started, while it is still
    ``pending`` and the drain has not ended (a drain's final records stay as announced)."""
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        if server.state != PENDING or _ended_before(drain, server, "AcquireSlot"):
            return
        server.state, server.finished_at = GONE, utcnow()
        server.error = (f"The server no longer exists: it was deleted before its "
                        f"{'next try' if server.attempts else 'move'} started.")
        drain.version += 1
    logger.info("drain server deleted before its move started; recorded gone",
                extra={"drain": drain_uuid, "instance_uuid": instance_uuid})


def _load_server(session: Session, drain_uuid: str, instance_uuid: str) -> tuple[Drain, DrainServer]:
    drain = _load(session, drain_uuid, for_update=True)
    server = session.scalars(select(DrainServer).where(DrainServer.drain_id == drain.id,
                                                       DrainServer.instance_uuid == instance_uuid)).one_or_none()
    if server is None:
        raise errors.DrainNotFound(f"Server {instance_uuid} is not part of drain {drain_uuid}.")
    return drain, server


def _ended_before(drain: Drain, server: DrainServer | None, step: str) -> bool:
    """Whether ``drain`` is final, so that what one of its steps reports now changes nothing.

    A final drain's report was announced: its records stay as announced. A late report comes
    from a server's iteration (a child execution) still running when Ferry finished the drain,
    its workflow having ended (:func:`finish_if_workflow_ended`), or from the drain's own
    execution redriven after that (``server`` None: PlanDrain); a finished drain holds no
    per-host slot (it counts none), so ignoring the report leaks none. Logged with the drain
    and the server.
    """
    if drain.status not in FINAL_STATUSES:
        return False
    logger.warning("late drain step after the drain ended; nothing recorded",
                   extra={"drain": drain.uuid, "instance_uuid": server.instance_uuid if server else None,
                          "step": step, "status": drain.status, "state": server.state if server else None})
    return True


# How a server's error starts when its next try found it busy with an operation of its own.
_BUSY_AT_NEXT_TRY = "The server was busy"


def _planned_again(drain_uuid: str, instance_uuid: str) -> str | None:
    """Plan a server to be tried again: None once planned, else what its iteration does next.

    A plan that finds no host uses up a try: the server waits for the next look while tries are
    left, and is ``failed`` after (``cancelled`` when the drain no longer runs). So does a server
    still busy with an operation that is not the drain's (its owner stopping it, say, which
    made its last try fail: see :func:`record_failure`): its move would be refused again at
    once, so it is not planned, and it is tried after a wait while tries are left. A plan not
    written (the server settled, or the drain ended, meanwhile) answers None too: the look that
    follows finds out what the iteration does next.
    """
    busy = _where_now(instance_uuid).task_state
    if busy is not None:
        why = f"{_BUSY_AT_NEXT_TRY} ({busy}) when its next try came."
    else:
        try:
            _replan(drain_uuid, instance_uuid, state=PENDING, step="AcquireSlot")
            return None
        except errors.NoValidHost as exc:
            why = f"No host takes it for another try: {exc.message}"
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        if _ended_before(drain, server, "AcquireSlot"):
            return "stop"
        if server.state != PENDING:
            return "stop" if server.state in SETTLED_STATES else "wait"
        # The first look after the try its owner's operation refused comes at once: it waits
        # without spending a try; each further look that finds the server busy spends one.
        waited_once = busy is not None and (server.error or "").startswith(_BUSY_AT_NEXT_TRY)
        server.error = why
        drain.version += 1
        retries = int(drain.options.get("retries", DEFAULT_RETRIES))
        if drain.status not in (RUNNING, PAUSED):
            server.state, server.finished_at = SERVER_CANCELLED, utcnow()
        elif busy is not None and not waited_once:
            return "wait"
        elif server.attempts < retries:  # this look uses up a try, and another is left for the next
            server.attempts += 1
            return "wait"
        else:  # this look used up the last try
            server.attempts = min(server.attempts + 1, retries + 1)
            server.state, server.finished_at = SERVER_FAILED, utcnow()
    logger.warning("drain server cannot be tried again", extra={"drain": drain_uuid, "instance_uuid": instance_uuid,
                                                                 "error": why})
    return "stop"


def _failed_destination(cell: str, drain_uuid: str, instance_uuid: str, attempts: int) -> str | None:
    """The destination of the server's last attempt that made a move (a try whose plan found no
    host made none), which failed; None before any."""
    tried = [_attempt_ids(drain_uuid, instance_uuid, attempt)[0] for attempt in range(attempts, 0, -1)]
    if not tried:
        return None
    with cell_session(cell) as session:
        found = {row.uuid: row.dest_compute for row in session.execute(
            select(Migration.uuid, Migration.dest_compute).where(Migration.uuid.in_(tried)))}
    return next((found[uuid] for uuid in tried if found.get(uuid)), None)


def _replan(drain_uuid: str, instance_uuid: str, *, state: str, step: str) -> str | None:
    """A fresh destination for a server whose earlier attempt failed.

    The moves of the drain's other servers under way are real by now (the scheduler counts their
    claims); its group's members whose destination is not claimed yet (waiting behind the
    drain's concurrency, or moving before their claim landed) are counted where the plan puts
    them, as the plan counted them, so that a retry does not take the place planned for one.

    The plan is written only while the server is still in ``state`` (``pending`` at AcquireSlot,
    ``moving`` at PrepareMove) and the drain has not ended: a plan made while the drain was
    finished (or the server settled) would change rows already announced.

    Returns:
        The planned host, or None when nothing was written: the caller's ``step`` stops there.

    Raises:
        NoValidHost.
    """
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        session.expunge(drain)
        cell, attempts = server.cell, server.attempts
    with cell_session(cell) as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == instance_uuid)).one()
        bfv = instances.is_bfv(session, instance_uuid)
        session.expunge(instance)
    base = _request_specs([instance_uuid])[instance_uuid]
    cells = [c.name for c in all_cells(include_cell0=False)]
    failed_at = _failed_destination(cell, drain_uuid, instance_uuid, attempts)
    group = (base.get("group") or {}).get("uuid")
    members_planned = _members_planned_unclaimed(drain.id, instance_uuid, group) if group else []
    # A retry prefers another host than the one its last attempt failed on (as a move's reschedule
    # does), and goes back there only when no other host takes it.
    selection, reason = plan_server(drain, cell, instance, bfv, base, {}, cells, avoid=[failed_at] if failed_at else [],
                                    group_moves={group: list(members_planned)} if group else None)
    if selection is None and failed_at:
        selection, reason = plan_server(drain, cell, instance, bfv, base, {}, cells,
                                        group_moves={group: list(members_planned)} if group else None)
    if selection is None:
        raise errors.NoValidHost(reason)
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        if _ended_before(drain, server, step) or server.state != state:
            return None
        server.planned_host, server.planned_cell = selection.host, selection.cell
    return selection.host


def _members_planned_unclaimed(drain_id: int, instance_uuid: str, group_uuid: str) -> list[tuple[str, str]]:
    """``(from host, to host)`` of the other members of ``group_uuid`` the drain has planned whose
    destination is not claimed yet: those waiting for their turn, and those whose move started
    before its claim landed (the scheduler counts a member where it holds allocations)."""
    with api_session() as session:
        rows = session.execute(
            select(DrainServer.instance_uuid, DrainServer.state, DrainServer.source_host, DrainServer.planned_host)
            .join(InstanceGroupMember, InstanceGroupMember.instance_uuid == DrainServer.instance_uuid)
            .join(InstanceGroup, InstanceGroup.id == InstanceGroupMember.group_id)
            .where(DrainServer.drain_id == drain_id, DrainServer.state.in_((PENDING, MOVING)),
                   DrainServer.instance_uuid != instance_uuid, DrainServer.planned_host.is_not(None),
                   InstanceGroup.uuid == group_uuid)
            .order_by(DrainServer.position)).all()
    return [(source, cast(str, planned)) for member, state, source, planned in rows
            if state == PENDING or not _holds_on(member, cast(str, planned))]


def _holds_on(consumer_uuid: str, host: str) -> bool:
    """Whether ``consumer_uuid`` holds allocations on ``host``'s provider."""
    try:
        return placement.provider_by_host(host) in placement.get_allocations(consumer_uuid)
    except errors.ResourceProviderNotFound:
        return False


def prepare_move(drain_uuid: str, instance_uuid: str, slot: Mapping[str, Any]) -> dict[str, Any]:
    """Accept the server's cold migration to its planned host; the workflow starts it as a nested execution.

    A retry goes to the host AcquireSlot planned it to. Idempotent per attempt: the migration id
    derives from the drain, the server and the attempt.

    Returns:
        ``{"name", "input"}`` of the resize workflow's execution.

    Raises:
        DrainInvalidState: the drain ended meanwhile (final), or the server settled while it
            was planned again: this iteration starts no move, and its RecordFailure records
            nothing for a drain that ended. (The check is not held while the move is accepted:
            a drain that ends in that moment has the move recorded failed, and the move runs or
            rolls back as any move does.)
        InstanceNotFound: the server no longer exists (deleted since AcquireSlot handed out
            the move): nothing is accepted, and RecordFailure records it ``gone``.
        DrainInvalidState: the server left the drained hosts by a move of its own (its owner
            resized or migrated it since AcquireSlot looked): it is recorded ``done`` where it
            is and no move is left accepted (:func:`_settle_moved_off`), and RecordFailure, where
            the workflow goes, finds it settled.
    """
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        if _ended_before(drain, server, "PrepareMove"):
            raise errors.DrainInvalidState(f"Drain {drain_uuid} is {drain.status}: it starts no more moves.")
        ctx = _drain_context(drain, slot["request_id"])
        planned = server.planned_host
        kind, targets = drain.target_kind, list(drain.targets)
    seen = _look(instance_uuid, kind, targets)
    if seen.gone:  # deleted since AcquireSlot: RecordFailure records it gone
        raise errors.InstanceNotFound(f"Server {instance_uuid} was deleted before its move started.")
    if seen.moved_off_to is not None:
        raise _settle_moved_off(drain_uuid, instance_uuid, seen.moved_off_to, slot)
    if planned is None:  # an attempt handed out before AcquireSlot planned retries (mid-update)
        planned = _replan(drain_uuid, instance_uuid, state=MOVING, step="PrepareMove")
    if planned is None:
        raise errors.DrainInvalidState(f"Drain {drain_uuid} no longer moves server {instance_uuid}: the drain "
                                       f"ended, or the server was settled, while it was planned again.")
    location = compute_api.locate(ctx, instance_uuid)
    try:
        execution = moves.prepare_migrate(ctx, location, planned, slot["migration_uuid"])
    except (errors.CannotMigrateToSameHost, errors.InstanceInvalidState) as exc:
        # Its owner's move may have ended between the look above and this one (on the planned host, say).
        if (elsewhere := _host_off_targets(kind, targets, instance_uuid)) is not None:
            raise _settle_moved_off(drain_uuid, instance_uuid, elsewhere, slot) from exc
        raise
    # The move was accepted from where the server was when its task was swapped (the migration's
    # source): a server its owner moved off the drained hosts since the look above is not moved again.
    accepted_from = _accepted_from(location, slot["migration_uuid"])
    if accepted_from is not None and location.cell is not None \
            and not _on_targets(kind, targets, location.cell.name, accepted_from):
        raise _settle_moved_off(drain_uuid, instance_uuid, accepted_from, slot)
    return {"name": execution.name, "input": execution.input}


def _accepted_from(location: compute_api.Location, migration_uuid: str) -> str | None:
    """The source host the move ``migration_uuid`` was accepted from (None when it is not recorded)."""
    if location.cell is None:
        return None
    with cell_session(location.cell) as session:
        return session.scalars(select(Migration.source_compute).where(Migration.uuid == migration_uuid)).first()


def _on_targets(kind: str, targets: list[str], cell: str, host: str) -> bool:
    """Whether a server on ``host`` in ``cell`` is on one of the drained hosts, or in the drained cell."""
    return cell in targets if kind == CELL else host in targets


def _host_off_targets(kind: str, targets: list[str], instance_uuid: str) -> str | None:
    """The host the server is on when it has left the drained hosts (or cell) by a move that is
    not the drain's, else None (see :func:`_look`). Call it outside any API database session."""
    return _look(instance_uuid, kind, targets).moved_off_to


def _record_moved_off(drain_uuid: str, instance_uuid: str, host: str, *, state: str, step: str) -> bool:
    """Record ``done`` on ``host`` a server that left the drained hosts by a move that is not the
    drain's (see :func:`_host_off_targets`), while it is still in ``state`` and the drain has not
    ended; return whether it was.

    It is where a drain's move would have left it, so the drain does not move it again (a second
    move from the host it is on now, or one refused because its owner's move took it to the host
    planned for it, would have failed the drain although the drained hosts no longer hold it).
    """
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        if server.state != state or _ended_before(drain, server, step):
            return False
        source = server.source_host
        server.state, server.dest_host, server.finished_at, server.error = DONE, host, utcnow(), None
        # No move of the drain's took it there: it counts in no average move (the ETA).
        server.started_at = server.migration_uuid = None
        drain.version += 1
    logger.info("drain server already left the drained hosts by a move that was not the drain's; recorded done "
                "without moving it", extra={"drain": drain_uuid, "instance_uuid": instance_uuid,
                                            "source_host": source, "host": host, "step": step})
    return True


def _settle_moved_off(drain_uuid: str, instance_uuid: str, host: str,
                      slot: Mapping[str, Any]) -> errors.DrainInvalidState:
    """Settle at PrepareMove a server that left the drained hosts (see :func:`_record_moved_off`),
    after undoing the move of this attempt if one was accepted (from the host it is on now).

    Returns:
        The error PrepareMove raises then, which sends its iteration to RecordFailure, where the
        server is found settled.

    Raises:
        MoveStillRunning: the workflow of this attempt's move runs (it never does before RunMove).
    """
    moves.abandon_prepared_move(instances.cell_of(instance_uuid).name, instance_uuid, slot["migration_uuid"],
                                slot["request_id"])
    _record_moved_off(drain_uuid, instance_uuid, host, state=MOVING, step="PrepareMove")
    return errors.DrainInvalidState(f"Drain {drain_uuid} no longer moves server {instance_uuid}: it left the "
                                    f"drained hosts by a move that was not the drain's, and is on {host}.")


def prepare_confirm(drain_uuid: str, instance_uuid: str, slot: Mapping[str, Any]) -> dict[str, Any]:
    """Accept the confirm of the server's move; ``{"name", "input"}`` of the confirm workflow's execution."""
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        ctx = _drain_context(drain, slot["request_id"])
    cell = instances.cell_of(instance_uuid).name
    execution = moves.prepare_confirm(cell, instance_uuid, slot["migration_uuid"],
                                      request_id=_confirm_request_id(slot), user_id=ctx.user_id,
                                      project_id=ctx.project_id)
    return {"name": execution.name, "input": execution.input}


def _confirm_request_id(slot: Mapping[str, Any]) -> str:
    """The request id the drain confirms the slot's move under."""
    return f"{slot['request_id']}-confirm"


@dataclass(frozen=True)
class _Whereabouts:
    """The server's visible copy now (Nones when it is gone), and the status there of the migration asked about."""

    host: str | None = None
    vm_state: str | None = None
    task_state: str | None = None
    migration_status: str | None = None


def _where_now(instance_uuid: str, migration_uuid: str | None = None) -> _Whereabouts:
    """Where the server is, read in its cell, with the status of ``migration_uuid`` there when given."""
    try:
        cell = instances.cell_of(instance_uuid)
    except errors.InstanceNotFound:
        return _Whereabouts()
    with cell_session(cell) as session:
        try:
            instance = instances.get(session, instance_uuid)
        except errors.InstanceNotFound:
            return _Whereabouts()
        status = None
        if migration_uuid:
            status = session.scalars(select(Migration.status).where(Migration.uuid == migration_uuid)).first()
        return _Whereabouts(instance.host, instance.vm_state, instance.task_state, status)


def _gone(instance_uuid: str) -> bool:
    """Whether the server no longer exists (see :func:`_look`). Call it outside any API database session."""
    return _look(instance_uuid).gone


@dataclass(frozen=True)
class _Look:
    """What one look at a server found (:func:`_look`)."""

    gone: bool
    # The host it is on when it left the drained hosts by a move that is not the drain's.
    moved_off_to: str | None = None


def _look(instance_uuid: str, kind: str | None = None, targets: Iterable[str] = ()) -> _Look:
    """Where the server is, read once in the cell its mapping names.

    ``gone``: the server no longer exists: its instance mapping is gone or queued for delete,
    or its instance in that cell is deleted (the mapping read again after: a move between cells
    that switched the mapping meanwhile, and purged the copy read, leaves a server that exists
    elsewhere). A server hidden in that cell (a move between cells switching over) still exists,
    and so does one whose delete is under way (task ``deleting``: its delete may yet fail) and one
    whose row that cell no longer holds.

    ``moved_off_to`` (with the drain's ``kind`` and ``targets``): the host the server is on when
    it left the drained hosts (or cell) by a move that is not the drain's. A server its owner
    resized or migrated during the drain (the scheduler sends it to a host not disabled) is on a
    host not drained (in another cell, for a drained cell), with no move to or from the drained
    hosts still open (for a drained cell, no move at all), whose revert would bring it back: as
    :func:`_left_on_targets` counts them, one in VERIFY_RESIZE for a finished move, with a task
    for one under way or being confirmed or reverted. None for a server on a drained host, one
    not on any host, one hidden, and one gone.

    Call it outside any API database session.
    """
    mapped = _mapped_cell(instance_uuid)
    if mapped is None:
        return _Look(gone=True)
    if mapped == "":  # not scheduled yet: not a server a drain found on a host
        return _Look(gone=False)
    moves_open: list[Any] = []
    with cell_session(mapped) as session:
        row = session.execute(select(Instance.deleted, Instance.hidden, Instance.host, Instance.vm_state,
                                     Instance.task_state).where(Instance.uuid == instance_uuid)).first()
        live = row is not None and not row.deleted and not row.hidden
        if live and kind is not None:
            moves_open = list(session.execute(select(
                Migration.status, Migration.source_compute, Migration.dest_compute).where(
                Migration.instance_uuid == instance_uuid, Migration.deleted.is_(False),
                Migration.status.in_(_OPEN_MOVE_STATUSES))))
    if row is not None and row.deleted:
        return _Look(gone=_mapped_cell(instance_uuid) == mapped)
    if row is None or not live or kind is None or not row.host:
        return _Look(gone=False)
    targets = list(targets)
    if _on_targets(kind, targets, mapped, row.host):
        return _Look(gone=False)
    for status, source, dest in moves_open:
        if _shows(status, row.vm_state, row.task_state) and (kind == CELL or source in targets or dest in targets):
            return _Look(gone=False)
    return _Look(gone=False, moved_off_to=str(row.host))


def _mapped_cell(instance_uuid: str) -> str | None:
    """The name of the cell the server's mapping names; "" before it is scheduled; None when the
    mapping is gone or queued for delete (the server's delete finished)."""
    with api_session() as session:
        mapping = session.scalars(select(InstanceMapping).where(
            InstanceMapping.instance_uuid == instance_uuid)).one_or_none()
        if mapping is None or mapping.queued_for_delete:
            return None
        return mapping.cell.name if mapping.cell is not None else ""


def record_moved(drain_uuid: str, instance_uuid: str, *, confirmed: bool,
                 migration_uuid: str | None = None) -> dict[str, Any]:
    """Record a server's finished move (idempotent). A drain that leaves its moves in
    VERIFY_RESIZE (not ``confirmed``) takes one its owner confirmed already, its migration
    (``migration_uuid``) ``confirmed``, as moved too, as RecordFailure does.

    A drain that ended meanwhile (final) records nothing more: the server's row stays as the
    drain's report announced it, and the step is done.

    Raises:
        MoveNotPrepared: the server is not where a finished move leaves it (still on its source,
            or not in VERIFY_RESIZE/confirmed as asked); the caller records the failure.
    """
    now = _where_now(instance_uuid, migration_uuid)
    host, vm_state, task_state = now.host, now.vm_state, now.task_state
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        if server.state == DONE or _ended_before(drain, server, "RecordMoved"):
            return _server_view(server)
        # Without ``confirmed``, a move its owner confirmed already is settled as a confirmed one.
        settled = confirmed or now.migration_status == migration_states.CONFIRMED
        expected = (states.ACTIVE, states.STOPPED) if settled else (states.RESIZED,)
        if host is None or host == server.source_host or vm_state not in expected or task_state is not None:
            raise errors.MoveNotPrepared(
                f"Server {instance_uuid} is on {host} in {vm_state}/{task_state} after its move from "
                f"{server.source_host}.")
        server.state, server.dest_host, server.finished_at, server.error = DONE, host, utcnow(), None
        return _server_view(server)


def record_failure(drain_uuid: str, instance_uuid: str, slot: Mapping[str, Any],
                   error: Mapping[str, Any] | None, confirm_slot: str | None = None) -> dict[str, Any]:
    """Record a failed attempt; say whether to try again, or to go on to the confirm.

    A move, or the drain's confirm of it, accepted whose workflow never started is undone first
    (while either workflow still runs, nothing is done). A step that failed although the
    move completed as the drain asks (the nested execution's result lost, say, or RecordMoved
    out of retries) records the server ``done``: moved and confirmed, or moved and in
    VERIFY_RESIZE when the drain keeps servers there. A drain that confirms goes on to confirm a
    move that finished (VERIFY_RESIZE on another host) although the step waiting for it failed,
    once per attempt: ``confirm_slot`` is the request id of the attempt whose confirm the
    workflow already went to, and then the server is failed instead ("confirm or revert it").
    A server that no longer exists (deleted during the drain) is ``gone``, never tried again.
    Otherwise the server is tried again when it is back on its source unchanged (its move
    rolled back), or on its source busy with an operation that is not this try's move (its
    owner stopping it, say: the move was refused; the retry waits for it, see
    :func:`_planned_again`), attempts are left (``retries``) and the drain is still running or
    paused; or it is ``failed`` with the error. A drain that ended meanwhile (final) records nothing more
    and tries nothing again (the outcome settles the iteration), but what it accepted and never
    started is still undone, and a move that finished still goes on to its confirm (once per
    attempt, when the drain confirms): the server would otherwise stay busy, or its move hold
    its allocation on the drained host, for good.

    Returns:
        ``{"retry": bool, "confirm": bool, "state", "error"}``: ``confirm`` sends the workflow
        to PrepareConfirm.

    Raises:
        MoveStillRunning: the step that waited for the move, or for its confirm, failed while
            that workflow still runs (nothing is recorded; the workflow retries this step until
            it has ended).
    """
    message = workflows.error_message(dict(error or {})) if error else "The move failed."
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        cell, retries, status = server.cell, int(drain.options.get("retries") or 0), drain.status
        confirm = bool(drain.options.get("confirm", True))
        if server.state in SETTLED_STATES and status not in FINAL_STATUSES:  # recorded already: the step ran twice
            return {"retry": False, "confirm": False, "state": server.state, "error": server.error}
    migration_uuid = slot.get("migration_uuid")
    if migration_uuid and slot.get("request_id"):
        _abandon_unstarted(cell, instance_uuid, migration_uuid, slot)
    now = _where_now(instance_uuid, migration_uuid)
    host, vm_state, task_state = now.host, now.vm_state, now.task_state
    gone = host is None and _gone(instance_uuid)
    # Waiting for its confirm or revert (not one under way, as after a failed RunConfirm).
    move_finished = now.migration_status == migration_states.FINISHED
    this_move_open = now.migration_status in _OPEN_MOVE_STATUSES
    with api_session() as session:
        drain, server = _load_server(session, drain_uuid, instance_uuid)
        ended = _ended_before(drain, server, "RecordFailure")
        if not ended and _completed_as_asked(now, server.source_host, confirm=confirm):
            server.state, server.dest_host, server.finished_at, server.error = DONE, host, utcnow(), None
            logger.warning("drain step failed after the move completed; recorded done",
                           extra={"drain": drain_uuid, "instance_uuid": instance_uuid, "host": host,
                                  "error": message})
            return {"retry": False, "confirm": False, "state": server.state, "error": None}
        awaits_confirm = host not in (None, server.source_host) and vm_state == states.RESIZED and \
            task_state is None and move_finished
        if confirm and awaits_confirm and confirm_slot != slot.get("request_id"):
            # Also once the drain ended: left unconfirmed, the move would hold its allocation on
            # the drained host for good. Nothing is recorded for it (the drain's records stay).
            logger.warning("drain step failed after the move finished; going on to confirm it",
                           extra={"drain": drain_uuid, "instance_uuid": instance_uuid, "host": host,
                                  "error": message, "status": status})
            return {"retry": False, "confirm": True, "state": server.state, "error": server.error if ended else None}
        if ended:
            return {"retry": False, "confirm": False, "state": server.state, "error": server.error}
        if gone:
            server.state, server.finished_at = GONE, utcnow()
            server.error = f"{GONE_MESSAGE.rstrip('.')}: {message}"
            logger.info("drain server deleted while it was moved; recorded gone",
                        extra={"drain": drain_uuid, "instance_uuid": instance_uuid, "error": message})
            return {"retry": False, "confirm": False, "state": server.state, "error": server.error}
        # Busy on its source with an operation that is not this try's move (its owner stopping it,
        # say, so that PrepareMove was refused): tried again, after a wait (see _planned_again).
        busy_otherwise = task_state is not None and not this_move_open
        back_home = host == server.source_host and vm_state in _MOVABLE and (task_state is None or busy_otherwise)
        retry = back_home and server.attempts <= retries and drain.status in (RUNNING, PAUSED)
        server.error = message
        if retry:
            # Planned again (AcquireSlot) with the capacity of that moment, before its limits are checked.
            server.state, server.planned_host, server.planned_cell = PENDING, None, None
        else:
            server.state, server.finished_at = SERVER_FAILED, utcnow()
            if host is None:
                server.error = f"{message} (the server is on no host)"
            elif host != server.source_host:
                server.dest_host = host
                if awaits_confirm:
                    server.error = f"{message.rstrip('.')}. The move itself finished on {host}: confirm or revert it."
        logger.warning("drain move failed", extra={"drain": drain_uuid, "instance_uuid": instance_uuid,
                                                   "retry": retry, "attempt": server.attempts, "error": message,
                                                   "status": status})
        return {"retry": retry, "confirm": False, "state": server.state, "error": server.error}


def _abandon_unstarted(cell: str, instance_uuid: str, migration_uuid: str, slot: Mapping[str, Any]) -> None:
    """Undo what the drain accepted for this move and whose workflow never started: the move
    (PrepareMove, in the source cell), then the confirm (PrepareConfirm, where the server is
    now: another cell after a cross-cell move).

    Raises:
        MoveStillRunning: the move's workflow, or its confirm's or revert's, still runs.
    """
    moves.abandon_prepared_move(cell, instance_uuid, migration_uuid, slot["request_id"])
    try:  # the server is looked for where it is now; a deleted one has nothing left to undo
        moves.abandon_prepared_confirm(instances.cell_of(instance_uuid).name, instance_uuid, migration_uuid,
                                       _confirm_request_id(slot))
    except errors.InstanceNotFound:
        pass


def _completed_as_asked(now: _Whereabouts, source_host: str, *, confirm: bool) -> bool:
    """Whether the server is where the drain's move leaves it: on another host with no task,
    confirmed (``confirm``) or waiting in VERIFY_RESIZE for its confirm or revert (or confirmed
    already by its owner)."""
    if now.host is None or now.host == source_host or now.task_state is not None:
        return False
    confirmed = now.vm_state in (states.ACTIVE, states.STOPPED) and now.migration_status == migration_states.CONFIRMED
    if confirm:
        return confirmed
    return confirmed or (now.vm_state == states.RESIZED and now.migration_status == migration_states.FINISHED)


def _wait_for_move(drain_uuid: str, instance_uuid: str) -> None:
    """Refuse to settle a ``moving`` server while its move's workflow, or its confirm's or
    revert's, still runs; undo what the drain accepted for it and never started, as RecordFailure
    does (:func:`_abandon_unstarted`).

    Settled, the server would no longer count against the drain's per-host and overall limits,
    and a move that outlasted RecordFailure's wait would run beside the ones started in its place.

    Raises:
        MoveStillRunning: a workflow of the server's last move still runs (SettleServer waits).
    """
    with api_session() as session:
        try:
            drain, server = _load_server(session, drain_uuid, instance_uuid)
        except errors.DrainNotFound:
            return
        if server.state != MOVING or drain.status in FINAL_STATUSES:
            return
        cell, slot = server.cell, _last_move_slot(drain_uuid, server)
    if slot is not None:
        _abandon_unstarted(cell, instance_uuid, slot["migration_uuid"], slot)


def settle_server(drain_uuid: str, instance_uuid: str, error: Mapping[str, Any] | None) -> dict[str, Any]:
    """The last step of a Map iteration whose bookkeeping failed (AcquireSlot or RecordFailure, after retries).

    The iteration will not move its server any more, so a server still ``pending`` or ``moving`` is
    recorded ``failed`` with the error: a server left ``moving`` would hold its per-host slot (see
    :func:`acquire_slot`) and make the other servers wait for ever; one deleted meanwhile is
    recorded ``gone`` instead, as RecordFailure would have. A ``moving`` server whose move's
    workflow still runs is not settled yet (:func:`_wait_for_move`): its slot is still taken. A
    server already settled, or no longer in the drain, is left as it is, and so is every server
    of a drain that ended (final). Idempotent.

    Returns:
        ``{"state", "error"}`` of the server (Nones when it is not in the drain).

    Raises:
        MoveStillRunning: the server is ``moving`` and its move's workflow still runs.
    """
    message = workflows.error_message(dict(error)) if error else "unknown error"
    gone = _gone(instance_uuid)  # read in the cells before the drain's row is taken
    _wait_for_move(drain_uuid, instance_uuid)
    with api_session() as session:
        try:
            drain, server = _load_server(session, drain_uuid, instance_uuid)
        except errors.DrainNotFound:
            return {"state": None, "error": None}
        if server.state not in SETTLED_STATES and not _ended_before(drain, server, "SettleServer"):
            was = server.state
            if gone:
                server.state, server.finished_at, server.error = GONE, utcnow(), GONE_MESSAGE
                drain.version += 1
                logger.info("drain server deleted during the drain; recorded gone",
                            extra={"drain": drain_uuid, "instance_uuid": instance_uuid, "was": was, "error": message})
                return {"state": server.state, "error": server.error}
            if was == MOVING:
                server.error = (f"The drain could not record the result of this server's move ({message}); "
                                f"see the server's actions and migrations.")
            elif server.attempts:
                server.error = f"The drain could not try this server's move again ({message})."
            else:
                server.error = f"The drain could not start this server's move ({message})."
            server.state, server.finished_at = SERVER_FAILED, utcnow()
            drain.version += 1
            logger.warning("drain server settled as failed", extra={"drain": drain_uuid, "instance_uuid": instance_uuid,
                                                                   "was": was, "error": message})
        return {"state": server.state, "error": server.error}


# --- starting and finishing ----------------------------------------------------------------------


def begin(execution_input: Mapping[str, Any], execution_name: str) -> dict[str, Any]:
    """The workflow's first step: load the drain the API recorded, or record one from the input.

    Raises:
        InvalidWorkflowInput: the input does not match ``drain.input.schema.json``.
        BadRequest, Forbidden, DrainInvalidState: the request in the input, as the API refuses it.
    """
    try:
        validation.check(dict(execution_input), INPUT_SCHEMA)
    except validation.SchemaMismatch as exc:
        raise errors.InvalidWorkflowInput(f"Invalid drain input: {exc.message}") from exc
    if execution_input.get("drain_uuid"):
        drain_uuid = execution_input["drain_uuid"]
    else:
        drain_uuid, _created = record_drain(operator_context(execution_input.get("request_id")),
                                            execution_input["drain"], origin=EXECUTION_ORIGIN,
                                            idempotency_key=f"execution:{execution_name}",
                                            execution_name=execution_name)
    with api_session() as session:
        drain = _load(session, drain_uuid)
        if drain.status in FINAL_STATUSES:
            raise errors.DrainInvalidState(f"Drain {drain_uuid} is {drain.status} already.")
        if drain.execution_name and drain.execution_name != execution_name:
            # Another execution would plan again under the first one's moves.
            raise errors.DrainInvalidState(f"Drain {drain_uuid} is run by execution {drain.execution_name}.")
        return {"drain_uuid": drain.uuid, "dry_run": drain.dry_run}


def start(drain_uuid: str) -> dict[str, Any]:
    """Disable the targets, plan, and decide whether to move (the PlanDrain step).

    Returns:
        ``{"proceed", "servers", "max_concurrency", "fits"}``; ``proceed`` is False for a dry
        run, a plan that does not fit (unless ``move_what_fits``), a drain cancelled meanwhile
        and a drain that ended (final). A drain cancelled before it disabled its targets
        disables nothing; one cancelled after gives them back, as does a plan that does not fit
        (nothing moved in either case). A drain final already (its execution redriven after
        Ferry finished it, :func:`finish_if_workflow_ended`) disables and plans nothing: its
        records stay as announced, and the workflow goes on to FinishDrain, which announces that
        end again. One that ends while this step runs keeps its rows (see :func:`plan`) and its
        disabled hosts, as a drain that failed does.
    """
    with api_session() as session:
        drain = _load(session, drain_uuid)
        max_concurrency = int(drain.options.get("max_concurrency") or DEFAULT_MAX_CONCURRENCY)
        if _ended_before(drain, None, "PlanDrain"):
            return {"proceed": False, "servers": [], "fits": drain.fits, "max_concurrency": max_concurrency}
        dry_run, options, cancelled = drain.dry_run, dict(drain.options), drain.status == CANCELLING
    if not dry_run and not cancelled:
        disable_targets(drain_uuid)
    result = plan(drain_uuid)
    proceed = not dry_run and bool(result["servers"]) and (result["fits"] or options.get("move_what_fits"))
    if not dry_run:
        with api_session() as session:
            drain = _load(session, drain_uuid, for_update=True)
            started = proceed and drain.status == PLANNING
            if started:
                drain.status, drain.started_at = RUNNING, drain.started_at or utcnow()
            elif proceed:
                proceed = drain.status in (RUNNING, PAUSED)
            cancelled, ended = drain.status == CANCELLING, drain.status in FINAL_STATUSES
        if started:
            _announce(drain_uuid, DRAIN_START)
        elif not proceed and not ended and (cancelled or not result["fits"]):
            # Nothing moves: a plan that does not fit, or a drain cancelled before its first move.
            give_back_targets(drain_uuid)
    return {"proceed": bool(proceed), "servers": result["servers"], "fits": result["fits"],
            "max_concurrency": max_concurrency}


def finish(drain_uuid: str, error: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Settle the drain's status from its servers, announce it, and return the report.

    ``completed`` when every server moved (or was deleted during the drain: ``gone``) and the
    hosts hold nothing else (see :func:`_left_on_targets`); ``cancelled`` after a cancel;
    ``failed`` when a server could not be moved or placed, the hosts still hold servers, or the
    workflow itself failed (``error``). Servers still pending (the Map stopped early) are marked
    cancelled; servers still moving (their iteration could not record the result) failed,
    pointing at the server's own records; either of them deleted meanwhile, ``gone``, and so is
    an unplaceable server deleted during a drain that moved what fits: it left the hosts as well.

    The final event (``drain.end`` or ``drain.error``, and the callback) is announced every time
    this runs for a drain that is not a dry run, final already or not: the status is committed
    before the announcement goes out, so a run that fails in between (or dies) leaves a final
    drain whose event may never have gone out, and the FinishDrain retry announces it again.
    Every announcement of the same event carries the same identity and timestamp (see
    :func:`_announce`), so consumers drop the repeats. Once the notification was put (delivered
    or not: it is logged and counted when not, and not tried again), ``announced_at`` records it,
    and then the callback is posted (within :data:`ferry.signing.CALLBACK_TIMEOUT_SECONDS`, never
    tried again by a later look, which a receiver that answers slowly would hold up for every
    look otherwise); a final drain without
    it is announced by the next look at it once its workflow has ended
    (:func:`finish_if_workflow_ended`). The report and the announcement are read in the
    transaction that settles the status: after its commit only giving back the hosts of a
    drain cancelled, or failed by its workflow, before any move was tried (every run, as
    :func:`give_back_targets` is idempotent),
    undoing what the drain accepted and never started (every run, see
    :func:`_abandon_left_behind`) and the announcement itself are left to do. Nothing written
    after the drain is final changes what it shows, so each announcement of its end carries
    the same summary.
    """
    with api_session() as session:
        drain = _load(session, drain_uuid)
        look = not (drain.status in FINAL_STATUSES or drain.dry_run or error)
        settles = drain.status not in FINAL_STATUSES and not drain.dry_run
        # A drain that moved what fits left its unplaceable servers where they were: one deleted
        # since has left the hosts too. (One whose plan did not fit moved nothing, and says so.)
        moved_what_fits = bool(drain.options.get("move_what_fits"))
        own, unsettled = set(), []
        for server in _servers(session, drain):
            if server.migration_uuid:
                own.add(server.migration_uuid)
            if settles and (server.state in (PENDING, MOVING) or (moved_what_fits and server.state == UNPLACEABLE)):
                unsettled.append(server.instance_uuid)
        session.expunge(drain)
    # Read before the drain's row is taken: the cells are read in sessions of their own.
    left = _left_on_targets(drain, own) if look else []
    deleted = {instance_uuid for instance_uuid in unsettled if _gone(instance_uuid)}
    with api_session() as session:
        drain = _load(session, drain_uuid, for_update=True)
        servers = _servers(session, drain)
        already_final = drain.status in FINAL_STATUSES
        if not already_final:
            for server in servers:
                if server.state in (PENDING, MOVING) and server.instance_uuid in deleted:
                    server.state, server.finished_at, server.error = GONE, utcnow(), GONE_MESSAGE
                elif server.state == UNPLACEABLE and server.instance_uuid in deleted:
                    server.state, server.finished_at = GONE, utcnow()
                    server.error = GONE_MESSAGE + (f" The plan had found no place for it: {server.error}"
                                                   if server.error else "")
                elif server.state == PENDING:
                    server.state, server.finished_at = SERVER_CANCELLED, utcnow()
                    server.error = server.error or "The drain ended before this server was moved."
                elif server.state == MOVING:
                    server.state, server.finished_at = SERVER_FAILED, utcnow()
                    server.error = ("The drain could not record the result of this server's move; "
                                    "see the server's actions and migrations.")
            counts = _counts(servers)
            # Servers deleted during the drain left its hosts too: named, never failed.
            gone = f", {counts['gone']} deleted during the drain" if counts["gone"] else ""
            if error:
                status, message = FAILED, f"{WORKFLOW_FAILED} {workflows.error_message(dict(error))}"
            elif drain.status == CANCELLING:
                status, message = CANCELLED, f"Cancelled: {counts['done']} of {counts['total']} servers moved{gone}."
            elif drain.fits is False and not drain.options.get("move_what_fits"):
                status = FAILED
                message = (f"The plan does not fit: {counts['unplaceable']} of {counts['total']} servers cannot "
                           f"be placed. Nothing was moved.")
            elif counts["failed"] or counts["unplaceable"] or counts["cancelled"]:
                status = FAILED
                message = (f"{counts['done']} of {counts['total']} servers moved; {counts['failed']} failed, "
                           f"{counts['unplaceable']} could not be placed"
                           + (f", {counts['cancelled']} not moved" if counts["cancelled"] else "") + gone + ".")
            elif left:
                status = FAILED
                message = (f"{_all_moved(counts)}, but {', '.join(drain.targets)} still "
                           f"{'holds' if len(drain.targets) == 1 else 'hold'} {len(left)} server(s) moved there or "
                           f"kept there by a move begun before the drain, or with a resize from there awaiting "
                           f"its confirm: {', '.join(left[:10])}{' …' if len(left) > 10 else ''}.")
            else:
                status, message = COMPLETED, f"{_all_moved(counts)}."
            drain.status, drain.message, drain.finished_at, drain.updated_at = status, message, utcnow(), utcnow()
            drain.version += 1
        # Read from the record, final already or not: a run that died after its commit left the
        # give-back to the next.
        give_back = _gives_back(drain, servers)
        # The servers failed short of a destination whose last try was handed a move: those found
        # moving above (or settled by their iteration) may have it accepted and never started.
        # Read from the record too, for the same reason; the others' RecordFailure undid theirs.
        left_behind = [(server.cell, server.instance_uuid, slot) for server in servers
                       if server.state in (SERVER_FAILED, GONE) and server.dest_host is None
                       and (slot := _last_move_slot(drain_uuid, server)) is not None]
        view, finished_at = _view(drain, servers), drain.finished_at
    if give_back:
        try:
            give_back_targets(drain_uuid)
        except Exception:  # the drain is final: its announcement goes out whatever happens here
            logger.exception("giving back the hosts of a drain that moved nothing failed", extra={"drain": drain_uuid})
    if not view["dry_run"]:
        for cell, instance_uuid, slot in left_behind:
            _abandon_left_behind(drain_uuid, cell, instance_uuid, slot)
        if already_final:
            logger.info("drain final already; its final event is announced again",
                        extra={"drain": drain_uuid, "status": view["status"]})
        _announce(drain_uuid, DRAIN_ERROR if view["status"] == FAILED else DRAIN_END, view, at=finished_at)
    logger.info("drain finished", extra={"drain": drain_uuid, "status": view["status"], "counts": view["counts"]})
    return {"status": view["status"], "counts": view["counts"], "message": view["message"]}


def _all_moved(counts: Mapping[str, int]) -> str:
    """``All N servers moved``, or, when some were deleted during the drain, ``All N servers left:
    M moved, K deleted during the drain``."""
    if not counts["gone"]:
        return f"All {counts['total']} servers moved"
    return f"All {counts['total']} servers left: {counts['done']} moved, {counts['gone']} deleted during the drain"


def _last_move_slot(drain_uuid: str, server: DrainServer) -> dict[str, Any] | None:
    """The ids of the server's last try that was handed a move (the try of its ``migration_uuid``),
    as :func:`acquire_slot` handed them out; None when no try was.

    ``attempts`` may count tries after that one: a try no host was found for is used up without
    a move (:func:`_planned_again`), so the ids are not derived from ``attempts`` alone.
    """
    if server.migration_uuid is None:
        return None
    for attempt in range(server.attempts, 0, -1):
        migration_uuid, request_id = _attempt_ids(drain_uuid, server.instance_uuid, attempt)
        if migration_uuid == server.migration_uuid:
            return Slot("move", migration_uuid, request_id, attempt).to_dict()
    return None


def _abandon_left_behind(drain_uuid: str, cell: str, instance_uuid: str, slot: Mapping[str, Any]) -> None:
    """Undo what the drain accepted for the server's try ``slot`` and whose workflow never
    started, as RecordFailure does (:func:`_abandon_unstarted`): the iteration that would have
    run it, or undone it, ended first (stopped, failed or timed out between PrepareMove and
    RunMove, say), and the server would stay in ``resize_prep`` for good.

    A move (or confirm) whose workflow runs is left to it, and so is one whose workflow got past
    accepting it: that workflow finishes or rolls it back, or, if it ended without doing so,
    ``ferry audit`` reports it. Undoing again what was undone changes nothing. Never raises: a
    failure is logged and counted, and the drain's end is announced whatever happens here.
    """
    try:
        _abandon_unstarted(cell, instance_uuid, slot["migration_uuid"], slot)
    except errors.MoveStillRunning as exc:
        logger.warning("drain move still under way when the drain finished; left to its workflow",
                       extra={"drain": drain_uuid, "instance_uuid": instance_uuid,
                              "migration_uuid": slot["migration_uuid"], "error": exc.message})
    except Exception:
        metrics.add_metric(name="DrainMoveUndoFailed", unit=MetricUnit.Count, value=1)
        logger.exception("undoing a drain move that never started failed",
                         extra={"drain": drain_uuid, "instance_uuid": instance_uuid,
                                "migration_uuid": slot["migration_uuid"]})


def _record_announced(drain_uuid: str) -> None:
    """Record the drain's end announced (the first announcement's time), leaving its ``updated_at``
    as it is: the view stays as its end was announced."""
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == drain_uuid, Drain.announced_at.is_(None))
                        .values(announced_at=utcnow(), updated_at=Drain.updated_at))


def _announcement_id(drain_uuid: str, event_type: str) -> str:
    """The identity of a drain's event: the notification's ``message_id`` and the callback's
    ``X-Ferry-Delivery``, the same each time the event is announced again."""
    return _derived_uuid(drain_uuid, "announcement", event_type)


def _announce(drain_uuid: str, event_type: str, view: Mapping[str, Any] | None = None, *,
              at: dt.datetime | None = None) -> None:
    """One grouped notification on the bus, and the signed callback when the request named one.

    Both carry :func:`_announcement_id`, so an event announced again (a retried FinishDrain) can
    be told from a new one. ``view`` is the drain as :func:`get_view` shows it (read when omitted);
    ``at`` is when the event happened, the notification's timestamp (default: now): the drain's
    ``finished_at`` for its end, the same at every announcement of it. Neither raises: what is
    not delivered is logged and counted by :mod:`ferry.notifications` and :mod:`ferry.signing`.

    The drain's end (``drain.end``, ``drain.error``) is recorded announced once the notification
    was put, before the callback is posted: a callback cut off (its function timed out while the receiver
    answered) then never makes every later look at the drain announce it again inline.
    """
    view = view if view is not None else get_view(drain_uuid)
    summary = {**{k: v for k, v in view.items() if k != "servers"},
               "servers": [{k: s[k] for k in ("id", "name", "source_host", "dest_host", "state", "error")}
                           for s in view["servers"]]}
    identity = _announcement_id(drain_uuid, event_type)
    notifications.notify_drain(event_type, drain_uuid=drain_uuid, payload=summary, message_id=identity, timestamp=at)
    if event_type != DRAIN_START:
        _record_announced(drain_uuid)
    with api_session() as session:
        url = _load(session, drain_uuid).options.get("callback_url")
    if url:
        settings = config.get()
        signing.post_callback(url, {"event_type": event_type, "drain": summary}, settings.callback_secret,
                              delivery_id=identity, allow_private=settings.callback_allow_private)
