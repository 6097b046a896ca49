"""Resize and cold migrate between the local stack's two cells, with confirm, revert and delete.

The module allows moves between cells (the policy file) and gives each cell a hardware
generation: an aggregate of the cell's hosts with ``hw_generation=<cell>``, and a flavor of the
small size whose extra spec asks for it. Resizing to the other cell's flavor leaves only that
cell's hosts to the scheduler. After every operation: the instance mapping names the one visible
copy, no copy is left in the other cell, placement holds exactly the flavor where the server
lives, no host keeps its disks elsewhere, the temporary snapshot is gone, and the root disk
carries the bytes it had.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from move_helpers import (
    CROSS_CELL_RULE,
    FLAVORS,
    SMALL,
    TINY,
    GiB,
    boot_with_digest,
    generation_flavors,
    host_of,
    port_bindings,
    resize_to_verify,
    root_digest,
)
from sqlalchemy import select

from ferry import faults
from ferry.store.api_models import (
    CellMapping,
    InstanceMapping,
    Volume,
    VolumeAttachment,
)
from ferry.store.cell_models import BlockDeviceMapping, Instance, Migration, Tag
from ferry.store.db import api_session, cell_session

pytestmark = pytest.mark.e2e

SNAPSHOT_SUFFIX = "-resize-temp"


# --- the module's cells: policy, hardware generations ---------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def cross_cell_allowed(local_stack) -> Iterator[None]:
    with local_stack.override_policy({CROSS_CELL_RULE: "admin_or_owner"}):
        yield


@pytest.fixture(scope="module")
def generation_flavor(local_stack) -> Iterator[dict[str, str]]:
    """``{cell: flavor id}``: a flavor of the small size that only that cell's hosts offer."""
    with generation_flavors(local_stack) as flavors:
        yield flavors


@pytest.fixture
def boot(servers, local_stack):
    return lambda flavor=TINY, **extra: boot_with_digest(local_stack, servers, flavor, **extra)


@pytest.fixture
def armed() -> Iterator[Any]:
    yield faults.arm
    faults.disarm_all()


# --- what Ferry recorded ----------------------------------------------------------------------------


def mapped_cell(server_id: str) -> str:
    with api_session() as session:
        return session.scalars(select(CellMapping.name).join(InstanceMapping, InstanceMapping.cell_id == CellMapping.id)
                               .where(InstanceMapping.instance_uuid == server_id)).one()


def copies(local_stack, server_id: str) -> dict[str, tuple[bool, str, str]]:
    """``{cell: (hidden, host, flavor id)}`` of every copy of the instance, in every cell."""
    found = {}
    for cell in sorted(set(local_stack.hosts.values())):
        with cell_session(cell) as session:
            row = session.scalars(select(Instance).where(Instance.uuid == server_id)).one_or_none()
            if row is not None:
                found[cell] = (row.hidden, row.host, row.flavor["flavorid"])
    return found


def migrations_anywhere(local_stack, server_id: str) -> dict[str, list[tuple[str, bool, bool]]]:
    """``{cell: [(status, cross_cell_move, hidden)]}`` of the server's migrations in each cell."""
    found = {}
    for cell in sorted(set(local_stack.hosts.values())):
        with cell_session(cell) as session:
            rows = session.scalars(select(Migration).where(Migration.instance_uuid == server_id)
                                   .order_by(Migration.id)).all()
            found[cell] = [(m.status, m.cross_cell_move, m.hidden) for m in rows]
    return found


def migration_uuid(local_stack, server_id: str) -> str:
    uuids = set()
    for cell in sorted(set(local_stack.hosts.values())):
        with cell_session(cell) as session:
            uuids |= set(session.scalars(select(Migration.uuid).where(Migration.instance_uuid == server_id)))
    [only] = uuids
    return only


def tags_and_bdms(cell: str, server_id: str) -> tuple[list[str], list[str]]:
    with cell_session(cell) as session:
        tags = sorted(session.scalars(select(Tag.tag).where(Tag.instance_uuid == server_id)))
        bdms = sorted(session.scalars(select(BlockDeviceMapping.uuid).where(
            BlockDeviceMapping.instance_uuid == server_id, BlockDeviceMapping.deleted == 0)))
    return tags, bdms


def attachment_hosts(server_id: str, volume_id: str) -> set[str]:
    with api_session() as session:
        return set(session.scalars(select(VolumeAttachment.host).where(
            VolumeAttachment.instance_uuid == server_id, VolumeAttachment.volume_id == volume_id,
            VolumeAttachment.status == "attached")))


