"""What stage 1's head costs per batch, column by column: the head matmul alone, and the matmul
with each `--head-kernel`'s columns, on one batch of scored positions, as the scorer computes them
(pipeline.scoring.head.HeadColumns in chunks of `head_chunk_rows`, compiled where a GPU compiles).

    python benchmarks/bench_stage1_head.py [--shape 1.5b|7b|tiny] [--rows N] [--repeats R]

Each row: milliseconds per batch (the best of --repeats synchronized passes after one warm-up) and
its ratio to the `fused loss` row. `+space` is `--space-logprob`'s column (a mask of a random 40% of
the vocabulary: its sum's cost does not depend on which ids), `+topk 32` the distillations' column,
`plain sampled 32` `--topk-mode sampled`'s 32 draws from each row's softmax with their ranks.
`onepass ...` rows (where Triton runs: CUDA) are `--head-kernel onepass`, `auto`'s choice there,
fused's logits reduced by a kernel that reads each once (the space mask's sum in the same read);
`fused loss, one-read form` (where the fused pass compiles: CUDA) is the fused loss as runs 7 and 8
measured it, which Inductor compiles to one read of each row for the max and Z, slower there than
today's form (docs/stage1-gpu-path.md: "One read of the logits"), and `fused +topk 32, one-stage
top-k` the top 32 as runs 3-6 took it, torch.topk of the whole row, where today's head takes it by
blocks, and `fused +topk 32, ties unranked` by blocks as runs 7 and 8 took it, before equal logits
were ranked by the lower id (so that the rule's cost is its difference from `fused +topk 32`);
`onepass loss, natural exp` and `onepass +space, natural exp` are onepass with the
exponentials runs 7-15 measured (natural, where today's are in base 2), so that the change's worth
is their difference from `onepass loss` and `onepass +space`. bench_gpu.py's `body + ... head` and `scorer` rows hold these heads
inside the whole batch; this script says which column costs what inside it. Random hidden states and
weights of the teacher's shape: shapes, not values, set the speed. `--shape tiny` (the default
without CUDA) runs in seconds on a CPU, eagerly, as a CPU scorer does.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from device_timing import best_seconds  # noqa: E402

from pipeline.choices import compiles_on  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.scoring.device import free_memory  # noqa: E402
from pipeline.scoring.head import HeadColumns, HeadExtras, head_chunk_rows  # noqa: E402
from pipeline.scoring.head_kernels import (  # noqa: E402
    compile_head_pass,
    fused_columns,
    onepass_columns,
    top_logits,
)

# (hidden size, vocabulary, scored positions per batch): Qwen2.5-1.5B and -7B, one batch of
# bench_gpu.py's 16,384 tokens; tiny for a CPU.
# vocab32k: a tiny hidden size and TinyLlama's vocabulary, where the columns (not the matmul) cost.
SHAPES = {"1.5b": (1536, 151936, 16384), "7b": (3584, 152064, 16384), "tiny": (64, 1000, 256),
          "vocab32k": (64, 32000, 512)}  # fmt: skip
SIDES = (  # label, --head-kernel, top-k, with the space column
    ("fused loss", "fused", 0, False),
    ("fused +space", "fused", 0, True),
    ("fused +topk 32", "fused", 32, False),
    ("plain loss", "plain", 0, False),
    ("plain +space", "plain", 0, True),
    ("plain +topk 32", "plain", 32, False),
    ("onepass loss", "onepass", 0, False),
    ("onepass +space", "onepass", 0, True),
    ("onepass +topk 32", "onepass", 32, False),
)


def one_read_form_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fused_columns's loss as runs 7 and 8 measured it: the max and Z of one fp32 view of the
    logits, the form Inductor's one-pass rewrite (`prepare_softmax_online`) matches (compiled, one
    read of each row for both, two exponentials a logit); the same values as today's form."""
    x = logits.float()
    shifted = x - x.amax(dim=-1, keepdim=True)
    log_sum = shifted.exp().sum(dim=-1, keepdim=True).log().squeeze(-1)
    return log_sum - shifted.gather(-1, targets[:, None]).squeeze(-1)


def one_stage_topk(logits: torch.Tensor, targets: torch.Tensor):
    """fused_columns's loss, and its top 32 as runs 3-6 took it: torch.topk of the whole row (the
    fused head now takes it by blocks: head_kernels.top_logits); the same values."""
    return fused_columns(logits, targets, 0, None), torch.topk(logits, 32, dim=-1, sorted=True)


