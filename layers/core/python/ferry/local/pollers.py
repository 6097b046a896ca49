"""The template's SQS event sources and schedules, played by threads in the local stack.

An :class:`SqsPoller` long-polls its queue and hands batches to the function like Lambda's
event source mapping: messages of a successful batch are deleted; when the function fails,
the whole batch stays and comes back after the visibility timeout (and, past
``maxReceiveCount``, goes to the dead-letter queue); with ``ReportBatchItemFailures`` only the
messages named in ``batchItemFailures`` stay. A mapping with ``ScalingConfig.MaximumConcurrency``
gets that many pollers, each with an execution environment of its own, so that batches run at
once as on Lambda; without it, one.

A :class:`ScheduleRunner` invokes its function every ``rate(...)`` period times ``rate_scale``
(``FERRY_LOCAL_RATE_SCALE``; below 1 to run schedules faster in tests; a number above 0).
cron() expressions are not played locally.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from ferry.errors import LocalStackError
from ferry.local.runtime import FunctionRunner
from ferry.local.template import LocalTemplate, Queue, Schedule, SqsEventSource

log = logging.getLogger("ferry-local")

RATE_SCALE_VARIABLE = "FERRY_LOCAL_RATE_SCALE"
# Long polls are kept short so that stop() returns quickly.
WAIT_TIME_SECONDS = 1


def sqs_event(queue: Queue, region: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The event Lambda's SQS event source mapping gives a function for ``messages``."""
    records = []
    for message in messages:
        attributes = {}
        for name, value in (message.get("MessageAttributes") or {}).items():
            attributes[name] = {
                "stringValue": value.get("StringValue"),
                "binaryValue": value.get("BinaryValue"),
                "stringListValues": value.get("StringListValues", []),
                "binaryListValues": value.get("BinaryListValues", []),
                "dataType": value.get("DataType"),
            }
        records.append(
            {
                "messageId": message["MessageId"],
                "receiptHandle": message["ReceiptHandle"],
                "body": message["Body"],
                "attributes": message.get("Attributes") or {},
                "messageAttributes": attributes,
                "md5OfBody": message.get("MD5OfBody"),
                "eventSource": "aws:sqs",
                "eventSourceARN": queue.arn,
                "awsRegion": region,
            }
        )
    return {"Records": records}


def failed_message_ids(result: Any, message_ids: set[str]) -> set[str] | None:
    """The messages a ``ReportBatchItemFailures`` response asks to keep; None means the whole batch.

    As on Lambda, a response naming an unknown or empty ``itemIdentifier`` fails the whole batch.
    """
    if not isinstance(result, dict) or not result.get("batchItemFailures"):
        return set()
    failures = result["batchItemFailures"]
    if not isinstance(failures, list):
        return None
    ids = {item.get("itemIdentifier") if isinstance(item, dict) else None for item in failures}
    if not ids <= message_ids:
        return None
    return ids  # type: ignore[return-value]


class _Worker:
    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s did not stop in %.0f s", self._thread.name, timeout)

    def _loop(self) -> None:
        raise NotImplementedError


class SqsPoller(_Worker):
    """One poller of an SQS event source mapping: ``queue`` → ``function``.

    Args:
        source: the mapping from the template.
        model: the resolved template.
        runner: runs the function's handler.
        client: ``client(service)`` returns a boto3 client for the local AWS.
        environment: the function's execution environment this poller invokes (one per poller of
            a mapping, so concurrent batches share no module state).
    """

    def __init__(
        self,
        source: SqsEventSource,
        model: LocalTemplate,
        runner: FunctionRunner,
        client: Callable[[str], Any],
        environment: int = 0,
    ) -> None:
        super().__init__(f"sqs-{source.function}" + (f"-{environment}" if environment else ""))
        self.environment = environment
        self.source = source
        self.queue = model.queues[source.queue]
        self.function = model.functions[source.function]
        self.region = model.region
        self.runner = runner
        self.sqs = client("sqs")

    def poll_once(self, wait_seconds: int = WAIT_TIME_SECONDS) -> int:
        """Receive one batch, run the function, delete what succeeded; returns the batch size."""
        response = self.sqs.receive_message(
            QueueUrl=self.queue.url,
            MaxNumberOfMessages=min(self.source.batch_size, 10),
            WaitTimeSeconds=wait_seconds,
            AttributeNames=["All"],
            MessageAttributeNames=["All"],
        )
        messages = response.get("Messages") or []
        if not messages:
            return 0
        event = sqs_event(self.queue, self.region, messages)
        invocation = self.runner.invoke(self.function.name, event, environment=self.environment)
        if invocation.failed:
            log.warning("%s failed a batch of %d: %s", self.function.name, len(messages), invocation.error)
            return len(messages)
        keep: set[str] | None = set()
        if self.source.report_batch_item_failures:
            keep = failed_message_ids(invocation.result, {m["MessageId"] for m in messages})
        if keep is None:
            log.warning("%s returned invalid batchItemFailures: %r", self.function.name, invocation.result)
            return len(messages)
        done = [m for m in messages if m["MessageId"] not in keep]
        if done:
            self.sqs.delete_message_batch(
                QueueUrl=self.queue.url,
                Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(done)],
            )
        return len(messages)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                log.exception("polling %s failed", self.queue.name)
                self._stop.wait(1)


