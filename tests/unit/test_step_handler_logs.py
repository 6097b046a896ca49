"""A step's log lines carry what a person following one request needs to find them all."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ferry import handlers
from ferry.observability import logger

CONTEXT = SimpleNamespace(function_name="ferry-test-step", memory_limit_in_mb=128, aws_request_id="lambda-req-1",
                          invoked_function_arn="arn:aws:lambda:us-east-1:123456789012:function:ferry-test-step")


def keys_during(event: dict[str, Any]) -> dict[str, Any]:
    """The logger's keys while the step runs (what each of its lines carries; keys without a value are left out)."""
    step = handlers.step_handler(lambda _event: {k: v for k, v in logger.get_current_keys().items() if v is not None},
                                 "PrepResizeAtDest")
    return step(event, CONTEXT)


def test_a_steps_lines_carry_the_request_id_and_the_moves_migration():
    keys = keys_during({"instance_uuid": "i-1", "request_id": "req-6f0c", "migration_uuid": "m-1",
                        "execution_name": "resize-i-1-m"})

    assert keys["request_id"] == "req-6f0c"
    assert keys["migration_uuid"] == "m-1"
    assert (keys["step"], keys["instance_uuid"], keys["execution"]) == ("PrepResizeAtDest", "i-1", "resize-i-1-m")


def test_a_step_without_a_migration_logs_none_and_the_next_invocation_keeps_nothing_of_the_last():
    keys_during({"instance_uuid": "i-1", "request_id": "req-1", "migration_uuid": "m-1"})

    keys = keys_during({"instance_uuid": "i-2", "request_id": "req-2"})

    assert keys["request_id"] == "req-2" and "migration_uuid" not in keys
