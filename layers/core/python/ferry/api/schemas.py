"""JSON schemas of the request bodies (Nova's, strict where Nova is strict)."""

from __future__ import annotations

import copy
import unicodedata
from collections.abc import Iterable
from typing import Any

from ferry import auth
from ferry.api.microversions import APIVersion
from ferry.compute import states
from ferry.validation import MAX_INT

UUID_PATTERN = "^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"
UUID = {"type": "string", "pattern": UUID_PATTERN}
NAME = {"type": "string", "minLength": 1, "maxLength": 255}
# A server's or flavor's name: the pattern is the part of Nova's rule a JSON Schema pattern can say
# in every client's regex dialect (the OpenAPI document publishes it); is_printable_name says the rest.
PRINTABLE_NAME = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^(?! )[^\\x00-\\x1f]+(?<! )$"}
PRINTABLE_NAME_RULE = "printable characters. Can not start or end with whitespace."
PRINTABLE_TEXT_RULE = "Must be printable characters."
# A server's description (2.19).
SERVER_DESCRIPTION = {"type": ["string", "null"], "maxLength": 255}
# A server's hostname: one DNS label of letters, digits and hyphens, not at either end (2.90),
# or from 2.94 a fully qualified name (letters, digits, ``-``, ``.``, ``_``), as Nova takes them.
HOSTNAME_V290 = {"type": "string", "minLength": 2, "maxLength": 63,
                 "pattern": "^[a-zA-Z0-9]+[a-zA-Z0-9-]*[a-zA-Z0-9]+$"}
HOSTNAME_V294 = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[a-zA-Z0-9-._]*$"}


def server_hostname(version: APIVersion) -> dict[str, Any] | None:
    """The schema of a requested hostname at ``version`` (None below 2.90, where there is none)."""
    if version.at_least("2.94"):
        return HOSTNAME_V294
    return HOSTNAME_V290 if version.at_least("2.90") else None
DESCRIPTION = {"type": ["string", "null"], "maxLength": 65535}
# The largest value a single-precision database float column holds (Nova's SQL_SP_FLOAT_MAX):
# the bound of a flavor's rxtx_factor.
MAX_FLOAT = 3.40282e38
# A number or a string of digits; a string's bounds are checked where it is read (request.bounded_int).
POSITIVE_INT = {"type": ["integer", "string"], "pattern": "^[0-9]+$", "minimum": 1, "maximum": MAX_INT}
NON_NEGATIVE_INT = {"type": ["integer", "string"], "pattern": "^[0-9]+$", "minimum": 0, "maximum": MAX_INT}
BOOLEAN = {"type": ["boolean", "string"],
           "enum": [True, False, "True", "False", "true", "false", "1", "0", "yes", "no", "on", "off"]}
TAG = {"type": "string", "minLength": 1, "maxLength": 60, "pattern": "^[^,/]*$"}
METADATA = {"type": "object", "patternProperties": {"^.{1,255}$": {"type": "string", "maxLength": 255}},
            "additionalProperties": False}
HOST_NAME = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[a-zA-Z0-9-._]*$"}
HOST_HINT = {"oneOf": [UUID, {"type": "array", "items": UUID}]}

_NETWORK_ITEM = {
    "type": "object",
    "properties": {
        "uuid": UUID,
        "port": {"oneOf": [UUID, {"type": "null"}]},
        "fixed_ip": {"type": "string", "minLength": 1},
    },
    "additionalProperties": False,
    "anyOf": [{"required": ["uuid"]}, {"required": ["port"]}],
}

_BLOCK_DEVICE = {
    "type": "object",
    "properties": {
        "source_type": {"enum": ["image", "volume", "snapshot", "blank"]},
        "destination_type": {"enum": ["local", "volume"]},
        "uuid": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[a-zA-Z0-9._-]*$"},
        "boot_index": {"type": ["integer", "string", "null"], "pattern": "^-?[0-9]+$"},
        "volume_size": {"type": ["integer", "string", "null"], "pattern": "^[0-9]+$", "minimum": 1,
                        "maximum": MAX_INT},
        "delete_on_termination": BOOLEAN,
        "device_name": {"type": "string", "minLength": 1, "maxLength": 255},
        "device_type": {"type": "string", "maxLength": 255},
        "disk_bus": {"type": "string", "maxLength": 255},
        "guest_format": {"type": "string", "maxLength": 255},
        "no_device": {},
    },
    "required": ["source_type"],
    "additionalProperties": False,
}

