"""Context-true packing (--packing documents): whole documents best-fit, every target trained
exactly once with its own document's context only, exact resume inside a split document, and a
document mask that makes a packed document's logits those of the document alone."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.distillation import AlignedRead
from pipeline.document_attention import document_mask
from pipeline.errors import ConfigError
from pipeline.models.student import build_student
from pipeline.tokenizer import load_tokenizer
from stage2_train.attention import student_logits
from stage2_train.config import parse_train_config
from stage2_train.data import document_packing
from stage2_train.data.document_packing import DocumentStream, split_context
from stage2_train.data.plan import DataPlan
from stage2_train.data.position import StreamPosition
from stage2_train.data.streams import consumer_stream
from tests.cache_fixtures import build_cache, read_cache_rows
from tests.test_stage2_data import annotate_rows


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("packing-cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=16, docs_per_shard=8)
    return path


def make_plan(cache: Path, **changes) -> DataPlan:
    settings = {"student_tokenizer": "tinyllama", "seq_len": 64, "micro_batch_size": 3, "seed": 5}
    return DataPlan.from_cache(cache, **{**settings, **changes})


def epoch_batches(plan: DataPlan) -> list[dict]:
    """Consumer 0's batches until its stream has listed every document of epoch 0."""
    got = []
    for batch in DocumentStream(plan, 0):
        got.append(batch)
        if batch["position"]["epoch"] >= 1:
            return got
    raise AssertionError("unreachable")


@pytest.mark.parametrize("seq_len", [64, 512])  # 64 splits most documents, 512 none
def test_every_target_is_trained_once_with_only_its_own_document_as_context(cache, seq_len):
    plan = make_plan(cache, seq_len=seq_len)
    got = epoch_batches(plan)
    rows = read_cache_rows(cache)
    names = [doc_id for batch in got for epoch, doc_id in batch["documents"] if epoch == 0]
    assert sorted(names) == sorted(rows)
    docs = annotate_rows([rows[name] for name in names], "tinyllama")
    bounds = np.cumsum(docs.lengths)[:-1]
    expected = {
        name: (ids, teacher)
        for name, ids, teacher in zip(
            names, np.split(docs.ids, bounds), np.split(docs.teacher_loss, bounds), strict=True
        )
    }
    trained = {name: [] for name in names}  # targets, in order, per document
    order = iter(names)
    current = None
    split = False
    for batch in got:
        segments = batch["segment_ids"].numpy()
        for segment in np.unique(segments[segments > 0]):  # pieces in stream order
            row = int(np.flatnonzero((segments == segment).any(axis=1))[0])
            where = np.flatnonzero(segments[row] == segment)
            assert where.size and np.all(np.diff(where) == 1)  # one contiguous piece
            positions = batch["position_ids"][row, where].numpy()
            np.testing.assert_array_equal(positions, np.arange(where.size))
            labels = batch["labels"][row, where].numpy()
            inputs = batch["input_ids"][row, where].numpy()
            teacher = batch["teacher_loss"][row, where].numpy()
            if current is None or len(trained[current]) == expected[current][0].size - 1:
                current = next(order, None)  # a new document starts
                if current is None:  # the stream went on into epoch 1
                    break
                context = 0
            else:  # a continuation re-reads its context without loss
                context = split_context(plan)
                split = True
            ids, loss = expected[current]
            first = len(trained[current]) - context
            np.testing.assert_array_equal(inputs, ids[first : first + where.size])
            assert np.all(labels[:context] == IGNORE_INDEX)
            assert np.all(np.isnan(teacher[:context]))
            np.testing.assert_array_equal(
                labels[context:], ids[first + 1 + context :][: where.size - context]
            )
            np.testing.assert_array_equal(
                teacher[context:], loss[first + 1 + context :][: where.size - context]
            )
            trained[current] += labels[context:].tolist()
        padding = segments == 0
        assert np.all(batch["labels"].numpy()[padding] == IGNORE_INDEX)
    # Every target of an epoch-0 document trained exactly once (the last one may go on into
    # epoch 1 only if it is the document the stream stopped in).
    for name in names[:-1]:
        assert trained[name] == expected[name][0][1:].tolist()
    assert split == any(ids.size - 1 > seq_len for ids, _ in expected.values())


