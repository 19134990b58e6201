"""experiments/regime.py: the splits, the plateau stop, the gate and the report from made-up
evaluations (fast), a bad design refused before anything runs, and the whole experiment end to
end at a tiny shape with a real stronger teacher, a rerun redoing nothing (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tiny_manifest(tmp_path: Path, teacher: Path, **regime) -> Path:
    """manifests/regime.toml's design at a tiny shape: its arms, comparisons and metrics."""
    import tomllib

    design = tomllib.loads((REPO / "manifests" / "regime.toml").read_text())
    values = {
        "out": str(tmp_path / "regime"), "teacher": str(teacher), "test_docs": 3,
        "validation_docs": 3, "cpt_docs": 6, "student": "llama-tiny", "warm_start_warmup": 1,
        "warm_start_max_steps": 12, "heldout_every": 1, "plateau_every": 4,
        "plateau_min_steps": 4, "plateau_tolerance": 0.9, "gate_margin": 0.05,
        "rates": design["regime"]["rates"], "arms": design["regime"]["arms"],
        "seeded_arms": design["regime"]["seeded_arms"], "seeds": [0, 1],
        "selection_tokens": 256, "nproc_per_node": 1, "ray_cpus": 1, **regime,
    }  # fmt: skip
    arms = "\n".join(
        f"[arms.{name}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in table.items())
        for name, table in design["arms"].items()
    )
    manifest = tmp_path / "regime.toml"
    manifest.write_text(
        "[regime]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items()) + f"""
{arms}
[preregistered]
primary = "bits_per_character"
secondary = ["last_word_accuracy"]
comparisons = {json.dumps(design["preregistered"]["comparisons"])}
resamples = 200
[stage1]
docs_per_shard = 3
num_workers = 1
max_length = 128
batch_tokens = 1024
topk_probs = 4
topk_ids = false
space_logprob = true
[stage2]
student_tokenizer = "tinyllama"
seq_len = 64
micro_batch_size = 2
global_batch_tokens = 128
warmup_steps = 1
lr = 3e-3
min_lr = 3e-4
num_workers = 0
data_consumers = 2
[eval]
batch_tokens = 2048
max_length = 128
"""
    )
    return manifest


def stronger_teacher(folder: Path) -> Path:
    """A real teacher the tiny student cannot match in a few steps: the same tiny shape trained
    plainly for 60 steps on the corpus (saved with its tokenizer, as stage 1 loads a teacher)."""
    from apps.demo.warm_start import train_warm_start
    from pipeline.corpus import Corpus
    from pipeline.shipped import shipped_corpus

    texts = [d.text for _, d in zip(range(200), Corpus(shipped_corpus("kjv")), strict=False)]
    return train_warm_start(folder, "llama-tiny", "tinyllama", texts, seed=1, seq_len=64,
                            batch_sequences=4, steps=60, lr=1e-2, min_lr=1e-3, warmup_steps=2,
                            threads=1)  # fmt: skip


@pytest.mark.slow
def test_the_experiment_runs_end_to_end_and_a_rerun_redoes_nothing(tmp_path):
    manifest = tiny_manifest(tmp_path, stronger_teacher(tmp_path / "teacher"))
    command = [sys.executable, "experiments/regime.py", f"--manifest={manifest}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "regime"
    regime = json.loads((out / "regime.json").read_text())
    assert regime["gate"]["passed"], regime["gate"]
    assert set(regime["chosen"]) == {"none", "token", "random", "rho1", "uld", "alm"}
    seeds = {(r["a"], r["b"], r["seeds"]) for r in regime["comparisons"]}
    assert ("token", "none", "over seeds") in seeds and ("uld", "none", "seed 0") in seeds
    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "stage 2" not in rerun.stderr and "Ray cluster up" not in rerun.stderr
