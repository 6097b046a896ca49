"""Notifications reach the notification bus (moto EventBridge, read back through a rule → SQS target),
and a bus that cannot take them never fails the caller."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
from moto import mock_aws
from moto_credentials import use_moto_credentials

from ferry import aws, config, notifications
from ferry.observability import metrics
from ferry.store.cell_models import Instance

BUS = "ferry-test-notifications"
FLAVOR = {"flavorid": "2", "name": "ferry.small", "vcpus": 2, "memory_mb": 1024, "root_gb": 2,
          "ephemeral_gb": 0, "swap": 0, "extra_specs": {"hw:cpu_policy": "shared"}}


class Bus:
    def __init__(self, queue_url: str) -> None:
        self.queue_url = queue_url

    def received(self) -> list[dict[str, Any]]:
        """Every event the rule delivered so far (EventBridge envelopes)."""
        sqs = aws.client("sqs")
        found = []
        while True:
            messages = sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10).get("Messages") or []
            if not messages:
                return found
            for message in messages:
                found.append(json.loads(message["Body"]))
                sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message["ReceiptHandle"])


@pytest.fixture
def bus(aws_test_credentials, monkeypatch) -> Iterator[Bus]:
    monkeypatch.setenv("FERRY_NOTIFICATION_BUS", BUS)
    config.reset()
    with mock_aws():
        aws.reset()
        events, sqs = aws.client("events"), aws.client("sqs")
        events.create_event_bus(Name=BUS)
        url = sqs.create_queue(QueueName="notifications-tap")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        events.put_rule(Name="tap", EventBusName=BUS, EventPattern=json.dumps({"source": [notifications.SOURCE]}))
        events.put_targets(Rule="tap", EventBusName=BUS, Targets=[{"Id": "queue", "Arn": arn}])
        metrics.clear_metrics()
        yield Bus(url)
        metrics.clear_metrics()
        aws.reset()
    config.reset()


def instance(**values: Any) -> Instance:
    fields: dict[str, Any] = {
        "uuid": "6d2c1b0e-0000-4000-8000-000000000001", "display_name": "vm1", "project_id": "demo",
        "user_id": "u1", "image_ref": "img-1", "flavor": FLAVOR, "vm_state": "active",
        "task_state": "resize_prep", "power_state": 1, "old_vm_state": "active", "host": "cell1-host1",
        "node": "cell1-host1", "availability_zone": None, "metadata_items": {"role": "db"}, "locked": False,
        "created_at": dt.datetime(2024, 5, 1, 12, 0, 0), "updated_at": None,
        "launched_at": dt.datetime(2024, 5, 1, 12, 1, 0), "terminated_at": None,
    }
    fields.update(values)
    return Instance(**fields)


def failed_publishes() -> float:
    metric = metrics.provider.metric_set.get("NotificationPublishFailed")
    return sum(metric["Value"]) if metric else 0


def test_a_notification_reaches_the_bus_with_its_type_publisher_and_payload(bus):
    server = instance()
    payload = notifications.instance_payload(server, new_flavor=notifications.flavor_payload({**FLAVOR, "vcpus": 4}))

    notifications.notify(notifications.RESIZE_START, instance_uuid=server.uuid,
                         publisher_id=notifications.compute_publisher("cell1-host1"), payload=payload)

    [event] = bus.received()
    assert event["source"] == "ferry.compute"
    assert event["detail-type"] == "instance.resize.start"
    detail = event["detail"]
    assert detail["event_type"] == "instance.resize.start"
    assert detail["publisher_id"] == "compute:cell1-host1"
    assert detail["priority"] == "INFO"
    assert detail["payload_version"] == notifications.PAYLOAD_VERSION
    assert detail["message_id"] and detail["timestamp"]
    body = detail["payload"]
    assert body["instance_uuid"] == server.uuid
    assert (body["state"], body["task_state"], body["power_state"]) == ("active", "resize_prep", "Running")
    assert (body["host"], body["node"]) == ("cell1-host1", "cell1-host1")
    assert body["flavor"]["name"] == "ferry.small" and body["flavor"]["extra_specs"] == {"hw:cpu_policy": "shared"}
    assert body["new_flavor"]["vcpus"] == 4
    assert body["created_at"] == "2024-05-01T12:00:00+00:00" and body["updated_at"] is None
    assert body["metadata"] == {"role": "db"}
    assert failed_publishes() == 0


def test_the_instance_uuid_is_always_in_the_payload_and_errors_are_error_priority(bus):
    notifications.notify(notifications.RESIZE_ERROR, instance_uuid="i-1",
                         publisher_id=notifications.conductor_publisher(), payload={"message": "boom"})

    [event] = bus.received()
    assert event["detail"]["payload"] == {"message": "boom", "instance_uuid": "i-1"}
    assert event["detail"]["priority"] == "ERROR"
    assert event["detail"]["publisher_id"].startswith("conductor:")


def test_each_notification_is_its_own_event_in_order_of_publishing(bus):
    for event_type in (notifications.RESIZE_PREP_START, notifications.RESIZE_PREP_END):
        notifications.notify(event_type, instance_uuid="i-2", publisher_id="compute:h")

    received = bus.received()
    assert sorted(e["detail-type"] for e in received) == ["instance.resize_prep.end", "instance.resize_prep.start"]
    assert len({e["detail"]["message_id"] for e in received}) == 2


def test_a_missing_bus_is_logged_and_counted_but_never_raised(bus, monkeypatch):
    monkeypatch.setenv("FERRY_NOTIFICATION_BUS", "no-such-bus")
    config.reset()

    notifications.notify(notifications.RESIZE_END, instance_uuid="i-3", publisher_id="compute:h")

    assert failed_publishes() == 1
    assert bus.received() == []


def test_an_unreachable_endpoint_is_counted_but_never_raised(monkeypatch):
    use_moto_credentials(monkeypatch, endpoint="http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    aws.reset()
    metrics.clear_metrics()
    try:
        notifications.notify(notifications.RESIZE_END, instance_uuid="i-4", publisher_id="compute:h")
        assert failed_publishes() == 1
    finally:
        metrics.clear_metrics()
        aws.reset()


def test_a_drain_too_large_for_the_bus_keeps_the_servers_that_did_not_move_and_counts_the_rest(bus):
    # GIVEN the end of a drain of 4,000 servers, 100 of them failed with a long error
    servers = [{"id": f"{n:08d}-0000-4000-8000-000000000000", "name": f"vm{n}", "source_host": "cell1-host1",
                "dest_host": None if n % 40 == 0 else "cell1-host2", "state": "failed" if n % 40 == 0 else "done",
                "error": "No valid host was found. " * 8 if n % 40 == 0 else None} for n in range(4000)]

    # WHEN its notification is published
    notifications.notify_drain("drain.error", drain_uuid="d1", payload={"status": "failed", "servers": servers})

    # THEN it fits an EventBridge entry: every failed server is in it, the rest as far as they fit,
    # and it says how many were left out
    [event] = bus.received()
    assert len(json.dumps(event["detail"])) <= 256 * 1024
    payload = event["detail"]["payload"]
    kept = payload["servers"]
    assert [s["state"] for s in kept[:100]] == ["failed"] * 100
    assert payload["servers_omitted"] == 4000 - len(kept) > 0
    assert failed_publishes() == 0


def test_a_drain_that_fits_is_published_whole(bus):
    servers = [{"id": str(n), "state": "done"} for n in range(10)]

    notifications.notify_drain("drain.end", drain_uuid="d1", payload={"status": "completed", "servers": servers})

    [event] = bus.received()
    assert event["detail"]["payload"]["servers"] == servers and "servers_omitted" not in event["detail"]["payload"]


def test_a_drain_whose_plan_did_not_fit_sends_its_unplaceable_servers_once(bus):
    # GIVEN the end of a drain of 3,000 servers none of which could be placed: the plan's list
    # repeats each one with its reason
    servers = [{"id": f"{n:08d}-0000-4000-8000-000000000000", "name": f"vm{n}", "state": "unplaceable",
                "error": "No valid host was found. There are not enough hosts available."} for n in range(3000)]
    plan = {"fits": False, "unplaceable": [{"id": s["id"], "name": s["name"], "reason": s["error"]} for s in servers]}

    notifications.notify_drain("drain.error", drain_uuid="d1", payload={"status": "failed", "plan": plan,
                                                                        "servers": servers})

    # THEN it fits the bus: the plan's list is left out (counted), and the servers carry them
    [event] = bus.received()
    payload = event["detail"]["payload"]
    assert len(json.dumps(event["detail"])) <= 256 * 1024
    assert payload["plan"] == {"fits": False, "unplaceable": [], "unplaceable_omitted": 3000}
    assert len(payload["servers"]) + payload["servers_omitted"] == 3000 and payload["servers"]



def test_every_copy_of_an_event_with_an_identity_carries_the_same_message_id_and_other_events_new_ones(bus):
    def publish(event_type: str, publisher: str, identity: str | None) -> None:
        notifications.notify(event_type, instance_uuid="i-3", publisher_id=publisher, identity=identity)

    # GIVEN one event published twice (a step run again), and events that differ in one part each
    publish(notifications.RESIZE_PREP_START, "compute:h1", "migration-1")
    publish(notifications.RESIZE_PREP_START, "compute:h1", "migration-1")
    publish(notifications.RESIZE_PREP_START, "compute:h2", "migration-1")  # the alternate host's prep
    publish(notifications.RESIZE_PREP_END, "compute:h1", "migration-1")
    publish(notifications.RESIZE_PREP_START, "compute:h1", "migration-2")  # a second resize of the server
    publish(notifications.RESIZE_PREP_START, "compute:h1", None)  # no identity: a new id each time
    publish(notifications.RESIZE_PREP_START, "compute:h1", None)

    ids = [e["detail"]["message_id"] for e in bus.received()]

    assert len(ids) == 7
    assert len(set(ids)) == 6
    assert ids.count(notifications.message_id(notifications.RESIZE_PREP_START, "i-3", "compute:h1",
                                              "migration-1")) == 2
