"""A database that does not answer for the moment: the API says so (503, Nova's serviceUnavailable)
and changes nothing; an error that is not of the moment stays a 500 naming only the request id."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import select, update
from test_api_moves import MOVE_WORKFLOWS, active_server, start_move_cloud
from test_api_servers import instance, schedule
from test_api_support import ADMIN, ALICE, call, create_server, mocked_cloud

from ferry import config
from ferry.store.api_models import CellMapping
from ferry.store.cell_models import InstanceAction, Migration
from ferry.store.db import api_session, cell_session

# Nothing listens there: a connection is refused at once, as by a database that is down.
REFUSED = "postgresql+psycopg2://ferry@127.0.0.1:1/ferry_gone"


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    for mocked in mocked_cloud(monkeypatch, tmp_path):
        yield start_move_cloud(mocked, monkeypatch)


@contextmanager
def cell_down(cell: str) -> Iterator[None]:
    """``cell``'s mapping names a database that refuses connections, until the block ends."""
    with api_session() as session:
        mapping = session.query(CellMapping).filter_by(name=cell).one()
        url = mapping.database_connection
        mapping.database_connection = REFUSED
    try:
        yield
    finally:
        with api_session() as session:
            session.execute(update(CellMapping).where(CellMapping.name == cell).values(database_connection=url))


def server_in_cell2() -> str:
    server_id = create_server(ALICE, name="far")
    schedule(server_id, "cell2", host="host3")
    return server_id


def snapshot(cloud, server_id: str) -> tuple:
    """What a request refused must leave as it was: the server, its migrations and actions, the
    workflows started."""
    row = instance(server_id, "cell2")
    with cell_session("cell2") as session:
        migrations = session.execute(select(Migration.uuid, Migration.status)).all()
        actions = session.execute(select(InstanceAction.action, InstanceAction.request_id)).all()
    return ((row.vm_state, row.task_state, row.flavor, row.new_flavor, row.host), migrations, actions,
            sum(len(cloud.executions(workflow)) for workflow in MOVE_WORKFLOWS))


def assert_unavailable(response) -> None:
    assert response.status == 503, response.body
    message = response.body["serviceUnavailable"]["message"]
    assert "does not answer for the moment" in message and "try again" in message
    assert response.header("x-openstack-request-id") in message
    assert "127.0.0.1" not in message and "psycopg" not in message


@pytest.mark.parametrize("body", [{"os-stop": None}, {"resize": {"flavorRef": "3"}}, {"migrate": None},
                                  {"confirmResize": None}])
def test_an_action_on_a_server_of_a_cell_that_does_not_answer_is_503_and_changes_nothing(cloud, body):
    server_id = server_in_cell2()
    before = snapshot(cloud, server_id)

    with cell_down("cell2"):
        answer = call("POST", f"/v2.1/servers/{server_id}/action", caller=ADMIN, body=body, version="2.90")

    assert_unavailable(answer)
    assert snapshot(cloud, server_id) == before


def test_showing_a_server_of_a_cell_that_does_not_answer_before_2_69_is_503(cloud):
    server_id = server_in_cell2()
    elsewhere = active_server()

    with cell_down("cell2"):
        assert_unavailable(call("GET", f"/v2.1/servers/{server_id}", caller=ALICE, version="2.68"))
        assert_unavailable(call("DELETE", f"/v2.1/servers/{server_id}", caller=ALICE))
        # the other cell's servers are served as ever
        assert call("GET", f"/v2.1/servers/{elsewhere}", caller=ALICE, version="2.68").status == 200


def test_an_api_database_that_does_not_answer_is_503(cloud, monkeypatch):
    monkeypatch.setenv("FERRY_API_DATABASE_URL", REFUSED)
    config.reset()

    assert_unavailable(call("GET", "/v2.1/servers/detail", caller=ALICE))
    assert_unavailable(call("GET", "/v2.1/flavors", caller=ALICE))
