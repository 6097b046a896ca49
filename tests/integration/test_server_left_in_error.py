"""``ServerLeftInError``: counted once by the run of a failed move's rollback that puts the server in ERROR.

The steps run as ``test_resize_steps`` and ``test_cross_cell_steps`` run them; the revert's and the
delete's failures are counted in ``test_revert_resize_steps`` and ``test_delete_resized_steps``.
"""

from __future__ import annotations

import pytest
from test_cross_cell_steps import run as run_across_cells
from test_cross_cell_steps import server_in_cell1, two_cells  # noqa: F401 - the two_cells fixture
from test_resize_steps import (  # noqa: F401 - the cloud fixture
    BIG,
    SOURCE,
    cloud,
    fail_and_roll_back,
    host_result,
    instance,
    make_server,
    prepare_move,
    run,
)

from ferry.compute import states
from ferry.observability import metrics
from ferry.workflows import cross_cell, resize

METRIC = "ServerLeftInError"


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the metrics the steps add, in order."""
    names: list[str] = []
    monkeypatch.setattr(metrics, "add_metric", lambda **metric: names.append(metric["name"]))
    return names


def test_a_rollback_that_cannot_restore_the_source_counts_the_server_left_in_error_once(cloud, counted):  # noqa: F811 - the fixture imported above
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="FinishResizeOnDestHost")

    doc = fail_and_roll_back(doc, restore_error={"Error": "Ferry.HypervisorError", "Cause": "no disks"})
    resize.rollback_move(doc)  # run again: it finds the rollback done

    assert instance(uuid).vm_state == states.ERROR
    assert counted.count(METRIC) == 1


def test_a_rollback_that_leaves_a_guest_on_the_destination_counts_the_server_left_in_error_once(cloud, counted):  # noqa: F811 - the fixture imported above
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="FinishResizeOnDestHost")

    doc = fail_and_roll_back(doc, cleanup_error={"Error": "States.Timeout", "Cause": ""},
                             restored=host_result(doc, SOURCE, states.SHUTDOWN))
    resize.rollback_move(doc)

    assert instance(uuid).vm_state == states.ERROR
    assert counted.count(METRIC) == 1


@pytest.mark.parametrize("stage", ["PrepResizeOnDestHost", "ResizeInstanceOnSourceHost", "MarkResized"])
def test_a_rollback_that_restores_the_server_counts_nothing(cloud, counted, stage):  # noqa: F811 - the fixture imported above
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until=stage)

    fail_and_roll_back(doc)

    assert instance(uuid).vm_state == states.ACTIVE
    assert METRIC not in counted


def test_a_move_across_cells_whose_target_may_still_run_the_guest_counts_the_server_left_in_error_once(
        two_cells, counted):  # noqa: F811 - the fixture imported above
    uuid, inp = server_in_cell1()
    doc = run_across_cells(inp, until="CompleteMoveAcrossCells")
    doc = {**doc, "error": {"Error": "Ferry.HypervisorError", "Cause": "it broke"},
           "cleanup_error": {"Error": "States.Timeout", "Cause": ""},
           "restored": host_result(doc, doc["move"]["source"]["host"], states.SHUTDOWN)}

    for _ in range(2):
        cross_cell.rollback_target_cell(doc)
        resize.rollback_move(doc)

    assert instance(uuid).vm_state == states.ERROR
    assert counted.count(METRIC) == 1
