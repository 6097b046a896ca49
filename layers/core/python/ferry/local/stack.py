"""The whole local stack in one object, and ``ferry-local`` (``make up``) to run it in the foreground.

:class:`LocalStack` resolves ``template.yaml`` for the state directory, starts moto with the
handlers patched in, creates the template's resources, seeds the default topology and data,
serves the compute API, runs the SQS event sources and schedules, starts one host agent per
simulated hypervisor and waits until every host has reported. ``stop()`` undoes all of it and
leaves no process behind.

For crash drills, :meth:`LocalStack.kill_agent` SIGKILLs one host's agent process and
:meth:`LocalStack.restart_agent` starts it again on the same state (its journal, its disks and
its simulated hypervisor's guests, which the test driver keeps in the host's node description).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from sqlalchemy import select

from ferry import arguments, config, errors, faults
from ferry.local import seed as seeding
from ferry.local.gateway import ApiGateway
from ferry.local.pollers import Pollers, checked_rate_scale, default_rate_scale
from ferry.local.provision import provision
from ferry.local.runtime import FAKE_CREDENTIALS, LocalAws, check_port, free_port
from ferry.local.template import LocalTemplate, load_template, resolve

if TYPE_CHECKING:
    from hostagent.driver import HostCapacity

log = logging.getLogger("ferry-local")

DEFAULT_STATE_DIR = Path(".ferry/local")
DEFAULT_MOTO_PORT = 4566
DEFAULT_API_PORT = 8774
# Template parameters the local stack sets (see template.yaml's Parameters).
STATE_DIR_PARAMETER = "FerryStateDir"
HOST_OP_TIMEOUT_PARAMETER = "HostOpTimeoutSeconds"
HOST_DISK_OP_TIMEOUT_PARAMETER = "HostDiskOpTimeoutSeconds"
HOST_OP_HEARTBEAT_PARAMETER = "HostOpHeartbeatSeconds"
POLICY_FILE_PARAMETER = "PolicyFile"
WEBHOOK_SECRET_PARAMETER = "DrainWebhookSecret"
CALLBACK_SECRET_PARAMETER = "DrainCallbackSecret"
# The local stack's callback receivers (its tests', an operator's) listen on 127.0.0.1.
CALLBACK_ALLOW_PRIVATE_PARAMETER = "DrainCallbackAllowPrivateAddresses"
# The simulated hypervisors' size.
AGENT_VCPUS = 8
AGENT_MEMORY_MB = 16384
AGENT_DISK_GB = 200
AGENT_STOP_TIMEOUT = 15.0
AGENT_START_TIMEOUT = 60.0
# The message in the agent's log once it polls its queue (hostagent.agent.HostAgent.start).
AGENT_STARTED_LOG = b"host agent started"
DEFAULT_KEEPALIVE_SECONDS = 30.0
API_PATH = "/v2.1"
IDENTITY_PATH = "/identity/v3"
VOLUME_PATH = "/volume/v3"
WEBHOOK_PATH = "/webhooks/drain"
# The file that marks a directory as a state directory the stack made: --fresh wipes no other.
STATE_MARKER = ".ferry-local-state"
# The FERRY_* variables a host agent reads (docs/host-agent.md#environment): the stack's queues and
# state directory, and the drill switches. An agent process gets no other FERRY_* variable of this
# process (the functions' settings: database URL, webhook secret, state machines), as on AWS.
AGENT_FERRY_VARIABLES = frozenset({
    config.HOST_QUEUE_PREFIX_VARIABLE,
    "FERRY_HOST_REPORTS_QUEUE_URL",
    "FERRY_STATE_DIR",
    faults.ENV_VAR,
    "FERRY_AGENT_OPERATION_DELAY",  # hostagent.agent.OPERATION_DELAY_ENV
    "FERRY_DISK_THROTTLE_MIBPS",  # hostagent.disks.THROTTLE_ENV
})


def default_template_path() -> Path:
    """``template.yaml`` of the working directory, else of the checkout this package lives in."""
    here = Path.cwd() / "template.yaml"
    if here.is_file():
        return here
    return Path(__file__).resolve().parents[5] / "template.yaml"


class _AgentProcess:
    def __init__(self, host: str, command: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.host = host
        self._log: IO[bytes] = log_path.open("ab")
        self.process = subprocess.Popen(
            command,
            env=dict(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal reaches the stack, which stops agents in order
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal_stop(self) -> None:
        if self.alive():
            self.process.terminate()

    def kill(self) -> None:
        """SIGKILL the agent, as a crash or the OOM killer would: nothing of it runs any more."""
        if self.alive():
            self.process.kill()
        self.process.wait()
        self._log.close()

    def wait(self, timeout: float) -> None:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("agent %s did not stop in %.0f s; killing it", self.host, timeout)
            self.process.kill()
            self.process.wait()
        self._log.close()


def default_host_capacity() -> HostCapacity:
    """What a local host offers unless told otherwise: a small hypervisor.

    Raises:
        LocalStackError: the host agent cannot be loaded (libvirt-python is missing).
    """
    try:
        from hostagent.driver import HostCapacity  # loads libvirt: only where agents are started
    except ModuleNotFoundError as exc:
        if exc.name != "libvirt":
            raise
        raise errors.LocalStackError(
            "The host agent cannot be loaded: libvirt-python is missing. Install libvirt-dev and pkg-config, "
            "then run `make bootstrap`."
        ) from exc
    return HostCapacity(AGENT_VCPUS, AGENT_MEMORY_MB, AGENT_DISK_GB)


class _AgentThread:
    def __init__(self, host: str, cell: str, state_dir: Path, instances_dir: Path, capacity: HostCapacity,
                 options: Mapping[str, Any]) -> None:
        from ferry import config
        from hostagent.agent import HostAgent, default_volumes_dirs, inventory_from_capacity
        from hostagent.driver import LibvirtDriver, write_test_node_xml

        settings = config.get()
        self.host = host
        self.driver = LibvirtDriver(
            write_test_node_xml(state_dir / "node.xml", capacity.vcpus, capacity.memory_mb, keep_guests=True),
            disk_path=instances_dir,
            persist_test_guests=True,
        )
        self.agent = HostAgent(
            host=host,
            node=host,
            cell=cell,
            queue_url=None,
            reports_queue_url=settings.host_reports_queue_url,
            driver=self.driver,
            instances_dir=instances_dir,
            state_dir=state_dir,
            inventory=inventory_from_capacity(capacity),
            queue_prefix=settings.host_queue_prefix,
            volumes_dirs=default_volumes_dirs(settings.state_dir, instances_dir),
            **options,
        )
        self.thread = threading.Thread(target=self._run, name=f"agent-{host}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.agent.run()
        except Exception:
            log.exception("agent %s stopped with an error", self.host)
        finally:
            self.driver.close()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def signal_stop(self) -> None:
        self.agent.stop()

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("agent %s did not stop in %.0f s", self.host, timeout)


class LocalStack:
    """Ferry on this machine: moto, the handlers, the compute API, pollers and host agents.

    Args:
        state_dir: databases, host agents' state and disks, logs, clouds.yaml.
        hosts_per_cell, cells: the simulated topology (plus cell0).
        moto_port, api_port: where moto and the compute API listen; 0 picks free ports.
        agent_mode: ``"process"`` runs ``python -m hostagent`` per host, ``"thread"`` runs the
            agents inside this process.
        rate_scale: multiplies the template's schedule rates (None: ``FERRY_LOCAL_RATE_SCALE`` or 1).
        host_op_timeout_seconds, host_op_heartbeat_seconds: shorter host operation limits.
        parameters: more template parameter overrides.
        template_path: the template (default :func:`default_template_path`).
        stage: the deployment stage.
        ready_timeout: how long to wait for every host's first heartbeat.
        agent_heartbeat_interval: seconds between the agents' heartbeats.
        agent_report_interval: seconds between the agents' inventory reports (their guests and disks).
        agent_visibility_timeout: seconds an operation message an agent received stays invisible
            (renewed while it runs); after an agent crash its message comes back this long after
            the last renewal. None: the agent's default.
        redirect_logs: send handlers' and moto's logs to ``<state>/logs/stack.log``.
        webhook_secret: the drain webhook's secret (the template's DrainWebhookSecret); None
            keeps one in ``<state>/webhook-secret``, made on the first start.
        callback_secret: the secret drain callbacks are signed with (the template's
            DrainCallbackSecret); None keeps one in ``<state>/callback-secret``, made on the first
            start. Callbacks may go to private and loopback addresses
            (DrainCallbackAllowPrivateAddresses true, unless ``parameters`` says otherwise).
        host_capacity: what each host offers guests (vCPUs, memory, disk); None: a small
            hypervisor (``AGENT_VCPUS``, ``AGENT_MEMORY_MB``, ``AGENT_DISK_GB``).

    Raises:
        LocalStackError: the host agent cannot be loaded (libvirt-python is missing).
    """

    def __init__(
        self,
        state_dir: str | Path,
        *,
        hosts_per_cell: int = 2,
        cells: int = 2,
        moto_port: int = DEFAULT_MOTO_PORT,
        api_port: int = DEFAULT_API_PORT,
        agent_mode: Literal["process", "thread"] = "process",
        rate_scale: float | None = None,
        host_op_timeout_seconds: int | None = None,
        host_op_heartbeat_seconds: int | None = None,
        parameters: Mapping[str, Any] | None = None,
        template_path: str | Path | None = None,
        stage: str = "local",
        ready_timeout: float = 120.0,
        agent_heartbeat_interval: float = 10.0,
        agent_report_interval: float = 60.0,
        agent_visibility_timeout: int | None = None,
        redirect_logs: bool = True,
        webhook_secret: str | None = None,
        callback_secret: str | None = None,
        host_capacity: HostCapacity | None = None,
    ) -> None:
        if agent_mode not in ("process", "thread"):
            raise ValueError(f"agent_mode must be 'process' or 'thread', not {agent_mode!r}")
        self.state_dir = Path(state_dir).resolve()
        self.hosts_per_cell = hosts_per_cell
        self.cells = cells
        self.moto_port = moto_port
        self.api_port = api_port
        self.agent_mode = agent_mode
        self.rate_scale = rate_scale
        self.template_path = Path(template_path) if template_path else default_template_path()
        self.stage = stage
        self.ready_timeout = ready_timeout
        self.agent_heartbeat_interval = agent_heartbeat_interval
        self.agent_report_interval = agent_report_interval
        self.agent_visibility_timeout = agent_visibility_timeout
        self.redirect_logs = redirect_logs
        self.webhook_secret = webhook_secret
        self.callback_secret = callback_secret
        self.host_capacity = host_capacity or default_host_capacity()
        self.parameters: dict[str, Any] = {STATE_DIR_PARAMETER: str(self.state_dir), **(parameters or {})}
        if host_op_timeout_seconds is not None:
            # Every host operation's: the disk moves' too (the local stack's disks are small).
            self.parameters[HOST_OP_TIMEOUT_PARAMETER] = host_op_timeout_seconds
            self.parameters[HOST_DISK_OP_TIMEOUT_PARAMETER] = host_op_timeout_seconds
        if host_op_heartbeat_seconds is not None:
            self.parameters[HOST_OP_HEARTBEAT_PARAMETER] = host_op_heartbeat_seconds
        self.model: LocalTemplate | None = None
        self.aws: LocalAws | None = None
        self.gateway: ApiGateway | None = None
        self.pollers: Pollers | None = None
        self.seeded: seeding.SeedResult | None = None
        self.agents: dict[str, _AgentProcess | _AgentThread] = {}
        # When this start began its agents (naive UTC, as the store keeps heartbeats).
        self.agents_started_at: dt.datetime | None = None
        self._log_handler: logging.Handler | None = None
        self._redirected: list[tuple[logging.StreamHandler, Any]] = []
        self._propagate: dict[str, bool] = {}
        self._captured_warnings = False

    @property
    def keepalive_interval(self) -> float:
        """Seconds between an agent's task heartbeats: well inside the template's HeartbeatSeconds."""
        assert self.model is not None
        heartbeat = float(self.model.parameters.get(HOST_OP_HEARTBEAT_PARAMETER) or DEFAULT_KEEPALIVE_SECONDS * 2)
        interval = min(DEFAULT_KEEPALIVE_SECONDS, heartbeat / 3)
        if self.agent_visibility_timeout is not None:
            # Renew the message well before it would become visible again.
            interval = min(interval, self.agent_visibility_timeout / 3)
        return max(1.0, interval)

    # where things are

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}{API_PATH}"

    @property
    def identity_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}{IDENTITY_PATH}"

    @property
    def volume_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}{VOLUME_PATH}"

    @property
    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}{WEBHOOK_PATH}"

    @property
    def webhook_secret_file(self) -> Path:
        """Where the webhook secret made for this state directory is kept (mode 0600)."""
        return self.state_dir / "webhook-secret"

    @property
    def callback_secret_file(self) -> Path:
        """Where the callback secret made for this state directory is kept (mode 0600)."""
        return self.state_dir / "callback-secret"

    @property
    def aws_endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.moto_port}"

    @property
    def clouds_yaml(self) -> Path:
        return self.state_dir / "clouds.yaml"

    def host_state_dir(self, host: str) -> Path:
        return self.state_dir / "hosts" / host

    def instances_dir(self, host: str) -> Path:
        return self.host_state_dir(host) / "instances"

    def node_xml(self, host: str) -> Path:
        """The test driver's node description the agent of ``host`` opens (see hostagent/__main__.py)."""
        return self.host_state_dir(host) / "node.xml"

    def libvirt_uri(self, host: str) -> str:
        return f"test://{self.node_xml(host)}"

    # lifecycle

    def start(self) -> LocalStack:
        """Bring the stack up; returns once every host has reported a heartbeat.

        Raises:
            LocalStackError: a port is taken, ``FERRY_LOCAL_RATE_SCALE`` is not a number above 0
                (both found before anything starts), or the hosts did not report in time
                (everything started so far is stopped again).
            TemplateError: the template cannot be played locally.
        """
        claim_state_dir(self.state_dir)
        self.logs_dir.mkdir(exist_ok=True)
        self._start_logging()
        try:
            self._start()
        except BaseException:
            log.exception("the local stack failed to start")
            self.stop()
            raise
        return self

    def _start(self) -> None:
        rate_scale = default_rate_scale() if self.rate_scale is None else checked_rate_scale(self.rate_scale)
        self.moto_port = self.moto_port or free_port()
        self.api_port = self.api_port or free_port()
        check_port("127.0.0.1", self.api_port, "--api-port")  # the moto port: LocalAws.start, before moto
        declared = load_template(self.template_path).get("Parameters") or {}
        if WEBHOOK_SECRET_PARAMETER in declared:
            self.webhook_secret = self.parameters.setdefault(
                WEBHOOK_SECRET_PARAMETER, self.webhook_secret or self._kept_secret(self.webhook_secret_file)
            )
        if CALLBACK_SECRET_PARAMETER in declared:
            self.callback_secret = self.parameters.setdefault(
                CALLBACK_SECRET_PARAMETER, self.callback_secret or self._kept_secret(self.callback_secret_file)
            )
        if CALLBACK_ALLOW_PRIVATE_PARAMETER in declared:
            self.parameters.setdefault(CALLBACK_ALLOW_PRIVATE_PARAMETER, "true")
        self.model = resolve(
            self.template_path, stage=self.stage, parameters=self.parameters, endpoint_url=self.aws_endpoint_url
        )
        self.aws = LocalAws(self.model, port=self.moto_port).start()
        provision(self.model, self.aws.client)
        self.seeded = seeding.seed(
            self.state_dir,
            api_url=self.api_url,
            identity_url=self.identity_url,
            volume_url=self.volume_url,
            cells=self.cells,
            hosts_per_cell=self.hosts_per_cell,
        )
        self.gateway = ApiGateway(self.model, self.aws.runner, port=self.api_port).start()
        self.pollers = Pollers(self.model, self.aws.runner, self.aws.client, rate_scale=rate_scale).start()
        from ferry.store.api_models import utcnow  # the store's clock: heartbeats are compared with it

        self.agents_started_at = utcnow()
        for host, cell in self.seeded.hosts.items():
            self.agents[host] = self._start_agent(host, cell)
        self.wait_for_hosts(self.ready_timeout)
        log.info("local stack ready: compute API %s, AWS %s", self.api_url, self.aws_endpoint_url)

    @staticmethod
    def _kept_secret(path: Path) -> str:
        """The secret in ``path``, made (random, readable by its owner only) when missing."""
        kept = path.read_text().strip() if path.is_file() else ""
        if kept:
            return kept
        made = secrets.token_urlsafe(32)
        seeding.write_private(path, made + "\n")
        return made

    def _start_agent(
        self,
        host: str,
        cell: str,
        environment: Mapping[str, str] | None = None,
        visibility_timeout: int | None = None,
        direct_copies: bool = True,
    ) -> _AgentProcess | _AgentThread:
        visibility_timeout = visibility_timeout or self.agent_visibility_timeout
        keepalive = self.keepalive_interval
        if visibility_timeout is not None:
            keepalive = max(1.0, min(keepalive, visibility_timeout / 3))
        state_dir = self.host_state_dir(host)
        instances_dir = self.instances_dir(host)
        instances_dir.mkdir(parents=True, exist_ok=True)
        if self.agent_mode == "thread":
            options: dict[str, Any] = {
                "poll_wait_seconds": 1,
                "heartbeat_interval": self.agent_heartbeat_interval,
                "report_interval": self.agent_report_interval,
                "keepalive_interval": keepalive,
                "direct_copies": direct_copies,
            }
            if visibility_timeout is not None:
                options["visibility_timeout"] = visibility_timeout
            return _AgentThread(host, cell, state_dir, instances_dir, self.host_capacity, options)
        command = [
            sys.executable, "-m", "hostagent",
            "--host", host, "--cell", cell,
            "--state-dir", str(state_dir), "--instances-dir", str(instances_dir),
            "--vcpus", str(self.host_capacity.vcpus), "--memory-mb", str(self.host_capacity.memory_mb),
            "--disk-gb", str(self.host_capacity.disk_gb),
            "--poll-wait-seconds", "1", "--heartbeat-interval", str(self.agent_heartbeat_interval),
            "--keepalive-interval", str(keepalive),
            "--report-interval", str(self.agent_report_interval),
            "--parent-pid", str(os.getpid()),  # an interrupted stack (or benchmark) leaves no agents behind
        ]  # fmt: skip
        if visibility_timeout is not None:
            command += ["--visibility-timeout", str(visibility_timeout)]
        if not direct_copies:
            command.append("--no-direct-copies")
        return _AgentProcess(host, command, self.agent_environment(environment), self.agent_log(host))

    def agent_environment(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of an agent process, what an agent on AWS gets and no more of Ferry's.

        This process's variables (PATH, HOME, Python's, coverage's ...) without the FERRY_* ones
        an agent does not read (:data:`AGENT_FERRY_VARIABLES`), plus the local AWS endpoint, its
        fake credentials and region, plus ``extra`` (a drill's switches for one agent).
        """
        assert self.model is not None
        kept = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_") or k in AGENT_FERRY_VARIABLES}
        region = self.model.region
        return {
            **kept,
            **FAKE_CREDENTIALS,
            "AWS_ENDPOINT_URL": self.aws_endpoint_url,
            "AWS_REGION": region,
            "AWS_DEFAULT_REGION": region,
            **(extra or {}),
        }

    def agent_log(self, host: str) -> Path:
        """Where the agent process of ``host`` writes its log."""
        return self.logs_dir / f"agent-{host}.log"

    # crash drills

    def _agent_process(self, host: str) -> _AgentProcess:
        agent = self.agents.get(host)
        if agent is None:
            raise errors.LocalStackError(f"No agent for host {host}.")
        if not isinstance(agent, _AgentProcess):
            raise errors.LocalStackError("Agents run as threads: only agent processes can be killed and restarted.")
        return agent

    def kill_agent(self, host: str) -> None:
        """SIGKILL the agent of ``host``: it stops where it is, without answering, deleting or cleaning up.

        Its operation in flight stays in its journal as started and its message comes back to the
        queue once the message's visibility timeout runs out. Only for ``agent_mode="process"``.

        Raises:
            LocalStackError: no such host, or the agents run as threads.
        """
        self._agent_process(host).kill()
        log.info("agent %s killed", host)

    def restart_agent(
        self,
        host: str,
        environment: Mapping[str, str] | None = None,
        *,
        visibility_timeout: int | None = None,
        direct_copies: bool = True,
        timeout: float = AGENT_START_TIMEOUT,
    ) -> None:
        """Start the agent of ``host`` again on its state directory; returns once it polls its queue.

        A live agent is stopped first (SIGTERM: it finishes what it runs). ``environment`` adds
        variables for this agent process only (a disk throttle, say) and ``visibility_timeout``
        replaces the stack's ``agent_visibility_timeout`` for it (a message this agent held comes
        back that long after the agent is killed); the next restart without them drops them.
        ``direct_copies=False`` starts it with ``--no-direct-copies``: moves to it go through S3.

        Raises:
            LocalStackError: no such host, the agents run as threads, or the agent did not start
                within ``timeout`` seconds (see its log).
        """
        agent = self._agent_process(host)
        if agent.alive():
            agent.signal_stop()
            agent.wait(AGENT_STOP_TIMEOUT)
        assert self.seeded is not None
        log_file = self.agent_log(host)
        offset = log_file.stat().st_size if log_file.exists() else 0
        restarted = self._start_agent(host, self.seeded.hosts[host], environment, visibility_timeout, direct_copies)
        self.agents[host] = restarted
        deadline = time.monotonic() + timeout
        while not self._logged_since(log_file, offset, AGENT_STARTED_LOG):
            if not restarted.alive():
                raise errors.LocalStackError(f"The agent of {host} exited on restart (see {log_file}).")
            if time.monotonic() > deadline:
                raise errors.LocalStackError(f"The agent of {host} did not start in {timeout:.0f} s (see {log_file}).")
            time.sleep(0.1)
        log.info("agent %s restarted", host)

    @staticmethod
    def _logged_since(log_file: Path, offset: int, text: bytes) -> bool:
        try:
            with log_file.open("rb") as f:
                f.seek(offset)
                return text in f.read()
        except FileNotFoundError:
            return False

    def reporting_hosts(self) -> set[str]:
        """Hosts whose service record in their cell has a heartbeat since this start began its
        agents (a heartbeat an earlier run left in the state directory does not count), or any
        heartbeat before a start."""
        from ferry.store.cell_models import Service
        from ferry.store.db import cell_session

        assert self.seeded is not None
        since = self.agents_started_at
        reported = Service.last_seen_at.is_not(None) if since is None else Service.last_seen_at >= since
        found: set[str] = set()
        for cell in sorted(set(self.seeded.hosts.values())):
            with cell_session(cell) as session:
                found.update(session.scalars(select(Service.host).where(reported)))
        return found

    def wait_for_hosts(self, timeout: float) -> None:
        """Wait until every seeded host has reported since this start began its agents.

        Raises:
            HostsNotReporting: some did not within ``timeout`` seconds, or their agent exited.
        """
        assert self.seeded is not None
        expected = set(self.seeded.hosts)
        deadline = time.monotonic() + timeout
        while True:
            missing = expected - self.reporting_hosts()
            if not missing:
                return
            dead = sorted(h for h in missing if not self.agents[h].alive())
            if dead:
                raise errors.HostsNotReporting(f"Host agents exited: {', '.join(dead)} (see {self.logs_dir}).")
            if time.monotonic() > deadline:
                raise errors.HostsNotReporting(
                    f"No heartbeat within {timeout:.0f} s from {', '.join(sorted(missing))} (see {self.logs_dir})."
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop agents (SIGTERM, then kill), pollers, the API and moto; restore the environment."""
        for agent in self.agents.values():
            agent.signal_stop()
        for agent in self.agents.values():
            agent.wait(AGENT_STOP_TIMEOUT)
        self.agents.clear()
        if self.pollers is not None:
            self.pollers.stop()
            self.pollers = None
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        if self.aws is not None:
            self.aws.stop()
            self.aws = None
        from ferry.store import db

        db.dispose_all()
        log.info("local stack stopped")
        self._stop_logging()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # logs

    def _start_logging(self) -> None:
        if self._log_handler is not None:
            return
        handler = logging.FileHandler(self.logs_dir / "stack.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s"))
        self._log_handler = handler
        local = logging.getLogger("ferry-local")
        local.addHandler(handler)
        local.setLevel(logging.INFO)
        if not self.redirect_logs:
            return
        for name in ("moto", "py.warnings"):
            quiet = logging.getLogger(name)
            quiet.addHandler(handler)
            self._propagate[name], quiet.propagate = quiet.propagate, False
        # Powertools warns on every invocation without metrics; keep that out of the terminal.
        self._captured_warnings = True
        logging.captureWarnings(True)
        # Handlers log through Powertools' "ferry" logger to the stdout it captured at import.
        for existing in logging.getLogger("ferry").handlers:
            if type(existing) is logging.StreamHandler:
                self._redirected.append((existing, existing.setStream(handler.stream)))

    def _stop_logging(self) -> None:
        for stream_handler, stream in self._redirected:
            stream_handler.setStream(stream)
        self._redirected.clear()
        if self._log_handler is None:
            return
        logging.getLogger("ferry-local").removeHandler(self._log_handler)
        for name, propagate in self._propagate.items():
            quiet = logging.getLogger(name)
            quiet.removeHandler(self._log_handler)
            quiet.propagate = propagate
        self._propagate.clear()
        if self._captured_warnings:
            logging.captureWarnings(False)
            self._captured_warnings = False
        self._log_handler.close()
        self._log_handler = None


