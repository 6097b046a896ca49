"""Ports and their host bindings: the part of networking a move has to carry along.

A port belongs to a server through ``device_id``; each host it is plugged into has a
:class:`~ferry.store.api_models.PortBinding`. Ports Ferry made for a server go with it;
ports the owner brought (``preexisting`` in the request spec) are only unplugged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ferry.store.api_models import Port, PortBinding, RequestSpec


def requested_networks(session: Session, instance_uuid: str) -> list[dict[str, Any]]:
    """The ``requested_networks`` the server was created with (empty when its spec is gone)."""
    spec = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == instance_uuid)).one_or_none()
    return list((spec.spec or {}).get("requested_networks") or []) if spec is not None else []


def release_ports(session: Session, instance_uuid: str, requested: Iterable[Mapping[str, Any]] = ()) -> None:
    """Delete the ports made for a server and unplug the ones its owner brought (idempotent)."""
    preexisting = {n["port_id"] for n in requested if n.get("preexisting") and n.get("port_id")}
    for port in list(session.scalars(select(Port).where(Port.device_id == instance_uuid))):
        if port.id in preexisting:
            port.device_id, port.status = None, "DOWN"
            session.execute(delete(PortBinding).where(PortBinding.port_id == port.id))
        else:
            session.delete(port)
    session.flush()
