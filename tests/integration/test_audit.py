"""``ferry audit`` on SQLite and PostgreSQL: a consistent store is clean; each planted inconsistency is
found, and the fixable ones are repaired by ``fix=True`` and stay repaired.

The consistent store: an ACTIVE server on cell1-host1 (allocation, ACTIVE port binding, volume
attached there), a server in VERIFY_RESIZE from cell1-host1 to cell1-host2 (as the resize workflow
leaves it), and host reports listing exactly their guests and instance directories.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid as uuidlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from verify_resize_helpers import (
    CELL,
    DEST,
    OLD,
    OLD_USAGE,
    OTHER,
    PROJECT,
    SOURCE,
    USER,
    Resized,
    make_resized,
    make_volume,
    mocked_aws,
    provider,
)

from ferry import audit, aws, config, hosts, images, network, placement, volumes
from ferry.compute import actions, migration_states, moves, states
from ferry.compute import api as compute_api
from ferry.store.api_models import (
    BuildRequest,
    CellMapping,
    InstanceMapping,
    Inventory,
    Port,
    PortBinding,
    ResourceProvider,
    Volume,
    VolumeAttachment,
    utcnow,
)
from ferry.store.cell_models import BlockDeviceMapping, Instance, InstanceActionEvent, Migration
from ferry.store.db import api_session, cell_session
from ferry.workflows.cross_cell import snapshot_image_id, target_db_setup

LONG_AGO = utcnow() - dt.timedelta(hours=1)


def report_view(host: str, guests: list[str], dirs: list[str], cell: str = CELL) -> None:
    """An inventory report from ``host`` listing its guests and instance directories, sent now."""
    hosts.apply_report({"kind": "inventory", "host": host, "node": host, "cell": cell,
                        "sent_at": dt.datetime.now(dt.UTC).isoformat(),
                        "inventory": {"VCPU": {"total": 8}, "MEMORY_MB": {"total": 8192}, "DISK_GB": {"total": 40}},
                        "guests": guests, "instance_dirs": dirs})


def check(**options: Any) -> audit.AuditReport:
    """The audit as tests run it: everything settled (no grace), nothing running, the same clock."""
    options.setdefault("grace_seconds", 0)
    options.setdefault("clock_skew_seconds", 0)
    options.setdefault("running_executions", set())
    return audit.run_audit(**options)


@dataclass
class Cloud:
    active: str
    port_id: str
    volume_id: str
    resized: Resized
    state_dir: Path

    def report_hosts(self) -> None:
        """Every host reports what the consistent store expects of it."""
        report_view(SOURCE, [self.active], [self.active, f"{self.resized.instance_uuid}_resize"])
        report_view(DEST, [self.resized.instance_uuid], [self.resized.instance_uuid])
        report_view(OTHER, [], [])


def make_active(state_dir: Path) -> tuple[str, str, str]:
    """An ACTIVE server on SOURCE with its allocation, an ACTIVE port binding and a volume attached there."""
    uuid = str(uuidlib.uuid4())
    placement.claim(uuid, PROJECT, USER, {provider(SOURCE): OLD_USAGE})
    volume_id = make_volume(state_dir)
    with cell_session(CELL) as session:
        session.add(Instance(uuid=uuid, display_name="active", project_id=PROJECT, user_id=USER, image_ref="img-1",
                             flavor=OLD, vm_state=states.ACTIVE, task_state=None, power_state=states.RUNNING,
                             host=SOURCE, node=SOURCE, launched_on=SOURCE))
        session.add(BlockDeviceMapping(instance_uuid=uuid, source_type="volume", destination_type="volume",
                                       device_name="vdb", volume_id=volume_id))
    with api_session() as session:
        cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == CELL)).one()
        session.add(InstanceMapping(instance_uuid=uuid, project_id=PROJECT, user_id=USER, cell_id=cell_id))
        port = Port(network_id="net-1", project_id=PROJECT, device_id=uuid, status="ACTIVE",
                    mac_address=f"fa:16:3e:{uuid[0:2]}:{uuid[2:4]}:{uuid[4:6]}", fixed_ip="10.0.0.9")
        port.bindings.append(PortBinding(host=SOURCE, status="ACTIVE", vif_details={"type": "ethernet"}))
        session.add(port)
        session.add(VolumeAttachment(volume_id=volume_id, instance_uuid=uuid, host=SOURCE, device="vdb",
                                     status="attached"))
        session.flush()
        return uuid, port.id, volume_id


@pytest.fixture
def cloud(store, monkeypatch, tmp_path) -> Iterator[Cloud]:
    with mocked_aws(monkeypatch):
        active, port_id, volume_id = make_active(tmp_path)
        resized = make_resized(volume=True, state_dir=tmp_path)
        made = Cloud(active, port_id, volume_id, resized, tmp_path)
        made.report_hosts()
        yield made


def cell_write(cell: str, stmt: Any) -> None:
    with cell_session(cell) as session:
        session.execute(stmt)


def add_copy(cell: str, uuid: str, **values: Any) -> None:
    """A copy of the instance ``uuid`` of cell1 in ``cell`` with ``values`` changed."""
    with cell_session(CELL) as session:
        row = session.scalars(select(Instance).where(Instance.uuid == uuid)).one()
        columns = {a.key: getattr(row, a.key) for a in Instance.__mapper__.column_attrs if a.key != "id"}
    with cell_session(cell) as session:
        session.add(Instance(**{**columns, **values}))


def add_migration(instance_uuid: str, status: str, *, cell: str = CELL, **values: Any) -> str:
    migration_uuid = str(uuidlib.uuid4())
    fields: dict[str, Any] = {"uuid": migration_uuid, "instance_uuid": instance_uuid, "source_compute": SOURCE,
                              "source_node": SOURCE, "dest_compute": OTHER, "dest_node": OTHER, "dest_host": OTHER,
                              "status": status, "migration_type": migration_states.MIGRATION, "user_id": USER,
                              "project_id": PROJECT, **values}
    with cell_session(cell) as session:
        session.add(Migration(**fields))
    return migration_uuid


def found(report: audit.AuditReport, kind: str) -> list[audit.Problem]:
    problems = report.of_kind(kind)
    assert problems, f"no {kind} in:\n{report.describe()}"
    return problems


def fix_with_race(monkeypatch: pytest.MonkeyPatch, race: Callable[[], None], **options: Any) -> audit.AuditReport:
    """``fix=True`` with ``race`` run between the audit's read and its repairs, as a workflow writing meanwhile
    would; one round only, so what the race wrote is not judged and repaired in turn."""
    apply_repairs = audit._apply_repairs

    def racing(problems: list[audit.Problem]) -> list[audit.Repair]:
        race()
        return apply_repairs(problems)

    monkeypatch.setattr(audit, "_apply_repairs", racing)
    return check(fix=True, max_fix_rounds=1, **options)


def refusal(report: audit.AuditReport, kind: str) -> str:
    """The reason the one repair of ``kind`` gave for refusing (it must have refused)."""
    (repair,) = [r for r in report.repairs if r.problem.kind == kind]
    assert repair.action is None and repair.error, report.describe()
    return repair.error


def begin_move(instance_uuid: str, dest: str) -> str:
    """What the API writes when a move of the server begins: its task and a ``pre-migrating`` migration to ``dest``."""
    cell_write(CELL, update(Instance).where(Instance.uuid == instance_uuid).values(task_state=states.RESIZE_PREP))
    return add_migration(instance_uuid, migration_states.PRE_MIGRATING, dest_compute=dest, dest_node=dest,
                         dest_host=dest)


def assert_fixed(kind: str) -> None:
    """``fix=True`` repairs the planted problem, says so, and the store is clean afterwards."""
    repaired = check(fix=True)
    assert [r.error for r in repaired.repairs if r.problem.kind == kind] == [None], repaired.describe()
    assert all(r.action for r in repaired.repairs)
    assert repaired.clean, repaired.describe()
    assert check().clean


# --- the baseline ---------------------------------------------------------------------------------


def test_a_consistent_store_is_clean(cloud):
    report = check()

    assert report.clean, report.describe()
    assert report.to_dict()["clean"] is True
    assert report.skipped == []


def test_a_clean_store_stays_clean_under_fix(cloud):
    report = check(fix=True)

    assert report.clean and report.repairs == [], report.describe()


def test_fresh_records_are_left_to_the_next_run(cloud):
    placement.claim(str(uuidlib.uuid4()), PROJECT, USER, {provider(OTHER): OLD_USAGE})

    assert check(grace_seconds=600).clean
    assert check().kinds() == [audit.ALLOCATION_ORPHAN]


# --- instances and their copies -------------------------------------------------------------------


def test_a_server_without_a_visible_copy_in_its_mapped_cell_is_found(cloud):
    cell_write(CELL, update(Instance).where(Instance.uuid == cloud.active).values(hidden=True))

    report = check()

    (problem,) = found(report, audit.INSTANCE_NOT_VISIBLE)
    assert problem.resource == f"instance/{cloud.active}" and not problem.fixable
    assert set(report.kinds()) == {audit.INSTANCE_NOT_VISIBLE}
    assert check(fix=True).kinds() == [audit.INSTANCE_NOT_VISIBLE]


def test_a_second_visible_copy_in_another_cell_is_found(cloud):
    add_copy("cell2", cloud.active)

    report = check()

    (problem,) = found(report, audit.INSTANCE_MAPPING_MISMATCH)
    assert problem.resource == f"instance/{cloud.active}@cell2" and not problem.fixable
    assert report.kinds() == [audit.INSTANCE_MAPPING_MISMATCH]


def test_a_visible_server_without_a_mapping_is_found(cloud):
    with api_session() as session:
        session.execute(InstanceMapping.__table__.delete().where(InstanceMapping.instance_uuid == cloud.active))

    report = check()

    assert report.kinds() == [audit.INSTANCE_UNMAPPED]
    assert not report.problems[0].fixable


def test_a_stale_hidden_copy_is_found_and_hard_deleted(cloud):
    add_copy("cell2", cloud.active, hidden=True)
    add_migration(cloud.active, migration_states.CONFIRMED, cell="cell2", cross_cell_move=True)

    report = check()

    (problem,) = found(report, audit.HIDDEN_COPY_STALE)
    assert problem.fixable and problem.resource == f"instance/{cloud.active}@cell2"
    assert report.kinds() == [audit.HIDDEN_COPY_STALE]
    assert_fixed(audit.HIDDEN_COPY_STALE)
    with cell_session("cell2") as session:
        assert session.scalars(select(Instance).where(Instance.uuid == cloud.active)).first() is None
        assert session.scalars(select(Migration).where(Migration.instance_uuid == cloud.active)).first() is None
    with cell_session(CELL) as session:
        assert session.scalars(select(Instance).where(Instance.uuid == cloud.active)).one().hidden is False


def test_a_stale_hidden_copy_replaced_by_a_new_move_between_cells_is_left_to_that_move(cloud, monkeypatch):
    # GIVEN a hidden copy an earlier move between cells left in cell2, which the audit reads as stale
    add_copy("cell2", cloud.active, hidden=True)
    add_migration(cloud.active, migration_states.CONFIRMED, cell="cell2", cross_cell_move=True)
    moves: list[str] = []

    def new_move_into_cell2() -> None:
        # WHEN a new move into cell2 runs TargetDBSetup before the repair: it replaces the stale copy
        moves.append(begin_move(cloud.active, "cell2-host1"))
        target_db_setup({"instance_uuid": cloud.active, "migration_uuid": moves[0], "cell": CELL,
                         "destination": {"cell": "cell2"}})

    report = fix_with_race(monkeypatch, new_move_into_cell2)

    # THEN the repair refuses, and the move's copy and migration in cell2 are intact
    assert "meanwhile" in refusal(report, audit.HIDDEN_COPY_STALE)
    with cell_session("cell2") as session:
        assert session.scalars(select(Instance.hidden).where(Instance.uuid == cloud.active)).one() is True
        migration = session.scalars(select(Migration).where(Migration.uuid == moves[0])).one()
        assert migration.cross_cell_move and migration.status == migration_states.PRE_MIGRATING


def test_a_repair_the_database_aborts_fails_alone_and_the_audit_goes_on(cloud, monkeypatch):
    # GIVEN a stale hidden copy whose repair the database aborts (a deadlock with a workflow writing
    # the same rows)
    add_copy("cell2", cloud.active, hidden=True)
    add_migration(cloud.active, migration_states.CONFIRMED, cell="cell2", cross_cell_move=True)

    def deadlocked(*_args, **_kwargs):
        raise OperationalError("DELETE FROM instances", {}, Exception("deadlock detected"))

    monkeypatch.setattr(audit.instances, "purge", deadlocked)

    report = check(fix=True, max_fix_rounds=1)

    # THEN that repair is reported failed with the database's reason, and the audit returns its report
    assert "deadlock detected" in refusal(report, audit.HIDDEN_COPY_STALE)
    with cell_session("cell2") as session:
        assert session.scalars(select(Instance.hidden).where(Instance.uuid == cloud.active)).one() is True


def test_a_stale_hidden_copy_written_afresh_meanwhile_is_not_removed(cloud, monkeypatch):
    add_copy("cell2", cloud.active, hidden=True)

    def copy_written_afresh() -> None:
        with cell_session("cell2") as session:
            session.execute(Instance.__table__.delete().where(Instance.uuid == cloud.active))
        add_copy("cell2", cloud.active, hidden=True, updated_at=utcnow())

    report = fix_with_race(monkeypatch, copy_written_afresh)

    assert "replaced it" in refusal(report, audit.HIDDEN_COPY_STALE)
    with cell_session("cell2") as session:
        assert session.scalars(select(Instance.hidden).where(Instance.uuid == cloud.active)).one() is True


def test_a_hidden_copy_of_a_move_between_cells_under_way_is_not_stale(cloud):
    add_copy("cell2", cloud.active, hidden=True)
    add_migration(cloud.active, migration_states.FINISHED, cell="cell2", cross_cell_move=True)

    assert audit.HIDDEN_COPY_STALE not in check().kinds()


# --- placement ------------------------------------------------------------------------------------


def test_an_allocation_of_an_unknown_consumer_is_found_and_deleted(cloud):
    stray = str(uuidlib.uuid4())
    placement.claim(stray, PROJECT, USER, {provider(OTHER): OLD_USAGE})

    report = check()

    (problem,) = found(report, audit.ALLOCATION_ORPHAN)
    assert problem.resource == f"allocation/{stray}" and problem.fixable
    assert report.kinds() == [audit.ALLOCATION_ORPHAN]
    assert_fixed(audit.ALLOCATION_ORPHAN)
    assert placement.get_allocations(stray) == {}
    assert placement.get_allocations(cloud.active) == {provider(SOURCE): OLD_USAGE}


def test_an_allocation_of_a_deleted_server_is_found_and_deleted(cloud):
    with cell_session(CELL) as session:
        session.execute(update(Instance).where(Instance.uuid == cloud.active).values(
            deleted=True, deleted_at=utcnow(), vm_state=states.DELETED))
    with api_session() as session:
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == cloud.active)
                        .values(queued_for_delete=True))
        session.execute(VolumeAttachment.__table__.delete().where(VolumeAttachment.instance_uuid == cloud.active))
        session.execute(Port.__table__.delete().where(Port.device_id == cloud.active))
    report_view(SOURCE, [], [f"{cloud.resized.instance_uuid}_resize"])

    report = check()

    assert report.kinds() == [audit.ALLOCATION_ORPHAN], report.describe()
    assert_fixed(audit.ALLOCATION_ORPHAN)


def test_an_allocation_held_by_a_confirmed_migration_is_found_and_deleted(cloud):
    migration = add_migration(cloud.active, migration_states.CONFIRMED)
    placement.claim(migration, PROJECT, USER, {provider(OTHER): OLD_USAGE})

    assert check().kinds() == [audit.ALLOCATION_ORPHAN]
    assert_fixed(audit.ALLOCATION_ORPHAN)


def test_a_settled_server_without_an_allocation_is_found(cloud):
    placement.delete_allocations(cloud.active)

    report = check()

    (problem,) = found(report, audit.ALLOCATION_MISSING)
    assert problem.resource == f"allocation/{cloud.active}" and not problem.fixable
    assert report.kinds() == [audit.ALLOCATION_MISSING]


def test_a_resized_server_whose_migration_holds_nothing_is_found(cloud):
    placement.delete_allocations(cloud.resized.migration_uuid)

    report = check()

    assert report.kinds() == [audit.ALLOCATION_MISSING]
    assert report.problems[0].resource == f"allocation/{cloud.resized.migration_uuid}"


def test_an_allocation_that_does_not_match_the_flavor_is_found(cloud):
    placement.claim(cloud.active, PROJECT, USER, {provider(SOURCE): {**OLD_USAGE, "MEMORY_MB": 4096}})

    report = check()

    assert report.kinds() == [audit.ALLOCATION_MISMATCH]
    assert "4096" in report.problems[0].message and not report.problems[0].fixable


def test_an_allocation_on_another_host_than_the_server_is_found(cloud):
    placement.claim(cloud.active, PROJECT, USER, {provider(OTHER): OLD_USAGE})

    assert check().kinds() == [audit.ALLOCATION_MISMATCH]


def test_a_failed_migration_still_holding_its_allocation_is_found(cloud):
    uuid = cloud.resized.instance_uuid
    cell_write(CELL, update(Migration).where(Migration.uuid == cloud.resized.migration_uuid)
               .values(status=migration_states.ERROR))
    cell_write(CELL, update(Instance).where(Instance.uuid == uuid).values(
        vm_state=states.ACTIVE, old_flavor=None, new_flavor=None))

    report = check()

    assert report.kinds() == [audit.MIGRATION_ALLOCATION_HELD], report.describe()
    assert not report.problems[0].fixable


def test_a_provider_over_its_capacity_is_found(cloud):
    with api_session() as session:
        provider_id = session.scalars(select(ResourceProvider.id).where(ResourceProvider.host == SOURCE)).one()
        session.execute(update(Inventory).where(Inventory.resource_provider_id == provider_id,
                                                Inventory.resource_class == "MEMORY_MB").values(total=600))

    report = check()

    assert report.kinds() == [audit.PROVIDER_OVER_CAPACITY]
    assert report.problems[0].resource == f"provider/{SOURCE}"


def test_a_used_counter_that_drifted_from_the_allocations_is_found_and_recomputed(cloud):
    with api_session() as session:
        provider_id = session.scalars(select(ResourceProvider.id).where(ResourceProvider.host == OTHER)).one()
        session.execute(update(Inventory).where(Inventory.resource_provider_id == provider_id,
                                                Inventory.resource_class == "VCPU").values(used=3))

    report = check()

    (problem,) = found(report, audit.INVENTORY_USAGE_DRIFT)
    assert problem.resource == f"provider/{OTHER}/VCPU" and problem.fixable
    assert report.kinds() == [audit.INVENTORY_USAGE_DRIFT]
    assert_fixed(audit.INVENTORY_USAGE_DRIFT)
    with api_session() as session:
        assert session.scalars(select(Inventory.used).where(Inventory.resource_provider_id == provider_id,
                                                            Inventory.resource_class == "VCPU")).one() == 0


# --- hosts: guests and instance directories -------------------------------------------------------


def test_a_guest_without_a_server_is_found(cloud):
    stray = str(uuidlib.uuid4())
    report_view(OTHER, [stray], [])

    report = check()

    assert report.kinds() == [audit.GUEST_ORPHAN]
    assert report.problems[0].resource == f"host/{OTHER}/guest/{stray}" and not report.problems[0].fixable


def test_a_guest_of_a_server_that_lives_elsewhere_is_found(cloud):
    report_view(OTHER, [cloud.active], [])

    assert check().kinds() == [audit.GUEST_ORPHAN]


def test_a_server_whose_host_has_no_guest_for_it_is_found(cloud):
    report_view(DEST, [], [cloud.resized.instance_uuid])

    report = check()

    assert report.kinds() == [audit.GUEST_MISSING]
    assert report.problems[0].resource == f"instance/{cloud.resized.instance_uuid}"


def test_a_report_older_than_the_servers_last_change_is_not_trusted(cloud):
    report_view(DEST, [], [cloud.resized.instance_uuid])
    cell_write(CELL, update(Instance).where(Instance.uuid == cloud.resized.instance_uuid)
               .values(updated_at=utcnow() + dt.timedelta(seconds=1)))

    assert check().clean


def test_instance_directories_nothing_owns_are_found(cloud):
    stray = str(uuidlib.uuid4())
    report_view(OTHER, [], [stray, f"{cloud.active}_resize", "lost+found"])

    report = check()

    assert report.kinds() == [audit.INSTANCE_DIR_ORPHAN] * 2
    assert {p.resource for p in report.problems} == {f"host/{OTHER}/dir/{stray}",
                                                     f"host/{OTHER}/dir/{cloud.active}_resize"}
    assert not any(p.fixable for p in report.problems)


def test_a_resize_directory_left_after_the_move_was_confirmed_is_found(cloud):
    uuid = cloud.resized.instance_uuid
    placement.delete_allocations(cloud.resized.migration_uuid)
    cell_write(CELL, update(Migration).where(Migration.uuid == cloud.resized.migration_uuid)
               .values(status=migration_states.CONFIRMED))
    cell_write(CELL, update(Instance).where(Instance.uuid == uuid).values(vm_state=states.ACTIVE))
    with api_session() as session:
        session.execute(PortBinding.__table__.delete().where(PortBinding.host == SOURCE,
                                                             PortBinding.port_id == cloud.resized.port_id))
        session.execute(VolumeAttachment.__table__.delete().where(VolumeAttachment.instance_uuid == uuid,
                                                                  VolumeAttachment.host == SOURCE))
    report_view(SOURCE, [cloud.active], [cloud.active, f"{uuid}_resize"])

    report = check()

    assert report.kinds() == [audit.INSTANCE_DIR_ORPHAN], report.describe()
    assert report.problems[0].resource == f"host/{SOURCE}/dir/{uuid}_resize"


@pytest.mark.parametrize("status", [migration_states.MIGRATING, migration_states.FINISHED])
def test_disks_copied_in_for_a_move_are_owned_only_while_the_move_runs(cloud, status):
    uuid = cloud.resized.instance_uuid
    cell_write(CELL, update(Migration).where(Migration.uuid == cloud.resized.migration_uuid).values(status=status))
    report_view(DEST, [uuid], [uuid, f"{uuid}_incoming"])

    orphans = [p.resource for p in check().problems if p.kind == audit.INSTANCE_DIR_ORPHAN]

    assert orphans == ([] if status == migration_states.MIGRATING else [f"host/{DEST}/dir/{uuid}_incoming"])


# --- ports and volumes ----------------------------------------------------------------------------


def test_a_port_binding_on_a_host_the_server_is_not_on_is_found_and_deleted(cloud):
    with api_session() as session:
        session.add(PortBinding(port_id=cloud.port_id, host=OTHER, status="INACTIVE", vif_details={}))

    report = check()

    (problem,) = found(report, audit.PORT_BINDING_ORPHAN)
    assert problem.resource == f"port/{cloud.port_id}@{OTHER}" and problem.fixable
    assert report.kinds() == [audit.PORT_BINDING_ORPHAN]
    assert_fixed(audit.PORT_BINDING_ORPHAN)
    with api_session() as session:
        assert {b.host for b in session.get(Port, cloud.port_id).bindings} == {SOURCE}


def test_a_port_binding_a_move_to_its_host_reuses_is_not_deleted(cloud, monkeypatch):
    # GIVEN a binding left on OTHER, a host the settled server is not on
    with api_session() as session:
        session.add(PortBinding(port_id=cloud.port_id, host=OTHER, status="INACTIVE", vif_details={}))

    def move_to_other() -> None:
        # WHEN a move of the server to OTHER begins before the repair and keeps that binding as its own
        begin_move(cloud.active, OTHER)
        with api_session() as session:
            network.bind_inactive(session, cloud.active, OTHER)

    report = fix_with_race(monkeypatch, move_to_other)

    # THEN the repair refuses and the move keeps its binding
    assert "migration" in refusal(report, audit.PORT_BINDING_ORPHAN)
    with api_session() as session:
        assert {b.host for b in session.get(Port, cloud.port_id).bindings} == {SOURCE, OTHER}


def _port_bound_on_other(device_id: str | None) -> str:
    """A new port of ``device_id`` (None: no server) bound ACTIVE on OTHER; its id."""
    with api_session() as session:
        port = Port(network_id="net-1", project_id=PROJECT, device_id=device_id,
                    mac_address=f"fa:16:3e:00:00:{'01' if device_id is None else '02'}")
        port.bindings.append(PortBinding(host=OTHER, status="ACTIVE", vif_details={}))
        session.add(port)
        session.flush()
        return str(port.id)


def test_a_binding_of_a_port_a_server_took_meanwhile_is_not_deleted(cloud, monkeypatch):
    port_id = _port_bound_on_other(None)

    def server_takes_the_port() -> None:
        with api_session() as session:
            session.get(Port, port_id).device_id = cloud.active

    report = fix_with_race(monkeypatch, server_takes_the_port)

    assert "changed meanwhile" in refusal(report, audit.PORT_BINDING_ORPHAN)
    with api_session() as session:
        assert [b.host for b in session.get(Port, port_id).bindings] == [OTHER]


def test_a_binding_of_a_port_without_a_server_is_found_and_deleted(cloud):
    _port_bound_on_other(None)

    assert check().kinds() == [audit.PORT_BINDING_ORPHAN]
    assert_fixed(audit.PORT_BINDING_ORPHAN)


def test_a_port_still_bound_for_a_deleted_server_is_found_and_released(cloud):
    gone = str(uuidlib.uuid4())
    port_id = _port_bound_on_other(gone)

    assert check().kinds() == [audit.PORT_BINDING_ORPHAN]
    assert_fixed(audit.PORT_BINDING_ORPHAN)
    with api_session() as session:
        assert session.get(Port, port_id) is None


def test_a_settled_port_without_an_active_binding_on_the_servers_host_is_found(cloud):
    with api_session() as session:
        session.execute(update(PortBinding).where(PortBinding.port_id == cloud.port_id).values(status="INACTIVE"))

    report = check()

    assert report.kinds() == [audit.PORT_BINDING_MISSING]
    assert not report.problems[0].fixable


def test_a_volume_attachment_on_another_host_is_found_and_deleted(cloud):
    with api_session() as session:
        session.add(VolumeAttachment(volume_id=cloud.volume_id, instance_uuid=cloud.active, host=OTHER,
                                     device="vdb", status="reserved"))

    report = check()

    assert report.kinds() == [audit.VOLUME_ATTACHMENT_ORPHAN]
    assert_fixed(audit.VOLUME_ATTACHMENT_ORPHAN)


def test_a_volume_attachment_a_move_to_its_host_reuses_is_not_deleted(cloud, monkeypatch):
    # GIVEN an attachment left on OTHER, a host the settled server is not on
    with api_session() as session:
        session.add(VolumeAttachment(volume_id=cloud.volume_id, instance_uuid=cloud.active, host=OTHER,
                                     device="vdb", status="reserved"))
        status = session.get(Volume, cloud.volume_id).status

    def move_to_other() -> None:
        # WHEN a move of the server to OTHER begins before the repair and keeps that attachment as its own
        begin_move(cloud.active, OTHER)
        with api_session() as session:
            volumes.reserve_on(session, cloud.active, SOURCE, OTHER)

    report = fix_with_race(monkeypatch, move_to_other)

    # THEN the repair refuses: the volume stays held on the move's destination
    assert "migration" in refusal(report, audit.VOLUME_ATTACHMENT_ORPHAN)
    with api_session() as session:
        held = session.scalars(select(VolumeAttachment.host).where(VolumeAttachment.volume_id == cloud.volume_id))
        assert sorted(held) == sorted([SOURCE, OTHER])
        assert session.get(Volume, cloud.volume_id).status == status


def _orphan_attachment(cloud: Cloud, volume_status: str, attachment_status: str) -> str:
    """A new volume in ``volume_status`` attached (``attachment_status``) on OTHER to a server that
    does not exist; its id."""
    volume_id = make_volume(cloud.state_dir)
    with api_session() as session:
        session.get(Volume, volume_id).status = volume_status
        session.add(VolumeAttachment(volume_id=volume_id, instance_uuid=str(uuidlib.uuid4()), host=OTHER,
                                     device="vdc", status=attachment_status))
    return volume_id


def test_a_volume_attachment_that_changed_meanwhile_is_not_deleted(cloud, monkeypatch):
    volume_id = _orphan_attachment(cloud, "in-use", "reserved")

    def attachment_completed() -> None:
        with api_session() as session:
            session.execute(update(VolumeAttachment).where(VolumeAttachment.volume_id == volume_id)
                            .values(status="attached"))

    report = fix_with_race(monkeypatch, attachment_completed)

    assert "changed meanwhile" in refusal(report, audit.VOLUME_ATTACHMENT_ORPHAN)
    with api_session() as session:
        assert session.scalars(select(VolumeAttachment.status).where(
            VolumeAttachment.volume_id == volume_id)).one() == "attached"
        assert session.get(Volume, volume_id).status == "in-use"


def test_an_orphan_attachment_of_a_volume_being_deleted_does_not_make_it_available(cloud):
    volume_id = _orphan_attachment(cloud, "deleting", "attached")

    report = check(fix=True)

    assert [r.error for r in report.repairs if r.problem.kind == audit.VOLUME_ATTACHMENT_ORPHAN] == [None]
    with api_session() as session:
        assert session.get(Volume, volume_id).status == "deleting"
        assert session.scalars(select(VolumeAttachment).where(VolumeAttachment.volume_id == volume_id)).all() == []


def test_a_volume_whose_status_changed_meanwhile_is_not_made_available(cloud, monkeypatch):
    volume_id = _orphan_attachment(cloud, "in-use", "attached")

    def volume_being_deleted() -> None:
        with api_session() as session:
            session.get(Volume, volume_id).status = "deleting"

    report = fix_with_race(monkeypatch, volume_being_deleted)

    assert [r.error for r in report.repairs if r.problem.kind == audit.VOLUME_ATTACHMENT_ORPHAN] == [None]
    with api_session() as session:
        assert session.get(Volume, volume_id).status == "deleting"


def test_a_volume_left_deleting_after_its_server_is_reported_for_a_person(cloud):
    volume_id = make_volume(cloud.state_dir)
    with api_session() as session:
        session.get(Volume, volume_id).status = "deleting"

    report = check()

    assert report.kinds() == [audit.VOLUME_LEFT_DELETING]
    [problem] = report.problems
    assert problem.resource == f"volume/{volume_id}" and not problem.fixable
    assert str(cloud.state_dir / "volumes" / volume_id) in problem.message
    assert check(fix=True).kinds() == [audit.VOLUME_LEFT_DELETING]  # nothing the audit may remove


def test_a_volume_attachment_of_a_deleted_server_is_found_and_the_volume_freed(cloud):
    volume_id = _orphan_attachment(cloud, "in-use", "attached")

    assert check().kinds() == [audit.VOLUME_ATTACHMENT_ORPHAN]
    assert_fixed(audit.VOLUME_ATTACHMENT_ORPHAN)
    with api_session() as session:
        assert session.get(Volume, volume_id).status == "available"


# --- volumes an attach or detach left behind --------------------------------------------------------


def _attach_left(cloud: Cloud) -> str:
    """What an attach to the ACTIVE server leaves when its undo stopped after the server's part: the
    volume ``attaching`` with a ``reserved`` attachment on the server's host, no mapping, no task."""
    volume_id = make_volume(cloud.state_dir)
    with api_session() as session:
        session.get(Volume, volume_id).status = "attaching"
        session.add(VolumeAttachment(volume_id=volume_id, instance_uuid=cloud.active, host=SOURCE, device="vdc",
                                     status="reserved"))
    return volume_id


