"""The compute API as an OpenAPI 3.1 document, served without a token at ``GET /v2.1/openapi.json``.

Paths and methods are read from the resolver's routes and request bodies are the JSON schemas
the routes validate with (:mod:`ferry.api.schemas` and the routers' own), so the document
follows the code. What only this module says, per operation: a summary, the success status,
the query parameters and the errors it may answer. Bodies are those of the newest
microversion; an older version may refuse a key the document shows (400).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from aws_lambda_powertools.event_handler import Response
from aws_lambda_powertools.event_handler.api_gateway import Router

from ferry import drains as drain_store
from ferry import quotas
from ferry.api import (
    aggregates,
    drains,
    migrations,
    request,
    schemas,
    server_groups,
    servers,
    services,
    volume_attachments,
)
from ferry.api.microversions import HEADER, LEGACY_HEADER, MAX_VERSION, MIN_VERSION

router = Router()

PATH = f"{request.API_PREFIX}/openapi.json"
OPENAPI_VERSION = "3.1.0"

# The paths served without a token (the template gives them no authorizer).
PUBLIC_PATHS = frozenset({"/", request.API_PREFIX, "/identity/v3", request.VOLUME_PREFIX, PATH})

Schema = dict[str, Any]

_STRING: Schema = {"type": "string"}
_INTEGER: Schema = {"type": "integer"}
_OBJECT: Schema = {"type": "object"}
_OBJECTS: Schema = {"type": "array", "items": _OBJECT}


def _keyed(key: str, inner: dict[str, Any]) -> dict[str, Any]:
    """An object with ``key`` holding ``inner`` (the wrapper every Nova body has)."""
    return {"type": "object", "required": [key], "properties": {key: inner}}


def _shape(*required: str, **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": properties}


_LINKS = {"type": "array", "items": _shape("rel", "href", rel=_STRING, href=_STRING)}
_VERSION = _keyed("version", _shape("id", "status", "links", id=_STRING, status=_STRING, version=_STRING,
                                    min_version=_STRING, links=_LINKS))
_VERSIONS = _keyed("versions", {"type": "array", "items": _VERSION["properties"]["version"]})
_SERVER_SUMMARY = _shape("id", "name", "links", id=_STRING, name=_STRING, links=_LINKS)
_SERVER = _shape("id", "name", "status", "links", "flavor", id=_STRING, name=_STRING, status=_STRING,
                 links=_LINKS, flavor=_OBJECT, tenant_id=_STRING, user_id=_STRING)
# A server of a cell whose database does not answer (2.69), in a list: its status is UNKNOWN.
_UNKNOWN_SERVER = _shape("id", "status", "links", id=_STRING, status={"const": "UNKNOWN"}, links=_LINKS)
_UNKNOWN_SERVER_DETAIL = _shape("id", "status", "links", "tenant_id", "created", id=_STRING,
                                status={"const": "UNKNOWN"}, links=_LINKS, tenant_id=_STRING, created=_STRING)
_UNKNOWN_SERVER_ONE = _shape("id", "status", "links", "tenant_id", "user_id", "created", "flavor", "image",
                              id=_STRING, status={"const": "UNKNOWN"}, links=_LINKS, tenant_id=_STRING,
                              created=_STRING, flavor=_OBJECT)
_SERVERS = {**_keyed("servers", {"type": "array", "items": _SERVER_SUMMARY}),
            "properties": {"servers": {"type": "array", "items": {"anyOf": [_SERVER_SUMMARY, _UNKNOWN_SERVER]}},
                           "servers_links": _LINKS}}
_SERVERS_DETAIL = {**_SERVERS, "properties": {
    "servers": {"type": "array", "items": {"anyOf": [_SERVER, _UNKNOWN_SERVER_DETAIL]}}, "servers_links": _LINKS}}
# The server, or with return_reservation_id its create request's reservation id.
_CREATED_SERVER = {"oneOf": [_keyed("server", _shape("id", "links", id=_STRING, links=_LINKS, adminPass=_STRING)),
                             {**_keyed("reservation_id", _STRING), "additionalProperties": False}]}
_FLAVOR = _shape("id", "name", "links", id=_STRING, name=_STRING, links=_LINKS, ram=_INTEGER, vcpus=_INTEGER,
                 disk=_INTEGER)
_FLAVOR_SUMMARY = _shape("id", "name", "links", id=_STRING, name=_STRING, links=_LINKS)
_INSTANCE_ACTION = _shape("action", "request_id", action=_STRING, request_id=_STRING, instance_uuid=_STRING)
_MIGRATION = _shape("id", "status", "instance_uuid", id=_INTEGER, status=_STRING, instance_uuid=_STRING)
_EXTRA_SPECS = _keyed("extra_specs", {"type": "object", "additionalProperties": _STRING})
_QUOTA_SET = _keyed("quota_set", {"type": "object", "additionalProperties": {"type": ["integer", "object",
                                                                                         "string"]}})
_AGGREGATE = _shape("id", "name", id=_INTEGER, name=_STRING, hosts={"type": "array", "items": _STRING},
                    metadata=_OBJECT)
_SERVER_GROUP = _shape("id", "name", "members", id=_STRING, name=_STRING, members={"type": "array", "items": _STRING})
_SERVICE = _shape("host", "binary", host=_STRING, binary=_STRING, status=_STRING)
_ATTACHMENT = _shape("device", "serverId", "volumeId", device={"type": ["string", "null"]}, serverId=_STRING,
                     volumeId=_STRING)
_DRAIN = _shape("id", "status", id=_STRING, status=_STRING)


@dataclass(frozen=True)
class Operation:
    """What the document says of one route beyond its path and method."""

    summary: str
    success: dict[int, dict[str, Any] | None]  # status -> body schema (None: no body)
    body: dict[str, Any] | None = None
    query: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: tuple[int, ...] = (400, 401, 403, 404, 406)


def _one_key_each(actions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A body naming exactly one of ``actions``, each with its own schema."""
    return {"oneOf": [{"type": "object", "properties": {name: schema}, "required": [name],
                       "additionalProperties": False} for name, schema in sorted(actions.items())]}


