"""The host agent's metrics reach CloudWatch (PutMetricData), batched, without ever holding up an operation.

The agent runs in a thread against moto, as in ``test_hostagent.py`` (whose fixtures these tests use);
the publisher alone is driven against moto's CloudWatch, made to fail through a recording client.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
import test_hostagent
from botocore.exceptions import ClientError, EndpointConnectionError
from moto_credentials import REGION
from test_hostagent import WAIT, Host, Recorder, failure, wait_for

from hostagent import metrics

# The agent and its cloud, as test_hostagent.py sets them up.
cloud = test_hostagent.cloud
host = test_hostagent.host

QUICK_FLUSHES = {"metrics_flush_interval": 0.1}


def throttled(_kwargs: dict[str, Any]) -> None:
    raise ClientError({"Error": {"Code": "Throttling", "Message": "Rate exceeded"}}, "PutMetricData")


def unreachable(_kwargs: dict[str, Any]) -> None:
    raise EndpointConnectionError(endpoint_url="https://monitoring.us-east-1.amazonaws.com/")


def published(cloudwatch: Any, name: str, dimensions: dict[str, str], stat: str = "Sum",
              namespace: str = metrics.DEFAULT_NAMESPACE) -> float | None:
    """``stat`` of the metric over the last minutes as CloudWatch has it; None when it has nothing."""
    now = datetime.now(UTC)
    answer = cloudwatch.get_metric_data(
        MetricDataQueries=[{
            "Id": "m",
            "MetricStat": {
                "Metric": {"Namespace": namespace, "MetricName": name,
                           "Dimensions": [{"Name": k, "Value": v} for k, v in dimensions.items()]},
                "Period": 3600,
                "Stat": stat,
            },
        }],
        StartTime=now - timedelta(minutes=30),
        EndTime=now + timedelta(minutes=30),
    )
    [result] = answer["MetricDataResults"]
    return sum(result["Values"]) if result["Values"] else None


def names_in(cloudwatch: Any, namespace: str = metrics.DEFAULT_NAMESPACE) -> set[str]:
    return {m["MetricName"] for m in cloudwatch.list_metrics(Namespace=namespace)["Metrics"]}


def logged(caplog: pytest.LogCaptureFixture, message: str) -> list[Any]:
    return [record for record in caplog.records if record.getMessage() == message]


@pytest.fixture
def cloudwatch(cloud) -> Recorder:
    """moto's CloudWatch, through a client that records the calls and can be made to fail."""
    return Recorder(boto3.client("cloudwatch", region_name=REGION))


def publisher(cloudwatch: Recorder, **options: Any) -> metrics.MetricsPublisher:
    return metrics.MetricsPublisher(cloudwatch, metrics.DEFAULT_NAMESPACE, **options)


# --- the agent -----------------------------------------------------------------------------------


@pytest.mark.parametrize("host", [QUICK_FLUSHES], indirect=True)
def test_a_failed_operation_is_counted_in_cloudwatch_by_host_and_operation(host: Host):
    assert failure(host.execute("power_on", str(uuid.uuid4()), {})) == "Ferry.GuestNotFound"

    where = {"Host": "compute1", "Operation": "power_on"}
    assert wait_for(lambda: published(host.cloudwatch, "HostOperationFailed", where), "HostOperationFailed") == 1
    assert published(host.cloudwatch, "HostOperationDuration", where, stat="SampleCount") == 1
    assert {"HostOperationFailed", "HostOperationDuration"} <= names_in(host.cloudwatch)
    [sent] = [d for call in host.cloudwatch.called("put_metric_data") for d in call["MetricData"]
              if d["MetricName"] == "HostOperationFailed"]
    assert sent["Unit"] == "Count"
    assert sorted((d["Name"], d["Value"]) for d in sent["Dimensions"]) == [("Host", "compute1"),
                                                                          ("Operation", "power_on")]


def test_an_operation_the_agent_does_not_know_is_counted_as_invalid(host: Host):
    # A malformed message's operation (any text) would be a dimension value CloudWatch may refuse,
    # and with it the whole batch: it is counted under "invalid"
    assert failure(host.execute("power_on\u00e9" * 200, str(uuid.uuid4()), {})) == "Ferry.InvalidOperation"

    where = {"Host": "compute1", "Operation": "invalid"}
    assert wait_for(lambda: published(host.cloudwatch, "HostOperationFailed", where), "HostOperationFailed") == 1