def _detach_left(cloud: Cloud) -> str:
    """What a detach from the ACTIVE server leaves when its undo stopped after the server's part: its
    attached, mapped volume ``detaching``, no task."""
    with api_session() as session:
        session.get(Volume, cloud.volume_id).status = "detaching"
    return cloud.volume_id


def volume_status(volume_id: str) -> str:
    with api_session() as session:
        return session.get(Volume, volume_id).status


def test_an_attach_left_half_undone_is_found_and_its_volume_freed(cloud):
    volume_id = _attach_left(cloud)

    report = check()

    [problem] = report.problems
    assert problem.kind == audit.VOLUME_OPERATION_LEFT and problem.resource == f"volume/{volume_id}"
    assert problem.fixable and cloud.active in problem.message and "attaching" in problem.message
    assert_fixed(audit.VOLUME_OPERATION_LEFT)
    assert volume_status(volume_id) == "available"
    with api_session() as session:
        assert session.scalars(select(VolumeAttachment).where(VolumeAttachment.volume_id == volume_id)).all() == []


def test_a_detach_left_half_undone_is_found_and_its_volume_in_use_again(cloud):
    volume_id = _detach_left(cloud)

    assert check().kinds() == [audit.VOLUME_OPERATION_LEFT]
    assert_fixed(audit.VOLUME_OPERATION_LEFT)
    assert volume_status(volume_id) == "in-use"
    with api_session() as session:  # still attached where the server is
        assert session.scalars(select(VolumeAttachment.host).where(
            VolumeAttachment.volume_id == volume_id)).all() == [SOURCE]


