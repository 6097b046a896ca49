"""Disk transfers between hosts through S3: data extents plus a manifest, streamed and verified (moto S3)."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import boto3
import pytest
from blake3 import blake3
from botocore.exceptions import ClientError
from digest_helpers import MOVES, block_digest, block_digest_of
from moto import mock_aws

from ferry import errors
from hostagent import disks

MiB = 2**20
GiB = 2**30
BUCKET = "ferry-transfers"
PREFIX = "moves/m-1"


@pytest.fixture
def s3(aws_test_credentials):
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


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


def _object(s3, key: str) -> bytes:
    return s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _manifest(s3, kind: str = "root") -> dict:
    return json.loads(_object(s3, disks.manifest_key(PREFIX, kind)))


def _count_calls(s3, operation: str) -> list[int]:
    """Record the body size of every ``operation`` call the client makes."""
    sizes: list[int] = []

    def record(params, **_kwargs):
        body = params.get("Body", b"")
        sizes.append(len(body) if isinstance(body, bytes) else len(body.read()) if hasattr(body, "read") else 0)
        if hasattr(body, "seek"):
            body.seek(0)

    s3.meta.events.register(f"before-parameter-build.s3.{operation}", record)
    return sizes


def test_a_sparse_disk_sends_only_its_data_and_comes_back_identical(s3, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dest" / "disk"
    data = {0: os.urandom(64 * 1024), 300 * MiB: os.urandom(MiB), GiB - 4096: os.urandom(4096)}
    content = _sparse_file(src, GiB, data)
    expected = block_digest_of(content)

    sent = disks.upload_disk(s3, src, BUCKET, PREFIX, "root")

    assert (sent.size, sent.sha256) == (GiB, expected)
    assert sent.data_bytes == sum(len(d) for d in data.values())
    stored = _object(s3, disks.transfer_key(PREFIX, "root"))
    assert len(stored) == sent.data_bytes
    manifest = _manifest(s3)
    assert manifest == {
        "size": GiB,
        "extents": [[offset, len(chunk)] for offset, chunk in data.items()],
        "sha256": expected,
        "digest": "sha256-blocks",
        "chunk_size": disks.CHUNK_SIZE,
    }

    received = disks.download_disk(s3, BUCKET, PREFIX, "root", dst, expected_sha256=expected, expected_size=GiB)

    assert received.sha256 == expected and received.size == GiB
    assert os.path.getsize(dst) == GiB
    assert disks.file_digest(dst) == expected == block_digest(dst)
    assert disks.sparse_sha256(dst) == hashlib.sha256(content).hexdigest()
    assert os.stat(dst).st_blocks * 512 < 4 * MiB
    assert sorted(p.name for p in dst.parent.iterdir()) == ["disk"]


def test_written_zeros_are_not_sent(s3, tmp_path):
    src = tmp_path / "src"
    content = os.urandom(MiB) + bytes(8 * MiB) + os.urandom(MiB)
    src.write_bytes(content)

    sent = disks.upload_disk(s3, src, BUCKET, PREFIX, "root", chunk_size=MiB)

    assert sent.sha256 == block_digest_of(content)
    assert _manifest(s3)["extents"] == [[0, MiB], [9 * MiB, MiB]]
    assert len(_object(s3, disks.transfer_key(PREFIX, "root"))) == 2 * MiB


def test_an_all_hole_disk_sends_no_data(s3, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _sparse_file(src, 64 * MiB, {})

    sent = disks.upload_disk(s3, src, BUCKET, PREFIX, "ephemeral")
    disks.download_disk(s3, BUCKET, PREFIX, "ephemeral", dst, expected_sha256=sent.sha256)

    assert sent.data_bytes == 0
    assert _manifest(s3, "ephemeral")["extents"] == []
    assert sent.sha256 == block_digest_of(bytes(64 * MiB))
    assert os.path.getsize(dst) == 64 * MiB and os.stat(dst).st_blocks == 0


def test_a_large_disk_is_sent_in_parts(s3, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    content = _sparse_file(src, 64 * MiB, {MiB: os.urandom(20 * MiB)})
    parts = _count_calls(s3, "UploadPart")

    sent = disks.upload_disk(s3, src, BUCKET, PREFIX, "root", part_size=5 * MiB)
    disks.download_disk(s3, BUCKET, PREFIX, "root", dst, expected_sha256=sent.sha256, expected_size=64 * MiB)

    assert len(parts) == 4
    assert max(parts) <= 5 * MiB and sum(parts) == 20 * MiB
    assert dst.read_bytes() == content


def test_the_part_size_keeps_every_upload_within_s3s_part_count():
    # S3 refuses a multipart upload's 10,001st part; the transfer manager cannot size a stream.
    assert {disks.transfer_part_size(size) for size in (0, MiB, 20 * GiB, 70 * GiB)} == {8 * MiB}
    for size in (200 * GiB, 2**40, 5 * 2**40):  # 5 TiB: S3's largest object
        part = disks.transfer_part_size(size)
        assert part % MiB == 0 and 8 * MiB < part <= 5 * GiB
        assert -(-size // part) <= 10_000
    assert disks.transfer_part_size(100 * 2**40) == 5 * GiB  # S3's largest part
    assert disks.transfer_part_size(GiB, minimum=5 * MiB) == 5 * MiB


def test_a_disk_too_large_for_8_mib_parts_is_sent_in_larger_ones(s3, tmp_path):
    # GIVEN a 200 GiB disk: filled, it would take 25,600 parts of 8 MiB
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.write(os.urandom(30 * MiB))
        f.truncate(200 * GiB)
    parts = _count_calls(s3, "UploadPart")

    # WHEN it is sent
    sent = disks.upload_disk(s3, src, BUCKET, PREFIX, "root")

    # THEN its parts are as large as its logical size needs (23 MiB), however little data it holds
    assert parts == [23 * MiB, 7 * MiB] == [disks.transfer_part_size(200 * GiB), 7 * MiB]
    assert sent.data_bytes == 30 * MiB
    assert len(_object(s3, disks.transfer_key(PREFIX, "root"))) == 30 * MiB



@pytest.fixture
def transfer_configs(monkeypatch):
    """The TransferConfig of every upload made through ``disks``' transfer manager."""
    configs = []
    upload = disks.aws.upload_fileobj

    def recording(*args, **kwargs):
        configs.append(kwargs["Config"])
        upload(*args, **kwargs)

    monkeypatch.setattr(disks.aws, "upload_fileobj", recording)
    return configs


