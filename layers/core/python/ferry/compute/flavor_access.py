"""Flavor access: the projects that may use a private flavor (Nova's ``os-flavor-access``).

A public flavor is anyone's. A private flavor is for admins and for the projects given access
to it; to anyone else it does not exist: it is not listed, shown, booted or resized to.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ferry import errors
from ferry.auth import RequestContext
from ferry.observability import logger
from ferry.store.api_models import Flavor, FlavorProject
from ferry.store.db import api_session


def usable(ctx: RequestContext, flavor: Flavor) -> bool:
    """Whether the caller may see and use ``flavor``."""
    return flavor.is_public or ctx.is_admin or any(p.project_id == ctx.project_id for p in flavor.projects)


def usable_clause(ctx: RequestContext) -> ColumnElement[bool]:
    """The flavors a non-admin caller may see and use, as a query condition."""
    return or_(Flavor.is_public.is_(True), Flavor.projects.any(FlavorProject.project_id == ctx.project_id))


def _flavor(session: Session, flavorid: str) -> Flavor:
    flavor = session.scalars(select(Flavor).where(Flavor.flavorid == flavorid)).one_or_none()
    if flavor is None:
        raise errors.FlavorNotFound(f"Flavor {flavorid} could not be found.")
    return flavor


def projects(flavorid: str) -> list[str]:
    """The projects with access to a private flavor, in the order they were given it.

    Raises:
        FlavorNotFound: no such flavor.
        FlavorAccessNotFound: the flavor is public (it has no access list).
    """
    with api_session() as session:
        flavor = _flavor(session, flavorid)
        if flavor.is_public:
            raise errors.FlavorAccessNotFound("Access list not available for public flavors.")
        return [p.project_id for p in sorted(flavor.projects, key=lambda p: p.id)]


def add(flavorid: str, project_id: str) -> list[str]:
    """Give a project access to a private flavor; the projects with access afterwards.

    Raises:
        FlavorNotFound: no such flavor.
        FlavorAccessExists: the flavor is public, or the project has access already.
    """
    exists = errors.FlavorAccessExists(
        f"Flavor access already exists for flavor {flavorid} and project {project_id} combination.")
    try:
        with api_session() as session:
            flavor = _flavor(session, flavorid)
            if flavor.is_public:
                raise errors.FlavorAccessExists("Can not add access to a public flavor.")
            if any(p.project_id == project_id for p in flavor.projects):
                raise exists
            flavor.projects.append(FlavorProject(project_id=project_id))
    except IntegrityError as exc:  # the same access given, or the flavor deleted, by a concurrent request
        with api_session() as session:
            _flavor(session, flavorid)
        raise exists from exc
    logger.info("flavor access added", extra={"flavorid": flavorid, "project_id": project_id})
    return projects(flavorid)


def remove(flavorid: str, project_id: str) -> list[str]:
    """Take a project's access to a private flavor away; the projects with access afterwards.

    Raises:
        FlavorNotFound: no such flavor.
        FlavorAccessNotFound: the project has no access to it.
    """
    with api_session() as session:
        flavor = _flavor(session, flavorid)
        granted = next((p for p in flavor.projects if p.project_id == project_id), None)
        if granted is None:
            raise errors.FlavorAccessNotFound(
                f"Flavor access not found for {flavorid} / {project_id} combination.")
        flavor.projects.remove(granted)
    logger.info("flavor access removed", extra={"flavorid": flavorid, "project_id": project_id})
    return projects(flavorid)
