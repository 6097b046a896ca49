"""Resize, cold migrate, confirm and revert through the real API handler (SQLite and PostgreSQL).

The state machines are dummies: these tests check what the API writes before a workflow
runs, which execution it starts with which input, and that a refused request changes nothing.
"""

from __future__ import annotations

import hashlib
import io
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import select, update
from test_api_servers import api_rows, instance, schedule
from test_api_support import (
    ADMIN,
    ALICE,
    BOB,
    PASS_DEFINITION,
    ROLE_ARN,
    Caller,
    add_host,
    call,
    create_server,
    flavor_named,
    mocked_cloud,
)

from ferry import config, errors, images, placement, quotas
from ferry.compute import actions, migration_states, moves, states
from ferry.compute import api as compute_api
from ferry.store import setup
from ferry.store.api_models import Flavor, RequestSpec
from ferry.store.cell_models import BlockDeviceMapping, Instance, InstanceAction, Migration, Service
from ferry.store.db import api_session, cell_session
from ferry.workflows import confirm_resize as confirm_steps
from ferry.workflows import resize as resize_steps
from ferry.workflows import revert_resize as revert_steps

MOVE_WORKFLOWS = {"resize": "RESIZE", "confirm_resize": "CONFIRM_RESIZE", "revert_resize": "REVERT_RESIZE"}


