"""What `--activation-checkpointing` costs in time and saves in memory (docs/gpu-path.md): one
training step (forward, backward, AdamW) of a preset student on random ids, its decoder layers
plain against checkpointed (stage2_train.parallel.checkpoint_layers), timed in turn so that both
see the same load, best of --repeats. Memory: the bytes autograd keeps for the backward pass
after the forward (every tensor saved, counted through saved-tensor hooks; the weights among
them are held anyway), and on a GPU CUDA's allocator peak of a step. Float32 on a CPU, bfloat16
autocast on a GPU; the layers are not compiled.

    python benchmarks/bench_activation_checkpointing.py [--student llama-small] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from peak_memory import peak_memory, reset_peak
from timing import interleaved_best_times, print_header, print_load_average

from pipeline.models.student import build_student
from pipeline.tokenizer import load_tokenizer
from stage2_train.parallel import checkpoint_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", default="llama-small")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer("tinyllama")
    models = {}
    for name in ("plain", "checkpointed"):
        model = build_student(args.student, tokenizer, 0, args.seq_len).to(device)
        if name == "checkpointed":
            checkpoint_layers(model)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    shape = (args.micro_batch_size, args.seq_len)
    ids = torch.randint(3, tokenizer.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )

    def step(model, optimizer) -> None:
        with autocast:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def saved_bytes(model) -> int:
        sizes = []

        def pack(tensor):
            sizes.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
        return sum(sizes)

    for pair in models.values():
        step(*pair)  # warm-up: allocations, AdamW's state
    peaks = {}
    for name, pair in models.items():
        reset_peak(device)
        step(*pair)
        peaks[name] = peak_memory(device) if device.type == "cuda" else None
    wall, cpu = interleaved_best_times(
        args.repeats, {name: (step, *pair) for name, pair in models.items()}
    )
    saved = {name: saved_bytes(model) for name, (model, _) in models.items()}
    parameters = sum(p.numel() for p in models["plain"][0].parameters())
    print(
        f"{args.student} ({parameters / 1e6:.1f}M parameters), micro-batch {shape[0]} x "
        f"{shape[1]}, {device}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print_header(f"{'layers':<14}{'step wall s':>12}{'step CPU s':>12}{'saved MiB':>11}{'peak MiB':>10}")
    for name in models:
        peak = f"{peaks[name] / 2**20:>10.0f}" if peaks[name] is not None else f"{'n/a':>10}"
        print(f"{name:<14}{wall[name]:>12.3f}{cpu[name]:>12.3f}{saved[name] / 2**20:>11.1f}{peak}")
    print(
        f"checkpointed / plain: step wall {wall['checkpointed'] / wall['plain']:.2f}x, "
        f"CPU {cpu['checkpointed'] / cpu['plain']:.2f}x, saved for the backward "
        f"{saved['checkpointed'] / saved['plain']:.3f}x"
    )
    print_load_average()


if __name__ == "__main__":
    main()
