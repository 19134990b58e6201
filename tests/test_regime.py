"""experiments/regime.py: the splits, the plateau stop, the gate and the report from made-up
evaluations (fast), a bad design refused before anything runs, and the whole experiment end to
end at a tiny shape with a real stronger teacher, a rerun redoing nothing (slow); its GPU form
from a cache and a teacher evaluation carried from another folder (slow), and carried ones of
other chapters refused in one line (fast); the shipped novels corpus (fast)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def tiny_manifest(tmp_path: Path, teacher: Path | None, design: str = "regime.toml",
                  **regime) -> Path:  # fmt: skip
    """A design's manifest (manifests/DESIGN) at a tiny shape: its arms, comparisons and metrics;
    `teacher` None names none (the GPU form's carried cache and evaluation stand in for it)."""
    import tomllib

    design = tomllib.loads((REPO / "manifests" / design).read_text())
    values = {
        "out": str(tmp_path / "regime"), **({} if teacher is None else {"teacher": str(teacher)}),
        "test_docs": 3,
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


def stronger_teacher(folder: Path, corpus: str = "kjv") -> Path:
    """A real teacher the tiny student cannot match in a few steps: the same tiny shape trained
    plainly for 60 steps on the corpus (saved with its tokenizer, as stage 1 loads a teacher)."""
    from apps.demo.warm_start import train_warm_start
    from pipeline.corpus import Corpus
    from pipeline.shipped import shipped_corpus

    texts = [d.text for _, d in zip(range(200), Corpus(shipped_corpus(corpus)), strict=False)]
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


# --- fast: the pieces, from made-up evaluations --------------------------------------------


def test_the_last_word_of_each_line_is_its_last_run_of_letters():
    from apps.evaluation.last_word import last_word_spans

    text = "And God said, Let there be light: and there was light.\n\nthe LORD'S own.\n12 34"
    spans = last_word_spans(text)
    assert [text[s:e] for s, e in spans] == ["light", "own"]  # a blank line and digits: none


def test_a_word_counts_only_when_every_token_covering_it_is_the_greedy_one():
    from apps.evaluation.last_word import words_predicted

    # tokens: "And"(0,3) " the"(3,7) " LO"(7,10) "RD"(10,12) "."(12,13)
    start, end = np.array([0, 3, 7, 10, 12]), np.array([3, 7, 10, 12, 13])
    spans = np.array([[8, 12], [4, 7], [13, 13]])  # LORD (two tokens), the, nothing covered
    both = np.array([True, True, True, True, False])
    assert words_predicted(start, end, both, spans).tolist() == [True, True, False]
    second_missed = np.array([True, True, True, False, True])
    assert words_predicted(start, end, second_missed, spans).tolist() == [False, True, False]


def test_the_greedy_ids_the_eval_reads_are_the_models_argmax_at_each_position(tmp_path):
    """The metric reads stage 1's top-1 column as 'the token the model predicts at j given the
    tokens before j': the same as an argmax over a plain forward pass, window for window."""
    import torch

    from apps.evaluation.bits_per_character import score_documents
    from apps.evaluation.last_word import last_word_accuracy
    from pipeline.models.hf_tokenizer import save_tokenizer
    from pipeline.models.student import build_student
    from pipeline.scoring.head import HeadExtras
    from pipeline.scoring.hf import HFScorer
    from pipeline.scoring.resolve import Asked
    from pipeline.scoring.teacher import resolve_teacher
    from pipeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("tinyllama")
    model = build_student("llama-tiny", tokenizer, seed=0, seq_len=64)
    model.save_pretrained(tmp_path)
    save_tokenizer(tokenizer, tmp_path)
    scorer = HFScorer(resolve_teacher(str(tmp_path)), asked=Asked("float32"), max_length=512,
                      stride=256, batch_tokens=2048, extras=HeadExtras(topk=1)).load()  # fmt: skip
    texts = ["In the beginning God created the heaven and the earth.\nAnd the earth was void.",
             "Jesus wept.\nThe the the the the the the the"]  # fmt: skip
    encodings, columns = score_documents(scorer, tokenizer, texts)
    for encoding, top in zip(encodings, columns["topk_ids"], strict=True):
        ids = torch.as_tensor(encoding.ids, dtype=torch.long)[None]
        with torch.no_grad():
            argmax = model(input_ids=ids).logits[0].argmax(-1).numpy()
        assert np.array_equal(np.asarray(top)[1:, 0], argmax[:-1])  # token 0: no prediction
    accuracy = last_word_accuracy(scorer, tokenizer, texts)
    assert accuracy.words == 4 and accuracy.per_document_words == (2, 2)


def test_the_plateau_stop_tests_the_last_quarter_at_its_steps_only():
    from apps.demo.warm_start import PlateauStop

    stop = PlateauStop(tolerance=0.02, every=400, min_steps=800)
    flat = {300: 2.00, 400: 1.99, 600: 1.98, 800: 1.97}
    assert not stop.reached(flat, 400)  # before min_steps
    assert stop.reached(flat, 800)  # 1.98 -> 1.97: 0.5% over 600..800
    falling = {600: 2.0, 800: 1.9}
    assert not stop.reached(falling, 800)  # 5%
    assert not stop.reached(flat | {1000: 1.9}, 1000)  # not a multiple of `every`


def test_the_splits_are_disjoint_fixed_by_their_seed_and_cover_the_corpus(tmp_path):
    from experiments.regime.config import RegimeConfig
    from experiments.regime.run import PARTS, write_splits

    ids = {}
    for name in ("a", "b"):
        config = RegimeConfig(out=tmp_path / name, test_docs=100, validation_docs=60, cpt_docs=160)
        write_splits(config)
        ids[name] = json.loads((tmp_path / name / "corpus" / "splits.json").read_text())["ids"]
    assert ids["a"] == ids["b"]
    sizes = {part: len(ids["a"][part]) for part in PARTS}
    assert sizes == {"test": 100, "validation": 60, "cpt": 160, "warm": 1189 - 320}
    every = [i for part in PARTS for i in ids["a"][part]]
    assert len(set(every)) == 1189 and ids["a"]["test"][0].startswith("kjv:")
    other = RegimeConfig(out=tmp_path / "c", split_seed=1)
    write_splits(other)
    assert json.loads((tmp_path / "c" / "corpus" / "splits.json").read_text())["ids"] != ids["a"]


def _evaluation(bits: np.ndarray, characters: np.ndarray, correct=None, words=None) -> dict:
    result = {"bits_per_character": {"per_document_bits": bits.tolist(),
                                     "per_document_characters": characters.tolist()}}  # fmt: skip
    if correct is not None:
        result["last_word_accuracy"] = {"per_document_correct": correct.tolist(),
                                        "per_document_words": words.tolist()}  # fmt: skip
    return result


def _made_up_run(out: Path, teacher_bpc: float, curve: list[tuple[int, float]]):
    """A finished warm start and the teacher's and warm start's test evaluations."""
    from pipeline.io import atomic_write_json

    rng = np.random.default_rng(0)
    characters = rng.integers(2000, 6000, 40).astype(float)
    base = rng.uniform(1.3, 1.5, 40) * characters
    history = [{"step": s, "loss": h, "heldout_loss": h, "train_rows_loss": h - 0.1}
               for s, h in curve]  # fmt: skip
    atomic_write_json(out / "warm-start" / "warm_start.json", {
        "history": history, "steps": curve[-1][0], "tokens_trained": 1000,
        "tokens_available": 500})  # fmt: skip
    words = rng.integers(10, 30, 40).astype(float)
    atomic_write_json(out / "eval" / "warm-start-test.json",
                      _evaluation(base, characters, words * 0.3, words))  # fmt: skip
    atomic_write_json(out / "eval" / "teacher-test.json",
                      _evaluation(characters * teacher_bpc, characters, words * 0.5, words))
    return base, characters, words


def test_the_gate_fails_on_a_teacher_too_close_and_says_what_would_pass_it(tmp_path):
    from experiments.regime.config import RegimeConfig, RegimePreRegistration
    from experiments.regime.report import gate, write_regime_report

    config = RegimeConfig(out=tmp_path)
    prereg = RegimePreRegistration(comparisons=["token-none"], resamples=200)
    _made_up_run(tmp_path, 1.30, [(400, 2.0), (600, 1.9), (800, 1.89)])  # plateau passes
    verdict = gate(config, prereg)
    assert verdict["plateau"]["flattened"] and not verdict["passed"]
    assert 0 < verdict["relative_gap"] < 0.15
    assert "a teacher at most" in verdict["would_pass_with"][0]
    report = write_regime_report(config, Path("m.toml"), prereg, {}).read_text()
    assert "**The gate failed.**" in report and "No arm was trained" in report
    assert "## The pre-registered comparisons" not in report


def test_the_report_compares_each_arm_at_its_validation_chosen_rate_per_seed_and_over_seeds(
    tmp_path,
):
    from experiments.regime.config import RegimeConfig, RegimePreRegistration
    from experiments.regime.report import write_regime_report
    from experiments.regime.run import run_name
    from pipeline.io import atomic_write_json

    config = RegimeConfig(out=tmp_path, arms=["none", "token", "uld"], seeded_arms=["none",
                          "token"], seeds=[0, 1])  # fmt: skip
    prereg = RegimePreRegistration(primary="bits_per_character",
                                   secondary=["last_word_accuracy"],
                                   comparisons=["token-none", "uld-none"], resamples=500)
    base, chars, words = _made_up_run(tmp_path, 1.0, [(400, 2.0), (600, 1.9), (800, 1.89)])
    # validation: 1e-3 wins for token (3e-3 for the others); the losing rate is made much
    # better on the test part, which must not matter
    shift = {"none": 0.0, "token": -0.05, "uld": 0.01}
    for arm in config.arms:
        best = 1e-3 if arm == "token" else 3e-3
        for lr in config.rates:
            bpc = 1.4 if lr == best else 1.5
            atomic_write_json(tmp_path / "eval" / f"{run_name(arm, lr, 0)}-validation.json",
                              _evaluation(chars * bpc, chars))  # fmt: skip
            for seed in config.seeds_of(arm):
                test_shift = shift[arm] if lr == best else -1.0
                atomic_write_json(
                    tmp_path / "eval" / f"{run_name(arm, lr, seed)}-test.json",
                    _evaluation(base + chars * (test_shift + 0.001 * seed), chars,
                                words * 0.4, words),
                )  # fmt: skip
    report = write_regime_report(config, Path("m.toml"), prereg, {"warm-start": 1.0})
    regime = json.loads((tmp_path / "regime.json").read_text())
    assert regime["chosen"]["token"]["lr"] == 1e-3 and regime["chosen"]["none"]["lr"] == 3e-3
    rows = {(r["a"], r["seeds"], r["metric"]): r for r in regime["comparisons"]}
    assert set(rows) == {(a, s, m) for a, ss in (("token", ("seed 0", "seed 1", "over seeds")),
                                                 ("uld", ("seed 0",)))
                         for s in ss for m in ("bits_per_character", "last_word_accuracy")}
    over = rows[("token", "over seeds", "bits_per_character")]
    assert over["difference"] == pytest.approx(-0.05, abs=1e-9) and over["excludes_zero"]
    text = report.read_text()
    assert "`token` − `none` = -0.0500" in text and "the cache's arm helped" in text
    assert "`uld` − `none` = +0.0100" in text and "the cache's arm hurt" in text


def test_a_design_naming_an_arm_without_a_table_is_refused_before_anything_runs(tmp_path):
    manifest = tiny_manifest(tmp_path, tmp_path / "no-teacher", arms=["none", "token", "rho2"],
                             seeded_arms=["none"])  # fmt: skip
    command = [sys.executable, "experiments/regime.py", f"--manifest={manifest}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"regime: error: {manifest}: no [arms.rho2] table for arm 'rho2'"
    ]
    assert not (tmp_path / "regime").exists()



GPU_SHAPE = {"test_docs": 3, "validation_docs": 2, "cpt_docs": 2}  # novels chapters are long


def the_cpu_half(folder: Path, teacher: Path | None = None) -> tuple[Path, Path]:
    """What manifests/regime-gpu.toml's --teacher-only half makes on a CPU, at GPU_SHAPE and
    without Ray: the splits, a cache of the continual-pretraining part (random teacher columns,
    tests/cache_fixtures.py) and, given a `teacher`, its `vocagno eval --last-words` of the test
    part and the cache's columns that uld and alm read (without one, nothing trains: a refusal
    needs only the cache's manifest)."""
    import tomllib

    from experiments.regime.config import RegimeConfig
    from experiments.regime.run import evaluate_on, texts_of, write_splits
    from tests.cache_fixtures import build_cache

    gpu = tomllib.loads((REPO / "manifests" / "regime-gpu.toml").read_text())
    config = RegimeConfig(out=folder, corpus=gpu["regime"]["corpus"], **GPU_SHAPE)
    parts = write_splits(config)
    cpt = parts["cpt"]
    columns = {"topk": 4, "space_logprob": True} if teacher is not None else {}
    build_cache(folder / "cache", teacher_tokenizer="smollm2", docs_per_shard=1,
                documents=[(f"cpt-{i}", t) for i, t in enumerate(texts_of(cpt))],
                corpus={"sources": [{"name": cpt.name, "bytes": cpt.stat().st_size}]},
                **columns)  # fmt: skip
    if teacher is not None:
        evaluate_on(config, {"batch_tokens": 2048, "max_length": 128}, teacher, "test", parts,
                    "teacher")  # fmt: skip
    return folder / "cache", config.teacher_eval_path


@pytest.mark.slow
def test_the_gpu_form_runs_at_a_tiny_shape_from_a_carried_cache_and_teacher_evaluation(tmp_path):
    """manifests/regime-gpu.toml's form on the CPU: its corpus, arms, rates and comparisons, the
    cache and the teacher's evaluation made in another folder (no teacher and no Ray here); the
    gate reads the carried evaluation, and each arm is compared at its validation-chosen rate."""
    import tomllib

    from experiments.regime.run import run_name

    gpu = tomllib.loads((REPO / "manifests" / "regime-gpu.toml").read_text())["regime"]
    teacher = stronger_teacher(tmp_path / "teacher", gpu["corpus"])
    cache, teacher_eval = the_cpu_half(tmp_path / "cpu", teacher)
    manifest = tiny_manifest(tmp_path, None, "regime-gpu.toml", corpus=gpu["corpus"],
                             cache=str(cache), teacher_eval=str(teacher_eval),
                             **GPU_SHAPE)  # fmt: skip
    command = [sys.executable, "experiments/regime.py", f"--manifest={manifest}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ray cluster up" not in result.stderr and "preparing the teacher" not in result.stderr
    out = tmp_path / "regime"
    assert not (out / "cache").exists()
    regime = json.loads((out / "regime.json").read_text())
    carried = json.loads(teacher_eval.read_text())
    assert json.loads((out / "eval" / "teacher-test.json").read_text()) == carried
    assert regime["gate"]["passed"], regime["gate"]
    assert regime["gate"]["teacher_bits_per_character"] == pytest.approx(
        carried["bits_per_character"]["bits_per_character"], rel=1e-9
    )
    assert set(regime["chosen"]) == set(gpu["arms"])
    for arm, pick in regime["chosen"].items():
        validation = {
            lr: json.loads((out / "eval" / f"{run_name(arm, lr, 0)}-validation.json").read_text())[
                "bits_per_character"]["bits_per_character"]
            for lr in gpu["rates"]
        }  # fmt: skip
        assert pick["lr"] == min(validation, key=validation.get), (arm, validation)
        for seed in [0, 1] if arm in gpu["seeded_arms"] else [0]:
            assert (out / "eval" / f"{run_name(arm, pick['lr'], seed)}-test.json").exists()
    pairs = {(r["a"], r["b"], r["seeds"]) for r in regime["comparisons"]}
    assert ("token", "none", "over seeds") in pairs and ("alm", "none", "seed 0") in pairs


def _refusal(manifest: Path) -> list[str]:
    command = [sys.executable, "experiments/regime.py", f"--manifest={manifest}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    return result.stderr.strip().splitlines()


def test_a_carried_cache_of_other_chapters_is_refused_in_one_line_before_any_teacher(tmp_path):
    cache, _ = the_cpu_half(tmp_path / "cpu")
    other = tiny_manifest(tmp_path, None, "regime-gpu.toml", corpus="novels", cache=str(cache),
                          **{**GPU_SHAPE, "split_seed": 1})  # fmt: skip
    [line] = _refusal(other)
    assert line.startswith(f"regime: error: cache {cache} scored [('cpt.jsonl', ")
    assert "not this design's continual-pretraining part" in line
    assert not (tmp_path / "regime" / "eval").exists()


def test_a_carried_teacher_evaluation_of_other_chapters_is_refused_in_one_line(tmp_path):
    from pipeline.io import atomic_write_json

    cache, _ = the_cpu_half(tmp_path / "cpu")
    wrong = tmp_path / "teacher-test.json"
    sizes = np.array([100.0, 200.0, 300.0])
    atomic_write_json(wrong, _evaluation(sizes, sizes, sizes * 0, sizes * 0 + 1)
                      | {"last_word_accuracy": {"accuracy": 0.0}})  # fmt: skip
    manifest = tiny_manifest(tmp_path, None, "regime-gpu.toml", corpus="novels",
                             cache=str(cache), teacher_eval=str(wrong), **GPU_SHAPE)  # fmt: skip
    [line] = _refusal(manifest)
    assert line.startswith(f"regime: error: teacher_eval {wrong} evaluated 3 documents that are "
                           "not this design's 3 test chapters")  # fmt: skip
    atomic_write_json(wrong, {"answer_bits": {}})
    [line] = _refusal(manifest)
    assert line.startswith(f"regime: error: teacher_eval {wrong} is no `vocagno eval "
                           "--last-words` result of the test part (KeyError")  # fmt: skip
    assert not (tmp_path / "regime" / "eval").exists()


def test_teacher_only_refuses_a_cache_it_would_not_make(tmp_path):
    manifest = tiny_manifest(tmp_path, None, "regime-gpu.toml", corpus="novels",
                             cache=str(tmp_path / "elsewhere"), teacher_only=True,
                             **GPU_SHAPE)  # fmt: skip
    assert _refusal(manifest) == [
        f"regime: error: {manifest} [regime]: teacher_only makes {tmp_path / 'regime' / 'cache'}, "
        f"but cache names {tmp_path / 'elsewhere'}"
    ]


def test_the_novels_corpus_ships_each_chapter_of_its_seven_works_once():
    from pipeline.corpus import Corpus
    from pipeline.shipped import shipped_corpus

    texts = [d.text for d in Corpus(shipped_corpus("novels"))]
    records = [json.loads(line) for line in _lines(shipped_corpus("novels"))]
    assert len(texts) == len(records) == 405 and len({r["id"] for r in records}) == 405
    chapters = {}
    for record in records:
        chapters.setdefault(record["work"], []).append(record["chapter"])
    assert {w: len(c) for w, c in chapters.items()} == {
        "sense-and-sensibility": 50, "pride-and-prejudice": 61, "mansfield-park": 48,
        "emma": 55, "northanger-abbey": 31, "persuasion": 24, "moby-dick": 136,
    }  # fmt: skip
    assert all(c == list(range(1, len(c) + 1)) for c in chapters.values())
    whole = "\n".join(texts)
    assert texts[0].startswith("The family of Dashwood had long been settled in Sussex.")
    assert texts[-1].endswith("only found another orphan.")
    for boilerplate in ("Gutenberg", "_", "A NOTE ON THE TEXT", "VOLUME I", "\r"):
        assert boilerplate not in whole, boilerplate
    assert not re.search(r"(?m)^(?:CHAPTER|Chapter) [0-9IVXLC]+\b", whole)  # no heading kept


def _lines(path: Path) -> list[str]:
    import zstandard

    with zstandard.ZstdDecompressor().stream_reader(path.open("rb")) as stream:
        return stream.read().decode("utf-8").splitlines()
