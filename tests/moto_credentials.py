"""The region and placeholder credentials botocore needs to sign requests to moto (no AWS account is reached)."""

from __future__ import annotations

import pytest

REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION}


def use_moto_credentials(monkeypatch: pytest.MonkeyPatch, endpoint: str | None = None) -> None:
    """Set :data:`CREDENTIALS`; send calls to ``endpoint`` (a moto server), or in-process when None."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    if endpoint is None:
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
