"""Error names are written once: in ferry.errors, and the state machines use only those."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ferry import errors
from ferry.errors import FerryError

ROOT = Path(__file__).resolve().parents[2]
ASL_FILES = sorted((ROOT / "statemachine").glob("*.asl.json"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _ferry_error_names(asl_file: Path) -> set[str]:
    """Every Ferry.* name a definition matches on (Retry/Catch ErrorEquals) or fails with (Fail.Error)."""
    # Placeholders may stand bare where a number goes; any number keeps the JSON valid.
    text = re.sub(r"\$\{[^}]*\}", "0", asl_file.read_text())
    names: set[str] = set()

    def collect(obj: dict) -> dict:
        names.update(obj.get("ErrorEquals", []))
        if obj.get("Type") == "Fail" and isinstance(obj.get("Error"), str):
            names.add(obj["Error"])
        return obj

    json.loads(text, object_hook=collect)
    return {name for name in names if name.startswith(errors.PREFIX)}


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


def test_definition_files_exist():
    assert ASL_FILES, "statemachine/ holds no *.asl.json"


@pytest.mark.parametrize("asl_file", ASL_FILES, ids=_rel)
def test_every_ferry_error_a_state_machine_names_is_defined(asl_file):
    assert _ferry_error_names(asl_file) - set(FerryError.registry) == set()


def test_every_ferry_error_is_named_with_the_ferry_prefix_and_registered():
    subclasses = _all_subclasses(FerryError)

    assert subclasses
    assert [cls.__name__ for cls in subclasses if not cls.__name__.startswith("Ferry.")] == []
    assert [cls.__name__ for cls in subclasses if FerryError.registry.get(cls.__name__) is not cls] == []


def test_every_ferry_error_is_defined_in_ferry_errors():
    import ferry.handlers
    import ferry.workflows  # noqa: F401  (import the modules that once defined their own)
    import hostagent.agent  # noqa: F401

    elsewhere = sorted(f"{cls.__module__}.{cls.__name__}" for cls in _all_subclasses(FerryError)
                       if cls.__module__ != errors.__name__ and cls.__module__.split(".")[0] in ("ferry", "hostagent"))
    assert elsewhere == []
