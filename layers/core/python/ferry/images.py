"""Images in S3: boot images and snapshots, described in the Image service v2 shape.

An image is the object ``images/<id>`` in the image bucket. Its user metadata describes it:
``image-id``, ``name`` (percent-encoded, S3 metadata is ASCII), ``disk-format``,
``container-format``, ``sha256``, ``min-disk``, ``min-ram``, ``visibility`` and, for an image
of a project, ``owner`` (its project id, percent-encoded with ``owner-encoding: percent``; an
older image's is as it was written). An object without ``sha256`` is an upload that has not
finished: it shows as ``saving`` and cannot be booted. A ``private`` image is seen (and booted)
only by its owner's project and by admins (:func:`visible_to`), as Glance shows it.

Most images are raw objects. A snapshot of a disk is stored sparse (``layout: extents``): the
object ``images/<id>`` is then a small pointer, written last with the digest of the whole
disk (``sha256``; ``digest`` names the algorithm, the host agent's block digest), and the disk's
written extents and their manifest live under ``image-data/<id>/`` (the host agent's transfer
format), so the holes of a mostly empty disk never travel. Its metadata also carries
``virtual-size`` (the disk's size) and ``data-size`` (the bytes stored). A block digest is not
an algorithm of the Image API's ``os_hash_algo``: such an image shows no hash there.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid as uuidlib
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote

from ferry import aws, config, errors, protocol
from ferry.observability import logger

PREFIX = "images/"
DATA_PREFIX = "image-data/"
# Where a move's disks wait between two hosts, one folder per migration (the bucket's lifecycle
# rule in template.yaml expires what a failed move left here).
TRANSFER_PREFIX = "transfers/"
EXTENTS_LAYOUT = "extents"
# The largest object S3 copies in one request (larger ones take a multipart copy).
SINGLE_COPY_LIMIT = 5 * 2**30
ACTIVE = "active"
SAVING = "saving"


class _HashingReader:
    """A non-seekable reader that hashes what passes through it.

    Being non-seekable makes the transfer manager read the source once, in order, so the
    digest covers exactly the bytes uploaded, without holding the whole image in memory.
    """

    def __init__(self, source: BinaryIO) -> None:
        self._source = source
        self.sha256 = hashlib.sha256()
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        chunk = self._source.read(size)
        self.sha256.update(chunk)
        self.size += len(chunk)
        return chunk

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def _bucket() -> str:
    return config.get().image_bucket


def _key(image_id: str) -> str:
    return f"{PREFIX}{image_id}"


def transfer_location(migration_uuid: str) -> dict[str, str]:
    """Where a move's disks wait between the hosts (the destination deletes them once it has them)."""
    return {"bucket": _bucket(), "prefix": f"{TRANSFER_PREFIX}{migration_uuid}"}


def data_prefix(image_id: str) -> str:
    """Where a sparse image's data extents and manifest live (``image-data/<id>``)."""
    return f"{DATA_PREFIX}{image_id}"


def _isotime(value: dt.datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _image(image_id: str, head: dict[str, Any]) -> dict[str, Any]:
    meta = head.get("Metadata") or {}
    sha256 = meta.get("sha256") or None
    sparse = meta.get("layout") == EXTENTS_LAYOUT
    plain_hash = sha256 is not None and meta.get("digest", "sha256") == "sha256"
    modified = _isotime(head.get("LastModified"))
    return {
        "id": image_id,
        "name": unquote(meta.get("name", "")),
        "status": ACTIVE if sha256 else SAVING,
        "visibility": meta.get("visibility", "public"),
        "protected": False,
        "os_hidden": False,
        "disk_format": meta.get("disk-format", "raw"),
        "container_format": meta.get("container-format", "bare"),
        "min_disk": int(meta.get("min-disk") or 0),
        "min_ram": int(meta.get("min-ram") or 0),
        "size": int(meta.get("data-size") or 0) if sparse else head.get("ContentLength"),
        "virtual_size": int(meta.get("virtual-size") or 0) if sparse else None,
        "checksum": None,
        "os_hash_algo": "sha256" if plain_hash else None,
        "os_hash_value": sha256 if plain_hash else None,
        "owner": protocol.image_owner(meta),
        "tags": [],
        "created_at": modified,
        "updated_at": modified,
        "self": f"/v2/images/{image_id}",
        "file": f"/v2/images/{image_id}/file",
        "schema": "/v2/schemas/image",
    }


def _head(image_id: str) -> dict[str, Any]:
    if not image_id or "/" in image_id:
        raise errors.ImageNotFound(f"Image {image_id} could not be found.")
    s3 = aws.client("s3")
    try:
        return s3.head_object(Bucket=_bucket(), Key=_key(image_id))
    except s3.exceptions.ClientError as exc:  # the client's own: botocore loads with it, not with this module
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            raise errors.ImageNotFound(f"Image {image_id} could not be found.") from exc
        raise


def visible_to(image: dict[str, Any], project_id: str, *, is_admin: bool) -> bool:
    """Whether a caller of ``project_id`` may see ``image``: a ``private`` one only its owner's
    project may (an admin sees every image)."""
    return is_admin or image["visibility"] != "private" or (image["owner"] is not None
                                                            and image["owner"] == project_id)


def get_image(image_id: str) -> dict[str, Any]:
    """The image ``image_id`` in the Image v2 shape.

    Raises:
        ImageNotFound: no such image.
    """
    return _image(image_id, _head(image_id))


def list_images(name: str | None = None) -> list[dict[str, Any]]:
    """Every image (oldest first), or those named exactly ``name``."""
    s3 = aws.client("s3")
    found = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=_bucket(), Prefix=PREFIX):
        for item in page.get("Contents", []):
            image_id = item["Key"][len(PREFIX):]
            if not image_id or "/" in image_id:
                continue
            try:
                image = get_image(image_id)
            except errors.ImageNotFound:
                continue  # deleted while listing
            if name is None or image["name"] == name:
                found.append(image)
    return sorted(found, key=lambda image: (image["created_at"] or "", image["id"]))


