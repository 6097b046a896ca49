"""What a workflow step's handler loads: only what its steps use, so that cold starts stay short.

The steps of the move workflows read and write records; they do not accept API requests, so
they must not pull in the API's acceptance code (``ferry.compute.moves`` and with it the policy
engine and its YAML parser) nor the schema migrations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API_SIDE = ("ferry.compute.moves", "ferry.compute.api", "ferry.policy", "yaml", "alembic")
STEP_FUNCTIONS = ("mark_resized", "prep_resize_at_dest", "resize_instance_at_source", "finish_resize_at_dest",
                  "rollback_move", "prep_cross_cell_at_dest", "complete_move_across_cells", "finish_confirm",
                  "finish_revert", "finish_delete")


def loaded_modules(function: str) -> set[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "layers" / "core" / "python"))
    out = subprocess.run([sys.executable, "-c", "import json, sys, app; print(json.dumps(sorted(sys.modules)))"],
                         cwd=ROOT / "functions" / function, env=env, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("function", STEP_FUNCTIONS)
def test_a_move_step_does_not_load_the_api_side(function):
    loaded = loaded_modules(function)
    assert "ferry.handlers" in loaded  # the handler really was imported
    assert sorted(set(API_SIDE) & loaded) == []


@pytest.mark.parametrize("function", STEP_FUNCTIONS)
def test_a_move_step_loads_neither_jsonschema_nor_an_aws_client_to_start(function):
    """Step inputs are checked by the compiled validator; botocore loads with the first AWS call."""
    loaded = loaded_modules(function)
    assert "ferry.validation" in loaded
    assert sorted({"jsonschema", "botocore.session", "botocore.client"} & loaded) == []


def test_the_api_handler_does_load_the_api_side():
    loaded = loaded_modules("api")
    assert {"ferry.compute.moves", "ferry.policy", "ferry.validation"} <= loaded
    assert sorted({"jsonschema", "yaml", "botocore.client"} & loaded) == []


def test_the_drain_webhook_loads_neither_boto3_nor_an_aws_client_to_start():
    """Its delivery records go through botocore's client, loaded with the first request."""
    loaded = loaded_modules("drain_webhook")
    assert {"ferry.webhook", "ferry.deliveries", "ferry.drains"} <= loaded
    assert sorted({"boto3", "s3transfer", "botocore.session", "botocore.client", "jsonschema",
                   "aws_lambda_powertools.utilities.idempotency"} & loaded) == []


LAYER_REQUIREMENTS = ROOT / "layers" / "core" / "python" / "requirements.txt"
# Imported only when installed (botocore's CA bundle, urllib3's IDNA codec): not needed.
OPTIONAL = {"certifi", "idna"}
LOAD_EVERY_HANDLER = """
import importlib.util, json, pathlib, sys
for app in sorted(pathlib.Path("functions").glob("*/app.py")):
    spec = importlib.util.spec_from_file_location(f"handler_{app.parent.name}", app)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def _requirements(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and "==" in line:
            name, version = line.split("==")
            pins[name.split("[")[0].strip().lower().replace("_", "-")] = version.strip()
    return pins


def _with_dependencies(names: set[str], extras: dict[str, set[str]]) -> set[str]:
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    closure, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        for spec in needs:
            requirement = Requirement(spec)
            marker = requirement.marker
            wanted = marker is None or any(marker.evaluate({"extra": extra}) for extra in extras.get(name, {""}))
            if wanted:
                todo.append(requirement.name.lower().replace("_", "-"))
    return closure


def test_the_layer_pins_what_the_tests_run_on():
    locked = _requirements(ROOT / "requirements.lock")
    layer = _requirements(LAYER_REQUIREMENTS)
    assert layer, "layers/core/python/requirements.txt names no package"
    assert {name: version for name, version in layer.items() if locked.get(name) != version} == {}


def test_the_layer_provides_every_package_a_handler_imports():
    from importlib.metadata import packages_distributions

    env = dict(os.environ, PYTHONPATH=str(ROOT / "layers" / "core" / "python"))
    out = subprocess.run([sys.executable, "-c", LOAD_EVERY_HANDLER], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    top_levels = set(json.loads(out.stdout.strip().splitlines()[-1]))
    third_party = top_levels - set(sys.stdlib_module_names) - {"ferry", "__main__", "_distutils_hack"}
    owners = packages_distributions()
    imported = {owners[name][0].lower().replace("_", "-") for name in third_party if name in owners}
    extras = {"aws-lambda-powertools": {"tracer"}}
    provided = _with_dependencies(set(_requirements(LAYER_REQUIREMENTS)), extras)
    assert "sqlalchemy" in imported  # the handlers really were loaded
    assert ", ".join(sorted(imported - provided - OPTIONAL)) == ""
