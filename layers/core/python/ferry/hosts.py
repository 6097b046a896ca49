"""Compute hosts as the control plane sees them: their queues, reports and services."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import threading
from typing import Any, cast

from aws_lambda_powertools.metrics import MetricUnit
from sqlalchemy import CursorResult, select, update

from ferry import aws, config, errors, placement, protocol
from ferry.compute import instances
from ferry.observability import logger, metrics
from ferry.store import setup
from ferry.store.api_models import CellMapping, HostMapping, utcnow
from ferry.store.cell_models import Instance, Service
from ferry.store.db import api_session, cell_session

_queue_urls: dict[str, str] = {}
_lock = threading.Lock()


def queue_url(host: str) -> str:
    """The URL of ``host``'s agent queue (looked up once per process)."""
    with _lock:
        url = _queue_urls.get(host)
    if url is None:
        name = protocol.host_queue_name(config.get().host_queue_prefix, host)
        url = aws.client("sqs").get_queue_url(QueueName=name)["QueueUrl"]
        with _lock:
            _queue_urls[host] = url
    return url


def cell_of_host(host: str) -> str | None:
    """The name of the cell ``host`` is mapped to, or None."""
    with api_session() as session:
        mapping = session.scalars(select(HostMapping).where(HostMapping.host == host)).one_or_none()
        return mapping.cell.name if mapping else None


def is_compute_host(host: str) -> bool:
    """Whether ``host`` is a compute host: mapped to a cell, with a service record there."""
    cell = cell_of_host(host)
    if cell is None:
        return False
    with cell_session(cell) as session:
        return session.scalars(select(Service.id).where(Service.host == host)).first() is not None


def apply_report(report: dict[str, Any], queued_at: dt.datetime | None = None, sender: str | None = None) -> None:
    """Apply one agent report: inventory to placement, heartbeat to the host's service record.

    ``queued_at`` is when the reports queue took the report (SQS's ``SentTimestamp``, naive UTC;
    None: now). A report that waited longer than ``service_down_time`` (a failed batch handled
    again, a backlog) says nothing of the host now and is dropped, logged and counted
    (``HostReportStale``): it would make a host that died since look up, or map again a host
    deleted since. A younger one is the host's heartbeat as of when it was queued, not when it is
    applied: a host that died just after its last report is down ``service_down_time`` after that
    report, however long the report waited (a backlog keeps a host up while its reports are younger
    than ``service_down_time`` less its report interval). Reports are ordered by the time the queue took them, not
    by the agent's clock (which may go back): an inventory report queued before the one last
    applied does not overwrite the host's inventory.

    The guests and instance directories an inventory report lists are kept in the service's
    ``details`` (:func:`host_view`), the newest report's only, for ``ferry audit``.

    A host that reports for the first time with a ``cell`` is mapped to that cell (Ferry's
    equivalent of discovering hosts); a host with no mapping and no cell is refused.

    ``sender`` is who sent the report (SQS's ``SenderId``; None: not known, nothing is checked).
    A host's reports are taken from one sender: the first report since the host was mapped (or
    re-bound with ``ferry host rebind``) binds the host to its sender, and a report of the host
    from another sender is dropped, logged and counted (``HostReportRefused``), so an agent
    cannot report another host up, its inventory or its guests.

    What an inventory report still lists of deleted servers is destroyed there
    (:func:`reap_deleted`), best effort: a failure there is logged, and the report stays applied.

    Raises:
        SchemaMismatch: the report does not match the protocol (:mod:`ferry.validation`).
        HostNotMapped: the host is in no cell.
    """
    protocol.validate(report, protocol.REPORT_SCHEMA)
    host = report["host"]
    now = utcnow()
    queued = min(now, queued_at or now)
    if now - queued > dt.timedelta(seconds=config.get().service_down_time):
        logger.warning("host report dropped: it waited in the queue longer than a host may stay silent",
                       extra={"host": host, "kind": report["kind"], "queued_at": queued.isoformat()})
        metrics.add_metric(name="HostReportStale", unit=MetricUnit.Count, value=1)
        return
    with api_session() as session:  # the host's cell and who its reports are taken from, in one read
        mapped = session.execute(select(CellMapping.name, HostMapping.reporter).join(
            HostMapping, HostMapping.cell_id == CellMapping.id).where(HostMapping.host == host)).one_or_none()
    cell, reporter = mapped if mapped is not None else (None, None)
    if cell is None:
        if not report.get("cell"):
            raise errors.HostNotMapped(f"Host {host} is not mapped to a cell and did not name one.")
        setup.map_host(host, report["cell"])
        cell = report["cell"]
    if sender is not None and reporter != sender and (reporter is not None or not _bind(host, sender)):
        logger.warning("host report refused: the host's reports are taken from another sender "
                       "(ferry host rebind re-binds it)",
                       extra={"host": host, "kind": report["kind"], "sender": sender})
        metrics.add_metric(name="HostReportRefused", unit=MetricUnit.Count, value=1)
        return
    view = _host_view(report, queued)
    with cell_session(cell) as session:
        # Locked: two reports of the host applied side by side keep the newer view (read, then written).
        service = session.scalars(select(Service).where(Service.host == host).with_for_update()).one_or_none()
        if service is None:
            service = Service(host=host, last_seen_at=queued, details={})
            session.add(service)
        elif service.last_seen_at is None or service.last_seen_at < queued:
            service.last_seen_at = queued
        newest = view is None or _newer_view(view, (service.details or {}).get(HOST_VIEW))
        if view is not None and newest:
            # A new dict, so the JSON column sees the change.
            service.details = {**(service.details or {}), HOST_VIEW: view}
    if report["kind"] == protocol.REPORT_INVENTORY and newest:
        with api_session() as session:
            cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == cell)).one()
        placement.ensure_provider(host, report.get("node") or host, cell_id, report["inventory"], reported_at=queued)
    if view is not None:
        try:
            reap_deleted(host, view)
        except Exception:  # best effort: the report is applied, and the next one tries again
            logger.exception("reaping deleted servers' leftovers failed", extra={"host": host})
            metrics.add_metric(name="ReapFailed", unit=MetricUnit.Count, value=1)
    logger.debug("host report applied", extra={"host": host, "kind": report["kind"]})


