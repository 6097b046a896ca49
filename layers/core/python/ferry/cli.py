"""``ferry``: the operator's command line (``ferry <command> …``).

It runs where the control plane's settings are (the same ``FERRY_*`` environment the functions
get): it reads the store and AWS directly, not through the compute API.

Each command is a function that adds its sub-parser and sets ``handler`` to what runs it; a new
command (``ferry drain …``, say) is one more entry in :data:`COMMANDS`. A handler returns the
exit status.

Exit statuses: 0 success (for ``audit``: no problem left), 1 problems remain (or, for the set-up
commands of :mod:`ferry.cli_cells` and for ``ferry volume``, refused), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ferry import cli_cells, cli_drain, cli_volumes
from ferry.audit import DEFAULT_GRACE_SECONDS

Handler = Callable[[argparse.Namespace], int]


def _run_audit(args: argparse.Namespace) -> int:
    from ferry import audit, config

    if not args.no_storage and not config.is_set(config.IMAGE_BUCKET_VARIABLE):
        # Bucket names are global: a default name may be another stack's bucket, and --fix deletes there.
        print(f"ferry audit: {config.IMAGE_BUCKET_VARIABLE} is not set: set it to the stack's image bucket "
              f"(the ImageBucketName output), or pass --no-storage to leave the bucket out", file=sys.stderr)
        return 2
    report = audit.run_audit(fix=args.fix, grace_seconds=args.grace, check_storage=not args.no_storage)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        print(report.describe())
    return 0 if report.clean else 1


def add_audit(commands: Any) -> None:
    parser = commands.add_parser(
        "audit", help="check Ferry's invariants (records, placement, hosts, images)",
        description="Check that servers, migrations, allocations, port bindings, volume attachments, the "
                    "hosts' guests and disks and the image bucket agree. Exit status 0 when clean, 1 when "
                    "problems remain. See docs/reliability.md for each problem kind.")
    parser.add_argument("--fix", action="store_true",
                        help="repair what is safe (orphan allocations, bindings, attachments, temporary "
                             "snapshots and transfers, stale hidden copies, stuck migrations), then check again")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS, metavar="SECONDS",
                        help="leave records changed within this many seconds alone: a workflow may be between "
                             "two writes (default: %(default)g)")
    parser.add_argument("--no-storage", action="store_true",
                        help="skip the image bucket (temporary snapshots and disk transfers)")
    parser.set_defaults(handler=_run_audit)


# (name, adds the sub-parser): the commands of ``ferry``, in the order --help lists them.
COMMANDS: list[tuple[str, Callable[[Any], None]]] = [
    ("audit", add_audit),
    ("drain", cli_drain.add_drain),
    ("db", cli_cells.add_db),
    ("cell", cli_cells.add_cell),
    ("host", cli_cells.add_host),
    ("volume", cli_volumes.add_volume),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="Operate a Ferry cloud.")
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for _name, add in COMMANDS:
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ferry`` with ``argv`` (default: the process's arguments); returns the exit status."""
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
