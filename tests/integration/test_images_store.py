"""Images in S3 (moto): registering, listing, locating and deleting, and the API's image look-ups."""

from __future__ import annotations

import hashlib
import io
import os

import pytest
from botocore.exceptions import ClientError
from test_api_support import ADMIN, ALICE, BOB, IMAGE_BYTES, call, mocked_cloud

from ferry import aws, config, errors, images
from ferry.api import images as api_images


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


def test_register_streams_the_file_and_records_its_sha256(cloud, tmp_path):
    data = os.urandom(9 * 1024 * 1024)  # above the transfer manager's multipart threshold
    path = tmp_path / "big.raw"
    path.write_bytes(data)

    image = images.register_image(path, "big", min_disk=2, min_ram=256)

    assert (image["status"], image["size"], image["min_disk"], image["min_ram"]) == ("active", len(data), 2, 256)
    assert image["os_hash_value"] == hashlib.sha256(data).hexdigest()
    head = aws.client("s3").head_object(Bucket=config.get().image_bucket, Key=f"images/{image['id']}")
    assert head["Metadata"]["sha256"] == image["os_hash_value"]
    assert head["Metadata"]["image-id"] == image["id"] and head["Metadata"]["disk-format"] == "raw"
    assert images.image_location(image["id"]) == {"id": image["id"], "bucket": config.get().image_bucket,
                                                  "key": f"images/{image['id']}", "sha256": image["os_hash_value"]}


def test_register_is_idempotent_by_name(cloud, tmp_path):
    path = tmp_path / "again.raw"
    path.write_bytes(IMAGE_BYTES)

    again = images.register_image(path, "cirros")

    assert again["id"] == cloud.image_id
    assert [i["id"] for i in images.list_images()] == [cloud.image_id]


def test_an_unfinished_upload_is_not_bootable(cloud):
    aws.client("s3").put_object(Bucket=config.get().image_bucket, Key="images/half", Body=b"x",
                                Metadata={"image-id": "half", "name": "half"})

    assert images.get_image("half")["status"] == "saving"
    with pytest.raises(errors.ImageNotFound):
        images.image_location("half")


def test_delete_image_twice_is_harmless(cloud):
    assert images.delete_image(cloud.image_id) is True
    assert images.delete_image(cloud.image_id) is False
    with pytest.raises(errors.ImageNotFound):
        images.get_image(cloud.image_id)


def test_api_lists_and_shows_images_in_image_v2_shapes(cloud):
    listed = call("GET", "/v2.1/images").body["images"]
    by_name = call("GET", "/v2.1/images", query={"name": "cirros"}).body["images"]
    nobody = call("GET", "/v2.1/images", query={"name": "nope"}).body["images"]
    shown = call("GET", f"/v2.1/images/{cloud.image_id}").body

    assert [i["id"] for i in listed] == [i["id"] for i in by_name] == [cloud.image_id]
    assert nobody == []
    assert {k: shown[k] for k in ("id", "name", "status", "disk_format", "container_format", "visibility")} == \
        {"id": cloud.image_id, "name": "cirros", "status": "active", "disk_format": "raw",
         "container_format": "bare", "visibility": "public"}


def test_a_private_image_is_seen_and_booted_only_by_its_owners_project_and_admins(cloud):
    # GIVEN a private image of Alice's project (a cross-cell move's snapshot of her server)
    private = images.upload_image(io.BytesIO(IMAGE_BYTES), "web-1-resize-temp", visibility="private",
                                  owner=ALICE.project_id)
    boot = {"server": {"name": "copy", "flavorRef": "1", "networks": "auto", "imageRef": private["id"]}}

    def listed(caller):
        return sorted(i["id"] for i in call("GET", "/v2.1/images", caller=caller).body["images"])

    # THEN another project neither lists, shows nor boots it; its owner and admins see it
    assert listed(BOB) == [cloud.image_id]
    assert call("GET", f"/v2.1/images/{private['id']}", caller=BOB).status == 404
    refused = call("POST", "/v2.1/servers", caller=BOB, body=boot, version="2.90")
    assert (refused.status, refused.body["badRequest"]["message"]) == (400, "Can not find requested image")
    assert listed(ALICE) == listed(ADMIN) == sorted([cloud.image_id, private["id"]])
    shown = call("GET", f"/v2.1/images/{private['id']}", caller=ALICE).body
    assert (shown["visibility"], shown["owner"]) == ("private", ALICE.project_id)
    assert call("POST", "/v2.1/servers", caller=ALICE, body=boot, version="2.90").status == 202


