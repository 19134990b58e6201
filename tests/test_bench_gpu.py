"""benchmarks/bench_gpu.py cannot rot: its model building and its floors' timing run here at tiny
shapes (fast), and its whole main at tiny shapes on the CPU (slow: a local Ray and two stages)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_gpu  # noqa: E402

VLLM_IMPORTS = importlib.util.find_spec("vllm") is not None  # `make test` installs vLLM's CPU build

from pipeline.scoring.head import HeadColumns  # noqa: E402
from pipeline.scoring.hf import HFScorer  # noqa: E402
from pipeline.scoring.resolve import Asked  # noqa: E402
from pipeline.scoring.switches import HeadSwitches  # noqa: E402
from pipeline.scoring.teacher import resolve_teacher  # noqa: E402
from pipeline.scoring.windows import plan_document_windows  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from tests.stage1_helpers import (  # noqa: E402
    direct_losses,
    head_pass_inputs,
    windowed_direct_losses,
)


def test_tiny_teacher_floors_and_direct_losses(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    shape = bench_gpu.TEACHERS["tiny"]["qwen2.5-1.5b-like"]
    folder = bench_gpu.build_teacher(tmp_path / "teacher", shape, cpu, torch.float32)
    scorer = HFScorer(
        resolve_teacher(str(folder)), max_length=32, stride=16, batch_tokens=64, device="cpu",
        asked=Asked("float32", HeadSwitches(head_kernel="fused")),
    ).load()  # fmt: skip
    model = scorer.model
    assert model.config.vocab_size == shape["vocab_size"] >= load_tokenizer("qwen2.5").vocab_size
    ids = [np.arange(1, n, dtype=np.int64) * 7 for n in (40, 90, 15)]
    # Every side runs on the worker's batches and counts every teacher token, as the job does.
    timed = {}

    def count(one_pass, tokens, repeats, device):
        timed[getattr(one_pass, "__name__", "a kernel's side")] = tokens
        one_pass()
        return 1.0

    calls, queue_columns = [], scorer.queue_columns  # score_columns's first half
    laid_out, batch_inputs = [], bench_gpu.batch_inputs

    def recorded(token_ids, *args, **kwargs):
        calls.append([len(i) for i in token_ids])
        return queue_columns(token_ids, *args, **kwargs)

    def recorded_inputs(scorer, token_ids, windows, layout):
        laid_out.append(([len(i) for i in token_ids], layout.slots))
        return batch_inputs(scorer, token_ids, windows, layout)

    with monkeypatch.context() as patch:
        patch.setattr(bench_gpu, "best_rate", count)
        patch.setattr(scorer, "queue_columns", recorded)
        patch.setattr(bench_gpu, "batch_inputs", recorded_inputs)
        timings = bench_gpu.floor_timings(scorer, ids, 2, 1, cpu)
        assert timed == {}  # nothing is timed until its row asks: a side past the budget never runs
        rates = {side: timing() for side, timing in timings.items()}
    # the body first: the job's rows are printed against it before any other floor is measured
    assert list(rates) == [
        "body", "bare forward", "body + fused head", "scorer", "scorer by unit",
        "scorer queued units",
    ]  # fmt: skip
    sides = ("body", "bare_forward", "body_and_fused_head", "scorer_pass", "scorer_units",
             "scorer_queued_units")  # fmt: skip
    assert timed == dict.fromkeys(sides, 39 + 89 + 14)
    # --floors: only the sides named, beside `body`, which every ratio divides by
    timed.clear()
    with monkeypatch.context() as patch:
        patch.setattr(bench_gpu, "best_rate", count)
        patch.setattr(bench_gpu, "triton_runs", lambda device: True)
        fewer = bench_gpu.floor_timings(scorer, ids, 2, 1, cpu, floors=("bare forward",))
        assert list(fewer) == ["body", "bare forward"]
        for timing in fewer.values():
            timing()
    assert set(timed) == {"bare_forward", "body"}
    # the scorer scores all documents in one call, then the job's units of 2 in order, then
    # queues them as a worker does
    assert calls == [[39, 89, 14], [39, 89], [14], [39, 89], [14]]
    # The floors' rows are the worker's: each unit of 2 laid out apart, as the worker lays out a
    # unit (`HFScorer.plan`), not all three documents at once (padded here, on a CPU: 238 slots
    # against 256).
    floors = [
        ([len(i) for i in unit], layout.slots)
        for unit in (ids[:2], ids[2:])
        for layout in scorer.layouts(plan_document_windows([len(i) for i in unit], 32, 16))
    ]
    assert laid_out[: len(floors)] == floors
    by_unit, at_once = bench_gpu.computed_slots(scorer, ids, 2)
    assert by_unit == sum(slots for _, slots in floors)
    whole = scorer.layouts(plan_document_windows([39, 89, 14], 32, 16))
    assert at_once == sum(layout.slots for layout in whole) != by_unit

    # Where Triton runs, its kernels' sides follow, each built when its row is measured, so a
    # first compile that fails on the GPU fails that row alone (kernels planted here: fused's
    # pass stands in for Triton's).
    def columns(extras, vocab_size, device, kernel):
        if kernel == "onepass":
            raise RuntimeError("ptxas: a planted compile error")
        return HeadColumns(extras, vocab_size, device, "fused")

    with monkeypatch.context() as patch:
        patch.setattr(bench_gpu, "best_rate", count)
        patch.setattr(bench_gpu, "triton_runs", lambda device: True)
        patch.setattr(bench_gpu, "HeadColumns", columns)
        timings = bench_gpu.floor_timings(scorer, ids, 2, 1, cpu)
        assert list(timings)[-2:] == ["body + triton head", "body + onepass head"]
        assert timings["body + triton head"]() == 1.0
        with pytest.raises(RuntimeError, match="planted compile error"):
            timings["body + onepass head"]()
    assert_rate_is_tokens_per_second_of_the_best_timed_pass(monkeypatch)

    # 89 tokens in windows of 32 with a stride of 16: the reference is the windows module's plain
    # loop of unpadded forward passes, and the first window's tokens see the whole prefix.
    text, window, stride = ids[1], 32, 16
    windowed = bench_gpu.direct_losses(model, text, window, stride, cpu)
    assert len(text) > 2 * window
    np.testing.assert_allclose(
        windowed, windowed_direct_losses(model, text, window, stride), atol=1e-4
    )
    np.testing.assert_allclose(windowed[:window], direct_losses(model, text)[:window], atol=1e-4)

    # Peak memory on a CPU is this process's RSS high-water mark in bytes (the kernel's VmHWM).
    # getrusage and /proc read it from counters that threads update in batches, so the two may
    # differ by a few hundred KiB (seen: 144 KiB of 1.1 GiB); a unit wrong by 1024x may not.
    before = resident_high_water_mark()
    peak = bench_gpu.peak_memory(cpu)
    assert 0.99 * before <= peak <= 1.01 * resident_high_water_mark()


def resident_high_water_mark() -> int:
    """VmHWM of this process in bytes, read from /proc."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB$", status, re.MULTILINE).group(1)) * 1024


