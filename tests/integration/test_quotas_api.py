"""Project quotas: ``/os-quota-sets``, ``/limits``, counting across cells and the check on create."""

from __future__ import annotations

import pytest
from sqlalchemy import event, false, select, update
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import ORMExecuteState, Session
from test_api_moves import active_server, resized_server, set_instance, snapshot_of, start_move_cloud
from test_api_support import ADMIN, ALICE, BOB, api_rows, call, cell_away, create_server, mocked_cloud

from ferry import auth, config, quotas
from ferry.compute import states
from ferry.store.api_models import AuthToken, BuildRequest, CellMapping, InstanceMapping, Quota
from ferry.store.cell_models import Instance
from ferry.store.db import api_session, cell_session

NOVA_SET = {"cores": 20, "instances": 10, "ram": 51200, "key_pairs": 100, "metadata_items": 128,
            "server_groups": 10, "server_group_members": 10}
INJECTED = {"injected_files": 5, "injected_file_content_bytes": 10240, "injected_file_path_bytes": 255}


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    for mocked in mocked_cloud(monkeypatch, tmp_path):
        yield start_move_cloud(mocked, monkeypatch)


# --- quota sets ---------------------------------------------------------------------------------


def test_a_project_starts_with_novas_defaults(cloud):
    response = call("GET", "/v2.1/os-quota-sets/project-a", caller=ALICE, version="2.57")

    assert response.status == 200
    assert response.body == {"quota_set": {"id": "project-a", **NOVA_SET}}


def test_older_microversions_show_injected_files_and_network_quotas(cloud):
    before_2_57 = call("GET", "/v2.1/os-quota-sets/project-a", caller=ALICE, version="2.56").body["quota_set"]
    before_2_36 = call("GET", "/v2.1/os-quota-sets/project-a", caller=ALICE, version="2.35").body["quota_set"]

    assert before_2_57 == {"id": "project-a", **NOVA_SET, **INJECTED}
    assert before_2_36["floating_ips"] == 10 and before_2_36["security_groups"] == 10
    assert before_2_36["fixed_ips"] == -1 and before_2_36["security_group_rules"] == 20


def test_defaults_come_from_the_environment(cloud, monkeypatch):
    monkeypatch.setenv("FERRY_QUOTA_CORES", "8")
    monkeypatch.setenv("FERRY_QUOTA_RAM", "-1")
    config.reset()

    shown = call("GET", "/v2.1/os-quota-sets/project-a/defaults", caller=BOB, version="2.90").body["quota_set"]

    assert (shown["id"], shown["cores"], shown["ram"], shown["instances"]) == ("project-a", 8, -1, 10)


def test_members_see_only_their_own_projects_quota(cloud):
    assert call("GET", "/v2.1/os-quota-sets/project-b", caller=ALICE).status == 403
    assert call("GET", "/v2.1/os-quota-sets/project-b/detail", caller=ALICE).status == 403
    assert call("GET", "/v2.1/os-quota-sets/project-b", caller=ADMIN).status == 200


def test_admin_sets_and_deletes_a_projects_quota(cloud):
    updated = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN, version="2.90",
                   body={"quota_set": {"cores": 40, "ram": "102400", "instances": -1}})

    assert updated.status == 200
    assert updated.body == {"quota_set": {**NOVA_SET, "cores": 40, "ram": 102400, "instances": -1}}
    shown = call("GET", "/v2.1/os-quota-sets/project-a", caller=ALICE, version="2.90").body["quota_set"]
    assert (shown["cores"], shown["ram"], shown["instances"]) == (40, 102400, -1)
    assert call("GET", "/v2.1/os-quota-sets/project-b", caller=ADMIN).body["quota_set"]["cores"] == 20

    assert call("DELETE", "/v2.1/os-quota-sets/project-a", caller=ADMIN).status == 202
    assert call("GET", "/v2.1/os-quota-sets/project-a", caller=ALICE).body["quota_set"]["cores"] == 20


def test_members_cannot_change_quotas(cloud):
    assert call("PUT", "/v2.1/os-quota-sets/project-a", caller=ALICE, body={"quota_set": {"cores": 99}}).status == 403
    assert call("DELETE", "/v2.1/os-quota-sets/project-a", caller=ALICE).status == 403
    assert quotas.limits("project-a")["cores"] == 20


