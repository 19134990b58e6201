"""The run's logs: each step's record to metrics.jsonl, the logger --logger chooses
(pipeline.loggers: TensorBoard by default), the progress bar and the per-rank document logs (the
append-only ones cut back on resume), and the lines a run stops with."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import to_dict
from pipeline.flops import StepRate, flop_parameters
from pipeline.io import atomic_write_json, atomic_write_text
from pipeline.loggers import open_logger
from pipeline.metrics import METRICS_NAME, read_json_lines
from pipeline.storage.store import masked
from stage2_train.data.epochs import cache_passes, epoch_boundary
from stage2_train.parallel import unwrapped

if TYPE_CHECKING:
    from stage2_train.evaluation import Evaluation
    from stage2_train.run_setup import Run
    from stage2_train.step import StepTotals


class JsonLines:
    """An append-only JSON-lines log that a resumed run cuts back to the checkpoint's step."""

    def __init__(self, path: Path, keep_up_to_step: int):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if path.exists():  # a torn last line (the run was killed mid-write) is dropped too
            log = read_json_lines(path)
            kept = [r for r in log.records if r["step"] <= keep_up_to_step]
            if log.warning:
                print(f"stage 2: {repair_note(path, kept, keep_up_to_step)}", file=sys.stderr)
        atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))
        self.handle = path.open("a")

    def append(self, record: dict) -> None:
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def repair_note(path: Path, kept: list[dict], up_to_step: int) -> str:
    """What a resume says of a log whose last line was cut off: what it keeps, what is lost."""
    steps = {record["step"] for record in kept}
    lost = [step for step in range(1, up_to_step + 1) if step not in steps]
    said = f"{path}: its last line was cut off and is dropped; kept the records of steps up to "
    said += f"{max(steps, default=0)}"
    if lost:
        shown = ", ".join(map(str, lost[:5])) + (" ..." if len(lost) > 5 else "")
        said += f"; no record of step {shown} (trained, not logged)"
    return said


def diverged(kept: list, step: int, loss: float, grad_norm: float) -> str:
    """The line a run stops with once its loss or gradient norm is NaN or infinite (`kept`: its
    complete checkpoints, (step, folder) oldest first)."""
    said = f"its checkpoints up to step {kept[-1][0]} are kept" if kept else "no checkpoint is kept"
    return (
        f"step {step}'s loss ({loss:.4g}) or gradient norm ({grad_norm:.4g}) is not finite: "
        f"stopped before saving it; {said} and no final/ is written. A lower --lr or a "
        "--grad-clip (in a new --out) may keep it finite"
    )


def no_target(step: int) -> str:
    """A completion-only step may hold no answer token: no loss to log, not a loss of 0."""
    return (
        f"stage 2: step {step} held no target token (--completion-only: no answer fell in its "
        "sequences); no loss logged for it"
    )


def step_record(step: int, tokens: int, lr: float, totals: StepTotals, distills: bool) -> dict:
    """A step's metrics from its totals: a completion-only step may hold no answer token, which
    has no loss to log (None), not 0; `distills`: the run trains a distillation term, whose mean
    over its units (before its weight) is logged as distill_loss."""
    targets = totals.valid > 0
    record = {
        "step": step,
        "loss": totals.kept_loss / max(totals.kept, 1) if targets else None,
        "loss_all": totals.all_loss / totals.valid if targets else None,
        "kept_fraction": totals.kept / totals.valid if targets else None,
        "mapped_fraction": totals.mapped / totals.valid if targets else None,
        "tokens": tokens,
        "lr": lr,
        "grad_norm": totals.grad_norm,
    }
    if distills:
        units = totals.distill_units
        record["distill_loss"] = totals.distill_loss / units if units else None
    return record


