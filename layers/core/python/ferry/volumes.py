"""Volumes and their per-host attachments: what a move has to carry along.

A volume attached to a server has one attachment per host that may use it. A move adds a
``reserved`` attachment on the destination, marks it ``attached`` when the guest is defined
there, and drops the source's on confirm (or the destination's on revert). Volume files are
shared storage (a path every host reaches), so a move never copies them.
"""

from __future__ import annotations

import os
from typing import Any, cast

from sqlalchemy import ColumnElement, CursorResult, delete, exists, select
from sqlalchemy.orm import Session

from ferry import errors
from ferry.auth import RequestContext
from ferry.store.api_models import Volume, VolumeAttachment

# A volume's statuses (Cinder's). ``deleting``: a server was deleted with it and no host removed
# its file yet.
AVAILABLE = "available"
ATTACHING = "attaching"
IN_USE = "in-use"
DETACHING = "detaching"
ERROR_DETACHING = "error_detaching"
DELETING = "deleting"
# A volume a boot took, and an attachment not made on a host yet (a status of both).
RESERVED = "reserved"
# An attachment made on its host.
ATTACHED = "attached"

# A boot's root volume made from an image is named ``<server uuid>-root`` (``ferry audit`` tells
# such volumes by it; names never change).
ROOT_VOLUME_SUFFIX = "-root"

# Statuses of a volume nothing holds: an operator may forget it (``ferry volume forget``).
FORGETTABLE = (AVAILABLE, DELETING)


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
            volume.status = IN_USE
    session.flush()


def detach_from(session: Session, instance_uuid: str, host: str) -> None:
    """Drop the server's attachments on ``host`` (the volumes stay attached elsewhere)."""
    for attachment in attachments(session, instance_uuid, host):
        session.delete(attachment)
    session.flush()


def unheld() -> ColumnElement[bool]:
    """The condition that no attachment holds the volume (for one-statement changes that must
    not race an attach, a boot or a forget)."""
    return ~exists().where(VolumeAttachment.volume_id == Volume.id)


def held_by(instance_uuid: str) -> ColumnElement[bool]:
    """The condition that an attachment of the server ``instance_uuid`` holds the volume (for
    one-statement changes that must not take a volume another server holds, such as a detach
    asked of a server whose block device mapping is stale)."""
    return exists().where(VolumeAttachment.volume_id == Volume.id, VolumeAttachment.instance_uuid == instance_uuid)


def register(session: Session, *, project_id: str, size_gb: int, path: str, name: str | None = None,
             volume_id: str | None = None) -> Volume:
    """Record a volume at ``path`` (storage every host reaches) for ``project_id``; ``available``.

    Raises:
        BadRequest: the path is not absolute, the size not a whole number of GiB of at least
            one, the name not printable, or another volume is recorded at the path.
    """
    from ferry.api.schemas import is_printable_name

    if not path.startswith("/"):
        raise errors.BadRequest(f"The volume's path {path!r} is not absolute.")
    path = "/" + os.path.normpath(path).lstrip("/")  # one form of a path: no "." or "..", one leading "/"
    if size_gb < 1:
        raise errors.BadRequest(f"A volume's size is a whole number of GiB, at least 1 (not {size_gb}).")
    if name is not None and (len(name) > 255 or not is_printable_name(name)):
        raise errors.BadRequest("A volume's name is 1 to 255 printable characters, with no space at either end.")
    if not project_id.strip():
        raise errors.BadRequest("A volume belongs to a project: name it.")
    taken = session.scalars(select(Volume.id).where(Volume.path == path)).first()
    if taken is not None:
        raise errors.BadRequest(f"Volume {taken} is recorded at {path} already.")
    volume = Volume(project_id=project_id, size_gb=size_gb, path=path, name=name, status=AVAILABLE,
                    **({"id": volume_id} if volume_id else {}))
    session.add(volume)
    session.flush()
    return volume


def forget(session: Session, volume_id: str) -> dict[str, Any]:
    """Delete the record of a volume nothing holds (status in :data:`FORGETTABLE`, no attachment),
    in one statement, so an attach that starts meanwhile either sees it gone or keeps it; what
    is at its path is left alone. Returns what the record held (``id``, ``path``, ``status``).

    Raises:
        VolumeNotFound: no such volume.
        VolumeInUse: it is attached, being attached or detached, or reserved by a boot.
    """
    volume = session.get(Volume, volume_id)
    if volume is None:
        raise errors.VolumeNotFound(f"Volume {volume_id} could not be found.")
    held = {"id": volume.id, "path": volume.path, "status": volume.status}
    stmt = delete(Volume).where(Volume.id == volume_id, Volume.status.in_(FORGETTABLE), unheld())
    if cast(CursorResult[Any], session.execute(stmt.execution_options(synchronize_session=False))).rowcount != 1:
        now = session.scalars(select(Volume.status).where(Volume.id == volume_id)).one_or_none()
        raise errors.VolumeInUse(f"Volume {volume_id} is {now or 'gone'}, or a server holds it; it is not forgotten "
                                 f"(only a volume {' or '.join(FORGETTABLE)} that no server holds is).")
    return held
