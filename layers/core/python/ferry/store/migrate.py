"""Schema migrations (Alembic) for the API database and the cell databases.

Alembic is imported when a migration runs, not with this module: every Lambda handler imports
the store, and only set-up paths migrate (importing Alembic costs a cold start ~0.4 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ferry.store.db import engine_for

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(kind: str, url: str) -> Config:
    """An Alembic config for ``kind`` (``api`` or ``cell``) at ``url``."""
    if kind not in ("api", "cell"):
        raise ValueError(f"unknown database kind {kind!r}")
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS / kind))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(kind: str, url: str, revision: str = "head") -> None:
    """Bring the ``kind`` database at ``url`` to ``revision`` (idempotent)."""
    from alembic import command

    cfg = alembic_config(kind, url)
    with engine_for(url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)
