"""Ferry: moves servers between hosts and cells with a Nova-compatible compute API."""
