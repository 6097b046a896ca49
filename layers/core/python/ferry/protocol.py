"""The host agent protocol: what a workflow sends to a host's queue and what hosts report.

A state machine sends an operation message with
``arn:aws:states:::sqs:sendMessage.waitForTaskToken``; the agent answers the task token with
SendTaskSuccess (the operation's JSON result) or SendTaskFailure (a ``Ferry.*`` error name
from :mod:`ferry.errors`). Agents send inventory and heartbeat reports to the host reports
queue, which the ``ReportHostState`` function consumes: agents never touch the database.
"""

from __future__ import annotations

import hashlib
import os
import re
import string
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from ferry import validation

# Disk and volume sizes travel in whole GiB (``size_gb``, a flavor's ``root_gb``).
GiB = 2**30

# Operations a host agent performs.
SPAWN = "spawn"
POWER_OFF = "power_off"
POWER_ON = "power_on"
DESTROY = "destroy"
# Same-cell resize and cold migrate (see docs/host-agent.md): where each runs is in its schema's title.
PREP_RESIZE = "prep_resize"
RESIZE_INSTANCE = "resize_instance"
FINISH_RESIZE = "finish_resize"
CONFIRM_RESIZE = "confirm_resize"
REVERT_RESIZE = "revert_resize"
FINISH_REVERT_RESIZE = "finish_revert_resize"
ATTACH_VOLUME = "attach_volume"
DETACH_VOLUME = "detach_volume"
# Cross-cell resize and cold migrate: the source snapshots its root disk, the destination spawns from it.
PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE = "prep_snapshot_based_resize_at_source"
OPERATIONS = (
    SPAWN,
    POWER_OFF,
    POWER_ON,
    DESTROY,
    PREP_RESIZE,
    RESIZE_INSTANCE,
    FINISH_RESIZE,
    CONFIRM_RESIZE,
    REVERT_RESIZE,
    FINISH_REVERT_RESIZE,
    ATTACH_VOLUME,
    DETACH_VOLUME,
    PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE,
)

# The local disks a move carries between hosts (swap is re-created, never copied).
MOVED_DISKS = ("root", "ephemeral")
# How a moved disk's digest is computed (its ``digest`` in ``disks``; see docs/host-agent.md): the
# digest of the digests of its 4 MiB blocks, by SHA-256 or by BLAKE3. Senders use MOVE_DIGEST; an
# entry without ``digest`` (from an agent older than BLAKE3 block digests) is BLOCK_SHA256.
BLOCK_SHA256 = "sha256-blocks"
BLOCK_BLAKE3 = "blake3-blocks"
MOVE_DIGEST = BLOCK_BLAKE3

# The names of a host's instance directories, as its inventory reports list them: ``<uuid>``, and
# ``<uuid>_resize`` / ``<uuid>_incoming`` while a move keeps or brings disks there.
INSTANCE_DIR_NAME = re.compile(
    r"^(?P<uuid>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(?P<kind>_resize|_incoming)?$")

# The directory, under the control plane's FERRY_STATE_DIR, where the compute API places the
# volume files it makes (``<state dir>/volumes/<id>``), and the name of an agent's default volumes
# directories (``hostagent.agent.default_volumes_dirs``).
VOLUMES_DIR = "volumes"

# Written beside every file-backed volume Ferry makes (by a host's spawn, or ``ferry volume
# register --new-file-in``): where it is seen, the volumes' storage is there (mounted), so a
# volume file missing beside it is gone rather than out of sight.
VOLUME_DIR_MARKER = ".ferry-volumes"


def mark_volume_dir(directory: str | os.PathLike[str]) -> None:
    """Mark ``directory`` as holding file-backed volumes (:data:`VOLUME_DIR_MARKER`; idempotent)."""
    (Path(directory) / VOLUME_DIR_MARKER).touch(exist_ok=True)


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

PORTS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["id", "mac_address"],
        "properties": {"id": {"type": "string"}, "mac_address": {"type": "string"}},
    },
}

VOLUME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["volume_id", "path", "device"],
    "properties": {
        "volume_id": {"type": "string", "minLength": 1},
        "path": {"type": "string", "minLength": 1},
        "device": {"type": "string", "minLength": 1},
        "boot_index": {"type": ["integer", "null"]},
    },
}

VOLUMES_SCHEMA: dict[str, Any] = {"type": "array", "items": VOLUME_SCHEMA}

