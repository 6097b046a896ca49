"""A server in VERIFY_RESIZE written straight into the store, and what the tests of confirm,
revert, delete, auto-confirm and volume attachments look at afterwards.

The records are those the resize workflow leaves: the instance resized on the destination with
the new flavor, the migration ``finished``, the migration consumer holding the old flavor on the
source and the instance the new one on the destination, an ACTIVE port binding on the
destination and an INACTIVE one on the source, and (optionally) a volume attached on both.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid as uuidlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from moto import mock_aws
from moto_credentials import use_moto_credentials
from sqlalchemy import select, update

from ferry import aws, config, hosts, notifications, placement, protocol, workflows
from ferry.compute import actions, migration_states, moves, states
from ferry.store.api_models import (
    CellMapping,
    InstanceMapping,
    Network,
    Port,
    PortBinding,
    RequestSpec,
    Volume,
    VolumeAttachment,
    utcnow,
)
from ferry.store.cell_models import BlockDeviceMapping, Instance, InstanceActionEvent, InstanceFault, Migration, Service
from ferry.store.db import api_session, cell_session

ROOT = Path(__file__).resolve().parents[2]
PROJECT, USER = "demo", "u1"
CELL = "cell1"
SOURCE, DEST, OTHER = "cell1-host1", "cell1-host2", "cell1-host3"
OLD = {"id": 1, "flavorid": "1", "name": "m1.small", "vcpus": 1, "memory_mb": 512, "root_gb": 1, "ephemeral_gb": 0,
       "swap": 0, "extra_specs": {}}
NEW = {"id": 2, "flavorid": "2", "name": "m1.medium", "vcpus": 2, "memory_mb": 1024, "root_gb": 2,
       "ephemeral_gb": 1, "swap": 0, "extra_specs": {}}
OLD_USAGE = placement.resources_from_flavor(OLD, False)
NEW_USAGE = placement.resources_from_flavor(NEW, False)
BUS = "ferry-test-settle-notifications"


def report(host: str, cell: str = CELL) -> None:
    """An inventory report from ``host`` (maps it, gives it a provider and a fresh heartbeat)."""
    hosts.apply_report({"kind": "inventory", "host": host, "node": host, "cell": cell, "sent_at": utcnow().isoformat(),
                        "inventory": {"VCPU": {"total": 8}, "MEMORY_MB": {"total": 8192},
                                      "DISK_GB": {"total": 40}}})


class Tap:
    """The notifications that reached the bus (a rule sends them to a queue)."""

    def __init__(self, queue_url: str) -> None:
        self.queue_url = queue_url

    def drain(self) -> list[dict[str, Any]]:
        sqs, found = aws.client("sqs"), []
        while True:
            batch = sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10).get("Messages") or []
            if not batch:
                return found
            for message in batch:
                found.append(json.loads(message["Body"])["detail"])
                sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message["ReceiptHandle"])

    def event_types(self) -> list[tuple[str, str]]:
        return [(n["event_type"], n["publisher_id"]) for n in self.drain()]


@contextmanager
def mocked_aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[Tap]:
    """moto for SQS (three host queues), S3 (the image bucket) and the notification bus; hosts reporting."""
    use_moto_credentials(monkeypatch)
    monkeypatch.setenv("FERRY_NOTIFICATION_BUS", BUS)
    config.reset()
    with mock_aws():
        aws.reset()
        hosts._queue_urls.clear()
        sqs, events = aws.client("sqs"), aws.client("events")
        aws.client("s3").create_bucket(Bucket=config.get().image_bucket)
        for host in (SOURCE, DEST, OTHER):
            sqs.create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, host))
            report(host)
        events.create_event_bus(Name=BUS)
        url = sqs.create_queue(QueueName="notifications-tap")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        events.put_rule(Name="tap", EventBusName=BUS, EventPattern=json.dumps({"source": [notifications.SOURCE]}))
        events.put_targets(Rule="tap", EventBusName=BUS, Targets=[{"Id": "tap", "Arn": arn}])
        with api_session() as session:
            session.add(Network(id="net-1", name="shared", cidr="10.0.0.0/24"))
        yield Tap(url)
        aws.reset()
        hosts._queue_urls.clear()


@dataclass(frozen=True)
class Resized:
    instance_uuid: str
    migration_uuid: str
    source: str
    dest: str
    port_id: str
    volume_id: str | None

    @property
    def same_host(self) -> bool:
        return self.source == self.dest


def provider(host: str) -> str:
    return placement.provider_by_host(host)


def make_volume(state_dir: Path, *, size_gb: int = 1, project: str = PROJECT) -> str:
    """A volume row as tests create them (as `ferry volume register` records one): a path under the state dir."""
    volume_id = str(uuidlib.uuid4())
    with api_session() as session:
        session.add(Volume(id=volume_id, name=f"vol-{volume_id[:8]}", project_id=project, size_gb=size_gb,
                           status="available", path=str(state_dir / "volumes" / volume_id)))
    return volume_id


def make_resized(*, source: str = SOURCE, dest: str = DEST, old_vm_state: str = states.ACTIVE,
                 volume: bool = False, state_dir: Path | None = None) -> Resized:
    """A server in VERIFY_RESIZE as the resize workflow leaves it (see the module docstring)."""
    uuid, migration_uuid = str(uuidlib.uuid4()), str(uuidlib.uuid4())
    running = old_vm_state == states.ACTIVE
    if source == dest:
        placement.set_allocations({
            migration_uuid: {"project_id": PROJECT, "user_id": USER, "allocations": {provider(source): OLD_USAGE}},
            uuid: {"project_id": PROJECT, "user_id": USER, "allocations": {provider(dest): NEW_USAGE}}})
    else:
        placement.claim(migration_uuid, PROJECT, USER, {provider(source): OLD_USAGE})
        placement.claim(uuid, PROJECT, USER, {provider(dest): NEW_USAGE})
    volume_id = make_volume(state_dir or Path("/tmp")) if volume else None
    with cell_session(CELL) as session:
        session.add(Instance(uuid=uuid, display_name="vm1", project_id=PROJECT, user_id=USER, image_ref="img-1",
                             flavor=NEW, old_flavor=OLD, new_flavor=NEW, old_vm_state=old_vm_state,
                             vm_state=states.RESIZED, task_state=None,
                             power_state=states.RUNNING if running else states.SHUTDOWN,
                             host=dest, node=dest, launched_on=source))
        session.add(Migration(uuid=migration_uuid, instance_uuid=uuid, source_compute=source, source_node=source,
                              dest_compute=dest, dest_node=dest, dest_host=dest, old_instance_type_id=OLD["id"],
                              new_instance_type_id=NEW["id"], status=migration_states.FINISHED,
                              migration_type=migration_states.RESIZE,
                              user_id=USER, project_id=PROJECT))
        if volume_id:
            session.add(BlockDeviceMapping(instance_uuid=uuid, source_type="volume", destination_type="volume",
                                           device_name="vdd", boot_index=None, volume_id=volume_id))
    with api_session() as session:
        cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == CELL)).one()
        session.add(InstanceMapping(instance_uuid=uuid, project_id=PROJECT, user_id=USER, cell_id=cell_id))
        session.add(RequestSpec(instance_uuid=uuid, spec={"instance_uuid": uuid, "project_id": PROJECT,
                                                          "user_id": USER, "flavor": NEW, "is_bfv": False}))
        port = Port(network_id="net-1", project_id=PROJECT, device_id=uuid, status="ACTIVE",
                    mac_address=f"fa:16:3e:{uuid[0:2]}:{uuid[2:4]}:{uuid[4:6]}", fixed_ip="10.0.0.5")
        port.bindings.append(PortBinding(host=dest, status="ACTIVE", vif_details={"type": "ethernet"}))
        if source != dest:
            port.bindings.append(PortBinding(host=source, status="INACTIVE", vif_details={"type": "ethernet"}))
        session.add(port)
        session.flush()
        port_id = port.id
        if volume_id:
            session.execute(update(Volume).where(Volume.id == volume_id).values(status="in-use"))
            for host in {source, dest}:
                session.add(VolumeAttachment(volume_id=volume_id, instance_uuid=uuid, host=host, device="vdd",
                                             status="attached"))
    return Resized(uuid, migration_uuid, source, dest, port_id, volume_id)


def begin(kind: str, resized: Resized, monkeypatch: pytest.MonkeyPatch, *, request_id: str | None = None
          ) -> dict[str, Any]:
    """Accept a confirm or revert through the compute API's own code; returns the execution's input."""
    started: list[dict[str, Any]] = []

    def start_execution(arn: str, name: str, payload: dict[str, Any]) -> str:
        started.append({**payload, "execution_name": name})
        return f"{arn}:{name}"

    accept = moves.begin_confirm if kind == "confirm" else moves.begin_revert
    with monkeypatch.context() as patched:
        patched.setattr(workflows, "start_execution", start_execution)
        accept(CELL, resized.instance_uuid, request_id=request_id or f"req-{uuidlib.uuid4()}", user_id=USER,
               project_id=PROJECT)
    return started[0]


def host_result(host: str, instance_uuid: str, power_state: int = states.NOSTATE) -> dict[str, Any]:
    """What a host agent answers (protocol.RESULT_SCHEMA)."""
    return {"instance_uuid": instance_uuid, "host": host, "node": host, "power_state": power_state}


def usage(host: str) -> dict[str, int]:
    return placement.usages(provider(host))


def instance_row(instance_uuid: str) -> Instance:
    with cell_session(CELL) as session:
        return session.scalars(select(Instance).where(Instance.uuid == instance_uuid)).one()


def migration_row(migration_uuid: str) -> Migration:
    with cell_session(CELL) as session:
        return session.scalars(select(Migration).where(Migration.uuid == migration_uuid)).one()


def faults(instance_uuid: str) -> list[InstanceFault]:
    with cell_session(CELL) as session:
        return list(session.scalars(select(InstanceFault).where(InstanceFault.instance_uuid == instance_uuid)
                                    .order_by(InstanceFault.id)))


def events(instance_uuid: str) -> dict[str, str | None]:
    """``{event name: result}`` of every action event of the instance."""
    from ferry.store.cell_models import InstanceAction

    with cell_session(CELL) as session:
        rows = session.execute(select(InstanceActionEvent.event, InstanceActionEvent.result)
                               .join(InstanceAction, InstanceAction.id == InstanceActionEvent.action_id)
                               .where(InstanceAction.instance_uuid == instance_uuid)).all()
    return {event: result for event, result in rows}


def bindings(instance_uuid: str) -> dict[str, str]:
    """``{host: status}`` of the server's port bindings."""
    with api_session() as session:
        ports = session.scalars(select(Port).where(Port.device_id == instance_uuid)).all()
        return {b.host: b.status for p in ports for b in p.bindings}


