"""What a revert between cells carries back: no column a server's owner can change is forgotten."""

from __future__ import annotations

from ferry.compute import instances
from ferry.store.cell_models import BlockDeviceMapping
from ferry.workflows import cross_cell_settle


def test_a_revert_carries_every_block_device_mapping_column():
    bookkeeping = {"id", "instance_uuid", "deleted", "created_at", "updated_at"}

    assert set(cross_cell_settle._BDM_COLUMNS) == {c.key for c in BlockDeviceMapping.__table__.columns} - bookkeeping


def test_a_revert_carries_what_an_update_can_change():
    assert set(instances.UPDATABLE.values()) <= set(cross_cell_settle._CARRIED_COLUMNS)