def test_a_large_disks_upload_keeps_its_buffered_parts_within_the_memory_bound(s3, tmp_path, transfer_configs):
    # GIVEN a 2 TiB disk: its parts are hundreds of MiB, and a stream's parts are buffered whole
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.write(os.urandom(MiB))
        f.truncate(2 * 2**40)

    # WHEN it is sent
    disks.upload_disk(s3, src, BUCKET, PREFIX, "root")

    # THEN the transfer manager buffers two of them (not its default ten), and sends no more at once
    (config,) = transfer_configs
    part = disks.transfer_part_size(2 * 2**40)
    assert config.multipart_chunksize == part == 234 * MiB
    assert config.max_in_memory_upload_chunks * part == 2 * part
    assert config.max_request_concurrency <= config.max_in_memory_upload_chunks


def test_a_small_disks_upload_buffers_as_many_parts_as_the_memory_bound_holds(s3, tmp_path, transfer_configs):
    src = tmp_path / "src"
    _sparse_file(src, 16 * MiB, {0: os.urandom(MiB)})

    disks.upload_disk(s3, src, BUCKET, PREFIX, "root")

    (config,) = transfer_configs
    assert (config.max_in_memory_upload_chunks, config.multipart_chunksize) == (10, 8 * MiB)  # 80 MiB, as ever
    assert config.max_request_concurrency == disks.TRANSFER_CONCURRENCY

def test_sending_again_replaces_the_transfer(s3, tmp_path):
    src = tmp_path / "src"
    _sparse_file(src, 8 * MiB, {0: os.urandom(MiB)})
    first = disks.upload_disk(s3, src, BUCKET, PREFIX, "root")

    again = disks.upload_disk(s3, src, BUCKET, PREFIX, "root")

    assert again == first
    assert len(_object(s3, disks.transfer_key(PREFIX, "root"))) == MiB


