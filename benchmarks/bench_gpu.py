"""Both stages at paper scale on one GPU, with no hub: stage 1 (the real job, hf backend) next to a
bare forward pass for a Qwen2.5-1.5B-like and a 7B-like teacher, and stage 2 (the real trainer)
for a TinyLlama-1.1B student with --guidance none and token, and a row per switch of its GPU
path, in one table.
Targets: stage 1 >= 0.95 of the bare forward (issue 12) and >= 0.85 of the body alone (issue 28);
stage 2 >= 55% MFU, token within 3% of none.

    python benchmarks/bench_gpu.py [--shapes gpu|tiny] [--docs N] [--steps S]
        [--teachers NAME ...] [--stage1-only | --stage2-only] [--switches [LABEL ...]]
        [--floors SIDE ...]
        [--budget-seconds S] [--rows-jsonl PATH] [--profile-dir DIR]

The rows come in the order the targets need them: each teacher's `stage 1 (hf)` and `stage 1
steady` as soon as its `body` floor is measured, then its other floors, the first teacher's
`+space` and `padded rows`, stage 2's `none`, `token` and floor, then the other switch rows.
Each is printed as it is measured (and appended to --rows-jsonl), with each stage-1 job's unit
phases and device time (benchmarks/stage1_runs.py: phase_summary, device_summary: the shares of
the device's time in batches, at what rate, and idle between them and at units' edges, from the
run record's events), so that a run cut off by a lease's limit still reports what it measured;
a row that fails is named in one line and the rest go on (exit 1); with --budget-seconds, a row
that would end past the budget by its baseline's time (a switch row, a stage-1 floor but `body`,
stage 2's rows but `none`), and any row once the budget is spent, is skipped and named;
--switches picks the switch rows and their order.
On an H200 the whole table takes longer than 10 minutes: the 1.5B teacher's rows alone took 269 s
with its layers compiled (2026-11-26, run 3), each switch row about 45 s.

Random-weight models are built from the configs below (shapes, not weights, set the speed) and
saved as model folders with the shipped tokenizers (qwen2.5 for the teachers, tinyllama for the
student). `--shapes tiny` (the default without CUDA) runs the same code at a few layers of hidden
size 64-96 on a CPU in about a minute; tests/test_bench_gpu.py does so.

What each row measures:
- stage 1: `stage1_score/run.py` in-process on a local Ray (Ray must be installed), one worker;
  tokens/s is the worker's rate of teacher tokens (every token of every document) from the final
  progress line. The worker compiles what it compiles at load, before its first unit.
- stage 1 steady: the same job's teacher tokens over the span from its first unit's scoring to
  its last unit's read-back (benchmarks/stage1_runs.py: steady_rate): what a job of many units
  approaches, without the first unit's tokenizing and the last one's writing, which nothing
  hides at a job's edges and a long job amortizes; every unit's own edges stay in. Its ratio is
  to `body` too. Units are `--docs-per-shard` documents (at gpu shapes the job's own default,
  1,000; runs 1-6 measured units of 256, about 2.7 batches each of the shipped corpus's short
  documents, whose last, partly empty rows made 2.3% more slots than all documents at once).
- stage 1 again: the same job run again, later (after the floors), as a ratio to stage 1: the
  noise between two runs of one job, and what being the first job on a fresh machine costs (its
  compile caches cold; run 9's first job measured 0.97 of its later ones,
  benchmarks/results/2026-11-27-h200/README.md).
  Its stored losses equal stage 1's exactly (a rerun gives the same cache).
- stage 1 +space: the same job with `--space-logprob` (ALM's column, docs/cache-columns.md), for
  the first teacher, as a ratio to stage 1 without it. A switch row measured after `again` also
  gives, on its line, its ratio to the last `again`: the plain job nearest it in time
  (`--switches +space again +space` reads `+space` twice, each beside a plain job).
- stage 1 +topk 32: the same with `--topk-probs 32` (the distillations' column), as a ratio to
  stage 1.
- stage 1 switch rows (issue 28): the same job for the first teacher with one of stage 1's GPU
  defaults turned off, as a ratio to stage 1 (`plain head`: `--head-kernel plain`, an fp32
  log-softmax per chunk, against the fused reductions; `fixed chunks`: `--head-chunks fixed`,
  2^24 logits per chunk, against chunks sized from free memory; `serial units`: `--unit-overlap
  off`, a worker's units one after another, against tokenizing and writing one unit while another
  is scored; `serial batches`: `--batch-overlap off`, each batch read back before the next is
  built, against building and launching batch k+1 while the device runs batch k; `eager
  layers`: `--compile off`, against each decoder layer compiled; `padded rows`:
  `--row-packing padded`, a window per row, against packed rows with a document mask; the gpu
  shapes give the one worker 8 units). `stage 1 triton head` (where the kernel runs: CUDA): the
  job with `--head-kernel triton`, the head's product and its reductions in one Triton kernel
  (pipeline/scoring/triton_head.py), a switch turned on, whose ratio to stage 1 is what it is
  worth; `stage 1 triton head +space` the same with `--space-logprob`; `stage 1 fused head`
  and `+space` likewise with `--head-kernel fused`, Inductor's reductions over the logits,
  against onepass's Triton kernel, auto's choice there. `stage 1 vllm` (where vllm imports):
  the same job with `--backend vllm`, the engine's prompt log-probabilities. Each of these rows
  is preceded by a line with the largest difference of its stored losses from stage 1's (the
  columns leave the loss as it is, a switch within rounding, the Triton head by bf16's rounding
  of the logits, which it does not round, and vLLM within its own arithmetic), its units'
  phases, and its steady rate as a ratio to `stage 1 steady` (a short job's edges, the first
  unit's tokenizing and the last one's writing, vary with the host).
- bare forward, body, body + fused head: the teacher loaded as the worker loads it
  (pipeline.scoring.hf.HFScorer, the same `auto` switches: on a GPU its decoder layers compiled and
  the onepass head, as the worker's), on the rows the worker computes (each unit of
  `--docs-per-shard` documents laid out apart, as the worker lays out a unit: its windows, row
  layout, mask and positions, so each unit's last, partly empty row and batch are in the floors too;
  a line gives the slots computed on these units against all documents at once; runs 1-6 laid all
  documents out at once) already on the device: `model(...).logits` and nothing else; the decoder
  body alone, no head (the floor of any loss); the body and one fused head pass over all of a
  batch's scored positions; `body + triton head` and `body + onepass head` (where the kernels run),
  the same with the Triton kernel's pass, which makes no logits, and with onepass's. `scorer`: the
  worker's scoring call itself (`HFScorer.score_columns` from host token ids: its batches built,
  copied, scored in sized chunks and read back) over all documents at once, in this process, without
  Ray, tokenizing or writing. `scorer by unit`: the same call once per unit, in the job's order:
  between it and `body + onepass head` (on a GPU: the same rows and head) lies the scorer's host
  work and each unit's wait for its last results before the next unit's first batch is queued,
  between it and `scorer` the units' edges whole (those waits, and the partly empty rows). `scorer
  queued units`: the units as a worker scores them, in one thread: each unit's batches queued before
  the previous unit's last batch is collected (`HFScorer.queue_columns`): between it and `scorer by
  unit` lies what that queueing is worth, between it and `stage 1 (hf)`'s score phases what Ray and
  the worker's threads cost. `scorer +space`: the `scorer` row's call with `--space-logprob`'s
  column, the scorer loaded again with it: between it and `scorer` lies what the column costs the
  scoring call, between it and `stage 1 +space` what it costs the job. Each: one warm-up pass, then
  the best of --repeats passes, synchronized; the same teacher-token count as the job. The `stage 1
  (hf)` row's ratio is to `body`, and a line gives stage 1 / bare forward. `body` is measured
  first, the others each as its own row (one that fails costs that row), and `--floors` measures
  only the ones it names (all of them take a 7B teacher about 5 minutes on an H200).
- stage 2: `stage2_train/train.py` in-process on the first teacher's cache (`--stage2-only`: on a
  cache of the shipped corpus with random teacher losses, no stage-1 job, no Ray); tokens/s and
  MFU are the median of metrics.jsonl's per-step `tokens_per_second` and `mfu` after the first
  third of steps. Each row starts in a clean compile state (torch._dynamo.reset(): what an
  earlier row compiled in this process would count towards its recompile limit) and runs with
  --no-save-at-end (no checkpoint, no final/); a line gives its phases (seconds before and after
  the steps: imports, the student built, the loader started; the first step, which compiles;
  the other steps) and the graphs dynamo compiled.
- stage 2 floor: the fastest plain training loop of the same student on batches of the same
  shape (benchmarks/stage2_floor.py: compiled layers, chunked loss, fused AdamW, bf16 on a GPU;
  no data path, no selection, no mask), its target tokens/s over the last two thirds of --steps;
  a line before the table gives `token` / floor.
- stage 2 switch rows (issue 27): the `token` arm with one of the GPU path's defaults turned off,
  as a ratio to `token` (`token dense`: `--attention dense`, the [B, 1, T, T] mask, against
  flex; `token plain adamw`: torch's default AdamW against the fused one; `token eager`: no
  torch.compile of the decoder layers; `token plain loss`: the loss from the whole micro-batch's
  logits against the chunked one); each is followed by the largest per-step loss difference from `token`, which a switch
  must leave within rounding.
MFU: 2 N (forward) or 6 N (training) x tokens/s over the device's peak dense bf16 FLOP/s
(pipeline/flops.py, NVIDIA datasheets; N without the input embedding; stage 2's over the target
tokens trained, not padding); n/a on a CPU. Peak memory: torch.cuda.max_memory_allocated
in this process over the row (a floor, stage 2), or for stage 1, whose worker is a Ray actor, the
device's used memory polled every 0.1 s above what was used before, once a finished job's worker
has freed its own (polled_device_memory); on a CPU the process's RSS
high-water mark (resource.getrusage, so it never goes down) and n/a for stage 1.
The loss check scores the first documents of the cache again with a plain unpadded forward pass per
window and compares with the stored (float16) losses.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from device_timing import best_seconds, synchronize  # noqa: E402
from peak_memory import peak_memory, reset_peak  # noqa: E402
from stage1_runs import (  # noqa: E402
    batch_inputs,
    device_summary,
    phase_summary,
    steady_rate,
    timed_stage1,
    write_corpus_slice,
)
from stage2_floor import floor_rate  # noqa: E402
from trace_gaps import describe_trace  # noqa: E402

from pipeline.cache.manifest import profile_name  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.flops import device_name, device_peak_flops, flop_parameters, mfu  # noqa: E402
from pipeline.models.hf_tokenizer import save_tokenizer  # noqa: E402
from pipeline.profiling import traced  # noqa: E402
from pipeline.scoring.head import HeadColumns, HeadExtras, triton_module  # noqa: E402
from pipeline.scoring.hf import HFScorer  # noqa: E402
from pipeline.scoring.resolve import Asked  # noqa: E402
from pipeline.scoring.teacher import resolve_teacher  # noqa: E402
from pipeline.scoring.windows import plan_document_windows  # noqa: E402
from pipeline.space_mask import space_mask  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402

# Qwen2.5-1.5B and -7B configs (their config.json on the hub: layers, widths, heads, vocabulary,
# tying); `tiny` keeps the architecture and vocabulary and shrinks the body.
TEACHERS = {
    "gpu": {
        "qwen2.5-1.5b-like": dict(
            hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
            num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
            tie_word_embeddings=True,
        ),
        "qwen2.5-7b-like": dict(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
            tie_word_embeddings=False,
        ),
    },
    "tiny": {  # heads of 32: the least vLLM's CPU attention takes (the `stage 1 vllm` row)
        "qwen2.5-1.5b-like": dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=151936, tie_word_embeddings=True,
        ),
        "qwen2.5-7b-like": dict(
            hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=3,
            num_key_value_heads=1, vocab_size=152064, tie_word_embeddings=False,
        ),
    },
}  # fmt: skip
# Windows and batches per shape: (max_length, stride, batch_tokens).
STAGE1 = {"gpu": (2048, 1024, 16384), "tiny": (128, 64, 512)}
# Rows of the first teacher beside `stage 1 (hf)`, each a ratio to it: the same job again (the
# control: a machine's first job measured 3% below its later ones, run 9), the cost of ALM's
# column and of the distillations' top 32, each switch of stage 1's GPU path turned to its plain
# value (issue 28). None may change a stored loss.
STAGE1_VARIANTS = (
    ("again", ()),
    ("+space", ("--space-logprob",)),
    ("+topk 32", ("--topk-probs", "32")),
    ("plain head", ("--head-kernel", "plain")),
    ("fixed chunks", ("--head-chunks", "fixed")),
    ("serial units", ("--unit-overlap", "off")),
    ("serial batches", ("--batch-overlap", "off")),
    ("eager layers", ("--compile", "off")),
    ("padded rows", ("--row-packing", "padded")),
)
# The switch rows measured before stage 2 (the rest after it): the control, the targets
# name +space, fused is the head `auto` falls back to where onepass cannot run, the Triton head
# measured no faster than fused (docs/stage1-gpu-path.md), packing is the largest of the
# switches, a wait per batch is what the floors never do, and compiled layers speed the body
# itself (the floors' too).
PRIORITY_VARIANTS = (
    "again", "+space", "fused head", "triton head", "padded rows", "serial batches", "eager layers"
)  # fmt: skip
# Where the Triton kernels run (CUDA, where `--head-kernel auto` is onepass), the job with
# `fused`, what auto falls back to elsewhere, and with `triton`, the head's product and reductions
# in one kernel, each without and with the space column (+space over the row before: what the
# column costs under it).
TRITON_VARIANTS = (
    ("fused head", ("--head-kernel", "fused")),
    ("fused head +space", ("--head-kernel", "fused", "--space-logprob")),
    ("triton head", ("--head-kernel", "triton")),
    ("triton head +space", ("--head-kernel", "triton", "--space-logprob")),
)
# Where vllm imports, a row of the first teacher's job with `--backend vllm` (on a CPU without
# torch.compile, whose start takes minutes there).
VLLM_VARIANT = {"cuda": ("--backend", "vllm"), "cpu": ("--backend", "vllm", "--vllm-enforce-eager")}
# gpu: 8,000 documents, 8 units of the job's own default of 1,000 (runs 1-6: 8,192 or fewer in
# units of 256). A bench job scores for seconds, so the first unit's tokenizing and the last one's
# writing may weigh on `stage 1 (hf)`; `stage 1 steady` leaves them out.
DEFAULTS = {
    "gpu": {"docs": 8000, "steps": 12, "docs_per_shard": 1000},
    "tiny": {"docs": 16, "steps": 4, "docs_per_shard": 8},
}
# stage-2 student preset, seq_len, micro-batch size, micro-batches per step, loader workers
STAGE2 = {"gpu": ("tinyllama-1.1b", 2048, 4, 4, 2), "tiny": ("llama-tiny", 64, 2, 2, 0)}
# stage-2 rows: (label, options, the row its ratio is taken against). A switch row turns one of
# the GPU path's defaults off (`--attention auto` is flex on a GPU, dense on a CPU).
STAGE2_RUNS = (
    ("none", ("--guidance", "none"), "none"),
    ("token", ("--guidance", "token"), "none"),
    ("token dense", ("--guidance", "token", "--attention", "dense"), "token"),
    ("token plain adamw", ("--guidance", "token", "--adamw-kernel", "plain"), "token"),
    ("token eager", ("--guidance", "token", "--compile", "off"), "token"),
    ("token plain loss", ("--guidance", "token", "--loss-kernel", "plain"), "token"),
)
# The floors beside `body`, which every stage-1 ratio divides by; --floors measures fewer.
FLOORS = (
    "bare forward", "body + fused head", "scorer", "scorer by unit", "scorer queued units",
    "body + triton head", "body + onepass head", "scorer +space",
)  # fmt: skip
LOSS_CHECK_DOCS = 4
# With --profile-dir, the unit each stage-1 job traces (--profile-unit) and the scorer traces
# again in this process: the second, past the first (and tiny shapes' runs have two).
PROFILED_UNIT = 1
# How long, and to within what of the idle level, a job's row waits at its start for the device
# memory a finished job's worker held to be freed.
SETTLE_SECONDS = 30.0
SETTLE_MARGIN = 1 << 30


@dataclass
class Row:
    what: str
    model: str
    tokens_per_second: float
    ratio: float | None
    mfu: float | None
    peak_bytes: int | None


def build_teacher(folder: Path, shape: dict, device: torch.device, dtype: torch.dtype) -> Path:
    """A random-weight Qwen2 causal LM of `shape` with the qwen2.5 tokenizer, as a model folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built on the device in its dtype: seconds for a 7B
    try:
        with device:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder)
    save_tokenizer(load_tokenizer("qwen2.5"), folder)
    del model
    return folder


