"""The compute services API through the real handler (SQLite and PostgreSQL)."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from placement_helpers import PROJECT, USER, add_aggregate, add_compute, add_instance, request_spec
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from test_api_support import ADMIN, ALICE, LambdaContext, call, cell_away, function, mocked_cloud

from ferry import errors, hosts, placement, protocol, scheduler
from ferry.compute import services as compute_services
from ferry.store.api_models import AggregateHost, HostMapping, ResourceProvider, utcnow
from ferry.store.cell_models import Migration, Service
from ferry.store.db import api_session, cell_session

SERVICES = "/v2.1/os-services"


@pytest.fixture
def cloud(store, monkeypatch, tmp_path):
    yield from mocked_cloud(monkeypatch, tmp_path)


@pytest.fixture
def computes(cloud):
    """compute-1 (up) and compute-2 (silent for ten minutes) in cell1, compute-3 (forced down) in cell2."""
    add_compute("compute-1", "cell1")
    add_compute("compute-2", "cell1", last_seen_at=utcnow() - dt.timedelta(minutes=10))
    add_compute("compute-3", "cell2", forced_down=True)
    return ["compute-1", "compute-2", "compute-3"]


def admin(method: str, path: str, **options):
    options.setdefault("version", "2.69")
    return call(method, path, caller=ADMIN, **options)


def row(host: str) -> Service:
    for cell in ("cell1", "cell2"):
        with cell_session(cell) as session:
            found = session.scalars(select(Service).where(Service.host == host)).one_or_none()
            if found is not None:
                return found
    raise AssertionError(f"no service for {host}")


def states() -> dict[str, tuple[bool, str | None, bool]]:
    """Every service's (disabled, disabled_reason, forced_down) as stored."""
    found = {}
    for cell in ("cell1", "cell2"):
        with cell_session(cell) as session:
            found.update({s.host: (s.disabled, s.disabled_reason, s.forced_down)
                          for s in session.scalars(select(Service))})
    return found


def listed(**options) -> dict[str, dict]:
    response = admin("GET", SERVICES, **options)
    assert response.status == 200, response.body
    return {s["host"]: s for s in response.body["services"]}


def error(response, kind: str) -> str:
    return response.body[kind]["message"]


# --- list -----------------------------------------------------------------------------------------


def test_list_shows_every_cells_services_with_state_from_the_heartbeat(computes):
    services = listed()

    assert sorted(services) == computes
    first = services["compute-1"]
    assert set(first) == {"id", "binary", "host", "zone", "status", "state", "updated_at", "disabled_reason",
                          "forced_down"}
    assert first["id"] == row("compute-1").uuid
    assert (first["binary"], first["zone"], first["status"], first["state"], first["disabled_reason"],
            first["forced_down"]) == ("nova-compute", "nova", "enabled", "up", None, False)
    assert first["updated_at"].startswith(utcnow().strftime("%Y-%m-%dT"))
    assert services["compute-2"]["state"] == "down"
    assert (services["compute-3"]["state"], services["compute-3"]["forced_down"]) == ("down", True)


def test_ids_are_integers_before_2_53_and_forced_down_shows_from_2_11(computes):
    old = listed(version="2.10")["compute-1"]
    legacy = listed(version="2.52")["compute-1"]

    assert old["id"] == row("compute-1").id and "forced_down" not in old
    assert legacy["id"] == row("compute-1").id and legacy["forced_down"] is False


def test_the_zone_comes_from_the_hosts_aggregates(computes):
    add_aggregate("rack-a", ["compute-2"], {"availability_zone": "zone-a"})
    add_aggregate("ssd", ["compute-1"], {"ssd": "true"})

    services = listed()

    assert {h: s["zone"] for h, s in services.items()} == {"compute-1": "nova", "compute-2": "zone-a",
                                                           "compute-3": "nova"}


def test_host_and_binary_filters(computes):
    assert list(listed(query={"host": "compute-3"})) == ["compute-3"]
    assert sorted(listed(query={"binary": "nova-compute"})) == computes
    assert list(listed(query={"host": "compute-1", "binary": "nova-compute"})) == ["compute-1"]
    assert listed(query={"binary": "nova-scheduler"}) == {}
    assert listed(query={"host": "nowhere"}) == {}


