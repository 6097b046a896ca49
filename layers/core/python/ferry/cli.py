"""``ferry``: the operator's command line (``ferry <command> …``).

It runs where the control plane's settings are (the same ``FERRY_*`` environment the functions
get): it reads the store and AWS directly, not through the compute API.

Each command is a function that adds its sub-parser and sets ``handler`` to what runs it; a new
command (``ferry drain …``, say) is one more entry in :data:`COMMANDS`. A handler returns the
exit status.

Exit statuses: 0 success (for ``audit``: no problem left), 1 problems remain (or, for the set-up
commands of :mod:`ferry.cli_cells`, for ``ferry volume``, ``ferry image`` and ``ferry token``,
refused), 2 bad usage (an argument out of range, or a ``FERRY_*`` setting that cannot be read: one
line naming the variable), 3 could not run (a database that cannot be reached, or whose URL cannot be
read, a SQLite file whose directory cannot be made, or for ``ferry image`` the image bucket: one line
on standard error, passwords hidden). Any
other database error (two ``ferry cell create`` racing, say) is one line and 1.

Standard output is the command's answer (``ferry audit --json`` is read by programs): Ferry's log
lines go to standard error while a command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy.exc import ArgumentError, DatabaseError, DBAPIError, InterfaceError, OperationalError, ProgrammingError

from ferry import arguments, cli_cells, cli_drain, cli_images, cli_tokens, cli_volumes, config, errors
from ferry.audit import DEFAULT_GRACE_SECONDS

Handler = Callable[[argparse.Namespace], int]

# The exit status of a command that could not run: a database it cannot reach or whose URL it
# cannot read. Distinct from 1, which says what the command found (problems, a refusal).
EXIT_CANNOT_RUN = 3
# The exit status of a command whose settings cannot be read (a FERRY_* number that is no number): bad usage,
# as for a command line argparse refuses, or an image bucket ``ferry audit`` is not told.
EXIT_BAD_SETTING = 2
# The exit status of `ferry audit --strict` that found nothing but could not run every check.
EXIT_AUDIT_INCOMPLETE = 4
# A URL within a message (``scheme://`` up to a blank or a quote).
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")


def _run_audit(args: argparse.Namespace) -> int:
    from ferry import audit

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
    if not report.clean:
        return 1
    return EXIT_AUDIT_INCOMPLETE if args.strict and report.skipped else 0


def add_audit(commands: Any) -> None:
    parser = commands.add_parser(
        "audit", help="check Ferry's invariants (records, placement, hosts, images)",
        description="Check that servers, migrations, allocations, port bindings, volume attachments, the "
                    "hosts' guests and disks and the image bucket agree. Exit status 0 when clean, 1 when "
                    "problems remain, 3 when a database cannot be used, 4 with --strict when clean but a check "
                    "was skipped. See docs/reliability.md for each problem kind.")
    parser.add_argument("--fix", action="store_true",
                        help="repair what is safe (orphan allocations, bindings, attachments, temporary "
                             "snapshots and transfers, stale hidden copies, stuck migrations), then check again")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--grace", type=arguments.seconds, default=DEFAULT_GRACE_SECONDS, metavar="SECONDS",
                        help="leave records changed within this many seconds alone: a workflow may be between "
                             "two writes (default: %(default)g)")
    parser.add_argument("--no-storage", action="store_true",
                        help="skip the image bucket (temporary snapshots and disk transfers)")
    parser.add_argument("--strict", action="store_true",
                        help="exit 4 rather than 0 when nothing was found but a check could not run (its SKIPPED "
                             "line says which): for a scheduled run that must check everything")
    parser.set_defaults(handler=_run_audit)


# (name, adds the sub-parser): the commands of ``ferry``, in the order --help lists them.
COMMANDS: list[tuple[str, Callable[[Any], None]]] = [
    ("audit", add_audit),
    ("drain", cli_drain.add_drain),
    ("db", cli_cells.add_db),
    ("cell", cli_cells.add_cell),
    ("host", cli_cells.add_host),
    ("volume", cli_volumes.add_volume),
    ("image", cli_images.add_image),
    ("token", cli_tokens.add_token),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferry", description="Operate a Ferry cloud.")
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for _name, add in COMMANDS:
        add(commands)
    return parser


@contextmanager
def _logs_to_standard_error() -> Iterator[None]:
    """Ferry's log lines (the Powertools logger's) go to standard error until the block ends.

    Standard output is left to the command's answer. Only the process running ``ferry`` is
    concerned: the functions log to standard output as Lambda expects.
    """
    from ferry.observability import logger

    log_handler = logger.registered_handler
    if not isinstance(log_handler, logging.StreamHandler):
        yield
        return
    previous = log_handler.setStream(sys.stderr)  # None when it wrote there already
    try:
        yield
    finally:
        if previous is not None:
            log_handler.setStream(previous)


def _cannot_use_the_database(exc: Exception) -> bool:
    """Whether ``exc`` says the database cannot be used at all: unreachable, refusing the connection,
    no database (SQLite's "file is not a database" is a bare ``DatabaseError``), no schema, no
    permission or an option PostgreSQL does not know (``ProgrammingError``), or a URL that cannot
    be read. Any other database error (a constraint two commands racing broke, say) is the
    command's own: refused."""
    return isinstance(exc, (OperationalError, InterfaceError, ProgrammingError, ArgumentError)) \
        or type(exc) is DatabaseError


def _first_line(exc: BaseException) -> str:
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(cause).strip().splitlines()
    return lines[0] if lines else type(cause).__name__


def _without_passwords(message: str, args: argparse.Namespace) -> str:
    """``message`` with the password of every database URL in it hidden (:func:`ferry.cli_cells.hidden_url`):
    the URLs the command was given, verbatim (a URL that cannot be parsed may be quoted whole), and
    any other ``scheme://`` one."""
    for url in (os.environ.get("FERRY_API_DATABASE_URL"), getattr(args, "database_url", None)):
        if url and url.strip():
            message = message.replace(url.strip(), cli_cells.hidden_url(url.strip()))
    return _URL_IN_TEXT.sub(lambda found: cli_cells.hidden_url(found[0]), message)


def _driver_missing(exc: ImportError) -> bool:
    """Whether ``exc`` is SQLAlchemy failing to import the driver a database URL names
    (``postgresql://`` names psycopg 3, which Ferry does not install)."""
    dialects = os.path.join("sqlalchemy", "dialects", "")
    return any(dialects in frame.filename for frame in traceback.extract_tb(exc.__traceback__))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ferry`` with ``argv`` (default: the process's arguments); returns the exit status.

    A ``FERRY_*`` setting that cannot be read (a number setting that is no number) ends the
    command with one line naming the variable and :data:`EXIT_BAD_SETTING`.

    A database that cannot be reached, or whose URL cannot be read or names a driver that is not
    installed, ends the command with one line on standard error (passwords hidden) and
    :data:`EXIT_CANNOT_RUN`. Any other database error (two commands racing, say) is one line
    too, and exit status 1: refused. Never a traceback, whose statement parameters may hold a
    database URL with its password.
    """
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    with _logs_to_standard_error():
        try:
            if args.command not in ("drain", "image") and not os.environ.get("FERRY_API_DATABASE_URL"):
                # Not an error (a local stack's state directory holds its databases), but an export lost in
                # a new shell would otherwise write a deployment's records into a file nobody reads.
                print(f"ferry: FERRY_API_DATABASE_URL is not set: using {config.get().api_database_url}",
                      file=sys.stderr)
            return handler(args)
        except errors.SettingInvalid as exc:
            print(f"ferry: {exc.message}", file=sys.stderr)
            return EXIT_BAD_SETTING
        except (DBAPIError, ArgumentError) as exc:
            line = _without_passwords(_first_line(exc), args)
            if not _cannot_use_the_database(exc):
                print(f"ferry: the database refused it: {line}", file=sys.stderr)
                return 1
            print(f"ferry: cannot use the database: {line}", file=sys.stderr)
            return EXIT_CANNOT_RUN
        except ImportError as exc:
            if not _driver_missing(exc):
                raise
            print(f"ferry: cannot use the database: its URL names a driver that is not installed ({exc}); "
                  f"Ferry installs psycopg2: postgresql+psycopg2://…", file=sys.stderr)
            return EXIT_CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main())