@pytest.mark.parametrize("body", [
    {"quota_set": {"cores": -2}},
    {"quota_set": {"cores": "lots"}},
    {"quota_set": {"floppies": 1}},
    {"quota_set": {"injected_files": 1}},  # gone at 2.57
    {"quota_set": {"cores": 1}, "extra": {}},
    {"cores": 1},
])
def test_bad_quota_updates_are_400(cloud, body):
    response = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN, body=body, version="2.90")

    assert response.status == 400, response.body
    assert quotas.limits("project-a") == quotas.defaults()


def test_a_limit_below_usage_needs_force(cloud):
    active_server()
    active_server()  # 2 cores, 1024 MB

    refused = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN, body={"quota_set": {"cores": 1}})
    forced = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN,
                  body={"quota_set": {"cores": 1, "force": True}})

    assert refused.status == 400
    assert refused.body["badRequest"]["message"] == \
        "Quota limit 1 for cores must be greater than or equal to already used and reserved 2."
    assert forced.status == 200 and forced.body["quota_set"]["cores"] == 1


@pytest.mark.parametrize("project_id", ["a b", "a%20b", "proj:1", "x" * 256])
@pytest.mark.parametrize(("method", "suffix", "body"), [
    ("GET", "", None),
    ("GET", "/detail", None),
    ("GET", "/defaults", None),
    ("PUT", "", {"quota_set": {"cores": 5}}),
    ("DELETE", "", None),
])
def test_a_project_id_no_project_can_have_is_400_and_writes_nothing(cloud, project_id, method, suffix, body):
    # WHEN an admin names a project by an id the identity API would never find
    response = call(method, f"/v2.1/os-quota-sets/{project_id}{suffix}", caller=ADMIN, body=body, version="2.90")

    # THEN it is refused as Nova refuses a project it cannot verify, and no quota is written for it
    assert response.status == 400, response.body
    assert response.body["badRequest"]["message"] == f"Project ID {project_id} is not a valid project."
    assert api_rows(Quota) == []
    assert project_id not in [p["id"] for p in call("GET", "/identity/v3/projects", caller=ADMIN).body["projects"]]


def test_a_project_a_token_was_issued_for_before_ids_were_narrowed_keeps_its_quotas(cloud):
    # GIVEN a token stored for project "proj:1" before new tokens were refused such ids
    with api_session() as session:
        session.add(AuthToken(token_sha256=auth.hash_token("old-token"), user_id="u1", project_id="proj:1",
                              roles=["member"]))

    # WHEN an admin sets and reads its quotas
    updated = call("PUT", "/v2.1/os-quota-sets/proj:1", caller=ADMIN, body={"quota_set": {"cores": 7}},
                   version="2.90")
    shown = call("GET", "/v2.1/os-quota-sets/proj:1", caller=ADMIN, version="2.90")

    # THEN its quotas are as for any project
    assert (updated.status, shown.status) == (200, 200), (updated.body, shown.body)
    assert shown.body["quota_set"]["cores"] == 7


def test_a_first_limit_set_by_a_concurrent_request_is_updated_not_a_server_error(cloud):
    # GIVEN another request commits a first cores limit for project-a after this request read the
    # project's quota rows: the row is in the database, the first read is made to have missed it
    with api_session() as session:
        session.add(Quota(project_id="project-a", resource="cores", hard_limit=30))
    reads: list[str] = []

    def read_before_the_other_committed(state: ORMExecuteState):
        if state.is_select and state.all_mappers and state.all_mappers[0].class_ is Quota and not reads:
            reads.append("quotas")
            return state.invoke_statement(statement=state.statement.where(false()))
        return None

    event.listen(Session, "do_orm_execute", read_before_the_other_committed)
    try:
        # WHEN this request sets the cores limit (and another) of the project
        response = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN, version="2.90",
                        body={"quota_set": {"cores": 40, "instances": 7}})
    finally:
        event.remove(Session, "do_orm_execute", read_before_the_other_committed)

    # THEN its insert meets the other's row, and it is written again as an update: one row, its limit
    assert reads == ["quotas"]
    assert response.status == 200, response.body
    assert (response.body["quota_set"]["cores"], response.body["quota_set"]["instances"]) == (40, 7)
    assert [row.hard_limit for row in api_rows(Quota, resource="cores")] == [40]


def test_per_user_quotas_are_refused(cloud):
    response = call("GET", "/v2.1/os-quota-sets/project-a", caller=ADMIN, query={"user_id": "alice"})

    assert response.status == 400


@pytest.mark.parametrize("path", ["/v2.1/os-quota-sets/project-a", "/v2.1/os-quota-sets/project-a/detail",
                                  "/v2.1/limits"])
