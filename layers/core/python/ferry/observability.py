"""Structured logs and metrics (Powertools Logger and Metrics, EMF) shared by handlers and the agent."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from aws_lambda_powertools import Logger, Metrics
from aws_lambda_powertools.metrics import MetricUnit

# The variable naming the metrics' namespace (the stack's MetricsNamespace), and its default.
NAMESPACE_VARIABLE = "POWERTOOLS_METRICS_NAMESPACE"
DEFAULT_NAMESPACE = "Ferry"
os.environ.setdefault(NAMESPACE_VARIABLE, DEFAULT_NAMESPACE)

logger = Logger(service=os.environ.get("POWERTOOLS_SERVICE_NAME", "ferry"))
metrics = Metrics(namespace=os.environ[NAMESPACE_VARIABLE])

# Some invocations publish no metric (the auto-confirm sweep when no resize is due; the host-report
# consumer, which records state and counts nothing), and Powertools warns at each such flush;
# the filter is the one its documentation gives where that is expected.
warnings.filterwarnings("ignore", message="No application metrics to publish*")


@contextmanager
def timed_step(step: str) -> Iterator[None]:
    """Record ``StepDuration`` (ms) and, on an exception, ``StepFailed`` for ``step``."""
    started = time.monotonic()
    try:
        yield
    except Exception as exc:
        metrics.add_metric(name="StepFailed", unit=MetricUnit.Count, value=1)
        logger.warning("step failed", extra={"step": step, "error": type(exc).__name__})
        raise
    finally:
        metrics.add_metric(name="StepDuration", unit=MetricUnit.Milliseconds, value=(time.monotonic() - started) * 1000)
