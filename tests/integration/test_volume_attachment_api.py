"""``/servers/{id}/os-volume_attachments`` through the real API handler (SQLite and PostgreSQL).

The volume_attachment state machine is a dummy: these tests check the answers, what the API
writes before the workflow runs, and that a refused request changes nothing.
"""

from __future__ import annotations

import json
import uuid as uuidlib
from typing import Any

import pytest
from sqlalchemy import select, update
from test_api_support import ADMIN, PASS_DEFINITION, ROLE_ARN, Caller, call, mocked_cloud
from verify_resize_helpers import (
    CELL,
    DEST,
    OTHER,
    PROJECT,
    SOURCE,
    USER,
    attachments,
    instance_row,
    make_resized,
    make_volume,
    report,
    set_instance,
    volume_status,
)

from ferry import aws, config, protocol
from ferry.compute import states
from ferry.store.api_models import Network, VolumeAttachment
from ferry.store.cell_models import BlockDeviceMapping
from ferry.store.db import api_session, cell_session
from ferry.workflows import volume_attachment as va

OWNER = Caller(USER, PROJECT)
STRANGER = Caller("mallory", "project-m")


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    for mocked in mocked_cloud(monkeypatch, tmp_path):
        arn = mocked.sfn.create_state_machine(name="ferry-test-volume-attachment", definition=PASS_DEFINITION,
                                              roleArn=ROLE_ARN)["stateMachineArn"]
        monkeypatch.setenv("FERRY_VOLUME_ATTACHMENT_STATE_MACHINE_ARN", arn)
        mocked.state_machines["volume_attachment"] = arn
        config.reset()
        for host in (SOURCE, DEST, OTHER):
            aws.client("sqs").create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, host))
            report(host)
        with api_session() as session:
            session.add(Network(id="net-1", name="shared", cidr="10.0.0.0/24"))
        yield mocked


def path(server_id: str, volume_id: str | None = None) -> str:
    base = f"/v2.1/servers/{server_id}/os-volume_attachments"
    return f"{base}/{volume_id}" if volume_id else base


def attach(server_id: str, body: Any, *, caller: Caller = OWNER, version: str = "2.1"):
    return call("POST", path(server_id), caller=caller, body=body, version=version)


def test_attach_answers_200_with_the_attachment_and_starts_the_workflow(cloud, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)

    response = attach(resized.instance_uuid, {"volumeAttachment": {"volumeId": volume_id, "device": "/dev/vdb"}})

    assert response.status == 200, response.body
    assert response.body == {"volumeAttachment": {"id": volume_id, "serverId": resized.instance_uuid,
                                                  "volumeId": volume_id, "device": "/dev/vdd"}}
    [execution] = cloud.executions("volume_attachment")
    assert execution["input"]["operation"] == "attach" and execution["input"]["volume_id"] == volume_id
    assert attachments(resized.instance_uuid) == {DEST: "reserved", SOURCE: "reserved"}
    assert volume_status(volume_id) == va.ATTACHING


@pytest.mark.parametrize("version", ["2.88", "2.89", "2.96"])
def test_attach_answers_in_novas_create_shape_at_every_microversion(cloud, tmp_path, version):
    # Only list and show change at 2.89; the create response keeps ``id`` and shows no attachment_id.
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)

    response = attach(resized.instance_uuid, {"volumeAttachment": {"volumeId": volume_id, "tag": "data"}},
                      version=version)

    assert response.status == 200, response.body
    assert response.body == {"volumeAttachment": {"id": volume_id, "serverId": resized.instance_uuid,
                                                  "volumeId": volume_id, "device": "/dev/vdd", "tag": "data",
                                                  "delete_on_termination": False}}