def test_an_unknown_query_parameter_is_refused_from_2_75_and_ignored_before(cloud, path):
    refused = call("GET", path, caller=ALICE, version="2.75", query={"colour": "red"})
    by_stranger = call("GET", path, caller=BOB, version="2.75", query={"colour": "red"})
    ignored = call("GET", path, caller=ALICE, version="2.74", query={"colour": "red"})

    for response in (refused, by_stranger):  # the query is checked before the policy, as in Nova
        assert response.status == 400
        assert response.body["badRequest"]["message"] == (
            "Invalid input for query parameters colour. Additional properties are not allowed "
            "('colour' was unexpected)")
    assert ignored.status == 200
    assert call("GET", path, caller=ALICE, version="2.75").status == 200


def test_deleting_a_users_quota_is_refused_and_keeps_the_projects(cloud):
    call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN, body={"quota_set": {"cores": 40}})

    response = call("DELETE", "/v2.1/os-quota-sets/project-a", caller=ADMIN, query={"user_id": "alice"})

    assert response.status == 400, response.body
    assert quotas.limits("project-a")["cores"] == 40


def test_detail_shows_usage(cloud):
    active_server()
    create_server(name="still-building", flavorRef="2")

    detail = call("GET", "/v2.1/os-quota-sets/project-a/detail", caller=ALICE, version="2.90").body["quota_set"]

    assert detail["id"] == "project-a"
    assert detail["instances"] == {"limit": 10, "in_use": 2, "reserved": 0}
    assert detail["cores"] == {"limit": 20, "in_use": 3, "reserved": 0}
    assert detail["ram"] == {"limit": 51200, "in_use": 1536, "reserved": 0}
    assert detail["key_pairs"] == {"limit": 100, "in_use": 0, "reserved": 0}


# --- counting -----------------------------------------------------------------------------------


def test_usage_counts_every_cell_and_leaves_out_deleted_and_hidden_copies(cloud):
    small = snapshot_of("m1.small")
    with cell_session("cell2") as session:
        session.add(Instance(display_name="other-cell", project_id="project-a", user_id="alice", flavor=small,
                             vm_state=states.ACTIVE))
        session.add(Instance(display_name="hidden-copy", project_id="project-a", user_id="alice", flavor=small,
                             vm_state=states.ACTIVE, hidden=True))
        session.add(Instance(display_name="gone", project_id="project-a", user_id="alice", flavor=small,
                             vm_state=states.DELETED, deleted=True))
    with cell_session("cell0") as session:
        session.add(Instance(display_name="unscheduled", project_id="project-a", user_id="alice", flavor=small,
                             vm_state=states.ERROR))
        session.add(Instance(display_name="bobs", project_id="project-b", user_id="bob", flavor=small,
                             vm_state=states.ERROR))

    assert quotas.usage("project-a") == {"instances": 2, "cores": 2, "ram": 1024}


def test_a_cell_whose_database_does_not_answer_is_left_out_of_the_count(cloud, monkeypatch):
    # GIVEN a server of the project in cell1 and one in cell2, whose database stops answering
    small = snapshot_of("m1.small")
    for cell in ("cell1", "cell2"):
        with cell_session(cell) as session:
            session.add(Instance(display_name=cell, project_id="project-a", user_id="alice", flavor=small,
                                 vm_state=states.ACTIVE))
    cell_away(monkeypatch, quotas, "cell2")

    # WHEN the project's usage is counted, THEN cell2's server is left out, not the count failed
    assert quotas.usage("project-a") == {"instances": 1, "cores": 1, "ram": 512}

    # AND a database error that is not of the moment still fails the count
    cell_away(monkeypatch, quotas, "cell2", broken=True)
    with pytest.raises(ProgrammingError):
        quotas.usage("project-a")


def test_a_server_recorded_in_two_cells_counts_once_as_its_mapped_cell_records_it(cloud):
    # GIVEN a server in cell1 and, as a move between cells leaves it for a moment, a visible copy in cell2
    server_id = active_server()  # m1.small: 1 core, 512 MB
    with cell_session("cell2") as session:
        session.add(Instance(uuid=server_id, display_name="copy", project_id="project-a", user_id="alice",
                             flavor=snapshot_of("m1.medium"), vm_state=states.RESIZED))

    # THEN it counts once, as the cell its instance mapping names records it
    assert quotas.usage("project-a") == {"instances": 1, "cores": 1, "ram": 512}

    # WHEN the mapping moves to cell2 and cell1's record is hidden
    with api_session() as session:
        cell2 = session.scalars(select(CellMapping.id).where(CellMapping.name == "cell2")).one()
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server_id)
                        .values(cell_id=cell2))
    assert quotas.usage("project-a") == {"instances": 1, "cores": 2, "ram": 1024}
    set_instance(server_id, hidden=True)

    # THEN it still counts once, now as cell2 records it
    assert quotas.usage("project-a") == {"instances": 1, "cores": 2, "ram": 1024}


