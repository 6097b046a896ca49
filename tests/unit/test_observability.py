"""Handlers' metrics: an invocation that publishes nothing of its own is not a warning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HANDLERS = """
    from types import SimpleNamespace
    from aws_lambda_powertools.metrics import MetricUnit
    from ferry.observability import metrics

    context = SimpleNamespace(function_name="ferry-test", memory_limit_in_mb=128, aws_request_id="req-1",
                              invoked_function_arn="arn:aws:lambda:us-east-1:123456789012:function:ferry-test")

    @metrics.log_metrics
    def quiet(event, context):
        return "read"

    @metrics.log_metrics
    def counting(event, context):
        metrics.add_metric(name="Counted", unit=MetricUnit.Count, value=1)
        return "counted"

    assert quiet({}, context) == "read"
    assert counting({}, context) == "counted"
"""


def test_a_handler_without_metrics_logs_no_warning_and_one_with_metrics_publishes_them():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "layers" / "core" / "python"))
    env.pop("PYTHONWARNINGS", None)  # the interpreter's default filters: a UserWarning is shown
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(HANDLERS)], env=env, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "No application metrics" not in done.stderr
    assert '"Counted"' in done.stdout, "the other invocation's EMF line is printed"
