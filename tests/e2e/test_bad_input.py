"""Requests the local stack must refuse, with the status and message Nova gives, and without leaving anything behind."""

from __future__ import annotations

import uuid

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture
def nothing_changes(servers, records):
    """Asserts after the test that no server, port or allocation appeared."""

    def everything() -> tuple[set[str], int, dict[str, dict[str, int]]]:
        listed = servers.api("admin").get("/servers", params={"all_tenants": "1"})
        assert listed.status_code == 200, listed.text
        return {s["id"] for s in listed.json()["servers"]}, records.port_count(), records.usages_by_host()

    before = everything()
    yield
    assert everything() == before


def _boot_body(local_stack, **server):
    body = {"name": "e2e-bad", "flavorRef": "1", "imageRef": local_stack.seeded.image["id"], "networks": "auto"}
    body.update(server)
    return {"server": body}


def _message(response, kind: str = "badRequest") -> str:
    fault = response.json()[kind]
    assert fault["code"] == response.status_code
    assert fault["message"]
    return fault["message"]


def test_an_unknown_flavor_is_a_bad_request(servers, local_stack, nothing_changes):
    response = servers.create(_boot_body(local_stack, flavorRef="no-such-flavor"))

    assert response.status_code == 400, response.text
    assert "flavor" in _message(response).lower()


def test_an_unknown_image_is_a_bad_request(servers, local_stack, nothing_changes):
    response = servers.create(_boot_body(local_stack, imageRef=str(uuid.uuid4())))

    assert response.status_code == 400, response.text
    assert "image" in _message(response).lower()


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"unexpected": True}, id="in the server"),
        pytest.param({"flavourRef": "1"}, id="misspelt flavorRef"),
    ],
)
def test_a_server_with_keys_the_api_does_not_know_is_a_bad_request(servers, local_stack, nothing_changes, body):
    response = servers.create(_boot_body(local_stack, **body))

    assert response.status_code == 400, response.text
    assert "additional properties" in _message(response).lower()


def test_a_body_with_unknown_top_level_keys_is_a_bad_request(servers, local_stack, nothing_changes):
    response = servers.create({**_boot_body(local_stack), "surprise": {}})

    assert response.status_code == 400, response.text
    _message(response)


def test_a_body_without_a_server_is_a_bad_request(servers, nothing_changes):
    response = servers.create({"name": "e2e-bad"})

    assert response.status_code == 400, response.text
    _message(response)


def test_an_unknown_server_is_not_found(servers, nothing_changes):
    missing = str(uuid.uuid4())
    demo = servers.api("demo")

    for response in (
        demo.get(f"/servers/{missing}"),
        demo.delete(f"/servers/{missing}"),
        demo.post(f"/servers/{missing}/action", json={"os-stop": None}),
        demo.get(f"/servers/{missing}/os-instance-actions"),
        servers.api("admin").get(f"/servers/{missing}"),
    ):
        assert response.status_code == 404, (response.request.method, response.request.url, response.text)
        assert missing in _message(response, "itemNotFound")


def test_an_unknown_server_action_is_a_bad_request(servers):
    server_id = servers.boot("demo", name="e2e-bad-action")["id"]

    response = servers.action(server_id, {"teleport": None})

    assert response.status_code == 400, response.text
    _message(response)
    assert servers.show(server_id)["status"] == "ACTIVE"
