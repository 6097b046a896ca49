"""Schema migrations (Alembic) for the API database and the cell databases."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from ferry.store.db import engine_for

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(kind: str, url: str) -> Config:
    """An Alembic config for ``kind`` (``api`` or ``cell``) at ``url``."""
    if kind not in ("api", "cell"):
        raise ValueError(f"unknown database kind {kind!r}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS / kind))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(kind: str, url: str, revision: str = "head") -> None:
    """Bring the ``kind`` database at ``url`` to ``revision`` (idempotent)."""
    cfg = alembic_config(kind, url)
    with engine_for(url).begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)
