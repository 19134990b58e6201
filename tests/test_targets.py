"""Completion-only targets (`--targets spans|chat`, pipeline.corpus.targets): records name their
target spans or carry chat messages; bad spans get one line naming the record (or a listed skip);
the cache carries the spans; stage 2 trains, selects and counts only tokens inside them, by the
stated rule for a token on a span's edge; the evaluation's answer bits read the same spans."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cache.manifest import SkippedDocument
from pipeline.cache.rows import target_spans as read_spans
from pipeline.cache.schema import TARGET_SPANS, iter_shard_batches
from pipeline.cache.verify import verify_cache
from pipeline.corpus import Corpus, CorpusOptions
from pipeline.corpus.targets import (
    TEMPLATES,
    BadTargets,
    checked_spans,
    render_chat,
    target_tokens,
)
from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.errors import CorpusError
from pipeline.shipped import shipped_corpus
from pipeline.tokenizer import load_tokenizer
from stage2_train import forward as student_forward
from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import read_metrics, train_args


def by_definition(start, end, spans) -> np.ndarray:
    """The rule, one token at a time: a token with characters is a target when one of them is a
    span's; a token without when the character before it is."""
    inside = lambda c: any(a <= c < b for a, b in spans)  # noqa: E731
    out = []
    for s, e in zip(start, end, strict=True):
        out.append(inside(s - 1) if s == e else any(inside(c) for c in range(s, e)))
    return np.array(out, dtype=bool)


def test_a_token_is_a_target_when_a_character_of_it_lies_in_a_span():
    rng = np.random.default_rng(0)
    for _ in range(200):  # random documents of random tokens, some without characters
        docs, starts, ends, lengths, all_spans = rng.integers(1, 4), [], [], [], []
        text_lengths = rng.integers(5, 40, docs)
        for n in text_lengths:
            cuts = np.sort(rng.choice(np.arange(1, n), rng.integers(0, min(n - 1, 6)), False))
            bounds = np.concatenate(([0], cuts, [n]))
            start, end = list(bounds[:-1]), list(bounds[1:])
            for where in rng.integers(0, len(start) + 1, rng.integers(0, 3)):  # BOS/EOS-like
                at = int(start[where]) if where < len(start) else int(n)
                start.insert(where, at)
                end.insert(where, at)
            edges = np.sort(rng.choice(np.arange(n + 1), 2 * rng.integers(1, 3), False))
            all_spans.append(edges.reshape(-1, 2))
            starts += start
            ends += end
            lengths.append(len(start))
        spans = np.concatenate(all_spans)
        ours = target_tokens(
            np.array(starts), np.array(ends), np.array(lengths), text_lengths, spans,
            np.array([len(s) for s in all_spans]),
        )  # fmt: skip
        first = np.cumsum([0, *lengths])
        for d, doc_spans in enumerate(all_spans):
            a, b = first[d], first[d + 1]
            expected = by_definition(starts[a:b], ends[a:b], [tuple(s) for s in doc_spans])
            assert (ours[a:b] == expected).all()


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([[0, 50]], "target span 0 [0, 50] is outside the text (the text has 20 characters)"),
        ([[5, 3]], "target span 0 [5, 3] is reversed or empty"),
        ([[4, 4]], "target span 0 [4, 4] is reversed or empty"),
        ([[0, 10], [5, 12]], "target span 1 [5, 12] overlaps or precedes the span before it"),
        ([[10, 12], [0, 4]], "target span 1 [0, 4] overlaps or precedes the span before it"),
        ([[0, 2.5]], "target span 0 is [0, 2.5], not [start, end] integers"),
        ([], "target spans must be a non-empty list"),
        ("0-5", "target spans must be a non-empty list"),
    ],
)
def test_bad_spans_are_named(spans, message):
    with pytest.raises(BadTargets) as error:
        checked_spans(spans, 20)
    assert str(error.value).startswith(message)
    assert checked_spans([[0, 5], [5, 20]], 20) == ((0, 5), (5, 20))  # adjacent is fine


