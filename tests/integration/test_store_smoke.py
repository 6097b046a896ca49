from ferry.store.db import all_cells


def test_store_maps_cell0_and_two_cells(store):
    assert [c.name for c in all_cells()] == ["cell0", "cell1", "cell2"]
    assert [c.name for c in all_cells(include_cell0=False)] == ["cell1", "cell2"]
