"""``ferry image``: images uploaded, listed and deleted by an operator (moto S3), with nothing uploaded
when refused and one line, never a traceback, when the bucket cannot be used."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.exceptions import EndpointConnectionError
from moto import mock_aws
from moto_credentials import use_moto_credentials

from ferry import aws, cli, config, images

BUCKET = "ferry-test-images"
IMAGE_BYTES = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and a bit: not a whole number of parts


@pytest.fixture
def bucket(tmp_path: Path, monkeypatch) -> Iterator[str]:
    """The image bucket, empty, in moto."""
    use_moto_credentials(monkeypatch)
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path))
    monkeypatch.setenv(config.IMAGE_BUCKET_VARIABLE, BUCKET)
    # No image command reads the database: set, so that ferry's notice of an unset one stays off stderr.
    monkeypatch.setenv("FERRY_API_DATABASE_URL", f"sqlite:///{tmp_path / 'api.sqlite'}")
    with mock_aws():
        aws.reset()
        config.reset()
        aws.client("s3").create_bucket(Bucket=config.get().image_bucket)
        yield config.get().image_bucket
        aws.reset()
    config.reset()


@pytest.fixture
def image_file(tmp_path: Path) -> Path:
    path = tmp_path / "cirros.raw"
    path.write_bytes(IMAGE_BYTES)
    return path


def stored(bucket: str) -> list[str]:
    """Every key in the bucket, and every multipart upload left open there."""
    s3 = aws.client("s3")
    keys = [item["Key"] for item in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    uploads = [f"upload:{upload['Key']}" for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    return keys + uploads


def table(out: str) -> list[dict[str, str]]:
    """The rows of a printed table, by column."""
    header, *rows = out.splitlines()
    assert header.split("\t") == ["id", "name", "status", "size", "sha256", "visibility", "owner"]
    return [dict(zip(header.split("\t"), row.split("\t"), strict=True)) for row in rows]


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err


def test_an_uploaded_image_is_listed_active_with_the_sha256_of_the_file(bucket, image_file, capsys):
    assert cli.main(["image", "upload", str(image_file), "--name", "cirros", "--min-disk", "1"]) == 0

    [shown] = table(capsys.readouterr().out)
    assert cli.main(["image", "list"]) == 0
    [listed] = table(capsys.readouterr().out)
    assert listed == shown
    assert listed["name"] == "cirros" and listed["status"] == "active"
    assert listed["sha256"] == hashlib.sha256(IMAGE_BYTES).hexdigest()
    assert listed["size"] == str(len(IMAGE_BYTES))
    assert (listed["visibility"], listed["owner"]) == ("public", "-")
    assert images.get_image(listed["id"])["min_disk"] == 1
    assert stored(bucket) == [f"images/{listed['id']}"]


def test_json_output_is_the_image_v2_shape(bucket, image_file, capsys):
    assert cli.main(["image", "upload", str(image_file), "--name", "cirros", "--json"]) == 0
    uploaded = json.loads(capsys.readouterr().out)

    assert cli.main(["image", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)

    assert uploaded["status"] == "active" and uploaded["name"] == "cirros"
    assert (uploaded["os_hash_algo"], uploaded["os_hash_value"]) == ("sha256", hashlib.sha256(IMAGE_BYTES).hexdigest())
    assert listed == {"images": [uploaded]}


def test_a_private_image_is_its_project_s_alone(bucket, image_file, capsys):
    assert cli.main(["image", "upload", str(image_file), "--name", "ours", "--private", "--project", "demo"]) == 0

    [row] = table(capsys.readouterr().out)
    assert (row["visibility"], row["owner"]) == ("private", "demo")
    image = images.get_image(row["id"])
    assert images.visible_to(image, "demo", is_admin=False)
    assert not images.visible_to(image, "other", is_admin=False)


@pytest.mark.parametrize("options, message", [
    (["--private"], "give --private and --project together"),
    (["--project", "demo"], "give --private and --project together"),
    (["--private", "--project", " "], "a project id is"),
    (["--private", "--project", "d\u00e9mo"], "a project id is 1 to 255 letters, digits"),
    (["--min-disk", "-1"], "--min-disk is a size from 0"),
    (["--min-ram", "-512"], "--min-ram is a size from 0"),
], ids=["private-alone", "project-alone", "blank-project", "non-ascii-project", "min-disk", "min-ram"])
def test_bad_options_are_refused_and_upload_nothing(bucket, image_file, capsys, options, message):
    assert cli.main(["image", "upload", str(image_file), "--name", "cirros", *options]) == 1

    err = one_line(capsys.readouterr().err)
    assert err.startswith("ferry: ") and message in err
    assert stored(bucket) == []


@pytest.mark.parametrize("name, message", [
    (" padded", "printable characters"),
    ("tab\there", "printable characters"),
    ("", "printable characters"),
    ("x" * 256, "printable characters"),
    ("bad\udcffbytes", "printable characters"),  # what a name not in UTF-8 becomes in argv; not encodable
    ("\u754c" * 200, "too long for the image's metadata"),  # 200 characters, 1,800 bytes percent-encoded
    ("vm1-resize-temp", "kept for cross-cell moves' temporary snapshots"),
], ids=["padded", "tab", "empty", "too-many-characters", "surrogate", "too-long-encoded", "snapshot-like"])
def test_a_name_that_cannot_be_kept_is_refused_and_uploads_nothing(bucket, image_file, capsys, name, message):
    assert cli.main(["image", "upload", str(image_file), "--name", name]) == 1

    err = one_line(capsys.readouterr().err)
    assert err.startswith("ferry: ") and message in err
    assert stored(bucket) == []


def test_a_path_that_is_no_readable_regular_file_is_refused_and_uploads_nothing(bucket, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it to read would wait for a writer
    (tmp_path / "empty.raw").touch()
    (tmp_path / "file").write_bytes(b"x")
    paths = {
        tmp_path / "missing.raw": "No such file or directory",
        tmp_path: "not a regular file",
        fifo: "not a regular file",
        tmp_path / "file" / "below": "Not a directory",
        tmp_path / "empty.raw": "is empty",
    }

    for path, message in paths.items():
        assert cli.main(["image", "upload", str(path), "--name", "cirros"]) == 1, path
        err = one_line(capsys.readouterr().err)
        assert err.startswith(f"ferry: {path}") and message in err

    assert stored(bucket) == []


def test_the_name_of_an_active_image_is_refused_until_it_is_deleted(bucket, image_file, tmp_path, capsys):
    other = tmp_path / "other.raw"
    other.write_bytes(b"another disk")
    assert cli.main(["image", "upload", str(image_file), "--name", "cirros"]) == 0
    [first] = table(capsys.readouterr().out)

    assert cli.main(["image", "upload", str(other), "--name", "cirros"]) == 1

    err = one_line(capsys.readouterr().err)
    assert f"is the name of the active image {first['id']};" in err and "delete" in err
    assert stored(bucket) == [f"images/{first['id']}"]
    assert images.get_image(first["id"])["os_hash_value"] == hashlib.sha256(IMAGE_BYTES).hexdigest()

    assert cli.main(["image", "delete", first["id"]]) == 0
    assert cli.main(["image", "upload", str(other), "--name", "cirros"]) == 0
    assert [image["os_hash_value"] for image in images.list_images(name="cirros")] == [
        hashlib.sha256(b"another disk").hexdigest()]


def test_an_unfinished_upload_of_the_name_is_redone_under_its_id(bucket, image_file, capsys):
    unfinished = str(uuid.uuid4())
    aws.client("s3").put_object(Bucket=bucket, Key=f"images/{unfinished}", Body=b"half",
                                Metadata={"image-id": unfinished, "name": "cirros", "visibility": "public"})
    assert images.get_image(unfinished)["status"] == "saving"

    assert cli.main(["image", "upload", str(image_file), "--name", "cirros"]) == 0

    [row] = table(capsys.readouterr().out)
    assert (row["id"], row["status"]) == (unfinished, "active")
    assert stored(bucket) == [f"images/{unfinished}"]


def test_the_list_shows_a_move_s_temporary_snapshot_too(bucket, image_file, capsys):
    with image_file.open("rb") as source:  # as a move names it: the command refuses such a name
        snapshot = images.upload_image(source, "vm1-resize-temp", visibility="private", owner="demo")

    assert cli.main(["image", "list"]) == 0

    assert [(row["id"], row["name"], row["owner"]) for row in table(capsys.readouterr().out)] == [
        (snapshot["id"], "vm1-resize-temp", "demo")]


def test_a_deleted_image_is_listed_no_more(bucket, image_file, capsys):
    assert cli.main(["image", "upload", str(image_file), "--name", "cirros"]) == 0
    [row] = table(capsys.readouterr().out)

    assert cli.main(["image", "delete", row["id"]]) == 0
    assert capsys.readouterr().out == f"image {row['id']} (cirros, active, public) deleted\n"

    assert cli.main(["image", "list"]) == 0
    assert table(capsys.readouterr().out) == []
    assert stored(bucket) == []


@pytest.mark.parametrize("image_id", [str(uuid.uuid4()), "", "a/b"], ids=["unknown", "empty", "slash"])
def test_deleting_an_unknown_image_is_refused(bucket, capsys, image_id):
    assert cli.main(["image", "delete", image_id]) == 1

    assert capsys.readouterr().err == f"ferry: no image {image_id}\n"


def test_deleting_an_unknown_id_leaves_the_uploads_it_begins_alone(bucket, capsys):
    # ferry.images.delete_image aborts the unfinished uploads whose key begins with images/<id>.
    s3, running = aws.client("s3"), str(uuid.uuid4())
    s3.create_multipart_upload(Bucket=bucket, Key=f"images/{running}")

    assert cli.main(["image", "delete", running[:8]]) == 1

    assert stored(bucket) == [f"upload:images/{running}"]


def test_deleting_an_image_aborts_its_own_unfinished_upload_and_no_other(bucket):
    # GIVEN unfinished uploads of an image and of another whose id begins with the first's
    s3, first = aws.client("s3"), str(uuid.uuid4())
    s3.create_multipart_upload(Bucket=bucket, Key=f"images/{first}")
    s3.create_multipart_upload(Bucket=bucket, Key=f"images/{first}0")

    # WHEN the first is deleted, THEN only its own upload is aborted
    images.delete_image(first)
    assert stored(bucket) == [f"upload:images/{first}0"]


@pytest.mark.parametrize("argv", [
    ["image", "upload", "{path}", "--name", "cirros"],
    ["image", "list"],
    ["image", "delete", "00000000-0000-4000-8000-000000000000"],
], ids=["upload", "list", "delete"])
def test_a_missing_bucket_is_one_line_naming_it_and_exit_3(bucket, image_file, monkeypatch, capsys, argv):
    monkeypatch.setenv(config.IMAGE_BUCKET_VARIABLE, "no-such-bucket")
    config.reset()

    assert cli.main([arg.format(path=image_file) for arg in argv]) == cli.EXIT_CANNOT_RUN == 3

    err = one_line(capsys.readouterr().err)
    assert err.startswith("ferry: cannot use the image bucket no-such-bucket: ") and "NoSuchBucket" in err


def test_s3_failing_during_the_upload_is_one_line_and_exit_3(bucket, image_file, monkeypatch, capsys):
    def unreachable(*args, **kwargs):
        raise EndpointConnectionError(endpoint_url="https://s3.example")

    monkeypatch.setattr(aws, "upload_fileobj", unreachable)

    assert cli.main(["image", "upload", str(image_file), "--name", "cirros"]) == 3

    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"ferry: cannot use the image bucket {bucket}: Could not connect")


@pytest.mark.parametrize("argv", [["image", "list"], ["image", "upload", "{path}", "--name", "cirros"]],
                         ids=["list", "upload"])
def test_an_unset_bucket_is_not_guessed(bucket, image_file, monkeypatch, capsys, argv):
    monkeypatch.delenv(config.IMAGE_BUCKET_VARIABLE)
    config.reset()
    default = config.get().image_bucket  # a global name: maybe another account's bucket
    aws.client("s3").create_bucket(Bucket=default)

    assert cli.main([arg.format(path=image_file) for arg in argv]) == 3

    assert f"{config.IMAGE_BUCKET_VARIABLE} is not set" in one_line(capsys.readouterr().err)
    assert stored(default) == [] and stored(bucket) == []


def test_a_minimum_that_is_no_whole_number_is_a_usage_error(bucket, image_file, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["image", "upload", str(image_file), "--name", "cirros", "--min-ram", "1.5"])

    assert exited.value.code == 2
    assert stored(bucket) == []