def test_chat_messages_render_with_the_assistant_turns_and_their_end_marker_as_spans():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    text, spans = render_chat(messages, TEMPLATES["chatml"])
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n6<|im_end|>\n"
    )
    assert [text[a:b] for a, b in spans] == ["4<|im_end|>", "6<|im_end|>"]
    text, spans = render_chat(messages[1:3], TEMPLATES["plain"])
    assert text == "user: 2+2?\n\nassistant: 4\n\n" and [text[a:b] for a, b in spans] == ["4"]
    with pytest.raises(BadTargets, match="no assistant message with content"):
        render_chat(messages[:2], TEMPLATES["chatml"])
    with pytest.raises(BadTargets, match="message 0 needs a string role and content"):
        render_chat([{"role": "user"}], TEMPLATES["chatml"])


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_corpus_reads_spans_and_names_a_bad_record_or_lists_it(tmp_path):
    records = [
        {"text": "Question: 1+1?\nAnswer: 2", "target_spans": [[23, 24]]},
        {"text": "Question: 2+2?\nAnswer: 4", "target_spans": [[23, 99]]},
        {"text": "Question: 3+3?\nAnswer: 6"},
    ]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(CorpusError) as error:
        list(Corpus(path, CorpusOptions(targets="spans")))
    assert str(error.value) == (
        f"{path}: record 1: target span 0 [23, 99] is outside the text (the text has 24 "
        "characters) (pass --on-bad-record skip to skip and list such records)"
    )
    items = list(Corpus(path, CorpusOptions(targets="spans", on_bad_record="skip")))
    assert items[0].target_spans == ((23, 24),) and items[0].text[23:24] == "2"
    skipped = [i for i in items if isinstance(i, SkippedDocument)]
    assert [(s.record, s.reason) for s in skipped] == [
        (1, "target span 0 [23, 99] is outside the text (the text has 24 characters)"),
        (2, "no field 'target_spans' (--targets spans)"),
    ]
    assert all(d.target_spans is None for d in Corpus(path, CorpusOptions()))  # all: as ever
    text_file = tmp_path / "t.txt"
    text_file.write_text("plain text")
    with pytest.raises(CorpusError, match="a text file has no fields to name targets in"):
        list(Corpus(text_file, CorpusOptions(targets="spans")))


def test_parquet_chat_records_render_as_json_lines_ones_do(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    messages = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]]
    pq.write_table(pa.table({"messages": messages}), tmp_path / "c.parquet")
    write_jsonl(tmp_path / "c.jsonl", [{"messages": messages[0]}])
    options = CorpusOptions(targets="chat")
    (table,), (lines,) = (list(Corpus(tmp_path / f"c.{x}", options)) for x in ("parquet", "jsonl"))
    assert (table.text, table.target_spans) == (lines.text, lines.target_spans)
    assert table.text[slice(*table.target_spans[0])] == "Hello<|im_end|>"
    # the corpus's description (the cache's identity) names the rendering; all targets: none
    described = Corpus(tmp_path / "c.jsonl", options).describe()["targets"]
    assert described["mode"] == "chat" and described["template"]["name"] == "chatml"
    assert "targets" not in Corpus(tmp_path / "c.jsonl").describe()


def answer_spans(text: str) -> tuple:
    """A GSM document's answer section, as a --targets spans record would name it."""
    start = text.index("\nAnswer:") + len("\nAnswer:")
    return ((start, len(text)),)


@pytest.fixture(scope="module")
def span_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("targets") / "cache"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=16, target_spans=answer_spans)
    return cache


def test_a_cache_carries_its_spans_and_verify_checks_them(span_cache, tmp_path):
    assert verify_cache(span_cache)[1] == []
    batch = next(iter_shard_batches(span_cache / "shard-000000.parquet", ["text", TARGET_SPANS]))
    spans, per_row = read_spans(batch)
    assert (per_row == 1).all()
    assert [tuple(s) for s in spans] == [answer_spans(t)[0] for t in batch.column("text").to_pylist()]
    bad = tmp_path / "bad"
    build_cache(bad, teacher_tokenizer="qwen2.5", num_documents=4,
                target_spans=lambda text: ((5, len(text) + 3),))  # fmt: skip
    (problem,) = verify_cache(bad)[1]
    assert "shard-000000.parquet row 0: target_spans are not ascending, non-overlapping" in problem


def test_the_data_path_labels_exactly_the_targets(span_cache):
    """Stream packing concatenates the documents: each micro-batch row is a window of the
    stream, so its labels are the stream's tokens where they are targets by the rule above
    (computed here per document from its text), IGNORE_INDEX elsewhere."""
    from stage2_train.data.documents import DocumentReader
    from stage2_train.data.plan import DataPlan
    from stage2_train.data.streams import consumer_stream
    from tests.cache_fixtures import read_cache_rows

    plan = DataPlan.from_cache(span_cache, student_tokenizer="tinyllama", seq_len=64,
                               micro_batch_size=4, packing="stream")  # fmt: skip
    assert plan.target_spans
    batch = next(iter(consumer_stream(plan, 0)))
    student, texts = load_tokenizer("tinyllama"), read_cache_rows(span_cache)
    ids, target = [], []
    for docs, _, _ in DocumentReader(plan, 0).documents():
        for doc_id, doc_ids in zip(docs.doc_ids, np.split(docs.ids, np.cumsum(docs.lengths)[:-1]), strict=True):
            text = texts[doc_id]["text"]
            encoded = student.encode_concatenated([text], add_eos=True)
            assert (encoded.ids == doc_ids).all()
            ids.append(doc_ids)
            target.append(by_definition(encoded.start, encoded.end, answer_spans(text)))
        if sum(map(len, ids)) > 4 * 64:
            break
    ids, target = np.concatenate(ids), np.concatenate(target)
    window = np.arange(4)[:, None] * 64 + np.arange(1, 65)[None, :]
    expected = np.where(target[window], ids[window], IGNORE_INDEX)
    assert (batch["labels"].numpy() == expected).all()
    assert 0.2 < target[window].mean() < 0.9  # questions are no targets, answers are


