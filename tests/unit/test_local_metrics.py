"""The local stack keeps each thread's metrics apart, as Lambda keeps each environment's."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
from aws_lambda_powertools import Metrics
from aws_lambda_powertools.metrics import MetricUnit

from ferry.local.runtime import ThreadMetricsProvider


def _handler(metrics: Metrics, barrier: threading.Barrier):
    @metrics.log_metrics
    def handler(event, context):
        metrics.add_dimension(name="Step", value=event["step"])
        barrier.wait()  # both invocations hold their metrics at once
        metrics.add_metric(name="StepDuration", unit=MetricUnit.Milliseconds, value=event["ms"])
        barrier.wait()
        return event["step"]

    return handler


def _flushed(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith('{"_aws"')]


@pytest.mark.parametrize("isolated", [True, False])
def test_concurrent_invocations_flush_their_own_dimension_and_values(capsys, isolated):
    metrics = Metrics(namespace="FerryTest")
    metrics.clear_metrics()
    if isolated:
        metrics.provider = ThreadMetricsProvider("FerryTest", "ferry")
    barrier = threading.Barrier(2, timeout=10)
    handler = _handler(metrics, barrier)
    results = []
    threads = [threading.Thread(target=lambda e=e: results.append(handler(e, None)))
               for e in ({"step": "MarkResized", "ms": 5.0}, {"step": "PrepResizeAtDest", "ms": 7.0})]
    # A shared metric set has one Step: the second invocation's overwrites the first's, and Powertools says so.
    overwritten = (contextlib.nullcontext() if isolated else
                   pytest.warns(UserWarning, match="Dimension 'Step' has already been added"))
    with overwritten:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    lines = _flushed(capsys.readouterr().out)
    assert sorted(results) == ["MarkResized", "PrepResizeAtDest"]
    if isolated:
        assert sorted((line["Step"], line["StepDuration"]) for line in lines) == [
            ("MarkResized", [5.0]), ("PrepResizeAtDest", [7.0])]
    else:  # what one shared metric set does: the two invocations' figures land on one line, one Step
        assert any(sorted(line.get("StepDuration", [])) == [5.0, 7.0] for line in lines)


def test_the_provider_answers_for_the_calling_thread():
    provider = ThreadMetricsProvider("FerryTest", "ferry")
    provider.add_metric(name="A", unit=MetricUnit.Count, value=1)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(dict(provider.metric_set)))
    worker.start()
    worker.join()

    assert seen == [{}]
    assert list(provider.metric_set) == ["A"]
    assert provider.namespace == "FerryTest"


def test_the_lambda_patch_isolates_metrics_and_its_removal_shares_them_again():
    from ferry.local import runtime
    from ferry.observability import metrics

    shared = metrics.provider
    runtime.install_lambda_patch(runtime.FunctionRunner({}))
    try:
        assert isinstance(metrics.provider, ThreadMetricsProvider)
        runtime.install_lambda_patch(runtime.FunctionRunner({}))  # a second stack in the process
        assert isinstance(metrics.provider, ThreadMetricsProvider)
    finally:
        runtime.remove_lambda_patch()

    assert metrics.provider is shared
