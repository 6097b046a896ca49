"""The resize state machine on the whole local stack, with real host agents on the libvirt test driver.

A server is booted through the compute API; the move is then prepared in the store exactly as
the compute API's contract says and the execution is started directly with boto3, as an
operator can. The server reaches VERIFY_RESIZE on the other host with its disks there, and a
failure on the destination rolls back to the server as it was, its guest running on the source.
"""

from __future__ import annotations

import json
import time
import uuid as uuidlib
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from sqlalchemy import select

from ferry import faults, placement
from ferry.compute import actions, states
from ferry.compute.api import flavor_snapshot
from ferry.local.stack import LocalStack
from ferry.store.api_models import Flavor
from ferry.store.cell_models import Instance, InstanceFault, Migration
from ferry.store.db import api_session, cell_session

WAIT = 120.0


class Stack:
    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        assert stack.aws is not None and stack.model is not None and stack.seeded is not None
        self.sfn = stack.aws.client("stepfunctions")
        self.arn = stack.model.state_machines["ResizeStateMachine"].arn
        self.api = requests.Session()
        self.api.headers["X-Auth-Token"] = stack.seeded.tokens["demo"]
        self.api.headers["OpenStack-API-Version"] = "compute latest"

    def boot(self) -> str:
        body = {"server": {"name": "mover", "flavorRef": "1", "imageRef": self.stack.seeded.image["id"],
                           "networks": "auto"}}
        response = self.api.post(self.stack.api_url + "/servers", json=body, timeout=60)
        assert response.status_code == 202, response.text
        server_id = response.json()["server"]["id"]
        self.wait(lambda: self.status(server_id) == "ACTIVE", f"{server_id} ACTIVE")
        return server_id

    def status(self, server_id: str) -> str:
        response = self.api.get(f"{self.stack.api_url}/servers/{server_id}", timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["server"]["status"]

    @staticmethod
    def wait(condition: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not condition():
            assert time.monotonic() < deadline, f"gave up waiting for {what}"
            time.sleep(0.2)

    def prepare_move(self, server_id: str, flavorid: str) -> dict[str, Any]:
        """What the compute API writes for a resize (its contract with the workflow)."""
        with api_session() as session:
            new_flavor = flavor_snapshot(session.scalars(select(Flavor).where(Flavor.flavorid == flavorid)).one())
        migration_uuid, request_id = str(uuidlib.uuid4()), f"req-{uuidlib.uuid4()}"
        with cell_session("cell1") as session:
            instance = session.scalars(select(Instance).where(Instance.uuid == server_id)).one()
            instance.task_state, instance.old_vm_state = states.RESIZE_PREP, instance.vm_state
            instance.old_flavor, instance.new_flavor = instance.flavor, new_flavor
            session.add(Migration(uuid=migration_uuid, instance_uuid=server_id, source_compute=instance.host,
                                  source_node=instance.node, status="pre-migrating", migration_type="resize",
                                  old_instance_type_id=instance.flavor.get("id"),
                                  new_instance_type_id=new_flavor["id"]))
            actions.start_action(session, instance_uuid=server_id, action=actions.RESIZE, request_id=request_id,
                                 user_id=instance.user_id, project_id=instance.project_id)
        return {"instance_uuid": server_id, "migration_uuid": migration_uuid, "cell": "cell1",
                "request_id": request_id, "requested_host": None}

    def run(self, document: dict[str, Any]) -> dict[str, Any]:
        name = f"resize-{document['instance_uuid']}-{document['migration_uuid'][:8]}"
        arn = self.sfn.start_execution(stateMachineArn=self.arn, name=name, input=json.dumps(document))[
            "executionArn"]
        deadline = time.monotonic() + WAIT
        while True:
            described = self.sfn.describe_execution(executionArn=arn)
            if described["status"] != "RUNNING":
                return described
            assert time.monotonic() < deadline, f"{name} still running"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("resize-stack")
    import os

    previous = os.environ.get(faults.ENV_VAR)
    os.environ[faults.ENV_VAR] = str(state / "faults.json")
    stack = LocalStack(state, cells=1, hosts_per_cell=2, moto_port=0, api_port=0, agent_mode="thread",
                       host_op_timeout_seconds=60, host_op_heartbeat_seconds=30)
    stack.start()
    try:
        yield Stack(stack)
    finally:
        faults.disarm_all()
        stack.stop()
        if previous is None:
            os.environ.pop(faults.ENV_VAR, None)
        else:
            os.environ[faults.ENV_VAR] = previous


def record(server_id: str) -> Instance:
    with cell_session("cell1") as session:
        return session.scalars(select(Instance).where(Instance.uuid == server_id)).one()


def test_a_directly_started_resize_reaches_verify_resize_with_the_disks_on_the_destination(local):
    server_id = local.boot()
    source = record(server_id).host
    document = local.prepare_move(server_id, "2")

    described = local.run(document)

    assert described["status"] == "SUCCEEDED", described
    assert local.status(server_id) == "VERIFY_RESIZE"
    server = record(server_id)
    dest = server.host
    assert dest != source and server.flavor["flavorid"] == "2" and server.power_state == states.RUNNING
    assert (local.stack.instances_dir(dest) / server_id).is_dir()
    assert placement.get_allocations(document["migration_uuid"]) == {
        placement.provider_by_host(source): placement.resources_from_flavor(server.old_flavor, False)}
    assert placement.get_allocations(server_id) == {
        placement.provider_by_host(dest): placement.resources_from_flavor(server.flavor, False)}


def test_a_failure_on_the_destination_rolls_back_to_the_source_as_it_was(local):
    server_id = local.boot()
    before = record(server_id)
    allocations = placement.get_allocations(server_id)
    faults.arm("*:finish_resize", error="DiskCopyFailed")
    document = local.prepare_move(server_id, "2")

    described = local.run(document)

    assert (described["status"], described["error"]) == ("FAILED", "Ferry.DiskCopyFailed"), described
    after = record(server_id)
    assert (after.host, after.node, after.flavor, after.vm_state, after.task_state, after.power_state) == (
        before.host, before.node, before.flavor, before.vm_state, None, states.RUNNING)
    assert placement.get_allocations(server_id) == allocations
    assert placement.get_allocations(document["migration_uuid"]) == {}
    assert local.status(server_id) == "ACTIVE"
    with cell_session("cell1") as session:
        assert session.scalars(select(Migration.status).where(
            Migration.uuid == document["migration_uuid"])).one() == "error"
        assert session.scalars(select(InstanceFault).where(InstanceFault.instance_uuid == server_id)).one()
    hosts = set(local.stack.seeded.hosts)
    other = (hosts - {before.host}).pop()
    assert not (local.stack.instances_dir(other) / server_id).exists()
