"""`--guidance alm` (docs/alm.md): the ALM loss of pipeline.distillation.alm against an independent
reference written here as a plain loop over chunks from the definitions (Minixhofer et al. 2025,
arXiv:2503.20083, and tokenkit's defaults), on hand-made tokenizations of two tokenizers; the
mode's refusal of a cache without `space_logprob`; and a short CPU training run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cache.manifest import load_manifest
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation import AlignedRead, fill_value, vocabulary_subset_on
from pipeline.distillation.alm import INDEX, TEACHER, AlmDistillation
from pipeline.errors import CacheError
from pipeline.flops import RATE_FIELDS
from pipeline.head_outputs import head_outputs
from pipeline.models.student import build_student
from pipeline.tokenizer import load_tokenizer
from stage2_train.attention import student_logits
from stage2_train.config import parse_train_config
from stage2_train.data.plan import DataPlan
from stage2_train.data.streams import consumer_stream
from stage2_train.preflight import check_distillation_cache
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args

BOS, EOS = "<s>", "</s>"
THRESHOLD, TEMPERATURE = 0.1, 100.0
VOCAB = 12
DEVICE = torch.device("cpu")
SPACE_IDS = np.array([0, 3, 7, 8])  # the student's space mask S (as ids)
SPACE_MASK = np.isin(np.arange(VOCAB - 2), SPACE_IDS)  # as the mask, shorter than the head


def spans(text: str, pieces: list) -> tuple[np.ndarray, np.ndarray]:
    """Token spans of a hand-made tokenization: a piece is a string of the text in order, (char,
    k) for k byte tokens of one character (one shared span), or BOS / EOS (zero-width)."""
    start, end, at = [], [], 0
    for piece in pieces:
        if piece in (BOS, EOS):
            start.append(at), end.append(at)
            continue
        string, copies = piece if isinstance(piece, tuple) else (piece, 1)
        assert text.startswith(string, at)
        start += [at] * copies
        end += [at + len(string)] * copies
        at += len(string)
    assert at == len(text)
    return np.array(start), np.array(end)


# (text, student tokens, teacher tokens, teacher space probability after chosen teacher tokens).
# The student splits ö and é into byte tokens; the teacher has a BOS in the second document only.
DOCUMENTS = [
    (
        "héllo wörld, ok then",
        [BOS, "h", ("é", 2), "llo", " w", ("ö", 2), "rld", ",", " ok", " then", EOS],
        ["hé", "llo", " wö", "rld", ", ", "ok", " th", "en"],
        {1: 0.6, 2: 0.05, 3: 0.5, 5: 0.3},  # " wö" merges into "rld"
    ),
    (
        "ab cd ef gh ij kl mn op",
        ["ab", " cd", " e", "f", " gh", " ij", " k", "l", " mn", " op", EOS],
        [BOS, "a", "b", " cd", " ef", " g", "h", " ij", " kl", " mn", " o", "p"],
        {3: 0.08, 4: 0.7, 6: 0.02, 7: 0.01, 8: 0.9, 9: 0.4},  # " cd" + " ef", " gh" + " ij" + " kl"
    ),
]


def make_read(seed: int = 0) -> tuple[AlignedRead, list[dict]]:
    rng = np.random.default_rng(seed)
    docs = []
    for text, student, teacher, space_after in DOCUMENTS:
        s_start, s_end = spans(text, student)
        t_start, t_end = spans(text, teacher)
        loss = rng.uniform(0.1, 4.0, t_end.size)
        loss[0] = np.nan
        # space_logprob[t]: the distribution predicting token t; after token j it is [j + 1]
        space = np.log(rng.uniform(0.15, 0.95, t_end.size))
        space[0] = np.nan
        for j, p in space_after.items():
            space[j + 1] = np.log(p)
        docs.append(
            dict(
                text=text,
                s_start=s_start,
                s_end=s_end,
                t_end=t_end,
                loss=loss,
                space=space,
                ids=rng.integers(0, VOCAB, s_end.size),
            )  # fmt: skip
        )
    cat = lambda key: np.concatenate([d[key] for d in docs])  # noqa: E731
    read = AlignedRead(
        student_ids=cat("ids").astype(np.int32),
        student_start=cat("s_start"),
        student_end=cat("s_end"),
        student_lengths=np.array([d["s_end"].size for d in docs]),
        teacher_start=np.zeros(0),
        teacher_end=cat("t_end"),
        teacher_lengths=np.array([d["t_end"].size for d in docs]),
        teacher_loss=cat("loss").astype(np.float32),
        text_lengths=np.array([len(d["text"]) for d in docs]),
        map_start=np.zeros(0),
        map_end=np.zeros(0),
        teacher_columns={"space_logprob": cat("space").astype(np.float16)},
    )
    for doc in docs:  # the reference reads what the cache holds
        doc["loss"] = doc["loss"].astype(np.float32).astype(np.float64)
        doc["space"] = doc["space"].astype(np.float16).astype(np.float64)
    return read, docs


def reference_chunks(doc: dict, merge: bool, append: bool) -> list[dict]:
    """The chunks of one document by the definitions, one token at a time."""
    s_end = np.maximum.accumulate(doc["s_end"])
    t_end = np.maximum.accumulate(doc["t_end"])
    common = sorted(set(s_end.tolist()) & set(t_end.tolist()))
    raw = []
    for k, boundary in enumerate(common):
        low = common[k - 1] if k else -1
        raw.append(
            dict(
                student=[i for i in range(len(s_end)) if low < s_end[i] <= boundary],
                teacher=[j for j in range(len(t_end)) if low < t_end[j] <= boundary],
            )
        )
    tail_s = [i for i in range(len(s_end)) if s_end[i] > common[-1]]
    tail_t = [j for j in range(len(t_end)) if t_end[j] > common[-1]]
    if tail_s or tail_t:
        raw.append(dict(student=tail_s, teacher=tail_t))
    merged, current = [], None
    for chunk in raw:
        if current is None:
            current = dict(student=[], teacher=[])
        current["student"] += chunk["student"]
        current["teacher"] += chunk["teacher"]
        last = chunk["teacher"][-1] if chunk["teacher"] else None
        space = math.nan
        if last is not None and last + 1 < len(t_end):
            space = doc["space"][last + 1]
        current["space"] = space
        if not (merge and math.exp(space) <= THRESHOLD):  # NaN: a boundary
            merged.append(current)
            current = None
    if current is not None:
        merged.append(current)
    for chunk in merged:
        unscored = (
            0 in chunk["student"]
            or len(s_end) - 1 in chunk["student"]
            or len(t_end) - 1 in chunk["teacher"]
            or not chunk["student"]
            or not chunk["teacher"]
            or any(math.isnan(doc["loss"][j]) for j in chunk["teacher"])
            or (append and math.isnan(chunk["space"]))
        )
        chunk["kept"] = not unscored
        chunk["teacher_logp"] = -sum(doc["loss"][j] for j in chunk["teacher"])
        if append:
            chunk["teacher_logp"] += chunk["space"]
    return merged


def reference_alm(docs, logits, labels, merge: bool, append: bool) -> tuple[float, int]:
    """(sum of binary_ce over the chunks the micro-batch trains on, their count). The micro-batch
    is the stream layout: student token p of the concatenated documents (p >= 1) is the target
    of row (p - 1) // W, slot (p - 1) % W."""
    width = labels.shape[1]
    logp = torch.log_softmax(logits.double(), dim=-1)
    total, count, offset = 0.0, 0, 0
    for doc in docs:
        for chunk in reference_chunks(doc, merge, append):
            if not chunk["kept"]:
                continue
            places = [divmod(offset + i - 1, width) for i in chunk["student"]]
            rows = {r for r, _ in places}
            if offset + chunk["student"][0] < 1 or len(rows) > 1:
                continue
            if any(labels[r, s] == IGNORE_INDEX for r, s in places):
                continue
            row, last = places[-1]
            if append and last + 1 >= width:
                continue
            student = sum(float(logp[r, s, labels[r, s]]) for r, s in places)
            if append:
                student += float(torch.logsumexp(logp[row, last + 1, SPACE_IDS], dim=0))
            t = chunk["teacher_logp"] / TEMPERATURE - 1e-6
            s = student / TEMPERATURE - 1e-6
            total += -(math.exp(t) * s + (1 - math.exp(t)) * math.log(1 - math.exp(s)))
            count += 1
        offset += len(doc["s_end"])
    return total, count


