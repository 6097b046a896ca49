"""The compiled JSON Schema checks of step inputs, host messages and drain requests (ferry.validation)."""

from __future__ import annotations

import pytest

from ferry import validation

SCHEMA = {
    "type": "object",
    "required": ["host"],
    "additionalProperties": False,
    "properties": {
        "host": {"type": "string", "minLength": 1},
        "servers": {"type": "array", "items": {"type": "string", "pattern": "^[0-9a-f-]{36}$"}},
        "target": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        "email": {"type": "string", "format": "email"},
    },
}


def test_a_matching_document_passes():
    validation.check({"host": "compute1", "servers": ["0" * 36], "target": 3, "email": "not checked"}, SCHEMA)


@pytest.mark.parametrize(("document", "path", "keyword", "says"), [
    ({}, (), "required", '"host" is a required property'),
    ({"host": ""}, ("host",), "minLength", "shorter than 1 character"),
    ({"host": 7}, ("host",), "type", 'is not of type "string"'),
    ({"host": "a", "servers": ["ok", "x" * 36]}, ("servers", 0), "pattern", "does not match"),
    ({"host": "a", "target": 1.5}, ("target",), "oneOf", "not valid under any"),
    ({"host": "a", "other": 1}, (), "additionalProperties", "other"),
    ([], (), "type", 'is not of type "object"'),
])
def test_a_mismatch_says_what_where_and_which_keyword(document, path, keyword, says):
    with pytest.raises(validation.SchemaMismatch) as raised:
        validation.check(document, SCHEMA)

    assert (raised.value.path, raised.value.keyword) == (path, keyword)
    assert says in raised.value.message
    assert raised.value.instance == _at(document, path)
    assert raised.value.where(".") == ".".join(str(part) for part in path)


def _at(document, path):
    for part in path:
        document = document[part]
    return document


def test_the_cache_of_compiled_schemas_is_bounded():
    for size in range(2 * validation.CACHE_SIZE):
        validation.check("x" * size, {"type": "string", "maxLength": size})

    assert len(validation._validators) <= validation.CACHE_SIZE


def test_of_several_errors_the_one_nearest_the_top_is_told_a_missing_property_first():
    with pytest.raises(validation.SchemaMismatch) as raised:
        validation.check({"servers": [1], "extra": True}, SCHEMA)

    assert (raised.value.keyword, raised.value.path) == ("required", ())


def test_a_schema_is_compiled_once_and_a_new_dict_gets_its_own_validator():
    validation.check({"host": "a"}, SCHEMA)
    compiled = validation._validators[id(SCHEMA)][1]
    validation.check({"host": "b"}, SCHEMA)
    assert validation._validators[id(SCHEMA)][1] is compiled

    stricter = {**SCHEMA, "required": ["host", "servers"]}
    with pytest.raises(validation.SchemaMismatch, match="servers"):
        validation.check({"host": "a"}, stricter)