def best_rate(one_pass, tokens: int, repeats: int, device) -> float:
    """`tokens` per second of `one_pass()`: one warm-up pass, then the best of `repeats`
    synchronized passes."""
    return tokens / best_seconds(one_pass, repeats, device)


def job_units(token_ids: list[np.ndarray], per_unit: int) -> list[list[np.ndarray]]:
    """The documents cut into the job's units of `per_unit`, in the job's order."""
    return [token_ids[begin : begin + per_unit] for begin in range(0, len(token_ids), per_unit)]


def computed_slots(scorer: HFScorer, token_ids: list[np.ndarray], per_unit: int) -> tuple[int, int]:
    """(positions the body computes, padding included, on the job's units of `per_unit`, on all
    documents laid out at once): each unit's last row and batch are partly empty."""
    return tuple(
        sum(layout.slots for unit in units for layout in scorer.plan(unit).layouts)
        for units in (job_units(token_ids, per_unit), [token_ids])
    )


def floor_timings(
    scorer: HFScorer,
    token_ids: list[np.ndarray],
    per_unit: int,
    repeats: int,
    device,
    floors: Collection[str] | None = None,
) -> dict[str, Callable[[], float]]:
    """{side: a call that times it and returns its teacher tokens/s}, `body` first: the bare
    forward pass and the floors, on the batches the worker builds (each unit of `per_unit`
    documents laid out apart, as the worker lays out a unit: its windows, `--row-packing` layout,
    mask and positions), already on the device, and the worker's whole scoring call from host
    token ids, over all documents at once and over the job's units; each counts every teacher
    token, as the job's progress does. `floors`: only these sides beside `body` (None: all but
    `scorer +space`, whose scorer the caller loads). Calls, not rates, so that each row is printed
    as it is measured and a side past the budget is never run."""
    units = job_units(token_ids, per_unit)
    batches = []
    for unit in units:  # planned as the worker plans a unit (HFScorer.plan)
        plan = scorer.plan(unit)
        batches += [batch_inputs(scorer, unit, plan.windows, layout) for layout in plan.layouts]
    tokens = sum(len(i) for i in token_ids)

    def bare_forward() -> None:
        for inputs, _, _ in batches:
            _ = scorer.model(**inputs, use_cache=False).logits

    def body() -> None:
        for inputs, _, _ in batches:
            _ = scorer.body(**inputs, use_cache=False).last_hidden_state

    def body_and_head(columns: HeadColumns) -> None:  # a batch's scored positions in one pass
        for inputs, row, position in batches:
            hidden = scorer.body(**inputs, use_cache=False).last_hidden_state[row, position]
            targets = inputs["input_ids"][row, position + 1]
            columns.of_batch(hidden, scorer.head, targets, len(row))

    fused = HeadColumns(HeadExtras(), scorer.vocab_size, device, "fused")

    def body_and_fused_head() -> None:  # the scorer's own head may be another (onepass on CUDA)
        body_and_head(fused)

    def scorer_pass() -> None:  # what a worker's unit does on the device, from host token ids
        scorer.score_columns(token_ids)

    def scorer_units() -> None:  # the same one unit at a time: each unit's last batch, its edges
        for unit in units:
            scorer.score_columns(unit)

    def scorer_queued_units() -> None:  # as a worker does: the next unit queued, then one collected
        queued = [scorer.queue_columns(units[0])]
        for unit in units[1:]:
            queued.append(scorer.queue_columns(unit))
            queued.pop(0).collect()
        queued.pop().collect()

    def kernel_head(kernel: str) -> float:  # a Triton kernel's first compile is in its warm-up
        columns = HeadColumns(HeadExtras(), scorer.vocab_size, device, kernel)
        return best_rate(functools.partial(body_and_head, columns), tokens, repeats, device)

    passes = {
        "body": body, "bare forward": bare_forward, "body + fused head": body_and_fused_head,
        "scorer": scorer_pass, "scorer by unit": scorer_units,
        "scorer queued units": scorer_queued_units,
    }  # fmt: skip
    timings = {
        side: functools.partial(best_rate, one_pass, tokens, repeats, device)
        for side, one_pass in passes.items()
    }
    if triton_runs(device):  # the head's product and reductions in one kernel; one read of logits
        for kernel in ("triton", "onepass"):
            timings[f"body + {kernel} head"] = functools.partial(kernel_head, kernel)
    wanted = FLOORS if floors is None else floors
    return {side: timing for side, timing in timings.items() if side == "body" or side in wanted}


