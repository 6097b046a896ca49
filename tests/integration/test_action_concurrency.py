"""Racing server actions and racing resizes on PostgreSQL.

Fifty conflicting actions on one server are released together: the compare-and-swap on the
server's task_state (or its migration's status) admits exactly one, and every other request
gets Nova's 409 ``conflictingRequest``. Thirty resizes claiming destinations in a nearly full
cell at once never over-commit a host, and a resize that finds no host holds nothing.

The requests go through the compute API's server-action dispatch (``ferry.api.servers.ACTIONS``,
policy, locate, the action's handler, and the API's error document), one thread and one database
connection per request. They do not go through the Powertools resolver: it keeps the current
event and context in attributes every thread shares, so concurrent invocations in one process
would read each other's request. On Lambda each concurrent request has a process of its own,
which is what one thread per request with a resolver-free dispatch stands for here.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from placement_helpers import (
    PROJECT,
    USER,
    add_compute,
    assert_used_counters_match_allocations,
    flavor,
    request_spec,
    resources,
)
from sqlalchemy import create_engine, func, select
from test_api_moves import actions_of, active_server, migrations_of, resized_server, start_move_cloud
from test_api_servers import instance
from test_api_support import ADMIN, ALICE, Caller, mocked_cloud

from ferry import errors, placement, scheduler
from ferry.api import fault_response, servers
from ferry.api.microversions import APIVersion
from ferry.auth import RequestContext
from ferry.compute import api as compute_api
from ferry.compute import migration_states, states
from ferry.placement import DISK_GB, MEMORY_MB, VCPU
from ferry.store import db
from ferry.store.api_models import Allocation, Consumer, InstanceMapping, Inventory, Network, Port, ResourceProvider

pytestmark = pytest.mark.postgres

RACERS = 50
BOOT_RACERS = 8  # within the project's instance quota
VERSION = APIVersion(2, 90)


@pytest.fixture
def cloud(pg_store, monkeypatch, tmp_path) -> Iterator[Any]:
    _widen_pools(pg_store)
    for mocked in mocked_cloud(monkeypatch, tmp_path):
        yield start_move_cloud(mocked, monkeypatch)


def _widen_pools(store: Any) -> None:
    """Let every racer hold a connection of its own to each database at once (the default pool
    would make the last ones wait for a free connection instead of racing)."""
    for url in (store.api_url, *store.cells.values()):
        with db._lock:
            old = db._engines.pop(url, None)
            if old is not None:
                old.dispose()
            db._engines[url] = create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=RACERS + 5)


def _dispatch(caller: Caller, server_id: str, body: dict[str, Any]) -> tuple[int, Any]:
    """``POST /servers/{id}/action`` below the resolver: (status, error document or None)."""
    ctx = RequestContext(caller.user_id, caller.project_id, caller.roles)
    name, value = next(iter(body.items()))
    try:
        location = compute_api.locate(ctx, server_id)
        response = servers.ACTIONS[name].handler(ctx, location, value, VERSION)
    except Exception as exc:  # noqa: BLE001 - the API turns every error into its document
        refused = fault_response(exc, {"request_id": ctx.request_id})
        return refused.status_code, refused.body
    return response.status_code, None


def _race(requests: list[tuple[Caller, dict[str, Any]]], server_id: str) -> list[tuple[dict[str, Any], int, Any]]:
    """Send every request at once (a barrier releases them together); (body, status, document) each."""
    barrier = threading.Barrier(len(requests))

    def send(request: tuple[Caller, dict[str, Any]]) -> tuple[dict[str, Any], int, Any]:
        caller, body = request
        barrier.wait(timeout=60)
        status, document = _dispatch(caller, server_id, body)
        return body, status, document

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(send, requests))


def _placement_rows() -> tuple[list[Any], int]:
    with db.api_session() as session:
        allocations = sorted(session.execute(select(Allocation.consumer_uuid, Allocation.resource_class,
                                                    Allocation.used)).all())
        consumers = session.scalar(select(func.count()).select_from(Consumer)) or 0
    return allocations, consumers


def _hold_on_host1(server_id: str) -> None:
    """Give the server its allocation on host1, as the boot workflow would have."""
    rp = add_compute("host1", vcpus=8, service=False)
    placement.claim(server_id, ALICE.project_id, ALICE.user_id, {rp: resources(vcpus=1, memory_mb=512, disk_gb=1)})


def _the_one_accepted(outcomes: list[tuple[dict[str, Any], int, Any]]) -> tuple[dict[str, Any], int]:
    accepted = [(body, status) for body, status, _ in outcomes if status < 300]
    assert len(accepted) == 1, accepted
    return accepted[0]


def _assert_conflicts(outcomes: list[tuple[dict[str, Any], int, Any]], server_id: str) -> None:
    """All but one answered 409 with Nova's conflictingRequest document about this server."""
    refused = [(body, status, document) for body, status, document in outcomes if status == 409]
    assert len(refused) == len(outcomes) - 1, Counter(status for _, status, _ in outcomes)
    for body, _, document in refused:
        assert set(document) == {"conflictingRequest"}, (body, document)
        assert document["conflictingRequest"]["code"] == 409
        assert server_id in document["conflictingRequest"]["message"]


