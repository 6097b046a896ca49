"""Enough of the identity API's users for clients that look a user up before acting on it.

Ferry has no identity service: a user is an id, and its name is its id, as a project is (see
:mod:`ferry.api.projects`). ``openstack server list --user U`` and ``openstack server migration
list --user U`` look ``U`` up here first, by id and then by name, and send the id they find. To an
admin every well-formed id is a user (one with nothing yet included), and the list holds the
users Ferry knows: those its tokens stand for and those owning servers. A member may look up only
herself; any other user is 403, Keystone's answer to a member, which the clients take as "use the
name as the id" (the compute API then decides what she may see).
"""

from __future__ import annotations

import re
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router
from sqlalchemy import select

from ferry import auth, errors
from ferry.api import request, schemas
from ferry.store.api_models import AuthToken, InstanceMapping
from ferry.store.db import api_session

router = Router()

PREFIX = "/identity/v3/users"
# A user id takes the characters a project id takes.
USER_ID = re.compile(schemas.PROJECT_ID_PATTERN)


def known_users() -> list[str]:
    """The users Ferry knows (those its tokens stand for and those owning servers), sorted."""
    with api_session() as session:
        found: set[str | None] = set()
        for column in (AuthToken.user_id, InstanceMapping.user_id):
            found.update(session.scalars(select(column).distinct()))
    return sorted(user for user in found if user)


def _user(base_url: str, user_id: str) -> dict[str, Any]:
    return {"id": user_id, "name": user_id, "domain_id": "default", "enabled": True, "password_expires_at": None,
            "options": {}, "links": {"self": f"{base_url}{PREFIX}/{user_id}"}}


def _visible(ctx: auth.RequestContext, user_id: str | None, rule: str) -> list[str]:
    """The users the caller may see: all Ferry knows, or only ``user_id`` (for an admin, any
    well-formed id; for a member, herself).

    Raises:
        Forbidden: a member asking for another user.
    """
    if not ctx.is_admin:
        if user_id not in (None, ctx.user_id) or not ctx.user_id:
            raise errors.Forbidden(f"You are not authorized to perform the requested action: {rule}.")
        return [ctx.user_id]
    if user_id is None:
        return known_users()
    return [user_id] if USER_ID.match(user_id) else []


@router.get(f"{PREFIX}/<user_id>")
def show_user(user_id: str) -> Response:
    ctx = request.caller(router)
    if not _visible(ctx, user_id, "identity:get_user"):
        raise errors.NotFound(f"Could not find user: {user_id}.")
    return request.json_response(200, {"user": _user(request.base_url(router), user_id)})


@router.get(PREFIX)
def list_users() -> Response:
    """``?name=`` (or ``?id=``) narrows the list to that user."""
    ctx = request.caller(router)
    params = request.query(router)
    users = _visible(ctx, request.last(params, "name") or request.last(params, "id"), "identity:list_users")
    base_url = request.base_url(router)
    return request.json_response(200, {"users": [_user(base_url, u) for u in users],
                                       "links": {"self": f"{base_url}{PREFIX}", "next": None, "previous": None}})
