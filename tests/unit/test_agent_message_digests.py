"""Image digests in spawn messages: a host names its image cache's files after them, so only digests pass."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from flavors import TINY as FLAVOR

from ferry import errors
from hostagent.agent import parse_message

INSTANCE = "7b0c6f2e-5d1a-4f0e-9a57-3c2d8e4b1f60"
DIGEST = hashlib.sha256(b"image").hexdigest()
NOT_DIGESTS = [
    "../../etc/shadow",
    "/etc/shadow",
    "../" + DIGEST[3:],
    DIGEST.upper(),  # Ferry records lower case only
    DIGEST[:63],
    DIGEST + "0",
    DIGEST + "\n",
    "",
]


def _image(sha256: str) -> dict[str, Any]:
    return {"id": "img-1", "bucket": "ferry-images", "key": "images/img-1", "sha256": sha256}


def _spawn(image: dict[str, Any] | None = None, volume: dict[str, Any] | None = None) -> dict[str, Any]:
    volumes = [{"volume_id": "v1", "path": "/var/lib/ferry/volumes/v1", "device": "/dev/vda", "boot_index": 0,
                **(volume or {})}]
    return {
        "operation": "spawn",
        "operation_id": "exec-1:spawn",
        "instance_uuid": INSTANCE,
        "task_token": "token",
        "args": {"name": "vm", "flavor": FLAVOR, "image": image, "ports": [], "volumes": [] if image else volumes,
                 "power_on": True},
    }


def test_a_spawn_with_image_digests_as_ferry_records_them_parses():
    assert parse_message(_spawn(image=_image(DIGEST))).args["image"]["sha256"] == DIGEST
    op = parse_message(_spawn(volume={"size_gb": 1, "source_image": _image(DIGEST)}))
    assert op.args["volumes"][0]["source_image"]["sha256"] == DIGEST


@pytest.mark.parametrize("sha256", NOT_DIGESTS)
def test_a_spawn_whose_image_digest_is_not_one_is_refused(sha256):
    with pytest.raises(errors.InvalidOperation, match="Invalid operation message"):
        parse_message(_spawn(image=_image(sha256)))


@pytest.mark.parametrize("sha256", NOT_DIGESTS)
def test_a_spawn_whose_volume_source_image_digest_is_not_one_is_refused(sha256):
    with pytest.raises(errors.InvalidOperation, match="Invalid operation message"):
        parse_message(_spawn(volume={"size_gb": 1, "source_image": _image(sha256)}))


@pytest.mark.parametrize("volume", [
    {"size_gb": 0},
    {"size_gb": -1},
    {"size_gb": "1"},
    {"size_gb": 1, "source_image": "images/img-1"},
    {"size_gb": 1, "source_image": {"id": "img-1", "bucket": "ferry-images", "key": "images/img-1"}},
])
def test_a_spawn_whose_new_volume_is_malformed_is_refused(volume):
    with pytest.raises(errors.InvalidOperation, match="Invalid operation message"):
        parse_message(_spawn(volume=volume))
