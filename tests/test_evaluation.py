"""vocagno eval: bits per character against a direct forward pass, answer parsing, the command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from apps.cli import main
from apps.evaluation.answer_accuracy import (
    build_prompt,
    extract_answer,
    problem_from_document,
    same_number,
)
from apps.evaluation.bits_per_character import bits_per_character
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.teacher import resolve_teacher
from pipeline.tokenizer import load_tokenizer
from tests.stage1_helpers import make_tiny_teacher

TEXTS = ["Question: 3 + 4?\nAnswer: 3 + 4 = 7 #### 7", "Ünïcode ✓ 12,5 and\ttabs  here."]


@pytest.mark.parametrize("tokenizer_name", ["tinyllama", "smollm2"])  # BOS / no BOS (EOS prefix)
def test_bits_per_character_equals_direct_cross_entropy(tmp_path, tokenizer_name):
    folder = make_tiny_teacher(tmp_path / "m", tokenizer_name)
    tokenizer = load_tokenizer(str(folder))
    scorer = HFScorer(
        resolve_teacher(str(folder)), dtype="float32", max_length=64, stride=32, batch_tokens=512
    )
    result = bits_per_character(scorer, tokenizer, TEXTS)

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    nats = 0.0
    for text in TEXTS:
        ids = tokenizer.encode(text).ids.tolist()
        if not tokenizer.policy.add_bos:
            ids = [tokenizer.eos_id, *ids]  # every text token gets a prediction
        with torch.inference_mode():
            out = model(torch.tensor([ids]), labels=torch.tensor([ids]))
        nats += out.loss.item() * (len(ids) - 1)
    assert result.unscored_characters == 0
    assert result.characters == sum(len(t) for t in TEXTS)
    assert result.bits_per_character == pytest.approx(
        nats / math.log(2) / result.characters, rel=1e-4
    )


def test_answers_are_parsed_from_the_final_line_only():
    assert extract_answer("so 3 * 4 = 12\n#### 1,234\n\nQuestion: next #### 9") == "1234"
    assert extract_answer("no final answer") is None
    assert extract_answer("#### -2.5") == "-2.5"
    assert same_number("12.0", "12") and not same_number("13", "12") and not same_number(None, "1")


def test_prompt_ends_where_the_model_must_answer():
    problem = problem_from_document("Question: 2 apples + 3?\nAnswer: 2 + 3 = 5 #### 5")
    assert problem == problem_from_document("Question: 2 apples + 3?\nAnswer: anything #### 5")
    prompt = build_prompt(["Question: a\nAnswer: b #### 1"], problem)
    assert prompt.endswith("Question: 2 apples + 3?\nAnswer:")
    assert prompt.startswith("Question: a\nAnswer: b #### 1\n\n")
    with pytest.raises(ValueError):
        problem_from_document("no answer line")


def test_eval_command_reports_both_measures(tmp_path, capsys):
    folder = make_tiny_teacher(tmp_path / "m", "tinyllama")
    report_path = tmp_path / "report.json"
    args = ["eval", "--model", str(folder), "--num-docs", "3", "--accuracy-problems", "2"]
    args += ["--shots", "1", "--max-new-tokens", "4", "--max-length", "256", "--out", str(report_path)]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bits_per_character"]["documents"] == 3
    assert summary["answer_accuracy"]["problems"] == 2
    saved = json.loads(report_path.read_text())
    assert len(saved["answer_accuracy"]["outcomes"]) == 2
    assert np.isfinite(saved["bits_per_character"]["bits_per_character"])


def test_eval_of_a_missing_model_or_a_checkpoint_is_one_clear_error(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nope")]) == 2
    assert f"error: model '{tmp_path / 'nope'}' does not exist" in capsys.readouterr().err
    checkpoint = tmp_path / "run" / "checkpoints" / "step-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps({"max_steps": 8, "dtype": "auto"}))
    assert main(["eval", "--model", str(checkpoint)]) == 2
    err = capsys.readouterr().err
    assert "is not a model's configuration" in err and "final/ folder" in err
    assert err.count("\n") == 1


def test_eval_data_with_a_bad_record_stops_or_skips_as_asked(tmp_path, capsys):
    folder = make_tiny_teacher(tmp_path / "m", "tinyllama")
    data = tmp_path / "held-out.jsonl"
    rows = [{"text": "One apple and 2 pears.\n#### 3"}, {"text": "bad \ud800"}]
    rows.append({"text": "Seven days.\n#### 7"})
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["eval", "--model", str(folder), "--data", str(data), "--num-docs", "2"]
    args += ["--accuracy-problems", "0", "--max-length", "256"]
    assert main(args) == 2
    assert "record 1: text holds a lone surrogate" in capsys.readouterr().err
    assert main([*args, "--on-bad-record", "skip"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bits_per_character"]["documents"] == 2 and report["skipped_records"] == 1


def test_generation_stops_per_row_once_the_final_answer_line_is_written():
    from apps.evaluation.answer_accuracy import FinalAnswerStop

    tokenizer = load_tokenizer("smollm2")
    prompt = tokenizer.encode("Question: 1 + 1?\nAnswer:").ids.tolist()
    rows = [" 1 + 1 = 2\n#### 2\n", " 1 + 1 = 2\n#### 2", " so\n\nQuestion: next"]
    encoded = [prompt + tokenizer.encode(r).ids.tolist() for r in rows]
    width = max(map(len, encoded))
    pad = tokenizer.eos_id
    # Right-pad here: the criterion decodes everything after the prompt, skipping specials.
    batch = torch.tensor([ids + [pad] * (width - len(ids)) for ids in encoded])
    stop = FinalAnswerStop(tokenizer, len(prompt))(batch, None)
    assert stop.tolist() == [True, False, True]
