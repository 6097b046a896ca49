"""What a server's owner reads of a failure in a fault: an error written for them, or its name alone."""

from __future__ import annotations

import pytest

from ferry import errors
from ferry.workflows import fault_details, owner_cause

# Errors whose messages name a host, a cell, a provider, a consumer or a workflow's input.
NAMING_INFRASTRUCTURE = [
    errors.ComputeHostNotFound("Compute host cmp-17 could not be found."),
    errors.CellNotFound("Cell cell3 could not be found."),
    errors.ResourceProviderNotFound("Host cmp-17 has no resource provider."),
    errors.CellCopyNotHidden("Instance 1 is visible in cell cell3: it is not a copy to remove."),
    errors.UnexpectedTaskState("Instance 1 is in task_state None on cmp-17: not a volume attach under way."),
    errors.UnexpectedMigrationState("Migration 2 is error and instance 1 is in vm_state active on cmp-17."),
    errors.AllocationConflict("Provider 5 generation changed for consumer 1."),
    errors.InsufficientCapacity("Provider 5 has 2 of 4 VCPU left."),
    errors.GroupPolicyConflict("Member 3 is on cmp-17."),
    errors.HostMappedElsewhere("Host cmp-17 is mapped to cell cell3."),
    errors.InventoryInUse("Provider 5 uses 4 VCPU."),
    errors.InvalidWorkflowInput("Input names queue https://sqs.us-east-1.amazonaws.com/123456789012/q."),
    errors.HypervisorError("libvirt: /var/lib/ferry/instances/1/disk: Permission denied"),
    errors.Conflict("Aggregate 4 already has host cmp-17."),
]

WRITTEN_FOR_THE_OWNER = [
    errors.NoValidHost("No valid host was found for 1: 3 compute node(s) in the allowed cells; RamFilter removed 3."),
    errors.InstanceInvalidState("Cannot 'resize' instance 1 while it is in task_state deleting."),
    errors.InstanceIsLocked("Instance 1 is locked."),
    errors.OverQuota("Quota exceeded for cores."),
    errors.InstanceNotFound("Instance 1 could not be found."),
    errors.ComputeServiceUnavailable("The source host of migration 2 is down."),
    errors.CannotResizeDisk("Resizing to a smaller disk is not allowed."),
    errors.MigrationInProgress("Another confirm or revert took migration 2 first."),
]


def _as_step_error(exc: errors.FerryError) -> dict[str, str]:
    return {"Error": exc.name, "Cause": exc.message}


@pytest.mark.parametrize("exc", NAMING_INFRASTRUCTURE, ids=lambda e: e.name)
def test_an_error_naming_infrastructure_shows_the_owner_its_name_and_admins_its_text(exc):
    error = _as_step_error(exc)

    assert owner_cause(error) == exc.name
    assert fault_details(error) == f"Cause: {exc.message}"
    assert fault_details(error, "Cleanup on host cmp-17 failed.") == \
        f"Cleanup on host cmp-17 failed. Cause: {exc.message}"


@pytest.mark.parametrize("exc", WRITTEN_FOR_THE_OWNER, ids=lambda e: e.name)
def test_an_error_written_for_the_owner_shows_its_message_and_nothing_more_to_admins(exc):
    error = _as_step_error(exc)

    assert owner_cause(error) == exc.message
    assert fault_details(error) is None
    assert fault_details(error, "Cleanup on host cmp-17 failed.") == "Cleanup on host cmp-17 failed."


@pytest.mark.parametrize("name", ["States.Timeout", "Lambda.Unknown", "Ferry.NoSuchError", ""])
def test_a_name_ferry_does_not_define_is_never_read_by_the_owner(name):
    error = {"Error": name, "Cause": "Task timed out after 28.00 seconds: arn:aws:lambda:us-east-1:123456789012"}

    assert owner_cause(error) == (name or "Unknown error")
    assert "arn:aws:lambda" in (fault_details(error) or "")


def test_an_error_is_read_by_the_owner_only_where_it_says_so():
    # A new error class is the admins' until it is written for the owner, whatever status the API answers.
    class WordedForAdmins(errors.FerryError):
        http_status = 409

    try:
        assert not errors.FerryError.readable_by_owner(WordedForAdmins.__name__)
        assert errors.FerryError.readable_by_owner(errors.InstanceNotFound.__name__)
    finally:
        del errors.FerryError.registry[WordedForAdmins.__name__]


# Reviewed one by one: none of their raise sites names a host, node, cell, provider, path, queue,
# ARN or database (NoValidHost's admin wording is reworded for members by the API). A class added
# here, or one inheriting ``owner_readable`` from a readable base, needs the same review.
READ_BY_OWNERS = {
    "BadRequest", "CannotMigrateToSameHost", "CannotResizeDisk", "CannotResizeToSameFlavor",
    "ComputeServiceUnavailable", "DrainNotFound", "DrainTooLarge", "FlavorAccessNotFound", "FlavorNotFound",
    "Forbidden", "ImageNotFound", "InstanceInvalidState", "InstanceIsLocked", "InstanceNotFound",
    "InstanceNotReady", "InstanceNotResized", "MigrationInProgress", "MigrationNotFound", "NoValidHost",
    "NotAcceptable", "NotFound", "OverQuota", "ServerGroupNotFound", "Unauthorized", "VolumeInUse",
    "VolumeNotAttached", "VolumeNotFound", "WebhookRequestInvalid", "WebhookSignatureInvalid",
    "WebhookTimestampStale",
}


def test_the_errors_read_by_owners_are_the_reviewed_ones():
    readable = {name.removeprefix(errors.PREFIX) for name in errors.FerryError.registry
                if errors.FerryError.readable_by_owner(name)}

    assert readable == READ_BY_OWNERS
