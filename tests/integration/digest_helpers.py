"""Ferry's block digests of a disk, computed independently of ``hostagent.disks`` to check them.

Every 4 MiB block of the logical content, counted from the start (the last may be shorter), is
hashed; the digest is the hash of those digests in order. ``sha256-blocks`` hashes with SHA-256,
``blake3-blocks`` (what moves use) with BLAKE3. Blocks are read with ``pread`` (a hole reads as
zeros); a block the file's data ranges do not touch is not read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blake3 import blake3

BLOCK = 4 * 2**20
HASHES: dict[str, Callable[..., Any]] = {"sha256-blocks": hashlib.sha256, "blake3-blocks": blake3}
MOVES = "blake3-blocks"


def block_digest_of(content: bytes, algorithm: str = "sha256-blocks") -> str:
    new = HASHES[algorithm]
    outer = new()
    for start in range(0, len(content), BLOCK):
        outer.update(new(content[start:start + BLOCK]).digest())
    return outer.hexdigest()


def block_digest(path: Path, count: int | None = None, algorithm: str = "sha256-blocks") -> str:
    """The block digest of the first ``count`` bytes of a file (all of it by default)."""
    new = HASHES[algorithm]
    size = os.path.getsize(path) if count is None else count
    assert os.path.getsize(path) >= size, f"{path} is shorter than expected"
    outer = new()
    zero_digest = new(bytes(BLOCK)).digest()
    fd = os.open(path, os.O_RDONLY)
    try:
        for start in range(0, size, BLOCK):
            length = min(BLOCK, size - start)
            try:
                data_at = os.lseek(fd, start, os.SEEK_DATA)
            except OSError:  # only a hole remains
                data_at = size
            if data_at >= start + length:
                outer.update(zero_digest if length == BLOCK else new(bytes(length)).digest())
            else:
                block = os.pread(fd, length, start)
                assert len(block) == length
                outer.update(new(block).digest())
    finally:
        os.close(fd)
    return outer.hexdigest()