def test_api_lists_only_the_images_an_id_filter_names_without_listing_the_bucket(cloud, monkeypatch):
    # GIVEN three images, one of them private to Bob's project
    second = images.upload_image(io.BytesIO(IMAGE_BYTES), "second")
    images.upload_image(io.BytesIO(IMAGE_BYTES), "third")
    bobs = images.upload_image(io.BytesIO(IMAGE_BYTES), "bobs", visibility="private", owner=BOB.project_id)
    missing = "00000000-0000-4000-8000-000000000000"

    def no_listing(**_kwargs):
        raise AssertionError("the bucket was listed")
    monkeypatch.setattr(images, "list_images", no_listing)

    def ids(value, caller=ALICE, **query):
        response = call("GET", "/v2.1/images", caller=caller, query={"id": value, **query})
        assert response.status == 200, response.body
        return sorted(i["id"] for i in response.body["images"])

    # WHEN `openstack server list` asks for its servers' images (id=in:<id>,<id>), or for one id
    # THEN only those visible to the caller are listed; unknown ids are skipped
    assert ids(f"in:{cloud.image_id},{second['id']},{missing}") == sorted([cloud.image_id, second["id"]])
    assert ids(second["id"]) == [second["id"]]
    assert ids(f"in:{bobs['id']},{second['id']}") == [second["id"]]
    assert ids(f"in:{bobs['id']},{second['id']}", caller=BOB) == sorted([bobs["id"], second["id"]])
    assert ids(f"in:{cloud.image_id},{second['id']}", name="second") == [second["id"]]
    assert ids(missing) == []
    # and a filter naming more than MAX_IDS images is refused before any look-up
    many = ",".join(f"00000000-0000-4000-8000-{n:012d}" for n in range(api_images.MAX_IDS + 1))
    refused = call("GET", "/v2.1/images", query={"id": f"in:{many}"})
    assert refused.status == 400 and f"at most {api_images.MAX_IDS}" in refused.body["badRequest"]["message"]


def test_a_private_image_with_no_owner_is_an_admins_only(cloud):
    private = images.upload_image(io.BytesIO(IMAGE_BYTES), "old-snapshot", visibility="private")

    assert call("GET", f"/v2.1/images/{private['id']}", caller=ALICE).status == 404
    assert call("GET", f"/v2.1/images/{private['id']}", caller=ADMIN).status == 200


@pytest.mark.parametrize("owner", ["prøject-ß", "项目", "p%41q", "hex-0123abcd"])
def test_an_image_of_a_project_with_any_printable_id_is_that_projects(cloud, owner):
    # S3 keeps only ASCII metadata: a project id outside it could own no image (nor a move's snapshot)
    image = images.upload_image(io.BytesIO(IMAGE_BYTES), "theirs", visibility="private", owner=owner)

    assert image["owner"] == images.get_image(image["id"])["owner"] == owner
    assert images.visible_to(image, owner, is_admin=False)
    assert not images.visible_to(image, owner + "x", is_admin=False)


def test_an_owner_written_before_owners_were_encoded_is_read_as_it_is(cloud):
    aws.client("s3").put_object(Bucket=config.get().image_bucket, Key="images/old", Body=b"x", Metadata={
        "image-id": "old", "name": "old", "visibility": "private", "owner": "p%41q", "sha256": "0" * 64})

    assert images.get_image("old")["owner"] == "p%41q"


def test_api_image_lookup_by_name_in_the_path_is_404(cloud):
    response = call("GET", "/v2.1/images/cirros")

    assert response.status == 404 and response.body["itemNotFound"]["code"] == 404


def test_a_sparse_image_shows_its_disk_size_and_goes_with_its_extents(cloud):
    s3, bucket, image_id = aws.client("s3"), config.get().image_bucket, "0b5e7c4e-3c57-4c1e-9a55-8f0f4a1c2d3e"
    prefix = images.data_prefix(image_id)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/disk", Body=b"x" * 4096)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/disk.manifest.json", Body=b"{}")
    s3.put_object(Bucket=bucket, Key=f"images/{image_id}", Body=b'{"layout": "extents"}', Metadata={
        "image-id": image_id, "name": "vm-resize-temp", "layout": "extents", "sha256": "ab" * 32,
        "virtual-size": str(2**30), "data-size": "4096"})

    image = images.get_image(image_id)

    assert (image["status"], image["size"], image["virtual_size"]) == ("active", 4096, 2**30)
    assert images.delete_image(image_id) is True
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not [key for key in left if image_id in key], left