@torch.inference_mode()
def direct_losses(model, ids: np.ndarray, max_length: int, stride: int, device) -> np.ndarray:
    """Per-token losses from one unpadded forward pass per window, full log-softmax; NaN where
    nothing predicts."""
    loss = np.full(len(ids), np.nan, dtype=np.float32)
    windows = plan_document_windows([len(ids)], max_length, stride)
    for start, score_from, end in zip(windows.start, windows.score_from, windows.end, strict=True):
        window = torch.as_tensor(ids[start:end], dtype=torch.long, device=device)[None]
        # no cache: a compiled layer would compile again for each layer's cache entry
        logits = model(input_ids=window, use_cache=False).logits
        logprobs = torch.log_softmax(logits[0].float(), dim=-1)
        positions = torch.arange(score_from - start - 1, end - start - 1, device=device)
        picked = logprobs[positions, window[0, positions + 1]]
        loss[score_from:end] = (-picked).cpu().numpy()
    return loss


def cache_rows(cache: Path) -> list[dict]:
    manifest = json.loads((cache / "manifest.json").read_text())
    return [
        row
        for shard in manifest["shards"]
        for row in pq.read_table(cache / shard["file"], columns=["token_ids", "loss"]).to_pylist()
    ]


def used_device_memory(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def others_device_memory(device: torch.device) -> int:
    """Device memory in use beyond what this process's allocator holds: the workers', mostly."""
    return used_device_memory(device) - torch.cuda.memory_reserved(device)


@contextlib.contextmanager
def polled_device_memory(device: torch.device, idle: int | None = None):
    """{"peak": bytes} of device memory in use above the level at entry, polled; None on CPU.
    Given `idle` (others_device_memory before any job), the level at entry is taken once the
    memory other processes use is back within SETTLE_MARGIN of it, for up to SETTLE_SECONDS: a
    finished job's worker process frees its memory after the job returns, and a level taken while
    it still held it made a later job's peak read 0 (run 5)."""
    result: dict = {"peak": None}
    if device.type != "cuda":
        yield result
        return
    deadline = time.monotonic() + SETTLE_SECONDS
    while idle is not None and others_device_memory(device) > idle + SETTLE_MARGIN:
        if time.monotonic() > deadline:
            print(f"device memory not back to its idle level after {SETTLE_SECONDS:g} s: this "
                  "row's peak is counted above what was still in use", flush=True)  # fmt: skip
            break
        time.sleep(0.1)
    base, done, peak = used_device_memory(device), threading.Event(), [0]

    def poll() -> None:
        while not done.wait(0.1):
            peak[0] = max(peak[0], used_device_memory(device) - base)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        done.set()
        thread.join()
        result["peak"] = peak[0]


def triton_runs(device: torch.device) -> bool:
    """Whether `--head-kernel triton` runs on `device`: on CUDA, or in Triton's interpreter."""
    try:
        triton_module("onepass", device)
    except ConfigError:
        return False
    return True


def stage1_variants(device: torch.device) -> tuple:
    """STAGE1_VARIANTS, the Triton head's row where its kernel runs, and the vLLM row where vllm
    imports."""
    variants = STAGE1_VARIANTS + (TRITON_VARIANTS if triton_runs(device) else ())
    if importlib.util.find_spec("vllm") is not None:
        variants += (("vllm", VLLM_VARIANT[device.type]),)
    return variants


class Bench:
    """The rows measured so far and what a leased machine's run needs around them: each row is
    printed as it is measured (and appended to --rows-jsonl), so that a run cut off at its limit
    still reports what it measured; a row that fails is reported in one line and the run goes on;
    a row whose predicted time would overrun --budget-seconds, or any once it is spent, is
    skipped and named."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.rows: list[Row] = []
        self.checks: dict[str, tuple[float, int, bool]] = {}
        self.failed: list[str] = []
        self.skipped: list[str] = []
        self.started = time.perf_counter()
        # other processes' device memory before any job, which each job's row waits to see again
        self.idle_memory = others_device_memory(device) if device.type == "cuda" else None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(row_line(row, device_name(self.device)), flush=True)
        if self.args.rows_jsonl:
            with open(self.args.rows_jsonl, "a") as out:
                out.write(json.dumps(row.__dict__ | {"device": device_name(self.device)}) + "\n")

    def attempt(self, what: str, measure, predicted: float | None = None) -> bool:
        """Run `measure()`, the step that adds `what`'s rows; False if it failed or was skipped:
        skipped once the budget is spent, or when `predicted` seconds would end past it."""
        budget = self.args.budget_seconds
        elapsed = self.elapsed()
        if budget and (elapsed >= budget or elapsed + (predicted or 0.0) > budget):
            self.skipped.append(what)
            why = (f"{elapsed:.0f} s in, --budget-seconds {budget:.0f} is spent"
                   if elapsed >= budget else f"{elapsed:.0f} s + about {predicted:.0f} s would "
                   f"pass --budget-seconds {budget:.0f}")  # fmt: skip
            print(f"{what}: skipped, {why}", flush=True)
            return False
        began = self.elapsed()
        try:
            measure()
        except Exception as exc:  # a benchmark reports every row it can, and names what broke
            traceback.print_exc()
            self.failed.append(what)
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            print(f"{what}: FAILED ({type(exc).__name__}: {first})", flush=True)
            return False
        print(f"{what}: {self.elapsed() - began:.0f} s, {self.elapsed():.0f} s in all", flush=True)
        return True


@dataclass
class Teacher:
    """One teacher's model folder and stage-1 command, and its cache (the first teacher's feeds
    stage 2 and its switch rows)."""

    name: str
    folder: Path
    out: Path
    command: list[str]
    rate: float = 0.0  # of `stage 1 (hf)`, the switch rows' baseline
    steady: float = 0.0  # of `stage 1 steady`, beside it on a switch row's line
    seconds: float = 0.0  # its wall time, what a switch row is predicted to take
    parameters: int = 0  # flop_parameters of the model


def teacher_job(bench: Bench, scratch: Path, corpus: Path, name: str, dtype: str) -> Teacher:
    max_length, stride, batch_tokens = STAGE1[bench.args.shapes]
    folder = build_teacher(scratch / name, TEACHERS[bench.args.shapes][name], bench.device,
                           getattr(torch, dtype))  # fmt: skip
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()  # the worker, not this process, scores with it
    out = scratch / f"cache-{name}"
    command = [
        "--teacher", str(folder), "--corpus", str(corpus), "--out", str(out),
        "--id-column", "id", "--docs-per-shard", str(bench.args.docs_per_shard), "--dtype", dtype,
        "--max-length", str(max_length), "--stride", str(stride),
        "--batch-tokens", str(batch_tokens), "--num-workers", "1",
        "--progress-seconds", "1e9",
    ]  # fmt: skip
    if bench.args.profile_dir:
        command += ["--profile-unit", str(PROFILED_UNIT)]
    return Teacher(name, folder, out, command)


def keep_trace(bench: Bench, out: Path, label: str) -> None:
    """With --profile-dir, the job's trace of PROFILED_UNIT copied there as `label`."""
    if bench.args.profile_dir:
        kept = bench.args.profile_dir / f"{label}-unit-{PROFILED_UNIT}.json"
        shutil.copyfile(out / profile_name(PROFILED_UNIT), kept)
        report_gaps(kept)


