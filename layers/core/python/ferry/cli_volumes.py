"""``ferry volume``: the volumes servers can boot from and attach, recorded by an operator.

Ferry serves volumes to the compute API's clients (``/volume/v3``, reading only); they are
made and forgotten here, where the control plane's settings are:

- ``ferry volume register --project P --size-gb N --path PATH [--name NAME]``: storage that
  exists (a block device or a file every host reaches at ``PATH``) becomes a volume of ``P``;
- ``ferry volume register … --new-file-in DIR``: a new, empty file-backed volume
  ``DIR/<id>`` (sparse, ``N`` GiB; ``DIR`` is shared storage every host reaches). Like the
  root volumes hosts make at boot, its file is removed when a server is deleted with it;
- ``ferry volume list [--project P] [--status S]``: every volume, with its path and servers;
- ``ferry volume forget ID``: the record of a volume nothing holds (``available`` or
  ``deleting``, no attachment) is deleted; what is at its path is left alone.

Exit statuses: 0 success, 1 refused (the reason on standard error), 2 bad usage, 3 could not
run (a database that cannot be reached, or whose URL cannot be read: see :mod:`ferry.cli`).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from ferry import protocol, volumes

# The largest volume recorded: 1 PiB (a file's size must fit in 63 bits of bytes).
MAX_SIZE_GB = 1024**2
# The statuses a volume can be in, as ``list --status`` takes them.
STATUSES = (volumes.AVAILABLE, volumes.RESERVED, volumes.ATTACHING, volumes.IN_USE, volumes.DETACHING,
            volumes.ERROR_DETACHING, volumes.DELETING)


def _refused(message: str) -> int:
    print(f"ferry: {message}", file=sys.stderr)
    return 1


def _new_file(directory: str, volume_id: str, size_gb: int) -> Path:
    """An empty sparse file ``directory/<volume_id>`` of ``size_gb`` GiB (mode 0660, whatever the
    umask), made here and only here."""
    path = Path(directory) / volume_id
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o660)
    try:
        os.fchmod(fd, 0o660)
        os.ftruncate(fd, size_gb * protocol.GiB)
        os.fsync(fd)
    except BaseException:
        path.unlink(missing_ok=True)  # a file that could not be made whole is not left
        raise
    finally:
        os.close(fd)
    return path


def _run_register(args: argparse.Namespace) -> int:
    from ferry import errors
    from ferry.store.db import api_session

    volume_id, made = str(uuid.uuid4()), None
    path = args.path
    if args.new_file_in is not None:
        if not os.path.isabs(args.new_file_in) or not os.path.isdir(args.new_file_in):
            return _refused(f"{args.new_file_in} is no absolute path of a directory here.")
        try:
            made = path = str(_new_file(args.new_file_in, volume_id, args.size_gb))
        except OSError as exc:
            return _refused(f"the volume's file cannot be made in {args.new_file_in}: {exc.strerror}.")
    recorded = False
    try:
        with api_session() as session:
            path = volumes.register(session, project_id=args.project, size_gb=args.size_gb, path=path, name=args.name,
                                    volume_id=volume_id).path
        recorded = True
    except errors.FerryError as exc:
        return _refused(exc.message)
    finally:
        if made is not None and not recorded:
            os.unlink(made)  # nothing is left of a volume that was not recorded
    if args.new_file_in is not None:  # marked as the hosts mark the directories they make volumes in
        protocol.mark_volume_dir(args.new_file_in)
    print(f"volume {volume_id}: {args.size_gb} GiB at {path}, project {args.project}, available")
    return 0


def _run_list(args: argparse.Namespace) -> int:
    from sqlalchemy import select

    from ferry.store.api_models import Volume
    from ferry.store.db import api_session

    with api_session() as session:
        query = select(Volume).order_by(Volume.created_at, Volume.id)
        if args.project is not None:
            query = query.where(Volume.project_id == args.project)
        if args.status is not None:
            query = query.where(Volume.status == args.status)
        rows = [(v.id, v.status, str(v.size_gb), v.project_id, v.name or "", v.path,
                 ",".join(sorted({a.instance_uuid for a in v.attachments})) or "-")
                for v in session.scalars(query)]
    print("\t".join(("id", "status", "size_gb", "project", "name", "path", "servers")))
    for row in rows:
        print("\t".join(row))
    return 0


def _run_forget(args: argparse.Namespace) -> int:
    from ferry import errors
    from ferry.store.db import api_session

    try:
        with api_session() as session:
            held = volumes.forget(session, args.volume_id)
    except errors.FerryError as exc:
        return _refused(exc.message)
    print(f"volume {held['id']} ({held['status']}) forgotten; what is at {held['path']} is left in place")
    return 0


def _size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no whole number of GiB") from None
    if not 1 <= value <= MAX_SIZE_GB:
        raise argparse.ArgumentTypeError(f"a volume has 1 to {MAX_SIZE_GB} GiB")
    return value


def add_volume(commands: Any) -> None:
    parser = commands.add_parser("volume", help="register, list and forget volumes",
                                 description="Volumes are storage every host reaches, recorded for a project.")
    sub = parser.add_subparsers(dest="volume_command", metavar="<volume command>", required=True)
    register = sub.add_parser("register", help="record a volume (existing storage, or a new file)")
    register.add_argument("--project", required=True, help="the project the volume belongs to")
    register.add_argument("--size-gb", required=True, type=_size, metavar="N", help="its size in GiB")
    where = register.add_mutually_exclusive_group(required=True)
    where.add_argument("--path", help="where the storage is, the same on every host (a block device or a file)")
    where.add_argument("--new-file-in", metavar="DIR",
                       help="make a new empty file-backed volume DIR/<id> (shared storage every host reaches)")
    register.add_argument("--name", help="its name (printable, no space at either end)")
    register.set_defaults(handler=_run_register)
    listing = sub.add_parser("list", help="the volumes, with their paths and the servers that hold them")
    listing.add_argument("--project", help="only this project's")
    listing.add_argument("--status", choices=STATUSES,
                         help="only volumes in this status (deleting: left after their server)")
    listing.set_defaults(handler=_run_list)
    forget = sub.add_parser("forget", help="delete the record of a volume nothing holds (its storage stays)")
    forget.add_argument("volume_id", help="the volume's id")
    forget.set_defaults(handler=_run_forget)
