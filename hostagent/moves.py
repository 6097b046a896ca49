"""The host side of same-cell resize and cold migrate, their confirm and revert, and volume attach/detach.

A move runs on two hosts (or twice on one, for a resize to the same host):

- ``prep_resize`` at the destination: the resize claim for what placement does not model.
- ``resize_instance`` at the source: power off, undefine the guest (its disks stay), move the
  instance directory aside to ``<uuid>_resize`` and send the root and ephemeral disks to S3.
- ``finish_resize`` at the destination: rebuild the disks, grow them to the new flavor, create a
  fresh swap, define the guest with the new flavor and power it on if it was running.
- ``confirm_resize`` at the source: drop the kept disks (and any guest left there).
- ``revert_resize`` at the destination, then ``finish_revert_resize`` at the source: the
  destination forgets the instance; the source puts its kept disks back and defines the guest
  with the old flavor.

Each operation converges when run again, including after a crash part-way. A small record,
``migration.json`` in the instance directory, remembers what a re-run needs (whether the guest
was running, the checksums reported). docs/host-agent.md describes the operations in full.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aws_lambda_powertools.metrics import MetricUnit
from botocore.exceptions import BotoCoreError, ClientError

from ferry import aws, errors, protocol
from ferry.observability import logger
from hostagent import disks
from hostagent.driver import (
    EPHEMERAL,
    LOCAL_DEVICES,
    NOSTATE,
    ROOT,
    RUNNING,
    SWAP,
    VOLUME,
    DiskSpec,
    Driver,
    GuestSpec,
    PortSpec,
    place_local_disks,
)

if TYPE_CHECKING:
    from hostagent.agent import Operation

MOVE_RECORD = "migration.json"
# The spawn that made an instance directory (hostagent.agent), with the volume files it created.
SPAWN_RECORD = "spawn.json"
# In the spawn's record: the spawn failed, and the volume files it lists are left to remove.
SPAWN_UNDONE = "undone"
def volume_disks(volumes: list[dict[str, Any]], boot_from_volume: bool) -> list[DiskSpec]:
    """The guest disks of attached volumes; with ``boot_from_volume`` the lowest boot_index boots."""
    boot_volume = None
    if boot_from_volume and volumes:
        indexed = [v for v in volumes if v.get("boot_index") is not None]
        boot_volume = min(indexed, key=lambda v: v["boot_index"]) if indexed else volumes[0]
    return [
        DiskSpec(kind=VOLUME, path=v["path"], device=v["device"], volume_id=v["volume_id"], boot=v is boot_volume)
        for v in volumes
    ]


def guest_spec(instance_uuid: str, args: Mapping[str, Any], guest_disks: list[DiskSpec]) -> GuestSpec:
    """The guest to define from an operation's ``name``, ``flavor`` and ``ports`` args and its
    disks, the local ones placed around the volumes' devices (:func:`place_local_disks`)."""
    return GuestSpec(
        instance_uuid=instance_uuid,
        display_name=args["name"],
        flavor=args["flavor"],
        disks=place_local_disks(guest_disks),
        ports=tuple(PortSpec(port_id=p["id"], mac_address=p["mac_address"]) for p in args["ports"]),
    )


def read_record(directory: Path, name: str = MOVE_RECORD) -> dict[str, Any] | None:
    """The JSON record ``name`` in ``directory`` (None when it is missing or not a record)."""
    try:
        record = json.loads((directory / name).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(directory: Path, record: dict[str, Any], name: str = MOVE_RECORD) -> None:
    """Write the JSON record ``name`` in ``directory`` whole or not at all."""
    target = directory / name
    tmp = directory / f".{name}.tmp"
    with open(tmp, "w") as out:
        out.write(json.dumps(record))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)
    disks.sync_dir(directory)  # a host's answer says the step is done: what it wrote must outlast a crash


def _record_of(directory: Path, migration_uuid: str) -> dict[str, Any] | None:
    """The move record in ``directory`` if it belongs to ``migration_uuid``."""
    record = read_record(directory)
    return record if record is not None and record.get("migration_uuid") == migration_uuid else None