def bucket_keys(local_stack) -> set[str]:
    """Every object in the image bucket (images and transfers)."""
    from ferry import config

    listed = local_stack.client("s3").list_objects_v2(Bucket=config.get().image_bucket)
    return {o["Key"] for o in listed.get("Contents", [])}


def temporary_snapshots(servers) -> list[str]:
    images = servers.api("admin").get("/images").json()["images"]
    return [i["name"] for i in images if i["name"].endswith(SNAPSHOT_SUFFIX)]


def other_cell(local_stack, cell: str) -> str:
    [other] = sorted(set(local_stack.hosts.values()) - {cell})
    return other


def assert_lives_only_in(local_stack, records, server_id: str, host: str, flavor_amounts: dict[str, int]) -> None:
    """The server is on ``host``: one visible copy there, the mapping on its cell, nothing anywhere else."""
    cell = local_stack.hosts[host]
    assert mapped_cell(server_id) == cell
    found = copies(local_stack, server_id)
    assert list(found) == [cell] and found[cell][:2] == (False, host), found
    assert records.allocations(server_id) == {records.provider(host): flavor_amounts}
    for other in local_stack.hosts:
        assert not (local_stack.instances_dir(other) / f"{server_id}_resize").exists(), other
        if other != host:
            assert not records.instance_dir(other, server_id).exists(), f"disks left on {other}"
    assert records.instance_dir(host, server_id).is_dir()
    assert port_bindings(server_id) == {(host, "ACTIVE")}


# --- moves between cells ------------------------------------------------------------------------------


