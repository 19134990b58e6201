"""Tokens to chunks for the paper's chunk baseline (Table 2; sections 2 and 6.1).

The paper gives chunk-to-chunk mapping (each sequence cut into n equal chunks, chunk c to chunk
c) and "the same teacher loss-based guidance". What it leaves open is chosen here and documented
in docs/guidance.md:
  - the data path marks where each chunk starts (`chunk_start`, per target token); a chunk is the
    run of target tokens from one start to the next, so it never spans two documents. Rows of a
    micro-batch are consecutive windows of one stream, so a chunk cut by a row boundary stays one
    chunk; a chunk cut by a micro-batch boundary is two pieces, each selected on its own;
  - chunk teacher loss = Φ (`--aggregate`) over the scored teacher tokens of teacher chunk c: the
    data path gives that value to every student token of student chunk c;
  - chunk student loss = `--chunk-student-aggregate` (mean by default; max or sum) of L_S over the
    chunk's valid target tokens;
  - chunk excess = chunk student loss - chunk teacher loss; a chunk whose teacher chunk has no
    scored token is an unmapped chunk, handled by `--unmapped` at the chunk level;
  - out of n candidate chunks in the scope exactly k = ceil(topk * n) chunks are kept, and every
    valid token of a kept chunk is kept (pipeline.guidance).

No Python loop and no host sync: chunk ids are a cumulative sum of the starts and are bounded by
the number of positions, so every per-chunk tensor has the positions' size. Reductions are
deterministic: sums are differences of one float64 cumulative sum (chunks are contiguous), and
first/last positions and maxima are scatter min/max (order-independent), never atomic float adds.
"""

from __future__ import annotations

import torch


def chunk_ids(chunk_start: torch.Tensor) -> torch.Tensor:
    """Flat chunk index of every position, in position order (row-major); the first position
    always starts a chunk. Ids are < the number of positions."""
    start = chunk_start.flatten().clone()
    start[0] = True
    return torch.cumsum(start.long(), dim=0) - 1


def reduce_to_chunks(
    chunk: torch.Tensor,
    student_loss: torch.Tensor,
    teacher_loss: torch.Tensor,
    valid: torch.Tensor,
    student_aggregate: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per chunk id (as many as positions; ids past the last chunk are unused): the chunk's student
    loss (float32), its teacher loss (NaN: unmapped) and whether it has a valid target token (the
    unused ids have none)."""
    size = chunk.numel()
    device = chunk.device
    position = torch.arange(size, device=device)
    flat_valid = valid.flatten()
    first = torch.full((size,), size - 1, device=device).scatter_reduce(0, chunk, position, "amin")
    last = torch.zeros(size, dtype=torch.long, device=device).scatter_reduce(
        0, chunk, position, "amax"
    )

    def run_sum(values: torch.Tensor) -> torch.Tensor:
        total = torch.cat((values.new_zeros(1), torch.cumsum(values, dim=0)))
        return total[last + 1] - total[first]

    count = run_sum(flat_valid.long())
    student = torch.where(flat_valid, student_loss.flatten().double(), 0.0)
    if student_aggregate == "max":
        masked = torch.where(flat_valid, student, -torch.inf)
        chunk_student = torch.full((size,), -torch.inf, dtype=student.dtype, device=device)
        chunk_student = chunk_student.scatter_reduce(0, chunk, masked, "amax")
    elif student_aggregate in ("mean", "sum"):
        chunk_student = run_sum(student)
        if student_aggregate == "mean":
            chunk_student = chunk_student / count.clamp(min=1)
    else:
        raise ValueError(
            f"chunk student aggregate must be mean, max or sum, not {student_aggregate!r}"
        )
    # Every token of a chunk carries its chunk's teacher loss; take the first token's.
    chunk_teacher = teacher_loss.flatten()[first]
    return chunk_student.float(), chunk_teacher, count > 0