# --- 1. conflicting actions on one server ---------------------------------------------------------


def test_fifty_conflicting_actions_on_an_active_server_admit_exactly_one(cloud):
    # GIVEN an ACTIVE server holding its allocation on host1
    server_id = active_server()
    _hold_on_host1(server_id)
    placement_before = _placement_rows()
    kinds: list[tuple[Caller, dict[str, Any]]] = [
        (ALICE, {"resize": {"flavorRef": "2"}}),
        (ALICE, {"resize": {"flavorRef": "3"}}),
        (ADMIN, {"migrate": None}),
        (ADMIN, {"migrate": {"host": "host2"}}),
        (ALICE, {"os-stop": None}),
    ]

    # WHEN fifty resize / migrate / stop requests arrive at once
    outcomes = _race([kinds[n % len(kinds)] for n in range(RACERS)], server_id)

    # THEN exactly one is accepted, the other 49 are 409 conflictingRequest
    won, status = _the_one_accepted(outcomes)
    assert status == 202
    _assert_conflicts(outcomes, server_id)
    # AND the server carries the winner's task state and records, once
    name = next(iter(won))
    [recorded] = actions_of(server_id)
    row = instance(server_id)
    if name == "os-stop":
        assert row.task_state == states.POWERING_OFF and recorded.action == "stop"
        assert migrations_of(server_id) == [] and len(cloud.executions("power")) == 1
        assert cloud.executions("resize") == []
    else:
        assert row.task_state == states.RESIZE_PREP and recorded.action == name
        [migration] = migrations_of(server_id)
        assert migration.status == migration_states.PRE_MIGRATING
        assert migration.migration_type == (migration_states.RESIZE if name == "resize" else migration_states.MIGRATION)
        [execution] = cloud.executions("resize")
        assert execution["input"]["migration_uuid"] == migration.uuid
        assert execution["input"]["request_id"] == recorded.request_id
        assert cloud.executions("power") == []
    # AND accepting a move claims nothing: placement is as it was
    assert _placement_rows() == placement_before


def test_fifty_conflicting_settles_of_a_resized_server_admit_exactly_one(cloud):
    # GIVEN a server in VERIFY_RESIZE with its finished migration
    server_id, migration_uuid = resized_server()
    kinds: list[tuple[Caller, dict[str, Any]]] = [
        (ALICE, {"confirmResize": None}),
        (ALICE, {"revertResize": None}),
        (ALICE, {"resize": {"flavorRef": "3"}}),
        (ADMIN, {"migrate": None}),
        (ALICE, {"os-stop": None}),
    ]

    # WHEN fifty confirm / revert / resize / migrate / stop requests arrive at once
    outcomes = _race([kinds[n % len(kinds)] for n in range(RACERS)], server_id)

    # THEN exactly one confirm (204) or revert (202) is accepted, every other request is 409
    won, status = _the_one_accepted(outcomes)
    _assert_conflicts(outcomes, server_id)
    [migration] = migrations_of(server_id)
    [recorded] = actions_of(server_id)
    row = instance(server_id)
    assert migration.uuid == migration_uuid and row.vm_state == states.RESIZED
    if "confirmResize" in won:
        assert status == 204 and recorded.action == "confirmResize"
        assert (migration.status, row.task_state) == (migration_states.CONFIRMING, None)
        assert len(cloud.executions("confirm_resize")) == 1 and cloud.executions("revert_resize") == []
    else:
        assert status == 202 and recorded.action == "revertResize"
        assert (migration.status, row.task_state) == (migration_states.REVERTING, states.RESIZE_REVERTING)
        assert len(cloud.executions("revert_resize")) == 1 and cloud.executions("confirm_resize") == []
    assert cloud.executions("resize") == [] and cloud.executions("power") == []


# --- 2. concurrent resizes into a nearly full cell ------------------------------------------------


SOURCES, PER_SOURCE = 3, 10
DESTINATIONS, RATIO = 6, 2.0
OLD = {VCPU: 1, MEMORY_MB: 512, DISK_GB: 5}
NEW_FLAVOR = flavor(vcpus=2, memory_mb=1024, root_gb=10)


def _nearly_full_cell() -> tuple[list[tuple[str, str]], list[str]]:
    """Three full source hosts with ten servers each, and six destinations (8 vCPU at ratio 2.0,
    so 16) already holding 11 vCPU: each has room for two 2-vCPU resizes, twelve in all."""
    servers_on: list[tuple[str, str]] = []
    for n in range(SOURCES):
        host = f"src-{n}"
        rp = add_compute(host, vcpus=PER_SOURCE, memory_mb=8192, disk_gb=100)
        for _ in range(PER_SOURCE):
            server = str(uuid.uuid4())
            placement.claim(server, PROJECT, USER, {rp: OLD})
            servers_on.append((server, host))
    destinations = []
    for n in range(DESTINATIONS):
        rp = add_compute(f"dst-{n}", vcpus=8, memory_mb=8192, disk_gb=100, ratio=RATIO)
        # Two servers, as one may not hold more vCPUs than the host's 8 cores.
        placement.claim(str(uuid.uuid4()), PROJECT, USER, {rp: {VCPU: 8, MEMORY_MB: 512, DISK_GB: 5}})
        placement.claim(str(uuid.uuid4()), PROJECT, USER, {rp: {VCPU: 3, MEMORY_MB: 512, DISK_GB: 5}})
        destinations.append(rp)
    return servers_on, destinations


