"""The resize / cold migrate workflow's steps against a real store (SQLite and PostgreSQL).

Each test drives the step functions the way ``statemachine/resize.asl.json`` does, with moto
for the host queues, the image bucket and the notification bus; the host operations'
results are what the host agent protocol says they are. The rollback tests take a snapshot
of everything a move touches before the compute API prepared it, fail the move at each
stage, roll back, and compare.
"""

from __future__ import annotations

import hashlib
import json
import uuid as uuidlib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from lock_support import looked_at_while_releasing
from moto import mock_aws
from sqlalchemy import select, update

from ferry import aws, config, errors, hosts, notifications, placement, protocol
from ferry.compute import actions, states
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
from ferry.store.cell_models import (
    BlockDeviceMapping,
    Instance,
    InstanceAction,
    InstanceActionEvent,
    InstanceFault,
    Migration,
)
from ferry.store.db import api_session, cell_session
from ferry.workflows import cross_cell, resize

ROOT = Path(__file__).resolve().parents[2]
PROJECT, USER = "demo", "u1"
SMALL = {"flavorid": "1", "name": "ferry.tiny", "vcpus": 1, "memory_mb": 512, "root_gb": 1, "ephemeral_gb": 0,
         "swap": 0, "extra_specs": {}}
BIG = {"flavorid": "2", "name": "ferry.small", "vcpus": 2, "memory_mb": 1024, "root_gb": 2, "ephemeral_gb": 1,
       "swap": 0, "extra_specs": {}}
SOURCE = "cell1-host1"
# Free memory decides the weighed order: host2 first, then host3.
HOSTS = {"cell1-host1": 4096, "cell1-host2": 8192, "cell1-host3": 6144}
BUS = "ferry-test-notifications"
DISKS = {"root": {"sha256": hashlib.sha256(b"root").hexdigest(), "size": 2 * 2**30}}


def report(host: str, cell: str = "cell1", *, vcpus: int = 4, memory_mb: int = 4096, disk_gb: int = 20) -> None:
    hosts.apply_report({"kind": "inventory", "host": host, "node": host, "cell": cell, "sent_at": utcnow().isoformat(),
                        "inventory": {"VCPU": {"total": vcpus}, "MEMORY_MB": {"total": memory_mb},
                                      "DISK_GB": {"total": disk_gb}}})


class Tap:
    """What reached the notification bus, through a rule with an SQS target."""

    def __init__(self, queue_url: str) -> None:
        self.queue_url = queue_url

    def drain(self) -> list[dict[str, Any]]:
        sqs, found = aws.client("sqs"), []
        while True:
            messages = sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10).get("Messages") or []
            if not messages:
                return found
            for message in messages:
                found.append(json.loads(message["Body"])["detail"])
                sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message["ReceiptHandle"])


@pytest.fixture
def cloud(aws_test_credentials, store, monkeypatch):
    """Three reporting hosts in cell1 with queues, the image bucket and a tapped notification bus."""
    monkeypatch.setenv("FERRY_NOTIFICATION_BUS", BUS)
    config.reset()
    with mock_aws():
        aws.reset()
        hosts._queue_urls.clear()
        aws.client("s3").create_bucket(Bucket=config.get().image_bucket)
        for host, memory in HOSTS.items():
            aws.client("sqs").create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, host))
            report(host, memory_mb=memory)
        events, sqs = aws.client("events"), aws.client("sqs")
        events.create_event_bus(Name=BUS)
        url = sqs.create_queue(QueueName="tap")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        events.put_rule(Name="tap", EventBusName=BUS, EventPattern=json.dumps({"source": [notifications.SOURCE]}))
        events.put_targets(Rule="tap", EventBusName=BUS, Targets=[{"Id": "q", "Arn": arn}])
        with api_session() as session:
            session.add(Network(id="net-1", name="shared", cidr="10.0.0.0/24"))
        yield Tap(url)
        aws.reset()
        hosts._queue_urls.clear()


# --- what exists before a move, and what the API writes -------------------------------------------


# What the destination answers when it refuses the move's claim (CanReschedule then reschedules).
CLAIM_REFUSED = {"Error": errors.ResizeClaimFailed.__name__, "Cause": "no NUMA room"}


def make_server(host: str = SOURCE, flavor: dict | None = None, *, vm_state: str = states.ACTIVE,
                power_state: int = states.RUNNING, volume: bool = False) -> str:
    """A server on ``host`` as a finished boot leaves it: claim, record, mapping, spec, an ACTIVE port."""
    flavor = flavor or SMALL
    uuid = str(uuidlib.uuid4())
    placement.claim(uuid, PROJECT, USER, {placement.provider_by_host(host):
                                         placement.resources_from_flavor(flavor, False)})
    with cell_session("cell1") as session:
        session.add(Instance(uuid=uuid, display_name="vm1", project_id=PROJECT, user_id=USER, image_ref="img-1",
                             flavor=flavor, vm_state=vm_state, task_state=None, power_state=power_state,
                             host=host, node=host, launched_on=host))
        if volume:
            session.add(BlockDeviceMapping(instance_uuid=uuid, source_type="volume", destination_type="volume",
                                           device_name="vdb", boot_index=None, volume_id=f"vol-{uuid[:8]}"))
    with api_session() as session:
        cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == "cell1")).one()
        session.add(InstanceMapping(instance_uuid=uuid, project_id=PROJECT, user_id=USER, cell_id=cell_id))
        session.add(RequestSpec(instance_uuid=uuid, spec={
            "instance_uuid": uuid, "project_id": PROJECT, "user_id": USER, "flavor": flavor, "is_bfv": False,
            "ignore_hosts": [], "requested_destination": None, "allowed_cells": None, "scheduler_hints": {},
            "group": None}))
        port = Port(network_id="net-1", project_id=PROJECT, device_id=uuid, status="ACTIVE",
                    mac_address=f"fa:16:3e:{uuid[0:2]}:{uuid[2:4]}:{uuid[4:6]}", fixed_ip="10.0.0.5")
        port.bindings.append(PortBinding(host=host, status="ACTIVE", vif_details={"type": "ethernet"}))
        session.add(port)
        if volume:
            vol = Volume(id=f"vol-{uuid[:8]}", project_id=PROJECT, size_gb=1, status="in-use",
                         path=f"/srv/volumes/vol-{uuid[:8]}")
            vol.attachments.append(VolumeAttachment(instance_uuid=uuid, host=host, device="vdb", status="attached"))
            session.add(vol)
    return uuid


def prepare_move(uuid: str, new_flavor: dict | None = None, *, requested_host: str | None = None) -> dict[str, Any]:
    """What the compute API writes before starting the workflow; returns the execution input."""
    migration_uuid = str(uuidlib.uuid4())
    request_id = f"req-{uuidlib.uuid4()}"
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance).where(Instance.uuid == uuid)).one()
        target = new_flavor or instance.flavor
        kind = "resize" if target["flavorid"] != instance.flavor["flavorid"] else "migration"
        instance.task_state, instance.old_flavor, instance.new_flavor = states.RESIZE_PREP, instance.flavor, target
        instance.old_vm_state = instance.vm_state
        session.add(Migration(uuid=migration_uuid, instance_uuid=uuid, source_compute=instance.host,
                              source_node=instance.node, status="pre-migrating", migration_type=kind,
                              old_instance_type_id=1, new_instance_type_id=2, user_id=USER, project_id=PROJECT))
        actions.start_action(session, instance_uuid=uuid, action="resize" if kind == "resize" else "migrate",
                             request_id=request_id, user_id=USER, project_id=PROJECT)
    return {"instance_uuid": uuid, "migration_uuid": migration_uuid, "cell": "cell1", "request_id": request_id,
            "requested_host": requested_host, "execution_name": f"resize-{uuid}-{migration_uuid[:8]}",
            "user_id": USER, "project_id": PROJECT}