def test_a_hidden_record_in_the_mapped_cell_counts(cloud):
    # Usage reads the instance mappings before the cells: by the time a cell is read, a switch between
    # cells may have hidden the record that the mapping, as read, still names.
    server_id = active_server()
    set_instance(server_id, hidden=True)

    assert quotas.usage("project-a") == {"instances": 1, "cores": 1, "ram": 512}


def test_a_hidden_record_in_the_mapped_cell_counts_the_larger_of_it_and_a_visible_copy_once(cloud):
    # GIVEN a server mapped to cell1 whose record there a switch between cells hid after the mapping was
    # read, and its copy in cell2, visible, with the larger flavor
    server_id = active_server()  # m1.small: 1 core, 512 MB
    set_instance(server_id, hidden=True)
    with cell_session("cell2") as session:
        session.add(Instance(uuid=server_id, display_name="copy", project_id="project-a", user_id="alice",
                             flavor=snapshot_of("m1.medium"), vm_state=states.RESIZED))

    # THEN it counts once, the larger of the two
    assert quotas.usage("project-a") == {"instances": 1, "cores": 2, "ram": 1024}


def test_a_mapping_queued_for_delete_does_not_make_a_hidden_record_count(cloud):
    # GIVEN a server being deleted (its mapping queued for delete) whose record in its cell is hidden
    server_id = active_server()
    set_instance(server_id, hidden=True)
    with api_session() as session:
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server_id)
                        .values(queued_for_delete=True))

    # THEN only undeleted mappings say where a server lives: a hidden record alone does not count
    assert quotas.usage("project-a") == {"instances": 0, "cores": 0, "ram": 0}


def test_a_server_in_resize_counts_the_larger_of_its_flavors(cloud):
    server_id, _ = resized_server()  # m1.small (1, 512) -> m1.medium (2, 1024)
    set_instance(server_id, flavor=snapshot_of("m1.medium"), old_flavor={**snapshot_of("m1.small"), "vcpus": 3})

    assert quotas.usage("project-a") == {"instances": 1, "cores": 3, "ram": 1024}

    set_instance(server_id, vm_state=states.ACTIVE, task_state=None)  # settled: the current flavor only
    assert quotas.usage("project-a") == {"instances": 1, "cores": 2, "ram": 1024}


def test_a_server_queued_for_delete_before_scheduling_does_not_count(cloud):
    server_id = create_server()
    with api_session() as session:
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == server_id)
                        .values(queued_for_delete=True))

    assert quotas.usage("project-a")["instances"] == 0


# --- create -------------------------------------------------------------------------------------