def report_gaps(trace: Path) -> None:
    """The device's gaps in a kept trace and what held the host (benchmarks/trace_gaps.py)."""
    try:
        line = describe_trace(trace)
    except Exception as exc:  # a trace this reader cannot read costs a line, not the GPU's run
        line = f"not read ({type(exc).__name__}: {exc})"
    print(f"trace {trace.name}: {line}", flush=True)


def stage1_and_floors(bench: Bench, teacher: Teacher, dtype: str) -> None:
    """`stage 1 (hf)` of `teacher`, then its floors on the worker's batches and the loss check."""
    max_length, stride, batch_tokens = STAGE1[bench.args.shapes]
    per_unit = bench.args.docs_per_shard
    device, peak = bench.device, device_peak_flops(bench.device)
    began = time.perf_counter()
    with polled_device_memory(device, bench.idle_memory) as polled:
        _, _, worker_rates = timed_stage1(teacher.command)
    teacher.seconds, teacher.rate = time.perf_counter() - began, sum(worker_rates)
    print(f"stage 1 (hf) {teacher.name}: {teacher.rate:,.0f} tok/s, the job {teacher.seconds:.0f} s; "
          f"{phase_summary(teacher.out)}; {device_summary(teacher.out)}", flush=True)  # fmt: skip
    keep_trace(bench, teacher.out, f"{teacher.name}-stage1")
    load = functools.partial(
        HFScorer, resolve_teacher(str(teacher.folder)), asked=Asked(dtype), max_length=max_length,
        stride=stride, batch_tokens=batch_tokens, device=str(device),
    )  # fmt: skip
    loaded = time.perf_counter()
    scorer = load().load()
    load_seconds = time.perf_counter() - loaded
    model = scorer.model
    parameters = teacher.parameters = flop_parameters(model)
    cached = cache_rows(teacher.out)
    token_ids = [np.asarray(r["token_ids"], dtype=np.int64) for r in cached]
    tokens, repeats = sum(len(ids) for ids in token_ids), bench.args.repeats
    wanted = bench.args.floors or FLOORS
    timings = floor_timings(scorer, token_ids, per_unit, repeats, device, wanted)

    # the body first, and the job's rows against it at once: a run cut off in the floors keeps them
    reset_peak(device)
    body_rate = timings.pop("body")()
    body_peak = peak_memory(device)
    steady = teacher.steady = steady_rate(teacher.out)

    def add_against_body(what: str, rate: float, peak_bytes: int | None) -> None:
        utilization = mfu(parameters, rate, peak, training=False)
        bench.add(Row(what, teacher.name, rate, rate / body_rate, utilization, peak_bytes))

    add_against_body("stage 1 (hf)", teacher.rate, polled["peak"])
    add_against_body("stage 1 steady", steady, polled["peak"])
    add_against_body("body", body_rate, body_peak)

    def floor_row(side: str, timing: Callable[[], float]) -> None:
        reset_peak(device)
        rate = timing()
        add_against_body(side, rate, peak_memory(device))
        if side == "bare forward":
            print(f"stage 1 / bare forward, {teacher.name}: {teacher.rate / rate:.3f}", flush=True)

    by_unit, at_once = computed_slots(scorer, token_ids, per_unit)
    print(f"slots the body computes, {teacher.name}: {by_unit:,} on units of {per_unit} (the "
          f"job's and the floors'), {at_once:,} on all documents at once (the `scorer` row's): "
          f"{by_unit / at_once:.4f}", flush=True)  # fmt: skip
    spaced, vocab_size = {}, scorer.vocab_size

    def scorer_with_space() -> float:  # whether what `+space` costs the job is the call's own cost
        mask = space_mask(load_tokenizer(str(teacher.folder)), vocab_size)[0]
        spaced["scorer+space"] = load(extras=HeadExtras(space_mask=mask)).load()
        score = functools.partial(spaced["scorer+space"].score_columns, token_ids)
        return best_rate(score, tokens, repeats, device)

    if "scorer +space" in wanted:
        timings["scorer +space"] = scorer_with_space
    # a side's warm-up and timed passes at the slowest floor's rate (0.84 of the body in run 12)
    floor_seconds = (1 + repeats) * tokens / body_rate / 0.8
    for side, timing in timings.items():
        extra = load_seconds if timing is scorer_with_space else 0.0
        bench.attempt(side, functools.partial(floor_row, side, timing), floor_seconds + extra)
    if bench.args.profile_dir:  # the job's traced unit, scored here, without the job around it
        unit = token_ids[PROFILED_UNIT * per_unit : (PROFILED_UNIT + 1) * per_unit]
        for label, traced_scorer in (("scorer", scorer), *spaced.items()):
            with traced(True) as trace:
                traced_scorer.score_columns(unit)
                synchronize(device)
            path = bench.args.profile_dir / f"{teacher.name}-{label}-unit-{PROFILED_UNIT}.json"
            path.write_bytes(trace.data)
            report_gaps(path)
    spaced.clear()
    model.set_attn_implementation("sdpa")  # the check's plain forward pass
    differences = []
    for row, ids in zip(cached[:LOSS_CHECK_DOCS], token_ids, strict=False):
        direct = direct_losses(model, ids, max_length, stride, device)
        stored = np.asarray(row["loss"], dtype=np.float32)
        differences.append(np.abs(stored - direct)[1:])
    difference = np.concatenate(differences)
    # stored float16 (~0.01 near a loss of 12), plus bf16's padded-vs-unpadded rounding
    tolerance = 0.02 if dtype == "float32" else 0.25
    bench.checks[teacher.name] = (float(difference.max()), difference.size,
                                  bool(difference.max() <= tolerance))  # fmt: skip
    del model, scorer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # What this process compiled for this teacher counts towards the recompile limit of the
    # next one's: a worker holds one teacher and starts afresh.
    torch._dynamo.reset()


