"""The lm-evaluation-harness adapter on a local task: lm-eval and `vocagno eval` agree."""

from __future__ import annotations

import math

import pytest

from apps.evaluation.bits_per_character import bits_per_character
from apps.evaluation.harness import heldout_task, run_lm_eval, task_manager
from apps.evaluation.run import evaluation_documents
from pipeline.models.hf_tokenizer import save_tokenizer
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.teacher import resolve_teacher
from pipeline.shipped import shipped_corpus
from pipeline.tokenizer import load_tokenizer
from tests.stage1_helpers import make_tiny_teacher

pytest.importorskip("lm_eval", reason="lm-eval is the `eval` extra; make test installs it")


@pytest.mark.parametrize("tokenizer_name", ["tinyllama", "smollm2"])  # BOS / EOS as first context
def test_lm_eval_scores_heldout_documents_exactly_as_vocagno_eval(tmp_path, tokenizer_name):
    model = make_tiny_teacher(tmp_path / "model", tokenizer_name)
    save_tokenizer(load_tokenizer(tokenizer_name), model)  # as stage 2 saves a student
    texts = [d.text for d in evaluation_documents(str(shipped_corpus("eval")), 3)[0]]
    task = heldout_task(tmp_path / "tasks", texts)
    results = run_lm_eval(
        model, [task], include_path=tmp_path / "tasks", add_bos_token=False, log_samples=True
    )
    harness_nats = {s["doc"]["text"]: -float(s["resps"][0][0]) for s in results["samples"][task]}
    scorer = HFScorer(
        resolve_teacher(str(model)), asked=Asked("float32"), max_length=256, stride=128,
        batch_tokens=2048,
    ).load()
    tokenizer = load_tokenizer(str(model))
    for text in texts:
        ours = bits_per_character(scorer, tokenizer, [text])
        ours_nats = ours.bits_per_character * ours.characters * math.log(2)
        assert harness_nats[text] == pytest.approx(ours_nats, rel=1e-4)
    bits_per_byte = results["results"][task]["bits_per_byte,none"]
    total_bytes = sum(len(t.encode()) for t in texts)
    assert bits_per_byte == pytest.approx(
        sum(harness_nats.values()) / math.log(2) / total_bytes, rel=1e-6
    )


def test_lm_evals_own_tasks_are_indexed_only_when_asked_for(tmp_path):
    """A held-out evaluation indexes its folder alone (lm-eval's own ~14,000 task files take 20 s
    to read on 2 cores)."""
    task = heldout_task(tmp_path / "tasks", ["one document"])
    assert task_manager([task], tmp_path / "tasks").all_tasks == [task]


@pytest.mark.slow  # reads lm-eval's whole index
def test_a_task_of_lm_evals_own_beside_a_local_one_is_found(tmp_path):
    """A list that names one of lm-eval's tasks gets lm-eval's index too."""
    task = heldout_task(tmp_path / "tasks", ["one document"])
    assert {task, "gsm8k"} <= set(task_manager([task, "gsm8k"], tmp_path / "tasks").all_tasks)
