"""A token's roles: names compare regardless of case, as oslo.policy compares them."""

from __future__ import annotations

import pytest

from ferry import auth, config, policy
from ferry.auth import RequestContext

FLAVOR_CREATE = "os_compute_api:os-flavor-manage:create"
SERVER_STOP = "os_compute_api:servers:stop"
OWN = {"project_id": "project-a"}


@pytest.fixture(autouse=True)
def no_policy_file(monkeypatch):
    monkeypatch.delenv("FERRY_POLICY_FILE", raising=False)
    config.reset()
    yield
    config.reset()


def caller(*roles: str) -> RequestContext:
    return RequestContext(user_id="alice", project_id="project-a", roles=roles)


@pytest.mark.parametrize("role", ["Admin", "ADMIN", "aDmIn"])
def test_the_admin_role_makes_an_administrator_in_any_case(role):
    ctx = caller(role, "member")

    assert ctx.is_admin and not ctx.reader_only
    assert policy.check(ctx, FLAVOR_CREATE)


def test_a_reader_who_also_has_the_admin_role_in_another_case_is_an_administrator_not_a_reader():
    # GIVEN a token whose roles are reader and Admin
    ctx = caller("reader", "Admin")

    # THEN she is an administrator: she may do what admins do, not only read
    assert (ctx.is_admin, ctx.reader_only) == (True, False)
    assert policy.check(ctx, FLAVOR_CREATE) and policy.check(ctx, SERVER_STOP, {"project_id": "project-b"})


def test_roles_are_kept_in_lower_case_whatever_the_authorizer_passed_on():
    ctx = auth.context_from_authorizer({"user_id": "alice", "project_id": "project-a", "roles": "Member,READER"})

    assert ctx.roles == ("member", "reader")
    assert caller("READER").reader_only and not policy.check(caller("READER"), SERVER_STOP, OWN)