def stage1_variant(bench: Bench, teacher: Teacher, label: str, options: tuple) -> None:
    """The first teacher's job with `options`, as a ratio to `stage 1 (hf)`, and the largest
    difference of its stored losses from stage 1's."""
    out = teacher.out.with_name(f"{teacher.out.name}-{label.replace(' ', '-')}")
    command = [str(out) if arg == str(teacher.out) else arg for arg in teacher.command]
    with polled_device_memory(bench.device, bench.idle_memory) as polled:
        rate = sum(timed_stage1([*command, *options])[2])
    difference = max(
        float(np.nanmax(np.abs(np.asarray(a["loss"], np.float32) -
                               np.asarray(b["loss"], np.float32))))
        for a, b in zip(cache_rows(out), cache_rows(teacher.out), strict=True)
    )  # fmt: skip
    steady = steady_rate(out)  # without the edges, whose host work varies between machines
    # against the plain job nearest in time too: later jobs on a machine ran 0.5% below its
    # first (runs 12 and 15), so a switch measured after `again` is read against the last one
    again = [r.tokens_per_second for r in bench.rows
             if r.what == "stage 1 again" and r.model == teacher.name]  # fmt: skip
    of_again = f", {rate / again[-1]:.3f} of stage 1 again" if again else ""
    print(f"stage 1 {label} vs stage 1: max |stored loss difference| {difference:.2e}; "
          f"{phase_summary(out)}; steady {steady:,.0f} tok/s, {steady / teacher.steady:.3f} of "
          f"stage 1 steady{of_again}; {device_summary(out)}")  # fmt: skip
    keep_trace(bench, out, f"{teacher.name}-stage1-{label.replace(' ', '-')}")
    shutil.rmtree(out)
    bench.add(Row(f"stage 1 {label}", teacher.name, rate, rate / teacher.rate,
                  mfu(teacher.parameters, rate, device_peak_flops(bench.device), training=False),
                  polled["peak"]))  # fmt: skip


