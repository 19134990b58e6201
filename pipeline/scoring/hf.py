"""Hugging Face transformers backend: the reference for correctness, on any machine.

Per batch of windows (pipeline.scoring.windows, pipeline.scoring.batching): one forward pass of the
decoder body, right-padded with an attention mask; then the output head is applied only to the
positions whose next token is scored, a chunk of rows at a time, and each chunk's loss and views
are computed by `--head-kernel` (pipeline.scoring.head). Chunks (`--head-chunks`) hold a fixed
2^24 logits, or are sized from the device's free memory at each batch, so that a large vocabulary
does not cost a head matrix product (re-reading the whole head weight) per hundred rows.
Full-vocabulary log-probabilities of all positions (batch x length x vocabulary) are never
materialized.

A model whose logits are not simply `head(body(x))` (soft-capping, scaling) is detected at load by
comparing both ways on a probe sequence; such a model falls back to its own forward pass, still
scored in chunks. Same input, same thread count -> bit-identical losses on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from pipeline.choices import on_device
from pipeline.scoring.batching import plan_batches
from pipeline.scoring.head import HeadColumns, HeadExtras, empty_columns
from pipeline.scoring.teacher import TeacherSource, load_teacher_model
from pipeline.scoring.windows import WindowTable, plan_document_windows

# --head-chunks fixed: rows of logits computed at once, rows x vocabulary near 2**24 floats
# (64 MiB in fp32; 110 rows at a 152k vocabulary).
LOGIT_BUDGET = 1 << 24
# --head-chunks sized: a chunk may take this share of the free memory, at this many bytes per
# logit (the plain kernel's model-dtype logits, fp32 copy and fp32 log-softmax; fused needs less).
HEAD_MEMORY_SHARE = 0.5
BYTES_PER_LOGIT = 12


def free_memory(device: torch.device) -> int:
    """Bytes free now: CUDA's free device memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def head_chunk_rows(vocab_size: int, chunks: str, free: int | None = None) -> int:
    """Rows per head chunk for `--head-chunks` `chunks` (fixed or sized), given `free` bytes
    (sized only): never fewer than the fixed budget's."""
    fixed = max(1, LOGIT_BUDGET // vocab_size)
    if chunks == "fixed":
        return fixed
    return max(fixed, int(free * HEAD_MEMORY_SHARE) // (vocab_size * BYTES_PER_LOGIT))


def scored_positions(windows: WindowTable, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row in batch, position in row) of every position whose next token is scored."""
    start, score_from, end = windows.start[rows], windows.score_from[rows], windows.end[rows]
    counts = end - score_from
    row = np.repeat(np.arange(len(rows)), counts)
    first = np.repeat(score_from - start - 1, counts)  # the position that predicts token f
    offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return row, first + offset


def padded_batch(
    token_ids: list[np.ndarray], windows: WindowTable, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, attention mask), int64 and right-padded, of the windows `rows`."""
    lengths = windows.length[rows]
    input_ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)
    for i, row in enumerate(rows):
        input_ids[i, : lengths[i]] = token_ids[windows.doc[row]][
            windows.start[row] : windows.end[row]
        ]
    mask = np.arange(input_ids.shape[1])[None, :] < lengths[:, None]
    return input_ids, mask.astype(np.int64)


def to_host(columns: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Each column as a numpy array: on a GPU every copy is started, then waited for once."""
    on_gpu = any(values.is_cuda for values in columns.values())
    columns = {name: values.to("cpu", non_blocking=True) for name, values in columns.items()}
    if on_gpu:
        torch.cuda.synchronize()
    return {name: values.numpy() for name, values in columns.items()}


class HFScorer:
    """Scores token sequences with a transformers causal LM; one instance per worker."""

    name = "hf"

    def __init__(
        self,
        teacher: TeacherSource,
        *,
        dtype: str,
        max_length: int,
        stride: int,
        batch_tokens: int,
        device: str | None = None,
        extras: HeadExtras | None = None,
        head_kernel: str = "auto",
        head_chunks: str = "auto",
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_teacher_model(teacher, dtype, str(self.device))
        self.max_length, self.stride, self.batch_tokens = max_length, stride, batch_tokens
        self.body = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.vocab_size = self.head.weight.shape[0]
        self.plain_head = self._head_reproduces_logits()
        self.extras = extras or HeadExtras()
        # auto: the fast path on a GPU; on a CPU the plain one, whose caches are those of before
        self.head_kernel = on_device(head_kernel, self.device, gpu="fused", cpu="plain")
        self.head_chunks = on_device(head_chunks, self.device, gpu="sized", cpu="fixed")
        self.columns = HeadColumns(self.extras, self.vocab_size, self.device, self.head_kernel)

    def describe(self) -> dict:
        import transformers

        return {
            "backend": self.name,
            "backend_version": transformers.__version__,
            "torch_version": torch.__version__,
            "model_dtype": str(self.model.dtype).removeprefix("torch."),
            "head": "chunked" if self.plain_head else "model forward",
            "head_kernel": self.head_kernel,
            "head_chunks": self.head_chunks,
        }

    @torch.inference_mode()
    def _head_reproduces_logits(self) -> bool:
        probe = torch.arange(8, device=self.device)[None] * 7919 % self.vocab_size
        full = self.model(input_ids=probe, use_cache=False).logits.float()
        ours = self.head(self.body(input_ids=probe, use_cache=False).last_hidden_state).float()
        return torch.allclose(full, ours, rtol=1e-3, atol=1e-3)

    def score(
        self, token_ids: list[np.ndarray], progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        """Per-document float32 losses aligned with `token_ids`; NaN where nothing predicts.

        `progress` is called with the number of tokens scored after each batch.
        """
        return self.score_columns(token_ids, progress)["loss"]

    @torch.inference_mode()
    def score_columns(
        self, token_ids: list[np.ndarray], progress: Callable[[int], None] | None = None
    ) -> dict[str, list[np.ndarray]]:
        """{"loss": per-document losses} plus the extra columns asked for (pipeline.scoring.head),
        each a per-document array whose first axis is aligned with `token_ids`."""
        lengths = [len(ids) for ids in token_ids]
        columns = {"loss": [np.full(n, np.nan, dtype=np.float32) for n in lengths]}
        columns |= empty_columns(self.extras, lengths)
        windows = plan_document_windows(lengths, self.max_length, self.stride)
        for rows in plan_batches(windows.length, self.batch_tokens):
            batch = self._score_batch(token_ids, windows, rows)
            scored = windows.scored[rows]
            bounds = np.cumsum(scored)[:-1]
            for name, values in batch.items():
                for part, row in zip(np.split(values, bounds), rows, strict=True):
                    doc = columns[name][windows.doc[row]]
                    doc[windows.score_from[row] : windows.end[row]] = part
            if progress is not None:
                progress(int(scored.sum()))
        return columns

    def _score_batch(
        self, token_ids: list[np.ndarray], windows: WindowTable, rows: np.ndarray
    ) -> dict[str, np.ndarray]:
        input_ids, mask = padded_batch(token_ids, windows, rows)
        ids = torch.from_numpy(input_ids).to(self.device)
        attention_mask = torch.from_numpy(mask).to(self.device)
        row, position = scored_positions(windows, rows)
        row, position = (
            torch.from_numpy(row).to(self.device),
            torch.from_numpy(position).to(self.device),
        )
        targets = ids[row, position + 1]
        if self.plain_head:
            hidden = self.body(input_ids=ids, attention_mask=attention_mask, use_cache=False)
            hidden = hidden.last_hidden_state[row, position]
            project = self.head
        else:
            logits = self.model(
                input_ids=ids, attention_mask=attention_mask, use_cache=False
            ).logits
            hidden = logits[row, position]
            project = torch.nn.Identity()
        free = free_memory(self.device) if self.head_chunks == "sized" else None
        rows = head_chunk_rows(self.vocab_size, self.head_chunks, free)
        out = self.columns.buffer(len(targets))
        for begin in range(0, len(targets), rows):
            chunk = slice(begin, begin + rows)
            self.columns.fill(out, chunk, project(hidden[chunk]), targets[chunk])
        return to_host(out)
