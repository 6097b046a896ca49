"""The Block Storage volume look-ups (``/volume/v3``) through the real handler (SQLite and PostgreSQL)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlalchemy import select
from test_api_support import ADMIN, ALICE, BASE_URL, BOB, call, mocked_cloud

from ferry import config
from ferry.compute import instances
from ferry.store.api_models import CellMapping, InstanceMapping, Volume, VolumeAttachment
from ferry.store.cell_models import Instance
from ferry.store.db import api_session, cell_session

SERVER = "5a1e0000-0000-4000-8000-000000000001"
DATA, BOOT, OLD, BOBS = (f"7d2c3a52-0000-4000-8000-00000000000{n}" for n in range(1, 5))


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


@pytest.fixture
def volumes(cloud):
    """Alice's ``data`` (in use: attached on host-1, and on host-2 where its server has just been
    resized to, with a third attachment still reserved), ``boot`` (from an image, in use) and
    ``old`` (available, the oldest); Bob's ``bobs``."""
    start = dt.datetime(2026, 1, 1)
    with api_session() as session:
        for offset, (volume_id, name, project, status, image) in enumerate([
                (OLD, "old", "project-a", "available", None), (BOBS, "bobs", "project-b", "available", None),
                (BOOT, "boot", "project-a", "in-use", "image-1"), (DATA, "data", "project-a", "in-use", None)]):
            session.add(Volume(id=volume_id, name=name, project_id=project, size_gb=offset + 1, status=status,
                               image_id=image, path=f"/volumes/{volume_id}",
                               created_at=start + dt.timedelta(minutes=offset)))
        session.flush()
        session.add(VolumeAttachment(id="att-1", volume_id=DATA, instance_uuid=SERVER, host="host-1", device="vdd",
                                     status="attached", created_at=start))
        session.add(VolumeAttachment(id="att-2", volume_id=DATA, instance_uuid=SERVER, host="host-2", device="vdd",
                                     status="attached", created_at=start + dt.timedelta(hours=1),
                                     updated_at=start + dt.timedelta(hours=2)))
        session.add(VolumeAttachment(id="att-4", volume_id=DATA, instance_uuid=SERVER, host="host-3", device="vdd",
                                     status="reserved", created_at=start + dt.timedelta(hours=3)))
        session.add(VolumeAttachment(id="att-3", volume_id=BOOT, instance_uuid=SERVER, host="host-1", device="vda",
                                     status="attached", created_at=start))


def _ids(response) -> list[str]:
    assert response.status == 200, response.body
    return [v["id"] for v in response.body["volumes"]]


def test_the_version_document_needs_no_token_and_names_the_version(cloud):
    response = call("GET", "/volume/v3", caller=None)

    assert response.status == 200
    assert response.body == {"version": {"id": "v3.0", "status": "CURRENT", "version": "3.0", "min_version": "3.0",
                                         "links": [{"rel": "self", "href": f"{BASE_URL}/volume/v3"}]}}
    assert response.header("OpenStack-API-Version") == "volume 3.0"


def test_a_member_lists_her_projects_volumes_newest_first(volumes):
    assert _ids(call("GET", "/volume/v3/volumes/detail", caller=ALICE)) == [DATA, BOOT, OLD]
    assert _ids(call("GET", "/volume/v3/volumes", caller=BOB)) == [BOBS]
    # all_tenants and project_id are an admin's: a member's list stays her own
    assert _ids(call("GET", "/volume/v3/volumes", caller=BOB, query={"all_tenants": "1"})) == [BOBS]
    assert _ids(call("GET", "/volume/v3/volumes", caller=BOB, query={"project_id": "project-a"})) == [BOBS]
    assert _ids(call("GET", "/volume/v3/volumes", caller=BOB,
                     query={"all_tenants": "1", "project_id": "project-a"})) == [BOBS]
    summary = call("GET", "/volume/v3/volumes", caller=BOB).body["volumes"][0]
    assert summary == {"id": BOBS, "name": "bobs", "links": [
        {"rel": "self", "href": f"{BASE_URL}/volume/v3/volumes/{BOBS}"},
        {"rel": "bookmark", "href": f"{BASE_URL}/volume/volumes/{BOBS}"}]}


def test_an_admin_lists_her_own_project_unless_she_asks_for_all(volumes):
    assert _ids(call("GET", "/volume/v3/volumes/detail", caller=ADMIN)) == []
    assert _ids(call("GET", "/volume/v3/volumes/detail", caller=ADMIN, query={"all_tenants": "True"})) == [
        DATA, BOOT, BOBS, OLD]
    assert _ids(call("GET", "/volume/v3/volumes/detail", caller=ADMIN,
                     query={"all_tenants": "1", "project_id": "project-b"})) == [BOBS]