def _bodies() -> dict[str, dict[str, Any]]:
    """The request bodies at the newest microversion, from the schemas the routes check."""
    actions = {name: action.schema for name, action in servers.ACTIONS.items()}
    actions["migrate"] = schemas.MIGRATE_ACTION_V256  # what 2.56 and later check
    resources = [r for r in quotas.RESOURCES if r not in quotas.INJECTED_FILE_RESOURCES]
    drain_create: Schema = copy.deepcopy(drain_store.BODY_SCHEMA)
    return {
        "server_create": schemas.server_create(MAX_VERSION),
        "server_update": schemas.server_update(MAX_VERSION),
        "server_action": _one_key_each(actions),
        "flavor_create": schemas.flavor_create(MAX_VERSION),
        "flavor_update": schemas.FLAVOR_UPDATE,
        "extra_specs_create": schemas.EXTRA_SPECS_CREATE,
        "flavor_action": schemas.FLAVOR_ACTION,
        "extra_spec_update": schemas.EXTRA_SPEC_UPDATE,
        "quota_set_update": schemas.quota_set_update(resources),
        "attach": volume_attachments.attach_schema(MAX_VERSION),
        "force_complete": schemas.FORCE_COMPLETE_ACTION,
        "aggregate_create": aggregates.CREATE,
        "aggregate_update": aggregates.UPDATE,
        "aggregate_action": _one_key_each(aggregates.ACTIONS),
        "server_group_create": server_groups.create_schema(MAX_VERSION),
        "service_update": {"anyOf": [services.UPDATE, services.LEGACY_UPDATE, services.LEGACY_FORCE_DOWN]},
        "drain_create": drain_create,
        "drain_action": drains.ACTION,
    }


_LIMIT: Schema = {"type": "integer", "minimum": 0}
_SERVER_QUERY: dict[str, Schema] = {
    "name": _STRING, "status": {"type": "array", "items": _STRING}, "limit": _LIMIT, "marker": _STRING,
    "all_tenants": _STRING, "project_id": _STRING, "tenant_id": _STRING, "host": _STRING,
    **{name: _STRING for name in ("node", "uuid", "user_id", "flavor", "image", "availability_zone", "key_name",
                                  "locked", "changes-since", "changes-before", "ip", "ip6", "tags", "tags-any",
                                  "not-tags", "not-tags-any", "deleted", "soft_deleted", "reservation_id",
                                  "display_name", "hostname", "display_description", "image_ref")},
    **{name: {"type": "array", "items": _STRING} for name in ("vm_state", "task_state", "sort_key", "sort_dir")},
    "power_state": {"type": "array", "items": _INTEGER}}
