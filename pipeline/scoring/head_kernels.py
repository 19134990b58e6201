"""The arithmetic of the columns stage 1 computes from a chunk of the teacher's logits: the loss,
and the optional views of the teacher's next-token distribution (no second forward pass, no
per-token Python loop), by `--head-kernel` (pipeline.scoring.head applies them to a batch in
chunks). Columns and conventions: docs/cache-columns.md.

For a scored position t (the distribution p = softmax(logits) that predicts token t, the one whose
-log p(token t) is `loss[t]`), in fp32:
  - topk_probs[t]: the K largest p(v), descending;
  - topk_ids[t]:   their token ids, tied probabilities to the lower id (`ranked_topk`);
  - topk_rest[t]:  1 - sum(topk_probs[t]), the mass outside the K (clamped at 0);
  - space_logprob[t]: log sum_{v in S} p(v) with S the space mask (pipeline.space_mask), at least
    log of fp32's smallest normal (-87.3).
Unscored positions (token 0, and a one-token document) hold NaN probabilities and id -1 here; the
writer stores their top-k entries as nulls.

Three kernels compute them (`--head-kernel`, docs/stage1-gpu-path.md):
  - plain: the chunk's logits copied to fp32, log-softmax (another fp32 chunk), the loss and the
    views read from it (pipeline.cross_entropy, the student's definition);
  - fused: reductions over the logits as they are (bf16 on a GPU): their max, then Z and the
    space mask's share of it, the target's logit, and the top k of the logits by blocks
    (top_logits), so no fp32 copy of the chunk is made where the pass is compiled (on CUDA;
    elsewhere it runs eagerly);
  - onepass (`auto` on CUDA): fused's logits, reduced by a Triton kernel that reads each logit
    once (the max and the sums together, rescaled as the max grows), and fused's top k of the
    logits (pipeline.scoring.triton_head: logit_row_sums).
They agree within fp32 rounding (top-k ids exactly where their logits are bf16's: ties go to the
lower id in each), far inside the cache's fp16 storage (tests/test_stage1_head.py,
tests/triton_interpreted.py).
"""

from __future__ import annotations

import functools
import math

import torch

from pipeline.cache.schema import (
    SAMPLE_IDS,
    SAMPLE_LOGPROBS,
    SAMPLE_RANKS,
    SPACE_LOGPROB,
    TOPK_IDS,
    TOPK_PROBS,
    TOPK_REST,
)
from pipeline.cross_entropy import token_log_probs_and_loss, token_loss
from pipeline.scoring import draws

TINY = torch.finfo(torch.float32).tiny  # the space mass's floor (docs/cache-columns.md)
TOPK_BLOCK = 128  # logits per block whose max ranks it for the top k (`top_logits`)


