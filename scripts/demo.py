"""Ferry's scripted demo (``make demo``): a server's life on the local stack, step by step.

Brings up the whole local stack in this process (on free ports, in a fresh state directory),
then, as the ``demo`` project's user through openstacksdk: lists the flavors, boots a server of
the smallest one from the seeded image, shows each change of its state as it happens, the
placement usage on its host, stops and starts it, resizes it to the next flavor and confirms,
cold-migrates it (as the admin) and reverts, deletes it and shows the usage back to zero.
The stack is shut down at the end, whatever happened.

Exit status: 0 when every step did what it should, 1 when one did not (the message says which
and where the logs are), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import requests

POLL_INTERVAL_SECONDS = 0.2
STEP_TIMEOUT_SECONDS = 90.0
DEMO_SERVER_NAME = "demo-vm"
POWER_STATES = {0: "NOSTATE", 1: "RUNNING", 3: "PAUSED", 4: "SHUTDOWN", 6: "CRASHED", 7: "SUSPENDED"}


class DemoFailed(Exception):
    """A step did not end as it should; the message says what happened instead."""


@dataclass(frozen=True)
class ServerState:
    """What the demo watches of a server: one line of output whenever it changes."""

    status: str
    task_state: str | None
    power_state: int | None
    host: str | None
    fault: str | None = None

    def line(self) -> str:
        power = POWER_STATES.get(self.power_state or 0, str(self.power_state))
        return f"{self.status} / {self.task_state or '-'} / {power} / {self.host or '-'}"


@dataclass
class Demo:
    """The running stack, the clients, and what the steps have learnt so far (the server, its host)."""

    stack: Any
    out: IO[str]
    conn: Any = None
    admin_conn: Any = None
    admin: requests.Session = field(default_factory=requests.Session)
    started: float = field(default_factory=time.monotonic)
    server_id: str | None = None
    host: str | None = None

    # output

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def header(self, text: str) -> None:
        self.say(f"\n== {text} ==")

    def elapsed(self) -> str:
        return f"[{time.monotonic() - self.started:6.1f}s]"

    # the admin's view of a server, which shows its host

    def server_state(self, server_id: str) -> ServerState | None:
        """The server as the admin sees it; None once the API answers 404."""
        response = self.admin.get(f"{self.stack.api_url}/servers/{server_id}", timeout=30)
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise DemoFailed(f"GET /servers/{server_id} answered {response.status_code}: {response.text}")
        server = response.json()["server"]
        fault = server.get("fault") or {}
        return ServerState(
            status=server["status"],
            task_state=server.get("OS-EXT-STS:task_state"),
            power_state=server.get("OS-EXT-STS:power_state"),
            host=server.get("OS-EXT-SRV-ATTR:host"),
            fault=fault.get("message"),
        )

    def watch(self, server_id: str, done: Callable[[ServerState | None], bool], what: str) -> ServerState | None:
        """Print the server's state (status / task_state / power_state / host) each time it changes, until ``done``.

        Raises:
            DemoFailed: the server went to ERROR, or ``what`` did not happen within the step timeout.
        """
        step_start = time.monotonic()
        last: ServerState | None | str = "unseen"
        while True:
            state = self.server_state(server_id)
            if state != last:
                seconds = time.monotonic() - step_start
                self.say(f"  {seconds:5.1f}s  {state.line() if state else 'gone (404)'}")
                last = state
            if done(state):
                return state
            if state is not None and state.status == "ERROR":
                raise DemoFailed(f"server {server_id} went to ERROR while waiting for {what}: {state.fault}")
            if time.monotonic() - step_start > STEP_TIMEOUT_SECONDS:
                raise DemoFailed(f"server {server_id} did not reach {what} within {STEP_TIMEOUT_SECONDS:.0f} s")
            time.sleep(POLL_INTERVAL_SECONDS)

    def wait_for_status(self, status: str) -> ServerState:
        assert self.server_id is not None
        state = self.watch(
            self.server_id, lambda s: s is not None and s.status == status and s.task_state is None, status
        )
        assert state is not None
        return state

    # placement

    def usage_lines(self, host: str) -> list[str]:
        from ferry import placement

        provider = placement.provider_by_host(host)
        used = placement.usages(provider)
        inventory = placement.get_inventories(provider)
        return [
            f"  {rc:<10} {used.get(rc, 0):>6} of {inventory[rc]['total']:>6}"
            for rc in (placement.VCPU, placement.MEMORY_MB, placement.DISK_GB)
            if rc in inventory
        ]


# --- the steps ---------------------------------------------------------------------------------------


def list_flavors(demo: Demo) -> None:
    demo.header("Flavors, as the demo project sees them")
    demo.say(f"  {'ID':<4} {'Name':<14} {'vCPUs':>5} {'RAM MB':>7} {'Disk GB':>7} {'Ephemeral':>9} {'Swap MB':>7}")
    for flavor in sorted(demo.conn.compute.flavors(), key=lambda f: (f.vcpus, f.ram, f.disk)):
        demo.say(
            f"  {flavor.id:<4} {flavor.name:<14} {flavor.vcpus:>5} {flavor.ram:>7} {flavor.disk:>7} "
            f"{flavor.ephemeral or 0:>9} {flavor.swap or 0:>7}"
        )


def boot_server(demo: Demo) -> None:
    flavors = sorted(demo.conn.compute.flavors(), key=lambda f: (f.vcpus, f.ram, f.disk))
    if not flavors:
        raise DemoFailed("the stack offers no flavor")
    flavor = flavors[0]
    image = demo.conn.image.find_image(demo.stack.seeded.image["name"], ignore_missing=True)
    if image is None:
        raise DemoFailed(f"the seeded image {demo.stack.seeded.image['name']} is not in the image list")
    demo.header(f'Boot "{DEMO_SERVER_NAME}": flavor {flavor.name}, image {image.name}, network auto')
    server = demo.conn.compute.create_server(
        name=DEMO_SERVER_NAME, flavor_id=flavor.id, image_id=image.id, networks="auto"
    )
    demo.server_id = server.id
    demo.say(f"  server {server.id} accepted; status / task_state / power_state / host:")
    state = demo.wait_for_status("ACTIVE")
    demo.host = state.host
    demo.say(f"  ACTIVE on {state.host}")


def show_usage(demo: Demo) -> None:
    if demo.host is None:
        raise DemoFailed("no host to show the usage of: the server was never placed")
    demo.header(f"Placement usage on {demo.host}")
    for line in demo.usage_lines(demo.host):
        demo.say(line)


def stop_server(demo: Demo) -> None:
    demo.header("Stop the server")
    demo.conn.compute.stop_server(demo.server_id)
    state = demo.wait_for_status("SHUTOFF")
    if state.power_state != 4:
        raise DemoFailed(f"the server is SHUTOFF but its power state is {state.power_state}, not 4 (SHUTDOWN)")


def start_server(demo: Demo) -> None:
    demo.header("Start the server")
    demo.conn.compute.start_server(demo.server_id)
    state = demo.wait_for_status("ACTIVE")
    if state.power_state != 1:
        raise DemoFailed(f"the server is ACTIVE but its power state is {state.power_state}, not 1 (RUNNING)")


def _settle_move(demo: Demo, finish: str) -> None:
    """Show where the server lives while it waits in VERIFY_RESIZE, then confirm or revert."""
    state = demo.wait_for_status("VERIFY_RESIZE")
    source, dest = demo.host, state.host
    demo.say(f"  VERIFY_RESIZE on {dest} (was on {source}); placement holds both until it is settled:")
    for host in dict.fromkeys((source, dest)):
        if host is None:
            continue
        demo.say(f"  {host}:")
        for line in demo.usage_lines(host):
            demo.say(f"  {line}")
    demo.say(f"  {finish} ...")
    if finish == "confirm":
        demo.conn.compute.confirm_server_resize(demo.server_id)
    else:
        demo.conn.compute.revert_server_resize(demo.server_id)
    settled = demo.wait_for_status("ACTIVE")
    expected = dest if finish == "confirm" else source
    if settled.host != expected:
        raise DemoFailed(f"after the {finish} the server is on {settled.host}, not {expected}")
    demo.host = settled.host
    demo.say(f"  ACTIVE on {settled.host}")


def resize_and_confirm(demo: Demo) -> None:
    server = demo.conn.compute.get_server(demo.server_id)
    current = server.flavor.get("original_name") if isinstance(server.flavor, dict) else server.flavor.name
    flavors = sorted(demo.conn.compute.flavors(), key=lambda f: (f.vcpus, f.ram, f.disk))
    bigger = next((f for f in flavors if f.name != current and f.disk >= flavors[0].disk), None)
    if bigger is None:
        raise DemoFailed("the stack offers no second flavor to resize to")
    demo.header(f"Resize {current} -> {bigger.name}, then confirm")
    demo.conn.compute.resize_server(demo.server_id, bigger.id)
    _settle_move(demo, "confirm")


def migrate_and_revert(demo: Demo) -> None:
    demo.header("Cold migrate (as the admin), then revert")
    demo.admin_conn.compute.migrate_server(demo.server_id)
    _settle_move(demo, "revert")


def delete_server(demo: Demo) -> None:
    assert demo.server_id is not None
    demo.header("Delete the server")
    demo.conn.compute.delete_server(demo.server_id)
    demo.watch(demo.server_id, lambda state: state is None, "deletion")
    demo.server_id = None


def show_usage_released(demo: Demo) -> None:
    from ferry import placement

    show_usage(demo)
    for host in demo.stack.seeded.hosts:
        left = placement.usages(placement.provider_by_host(host))
        if any(left.values()):
            raise DemoFailed(f"{host} still has resources allocated after the delete: {left}")
    demo.say("  everything released, on every host")


STEPS: tuple[Callable[[Demo], None], ...] = (
    list_flavors,
    boot_server,
    show_usage,
    stop_server,
    start_server,
    resize_and_confirm,
    migrate_and_revert,
    delete_server,
    show_usage_released,
)


# --- running it --------------------------------------------------------------------------------------


def _connect(stack: Any, identity: str) -> Any:
    import openstack

    os.environ["OS_CLIENT_CONFIG_FILE"] = str(stack.clouds_yaml)
    return openstack.connect(cloud=f"ferry-{identity}")


def _cleanup(demo: Demo) -> None:
    """Delete the demo's server if a step failed with it still there (the stack's state is thrown away anyway)."""
    if demo.server_id is None or demo.conn is None:
        return
    try:
        demo.conn.compute.delete_server(demo.server_id, ignore_missing=True)
    except Exception as exc:  # the demo has failed already; say so, do not hide the first error
        demo.say(f"  (could not delete server {demo.server_id}: {exc})")


def run(state_dir: Path, out: IO[str]) -> None:
    """Start the stack in ``state_dir``, run every step, stop the stack.

    Raises:
        DemoFailed: a step did not end as it should.
    """
    from ferry.local.stack import LocalStack

    stack = LocalStack(state_dir, moto_port=0, api_port=0, agent_mode="process")
    demo = Demo(stack=stack, out=out)
    demo.say(f"{demo.elapsed()} Starting Ferry's local stack in {state_dir} ...")
    stack.start()
    try:
        demo.say(f"{demo.elapsed()} Up: compute API {stack.api_url}, hosts {', '.join(stack.seeded.hosts)}")
        demo.admin.headers.update(
            {"X-Auth-Token": stack.seeded.tokens["admin"], "OpenStack-API-Version": "compute latest"}
        )
        demo.conn = _connect(stack, "demo")
        demo.admin_conn = _connect(stack, "admin")
        for step in STEPS:
            step(demo)
        demo.header("Done")
    except BaseException:
        _cleanup(demo)
        raise
    finally:
        demo.say(f"{demo.elapsed()} Stopping the local stack ...")
        for conn in (demo.conn, demo.admin_conn):
            if conn is not None:
                conn.close()
        demo.admin.close()
        stack.stop()
        demo.say(f"{demo.elapsed()} Stopped.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run Ferry's scripted demo on a fresh local stack.")
    parser.add_argument(
        "--state-dir", type=Path, default=None,
        help="state directory for the stack (default: a new temporary one, removed after a successful run)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    terminal = sys.stdout
    if args.state_dir is not None:
        state_dir, temporary = args.state_dir.resolve(), False
    else:
        state_dir, temporary = Path(tempfile.mkdtemp(prefix="ferry-demo-")), True

    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    # openstacksdk warns about its own deprecations; they say nothing about Ferry.
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", PendingDeprecationWarning)
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    # The handlers run in this process and print their metrics to stdout: keep them in the stack's log.
    log_stream = (state_dir / "logs" / "stack.log").open("a")
    sys.stdout = log_stream
    print("Ferry demo: a server's life on the local stack", file=terminal, flush=True)
    failure: str | None = None
    try:
        run(state_dir, terminal)
    except DemoFailed as exc:
        failure = str(exc)
    except KeyboardInterrupt:
        print(f"\ndemo interrupted\n  logs: {state_dir / 'logs'}", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        sys.stdout = terminal
        log_stream.close()
    if failure is not None:
        print(f"\ndemo FAILED: {failure}\n  logs: {state_dir / 'logs'}", file=sys.stderr, flush=True)
        return 1
    if temporary:
        shutil.rmtree(state_dir, ignore_errors=True)
    print("\nThe demo ran to the end.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
