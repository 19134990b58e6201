"""The draws of a sampled cache (stage 1's `--topk-mode sampled`; docs/cache-columns.md): per
position, K ids drawn from the teacher's softmax at temperature 1 by inverting its cumulative
distribution at uniforms that depend on the run's seed and the document alone, with each id's
rank in the teacher's descending order. What stage 2 estimates from them:
pipeline.distillation.sampled.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def document_uniforms(ids: np.ndarray, k: int, seed: int) -> np.ndarray:
    """The uniforms [tokens, k] in [0, 1) that a document's draws invert: from the run's seed and
    the document's token ids alone, so that a rerun, another batching or another worker draws
    the same ids."""
    digest = hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=8).digest()
    rng = np.random.default_rng([seed, int.from_bytes(digest, "little")])
    return rng.random((len(ids), k))


def cumulative(teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Each row's cumulative distribution [n, V] (float64, for the tail's resolution), normalized
    to end at 1: what draw_ids inverts."""
    cdf = torch.cumsum(teacher_logprobs.double().exp(), dim=-1)
    return cdf / cdf[..., -1:]


def draw_ids(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Ids [n, K] drawn from each row of `cdf` (cumulative) at `uniforms` [n, K] in [0, 1)."""
    ids = torch.searchsorted(cdf, uniforms.double().contiguous(), right=True)
    return ids.clamp_(max=cdf.shape[-1] - 1)


def drawn_ranks(teacher_logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each drawn id's rank [n, K] in its row's descending order, equal values by the lower id
    (the top-k rule of pipeline.scoring.head_kernels), without sorting the vocabulary.

    An id's rank is how many ids come before it: a larger value, or an equal one at a lower id.
    Each log-probability becomes an int64 key that orders as that rule does (its fp32 bits made
    monotone, with the reversed id below them), so keys are distinct, and the counts of keys
    above the K drawn ones come from one searchsorted and a histogram: O(V log K) a row where a
    sort is O(V log V) (measured against the sort: benchmarks/results/2026-12-03/)."""
    vocab = teacher_logprobs.shape[-1]
    id_bits = max(vocab - 1, 1).bit_length()
    # + 0.0: -0.0 sorts as 0.0 does; in place from here, two int64 values a logit at the most
    keys = (teacher_logprobs.float() + 0.0).view(torch.int32).long()
    sign = keys >> 31  # negative floats count downwards: their bits made monotone
    keys ^= sign.bitwise_and_(0x7FFFFFFF)
    del sign
    keys <<= id_bits
    keys |= (1 << id_bits) - 1 - torch.arange(vocab, device=ids.device)  # lower ids first
    thresholds, order = torch.sort(keys.gather(-1, ids), dim=-1)
    # below[v]: how many drawn keys are below key v; key v is above drawn key j iff j < below[v]
    below = torch.searchsorted(thresholds, keys)
    del keys
    counts = torch.zeros(len(ids), ids.shape[-1] + 1, dtype=torch.long, device=ids.device)
    one = torch.ones((), dtype=torch.long, device=ids.device)
    counts.scatter_add_(-1, below, one.expand_as(below))
    above = vocab - counts.cumsum(-1)[:, :-1]  # keys above each threshold: all but those below
    return torch.empty_like(ids).scatter_(-1, order, above)