def unranked_topk(logits: torch.Tensor, targets: torch.Tensor):
    """fused_columns's loss, and its top 32 by blocks before the tie rule (runs 7 and 8): each
    stage torch.topk's picks among equal values, where today's ranks them by the lower id
    (head_kernels.ranked_topk); the same values, the ids but where logits tie."""
    topk = functools.partial(torch.topk, dim=-1, sorted=True)
    return fused_columns(logits, targets, 0, None), top_logits(logits, 32, rank=topk)


# rows of the fused head in earlier forms, beside today's, where the fused pass compiles (CUDA)
EARLIER_FORMS = (
    ("fused loss, one-read form", one_read_form_loss),
    ("fused +topk 32, one-stage top-k", one_stage_topk),
    ("fused +topk 32, ties unranked", unranked_topk),
)

# onepass's row kernel with its exponentials as runs 7-15 measured them (natural, six instructions
# a logit where today's base 2 takes two: triton_head.LOG2_E), beside today's, where Triton runs
NATURAL_EXP_ROWS = (("onepass loss, natural exp", False), ("onepass +space, natural exp", True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), help="default: 1.5b with CUDA, else tiny")
    parser.add_argument(
        "--rows", type=int, help="scored positions per batch (default: the shape's)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = args.shape or ("1.5b" if device.type == "cuda" else "tiny")
    width, vocab, positions = SHAPES[shape]
    positions = args.rows or positions
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(positions, width, generator=generator, device=device, dtype=dtype)
    head = torch.nn.Linear(width, vocab, bias=False, device=device, dtype=dtype)
    weight = head.weight.requires_grad_(False)
    weight.copy_(torch.randn(vocab, width, generator=generator, device=device) / width**0.5)
    targets = torch.randint(0, vocab, (positions,), generator=generator, device=device)
    space = (torch.rand(vocab, generator=generator, device=device) < 0.4).cpu().numpy()
    rows = head_chunk_rows(vocab, "sized", free_memory(device))
    print(f"shape {shape}: {positions} scored positions, hidden {width}, vocabulary {vocab}, "
          f"{dtype}, chunks of {min(rows, positions)} rows, {device}")  # fmt: skip

    times = {}

    def logits_only() -> None:
        for begin in range(0, positions, rows):
            _ = hidden[begin : begin + rows] @ weight.T

    times["head matmul"] = best_seconds(logits_only, args.repeats, device)

    def measure(label: str, one_pass) -> None:
        """`times[label]`, or a line where it fails: a kernel's first compile on this GPU is
        here, and one that fails must not cost the other rows."""
        try:
            times[label] = best_seconds(one_pass, args.repeats, device)
        except Exception as exc:  # the compilers' errors share no base class
            print(f"{label}: not measured ({type(exc).__name__}: {exc})"[:400], flush=True)

    for label, kernel, topk, with_space in SIDES:
        extras = HeadExtras(topk=topk, space_mask=space if with_space else None)
        try:
            columns = HeadColumns(extras, vocab, device, kernel)
        except ConfigError as exc:  # onepass's Triton kernel off CUDA
            print(f"{label}: not measured: {exc}")
            continue
        measure(label, functools.partial(columns.of_batch, hidden, head, targets, rows))
    # --topk-mode sampled: 32 ids drawn from each row's fp32 softmax, with their ranks
    sampled = HeadColumns(HeadExtras(topk=32, sampled=True), vocab, device, "plain")
    uniforms = torch.rand(positions, 32, generator=generator, device=device, dtype=torch.float64)
    measure("plain sampled 32", functools.partial(
        sampled.of_batch, hidden, head, targets, rows, uniforms))  # fmt: skip
    for label, form in EARLIER_FORMS if compiles_on(device) else ():
        earlier = compile_head_pass(form)  # compiled as the scorer compiles fused

        def earlier_form(earlier=earlier) -> None:
            for begin in range(0, positions, rows):
                chunk = slice(begin, begin + rows)
                earlier(hidden[chunk] @ weight.T, targets[chunk])

        measure(label, earlier_form)
    for label, with_space in NATURAL_EXP_ROWS if "onepass loss" in times else ():  # where it runs
        from pipeline.scoring.triton_head import logit_row_sums

        extras = HeadExtras(space_mask=space if with_space else None)
        columns = HeadColumns(extras, vocab, device, "onepass")
        row_sums = functools.partial(logit_row_sums, natural_exp=True)
        columns.compute = functools.partial(onepass_columns, row_sums, None)  # no top k
        measure(label, functools.partial(columns.of_batch, hidden, head, targets, rows))
    print(f"{'what':<34} {'ms/batch':>9} {'ratio':>7}")
    for label, seconds in times.items():
        print(f"{label:<34} {seconds * 1e3:>9.2f} {seconds / times['fused loss']:>7.3f}")
    print("ratio: / fused loss (what `stage 1 (hf)` computes on a GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
