"""API microversions: parsing the request headers and naming the version used.

A compute request may name its version in ``OpenStack-API-Version: compute X`` or in the older
``X-OpenStack-Nova-API-Version: X`` (the first wins); without either it gets the minimum.
``latest`` means the maximum. Every response names the version used in both headers and
lists them in ``Vary``. The volume look-ups (``/volume/v3``) serve one version, 3.0, named in
``OpenStack-API-Version: volume X`` the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from ferry import errors

SERVICE = "compute"
VOLUME_SERVICE = "volume"
HEADER = "OpenStack-API-Version"
LEGACY_HEADER = "X-OpenStack-Nova-API-Version"

_VERSION_RE = re.compile(r"^([1-9]\d*)\.([1-9]\d*|0)$")


class APIVersion(NamedTuple):
    """A microversion; tuples compare the way versions do (2.9 < 2.10)."""

    major: int
    minor: int

    @classmethod
    def parse(cls, text: str) -> APIVersion:
        """Parse ``"2.37"``.

        Raises:
            BadRequest: not of the form ``Major.Minor``.
        """
        match = _VERSION_RE.match(text.strip())
        if match is None:
            raise errors.BadRequest(f"API Version String {text} is of invalid format. "
                                    f"Must be of format MajorNum.MinorNum.")
        return cls(int(match.group(1)), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    def at_least(self, text: str) -> bool:
        """Whether this version is ``text`` or newer."""
        return self >= APIVersion.parse(text)


MIN_VERSION = APIVersion(2, 1)
MAX_VERSION = APIVersion(2, 96)
VOLUME_VERSION = APIVersion(3, 0)
# The versions each service serves, oldest and newest.
_RANGES = {SERVICE: (MIN_VERSION, MAX_VERSION), VOLUME_SERVICE: (VOLUME_VERSION, VOLUME_VERSION)}


def _header(headers: Mapping[str, str], name: str) -> str | None:
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def requested_version(headers: Mapping[str, str] | None, service: str = SERVICE) -> str | None:
    """The version of ``service`` a request names, as written, or None when it names none."""
    headers = headers or {}
    combined = _header(headers, HEADER)
    if combined:
        for item in combined.split(","):
            parts = item.strip().split(None, 1)
            if len(parts) == 2 and parts[0].lower() == service:
                return parts[1].strip()
    legacy = _header(headers, LEGACY_HEADER) if service == SERVICE else None
    return legacy.strip() if legacy and legacy.strip() else None


def negotiate(headers: Mapping[str, str] | None, service: str = SERVICE) -> APIVersion:
    """The version of ``service`` a request gets.

    Raises:
        BadRequest: the version is malformed.
        NotAcceptable: the version is outside what the service serves.
    """
    minimum, maximum = _RANGES[service]
    text = requested_version(headers, service)
    if text is None:
        return minimum
    if text.lower() == "latest":
        return maximum
    version = APIVersion.parse(text)
    if not minimum <= version <= maximum:
        raise errors.NotAcceptable(f"Version {version} is not supported by the API. "
                                   f"Minimum is {minimum} and maximum is {maximum}.")
    return version


def response_headers(version: APIVersion, service: str = SERVICE) -> dict[str, str]:
    """The headers that name the version a response was made with."""
    if service != SERVICE:
        return {HEADER: f"{service} {version}", "Vary": HEADER}
    return {HEADER: f"{SERVICE} {version}", LEGACY_HEADER: str(version), "Vary": f"{HEADER}, {LEGACY_HEADER}"}
