"""How servers, flavors and instance actions look in the compute API, per microversion."""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode

from ferry import errors, policy
from ferry.api.request import ViewContext
from ferry.compute import states
from ferry.compute.api import Server, UnknownServer
from ferry.store.api_models import Flavor
from ferry.store.db import CELL0_NAME

# Every guest's root disk (the host agent's first virtio disk).
ROOT_DEVICE = "/dev/vda"


def isotime(value: dt.datetime | None) -> str | None:
    """``2024-05-01T12:00:00Z`` (what servers and faults show)."""
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if value else None


def isotime_micro(value: dt.datetime | None) -> str | None:
    """``2024-05-01T12:00:00.000000`` (what launched_at and instance actions show)."""
    return value.strftime("%Y-%m-%dT%H:%M:%S.%f") if value else None


def links(view: ViewContext, collection: str, item_id: str) -> list[dict[str, str]]:
    return [{"rel": "self", "href": f"{view.api_url}/{collection}/{item_id}"},
            {"rel": "bookmark", "href": f"{view.base_url}/{collection}/{item_id}"}]


def host_id(project_id: str, host: str | None) -> str:
    """Nova's ``hostId``: an opaque per-project name of the host (empty without a host)."""
    return hashlib.sha224((project_id + host).encode()).hexdigest() if host else ""


# --- servers -----------------------------------------------------------------------------------


def server_summary(view: ViewContext, server: Server) -> dict[str, Any]:
    return {"id": server.uuid, "name": server.name, "links": links(view, "servers", server.uuid)}


def unknown_server(view: ViewContext, server: UnknownServer, *, detail: bool, one: bool = False,
                   groups: list[str] | None = None) -> dict[str, Any]:
    """A server of a cell whose database does not answer (2.69): what the API database knows,
    status ``UNKNOWN`` (Nova's partial record; the detailed list adds its project and creation,
    and a server shown alone (``one``) its user, flavor, image, requested zone (Nova's
    ``UNKNOWN`` for either when not known), power state NOSTATE and, from 2.71, its groups)."""
    body: dict[str, Any] = {"id": server.uuid, "status": "UNKNOWN", "links": links(view, "servers", server.uuid)}
    if detail or one:
        body.update({"tenant_id": server.project_id, "created": isotime(server.created_at)})
    if one:
        body.update({
            "user_id": server.user_id or "UNKNOWN", "flavor": _server_flavor(view, server.flavor or {}),
            "image": {"id": server.image_ref, "links": [
                {"rel": "bookmark", "href": f"{view.base_url}/images/{server.image_ref}"}]} if server.image_ref else "",
            "OS-EXT-AZ:availability_zone": server.availability_zone or "UNKNOWN",
            "OS-EXT-STS:power_state": states.NOSTATE,
        })
        if view.at_least("2.71"):
            body["server_groups"] = list(groups or [])
    return body


def _addresses(server: Server, *, extended: bool = True) -> dict[str, list[dict[str, Any]]]:
    addresses: dict[str, list[dict[str, Any]]] = {}
    for port in server.ports:
        if not port.get("fixed_ip"):
            continue
        address: dict[str, Any] = {"addr": port["fixed_ip"], "version": ipaddress.ip_address(port["fixed_ip"]).version}
        if extended:
            address.update({"OS-EXT-IPS:type": "fixed", "OS-EXT-IPS-MAC:mac_addr": port["mac_address"]})
        addresses.setdefault(port["network_name"], []).append(address)
    return addresses


def _server_flavor(view: ViewContext, flavor: dict[str, Any]) -> dict[str, Any]:
    if not view.at_least("2.47"):
        flavor_id = str(flavor.get("flavorid", ""))
        return {"id": flavor_id, "links": [{"rel": "bookmark", "href": f"{view.base_url}/flavors/{flavor_id}"}]}
    shown: dict[str, Any] = {"vcpus": flavor.get("vcpus"), "ram": flavor.get("memory_mb"),
                             "disk": flavor.get("root_gb"), "ephemeral": flavor.get("ephemeral_gb", 0),
                             "swap": flavor.get("swap", 0), "original_name": flavor.get("name")}
    if policy.check(view.ctx, "os_compute_api:os-flavor-extra-specs:index"):
        shown["extra_specs"] = dict(flavor.get("extra_specs") or {})
    return shown


def _image(view: ViewContext, server: Server) -> dict[str, Any] | str:
    if not server.image_ref:
        return ""
    return {"id": server.image_ref,
            "links": [{"rel": "bookmark", "href": f"{view.base_url}/images/{server.image_ref}"}]}