_SERVER_BASE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": PRINTABLE_NAME,
        "imageRef": {"type": "string", "maxLength": 255},
        "flavorRef": {"type": ["string", "integer"], "minLength": 1},
        "networks": {"type": "array", "items": _NETWORK_ITEM},
        "metadata": METADATA,
        "key_name": NAME,
        "availability_zone": NAME,
        "block_device_mapping_v2": {"type": "array", "items": _BLOCK_DEVICE},
        "min_count": POSITIVE_INT,
        "max_count": POSITIVE_INT,
        "return_reservation_id": BOOLEAN,
        "security_groups": {"type": "array", "items": {
            "type": "object", "properties": {"name": NAME}, "additionalProperties": False}},
        "user_data": {"type": "string", "maxLength": 65535},
        "config_drive": BOOLEAN,
        "adminPass": {"type": "string"},
        "accessIPv4": {"type": "string"},
        "accessIPv6": {"type": "string"},
        "OS-DCF:diskConfig": {"enum": ["AUTO", "MANUAL"]},
    },
    "required": ["name", "flavorRef"],
    "additionalProperties": False,
}

_SCHEDULER_HINTS = {
    "type": "object",
    "properties": {"same_host": HOST_HINT, "different_host": HOST_HINT, "group": UUID},
    "additionalProperties": True,
}


def server_create(version: APIVersion) -> dict[str, Any]:
    """The body of ``POST /servers`` at ``version`` (networks required from 2.37, tags from 2.52,
    a block device's ``volume_type`` from 2.67, a requested ``host``/``hypervisor_hostname`` from
    2.74, ``hostname`` from 2.90).

    Device tags, as in Nova: a block device's ``tag`` at 2.32 and from 2.42, a network's at 2.32
    to 2.36 and from 2.42 (lost in between, and given back by 2.42).
    """
    server = copy.deepcopy(_SERVER_BASE)
    properties = server["properties"]
    tagged_from_2_42 = version.at_least("2.42")
    if tagged_from_2_42 or (version.at_least("2.32") and not version.at_least("2.33")):
        properties["block_device_mapping_v2"]["items"]["properties"]["tag"] = TAG
    if tagged_from_2_42 or (version.at_least("2.32") and not version.at_least("2.37")):
        properties["networks"]["items"]["properties"]["tag"] = TAG
    if version.at_least("2.19"):
        properties["description"] = SERVER_DESCRIPTION
    if version.at_least("2.37"):
        properties["networks"] = {"oneOf": [properties["networks"], {"enum": ["auto", "none"]}]}
        server["required"].append("networks")
    if version.at_least("2.52"):
        properties["tags"] = {"type": "array", "items": TAG, "maxItems": 50}
    if version.at_least("2.67"):
        properties["block_device_mapping_v2"]["items"]["properties"]["volume_type"] = {
            "type": ["string", "null"], "maxLength": 255}
    if version.at_least("2.74"):
        properties["host"] = properties["hypervisor_hostname"] = HOST_NAME
    hostname = server_hostname(version)
    if hostname is not None:
        properties["hostname"] = hostname
    return {
        "type": "object",
        "properties": {"server": server, "os:scheduler_hints": _SCHEDULER_HINTS,
                       "OS-SCH-HNT:scheduler_hints": _SCHEDULER_HINTS},
        "required": ["server"],
        "additionalProperties": False,
    }


SERVER_ACTION = {"type": "object", "minProperties": 1, "maxProperties": 1}
NULL_ACTION = {"type": "null"}
# A live migration's force_complete: exactly ``{"force_complete": null}``.
FORCE_COMPLETE_ACTION = {
    "type": "object",
    "properties": {"force_complete": NULL_ACTION},
    "required": ["force_complete"],
    "additionalProperties": False,
}
# os-resetState: exactly ``state``, one of the two vm_states an admin may set (Nova's choice).
RESET_STATE_ACTION = {
    "type": "object",
    "properties": {"state": {"type": "string", "enum": sorted(states.RESET_STATES)}},
    "required": ["state"],
    "additionalProperties": False,
}

# A flavor id given as a JSON number is taken as its text, as Nova takes it ("id": 42 is "42").
FLAVOR_ID = {"type": ["string", "number", "null"], "minLength": 1, "maxLength": 255,
             "pattern": "^(?! )[a-zA-Z0-9. _-]+(?<! )$"}


def flavor_create(version: APIVersion) -> dict[str, Any]:
    """The body of ``POST /flavors`` (description from 2.55)."""
    flavor: dict[str, Any] = {
        "type": "object",
        "properties": {
            "name": PRINTABLE_NAME,
            "id": FLAVOR_ID,
            "ram": POSITIVE_INT,
            "vcpus": POSITIVE_INT,
            "disk": NON_NEGATIVE_INT,
            "OS-FLV-EXT-DATA:ephemeral": NON_NEGATIVE_INT,
            "swap": {"type": ["integer", "string"], "pattern": "^[0-9]*$", "minimum": 0, "maximum": MAX_INT},
            "rxtx_factor": {"type": ["number", "string"], "pattern": "^[0-9]+(\\.[0-9]+)?$", "exclusiveMinimum": 0,
                            "maximum": MAX_FLOAT},
            "os-flavor-access:is_public": BOOLEAN,
        },
        "required": ["name", "ram", "vcpus", "disk"],
        "additionalProperties": False,
    }
    if version.at_least("2.55"):
        flavor["properties"]["description"] = DESCRIPTION
    return {"type": "object", "properties": {"flavor": flavor}, "required": ["flavor"], "additionalProperties": False}


