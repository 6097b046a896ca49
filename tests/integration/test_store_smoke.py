from ferry.store.db import all_cells
def test_cells(store):
    assert [c.name for c in all_cells()] == ["cell1", "cell2"]