def claim_state_dir(state_dir: Path) -> None:
    """Create the state directory; one the stack creates (or finds empty) gets :data:`STATE_MARKER`,
    so that ``--fresh`` later knows it as the stack's own."""
    if state_dir.is_dir() and any(state_dir.iterdir()):
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / STATE_MARKER).write_text("A state directory of ferry-local: `ferry-local --fresh` deletes it.\n")


def _wipe(state_dir: Path) -> None:
    """Delete a state directory the stack made (``--fresh``).

    Raises:
        LocalStackError: the directory is not one (see :func:`_not_wipeable`); the message names it.
    """
    if not state_dir.exists():
        return
    reason = _not_wipeable(state_dir.resolve())
    if reason is not None:
        raise errors.LocalStackError(f"Not wiping {state_dir}: {reason}.")
    shutil.rmtree(state_dir)


def _not_wipeable(state_dir: Path) -> str | None:
    """Why ``state_dir`` must not be wiped, or None: only an empty directory or one the stack marked
    as its own (:data:`STATE_MARKER`, or the ``seed.json`` seeding writes) is, and never ``/``, a
    home directory or what holds it, or a git work tree, whatever they hold."""
    try:
        home: Path | None = Path.home().resolve()
    except RuntimeError:  # no HOME and no password entry
        home = None
    if state_dir == state_dir.parent:
        return "it is the root directory"
    if home is not None and (state_dir == home or state_dir in home.parents):
        return "it is a home directory or holds one"
    if (state_dir / ".git").exists():
        return "it is a git work tree"
    if not any(state_dir.iterdir()):
        return None
    if not ((state_dir / STATE_MARKER).is_file() or (state_dir / "seed.json").is_file()):
        return f"it holds neither {STATE_MARKER} nor seed.json, so the local stack did not make it"
    return None


