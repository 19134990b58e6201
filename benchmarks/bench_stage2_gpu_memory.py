"""What stage 2's GPU-path switches save in memory, on a GPU or as far as it runs on a CPU
(docs/gpu-path.md).

- loss: one training step's loss and backward pass over a sequence of --positions positions,
  `--loss-kernel plain` (the head's float32 logits for every position, then log-softmax) against
  `chunked` (pipeline.chunked_loss), at a 32k and a 152k vocabulary (TinyLlama's and Qwen2.5's),
  and at 152k with what ULD reads beside the loss (the student's top 32 and log Z).
  The memory of logits does not depend on the hidden size, so a small one (--hidden) keeps the
  matrix products short.
- attention: the decoder of a llama-small-shaped student (its head's logits left out) over a
  micro-batch of 4 rows of 1024, 2048 and 4096 positions packed with documents of 256 tokens,
  `--attention dense` (the [B, 1, T, T] mask through SDPA) against `flex` (a BlockMask, compiled
  flex_attention): on a GPU a training step in bf16 autocast; on a CPU only a forward pass, as
  PyTorch has no flex backward pass there.

Each case runs in a fresh process; its figure is the peak memory above what the process held once
its inputs were built: CUDA's allocator peak on a GPU, the resident high-water mark
(resource.getrusage) on a CPU. Printed in MiB, with the ratio of the fast path to the plain one.

    python benchmarks/bench_stage2_gpu_memory.py [--positions 2048] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from peak_memory import in_use, peak_memory, reset_peak

VOCABULARIES = (32_000, 151_936)
SEQ_LENS = (1024, 2048, 4096)
ULD_TOP = 32  # a distillation's reads: ULD's student top k at the cache's usual --topk-probs
DOCUMENT = 256  # tokens per packed document in the attention case


class Growth:
    """Peak memory above the level at `start()` (benchmarks/peak_memory.py)."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)

    def start(self) -> None:
        reset_peak(self.device)
        self.base = in_use(self.device)

    def mib(self) -> float:
        return (peak_memory(self.device) - self.base) / 2**20


def loss_case(
    device: str, kernel: str, vocabulary: int, positions: int, hidden_size: int, top: int
) -> float:
    import torch

    from pipeline.chunked_loss import chunked_head_outputs
    from pipeline.head_outputs import HeadReads, head_outputs

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, hidden_size, generator=generator).to(device)
    weight = (torch.randn(vocabulary, hidden_size, generator=generator) / 16).to(device)
    labels = torch.randint(0, vocabulary, (positions,), generator=generator).to(device)
    hidden.requires_grad_(), weight.requires_grad_()
    reads = HeadReads(top=top)  # top > 0: ULD's reads of the student (its top k and log Z)
    growth = Growth(device)
    growth.start()
    with torch.autocast(growth.device.type, torch.bfloat16, enabled=growth.device.type == "cuda"):
        if kernel == "plain":
            student = head_outputs(hidden @ weight.T, labels, reads)
        else:
            student = chunked_head_outputs(hidden, weight, labels, reads)
    objective = student.loss.sum()
    if top:
        objective = objective + (student.top - student.log_z[:, None]).exp().sum()
    objective.backward()
    return growth.mib()


def attention_case(device: str, attention: str, seq_len: int) -> float:
    """On a GPU a training step of the decoder (bf16 autocast); on a CPU its forward pass."""
    import torch

    from pipeline.models.student import build_student
    from pipeline.tokenizer import load_tokenizer
    from stage2_train.attention import model_inputs, use_attention

    device = torch.device(device)
    model = build_student("llama-small", load_tokenizer("tinyllama"), 0, seq_len).to(device)
    use_attention(model, attention)
    pieces = seq_len // DOCUMENT
    batch = {
        "input_ids": torch.randint(3, 1000, (4, seq_len)),
        "segment_ids": torch.arange(1, pieces + 1).repeat_interleave(DOCUMENT).repeat(4, 1),
        "position_ids": torch.arange(DOCUMENT).repeat(pieces).repeat(4, 1),
    }
    decoder, training = model.get_decoder(), device.type == "cuda"  # the head's logits left out

    def step(inputs) -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=training):
            hidden = decoder(**model_inputs(model, inputs, device)).last_hidden_state
        if training:
            hidden.float().square().mean().backward()

    with torch.set_grad_enabled(training):
        step({k: v[:1, :DOCUMENT] for k, v in batch.items()})  # compiles flex
        model.zero_grad(set_to_none=True)
        growth = Growth(device)
        growth.start()
        step(batch)
    return growth.mib()


def measured(case: list) -> float:
    """Run one case in a fresh process; its growth in MiB."""
    command = [sys.executable, __file__, "--case", json.dumps(case)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, default=2048, help="loss case: positions")
    parser.add_argument("--hidden", type=int, default=256, help="loss case: hidden size")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in the child process
    args = parser.parse_args()
    if args.case:
        kind, *rest = json.loads(args.case)
        print(loss_case(*rest) if kind == "loss" else attention_case(*rest))
        return
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}; peak MiB above the case's inputs, each case in a fresh process")
    print(f"{'case':<42} {'plain':>9} {'fast':>9} {'fast/plain':>11}")
    print(f"(loss cases: {args.positions} positions, hidden size {args.hidden})")
    for vocabulary, top in [(v, 0) for v in VOCABULARIES] + [(VOCABULARIES[-1], ULD_TOP)]:
        plain, chunked = (
            measured(["loss", device, kernel, vocabulary, args.positions, args.hidden, top])
            for kernel in ("plain", "chunked")
        )
        what = f"loss{f' + top-{top} reads' if top else ''}, vocabulary {vocabulary:,}"
        print(f"{what:<42} {plain:>9,.0f} {chunked:>9,.0f} {chunked / plain:>11.3f}")
    for seq_len in SEQ_LENS:
        dense, flex = (measured(["attention", device, kind, seq_len]) for kind in ("dense", "flex"))
        what = f"decoder {'step' if device == 'cuda' else 'forward'}, 4 x {seq_len}"
        print(f"{what:<42} {dense:>9,.0f} {flex:>9,.0f} {flex / dense:>11.3f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
