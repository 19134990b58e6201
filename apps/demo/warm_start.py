"""The warm start every arm continues from: the student pretrained plainly (next-token loss on
every token, no teacher) on documents disjoint from the continual-pretraining slice.

It stands in for the paper's already-trained TinyLlama, which was pretrained outside the method,
so it needs no teacher scores: stage 2 reads a stage-1 cache, and scoring these documents with
the teacher only to ignore the scores would cost more than the training itself. One process,
the same AdamW settings and cosine schedule as stage 2; packed sequences of `seq_len` tokens, on
the GPU where there is one."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.io import staged_folder
from pipeline.log import get_logger

log = get_logger("demo").info


@dataclass(frozen=True)
class PlateauStop:
    """Stop once the held-out loss fell by less than `tolerance` (a share) over the last quarter
    of the steps, tested at every multiple of `every` steps of at least `min_steps` (`every` a
    multiple of 4 held-out intervals, so that 3/4 of the step was measured too)."""

    tolerance: float
    every: int
    min_steps: int = 0

    def reached(self, heldout_at: dict[int, float], step: int) -> bool:
        quarter = step * 3 // 4
        if step < self.min_steps or step % self.every or quarter not in heldout_at:
            return False
        return (heldout_at[quarter] - heldout_at[step]) / heldout_at[quarter] < self.tolerance


def lr_at(step: int, steps: int, warmup: int, lr: float, min_lr: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def pack(ids: np.ndarray, seq_len: int) -> np.ndarray:
    rows = len(ids) // seq_len
    if rows < 1:
        raise ValueError(f"warm-start documents give {len(ids)} tokens, less than one sequence")
    return ids[: rows * seq_len].reshape(rows, seq_len)


@torch.no_grad()
def mean_loss(model, rows: torch.Tensor, batch_sequences: int) -> float:
    """The mean next-token loss over packed rows (every row's targets weigh alike)."""
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for first in range(0, len(rows), batch_sequences):
        batch = rows[first : first + batch_sequences].to(device)
        total += model(input_ids=batch, labels=batch).loss.double() * len(batch)
    model.train()
    return total.item() / len(rows)


def heldout_loss(folder: Path, texts: list[str], seq_len: int, batch_sequences: int) -> float:
    """The mean next-token loss of the model saved in `folder` on `texts`, packed as in training
    (a stage-2 run's final/, whose tokenizer is in the folder)."""
    from transformers import AutoModelForCausalLM

    from pipeline.tokenizer import load_tokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(folder).to(device)
    encodings = load_tokenizer(str(folder)).encode_batch(texts, add_eos=True)
    rows = torch.from_numpy(pack(np.concatenate([e.ids for e in encodings]), seq_len)).long()
    return mean_loss(model, rows, batch_sequences)


def train_warm_start(
    folder: Path,
    student: str,
    tokenizer_spec: str,
    texts: list[str],
    *,
    seed: int,
    seq_len: int,
    batch_sequences: int,
    steps: int,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    weight_decay: float = 0.1,
    threads: int = 2,
    heldout: list[str] | None = None,
    heldout_every: int = 0,
    plateau: PlateauStop | None = None,
) -> Path:
    """`heldout`: documents whose mean loss is recorded in the history every `heldout_every`
    steps and at the end (how far the warm start got; the dose-response's plateau test), with the
    mean loss of as many rows of the training documents beside it (train against held-out: how
    much of a fall is memorizing text seen before). `plateau`: stop early, at the first step the
    rule passes (`steps` is then the most it may take)."""
    from pipeline.models.hf_tokenizer import save_tokenizer
    from pipeline.models.student import build_student
    from pipeline.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(tokenizer_spec)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_student(student, tokenizer, seed, seq_len).to(device).train()
    encodings = tokenizer.encode_batch(texts, add_eos=True)
    rows = torch.from_numpy(pack(np.concatenate([e.ids for e in encodings]), seq_len)).long()
    heldout_rows = train_sample = None
    if heldout:
        held = tokenizer.encode_batch(heldout, add_eos=True)
        heldout_rows = torch.from_numpy(pack(np.concatenate([e.ids for e in held]), seq_len)).long()
        sample = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 1))
        train_sample = rows[sample[: len(heldout_rows)]]
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(rows), generator=generator)
    cursor, losses, heldout_at, train_at, started = 0, [], {}, {}, time.monotonic()
    for step in range(steps):
        if cursor + batch_sequences > len(order):  # next epoch, reshuffled
            order, cursor = torch.randperm(len(rows), generator=generator), 0
        batch = rows[order[cursor : cursor + batch_sequences]].to(device)
        cursor += batch_sequences
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, warmup_steps, lr, min_lr)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read on the host every 20 steps, not every step
        stop = False
        if heldout_rows is not None and ((step + 1) % heldout_every == 0 or step + 1 == steps):
            heldout_at[step + 1] = round(mean_loss(model, heldout_rows, batch_sequences), 4)
            train_at[step + 1] = round(mean_loss(model, train_sample, batch_sequences), 4)
            log(f"warm start step {step + 1}: held-out loss {heldout_at[step + 1]:.4f}, "
                f"on training rows {train_at[step + 1]:.4f}")  # fmt: skip
            stop = plateau is not None and plateau.reached(heldout_at, step + 1)
        if (step + 1) % 20 == 0 or step + 1 == steps:
            log(f"warm start step {step + 1}/{steps}: loss {loss.item():.3f} "
                f"({time.monotonic() - started:.0f} s)")  # fmt: skip
        if stop:
            log(f"warm start: the plateau test passed at step {step + 1}")
            break
    steps = len(losses)
    history = [
        {"step": step, "loss": round(value, 4)}
        | (
            {"heldout_loss": heldout_at[step], "train_rows_loss": train_at[step]}
            if step in heldout_at
            else {}
        )
        for step, value in enumerate(torch.stack(losses).tolist(), start=1)
    ]
    with staged_folder(folder) as partial:
        model.save_pretrained(partial, safe_serialization=True)
        save_tokenizer(tokenizer, partial)
        summary = {
            "student": student,
            "documents": len(texts),
            "tokens_available": int(rows.numel()),
            "tokens_trained": steps * batch_sequences * seq_len,
            "steps": steps,
            "history": history,
        }
        (partial / "warm_start.json").write_text(json.dumps(summary, indent=1))
    return folder