class ScheduleRunner(_Worker):
    """One ``Schedule``/``ScheduleV2`` event, run every ``rate_seconds * rate_scale`` seconds."""

    def __init__(self, schedule: Schedule, model: LocalTemplate, runner: FunctionRunner, rate_scale: float) -> None:
        super().__init__(f"schedule-{schedule.function}-{schedule.event_name}")
        self.schedule = schedule
        self.model = model
        self.function = model.functions[schedule.function]
        self.runner = runner
        self.interval = max(0.05, (schedule.rate_seconds or 0) * rate_scale)

    def event(self) -> Any:
        """What the scheduler passes: the configured Input, else EventBridge's scheduled event."""
        if self.schedule.input is not None:
            return self.schedule.input
        if self.schedule.kind == "ScheduleV2":
            return {}
        rule = f"{self.model.stack_name}-{self.schedule.function}-{self.schedule.event_name}"
        return {
            "version": "0",
            "id": str(uuid.uuid4()),
            "detail-type": "Scheduled Event",
            "source": "aws.events",
            "account": self.model.account_id,
            "time": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "region": self.model.region,
            "resources": [f"arn:aws:events:{self.model.region}:{self.model.account_id}:rule/{rule}"],
            "detail": {},
        }

    def run_once(self) -> None:
        invocation = self.runner.invoke(self.function.name, self.event())
        if invocation.failed:
            log.warning("scheduled %s failed: %s", self.function.name, invocation.error)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_once()
            except Exception:
                log.exception("scheduled %s failed", self.function.name)


def default_rate_scale() -> float:
    """``FERRY_LOCAL_RATE_SCALE`` or 1.

    Raises:
        LocalStackError: it is not a number above 0.
    """
    return checked_rate_scale(os.environ.get(RATE_SCALE_VARIABLE) or "1", RATE_SCALE_VARIABLE)


def checked_rate_scale(value: float | str, source: str = "rate_scale") -> float:
    """``value`` as a schedule rate scale: a finite number above 0 (0 would run schedules back to back).

    Raises:
        LocalStackError: it is anything else; the message names ``source``.
    """
    try:
        scale = float(value)
    except ValueError:
        scale = math.nan
    if not 0 < scale < math.inf:
        raise LocalStackError(f"{source} must be a number above 0, not {value!r}.")
    return scale


def sqs_pollers(
    source: SqsEventSource, model: LocalTemplate, runner: FunctionRunner, client: Callable[[str], Any]
) -> list[SqsPoller]:
    """The pollers of one mapping: ``MaximumConcurrency`` of them (each in its own environment), else one."""
    return [
        SqsPoller(source, model, runner, client, environment) for environment in range(source.maximum_concurrency or 1)
    ]


class Pollers:
    """Every enabled SQS event source and rate() schedule of the template.

    Args:
        model: the resolved template.
        runner: runs the functions' handlers.
        client: ``client(service)`` returns a boto3 client for the local AWS.
        rate_scale: multiplies every schedule's period (default :func:`default_rate_scale`).

    Raises:
        LocalStackError: the rate scale is not a number above 0.
    """

    def __init__(
        self,
        model: LocalTemplate,
        runner: FunctionRunner,
        client: Callable[[str], Any],
        *,
        rate_scale: float | None = None,
    ) -> None:
        scale = default_rate_scale() if rate_scale is None else checked_rate_scale(rate_scale)
        self.workers: list[_Worker] = [
            poller
            for source in model.sqs_event_sources
            if source.enabled
            for poller in sqs_pollers(source, model, runner, client)
        ]
        for schedule in model.schedules:
            if not schedule.enabled:
                continue
            if schedule.rate_seconds is None:
                log.warning(
                    "schedule %s (%s) is not a rate(): not run locally", schedule.event_name, schedule.expression
                )
                continue
            self.workers.append(ScheduleRunner(schedule, model, runner, scale))

    def start(self) -> Pollers:
        for worker in self.workers:
            worker.start()
        return self

    def stop(self) -> None:
        for worker in self.workers:
            worker._stop.set()
        for worker in self.workers:
            worker.stop()
