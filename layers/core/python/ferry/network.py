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


# --- bindings during a move ----------------------------------------------------------------------
#
# A move adds an INACTIVE binding on the destination before the guest leaves the source,
# activates it (and deactivates the source's) when the guest is defined there, and drops the
# source's on confirm or the destination's on revert. Every function is idempotent.

ACTIVE = "ACTIVE"
INACTIVE = "INACTIVE"


def instance_ports(session: Session, instance_uuid: str) -> list[Port]:
    """The server's ports, oldest first."""
    return list(session.scalars(select(Port).where(Port.device_id == instance_uuid)
                                .order_by(Port.created_at, Port.id)))


def guest_ports(session: Session, instance_uuid: str) -> list[Port]:
    """The server's ports in the order of its guest's interfaces: as the server was created with
    them (its ``requested_networks``, a port its owner brought where it was named), then any
    other, oldest first."""
    position = {n["port_id"]: i for i, n in enumerate(requested_networks(session, instance_uuid)) if n.get("port_id")}
    return sorted(instance_ports(session, instance_uuid), key=lambda port: position.get(port.id, len(position)))


def _binding(port: Port, host: str) -> PortBinding | None:
    return next((b for b in port.bindings if b.host == host), None)


def bind_inactive(session: Session, instance_uuid: str, host: str) -> None:
    """Give each of the server's ports an INACTIVE binding on ``host`` (an existing one is kept)."""
    for port in instance_ports(session, instance_uuid):
        if _binding(port, host) is None:
            port.bindings.append(PortBinding(host=host, status=INACTIVE, vif_details={"type": "ethernet"}))
    session.flush()


def activate(session: Session, instance_uuid: str, host: str) -> None:
    """Make ``host``'s binding the active one of each port (creating it if missing)."""
    for port in instance_ports(session, instance_uuid):
        if _binding(port, host) is None:
            port.bindings.append(PortBinding(host=host, status=ACTIVE, vif_details={"type": "ethernet"}))
        for binding in port.bindings:
            binding.status = ACTIVE if binding.host == host else INACTIVE
        port.status = ACTIVE
    session.flush()


def unbind(session: Session, instance_uuid: str, host: str) -> None:
    """Drop each port's binding on ``host`` (none there is fine)."""
    for port in instance_ports(session, instance_uuid):
        for binding in [b for b in port.bindings if b.host == host]:
            port.bindings.remove(binding)
    session.flush()


def bound_hosts(session: Session, instance_uuid: str) -> dict[str, set[str]]:
    """``{port id: {host, …}}``: where each of the server's ports has a binding."""
    return {port.id: {b.host for b in port.bindings} for port in instance_ports(session, instance_uuid)}