@pytest.mark.parametrize("host", [QUICK_FLUSHES], indirect=True)
def test_a_cloudwatch_error_never_fails_an_operation_and_its_metrics_are_sent_again(host: Host, caplog):
    # GIVEN CloudWatch throttles every PutMetricData
    host.cloudwatch.hooks["put_metric_data"] = throttled

    # WHEN an operation fails meanwhile, THEN it is answered with its own error
    assert failure(host.execute("power_on", str(uuid.uuid4()), {})) == "Ferry.GuestNotFound"
    wait_for(lambda: len(host.cloudwatch.called("put_metric_data")) >= 3, "metrics sent again")
    assert len(logged(caplog, "publishing metrics to CloudWatch failed: sent again at the next flush")) == 1
    assert published(host.cloudwatch, "HostOperationFailed", {"Host": "compute1", "Operation": "power_on"}) is None

    # AND once CloudWatch takes them again, the metrics arrive, counted once
    del host.cloudwatch.hooks["put_metric_data"]
    where = {"Host": "compute1", "Operation": "power_on"}
    assert wait_for(lambda: published(host.cloudwatch, "HostOperationFailed", where), "HostOperationFailed") == 1
    # (the flush logs its recovery, and empties its buffer, just after CloudWatch answered)
    assert wait_for(lambda: logged(caplog, "publishing metrics to CloudWatch works again"), "the recovery logged")
    assert wait_for(lambda: host.agent.metrics.buffered == 0, "the buffer emptied")


@pytest.mark.parametrize("host", [{"metrics_flush_interval": 3600}], indirect=True)
def test_stopping_the_agent_sends_the_metrics_still_buffered(host: Host):
    assert failure(host.execute("power_on", str(uuid.uuid4()), {})) == "Ferry.GuestNotFound"
    assert host.cloudwatch.called("put_metric_data") == []  # the next flush is an hour away

    host.agent.stop()
    host.thread.join(WAIT)

    assert not host.thread.is_alive()
    assert published(host.cloudwatch, "HostOperationFailed", {"Host": "compute1", "Operation": "power_on"}) == 1


@pytest.mark.parametrize("host", [QUICK_FLUSHES], indirect=True)
def test_an_agent_stops_cleanly_when_cloudwatch_cannot_take_its_last_metrics(host: Host, caplog):
    host.cloudwatch.hooks["put_metric_data"] = unreachable
    assert failure(host.execute("power_on", str(uuid.uuid4()), {})) == "Ferry.GuestNotFound"

    host.agent.stop()
    host.thread.join(WAIT)

    assert not host.thread.is_alive() and host.errors == []
    [lost] = logged(caplog, "metrics not published before the agent stopped")
    assert lost.entries >= 2  # HostOperationFailed and HostOperationDuration


def test_the_namespace_is_the_stack_s_metrics_namespace(monkeypatch):
    monkeypatch.setenv(metrics.NAMESPACE_VARIABLE, "Ferry-staging")
    assert metrics.namespace_from_environment() == "Ferry-staging"

    monkeypatch.setenv(metrics.NAMESPACE_VARIABLE, "")
    assert metrics.namespace_from_environment() == "Ferry"


# --- the publisher -------------------------------------------------------------------------------


def test_counts_of_one_metric_within_a_flush_are_sent_as_one_entry(cloudwatch):
    sender = publisher(cloudwatch)
    where = {"Host": "compute1", "Operation": "resize_instance"}
    for _ in range(50):
        sender.add("HostCleanupFailed", "Count", 1, where)
    sender.add("HostCleanupFailed", "Count", 1, {"Host": "compute1", "Operation": "confirm_resize"})

    assert sender.flush()

    [call] = cloudwatch.called("put_metric_data")
    assert call["Namespace"] == "Ferry"
    entries = {d["Dimensions"][1]["Value"]: (d["Values"], d["Counts"]) for d in call["MetricData"]}
    assert entries == {"resize_instance": ([1.0], [50.0]), "confirm_resize": ([1.0], [1.0])}
    assert published(cloudwatch, "HostCleanupFailed", where) == 50


def test_metrics_are_sent_in_batches_within_put_metric_data_limits(cloudwatch):
    sender = publisher(cloudwatch)
    for index in range(2500):
        sender.add("DiskBytesSent", "Bytes", 4096, {"Host": f"compute{index}", "Operation": "resize_instance"})

    assert sender.flush()

    assert [len(call["MetricData"]) for call in cloudwatch.called("put_metric_data")] == [1000, 1000, 500]
    assert published(cloudwatch, "DiskBytesSent", {"Host": "compute2499", "Operation": "resize_instance"}) == 4096


