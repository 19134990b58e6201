"""How many passes over the cache a schedule reads. The stream loops when the schedule outruns
the cache (every consumer starts its next epoch with a new shuffle), so a schedule longer than
the cache trains on its documents again; a run says so at its start, and notes each boundary.

The cache records its size in teacher tokens; the student's count differs by the tokenizers'
ratio, which is measured on the first rows of the first shard (re-tokenized as the stream does).
The schedule's tokens also count padding and the context a long document's continuation re-reads,
so the figure is an estimate, said as one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.compute as pc

from pipeline.cache.schema import TEXT, TOKEN_IDS, iter_shard_batches
from pipeline.tokenizer import TextTokenizer
from stage2_train.data.plan import DataPlan
from stage2_train.data.shards import verified_shard

SAMPLE_ROWS = 256  # documents re-tokenized for the student-to-teacher token ratio


@dataclass(frozen=True)
class CachePasses:
    """The schedule's tokens against the cache's, in the student's tokens."""

    schedule_tokens: int
    cache_tokens: int  # estimated: the cache's teacher tokens times the sampled ratio
    sampled_documents: int

    @property
    def epochs(self) -> float:
        return self.schedule_tokens / max(self.cache_tokens, 1)

    def note(self) -> str:
        head = (
            f"the schedule reads {self.schedule_tokens:,} tokens, about {self.epochs:.2f} epochs "
            f"of the cache (~{self.cache_tokens:,} student tokens, the ratio to its teacher "
            f"tokens measured on {self.sampled_documents} documents)"
        )
        if self.epochs <= 1:
            return head
        return head + "; its documents repeat from the second epoch on, each boundary is logged"


def cache_passes(plan: DataPlan, teacher_tokens: int, schedule_tokens: int,
                 tokenizer: TextTokenizer) -> CachePasses:  # fmt: skip
    """Estimate from the first rows of the cache's first shard (one verified read)."""
    path = verified_shard(plan, plan.shards[0])
    batch = next(iter_shard_batches(path, [TEXT, TOKEN_IDS], SAMPLE_ROWS, use_threads=False))
    texts = batch.column(TEXT).to_pylist()
    teacher = int(pc.sum(pc.list_value_length(batch.column(TOKEN_IDS))).as_py() or 0)
    student = int(tokenizer.encode_concatenated(texts, add_eos=True).lengths.sum())
    ratio = student / max(teacher, 1)
    return CachePasses(schedule_tokens, round(teacher_tokens * ratio), len(texts))


def epoch_boundary(step: int, epoch: int) -> str:
    """The line a step whose documents begin a new pass over the cache logs (epochs from 1)."""
    return (
        f"step {step}: the data stream began epoch {epoch + 1} of the cache; the documents "
        "from here on were trained on before"
    )
