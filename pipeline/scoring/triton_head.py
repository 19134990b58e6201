"""The head's Triton kernels.

`--head-kernel triton`: the head's matrix product and the loss's reductions in one Triton
kernel, so that no logit leaves the chip (the kind of kernel cut-cross-entropy is; Wijmans et al.
2025). It computes the loss and, when asked, the space column; for top-k use the fused pass.

Each program takes a block of scored positions and one span of the vocabulary (programs ordered so
that those running at once share a few blocks of positions and a few spans, as a grouped matrix
product's tiles are, and both stay in L2). Per tile of the span it multiplies the positions' hidden
states by the tile's head rows, accumulating in fp32, and folds the tile into running sums: the max,
Z = sum exp(logit - max), the space mask's share of Z, and the target's logit. The spans' partial
sums are then combined in torch, on the device: loss = log Z - logit[target], space_logprob = log
Z(S) - log Z (docs/cache-columns.md).

The logits stay fp32 from the product on, where the other kernels read them from the head's output
dtype (bf16 on a GPU): on a bf16 teacher the columns differ from fused's by bf16's rounding of the
logits, and are the nearer to exact. Block sizes and spans are fixed, not autotuned by timing, and
nothing is summed by atomics, so a rerun gives the same bits.

Off CUDA the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
first imported; numpy, slow: for the tests), which computes no
bfloat16 arithmetic (Triton's debugging guide): there the operands are upcast to fp32 before the
product. A bf16 product is exact in fp32, so only the summation order differs from a GPU's.
At load, the scorer compares the kernel with an fp32 product on a probe, so a GPU's compiled
kernel is checked on the machine that runs it.

`--head-kernel onepass`: the logits as the fused pass takes them (cuBLAS's product, in the head's
dtype), reduced by one Triton program per row that reads each logit once: the same running sums
(`logit_row_sums`), the space mask's share of Z included, each exponential in base 2 (one FMA and
one MUFU.EX2 a logit: `LOG2_E`), where the fused pass's compiled reductions read each row once for
the max and Z and again for the space mask's sum (runs 3-6's fused pass read it twice for the loss
alone: benchmarks/results/2026-11-27-h200/README.md). Its columns are fused's up to fp32
rounding, and a space column below about -72 nats, which its flushed terms may take to the floor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pipeline.cache.schema import SPACE_LOGPROB
from pipeline.scoring.head_kernels import TOPK_BLOCK

TINY_LOG = math.log(torch.finfo(torch.float32).tiny)  # the space column's floor, as the others'


class Blocks(NamedTuple):
    """How the kernel divides the work: a program's tile of positions x vocabulary entries x
    hidden size, the vocabulary entries it takes in turn (its span, a multiple of its tile), the
    blocks of positions that take the spans in turn before the next such group starts, and the
    launch's warps and software-pipeline stages."""

    positions: int
    vocab: int
    width: int
    span: int
    group: int
    warps: int
    stages: int