class RunLogs:
    """Where each step's record goes: metrics.jsonl, the --logger and the progress bar on rank 0,
    and with --record-documents the documents each rank trained on. Opening them writes the
    run's config.json (its options and `Run.meta`) and says what the run trains."""

    def __init__(self, run: Run):
        from tqdm import tqdm

        config, runtime, start = run.config, run.runtime, run.start_step
        out = config.checkpointing.out
        self.global_batch_tokens = config.optimizer.global_batch_tokens
        self.distills = run.distillation is not None  # logs distill_loss
        self.metrics = self.documents = self.logger = self.step_rate = None
        if runtime.is_main:
            saved = {**to_dict(config), **run.meta}
            atomic_write_json(out / "config.json", saved)
            self.metrics = JsonLines(out / METRICS_NAME, start)
            logging = config.logging
            self.logger = open_logger(logging.logger, out, start, saved, logging.wandb_project)
            self.step_rate = StepRate(flop_parameters(unwrapped(run.model)), runtime.device)
            print(banner(run), file=sys.stderr)
            passes = cache_passes(
                run.plan,
                run.manifest.total_teacher_tokens,
                config.optimizer.max_steps * config.optimizer.global_batch_tokens,
                run.tokenizer,
            )
            print(f"stage 2: {passes.note()}", file=sys.stderr)
        if config.logging.record_documents:
            self.documents = JsonLines(
                out / "documents" / f"rank-{runtime.rank}.jsonl", start
            )
        self.progress = tqdm(total=run.stop_step, initial=start, disable=not runtime.is_main,
                             unit="step", dynamic_ncols=True, file=sys.stderr)  # fmt: skip
        self.started, self.step_tokens = time.monotonic(), 0
        # the newest pass over the cache this rank's documents come from (0: the first)
        self.epoch = max(position.epoch for position in run.data_state.positions.values())
        self.heldout = ""  # the progress bar's last held-out figures

    def log_step(
        self,
        step: int,
        lr: float,
        totals: StepTotals,
        micro_batches: list[dict],
        evaluation: Evaluation | None = None,
    ) -> None:
        """Log one step from its totals (every rank's sums) and this rank's micro-batches, with
        the held-out evaluation that followed it, if one did (its time is no step's)."""
        self.step_tokens += int(totals.valid)
        tokens = step * self.global_batch_tokens
        record = step_record(step, tokens, lr, totals, self.distills)
        if evaluation is not None:
            record |= evaluation.fields()
            self.started += evaluation.seconds
            self.heldout = f"{evaluation.loss:.3f} ({evaluation.bits_per_char:.3f} bits/char)"
        if self.documents is not None:
            trained = [document for batch in micro_batches for document in batch["documents"]]
            self.documents.append({"step": step, "documents": trained})
        if self.metrics is None:  # not rank 0
            return
        self.note_epoch(step, micro_batches)
        if evaluation is not None:
            self.step_rate.leave_out(evaluation.seconds)
        rates = self.step_rate.fields(int(totals.valid), self.global_batch_tokens)
        self.metrics.append({**record, **rates})
        self.logger.log({**record, **rates}, step)
        self.show(step, record)

    def note_epoch(self, step: int, micro_batches: list[dict]) -> None:
        """Log the step whose documents begin a new pass over the cache (rank 0's consumers)."""
        epochs = [epoch for batch in micro_batches for epoch, _ in batch["documents"]]
        if epochs and max(epochs) > self.epoch:
            self.epoch = max(epochs)
            self.progress.write(epoch_boundary(step, self.epoch), file=sys.stderr)

    def show(self, step: int, record: dict) -> None:
        """The progress bar's loss, kept fraction and tokens per second (and a no-target line)."""
        targets = record["loss_all"] is not None
        if not targets:
            self.progress.write(no_target(step), file=sys.stderr)
        rate = self.step_tokens / max(time.monotonic() - self.started, 1e-9)
        self.progress.set_postfix(
            loss=f"{record['loss']:.3f}" if targets else "-",
            kept=f"{record['kept_fraction']:.2f}" if targets else "-",
            tok_s=f"{rate:,.0f}",
            **({"heldout": self.heldout} if self.heldout else {}),
            refresh=False,
        )
        self.progress.update()

    def close(self) -> None:
        self.progress.close()
        for log in (self.metrics, self.documents, self.logger):
            if log is not None:
                log.close()


def banner(run: Run) -> str:
    """The line a run starts with: its student, batch shape and guidance, and where it starts."""
    config = run.config
    parameters = sum(p.numel() for p in unwrapped(run.model).parameters())
    return (
        f"stage 2: {parameters / 1e6:.2f}M-parameter student, {run.runtime.world_size} rank(s) x "
        f"{run.accumulation} micro-batch(es) of {config.optimizer.micro_batch_size} x "
        f"{config.data.seq_len} tokens per step, guidance {config.guidance.mode}; "
        + (f"resuming at step {run.start_step}" if run.start_step else "starting at step 0")
        + (heldout_note(run) if run.heldout is not None else "")
    )


def heldout_note(run: Run) -> str:
    """What --eval-every measures, and how often."""
    heldout = run.heldout
    return (
        f"; held-out loss every {run.config.logging.eval_every} steps on {heldout.documents} "
        f"document(s) of {masked(heldout.spec)} ({heldout.tokens:,} tokens, "
        f"{heldout.characters:,} characters, {len(heldout.batches)} batches), none of them in "
        "the cache"
    )