def stream_batch(read: AlignedRead, extras: dict, width: int, context: tuple[int, int]):
    """The documents as one token stream cut into rows of `width` targets (stage 2's stream
    packing); the slots in `context` (row, count) are made context: no label, fill extras."""
    ids = read.student_ids.astype(np.int64)
    rows = -(-(ids.size - 1) // width)
    labels = np.full(rows * width, IGNORE_INDEX)
    labels[: ids.size - 1] = ids[1:]
    out = {}
    for name, values in extras.items():
        padded = np.full(rows * width, fill_value(values.dtype), dtype=values.dtype)
        padded[: ids.size - 1] = values[1:]
        out[name] = padded.reshape(rows, width)
    labels = labels.reshape(rows, width)
    row, count = context
    labels[row, :count] = IGNORE_INDEX
    for name in out:
        out[name][row, :count] = fill_value(out[name].dtype)
    return torch.from_numpy(labels), {k: torch.from_numpy(v) for k, v in out.items()}


MODES = ["merge_by_space_prob+append_space", "merge_by_space_prob", "append_space", "naive"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("width,context", [(7, (1, 0)), (8, (1, 2)), (30, (0, 0))])
def test_alm_loss_equals_a_plain_loop_over_chunks(mode, width, context):
    read, docs = make_read()
    alm = AlmDistillation(1.0, TEMPERATURE, THRESHOLD, mode, space_mask=SPACE_MASK)
    labels, extras = stream_batch(read, alm.extras(read), width, context)
    logits = torch.randn(*labels.shape, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    merge, append = "merge" in mode, "append" in mode
    expected, count = reference_alm(docs, logits, labels, merge, append)
    assert count >= 2 and int(alm.units(labels, extras)) == count
    logits.requires_grad_()
    reads = alm.reads(extras, vocabulary_subset_on(alm, DEVICE))
    got = alm.loss_sum(head_outputs(logits, labels, reads), labels, extras)
    assert abs(float(got.detach()) - expected) <= 1e-5 * max(1.0, abs(expected))
    got.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_the_hand_made_chunks_merge_split_bytes_and_leave_out_first_and_last():
    read, docs = make_read()
    chunks = reference_chunks(docs[0], merge=True, append=True)
    student = [c["student"] for c in chunks]
    # BOS h é é | llo | " w" ö ö rld (merged: p(space after " wö") = 0.05) | "," " ok" | " then" EOS
    assert student == [[0, 1, 2, 3], [4], [5, 6, 7, 8], [9, 10], [11, 12]]
    assert [c["kept"] for c in chunks] == [False, True, True, True, False]
    alm = AlmDistillation(1.0, TEMPERATURE, THRESHOLD, MODES[0], space_mask=SPACE_MASK)
    extras = alm.extras(read)
    first = slice(0, docs[0]["s_end"].size)
    assert extras[INDEX][first].tolist() == [-1] * 4 + [0, 0, 1, 2, 3, 0, 1, -1, -1]
    closes = np.flatnonzero(~np.isnan(extras[TEACHER][first]))
    assert closes.tolist() == [4, 8, 10]
    # tokenkit would keep the first chunk without its unscored term; we leave it out (docs/alm.md)
    assert np.isclose(extras[TEACHER][4], -docs[0]["loss"][1] + docs[0]["space"][2], atol=1e-5)


# --- the mode end to end: a real cache, the real data path and trainer ---------------------------


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("caches")
    for name, space in (("space", True), ("plain", False)):
        build_cache(root / name, num_documents=16, docs_per_shard=8, space_logprob=space)
    return {"space": root / "space", "plain": root / "plain"}


def alm_args(cache: Path, out: Path, *extra: str) -> list[str]:
    return train_args(cache, out, "--guidance", "alm", "--global-batch-tokens", "64", *extra)


def metric_lines(out: Path) -> list[dict]:
    """Every field of metrics.jsonl but the timings."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in RATE_FIELDS} for r in lines]


@pytest.mark.slow  # three runs: about a minute on a shared 2-core machine
def test_alm_trains_and_resumes_bit_for_bit(caches, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    args = ("--num-workers", "2", "--alm-weight", "0.5")
    assert main(alm_args(caches["space"], whole, *args)) == 0
    assert main(alm_args(caches["space"], parts, *args, "--stop-at-step", "3")) == 0
    assert main(alm_args(caches["space"], parts, *args)) == 0
    records = metric_lines(whole)
    assert records == metric_lines(parts)
    assert all(math.isfinite(r["distill_loss"]) and r["distill_loss"] > 0 for r in records)
    assert all(r["kept_fraction"] == 1.0 for r in records)  # the cross-entropy on every token
    saved = json.loads((whole / "config.json").read_text())
    assert saved["alm_weight"] == 0.5 and saved["alm_mode"] == "merge_by_space_prob+append_space"
    assert saved["alm_temperature"] == 100.0 and saved["alm_merge_threshold"] == 0.1


def test_the_chunked_pass_trains_what_the_full_logits_do(caches, tmp_path):
    """--loss-kernel chunked (auto's choice on a GPU): the space mask's log-probability and the
    cross-entropy from the chunked pass train the run the plain pass trains, within float32
    rounding."""
    args = ("--num-workers", "0", "--max-steps", "3")
    runs = {}
    for kernel in ("plain", "chunked"):
        out = tmp_path / kernel
        assert main(alm_args(caches["space"], out, *args, "--loss-kernel", kernel)) == 0
        runs[kernel] = metric_lines(out)
    for ours, theirs in zip(runs["chunked"], runs["plain"], strict=True):
        for key in ("loss", "grad_norm", "distill_loss"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (key, ours, theirs)


def test_a_cache_without_space_logprob_is_refused_unless_naive(caches, tmp_path, capsys):
    assert main(alm_args(caches["plain"], tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip()
    assert "--space-logprob" in err and "space_logprob" in err and "\n" not in err
    out = tmp_path / "naive"
    assert main(alm_args(caches["plain"], out, "--num-workers", "0", "--max-steps", "2",
                         "--alm-mode", "naive")) == 0  # fmt: skip
    assert all(r["distill_loss"] > 0 for r in metric_lines(out))
    config = parse_train_config(alm_args(caches["plain"], out))
    with pytest.raises(CacheError, match="score the corpus with stage 1's --space-logprob"):
        check_distillation_cache(
            config.guidance,
            config.model,
            config.guidance.distillation(config.model, {}),
            {caches["plain"]: load_manifest(caches["plain"])},
            load_tokenizer(config.model.student_tokenizer),
        )


def test_alm_decreases_on_a_repeated_batch(caches):
    config = parse_train_config(alm_args(caches["space"], Path("unused")))
    alm = config.guidance.distillation(config.model, {})
    plan = DataPlan.from_cache(caches["space"], student_tokenizer="tinyllama", seq_len=64,
                               micro_batch_size=2, distillation=alm)  # fmt: skip
    batch = next(iter(consumer_stream(plan, 0)))
    extras = {name: batch[name] for name in alm.extra_names}
    units = int(alm.units(batch["labels"], extras))
    assert units > 10
    model = build_student("llama-tiny", load_tokenizer("tinyllama"), seed=0, seq_len=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    subset = vocabulary_subset_on(alm, DEVICE)
    terms = []
    for _ in range(6):
        logits = student_logits(model, batch, torch.device("cpu"))
        student = head_outputs(logits, batch["labels"], alm.reads(extras, subset))
        term = alm.loss_sum(student, batch["labels"], extras) / units
        term.backward()
        optimizer.step()
        optimizer.zero_grad()
        terms.append(float(term.detach()))
    assert terms[-1] < 0.95 * terms[0], terms  # binary_ce at temperature 100 moves slowly


def test_the_comparison_manifests_differ_only_in_the_objective():
    from pipeline.config import from_dict, load_manifest_section, to_dict
    from stage1_score.config import ScoreConfig
    from stage2_train.config import TrainConfig

    paper = Path(__file__).resolve().parents[1] / "manifests" / "paper"
    runs = {
        mode: to_dict(
            from_dict(
                TrainConfig, load_manifest_section(paper / f"alm-comparison-{mode}.toml", "stage2")
            )
        )
        for mode in ("alm", "token", "none")
    }
    stage1 = from_dict(
        ScoreConfig, load_manifest_section(paper / "alm-comparison-alm.toml", "stage1")
    )
    assert stage1.output.space_logprob and str(stage1.output.out) == str(runs["alm"]["cache"])
    assert {mode: run["guidance"] for mode, run in runs.items()} == {m: m for m in runs}
    same = lambda run: {k: v for k, v in run.items() if k not in ("guidance", "out")}  # noqa: E731
    assert same(runs["alm"]) == same(runs["token"]) == same(runs["none"])


@pytest.mark.slow  # three 2-rank torchrun launches
def test_alm_under_torchrun_resumes_bit_for_bit_on_2_ranks(tmp_path):
    from tests.cache_fixtures import corpus_documents
    from tests.test_stage2_torchrun import finish, run_args, torchrun

    cache = tmp_path / "cache"
    build_cache(cache, documents=corpus_documents(6), docs_per_shard=3, space_logprob=True)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    alm = ("--guidance", "alm")
    first = [
        torchrun(run_args(cache, whole, *alm)),
        torchrun(run_args(cache, parts, *alm, "--stop-at-step", "4")),
    ]
    for process in first:
        finish(process)
    finish(torchrun(run_args(cache, parts, *alm)))
    records = metric_lines(whole)
    assert len(records) == 8 and records == metric_lines(parts)
    assert all(r["distill_loss"] > 0 for r in records)
    assert json.loads((whole / "config.json").read_text())["world_size"] == 2