def plain_columns(
    logits: torch.Tensor, targets: torch.Tensor, topk: int, space: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The columns of a chunk [rows, V] from its fp32 log-softmax (`--head-kernel plain`); the
    loss alone is pipeline.cross_entropy.token_loss, bit for bit, with or without the views."""
    if not topk and space is None:
        return {"loss": token_loss(logits, targets)}
    log_probs, loss = token_log_probs_and_loss(logits, targets)
    columns = {"loss": loss}
    if topk:
        values, ids = top_logits(log_probs, topk)
        probs = values.exp()
        columns |= {TOPK_PROBS: probs, TOPK_IDS: ids}
        columns[TOPK_REST] = (1.0 - probs.sum(dim=-1)).clamp_(min=0.0)
    if space is not None:
        columns[SPACE_LOGPROB] = space_logprob(log_probs, space)
    return columns


def space_logprob(log_probs: torch.Tensor, space: torch.Tensor) -> torch.Tensor:
    """log p(S) per row of fp32 log-probabilities [rows, V] (exponentiated in place): the mask's
    mass as one product with its float32 indicator; a mass under fp32's smallest normal reads as
    that bound."""
    mass = log_probs.exp_() @ space.to(log_probs.dtype)  # a float32 indicator: no copy
    return mass.clamp_(TINY, 1.0).log_()


def sampled_columns(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    space: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The loss and, per row of a chunk [rows, V], `k` ids drawn from its fp32 softmax at
    `uniforms` [rows, k] (`--topk-mode sampled`: pipeline.scoring.draws), with each id's
    log-probability and rank; the loss is plain_columns' bit for bit."""
    log_probs, loss = token_log_probs_and_loss(logits, targets)
    ids = draws.draw_ids(draws.cumulative(log_probs), uniforms)
    columns = {
        "loss": loss,
        SAMPLE_IDS: ids,
        SAMPLE_LOGPROBS: log_probs.gather(-1, ids),
        SAMPLE_RANKS: draws.drawn_ranks(log_probs, ids),
    }
    if space is not None:
        columns[SPACE_LOGPROB] = space_logprob(log_probs, space)
    return columns


def fused_columns(
    logits: torch.Tensor, targets: torch.Tensor, topk: int, space: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The same columns as `plain_columns` from reductions over the logits in their own dtype
    (`--head-kernel fused`): loss = log Z - logit[target], the top-k probabilities
    exp(logit - log Z) of the top k of the logits (`top_logits`), and p(S) as the share of S's terms
    exp(logit - max) in their sum over the vocabulary. Compiled (`compiled_pass`), each
    reduction upcasts the logits as it reads them: a read for the max, then Z (and the space
    mask's sum) from the logits less it. The max is taken of the logits as they are, which
    Inductor's one-pass rewrite (`prepare_softmax_online`: the max and Z in one read, two
    exponentials a logit) does not match, a form measured slower on a GPU (docs/stage1-gpu-path.md,
    "One read of the logits")."""
    top = logits.amax(dim=-1, keepdim=True).float()
    shifted = logits.float() - top
    exp = shifted.exp()
    log_sum = exp.sum(dim=-1, keepdim=True).log().squeeze(-1)
    picked = shifted.gather(-1, targets[:, None]).squeeze(-1)
    columns = {"loss": log_sum - picked}
    if topk:
        columns |= topk_columns(logits, topk, top.squeeze(-1) + log_sum)
    if space is not None:
        # a mass under fp32's smallest normal (or none: log 0) reads as that bound, as plain's does
        in_space = torch.where(space, exp, 0.0).sum(dim=-1).log()
        columns[SPACE_LOGPROB] = (in_space - log_sum).clamp(min=math.log(TINY), max=0.0)
    return columns


def topk_blocks(vocabulary: int, k: int) -> int:
    """The whole blocks of TOPK_BLOCK logits whose maxima `top_logits` ranks for a top `k` of
    `vocabulary` logits; 0 where it takes torch.topk of the row in one stage (under 4k blocks)."""
    blocks = vocabulary // TOPK_BLOCK
    return blocks if k and blocks >= 4 * k else 0


def ranked_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of `values` [rows, n], descending, and their indices, equal
    values to the lower index: the first k of a stable descending sort. torch.topk does not
    promise which of equal values it takes, nor their order (on a CPU it varies), and bf16 logits
    tie often in a top 32; with this rule the cached ids are a function of the logits alone, the
    same from every head kernel. torch.topk's values, then the slots holding its k-th value
    refilled with the lowest indices holding it (the r-th such slot takes the r-th, found by
    binary search of a running count of them), then each run of equal values ordered by index
    (one sort of k keys). NaN, a broken teacher's, ranks first, among NaNs as torch.topk picks."""
    n = values.shape[-1]
    top, where = torch.topk(values, k, dim=-1, sorted=True)
    bound = top[:, -1:]
    above = (top != bound).sum(dim=-1, keepdim=True)  # the slots before the k-th's value
    tie = torch.arange(1, k + 1, device=values.device) - above  # >= 1: the slot's rank among ties
    tied_so_far = (values == bound).cumsum(dim=-1, dtype=torch.int32)
    lowest = torch.searchsorted(tied_so_far, tie.clamp(min=1).to(torch.int32))
    where = torch.where(tie >= 1, lowest, where)
    new_run = torch.ones_like(top, dtype=torch.bool)
    new_run[:, 1:] = top[:, 1:] != top[:, :-1]
    run_key = new_run.cumsum(dim=-1) * n
    return top, (run_key + where).sort(dim=-1).values - run_key


def top_logits(
    logits: torch.Tensor, k: int, block_maxima: torch.Tensor | None = None, rank=ranked_topk
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ranked_topk(logits, k)` of a chunk [rows, V], from k of its blocks of TOPK_BLOCK logits:
    one read of the chunk for each block's max (unless `block_maxima` [rows, blocks] holds them:
    onepass's kernel takes them in its own read), then `ranked_topk` of the k blocks ranked first
    by their maxima (and of a last, partial block), a few percent of the row. The k first of the
    row lie in those blocks: a logit outside them has k blocks ranked before its own, each with
    a logit ranked before it (a larger one, or an equal one in a block of lower ids), so values
    and ids are `ranked_topk`'s of the whole row exactly. One stage where the row has under 4k
    blocks. torch.topk of a whole 152k row runs radix passes over it, longer than the whole fused
    loss takes (docs/stage1.md, `bench_stage1_head.py`). `rank`: the head bench's earlier form
    passes torch.topk's picks, to measure what the tie rule costs."""
    vocabulary = logits.shape[1]
    blocks = topk_blocks(vocabulary, k)
    if not blocks:
        return rank(logits, k)
    whole = blocks * TOPK_BLOCK
    by_block = logits[:, :whole].unflatten(1, (blocks, TOPK_BLOCK))
    maxima = by_block.amax(dim=-1) if block_maxima is None else block_maxima
    # in the order of their ids, so that a candidate's place orders it as its id does
    chosen = rank(maxima, k)[1].sort(dim=-1).values
    candidates = by_block.gather(1, chosen[..., None].expand(-1, -1, TOPK_BLOCK)).flatten(1)
    if whole < vocabulary:
        candidates = torch.cat([candidates, logits[:, whole:]], dim=1)
    values, where = rank(candidates, k)
    # a candidate's id: its block's first id plus its offset, or past the chosen blocks, the tail's
    block = chosen.gather(1, (where // TOPK_BLOCK).clamp(max=k - 1))
    in_blocks = block * TOPK_BLOCK + where % TOPK_BLOCK
    return values, torch.where(where < k * TOPK_BLOCK, in_blocks, where - k * TOPK_BLOCK + whole)


def topk_columns(
    logits: torch.Tensor,
    topk: int,
    log_z: torch.Tensor,
    block_maxima: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The top-k columns of `logits` [rows, V] whose log Z is `log_z` [rows]: the top k of the
    logits as they are (`top_logits`, with their `block_maxima` where taken already), their
    probabilities exp(logit - log Z) and the rest."""
    values, ids = top_logits(logits, topk, block_maxima)
    probs = (values.float() - log_z[:, None]).exp()
    rest = (1.0 - probs.sum(dim=-1)).clamp(min=0.0)
    return {TOPK_PROBS: probs, TOPK_IDS: ids, TOPK_REST: rest}


def onepass_columns(
    row_sums,
    topk_pass,
    logits: torch.Tensor,
    targets: torch.Tensor,
    topk: int,
    space: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """`--head-kernel onepass`: the loss and the space column from `row_sums`
    (triton_head.logit_row_sums: one read of each logit, which also takes the block maxima of
    the top k's first stage), the top-k from `topk_pass` (`topk_columns`, compiled where fused
    is: eager, its many small steps cost several times the compiled pass), spared a second read
    of the logits for its block maxima."""
    blocks = topk_blocks(logits.shape[1], topk)
    maxima = logits.new_empty((len(logits), blocks), dtype=torch.float32) if blocks else None
    columns, log_z = row_sums(logits, targets, space, maxima)
    if topk:
        columns |= topk_pass(logits, topk, log_z, maxima)
    return columns


def compile_head_pass(function):
    """`function(logits, targets, ...)` under torch.compile, as bench_stage1_head.py's rows
    measured it: the chunk's rows dynamic (a batch's last, shorter chunk does not recompile), its
    vocabulary static (the teacher's: Inductor sizes the row's reductions for it), and its
    reductions never split: on a GPU Inductor splits a row's reduction where the first chunk it
    compiles for has few rows (under 2 per SM: a padded warm-up's 63), and the one graph then
    serves every later chunk, full ones too (tests/test_stage1_head.py)."""
    compiled = torch.compile(function, dynamic=True, options={"split_reductions": False})

    def head_pass(logits: torch.Tensor, *args):
        torch._dynamo.mark_static(logits, 1)
        return compiled(logits, *args)

    return head_pass


@functools.cache
def compiled_pass(function):
    """`function` under `compile_head_pass`, once per process: on CUDA, `fused_columns`, and
    `topk_columns` beside onepass's Triton kernel."""
    return compile_head_pass(function)
