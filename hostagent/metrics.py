"""The agent's metrics, published to CloudWatch with ``PutMetricData``.

In Lambda, CloudWatch turns the embedded-metric-format lines a function prints into metrics. On a
hypervisor nothing does (journald only keeps them), so the agent publishes its metrics itself.
An operation never waits for CloudWatch: :meth:`MetricsPublisher.add` only buffers, and a
background thread sends what was buffered every few seconds. Values of one metric (name, unit and
dimensions) added within one such window are sent as one entry of values and their counts, so a
count of 1 added 50 times is sent as the value 1 counted 50 times. A failed send is logged and
retried at the next flush; while CloudWatch cannot be reached the buffer keeps at most
``max_buffered`` entries, dropping the oldest (logged with how many). Closing the publisher sends
what is left.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError, ParamValidationError

from ferry.observability import DEFAULT_NAMESPACE, NAMESPACE_VARIABLE, logger

# How often buffered metrics are sent (one PutMetricData call per batch, none when nothing is buffered).
DEFAULT_FLUSH_INTERVAL = 5.0
# Entries kept while CloudWatch cannot be reached, the oldest dropped beyond (a few hours of a busy host).
DEFAULT_MAX_BUFFERED = 10_000
# PutMetricData takes at most 1000 entries per call and 150 distinct values per entry.
MAX_DATA_PER_CALL = 1000
MAX_VALUES_PER_DATUM = 150
# Values per call, all entries together: keeps a call well inside PutMetricData's 1 MB request limit.
MAX_VALUES_PER_CALL = 3000
# How long stopping waits for the last send: a CloudWatch that cannot be reached never holds up a stop for long.
CLOSE_TIMEOUT = 10.0
# While sends keep failing, one warning this often (the first at once).
FAILURE_LOG_INTERVAL = 60.0
# Errors that say the data itself is refused: sending it again cannot succeed, so it is dropped.
_REFUSED_CODES = frozenset({
    "InvalidParameterValue", "InvalidParameterValueException",
    "InvalidParameterCombination", "InvalidParameterCombinationException",
    "MissingParameter", "MissingRequiredParameterException",
})


def namespace_from_environment() -> str:
    """The metrics' namespace: ``POWERTOOLS_METRICS_NAMESPACE``, or ``Ferry`` when unset or empty."""
    return os.environ.get(NAMESPACE_VARIABLE) or DEFAULT_NAMESPACE


@dataclass
class _Datum:
    """One metric's values within one flush window: each distinct value and how often it was added."""

    name: str
    unit: str
    dimensions: tuple[tuple[str, str], ...]
    timestamp: datetime
    counts: Counter[float] = field(default_factory=Counter)

    def metric_datum(self) -> dict[str, Any]:
        values = list(self.counts)
        return {
            "MetricName": self.name,
            "Dimensions": [{"Name": name, "Value": value} for name, value in self.dimensions],
            "Timestamp": self.timestamp,
            "Unit": self.unit,
            "Values": values,
            "Counts": [float(self.counts[value]) for value in values],
        }


