"""Admin server actions that only change records: ``os-resetState``.

Resetting a server's state is how an operator hands a server back to Ferry after cleaning up
by hand what a fault or a stuck task named (a guest, disks, allocations, a migration): the
server takes the vm_state asked for and loses its task, and nothing else about it changes.
"""

from __future__ import annotations

from ferry import errors
from ferry.auth import RequestContext
from ferry.compute import actions, instances, states
from ferry.compute import api as compute_api
from ferry.observability import logger
from ferry.store.api_models import utcnow
from ferry.store.db import cell_session

# How often a reset reads the server again when a workflow changed it between the read and the write.
_ATTEMPTS = 5


def reset_state(ctx: RequestContext, location: compute_api.Location, state: str) -> None:
    """Set the server's vm_state to ``state`` (``active`` or ``error``) and clear its task_state.

    Whatever the server's state, task or lock, as Nova does: this is the way out of a state no
    other action accepts. Host, node, flavor, power state, allocations, migrations and faults stay
    as they are. The copy changed is the one in the cell the instance mapping names (during a move
    between cells, whichever copy that is, hidden or not). The write is a compare-and-swap on the
    vm_state and task_state just read, so a workflow step that changes the server meanwhile is
    never overwritten unseen: the server is read again and reset from what it is then. The action
    ``resetState`` is recorded, finished, in the same transaction.

    Args:
        state: ``active`` or ``error`` (the body was checked against the schema).

    Raises:
        InstanceNotFound: the server is gone.
        InstanceInvalidState: it is still a build request (no cell yet), or it kept changing.
    """
    vm_state = states.RESET_STATES[state]
    uuid = location.instance_uuid
    for _attempt in range(_ATTEMPTS):
        cell = location.cell
        if cell is None:
            raise errors.InstanceInvalidState(
                f"Cannot 'os-resetState' instance {uuid} while it is in vm_state {states.BUILDING}: it is "
                f"still being scheduled to a cell. Try again once it has one.")
        with cell_session(cell) as session:
            instance = instances.get(session, uuid, include_hidden=True)
            before = (instance.vm_state, instance.task_state)
            try:
                instances.update_cas(session, uuid, {"vm_state": vm_state, "task_state": None},
                                     expected_vm_state=(before[0],), expected_task_state=(before[1],))
            except errors.UnexpectedTaskState:
                logger.info("server changed while being reset; reading it again", extra={"instance_uuid": uuid})
                continue
            record = actions.start_action(session, instance_uuid=uuid, action=actions.RESET_STATE,
                                          request_id=ctx.request_id, user_id=ctx.user_id,
                                          project_id=ctx.project_id)
            record.finish_time = utcnow()
        # A move between cells may have switched the mapping to the other copy meanwhile: reset
        # that one as well, so the server shown is the one reset.
        location = compute_api.locate(ctx, uuid)
        if location.cell is not None and location.cell.id == cell.id:
            logger.info("server state reset", extra={
                "instance_uuid": uuid, "cell": cell.name, "vm_state": vm_state, "previous_vm_state": before[0],
                "previous_task_state": before[1]})
            return
    raise errors.InstanceInvalidState(
        f"Cannot 'os-resetState' instance {uuid}: its state kept changing while it was being reset. Try again.")