def test_whole_documents_are_packed_without_splitting_short_ones(cache):
    """With a window longer than every document, each piece is a whole document (it starts at
    position 0 with the document's first target), and a micro-batch is closed only when the next
    document fits in none of its rows: every row has fewer free slots than that document has
    targets (best fit's guarantee; it bounds how empty a row can be, given the documents)."""
    plan = make_plan(cache, seq_len=512)
    got = epoch_batches(plan)
    rows = read_cache_rows(cache)
    tokenizer = load_tokenizer("tinyllama")
    for batch in got:
        assert batch["position"]["token"] == 0  # never inside a document
    for batch, following in itertools.pairwise(got):
        _, first_left_out = following["documents"][0]  # the document that closed `batch`
        targets = len(tokenizer.encode(rows[first_left_out]["text"], add_eos=True)) - 1
        assert targets <= plan.seq_len  # it fits an empty row: only full rows turned it away
        free = (batch["segment_ids"] == 0).sum(dim=1)
        assert (free < targets).all(), (free.tolist(), targets)


@pytest.mark.parametrize("seq_len", [48, 256])
def test_a_resumed_document_stream_continues_exactly(cache, seq_len):
    plan = make_plan(cache, seq_len=seq_len)
    reference = list(itertools.islice(DocumentStream(plan, 0), 12))
    for cut in (1, 4, 7):
        position = StreamPosition(**reference[cut - 1]["position"])
        resumed = list(itertools.islice(DocumentStream(plan, 0, position), 12 - cut))
        for want, got in zip(reference[cut:], resumed, strict=True):
            for key in ("input_ids", "labels", "position_ids", "segment_ids"):
                assert torch.equal(want[key], got[key]), key
            assert torch.equal(want["teacher_loss"].isnan(), got["teacher_loss"].isnan())
            assert torch.equal(want["teacher_loss"].nan_to_num(), got["teacher_loss"].nan_to_num())
            assert want["documents"] == got["documents"]
            assert want["position"] == got["position"]
    if seq_len == 48:
        assert any(batch["position"]["token"] for batch in reference)  # resumed mid-document


def test_micro_batches_do_not_depend_on_how_many_are_assembled_together(cache, monkeypatch):
    """The stream builds several micro-batches' tensors in one pass; each must be what it would
    be built alone (pieces from two reads, split documents, the segment numbering)."""
    plan = make_plan(cache, seq_len=48)
    together = list(itertools.islice(DocumentStream(plan, 0), 20))
    monkeypatch.setattr(document_packing, "ASSEMBLY_GROUP", 1)
    alone = list(itertools.islice(DocumentStream(plan, 0), 20))
    assert document_packing.ASSEMBLY_GROUP == 1 and len(together) == len(alone) == 20
    for want, got in zip(alone, together, strict=True):
        assert want.keys() == got.keys()
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.nan_to_num(), got[key].nan_to_num()), key
                assert torch.equal(value.isnan(), got[key].isnan()), key
            else:
                assert value == got[key], key


def test_the_packing_is_an_option_recorded_in_the_config(tmp_path):
    base = ["--cache", str(tmp_path), "--student", "llama-tiny", "--out", str(tmp_path / "o")]
    base += ["--max-steps", "2", "--warmup-steps", "0", "--global-batch-tokens", "8192"]
    config = parse_train_config(base)
    assert config.data.packing == "documents" and config.data.packing_context == 0.5
    assert parse_train_config([*base, "--packing", "stream"]).data.packing == "stream"
    assert config.fingerprint != parse_train_config([*base, "--packing", "stream"]).fingerprint
    with pytest.raises(ConfigError, match="packing-context"):
        parse_train_config([*base, "--packing-context", "1"])


def test_the_plan_picks_the_stream_of_its_packing(cache):
    assert "segment_ids" in next(iter(consumer_stream(make_plan(cache), 0)))
    assert "segment_ids" not in next(iter(consumer_stream(make_plan(cache, packing="stream"), 0)))


