"""The policy rules: Nova's defaults and operator overrides from a policy file."""

from __future__ import annotations

import pytest

from ferry import config, errors, policy
from ferry.auth import RequestContext

MEMBER = RequestContext(user_id="alice", project_id="project-a", roles=("member",))
ADMIN = RequestContext(user_id="root", project_id="admin-project", roles=("admin",))
OTHERS = {"project_id": "project-b"}


@pytest.fixture
def policy_file(tmp_path, monkeypatch):
    path = tmp_path / "policy.yaml"
    monkeypatch.setenv("FERRY_POLICY_FILE", str(path))
    config.reset()
    yield path
    config.reset()


@pytest.fixture(autouse=True)
def no_policy_file(monkeypatch):
    monkeypatch.delenv("FERRY_POLICY_FILE", raising=False)
    config.reset()
    yield
    config.reset()


def test_owner_rules_allow_the_owning_project_and_admins_only():
    assert policy.check(MEMBER, "os_compute_api:servers:stop", {"project_id": "project-a"})
    assert not policy.check(MEMBER, "os_compute_api:servers:stop", OTHERS)
    assert policy.check(ADMIN, "os_compute_api:servers:stop", OTHERS)


def test_admin_rules_refuse_members_with_novas_message():
    with pytest.raises(errors.Forbidden) as raised:
        policy.enforce(MEMBER, "os_compute_api:os-flavor-manage:create")
    assert raised.value.message == "Policy doesn't allow os_compute_api:os-flavor-manage:create to be performed."
    policy.enforce(ADMIN, "os_compute_api:os-flavor-manage:create")


def test_cross_cell_moves_are_off_for_everyone_by_default():
    assert not policy.check(ADMIN, "compute:servers:resize:cross_cell")
    assert not policy.check(MEMBER, "compute:servers:resize:cross_cell")


def test_move_rules_have_novas_defaults():
    assert policy.check(MEMBER, "os_compute_api:servers:resize")
    assert not policy.check(MEMBER, "os_compute_api:os-migrate-server:migrate")
    assert not policy.check(MEMBER, "os_compute_api:os-migrations:index")
    assert policy.check(ADMIN, "os_compute_api:os-migrate-server:migrate")


def test_resetting_a_servers_state_is_for_admins_only_even_on_the_owners_server():
    assert not policy.check(MEMBER, "os_compute_api:os-admin-actions:reset_state", {"project_id": "project-a"})
    assert policy.check(ADMIN, "os_compute_api:os-admin-actions:reset_state", OTHERS)


def test_a_policy_file_overrides_only_the_rules_it_names(policy_file):
    policy_file.write_text('compute:servers:resize:cross_cell: admin\n"os_compute_api:servers:create": "!"\n')

    assert policy.check(ADMIN, "compute:servers:resize:cross_cell")
    assert not policy.check(MEMBER, "compute:servers:resize:cross_cell")
    assert not policy.check(ADMIN, "os_compute_api:servers:create")
    assert policy.check(MEMBER, "os_compute_api:servers:index")


def test_a_changed_policy_file_is_read_again(policy_file):
    policy_file.write_text("os_compute_api:os-migrations:index: admin\n")
    assert not policy.check(MEMBER, "os_compute_api:os-migrations:index")

    policy_file.write_text("os_compute_api:os-migrations:index: '@'\n")
    assert policy.check(MEMBER, "os_compute_api:os-migrations:index")


@pytest.mark.parametrize("content", ["os_compute_api:servers:create: role:admin\n", "- a list\n", "{unclosed"])
def test_an_invalid_policy_file_is_refused(policy_file, content):
    policy_file.write_text(content)

    with pytest.raises(errors.InvalidPolicy):
        policy.check(MEMBER, "os_compute_api:servers:create")


def test_a_missing_policy_file_or_unknown_rule_is_refused(tmp_path, monkeypatch):
    with pytest.raises(errors.InvalidPolicy):
        policy.check(MEMBER, "os_compute_api:servers:teleport")
    monkeypatch.setenv("FERRY_POLICY_FILE", str(tmp_path / "missing.yaml"))
    config.reset()
    with pytest.raises(errors.InvalidPolicy):
        policy.check(MEMBER, "os_compute_api:servers:create")


READER = RequestContext(user_id="carol", project_id="project-a", roles=("reader",))


def test_a_reader_reads_her_projects_servers_and_changes_nothing_whatever_the_rules_say(policy_file):
    policy_file.write_text("{}\n")
    assert READER.reader_only and not MEMBER.reader_only and not ADMIN.reader_only
    assert not RequestContext(user_id="dave", project_id="project-a", roles=("reader", "member")).reader_only
    assert policy.check(READER, "os_compute_api:servers:show") and policy.check(READER, "os_compute_api:servers:index")
    for rule in ("os_compute_api:servers:create", "os_compute_api:servers:delete", "os_compute_api:servers:stop",
                 "os_compute_api:servers:resize", "os_compute_api:servers:confirm_resize",
                 "os_compute_api:os-volumes-attachments:create"):
        assert policy.check(MEMBER, rule) and not policy.check(READER, rule), rule
    # an operator opening a write to everyone does not open it to readers
    policy_file.write_text('"os_compute_api:os-migrate-server:migrate": "@"\n')
    assert policy.check(MEMBER, "os_compute_api:os-migrate-server:migrate")
    assert not policy.check(READER, "os_compute_api:os-migrate-server:migrate")


def test_every_read_rule_is_a_rule():
    assert policy.READ_RULES <= set(policy.DEFAULT_RULES)
