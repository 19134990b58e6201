"""benchmarks/trace_gaps.py: a trace's device gaps, each put down to what the launching host
thread was doing, on a planted trace whose every gap has a known cause; a CPU trace from the
product's own tracer; bad input in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import trace_gaps  # noqa: E402

HOST, LAUNCHER, OTHER, DEVICE = 100, 1, 2, 0


def work(name, start, end, correlation, stream=7, cat="kernel"):
    args = {"stream": stream, "device": DEVICE}
    if correlation is not None:
        args["correlation"] = correlation
    return {"ph": "X", "cat": cat, "name": name, "pid": DEVICE, "tid": stream,
            "ts": start, "dur": end - start, "args": args}  # fmt: skip


def host(name, start, end, cat="cpu_op", tid=LAUNCHER, correlation=None):
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "pid": HOST, "tid": tid,
            "ts": start, "dur": end - start, "args": args}  # fmt: skip


def launch(correlation, start, end=None, name="cudaLaunchKernel", cat="cuda_runtime"):
    return host(name, start, start + 1 if end is None else end, cat, correlation=correlation)


def planted_trace() -> dict:
    """Device work from 1,000 to 1,700 us with a gap of 40-50 us for each cause (and one of 5 us,
    under the 10 us counted), work on two streams overlapping, and what the profiler also writes
    (metadata, flows, a device-side annotation) that is not work."""
    events = [
        {"ph": "M", "name": "process_name", "pid": DEVICE, "args": {"name": "GPU 0"}},
        {"ph": "s", "cat": "ac2g", "id": 2, "pid": HOST, "tid": LAUNCHER, "ts": 1148},
        work("gpu annotation", 1000, 1700, None, cat="gpu_user_annotation"),
        # the first kernel, queued long before
        work("k1", 1000, 1100, 1), launch(1, 900),
        # 1100-1150: the launching thread waits in a synchronize from 1095 to 1147
        host("cudaStreamSynchronize", 1095, 1147, cat="cuda_runtime"),
        work("k2", 1150, 1200, 2), launch(2, 1148),
        # another stream's kernel overlaps k2: the device is busy 1150-1260
        work("k3", 1190, 1260, 3, stream=8), launch(3, 1010),
        # 1260-1300: computing an operator (the innermost of two covering the wait)
        host("aten::outer", 1255, 1299.5), host("aten::inner", 1262, 1298),
        work("k4", 1300, 1350, 4), launch(4, 1299),
        # 1350-1400: nothing recorded on the launching thread (another thread's op is no cause)
        host("aten::elsewhere", 1340, 1410, tid=OTHER),
        work("k5", 1400, 1420, 5), launch(5, 1398),
        # 1420-1470: a copy whose own call blocked across the gap (from pageable memory)
        work("copy", 1470, 1480, 6, cat="gpu_memcpy"),
        launch(6, 1380, 1469, name="cudaMemcpyAsync"),
        # 1480-1530: queued long before: the work waited on the device
        work("k7", 1530, 1540, 7), launch(7, 1100),
        # 1540-1545: under the shortest gap counted
        work("k8", 1545, 1600, 8), launch(8, 1544),
        # 1600-1640: work whose launch is not in the trace
        work("memset", 1640, 1700, 9, cat="gpu_memset"),
    ]
    return {"traceEvents": events}


def test_every_planted_gap_is_found_and_put_down_to_its_cause():
    gaps = trace_gaps.device_gaps(planted_trace(), min_gap_ms=0.01)
    assert [(g.start, g.end, g.cause) for g in gaps.gaps] == [
        (1100, 1150, "cudaStreamSynchronize"),
        (1260, 1300, "aten::inner"),
        (1350, 1400, trace_gaps.UNTRACED),
        (1420, 1470, "cudaMemcpyAsync"),
        (1480, 1530, trace_gaps.QUEUED),
        (1600, 1640, trace_gaps.UNLAUNCHED),
    ]
    assert (gaps.start, gaps.span) == (1000, 700)
    # busy: 700 less the six gaps (280) and the short one (5)
    assert gaps.busy == 415
    line = trace_gaps.summary(gaps, causes=2)
    assert line.startswith("device busy 59.3% of 0.7 ms; 6 gaps, 0.3 ms: ")
    assert "cudaStreamSynchronize 1 (0.1 ms, longest 0.05)" in line
    assert line.endswith("4 other causes")


def test_a_gap_under_the_shortest_counted_is_busy_time_lost_but_not_listed():
    gaps = trace_gaps.device_gaps(planted_trace(), min_gap_ms=0.05)  # 50 us: counted
    assert [g.start for g in gaps.gaps] == [1100, 1350, 1420, 1480]
    assert gaps.busy == 415


def test_a_cpu_trace_from_the_products_tracer_has_no_device_work(tmp_path):
    from pipeline.profiling import traced

    with traced(True) as trace:
        torch.ones(64, 64).matmul(torch.ones(64, 64)).sum()
    path = tmp_path / "cpu.json"
    path.write_bytes(trace.data)
    assert trace_gaps.timed_events(json.loads(trace.data))  # host ops are there
    assert trace_gaps.describe_trace(path) == "no device work in the trace (traced on a CPU?)"


def test_the_command_lists_the_longest_gaps_and_refuses_what_is_not_a_trace(tmp_path, capsys):
    path = tmp_path / "unit.json"
    path.write_text(json.dumps(planted_trace()))
    assert trace_gaps.main([str(path), "--min-gap-ms", "0.01", "--longest", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("unit.json: device busy 59.3%")
    assert out[1:] == [
        "  at 0.10 ms: 0.05 ms, cudaStreamSynchronize",
        "  at 0.35 ms: 0.05 ms, " + trace_gaps.UNTRACED,
    ]
    for bad, text in (("list.json", "[]"), ("broken.json", "{")):
        (tmp_path / bad).write_text(text)
        assert trace_gaps.main([str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"trace_gaps: {tmp_path / bad}: "), err
    assert trace_gaps.main([str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("covered", [0.6, 0.4])
def test_a_call_is_named_only_where_it_covers_half_the_hosts_lateness(covered):
    trace = {"traceEvents": [
        work("k1", 0, 100, 1), launch(1, -50),
        host("cudaMalloc", 100, 100 + covered * 100, cat="cuda_runtime"),
        work("k2", 200, 300, 2), launch(2, 199),
    ]}  # fmt: skip
    (gap,) = trace_gaps.device_gaps(trace, min_gap_ms=0.01).gaps
    assert gap.cause == ("cudaMalloc" if covered > 0.5 else trace_gaps.UNTRACED)


def test_events_without_names_or_arguments_are_read_not_refused():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "pid": DEVICE, "tid": 7, "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "pid": DEVICE, "tid": 7, "ts": 50, "dur": 10, "args": None},
        {"ph": "X", "cat": "cuda_runtime", "pid": HOST, "tid": LAUNCHER, "ts": 5, "dur": 1},
    ]}  # fmt: skip
    (gap,) = trace_gaps.device_gaps(trace, min_gap_ms=0.01).gaps
    assert (gap.start, gap.end, gap.cause) == (10, 50, trace_gaps.UNLAUNCHED)
