"""``ferry image``: the images servers boot from, uploaded, listed and deleted by an operator.

Images are objects in the image bucket (``FERRY_IMAGE_BUCKET``, see :mod:`ferry.images`); the
compute API only lists and shows them, so they are added here, where the control plane's
settings are:

- ``ferry image upload PATH --name NAME [--private --project P] [--min-disk GB] [--min-ram MB]``:
  the file at ``PATH`` streams into a new image, ``active`` once the upload is complete (its
  SHA-256 is computed on the way). A name is one image's: a name an active image has is
  refused (delete that image first), while an unfinished upload of the name is redone under
  its id, as :func:`ferry.images.register_image` does. A public image has no owner; a private
  one is its project's (and the admins');
- ``ferry image list``: every image, a cross-cell move's temporary snapshots
  (``<server name>-resize-temp``) included;
- ``ferry image delete ID``: the image and what its upload left behind.

``--json`` prints images in the Image service v2 shape the compute API shows.

Exit statuses: 0 success, 1 refused (the reason on standard error, nothing uploaded or deleted),
2 bad usage, 3 could not run: the image bucket is not set, cannot be reached or refused a
request (one line on standard error naming the bucket). A failed upload leaves at most an
unfinished (``saving``) image, which uploading the same name again redoes.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO
from urllib.parse import unquote

from botocore.exceptions import BotoCoreError, ClientError

from ferry import config, errors, images, protocol
from ferry.audit import SNAPSHOT_SUFFIX

# The columns of the table ``upload`` and ``list`` print, one image a row.
COLUMNS = ("id", "name", "status", "size", "sha256", "visibility", "owner")
# Glance's longest image name.
MAX_NAME_LENGTH = 255


class _BucketUnusable(Exception):
    """The image bucket cannot be used: the command could not run (exit status 3)."""


def _refused(message: str) -> int:
    print(f"ferry: {message}", file=sys.stderr)
    return 1


@contextmanager
def _the_bucket() -> Iterator[None]:
    """Run the block against the image bucket; S3 failing becomes :class:`_BucketUnusable`.

    Raises:
        _BucketUnusable: ``FERRY_IMAGE_BUCKET`` is not set (bucket names are global: the default
            may be another account's bucket), or S3 failed (unreachable, no such bucket, denied).
    """
    if not config.is_set(config.IMAGE_BUCKET_VARIABLE):
        raise _BucketUnusable(f"cannot use the image bucket: {config.IMAGE_BUCKET_VARIABLE} is not set: set it to "
                              f"the stack's image bucket (the ImageBucketName output)")
    bucket = config.get().image_bucket
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        lines = str(exc).strip().splitlines()
        raise _BucketUnusable(f"cannot use the image bucket {bucket}: {lines[0] if lines else type(exc).__name__}") \
            from exc


def _cannot_run(exc: _BucketUnusable) -> int:
    from ferry.cli import EXIT_CANNOT_RUN  # not at the top: ferry.cli imports this module

    print(f"ferry: {exc}", file=sys.stderr)
    return EXIT_CANNOT_RUN


def _name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an image, or None.

    A name is Nova's printable name of at most 255 characters, kept whole in the object's
    metadata (:func:`ferry.protocol.image_metadata_name` shortens a longer encoding, and the
    image would then be listed under another name than the one checked here), and not ending
    like a move's temporary snapshot, which ``ferry audit`` reports when no move made it.
    """
    from ferry.api.schemas import is_printable_name

    if len(name) > MAX_NAME_LENGTH or not is_printable_name(name):
        return f"an image's name is 1 to {MAX_NAME_LENGTH} printable characters, with no space at either end: " \
               f"{name!r}"
    if unquote(protocol.image_metadata_name(name)) != name:
        return f"the name {name!r} is too long for the image's metadata: percent-encoded, it takes at most " \
               f"{protocol.IMAGE_NAME_BYTES} bytes"
    if name.endswith(SNAPSHOT_SUFFIX):
        return f"names ending {SNAPSHOT_SUFFIX!r} are kept for cross-cell moves' temporary snapshots"
    return None


def _project_problem(project: str) -> str | None:
    """Why ``project`` cannot own an image, or None: a project id as tokens hold it
    (:data:`ferry.auth.IDENTITY_ID`)."""
    from ferry.auth import IDENTITY_ID

    if not IDENTITY_ID.fullmatch(project):
        return f"a project id is 1 to 255 letters, digits, '_', '.', '@' or '-': {project!r}"
    return None


def _open_image_file(path: str) -> BinaryIO:
    """The regular file at ``path``, open for reading.

    Opened without blocking (a FIFO would wait for a writer), then checked by what was opened,
    not by its name, so what is checked is what is uploaded.

    Raises:
        OSError: it cannot be opened, or is no regular file (``EINVAL``, with a message saying so).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(22, "not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _row(image: dict[str, Any]) -> tuple[str, ...]:
    return (image["id"], image["name"], image["status"], str(image["size"] if image["size"] is not None else "-"),
            image["os_hash_value"] or "-", image["visibility"], image["owner"] or "-")


def _print_table(listed: list[dict[str, Any]]) -> None:
    print("\t".join(COLUMNS))
    for image in listed:
        print("\t".join(_row(image)))


def _run_upload(args: argparse.Namespace) -> int:
    name_problem = _name_problem(args.name)
    if name_problem is not None:
        return _refused(name_problem + ".")
    if args.private != (args.project is not None):
        return _refused("a private image is a project's and a public one no project's: give --private and "
                        "--project together, or neither.")
    if args.project is not None and (project_problem := _project_problem(args.project)) is not None:
        return _refused(project_problem + ".")
    for option, value in (("--min-disk", args.min_disk), ("--min-ram", args.min_ram)):
        if value < 0:
            return _refused(f"{option} is a size from 0: {value}.")
    try:
        source = _open_image_file(args.path)
    except OSError as exc:
        return _refused(f"{args.path} cannot be uploaded: {exc.strerror or exc}.")
    with source:
        if os.fstat(source.fileno()).st_size == 0:
            return _refused(f"{args.path} is empty: an image is a disk.")
        try:
            with _the_bucket():
                existing = images.list_images(name=args.name)
                active = [image["id"] for image in existing if image["status"] == images.ACTIVE]
                if active:
                    return _refused(f"{args.name!r} is the name of the active image {', '.join(active)}; to upload "
                                    f"it again, delete that image first (ferry image delete ID).")
                # An unfinished upload of the name is redone under its id, not left beside a new one.
                image = images.upload_image(
                    source, args.name, image_id=existing[0]["id"] if existing else None, min_disk=args.min_disk,
                    min_ram=args.min_ram, visibility="private" if args.private else "public", owner=args.project)
        except _BucketUnusable as exc:
            return _cannot_run(exc)
    if args.json:
        print(json.dumps(image, indent=2, sort_keys=True))
    else:
        _print_table([image])
    return 0


def _run_list(args: argparse.Namespace) -> int:
    try:
        with _the_bucket():
            listed = images.list_images()
    except _BucketUnusable as exc:
        return _cannot_run(exc)
    if args.json:
        print(json.dumps({"images": listed}, indent=2, sort_keys=True))
    else:
        _print_table(listed)
    return 0


def _run_delete(args: argparse.Namespace) -> int:
    try:
        with _the_bucket():
            # Looked up first: an id that names no image is refused before anything is deleted.
            image = images.get_image(args.image_id)
            deleted = images.delete_image(args.image_id)
    except errors.ImageNotFound:
        return _refused(f"no image {args.image_id}")
    except _BucketUnusable as exc:
        return _cannot_run(exc)
    if not deleted:  # deleted by someone else in between
        return _refused(f"no image {args.image_id}")
    print(f"image {image['id']} ({image['name']}, {image['status']}, {image['visibility']}) deleted")
    return 0


def add_image(commands: Any) -> None:
    parser = commands.add_parser("image", help="upload, list and delete images",
                                 description="Images servers boot from: objects in the image bucket "
                                             f"({config.IMAGE_BUCKET_VARIABLE}).")
    sub = parser.add_subparsers(dest="image_command", metavar="<image command>", required=True)
    upload = sub.add_parser("upload", help="upload a raw disk file as a new image")
    upload.add_argument("path", metavar="PATH", help="the raw disk image file")
    upload.add_argument("--name", required=True, help="its name, no active image's (printable, no space at either end)")
    upload.add_argument("--private", action="store_true", help="only --project (and admins) see and boot it")
    upload.add_argument("--project", help="the project a private image belongs to")
    upload.add_argument("--min-disk", type=int, default=0, metavar="GB",
                        help="the smallest root disk it boots on, in GiB (default: %(default)s)")
    upload.add_argument("--min-ram", type=int, default=0, metavar="MB",
                        help="the least memory it boots with, in MiB (default: %(default)s)")
    upload.add_argument("--json", action="store_true", help="print the image as JSON (Image v2 shape)")
    upload.set_defaults(handler=_run_upload)
    listing = sub.add_parser("list", help="every image, moves' temporary snapshots included")
    listing.add_argument("--json", action="store_true", help='print {"images": [...]} as JSON (Image v2 shapes)')
    listing.set_defaults(handler=_run_list)
    delete = sub.add_parser("delete", help="delete an image")
    delete.add_argument("image_id", metavar="ID", help="the image's id")
    delete.set_defaults(handler=_run_delete)