def test_a_cell_that_does_not_answer_is_left_out_and_from_2_69_its_hosts_are_unknown(computes, monkeypatch):
    # GIVEN cell2's database stops answering
    cell_away(monkeypatch, compute_services, "cell2")

    # WHEN the services are listed, THEN cell1's are shown; cell2's host is left out before 2.69
    # and listed UNKNOWN from it (its host and binary only, as Nova's partial record)
    assert sorted(listed(version="2.68")) == ["compute-1", "compute-2"]
    services = listed(version="2.69")
    assert sorted(services) == computes
    assert services["compute-3"] == {"binary": "nova-compute", "host": "compute-3", "status": "UNKNOWN"}
    assert services["compute-1"]["status"] == "enabled"
    # AND the filters hold for it
    assert list(listed(query={"host": "compute-3"})) == ["compute-3"]
    assert listed(query={"host": "compute-1"}).keys() == {"compute-1"}
    assert listed(query={"binary": "nova-scheduler"}) == {}

    # AND a database error that is not of the moment still fails the list
    cell_away(monkeypatch, compute_services, "cell2", broken=True)
    assert admin("GET", SERVICES).status == 500


def test_an_unknown_list_parameter_is_refused_from_2_75_before_the_policy_and_ignored_before(computes):
    refused = admin("GET", SERVICES, version="2.75", query={"host": "compute-1", "zone": "nova"})
    by_member = call("GET", SERVICES, caller=ALICE, version="2.75", query={"zone": "nova"})

    for response in (refused, by_member):
        assert response.status == 400
        assert error(response, "badRequest") == (
            "Invalid input for query parameters zone. Additional properties are not allowed ('zone' was unexpected)")
    assert list(listed(version="2.74", query={"host": "compute-1", "zone": "nova"})) == ["compute-1"]
    assert list(listed(version="2.75", query={"host": "compute-1", "binary": "nova-compute"})) == ["compute-1"]


def test_members_are_refused_every_services_request(computes):
    service_uuid = row("compute-1").uuid
    for method, path, body, rule in (
            ("GET", SERVICES, None, "list"),
            ("PUT", f"{SERVICES}/{service_uuid}", {"status": "disabled"}, "update"),
            ("DELETE", f"{SERVICES}/{service_uuid}", None, "delete")):
        response = call(method, path, caller=ALICE, body=body, version="2.53")
        assert response.status == 403, rule
        assert error(response, "forbidden") == \
            f"Policy doesn't allow os_compute_api:os-services:{rule} to be performed."
    legacy = call("PUT", f"{SERVICES}/disable", caller=ALICE, body={"host": "compute-1", "binary": "nova-compute"})
    assert legacy.status == 403
    assert states()["compute-1"] == (False, None, False)


# --- update (2.53+) -------------------------------------------------------------------------------


def test_disable_with_a_reason_and_enable_again_by_uuid(computes):
    service_uuid = row("compute-1").uuid

    disabled = admin("PUT", f"{SERVICES}/{service_uuid}", body={"status": "disabled", "disabled_reason": "disk"})
    assert disabled.status == 200
    shown = disabled.body["service"]
    assert (shown["id"], shown["host"], shown["status"], shown["disabled_reason"], shown["state"]) == \
        (service_uuid, "compute-1", "disabled", "disk", "up")
    assert states()["compute-1"] == (True, "disk", False)
    assert listed()["compute-1"]["status"] == "disabled"

    enabled = admin("PUT", f"{SERVICES}/{service_uuid}", body={"status": "enabled"})
    assert enabled.status == 200 and enabled.body["service"]["disabled_reason"] is None
    assert states()["compute-1"] == (False, None, False)


def test_force_down_and_up_by_uuid(computes):
    service_uuid = row("compute-1").uuid

    down = admin("PUT", f"{SERVICES}/{service_uuid}", body={"forced_down": True})
    assert (down.body["service"]["forced_down"], down.body["service"]["state"]) == (True, "down")
    assert states()["compute-1"] == (False, None, True)

    up = admin("PUT", f"{SERVICES}/{service_uuid}", body={"forced_down": False, "status": "disabled"})
    assert (up.body["service"]["state"], up.body["service"]["status"]) == ("up", "disabled")
    assert states()["compute-1"] == (True, None, False)