def test_resize_to_the_other_cells_flavor_moves_the_server_there_and_confirm_cleans_the_source(
        local_stack, servers, records, boot, generation_flavor):
    keys_before = bucket_keys(local_stack)
    server, digest = boot(TINY, tags=["blue", "green"])
    source, source_cell = host_of(server), local_stack.hosts[host_of(server)]
    target_cell = other_cell(local_stack, source_cell)
    ports = records.ports(server["id"])
    tags, bdms = tags_and_bdms(source_cell, server["id"])

    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": generation_flavor[target_cell]}})

    dest = host_of(resized)
    assert local_stack.hosts[dest] == target_cell
    assert resized["OS-EXT-STS:vm_state"] == "resized" and resized["OS-EXT-STS:power_state"] == 1
    assert resized["flavor"]["original_name"] == f"e2e.small.{target_cell}"
    assert sorted(resized["tags"]) == ["blue", "green"]
    assert mapped_cell(server["id"]) == target_cell
    assert copies(local_stack, server["id"]) == {
        source_cell: (True, source, TINY), target_cell: (False, dest, generation_flavor[target_cell])}
    assert migrations_anywhere(local_stack, server["id"]) == {
        source_cell: [("finished", True, False)], target_cell: [("finished", True, False)]}
    assert tags_and_bdms(target_cell, server["id"]) == (tags, bdms)
    assert records.ports(server["id"]) == ports
    assert port_bindings(server["id"]) == {(source, "INACTIVE"), (dest, "ACTIVE")}
    moved = migration_uuid(local_stack, server["id"])
    assert records.allocations(moved) == {records.provider(source): FLAVORS[TINY]}
    assert records.allocations(server["id"]) == {records.provider(dest): FLAVORS[SMALL]}
    dest_root = records.instance_dir(dest, server["id"]) / "disk"
    assert dest_root.stat().st_size == FLAVORS[SMALL]["DISK_GB"] * GiB
    assert root_digest(dest_root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    assert (local_stack.instances_dir(source) / f"{server['id']}_resize").is_dir()
    assert temporary_snapshots(servers) == [] and bucket_keys(local_stack) == keys_before

    listed = servers.api("admin").get(f"/os-migrations?instance_uuid={server['id']}").json()["migrations"]
    assert [(m["uuid"], m["status"]) for m in listed] == [(moved, "finished")]
    listing = servers.api("demo").get("/servers").json()["servers"]
    assert [s["id"] for s in listing].count(server["id"]) == 1

    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    confirmed = servers.wait_for_status(server["id"], "ACTIVE")

    assert host_of(confirmed) == dest and sorted(confirmed["tags"]) == ["blue", "green"]
    assert_lives_only_in(local_stack, records, server["id"], dest, FLAVORS[SMALL])
    assert not records.consumer_exists(moved)
    assert migrations_anywhere(local_stack, server["id"]) == {
        source_cell: [], target_cell: [("confirmed", True, False)]}
    assert tags_and_bdms(target_cell, server["id"]) == (tags, bdms)
    assert records.ports(server["id"]) == ports
    assert root_digest(dest_root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    assert event_names(servers, server["id"], "resize") == [
        "conductor_migrate_server", "compute_prep_snapshot_based_resize_at_dest",
        "compute_prep_snapshot_based_resize_at_source", "compute_finish_snapshot_based_resize_at_dest"]
    assert event_names(servers, server["id"], "confirmResize") == [
        "conductor_confirm_snapshot_based_resize", "compute_confirm_snapshot_based_resize_at_source"]


def event_names(servers, server_id: str, action: str) -> list[str]:
    api = servers.api("admin")
    listed = api.get(f"/servers/{server_id}/os-instance-actions").json()["instanceActions"]
    [wanted] = [a for a in listed if a["action"] == action]
    detail = api.get(f"/servers/{server_id}/os-instance-actions/{wanted['request_id']}").json()["instanceAction"]
    assert all(e["result"] == "Success" for e in detail["events"]), detail["events"]
    return [e["event"] for e in sorted(detail["events"], key=lambda e: e["start_time"])]


def test_a_volume_backed_server_moves_to_the_other_cell_and_reverts(local_stack, servers, records, generation_flavor):
    server = servers.boot(flavor=TINY, imageRef="", block_device_mapping_v2=[{
        "source_type": "image", "destination_type": "volume", "uuid": local_stack.seeded.image["id"],
        "boot_index": 0, "volume_size": 1, "delete_on_termination": True}])
    source, source_cell = host_of(server), local_stack.hosts[host_of(server)]
    target_cell = other_cell(local_stack, source_cell)
    [volume_id] = [v["id"] for v in server["os-extended-volumes:volumes_attached"]]
    _, bdms = tags_and_bdms(source_cell, server["id"])
    keys_before = bucket_keys(local_stack)

    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": generation_flavor[target_cell]}})
    dest = host_of(resized)
    assert local_stack.hosts[dest] == target_cell
    assert records.allocations(server["id"]) == {records.provider(dest): {"VCPU": 1, "MEMORY_MB": 512}}
    assert attachment_hosts(server["id"], volume_id) == {source, dest}  # the source's goes at confirm or revert
    assert bucket_keys(local_stack) == keys_before  # nothing to snapshot: the root disk is the volume

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    reverted = servers.wait_for_status(server["id"], "ACTIVE")

    assert host_of(reverted) == source and reverted["flavor"]["original_name"] == "ferry.tiny"
    assert_lives_only_in(local_stack, records, server["id"], source, {"VCPU": 1, "MEMORY_MB": 256})
    assert attachment_hosts(server["id"], volume_id) == {source}
    assert tags_and_bdms(source_cell, server["id"])[1] == bdms
    assert migrations_anywhere(local_stack, server["id"]) == {
        source_cell: [("reverted", True, False)], target_cell: []}
    assert event_names(servers, server["id"], "revertResize") == [
        "conductor_revert_snapshot_based_resize", "compute_revert_snapshot_based_resize_at_dest",
        "compute_finish_revert_snapshot_based_resize_at_source"]


@pytest.mark.parametrize("finish", ["confirmResize", "revertResize"])
def test_a_stopped_server_stays_shut_off_across_cells(local_stack, servers, records, boot, generation_flavor, finish):
    server, digest = boot(TINY)
    source, source_cell = host_of(server), local_stack.hosts[host_of(server)]
    assert servers.action(server["id"], {"os-stop": None}).status_code == 202
    servers.wait_for_status(server["id"], "SHUTOFF")

    target_cell = other_cell(local_stack, source_cell)
    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": generation_flavor[target_cell]}})
    assert resized["OS-EXT-STS:power_state"] == 4 and local_stack.hosts[host_of(resized)] == target_cell

    assert servers.action(server["id"], {finish: None}).status_code in (202, 204)
    done = servers.wait_for_status(server["id"], "SHUTOFF")

    assert done["OS-EXT-STS:power_state"] == 4
    host, amounts = (host_of(resized), FLAVORS[SMALL]) if finish == "confirmResize" else (source, FLAVORS[TINY])
    assert host_of(done) == host
    assert_lives_only_in(local_stack, records, server["id"], host, amounts)
    assert root_digest(records.instance_dir(host, server["id"]) / "disk", FLAVORS[TINY]["DISK_GB"] * GiB) == digest


def test_migrate_to_a_named_host_of_the_other_cell_lands_there(local_stack, servers, records, boot):
    server, digest = boot(TINY)
    source_cell = local_stack.hosts[host_of(server)]
    target = sorted(h for h, c in local_stack.hosts.items() if c != source_cell)[-1]

    response = servers.api("admin").post(f"/servers/{server['id']}/action", json={"migrate": {"host": target}},
                                         headers={"OpenStack-API-Version": "compute 2.56"})
    assert response.status_code == 202, response.text
    migrated = servers.wait_for_status(server["id"], "VERIFY_RESIZE", timeout=120)
    assert host_of(migrated) == target and migrated["flavor"]["original_name"] == "ferry.tiny"

    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    servers.wait_for_status(server["id"], "ACTIVE")
    assert_lives_only_in(local_stack, records, server["id"], target, FLAVORS[TINY])
    assert root_digest(records.instance_dir(target, server["id"]) / "disk", FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    listed = servers.api("admin").get(f"/os-migrations?instance_uuid={server['id']}",
                                      headers={"OpenStack-API-Version": "compute 2.59"}).json()["migrations"]
    assert [(m["migration_type"], m["status"], m["dest_compute"]) for m in listed] == [
        ("migration", "confirmed", target)]


def test_the_weigher_keeps_a_move_in_its_cell_when_a_host_there_fits(local_stack, servers, records, boot):
    server, _ = boot(TINY)
    source, cell = host_of(server), local_stack.hosts[host_of(server)]

    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})

    assert local_stack.hosts[host_of(resized)] == cell and host_of(resized) != source
    assert migrations_anywhere(local_stack, server["id"])[cell] == [("finished", False, False)]
    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    servers.wait_for_status(server["id"], "ACTIVE")
    assert_lives_only_in(local_stack, records, server["id"], source, FLAVORS[TINY])


def test_without_the_policy_a_move_to_the_other_cells_flavor_finds_no_host(local_stack, servers, records, boot,
                                                                            generation_flavor):
    server, digest = boot(TINY)
    source, cell = host_of(server), local_stack.hosts[host_of(server)]

    elsewhere = generation_flavor[other_cell(local_stack, cell)]
    with local_stack.override_policy({}):
        response = servers.action(server["id"], {"resize": {"flavorRef": elsewhere}})
        assert response.status_code == 202, response.text
        local_stack.wait_for(lambda: migrations_anywhere(local_stack, server["id"])[cell] == [("error", False, False)],
                             timeout=120)
    servers.wait_for_status(server["id"], "ACTIVE")
    assert_lives_only_in(local_stack, records, server["id"], source, FLAVORS[TINY])
    assert root_digest(records.instance_dir(source, server["id"]) / "disk", FLAVORS[TINY]["DISK_GB"] * GiB) == digest


def test_delete_in_verify_resize_cleans_both_cells_and_both_hosts(local_stack, servers, records, boot,
                                                                  generation_flavor):
    server, _ = boot(TINY)
    source, source_cell = host_of(server), local_stack.hosts[host_of(server)]
    ports = records.ports(server["id"])
    resized = resize_to_verify(servers, server["id"],
                               {"resize": {"flavorRef": generation_flavor[other_cell(local_stack, source_cell)]}})
    moved = migration_uuid(local_stack, server["id"])

    assert servers.delete(server["id"]).status_code == 204
    servers.wait_until_gone(server["id"])

    for host in (source, host_of(resized)):
        assert not records.instance_dir(host, server["id"]).exists(), host
        assert not (local_stack.instances_dir(host) / f"{server['id']}_resize").exists(), host
    assert records.allocations(server["id"]) == {} and not records.consumer_exists(moved)
    assert not any(records.port_exists(port) for port in ports)
    found = copies(local_stack, server["id"])
    assert list(found) in ([], [local_stack.hosts[host_of(resized)]])  # at most the soft-deleted row
    assert all(migrations == [] or migrations[-1][0] == "confirmed"
               for migrations in migrations_anywhere(local_stack, server["id"]).values())


def test_a_volume_attached_and_detached_while_resized_follows_the_revert(local_stack, servers, records, boot,
                                                                        generation_flavor):
    server, _ = boot(TINY)
    source, source_cell = host_of(server), local_stack.hosts[host_of(server)]
    dest = host_of(resize_to_verify(servers, server["id"],
                                    {"resize": {"flavorRef": generation_flavor[other_cell(local_stack, source_cell)]}}))
    project = local_stack.seeded.identities["demo"].project_id
    kept, detached = str(uuid.uuid4()), str(uuid.uuid4())
    with api_session() as session:
        for volume_id in (kept, detached):
            session.add(Volume(id=volume_id, project_id=project, size_gb=1,
                               path=str(local_stack.state_dir / "volumes" / volume_id)))
    api = servers.api("demo")
    for volume_id in (kept, detached):
        attach = api.post(f"/servers/{server['id']}/os-volume_attachments",
                          json={"volumeAttachment": {"volumeId": volume_id}})
        assert attach.status_code == 200, attach.text
        local_stack.wait_for(lambda v=volume_id: attachment_hosts(server["id"], v) == {dest})
        servers.wait_for_status(server["id"], "VERIFY_RESIZE")
    assert api.delete(f"/servers/{server['id']}/os-volume_attachments/{detached}").status_code == 202
    local_stack.wait_for(lambda: attachment_hosts(server["id"], detached) == set())
    servers.wait_for_status(server["id"], "VERIFY_RESIZE")

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    reverted = servers.wait_for_status(server["id"], "ACTIVE")

    assert host_of(reverted) == source
    assert attachment_hosts(server["id"], kept) == {source}
    assert attachment_hosts(server["id"], detached) == set()
    assert [v["id"] for v in reverted["os-extended-volumes:volumes_attached"]] == [kept]
    assert_lives_only_in(local_stack, records, server["id"], source, FLAVORS[TINY])


def test_a_refused_claim_reschedules_to_the_other_host_of_the_target_cell(local_stack, servers, records, boot,
                                                                         generation_flavor, armed):
    server, digest = boot(TINY)
    source_cell = local_stack.hosts[host_of(server)]
    target_cell = other_cell(local_stack, source_cell)
    armed("*:prep_resize", faults.ONCE, "ResizeClaimFailed")

    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": generation_flavor[target_cell]}})

    dest = host_of(resized)
    assert local_stack.hosts[dest] == target_cell
    refused = [h for h, c in local_stack.hosts.items() if c == target_cell and h != dest]
    [first] = refused
    assert ("prep_resize", "failed") in records.host_operations(first, server["id"])
    assert records.usages(first) == {} or all(v == 0 for v in records.usages(first).values())
    assert not records.instance_dir(first, server["id"]).exists()
    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    servers.wait_for_status(server["id"], "ACTIVE")
    assert_lives_only_in(local_stack, records, server["id"], dest, FLAVORS[SMALL])
    assert root_digest(records.instance_dir(dest, server["id"]) / "disk", FLAVORS[TINY]["DISK_GB"] * GiB) == digest


# --- a failure at any step of the move leaves the server where it was -------------------------------


def test_a_snapshot_that_fails_half_way_leaves_the_server_as_it_was(local_stack, servers, records, boot,
                                                                     generation_flavor, armed):
    """The snapshot's data is sent but its image object is not written (every Task state: test_fault_sweep.py)."""
    point = "*:snapshot_written"
    keys_before = bucket_keys(local_stack)
    server, digest = boot(TINY, tags=["kept"])
    source, source_cell = host_of(server), local_stack.hosts[host_of(server)]
    target_cell = other_cell(local_stack, source_cell)
    ports = records.ports(server["id"])
    armed(point, faults.ALWAYS)

    response = servers.action(server["id"], {"resize": {"flavorRef": generation_flavor[target_cell]}})
    assert response.status_code == 202, response.text
    local_stack.wait_for(lambda: [m[0] for m in migrations_anywhere(local_stack, server["id"])[source_cell]]
                         == ["error"], timeout=180)
    faults.disarm_all()

    after = servers.wait_for_status(server["id"], "ACTIVE", timeout=120)
    assert host_of(after) == source and after["flavor"]["original_name"] == "ferry.tiny"
    assert after["OS-EXT-STS:power_state"] == 1 and after["tags"] == ["kept"]
    assert_lives_only_in(local_stack, records, server["id"], source, FLAVORS[TINY])
    assert migrations_anywhere(local_stack, server["id"])[target_cell] == []
    assert not records.consumer_exists(migration_uuid(local_stack, server["id"]))
    assert records.ports(server["id"]) == ports
    root = records.instance_dir(source, server["id"]) / "disk"
    assert root_digest(root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    assert temporary_snapshots(servers) == [] and bucket_keys(local_stack) == keys_before
    for host, cell in local_stack.hosts.items():
        if cell == target_cell:
            assert all(v == 0 for v in records.usages(host).values()), (host, records.usages(host))

    # The server can still move, and back.
    resize_to_verify(servers, server["id"], {"resize": {"flavorRef": generation_flavor[target_cell]}})
    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    servers.wait_for_status(server["id"], "ACTIVE")
    assert_lives_only_in(local_stack, records, server["id"], source, FLAVORS[TINY])
    assert root_digest(root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
