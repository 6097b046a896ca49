"""Same-cell resize and cold migrate, confirm and revert, end to end on the local stack.

API → state machine → host agents on libvirt test hosts → store. After every operation the
invariants hold: placement usages equal the flavors of the servers where they live, nothing is
left on the other host, and the root disk carries the same bytes it had before the move.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from move_helpers import (
    FLAVORS,
    LARGE,
    MEDIUM,
    SERVICES_MICROVERSION,
    SMALL,
    TINY,
    GiB,
    assert_lives_only_on,
    boot_with_digest,
    cell_of,
    compute_services,
    host_of,
    migrations_of,
    resize_to_verify,
    root_digest,
)
from sqlalchemy import select

from ferry import hosts
from ferry.store.api_models import Volume, VolumeAttachment
from ferry.store.cell_models import Service
from ferry.store.db import api_session, cell_session

pytestmark = pytest.mark.e2e

@pytest.fixture
def boot(servers, local_stack):
    return lambda flavor=TINY, **extra: boot_with_digest(local_stack, servers, flavor, **extra)


def test_resize_then_confirm_moves_the_server_to_the_new_flavor_on_another_host(local_stack, servers, records, boot):
    server, digest = boot(TINY)
    source = host_of(server)

    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})

    dest = host_of(resized)
    assert dest != source and cell_of(local_stack, dest) == cell_of(local_stack, source)
    assert resized["flavor"]["original_name"] == "ferry.small"
    assert resized["OS-EXT-STS:vm_state"] == "resized" and resized["OS-EXT-STS:power_state"] == 1
    [migration] = migrations_of(server["id"], cell_of(local_stack, source))
    assert (migration.status, migration.migration_type) == ("finished", "resize")
    assert records.allocations(migration.uuid) == {records.provider(source): FLAVORS[TINY]}
    assert records.allocations(server["id"]) == {records.provider(dest): FLAVORS[SMALL]}
    dest_root = records.instance_dir(dest, server["id"]) / "disk"
    assert dest_root.stat().st_size == FLAVORS[SMALL]["DISK_GB"] * GiB
    assert root_digest(dest_root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest

    response = servers.action(server["id"], {"confirmResize": None})
    assert response.status_code == 204, response.text
    confirmed = servers.wait_for_status(server["id"], "ACTIVE")

    assert host_of(confirmed) == dest
    assert_lives_only_on(local_stack, records, server["id"], dest, SMALL)
    assert not records.consumer_exists(migration.uuid)
    assert migrations_of(server["id"], cell_of(local_stack, source))[0].status == "confirmed"
    events = instance_events(servers, server["id"], "resize")
    assert ["conductor_migrate_server", "compute_prep_resize", "compute_resize_instance",
            "compute_finish_resize"] == [e["event"] for e in events]
    assert all(e["result"] == "Success" for e in events)


def instance_events(servers, server_id: str, action: str) -> list[dict[str, Any]]:
    api = servers.api("admin")
    actions = api.get(f"/servers/{server_id}/os-instance-actions").json()["instanceActions"]
    [wanted] = [a for a in actions if a["action"] == action]
    detail = api.get(f"/servers/{server_id}/os-instance-actions/{wanted['request_id']}").json()
    return sorted(detail["instanceAction"]["events"], key=lambda e: e["start_time"])


def test_resize_then_revert_restores_the_old_flavor_on_the_source(local_stack, servers, records, boot):
    server, digest = boot(TINY)
    source = host_of(server)
    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    dest = host_of(resized)

    response = servers.action(server["id"], {"revertResize": None})
    assert response.status_code == 202, response.text
    reverted = servers.wait_for_status(server["id"], "ACTIVE")

    assert host_of(reverted) == source and reverted["flavor"]["original_name"] == "ferry.tiny"
    assert reverted["OS-EXT-STS:power_state"] == 1
    assert_lives_only_on(local_stack, records, server["id"], source, TINY)
    assert not records.instance_dir(dest, server["id"]).exists()
    root = records.instance_dir(source, server["id"]) / "disk"
    assert root_digest(root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    [migration] = migrations_of(server["id"], cell_of(local_stack, source))
    assert migration.status == "reverted" and not records.consumer_exists(migration.uuid)


@pytest.mark.parametrize("finish", ["confirmResize", "revertResize"])
def test_a_stopped_server_stays_shut_off_through_resize(local_stack, servers, records, boot, finish):
    server, _ = boot(TINY)
    assert servers.action(server["id"], {"os-stop": None}).status_code == 202
    servers.wait_for_status(server["id"], "SHUTOFF")

    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    assert resized["OS-EXT-STS:power_state"] == 4

    assert servers.action(server["id"], {finish: None}).status_code in (202, 204)
    done = servers.wait_for_status(server["id"], "SHUTOFF")
    assert done["OS-EXT-STS:power_state"] == 4
    expected_host, flavor = (host_of(resized), SMALL) if finish == "confirmResize" else (host_of(server), TINY)
    assert host_of(done) == expected_host
    assert_lives_only_on(local_stack, records, server["id"], expected_host, flavor)


def test_cold_migrate_changes_host_and_revert_restores_it(local_stack, servers, records, boot):
    server, digest = boot(TINY)
    source = host_of(server)

    migrated = resize_to_verify(servers, server["id"], {"migrate": None}, identity="admin")
    assert host_of(migrated) != source and migrated["flavor"]["original_name"] == "ferry.tiny"
    [migration] = migrations_of(server["id"], cell_of(local_stack, source))
    assert migration.migration_type == "migration"

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    reverted = servers.wait_for_status(server["id"], "ACTIVE")
    assert host_of(reverted) == source
    assert_lives_only_on(local_stack, records, server["id"], source, TINY)


def test_migrate_to_a_named_host_lands_there(local_stack, servers, records, boot):
    server, _ = boot(TINY)
    source = host_of(server)
    [target] = [h for h, c in local_stack.hosts.items() if c == cell_of(local_stack, source) and h != source]
    admin = servers.api("admin")

    response = admin.post(f"/servers/{server['id']}/action", json={"migrate": {"host": target}},
                          headers={"OpenStack-API-Version": "compute 2.56"})
    assert response.status_code == 202, response.text
    migrated = servers.wait_for_status(server["id"], "VERIFY_RESIZE", timeout=120)
    assert host_of(migrated) == target

    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    servers.wait_for_status(server["id"], "ACTIVE")
    assert_lives_only_on(local_stack, records, server["id"], target, TINY)


def test_swap_is_recreated_not_copied_on_migrate(local_stack, servers, records, boot):
    server, _ = boot(LARGE)
    source = host_of(server)
    swap = records.instance_dir(source, server["id"]) / "disk.swap"
    with open(swap, "r+b") as f:  # what the guest wrote to swap must not travel
        f.write(b"swapped-out page")

    migrated = resize_to_verify(servers, server["id"], {"migrate": None}, identity="admin")

    new_swap = records.instance_dir(host_of(migrated), server["id"]) / "disk.swap"
    assert new_swap.stat().st_size == 128 * 2**20
    with open(new_swap, "rb") as f:
        assert f.read(16) == b"\0" * 16
    assert (records.instance_dir(host_of(migrated), server["id"]) / "disk.eph0").exists()
    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    servers.wait_for_status(server["id"], "ACTIVE")
    assert_lives_only_on(local_stack, records, server["id"], host_of(migrated), LARGE)


def test_delete_while_verify_resize_cleans_both_hosts(local_stack, servers, records, boot):
    server, _ = boot(TINY)
    source = host_of(server)
    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    [migration] = migrations_of(server["id"], cell_of(local_stack, source))

    assert servers.delete(server["id"]).status_code == 204
    servers.wait_until_gone(server["id"])

    for host in (source, host_of(resized)):
        assert not records.instance_dir(host, server["id"]).exists()
        assert not (local_stack.instances_dir(host) / f"{server['id']}_resize").exists()
    assert records.allocations(server["id"]) == {} and not records.consumer_exists(migration.uuid)
    assert migrations_of(server["id"], cell_of(local_stack, source))[0].status == "confirmed"


def test_revert_works_after_the_old_flavor_was_deleted(local_stack, servers, records, boot):
    admin = servers.api("admin")
    created = admin.post("/flavors", json={"flavor": {"name": "e2e.doomed", "vcpus": 1, "ram": 256, "disk": 1}})
    assert created.status_code == 200, created.text
    doomed = created.json()["flavor"]["id"]
    server = servers.boot(flavor=doomed)
    source = host_of(server)
    resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    assert admin.delete(f"/flavors/{doomed}").status_code == 202

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    reverted = servers.wait_for_status(server["id"], "ACTIVE")

    assert host_of(reverted) == source and reverted["flavor"]["original_name"] == "e2e.doomed"
    assert records.allocations(server["id"]) == {records.provider(source): FLAVORS[TINY]}


def test_a_volume_attached_while_resized_survives_revert(local_stack, servers, records, boot):
    server, _ = boot(TINY)
    source = host_of(server)
    dest = host_of(resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}}))
    volume_id = str(uuid.uuid4())
    with api_session() as session:
        session.add(Volume(id=volume_id, project_id=local_stack.seeded.identities["demo"].project_id,
                           size_gb=1, path=str(local_stack.state_dir / "volumes" / volume_id)))

    attach = servers.api("demo").post(f"/servers/{server['id']}/os-volume_attachments",
                                      json={"volumeAttachment": {"volumeId": volume_id}})
    assert attach.status_code == 200, attach.text
    local_stack.wait_for(lambda: attachment_hosts(server["id"], volume_id) == {dest})
    servers.wait_for_status(server["id"], "VERIFY_RESIZE")

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    servers.wait_for_status(server["id"], "ACTIVE")

    assert attachment_hosts(server["id"], volume_id) == {source}
    shown = servers.show(server["id"])
    assert volume_id in [v["id"] for v in shown["os-extended-volumes:volumes_attached"]]


def attachment_hosts(server_id: str, volume_id: str) -> set[str]:
    with api_session() as session:
        return set(session.scalars(select(VolumeAttachment.host).where(
            VolumeAttachment.instance_uuid == server_id, VolumeAttachment.volume_id == volume_id,
            VolumeAttachment.status == "attached")))


def test_volume_backed_server_resizes_and_reverts(local_stack, servers, records):
    server = servers.boot(flavor=TINY, imageRef="", block_device_mapping_v2=[{
        "source_type": "image", "destination_type": "volume", "uuid": local_stack.seeded.image["id"],
        "boot_index": 0, "volume_size": 1, "delete_on_termination": True}])
    source = host_of(server)

    resized = resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    assert records.allocations(server["id"]) == {
        records.provider(host_of(resized)): {"VCPU": 1, "MEMORY_MB": 512}}

    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    reverted = servers.wait_for_status(server["id"], "ACTIVE")
    assert host_of(reverted) == source
    assert records.allocations(server["id"]) == {records.provider(source): {"VCPU": 1, "MEMORY_MB": 256}}


def test_a_volume_backed_server_deleted_while_resized_takes_its_new_volume_along(local_stack, servers):
    # GIVEN a server booted from a new volume deleted with it, in VERIFY_RESIZE
    server = servers.boot(flavor=TINY, imageRef="", block_device_mapping_v2=[{
        "source_type": "image", "destination_type": "volume", "uuid": local_stack.seeded.image["id"],
        "boot_index": 0, "volume_size": 1, "delete_on_termination": True}])
    [attached] = server["os-extended-volumes:volumes_attached"]
    with api_session() as session:
        path = Path(session.get(Volume, attached["id"]).path)
    assert path.is_file()
    resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})

    # WHEN it is deleted
    assert servers.delete(server["id"]).status_code == 204
    servers.wait_until_gone(server["id"])

    # THEN its volume is gone, record and file
    with api_session() as session:
        assert session.get(Volume, attached["id"]) is None
        assert session.scalars(select(VolumeAttachment).where(
            VolumeAttachment.volume_id == attached["id"])).first() is None
    assert not path.exists()


def test_a_server_deleted_while_its_host_was_down_is_destroyed_there_once_the_host_reports(
        local_stack, servers, records):
    # GIVEN a server on a host forced down: its delete only releases its records (the local delete)
    server = servers.boot(flavor=TINY)
    host = host_of(server)
    admin = local_stack.session("admin")
    [service] = [s for s in compute_services(admin) if s["host"] == host]

    def force_down(down: bool) -> None:
        changed = admin.put(f"/os-services/{service['id']}", json={"forced_down": down},
                            headers=SERVICES_MICROVERSION)
        assert changed.status_code == 200, changed.text

    force_down(True)
    try:
        assert servers.delete(server["id"]).status_code == 204
        servers.wait_until_gone(server["id"])

        # WHEN the host reports its guests again, THEN it is told to destroy the deleted server's
        # (no workflow did: the only destroy is the reap's)
        local_stack.wait_for(lambda: "succeeded" in reaps(local_stack, host, server["id"]), timeout=60)
        operations = [op for op, _ in records.host_operations(host, server["id"])]
        assert operations[0] == "spawn" and set(operations[1:]) == {"destroy"}
        assert len(operations) - 1 == len(reaps(local_stack, host, server["id"]))
        assert not records.instance_dir(host, server["id"]).exists()
        local_stack.wait_for(lambda: not still_reported(cell_of(local_stack, host), host, server["id"]), timeout=60)
    finally:
        force_down(False)


def reaps(local_stack, host: str, instance_uuid: str) -> list[str]:
    """The statuses of the destroys ``host``'s agent journaled for the instance as reaps."""
    import sqlite3
    from contextlib import closing

    journal = local_stack.host_state_dir(host) / "journal.sqlite"
    with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as conn:
        return [status for (status,) in conn.execute(
            "SELECT status FROM operations WHERE instance_uuid = ? AND operation = 'destroy' "
            "AND operation_id LIKE 'reap/%'", (instance_uuid,))]