# On a GPU: 128 x 128 x 64 tiles over 8 warps, 3 stages, which Triton compiles for an H100
# (sm_90a) to wgmma with double-buffered loads, 173-205 registers, 96 KiB of shared memory and no
# spill; a vocabulary tile of 256 spills (benchmarks/triton_head_compile.py; speed unmeasured).
# Spans of 16 tiles and groups of 8 blocks: the 132 programs an H100 runs at once read about 8
# blocks of hidden states and 16 tiles of the head (3 and 6 MiB at the 1.5B shape); one long span
# per block of positions would keep 128 blocks' hidden states (48 MiB, L2's size) in play.
GPU_BLOCKS = Blocks(128, 128, 64, 2048, 8, 8, 3)
# In the interpreter: big blocks, since each operation costs a numpy call.
INTERPRETER_BLOCKS = Blocks(256, 4096, 64, 8192, 2, 1, 1)
# Largest |difference| of the loss or the space column, kernel against an fp32 product, on the
# load probe (pipeline.scoring.head.check_triton_kernel): the order of fp32 sums over a hidden size
# of thousands, or TF32's rounding of an fp32 teacher's operands where torch allows it, stays far
# below it; a wrong tile, mask or span
# is a difference of whole nats.
REFERENCE_TOLERANCE = 1e-2
# logit_row_sums: logits a program reduces at a step (8 KiB of bf16, 16 per thread of 8 warps on
# a GPU; in the interpreter, whole rows of the tests' vocabularies at once)
ROW_BLOCK, ROW_WARPS = 4096, 8
INTERPRETER_ROW_BLOCK = 65536
# The row kernel takes each logit's exponential as 2^(logit log2(e) - max log2(e)),
# one FMA and one MUFU.EX2 a logit, where exp(logit - max) compiles to six instructions (a
# subtraction, the multiply by log2(e), and ex2's fix-up for results below float32's smallest
# normal: a compare and two multiplies). Triton's exp2 flushes such results to zero (PTX
# ex2.approx.ftz), FlashAttention's form: each dropped term is a probability below 1.2e-38, so Z
# moves by under vocabulary x 1.2e-38 (nothing, at float32's precision) and the space column only
# where it lies below about -72 nats (docs/cache-columns.md). The compiled row loop issues 9.6
# instructions a logit for the loss (13.7 before), 15.1 with the space column (19.2), 11.2 with
# the top k's block maxima (15.4), no spill (benchmarks/triton_head_compile.py, sm_90a); its speed
# on a GPU is unmeasured (bench_stage1_head.py's `natural exp` rows time the earlier form beside
# it).
LOG2_E = tl.constexpr(math.log2(math.e))
# Whether a multiply and an add may fuse into one rounding (an FMA) in the kernels' running sums:
# on, as the measured runs compiled them and as Inductor compiles its own kernels. Said at launch,
# since Triton 3.10 turns its default off, which would move the cached columns' last bits.
FP_FUSION = True
# Triton compiles a kernel again for each new specialization of its arguments: an integer's
# divisibility by 16 (or being 1), a pointer's 16-byte alignment. What varies with a batch's
# scored positions (their count, a head chunk's targets, the sums' offsets in their one
# allocation) is left unspecialized, each read or written a scalar or a masked block at a time,
# so that the compile at load serves every batch: before, a worker's first unit with a count of
# 2 mod 4 compiled a third variant of the row kernel (103 ms on an H200, run 11).
PER_POSITION = ("target_ptr", "max_ptr", "total_ptr", "space_total_ptr", "picked_ptr")


