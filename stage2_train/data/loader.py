"""A rank's DataLoader: its data-loader workers play the rank's consumers in turn, and a data error
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
    """One rank's stream: its consumers' micro-batches in turn (plan.rank_consumers), the turns
    dealt to data-loader workers: worker w of W plays turns w, w + W, ... of each round.

    `first` (the index in the rank's consumer list whose turn is next) rotates the roles so that a
    resumed loader's first batch comes from that consumer (DataLoader always starts with worker 0).
    """

    def __init__(self, plan: DataPlan, rank: int, positions: dict[int, StreamPosition], first: int):
        super().__init__()
        self.plan, self.consumers = plan, plan.rank_consumers(rank)
        if set(positions) != set(self.consumers):
            raise ValueError("one position per consumer of this rank is needed")
        self.positions, self.first = positions, first

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        count = len(self.consumers)
        mine = [
            self.consumers[(self.first + turn) % count] for turn in range(worker, count, workers)
        ]
        try:
            streams = [(c, iter(consumer_stream(self.plan, c, self.positions[c]))) for c in mine]
            while True:
                for consumer, stream in streams:
                    batch = next(stream)
                    batch["consumer"] = consumer
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


def worker_death(exc: BaseException) -> VocagnoError | None:
    """The one line for a data-loader worker that died (killed, out of memory), or None when
    `exc` is something else. torch reports it from its SIGCHLD handler wherever the training loop
    is (`DataLoader worker (pid N) is killed by signal: ...`), or the loop finds the worker's end
    of the queue closed first (ConnectionResetError, EOFError); call only with workers."""
    if isinstance(exc, RuntimeError) and not str(exc).startswith("DataLoader worker"):
        return None
    if not isinstance(exc, RuntimeError | ConnectionError | EOFError):
        return None
    reason = str(exc).splitlines()[0].rstrip(". ") if str(exc) else type(exc).__name__
    return VocagnoError(
        f"a data-loader worker died ({reason}): killed, or out of memory; the finished "
        "checkpoints are kept: run the same command to resume from the last one"
    )


def make_loader(
    plan: DataPlan,
    rank: int,
    state: DataState,
    first: int = 0,
    pin_memory: bool = False,
    step_micro_batches: int = 1,
) -> DataLoader:
    """`first`: the rank's micro-batches taken so far (the next one is consumer turn `first`).
    The workers keep a whole step's micro-batches (`step_micro_batches`) ready ahead: the trainer
    takes a step's micro-batches before its first forward pass, so they are made during the
    previous step instead of while the device waits. What is read never depends on it."""
    dataset = CacheStream(plan, rank, state.positions, first % plan.consumers_per_rank)
    ahead = max(4, -(-step_micro_batches // plan.workers)) if plan.workers else None
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=plan.workers,
        pin_memory=pin_memory,
        prefetch_factor=ahead,
        worker_init_fn=ignore_interrupts_in_workers,
    )