def test_the_list_filters_by_name_status_bootable_and_metadata(volumes):
    def listed(**query: str) -> list[str]:
        return _ids(call("GET", "/volume/v3/volumes/detail", caller=ALICE, query=query))

    assert listed(name="old") == [OLD]
    assert listed(status="in-use") == [DATA, BOOT]
    assert listed(name="bobs") == []
    # Ferry boots from any volume, so all are bootable; it keeps no volume metadata
    assert listed(bootable="true") == [DATA, BOOT, OLD]
    assert listed(bootable="false") == []
    assert listed(metadata="{}") == [DATA, BOOT, OLD]
    assert listed(metadata="{'tier': 'gold'}") == []
    assert call("GET", "/volume/v3/volumes", caller=ALICE, query={"metadata": "tier=gold"}).status == 400


def test_unknown_filters_and_bad_values_are_refused(volumes):
    refused = call("GET", "/volume/v3/volumes/detail", caller=ALICE, query={"created_at": "x", "user_id": "alice"})
    assert refused.status == 400
    assert refused.body["badRequest"]["message"] == "Invalid filters created_at, user_id are found in query options."
    assert call("GET", "/volume/v3/volumes", caller=ALICE, query={"bootable": "maybe"}).status == 400
    assert call("GET", "/volume/v3/volumes", caller=ALICE, query={"limit": "-1"}).status == 400
    assert call("GET", "/volume/v3/volumes", caller=ADMIN, query={"all_tenants": "perhaps"}).status == 400


def test_the_list_pages_with_limit_and_marker(volumes):
    first = call("GET", "/volume/v3/volumes/detail", caller=ALICE, query={"limit": "2", "name": ["old", "x"]})
    assert _ids(first) == []  # the last name wins, as with every repeated parameter
    first = call("GET", "/volume/v3/volumes/detail", caller=ALICE, query={"limit": "2"})
    assert _ids(first) == [DATA, BOOT]
    [link] = first.body["volumes_links"]
    assert link == {"rel": "next", "href": f"{BASE_URL}/volume/v3/volumes/detail?limit=2&marker={BOOT}"}

    second = call("GET", "/volume/v3/volumes/detail", caller=ALICE, query={"limit": "2", "marker": BOOT})
    assert _ids(second) == [OLD]
    assert "volumes_links" not in second.body

    # a marker that no longer passes the filters still marks its place
    assert _ids(call("GET", "/volume/v3/volumes", caller=ALICE, query={"marker": DATA, "status": "available"})) \
        == [OLD]
    missing = call("GET", "/volume/v3/volumes", caller=ALICE, query={"marker": BOBS})  # another project's
    assert missing.status == 404
    assert missing.body["itemNotFound"]["message"] == f"Marker {BOBS} could not be found."


def test_show_gives_cinders_shape_with_the_attachments_in_place(volumes):
    response = call("GET", f"/volume/v3/volumes/{DATA}", caller=ALICE)

    assert response.status == 200
    assert response.header("OpenStack-API-Version") == "volume 3.0"
    volume = response.body["volume"]
    assert {k: volume[k] for k in ("id", "name", "status", "size", "bootable", "availability_zone", "volume_type",
                                   "multiattach", "encrypted", "metadata")} == {
        "id": DATA, "name": "data", "status": "in-use", "size": 4, "bootable": "true", "availability_zone": "nova",
        "volume_type": "__DEFAULT__", "multiattach": False, "encrypted": False, "metadata": {}}
    # one attachment per server, the newest in place (the server's host after a resize); a
    # member is not told the host
    assert volume["attachments"] == [{"id": DATA, "attachment_id": "att-2", "volume_id": DATA, "server_id": SERVER,
                                      "host_name": None, "device": "/dev/vdd",
                                      "attached_at": "2026-01-01T02:00:00.000000"}]
    assert volume["created_at"] == "2026-01-01T00:03:00.000000"
    assert "os-vol-tenant-attr:tenant_id" not in volume
    as_admin = call("GET", f"/volume/v3/volumes/{DATA}", caller=ADMIN).body["volume"]
    assert [a["host_name"] for a in as_admin["attachments"]] == ["host-2"]

    boot = call("GET", f"/volume/v3/volumes/{BOOT}", caller=ADMIN).body["volume"]
    assert boot["bootable"] == "true" and boot["volume_image_metadata"] == {"image_id": "image-1"}
    assert boot["os-vol-tenant-attr:tenant_id"] == "project-a"
    assert "volume_image_metadata" not in call("GET", f"/volume/v3/volumes/{OLD}", caller=ALICE).body["volume"]


