"""``ferry token``: the API tokens clients send in ``X-Auth-Token``, issued and revoked by an operator.

Ferry has no identity service: a token stands for a user in a project with roles, and only its
SHA-256 is kept (:mod:`ferry.auth`).

- ``ferry token issue --user U --project P [--role R …] [--expires-in DURATION | --no-expiry]``:
  a new token, printed once on standard output (nothing can show it again); it expires after
  30 days unless told otherwise;
- ``ferry token list [--user U] [--project P]``: the tokens kept, by record id, never their values;
- ``ferry token revoke ID …``, ``--user U [--project P]``, ``--project P``, ``--expired`` or
  ``--stdin`` (token values, one per line), one of these at a time: forgotten at once (the
  authorizer caches nothing).

Exit statuses: 0 success, 1 refused (the reason on standard error), 2 bad usage, 3 could not run
(a database that cannot be used: see :mod:`ferry.cli`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from typing import Any

from ferry import arguments

# A token nobody said how long to keep is kept 30 days; none longer than ten years.
DEFAULT_EXPIRES_IN = dt.timedelta(days=30)
MAX_EXPIRES_IN = dt.timedelta(days=3650)
_DURATION = re.compile(r"(\d{1,9})([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# A user's or project's id as a token takes it (ferry.auth.IDENTITY_ID): one the identity API finds.
_ID_RULE = "1 to 255 letters, digits, _ . @ or -"


def duration(text: str) -> dt.timedelta:
    """A lifetime: a whole number of seconds, or of minutes, hours or days (``90m``, ``12h``, ``30d``)."""
    found = _DURATION.fullmatch(text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is no duration (a whole number with s, m, h or d: 12h, 30d)")
    lifetime = dt.timedelta(seconds=int(found[1]) * _UNIT_SECONDS[found[2]])
    if not dt.timedelta(minutes=1) <= lifetime <= MAX_EXPIRES_IN:
        raise argparse.ArgumentTypeError(f"a token lives from one minute to {MAX_EXPIRES_IN.days} days")
    return lifetime


def _when(moment: dt.datetime | None) -> str:
    return "never" if moment is None else moment.replace(microsecond=0).isoformat() + "Z"


def _run_issue(args: argparse.Namespace) -> int:
    from ferry import auth, errors
    from ferry.store.api_models import utcnow

    expires_at = None if args.no_expiry else utcnow() + args.expires_in
    roles = args.role or ["member"]
    try:
        token = auth.issue_token(args.user, args.project, roles, expires_at=expires_at)
    except errors.FerryError as exc:
        print(f"ferry: {exc.message}", file=sys.stderr)
        return 1
    print(token)
    print(f"ferry: token for user {args.user} in project {args.project}, roles {','.join(roles)}, "
          f"expires {_when(expires_at)}; it is shown only now", file=sys.stderr)
    return 0


def _run_list(args: argparse.Namespace) -> int:
    from ferry import auth

    print("\t".join(("id", "user", "project", "roles", "expires", "created")))
    for record in auth.list_tokens(user_id=args.user, project_id=args.project):
        expires = _when(record.expires_at) + (" (expired)" if record.expired else "")
        print("\t".join((str(record.id), record.user_id, record.project_id, ",".join(record.roles) or "-",
                         expires, _when(record.created_at))))
    return 0


def _run_revoke(args: argparse.Namespace) -> int:
    from ferry import auth

    # One way of naming tokens at a time: combined, they would add up (ids *and* a user's), which
    # reads as narrowing; only --user and --project narrow each other.
    chosen = [bool(args.ids), args.stdin, args.expired, args.user is not None or args.project is not None]
    if sum(chosen) != 1:
        print("ferry token revoke: say which tokens, one way: record ids, --user and/or --project, --expired "
              "or --stdin", file=sys.stderr)
        return 2
    tokens = [line.strip() for line in sys.stdin if line.strip()] if args.stdin else []
    if args.stdin and not tokens:
        print("ferry: no token on standard input", file=sys.stderr)
        return 1
    count = auth.revoke_tokens(ids=args.ids, tokens=tokens, user_id=args.user, project_id=args.project,
                               expired=args.expired)
    print(f"{count} token{'s' if count != 1 else ''} revoked")
    return 0


def add_token(commands: Any) -> None:
    parser = commands.add_parser("token", help="issue, list and revoke API tokens",
                                 description="A token stands for a user in a project with roles; clients send "
                                             "it in X-Auth-Token. Only its SHA-256 is kept.")
    sub = parser.add_subparsers(dest="token_command", metavar="<token command>", required=True)

    issue = sub.add_parser("issue", help="make a token and print it (once)")
    issue.add_argument("--user", required=True, help="the user id it stands for (" + _ID_RULE + ")")
    issue.add_argument("--project", required=True, help="the project id it stands for (" + _ID_RULE + ")")
    issue.add_argument("--role", action="append", metavar="ROLE",
                       help="a role (repeat for several; in any case): admin makes an administrator, reader alone "
                            "a read-only member, any other a member (default: member)")
    lifetime = issue.add_mutually_exclusive_group()
    lifetime.add_argument("--expires-in", type=duration, default=DEFAULT_EXPIRES_IN, metavar="DURATION",
                          help="how long it is valid: seconds, or 90m, 12h, 30d (default: 30d)")
    lifetime.add_argument("--no-expiry", action="store_true", help="valid until revoked")
    issue.set_defaults(handler=_run_issue)

    listing = sub.add_parser("list", help="the tokens kept (record ids, never the tokens)")
    listing.add_argument("--user", help="only this user's")
    listing.add_argument("--project", help="only this project's")
    listing.set_defaults(handler=_run_list)

    revoke = sub.add_parser("revoke", help="forget tokens: they are refused from the next request on")
    revoke.add_argument("ids", nargs="*", type=arguments.whole(1), metavar="ID", help="record ids, as listed")
    revoke.add_argument("--user", help="every token of this user (in --project, when given)")
    revoke.add_argument("--project", help="every token in this project (of --user, when given)")
    revoke.add_argument("--expired", action="store_true", help="every expired token")
    revoke.add_argument("--stdin", action="store_true",
                        help="the tokens read from standard input, one per line (kept out of the shell's history)")
    revoke.set_defaults(handler=_run_revoke)