_FLAVOR_QUERY: dict[str, Schema] = {
    "is_public": _STRING, "minDisk": _INTEGER, "minRam": _INTEGER, "limit": _LIMIT, "marker": _STRING,
    "sort_key": _STRING, "sort_dir": _STRING}
# Every parameter the migration list takes (some from a later microversion only: 400 before).
_MIGRATION_QUERY: dict[str, Schema] = {
    name: {"limit": _LIMIT, "status": {"type": "array", "items": _STRING}}.get(name, _STRING)
    for name in migrations.PARAMETERS}
_VOLUME_QUERY: dict[str, Schema] = {
    "all_tenants": _STRING, "project_id": _STRING, "name": _STRING, "status": _STRING, "bootable": _STRING,
    "metadata": _STRING, "limit": _LIMIT, "marker": _STRING}
_ACTION_QUERY: dict[str, Schema] = {name: _LIMIT if name == "limit" else _STRING
                                    for name in servers.ACTION_LIST_PARAMETERS}
_USER_ID: dict[str, Schema] = {"user_id": _STRING}

_WRITE_ERRORS = (400, 401, 403, 404, 406, 409)
_PUBLIC_ERRORS = (400, 406)


def _operations(bodies: dict[str, dict[str, Any]]) -> dict[tuple[str, str], Operation]:
    v = request.API_PREFIX
    server, flavor, aggregate = f"{v}/servers/{{server_id}}", f"{v}/flavors/{{flavor_id}}", \
        f"{v}/os-aggregates/{{aggregate_id}}"
    quota, attachments = f"{v}/os-quota-sets/{{project_id}}", f"{server}/os-volume_attachments"
    group = f"{v}/os-server-groups/{{group_id}}"
    return {
        ("GET", "/"): Operation("The major versions served: v2.1 (no token)", {200: _VERSIONS}, errors=()),
        ("GET", v): Operation("The versions of the compute API (no token)", {200: _VERSION}, errors=_PUBLIC_ERRORS),
        ("GET", "/identity/v3/projects"): Operation(
            "Projects Ferry knows (admins: all; members: their own), ?name= narrowing (the name is the id)",
            {200: _keyed("projects", _OBJECTS)}, errors=(401,)),
        ("GET", "/identity/v3/projects/{project_id}"): Operation(
            "A project Ferry knows (members: their own only)", {200: _keyed("project", _OBJECT)}, errors=(401, 404)),
        ("GET", "/identity/v3/users"): Operation(
            "Users Ferry knows (admins: all; members: themselves, 403 for another), ?name= narrowing (the name is "
            "the id)", {200: _keyed("users", _OBJECTS)}, query={"name": _STRING, "id": _STRING}, errors=(401, 403)),
        ("GET", "/identity/v3/users/{user_id}"): Operation(
            "A user (members: themselves only, 403 for another)", {200: _keyed("user", _OBJECT)},
            errors=(401, 403, 404)),
        ("GET", "/identity/v3/domains"): Operation(
            "The one domain, default (its id and its name), ?name= or ?id= narrowing",
            {200: _keyed("domains", _OBJECTS)}, query={"name": _STRING, "id": _STRING}, errors=(401,)),
        ("GET", "/identity/v3/domains/{domain_id}"): Operation(
            "The domain default (404 for any other)", {200: _keyed("domain", _OBJECT)}, errors=(401, 404)),
        ("GET", "/identity/v3"): Operation("An identity version document for clients' discovery (no token)",
                                           {200: _VERSION}, errors=()),
        ("GET", PATH): Operation("This document (no token)", {200: _OBJECT}, errors=_PUBLIC_ERRORS),
        # volume look-ups (Block Storage v3.0 shapes)
        ("GET", request.VOLUME_PREFIX): Operation("The Block Storage version served for volume look-ups (no token)",
                                                  {200: _VERSION}, errors=_PUBLIC_ERRORS),
        ("GET", f"{request.VOLUME_PREFIX}/volumes"): Operation(
            "List volumes (a member: her project's; an admin with all_tenants: every project's)",
            {200: _keyed("volumes", _OBJECTS)}, query=_VOLUME_QUERY),
        ("GET", f"{request.VOLUME_PREFIX}/volumes/detail"): Operation(
            "List volumes with details", {200: _keyed("volumes", _OBJECTS)}, query=_VOLUME_QUERY),
        ("GET", f"{request.VOLUME_PREFIX}/volumes/{{volume_id}}"): Operation(
            "Show a volume (404 for another project's)", {200: _keyed("volume", _OBJECT)}),
        # servers
        ("GET", f"{v}/servers"): Operation("List servers", {200: _SERVERS}, query=_SERVER_QUERY),
        ("GET", f"{v}/servers/detail"): Operation("List servers with details", {200: _SERVERS_DETAIL},
                                                  query=_SERVER_QUERY),
        ("POST", f"{v}/servers"): Operation("Create a server", {202: _CREATED_SERVER}, bodies["server_create"],
                                            errors=_WRITE_ERRORS),
        ("GET", server): Operation("Show a server (404 for a name or another project's; from 2.69 UNKNOWN when "
                                   "its cell does not answer)",
                                   {200: _keyed("server", {"anyOf": [_SERVER, _UNKNOWN_SERVER_ONE]})}),
        ("PUT", server): Operation("Rename a server, or change its description (2.19) or hostname (2.90); the "
                                   "server back",
                                   {200: _keyed("server", _SERVER)}, bodies["server_update"], errors=_WRITE_ERRORS),
        ("DELETE", server): Operation("Delete a server", {204: None}, errors=_WRITE_ERRORS),
        ("POST", f"{server}/action"): Operation(
            "Run a server action: os-stop, os-start, resize, migrate, revertResize, os-resetState (admins) (202) "
            "or confirmResize (204)",
            {202: None, 204: None}, bodies["server_action"], errors=_WRITE_ERRORS),
        ("GET", f"{server}/os-instance-actions"): Operation(
            "List a server's instance actions (paged and filtered from 2.58)",
            {200: {"type": "object", "required": ["instanceActions"],
                   "properties": {"instanceActions": {"type": "array", "items": _INSTANCE_ACTION}, "links": _LINKS}}},
            query=_ACTION_QUERY),
        ("GET", f"{server}/os-instance-actions/{{request_id}}"): Operation(
            "Show an instance action with its events", {200: _keyed("instanceAction", _INSTANCE_ACTION)}),
        ("GET", f"{server}/migrations"): Operation(
            "List a server's in-progress live migrations (always none; 2.23+)",
            {200: _keyed("migrations", _OBJECTS)}),
        ("GET", f"{server}/migrations/{{migration_id}}"): Operation(
            "Show an in-progress live migration (always 404; 2.23+)", {200: _keyed("migration", _OBJECT)}),
        ("DELETE", f"{server}/migrations/{{migration_id}}"): Operation(
            "Abort a live migration (admins; always 409: no server migrates live; 2.24+)", {202: None},
            errors=_WRITE_ERRORS),
        ("POST", f"{server}/migrations/{{migration_id}}/action"): Operation(
            "Force a live migration to complete (admins; always 409: no server migrates live; 2.22+)", {202: None},
            bodies["force_complete"], errors=_WRITE_ERRORS),
        ("GET", attachments): Operation("List a server's volume attachments",
                                        {200: _keyed("volumeAttachments", {"type": "array", "items": _ATTACHMENT})},
                                        query={name: _LIMIT for name in volume_attachments.LIST_PARAMETERS}),
        ("POST", attachments): Operation("Attach a volume", {200: _keyed("volumeAttachment", _ATTACHMENT)},
                                         bodies["attach"], errors=_WRITE_ERRORS),
        ("GET", f"{attachments}/{{volume_id}}"): Operation("Show a volume attachment",
                                                           {200: _keyed("volumeAttachment", _ATTACHMENT)}),
        ("DELETE", f"{attachments}/{{volume_id}}"): Operation("Detach a volume", {202: None},
                                                              errors=_WRITE_ERRORS),
        # flavors
        ("GET", f"{v}/flavors"): Operation("List flavors", {200: _keyed("flavors", {
            "type": "array", "items": _FLAVOR_SUMMARY})}, query=_FLAVOR_QUERY),
        ("GET", f"{v}/flavors/detail"): Operation("List flavors with details", {200: _keyed("flavors", {
            "type": "array", "items": _FLAVOR})}, query=_FLAVOR_QUERY),
        ("POST", f"{v}/flavors"): Operation("Create a flavor (admins)", {200: _keyed("flavor", _FLAVOR)},
                                            bodies["flavor_create"], errors=_WRITE_ERRORS),
        ("GET", flavor): Operation("Show a flavor (by id; a name is 404)", {200: _keyed("flavor", _FLAVOR)}),
        ("PUT", flavor): Operation("Change a flavor's description (admins, 2.55+)", {200: _keyed("flavor", _FLAVOR)},
                                   bodies["flavor_update"], errors=_WRITE_ERRORS),
        ("DELETE", flavor): Operation("Delete a flavor (admins)", {202: None}, errors=_WRITE_ERRORS),
        ("GET", f"{flavor}/os-flavor-access"): Operation(
            "List the projects with access to a private flavor (admins; 404 for a public flavor)",
            {200: _keyed("flavor_access", _OBJECTS)}),
        ("POST", f"{flavor}/action"): Operation(
            "Give (addTenantAccess) or take away (removeTenantAccess) a project's access to a private flavor (admins)",
            {200: _keyed("flavor_access", _OBJECTS)}, bodies["flavor_action"], errors=_WRITE_ERRORS),
        ("GET", f"{flavor}/os-extra_specs"): Operation("List a flavor's extra specs", {200: _EXTRA_SPECS}),
        ("POST", f"{flavor}/os-extra_specs"): Operation("Set extra specs (admins)", {200: _EXTRA_SPECS},
                                                        bodies["extra_specs_create"], errors=_WRITE_ERRORS),
        ("GET", f"{flavor}/os-extra_specs/{{key}}"): Operation("Show one extra spec", {200: _OBJECT}),
        ("PUT", f"{flavor}/os-extra_specs/{{key}}"): Operation("Set one extra spec (admins)", {200: _OBJECT},
                                                               bodies["extra_spec_update"], errors=_WRITE_ERRORS),
        ("DELETE", f"{flavor}/os-extra_specs/{{key}}"): Operation("Delete one extra spec (admins)", {200: None},
                                                                  errors=_WRITE_ERRORS),
        # images
        ("GET", f"{v}/images"): Operation("List images (Image service v2 shapes)",
                                          {200: _keyed("images", _OBJECTS)}, query={"name": _STRING, "id": _STRING}),
        ("GET", f"{v}/images/{{image_id}}"): Operation("Show an image (by id; a name is 404)",
                                                       {200: _shape("id", id=_STRING, name=_STRING)}),
        # migrations
        ("GET", f"{v}/os-migrations"): Operation(
            "List migrations (admins)", {200: {**_keyed("migrations", {"type": "array", "items": _MIGRATION}),
                                               "properties": {"migrations": {"type": "array", "items": _MIGRATION},
                                                              "migrations_links": _LINKS}}},
            query=_MIGRATION_QUERY),
        # quotas and limits
        ("GET", quota): Operation("Show a project's quotas", {200: _QUOTA_SET}, query=_USER_ID),
        ("GET", f"{quota}/detail"): Operation("Show a project's quotas with usage", {200: _QUOTA_SET},
                                              query=_USER_ID),
        ("GET", f"{quota}/defaults"): Operation("Show the default quotas", {200: _QUOTA_SET}),
        ("PUT", quota): Operation("Change a project's quotas (admins)", {200: _QUOTA_SET}, bodies["quota_set_update"],
                                  query=_USER_ID, errors=_WRITE_ERRORS),
        ("DELETE", quota): Operation("Reset a project's quotas to the defaults (admins)", {202: None},
                                     errors=_WRITE_ERRORS),
        ("GET", f"{v}/limits"): Operation("Absolute limits and usage", {200: _keyed("limits", _shape(
            "rate", "absolute", rate={"type": "array"}, absolute=_OBJECT))}, query={"tenant_id": _STRING}),
        # host aggregates
        ("GET", f"{v}/os-aggregates"): Operation("List host aggregates (admins)",
                                                 {200: _keyed("aggregates", {"type": "array", "items": _AGGREGATE})}),
        ("POST", f"{v}/os-aggregates"): Operation("Create a host aggregate (admins)",
                                                  {200: _keyed("aggregate", _AGGREGATE)}, bodies["aggregate_create"],
                                                  errors=_WRITE_ERRORS),
        ("GET", aggregate): Operation("Show a host aggregate (admins)", {200: _keyed("aggregate", _AGGREGATE)}),
        ("PUT", aggregate): Operation("Rename a host aggregate or change its zone (admins)",
                                      {200: _keyed("aggregate", _AGGREGATE)}, bodies["aggregate_update"],
                                      errors=_WRITE_ERRORS),
        ("DELETE", aggregate): Operation("Delete an empty host aggregate (admins)", {200: None},
                                         errors=_WRITE_ERRORS),
        ("POST", f"{aggregate}/action"): Operation("add_host, remove_host or set_metadata (admins)",
                                                   {200: _keyed("aggregate", _AGGREGATE)}, bodies["aggregate_action"],
                                                   errors=_WRITE_ERRORS),
        # server groups
        ("GET", f"{v}/os-server-groups"): Operation(
            "List server groups (the caller's project's; an admin's with all_projects: every project's)",
            {200: _keyed("server_groups", {"type": "array", "items": _SERVER_GROUP})},
            query={"all_projects": _STRING, "limit": _LIMIT, "offset": _LIMIT}),
        ("POST", f"{v}/os-server-groups"): Operation(
            "Create a server group (policies below 2.64, policy and rules from it)",
            {200: _keyed("server_group", _SERVER_GROUP)}, bodies["server_group_create"], errors=_WRITE_ERRORS),
        ("GET", group): Operation("Show a server group and its members", {200: _keyed("server_group", _SERVER_GROUP)}),
        ("DELETE", group): Operation("Delete a server group (its servers stay)", {204: None}, errors=_WRITE_ERRORS),
        # compute services
        ("GET", f"{v}/os-services"): Operation("List compute services (admins)",
                                               {200: _keyed("services", {"type": "array", "items": _SERVICE})},
                                               query={"host": _STRING, "binary": _STRING}),
        ("PUT", f"{v}/os-services/{{service_id}}"): Operation(
            "Change a service: by uuid from 2.53; enable, disable, disable-log-reason, force-down below (admins)",
            {200: _keyed("service", _SERVICE)}, bodies["service_update"], errors=_WRITE_ERRORS),
        ("DELETE", f"{v}/os-services/{{service_id}}"): Operation(
            "Forget a compute host (admins; 409 while it matters)", {204: None}, errors=_WRITE_ERRORS),
        # drains
        ("POST", f"{v}/ferry/drains"): Operation("Start a drain (202), or plan one with dry_run (200) (admins)",
                                                 {200: _OBJECT, 202: _keyed("drain", _DRAIN)}, bodies["drain_create"],
                                                 errors=_WRITE_ERRORS),
        ("GET", f"{v}/ferry/drains"): Operation("List drains (admins)",
                                                {200: _keyed("drains", {"type": "array", "items": _DRAIN})},
                                                query={"status": _STRING, "limit": _LIMIT}),
        ("GET", f"{v}/ferry/drains/{{drain_id}}"): Operation("Show a drain (admins)", {200: _keyed("drain", _DRAIN)}),
        ("POST", f"{v}/ferry/drains/{{drain_id}}/action"): Operation(
            "pause, resume or cancel a drain (admins)", {202: _keyed("drain", _DRAIN)}, bodies["drain_action"],
            errors=_WRITE_ERRORS),
    }


