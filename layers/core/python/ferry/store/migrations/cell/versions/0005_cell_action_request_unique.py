"""one action per server and request: instance_actions unique by (instance_uuid, request_id)

Two deliveries of a step that starts an action could each record it; every look-up of that
request's action then found two. The duplicates are merged into the oldest (lowest id) action
before the constraint is added: its events come along (an event both had is merged into one),
so no event is lost.

Revision ID: 0005_cell
Revises: 0004_cell
Create Date: 2027-01-18 10:00:00.000000

"""
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = '0005_cell'
down_revision: str | Sequence[str] | None = '0004_cell'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNIQUE = "uq_instance_actions_instance_uuid"  # the name the models' naming convention gives it
ERROR = "Error"  # the result of a failed event, the message of a failed action (ferry.compute.actions)

ACTIONS = sa.table('instance_actions', sa.column('id', sa.Integer), sa.column('instance_uuid', sa.String),
                   sa.column('request_id', sa.String), sa.column('user_id', sa.String),
                   sa.column('project_id', sa.String), sa.column('start_time', sa.DateTime),
                   sa.column('finish_time', sa.DateTime), sa.column('message', sa.Text),
                   sa.column('updated_at', sa.DateTime))
EVENTS = sa.table('instance_actions_events', sa.column('id', sa.Integer), sa.column('action_id', sa.Integer),
                  sa.column('event', sa.String), sa.column('start_time', sa.DateTime),
                  sa.column('finish_time', sa.DateTime), sa.column('result', sa.String),
                  sa.column('traceback', sa.Text), sa.column('host', sa.String), sa.column('details', sa.Text))


def upgrade() -> None:
    """Merge each request's duplicate actions into its oldest, then make (instance_uuid, request_id) unique."""
    connection = op.get_bind()
    if connection.dialect.name == "postgresql":
        # Both tables for the whole revision, taken at once and never raised later: the functions
        # touch them in either order, so a weaker lock raised at the ALTER could close a cycle with
        # a function mid-step. A cycle while taking them is broken by PostgreSQL (one side fails:
        # the step is retried, the sync too: ferry.store.migrate).
        op.execute("LOCK TABLE instance_actions, instance_actions_events IN ACCESS EXCLUSIVE MODE")
    for instance_uuid, request_id in connection.execute(
            sa.select(ACTIONS.c.instance_uuid, ACTIONS.c.request_id)
            .group_by(ACTIONS.c.instance_uuid, ACTIONS.c.request_id).having(sa.func.count() > 1)).all():
        _merge_actions(connection, instance_uuid, request_id)
    _add_constraint(connection.dialect.name)


def _add_constraint(dialect: str) -> None:
    """Make (instance_uuid, request_id) unique. On PostgreSQL the index is built under the lock
    above and then becomes the constraint. (SQLite rebuilds the table: ferry.store.migrate turns its
    foreign keys off meanwhile, or dropping the old table would delete every event with its action.)"""
    if dialect == "postgresql":
        op.execute(f"CREATE UNIQUE INDEX {UNIQUE} ON instance_actions (instance_uuid, request_id)")
        op.execute(f"ALTER TABLE instance_actions ADD CONSTRAINT {UNIQUE} UNIQUE USING INDEX {UNIQUE}")
        return
    with op.batch_alter_table('instance_actions', schema=None) as batch_op:
        batch_op.create_unique_constraint(UNIQUE, ['instance_uuid', 'request_id'])


def downgrade() -> None:
    """Drop the constraint (merged actions stay merged).

    Refused on SQLite with foreign keys on: rebuilding the table there would delete every event.
    """
    connection = op.get_bind()
    if connection.dialect.name == "sqlite" and connection.exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError("0005_cell's downgrade rebuilds instance_actions: turn SQLite's foreign keys off "
                           "first (PRAGMA foreign_keys=OFF), or every action event is deleted with the old table")
    with op.batch_alter_table('instance_actions', schema=None) as batch_op:
        batch_op.drop_constraint(UNIQUE, type_='unique')


def _merge_actions(connection: sa.Connection, instance_uuid: str, request_id: str) -> None:
    """Keep the request's oldest action, with what the others recorded, and delete the others."""
    rows = connection.execute(sa.select(ACTIONS).where(
        ACTIONS.c.instance_uuid == instance_uuid, ACTIONS.c.request_id == request_id).order_by(ACTIONS.c.id)).all()
    keeper, duplicates = rows[0], rows[1:]
    for duplicate in duplicates:
        _move_events(connection, keeper.id, duplicate.id)
    connection.execute(ACTIONS.update().where(ACTIONS.c.id == keeper.id).values(_merged_action(rows)))
    connection.execute(ACTIONS.delete().where(ACTIONS.c.id.in_([row.id for row in duplicates])))


def _merged_action(rows: Sequence[Any]) -> dict[str, Any]:
    """One action's columns from its copies (oldest first): the first user and project known, the
    earliest start, the latest finish and update, and ``Error`` if any copy failed."""
    messages = [row.message for row in rows if row.message is not None]
    return {
        "user_id": _first(row.user_id for row in rows),
        "project_id": _first(row.project_id for row in rows),
        "start_time": min(row.start_time for row in rows),
        "finish_time": _latest(row.finish_time for row in rows),
        "updated_at": _latest(row.updated_at for row in rows),
        "message": ERROR if ERROR in messages else _first(messages),
    }


def _move_events(connection: sa.Connection, keeper_id: int, duplicate_id: int) -> None:
    """Move a duplicate action's events to the kept action; an event the kept action has too is
    merged into its own (events are unique by action and name)."""
    kept = {row.event: row for row in connection.execute(sa.select(EVENTS).where(EVENTS.c.action_id == keeper_id))}
    for event in connection.execute(sa.select(EVENTS).where(EVENTS.c.action_id == duplicate_id)).all():
        mine = kept.get(event.event)
        if mine is None:
            connection.execute(EVENTS.update().where(EVENTS.c.id == event.id).values(action_id=keeper_id))
            continue
        connection.execute(EVENTS.update().where(EVENTS.c.id == mine.id).values(_merged_event(mine, event)))
        connection.execute(EVENTS.delete().where(EVENTS.c.id == event.id))


def _merged_event(mine: Any, other: Any) -> dict[str, Any]:
    """One event from two records of it: the failed one's result, details and traceback (else the
    finished one's, else the kept one's), every other column filled from either, the earliest
    start and the latest finish."""
    first, second = (other, mine) if other.result == ERROR and mine.result != ERROR \
        or mine.result is None and other.result is not None else (mine, other)
    merged = {column: _first((getattr(first, column), getattr(second, column)))
              for column in ("result", "details", "traceback", "host")}
    merged["start_time"] = min(mine.start_time, other.start_time)
    merged["finish_time"] = _latest((mine.finish_time, other.finish_time))
    return merged


def _first(values: Any) -> Any:
    """The first value that is not None (None when there is none)."""
    return next((value for value in values if value is not None), None)


def _latest(values: Any) -> Any:
    """The latest time that is not None (None when there is none)."""
    return max((value for value in values if value is not None), default=None)