def _assert_within_capacity() -> None:
    with db.api_session() as session:
        rows = session.execute(select(ResourceProvider.name, Inventory.resource_class, Inventory.total,
                                      Inventory.reserved, Inventory.allocation_ratio, Inventory.used)
                               .join(Inventory, Inventory.resource_provider_id == ResourceProvider.id)).all()
    for name, rc, total, reserved, ratio, used in rows:
        assert used <= placement.capacity(total, reserved, ratio), (name, rc, used)


def test_thirty_concurrent_resizes_into_a_nearly_full_cell_never_over_commit(pg_store):
    # GIVEN thirty servers on full hosts and room for twelve resizes elsewhere in the cell
    servers_on, destinations = _nearly_full_cell()
    migrations = {server: str(uuid.uuid4()) for server, _ in servers_on}
    barrier = threading.Barrier(len(servers_on))

    def resize(server_host: tuple[str, str]) -> str:
        server, host = server_host
        spec = request_spec(server, flavor=NEW_FLAVOR, ignore_hosts=[host])
        barrier.wait(timeout=60)
        try:
            [chosen, *_] = scheduler.select_destinations(spec, migration_uuid=migrations[server])
        except errors.NoValidHost:
            return "no valid host"
        return chosen.provider_uuid

    # WHEN all thirty claim a destination at once
    with ThreadPoolExecutor(max_workers=len(servers_on)) as pool:
        outcomes = dict(zip([s for s, _ in servers_on], pool.map(resize, servers_on), strict=True))

    # THEN exactly the twelve slots are taken, two on each destination, and no host is over-committed
    claimed = {server: rp for server, rp in outcomes.items() if rp != "no valid host"}
    assert len(claimed) == DESTINATIONS * 2
    assert Counter(claimed.values()) == {rp: 2 for rp in destinations}
    _assert_within_capacity()
    assert_used_counters_match_allocations()
    new = resources(vcpus=2, memory_mb=1024, disk_gb=10)
    for server, source in servers_on:
        source_rp = placement.provider_by_host(source)
        if server in claimed:
            # AND every successful claim is held: the destination by the server, the source by its migration
            assert placement.get_allocations(server) == {claimed[server]: new}
            assert placement.get_allocations(migrations[server]) == {source_rp: OLD}
        else:
            # AND a resize that found no host holds nothing new
            assert placement.get_allocations(server) == {source_rp: OLD}
            assert placement.get_allocations(migrations[server]) == {}
    for n in range(SOURCES):
        assert placement.usages(placement.provider_by_host(f"src-{n}"))[VCPU] == PER_SOURCE



# --- 4. boots claiming one port ------------------------------------------------------------------


def test_boots_racing_for_one_port_give_it_to_exactly_one(cloud):
    # GIVEN a port of Alice's with no server
    port_id = "22222222-2222-4222-8222-222222222222"
    with db.api_session() as session:
        network = Network(name="private", cidr="192.168.7.0/24", project_id=ALICE.project_id, shared=False)
        session.add(network)
        session.flush()
        session.add(Port(id=port_id, network_id=network.id, project_id=ALICE.project_id,
                         mac_address="fa:16:3e:aa:bb:cc", fixed_ip="192.168.7.50"))
    barrier = threading.Barrier(BOOT_RACERS)

    def boot(n: int) -> str:
        ctx = RequestContext(ALICE.user_id, ALICE.project_id, ALICE.roles)
        request = compute_api.BootRequest(name=f"vm{n}", flavor_ref="1", image_ref=cloud.image_id,
                                          networks=[{"port": port_id}])
        barrier.wait(timeout=60)
        try:
            return compute_api.create_server(ctx, request)
        except errors.Conflict as exc:
            return exc.message

    # WHEN several boots ask for it at once
    with ThreadPoolExecutor(max_workers=BOOT_RACERS) as pool:
        outcomes = list(pool.map(boot, range(BOOT_RACERS)))

    # THEN one server gets it, every other boot is refused with 409 and left nothing behind
    refused = [o for o in outcomes if o == f"Port {port_id} is still in use."]
    [winner] = [o for o in outcomes if o not in refused]
    assert len(refused) == BOOT_RACERS - 1, outcomes
    with db.api_session() as session:
        assert session.get(Port, port_id).device_id == winner
        assert session.scalar(select(func.count()).select_from(InstanceMapping)) == 1