_ERROR_TEXT = {400: "Bad request: malformed or invalid input, or a malformed microversion",
               401: "No valid token (answered by the gateway, as keystonemiddleware does: kind `error`)",
               403: "A policy rule or a quota refused", 404: "Not found (or another project's)",
               406: "The microversion is not supported", 409: "The state of the resource does not allow it",
               503: "A database the request needs does not answer for the moment (a cell down): try again later"}


def _components() -> dict[str, Any]:
    fault = {
        "type": "object", "minProperties": 1, "maxProperties": 1,
        "description": "Nova's error body: the kind of fault (badRequest, itemNotFound, ...) holding code and message.",
        "additionalProperties": {"type": "object", "required": ["code", "message"],
                                 "properties": {"code": {"type": "integer"}, "message": {"type": "string"}}},
    }
    minors = range(MIN_VERSION.minor, MAX_VERSION.minor + 1)
    versions = ["latest", *(f"{MIN_VERSION.major}.{minor}" for minor in minors)]
    responses: dict[str, Any] = {str(status): {"description": text, "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/Fault"}}}} for status, text in _ERROR_TEXT.items()}
    return {
        "securitySchemes": {"token": {"type": "apiKey", "in": "header", "name": "X-Auth-Token"}},
        "schemas": {"Fault": fault},
        "responses": responses,
        "parameters": {
            "microversion": {"name": HEADER, "in": "header", "required": False,
                             "description": f"`compute X`, X from {MIN_VERSION} to {MAX_VERSION} or `latest`; "
                                            f"none means {MIN_VERSION}. Answered in the same header.",
                             "schema": {"enum": [f"compute {v}" for v in versions]}},
            "legacy_microversion": {"name": LEGACY_HEADER, "in": "header", "required": False,
                                    "description": f"The older form of {HEADER}: X alone (the newer header wins).",
                                    "schema": {"enum": versions}},
        },
    }


