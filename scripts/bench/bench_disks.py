#!/usr/bin/env python3
"""Benchmark disk moves: the host agent's direct copy and its transfer through S3, against ``cp``.

A move between two hosts is what ``resize_instance`` at the source and ``finish_resize`` at the
destination do. When the source sees the destination's instances directory it copies the disk
straight in (``hostagent.disks.copy_to_host``) and the destination checks it from its block
digests (``received_digest``): the "direct" figures. Otherwise the disk's data extents go to S3
(``upload_disk``) and are rebuilt, verified, at the destination (``download_disk``), as snapshots
always do: the "S3" figures, with S3 being moto's server in its own process as on the local
stack. Each side runs in a fresh child process so its peak RSS is its own.

Cases, each in one run on one filesystem:

* a fully written disk (2 GiB by default): ``cp`` of it, then the direct move, then the move
  through S3; the ratio is cp time / move time (the target is at least 0.9);
* a fully written 1 GiB disk and a 20 GiB sparse disk holding 1 GiB of data spread over it:
  the sparse move should take about the time of the 1 GiB one (both ways).

Files live under a temporary directory on ``--dir``'s filesystem (the system temporary directory
by default) and are removed afterwards. When that filesystem has less free space than the run
needs, ``/dev/shm`` is used instead and the output says so.

    .venv/bin/python scripts/bench/bench_disks.py [--size-gib 2] [--sparse-gib 20] [--dir /var/tmp] \
        [--compare-digest] [--unsynced]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blake3 import blake3

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "layers" / "core" / "python")]
from machine import print_header  # noqa: E402 - the sibling modules of this script

from ferry.protocol import BLOCK_SHA256, MOVE_DIGEST  # noqa: E402 - the digests' names, from the layer

MiB = 2**20
GiB = 2**30
BUCKET = "ferry-bench-transfers"
WRITE_CHUNK = 8 * MiB

# The two sides of a move, run as ``python -c`` in a child process: they print one JSON line.
SIDE = r"""
import json, resource, sys, time
import boto3
from botocore.config import Config
from hostagent import disks
BUCKET = "ferry-bench-transfers"
op, endpoint, path, prefix = sys.argv[1:5]
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x",
                  aws_secret_access_key="x", config=Config(max_pool_connections=16))
started = time.perf_counter()
checked = 0.0
if op == "upload":
    moved = disks.upload_disk(s3, path, BUCKET, prefix, "root", algorithm=disks.MOVE_DIGEST)
elif op == "download":
    moved = disks.download_disk(s3, BUCKET, prefix, "root", path, expected_sha256=sys.argv[5])
else:  # direct: the source's copy into the destination's directory, then the destination's check
    if sys.argv[6] == "unsynced":  # what durability costs: the same copy with its fsyncs left out
        import os
        os.fsync = lambda fd: None
    moved = disks.copy_to_host(path, prefix, algorithm=sys.argv[5])
    copied = time.perf_counter()
    disks.received_digest(prefix, moved.sha256, moved.size, moved.digest)
    checked = time.perf_counter() - copied