# An image's digest as Ferry records it (lower-case hex, ``hashlib``'s ``hexdigest``). A host names
# the image's file in its image cache after it: nothing else (``..``, ``/``) may reach a path.
IMAGE_DIGEST_SCHEMA: dict[str, Any] = {"type": "string", "pattern": "^[0-9a-f]{64}$"}

# Where a spawn finds an image: ``ferry.images.image_location``.
IMAGE_LOCATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "bucket", "key", "sha256"],
    "properties": {
        "id": {"type": "string"},
        "bucket": {"type": "string"},
        "key": {"type": "string"},
        "sha256": IMAGE_DIGEST_SCHEMA,
        # False for an image that is deleted once the spawn is done (a cross-cell move's
        # snapshot): the host then writes it into the instance only, never into its image cache.
        "cache": {"type": "boolean"},
    },
}

SPAWN_ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "flavor", "image", "ports", "volumes", "power_on"],
    "properties": {
        "name": {"type": "string"},
        "flavor": FLAVOR_SCHEMA,
        "image": {**IMAGE_LOCATION_SCHEMA, "type": ["object", "null"]},
        "ports": PORTS_SCHEMA,
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
                    # Where the volume comes from (its block device mapping's): the build creates a
                    # ``blank`` or ``image`` one; any other exists already, and its file is never made
                    # anew. Missing in an older message, which gave every volume its ``size_gb``.
                    "source_type": {"enum": ["blank", "image", "volume", "snapshot"]},
                    # A new file-backed volume the host makes (when its path does not exist yet), of
                    # this size, holding ``source_image`` if it has one: given only for a volume the
                    # build creates.
                    "size_gb": {"type": "integer", "minimum": 1},
                    "source_image": IMAGE_LOCATION_SCHEMA,
                },
            },
        },
        "power_on": {"type": "boolean"},
    },
}

POWER_OFF_ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "timeout": {"type": "number", "minimum": 0},
        "clean_shutdown": {"type": "boolean"},
    },
}

POWER_ON_ARGS_SCHEMA: dict[str, Any] = {"type": "object"}

# ``volumes``: the volumes deleted with the server (``delete_on_termination``); their files go too.
DESTROY_ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "keep_disks": {"type": "boolean"},
        "volumes": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["volume_id", "path"],
                "properties": {"volume_id": {"type": "string", "minLength": 1},
                               "path": {"type": "string", "minLength": 1}},
            },
        },
    },
}

# Where a move's disks wait between the source and the destination: ``s3://<bucket>/<prefix>/<kind>``.
TRANSFER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["bucket", "prefix"],
    "properties": {
        "bucket": {"type": "string", "minLength": 1},
        "prefix": {"type": "string", "minLength": 1, "pattern": "[^/]"},
    },
}

# The destination's offer, in prep_resize's result: the source may copy the disks straight into
# ``<instances_dir>/<uuid>_incoming/`` if it reads ``token`` in the destination's host marker there.
DIRECT_OFFER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["instances_dir", "token"],
    "properties": {
        "instances_dir": {"type": "string", "minLength": 1},
        "token": {"type": "string", "minLength": 1},
    },
}

DISK_CHECKSUM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["sha256", "size"],
    "properties": {
        # The hex digest by the ``digest`` algorithm (the key keeps the name it had when SHA-256 was the only one).
        "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "size": {"type": "integer", "minimum": 0},
        "digest": {"enum": [BLOCK_SHA256, BLOCK_BLAKE3]},
    },
}

# What resize_instance reports of the disks it sent, and finish_resize checks: one entry per disk that exists.
MOVED_DISKS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {kind: DISK_CHECKSUM_SCHEMA for kind in MOVED_DISKS},
    "additionalProperties": False,
}

_MIGRATION_UUID: dict[str, Any] = {"type": "string", "minLength": 1}

# A transfer is needed unless the move stays on one host.
_TRANSFER_UNLESS_SAME_HOST: dict[str, Any] = {
    "if": {"properties": {"same_host": {"const": False}}},
    "then": {"required": ["transfer"]},
}

PREP_RESIZE_ARGS_SCHEMA: dict[str, Any] = {
    "title": "prep_resize, at the destination",
    "type": "object",
    "required": ["migration_uuid", "flavor", "same_host"],
    "properties": {
        "migration_uuid": _MIGRATION_UUID,
        "flavor": FLAVOR_SCHEMA,
        "same_host": {"type": "boolean"},
        # Volume-backed: the claim counts no root disk. Absent (a workflow older than it) is false.
        "is_bfv": {"type": "boolean", "default": False},
    },
}

