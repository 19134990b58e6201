"""Stage 2's first call on a GPU machine: does its GPU path run, stay compiled, and at what speed?
No Ray, no teacher, no network: what it needs is the project's own Python dependencies.

    python benchmarks/gpu_first_call.py [--shape tinyllama|tiny] [--steps N] [--docs N]

Each phase prints its line as it ends, after the seconds since the start and this process's CPU
seconds, so that a call cut off by its time limit still reports what it measured:
1. versions: torch (its CUDA, the device), transformers, triton and the packages stage 2 imports;
   a missing one is named, and one stage 2 cannot run without stops the call there.
2. flex dtypes: what flex_attention receives as q, k and v in one decoder layer of the student's
   width under bf16 autocast with float32 weights (stage 2's compute without --fsdp), through the
   trainer's attention (stage2_train/attention.py); on a GPU its backward pass runs too.
3. a cache: the shipped corpus's first --docs documents with seeded random teacher losses
   (tests/cache_fixtures.py, the stage-1 contract's writer, the qwen2.5 tokenizer).
4. `token`, `none`: stage2_train/train.py in this process with every `auto` switch, --steps
   steps, no checkpoint and no final/ (--no-save-at-end), each in a clean compile state
   (torch._dynamo.reset()); its line gives the resolved switches, wall time, the first step's
   seconds (its compiling), the graphs dynamo compiled and the recompile-limit hits, tokens/s and
   MFU on the target tokens (the median after the first third of steps), peak memory (CUDA's
   allocator; on a CPU the process's resident high-water mark) and whether every loss is finite.
5. the floor: benchmarks/stage2_floor.py's plain training loop of the same student and batch
   shape, the same figures; then token / none and token / floor.

`--shape tinyllama` (the default with CUDA): the paper's student, TinyLlama-1.1B's shape, on
batches of 4 x 2048 tokens, 2 micro-batches a step. `--shape tiny` (the default without):
llama-tiny on 2 x 64, which tests/test_gpu_first_call.py runs on a CPU, where `auto` takes
each switch's plain value.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import io
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the cache builder
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


@dataclass(frozen=True)
class Shape:
    student: str  # a preset of pipeline.models.student
    seq_len: int
    micro_batch_size: int
    accumulation: int
    steps: int
    docs: int
    workers: int


SHAPES = {
    "tinyllama": Shape("tinyllama-1.1b", 2048, 4, 2, 10, 2000, 2),
    "tiny": Shape("llama-tiny", 64, 2, 2, 4, 16, 0),
}
# What stage 2 imports beyond torch (a missing one stops the call), and what it may go without.
REQUIRED = ("transformers", "tokenizers", "numpy", "pyarrow", "safetensors", "tqdm", "xxhash",
            "zstandard", "tensorboard")  # fmt: skip
OPTIONAL = ("triton",)
STARTED = time.perf_counter()


def say(line: str) -> None:
    """`line` after the seconds since the start, and this process's CPU seconds (the steadier
    figure on a machine that other work shares)."""
    print(f"[{time.perf_counter() - STARTED:6.1f} s, CPU {time.process_time():6.1f} s] {line}",
          flush=True)  # fmt: skip


def versions(device: torch.device) -> list[str]:
    """Phase 1: one line of versions; the names of the required packages that do not import."""
    found, missing = [f"torch {torch.__version__}"], []
    if device.type == "cuda":
        found.append(f"CUDA {torch.version.cuda} on {torch.cuda.get_device_name(device)}")
    for name in (*REQUIRED, *OPTIONAL):
        try:
            importlib.import_module(name)
            found.append(f"{name} {importlib.metadata.version(name)}")
        except Exception as exc:  # a package may fail to import for reasons of its own
            found.append(f"{name} MISSING ({type(exc).__name__})")
            missing += [name] if name in REQUIRED else []
    say("versions: " + ", ".join(found))
    return missing


def flex_dtypes(shape: Shape, device: torch.device) -> None:
    """Phase 2: the q, k, v dtypes flex_attention receives in one decoder layer of the student's
    width under bf16 autocast with float32 weights (a spy in front of transformers' call of the
    kernel); on a GPU the layer's backward pass runs too (flex has none on a CPU)."""
    import transformers.integrations.flex_attention as flex
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models.student import PRESETS
    from stage2_train.attention import student_logits, use_attention

    received, kernel = set(), flex.compile_friendly_flex_attention

    def spy(query, key, value, *args, **kwargs):
        received.add(tuple(str(t.dtype).removeprefix("torch.") for t in (query, key, value)))
        return kernel(query, key, value, *args, **kwargs)

    one_layer = {**PRESETS[shape.student], "num_hidden_layers": 1}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, **one_layer)).to(device)
    use_attention(model, "flex")
    length, half = shape.seq_len, shape.seq_len // 2
    batch = {  # two documents a row, positions restarting at the second
        "input_ids": torch.randint(3, 32000, (2, length)),
        "segment_ids": torch.tensor([1] * half + [2] * (length - half)).expand(2, -1),
        "position_ids": torch.cat([torch.arange(half), torch.arange(length - half)]).expand(2, -1),
    }
    began = time.perf_counter()
    flex.compile_friendly_flex_attention = spy
    try:
        training = device.type == "cuda"
        with torch.autocast(device.type, dtype=torch.bfloat16), torch.set_grad_enabled(training):
            logits = student_logits(model, batch, device)
        if training:
            logits.float().sum().backward()
        ran = "forward and backward" if training else "forward (no flex backward on a CPU)"
        say(f"flex dtypes: q, k, v {sorted(received)} under bf16 autocast with float32 weights; "
            f"{ran} {time.perf_counter() - began:.1f} s")  # fmt: skip
    except Exception as exc:  # what fails here is what this call is for: said, and the rest goes on
        say(f"flex dtypes: q, k, v {sorted(received)}; the kernel FAILED: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}")  # fmt: skip
    finally:
        flex.compile_friendly_flex_attention = kernel