def attachments(instance_uuid: str) -> dict[str, str]:
    """``{host: status}`` of the server's volume attachments."""
    with api_session() as session:
        rows = session.scalars(select(VolumeAttachment).where(VolumeAttachment.instance_uuid == instance_uuid)).all()
        return {str(a.host): a.status for a in rows}


def volume_status(volume_id: str) -> str:
    with api_session() as session:
        volume = session.get(Volume, volume_id)
        assert volume is not None
        return volume.status


def set_instance(instance_uuid: str, **values: Any) -> None:
    with cell_session(CELL) as session:
        session.execute(update(Instance).where(Instance.uuid == instance_uuid).values(**values))


def accept_delete(instance_uuid: str, request_id: str, cell: str = CELL) -> None:
    """What the compute API's delete writes before it starts the workflow: task ``deleting`` and
    the request's action."""
    with cell_session(cell) as session:
        session.execute(update(Instance).where(Instance.uuid == instance_uuid).values(task_state="deleting"))
        actions.start_action(session, instance_uuid=instance_uuid, action=actions.DELETE, request_id=request_id,
                             user_id="u1", project_id="demo")


def set_migration(migration_uuid: str, **values: Any) -> None:
    with cell_session(CELL) as session:
        session.execute(update(Migration).where(Migration.uuid == migration_uuid).values(**values))


def host_down(host: str) -> None:
    """The host's service stops sending heartbeats (its last one is long gone)."""
    long_ago = utcnow() - dt.timedelta(seconds=config.get().service_down_time * 10)
    with cell_session(CELL) as session:
        session.execute(update(Service).where(Service.host == host).values(last_seen_at=long_ago))


def snapshot(resized: Resized) -> tuple[Any, ...]:
    """Everything a refused or rolled-back step must leave as it was."""
    row, migration = instance_row(resized.instance_uuid), migration_row(resized.migration_uuid)
    return ((row.vm_state, row.task_state, row.power_state, row.host, row.node, row.flavor, row.old_flavor,
             row.new_flavor, row.old_vm_state),
            migration.status,
            placement.get_allocations(resized.instance_uuid), placement.get_allocations(resized.migration_uuid),
            bindings(resized.instance_uuid), attachments(resized.instance_uuid), len(faults(resized.instance_uuid)))
