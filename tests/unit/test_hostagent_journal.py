"""The host agent's operation journal: what a redelivered or retried message gets."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from hostagent.journal import (
    ANSWER_SENDING,
    FAILED,
    IN_PROGRESS,
    SUCCEEDED,
    TAKEN_BACK,
    TAKING_BACK,
    Journal,
)


def test_unknown_operation_has_no_entry(tmp_path):
    assert Journal(tmp_path / "journal.sqlite").get("op-1") is None


def test_success_is_recorded_and_answers_any_later_message(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    journal.start("op-1", "spawn", "uuid-1", "token-a")
    journal.succeed("op-1", {"power_state": 1})

    entry = journal.get("op-1")
    assert entry is not None and entry.status == SUCCEEDED and entry.finished
    assert entry.result == {"power_state": 1}
    assert entry.answers("token-a")
    assert entry.answers("token-b")
    assert entry.answers(None)


def test_failure_answers_only_a_redelivery_of_the_same_message(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    journal.start("op-1", "spawn", "uuid-1", "token-a")
    journal.fail("op-1", "Ferry.HypervisorError", "libvirt said no")

    entry = journal.get("op-1")
    assert entry is not None and entry.status == FAILED
    assert (entry.error, entry.cause) == ("Ferry.HypervisorError", "libvirt said no")
    assert entry.answers("token-a")
    assert not entry.answers("token-b")


def test_the_journal_keeps_no_task_token(tmp_path):
    path = tmp_path / "journal.sqlite"
    Journal(path).start("op-1", "spawn", "uuid-1", "secret-token-value")
    written = b"".join(p.read_bytes() for p in tmp_path.iterdir())  # the database and its write-ahead log
    assert written and b"secret-token-value" not in written


def test_an_interrupted_operation_is_listed_and_restarting_it_counts_an_attempt(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    journal.start("op-1", "destroy", "uuid-1", None)

    reopened = Journal(tmp_path / "journal.sqlite")
    assert [e.operation_id for e in reopened.in_progress()] == ["op-1"]
    entry = reopened.get("op-1")
    assert entry is not None and entry.status == IN_PROGRESS and not entry.finished
    assert not entry.answers(None)

    again = reopened.start("op-1", "destroy", "uuid-1", None)
    assert again.attempts == 2


def test_restarting_a_failed_operation_clears_its_error(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    journal.start("op-1", "spawn", "uuid-1", "token-a")
    journal.fail("op-1", "Ferry.SpawnFailed", "no")

    entry = journal.start("op-1", "spawn", "uuid-1", "token-b")

    assert entry.status == IN_PROGRESS and entry.error is None and entry.cause is None
    assert entry.answers("token-b") is False


def test_prune_forgets_old_finished_operations_and_interrupted_ones_started_as_long_ago(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    journal.start("done", "power_on", "uuid-1", None)
    journal.succeed("done", {})
    journal.start("interrupted", "power_off", "uuid-1", None)

    assert journal.prune(timedelta(days=1)) == 0
    with sqlite3.connect(tmp_path / "journal.sqlite") as conn:  # interrupted two days ago, never run again
        conn.execute("UPDATE operations SET started_at = ? WHERE operation_id = 'interrupted'",
                     ((datetime.now(UTC) - timedelta(days=2)).isoformat(),))
    assert journal.prune(timedelta(days=1)) == 1
    assert journal.get("interrupted") is None and journal.get("done") is not None

    assert journal.prune(timedelta(seconds=-1)) == 1
    assert journal.get("done") is None


def _old_journal(tmp_path) -> Path:
    """A journal from before the answer column, with one ended operation (``done``)."""
    path = tmp_path / "journal.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE operations (operation_id TEXT PRIMARY KEY, operation TEXT NOT NULL, "
                     "instance_uuid TEXT NOT NULL, status TEXT NOT NULL, token_digest TEXT, result TEXT, error TEXT, "
                     "cause TEXT, attempts INTEGER NOT NULL DEFAULT 0, started_at TEXT NOT NULL, finished_at TEXT)")
        now = datetime.now(UTC).isoformat()
        conn.execute("INSERT INTO operations VALUES ('done', 'spawn', 'uuid-1', ?, NULL, '{}', NULL, NULL, 1, ?, ?)",
                     (SUCCEEDED, now, now))
    return path


def test_a_journal_written_before_answers_were_recorded_takes_every_ended_operation_as_maybe_answered(tmp_path):
    # GIVEN a journal from before the answer column, with an ended and an interrupted operation
    path = _old_journal(tmp_path)
    with sqlite3.connect(path) as conn:
        now = datetime.now(UTC).isoformat()
        conn.execute("INSERT INTO operations VALUES ('cut', 'spawn', 'uuid-2', ?, NULL, NULL, NULL, NULL, 1, ?, NULL)",
                     (IN_PROGRESS, now))

    # WHEN the agent opens it
    journal = Journal(path)

    # THEN the ended operation may have been answered (never taken back), the interrupted one was not
    done, cut = journal.get("done"), journal.get("cut")
    assert done is not None and done.answer == ANSWER_SENDING
    assert cut is not None and cut.answer is None


class _DiesAtTheUpdate(sqlite3.Connection):
    """A connection whose process dies as it marks the ended operations (the column just added)."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
        if sql.startswith("UPDATE operations SET answer"):
            raise KeyboardInterrupt
        return super().execute(sql, *args)


def test_a_migration_cut_short_leaves_the_journal_as_it_was_and_the_next_open_completes_it(tmp_path, monkeypatch):
    # GIVEN a journal from before the answer column, with an ended operation
    path = _old_journal(tmp_path)

    # WHEN the agent dies between adding the column and marking the ended operation
    connect = sqlite3.connect
    with monkeypatch.context() as patched:
        patched.setattr(sqlite3, "connect", lambda *a, **kw: connect(*a, factory=_DiesAtTheUpdate, **kw))
        with pytest.raises(KeyboardInterrupt):
            Journal(path)

    # THEN the column was not added alone; opened again, the ended operation may have been answered
    with sqlite3.connect(path) as conn:
        assert "answer" not in {row[1] for row in conn.execute("PRAGMA table_info(operations)")}
    done = Journal(path).get("done")
    assert done is not None and done.answer == ANSWER_SENDING


def test_a_take_back_is_recorded_before_and_after_and_one_cut_short_is_listed_and_pruned_like_an_interrupted_run(
        tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    journal.start("op-1", "spawn", "uuid-1", "token-a")
    journal.succeed("op-1", {"power_state": 1})
    assert journal.answering("op-1") is None
    journal.unanswered("op-1")

    journal.taking_back("op-1")

    entry = journal.get("op-1")
    assert entry is not None and entry.status == TAKING_BACK and not entry.finished and entry.result is None
    assert entry.run_for("token-a") and not entry.run_for("token-b")
    assert [e.operation_id for e in Journal(tmp_path / "journal.sqlite").in_progress()] == ["op-1"]
    assert journal.prune(timedelta(days=1)) == 0

    journal.taken_back("op-1", "Ferry.HostOperationFailed", "taken back")

    entry = journal.get("op-1")
    assert entry is not None and entry.status == TAKEN_BACK and entry.finished
    assert not entry.answers("token-a") and not entry.answers("token-b")
    assert journal.in_progress() == []