@pytest.mark.parametrize("status", ["attaching", "detaching"])
def test_a_volume_left_attaching_or_detaching_that_nothing_holds_is_made_available(cloud, status):
    volume_id = make_volume(cloud.state_dir)
    with api_session() as session:
        session.get(Volume, volume_id).status = status

    assert check().kinds() == [audit.VOLUME_OPERATION_LEFT]
    assert_fixed(audit.VOLUME_OPERATION_LEFT)
    assert volume_status(volume_id) == "available"


def test_an_attaching_volume_no_attachment_holds_but_a_server_maps_is_not_freed(cloud):
    # GIVEN an attach that died between the server's records (mapping, task) and the volume's
    # attachment, whose server's task was then reset
    volume_id = make_volume(cloud.state_dir)
    with api_session() as session:
        session.get(Volume, volume_id).status = "attaching"
    with cell_session(CELL) as session:
        session.add(BlockDeviceMapping(instance_uuid=cloud.active, source_type="volume", destination_type="volume",
                                       device_name="vdc", volume_id=volume_id))

    report = check(fix=True)

    [problem] = report.of_kind(audit.VOLUME_OPERATION_LEFT)
    assert not problem.fixable and cloud.active in problem.message
    assert volume_status(volume_id) == "attaching"


@pytest.mark.parametrize("left", [_attach_left, _detach_left])
def test_a_volume_whose_server_has_its_task_or_a_running_workflow_is_not_judged(cloud, left):
    left(cloud)
    assert check(running_executions={f"attach-{cloud.active}-0123"}).clean
    cell_write(CELL, update(Instance).where(Instance.uuid == cloud.active).values(task_state="attaching_volume"))
    assert audit.VOLUME_OPERATION_LEFT not in check().kinds()


