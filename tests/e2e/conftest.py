"""The local stack for the end-to-end tests: one per test session, on free ports, agents as processes.

Tests drive it through the public API (``local_stack.session("demo")``), the ``openstack`` CLI
(``local_stack.clouds_yaml`` with the clouds ``ferry-admin``, ``ferry-demo``, ``ferry-alt``)
or openstacksdk, and look at hosts through their state directories: instance disks are real
files under ``local_stack.instances_dir(host)``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests

from ferry.local.stack import POLICY_FILE_PARAMETER, LocalStack

T = TypeVar("T")

# Host operations time out quickly so a failure-path test does not wait 15 minutes.
HOST_OP_TIMEOUT_SECONDS = 60
HOST_OP_HEARTBEAT_SECONDS = 30
# Agents report their guests and disks (what ferry audit compares) this often.
AGENT_REPORT_INTERVAL_SECONDS = 10
# A drain's waiting moves (paused, or at a per-host limit) look again this often.
DRAIN_POLL_SECONDS = 1
# Schedules in the template run 100 times faster than declared.
RATE_SCALE = 0.01
# The state machines wait a tenth of their declared Retry intervals (FERRY_LOCAL_RETRY_SCALE).
RETRY_SCALE = 0.1


class ApiSession(requests.Session):
    """A requests session for one identity: relative paths go to the compute API, with its token."""

    def __init__(self, base_url: str, token: str | None) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        if token:
            self.headers["X-Auth-Token"] = token

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> requests.Response:
        if isinstance(url, str) and url.startswith("/"):
            url = self.base_url + url
        kwargs.setdefault("timeout", 60)
        return super().request(method, url, *args, **kwargs)


@dataclass
class LocalStackHandle:
    """What end-to-end tests need of the running local stack."""

    stack: LocalStack

    @property
    def api_url(self) -> str:
        """The compute endpoint, ``http://127.0.0.1:<port>/v2.1``."""
        return self.stack.api_url

    @property
    def identity_url(self) -> str:
        return self.stack.identity_url

    @property
    def aws_endpoint_url(self) -> str:
        return self.stack.aws_endpoint_url

    @property
    def state_dir(self) -> Path:
        return self.stack.state_dir

    @property
    def clouds_yaml(self) -> Path:
        return self.stack.clouds_yaml

    @property
    def tokens(self) -> dict[str, str]:
        """Tokens by identity: ``admin``, ``demo``, ``alt``."""
        assert self.stack.seeded is not None
        return self.stack.seeded.tokens

    @property
    def seeded(self) -> Any:
        """The :class:`ferry.local.seed.SeedResult`: cells, hosts, flavors, image, network, identities."""
        return self.stack.seeded

    @property
    def hosts(self) -> dict[str, str]:
        """Every host and its cell."""
        assert self.stack.seeded is not None
        return dict(self.stack.seeded.hosts)

    @contextmanager
    def override_policy(self, rules: dict[str, str]) -> Iterator[None]:
        """Run with ``rules`` as the stack's policy file; the file as it was is back afterwards."""
        policy_file = self.state_dir / "policy.yaml"
        before = policy_file.read_text()
        policy_file.write_text(json.dumps(rules) + "\n")
        try:
            yield
        finally:
            policy_file.write_text(before)

    def session(self, identity: str | None = "demo") -> ApiSession:
        """A requests session as ``identity`` (``None``: no token)."""
        return ApiSession(self.api_url, self.tokens[identity] if identity else None)

    def cloud(self, identity: str = "demo") -> str:
        """The clouds.yaml entry of ``identity`` (``OS_CLOUD``)."""
        return f"ferry-{identity}"

    def host_state_dir(self, host: str) -> Path:
        return self.stack.host_state_dir(host)

    def instances_dir(self, host: str) -> Path:
        """Where ``host``'s agent keeps instance disks (``<instances_dir>/<instance uuid>/``)."""
        return self.stack.instances_dir(host)

    def libvirt_uri(self, host: str) -> str:
        """The ``test:///`` URI of ``host``'s node description.

        Each open of a test-driver URI is a new, empty hypervisor: opening it here does not show
        the agent's guests. Check guests through the agent's reports or its instance files.
        """
        return self.stack.libvirt_uri(host)

    def client(self, service: str) -> Any:
        """A boto3 client for the local AWS (queues, executions, the image bucket)."""
        assert self.stack.aws is not None
        return self.stack.aws.client(service)

    @staticmethod
    def wait_for(predicate: Callable[[], T], timeout: float = 60, interval: float = 0.1) -> T:
        """Call ``predicate`` until it returns something truthy, and return that.

        Raises:
            AssertionError: it did not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout} s (last value {value!r})")
            time.sleep(interval)


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStackHandle]:
    """Ferry's local stack in a temporary state directory, shared by the session's tests.

    Fault injection is on (``ferry.faults``, a file in the state directory): the Lambda steps run
    in this process and the agents inherit the environment, so a test can arm any step. Retry
    intervals are scaled by :data:`RETRY_SCALE`. The
    policy file (``policy.yaml`` in the state directory, re-read when it changes) starts empty:
    the default rules; tests change it with :meth:`LocalStackHandle.override_policy`. After the
    last test, ``ferry audit`` must find nothing wrong.
    """
    from ferry import audit, faults
    from ferry.local.runtime import RETRY_SCALE_ENV

    state_dir = tmp_path_factory.mktemp("local-stack")
    policy_file = state_dir / "policy.yaml"
    policy_file.write_text("{}\n")
    previous = {name: os.environ.get(name) for name in (faults.ENV_VAR, RETRY_SCALE_ENV)}
    os.environ[faults.ENV_VAR] = str(state_dir / "faults.json")
    os.environ[RETRY_SCALE_ENV] = str(RETRY_SCALE)
    stack = LocalStack(
        state_dir,
        cells=2,
        hosts_per_cell=2,
        moto_port=0,
        api_port=0,
        agent_mode="process",
        rate_scale=RATE_SCALE,
        host_op_timeout_seconds=HOST_OP_TIMEOUT_SECONDS,
        host_op_heartbeat_seconds=HOST_OP_HEARTBEAT_SECONDS,
        parameters={POLICY_FILE_PARAMETER: str(policy_file), "DrainPollSeconds": DRAIN_POLL_SECONDS},
        agent_report_interval=AGENT_REPORT_INTERVAL_SECONDS,
    )
    try:
        stack.start()
        try:
            yield LocalStackHandle(stack)
            # Whatever the tests did, nothing is left inconsistent or leaked (while the local AWS still runs).
            audit.assert_consistent(grace_seconds=0)
        finally:
            stack.stop()
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- servers through the API, and Ferry's records behind it -------------------------------------

# Every request of the helpers below asks for the newest microversion the API offers.
LATEST_MICROVERSION = "compute latest"


class Servers:
    """Servers driven through the compute API, as the identities of the local stack.

    Reads go through the admin's view (which carries ``OS-EXT-SRV-ATTR:host``) unless told
    otherwise. Every server created here is deleted by :meth:`delete_all` at the end of the test.
    """

    def __init__(self, stack: LocalStackHandle) -> None:
        self.stack = stack
        self.created: list[str] = []
        self._sessions: dict[str, ApiSession] = {}

    def api(self, identity: str = "demo") -> ApiSession:
        """A session as ``identity`` that asks for the newest microversion."""
        if identity not in self._sessions:
            session = self.stack.session(identity)
            session.headers["OpenStack-API-Version"] = LATEST_MICROVERSION
            self._sessions[identity] = session
        return self._sessions[identity]

    def create(self, body: dict[str, Any], identity: str = "demo") -> requests.Response:
        """``POST /servers`` with ``body`` as is; a server it creates is remembered for clean-up."""
        response = self.api(identity).post("/servers", json=body)
        if response.status_code == 202:
            self.created.append(response.json()["server"]["id"])
        return response

    def boot(self, identity: str = "demo", *, flavor: str = "1", name: str = "e2e", **extra: Any) -> dict[str, Any]:
        """Boot a server from the seeded image and wait until it is ACTIVE; returns the admin's view of it."""
        body = {"server": {"name": name, "flavorRef": flavor, "imageRef": self.stack.seeded.image["id"],
                           "networks": "auto", **extra}}
        response = self.create(body, identity)
        assert response.status_code == 202, response.text
        return self.wait_for_status(response.json()["server"]["id"], "ACTIVE")

    def show(self, server_id: str, identity: str = "admin") -> dict[str, Any] | None:
        """The server as ``identity`` sees it, or None when the API answers 404."""
        response = self.api(identity).get(f"/servers/{server_id}")
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        return response.json()["server"]

    def action(self, server_id: str, body: dict[str, Any], identity: str = "demo") -> requests.Response:
        return self.api(identity).post(f"/servers/{server_id}/action", json=body)

    def wait_for_status(self, server_id: str, status: str, timeout: float = 90) -> dict[str, Any]:
        """Wait until the server has ``status`` and no task; returns the admin's view.

        Raises:
            AssertionError: the timeout passed, the server went to ERROR (with its fault), or it vanished.
        """
        seen: dict[str, Any] = {}

        def settled() -> dict[str, Any] | None:
            server = self.show(server_id)
            assert server is not None, f"server {server_id} vanished while waiting for {status}"
            seen.update(server)
            if server["status"] == "ERROR" and status != "ERROR":
                raise AssertionError(f"server {server_id} went to ERROR: {server.get('fault')}")
            if server["status"] == status and server["OS-EXT-STS:task_state"] is None:
                return server
            return None

        try:
            return self.stack.wait_for(settled, timeout=timeout)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}; server {server_id} is {seen.get('status')} / {seen.get('OS-EXT-STS:task_state')}"
            ) from None

    def wait_until_gone(self, server_id: str, timeout: float = 90) -> None:
        """Wait until ``GET /servers/{id}`` answers 404."""
        self.stack.wait_for(lambda: self.show(server_id) is None, timeout=timeout)

    def delete(self, server_id: str, identity: str = "demo") -> requests.Response:
        return self.api(identity).delete(f"/servers/{server_id}")

    def delete_all(self) -> None:
        """Delete (as admin) every server this helper created that still exists, and wait until they are gone."""
        for server_id in self.created:
            server = self.show(server_id)
            if server is None:
                continue
            if server["OS-EXT-STS:task_state"] != "deleting":
                self.delete(server_id, "admin")
            self.wait_until_gone(server_id)
        self.created.clear()


