"""What a host still holds of servers deleted while it was down is destroyed when it reports it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from moto import mock_aws
from sqlalchemy import select

from ferry import aws, config, hosts, protocol
from ferry.store.api_models import CellMapping, InstanceMapping, utcnow
from ferry.store.cell_models import Instance
from ferry.store.db import api_session, cell_session

HOST = "compute-1"


@pytest.fixture
def queue(aws_test_credentials, store) -> Iterator[str]:
    """The host's agent queue (moto), the host reporting in cell1."""
    with mock_aws():
        aws.reset()
        hosts._queue_urls.clear()
        url = aws.client("sqs").create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix,
                                                                                 HOST))["QueueUrl"]
        report([], [])
        yield url
        aws.reset()


def report(guests: list[str], dirs: list[str]) -> None:
    hosts.apply_report({"kind": "inventory", "host": HOST, "node": HOST, "cell": "cell1",
                        "sent_at": utcnow().isoformat(),
                        "inventory": {"VCPU": {"total": 8}, "MEMORY_MB": {"total": 8192}, "DISK_GB": {"total": 40}},
                        "guests": guests, "instance_dirs": dirs})


def server(*, deleted: bool, queued_for_delete: bool) -> str:
    """A server recorded in cell1 on the host: its delete finished (both true), under way, or not asked."""
    instance_uuid = str(uuid.uuid4())
    with api_session() as session:
        cell1 = session.scalars(select(CellMapping.id).where(CellMapping.name == "cell1")).one()
        session.add(InstanceMapping(instance_uuid=instance_uuid, cell_id=cell1, project_id="p", user_id="u",
                                    queued_for_delete=queued_for_delete))
    with cell_session("cell1") as session:
        session.add(Instance(uuid=instance_uuid, display_name="vm", project_id="p", user_id="u", flavor={},
                             host=HOST, node=HOST, vm_state="deleted" if deleted else "active", deleted=deleted,
                             deleted_at=utcnow() if deleted else None))
    return instance_uuid


def messages(url: str) -> list[dict]:
    received = aws.client("sqs").receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages") or []
    return [json.loads(m["Body"]) for m in received]


def test_the_guest_and_disks_of_a_server_deleted_while_its_host_was_down_are_destroyed(queue):
    # GIVEN servers whose delete finished while the host was down, one under way, one alive, a stranger
    gone, gone_dirs_only = server(deleted=True, queued_for_delete=True), server(deleted=True, queued_for_delete=True)
    deleting, alive = server(deleted=False, queued_for_delete=True), server(deleted=False, queued_for_delete=False)
    stranger = str(uuid.uuid4())

    # WHEN the host reports them again
    report([gone, deleting, alive, stranger, "not-a-uuid"], [gone, f"{gone_dirs_only}_resize", alive])

    # THEN it is asked to destroy those of the two deleted servers, and nothing else
    sent = messages(queue)
    assert sorted(m["instance_uuid"] for m in sent) == sorted([gone, gone_dirs_only])
    for message in sent:
        protocol.validate(message, protocol.OPERATION_SCHEMA)
        assert (message["operation"], message["args"], message.get("task_token")) == (protocol.DESTROY, {}, None)
        assert message["operation_id"].startswith(f"reap/{message['instance_uuid']}/")


def test_a_report_without_what_the_host_holds_asks_for_nothing(queue):
    server(deleted=True, queued_for_delete=True)

    hosts.apply_report({"kind": protocol.REPORT_HEARTBEAT, "host": HOST, "sent_at": utcnow().isoformat()})
    report([], [])

    assert messages(queue) == []
