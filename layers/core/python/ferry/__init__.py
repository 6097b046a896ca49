"""Ferry: moves servers between hosts and cells with a Nova-compatible compute API.

In a Lambda environment the cyclic garbage collector waits while the function's modules load:
importing SQLAlchemy, the ORM mappings and Ferry builds some 70,000 long-lived objects and
almost no garbage (a few hundred unreachable objects), yet the collector's passes over them
took about a fifth of the import time. The handler's first invocation freezes what was built
and lets the collector run again (:func:`ferry.handlers.freeze_startup_heap`). Elsewhere (the
local stack, the host agent, the command line, tests) nothing changes.
"""

import gc as _gc
import os as _os

# Set by Lambda in every function's environment.
LAMBDA_VARIABLE = "AWS_LAMBDA_FUNCTION_NAME"

collector_paused_for_startup = bool(_os.environ.get(LAMBDA_VARIABLE)) and _gc.isenabled()
if collector_paused_for_startup:
    _gc.disable()