@pytest.mark.parametrize(("body", "message"), [
    ({}, "No updates were requested. Fields 'status' or 'forced_down' should be specified."),
    ({"disabled_reason": "disk"}, "No updates were requested. Fields 'status' or 'forced_down' should be specified."),
    ({"status": "enabled", "disabled_reason": "disk"},
     "Specifying 'disabled_reason' with status 'enabled' is invalid."),
    ({"status": "off"}, None),
    ({"status": "disabled", "disabled_reason": ""}, None),
    ({"status": "disabled", "disabled_reason": "x" * 256}, None),
    ({"forced_down": "maybe"}, None),
    ({"forced_down": 1}, None),
    ({"status": "disabled", "host": "compute-1"}, None),
    (None, None),
])
def test_a_bad_update_is_400_and_changes_nothing(computes, body, message):
    response = admin("PUT", f"{SERVICES}/{row('compute-1').uuid}", body=body)

    assert response.status == 400
    if message:
        assert error(response, "badRequest") == message
    assert states()["compute-1"] == (False, None, False)


def test_a_reason_without_a_status_is_ignored_as_nova_ignores_it(computes):
    """GIVEN an enabled service, WHEN forced down with a reason but no status, THEN the reason is not kept."""
    response = admin("PUT", f"{SERVICES}/{row('compute-1').uuid}", body={"disabled_reason": "disk",
                                                                         "forced_down": True})

    assert response.status == 200
    assert (response.body["service"]["status"], response.body["service"]["disabled_reason"]) == ("enabled", None)
    assert states()["compute-1"] == (False, None, True)


@pytest.mark.parametrize(("host", "value", "forced_down"), [
    ("compute-1", "true", True), ("compute-1", "True", True), ("compute-1", "1", True), ("compute-3", "false", False)])
def test_forced_down_takes_novas_boolean_strings(computes, host, value, forced_down):
    by_uuid = admin("PUT", f"{SERVICES}/{row(host).uuid}", body={"forced_down": value})
    legacy = admin("PUT", f"{SERVICES}/force-down", version="2.11",
                   body={"host": host, "binary": "nova-compute", "forced_down": value})

    assert by_uuid.status == 200 and by_uuid.body["service"]["forced_down"] is forced_down
    assert legacy.status == 200 and legacy.body["service"]["forced_down"] is forced_down
    assert states()[host][2] is forced_down


def test_update_of_an_unknown_or_malformed_service_id(computes):
    unknown = admin("PUT", f"{SERVICES}/{uuid.uuid4()}", body={"status": "disabled"})
    malformed = admin("PUT", f"{SERVICES}/disable", body={"host": "compute-1", "binary": "nova-compute"})

    assert unknown.status == 404 and error(unknown, "itemNotFound").endswith("could not be found.")
    assert malformed.status == 400 and error(malformed, "badRequest") == "Invalid uuid disable"
    assert all(state == (False, None, False) for host, state in states().items() if host != "compute-3")


# --- the pre-2.53 forms ---------------------------------------------------------------------------


def test_legacy_disable_log_reason_disable_and_enable(computes):
    naming = {"host": "compute-3", "binary": "nova-compute"}

    logged = admin("PUT", f"{SERVICES}/disable-log-reason", version="2.52", body={**naming, "disabled_reason": "fan"})
    assert logged.status == 200
    assert logged.body == {"service": {**naming, "status": "disabled", "disabled_reason": "fan"}}
    assert states()["compute-3"] == (True, "fan", True)

    enabled = admin("PUT", f"{SERVICES}/enable", version="2.1", body=naming)
    assert enabled.body == {"service": {**naming, "status": "enabled"}}
    assert states()["compute-3"] == (False, None, True)

    disabled = admin("PUT", f"{SERVICES}/disable", version="2.1", body=naming)
    assert disabled.body == {"service": {**naming, "status": "disabled"}}
    assert states()["compute-3"] == (True, None, True)


def test_legacy_force_down_from_2_11(computes):
    naming = {"host": "compute-1", "binary": "nova-compute"}

    too_early = admin("PUT", f"{SERVICES}/force-down", version="2.10", body=naming)
    early_body = admin("PUT", f"{SERVICES}/force-down", version="2.10", body={**naming, "forced_down": True})
    forced = admin("PUT", f"{SERVICES}/force-down", version="2.11", body={**naming, "forced_down": True})

    assert too_early.status == 404
    assert early_body.status == 400  # Nova's schema below 2.11 has no forced_down, and is checked first
    assert forced.status == 200 and forced.body == {"service": {**naming, "forced_down": True}}
    assert states()["compute-1"] == (False, None, True)