elapsed = time.perf_counter() - started
print(json.dumps({"seconds": elapsed, "check_seconds": checked, "sha256": moved.sha256,
                  "data_bytes": moved.data_bytes, "size": moved.size,
                  "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""

MOTO = r"""
import sys, time
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_disk(path: Path, size: int, data_extents: list[tuple[int, int]]) -> None:
    """A sparse file of ``size`` with random data written over each (offset, length)."""
    with open(path, "wb") as f:
        for offset, length in data_extents:
            f.seek(offset)
            remaining = length
            while remaining:
                step = min(WRITE_CHUNK, remaining)
                f.write(os.urandom(step))
                remaining -= step
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def spread_extents(size: int, data: int, pieces: int = 16) -> list[tuple[int, int]]:
    """``pieces`` equal extents totalling ``data`` bytes, spread evenly over ``size`` bytes."""
    piece, stride = data // pieces, size // pieces
    return [(n * stride, piece) for n in range(pieces)]


SETTLE_SECONDS = 2.0


def drop_cache(path: Path) -> None:
    """Let earlier writes and deletions reach the disk, then forget the file's cached pages.

    Every case starts from the disk alike: without the wait, the write-back of the previous
    case's copy and the discard of the blocks it freed when it was deleted would land on the
    next case's time.
    """
    os.sync()
    time.sleep(SETTLE_SECONDS)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError:
        pass


def run_side(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / "layers" / "core" / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SIDE, *args], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{args[0]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def move(endpoint: str, src: Path, dest: Path, prefix: str) -> dict:
    """Upload then download ``src`` to ``dest``; the figures of both sides."""
    drop_cache(src)
    up = run_side("upload", endpoint, str(src), prefix)
    down = run_side("download", endpoint, str(dest), prefix, up["sha256"])
    return {"upload": up, "download": down, "seconds": up["seconds"] + down["seconds"]}


EARLIER_DIGEST = BLOCK_SHA256  # what moves used before (--compare-digest)


def direct(endpoint: str, src: Path, dest: Path, algorithm: str = MOVE_DIGEST, synced: bool = True) -> dict:
    """Copy ``src`` to ``dest`` as a source that sees the destination's directory does; its figures."""
    drop_cache(src)
    copied = run_side("direct", endpoint, str(src), str(dest), algorithm, "synced" if synced else "unsynced")
    Path(str(dest) + ".blocks").unlink()
    return copied


def report_direct(label: str, copied: dict) -> None:
    print(f"  {label}: direct {copied['seconds']:6.2f} s ({rate(copied['size'], copied['seconds'])} of disk, "
          f"{rate(copied['data_bytes'], copied['seconds'])} of data; the destination's check "
          f"{copied['check_seconds'] * 1000:.0f} ms); data written {copied['data_bytes'] / MiB:.0f} MiB of "
          f"{copied['size'] / MiB:.0f} MiB; peak RSS {copied['max_rss_kib'] / 1024:.0f} MiB", flush=True)


def timed_cp(src: Path, dest: Path) -> tuple[float, float]:
    """Seconds of ``cp``, and of ``cp`` then an fsync of the copy (a move's copy is on disk when it ends)."""
    drop_cache(src)
    started = time.perf_counter()
    subprocess.run(["cp", "--sparse=auto", str(src), str(dest)], check=True)
    copied = time.perf_counter() - started
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return copied, time.perf_counter() - started


def hash_rate(new: Callable[[bytes], Any]) -> float:
    """Bytes per second of a hash on one core over 4 MiB blocks in memory (a block digest's CPU cost)."""
    block = os.urandom(4 * MiB)
    new(block).digest()
    started = time.perf_counter()
    for _ in range(64):
        new(block).digest()
    return 64 * len(block) / (time.perf_counter() - started)


def rate(data_bytes: int, seconds: float) -> str:
    return f"{data_bytes / MiB / seconds:7.1f} MiB/s"


def report_move(label: str, moved: dict) -> None:
    up, down = moved["upload"], moved["download"]
    print(f"  {label}: move {moved['seconds']:6.2f} s (upload {up['seconds']:.2f} s at "
          f"{rate(up['data_bytes'], up['seconds'])}, download {down['seconds']:.2f} s at "
          f"{rate(down['data_bytes'], down['seconds'])}); data sent {up['data_bytes'] / MiB:.0f} MiB of "
          f"{up['size'] / MiB:.0f} MiB; peak RSS upload {up['max_rss_kib'] / 1024:.0f} MiB, "
          f"download {down['max_rss_kib'] / 1024:.0f} MiB", flush=True)


def pick_directory(requested: Path, needed: int) -> Path:
    free = shutil.disk_usage(requested).free
    if free >= needed:
        return requested
    shm = Path("/dev/shm")
    print(f"  {requested} has {free / GiB:.1f} GiB free, the run needs {needed / GiB:.1f} GiB: using {shm} (tmpfs)")
    return shm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="the fully written disk (default 2)")
    parser.add_argument("--sparse-gib", type=float, default=20.0, help="the sparse disk's size (default 20)")
    parser.add_argument("--written-gib", type=float, default=1.0, help="data in the sparse disk (default 1)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--repeat", type=int, default=5, help="cp and direct copies of the full disk (medians)")
    parser.add_argument("--compare-digest", action="store_true",
                        help=f"also copy the full disk with {EARLIER_DIGEST} digests, alternately (before and after)")
    parser.add_argument("--unsynced", action="store_true",
                        help="also copy the full disk without its fsyncs, alternately (what durability costs)")
    args = parser.parse_args(argv)
    size, sparse, written = int(args.size_gib * GiB), int(args.sparse_gib * GiB), int(args.written_gib * GiB)
    print_header("disk moves: host agent direct copy and transfer through S3 (moto server) vs cp")
    # moto keeps the object (its temporary files go to the same place) next to source and copy.
    needed = 3 * max(size, written) + GiB // 2
    base = pick_directory(args.dir, needed)
    stat = os.statvfs(base)
    print(f"  files under {base} (filesystem block size {stat.f_bsize}); before each case the disk is synced, "
          f"left {SETTLE_SECONDS:g} s to settle, and the source's cached pages dropped")

    with tempfile.TemporaryDirectory(prefix="ferry-bench-disks-", dir=base) as tmp:
        work = Path(tmp)
        port = free_port()
        moto = subprocess.Popen([sys.executable, "-c", MOTO, str(port)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=dict(os.environ, TMPDIR=str(work)))
        try:
            assert moto.stdout is not None and moto.stdout.readline().strip() == "ready"
            endpoint = f"http://127.0.0.1:{port}"
            import boto3

            s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x",
                              aws_secret_access_key="x")
            s3.create_bucket(Bucket=BUCKET)

            src, dest = work / "src-disk", work / "dest-disk"
            print(f"\nfully written disk, {size / GiB:g} GiB")
            write_disk(src, size, [(0, size)])
            cps, synced, copies, earlier, unsynced = [], [], [], [], []
            for _ in range(max(1, args.repeat)):  # alternately, so that all meet the storage alike
                plain, durable = timed_cp(src, dest)
                cps.append(plain)
                synced.append(durable)
                dest.unlink()
                copies.append(direct(endpoint, src, dest))
                dest.unlink()
                if args.compare_digest:
                    earlier.append(direct(endpoint, src, dest, EARLIER_DIGEST))
                    dest.unlink()
                if args.unsynced:
                    unsynced.append(direct(endpoint, src, dest, synced=False))
                    dest.unlink()
            cp_seconds, cp_synced = statistics.median(cps), statistics.median(synced)
            copied = sorted(copies, key=lambda c: c["seconds"])[len(copies) // 2]
            print(f"  cp:   {cp_seconds:6.2f} s ({rate(size, cp_seconds)}); cp and fsync of the copy "
                  f"{cp_synced:.2f} s (medians of {len(cps)}: {', '.join(f'{c:.2f}' for c in cps)} / "
                  f"{', '.join(f'{c:.2f}' for c in synced)})")
            report_direct("move", copied)
            runs = ", ".join(f"{c['seconds']:.2f}" for c in copies)
            print(f"    direct runs: {runs} s")
            for label, variant in ((f"with {EARLIER_DIGEST} digests instead", earlier),
                                   ("without its fsyncs (not a move: the copy would not be on disk when it ends)",
                                    unsynced)):
                if variant:
                    median = statistics.median(c["seconds"] for c in variant)
                    variant_runs = ", ".join(f"{c['seconds']:.2f}" for c in variant)
                    print(f"    {label}: median {median:.2f} s ({variant_runs}); cp / that = {cp_seconds / median:.2f}")
            ratio = cp_seconds / copied["seconds"]
            print(f"  direct move speed / cp speed = {ratio:.2f} "
                  f"(target >= 0.90: {'met' if ratio >= 0.9 else 'missed'}); / cp and fsync = "
                  f"{cp_synced / copied['seconds']:.2f}")
            cores = os.cpu_count() or 1
            blake3_rate, sha256_rate = hash_rate(blake3), hash_rate(hashlib.sha256)
            print(f"  floors of a digested, durable copy: the move digest (BLAKE3 blocks) of {size / GiB:g} GiB "
                  f"alone takes {size / blake3_rate / cores:.2f} s on all {cores} cores "
                  f"({blake3_rate / MiB:.0f} MiB/s per core; SHA-256 blocks, as before, "
                  f"{size / sha256_rate / cores:.2f} s at {sha256_rate / MiB:.0f} MiB/s), "
                  f"the fsync after cp {cp_synced - cp_seconds:.2f} s")
            moved = move(endpoint, src, dest, "full")
            report_move("S3  ", moved)
            print(f"  S3 move speed / cp speed = {cp_seconds / moved['seconds']:.2f}")
            for path in (src, dest):
                path.unlink()
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": "full/root"},
                                                                  {"Key": "full/root.manifest.json"}]})

            print(f"\n{written / GiB:g} GiB fully written vs {sparse / GiB:g} GiB sparse with "
                  f"{written / GiB:g} GiB written")
            write_disk(src, written, [(0, written)])
            dense_direct = direct(endpoint, src, dest)
            report_direct(f"{written / GiB:g} GiB dense ", dense_direct)
            dest.unlink()
            dense = move(endpoint, src, dest, "dense")
            report_move(f"{written / GiB:g} GiB dense ", dense)
            for path in (src, dest):
                path.unlink()
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": "dense/root"},
                                                                  {"Key": "dense/root.manifest.json"}]})
            write_disk(src, sparse, spread_extents(sparse, written))
            thin_direct = direct(endpoint, src, dest)
            report_direct(f"{sparse / GiB:g} GiB sparse", thin_direct)
            print(f"  direct: destination allocates {dest.stat().st_blocks * 512 / MiB:.0f} MiB; sparse / dense "
                  f"time = {thin_direct['seconds'] / dense_direct['seconds']:.2f} (target about 1)")
            dest.unlink()
            thin = move(endpoint, src, dest, "sparse")
            report_move(f"{sparse / GiB:g} GiB sparse", thin)
            allocated = dest.stat().st_blocks * 512
            print(f"  destination allocates {allocated / MiB:.0f} MiB of {sparse / MiB:.0f} MiB")
            factor = thin["seconds"] / dense["seconds"]
            print(f"  S3: sparse / dense time = {factor:.2f} (target about 1)")
        finally:
            if moto.stdin:
                moto.stdin.close()
            try:
                moto.wait(timeout=20)
            except subprocess.TimeoutExpired:
                moto.kill()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(f"\n  largest child RSS (the moto server holds whole objects): {children / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