def test_a_volume_left_attaching_is_reported_not_freed_when_the_workflows_cannot_be_listed(cloud):
    volume_id = _attach_left(cloud)

    report = check(fix=True, running_executions=None)

    [problem] = report.of_kind(audit.VOLUME_OPERATION_LEFT)
    assert not problem.fixable and "could not be listed" in problem.message
    assert volume_status(volume_id) == "attaching"


def test_an_attaching_volume_its_server_maps_is_reported_for_a_person(cloud):
    volume_id = _attach_left(cloud)
    with cell_session(CELL) as session:
        session.add(BlockDeviceMapping(instance_uuid=cloud.active, source_type="volume", destination_type="volume",
                                       device_name="vdc", volume_id=volume_id))

    report = check(fix=True)

    [problem] = report.of_kind(audit.VOLUME_OPERATION_LEFT)
    assert not problem.fixable and "disagree" in problem.message
    assert volume_status(volume_id) == "attaching"


@pytest.mark.parametrize("left", [_attach_left, _detach_left])
def test_a_volume_whose_server_took_a_task_meanwhile_is_left_as_it_is(cloud, monkeypatch, left):
    volume_id = left(cloud)
    before = volume_status(volume_id)

    report = fix_with_race(monkeypatch, lambda: cell_write(
        CELL, update(Instance).where(Instance.uuid == cloud.active).values(task_state="resize_prep")))

    assert "has a task now" in refusal(report, audit.VOLUME_OPERATION_LEFT)
    assert volume_status(volume_id) == before
    with api_session() as session:
        assert session.scalars(select(VolumeAttachment).where(VolumeAttachment.volume_id == volume_id)).all()


def test_a_volume_whose_status_moved_on_meanwhile_is_left_as_it_is(cloud, monkeypatch):
    volume_id = _detach_left(cloud)

    def detach_finished() -> None:
        with api_session() as session:
            session.get(Volume, volume_id).status = "available"

    report = fix_with_race(monkeypatch, detach_finished)

    assert "changed meanwhile" in refusal(report, audit.VOLUME_OPERATION_LEFT)
    assert volume_status(volume_id) == "available"


# --- volumes a boot reserved, or a failed detach left -----------------------------------------------