# What a member reads of a scheduling failure (Nova's words): the scheduler's count of hosts per
# filter describes the cloud, for admins only.
NO_VALID_HOST_MESSAGE = f"{errors.NoValidHost.MESSAGE_START}. There are not enough hosts available."


def _fault(view: ViewContext, server: Server) -> dict[str, Any] | None:
    if server.fault is None or server.status not in ("ERROR", "DELETED"):
        return None
    message = server.fault["message"]
    if not view.ctx.is_admin and message.startswith(errors.NoValidHost.MESSAGE_START):
        message = NO_VALID_HOST_MESSAGE
    fault = {"code": server.fault["code"], "message": message, "created": isotime(server.fault["created"])}
    if view.ctx.is_admin and server.fault.get("details"):
        fault["details"] = server.fault["details"]
    return fault


# The statuses a server view shows ``progress`` in (Nova's).
PROGRESS_STATUSES = frozenset({"ACTIVE", "BUILD", "REBUILD", "RESIZE", "VERIFY_RESIZE", "MIGRATING"})

# How far a resize or cold migration (same cell or across cells) has got, in percent, by the step
# it is in: what ``openstack server resize --wait`` prints while it waits. Ferry measures nothing
# within a step, so the disks' copy shows as one step.
_MOVE_PROGRESS = {
    states.RESIZE_PREP: 0,  # checked, destination chosen and claimed, destination prepared
    states.RESIZE_MIGRATING: 25,  # guest stopped, disks (or the snapshot) on their way
    states.RESIZE_MIGRATED: 50,  # disks at the destination
    states.RESIZE_FINISH: 75,  # guest being defined and started on the destination
}


def _progress(server: Server) -> int:
    """The server's ``progress``: a move's step (:data:`_MOVE_PROGRESS`), 100 once it waits for its
    confirm or revert, else 0."""
    if server.status == "VERIFY_RESIZE":
        return 100
    if server.status == "RESIZE":
        return _MOVE_PROGRESS.get(server.task_state or "", 0)
    return 0


def server_detail(view: ViewContext, server: Server, *, one: bool = False,
                  groups: list[str] | None = None, extended: bool = True) -> dict[str, Any]:
    """The full server view (``GET /servers/{id}``, ``/servers/detail``); ``one`` for a single
    server's (show, update), which alone carries ``server_groups`` (``groups``, the uuids of the
    groups it is in) from 2.71, as Nova's. Without ``extended`` (what ``PUT`` answers below 2.75,
    as Nova) the extensions' fields are left out: ``OS-EXT-*``, ``OS-SRV-USG:*``, the key pair,
    config drive, security groups, attached volumes, ``host_status`` and the addresses' type and
    MAC."""
    body: dict[str, Any] = {
        "id": server.uuid,
        "name": server.name,
        "status": server.status,
        "tenant_id": server.project_id,
        "user_id": server.user_id,
        "created": isotime(server.created_at),
        "updated": isotime(server.updated_at or server.created_at),
        "hostId": host_id(server.project_id, server.host),
        "image": _image(view, server),
        "flavor": _server_flavor(view, server.flavor),
        "addresses": _addresses(server, extended=extended),
        "metadata": dict(server.metadata),
        "links": links(view, "servers", server.uuid),
        "accessIPv4": "",
        "accessIPv6": "",
        "OS-DCF:diskConfig": "MANUAL",
    }
    if extended:
        body.update(_extensions(view, server))
    if server.status in PROGRESS_STATUSES:
        body["progress"] = _progress(server)  # Nova shows the key in these statuses only
    fault = _fault(view, server)
    if fault is not None:
        body["fault"] = fault
    if view.at_least("2.9"):
        body["locked"] = server.locked
    if extended and view.at_least("2.16") and server.host_status is not None:
        body["host_status"] = server.host_status
    if view.at_least("2.19"):
        body["description"] = server.description
    if view.at_least("2.26"):
        body["tags"] = list(server.tags)
    if view.at_least("2.63"):
        body["trusted_image_certificates"] = None
    if one and view.at_least("2.71"):
        body["server_groups"] = list(groups or [])
    if view.at_least("2.73"):
        body["locked_reason"] = None
    if view.at_least("2.96"):
        body["pinned_availability_zone"] = server.pinned_availability_zone
    return body


def _extensions(view: ViewContext, server: Server) -> dict[str, Any]:
    """The extensions' fields of a server's full view (see :func:`server_detail`)."""
    body: dict[str, Any] = {
        "key_name": server.key_name,
        "config_drive": "",
        "OS-EXT-AZ:availability_zone": server.availability_zone or "",
        "OS-EXT-STS:vm_state": server.vm_state,
        "OS-EXT-STS:task_state": server.task_state,
        "OS-EXT-STS:power_state": server.power_state,
        "OS-SRV-USG:launched_at": isotime_micro(server.launched_at),
        "OS-SRV-USG:terminated_at": isotime_micro(server.terminated_at),
        "security_groups": [{"name": "default"}],
        "os-extended-volumes:volumes_attached": [
            {"id": v["id"], **({"delete_on_termination": v["delete_on_termination"]} if view.at_least("2.3") else {})}
            for v in server.volumes],
    }
    if policy.check(view.ctx, "os_compute_api:os-extended-server-attributes", server.target):
        body["OS-EXT-SRV-ATTR:host"] = server.host
        body["OS-EXT-SRV-ATTR:hypervisor_hostname"] = server.node
        body["OS-EXT-SRV-ATTR:instance_name"] = server.instance_name
        if view.at_least("2.3"):
            body.update({
                "OS-EXT-SRV-ATTR:reservation_id": server.reservation_id,
                "OS-EXT-SRV-ATTR:launch_index": server.launch_index,
                "OS-EXT-SRV-ATTR:hostname": server.hostname, "OS-EXT-SRV-ATTR:kernel_id": "",
                "OS-EXT-SRV-ATTR:ramdisk_id": "", "OS-EXT-SRV-ATTR:user_data": server.user_data,
                "OS-EXT-SRV-ATTR:root_device_name": ROOT_DEVICE if server.cell not in (None, CELL0_NAME) else None})
    if view.at_least("2.90"):
        body["OS-EXT-SRV-ATTR:hostname"] = server.hostname  # everyone's from 2.90
    return body


def next_link(view: ViewContext, path: str, params: Mapping[str, list[str]], ids: list[str],
              page_size: int) -> list[dict[str, str]]:
    """``[{"rel": "next", "href"}]`` when the page is full (there may be more): the same query
    with the page's last id as the marker; empty otherwise."""
    return next_link_at(f"{view.api_url}/{path}", params, ids, page_size)


def next_link_at(url: str, params: Mapping[str, list[str]], ids: list[str], page_size: int) -> list[dict[str, str]]:
    """:func:`next_link` for the collection at ``url`` (of any API)."""
    if not ids or len(ids) < page_size:
        return []
    query = [(k, v) for k, values in params.items() if k not in ("limit", "marker") for v in values]
    query += [("limit", str(page_size)), ("marker", ids[-1])]
    return [{"rel": "next", "href": f"{url}?{urlencode(query)}"}]


# --- flavors -----------------------------------------------------------------------------------


def flavor_summary(view: ViewContext, flavor: Flavor) -> dict[str, Any]:
    body: dict[str, Any] = {"id": flavor.flavorid, "name": flavor.name,
                            "links": links(view, "flavors", flavor.flavorid)}
    if view.at_least("2.55"):
        body["description"] = flavor.description
    return body


def flavor_detail(view: ViewContext, flavor: Flavor) -> dict[str, Any]:
    body = flavor_summary(view, flavor)
    body.update({
        "ram": flavor.memory_mb,
        "vcpus": flavor.vcpus,
        "disk": flavor.root_gb,
        "OS-FLV-EXT-DATA:ephemeral": flavor.ephemeral_gb,
        "swap": flavor.swap if flavor.swap or view.at_least("2.75") else "",
        "rxtx_factor": flavor.rxtx_factor,
        "os-flavor-access:is_public": flavor.is_public,
        "OS-FLV-DISABLED:disabled": flavor.disabled,
    })
    if view.at_least("2.61") and policy.check(view.ctx, "os_compute_api:os-flavor-extra-specs:index"):
        body["extra_specs"] = dict(flavor.specs)
    return body


# --- instance actions --------------------------------------------------------------------------


def instance_action(view: ViewContext, action: dict[str, Any]) -> dict[str, Any]:
    body = {
        "action": action["action"],
        "instance_uuid": action["instance_uuid"],
        "request_id": action["request_id"],
        "user_id": action["user_id"],
        "project_id": action["project_id"],
        "start_time": isotime_micro(action["start_time"]),
        "message": action["message"],
    }
    if view.at_least("2.58"):
        body["updated_at"] = isotime_micro(action["updated_at"] or action["finish_time"] or action["start_time"])
    return body


def instance_action_events(view: ViewContext, events: Iterable[dict[str, Any]], project_id: str) -> list[dict]:
    """Events of an action; tracebacks and details only for callers the policy allows."""
    show_traceback = policy.check(view.ctx, "os_compute_api:os-instance-actions:events", {"project_id": project_id})
    show_details = policy.check(view.ctx, "os_compute_api:os-instance-actions:events:details",
                                {"project_id": project_id})
    shown = []
    for event in events:
        body: dict[str, Any] = {"event": event["event"], "start_time": isotime_micro(event["start_time"]),
                                "finish_time": isotime_micro(event["finish_time"]), "result": event["result"]}
        if show_traceback:
            body["traceback"] = event["traceback"]
        if view.at_least("2.62"):
            body["hostId"] = host_id(project_id, event["host"])
            if show_traceback:
                body["host"] = event["host"] or ""
        if view.at_least("2.84") and show_details:
            body["details"] = event["details"]
        shown.append(body)
    return shown


