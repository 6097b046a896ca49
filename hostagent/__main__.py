"""Run a host agent: ``ferry-hostagent --host compute1 --cell cell1`` (or ``python -m hostagent …``).

Without ``--libvirt-uri`` the agent simulates a hypervisor with libvirt's test driver: it writes
a node description (``--vcpus``, ``--memory-mb``) under ``--state-dir`` and opens it, so each
agent has its own hypervisor. That hypervisor writes its guests back into the node description
after every change, so an agent restarted on the same state directory (after a crash, say) finds
its guests as a real hypervisor would keep them. On a real hypervisor pass
``--libvirt-uri qemu:///system``.

Environment: ``AWS_ENDPOINT_URL`` (the local stack), ``FERRY_HOST_QUEUE_PREFIX``,
``FERRY_HOST_REPORTS_QUEUE_URL``, ``FERRY_STATE_DIR``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from ferry import config, errors, protocol
from ferry.arguments import more_than_zero, seconds, whole
from ferry.observability import logger
from hostagent.agent import (
    DEFAULT_HYPERVISOR_CALL_TIMEOUT,
    DEFAULT_KEEPALIVE_INTERVAL,
    DEFAULT_MAX_WAITING,
    DEFAULT_VISIBILITY_TIMEOUT,
    HostAgent,
    default_volumes_dirs,
    inventory_from_capacity,
)
from hostagent.driver import CPU_MODES, PORT_VIF_TYPES, HostCapacity, LibvirtDriver, write_test_node_xml

DEFAULT_TEST_VCPUS = 8
DEFAULT_TEST_MEMORY_MB = 16384
DEFAULT_RESERVED_MEMORY_MB = 512
# A cached image no spawn used for a day is deleted.
DEFAULT_IMAGE_CACHE_MAX_AGE = 24 * 60 * 60.0
# How often an agent started with --parent-pid checks that its parent is still there.
PARENT_CHECK_SECONDS = 1.0
# The longest SQS long poll.
MAX_POLL_WAIT_SECONDS = 20


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it has none or its help tells it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferry-hostagent",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--host", default=socket.gethostname(), help="compute host name")
    parser.add_argument("--node", help="hypervisor node name (default: the host name)")
    parser.add_argument("--cell", default="cell1", help="the cell this host belongs to")
    parser.add_argument(
        "--libvirt-uri", help="libvirt URI (default: a test:/// hypervisor described under --state-dir)"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="the agent's state: journal, test node XML (default: $FERRY_STATE_DIR/hosts/<host>)",
    )
    parser.add_argument("--instances-dir", type=Path, help="instance disks (default: <state-dir>/instances)")
    parser.add_argument(
        "--volumes-dir",
        type=Path,
        action="append",
        dest="volumes_dirs",
        metavar="DIR",
        help="a directory in which operations may make and remove volume files, repeated for each; a volume "
        "file elsewhere is refused (default: $FERRY_STATE_DIR/volumes and volumes beside --instances-dir; the "
        "first is where the compute API places the volumes it makes only when this FERRY_STATE_DIR is the "
        "stack's FerryStateDir, as in the local stack: otherwise give that directory, and each directory "
        "volumes are registered in with --new-file-in)",
    )
    parser.add_argument("--vcpus", type=whole(1), help="vCPUs to report (and of the test hypervisor)")
    parser.add_argument("--memory-mb", type=whole(1), help="memory to report (and of the test hypervisor)")
    parser.add_argument("--disk-gb", type=whole(0), help="instance disk to report (default: the instances filesystem)")
    parser.add_argument("--reserved-vcpus", type=whole(0), default=0, help="vCPUs kept for the host")
    parser.add_argument(
        "--reserved-memory-mb", type=whole(0), default=DEFAULT_RESERVED_MEMORY_MB, help="memory kept for the host"
    )
    parser.add_argument("--reserved-disk-gb", type=whole(0), default=0, help="disk kept for the host")
    parser.add_argument("--queue-url", help="the host's operation queue (default: created from the queue prefix)")
    parser.add_argument("--print-queue-tag", action="store_true",
                        help="print the value of the ferry-host tag that confines this host's AWS identity to its "
                             "own queues (HostAgentOwnQueuePolicyArn) and exit")
    parser.add_argument("--poll-wait-seconds", type=whole(0, MAX_POLL_WAIT_SECONDS), default=MAX_POLL_WAIT_SECONDS,
                        help=f"SQS long-poll wait, 0-{MAX_POLL_WAIT_SECONDS}")
    parser.add_argument(
        "--report-interval", type=more_than_zero, default=60.0, help="seconds between inventory reports"
    )
    parser.add_argument("--heartbeat-interval", type=more_than_zero, default=10.0, help="seconds between heartbeats")
    parser.add_argument(
        "--keepalive-interval", type=more_than_zero, default=DEFAULT_KEEPALIVE_INTERVAL,
        help="seconds between task heartbeats and visibility renewals while an operation runs or waits for a worker "
        "(at most half the visibility timeout)"
    )
    parser.add_argument(
        "--visibility-timeout",
        type=whole(1),
        default=DEFAULT_VISIBILITY_TIMEOUT,
        help="seconds a received operation stays invisible (renewed while it runs)",
    )
    parser.add_argument(
        "--hypervisor-call-timeout", type=whole(0), default=int(DEFAULT_HYPERVISOR_CALL_TIMEOUT),
        help="seconds a call into libvirt may run beyond what it was asked to wait before the hypervisor counts as "
        "hung: task and service heartbeats stop until it answers (0: never)",
    )
    parser.add_argument("--workers", type=int, default=1, help="operations run at once")
    parser.add_argument(
        "--waiting", type=int, default=DEFAULT_MAX_WAITING,
        help="operations received beyond the workers, their tasks heartbeat while they wait for one",
    )
    parser.add_argument(
        "--disk-headroom-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the resize claim refuses a flavor whose disks, fully written, do not fit the instances filesystem",
    )
    parser.add_argument(
        "--direct-copies",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="offer this host's instances directory to a move's source, which copies the disks straight in "
        "when it sees that storage (otherwise, or with --no-direct-copies, disks travel through S3)",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        help="stop, as on SIGTERM, once the process with this id is no longer the agent's parent (it exited): "
        "whoever starts agents for itself alone, as the local stack does, keeps them from outliving it",
    )
    parser.add_argument(
        "--image-cache-max-age",
        type=seconds,
        default=DEFAULT_IMAGE_CACHE_MAX_AGE,
        help="seconds after its last use a cached image (<instances-dir>/_base) is deleted; 0 keeps them all",
    )
    parser.add_argument(
        "--disk-overcommit-ratio",
        type=more_than_zero,
        default=1.0,
        help="the disk headroom check needs a flavor's full disk size divided by this ratio free "
        "(above 1 for sparse disks that are expected to stay sparse)",
    )
    parser.add_argument(
        "--cpu-mode",
        choices=CPU_MODES,
        default="host-model",
        help="the CPU guests see: the host's model and features (host-model), the host CPU exactly "
        "(host-passthrough: moves only between identical hosts), or the hypervisor's default (none)",
    )
    parser.add_argument(
        "--port-bridge",
        help="the bridge ports are plugged into (br-int for Open vSwitch); unset, ports are tap devices "
        "of type ethernet that nothing plugs in, which is all libvirt's test driver needs",
    )
    parser.add_argument(
        "--port-vif-type",
        choices=PORT_VIF_TYPES,
        default="ovs",
        help="how a port joins --port-bridge: an Open vSwitch port carrying the port id, or a Linux bridge port",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the agent until SIGTERM or SIGINT; return the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.keepalive_interval > args.visibility_timeout / 2:
        parser.error("--keepalive-interval must be at most half --visibility-timeout: a running operation's "
                     "message would reappear")
    if args.workers < 1 or args.waiting < 0:
        parser.error("--workers must be at least 1 and --waiting at least 0")
    if not args.queue_url and not config.is_set(config.HOST_QUEUE_PREFIX_VARIABLE):
        parser.error(f"{config.HOST_QUEUE_PREFIX_VARIABLE} is not set: set it to the stack's HostQueuePrefix "
                     f"output (ferry-<stage>-host-), or name the host's queue with --queue-url; otherwise no "
                     f"workflow reaches this agent")
    settings = config.get()
    host: str = args.host
    if not protocol.is_host_name(host):
        parser.error(f"--host {host!r} is not a host name: letters, digits, '-' and '_' in labels separated by "
                     f"dots, not ending in {protocol.DLQ_SUFFIX}")
    if host == protocol.REPORTS_HOST:  # whatever --queue-url says: its reports queue is the stack's
        parser.error(f"--host {host!r} would poll the host reports queue (<prefix>{protocol.REPORTS_HOST}): "
                     f"choose another host name")
    reports_queue = settings.host_reports_queue_url.rstrip("/").rsplit("/", 1)[-1]
    if not args.queue_url and protocol.host_queue_name(settings.host_queue_prefix, host) == reports_queue:
        parser.error(f"--host {host!r} would poll the host reports queue {reports_queue}: choose another host name")
    if args.print_queue_tag:
        print(protocol.host_queue_tag(settings.host_queue_prefix, host))
        return 0
    state_dir: Path = (args.state_dir or settings.state_dir / "hosts" / host).resolve()
    instances_dir: Path = (args.instances_dir or state_dir / "instances").resolve()
    volumes_dirs = [d.resolve() for d in args.volumes_dirs or default_volumes_dirs(settings.state_dir, instances_dir)]
    uri = args.libvirt_uri or write_test_node_xml(
        state_dir / "node.xml",
        args.vcpus or DEFAULT_TEST_VCPUS,
        args.memory_mb or DEFAULT_TEST_MEMORY_MB,
        keep_guests=True,
    )
    try:
        driver = LibvirtDriver(
            uri,
            disk_path=instances_dir,
            persist_test_guests=not args.libvirt_uri,
            cpu_mode=args.cpu_mode,
            port_bridge=args.port_bridge,
            port_vif_type=args.port_vif_type,
        )
        capacity = driver.host_capacity()
    except errors.HypervisorError as exc:
        logger.error("cannot open the hypervisor", extra={"host": host, "uri": uri, "error": exc.message})
        return 1
    inventory = inventory_from_capacity(
        HostCapacity(
            vcpus=args.vcpus or capacity.vcpus,
            memory_mb=args.memory_mb or capacity.memory_mb,
            disk_gb=args.disk_gb if args.disk_gb is not None else capacity.disk_gb,
        ),
        reserved_vcpus=args.reserved_vcpus,
        reserved_memory_mb=args.reserved_memory_mb,
        reserved_disk_gb=args.reserved_disk_gb,
    )
    agent = HostAgent(
        host=host,
        node=args.node or host,
        cell=args.cell,
        queue_url=args.queue_url,
        reports_queue_url=settings.host_reports_queue_url,
        driver=driver,
        instances_dir=instances_dir,
        state_dir=state_dir,
        volumes_dirs=volumes_dirs,
        inventory=inventory,
        queue_prefix=settings.host_queue_prefix,
        poll_wait_seconds=args.poll_wait_seconds,
        report_interval=args.report_interval,
        heartbeat_interval=args.heartbeat_interval,
        keepalive_interval=args.keepalive_interval,
        visibility_timeout=args.visibility_timeout,
        max_workers=args.workers,
        max_waiting=args.waiting,
        disk_headroom_check=args.disk_headroom_check,
        disk_overcommit_ratio=args.disk_overcommit_ratio,
        direct_copies=args.direct_copies,
        image_cache_max_age=timedelta(seconds=args.image_cache_max_age) if args.image_cache_max_age > 0 else None,
        hypervisor_call_timeout=float(args.hypervisor_call_timeout),
    )
    agent.install_signal_handlers()
    if args.parent_pid is not None:
        stop_with_parent(agent, args.parent_pid)
    try:
        agent.run()
    finally:
        driver.close()
    return 0


def stop_with_parent(agent: HostAgent, parent_pid: int, interval: float = PARENT_CHECK_SECONDS) -> threading.Thread:
    """Stop ``agent`` as SIGTERM would once ``parent_pid`` is no longer this process's parent.

    A process whose parent exits is handed to another (init, or a subreaper), so its parent id
    changes; a parent that already exited before the agent started is noticed at once. Returns
    the watching (daemon) thread, which ends with the agent.
    """

    def watch() -> None:
        while not agent.stopping:
            if os.getppid() != parent_pid:
                logger.warning("the process that started this agent has exited: stopping",
                               extra={"host": agent.host, "parent_pid": parent_pid})
                agent.stop()
                return
            time.sleep(interval)

    watcher = threading.Thread(target=watch, name="parent-watch", daemon=True)
    watcher.start()
    return watcher


if __name__ == "__main__":
    sys.exit(main())
