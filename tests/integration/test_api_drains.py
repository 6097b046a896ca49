"""``/ferry/drains/{id}/action`` through the real API handler (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update
from test_api_support import ADMIN, add_host, call, mocked_cloud

from ferry import drains
from ferry.auth import RequestContext
from ferry.store import setup
from ferry.store.api_models import Drain, DrainServer
from ferry.store.db import api_session

OPERATOR = RequestContext(user_id=ADMIN.user_id, project_id=ADMIN.project_id, roles=ADMIN.roles)


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


def running_drain() -> str:
    """A drain of host1 whose workflow is moving servers."""
    add_host("host1")
    setup.map_host("host1", "cell1")
    drain_uuid, created = drains.record_drain(OPERATOR, {"host": "host1"}, origin="api")
    assert created
    with api_session() as session:
        session.execute(update(Drain).where(Drain.uuid == drain_uuid).values(status=drains.RUNNING))
    return drain_uuid


def status_of(drain_uuid: str) -> str:
    with api_session() as session:
        return session.scalars(select(Drain.status).where(Drain.uuid == drain_uuid)).one()


@pytest.mark.parametrize("value", [True, "now", {}, {"force": True}, [], 0])
def test_a_drain_action_with_a_value_other_than_null_is_400_and_changes_nothing(cloud, value: Any):
    drain_uuid = running_drain()

    response = call("POST", f"/v2.1/ferry/drains/{drain_uuid}/action", caller=ADMIN, body={"pause": value})

    assert response.status == 400, response.body
    assert "Invalid input for field/attribute pause" in response.body["badRequest"]["message"]
    assert 'is not of type "null"' in response.body["badRequest"]["message"]
    assert status_of(drain_uuid) == drains.RUNNING


def test_a_drain_action_with_null_is_accepted_and_answered_with_the_hosts_the_drain_disabled(cloud):
    drain_uuid = running_drain()
    with api_session() as session:  # as PlanDrain records the services it disabled
        session.execute(update(Drain).where(Drain.uuid == drain_uuid).values(disabled_hosts=["host1"]))

    response = call("POST", f"/v2.1/ferry/drains/{drain_uuid}/action", caller=ADMIN, body={"pause": None})

    assert response.status == 202, response.body
    assert response.body["drain"]["status"] == drains.PAUSED == status_of(drain_uuid)
    assert response.body["drain"]["disabled_hosts"] == ["host1"]


def test_a_drain_is_answered_as_get_shows_it_with_the_hosts_it_disabled(cloud):
    add_host("host1")
    setup.map_host("host1", "cell1")

    created = call("POST", "/v2.1/ferry/drains", caller=ADMIN, body={"drain": {"host": "host1", "dry_run": True}})

    assert created.status == 200, created.body
    shown = call("GET", f"/v2.1/ferry/drains/{created.body['drain']['id']}", caller=ADMIN).body["drain"]
    assert created.body["drain"]["disabled_hosts"] == shown["disabled_hosts"] == []
    assert set(created.body["drain"]) == set(shown)


def test_an_unknown_drain_action_is_400(cloud):
    drain_uuid = running_drain()

    response = call("POST", f"/v2.1/ferry/drains/{drain_uuid}/action", caller=ADMIN, body={"stop": None})

    assert response.status == 400
    assert status_of(drain_uuid) == drains.RUNNING


@pytest.mark.parametrize("url", ["https://ops.example.com/hook?token=s3cret x", "https://ops.example.com/\nhook?token=s3cret"])
def test_a_drain_whose_callback_url_has_a_space_or_a_control_character_is_400_and_recorded_nowhere(cloud, url):
    add_host("host1")
    setup.map_host("host1", "cell1")

    response = call("POST", "/v2.1/ferry/drains", caller=ADMIN, body={"drain": {"host": "host1", "callback_url": url}})

    assert response.status == 400, response.body
    assert "callback_url" in response.body["badRequest"]["message"]
    assert "s3cret" not in response.body["badRequest"]["message"]
    with api_session() as session:
        assert session.scalars(select(Drain.uuid)).all() == []


TOKEN = "t0ken-n0t-to-be-repeated"
CALLBACK = f"https://ops.example.com/ferry?token={TOKEN}"
# Each refusal as the schema words it would repeat the URL (pattern, maxLength) or the whole drain (oneOf).
BAD_DRAINS = {
    "space in the URL": {"host": "host1", "callback_url": CALLBACK + " x"},
    "URL over 2048 characters": {"host": "host1", "callback_url": CALLBACK + "a" * 2048},
    "host and cell both named": {"host": "host1", "cell": "cell1", "callback_url": CALLBACK},
    "drain not an object": CALLBACK,
}


@pytest.mark.parametrize("drain", BAD_DRAINS.values(), ids=BAD_DRAINS.keys())
def test_a_refused_drain_request_repeats_its_callback_url_neither_in_the_answer_nor_in_the_log(
        cloud, caplog, capsys, drain):
    add_host("host1")
    setup.map_host("host1", "cell1")

    response = call("POST", "/v2.1/ferry/drains", caller=ADMIN, body={"drain": drain})

    assert response.status == 400, response.body
    assert "Invalid drain request" in response.body["badRequest"]["message"]
    assert TOKEN not in str(response.body)
    logged = "\n".join(str(vars(record)) for record in caplog.records) + capsys.readouterr().out
    assert TOKEN not in logged
    with api_session() as session:
        assert session.scalars(select(Drain.uuid)).all() == []


def test_a_drains_view_counts_and_shows_a_server_deleted_during_the_drain_as_gone(cloud):
    # GIVEN a drain with one server moved and one deleted by its owner before its turn
    drain_uuid = running_drain()
    with api_session() as session:
        drain_id = session.scalars(select(Drain.id).where(Drain.uuid == drain_uuid)).one()
        session.add_all([
            DrainServer(drain_id=drain_id, position=0, instance_uuid="11111111-1111-1111-1111-111111111111",
                        cell="cell1", source_host="host1", dest_host="host2", state=drains.DONE, attempts=1),
            DrainServer(drain_id=drain_id, position=1, instance_uuid="22222222-2222-2222-2222-222222222222",
                        cell="cell1", source_host="host1", state=drains.GONE, attempts=0,
                        error="The server no longer exists: it was deleted before its move started.")])

    # WHEN it is shown and listed
    shown = call("GET", f"/v2.1/ferry/drains/{drain_uuid}", caller=ADMIN)
    listed = call("GET", "/v2.1/ferry/drains", caller=ADMIN)

    # THEN both count it gone, apart from the failed, and the server's state says so
    assert shown.status == listed.status == 200
    counts = shown.body["drain"]["counts"]
    assert (counts["done"], counts["gone"], counts["failed"], counts["left"]) == (1, 1, 0, 0)
    assert [s["state"] for s in shown.body["drain"]["servers"]] == ["done", "gone"]
    assert listed.body["drains"][0]["counts"] == counts


def test_drains_are_listed_by_a_status_with_the_hosts_they_disabled_and_an_unknown_status_is_400(cloud):
    drain_uuid = running_drain()
    with api_session() as session:  # as PlanDrain records the services it disabled
        session.execute(update(Drain).where(Drain.uuid == drain_uuid).values(disabled_hosts=["host1"]))

    running = call("GET", "/v2.1/ferry/drains", caller=ADMIN, query={"status": "running"})
    completed = call("GET", "/v2.1/ferry/drains", caller=ADMIN, query={"status": "completed"})
    unknown = call("GET", "/v2.1/ferry/drains", caller=ADMIN, query={"status": "bogus"})

    assert [d["id"] for d in running.body["drains"]] == [drain_uuid]
    shown = call("GET", f"/v2.1/ferry/drains/{drain_uuid}", caller=ADMIN).body["drain"]
    assert running.body["drains"][0]["disabled_hosts"] == shown["disabled_hosts"] == ["host1"]
    assert completed.body["drains"] == []
    assert unknown.status == 400 and "Invalid drain status 'bogus'" in unknown.body["badRequest"]["message"]