# --- migrations ----------------------------------------------------------------------------------


def migration(view: ViewContext, record: dict[str, Any]) -> dict[str, Any]:
    """One entry of ``GET /os-migrations`` at the request's microversion."""
    body: dict[str, Any] = {
        "id": record["id"],
        "instance_uuid": record["instance_uuid"],
        "source_compute": record["source_compute"],
        "source_node": record["source_node"],
        "dest_compute": record["dest_compute"],
        "dest_node": record["dest_node"],
        "dest_host": record["dest_host"],
        "old_instance_type_id": record["old_instance_type_id"],
        "new_instance_type_id": record["new_instance_type_id"],
        "status": record["status"],
        "created_at": isotime_micro(record["created_at"]),
        "updated_at": isotime_micro(record["updated_at"]),
    }
    if view.at_least("2.23"):
        body["migration_type"] = record["migration_type"]
    if view.at_least("2.59"):
        body["uuid"] = record["uuid"]
    if view.at_least("2.80"):
        body["user_id"] = record["user_id"]
        body["project_id"] = record["project_id"]
    return body


# --- quotas and limits ---------------------------------------------------------------------------

# Network quotas Nova showed below 2.36 (it proxied them; Ferry shows Nova's defaults).
NETWORK_QUOTAS = {"fixed_ips": -1, "floating_ips": 10, "security_group_rules": 20, "security_groups": 10}


def quota_resources(view: ViewContext, resources: Iterable[str], injected: Iterable[str]) -> list[str]:
    """The quota resources a microversion shows (injected files go away at 2.57)."""
    hidden = set(injected) if view.at_least("2.57") else set()
    return [r for r in resources if r not in hidden]


def quota_set(view: ViewContext, values: dict[str, int], resources: Iterable[str],
              project_id: str | None = None) -> dict[str, Any]:
    """``{"quota_set": …}`` with the limits (and ``id`` when ``project_id`` is given)."""
    body: dict[str, Any] = {"id": project_id} if project_id is not None else {}
    body.update({r: values[r] for r in resources})
    if not view.at_least("2.36"):
        body.update(NETWORK_QUOTAS)
    return body


def quota_set_detail(view: ViewContext, values: dict[str, int], used: dict[str, int], resources: Iterable[str],
                     project_id: str) -> dict[str, Any]:
    """``/os-quota-sets/{id}/detail``: each resource as ``{limit, in_use, reserved}``."""
    body: dict[str, Any] = {"id": project_id}
    body.update({r: {"limit": values[r], "in_use": used.get(r, 0), "reserved": 0} for r in resources})
    if not view.at_least("2.36"):
        body.update({r: {"limit": v, "in_use": 0, "reserved": 0} for r, v in NETWORK_QUOTAS.items()})
    return body


def absolute_limits(view: ViewContext, values: dict[str, int], used: dict[str, int]) -> dict[str, int]:
    """``GET /limits``' ``absolute`` part (Nova's names; removed entries follow the microversion)."""
    body = {
        "maxServerMeta": values["metadata_items"],
        "maxTotalKeypairs": values["key_pairs"],
        "maxServerGroups": values["server_groups"],
        "maxServerGroupMembers": values["server_group_members"],
        "maxTotalCores": values["cores"],
        "maxTotalInstances": values["instances"],
        "maxTotalRAMSize": values["ram"],
        "totalCoresUsed": used["cores"],
        "totalInstancesUsed": used["instances"],
        "totalRAMUsed": used["ram"],
        "totalServerGroupsUsed": used.get("server_groups", 0),
    }
    if not view.at_least("2.57"):
        body["maxPersonality"] = values["injected_files"]
        body["maxPersonalitySize"] = values["injected_file_content_bytes"]
    if not view.at_least("2.39"):
        body["maxImageMeta"] = values["metadata_items"]
    if not view.at_least("2.36"):
        body.update({"maxSecurityGroups": NETWORK_QUOTAS["security_groups"],
                     "maxSecurityGroupRules": NETWORK_QUOTAS["security_group_rules"],
                     "maxTotalFloatingIps": NETWORK_QUOTAS["floating_ips"],
                     "totalFloatingIpsUsed": 0, "totalSecurityGroupsUsed": 0})
    return body
