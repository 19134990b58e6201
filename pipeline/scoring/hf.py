"""Hugging Face transformers backend: the reference for correctness, on any machine.

Per batch of windows (pipeline.scoring.windows, pipeline.scoring.batching): one forward pass of the
decoder body; then the output head is applied only to the positions whose next token is scored, a
chunk of rows at a time, and each chunk's loss and views are computed by `--head-kernel`
(pipeline.scoring.head, pipeline.scoring.head_kernels).
Chunks (`--head-chunks`, pipeline.scoring.head: head_chunk_rows) hold a fixed 2^24 logits, or
are sized from the device's free memory at load, so that a large vocabulary does not cost a head
matrix product (re-reading the whole head weight) per hundred rows.
Full-vocabulary log-probabilities of all positions (batch x length x vocabulary) are never
materialized. `--compile layers` compiles each decoder layer of the body (pipeline.models.layers).

`--row-packing` says how windows fill the batch's rows: `padded`, one window per row,
right-padded, with a 2-D attention mask; `packed`, several windows per row of `max_length`
tokens, each attending causally to itself only (pipeline.document_attention: a dense
[B, 1, T, T] mask, or flex_attention's block mask under `--attention flex`) with its positions
restarting at 0, so that every window is scored with exactly its own context. A teacher whose
forward pass does not honour that (checked at load on a probe, where every switch is resolved:
pipeline.scoring.resolve) is refused for `packed`, and `auto` keeps it padded.

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

from pipeline import document_attention
from pipeline.errors import ConfigError
from pipeline.log import get_logger
from pipeline.models.layers import compile_layers, eager_layers
from pipeline.scoring.batching import (
    BatchLayout,
    UnitPlan,
    layout_arrays,
    packed_layouts,
    padded_layouts,
    scored_positions,
)
from pipeline.scoring.device import DeviceTime, QueuedBatch, QueuedColumns, to_device
from pipeline.scoring.draws import document_uniforms
from pipeline.scoring.head import HeadColumns, HeadExtras, empty_columns
from pipeline.scoring.resolve import Asked, Resolved, resolve
from pipeline.scoring.switches import HeadSwitches
from pipeline.scoring.teacher import TeacherSource, load_teacher_model
from pipeline.scoring.windows import WindowTable, plan_document_windows

WARM_UP_TOKENS = 64
ASKED_BY_DEFAULT = Asked()  # every choice auto


class HFScorer:
    """Scores token sequences with a transformers causal LM; one instance per worker. Made
    cheaply with what is asked; `load()` loads the teacher, resolves every switch for its device
    (pipeline.scoring.resolve), compiles and warms up."""

    name = "hf"

    def __init__(
        self,
        teacher: TeacherSource,
        *,
        max_length: int,
        stride: int,
        batch_tokens: int,
        asked: Asked = ASKED_BY_DEFAULT,
        device: str | None = None,
        extras: HeadExtras | None = None,
    ):
        self.teacher, self.asked, self.extras = teacher, asked, extras or HeadExtras()
        self.max_length, self.stride, self.batch_tokens = max_length, stride, batch_tokens
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.resolved: Resolved | None = None  # once loaded
        self._last_done = None  # the event behind the last batch queued (DeviceTime)

    def load(self) -> HFScorer:
        """Load the teacher in the dtype resolved for this device, resolve the switches with it,
        compile its layers as resolved, and warm up; returns the scorer, loaded."""
        dtype = resolve(self.asked, self.device).dtype
        self.model = load_teacher_model(self.teacher, dtype, str(self.device))
        self.body = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self.vocab_size = self.head.weight.shape[0]
        self.resolved = resolve(self.asked, self.device, self.model, self.extras)
        self.columns = HeadColumns(
            self.extras, self.vocab_size, self.device, self.switches.head_kernel
        )
        compile_layers(self.model, self.switches.compile, "the teacher")
        self._warm_up()
        return self

    @property
    def switches(self) -> HeadSwitches:
        """What this scorer steps with, each switch resolved for its device and teacher."""
        return self.resolved.switches

    def _warm_up(self) -> None:
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
            if self.asked.switches.compile != "auto":
                raise ConfigError(f"--compile layers: {problem}; use --compile off") from exc
            get_logger("scoring").warning(f"--compile auto: {problem}; they run eagerly")
            eager_layers(self.model)
            switches = replace(self.switches, compile="off")
            self.resolved = replace(self.resolved, switches=switches)
            self._warm_up()

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
        } | self.resolved.saved()

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
        rows, device_time = self.resolved.head_rows, DeviceTime()

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
            segments, positions = (to_device(a, self.device) for a in (segment_ids, position_ids))
            inputs = document_attention.packed_inputs(self.model, ids, segments, positions)
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
        if self.resolved.plain_head:
            hidden = self.body(**inputs, use_cache=False).last_hidden_state[row, position]
            head = self.head
        else:
            hidden = self.model(**inputs, use_cache=False).logits[row, position]
            head = None
        drawn_at = None if uniforms is None else to_device(uniforms, self.device)
        batch.copy(self.columns.of_batch(hidden, head, targets, rows, drawn_at))
        self._last_done = batch.done
        return batch