def test_a_sparse_image_whose_extents_could_not_be_deleted_keeps_its_image_object(cloud, monkeypatch):
    # GIVEN a sparse image, and S3 failing to delete its extents
    s3, bucket, image_id = aws.client("s3"), config.get().image_bucket, "3c9a1e5d-6b2f-4e8a-9d7c-1f0e2d3c4b5a"
    prefix = images.data_prefix(image_id)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/disk", Body=b"x" * 4096)
    s3.put_object(Bucket=bucket, Key=f"images/{image_id}", Body=b'{"layout": "extents"}', Metadata={
        "image-id": image_id, "name": "vm-resize-temp", "layout": "extents", "sha256": "ab" * 32})
    delete_object = s3.delete_object

    def failing_on_extents(**kwargs):
        if kwargs["Key"].startswith(prefix):
            raise ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "S3 is unavailable"}},
                              "DeleteObject")
        return delete_object(**kwargs)

    # WHEN the image is deleted
    with monkeypatch.context() as patched:
        patched.setattr(s3, "delete_object", failing_on_extents)
        with pytest.raises(ClientError):
            images.delete_image(image_id)

    # THEN the image still points at its extents, so it is still listed (and deleting it again removes both)
    assert images.get_image(image_id)["status"] == "active"
    assert images.delete_image(image_id) is True
    assert s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount", 0) == 0

@pytest.mark.parametrize("digest", [None, "sha256", "sha256-blocks"])
def test_only_a_plain_sha256_shows_as_the_images_hash_and_the_host_gets_the_recorded_digest(cloud, digest):
    s3, bucket, image_id = aws.client("s3"), config.get().image_bucket, "7f1d6c0e-2b7a-4d7e-8a0c-5e9a1b2c3d4e"
    meta = {"image-id": image_id, "name": "vm-resize-temp", "layout": "extents", "sha256": "cd" * 32,
            "virtual-size": str(2**30), "data-size": "0", **({"digest": digest} if digest else {})}
    s3.put_object(Bucket=bucket, Key=f"images/{image_id}", Body=b'{"layout": "extents"}', Metadata=meta)

    image = images.get_image(image_id)

    plain = digest != "sha256-blocks"
    assert image["status"] == "active"
    assert (image["os_hash_algo"], image["os_hash_value"]) == (("sha256", "cd" * 32) if plain else (None, None))
    assert images.image_location(image_id)["sha256"] == "cd" * 32


def test_deleting_a_snapshot_whose_image_was_never_written_removes_its_extents(cloud):
    s3, bucket, image_id = aws.client("s3"), config.get().image_bucket, "5d1f0a2b-7c3e-4f5a-8b9c-0d1e2f3a4b5c"
    s3.put_object(Bucket=bucket, Key=f"{images.data_prefix(image_id)}/disk", Body=b"partial")

    assert images.delete_image(image_id) is False  # no image, but its data goes
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=images.data_prefix(image_id))
    assert listed.get("KeyCount", 0) == 0


def test_deleting_a_snapshot_aborts_the_uploads_a_killed_agent_left_open(cloud):
    s3, bucket, image_id = aws.client("s3"), config.get().image_bucket, "5d1f0a2b-7c3e-4f5a-8b9c-0d1e2f3a4b5c"
    for key in (f"{images.data_prefix(image_id)}/disk", f"images/{image_id}", "images/another"):
        s3.create_multipart_upload(Bucket=bucket, Key=key)

    images.delete_image(image_id)

    assert [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == ["images/another"]


def test_an_image_with_a_long_non_ascii_name_stays_within_s3s_metadata_size(cloud):
    name = "\U0001f680" * 200 + "\u00e9" * 55

    image = images.upload_image(io.BytesIO(b"disk"), name)

    s3 = aws.client("s3")
    meta = s3.head_object(Bucket=config.get().image_bucket, Key=f"images/{image['id']}")["Metadata"]
    assert sum(len(k.encode()) + len(v.encode()) for k, v in meta.items()) <= 2048 - 512
    shown = images.get_image(image["id"])["name"]
    assert shown.startswith("\U0001f680" * 40) and shown.endswith("\u00e9" * 20) and len(shown) < len(name)
