"""``os-resetState`` through the API handler: an admin's way to hand a server back after cleaning up by hand.

The server takes the vm_state asked for (``active`` or ``error``) and loses its task, whatever
state, task or lock it had; nothing else about it changes.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select, update
from test_api_servers import instance, schedule
from test_api_support import ADMIN, ALICE, BOB, call, create_server, mocked_cloud

from ferry.compute import instances, states
from ferry.store.api_models import CellMapping, InstanceMapping
from ferry.store.cell_models import Instance, InstanceAction, InstanceActionEvent, InstanceFault, Migration
from ferry.store.db import api_session, cell_session


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


def _reset(server_id: str, body, caller=ADMIN):
    return call("POST", f"/v2.1/servers/{server_id}/action", caller=caller, body={"os-resetState": body},
                headers={"Accept": ""})


def _set(server_id: str, cell: str = "cell1", **values) -> None:
    with cell_session(cell) as session:
        session.execute(update(Instance).where(Instance.uuid == server_id).values(**values))


def _state(server_id: str, cell: str = "cell1") -> dict:
    row = instance(server_id, cell)
    return {k: getattr(row, k) for k in ("vm_state", "task_state", "power_state", "host", "node", "flavor",
                                         "locked", "hidden")}


def _actions(server_id: str, cell: str = "cell1") -> list[InstanceAction]:
    with cell_session(cell) as session:
        return list(session.scalars(select(InstanceAction).where(InstanceAction.instance_uuid == server_id)))


def _shown(server_id: str) -> dict:
    return call("GET", f"/v2.1/servers/{server_id}", caller=ADMIN, version="2.90").body["server"]


def test_an_admin_resets_an_errored_server_to_active(cloud):
    server_id = create_server()
    schedule(server_id, host="host1", vm_state=states.ERROR)
    with cell_session("cell1") as session:
        session.add(InstanceFault(instance_uuid=server_id, code=500, message="Disk copy failed."))
    before = _state(server_id)

    response = _reset(server_id, {"state": "active"})

    assert response.status == 202 and response.body is None
    assert _state(server_id) == {**before, "vm_state": states.ACTIVE, "task_state": None}
    shown = _shown(server_id)
    assert (shown["status"], shown["OS-EXT-SRV-ATTR:host"], shown["OS-EXT-STS:task_state"]) == ("ACTIVE", "host1", None)
    assert "fault" not in shown  # kept on record, shown only while the server is in ERROR
    with cell_session("cell1") as session:
        assert session.scalars(select(InstanceFault).where(InstanceFault.instance_uuid == server_id)).one()


def test_the_reset_is_recorded_as_a_finished_resetstate_action_without_events(cloud):
    server_id = create_server()
    schedule(server_id, vm_state=states.ERROR)

    response = _reset(server_id, {"state": "active"})

    request_id = response.header("x-openstack-request-id")
    [action] = _actions(server_id)
    assert (action.action, action.request_id, action.user_id, action.project_id) == \
        ("resetState", request_id, "root", "admin-project")
    assert action.finish_time is not None and action.message is None
    with cell_session("cell1") as session:
        assert not list(session.scalars(select(InstanceActionEvent).where(InstanceActionEvent.action_id == action.id)))
    listed = call("GET", f"/v2.1/servers/{server_id}/os-instance-actions", caller=ADMIN).body["instanceActions"]
    assert [(a["action"], a["request_id"]) for a in listed] == [("resetState", request_id)]


def test_an_admin_resets_a_server_with_a_task_in_progress_to_error(cloud):
    server_id = create_server()
    schedule(server_id, host="host1")
    _set(server_id, task_state=states.RESIZE_MIGRATING)
    with cell_session("cell1") as session:
        session.add(Migration(instance_uuid=server_id, status="migrating", migration_type="resize",
                              source_compute="host1", dest_compute="host2"))
    before = _state(server_id)

    response = _reset(server_id, {"state": "error"})

    assert response.status == 202
    assert _state(server_id) == {**before, "vm_state": states.ERROR, "task_state": None}
    assert _shown(server_id)["status"] == "ERROR"
    with cell_session("cell1") as session:
        migration = session.scalars(select(Migration).where(Migration.instance_uuid == server_id)).one()
    assert (migration.status, migration.source_compute, migration.dest_compute) == ("migrating", "host1", "host2")


def test_a_locked_shut_off_server_reset_to_active_shows_active_and_keeps_its_power_state(cloud):
    server_id = create_server()
    schedule(server_id, vm_state=states.ERROR, power_state=states.SHUTDOWN)
    _set(server_id, locked=True, task_state=states.POWERING_ON)

    response = _reset(server_id, {"state": "active"})

    assert response.status == 202
    state = _state(server_id)
    assert (state["vm_state"], state["task_state"], state["power_state"], state["locked"]) == \
        (states.ACTIVE, None, states.SHUTDOWN, True)
    shown = _shown(server_id)
    assert (shown["status"], shown["OS-EXT-STS:power_state"]) == ("ACTIVE", states.SHUTDOWN)


def test_a_member_may_not_reset_even_her_own_server_and_nothing_changes(cloud):
    server_id = create_server()
    schedule(server_id, vm_state=states.ERROR)
    before = _state(server_id)

    owner = _reset(server_id, {"state": "active"}, caller=ALICE)
    stranger = _reset(server_id, {"state": "active"}, caller=BOB)

    assert owner.status == 403
    assert owner.body["forbidden"]["message"] == \
        "Policy doesn't allow os_compute_api:os-admin-actions:reset_state to be performed."
    assert stranger.status == 404  # another project's server is not to be learnt of
    assert _state(server_id) == before and _actions(server_id) == []


@pytest.mark.parametrize(("body", "wrong"), [
    ({}, '"state" is a required property'),
    ({"state": "stopped"}, "stopped"),
    ({"state": "ACTIVE"}, "ACTIVE"),
    ({"state": None}, "null"),
    ({"state": "active", "force": True}, "force"),
    (None, "null"),
    ("active", "active"),
])
def test_a_bad_body_is_400_and_changes_nothing(cloud, body, wrong):
    server_id = create_server()
    schedule(server_id, vm_state=states.ERROR)
    before = _state(server_id)

    response = _reset(server_id, body)

    assert response.status == 400, response.body
    message = response.body["badRequest"]["message"]
    assert message.startswith("Invalid input for field/attribute os-resetState") and wrong in message
    assert _state(server_id) == before and _actions(server_id) == []


def test_a_second_action_beside_the_reset_is_400(cloud):
    server_id = create_server()
    schedule(server_id, vm_state=states.ERROR)

    response = call("POST", f"/v2.1/servers/{server_id}/action", caller=ADMIN,
                    body={"os-resetState": {"state": "active"}, "os-start": None})

    assert response.status == 400
    assert instance(server_id).vm_state == states.ERROR


@pytest.mark.parametrize("server_id", ["0d5a7c3e-9b1f-4e2a-8c6d-3f4b5a6e7d8c", "vm1"])
def test_an_unknown_server_is_404(cloud, server_id):
    create_server(name="vm1")

    response = _reset(server_id, {"state": "active"})

    assert response.status == 404
    assert response.body["itemNotFound"]["message"] == f"Instance {server_id} could not be found."


def test_a_server_still_being_scheduled_is_409_and_keeps_its_build_request(cloud):
    server_id = create_server()

    response = _reset(server_id, {"state": "error"})

    assert response.status == 409
    assert "still being scheduled" in response.body["conflictingRequest"]["message"]
    assert _shown(server_id)["status"] == "BUILD"


def test_mid_move_between_cells_the_copy_the_mapping_names_is_reset(cloud):
    server_id = create_server()
    schedule(server_id, "cell2", host="host9", hidden_copy_in="cell1")
    _set(server_id, "cell2", task_state=states.RESIZE_FINISH)
    with cell_session("cell2") as session:
        session.add(Migration(instance_uuid=server_id, status="post-migrating", migration_type="resize",
                              cross_cell_move=True, source_compute="elsewhere", dest_compute="host9"))
    left = _state(server_id, "cell1")

    response = _reset(server_id, {"state": "error"})

    assert response.status == 202
    assert (instance(server_id, "cell2").vm_state, instance(server_id, "cell2").task_state) == (states.ERROR, None)
    assert _state(server_id, "cell1") == left
    assert [a.action for a in _actions(server_id, "cell2")] == ["resetState"] and _actions(server_id, "cell1") == []


def test_the_mapped_copy_is_reset_even_while_a_switch_has_it_hidden(cloud):
    server_id = create_server()
    schedule(server_id, vm_state=states.ERROR)
    _set(server_id, hidden=True, task_state=states.RESIZE_REVERTING)

    response = _reset(server_id, {"state": "active"})

    assert response.status == 202
    state = _state(server_id)
    assert (state["vm_state"], state["task_state"], state["hidden"]) == (states.ACTIVE, None, True)


def test_a_workflow_step_that_changes_the_server_meanwhile_is_not_overwritten_unseen(cloud, monkeypatch):
    """The write is a compare-and-swap on what was read: a step landing between the read and the
    write makes it fail, and the reset reads the server again before it writes."""
    server_id = create_server()
    schedule(server_id)
    _set(server_id, task_state=states.RESIZE_PREP)
    real_update = instances.update_cas
    expected_seen = []

    def step_lands_first(session, instance_uuid, values, **expected):
        expected_seen.append(expected["expected_task_state"])
        if len(expected_seen) == 1:  # what a step committing between the reset's read and its write leaves
            session.execute(update(Instance).where(Instance.uuid == server_id)
                            .values(task_state=states.RESIZE_MIGRATING))
        return real_update(session, instance_uuid, values, **expected)

    monkeypatch.setattr(instances, "update_cas", step_lands_first)

    response = _reset(server_id, {"state": "error"})

    assert response.status == 202
    assert expected_seen == [(states.RESIZE_PREP,), (states.RESIZE_MIGRATING,)]
    assert (instance(server_id).vm_state, instance(server_id).task_state) == (states.ERROR, None)
    assert len(_actions(server_id)) == 1


def test_a_switch_of_cells_during_the_reset_resets_the_copy_switched_to(cloud, monkeypatch):
    server_id = create_server()
    schedule(server_id, "cell1", vm_state=states.ERROR, hidden_copy_in="cell2")
    _set(server_id, "cell2", vm_state=states.ERROR, task_state=states.RESIZE_FINISH)
    real_update = instances.update_cas
    written = []

    def switch_after_the_first_write(session, instance_uuid, values, **expected):
        real_update(session, instance_uuid, values, **expected)
        written.append(expected)
        if len(written) == 1:  # the move switches the server to cell2's copy
            session.execute(update(Instance).where(Instance.uuid == server_id).values(hidden=True))
            _set(server_id, "cell2", hidden=False)
            with api_session() as api:
                cell2 = api.scalars(select(CellMapping.id).where(CellMapping.name == "cell2")).one()
                api.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server_id)
                            .values(cell_id=cell2))

    monkeypatch.setattr(instances, "update_cas", switch_after_the_first_write)

    response = _reset(server_id, {"state": "active"})

    assert response.status == 202 and len(written) == 2
    for cell in ("cell1", "cell2"):
        assert (instance(server_id, cell).vm_state, instance(server_id, cell).task_state) == (states.ACTIVE, None)
        assert [a.action for a in _actions(server_id, cell)] == ["resetState"]
    assert _shown(server_id)["status"] == "ACTIVE"