def test_legacy_forms_from_2_11_take_forced_down_and_a_reason_in_any_body_as_nova_does(computes):
    """Nova's 2.11 schema is one for every action: each reads what it needs and ignores the rest."""
    naming = {"host": "compute-1", "binary": "nova-compute"}

    disabled = admin("PUT", f"{SERVICES}/disable", version="2.11", body={**naming, "forced_down": True})
    assert disabled.status == 200 and disabled.body == {"service": {**naming, "status": "disabled"}}
    assert states()["compute-1"] == (True, None, False)

    forced = admin("PUT", f"{SERVICES}/force-down", version="2.52",
                   body={**naming, "forced_down": True, "disabled_reason": "fan"})
    assert forced.status == 200 and forced.body == {"service": {**naming, "forced_down": True}}
    assert states()["compute-1"] == (True, None, True)

    missing = admin("PUT", f"{SERVICES}/force-down", version="2.52", body=naming)
    assert missing.status == 400 and error(missing, "badRequest") == "Missing forced_down field"
    below = admin("PUT", f"{SERVICES}/disable", version="2.10", body={**naming, "forced_down": False})
    assert below.status == 400
    assert states()["compute-1"] == (True, None, True)


@pytest.mark.parametrize(("path", "body", "status"), [
    ("disable-log-reason", {"host": "compute-1", "binary": "nova-compute"}, 400),
    ("disable", {"host": "compute-1"}, 400),
    ("disable", {"host": "compute-1", "binary": "nova-compute", "zone": "z"}, 400),
    ("disable", {"host": "nowhere", "binary": "nova-compute"}, 404),
    ("disable", {"host": "compute-1", "binary": "nova-scheduler"}, 404),
    ("force-down", {"host": "compute-1", "binary": "nova-compute"}, 400),
    ("reboot", {"host": "compute-1", "binary": "nova-compute"}, 404),
])
def test_bad_legacy_updates_change_nothing(computes, path, body, status):
    response = admin("PUT", f"{SERVICES}/{path}", version="2.52", body=body)

    assert response.status == status
    assert states()["compute-1"] == (False, None, False)


# --- delete ---------------------------------------------------------------------------------------


def test_delete_is_refused_while_the_host_has_servers(computes):
    add_instance("compute-1", "cell1")

    response = admin("DELETE", f"{SERVICES}/{row('compute-1').uuid}")

    assert response.status == 409
    assert error(response, "conflictingRequest") == (
        "Unable to delete compute service that is hosting instances. Migrate or delete the instances first.")
    assert "compute-1" in states()


def test_delete_is_refused_while_a_migration_involves_the_host(computes):
    with cell_session("cell2") as session:
        session.add(Migration(instance_uuid=str(uuid.uuid4()), source_compute="compute-3", dest_compute="compute-1",
                              status="finished", migration_type="migration"))

    response = admin("DELETE", f"{SERVICES}/{row('compute-1').uuid}")

    assert response.status == 409
    assert "in-progress migrations" in error(response, "conflictingRequest")
    with cell_session("cell2") as session:
        session.execute(update(Migration).values(status="confirmed"))
    assert admin("DELETE", f"{SERVICES}/{row('compute-1').uuid}").status == 204


def test_delete_is_refused_while_the_hosts_provider_has_allocations(computes):
    placement.claim(str(uuid.uuid4()), PROJECT, USER, {placement.provider_by_host("compute-2"): {placement.VCPU: 1}})

    response = admin("DELETE", f"{SERVICES}/{row('compute-2').uuid}")

    assert response.status == 409
    assert "still has allocations" in error(response, "conflictingRequest")
    assert "compute-2" in states()
    with api_session() as session:
        assert session.scalars(select(HostMapping).where(HostMapping.host == "compute-2")).one_or_none() is not None


