"""Run 11's probe (H200): does `--head-kernel onepass`'s row kernel compile again mid-job?

In a fresh Triton cache, the row kernel launched as `logit_row_sums` launches it, on bf16 logits of
a 151,936 vocabulary, for row counts in the order a warm-up and then a unit meet them; per call,
its wall time (synchronized) and how many compiled variants the kernel then holds. Once with the
kernel as the tree defines it, once with a plain `triton.jit` of the same function (every argument
specialized, as before run 11's change). Not a benchmark of the product: a one-off probe, kept with
its log for what it decided.

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/results/2026-11-27-h200/row_kernel_variants.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import triton  # noqa: E402

from pipeline.scoring import triton_head  # noqa: E402

VOCAB = 151_936
# the probe's and a packed warm-up's row counts, then a unit's remainders
ROWS = (67, 64, 1, 8192, 2048, 16_370, 16_371, 16_372, 16_373, 16_369)


def probe(kernel, label: str) -> None:
    triton_head._row_sums = kernel
    device = torch.device("cuda")
    logits = torch.randn(max(ROWS), VOCAB, device=device, dtype=torch.bfloat16)
    space = (torch.rand(VOCAB, device=device) < 0.3).to(torch.int8)
    for rows in ROWS:
        targets = torch.randint(0, VOCAB, (rows,), device=device)
        torch.cuda.synchronize()
        started = time.perf_counter()
        triton_head.logit_row_sums(logits[:rows].clone(), targets, space)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        variants = len(kernel.device_caches[torch.cuda.current_device()][0])
        print(f"{label:<22} rows {rows:>6} ({rows % 4} mod 4): {seconds * 1e3:8.1f} ms, "
              f"{variants} compiled variant(s)", flush=True)  # fmt: skip


def main() -> int:
    tree = triton_head._row_sums
    probe(triton.jit(tree.fn), "all specialized")
    probe(tree, "the tree's kernel")
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