def still_reported(cell: str, host: str, instance_uuid: str) -> bool:
    """Whether ``host``'s last report lists a guest or an instance directory of the instance."""
    with cell_session(cell) as session:
        view = hosts.host_view(session.scalars(select(Service).where(Service.host == host)).one()) or {}
    return instance_uuid in view.get("guests", []) or any(
        name.startswith(instance_uuid) for name in view.get("instance_dirs") or [])


# --- refusals: nothing changes ----------------------------------------------------------------------


def test_bad_resize_requests_are_refused_and_change_nothing(local_stack, servers, records, boot):
    server, _ = boot(TINY)
    cell = cell_of(local_stack, host_of(server))

    assert servers.action(server["id"], {"resize": {"flavorRef": "no-such-flavor"}}).status_code == 400
    assert servers.action(server["id"], {"resize": {"flavorRef": None}}).status_code == 400
    assert servers.action(server["id"], {"resize": {"flavorRef": TINY}}).status_code == 400
    assert servers.action(server["id"], {"resize": {"flavorRef": SMALL, "extra": 1}}).status_code == 400
    assert servers.action("00000000-0000-4000-8000-000000000000", {"resize": {"flavorRef": SMALL}}).status_code == 404
    assert servers.action(server["id"], {"confirmResize": None}).status_code == 400
    assert servers.action(server["id"], {"migrate": None}).status_code == 403  # admin only
    assert servers.action(server["id"], {"resize": {"flavorRef": SMALL}}, identity="alt").status_code == 404

    assert migrations_of(server["id"], cell) == []
    shown = servers.show(server["id"])
    assert (shown["status"], shown["OS-EXT-STS:task_state"]) == ("ACTIVE", None)
    assert records.allocations(server["id"]) == {records.provider(host_of(server)): FLAVORS[TINY]}