def test_corrupt_data_fails_and_leaves_no_file(s3, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dest" / "disk"
    _sparse_file(src, 16 * MiB, {4 * MiB: os.urandom(MiB)})
    sent = disks.upload_disk(s3, src, BUCKET, PREFIX, "root")
    stored = bytearray(_object(s3, disks.transfer_key(PREFIX, "root")))
    stored[100] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=disks.transfer_key(PREFIX, "root"), Body=bytes(stored))

    with pytest.raises(errors.DiskCopyFailed, match="sha256-blocks"):
        disks.download_disk(s3, BUCKET, PREFIX, "root", dst, expected_sha256=sent.sha256)

    assert not dst.exists()
    assert list(dst.parent.iterdir()) == []


@pytest.mark.parametrize("change", ["truncated", "longer"])
def test_data_that_does_not_match_the_extents_fails(s3, tmp_path, change):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _sparse_file(src, 16 * MiB, {0: os.urandom(MiB)})
    disks.upload_disk(s3, src, BUCKET, PREFIX, "root")
    stored = _object(s3, disks.transfer_key(PREFIX, "root"))
    stored = stored[:-10] if change == "truncated" else stored + b"more"
    s3.put_object(Bucket=BUCKET, Key=disks.transfer_key(PREFIX, "root"), Body=stored)

    with pytest.raises(errors.DiskCopyFailed):
        disks.download_disk(s3, BUCKET, PREFIX, "root", dst)

    assert not dst.exists()


