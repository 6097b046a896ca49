"""Enough of the identity API's domains for clients that look a domain up before a user.

Ferry has one domain, Keystone's default (id ``default``, name ``Default``), the domain of every project and user
(see :mod:`ferry.api.projects` and :mod:`ferry.api.users`). ``openstack server list --user U
--user-domain D`` and ``openstack server migration list --user U --user-domain D`` look ``D`` up
here first, by id and then by name. Every caller with a token may see it: it is her token's domain.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import errors
from ferry.api import request

router = Router()

PREFIX = "/identity/v3/domains"
# Keystone's default domain: id ``default``, name ``Default`` (what openrc files name it).
DEFAULT_DOMAIN = "default"
DEFAULT_DOMAIN_NAME = "Default"


def _domain(base_url: str) -> dict[str, Any]:
    return {"id": DEFAULT_DOMAIN, "name": DEFAULT_DOMAIN_NAME, "description": "The default domain", "enabled": True,
            "tags": [], "options": {}, "links": {"self": f"{base_url}{PREFIX}/{DEFAULT_DOMAIN}"}}


@router.get(f"{PREFIX}/<domain_id>")
def show_domain(domain_id: str) -> Response:
    request.caller(router)
    if domain_id != DEFAULT_DOMAIN:
        raise errors.NotFound(f"Could not find domain: {domain_id}.")
    return request.json_response(200, {"domain": _domain(request.base_url(router))})


@router.get(PREFIX)
def list_domains() -> Response:
    """``?name=`` and ``?id=`` narrow the list (to nothing when they name another domain)."""
    request.caller(router)
    params = request.query(router)
    name, domain_id = request.last(params, "name"), request.last(params, "id")
    base_url = request.base_url(router)
    # Names compare as Keystone's database compares them by default, whatever the case.
    found = (name is None or name.casefold() == DEFAULT_DOMAIN_NAME.casefold()) and domain_id in (None, DEFAULT_DOMAIN)
    domains = [_domain(base_url)] if found else []
    return request.json_response(200, {"domains": domains,
                                       "links": {"self": f"{base_url}{PREFIX}", "next": None, "previous": None}})
