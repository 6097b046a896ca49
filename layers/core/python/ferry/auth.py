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
import re
import secrets
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from aws_lambda_powertools.metrics import MetricUnit
from sqlalchemy import ColumnElement, CursorResult, and_, delete, or_, select

from ferry import errors
from ferry.observability import metrics
from ferry.store.api_models import AuthToken, FlavorProject, InstanceMapping, Quota, utcnow
from ferry.store.db import api_session

TOKEN_HEADER = "X-Auth-Token"
ADMIN_ROLE = "admin"
# Keystone's read-only project role.
READER_ROLE = "reader"
# A role's name as tokens record it.
ROLE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A user's or project's id as a new token records it: one the identity API finds, and flavor access
# and quotas take (the API's schemas use this pattern). Tokens issued before with other ids still work.
IDENTITY_ID = re.compile(r"[A-Za-z0-9_.@-]{1,255}")


def new_request_id() -> str:
    """A request id in Nova's format (``req-<uuid>``)."""
    return f"req-{uuid.uuid4()}"


@dataclass(frozen=True)
class RequestContext:
    """Who is calling and under which request id.

    ``is_admin`` follows from ``roles`` (the ``admin`` role) and cannot be set on its own;
    ``reader_only`` too: a caller whose every role is ``reader`` (Keystone's project reader)
    reads, and changes nothing (:mod:`ferry.policy`). Roles are kept in lower case, as role
    names compare regardless of case (as oslo.policy compares them): ``Admin`` is ``admin``.
    """

    user_id: str
    project_id: str
    roles: tuple[str, ...] = ()
    request_id: str = field(default_factory=new_request_id)
    is_admin: bool = field(init=False)
    reader_only: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(role.lower() for role in self.roles))
        object.__setattr__(self, "is_admin", ADMIN_ROLE in self.roles)
        object.__setattr__(self, "reader_only", bool(self.roles) and not self.is_admin
                           and all(role == READER_ROLE for role in self.roles))


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
    roles = list(roles)
    for role in roles:
        # The authorizer passes roles on comma-joined: a comma in one would make two.
        if not ROLE_NAME.fullmatch(role):
            raise errors.BadRequest(f"A role name is 1 to 64 letters, digits, '_', '.' or '-': {role!r}.")
    for what, value in (("user", user_id), ("project", project_id)):
        if not IDENTITY_ID.fullmatch(value):
            raise errors.BadRequest(f"A {what} id is 1 to 255 letters, digits, '_', '.', '@' or '-': {value!r}.")
    token = token or secrets.token_urlsafe(32)
    digest = hash_token(token)
    with api_session() as session:
        record = session.scalars(select(AuthToken).where(AuthToken.token_sha256 == digest)).one_or_none()
        if record is None:
            record = AuthToken(token_sha256=digest)
            session.add(record)
        record.user_id, record.project_id = user_id, project_id
        record.roles, record.expires_at = roles, expires_at
    return token


def revoke_token(token: str) -> None:
    """Forget a token (no-op when it is unknown)."""
    revoke_tokens(tokens=[token])


@dataclass(frozen=True)
class TokenRecord:
    """What is kept of a token: never the token itself."""

    id: int
    user_id: str
    project_id: str
    roles: tuple[str, ...]
    expires_at: dt.datetime | None
    created_at: dt.datetime

    @property
    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= utcnow()


def list_tokens(user_id: str | None = None, project_id: str | None = None) -> list[TokenRecord]:
    """The stored tokens (of ``user_id``, in ``project_id``, when given), oldest first."""
    query = select(AuthToken).order_by(AuthToken.created_at, AuthToken.id)
    if user_id is not None:
        query = query.where(AuthToken.user_id == user_id)
    if project_id is not None:
        query = query.where(AuthToken.project_id == project_id)
    with api_session() as session:
        return [TokenRecord(id=record.id, user_id=record.user_id, project_id=record.project_id,
                            roles=tuple(record.roles or ()), expires_at=record.expires_at,
                            created_at=record.created_at)
                for record in session.scalars(query)]


def revoke_tokens(*, ids: Iterable[int] = (), tokens: Iterable[str] = (), user_id: str | None = None,
                  project_id: str | None = None, expired: bool = False) -> int:
    """Forget the tokens named (by record id, by value), those of ``user_id`` (in ``project_id``),
    those of ``project_id``, or the expired ones; returns how many were forgotten. Unknown ids
    and values are no error: a token revoked twice is gone either way."""
    conditions: list[ColumnElement[bool]] = []
    if ids := list(ids):
        conditions.append(AuthToken.id.in_(ids))
    if digests := [hash_token(token) for token in tokens]:
        conditions.append(AuthToken.token_sha256.in_(digests))
    if user_id is not None or project_id is not None:
        owner = [AuthToken.user_id == user_id] if user_id is not None else []
        owner += [AuthToken.project_id == project_id] if project_id is not None else []
        conditions.append(and_(*owner))
    if expired:
        conditions.append(AuthToken.expires_at <= utcnow())
    if not conditions:
        return 0
    with api_session() as session:
        return cast(CursorResult[Any], session.execute(delete(AuthToken).where(or_(*conditions)))).rowcount


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