def snapshot(uuid: str) -> dict[str, Any]:
    """Everything a move may touch: the record, allocations of every consumer, bindings, attachments."""
    with cell_session("cell1") as session:
        i = session.scalars(select(Instance).where(Instance.uuid == uuid)).one()
        record = {k: getattr(i, k) for k in ("host", "node", "flavor", "vm_state", "task_state", "power_state",
                                             "old_flavor", "new_flavor", "old_vm_state")}
        migrations = list(session.scalars(select(Migration.uuid).where(Migration.instance_uuid == uuid)))
    with api_session() as session:
        ports = {p.id: sorted((b.host, b.status) for b in p.bindings)
                 for p in session.scalars(select(Port).where(Port.device_id == uuid))}
        attachments = sorted((a.volume_id, a.host, a.device, a.status) for a in session.scalars(
            select(VolumeAttachment).where(VolumeAttachment.instance_uuid == uuid)))
        volume_status = sorted(v.status for v in session.scalars(select(Volume)))
    usage = {host: placement.usages(placement.provider_by_host(host)) for host in HOSTS}
    consumers = {c: placement.get_allocations(c) for c in [uuid, *migrations] if placement.get_allocations(c)}
    return {"record": record, "ports": ports, "attachments": attachments, "volumes": volume_status,
            "usage": usage, "allocations": consumers}


def instance(uuid: str) -> Instance:
    with cell_session("cell1") as session:
        return session.scalars(select(Instance).where(Instance.uuid == uuid)).one()


def migration(migration_uuid: str) -> Migration:
    with cell_session("cell1") as session:
        return session.scalars(select(Migration).where(Migration.uuid == migration_uuid)).one()


def events_of(uuid: str) -> dict[str, tuple[str | None, str | None, bool]]:
    """``{event: (result, host, finished)}`` of the instance's actions."""
    with cell_session("cell1") as session:
        rows = session.execute(select(InstanceActionEvent).join(
            InstanceAction, InstanceAction.id == InstanceActionEvent.action_id).where(
            InstanceAction.instance_uuid == uuid)).scalars()
        return {e.event: (e.result, e.host, e.finish_time is not None) for e in rows}


def faults_of(uuid: str) -> list[InstanceFault]:
    with cell_session("cell1") as session:
        return list(session.scalars(select(InstanceFault).where(InstanceFault.instance_uuid == uuid)))


def used_on(host: str) -> dict[str, int]:
    return placement.usages(placement.provider_by_host(host))


# --- driving the steps as the state machine does ------------------------------------------------

STAGES = ["SelectMoveDestinations", "PrepResizeAtDest", "PrepResizeOnDestHost", "ResizeInstanceAtSource",
          "ResizeInstanceOnSourceHost", "FinishResizeAtDest", "FinishResizeOnDestHost", "MarkResized"]


def host_result(doc: dict[str, Any], host: str, power_state: int, **extra: Any) -> dict[str, Any]:
    return {"instance_uuid": doc["instance_uuid"], "host": host, "node": host, "power_state": power_state, **extra}


def run(inp: dict[str, Any], *, until: str | None = None, twice: bool = False) -> dict[str, Any]:
    """Run the steps in order; stop before ``until`` (a state name) as its Catch would see the document.

    Lambda steps named by ``until`` do run (their writes stay, as when a step fails after
    committing) but their result is not stored. With ``twice`` every step runs two times.
    """
    doc = resize.validate_input({"input": inp, "execution_name": inp["execution_name"]})

    def step(name: str, key: str | None, fn: Any) -> bool:
        result = fn(doc)
        if twice:
            result = fn(doc)
        if name == until:
            return False
        if key:
            doc[key] = result
        return True

    if until == "SelectMoveDestinations":
        return doc
    if not step("SelectMoveDestinations", "destination", resize.select_destinations):
        return doc
    if not step("PrepResizeAtDest", "prep", resize.prep_resize_at_dest) or until == "PrepResizeOnDestHost":
        return doc
    protocol.validate(doc["prep"]["args"], protocol.ARGS_SCHEMAS[protocol.PREP_RESIZE])
    doc["claim"] = host_result(doc, doc["destination"]["host"], states.NOSTATE, claimed=True)
    if not step("ResizeInstanceAtSource", "resize", resize.resize_instance_at_source):
        return doc
    protocol.validate(doc["resize"]["args"], protocol.ARGS_SCHEMAS[protocol.RESIZE_INSTANCE])
    if until == "ResizeInstanceOnSourceHost":
        return doc
    was_running = instance(doc["instance_uuid"]).power_state == states.RUNNING
    doc["resized"] = host_result(doc, doc["move"]["source"]["host"], states.SHUTDOWN, was_running=was_running,
                                 disks=DISKS)
    if not step("FinishResizeAtDest", "finish", resize.finish_resize_at_dest):
        return doc
    protocol.validate(doc["finish"]["args"], protocol.ARGS_SCHEMAS[protocol.FINISH_RESIZE])
    if until == "FinishResizeOnDestHost":
        return doc
    power = states.RUNNING if doc["finish"]["args"]["power_on"] else states.SHUTDOWN
    doc["finished"] = host_result(doc, doc["destination"]["host"], power, disks=DISKS)
    step("MarkResized", None, resize.mark_resized)
    return doc


def fail_and_roll_back(doc: dict[str, Any], error: str = "Ferry.HypervisorError", cause: str = "it broke",
                       **extra: Any) -> dict[str, Any]:
    """What the Catch branches do: revert at the destination, restore the source, then RollbackMove."""
    doc = {**doc, "error": {"Error": error, "Cause": cause}, **extra}
    if "resize" in doc and "restore_error" not in doc:
        power = states.RUNNING if doc["move"]["restore_args"]["power_on"] else states.SHUTDOWN
        doc.setdefault("restored", host_result(doc, doc["move"]["source"]["host"], power))
    resize.rollback_move(doc)
    return doc


# --- ValidateInput ------------------------------------------------------------------------------


def test_validate_input_returns_the_move_and_changes_nothing(cloud):
    uuid = make_server(volume=True)
    inp = prepare_move(uuid, BIG)
    before = snapshot(uuid)

    doc = resize.validate_input({"input": {k: v for k, v in inp.items() if k != "execution_name"},
                                 "execution_name": "named-by-the-execution"})

    assert snapshot(uuid) == before
    assert doc["execution_name"] == "named-by-the-execution"
    move = doc["move"]
    assert move["migration_type"] == "resize"
    assert (move["source"]["host"], move["source"]["node"], move["source"]["power_state"]) == (SOURCE, SOURCE, 1)
    assert move["source"]["queue_url"].endswith(protocol.host_queue_name(config.get().host_queue_prefix, SOURCE))
    assert move["transfer"] == {"bucket": config.get().image_bucket, "prefix": f"transfers/{inp['migration_uuid']}"}
    restore = move["restore_args"]
    protocol.validate(restore, protocol.ARGS_SCHEMAS[protocol.FINISH_REVERT_RESIZE])
    assert restore["flavor"] == resize.host_flavor(SMALL) and restore["power_on"] is True
    assert restore["volumes"] == [{"volume_id": f"vol-{uuid[:8]}", "path": f"/srv/volumes/vol-{uuid[:8]}",
                                   "device": "vdb", "boot_index": None}]
    with api_session() as session:
        port = session.scalars(select(Port).where(Port.device_id == uuid)).one()
        assert restore["ports"] == [{"id": port.id, "mac_address": port.mac_address}]


@pytest.mark.parametrize("change", [
    {"migration_uuid": None},
    {"instance_uuid": "not-a-uuid"},
    {"surprise": True},
    {"requested_host": ""},
    {"cell": 3},
], ids=["missing-migration", "bad-uuid", "unknown-key", "empty-host", "cell-not-a-string"])
def test_input_not_matching_the_schema_is_refused_and_changes_nothing(cloud, change):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    before = snapshot(uuid)
    bad = {k: v for k, v in {**inp, **change}.items() if v is not None}

    with pytest.raises(errors.InvalidWorkflowInput):
        resize.validate_input({"input": bad, "execution_name": "x"})

    assert snapshot(uuid) == before


def _no_migration(inp):
    return {**inp, "migration_uuid": str(uuidlib.uuid4())}


def _not_prepared(inp):
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=None))
    return inp


def _migration_moved_on(inp):
    with cell_session("cell1") as session:
        session.execute(Migration.__table__.update().values(status="error"))
    return inp


def _wrong_cell(inp):
    return {**inp, "cell": "cell2"}


def _unknown_instance(inp):
    return {**inp, "instance_uuid": str(uuidlib.uuid4())}


@pytest.mark.parametrize("spoil", [_no_migration, _not_prepared, _migration_moved_on, _wrong_cell,
                                   _unknown_instance], ids=lambda f: f.__name__.strip("_"))
def test_a_move_the_api_did_not_prepare_is_refused_and_changes_nothing(cloud, spoil):
    uuid = make_server()
    inp = spoil(prepare_move(uuid, BIG))
    before = snapshot(uuid)

    with pytest.raises(errors.MoveNotPrepared):
        resize.validate_input({"input": inp, "execution_name": "x"})

    assert snapshot(uuid) == before


