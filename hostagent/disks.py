"""Instance disks as files: download, sparse copy, checksum, grow.

Everything streams in chunks (never a whole file in memory) and writes sparse: runs of zeros
become holes. A file is written to a temporary name beside its destination and renamed into
place once complete, so a disk path either does not exist or holds a whole, verified disk.

An instance's disks live in ``<instances_dir>/<uuid>/``: ``disk`` (root), ``disk.eph0``
(ephemeral) and ``disk.swap``. Disks are raw files; their size is the flavor's (sparse). While a
resize or cold migration is in progress, the source host keeps the instance's old disks in
``<instances_dir>/<uuid>_resize/`` until the move is confirmed or reverted.

Between two hosts a disk travels through S3 as a *transfer* (:func:`upload_disk`,
:func:`download_disk`): the object ``<prefix>/<kind>`` holds only the disk's data extents, one
after the other, and ``<prefix>/<kind>.manifest.json`` says where they go
(``{"size", "extents": [[offset, length], ...], "sha256", "digest", "chunk_size"}``). The manifest is
written last, so its presence means the data object is complete.

A disk moved between hosts is checked with its *block digest* (:class:`BlockDigest`): the
digest of the digests of its 4 MiB blocks, in order, by BLAKE3 (:class:`BlockBlake3`, named
``"blake3-blocks"``, what moves use) or by SHA-256 (:class:`BlockSha256`, ``"sha256-blocks"``,
what agents before BLAKE3 sent). It identifies the logical content as a plain digest does, but a
hole costs one precomputed block digest instead of hashing its zeros, so checking a mostly empty
disk costs what its data costs. Snapshot images stored sparse use ``sha256-blocks`` (their
metadata says ``digest``); raw images keep the plain SHA-256 (``"digest": "sha256"``) that the
image API shows.

For drills, ``FERRY_DISK_THROTTLE_MIBPS`` (read when a copy starts) caps every disk stream of
the process (copies, downloads, uploads) at that many MiB per second, so that a test can catch
an agent in the middle of moving a disk.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import mmap
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from blake3 import blake3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError

from ferry import aws, errors, faults
from ferry.observability import logger
from ferry.protocol import BLOCK_BLAKE3, BLOCK_SHA256, MOVE_DIGEST, VOLUME_DIR_MARKER, GiB

CHUNK_SIZE = 4 * 2**20
MiB = 2**20

ROOT_DISK = "disk"
EPHEMERAL_DISK = "disk.eph0"
SWAP_DISK = "disk.swap"
IMAGE_CACHE_DIR = "_base"
RESIZE_SUFFIX = "_resize"
INCOMING_SUFFIX = "_incoming"
# A disk being written is ``.<name>.<random>.part`` beside its destination, renamed into place once complete.
PART_SUFFIX = ".part"
# Such a temporary file's name: ``<random>`` is tempfile.mkstemp's (letters, digits, ``_``; no dot).
_PART_NAME = re.compile(rf"\.(?P<name>.+)\.[a-z0-9_]+{re.escape(PART_SUFFIX)}")
# An image's digest, lower-cased: the name of its file in the image cache (see :func:`create_root_disk`).
_IMAGE_DIGEST = re.compile(r"[0-9a-f]{64}")
# What flock answers on storage that has no locks.
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})
# This host's name and token in its instances directory: whoever reads the same there shares the storage.
HOST_MARKER = ".ferry-host.json"
# Beside a disk copied directly: the digest of each of its 4 MiB blocks, in order (32 bytes each).
BLOCKS_SUFFIX = ".blocks"
# Threads that read, digest and copy the blocks of one direct copy at once.
COPY_WORKERS = 2
# The file name of each kind of local disk in an instance directory.
DISK_FILES = {"root": ROOT_DISK, "ephemeral": EPHEMERAL_DISK, "swap": SWAP_DISK}
MANIFEST_SUFFIX = ".manifest.json"
# Multipart part size of a transfer upload (S3's minimum part is 5 MiB); parts in flight at once.
TRANSFER_PART_SIZE = 8 * MiB
TRANSFER_CONCURRENCY = 4
# The bytes of a transfer upload's parts held in memory at once (a stream's parts are buffered whole):
# ten parts of 8 MiB; fewer, larger parts for a large disk, but never fewer than two.
TRANSFER_MEMORY = 80 * MiB
TRANSFER_MIN_PARTS_IN_MEMORY = 2
# S3 takes at most 10,000 parts of at most 5 GiB each; a transfer aims below the count, with a margin.
TRANSFER_MAX_PARTS = 9_000
TRANSFER_MAX_PART_SIZE = 5 * GiB
# Drills only: the MiB per second every disk stream of this process is held to (unset: no limit).
THROTTLE_ENV = "FERRY_DISK_THROTTLE_MIBPS"


# Set while an operation runs in this thread (:func:`abandoned_when`): the streams it starts stop
# once the event is set, its workflow having stopped waiting.
_ABANDONED: ContextVar[threading.Event | None] = ContextVar("ferry_stream_abandoned", default=None)


@contextmanager
def abandoned_when(event: threading.Event | None) -> Iterator[None]:
    """Streams started in this thread while the block runs raise ``OperationAbandoned`` at their
    next chunk once ``event`` is set: a copy of hours whose workflow gave up ends within a chunk,
    and what it wrote goes the way a failed copy's goes. None: they run to their end."""
    token = _ABANDONED.set(event)
    try:
        yield
    finally:
        _ABANDONED.reset(token)


class _Pace:
    """Holds a stream to :data:`THROTTLE_ENV` MiB/s (read when the stream starts), and stops it
    once the operation that started it is abandoned (:func:`abandoned_when`)."""

    def __init__(self, *, throttled: bool = True) -> None:
        try:
            rate = float(os.environ.get(THROTTLE_ENV) or 0) if throttled else 0.0
        except ValueError:
            rate = 0.0
        self.bytes_per_second = rate * MiB if rate > 0 else 0.0
        self._started = time.monotonic()
        self._moved = 0
        self._abandoned = _ABANDONED.get()

    def moved(self, count: int) -> None:
        """``count`` more bytes went through: wait until the stream is back at its rate.

        Raises:
            OperationAbandoned: the operation's workflow no longer waits for it (seen here, or
                while the stream waits).
        """
        abandoned = self._abandoned
        if abandoned is not None and abandoned.is_set():
            raise errors.OperationAbandoned()
        if not self.bytes_per_second:
            return
        self._moved += count
        ahead = self._moved / self.bytes_per_second - (time.monotonic() - self._started)
        if ahead <= 0:
            return
        if abandoned is None:
            time.sleep(ahead)
        elif abandoned.wait(ahead):
            raise errors.OperationAbandoned()


