"""AWS clients, one per service per process, pointed at AWS or at the local stack.

The clients are botocore's: what every function calls is the service API, and loading boto3 (its
resource layer and S3 transfer manager) would lengthen each cold start for nothing. The one
operation that needs boto3, S3's managed upload, is :func:`upload_fileobj`. botocore itself is
loaded by the first :func:`client` call, so a function that never calls AWS never loads it.
``AWS_ENDPOINT_URL`` (honoured by botocore itself) points every client at the local stack.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import botocore.session


class Readable(Protocol):
    """What an upload reads from."""

    def read(self, size: int = -1) -> bytes: ...


_clients: dict[str, Any] = {}
_session: botocore.session.Session | None = None
# The loader of botocore's data files (service models, endpoints): it caches what it parsed, and
# what it reads never changes, so it outlives :func:`reset`.
_loader: Any = None
_lock = threading.Lock()


def client(service: str) -> Any:
    """A cached client for ``service`` in the configured region.

    The clients share one botocore session, so the service models and endpoint data it loads
    are read once per process, not once per service.
    """
    global _session, _loader
    with _lock:
        existing = _clients.get(service)
        if existing is None:
            import botocore.session  # loaded by the first client, not by importing this module
            from botocore.config import Config

            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            if _session is None:
                _session = botocore.session.get_session()
                if _loader is None:
                    _loader = _session.get_component("data_loader")
                else:
                    _session.register_component("data_loader", _loader)
            existing = _session.create_client(
                service, region_name=region, config=Config(retries={"max_attempts": 5, "mode": "standard"})
            )
            _clients[service] = existing
        return existing


def upload_fileobj(s3_client: Any, fileobj: Readable, bucket: str, key: str, **kwargs: Any) -> None:
    """Upload ``fileobj`` to ``bucket``/``key`` through S3's transfer manager (multipart, concurrent parts).

    ``s3_client`` may be any S3 client; ``kwargs`` are those of boto3's ``upload_fileobj``
    (``ExtraArgs``, ``Config``, ``Callback``).
    """
    from boto3.s3.inject import upload_fileobj as managed_upload  # loaded by the uploads alone

    managed_upload(s3_client, fileobj, bucket, key, **kwargs)


def abort_uploads(s3_client: Any, bucket: str, prefix: str, *, whole_key: bool = False) -> int:
    """Abort the multipart uploads under ``prefix`` that never completed; return how many.

    With ``whole_key``, only those of the object named ``prefix`` (S3 lists by prefix: the
    uploads of ``images/ab`` would take those of ``images/abc`` too).

    An uploader killed mid-way leaves its upload open, and S3 keeps (and bills) its parts until
    it is aborted; listing objects never shows them. The bucket's lifecycle rule aborts what is
    missed here.
    """
    aborted = 0
    for page in s3_client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        for upload in page.get("Uploads", []):
            if whole_key and upload["Key"] != prefix:
                continue
            s3_client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            aborted += 1
    return aborted


def reset() -> None:
    """Forget cached clients and their session (after the endpoint or credentials changed).

    The service models already parsed are kept: they do not depend on either.
    """
    global _session
    with _lock:
        _clients.clear()
        _session = None
