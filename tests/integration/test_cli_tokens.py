"""``ferry token``: tokens issued, listed and revoked by an operator; the values shown once, never kept."""

from __future__ import annotations

import datetime as dt
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from ferry import auth, cli, config, errors
from ferry.store import db, setup
from ferry.store.api_models import AuthToken, utcnow
from ferry.store.db import api_session


@pytest.fixture
def deployment(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    monkeypatch.setenv("FERRY_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("FERRY_API_DATABASE_URL", f"sqlite:///{tmp_path / 'api.sqlite'}")
    config.reset()
    setup.init_api_database()
    yield tmp_path
    db.dispose_all()
    config.reset()


def issued(capsys, *argv: str) -> str:
    assert cli.main(["token", "issue", *argv]) == 0
    return capsys.readouterr().out.strip()


def stored() -> list[AuthToken]:
    with api_session() as session:
        return list(session.scalars(select(AuthToken).order_by(AuthToken.id)))


def test_an_issued_token_is_printed_once_stored_hashed_and_stands_for_its_identity(deployment, capsys):
    assert cli.main(["token", "issue", "--user", "alice", "--project", "demo", "--role", "member",
                     "--role", "admin"]) == 0
    out, err = capsys.readouterr()
    token = out.strip()

    assert out == token + "\n"  # standard output is the token alone (scripts read it)
    assert "user alice in project demo, roles member,admin" in err and "shown only now" in err
    ctx = auth.validate(token)
    assert (ctx.user_id, ctx.project_id, ctx.roles, ctx.is_admin) == ("alice", "demo", ("member", "admin"), True)
    [record] = stored()
    assert record.token_sha256 == auth.hash_token(token) and token not in str(record.__dict__)


def test_a_token_expires_after_30_days_unless_told_otherwise(deployment, capsys):
    before = utcnow()
    issued(capsys, "--user", "alice", "--project", "demo")
    issued(capsys, "--user", "bob", "--project", "demo", "--expires-in", "12h")
    issued(capsys, "--user", "carol", "--project", "demo", "--no-expiry")

    alice, bob, carol = stored()
    assert dt.timedelta(days=30) <= alice.expires_at - before < dt.timedelta(days=30, minutes=1)
    assert dt.timedelta(hours=12) <= bob.expires_at - before < dt.timedelta(hours=12, minutes=1)
    assert carol.expires_at is None
    assert alice.roles == ["member"]  # no --role: a member


def test_an_expired_token_is_refused(deployment, capsys):
    token = auth.issue_token("alice", "demo", ["member"], expires_at=utcnow() - dt.timedelta(seconds=1))

    with pytest.raises(errors.Unauthorized):
        auth.validate(token)


def test_the_list_shows_record_ids_and_expiry_never_the_tokens(deployment, capsys):
    token = issued(capsys, "--user", "alice", "--project", "demo", "--role", "reader", "--no-expiry")
    auth.issue_token("bob", "other", ["member"], expires_at=utcnow() - dt.timedelta(seconds=1))

    assert cli.main(["token", "list"]) == 0
    out = capsys.readouterr().out
    header, alice, bob = out.splitlines()
    assert header.split("\t") == ["id", "user", "project", "roles", "expires", "created"]
    assert alice.split("\t")[1:5] == ["alice", "demo", "reader", "never"]
    assert bob.split("\t")[1:4] == ["bob", "other", "member"] and bob.split("\t")[4].endswith("Z (expired)")
    assert token not in out and auth.hash_token(token) not in out

    assert cli.main(["token", "list", "--project", "other"]) == 0
    assert [line.split("\t")[1] for line in capsys.readouterr().out.splitlines()[1:]] == ["bob"]


def test_revoked_tokens_are_refused_at_once(deployment, capsys, monkeypatch):
    first = issued(capsys, "--user", "alice", "--project", "demo")
    second = issued(capsys, "--user", "alice", "--project", "other")
    third = issued(capsys, "--user", "bob", "--project", "demo")
    fourth = issued(capsys, "--user", "carol", "--project", "demo")
    expired = auth.issue_token("dave", "demo", ["member"], expires_at=utcnow() - dt.timedelta(seconds=1))
    ids = {record.user_id + "/" + record.project_id: record.id for record in stored()}

    # by record id
    assert cli.main(["token", "revoke", str(ids["bob/demo"])]) == 0
    assert capsys.readouterr().out == "1 token revoked\n"
    # by user in a project
    assert cli.main(["token", "revoke", "--user", "alice", "--project", "other"]) == 0
    # by value, read from standard input
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{fourth}\n\nnot-a-token\n"))
    assert cli.main(["token", "revoke", "--stdin"]) == 0
    # the expired ones
    assert cli.main(["token", "revoke", "--expired"]) == 0
    assert capsys.readouterr().out.splitlines() == ["1 token revoked", "1 token revoked", "1 token revoked"]

    for token in (second, third, fourth, expired):
        with pytest.raises(errors.Unauthorized):
            auth.validate(token)
    assert auth.validate(first).project_id == "demo"
    assert [(r.user_id, r.project_id) for r in stored()] == [("alice", "demo")]

    # every token of a user, in any project
    assert cli.main(["token", "revoke", "--user", "alice"]) == 0
    assert capsys.readouterr().out == "1 token revoked\n" and stored() == []


@pytest.mark.parametrize("selectors", [[], ["--user", "alice", "--expired"], ["1", "--user", "bob"],
                                       ["--project", "demo", "--stdin"]])
def test_a_revoke_that_names_nothing_or_names_tokens_two_ways_is_bad_usage_and_revokes_nothing(deployment, capsys,
                                                                                               selectors):
    token = issued(capsys, "--user", "alice", "--project", "demo")

    assert cli.main(["token", "revoke", *selectors]) == 2
    assert "say which tokens, one way" in capsys.readouterr().err
    assert auth.validate(token).user_id == "alice"


@pytest.mark.parametrize("argv, message", [
    (["--role", "member,admin"], "A role name is"),  # the authorizer would pass it on as two roles
    (["--role", ""], "A role name is"),
    (["--role", "x" * 65], "A role name is"),
])
def test_a_role_the_authorizer_could_not_pass_on_is_refused_and_nothing_is_stored(deployment, capsys, argv, message):
    assert cli.main(["token", "issue", "--user", "alice", "--project", "demo", *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and message in err
    assert stored() == []


@pytest.mark.parametrize("user, project", [("al ice", "demo"), ("alice", ""), ("alice", "x" * 256),
                                           ("alice\n", "demo")])
def test_an_id_with_spaces_or_too_long_is_refused(deployment, capsys, user, project):
    assert cli.main(["token", "issue", "--user", user, "--project", project]) == 1
    assert "id is 1 to 255 letters, digits, '_', '.', '@' or '-'" in capsys.readouterr().err
    assert stored() == []


@pytest.mark.parametrize("user, project, what", [("alice", "proj:1", "project"), ("alice", "proj#1", "project"),
                                                 ("alice", "d\u00e9mo", "project"), ("al/ice", "demo", "user"),
                                                 ("alice+ops", "demo", "user")])
def test_an_id_the_identity_api_could_not_find_is_refused_and_nothing_is_stored(deployment, capsys, user, project,
                                                                                 what):
    # WHEN an operator issues a token for an id outside what the identity API and flavor access take
    status = cli.main(["token", "issue", "--user", user, "--project", project])

    # THEN the CLI refuses it with one error line, and no token is made
    out, err = capsys.readouterr()
    assert status == 1 and out == ""
    assert err.startswith(f"ferry: A {what} id is 1 to 255 letters, digits, '_', '.', '@' or '-': ")
    assert len(err.splitlines()) == 1
    assert stored() == []


@pytest.mark.parametrize("lifetime", ["0", "30s", "3651d", "12x", "-5", "1.5h", ""])
def test_a_lifetime_out_of_range_or_unreadable_is_bad_usage(deployment, capsys, lifetime):
    with pytest.raises(SystemExit) as exited:
        cli.main(["token", "issue", "--user", "alice", "--project", "demo", "--expires-in", lifetime])
    assert exited.value.code == 2
    assert stored() == []


def test_no_expiry_and_a_lifetime_together_are_bad_usage(deployment, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["token", "issue", "--user", "alice", "--project", "demo", "--no-expiry", "--expires-in", "1d"])
    assert exited.value.code == 2


@pytest.mark.parametrize("record_id", ["99999999999999999999999", str(2**63)])
def test_a_record_id_no_database_can_hold_is_a_usage_error_not_an_overflow(deployment, capsys, record_id):
    # GIVEN a token, and a record id beyond the largest integer the database stores
    issued(capsys, "--user", "alice", "--project", "demo")

    # WHEN the operator revokes by that id
    with pytest.raises(SystemExit) as exited:
        cli.main(["token", "revoke", record_id])

    # THEN argparse refuses it (exit 2), naming the argument, and no token is revoked
    assert exited.value.code == 2
    assert "argument ID" in capsys.readouterr().err
    assert len(stored()) == 1

