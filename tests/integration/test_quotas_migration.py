"""The API database migrations create exactly the quota table the models describe."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from ferry.store.api_models import ApiBase
from ferry.store.db import engine_for


def test_migrated_api_database_matches_the_models(store):
    with engine_for(store.api_url).connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, ApiBase.metadata) == []
        columns = {c["name"] for c in inspect(connection).get_columns("quotas")}
        assert columns == {"id", "project_id", "resource", "hard_limit", "created_at", "updated_at"}
        uniques = inspect(connection).get_unique_constraints("quotas")
        assert [u["column_names"] for u in uniques] == [["project_id", "resource"]]
