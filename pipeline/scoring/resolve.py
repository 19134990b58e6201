"""Every device-dependent decision of stage 1's scoring in one place: `resolve(asked, device,
model)` turns what was asked (`Asked`, any value `auto`) into what runs (`Resolved`).

It answers at two moments. Before the teacher is loaded (`model` None): stage 1's driver, for
the device its Ray cluster gives each worker (a GPU, or CPUs), learns the teacher's dtype and
whether a worker holds two units at once; the hf switches as the device alone would have them.
With the teacher loaded (pipeline.scoring.hf: HFScorer.load), on the worker's own device: the
same, and what the teacher decides: whether its head reproduces its logits (else its own
forward pass is scored), whether onepass's kernel passes its check against the plain one,
whether it gives a packed window what it gives it alone, whether it has decoder layers to
compile, and the rows of a head chunk from the memory then free. Layers that fail to compile
are found only by the warm-up, which then takes `compile` back (HFScorer.load).

The record is saved with the run (stage1-run.json: "backend"), not in the cache's identity:
each switch gives the same columns up to rounding, and the manifest names the shards each
value scored (`switches`). Only the dtype changes what a cache holds; it has always been the
identity's `teacher.dtype`, so a resume that resolves another dtype is refused there, and a
worker whose own device resolves another than its driver's is refused at load (`check_worker`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pipeline import document_attention
from pipeline.choices import on_device
from pipeline.document_attention import FLEX
from pipeline.errors import ConfigError
from pipeline.log import get_logger
from pipeline.models.layers import decoder_layers, resolve_compile
from pipeline.scoring.device import free_memory
from pipeline.scoring.head import (
    HeadColumns,
    HeadExtras,
    check_triton_kernel,
    head_chunk_rows,
)
from pipeline.scoring.switches import HeadSwitches

# Largest relative difference of a probe's fp32 hidden states, two windows packed in one row
# against each alone, that still counts as the same context: rounding, far below what attending
# to a neighbouring window or taking its positions changes (a sizeable share of the norm). Half
# precision weights get 50 times more (bf16 rounds at 4e-3).
PACKING_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Asked:
    """What a scorer is asked for: the teacher's dtype (`--dtype`), the hf switches, and stage
    1's `--unit-overlap`; any may be `auto`."""

    dtype: str = "auto"
    switches: HeadSwitches = HeadSwitches()
    unit_overlap: str = "auto"

    @classmethod
    def of(cls, config) -> Asked:
        """What stage 1's ScoreConfig asks (its teacher's, head's and batching's sections)."""
        switches = HeadSwitches.asked_by(config.head, config.batching)
        return cls(config.teacher.dtype, switches, config.batching.unit_overlap)


@dataclass(frozen=True)
class Resolved:
    """What runs: each of `Asked`'s choices for one device (and, once loaded, one teacher)."""

    device: str  # "cuda" or "cpu"
    dtype: str  # the teacher's weights; the cache's identity holds it
    unit_overlap: str  # on: a stage-1 worker holds two units at once
    switches: HeadSwitches
    plain_head: bool | None = None  # the head reproduces the logits; None: teacher not loaded
    head_rows: int | None = None  # scored positions per head chunk; None: teacher not loaded

    def saved(self) -> dict:
        """As stage1-run.json's "backend" records it (its top level holds `unit_overlap`,
        beside the pool's sizes); the switches in the shape of the manifest's `switches`."""
        head = {True: "chunked", False: "model forward", None: None}[self.plain_head]
        decided = {"device": self.device, "dtype": self.dtype, "head": head}
        return decided | {"head_rows": self.head_rows} | self.switches.saved()


def resolve(
    asked: Asked,
    device: torch.device,
    model: torch.nn.Module | None = None,
    extras: HeadExtras | None = None,
) -> Resolved:
    """`asked` on `device`, and with `model` (the teacher, loaded on `device`) what it decides;
    `extras`: the columns asked for besides the loss. A choice that was asked for and cannot be
    honoured is refused in one line (ConfigError); under auto it falls back, with a warning
    where a GPU's fast path is lost."""
    extras = extras or HeadExtras()
    wanted = asked.switches
    # the draws need each row's whole fp32 softmax: the plain kernel's
    kernel = "plain" if extras.sampled and wanted.head_kernel == "auto" else wanted.head_kernel
    packing = on_device(wanted.row_packing, device, gpu="packed", cpu="padded")
    attention = on_device(wanted.attention, device, gpu="flex", cpu="dense")
    switches = HeadSwitches(
        head_kernel=on_device(kernel, device, gpu="onepass", cpu="plain"),
        # draws hold ~3x the plain head's bytes a logit: auto keeps their chunks fixed
        head_chunks=on_device(
            wanted.head_chunks, device, cpu="fixed", gpu="fixed" if extras.sampled else "sized"
        ),
        row_packing=packing,
        attention=None if packing == "padded" else attention,
        batch_overlap=on_device(wanted.batch_overlap, device, gpu="on", cpu="off"),
        compile=resolve_compile(wanted.compile, device),
    )
    resolved = Resolved(
        device=device.type,
        dtype=on_device(asked.dtype, device, gpu="bfloat16", cpu="float32"),
        unit_overlap=on_device(asked.unit_overlap, device, gpu="on", cpu="off"),
        switches=switches,
    )
    if model is None:
        return resolved
    return _on_teacher(resolved, wanted, device, model, extras)


