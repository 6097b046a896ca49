"""A server in VERIFY_RESIZE after a move between cells, written straight into the store.

The records are those the cross-cell resize workflow leaves: the server in both cells under
one uuid (cell2's copy visible on the destination with the new flavor, cell1's copy hidden on
the source with the old one), the instance mapping on cell2, the migration (``cross_cell_move``,
``finished``) in both cells, block device mappings, tags and actions in both; the migration
consumer holding the old flavor on the source and the instance the new one on the destination;
an ACTIVE port binding on the destination and an INACTIVE one on the source; a volume attached
on both hosts.
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from verify_resize_helpers import NEW, NEW_USAGE, OLD, OLD_USAGE, PROJECT, SOURCE, USER, make_volume, provider, report

from ferry import aws, config, placement, protocol
from ferry.compute import migration_states, states
from ferry.store.api_models import CellMapping, InstanceMapping, Port, PortBinding, RequestSpec, VolumeAttachment
from ferry.store.cell_models import BlockDeviceMapping, Instance, InstanceAction, InstanceActionEvent, Migration, Tag
from ferry.store.db import api_session, cell_session

SOURCE_CELL, TARGET_CELL = "cell1", "cell2"
CROSS_DEST = "cell2-host1"


def add_target_host() -> None:
    """The destination host of cell2: its queue and an inventory report (inside ``mocked_aws``)."""
    aws.client("sqs").create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, CROSS_DEST))
    report(CROSS_DEST, cell=TARGET_CELL)


@dataclass(frozen=True)
class CrossCell:
    instance_uuid: str
    migration_uuid: str
    port_id: str
    volume_id: str


def _copy(cell: str, uuid: str, migration_uuid: str, volume_id: str, *, hidden: bool, old_vm_state: str) -> None:
    running = old_vm_state == states.ACTIVE
    host, flavor = (SOURCE, OLD) if hidden else (CROSS_DEST, NEW)
    with cell_session(cell) as session:
        session.add(Instance(uuid=uuid, display_name="vm1", project_id=PROJECT, user_id=USER, image_ref="img-1",
                             flavor=flavor, old_flavor=OLD, new_flavor=NEW, old_vm_state=old_vm_state,
                             vm_state=states.RESIZED, task_state=None, hidden=hidden,
                             power_state=states.RUNNING if running and not hidden else states.SHUTDOWN,
                             host=host, node=host, launched_on=SOURCE))
        session.add(Migration(uuid=migration_uuid, instance_uuid=uuid, source_compute=SOURCE, source_node=SOURCE,
                              dest_compute=CROSS_DEST, dest_node=CROSS_DEST, dest_host=CROSS_DEST,
                              old_instance_type_id=OLD["id"], new_instance_type_id=NEW["id"],
                              status=migration_states.FINISHED, migration_type=migration_states.RESIZE, user_id=USER,
                              project_id=PROJECT, cross_cell_move=True))
        session.add(BlockDeviceMapping(instance_uuid=uuid, source_type="volume", destination_type="volume",
                                       device_name="vdd", boot_index=None, volume_id=volume_id))
        session.add(Tag(instance_uuid=uuid, tag="blue"))
        action = InstanceAction(action="resize", instance_uuid=uuid, request_id="req-resize", user_id=USER,
                                project_id=PROJECT)
        session.add(action)
        session.flush()
        session.add(InstanceActionEvent(action_id=action.id, event="conductor_resize_instance", result="Success"))


def make_cross_cell(state_dir: Path, *, old_vm_state: str = states.ACTIVE) -> CrossCell:
    """A server in VERIFY_RESIZE after a cross-cell move (see the module docstring)."""
    uuid, migration_uuid = str(uuidlib.uuid4()), str(uuidlib.uuid4())
    placement.claim(migration_uuid, PROJECT, USER, {provider(SOURCE): OLD_USAGE})
    placement.claim(uuid, PROJECT, USER, {provider(CROSS_DEST): NEW_USAGE})
    volume_id = make_volume(state_dir)
    _copy(SOURCE_CELL, uuid, migration_uuid, volume_id, hidden=True, old_vm_state=old_vm_state)
    _copy(TARGET_CELL, uuid, migration_uuid, volume_id, hidden=False, old_vm_state=old_vm_state)
    with api_session() as session:
        cell_id = session.scalars(select(CellMapping.id).where(CellMapping.name == TARGET_CELL)).one()
        session.add(InstanceMapping(instance_uuid=uuid, project_id=PROJECT, user_id=USER, cell_id=cell_id))
        session.add(RequestSpec(instance_uuid=uuid, spec={"instance_uuid": uuid, "project_id": PROJECT,
                                                          "user_id": USER, "flavor": NEW, "is_bfv": False}))
        port = Port(network_id="net-1", project_id=PROJECT, device_id=uuid, status="ACTIVE",
                    mac_address=f"fa:16:3e:{uuid[0:2]}:{uuid[2:4]}:{uuid[4:6]}", fixed_ip="10.0.0.7")
        port.bindings.append(PortBinding(host=CROSS_DEST, status="ACTIVE", vif_details={"type": "ethernet"}))
        port.bindings.append(PortBinding(host=SOURCE, status="INACTIVE", vif_details={"type": "ethernet"}))
        session.add(port)
        session.flush()
        port_id = port.id
        for host in (SOURCE, CROSS_DEST):
            session.add(VolumeAttachment(volume_id=volume_id, instance_uuid=uuid, host=host, device="vdd",
                                         status="attached"))
    return CrossCell(uuid, migration_uuid, port_id, volume_id)


def copy_in(cell: str, instance_uuid: str) -> Instance | None:
    with cell_session(cell) as session:
        return session.scalars(select(Instance).where(Instance.uuid == instance_uuid)).one_or_none()


def migration_in(cell: str, migration_uuid: str) -> Migration | None:
    with cell_session(cell) as session:
        return session.scalars(select(Migration).where(Migration.uuid == migration_uuid)).one_or_none()


def leftovers(cell: str, instance_uuid: str) -> dict[str, int]:
    """How many rows of each kind the server still has in ``cell``."""
    with cell_session(cell) as session:
        counts: dict[str, Any] = {}
        for name, model in (("instances", Instance), ("bdms", BlockDeviceMapping), ("tags", Tag),
                            ("actions", InstanceAction), ("migrations", Migration)):
            column = Instance.uuid if model is Instance else model.instance_uuid
            counts[name] = len(session.scalars(select(model).where(column == instance_uuid)).all())
        return counts


def mapped_cell(instance_uuid: str) -> str:
    with api_session() as session:
        mapping = session.scalars(select(InstanceMapping).where(InstanceMapping.instance_uuid == instance_uuid)).one()
        return mapping.cell.name


def events_in(cell: str, instance_uuid: str) -> dict[str, str | None]:
    with cell_session(cell) as session:
        rows = session.execute(select(InstanceActionEvent.event, InstanceActionEvent.result)
                               .join(InstanceAction, InstanceAction.id == InstanceActionEvent.action_id)
                               .where(InstanceAction.instance_uuid == instance_uuid)).all()
    return {event: result for event, result in rows}
