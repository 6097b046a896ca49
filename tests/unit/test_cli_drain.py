"""``ferry drain``: the request each flag sends, how plans, drains and progress read, and how
``watch`` ends. The API is a scripted stand-in for openstacksdk's compute proxy; the real one is
driven end to end elsewhere."""

from __future__ import annotations

import io
import json
import os
import socket
from typing import Any

import openstack
import pytest
from keystoneauth1 import exceptions as ksa

from ferry import cli, cli_drain

DRAIN_ID = "5f0c2a9e-0000-4000-8000-000000000001"
VM1 = "11111111-1111-4111-8111-111111111111"
VM2 = "22222222-2222-4222-8222-222222222222"
VM3 = "33333333-3333-4333-8333-333333333333"


class FakeResponse:
    def __init__(self, status: int, document: Any = None, text: str | None = None) -> None:
        self.status_code = status
        self._document = document
        self.text = json.dumps(document) if text is None else text

    def json(self) -> Any:
        if self._document is None:
            raise ValueError("no JSON")
        return self._document


class FakeCompute:
    """Answers each request with the next scripted response (or raises it, if an exception)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, str, Any]] = []

    def _answer(self, method: str, url: str, kwargs: dict[str, Any]) -> FakeResponse:
        assert kwargs.get("raise_exc") is False
        self.calls.append((method, url, kwargs.get("json")))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def get(self, url: str, **kwargs: Any) -> FakeResponse:
        return self._answer("GET", url, kwargs)

    def post(self, url: str, **kwargs: Any) -> FakeResponse:
        return self._answer("POST", url, kwargs)


class FakeConnection:
    def __init__(self, *answers: Any) -> None:
        self.compute = FakeCompute(list(answers))


@pytest.fixture
def cloud(monkeypatch):
    """Install a fake connection for ``ferry drain``; ``cloud(*answers)`` returns it."""
    made: dict[str, Any] = {}

    def install(*answers: Any) -> FakeConnection:
        conn = FakeConnection(*answers)

        def connect(name: str | None) -> FakeConnection:
            made["cloud"] = name
            return conn

        monkeypatch.setattr(cli_drain, "connect", connect)
        made["conn"] = conn
        return conn

    install.made = made  # type: ignore[attr-defined]
    return install


def server(server_id: str, name: str, state: str = "pending", **fields: Any) -> dict[str, Any]:
    base = {"id": server_id, "name": name, "cell": "cell1", "source_host": "h1", "planned_host": "h2",
            "dest_host": None, "state": state, "vm_state": "active", "migration_id": None, "attempts": 0,
            "error": None, "started_at": None, "finished_at": None}
    return base | fields


def view(status: str = "running", counts: dict[str, int] | None = None, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": DRAIN_ID, "status": status, "target": {"kind": "host", "names": ["h1"]},
        "reason": "disk replacement", "dry_run": False,
        "options": {"max_concurrency": 5, "max_per_source_host": None, "max_per_dest_host": None, "confirm": True,
                    "move_what_fits": False, "retries": 1, "callback_url": None},
        "counts": {"total": 3, "done": 0, "failed": 0, "in_progress": 0, "left": 3, "cancelled": 0,
                   "unplaceable": 0} | (counts or {}),
        "created_at": "2026-11-23T10:00:00Z", "started_at": "2026-11-23T10:00:01Z", "finished_at": None,
        "updated_at": "2026-11-23T10:00:05Z", "eta": None, "eta_seconds": None, "average_move_seconds": None,
        "message": None, "plan": {"fits": True, "unplaceable": []},
        "servers": [server(VM1, "vm1"), server(VM2, "vm2"), server(VM3, "vm3")],
    }
    return base | fields


def ok(document: Any, status: int = 200) -> FakeResponse:
    return FakeResponse(status, document)


# --- arguments and the request they send ---------------------------------------------------------


@pytest.mark.parametrize(("flags", "body"), [
    (["--host", "h1"], {"host": "h1"}),
    (["--host", "h1", "--host", "h2", "--host", "h1"], {"hosts": ["h1", "h2"]}),
    (["--cell", "cell2"], {"cell": "cell2"}),
    (["--cell", "cell2", "--reason", "retire gen2", "--dry-run", "--max-concurrency", "10",
      "--max-per-source-host", "2", "--max-per-dest-host", "3", "--no-confirm", "--move-what-fits",
      "--retries", "0", "--callback-url", "https://ops.example/hook"],
     {"cell": "cell2", "reason": "retire gen2", "dry_run": True, "max_concurrency": 10, "max_per_source_host": 2,
      "max_per_dest_host": 3, "confirm": False, "move_what_fits": True, "retries": 0,
      "callback_url": "https://ops.example/hook"}),
])
def test_start_sends_only_the_options_given(cloud, capsys, flags, body):
    conn = cloud(ok({"drain": view("running")}, 202))

    assert cli.main(["drain", "start", *flags]) == 0

    assert conn.compute.calls == [("POST", "/ferry/drains", {"drain": body})]


@pytest.mark.parametrize("flags", [
    [],
    ["--host", "h1", "--cell", "cell1"],
    ["--host", "h1", "--max-concurrency", "0"],
    ["--host", "h1", "--max-concurrency", "101"],
    ["--host", "h1", "--retries", "6"],
    ["--host", "h1", "--retries", "one"],
    ["--host", "h1", "--max-per-dest-host", "0"],
    ["--host", "h1", "--max-per-source-host", "1001"],
    ["--host", "h1", "--interval", "0"],
    ["--host", "h1", "--watch", "--json"],
])
def test_bad_start_arguments_are_usage_errors_and_send_nothing(cloud, capsys, flags):
    conn = cloud()

    with pytest.raises(SystemExit) as exited:
        cli.main(["drain", "start", *flags])

    assert exited.value.code == 2
    assert conn.compute.calls == []


def test_host_and_cell_exclude_each_other(cloud, capsys):
    cloud()
    with pytest.raises(SystemExit):
        cli.main(["drain", "start", "--host", "h1", "--cell", "cell1"])

    assert "--cell: not allowed with argument --host" in capsys.readouterr().err


def test_drain_without_a_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["drain"])

    assert exited.value.code == 2
    assert "<subcommand>" in capsys.readouterr().err


def test_drain_is_a_ferry_command():
    assert ("drain", cli_drain.add_drain) in cli.COMMANDS


def test_the_cloud_comes_from_os_cloud_or_the_flag(cloud, monkeypatch, capsys):
    monkeypatch.setenv("OS_CLOUD", "ferry-admin")
    cloud(ok({"drains": []}))
    assert cli.main(["drain", "list"]) == 0
    assert cloud.made["cloud"] == "ferry-admin"

    cloud(ok({"drains": []}))
    assert cli.main(["drain", "list", "--os-cloud", "other"]) == 0
    assert cloud.made["cloud"] == "other"


def test_connect_uses_openstack_connect_with_the_cloud(monkeypatch):
    seen = []
    monkeypatch.setattr(openstack, "connect", lambda cloud=None: seen.append(cloud) or "conn")

    assert cli_drain.connect("ferry-admin") == "conn"
    assert seen == ["ferry-admin"]


def test_an_unknown_cloud_is_one_line_and_exit_1(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("OS_CLIENT_CONFIG_FILE", str(tmp_path / "clouds.yaml"))

    assert cli.main(["drain", "list", "--os-cloud", "nowhere"]) == 1

    assert capsys.readouterr().err.startswith("ferry drain: cannot use cloud nowhere:")


# --- answers: plans, views, lists, errors --------------------------------------------------------


def planned(fits: bool, move_what_fits: bool = False) -> dict[str, Any]:
    unplaceable = [] if fits else [{"id": VM3, "name": "vm3", "reason": "no host has 4 VCPU free"}]
    servers = [server(VM1, "vm1", planned_host="h2"), server(VM2, "vm2", source_host="h1", planned_host="h3"),
               server(VM3, "vm3", planned_host=None, state="pending" if fits else "unplaceable")]
    if fits:
        servers[2]["planned_host"] = "h2"
    result = view("planned", dry_run=True, plan={"fits": fits, "unplaceable": unplaceable}, servers=servers)
    result["options"]["move_what_fits"] = move_what_fits
    return result


def test_a_plan_that_fits_lists_each_server_and_its_planned_host():
    text = cli_drain.render_plan(planned(fits=True))

    assert text.splitlines()[0] == f"Plan of drain {DRAIN_ID} (host h1): 3 server(s), dry run: nothing moved"
    assert text.splitlines()[2].split() == ["SERVER", "ID", "SOURCE", "→", "PLANNED", "HOST"]
    assert f"vm1     {VM1}  h1 → h2" in text
    assert f"vm2     {VM2}  h1 → h3" in text
    assert text.endswith("The plan fits: every server has a destination.")


def test_a_plan_that_does_not_fit_says_why_and_what_move_what_fits_would_do():
    text = cli_drain.render_plan(planned(fits=False))

    assert f"vm3     {VM3}  h1 → cannot be placed: no host has 4 VCPU free" in text
    assert "The plan does not fit: 1 of 3 server(s) cannot be placed." in text
    assert "--move-what-fits moves the 2 that can be placed" in text


def test_a_plan_where_nothing_fits_does_not_offer_move_what_fits():
    nothing = planned(fits=False)
    nothing["servers"] = [server(VM3, "vm3", "unplaceable", planned_host=None)]

    text = cli_drain.render_plan(nothing)

    assert text.splitlines()[-2:] == ["The plan does not fit: 1 of 1 server(s) cannot be placed.",
                                      "No server can be placed: a drain would move nothing."]


@pytest.mark.parametrize(("fits", "move_what_fits", "status"), [(True, False, 0), (False, False, 1), (False, True, 0)])
def test_a_dry_run_prints_the_plan_and_exits_by_whether_a_drain_would_go(cloud, capsys, fits, move_what_fits,
                                                                         status):
    cloud(ok({"drain": planned(fits, move_what_fits)}))

    assert cli.main(["drain", "start", "--host", "h1", "--dry-run"]) == status

    out = capsys.readouterr().out
    assert "Plan of drain" in out
    assert ("The plan fits" in out) is fits


def test_show_renders_the_drain_and_its_servers(cloud, capsys):
    servers = [server(VM1, "vm1", "done", dest_host="h2", attempts=1),
               server(VM2, "vm2", "moving", dest_host="h3", attempts=2),
               server(VM3, "vm3", "unplaceable", planned_host=None)]
    shown = view("running", {"done": 1, "in_progress": 1, "left": 1, "unplaceable": 1}, servers=servers,
                 eta="2026-11-23T10:06:05Z", eta_seconds=65, average_move_seconds=61.6, message="one cannot be placed",
                 plan={"fits": False, "unplaceable": [{"id": VM3, "name": "vm3", "reason": "too big"}]},
                 disabled_hosts=["h1"])
    conn = cloud(ok({"drain": shown}))

    assert cli.main(["drain", "show", DRAIN_ID]) == 0

    assert conn.compute.calls == [("GET", f"/ferry/drains/{DRAIN_ID}", None)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Drain {DRAIN_ID}  running"
    assert "  target       host h1" in lines
    assert ("  options      max concurrency 5, per source host no limit, per destination host no limit, confirm, "
            "move what fits no, retries 1") in lines
    assert "  eta          2026-11-23T10:06:05Z (in 1m 05s)" in lines
    assert "  average move 1m 02s" in lines
    assert "  plan         does not fit: 1 server(s) cannot be placed" in lines
    assert "  message      one cannot be placed" in lines
    assert "  disabled     h1" in lines
    rows = [line.split() for line in lines[lines.index("") + 1:]]
    assert rows == [["SERVER", "ID", "SOURCE", "DESTINATION", "STATE", "ATTEMPTS", "ERROR"],
                    ["vm1", VM1, "h1", "h2", "done", "1", "-"],
                    ["vm2", VM2, "h1", "h3", "moving", "2", "-"],
                    ["vm3", VM3, "h1", "-", "unplaceable", "0", "too", "big"]]


def test_show_json_prints_the_raw_document(cloud, capsys):
    document = {"drain": view("paused")}
    cloud(ok(document))

    assert cli.main(["drain", "show", DRAIN_ID, "--json"]) == 0

    assert json.loads(capsys.readouterr().out) == document


def test_list_filters_by_status_and_prints_one_row_per_drain(cloud, capsys):
    listed = view("running", {"total": 40, "done": 12, "failed": 1})
    del listed["servers"]
    conn = cloud(ok({"drains": [listed]}))

    assert cli.main(["drain", "list", "--status", "running"]) == 0

    assert conn.compute.calls == [("GET", "/ferry/drains?status=running", None)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "TARGET", "DONE", "FAILED", "CREATED", "REASON"]
    assert lines[1].split() == [DRAIN_ID, "running", "host", "h1", "12/40", "1", "2026-11-23T10:00:00Z", "disk",
                                "replacement"]


def test_an_empty_list_says_so(cloud, capsys):
    cloud(ok({"drains": []}))

    assert cli.main(["drain", "list"]) == 0
    assert capsys.readouterr().out == "No drains.\n"


def test_list_status_must_be_a_drain_status(cloud, capsys):
    cloud()
    with pytest.raises(SystemExit) as exited:
        cli.main(["drain", "list", "--status", "done"])
    assert exited.value.code == 2


@pytest.mark.parametrize(("status", "document", "text", "line"), [
    (409, {"conflictingRequest": {"code": 409, "message": "Drain is completed; it cannot be paused."}}, None,
     "HTTP 409 Conflict: Drain is completed; it cannot be paused."),
    (400, {"badRequest": {"code": 400, "message": "max_concurrency: 0 is less than the minimum of 1"}}, None,
     "HTTP 400 Bad Request: max_concurrency: 0 is less than the minimum of 1"),
    (403, {"message": "Forbidden"}, None, "HTTP 403 Forbidden: Forbidden"),
    (502, None, "<html>Bad gateway\nmore</html>", "HTTP 502 Bad Gateway: <html>Bad gateway"),
    (500, None, "", "HTTP 500 Internal Server Error"),
    (599, None, "", "HTTP 599"),
])
def test_an_error_answer_is_one_line_with_status_and_message(status, document, text, line):
    assert cli_drain.describe_error(status, document, text or "") == line


def test_an_error_answer_ends_the_command_with_exit_1(cloud, capsys):
    fault = {"itemNotFound": {"code": 404, "message": f"Drain {DRAIN_ID} could not be found."}}
    cloud(FakeResponse(404, fault))

    assert cli.main(["drain", "show", DRAIN_ID]) == 1

    captured = capsys.readouterr()
    assert captured.err == f"ferry drain: HTTP 404 Not Found: Drain {DRAIN_ID} could not be found.\n"
    assert captured.out == ""


def test_no_answer_at_all_is_one_line_and_exit_1(cloud, capsys):
    cloud(ksa.ConnectFailure("Unable to establish connection to http://127.0.0.1:8774"))

    assert cli.main(["drain", "list"]) == 1
    assert capsys.readouterr().err.startswith("ferry drain: GET /ferry/drains: Unable to establish connection")


@pytest.mark.parametrize(("action", "after"), [
    ("pause", "No new moves start; the 2 in progress finish. Resume with: ferry drain resume"),
    ("resume", "Moves start again."),
    ("cancel", "No new moves start; the 2 in progress finish, then the drain reports."),
])
def test_pause_resume_cancel_post_the_action_and_say_what_follows(cloud, capsys, action, after):
    status = {"pause": "paused", "resume": "running", "cancel": "cancelling"}[action]
    conn = cloud(ok({"drain": view(status, {"done": 1, "in_progress": 2, "left": 2})}, 202))

    assert cli.main(["drain", action, DRAIN_ID]) == 0

    assert conn.compute.calls == [("POST", f"/ferry/drains/{DRAIN_ID}/action", {action: None})]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Drain {DRAIN_ID} {status}: 1 done, 0 failed of 3, 2 in progress."
    assert lines[1].startswith(after)


def test_an_action_the_status_does_not_allow_exits_1(cloud, capsys):
    cloud(FakeResponse(409, {"conflictingRequest": {"code": 409, "message": "Drain is completed."}}))

    assert cli.main(["drain", "resume", DRAIN_ID]) == 1
    assert capsys.readouterr().err == "ferry drain: HTTP 409 Conflict: Drain is completed.\n"


def test_a_started_drain_says_how_to_follow_it(cloud, capsys):
    cloud(ok({"drain": view("running")}, 202))

    assert cli.main(["drain", "start", "--host", "h1"]) == 0

    assert capsys.readouterr().out.splitlines() == [
        f"Drain {DRAIN_ID} running: host h1, 3 server(s).", f"Follow it with: ferry drain watch {DRAIN_ID}"]


def test_a_drain_still_planning_has_no_server_count_yet(cloud, capsys):
    cloud(ok({"drain": view("planning", {"total": 0, "left": 0}, servers=[], started_at=None)}, 202))

    assert cli.main(["drain", "start", "--cell", "cell1"]) == 0

    assert capsys.readouterr().out.splitlines()[0] == f"Drain {DRAIN_ID} planning: host h1."


def test_start_json_prints_the_raw_document(cloud, capsys):
    document = {"drain": view("running")}
    cloud(ok(document, 202))

    assert cli.main(["drain", "start", "--cell", "cell2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == document


# --- progress --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [
    (None, "--"), (0, "0s"), (44.6, "45s"), (59.4, "59s"), (60, "1m 00s"), (365, "6m 05s"),
    (3599, "59m 59s"), (3600, "1h 00m"), (7380, "2h 03m"), (86400 + 4 * 3600 + 59, "1d 04h"), (-5, "0s"),
])
def test_durations_read_at_a_glance(seconds, text):
    assert cli_drain.format_duration(seconds) == text


@pytest.mark.parametrize(("counts", "percent"), [
    ({"total": 0}, 100),
    ({"total": 3, "done": 0}, 0),
    ({"total": 3, "done": 1}, 33),
    ({"total": 2, "done": 1, "in_progress": 1, "left": 1}, 50),  # moving servers are in "left" too
    ({"total": 200, "done": 150, "failed": 40, "cancelled": 5, "unplaceable": 4}, 99),  # floored
    ({"total": 4, "done": 2, "failed": 1, "unplaceable": 1}, 100),
    ({"total": 3, "done": 2, "gone": 1}, 100),  # a server deleted during the drain is settled too
])
def test_the_percentage_counts_settled_servers(counts, percent):
    assert cli_drain.settled_percent(counts) == percent


def test_the_progress_line_has_bar_percentage_counts_and_eta():
    running = view("running", {"total": 44, "done": 10, "failed": 1, "in_progress": 3, "left": 33},
                   eta_seconds=365)

    assert cli_drain.progress_line(running) == (
        "running  [######..................]   25%  10 done, 1 failed of 44, 3 in progress  ETA 6m 05s")
    assert cli_drain.progress_line(running, bar=False) == (
        "running   25%  10 done, 1 failed of 44, 3 in progress  ETA 6m 05s")


def test_the_progress_line_without_an_estimate_yet_and_when_final():
    starting = view("running", {"total": 4, "left": 4})
    finished = view("completed", {"total": 4, "done": 3, "left": 0, "unplaceable": 1})

    assert cli_drain.progress_line(starting, width=4) == (
        "running  [....]    0%  0 done, 0 failed of 4, 0 in progress  ETA --")
    assert cli_drain.progress_line(finished, width=4) == (
        "completed  [####]  100%  3 done, 0 failed of 4, 1 unplaceable")


def test_a_drain_still_planning_is_not_shown_as_done():
    planning = view("planning", {"total": 0, "left": 0}, servers=[])

    assert cli_drain.progress_line(planning, width=4) == (
        "planning  [....]    0%  finding a destination for every server")
    assert cli_drain.progress_line(planning, bar=False) == "planning    0%  finding a destination for every server"


# --- watch -----------------------------------------------------------------------------------------


def running(done: int, moving: str | None = None, **fields: Any) -> dict[str, Any]:
    servers = [server(sid, name, "done" if i < done else "pending", dest_host="h2" if i < done else None)
               for i, (sid, name) in enumerate([(VM1, "vm1"), (VM2, "vm2"), (VM3, "vm3")])]
    counts = {"done": done, "left": 3 - done, "in_progress": 0}
    if moving is not None:
        index = [VM1, VM2, VM3].index(moving)
        servers[index] = server(moving, servers[index]["name"], "moving", dest_host="h3", attempts=1)
        counts = {"done": done, "in_progress": 1, "left": 3 - done}
    return view("running", counts, servers=servers, eta_seconds=120 - 40 * done, **fields)


def watched(conn: FakeConnection, tty: bool = False, **kwargs: Any) -> tuple[int, str, list[float]]:
    out = io.StringIO()
    sleeps: list[float] = []
    status = cli_drain.watch(conn, DRAIN_ID, interval=0.5, out=out, tty=tty, sleep=sleeps.append, **kwargs)
    return status, out.getvalue(), sleeps


def test_watch_prints_a_line_per_change_and_exits_0_when_completed():
    completed = view("completed", {"done": 3, "left": 0}, finished_at="2026-11-23T10:02:06Z",
                     servers=[server(s, n, "done", dest_host="h2") for s, n in [(VM1, "vm1"), (VM2, "vm2"),
                                                                               (VM3, "vm3")]])
    conn = FakeConnection(ok({"drain": running(0)}), ok({"drain": running(0)}), ok({"drain": running(0, VM1)}),
                          ok({"drain": running(2)}), ok({"drain": completed}))

    status, out, sleeps = watched(conn)

    assert status == 0
    assert sleeps == [0.5] * 4  # no sleep after the final look
    assert all(call == ("GET", f"/ferry/drains/{DRAIN_ID}", None) for call in conn.compute.calls)
    assert out.splitlines() == [
        "2026-11-23T10:00:05Z  running    0%  0 done, 0 failed of 3, 0 in progress  ETA 2m 00s",
        f"vm1 ({VM1}): moving h1 → h3",
        "2026-11-23T10:00:05Z  running    0%  0 done, 0 failed of 3, 1 in progress  ETA 2m 00s",
        f"vm1 ({VM1}): done, now on h2",
        f"vm2 ({VM2}): done, now on h2",
        "2026-11-23T10:00:05Z  running   66%  2 done, 0 failed of 3, 0 in progress  ETA 40s",
        f"vm3 ({VM3}): done, now on h2",
        "2026-11-23T10:00:05Z  completed  100%  3 done, 0 failed of 3",
        f"Drain {DRAIN_ID} completed: 3 done, 0 failed, 0 cancelled, 0 unplaceable of 3 in 2m 05s.",
    ]


@pytest.mark.parametrize("final", ["failed", "cancelled"])
def test_watch_exits_1_when_the_drain_failed_or_was_cancelled_and_names_the_failures(final):
    servers = [server(VM1, "vm1", "done", dest_host="h2"),
               server(VM2, "vm2", "failed", attempts=2, error="Ferry.HostOpTimeout at PrepResizeAtDest"),
               server(VM3, "vm3", "cancelled")]
    ended = view(final, {"done": 1, "failed": 1, "cancelled": 1, "left": 0}, servers=servers,
                 message="1 server(s) failed")
    conn = FakeConnection(ok({"drain": running(1)}), ok({"drain": ended}))

    status, out, _ = watched(conn)

    assert status == 1
    assert f"vm2 ({VM2}): failed after 2 attempt(s), back on h1: Ferry.HostOpTimeout at PrepResizeAtDest" in out
    assert f"vm3 ({VM3}): cancelled" in out
    assert out.splitlines()[-3:] == [
        f"Drain {DRAIN_ID} {final}: 1 done, 1 failed, 1 cancelled, 0 unplaceable of 3.",
        "1 server(s) failed",
        f"  failed: vm2 ({VM2}) on h1: Ferry.HostOpTimeout at PrepResizeAtDest"]


def test_watch_on_a_terminal_redraws_one_progress_line():
    completed = view("completed", {"done": 3, "left": 0}, servers=[])
    conn = FakeConnection(ok({"drain": running(1)}), ok({"drain": completed}))

    status, out, _ = watched(conn, tty=True)

    assert status == 0
    first, second = out.split("\r\x1b[K")[1:3]
    assert first.startswith("running  [########................]   33%  1 done, 0 failed of 3")
    assert second.startswith("completed  [########################]  100%  3 done")
    assert second.endswith(f"\nDrain {DRAIN_ID} completed: 3 done, 0 failed, 0 cancelled, 0 unplaceable of 3.\n")


def test_watch_announces_planned_servers_only_once_they_do_something():
    planning = view("planning", {"total": 0, "left": 0}, servers=[])
    unplaceable = server(VM3, "vm3", "unplaceable", planned_host=None, error="too big")
    planned_now = running(0, VM1)
    planned_now["servers"][2] = unplaceable
    retried = running(0)
    retried["servers"][0] = server(VM1, "vm1", "pending", attempts=1, error="Ferry.HostOpTimeout")
    retried["servers"][2] = unplaceable
    ended = view("failed", {"done": 0, "left": 0, "cancelled": 3}, servers=[])
    conn = FakeConnection(*(ok({"drain": v}) for v in (planning, planned_now, retried, ended)))

    _status, out, _ = watched(conn)

    events = [line for line in out.splitlines() if line.startswith("vm")]
    assert events == [f"vm1 ({VM1}): moving h1 → h3",
                      f"vm3 ({VM3}): unplaceable: too big",
                      f"vm1 ({VM1}): will be tried again after: Ferry.HostOpTimeout"]


def test_watch_rides_out_a_few_transient_failures():
    conn = FakeConnection(ok({"drain": running(1)}),
                          FakeResponse(503, {"message": "Service Unavailable"}),
                          ksa.ConnectFailure("connection reset"),
                          ok({"drain": view("completed", {"done": 3, "left": 0})}))

    status, out, sleeps = watched(conn)

    assert status == 0
    assert len(sleeps) == 3
    assert "retrying (1/5): HTTP 503 Service Unavailable: Service Unavailable" in out
    assert "retrying (2/5): GET" in out


def test_watch_gives_up_after_too_many_transient_failures():
    conn = FakeConnection(*[FakeResponse(502, None, "bad gateway")] * (cli_drain.WATCH_TRANSIENT_LIMIT + 1))

    with pytest.raises(cli_drain.DrainError, match="HTTP 502 Bad Gateway: bad gateway"):
        watched(conn)


def test_watch_stops_at_once_on_an_error_answer(cloud, capsys):
    cloud(FakeResponse(404, {"itemNotFound": {"code": 404, "message": "Drain nope could not be found."}}))

    assert cli.main(["drain", "watch", "nope", "--interval", "0.01"]) == 1
    assert capsys.readouterr().err == "ferry drain: HTTP 404 Not Found: Drain nope could not be found.\n"


def test_an_interrupted_watch_says_the_drain_goes_on(cloud, capsys):
    cloud(KeyboardInterrupt())

    assert cli.main(["drain", "watch", DRAIN_ID]) == 130
    assert f"the drain goes on (ferry drain watch {DRAIN_ID})" in capsys.readouterr().out


def test_an_interrupted_start_watch_says_the_drain_goes_on(cloud, capsys):
    cloud(ok({"drain": view("running")}, 202), KeyboardInterrupt())

    assert cli.main(["drain", "start", "--host", "h1", "--watch"]) == 130
    assert f"the drain goes on (ferry drain watch {DRAIN_ID})" in capsys.readouterr().out


def test_a_failed_server_whose_move_finished_elsewhere_is_shown_there():
    servers = [server(VM1, "vm1", "failed", attempts=1, dest_host="h2",
                      error="Confirming failed. The move itself finished on h2: confirm or revert it.")]
    ended = view("failed", {"done": 0, "failed": 1, "left": 0}, servers=servers)

    _status, out, _ = watched(FakeConnection(ok({"drain": running(1)}), ok({"drain": ended})))

    assert f"vm1 ({VM1}): failed after 1 attempt(s), now on h2: Confirming failed." in out


def test_a_dry_run_is_final_for_watch():
    status, out, sleeps = watched(FakeConnection(ok({"drain": planned(fits=False)})))

    assert (status, sleeps) == (1, [])
    assert out.splitlines()[-1].startswith(f"Drain {DRAIN_ID} planned:")


def test_start_watch_starts_then_follows_until_the_end(cloud, monkeypatch, capsys):
    monkeypatch.setattr(cli_drain.time, "sleep", lambda seconds: None)
    conn = cloud(ok({"drain": view("running")}, 202), ok({"drain": running(2)}),
                 ok({"drain": view("failed", {"done": 2, "failed": 1, "left": 0})}))

    assert cli.main(["drain", "start", "--host", "h1", "--watch", "--interval", "0.1"]) == 1

    assert [call[:2] for call in conn.compute.calls] == [
        ("POST", "/ferry/drains"), ("GET", f"/ferry/drains/{DRAIN_ID}"), ("GET", f"/ferry/drains/{DRAIN_ID}")]
    assert f"Drain {DRAIN_ID} failed: 2 done, 1 failed" in capsys.readouterr().out


def test_no_cloud_given_is_one_line_and_exit_1(monkeypatch, tmp_path, capsys):
    """Neither --os-cloud nor OS_CLOUD, and no OS_* variable to authenticate with: said in one line."""
    for name in [name for name in os.environ if name.startswith("OS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OS_CLIENT_CONFIG_FILE", str(tmp_path / "clouds.yaml"))
    monkeypatch.setattr(openstack.config.loader, "CONFIG_FILES", [str(tmp_path / "clouds.yaml")])

    assert cli.main(["drain", "list"]) == 1

    err = capsys.readouterr().err
    assert err.startswith("ferry drain: no cloud given (--os-cloud, or OS_CLOUD)") and "auth_url" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("interval", ["0", "-1", "inf", "nan"])
def test_an_interval_that_is_no_finite_number_above_0_is_a_usage_error(capsys, interval):
    with pytest.raises(SystemExit) as exited:
        cli.main(["drain", "watch", DRAIN_ID, "--interval", interval])

    assert exited.value.code == 2
    assert "argument --interval" in capsys.readouterr().err


def test_a_server_deleted_during_the_drain_is_shown_gone_not_back_on_its_source(cloud, capsys):
    # GIVEN a drain that completed with one of its servers deleted by its owner on the way
    servers = [server(VM1, "vm1", "done", dest_host="h2", attempts=1),
               server(VM2, "vm2", "done", dest_host="h2", attempts=1),
               server(VM3, "vm3", "gone", error="The server no longer exists: it was deleted before its move started.")]
    completed = view("completed", {"done": 2, "gone": 1, "left": 0}, servers=servers,
                     message="All 3 servers left: 2 moved, 1 deleted during the drain.")

    # WHEN it is watched to its end
    status, out, _ = watched(FakeConnection(ok({"drain": running(2)}), ok({"drain": completed})))

    # THEN the server is announced gone, counted, named in the summary, and the watch succeeds
    assert status == 0
    assert f"vm3 ({VM3}): gone, deleted during the drain (it was on h1)" in out
    assert "back on" not in out
    assert "completed  100%  2 done, 0 failed of 3, 1 gone" in out
    assert out.splitlines()[-3:] == [
        f"Drain {DRAIN_ID} completed: 2 done, 0 failed, 0 cancelled, 0 unplaceable, 1 gone of 3.",
        "All 3 servers left: 2 moved, 1 deleted during the drain.",
        f"  gone: vm3 ({VM3}) was on h1: deleted during the drain"]

    # and show lists it in its own state
    cloud(ok({"drain": completed}))
    assert cli.main(["drain", "show", DRAIN_ID]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  progress     completed  [########################]  100%  2 done, 0 failed of 3, 1 gone" in lines
    [row] = [line.split()[:6] for line in lines if line.startswith("vm3")]
    assert row == ["vm3", VM3, "h1", "-", "gone", "0"]  # its planned host no longer means anything


def test_an_identity_endpoint_out_of_reach_is_a_ferry_drain_line_and_exit_1(monkeypatch, tmp_path, capsys):
    # GIVEN a cloud whose identity endpoint nothing listens on (the compute proxy authenticates when first used)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    clouds = tmp_path / "clouds.yaml"
    clouds.write_text(f"""clouds:
  unreachable:
    auth:
      auth_url: http://127.0.0.1:{port}/v3
      username: admin
      password: s3cret
      project_name: admin
      user_domain_name: Default
      project_domain_name: Default
""")
    monkeypatch.setenv("OS_CLIENT_CONFIG_FILE", str(clouds))
    monkeypatch.setattr(openstack.config.loader, "CONFIG_FILES", [str(clouds)])

    # WHEN a drain command runs against it
    status = cli.main(["drain", "list", "--os-cloud", "unreachable"])

    # THEN ferry drain says so in its own line, with the documented exit status, and no traceback
    err = capsys.readouterr().err
    assert status == 1
    assert "ferry drain: GET /ferry/drains: Unable to establish connection" in err
    assert "Traceback" not in err and "s3cret" not in err
