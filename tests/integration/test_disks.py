"""Instance disk files: sparse copies, streamed and verified image downloads, growth (moto S3, real files)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from ferry import errors
from hostagent import disks

MiB = 2**20
BUCKET = "ferry-images"


@pytest.fixture
def s3(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def _sparse_file(path, size: int, extents: dict[int, bytes]) -> bytes:
    """Write ``extents`` (offset -> data) into a sparse file of ``size``; return its logical content."""
    with open(path, "wb") as f:
        for offset, data in extents.items():
            f.seek(offset)
            f.write(data)
        f.truncate(size)
    logical = bytearray(size)
    for offset, data in extents.items():
        logical[offset : offset + len(data)] = data
    return bytes(logical)


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_copy_sparse_keeps_holes_and_checksums_the_logical_content(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "out" / "dst"
    content = _sparse_file(src, 32 * MiB, {0: os.urandom(MiB), 9 * MiB: os.urandom(MiB)})

    digest = disks.copy_sparse(src, dst, chunk_size=256 * 1024)

    assert digest == hashlib.sha256(content).hexdigest()
    assert disks.sha256_file(dst) == digest == disks.sha256_file(src)
    assert os.path.getsize(dst) == 32 * MiB
    assert _allocated(dst) <= 4 * MiB
    with open(dst, "rb") as f:
        assert os.lseek(f.fileno(), MiB, os.SEEK_HOLE) == MiB
    assert _leftovers(dst.parent) == ["dst"]


def test_copy_sparse_turns_written_zeros_into_holes(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    content = os.urandom(MiB) + bytes(6 * MiB) + os.urandom(MiB)
    src.write_bytes(content)

    digest = disks.copy_sparse(src, dst, chunk_size=MiB)

    assert digest == hashlib.sha256(content).hexdigest()
    assert dst.read_bytes() == content
    assert _allocated(dst) < _allocated(src) - 4 * MiB


def test_copy_sparse_of_an_all_hole_file_writes_no_data(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _sparse_file(src, 16 * MiB, {})

    digest = disks.copy_sparse(src, dst)

    assert digest == hashlib.sha256(bytes(16 * MiB)).hexdigest()
    assert os.path.getsize(dst) == 16 * MiB
    assert _allocated(dst) == 0


def test_copy_sparse_failure_leaves_no_destination(tmp_path):
    with pytest.raises(errors.DiskCopyFailed):
        disks.copy_sparse(tmp_path / "missing", tmp_path / "out" / "dst")
    assert not (tmp_path / "out" / "dst").exists()


def test_download_streams_in_chunks_and_verifies_the_checksum(s3, tmp_path):
    content = os.urandom(3 * MiB + 5)
    s3.put_object(Bucket=BUCKET, Key="images/big.raw", Body=content)
    chunk_sizes: list[int] = []
    real_get_object = s3.get_object

    def recording_get_object(**kwargs):
        response = real_get_object(**kwargs)
        body = response["Body"]
        real_iter = body.iter_chunks

        def iter_chunks(chunk_size):
            for chunk in real_iter(chunk_size):
                chunk_sizes.append(len(chunk))
                yield chunk

        body.iter_chunks = iter_chunks
        return response

    s3.get_object = recording_get_object
    dest = tmp_path / "images" / "big.raw"

    size = disks.download_image(s3, BUCKET, "images/big.raw", dest, hashlib.sha256(content).hexdigest(), chunk_size=MiB)

    assert size == len(content)
    assert dest.read_bytes() == content
    assert len(chunk_sizes) == 4 and max(chunk_sizes) <= MiB
    assert _leftovers(dest.parent) == ["big.raw"]


def test_download_writes_runs_of_zeros_as_holes(s3, tmp_path):
    content = os.urandom(MiB) + bytes(8 * MiB) + os.urandom(MiB)
    s3.put_object(Bucket=BUCKET, Key="sparse.raw", Body=content)
    dest = tmp_path / "sparse.raw"

    disks.download_image(s3, BUCKET, "sparse.raw", dest, hashlib.sha256(content).hexdigest(), chunk_size=MiB)

    assert dest.read_bytes() == content
    assert _allocated(dest) <= 4 * MiB


def test_download_with_a_wrong_checksum_fails_and_leaves_nothing(s3, tmp_path):
    s3.put_object(Bucket=BUCKET, Key="corrupt.raw", Body=os.urandom(2 * MiB))
    dest = tmp_path / "images" / "corrupt.raw"

    with pytest.raises(errors.ImageDownloadFailed):
        disks.download_image(s3, BUCKET, "corrupt.raw", dest, hashlib.sha256(b"something else").hexdigest())

    assert _leftovers(dest.parent) == []


def test_download_of_a_missing_object_raises_image_download_failed(s3, tmp_path):
    with pytest.raises(errors.ImageDownloadFailed):
        disks.download_image(s3, BUCKET, "nope.raw", tmp_path / "nope.raw", "0" * 64)
    assert _leftovers(tmp_path) == []


def test_grow_extends_sparsely_and_never_shrinks(tmp_path):
    path = tmp_path / "disk"
    path.write_bytes(b"boot sector")

    assert disks.grow(path, 64 * MiB) == 64 * MiB
    assert disks.grow(path, MiB) == 64 * MiB

    assert os.path.getsize(path) == 64 * MiB
    assert _allocated(path) < MiB
    assert path.read_bytes()[:11] == b"boot sector"


def test_create_sparse_makes_an_empty_disk_and_keeps_an_existing_one(tmp_path):
    path = tmp_path / "inst" / "disk.eph0"

    disks.create_sparse(path, 128 * MiB)
    assert os.path.getsize(path) == 128 * MiB
    assert _allocated(path) == 0

    with open(path, "r+b") as f:
        f.write(b"data")
    disks.create_sparse(path, 64 * MiB)
    assert os.path.getsize(path) == 128 * MiB
    assert path.read_bytes()[:4] == b"data"


@pytest.mark.parametrize("grower", ["grow", "create_sparse"])
def test_a_disk_path_that_is_a_symbolic_link_is_never_followed(tmp_path, grower):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not a disk")
    link = tmp_path / "disk"
    link.symlink_to(target)

    with pytest.raises(OSError):
        getattr(disks, grower)(link, 64 * MiB)

    assert target.read_bytes() == b"not a disk"



def test_an_exclusive_write_leaves_a_file_made_meanwhile(tmp_path):
    path = tmp_path / "vol-1"
    path.write_bytes(b"another attempt's")

    with pytest.raises(disks.FileTaken):
        disks.create_sparse(path, 64 * MiB, exclusive=True)

    assert path.read_bytes() == b"another attempt's"
    assert [p.name for p in tmp_path.iterdir()] == ["vol-1"]


def test_an_exclusive_write_whose_link_was_made_though_the_server_answered_eexist_succeeds(tmp_path, monkeypatch):
    # GIVEN an NFSv3 server that made the link but answers the client's retransmitted LINK with EEXIST
    path = tmp_path / "vol-1"
    link = os.link

    def retransmitted(src, dst, *args, **kwargs):
        link(src, dst, *args, **kwargs)
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))

    monkeypatch.setattr(os, "link", retransmitted)

    # WHEN a volume file is made there
    disks.create_sparse(path, 64 * MiB, exclusive=True)

    # THEN the file at the name, being the one written, is taken as made
    assert os.path.getsize(path) == 64 * MiB
    assert [p.name for p in tmp_path.iterdir()] == ["vol-1"]


def test_an_exclusive_write_records_the_files_identity_before_it_takes_its_name(tmp_path):
    path = tmp_path / "vol-1"
    recorded: list[tuple[tuple[int, int], bool]] = []

    disks.create_sparse(path, 64 * MiB, exclusive=True,
                        record_identity=lambda identity: recorded.append((identity, path.exists())))

    assert recorded == [(disks.file_identity(path), False)]

def _image(s3, key: str, content: bytes) -> dict[str, str]:
    s3.put_object(Bucket=BUCKET, Key=key, Body=content)
    return {"id": key, "bucket": BUCKET, "key": key, "sha256": hashlib.sha256(content).hexdigest()}


def test_root_disk_holds_the_image_and_has_the_flavor_size(s3, tmp_path):
    content = os.urandom(MiB + 3)
    image = _image(s3, "cirros.raw", content)
    dest = tmp_path / "inst" / "disk"

    size = disks.create_root_disk(s3, image, 16 * MiB, dest, cache_dir=tmp_path / "_base")

    assert size == os.path.getsize(dest) == 16 * MiB
    with open(dest, "rb") as f:
        assert f.read(len(content)) == content
    assert disks.sha256_file(tmp_path / "_base" / image["sha256"]) == image["sha256"]


def test_root_disk_of_size_zero_keeps_the_image_size(s3, tmp_path):
    content = os.urandom(MiB)
    image = _image(s3, "small.raw", content)

    size = disks.create_root_disk(s3, image, 0, tmp_path / "disk")

    assert size == MiB
    assert (tmp_path / "disk").read_bytes() == content


def test_image_larger_than_the_root_disk_raises_spawn_failed_before_downloading(s3, tmp_path):
    image = _image(s3, "large.raw", os.urandom(2 * MiB))

    with pytest.raises(errors.SpawnFailed):
        disks.create_root_disk(s3, image, MiB, tmp_path / "disk", cache_dir=tmp_path / "_base")

    assert not (tmp_path / "disk").exists()
    assert not (tmp_path / "_base").exists()


def test_cached_image_serves_later_root_disks_without_s3(s3, tmp_path):
    content = os.urandom(MiB)
    image = _image(s3, "cached.raw", content)
    disks.create_root_disk(s3, image, 4 * MiB, tmp_path / "a" / "disk", cache_dir=tmp_path / "_base")
    s3.delete_object(Bucket=BUCKET, Key="cached.raw")
    s3.put_object(Bucket=BUCKET, Key="cached.raw", Body=b"x")  # a head still answers; the content must not be used

    disks.create_root_disk(s3, {**image}, 4 * MiB, tmp_path / "b" / "disk", cache_dir=tmp_path / "_base")

    with open(tmp_path / "b" / "disk", "rb") as f:
        assert f.read(MiB) == content


def test_a_rotten_cache_entry_is_fetched_again(s3, tmp_path):
    content = os.urandom(MiB)
    image = _image(s3, "rot.raw", content)
    cache = tmp_path / "_base"
    cache.mkdir()
    (cache / image["sha256"]).write_bytes(b"bit rot")

    disks.create_root_disk(s3, image, 2 * MiB, tmp_path / "disk", cache_dir=cache)

    with open(tmp_path / "disk", "rb") as f:
        assert f.read(MiB) == content
    assert disks.sha256_file(cache / image["sha256"]) == image["sha256"]


@pytest.mark.parametrize("name", ["../victim", "absolute"])
def test_an_image_digest_that_is_not_one_is_refused_before_it_names_a_file(s3, tmp_path, name):
    # GIVEN a file beside the image cache, and an image whose "digest" names it
    victim = tmp_path / "victim"
    victim.write_bytes(b"not an image")
    os.utime(victim, (1_000_000, 1_000_000))
    image = {**_image(s3, "evil.raw", os.urandom(MiB)), "sha256": str(victim) if name == "absolute" else name}
    cache, dest = tmp_path / "_base", tmp_path / "inst" / "disk"
    before = sorted(tmp_path.iterdir())

    # WHEN a root disk is made from it THEN it is refused, and nothing outside the cache is touched
    with pytest.raises(errors.InvalidOperation):
        disks.create_root_disk(s3, image, 2 * MiB, dest, cache_dir=cache)

    assert victim.read_bytes() == b"not an image"
    assert victim.stat().st_mtime == 1_000_000
    assert sorted(tmp_path.iterdir()) == before


def test_a_grown_disk_is_synced(tmp_path, monkeypatch):
    path = tmp_path / "disk"
    path.write_bytes(b"boot sector")
    synced: list[int] = []  # the inode of each file synced
    real_fsync = os.fsync

    def recording(fd):  # type: ignore[no-untyped-def]
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(disks.os, "fsync", recording)

    disks.grow(path, 64 * MiB)

    assert path.stat().st_ino in synced


def test_a_directory_made_is_synced_in_its_parent(tmp_path, monkeypatch):
    synced: list[tuple[Path, list[str]]] = []
    monkeypatch.setattr(disks, "sync_dir", lambda d: synced.append((Path(d), sorted(os.listdir(d)))))

    disks.make_dir(tmp_path / "instance")

    assert synced == [(tmp_path, ["instance"])]


def test_a_verified_copy_takes_its_name_only_when_its_digest_is_the_expected_one(tmp_path):
    source = tmp_path / "source"
    source.write_bytes(os.urandom(MiB))
    digest = disks.sha256_file(source)

    assert disks.copy_sparse_verified(source, tmp_path / "other", "0" * 64) is False
    assert list(tmp_path.iterdir()) == [source]  # neither the copy nor its temporary file
    assert disks.copy_sparse_verified(source, tmp_path / "copy", digest) is True
    assert disks.sha256_file(tmp_path / "copy") == digest


def test_remove_instance_dir_deletes_disks_and_accepts_a_missing_directory(tmp_path):
    disks.create_sparse(disks.root_disk_path(tmp_path, "i-1"), MiB)
    disks.create_sparse(disks.swap_disk_path(tmp_path, "i-1"), MiB)

    disks.remove_instance_dir(tmp_path, "i-1")
    disks.remove_instance_dir(tmp_path, "i-1")

    assert not disks.instance_dir(tmp_path, "i-1").exists()


# --- volume files and temporary files ------------------------------------------------------------


def test_inside_is_strictly_within_a_directory_once_resolved(tmp_path):
    volumes = tmp_path / "volumes"
    volumes.mkdir()
    (volumes / "loop").symlink_to(volumes / "loop")

    assert disks.inside(volumes / "vol-1", [volumes])
    assert not disks.inside(volumes, [volumes])  # the directory itself is no file in it
    assert not disks.inside(Path(f"{volumes}/sub/../../vol-1"), [volumes])
    assert not disks.inside(volumes / "loop" / "vol-1", [volumes])  # a loop of links resolves nowhere
    assert not disks.inside("volumes/vol-1", [volumes])  # relative
    assert not disks.inside(f"{volumes}/vol\0-1", [volumes])  # a NUL byte


def test_a_volume_file_is_made_where_its_directory_resolves_and_only_within_the_volumes_directories(tmp_path):
    volumes, outside = tmp_path / "volumes", tmp_path / "outside"
    (volumes / "real").mkdir(parents=True)
    outside.mkdir()
    (volumes / "linked").symlink_to(volumes / "real")
    (outside / "into-volumes").symlink_to(volumes / "vol-3")
    (volumes / "out").symlink_to(outside / "vol-4")

    assert disks.volume_target(volumes / "vol-1", [volumes]) == volumes / "vol-1"
    assert disks.volume_target(volumes / "linked" / "vol-2", [volumes]) == volumes / "real" / "vol-2"
    assert disks.volume_target(outside / "into-volumes", [volumes]) is None  # the link is outside
    assert disks.volume_target(volumes / "out", [volumes]) is None  # it leads outside
    assert disks.volume_target(Path(f"{volumes}/real/sub/.."), [volumes]) is None
    assert disks.volume_target(tmp_path / "vol-5", [volumes]) is None


def test_a_write_makes_a_new_temporary_file_when_a_sweep_removed_its_first_before_it_was_held(tmp_path, monkeypatch):
    made: list[str] = []
    sweeps: list[list[Path]] = []
    real_mkstemp, real_flock = tempfile.mkstemp, fcntl.flock

    def mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real_mkstemp(*args, **kwargs)
        made.append(name)
        return fd, name

    def flock(fd: int, operation: int) -> None:
        if not sweeps:  # a sweep between the first file's creation and its lock (its own lock goes through)
            sweeps.append([])
            sweeps[0] = disks.remove_abandoned_parts(tmp_path)
        real_flock(fd, operation)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(fcntl, "flock", flock)

    fd, part = disks._held_part(tmp_path / "disk")
    try:
        assert sweeps == [[Path(made[0])]]
        assert part == Path(made[1]) and part.is_file()
        with open(part, "rb+") as other, pytest.raises(BlockingIOError):
            real_flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # held
    finally:
        os.close(fd)


def test_a_sweep_takes_only_the_temporary_files_of_writes_by_their_shape(tmp_path):
    parts = [".disk.abc123_x.part", ".vol.1.abcdefgh.part"]
    others = [".part", "..part", ".disk.part", ".disk.ABCDEFGH.part", "disk.abcdefgh.part", ".disk.abc.parts",
              ".disk.abcdefgh.part\n"]
    for name in parts + others:
        (tmp_path / name).write_bytes(b"x")

    assert disks.remove_abandoned_parts(tmp_path, "vol") == []  # .vol.1.<random>.part is vol.1's
    assert sorted(disks.remove_abandoned_parts(tmp_path)) == sorted(tmp_path / name for name in parts)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)


def test_a_sweep_leaves_a_file_that_took_the_name_of_the_one_it_held(tmp_path, monkeypatch):
    part = tmp_path / ".disk.abcdefgh.part"
    part.write_bytes(b"abandoned")
    real_flock = fcntl.flock

    def flock(fd: int, operation: int) -> None:
        real_flock(fd, operation)
        # meanwhile the held file goes (renamed into place), and another file takes its name
        part.rename(tmp_path / "disk")
        part.write_bytes(b"another")

    monkeypatch.setattr(fcntl, "flock", flock)

    assert disks.remove_abandoned_parts(tmp_path) == []
    assert part.read_bytes() == b"another"


@pytest.mark.parametrize("no_locks", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_where_there_are_no_locks_an_agent_starting_still_removes_its_own_leftovers_but_not_shared_ones(
        tmp_path, monkeypatch, no_locks):
    own = tmp_path / "instances" / "a1" / ".disk.abcdefgh.part"
    shared = tmp_path / "volumes" / ".vol-1.abcdefgh.part"
    for path in (own, shared):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")

    def flock(fd: int, operation: int) -> None:
        raise OSError(no_locks, os.strerror(no_locks))

    monkeypatch.setattr(fcntl, "flock", flock)

    assert disks.remove_partial_files(tmp_path / "instances") == [own]  # only this host writes there
    assert disks.remove_abandoned_parts(tmp_path / "volumes") == []  # another host may be writing it
    assert shared.exists()


@pytest.mark.parametrize("stream", ["copy_sparse", "copy_to_host", "download_image", "upload_disk", "download_disk",
                                    "file_digest"])
def test_a_stream_whose_operation_is_abandoned_stops_and_leaves_nothing_part_written(tmp_path, s3, monkeypatch, stream):
    # GIVEN a disk with 7 MiB of data, in a file and in S3
    src, out = tmp_path / "src", tmp_path / "out"
    out.mkdir()
    content = _sparse_file(src, 16 * MiB, {0: os.urandom(6 * MiB), 9 * MiB: os.urandom(MiB)})
    s3.put_object(Bucket=BUCKET, Key="image", Body=content)
    sent = disks.upload_disk(s3, src, BUCKET, "moves/m1", "root")
    streams = {
        "copy_sparse": lambda: disks.copy_sparse(src, out / "disk", chunk_size=MiB),
        "copy_to_host": lambda: disks.copy_to_host(src, out / "disk"),
        "download_image": lambda: disks.download_image(s3, BUCKET, "image", out / "disk",
                                                       hashlib.sha256(content).hexdigest(), MiB),
        "upload_disk": lambda: disks.upload_disk(s3, src, BUCKET, "moves/m2", "root", chunk_size=MiB,
                                                 part_size=5 * MiB),
        "download_disk": lambda: disks.download_disk(s3, BUCKET, "moves/m1", "root", out / "disk", sent.sha256,
                                                     chunk_size=MiB),
        # the digest a same-host resize reads of each disk it keeps
        "file_digest": lambda: disks.file_digest(src, chunk_size=MiB),
    }
    # ... whose operation's workflow stops waiting once the stream moved its first chunk (6 MiB
    # for the upload: its first part is sent)
    abandoned = threading.Event()
    moved = disks._Pace.moved
    first = 6 * MiB if stream == "upload_disk" else 1
    went_through = [0]

    def then_abandoned(pace: disks._Pace, count: int) -> None:
        moved(pace, count)
        went_through[0] += count
        if went_through[0] >= first:
            abandoned.set()

    monkeypatch.setattr(disks._Pace, "moved", then_abandoned)

    # WHEN it runs
    with disks.abandoned_when(abandoned), pytest.raises(errors.OperationAbandoned):
        streams[stream]()

    # THEN it stopped, and nothing it started writing is left
    assert _leftovers(out) == []
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="moves/m2/").get("Contents", [])] == []
    assert not s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_a_digest_is_not_held_to_a_drills_throttle_as_the_copies_it_checks_are(tmp_path, monkeypatch):
    # GIVEN a drill's throttle of 1 MiB/s, and a disk with 4 MiB of data
    monkeypatch.setenv(disks.THROTTLE_ENV, "1")
    src = tmp_path / "src"
    content = _sparse_file(src, 16 * MiB, {0: os.urandom(4 * MiB)})
    waits: list[float] = []
    monkeypatch.setattr(disks.time, "sleep", waits.append)

    # WHEN its digest is read, and when it is copied
    digest = disks.file_digest(src, disks.SHA256, chunk_size=MiB)
    unthrottled = list(waits)
    disks.copy_sparse(src, tmp_path / "dst", chunk_size=MiB)

    # THEN only the copy waited to keep to the throttle
    assert digest == hashlib.sha256(content).hexdigest()
    assert unthrottled == [] and waits


def test_a_stream_runs_to_its_end_once_the_operation_that_started_it_is_over(tmp_path):
    # GIVEN an operation that ended, abandoned, after the copy it started was made
    src = tmp_path / "src"
    content = _sparse_file(src, 8 * MiB, {0: os.urandom(MiB)})
    abandoned = threading.Event()
    with disks.abandoned_when(abandoned):
        pass
    abandoned.set()

    # WHEN a stream starts outside it
    digest = disks.copy_sparse(src, tmp_path / "dst")

    # THEN it is not stopped
    assert digest == hashlib.sha256(content).hexdigest()