def test_delete_forgets_the_host_everywhere(computes):
    add_aggregate("ssd", ["compute-1", "compute-2"], {"ssd": "true"})

    response = admin("DELETE", f"{SERVICES}/{row('compute-1').uuid}")

    assert response.status == 204 and response.body is None
    assert sorted(states()) == ["compute-2", "compute-3"]
    with api_session() as session:
        assert session.scalars(select(HostMapping.host).where(HostMapping.host == "compute-1")).all() == []
        assert session.scalars(select(ResourceProvider.host).where(ResourceProvider.host == "compute-1")).all() == []
        assert session.scalars(select(AggregateHost.host)).all() == ["compute-2"]
    assert "compute-1" not in listed()


@pytest.mark.parametrize("service_id", ["99999999999999999999999", "2147483648", "-99999999999999999999999"])
def test_legacy_delete_of_an_integer_id_beyond_the_column_is_404_as_any_unknown_id(computes, service_id):
    before = states()

    response = admin("DELETE", f"{SERVICES}/{service_id}", version="2.52")

    assert response.status == 404, response.body
    assert error(response, "itemNotFound") == f"Service {service_id} could not be found."
    assert states() == before


def test_legacy_delete_by_integer_id_needs_an_unambiguous_id(computes):
    # compute-1 (cell1) and compute-3 (cell2) are each the first service of their cell.
    assert row("compute-1").id == row("compute-3").id

    ambiguous = admin("DELETE", f"{SERVICES}/{row('compute-1').id}", version="2.52")
    unique = admin("DELETE", f"{SERVICES}/{row('compute-2').id}", version="2.52")
    malformed = admin("DELETE", f"{SERVICES}/{row('compute-1').uuid}", version="2.52")

    assert ambiguous.status == 400 and error(ambiguous, "badRequest") == \
        f"Service id {row('compute-1').id} refers to multiple services."
    assert unique.status == 204
    assert malformed.status == 400
    assert sorted(states()) == ["compute-1", "compute-3"]


def test_a_delete_whose_api_database_commit_failed_is_finished_by_asking_again(computes, monkeypatch):
    # GIVEN the API database's commit fails once, after the host's providers, memberships and mapping
    # were deleted in it
    add_aggregate("ssd", ["compute-1", "compute-2"], {"ssd": "true"})
    service_uuid = row("compute-1").uuid
    real_api_session = compute_services.api_session
    failures: list[str] = []

    @contextmanager
    def commit_fails_once() -> Iterator[Session]:
        with real_api_session() as session:
            yield session
            if not failures:
                failures.append("commit")
                raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(compute_services, "api_session", commit_fails_once)

    # WHEN the delete is asked, fails, and is asked again
    failed = admin("DELETE", f"{SERVICES}/{service_uuid}")
    again = admin("DELETE", f"{SERVICES}/{service_uuid}")

    # THEN the first answer is an error that left the service to be found, and the second finishes the
    # delete: the service, its provider, its aggregate membership and its mapping are all gone
    assert failures == ["commit"]
    assert failed.status >= 500, failed.body
    assert again.status == 204, again.body
    assert sorted(states()) == ["compute-2", "compute-3"]
    with api_session() as session:
        assert session.scalars(select(HostMapping.host).where(HostMapping.host == "compute-1")).all() == []
        assert session.scalars(select(ResourceProvider.host).where(ResourceProvider.host == "compute-1")).all() == []
        assert session.scalars(select(AggregateHost.host)).all() == ["compute-2"]


def test_delete_of_an_unknown_service_is_404(computes):
    assert admin("DELETE", f"{SERVICES}/{uuid.uuid4()}").status == 404
    assert admin("DELETE", f"{SERVICES}/999", version="2.52").status == 404
    assert admin("DELETE", f"{SERVICES}/not-a-uuid").status == 400
    assert sorted(states()) == computes


# --- what disabling does --------------------------------------------------------------------------


def test_a_host_disabled_through_the_api_gets_no_new_servers(computes):
    add_compute("compute-4", "cell1")

    def chosen() -> list[str]:
        return sorted(s.host for s in scheduler.select_destinations(request_spec(), claim=False))

    assert chosen() == ["compute-1", "compute-4"]
    admin("PUT", f"{SERVICES}/{row('compute-1').uuid}", body={"status": "disabled", "disabled_reason": "maint"})
    assert chosen() == ["compute-4"]
    admin("PUT", f"{SERVICES}/{row('compute-4').uuid}", body={"status": "disabled"})
    with pytest.raises(errors.NoValidHost):
        chosen()

    admin("PUT", f"{SERVICES}/{row('compute-1').uuid}", body={"status": "enabled"})
    assert chosen() == ["compute-1"]