class MetricsPublisher:
    """Buffers metrics and sends them to CloudWatch from a background thread.

    Args:
        cloudwatch: a CloudWatch client.
        namespace: the metrics' namespace.
        flush_interval: seconds between sends once :meth:`start` was called.
        max_buffered: entries kept while CloudWatch cannot be reached; the oldest go beyond.
    """

    def __init__(self, cloudwatch: Any, namespace: str, *, flush_interval: float = DEFAULT_FLUSH_INTERVAL,
                 max_buffered: int = DEFAULT_MAX_BUFFERED) -> None:
        if flush_interval <= 0 or max_buffered < 1:
            raise ValueError("flush_interval must be above 0 and max_buffered at least 1.")
        self.cloudwatch = cloudwatch
        self.namespace = namespace
        self.flush_interval = flush_interval
        self.max_buffered = max_buffered
        self._guard = threading.Lock()
        # The open window, by (name, unit, dimensions); then the closed entries, oldest first.
        self._window: dict[tuple[str, str, tuple[tuple[str, str], ...]], _Datum] = {}
        self._pending: deque[_Datum] = deque()
        self._dropped = 0
        # Sends failed in a row, and when the last warning about them was logged.
        self._failures = 0
        self._failure_logged = 0.0
        self._flushing = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_sent = False  # whether the background thread's last flush, as it stopped, sent everything

    def add(self, name: str, unit: str, value: float, dimensions: Mapping[str, str]) -> None:
        """Buffer one value of the metric ``name`` (``unit`` a CloudWatch unit such as ``Count``).

        Never waits for CloudWatch. A value CloudWatch cannot take (not finite) is logged and left out.
        """
        value = float(value)
        if not math.isfinite(value):
            logger.warning("metric value left out: not a finite number", extra={"metric": name, "value": str(value)})
            return
        key = (name, unit, tuple(sorted(dimensions.items())))
        with self._guard:
            datum = self._window.get(key)
            if datum is not None and value not in datum.counts and len(datum.counts) >= MAX_VALUES_PER_DATUM:
                self._keep(datum)  # full: the window goes on in another entry
                datum = None
            if datum is None:
                datum = self._window[key] = _Datum(name, unit, key[2], datetime.now(UTC))
            datum.counts[value] += 1

    @property
    def buffered(self) -> int:
        """How many entries wait to be sent (the open window's included)."""
        with self._guard:
            return len(self._pending) + len(self._window)

    def start(self) -> None:
        """Send what is buffered every ``flush_interval`` seconds, from a daemon thread, until :meth:`close`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._last_sent = False
        self._thread = threading.Thread(target=self._flush_loop, name="metrics", daemon=True)
        self._thread.start()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Stop the background sends and send what is buffered, waiting at most ``timeout`` seconds
        for it; True when all of it was sent.

        What CloudWatch does not take by then is lost (logged): the process is about to end.
        """
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            sent = self.flush()
        else:  # it sends what is left as it stops
            thread.join(timeout)
            sent = not thread.is_alive() and self._last_sent
        if sent:
            return True
        with self._guard:
            lost = len(self._pending) + len(self._window) + self._dropped
            self._pending.clear()
            self._window.clear()
            self._dropped = 0
        logger.warning("metrics not published before the agent stopped", extra={"entries": lost})
        return False

    def flush(self) -> bool:
        """Close the window and send everything buffered, in batches; True when nothing is left.

        Never raises: a send that fails is logged, and what it carried is sent again at the next flush.
        """
        with self._flushing:
            with self._guard:
                for datum in self._window.values():
                    self._keep(datum)
                self._window.clear()
                dropped, self._dropped = self._dropped, 0
            if dropped:
                logger.warning("metrics dropped: CloudWatch could not be reached and the buffer is full",
                               extra={"dropped": dropped, "max_buffered": self.max_buffered})
            while True:
                with self._guard:
                    batch = self._take_batch()
                if not batch:
                    return True
                if not self._send(batch):
                    with self._guard:
                        self._pending.extendleft(reversed(batch))
                        self._trim()
                    return False

    def _send(self, batch: list[_Datum]) -> bool:
        """PutMetricData ``batch``; False when it should be sent again (True once sent, or refused for good)."""
        try:
            self.cloudwatch.put_metric_data(Namespace=self.namespace, MetricData=[d.metric_datum() for d in batch])
        except (ClientError, ParamValidationError) as exc:
            code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
            if isinstance(exc, ParamValidationError) or code in _REFUSED_CODES:
                logger.warning("CloudWatch refused metrics: dropped",
                               extra={"entries": len(batch), "namespace": self.namespace, "error": str(exc)})
                return True
            self._failed(batch, exc)
            return False
        except Exception as exc:  # an unreachable endpoint, missing credentials: never the agent's failure
            self._failed(batch, exc)
            return False
        if self._failures:
            logger.info("publishing metrics to CloudWatch works again", extra={"failed_sends": self._failures})
            self._failures = 0
        return True

    def _failed(self, batch: list[_Datum], exc: Exception) -> None:
        """Log a failed send: the first of a series at once, then one warning every :data:`FAILURE_LOG_INTERVAL`."""
        self._failures += 1
        now = time.monotonic()
        if self._failures == 1 or now - self._failure_logged >= FAILURE_LOG_INTERVAL:
            self._failure_logged = now
            logger.warning("publishing metrics to CloudWatch failed: sent again at the next flush",
                           extra={"entries": len(batch), "buffered": len(self._pending) + len(batch),
                                  "failed_sends": self._failures, "namespace": self.namespace, "error": str(exc)})

    def _take_batch(self) -> list[_Datum]:
        """The oldest entries one PutMetricData call takes, removed from the buffer (call under the guard)."""
        batch: list[_Datum] = []
        values = 0
        while self._pending and len(batch) < MAX_DATA_PER_CALL:
            size = len(self._pending[0].counts)
            if batch and values + size > MAX_VALUES_PER_CALL:
                break
            batch.append(self._pending.popleft())
            values += size
        return batch

    def _keep(self, datum: _Datum) -> None:
        """Queue a closed entry to be sent (call under the guard)."""
        self._pending.append(datum)
        self._trim()

    def _trim(self) -> None:
        while len(self._pending) > self.max_buffered:
            self._pending.popleft()
            self._dropped += 1

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval):
            self._flush_quietly()
        self._last_sent = self._flush_quietly()

    def _flush_quietly(self) -> bool:
        try:
            return self.flush()
        except Exception:  # flush never raises; this keeps the thread alive if it ever did
            logger.exception("publishing metrics failed")
            return False
