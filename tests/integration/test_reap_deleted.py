"""What a host still holds of servers deleted while it was down is destroyed when it reports it; reports
of one host applied at once keep the newer one's inventory."""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid
from collections.abc import Iterator

import pytest
from moto import mock_aws
from sqlalchemy import select

from ferry import aws, config, hosts, placement, protocol
from ferry.store.api_models import CellMapping, InstanceMapping, Inventory, ResourceProvider, utcnow
from ferry.store.cell_models import Instance, Service
from ferry.store.db import api_session, cell_session

HOST = "compute-1"
A_MINUTE_AGO = utcnow() - dt.timedelta(minutes=1)


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


def report(guests: list[str], dirs: list[str], sent_at: dt.datetime | None = None) -> None:
    hosts.apply_report({"kind": "inventory", "host": HOST, "node": HOST, "cell": "cell1",
                        "sent_at": (sent_at or utcnow()).isoformat(),
                        "inventory": {"VCPU": {"total": 8}, "MEMORY_MB": {"total": 8192}, "DISK_GB": {"total": 40}},
                        "guests": guests, "instance_dirs": dirs})


def server(*, deleted: bool, queued_for_delete: bool, cell: str = "cell1") -> str:
    """A server recorded in ``cell`` on the host: its delete finished a minute ago (both true),
    under way, or not asked."""
    instance_uuid = str(uuid.uuid4())
    with api_session() as session:
        cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == cell)).one()
        session.add(InstanceMapping(instance_uuid=instance_uuid, cell_id=cell_id, project_id="p", user_id="u",
                                    queued_for_delete=queued_for_delete))
    with cell_session(cell) as session:
        session.add(Instance(uuid=instance_uuid, display_name="vm", project_id="p", user_id="u", flavor={},
                             host=HOST, node=HOST, vm_state="deleted" if deleted else "active", deleted=deleted,
                             deleted_at=A_MINUTE_AGO if deleted else None))
    return instance_uuid


def messages(url: str) -> list[dict]:
    found: list[dict] = []
    while received := aws.client("sqs").receive_message(QueueUrl=url, MaxNumberOfMessages=10).get("Messages"):
        found.extend(json.loads(m["Body"]) for m in received)
        for m in received:
            aws.client("sqs").delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    return found


def test_the_guest_and_disks_of_a_server_deleted_while_its_host_was_down_are_destroyed(queue):
    # GIVEN servers whose delete finished (one recorded in another cell after a move between
    # cells), one whose delete is under way, one deleted but still mapped, one alive, a stranger
    gone, gone_dirs_only = server(deleted=True, queued_for_delete=True), server(deleted=True, queued_for_delete=True)
    moved_away = server(deleted=True, queued_for_delete=True, cell="cell2")
    deleting, alive = server(deleted=False, queued_for_delete=True), server(deleted=False, queued_for_delete=False)
    unmapped_delete = server(deleted=True, queued_for_delete=False)
    stranger = str(uuid.uuid4())

    # WHEN the host reports them again
    report([gone, moved_away, deleting, alive, unmapped_delete, stranger, "not-a-uuid"],
           [gone, f"{gone_dirs_only}_resize", alive])

    # THEN it is asked to destroy those of the deleted servers, and nothing else
    sent = messages(queue)
    assert sorted(m["instance_uuid"] for m in sent) == sorted([gone, gone_dirs_only, moved_away])
    for message in sent:
        protocol.validate(message, protocol.OPERATION_SCHEMA)
        assert (message["operation"], message["args"], message.get("task_token")) == (protocol.DESTROY, {}, None)
        assert message["operation_id"].startswith(f"reap/{message['instance_uuid']}/")