def compile_counts() -> str:
    from torch._dynamo.utils import counters

    limit = sum(n for reason, n in counters["unimplemented"].items() if "recompile limit" in reason)
    breaks = sum(counters["graph_break"].values())
    return (f"{counters['stats']['unique_graphs']} graphs compiled, recompile limit hit {limit} "
            f"times, {breaks} graph breaks")  # fmt: skip


def clean_compile_state(device: torch.device) -> None:
    from peak_memory import reset_peak
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    reset_peak(device)


def peak(device: torch.device) -> str:
    from peak_memory import peak_memory

    where = "allocated" if device.type == "cuda" else "resident high-water mark, this process"
    return f"peak memory {peak_memory(device) / 2**30:.2f} GiB ({where})"


def arm(guidance: str, shape: Shape, cache: Path, out: Path, device: torch.device) -> float:
    """Phase 4: one stage-2 arm; returns its tokens/s."""
    from stage2_train.train import main as train

    global_batch = shape.seq_len * shape.micro_batch_size * shape.accumulation
    command = [
        "--cache", str(cache), "--student", shape.student, "--student-tokenizer", "tinyllama",
        "--out", str(out), "--guidance", guidance, "--max-steps", str(shape.steps),
        "--warmup-steps", "1", "--seq-len", str(shape.seq_len),
        "--micro-batch-size", str(shape.micro_batch_size),
        "--global-batch-tokens", str(global_batch), "--num-workers", str(shape.workers),
        "--save-every", "1000000", "--no-save-at-end",
    ]  # fmt: skip
    clean_compile_state(device)
    log, began = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(log):
        code = train(command)
    wall = time.perf_counter() - began
    if code != 0:
        say(f"{guidance}: FAILED, exit {code}: {log.getvalue().strip().splitlines()[-1:]}")
        return math.nan
    saved = json.loads((out / "config.json").read_text())
    resolved = ", ".join(f"{k[9:]} {v}" for k, v in saved.items() if k.startswith("resolved_"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = records[len(records) // 3 :]
    rate = statistics.median(r["tokens_per_second"] for r in steady)
    utilization = [r["mfu"] for r in steady if r["mfu"] is not None]
    mfu = f"{statistics.median(utilization):.1%}" if utilization else "n/a"
    first = global_batch / records[0]["slot_tokens_per_second"]  # metrics.jsonl keeps no clock
    finite = all(math.isfinite(r["loss_all"]) for r in records if r["loss_all"] is not None)
    say(f"{guidance}: {resolved}; {wall:.1f} s, first step {first:.1f} s; {compile_counts()}; "
        f"{rate:,.0f} target tokens/s, MFU {mfu} (median of steps {len(records) - len(steady) + 1}"
        f"-{len(records)}); {peak(device)}; losses {'finite' if finite else 'NOT finite'}")  # fmt: skip
    return rate


def floor(shape: Shape, device: torch.device) -> float:
    """Phase 5: the plain training loop of the same student and batch shape."""
    from stage2_floor import floor_rate

    clean_compile_state(device)
    began = time.perf_counter()
    rate, utilization = floor_rate(shape.student, shape.seq_len, shape.micro_batch_size,
                                   shape.accumulation, shape.steps, device)  # fmt: skip
    mfu = "n/a" if utilization is None else f"{utilization:.1%}"
    say(f"floor: {time.perf_counter() - began:.1f} s; {compile_counts()}; {rate:,.0f} target "
        f"tokens/s, MFU {mfu} (the last two thirds of steps); {peak(device)}")  # fmt: skip
    return rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), help="default: tinyllama with CUDA")
    parser.add_argument("--steps", type=int, help="optimizer steps per arm and of the floor")
    parser.add_argument("--docs", type=int, help="documents in the cache")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES[args.shape or ("tinyllama" if device.type == "cuda" else "tiny")]
    shape = Shape(**{**shape.__dict__, "steps": args.steps or shape.steps,
                     "docs": args.docs or shape.docs})  # fmt: skip
    missing = versions(device)
    if missing:
        say(f"stopped: stage 2 imports {', '.join(missing)}; install them and run again")
        return 2
    from tests.cache_fixtures import build_cache

    flex_dtypes(shape, device)
    with tempfile.TemporaryDirectory() as scratch:
        cache = Path(scratch) / "cache"
        build_cache(cache, num_documents=shape.docs, docs_per_shard=max(8, shape.docs // 4))
        say(f"cache: {shape.docs} documents of the shipped corpus, random teacher losses")
        rates = {guidance: arm(guidance, shape, cache, Path(scratch) / guidance, device)
                 for guidance in ("token", "none")}  # fmt: skip
    rates["floor"] = floor(shape, device)
    say(f"token / none {rates['token'] / rates['none']:.3f}, token / floor "
        f"{rates['token'] / rates['floor']:.3f} ({shape.student}, {shape.steps} steps of "
        f"{shape.accumulation} x {shape.micro_batch_size} x {shape.seq_len} tokens)")
    return 0 if all(math.isfinite(rate) for rate in rates.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