FLAVOR_UPDATE = {
    "type": "object",
    "properties": {"flavor": {"type": "object", "properties": {"description": DESCRIPTION},
                              "required": ["description"], "additionalProperties": False}},
    "required": ["flavor"],
    "additionalProperties": False,
}

_SPEC_KEY = "^[a-zA-Z0-9-_:. ]{1,255}$"
# A string or a number, as Nova takes them: a boolean is refused.
_SPEC_VALUE = {"type": ["string", "number"], "maxLength": 255}

EXTRA_SPECS_CREATE = {
    "type": "object",
    "properties": {"extra_specs": {"type": "object", "patternProperties": {_SPEC_KEY: _SPEC_VALUE},
                                   "additionalProperties": False}},
    "required": ["extra_specs"],
    "additionalProperties": False,
}

EXTRA_SPEC_UPDATE = {
    "type": "object",
    "patternProperties": {_SPEC_KEY: _SPEC_VALUE},
    "minProperties": 1,
    "maxProperties": 1,
    "additionalProperties": False,
}


# --- moves ------------------------------------------------------------------------------------------

RESIZE_ACTION = {
    "type": "object",
    "properties": {
        "flavorRef": {"type": ["string", "integer"], "minLength": 1},
        "OS-DCF:diskConfig": {"enum": ["AUTO", "MANUAL"]},
    },
    "required": ["flavorRef"],
    "additionalProperties": False,
}

# Below 2.56 Nova does not look at the migrate body at all; from 2.56 it may name a host.
MIGRATE_ACTION_ANY: dict[str, Any] = {}
MIGRATE_ACTION_V256 = {
    "type": ["object", "null"],
    "properties": {"host": {"oneOf": [HOST_NAME, {"type": "null"}]}},
    "additionalProperties": False,
}


# --- quotas -----------------------------------------------------------------------------------------

# A project id as Ferry takes one (Keystone's ids, and the names Ferry's tokens use).
PROJECT_ID_PATTERN = f"^{auth.IDENTITY_ID.pattern}$"
_TENANT = {"type": "object", "properties": {"tenant": {"type": "string", "pattern": PROJECT_ID_PATTERN}},
           "required": ["tenant"], "additionalProperties": False}
FLAVOR_ACTION = {"oneOf": [{"type": "object", "properties": {name: _TENANT}, "required": [name],
                            "additionalProperties": False} for name in ("addTenantAccess", "removeTenantAccess")]}
QUOTA_LIMIT = {"type": ["integer", "string"], "pattern": "^-?[0-9]+$", "minimum": -1, "maximum": MAX_INT}


def quota_set_update(resources: Iterable[str]) -> dict[str, Any]:
    """The body of ``PUT /os-quota-sets/{project_id}`` for the resources of a microversion."""
    properties: dict[str, Any] = dict.fromkeys(resources, QUOTA_LIMIT)
    properties["force"] = BOOLEAN
    return {
        "type": "object",
        "properties": {"quota_set": {"type": "object", "properties": properties, "additionalProperties": False}},
        "required": ["quota_set"],
        "additionalProperties": False,
    }


def _printable(char: str) -> bool:
    """Nova's printable character: no control, format, private-use, surrogate or unassigned
    code point, of the separators only spaces, and (as Nova builds its ranges from the Basic
    Multilingual Plane only) nothing beyond U+FFFE: no emoji."""
    category = unicodedata.category(char)
    return ord(char) < 0xFFFF and category[0] != "C" and (category[0] != "Z" or category == "Zs")


def is_printable_name(name: str) -> bool:
    """Nova's rule for names: printable characters, and no whitespace at either end (a no-break
    space included)."""
    return bool(name) and not name[0].isspace() and not name[-1].isspace() and all(map(_printable, name))


def is_printable_text(text: str) -> bool:
    """Nova's rule for descriptions: printable characters (spaces anywhere, but no line breaks or tabs)."""
    return all(map(_printable, text))


def server_update(version: APIVersion) -> dict[str, Any]:
    """The body of ``PUT /servers/{id}`` at ``version``: a new name, from 2.19 a description, from
    2.90 a hostname (``accessIPv4``, ``accessIPv6`` and ``OS-DCF:diskConfig`` are taken, as on
    create, and kept nowhere)."""
    properties: dict[str, Any] = {"name": PRINTABLE_NAME, **{key: _SERVER_BASE["properties"][key] for key in (
        "accessIPv4", "accessIPv6", "OS-DCF:diskConfig")}}
    if version.at_least("2.19"):
        properties["description"] = SERVER_DESCRIPTION
    hostname = server_hostname(version)
    if hostname is not None:
        properties["hostname"] = hostname
    return {"type": "object",
            "properties": {"server": {"type": "object", "properties": properties, "additionalProperties": False}},
            "required": ["server"], "additionalProperties": False}
