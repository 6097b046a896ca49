"""What a server list asks for, and how a server is matched and ordered (Nova's semantics).

The HTTP layer parses the query into :class:`ServerFilters` (which filters a caller may use,
and from which microversion, is decided there); :func:`ferry.compute.api.list_servers` reads
the candidates and keeps those :func:`matches` accepts, in :func:`order`.

- ``name`` is a regular expression searched anywhere in the name; so are ``ip`` and ``ip6`` in
  the fixed addresses (IPv4 and IPv6), and a server matching either is kept. The admins'
  ``display_name``, ``hostname`` and ``display_description`` are searched the same way; a server
  without a hostname or description does not match.
- ``read_deleted`` is Nova's: ``no`` lists live servers, ``only`` deleted ones, ``yes`` both
  (what a list with ``changes-since``/``changes-before`` gets, so that a client polling for
  changes sees deletions).
- ``flavor`` and ``image`` are ids (or hrefs); a flavor that does not exist matches nothing.
- ``changes_since``/``changes_before`` compare the time of the server's last change (its
  creation when it never changed), both ends included.
- ``tags`` needs every tag, ``tags_any`` one of them; ``not_tags`` refuses servers that have
  every tag, ``not_tags_any`` servers that have any.
- ``sort`` is ``(key, direction)`` pairs; creation time and uuid, in the first direction,
  break ties. Unset values sort first when ascending.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import regex

from ferry import errors

if TYPE_CHECKING:
    from ferry.compute.api import Server

# How long the regular expressions of one list may take to match, all servers together: a caller's
# expression must not hold a function (and the concurrency every tenant shares) for its timeout.
MATCH_SECONDS = 1.0


@dataclass
class MatchBudget:
    """The time the patterns of one list share, counted from their first search."""

    seconds: float | None = None  # None: MATCH_SECONDS
    _deadline: float | None = field(default=None, repr=False)

    def remaining(self) -> float:
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + (MATCH_SECONDS if self.seconds is None else self.seconds)
        return self._deadline - now


# A quantifier in Python's syntax: ``{m}``, ``{m,}``, ``{,n}``, ``{m,n}``.
_QUANTIFIER = re.compile(r"\{(?:\d+(?:,\d*)?|,\d+)\}")


def _literal_braces(expression: str) -> str:
    """``expression`` with every ``{`` that Python reads as a character, not as a quantifier,
    escaped, and every ``[`` within a set: the ``regex`` engine reads some of those (``{e}``,
    ``{s<=1}``) as fuzzy matching, and ``[:digit:]`` in a set as a POSIX class."""
    out: list[str] = []
    index, in_class = 0, False
    while index < len(expression):
        char = expression[index]
        if char == "\\":
            out.append(expression[index:index + 2])
            index += 2
            continue
        if in_class:
            in_class = char != "]"
            if char == "[":  # a character to Python; the start of a POSIX class ("[:digit:]") to regex
                char = "\\["
        elif char == "[":
            in_class = True
            # A "]" right after "[" or "[^" is a member of the class, not its end.
            ahead = 2 if expression.startswith("[^", index) else 1
            if expression.startswith("]", index + ahead):
                out.append(expression[index:index + ahead + 1])
                index += ahead + 1
                continue
        elif char == "{" and not _QUANTIFIER.match(expression, index):
            char = "\\{"
        out.append(char)
        index += 1
    return "".join(out)


class SearchPattern:
    """A filter's regular expression (Python's syntax, as Nova's on SQLite), searched anywhere in a
    value within a :class:`MatchBudget` (the ``regex`` engine stops a search at its timeout).

    Raises (when made):
        BadRequest: not a regular expression.
    """

    def __init__(self, name: str, expression: str, budget: MatchBudget) -> None:
        self.name, self.expression, self._budget = name, expression, budget
        try:
            re.compile(expression)  # Python's syntax decides what is an expression
            self._compiled = regex.compile(_literal_braces(expression))
        except (re.error, regex.error) as exc:
            raise errors.BadRequest(f"Invalid {name} filter {expression!r}: {exc}.") from exc

    def search(self, value: str) -> bool:
        """Whether the expression is found in ``value``.

        Raises:
            BadRequest: the list's searches ran out of time (an expression that backtracks).
        """
        remaining = self._budget.remaining()
        try:
            if remaining <= 0:
                raise TimeoutError
            return self._compiled.search(value, timeout=remaining) is not None
        except TimeoutError:
            raise errors.BadRequest(f"The {self.name} filter {self.expression!r} takes too long to match: "
                                    f"give a simpler expression.") from None

# Sort keys Ferry orders by (Nova's names); host and node are for admins only.
SORT_KEYS: Mapping[str, Callable[[Server], Any]] = {
    "created_at": lambda s: s.created_at,
    "updated_at": lambda s: s.updated_at or s.created_at,
    "display_name": lambda s: s.name,
    "uuid": lambda s: s.uuid,
    "host": lambda s: s.host,
    "node": lambda s: s.node,
    "vm_state": lambda s: s.vm_state,
    "task_state": lambda s: s.task_state,
    "power_state": lambda s: s.power_state,
    "launched_at": lambda s: s.launched_at,
    "terminated_at": lambda s: s.terminated_at,
    "key_name": lambda s: s.key_name,
    "availability_zone": lambda s: s.availability_zone,
    "user_id": lambda s: s.user_id,
    "project_id": lambda s: s.project_id,
    "hostname": lambda s: s.hostname,
    "display_description": lambda s: s.description,
    "locked": lambda s: s.locked,  # from 2.73
}
ADMIN_SORT_KEYS = frozenset({"host", "node"})
# Which servers a list reads, by whether they are deleted (Nova's ``read_deleted``).
ReadDeleted = Literal["no", "yes", "only"]
SORT_DIRECTIONS = ("asc", "desc")


@dataclass(frozen=True)
class ServerFilters:
    """A server list's filters, paging and order; None (or empty) leaves a filter out."""

    name: SearchPattern | None = None
    display_name: SearchPattern | None = None
    hostname: SearchPattern | None = None
    description: SearchPattern | None = None
    read_deleted: ReadDeleted = "no"
    all_tenants: bool = False
    project_id: str | None = None
    user_id: str | None = None
    host: str | None = None
    node: str | None = None
    uuid: str | None = None
    reservation_id: str | None = None
    flavor: str | None = None
    image: str | None = None
    availability_zone: str | None = None
    key_name: str | None = None
    vm_states: frozenset[str] | None = None
    task_states: frozenset[str] | None = None
    power_states: frozenset[int] | None = None
    locked: bool | None = None
    changes_since: dt.datetime | None = None
    changes_before: dt.datetime | None = None
    ip: SearchPattern | None = None
    ip6: SearchPattern | None = None
    tags: frozenset[str] | None = None
    tags_any: frozenset[str] | None = None
    not_tags: frozenset[str] | None = None
    not_tags_any: frozenset[str] | None = None
    sort: tuple[tuple[str, str], ...] = ()
    limit: int | None = None
    marker: str | None = None

    @property
    def by_tags(self) -> bool:
        return any(t is not None for t in (self.tags, self.tags_any, self.not_tags, self.not_tags_any))

    @property
    def by_address(self) -> bool:
        return self.ip is not None or self.ip6 is not None


def _ref_id(ref: str) -> str:
    """The id in a reference that may be an href (``…/images/<id>``) or a bare id."""
    return ref.rstrip("/").rsplit("/", 1)[-1]


def _same_ref(ref: str | None, wanted: str) -> bool:
    return ref is not None and _ref_id(ref) == wanted


def matches(server: Server, filters: ServerFilters, *, flavor_id: int | None = None,
            addresses: Mapping[str, Iterable[str]] | None = None) -> bool:
    """Whether ``server`` passes ``filters``.

    ``flavor_id`` is the internal id of the flavor ``filters.flavor`` names; ``addresses`` the
    fixed addresses of each server (needed for ``ip``/``ip6``). ``server.tags`` must be loaded
    when filtering by tags.
    """
    f = filters
    exact = ((f.user_id, server.user_id), (f.host, server.host), (f.node, server.node), (f.uuid, server.uuid),
             (f.availability_zone, server.availability_zone), (f.key_name, server.key_name),
             (f.reservation_id, server.reservation_id))
    if any(wanted is not None and value != wanted for wanted, value in exact):
        return False
    among = ((f.vm_states, server.vm_state), (f.task_states, server.task_state), (f.power_states, server.power_state))
    if any(allowed is not None and value not in allowed for allowed, value in among):
        return False
    searched = ((f.name, server.name), (f.display_name, server.name), (f.hostname, server.hostname),
                (f.description, server.description))
    if any(pattern is not None and (value is None or not pattern.search(value)) for pattern, value in searched):
        return False
    if f.flavor is not None and server.flavor.get("id") != flavor_id:
        return False
    if f.image is not None and not _same_ref(server.image_ref, _ref_id(f.image)):
        return False
    if f.locked is not None and server.locked != f.locked:
        return False
    changed = server.updated_at or server.created_at
    if f.changes_since is not None and changed < f.changes_since:
        return False
    if f.changes_before is not None and changed > f.changes_before:
        return False
    if f.by_address and not _address_matches(list((addresses or {}).get(server.uuid, ())), f.ip, f.ip6):
        return False
    return not f.by_tags or _tags_match(set(server.tags), f)


def _address_matches(addresses: list[str], ip: SearchPattern | None, ip6: SearchPattern | None) -> bool:
    """Whether ``ip`` is found in an IPv4 address, or ``ip6`` in an IPv6 one (Nova keeps either)."""
    for address in addresses:
        pattern = ip6 if ":" in address else ip
        if pattern is not None and pattern.search(address):
            return True
    return False


def _tags_match(have: set[str], f: ServerFilters) -> bool:
    return ((f.tags is None or f.tags <= have)
            and (f.tags_any is None or bool(f.tags_any & have))
            and (f.not_tags is None or not f.not_tags <= have)
            and (f.not_tags_any is None or not f.not_tags_any & have))


def order(servers: Iterable[Server], sort: tuple[tuple[str, str], ...]) -> list[Server]:
    """``servers`` in the order ``sort`` asks for; newest first when it asks for none."""
    keys = list(sort) or [("created_at", "desc")]
    first_direction = keys[0][1]
    keys += [(k, first_direction) for k in ("created_at", "uuid") if k not in {key for key, _ in keys}]
    ordered = list(servers)
    for key, direction in reversed(keys):  # stable sorts, the least significant key first
        ordered.sort(key=_sortable(SORT_KEYS[key]), reverse=direction == "desc")
    return ordered


def _sortable(value: Callable[[Server], Any]) -> Callable[[Server], tuple[bool, Any]]:
    """A sort key from ``value`` that puts unset values before every set one (ascending)."""
    def key(server: Server) -> tuple[bool, Any]:
        found = value(server)
        return (found is not None, found if found is not None else 0)
    return key