RESIZE_INSTANCE_ARGS_SCHEMA: dict[str, Any] = {
    "title": "resize_instance, at the source",
    "type": "object",
    "required": ["migration_uuid", "dest_host", "same_host"],
    "properties": {
        "migration_uuid": _MIGRATION_UUID,
        "dest_host": {"type": "string", "minLength": 1},
        "same_host": {"type": "boolean"},
        "transfer": TRANSFER_SCHEMA,
        "direct": DIRECT_OFFER_SCHEMA,
        "clean_shutdown": {"type": "boolean"},
        "timeout": {"type": "number", "minimum": 0},
    },
    **_TRANSFER_UNLESS_SAME_HOST,
}

FINISH_RESIZE_ARGS_SCHEMA: dict[str, Any] = {
    "title": "finish_resize, at the destination",
    "type": "object",
    "required": [
        "migration_uuid",
        "name",
        "flavor",
        "old_flavor",
        "same_host",
        "disks",
        "ports",
        "volumes",
        "power_on",
    ],
    "properties": {
        "migration_uuid": _MIGRATION_UUID,
        "name": {"type": "string"},
        "flavor": FLAVOR_SCHEMA,
        "old_flavor": FLAVOR_SCHEMA,
        "same_host": {"type": "boolean"},
        "transfer": TRANSFER_SCHEMA,
        # The source copied the disks into this host's ``<uuid>_incoming/`` rather than the transfer.
        "direct": {"type": "boolean"},
        "disks": MOVED_DISKS_SCHEMA,
        "ports": PORTS_SCHEMA,
        "volumes": VOLUMES_SCHEMA,
        "power_on": {"type": "boolean"},
    },
    **_TRANSFER_UNLESS_SAME_HOST,
}

CONFIRM_RESIZE_ARGS_SCHEMA: dict[str, Any] = {
    "title": "confirm_resize, at the source",
    "type": "object",
    "required": ["migration_uuid", "same_host"],
    "properties": {"migration_uuid": _MIGRATION_UUID, "same_host": {"type": "boolean"}},
}

REVERT_RESIZE_ARGS_SCHEMA: dict[str, Any] = {
    "title": "revert_resize, at the destination",
    "type": "object",
    "required": ["migration_uuid", "same_host"],
    "properties": {
        "migration_uuid": _MIGRATION_UUID,
        "same_host": {"type": "boolean"},
        "transfer": TRANSFER_SCHEMA,
    },
    **_TRANSFER_UNLESS_SAME_HOST,
}

FINISH_REVERT_RESIZE_ARGS_SCHEMA: dict[str, Any] = {
    "title": "finish_revert_resize, at the source",
    "type": "object",
    "required": ["migration_uuid", "name", "flavor", "ports", "volumes", "power_on"],
    "properties": {
        "migration_uuid": _MIGRATION_UUID,
        "name": {"type": "string"},
        "flavor": FLAVOR_SCHEMA,
        "ports": PORTS_SCHEMA,
        "volumes": VOLUMES_SCHEMA,
        "power_on": {"type": "boolean"},
    },
}

ATTACH_VOLUME_ARGS_SCHEMA: dict[str, Any] = {
    "title": "attach_volume, on the instance's host",
    "type": "object",
    "required": ["volume"],
    "properties": {"volume": VOLUME_SCHEMA},
}

DETACH_VOLUME_ARGS_SCHEMA: dict[str, Any] = {
    "title": "detach_volume, on the instance's host",
    "type": "object",
    "required": ["volume_id"],
    "properties": {"volume_id": {"type": "string", "minLength": 1}},
}

PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE_ARGS_SCHEMA: dict[str, Any] = {
    "title": "prep_snapshot_based_resize_at_source, at the source of a cross-cell move",
    "type": "object",
    "required": ["migration_uuid", "snapshot"],
    "properties": {
        "migration_uuid": _MIGRATION_UUID,
        # null for a volume-backed server: it has no root disk here to snapshot.
        "snapshot": {
            "type": ["object", "null"],
            "required": ["bucket", "key", "data_prefix", "image_id", "name"],
            "properties": {
                "bucket": {"type": "string", "minLength": 1},
                "key": {"type": "string", "minLength": 1},
                # where the image's data extents go (images.data_prefix): only written blocks travel
                "data_prefix": {"type": "string", "minLength": 1},
                "image_id": {"type": "string", "minLength": 1},
                "name": {"type": "string"},
                # the server's project: only it (and admins) may see or boot the image
                "owner": {"type": "string", "minLength": 1},
            },
        },
        "clean_shutdown": {"type": "boolean"},
        "timeout": {"type": "number", "minimum": 0},
    },
}

# What prep_snapshot_based_resize_at_source reports of the snapshot it made (null when volume-backed).
SNAPSHOT_RESULT_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "required": ["image_id", "sha256", "size"],
    "properties": {
        "image_id": {"type": "string", "minLength": 1},
        "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "size": {"type": "integer", "minimum": 0},
        "data_bytes": {"type": "integer", "minimum": 0},
    },
}

# The arguments of each operation.
ARGS_SCHEMAS: dict[str, dict[str, Any]] = {
    SPAWN: SPAWN_ARGS_SCHEMA,
    POWER_OFF: POWER_OFF_ARGS_SCHEMA,
    POWER_ON: POWER_ON_ARGS_SCHEMA,
    DESTROY: DESTROY_ARGS_SCHEMA,
    PREP_RESIZE: PREP_RESIZE_ARGS_SCHEMA,
    RESIZE_INSTANCE: RESIZE_INSTANCE_ARGS_SCHEMA,
    FINISH_RESIZE: FINISH_RESIZE_ARGS_SCHEMA,
    CONFIRM_RESIZE: CONFIRM_RESIZE_ARGS_SCHEMA,
    REVERT_RESIZE: REVERT_RESIZE_ARGS_SCHEMA,
    FINISH_REVERT_RESIZE: FINISH_REVERT_RESIZE_ARGS_SCHEMA,
    ATTACH_VOLUME: ATTACH_VOLUME_ARGS_SCHEMA,
    DETACH_VOLUME: DETACH_VOLUME_ARGS_SCHEMA,
    PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE: PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE_ARGS_SCHEMA,
}

# Every result (the SendTaskSuccess output) has this shape; power_state is that of the instance's
# guest on the answering host after the operation, 0 (NOSTATE) when the host has no guest for it.
RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["instance_uuid", "host", "node", "power_state"],
    "properties": {
        "instance_uuid": {"type": "string"},
        "host": {"type": "string"},
        "node": {"type": "string"},
        "power_state": {"type": "integer", "minimum": 0},
    },
}


def _result_with(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    return {
        **RESULT_SCHEMA,
        "required": RESULT_SCHEMA["required"] + required,
        "properties": {**RESULT_SCHEMA["properties"], **properties},
    }


# Results with more than the common keys.
RESULT_SCHEMAS: dict[str, dict[str, Any]] = {
    PREP_RESIZE: _result_with(["claimed"], {"claimed": {"const": True}, "direct": DIRECT_OFFER_SCHEMA}),
    RESIZE_INSTANCE: _result_with(
        ["was_running", "disks"],
        {"was_running": {"type": "boolean"}, "disks": MOVED_DISKS_SCHEMA, "direct": {"type": "boolean"}},
    ),
    FINISH_RESIZE: _result_with(["disks"], {"disks": MOVED_DISKS_SCHEMA}),
    DESTROY: _result_with([], {"volumes_removed": {"type": "array", "items": {"type": "string"}}}),
    PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE: _result_with(
        ["was_running", "snapshot"], {"was_running": {"type": "boolean"}, "snapshot": SNAPSHOT_RESULT_SCHEMA}
    ),
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
        # Directories under the agent's instances directory (``<uuid>``, ``<uuid>_resize``), the image cache left out.
        "instance_dirs": {"type": "array", "items": {"type": "string"}},
    },
}


