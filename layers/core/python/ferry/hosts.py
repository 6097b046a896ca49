"""Compute hosts as the control plane sees them: their queues, reports and services."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from sqlalchemy import select

from ferry import aws, config, errors, placement, protocol
from ferry.observability import logger
from ferry.store import setup
from ferry.store.api_models import CellMapping, HostMapping, utcnow
from ferry.store.cell_models import Service
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


def apply_report(report: dict[str, Any]) -> None:
    """Apply one agent report: inventory to placement, heartbeat to the host's service record.

    A host that reports for the first time with a ``cell`` is mapped to that cell (Ferry's
    equivalent of discovering hosts); a host with no mapping and no cell is refused.

    Raises:
        jsonschema.ValidationError: the report does not match the protocol.
        HostNotMapped: the host is in no cell.
    """
    protocol.validate(report, protocol.REPORT_SCHEMA)
    host = report["host"]
    cell = cell_of_host(host)
    if cell is None:
        if not report.get("cell"):
            raise errors.HostNotMapped(f"Host {host} is not mapped to a cell and did not name one.")
        setup.map_host(host, report["cell"])
        cell = report["cell"]
    now = utcnow()
    with cell_session(cell) as session:
        service = session.scalars(select(Service).where(Service.host == host)).one_or_none()
        if service is None:
            session.add(Service(host=host, last_seen_at=now))
        elif service.last_seen_at is None or service.last_seen_at < now:
            service.last_seen_at = now
    if report["kind"] == protocol.REPORT_INVENTORY:
        with api_session() as session:
            cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == cell)).one()
        placement.ensure_provider(host, report.get("node") or host, cell_id, report["inventory"])
    logger.debug("host report applied", extra={"host": host, "kind": report["kind"]})


def is_up(service: Service, now: dt.datetime | None = None) -> bool:
    """Whether a compute service has sent a heartbeat within ``service_down_time``."""
    if service.forced_down or service.last_seen_at is None:
        return False
    now = now or utcnow()
    return (now - service.last_seen_at).total_seconds() <= config.get().service_down_time
