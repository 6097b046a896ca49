"""Ferry's block digest of a disk, computed independently of ``hostagent.disks`` to check it.

Every 4 MiB block of the logical content, counted from the start (the last may be shorter), is
hashed with SHA-256; the digest is the SHA-256 of those digests in order. Blocks are read with
``pread`` (a hole reads as zeros); a block the file's data ranges do not touch is not read.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

BLOCK = 4 * 2**20


def block_digest_of(content: bytes) -> str:
    outer = hashlib.sha256()
    for start in range(0, len(content), BLOCK):
        outer.update(hashlib.sha256(content[start:start + BLOCK]).digest())
    return outer.hexdigest()


def block_digest(path: Path, count: int | None = None) -> str:
    """The block digest of the first ``count`` bytes of a file (all of it by default)."""
    size = os.path.getsize(path) if count is None else count
    assert os.path.getsize(path) >= size, f"{path} is shorter than expected"
    outer = hashlib.sha256()
    zero_digest = hashlib.sha256(bytes(BLOCK)).digest()
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in range(0, size, BLOCK):
            length = min(BLOCK, size - start)
            try:
                data_at = os.lseek(fd, start, os.SEEK_DATA)
            except OSError:  # only a hole remains
                data_at = size
            if data_at >= start + length:
                outer.update(zero_digest if length == BLOCK else hashlib.sha256(bytes(length)).digest())
            else:
                block = os.pread(fd, length, start)
                assert len(block) == length
                outer.update(hashlib.sha256(block).digest())
    finally:
        os.close(fd)
    return outer.hexdigest()
