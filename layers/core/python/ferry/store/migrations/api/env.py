"""Alembic environment of the api database (run through ferry.store.migrate)."""

from alembic import context
from sqlalchemy import create_engine

from ferry.store.api_models import ApiBase as Base

target_metadata = Base.metadata


def run() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        url = context.config.get_main_option("sqlalchemy.url")
        if not url:
            raise RuntimeError("no database URL: pass a connection or set sqlalchemy.url")
        engine = create_engine(url)
        with engine.connect() as conn:
            _run_with(conn)
            conn.commit()
    else:
        _run_with(connection)


def _run_with(connection) -> None:  # noqa: ANN001 - alembic hands us a Connection
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        # Each revision commits on its own: a table a revision altered is not held locked while
        # the revisions after it run (on SQLite, ferry.store.migrate runs them in one transaction).
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run()
