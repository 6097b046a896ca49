"""Ferry's scheduler: where a server goes, with alternates for reschedules.

:func:`select_destinations` asks placement for allocation candidates (a bounded, randomised
batch of the providers with room), runs the host filters (:mod:`ferry.scheduler.filters`) and
the weighers (:mod:`ferry.scheduler.weighers`) over them and then claims the best host in
placement; :func:`claim_alternate` moves a claim to an alternate; :func:`alternates_for` lists
them again for a claim an earlier run made.
"""

from ferry.scheduler.host_state import HostState, SchedulingSpec, build_spec
from ferry.scheduler.manager import alternates_for, claim_alternate, plan_destination, select_destinations
from ferry.scheduler.selection import Selection

__all__ = ["HostState", "SchedulingSpec", "Selection", "alternates_for", "build_spec", "claim_alternate",
           "plan_destination", "select_destinations"]
