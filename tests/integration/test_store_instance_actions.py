"""Instance actions on PostgreSQL under concurrency: one action per server and request however
many deliveries start it, and the checks made under a server's row lock read the row as locked."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import event, func, select, update
from sqlalchemy.orm import Session

from ferry import errors
from ferry.compute import actions, states
from ferry.store.cell_models import Instance, InstanceAction
from ferry.store.db import cell_session

pytestmark = pytest.mark.postgres

DELIVERIES = 8


def _server(task_state: str | None, request_id: str | None = None) -> str:
    """A server in cell1 with ``task_state`` (and the action of ``request_id``); its uuid."""
    with cell_session("cell1") as session:
        instance = Instance(display_name="web", project_id="demo", user_id="alice", flavor={},
                            vm_state=states.ACTIVE, task_state=task_state)
        session.add(instance)
        session.flush()
        if request_id is not None:
            actions.start_action(session, instance_uuid=instance.uuid, action=actions.RESIZE,
                                 request_id=request_id, user_id="alice", project_id="demo")
        return instance.uuid


def _set_task_state(instance_uuid: str, task_state: str | None) -> None:
    """Change the server's row in a transaction of its own (another request, committed)."""
    with cell_session("cell1") as session:
        session.execute(update(Instance).where(Instance.uuid == instance_uuid).values(task_state=task_state))


@pytest.fixture
def inserts_together():
    """Hold each session's insert of an action until every delivery has one to insert: all of
    them looked the action up and found none, as deliveries racing on separate hosts can."""
    ready = threading.Barrier(DELIVERIES, timeout=30)

    def hold(session: Session, _context: object, _instances: object) -> None:
        if any(isinstance(row, InstanceAction) for row in session.new):
            ready.wait()

    event.listen(Session, "before_flush", hold)
    yield
    event.remove(Session, "before_flush", hold)


def test_deliveries_starting_one_action_together_all_get_that_action(pg_store, inserts_together):
    # GIVEN a step delivered several times at once, each finding no action for its request
    instance_uuid = _server(states.RESIZE_PREP)

    def deliver() -> int:
        with cell_session("cell1") as session:
            action = actions.start_action(session, instance_uuid=instance_uuid, action=actions.RESIZE,
                                          request_id="req-1", user_id="alice", project_id="demo")
            actions.start_event(session, instance_uuid=instance_uuid, request_id="req-1",
                                event="compute_prep_resize")
            return action.id

    # WHEN each records it
    with ThreadPoolExecutor(DELIVERIES) as pool:
        ids = [future.result() for future in [pool.submit(deliver) for _ in range(DELIVERIES)]]

    # THEN every delivery got the one action recorded, which the request's look-ups find
    with cell_session("cell1") as session:
        count = session.scalar(select(func.count()).select_from(InstanceAction)
                               .where(InstanceAction.instance_uuid == instance_uuid))
        found = actions.find(session, instance_uuid, "req-1")
    assert count == 1
    assert found is not None and set(ids) == {found.id}


def test_taking_a_request_reads_the_server_as_locked_not_as_loaded_before(pg_store):
    # GIVEN a step's session that loaded the server while its request was in force
    instance_uuid = _server(states.RESIZE_PREP, "req-1")
    with cell_session("cell1") as session:
        loaded = session.scalars(select(Instance).where(Instance.uuid == instance_uuid)).one()
        assert loaded.task_state == states.RESIZE_PREP

        # WHEN the API undoes the request meanwhile, and the step then takes it
        _set_task_state(instance_uuid, None)

        # THEN the step sees it undone
        with pytest.raises(errors.UnexpectedTaskState):
            actions.take_request(session, instance_uuid=instance_uuid, request_id="req-1",
                                 task_states=(states.RESIZE_PREP,), event="compute_prep_resize")
        assert loaded.task_state is None


def test_locking_a_server_refreshes_the_server_the_session_loaded_before(pg_store):
    # GIVEN a session that loaded the server
    instance_uuid = _server(states.RESIZE_REVERTING)
    with cell_session("cell1") as session:
        loaded = session.scalars(select(Instance).where(Instance.uuid == instance_uuid)).one()

        # WHEN another request changes it, and the session takes its row lock
        _set_task_state(instance_uuid, states.RESIZE_CONFIRMING)
        actions.lock_server(session, instance_uuid)

        # THEN the server has the values read under the lock
        assert loaded.task_state == states.RESIZE_CONFIRMING