def _root_volume(cloud: Cloud, server: str, *, made_from_image: bool, attached: bool = True,
                 changed_at: dt.datetime | None = None) -> str:
    """A ``reserved`` root volume as a boot of ``server`` leaves it (made from an image for it, or an existing
    one), with the boot's ``reserved`` attachment (on no host yet) unless not ``attached``, last written
    ``changed_at`` (now, by default); its id."""
    volume_id = make_volume(cloud.state_dir)
    with api_session() as session:
        volume = session.get(Volume, volume_id)
        volume.status = "reserved"
        if made_from_image:
            volume.name, volume.image_id = f"{server}-root", "img-1"
        if changed_at is not None:
            volume.created_at = volume.updated_at = changed_at
        if attached:
            session.add(VolumeAttachment(volume_id=volume_id, instance_uuid=server, status="reserved"))
    return volume_id


def volume_row(volume_id: str) -> Volume | None:
    with api_session() as session:
        return session.get(Volume, volume_id)


def test_an_existing_root_volume_of_a_deleted_boot_is_made_available_with_its_attachment_gone(cloud):
    # GIVEN an existing volume a boot reserved as its root, whose server is gone but its attachment stayed
    volume_id = _root_volume(cloud, str(uuidlib.uuid4()), made_from_image=False)

    # WHEN the audit repairs the orphan attachment
    assert check().kinds() == [audit.VOLUME_ATTACHMENT_ORPHAN]
    assert_fixed(audit.VOLUME_ATTACHMENT_ORPHAN)

    # THEN the volume is available again, for a boot or an attach, and an operator may forget it
    assert volume_status(volume_id) == "available"
    with api_session() as session:
        assert volumes.forget(session, volume_id)["status"] == "available"


def test_a_root_volume_made_for_a_deleted_server_that_never_reached_a_host_is_deleted(cloud):
    # GIVEN the root volume a boot made from an image for a server that was deleted before any host took
    # it (never written), still reserved by the server's attachment
    server = str(uuidlib.uuid4())
    volume_id = _root_volume(cloud, server, made_from_image=True)

    # WHEN the audit repairs the orphan attachment
    assert_fixed(audit.VOLUME_ATTACHMENT_ORPHAN)

    # THEN the volume goes with it, as a discarded boot's does
    assert volume_row(volume_id) is None


def test_a_root_volume_made_for_a_deleted_server_that_reached_a_host_is_left_deleting_for_a_person(cloud):
    # GIVEN the root volume a boot made from an image for a server that had a host, deleted since
    server = str(uuidlib.uuid4())
    with cell_session(CELL) as session:
        session.add(Instance(uuid=server, display_name="gone", project_id=PROJECT, user_id=USER, flavor=OLD,
                             vm_state=states.DELETED, power_state=states.NOSTATE, host=OTHER, node=OTHER,
                             deleted=True, deleted_at=LONG_AGO))
    volume_id = _root_volume(cloud, server, made_from_image=True)

    # WHEN the audit repairs the orphan attachment
    report = check(fix=True)

    # THEN the volume is deleting, as a delete leaves one whose file may remain, and reported for a person
    assert [r.error for r in report.repairs if r.problem.kind == audit.VOLUME_ATTACHMENT_ORPHAN] == [None]
    assert volume_status(volume_id) == "deleting"
    assert report.kinds() == [audit.VOLUME_LEFT_DELETING]


def test_a_reserved_volume_nothing_holds_is_reported_and_released_but_not_one_a_boot_owns(cloud):
    # GIVEN reserved volumes no attachment holds: one nothing else names either (an earlier repair left
    # it), one a build request names (its boot not handed to a cell yet), one reserved just now
    left = _root_volume(cloud, str(uuidlib.uuid4()), made_from_image=False, attached=False, changed_at=LONG_AGO)
    booting = str(uuidlib.uuid4())
    owned = _root_volume(cloud, booting, made_from_image=False, attached=False, changed_at=LONG_AGO)
    with api_session() as session:
        session.add(BuildRequest(instance_uuid=booting, project_id=PROJECT, instance={"display_name": "booting"},
                                 block_device_mappings=[{"boot_index": 0, "volume_id": owned}]))
        session.add(InstanceMapping(instance_uuid=booting, project_id=PROJECT, user_id=USER, cell_id=None))
    fresh = _root_volume(cloud, str(uuidlib.uuid4()), made_from_image=False, attached=False)
    running = {f"boot-{booting}"}

    # WHEN the audit runs, THEN only the one nothing holds is reported, as fixable
    [problem] = check(grace_seconds=60, running_executions=running).of_kind(audit.VOLUME_OPERATION_LEFT)
    assert problem.resource == f"volume/{left}" and problem.fixable and "reserved" in problem.message

    # WHEN it repairs, THEN that one is available and the others are left reserved
    check(fix=True, grace_seconds=60, running_executions=running)
    assert [volume_status(v) for v in (left, owned, fresh)] == ["available", "reserved", "reserved"]


def test_a_reserved_volume_made_for_a_server_that_never_reached_a_host_and_held_by_nothing_is_deleted(cloud):
    # GIVEN the root volume made from an image for a server that is gone, its attachment gone too
    volume_id = _root_volume(cloud, str(uuidlib.uuid4()), made_from_image=True, attached=False)

    # WHEN the audit repairs, THEN the volume goes (nothing ever wrote it) and the store is clean
    assert check().kinds() == [audit.VOLUME_OPERATION_LEFT]
    assert_fixed(audit.VOLUME_OPERATION_LEFT)
    assert volume_row(volume_id) is None


def test_a_reserved_volume_a_server_still_maps_is_reported_not_released(cloud):
    # GIVEN a reserved volume no attachment holds, which a live server's block device mapping names
    volume_id = _root_volume(cloud, cloud.active, made_from_image=False, attached=False)
    with cell_session(CELL) as session:
        session.add(BlockDeviceMapping(instance_uuid=cloud.active, source_type="volume", destination_type="volume",
                                       device_name="vdc", volume_id=volume_id))

    # WHEN the audit repairs, THEN it is reported for a person and stays reserved
    [problem] = check(fix=True).of_kind(audit.VOLUME_OPERATION_LEFT)
    assert not problem.fixable and cloud.active in problem.message
    assert volume_status(volume_id) == "reserved"


def test_a_volume_left_error_detaching_is_found_and_put_back_in_use_for_a_detach_again(cloud):
    # GIVEN a detach that failed after the host detached the volume, its records not updated: the volume
    # error_detaching, still held and mapped by its server, which has no task
    with api_session() as session:
        session.get(Volume, cloud.volume_id).status = "error_detaching"

    # WHEN the audit runs, THEN it reports it, fixable
    [problem] = check().problems
    assert (problem.kind, problem.resource) == (audit.VOLUME_OPERATION_LEFT, f"volume/{cloud.volume_id}")
    assert problem.fixable and "error_detaching" in problem.message and cloud.active in problem.message

    # WHEN it repairs, THEN the volume is in-use again, still attached where its server is
    assert_fixed(audit.VOLUME_OPERATION_LEFT)
    assert volume_status(cloud.volume_id) == "in-use"
    with api_session() as session:
        assert session.scalars(select(VolumeAttachment.host).where(
            VolumeAttachment.volume_id == cloud.volume_id)).all() == [SOURCE]


def test_a_volume_left_error_detaching_is_only_reported_when_the_workflows_cannot_be_listed(cloud):
    # GIVEN a volume left error_detaching by a failed detach
    with api_session() as session:
        session.get(Volume, cloud.volume_id).status = "error_detaching"

    # WHEN the audit repairs without a view of the running workflows
    report = check(fix=True, running_executions=None)

    # THEN it is reported, not repaired
    [problem] = report.of_kind(audit.VOLUME_OPERATION_LEFT)
    assert not problem.fixable and "could not be listed" in problem.message
    assert volume_status(cloud.volume_id) == "error_detaching"


# --- a boot that never reached a cell ---------------------------------------------------------------


def test_a_build_request_no_boot_workflow_runs_for_is_reported_with_its_claim(cloud, monkeypatch):
    # GIVEN a boot whose workflow ended after it claimed a host, before it handed the server to a cell
    uuid = str(uuidlib.uuid4())
    placement.claim(uuid, PROJECT, USER, {provider(OTHER): OLD_USAGE})
    with api_session() as session:
        session.add(BuildRequest(instance_uuid=uuid, project_id=PROJECT, instance={"display_name": "stuck"}))
        session.add(InstanceMapping(instance_uuid=uuid, project_id=PROJECT, user_id=USER, cell_id=None))

    # THEN the audit reports it (not while its boot runs), naming the host it holds a claim on
    assert check(running_executions={f"boot-{uuid}"}).clean
    [problem] = check(fix=True).problems
    assert (problem.kind, problem.resource, problem.fixable) == (audit.BUILD_REQUEST_STUCK, f"instance/{uuid}", False)
    assert OTHER in problem.message

    # (not when the boot's executions cannot be listed: its state machine not configured)
    monkeypatch.setattr(audit, "_running_executions", lambda skipped: set())
    monkeypatch.setenv("FERRY_BOOT_STATE_MACHINE_ARN", "")
    config.reset()
    assert audit.BUILD_REQUEST_STUCK not in check(running_executions=None).kinds()

    # and once the server is deleted (as the API deletes a build request), --fix releases the claim
    assert compute_api._discard_build(uuid, forget=False)
    assert check().kinds() == [audit.ALLOCATION_ORPHAN]
    assert_fixed(audit.ALLOCATION_ORPHAN)


