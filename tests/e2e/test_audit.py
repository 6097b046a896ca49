"""``ferry audit`` against the local stack: clean after a boot; a stray instance directory on a host and a
leftover temporary snapshot are found; clean again once they are gone.

What a host holds reaches the audit through its agent's inventory report (every minute), so the
test waits for a report sent after each change on the host.
"""

from __future__ import annotations

import datetime as dt
import uuid
from io import BytesIO
from typing import Any

import pytest
from sqlalchemy import select

from ferry import audit, hosts, images
from ferry.store.cell_models import Service
from ferry.store.db import cell_session

pytestmark = pytest.mark.e2e

# Agents report their inventory every 60 s; allow for one full period and the queue.
REPORT_WAIT = 150


def host_view(local_stack: Any, host: str) -> dict[str, Any] | None:
    with cell_session(local_stack.hosts[host]) as session:
        service = session.scalars(select(Service).where(Service.host == host)).one_or_none()
        return hosts.host_view(service) if service is not None else None


def wait_for_report(local_stack: Any, host: str, after: dt.datetime) -> dict[str, Any]:
    """The first view of ``host`` its agent sent after ``after`` (naive UTC)."""

    def fresh() -> dict[str, Any] | None:
        view = host_view(local_stack, host)
        return view if view is not None and hosts.report_time(view["sent_at"]) > after else None

    return local_stack.wait_for(fresh, timeout=REPORT_WAIT, interval=1)


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


def test_audit_is_clean_after_a_boot_and_finds_what_a_host_and_the_bucket_hold_for_nobody(local_stack, servers):
    server = servers.boot(name="audit-e2e")
    host = server["OS-EXT-SRV-ATTR:host"]
    view = wait_for_report(local_stack, host, now())
    assert server["id"] in view["guests"] and server["id"] in view["instance_dirs"]

    clean = audit.run_audit(grace_seconds=0)
    assert clean.clean, clean.describe()

    # GIVEN a directory nothing owns on the server's host and a snapshot no move made
    stray = str(uuid.uuid4())
    planted_at = now()
    (local_stack.instances_dir(host) / stray).mkdir()
    image = images.upload_image(BytesIO(b"leftover"), "audit-e2e-resize-temp")
    try:
        wait_for_report(local_stack, host, planted_at)

        # WHEN the audit runs THEN it finds both, and nothing else
        report = audit.run_audit(grace_seconds=0)
        assert {(p.kind, p.resource) for p in report.problems} == {
            (audit.INSTANCE_DIR_ORPHAN, f"host/{host}/dir/{stray}"),
            (audit.SNAPSHOT_IMAGE_ORPHAN, f"image/{image['id']}"),
        }, report.describe()
        assert not any(p.fixable for p in report.problems)
    finally:
        (local_stack.instances_dir(host) / stray).rmdir()
        images.delete_image(image["id"])

    removed_at = now()
    view = wait_for_report(local_stack, host, removed_at)
    assert stray not in view["instance_dirs"]
    audit.assert_consistent(grace_seconds=0)