def test_another_projects_volume_is_not_found(volumes):
    assert call("GET", f"/volume/v3/volumes/{BOBS}", caller=ALICE).status == 404
    missing = call("GET", "/volume/v3/volumes/no-such-volume", caller=ALICE)
    assert missing.status == 404
    assert missing.body["itemNotFound"]["message"] == "Volume no-such-volume could not be found."


@pytest.mark.parametrize(("header", "status", "answered"), [
    ("volume 3.0", 200, "volume 3.0"),
    ("volume latest", 200, "volume 3.0"),
    ("compute 2.96", 200, "volume 3.0"),  # another service's version is not this one's
    ("volume 3.1", 406, None),
    ("volume three", 400, None),
])
def test_the_volume_microversion_is_negotiated(volumes, header, status, answered):
    response = call("GET", "/volume/v3/volumes", caller=ALICE, headers={"OpenStack-API-Version": header})

    assert response.status == status, response.body
    if answered:
        assert response.header("OpenStack-API-Version") == answered
        assert response.header("X-OpenStack-Nova-API-Version") is None


def test_the_policy_file_can_close_the_look_ups(volumes, tmp_path, monkeypatch):
    rules = tmp_path / "policy.yaml"
    rules.write_text('"volume:get_all": "admin"\n"volume:get": "!"\n')
    monkeypatch.setenv("FERRY_POLICY_FILE", str(rules))
    config.reset()

    assert call("GET", "/volume/v3/volumes", caller=ALICE).status == 403
    assert call("GET", "/volume/v3/volumes", caller=ADMIN).status == 200
    assert call("GET", f"/volume/v3/volumes/{DATA}", caller=ADMIN).status == 403


def test_methods_other_than_get_are_not_found(volumes):
    response = call("POST", "/volume/v3/volumes", caller=ALICE, body={"volume": {"size": 1}})

    assert response.status == 404
    assert "itemNotFound" in response.body


def test_the_attachment_shown_is_the_one_on_the_servers_host(volumes):
    # GIVEN the server is on host-1, the older of its two attachments (a volume attached while the
    # server waited in VERIFY_RESIZE on host-1 also gets one, newer, on the source host-2)
    with api_session() as session:
        cell1 = session.scalars(select(CellMapping.id).where(CellMapping.name == "cell1")).one()
        session.add(InstanceMapping(instance_uuid=SERVER, cell_id=cell1, project_id="project-a", user_id="alice"))
    with cell_session("cell1") as session:
        session.add(Instance(uuid=SERVER, display_name="vm", project_id="project-a", user_id="alice",
                             flavor={}, vm_state="resized", host="host-1", node="host-1"))

    shown = call("GET", f"/volume/v3/volumes/{DATA}", caller=ADMIN).body["volume"]

    assert [(a["attachment_id"], a["host_name"]) for a in shown["attachments"]] == [("att-1", "host-1")]


def test_the_hosts_of_servers_in_several_cells_are_read_once_per_cell(cloud, monkeypatch):
    # GIVEN servers in cell1 and cell2, one hidden copy, one deleted, one still being scheduled
    servers = {name: str(uuid.uuid4()) for name in ("one", "two", "gone", "unscheduled")}
    with api_session() as session:
        cells = {c.name: c.id for c in session.scalars(select(CellMapping))}
        for name, cell in (("one", "cell1"), ("two", "cell2"), ("gone", "cell1")):
            session.add(InstanceMapping(instance_uuid=servers[name], cell_id=cells[cell], project_id="project-a",
                                        user_id="alice"))
        session.add(InstanceMapping(instance_uuid=servers["unscheduled"], project_id="project-a", user_id="alice"))
    for name, cell, host, hidden, deleted in (("one", "cell1", "host-1", False, False),
                                              ("two", "cell2", "host-2", False, False),
                                              ("two", "cell1", "host-old", True, False),
                                              ("gone", "cell1", "host-1", False, True)):
        with cell_session(cell) as session:
            session.add(Instance(uuid=servers[name], display_name=name, project_id="project-a", user_id="alice",
                                 flavor={}, host=host, node=host, hidden=hidden, deleted=deleted))
    opened: list[object] = []
    real = instances.cell_session

    def counting(cell):
        opened.append(cell.name)
        return real(cell)

    monkeypatch.setattr(instances, "cell_session", counting)

    hosts = instances.hosts_of([*servers.values(), servers["one"]])

    assert hosts == {servers["one"]: "host-1", servers["two"]: "host-2", servers["gone"]: None,
                     servers["unscheduled"]: None}
    assert sorted(opened) == ["cell1", "cell2"]
