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


def ranks(teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """Every id's rank [n, V] in its row's descending order, equal values by the lower id (the
    top-k rule of pipeline.scoring.head_kernels)."""
    order = torch.sort(teacher_logprobs, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank
