"""The API database migration 0006 clears request spec zones that name no zone (SQLite)."""

from __future__ import annotations

import json

from sqlalchemy import text

from ferry.store import migrate
from ferry.store.db import engine_for


def test_zones_no_aggregate_defines_are_cleared_and_the_others_kept(tmp_path):
    url = f"sqlite:///{tmp_path / 'api.sqlite'}"
    migrate.upgrade("api", url, "0005_api")
    specs = {"typo": {"availability_zone": "az-1"}, "real": {"availability_zone": "az1"},
             "default": {"availability_zone": "nova"}, "none": {"availability_zone": None, "is_bfv": True}}
    with engine_for(url).begin() as connection:
        connection.execute(text("INSERT INTO aggregates (id, uuid, name, created_at) "
                                "VALUES (1, 'agg-1', 'zone-1', CURRENT_TIMESTAMP)"))
        connection.execute(text("INSERT INTO aggregate_metadata (aggregate_id, key, value) "
                                "VALUES (1, 'availability_zone', 'az1')"))
        for name, spec in specs.items():
            connection.execute(text("INSERT INTO request_specs (instance_uuid, spec, created_at) "
                                    "VALUES (:uuid, :spec, CURRENT_TIMESTAMP)"),
                               {"uuid": name, "spec": json.dumps({"instance_uuid": name, **spec})})

    migrate.upgrade("api", url)

    with engine_for(url).connect() as connection:
        found = {uuid: json.loads(spec) for uuid, spec in connection.execute(
            text("SELECT instance_uuid, spec FROM request_specs"))}
    assert found["typo"] == {"instance_uuid": "typo", "availability_zone": None}
    assert found["real"]["availability_zone"] == "az1"
    assert found["default"]["availability_zone"] == "nova"
    assert found["none"] == {"instance_uuid": "none", "availability_zone": None, "is_bfv": True}
