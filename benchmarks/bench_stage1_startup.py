"""Where a tiny stage-1 run's wall time goes: `python stage1_score/run.py` on a few documents, as a
user starts it, with each line of its log stamped on arrival, split into phases at the lines that
open them. Run twice side by side: starting a local Ray instance of its own, and joining one that
is already running (`ray start --head` once, then every run joins it).

    python benchmarks/bench_stage1_startup.py [--docs 4] [--repeats 2] [--teacher FOLDER]

The phases, each ending where the next one's line appears:
  imports and plan   interpreter start, imports, tokenizer, teacher config, corpus size
  output and Ray     the output folder taken, then Ray started or joined (`ray.init`)
  workers            actors started, each loading the teacher
  scoring            the units, up to the final progress line
  wrap-up            teachers closed, Ray shut down or left, run record and manifest written
  exit               the interpreter's own exit
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.stage1_runs import prepared_teacher, write_corpus_slice  # noqa: E402
from benchmarks.timing import print_header, print_load_average  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# (phase, the log text that opens the next phase); the last phase ends at the process's exit.
PHASES = (
    ("imports and plan", "[stage1] teacher "),
    ("output and Ray", "[stage1] starting "),
    ("workers", "[stage1] workers on nodes"),
    ("scoring", "finished in "),
    ("wrap-up", "[stage1] wrote "),
    ("exit", None),
)


def stamped_run(command: list[str]) -> list[tuple[float, str]]:
    """(seconds since launch, line) for each line the run writes, and the exit as a last line."""
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "stage1_score" / "run.py"), *command],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines = [(time.perf_counter() - started, line) for line in process.stderr]
    if process.wait() != 0:
        sys.exit("".join(line for _, line in lines[-20:]))
    return [*lines, (time.perf_counter() - started, "exit")]


def phase_seconds(lines: list[tuple[float, str]]) -> list[float]:
    """Each phase's seconds: from the line that opened it to the one that opens the next."""
    ends = []
    for _, opening_next in PHASES:
        if opening_next is None:
            ends.append(lines[-1][0])
        else:
            ends.append(next(t for t, line in lines if opening_next in line))
    return [end - begin for begin, end in zip([0.0, *ends], ends, strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", help="teacher folder (default: the prepared SmolLM2)")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternated")
    args = parser.parse_args()
    teacher = prepared_teacher(args.teacher)
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus_slice(Path(tmp), args.docs)
        common = ["--teacher", teacher, "--corpus", str(corpus), "--id-column", "id",
                  "--docs-per-shard", "1", "--num-workers", "1", "--progress-seconds", "1"]  # fmt: skip
        runs: dict[str, list[list[float]]] = {"own Ray": [], "joins a running Ray": []}
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
        address = ray.get_runtime_context().gcs_address
        try:
            for repeat in range(args.repeats):
                for kind, extra in (("own Ray", ["--ray-address", "local"]),
                                    ("joins a running Ray", ["--ray-address", address])):  # fmt: skip
                    out = ["--out", str(Path(tmp) / f"cache-{kind[0]}-{repeat}")]
                    runs[kind].append(phase_seconds(stamped_run([*common, *out, *extra])))
        finally:
            ray.shutdown()
    print(f"stage 1 on {args.docs} documents, 1 worker; median of {args.repeats} runs each")
    print_header(f"{'phase':<18}" + "".join(f"{kind:>22}" for kind in runs))
    for at, (phase, _) in enumerate(PHASES):
        cells = [statistics.median(r[at] for r in runs[kind]) for kind in runs]
        print(f"{phase:<18}" + "".join(f"{cell:>21.1f}s" for cell in cells))
    totals = [statistics.median(sum(r) for r in runs[kind]) for kind in runs]
    print(f"{'total':<18}" + "".join(f"{cell:>21.1f}s" for cell in totals))
    print_load_average()


if __name__ == "__main__":
    main()
