"""Tables of a cell database: instances, migrations, block device mappings, tags, instance
actions and events, faults and compute services."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ferry.store.api_models import NAMING, new_uuid, utcnow


class CellBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class TimestampMixin:
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime | None] = mapped_column(DateTime, onupdate=utcnow)


class Instance(TimestampMixin, CellBase):
    """A server. ``flavor`` is the flavor it has now (a snapshot of the flavor's fields, so a
    deleted flavor never strands it); ``old_flavor``/``new_flavor`` are set during a move."""

    __tablename__ = "instances"
    # A server list reads servers newest first from its marker on (every project's, or one's);
    # the same indexes serve the reads by project (quotas) or by deleted alone (0009_cell).
    __table_args__ = (Index("ix_instances_deleted_created_at_uuid", "deleted", "created_at", "uuid"),
                      Index("ix_instances_project_id_deleted_created_at_uuid", "project_id", "deleted", "created_at",
                            "uuid"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    display_name: Mapped[str] = mapped_column(String(255))
    display_description: Mapped[str | None] = mapped_column(Text, nullable=True)
    hostname: Mapped[str | None] = mapped_column(String(255), nullable=True)
    reservation_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # Its place among the servers of its create request (0 for the first); None for servers made
    # before the column was (shown as 0).
    launch_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    user_data: Mapped[str | None] = mapped_column(Text, nullable=True)
    project_id: Mapped[str] = mapped_column(String(255))
    user_id: Mapped[str] = mapped_column(String(255))
    image_ref: Mapped[str | None] = mapped_column(String(255), nullable=True)
    flavor: Mapped[dict] = mapped_column(JSON)
    old_flavor: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    new_flavor: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    vm_state: Mapped[str] = mapped_column(String(32), default="building")
    task_state: Mapped[str | None] = mapped_column(String(32), nullable=True)
    power_state: Mapped[int] = mapped_column(Integer, default=0)
    old_vm_state: Mapped[str | None] = mapped_column(String(32), nullable=True)
    host: Mapped[str | None] = mapped_column(String(255), index=True, nullable=True)
    node: Mapped[str | None] = mapped_column(String(255), nullable=True)
    launched_on: Mapped[str | None] = mapped_column(String(255), nullable=True)
    availability_zone: Mapped[str | None] = mapped_column(String(255), nullable=True)
    key_name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    metadata_items: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    locked: Mapped[bool] = mapped_column(Boolean, default=False)
    locked_by: Mapped[str | None] = mapped_column(String(16), nullable=True)
    hidden: Mapped[bool] = mapped_column(Boolean, default=False)
    launched_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    terminated_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    deleted_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)


class Migration(TimestampMixin, CellBase):
    __tablename__ = "migrations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    instance_uuid: Mapped[str] = mapped_column(String(36), index=True)
    source_compute: Mapped[str | None] = mapped_column(String(255), index=True, nullable=True)
    source_node: Mapped[str | None] = mapped_column(String(255), nullable=True)
    dest_compute: Mapped[str | None] = mapped_column(String(255), index=True, nullable=True)
    dest_node: Mapped[str | None] = mapped_column(String(255), nullable=True)
    dest_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    old_instance_type_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    new_instance_type_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(32), index=True)
    migration_type: Mapped[str] = mapped_column(String(32))
    hidden: Mapped[bool] = mapped_column(Boolean, default=False)
    cross_cell_move: Mapped[bool] = mapped_column(Boolean, default=False)
    user_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    project_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)


class BlockDeviceMapping(TimestampMixin, CellBase):
    __tablename__ = "block_device_mappings"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    instance_uuid: Mapped[str] = mapped_column(String(36), index=True)
    source_type: Mapped[str] = mapped_column(String(32))
    destination_type: Mapped[str] = mapped_column(String(32))
    device_name: Mapped[str | None] = mapped_column(String(64), nullable=True)
    boot_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    volume_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    image_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    volume_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    guest_format: Mapped[str | None] = mapped_column(String(32), nullable=True)
    delete_on_termination: Mapped[bool] = mapped_column(Boolean, default=False)
    attachment_id: Mapped[str | None] = mapped_column(String(36), nullable=True)
    # The device tag asked for at create (2.32, from 2.42) or at attach (2.49), for the guest to find it by.
    tag: Mapped[str | None] = mapped_column(String(255), nullable=True)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)


class Tag(CellBase):
    __tablename__ = "tags"
    instance_uuid: Mapped[str] = mapped_column(String(36), primary_key=True)
    tag: Mapped[str] = mapped_column(String(80), primary_key=True)


class InstanceAction(CellBase):
    """An action a request started on a server: one per server and request id (a step delivered
    twice finds the one recorded)."""

    __tablename__ = "instance_actions"
    __table_args__ = (UniqueConstraint("instance_uuid", "request_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    action: Mapped[str] = mapped_column(String(255))
    instance_uuid: Mapped[str] = mapped_column(String(36), index=True)
    request_id: Mapped[str] = mapped_column(String(255), index=True)
    user_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    project_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    start_time: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finish_time: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    updated_at: Mapped[dt.datetime | None] = mapped_column(DateTime, onupdate=utcnow, nullable=True)


class InstanceActionEvent(CellBase):
    __tablename__ = "instance_actions_events"
    __table_args__ = (UniqueConstraint("action_id", "event"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    action_id: Mapped[int] = mapped_column(ForeignKey("instance_actions.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(255))
    start_time: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finish_time: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    result: Mapped[str | None] = mapped_column(String(255), nullable=True)
    traceback: Mapped[str | None] = mapped_column(Text, nullable=True)
    host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    details: Mapped[str | None] = mapped_column(Text, nullable=True)


class InstanceFault(CellBase):
    __tablename__ = "instance_faults"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance_uuid: Mapped[str] = mapped_column(String(36), index=True)
    code: Mapped[int] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(String(255))
    details: Mapped[str | None] = mapped_column(Text, nullable=True)
    host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class Service(TimestampMixin, CellBase):
    """A compute service (one per host agent); ``last_seen_at`` is its heartbeat."""

    __tablename__ = "services"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    host: Mapped[str] = mapped_column(String(255), unique=True)
    binary: Mapped[str] = mapped_column(String(64), default="ferry-compute")
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    disabled_reason: Mapped[str | None] = mapped_column(String(255), nullable=True)
    forced_down: Mapped[bool] = mapped_column(Boolean, default=False)
    last_seen_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    details: Mapped[dict] = mapped_column(JSON, default=dict)
