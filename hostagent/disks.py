"""Instance disks as files: download, sparse copy, checksum, grow.

Everything streams in chunks (never a whole file in memory) and writes sparse: runs of zeros
become holes. A file is written to a temporary name beside its destination and renamed into
place once complete, so a disk path either does not exist or holds a whole, verified disk.

An instance's disks live in ``<instances_dir>/<uuid>/``: ``disk`` (root), ``disk.eph0``
(ephemeral) and ``disk.swap``. Disks are raw files; their size is the flavor's (sparse).
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from botocore.exceptions import BotoCoreError, ClientError

from ferry import errors

CHUNK_SIZE = 4 * 2**20
GiB = 2**30
MiB = 2**20

ROOT_DISK = "disk"
EPHEMERAL_DISK = "disk.eph0"
SWAP_DISK = "disk.swap"
IMAGE_CACHE_DIR = "_base"


def instance_dir(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    """The directory holding an instance's disks."""
    return Path(instances_dir) / instance_uuid


def root_disk_path(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    return instance_dir(instances_dir, instance_uuid) / ROOT_DISK


def ephemeral_disk_path(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    return instance_dir(instances_dir, instance_uuid) / EPHEMERAL_DISK


def swap_disk_path(instances_dir: str | os.PathLike[str], instance_uuid: str) -> Path:
    return instance_dir(instances_dir, instance_uuid) / SWAP_DISK


def remove_instance_dir(instances_dir: str | os.PathLike[str], instance_uuid: str) -> None:
    """Delete an instance's directory and every disk in it; an absent directory is already gone."""
    try:
        shutil.rmtree(instance_dir(instances_dir, instance_uuid))
    except FileNotFoundError:
        pass


@contextmanager
def _temp_beside(dest: Path) -> Iterator[tuple[IO[bytes], Path]]:
    """A temporary file in ``dest``'s directory, renamed to ``dest`` on success and removed on failure."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out, tmp
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


def _hash_zeros(hasher: Any, count: int, chunk_size: int) -> None:
    zeros = bytes(min(chunk_size, count)) if count else b""
    view = memoryview(zeros)
    while count > 0:
        step = min(count, len(view))
        hasher.update(view[:step])
        count -= step


def data_segments(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The ``(start, end)`` byte ranges of an open file that hold data, skipping holes.

    On a filesystem without SEEK_DATA/SEEK_HOLE the whole file is one data range.
    """
    offset = 0
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


def copy_sparse(src: str | os.PathLike[str], dst: str | os.PathLike[str], chunk_size: int = CHUNK_SIZE) -> str:
    """Copy ``src`` to ``dst`` keeping holes, and return the sha256 of the content copied.

    Only the data ranges of ``src`` are read; zero chunks are not written, so ``dst`` is at
    least as sparse as ``src``. ``dst`` appears atomically when the copy is complete.

    Raises:
        DiskCopyFailed: reading or writing failed, or ``src`` changed size during the copy.
    """
    src_path, dst_path = Path(src), Path(dst)
    hasher = hashlib.sha256()
    try:
        with open(src_path, "rb") as fin, _temp_beside(dst_path) as (out, _tmp):
            size = os.fstat(fin.fileno()).st_size
            writer = _SparseWriter(out)
            position = 0
            for start, end in data_segments(fin.fileno(), size):
                _hash_zeros(hasher, start - position, chunk_size)
                fin.seek(start)
                out.seek(start)
                remaining = end - start
                while remaining > 0:
                    chunk = fin.read(min(chunk_size, remaining))
                    if not chunk:
                        raise errors.DiskCopyFailed(f"{src_path} shrank while it was being copied.")
                    hasher.update(chunk)
                    writer.write(chunk)
                    remaining -= len(chunk)
                position = end
            _hash_zeros(hasher, size - position, chunk_size)
            writer.finish(size)
    except OSError as exc:
        raise errors.DiskCopyFailed(f"Copying {src_path} to {dst_path} failed: {exc}") from exc
    return hasher.hexdigest()


def download_image(
    s3_client: Any,
    bucket: str,
    key: str,
    dest: str | os.PathLike[str],
    expected_sha256: str,
    chunk_size: int = CHUNK_SIZE,
) -> int:
    """Stream ``s3://bucket/key`` to ``dest`` (sparse), verifying its sha256; return its size in bytes.

    ``dest`` appears atomically and only with the expected content.

    Raises:
        ImageDownloadFailed: the object cannot be read, writing failed, or the checksum differs.
    """
    dest_path = Path(dest)
    hasher = hashlib.sha256()
    size = 0
    try:
        with _temp_beside(dest_path) as (out, _tmp):
            body = s3_client.get_object(Bucket=bucket, Key=key)["Body"]
            writer = _SparseWriter(out)
            try:
                for chunk in body.iter_chunks(chunk_size):
                    hasher.update(chunk)
                    writer.write(chunk)
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
    """Extend a raw disk to ``size_bytes`` with a hole; a larger disk is never shrunk. Returns the size.

    Raises:
        OSError: the file cannot be extended.
    """
    current = os.path.getsize(path)
    if size_bytes > current:
        os.truncate(path, size_bytes)
        return size_bytes
    return current


def create_sparse(path: str | os.PathLike[str], size_bytes: int) -> Path:
    """Create an empty (all-hole) disk of ``size_bytes``; an existing disk is kept and grown if smaller.

    Raises:
        OSError: the file cannot be created.
    """
    target = Path(path)
    if target.exists():
        grow(target, size_bytes)
        return target
    with _temp_beside(target) as (out, _tmp):
        out.truncate(size_bytes)
    return target


def create_root_disk(
    s3_client: Any,
    image: dict[str, Any],
    root_bytes: int,
    dest: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> int:
    """Write a root disk from a raw image in S3 and grow it to ``root_bytes``; return its size.

    ``root_bytes == 0`` (a flavor with ``root_gb`` 0) keeps the image's own size, as Nova does.
    With ``cache_dir`` the image is downloaded once per checksum into the cache and copied
    (sparse, verified) from there.

    Args:
        image: ``{"id", "bucket", "key", "sha256"}``.

    Raises:
        SpawnFailed: the image is larger than the root disk.
        ImageDownloadFailed: the image cannot be fetched or its checksum differs.
        DiskCopyFailed: copying from the cache failed.
    """
    dest_path = Path(dest)
    bucket, key, expected = image["bucket"], image["key"], image["sha256"].lower()
    try:
        image_size = int(s3_client.head_object(Bucket=bucket, Key=key)["ContentLength"])
    except (ClientError, BotoCoreError) as exc:
        raise errors.ImageDownloadFailed(
            f"Image s3://{bucket}/{key} cannot be read: {exc}", bucket=bucket, key=key
        ) from exc
    if root_bytes > 0 and image_size > root_bytes:
        raise errors.SpawnFailed(
            f"Image {image.get('id')} ({image_size} bytes) is larger than the root disk ({root_bytes} bytes).",
            image_id=image.get("id"),
        )
    if cache_dir is None:
        download_image(s3_client, bucket, key, dest_path, expected, chunk_size)
    else:
        cached = Path(cache_dir) / expected
        if not cached.exists():
            download_image(s3_client, bucket, key, cached, expected, chunk_size)
        if copy_sparse(cached, dest_path, chunk_size) != expected:
            # The cached copy rotted on disk: drop it and the copy, and fetch the image afresh.
            dest_path.unlink(missing_ok=True)
            cached.unlink(missing_ok=True)
            download_image(s3_client, bucket, key, cached, expected, chunk_size)
            if copy_sparse(cached, dest_path, chunk_size) != expected:
                dest_path.unlink(missing_ok=True)
                raise errors.ImageDownloadFailed(f"Image {image.get('id')} changed while it was being copied.")
    if root_bytes > 0 and os.path.getsize(dest_path) > root_bytes:
        # The object changed between its size check and its download.
        dest_path.unlink(missing_ok=True)
        raise errors.SpawnFailed(f"Image {image.get('id')} is larger than the root disk ({root_bytes} bytes).")
    return grow(dest_path, root_bytes) if root_bytes > 0 else os.path.getsize(dest_path)
