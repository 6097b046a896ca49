"""Creating the API database and cells (what an operator runs once per deployment)."""

from __future__ import annotations

from sqlalchemy import select

from ferry import config, errors
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
    """Record which cell a compute host belongs to (idempotent).

    Raises:
        HostMappedElsewhere: the host is mapped to another cell (read in the same transaction as
            the write: a mapping made meanwhile, by the host's first report say, is never moved).
    """
    with api_session() as session:
        cell = session.scalars(select(CellMapping).where(CellMapping.name == cell_name)).one()
        # The row alone (its cell is eagerly joined otherwise, and PostgreSQL locks no outer join).
        mapped_to = session.scalars(select(HostMapping.cell_id).where(HostMapping.host == host)
                                    .with_for_update()).one_or_none()
        if mapped_to is None:
            session.add(HostMapping(host=host, cell_id=cell.id))
        elif mapped_to != cell.id:
            other = session.get(CellMapping, mapped_to)
            raise errors.HostMappedElsewhere(f"host {host} is mapped to cell {other.name if other else mapped_to}; a "
                                             f"host with servers recorded there is never moved to another cell.")


def set_cell_disabled(name: str, disabled: bool) -> bool:
    """Disable or enable a cell for scheduling (idempotent); whether it was changed.

    A disabled cell takes no new server and no move from another cell; a move held to the cell
    its server is in (one that may not leave it) still lands in it, as in Nova.

    Raises:
        CellNotFound: no cell of that name is mapped.
    """
    with api_session() as session:
        mapping = session.scalars(select(CellMapping).where(CellMapping.name == name).with_for_update()).one_or_none()
        if mapping is None:
            raise errors.CellNotFound(f"Cell {name} could not be found.")
        changed = mapping.disabled != disabled
        mapping.disabled = disabled
        return changed