def _bind(host: str, sender: str) -> bool:
    """Bind ``host``, not bound yet, to ``sender``; whether its reports are taken from ``sender``
    now (the update locks the mapping's row: of two first reports, one binds)."""
    with api_session() as session:
        bound = cast(CursorResult[Any], session.execute(
            update(HostMapping).where(HostMapping.host == host, HostMapping.reporter.is_(None))
            .values(reporter=sender).execution_options(synchronize_session=False)))
        if bound.rowcount:
            logger.info("host bound to the sender of its reports", extra={"host": host, "sender": sender})
            return True
        return session.scalars(select(HostMapping.reporter).where(HostMapping.host == host)).one() == sender


def rebind(host: str) -> None:
    """Take ``host``'s next report from whoever sends it, and its reports from that sender on (an
    agent that now sends as another identity: a replaced machine, new credentials).

    Raises:
        HostNotMapped: the host is in no cell.
    """
    with api_session() as session:
        result = cast(CursorResult[Any], session.execute(
            update(HostMapping).where(HostMapping.host == host).values(reporter=None)
            .execution_options(synchronize_session=False)))
        if not result.rowcount:
            raise errors.HostNotMapped(f"Host {host} is not mapped to a cell.")


# Reports sent within this long after a delete finished may predate it (host and store clocks differ).
REAP_CLOCK_SKEW = dt.timedelta(seconds=5)
# Every report names a leftover's destroy after the period it falls in, so the agent runs it at
# most once per period (a repeat is answered from its journal): a destroy that fails is tried
# again in a later period, not at every report.
REAP_PERIOD_SECONDS = 1800
# At most this many destroys per report, chosen in an order that changes with the period, so
# leftovers whose destroy keeps failing do not hold back the others for good.
REAP_MAX_PER_REPORT = 20


def reap_deleted(host: str, view: dict[str, Any]) -> list[str]:
    """Ask ``host`` to destroy what it still holds of deleted servers; returns their uuids.

    A server deleted while its host was down (the local delete), or whose source host was down
    when it was deleted in VERIFY_RESIZE, leaves its guest and instance directories there. When
    the host reports them in an inventory report sent after the delete finished (its record
    deleted, its mapping queued for delete), each such server's guest and disks are destroyed
    there: a ``destroy`` message without a task token, ``reap/<uuid>/<period>``. This is what
    Nova's ``running_deleted_instance_action = reap`` does; the setting
    ``FERRY_RUNNING_DELETED_ACTION=log`` only logs. Volume files are never part of it (what is
    left of those is an operator's: ``volume_left_deleting``). A destroy sent again is
    harmless: an absent guest is already destroyed.

    Raises:
        Whatever reading the store or sending to the host's queue raises (the caller logs it).
    """
    held = {m.group("uuid") for name in [*view.get("guests", []), *(view.get("instance_dirs") or [])]
            if (m := protocol.INSTANCE_DIR_NAME.match(name))}
    if not held:
        return []
    sent_at = report_time(view["sent_at"])
    left = [uuid for uuid, deleted_at in _deleted_servers(held)
            if deleted_at is not None and deleted_at + REAP_CLOCK_SKEW < sent_at]
    if not left:
        return []
    if config.get().running_deleted_action != "reap":
        logger.warning("deleted servers' guests or disks still on their host (not reaped: "
                       "FERRY_RUNNING_DELETED_ACTION)", extra={"host": host, "instance_uuids": left})
        return []
    period = int(sent_at.replace(tzinfo=dt.UTC).timestamp()) // REAP_PERIOD_SECONDS
    chosen = sorted(left, key=lambda uuid: hashlib.sha256(f"{uuid}/{period}".encode()).digest())
    chosen = chosen[:REAP_MAX_PER_REPORT]
    entries = [{"Id": str(n), "MessageBody": json.dumps({
        "operation": protocol.DESTROY, "operation_id": f"reap/{uuid}/{period}", "instance_uuid": uuid, "args": {}})}
        for n, uuid in enumerate(chosen)]
    sqs, url = aws.client("sqs"), queue_url(host)
    unsent: set[str] = set()
    for first in range(0, len(entries), 10):
        answer = sqs.send_message_batch(QueueUrl=url, Entries=entries[first:first + 10])
        for failed in answer.get("Failed") or []:
            unsent.add(chosen[int(failed["Id"])])
            logger.warning("reap message not sent", extra={"host": host, "error": failed.get("Message"),
                                                           "instance_uuid": chosen[int(failed["Id"])]})
    reaped = [uuid for uuid in chosen if uuid not in unsent]
    logger.warning("deleted servers' guests or disks still on their host: destroying them",
                   extra={"host": host, "instance_uuids": reaped, "left_for_later": len(left) - len(reaped)})
    return reaped


