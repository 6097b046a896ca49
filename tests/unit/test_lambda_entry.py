"""Every Lambda handler freezes the heap its imports built, once, on its first invocation."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import ferry
from ferry import errors, handlers

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = SimpleNamespace(function_name="ferry-test-echo", memory_limit_in_mb=128, aws_request_id="req-1",
                          invoked_function_arn="arn:aws:lambda:us-east-1:123456789012:function:ferry-test-echo")


@pytest.fixture
def fresh_process(monkeypatch):
    frozen = []
    monkeypatch.setattr(handlers, "_heap_frozen", False)
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    return frozen


def test_the_first_invocation_freezes_the_heap_and_later_ones_do_not(fresh_process):
    calls = []

    @handlers.lambda_entry
    def handler(event, context):
        calls.append((event, len(fresh_process)))
        return event["n"] * 2

    assert fresh_process == []
    assert [handler({"n": n}, None) for n in (1, 2, 3)] == [2, 4, 6]
    assert calls == [({"n": 1}, 1), ({"n": 2}, 1), ({"n": 3}, 1)], "frozen before the first call runs, and once"
    assert handler.__name__ == "handler"


def test_a_step_handler_freezes_on_its_first_invocation(fresh_process):
    step = handlers.step_handler(lambda event: event["instance_uuid"], "Echo")

    with pytest.raises(errors.InvalidStepInput):
        step({"request_id": "r"}, CONTEXT)
    assert fresh_process == [True]
    assert step({"instance_uuid": "i", "request_id": "r"}, CONTEXT) == "i"
    assert fresh_process == [True]


@pytest.mark.parametrize("app", sorted(p.parent.name for p in (ROOT / "functions").glob("*/app.py")))
def test_every_function_goes_through_lambda_entry(app):
    source = (ROOT / "functions" / app / "app.py").read_text()
    assert "step_handler(" in source or "@lambda_entry\n" in source


def run_fresh(code: str, *, lambda_variable: bool, cwd: Path = ROOT) -> None:
    """Run ``code`` in a fresh interpreter, with or without Lambda's function-name variable."""
    env = {key: value for key, value in os.environ.items() if key != ferry.LAMBDA_VARIABLE}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "layers" / "core" / "python"), str(ROOT)])
    if lambda_variable:
        env[ferry.LAMBDA_VARIABLE] = "ferry-test"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_on_lambda_the_collector_waits_while_modules_load_and_runs_from_the_first_invocation():
    run_fresh("""
        import gc
        import ferry.handlers
        assert not gc.isenabled(), "paused while the function's modules load"
        handler = ferry.handlers.lambda_entry(lambda event, context: gc.isenabled())
        assert handler({}, None) is True, "running again when the first invocation starts"
        assert gc.get_freeze_count() > 10_000, "what the imports built is frozen"
        assert handler({}, None) is True
    """, lambda_variable=True)


def test_a_real_function_pauses_the_collector_until_its_first_invocation_even_a_refused_one():
    run_fresh("""
        import gc
        from types import SimpleNamespace
        import app
        from ferry.errors import InvalidStepInput
        assert not gc.isenabled()
        context = SimpleNamespace(function_name="ferry-test", memory_limit_in_mb=128, aws_request_id="req-1",
                                  invoked_function_arn="arn:aws:lambda:us-east-1:123456789012:function:ferry-test")
        try:
            app.handler({"request_id": "r"}, context)
        except InvalidStepInput:
            pass
        else:
            raise AssertionError("an event without instance_uuid is refused")
        assert gc.isenabled()
    """, lambda_variable=True, cwd=ROOT / "functions" / "mark_resized")


def test_elsewhere_the_collector_is_left_alone():
    run_fresh("""
        import gc
        import ferry.handlers
        assert gc.isenabled(), "outside Lambda the import changes nothing"
        ferry.handlers.lambda_entry(lambda event, context: None)({}, None)
        assert gc.isenabled()
    """, lambda_variable=False)
    run_fresh("""
        import gc
        gc.disable()
        import ferry.handlers
        ferry.handlers.lambda_entry(lambda event, context: None)({}, None)
        assert not gc.isenabled(), "a collector the process turned off stays off"
    """, lambda_variable=True)
