"""JSON Schema checks of what Ferry receives.

Workflow step inputs, host agent messages and reports, drain requests, webhook bodies and the
compute API's request bodies are checked here, against the schemas their modules define. The
validators are jsonschema-rs's (compiled; Draft 2020-12 unless a schema names another
``$schema``; ``format`` is an annotation, not checked), built on a schema's first check and
kept for the life of the process. Every workflow step loads this module, so its cost is part
of every cold start: a few milliseconds, where the pure-Python ``jsonschema`` took about fifty.
``ferry.api.request`` words the API's errors as Nova does.
"""

from __future__ import annotations

import threading
from typing import Any

import jsonschema_rs

# The largest value the databases' integer columns hold (Nova's MAX_INT): a bound for every
# integer Ferry takes in and stores; and the smallest.
MAX_INT = 2**31 - 1
MIN_INT = -(2**31)


class SchemaMismatch(ValueError):
    """A document does not match its schema.

    Attributes:
        message: what is wrong, e.g. ``"host" is a required property``.
        path: where, as keys and indexes from the document's top (empty for the top itself).
        keyword: the schema keyword that failed (``required``, ``oneOf``, ``pattern``, …).
        instance: the part of the document at ``path``.
    """

    def __init__(self, message: str, path: tuple[str | int, ...], keyword: str, instance: Any = None) -> None:
        super().__init__(message)
        self.message, self.path, self.keyword, self.instance = message, path, keyword, instance

    def where(self, separator: str = "/") -> str:
        """The path joined with ``separator`` (empty for the document's top)."""
        return separator.join(str(part) for part in self.path)


_validators: dict[int, tuple[dict[str, Any], Any]] = {}
_lock = threading.Lock()
# Compiled validators kept at most; the API builds a few schemas per request, which must not pile up.
CACHE_SIZE = 256


def check(document: Any, schema: dict[str, Any]) -> None:
    """Return if ``document`` matches ``schema``.

    Raises:
        SchemaMismatch: it does not. Of several errors, the one nearest the document's top, and
            there a missing property before an unexpected one (what the sender most needs to hear).
    """
    validator = _validator(schema)
    if validator.is_valid(document):
        return
    error = min(validator.iter_errors(document),
                key=lambda e: (len(e.instance_path), _keyword(e) == "additionalProperties"))
    raise SchemaMismatch(error.message, tuple(error.instance_path), _keyword(error), error.instance)


def _keyword(error: jsonschema_rs.ValidationError) -> str:
    return next((str(part) for part in reversed(error.schema_path) if isinstance(part, str)), "")


def _validator(schema: dict[str, Any]) -> Any:
    """The compiled validator of ``schema``, kept by identity (most schemas are module constants)."""
    entry = _validators.get(id(schema))
    if entry is None or entry[0] is not schema:
        entry = (schema, jsonschema_rs.validator_for(schema, validate_formats=False))
        with _lock:
            if len(_validators) >= CACHE_SIZE:
                _validators.clear()
            _validators[id(schema)] = entry
    return entry[1]
