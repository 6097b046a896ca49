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

# Statuses of a migration whose confirm or revert is under way.
SETTLING = (CONFIRMING, REVERTING)

# Types.
RESIZE = "resize"
MIGRATION = "migration"
