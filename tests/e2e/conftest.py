"""The local stack for the end-to-end tests: one per test session, on free ports, agents as processes.

Tests drive it through the public API (``local_stack.session("demo")``), the ``openstack`` CLI
(``local_stack.clouds_yaml`` with the clouds ``ferry-admin``, ``ferry-demo``, ``ferry-alt``)
or openstacksdk, and look at hosts through their state directories: instance disks are real
files under ``local_stack.instances_dir(host)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests

from ferry.local.stack import LocalStack

T = TypeVar("T")

# Host operations time out quickly so a failure-path test does not wait 15 minutes.
HOST_OP_TIMEOUT_SECONDS = 60
HOST_OP_HEARTBEAT_SECONDS = 30
# Schedules in the template run 100 times faster than declared.
RATE_SCALE = 0.01


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
    def wait_for(predicate: Callable[[], T], timeout: float = 60, interval: float = 0.25) -> T:
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
    """Ferry's local stack in a temporary state directory, shared by the session's tests."""
    stack = LocalStack(
        tmp_path_factory.mktemp("local-stack"),
        cells=2,
        hosts_per_cell=2,
        moto_port=0,
        api_port=0,
        agent_mode="process",
        rate_scale=RATE_SCALE,
        host_op_timeout_seconds=HOST_OP_TIMEOUT_SECONDS,
        host_op_heartbeat_seconds=HOST_OP_HEARTBEAT_SECONDS,
    )
    stack.start()
    try:
        yield LocalStackHandle(stack)
    finally:
        stack.stop()