def test_the_layer_reads_the_same_input_schema_the_state_machine_documents():
    documented = json.loads((ROOT / "statemachine" / "resize.input.schema.json").read_text())

    assert resize.INPUT_SCHEMA == documented
    jsonschema.Draft202012Validator.check_schema(documented)


# --- SelectDestinations -------------------------------------------------------------------------


def test_select_moves_the_source_allocation_to_the_migration_and_claims_the_destination(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = resize.validate_input({"input": inp})

    dest = resize.select_destinations(doc)

    assert dest["host"] == "cell1-host2" and dest["same_host"] is False
    assert [a["host"] for a in dest["alternates"]] == ["cell1-host3"]
    source_rp, dest_rp = placement.provider_by_host(SOURCE), placement.provider_by_host("cell1-host2")
    assert placement.get_allocations(inp["migration_uuid"]) == {source_rp: {"VCPU": 1, "MEMORY_MB": 512,
                                                                            "DISK_GB": 1}}
    assert placement.get_allocations(uuid) == {dest_rp: {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}}
    assert events_of(uuid) == {resize.EVENT_MIGRATE: ("Success", None, True)}
    assert instance(uuid).task_state == states.RESIZE_PREP


@pytest.mark.parametrize("may_leave", [False, True], ids=["held", "may-leave"])
def test_a_move_held_to_its_disabled_cell_still_lands_there_and_one_that_may_leave_does_not(cloud, may_leave):
    # GIVEN the server's cell disabled (its hosts enabled), and the move allowed to leave it or not
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    with api_session() as session:
        session.execute(update(CellMapping).where(CellMapping.name == "cell1").values(disabled=True))
        row = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == uuid)).one()
        row.spec = {**row.spec, "allow_cross_cell_move": may_leave}
    doc = resize.validate_input({"input": inp})

    # THEN a move that may not leave it is scheduled there, as in Nova; one that may finds no
    # other cell with room here, and is not sent into the disabled cell
    if may_leave:
        with pytest.raises(errors.NoValidHost):
            resize.select_destinations(doc)
    else:
        assert resize.select_destinations(doc)["host"] == "cell1-host2"


def test_select_run_twice_claims_once(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = resize.validate_input({"input": inp})

    first = resize.select_destinations(doc)
    second = resize.select_destinations(doc)

    assert second["host"] == first["host"]
    assert used_on(first["host"]) == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}
    assert used_on(SOURCE) == {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 1}
    # the second run lists the alternates again, for a reschedule
    assert first["alternates"] and second["alternates"] == first["alternates"]


def test_select_run_twice_for_a_server_without_allocations_claims_once_and_gives_the_migration_nothing(cloud):
    # GIVEN a server whose allocations an operator removed
    uuid = make_server()
    placement.delete_allocations(uuid)
    inp = prepare_move(uuid, BIG)
    doc = resize.validate_input({"input": inp})

    # WHEN SelectDestinations runs twice (its first answer was lost)
    first = resize.select_destinations(doc)
    second = resize.select_destinations(doc)

    # THEN the second run finds the first one's claim: the migration holds nothing of it
    assert second["host"] == first["host"]
    assert placement.get_allocations(inp["migration_uuid"]) == {}
    assert placement.get_allocations(uuid) == {first["provider_uuid"]: {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}}
    assert {host: used_on(host) for host in HOSTS} == {
        host: ({"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3} if host == first["host"] else {}) for host in HOSTS}


def test_a_cold_migrate_never_stays_on_the_source(cloud, monkeypatch):
    monkeypatch.setenv("FERRY_ALLOW_RESIZE_TO_SAME_HOST", "true")
    config.reset()
    report("cell1-host2", memory_mb=256)
    report("cell1-host3", memory_mb=256)
    uuid = make_server()
    doc = resize.validate_input({"input": prepare_move(uuid)})

    with pytest.raises(errors.NoValidHost):
        resize.select_destinations(doc)


def test_a_same_host_resize_when_allowed_holds_old_and_new_on_one_provider(cloud, monkeypatch):
    monkeypatch.setenv("FERRY_ALLOW_RESIZE_TO_SAME_HOST", "true")
    config.reset()
    uuid = make_server()
    inp = prepare_move(uuid, BIG, requested_host=SOURCE)

    doc = run(inp)

    assert doc["destination"]["same_host"] is True
    source_rp = placement.provider_by_host(SOURCE)
    assert placement.get_allocations(inp["migration_uuid"]) == {source_rp: {"VCPU": 1, "MEMORY_MB": 512,
                                                                            "DISK_GB": 1}}
    assert placement.get_allocations(uuid) == {source_rp: {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}}
    assert used_on(SOURCE) == {"VCPU": 3, "MEMORY_MB": 1536, "DISK_GB": 4}
    with api_session() as session:
        port = session.scalars(select(Port).where(Port.device_id == uuid)).one()
        assert [(b.host, b.status) for b in port.bindings] == [(SOURCE, "ACTIVE")]
    assert instance(uuid).vm_state == states.RESIZED


def test_a_requested_host_is_the_only_candidate(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, requested_host="cell1-host3")
    doc = resize.validate_input({"input": inp})

    dest = resize.select_destinations(doc)

    assert dest["host"] == "cell1-host3" and dest["alternates"] == []


def test_no_valid_host_leaves_everything_as_before_and_records_no_fault(cloud):
    uuid = make_server()
    before = snapshot(uuid)
    inp = prepare_move(uuid, {**BIG, "flavorid": "9", "vcpus": 64})
    doc = resize.validate_input({"input": inp})
    with pytest.raises(errors.NoValidHost) as raised:
        resize.select_destinations(doc)
    cloud.drain()

    resize.rollback_move({**doc, "error": {"Error": "Ferry.NoValidHost", "Cause": raised.value.message}})

    assert snapshot(uuid) == before
    assert migration(inp["migration_uuid"]).status == "error"
    assert faults_of(uuid) == []
    result, host, finished = events_of(uuid)[resize.EVENT_MIGRATE]
    assert (result, finished) == ("Error", True)
    with cell_session("cell1") as session:
        event = session.scalars(select(InstanceActionEvent)).one()
        assert event.details.startswith("Ferry.NoValidHost: No valid host was found")
    [error] = cloud.drain()
    assert error["event_type"] == "instance.resize.error" and error["publisher_id"].startswith("conductor:")


def test_a_validation_that_broke_rolls_back_from_the_raw_input(cloud):
    uuid = make_server()
    before = snapshot(uuid)
    inp = prepare_move(uuid, BIG)

    event = {**inp, "error": {"Error": "Ferry.InjectedFault", "Cause": "the database went away"}}
    jsonschema.validate(event, resize.ROLLBACK_SCHEMA)  # what the RollbackMove handler checks first

    resize.rollback_move(event)

    assert snapshot(uuid) == before
    assert migration(inp["migration_uuid"]).status == "error"
    [fault] = faults_of(uuid)
    assert fault.message == "Ferry.InjectedFault" and fault.details == "Cause: the database went away"


# --- PrepResizeAtDest and RescheduleMove --------------------------------------------------------


def test_prep_records_the_destination_and_binds_ports_and_volumes_there_inactive(cloud):
    uuid = make_server(volume=True)
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="PrepResizeOnDestHost", twice=True)

    dest = doc["destination"]["host"]
    assert doc["prep"]["args"] == {"migration_uuid": inp["migration_uuid"], "flavor": resize.host_flavor(BIG),
                                   "same_host": False, "is_bfv": False}
    m = migration(inp["migration_uuid"])
    assert (m.dest_compute, m.dest_node, m.dest_host, m.status) == (dest, dest, dest, "pre-migrating")
    state = snapshot(uuid)
    assert list(state["ports"].values()) == [sorted([(SOURCE, "ACTIVE"), (dest, "INACTIVE")])]
    assert state["attachments"] == sorted([(f"vol-{uuid[:8]}", SOURCE, "vdb", "attached"),
                                           (f"vol-{uuid[:8]}", dest, "vdb", "reserved")])
    assert events_of(uuid)[resize.EVENT_PREP] == (None, dest, False)
    published = [(n["event_type"], n["publisher_id"]) for n in cloud.drain()]
    assert ("instance.resize_prep.start", f"compute:{dest}") in published


def boot_from_volume(uuid: str) -> None:
    """Make the server volume-backed: its boot device (boot_index 0) a volume."""
    with cell_session("cell1") as session:
        session.add(BlockDeviceMapping(instance_uuid=uuid, source_type="volume", destination_type="volume",
                                       device_name="vda", boot_index=0, volume_id=f"root-{uuid[:8]}"))


def test_prep_tells_the_destination_a_volume_backed_server_has_no_root_disk_there(cloud):
    # GIVEN a volume-backed server being resized
    uuid = make_server()
    boot_from_volume(uuid)

    # WHEN PrepResizeAtDest builds the destination's prep_resize arguments
    doc = run(prepare_move(uuid, BIG), until="PrepResizeOnDestHost")

    # THEN they say so, for the claim to count no root disk, and they are what the agent accepts
    assert doc["prep"]["args"]["is_bfv"] is True
    protocol.validate(doc["prep"]["args"], protocol.ARGS_SCHEMAS[protocol.PREP_RESIZE])


def test_a_refused_claim_moves_to_the_alternate_and_releases_the_refusing_host(cloud):
    uuid = make_server(volume=True)
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="PrepResizeOnDestHost")
    refused = doc["destination"]
    doc["error"] = dict(CLAIM_REFUSED)

    new = resize.reschedule_move(doc)
    again = resize.reschedule_move(doc)

    assert new["host"] == again["host"] == "cell1-host3" and new["alternates"] == []
    assert used_on(refused["host"]) == {}
    assert placement.get_allocations(uuid) == {new["provider_uuid"]: {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}}
    assert placement.get_allocations(inp["migration_uuid"]) == {
        placement.provider_by_host(SOURCE): {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 1}}
    state = snapshot(uuid)
    assert list(state["ports"].values()) == [[(SOURCE, "ACTIVE")]]
    assert state["attachments"] == [(f"vol-{uuid[:8]}", SOURCE, "vdb", "attached")]
    assert migration(inp["migration_uuid"]).dest_compute is None

    doc = {k: v for k, v in doc.items() if k not in ("prep", "error")} | {"destination": new}
    doc["prep"] = resize.prep_resize_at_dest(doc)
    assert migration(inp["migration_uuid"]).dest_compute == "cell1-host3"


def test_a_refused_claim_of_a_server_without_allocations_moves_to_the_alternate_and_the_migration_takes_nothing(
        cloud):
    # GIVEN a server whose allocations an operator removed, its destination refusing the claim
    uuid = make_server()
    placement.delete_allocations(uuid)
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="PrepResizeOnDestHost")
    refused = doc["destination"]
    doc["error"] = dict(CLAIM_REFUSED)

    # WHEN the move is rescheduled (twice: delivered again)
    new = resize.reschedule_move(doc)
    again = resize.reschedule_move(doc)

    # THEN the claim moved to the alternate, and the refused claim was not handed to the migration
    assert new["host"] == again["host"] == "cell1-host3"
    assert placement.get_allocations(uuid) == {new["provider_uuid"]: {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}}
    assert placement.get_allocations(inp["migration_uuid"]) == {}
    assert (used_on(refused["host"]), used_on(SOURCE)) == ({}, {})


