"""The host's operation journal: what each operation id came to, so a redelivered message is answered, not redone.

SQS and Step Functions deliver at least once. Before running an operation the agent records it
as ``in_progress``; when it ends, the result or the error. A message whose operation already
ended is answered from the journal. An operation still ``in_progress`` when a message for it
arrives was interrupted (the agent stopped mid-way) and is run again: every operation is
idempotent (or, when its workflow no longer waits, what it did is taken back; see below).

A recorded failure is replayed only to the same task token (a redelivery of the same message).
A new token for the same operation id is the workflow retrying, so the operation runs again.

An operation that may have to be taken back (its workflow stopped waiting: ``hostagent.agent``)
also records whether its answer went out: ``answer`` is None until one is sent, ``sending`` once
one may have reached Step Functions, and ``taken`` once Step Functions took it. Its take-back is
recorded as ``taking_back`` before it starts, so that one cut short goes on when the message
comes back, and as ``taken_back`` once done: an entry that answers no message, so that a retry
with a new task token runs the operation again.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

IN_PROGRESS = "in_progress"
SUCCEEDED = "succeeded"
FAILED = "failed"
TAKING_BACK = "taking_back"
TAKEN_BACK = "taken_back"
# Where an operation's answer is (``answer``; None: never sent).
ANSWER_SENDING = "sending"
ANSWER_TAKEN = "taken"
# Statuses whose entry is not finished: started, and not yet ended.
_UNFINISHED = (IN_PROGRESS, TAKING_BACK)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
    operation_id  TEXT PRIMARY KEY,
    operation     TEXT NOT NULL,
    instance_uuid TEXT NOT NULL,
    status        TEXT NOT NULL,
    token_digest  TEXT,
    result        TEXT,
    error         TEXT,
    cause         TEXT,
    attempts      INTEGER NOT NULL DEFAULT 0,
    started_at    TEXT NOT NULL,
    finished_at   TEXT,
    answer        TEXT
)
"""


def _now() -> str:
    return datetime.now(UTC).isoformat()


def token_digest(task_token: str | None) -> str | None:
    """A digest of a task token: enough to recognise it again without keeping the credential."""
    return hashlib.sha256(task_token.encode()).hexdigest() if task_token else None


@dataclass(frozen=True)
class JournalEntry:
    """One operation as the journal knows it."""

    operation_id: str
    operation: str
    instance_uuid: str
    status: str
    token_digest: str | None
    result: dict[str, Any] | None
    error: str | None
    cause: str | None
    attempts: int
    started_at: str
    finished_at: str | None
    answer: str | None = None

    @property
    def finished(self) -> bool:
        return self.status not in _UNFINISHED

    def run_for(self, task_token: str | None) -> bool:
        """Whether the operation's last run was for the message carrying ``task_token``."""
        return task_token is not None and self.token_digest == token_digest(task_token)

    def answers(self, task_token: str | None) -> bool:
        """Whether this entry is the answer to a message carrying ``task_token``.

        A success answers any later message for the operation (the work is done); a failure
        only a redelivery of the same message; a take-back none (nothing is left to answer with).
        """
        if self.status == SUCCEEDED:
            return True
        return self.status == FAILED and self.token_digest == token_digest(task_token)