def assert_rate_is_tokens_per_second_of_the_best_timed_pass(monkeypatch) -> None:
    """On a fake clock that only the passes advance, each pass taking a chosen time: the rate is
    the tokens over the fastest timed pass, not the (faster) warm-up."""
    repeats, tokens, cpu = 3, 1000, torch.device("cpu")
    seconds_per_pass = [0.5, 4.0, 2.0, 3.0]  # the warm-up pass, then the timed ones
    clock = {"now": 100.0, "calls": 0}

    def one_pass():
        clock["now"] += seconds_per_pass[clock["calls"]]
        clock["calls"] += 1

    with monkeypatch.context() as patch:
        patch.setattr(bench_gpu.time, "perf_counter", lambda: clock["now"])
        rate = bench_gpu.best_rate(one_pass, tokens, repeats, cpu)
    assert clock["calls"] == 1 + repeats
    assert rate == pytest.approx(tokens / min(seconds_per_pass[1:]))


@pytest.mark.slow
def test_benchmark_main_at_tiny_shapes_prints_every_row_and_passes_the_loss_check(capsys, tmp_path):
    traces = tmp_path / "traces"
    command = ["--shapes", "tiny", "--docs", "16", "--steps", "3", "--repeats", "1"]
    assert bench_gpu.main([*command, "--profile-dir", str(traces)]) == 0
    out = capsys.readouterr().out
    for what, model in [
        ("stage 1 (hf)", "qwen2.5-1.5b-like"),
        ("stage 1 steady", "qwen2.5-1.5b-like"),
        ("stage 1 again", "qwen2.5-1.5b-like"),
        ("stage 1 +space", "qwen2.5-1.5b-like"),
        ("stage 1 +topk 32", "qwen2.5-1.5b-like"),
        ("stage 1 plain head", "qwen2.5-1.5b-like"),
        ("stage 1 fixed chunks", "qwen2.5-1.5b-like"),
        ("stage 1 serial units", "qwen2.5-1.5b-like"),
        ("stage 1 serial batches", "qwen2.5-1.5b-like"),
        ("stage 1 eager layers", "qwen2.5-1.5b-like"),
        ("stage 1 padded rows", "qwen2.5-1.5b-like"),
        ("bare forward", "qwen2.5-1.5b-like"),
        ("body ", "qwen2.5-1.5b-like"),
        ("body + fused head", "qwen2.5-1.5b-like"),
        ("scorer", "qwen2.5-1.5b-like"),
        ("scorer by unit", "qwen2.5-1.5b-like"),
        ("scorer queued units", "qwen2.5-1.5b-like"),
        ("scorer +space", "qwen2.5-1.5b-like"),
        ("stage 1 (hf)", "qwen2.5-7b-like"),
        ("stage 1 steady", "qwen2.5-7b-like"),
        ("bare forward", "qwen2.5-7b-like"),
        ("body ", "qwen2.5-7b-like"),
        ("body + fused head", "qwen2.5-7b-like"),
        ("scorer", "qwen2.5-7b-like"),
        ("scorer by unit", "qwen2.5-7b-like"),
        ("scorer queued units", "qwen2.5-7b-like"),
        ("scorer +space", "qwen2.5-7b-like"),
        ("stage 2 none", "llama-tiny"),
        ("stage 2 token", "llama-tiny"),
        ("stage 2 token dense", "llama-tiny"),
        ("stage 2 token plain adamw", "llama-tiny"),
        ("stage 2 token eager", "llama-tiny"),
        ("stage 2 token plain loss", "llama-tiny"),
        ("stage 2 floor", "llama-tiny"),
    ] + [("stage 1 vllm", "qwen2.5-1.5b-like")] * VLLM_IMPORTS:
        assert any(line.startswith(what) and model in line for line in out.splitlines()), out
    assert out.count(": passed") == 2 and "FAILED" not in out
    assert "stage 2 token / the floor: " in out
    assert "stage 1 / bare forward, qwen2.5-7b-like: " in out
    # The columns leave the stored loss as it is; on a CPU `auto` resolves to the switch rows'
    # settings: each caches exactly what stage 1 does, and trains exactly what `token` does.
    switches = ("again", "+space", "+topk 32", "plain head", "fixed chunks", "serial units",
                "serial batches", "eager layers", "padded rows")  # fmt: skip
    device = r"device: \d+ batches, [.\d]+% of [.\d]+ s in them \(at [,\d]+ tok/s\), .*"
    for switch in switches:  # each after `again` read against it too, the plain job nearest
        line = f"stage 1 {switch} vs stage 1: max |stored loss difference| 0.00e+00"
        again = "" if switch == "again" else r", [.\d]+ of stage 1 again"
        pattern = rf"^{re.escape(line)}; .* of stage 1 steady{again}; {device}$"
        assert re.search(pattern, out, re.M), out
    for teacher in bench_gpu.TEACHERS["tiny"]:  # each job's line says where its device time went
        assert re.search(rf"^stage 1 \(hf\) {teacher}: .*; {device}$", out, re.M), out
    if VLLM_IMPORTS:  # vLLM's own arithmetic, stored as float16 (a step is 0.008 near 12 nats)
        vllm = re.search(
            r"stage 1 vllm vs stage 1: max \|stored loss difference\| ([-+.e0-9]+)", out
        )
        assert float(vllm.group(1)) <= 0.02, out
    for switch in ("token dense", "token plain adamw", "token eager", "token plain loss"):
        assert f"stage 2 {switch} vs token: max |loss difference| 0.00e+00 over 3 steps" in out
    # --profile-dir: each job's trace of the profiled unit, and the scorer's of the same unit
    switches = bench_gpu.stage1_variants(torch.device("cpu"))  # with `vllm` where it imports
    jobs = ["stage1"] + [f"stage1-{label.replace(' ', '-')}" for label, _ in switches]
    expected = {
        f"{teacher}-{what}-unit-{bench_gpu.PROFILED_UNIT}.json"
        for teacher in bench_gpu.TEACHERS["tiny"]
        for what in ["stage1", "scorer", "scorer+space"]
    } | {f"qwen2.5-1.5b-like-{job}-unit-{bench_gpu.PROFILED_UNIT}.json" for job in jobs}
    assert {path.name for path in traces.iterdir()} == expected
    for path in traces.iterdir():
        assert "traceEvents" in json.loads(path.read_text())
        # each followed by its device's gaps (benchmarks/trace_gaps.py): a CPU trace has none
        assert f"trace {path.name}: no device work in the trace" in out


