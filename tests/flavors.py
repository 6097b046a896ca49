"""Flavors as the host agent receives them in operation messages (the shape ``protocol`` validates)."""

from __future__ import annotations

from typing import Any

TINY: dict[str, Any] = {"flavorid": "1", "name": "m1.tiny", "vcpus": 1, "memory_mb": 512, "root_gb": 1,
                        "ephemeral_gb": 0, "swap": 0}
SMALL: dict[str, Any] = {"flavorid": "2", "name": "m1.small", "vcpus": 2, "memory_mb": 1024, "root_gb": 1,
                         "ephemeral_gb": 0, "swap": 0}