class Records:
    """What Ferry recorded behind the API: placement, ports and the host agents' journals and disks.

    The local stack runs in the test process with its environment set, so Ferry's own modules
    read the stack's databases.
    """

    def __init__(self, stack: LocalStackHandle) -> None:
        self.stack = stack

    def usages(self, host: str) -> dict[str, int]:
        """``{resource class: amount allocated}`` on ``host``'s resource provider."""
        from ferry import placement

        return placement.usages(placement.provider_by_host(host))

    def usages_by_host(self) -> dict[str, dict[str, int]]:
        return {host: self.usages(host) for host in self.stack.hosts}

    def provider(self, host: str) -> str:
        from ferry import placement

        return placement.provider_by_host(host)

    def allocations(self, consumer_uuid: str) -> dict[str, dict[str, int]]:
        """``{provider uuid: {resource class: amount}}`` held by the consumer."""
        from ferry import placement

        return placement.get_allocations(consumer_uuid)

    def consumer_exists(self, consumer_uuid: str) -> bool:
        from ferry import placement

        return placement.consumer_generation(consumer_uuid) is not None

    def ports(self, instance_uuid: str) -> list[str]:
        """Ids of the ports plugged into the server."""
        from sqlalchemy import select

        from ferry.store.api_models import Port
        from ferry.store.db import api_session

        with api_session() as session:
            return list(session.scalars(select(Port.id).where(Port.device_id == instance_uuid)))

    def port_exists(self, port_id: str) -> bool:
        from ferry.store.api_models import Port
        from ferry.store.db import api_session

        with api_session() as session:
            return session.get(Port, port_id) is not None

    def port_count(self) -> int:
        from sqlalchemy import func, select

        from ferry.store.api_models import Port
        from ferry.store.db import api_session

        with api_session() as session:
            return int(session.scalar(select(func.count()).select_from(Port)) or 0)

    def instance_dir(self, host: str, instance_uuid: str) -> Path:
        return self.stack.instances_dir(host) / instance_uuid

    def host_operations(self, host: str, instance_uuid: str) -> list[tuple[str, str]]:
        """``(operation, status)`` of every operation ``host``'s agent journaled for the instance, oldest first."""
        import sqlite3
        from contextlib import closing

        journal = self.stack.host_state_dir(host) / "journal.sqlite"
        if not journal.exists():
            return []
        with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as conn:
            rows = conn.execute(
                "SELECT operation, status FROM operations WHERE instance_uuid = ? ORDER BY started_at",
                (instance_uuid,),
            ).fetchall()
        return [(operation, status) for operation, status in rows]


