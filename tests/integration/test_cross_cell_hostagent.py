"""The source side of a cross-cell move on a real host agent: the snapshot-based prep, and a spawn from its image.

Same harness as ``test_hostagent_resize``: agents on the libvirt test driver with real disk files,
moto for S3 and SQS, answers recorded by task token.
"""

from __future__ import annotations

import uuid

import test_hostagent_resize as harness
from botocore.exceptions import ClientError
from digest_helpers import block_digest
from test_hostagent_resize import IMAGES, NEW, PORTS, boot, finish_revert_args, logical_sha256

from ferry import images, protocol
from hostagent import disks
from hostagent.driver import NOSTATE, RUNNING

OP = protocol.PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE

# The agent harness's fixtures: two hosts with their own hypervisor and disks, scaled gigabytes.
cloud, source, dest, scaled_disks = harness.cloud, harness.source, harness.dest, harness.scaled_disks


def snapshot_args(migration_uuid: str, image_id: str | None) -> dict:
    snapshot = None
    if image_id is not None:
        snapshot = {"bucket": IMAGES, "key": f"images/{image_id}", "data_prefix": f"image-data/{image_id}",
                    "image_id": image_id, "name": "web-1-resize-temp", "owner": "project-a"}
    return {"migration_uuid": migration_uuid, "snapshot": snapshot, "clean_shutdown": True}


def object_size(cloud, key: str) -> int:
    return int(cloud.s3.head_object(Bucket=IMAGES, Key=key)["ContentLength"])


def test_snapshot_prep_uploads_the_root_disk_as_an_image_and_keeps_the_disks(cloud, source):
    server = boot(source)
    migration_uuid, image_id = str(uuid.uuid4()), str(uuid.uuid4())

    result = source.ok(OP, server.uuid, snapshot_args(migration_uuid, image_id))

    kept = source.kept(server.uuid)
    root = kept / disks.ROOT_DISK
    assert result["was_running"] is True
    assert result["power_state"] == NOSTATE
    assert not source.driver.guest_exists(server.uuid)
    assert not source.live(server.uuid).exists()
    assert root.exists() and (kept / disks.EPHEMERAL_DISK).exists()
    assert logical_sha256(root) == server.root_sha256
    snapshot = result["snapshot"]
    image_digest = block_digest(root)  # snapshots keep SHA-256 block digests (moves use BLAKE3 ones)
    assert (snapshot["image_id"], snapshot["sha256"], snapshot["size"]) == (
        image_id, image_digest, root.stat().st_size)
    # Only the written blocks travel: the data object holds them, far less than the disk's size.
    assert 0 < snapshot["data_bytes"] == object_size(cloud, f"image-data/{image_id}/disk") < root.stat().st_size // 4
    meta = cloud.s3.head_object(Bucket=IMAGES, Key=f"images/{image_id}")["Metadata"]
    assert (meta["sha256"], meta["digest"], meta["layout"], meta["virtual-size"], meta["data-size"]) == (
        image_digest, "sha256-blocks", "extents", str(root.stat().st_size), str(snapshot["data_bytes"]))
    assert (meta["disk-format"], meta["name"], meta["image-id"]) == ("raw", "web-1-resize-temp", image_id)
    assert (meta["visibility"], meta["owner"]) == ("private", "project-a")


def test_a_snapshot_of_a_server_with_a_long_non_ascii_name_stays_within_s3s_metadata_size(cloud, source):
    # GIVEN a server named with 255 characters outside ASCII (12 bytes each, percent-encoded)
    server = boot(source)
    migration_uuid, image_id = str(uuid.uuid4()), str(uuid.uuid4())
    args = snapshot_args(migration_uuid, image_id)
    name = "\U0001f680" * 200 + "\u00e9" * 55 + "-resize-temp"
    args["snapshot"]["name"] = name

    # WHEN its root disk is snapshotted
    source.ok(OP, server.uuid, args)

    # THEN the image's metadata fits in S3's 2 KB (moto does not enforce it; S3 refuses more)
    meta = cloud.s3.head_object(Bucket=IMAGES, Key=f"images/{image_id}")["Metadata"]
    assert sum(len(k.encode()) + len(v.encode()) for k, v in meta.items()) <= 2048 - 512
    # and the image API reads back the name's beginning and its end, the move's suffix included
    shown = images.get_image(image_id)["name"]
    assert shown.startswith("\U0001f680" * 40) and shown.endswith("\u00e9" * 20 + "-resize-temp")
    assert "\ufffd" not in shown and len(shown) < len(name)


def test_a_snapshot_of_a_server_of_a_project_whose_id_is_not_ascii_is_that_projects(cloud, source):
    server = boot(source)
    migration_uuid, image_id = str(uuid.uuid4()), str(uuid.uuid4())
    args = snapshot_args(migration_uuid, image_id)
    args["snapshot"]["owner"] = "projet-été"

    source.ok(OP, server.uuid, args)

    assert images.get_image(image_id)["owner"] == "projet-été"


def test_snapshot_prep_run_again_returns_the_same_snapshot_without_sending_it_again(cloud, source):
    server = boot(source)
    migration_uuid, image_id = str(uuid.uuid4()), str(uuid.uuid4())
    first = source.ok(OP, server.uuid, snapshot_args(migration_uuid, image_id))
    etag = cloud.s3.head_object(Bucket=IMAGES, Key=f"images/{image_id}")["LastModified"]

    again = source.ok(OP, server.uuid, snapshot_args(migration_uuid, image_id))

    assert again == first
    assert cloud.s3.head_object(Bucket=IMAGES, Key=f"images/{image_id}")["LastModified"] == etag
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256


