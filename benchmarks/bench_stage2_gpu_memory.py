"""What stage 2's GPU-path switches save in memory, on a GPU or as far as it runs on a CPU
(docs/gpu-path.md).

- loss: one training step's loss and backward pass over a sequence of --positions positions,
  `--loss-kernel plain` (the head's float32 logits for every position, then log-softmax) against
  `chunked` (pipeline.chunked_loss), at a 32k and a 152k vocabulary (TinyLlama's and Qwen2.5's).
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
import resource
import subprocess
import sys
from pathlib import Path

VOCABULARIES = (32_000, 151_936)
SEQ_LENS = (1024, 2048, 4096)
DOCUMENT = 256  # tokens per packed document in the attention case


class Growth:
    """Peak memory above the level at `start()`: CUDA's allocator peak on a GPU, the process's
    resident high-water mark on a CPU."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, torch.device(device)

    def start(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
            self.base = self.torch.cuda.memory_allocated(self.device)
        else:
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def mib(self) -> float:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
            peak = self.torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return (peak - self.base) / 2**20


def loss_case(device: str, kernel: str, vocabulary: int, positions: int, hidden_size: int):
    import torch

    from pipeline.chunked_loss import chunked_token_loss
    from pipeline.cross_entropy import token_loss

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(positions, hidden_size, generator=generator).to(device)
    weight = (torch.randn(vocabulary, hidden_size, generator=generator) / 16).to(device)
    labels = torch.randint(0, vocabulary, (positions,), generator=generator).to(device)
    hidden.requires_grad_(), weight.requires_grad_()
    growth = Growth(device)
    growth.start()
    with torch.autocast(growth.device.type, torch.bfloat16, enabled=growth.device.type == "cuda"):
        if kernel == "plain":
            loss = token_loss(hidden @ weight.T, labels)
        else:
            loss = chunked_token_loss(hidden, weight, labels)
    loss.sum().backward()
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
    for vocabulary in VOCABULARIES:
        plain, chunked = (
            measured(["loss", device, kernel, vocabulary, args.positions, args.hidden])
            for kernel in ("plain", "chunked")
        )
        what = f"loss, vocabulary {vocabulary:,}, {args.positions} positions"
        print(f"{what:<42} {plain:>9,.0f} {chunked:>9,.0f} {chunked / plain:>11.3f}")
    for seq_len in SEQ_LENS:
        dense, flex = (measured(["attention", device, kind, seq_len]) for kind in ("dense", "flex"))
        what = f"decoder {'step' if device == 'cuda' else 'forward'}, 4 x {seq_len}"
        print(f"{what:<42} {dense:>9,.0f} {flex:>9,.0f} {flex / dense:>11.3f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
