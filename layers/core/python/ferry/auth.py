"""API tokens and the identity of a request.

Tokens are opaque random strings handed to operators and users (``ferry`` CLI, seeding
scripts); only their SHA-256 is stored. The API Gateway authorizer validates the
``X-Auth-Token`` header with :func:`authorize` and passes the caller's identity to the
compute API as string values in the authorizer context; the API rebuilds a
:class:`RequestContext` from it with :func:`context_from_authorizer`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from sqlalchemy import select

from ferry import errors
from ferry.observability import metrics
from ferry.store.api_models import AuthToken, FlavorProject, InstanceMapping, Quota, utcnow
from ferry.store.db import api_session

TOKEN_HEADER = "X-Auth-Token"
ADMIN_ROLE = "admin"
# Keystone's read-only project role.
READER_ROLE = "reader"


def new_request_id() -> str:
    """A request id in Nova's format (``req-<uuid>``)."""
    return f"req-{uuid.uuid4()}"


@dataclass(frozen=True)
class RequestContext:
    """Who is calling and under which request id.

    ``is_admin`` follows from ``roles`` (the ``admin`` role) and cannot be set on its own;
    ``reader_only`` too: a caller whose every role is ``reader`` (Keystone's project reader)
    reads, and changes nothing (:mod:`ferry.policy`).
    """

    user_id: str
    project_id: str
    roles: tuple[str, ...] = ()
    request_id: str = field(default_factory=new_request_id)
    is_admin: bool = field(init=False)
    reader_only: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))
        object.__setattr__(self, "is_admin", ADMIN_ROLE in self.roles)
        object.__setattr__(self, "reader_only", bool(self.roles) and not self.is_admin
                           and all(role.lower() == READER_ROLE for role in self.roles))


def hash_token(token: str) -> str:
    """The stored form of a token (hex SHA-256)."""
    return hashlib.sha256(token.encode()).hexdigest()


def issue_token(user_id: str, project_id: str, roles: Iterable[str], token: str | None = None,
                expires_at: dt.datetime | None = None) -> str:
    """Store a token for ``user_id`` in ``project_id`` with ``roles`` and return it.

    Params:
        token: the token to store; a new random one when omitted. Issuing an existing token
            again replaces the identity it stands for (so seeding is idempotent).
        expires_at: naive UTC expiry; ``None`` never expires.
    """
    token = token or secrets.token_urlsafe(32)
    digest = hash_token(token)
    with api_session() as session:
        record = session.scalars(select(AuthToken).where(AuthToken.token_sha256 == digest)).one_or_none()
        if record is None:
            record = AuthToken(token_sha256=digest)
            session.add(record)
        record.user_id, record.project_id = user_id, project_id
        record.roles, record.expires_at = list(roles), expires_at
    return token


def revoke_token(token: str) -> None:
    """Forget a token (no-op when it is unknown)."""
    with api_session() as session:
        record = session.scalars(select(AuthToken).where(AuthToken.token_sha256 == hash_token(token))).one_or_none()
        if record is not None:
            session.delete(record)


def known_projects(project_id: str | None = None) -> list[str]:
    """The projects Ferry knows (those its tokens stand for, that own servers, have quotas set or
    access to private flavors), sorted; only ``project_id`` (if known) when given. Ferry has no
    identity service: a project is an id."""
    with api_session() as session:
        found: set[str] = set()
        for column in (AuthToken.project_id, InstanceMapping.project_id, Quota.project_id, FlavorProject.project_id):
            query = select(column).distinct()
            if project_id is not None:
                query = query.where(column == project_id)
            found.update(session.scalars(query))
    return sorted(found)


def validate(token: str | None) -> RequestContext:
    """The identity ``token`` stands for.

    Raises:
        Unauthorized: no token, an unknown token, or an expired one.
    """
    if not token:
        raise errors.Unauthorized()
    with api_session() as session:
        record = session.scalars(select(AuthToken).where(AuthToken.token_sha256 == hash_token(token))).one_or_none()
        if record is None or (record.expires_at is not None and record.expires_at <= utcnow()):
            raise errors.Unauthorized()
        return RequestContext(user_id=record.user_id, project_id=record.project_id, roles=tuple(record.roles or ()))


def authorize(event: Mapping[str, Any]) -> dict[str, Any]:
    """Answer an API Gateway REQUEST authorizer event.

    Returns an IAM policy allowing ``execute-api:Invoke`` on every method of the stage the
    request came through, with the caller's ``user_id``, ``project_id`` and comma-joined
    ``roles`` as the authorizer context (API Gateway passes only string values on).

    Raises:
        Unauthorized: the ``X-Auth-Token`` header is missing, unknown or expired.
    """
    # The authorizer's event classes load in the authorizer alone (every function imports this module).
    from aws_lambda_powertools.utilities.data_classes.api_gateway_authorizer_event import (
        APIGatewayAuthorizerRequestEvent,
        APIGatewayAuthorizerResponse,
    )

    request = APIGatewayAuthorizerRequestEvent(dict(event))
    try:
        ctx = validate(request.headers.get(TOKEN_HEADER))  # headers are case-insensitive
    except errors.Unauthorized:
        metrics.add_metric(name="TokenRejected", unit=MetricUnit.Count, value=1)
        raise
    metrics.add_metric(name="TokenAccepted", unit=MetricUnit.Count, value=1)
    response = APIGatewayAuthorizerResponse.from_route_arn(
        request.method_arn,
        principal_id=ctx.user_id,
        context={"user_id": ctx.user_id, "project_id": ctx.project_id, "roles": ",".join(ctx.roles)},
    )
    response.allow_all_routes()
    return response.asdict()


def context_from_authorizer(authorizer: Mapping[str, Any] | None, request_id: str | None = None) -> RequestContext:
    """Rebuild the caller's context from ``requestContext.authorizer`` of a proxy event.

    Raises:
        Unauthorized: the event carries no authorizer identity.
    """
    authorizer = authorizer or {}
    user_id, project_id = authorizer.get("user_id"), authorizer.get("project_id")
    if not user_id or not project_id:
        raise errors.Unauthorized()
    roles = tuple(r.strip() for r in str(authorizer.get("roles") or "").split(",") if r.strip())
    return RequestContext(user_id=str(user_id), project_id=str(project_id), roles=roles,
                          request_id=request_id or new_request_id())
