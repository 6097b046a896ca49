"""Who may do what: Nova's policy rule names with a deliberately tiny rule language.

A rule is one of four words:

``admin``
    callers with the ``admin`` role.
``admin_or_owner``
    admins, and callers whose project owns the target (``target["project_id"]``).
``member`` (or ``@``)
    any authenticated caller.
``!``
    nobody.

A caller whose every role is ``reader`` (Keystone's project reader, see
:attr:`ferry.auth.RequestContext.reader_only`) passes only the rules that read
(:data:`READ_RULES`), as Nova's project reader: whatever a rule's word, it changes nothing.

Operators override rules with a YAML (or JSON) mapping of rule name to rule in the file
named by ``FERRY_POLICY_FILE``, e.g. ``{"compute:servers:resize:cross_cell": "admin"}``.
Rules not in the file keep their defaults. The file is re-read when it changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ferry import config, errors
from ferry.auth import RequestContext
from ferry.observability import logger

ADMIN = "admin"
ADMIN_OR_OWNER = "admin_or_owner"
MEMBER = "member"
ANYONE = "@"
NOBODY = "!"
RULE_WORDS = frozenset({ADMIN, ADMIN_OR_OWNER, MEMBER, ANYONE, NOBODY})

DEFAULT_RULES: dict[str, str] = {
    # servers
    "os_compute_api:servers:index": MEMBER,
    "os_compute_api:servers:detail": MEMBER,
    "os_compute_api:servers:index:get_all_tenants": ADMIN,
    "os_compute_api:servers:detail:get_all_tenants": ADMIN,
    "os_compute_api:servers:show": ADMIN_OR_OWNER,
    "os_compute_api:servers:create": MEMBER,
    "os_compute_api:servers:create:zero_disk_flavor": ADMIN,
    "os_compute_api:servers:delete": ADMIN_OR_OWNER,
    "os_compute_api:servers:update": ADMIN_OR_OWNER,
    "os_compute_api:servers:start": ADMIN_OR_OWNER,
    "os_compute_api:servers:stop": ADMIN_OR_OWNER,
    "os_compute_api:os-extended-server-attributes": ADMIN,
    "os_compute_api:os-instance-actions:list": ADMIN_OR_OWNER,
    "os_compute_api:os-instance-actions:show": ADMIN_OR_OWNER,
    "os_compute_api:os-instance-actions:events": ADMIN,
    "os_compute_api:os-instance-actions:events:details": ADMIN,
    "os_compute_api:os-admin-actions:reset_state": ADMIN,
    # flavors
    "os_compute_api:os-flavor-manage:create": ADMIN,
    "os_compute_api:os-flavor-manage:update": ADMIN,
    "os_compute_api:os-flavor-manage:delete": ADMIN,
    "os_compute_api:servers:show:host_status": ADMIN,
    "compute:servers:create:requested_destination": ADMIN,
    "os_compute_api:os-flavor-access": ADMIN,
    "os_compute_api:os-flavor-access:add_tenant_access": ADMIN,
    "os_compute_api:os-flavor-access:remove_tenant_access": ADMIN,
    "os_compute_api:os-flavor-extra-specs:index": MEMBER,
    "os_compute_api:os-flavor-extra-specs:show": MEMBER,
    "os_compute_api:os-flavor-extra-specs:create": ADMIN,
    "os_compute_api:os-flavor-extra-specs:update": ADMIN,
    "os_compute_api:os-flavor-extra-specs:delete": ADMIN,
    # moves
    "os_compute_api:servers:resize": ADMIN_OR_OWNER,
    "os_compute_api:servers:confirm_resize": ADMIN_OR_OWNER,
    "os_compute_api:servers:revert_resize": ADMIN_OR_OWNER,
    "os_compute_api:os-migrate-server:migrate": ADMIN,
    "os_compute_api:os-migrate-server:migrate:host": ADMIN,
    "os_compute_api:os-migrations:index": ADMIN,
    "os_compute_api:servers:migrations:index": ADMIN,
    "os_compute_api:servers:migrations:show": ADMIN,
    "os_compute_api:servers:migrations:delete": ADMIN,
    "os_compute_api:servers:migrations:force_complete": ADMIN,
    "compute:servers:resize:cross_cell": NOBODY,
    # quotas and limits
    "os_compute_api:os-quota-sets:show": ADMIN_OR_OWNER,
    "os_compute_api:os-quota-sets:detail": ADMIN_OR_OWNER,
    "os_compute_api:os-quota-sets:defaults": ANYONE,
    "os_compute_api:os-quota-sets:update": ADMIN,
    "os_compute_api:os-quota-sets:delete": ADMIN,
    "os_compute_api:limits": ANYONE,
    "os_compute_api:limits:other_project": ADMIN,
    # volume attachments
    "os_compute_api:os-volumes-attachments:index": ADMIN_OR_OWNER,
    "os_compute_api:os-volumes-attachments:show": ADMIN_OR_OWNER,
    "os_compute_api:os-volumes-attachments:create": ADMIN_OR_OWNER,
    "os_compute_api:os-volumes-attachments:delete": ADMIN_OR_OWNER,
    # volume look-ups (/volume/v3, Cinder's rule names)
    "volume:get": ADMIN_OR_OWNER,
    "volume:get_all": MEMBER,
    "volume_extension:volume_tenant_attribute": ADMIN,
    # host aggregates
    "os_compute_api:os-aggregates:index": ADMIN,
    "os_compute_api:os-aggregates:create": ADMIN,
    "os_compute_api:os-aggregates:show": ADMIN,
    "os_compute_api:os-aggregates:update": ADMIN,
    "os_compute_api:os-aggregates:delete": ADMIN,
    "os_compute_api:os-aggregates:add_host": ADMIN,
    "os_compute_api:os-aggregates:remove_host": ADMIN,
    "os_compute_api:os-aggregates:set_metadata": ADMIN,
    # server groups
    "os_compute_api:os-server-groups:index": MEMBER,
    "os_compute_api:os-server-groups:index:all_projects": ADMIN,
    "os_compute_api:os-server-groups:create": MEMBER,
    "os_compute_api:os-server-groups:show": ADMIN_OR_OWNER,
    "os_compute_api:os-server-groups:delete": ADMIN_OR_OWNER,
    # compute services
    "os_compute_api:os-services:list": ADMIN,
    "os_compute_api:os-services:update": ADMIN,
    "os_compute_api:os-services:delete": ADMIN,
    # drains (Ferry's own)
    "ferry:drains:create": ADMIN,
    "ferry:drains:list": ADMIN,
    "ferry:drains:show": ADMIN,
    "ferry:drains:action": ADMIN,
}

# The rules that only read: a reader-only caller passes these (as their words allow) and no other.
READ_RULES = frozenset({
    "os_compute_api:os-server-groups:index", "os_compute_api:os-server-groups:index:all_projects",
    "os_compute_api:os-server-groups:show",
    "os_compute_api:servers:index", "os_compute_api:servers:detail",
    "os_compute_api:servers:index:get_all_tenants", "os_compute_api:servers:detail:get_all_tenants",
    "os_compute_api:servers:show", "os_compute_api:servers:show:host_status",
    "os_compute_api:os-extended-server-attributes",
    "os_compute_api:os-instance-actions:list", "os_compute_api:os-instance-actions:show",
    "os_compute_api:os-instance-actions:events", "os_compute_api:os-instance-actions:events:details",
    "os_compute_api:os-flavor-access", "os_compute_api:os-flavor-extra-specs:index",
    "os_compute_api:os-flavor-extra-specs:show",
    "os_compute_api:os-migrations:index", "os_compute_api:servers:migrations:index",
    "os_compute_api:servers:migrations:show",
    "os_compute_api:os-quota-sets:show", "os_compute_api:os-quota-sets:detail",
    "os_compute_api:os-quota-sets:defaults", "os_compute_api:limits", "os_compute_api:limits:other_project",
    "os_compute_api:os-volumes-attachments:index", "os_compute_api:os-volumes-attachments:show",
    "volume:get", "volume:get_all", "volume_extension:volume_tenant_attribute",
    "os_compute_api:os-aggregates:index", "os_compute_api:os-aggregates:show",
    "os_compute_api:os-services:list",
    "ferry:drains:list", "ferry:drains:show",
})

_loaded: dict[str, Any] = {"key": None, "rules": dict(DEFAULT_RULES)}


def _check_rules(rules: Mapping[str, Any], source: str) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, rule in rules.items():
        if not isinstance(rule, str) or rule.strip() not in RULE_WORDS:
            raise errors.InvalidPolicy(f"Policy rule {name} in {source} is {rule!r}; "
                                       f"use one of {', '.join(sorted(RULE_WORDS))}.")
        checked[str(name)] = rule.strip()
    return checked


def rules() -> dict[str, str]:
    """The effective rules: defaults overridden by the configured policy file.

    Raises:
        InvalidPolicy: the file is missing, not a mapping, or uses an unknown rule.
    """
    path = config.get().policy_file
    if not path:
        return dict(DEFAULT_RULES)
    try:
        stat = os.stat(path)
        key = (path, stat.st_mtime_ns, stat.st_size)
    except OSError as exc:
        raise errors.InvalidPolicy(f"Policy file {path} cannot be read: {exc.strerror}.") from exc
    if _loaded["key"] != key:
        import yaml  # the parser loads with a policy file, not with every function

        with open(path, encoding="utf-8") as handle:
            try:
                overrides = yaml.safe_load(handle) or {}
            except yaml.YAMLError as exc:
                raise errors.InvalidPolicy(f"Policy file {path} is not valid YAML.") from exc
        if not isinstance(overrides, Mapping):
            raise errors.InvalidPolicy(f"Policy file {path} must map rule names to rules.")
        _loaded["rules"] = {**DEFAULT_RULES, **_check_rules(overrides, path)}
        _loaded["key"] = key
        logger.info("policy file loaded", extra={"policy_file": path, "overrides": len(overrides)})
    return dict(_loaded["rules"])


# The target of a rule about the cloud rather than a project (services, aggregates, drains, the
# migrations of every project, flavor management): no project owns it, so ``admin_or_owner`` set
# on such a rule allows admins only (as oslo.policy's ``project_id:%(project_id)s`` fails on a
# target without a project), never every caller.
NO_PROJECT: Mapping[str, Any] = MappingProxyType({})


def check(context: RequestContext, rule: str, target: Mapping[str, Any] | None = None) -> bool:
    """Whether ``rule`` allows ``context`` to act on ``target`` (by default the caller's own
    project; :data:`NO_PROJECT` for what no project owns).

    Raises:
        InvalidPolicy: ``rule`` is not a known rule name, or the policy file is invalid.
    """
    effective = rules()
    if rule not in effective:
        raise errors.InvalidPolicy(f"Policy rule {rule} is not registered.")
    word = effective[rule]
    if word == NOBODY or (context.reader_only and rule not in READ_RULES):
        return False
    if word in (MEMBER, ANYONE):
        return True
    if context.is_admin:
        return True
    if word == ADMIN_OR_OWNER:
        owner = context.project_id if target is None else target.get("project_id")
        return owner is not None and owner == context.project_id
    return False


def enforce(context: RequestContext, rule: str, target: Mapping[str, Any] | None = None) -> None:
    """Raise unless ``rule`` allows ``context`` to act on ``target``.

    Raises:
        Forbidden: the rule does not allow it (Nova's message names the rule).
        InvalidPolicy: ``rule`` is unknown or the policy file is invalid.
    """
    if not check(context, rule, target):
        raise errors.Forbidden(f"Policy doesn't allow {rule} to be performed.")
