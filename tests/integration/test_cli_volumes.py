"""``ferry volume``: volumes registered, listed and forgotten by an operator, with nothing left half-made."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from ferry import cli, cli_volumes, config, protocol
from ferry import volumes as volumes_module
from ferry.store import db, setup
from ferry.store.api_models import Volume, VolumeAttachment
from ferry.store.db import api_session

GiB = 1024**3


@pytest.fixture
def deployment(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("FERRY_API_DATABASE_URL", f"sqlite:///{tmp_path / 'api.sqlite'}")
    config.reset()
    setup.init_api_database()
    (tmp_path / "shared").mkdir()
    umask = os.umask(0o027)  # a strict one: a new volume's file is 0660 all the same
    yield tmp_path
    os.umask(umask)
    db.dispose_all()
    config.reset()


def volumes() -> list[Volume]:
    with api_session() as session:
        return list(session.scalars(select(Volume).order_by(Volume.created_at)))


def test_a_new_file_backed_volume_is_made_recorded_listed_and_forgotten(deployment, capsys):
    shared = deployment / "shared"

    assert cli.main(["volume", "register", "--project", "demo", "--size-gb", "2", "--new-file-in", str(shared),
                     "--name", "data"]) == 0

    [volume] = volumes()
    path = shared / volume.id
    assert (volume.project_id, volume.size_gb, volume.name, volume.status, volume.path) == (
        "demo", 2, "data", "available", str(path))
    assert path.stat().st_size == 2 * GiB and path.stat().st_blocks == 0  # sparse: nothing written
    assert stat.S_IMODE(path.stat().st_mode) == 0o660  # whatever the umask
    assert (shared / protocol.VOLUME_DIR_MARKER).is_file()  # as the hosts mark the directories they write in
    assert f"volume {volume.id}: 2 GiB at {path}" in capsys.readouterr().out

    assert cli.main(["volume", "list", "--project", "demo"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "\t".join(
        (volume.id, "available", "2", "demo", "data", str(path), "-"))

    assert cli.main(["volume", "forget", volume.id]) == 0
    assert volumes() == [] and path.exists()  # the storage is the operator's to remove
    assert f"what is at {path} is left in place" in capsys.readouterr().out


def test_existing_storage_is_recorded_once(deployment, capsys):
    args = ["volume", "register", "--project", "demo", "--size-gb", "1", "--path", "/dev/mapper/vol-a"]
    assert cli.main(args) == 0
    capsys.readouterr()

    assert cli.main(args) == 1
    assert cli.main([*args[:-1], "//dev/mapper/../mapper/./vol-a"]) == 1  # the same path, written otherwise

    assert [v.path for v in volumes()] == ["/dev/mapper/vol-a"]
    assert "is recorded at /dev/mapper/vol-a already" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--path", "relative/vol"], "is not absolute"),
    (["--path", "/dev/vol", "--name", " padded"], "printable"),
    (["--path", "/dev/vol", "--project", " "], "belongs to a project"),
    (["--new-file-in", "/no/such/directory"], "no absolute path of a directory"),
])
def test_bad_input_is_refused_and_leaves_nothing(deployment, capsys, args, message):
    base = ["volume", "register", "--project", "demo", "--size-gb", "1"]
    if "--project" in args:
        base = ["volume", "register", "--size-gb", "1"]

    assert cli.main([*base, *args]) == 1

    assert message in capsys.readouterr().err
    assert volumes() == []


def test_a_file_made_for_a_volume_that_is_refused_is_removed(deployment, capsys):
    shared = deployment / "shared"

    assert cli.main(["volume", "register", "--project", "demo", "--size-gb", "1", "--new-file-in", str(shared),
                     "--name", "bad\u200bname"]) == 1

    assert volumes() == [] and os.listdir(shared) == []


@pytest.mark.parametrize("size", ["0", "1.5", "x", "10000000000"])
def test_a_size_that_is_no_whole_number_of_gib_is_a_usage_error(deployment, capsys, size):
    with pytest.raises(SystemExit) as exited:
        cli.main(["volume", "register", "--project", "demo", "--size-gb", size, "--path", "/dev/vol"])
    assert exited.value.code == 2
    assert volumes() == []


@pytest.mark.parametrize("status, attached, forgotten", [
    ("available", False, True),
    ("deleting", False, True),
    ("error_detaching", False, False),
    ("in-use", True, False),
    ("reserved", True, False),
    ("available", True, False),  # an attachment holds it, whatever its status says
    ("detaching", False, False),
])
def test_only_a_volume_nothing_holds_is_forgotten(deployment, capsys, status, attached, forgotten):
    with api_session() as session:
        volume = Volume(project_id="demo", size_gb=1, path="/dev/mapper/vol-b", status=status)
        session.add(volume)
        session.flush()
        volume_id = volume.id
        if attached:
            session.add(VolumeAttachment(volume_id=volume_id, instance_uuid="a-server", host="h1"))

    assert cli.main(["volume", "forget", volume_id]) == (0 if forgotten else 1)

    assert (volumes() == []) is forgotten
    if not forgotten:
        assert "not forgotten" in capsys.readouterr().err


def test_forgetting_an_unknown_volume_is_refused(deployment, capsys):
    assert cli.main(["volume", "forget", "no-such-volume"]) == 1
    assert "could not be found" in capsys.readouterr().err


def test_the_list_names_the_servers_holding_a_volume_and_filters_by_status(deployment, capsys):
    with api_session() as session:
        held = Volume(project_id="demo", size_gb=1, path="/dev/mapper/held", status="in-use")
        left = Volume(project_id="other", size_gb=3, path="/srv/left", status="deleting")
        session.add_all([held, left])
        session.flush()
        session.add(VolumeAttachment(volume_id=held.id, instance_uuid="server-1", host="h1"))
        session.add(VolumeAttachment(volume_id=held.id, instance_uuid="server-1", host="h2"))
        held_id, left_id = held.id, left.id

    assert cli.main(["volume", "list"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()[1:]]
    assert {row[0]: row[6] for row in rows} == {held_id: "server-1", left_id: "-"}

    assert cli.main(["volume", "list", "--status", "deleting"]) == 0
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()[1:]] == [left_id]


@pytest.mark.parametrize("status", ["bogus", "in_use", "Available", ""])
def test_listing_by_a_status_no_volume_can_have_is_a_usage_error(deployment, capsys, status):
    with pytest.raises(SystemExit) as exited:
        cli.main(["volume", "list", "--status", status])

    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_every_status_a_volume_can_have_can_be_listed(deployment, capsys):
    for status in cli_volumes.STATUSES:
        assert cli.main(["volume", "list", "--status", status]) == 0
    assert set(cli_volumes.STATUSES) == {volumes_module.AVAILABLE, volumes_module.RESERVED, volumes_module.ATTACHING,
                                         volumes_module.IN_USE, volumes_module.DETACHING,
                                         volumes_module.ERROR_DETACHING, volumes_module.DELETING}


def test_a_file_that_cannot_be_sized_is_removed_and_nothing_recorded(deployment, capsys, monkeypatch):
    shared = deployment / "shared"

    def no_space(fd, length):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(os, "ftruncate", no_space)
        refused = cli.main(["volume", "register", "--project", "demo", "--size-gb", "1", "--new-file-in",
                            str(shared)])

    assert refused == 1 and "No space left on device" in capsys.readouterr().err
    assert volumes() == [] and os.listdir(shared) == []
