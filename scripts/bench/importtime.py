"""Reading the report of ``python -X importtime``."""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"^import time:\s*(\d+)\s*\|\s*(\d+)\s*\|(\s*)(\S.*?)\s*$")


@dataclass(frozen=True)
class ImportTime:
    """One imported module: its own and cumulative time (microseconds) and its nesting depth."""

    module: str
    self_us: int
    cumulative_us: int
    depth: int


def parse_importtime(stderr: str) -> list[ImportTime]:
    """The modules ``-X importtime`` reported, in the order it printed them; other lines are skipped.

    The depth is the indentation of the module name after the second ``|`` (one space, then two
    per level), so the top-level imports of the command have depth 0.
    """
    entries = []
    for line in stderr.splitlines():
        match = _LINE.match(line)
        if match:
            self_us, cumulative_us, indent, module = match.groups()
            entries.append(ImportTime(module=module, self_us=int(self_us), cumulative_us=int(cumulative_us),
                                      depth=max(0, (len(indent) - 1) // 2)))
    return entries