# --- the image bucket -----------------------------------------------------------------------------


def test_a_temporary_snapshot_left_by_a_failed_move_between_cells_is_found_and_deleted(cloud):
    migration = add_migration(cloud.active, migration_states.ERROR, cross_cell_move=True)
    image_id = snapshot_image_id(migration)
    images.upload_image(BytesIO(b"disk"), "active-resize-temp", image_id=image_id)

    report = check()

    (problem,) = found(report, audit.SNAPSHOT_IMAGE_ORPHAN)
    assert problem.resource == f"image/{image_id}" and problem.fixable
    assert report.kinds() == [audit.SNAPSHOT_IMAGE_ORPHAN]
    assert_fixed(audit.SNAPSHOT_IMAGE_ORPHAN)
    assert images.list_images() == []


def test_the_snapshot_of_a_move_under_way_is_not_an_orphan(cloud):
    migration = add_migration(cloud.active, migration_states.POST_MIGRATING, cross_cell_move=True)
    cell_write(CELL, update(Instance).where(Instance.uuid == cloud.active)
               .values(task_state=states.RESIZE_MIGRATED))
    images.upload_image(BytesIO(b"disk"), "active-resize-temp", image_id=snapshot_image_id(migration))

    assert check(running_executions={f"resize-{cloud.active}-{migration[:8]}"}).clean


def test_an_image_named_like_a_snapshot_that_no_move_made_is_reported_not_deleted(cloud):
    image = images.upload_image(BytesIO(b"disk"), "someone-resize-temp")

    report = check(fix=True)

    assert report.kinds() == [audit.SNAPSHOT_IMAGE_ORPHAN] and report.repairs == []
    assert images.get_image(image["id"])


def put_extents(image_id: str) -> str:
    """Extents of a sparse snapshot under ``image-data/<image_id>/``, without the image object; returns that folder."""
    s3, folder = aws.client("s3"), f"{images.data_prefix(image_id)}/"
    for name in ("disk", "disk.manifest.json"):
        s3.put_object(Bucket=config.get().image_bucket, Key=f"{folder}{name}", Body=b"x")
    return folder


def objects_under(prefix: str) -> int:
    return aws.client("s3").list_objects_v2(Bucket=config.get().image_bucket, Prefix=prefix).get("KeyCount", 0)


def test_snapshot_extents_a_failed_delete_left_without_their_image_object_are_found_and_deleted(cloud):
    # GIVEN a failed move between cells whose snapshot lost its image object but not its extents
    migration = add_migration(cloud.active, migration_states.ERROR, cross_cell_move=True)
    folder = put_extents(snapshot_image_id(migration))

    # WHEN the audit checks the bucket
    report = check()

    # THEN it reports the extents, and --fix deletes them
    (problem,) = found(report, audit.SNAPSHOT_DATA_ORPHAN)
    assert problem.resource == f"s3://{config.get().image_bucket}/{folder}" and problem.fixable
    assert report.kinds() == [audit.SNAPSHOT_DATA_ORPHAN]
    assert_fixed(audit.SNAPSHOT_DATA_ORPHAN)
    assert objects_under(images.DATA_PREFIX) == 0


def test_the_extents_of_a_snapshot_being_uploaded_are_not_orphans(cloud):
    # GIVEN a move between cells whose source is still uploading its snapshot (no image object yet)
    migration = add_migration(cloud.active, migration_states.MIGRATING, cross_cell_move=True)
    cell_write(CELL, update(Instance).where(Instance.uuid == cloud.active)
               .values(task_state=states.RESIZE_MIGRATING))
    put_extents(snapshot_image_id(migration))

    # THEN the audit leaves them alone
    assert check(running_executions={f"resize-{cloud.active}-{migration[:8]}"}).clean


def test_the_extents_of_an_image_are_judged_with_the_image(cloud):
    # GIVEN a failed move's snapshot with its image object and its extents
    migration = add_migration(cloud.active, migration_states.ERROR, cross_cell_move=True)
    image_id = snapshot_image_id(migration)
    folder = put_extents(image_id)
    images.upload_image(BytesIO(b"pointer"), "active-resize-temp", image_id=image_id)

    # THEN the image is the one problem, and deleting it takes the extents too
    assert check().kinds() == [audit.SNAPSHOT_IMAGE_ORPHAN]
    assert_fixed(audit.SNAPSHOT_IMAGE_ORPHAN)
    assert objects_under(folder) == 0


def test_extents_that_no_move_made_are_reported_not_deleted(cloud):
    folder = put_extents(str(uuidlib.uuid4()))

    report = check(fix=True)

    assert report.kinds() == [audit.SNAPSHOT_DATA_ORPHAN] and report.repairs == []
    assert objects_under(folder) == 2


def test_snapshot_extents_whose_image_object_was_written_meanwhile_are_not_deleted(cloud, monkeypatch):
    # GIVEN a failed move's snapshot extents without their image object
    migration = add_migration(cloud.active, migration_states.ERROR, cross_cell_move=True)
    image_id = snapshot_image_id(migration)
    folder = put_extents(image_id)

    # WHEN a late upload writes the image object between the audit's read and its repair
    report = fix_with_race(monkeypatch, lambda: images.upload_image(BytesIO(b"pointer"), "active-resize-temp",
                                                                    image_id=image_id))

    # THEN the repair refuses, and the extents stay with their image
    assert "image object" in refusal(report, audit.SNAPSHOT_DATA_ORPHAN)
    assert objects_under(folder) == 2


def snapshot_data_repair(report: audit.AuditReport) -> str:
    """What the one repair of snapshot extents did (it must have succeeded)."""
    (repair,) = [r for r in report.repairs if r.problem.kind == audit.SNAPSHOT_DATA_ORPHAN]
    assert repair.action and repair.error is None, report.describe()
    return repair.action


def test_snapshot_extents_deleted_meanwhile_are_not_deleted_again(cloud, monkeypatch):
    # GIVEN a failed move's snapshot extents without their image object
    migration = add_migration(cloud.active, migration_states.ERROR, cross_cell_move=True)
    image_id = snapshot_image_id(migration)
    folder = put_extents(image_id)

    # WHEN a deletion of them finishes between the audit's read and its repair
    s3, bucket = aws.client("s3"), config.get().image_bucket
    report = fix_with_race(monkeypatch, lambda: s3.delete_objects(Bucket=bucket, Delete={"Objects": [
        {"Key": f"{folder}disk"}, {"Key": f"{folder}disk.manifest.json"}]}))

    # THEN the repair says nothing was left, not that it deleted them
    assert snapshot_data_repair(report) == f"nothing was left to delete: no extent object of image {image_id} remains"
    assert objects_under(folder) == 0


def test_the_repair_of_snapshot_extents_counts_only_those_still_there(cloud, monkeypatch):
    # GIVEN a failed move's two snapshot extent objects without their image object
    migration = add_migration(cloud.active, migration_states.ERROR, cross_cell_move=True)
    image_id = snapshot_image_id(migration)
    folder = put_extents(image_id)

    # WHEN one of them is deleted between the audit's read and its repair
    s3, bucket = aws.client("s3"), config.get().image_bucket
    report = fix_with_race(monkeypatch, lambda: s3.delete_object(Bucket=bucket, Key=f"{folder}disk"))

    # THEN the repair deletes and counts the other only
    assert snapshot_data_repair(report) == f"deleted 1 extent object(s) of image {image_id}"
    assert objects_under(folder) == 0


def test_disk_transfer_objects_of_a_finished_move_are_found_and_deleted(cloud):
    s3, bucket = aws.client("s3"), config.get().image_bucket
    prefix = f"{images.TRANSFER_PREFIX}{cloud.resized.migration_uuid}"
    for kind in ("root", "root.manifest.json"):
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{kind}", Body=b"x")

    report = check()

    (problem,) = found(report, audit.TRANSFER_ORPHAN)
    assert problem.resource == f"s3://{bucket}/{prefix}/" and problem.fixable
    assert report.kinds() == [audit.TRANSFER_ORPHAN]
    assert_fixed(audit.TRANSFER_ORPHAN)
    assert s3.list_objects_v2(Bucket=bucket, Prefix=images.TRANSFER_PREFIX).get("KeyCount") == 0


# --- migrations -----------------------------------------------------------------------------------


def test_a_finished_migration_of_a_server_not_in_verify_resize_is_found_and_put_in_error(cloud):
    migration = add_migration(cloud.active, migration_states.FINISHED)

    report = check()

    (problem,) = found(report, audit.MIGRATION_STATE_MISMATCH)
    assert problem.resource == f"migration/{migration}" and problem.fixable
    assert report.kinds() == [audit.MIGRATION_STATE_MISMATCH]
    assert_fixed(audit.MIGRATION_STATE_MISMATCH)
    with cell_session(CELL) as session:
        status = session.scalars(select(Migration.status).where(Migration.uuid == migration)).one()
        assert status == migration_states.ERROR


