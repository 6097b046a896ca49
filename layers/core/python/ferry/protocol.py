"""The host agent protocol: what a workflow sends to a host's queue and what hosts report.

A state machine sends an operation message with
``arn:aws:states:::sqs:sendMessage.waitForTaskToken``; the agent answers the task token with
SendTaskSuccess (the operation's JSON result) or SendTaskFailure (a ``Ferry.*`` error name
from :mod:`ferry.errors`). Agents send inventory and heartbeat reports to the host reports
queue, which the ``ReportHostState`` function consumes: agents never touch the database.
"""

from __future__ import annotations

from typing import Any

import jsonschema

# Operations a host agent performs.
SPAWN = "spawn"
POWER_OFF = "power_off"
POWER_ON = "power_on"
DESTROY = "destroy"
OPERATIONS = (SPAWN, POWER_OFF, POWER_ON, DESTROY)

# Kinds of report an agent sends.
REPORT_INVENTORY = "inventory"
REPORT_HEARTBEAT = "heartbeat"

FLAVOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["flavorid", "name", "vcpus", "memory_mb", "root_gb", "ephemeral_gb", "swap"],
    "properties": {
        "flavorid": {"type": "string"},
        "name": {"type": "string"},
        "vcpus": {"type": "integer", "minimum": 1},
        "memory_mb": {"type": "integer", "minimum": 1},
        "root_gb": {"type": "integer", "minimum": 0},
        "ephemeral_gb": {"type": "integer", "minimum": 0},
        "swap": {"type": "integer", "minimum": 0},
    },
}

OPERATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["operation", "operation_id", "instance_uuid", "args"],
    "properties": {
        "operation": {"enum": list(OPERATIONS)},
        "operation_id": {"type": "string", "minLength": 1},
        "instance_uuid": {"type": "string", "minLength": 1},
        "args": {"type": "object"},
        "task_token": {"type": ["string", "null"]},
    },
}

SPAWN_ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "flavor", "image", "ports", "volumes", "power_on"],
    "properties": {
        "name": {"type": "string"},
        "flavor": FLAVOR_SCHEMA,
        "image": {
            "type": ["object", "null"],
            "required": ["id", "bucket", "key", "sha256"],
            "properties": {
                "id": {"type": "string"},
                "bucket": {"type": "string"},
                "key": {"type": "string"},
                "sha256": {"type": "string"},
            },
        },
        "ports": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "mac_address"],
                "properties": {"id": {"type": "string"}, "mac_address": {"type": "string"}},
            },
        },
        "volumes": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["volume_id", "path", "device"],
                "properties": {
                    "volume_id": {"type": "string"},
                    "path": {"type": "string"},
                    "device": {"type": "string"},
                    "boot_index": {"type": ["integer", "null"]},
                },
            },
        },
        "power_on": {"type": "boolean"},
    },
}

REPORT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["kind", "host", "sent_at"],
    "properties": {
        "kind": {"enum": [REPORT_INVENTORY, REPORT_HEARTBEAT]},
        "host": {"type": "string", "minLength": 1},
        "node": {"type": "string"},
        "cell": {"type": "string"},
        "sent_at": {"type": "string"},
        "inventory": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["total"],
                "properties": {
                    "total": {"type": "integer", "minimum": 0},
                    "reserved": {"type": "integer", "minimum": 0},
                },
            },
        },
        "guests": {"type": "array", "items": {"type": "string"}},
    },
}


def validate(document: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``document`` matches ``schema``."""
    jsonschema.validate(document, schema)


def host_queue_name(prefix: str, host: str) -> str:
    """The SQS queue name of a host's agent (``<prefix><host>``)."""
    return f"{prefix}{host}"
