"""What a move announces on the notification bus when it is refused, fails, or runs a step twice.

Every ``instance.resize_prep.start`` has its ``.end`` from the same publisher (a destination that
refuses the claim, a prep that fails); a cross-cell move whose last step failed after the switch
still announces ``instance.resize_finish.end``; and every copy of one event carries the same
``message_id``, so consumers can drop the repeats. The steps run as ``test_resize_steps`` and
``test_cross_cell_steps`` run them (moto for the queues, the image bucket and the bus).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from sqlalchemy import update
from test_cross_cell_steps import (  # noqa: F401 - the two_cells fixture
    TARGET_HOST,
    complete_move_failing_at,
    roll_back,
    server_in_cell1,
    two_cells,
)
from test_cross_cell_steps import run as run_across_cells
from test_resize_steps import (  # noqa: F401 - the cloud fixture
    BIG,
    CLAIM_REFUSED,
    SOURCE,
    STAGES,
    cloud,
    fail_and_roll_back,
    host_result,
    make_server,
    prepare_move,
    report,
    run,
)

from ferry import errors, placement
from ferry.compute import migration_states, states
from ferry.store.cell_models import Instance, Migration
from ferry.store.db import cell_session
from ferry.workflows import cross_cell, resize

PREP_START, PREP_END = "instance.resize_prep.start", "instance.resize_prep.end"
FINISH_END = "instance.resize_finish.end"


def preps(published: list[dict[str, Any]]) -> tuple[Counter[str], Counter[str]]:
    """How many prep starts and ends each publisher sent."""
    starts = Counter(n["publisher_id"] for n in published if n["event_type"] == PREP_START)
    ends = Counter(n["publisher_id"] for n in published if n["event_type"] == PREP_END)
    return starts, ends


def test_a_destination_that_refuses_the_claim_ends_its_prep_before_the_move_goes_to_the_alternate(cloud):  # noqa: F811 - the fixture imported above
    # GIVEN a destination that refused the move's claim
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="PrepResizeOnDestHost")
    refused = doc["destination"]["host"]
    doc["error"] = dict(CLAIM_REFUSED)

    # WHEN the move is rescheduled (twice: delivered again), then goes on at the alternate
    new = resize.reschedule_move(doc)
    resize.reschedule_move(doc)
    doc = {k: v for k, v in doc.items() if k not in ("prep", "error")} | {"destination": new}
    doc["prep"] = resize.prep_resize_at_dest(doc)
    doc["claim"] = host_result(doc, new["host"], states.NOSTATE, claimed=True)
    resize.resize_instance_at_source(doc)

    # THEN each destination's prep started and ended once, the refused one's end before the alternate's start
    published = cloud.drain()
    assert preps(published) == ({f"compute:{refused}": 1, f"compute:{new['host']}": 1},
                                {f"compute:{refused}": 1, f"compute:{new['host']}": 1})
    order = [(n["event_type"], n["publisher_id"]) for n in published]
    assert order.index((PREP_END, f"compute:{refused}")) < order.index((PREP_START, f"compute:{new['host']}"))


def test_a_reschedule_that_finds_no_alternate_ends_the_refused_prep_once(cloud):  # noqa: F811 - the fixture imported above
    # GIVEN a refused claim whose alternate no longer fits: RescheduleMove fails, RollbackMove follows
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until="PrepResizeOnDestHost")
    refused = doc["destination"]["host"]
    report("cell1-host3", memory_mb=512)
    with pytest.raises(errors.NoValidHost):
        resize.reschedule_move(doc)

    fail_and_roll_back(doc, CLAIM_REFUSED["Error"], CLAIM_REFUSED["Cause"],
                       reschedule_error={"Error": "Ferry.NoValidHost", "Cause": "No valid host"})

    assert preps(cloud.drain()) == ({f"compute:{refused}": 1}, {f"compute:{refused}": 1})


@pytest.mark.parametrize("stage", STAGES[1:])
def test_a_move_that_fails_at_any_stage_ends_every_prep_it_started_once(cloud, stage):  # noqa: F811 - the fixture imported above
    # GIVEN a move failing at ``stage`` (its prep may have started, and may have ended)
    uuid = make_server()
    doc = run(prepare_move(uuid, BIG), until=stage)

    # WHEN it rolls back (twice: the rollback may run again)
    doc = fail_and_roll_back(doc)
    resize.rollback_move(doc)

    # THEN a prep that started has exactly one end, sent before the error
    published = cloud.drain()
    starts, ends = preps(published)
    assert ends == starts
    types = [n["event_type"] for n in published]
    assert types.count("instance.resize.error") == 1
    if starts:
        assert types.index(PREP_END) < types.index("instance.resize.error")


@pytest.mark.parametrize("stage", ["PrepResizeOnDestHost", "PrepResizeAtSource"])
def test_a_move_across_cells_that_fails_in_its_prep_ends_the_prep_once(two_cells, stage):  # noqa: F811 - the fixture imported above
    uuid, inp = server_in_cell1()
    doc = run_across_cells(inp, until=stage)

    roll_back(doc)
    roll_back(doc)

    assert preps(two_cells.drain()) == ({f"compute:{TARGET_HOST}": 1}, {f"compute:{TARGET_HOST}": 1})


def test_a_switch_across_cells_that_failed_before_announcing_it_still_announces_the_finish(two_cells, monkeypatch):  # noqa: F811 - the fixture imported above
    # GIVEN CompleteMoveAcrossCells switched the mapping, then failed hiding the source copy (nothing announced)
    uuid, inp = server_in_cell1()
    doc = run_across_cells(inp, until="CompleteMoveAcrossCells")
    two_cells.drain()
    complete_move_failing_at("_hide_source", doc, monkeypatch)
    assert [n for n in two_cells.drain() if n["event_type"] == FINISH_END] == []

    # WHEN its Catch finds the move committed (twice: run again)
    failed = {**doc, "error": {"Error": "Sandbox.Timedout", "Cause": "timed out"}}
    assert cross_cell.check_move_committed(failed) == {"committed": True}
    cross_cell.check_move_committed(failed)

    # THEN the finish end went out, from the destination, as the server in VERIFY_RESIZE, under one message id
    ends = [n for n in two_cells.drain() if n["event_type"] == FINISH_END]
    assert ends and {n["publisher_id"] for n in ends} == {f"compute:{TARGET_HOST}"}
    assert len({n["message_id"] for n in ends}) == 1
    assert ends[0]["payload"]["state"] == states.RESIZED and ends[0]["payload"]["host"] == TARGET_HOST


def test_a_settled_move_found_committed_announces_no_late_finish(two_cells, monkeypatch):  # noqa: F811 - the fixture imported above
    uuid, inp = server_in_cell1()
    doc = run_across_cells(inp, until="CompleteMoveAcrossCells")
    complete_move_failing_at("_hide_source", doc, monkeypatch)
    two_cells.drain()
    for cell in ("cell1", "cell2"):  # the owner's confirm has taken over
        with cell_session(cell) as session:
            session.execute(update(Migration).where(Migration.uuid == inp["migration_uuid"])
                            .values(status=migration_states.CONFIRMING))

    assert cross_cell.check_move_committed({**doc, "error": {"Error": "Sandbox.Timedout", "Cause": "x"}}) == {
        "committed": True}

    assert [n for n in two_cells.drain() if n["event_type"] == FINISH_END] == []


def test_every_step_run_twice_publishes_each_event_under_one_message_id_and_a_new_move_gets_new_ones(cloud):  # noqa: F811 - the fixture imported above
    # GIVEN a move whose every step ran twice
    uuid = make_server()
    inp = prepare_move(uuid, BIG)
    run(inp, twice=True)
    first = cloud.drain()

    # THEN each event's copies share their message id, and different events have different ones
    ids: dict[tuple[str, str], set[str]] = {}
    for n in first:
        ids.setdefault((n["event_type"], n["publisher_id"]), set()).add(n["message_id"])
    assert len(ids) == 6 and all(len(copies) == 1 for copies in ids.values())
    assert len({n["message_id"] for n in first}) == 6

    # WHEN the server, its move settled (as a confirm leaves it), moves again with a migration of its own
    placement.delete_allocations(inp["migration_uuid"])
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == uuid).values(
            vm_state=states.ACTIVE, task_state=None, old_flavor=None, new_flavor=None, old_vm_state=None))
    run(prepare_move(uuid))
    second = cloud.drain()

    # THEN its events are new ones
    assert len(second) == 6
    assert {n["message_id"] for n in first}.isdisjoint(n["message_id"] for n in second)