@pytest.mark.slow
def test_a_floor_that_fails_costs_its_row_and_the_jobs_rows_come_first(monkeypatch, capsys):
    """Run 13 lost a 7B job's rows when its floors outlasted the device call: the job's rows are
    now printed against the body as soon as it is measured, and a floor that fails (a planted
    bare forward here) costs its row alone; --floors measures the floors named."""
    floor_timings = bench_gpu.floor_timings

    def broken() -> float:
        raise RuntimeError("planted")

    def planted(*args, **kwargs):
        return floor_timings(*args, **kwargs) | {"bare forward": broken}

    monkeypatch.setattr(bench_gpu, "floor_timings", planted)
    command = ["--shapes", "tiny", "--docs", "16", "--repeats", "1", "--stage1-only",
               "--teachers", "qwen2.5-1.5b-like", "--switches", "again",
               "--floors", "bare forward", "body + fused head"]  # fmt: skip
    assert bench_gpu.main(command) == 1  # a failed row fails the run
    out = capsys.readouterr().out
    measured = [line.split("  ")[0] for line in out.splitlines() if "qwen2.5-1.5b-like  " in line]
    assert measured[:4] == ["stage 1 (hf)", "stage 1 steady", "body", "body + fused head"], out
    assert "bare forward: FAILED (RuntimeError: planted)" in out
    assert "row failed: bare forward" in out and "stage 1 again" in measured
    assert not {"scorer", "scorer +space"} & set(measured)
    assert out.count(": passed") == 1