def test_the_document_mask_gives_a_packed_document_the_logits_it_has_alone():
    """Row = [doc A | doc B]: with the mask and restarted positions, B's logits equal B's logits
    alone; without them (stream packing's causal attention) they do not."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer("tinyllama")
    model = build_student("llama-tiny", tokenizer, seed=0, seq_len=64).eval()
    a = torch.randint(3, 1000, (1, 23))
    b = torch.randint(3, 1000, (1, 17))
    pad = torch.zeros(1, 24, dtype=torch.long)
    row = torch.cat((a, b, pad), dim=1)
    packed = {
        "input_ids": row,
        "segment_ids": torch.tensor([[1] * 23 + [2] * 17 + [0] * 24]),
        "position_ids": torch.cat(
            (torch.arange(23), torch.arange(17), torch.zeros(24, dtype=torch.long))
        )[None],
    }
    with torch.no_grad():
        alone = model(input_ids=b).logits[0]
        masked = student_logits(model, packed, torch.device("cpu"))[0, 23:40]
        first = model(input_ids=a).logits[0]
        masked_a = student_logits(model, packed, torch.device("cpu"))[0, :23]
        unmasked = model(input_ids=row).logits[0, 23:40]
    torch.testing.assert_close(masked, alone, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(masked_a, first, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(unmasked, alone, rtol=1e-2, atol=1e-2)


def test_the_document_mask_is_block_diagonal_and_causal():
    mask = document_mask(torch.tensor([[1, 1, 2, 2, 0]]))[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("seq_len", [64, 512])
def test_chunks_of_packed_documents_never_span_two_documents(cache, seq_len):
    """Under chunk alignment each new piece begins a chunk (a document's first target, token 1,
    is not where its first chunk begins), chunk starts sit on new targets only, and a whole
    document keeps exactly its num_chunks chunks."""
    from pipeline.chunk_selection import chunk_ids

    num_chunks = 4
    plan = make_plan(cache, seq_len=seq_len, alignment="chunk", num_chunks=num_chunks)
    for batch in epoch_batches(plan):
        start, segment = batch["chunk_start"], batch["segment_ids"]
        fresh = batch["labels"] != IGNORE_INDEX
        assert not (start & ~fresh).any()
        chunk = chunk_ids(start).view(start.shape)
        for piece in segment.unique()[1:]:
            in_piece = (segment == piece) & fresh
            first = torch.nonzero(in_piece.flatten())[0]
            assert start.flatten()[first]  # a piece's first new target opens a chunk
            # No chunk holds new targets of two pieces.
            others = fresh & (segment != piece)
            assert not set(chunk[in_piece].tolist()) & set(chunk[others].tolist())
        if seq_len == 512:  # no document is split: each keeps its chunks (tiny ones may hold
            # fewer targets than chunks)
            per_piece = [int(start[segment == p].sum()) for p in segment.unique()[1:]]
            assert all(1 <= n <= num_chunks for n in per_piece)


@dataclass(frozen=True)
class TargetEcho:
    """A distillation whose extras echo each student token: its id (1-D int) and (id, its first
    teacher token's loss) as floats (2-D), so a test can see that an extra sits beside its
    target."""

    name: str = "echo"
    cache_columns: tuple[str, ...] = ()
    extra_names: tuple[str, ...] = ("echo_id", "echo_pair")
    weight: float = 1.0

    def extras(self, read: AlignedRead) -> dict[str, np.ndarray]:
        first_loss = np.where(read.map_start >= 0, read.teacher_loss[read.map_start], np.nan)
        pair = np.stack((read.student_ids, first_loss), axis=1).astype(np.float32)
        return {"echo_id": read.student_ids.astype(np.int64), "echo_pair": pair}


@pytest.mark.parametrize("packing", ["documents", "stream"])
def test_a_distillations_extras_sit_beside_their_targets(cache, packing):
    plan = make_plan(cache, packing=packing, distillation=TargetEcho())
    stream = consumer_stream(plan, 0)
    for batch in itertools.islice(stream, 4):
        target = batch["labels"] != IGNORE_INDEX
        assert torch.equal(batch["echo_id"][target], batch["labels"][target])
        assert torch.equal(batch["echo_pair"][..., 0][target], batch["labels"][target].float())
        assert batch["echo_pair"].shape == (*batch["labels"].shape, 2)
        if packing == "documents":  # padding and context slots hold the fill values
            assert (batch["echo_id"][~target] == -1).all()
            assert batch["echo_pair"][~target].isnan().all()


def test_each_document_goes_to_the_fullest_row_with_room_best_fit_not_first_fit(tmp_path):
    """Replaying each micro-batch's placements in stream order (segments are numbered as they are
    placed): every piece sits in the row with the least free room that fits it (the first on a
    tie), and some pieces are where first fit would not have put them. Short documents of mixed
    lengths, so that rows fill unevenly and choices arise."""
    rng = np.random.default_rng(0)
    words = ["apple", "seven", "train", "is", "the", "of", "many", "books", "left", "and"]
    documents = [
        (f"doc-{i}", " ".join(rng.choice(words, rng.integers(3, 40))) + ".") for i in range(60)
    ]
    cache = tmp_path / "short"
    build_cache(cache, teacher_tokenizer="qwen2.5", documents=documents, docs_per_shard=60)
    plan = make_plan(cache, seq_len=64)
    differs = 0
    for batch in epoch_batches(plan):
        segments = batch["segment_ids"].numpy()
        free = [plan.seq_len] * len(segments)
        for segment in range(1, int(segments.max()) + 1):
            rows, slots = np.nonzero(segments == segment)
            row, length = int(rows[0]), len(slots)
            assert (rows == row).all() and slots.min() == plan.seq_len - free[row]  # appended
            fitting = [r for r, room in enumerate(free) if room >= length]
            best = min(fitting, key=lambda r: (free[r], r))
            assert row == best, (segment, free, length)
            differs += best != fitting[0]
            free[row] -= length
    assert differs > 0  # cases where first fit differs
