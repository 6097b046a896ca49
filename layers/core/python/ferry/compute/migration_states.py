"""Migration statuses and types (Nova's names), for the API and the workflow steps alike."""

# Statuses.
PRE_MIGRATING = "pre-migrating"
MIGRATING = "migrating"
POST_MIGRATING = "post-migrating"
FINISHED = "finished"
CONFIRMING = "confirming"
CONFIRMED = "confirmed"
REVERTING = "reverting"
REVERTED = "reverted"
ERROR = "error"
# Only a cross-cell move's target copy of its migration takes it: CheckMoveCommitted's mark of a
# move found not committed, whose rollback removes that copy.
FAILED = "failed"

# Statuses of a migration whose move is under way (its resize workflow has not ended it).
MOVING = (PRE_MIGRATING, MIGRATING, POST_MIGRATING)

# Statuses of a migration whose confirm or revert is under way.
SETTLING = (CONFIRMING, REVERTING)

# Types.
RESIZE = "resize"
MIGRATION = "migration"