def test_no_reschedule_when_a_host_was_requested(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, requested_host="cell1-host2")
    doc = run(inp, until="PrepResizeOnDestHost")

    with pytest.raises(errors.NoValidHost):
        resize.reschedule_move({**doc, "destination": {**doc["destination"], "alternates": [
            {"host": "cell1-host3", "node": "cell1-host3", "cell": "cell1",
             "provider_uuid": placement.provider_by_host("cell1-host3"), "allocations": {}}]}})

    assert used_on("cell1-host2") == {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 1}


def test_reschedule_fails_when_no_alternate_fits_any_more(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="PrepResizeOnDestHost")
    report("cell1-host3", memory_mb=512)

    with pytest.raises(errors.NoValidHost):
        resize.reschedule_move(doc)
    fail_and_roll_back(doc, CLAIM_REFUSED["Error"], CLAIM_REFUSED["Cause"],
                       reschedule_error={"Error": "Ferry.NoValidHost", "Cause": "No valid host"})

    assert used_on("cell1-host2") == used_on("cell1-host3") == {}
    assert placement.get_allocations(uuid) == {placement.provider_by_host(SOURCE): {"VCPU": 1, "MEMORY_MB": 512,
                                                                                    "DISK_GB": 1}}
    [fault] = faults_of(uuid)
    # the owner reads the failure's name; its text and the reschedule's are the admins'
    assert fault.message == "Ferry.ResizeClaimFailed"
    assert "Rescheduling to an alternate host failed" in fault.details and "Cause: no NUMA room" in fault.details


# --- forward to VERIFY_RESIZE -------------------------------------------------------------------


def test_a_resize_reaches_verify_resize_with_migration_based_allocations(cloud):
    uuid = make_server(volume=True)
    inp = prepare_move(uuid, BIG)

    doc = run(inp, twice=True)

    dest = doc["destination"]["host"]
    server = instance(uuid)
    assert (server.vm_state, server.task_state, server.power_state) == ("resized", None, states.RUNNING)
    assert (server.host, server.node, server.flavor, server.old_flavor) == (dest, dest, BIG, SMALL)
    assert states.api_status(server.vm_state, server.task_state) == "VERIFY_RESIZE"
    m = migration(inp["migration_uuid"])
    assert (m.status, m.dest_compute, m.source_compute) == ("finished", dest, SOURCE)
    assert placement.get_allocations(inp["migration_uuid"]) == {
        placement.provider_by_host(SOURCE): {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 1}}
    assert placement.get_allocations(uuid) == {
        placement.provider_by_host(dest): {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 3}}
    state = snapshot(uuid)
    assert list(state["ports"].values()) == [sorted([(SOURCE, "INACTIVE"), (dest, "ACTIVE")])]
    assert state["attachments"] == sorted([(f"vol-{uuid[:8]}", SOURCE, "vdb", "attached"),
                                           (f"vol-{uuid[:8]}", dest, "vdb", "attached")])
    assert events_of(uuid) == {resize.EVENT_MIGRATE: ("Success", None, True),
                               resize.EVENT_PREP: ("Success", dest, True),
                               resize.EVENT_RESIZE: ("Success", SOURCE, True),
                               resize.EVENT_FINISH: ("Success", dest, True)}
    finish = doc["finish"]["args"]
    assert finish["disks"] == DISKS and finish["power_on"] is True and finish["old_flavor"] == resize.host_flavor(SMALL)
    assert finish["volumes"] == [{"volume_id": f"vol-{uuid[:8]}", "path": f"/srv/volumes/vol-{uuid[:8]}",
                                  "device": "vdb", "boot_index": None}]
    assert doc["resize"]["args"]["transfer"]["prefix"] == f"transfers/{inp['migration_uuid']}"
    published = {(n["event_type"], n["publisher_id"]) for n in cloud.drain()}
    assert published == {("instance.resize_prep.start", f"compute:{dest}"),
                         ("instance.resize_prep.end", f"compute:{dest}"),
                         ("instance.resize.start", f"compute:{SOURCE}"),
                         ("instance.resize.end", f"compute:{SOURCE}"),
                         ("instance.resize_finish.start", f"compute:{dest}"),
                         ("instance.resize_finish.end", f"compute:{dest}")}


def test_a_finish_resize_retried_after_its_commit_still_announces_the_resize_end(cloud, monkeypatch):
    # GIVEN FinishResizeAtDest committed the switch to the destination, then failed reading the
    # API database (the state retries it: Ferry.DatabaseUnavailable)
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="FinishResizeAtDest")
    cloud.drain()
    monkeypatch.setattr(resize, "_ports", lambda *_: (_ for _ in ()).throw(RuntimeError("API database away")))
    with pytest.raises(RuntimeError):
        resize.finish_resize_at_dest(doc)
    monkeypatch.undo()

    # WHEN it is retried
    resize.finish_resize_at_dest(doc)

    # THEN instance.resize.end went out (from the source), as did the finish's start
    published = {(n["event_type"], n["publisher_id"]) for n in cloud.drain()}
    assert ("instance.resize.end", f"compute:{SOURCE}") in published
    assert ("instance.resize_finish.start", f"compute:{doc['destination']['host']}") in published