def test_list_and_show_in_nova_shapes_per_microversion(cloud, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    server_id, volume_id = resized.instance_uuid, resized.volume_id
    assert volume_id is not None

    listed = call("GET", path(server_id), caller=OWNER, version="2.1")
    shown = call("GET", path(server_id, volume_id), caller=OWNER, version="2.89")

    assert listed.status == 200
    assert listed.body == {"volumeAttachments": [{"id": volume_id, "serverId": server_id, "volumeId": volume_id,
                                                  "device": "/dev/vdd"}]}
    assert shown.status == 200
    body = shown.body["volumeAttachment"]
    assert "id" not in body
    assert (body["tag"], body["delete_on_termination"], body["volumeId"]) == (None, False, volume_id)
    assert set(body) == {"device", "serverId", "volumeId", "tag", "delete_on_termination", "attachment_id",
                         "bdm_uuid"}


@pytest.mark.parametrize("query", [{"limit": "x"}, {"limit": "-1"}, {"offset": "1.5"}, {"offset": ""}])
def test_a_list_limit_or_offset_that_is_not_a_non_negative_integer_is_400(cloud, tmp_path, query):
    resized = make_resized(volume=True, state_dir=tmp_path)
    [(name, value)] = query.items()

    response = call("GET", path(resized.instance_uuid), caller=OWNER, version="2.1", query=query)

    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == \
        f"Invalid input for query parameters {name}. Value: {value}. '{value}' does not match '^[0-9]*$'"


def test_the_list_pages_by_limit_and_offset_as_nova_does(cloud, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)

    def listed(**query):
        response = call("GET", path(resized.instance_uuid), caller=OWNER, version="2.1", query=query)
        assert response.status == 200, response.body
        return [a["volumeId"] for a in response.body["volumeAttachments"]]

    assert listed(limit="1") == listed(limit="0") == listed(offset="0") == [resized.volume_id]  # 0: no limit
    assert listed(offset="1") == []


def test_the_list_refuses_unknown_query_parameters_from_2_75(cloud, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)

    refused = call("GET", path(resized.instance_uuid), caller=OWNER, version="2.75", query={"sort_key": "device"})
    ignored = call("GET", path(resized.instance_uuid), caller=OWNER, version="2.74", query={"sort_key": "device"})

    assert refused.status == 400
    assert "'sort_key' was unexpected" in refused.body["badRequest"]["message"]
    assert ignored.status == 200


def test_the_attachment_id_shown_is_that_of_the_attachment_on_the_servers_host_now(cloud, tmp_path):
    # GIVEN a server moved to DEST with a volume whose mapping still carries its first attachment's
    # id (the move made a new attachment on DEST; confirming it drops the one on SOURCE)
    resized = make_resized(volume=True, state_dir=tmp_path)
    server_id, volume_id = resized.instance_uuid, resized.volume_id
    with api_session() as session:
        ids = dict(session.execute(select(VolumeAttachment.host, VolumeAttachment.id).where(
            VolumeAttachment.instance_uuid == server_id)).all())
    with cell_session(CELL) as session:
        session.execute(update(BlockDeviceMapping).where(BlockDeviceMapping.volume_id == volume_id)
                        .values(attachment_id=ids[SOURCE]))

    shown = call("GET", path(server_id, volume_id), caller=OWNER, version="2.89").body["volumeAttachment"]
    set_instance(server_id, host=SOURCE, node=SOURCE)  # as a revert leaves it
    reverted = call("GET", path(server_id), caller=OWNER, version="2.89").body["volumeAttachments"]

    # THEN each shows the attachment the volume API shows for the server's host at the time
    assert shown["attachment_id"] == ids[DEST]
    assert [a["attachment_id"] for a in reverted] == [ids[SOURCE]]


@pytest.mark.parametrize("body", [
    {},
    {"volumeAttachment": {}},
    {"volumeAttachment": {"volumeId": "not-a-uuid"}},
    {"volumeAttachment": {"volumeId": str(uuidlib.uuid4()), "bogus": 1}},
    {"volumeAttachment": {"volumeId": str(uuidlib.uuid4()), "device": "sdb!"}},
    {"volumeAttachment": {"volumeId": str(uuidlib.uuid4()), "delete_on_termination": True}},
])
def test_a_bad_body_is_400(cloud, tmp_path, body):
    resized = make_resized(state_dir=tmp_path)

    response = attach(resized.instance_uuid, body)

    assert response.status == 400, response.body
    assert "badRequest" in response.body


def test_delete_on_termination_is_accepted_from_2_79(cloud, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)

    response = attach(resized.instance_uuid, {"volumeAttachment": {"volumeId": volume_id,
                                                                   "delete_on_termination": True}}, version="2.79")

    assert response.status == 200, response.body
    assert response.body["volumeAttachment"]["delete_on_termination"] is True


def test_a_tag_is_taken_from_2_49_kept_and_shown_from_2_70(cloud, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    server_id, volume_id = resized.instance_uuid, make_volume(tmp_path)

    too_early = attach(server_id, {"volumeAttachment": {"volumeId": volume_id, "tag": "data"}}, version="2.48")
    assert too_early.status == 400
    bad = attach(server_id, {"volumeAttachment": {"volumeId": volume_id, "tag": "a/b"}}, version="2.49")
    assert bad.status == 400
    response = attach(server_id, {"volumeAttachment": {"volumeId": volume_id, "tag": "data"}}, version="2.70")

    assert response.status == 200, response.body
    assert response.body["volumeAttachment"]["tag"] == "data"
    shown = call("GET", path(server_id, volume_id), caller=OWNER, version="2.70").body["volumeAttachment"]
    assert shown["tag"] == "data"
    assert "tag" not in call("GET", path(server_id, volume_id), caller=OWNER, version="2.69").body["volumeAttachment"]


def test_unknown_server_unknown_volume_and_another_projects_volume_are_404(cloud, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    theirs = make_volume(tmp_path, project="project-m")

    assert attach(str(uuidlib.uuid4()), {"volumeAttachment": {"volumeId": volume_id}}).status == 404
    assert attach(resized.instance_uuid, {"volumeAttachment": {"volumeId": str(uuidlib.uuid4())}}).status == 404
    assert attach(resized.instance_uuid, {"volumeAttachment": {"volumeId": theirs}}).status == 404
    assert attach(resized.instance_uuid, {"volumeAttachment": {"volumeId": volume_id}},
                  caller=STRANGER).status == 404
    assert call("GET", path(resized.instance_uuid, volume_id), caller=OWNER).status == 404
    assert call("DELETE", path(resized.instance_uuid, volume_id), caller=OWNER).status == 404
    assert cloud.executions("volume_attachment") == []


def test_a_volume_in_use_is_400_and_a_busy_server_409_and_neither_changes_anything(cloud, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    other = make_resized(state_dir=tmp_path)
    free = make_volume(tmp_path)

    in_use = attach(other.instance_uuid, {"volumeAttachment": {"volumeId": resized.volume_id}})
    set_instance(other.instance_uuid, task_state=states.RESIZE_REVERTING)
    busy = attach(other.instance_uuid, {"volumeAttachment": {"volumeId": free}})

    assert (in_use.status, busy.status) == (400, 409)  # Nova's InvalidVolume, and its instance state conflict
    assert "badRequest" in in_use.body and "conflictingRequest" in busy.body
    assert volume_status(free) == "available" and attachments(other.instance_uuid) == {}
    assert instance_row(other.instance_uuid).task_state == states.RESIZE_REVERTING
    assert cloud.executions("volume_attachment") == []


def test_detach_answers_202_and_starts_the_workflow(cloud, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    assert resized.volume_id is not None

    response = call("DELETE", path(resized.instance_uuid, resized.volume_id), caller=OWNER)

    assert response.status == 202, response.body
    [execution] = cloud.executions("volume_attachment")
    assert execution["input"]["operation"] == "detach"
    assert instance_row(resized.instance_uuid).task_state == va.DETACHING_VOLUME
    assert volume_status(resized.volume_id) == va.DETACHING


def test_an_admin_may_attach_to_any_project_server(cloud, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)

    response = attach(resized.instance_uuid, {"volumeAttachment": {"volumeId": volume_id}}, caller=ADMIN)

    assert response.status == 200, json.dumps(response.body)


def test_a_detach_through_a_stale_mapping_is_400_and_leaves_the_holder_alone(cloud, tmp_path):
    # GIVEN a volume in use by one server, and another whose block device mapping of it is stale
    holder, stale = make_resized(volume=True, state_dir=tmp_path), make_resized(state_dir=tmp_path)
    volume_id = holder.volume_id
    assert volume_id is not None
    with cell_session(CELL) as session:
        session.add(BlockDeviceMapping(instance_uuid=stale.instance_uuid, source_type="volume",
                                       destination_type="volume", device_name="vdd", boot_index=None,
                                       volume_id=volume_id))

    response = call("DELETE", path(stale.instance_uuid, volume_id), caller=OWNER)

    assert response.status == 400, response.body
    assert volume_status(volume_id) == "in-use"
    assert attachments(holder.instance_uuid) == {DEST: "attached", SOURCE: "attached"}
    assert instance_row(stale.instance_uuid).task_state is None
    assert cloud.executions("volume_attachment") == []
