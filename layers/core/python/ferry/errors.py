"""Every typed error Ferry raises, named once.

A subclass of :class:`FerryError` gets the public name ``Ferry.<ClassName>``: it is the
``errorType`` a Lambda task reports, the ``error`` a host agent sends with
SendTaskFailure, and the string the state machines' ``Retry``/``Catch`` match on.
``tests/unit/test_error_names.py`` checks that every ``Ferry.*`` name in
``statemachine/*.asl.json`` is defined here.
"""

from __future__ import annotations

from typing import Any, ClassVar

PREFIX = "Ferry."


class FerryError(Exception):
    """Base of Ferry's typed errors.

    ``http_status`` is what the compute API answers when the error reaches it;
    ``api_kind`` the key of Nova's error body (``{"badRequest": {...}}``);
    ``owner_readable`` whether its message is written for the server's owner to read, as a
    fault's message shows it (:meth:`readable_by_owner`).
    """

    http_status: ClassVar[int] = 500
    api_kind: ClassVar[str] = "computeFault"
    default_message: ClassVar[str] = "An unexpected error occurred."
    # Only errors written for the caller (a request refused, not found, a server in the wrong
    # state; no valid host) say True: any other may carry a host's or cell's name, a host's paths
    # and libvirt's output, an AWS account or ARN, or a database server's address.
    owner_readable: ClassVar[bool] = False
    registry: ClassVar[dict[str, type[FerryError]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        short = cls.__name__
        cls.__name__ = cls.__qualname__ = PREFIX + short
        FerryError.registry[cls.__name__] = cls

    def __init__(self, message: str | None = None, **details: Any) -> None:
        self.message = message or self.default_message
        self.details = details
        super().__init__(self.message)

    @property
    def name(self) -> str:
        return type(self).__name__

    @classmethod
    def readable_by_owner(cls, name: str) -> bool:
        """Whether the error named ``name`` (``Ferry.NoValidHost``) has a message written for the
        server's owner (its ``owner_readable``). Any other name (``States.Timeout``,
        ``Lambda.Unknown``, one Ferry does not define) has not."""
        err_cls = FerryError.registry.get(name)
        return err_cls is not None and err_cls.owner_readable

    @classmethod
    def from_name(cls, name: str, message: str) -> FerryError:
        """Rebuild a typed error from its public name (unknown names become HostOperationFailed)."""
        err_cls = FerryError.registry.get(name, HostOperationFailed)
        return err_cls(message)


# --- API-facing errors --------------------------------------------------------------------------


class BadRequest(FerryError):
    http_status = 400
    api_kind = "badRequest"
    default_message = "The request is invalid."
    owner_readable = True


class Forbidden(FerryError):
    http_status = 403
    api_kind = "forbidden"
    default_message = "Policy does not allow this operation."
    owner_readable = True


class Unauthorized(FerryError):
    http_status = 401
    api_kind = "unauthorized"
    default_message = "The request you have made requires authentication."
    owner_readable = True


class NotFound(FerryError):
    http_status = 404
    api_kind = "itemNotFound"
    default_message = "Resource could not be found."
    owner_readable = True


class InstanceNotFound(NotFound):
    pass


class FlavorNotFound(NotFound):
    pass


class FlavorAccessNotFound(NotFound):
    """The project has no access to the flavor (or the flavor is public and has no access list)."""


class ImageNotFound(NotFound):
    pass


class CellNotFound(NotFound):
    owner_readable = False  # names a cell


class ServerGroupNotFound(NotFound):
    pass


class Conflict(FerryError):
    http_status = 409
    api_kind = "conflictingRequest"
    default_message = "There was a conflict when trying to complete your request."


class UnexpectedTaskState(Conflict):
    """A compare-and-swap on task_state found another operation in progress."""


class InstanceInvalidState(Conflict):
    owner_readable = True


class InstanceNotReady(Conflict):
    """The server has no host (its build never placed it, or a failed one left none)."""

    owner_readable = True


class OverQuota(Forbidden):
    pass


# --- Placement and scheduling --------------------------------------------------------------------


class AllocationConflict(FerryError):
    """Provider or consumer generations kept changing: the bounded retries ran out."""

    http_status = 409
    api_kind = "conflictingRequest"


class InsufficientCapacity(FerryError):
    """A claim does not fit the provider's inventory."""

    http_status = 409
    api_kind = "conflictingRequest"


class GroupPolicyConflict(FerryError):
    """A claim would break its server group's policy: another member was placed since the hosts were read."""

    http_status = 409
    api_kind = "conflictingRequest"


class NoValidHost(FerryError):
    # How every scheduling failure's message starts (the scheduler's, and a workflow's fault): the
    # API tells one by it in a server's fault.
    MESSAGE_START = "No valid host was found"
    default_message = f"{MESSAGE_START}."
    # The owner reads why the server could not be placed (the API words it for members).
    owner_readable = True


# --- Host operations (sent by the host agent with SendTaskFailure) -------------------------------


class HostOperationFailed(FerryError):
    """A host operation failed for a reason without a more precise type."""


class HypervisorError(HostOperationFailed):
    """libvirt refused or failed an operation."""


class SpawnFailed(HostOperationFailed):
    pass


class ImageDownloadFailed(HostOperationFailed):
    pass


class DiskCopyFailed(HostOperationFailed):
    pass


class ResizeClaimFailed(HostOperationFailed):
    pass


class OperationAbandoned(HostOperationFailed):
    """The operation's workflow stopped waiting for it (its Task timed out), so the host agent
    stopped its disk streams part way; nobody takes this answer."""

    default_message = "The operation's workflow stopped waiting for it: it was stopped part way."


class GuestNotFound(HostOperationFailed):
    pass


class InvalidOperation(HostOperationFailed):
    """The agent received a message it cannot act on (unknown operation, bad arguments)."""


class HostNotMapped(FerryError):
    """A host reported (or was named) without being mapped to a cell."""


class HostMappedElsewhere(Conflict):
    """A host is mapped to another cell: a host with servers recorded in one cell is never moved to another."""


class BuildFailed(FerryError):
    """A server could not be built; the instance fault holds the cause."""


class InventoryInUse(FerryError):
    """An inventory update would leave a provider with less capacity than its allocations use."""

    http_status = 409
    api_kind = "conflictingRequest"


class ResourceProviderNotFound(NotFound):
    """No resource provider has the given uuid, host or node."""

    owner_readable = False  # names a provider or a host


class DeleteFailed(FerryError):
    """A server could not be deleted; the instance fault holds the cause."""


class PowerActionFailed(FerryError):
    """os-stop or os-start failed on the host; the instance fault holds the cause."""


# --- Local stack ---------------------------------------------------------------------------------


class LocalStackError(FerryError):
    """The local stack could not be built, started or kept running."""


class TemplateError(LocalStackError):
    """template.yaml uses something the local stack cannot resolve, or resolves to a conflict."""


class HostsNotReporting(LocalStackError):
    """Some host agents of the local stack never reported a heartbeat."""


# --- Compute API ---------------------------------------------------------------------------------


class NotAcceptable(FerryError):
    """The requested microversion is outside what the API supports.

    Nova answers 406 under the generic ``computeFault`` key (406 has no fault name of its
    own there), and so does Ferry.
    """

    http_status = 406
    api_kind = "computeFault"
    default_message = "The requested API version is not supported."
    owner_readable = True


class InvalidPolicy(FerryError):
    """The policy file cannot be read, or names a rule the policy language does not know."""


class InstanceIsLocked(Conflict):
    owner_readable = True


class FlavorExists(Conflict):
    pass


class FlavorAccessExists(Conflict):
    """The project has access to the flavor already, or the flavor is public (anyone's)."""


# --- Fault injection -----------------------------------------------------------------------------


class InjectedFault(FerryError):
    """A failure armed on purpose at a named point (tests and drills; off unless configured)."""


# --- Moves API -----------------------------------------------------------------------------------


class InstanceNotResized(BadRequest):
    """Confirm or revert found no finished migration for the server."""

    default_message = "Instance has not been resized."


class CannotResizeToSameFlavor(BadRequest):
    default_message = "When resizing, instances must change flavor!"


class CannotResizeDisk(BadRequest):
    """The new flavor cannot hold the server's disks (zero root disk, or a shrink)."""


class ComputeHostNotFound(BadRequest):
    """A migrate named a host that is not a known compute host (Nova answers 400 here)."""

    owner_readable = False  # names a host


class CannotMigrateToSameHost(BadRequest):
    default_message = "Cannot migrate to the host where the server exists."


class ComputeServiceUnavailable(Conflict):
    """The server's host is down: a move cannot start from it."""

    default_message = "Service is unavailable at this time."
    owner_readable = True  # says which of the move's hosts is down, never its name


class BuildRequestChanged(Conflict):
    """A server's build request kept changing while the boot workflow handed it to its cell (retried)."""


class MigrationInProgress(Conflict):
    """Another confirm or revert took the server's migration first."""

    owner_readable = True


class InvalidQuotaDefault(FerryError):
    """A ``FERRY_QUOTA_*`` setting is not a valid limit."""


# --- Resize workflow -----------------------------------------------------------------------------


class MoveNotPrepared(FerryError):
    """A resize execution names a migration or instance the compute API did not prepare for it
    (missing, another instance's, or no longer in ``pre-migrating`` / ``resize_prep``)."""


# --- Confirm and revert --------------------------------------------------------------------------


class MigrationNotFound(NotFound):
    """No migration has the given uuid for the given instance in that cell."""


class UnexpectedMigrationState(Conflict):
    """A confirm, revert or volume execution found its records in another state than it starts
    from (an execution started twice, or by hand at the wrong time); it changed nothing."""


class ConfirmResizeFailed(FerryError):
    """A confirm did not complete; the migration is in error and the instance fault says what is left where."""


class RevertResizeFailed(FerryError):
    """A revert did not complete; the instance fault says where the guest, disks and allocations are."""


class MoveNotSettled(FerryError):
    """A move failed and could not be settled: its rollback could not be recorded, or whether its
    last step had committed could not be read. ``ferry audit`` reports what is left."""


class MoveStillRunning(FerryError):
    """The move's workflow still runs although the step that waited for it failed: what becomes of
    the server is not known yet (a drain's RecordFailure is retried until that workflow ends)."""


class VolumeNotFound(NotFound):
    """No such volume (or another project's)."""


class VolumeInUse(BadRequest):
    """The volume is attached, or being attached or detached, elsewhere: Nova's InvalidVolume (400)."""


class VolumeNotAttached(NotFound):
    """The volume is not attached to this server."""


class VolumeOperationFailed(FerryError):
    """Attaching or detaching a volume failed; the instance action's event says why."""


class InvalidWorkflowInput(BadRequest):
    """An execution's input does not match the ``*.input.schema.json`` beside its state machine."""

    owner_readable = False  # repeats the execution's input: queue URLs, the account


class InvalidStepInput(FerryError):
    """A workflow step received input that does not match its schema."""


class DatabaseUnavailable(FerryError):
    """A database could not serve a workflow step or an API request for a moment: its connection
    was refused or lost, or PostgreSQL ended the transaction as the losing side of a deadlock or a
    serialization conflict, or a lock (SQLite's write lock) was not had in time. Every state
    running a step retries it (the steps are idempotent); what the step committed before stays.
    The API answers it 503, Nova's ``serviceUnavailable``: the caller may try again."""

    http_status = 503
    api_kind = "serviceUnavailable"


class DatabaseNotConfigured(FerryError):
    """A function on AWS Lambda has no API database URL: the embedded SQLite default would give
    each execution environment a database of its own."""


class SettingInvalid(FerryError):
    """A ``FERRY_*`` variable holds what its setting cannot be (a number setting that is no number)."""

    default_message = "A Ferry setting cannot be read."


class WorkflowNotConfigured(FerryError):
    """The state machine ARN for a workflow is not set in this function's environment."""


class ExecutionNameTaken(Conflict):
    """An execution of another request holds the name a workflow was to start under."""


# --- Cross-cell confirm and revert


class CellCopyNotHidden(Conflict):
    """A copy of a server that a cross-cell confirm, revert or delete would remove from a cell is
    visible there: it is the server, so it is left alone."""


# --- Drain webhook and signed callbacks ----------------------------------------------------------


class WebhookNotConfigured(FerryError):
    """No webhook secret is configured (``DrainWebhookSecret``): signed requests cannot be checked
    and signed callbacks cannot be sent, so the webhook refuses everything."""

    http_status = 503
    api_kind = "computeFault"
    default_message = "The drain webhook is not configured: no webhook secret is set."


class WebhookSignatureInvalid(Unauthorized):
    """X-Ferry-Signature or X-Ferry-Timestamp is missing or malformed, or the signature does not
    match the body under the configured secret."""


class WebhookTimestampStale(Unauthorized):
    """A correctly signed request whose X-Ferry-Timestamp lies too far in the past or the future."""


class WebhookReplayed(Conflict):
    """A signature already used by another delivery: the request was captured and sent again."""


class WebhookDeliveryConflict(Conflict):
    """The delivery id is being answered right now, or was used before for a different request."""


class WebhookRequestInvalid(BadRequest):
    """The delivery id is missing or too long, or the body is not a valid drain request."""


# --- drains -------------------------------------------------------------------------------------


class DrainNotFound(NotFound):
    """No drain has this id (or the server is not part of it)."""


class DrainInvalidState(Conflict):
    """The drain's status does not allow this action, or its targets are being drained already."""


class DrainTooLarge(BadRequest):
    """The drain's hosts or cell hold more servers than one drain moves."""


class DrainFailed(FerryError):
    """A drain ended with servers left on its targets (the drain's message says how many and why)."""


class DrainWorkflowEnded(FerryError):
    """A drain's workflow ended (stopped, timed out, failed) or never started, and did not finish the drain."""