def test_a_transfer_of_another_disk_is_refused_before_it_is_fetched(s3, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _sparse_file(src, 16 * MiB, {0: os.urandom(MiB)})
    sent = disks.upload_disk(s3, src, BUCKET, PREFIX, "root")

    with pytest.raises(errors.DiskCopyFailed, match="another disk"):
        disks.download_disk(s3, BUCKET, PREFIX, "root", dst, expected_sha256="0" * 64)
    with pytest.raises(errors.DiskCopyFailed, match="expected"):
        disks.download_disk(s3, BUCKET, PREFIX, "root", dst, expected_sha256=sent.sha256, expected_size=MiB)

    assert not dst.exists()


@pytest.mark.parametrize(
    "manifest",
    [
        b"not json",
        json.dumps({"size": 10}).encode(),
        json.dumps({"size": MiB, "extents": [[0, 10], [5, 10]], "sha256": "0" * 64, "chunk_size": 1}).encode(),
        json.dumps({"size": MiB, "extents": [[MiB - 1, 10]], "sha256": "0" * 64, "chunk_size": 1}).encode(),
        json.dumps({"size": MiB, "extents": [], "sha256": "0" * 64, "digest": "md5", "chunk_size": 1}).encode(),
    ],
    ids=["not-json", "incomplete", "overlapping", "beyond-the-end", "unknown-digest"],
)
def test_a_bad_manifest_fails(s3, tmp_path, manifest):
    s3.put_object(Bucket=BUCKET, Key=disks.transfer_key(PREFIX, "root"), Body=b"x" * 20)
    s3.put_object(Bucket=BUCKET, Key=disks.manifest_key(PREFIX, "root"), Body=manifest)

    with pytest.raises(errors.DiskCopyFailed):
        disks.download_disk(s3, BUCKET, PREFIX, "root", tmp_path / "dst")

    assert not (tmp_path / "dst").exists()


def test_a_missing_transfer_fails(s3, tmp_path):
    with pytest.raises(errors.DiskCopyFailed):
        disks.download_disk(s3, BUCKET, PREFIX, "root", tmp_path / "dst")


def test_an_unreadable_source_fails_with_disk_copy_failed(s3, tmp_path):
    with pytest.raises(errors.DiskCopyFailed):
        disks.upload_disk(s3, tmp_path / "missing", BUCKET, PREFIX, "root")


def test_an_upload_to_a_missing_bucket_fails_with_disk_copy_failed(s3, tmp_path):
    src = tmp_path / "src"
    _sparse_file(src, MiB, {0: b"data"})

    with pytest.raises(errors.DiskCopyFailed):
        disks.upload_disk(s3, src, "no-such-bucket", PREFIX, "root")


def test_deleting_a_transfer_removes_only_its_prefix(s3, tmp_path):
    src = tmp_path / "src"
    _sparse_file(src, MiB, {0: b"data"})
    disks.upload_disk(s3, src, BUCKET, PREFIX, "root")
    disks.upload_disk(s3, src, BUCKET, PREFIX, "ephemeral")
    disks.upload_disk(s3, src, BUCKET, PREFIX + "0", "root")

    assert disks.delete_transfer(s3, BUCKET, PREFIX) == 4
    assert disks.delete_transfer(s3, BUCKET, PREFIX) == 0

    left = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert sorted(left) == [f"{PREFIX}0/root", f"{PREFIX}0/root.manifest.json"]


def test_deleting_a_transfer_that_s3_answers_partly_failed_raises(s3, tmp_path, monkeypatch):
    # GIVEN S3 answers a DeleteObjects with a per-object error, as it does instead of raising
    src = tmp_path / "src"
    _sparse_file(src, MiB, {0: b"data"})
    disks.upload_disk(s3, src, BUCKET, PREFIX, "root")
    monkeypatch.setattr(s3, "delete_objects", lambda **kwargs: {"Errors": [
        {"Key": f"{PREFIX}/root", "Code": "SlowDown", "Message": "Please reduce your request rate."}]})

    # THEN the deletion raises, so that no caller goes on as if the objects were gone
    with pytest.raises(ClientError, match="SlowDown"):
        disks.delete_transfer(s3, BUCKET, PREFIX)


def test_deleting_a_transfer_aborts_the_upload_a_killed_sender_left_open(s3):
    """Open uploads never show among the objects, yet S3 keeps their parts until they are aborted."""
    for key in (f"{PREFIX}/root", f"{PREFIX}0/root"):
        upload = s3.create_multipart_upload(Bucket=BUCKET, Key=key)
        s3.upload_part(Bucket=BUCKET, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 5 * MiB)

    assert disks.delete_transfer(s3, BUCKET, PREFIX) == 0

    left = s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    assert [u["Key"] for u in left] == [f"{PREFIX}0/root"]


def test_sparse_sha256_reads_like_the_whole_file(tmp_path):
    path = tmp_path / "disk"
    content = _sparse_file(path, 40 * MiB, {3 * MiB: os.urandom(12345), 39 * MiB: os.urandom(MiB)})

    assert disks.sparse_sha256(path, chunk_size=MiB) == disks.sha256_file(path) == hashlib.sha256(content).hexdigest()


def test_the_kept_directory_sits_beside_the_live_one(tmp_path):
    live = disks.instance_dir(tmp_path, "abc")
    kept = disks.resize_dir(tmp_path, "abc")

    assert kept.parent == live.parent and kept.name == "abc_resize"


# --- the block digest ------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["sha256-blocks", "blake3-blocks"])
@pytest.mark.parametrize("size", [0, 1, 4 * MiB - 1, 4 * MiB, 4 * MiB + 1, 13 * MiB + 12345])
def test_the_block_digest_is_the_hash_of_the_4_mib_block_digests_whatever_the_feeding(size, algorithm):
    content = bytearray(size)
    for offset in range(0, size, 3 * MiB + 7):  # some data, some zeros, across block edges
        content[offset:offset + 100_000] = os.urandom(len(content[offset:offset + 100_000]))
    content = bytes(content)
    expected = block_digest_of(content, algorithm)

    by_bytes, by_holes = disks.DIGESTS[algorithm](), disks.DIGESTS[algorithm]()
    for start in range(0, size, 777_777):
        by_bytes.update(content[start:start + 777_777])
    position = 0
    for start in range(0, size, 100_003):  # zero runs as holes, data as bytes, at odd offsets
        piece = content[start:start + 100_003]
        if piece.count(0) == len(piece):
            by_holes.update_zeros(len(piece))
        else:
            by_holes.update(piece)
        position = start + len(piece)
    assert position == size

    assert by_bytes.hexdigest() == by_holes.hexdigest() == expected
    assert expected not in (hashlib.sha256(content).hexdigest(), blake3(content).hexdigest()) or size == 0
    assert by_bytes.name == algorithm


def test_the_two_block_digests_differ_and_moves_use_blake3():
    content = os.urandom(5 * MiB)

    assert block_digest_of(content, "sha256-blocks") != block_digest_of(content, "blake3-blocks")
    assert disks.MOVE_DIGEST == MOVES == "blake3-blocks"


@pytest.mark.parametrize("algorithm", ["sha256-blocks", "blake3-blocks"])
def test_a_block_digest_copy_goes_on_alone(algorithm):
    first = disks.DIGESTS[algorithm]()
    first.update(os.urandom(5 * MiB))
    before = first.hexdigest()
    grown = first.copy()
    grown.update_zeros(9 * MiB + 3)

    assert first.hexdigest() == before
    assert grown.hexdigest() != before
    assert disks.grown_digest(first, 5 * MiB, 14 * MiB + 3) == grown.hexdigest()


def test_a_sparse_disk_and_its_dense_copy_have_the_same_digest(tmp_path):
    sparse, dense = tmp_path / "sparse", tmp_path / "dense"
    content = _sparse_file(sparse, 64 * MiB + 5, {MiB: os.urandom(3 * MiB), 40 * MiB: os.urandom(10)})
    dense.write_bytes(content)

    assert disks.file_digest(sparse) == disks.file_digest(dense) == block_digest(dense) == block_digest_of(content)
    assert disks.file_digest(sparse, disks.SHA256) == hashlib.sha256(content).hexdigest()


def test_a_manifest_without_a_digest_name_is_a_plain_sha256_one(s3, tmp_path):
    """What an agent that predates block digests sends is still received and verified."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    content = _sparse_file(src, 16 * MiB, {2 * MiB: os.urandom(MiB)})
    sent = disks.upload_disk(s3, src, BUCKET, PREFIX, "root", algorithm=disks.SHA256)
    manifest = _manifest(s3)
    del manifest["digest"]
    s3.put_object(Bucket=BUCKET, Key=disks.manifest_key(PREFIX, "root"), Body=json.dumps(manifest).encode())

    received = disks.download_disk(s3, BUCKET, PREFIX, "root", dst, expected_sha256=sent.sha256)

    assert received.sha256 == sent.sha256 == hashlib.sha256(content).hexdigest()
    assert received.digest == disks.SHA256
    assert dst.read_bytes() == content


# --- direct copies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel_copy", ["offered", "refused"])
@pytest.mark.parametrize("workers", [1, 3])
def test_a_direct_copy_keeps_the_content_and_the_holes_and_records_its_block_digests(
        tmp_path, monkeypatch, workers, kernel_copy):
    """The kernel copies the data ranges where it can; where it refuses, the blocks are written from user space.

    The copy's digest is the move digest (BLAKE3 block digests) unless asked for another.
    """
    ranges = []
    copy_file_range = os.copy_file_range

    def kernel(src_fd, dst_fd, count, offset_src=None, offset_dst=None):
        ranges.append((offset_src, count))
        if kernel_copy == "refused":
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return copy_file_range(src_fd, dst_fd, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", kernel)
    src, dst = tmp_path / "src", tmp_path / "dest" / "disk"
    dst.parent.mkdir()
    size = 64 * MiB + 12345  # a shorter last block
    data = {0: os.urandom(5 * MiB), 20 * MiB: bytes(4 * MiB), 40 * MiB + 7: os.urandom(100), size - 10: b"end" * 3}
    content = _sparse_file(src, size, data)

    copied = disks.copy_to_host(src, dst, workers=workers)

    assert dst.read_bytes() == content
    assert (copied.size, copied.sha256, copied.digest) == (size, block_digest_of(content, MOVES), MOVES)
    assert copied.data_bytes == 2 * 4 * MiB + 4 * MiB + 12345, "written zeros and holes are not written"
    assert os.stat(dst).st_blocks * 512 <= copied.data_bytes + 4 * MiB
    sums = (tmp_path / "dest" / "disk.blocks").read_bytes()
    blocks = [content[i:i + 4 * MiB] for i in range(0, size, 4 * MiB)]
    assert sums == b"".join(blake3(b).digest() for b in blocks)
    assert sorted(p.name for p in dst.parent.iterdir()) == ["disk", "disk.blocks"]

    if kernel_copy == "offered":
        assert sorted(ranges) == [(0, 4 * MiB), (4 * MiB, 4 * MiB), (40 * MiB, 4 * MiB), (64 * MiB, 12345)]
    else:
        assert len(ranges) == 1, "after one refusal the copy stops asking the kernel"

    received = disks.received_digest(dst, copied.sha256, size, MOVES)
    assert received.hexdigest() == copied.sha256
    received.update_zeros(MiB)
    assert received.hexdigest() == block_digest_of(content + bytes(MiB), MOVES)


def test_a_direct_copy_by_sha256_blocks_is_received_as_such_and_not_as_blake3(tmp_path):
    """What an agent older than BLAKE3 block digests copied is checked by SHA-256; the names are not interchangeable."""
    src, dst = tmp_path / "src", tmp_path / "dest" / "disk"
    content = _sparse_file(src, 9 * MiB + 3, {MiB: os.urandom(2 * MiB), 9 * MiB: b"end"})

    copied = disks.copy_to_host(src, dst, algorithm="sha256-blocks")

    assert copied.sha256 == block_digest_of(content, "sha256-blocks")
    assert disks.received_digest(dst, copied.sha256, copied.size, "sha256-blocks").hexdigest() == copied.sha256
    with pytest.raises(errors.DiskCopyFailed, match="does not match"):
        disks.received_digest(dst, copied.sha256, copied.size, MOVES)
    with pytest.raises(errors.DiskCopyFailed, match="Unknown disk digest 'md5-blocks'"):
        disks.received_digest(dst, copied.sha256, copied.size, "md5-blocks")


def test_a_direct_copy_grown_by_a_hole_is_still_received_and_one_grown_with_data_is_not(tmp_path):
    """A finish interrupted after growing the disk (linked into the instance) receives the same copy again."""
    src, dst = tmp_path / "src", tmp_path / "dest" / "disk"
    content = _sparse_file(src, 9 * MiB + 3, {MiB: os.urandom(2 * MiB), 9 * MiB: b"end"})
    copied = disks.copy_to_host(src, dst)

    os.truncate(dst, 16 * MiB)

    assert disks.received_digest(dst, copied.sha256, copied.size, MOVES).hexdigest() == block_digest_of(content, MOVES)
    with open(dst, "r+b") as f:
        f.seek(12 * MiB)
        f.write(b"not a hole")
    with pytest.raises(errors.DiskCopyFailed, match="16777216 bytes"):
        disks.received_digest(dst, copied.sha256, copied.size, MOVES)


def test_a_direct_copy_that_the_kernel_fails_for_another_reason_fails_and_leaves_nothing(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dest" / "disk"
    dst.parent.mkdir()
    _sparse_file(src, 12 * MiB, {0: os.urandom(9 * MiB)})

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", full)
    with pytest.raises(errors.DiskCopyFailed, match="No space left"):
        disks.copy_to_host(src, dst)

    assert list(dst.parent.iterdir()) == []


@pytest.mark.parametrize("spoil", ["digest", "size", "blocks-missing", "last-block"])
def test_a_direct_copy_that_is_not_what_was_reported_is_refused(tmp_path, spoil):
    src, dst = tmp_path / "src", tmp_path / "disk"
    content = _sparse_file(src, 8 * MiB + 100, {MiB: os.urandom(MiB), 8 * MiB: os.urandom(100)})
    copied = disks.copy_to_host(src, dst)
    expected, size = copied.sha256, copied.size
    if spoil == "digest":
        expected = block_digest_of(content[:-1] + bytes([content[-1] ^ 1]), MOVES)  # another last byte, always
    elif spoil == "size":
        size += 1
    elif spoil == "blocks-missing":
        (tmp_path / "disk.blocks").unlink()
    else:
        with open(dst, "r+b") as f:
            f.seek(8 * MiB)
            f.write(b"changed")

    with pytest.raises(errors.DiskCopyFailed):
        disks.received_digest(dst, expected, size, MOVES)


def test_a_host_marker_is_made_once_and_read_only_for_its_host(tmp_path):
    token = disks.host_token(tmp_path, "compute1")

    assert disks.host_token(tmp_path, "compute1") == token
    assert disks.reaches(tmp_path, "compute1", token)
    assert not disks.reaches(tmp_path, "compute2", token)
    assert not disks.reaches(tmp_path, "compute1", "another")
    assert not disks.reaches(tmp_path / "elsewhere", "compute1", token)


def test_an_agent_starting_removes_its_own_partial_writes_but_not_a_copy_another_host_is_sending(tmp_path):
    own = [tmp_path / "a1" / ".disk.x1.part", tmp_path / disks.IMAGE_CACHE_DIR / ".ab12.x2.part"]
    sending = disks.incoming_dir(tmp_path, "a2") / ".disk.x3.part"
    kept = tmp_path / "a1" / "disk"
    for path in [*own, sending, kept]:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")

    assert sorted(disks.remove_partial_files(tmp_path)) == sorted(own)
    assert sending.exists() and kept.exists()
