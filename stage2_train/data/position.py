"""Position. After each micro-batch a consumer's place is (epoch, item, read, row, token): the
document where the next window starts and the token offset inside it. Every micro-batch carries
its consumer's position; a checkpoint stores the last consumed one per consumer, and a resumed
stream re-reads that document and drops `token` tokens (stream packing) or skips its first
`token` targets (documents packing), so it continues exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from stage2_train.data.plan import DataPlan


@dataclass(frozen=True)
class StreamPosition:
    """Where a consumer's token stream continues."""

    epoch: int = 0
    item: int = 0
    read: int = 0
    row: int = 0
    token: int = 0


@dataclass
class DataState:
    """A rank's data position: the last consumed position of each of its consumers, and whose
    turn is next. Saved in every checkpoint."""

    positions: list[StreamPosition]
    next_consumer: int = 0

    @classmethod
    def fresh(cls, plan: DataPlan) -> DataState:
        return cls([StreamPosition() for _ in range(plan.consumers_per_rank)])

    def observe(self, batch: dict) -> None:
        local = batch["consumer"]
        self.positions[local] = StreamPosition(**batch["position"])
        self.next_consumer = (local + 1) % len(self.positions)

    def to_dict(self) -> dict:
        return {
            "positions": [asdict(p) for p in self.positions],
            "next_consumer": self.next_consumer,
        }

    @classmethod
    def from_dict(cls, data: dict) -> DataState:
        return cls([StreamPosition(**p) for p in data["positions"]], data["next_consumer"])
