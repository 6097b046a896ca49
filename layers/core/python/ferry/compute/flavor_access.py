"""Flavor access: who may use a flavor (Nova's ``os-flavor-access``).

A public flavor is anyone's. A private flavor is for admins and for the projects given access
to it (:func:`ferry.compute.api.add_flavor_access`); to anyone else it does not exist: it is
not listed, shown, booted or resized to.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, or_

from ferry.auth import RequestContext
from ferry.store.api_models import Flavor, FlavorProject


def usable(ctx: RequestContext, flavor: Flavor) -> bool:
    """Whether the caller may see and use ``flavor``."""
    return flavor.is_public or ctx.is_admin or any(p.project_id == ctx.project_id for p in flavor.projects)


def usable_clause(ctx: RequestContext) -> ColumnElement[bool]:
    """The flavors a non-admin caller may see and use, as a query condition."""
    return or_(Flavor.is_public.is_(True), Flavor.projects.any(FlavorProject.project_id == ctx.project_id))
