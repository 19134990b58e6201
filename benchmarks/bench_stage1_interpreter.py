"""How long a thread that launches kernels waits beside a stage-1 worker's host work, under
`--interpreter default` (Python's 5 ms lock hand-over) and `tuned` (pipeline/interpreter.py).

Usage: python benchmarks/bench_stage1_interpreter.py [--docs N] [--seconds S] [--repeats R]

Under `--unit-overlap on` a worker scores one unit while another thread tokenizes the next and
builds, writes and hashes the last one's shard (stage1_score/worker.py). Every kernel launch
releases the interpreter's lock and takes it back; this measures what that costs a launching
thread, on any machine's CPU, with no GPU. The launching thread here issues small torch operators
(each releases the lock, as a Triton launch or a cuBLAS call does) as fast as it can, and counts
them: alone, then beside a thread running the worker's own tokenizing (`encode_batch`) and
writing (`write_unit`) of units of `--docs` shipped documents back to back, under each setting.
The process imports what a worker holds (torch, transformers, Ray, Arrow). Rounds alternate the
settings; each figure is the median over rounds.

What it prints is the launching thread's rate beside the host work as a share of its rate alone,
the share of its time spent in waits of over 1 ms between two launches, its longest wait, and the
host work's own rate. It says how much of the host's launching capacity the worker's other
threads take, not what a GPU job gains: a launching thread that keeps ahead of its device loses
nothing, and `bench_gpu.py`'s `stage 1 tuned interpreter` row measures the job.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import ray  # noqa: E402, F401  (a worker's heap holds it)
import torch  # noqa: E402
import transformers  # noqa: E402

from pipeline.corpus import Corpus, CorpusOptions  # noqa: E402
from pipeline.interpreter import tune_interpreter  # noqa: E402
from pipeline.shipped import shipped_corpus  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage1_score.units import plan_units  # noqa: E402
from stage1_score.worker import WorkerSpec, write_unit  # noqa: E402

PYTHON_SWITCH_INTERVAL_S = sys.getswitchinterval()
LONG_WAIT_S = 1e-3


class Launcher(threading.Thread):
    """Issues small torch operators while entered (from full rate: it starts first); records
    when each returned, and the window entered."""

    def __init__(self):
        super().__init__(daemon=True)
        self.stop, self.times = threading.Event(), []

    def __enter__(self) -> Launcher:
        self.start()
        time.sleep(0.2)
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.ended = time.perf_counter()
        self.stop.set()
        self.join()

    def run(self) -> None:
        value, times = torch.ones(4), self.times
        while not self.stop.is_set():
            value = torch.add(value, 1)
            times.append(time.perf_counter())

    def launches(self) -> tuple[float, float, float]:
        """Within the window entered: (launches a second, the share of the time in waits over
        1 ms between two launches, the longest wait in ms)."""
        times = np.array(self.times)
        times = times[(times >= self.began) & (times <= self.ended)]
        waits = np.diff(times)
        wall = self.ended - self.began
        long_waits = float(waits[waits > LONG_WAIT_S].sum())
        return times.size / wall, long_waits / wall, 1e3 * float(waits.max(initial=0.0))


def host_work(units, tokenizer, spec: WorkerSpec, seconds: float) -> tuple[float, ...]:
    """The worker's host work on `units`, back to back for `seconds`, beside a launching thread:
    the launching thread's figures (Launcher.launches), then units a second."""
    done = 0
    with Launcher() as launcher:
        for unit in itertools.cycle(units):
            encodings = tokenizer.encode_batch(unit.texts)
            losses = [np.linspace(0, 10, len(e), dtype=np.float32) for e in encodings]
            write_unit(spec, unit, encodings, losses, {})
            done += 1
            if time.perf_counter() - launcher.began >= seconds:
                break
    return (*launcher.launches(), done / (launcher.ended - launcher.began))


def alone(seconds: float) -> float:
    with Launcher() as launcher:
        time.sleep(seconds)
    return launcher.launches()[0]


def set_interpreter(mode: str) -> None:
    """`mode` on this process, undoing the other first (a worker applies one, once)."""
    sys.setswitchinterval(PYTHON_SWITCH_INTERVAL_S)
    tune_interpreter(mode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--docs", type=int, default=1000, help="documents a unit (--docs-per-shard)"
    )
    parser.add_argument("--units", type=int, default=4, help="distinct units cycled through")
    parser.add_argument("--tokenizer", default="qwen2.5", help="the teacher's tokenizer")
    parser.add_argument("--seconds", type=float, default=3.0, help="host work per side and round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the two settings")
    args = parser.parse_args(argv)
    transformers.LlamaForCausalLM  # noqa: B018  (the model classes a worker has imported)
    torch.set_num_threads(1)
    documents = itertools.islice(
        Corpus(shipped_corpus("train"), CorpusOptions(id_column="id")), args.docs * args.units
    )
    units = list(plan_units(documents, args.docs))
    tokenizer = load_tokenizer(args.tokenizer)
    print(f"units of {args.docs} documents ({args.tokenizer} tokenizer), {args.repeats} rounds of "
          f"{args.seconds:g} s per setting, {os.cpu_count()} CPUs")  # fmt: skip
    rows: dict[str, list[tuple[float, ...]]] = {"default": [], "tuned": []}
    rates = []
    with tempfile.TemporaryDirectory() as out:
        spec = WorkerSpec(
            teacher=None, tokenizer=args.tokenizer, backend="hf", dtype="float32",
            max_length=2048, stride=1024, batch_tokens=16384, loss_dtype="float16", out=Path(out),
            run_fingerprint="bench", threads=1, progress_seconds=1e9,
        )  # fmt: skip
        for _ in range(args.repeats):
            set_interpreter("default")
            rates.append(alone(args.seconds / 2))
            for mode in rows:
                set_interpreter(mode)
                rows[mode].append(host_work(units, tokenizer, spec, args.seconds))
    set_interpreter("default")
    base = statistics.median(rates)
    print(f"launching thread alone: {base:,.0f} launches/s (median of {len(rates)})")
    print(f"{'--interpreter':14s} {'launches/s beside':>18s} {'share of alone':>15s} "
          f"{'time in waits > 1 ms':>21s} {'longest wait':>13s} {'units/s':>8s}")  # fmt: skip
    shares = {}
    for mode, measured in rows.items():
        rate, waiting, wait, done = (statistics.median(c) for c in zip(*measured, strict=True))
        shares[mode] = rate / base
        print(f"{mode:14s} {rate:18,.0f} {shares[mode]:15.3f} {waiting:21.3f} {wait:10.1f} ms "
              f"{done:8.2f}")  # fmt: skip
    print(
        f"tuned / default, launches beside the host work: {shares['tuned'] / shares['default']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