def test_create_over_the_instances_quota_is_403_and_writes_nothing(cloud):
    quotas.update("project-a", {"instances": 1})
    create_server()

    response = call("POST", "/v2.1/servers", version="2.90", body={
        "server": {"name": "second", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto"}})

    assert response.status == 403
    assert response.body["forbidden"]["message"] == \
        "Quota exceeded for instances: Requested 1, but already used 1 of 1 instances"
    with api_session() as session:
        assert session.query(BuildRequest).count() == 1
    assert cloud.executions("boot") and len(cloud.executions("boot")) == 1


def test_create_over_the_cores_quota_names_cores(cloud):
    quotas.update("project-a", {"cores": 2})
    create_server()  # 1 core

    response = call("POST", "/v2.1/servers", version="2.90", body={
        "server": {"name": "big", "flavorRef": "2", "imageRef": cloud.image_id, "networks": "auto"}})

    assert response.status == 403
    assert response.body["forbidden"]["message"] == \
        "Quota exceeded for cores: Requested 2, but already used 1 of 2 cores"


def test_another_projects_servers_do_not_count(cloud):
    quotas.update("project-a", {"instances": 1})
    create_server(BOB)
    create_server(BOB)

    assert call("POST", "/v2.1/servers", version="2.90", body={
        "server": {"name": "mine", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto"}}).status == 202


def test_a_boot_that_loses_the_race_for_the_last_instance_is_removed(cloud, monkeypatch):
    quotas.update("project-a", {"instances": 1})
    original = quotas.servers_that_fit

    def racer_boots_meanwhile(project_id, each, minimum, maximum):
        fit = original(project_id, each, minimum, maximum)
        with cell_session("cell1") as session:
            session.add(Instance(display_name="racer", project_id="project-a", user_id="alice",
                                 flavor=snapshot_of("m1.small"), vm_state=states.ACTIVE))
        return fit

    monkeypatch.setattr(quotas, "servers_that_fit", racer_boots_meanwhile)

    response = call("POST", "/v2.1/servers", version="2.90", body={
        "server": {"name": "late", "flavorRef": "1", "imageRef": cloud.image_id, "networks": "auto"}})

    assert response.status == 403
    with api_session() as session:
        assert session.query(BuildRequest).count() == 0 and session.query(InstanceMapping).count() == 0
    assert cloud.executions("boot") == []


# --- limits -------------------------------------------------------------------------------------


def test_limits_show_the_projects_limits_and_usage(cloud):
    active_server()
    quotas.update("project-a", {"cores": 7})

    absolute = call("GET", "/v2.1/limits", caller=ALICE, version="2.90").body["limits"]["absolute"]

    assert absolute == {"maxServerMeta": 128, "maxTotalKeypairs": 100, "maxServerGroups": 10,
                        "maxServerGroupMembers": 10, "maxTotalCores": 7, "maxTotalInstances": 10,
                        "maxTotalRAMSize": 51200, "totalCoresUsed": 1, "totalInstancesUsed": 1,
                        "totalRAMUsed": 512, "totalServerGroupsUsed": 0}


def test_limits_before_2_57_and_2_39_and_2_36(cloud):
    body = call("GET", "/v2.1/limits", caller=ALICE, version="2.35").body["limits"]

    assert body["rate"] == []
    absolute = body["absolute"]
    assert (absolute["maxPersonality"], absolute["maxPersonalitySize"], absolute["maxImageMeta"]) == (5, 10240, 128)
    assert absolute["maxTotalFloatingIps"] == 10 and absolute["totalSecurityGroupsUsed"] == 0
    assert "maxImageMeta" not in call("GET", "/v2.1/limits", caller=ALICE, version="2.39").body["limits"]["absolute"]


def test_limits_of_another_project_are_for_admins(cloud):
    create_server(BOB)

    assert call("GET", "/v2.1/limits", caller=ALICE, query={"tenant_id": "project-b"}).status == 403
    shown = call("GET", "/v2.1/limits", caller=ADMIN, query={"tenant_id": "project-b"}).body["limits"]["absolute"]
    assert shown["totalInstancesUsed"] == 1
    later = call("GET", "/v2.1/limits", caller=ADMIN, version="2.75", query={"tenant_id": "project-b"})
    assert later.status == 200 and later.body["limits"]["absolute"]["totalInstancesUsed"] == 1


def test_naming_even_the_callers_own_project_in_limits_needs_the_other_project_rule(cloud):
    """Nova checks ``limits:other_project`` whenever ``tenant_id`` is given, whichever project it names."""
    own = call("GET", "/v2.1/limits", caller=ALICE, query={"tenant_id": "project-a"})

    assert own.status == 403
    assert own.body["forbidden"]["message"] == \
        "Policy doesn't allow os_compute_api:limits:other_project to be performed."
    assert call("GET", "/v2.1/limits", caller=ALICE).status == 200
    assert call("GET", "/v2.1/limits", caller=ADMIN, query={"tenant_id": "admin-project"}).status == 200


def test_an_invalid_default_is_reported(cloud, monkeypatch):
    monkeypatch.setenv("FERRY_QUOTA_INSTANCES", "many")
    config.reset()

    response = call("GET", "/v2.1/os-quota-sets/project-a", caller=ALICE)

    assert response.status == 500


@pytest.mark.parametrize("value", [10**20, "2147483648", "-2"])
def test_a_quota_out_of_range_is_400_and_changes_nothing(cloud, value):
    before = call("GET", "/v2.1/os-quota-sets/project-a", caller=ADMIN, version="2.90").body["quota_set"]["cores"]

    response = call("PUT", "/v2.1/os-quota-sets/project-a", caller=ADMIN, body={"quota_set": {"cores": value}},
                    version="2.90")

    assert response.status == 400, response.body
    assert call("GET", "/v2.1/os-quota-sets/project-a", caller=ADMIN, version="2.90").body["quota_set"]["cores"] \
        == before