def test_a_mark_resized_retried_after_its_commit_announces_the_finish_end(cloud):
    # GIVEN MarkResized committed VERIFY_RESIZE and failed before it published its end
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG))
    cloud.drain()  # what the committing run published is taken as lost

    # WHEN it is retried
    assert resize.mark_resized(doc) == {}

    # THEN the end goes out (the same message id as the first run's, for consumers to drop a repeat)
    assert [(n["event_type"], n["publisher_id"]) for n in cloud.drain()] == [
        ("instance.resize_finish.end", f"compute:{doc['destination']['host']}")]


@pytest.mark.parametrize("status", ["confirming", "confirmed", "reverting", "reverted"])
def test_mark_resized_run_again_after_a_confirm_or_revert_took_over_changes_nothing(cloud, status):
    """A redelivered MarkResized must not undo what the owner's confirm or revert has done since."""
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = run(inp)
    with cell_session("cell1") as session:
        session.scalars(select(Migration).where(Migration.uuid == inp["migration_uuid"])).one().status = status
        server = session.scalars(select(Instance).where(Instance.uuid == uuid)).one()
        server.task_state = "resize_reverting" if status == "reverting" else None
    with api_session() as session:
        for port in session.scalars(select(Port).where(Port.device_id == uuid)):
            for binding in port.bindings:
                binding.status = "INACTIVE"  # so that activating the destination's again would show
    before = snapshot(uuid)

    assert resize.mark_resized(doc) == {}

    assert snapshot(uuid) == before
    assert migration(inp["migration_uuid"]).status == status


def test_a_mark_resized_that_failed_after_it_committed_is_not_rolled_back(cloud):
    # GIVEN MarkResized committed VERIFY_RESIZE, then failed (its response lost, a timeout)
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = {**run(inp), "error": {"Error": "Sandbox.Timedout", "Cause": "Task timed out after 60.00 seconds"}}
    before = snapshot(uuid)

    # WHEN its Catch asks before rolling back
    answer = cross_cell.check_move_committed(doc)

    # THEN the move stands: the state machine ends as resized, and nothing was changed
    assert answer == {"committed": True}
    assert snapshot(uuid) == before
    server = instance(uuid)
    assert (server.vm_state, server.host) == (states.RESIZED, doc["destination"]["host"])


@pytest.mark.parametrize("status", ["confirming", "confirmed", "reverting", "reverted", "error"])
def test_a_move_the_owner_confirmed_or_reverted_since_its_last_step_committed_stands(cloud, status):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = {**run(inp), "error": {"Error": "Sandbox.Timedout", "Cause": "timed out"}}
    with cell_session("cell1") as session:
        session.scalars(select(Migration).where(Migration.uuid == inp["migration_uuid"])).one().status = status

    assert cross_cell.check_move_committed(doc) == {"committed": True}


def test_a_mark_resized_that_failed_before_it_committed_is_rolled_back(cloud):
    uuid = make_server()
    before = snapshot(uuid)
    doc = run(prepare_move(uuid, BIG), until="FinishResizeOnDestHost")
    doc["finished"] = host_result(doc, doc["destination"]["host"], states.RUNNING, disks=DISKS)

    assert cross_cell.check_move_committed({**doc, "error": {"Error": "Ferry.InjectedFault", "Cause": "x"}}) == {
        "committed": False}
    fail_and_roll_back(doc)
    assert snapshot(uuid) == before


def test_the_destinations_offer_of_a_direct_copy_reaches_the_source_and_the_copy_reaches_the_destination(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="ResizeInstanceAtSource")
    offer = {"instances_dir": "/var/lib/ferry/instances", "token": "4f1c"}
    doc["claim"] = host_result(doc, doc["destination"]["host"], states.NOSTATE, claimed=True, direct=offer)
    protocol.validate(doc["claim"], protocol.RESULT_SCHEMAS[protocol.PREP_RESIZE])

    args = resize.resize_instance_at_source(doc)["args"]

    protocol.validate(args, protocol.ARGS_SCHEMAS[protocol.RESIZE_INSTANCE])
    assert args["direct"] == offer and args["transfer"]["prefix"] == f"transfers/{inp['migration_uuid']}"
    doc["resized"] = host_result(doc, SOURCE, states.SHUTDOWN, was_running=True, disks=DISKS, direct=True)
    protocol.validate(doc["resized"], protocol.RESULT_SCHEMAS[protocol.RESIZE_INSTANCE])
    finish = resize.finish_resize_at_dest(doc)["args"]
    protocol.validate(finish, protocol.ARGS_SCHEMAS[protocol.FINISH_RESIZE])
    assert finish["direct"] is True and finish["disks"] == DISKS


def test_without_an_offer_the_disks_go_through_the_transfer(cloud):
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="ResizeInstanceAtSource")

    assert "direct" not in resize.resize_instance_at_source(doc)["args"]
    doc["resized"] = host_result(doc, SOURCE, states.SHUTDOWN, was_running=True, disks=DISKS)
    assert "direct" not in resize.finish_resize_at_dest(doc)["args"]


def test_a_stopped_server_stays_off_and_shows_verify_resize_with_power_state_4(cloud):
    uuid = make_server(vm_state=states.STOPPED, power_state=states.SHUTDOWN)
    inp = prepare_move(uuid)

    doc = run(inp)

    assert doc["finish"]["args"]["power_on"] is False
    assert doc["move"]["restore_args"]["power_on"] is False
    server = instance(uuid)
    assert (server.vm_state, server.power_state, server.old_vm_state) == ("resized", states.SHUTDOWN, "stopped")
    assert migration(inp["migration_uuid"]).migration_type == "migration"


def test_the_server_switches_host_when_the_disks_have_left_the_source(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="FinishResizeOnDestHost")

    server = instance(uuid)
    assert (server.task_state, server.host, server.flavor) == ("resize_finish", doc["destination"]["host"], SMALL)
    assert migration(inp["migration_uuid"]).status == "post-migrating"


# --- rollback -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES[1:])
def test_a_failure_at_any_stage_rolls_back_to_exactly_the_state_before(cloud, stage):
    uuid = make_server(volume=True)
    before = snapshot(uuid)
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until=stage)
    cloud.drain()

    doc = fail_and_roll_back(doc, "Ferry.DiskCopyFailed", f"failed at {stage}")
    resize.rollback_move(doc)

    assert snapshot(uuid) == before
    m = migration(inp["migration_uuid"])
    assert m.status == "error"
    [fault] = faults_of(uuid)
    assert (fault.message, fault.details) == ("Ferry.DiskCopyFailed", f"Cause: failed at {stage}")
    failed_event = {"PrepResizeAtDest": resize.EVENT_PREP, "PrepResizeOnDestHost": resize.EVENT_PREP,
                    "ResizeInstanceAtSource": resize.EVENT_RESIZE, "ResizeInstanceOnSourceHost": resize.EVENT_RESIZE,
                    "FinishResizeAtDest": resize.EVENT_FINISH, "FinishResizeOnDestHost": resize.EVENT_FINISH,
                    "MarkResized": resize.EVENT_FINISH}[stage]
    recorded = events_of(uuid)
    assert recorded[failed_event][0] == "Error"
    assert all(result == "Success" for name, (result, _host, _done) in recorded.items() if name != failed_event)
    assert all(done for _result, _host, done in recorded.values())
    errors_published = [n for n in cloud.drain() if n["event_type"] == "instance.resize.error"]
    assert len(errors_published) == 1
    assert errors_published[0]["payload"]["fault"] == {
        "message": "Ferry.DiskCopyFailed", "error": "Ferry.DiskCopyFailed", "details": f"Cause: failed at {stage}"}


def allow_same_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_ALLOW_RESIZE_TO_SAME_HOST", "true")
    config.reset()


@pytest.mark.parametrize("same_host", [False, True], ids=["other-host", "same-host"])
@pytest.mark.parametrize("stage", STAGES[1:])
def test_a_server_without_allocations_that_fails_to_move_holds_none_afterwards(cloud, monkeypatch, stage, same_host):
    # GIVEN a server whose allocations an operator removed: the migration takes nothing from it
    if same_host:
        allow_same_host(monkeypatch)
    uuid = make_server()
    placement.delete_allocations(uuid)
    before = snapshot(uuid)
    doc = run(prepare_move(uuid, BIG, requested_host=SOURCE if same_host else None), until=stage)
    assert placement.get_allocations(uuid)  # the destination was claimed for it

    # WHEN the move fails and rolls back (twice: the last step may run again)
    doc = fail_and_roll_back(doc)
    resize.rollback_move(doc)

    # THEN the destination claim is gone: nothing is held for it anywhere, as before the move
    assert snapshot(uuid) == before