@pytest.fixture
def servers(local_stack: LocalStackHandle) -> Iterator[Servers]:
    """Servers for one test; whatever it leaves behind is deleted afterwards."""
    helper = Servers(local_stack)
    try:
        yield helper
    finally:
        helper.delete_all()


@pytest.fixture
def records(local_stack: LocalStackHandle) -> Records:
    return Records(local_stack)


SWEEP_CASE = "test_fault_sweep.py::test_a_fault_at_the_state_loses_nothing["


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Print how many Task states the fault sweep covered: one case per state, passed of all run."""
    outcomes = {outcome: [r for r in terminalreporter.stats.get(outcome, [])
                          if SWEEP_CASE in getattr(r, "nodeid", "") and r.when == "call"]
                for outcome in ("passed", "failed")}
    run = len(outcomes["passed"]) + len(outcomes["failed"])
    if run:
        terminalreporter.write_line(f"fault sweep: {len(outcomes['passed'])} of {run} Task states covered")


# The order the files start in, so that the two workers end together instead of one finishing a
# long file alone at the end. Workers take whole files in collection order, two each up front
# (pytest-xdist's loadfile): the longest (about 200 s on 2 cores) and a short one go to the first,
# the next two (about 95 and 90 s) to the second, which then takes the files that follow (55 s,
# 50 s, then the rest in their usual order) until the first is free again.
FIRST_FILES = ("test_fault_sweep.py", "test_openapi_fuzz.py", "test_bad_input.py", "test_timeouts.py",
               "test_drains.py", "test_agent_crash.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run :data:`FIRST_FILES` first, then the others in their usual order (tests keep theirs within a file).

    Only when the run is of end-to-end tests alone, as ``make test`` runs them.
    """
    here = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return FIRST_FILES.index(name) if name in FIRST_FILES else len(FIRST_FILES)

    if all(item.path.parent == here for item in items):
        items.sort(key=rank)