def test_a_busy_server_refuses_a_second_move(local_stack, servers, boot):
    server, _ = boot(TINY)

    first = servers.action(server["id"], {"resize": {"flavorRef": SMALL}})
    second = servers.action(server["id"], {"resize": {"flavorRef": MEDIUM}})

    assert first.status_code == 202 and second.status_code == 409
    servers.wait_for_status(server["id"], "VERIFY_RESIZE", timeout=120)
    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    servers.wait_for_status(server["id"], "ACTIVE")


def test_over_quota_resize_is_forbidden(local_stack, servers, boot):
    server, _ = boot(TINY)
    project = local_stack.seeded.identities["demo"].project_id
    admin = servers.api("admin")
    assert admin.put(f"/os-quota-sets/{project}", json={"quota_set": {"cores": 1}}).status_code == 200
    try:
        response = servers.action(server["id"], {"resize": {"flavorRef": MEDIUM}})
        assert response.status_code == 403, response.text
        assert "Quota exceeded for cores" in response.text
    finally:
        admin.delete(f"/os-quota-sets/{project}")
    assert servers.show(server["id"])["OS-EXT-STS:task_state"] is None


def test_os_migrations_lists_the_moves_newest_first(local_stack, servers, boot):
    server, _ = boot(TINY)
    resize_to_verify(servers, server["id"], {"resize": {"flavorRef": SMALL}})
    assert servers.action(server["id"], {"confirmResize": None}).status_code == 204
    servers.wait_for_status(server["id"], "ACTIVE")
    resize_to_verify(servers, server["id"], {"migrate": None}, identity="admin")
    assert servers.action(server["id"], {"revertResize": None}).status_code == 202
    servers.wait_for_status(server["id"], "ACTIVE")

    listed = servers.api("admin").get(f"/os-migrations?instance_uuid={server['id']}",
                                      headers={"OpenStack-API-Version": "compute 2.80"}).json()["migrations"]

    assert [(m["migration_type"], m["status"]) for m in listed] == [("migration", "reverted"),
                                                                   ("resize", "confirmed")]
    assert servers.api("admin").get(f"/servers/{server['id']}/migrations").json() == {"migrations": []}