class Stage2:
    """The stage-2 runs on the first teacher's cache: each label's tokens/s and per-step losses."""

    def __init__(self, bench: Bench, cache: Path, scratch: Path):
        self.bench, self.cache, self.scratch = bench, cache, scratch
        self.rates: dict[str, float] = {}
        self.losses: dict[str, np.ndarray] = {}
        self.seconds: dict[str, float] = {}

    def run(self, label: str, options: tuple, baseline: str) -> None:
        from stage2_train.train import main as train

        args, device = self.bench.args, self.bench.device
        student, seq_len, micro, accumulation, workers = STAGE2[args.shapes]
        out = self.scratch / f"stage2-{label.replace(' ', '-')}"
        reset_peak(device)
        global_batch = seq_len * micro * accumulation
        command = [
            "--cache", str(self.cache), "--student", student, "--student-tokenizer", "tinyllama",
            "--out", str(out), "--max-steps", str(args.steps), "--warmup-steps", "1",
            "--seq-len", str(seq_len), "--micro-batch-size", str(micro),
            "--global-batch-tokens", str(global_batch), "--num-workers", str(workers),
            "--save-every", "1000000", "--no-save-at-end", *options,
        ]  # fmt: skip
        log = io.StringIO()
        clean_compile_state()
        began = time.perf_counter()
        with contextlib.redirect_stderr(log):
            assert train(command) == 0, log.getvalue()
        self.seconds[label] = time.perf_counter() - began
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        # a step's seconds from its rate over every slot (metrics.jsonl has no clock)
        steps = [global_batch / r["slot_tokens_per_second"] for r in records]
        print(f"stage 2 {label}: {self.seconds[label]:.1f} s: {self.seconds[label] - sum(steps):.1f} "
              f"s before and after the steps, first step {steps[0]:.2f} s, the other "
              f"{len(steps) - 1} {sum(steps[1:]):.2f} s; {compiled_graphs()}", flush=True)  # fmt: skip
        steady = records[len(records) // 3 :]
        self.rates[label] = statistics.median(r["tokens_per_second"] for r in steady)
        self.losses[label] = np.array([r["loss_all"] for r in records])
        utilization = [r["mfu"] for r in steady if r["mfu"] is not None]
        self.bench.add(
            Row(f"stage 2 {label}", student, self.rates[label],
                self.rates[label] / self.rates[baseline],
                statistics.median(utilization) if utilization else None, peak_memory(device))
        )  # fmt: skip
        if baseline not in (label, "none"):  # a switch row changes speed, not what is trained
            difference = np.abs(self.losses[label] - self.losses[baseline]).max()
            print(f"stage 2 {label} vs {baseline}: max |loss difference| {difference:.2e} over "
                  f"{len(self.losses[label])} steps")  # fmt: skip
        shutil.rmtree(out)

    def floor(self) -> None:
        args, device = self.bench.args, self.bench.device
        student, seq_len, micro, accumulation, _ = STAGE2[args.shapes]
        reset_peak(device)
        clean_compile_state()
        rate, utilization = floor_rate(student, seq_len, micro, accumulation, args.steps, device)
        self.bench.add(Row("stage 2 floor", student, rate, None, utilization, peak_memory(device)))
        print(f"stage 2 floor: {compiled_graphs()}")
        print(f"stage 2 token / the floor: {self.rates['token'] / rate:.3f}")


def clean_compile_state() -> None:
    """Each stage-2 row compiles afresh: what an earlier row compiled would count towards this
    row's recompile limit (a run is one process), and its graphs towards this row's count."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def compiled_graphs() -> str:
    """What dynamo compiled since `clean_compile_state`: graphs, and frames it gave up on."""
    from torch._dynamo.utils import counters

    limit = sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason)
    return (f"{counters['stats']['unique_graphs']} graphs compiled, recompile limit hit "
            f"{limit} times")  # fmt: skip


def measure_all(bench: Bench, scratch: Path, corpus: Path, dtype: str) -> None:
    """Every row, the ones the targets name first: each teacher's `stage 1 (hf)` and floors; the
    first teacher's PRIORITY_VARIANTS; stage 2's arms and floor; then the other switch rows. A
    switch row (and the floor) is skipped where its predicted time, its baseline's, would overrun
    the budget."""
    import ray

    def start_ray() -> None:
        ray.init(address="local", num_cpus=bench.args.cpus, include_dashboard=False,
                 logging_level="ERROR")  # fmt: skip

    def variant_rows(labels) -> None:
        for label in labels:
            bench.attempt(f"stage 1 {label}",
                          lambda v=label: stage1_variant(bench, first, v, variants[v]),
                          predicted=first.seconds)  # fmt: skip

    names = [name for name in TEACHERS[bench.args.shapes] if name in bench.args.teachers]
    start_ray()
    try:
        measured: dict[str, Teacher] = {}

        def teacher_rows(name: str) -> None:
            measured[name] = teacher_job(bench, scratch, corpus, name, dtype)
            stage1_and_floors(bench, measured[name], dtype)

        for name in names:
            if not bench.attempt(f"stage 1 (hf) {name}", lambda n=name: teacher_rows(n)):
                measured.pop(name, None)
            if name != names[0]:
                shutil.rmtree(scratch / name, ignore_errors=True)  # disk: a 7B folder is 15 GB
        if names[0] not in measured:
            return  # its cache feeds every row below
        first, variants = measured[names[0]], dict(stage1_variants(bench.device))
        if bench.args.switches is None:
            before = [label for label in variants if label in PRIORITY_VARIANTS]
            after = [label for label in variants if label not in before]
        else:  # all before stage 2, in the order named, so that a budget keeps the first (one
            # named twice is measured twice); named with no label: no switch row
            before, after = [label for label in bench.args.switches if label in variants], []
        variant_rows(before)
        if bench.args.stage1_only:
            variant_rows(after)
            return
        ray.shutdown()  # stage 2 trains in this process
        stage2 = Stage2(bench, first.out, scratch)
        if not stage2_arms_and_floor(bench, stage2):
            return
        start_ray()
        variant_rows(after)
        ray.shutdown()
        stage2_rows(bench, stage2, STAGE2_RUNS[2:])
    finally:
        ray.shutdown()


def stage2_rows(bench: Bench, stage2: Stage2, runs) -> bool:
    """Stage 2's `runs`, each predicted to take what its baseline took (`none`: not known); each
    is attempted, so that every one skipped is named."""
    return all([
        bench.attempt(f"stage 2 {label}", functools.partial(stage2.run, label, options, baseline),
                      predicted=stage2.seconds.get(baseline))
        for label, options, baseline in runs
    ])  # fmt: skip


def stage2_arms_and_floor(bench: Bench, stage2: Stage2) -> bool:
    """`none`, `token` and the floor; False where an arm failed or was skipped."""
    if not stage2_rows(bench, stage2, STAGE2_RUNS[:2]):
        return False
    bench.attempt("stage 2 floor", stage2.floor, predicted=stage2.seconds["token"])
    return True


def measure_stage2(bench: Bench, scratch: Path) -> None:
    """--stage2-only: stage 2's rows on a cache of the shipped corpus's first --docs documents
    with seeded random teacher losses (tests/cache_fixtures.py, the stage-1 contract's writer,
    the qwen2.5 tokenizer): no Ray, no teacher, no stage-1 job."""
    from tests.cache_fixtures import build_cache

    began = time.perf_counter()
    cache = scratch / "cache"
    build_cache(cache, num_documents=bench.args.docs, docs_per_shard=bench.args.docs_per_shard)
    print(f"cache of {bench.args.docs} documents, random teacher losses: "
          f"{time.perf_counter() - began:.1f} s", flush=True)  # fmt: skip
    stage2 = Stage2(bench, cache, scratch)
    if stage2_arms_and_floor(bench, stage2):
        stage2_rows(bench, stage2, STAGE2_RUNS[2:])


def row_line(row: Row, device: str) -> str:
    return (
        f"{row.what:<27} {row.model:<18} {row.tokens_per_second:>11,.0f} "
        f"{'' if row.ratio is None else f'{row.ratio:.3f}':>7} "
        f"{'n/a' if row.mfu is None else f'{row.mfu:.1%}':>7} "
        f"{'n/a' if row.peak_bytes is None else f'{row.peak_bytes / 2**30:.2f}':>12}  {device}"
    )


def print_table(rows: list[Row], device) -> None:
    header = (
        f"{'what':<27} {'model':<18} {'tokens/s':>11} {'ratio':>7} {'MFU':>7} "
        f"{'peak mem GiB':>12}  device"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(row_line(row, device_name(device)))
    print(
        "ratio: stage 1 (hf) and steady, bare forward, body + fused, triton or onepass head and the scorer rows / body of the same teacher; stage 1 +space (--space-logprob), "
        "+topk 32 and a stage 1 switch row / stage 1; stage 2 arm / stage 2 none; a stage 2 switch row / stage 2 token (whose "
        "defaults are the GPU path's on a GPU, the same as the switch rows' on a CPU). Targets: stage 1 >= 0.85 of body and 0.95 of bare forward, +space >= 0.99 on a "
        "GPU, stage 2 MFU >= 55%, token >= 0.97."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=("gpu", "tiny"), help="default: gpu with CUDA")
    parser.add_argument("--docs", type=int, help="documents of the shipped training split")
    parser.add_argument(
        "--docs-per-shard", type=int,
        help="documents a stage-1 unit (default at gpu shapes: the job's own, 1,000; runs 1-6 "
        "measured 256)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, help="stage-2 optimizer steps per arm")
    parser.add_argument("--repeats", type=int, default=3, help="timed bare-forward passes")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    parser.add_argument(
        "--budget-seconds", type=float, default=0.0,
        help="skip a row whose predicted time (its baseline's: a switch row's, a stage-1 "
        "floor's, stage 2's but `none`) would end past this many seconds from the start, and "
        "every row once they have passed; 0: no budget",
    )  # fmt: skip
    parser.add_argument("--rows-jsonl", type=Path, help="also append each row here as measured")
    parser.add_argument(
        "--profile-dir", type=Path,
        help=f"trace unit {PROFILED_UNIT} of every stage-1 job (--profile-unit) and the scorer's "
        "own pass over it, with and without the space column, into this folder (Chrome's trace "
        "format; Perfetto opens them), each followed by a line of its device's gaps and what "
        "held the host in them (benchmarks/trace_gaps.py)",
    )  # fmt: skip
    parser.add_argument(
        "--teachers", nargs="+", choices=list(TEACHERS["gpu"]), default=list(TEACHERS["gpu"]),
        help="the teachers to measure (default: both); the first of them in this list's order "
        "feeds stage 2 and the switch rows",
    )  # fmt: skip
    parser.add_argument("--stage1-only", action="store_true", help="no stage-2 rows")
    parser.add_argument(
        "--stage2-only", action="store_true",
        help="stage 2's rows alone, on a cache of --docs documents with random teacher losses: "
        "no Ray, no teacher, no stage-1 job",
    )  # fmt: skip
    parser.add_argument(
        "--floors", nargs="+", choices=FLOORS,
        help="only these stage-1 floors beside `body`, which every stage-1 ratio divides by "
        "(default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--switches", nargs="*",
        choices=[label for label, _ in (*STAGE1_VARIANTS, *TRITON_VARIANTS)] + ["vllm"],
        help="only these stage-1 switch rows, before stage 2's and in the order named, so that "
        "--budget-seconds skips the last; one named twice is measured twice (default: all, in "
        "their usual order; named alone: none, as for a run of stage 2's rows)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.shapes = args.shapes or ("gpu" if device.type == "cuda" else "tiny")
    for key, value in DEFAULTS[args.shapes].items():
        setattr(args, key, getattr(args, key) or value)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, device)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if args.stage2_only:
            measure_stage2(bench, scratch)
        else:
            measure_all(bench, scratch, write_corpus_slice(scratch, args.docs), dtype)
    print(
        f"shapes {args.shapes}, {args.docs} documents, teachers in {dtype}, "
        f"{args.steps} stage-2 steps per arm, {bench.elapsed():.0f} s in all"
    )
    print_table(bench.rows, device)
    for name, (largest, tokens, passed) in bench.checks.items():
        verdict = "passed" if passed else "FAILED"
        print(
            f"loss check {name}: max |cached - direct forward| {largest:.4f} over {tokens} "
            f"tokens of {LOSS_CHECK_DOCS} documents: {verdict}"
        )
    for what in bench.failed:
        print(f"row failed: {what} (its traceback is above)")
    for what in bench.skipped:
        print(f"row skipped for the budget: {what}")
    passed = all(passed for *_, passed in bench.checks.values())
    return 0 if passed and not bench.failed else 1


if __name__ == "__main__":
    sys.exit(main())
