"""Tokens and the API Gateway REQUEST authorizer, then the API with the authorizer's context."""

from __future__ import annotations

import datetime as dt

import pytest
from test_api_support import LambdaContext, function, proxy_event

from ferry import auth, errors
from ferry.store.api_models import AuthToken, utcnow
from ferry.store.db import api_session

METHOD_ARN = "arn:aws:execute-api:us-east-1:123456789012:abc123/local/GET/v2.1/servers/detail"


def authorizer_event(token: str | None) -> dict:
    headers = {"X-Auth-Token": token} if token is not None else {}
    return {"type": "REQUEST", "methodArn": METHOD_ARN, "resource": "/v2.1/{proxy+}", "path": "/v2.1/servers/detail",
            "httpMethod": "GET", "headers": headers, "multiValueHeaders": {k: [v] for k, v in headers.items()},
            "queryStringParameters": {}, "pathParameters": {"proxy": "servers/detail"}, "stageVariables": {},
            "requestContext": {"stage": "local", "requestId": "c6af9ac6-7b61-11e6-9a41-93e8deadbeef",
                               "httpMethod": "GET", "path": "/local/v2.1/servers/detail"}}


def test_tokens_are_stored_hashed_and_validate_to_their_identity(store):
    token = auth.issue_token("alice", "project-a", ["member", "admin"])

    ctx = auth.validate(token)

    assert (ctx.user_id, ctx.project_id, ctx.roles, ctx.is_admin) == ("alice", "project-a", ("member", "admin"),
                                                                       True)
    assert ctx.request_id.startswith("req-")
    with api_session() as session:
        stored = session.query(AuthToken).one()
    assert stored.token_sha256 == auth.hash_token(token) and token not in stored.token_sha256


def test_issuing_a_known_token_again_replaces_its_identity(store):
    auth.issue_token("alice", "project-a", ["member"], token="seeded-token")
    auth.issue_token("alice", "project-b", ["reader"], token="seeded-token")

    ctx = auth.validate("seeded-token")
    assert (ctx.project_id, ctx.roles, ctx.is_admin) == ("project-b", ("reader",), False)


def test_a_token_for_an_id_the_identity_api_cannot_find_is_refused_while_one_stored_before_still_works(store):
    # GIVEN a token stored, before ids were bounded as the identity API bounds them, for project proj:1
    with api_session() as session:
        session.add(AuthToken(token_sha256=auth.hash_token("older-token"), user_id="alice", project_id="proj:1",
                              roles=["member"]))

    # WHEN a new token is asked for the same project, and for a project the identity API finds
    with pytest.raises(errors.BadRequest) as refused:
        auth.issue_token("alice", "proj:1", ["member"])
    token = auth.issue_token("alice@example.org", "team.a-1_b", ["member"])

    # THEN only the new one for proj:1 is refused; the token stored before still stands for its identity
    assert refused.value.message == "A project id is 1 to 255 letters, digits, '_', '.', '@' or '-': 'proj:1'."
    assert (auth.validate(token).user_id, auth.validate(token).project_id) == ("alice@example.org", "team.a-1_b")
    assert auth.validate("older-token").project_id == "proj:1"


@pytest.mark.parametrize("token", [None, "", "unknown", "expired"])
def test_missing_unknown_and_expired_tokens_are_unauthorized(store, token):
    auth.issue_token("alice", "project-a", ["member"], token="expired", expires_at=utcnow() - dt.timedelta(seconds=1))

    with pytest.raises(errors.Unauthorized):
        auth.validate(token)


def test_authorizer_allows_the_whole_stage_and_passes_the_identity(store):
    token = auth.issue_token("alice", "project-a", ["member", "admin"])

    policy = function("authorizer").handler(authorizer_event(token), LambdaContext())

    assert policy["principalId"] == "alice"
    [statement] = policy["policyDocument"]["Statement"]
    assert (statement["Action"], statement["Effect"]) == ("execute-api:Invoke", "Allow")
    assert statement["Resource"] == ["arn:aws:execute-api:us-east-1:123456789012:abc123/local/*/*"]
    assert policy["context"] == {"user_id": "alice", "project_id": "project-a", "roles": "member,admin"}
    assert all(isinstance(v, str) for v in policy["context"].values())


def test_authorizer_accepts_the_header_in_any_case(store):
    token = auth.issue_token("alice", "project-a", ["member"])
    event = authorizer_event(None)
    event["headers"] = {"x-auth-token": token}

    assert function("authorizer").handler(event, LambdaContext())["principalId"] == "alice"


@pytest.mark.parametrize("token", [None, "bogus"])
def test_authorizer_denies_with_the_message_api_gateway_maps_to_401(store, token):
    with pytest.raises(Exception) as raised:
        function("authorizer").handler(authorizer_event(token), LambdaContext())

    assert type(raised.value) is Exception and str(raised.value) == "Unauthorized"


def test_the_api_acts_as_the_identity_the_authorizer_passed(store):
    token = auth.issue_token("alice", "project-a", ["member"])
    context = function("authorizer").handler(authorizer_event(token), LambdaContext())["context"]
    event = proxy_event("GET", "/v2.1/servers", caller=None)
    event["requestContext"]["authorizer"] = {"principalId": "alice", **context}

    result = function("api").handler(event, LambdaContext())

    assert result["statusCode"] == 200


def test_context_from_authorizer_needs_an_identity():
    with pytest.raises(errors.Unauthorized):
        auth.context_from_authorizer({"principalId": "x"})
    ctx = auth.context_from_authorizer({"user_id": "u", "project_id": "p", "roles": "member, admin"}, "req-1")
    assert (ctx.roles, ctx.is_admin, ctx.request_id) == (("member", "admin"), True, "req-1")
