"""Volumes and their per-host attachments: what a move has to carry along.

A volume attached to a server has one attachment per host that may use it. A move adds a
``reserved`` attachment on the destination, marks it ``attached`` when the guest is defined
there, and drops the source's on confirm (or the destination's on revert). Volume files are
shared storage (a path every host reaches), so a move never copies them.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ferry.store.api_models import Volume, VolumeAttachment

RESERVED = "reserved"
ATTACHED = "attached"


def attachments(session: Session, instance_uuid: str, host: str | None = None) -> list[VolumeAttachment]:
    """The server's attachments, optionally only ``host``'s, in a stable order."""
    query = select(VolumeAttachment).where(VolumeAttachment.instance_uuid == instance_uuid)
    if host is not None:
        query = query.where(VolumeAttachment.host == host)
    return list(session.scalars(query.order_by(VolumeAttachment.created_at, VolumeAttachment.id)))


def attached_volumes(session: Session, instance_uuid: str, host: str) -> list[tuple[Volume, VolumeAttachment]]:
    """The volumes attached to the server on ``host``, with their attachments."""
    result = []
    for attachment in attachments(session, instance_uuid, host):
        volume = session.get(Volume, attachment.volume_id)
        if volume is not None:
            result.append((volume, attachment))
    return result


def reserve_on(session: Session, instance_uuid: str, source_host: str, dest_host: str) -> None:
    """Add a ``reserved`` attachment on ``dest_host`` for every volume attached on ``source_host``."""
    have = {a.volume_id for a in attachments(session, instance_uuid, dest_host)}
    for attachment in attachments(session, instance_uuid, source_host):
        if attachment.volume_id not in have:
            session.add(VolumeAttachment(volume_id=attachment.volume_id, instance_uuid=instance_uuid,
                                         host=dest_host, device=attachment.device, status=RESERVED))
    session.flush()


def complete_on(session: Session, instance_uuid: str, host: str) -> None:
    """Mark the server's attachments on ``host`` ``attached`` and their volumes ``in-use``."""
    for attachment in attachments(session, instance_uuid, host):
        attachment.status = ATTACHED
        volume = session.get(Volume, attachment.volume_id)
        if volume is not None:
            volume.status = "in-use"
    session.flush()


def detach_from(session: Session, instance_uuid: str, host: str) -> None:
    """Drop the server's attachments on ``host`` (the volumes stay attached elsewhere)."""
    for attachment in attachments(session, instance_uuid, host):
        session.delete(attachment)
    session.flush()
