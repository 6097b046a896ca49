"""Messages of the move operations: what the workflows send is accepted, malformed arguments are refused."""

from __future__ import annotations

import copy

import pytest

from ferry import errors, protocol, validation
from hostagent.agent import HostAgent, parse_message

INSTANCE = "7b0c6f2e-5d1a-4f0e-9a57-3c2d8e4b1f60"
MIGRATION = "0e8a8a4e-2b6c-4c55-9a43-1f1f3c0d2b11"
OLD = {"flavorid": "1", "name": "m1.tiny", "vcpus": 1, "memory_mb": 512, "root_gb": 1, "ephemeral_gb": 0, "swap": 0}
NEW = {**OLD, "flavorid": "2", "name": "m1.small", "memory_mb": 1024, "root_gb": 2}
TRANSFER = {"bucket": "ferry-transfers", "prefix": f"moves/{MIGRATION}"}
DISKS = {"root": {"sha256": "a" * 64, "size": 2**30}}
PORTS = [{"id": "port-1", "mac_address": "fa:16:3e:00:00:01"}]
VOLUMES = [{"volume_id": "vol-1", "path": "/dev/mapper/vol-1", "device": "/dev/vdd", "boot_index": None}]

VALID_ARGS = {
    "prep_resize": {"migration_uuid": MIGRATION, "flavor": NEW, "same_host": False},
    "resize_instance": {
        "migration_uuid": MIGRATION,
        "dest_host": "compute2",
        "same_host": False,
        "transfer": TRANSFER,
        "clean_shutdown": True,
        "timeout": 60,
    },
    "finish_resize": {
        "migration_uuid": MIGRATION,
        "name": "web-1",
        "flavor": NEW,
        "old_flavor": OLD,
        "same_host": False,
        "transfer": TRANSFER,
        "disks": DISKS,
        "ports": PORTS,
        "volumes": VOLUMES,
        "power_on": True,
    },
    "confirm_resize": {"migration_uuid": MIGRATION, "same_host": False},
    "revert_resize": {"migration_uuid": MIGRATION, "same_host": False, "transfer": TRANSFER},
    "finish_revert_resize": {
        "migration_uuid": MIGRATION,
        "name": "web-1",
        "flavor": OLD,
        "ports": PORTS,
        "volumes": VOLUMES,
        "power_on": False,
    },
    "attach_volume": {"volume": {"volume_id": "vol-1", "path": "/dev/mapper/vol-1", "device": "/dev/vdd"}},
    "detach_volume": {"volume_id": "vol-1"},
    "prep_snapshot_based_resize_at_source": {
        "migration_uuid": MIGRATION,
        "snapshot": {"bucket": "images", "key": "images/img-1", "data_prefix": "image-data/img-1",
                     "image_id": "img-1", "name": "web-1-resize-temp"},
        "clean_shutdown": True,
    },
}


def _body(operation: str, args: dict) -> dict:
    return {
        "operation": operation,
        "operation_id": f"exec-1:{operation}",
        "instance_uuid": INSTANCE,
        "args": args,
        "task_token": "token",
    }


def test_every_operation_has_an_args_schema_and_an_agent_handler(tmp_path):
    unused = object()
    agent = HostAgent(
        host="compute1",
        node="compute1",
        cell="cell1",
        queue_url="https://queue.invalid/compute1",
        reports_queue_url="",
        driver=unused,  # type: ignore[arg-type]
        instances_dir=tmp_path / "instances",
        state_dir=tmp_path / "state",
        sqs=unused,
        stepfunctions=unused,
        s3=unused,
    )

    assert set(protocol.ARGS_SCHEMAS) == set(protocol.OPERATIONS)
    assert set(agent._handlers) == set(protocol.OPERATIONS)
    assert set(VALID_ARGS) == set(protocol.OPERATIONS) - {"spawn", "power_on", "power_off", "destroy"}


def test_the_operation_names_are_nova_s():
    assert (
        protocol.PREP_RESIZE,
        protocol.RESIZE_INSTANCE,
        protocol.FINISH_RESIZE,
        protocol.CONFIRM_RESIZE,
        protocol.REVERT_RESIZE,
        protocol.FINISH_REVERT_RESIZE,
        protocol.ATTACH_VOLUME,
        protocol.DETACH_VOLUME,
    ) == (
        "prep_resize",
        "resize_instance",
        "finish_resize",
        "confirm_resize",
        "revert_resize",
        "finish_revert_resize",
        "attach_volume",
        "detach_volume",
    )


@pytest.mark.parametrize("operation", sorted(VALID_ARGS))
def test_the_messages_the_workflows_send_parse(operation):
    op = parse_message(_body(operation, VALID_ARGS[operation]))

    assert (op.name, op.instance_uuid, op.args) == (operation, INSTANCE, VALID_ARGS[operation])


