"""A rank's DataLoader: each data-loader worker plays one of the rank's consumers, and a data error
raised in a worker reaches the training loop as itself."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.errors import VocagnoError
from stage2_train.data.plan import DataPlan
from stage2_train.data.position import DataState, StreamPosition
from stage2_train.data.streams import consumer_stream
from stage2_train.stop_request import ignore_interrupts_in_workers


class CacheStream(IterableDataset):
    """One rank's stream: each data-loader worker plays one of the rank's consumers.

    `first_consumer` rotates the roles so that a resumed loader's first batch comes from the
    consumer whose turn it was (DataLoader always starts with worker 0).
    """

    def __init__(
        self, plan: DataPlan, rank: int, positions: list[StreamPosition], first_consumer: int
    ):
        super().__init__()
        if len(positions) != plan.consumers_per_rank:
            raise ValueError("one position per consumer of this rank is needed")
        self.plan, self.rank = plan, rank
        self.positions, self.first_consumer = positions, first_consumer

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        local = ((info.id if info else 0) + self.first_consumer) % self.plan.consumers_per_rank
        consumer = self.rank * self.plan.consumers_per_rank + local
        try:
            for batch in consumer_stream(self.plan, consumer, self.positions[local]):
                batch["consumer"] = local
                yield batch
        except VocagnoError as exc:
            # Handed over as a value: DataLoader would re-raise it with the worker's traceback
            # pasted into the message, and the user should see one clear line.
            yield {"error": exc}


def batches(loader: DataLoader) -> Iterator[dict]:
    """The loader's micro-batches; a data error from a worker is raised here, as itself."""
    for batch in loader:
        if "error" in batch:
            raise batch["error"]
        yield batch


def make_loader(
    plan: DataPlan, rank: int, state: DataState, pin_memory: bool = False
) -> DataLoader:
    dataset = CacheStream(plan, rank, list(state.positions), state.next_consumer)
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=plan.num_workers,
        pin_memory=pin_memory,
        prefetch_factor=4 if plan.num_workers else None,
        worker_init_fn=ignore_interrupts_in_workers,
    )
