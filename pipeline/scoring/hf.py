"""Hugging Face transformers backend: the reference for correctness, on any machine.

Per batch of windows (pipeline.scoring.windows, pipeline.scoring.batching): one forward pass of the
decoder body; then the output head is applied only to the positions whose next token is scored, a
chunk of rows at a time, and each chunk's loss and views are computed by `--head-kernel`
(pipeline.scoring.head, pipeline.scoring.head_kernels).
Chunks (`--head-chunks`, pipeline.scoring.head: head_chunk_rows) hold a fixed 2^24 logits, or
are sized from the device's free memory at the first scoring call (the warm-up at load), so that
a large vocabulary does not cost a head matrix product (re-reading the whole head weight) per
hundred rows.
Full-vocabulary log-probabilities of all positions (batch x length x vocabulary) are never
materialized. `--compile layers` compiles each decoder layer of the body (pipeline.models.layers).

`--row-packing` says how windows fill the batch's rows: `padded`, one window per row,
right-padded, with a 2-D attention mask; `packed`, several windows per row of `max_length`
tokens, each attending causally to itself only (pipeline.document_attention: a dense
[B, 1, T, T] mask, or flex_attention's block mask under `--attention flex`) with its positions
restarting at 0, so that every window is scored with exactly its own context. A teacher whose
forward pass does not honour that (checked at load on a probe) is refused for `packed`, and
`auto` keeps it padded.

A model whose logits are not simply `head(body(x))` (soft-capping, scaling) is detected at load by
comparing both ways on a probe sequence; such a model falls back to its own forward pass, still
scored in chunks. Same input, same thread count -> bit-identical losses on the CPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from pipeline.choices import on_device
from pipeline.document_attention import FLEX, document_block_mask, document_mask
from pipeline.errors import ConfigError
from pipeline.log import get_logger
from pipeline.models.layers import compile_layers, decoder_layers, eager_layers, resolve_compile
from pipeline.scoring.batching import (
    BatchLayout,
    UnitPlan,
    layout_arrays,
    packed_layouts,
    padded_layouts,
    scored_positions,
)
from pipeline.scoring.device import DeviceTime, QueuedBatch, QueuedColumns, free_memory, to_device
from pipeline.scoring.draws import document_uniforms
from pipeline.scoring.head import HeadExtras, empty_columns, head_chunk_rows, head_columns
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import TeacherSource, load_teacher_model
from pipeline.scoring.windows import WindowTable, plan_document_windows

WARM_UP_TOKENS = 64
# Largest relative difference of a probe's fp32 hidden states, two windows packed in one row
# against each alone, that still counts as the same context: rounding, far below what attending
# to a neighbouring window or taking its positions changes (a sizeable share of the norm). Half
# precision weights get 50 times more (bf16 rounds at 4e-3).
PACKING_TOLERANCE = 1e-3
ASKED_BY_DEFAULT = HeadSwitches()  # every switch auto


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
        switches: HeadSwitches = ASKED_BY_DEFAULT,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_teacher_model(teacher, dtype, str(self.device))
        self.max_length, self.stride, self.batch_tokens = max_length, stride, batch_tokens
        self.body = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.vocab_size = self.head.weight.shape[0]
        self.plain_head = self._head_reproduces_logits()
        self.extras = extras or HeadExtras()
        self.columns = head_columns(
            switches.head_kernel, self.extras, self.vocab_size, self.device, self.head
        )
        row_packing, attention = self._resolve_packing(switches.row_packing, switches.attention)
        compile = resolve_compile(switches.compile, self.device)
        if switches.compile == "auto" and not decoder_layers(self.model):
            compile = "off"  # a teacher of another shape runs eagerly; asked for, refused
        # what this scorer steps with, each switch resolved for this device and teacher
        self.switches = HeadSwitches(
            head_kernel=self.columns.kernel,
            # draws hold ~3x the plain head's bytes a logit: auto keeps their chunks fixed
            head_chunks=on_device(switches.head_chunks, self.device, cpu="fixed",
                                  gpu="fixed" if self.extras.sampled else "sized"),  # fmt: skip
            row_packing=row_packing,
            attention=attention,
            batch_overlap=on_device(switches.batch_overlap, self.device, gpu="on", cpu="off"),
            compile=compile,
        )
        compile_layers(self.model, compile, "the teacher")
        self._head_rows: int | None = None  # rows per head chunk, from the first scoring call
        self._last_done = None  # the event behind the last batch queued (DeviceTime)
        self._warm_up(switches.compile)

    def _warm_up(self, asked: str) -> None:
        """Score `_warm_up_units`, so that what compiles on first use (the layers, the head's
        compiled passes, flex attention and its block mask) does so now, at load, not inside a
        unit (onepass's Triton kernel compiles at its check, just before). Layers that fail to
        compile are refused in one line where `--compile layers` was asked for; under auto they
        run eagerly, with one warning."""
        try:
            for documents in self._warm_up_units():
                self.score_columns(documents)
            self._last_done = None  # a unit's edge is timed from the previous unit, not load
        except Exception as exc:  # torch.compile's failures share no base class
            if self.switches.compile == "off":
                raise
            # the compiler's own error, which torch._dynamo's BackendCompilerFailed wraps
            cause = getattr(exc, "inner_exception", None) or exc
            first = (str(cause).strip().splitlines() or [""])[0][:300]
            problem = f"compiling the teacher's layers failed ({type(cause).__name__}: {first})"
            if asked != "auto":
                raise ConfigError(f"--compile layers: {problem}; use --compile off") from exc
            get_logger("scoring").warning(f"--compile auto: {problem}; they run eagerly")
            eager_layers(self.model)
            self.switches = replace(self.switches, compile="off")
            self._warm_up(asked)

    def _warm_up_units(self) -> list[list[np.ndarray]]:
        """Units whose batches take every kind of shape that compiles differently: a compiled
        function compiles again for a new size until it has seen a size of 1 and two others (1
        is specialized), and for a mask where it had none; on a GPU a compile takes longer than
        a small unit's scoring. Packed: a full batch of rows, a batch of two, then a document of
        two tokens (a row of its own, and one scored position: a head chunk of one row). Padded:
        a row alone, that document, two rows of one length (no mask), then padded batches (a
        mask, first seen with sizes of its own) of two and three rows of two lengths."""

        def document(length: int) -> np.ndarray:
            return np.arange(length) % self.vocab_size

        one_position = [document(2)]
        per_batch = max(1, self.batch_tokens // self.max_length)
        if self.switches.row_packing == "packed" and per_batch > 1:
            alone = document(self.max_length // 2 + 1)  # two never share a row
            rows = sorted({per_batch, min(2, per_batch)}, reverse=True)
            return [[alone] * count for count in rows] + [one_position]
        short = max(8, min(WARM_UP_TOKENS, self.max_length, self.batch_tokens // 3))
        long, half, quarter = document(short), document(short // 2), document(short // 4)
        return [[long], one_position, [long] * 2, [long, half], [half, quarter, quarter]]

    def describe(self) -> dict:
        import transformers

        return {
            "backend": self.name,
            "backend_version": transformers.__version__,
            "model_dtype": str(self.model.dtype).removeprefix("torch."),
            "head": "chunked" if self.plain_head else "model forward",
        } | self.switches.saved()

    @torch.inference_mode()
    def _head_reproduces_logits(self) -> bool:
        probe = torch.arange(8, device=self.device)[None] * 7919 % self.vocab_size
        full = self.model(input_ids=probe, use_cache=False).logits.float()
        ours = self.head(self.body(input_ids=probe, use_cache=False).last_hidden_state).float()
        return torch.allclose(full, ours, rtol=1e-3, atol=1e-3)

    def _resolve_packing(self, row_packing: str, attention: str) -> tuple[str, str | None]:
        """(`packed` or `padded`, the attention packed rows use): `auto` packs on a GPU, with flex
        attention, if this teacher's forward pass gives a packed window what it gives it alone;
        an explicit `packed` it cannot honour is refused in one line."""
        packing = on_device(row_packing, self.device, gpu="packed", cpu="padded")
        if packing == "padded":
            return packing, None
        attention = on_device(attention, self.device, gpu="flex", cpu="dense")
        problem = None
        if attention == "flex":
            try:
                self.model.set_attn_implementation(FLEX)
            except (ValueError, ImportError) as exc:  # no flex path for this architecture
                problem = f"--attention flex: {exc}"
        problem = problem or self._packing_problem()
        if problem is None:
            return packing, attention
        if row_packing == "auto":
            return "padded", None
        raise ConfigError(f"--row-packing packed: {problem}; use --row-packing padded")

    @torch.inference_mode()
    def _packing_problem(self) -> str | None:
        """None if two probe windows packed into one row get the hidden states each gets alone;
        else what differs."""
        first = torch.arange(5, device=self.device) * 7919 % self.vocab_size
        second = torch.arange(3, device=self.device) * 104729 % self.vocab_size
        segments = torch.tensor([[1] * 5 + [2] * 3], device=self.device)
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=self.device)
        inputs = self._packed_inputs(torch.cat([first, second])[None], segments, positions)
        try:
            packed = self.body(**inputs, use_cache=False).last_hidden_state[0].float()
        except (TypeError, ValueError, RuntimeError) as exc:  # a mask or positions it cannot take
            return f"this teacher's forward pass does not take a document mask ({exc})"
        alone = torch.cat([
            self.body(input_ids=ids[None], use_cache=False).last_hidden_state[0].float()
            for ids in (first, second)
        ])  # fmt: skip
        difference = float((packed - alone).norm() / alone.norm())
        tolerance = PACKING_TOLERANCE if self.model.dtype == torch.float32 else 50 * PACKING_TOLERANCE
        if difference <= tolerance:
            return None
        return (
            f"this teacher's forward pass gives a packed window other hidden states than it "
            f"gives it alone (relative difference {difference:.2g} on a probe, above "
            f"{tolerance:g}): it does not honour a document mask or restarted positions"
        )

    def _packed_inputs(
        self, ids: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The body's inputs for packed rows: each window attends to itself, from position 0."""
        flex = self.model.config._attn_implementation == FLEX
        mask = document_block_mask(segments) if flex else document_mask(segments)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}

    def score(
        self, token_ids: list[np.ndarray], progress: Callable[[int], None] | None = None
    ) -> list[np.ndarray]:
        """Per-document float32 losses aligned with `token_ids`; NaN where nothing predicts.

        `progress` is called with the number of tokens scored after each batch.
        """
        return self.score_columns(token_ids, progress)["loss"]

    def score_columns(
        self, token_ids: list[np.ndarray], progress: Callable[[int], None] | None = None
    ) -> dict[str, list[np.ndarray]]:
        """{"loss": per-document losses} plus the extra columns asked for (pipeline.scoring.head),
        each a per-document array whose first axis is aligned with `token_ids`."""
        return self.queue_columns(token_ids, progress).collect()

    def plan(self, token_ids: list[np.ndarray]) -> UnitPlan:
        """The host's part of planning a scoring call of `token_ids` (no device work)."""
        lengths = [len(ids) for ids in token_ids]
        columns = {"loss": [np.full(n, np.nan, dtype=np.float32) for n in lengths]}
        columns |= empty_columns(self.extras, lengths)
        windows = plan_document_windows(lengths, self.max_length, self.stride)
        k, seed, drawn = self.extras.topk, self.extras.sample_seed, self.extras.sampled
        uniforms = [document_uniforms(i, k, seed) for i in token_ids] if drawn else None
        return UnitPlan(windows, self.layouts(windows), columns, uniforms)

    @torch.inference_mode()
    def queue_columns(
        self,
        token_ids: list[np.ndarray],
        progress: Callable[[int], None] | None = None,
        plan: UnitPlan | None = None,
    ) -> QueuedColumns:
        """`score_columns` in two halves: every batch queued on the device, and all read back
        but the one `--batch-overlap on` keeps in flight; `collect()` reads that one back. A
        worker lets the next unit queue its first batch in between, so that the device does not
        wait at a unit's edge for the last batch's read-back and the next one's first inputs.
        `plan`: `self.plan(token_ids)`, made beforehand (else here)."""
        if plan is None:
            plan = self.plan(token_ids)
        windows, columns = plan.windows, plan.columns
        if self._head_rows is None:
            # Sized chunks take the free memory once, at the first call (the warm-up's, whose
            # full batch proves the size fits): whether CUDA's query waits for queued work (the
            # previous unit's last batch, or this one's) is not documented.
            free = free_memory(self.device) if self.switches.head_chunks == "sized" else None
            self._head_rows = head_chunk_rows(self.vocab_size, self.switches.head_chunks, free)
        rows, device_time = self._head_rows, DeviceTime()

        def place(layout: BatchLayout, batch: QueuedBatch) -> None:
            scored = windows.scored[layout.windows]
            bounds = np.cumsum(scored)[:-1]
            for name, values in batch.arrays().items():
                for part, row in zip(np.split(values, bounds), layout.windows, strict=True):
                    doc = columns[name][windows.doc[row]]
                    doc[windows.score_from[row] : windows.end[row]] = part
            device_time.add(batch)
            if progress is not None:
                progress(int(scored.sum()))

        # --batch-overlap on: a batch's results are read back only once the next batch is queued
        # behind it, so the host builds and launches that batch while the device computes.
        in_flight: deque[tuple[BatchLayout, QueuedBatch]] = deque()
        for layout in plan.layouts:
            in_flight.append((layout, self._score_batch(token_ids, plan, layout, rows)))
            while len(in_flight) > (self.switches.batch_overlap == "on"):
                place(*in_flight.popleft())
        return QueuedColumns(columns, in_flight, place, device_time)

    def layouts(self, windows: WindowTable) -> list[BatchLayout]:
        """The batches `windows` are scored in, under `--row-packing`."""
        if self.switches.row_packing == "packed":
            return packed_layouts(windows.length, self.max_length, self.batch_tokens)
        return padded_layouts(windows.length, self.batch_tokens)

    def inputs_on_device(self, arrays: tuple, scored: tuple) -> tuple[dict, torch.Tensor, ...]:
        """(the forward pass's inputs, row, position of each scored position), on the device,
        from a batch's host arrays (pipeline.scoring.batching: layout_arrays, scored_positions)."""
        input_ids, segment_ids, position_ids = arrays
        ids = to_device(input_ids, self.device)
        if self.switches.row_packing == "packed":
            inputs = self._packed_inputs(
                ids, to_device(segment_ids, self.device), to_device(position_ids, self.device)
            )
        else:
            mask = to_device((segment_ids > 0).astype(np.int64), self.device)
            inputs = {"input_ids": ids, "attention_mask": mask}
        row, position = (to_device(values, self.device) for values in scored)
        return inputs, row, position

    def _score_batch(
        self, token_ids: list[np.ndarray], plan: UnitPlan, layout: BatchLayout, rows: int
    ) -> QueuedBatch:
        """The batch's work queued on the device, head chunks of `rows` scored positions (drawn at
        the plan's uniforms under --topk-mode sampled), its columns' copies to the host started;
        timed from when the host has built its inputs."""
        windows, uniforms = plan.windows, plan.batch_uniforms(layout)
        arrays = layout_arrays(token_ids, windows, layout), scored_positions(windows, layout)
        batch = QueuedBatch(self.device, previous=self._last_done)
        inputs, row, position = self.inputs_on_device(*arrays)
        ids = inputs["input_ids"]
        targets = ids[row, position + 1]
        if self.plain_head:
            hidden = self.body(**inputs, use_cache=False).last_hidden_state[row, position]
            head = self.head
        else:
            hidden = self.model(**inputs, use_cache=False).logits[row, position]
            head = None
        drawn_at = None if uniforms is None else to_device(uniforms, self.device)
        batch.copy(self.columns.of_batch(hidden, head, targets, rows, drawn_at))
        self._last_done = batch.done
        return batch