def _path_parameters(path: str) -> list[dict[str, Any]]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
            for name in names]


def _query_parameters(query: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": name, "in": "query", "required": False, "schema": schema,
             **({"style": "form", "explode": True} if schema.get("type") == "array" else {})}
            for name, schema in query.items()]


def _operation_id(method: str, path: str, under_api: bool) -> str:
    """``get_servers_server_id_os_instance_actions``: the method and the path after the version."""
    parts = [part.strip("{}") for part in path.split("/") if part]
    if under_api:
        parts = parts[1:] or ["versions"]
    return "_".join([method.lower(), *parts]).replace("-", "_").replace(".", "_")


def _operation(method: str, path: str, op: Operation) -> dict[str, Any]:
    under_api = path == request.API_PREFIX or path.startswith(request.API_PREFIX + "/")
    parameters = _path_parameters(path) + _query_parameters(op.query)
    if under_api:
        parameters += [{"$ref": "#/components/parameters/microversion"},
                       {"$ref": "#/components/parameters/legacy_microversion"}]
    request_ids = {name: {"schema": _STRING, "required": True} for name in request.REQUEST_ID_HEADERS}
    responses: dict[str, Any] = {}
    for status, schema in sorted(op.success.items()):
        answer: dict[str, Any] = {"description": "Success"}
        if under_api:
            answer["headers"] = request_ids
        if schema is not None:
            answer["content"] = {"application/json": {"schema": schema}}
        responses[str(status)] = answer
    # Every operation may answer 400: a NUL character in the path or a query parameter is refused
    # before any route runs (ferry.api.request.refuse_nul). One that reads the store may answer 503.
    for status in sorted({400, *op.errors, *(() if path in PUBLIC_PATHS else (503,))}):
        responses[str(status)] = {"$ref": f"#/components/responses/{status}"}
    segments = [part for part in path.split("/") if part and not part.startswith("{")]
    operation: dict[str, Any] = {
        "operationId": _operation_id(method, path, under_api),
        "summary": op.summary,
        "tags": [segments[1] if len(segments) > 1 else segments[0] if segments else "versions"],
        "parameters": parameters,
        "responses": responses,
    }
    if path in PUBLIC_PATHS:
        operation["security"] = []
    if op.body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": op.body}}}
    return operation