def test_many_distinct_values_are_split_across_entries_and_calls(cloudwatch):
    sender = publisher(cloudwatch)
    for index in range(25 * metrics.MAX_VALUES_PER_DATUM):  # 3750 durations, each its own value
        sender.add("HostOperationDuration", "Milliseconds", index + 0.5, {"Host": "compute1", "Operation": "spawn"})

    assert sender.flush()

    calls = cloudwatch.called("put_metric_data")
    assert all(len(d["Values"]) <= metrics.MAX_VALUES_PER_DATUM for call in calls for d in call["MetricData"])
    assert all(sum(len(d["Values"]) for d in call["MetricData"]) <= metrics.MAX_VALUES_PER_CALL for call in calls)
    assert [len(call["MetricData"]) for call in calls] == [20, 5]
    where = {"Host": "compute1", "Operation": "spawn"}
    assert published(cloudwatch, "HostOperationDuration", where, stat="SampleCount") == 3750


def test_the_buffer_keeps_the_newest_entries_and_logs_what_it_dropped(cloudwatch, caplog):
    # GIVEN CloudWatch cannot be reached, and a buffer of three entries
    cloudwatch.hooks["put_metric_data"] = unreachable
    sender = publisher(cloudwatch, max_buffered=3)

    for index in range(5):
        sender.add("HostOperationFailed", "Count", 1, {"Host": "compute1", "Operation": f"op{index}"})
        assert not sender.flush()  # each in an entry of its own

    assert sender.buffered == 3
    drops = logged(caplog, "metrics dropped: CloudWatch could not be reached and the buffer is full")
    assert [record.dropped for record in drops] == [1, 1]
    # one failure warning for the whole outage
    assert len(logged(caplog, "publishing metrics to CloudWatch failed: sent again at the next flush")) == 1

    # WHEN CloudWatch is back, THEN the three newest arrive
    del cloudwatch.hooks["put_metric_data"]
    assert sender.flush()
    call = cloudwatch.called("put_metric_data")[-1]
    assert [d["Dimensions"][1]["Value"] for d in call["MetricData"]] == ["op2", "op3", "op4"]


def test_data_cloudwatch_refuses_is_dropped_not_sent_again(cloudwatch, caplog):
    def refused(_kwargs: dict[str, Any]) -> None:
        raise ClientError({"Error": {"Code": "InvalidParameterValue", "Message": "bad"}}, "PutMetricData")

    cloudwatch.hooks["put_metric_data"] = refused
    sender = publisher(cloudwatch)
    sender.add("HostOperationFailed", "Count", 1, {"Host": "compute1", "Operation": "spawn"})

    assert sender.flush()
    assert sender.flush()

    assert len(cloudwatch.called("put_metric_data")) == 1
    assert logged(caplog, "CloudWatch refused metrics: dropped")


def test_a_value_cloudwatch_cannot_take_is_left_out(cloudwatch, caplog):
    sender = publisher(cloudwatch)
    sender.add("HostOperationDuration", "Milliseconds", float("nan"), {"Host": "compute1", "Operation": "spawn"})

    assert sender.buffered == 0
    assert logged(caplog, "metric value left out: not a finite number")


def test_the_background_thread_sends_every_flush_interval_and_close_sends_the_rest(cloudwatch):
    sender = publisher(cloudwatch, flush_interval=0.05)
    sender.start()
    sender.add("HostOperationFailed", "Count", 1, {"Host": "compute1", "Operation": "spawn"})
    wait_for(lambda: cloudwatch.called("put_metric_data"), "a background flush")

    sender.add("HostOperationFailed", "Count", 1, {"Host": "compute1", "Operation": "spawn"})
    assert sender.close()

    assert published(cloudwatch, "HostOperationFailed", {"Host": "compute1", "Operation": "spawn"}) == 2
    calls = len(cloudwatch.called("put_metric_data"))
    sender.add("HostOperationFailed", "Count", 1, {"Host": "compute1", "Operation": "spawn"})
    time.sleep(0.2)  # four flush intervals
    assert len(cloudwatch.called("put_metric_data")) == calls  # the thread is gone


def test_closing_waits_for_a_cloudwatch_that_does_not_answer_only_so_long(cloudwatch, caplog):
    answer = threading.Event()

    def hangs(kwargs: dict[str, Any]) -> None:
        answer.wait(WAIT)
        unreachable(kwargs)

    cloudwatch.hooks["put_metric_data"] = hangs
    sender = publisher(cloudwatch, flush_interval=3600)
    sender.start()
    sender.add("HostCleanupFailed", "Count", 1, {"Host": "compute1", "Operation": "destroy"})

    started = time.monotonic()
    assert not sender.close(timeout=0.2)

    assert time.monotonic() - started < 2
    [lost] = logged(caplog, "metrics not published before the agent stopped")
    assert lost.entries == 0  # the one entry was on its way
    answer.set()
    wait_for(lambda: not any(t.name == "metrics" and t.is_alive() for t in threading.enumerate()), "the sender's end")