def instance_dir(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    """The directory holding an instance's disks."""
    return Path(instances_dir) / instance_uuid


def root_disk_path(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    return instance_dir(instances_dir, instance_uuid) / ROOT_DISK


def ephemeral_disk_path(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    return instance_dir(instances_dir, instance_uuid) / EPHEMERAL_DISK


def swap_disk_path(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    return instance_dir(instances_dir, instance_uuid) / SWAP_DISK


def resize_dir(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    """Where the source host keeps an instance's old disks while a move waits for confirm or revert."""
    return Path(instances_dir) / f"{instance_uuid}{RESIZE_SUFFIX}"


def incoming_dir(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    """Where another host copies an instance's disks directly for a move here (:func:`copy_to_host`)."""
    return Path(instances_dir) / f"{instance_uuid}{INCOMING_SUFFIX}"


def remove_instance_dir(instances_dir: str | os.PathLike[str], instance_uuid: str) -> None:
    """Delete an instance's directory and every disk in it; an absent directory is already gone."""
    remove_dir(instance_dir(instances_dir, instance_uuid))


# fsync of a directory, refused by file systems that have nothing to sync for one (CIFS before
# Linux 4.17, some FUSE and network file systems): their entries are as durable as they get.
_DIRECTORY_SYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def sync_dir(directory: str | os.PathLike[str]) -> None:
    """Write ``directory``'s entries to disk: a file renamed, linked or created in it survives a
    power loss only once its directory is synced, whatever the file's own fsync did. A file system
    that refuses to sync a directory is let be (logged once)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIRECTORY_SYNC_UNSUPPORTED:
            raise
        _log_unsupported_directory_sync(str(directory), exc)
    finally:
        os.close(fd)


@functools.cache
def _log_unsupported_directory_sync(directory: str, exc: OSError) -> None:
    logger.warning("this file system does not sync directories: a rename may not outlast a power loss",
                   extra={"path": directory, "error": str(exc)})


def make_dir(directory: str | os.PathLike[str], *, exist_ok: bool = False) -> Path:
    """Create ``directory`` (and its missing parents), and sync the directory that holds it: a
    host's answer says its disks are there, and a new directory outlasts a power loss only once
    its parent is synced. Returns it.

    Raises:
        FileExistsError: it exists and not ``exist_ok``.
        OSError: it cannot be created or its parent synced.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=exist_ok)
    sync_dir(path.parent)
    return path


def remove_dir(directory: str | os.PathLike[str]) -> None:
    """Delete a directory and everything in it; an absent directory is already gone."""
    try:
        shutil.rmtree(directory)
    except FileNotFoundError:
        pass


def remove_dir_record_last(directory: str | os.PathLike[str], record: str) -> None:
    """Delete a directory and everything in it, its file ``record`` last: until the directory is
    gone, the record still says whose it is. An absent directory is already gone."""
    path = Path(directory)
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name == record:
            continue
        if entry.is_dir(follow_symlinks=False):
            remove_dir(entry.path)
        else:
            Path(entry.path).unlink(missing_ok=True)
    remove_dir(path)


def remove_volume_file(path: str | os.PathLike[str], volume_id: str) -> bool:
    """Delete a volume's file; whether it is gone.

    Only a regular file named after the volume is deleted: the file-backed volumes the hosts
    make. Anything else at the path (a block device, a link, another name) belongs to the
    storage that made it and is left there (False). Such a file that is absent is gone only
    where its directory carries the volumes' marker (``protocol.mark_volume_dir``); elsewhere the
    storage may only be out of sight here (not mounted), and nothing can be told (False).

    Raises:
        OSError: the file cannot be removed, or its directory not read.
    """
    path = Path(path)
    if path.name != volume_id:
        return False
    try:
        found = path.lstat()
    except FileNotFoundError:
        return (path.parent / VOLUME_DIR_MARKER).is_file()
    if not stat.S_ISREG(found.st_mode):
        return False
    path.unlink(missing_ok=True)
    return True


def file_identity(path: str | os.PathLike[str]) -> tuple[int, int]:
    """The ``(st_dev, st_ino)`` of the file at ``path`` (a link there is not followed): which file it is.

    Raises:
        OSError: there is none.
    """
    found = os.lstat(path)
    return found.st_dev, found.st_ino


def remove_file_made(path: str | os.PathLike[str], identity: tuple[int, int]) -> bool:
    """Delete ``path`` if it is still the file ``identity`` (:func:`file_identity`) names; whether it did.

    On shared storage another host may have put another file at the name since: that one is left.

    Raises:
        OSError: the file cannot be removed.
    """
    try:
        if file_identity(path) != tuple(identity):
            return False
    except FileNotFoundError:
        return False
    Path(path).unlink(missing_ok=True)
    return True


def inside(path: str | os.PathLike[str], directories: Iterable[str | os.PathLike[str]]) -> bool:
    """Whether ``path`` lies within one of ``directories`` (beneath it, not the directory itself)
    once ``..`` and symbolic links are resolved (the directories' too). A relative path, or one
    that cannot be resolved (a loop of links, a NUL byte), lies nowhere.
    """
    if not os.path.isabs(path):
        return False
    try:
        resolved = Path(path).resolve()
        return any(Path(directory).resolve() in resolved.parents for directory in directories)
    except (OSError, RuntimeError, ValueError):
        return False


def volume_target(path: str | os.PathLike[str], directories: Iterable[str | os.PathLike[str]]) -> Path | None:
    """Where the volume file ``path`` is made or removed: ``path`` with its directory resolved
    (``..`` and symbolic links), when the file and that directory both lie within one of
    ``directories`` (the directory may be one of them); None otherwise.

    Resolved when the file is about to be written or removed, so that the write goes to the
    directory that was checked, not through a link put in place of one since. A link at the
    file's own name is never followed: an ``exclusive`` write (a spawn's) fails on it
    (:class:`FileTaken`), :func:`grow` refuses it and :func:`remove_volume_file` leaves it.
    """
    roots = list(directories)
    path = Path(path)
    if path.name in ("", "..") or not inside(path, roots):  # also refuses a link at its name pointing out
        return None
    try:
        directory = path.parent.resolve()
        if any(directory == root or root in directory.parents for root in (Path(r).resolve() for r in roots)):
            return directory / path.name
    except (OSError, RuntimeError, ValueError):
        pass
    return None


def remove_partial_files(instances_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files an interrupted write left in the instance directories and the image cache.

    Disks are written to ``.<name>.<random>.part`` beside their destination and renamed once
    complete; a process killed mid-way leaves the temporary file behind, which nothing else
    would ever remove. A file a write holds is left (:func:`remove_abandoned_parts`), but where
    the storage has no locks every one is taken as abandoned, since only this host writes in
    these directories: call it when the agent starts, before its operations write. Incoming
    directories are left alone: another host's agent writes there (a direct copy may be
    running), and the whole directory goes with the move's finish or revert.
    Returns the files deleted.
    """
    removed: list[Path] = []
    root = Path(instances_dir)
    if not root.is_dir():
        return removed
    for directory in (d for d in root.iterdir()
                      if d.is_dir() and not d.is_symlink() and not d.name.endswith(INCOMING_SUFFIX)):
        removed += remove_abandoned_parts(directory, unlocked_abandoned=True)
    return removed


def remove_abandoned_parts(directory: str | os.PathLike[str], name: str | None = None, *,
                           unlocked_abandoned: bool = False) -> list[Path]:
    """Delete the temporary files that interrupted writes left in ``directory`` (only those of the
    file ``name``, when given); return them.

    A write holds its temporary file (``flock``) until the file is renamed into place, so a file
    that can be held here is one whose writer is gone: this host's or another's, since a lock on
    shared storage is seen by every host that mounts it. A file that is held is left alone. So
    is one on storage without locks (``ENOLCK``, ``EOPNOTSUPP``), unless ``unlocked_abandoned``
    says nobody can be writing it (a host's own directories, as its agent starts). Only names
    of the temporary files' shape (``.<name>.<random>.part``) are looked at, and a file is
    removed only while the one held is still the one at its name. Safe while operations run,
    but for ``unlocked_abandoned`` on storage without locks.

    On NFS the sweep is as good as the locks: Linux clients carry ``flock`` over NFS locks, seen
    by every host, unless the storage is mounted ``local_lock=flock`` or ``all`` (or ``nolock``)
    where each host sees only its own, so another host's write in progress looks abandoned; and a
    host cut off from the server for longer than its lease loses its locks, so its writes in
    progress may be removed (they then fail).
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        shape = _PART_NAME.fullmatch(entry.name)
        if shape is None or (name is not None and shape["name"] != name):
            continue
        if not entry.is_file(follow_symlinks=False):
            continue
        try:
            # Open for writing: NFS grants an exclusive lock only on a file open for writing.
            fd = os.open(entry.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # renamed into place or removed meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if not (unlocked_abandoned and exc.errno in _NO_LOCKS):
                    continue  # a write holds it, or the storage has no locks to tell
            # Held now, by this sweep: its writer is gone (a write renames its file before letting go).
            held, there = os.fstat(fd), os.lstat(entry.path)
            if (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino):
                continue  # renamed into place meanwhile, and another file took the name
            os.unlink(entry.path)
        except OSError:  # renamed into place or removed meanwhile
            continue
        finally:
            os.close(fd)
        removed.append(Path(entry.path))
    return removed


def prune_image_cache(cache_dir: str | os.PathLike[str], max_age_seconds: float, keep: Container[str]) -> list[Path]:
    """Delete the cached images not used for ``max_age_seconds`` (by their time stamp) but those in ``keep``.

    A spawn marks a cached image used (:func:`create_root_disk`); instance disks are full copies
    and never refer to the cache. Temporary files are left to :func:`remove_partial_files`.
    Returns the files deleted.
    """
    removed: list[Path] = []
    oldest = time.time() - max_age_seconds
    try:
        entries = list(os.scandir(cache_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith(".") or entry.name in keep or not entry.is_file(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_mtime < oldest:
            Path(entry.path).unlink(missing_ok=True)
            removed.append(Path(entry.path))
    return removed


def _held_part(dest: Path) -> tuple[int, Path]:
    """Create ``.<name>.<random>.part`` beside ``dest`` and hold it (``flock``) until its descriptor closes.

    A sweep (:func:`remove_abandoned_parts`) that removed the file between its creation and the
    lock is noticed (it has no name left) and another is made.
    """
    while True:
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=PART_SUFFIX)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            # Storage without locks: a sweep cannot hold the file either, and leaves it alone.
            return fd, Path(name)
        if os.fstat(fd).st_nlink:
            return fd, Path(name)
        os.close(fd)


# Records a new file's identity (:func:`file_identity`) before the file takes its name.
IdentityRecorder = Callable[[tuple[int, int]], None]


class FileTaken(Exception):
    """A file made ``exclusive`` found another at its name (made meanwhile by someone else), left as it was.

    Not an OSError, so that the writers' handlers of I/O errors let it through as it is.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} was made by someone else meanwhile.")
        self.path = path


@contextmanager
def _temp_beside(
    dest: Path, *, exclusive: bool = False, record_identity: IdentityRecorder | None = None
) -> Iterator[tuple[IO[bytes], Path]]:
    """A temporary file in ``dest``'s directory, renamed to ``dest`` on success and removed on failure.

    The file is held while it is written, and renamed before it is let go: a sweep of abandoned
    temporary files (:func:`remove_abandoned_parts`) never takes one that is being written.
    ``exclusive`` never replaces a file at ``dest``: the temporary file is hard-linked there
    instead of renamed, and a file found there is left and :class:`FileTaken` raised.
    ``record_identity`` is given the file's identity (:func:`file_identity`) before it takes
    ``dest``'s name (a hard link or a rename keeps it), so that a crash right after leaves a file
    its writer can still recognise as its own.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _held_part(dest)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out, tmp
            out.flush()
            os.fsync(out.fileno())
            made = os.fstat(out.fileno())
            if record_identity is not None:
                record_identity((made.st_dev, made.st_ino))
            if not exclusive:
                os.replace(tmp, dest)
            else:
                _link_exclusive(tmp, dest, (made.st_dev, made.st_ino))
                tmp.unlink()
        sync_dir(dest.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _link_exclusive(tmp: Path, dest: Path, identity: tuple[int, int]) -> None:
    """Hard-link ``tmp`` (the file ``identity`` names) at ``dest``, never over a file there.

    An NFSv3 server may answer a retransmitted LINK that succeeded with EEXIST: a name that is
    already this very file is the link made, not another's file.

    Raises:
        FileTaken: another file is at ``dest``.
        OSError: the link cannot be made.
    """
    try:
        os.link(tmp, dest)
    except FileExistsError:
        try:
            found = file_identity(dest)
        except FileNotFoundError:
            found = None
        if found != identity:
            raise FileTaken(dest) from None


class _SparseWriter:
    """Writes chunks at the file's position, turning all-zero chunks into holes."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out

    def write(self, chunk: bytes) -> None:
        if chunk.count(0) == len(chunk):
            self.out.seek(len(chunk), os.SEEK_CUR)
        else:
            self.out.write(chunk)

    def finish(self, size: int) -> None:
        # Trailing holes only exist once the file is extended to its logical size.
        self.out.truncate(size)


# --- digests of a disk's logical content ----------------------------------------------------------

SHA256 = "sha256"
DIGEST_BLOCK_SIZE = 4 * MiB


@functools.cache
def _zero_block() -> memoryview:
    return memoryview(bytes(DIGEST_BLOCK_SIZE))


def _zeros(count: int) -> Iterator[memoryview]:
    """``count`` zero bytes, in views of at most one block."""
    while count > 0:
        step = min(count, DIGEST_BLOCK_SIZE)
        yield _zero_block()[:step]
        count -= step


class Sha256:
    """The plain SHA-256 of a disk's logical content, holes as zeros (what ``sha256sum`` prints)."""

    name = SHA256

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: bytes | memoryview) -> None:
        self._hash.update(data)

    def update_zeros(self, count: int) -> None:
        """Hash ``count`` zero bytes (a hole): as costly as reading them."""
        for zeros in _zeros(count):
            self._hash.update(zeros)

    def copy(self) -> Sha256:
        other = Sha256()
        other._hash = self._hash.copy()
        return other

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class BlockDigest:
    """The block digest of a disk: a hash over the hash of each 4 MiB block of its logical content.

    Blocks are counted from the start of the disk; the last one may be shorter; an empty disk
    has the hash of nothing. Equal content gives an equal digest however sparse its file is.
    A whole block of zeros adds the zero block's digest (computed once per process), so holes
    cost almost nothing. Subclasses name the hash (32-byte digests).
    """

    name: str
    _hash: Any

    def __init__(self) -> None:
        self._outer = self._hash()
        self._block = self._hash()
        self._filled = 0  # bytes of the current block hashed so far

    @classmethod
    def block(cls, data: bytes | memoryview) -> bytes:
        """The digest of one block (or of a disk's last, shorter one)."""
        return bytes(cls._hash(data).digest())

    @classmethod
    def zeros(cls, length: int) -> bytes:
        """The digest of a block of ``length`` zero bytes (computed once per process and length)."""
        return _zeros_digest(cls.name, length)

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), DIGEST_BLOCK_SIZE - self._filled)
            self._block.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == DIGEST_BLOCK_SIZE:
                self._outer.update(self._block.digest())
                self._block, self._filled = self._hash(), 0

    def update_zeros(self, count: int) -> None:
        """Hash ``count`` zero bytes (a hole): whole blocks by their precomputed digest."""
        if self._filled and count:
            head = min(count, DIGEST_BLOCK_SIZE - self._filled)
            self.update(_zero_block()[:head])
            count -= head
        whole, rest = divmod(count, DIGEST_BLOCK_SIZE)
        while whole:
            batch = min(whole, 4096)  # at most 128 KiB of digests at once
            self._outer.update(self.zeros(DIGEST_BLOCK_SIZE) * batch)
            whole -= batch
        if rest:
            self.update(_zero_block()[:rest])

    def add_block_digests(self, digests: bytes) -> None:
        """Whole blocks by their digests (32 bytes each, hashed elsewhere); only at a block boundary."""
        if self._filled or len(digests) % 32:
            raise ValueError("block digests go in whole, at a block boundary")
        self._outer.update(digests)

    def copy(self) -> BlockDigest:
        other = type(self)()
        other._outer, other._block, other._filled = self._outer.copy(), self._block.copy(), self._filled
        return other

    def hexdigest(self) -> str:
        outer = self._outer.copy()
        if self._filled:
            outer.update(self._block.digest())
        return str(outer.hexdigest())


class BlockSha256(BlockDigest):
    """The block digest by SHA-256 (``sha256-blocks``): sparse snapshot images, and moves by older agents."""

    name = BLOCK_SHA256
    _hash = staticmethod(hashlib.sha256)


class BlockBlake3(BlockDigest):
    """The block digest by BLAKE3 (``blake3-blocks``): what a move's disks are checked with.

    BLAKE3 hashes several times faster per core than SHA-256, which bounds a direct copy.
    """

    name = BLOCK_BLAKE3
    _hash = staticmethod(blake3)


Digest = Sha256 | BlockDigest
BLOCK_DIGESTS: dict[str, type[BlockDigest]] = {BLOCK_SHA256: BlockSha256, BLOCK_BLAKE3: BlockBlake3}
DIGESTS: dict[str, type[Sha256] | type[BlockDigest]] = {SHA256: Sha256, **BLOCK_DIGESTS}


@functools.lru_cache(maxsize=8)
def _zeros_digest(algorithm: str, length: int) -> bytes:
    return BLOCK_DIGESTS[algorithm].block(_zero_block()[:length])


def block_digest_class(algorithm: str) -> type[BlockDigest]:
    """The block digest named ``algorithm``.

    Raises:
        DiskCopyFailed: no such block digest (a sender newer than this agent).
    """
    try:
        return BLOCK_DIGESTS[algorithm]
    except KeyError:
        raise errors.DiskCopyFailed(
            f"Unknown disk digest {algorithm!r}: this agent checks {', '.join(sorted(BLOCK_DIGESTS))}.") from None


def data_segments(fd: int, size: int, offset: int = 0) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` byte ranges of an open file from ``offset`` on that hold data, skipping holes.

    On a filesystem without SEEK_DATA/SEEK_HOLE the whole rest of the file is one data range.
    """
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole remains
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield offset, size
                return
            raise
        if start >= size:
            return
        try:
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
            end = size
        end = min(end, size)
        yield start, end
        offset = end


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file's logical content (holes read as zeros)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sparse_sha256(path: str | os.PathLike[str], chunk_size: int = CHUNK_SIZE) -> str:
    """The same digest as :func:`sha256_file`, reading only the file's data (holes are hashed, not read)."""
    return file_digest(path, SHA256, chunk_size)


def file_digest(path: str | os.PathLike[str], algorithm: str = BLOCK_SHA256, chunk_size: int = CHUNK_SIZE) -> str:
    """The ``algorithm`` digest (:data:`DIGESTS`) of a file's logical content, reading only its data.

    An operation abandoned meanwhile stops it at its next chunk, as it stops a stream (:class:`_Pace`);
    a drill's throttle holds back the copies it checks, not the read.
    """
    hasher = DIGESTS[algorithm]()
    pace = _Pace(throttled=False)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        position = 0
        for start, end in data_segments(f.fileno(), size):
            hasher.update_zeros(start - position)
            f.seek(start)
            remaining = end - start
            while remaining > 0:
                chunk = f.read(min(chunk_size, remaining))
                if not chunk:
                    raise OSError(errno.EIO, f"{path} shrank while it was being read")
                hasher.update(chunk)
                remaining -= len(chunk)
                pace.moved(len(chunk))
            position = end
        hasher.update_zeros(size - position)
    return hasher.hexdigest()


def copy_sparse(src: str | os.PathLike[str], dst: str | os.PathLike[str], chunk_size: int = CHUNK_SIZE,
                algorithm: str = SHA256) -> str:
    """Copy ``src`` to ``dst`` keeping holes, and return the ``algorithm`` digest of the content copied.

    Only the data ranges of ``src`` are read; zero chunks are not written, so ``dst`` is at
    least as sparse as ``src``. ``dst`` appears atomically when the copy is complete.

    Raises:
        DiskCopyFailed: reading or writing failed, or ``src`` changed size during the copy.
    """
    return copy_sparse_digest(src, dst, chunk_size, algorithm).hexdigest()


class _NotTheExpectedContent(Exception):
    """A copy whose digest is not the one expected (it is removed before it takes its name)."""


def copy_sparse_verified(src: str | os.PathLike[str], dst: str | os.PathLike[str], expected: str,
                         chunk_size: int = CHUNK_SIZE, algorithm: str = SHA256, *, exclusive: bool = False,
                         record_identity: IdentityRecorder | None = None) -> bool:
    """:func:`copy_sparse`, but ``dst`` appears only when the copy's digest is ``expected``.

    ``exclusive``: a file at ``dst`` is never replaced (:class:`FileTaken`). ``record_identity``
    is given the copy's identity before it takes ``dst``'s name.

    Returns:
        Whether it did; when not, nothing is left at ``dst``.

    Raises:
        DiskCopyFailed: reading or writing failed, or ``src`` changed size during the copy.
        FileTaken: with ``exclusive``, a file appeared at ``dst`` meanwhile.
    """
    try:
        copy_sparse_digest(src, dst, chunk_size, algorithm, expected=expected, exclusive=exclusive,
                           record_identity=record_identity)
    except _NotTheExpectedContent:
        return False
    return True


def copy_sparse_digest(src: str | os.PathLike[str], dst: str | os.PathLike[str], chunk_size: int = CHUNK_SIZE,
                       algorithm: str = SHA256, *, expected: str | None = None, exclusive: bool = False,
                       record_identity: IdentityRecorder | None = None) -> Digest:
    """:func:`copy_sparse`, returning the digest object itself (to extend with :func:`grown_digest`).

    With ``expected``, a copy of another digest is removed before it takes ``dst``'s name
    (``_NotTheExpectedContent``), so a crash never leaves an unchecked file there. With
    ``exclusive``, a file at ``dst`` is never replaced (:class:`FileTaken`). ``record_identity``
    is given the copy's identity before it takes ``dst``'s name.
    """
    src_path, dst_path = Path(src), Path(dst)
    hasher = DIGESTS[algorithm]()
    try:
        with open(src_path, "rb") as fin, _temp_beside(dst_path, exclusive=exclusive,
                                                       record_identity=record_identity) as (out, _tmp):
            size = os.fstat(fin.fileno()).st_size
            writer = _SparseWriter(out)
            pace = _Pace()
            position = 0
            for start, end in data_segments(fin.fileno(), size):
                hasher.update_zeros(start - position)
                fin.seek(start)
                out.seek(start)
                remaining = end - start
                while remaining > 0:
                    chunk = fin.read(min(chunk_size, remaining))
                    if not chunk:
                        raise errors.DiskCopyFailed(f"{src_path} shrank while it was being copied.")
                    hasher.update(chunk)
                    writer.write(chunk)
                    pace.moved(len(chunk))
                    remaining -= len(chunk)
                position = end
            hasher.update_zeros(size - position)
            writer.finish(size)
            if expected is not None and hasher.hexdigest() != expected:
                raise _NotTheExpectedContent(str(src_path))
    except OSError as exc:
        raise errors.DiskCopyFailed(f"Copying {src_path} to {dst_path} failed: {exc}") from exc
    return hasher


def grown_digest(hasher: Digest, old_size: int, new_size: int) -> str:
    """The digest of a disk grown from ``old_size`` to ``new_size`` by :func:`grow`, from the digest
    object of its content before (the growth is zeros: only they are hashed, the content is not read again)."""
    extended = hasher.copy()
    extended.update_zeros(new_size - old_size)
    return extended.hexdigest()


def download_image(
    s3_client: Any,
    bucket: str,
    key: str,
    dest: str | os.PathLike[str],
    expected_sha256: str,
    chunk_size: int = CHUNK_SIZE,
    *,
    exclusive: bool = False,
    record_identity: IdentityRecorder | None = None,
) -> int:
    """Stream ``s3://bucket/key`` to ``dest`` (sparse), verifying its sha256; return its size in bytes.

    ``dest`` appears atomically and only with the expected content; with ``exclusive``, never
    in place of a file there (:class:`FileTaken`). ``record_identity`` is given the file's
    identity before it takes ``dest``'s name.

    Raises:
        ImageDownloadFailed: the object cannot be read, writing failed, or the checksum differs.
        FileTaken: with ``exclusive``, a file appeared at ``dest`` meanwhile.
    """
    dest_path = Path(dest)
    hasher = hashlib.sha256()
    size = 0
    try:
        with _temp_beside(dest_path, exclusive=exclusive, record_identity=record_identity) as (out, _tmp):
            body = s3_client.get_object(Bucket=bucket, Key=key)["Body"]
            writer = _SparseWriter(out)
            pace = _Pace()
            try:
                for chunk in body.iter_chunks(chunk_size):
                    hasher.update(chunk)
                    writer.write(chunk)
                    pace.moved(len(chunk))
                    size += len(chunk)
            finally:
                body.close()
            writer.finish(size)
            digest = hasher.hexdigest()
            if digest != expected_sha256.lower():
                raise errors.ImageDownloadFailed(
                    f"Image s3://{bucket}/{key} has sha256 {digest}, expected {expected_sha256}.",
                    bucket=bucket,
                    key=key,
                )
    except (ClientError, BotoCoreError, OSError) as exc:
        raise errors.ImageDownloadFailed(
            f"Downloading image s3://{bucket}/{key} failed: {exc}", bucket=bucket, key=key
        ) from exc
    return size


def grow(path: str | os.PathLike[str], size_bytes: int) -> int:
    """Extend a raw disk to ``size_bytes`` with a hole, synced; a larger disk is never shrunk. Returns the size.

    A symbolic link at ``path`` is never followed.

    Raises:
        FileNotFoundError: there is no such file.
        OSError: the file cannot be extended, or ``path`` is a symbolic link (``ELOOP``).
    """
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        current = os.fstat(fd).st_size
        if size_bytes > current:
            os.ftruncate(fd, size_bytes)
            os.fsync(fd)  # the host answers with this size: it must outlast a power loss
            return size_bytes
        return current
    finally:
        os.close(fd)


def create_sparse(path: str | os.PathLike[str], size_bytes: int, *, exclusive: bool = False,
                  record_identity: IdentityRecorder | None = None) -> Path:
    """Create an empty (all-hole) disk of ``size_bytes``; an existing disk is kept and grown if smaller.

    A symbolic link at ``path`` is never followed (see :func:`grow`). With ``exclusive`` a file at
    ``path`` is neither grown nor replaced: it is left, and :class:`FileTaken` raised.
    ``record_identity`` is given a new file's identity (:func:`file_identity`) before it takes
    ``path``'s name.

    Raises:
        OSError: the file cannot be created, or ``path`` is a symbolic link.
        FileTaken: with ``exclusive``, there is a file at ``path``.
    """
    target = Path(path)
    if not exclusive:
        try:
            grow(target, size_bytes)
            return target
        except FileNotFoundError:
            pass
    with _temp_beside(target, exclusive=exclusive, record_identity=record_identity) as (out, _tmp):
        out.truncate(size_bytes)
    return target


def create_root_disk(
    s3_client: Any,
    image: dict[str, Any],
    root_bytes: int,
    dest: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    chunk_size: int = CHUNK_SIZE,
    *,
    exclusive: bool = False,
    record_identity: IdentityRecorder | None = None,
) -> int:
    """Write a root disk from an image in S3 (raw or sparse) and grow it to ``root_bytes``; return its size.

    ``root_bytes == 0`` (a flavor with ``root_gb`` 0) keeps the image's own size, as Nova does.
    With ``cache_dir`` the image is downloaded once per checksum into the cache and copied
    (sparse, verified) from there. With ``exclusive`` the disk never replaces a file at ``dest``.
    ``record_identity`` is given the disk's identity (:func:`file_identity`) before it takes
    ``dest``'s name.

    Args:
        image: ``{"id", "bucket", "key", "sha256"}``.

    Raises:
        InvalidOperation: the image's ``sha256`` is not a hex SHA-256 digest (it names its file in
            ``cache_dir``: nothing is touched).
        SpawnFailed: the image is larger than the root disk.
        ImageDownloadFailed: the image cannot be fetched or its checksum differs.
        DiskCopyFailed: copying from the cache failed.
        FileTaken: with ``exclusive``, a file appeared at ``dest`` meanwhile (it is left as it is).
    """
    dest_path = Path(dest)
    bucket, key, expected = image["bucket"], image["key"], str(image["sha256"]).lower()
    if not _IMAGE_DIGEST.fullmatch(expected):
        # Refused before it becomes a path: ``../x`` or an absolute one would reach outside the cache.
        raise errors.InvalidOperation(f"Image {image.get('id')} has no valid sha256 digest: {image['sha256']!r}.",
                                      image_id=image.get("id"))
    try:
        head = s3_client.head_object(Bucket=bucket, Key=key)
        metadata = head.get("Metadata") or {}
        sparse = metadata.get("layout") == EXTENTS_LAYOUT
        image_size = int(metadata.get("virtual-size") or 0) if sparse else int(head["ContentLength"])
        algorithm = (metadata.get("digest") or SHA256) if sparse else SHA256
    except (ClientError, BotoCoreError) as exc:
        raise errors.ImageDownloadFailed(
            f"Image s3://{bucket}/{key} cannot be read: {exc}", bucket=bucket, key=key
        ) from exc
    if root_bytes > 0 and image_size > root_bytes:
        raise errors.SpawnFailed(
            f"Image {image.get('id')} ({image_size} bytes) is larger than the root disk ({root_bytes} bytes).",
            image_id=image.get("id"),
        )
    if algorithm not in DIGESTS:
        raise errors.ImageDownloadFailed(f"Image s3://{bucket}/{key} has an unknown digest {algorithm!r}.",
                                         bucket=bucket, key=key)
    fetch = _download_sparse_image if sparse else download_image
    if cache_dir is None:
        fetch(s3_client, bucket, key, dest_path, expected, chunk_size, exclusive=exclusive,
              record_identity=record_identity)
    else:
        cached = Path(cache_dir) / expected
        if cached.exists():
            os.utime(cached)  # used now: pruning goes by the last use
        else:
            fetch(s3_client, bucket, key, cached, expected, chunk_size)
        # Checked before the copy takes its name: a root disk that exists is a verified one.
        if not copy_sparse_verified(cached, dest_path, expected, chunk_size, algorithm, exclusive=exclusive,
                                    record_identity=record_identity):
            # The cached copy rotted on disk: drop it, and fetch the image afresh.
            cached.unlink(missing_ok=True)
            fetch(s3_client, bucket, key, cached, expected, chunk_size)
            if not copy_sparse_verified(cached, dest_path, expected, chunk_size, algorithm, exclusive=exclusive,
                                        record_identity=record_identity):
                raise errors.ImageDownloadFailed(f"Image {image.get('id')} changed while it was being copied.")
    if root_bytes > 0 and os.path.getsize(dest_path) > root_bytes:
        # The object changed between its size check and its download.
        dest_path.unlink(missing_ok=True)
        raise errors.SpawnFailed(f"Image {image.get('id')} is larger than the root disk ({root_bytes} bytes).")
    return grow(dest_path, root_bytes) if root_bytes > 0 else os.path.getsize(dest_path)


# --- direct copies into another host's instances directory ------------------------------------------


def host_token(instances_dir: str | os.PathLike[str], host: str) -> str:
    """This host's token in ``<instances_dir>/.ferry-host.json``, created once.

    Another host that reads this host's name and the same token at the path this host gives for
    its instances directory shares that storage, and may copy a move's disks straight into it.

    Raises:
        OSError: the marker cannot be read or written.
    """
    marker = Path(instances_dir) / HOST_MARKER
    try:
        known = json.loads(marker.read_text())
        if known.get("host") == host and known.get("token"):
            return str(known["token"])
    except (OSError, ValueError, AttributeError):
        pass
    token = os.urandom(16).hex()
    with _temp_beside(marker) as (out, _tmp):
        out.write(json.dumps({"host": host, "token": token}).encode())
    return token


def reaches(instances_dir: str | os.PathLike[str], host: str, token: str) -> bool:
    """Whether ``instances_dir`` is ``host``'s instances directory (its marker holds ``token``), as seen from here."""
    try:
        known = json.loads((Path(instances_dir) / HOST_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(known, dict) and known.get("host") == host and known.get("token") == token


def _data_blocks(fd: int, size: int) -> list[int]:
    """The indexes of the 4 MiB blocks that the file's data ranges touch."""
    touched: list[int] = []
    for start, end in data_segments(fd, size):
        first, last = start // DIGEST_BLOCK_SIZE, (end - 1) // DIGEST_BLOCK_SIZE
        touched.extend(range(max(first, touched[-1] + 1 if touched else 0), last + 1))
    return touched


def copy_to_host(src: str | os.PathLike[str], dst: str | os.PathLike[str], workers: int = COPY_WORKERS,
                 algorithm: str = MOVE_DIGEST) -> Transferred:
    """Copy a disk into another host's instances directory, sparse, its ``algorithm`` block digest computed on the way.

    The 4 MiB blocks that the source's data ranges touch are handled by ``workers`` threads at
    once (the file calls and the hashes release the GIL): each block is read into the thread's own
    page-aligned buffer and digested, and unless its digest is that of zeros (the hash tells an
    all-zero block apart as surely as it tells a whole copy) the kernel copies the same range
    into place (``copy_file_range``: the data does not pass through this process a second time,
    and no fresh buffers are allocated per block); where the file systems do not offer that, the
    block is written from the buffer. Holes are neither read nor written. The block digests go beside
    the copy (``<dst>.blocks``) so that the receiver has the digest without reading the disk
    again (:func:`received_digest`). Each file is fsynced and appears atomically.

    Raises:
        DiskCopyFailed: reading or writing failed, or ``src`` changed size during the copy.
    """
    src_path, dst_path = Path(src), Path(dst)
    blocks_path = dst_path.with_name(dst_path.name + BLOCKS_SUFFIX)
    digest_class = block_digest_class(algorithm)
    try:
        with open(src_path, "rb") as fin, _temp_beside(dst_path) as (out, _tmp):
            size = os.fstat(fin.fileno()).st_size
            out.truncate(size)
            pace = _Pace()
            copier = _RangeCopier(fin.fileno(), out.fileno(), dst_path)
            buffers = threading.local()

            def copy_block(index: int) -> tuple[bytes, int]:
                start = index * DIGEST_BLOCK_SIZE
                length = min(DIGEST_BLOCK_SIZE, size - start)
                view = getattr(buffers, "block", None)
                if view is None:
                    view = buffers.block = memoryview(mmap.mmap(-1, DIGEST_BLOCK_SIZE))
                if length < DIGEST_BLOCK_SIZE:
                    view = view[:length]
                if os.preadv(fin.fileno(), [view], start) != length:
                    raise errors.DiskCopyFailed(f"{src_path} shrank while it was being copied.")
                digest = digest_class.block(view)
                if digest == digest_class.zeros(length):
                    return digest, 0
                copier.copy(start, view)
                return digest, length

            count = -(-size // DIGEST_BLOCK_SIZE)
            digests = [digest_class.zeros(DIGEST_BLOCK_SIZE)] * count
            if count and size % DIGEST_BLOCK_SIZE:
                digests[-1] = digest_class.zeros(size % DIGEST_BLOCK_SIZE)
            data_bytes = 0
            todo = iter(_data_blocks(fin.fileno(), size))
            with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="disk-copy") as pool:
                running: deque[tuple[int, Future[tuple[bytes, int]]]] = deque()
                for index in todo:  # a window of blocks in flight: memory stays at a few blocks
                    running.append((index, pool.submit(copy_block, index)))
                    while len(running) >= 2 * max(1, workers):
                        data_bytes += _settle(running, digests, pace)
                while running:
                    data_bytes += _settle(running, digests, pace)
            with _temp_beside(blocks_path) as (sums, _sums_tmp):
                sums.write(b"".join(digests))
    except OSError as exc:
        raise errors.DiskCopyFailed(f"Copying {src_path} to {dst_path} failed: {exc}") from exc
    hasher = digest_class()
    hasher.add_block_digests(b"".join(digests))
    return Transferred(size=size, sha256=hasher.hexdigest(), data_bytes=data_bytes, digest=algorithm, hasher=hasher)


class _RangeCopier:
    """Puts one block of the source at the same offset of the destination, in the kernel where it can.

    ``copy_file_range`` copies between the two files' page caches; file systems (or kernels) that
    refuse it for this pair of files make every later block go through :func:`os.pwrite` of the
    buffer already read.
    """

    UNSUPPORTED = frozenset({errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})

    def __init__(self, src_fd: int, dst_fd: int, dst_path: Path) -> None:
        self.src_fd, self.dst_fd, self.dst_path = src_fd, dst_fd, dst_path
        self.in_kernel = hasattr(os, "copy_file_range")

    def copy(self, start: int, block: memoryview) -> None:
        if self.in_kernel:
            try:
                self._copy_range(start, len(block))
                return
            except OSError as exc:
                if exc.errno not in self.UNSUPPORTED:
                    raise
                self.in_kernel = False
        written = os.pwrite(self.dst_fd, block, start)
        if written != len(block):
            raise errors.DiskCopyFailed(f"Writing {self.dst_path} stopped short at offset {start + written}.")

    def _copy_range(self, start: int, length: int) -> None:
        done = 0
        while done < length:
            copied = os.copy_file_range(self.src_fd, self.dst_fd, length - done, start + done, start + done)
            if copied == 0:
                raise errors.DiskCopyFailed(f"Copying into {self.dst_path} stopped short at offset {start + done}.")
            done += copied


def _settle(running: deque[tuple[int, Future[tuple[bytes, int]]]], digests: list[bytes], pace: _Pace) -> int:
    index, future = running.popleft()
    digests[index], written = future.result()
    pace.moved(written or DIGEST_BLOCK_SIZE)
    return written


def received_digest(path: str | os.PathLike[str], expected_sha256: str, expected_size: int,
                    algorithm: str) -> BlockDigest:
    """The ``algorithm`` block digest object of a disk :func:`copy_to_host` wrote here, from its ``.blocks`` file.

    The disk must have the expected size and its block digests must make up ``expected_sha256``
    (what the sender reported); the disk itself is not read again. A disk that is larger only by
    a hole is the same copy, grown in place by a finish that was interrupted before its guest was
    defined (the instance's disk is a link to it); its first ``expected_size`` bytes are checked.

    Raises:
        DiskCopyFailed: the disk or its block digests are missing or do not match, or ``algorithm``
            is not a block digest this agent knows.
    """
    digest_class = block_digest_class(algorithm)
    disk = Path(path)
    blocks_path = disk.with_name(disk.name + BLOCKS_SUFFIX)
    try:
        size = disk.stat().st_size
        digests = blocks_path.read_bytes()
    except OSError as exc:
        raise errors.DiskCopyFailed(f"The disk copied to {disk} is incomplete: {exc}") from exc
    count = -(-expected_size // DIGEST_BLOCK_SIZE)
    if size < expected_size or len(digests) != 32 * count or (size > expected_size
                                                              and _holds_data(disk, expected_size, size)):
        raise errors.DiskCopyFailed(
            f"The disk copied to {disk} is {size} bytes with {len(digests) // 32} block digests; expected "
            f"{expected_size} bytes.")
    size = expected_size
    hasher = digest_class()
    whole = size // DIGEST_BLOCK_SIZE
    hasher.add_block_digests(digests[:32 * whole])
    if size % DIGEST_BLOCK_SIZE:  # the last, shorter block: read again to carry on from inside it
        with open(disk, "rb") as f:
            f.seek(whole * DIGEST_BLOCK_SIZE)
            last = f.read(size - whole * DIGEST_BLOCK_SIZE)
        if digest_class.block(last) != digests[32 * whole:]:
            raise errors.DiskCopyFailed(f"The last block of the disk copied to {disk} does not match its digest.")
        hasher.update(last)
    if hasher.hexdigest() != expected_sha256.lower():
        raise errors.DiskCopyFailed(
            f"The disk copied to {disk} has block digest {hasher.hexdigest()}, expected {expected_sha256}.")
    return hasher


def _holds_data(path: Path, start: int, end: int) -> bool:
    """Whether the file holds anything but zeros between ``start`` and ``end``.

    Up to the next MiB the bytes are read (the filesystem block that holds ``start`` is data);
    beyond it there must be only a hole.
    """
    aligned = min(-(-start // MiB) * MiB, end)
    with open(path, "rb") as f:
        f.seek(start)
        if f.read(aligned - start).strip(b"\0"):
            return True
        return next(data_segments(f.fileno(), end, aligned), None) is not None


# --- transfers between hosts ---------------------------------------------------------------------


@dataclass(frozen=True)
class Transferred:
    """What one disk transfer moved: the disk's logical size and digest, and the data bytes that travelled.

    ``sha256`` is the hex digest of the transfer's ``digest`` algorithm; ``hasher`` is the digest
    object of the content (for :func:`grown_digest`).
    """

    size: int
    sha256: str
    data_bytes: int
    digest: str = BLOCK_SHA256
    hasher: Any = field(default=None, compare=False, repr=False)


def transfer_key(prefix: str, kind: str) -> str:
    """The S3 key of a transferred disk's data (``<prefix>/<kind>``)."""
    return f"{prefix.rstrip('/')}/{kind}"


def manifest_key(prefix: str, kind: str) -> str:
    """The S3 key of a transferred disk's manifest (``<prefix>/<kind>.manifest.json``)."""
    return transfer_key(prefix, kind) + MANIFEST_SUFFIX


class _ExtentReader:
    """A file-like reader of a sparse file's data: its non-zero chunks, in order, as one stream.

    Holes are skipped without reading them, and so are chunks that read as all zeros. While it
    reads, it records the extents it returned (``[offset, length]``, adjacent ones merged) and
    digests the file's whole logical content, zeros included. Non-seekable, so an upload reads
    it once, in order, and the digest covers exactly what was sent.
    """

    def __init__(self, f: IO[bytes], size: int, chunk_size: int, algorithm: str) -> None:
        self._file = f
        self.size = size
        self.chunk_size = chunk_size
        self.extents: list[list[int]] = []
        self.data_bytes = 0
        self._hasher = DIGESTS[algorithm]()
        self._hashed = 0  # the logical content up to here is hashed
        self._segments = data_segments(f.fileno(), size)
        self._segment: tuple[int, int] | None = None
        self._offset = 0  # next read position inside the current segment
        self._buffer = memoryview(b"")
        self._done = False
        self._pace = _Pace()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def sha256(self) -> str:
        """The digest of the logical content; complete once :meth:`read` has returned ``b""``."""
        return self._hasher.hexdigest()

    def read(self, size: int = -1) -> bytes:
        out = bytearray()
        while size < 0 or len(out) < size:
            if not self._buffer and not self._fill():
                break
            take = len(self._buffer) if size < 0 else min(size - len(out), len(self._buffer))
            out += self._buffer[:take]
            self._buffer = self._buffer[take:]
        return bytes(out)

    def _fill(self) -> bool:
        """Load the next non-zero chunk; False at the end of the file."""
        while not self._done:
            if self._segment is None or self._offset >= self._segment[1]:
                self._segment = next(self._segments, None)
                if self._segment is None:
                    self._hasher.update_zeros(self.size - self._hashed)
                    self._hashed = self.size
                    self._done = True
                    return False
                self._offset = self._segment[0]
            start = self._offset
            self._file.seek(start)
            chunk = self._file.read(min(self.chunk_size, self._segment[1] - start))
            if not chunk:
                raise errors.DiskCopyFailed(f"{self._file.name} shrank while it was being sent.")
            self._pace.moved(len(chunk))
            self._hasher.update_zeros(start - self._hashed)
            self._hasher.update(chunk)
            self._hashed = start + len(chunk)
            self._offset = self._hashed
            if chunk.count(0) == len(chunk):
                continue
            if self.extents and self.extents[-1][0] + self.extents[-1][1] == start:
                self.extents[-1][1] += len(chunk)
            else:
                self.extents.append([start, len(chunk)])
            self.data_bytes += len(chunk)
            self._buffer = memoryview(chunk)
            return True
        return False


def transfer_part_size(size: int, minimum: int = TRANSFER_PART_SIZE) -> int:
    """The part size of a multipart upload of at most ``size`` bytes: ``minimum``, or more when the
    upload would otherwise take more than :data:`TRANSFER_MAX_PARTS` parts; a whole number of MiB,
    at most S3's largest part (:data:`TRANSFER_MAX_PART_SIZE`).

    A disk's data is sent as a stream the transfer manager cannot measure (:class:`_ExtentReader`),
    so the manager keeps the part size it is given, and S3 refuses a part beyond the 10,000th.
    """
    needed = -(-size // TRANSFER_MAX_PARTS)  # ceiling division
    return min(max(minimum, -(-needed // MiB) * MiB), TRANSFER_MAX_PART_SIZE)


def transfer_parts_in_memory(part_size: int) -> int:
    """How many parts of ``part_size`` a transfer upload buffers at once: as many as
    :data:`TRANSFER_MEMORY` holds, and at least :data:`TRANSFER_MIN_PARTS_IN_MEMORY` (one read
    while another is sent).
    """
    return max(TRANSFER_MIN_PARTS_IN_MEMORY, TRANSFER_MEMORY // part_size)


def upload_disk(
    s3_client: Any,
    path: str | os.PathLike[str],
    bucket: str,
    prefix: str,
    kind: str,
    chunk_size: int = CHUNK_SIZE,
    part_size: int = TRANSFER_PART_SIZE,
    algorithm: str = BLOCK_SHA256,
) -> Transferred:
    """Send a disk to ``s3://bucket/<prefix>/<kind>`` as its data extents, then its manifest.

    Streams with a multipart upload; only the data (non-zero chunks of the data ranges) is read
    and sent. The stream's parts are buffered whole, at most :func:`transfer_parts_in_memory`
    of them (about :data:`TRANSFER_MEMORY`) plus the one being read. Sending again replaces both
    objects. The manifest carries the ``algorithm`` digest (:data:`DIGESTS`) of the whole disk.

    Args:
        part_size: the smallest part; parts are larger for a disk whose logical size (the most
            data it can hold) would need too many (:func:`transfer_part_size`).

    Raises:
        DiskCopyFailed: the disk cannot be read or the upload failed.
    """
    source = Path(path)
    key = transfer_key(prefix, kind)
    try:
        with open(source, "rb") as f:
            reader = _ExtentReader(f, os.fstat(f.fileno()).st_size, chunk_size, algorithm)
            part = transfer_part_size(reader.size, part_size)
            in_memory = transfer_parts_in_memory(part)
            # A part being sent holds its place in memory: more threads than places would only wait.
            config = TransferConfig(
                multipart_threshold=part, multipart_chunksize=part,
                max_concurrency=min(TRANSFER_CONCURRENCY, in_memory),
            )
            config.max_in_memory_upload_chunks = in_memory  # not one of boto3's arguments
            aws.upload_fileobj(s3_client, reader, bucket, key, Config=config)
            if reader.read(1):
                raise errors.DiskCopyFailed(f"The upload of {source} stopped before its end.")
        manifest = {
            "size": reader.size,
            "extents": reader.extents,
            "sha256": reader.sha256,
            "digest": algorithm,
            "chunk_size": chunk_size,
        }
        s3_client.put_object(
            Bucket=bucket,
            Key=manifest_key(prefix, kind),
            Body=json.dumps(manifest).encode(),
            ContentType="application/json",
        )
    except (ClientError, BotoCoreError, S3UploadFailedError, OSError) as exc:
        raise errors.DiskCopyFailed(
            f"Sending {source} to s3://{bucket}/{key} failed: {exc}", bucket=bucket, key=key
        ) from exc
    return Transferred(size=reader.size, sha256=reader.sha256, data_bytes=reader.data_bytes, digest=algorithm)


def _read_manifest(s3_client: Any, bucket: str, key: str) -> tuple[int, list[tuple[int, int]], str, str]:
    """The (size, extents, digest, digest algorithm) of a transfer manifest, checked for sense.

    A manifest without ``digest`` is a plain SHA-256 one (as agents before block digests wrote).

    Raises:
        DiskCopyFailed: the manifest is missing, unreadable or inconsistent.
        ClientError, BotoCoreError: S3 failed (the caller wraps them).
    """
    body = s3_client.get_object(Bucket=bucket, Key=key)["Body"]
    try:
        raw = body.read()
    finally:
        body.close()
    try:
        manifest = json.loads(raw)
        size = int(manifest["size"])
        sha = str(manifest["sha256"]).lower()
        extents = [(int(offset), int(length)) for offset, length in manifest["extents"]]
        algorithm = str(manifest.get("digest", SHA256))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise errors.DiskCopyFailed(f"The transfer manifest s3://{bucket}/{key} is not valid: {exc}") from exc
    position = 0
    for offset, length in extents:
        if offset < position or length <= 0 or offset + length > size:
            raise errors.DiskCopyFailed(f"The transfer manifest s3://{bucket}/{key} has overlapping or stray extents.")
        position = offset + length
    if algorithm not in DIGESTS:
        raise errors.DiskCopyFailed(f"The transfer manifest s3://{bucket}/{key} has an unknown digest {algorithm!r}.")
    return size, extents, sha, algorithm


def _read_exactly(body: Any, count: int, chunk_size: int) -> Iterator[bytes]:
    """``count`` bytes of a streaming body, in chunks of at most ``chunk_size``."""
    while count > 0:
        chunk = body.read(min(chunk_size, count))
        if not chunk:
            raise errors.DiskCopyFailed("The transferred data ended before the manifest's extents.")
        count -= len(chunk)
        yield chunk


def download_disk(
    s3_client: Any,
    bucket: str,
    prefix: str,
    kind: str,
    dest: str | os.PathLike[str],
    expected_sha256: str | None = None,
    expected_size: int | None = None,
    chunk_size: int = CHUNK_SIZE,
    *,
    exclusive: bool = False,
    record_identity: IdentityRecorder | None = None,
) -> Transferred:
    """Rebuild a transferred disk at ``dest``: each extent written in place in a sparse file.

    The disk's digest must match its manifest and, when given, ``expected_sha256`` and
    ``expected_size`` (what the sender reported). ``dest`` appears atomically and only when
    verified; with ``exclusive``, never in place of a file there. ``record_identity`` is given
    the disk's identity before it takes ``dest``'s name.

    Raises:
        DiskCopyFailed: the transfer is missing, incomplete, inconsistent or corrupt, or writing failed.
        FileTaken: with ``exclusive``, a file appeared at ``dest`` meanwhile.
    """
    dest_path = Path(dest)
    data_key, man_key = transfer_key(prefix, kind), manifest_key(prefix, kind)
    try:
        size, extents, manifest_sha, algorithm = _read_manifest(s3_client, bucket, man_key)
        if expected_sha256 is not None and manifest_sha != expected_sha256.lower():
            raise errors.DiskCopyFailed(
                f"The transfer s3://{bucket}/{data_key} is of another disk (sha256 {manifest_sha}, expected "
                f"{expected_sha256}).",
                bucket=bucket,
                key=data_key,
            )
        if expected_size is not None and size != expected_size:
            raise errors.DiskCopyFailed(
                f"The transfer s3://{bucket}/{data_key} is {size} bytes, expected {expected_size}.",
                bucket=bucket,
                key=data_key,
            )
        hasher = DIGESTS[algorithm]()
        data_bytes = 0
        with _temp_beside(dest_path, exclusive=exclusive, record_identity=record_identity) as (out, _tmp):
            body = s3_client.get_object(Bucket=bucket, Key=data_key)["Body"]
            try:
                writer = _SparseWriter(out)
                pace = _Pace()
                position = 0
                for offset, length in extents:
                    hasher.update_zeros(offset - position)
                    out.seek(offset)
                    for chunk in _read_exactly(body, length, chunk_size):
                        hasher.update(chunk)
                        writer.write(chunk)
                        pace.moved(len(chunk))
                    data_bytes += length
                    position = offset + length
                if body.read(1):
                    raise errors.DiskCopyFailed(
                        f"The transfer s3://{bucket}/{data_key} has more data than its extents."
                    )
            finally:
                body.close()
            hasher.update_zeros(size - position)
            writer.finish(size)
            digest = hasher.hexdigest()
            if digest != manifest_sha:
                raise errors.DiskCopyFailed(
                    f"The transfer s3://{bucket}/{data_key} has {algorithm} {digest}, expected {manifest_sha}.",
                    bucket=bucket,
                    key=data_key,
                )
    except errors.DiskCopyFailed:
        raise
    except (ClientError, BotoCoreError, OSError) as exc:
        raise errors.DiskCopyFailed(
            f"Fetching s3://{bucket}/{data_key} to {dest_path} failed: {exc}", bucket=bucket, key=data_key
        ) from exc
    return Transferred(size=size, sha256=digest, data_bytes=data_bytes, digest=algorithm, hasher=hasher)


def delete_transfer(s3_client: Any, bucket: str, prefix: str) -> int:
    """Delete every object under ``<prefix>/`` and abort its unfinished uploads; return how many objects.

    Nothing there is fine.

    Raises:
        ClientError, BotoCoreError: S3 failed, also when it answered that some objects were not
            deleted (DeleteObjects reports those in its answer instead of raising).
    """
    folder = prefix.rstrip("/") + "/"
    deleted = 0
    paginator = s3_client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=folder):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            answer = s3_client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            if failed := answer.get("Errors"):
                raise ClientError({"Error": {"Code": failed[0].get("Code", "InternalError"),
                                             "Message": f"{len(failed)} object(s) under {folder} not deleted, "
                                                        f"{failed[0].get('Key')} first: {failed[0].get('Message')}"}},
                                  "DeleteObjects")
            deleted += len(keys)
    aws.abort_uploads(s3_client, bucket, folder)
    return deleted


# --- snapshots as images ---------------------------------------------------------------------------


def image_sha256(s3_client: Any, bucket: str, key: str) -> str | None:
    """The sha256 an image object's metadata records, or None when there is no finished image there."""
    try:
        head = s3_client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    return (head.get("Metadata") or {}).get("sha256") or None


IMAGE_DATA_KIND = "disk"
# The fault point between a snapshot's data and its image object (``*:snapshot_written``).
SNAPSHOT_WRITTEN_FAULT = "snapshot_written"
EXTENTS_LAYOUT = "extents"  # ferry.images.EXTENTS_LAYOUT


def upload_sparse_image(
    s3_client: Any,
    path: str | os.PathLike[str],
    bucket: str,
    key: str,
    data_prefix: str,
    metadata: dict[str, str],
) -> Transferred:
    """Store the disk at ``path`` as the sparse image ``s3://bucket/key``; return what was sent.

    The disk's written extents and their manifest go under ``data_prefix`` (as a transfer
    between hosts does: holes and zero blocks are not sent), then the image object itself, a
    small pointer to them, with ``metadata`` plus the block digest of the whole disk (``sha256``,
    named by ``digest``), its ``virtual-size`` and ``data-size``: the image exists, finished,
    from that one write on.

    Raises:
        DiskCopyFailed: the disk cannot be read or the upload failed.
    """
    sent = upload_disk(s3_client, path, bucket, data_prefix, IMAGE_DATA_KIND)
    faults.check(f"*:{SNAPSHOT_WRITTEN_FAULT}")  # drills: the data is sent, the image not yet written
    pointer = {"layout": EXTENTS_LAYOUT, "prefix": data_prefix, "kind": IMAGE_DATA_KIND}
    try:
        s3_client.put_object(
            Bucket=bucket,
            Key=key,
            Body=json.dumps(pointer).encode(),
            ContentType="application/json",
            Metadata={**metadata, "layout": EXTENTS_LAYOUT, "sha256": sent.sha256, "digest": sent.digest,
                      "virtual-size": str(sent.size), "data-size": str(sent.data_bytes)},
        )
    except (ClientError, BotoCoreError) as exc:
        raise errors.DiskCopyFailed(f"Writing the image s3://{bucket}/{key} failed: {exc}", bucket=bucket,
                                    key=key) from exc
    return sent


def _download_sparse_image(
    s3_client: Any, bucket: str, key: str, dest: str | os.PathLike[str], expected_sha256: str, chunk_size: int,
    *, exclusive: bool = False, record_identity: IdentityRecorder | None = None,
) -> int:
    """Rebuild a sparse image's disk at ``dest`` from its extents, verified; return its size.

    Raises:
        ImageDownloadFailed: the pointer, manifest or data are missing or do not match.
        FileTaken: with ``exclusive``, a file appeared at ``dest`` meanwhile.
    """
    try:
        body = s3_client.get_object(Bucket=bucket, Key=key)["Body"]
        try:
            pointer = json.loads(body.read())
        finally:
            body.close()
        got = download_disk(s3_client, bucket, str(pointer["prefix"]), str(pointer["kind"]), dest,
                            expected_sha256=expected_sha256, chunk_size=chunk_size, exclusive=exclusive,
                            record_identity=record_identity)
    except (ValueError, TypeError, KeyError) as exc:
        raise errors.ImageDownloadFailed(f"Image s3://{bucket}/{key} is not a valid sparse image: {exc}",
                                         bucket=bucket, key=key) from exc
    except errors.DiskCopyFailed as exc:
        raise errors.ImageDownloadFailed(f"Image s3://{bucket}/{key}: {exc.message}", bucket=bucket, key=key) from exc
    except (ClientError, BotoCoreError) as exc:
        raise errors.ImageDownloadFailed(f"Image s3://{bucket}/{key} cannot be read: {exc}", bucket=bucket,
                                         key=key) from exc
    return got.size