def test_the_finished_migration_of_a_resized_server_whose_copy_is_hidden_is_reported_not_put_in_error(cloud):
    # GIVEN a server in VERIFY_RESIZE whose copy in its mapped cell is hidden
    uuid, migration = cloud.resized.instance_uuid, cloud.resized.migration_uuid
    cell_write(CELL, update(Instance).where(Instance.uuid == uuid).values(hidden=True))

    # WHEN the audit repairs
    report = check(fix=True)

    # THEN the migration is reported, not as a gone server's, and left finished
    found(report, audit.INSTANCE_NOT_VISIBLE)
    (problem,) = found(report, audit.MIGRATION_STATE_MISMATCH)
    assert not problem.fixable and "is gone" not in problem.message and "no visible copy" in problem.message
    with cell_session(CELL) as session:
        assert session.scalars(select(Migration.status).where(Migration.uuid == migration)).one() == "finished"

    # WHEN the operator makes the copy visible again, THEN the server waits in VERIFY_RESIZE as before
    cell_write(CELL, update(Instance).where(Instance.uuid == uuid).values(hidden=False))
    assert check().clean


def _events(uuid: str, request_id: str) -> dict[str, tuple[str | None, str | None]]:
    """The action's events: name -> (result, details)."""
    with cell_session(CELL) as session:
        action = actions.find(session, uuid, request_id)
        assert action is not None
        return {e: (r, d) for e, r, d in session.execute(
            select(InstanceActionEvent.event, InstanceActionEvent.result, InstanceActionEvent.details)
            .where(InstanceActionEvent.action_id == action.id))}


@pytest.mark.parametrize(("migration_type", "action"), [(migration_states.MIGRATION, actions.MIGRATE),
                                                        (migration_states.RESIZE, actions.RESIZE)])
def test_a_migration_stuck_without_a_workflow_is_put_in_error_with_its_moves_open_events(cloud, migration_type,
                                                                                          action):
    # GIVEN a move whose workflow ended (stopped by hand, say) after its prep and during its resize
    # step, long ago: the migration migrating, the step's event open; and a stop never ended before
    uuid = cloud.active
    older, request_id = f"req-{uuidlib.uuid4()}", f"req-{uuidlib.uuid4()}"
    with cell_session(CELL) as session:
        actions.start_action(session, instance_uuid=uuid, action=actions.STOP, request_id=older,
                             user_id=USER, project_id=PROJECT)
        actions.start_event(session, instance_uuid=uuid, request_id=older, event="compute_stop_instance")
        actions.start_action(session, instance_uuid=uuid, action=action, request_id=request_id,
                             user_id=USER, project_id=PROJECT)
        actions.start_event(session, instance_uuid=uuid, request_id=request_id, event="compute_prep_resize")
        actions.finish_event(session, instance_uuid=uuid, request_id=request_id, event="compute_prep_resize")
        actions.start_event(session, instance_uuid=uuid, request_id=request_id, event="compute_resize_instance",
                            host=SOURCE)
    migration = add_migration(uuid, migration_states.MIGRATING, created_at=LONG_AGO, migration_type=migration_type)

    report = check()

    (problem,) = found(report, audit.MIGRATION_STUCK)
    assert problem.resource == f"migration/{migration}" and problem.fixable
    assert report.kinds() == [audit.MIGRATION_STUCK]
    (repair,) = check(fix=True).repairs
    assert repair.error is None and repair.action is not None and "compute_resize_instance" in repair.action
    assert check().clean

    # THEN the migration is in error, and the move's open event ended Error saying why; its ended
    # event and the other action's are as they were
    with cell_session(CELL) as session:
        status = session.scalars(select(Migration.status).where(Migration.uuid == migration)).one()
        assert status == migration_states.ERROR
    events = _events(uuid, request_id)
    assert events["compute_prep_resize"] == ("Success", None)
    result, details = events["compute_resize_instance"]
    assert result == "Error" and details is not None
    assert details.startswith("Ferry.MoveNotSettled:") and migration in details and "ferry audit" in details
    assert _events(uuid, older) == {"compute_stop_instance": (None, None)}


def _confirm_accepted(uuid: str, *, began: bool = False) -> str:
    """A confirm of the server accepted now (its request id); ``began``: its first step recorded its event."""
    request_id = f"req-{uuidlib.uuid4()}"
    with cell_session(CELL) as session:
        actions.start_action(session, instance_uuid=uuid, action=actions.CONFIRM_RESIZE, request_id=request_id,
                             user_id=USER, project_id=PROJECT)
        if began:
            actions.start_event(session, instance_uuid=uuid, request_id=request_id, event="compute_confirm_resize")
    return request_id


@pytest.mark.parametrize("began", [False, True])
def test_a_confirm_stuck_without_a_workflow_goes_back_to_finished_only_when_it_never_began(cloud, began):
    # GIVEN a resized server whose confirm was accepted long ago, and whose workflow either never
    # started (no step recorded an event) or began and ended without settling the move
    uuid, migration = cloud.resized.instance_uuid, cloud.resized.migration_uuid
    request_id = _confirm_accepted(uuid, began=began)
    cell_write(CELL, update(Migration).where(Migration.uuid == migration)
               .values(status=migration_states.CONFIRMING, updated_at=LONG_AGO))

    # WHEN the audit repairs what it finds
    report = check(fix=True)

    # THEN a confirm that never began is given back: the server waits in VERIFY_RESIZE, and a
    # confirm is accepted again; one that began is put in error, for the operator
    (repair,) = [r for r in report.repairs if r.problem.kind == audit.MIGRATION_STUCK]
    assert repair.error is None and ("never began" in repair.problem.message) is not began
    with cell_session(CELL) as session:
        status = session.scalars(select(Migration.status).where(Migration.uuid == migration)).one()
        assert status == (migration_states.ERROR if began else migration_states.FINISHED)
        assert (actions.newest_request_id(session, uuid, actions.CONFIRM_RESIZE) == request_id) is began
        if not began:
            _instance, settling = moves._check_settle_state(session, actions.CONFIRM_RESIZE, uuid)
            assert settling.uuid == migration
    if not began:
        assert check().clean
    else:  # the confirm's event its workflow left open ended with the migration
        result, details = _events(uuid, request_id)["compute_confirm_resize"]
        assert result == "Error" and details is not None and "ferry audit" in details


@pytest.mark.parametrize(("race", "left"), [("given back and confirmed again", "given back meanwhile"),
                                             ("its first step begins", "began meanwhile")])
def test_a_confirm_that_changes_while_the_audit_runs_is_left_to_the_confirm_under_way(cloud, monkeypatch, race,
                                                                                      left):
    # GIVEN a confirm accepted long ago that had not begun when the audit read it
    uuid, migration = cloud.resized.instance_uuid, cloud.resized.migration_uuid
    first = _confirm_accepted(uuid)
    cell_write(CELL, update(Migration).where(Migration.uuid == migration)
               .values(status=migration_states.CONFIRMING, updated_at=LONG_AGO))

    # WHEN, between the audit's read and its repair, that confirm is given back (a drain's undo)
    # and a new one is accepted and begins, or its own first step begins (records its event)
    def raced() -> None:
        with cell_session(CELL) as session:
            if race == "its first step begins":
                actions.start_event(session, instance_uuid=uuid, request_id=first, event="compute_confirm_resize")
                return
            actions.forget_action(session, uuid, first)
        _confirm_accepted(uuid, began=True)

    report = fix_with_race(monkeypatch, raced)

    # THEN the repair gives nothing back: the migration stays the confirm's under way
    (repair,) = [r for r in report.repairs if r.problem.kind == audit.MIGRATION_STUCK]
    assert repair.error is not None and left in repair.error
    with cell_session(CELL) as session:
        assert session.scalars(select(Migration.status).where(Migration.uuid == migration)).one() == \
            migration_states.CONFIRMING
        newest = actions.newest_request_id(session, uuid, actions.CONFIRM_RESIZE)
        assert (newest == first) is (left == "began meanwhile")


@pytest.mark.parametrize("why", ["a task", "another host"])
def test_a_confirm_that_never_began_and_would_be_refused_again_is_put_in_error(cloud, why):
    # GIVEN a confirm accepted long ago that never began, of a server its confirm refuses (a task
    # under way, or not on the move's destination)
    uuid, migration = cloud.resized.instance_uuid, cloud.resized.migration_uuid
    _confirm_accepted(uuid)
    cell_write(CELL, update(Migration).where(Migration.uuid == migration)
               .values(status=migration_states.CONFIRMING, updated_at=LONG_AGO))
    cell_write(CELL, update(Instance).where(Instance.uuid == uuid).values(
        **({"task_state": states.RESIZE_REVERTING} if why == "a task" else {"host": OTHER})))

    # WHEN the audit repairs it
    report = check(fix=True)

    # THEN it is put in error for an operator, not given back to be refused at every confirm
    (repair,) = [r for r in report.repairs if r.problem.kind == audit.MIGRATION_STUCK]
    assert repair.error is None and "never began" not in repair.problem.message
    with cell_session(CELL) as session:
        assert session.scalars(select(Migration.status).where(Migration.uuid == migration)).one() == \
            migration_states.ERROR


def test_a_migration_whose_workflow_runs_is_not_stuck(cloud):
    migration = add_migration(cloud.active, migration_states.MIGRATING, created_at=LONG_AGO)
    cell_write(CELL, update(Instance).where(Instance.uuid == cloud.active)
               .values(task_state=states.RESIZE_MIGRATING))

    assert check(running_executions={f"resize-{cloud.active}-{migration[:8]}"}).clean


def test_without_a_view_of_the_workflows_a_stuck_migration_is_reported_but_not_repaired(cloud):
    add_migration(cloud.active, migration_states.MIGRATING, created_at=LONG_AGO)

    report = check(fix=True, running_executions=None)

    assert report.kinds() == [audit.MIGRATION_STUCK] and report.repairs == []
    assert any("state machine" in note for note in report.skipped)