@pytest.mark.slow
def test_switches_named_alone_measure_no_switch_row(capsys):
    """A device call spent on stage 2's rows (or on the floors) names `--switches` with no label,
    which must measure no stage-1 switch row, not every one."""
    command = ["--shapes", "tiny", "--docs", "16", "--repeats", "1", "--stage1-only",
               "--teachers", "qwen2.5-1.5b-like", "--floors", "bare forward",
               "--switches"]  # fmt: skip
    assert bench_gpu.main(command) == 0
    out = capsys.readouterr().out
    measured = [line.split("  ")[0] for line in out.splitlines() if "qwen2.5-1.5b-like  " in line]
    assert set(measured) == {"stage 1 (hf)", "stage 1 steady", "body", "bare forward"}, out


def test_a_trace_the_gap_reader_cannot_read_costs_a_line_not_the_run(tmp_path, capsys):
    broken = tmp_path / "unit.json"
    broken.write_text("{")
    bench_gpu.report_gaps(broken)
    assert capsys.readouterr().out.startswith("trace unit.json: not read (JSONDecodeError: ")


def test_a_job_rows_memory_is_counted_once_the_last_jobs_worker_has_freed_its_own(monkeypatch):
    """Run 5's `triton head` row read a peak of 0: its level was taken while the previous job's
    worker still held its memory. The level is now taken once other processes' memory is back
    near its idle level (a device's memory scripted here: no GPU)."""
    gib, total = 1 << 30, 80 << 30
    state = {"others": 12 * gib, "reads": 0}

    def mem_get_info(device):
        state["reads"] += 1
        if state["reads"] == 5:  # the last job's worker is gone
            state["others"] = gib // 2
        return total - state["others"], total

    monkeypatch.setattr(bench_gpu.torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(bench_gpu.torch.cuda, "memory_reserved", lambda device: 0)
    cuda = torch.device("cuda")
    with bench_gpu.polled_device_memory(cuda, idle=gib // 2) as polled:
        assert state["others"] == gib // 2  # waited for the worker to go
        state["others"] = 9 * gib  # this job's worker
        seen = state["reads"]
        deadline = time.monotonic() + 10
        while state["reads"] < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert polled["peak"] == 9 * gib - gib // 2


def test_a_failed_row_is_named_and_a_row_past_the_budget_skipped_while_the_rest_go_on(
    tmp_path, capsys
):
    """What a run on a leased GPU relies on: a row that fails costs only itself, a switch row
    that would end past --budget-seconds is skipped and named, and each row measured is kept."""
    import argparse

    rows = tmp_path / "rows.jsonl"
    bench = bench_gpu.Bench(
        argparse.Namespace(budget_seconds=100.0, rows_jsonl=rows), torch.device("cpu")
    )

    def broken():
        raise RuntimeError("flex attention is not here\nand more")

    assert not bench.attempt("stage 1 (hf) big", broken)
    row = bench_gpu.Row("body", "small", 10.0, 1.0, None, None)
    assert bench.attempt("stage 1 (hf) small", lambda: bench.add(row))
    bench.started -= 90  # 90 s into the run
    assert not bench.attempt("stage 1 +space", lambda: pytest.fail("ran past the budget"), 20.0)
    assert bench.attempt("stage 1 +topk 32", lambda: None, predicted=5.0)
    out = capsys.readouterr().out
    assert "stage 1 (hf) big: FAILED (RuntimeError: flex attention is not here)" in out
    assert "stage 1 +space: skipped" in out
    assert (bench.failed, bench.skipped) == (["stage 1 (hf) big"], ["stage 1 +space"])
    assert [json.loads(line) for line in rows.read_text().splitlines()] == [
        {"what": "body", "model": "small", "tokens_per_second": 10.0, "ratio": 1.0, "mfu": None,
         "peak_bytes": None, "device": "cpu"}
    ]  # fmt: skip


def test_every_stage2_row_is_under_the_budget_and_what_it_skips_is_named(monkeypatch, capsys):
    """`none` and `token` were never skipped by --budget-seconds, so a call's budget could be
    spent before its first stage-2 row printed. Each stage-2 row is now predicted to take what
    its baseline took (`none`: not known, run while the budget lasts), and any row is skipped
    once the budget is spent. Rows stood in for, on a clock that only they advance: 40 s each."""
    import argparse

    clock, ran = {"now": 0.0}, []
    monkeypatch.setattr(bench_gpu.time, "perf_counter", lambda: clock["now"])

    class Rows(bench_gpu.Stage2):
        def run(self, label, options, baseline):
            ran.append(label)
            clock["now"] += 40.0
            self.seconds[label], self.rates[label] = 40.0, 1.0

        def floor(self):
            self.run("floor", (), "token")

    def rows(budget: float, started: float = 0.0) -> list[str]:
        args = argparse.Namespace(budget_seconds=budget, rows_jsonl=None)
        clock["now"] = 0.0
        bench = bench_gpu.Bench(args, torch.device("cpu"))
        clock["now"] = started  # seconds into the run
        ran.clear()
        stage2 = Rows(bench, Path("cache"), Path("scratch"))
        if bench_gpu.stage2_arms_and_floor(bench, stage2):
            bench_gpu.stage2_rows(bench, stage2, bench_gpu.STAGE2_RUNS[2:])
        return bench.skipped

    switches = [f"stage 2 {label}" for label, *_ in bench_gpu.STAGE2_RUNS[2:]]
    assert rows(100.0) == ["stage 2 floor", *switches] and ran == ["none", "token"]
    said = capsys.readouterr().out
    assert "stage 2 floor: skipped, 80 s + about 40 s would pass --budget-seconds 100" in said
    assert rows(70.0) == ["stage 2 token"] and ran == ["none"]  # 40 + 40 > 70: no floor either
    assert rows(30.0, started=30.0) == ["stage 2 none", "stage 2 token"] and ran == []
    assert "stage 2 none: skipped, 30 s in, --budget-seconds 30 is spent" in capsys.readouterr().out
    assert rows(0.0) == [] and ran == ["none", "token", "floor", *[s[8:] for s in switches]]


@pytest.mark.slow  # 7 stage-2 runs: about 25 s on 2 cores
def test_stage2_only_runs_every_stage2_row_at_tiny_shapes_each_compiled_afresh(
    monkeypatch, capsys
):
    """--stage2-only (no Ray, no teacher): every stage-2 row, each after torch._dynamo.reset()
    (a row's graphs and recompile limit are its own), each run asking for no checkpoint and no
    final/ and leaving none, each row's phases and graph count printed; on a CPU `auto` is every
    switch row's plain value, so each trains exactly what `token` does."""
    import stage2_train.train

    resets, trained, train = [], [], stage2_train.train.main
    reset = torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(len(trained)) or reset())

    def train_and_look(args):
        code = train(args)
        out = Path(args[args.index("--out") + 1])
        trained.append((args, (out / "final").exists(), list(out.glob("checkpoints/step-*"))))
        return code

    monkeypatch.setattr(stage2_train.train, "main", train_and_look)
    command = ["--stage2-only", "--shapes", "tiny", "--docs", "16", "--steps", "3"]
    assert bench_gpu.main(command) == 0
    out = capsys.readouterr().out
    labels = [label for label, *_ in bench_gpu.STAGE2_RUNS]
    for what in [*labels, "floor"]:
        assert re.search(rf"^stage 2 {what} +llama-tiny ", out, re.M), out
    for label in labels:
        phases = rf"^stage 2 {label}: [.\d]+ s: [.\d]+ s before and after the steps, first step "
        phases += r"[.\d]+ s, the other 2 [.\d]+ s; 0 graphs compiled, recompile limit hit 0 times$"
        assert re.search(phases, out, re.M), out
    for label in labels[2:]:
        assert f"stage 2 {label} vs token: max |loss difference| 0.00e+00 over 3 steps" in out
    assert "stage 2 token / the floor: " in out and not re.search(r"^stage 1", out, re.M)
    assert resets == [0, 1, 2, 2, 3, 4, 5]  # before each run, and the floor's after `token`
    assert len(trained) == len(labels)
    for args, final, checkpoints in trained:
        assert "--no-save-at-end" in args and not final and not checkpoints


def write_job_records(out: Path, units: dict) -> None:
    """A stage-1 job's records as stage1_runs reads them: its units, and 10,000 teacher tokens."""
    (out / "stage1-run.json").write_text(json.dumps({"units": units}))
    (out / "manifest.json").write_text(json.dumps({"totals": {"teacher_tokens": 10_000}}))


def test_phase_summary_sums_each_phase_over_units_and_the_share_and_rate_of_scoring(tmp_path):
    """And `stage 1 steady`'s rate: the tokens over [the first unit's scoring, the last one's
    read-back], without the first tokenizing and the last writing, one worker's clock; those
    edges are the summary's last figures."""
    from stage1_runs import phase_summary, steady_rate

    units = {  # unit 1 tokenized while unit 0 scored
        "0": {"worker": 0, "phases": {"tokenize": [10, 11], "score": [11, 13],
                                      "collect": [13, 13.5], "write": [13.5, 14]}},
        "1": {"worker": 0, "phases": {"tokenize": [11, 12], "score": [13, 15],
                                      "collect": [15, 15.5], "write": [15.5, 16]}},
    }  # fmt: skip
    write_job_records(tmp_path, units)
    assert phase_summary(tmp_path) == (
        "2 units in 6.00 s: tokenize 2.00 s, score 4.00 s, collect 1.00 s, write 1.00 s; scoring "
        "67% of it, at 2,500 tok/s; edges: the first scoring 1.00 s after the start, the last "
        "write ending 0.50 s after the last read-back"
    )
    assert steady_rate(tmp_path) == pytest.approx(10_000 / (15.5 - 11))
    units["1"]["worker"] = 1  # another worker's clock
    write_job_records(tmp_path, units)
    with pytest.raises(ValueError, match="one worker"):
        steady_rate(tmp_path)


def test_device_summary_shares_the_units_device_time_and_rates_the_batches(tmp_path):
    """Where the job's device time went, from its units' `device` records: in batches (and the
    tokens per second there, beside the floors), idle between batches and at units' edges,
    without the first unit's wait for work; a vLLM job's units have none."""
    from stage1_runs import device_summary

    units = {
        "0": {"device": {"batches": 3, "in_batches_s": 1.5, "between_batches_s": 0.1,
                         "before_first_s": None}},
        "1": {"device": {"batches": 2, "in_batches_s": 1.0, "between_batches_s": 0.2,
                         "before_first_s": 0.2}},
    }  # fmt: skip
    write_job_records(tmp_path, units)
    assert device_summary(tmp_path) == (
        "device: 5 batches, 83.3% of 3.00 s in them (at 4,000 tok/s), 10.0% idle between "
        "batches, 6.7% idle at 1 edge between units"
    )
    units["1"]["device"] = None
    write_job_records(tmp_path, units)
    assert device_summary(tmp_path).startswith("device: not timed")


def test_the_head_bench_times_every_head_pass_against_the_fused_loss(capsys):
    """bench_stage1_head.py at tiny shapes (eager, as a CPU scores): a row per head pass, each a
    ratio to the fused loss, the pass stage 1 runs on a GPU; the Triton kernels' rows, which need
    CUDA (or Triton's interpreter), are named as not measured."""
    import bench_stage1_head

    assert bench_stage1_head.main(["--shape", "tiny", "--repeats", "1"]) == 0
    rows, said = {}, capsys.readouterr().out
    for line in said.splitlines():
        *label, ms, ratio = line.split() or [""]
        kernels = ("head", "fused", "plain", "onepass")
        if label and label[0] in kernels and ms[0].isdigit():
            rows[" ".join(label)] = (float(ms), float(ratio))
    sides = {label for label, *_ in bench_stage1_head.SIDES}
    if not bench_gpu.triton_runs(torch.device("cpu")):
        unmeasured = {label for label in sides if label.startswith("onepass")}
        message = ": not measured: --head-kernel onepass: "
        assert len(unmeasured) > 1 and all(label + message in said for label in unmeasured)
        sides -= unmeasured
    assert set(rows) == {"head matmul", "plain sampled 32"} | sides
    assert rows["fused loss"][1] == 1.0
    assert all(ms > 0 and ratio > 0 for ms, ratio in rows.values())


@pytest.mark.slow  # a benchmark's extra rows; test_stage1_packing.py compiles the fused pass
def test_where_the_fused_pass_compiles_the_head_bench_adds_the_earlier_forms(monkeypatch, capsys):
    """On CUDA the head bench also times runs 7-8's one-read form of the fused loss, runs 3-6's
    one-stage top 32 and runs 7-8's top 32 with ties unranked, compiled as the scorer compiles
    `fused`: that path runs here too (compiled on the CPU), so that the next GPU run does not
    meet it first."""
    import bench_stage1_head

    monkeypatch.setattr(bench_stage1_head, "compiles_on", lambda device: True)
    assert bench_stage1_head.main(["--shape", "tiny", "--repeats", "1"]) == 0
    said = capsys.readouterr().out
    for label in (
        "fused loss, one-read form",
        "fused +topk 32, one-stage top-k",
        "fused +topk 32, ties unranked",
    ):
        row = re.search(rf"^{re.escape(label)} +([\d.]+) +([\d.]+)$", said, re.M)
        assert row and float(row[1]) > 0 and float(row[2]) > 0, said


def test_a_head_pass_that_fails_costs_the_head_bench_its_row_not_the_table(monkeypatch, capsys):
    """A kernel's first compile on a GPU happens inside the head bench: one that fails there is
    named in a line, and every other row is still measured and printed (planted: the plain
    kernel's pass raises as a compiler would)."""
    import bench_stage1_head

    class FailingPlain(bench_stage1_head.HeadColumns):
        def of_batch(self, *args, **kwargs):
            if self.kernel == "plain":
                raise RuntimeError("a planted compile error")
            return super().of_batch(*args, **kwargs)

    monkeypatch.setattr(bench_stage1_head, "HeadColumns", FailingPlain)
    assert bench_stage1_head.main(["--shape", "tiny", "--repeats", "1"]) == 0
    said = capsys.readouterr().out
    assert "plain loss: not measured (RuntimeError: a planted compile error)" in said
    table = said[said.index("ms/batch") :]
    assert "plain loss" not in table and re.search(r"^fused \+space +[\d.]+ +[\d.]+$", table, re.M)


def test_the_head_bench_one_stage_topk_is_the_fused_heads_top_32():
    """`fused +topk 32, one-stage top-k` (torch.topk of the whole row) selects the values the
    fused head's top 32 by blocks does, on a vocabulary large enough for blocks, so its row differs
    from `fused +topk 32` by the selection alone."""
    import bench_stage1_head

    from pipeline.scoring.head_kernels import fused_columns

    logits, targets, _ = head_pass_inputs(8, 151_936)
    columns, (values, ids) = bench_stage1_head.one_stage_topk(logits, targets)
    fused = fused_columns(logits, targets, 32, None)
    assert torch.equal(columns["loss"], fused["loss"])
    assert torch.equal(logits.gather(1, fused["topk_ids"]), values)


def test_the_head_bench_one_read_form_is_the_fused_loss():
    """`fused loss, one-read form` (runs 7-8's form of the fused loss, which Inductor reads once
    for the max and Z) computes the fused loss's values, so its row differs from `fused loss` by
    the form alone."""
    import bench_stage1_head

    from pipeline.scoring.head_kernels import fused_columns

    logits, targets, _ = head_pass_inputs()
    torch.testing.assert_close(
        bench_stage1_head.one_read_form_loss(logits, targets),
        fused_columns(logits, targets, 0, None)["loss"],
        rtol=0, atol=0,
    )  # fmt: skip


def test_switches_named_run_in_the_order_named(monkeypatch, capsys):
    """A device call names the row it must have first (run 16's `+space` before `again`), since
    --budget-seconds skips the rows past it, and a row named twice is measured twice (`+space`
    each side of `again`); before, the named rows ran once each in the usual order. The jobs
    themselves are stood in for: this is the order, not the measuring."""
    import ray

    ran = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(
        bench_gpu, "teacher_job", lambda bench, scratch, corpus, name, dtype:
        bench_gpu.Teacher(name, scratch, scratch / "cache", [], seconds=1.0),
    )  # fmt: skip
    monkeypatch.setattr(bench_gpu, "stage1_and_floors", lambda bench, teacher, dtype: None)
    monkeypatch.setattr(bench_gpu, "stage1_variant", lambda bench, t, label, o: ran.append(label))
    command = ["--shapes", "tiny", "--docs", "16", "--stage1-only",
               "--teachers", "qwen2.5-1.5b-like", "--switches"]  # fmt: skip
    # (+topk 32 is no priority row: unnamed, it would run after the others, and after stage 2)
    orders = (["+space", "again"], ["again", "+space"], ["+topk 32", "+space"],
              ["+space", "again", "+space"], [])  # fmt: skip
    for named in orders:
        ran.clear()
        assert bench_gpu.main([*command, *named]) == 0
        assert ran == named
    capsys.readouterr()