def main(argv: list[str] | None = None) -> int:
    """``ferry-local``: run the local stack in the foreground until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(prog="ferry-local", description="Run Ferry's local stack in the foreground.")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="state directory (%(default)s)")
    parser.add_argument("--cells", type=arguments.whole(1), default=2, help="cells with hosts (%(default)s)")
    parser.add_argument("--hosts-per-cell", type=arguments.whole(1), default=2,
                        help="hosts in each cell (%(default)s)")
    parser.add_argument("--fresh", action="store_true", help="wipe the state directory first")
    # A port out of range is a usage error (exit status 2), before anything starts; 0 picks a free one.
    parser.add_argument("--moto-port", type=arguments.whole(0, 65535), default=DEFAULT_MOTO_PORT,
                        help="local AWS port, 0 for a free one (%(default)s)")
    parser.add_argument("--api-port", type=arguments.whole(0, 65535), default=DEFAULT_API_PORT,
                        help="compute API port, 0 for a free one (%(default)s)")
    parser.add_argument("--agent-mode", choices=("process", "thread"), default="process")
    parser.add_argument("--template", type=Path, default=None, help="template.yaml (default: the checkout's)")
    parser.add_argument("--policy-file", type=Path, default=None,
                        help="a YAML or JSON policy file (the template's PolicyFile), re-read when it changes")
    parser.add_argument("--webhook-secret", default=None,
                        help="the drain webhook's secret (the template's DrainWebhookSecret; default: a random "
                             "one made once and kept in <state dir>/webhook-secret)")
    parser.add_argument("--callback-secret", default=None,
                        help="the secret drain callbacks are signed with (the template's DrainCallbackSecret; "
                             "default: a random one made once and kept in <state dir>/callback-secret)")
    args = parser.parse_args(argv)

    state_dir = args.state_dir.resolve()
    # Checked before anything is wiped, made or started: each would otherwise end in a traceback.
    if state_dir.exists() and not state_dir.is_dir():
        print(f"ferry-local: {state_dir} is not a directory: give --state-dir a directory (made if missing).",
              file=sys.stderr)
        return 1
    if args.template is not None and not args.template.is_file():
        print(f"ferry-local: no template file at {args.template}: give --template the path of a template.yaml.",
              file=sys.stderr)
        return 1
    if args.policy_file is not None and not args.policy_file.is_file():
        # Re-read when it changes, but it must be there to start with: the stack starts with its rules.
        print(f"ferry-local: {args.policy_file} is not a file: give --policy-file the path of a YAML or JSON "
              f"policy file.", file=sys.stderr)
        return 1
    try:
        if args.fresh:
            _wipe(state_dir)
    except errors.LocalStackError as exc:
        print(f"ferry-local: {exc.message}", file=sys.stderr)
        return 2
    try:
        stack = LocalStack(
            state_dir,
            cells=args.cells,
            hosts_per_cell=args.hosts_per_cell,
            moto_port=args.moto_port,
            api_port=args.api_port,
            agent_mode=args.agent_mode,
            template_path=args.template,
            parameters={POLICY_FILE_PARAMETER: str(args.policy_file.resolve())} if args.policy_file else None,
            webhook_secret=args.webhook_secret,
            callback_secret=args.callback_secret,
        )
    except errors.LocalStackError as exc:
        print(f"ferry-local: {exc.message}", file=sys.stderr)
        return 1
    try:
        claim_state_dir(stack.state_dir)
        stack.logs_dir.mkdir(exist_ok=True)
        # Handlers print their metrics (EMF) to stdout: send them to the stack log, keep the terminal for us.
        log_stream = (stack.logs_dir / "stack.log").open("a")
    except OSError as exc:  # no permission, a file where a directory goes
        print(f"ferry-local: cannot use {stack.state_dir} as the state directory: {exc.strerror or exc}"
              f"{f' ({exc.filename})' if exc.filename else ''}", file=sys.stderr)
        return 1
    terminal = sys.stdout
    print(f"Starting Ferry's local stack in {state_dir} (logs in {stack.logs_dir}) ...", flush=True)

    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    # While starting, SIGTERM interrupts like Ctrl-C: start() stops what it started and re-raises.
    signal.signal(signal.SIGTERM, _interrupt)
    sys.stdout = log_stream
    try:
        try:
            stack.start()
        except errors.FerryError as exc:
            print(f"ferry-local: {exc.message}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        stopping = threading.Event()

        def _request_stop(signum: int, _frame: Any) -> None:
            stopping.set()

        signal.signal(signal.SIGTERM, _request_stop)
        signal.signal(signal.SIGINT, _request_stop)
        secret_from = "given with --webhook-secret" if args.webhook_secret else f"in {stack.webhook_secret_file}"
        callback_from = ("given with --callback-secret" if args.callback_secret
                         else f"in {stack.callback_secret_file}")
        print(
            f"\nFerry is up.\n"
            f"  compute API   {stack.api_url}\n"
            f"  local AWS     {stack.aws_endpoint_url}\n"
            f"  drain webhook POST {stack.webhook_url}\n"
            f"                secret {secret_from}\n"
            f"  callbacks     signed with the secret {callback_from}\n"
            f"  hosts         {', '.join(stack.agents)}\n\n"
            f"  export OS_CLIENT_CONFIG_FILE={stack.clouds_yaml}\n"
            f"  export OS_CLOUD=ferry-demo     # or ferry-admin, ferry-alt\n"
            f"  openstack flavor list\n\n"
            f"Ctrl-C stops the stack.",
            file=terminal,
            flush=True,
        )
        reported: set[str] = set()
        while not stopping.wait(1):
            dead = {host for host, agent in stack.agents.items() if not agent.alive()} - reported
            if dead:
                print(
                    f"ferry-local: host agents exited: {', '.join(sorted(dead))}; see {stack.logs_dir}",
                    file=sys.stderr,
                    flush=True,
                )
                reported |= dead
        print("Stopping ...", file=terminal, flush=True)
        stack.stop()
        return 0
    finally:
        sys.stdout = terminal
        log_stream.close()


if __name__ == "__main__":
    sys.exit(main())