def validate(document: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise :class:`ferry.validation.SchemaMismatch` unless ``document`` matches ``schema``."""
    validation.check(document, schema)


def disk_digest(entry: dict[str, Any]) -> str:
    """How a ``disks`` entry's digest was computed: its ``digest``, or BLOCK_SHA256 when it names none."""
    return str(entry.get("digest", BLOCK_SHA256))


# SQS queue names: letters, digits, ``-`` and ``_``, at most 80 characters.
_QUEUE_NAME_MAX = 80
# A host queue's dead-letter queue is named after it with this suffix.
DLQ_SUFFIX = "-dlq"
# The host name whose queue, ``<HostQueuePrefix>reports``, is the stack's host reports queue
# (template.yaml's HostReportsQueue): no agent serves it.
REPORTS_HOST = "reports"
# What a host name may hold: labels of letters, digits, ``-`` and ``_`` (as hosts are named in
# practice), separated by dots.
_HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*")


def is_host_name(host: str) -> bool:
    """Whether ``host`` is a host name an agent may serve: letters, digits, ``-`` and ``_`` in
    labels separated by dots, at most 253 characters, and not ending like a dead-letter queue
    (its queue would be another queue's dead letters)."""
    return len(host) <= 253 and _HOST_NAME.fullmatch(host) is not None and not host.endswith(DLQ_SUFFIX)


def host_queue_name(prefix: str, host: str) -> str:
    """The SQS queue name of a host's agent: ``<prefix><host>`` when SQS takes that as it is
    (letters, digits, ``-`` and ``_``, room left for the dead-letter suffix). A host name with
    dots (a fully qualified one) or too long is written with its dots as ``_``, cut to fit and
    ended with a digest of the whole host name, so that every host keeps a queue of its own."""
    name = prefix + host
    room = _QUEUE_NAME_MAX - len(DLQ_SUFFIX)
    if "." in host or len(name) > room:
        digest = hashlib.blake2b(host.encode(), digest_size=6).hexdigest()
        name = f"{(prefix + host.replace('.', '_'))[:room - len(digest) - 1]}-{digest}"
    return name


def host_queue_tag(prefix: str, host: str) -> str:
    """What a host's queue name holds after the prefix: the ``ferry-host`` principal tag that
    confines the host's AWS identity to its own queues (the template's HostAgentOwnQueuePolicy)."""
    return host_queue_name(prefix, host)[len(prefix):]


# --- image names in object metadata -------------------------------------------------------------

# S3 keeps at most 2 KB of an object's metadata: an image's name, percent-encoded, takes at most
# this much of it, the rest of the image's metadata about 400 bytes.
IMAGE_NAME_BYTES = 1024
# The last characters of a name too long for that, always kept (a move's snapshot ends
# ``-resize-temp``, which ``ferry audit`` looks for).
_NAME_TAIL = 32
_ELLIPSIS = quote("\u2026", safe="")


def image_metadata_name(name: str, limit: int = IMAGE_NAME_BYTES) -> str:
    """``name`` percent-encoded, as an image object's metadata holds it (``ferry.images`` decodes
    it), in at most ``limit`` bytes: a longer one keeps its beginning and its last characters
    around an ellipsis (``…``), cut between characters, never inside one's encoding. Written by
    the compute API's image uploads and by the host agents' snapshots."""
    encoded = quote(name, safe="")
    if len(encoded) <= limit:
        return encoded
    tail = quote(name[-_NAME_TAIL:], safe="")
    used = len(tail) + len(_ELLIPSIS)
    head: list[str] = []
    for char in name:
        piece = quote(char, safe="")
        if used + len(piece) > limit:
            break
        head.append(piece)
        used += len(piece)
    return "".join(head) + _ELLIPSIS + tail


# --- image owners in object metadata -------------------------------------------------------------

# An owner written so is percent-encoded: a project id may hold any printable character, and S3
# metadata is ASCII. The printable ASCII ones but ``%`` stay as they are (a hex id is unchanged).
_OWNER_ENCODED = {"owner-encoding": "percent"}
_OWNER_SAFE = "".join(c for c in string.printable if c not in string.whitespace and c != "%")


def image_metadata_owner(owner: str | None) -> dict[str, str]:
    """The metadata that names an image's owner (a project id), none without one. Written by the
    compute API's image uploads and by the host agents' snapshots; read by :func:`image_owner`."""
    return {"owner": quote(owner, safe=_OWNER_SAFE), **_OWNER_ENCODED} if owner else {}


def image_owner(metadata: dict[str, str]) -> str | None:
    """The project that owns the image whose object ``metadata`` this is, or None. An owner
    written before owners were encoded is taken as it is."""
    owner = metadata.get("owner")
    if not owner:
        return None
    return unquote(owner) if metadata.get("owner-encoding") == _OWNER_ENCODED["owner-encoding"] else owner