def start_move_cloud(cloud: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Add the move state machines, hosts host1/host2 in cell1 and host3 in cell2, and more flavors."""
    for workflow, env in MOVE_WORKFLOWS.items():
        arn = cloud.sfn.create_state_machine(name=f"ferry-test-{workflow}", definition=PASS_DEFINITION,
                                             roleArn=ROLE_ARN)["stateMachineArn"]
        monkeypatch.setenv(f"FERRY_{env}_STATE_MACHINE_ARN", arn)
        cloud.state_machines[workflow] = arn
    config.reset()
    for host, cell in (("host1", "cell1"), ("host2", "cell1"), ("host3", "cell2")):
        add_host(host, cell)
        setup.map_host(host, cell)
    compute_api.create_flavor(name="m1.large", vcpus=4, memory_mb=4096, root_gb=4, flavorid="3")
    compute_api.create_flavor(name="m1.tiny-disk", vcpus=2, memory_mb=1024, root_gb=0, flavorid="zero")
    compute_api.create_flavor(name="m1.nano", vcpus=1, memory_mb=256, root_gb=0, flavorid="nano")
    compute_api.create_flavor(name="m1.private", vcpus=2, memory_mb=1024, root_gb=2, flavorid="private",
                              is_public=False)
    return cloud


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    for mocked in mocked_cloud(monkeypatch, tmp_path):
        yield start_move_cloud(mocked, monkeypatch)


def action(server_id: str, body: dict[str, Any], *, caller: Caller = ALICE, version: str = "2.90"):
    return call("POST", f"/v2.1/servers/{server_id}/action", caller=caller, body=body, version=version)


def active_server(caller: Caller = ALICE, *, vm_state: str = states.ACTIVE, **server: Any) -> str:
    server_id = create_server(caller, **server)
    schedule(server_id, vm_state=vm_state,
             power_state=states.SHUTDOWN if vm_state == states.STOPPED else states.RUNNING)
    return server_id


def set_instance(server_id: str, **values: Any) -> None:
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == server_id).values(**values))


def migrations_of(server_id: str, cell: str = "cell1") -> list[Migration]:
    with cell_session(cell) as session:
        return list(session.scalars(select(Migration).where(Migration.instance_uuid == server_id)
                                    .order_by(Migration.id)))


def actions_of(server_id: str) -> list[InstanceAction]:
    with cell_session("cell1") as session:
        return list(session.scalars(select(InstanceAction).where(InstanceAction.instance_uuid == server_id)
                                    .order_by(InstanceAction.id)))


@dataclass(frozen=True)
class Snapshot:
    """What a refused request must leave as it was."""

    instance: tuple
    migrations: tuple
    actions: tuple
    executions: int


def snapshot(cloud: Any, server_id: str) -> Snapshot:
    row = instance(server_id)
    return Snapshot(
        instance=(row.vm_state, row.task_state, row.flavor, row.old_flavor, row.new_flavor, row.old_vm_state,
                  row.host, row.node),
        migrations=tuple((m.uuid, m.status) for m in migrations_of(server_id)),
        actions=tuple((a.action, a.request_id) for a in actions_of(server_id)),
        executions=sum(len(cloud.executions(w)) for w in MOVE_WORKFLOWS))


def snapshot_of(name: str) -> dict[str, Any]:
    flavor = flavor_named(name)
    assert flavor is not None
    return compute_api.flavor_snapshot(flavor)


def resized_server(caller: Caller = ALICE, *, status: str = migration_states.FINISHED,
                   old_vm_state: str = states.ACTIVE) -> tuple[str, str]:
    """A server in VERIFY_RESIZE from m1.small on host1 to m1.medium on host2; returns (server, migration)."""
    server_id = active_server(caller)
    old, new = snapshot_of("m1.small"), snapshot_of("m1.medium")
    set_instance(server_id, old_flavor=old, new_flavor=new, flavor=new, vm_state=states.RESIZED,
                 old_vm_state=old_vm_state, host="host2", node="host2")
    with cell_session("cell1") as session:
        migration = Migration(instance_uuid=server_id, source_compute="host1", source_node="host1",
                              dest_compute="host2", dest_node="host2", dest_host="host2", status=status,
                              migration_type=migration_states.RESIZE, old_instance_type_id=old["id"],
                              new_instance_type_id=new["id"], user_id=caller.user_id,
                              project_id=caller.project_id)
        session.add(migration)
        session.flush()
        return server_id, migration.uuid


def write_policy(tmp_path, monkeypatch, rules: dict[str, str]) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("".join(f'"{name}": "{rule}"\n' for name, rule in rules.items()))
    monkeypatch.setenv("FERRY_POLICY_FILE", str(path))
    config.reset()


# --- resize: accepted --------------------------------------------------------------------------------


def test_resize_writes_the_move_contract_and_starts_the_resize_workflow(cloud):
    server_id = active_server()

    response = action(server_id, {"resize": {"flavorRef": "2", "OS-DCF:diskConfig": "AUTO"}})

    assert (response.status, response.body) == (202, None)
    request_id = response.header("x-openstack-request-id")
    row = instance(server_id)
    assert (row.vm_state, row.task_state, row.old_vm_state) == (states.ACTIVE, states.RESIZE_PREP, states.ACTIVE)
    assert row.flavor == snapshot_of("m1.small") and row.old_flavor == snapshot_of("m1.small")
    assert row.new_flavor == snapshot_of("m1.medium")
    [migration] = migrations_of(server_id)
    assert (migration.status, migration.migration_type) == ("pre-migrating", "resize")
    assert (migration.source_compute, migration.source_node, migration.dest_compute, migration.dest_node) == \
        ("host1", "host1", None, None)
    assert (migration.old_instance_type_id, migration.new_instance_type_id) == \
        (flavor_named("m1.small").id, flavor_named("m1.medium").id)
    assert (migration.user_id, migration.project_id) == ("alice", "project-a")
    assert [(a.action, a.request_id, a.user_id, a.project_id) for a in actions_of(server_id)] == \
        [("resize", request_id, "alice", "project-a")]
    [execution] = cloud.executions("resize")
    assert execution["name"] == f"resize-{server_id}-{migration.uuid[:8]}"
    assert execution["input"] == {
        "instance_uuid": server_id, "migration_uuid": migration.uuid, "cell": "cell1", "request_id": request_id,
        "requested_host": None, "user_id": "alice", "project_id": "project-a", "execution_name": execution["name"]}
    with api_session() as session:
        spec = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == server_id)).one().spec
    assert spec["allow_cross_cell_move"] is False


def test_a_resizing_server_shows_resize_status_and_its_current_flavor(cloud):
    server_id = active_server()
    assert action(server_id, {"resize": {"flavorRef": "2"}}).status == 202

    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]

    assert (shown["status"], shown["OS-EXT-STS:task_state"], shown["OS-EXT-STS:vm_state"]) == \
        ("RESIZE", "resize_prep", "active")
    assert shown["flavor"]["original_name"] == "m1.small"


@pytest.mark.parametrize(("vm_state", "task_state", "status", "progress"), [
    (states.ACTIVE, states.RESIZE_PREP, "RESIZE", 0),
    (states.ACTIVE, states.RESIZE_MIGRATING, "RESIZE", 25),
    (states.STOPPED, states.RESIZE_MIGRATED, "RESIZE", 50),
    (states.ACTIVE, states.RESIZE_FINISH, "RESIZE", 75),
    (states.RESIZED, None, "VERIFY_RESIZE", 100),
    (states.RESIZED, states.RESIZE_REVERTING, "REVERT_RESIZE", None),
    (states.RESIZED, states.RESIZE_CONFIRMING, "VERIFY_RESIZE", 100),
    (states.ACTIVE, None, "ACTIVE", 0),
])
def test_server_status_and_progress_follow_the_resize_states(cloud, vm_state, task_state, status, progress):
    server_id = active_server()
    set_instance(server_id, vm_state=vm_state, task_state=task_state, power_state=states.SHUTDOWN)

    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]

    assert (shown["status"], shown["OS-EXT-STS:vm_state"], shown["OS-EXT-STS:task_state"],
            shown["OS-EXT-STS:power_state"]) == (status, vm_state, task_state, states.SHUTDOWN)
    assert shown.get("progress") == progress  # absent outside Nova's progress statuses


def test_resize_of_a_stopped_server_remembers_it_was_stopped(cloud):
    server_id = active_server(vm_state=states.STOPPED)

    assert action(server_id, {"resize": {"flavorRef": 2}}).status == 202

    row = instance(server_id)
    assert (row.vm_state, row.task_state, row.old_vm_state) == (states.STOPPED, states.RESIZE_PREP, states.STOPPED)


def test_resize_accepts_a_flavor_href_and_admins_may_use_private_flavors(cloud):
    server_id = active_server()

    response = action(server_id, {"resize": {"flavorRef": "https://x/v2.1/flavors/private"}}, caller=ADMIN)

    assert response.status == 202
    assert instance(server_id).new_flavor["name"] == "m1.private"


def test_a_member_may_resize_to_a_private_flavor_her_project_has_access_to(cloud):
    server_id = active_server()
    assert action(server_id, {"resize": {"flavorRef": "private"}}).status == 400
    assert call("POST", "/v2.1/flavors/private/action", caller=ADMIN,
                body={"addTenantAccess": {"tenant": "project-a"}}).status == 200

    assert action(server_id, {"resize": {"flavorRef": "private"}}).status == 202
    assert instance(server_id).new_flavor["name"] == "m1.private"


def test_volume_backed_server_may_resize_to_a_zero_disk_flavor(cloud):
    server_id = active_server()
    set_instance(server_id, image_ref="")
    with cell_session("cell1") as session:
        session.add(BlockDeviceMapping(instance_uuid=server_id, source_type="volume", destination_type="volume",
                                       boot_index=0, volume_id="vol-1"))

    assert action(server_id, {"resize": {"flavorRef": "zero"}}).status == 202


# --- resize: refused, nothing changed -------------------------------------------------------------


@pytest.mark.parametrize(("body", "message"), [
    ({"resize": {"flavorRef": "no-such-flavor"}}, "Unable to locate requested flavor."),
    ({"resize": {"flavorRef": "private"}}, "Unable to locate requested flavor."),
    ({"resize": {"flavorRef": "disabled"}}, "Unable to locate requested flavor."),
    ({"resize": {"flavorRef": None}}, "Invalid input for field/attribute resize/flavorRef"),
    ({"resize": {"flavorRef": ""}}, "Invalid input for field/attribute resize/flavorRef"),
    ({"resize": {}}, '"flavorRef" is a required property'),
    ({"resize": {"flavorRef": "2", "extra": 1}}, "Additional properties are not allowed"),
    ({"resize": {"flavorRef": "2", "OS-DCF:diskConfig": "SIDEWAYS"}}, "OS-DCF:diskConfig"),
    ({"resize": None}, "Invalid input for field/attribute resize"),
    ({"resize": {"flavorRef": "1"}}, "When resizing, instances must change flavor!"),
    ({"resize": {"flavorRef": "nano"}},
     "Server disk was unable to be resized because: Resize to zero disk flavor is not allowed."),
])
def test_bad_resize_requests_are_400_and_change_nothing(cloud, body, message):
    with api_session() as session:
        session.add(Flavor(flavorid="disabled", name="m1.disabled", vcpus=2, memory_mb=1024, root_gb=2,
                           disabled=True))
    server_id = active_server()
    before = snapshot(cloud, server_id)

    response = action(server_id, body)

    assert response.status == 400, response.body
    assert message in response.body["badRequest"]["message"]
    assert snapshot(cloud, server_id) == before


def test_resize_refuses_to_shrink_the_root_disk(cloud):
    server_id = create_server(flavorRef="3")
    schedule(server_id)
    before = snapshot(cloud, server_id)

    response = action(server_id, {"resize": {"flavorRef": "2"}})

    assert response.status == 400
    assert "the root disk cannot shrink (flavor m1.large has 4 GB, m1.medium 2 GB)" in \
        response.body["badRequest"]["message"]
    assert snapshot(cloud, server_id) == before


def server_of_an_image_needing_2g(flavor_vcpus: int, flavorid: str) -> tuple[str, str]:
    """A server (m1.large) booted from an image that needs 2 GB of RAM, and a flavor ``flavorid``
    with less RAM but a bigger disk and ``flavor_vcpus``; returns (server, image)."""
    image = images.upload_image(io.BytesIO(b"\0" * 4096), "needs-2g", min_ram=2048)
    compute_api.create_flavor(name=f"m1.{flavorid}", vcpus=flavor_vcpus, memory_mb=1024, root_gb=8,
                              flavorid=flavorid)
    server_id = create_server(flavorRef="3", imageRef=image["id"])
    schedule(server_id)
    return server_id, image["id"]


def test_resize_of_an_image_backed_server_to_a_flavor_its_image_does_not_fit_is_400(cloud):
    # GIVEN a server booted from an image that needs 2 GB of RAM, and a flavor with less but a bigger disk
    server_id, image_id = server_of_an_image_needing_2g(4, "small-ram")
    before = snapshot(cloud, server_id)

    # WHEN it is resized to that flavor
    response = action(server_id, {"resize": {"flavorRef": "small-ram"}})

    # THEN Nova's refusal, and nothing changed; the image deleted, the resize is not checked against it
    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == "Flavor's memory is too small for requested image."
    assert snapshot(cloud, server_id) == before
    images.delete_image(image_id)
    assert action(server_id, {"resize": {"flavorRef": "small-ram"}}).status == 202


def test_resize_of_someone_elses_or_an_unknown_server_is_404(cloud):
    server_id = active_server()
    before = snapshot(cloud, server_id)

    other = action(server_id, {"resize": {"flavorRef": "2"}}, caller=BOB)
    unknown = action("00000000-0000-4000-8000-000000000000", {"resize": {"flavorRef": "2"}})

    assert (other.status, unknown.status) == (404, 404)
    assert other.body["itemNotFound"]["message"] == f"Instance {server_id} could not be found."
    assert snapshot(cloud, server_id) == before


@pytest.mark.parametrize(("values", "message"), [
    ({"vm_state": states.SUSPENDED}, "while it is in vm_state suspended"),
    ({"vm_state": states.ERROR}, "while it is in vm_state error"),
    ({"vm_state": states.RESIZED}, "while it is in vm_state resized"),
    ({"task_state": states.POWERING_OFF}, "while it is in task_state powering-off"),
    ({"task_state": states.RESIZE_MIGRATING}, "while it is in task_state resize_migrating"),
    ({"locked": True}, "is locked"),
])
def test_resize_in_the_wrong_state_is_409_and_changes_nothing(cloud, values, message):
    server_id = active_server()
    set_instance(server_id, **values)
    before = snapshot(cloud, server_id)

    response = action(server_id, {"resize": {"flavorRef": "2"}})

    assert response.status == 409
    assert message in response.body["conflictingRequest"]["message"]
    assert snapshot(cloud, server_id) == before


@pytest.mark.parametrize("values", [
    {"locked": True}, {"vm_state": states.SUSPENDED}, {"task_state": states.POWERING_OFF},
    {"host": "host-down", "node": "host-down"},
])
def test_a_server_that_cannot_move_is_409_even_for_an_unknown_flavor(cloud, values):
    """Lock, state and host come before the flavor: the caller learns first that the server cannot move."""
    add_host("host-down", up=False)
    server_id = active_server()
    set_instance(server_id, **values)
    before = snapshot(cloud, server_id)

    response = action(server_id, {"resize": {"flavorRef": "no-such-flavor"}})

    assert response.status == 409, response.body
    assert snapshot(cloud, server_id) == before


def test_resize_from_a_down_host_is_409(cloud):
    add_host("host-down", up=False)
    server_id = active_server()
    set_instance(server_id, host="host-down", node="host-down")
    before = snapshot(cloud, server_id)

    response = action(server_id, {"resize": {"flavorRef": "2"}})

    assert response.status == 409
    # Nova's words: the owner is not told the host's name
    assert response.body["conflictingRequest"]["message"] == "Service is unavailable at this time."
    assert snapshot(cloud, server_id) == before


def test_an_admin_may_resize_a_locked_server(cloud):
    server_id = active_server()
    set_instance(server_id, locked=True)

    assert action(server_id, {"resize": {"flavorRef": "2"}}, caller=ADMIN).status == 202


def test_a_second_move_while_the_first_is_pending_is_409(cloud):
    server_id = active_server()

    first = action(server_id, {"resize": {"flavorRef": "2"}})
    second = action(server_id, {"resize": {"flavorRef": "3"}})
    third = action(server_id, {"migrate": None}, caller=ADMIN)

    assert (first.status, second.status, third.status) == (202, 409, 409)
    assert "task_state resize_prep" in second.body["conflictingRequest"]["message"]
    assert len(migrations_of(server_id)) == 1 and len(cloud.executions("resize")) == 1
    assert instance(server_id).new_flavor["name"] == "m1.medium"


@pytest.mark.parametrize("status", [migration_states.PRE_MIGRATING, migration_states.POST_MIGRATING,
                                    migration_states.CONFIRMING, migration_states.REVERTING])
def test_a_move_after_a_reset_while_another_moves_the_server_is_409_and_writes_nothing(cloud, status):
    # GIVEN a move under way whose server an admin reset to active (task cleared), its migration still live
    server_id = active_server()
    assert action(server_id, {"resize": {"flavorRef": "2"}}).status == 202
    [migration] = migrations_of(server_id)
    with cell_session("cell1") as session:
        session.execute(update(Migration).values(status=status))
    assert call("POST", f"/v2.1/servers/{server_id}/action", caller=ADMIN,
                body={"os-resetState": {"state": "active"}}).status == 202

    # WHEN a new move is asked for
    again = action(server_id, {"migrate": None}, caller=ADMIN)

    # THEN it is refused while the first one's workflow may still act on the server; nothing is written
    assert again.status == 409, again.body
    assert f"its migration {migration.uuid} is still {status}" in again.body["conflictingRequest"]["message"]
    assert len(migrations_of(server_id)) == 1 and len(cloud.executions("resize")) == 1
    assert instance(server_id).task_state is None


def test_a_move_after_an_ended_one_is_accepted(cloud):
    server_id = active_server()
    assert action(server_id, {"resize": {"flavorRef": "2"}}).status == 202
    with cell_session("cell1") as session:
        session.execute(update(Migration).values(status=migration_states.ERROR))
    set_instance(server_id, task_state=None)

    assert action(server_id, {"migrate": None}, caller=ADMIN).status == 202


def test_a_move_that_loses_the_compare_and_swap_is_409_and_writes_nothing(cloud, monkeypatch):
    server_id = active_server()
    original = moves.quotas.check

    def busy_meanwhile(project_id, deltas):
        original(project_id, deltas)
        set_instance(server_id, task_state=states.POWERING_OFF)  # another request won the race

    monkeypatch.setattr(moves.quotas, "check", busy_meanwhile)

    response = action(server_id, {"resize": {"flavorRef": "2"}})

    assert response.status == 409
    assert migrations_of(server_id) == [] and actions_of(server_id) == []
    assert cloud.executions("resize") == []


def test_resize_policy_comes_from_the_policy_file(cloud, tmp_path, monkeypatch):
    server_id = active_server()
    write_policy(tmp_path, monkeypatch, {"os_compute_api:servers:resize": "admin"})
    before = snapshot(cloud, server_id)

    refused = action(server_id, {"resize": {"flavorRef": "2"}})

    assert refused.status == 403
    assert refused.body["forbidden"]["message"] == "Policy doesn't allow os_compute_api:servers:resize to be performed."
    assert snapshot(cloud, server_id) == before
    assert action(server_id, {"resize": {"flavorRef": "2"}}, caller=ADMIN).status == 202


def test_a_flavor_made_after_the_servers_flavor_was_deleted_is_another_flavor(cloud):
    # GIVEN a server of a flavor since deleted, and a new flavor that took its internal id
    # (SQLite gives the highest deleted id again)
    def make_flavor(flavor_id: str) -> None:
        assert call("POST", "/v2.1/flavors", caller=ADMIN, version="2.90", body={"flavor": {
            "name": f"f-{flavor_id}", "id": flavor_id, "vcpus": 1, "ram": 512, "disk": 1}}).status == 200

    make_flavor("old")
    server_id = active_server(flavorRef="old")
    assert call("DELETE", "/v2.1/flavors/old", caller=ADMIN, version="2.90").status == 202
    make_flavor("new")

    # WHEN the server is resized to the new flavor THEN it is accepted
    assert action(server_id, {"resize": {"flavorRef": "new"}}).status == 202


def test_a_resize_workflow_that_cannot_start_is_undone(cloud, monkeypatch):
    server_id = active_server()
    monkeypatch.setenv("FERRY_RESIZE_STATE_MACHINE_ARN", "")
    config.reset()

    response = action(server_id, {"resize": {"flavorRef": "2"}})

    assert response.status == 500
    row = instance(server_id)
    assert (row.task_state, row.old_flavor, row.new_flavor, row.old_vm_state) == (None, None, None, None)
    assert [m.status for m in migrations_of(server_id)] == ["error"]
    assert actions_of(server_id) == []
    assert call("GET", f"/v2.1/servers/{server_id}").body["server"]["status"] == "ACTIVE"


def test_a_resize_whose_start_answered_an_error_but_whose_workflow_runs_is_accepted(cloud, monkeypatch):
    # GIVEN a start whose answer is an error although the workflow runs: its first step recorded
    # its event before the API looked
    server_id = active_server()

    def started_but_answered_an_error(arn, name, payload):
        with cell_session(payload["cell"]) as session:
            actions.start_event(session, instance_uuid=payload["instance_uuid"], request_id=payload["request_id"],
                                event=resize_steps.EVENT_MIGRATE)
        raise RuntimeError("the answer was lost")

    monkeypatch.setattr(moves.workflows, "start_execution", started_but_answered_an_error)

    response = action(server_id, {"resize": {"flavorRef": "2"}})

    # THEN the move stands, as its workflow goes on with it
    assert response.status == 202
    assert instance(server_id).task_state == states.RESIZE_PREP
    assert [m.status for m in migrations_of(server_id)] == ["pre-migrating"]


def test_cross_cell_choice_follows_the_callers_policy(cloud, tmp_path, monkeypatch):
    write_policy(tmp_path, monkeypatch, {"compute:servers:resize:cross_cell": "admin_or_owner"})
    server_id = active_server()

    assert action(server_id, {"resize": {"flavorRef": "2"}}).status == 202

    with api_session() as session:
        spec = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == server_id)).one().spec
    assert spec["allow_cross_cell_move"] is True


# --- quota on resize --------------------------------------------------------------------------------


def test_an_upsize_over_quota_is_403_and_changes_nothing(cloud):
    server_id = active_server()  # 1 core
    quotas.update("project-a", {"cores": 3})
    other = active_server()  # 2 cores used
    before = snapshot(cloud, server_id)

    response = action(server_id, {"resize": {"flavorRef": "3"}})  # +3 cores

    assert response.status == 403
    assert response.body["forbidden"]["message"] == \
        "Quota exceeded for cores: Requested 3, but already used 2 of 3 cores"
    assert snapshot(cloud, server_id) == before
    assert instance(other).task_state is None


def test_an_upsize_over_quota_is_403_before_its_image_is_found_not_to_fit(cloud):
    # GIVEN an upsize over the cores quota to a flavor the server's image does not fit either
    server_id, _image_id = server_of_an_image_needing_2g(32, "cpu-heavy")
    before = snapshot(cloud, server_id)

    response = action(server_id, {"resize": {"flavorRef": "cpu-heavy"}})

    # THEN the quota answers, as Nova checks it before the image
    assert response.status == 403, response.body
    assert response.body["forbidden"]["message"].startswith("Quota exceeded for cores")
    assert snapshot(cloud, server_id) == before


def test_an_upsize_over_cores_and_ram_names_both(cloud):
    server_id = active_server()
    quotas.update("project-a", {"cores": 2, "ram": 1024})

    response = action(server_id, {"resize": {"flavorRef": "3"}})

    assert response.status == 403
    assert response.body["forbidden"]["message"] == \
        "Quota exceeded for cores, ram: Requested 3, 3584, but already used 1, 512 of 2, 1024 cores, ram"


def test_raising_the_quota_as_admin_lets_the_upsize_through(cloud):
    server_id = active_server()
    quotas.update("project-a", {"cores": 1})
    assert action(server_id, {"resize": {"flavorRef": "2"}}).status == 403

    raised = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN, body={"quota_set": {"cores": 4}})

    assert raised.status == 200 and raised.body["quota_set"]["cores"] == 4
    assert action(server_id, {"resize": {"flavorRef": "2"}}).status == 202


def test_a_downsize_needs_no_quota(cloud):
    server_id = create_server(flavorRef="2")
    schedule(server_id)
    quotas.update("project-a", {"cores": 1, "ram": 512}, force=True)  # already over

    assert action(server_id, {"resize": {"flavorRef": "3"}}).status == 403
    set_instance(server_id, flavor=snapshot_of("m1.tiny-disk"))
    assert action(server_id, {"resize": {"flavorRef": "1"}}).status == 202


def test_a_concurrent_request_that_took_the_quota_undoes_the_resize(cloud, monkeypatch):
    server_id = active_server()
    quotas.update("project-a", {"cores": 2})
    original = moves.quotas.check

    def other_server_appears(project_id, deltas):
        original(project_id, deltas)
        with cell_session("cell1") as session:  # another boot took the last core meanwhile
            session.add(Instance(display_name="racer", project_id="project-a", user_id="alice",
                                 flavor=snapshot_of("m1.small"), vm_state=states.ACTIVE, host="host1"))

    monkeypatch.setattr(moves.quotas, "check", other_server_appears)

    response = action(server_id, {"resize": {"flavorRef": "2"}})

    assert response.status == 403
    assert response.body["forbidden"]["message"].startswith("Quota exceeded for cores: Requested 1")
    assert migrations_of(server_id) == [] and actions_of(server_id) == []
    assert instance(server_id).task_state is None and cloud.executions("resize") == []


def test_a_recount_that_cannot_be_made_undoes_the_resize(cloud, monkeypatch):
    # GIVEN an upsize whose second count fails (a cell's database out of reach for a moment)
    server_id = active_server()

    def unreachable(project_id, deltas):
        raise RuntimeError("cell database unreachable")

    monkeypatch.setattr(moves.quotas, "recheck", unreachable)

    # WHEN it is asked for, THEN it fails and nothing stays of it: the server can be moved again
    response = action(server_id, {"resize": {"flavorRef": "2"}})

    assert response.status == 500
    assert migrations_of(server_id) == [] and actions_of(server_id) == []
    assert instance(server_id).task_state is None and cloud.executions("resize") == []


# --- migrate --------------------------------------------------------------------------------------


def test_migrate_is_for_admins_by_default(cloud):
    server_id = active_server()
    before = snapshot(cloud, server_id)

    response = action(server_id, {"migrate": None})

    assert response.status == 403
    assert "os_compute_api:os-migrate-server:migrate" in response.body["forbidden"]["message"]
    assert snapshot(cloud, server_id) == before


def test_migrate_keeps_the_flavor_and_starts_the_resize_workflow(cloud):
    server_id = active_server()

    response = action(server_id, {"migrate": None}, caller=ADMIN)

    assert (response.status, response.body) == (202, None)
    row = instance(server_id)
    assert row.task_state == states.RESIZE_PREP
    assert row.old_flavor == row.new_flavor == row.flavor == snapshot_of("m1.small")
    [migration] = migrations_of(server_id)
    assert (migration.migration_type, migration.status) == ("migration", "pre-migrating")
    assert migration.old_instance_type_id == migration.new_instance_type_id == flavor_named("m1.small").id
    assert (migration.user_id, migration.project_id) == ("root", "admin-project")
    assert [a.action for a in actions_of(server_id)] == ["migrate"]
    [execution] = cloud.executions("resize")
    assert execution["name"] == f"resize-{server_id}-{migration.uuid[:8]}"
    assert execution["input"]["requested_host"] is None


def _create_on(host: dict, caller: Caller = ADMIN, version: str = "2.74"):
    return call("POST", "/v2.1/servers", caller=caller, version=version, body={"server": {
        "name": "placed", "flavorRef": "1", "imageRef": cloud_image(), "networks": "none", **host}})


def cloud_image() -> str:
    return images.list_images(name="cirros")[0]["id"]


@pytest.fixture
def nodes(cloud):
    """Compute nodes named apart from their hosts, as an agent started with --node reports them."""
    for host in ("host1", "host2"):
        placement.ensure_provider(host, f"{host}-node", None, {})


@pytest.mark.parametrize("asked", [{"host": "host2", "hypervisor_hostname": "host2-node"}, {"host": "host2"},
                                   {"hypervisor_hostname": "host2-node"}])
def test_admins_create_a_server_on_a_named_host_or_node_from_2_74(cloud, nodes, asked):
    created = _create_on(asked)

    assert created.status == 202, created.body
    spec = api_rows(RequestSpec, instance_uuid=created.body["server"]["id"])[0].spec
    assert spec["requested_destination"] == {("node" if k == "hypervisor_hostname" else k): v for k, v in asked.items()}


@pytest.mark.parametrize(("host", "caller", "version", "status"), [
    ({"host": "no-such-host"}, ADMIN, "2.74", 400),
    ({"hypervisor_hostname": "no-such-node"}, ADMIN, "2.74", 400),
    ({"hypervisor_hostname": "host2"}, ADMIN, "2.74", 400),  # a host's name is not its node's here
    ({"host": "host1", "hypervisor_hostname": "host2-node"}, ADMIN, "2.74", 400),
    ({"host": "host2"}, ALICE, "2.74", 403),
    ({"host": "host2"}, ADMIN, "2.73", 400),  # not in the body before 2.74
])
def test_a_requested_host_that_is_not_one_or_not_allowed_creates_nothing(cloud, nodes, host, caller, version,
                                                                        status):
    assert _create_on(host, caller, version).status == status
    assert api_rows(RequestSpec) == []


def test_migrate_to_a_named_host_from_2_56(cloud):
    server_id = active_server()

    response = action(server_id, {"migrate": {"host": "host2"}}, caller=ADMIN, version="2.56")

    assert response.status == 202
    [execution] = cloud.executions("resize")
    assert execution["input"]["requested_host"] == "host2"


def test_a_named_host_in_another_cell_is_not_found_unless_the_caller_may_move_across_cells(
        cloud, tmp_path, monkeypatch):
    # GIVEN a server in cell1, and a caller the cross-cell policy does not allow (the default)
    server_id = active_server()
    before = snapshot(cloud, server_id)

    # WHEN an admin migrates it to host3, a compute host of cell2
    refused = action(server_id, {"migrate": {"host": "host3"}}, caller=ADMIN, version="2.56")

    # THEN the host is not found (as Nova looks it up only in the server's cell), and nothing changed
    assert refused.status == 400, refused.body
    assert refused.body["badRequest"]["message"] == "Compute host host3 could not be found."
    assert snapshot(cloud, server_id) == before

    # AND once the policy lets admins move servers between cells, the same request is accepted
    write_policy(tmp_path, monkeypatch, {"compute:servers:resize:cross_cell": "admin"})
    assert action(server_id, {"migrate": {"host": "host3"}}, caller=ADMIN, version="2.56").status == 202
    [execution] = cloud.executions("resize")
    assert execution["input"]["requested_host"] == "host3"


def test_migrate_host_is_ignored_below_2_56(cloud):
    server_id = active_server()

    response = action(server_id, {"migrate": {"host": "no-such-host", "whatever": 1}}, caller=ADMIN,
                      version="2.55")

    assert response.status == 202
    [execution] = cloud.executions("resize")
    assert execution["input"]["requested_host"] is None


@pytest.mark.parametrize(("body", "message"), [
    ({"migrate": {"host": "no-such-host"}}, "Compute host no-such-host could not be found."),
    ({"migrate": {"host": "host1"}}, "Cannot migrate to the host where the server exists."),
    ({"migrate": {"host": "host2", "extra": True}}, "Additional properties are not allowed"),
    ({"migrate": {"host": ""}}, "Invalid input for field/attribute migrate/host"),
    ({"migrate": {"host": "host2:8774"}}, "Invalid input for field/attribute migrate/host"),  # not a host name
    ({"migrate": "host2"}, "Invalid input for field/attribute migrate"),
])
def test_bad_migrate_requests_are_400_and_change_nothing(cloud, body, message):
    server_id = active_server()
    before = snapshot(cloud, server_id)

    response = action(server_id, body, caller=ADMIN, version="2.56")

    assert response.status == 400, response.body
    assert message in response.body["badRequest"]["message"]
    assert snapshot(cloud, server_id) == before


def test_a_bad_migrate_body_is_400_before_the_server_is_looked_up(cloud):
    # Nova checks the body against the microversion's schema first: an unknown server does not hide it.
    response = action(str(uuidlib.uuid4()), {"migrate": {"host": 5}}, caller=ADMIN, version="2.56")

    assert response.status == 400, response.body
    assert "Invalid input for field/attribute migrate/host" in response.body["badRequest"]["message"]


def test_migrate_with_a_null_host_lets_the_scheduler_choose(cloud):
    server_id = active_server()

    assert action(server_id, {"migrate": {"host": None}}, caller=ADMIN, version="2.56").status == 202
    assert cloud.executions("resize")[0]["input"]["requested_host"] is None


def test_naming_a_host_needs_its_own_policy(cloud, tmp_path, monkeypatch):
    write_policy(tmp_path, monkeypatch, {"os_compute_api:os-migrate-server:migrate": "admin_or_owner"})
    server_id = active_server()
    before = snapshot(cloud, server_id)

    targeted = action(server_id, {"migrate": {"host": "host2"}}, version="2.56")

    assert targeted.status == 403
    assert "os_compute_api:os-migrate-server:migrate:host" in targeted.body["forbidden"]["message"]
    assert snapshot(cloud, server_id) == before
    assert action(server_id, {"migrate": None}).status == 202


def test_naming_a_host_needs_only_its_own_policy(cloud, tmp_path, monkeypatch):
    # As in Nova, one rule decides: migrate:host when a host is named, migrate when none is
    write_policy(tmp_path, monkeypatch, {"os_compute_api:os-migrate-server:migrate": "!",
                                         "os_compute_api:os-migrate-server:migrate:host": "admin_or_owner"})
    server_id = active_server()
    before = snapshot(cloud, server_id)

    untargeted = action(server_id, {"migrate": None})

    assert untargeted.status == 403
    assert "os_compute_api:os-migrate-server:migrate " in untargeted.body["forbidden"]["message"]
    assert snapshot(cloud, server_id) == before
    assert action(server_id, {"migrate": {"host": "host2"}}, version="2.56").status == 202


def test_migrate_from_a_down_host_or_in_the_wrong_state_is_409(cloud):
    add_host("host-down", up=False)
    down, busy = active_server(), active_server()
    set_instance(down, host="host-down", node="host-down")
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == busy).values(task_state=states.POWERING_ON))

    assert action(down, {"migrate": None}, caller=ADMIN).status == 409
    assert action(busy, {"migrate": None}, caller=ADMIN).status == 409
    assert migrations_of(down) == migrations_of(busy) == []


def test_migrate_of_an_unknown_server_is_404(cloud):
    response = action("00000000-0000-4000-8000-000000000000", {"migrate": None}, caller=ADMIN)

    assert response.status == 404


def test_a_server_still_building_cannot_move(cloud):
    server_id = create_server()

    response = action(server_id, {"resize": {"flavorRef": "2"}})

    assert response.status == 409
    assert "vm_state building" in response.body["conflictingRequest"]["message"]


# --- confirm --------------------------------------------------------------------------------------


def test_confirm_answers_204_and_starts_the_confirm_workflow(cloud):
    server_id, migration_uuid = resized_server()

    response = action(server_id, {"confirmResize": None})

    assert (response.status, response.body) == (204, None)
    request_id = response.header("x-openstack-request-id")
    assert migrations_of(server_id)[0].status == "confirming"
    row = instance(server_id)
    assert (row.vm_state, row.task_state) == (states.RESIZED, None)
    assert [(a.action, a.request_id) for a in actions_of(server_id)] == [("confirmResize", request_id)]
    [execution] = cloud.executions("confirm_resize")
    assert execution["name"] == f"confirm-{server_id}-{migration_uuid[:8]}"
    assert execution["input"] == {"instance_uuid": server_id, "migration_uuid": migration_uuid, "cell": "cell1",
                                  "request_id": request_id, "execution_name": execution["name"]}


def test_confirm_of_a_server_that_was_not_resized_is_400(cloud):
    server_id = active_server()
    before = snapshot(cloud, server_id)

    response = action(server_id, {"confirmResize": None})

    assert response.status == 400
    assert response.body["badRequest"]["message"] == "Instance has not been resized."
    assert snapshot(cloud, server_id) == before


@pytest.mark.parametrize("vm_state", [states.ACTIVE, states.STOPPED])
def test_revert_of_a_server_that_was_not_resized_is_409_as_in_nova(cloud, vm_state):
    # GIVEN a server that was never resized (no migration at all)
    server_id = active_server(vm_state=vm_state)
    before = snapshot(cloud, server_id)

    # WHEN its resize is reverted
    response = action(server_id, {"revertResize": None})

    # THEN Nova's vm_state check answers, before any look at migrations; nothing changes
    assert response.status == 409
    assert response.body["conflictingRequest"]["message"] == \
        f"Cannot 'revertResize' instance {server_id} while it is in vm_state {vm_state}"
    assert snapshot(cloud, server_id) == before
    assert cloud.executions("revert_resize") == []


def test_confirm_without_a_finished_migration_is_400(cloud):
    server_id, _ = resized_server(status=migration_states.ERROR)
    before = snapshot(cloud, server_id)

    response = action(server_id, {"confirmResize": None})

    assert response.status == 400
    assert snapshot(cloud, server_id) == before


@pytest.mark.parametrize("source", ["host1", "host3"])  # host3: in cell2, a move between cells
def test_confirm_while_the_source_host_is_down_is_409_and_changes_nothing(cloud, source):
    # GIVEN a server in VERIFY_RESIZE whose migration's source host is down
    server_id, migration_uuid = resized_server()
    source_cell = "cell2" if source == "host3" else "cell1"
    with cell_session("cell1") as session:
        session.execute(update(Migration).where(Migration.uuid == migration_uuid).values(
            source_compute=source, source_node=source, cross_cell_move=source_cell != "cell1"))
    with cell_session(source_cell) as session:
        session.execute(update(Service).where(Service.host == source).values(forced_down=True))
    before = snapshot(cloud, server_id)

    # WHEN its owner confirms the resize
    response = action(server_id, {"confirmResize": None})

    # THEN it is refused in Nova's words, before the migration is touched; once the host is up
    # again the confirm is accepted
    assert response.status == 409, response.body
    assert response.body["conflictingRequest"]["message"] == "Service is unavailable at this time."
    assert snapshot(cloud, server_id) == before and cloud.executions("confirm_resize") == []
    with cell_session(source_cell) as session:
        session.execute(update(Service).where(Service.host == source).values(forced_down=False))
    assert action(server_id, {"confirmResize": None}).status == 204


@pytest.mark.parametrize(("body", "reason"), [
    ({"confirmResize": None}, "task_state resize_prep"),
    ({"revertResize": None}, "vm_state active"),  # a revert checks vm_state first, as Nova does
])
def test_confirm_or_revert_during_the_resize_is_409(cloud, body, reason):
    server_id = active_server()
    assert action(server_id, {"resize": {"flavorRef": "2"}}).status == 202
    before = snapshot(cloud, server_id)

    response = action(server_id, body)

    assert response.status == 409
    assert reason in response.body["conflictingRequest"]["message"]
    assert snapshot(cloud, server_id) == before


@pytest.mark.parametrize(("first", "second"), [
    ("confirmResize", "confirmResize"), ("confirmResize", "revertResize"),
    ("revertResize", "confirmResize"), ("revertResize", "revertResize"),
])
def test_a_second_confirm_or_revert_loses_with_409(cloud, first, second):
    server_id, migration_uuid = resized_server()
    assert action(server_id, {first: None}).status in (202, 204)
    before = snapshot(cloud, server_id)

    response = action(server_id, {second: None})

    assert response.status == 409
    assert snapshot(cloud, server_id) == before


def test_confirm_of_a_locked_server_is_409_for_members(cloud):
    server_id, _ = resized_server()
    set_instance(server_id, locked=True)

    assert action(server_id, {"confirmResize": None}).status == 409
    assert action(server_id, {"revertResize": None}).status == 409
    assert cloud.executions("confirm_resize") == [] and cloud.executions("revert_resize") == []
    assert action(server_id, {"confirmResize": None}, caller=ADMIN).status == 204


def test_confirm_and_revert_are_404_for_another_project_and_follow_the_policy_file(cloud, tmp_path, monkeypatch):
    server_id, _ = resized_server()
    assert action(server_id, {"confirmResize": None}, caller=BOB).status == 404
    assert action(server_id, {"revertResize": None}, caller=BOB).status == 404
    write_policy(tmp_path, monkeypatch, {"os_compute_api:servers:confirm_resize": "admin",
                                         "os_compute_api:servers:revert_resize": "!"})

    assert action(server_id, {"confirmResize": None}).status == 403
    assert action(server_id, {"revertResize": None}, caller=ADMIN).status == 403
    assert migrations_of(server_id)[0].status == "finished"


def test_confirm_body_must_be_null(cloud):
    server_id, _ = resized_server()

    response = action(server_id, {"confirmResize": {"now": True}})

    assert response.status == 400
    assert migrations_of(server_id)[0].status == "finished"


def test_a_confirm_workflow_that_cannot_start_is_undone(cloud, monkeypatch):
    server_id, _ = resized_server()
    monkeypatch.setenv("FERRY_CONFIRM_RESIZE_STATE_MACHINE_ARN", "")
    config.reset()

    assert action(server_id, {"confirmResize": None}).status == 500

    assert migrations_of(server_id)[0].status == "finished"
    assert actions_of(server_id) == []


def test_begin_confirm_is_what_the_automatic_confirm_calls(cloud):
    server_id, migration_uuid = resized_server()

    returned = moves.begin_confirm("cell1", server_id, request_id="req-auto", user_id=None, project_id=None)

    assert returned == migration_uuid
    [action_row] = actions_of(server_id)
    assert (action_row.action, action_row.request_id, action_row.user_id) == ("confirmResize", "req-auto", None)
    with pytest.raises(errors.MigrationInProgress):
        moves.begin_confirm("cell1", server_id, request_id="req-auto-2", user_id=None, project_id=None)


# --- revert ---------------------------------------------------------------------------------------


def test_revert_answers_202_and_starts_the_revert_workflow(cloud):
    server_id, migration_uuid = resized_server(old_vm_state=states.STOPPED)

    response = action(server_id, {"revertResize": None})

    assert (response.status, response.body) == (202, None)
    request_id = response.header("x-openstack-request-id")
    assert migrations_of(server_id)[0].status == "reverting"
    row = instance(server_id)
    assert (row.vm_state, row.task_state, row.old_vm_state) == (states.RESIZED, states.RESIZE_REVERTING,
                                                                states.STOPPED)
    assert [(a.action, a.request_id) for a in actions_of(server_id)] == [("revertResize", request_id)]
    [execution] = cloud.executions("revert_resize")
    assert execution["name"] == f"revert-{server_id}-{migration_uuid[:8]}"
    assert execution["input"] == {"instance_uuid": server_id, "migration_uuid": migration_uuid, "cell": "cell1",
                                  "request_id": request_id, "execution_name": execution["name"]}
    shown = call("GET", f"/v2.1/servers/{server_id}", version="2.90").body["server"]
    assert shown["status"] == "REVERT_RESIZE"


def test_revert_works_after_the_old_flavor_was_deleted(cloud):
    server_id, _ = resized_server()
    assert call("DELETE", "/v2.1/flavors/1", caller=ADMIN).status == 202

    assert action(server_id, {"revertResize": None}).status == 202
    assert instance(server_id).old_flavor["name"] == "m1.small"


def test_revert_without_the_old_flavor_or_a_finished_migration_is_400(cloud):
    forgotten, _ = resized_server()
    set_instance(forgotten, old_flavor=None)
    failed, _ = resized_server(status=migration_states.ERROR)  # resized, but no finished migration

    for server_id in (forgotten, failed):
        before = snapshot(cloud, server_id)
        response = action(server_id, {"revertResize": None})
        assert response.status == 400, response.body
        assert snapshot(cloud, server_id) == before


def test_a_revert_workflow_that_cannot_start_is_undone(cloud, monkeypatch):
    server_id, _ = resized_server()
    monkeypatch.setenv("FERRY_REVERT_RESIZE_STATE_MACHINE_ARN", "")
    config.reset()

    assert action(server_id, {"revertResize": None}).status == 500

    assert migrations_of(server_id)[0].status == "finished"
    assert instance(server_id).task_state is None
    assert actions_of(server_id) == []


SETTLE_STEPS = {"confirmResize": confirm_steps.check_resize_to_confirm,
                "revertResize": revert_steps.check_resize_to_revert}


def start_answering_an_error(monkeypatch: pytest.MonkeyPatch, *, began: bool) -> list[dict[str, Any]]:
    """StartExecution answers an error (and Step Functions cannot show the execution); with ``began``
    the workflow began all the same and its first step ran. The payloads it was asked to start."""
    payloads: list[dict[str, Any]] = []

    def start(arn: str, name: str, payload: dict[str, Any]) -> str:
        payloads.append(payload)
        if began:
            step = confirm_steps.check_resize_to_confirm if "confirm" in name else revert_steps.check_resize_to_revert
            step(payload)
        raise RuntimeError("Step Functions is unreachable")

    monkeypatch.setattr(moves.workflows, "start_execution", start)
    return payloads


@pytest.mark.parametrize("settle", ["confirmResize", "revertResize"])
def test_a_confirm_or_revert_whose_workflow_began_though_its_start_answered_an_error_stands(cloud, monkeypatch,
                                                                                             settle):
    server_id, _ = resized_server()
    start_answering_an_error(monkeypatch, began=True)

    response = action(server_id, {settle: None})

    # THEN it is accepted, for its workflow to finish: nothing was undone under it
    assert response.status in (202, 204), response.body
    assert migrations_of(server_id)[0].status == ("confirming" if settle == "confirmResize" else "reverting")
    assert [a.action for a in actions_of(server_id)] == [settle]


@pytest.mark.parametrize("settle", ["confirmResize", "revertResize"])
def test_the_first_step_of_a_confirm_or_revert_the_api_undid_changes_nothing(cloud, monkeypatch, settle):
    server_id, _ = resized_server()
    payloads = start_answering_an_error(monkeypatch, began=False)
    assert action(server_id, {settle: None}).status == 500
    [payload] = payloads
    before = snapshot(cloud, server_id)

    with pytest.raises(errors.UnexpectedMigrationState):
        SETTLE_STEPS[settle](payload)

    assert snapshot(cloud, server_id) == before
    assert migrations_of(server_id)[0].status == "finished" and actions_of(server_id) == []


@pytest.mark.parametrize("settle", ["confirmResize", "revertResize"])
def test_the_late_first_step_of_an_undone_request_leaves_a_newer_ones_migration_alone(cloud, monkeypatch, settle):
    # GIVEN a confirm or revert the API undid (its start answered an error), then asked again and accepted
    server_id, _ = resized_server()
    with monkeypatch.context() as patched:
        payloads = start_answering_an_error(patched, began=False)
        assert action(server_id, {settle: None}).status == 500
    assert action(server_id, {settle: None}).status in (202, 204)

    # WHEN the undone request's first step runs late, THEN it refuses: the migration is the newer request's
    with pytest.raises(errors.UnexpectedMigrationState, match="undone"):
        SETTLE_STEPS[settle](payloads[0])
    assert migrations_of(server_id)[0].status == ("confirming" if settle == "confirmResize" else "reverting")


# --- what the NoValidHost rule means for the API ---------------------------------------------------


def test_a_move_with_no_possible_destination_is_still_accepted(cloud):
    """Scheduling happens in the workflow: the API accepts, the action's event will carry NoValidHost."""
    server_id = active_server()
    with cell_session("cell1") as session:
        session.execute(update(moves.Service).where(moves.Service.host == "host2").values(disabled=True))
    with cell_session("cell2") as session:
        session.execute(update(moves.Service).where(moves.Service.host == "host3").values(disabled=True))

    assert action(server_id, {"migrate": None}, caller=ADMIN).status == 202
    assert len(cloud.executions("resize")) == 1


# --- real concurrency -----------------------------------------------------------------------------


def test_concurrent_moves_of_one_server_admit_exactly_one(cloud):
    """Four requests race (threads, one transaction each): one move is accepted, the others get 409."""
    import threading

    from ferry.auth import RequestContext

    server_id = active_server()
    barrier = threading.Barrier(4)
    outcomes: list[Any] = []

    def attempt(flavor_ref: str | None) -> None:
        ctx = RequestContext(user_id="root", project_id="admin-project", roles=("admin",))
        location = compute_api.locate(ctx, server_id)
        barrier.wait()
        try:
            if flavor_ref is None:
                moves.begin_migrate(ctx, location)
            else:
                moves.begin_resize(ctx, location, flavor_ref)
            outcomes.append("accepted")
        except errors.FerryError as exc:
            outcomes.append(exc.http_status)

    threads = [threading.Thread(target=attempt, args=(ref,)) for ref in ("2", "3", None, "private")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert sorted(outcomes, key=str) == [409, 409, 409, "accepted"]
    [migration] = migrations_of(server_id)
    assert migration.status == "pre-migrating" and len(cloud.executions("resize")) == 1
    assert len(actions_of(server_id)) == 1
    assert instance(server_id).task_state == states.RESIZE_PREP


def test_concurrent_confirm_and_revert_admit_exactly_one(cloud):
    import threading

    server_id, _ = resized_server()
    barrier = threading.Barrier(4)
    outcomes: list[Any] = []

    def attempt(begin: Any, index: int) -> None:
        barrier.wait()
        try:
            begin("cell1", server_id, request_id=f"req-{index}", user_id="alice", project_id="project-a")
            outcomes.append("accepted")
        except errors.FerryError as exc:
            outcomes.append(exc.http_status)

    threads = [threading.Thread(target=attempt, args=(begin, i))
               for i, begin in enumerate((moves.begin_confirm, moves.begin_revert) * 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert sorted(outcomes, key=str) == [409, 409, 409, "accepted"]
    assert len(actions_of(server_id)) == 1
    started = len(cloud.executions("confirm_resize")) + len(cloud.executions("revert_resize"))
    assert started == 1
    status = migrations_of(server_id)[0].status
    assert (status, instance(server_id).task_state) in (("confirming", None), ("reverting", "resize_reverting"))


def test_a_confirm_asked_again_after_its_workflow_gave_the_migration_back_gets_a_new_execution(cloud):
    server_id, migration_uuid = resized_server()
    assert action(server_id, {"confirmResize": None}).status == 204
    [first] = cloud.sfn.list_executions(stateMachineArn=cloud.state_machines["confirm_resize"])["executions"]
    cloud.sfn.stop_execution(executionArn=first["executionArn"])
    with cell_session("cell1") as session:  # what the workflow's RestoreVerifyResize does
        session.execute(update(Migration).where(Migration.uuid == migration_uuid).values(
            status=migration_states.FINISHED))

    again = action(server_id, {"confirmResize": None})

    assert again.status == 204
    base = f"confirm-{server_id}-{migration_uuid[:8]}"
    executions = {e["name"]: e["input"]["request_id"] for e in cloud.executions("confirm_resize")}
    again_id = again.header("x-openstack-request-id")
    again_name = f"{base}-{hashlib.sha256(again_id.encode()).hexdigest()[:8]}"
    assert executions == {base: first_request_id(server_id), again_name: again_id}


def test_the_same_request_started_twice_keeps_its_execution_name(cloud):
    server_id, migration_uuid = resized_server()
    moves.begin_revert("cell1", server_id, request_id="req-same", user_id=None, project_id=None)
    with cell_session("cell1") as session:
        session.execute(update(Migration).where(Migration.uuid == migration_uuid).values(
            status=migration_states.FINISHED))
    set_instance(server_id, task_state=None)

    moves.begin_revert("cell1", server_id, request_id="req-same", user_id=None, project_id=None)

    assert [e["name"] for e in cloud.executions("revert_resize")] == [f"revert-{server_id}-{migration_uuid[:8]}"]


def first_request_id(server_id: str) -> str:
    return actions_of(server_id)[0].request_id