def first_batch(argv: list[str]) -> dict:
    seen = {}
    forward = student_forward.student_logits

    def watched(model, batch, device):
        seen.setdefault("batch", batch)
        return forward(model, batch, device)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(student_forward, "student_logits", watched)
        assert main(argv) == 0
    return seen["batch"]


ARGS = ("--num-workers", "0", "--global-batch-tokens", "512", "--seq-len", "256", "--max-steps", "2")


def test_stage2_selects_and_counts_targets_only(span_cache, tmp_path):
    """Document packing (the default) trains the targets of each document it packs: the same
    inputs as an all-targets cache of the same texts, its labels where they are targets; the
    selection keeps --topk of the targets, and the logged fractions count targets alone."""
    out = tmp_path / "out"
    batch = first_batch(train_args(span_cache, out, *ARGS, "--guidance", "token"))
    all_targets = tmp_path / "all"
    build_cache(all_targets, teacher_tokenizer="qwen2.5", num_documents=16)
    plain = first_batch(train_args(all_targets, tmp_path / "all-out", *ARGS, "--guidance", "token"))
    assert torch.equal(plain["input_ids"], batch["input_ids"])
    trained = batch["labels"] != IGNORE_INDEX
    assert torch.equal(batch["labels"][trained], plain["labels"][trained])
    share = trained.sum() / (plain["labels"] != IGNORE_INDEX).sum()
    assert 0.2 < share < 0.9
    ours, theirs = read_metrics(out), read_metrics(tmp_path / "all-out")
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["kept_fraction"] == pytest.approx(other["kept_fraction"], abs=0.02)
    assert ours[0]["loss_all"] != theirs[0]["loss_all"]  # the mean over other tokens
    every = tmp_path / "every"  # --no-completion-only: the spans unused, every token trained
    ignored = first_batch(train_args(span_cache, every, *ARGS, "--no-completion-only"))
    assert torch.equal(ignored["labels"], plain["labels"])
    assert json.loads((every / "config.json").read_text())["completion_only"] is False


def test_answer_bits_read_the_records_spans():
    """A chat record's answer bits are those of its assistant span, the tokens by the rule."""
    from apps.evaluation.answer_bits import answer_bits

    class Scorer:  # a loss of 1 nat per token: the bits count the answer's tokens
        def score(self, sequences):
            return [np.ones(len(s), dtype=np.float32) for s in sequences]

    tokenizer = load_tokenizer("smollm2")
    options = CorpusOptions(targets="chat")
    docs = list(Corpus(shipped_corpus("chat-eval"), options))[:3]
    result = answer_bits(Scorer(), tokenizer, [d.text for d in docs], [d.target_spans for d in docs])
    for doc, bits, characters in zip(docs, result.bits, result.characters, strict=True):
        enc = tokenizer.encode_batch([doc.text])[0]
        tokens = by_definition(enc.start, enc.end, doc.target_spans).sum()
        assert bits == pytest.approx(tokens / np.log(2))
        assert characters == sum(b - a for a, b in doc.target_spans)


def test_a_step_that_holds_no_target_logs_no_loss_and_says_so(tmp_path, capsys):
    """Only each document's last character is a target, so most 32-token steps hold none.
    Before: such a step was logged as loss 0.0, a loss no token had. It is logged with no loss
    (null), and one line says it held no target."""
    cache = tmp_path / "cache"
    build_cache(cache, teacher_tokenizer="qwen2.5", num_documents=4,
                target_spans=lambda text: ((len(text) - 1, len(text)),))  # fmt: skip
    out = tmp_path / "out"
    assert main(train_args(cache, out, "--num-workers", "0", "--max-steps", "4")) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    empty = [r["step"] for r in records if r["loss_all"] is None]
    assert empty and all(r["loss"] is None and r["kept_fraction"] is None for r in records
                         if r["step"] in empty)  # fmt: skip
    assert len(empty) < 4 and all(r["loss"] > 0 for r in records if r["step"] not in empty)
    err = capsys.readouterr().err
    for step in empty:
        assert f"stage 2: step {step} held no target token" in err