class Journal:
    """The journal, one SQLite file in the agent's state directory.

    Safe to use from several threads: each call opens its own connection.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(_SCHEMA)
            # The check and the migration in one transaction (SQLite's DDL is transactional): an
            # agent dying between them leaves the journal as it was, and a second agent opening it
            # meanwhile waits, then finds the column.
            conn.execute("BEGIN IMMEDIATE")
            columns = {row["name"] for row in conn.execute("PRAGMA table_info(operations)")}
            if "answer" not in columns:
                # A journal written before answers were recorded: whether an answer went out is
                # unknown, so every ended operation is taken to have been answered, maybe.
                conn.execute("ALTER TABLE operations ADD COLUMN answer TEXT")
                conn.execute("UPDATE operations SET answer = ? WHERE status != ?", (ANSWER_SENDING, IN_PROGRESS))

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=30)) as conn:
            conn.row_factory = sqlite3.Row
            with conn:
                yield conn

    @staticmethod
    def _entry(row: sqlite3.Row) -> JournalEntry:
        return JournalEntry(
            operation_id=row["operation_id"],
            operation=row["operation"],
            instance_uuid=row["instance_uuid"],
            status=row["status"],
            token_digest=row["token_digest"],
            result=json.loads(row["result"]) if row["result"] is not None else None,
            error=row["error"],
            cause=row["cause"],
            attempts=row["attempts"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            answer=row["answer"],
        )

    def get(self, operation_id: str) -> JournalEntry | None:
        """The entry of ``operation_id``, or None if the host never started it."""
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM operations WHERE operation_id = ?", (operation_id,)).fetchone()
        return self._entry(row) if row else None

    def start(self, operation_id: str, operation: str, instance_uuid: str, task_token: str | None) -> JournalEntry:
        """Record that ``operation_id`` is (again) in progress, for the message carrying ``task_token``."""
        with self._connect() as conn:
            conn.execute(
                """
                INSERT INTO operations (operation_id, operation, instance_uuid, status, token_digest, attempts,
                                        started_at)
                VALUES (?, ?, ?, ?, ?, 1, ?)
                ON CONFLICT (operation_id) DO UPDATE SET
                    status = excluded.status, token_digest = excluded.token_digest, result = NULL, error = NULL,
                    cause = NULL, attempts = operations.attempts + 1, started_at = excluded.started_at,
                    finished_at = NULL, answer = NULL
                """,
                (operation_id, operation, instance_uuid, IN_PROGRESS, token_digest(task_token), _now()),
            )
        entry = self.get(operation_id)
        assert entry is not None
        return entry

    def succeed(self, operation_id: str, result: dict[str, Any]) -> None:
        """Record the result of ``operation_id``."""
        with self._connect() as conn:
            conn.execute(
                "UPDATE operations SET status = ?, result = ?, error = NULL, cause = NULL, finished_at = ? "
                "WHERE operation_id = ?",
                (SUCCEEDED, json.dumps(result), _now(), operation_id),
            )

    def fail(self, operation_id: str, error: str, cause: str) -> None:
        """Record that ``operation_id`` failed with the typed error name ``error``."""
        self._end(operation_id, FAILED, error, cause)

    def _end(self, operation_id: str, status: str, error: str, cause: str) -> None:
        with self._connect() as conn:
            conn.execute(
                "UPDATE operations SET status = ?, result = NULL, error = ?, cause = ?, finished_at = ? "
                "WHERE operation_id = ?",
                (status, error, cause, _now(), operation_id),
            )

    def answering(self, operation_id: str) -> str | None:
        """Record that an answer of ``operation_id`` is about to be sent; return where its answer was before."""
        with self._connect() as conn:
            row = conn.execute("SELECT answer FROM operations WHERE operation_id = ?", (operation_id,)).fetchone()
            if row is None:
                return None
            if row["answer"] is None:
                conn.execute("UPDATE operations SET answer = ? WHERE operation_id = ?", (ANSWER_SENDING, operation_id))
            return row["answer"]

    def answered(self, operation_id: str) -> None:
        """Record that Step Functions took an answer of ``operation_id``."""
        with self._connect() as conn:
            conn.execute("UPDATE operations SET answer = ? WHERE operation_id = ?", (ANSWER_TAKEN, operation_id))

    def unanswered(self, operation_id: str) -> None:
        """Record that the answer :meth:`answering` announced never reached Step Functions."""
        with self._connect() as conn:
            conn.execute("UPDATE operations SET answer = NULL WHERE operation_id = ? AND answer = ?",
                         (operation_id, ANSWER_SENDING))

    def taking_back(self, operation_id: str) -> None:
        """Record that what ``operation_id`` did is being taken back (its workflow stopped waiting)."""
        with self._connect() as conn:
            conn.execute(
                "UPDATE operations SET status = ?, result = NULL, error = NULL, cause = NULL, finished_at = NULL "
                "WHERE operation_id = ?",
                (TAKING_BACK, operation_id),
            )

    def taken_back(self, operation_id: str, error: str, cause: str) -> None:
        """Record that what ``operation_id`` did was taken back; ``error`` and ``cause`` say why."""
        self._end(operation_id, TAKEN_BACK, error, cause)

    def in_progress(self) -> list[JournalEntry]:
        """Operations started but never finished (the agent stopped during them or their take-back)."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT * FROM operations WHERE status IN (?, ?) ORDER BY started_at", _UNFINISHED
            ).fetchall()
        return [self._entry(row) for row in rows]

    def prune(self, older_than: timedelta) -> int:
        """Forget finished operations that ended more than ``older_than`` ago, and interrupted ones
        started that long ago (their message can no longer come back); return how many.

        Keep ``older_than`` well beyond the queue's message retention: a message redelivered after
        its entry is gone would run again.
        """
        cutoff = (datetime.now(UTC) - older_than).isoformat()
        with self._connect() as conn:
            cursor = conn.execute(
                "DELETE FROM operations WHERE (status NOT IN (?, ?) AND finished_at < ?) "
                "OR (status IN (?, ?) AND started_at < ?)",
                (*_UNFINISHED, cutoff, *_UNFINISHED, cutoff),
            )
        return cursor.rowcount
