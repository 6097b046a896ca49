"""The whole local stack from template.yaml: it comes up with every host reporting and goes away cleanly."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import requests
import yaml
from sqlalchemy import func, select

from ferry.errors import LocalStackError
from ferry.local import seed, stack
from ferry.local.stack import LocalStack


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_the_stack_comes_up_with_every_host_reporting_and_stops_without_leftovers(tmp_path):
    before = os.environ.get("AWS_ENDPOINT_URL")
    local = LocalStack(tmp_path / "state", cells=2, hosts_per_cell=1, moto_port=0, api_port=0)
    local.start()
    try:
        assert local.reporting_hosts() == {"cell1-host1", "cell2-host1"}
        assert local.seeded.cells == ["cell0", "cell1", "cell2"]
        assert requests.get(local.api_url, timeout=30).status_code == 200
        flavors = requests.get(
            local.api_url + "/flavors", headers={"X-Auth-Token": local.seeded.tokens["demo"]}, timeout=30
        )
        assert sorted(f["id"] for f in flavors.json()["flavors"]) == ["1", "2", "3", "4"]
        assert requests.get(local.api_url + "/flavors", timeout=30).status_code == 401
        clouds = yaml.safe_load(local.clouds_yaml.read_text())["clouds"]
        assert set(clouds) == {"ferry-admin", "ferry-demo", "ferry-alt"}
        for name, cloud in clouds.items():
            assert cloud["auth_type"] == "admin_token"
            assert cloud["auth"] == {"endpoint": local.api_url, "token": local.seeded.tokens[name[len("ferry-") :]]}
            assert cloud["identity_endpoint_override"] == local.identity_url
            assert "compute_api_version" not in cloud
        agents = [agent.process for agent in local.agents.values()]
        assert (local.logs_dir / "stack.log").is_file()
        assert all((local.logs_dir / f"agent-{host}.log").is_file() for host in local.agents)
        assert local.node_xml("cell1-host1").is_file()
    finally:
        local.stop()
    assert all(process.poll() is not None for process in agents)
    assert not _listening(local.api_port)
    assert not _listening(local.moto_port)
    assert os.environ.get("AWS_ENDPOINT_URL") == before


def test_restarting_on_the_same_state_keeps_tokens_image_and_flavors(tmp_path):
    state = tmp_path / "state"
    first = LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread")
    with first:
        tokens, image = first.seeded.tokens, first.seeded.image
    second = LocalStack(state, cells=1, hosts_per_cell=1, moto_port=0, api_port=0, agent_mode="thread")
    with second:
        assert second.seeded.tokens == tokens
        assert second.seeded.image["id"] == image["id"]
        from ferry.store.api_models import Flavor
        from ferry.store.db import api_session

        with api_session() as session:
            assert session.scalar(select(func.count()).select_from(Flavor)) == len(seed.DEFAULT_FLAVORS)
        response = requests.get(
            second.api_url + f"/images/{image['id']}", headers={"X-Auth-Token": tokens["admin"]}, timeout=30
        )
        assert response.status_code == 200
        assert not any(agent.alive() is False for agent in second.agents.values())
    assert json.loads((state / "seed.json").read_text())["tokens"] == tokens


def test_the_seed_image_is_a_deterministic_bootable_raw_disk(tmp_path):
    first = seed.write_test_image(tmp_path / "a.raw", size_mib=1)
    second = seed.write_test_image(tmp_path / "b.raw", size_mib=1)
    assert first == second
    data = (tmp_path / "a.raw").read_bytes()
    assert len(data) == 1024 * 1024
    assert data.startswith(seed.IMAGE_MARKER)
    assert data[510:512] == b"\x55\xaa"


def test_the_default_topology_names_hosts_after_their_cell():
    assert seed.topology(2, 2) == {
        "cell1-host1": "cell1",
        "cell1-host2": "cell1",
        "cell2-host1": "cell2",
        "cell2-host2": "cell2",
    }


def test_fresh_refuses_to_wipe_a_directory_that_is_not_a_stack_state(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(LocalStackError):
        stack._wipe(tmp_path)
    assert (tmp_path / "precious.txt").exists()
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    stack._wipe(state)
    assert not state.exists()


def test_the_default_template_is_the_checkouts():
    assert stack.default_template_path() == Path(__file__).resolve().parents[2] / "template.yaml"