def routes() -> list[tuple[str, str]]:
    """Every ``(method, path)`` the resolver serves, paths in OpenAPI's ``{name}`` form."""
    from ferry.api import get_resolver

    app = get_resolver()
    return sorted((route.method, route.openapi_path) for route in app._static_routes + app._dynamic_routes)


def document(base_url: str = "") -> dict[str, Any]:
    """The OpenAPI document of every route the API serves; ``base_url`` (``scheme://host``) names the server.

    Raises:
        KeyError: a route has no entry in the operation table (a new route must be described).
    """
    operations = _operations(_bodies())
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes():
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, operations[(method, path)])
    return copy.deepcopy({
        "openapi": OPENAPI_VERSION,
        "info": {"title": "Ferry compute API", "version": str(MAX_VERSION),
                 "description": "The OpenStack compute API (Nova v2.1 with microversions) as Ferry serves it, "
                                "and Ferry's drains. Bodies are those of the newest microversion. Errors are "
                                "`{\"<kind>\": {\"code\": N, \"message\": \"...\"}}`; a missing or invalid token "
                                "is answered by the gateway."},
        "servers": [{"url": base_url or "/"}],
        "security": [{"token": []}],
        "paths": paths,
        "components": _components(),
    })


@router.get(PATH)
def show_document() -> Response:
    return request.json_response(200, document(request.base_url(router)))