@pytest.mark.parametrize("is_bfv", [True, False])
def test_prep_resize_says_whether_the_server_is_volume_backed_and_an_older_message_need_not(is_bfv):
    # GIVEN prep_resize arguments with is_bfv, and the same without it (a workflow older than it)
    args = {**VALID_ARGS["prep_resize"], "is_bfv": is_bfv}

    # WHEN the agent parses them
    op = parse_message(_body("prep_resize", args))

    # THEN both are accepted, and the schema says an absent is_bfv is false
    assert op.args["is_bfv"] is is_bfv
    assert parse_message(_body("prep_resize", VALID_ARGS["prep_resize"])).args == VALID_ARGS["prep_resize"]
    assert protocol.PREP_RESIZE_ARGS_SCHEMA["properties"]["is_bfv"] == {"type": "boolean", "default": False}


@pytest.mark.parametrize("operation", ["resize_instance", "finish_resize", "revert_resize"])
def test_a_move_to_another_host_needs_a_transfer_and_one_on_the_same_host_does_not(operation):
    args = {k: v for k, v in VALID_ARGS[operation].items() if k != "transfer"}

    with pytest.raises(errors.InvalidOperation):
        parse_message(_body(operation, args))
    parse_message(_body(operation, {**args, "same_host": True}))


def _without(args: dict, key: str) -> dict:
    return {k: v for k, v in args.items() if k != key}


def _with(args: dict, path: tuple, value) -> dict:
    changed = copy.deepcopy(args)
    target = changed
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return changed


@pytest.mark.parametrize(
    ("operation", "args"),
    [
        ("prep_resize", _without(VALID_ARGS["prep_resize"], "flavor")),
        ("prep_resize", _with(VALID_ARGS["prep_resize"], ("flavor", "memory_mb"), 0)),
        ("prep_resize", _with(VALID_ARGS["prep_resize"], ("same_host",), "no")),
        ("prep_resize", _with(VALID_ARGS["prep_resize"], ("is_bfv",), "yes")),
        ("resize_instance", _without(VALID_ARGS["resize_instance"], "migration_uuid")),
        ("resize_instance", _with(VALID_ARGS["resize_instance"], ("timeout",), -1)),
        ("resize_instance", _with(VALID_ARGS["resize_instance"], ("transfer", "prefix"), "")),
        ("resize_instance", _with(VALID_ARGS["resize_instance"], ("transfer", "prefix"), "/")),
        ("resize_instance", _without(VALID_ARGS["resize_instance"], "dest_host")),
        ("finish_resize", _without(VALID_ARGS["finish_resize"], "old_flavor")),
        ("finish_resize", _with(VALID_ARGS["finish_resize"], ("disks", "root", "sha256"), "not-hex")),
        ("finish_resize", _with(VALID_ARGS["finish_resize"], ("disks", "swap"), DISKS["root"])),
        ("finish_resize", _with(VALID_ARGS["finish_resize"], ("volumes",), [{"volume_id": "v"}])),
        ("finish_resize", _without(VALID_ARGS["finish_resize"], "power_on")),
        ("confirm_resize", _without(VALID_ARGS["confirm_resize"], "same_host")),
        ("finish_revert_resize", _without(VALID_ARGS["finish_revert_resize"], "flavor")),
        ("attach_volume", {"volume": {"volume_id": "vol-1"}}),
        ("detach_volume", {}),
    ],
)
def test_malformed_arguments_are_refused(operation, args):
    with pytest.raises(errors.InvalidOperation):
        parse_message(_body(operation, args))


def test_result_schemas_describe_the_extra_keys():
    base = {"instance_uuid": INSTANCE, "host": "compute1", "node": "compute1", "power_state": 0}

    protocol.validate({**base, "claimed": True}, protocol.RESULT_SCHEMAS["prep_resize"])
    protocol.validate({**base, "was_running": False, "disks": DISKS}, protocol.RESULT_SCHEMAS["resize_instance"])
    protocol.validate({**base, "disks": {}}, protocol.RESULT_SCHEMAS["finish_resize"])
    with pytest.raises(validation.SchemaMismatch):
        protocol.validate(base, protocol.RESULT_SCHEMAS["resize_instance"])
    with pytest.raises(validation.SchemaMismatch):
        protocol.validate({**base, "claimed": False}, protocol.RESULT_SCHEMAS["prep_resize"])


def test_a_disk_entry_names_its_digest_and_one_without_is_sha256_blocks():
    assert protocol.disk_digest({**DISKS["root"], "digest": protocol.BLOCK_BLAKE3}) == protocol.BLOCK_BLAKE3
    assert protocol.disk_digest(DISKS["root"]) == protocol.BLOCK_SHA256
    assert protocol.MOVE_DIGEST != protocol.BLOCK_SHA256  # senders name theirs; the fallback is the older one
