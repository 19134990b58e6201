"""vocagno eval: bits per character against a direct forward pass, answer parsing, the command."""

from __future__ import annotations

import json
import math
from pathlib import Path

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
from apps.evaluation.answer_bits import answer_bits, answer_start
from apps.evaluation.bits_per_character import bits_per_character
from apps.evaluation.bootstrap import paired_bootstrap
from apps.evaluation.config import EvalConfig
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.teacher import resolve_teacher
from pipeline.tokenizer import load_tokenizer
from tests.stage1_helpers import make_tiny_teacher

TEXTS = ["Question: 3 + 4?\nAnswer: 3 + 4 = 7 #### 7", "Ünïcode ✓ 12,5 and\ttabs  here."]


@pytest.mark.parametrize("tokenizer_name", ["tinyllama", "smollm2"])  # BOS / no BOS (EOS prefix)
def test_bits_per_character_equals_direct_cross_entropy(tmp_path, tokenizer_name):
    folder = make_tiny_teacher(tmp_path / "m", tokenizer_name)
    tokenizer = load_tokenizer(str(folder))
    scorer = HFScorer(
        resolve_teacher(str(folder)), asked=Asked("float32"), max_length=64, stride=32,
        batch_tokens=512,
    ).load()
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
    args += ["--answer-problems", "4"]
    args += [
        "--shots",
        "1",
        "--max-new-tokens",
        "4",
        "--max-length",
        "256",
        "--out",
        str(report_path),
    ]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bits_per_character"]["documents"] == 3
    assert summary["answer_accuracy"]["problems"] == 2
    saved = json.loads(report_path.read_text())
    assert len(saved["answer_accuracy"]["outcomes"]) == 2
    assert np.isfinite(saved["bits_per_character"]["bits_per_character"])
    assert len(saved["bits_per_character"]["per_document_bits"]) == 3
    answer = saved["answer_bits"]
    assert answer["problems"] == 4 and len(answer["per_problem_characters"]) == 4
    # the same problems, in the same order, for both answer metrics
    assert saved["answer_accuracy"]["outcomes"][0]["question"].startswith("Question:")


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
    args += ["--accuracy-problems", "0", "--answer-problems", "0", "--max-length", "256"]
    assert main(args) == 2
    assert "record 1: text holds a lone surrogate" in capsys.readouterr().err
    assert main([*args, "--on-bad-record", "skip"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bits_per_character"]["documents"] == 2 and report["skipped_records"] == 1


def test_eval_computes_the_readmes_primary_metric_without_being_asked(tmp_path, capsys):
    """README: the primary metric is answer bits per character given the question on 200
    held-out problems, as the demo pre-registers it; `vocagno eval` computes it by default, and
    says so when the held-out data hold fewer problems (or refuses in one line when none)."""
    from pipeline.config import load_manifest_section

    demo = Path(__file__).resolve().parents[1] / "manifests" / "demo.toml"
    assert EvalConfig(model="m").answer_problems == 200
    assert load_manifest_section(demo, "eval")["answer_problems"] == 200
    folder = make_tiny_teacher(tmp_path / "m", "tinyllama")
    data = tmp_path / "held-out.jsonl"
    rows = [f"Question: {n} + 1?\nAnswer: {n + 1} #### {n + 1}" for n in range(3)]
    data.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    args = ["eval", "--model", str(folder), "--data", str(data), "--accuracy-problems", "0"]
    args += ["--max-length", "256"]
    assert main([*args, "--num-docs", "1"]) == 0  # no --answer-problems: 2 of the 200 left
    out, err = capsys.readouterr()
    primary = json.loads(out)["answer_bits"]
    assert primary["problems"] == 2 and 0 < primary["bits_per_character"] < 30
    assert primary["per_problem_characters"] == [len(" 2 #### 2"), len(" 3 #### 3")]
    assert "only 2 held-out problems after the documents" in err
    assert main([*args, "--num-docs", "3"]) == 2  # none left: one line, not an empty metric
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        "vocagno eval: error: no held-out problems left after the 3 bits-per-character documents"
    )


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


def test_answer_bits_are_the_answer_tokens_loss_given_the_question(tmp_path):
    folder = make_tiny_teacher(tmp_path / "m", "tinyllama")
    tokenizer = load_tokenizer(str(folder))
    scorer = HFScorer(
        resolve_teacher(str(folder)), asked=Asked("float32"), max_length=64, stride=32,
        batch_tokens=512,
    ).load()
    texts = [TEXTS[0], "Question: 10 - 4?\nAnswer: 10 - 4 = 6\n#### 6"]
    result = answer_bits(scorer, tokenizer, texts)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    for text, bits, chars in zip(texts, result.bits, result.characters, strict=True):
        start = answer_start(text)
        assert text[start:].startswith(" ") and chars == len(text) - start
        encoding = tokenizer.encode(text)
        ids = torch.tensor([encoding.ids.tolist()])
        with torch.inference_mode():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        token_logp = logp.gather(1, ids[0, 1:, None])[:, 0].numpy()
        in_answer = encoding.end[1:] > start  # tokens covering any answer character
        assert bits == pytest.approx(-token_logp[in_answer].sum() / math.log(2), rel=1e-4)
    assert result.unscored_tokens == 0
    assert result.bits_per_character == pytest.approx(result.bits.sum() / result.characters.sum())


def test_paired_bootstrap_recovers_a_known_difference_and_narrows_with_more_problems():
    rng = np.random.default_rng(1)
    widths = []
    for n in (50, 800):
        base = rng.normal(2.0, 0.5, n)  # problem difficulty, shared by both models
        a, b = base + 0.1 + rng.normal(0, 0.05, n), base + rng.normal(0, 0.05, n)
        d = paired_bootstrap(a, b, resamples=2000, seed=0)
        assert d.low < 0.1 < d.high and d.excludes_zero
        assert d.difference == pytest.approx(np.mean(a - b))
        widths.append(d.high - d.low)
    assert widths[1] < widths[0] / 2
    same = paired_bootstrap(a, a, resamples=500)
    assert same.difference == 0 and not same.excludes_zero
    # weights: a per-character rate over all problems, not a mean of per-problem rates
    w = np.array([1.0, 3.0])
    d = paired_bootstrap(np.array([1.0, 2.0]), np.array([0.0, 0.0]), w, resamples=200)
    assert d.difference == pytest.approx(7 / 4)
    assert paired_bootstrap(a, b, resamples=300, seed=5) == paired_bootstrap(
        a, b, resamples=300, seed=5
    )
    with pytest.raises(ValueError):
        paired_bootstrap(np.ones(3), np.ones(4))
