"""Validating host operation messages and building inventory reports."""

from __future__ import annotations

import re

import pytest
from flavors import TINY as FLAVOR

from ferry import errors, protocol
from hostagent.agent import inventory_from_capacity, parse_message
from hostagent.driver import HostCapacity

INSTANCE = "7b0c6f2e-5d1a-4f0e-9a57-3c2d8e4b1f60"


def _spawn_body(**changes):
    body = {
        "operation": "spawn",
        "operation_id": "exec-1:spawn",
        "instance_uuid": INSTANCE,
        "task_token": "token",
        "args": {
            "name": "vm",
            "flavor": FLAVOR,
            "image": None,
            "ports": [],
            "volumes": [{"volume_id": "v1", "path": "/v/1", "device": "/dev/vda", "boot_index": 0}],
            "power_on": True,
        },
    }
    body.update(changes)
    return body


def test_a_valid_spawn_message_parses():
    op = parse_message(_spawn_body())
    assert (op.name, op.operation_id, op.instance_uuid, op.task_token) == ("spawn", "exec-1:spawn", INSTANCE, "token")


def test_power_and_destroy_messages_accept_empty_arguments():
    for name in ("power_on", "power_off", "destroy"):
        op = parse_message(
            {"operation": name, "operation_id": "o", "instance_uuid": INSTANCE, "args": {}, "task_token": None}
        )
        assert op.task_token is None


@pytest.mark.parametrize(
    "body",
    [
        None,
        ["spawn"],
        {"operation": "reboot", "operation_id": "o", "instance_uuid": INSTANCE, "args": {}},
        {"operation": "destroy", "operation_id": "", "instance_uuid": INSTANCE, "args": {}},
        {"operation": "destroy", "operation_id": "o", "args": {}},
        {"operation": "power_off", "operation_id": "o", "instance_uuid": INSTANCE, "args": {"timeout": -1}},
        _spawn_body(args={"name": "vm"}),
        _spawn_body(instance_uuid="not-a-uuid"),
    ],
    ids=[
        "not-json-object",
        "list",
        "unknown-operation",
        "empty-id",
        "no-instance",
        "bad-timeout",
        "spawn-args",
        "bad-uuid",
    ],
)
def test_invalid_messages_raise_invalid_operation(body):
    with pytest.raises(errors.InvalidOperation) as caught:
        parse_message(body)
    assert caught.value.name == "Ferry.InvalidOperation"


@pytest.mark.parametrize("spelling", [INSTANCE.upper(), "{" + INSTANCE + "}", "urn:uuid:" + INSTANCE,
                                      INSTANCE.replace("-", ""), f" {INSTANCE}"],
                         ids=["upper-case", "braces", "urn", "no-dashes", "space"])
def test_a_uuid_not_in_its_canonical_form_is_refused(spelling):
    # Its directory would have a name inventory reports and audits never recognise as an instance's.
    with pytest.raises(errors.InvalidOperation):
        parse_message(_spawn_body(instance_uuid=spelling))

    assert protocol.INSTANCE_DIR_NAME.match(spelling) is None
    assert protocol.INSTANCE_DIR_NAME.match(parse_message(_spawn_body()).instance_uuid)


def test_inventory_reports_capacity_and_caps_reservations_at_the_total():
    inventory = inventory_from_capacity(
        HostCapacity(vcpus=8, memory_mb=256, disk_gb=100), reserved_vcpus=1, reserved_memory_mb=512, reserved_disk_gb=10
    )
    assert inventory == {
        "VCPU": {"total": 8, "reserved": 1},
        "MEMORY_MB": {"total": 256, "reserved": 256},
        "DISK_GB": {"total": 100, "reserved": 10},
    }


@pytest.mark.parametrize(("host", "valid"), [
    ("compute1", True), ("compute-1.rack2.example.org", True), ("compute_7", True), ("a" * 63, True),
    ("", False), ("-compute", False), ("compute-", False), ("compute..1", False), ("compute 1", False),
    ("compute1.", False), ("compute/1", False), ("compute1-dlq", False), ("reports-dlq", False), ("a" * 254, False),
])
def test_a_host_name_is_labels_of_letters_digits_hyphens_and_underscores(host, valid):
    assert protocol.is_host_name(host) is valid


def test_every_host_name_gets_a_queue_name_of_its_own_that_sqs_accepts():
    prefix = "ferry-production-host-"
    hosts = ["compute1", "compute_7", "compute1.example.org", "compute1_example_org",
             "node-" + "x" * 70 + ".example.org", "node-" + "x" * 70 + ".example.net", "n" * 60, "n" * 61]

    names = [protocol.host_queue_name(prefix, host) for host in hosts]

    # names SQS takes as they are stay as they were
    assert names[:2] == ["ferry-production-host-compute1", "ferry-production-host-compute_7"]
    assert names[2].startswith("ferry-production-host-compute1_example_org-")
    assert len(set(names)) == len(hosts)
    for name in names:
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,80}", name + protocol.DLQ_SUFFIX), name
