"""Volumes and their per-host attachments: what a move has to carry along.

A volume attached to a server has one attachment per host that may use it. A move adds a
``reserved`` attachment on the destination, marks it ``attached`` when the guest is defined
there, and drops the source's on confirm (or the destination's on revert). Volume files are
shared storage (a path every host reaches), so a move never copies them.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ferry import errors
from ferry.auth import RequestContext
from ferry.store.api_models import Volume, VolumeAttachment

RESERVED = "reserved"
ATTACHED = "attached"


def device_path(device: str | None) -> str | None:
    """``/dev/vdd`` for the device ``vdd`` an attachment records (None for none)."""
    return f"/dev/{device}" if device else None


def visible(session: Session, ctx: RequestContext, volume_id: str, *, missing: str | None = None) -> Volume:
    """The volume ``volume_id`` if the caller may see it: her project's, or any for an admin.

    Raises:
        VolumeNotFound: no such volume, or another project's and the caller is no admin
            (``missing`` is the message, when given).
    """
    volume = session.get(Volume, volume_id)
    if volume is None or (volume.project_id != ctx.project_id and not ctx.is_admin):
        raise errors.VolumeNotFound(missing or f"Volume {volume_id} could not be found.")
    return volume


def listed(session: Session, *, project_id: str | None, name: str | None = None,
           status: str | None = None) -> list[Volume]:
    """The volumes of ``project_id`` (of every project when None) that match the filters, newest
    first (the order Cinder lists in: created_at, then id, descending)."""
    query = select(Volume)
    if project_id is not None:
        query = query.where(Volume.project_id == project_id)
    if name is not None:
        query = query.where(Volume.name == name)
    if status is not None:
        query = query.where(Volume.status == status)
    return list(session.scalars(query.order_by(Volume.created_at.desc(), Volume.id.desc())))


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
