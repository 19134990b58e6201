"""What trusting a checkpoint costs: checking every file against its recorded digest before a
resume, against the resume's own load (model, AdamW state, scheduler and the rank's file), and
hashing at save against the save. Target: verification <= 5% of the resume at the TinyLlama
shape on the CPU.

One process saves a checkpoint of the student preset with its AdamW state (after one step, so the
moments exist) through stage 2's own `save_checkpoint`, then times, in turn and `--repeats`
times: `load_checkpoint` into the same model and optimizer, and the verification stage 2 runs
first (`share_problems` over every file). Both read the files the save just wrote, so both read
from the page cache where memory allows: the ratio is of warm reads, which a resume on the
machine that saved sees; a cold read from a network file system makes both slower.

    python benchmarks/bench_checkpoint_digest.py [--student tinyllama-1.1b] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from timing import Elapsed, measure, print_header, print_load_average  # noqa: E402

from pipeline.config import from_flat  # noqa: E402
from pipeline.file_digests import share_problems  # noqa: E402
from pipeline.models.student import build_student  # noqa: E402
from pipeline.tokenizer import load_tokenizer  # noqa: E402
from stage2_train.checkpoint import load_checkpoint, save_checkpoint, step_dir  # noqa: E402
from stage2_train.checkpoint_digests import recorded_digests  # noqa: E402
from stage2_train.config import TrainConfig  # noqa: E402
from stage2_train.data.plan import DataPlan  # noqa: E402
from stage2_train.data.position import DataState  # noqa: E402
from stage2_train.distributed import Runtime  # noqa: E402
from stage2_train.schedule import make_optimizer  # noqa: E402
from tests.cache_fixtures import build_cache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", default="tinyllama-1.1b")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print_header("checkpoint digests: verification against load, hashing against save")
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        build_cache(root / "cache", num_documents=2, docs_per_shard=2)
        tokenizer = load_tokenizer("tinyllama")
        config = from_flat(TrainConfig, dict(
            cache=str(root / "cache"), student=args.student, student_tokenizer="tinyllama",
            out=root / "run", max_steps=2, warmup_steps=1, seq_len=64, micro_batch_size=1,
            global_batch_tokens=64,
        ))  # fmt: skip
        model = build_student(args.student, tokenizer, 0, config.data.seq_len)
        optimizer = make_optimizer(model, config.optimizer, "plain")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        model(
            input_ids=torch.ones(1, 8, dtype=torch.long), labels=torch.ones(1, 8, dtype=torch.long)
        ).loss.backward()  # noqa: E501
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the gradients are no part of a checkpoint
        runtime = Runtime(0, 0, 1, torch.device("cpu"))
        plan = DataPlan.from_cache(root / "cache", student_tokenizer=tokenizer.spec, seq_len=64,
                                   micro_batch_size=1)  # fmt: skip
        state = DataState.fresh(plan, 0)
        meta = {"world_size": 1}
        parameters = sum(p.numel() for p in model.parameters())
        save, load, verify = Elapsed(), Elapsed(), Elapsed()
        for _ in range(args.repeats):
            with measure(save):
                folder = save_checkpoint(config, 1, model, optimizer, scheduler, state, meta,
                                         runtime)  # fmt: skip
            recorded = recorded_digests(folder)
            with measure(verify):
                assert share_problems(folder, recorded, 0, 1) == []
            with measure(load):
                load_checkpoint(folder, model, optimizer, scheduler, plan, runtime)
        size = sum(d["bytes"] for d in recorded_digests(step_dir(config.out, 1)).values())
        n = args.repeats
        print(f"student {args.student}: {parameters / 1e6:,.1f}M parameters, checkpoint "
              f"{size / 2**30:.2f} GiB in {len(recorded)} files; {n} repeats")  # fmt: skip
        print(f"{'step':<28}{'wall s':>10}{'cpu s':>10}")
        for name, elapsed in (("save (with its hashing)", save), ("verify (every file)", verify),
                              ("load", load)):  # fmt: skip
            print(f"{name:<28}{elapsed.wall / n:>10.2f}{elapsed.cpu / n:>10.2f}")
        print(f"verify / load:          {verify.wall / load.wall:.3f} (wall)")
        print(f"verify / (verify + load): {verify.wall / (verify.wall + load.wall):.3f} (wall): "
              "the share of a resume's reading spent on trust")  # fmt: skip
        print_load_average()


if __name__ == "__main__":
    main()