def next_period() -> dt.datetime:
    """The start of the next reap period (naive UTC), after every delete these tests record."""
    period = hosts.REAP_PERIOD_SECONDS
    start = (int(utcnow().replace(tzinfo=dt.UTC).timestamp()) // period + 1) * period
    return dt.datetime.fromtimestamp(start, dt.UTC).replace(tzinfo=None)


def view(guests: list[str], sent_at: dt.datetime) -> dict:
    return {"sent_at": sent_at.isoformat(), "guests": guests, "instance_dirs": []}


def test_a_report_sent_before_the_delete_finished_asks_for_nothing(queue):
    # a report sent before an ordinary delete's DestroyAtHost, processed after its FinishDelete
    gone = server(deleted=True, queued_for_delete=True)

    assert hosts.reap_deleted(HOST, view([gone], A_MINUTE_AGO - dt.timedelta(seconds=1))) == []
    assert hosts.reap_deleted(HOST, view([gone], A_MINUTE_AGO + dt.timedelta(seconds=10))) == [gone]


def test_reports_within_one_period_ask_for_the_same_destroy(queue):
    gone = server(deleted=True, queued_for_delete=True)
    start = next_period()

    report([gone], [], sent_at=start)
    report([gone], [], sent_at=start + dt.timedelta(seconds=hosts.REAP_PERIOD_SECONDS - 1))
    report([gone], [], sent_at=start + dt.timedelta(seconds=hosts.REAP_PERIOD_SECONDS))

    first, again, later = messages(queue)
    assert first["operation_id"] == again["operation_id"]  # the agent answers the second from its journal
    assert later["operation_id"] != first["operation_id"]  # a failed one is tried again


def test_leftovers_beyond_a_reports_cap_are_asked_for_in_turn(queue, monkeypatch):
    monkeypatch.setattr(hosts, "REAP_MAX_PER_REPORT", 12)  # two batches of messages
    gone = [server(deleted=True, queued_for_delete=True) for _ in range(25)]
    start = next_period()
    picked: list[set[str]] = []

    for n in range(4):  # reports in four periods
        reaped = hosts.reap_deleted(HOST, view(gone, start + dt.timedelta(seconds=n * hosts.REAP_PERIOD_SECONDS)))
        sent = [m["instance_uuid"] for m in messages(queue)]
        assert len(reaped) == 12 and sorted(sent) == sorted(reaped)
        picked.append(set(reaped))

    assert len(set.union(*picked)) > 12  # not the same twelve each period


def test_with_the_log_action_leftovers_are_only_logged(queue, monkeypatch, caplog):
    gone = server(deleted=True, queued_for_delete=True)
    monkeypatch.setenv("FERRY_RUNNING_DELETED_ACTION", "log")
    config.reset()
    try:
        assert hosts.reap_deleted(HOST, view([gone], utcnow())) == []
    finally:
        monkeypatch.delenv("FERRY_RUNNING_DELETED_ACTION")
        config.reset()

    assert messages(queue) == []
    assert any("not reaped" in r.getMessage() for r in caplog.records)


def test_a_reap_that_cannot_be_sent_leaves_the_report_applied(queue, caplog):
    gone = server(deleted=True, queued_for_delete=True)
    aws.client("sqs").delete_queue(QueueUrl=queue)
    hosts._queue_urls.clear()
    sent_at = utcnow()

    report([gone], [gone], sent_at=sent_at)  # does not raise

    assert any(r.getMessage() == "reaping deleted servers' leftovers failed" for r in caplog.records)
    with cell_session("cell1") as session:
        service = session.scalars(select(Service).where(Service.host == HOST)).one()
    assert hosts.host_view(service)["guests"] == [gone]


def test_two_reports_of_a_host_applied_at_once_leave_the_newer_ones_inventory(queue, monkeypatch):
    # GIVEN an inventory report whose placement write is slow, and a newer one of the same host
    # applied while the first is under way (report batches run side by side)
    write, older_writing = placement.ensure_provider, threading.Event()

    def slow_for_the_older(host, node, cell_id, inventories, **options):
        if inventories["VCPU"]["total"] == 4:
            older_writing.set()
            threading.Event().wait(0.5)
        return write(host, node, cell_id, inventories, **options)

    monkeypatch.setattr(placement, "ensure_provider", slow_for_the_older)

    def inventory_report(vcpus: int) -> None:  # queued as it is applied
        hosts.apply_report({"kind": "inventory", "host": HOST, "node": HOST, "cell": "cell1",
                            "sent_at": utcnow().isoformat(), "guests": [], "instance_dirs": [],
                            "inventory": {"VCPU": {"total": vcpus}, "MEMORY_MB": {"total": 8192},
                                          "DISK_GB": {"total": 40}}})

    older = threading.Thread(target=inventory_report, args=(4,))
    older.start()
    assert older_writing.wait(10)

    # WHEN the newer one is applied meanwhile
    inventory_report(16)
    older.join(10)

    # THEN the host's inventory is the newer report's
    with api_session() as session:
        total = session.scalars(select(Inventory.total).join(ResourceProvider).where(
            ResourceProvider.name == HOST, Inventory.resource_class == "VCPU")).one()
    assert total == 16