def _on_teacher(
    resolved: Resolved, asked: HeadSwitches, device: torch.device, model, extras: HeadExtras
) -> Resolved:
    """`resolved` as the loaded teacher `model` takes it back, with its head's chunk rows."""
    head = model.get_output_embeddings()
    vocab_size = head.weight.shape[0]
    plain_head = head_reproduces_logits(model, device)
    switches = resolved.switches
    kernel = _head_kernel(switches.head_kernel, asked.head_kernel, extras, device, head)
    packing, attention = _packing(switches, asked.row_packing, model, device)
    compile = switches.compile
    if asked.compile == "auto" and not decoder_layers(model):
        compile = "off"  # a teacher of another shape runs eagerly; asked for, refused at load
    switches = replace(
        switches, head_kernel=kernel, row_packing=packing, attention=attention, compile=compile
    )
    # Sized chunks take the memory free once the teacher and its probes are on the device: the
    # warm-up's full batch then proves the size fits.
    free = free_memory(device) if switches.head_chunks == "sized" else None
    rows = head_chunk_rows(vocab_size, switches.head_chunks, free)
    return replace(resolved, switches=switches, plain_head=plain_head, head_rows=rows)


def check_worker(driver: Resolved, worker: Resolved) -> None:
    """Refuse a worker whose own device resolves another dtype than its driver's, which the
    cache's identity records: its shards would not be the cache the identity names."""
    if worker.dtype != driver.dtype:
        raise ConfigError(
            f"--dtype auto: the driver resolved {driver.dtype} for workers on a {driver.device} "
            f"device, but a worker scores on a {worker.device} device ({worker.dtype}); "
            "name --dtype"
        )


@torch.inference_mode()
def head_reproduces_logits(model, device: torch.device) -> bool:
    """Whether `head(body(x))` gives the model's logits on a probe: not where it soft-caps or
    scales them, whose own forward pass is then scored (still in chunks)."""
    head = model.get_output_embeddings()
    probe = torch.arange(8, device=device)[None] * 7919 % head.weight.shape[0]
    full = model(input_ids=probe, use_cache=False).logits.float()
    ours = head(model.base_model(input_ids=probe, use_cache=False).last_hidden_state).float()
    return torch.allclose(full, ours, rtol=1e-3, atol=1e-3)


def _head_kernel(kernel: str, asked: str, extras: HeadExtras, device: torch.device, head) -> str:
    """`kernel` where it runs here: onepass only if its Triton kernel compiles and passes its
    check on a probe; under auto fused, with one warning, where it does not (on a GPU onepass is
    the fastest measured: docs/stage1-gpu-path.md)."""
    if kernel != "onepass":
        return kernel
    try:
        check_triton_kernel(HeadColumns(extras, head.weight.shape[0], device, kernel), head)
    except ConfigError as exc:
        if asked != "auto":
            raise
        get_logger("scoring").warning(f"--head-kernel auto takes fused: {exc}")
        return "fused"
    return kernel


def _packing(
    switches: HeadSwitches, asked: str, model, device: torch.device
) -> tuple[str, str | None]:
    """(`packed` or `padded`, the attention packed rows use): packed only if this teacher's
    forward pass gives a packed window what it gives it alone (and takes flex attention where
    that is the choice, which it is then set to); an explicit `packed` it cannot honour is
    refused in one line, auto stays padded."""
    if switches.row_packing == "padded":
        return "padded", None
    problem = None
    if switches.attention == "flex":
        try:
            model.set_attn_implementation(FLEX)
        except (ValueError, ImportError) as exc:  # no flex path for this architecture
            problem = f"--attention flex: {exc}"
    problem = problem or _packing_problem(model, device)
    if problem is None:
        return "packed", switches.attention
    if asked == "auto":
        return "padded", None
    raise ConfigError(f"--row-packing packed: {problem}; use --row-packing padded")


@torch.inference_mode()
def _packing_problem(model, device: torch.device) -> str | None:
    """None if two probe windows packed into one row get the hidden states each gets alone;
    else what differs."""
    vocab_size, body = model.get_output_embeddings().weight.shape[0], model.base_model
    first = torch.arange(5, device=device) * 7919 % vocab_size
    second = torch.arange(3, device=device) * 104729 % vocab_size
    segments = torch.tensor([[1] * 5 + [2] * 3], device=device)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=device)
    ids = torch.cat([first, second])[None]
    inputs = document_attention.packed_inputs(model, ids, segments, positions)
    try:
        packed = body(**inputs, use_cache=False).last_hidden_state[0].float()
    except (TypeError, ValueError, RuntimeError) as exc:  # a mask or positions it cannot take
        return f"this teacher's forward pass does not take a document mask ({exc})"
    alone = torch.cat([
        body(input_ids=ids[None], use_cache=False).last_hidden_state[0].float()
        for ids in (first, second)
    ])  # fmt: skip
    difference = float((packed - alone).norm() / alone.norm())
    tolerance = PACKING_TOLERANCE if model.dtype == torch.float32 else 50 * PACKING_TOLERANCE
    if difference <= tolerance:
        return None
    return (
        f"this teacher's forward pass gives a packed window other hidden states than it "
        f"gives it alone (relative difference {difference:.2g} on a probe, above "
        f"{tolerance:g}): it does not honour a document mask or restarted positions"
    )
