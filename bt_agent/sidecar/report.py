"""What the drain could not save: files not durable, checkpoints not committed and why."""

from __future__ import annotations

from dataclasses import dataclass, field

from bt_agent.log import shown

SHOWN = 10


@dataclass(frozen=True)
class DrainReport:
    not_durable: list[str]  # files (relative to the checkpoint dir) not saved in time
    not_committed: dict[str, str] = field(default_factory=dict)  # checkpoint -> why
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.not_durable and not self.not_committed

    def describe(self) -> str:
        """``2 checkpoint file(s) not durable: ...; not committed: checkpoint-2, its writer
        ended while writing model.pt``."""
        parts = []
        if self.not_durable:
            names = ", ".join(shown(name) for name in self.not_durable[:SHOWN])
            more = " ..." if len(self.not_durable) > SHOWN else ""
            parts.append(f"{len(self.not_durable)} checkpoint file(s) not durable: {names}{more}")
        if self.not_committed:
            reasons = "; ".join(f"{shown(name)}, {why}" for name, why in self.not_committed.items())
            parts.append(f"not committed: {reasons}")
        return "; ".join(parts)