def test_a_stopped_server_is_reported_as_not_running(source):
    server = boot(source, running=False)

    result = source.ok(OP, server.uuid, snapshot_args(str(uuid.uuid4()), str(uuid.uuid4())))

    assert result["was_running"] is False


def test_a_snapshot_prep_whose_workflow_gave_up_takes_back_the_snapshot(cloud, source):
    """The rollback deletes the snapshot, but may do so before a late source finishes writing it."""
    server = boot(source)
    image_id = str(uuid.uuid4())

    source.abandoned(OP, server.uuid, snapshot_args(str(uuid.uuid4()), image_id))

    for prefix in (f"images/{image_id}", f"image-data/{image_id}/"):
        assert cloud.s3.list_objects_v2(Bucket=IMAGES, Prefix=prefix).get("KeyCount", 0) == 0
    assert logical_sha256(source.kept(server.uuid) / disks.ROOT_DISK) == server.root_sha256, "kept for the revert"


def test_a_snapshot_taken_back_with_s3_failing_on_its_extents_keeps_its_image_object(cloud, source, monkeypatch):
    """What is left must stay findable: the image object points at the extents, so it goes last."""
    # GIVEN a late snapshot prep, and S3 failing to delete the snapshot's extents
    server = boot(source)
    image_id = str(uuid.uuid4())
    delete_objects = source.agent.s3.delete_objects

    def failing_on_extents(**kwargs):
        if any(o["Key"].startswith(f"image-data/{image_id}/") for o in kwargs["Delete"]["Objects"]):
            raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "S3 is unavailable"}},
                              "DeleteObjects")
        return delete_objects(**kwargs)

    monkeypatch.setattr(source.agent.s3, "delete_objects", failing_on_extents)

    # WHEN its workflow gave up on it, so the agent takes the snapshot back
    source.abandoned(OP, server.uuid, snapshot_args(str(uuid.uuid4()), image_id))

    # THEN the extents are there and so is the image object pointing at them
    assert cloud.s3.list_objects_v2(Bucket=IMAGES, Prefix=f"image-data/{image_id}/").get("KeyCount", 0) > 0
    assert cloud.s3.head_object(Bucket=IMAGES, Key=f"images/{image_id}")["Metadata"]["image-id"] == image_id

def test_a_volume_backed_server_is_not_snapshotted(cloud, source, tmp_path):
    volume_path = tmp_path / "vol-1"
    volume_path.write_bytes(b"boot volume")
    server = boot(source, volumes=[{"volume_id": "vol-1", "path": str(volume_path), "device": "vda", "boot_index": 0}])

    result = source.ok(OP, server.uuid, snapshot_args(str(uuid.uuid4()), None))

    assert result["snapshot"] is None
    assert not source.driver.guest_exists(server.uuid)
    assert source.kept(server.uuid).exists()
    assert "Contents" not in cloud.s3.list_objects_v2(Bucket=IMAGES, Prefix="images/")
    assert volume_path.read_bytes() == b"boot volume"


def test_the_destination_spawns_from_the_snapshot_with_the_new_flavor(cloud, source, dest):
    server = boot(source)
    image_id = str(uuid.uuid4())
    snap = source.ok(OP, server.uuid, snapshot_args(str(uuid.uuid4()), image_id))["snapshot"]

    spawned = dest.ok("spawn", server.uuid, {
        "name": "web-1", "flavor": NEW, "ports": PORTS, "volumes": [], "power_on": True,
        "image": {"id": image_id, "bucket": IMAGES, "key": f"images/{image_id}", "sha256": snap["sha256"]}})

    assert spawned["power_state"] == RUNNING
    root = dest.live(server.uuid) / disks.ROOT_DISK
    assert root.stat().st_size == NEW["root_gb"] * disks.GiB
    assert logical_sha256(root, snap["size"]) == server.root_sha256


def test_a_spawn_from_the_move_s_snapshot_keeps_no_copy_in_the_image_cache(cloud, source, dest):
    """The snapshot is deleted once the move settles: a cached copy would outlive it for ever."""
    server = boot(source)
    image_id = str(uuid.uuid4())
    snap = source.ok(OP, server.uuid, snapshot_args(str(uuid.uuid4()), image_id))["snapshot"]
    image = {"id": image_id, "bucket": IMAGES, "key": f"images/{image_id}", "sha256": snap["sha256"]}
    spawn = {"name": "web-1", "flavor": NEW, "ports": PORTS, "volumes": [], "power_on": False}
    cache = dest.instances_dir / disks.IMAGE_CACHE_DIR

    dest.ok("spawn", server.uuid, {**spawn, "image": {**image, "cache": False}})

    assert logical_sha256(dest.live(server.uuid) / disks.ROOT_DISK, snap["size"]) == server.root_sha256
    assert not cache.exists() or not any(cache.iterdir())
    # The same image, not marked: an ordinary image is cached for later spawns.
    dest.ok("spawn", str(uuid.uuid4()), {**spawn, "image": image})
    assert [p.name for p in cache.iterdir()] == [snap["sha256"]]


def test_the_source_guest_is_restored_from_the_kept_disks_after_a_snapshot_prep(source):
    server = boot(source)
    migration_uuid = str(uuid.uuid4())
    source.ok(OP, server.uuid, snapshot_args(migration_uuid, str(uuid.uuid4())))

    restored = source.ok("finish_revert_resize", server.uuid, finish_revert_args(migration_uuid, server, True))

    assert restored["power_state"] == RUNNING
    assert logical_sha256(source.live(server.uuid) / disks.ROOT_DISK) == server.root_sha256
    assert not source.kept(server.uuid).exists()