def test_a_select_that_failed_after_claiming_for_a_server_without_allocations_leaves_no_claim(cloud, monkeypatch):
    # GIVEN a server whose allocations an operator removed
    uuid = make_server()
    placement.delete_allocations(uuid)
    before = snapshot(uuid)
    doc = resize.validate_input({"input": prepare_move(uuid, BIG)})

    # WHEN SelectDestinations fails after its claim committed, so the document names no destination
    def lost(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the connection to the cell database was lost")

    with monkeypatch.context() as patched:
        patched.setattr(actions, "finish_event", lost)
        with pytest.raises(RuntimeError):
            resize.select_destinations(doc)
    assert placement.get_allocations(uuid)
    resize.rollback_move({**doc, "error": {"Error": "RuntimeError", "Cause": "connection lost"}})

    # THEN the claim it made is gone all the same
    assert snapshot(uuid) == before


@pytest.mark.parametrize("same_host", [False, True], ids=["other-host", "same-host"])
def test_a_move_whose_source_allocation_was_removed_meanwhile_drops_its_claim_on_rollback(cloud, monkeypatch,
                                                                                         same_host):
    # GIVEN a move under way whose migration's allocation (the server's, on the source) an operator removed
    if same_host:
        allow_same_host(monkeypatch)
    uuid = make_server()
    inp = prepare_move(uuid, BIG, requested_host=SOURCE if same_host else None)
    doc = run(inp, until="FinishResizeOnDestHost")
    placement.delete_allocations(inp["migration_uuid"])

    # WHEN the move fails and rolls back, twice
    doc = fail_and_roll_back(doc)
    resize.rollback_move(doc)

    # THEN there was nothing to give back, and the destination claim went: the server holds nothing
    assert placement.get_allocations(uuid) == {}
    assert placement.get_allocations(inp["migration_uuid"]) == {}
    assert {host: used_on(host) for host in HOSTS} == dict.fromkeys(HOSTS, {})
    assert (instance(uuid).host, instance(uuid).flavor) == (SOURCE, SMALL)


def test_a_same_host_rollback_run_again_after_giving_the_allocation_back_keeps_it(cloud, monkeypatch):
    # GIVEN a same-host resize whose rollback gave the source allocation back, then failed
    allow_same_host(monkeypatch)
    uuid = make_server()
    before = snapshot(uuid)
    doc = run(prepare_move(uuid, BIG, requested_host=SOURCE), until="FinishResizeOnDestHost")

    def lost(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the connection to the API database was lost")

    with monkeypatch.context() as patched:
        patched.setattr(resize, "_release_destination", lost)
        with pytest.raises(RuntimeError):
            fail_and_roll_back(doc)
    assert placement.get_allocations(uuid) == before["allocations"][uuid]

    # WHEN the rollback runs again
    fail_and_roll_back(doc)

    # THEN the allocation given back is kept, and all is as before the move
    assert snapshot(uuid) == before


def recorded_before_claims(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` as steps wrote it before ValidateMoveInput recorded ``allocated`` and destinations their claim.

    What an execution in flight when those keys came in carries to its rollback.
    """
    old = json.loads(json.dumps(doc))
    old["move"]["source"].pop("allocated")
    for key in ("claimed", "claim_generation"):
        (old.get("destination") or {}).pop(key, None)
    return old


@pytest.mark.parametrize("allocated", [True, False], ids=["with-allocations", "without-allocations"])
@pytest.mark.parametrize("stage", ["PrepResizeAtDest", "FinishResizeOnDestHost"])
def test_a_move_whose_document_records_no_claim_rolls_back_as_before(cloud, stage, allocated):
    # GIVEN a move whose state document was written before claims were recorded, of a server with its
    # allocations, or without (an operator removed them)
    uuid = make_server()
    if not allocated:
        placement.delete_allocations(uuid)
    before = snapshot(uuid)
    doc = recorded_before_claims(run(prepare_move(uuid, BIG), until=stage))
    assert placement.get_allocations(uuid)  # the destination was claimed for it

    # WHEN the move fails and rolls back, twice
    doc = fail_and_roll_back(doc)
    resize.rollback_move(doc)

    # THEN the destination claim went, as the rollback did when the document was written: the instance
    # holds the destination's provider and not the source's
    assert snapshot(uuid) == before


def give_allocation_back(uuid: str) -> dict[str, dict[str, int]]:
    """What an operator does as ``ferry audit`` advises: the server's allocation, its flavor on its host."""
    given_back = {placement.provider_by_host(SOURCE): placement.resources_from_flavor(SMALL, False)}
    placement.claim(uuid, PROJECT, USER, given_back)
    return given_back


@pytest.mark.parametrize("move", ["cold-migrate", "resize-allowed-on-the-source"])
def test_an_allocation_given_back_before_scheduling_is_the_servers_not_an_earlier_claim(cloud, monkeypatch, move):
    # GIVEN a server whose allocations an operator removed, its move validated, then the allocation given back
    if move == "resize-allowed-on-the-source":
        allow_same_host(monkeypatch)
    uuid = make_server()
    placement.delete_allocations(uuid)
    inp = prepare_move(uuid, BIG if move.startswith("resize") else None)
    doc = resize.validate_input({"input": inp})
    assert doc["move"]["source"]["allocated"] is False
    given_back = give_allocation_back(uuid)

    # WHEN SelectMoveDestinations runs (twice: its first answer was lost)
    first = resize.select_destinations(doc)
    second = resize.select_destinations(doc)

    # THEN it scheduled (the source is no destination for what the server holds there): the migration holds
    # the allocation given back, as any source allocation, and the instance the claim of the new flavor
    flavor = BIG if move.startswith("resize") else SMALL
    assert first["host"] == second["host"] == "cell1-host2"
    assert placement.get_allocations(inp["migration_uuid"]) == given_back
    assert placement.get_allocations(uuid) == {first["provider_uuid"]: placement.resources_from_flavor(flavor, False)}

    # and a rollback gives the server back what it held
    fail_and_roll_back({**doc, "destination": second})
    assert placement.get_allocations(uuid) == given_back
    assert placement.get_allocations(inp["migration_uuid"]) == {}
    assert used_on("cell1-host2") == {}


def test_a_rollback_before_any_claim_keeps_an_allocation_given_back_meanwhile(cloud):
    # GIVEN a server whose allocations an operator removed, its move validated, then the allocation given back
    uuid = make_server()
    placement.delete_allocations(uuid)
    doc = resize.validate_input({"input": prepare_move(uuid, BIG)})
    given_back = give_allocation_back(uuid)

    # WHEN SelectMoveDestinations finds no host and the move rolls back
    resize.rollback_move({**doc, "error": {"Error": "NoValidHost", "Cause": "No valid host was found."}})

    # THEN what the server holds is not a claim of this move: it stays
    assert placement.get_allocations(uuid) == given_back


def test_a_rollback_of_a_server_deleted_before_its_claim_landed_releases_the_claim(cloud):
    # GIVEN a move whose claim landed after the server's delete had released its allocations
    # (an operator reset the server to error and deleted it while the scheduler ran)
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="PrepResizeAtDest")
    assert placement.get_allocations(uuid) != {}
    with cell_session("cell1") as session:
        session.get(Instance, instance(uuid).id).deleted = True

    # WHEN the move fails and rolls back, twice
    doc = fail_and_roll_back(doc, error="Ferry.InstanceNotFound", cause="deleted")
    resize.rollback_move(doc)

    # THEN neither the claim nor the migration's allocation is left, and the move's action says
    # how it ended
    assert placement.get_allocations(uuid) == placement.get_allocations(doc["migration_uuid"]) == {}
    assert {host: used_on(host) for host in HOSTS} == {host: {} for host in HOSTS}
    assert events_of(uuid) == {resize.EVENT_MIGRATE: ("Success", None, True),
                               resize.EVENT_PREP: ("Error", doc["destination"]["host"], True)}


def test_a_rollback_of_a_deleted_server_releases_the_claim_without_holding_its_cell(cloud, store, monkeypatch):
    # GIVEN a move whose server was deleted after its claim landed
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="PrepResizeAtDest")
    with cell_session("cell1") as session:
        session.get(Instance, instance(uuid).id).deleted = True
    open_meanwhile = looked_at_while_releasing(monkeypatch, store.cells["cell1"])

    # WHEN the move fails and rolls back
    doc = fail_and_roll_back(doc, error="Ferry.InstanceNotFound", cause="deleted")

    # THEN the claim and the migration's allocation were released while the cell stayed open to
    # other writers (a step holding the API database may wait for the cell), and the migration is
    # in error
    assert open_meanwhile == [True, True]
    assert placement.get_allocations(uuid) == placement.get_allocations(doc["migration_uuid"]) == {}
    assert migration(doc["migration_uuid"]).status == "error"


def test_a_rollback_leaves_a_server_a_delete_took_meanwhile_to_that_delete(cloud):
    # GIVEN a move waiting on its destination host, whose server an operator reset to error and
    # its owner then deleted (a server in error takes a delete whatever its task)
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="PrepResizeOnDestHost")
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == uuid).values(vm_state=states.ERROR, task_state=None))
        actions.start_action(session, instance_uuid=uuid, action=actions.DELETE, request_id="req-delete",
                             user_id="u1", project_id="demo")
        session.execute(update(Instance).where(Instance.uuid == uuid).values(task_state=states.DELETING))

    # WHEN the host operation times out and the move rolls back, twice
    doc = fail_and_roll_back(doc, error="States.Timeout", cause="timed out")
    resize.rollback_move(doc)

    # THEN the server is put back on its source, holding what it held there, and stays its
    # delete's (in error, task deleting): should the delete fail, it is a server in error there
    row = instance(uuid)
    assert (row.vm_state, row.task_state, row.host) == (states.ERROR, states.DELETING, doc["move"]["source"]["host"])
    assert placement.get_allocations(doc["migration_uuid"]) == {}
    assert list(placement.get_allocations(uuid)) == [placement.provider_by_host(doc["move"]["source"]["host"])]
    assert migration(doc["migration_uuid"]).status == "error"
    assert events_of(uuid)[resize.EVENT_PREP][0] == "Error"


@pytest.mark.parametrize("stage", ["PrepResizeAtDest", "FinishResizeOnDestHost"])
def test_a_rollback_keeps_an_allocation_given_back_in_place_of_the_claim(cloud, stage):
    # GIVEN a server whose allocations an operator removed, moving; then the operator sets its allocation on the
    # source again, which replaces the destination claim
    uuid = make_server()
    placement.delete_allocations(uuid)
    doc = run(prepare_move(uuid, BIG), until=stage)
    given_back = give_allocation_back(uuid)

    # WHEN the move fails and rolls back, twice
    doc = fail_and_roll_back(doc)
    resize.rollback_move(doc)

    # THEN the allocation is not the claim the move recorded, nor any claim of it: it stays
    assert placement.get_allocations(uuid) == given_back
    assert {host: used_on(host) for host in HOSTS} == {
        host: (placement.resources_from_flavor(SMALL, False) if host == SOURCE else {}) for host in HOSTS}


def test_a_reschedule_that_failed_after_claiming_for_a_server_without_allocations_leaves_no_claim(cloud, monkeypatch):
    # GIVEN a server whose allocations an operator removed, its destination refusing the claim
    uuid = make_server()
    placement.delete_allocations(uuid)
    before = snapshot(uuid)
    doc = run(prepare_move(uuid, BIG), until="PrepResizeOnDestHost")
    doc["error"] = dict(CLAIM_REFUSED)

    # WHEN RescheduleMove fails after claiming the alternate, so the document keeps the refused destination
    def lost(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the connection to the API database was lost")

    with monkeypatch.context() as patched:
        patched.setattr(resize, "_destination", lost)
        with pytest.raises(RuntimeError):
            resize.reschedule_move(doc)
    assert used_on("cell1-host3")
    resize.rollback_move({**doc, "reschedule_error": {"Error": "RuntimeError", "Cause": "connection lost"}})

    # THEN the alternate's claim is gone all the same
    assert snapshot(uuid) == before


def test_a_reschedule_hands_the_migration_an_allocation_given_back_in_place_of_the_claim(cloud):
    # GIVEN a server whose allocations an operator removed, its destination claimed and refusing it; meanwhile
    # the operator set the server's allocation on the source again, which replaced the claim
    uuid = make_server()
    placement.delete_allocations(uuid)
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="PrepResizeOnDestHost")
    doc["error"] = dict(CLAIM_REFUSED)
    given_back = give_allocation_back(uuid)

    # WHEN the move is rescheduled (twice: delivered again), then fails on the alternate and rolls back
    new = resize.reschedule_move(doc)
    assert resize.reschedule_move(doc)["host"] == new["host"] == "cell1-host3"

    # THEN the migration took what the server held, as a source allocation, and the rollback gives it back
    assert placement.get_allocations(inp["migration_uuid"]) == given_back
    assert placement.get_allocations(uuid) == {new["provider_uuid"]: placement.resources_from_flavor(BIG, False)}
    fail_and_roll_back({k: v for k, v in doc.items() if k not in ("prep", "error")} | {"destination": new})
    assert placement.get_allocations(uuid) == given_back
    assert placement.get_allocations(inp["migration_uuid"]) == {}
    assert {host: used_on(host) for host in HOSTS} == {
        host: (placement.resources_from_flavor(SMALL, False) if host == SOURCE else {}) for host in HOSTS}


def validated_then_allocation_removed(uuid: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A move of ``uuid`` validated while it held its allocation, which an operator removed right after."""
    before = snapshot(uuid)
    doc = resize.validate_input({"input": prepare_move(uuid, BIG)})
    assert doc["move"]["source"]["allocated"] is True
    placement.delete_allocations(uuid)
    return doc, {**before, "allocations": {}, "usage": dict.fromkeys(HOSTS, {})}


def test_select_run_twice_after_the_allocation_was_removed_since_validation_claims_once(cloud):
    # GIVEN a server validated with its allocation, which an operator removed before scheduling
    uuid = make_server()
    doc, before = validated_then_allocation_removed(uuid)

    # WHEN SelectMoveDestinations runs twice (its first answer was lost), then the move rolls back
    first = resize.select_destinations(doc)
    second = resize.select_destinations(doc)

    # THEN the second run found the first one's claim and gave the migration none of it; the rollback drops it
    assert second["host"] == first["host"]
    assert placement.get_allocations(doc["migration_uuid"]) == {}
    assert placement.get_allocations(uuid) == {first["provider_uuid"]: placement.resources_from_flavor(BIG, False)}
    fail_and_roll_back({**doc, "destination": second})
    assert snapshot(uuid) == before


def test_a_reschedule_after_the_allocation_was_removed_since_validation_moves_the_claim(cloud):
    # GIVEN a server validated with its allocation, which an operator removed before scheduling; its
    # destination claimed and refusing it
    uuid = make_server()
    doc, before = validated_then_allocation_removed(uuid)
    doc["destination"] = resize.select_destinations(doc)
    doc["prep"] = resize.prep_resize_at_dest(doc)
    doc["error"] = dict(CLAIM_REFUSED)

    # WHEN the move is rescheduled, then fails on the alternate and rolls back (twice)
    new = resize.reschedule_move(doc)
    assert placement.get_allocations(doc["migration_uuid"]) == {}
    doc = fail_and_roll_back({k: v for k, v in doc.items() if k not in ("prep", "error")} | {"destination": new})
    resize.rollback_move(doc)

    # THEN the refused claim was not handed to the migration as if it were the source's: no claim is left
    assert snapshot(uuid) == before


def test_a_resize_to_a_flavor_of_the_same_size_that_may_stay_on_its_host_is_scheduled(cloud, monkeypatch):
    # GIVEN resizes may stay on their host, and a server resized to a flavor that differs only in
    # its extra specs (its allocation on the source is exactly what a claim of the new one holds)
    allow_same_host(monkeypatch)
    uuid = make_server()
    before = placement.get_allocations(uuid)
    same_size = {**SMALL, "flavorid": "3", "name": "ferry.tiny-gen2", "extra_specs": {"hw:cpu_policy": "shared"}}
    doc = resize.validate_input({"input": prepare_move(uuid, same_size)})

    # WHEN SelectMoveDestinations runs (twice: its first answer lost)
    doc["destination"] = resize.select_destinations(doc)
    again = resize.select_destinations(doc)

    # THEN the move was scheduled (not taken for an earlier run's claim): the migration holds the
    # server's allocation, the instance the claim, and the second run found that claim
    assert again["host"] == doc["destination"]["host"]
    assert placement.get_allocations(doc["migration_uuid"]) == before
    assert placement.get_allocations(uuid) == doc["destination"]["claimed"]
    assert doc["destination"]["alternates"]  # the scheduler ran: it lists the hosts after the chosen one

    # and a rollback gives the server back exactly what it held
    fail_and_roll_back(doc)
    assert placement.get_allocations(uuid) == before
    assert placement.get_allocations(doc["migration_uuid"]) == {}


def test_a_rollback_on_one_host_keeps_an_allocation_given_back_that_a_claim_would_equal(cloud, monkeypatch):
    # GIVEN a server whose allocations an operator removed, resized on its host to a flavor of the same size;
    # SelectMoveDestinations failed after its claim, so the document records none
    allow_same_host(monkeypatch)
    uuid = make_server()
    placement.delete_allocations(uuid)
    doc = resize.validate_input({"input": prepare_move(uuid, {**SMALL, "flavorid": "3", "name": "ferry.tiny2"},
                                                       requested_host=SOURCE)})

    def lost(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the connection to the cell database was lost")

    with monkeypatch.context() as patched:
        patched.setattr(actions, "finish_event", lost)
        with pytest.raises(RuntimeError):
            resize.select_destinations(doc)
    # and the operator set the server's allocation on its host again: the same as the claim
    given_back = give_allocation_back(uuid)

    # WHEN the move rolls back
    resize.rollback_move({**doc, "error": {"Error": "RuntimeError", "Cause": "connection lost"}})

    # THEN on one host the allocations alone do not prove a claim: what the server holds stays
    assert placement.get_allocations(uuid) == given_back


def test_a_stopped_server_that_fails_to_move_stays_stopped(cloud):
    uuid = make_server(vm_state=states.STOPPED, power_state=states.SHUTDOWN)
    before = snapshot(uuid)
    doc = run(prepare_move(uuid), until="FinishResizeOnDestHost")

    fail_and_roll_back(doc)

    assert snapshot(uuid) == before
    assert doc["move"]["restore_args"]["power_on"] is False


def test_a_source_that_cannot_be_restored_is_error_with_a_fault_saying_what_is_left_where(cloud):
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="FinishResizeOnDestHost")
    dest = doc["destination"]["host"]

    fail_and_roll_back(doc, "Ferry.DiskCopyFailed", "checksum mismatch",
                       restore_error={"Error": "Ferry.HypervisorError", "Cause": "libvirt refused the domain"})

    server = instance(uuid)
    assert (server.vm_state, server.task_state, server.host, server.flavor) == ("error", None, SOURCE, SMALL)
    assert placement.get_allocations(uuid) == {placement.provider_by_host(SOURCE): {"VCPU": 1, "MEMORY_MB": 512,
                                                                                    "DISK_GB": 1}}
    assert used_on(dest) == {}
    [fault] = faults_of(uuid)
    assert f"{uuid}_resize there" in fault.message and "the destination host was cleaned up" in fault.message
    assert SOURCE not in fault.message and dest not in fault.message  # the owner reads it: hosts are in the details
    assert f"{uuid}_resize on {SOURCE}" in fault.details
    assert "libvirt refused the domain" in fault.details and "checksum mismatch" in fault.details


CLEANUP_TIMED_OUT = {"Error": "States.Timeout", "Cause": ""}


@pytest.mark.parametrize("stage", ["ResizeInstanceOnSourceHost", "FinishResizeAtDest"])
def test_a_destination_that_could_not_be_cleaned_before_finish_resize_was_sent_is_named_in_the_fault(cloud, stage):
    # GIVEN a move that failed before finish_resize was sent: no guest of the server was made on the destination
    uuid = make_server(volume=True)
    before = snapshot(uuid)
    doc = run(prepare_move(uuid, BIG), until=stage)
    dest = doc["destination"]["host"]

    # WHEN the destination cannot be cleaned up
    fail_and_roll_back(doc, cleanup_error=CLEANUP_TIMED_OUT)

    # THEN the server is restored as it was, running on its source; the fault names the destination
    assert snapshot(uuid) == before
    [fault] = faults_of(uuid)
    assert fault.message == "Ferry.HypervisorError"
    assert dest in fault.details and "may remain there" in fault.details and "Cause: it broke" in fault.details


def test_a_destination_that_may_still_run_the_guest_leaves_the_server_in_error_shut_off_on_its_source(cloud):
    # GIVEN a volume-backed server whose move failed after finish_resize may have been sent to the destination
    uuid = make_server(volume=True)
    before = snapshot(uuid)
    inp = prepare_move(uuid, BIG)
    doc = run(inp, until="FinishResizeOnDestHost")
    dest = doc["destination"]["host"]
    cloud.drain()

    # WHEN cleaning up the destination failed, and the source guest was restored shut off (KeepSourceGuestOff)
    doc = fail_and_roll_back(doc, "Ferry.DiskCopyFailed", "finish_resize timed out",
                             cleanup_error={"Error": "States.Timeout", "Cause": "no heartbeat from the agent"},
                             restored=host_result(doc, SOURCE, states.SHUTDOWN))

    # THEN the server is in ERROR on its source, shut off, with its old flavor and the source's allocations
    record = {**before["record"], "vm_state": states.ERROR, "power_state": states.SHUTDOWN}
    assert snapshot(uuid) == {**before, "record": record}
    assert (record["host"], record["flavor"], record["task_state"]) == (SOURCE, SMALL, None)
    assert used_on(dest) == {}
    assert migration(inp["migration_uuid"]).status == "error"
    # and the fault says what is left where and what to do, in that order
    [fault] = faults_of(uuid)
    assert fault.message == ("Resize failed and the destination host could not be cleaned up: a guest of this "
                             "server may still run there.")  # the owner reads it: host names are in the details
    assert fault.host == dest
    details = fault.details
    for part in (f"Cleaning up destination host {dest} failed (no heartbeat from the agent)",
                 "a guest of this server may still run there", f"source host {SOURCE}", "not powered on",
                 f"Destroy the guest on {dest} first", "guest_orphan",
                 f"openstack server set --state active {uuid}", f"openstack server stop {uuid}",
                 f"openstack server start {uuid}", "finish_resize timed out"):
        assert part in details, part
    # in the order they must run: a reset to active leaves the guest off, and only a stopped server starts
    steps = ["Destroy the guest on", "openstack server set --state active", "openstack server stop",
             "openstack server start"]
    assert [details.index(step) for step in steps] == sorted(details.index(step) for step in steps)
    assert events_of(uuid)[resize.EVENT_FINISH][0] == "Error"
    [published] = [n for n in cloud.drain() if n["event_type"] == "instance.resize.error"]
    assert published["payload"]["fault"]["message"] == fault.message

    # WHEN the rollback runs again THEN nothing changes
    resize.rollback_move(doc)
    assert snapshot(uuid) == {**before, "record": record}
    assert len(faults_of(uuid)) == 1


def test_a_stopped_server_whose_destination_may_still_hold_the_guest_is_in_error_and_not_told_to_start(cloud):
    uuid = make_server(vm_state=states.STOPPED, power_state=states.SHUTDOWN)
    doc = run(prepare_move(uuid), until="MarkResized")

    fail_and_roll_back(doc, cleanup_error=CLEANUP_TIMED_OUT)

    server = instance(uuid)
    assert (server.vm_state, server.task_state, server.power_state, server.host) == (
        states.ERROR, None, states.SHUTDOWN, SOURCE)
    [fault] = faults_of(uuid)
    assert "openstack server set --state active" in fault.details and "was stopped before the move" in fault.details
    assert "openstack server stop" in fault.details and "openstack server start" not in fault.details


def test_a_same_host_resize_whose_clean_up_failed_is_restored_as_before(cloud, monkeypatch):
    # GIVEN a resize on one host: the source's restore replaces the only guest the host can have of the server
    allow_same_host(monkeypatch)
    uuid = make_server()
    before = snapshot(uuid)
    doc = run(prepare_move(uuid, BIG, requested_host=SOURCE), until="FinishResizeOnDestHost")
    assert doc["destination"]["same_host"] is True

    fail_and_roll_back(doc, cleanup_error=CLEANUP_TIMED_OUT)

    assert snapshot(uuid) == before


def test_rollback_after_it_finished_changes_nothing(cloud):
    uuid = make_server()
    doc = fail_and_roll_back(run(prepare_move(uuid, BIG), until="ResizeInstanceOnSourceHost"))
    after = snapshot(uuid)

    resize.rollback_move(doc)

    assert snapshot(uuid) == after
    assert len(faults_of(uuid)) == 1