def upload_image(source: BinaryIO, name: str, *, image_id: str | None = None, disk_format: str = "raw",
                 container_format: str = "bare", min_disk: int = 0, min_ram: int = 0,
                 visibility: str = "public", owner: str | None = None) -> dict[str, Any]:
    """Stream ``source`` into a new image (of the project ``owner``, if given) and return it.

    The SHA-256 is computed while the data streams; it is written into the object's
    metadata once the upload is complete, which is what makes the image ``active``.
    """
    image_id = image_id or str(uuidlib.uuid4())
    metadata = {"image-id": image_id, "name": protocol.image_metadata_name(name), "disk-format": disk_format,
                "container-format": container_format, "min-disk": str(min_disk), "min-ram": str(min_ram),
                "visibility": visibility, **protocol.image_metadata_owner(owner)}
    s3, bucket, key = aws.client("s3"), _bucket(), _key(image_id)
    reader = _HashingReader(source)
    aws.upload_fileobj(s3, reader, bucket, key, ExtraArgs={"Metadata": metadata})
    digest = reader.sha256.hexdigest()
    finished = {**metadata, "sha256": digest}
    if reader.size <= SINGLE_COPY_LIMIT:  # one request: S3's multipart copy of an object onto itself is not needed
        s3.copy_object(CopySource={"Bucket": bucket, "Key": key}, Bucket=bucket, Key=key, Metadata=finished,
                       MetadataDirective="REPLACE")
    else:
        s3.copy({"Bucket": bucket, "Key": key}, bucket, key,
                ExtraArgs={"Metadata": finished, "MetadataDirective": "REPLACE"})
    logger.info("image uploaded", extra={"image_id": image_id, "image_name": name, "size": reader.size})
    return get_image(image_id)


def register_image(path: str | Path, name: str, **options: Any) -> dict[str, Any]:
    """Upload the file at ``path`` as the image ``name`` (idempotent by name).

    An active image of that name is returned as it is; an unfinished upload of that name is
    redone under the same id. ``options`` are those of :func:`upload_image`.
    """
    existing = list_images(name=name)
    active = [image for image in existing if image["status"] == ACTIVE]
    if active:
        return active[0]
    if existing:
        options.setdefault("image_id", existing[0]["id"])
    with open(path, "rb") as source:
        return upload_image(source, name, **options)


def image_location(image_id: str) -> dict[str, Any]:
    """Where the boot workflow downloads an image from: ``{id, bucket, key, sha256}``.

    Raises:
        ImageNotFound: no such image, or its upload has not finished.
    """
    digest = (_head(image_id).get("Metadata") or {}).get("sha256")
    if not digest:
        raise errors.ImageNotFound(f"Image {image_id} is not active.")
    return {"id": image_id, "bucket": _bucket(), "key": _key(image_id), "sha256": digest}


def delete_image(image_id: str) -> bool:
    """Delete an image; returns False when there was none (deleting twice is harmless).

    A sparse image's extents under ``image-data/<id>/`` go first and its object ``images/<id>``
    last: a deletion that fails half-way leaves the image listed (and ``ferry audit`` finds a
    snapshot so left), never extents that no object points at.

    Raises:
        ClientError, BotoCoreError: S3 failed; what is left is deleted by deleting again.
    """
    s3 = aws.client("s3")
    try:
        _head(image_id)
    except errors.ImageNotFound:
        found = False
    else:
        found = True
    # Also when only the extents were written: an upload that stopped before the pointer leaves them behind.
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=_bucket(), Prefix=data_prefix(image_id) + "/"):
        for item in page.get("Contents", []):
            s3.delete_object(Bucket=_bucket(), Key=item["Key"])
    # And what a killed upload left unfinished, of the extents or of the image itself.
    aws.abort_uploads(s3, _bucket(), data_prefix(image_id) + "/")
    aws.abort_uploads(s3, _bucket(), _key(image_id), whole_key=True)
    if found:
        s3.delete_object(Bucket=_bucket(), Key=_key(image_id))
        logger.info("image deleted", extra={"image_id": image_id})
    return found
