"""`--head-kernel onepass`'s Triton kernel: the logits as the fused pass takes them (cuBLAS's
product, in the head's dtype), reduced by one Triton program per row that reads each logit once:
the max, Z = sum exp(logit - max) and the space mask's share of Z, rescaled as the max grows, and
the target's logit (`logit_row_sums`), each exponential in base 2 (one FMA and one MUFU.EX2 a
logit: `LOG2_E`), where the fused pass's compiled reductions read each row once for the max and Z
and again for the space mask's sum (benchmarks/results/2026-11-27-h200/README.md). The rows' sums
are then combined in torch, on the device: loss = log Z - logit[target], space_logprob = log Z(S)
- log Z (docs/cache-columns.md). Its columns are fused's up to fp32 rounding, and a space column
below about -72 nats, which its flushed terms may take to the floor. Block sizes are fixed, not
autotuned by timing, and nothing is summed by atomics, so a rerun gives the same bits.

Off CUDA the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
first imported; numpy, slow: for the tests), which computes no bfloat16 arithmetic (Triton's
debugging guide): there the logits are upcast to fp32 first. At load, the scorer compares the
kernel with the plain one on a probe, so a GPU's compiled kernel is checked on the machine that
runs it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pipeline.cache.schema import SPACE_LOGPROB
from pipeline.scoring.head_kernels import TOPK_BLOCK

TINY_LOG = math.log(torch.finfo(torch.float32).tiny)  # the space column's floor, as the others'


# Largest |difference| of the loss or the space column, kernel against the plain one on the same
# logits, on the load probe (pipeline.scoring.head.check_triton_kernel): the order of fp32 sums
# over a vocabulary stays far below it; a wrong block or mask is a difference of whole nats.
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
# where it lies below about -72 nats (docs/cache-columns.md). What the loop compiles to:
# benchmarks/triton_head_compile.py (docs/stage1.md); bench_stage1_head.py's `natural exp` rows
# time the natural form beside it.
LOG2_E = tl.constexpr(math.log2(math.e))
# Whether a multiply and an add may fuse into one rounding (an FMA) in the kernel's running sums:
# on, as the measured runs compiled them and as Inductor compiles its own kernels. Said at launch,
# since Triton 3.10 turns its default off, which would move the cached columns' last bits.
FP_FUSION = True
# Triton compiles a kernel again for each new specialization of its arguments: an integer's
# divisibility by 16 (or being 1), a pointer's 16-byte alignment. What varies with a batch's
# scored positions (their count, a head chunk's targets, the sums' offsets in their one
# allocation) is left unspecialized, each read or written a scalar or a masked block at a time,
# so that the compile at load serves every batch, not a variant compiled inside a unit
# (tests/test_stage1_triton_head.py).
PER_POSITION = ("target_ptr", "max_ptr", "total_ptr", "space_total_ptr", "picked_ptr")


@triton.jit(do_not_specialize_on_alignment=PER_POSITION)
def _row_sums(
    logits_ptr, target_ptr, space_ptr, max_ptr, total_ptr, space_total_ptr, picked_ptr,
    block_max_ptr, vocab, row_stride, HAS_SPACE: tl.constexpr, BLOCK: tl.constexpr,
    MAX_BLOCK: tl.constexpr, NATURAL_EXP: tl.constexpr,
):  # fmt: skip
    """One row of logits, read once: its max, Z and the space mask's share of Z (rescaled as
    the max grows), the target's logit, and with a MAX_BLOCK (0: none) the
    max of each whole block of that many logits, for `top_logits`. The exponentials in base 2
    (`LOG2_E`), or with NATURAL_EXP in the natural form, for the head bench."""
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
INTERPRETED = not isinstance(_row_sums, triton.JITFunction)


def unavailable(device: torch.device) -> str | None:
    """None if the kernel runs on `device`, else why not."""
    if device.type == "cuda" or INTERPRETED:
        return None
    return (
        f"Triton compiles for CUDA devices, not {device.type}; elsewhere it runs only in its "
        f"interpreter, which TRITON_INTERPRET=1 turns on before triton is imported (slow: for "
        f"tests)"
    )


ROW_OPTIONS = {"num_warps": ROW_WARPS, "enable_fp_fusion": FP_FUSION}  # the kernel's compile options


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
    `top_logits` would otherwise read the logits again for. `natural_exp`: the exponentials in
    the natural form, for bench_stage1_head.py's rows beside the base-2 ones."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if INTERPRETED:  # it computes no bf16 arithmetic (see above)
        logits = logits.float()
    top, total, space_total, picked = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
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
    # loss = log Z - logit[target], space_logprob = log Z(S) - log Z, at least the others' floor
    log_z = total.log() + top
    columns = {"loss": log_z - picked}
    if space is not None:
        columns[SPACE_LOGPROB] = (space_total.log() + top - log_z).clamp(min=TINY_LOG, max=0.0)
    return columns, log_z
