"""The host agent: polls the host's SQS queue, performs host operations, answers the workflows.

One agent runs on each hypervisor. It never touches the database: it learns what to do from
operation messages (:mod:`ferry.protocol`), answers each task token with SendTaskSuccess or
SendTaskFailure (a ``Ferry.*`` error name), and tells the control plane about its host through
inventory and heartbeat reports on the host reports queue.

Every operation is idempotent and journaled (:mod:`hostagent.journal`): a redelivered message is
answered from the journal; an operation interrupted by a crash runs again. A copy of the message of
an operation this agent is running or has waiting is kept and settled by that delivery.

An answer can come too late. A Task state that hears nothing (no answer, no task heartbeat) for its
``HeartbeatSeconds``, or no answer within its ``TimeoutSeconds``, fails with ``States.Timeout`` and
the workflow rolls back without the host. So, right before it starts an operation, the agent asks
Step Functions whether the workflow still waits (a task heartbeat): if not (``TaskTimedOut``,
``InvalidToken``, ``TaskDoesNotExist``) the message is dropped without running the operation, which,
run late, would leave a guest or disks on the host that nothing owns. When Step Functions cannot
tell (it keeps failing), the operation waits for the message's next delivery. An answer the
workflow no longer waits for (the Task timed out while the operation ran) is logged and dropped.
An operation that sends something off its host (a source's disks into the destination's
directory or the transfer, a snapshot) or makes a guest here asks again once it has run; when the
workflow no longer waits, what it did is taken back instead of answering, since the workflow's
rollback may already have deleted it (or never comes to), and nothing else would again. The same
goes for such an operation found cut short (the agent died during it, or before its answer went
out) when its message comes back, and for one whose answer Step Functions refuses while no earlier
answer of it may have been taken. A take-back is journaled before it starts, so that one cut short
goes on when the message comes back; the message is settled only once it is done.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from botocore.exceptions import BotoCoreError, ClientError

from ferry import aws, errors, faults, protocol, validation
from ferry.observability import logger
from hostagent import disks
from hostagent.driver import (
    EPHEMERAL,
    LOCAL_DEVICES,
    NOSTATE,
    ROOT,
    SWAP,
    CallUnderWay,
    DiskSpec,
    Driver,
    HostCapacity,
)
from hostagent.journal import (
    ANSWER_SENDING,
    FAILED,
    IN_PROGRESS,
    SUCCEEDED,
    TAKEN_BACK,
    TAKING_BACK,
    Journal,
    JournalEntry,
)
from hostagent.metrics import DEFAULT_FLUSH_INTERVAL, MetricsPublisher, namespace_from_environment
from hostagent.moves import (
    SPAWN_RECORD,
    SPAWN_UNDONE,
    MoveOperations,
    guest_spec,
    read_record,
    volume_disks,
    write_record,
)

# A received message reappears this long after its last renewal (an agent that died): well inside
# the template's HostOpHeartbeatSeconds (60 s), so that the operation runs again before its Task
# times out. Renewed every keepalive interval, at most half of it.
DEFAULT_VISIBILITY_TIMEOUT = 45
DEFAULT_KEEPALIVE_INTERVAL = 15.0
# The keepalive's first beat comes this soon (or at the interval, when shorter).
KEEPALIVE_FIRST_BEAT_SECONDS = 1.0
# How long an operation's end waits for its keepalive to stop before it answers.
KEEPALIVE_JOIN_SECONDS = 5.0
# Seconds a hypervisor call may run beyond what it was asked to wait before the hypervisor counts
# as hung (see HostAgent's hypervisor_call_timeout): well past any call libvirt answers normally.
DEFAULT_HYPERVISOR_CALL_TIMEOUT = 600.0

# Messages received beyond the workers, waiting for one with their tasks heartbeat meanwhile.
DEFAULT_MAX_WAITING = 4
# Drills only: ``<operation>=<seconds>[,...]`` (``*`` for every operation) makes this agent wait that
# long once an operation is journaled as started, before its work, to catch it there (kill it, say).
OPERATION_DELAY_ENV = "FERRY_AGENT_OPERATION_DELAY"
DEFAULT_MAX_RECEIVE_COUNT = 5
# Calls to Step Functions about a task (is it still awaited, its answer) are tried this often, waiting
# ``attempt * STEP_FUNCTIONS_RETRY_SECONDS`` in between, before the message is left for its next delivery.
STEP_FUNCTIONS_ATTEMPTS = 3
STEP_FUNCTIONS_RETRY_SECONDS = 0.5
# When Step Functions cannot tell whether a task is still awaited, its message comes back this much later.
UNSURE_REDELIVERY_SECONDS = 10
# A take-back that failed (libvirt busy, storage slow) is tried again when its message comes back
# this much later: the queue's receive limit then spreads its tries over minutes, not seconds.
TAKE_BACK_RETRY_SECONDS = 120
# How often an operation held by an injected timeout (drills) looks whether the fault still holds it.
HOLD_POLL_SECONDS = 0.5
DLQ_RETENTION_SECONDS = 14 * 24 * 3600
# Operations whose HypervisorError a revert reads as "nothing was removed here" (the guest could
# not be destroyed, so its disks were not touched either: RevertAtDest, DestroyAtDest), and goes
# back to VERIFY_RESIZE, where a confirm deletes the source's disks. Once an earlier run of the
# same operation was cut short, it may have removed them before this run's hypervisor failed.
# (The other workflows sending them take either error alike; a delete retries both.)
_NOTHING_REMOVED_ON_HYPERVISOR_ERROR = frozenset({protocol.DESTROY, protocol.REVERT_RESIZE})
# Step Functions limits on SendTaskFailure.
_MAX_ERROR_LEN = 256
_MAX_CAUSE_LEN = 32768


@dataclass(frozen=True)
class Operation:
    """One validated operation message."""

    name: str
    operation_id: str
    instance_uuid: str
    args: dict[str, Any]
    task_token: str | None


def inventory_from_capacity(
    capacity: HostCapacity, reserved_vcpus: int = 0, reserved_memory_mb: int = 0, reserved_disk_gb: int = 0
) -> dict[str, dict[str, int]]:
    """Placement inventory (VCPU, MEMORY_MB, DISK_GB) of a host; a reservation never exceeds the total."""
    return {
        "VCPU": {"total": capacity.vcpus, "reserved": min(reserved_vcpus, capacity.vcpus)},
        "MEMORY_MB": {"total": capacity.memory_mb, "reserved": min(reserved_memory_mb, capacity.memory_mb)},
        "DISK_GB": {"total": capacity.disk_gb, "reserved": min(reserved_disk_gb, capacity.disk_gb)},
    }


def _is_queue_exists(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") in (
        "QueueAlreadyExists",
        "QueueNameExists",
        "AWS.SimpleQueueService.QueueNameExists",
    )


def _create_queue(sqs: Any, name: str, attributes: dict[str, str]) -> str:
    try:
        return str(sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"])
    except ClientError as exc:
        if not _is_queue_exists(exc):
            raise
    # The queue exists with other attributes (an operator changed them, or an older agent made it).
    url = str(sqs.get_queue_url(QueueName=name)["QueueUrl"])
    sqs.set_queue_attributes(QueueUrl=url, Attributes=attributes)
    return url


def ensure_host_queue(
    sqs: Any,
    prefix: str,
    host: str,
    visibility_timeout: int = DEFAULT_VISIBILITY_TIMEOUT,
    max_receive_count: int = DEFAULT_MAX_RECEIVE_COUNT,
) -> str:
    """Create (or update) a host's operation queue and its dead-letter queue; return the queue URL.

    A message that fails ``max_receive_count`` times moves to ``<queue name>-dlq``
    (:data:`ferry.protocol.DLQ_SUFFIX`).
    Safe to call on every agent start.
    """
    name = protocol.host_queue_name(prefix, host)
    dlq_url = _create_queue(sqs, f"{name}{protocol.DLQ_SUFFIX}", {"MessageRetentionPeriod": str(DLQ_RETENTION_SECONDS)})
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    redrive = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(max_receive_count)})
    return _create_queue(sqs, name, {"VisibilityTimeout": str(visibility_timeout), "RedrivePolicy": redrive})


def parse_message(body: Any) -> Operation:
    """Validate an operation message body (the decoded JSON) and its arguments.

    Raises:
        InvalidOperation: not an operation message, an unknown operation, or invalid arguments.
    """
    if not isinstance(body, dict):
        raise errors.InvalidOperation("The message is not a JSON object.")
    try:
        protocol.validate(body, protocol.OPERATION_SCHEMA)
        protocol.validate(body["args"], protocol.ARGS_SCHEMAS[body["operation"]])
    except validation.SchemaMismatch as exc:
        raise errors.InvalidOperation(
            f"Invalid operation message: {exc.message}", operation=body.get("operation")
        ) from exc
    # Only the canonical form (lower case, dashes, nothing around it): the uuid names the instance's
    # directories, which inventory reports and ``ferry audit`` recognise by that form alone.
    try:
        canonical = str(uuid.UUID(body["instance_uuid"])) == body["instance_uuid"]
    except ValueError:
        canonical = False
    if not canonical:
        raise errors.InvalidOperation(
            f"Invalid instance uuid {body['instance_uuid']!r}: not a uuid in its canonical form.",
            operation=body["operation"],
        )
    return Operation(
        name=body["operation"],
        operation_id=body["operation_id"],
        instance_uuid=body["instance_uuid"],
        args=body["args"],
        task_token=body.get("task_token"),
    )


def default_volumes_dirs(ferry_state_dir: str | Path, instances_dir: str | Path) -> list[Path]:
    """The volumes directories of an agent configured with none (``python -m hostagent`` without
    ``--volumes-dir``): ``<ferry_state_dir>/volumes`` and ``volumes`` beside the instances directory
    (:data:`ferry.protocol.VOLUMES_DIR`).

    The first is where the compute API places the volume files it makes only when
    ``ferry_state_dir`` (the agent's FERRY_STATE_DIR) is the control plane's (the template's
    ``FerryStateDir``), as for the local stack's agents, which share its state directory.
    """
    return [Path(ferry_state_dir) / protocol.VOLUMES_DIR, Path(instances_dir).parent / protocol.VOLUMES_DIR]


def operation_delay(operation: str) -> float:
    """Seconds :data:`OPERATION_DELAY_ENV` asks this agent to hold ``operation`` before its work (0: none)."""
    for item in os.environ.get(OPERATION_DELAY_ENV, "").split(","):
        name, _, seconds = item.strip().partition("=")
        if name in (operation, "*"):
            try:
                return max(0.0, float(seconds))
            except ValueError:
                return 0.0
    return 0.0


# The volume files a spawn makes: each listed before it is made, with its identity (``disks.file_identity``)
# once made, so that undoing the spawn removes only a file it made, never one another attempt put there.
CreatedVolumes = dict[Path, tuple[int, int] | None]


def _created_volumes(record: dict[str, Any]) -> CreatedVolumes:
    """The volume files a spawn record lists, with the identity it recorded for each (None: none)."""
    identities = record.get("created_volume_files")
    identities = identities if isinstance(identities, dict) else {}
    created: CreatedVolumes = {}
    for path in record.get("created_volumes", []):
        made = identities.get(path)
        if isinstance(made, list) and len(made) == 2 and all(isinstance(n, int) for n in made):
            created[Path(path)] = (made[0], made[1])
        else:
            created[Path(path)] = None
    return created


def _spawn_record(operation_id: str, created_volumes: CreatedVolumes, undone: bool = False) -> dict[str, Any]:
    """A spawn's record: the spawn, the volume files it makes and the identity of each made; ``undone``
    (:data:`SPAWN_UNDONE`): the spawn failed, and the files it lists are left to remove."""
    record: dict[str, Any] = {
        "operation_id": operation_id, "created_volumes": [str(p) for p in created_volumes],
        "created_volume_files": {str(p): list(made) for p, made in created_volumes.items() if made is not None},
    }
    if undone:
        record[SPAWN_UNDONE] = True
    return record


class _TakenBack(Exception):
    """The operation's workflow had stopped waiting: what the operation did is taken back instead
    of answering. ``done``: the take-back finished, and the message is settled without an answer;
    else it failed, and the message comes back to try it again."""

    def __init__(self, done: bool) -> None:
        super().__init__("taken back" if done else "taking back failed")
        self.done = done


class _Answer(enum.Enum):
    """What became of an answer sent to Step Functions."""

    TAKEN = "taken"
    # Refused (the workflow no longer waits) and, as far as this call knows, never taken before.
    REFUSED = "refused"
    # Refused after an attempt whose response was lost: the workflow may have taken that one.
    REFUSED_MAYBE_TAKEN = "refused_maybe_taken"
    # Not sent (Step Functions kept failing): the message comes back to be answered again.
    UNSENT = "unsent"
    # As UNSENT, but an attempt's response was lost: it may have been taken.
    UNSENT_MAYBE_TAKEN = "unsent_maybe_taken"


class _NotRun(Exception):
    """The operation was not started: its workflow no longer waits (``awaited`` False) or may not (None)."""

    def __init__(self, awaited: bool | None) -> None:
        super().__init__("not awaited" if awaited is False else "not known to be awaited")
        self.awaited = awaited


class _Claim:
    """An operation this agent runs, or has waiting for its instance's lock or a worker, and the
    copies of its message (same operation id) received meanwhile: they hold no slot, and the
    delivery that claimed the operation keeps them and settles them.

    Deliveries are told apart by SQS message id. A message SQS hands out again (its visibility
    lapsed) keeps only its newest receipt handle, the one SQS honours: ``receipt`` for the claimed
    message, and in ``copies`` (message id to (receipt handle, task token)) for the others. Fields
    change under the agent's claims guard.
    """

    def __init__(self, op: Operation, message_id: str, receipt: str) -> None:
        self.op = op
        self.message_id = message_id
        self.receipt = receipt
        self.copies: dict[str, tuple[str, str | None]] = {}
        # The receipt the claimed message was settled by; SQS may hand it out again after that.
        self.settled_with: str | None = None
        # Set when a copy brings a task token the claim did not know: the keepalive heartbeats it
        # at once rather than at its next beat.
        self.new_token = threading.Event()
        # Set by the keepalive once no workflow waits for any of the claim's task tokens: the
        # operation's disk streams stop (:func:`disks.abandoned_when`).
        self.abandoned = threading.Event()

    def deliveries(self) -> list[tuple[str, str | None]]:
        """(receipt handle, task token) of the claimed message and of each copy."""
        return [(self.receipt, self.op.task_token), *self.copies.values()]

    def other_tokens(self) -> set[str]:
        """The task tokens of the copies that are not the claimed message's: the workflow retried
        the operation while it ran (read under the agent's claims guard)."""
        return {token for _receipt, token in self.copies.values() if token and token != self.op.task_token}


def _refused_unread(exc: Exception) -> bool:
    """Whether a failed call to Step Functions was refused before it could act (a 4xx: throttled,
    invalid), rather than failing in a way that may have let it act (a lost response, a 5xx).

    A refusal that came after the client's own retries (botocore tries a call again on a 5xx or a
    lost connection, unseen here) may follow an attempt Step Functions took: it is no proof."""
    if not isinstance(exc, ClientError) or _retried(exc):
        return False
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return isinstance(status, int) and 400 <= status < 500


def _retried(exc: Exception) -> bool:
    """Whether the client tried the call more than once before this error (see :func:`_refused_unread`)."""
    attempts = exc.response.get("ResponseMetadata", {}).get("RetryAttempts") if isinstance(exc, ClientError) else None
    return isinstance(attempts, int) and attempts > 0


def _message_token(body: Any) -> str | None:
    token = body.get("task_token") if isinstance(body, dict) else None
    return token if isinstance(token, str) and token else None


class HostAgent(MoveOperations):
    """The agent of one host (one hypervisor node).

    Args:
        host: the compute host name (the service's host, as placement and the scheduler know it).
        node: the hypervisor node name (usually the host name).
        cell: the cell the host belongs to (carried in reports).
        queue_url: the host's operation queue; ``None`` creates it from ``queue_prefix`` (see
            :func:`ensure_host_queue`).
        reports_queue_url: where inventory and heartbeat reports go; empty disables reports.
        driver: the hypervisor driver.
        instances_dir: where instance directories and the image cache live.
        state_dir: the agent's own state (the journal).
        volumes_dirs: the only directories in which a message may have this host make or remove a
            volume file (checked once ``..`` and symbolic links are resolved); None: only
            ``volumes`` beside the instances directory. ``python -m hostagent`` passes
            :func:`default_volumes_dirs` unless given ``--volumes-dir``.
        inventory: the inventory to report; ``None`` reports the driver's host capacity.
        queue_prefix: host queue name prefix, needed when ``queue_url`` is None.
        sqs, stepfunctions, s3, cloudwatch: boto3 clients (default: :func:`ferry.aws.client`).
        metrics_namespace: the namespace the agent's metrics are published in (default:
            ``POWERTOOLS_METRICS_NAMESPACE``, else ``Ferry``): the stack's ``MetricsNamespace``.
        metrics_flush_interval: seconds between sends of the buffered metrics to CloudWatch
            (see :mod:`hostagent.metrics`) while :meth:`run` runs; it sends what is left as it returns.
        poll_wait_seconds: SQS long-poll wait (0..20); 0 polls without waiting, pausing
            ``idle_wait_seconds`` when the queue is empty.
        report_interval: seconds between inventory reports (one is sent at start).
        heartbeat_interval: seconds between service heartbeat reports.
        keepalive_interval: seconds between task heartbeats and visibility extensions while an
            operation runs or waits for a worker (at most half the visibility timeout).
        visibility_timeout: how long a received message stays invisible, renewed while it runs.
        max_workers: operations run at once (operations on one instance never overlap).
        max_waiting: operations received beyond ``max_workers``, waiting for a worker: their
            tasks are heartbeat meanwhile, so an operation queued behind a long one on this host
            does not time out while it waits. A copy of an operation already running or waiting
            takes no such place (see :meth:`_claim`).
        power_off_timeout: default seconds a guest gets to shut down before it is forced off.
        use_image_cache: keep downloaded images under ``<instances_dir>/_base`` for later spawns (never
            an image the spawn marks ``cache: false``, such as a cross-cell move's snapshot).
        image_cache_max_age: a cached image no spawn used for this long is deleted (checked with
            each inventory report); None keeps them all. Instance disks never refer to the cache.
        journal_retention: how long finished operations stay in the journal.
        disk_headroom_check: the resize claim (``prep_resize``) refuses a flavor whose disks, fully
            written, do not fit the free space of the instances filesystem.
        disk_overcommit_ratio: how far that check trusts sparse disks to stay sparse: a flavor
            needs its full disk size divided by this ratio free (1.0: the full size).
        hypervisor_call_timeout: seconds a call into the hypervisor may run beyond what it was
            asked to wait (a power-off's timeout) before the hypervisor counts as hung: while one
            hangs, no task is heartbeat (their workflows time out and roll back) and no service
            heartbeat is sent (the host goes down, so nothing new is sent to it); 0 never.
    """

    def __init__(
        self,
        host: str,
        node: str,
        cell: str,
        queue_url: str | None,
        reports_queue_url: str,
        driver: Driver,
        instances_dir: str | Path,
        state_dir: str | Path,
        inventory: dict[str, dict[str, int]] | None = None,
        *,
        queue_prefix: str | None = None,
        sqs: Any = None,
        stepfunctions: Any = None,
        s3: Any = None,
        cloudwatch: Any = None,
        metrics_namespace: str | None = None,
        metrics_flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        poll_wait_seconds: int = 20,
        idle_wait_seconds: float = 0.05,
        report_interval: float = 60.0,
        heartbeat_interval: float = 10.0,
        keepalive_interval: float = DEFAULT_KEEPALIVE_INTERVAL,
        visibility_timeout: int = DEFAULT_VISIBILITY_TIMEOUT,
        max_workers: int = 1,
        max_waiting: int = DEFAULT_MAX_WAITING,
        power_off_timeout: float = 60.0,
        use_image_cache: bool = True,
        image_cache_max_age: timedelta | None = timedelta(days=1),
        journal_retention: timedelta = timedelta(days=15),
        disk_headroom_check: bool = True,
        disk_overcommit_ratio: float = 1.0,
        direct_copies: bool = True,
        volumes_dirs: Iterable[str | Path] | None = None,
        hypervisor_call_timeout: float = DEFAULT_HYPERVISOR_CALL_TIMEOUT,
    ) -> None:
        if queue_url is None and queue_prefix is None:
            raise ValueError("HostAgent needs a queue_url or a queue_prefix to derive it from.")
        if disk_overcommit_ratio <= 0:
            raise ValueError("disk_overcommit_ratio must be positive.")
        if keepalive_interval > visibility_timeout / 2:
            raise ValueError(f"keepalive_interval ({keepalive_interval} s) must be at most half the visibility "
                             f"timeout ({visibility_timeout} s): a running operation's message would reappear.")
        if max_workers < 1 or max_waiting < 0:
            raise ValueError("max_workers must be at least 1 and max_waiting at least 0.")
        self.host = host
        self.node = node
        self.cell = cell
        self.queue_url = queue_url
        self.queue_prefix = queue_prefix
        self.reports_queue_url = reports_queue_url
        self.driver = driver
        self.instances_dir = Path(instances_dir)
        self.state_dir = Path(state_dir)
        self.volumes_dirs = [Path(d) for d in volumes_dirs] if volumes_dirs is not None \
            else [self.instances_dir.parent / protocol.VOLUMES_DIR]
        self.inventory = inventory
        self.sqs = sqs or aws.client("sqs")
        self.sfn = stepfunctions or aws.client("stepfunctions")
        self.s3 = s3 or aws.client("s3")
        self.metrics = MetricsPublisher(
            cloudwatch or aws.client("cloudwatch"),
            metrics_namespace or namespace_from_environment(),
            flush_interval=metrics_flush_interval,
        )
        self.poll_wait_seconds = max(0, min(20, int(poll_wait_seconds)))
        self.idle_wait_seconds = idle_wait_seconds
        self.report_interval = report_interval
        self.heartbeat_interval = heartbeat_interval
        self.keepalive_interval = keepalive_interval
        self.visibility_timeout = visibility_timeout
        self.max_workers = max_workers
        self.max_waiting = max_waiting
        self._workers = threading.BoundedSemaphore(max_workers)
        self.power_off_timeout = power_off_timeout
        self.use_image_cache = use_image_cache
        self.image_cache_max_age = image_cache_max_age
        # Cached images a spawn is using now, by name: never pruned under it.
        self._cache_in_use: Counter[str] = Counter()
        self._cache_guard = threading.Lock()
        self.journal_retention = journal_retention
        self.disk_headroom_check = disk_headroom_check
        self.disk_overcommit_ratio = disk_overcommit_ratio
        self.direct_copies = direct_copies
        self.hypervisor_call_timeout = hypervisor_call_timeout
        # When the hung hypervisor call now withholding the service heartbeats was first seen.
        self._hung_seen: float | None = None
        self.journal: Journal | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        # The operations this agent runs or has waiting, by operation id (see _Claim).
        self._claims: dict[str, _Claim] = {}
        self._claims_guard = threading.Lock()
        # Each instance's lock and how many operations hold it or wait for it (gone at none).
        self._instance_locks: dict[str, tuple[threading.Lock, int]] = {}
        self._instance_locks_guard = threading.Lock()
        self._reporter: threading.Thread | None = None
        self._handlers: dict[str, Callable[[Operation], dict[str, Any]]] = {
            protocol.SPAWN: self.spawn,
            protocol.POWER_OFF: self.power_off,
            protocol.POWER_ON: self.power_on,
            protocol.DESTROY: self.destroy,
            protocol.PREP_RESIZE: self.prep_resize,
            protocol.RESIZE_INSTANCE: self.resize_instance,
            protocol.FINISH_RESIZE: self.finish_resize,
            protocol.CONFIRM_RESIZE: self.confirm_resize,
            protocol.REVERT_RESIZE: self.revert_resize,
            protocol.FINISH_REVERT_RESIZE: self.finish_revert_resize,
            protocol.ATTACH_VOLUME: self.attach_volume,
            protocol.DETACH_VOLUME: self.detach_volume,
            protocol.PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE: self.prep_snapshot_based_resize_at_source,
        }
        # What an operation whose workflow stopped waiting takes back: what it wrote off this host,
        # which the workflow's rollback (another host, or a Lambda) may have deleted before, and a
        # guest it made here, which the rollback's own host operation may never come to destroy
        # (its Task, waiting behind this one, may time out too) while the rollback restores the
        # server elsewhere. Each may run again (a take-back cut short goes on when its message comes
        # back) and leaves what a later operation of the instance made.
        self._take_back: dict[str, Callable[[Operation], None]] = {
            protocol.RESIZE_INSTANCE: self.take_back_sent_disks,
            protocol.PREP_SNAPSHOT_BASED_RESIZE_AT_SOURCE: self.take_back_snapshot,
            protocol.SPAWN: self.take_back_guest,
            protocol.FINISH_RESIZE: self.take_back_guest,
        }

    # -- lifecycle

    def start(self) -> None:
        """Prepare directories, the journal and the queue, and send the first reports.

        :meth:`run` calls it; tests may call it to drive :meth:`process_message` by hand.
        """
        if self._started.is_set():
            return
        self.instances_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.state_dir / "journal.sqlite")
        for leftover in disks.remove_partial_files(self.instances_dir):
            logger.info("removed a file an interrupted write left", extra={"host": self.host, "path": str(leftover)})
        for directory in self.volumes_dirs:
            # Shared storage: another host may be writing a volume there, and holds its file meanwhile.
            for leftover in disks.remove_abandoned_parts(directory):
                logger.info("removed a file an interrupted volume write left",
                            extra={"host": self.host, "path": str(leftover)})
        for entry in self.journal.in_progress():
            # The message comes back after its visibility timeout and the operation runs again (or,
            # its workflow no longer waiting, what it did is taken back).
            if entry.status == TAKING_BACK:
                logger.warning("taking back an abandoned operation, interrupted by the last stop, goes on when "
                               "its message comes back", extra=self._entry_context(entry))
            else:
                logger.warning(
                    "operation interrupted by the last stop will run again when redelivered",
                    extra=self._entry_context(entry),
                )
        if self.queue_url is None:
            assert self.queue_prefix is not None
            self.queue_url = ensure_host_queue(self.sqs, self.queue_prefix, self.host, self.visibility_timeout)
        if not self.reports_queue_url:
            logger.warning(
                "no host reports queue configured: inventory and heartbeats are not reported", extra={"host": self.host}
            )
        self.send_inventory()
        self.send_heartbeat()
        self._started.set()
        logger.info(
            "host agent started",
            extra={"host": self.host, "node": self.node, "cell": self.cell, "queue_url": self.queue_url},
        )

    def stop(self) -> None:
        """Ask the agent to stop: it stops polling, finishes running operations, and :meth:`run` returns."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def install_signal_handlers(self) -> None:
        """Stop on SIGTERM and SIGINT (call from the main thread)."""

        def _handle(signum: int, _frame: Any) -> None:
            logger.info("stop requested", extra={"host": self.host, "signal": signal.Signals(signum).name})
            self.stop()

        signal.signal(signal.SIGTERM, _handle)
        signal.signal(signal.SIGINT, _handle)

    def run(self) -> None:
        """Poll and run operations until :meth:`stop`; running operations finish before it returns.

        The metrics are sent to CloudWatch meanwhile, and what is left of them as it returns.
        """
        self.metrics.start()
        try:
            self.start()
            self._reporter = threading.Thread(target=self._report_loop, name=f"reports-{self.host}", daemon=True)
            self._reporter.start()
            watcher = threading.Thread(target=self._watch_loop, name=f"hypervisor-watch-{self.host}", daemon=True)
            watcher.start()
            taken = self.max_workers + self.max_waiting  # messages held at once, running or waiting for a worker
            slots = threading.BoundedSemaphore(taken)
            with ThreadPoolExecutor(max_workers=taken, thread_name_prefix=f"op-{self.host}") as pool:
                while not self._stop.is_set():
                    if not slots.acquire(timeout=0.5):
                        continue
                    message = self._receive()
                    if message is None:
                        slots.release()
                        continue
                    if self._stop.is_set():
                        self._release(message["ReceiptHandle"])
                        slots.release()
                        break
                    pool.submit(self._process_in_slot, message, slots)
            self._reporter.join()
        finally:
            self.metrics.close()
        logger.info("host agent stopped", extra={"host": self.host})

    def _process_in_slot(self, message: dict[str, Any], slots: threading.BoundedSemaphore) -> None:
        try:
            self.process_message(message)
        except Exception:
            # The message stays on the queue: it is redelivered and, failing often enough, dead-lettered.
            logger.exception(
                "processing a message failed", extra={"host": self.host, "message_id": message.get("MessageId")}
            )
        finally:
            slots.release()

    def _receive(self) -> dict[str, Any] | None:
        try:
            response = self.sqs.receive_message(
                QueueUrl=self.queue_url,
                MaxNumberOfMessages=1,
                WaitTimeSeconds=self.poll_wait_seconds,
                VisibilityTimeout=self.visibility_timeout,
                AttributeNames=["ApproximateReceiveCount"],
            )
        except (ClientError, BotoCoreError) as exc:
            logger.warning("polling the host queue failed", extra={"host": self.host, "error": str(exc)})
            self._stop.wait(min(5.0, max(self.idle_wait_seconds, 1.0)))
            return None
        messages = response.get("Messages") or []
        if not messages:
            if self.poll_wait_seconds == 0:
                self._stop.wait(self.idle_wait_seconds)
            return None
        return dict(messages[0])

    def _release(self, receipt: str) -> None:
        """Make a received message visible again at once: for the next agent (one received while
        stopping), or to be taken again."""
        try:
            self.sqs.change_message_visibility(QueueUrl=self.queue_url, ReceiptHandle=receipt, VisibilityTimeout=0)
        except (ClientError, BotoCoreError) as exc:
            logger.warning("releasing a message failed", extra={"host": self.host, "error": str(exc)})

    # -- messages

    def process_message(self, message: dict[str, Any]) -> None:
        """Handle one SQS message: validate, answer from the journal or run, answer, delete.

        A message that cannot be parsed is answered with ``Ferry.InvalidOperation`` (when it has a
        task token) and deleted. A message whose answer could not be delivered for a reason other
        than the workflow having moved on stays on the queue, to be answered from the journal. A
        message whose workflow no longer waits is deleted without running its operation; one held
        by an injected timeout (drills) stays taken and unanswered until the fault lets go. A copy
        of the message of an operation this agent already runs or has waiting (SQS delivered it
        again, or the workflow retries) returns at once: that delivery keeps it and settles it.
        """
        if self.journal is None:
            self.start()
        assert self.journal is not None
        receipt = message["ReceiptHandle"]
        try:
            body: Any = json.loads(message.get("Body") or "")
        except ValueError:
            body = None
        try:
            op = parse_message(body)
        except errors.InvalidOperation as exc:
            context = {
                "host": self.host,
                "message_id": message.get("MessageId"),
                "operation": body.get("operation") if isinstance(body, dict) else None,
                "operation_id": body.get("operation_id") if isinstance(body, dict) else None,
            }
            logger.warning("invalid operation message deleted", extra={**context, "error": exc.message})
            self._count_failure(str(context["operation"] or "unknown"))
            token = _message_token(body)
            if token:
                self._answer(token, None, exc.name, exc.message, context)
            self._delete(receipt)
            return

        context = {**self._context(op), "receive_count": message.get("Attributes", {}).get("ApproximateReceiveCount")}
        recorded = self.journal.get(op.operation_id)
        # Not for an operation that may take back what it sent: its run decides under the
        # instance's lock, and a copy answered meanwhile would make it take back what it must not.
        if recorded is not None and recorded.finished and recorded.answers(op.task_token) \
                and op.name not in self._take_back:
            logger.info(
                "operation already done: answering from the journal", extra={**context, "status": recorded.status}
            )
            self._settle(op, receipt, recorded.result, recorded.error, recorded.cause, context)
            return

        try:
            # A timeout armed for this operation (tests and drills; off unless configured): the host goes quiet.
            faults.check_timeout(*faults.host_points(self.host, op.name, op.operation_id))
        except faults.InjectedTimeout as timeout:
            self._hold(message, timeout, context)
            return
        # Without a message id (a message handed in by hand) a delivery is told apart by its receipt.
        claim = self._claim(op, message.get("MessageId") or receipt, receipt, context)
        if claim is None:
            return
        settled = False
        try:
            settled = self._run_and_settle(claim, context)
        finally:
            self._end_claim(claim, settled, context)

    def _claim(self, op: Operation, message_id: str, receipt: str, context: dict[str, Any]) -> _Claim | None:
        """Claim ``op`` for this delivery; None when this agent already runs it or has it waiting.

        Such a copy of its message is added to that claim rather than waiting for the operation
        with a slot of its own, which copies of a long operation would otherwise fill, keeping
        other instances' operations from being received: the claiming delivery keeps the copy
        invisible and its task heartbeat, and settles it once the operation ends (:meth:`_end_claim`).
        A message the claim holds already (SQS handed it out again) is kept by its newest receipt
        handle only. A copy bringing a task token new to the claim has it heartbeat at once.
        """
        with self._claims_guard:
            claim = self._claims.get(op.operation_id)
            if claim is None:
                claim = self._claims[op.operation_id] = _Claim(op, message_id, receipt)
                return claim
            again = message_id == claim.message_id
            if again:
                claim.receipt = receipt
            else:
                known = {token for _receipt, token in claim.deliveries()}
                claim.copies[message_id] = (receipt, op.task_token)
                if op.task_token and op.task_token not in known:
                    claim.new_token.set()
        if again:
            logger.info("the message of an operation this agent runs or has waiting came back: kept by its "
                        "newest receipt", extra=context)
        else:
            logger.info("a copy of an operation this agent runs or has waiting: settled when it ends", extra=context)
        return None

    def _end_claim(self, claim: _Claim, settled: bool, context: dict[str, Any]) -> None:
        """Forget ``claim`` and settle the copies of its message received meanwhile.

        A copy with the claim's task token shares its message's fate (``settled``: a delete of that
        one was attempted, it being answered or no longer awaited): deleted too, else back in
        :data:`UNSURE_REDELIVERY_SECONDS`. A copy with another token (the workflow retrying the
        operation) is made visible at once, to be answered from the journal or run as a delivery
        of its own.
        """
        with self._claims_guard:
            del self._claims[claim.op.operation_id]
            copies = list(claim.copies.values())
            if claim.settled_with is not None and claim.receipt != claim.settled_with:
                # Handed out again while it was being settled: its newest receipt goes the same way.
                copies.append((claim.receipt, claim.op.task_token))
        for receipt, token in copies:
            if token != claim.op.task_token:
                self._release(receipt)
            elif settled:
                self._delete(receipt)
            else:
                self._redeliver_later(receipt, context)

    def _run_and_settle(self, claim: _Claim, context: dict[str, Any]) -> bool:
        """Run the claimed operation and settle its message (by its newest receipt handle).

        Returns:
            True when a delete of the message was attempted: it was answered, or its workflow no
            longer waits (a delete that failed only brings it back, to be answered from the
            journal). False when it is left to come back soon.
        """
        op = claim.op
        try:
            result, error, cause = self._run(claim, context)
        except _NotRun as not_run:
            self._record_not_started(op, not_run.awaited, context)
            if not_run.awaited is False:
                self._delete(self._settling(claim))
                return True
            self._redeliver_later(self._settling(claim), context)
            return False
        except _TakenBack as taken:
            if taken.done:
                self._delete(self._settling(claim))
                return True
            self._redeliver_later(self._settling(claim), context, TAKE_BACK_RETRY_SECONDS)
            return False
        return self._settle(op, self._settling(claim), result, error, cause, context, claim)

    def _settling(self, claim: _Claim) -> str:
        """The newest receipt handle of the claimed message, noted as the one it is settled by
        (one handed out later is settled the same way when the claim ends)."""
        with self._claims_guard:
            claim.settled_with = claim.receipt
            return claim.receipt

    def _settle(self, op: Operation, receipt: str, result: dict[str, Any] | None, error: str | None,
                cause: str | None, context: dict[str, Any], claim: _Claim | None = None) -> bool:
        """Answer the message's task and delete the message; an answer that could not be sent
        brings the message back soon, to be answered from the journal well inside the Task's
        heartbeat time. True when a delete of the message was attempted (answered, or no
        longer awaited).

        For an operation that may be taken back, the journal follows its answer: a refused answer
        that no earlier attempt may have delivered means the workflow never had the outcome, and
        what the operation did is taken back (:meth:`_take_back_refused`), unless a copy of the
        message, the workflow retrying the operation, carries a task that may still wait: that
        copy is answered from the journal once the claim ends.
        """
        journal = self.journal if op.name in self._take_back and op.task_token else None
        before = journal.answering(op.operation_id) if journal is not None else None
        answer = self._answer(op.task_token, result, error, cause, context)
        if answer is _Answer.TAKEN:
            self._delete(receipt)
            if journal is not None:  # after the delete: a copy of the message waits for it
                journal.answered(op.operation_id)
            return True
        if journal is not None:
            if answer is _Answer.UNSENT and before is None:
                journal.unanswered(op.operation_id)
            elif answer is _Answer.REFUSED and before is None:
                if self._awaited_by_a_copy(claim, context):
                    logger.info("the answer was refused, but the workflow retried the operation: the retry is "
                                "answered with this outcome", extra=context)
                    self._delete(receipt)
                    return True
                return self._take_back_refused(op, receipt, context)
            elif answer in (_Answer.REFUSED, _Answer.REFUSED_MAYBE_TAKEN):
                logger.warning("an answer of this operation may have been taken before: nothing is taken back",
                               extra=context)
        if answer in (_Answer.UNSENT, _Answer.UNSENT_MAYBE_TAKEN):
            self._redeliver_later(receipt, context)
            return False
        self._delete(receipt)
        return True

    def _take_back_refused(self, op: Operation, receipt: str, context: dict[str, Any]) -> bool:
        """Take back what ``op`` did, its answer refused while never taken before (the Task timed
        out as it was answered), and settle its message as :meth:`_settle` does.

        Under the instance's lock, and only while the journal still holds this delivery's
        unanswered outcome: another delivery may have moved the operation on meanwhile.
        """
        assert self.journal is not None
        with self._instance_lock(op.instance_uuid):
            entry = self.journal.get(op.operation_id)
            if entry is None or not entry.run_for(op.task_token) or entry.status not in (SUCCEEDED, FAILED) \
                    or entry.answer != ANSWER_SENDING:
                self._delete(receipt)
                return True
            done = self._take_back_now(op, context)
        if done:
            self._delete(receipt)
            return True
        self._redeliver_later(receipt, context, TAKE_BACK_RETRY_SECONDS)
        return False

    def _take_back_now(self, op: Operation, context: dict[str, Any]) -> bool:
        """Take back what ``op`` did, its workflow having stopped waiting (see ``_take_back``); whether it is done.

        Only for this delivery's own run, whose answer was never taken, and under the instance's
        lock (the caller holds it): a copy of the message answered from the journal belongs to a
        run whose answer may have been taken, and the workflow then goes on with what it did.
        Journaled as ``taking_back`` first: a crash during the take-back never leaves a success
        naming what is gone, and the take-back goes on when the message comes back. Once done,
        the journal records it taken back, so that a new message for the operation (a retry with
        a new task) runs it again rather than answering with what is gone. A failure to take back
        is logged and counted, and left to the message's next delivery; ``ferry audit`` and the
        bucket's lifecycle rules find what is left should it never come.
        """
        assert self.journal is not None
        self.journal.taking_back(op.operation_id)
        try:
            self._take_back[op.name](op)
        except Exception:
            logger.exception("taking back what an abandoned operation did failed: tried again when its message "
                             "comes back", extra=context)
            self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, op.name)
            return False
        abandoned = errors.HostOperationFailed("Its workflow stopped waiting; what it did was taken back.")
        self.journal.taken_back(op.operation_id, abandoned.name, abandoned.message)
        logger.warning("what the abandoned operation sent was taken back", extra=context)
        return True

    def _take_back_left(self, op: Operation, recorded: JournalEntry, context: dict[str, Any]) -> bool:
        """Settle what an earlier run of ``op`` left, before the operation is answered from the
        journal or run: a take-back cut short is finished (whatever the message); a run of this
        message cut short (``in_progress``) or whose outcome was never answered is taken back
        when its workflow no longer waits. Under the instance's lock (the caller holds it).

        Returns:
            True when Step Functions was asked and the workflow still waits.

        Raises:
            _TakenBack: this message's run was taken back (or its take-back failed).
            _NotRun: Step Functions cannot tell now whether the workflow waits.
        """
        if recorded.status == TAKING_BACK:
            logger.warning("taking back an abandoned operation, cut short, goes on", extra=context)
            done = self._take_back_now(op, context)
            if not done or recorded.run_for(op.task_token):
                raise _TakenBack(done)
            return False  # a new task for the operation: it runs again
        if not recorded.run_for(op.task_token):
            return False
        if recorded.status == TAKEN_BACK:
            raise _TakenBack(True)
        if recorded.status != IN_PROGRESS and recorded.answer is not None:
            return False
        assert op.task_token is not None
        awaited = self._still_awaited(op.task_token, context)
        if awaited is None:
            raise _NotRun(None)
        if awaited:
            return True
        logger.warning("an earlier run of this operation was cut short or never answered, and its workflow no "
                       "longer waits: what it did is taken back", extra={**context, "status": recorded.status})
        raise _TakenBack(self._take_back_now(op, context))

    def _run(
        self, claim: _Claim, context: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, str | None, str | None]:
        """Run the claimed operation under the journal; return (result, error name, cause).

        An operation found finished once its instance's lock is held is answered with that run's
        outcome instead of running again: a delivery that found no outcome in the journal when it
        was received but claimed the operation only after the run that held it had ended, or one
        of an operation that may take back what it did (answered from the journal only here, once
        what an earlier run left is settled: :meth:`_take_back_left`).

        Raises:
            _NotRun: the workflow no longer waits for the operation, or Step Functions cannot tell;
                the operation was not started.
            _TakenBack: the operation ran (now or in an earlier run of this message), but its
                workflow stopped waiting; what it did was taken back.
        """
        assert self.journal is not None
        op = claim.op
        with self._keepalive(claim, context), self._instance_lock(op.instance_uuid):
            recorded = self.journal.get(op.operation_id)
            awaited = False
            if recorded is not None and op.name in self._take_back:
                awaited = self._take_back_left(op, recorded, context)
                recorded = self.journal.get(op.operation_id)
            if recorded is not None and recorded.finished and recorded.answers(op.task_token):
                logger.info("operation done meanwhile: answering from the journal", extra=context)
                return recorded.result, recorded.error, recorded.cause
            with self._worker():
                return self._run_here(op, context, recorded, awaited, claim)

    def _run_here(
        self, op: Operation, context: dict[str, Any], earlier: JournalEntry | None, awaited: bool = False,
        claim: _Claim | None = None,
    ) -> tuple[dict[str, Any] | None, str | None, str | None]:
        """Run ``op`` now, under its instance's lock and a worker, journaling its outcome.

        ``earlier``: the journal's entry of an earlier run of the operation (None when it never ran).

        ``awaited``: Step Functions was just asked and the workflow waits (it is not asked again first).

        ``claim``: the delivery's claim: its ``abandoned`` is set once no workflow waits for the
        operation, whose disk streams then stop (``OperationAbandoned``), rather than holding the
        instance's lock and a worker to their end; the copies it holds may carry the task of a
        workflow that retried the operation, which then takes the outcome.

        Raises:
            _NotRun, _TakenBack: as :meth:`_run`.
        """
        assert self.journal is not None
        result: dict[str, Any] | None = None
        error: str | None = None
        cause: str | None = None
        if self.hung_hypervisor_call() is not None:
            # Not started (its task is not heartbeat either): the message comes back later, and
            # runs once the hypervisor answers, or is dropped once its workflow stopped waiting.
            logger.warning("the hypervisor hangs: the operation is left for its message's next delivery",
                           extra=context)
            raise _NotRun(None)
        if op.task_token and not awaited:
            waits = self._still_awaited(op.task_token, context)
            if not waits:
                raise _NotRun(waits)
        cut_short = earlier is not None and not earlier.finished
        self.journal.start(op.operation_id, op.name, op.instance_uuid, op.task_token)
        logger.info("operation started", extra=context)
        started = time.monotonic()
        try:
            delay = operation_delay(op.name)
            if delay:
                self._stop.wait(delay)
            # A fault armed for this operation (tests and drills; off unless configured) fails it here.
            faults.check(*faults.host_points(self.host, op.name, op.operation_id))
            with disks.abandoned_when(claim.abandoned if claim is not None else None):
                result = self._handlers[op.name](op)
        except errors.FerryError as exc:
            failure = exc
            if cut_short and op.name in _NOTHING_REMOVED_ON_HYPERVISOR_ERROR \
                    and isinstance(exc, errors.HypervisorError):
                failure = errors.HostOperationFailed(
                    f"{exc.message} An earlier run of this operation was cut short: it may have removed the "
                    f"guest or its disks already.", instance_uuid=op.instance_uuid)
            error, cause = failure.name, failure.message
        except Exception as exc:
            logger.exception("operation failed unexpectedly", extra=context)
            wrapped = errors.HostOperationFailed(f"{type(exc).__name__}: {exc}")
            error, cause = wrapped.name, wrapped.message
        duration_ms = (time.monotonic() - started) * 1000
        if op.task_token and op.name in self._take_back and self._still_awaited(op.task_token, context) is False \
                and not self._awaited_by_a_copy(claim, context):
            # The Task timed out while the operation ran: nobody takes its answer, and the
            # rollback may already have deleted what it sent. Asked before the outcome is
            # journaled: a delivery of the message that claims the operation once this claim
            # ends would answer from the journal, and Step Functions would then refuse this
            # question just as it does for a Task that timed out. Unless the workflow retried
            # the operation meanwhile (a copy with a task of its own still waits): that copy is
            # answered with this outcome, from the journal, once this claim ends.
            raise _TakenBack(self._take_back_now(op, context))
        # Journaled before the instance's lock and the claim go: a delivery of the message that
        # claims the operation afterwards finds the outcome and answers with it, never running
        # the operation again.
        if error is None:
            assert result is not None
            self.journal.succeed(op.operation_id, result)
            logger.info("operation succeeded", extra={**context, "duration_ms": round(duration_ms, 1)})
        else:
            assert cause is not None
            self.journal.fail(op.operation_id, error, cause)
            logger.warning(
                "operation failed",
                extra={**context, "error": error, "cause": cause, "duration_ms": round(duration_ms, 1)},
            )
            self._count_failure(op.name)
        self._emit_metric("HostOperationDuration", MetricUnit.Milliseconds, duration_ms, op.name)
        return result, error, cause

    def _answer(
        self,
        token: str | None,
        result: dict[str, Any] | None,
        error: str | None,
        cause: str | None,
        context: dict[str, Any],
    ) -> _Answer:
        """Send the answer for ``token``; say what became of it (without a token: taken)."""
        if not token:
            return _Answer.TAKEN
        failure: Exception | None = None
        maybe_taken = False  # an attempt's response was lost: Step Functions may have taken it
        for attempt in range(STEP_FUNCTIONS_ATTEMPTS):
            if attempt:
                self._stop.wait(attempt * STEP_FUNCTIONS_RETRY_SECONDS)
            try:
                if error is None:
                    self.sfn.send_task_success(taskToken=token, output=json.dumps(result or {}))
                else:
                    self.sfn.send_task_failure(
                        taskToken=token, error=error[:_MAX_ERROR_LEN], cause=(cause or "")[:_MAX_CAUSE_LEN]
                    )
                return _Answer.TAKEN
            except self._task_gone_errors() as exc:
                # The workflow gave up on this task (timed out or ended): the answer is stale, nobody waits for it.
                logger.warning(
                    "the workflow no longer waits for this answer: dropped",
                    extra={**context, "error": type(exc).__name__},
                )
                # After the client's own retries the refusal may answer a second try of an answer
                # the first one delivered (its response lost): maybe taken.
                return _Answer.REFUSED_MAYBE_TAKEN if maybe_taken or _retried(exc) else _Answer.REFUSED
            except (ClientError, BotoCoreError) as exc:
                # Throttling or a 5xx; moto also answers a 500 while another execution is starting.
                failure = exc
                maybe_taken = maybe_taken or not _refused_unread(exc)
        logger.warning(
            "answering the workflow failed; the message will be answered again",
            extra={**context, "error": str(failure)},
        )
        return _Answer.UNSENT_MAYBE_TAKEN if maybe_taken else _Answer.UNSENT

    def _task_gone_errors(self) -> tuple[type[Exception], ...]:
        """What Step Functions answers about a task token whose Task no longer waits (timed out, or ended)."""
        exceptions = self.sfn.exceptions
        return (exceptions.TaskTimedOut, exceptions.InvalidToken, exceptions.TaskDoesNotExist)

    def _awaited_by_a_copy(self, claim: _Claim | None, context: dict[str, Any]) -> bool:
        """Whether a copy of the claimed message carries another task that a workflow may still
        wait for (or Step Functions cannot tell now): what the operation did is then that task's
        outcome, never to be taken back."""
        if claim is None:
            return False
        with self._claims_guard:
            others = claim.other_tokens()
        return any(self._still_awaited(token, context) is not False for token in others)

    def _still_awaited(self, token: str, context: dict[str, Any]) -> bool | None:
        """Whether a workflow still waits for ``token``'s answer; None when Step Functions cannot tell now.

        Asked with a task heartbeat, which also tells a waiting workflow that the host took the task.
        """
        failure: Exception | None = None
        for attempt in range(STEP_FUNCTIONS_ATTEMPTS):
            if attempt:
                self._stop.wait(attempt * STEP_FUNCTIONS_RETRY_SECONDS)
            try:
                self.sfn.send_task_heartbeat(taskToken=token)
                return True
            except self._task_gone_errors() as exc:
                logger.warning(
                    "the workflow no longer waits for this operation", extra={**context, "error": type(exc).__name__}
                )
                return False
            except (ClientError, BotoCoreError) as exc:
                failure = exc
        logger.warning(
            "asking whether the workflow still waits for this operation failed",
            extra={**context, "error": str(failure)},
        )
        return None

    def _record_not_started(self, op: Operation, awaited: bool | None, context: dict[str, Any]) -> None:
        if awaited is False:
            logger.warning("operation dropped without running: its workflow timed out or ended", extra=context)
        else:
            logger.warning("operation not started: it runs when its message comes back", extra=context)
        self._emit_metric("HostOperationNotStarted", MetricUnit.Count, 1, op.name)

    def _redeliver_later(self, receipt: str, context: dict[str, Any], seconds: int = UNSURE_REDELIVERY_SECONDS) -> None:
        """Let the message come back in ``seconds`` (:data:`UNSURE_REDELIVERY_SECONDS` by default)
        rather than its full visibility timeout."""
        try:
            self.sqs.change_message_visibility(
                QueueUrl=self.queue_url, ReceiptHandle=receipt, VisibilityTimeout=seconds
            )
        except (ClientError, BotoCoreError) as exc:
            logger.warning("shortening the message's visibility failed", extra={**context, "error": str(exc)})

    def _hold(self, message: dict[str, Any], timeout: faults.InjectedTimeout, context: dict[str, Any]) -> None:
        """Keep ``message`` taken and unanswered while the timeout fault that fired for it holds (drills).

        No answer, failure or task heartbeat goes out, so its Task state times out. The message stays
        invisible (its visibility is extended) so the queue does not hand it out again; its worker is
        free for other messages (the workflow's rollback comes to this host too). When the fault lets
        go (disarmed, re-armed, or its ``hold_seconds`` are over) or the agent stops, the message is
        made visible at once and taken again like any other: a host that comes back finds its queue.
        """
        logger.warning(
            "operation held by an injected timeout: no answer, no heartbeat", extra={**context, "point": timeout.point}
        )
        thread = threading.Thread(
            target=self._keep_held, args=(message, timeout, context), name=f"held-{timeout.fired_id}", daemon=True
        )
        thread.start()

    def _keep_held(self, message: dict[str, Any], timeout: faults.InjectedTimeout, context: dict[str, Any]) -> None:
        interval = max(HOLD_POLL_SECONDS, min(self.keepalive_interval, self.visibility_timeout / 3))
        extend_at = time.monotonic() + interval
        while not self._stop.wait(HOLD_POLL_SECONDS):
            try:
                if not faults.holding(timeout):
                    break
            except (OSError, ValueError) as exc:  # the faults file is unreadable: let the operation go
                logger.warning("reading the armed faults failed", extra={**context, "error": str(exc)})
                break
            if time.monotonic() >= extend_at:
                extend_at = time.monotonic() + interval
                try:
                    self.sqs.change_message_visibility(
                        QueueUrl=self.queue_url,
                        ReceiptHandle=message["ReceiptHandle"],
                        VisibilityTimeout=self.visibility_timeout,
                    )
                except (ClientError, BotoCoreError) as exc:
                    logger.warning("extending a held message's visibility failed", extra={**context, "error": str(exc)})
        logger.info("held operation let go: its message is visible again", extra=context)
        self._release(message["ReceiptHandle"])

    def _delete(self, receipt: str) -> None:
        try:
            self.sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=receipt)
        except (ClientError, BotoCoreError) as exc:
            # A redelivery is answered from the journal.
            logger.warning("deleting a message failed", extra={"host": self.host, "error": str(exc)})

    @contextmanager
    def _keepalive(self, claim: _Claim, context: dict[str, Any]) -> Iterator[None]:
        """While the block runs, heartbeat the claim's tasks and keep its message and copies invisible.

        The first beat comes within a second (a message that came back late and waits for a
        worker has little of its Task's heartbeat time left), then one every keepalive interval.
        A copy that brings a new task token (the workflow retrying) has it heartbeat at once too,
        not at the next beat: its Task may have little heartbeat time left as well.

        The heartbeats and the visibility extensions beat on threads of their own: a slow SQS
        (its calls retried for minutes) never holds a heartbeat back past HostOpHeartbeatSeconds,
        which would time out a healthy operation. Once the block ends they are waited for
        :data:`KEEPALIVE_JOIN_SECONDS` at most: one stuck in a call ends by itself, after the answer.
        """
        done = threading.Event()

        def heartbeat() -> None:
            gone: set[str] = set()  # tokens whose workflow stopped waiting: their messages are kept alive only
            beaten: set[str] = set()
            withheld = False  # whether the beats were withheld for a hung hypervisor (logged once)
            due = time.monotonic() + min(self.keepalive_interval, KEEPALIVE_FIRST_BEAT_SECONDS)
            while True:
                claim.new_token.wait(max(0.0, due - time.monotonic()))
                claim.new_token.clear()
                if done.is_set():  # after the clear: the wake-up that ends the beat is never lost
                    return
                with self._claims_guard:
                    deliveries = claim.deliveries()
                tokens = dict.fromkeys(token for _receipt, token in deliveries if token)
                if time.monotonic() < due:  # woken by a copy: only its new task is heartbeat now
                    tokens = dict.fromkeys(token for token in tokens if token not in beaten)
                else:
                    due = time.monotonic() + self.keepalive_interval
                hung = self.hung_hypervisor_call()
                if hung is not None:  # the task times out and its workflow rolls back without this host
                    if not withheld:
                        logger.warning("the hypervisor hangs: this operation's task is no longer heartbeat and "
                                       "its disk streams stop",
                                       extra={**context, "call": hung.method, "seconds": round(hung.seconds)})
                        claim.abandoned.set()
                    withheld = True
                    continue
                if withheld:
                    logger.info("the hypervisor answers again: this operation's task is heartbeat again",
                                extra=context)
                    withheld = False
                for token in tokens:
                    beaten.add(token)
                    self._keepalive_heartbeat(token, gone, context)
                awaited = {token for _receipt, token in deliveries if token}
                if awaited and awaited <= gone and not claim.abandoned.is_set():
                    logger.warning("no workflow waits for this operation any more: its disk streams stop",
                                   extra=context)
                    claim.abandoned.set()

        def extend_visibility() -> None:
            wait = min(self.keepalive_interval, KEEPALIVE_FIRST_BEAT_SECONDS)
            while not done.wait(wait):
                wait = self.keepalive_interval
                with self._claims_guard:
                    deliveries = claim.deliveries()
                for receipt in dict.fromkeys(receipt for receipt, _token in deliveries):
                    if done.is_set():  # the operation ended: its settle sets the visibility now
                        return
                    try:
                        self.sqs.change_message_visibility(
                            QueueUrl=self.queue_url, ReceiptHandle=receipt, VisibilityTimeout=self.visibility_timeout
                        )
                    except (ClientError, BotoCoreError) as exc:
                        logger.warning("extending the message's visibility failed",
                                       extra={**context, "error": str(exc)})

        threads = [
            threading.Thread(target=heartbeat, name=f"keepalive-{claim.op.operation_id}", daemon=True),
            threading.Thread(target=extend_visibility, name=f"visibility-{claim.op.operation_id}", daemon=True),
        ]
        for thread in threads:
            thread.start()
        try:
            yield
        finally:
            done.set()
            claim.new_token.set()  # wakes the heartbeat to end it
            deadline = time.monotonic() + KEEPALIVE_JOIN_SECONDS
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():  # a call to SQS or Step Functions still under way: it ends alone
                    logger.warning("keepalive call still under way as the operation ends",
                                   extra={**context, "keepalive": thread.name})

    def _keepalive_heartbeat(self, token: str, gone: set[str], context: dict[str, Any]) -> None:
        """Heartbeat ``token``'s task unless it is in ``gone``; add it there when its workflow stopped waiting."""
        if token in gone:
            return
        try:
            self.sfn.send_task_heartbeat(taskToken=token)
        except self._task_gone_errors() as exc:
            logger.warning("task heartbeat failed", extra={**context, "error": str(exc)})
            gone.add(token)
        except (ClientError, BotoCoreError) as exc:
            logger.warning("task heartbeat failed", extra={**context, "error": str(exc)})

    @contextmanager
    def _worker(self) -> Iterator[None]:
        """Hold one of the ``max_workers`` while the block runs, waiting for one first.

        Raises:
            _NotRun: the agent stops while the operation waits (its message comes back soon).
        """
        while not self._workers.acquire(timeout=0.5):
            if self._stop.is_set():
                raise _NotRun(None)
        try:
            if self._stop.is_set():  # handed a worker as the agent stops: the next agent runs it
                raise _NotRun(None)
            yield
        finally:
            self._workers.release()

    @contextmanager
    def _instance_lock(self, instance_uuid: str) -> Iterator[None]:
        with self._instance_locks_guard:
            lock, users = self._instance_locks.get(instance_uuid, (threading.Lock(), 0))
            self._instance_locks[instance_uuid] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._instance_locks_guard:
                lock, users = self._instance_locks[instance_uuid]
                if users == 1:
                    del self._instance_locks[instance_uuid]
                else:
                    self._instance_locks[instance_uuid] = (lock, users - 1)

    def _context(self, op: Operation) -> dict[str, Any]:
        return {
            "host": self.host,
            "operation": op.name,
            "operation_id": op.operation_id,
            "instance_uuid": op.instance_uuid,
        }

    def _entry_context(self, entry: JournalEntry) -> dict[str, Any]:
        return {
            "host": self.host,
            "operation": entry.operation,
            "operation_id": entry.operation_id,
            "instance_uuid": entry.instance_uuid,
        }

    def _emit_metric(self, name: str, unit: MetricUnit, value: float, operation: str) -> None:
        """Buffer one value of the metric ``name`` for CloudWatch, with the dimensions ``Host`` and
        ``Operation``: an operation this agent does not know (a malformed message's) is ``invalid``,
        since a value CloudWatch refuses would lose the whole batch it is sent in."""
        known = operation in self._handlers or operation == "unknown"
        self.metrics.add(name, unit.value, value, {"Host": self.host, "Operation": operation if known else "invalid"})

    def _emit_host_metric(self, name: str, unit: MetricUnit, value: float) -> None:
        """Buffer one value of the metric ``name`` about the host itself (dimension ``Host`` only)."""
        self.metrics.add(name, unit.value, value, {"Host": self.host})

    def _count_failure(self, operation: str) -> None:
        """Count a failed operation (its error name is in the log line that reports it)."""
        self._emit_metric("HostOperationFailed", MetricUnit.Count, 1, operation)

    # -- operations

    def _result(self, instance_uuid: str, power_state: int) -> dict[str, Any]:
        return {"instance_uuid": instance_uuid, "host": self.host, "node": self.node, "power_state": power_state}

    def spawn(self, op: Operation) -> dict[str, Any]:
        """Create the instance's disks and guest, and power it on if asked.

        Volumes are attached by path. A volume the build creates (:meth:`_makes_volume`) whose path
        does not exist yet is a new file-backed volume (the embedded default's volume storage): it
        is created here, sparse, with the content of its ``source_image`` if it has one, only in one
        of the volumes directories (``volumes_dirs``): a spawn that would make one elsewhere is
        refused before anything is touched. So is one whose volume exists already but whose file
        is missing here (:meth:`_check_volume_files`): its data is never replaced by a blank disk.
        An existing path (a block device in production) is never written, nor is a file that
        appears at the path while the spawn writes the volume (another attempt to boot the server
        made it): the spawn then fails and leaves it.

        The instance directory is this spawn's when its record (``spawn.json``) names the
        operation: a guest that exists then is this spawn done before, only powered on if asked,
        and a root disk in it was written by an interrupted attempt. A guest or directory without
        that record is an earlier operation's leftover (a spawn goes only to a host the server is
        new to) and is removed first. On failure the spawn leaves nothing behind: no guest, no
        instance directory, no volume file it created (in any attempt) that is still the file it made;
        what cannot be removed (a guest that cannot be destroyed, a volume file) stays listed in the
        record, marked undone, for the ``destroy`` that follows or a run again to finish
        (see :meth:`_undo_spawn`).

        Raises:
            SpawnFailed, ImageDownloadFailed, DiskCopyFailed, HypervisorError, InvalidOperation.
        """
        uuid, args = op.instance_uuid, op.args
        self._check_volume_files(op)
        directory = disks.instance_dir(self.instances_dir, uuid)
        record = read_record(directory, SPAWN_RECORD) or {}
        if record.get("operation_id") == op.operation_id:
            if record.get(SPAWN_UNDONE):
                # A guest an attempt that failed could not destroy: built again, on the same volume files.
                self.driver.destroy(uuid)
            elif self.driver.guest_exists(uuid):
                if args["power_on"]:
                    self.driver.power_on(uuid)
                return self._result(uuid, self.driver.guest_power_state(uuid))
        elif self.driver.guest_exists(uuid) or directory.exists():
            logger.warning("removing what an earlier operation left before spawning",
                           extra={**self._context(op), "left_by": record.get("operation_id")})
            self.driver.destroy(uuid)
            disks.remove_dir(directory)
            record = {}
        created_volumes = _created_volumes(record)
        try:
            disks.make_dir(directory, exist_ok=True)
            self._write_spawn_record(op, created_volumes)
            self.driver.define_guest(guest_spec(uuid, args, self._prepare_disks(op, created_volumes)))
            if args["power_on"]:
                self.driver.power_on(uuid)
            return self._result(uuid, self.driver.guest_power_state(uuid))
        except Exception:
            self._undo_spawn(op, created_volumes)
            raise

    @contextmanager
    def _cached_image_in_use(self, name: str | None) -> Iterator[None]:
        """Keep the image cache's ``name`` from being pruned while the block runs (None: nothing)."""
        if name is None:
            yield
            return
        with self._cache_guard:
            self._cache_in_use[name] += 1
        try:
            yield
        finally:
            with self._cache_guard:
                self._cache_in_use[name] -= 1
                if not self._cache_in_use[name]:
                    del self._cache_in_use[name]

    def prune_image_cache(self) -> list[Path]:
        """Delete the cached images no spawn used for ``image_cache_max_age``; return them.

        An image a spawn is using right now is kept whatever its age; one a spawn asks for after
        it was deleted is downloaded again.
        """
        if self.image_cache_max_age is None:
            return []
        cache = self.instances_dir / disks.IMAGE_CACHE_DIR
        with self._cache_guard:
            removed = disks.prune_image_cache(cache, self.image_cache_max_age.total_seconds(), set(self._cache_in_use))
        for path in removed:
            logger.info("cached image removed: unused", extra={"host": self.host, "path": str(path)})
        return removed

    def _undo_spawn(self, op: Operation, created_volumes: CreatedVolumes) -> None:
        """Remove what a failed spawn made: its guest, then the volume files it made, then its
        instance directory. Never raises over the spawn's own error.

        Files go only once the guest is known gone (it may still be writing them), each on its
        own: one that cannot be removed does not keep the others. The volume files go before the
        directory, whose record is the only list of them. What is left is logged and counted,
        and stays listed in the record, marked undone (:data:`SPAWN_UNDONE`), with the directory:
        the ``destroy`` that follows (the workflow's rollback) or a run again of the spawn finishes it.
        """
        context = self._context(op)
        try:
            self.driver.destroy(op.instance_uuid)
        except Exception:
            logger.exception("undoing a failed spawn: its guest could not be destroyed; its disks and volume files "
                             "stay for the destroy that follows", extra=context)
            self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, op.name)
            self._mark_spawn_undone(op, created_volumes)
            return
        if not self._remove_created_volumes(op.instance_uuid, op.name, created_volumes):
            self._mark_spawn_undone(op, created_volumes)
            return
        try:
            disks.remove_instance_dir(self.instances_dir, op.instance_uuid)
        except OSError:
            logger.exception("undoing a failed spawn: its instance directory could not be removed", extra=context)
            self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, op.name)

    def _mark_spawn_undone(self, op: Operation, created_volumes: CreatedVolumes) -> None:
        """Mark the spawn's record undone, listing the volume files it made that are left."""
        directory = disks.instance_dir(self.instances_dir, op.instance_uuid)
        if not directory.is_dir():
            return
        try:
            self._write_spawn_record(op, created_volumes, undone=True)
        except OSError:
            logger.exception("undoing a failed spawn: its record could not be marked undone", extra=self._context(op))
            self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, op.name)

    def _remove_created_volumes(self, instance_uuid: str, operation: str, created_volumes: CreatedVolumes) -> bool:
        """Remove each volume file of ``created_volumes`` that is still the file the spawn made, dropping
        from it those dealt with; whether none is left to try again.

        A file another attempt put at the name since, or one whose making the spawn could not record,
        is left (it may be in use), and so is a path outside the volumes directories: nothing more
        can be done for those. A file that cannot be removed is logged, counted, and kept listed.
        """
        context = {"host": self.host, "operation": operation, "instance_uuid": instance_uuid}
        for path, made in list(created_volumes.items()):
            target = disks.volume_target(path, self.volumes_dirs)
            try:
                if target is None:
                    logger.warning("a volume file the spawn's record names outside the volumes directories is left",
                                   extra={**context, "path": str(path)})
                elif not (made is not None and disks.remove_file_made(target, made)) and os.path.lexists(target):
                    # Another attempt's (another host booting the server made it since), or one whose
                    # making this spawn could not record: it may be in use.
                    logger.warning("a volume file the spawn did not make is left",
                                   extra={**context, "path": str(target)})
            except OSError as exc:
                logger.warning("a volume file the failed spawn made could not be removed: kept listed to try again",
                               extra={**context, "path": str(path), "error": str(exc)})
                self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, operation)
                continue
            del created_volumes[path]
        return not created_volumes

    def remove_volumes_of_undone_spawn(self, instance_uuid: str, operation: str) -> bool:
        """Remove the volume files a failed spawn left listed in its record, marked undone (the guest
        must be gone); whether none is left. Without such a record there is nothing to remove.
        """
        directory = disks.instance_dir(self.instances_dir, instance_uuid)
        record = read_record(directory, SPAWN_RECORD)
        if not record or not record.get(SPAWN_UNDONE):
            return True
        created_volumes = _created_volumes(record)
        done = self._remove_created_volumes(instance_uuid, operation, created_volumes)
        if not done:
            write_record(directory, _spawn_record(str(record.get("operation_id")), created_volumes, undone=True),
                         SPAWN_RECORD)
        return done

    @staticmethod
    def _makes_volume(volume: dict[str, Any]) -> bool:
        """Whether the spawn makes ``volume``'s file when it is missing: a volume the build creates
        (``source_type`` ``blank``, or ``image`` with its ``source_image``), of its ``size_gb``.

        Any other volume exists already, and a file made for it would be a blank disk in place of
        its owner's data. A message from before ``source_type`` was sent gave every volume its
        size, an existing one too: in it only a ``source_image`` tells a volume the build creates.
        """
        if not volume.get("size_gb"):
            return False
        source = volume.get("source_type")
        if source is None:
            return "source_image" in volume
        return source == "blank" or (source == "image" and "source_image" in volume)

    def _check_volume_files(self, op: Operation) -> None:
        """Refuse, before anything is touched, a spawn whose volumes cannot be had as asked: a new
        volume's file outside the volumes directories, or an existing volume's file missing.

        An existing volume's file is missing when its path does not exist and it lies in the
        volumes directories, or the message gives the volume a size (an older message's, for
        which the spawn would have made it). Another path (a block device) is the hypervisor's to
        find.

        Raises:
            InvalidOperation: a new volume's file lies outside the volumes directories.
            SpawnFailed: an existing volume's file is not on this host (its storage not mounted
                here, or the file gone); no file is made for it.
        """
        for volume in op.args["volumes"]:
            path = volume["path"]
            if Path(path).exists():
                continue
            if self._makes_volume(volume):
                self._volume_file(op, path)
            elif volume.get("size_gb") or disks.volume_target(path, self.volumes_dirs) is not None:
                raise errors.SpawnFailed(
                    f"The file of volume {volume['volume_id']} ({path}) is not on host {self.host}; the volume "
                    f"exists already, so no new file is made for it.", instance_uuid=op.instance_uuid
                )

    def _volume_file(self, op: Operation, path: str) -> Path:
        """Where to make or remove ``path``, the file of a volume this host is asked to make or
        remove: ``path`` with its directory resolved now, once the file and that directory are
        known to lie in the volumes directories (:func:`hostagent.disks.volume_target`). Call it
        right before the file is touched.

        Raises:
            InvalidOperation: it lies elsewhere (after ``..`` and symbolic links are resolved).
        """
        target = disks.volume_target(path, self.volumes_dirs)
        if target is None:
            raise errors.InvalidOperation(
                f"The volume file {path} is outside this host's volumes directories "
                f"({', '.join(str(d) for d in self.volumes_dirs)}).", instance_uuid=op.instance_uuid
            )
        return target

    def _write_spawn_record(self, op: Operation, created_volumes: CreatedVolumes, undone: bool = False) -> None:
        """Name the spawn in its instance directory, with the volume files it creates (before it creates
        them) and the identity of each (before the file takes its name); ``undone``: the spawn failed,
        and those files are left to remove."""
        write_record(disks.instance_dir(self.instances_dir, op.instance_uuid),
                     _spawn_record(op.operation_id, created_volumes, undone), SPAWN_RECORD)

    def _record_volume_file(self, op: Operation, created_volumes: CreatedVolumes, target: Path,
                            identity: tuple[int, int]) -> None:
        """Record in the spawn's record that the volume file ``target`` is the file ``identity`` names."""
        created_volumes[target] = identity
        self._write_spawn_record(op, created_volumes)

    def _prepare_disks(self, op: Operation, created_volumes: CreatedVolumes) -> list[DiskSpec]:
        instance_uuid, args = op.instance_uuid, op.args
        flavor, image, volumes = args["flavor"], args["image"], args["volumes"]
        cacheable = self.use_image_cache and image is not None and image.get("cache", True)
        cache = self.instances_dir / disks.IMAGE_CACHE_DIR if cacheable else None
        result: list[DiskSpec] = []
        try:
            disks.instance_dir(self.instances_dir, instance_uuid).mkdir(parents=True, exist_ok=True)
            if image is not None:
                root = disks.root_disk_path(self.instances_dir, instance_uuid)
                if root.exists():
                    # Written by an interrupted attempt: complete and verified, since it appears only by rename.
                    disks.grow(root, flavor["root_gb"] * disks.GiB)
                else:
                    with self._cached_image_in_use(image["sha256"].lower() if cache is not None else None):
                        disks.create_root_disk(self.s3, image, flavor["root_gb"] * disks.GiB, root, cache_dir=cache)
                result.append(DiskSpec(kind=ROOT, path=str(root), device=LOCAL_DEVICES[ROOT], boot=True))
            elif not volumes:
                raise errors.InvalidOperation(
                    "A server without an image needs a boot volume.", instance_uuid=instance_uuid
                )
            if flavor["ephemeral_gb"] > 0:
                path = disks.ephemeral_disk_path(self.instances_dir, instance_uuid)
                disks.create_sparse(path, flavor["ephemeral_gb"] * disks.GiB)
                result.append(DiskSpec(kind=EPHEMERAL, path=str(path), device=LOCAL_DEVICES[EPHEMERAL]))
            if flavor["swap"] > 0:
                path = disks.swap_disk_path(self.instances_dir, instance_uuid)
                disks.create_sparse(path, flavor["swap"] * disks.MiB)
                result.append(DiskSpec(kind=SWAP, path=str(path), device=LOCAL_DEVICES[SWAP]))
            for volume in volumes:
                if Path(volume["path"]).exists() or not self._makes_volume(volume):
                    continue
                # Checked again right before it is written (a root disk's download may have taken
                # minutes since the spawn's first check), and written in its directory as that check
                # resolved it, not through a link put in the path since.
                target = self._volume_file(op, volume["path"])
                size = int(volume["size_gb"]) * disks.GiB
                created_volumes[target] = None
                self._write_spawn_record(op, created_volumes)
                for leftover in disks.remove_abandoned_parts(target.parent, target.name):
                    logger.info("removed a file an interrupted write of the volume left",
                                extra={**self._context(op), "path": str(leftover)})
                source_image = volume.get("source_image")
                # The file's identity is recorded before the file takes its name (a link keeps it):
                # a crash right after still leaves a file an attempt run again knows as its own.
                record_identity = functools.partial(self._record_volume_file, op, created_volumes, target)
                try:
                    # Never over a file made meanwhile: volumes are shared storage, and another
                    # attempt to boot the server (rescheduled to another host while this one ran
                    # long) may have made the volume and booted from it.
                    if source_image:
                        with self._cached_image_in_use(source_image["sha256"].lower() if cache is not None else None):
                            disks.create_root_disk(self.s3, source_image, size, target, cache_dir=cache,
                                                   exclusive=True, record_identity=record_identity)
                    else:
                        disks.create_sparse(target, size, exclusive=True, record_identity=record_identity)
                except disks.FileTaken as exc:
                    del created_volumes[target]
                    self._write_spawn_record(op, created_volumes)
                    raise errors.SpawnFailed(
                        f"The file of volume {volume['volume_id']} ({target}) was made by another attempt to "
                        f"boot instance {instance_uuid} while this one wrote it; it is left to that attempt.",
                        instance_uuid=instance_uuid,
                    ) from exc
                protocol.mark_volume_dir(target.parent)
        except OSError as exc:
            raise errors.SpawnFailed(
                f"Preparing the disks of instance {instance_uuid} failed: {exc}", instance_uuid=instance_uuid
            ) from exc
        return result + volume_disks(volumes, boot_from_volume=image is None)

    def power_off(self, op: Operation) -> dict[str, Any]:
        """Stop the guest (a stopped guest stays stopped).

        Raises:
            GuestNotFound, HypervisorError.
        """
        self.driver.power_off(
            op.instance_uuid,
            timeout=float(op.args.get("timeout", self.power_off_timeout)),
            clean_shutdown=bool(op.args.get("clean_shutdown", True)),
        )
        return self._result(op.instance_uuid, self.driver.guest_power_state(op.instance_uuid))

    def power_on(self, op: Operation) -> dict[str, Any]:
        """Start the guest (a running guest keeps running).

        Raises:
            GuestNotFound, HypervisorError.
        """
        self.driver.power_on(op.instance_uuid)
        return self._result(op.instance_uuid, self.driver.guest_power_state(op.instance_uuid))

    def destroy(self, op: Operation) -> dict[str, Any]:
        """Remove the guest and, unless ``keep_disks``, the instance directory, the old disks a
        move kept here (``<uuid>_resize``: a server deleted after its revert failed) and disks a
        move was copying in (``<uuid>_incoming``). An absent guest is fine. Before the instance
        directory, the volume files a failed spawn made and could not remove (its record, marked
        undone, lists them: see :meth:`_undo_spawn`) are removed while still the files it made.

        The files of the ``volumes`` deleted with the server go last (shared storage: any host
        reaches them); ``volumes_removed`` names those whose file is gone. A volume that is no
        file the hosts make (a block device), whose path is outside the volumes directories
        (``volumes_dirs``), whose file is not seen where its directory is not marked (storage not
        mounted here), or whose file cannot be removed, is left, logged, and not named: the
        server's delete goes on, as Nova's does when a volume's delete fails.

        Raises:
            HypervisorError, HostOperationFailed (the disks cannot be removed).
        """
        uuid = op.instance_uuid
        self.driver.destroy(uuid)
        if not op.args.get("keep_disks", False):
            try:
                # A failed spawn's volume files, which its undo could not remove, before the record listing them.
                if not self.remove_volumes_of_undone_spawn(uuid, op.name):
                    raise OSError("volume files the failed spawn made are left; its record keeps them listed")
                disks.remove_instance_dir(self.instances_dir, uuid)
                disks.remove_dir(disks.resize_dir(self.instances_dir, uuid))
                disks.remove_dir(disks.incoming_dir(self.instances_dir, uuid))
            except OSError as exc:
                raise errors.HostOperationFailed(
                    f"Removing the disks of instance {uuid} failed: {exc}", instance_uuid=uuid
                ) from exc
        removed: list[str] = []
        for volume in op.args.get("volumes", []):
            where = {"host": self.host, "instance_uuid": uuid, "volume_id": volume["volume_id"], "path": volume["path"]}
            target = disks.volume_target(volume["path"], self.volumes_dirs)
            if target is None:
                logger.warning("volume file not removed: refused", extra={
                    **where, "error": "outside this host's volumes directories",
                    "volumes_dirs": [str(d) for d in self.volumes_dirs]})
                continue
            try:
                gone = disks.remove_volume_file(target, volume["volume_id"])
            except OSError as exc:
                logger.warning("volume file not removed", extra={**where, "error": str(exc)})
                continue
            if gone:
                removed.append(volume["volume_id"])
            elif os.path.lexists(volume["path"]) or Path(volume["path"]).name != volume["volume_id"]:
                logger.warning("volume left to its storage: no file the hosts made", extra=where)
            else:
                logger.warning("volume file not seen, in a directory not marked as the volumes': "
                               "the storage may not be mounted here; left as it is", extra=where)
        return {**self._result(uuid, NOSTATE), "volumes_removed": removed}

    # -- reports

    def current_inventory(self) -> dict[str, dict[str, int]]:
        """The inventory to report: the configured one, or the driver's host capacity."""
        if self.inventory is not None:
            return self.inventory
        return inventory_from_capacity(self.driver.host_capacity())

    def _send_report(self, report: dict[str, Any]) -> bool:
        if not self.reports_queue_url:
            return False
        protocol.validate(report, protocol.REPORT_SCHEMA)
        try:
            self.sqs.send_message(QueueUrl=self.reports_queue_url, MessageBody=json.dumps(report))
        except (ClientError, BotoCoreError) as exc:
            logger.warning(
                "sending a host report failed", extra={"host": self.host, "kind": report["kind"], "error": str(exc)}
            )
            return False
        return True

    def _report_base(self, kind: str) -> dict[str, Any]:
        return {
            "kind": kind,
            "host": self.host,
            "node": self.node,
            "cell": self.cell,
            "sent_at": datetime.now(UTC).isoformat(),
        }

    def instance_dirs(self) -> list[str] | None:
        """The names of the directories under the instances directory, the image cache left out.

        ``<uuid>`` holds an instance's live disks, ``<uuid>_resize`` the disks a move set aside;
        the control plane compares them with its records (``ferry audit``). None when the
        directory cannot be read (the report then says nothing about directories).
        """
        try:
            entries = list(os.scandir(self.instances_dir))
        except OSError as exc:
            logger.warning("listing the instances directory failed", extra={"host": self.host, "error": str(exc)})
            return None
        return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False) and e.name != disks.IMAGE_CACHE_DIR)

    def send_inventory(self) -> bool:
        """Report the host's inventory, its guests and its instance directories; True if the report was sent.

        ``sent_at`` is taken before the guests and directories are listed, so the report shows
        at least everything that was done on the host before that time. None is sent while the
        hypervisor hangs: a report also tells the control plane the host is up (see
        :meth:`send_heartbeat`).
        """
        if self.hung_hypervisor_call() is not None:
            return False
        try:
            report = {
                **self._report_base(protocol.REPORT_INVENTORY),
                "inventory": self.current_inventory(),
                "guests": self.driver.list_guests(),
            }
            directories = self.instance_dirs()
            if directories is not None:
                report["instance_dirs"] = directories
        except errors.FerryError as exc:
            logger.warning("reading the host's inventory failed", extra={"host": self.host, "error": exc.message})
            return False
        return self._send_report(report)

    def send_heartbeat(self) -> bool:
        """Report that the host's agent is alive; True if the report was sent. Nothing is sent
        while the hypervisor hangs (:meth:`hung_hypervisor_call`): the host then goes down, so
        the scheduler sends it nothing new and moves from it are refused, until it answers again."""
        if self.hung_hypervisor_call() is not None:
            return False
        return self._send_report(self._report_base(protocol.REPORT_HEARTBEAT))

    def watch_hypervisor(self) -> bool:
        """Look once whether the hypervisor hangs; True if it does. A hang is logged when first
        seen and when it ends, and counted (``HypervisorHung``) at each look while it lasts. Run
        every heartbeat interval by a thread of its own, which never calls the hypervisor: the
        report loop may be the one stuck in it."""
        hung = self.hung_hypervisor_call()
        if hung is None:
            if self._hung_seen is not None:
                logger.warning("the hypervisor answers again: heartbeats resume",
                               extra={"host": self.host, "hung_seconds": round(time.monotonic() - self._hung_seen)})
                self._hung_seen = None
            return False
        if self._hung_seen is None:
            self._hung_seen = time.monotonic()
            logger.error("the hypervisor hangs: heartbeats are withheld, so the host goes down and the workflows "
                         "waiting for it roll back",
                         extra={"host": self.host, "call": hung.method, "seconds": round(hung.seconds)})
        self._emit_host_metric("HypervisorHung", MetricUnit.Count, 1)
        return True

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                self.watch_hypervisor()
            except Exception:
                logger.exception("watching the hypervisor failed", extra={"host": self.host})

    def hung_hypervisor_call(self) -> CallUnderWay | None:
        """The oldest call into the hypervisor running longer than it was asked to wait plus
        ``hypervisor_call_timeout`` (the hypervisor hangs); None when there is none or the watch
        is off."""
        if self.hypervisor_call_timeout <= 0:
            return None
        return next((call for call in self.driver.calls_under_way()
                     if call.seconds > call.allowed + self.hypervisor_call_timeout), None)

    def _report_loop(self) -> None:
        next_inventory = time.monotonic() + self.report_interval
        next_heartbeat = time.monotonic() + self.heartbeat_interval
        while not self._stop.wait(max(0.0, min(next_inventory, next_heartbeat) - time.monotonic())):
            now = time.monotonic()
            try:
                if now >= next_heartbeat:
                    self.send_heartbeat()
                    next_heartbeat = now + self.heartbeat_interval
                if now >= next_inventory:
                    self.send_inventory()
                    next_inventory = now + self.report_interval
                    if self.journal is not None:
                        self.journal.prune(self.journal_retention)
                    self.prune_image_cache()
            except Exception:
                logger.exception("host report failed", extra={"host": self.host})
