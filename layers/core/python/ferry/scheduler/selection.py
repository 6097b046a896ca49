"""What the scheduler hands back: a chosen (or alternate) destination and its allocations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Selection:
    """A destination compute node and the allocations a claim on it holds (or would hold).

    Params:
        host: the compute host.
        node: the compute node (the resource provider's name).
        cell: the name of the host's cell.
        provider_uuid: the node's resource provider.
        allocations: ``{rp_uuid: {resource_class: amount}}`` for the instance.
    """

    host: str
    node: str
    cell: str
    provider_uuid: str
    allocations: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what Step Functions carries between steps)."""
        return {
            "host": self.host,
            "node": self.node,
            "cell": self.cell,
            "provider_uuid": self.provider_uuid,
            "allocations": {rp: dict(resources) for rp, resources in self.allocations.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Selection:
        """The Selection :meth:`to_dict` made (unknown keys are ignored)."""
        return cls(
            host=data["host"],
            node=data["node"],
            cell=data["cell"],
            provider_uuid=data["provider_uuid"],
            allocations={rp: {rc: int(n) for rc, n in resources.items()}
                         for rp, resources in (data.get("allocations") or {}).items()},
        )