class MoveOperations:
    """Resize, cold migrate, confirm, revert and volume operations of :class:`hostagent.agent.HostAgent`.

    A mixin: the agent provides the attributes declared here.
    """

    host: str
    node: str
    driver: Driver
    s3: Any
    instances_dir: Path
    power_off_timeout: float
    disk_headroom_check: bool
    disk_overcommit_ratio: float
    direct_copies: bool

    def _result(self, instance_uuid: str, power_state: int) -> dict[str, Any]:
        raise NotImplementedError

    def _emit_metric(self, name: str, unit: MetricUnit, value: float, operation: str) -> None:
        raise NotImplementedError

    def remove_volumes_of_undone_spawn(self, instance_uuid: str, operation: str) -> bool:
        raise NotImplementedError

    def _power_state_here(self, instance_uuid: str) -> int:
        """The power state of the instance's guest on this host; NOSTATE when there is none."""
        if not self.driver.guest_exists(instance_uuid):
            return NOSTATE
        try:
            return self.driver.guest_power_state(instance_uuid)
        except errors.GuestNotFound:
            return NOSTATE

    # -- prep_resize (destination)

    def prep_resize(self, op: Operation) -> dict[str, Any]:
        """The destination's resize claim: memory and instance disk space for the new flavor.

        Placement has claimed VCPU, MEMORY_MB and DISK_GB already; this checks what the
        hypervisor and the filesystem really have. The disk space is the flavor's root (unless
        ``is_bfv``: a volume-backed server has no root disk here, as placement counts it),
        ephemeral and swap disks. Nothing is reserved or written. Unless the
        move stays on this host (or ``direct_copies`` is off), the result offers this host's
        instances directory (``direct``: its path and this host's token) for the source to copy
        the disks into, should it see the same storage.

        Raises:
            ResizeClaimFailed: the memory of the guests defined here, or the free space of the
                instances filesystem, leaves too little for the new flavor.
            HypervisorError.
        """
        uuid, flavor = op.instance_uuid, op.args["flavor"]
        self._claim_memory(uuid, flavor)
        if self.disk_headroom_check:
            self._claim_disk(uuid, flavor, is_bfv=bool(op.args.get("is_bfv", False)))
        result = {**self._result(uuid, self._power_state_here(uuid)), "claimed": True}
        if self.direct_copies and not op.args["same_host"]:
            try:
                self.instances_dir.mkdir(parents=True, exist_ok=True)
                token = disks.host_token(self.instances_dir, self.host)
            except OSError as exc:
                logger.warning("no direct copies into this host", extra={"host": self.host, "error": str(exc)})
            else:
                result["direct"] = {"instances_dir": str(self.instances_dir.resolve()), "token": token}
        return result

    def _claim_memory(self, instance_uuid: str, flavor: dict[str, Any]) -> None:
        capacity = self.driver.host_capacity().memory_mb
        used = 0
        for guest in self.driver.list_guests():
            if guest == instance_uuid:
                continue  # on the same host the instance's own guest is replaced, not added to
            try:
                used += self.driver.guest_memory_mb(guest)
            except errors.GuestNotFound:
                continue  # undefined since it was listed
        free = capacity - used
        if free < flavor["memory_mb"]:
            raise errors.ResizeClaimFailed(
                f"Host {self.host} has {free} MiB of memory left for guests ({capacity} MiB, {used} MiB defined); "
                f"flavor {flavor['name']} needs {flavor['memory_mb']} MiB.",
                instance_uuid=instance_uuid,
                host=self.host,
            )

    def _claim_disk(self, instance_uuid: str, flavor: dict[str, Any], *, is_bfv: bool) -> None:
        root_gb = 0 if is_bfv else flavor["root_gb"]
        full = root_gb * disks.GiB + flavor["ephemeral_gb"] * disks.GiB + flavor["swap"] * disks.MiB
        needed = math.ceil(full / self.disk_overcommit_ratio)
        self.instances_dir.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(self.instances_dir)
        free = st.f_bavail * st.f_frsize
        if free < needed:
            raise errors.ResizeClaimFailed(
                f"Host {self.host} has {free // disks.MiB} MiB free for instance disks; flavor {flavor['name']} "
                f"needs {needed // disks.MiB} MiB (its disks fully written, overcommit ratio "
                f"{self.disk_overcommit_ratio:g}).",
                instance_uuid=instance_uuid,
                host=self.host,
            )

    # -- resize_instance (source)

    def resize_instance(self, op: Operation) -> dict[str, Any]:
        """Stop the guest, undefine it keeping its disks, move the disks aside and send them.

        The instance directory becomes ``<uuid>_resize``. Unless the move stays on this host, the
        root disk (if any: a volume-backed server has none) and the ephemeral disk (if any) are
        sent to the transfer prefix; swap is never sent. A re-run after the disks were moved aside
        only sends them again.

        Raises:
            GuestNotFound: this host has neither the guest nor its disks.
            DiskCopyFailed: reading a disk or the upload failed.
            HypervisorError.
        """
        uuid, args = op.instance_uuid, op.args
        migration = args["migration_uuid"]
        kept, record = self._set_aside(op)
        sent: dict[str, dict[str, Any]] = {}
        incoming = None if args["same_host"] else self._direct_target(op)
        for kind in protocol.MOVED_DISKS:
            path = kept / disks.DISK_FILES[kind]
            if not path.exists():
                continue
            if args["same_host"]:
                # The destination copies from the kept directory; the checksum lets it verify the copy.
                try:
                    sent[kind] = {"sha256": disks.file_digest(path, protocol.MOVE_DIGEST),
                                  "size": path.stat().st_size, "digest": protocol.MOVE_DIGEST}
                except OSError as exc:
                    raise errors.DiskCopyFailed(f"Reading {path} failed: {exc}", instance_uuid=uuid) from exc
                continue
            if incoming is not None:
                moved = disks.copy_to_host(path, incoming / disks.DISK_FILES[kind])
            else:
                transfer = args["transfer"]
                moved = disks.upload_disk(self.s3, path, transfer["bucket"], transfer["prefix"], kind,
                                          algorithm=protocol.MOVE_DIGEST)
            self._emit_metric("DiskBytesSent", MetricUnit.Bytes, moved.data_bytes, op.name)
            logger.info(
                "disk sent",
                extra={
                    "host": self.host,
                    "instance_uuid": uuid,
                    "migration_uuid": migration,
                    "dest_host": args["dest_host"],
                    "disk": kind,
                    "size": moved.size,
                    "data_bytes": moved.data_bytes,
                    "direct": incoming is not None,
                },
            )
            sent[kind] = {"sha256": moved.sha256, "size": moved.size, "digest": moved.digest}
        result = {**self._result(uuid, NOSTATE), "was_running": bool(record["was_running"]), "disks": sent}
        if incoming is not None:
            result["direct"] = True
        return result

    def _direct_target(self, op: Operation) -> Path | None:
        """The destination's directory for this instance's incoming disks, if this host sees its storage.

        The destination offered its instances directory and token at ``prep_resize``; when the
        marker there holds the same, the disks are copied straight in (created here, emptied of
        an earlier attempt). Otherwise, or when the directory cannot be prepared, None: the
        disks go through the transfer.
        """
        uuid, offer = op.instance_uuid, op.args.get("direct")
        if not offer or not disks.reaches(offer["instances_dir"], op.args["dest_host"], offer["token"]):
            return None
        incoming = disks.incoming_dir(offer["instances_dir"], uuid)
        try:
            disks.remove_dir(incoming)
            disks.make_dir(incoming)
        except OSError as exc:
            logger.warning("copying directly failed to start; sending through the transfer",
                           extra={"host": self.host, "instance_uuid": uuid, "path": str(incoming), "error": str(exc)})
            return None
        return incoming

    def _set_aside(self, op: Operation) -> tuple[Path, dict[str, Any]]:
        """The guest's directory moved aside for this migration (done now unless an earlier run did), and its record."""
        kept = disks.resize_dir(self.instances_dir, op.instance_uuid)
        record = _record_of(kept, op.args["migration_uuid"])
        return kept, record if record is not None else self._move_aside(op, kept)

    def _move_aside(self, op: Operation, kept: Path) -> dict[str, Any]:
        """Power off and undefine the guest, and rename its directory to ``kept``; return the move record."""
        uuid, args = op.instance_uuid, op.args
        migration = args["migration_uuid"]
        live = disks.instance_dir(self.instances_dir, uuid)
        if kept.exists() and not live.exists():
            raise errors.GuestNotFound(
                f"Instance {uuid} has no disks on {self.host} except those kept for another move ({kept}).",
                instance_uuid=uuid,
            )
        record = _record_of(live, migration)
        guest = self.driver.guest_exists(uuid)
        if not guest and record is None:
            # Checked before anything is removed: the kept disks may be the instance's only good ones.
            raise errors.GuestNotFound(f"No guest for instance {uuid} on {self.host}.", instance_uuid=uuid)
        if kept.exists():
            # Left by an earlier move that was never cleaned up; the live directory is the current one.
            logger.warning(
                "removing disks kept for an earlier move",
                extra={"host": self.host, "instance_uuid": uuid, "path": str(kept), "record": read_record(kept)},
            )
            disks.remove_dir(kept)
        if guest:
            if record is None:
                # Written before the guest is touched: a re-run after the power off still knows it ran.
                live.mkdir(parents=True, exist_ok=True)
                record = {
                    "migration_uuid": migration,
                    "was_running": self.driver.guest_power_state(uuid) == RUNNING,
                }
                write_record(live, record)
            self.driver.power_off(
                uuid,
                timeout=float(args.get("timeout", self.power_off_timeout)),
                clean_shutdown=bool(args.get("clean_shutdown", True)),
            )
            # Undefining unplugs the guest's ports and disconnects its volumes; the disks stay.
            self.driver.destroy(uuid)
        assert record is not None  # written above for a guest, found otherwise
        try:
            os.rename(live, kept)
        except OSError as exc:
            raise errors.HostOperationFailed(
                f"Moving the disks of instance {uuid} aside to {kept} failed: {exc}", instance_uuid=uuid
            ) from exc
        disks.sync_dir(self.instances_dir)
        return record

    # -- finish_resize (destination)

    def finish_resize(self, op: Operation) -> dict[str, Any]:
        """Rebuild the disks here, grow them to the new flavor and define the guest with it.

        The disks come from the transfer (checked against its manifest and the ``disks``
        argument) or, on the same host, from the kept directory. Swap is created afresh. The
        guest is powered on only if ``power_on``. Once the guest is defined the transfer objects
        are deleted, and so is the instance's ``<uuid>_incoming`` here, however the disks came
        (an earlier attempt of the source may have copied directly, a later one through the
        transfer). A guest that exists already is this operation done before when the live
        directory's record names this move with its disks; any other is an earlier operation's
        leftover and is destroyed first (on the same host, where it could be the server's own,
        the operation fails instead).

        On failure nothing of the instance is left here (guest undefined, new directory
        removed); the source's disks and the transfer are never touched.

        Raises:
            DiskCopyFailed: a disk is missing, corrupt or cannot be written.
            InvalidOperation: the instance would have no boot disk.
            HypervisorError.
        """
        uuid, args = op.instance_uuid, op.args
        live = disks.instance_dir(self.instances_dir, uuid)
        kept = disks.resize_dir(self.instances_dir, uuid)
        if self.driver.guest_exists(uuid):
            record = _record_of(live, args["migration_uuid"])
            if record is not None and "disks" in record:  # this operation, done before
                if args["power_on"]:
                    self.driver.power_on(uuid)
                self._drop_what_was_sent(op)
                return {**self._result(uuid, self.driver.guest_power_state(uuid)), "disks": record["disks"]}
            self._destroy_leftover_guest(op)
        if args["same_host"] and not kept.exists():
            # Without the kept directory the live one may be the instance's only copy: never remove it.
            raise errors.DiskCopyFailed(
                f"The disks of instance {uuid} were not moved aside on {self.host}: nothing to resize from.",
                instance_uuid=uuid,
            )
        try:
            disks.remove_dir(live)  # what an interrupted attempt left
            disks.make_dir(live)
            # Names the move before any disk comes in: what an attempt cut short left is known as its own.
            write_record(live, {"migration_uuid": args["migration_uuid"]})
            received = self._receive_disks(op, live, kept)
            local = self._prepare_local_disks(uuid, live, args["flavor"])
            checksums = self._disk_checksums(uuid, live, received)
            write_record(live, {"migration_uuid": args["migration_uuid"], "disks": checksums})
            self._define(uuid, args, local)
            if args["power_on"]:
                self.driver.power_on(uuid)
            result = {**self._result(uuid, self.driver.guest_power_state(uuid)), "disks": checksums}
        except Exception:
            self._forget_here(op, live)
            raise
        self._drop_what_was_sent(op)
        return result

    def _destroy_leftover_guest(self, op: Operation) -> None:
        """Destroy a guest that an earlier operation left on this destination (its disks go with the
        live directory next).

        Raises:
            HostOperationFailed: the move stays on this host, where the guest may be the server's own.
            HypervisorError.
        """
        uuid = op.instance_uuid
        if op.args["same_host"]:
            raise errors.HostOperationFailed(
                f"Instance {uuid} has a guest on {self.host} that this move did not define; it is left alone.",
                instance_uuid=uuid,
            )
        logger.warning(
            "destroying a guest an earlier operation left",
            extra={"host": self.host, "instance_uuid": uuid, "operation": op.name,
                   "migration_uuid": op.args["migration_uuid"]},
        )
        self.driver.destroy(uuid)

    def _drop_what_was_sent(self, op: Operation) -> None:
        """Once the guest is defined on its disks: remove the instance's incoming directory here and the transfer.

        The incoming directory goes whether or not this move's disks came through it: an attempt
        of the source cut short may have copied into it before another sent the disks through the
        transfer. Not before: until the guest exists, a run again receives the disks anew from these.
        """
        incoming = disks.incoming_dir(self.instances_dir, op.instance_uuid)
        try:
            disks.remove_dir(incoming)
        except OSError as exc:  # the guest runs here now: what is left is ferry audit's to report
            logger.warning("the copied disks could not be removed: ferry audit reports them",
                           extra={"host": self.host, "instance_uuid": op.instance_uuid, "path": str(incoming),
                                  "error": str(exc)})
            self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, op.name)
        if not op.args["same_host"]:
            self._delete_transfer(op, op.args["transfer"])

    def _receive_disks(self, op: Operation, live: Path, kept: Path) -> dict[str, tuple[Any, int]]:
        """Copy or fetch each disk of the ``disks`` argument into ``live``, verified.

        Returns each disk's digest object and size, to checksum it once grown without reading it again.
        """
        uuid, args = op.instance_uuid, op.args
        received: dict[str, tuple[Any, int]] = {}
        incoming = disks.incoming_dir(self.instances_dir, uuid)
        for kind, expected in args["disks"].items():
            dest = live / disks.DISK_FILES[kind]
            algorithm = protocol.disk_digest(expected)
            if args.get("direct"):
                # Copied straight into this host by the source: link it into place, digest from its blocks.
                copied = incoming / disks.DISK_FILES[kind]
                blocks = disks.received_digest(copied, expected["sha256"], expected["size"], algorithm)
                try:
                    os.link(copied, dest)
                    disks.sync_dir(live)
                except OSError as exc:
                    raise errors.DiskCopyFailed(f"The {kind} disk copied to {copied} cannot be taken: {exc}",
                                                instance_uuid=uuid) from exc
                received[kind] = (blocks, expected["size"])
                continue
            if args["same_host"]:
                source = kept / disks.DISK_FILES[kind]
                if not source.exists():
                    raise errors.DiskCopyFailed(f"The kept {kind} disk {source} is missing.", instance_uuid=uuid)
                hasher = disks.copy_sparse_digest(source, dest, algorithm=algorithm)
                digest, size = hasher.hexdigest(), dest.stat().st_size
                received[kind] = (hasher, size)
                if digest != expected["sha256"] or size != expected["size"]:
                    raise errors.DiskCopyFailed(
                        f"The {kind} disk of instance {uuid} changed since it was moved aside "
                        f"(digest {digest}, {size} bytes; expected {expected['sha256']}, {expected['size']} bytes).",
                        instance_uuid=uuid,
                    )
                continue
            transfer = args["transfer"]
            moved = disks.download_disk(
                self.s3,
                transfer["bucket"],
                transfer["prefix"],
                kind,
                dest,
                expected_sha256=expected["sha256"],
                expected_size=expected["size"],
            )
            self._emit_metric("DiskBytesReceived", MetricUnit.Bytes, moved.data_bytes, op.name)
            received[kind] = (moved.hasher, moved.size)
        return received

    def _prepare_local_disks(self, instance_uuid: str, directory: Path, flavor: dict[str, Any]) -> list[DiskSpec]:
        """Grow the root and ephemeral disks to ``flavor`` (never shrinking), create what it adds and swap.

        Raises:
            DiskCopyFailed: a disk cannot be grown or created.
        """
        root = directory / disks.ROOT_DISK
        ephemeral = directory / disks.EPHEMERAL_DISK
        swap = directory / disks.SWAP_DISK
        result: list[DiskSpec] = []
        try:
            if root.exists():
                if flavor["root_gb"] > 0:
                    disks.grow(root, flavor["root_gb"] * disks.GiB)
                result.append(DiskSpec(kind=ROOT, path=str(root), device=LOCAL_DEVICES[ROOT], boot=True))
            if ephemeral.exists() or flavor["ephemeral_gb"] > 0:
                disks.create_sparse(ephemeral, flavor["ephemeral_gb"] * disks.GiB)
                result.append(DiskSpec(kind=EPHEMERAL, path=str(ephemeral), device=LOCAL_DEVICES[EPHEMERAL]))
            if flavor["swap"] > 0:
                disks.create_sparse(swap, flavor["swap"] * disks.MiB)
                result.append(DiskSpec(kind=SWAP, path=str(swap), device=LOCAL_DEVICES[SWAP]))
        except OSError as exc:
            raise errors.DiskCopyFailed(
                f"Preparing the disks of instance {instance_uuid} failed: {exc}", instance_uuid=instance_uuid
            ) from exc
        return result

    def _disk_checksums(
        self, instance_uuid: str, directory: Path, known: dict[str, tuple[Any, int]] | None = None
    ) -> dict[str, dict[str, Any]]:
        """The block digest, its name and the size of the root and ephemeral disks in ``directory`` (whole files,
        zeros included).

        ``known`` has the digest objects of disks just written, before they were grown (their digest
        is carried on in the algorithm they arrived with); other disks get the move digest.
        """
        found: dict[str, dict[str, Any]] = {}
        for kind in protocol.MOVED_DISKS:
            path = directory / disks.DISK_FILES[kind]
            if path.exists():
                try:
                    size = path.stat().st_size
                    if known and kind in known and size >= known[kind][1]:
                        hasher, old_size = known[kind]
                        found[kind] = {"sha256": disks.grown_digest(hasher, old_size, size), "size": size,
                                       "digest": hasher.name}
                    else:
                        found[kind] = {"sha256": disks.file_digest(path, protocol.MOVE_DIGEST), "size": size,
                                       "digest": protocol.MOVE_DIGEST}
                except OSError as exc:
                    raise errors.DiskCopyFailed(f"Reading {path} failed: {exc}", instance_uuid=instance_uuid) from exc
        return found

    def _define(self, instance_uuid: str, args: dict[str, Any], local: list[DiskSpec]) -> None:
        """Define the guest from its local disks and the ``flavor``, ``name``, ``ports`` and ``volumes`` args."""
        has_root = any(d.kind == ROOT for d in local)
        if not has_root and not args["volumes"]:
            raise errors.InvalidOperation(
                f"Instance {instance_uuid} has neither a root disk nor a boot volume here.", instance_uuid=instance_uuid
            )
        self.driver.define_guest(
            guest_spec(instance_uuid, args, local + volume_disks(args["volumes"], boot_from_volume=not has_root))
        )

    def _forget_here(self, op: Operation, live: Path) -> None:
        """Undo a failed finish_resize: no guest, no live directory. Never raises over the operation's error."""
        try:
            self.driver.destroy(op.instance_uuid)
            disks.remove_dir(live)
        except Exception:
            logger.exception(
                "cleaning up a failed finish_resize failed",
                extra={"host": self.host, "operation": op.name, "instance_uuid": op.instance_uuid},
            )
            self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, op.name)

    def _delete_transfer(self, op: Operation, transfer: dict[str, Any]) -> None:
        """Delete the transfer objects, best effort: a failure is logged and counted."""
        try:
            deleted = disks.delete_transfer(self.s3, transfer["bucket"], transfer["prefix"])
        except (ClientError, BotoCoreError) as exc:
            # The guest is up (or, reverted, gone); the leftovers go with the bucket's expiry rule.
            logger.warning(
                "deleting the transfer failed",
                extra={"host": self.host, "instance_uuid": op.instance_uuid, "error": str(exc), **transfer},
            )
            self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, op.name)
            return
        if deleted:
            logger.info(
                "transfer deleted",
                extra={"host": self.host, "instance_uuid": op.instance_uuid, "objects": deleted, **transfer},
            )

    # -- what an operation nobody waited for sent off this host

    def take_back_sent_disks(self, op: Operation) -> None:
        """Remove the disks a ``resize_instance`` sent: its direct copy at the destination, its transfer.

        For a run whose workflow stopped waiting: the rollback deletes both, but it may have run
        before this run finished sending. The kept disks stay for the rollback's revert. The
        destination's incoming directory is left once a later move of the instance has set its
        disks aside here (it copies into the same directory); the transfer is this move's alone.

        Raises:
            OSError, ClientError, BotoCoreError: logged and counted by the agent; `ferry audit` finds what is left.
        """
        args = op.args
        if args["same_host"]:
            return
        offer = args.get("direct")
        kept = read_record(disks.resize_dir(self.instances_dir, op.instance_uuid))
        later_move = kept is not None and kept.get("migration_uuid") != args["migration_uuid"]
        if offer and not later_move and disks.reaches(offer["instances_dir"], args["dest_host"], offer["token"]):
            disks.remove_dir(disks.incoming_dir(offer["instances_dir"], op.instance_uuid))
        disks.delete_transfer(self.s3, args["transfer"]["bucket"], args["transfer"]["prefix"])

    def take_back_snapshot(self, op: Operation) -> None:
        """Delete the snapshot a ``prep_snapshot_based_resize_at_source`` wrote, with its extents.

        For a run whose workflow stopped waiting: the rollback deletes the snapshot, but it may
        have run before this run finished writing it. The extents go first and the image object
        last, so a failure half-way leaves an image that points at what is left.

        Raises:
            ClientError, BotoCoreError: logged and counted by the agent; `ferry audit` finds what is left.
        """
        snapshot = op.args.get("snapshot")
        if snapshot is None:
            return
        bucket = snapshot["bucket"]
        disks.delete_transfer(self.s3, bucket, snapshot["data_prefix"])
        aws.abort_uploads(self.s3, bucket, snapshot["key"], whole_key=True)
        self.s3.delete_object(Bucket=bucket, Key=snapshot["key"])

    def take_back_guest(self, op: Operation) -> None:
        """Destroy the guest a ``spawn`` or ``finish_resize`` made here, with its disks.

        For a run whose workflow stopped waiting: the workflow rolled the server back (to its
        source, or to no host), and a guest left running here would write the same volumes as
        the one the rollback restored. Not for a move on one host, whose guest is the server's
        only one; volume files stay (they are the volumes'), but for those a failed spawn made and
        its undo left (:meth:`hostagent.agent.HostAgent.remove_volumes_of_undone_spawn`), and the kept disks of a
        move stay.

        Only while the instance directory is still the operation's: its record (``spawn.json``
        naming the spawn, ``migration.json`` naming the move) is written before any disk or
        guest, and goes last. A directory another operation made since (or none) is left with
        the guest, which is then that operation's. A ``finish_resize`` also removes the disks
        copied into ``<uuid>_incoming``. Safe to run again, after a take-back cut short.

        Raises:
            HypervisorError, OSError: logged and counted by the agent; `ferry audit` finds what is left.
        """
        if op.args.get("same_host"):
            return
        uuid = op.instance_uuid
        live = disks.instance_dir(self.instances_dir, uuid)
        if op.name == protocol.SPAWN:
            name = SPAWN_RECORD
            owned = (read_record(live, SPAWN_RECORD) or {}).get("operation_id") == op.operation_id
        else:
            name = MOVE_RECORD
            owned = _record_of(live, op.args["migration_uuid"]) is not None
        if not owned:
            logger.info("nothing of the operation to take back here: the instance directory is another's, or gone",
                        extra={"host": self.host, "instance_uuid": uuid, "operation": op.name,
                               "operation_id": op.operation_id})
            return
        self.driver.destroy(uuid)
        if op.name == protocol.FINISH_RESIZE:
            disks.remove_dir(disks.incoming_dir(self.instances_dir, uuid))
        elif not self.remove_volumes_of_undone_spawn(uuid, op.name):
            raise OSError(f"volume files the failed spawn of instance {uuid} made are left; its record keeps them")
        disks.remove_dir_record_last(live, name)

    # -- prep_snapshot_based_resize_at_source (source of a cross-cell move)

    def prep_snapshot_based_resize_at_source(self, op: Operation) -> dict[str, Any]:
        """Power off, snapshot the root disk to an image object unless volume-backed, undefine the guest.

        The guest's power state is remembered (``was_running``), the guest is stopped and
        undefined and its directory becomes ``<uuid>_resize`` as for ``resize_instance``; then the
        root disk's written extents stream to ``s3://<snapshot.bucket>/<snapshot.data_prefix>/`` and
        ``<snapshot.key>`` becomes the sparse image named ``snapshot.name`` that points at them,
        which the destination's ``spawn`` boots from. A re-run after the upload
        finished returns the same snapshot without sending it again.

        Raises:
            GuestNotFound: this host has neither the guest nor its disks.
            DiskCopyFailed: the root disk cannot be read or the upload failed.
            HypervisorError.
        """
        uuid, args = op.instance_uuid, op.args
        migration = args["migration_uuid"]
        kept, record = self._set_aside(op)
        snapshot = args.get("snapshot")
        if snapshot is None:
            return {**self._result(uuid, NOSTATE), "was_running": bool(record["was_running"]), "snapshot": None}
        bucket, key, image_id = snapshot["bucket"], snapshot["key"], snapshot["image_id"]
        done = record.get("snapshot")
        if done and done.get("image_id") == image_id and disks.image_sha256(self.s3, bucket, key) == done["sha256"]:
            return {**self._result(uuid, NOSTATE), "was_running": bool(record["was_running"]), "snapshot": done}
        root = kept / disks.DISK_FILES["root"]
        if not root.exists():
            raise errors.GuestNotFound(
                f"Instance {uuid} has no root disk on {self.host} to snapshot ({root}).", instance_uuid=uuid
            )
        metadata = {
            "image-id": image_id,
            "name": protocol.image_metadata_name(snapshot["name"]),
            "disk-format": "raw",
            "container-format": "bare",
            "min-disk": "0",
            "min-ram": "0",
            "visibility": "private",
            # The server's project: no other project sees or boots the snapshot (an older
            # workflow sends no owner; the image is then an admin's only).
            **protocol.image_metadata_owner(snapshot.get("owner")),
        }
        sent = disks.upload_sparse_image(self.s3, root, bucket, key, snapshot["data_prefix"], metadata)
        self._emit_metric("SnapshotBytesSent", MetricUnit.Bytes, sent.data_bytes, op.name)
        done = {"image_id": image_id, "sha256": sent.sha256, "size": sent.size, "data_bytes": sent.data_bytes}
        write_record(kept, {**record, "snapshot": done})
        logger.info(
            "snapshot sent",
            extra={"host": self.host, "instance_uuid": uuid, "migration_uuid": migration, "image_id": image_id,
                   "size": sent.size, "data_bytes": sent.data_bytes},
        )
        return {**self._result(uuid, NOSTATE), "was_running": bool(record["was_running"]), "snapshot": done}

    # -- confirm_resize (source)

    def confirm_resize(self, op: Operation) -> dict[str, Any]:
        """Forget the old side of a move: the kept disks and, unless the move stayed here, any guest
        and instance directory (a host that is not the server's keeps nothing of it; the directory
        is there only when a revert between cells failed after giving the server back to its source).

        On the same host the live guest is the resized one and is left alone.

        Raises:
            HypervisorError, HostOperationFailed (the kept disks cannot be removed).
        """
        uuid, same_host = op.instance_uuid, op.args["same_host"]
        if not same_host:
            self.driver.destroy(uuid)
        kept = disks.resize_dir(self.instances_dir, uuid)
        try:
            if not same_host:
                disks.remove_instance_dir(self.instances_dir, uuid)
            disks.remove_dir(kept)
        except OSError as exc:
            raise errors.HostOperationFailed(f"Removing {kept} failed: {exc}", instance_uuid=uuid) from exc
        return self._result(uuid, self._power_state_here(uuid) if same_host else NOSTATE)

    # -- revert_resize (destination)

    def revert_resize(self, op: Operation) -> dict[str, Any]:
        """Forget the new side of a move: the guest and disks here, and the transfer objects.

        Safe when nothing was created yet. On the same host the kept directory stays (the
        source's revert restores it); if nothing was moved aside there for this move (no kept
        directory, or one an earlier move left), the live guest and disks are the instance's only
        ones and are left alone.

        Once the guest is destroyed the revert must go on to the source, whose disks are the
        server's only ones now: what cannot be removed after that (the directories, the transfer
        objects) is logged and counted (``HostCleanupFailed``), never raised. An error would
        leave the server in VERIFY_RESIZE on a destination that no longer holds it, and a confirm
        would then delete the source's disks. ``ferry audit`` reports what is left
        (``instance_dir_orphan``, ``transfer_orphan``; the bucket's expiry rule removes transfers).

        The answer's power state is NOSTATE when it cannot be read once the guest is gone: the
        workflow takes a HypervisorError for "nothing here was removed" and puts the server back
        in VERIFY_RESIZE, so none may be raised once anything was. For the same reason a destroy
        that fails where an earlier run of this operation (its agent died mid-way) already
        removed the instance directory is taken as done: no guest here has disks any more.

        Raises:
            HypervisorError: the guest could not be destroyed (nothing here was removed; the
                agent answers HostOperationFailed instead when an earlier run of this operation
                was cut short, which may have removed some of the disks).
        """
        uuid, args = op.instance_uuid, op.args
        live = disks.instance_dir(self.instances_dir, uuid)
        kept = disks.resize_dir(self.instances_dir, uuid)
        if args["same_host"] and _record_of(kept, args["migration_uuid"]) is None:
            # Kept disks of another move are no sign of this one: the live guest may be the only one.
            logger.info(
                "nothing was moved aside for this move: the instance's guest and disks stay",
                extra={"host": self.host, "instance_uuid": uuid, "migration_uuid": args["migration_uuid"],
                       "kept_for_another_move": kept.exists()},
            )
        else:
            try:
                self.driver.destroy(uuid)
            except errors.HypervisorError as exc:
                if live.exists():
                    raise
                logger.warning("the guest could not be destroyed, but its disks are gone (an earlier run removed "
                               "them): the revert goes on", extra={"host": self.host, "instance_uuid": uuid,
                                                                  "error": exc.message})
            try:
                disks.remove_dir(live)
                disks.remove_dir(disks.incoming_dir(self.instances_dir, uuid))
            except OSError as exc:
                logger.warning("the reverted guest's disks could not be removed: ferry audit reports them",
                               extra={"host": self.host, "instance_uuid": uuid, "path": str(live), "error": str(exc)})
                self._emit_metric("HostCleanupFailed", MetricUnit.Count, 1, op.name)
        if args.get("transfer"):
            self._delete_transfer(op, args["transfer"])
        try:
            power_state = self._power_state_here(uuid)
        except errors.HypervisorError as exc:
            logger.warning("the power state after the revert could not be read", extra={
                "host": self.host, "instance_uuid": uuid, "error": exc.message})
            power_state = NOSTATE
        return self._result(uuid, power_state)

    # -- finish_revert_resize (source)

    def finish_revert_resize(self, op: Operation) -> dict[str, Any]:
        """Put the kept disks back and define the guest with the old flavor; power it on if asked.

        Any guest or live directory left here by the move goes first. Swap is re-created if
        missing. Without disks kept for this move (``migration_uuid``), the live directory is the
        instance's: its guest is defined if missing, and powered on if asked; disks an earlier
        move kept are left alone. Also the rollback of a failed resize_instance or
        finish_resize.

        Raises:
            GuestNotFound: this host has neither kept nor live disks of the instance, nor its guest.
            InvalidOperation: the instance would have no boot disk.
            HypervisorError, HostOperationFailed (the disks cannot be moved back).
        """
        uuid, args = op.instance_uuid, op.args
        live = disks.instance_dir(self.instances_dir, uuid)
        kept = disks.resize_dir(self.instances_dir, uuid)
        if kept.exists() and _record_of(kept, args["migration_uuid"]) is None:
            # Left by an earlier move: never put back over the live disks (a later move removes it).
            logger.warning(
                "disks kept for another move left as they are",
                extra={"host": self.host, "instance_uuid": uuid, "migration_uuid": args["migration_uuid"],
                       "path": str(kept), "record": read_record(kept)},
            )
        elif kept.exists():
            # A guest defined now is the resized one (the original was undefined before its disks moved aside).
            self.driver.destroy(uuid)
            try:
                disks.remove_dir(live)
                os.rename(kept, live)
            except OSError as exc:
                raise errors.HostOperationFailed(
                    f"Moving the kept disks of instance {uuid} back failed: {exc}", instance_uuid=uuid
                ) from exc
            disks.sync_dir(self.instances_dir)
        if not self.driver.guest_exists(uuid):
            if not live.exists():
                raise errors.GuestNotFound(
                    f"Instance {uuid} has neither a guest nor disks on {self.host}.", instance_uuid=uuid
                )
            # The kept disks are at least the old flavor's sizes: only a missing ephemeral or swap is created.
            self._define(uuid, args, self._prepare_local_disks(uuid, live, args["flavor"]))
        if args["power_on"]:
            self.driver.power_on(uuid)
        (live / MOVE_RECORD).unlink(missing_ok=True)
        return self._result(uuid, self.driver.guest_power_state(uuid))

    # -- volumes

    def attach_volume(self, op: Operation) -> dict[str, Any]:
        """Attach a volume to the instance's guest; attaching it again changes nothing.

        Raises:
            GuestNotFound, InvalidOperation (the device is taken), HypervisorError.
        """
        volume = op.args["volume"]
        self.driver.attach_volume(
            op.instance_uuid,
            DiskSpec(kind=VOLUME, path=volume["path"], device=volume["device"], volume_id=volume["volume_id"]),
        )
        return self._result(op.instance_uuid, self.driver.guest_power_state(op.instance_uuid))

    def detach_volume(self, op: Operation) -> dict[str, Any]:
        """Detach a volume from the instance's guest; a volume not attached, or an instance with no
        guest here, is already detached (its power state then NOSTATE).

        Raises:
            HypervisorError.
        """
        self.driver.detach_volume(op.instance_uuid, op.args["volume_id"])
        return self._result(op.instance_uuid, self._power_state_here(op.instance_uuid))