def _deleted_servers(uuids: set[str]) -> list[tuple[str, dt.datetime | None]]:
    """``(uuid, deleted_at)`` of those of ``uuids`` that are servers whose delete finished:
    mapping queued for delete, record deleted in the mapped cell."""
    deleted: list[tuple[str, dt.datetime | None]] = []
    for cell, found in instances.by_cell(uuids, queued_for_delete=True):
        with cell_session(cell) as session:
            rows = session.execute(select(Instance.uuid, Instance.deleted_at).where(
                Instance.uuid.in_(found), Instance.deleted.is_(True)))
            deleted.extend((uuid, deleted_at) for uuid, deleted_at in rows)
    return sorted(deleted)


# The key of ``Service.details`` under which the host's own view of itself is kept.
HOST_VIEW = "host_view"


def _host_view(report: dict[str, Any], queued: dt.datetime) -> dict[str, Any] | None:
    """What an inventory report says the host holds: ``{sent_at, queued_at, guests, instance_dirs?}``,
    or None; ``queued_at`` orders the views (:func:`_newer_view`)."""
    if report["kind"] != protocol.REPORT_INVENTORY or "guests" not in report:
        return None
    view: dict[str, Any] = {"sent_at": report["sent_at"], "queued_at": queued.isoformat(),
                            "guests": sorted(report["guests"])}
    if "instance_dirs" in report:
        view["instance_dirs"] = sorted(report["instance_dirs"])
    return view


def _newer_view(view: dict[str, Any], recorded: Any) -> bool:
    """Whether ``view`` was queued after the recorded one (reports may arrive out of order). A view
    recorded before views carried ``queued_at`` counts as older."""
    if not isinstance(recorded, dict) or "queued_at" not in recorded:
        return True
    try:
        return report_time(view["queued_at"]) >= report_time(recorded["queued_at"])
    except ValueError:
        return True


def report_time(sent_at: str) -> dt.datetime:
    """A report's ``sent_at`` as a naive UTC datetime (the store's timestamps are naive UTC).

    Raises:
        ValueError: not an ISO 8601 time.
    """
    moment = dt.datetime.fromisoformat(sent_at)
    if moment.tzinfo is not None:
        moment = moment.astimezone(dt.UTC).replace(tzinfo=None)
    return moment


def host_view(service: Service) -> dict[str, Any] | None:
    """The guests and instance directories ``service``'s host last reported, with when (``sent_at``)."""
    view = (service.details or {}).get(HOST_VIEW)
    return view if isinstance(view, dict) else None


def is_up(service: Service, now: dt.datetime | None = None) -> bool:
    """Whether a compute service has sent a heartbeat within ``service_down_time``."""
    if service.forced_down or service.last_seen_at is None:
        return False
    now = now or utcnow()
    return (now - service.last_seen_at).total_seconds() <= config.get().service_down_time


def service_is_up(session: Any, host: str) -> bool:
    """Whether ``host``'s compute service, read in ``session`` (its cell's), sends heartbeats."""
    service = session.scalars(select(Service).where(Service.host == host)).one_or_none()
    return service is not None and is_up(service)


def host_is_up_from(session: Any, current_cell: str, host: str, *, here: bool = False) -> bool:
    """Whether ``host``'s compute service, in the cell the host is mapped to, sends heartbeats,
    asked with ``session`` open on ``current_cell``: read in it when the host is there (SQLite
    allows one writer per file, so no second session on it is opened), else in its own cell.
    ``here``: the host is known to be in ``current_cell`` (a move within it), read there at once,
    with no API session opened inside ``session``."""
    if here:
        return service_is_up(session, host)
    cell = cell_of_host(host)
    if cell is None:
        return False
    if cell == current_cell:
        return service_is_up(session, host)
    with cell_session(cell) as other:
        return service_is_up(other, host)

