"""Creating the API database and cells (what an operator runs once per deployment)."""

from __future__ import annotations

from sqlalchemy import select

from ferry import config
from ferry.store import migrate
from ferry.store.api_models import CellMapping, HostMapping
from ferry.store.db import api_session


def init_api_database() -> None:
    """Migrate the configured API database to the newest schema."""
    migrate.upgrade("api", config.get().api_database_url)


def create_cell(name: str, database_url: str | None = None) -> CellMapping:
    """Migrate a cell database and map it (idempotent: an existing cell is returned as is).

    Without ``database_url`` the cell gets an SQLite file under the state directory.
    """
    url = database_url or f"sqlite:///{config.get().state_dir / f'cell-{name}.sqlite'}"
    migrate.upgrade("cell", url)
    with api_session() as session:
        mapping = session.scalars(select(CellMapping).where(CellMapping.name == name)).one_or_none()
        if mapping is None:
            mapping = CellMapping(name=name, database_connection=url)
            session.add(mapping)
            session.flush()
        return mapping


def map_host(host: str, cell_name: str) -> None:
    """Record which cell a compute host belongs to (idempotent)."""
    with api_session() as session:
        cell = session.scalars(select(CellMapping).where(CellMapping.name == cell_name)).one()
        existing = session.scalars(select(HostMapping).where(HostMapping.host == host)).one_or_none()
        if existing is None:
            session.add(HostMapping(host=host, cell_id=cell.id))
        elif existing.cell_id != cell.id:
            existing.cell_id = cell.id
