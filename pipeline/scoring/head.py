"""The columns stage 1 computes from the teacher's head for a batch of scored positions, a chunk
at a time (`HeadColumns`): which kernel computes them (`--head-kernel`; their arithmetic and the
columns' definitions: pipeline.scoring.head_kernels, onepass's Triton kernel:
pipeline.scoring.triton_head), how many rows a chunk holds (`--head-chunks`), the extra columns
asked for, and the Triton kernel's check at load. Columns and conventions: docs/cache-columns.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cache.schema import (
    MAX_TOPK,
    SAMPLE_IDS,
    SAMPLE_LOGPROBS,
    SAMPLE_RANKS,
    SPACE_LOGPROB,
    TOPK_IDS,
    TOPK_PROBS,
    TOPK_REST,
)
from pipeline.choices import SAMPLED_NEEDS_PLAIN_HEAD, compiles_on
from pipeline.errors import ConfigError
from pipeline.scoring.head_kernels import (
    compiled_pass,
    fused_columns,
    onepass_columns,
    plain_columns,
    sampled_columns,
    topk_columns,
)

# The Triton kernel's check at load, on batches of these many positions: Triton compiles a kernel
# again for an integer argument of 1 and for a multiple of 16, so each kind of count a unit can
# give is compiled (and checked) here, not inside a unit; 67 is not a whole block either.
PROBE_POSITIONS = (67, 64, 1)
# --head-chunks fixed: rows of logits computed at once, rows x vocabulary near 2**24 floats
# (64 MiB in fp32; 110 rows at a 152k vocabulary).
LOGIT_BUDGET = 1 << 24
# --head-chunks sized: a chunk may take this share of the free memory, at this many bytes per
# logit (the plain kernel's model-dtype logits, fp32 copy and fp32 log-softmax; fused needs less).
HEAD_MEMORY_SHARE = 0.5
BYTES_PER_LOGIT = 12
# --topk-mode sampled: the dtypes of a chunk's draws on the device
SAMPLED_DTYPES = {SAMPLE_IDS: torch.int64, SAMPLE_LOGPROBS: torch.float32, SAMPLE_RANKS: torch.int64}


def head_chunk_rows(vocab_size: int, chunks: str, free: int | None = None) -> int:
    """Rows per head chunk for `--head-chunks` `chunks` (fixed or sized), given `free` bytes
    (sized only): never fewer than the fixed budget's."""
    fixed = max(1, LOGIT_BUDGET // vocab_size)
    if chunks == "fixed":
        return fixed
    return max(fixed, int(free * HEAD_MEMORY_SHARE) // (vocab_size * BYTES_PER_LOGIT))


@dataclass(frozen=True)
class HeadExtras:
    """What to compute besides the loss: K (0: no top-k), whether to keep the ids, the space
    mask (bool numpy array over the head's outputs, or None); `sampled`: K ids drawn from the
    teacher's distribution instead of its top K (pipeline.scoring.draws), at uniforms
    seeded by `sample_seed` and each document's tokens (pipeline.scoring.hf: HFScorer.plan)."""

    topk: int = 0
    topk_ids: bool = True
    space_mask: np.ndarray | None = None
    sampled: bool = False
    sample_seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.topk <= MAX_TOPK:
            raise ValueError(f"topk must be in 0..{MAX_TOPK}, not {self.topk}")
        if self.sampled and not self.topk:
            raise ValueError("sampled draws topk ids: give topk")

    @property
    def active(self) -> bool:
        return self.topk > 0 or self.space_mask is not None

    def columns(self) -> tuple[str, ...]:
        names = ()
        if self.sampled:
            names = (SAMPLE_IDS, SAMPLE_LOGPROBS, SAMPLE_RANKS)
        elif self.topk:
            names = (TOPK_PROBS, TOPK_IDS, TOPK_REST) if self.topk_ids else (TOPK_PROBS, TOPK_REST)
        return names + ((SPACE_LOGPROB,) if self.space_mask is not None else ())


def head_kernel_function(kernel: str, device: torch.device):
    """What computes a chunk's columns for `--head-kernel` `kernel` (plain, fused or onepass) on
    `device`: fused, and onepass's top-k beside its Triton kernel, compiled where `compiles_on`
    says (CUDA), eager elsewhere."""
    if kernel == "plain":
        return plain_columns
    as_run = compiled_pass if compiles_on(device) else lambda function: function
    if kernel == "onepass":
        row_sums = triton_module(kernel, device).logit_row_sums
        return functools.partial(onepass_columns, row_sums, as_run(topk_columns))
    return as_run(fused_columns)


class HeadColumns:
    """The columns of a scorer's batches (the loss and the extras asked for) by `--head-kernel`
    `kernel` on `device`, for a head of `vocab_size` outputs; the space mask goes to the device
    once, here."""

    def __init__(self, extras: HeadExtras, vocab_size: int, device: torch.device, kernel: str):
        if extras.topk > vocab_size:
            raise ValueError(f"topk {extras.topk} exceeds the teacher's {vocab_size} outputs")
        self.space = None
        if extras.space_mask is not None:
            if len(extras.space_mask) != vocab_size:
                raise ValueError(
                    f"space mask of {len(extras.space_mask)} ids for a head of {vocab_size}"
                )
            # in the form the kernel reads, so no chunk converts it: plain multiplies the
            # probabilities by a float indicator, fused masks the logits with a bool one,
            # onepass's Triton kernel loads bytes
            form = {"plain": np.float32, "fused": np.bool_}.get(kernel, np.int8)
            self.space = torch.from_numpy(extras.space_mask.astype(form)).to(device)
        self.extras, self.device, self.kernel = extras, device, kernel
        self.compute = head_kernel_function(kernel, device)
        if extras.sampled:
            if kernel != "plain":  # the draws need the whole fp32 distribution of each row
                raise ConfigError(SAMPLED_NEEDS_PLAIN_HEAD.format(kernel=kernel))
            self.compute = sampled_columns

    def buffer(self, rows: int) -> dict[str, torch.Tensor]:
        """Empty device tensors for `rows` scored positions, by column."""
        k, device = self.extras.topk, self.device
        out = {"loss": torch.empty(rows, dtype=torch.float32, device=device)}
        if self.extras.sampled:
            for name, dtype in SAMPLED_DTYPES.items():
                out[name] = torch.empty(rows, k, dtype=dtype, device=device)
        elif k:
            out[TOPK_PROBS] = torch.empty(rows, k, dtype=torch.float32, device=device)
            out[TOPK_REST] = torch.empty(rows, dtype=torch.float32, device=device)
            if self.extras.topk_ids:
                out[TOPK_IDS] = torch.empty(rows, k, dtype=torch.int64, device=device)
        if self.space is not None:
            out[SPACE_LOGPROB] = torch.empty(rows, dtype=torch.float32, device=device)
        return out

    def of_batch(
        self,
        hidden: torch.Tensor,
        head: torch.nn.Linear | None,
        targets: torch.Tensor,
        rows: int,
        uniforms: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The columns of a batch's scored positions from their `hidden` states under `head`
        (None: `hidden` are the logits already), in chunks of `rows` positions. `uniforms`
        [positions, K]: where the draws of `--topk-mode sampled` fall."""
        project, topk = head or torch.nn.Identity(), self.extras.topk
        out = self.buffer(len(targets))
        for begin in range(0, len(targets), rows):
            chunk = slice(begin, begin + rows)
            at = () if uniforms is None else (uniforms[chunk],)
            columns = self.compute(project(hidden[chunk]), targets[chunk], topk, self.space, *at)
            for name, values in columns.items():
                if name in out:  # ids computed but not kept (--no-topk-ids)
                    out[name][chunk] = values
        return out

    @torch.inference_mode()
    def probe_difference(self, head: torch.nn.Linear) -> float:
        """Largest |difference| of the loss and the space column between this kernel and the
        plain one on the logits it reads (the head's own product), over probes of random hidden
        states: a Triton kernel's check on the machine that compiled it."""
        generator = torch.Generator(self.device).manual_seed(0)
        vocab, width = head.weight.shape
        differences = []
        for positions in PROBE_POSITIONS:
            shape, device = (positions, width), self.device
            hidden = torch.randn(shape, generator=generator, device=device).to(head.weight.dtype)
            targets = torch.randint(0, vocab, shape[:1], generator=generator, device=device)
            ours = self.of_batch(hidden, head, targets, positions)
            space = None if self.space is None else self.space.float()
            exact = plain_columns(head(hidden).float(), targets, 0, space)
            differences += [float((ours[name] - exact[name]).abs().max()) for name in exact]
        return float(np.max(differences))  # NaN if any is


def check_triton_kernel(columns: HeadColumns, head: torch.nn.Linear) -> None:
    """Refuse `--head-kernel onepass` in one line where its columns would not be the teacher's:
    a kernel that does not compile here, or one whose columns on a probe differ from the plain
    kernel's on the logits it reads (a compiler's fault a CPU test cannot see)."""
    from pipeline.scoring.triton_head import REFERENCE_TOLERANCE

    refusal = f"--head-kernel {columns.kernel}: {{}}; use --head-kernel fused"
    try:
        difference = columns.probe_difference(head)
    except Exception as exc:  # Triton's compile errors share no base class
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ConfigError(refusal.format(
            f"the kernel failed on a probe ({type(exc).__name__}: {first})"
        )) from exc  # fmt: skip
    if not difference <= REFERENCE_TOLERANCE:  # NaN too
        raise ConfigError(refusal.format(
            f"on a probe its columns differ from the plain kernel's by {difference:.3g} "
            f"(more than {REFERENCE_TOLERANCE:g})"
        ))  # fmt: skip


def triton_module(kernel: str, device: torch.device):
    """pipeline.scoring.triton_head for `--head-kernel` `kernel`, or a one-line refusal where
    its kernels cannot run on `device`."""
    try:
        from pipeline.scoring import triton_head
    except ImportError as exc:
        raise ConfigError(f"--head-kernel {kernel} needs the triton package ({exc})") from exc
    problem = triton_head.unavailable(device)
    if problem:
        raise ConfigError(f"--head-kernel {kernel}: {problem}; use --head-kernel fused")
    return triton_head


def empty_columns(extras: HeadExtras, lengths: list[int]) -> dict[str, list[np.ndarray]]:
    """Per-document arrays of the extra columns, all unscored (NaN, id -1) to start with."""
    k = extras.topk
    shapes = {TOPK_REST: (), SPACE_LOGPROB: ()}
    columns = {}
    for name in extras.columns():
        integer = name in (TOPK_IDS, SAMPLE_IDS, SAMPLE_RANKS)
        fill, dtype = (-1, np.int64) if integer else (np.nan, np.float32)
        shape = shapes.get(name, (k,))
        columns[name] = [np.full((n, *shape), fill, dtype=dtype) for n in lengths]
    return columns