def test_the_heartbeat_does_not_enable_a_disabled_service(computes):
    admin("PUT", f"{SERVICES}/{row('compute-1').uuid}", body={"status": "disabled", "disabled_reason": "maint"})

    hosts.apply_report({"kind": protocol.REPORT_HEARTBEAT, "host": "compute-1", "sent_at": utcnow().isoformat()})

    assert states()["compute-1"] == (True, "maint", False)
    assert listed()["compute-1"]["state"] == "up"


# --- reports that waited in the queue ---------------------------------------------------------------


def _inventory(host: str, vcpus: int, sent_at: dt.datetime, cell: str = "cell1") -> dict:
    return {"kind": protocol.REPORT_INVENTORY, "host": host, "node": host, "cell": cell,
            "sent_at": sent_at.isoformat(), "guests": [],
            "inventory": {"VCPU": {"total": vcpus}, "MEMORY_MB": {"total": 4096}, "DISK_GB": {"total": 40}}}


def test_a_report_that_waited_in_the_queue_longer_than_a_host_may_be_silent_is_dropped(computes):
    # GIVEN the report of compute-2 (silent for ten minutes) queued two minutes ago, handled only now
    # (its first batch failed), and one of a host deleted since
    queued_at = utcnow() - dt.timedelta(minutes=2)
    before = row("compute-2").last_seen_at

    hosts.apply_report({"kind": protocol.REPORT_HEARTBEAT, "host": "compute-2", "sent_at": queued_at.isoformat()},
                       queued_at)
    hosts.apply_report(_inventory("compute-9", 8, queued_at), queued_at)

    # THEN the host does not look up, and the deleted one is neither mapped again nor given a provider
    assert row("compute-2").last_seen_at == before
    assert listed()["compute-2"]["state"] == "down"
    assert hosts.cell_of_host("compute-9") is None
    with api_session() as session:
        assert session.scalars(select(ResourceProvider).where(ResourceProvider.host == "compute-9")).all() == []


def test_a_report_that_waited_less_than_that_is_a_heartbeat_as_of_when_it_was_queued(computes):
    # A backlog shorter than service_down_time must not make every host look down; a host that
    # died just after its last report is down service_down_time after it, however long it waited.
    queued_at = utcnow() - dt.timedelta(seconds=50)

    hosts.apply_report({"kind": protocol.REPORT_HEARTBEAT, "host": "compute-2", "sent_at": queued_at.isoformat()},
                       queued_at)

    assert row("compute-2").last_seen_at == queued_at
    assert listed()["compute-2"]["state"] == "up"

    # AND a report queued before it, applied after, does not take the heartbeat back
    earlier = queued_at - dt.timedelta(seconds=5)
    hosts.apply_report({"kind": protocol.REPORT_HEARTBEAT, "host": "compute-2", "sent_at": earlier.isoformat()},
                       earlier)
    assert row("compute-2").last_seen_at == queued_at


def test_an_agent_clock_that_went_back_does_not_freeze_the_hosts_inventory(computes):
    # GIVEN a report whose agent's clock ran an hour ahead, then one after the clock was set right
    ahead = _inventory("compute-1", 4, utcnow() + dt.timedelta(hours=1))
    hosts.apply_report(ahead, utcnow() - dt.timedelta(seconds=10))

    hosts.apply_report(_inventory("compute-1", 16, utcnow()), utcnow())

    # THEN the later report, by the queue's clock, is applied
    assert placement.get_inventories(placement.provider_by_host("compute-1"))[placement.VCPU]["total"] == 16


def test_an_inventory_report_older_than_the_last_applied_does_not_overwrite_it(computes):
    newer, older = utcnow() - dt.timedelta(seconds=5), utcnow() - dt.timedelta(seconds=15)

    hosts.apply_report(_inventory("compute-1", 16, newer), newer)
    hosts.apply_report(_inventory("compute-1", 2, older), older)  # delivered late

    assert placement.get_inventories(placement.provider_by_host("compute-1"))[placement.VCPU]["total"] == 16