PASS_DEFINITION = json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Succeed"}}})


def configure_state_machines(monkeypatch: pytest.MonkeyPatch, *workflows: str) -> None:
    """Dummy state machines (nothing runs) for ``workflows`` (``resize``, ``confirm_resize``, …), in the settings."""
    sfn = aws.client("stepfunctions")
    for workflow in workflows:
        arn = sfn.create_state_machine(name=f"ferry-test-{workflow}", definition=PASS_DEFINITION,
                                       roleArn="arn:aws:iam::123456789012:role/ferry-test")["stateMachineArn"]
        monkeypatch.setenv(f"FERRY_{workflow.upper()}_STATE_MACHINE_ARN", arn)
    config.reset()


def test_a_settling_migration_is_not_put_in_error_when_its_workflows_are_not_listed(cloud, monkeypatch):
    # GIVEN only the resize state machine configured: a running confirm would not be listed
    configure_state_machines(monkeypatch, "resize")
    migration = add_migration(cloud.active, migration_states.CONFIRMING, created_at=LONG_AGO)

    report = check(fix=True, running_executions=None)

    # THEN the migration is reported, not repaired, and the report says why
    assert report.kinds() == [audit.MIGRATION_STUCK] and report.repairs == [], report.describe()
    assert any("confirm resize" in note and "not repaired" in note for note in report.skipped), report.skipped
    with cell_session(CELL) as session:
        status = session.scalars(select(Migration.status).where(Migration.uuid == migration)).one()
        assert status == migration_states.CONFIRMING


def test_with_every_move_workflow_listed_a_stuck_migration_is_put_in_error(cloud, monkeypatch):
    configure_state_machines(monkeypatch, "resize", "confirm_resize", "revert_resize")
    migration = add_migration(cloud.active, migration_states.CONFIRMING, created_at=LONG_AGO)

    report = check(fix=True, running_executions=None)

    assert [r.error for r in report.repairs if r.problem.kind == audit.MIGRATION_STUCK] == [None], report.describe()
    assert report.skipped == []
    with cell_session(CELL) as session:
        status = session.scalars(select(Migration.status).where(Migration.uuid == migration)).one()
        assert status == migration_states.ERROR


@pytest.mark.parametrize("status", [migration_states.MIGRATING, migration_states.CONFIRMING])
@pytest.mark.parametrize("listed_again", ["a workflow for the server", "nothing: listing fails"])
def test_a_stuck_migration_whose_workflow_starts_while_the_audit_runs_is_left_to_it(cloud, monkeypatch, status,
                                                                                    listed_again):
    # GIVEN every move workflow listed, none running for a migration stuck long ago (a confirm
    # accepted then, for one confirming, that never began)
    configure_state_machines(monkeypatch, "resize", "confirm_resize", "revert_resize")
    if status == migration_states.CONFIRMING:
        uuid, migration = cloud.resized.instance_uuid, cloud.resized.migration_uuid
        _confirm_accepted(uuid)
        cell_write(CELL, update(Migration).where(Migration.uuid == migration)
                   .values(status=status, updated_at=LONG_AGO))
    else:
        uuid, migration = cloud.active, add_migration(cloud.active, status, created_at=LONG_AGO)

    # WHEN, between the audit's read and its repair, a workflow starts for the server (a failed
    # execution redriven), or the workflows can no longer be listed
    def raced() -> None:
        running = {f"resize-{uuid}-redriven"} if listed_again.startswith("a workflow") else None
        monkeypatch.setattr(audit, "_running_executions", lambda skipped: running)

    report = fix_with_race(monkeypatch, raced, running_executions=None)

    # THEN the repair changes nothing and says why
    (repair,) = [r for r in report.repairs if r.problem.kind == audit.MIGRATION_STUCK]
    assert repair.error is not None and ("runs for server" if listed_again.startswith("a workflow")
                                         else "cannot be listed") in repair.error, repair.error
    with cell_session(CELL) as session:
        assert session.scalars(select(Migration.status).where(Migration.uuid == migration)).one() == status
        if status == migration_states.CONFIRMING:  # not given back either
            assert actions.newest_request_id(session, uuid, actions.CONFIRM_RESIZE) is not None


def test_the_repairs_of_stuck_migrations_list_the_running_workflows_once_a_round(cloud, monkeypatch):
    # GIVEN every move workflow listed and two migrations stuck long ago
    configure_state_machines(monkeypatch, "resize", "confirm_resize", "revert_resize")
    stuck = [add_migration(cloud.active, status, created_at=LONG_AGO)
             for status in (migration_states.MIGRATING, migration_states.POST_MIGRATING)]
    listings = []

    def counted(skipped: list[str]) -> set[str]:
        listings.append(skipped)
        return set()

    # WHEN the audit repairs them, the workflows listed from the read on
    report = fix_with_race(monkeypatch, lambda: monkeypatch.setattr(audit, "_running_executions", counted),
                           running_executions=None)

    # THEN both are put in error after one look at the running workflows for both repairs (the
    # other is the audit's read of the store after them)
    assert [r.error for r in report.repairs if r.problem.kind == audit.MIGRATION_STUCK] == [None, None]
    assert len(listings) == 2
    with cell_session(CELL) as session:
        assert set(session.scalars(select(Migration.status).where(Migration.uuid.in_(stuck)))) == {
            migration_states.ERROR}


def test_a_listing_of_the_running_workflows_that_fails_is_not_shared_by_the_next_repair(cloud, monkeypatch):
    # GIVEN every move workflow listed and two migrations stuck long ago
    configure_state_machines(monkeypatch, "resize", "confirm_resize", "revert_resize")
    stuck = [add_migration(cloud.active, status, created_at=LONG_AGO)
             for status in (migration_states.MIGRATING, migration_states.POST_MIGRATING)]
    answers: list[set[str] | None] = [None, set()]

    def throttled_once(skipped: list[str]) -> set[str] | None:
        if not answers:
            return set()
        answer = answers.pop(0)
        if answer is None:
            skipped.append("listing running workflows failed (ThrottlingException)")
        return answer

    # WHEN the first listing for the repairs fails (throttled) and the next works
    report = fix_with_race(monkeypatch, lambda: monkeypatch.setattr(audit, "_running_executions", throttled_once),
                           running_executions=None)

    # THEN one repair is refused saying why, and the other asks again and is made
    repairs = {r.problem.resource.removeprefix("migration/"): r.error for r in report.repairs
               if r.problem.kind == audit.MIGRATION_STUCK}
    assert sorted(error is None for error in repairs.values()) == [False, True]
    assert any("ThrottlingException" in error for error in repairs.values() if error)
    with cell_session(CELL) as session:
        statuses = dict(session.execute(select(Migration.uuid, Migration.status)
                                        .where(Migration.uuid.in_(stuck))).all())
    assert {u: statuses[u] == migration_states.ERROR for u in stuck} == {u: repairs[u] is None for u in stuck}


def test_a_server_stuck_with_a_task_and_no_workflow_is_found(cloud):
    cell_write(CELL, update(Instance).where(Instance.uuid == cloud.active)
               .values(task_state=states.POWERING_OFF, updated_at=LONG_AGO))

    report = check()

    assert report.kinds() == [audit.INSTANCE_TASK_STUCK]
    assert not report.problems[0].fixable
    assert check(running_executions={f"power-{cloud.active}-1234"}).clean


def test_the_report_serialises_every_field(cloud):
    placement.claim(str(uuidlib.uuid4()), PROJECT, USER, {provider(OTHER): OLD_USAGE})

    (problem,) = check().to_dict()["problems"]

    assert set(problem) == {"kind", "resource", "message", "fixable", "hint"}
    assert problem["hint"] == audit.HINTS[audit.ALLOCATION_ORPHAN]


def test_every_kind_has_a_runbook_entry():
    runbook = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()

    missing = [kind for kind in audit.KINDS if f"### `{kind}`" not in runbook]

    assert missing == []



def test_a_report_that_arrives_after_a_newer_one_does_not_replace_its_view(cloud):
    stray = str(uuidlib.uuid4())
    report_view(OTHER, [stray], [])
    hosts.apply_report({"kind": "inventory", "host": OTHER, "node": OTHER, "cell": CELL,
                        "sent_at": (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)).isoformat(),
                        "inventory": {"VCPU": {"total": 8}, "MEMORY_MB": {"total": 8192}, "DISK_GB": {"total": 40}},
                        "guests": [], "instance_dirs": []},
                       utcnow() - dt.timedelta(seconds=30))  # queued before the newer one, handled after it

    assert check().kinds() == [audit.GUEST_ORPHAN]


def test_a_drifted_counter_is_found_on_a_host_that_keeps_reporting(cloud):
    # GIVEN a drifted counter on a host whose report was just applied (the provider changed now)
    with api_session() as session:
        provider_id = session.scalars(select(ResourceProvider.id).where(ResourceProvider.host == OTHER)).one()
        session.execute(update(Inventory).where(Inventory.resource_provider_id == provider_id,
                                                Inventory.resource_class == "VCPU").values(used=3))
    report_view(OTHER, [], [])

    # WHEN the audit runs with its grace period, THEN the drift is found and recomputed all the same
    report = check(grace_seconds=120)

    (problem,) = found(report, audit.INVENTORY_USAGE_DRIFT)
    assert problem.resource == f"provider/{OTHER}/VCPU"
    assert_fixed(audit.INVENTORY_USAGE_DRIFT)
