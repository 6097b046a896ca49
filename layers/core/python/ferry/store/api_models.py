"""Tables of the API database: mappings, flavors, aggregates, request specs, server groups,
placement, ports, volumes and auth tokens."""

from __future__ import annotations

import datetime as dt
import uuid as uuidlib

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


def new_uuid() -> str:
    return str(uuidlib.uuid4())


class ApiBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class TimestampMixin:
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime | None] = mapped_column(DateTime, onupdate=utcnow)


# --- cells and mappings -------------------------------------------------------------------------


class CellMapping(TimestampMixin, ApiBase):
    __tablename__ = "cell_mappings"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    database_connection: Mapped[str] = mapped_column(Text)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)


class HostMapping(TimestampMixin, ApiBase):
    __tablename__ = "host_mappings"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    host: Mapped[str] = mapped_column(String(255), unique=True)
    cell_id: Mapped[int] = mapped_column(ForeignKey("cell_mappings.id"), index=True)
    cell: Mapped[CellMapping] = relationship(lazy="joined")
    # Who the host's reports are taken from (SQS's SenderId of its first report since it was
    # mapped or re-bound); None until then.
    reporter: Mapped[str | None] = mapped_column(String(255), nullable=True)


class InstanceMapping(TimestampMixin, ApiBase):
    """Where an instance lives: the authority the API reads before touching a cell."""

    __tablename__ = "instance_mappings"
    # A cell's servers newest first, for a list that shows those of a cell not answering (2.69).
    __table_args__ = (Index("ix_instance_mappings_cell_listing", "cell_id", "queued_for_delete", "created_at",
                            "instance_uuid"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance_uuid: Mapped[str] = mapped_column(String(36), unique=True)
    cell_id: Mapped[int | None] = mapped_column(ForeignKey("cell_mappings.id"), index=True, nullable=True)
    project_id: Mapped[str] = mapped_column(String(255), index=True)
    user_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    queued_for_delete: Mapped[bool] = mapped_column(Boolean, default=False)
    cell: Mapped[CellMapping | None] = relationship(lazy="joined")


# --- flavors and aggregates ---------------------------------------------------------------------


class Flavor(TimestampMixin, ApiBase):
    __tablename__ = "flavors"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    flavorid: Mapped[str] = mapped_column(String(255), unique=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    vcpus: Mapped[int] = mapped_column(Integer)
    memory_mb: Mapped[int] = mapped_column(Integer)
    root_gb: Mapped[int] = mapped_column(Integer, default=0)
    ephemeral_gb: Mapped[int] = mapped_column(Integer, default=0)
    swap: Mapped[int] = mapped_column(Integer, default=0)
    rxtx_factor: Mapped[float] = mapped_column(Float, default=1.0)
    is_public: Mapped[bool] = mapped_column(Boolean, default=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    description: Mapped[str | None] = mapped_column(Text, nullable=True)
    extra_specs: Mapped[list[FlavorExtraSpec]] = relationship(
        cascade="all, delete-orphan", lazy="selectin", back_populates="flavor"
    )
    projects: Mapped[list[FlavorProject]] = relationship(cascade="all, delete-orphan", lazy="selectin")

    @property
    def specs(self) -> dict[str, str]:
        return {s.key: s.value for s in self.extra_specs}


class FlavorExtraSpec(ApiBase):
    __tablename__ = "flavor_extra_specs"
    __table_args__ = (UniqueConstraint("flavor_id", "key"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    flavor_id: Mapped[int] = mapped_column(ForeignKey("flavors.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    value: Mapped[str] = mapped_column(String(255))
    flavor: Mapped[Flavor] = relationship(back_populates="extra_specs")


class FlavorProject(ApiBase):
    """A project allowed to use a private flavor (Nova's flavor access)."""

    __tablename__ = "flavor_projects"
    __table_args__ = (UniqueConstraint("flavor_id", "project_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    flavor_id: Mapped[int] = mapped_column(ForeignKey("flavors.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(String(255))


class Aggregate(TimestampMixin, ApiBase):
    __tablename__ = "aggregates"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    hosts: Mapped[list[AggregateHost]] = relationship(cascade="all, delete-orphan", lazy="selectin")
    metadata_items: Mapped[list[AggregateMetadata]] = relationship(cascade="all, delete-orphan", lazy="selectin")

    @property
    def metadata_dict(self) -> dict[str, str]:
        return {m.key: m.value for m in self.metadata_items}


class AggregateHost(ApiBase):
    __tablename__ = "aggregate_hosts"
    __table_args__ = (UniqueConstraint("aggregate_id", "host"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    aggregate_id: Mapped[int] = mapped_column(ForeignKey("aggregates.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(255), index=True)


class AggregateMetadata(ApiBase):
    __tablename__ = "aggregate_metadata"
    __table_args__ = (UniqueConstraint("aggregate_id", "key"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    aggregate_id: Mapped[int] = mapped_column(ForeignKey("aggregates.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    value: Mapped[str] = mapped_column(String(255))


class RequestSpec(TimestampMixin, ApiBase):
    """What a server asked of the scheduler at boot, reused for every later move."""

    __tablename__ = "request_specs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance_uuid: Mapped[str] = mapped_column(String(36), unique=True)
    spec: Mapped[dict] = mapped_column(JSON)


class BuildRequest(TimestampMixin, ApiBase):
    """A server accepted by the API but not yet scheduled to a cell (Nova's build request).

    ``instance`` holds the instance's fields; the boot workflow creates the instance in the
    chosen cell from it (or in cell0 when no host fits) and then deletes this row.
    """

    __tablename__ = "build_requests"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    instance_uuid: Mapped[str] = mapped_column(String(36), unique=True)
    project_id: Mapped[str] = mapped_column(String(255), index=True)
    instance: Mapped[dict] = mapped_column(JSON)
    block_device_mappings: Mapped[list] = mapped_column(JSON, default=list)
    tags: Mapped[list] = mapped_column(JSON, default=list)


# --- server groups ------------------------------------------------------------------------------


class InstanceGroup(TimestampMixin, ApiBase):
    """A server group: servers its owner asked to keep together or apart (Nova's instance group).

    ``policy`` is ``affinity``, ``anti-affinity``, ``soft-affinity`` or ``soft-anti-affinity``;
    ``rules`` holds ``max_server_per_host`` for an anti-affinity group that allows more than one.
    """

    __tablename__ = "instance_groups"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    name: Mapped[str] = mapped_column(String(255))
    project_id: Mapped[str] = mapped_column(String(255), index=True)
    user_id: Mapped[str] = mapped_column(String(255))
    policy: Mapped[str] = mapped_column(String(32))
    rules: Mapped[dict] = mapped_column(JSON, default=dict)


class InstanceGroupMember(ApiBase):
    """A server in a group; a server is in one group at most (it names one at creation)."""

    __tablename__ = "instance_group_members"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_id: Mapped[int] = mapped_column(ForeignKey("instance_groups.id", ondelete="CASCADE"), index=True)
    instance_uuid: Mapped[str] = mapped_column(String(36), unique=True)


# --- placement ----------------------------------------------------------------------------------


class ResourceProvider(TimestampMixin, ApiBase):
    """One compute node. ``generation`` changes on every inventory or allocation write."""

    __tablename__ = "resource_providers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    host: Mapped[str] = mapped_column(String(255), index=True)
    cell_id: Mapped[int | None] = mapped_column(ForeignKey("cell_mappings.id"), index=True, nullable=True)
    generation: Mapped[int] = mapped_column(Integer, default=0)
    # When the host report whose inventory the provider has was queued: an older one is not applied.
    inventory_reported_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)


class Inventory(ApiBase):
    """One resource class of a provider. ``used`` is the sum of the provider's allocations of that
    class, kept equal to it in every transaction that writes them (so capacity is read without
    summing allocations)."""

    __tablename__ = "inventories"
    __table_args__ = (UniqueConstraint("resource_provider_id", "resource_class"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    resource_provider_id: Mapped[int] = mapped_column(ForeignKey("resource_providers.id", ondelete="CASCADE"))
    resource_class: Mapped[str] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer)
    reserved: Mapped[int] = mapped_column(Integer, default=0)
    min_unit: Mapped[int] = mapped_column(Integer, default=1)
    max_unit: Mapped[int] = mapped_column(Integer, default=2147483647)
    step_size: Mapped[int] = mapped_column(Integer, default=1)
    allocation_ratio: Mapped[float] = mapped_column(Float, default=1.0)
    used: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))


class Consumer(TimestampMixin, ApiBase):
    """An instance or a migration holding allocations.

    ``instance_uuid`` is, for a move's migration, the instance it moves (the source host the
    migration holds is still that server's, which a server group counts); None otherwise.
    """

    __tablename__ = "consumers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True)
    project_id: Mapped[str] = mapped_column(String(255))
    user_id: Mapped[str] = mapped_column(String(255))
    generation: Mapped[int] = mapped_column(Integer, default=0)
    instance_uuid: Mapped[str | None] = mapped_column(String(36), nullable=True, index=True)


class Allocation(ApiBase):
    __tablename__ = "allocations"
    __table_args__ = (
        UniqueConstraint("resource_provider_id", "consumer_uuid", "resource_class"),
        Index("ix_allocations_rp_rc", "resource_provider_id", "resource_class"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    resource_provider_id: Mapped[int] = mapped_column(ForeignKey("resource_providers.id"))
    consumer_uuid: Mapped[str] = mapped_column(String(36), index=True)
    resource_class: Mapped[str] = mapped_column(String(64))
    used: Mapped[int] = mapped_column(Integer)


# --- networking and volumes ---------------------------------------------------------------------


class Network(TimestampMixin, ApiBase):
    __tablename__ = "networks"
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uuid)
    name: Mapped[str] = mapped_column(String(255))
    cidr: Mapped[str] = mapped_column(String(64))
    project_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    shared: Mapped[bool] = mapped_column(Boolean, default=True)


class Port(TimestampMixin, ApiBase):
    __tablename__ = "ports"
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uuid)
    network_id: Mapped[str] = mapped_column(ForeignKey("networks.id"), index=True)
    project_id: Mapped[str] = mapped_column(String(255))
    device_id: Mapped[str | None] = mapped_column(String(36), index=True, nullable=True)
    mac_address: Mapped[str] = mapped_column(String(32), unique=True)
    fixed_ip: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="DOWN")
    bindings: Mapped[list[PortBinding]] = relationship(cascade="all, delete-orphan", lazy="selectin")


class PortBinding(ApiBase):
    """A port's binding to a host; a move adds an INACTIVE one on the destination."""

    __tablename__ = "port_bindings"
    __table_args__ = (UniqueConstraint("port_id", "host"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    port_id: Mapped[str] = mapped_column(ForeignKey("ports.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), default="ACTIVE")
    vif_details: Mapped[dict] = mapped_column(JSON, default=dict)


class Volume(TimestampMixin, ApiBase):
    __tablename__ = "volumes"
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uuid)
    name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    project_id: Mapped[str] = mapped_column(String(255))
    size_gb: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(32), default="available")
    image_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    path: Mapped[str] = mapped_column(Text)
    attachments: Mapped[list[VolumeAttachment]] = relationship(cascade="all, delete-orphan", lazy="selectin")


class VolumeAttachment(TimestampMixin, ApiBase):
    __tablename__ = "volume_attachments"
    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_uuid)
    volume_id: Mapped[str] = mapped_column(ForeignKey("volumes.id", ondelete="CASCADE"), index=True)
    instance_uuid: Mapped[str] = mapped_column(String(36), index=True)
    host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    device: Mapped[str | None] = mapped_column(String(64), nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="reserved")


# --- identity -----------------------------------------------------------------------------------


class AuthToken(TimestampMixin, ApiBase):
    """An API token (stored as its SHA-256) and the identity it stands for."""

    __tablename__ = "auth_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[str] = mapped_column(String(255))
    project_id: Mapped[str] = mapped_column(String(255))
    roles: Mapped[list] = mapped_column(JSON, default=list)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)


# --- quotas -------------------------------------------------------------------------------------


class Quota(TimestampMixin, ApiBase):
    """A project's limit for one resource (``instances``, ``cores``, ``ram``, …), set by an admin.

    Resources without a row use the deployment's defaults; ``-1`` means unlimited.
    """

    __tablename__ = "quotas"
    __table_args__ = (UniqueConstraint("project_id", "resource"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[str] = mapped_column(String(255), index=True)
    resource: Mapped[str] = mapped_column(String(255))
    hard_limit: Mapped[int] = mapped_column(Integer)


# --- drains -------------------------------------------------------------------------------------


class Drain(TimestampMixin, ApiBase):
    """An operator's request to empty hosts or a cell, and how far it got.

    ``targets`` names the hosts (``target_kind`` ``host``) or the one cell (``cell``);
    ``options`` holds the limits and choices of the request; ``disabled_hosts`` the compute
    services this drain disabled (so a drain that moved nothing can give them back);
    ``version`` is bumped by every change that hands out a move slot (compare-and-swap);
    ``announced_at`` is when the drain's end was announced (its final event published and its
    callback posted, whether or not they were delivered), null while that is still to do;
    ``request_digest`` the SHA-256 of the normalised request (``ferry.drains.request_digest``), so
    ``idempotency_key`` again with another request is refused (null: recorded before digests were).
    """

    __tablename__ = "drains"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(36), unique=True, default=new_uuid)
    status: Mapped[str] = mapped_column(String(32), index=True)
    target_kind: Mapped[str] = mapped_column(String(16))
    targets: Mapped[list] = mapped_column(JSON, default=list)
    reason: Mapped[str | None] = mapped_column(String(255), nullable=True)
    dry_run: Mapped[bool] = mapped_column(Boolean, default=False)
    options: Mapped[dict] = mapped_column(JSON, default=dict)
    allow_cross_cell: Mapped[bool] = mapped_column(Boolean, default=False)
    fits: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    disabled_hosts: Mapped[list] = mapped_column(JSON, default=list)
    origin: Mapped[str] = mapped_column(String(32), default="api")
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True, nullable=True)
    request_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    user_id: Mapped[str] = mapped_column(String(255))
    project_id: Mapped[str] = mapped_column(String(255))
    roles: Mapped[list] = mapped_column(JSON, default=list)
    request_id: Mapped[str] = mapped_column(String(255))
    execution_name: Mapped[str | None] = mapped_column(String(80), nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    announced_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    version: Mapped[int] = mapped_column(Integer, default=0)


class DrainServer(TimestampMixin, ApiBase):
    """One server of a drain: where it was, where the plan puts it, and what became of it."""

    __tablename__ = "drain_servers"
    __table_args__ = (UniqueConstraint("drain_id", "instance_uuid"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    drain_id: Mapped[int] = mapped_column(ForeignKey("drains.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer, default=0)
    instance_uuid: Mapped[str] = mapped_column(String(36))
    name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    cell: Mapped[str] = mapped_column(String(255))
    source_host: Mapped[str] = mapped_column(String(255))
    vm_state: Mapped[str | None] = mapped_column(String(255), nullable=True)
    planned_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    planned_cell: Mapped[str | None] = mapped_column(String(255), nullable=True)
    dest_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    state: Mapped[str] = mapped_column(String(32))
    migration_uuid: Mapped[str | None] = mapped_column(String(36), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
