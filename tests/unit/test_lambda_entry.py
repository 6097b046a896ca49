"""Every Lambda handler freezes the heap its imports built, once, on its first invocation."""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace

import pytest

from ferry import handlers

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

    with pytest.raises(handlers.InvalidStepInput):
        step({"request_id": "r"}, CONTEXT)
    assert fresh_process == [True]
    assert step({"instance_uuid": "i", "request_id": "r"}, CONTEXT) == "i"
    assert fresh_process == [True]


@pytest.mark.parametrize("app", sorted(p.parent.name for p in (ROOT / "functions").glob("*/app.py")))
def test_every_function_goes_through_lambda_entry(app):
    source = (ROOT / "functions" / app / "app.py").read_text()
    assert "step_handler(" in source or "@lambda_entry\n" in source