def test_a_hosts_reports_are_taken_from_the_sender_of_its_first_one_until_it_is_rebound(computes, capsys):
    # GIVEN compute-2 (silent for ten minutes) and a new host, each reporting first from its own agent
    first = utcnow() - dt.timedelta(seconds=20)
    hosts.apply_report({"kind": protocol.REPORT_HEARTBEAT, "host": "compute-2", "sent_at": first.isoformat()},
                       first, "AROAAGENT:i-02")
    hosts.apply_report(_inventory("compute-7", 8, first), first, "AROAAGENT:i-07")
    assert row("compute-2").last_seen_at == first and hosts.cell_of_host("compute-7") == "cell1"

    # WHEN another sender reports compute-2 up and compute-7's inventory changed
    later = utcnow() - dt.timedelta(seconds=10)
    hosts.apply_report({"kind": protocol.REPORT_HEARTBEAT, "host": "compute-2", "sent_at": later.isoformat()},
                       later, "AROAAGENT:i-07")
    hosts.apply_report(_inventory("compute-7", 64, later), later, "AROAAGENT:i-02")

    # THEN neither is applied
    assert row("compute-2").last_seen_at == first
    assert placement.get_inventories(placement.provider_by_host("compute-7"))[placement.VCPU]["total"] == 8
    # (a report whose sender is not known is applied as before)
    hosts.apply_report(_inventory("compute-7", 16, later), later)
    assert placement.get_inventories(placement.provider_by_host("compute-7"))[placement.VCPU]["total"] == 16

    # WHEN compute-7's agent now sends as another identity and the host is re-bound
    from ferry import cli

    assert cli.main(["host", "rebind", "compute-7"]) == 0
    assert "compute-7: its reports are taken from the sender of its next report" in capsys.readouterr().out
    now = utcnow()
    hosts.apply_report(_inventory("compute-7", 32, now), now, "AROAAGENT:i-17")
    hosts.apply_report(_inventory("compute-7", 4, now), now, "AROAAGENT:i-07")

    # THEN the next report binds it: the new identity's reports are applied, the old one's not
    assert placement.get_inventories(placement.provider_by_host("compute-7"))[placement.VCPU]["total"] == 32
    assert cli.main(["host", "rebind", "compute-99"]) == 1
    assert "host compute-99 is not mapped to a cell" in capsys.readouterr().err


def test_the_reports_handler_gives_each_report_the_time_sqs_queued_it(computes, monkeypatch):
    queued_at = utcnow().replace(microsecond=0) - dt.timedelta(seconds=30)
    applied = []
    monkeypatch.setattr(hosts, "apply_report",
                        lambda report, at=None, sender=None: applied.append((report["host"], at, sender)))
    record = {"messageId": "m-1", "receiptHandle": "r-1", "md5OfBody": "", "eventSource": "aws:sqs",
              "eventSourceARN": "arn:aws:sqs:us-east-1:123456789012:ferry-test-host-reports", "awsRegion": "us-east-1",
              "body": json.dumps({"kind": protocol.REPORT_HEARTBEAT, "host": "compute-1", "sent_at": "x"}),
              "attributes": {"SentTimestamp": str(int(queued_at.replace(tzinfo=dt.UTC).timestamp() * 1000)),
                             "SenderId": "AROAAGENT:i-01"},
              "messageAttributes": {}}

    result = function("report_host_state").handler({"Records": [record]}, LambdaContext())

    assert result == {"batchItemFailures": []}
    assert applied == [("compute-1", queued_at, "AROAAGENT:i-01")]


def test_a_report_without_sqs_times_is_applied_as_queued_now(computes, monkeypatch):
    applied = []
    monkeypatch.setattr(hosts, "apply_report",
                        lambda report, at=None, sender=None: applied.append((report["host"], at, sender)))
    record = {"messageId": "m-1", "receiptHandle": "r-1", "md5OfBody": "", "eventSource": "aws:sqs",
              "eventSourceARN": "arn:aws:sqs:us-east-1:123456789012:ferry-test-host-reports", "awsRegion": "us-east-1",
              "body": json.dumps({"kind": protocol.REPORT_HEARTBEAT, "host": "compute-1", "sent_at": "x"}),
              "attributes": {}, "messageAttributes": {}}

    result = function("report_host_state").handler({"Records": [record]}, LambdaContext())

    assert result == {"batchItemFailures": []}
    assert applied == [("compute-1", None, None)]

