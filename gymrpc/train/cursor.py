"""Where the trainer is in its task list: a seeded shuffle per epoch and a position in it.

Saved as three integers (`to_json`), so a resumed run draws exactly the batches the crashed one
would have drawn next: every epoch's order is a function of (seed, epoch) alone, never of an
RNG that advanced along the way.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass
class DataCursor:
    size: int
    """Tasks in the list."""
    seed: int = 0
    epoch: int = 0
    position: int = 0
    """Tasks of `epoch`'s order already handed out."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a data cursor needs at least one task, got {self.size}")
        if self.epoch < 0 or not 0 <= self.position <= self.size:
            raise ValueError(f"cursor position {self.epoch}:{self.position} is outside 0..{self.size}")

    def order(self, epoch: int) -> list[int]:
        """Task indices of `epoch`, shuffled by (seed, epoch)."""
        indices = list(range(self.size))
        random.Random(f"gymrpc.train:{self.seed}:{epoch}").shuffle(indices)
        return indices

    def take(self, count: int) -> list[int]:
        """The next `count` task indices, crossing into the next epoch's order when one runs out."""
        if count < 1:
            raise ValueError(f"take at least one task, got {count}")
        out: list[int] = []
        while len(out) < count:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
            order = self.order(self.epoch)
            step = min(count - len(out), self.size - self.position)
            out += order[self.position : self.position + step]
            self.position += step
        return out

    def to_json(self) -> dict[str, int]:
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DataCursor:
        return cls(int(data["size"]), int(data["seed"]), int(data["epoch"]), int(data["position"]))