# (the Triton head takes a batch's targets whole, a tensor of their own: aligned)
@triton.jit(do_not_specialize=("positions",), do_not_specialize_on_alignment=PER_POSITION[1:])
def _head_sums(
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, space_ptr,
    max_ptr, total_ptr, space_total_ptr, picked_ptr,
    positions, vocab, width, hidden_stride, weight_stride,
    HAS_BIAS: tl.constexpr, HAS_SPACE: tl.constexpr, UPCAST: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_POSITIONS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_WIDTH: tl.constexpr,
    SPAN: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One block of positions over one span of the vocabulary: its partial sums, by span."""
    # program -> (block, span), GROUP blocks at a time, each group's spans in turn
    spans = tl.cdiv(vocab, SPAN)
    per_group = GROUP * spans
    group_first = tl.program_id(0) // per_group * GROUP
    group_size = tl.minimum(tl.cdiv(positions, BLOCK_POSITIONS) - group_first, GROUP)
    block = group_first + tl.program_id(0) % per_group % group_size
    span = tl.program_id(0) % per_group // group_size
    position = block * BLOCK_POSITIONS + tl.arange(0, BLOCK_POSITIONS)
    position_ok = position < positions
    # Rows and columns past the end read the last one's memory instead of being masked, so that
    # the loads in the product's loop carry no predicate; their results are dropped below.
    row = tl.minimum(position, positions - 1).to(tl.int64)
    target = tl.load(target_ptr + row).to(tl.int32)
    top = tl.full([BLOCK_POSITIONS], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_POSITIONS], tl.float32)
    space_total = tl.zeros([BLOCK_POSITIONS], tl.float32)
    picked = tl.zeros([BLOCK_POSITIONS], tl.float32)
    first = span * SPAN
    for start in range(first, tl.minimum(first + SPAN, vocab), BLOCK_VOCAB):
        column = start + tl.arange(0, BLOCK_VOCAB)
        column_ok = column < vocab
        # int64 offsets: a large head's (vocabulary x width) passes 2^31
        entry = tl.minimum(column, vocab - 1).to(tl.int64)
        h_next = hidden_ptr + row[:, None] * hidden_stride + tl.arange(0, BLOCK_WIDTH)[None, :]
        w_next = weight_ptr + entry[None, :] * weight_stride + tl.arange(0, BLOCK_WIDTH)[:, None]
        logits = tl.zeros([BLOCK_POSITIONS, BLOCK_VOCAB], tl.float32)
        for inner in range(0, width, BLOCK_WIDTH):
            if EVEN:  # the blocks tile the hidden size: no mask along it
                h = tl.load(h_next)
                w = tl.load(w_next)
            else:
                k = inner + tl.arange(0, BLOCK_WIDTH)
                h = tl.load(h_next, mask=(k < width)[None, :], other=0.0)
                w = tl.load(w_next, mask=(k < width)[:, None], other=0.0)
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            logits = tl.dot(h, w, logits, input_precision=PRECISION)
            h_next += BLOCK_WIDTH
            w_next += BLOCK_WIDTH
        if HAS_BIAS:
            bias = tl.load(bias_ptr + column, mask=column_ok, other=0.0)
            logits += bias.to(tl.float32)[None, :]
        logits = tl.where(column_ok[None, :], logits, float("-inf"))
        new_top = tl.maximum(top, tl.max(logits, 1))
        scale = tl.exp(top - new_top)
        exp = tl.exp(logits - new_top[:, None])
        total = total * scale + tl.sum(exp, 1)
        if HAS_SPACE:
            in_space = tl.load(space_ptr + column, mask=column_ok, other=0) != 0
            space_total = space_total * scale + tl.sum(tl.where(in_space[None, :], exp, 0.0), 1)
        picked += tl.sum(tl.where(column[None, :] == target[:, None], logits, 0.0), 1)
        top = new_top
    out = span * positions + position
    tl.store(max_ptr + out, top, mask=position_ok)
    tl.store(total_ptr + out, total, mask=position_ok)
    tl.store(picked_ptr + out, picked, mask=position_ok)
    if HAS_SPACE:
        tl.store(space_total_ptr + out, space_total, mask=position_ok)


@triton.jit(do_not_specialize_on_alignment=PER_POSITION)
def _row_sums(
    logits_ptr, target_ptr, space_ptr, max_ptr, total_ptr, space_total_ptr, picked_ptr,
    block_max_ptr, vocab, row_stride, HAS_SPACE: tl.constexpr, BLOCK: tl.constexpr,
    MAX_BLOCK: tl.constexpr, NATURAL_EXP: tl.constexpr,
):  # fmt: skip
    """One row of logits, read once: its max, Z and the space mask's share of Z (rescaled as
    the max grows, as `_head_sums`'s are), the target's logit, and with a MAX_BLOCK (0: none) the
    max of each whole block of that many logits, for `top_logits`. The exponentials in base 2
    (`LOG2_E`), or with NATURAL_EXP as runs 7-15 measured them."""
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * row_stride
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    space_total = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        column = start + tl.arange(0, BLOCK)
        column_ok = column < vocab
        logits = tl.load(logits_ptr + column, mask=column_ok, other=float("-inf")).to(tl.float32)
        new_top = tl.maximum(top, tl.max(logits, 0))
        if NATURAL_EXP:
            scale = tl.exp(top - new_top)
            exp = tl.exp(logits - new_top)
        else:
            scale = tl.math.exp2((top - new_top) * LOG2_E)  # 1 where the max stays
            exp = tl.math.exp2(logits * LOG2_E - new_top * LOG2_E)
        total = total * scale + tl.sum(exp, 0)
        if HAS_SPACE:
            in_space = tl.load(space_ptr + column, mask=column_ok, other=0) != 0
            space_total = space_total * scale + tl.sum(tl.where(in_space, exp, 0.0), 0)
        top = new_top
        if MAX_BLOCK:
            blocks = vocab // MAX_BLOCK
            block = start // MAX_BLOCK + tl.arange(0, BLOCK // MAX_BLOCK)
            block_top = tl.max(tl.reshape(logits, [BLOCK // MAX_BLOCK, MAX_BLOCK]), 1)
            tl.store(block_max_ptr + row * blocks + block, block_top, mask=block < blocks)
    tl.store(max_ptr + row, top)
    tl.store(total_ptr + row, total)
    tl.store(picked_ptr + row, tl.load(logits_ptr + tl.load(target_ptr + row)).to(tl.float32))
    if HAS_SPACE:
        tl.store(space_total_ptr + row, space_total)


# Under TRITON_INTERPRET=1 (read when triton is first imported) `triton.jit` gives the
# interpreter's function, which runs on the host.
INTERPRETED = not isinstance(_head_sums, triton.JITFunction)


def unavailable(device: torch.device) -> str | None:
    """None if the kernel runs on `device`, else why not."""
    if device.type == "cuda" or INTERPRETED:
        return None
    return (
        f"Triton compiles for CUDA devices, not {device.type}; elsewhere it runs only in its "
        f"interpreter, which TRITON_INTERPRET=1 turns on before triton is imported (slow: for "
        f"tests)"
    )


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: an fp32 teacher's product in full fp32, as torch's matmul
    computes it unless TF32 is allowed (a bf16 or fp16 product ignores it)."""
    full = dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return "ieee" if full else "tf32"


def head_options(blocks: Blocks) -> dict:
    """The head kernel's compile options on a GPU: its launch's, and its compile check's."""
    return {"num_warps": blocks.warps, "num_stages": blocks.stages, "enable_fp_fusion": FP_FUSION}


ROW_OPTIONS = {"num_warps": ROW_WARPS, "enable_fp_fusion": FP_FUSION}  # likewise, the row kernel's


def triton_head_columns(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    space: torch.Tensor | None,
    blocks: Blocks | None = None,
) -> dict[str, torch.Tensor]:
    """{"loss": [N]} and, with a `space` mask (int8 over the vocabulary), the space column, of N
    positions' `hidden` states [N, width] under the head `weight` [vocabulary, width] (+ `bias`),
    fp32. `blocks` overrides the fixed ones."""
    positions, width = hidden.shape
    vocab = weight.shape[0]
    blocks = blocks or (INTERPRETER_BLOCKS if INTERPRETED else GPU_BLOCKS)
    if blocks.span % blocks.vocab:
        raise ValueError(f"a span of {blocks.span} is not a multiple of the tile's {blocks.vocab}")
    spans = -(-vocab // blocks.span)
    hidden, weight = hidden.contiguous(), weight.contiguous()
    sums = torch.empty(4, spans, positions, dtype=torch.float32, device=hidden.device)
    top, total, space_total, picked = sums
    if positions:
        launch = {} if INTERPRETED else head_options(blocks)
        _head_sums[(-(-positions // blocks.positions) * spans,)](
            hidden, weight, bias if bias is not None else hidden, targets,
            space if space is not None else targets,
            top, total, space_total, picked,
            positions, vocab, width, hidden.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, HAS_SPACE=space is not None, UPCAST=INTERPRETED,
            EVEN=width % blocks.width == 0, BLOCK_POSITIONS=blocks.positions,
            BLOCK_VOCAB=blocks.vocab, BLOCK_WIDTH=blocks.width, SPAN=blocks.span,
            GROUP=blocks.group, PRECISION=dot_precision(weight.dtype), **launch,
        )  # fmt: skip
    return combined_columns(sums, space is not None)[0]


def logit_row_sums(
    logits: torch.Tensor,
    targets: torch.Tensor,
    space: torch.Tensor | None,
    block_maxima: torch.Tensor | None = None,
    natural_exp: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`--head-kernel onepass`'s reduction of `logits` [N, vocabulary] (any float dtype; rows may
    lie strided apart): ({"loss": [N]} and, with a `space` mask (int8), the space column; log Z
    [N]), fp32, each logit read once; and, given `block_maxima` (fp32 [N, vocabulary //
    TOPK_BLOCK]), the max of each whole block of TOPK_BLOCK logits written into it, which
    `top_logits` would otherwise read the logits again for. `natural_exp`: the exponentials as
    runs 7-15 measured them, for bench_stage1_head.py's rows beside today's."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if INTERPRETED:  # it computes no bf16 arithmetic (see above)
        logits = logits.float()
    sums = torch.empty(4, 1, rows, dtype=torch.float32, device=logits.device)
    top, total, space_total, picked = sums[:, 0]
    if rows:
        block = INTERPRETER_ROW_BLOCK if INTERPRETED else ROW_BLOCK
        launch = {} if INTERPRETED else ROW_OPTIONS
        _row_sums[(rows,)](
            logits, targets, space if space is not None else logits,  # unread: any aligned
            top, total, space_total, picked, logits if block_maxima is None else block_maxima,
            vocab, logits.stride(0), HAS_SPACE=space is not None, BLOCK=block,
            MAX_BLOCK=0 if block_maxima is None else TOPK_BLOCK, NATURAL_EXP=natural_exp,
            **launch,
        )  # fmt: skip
    return combined_columns(sums, space is not None)


def combined_columns(
    sums: torch.Tensor, has_space: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The columns and log Z of the kernels' partial sums [4 (max, Z, the space share of Z, the
    target's logit), spans, positions], combined across spans: loss = log Z - logit[target],
    space_logprob = log Z(S) - log Z, at least the others' floor."""
    top, total, space_total, picked = sums
    overall = top.amax(dim=0)
    scale = (top - overall).exp()
    log_z = (total * scale).sum(dim=0).log() + overall
    columns = {"loss": log_z - picked.sum(dim=0)}
    if has_space:
        log_space = (space_total * scale).sum(dim=0).log() + overall
        columns[SPACE_LOGPROB] = (log_space - log_z).clamp(min=TINY_LOG, max=0.0)
    return columns, log_z
