"""boto3 clients, one per service per process, pointed at AWS or at the local stack.

``AWS_ENDPOINT_URL`` (honoured by boto3 itself) points every client at the local stack.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import boto3
from botocore.config import Config

_clients: dict[str, Any] = {}
_lock = threading.Lock()


def client(service: str) -> Any:
    """A cached boto3 client for ``service`` in the configured region."""
    with _lock:
        existing = _clients.get(service)
        if existing is None:
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            existing = boto3.session.Session().client(
                service, region_name=region, config=Config(retries={"max_attempts": 5, "mode": "standard"})
            )
            _clients[service] = existing
        return existing


def reset() -> None:
    """Forget cached clients (after the endpoint or credentials changed)."""
    with _lock:
        _clients.clear()
