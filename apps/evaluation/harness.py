"""lm-evaluation-harness on our students and teachers (`pip install -e '.[eval]'`).

Stage 2 saves a plain Hugging Face model with its tokenizer, so lm-eval's own `hf` model runs the
paper's suite (GSM8K, MATH, SVAMP, ASDiv, MAWPS, TabMWP, MathQA, MMLU-STEM, SAT) wherever its
datasets are reachable: `run_lm_eval(OUT/final, ["gsm8k", "minerva_math", ...])`.

`heldout_task` adds a local task: held-out documents scored as rolling log-likelihoods, lm-eval's
bits per byte. For it lm-eval must not add BOS itself (`add_bos_token=False`): its rolling windows
already start with the BOS (or EOS) prefix, and a tokenizer that frames documents would otherwise
give it twice and score `<s>` after `<s>`. With that, its per-document log-likelihoods equal
`vocagno eval`'s (a test checks this).
"""

from __future__ import annotations

import json
from pathlib import Path

HELDOUT_TASK = "vocagno_heldout_bpb"


def heldout_task(task_dir: Path, texts: list[str]) -> str:
    """Write a local lm-eval task over `texts` into `task_dir`; returns its name."""
    task_dir.mkdir(parents=True, exist_ok=True)
    data = task_dir / f"{HELDOUT_TASK}.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    (task_dir / f"{HELDOUT_TASK}.yaml").write_text(
        f"""task: {HELDOUT_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data.resolve()))}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
""",
        encoding="utf-8",
    )
    return HELDOUT_TASK


def run_lm_eval(
    model: str | Path,
    tasks: list[str],
    *,
    include_path: Path | None = None,
    add_bos_token: bool | None = None,
    dtype: str = "float32",
    limit: int | None = None,
    log_samples: bool = False,
    device: str = "cpu",
) -> dict:
    """lm_eval.simple_evaluate with its `hf` model; returns lm-eval's results dictionary."""
    from lm_eval import simple_evaluate

    model_args = f"pretrained={model},dtype={dtype}"
    if add_bos_token is not None:
        model_args += f",add_bos_token={add_bos_token}"
    return simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=tasks,
        task_manager=task_manager(tasks, include_path),
        limit=limit,
        log_samples=log_samples,
        device=device,
    )


def task_manager(tasks: list[str], include_path: Path | None):
    """lm-eval's index of tasks: `include_path`'s alone where it holds every task asked for, else
    with lm-eval's own. Indexing its own reads about 14,000 YAML files (20 s on 2 cores), which a
    held-out evaluation does not need."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=str(include_path) if include_path else None)
