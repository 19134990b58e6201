"""Stage 2 data path: teacher losses land on the right student tokens, packing is exact, every
document is used once per epoch across ranks and workers, positions resume exactly, and a cache
that does not match its manifest is refused."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.cache.manifest import load_manifest
from pipeline.cache.rows import rows_index
from pipeline.cache.schema import shard_name
from pipeline.errors import CacheError, ConfigError
from pipeline.guidance import GuidanceSettings
from pipeline.tokenizer import load_tokenizer
from stage2_train.data.documents import annotate, choose_alignment
from stage2_train.data.loader import batches, make_loader
from stage2_train.data.packing import ConsumerStream
from stage2_train.data.plan import DataPlan, work_items
from stage2_train.data.position import DataState
from tests.cache_fixtures import build_cache, corpus_documents, read_cache_rows


@pytest.fixture(scope="module")
def qwen_cache(tmp_path_factory) -> Path:
    """24 documents in 3 shards, teacher tokenizer qwen2.5 (byte-level BPE, no BOS)."""
    path = tmp_path_factory.mktemp("qwen-cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=24, docs_per_shard=8)
    return path


def make_plan(cache: Path, **changes) -> DataPlan:
    settings = {
        "student_tokenizer": "tinyllama",
        "seq_len": 48,
        "micro_batch_size": 2,
        "num_chunks": 4,
        "seed": 5,
    }
    return DataPlan.from_cache(cache, **{**settings, **changes})


def overlap_oracle(student_enc, row, how: str) -> np.ndarray:
    """Per student token, by definition: aggregate the teacher range spanning every non-empty
    teacher token that shares a character with it (a slow per-token loop, as a test oracle)."""
    t_start, t_end = np.array(row["token_start"]), np.array(row["token_end"])
    loss = np.array(row["loss"], dtype=np.float64)
    out = np.full(len(student_enc), np.nan)
    for i, (s, e) in enumerate(zip(student_enc.start, student_enc.end, strict=True)):
        hits = np.flatnonzero((t_end > t_start) & (np.maximum(s, t_start) < np.minimum(e, t_end)))
        if e <= s or hits.size == 0:
            continue
        values = loss[hits.min() : hits.max() + 1]
        values = values[~np.isnan(values)]
        if values.size:
            out[i] = {"max": np.max, "mean": np.mean, "sum": np.sum}[how](values)
    return out


def annotate_rows(rows: list[dict], student: str, **kw):
    tokenizer = load_tokenizer(student)
    return annotate(
        tokenizer,
        [r["text"] for r in rows],
        np.concatenate([r["token_start"] for r in rows]).astype(np.int64),
        np.concatenate([r["token_end"] for r in rows]).astype(np.int64),
        np.concatenate([r["loss"] for r in rows]).astype(np.float32),
        np.array([len(r["loss"]) for r in rows]),
        **kw,
    )


@pytest.mark.parametrize("how", ["max", "mean", "sum"])
@pytest.mark.parametrize("student", ["tinyllama", "smollm2"])
def test_teacher_losses_land_on_the_right_student_tokens(qwen_cache, how, student):
    rows = list(read_cache_rows(qwen_cache).values())[:10]
    docs = annotate_rows(rows, student, aggregate=how)
    tokenizer = load_tokenizer(student)
    offset = 0
    for row, length in zip(rows, docs.lengths, strict=True):
        enc = tokenizer.encode(row["text"], add_eos=True)
        assert length == len(enc)
        np.testing.assert_array_equal(docs.ids[offset : offset + length], enc.ids)
        np.testing.assert_allclose(
            docs.teacher_loss[offset : offset + length], overlap_oracle(enc, row, how), rtol=1e-6
        )
        assert np.isnan(docs.teacher_loss[offset + length - 1])  # EOS has no characters
        offset += length
    assert offset == docs.ids.size
    mapped = ~np.isnan(docs.teacher_loss)
    assert mapped.mean() > 0.9  # offsets really align: almost every content token is guided


def test_rows_index_takes_rows_in_the_given_order():
    """The reader shuffles a read's rows with numpy: per-token values of rows of these lengths,
    taken in the read's order."""
    lengths = np.array([2, 0, 3])
    values = np.array([10, 11, 30, 31, 32])
    assert values[rows_index(lengths, np.array([2, 0, 1]))].tolist() == [30, 31, 32, 10, 11]
    assert values[rows_index(lengths, np.array([1, 0]))].tolist() == [10, 11]
    assert rows_index(lengths, np.array([], dtype=np.int64)).size == 0


def test_same_tokenizer_gives_identity_alignment_rho1(tmp_path):
    """Teacher and student share the tinyllama vocabulary: each student token gets exactly its
    own cached teacher loss (same-vocabulary guidance, Rho-1), byte-fallback pieces included."""
    documents = [*corpus_documents(4), ("emoji", "x 😀 and 漢字 √2 ≈ 1.41"), ("cjk", "数学 é")]
    build_cache(tmp_path, teacher_tokenizer="tinyllama", documents=documents, docs_per_shard=6)
    manifest = load_manifest(tmp_path)

    def alignment(mode: str, tokenizer: str = "tinyllama") -> str:
        fingerprint = load_tokenizer(tokenizer).fingerprint
        return choose_alignment(GuidanceSettings(mode), fingerprint, manifest.tokenizer)

    assert alignment("token") == "identity" and alignment("random") == "identity"
    assert alignment("chunk") == "chunk" and alignment("random-chunk") == "chunk"
    assert alignment("token", "mistral") == "token"
    rows = list(read_cache_rows(tmp_path).values())
    docs = annotate_rows(rows, "tinyllama", alignment="identity")
    offset = 0
    for row, length in zip(rows, docs.lengths, strict=True):
        ids = docs.ids[offset : offset + length]
        np.testing.assert_array_equal(ids[:-1], row["token_ids"])  # + the student's EOS
        np.testing.assert_array_equal(
            docs.teacher_loss[offset : offset + length - 1], np.array(row["loss"], np.float32)
        )
        assert np.isnan(docs.teacher_loss[offset + length - 1])  # EOS: no teacher token
        offset += length
    # Offsets alone would give each byte piece of 😀 the max over all four pieces.
    by_offsets = annotate_rows(rows, "tinyllama", alignment="token")
    assert not np.array_equal(
        np.nan_to_num(by_offsets.teacher_loss), np.nan_to_num(docs.teacher_loss)
    )


def equal_chunk_oracle(num_student: int, row, num_chunks: int, how: str):
    """Per student token, by definition: cut both sides into `num_chunks` runs of consecutive
    tokens, chunk c holding tokens [floor(c n / N), floor((c + 1) n / N)) of a side of n; each
    student token gets the aggregate of the scored losses of the teacher chunk with its number
    (NaN for an empty or unscored one). A slow per-token loop, as a test oracle; also returns
    the positions of the student tokens that begin a chunk."""
    loss = np.array(row["loss"], dtype=np.float64)
    num_teacher = len(loss)
    out = np.full(num_student, np.nan)
    first_tokens = []
    for i in range(num_student):
        (chunk,) = [
            c
            for c in range(num_chunks)
            if c * num_student // num_chunks <= i < (c + 1) * num_student // num_chunks
        ]
        if i == chunk * num_student // num_chunks:
            first_tokens.append(i)
        teacher = loss[chunk * num_teacher // num_chunks : (chunk + 1) * num_teacher // num_chunks]
        teacher = teacher[~np.isnan(teacher)]
        if teacher.size:
            out[i] = {"max": np.max, "mean": np.mean, "sum": np.sum}[how](teacher)
    return out, first_tokens


@pytest.mark.parametrize("how", ["max", "mean", "sum"])
@pytest.mark.parametrize("num_chunks", [4, 256])  # 256: more chunks than tokens on both sides
def test_chunk_alignment_maps_each_chunk_to_the_teacher_chunk(qwen_cache, num_chunks, how):
    rows = list(read_cache_rows(qwen_cache).values())[:4]
    docs = annotate_rows(rows, "tinyllama", alignment="chunk", num_chunks=num_chunks, aggregate=how)
    tokenizer = load_tokenizer("tinyllama")
    offset = 0
    for row, length in zip(rows, docs.lengths, strict=True):
        assert length == len(tokenizer.encode(row["text"], add_eos=True))
        expected, first_tokens = equal_chunk_oracle(int(length), row, num_chunks, how)
        np.testing.assert_allclose(docs.teacher_loss[offset : offset + length], expected, rtol=1e-6)
        # The first token of each of the document's chunks, and no other, starts a chunk.
        np.testing.assert_array_equal(
            np.flatnonzero(docs.chunk_start[offset : offset + length]), first_tokens
        )
        offset += length
    assert offset == docs.ids.size
    if num_chunks == 256:  # some student tokens fall in a teacher chunk that is empty
        assert np.isnan(docs.teacher_loss).any()
    # Token alignment: every token is its own selection unit.
    assert annotate_rows(rows, "tinyllama").chunk_start.all()


@pytest.mark.parametrize("alignment", ["token", "chunk"])
def test_packing_is_the_document_stream_cut_into_overlapping_windows(qwen_cache, alignment):
    plan = make_plan(qwen_cache, alignment=alignment)
    stream = iter(ConsumerStream(plan, 0))
    got = [next(stream) for _ in range(8)]
    order = [doc_id for batch in got for _, doc_id in batch["documents"]]
    rows = read_cache_rows(qwen_cache)
    docs = annotate_rows([rows[d] for d in order], "tinyllama", alignment=alignment, num_chunks=4)
    length, width = plan.seq_len, plan.micro_batch_size * plan.seq_len
    for k, batch in enumerate(got):
        for b in range(plan.micro_batch_size):
            first = k * width + b * length
            np.testing.assert_array_equal(batch["input_ids"][b], docs.ids[first : first + length])
            np.testing.assert_array_equal(
                batch["labels"][b], docs.ids[first + 1 : first + length + 1]
            )
            np.testing.assert_array_equal(
                batch["teacher_loss"][b], docs.teacher_loss[first + 1 : first + length + 1]
            )
            np.testing.assert_array_equal(  # chunk starts travel with their target tokens
                batch["chunk_start"][b], docs.chunk_start[first + 1 : first + length + 1]
            )
    assert (
        got[0]["input_ids"].dtype == torch.int64 and got[0]["teacher_loss"].dtype == torch.float32
    )
    # A document is listed in the batch that consumes its first token.
    starts = np.concatenate(([0], np.cumsum(docs.lengths)[:-1]))
    listed = [k for k, batch in enumerate(got) for _ in batch["documents"]]
    assert listed == [int(s // width) for s in starts]


def drain_first_epoch(plan: DataPlan, rank: int) -> list[str]:
    """Every epoch-0 document a rank's loader yields, until all its consumers are in epoch 1."""
    state = DataState.fresh(plan, rank)
    seen = []
    for batch in batches(make_loader(plan, rank, state)):
        state.observe(batch)
        seen += [doc_id for epoch, doc_id in batch["documents"] if epoch == 0]
        if all(p.epoch >= 1 for p in state.positions.values()):
            return seen
    raise AssertionError("unreachable: streams are endless")


@pytest.mark.parametrize("shards_per_cache", [3, 1])
def test_each_document_is_used_exactly_once_per_epoch_across_ranks_and_workers(
    tmp_path, shards_per_cache
):
    """The real partition for 2 ranks x 2 data-loader workers, with 3 shards and with 1 (fewer
    shards than consumers: each shard is split into row parts)."""
    docs = corpus_documents(30)
    build_cache(tmp_path, num_documents=30, docs_per_shard=30 // shards_per_cache, documents=docs)
    plan = make_plan(tmp_path, consumers=4, world_size=2, num_workers=2, seq_len=32)
    per_rank = [drain_first_epoch(plan, rank) for rank in (0, 1)]
    everything = per_rank[0] + per_rank[1]
    assert sorted(everything) == sorted(doc_id for doc_id, _ in docs)  # all, once each
    assert not set(per_rank[0]) & set(per_rank[1])


def test_epoch_order_is_a_pure_function_of_seed_and_epoch(qwen_cache):
    plan = make_plan(qwen_cache, consumers=4, world_size=2, num_workers=2)

    def assignment(plan, epoch):
        return [work_items(plan, consumer, epoch) for consumer in range(plan.consumers)]

    assert assignment(plan, 3) == assignment(
        make_plan(qwen_cache, consumers=4, world_size=2, num_workers=2), 3
    )
    assert len({str(assignment(plan, e)) for e in range(4)}) == 4  # reshuffled every epoch
    assert assignment(replace(plan, seed=6), 0) != assignment(plan, 0)
    first = [next(iter(ConsumerStream(plan, 2)))["input_ids"] for _ in range(2)]
    assert torch.equal(first[0], first[1])


def test_a_resumed_loader_continues_exactly(qwen_cache):
    """Positions saved after 3 batches (an odd count, so a different worker is next) restart two
    workers that yield exactly the batches the uninterrupted loader yielded next, also when the
    resumed one keeps a step of 9 micro-batches ready ahead (the trainer's prefetch)."""
    plan = make_plan(qwen_cache, consumers=2, num_workers=2, seq_len=40)
    state = DataState.fresh(plan, 0)
    reference = []
    for batch in itertools.islice(batches(make_loader(plan, 0, DataState.fresh(plan, 0))), 9):
        reference.append(batch)
    for batch in reference[:3]:
        state.observe(batch)
    state = DataState.from_dict(state.to_dict())
    loader = make_loader(plan, 0, state, first=3, step_micro_batches=9)
    assert loader.prefetch_factor * loader.num_workers >= 9
    resumed = list(itertools.islice(batches(loader), 6))
    for want, got in zip(reference[3:], resumed, strict=True):
        assert torch.equal(want["input_ids"], got["input_ids"])
        assert torch.equal(want["labels"], got["labels"])
        assert torch.equal(want["teacher_loss"].isnan(), got["teacher_loss"].isnan())
        assert torch.equal(want["teacher_loss"].nan_to_num(), got["teacher_loss"].nan_to_num())
        assert want["documents"] == got["documents"] and want["position"] == got["position"]


def corrupt_copy(cache: Path, dest: Path) -> Path:
    shutil.copytree(cache, dest)
    return dest


def first_batches(plan: DataPlan, count: int = 40):
    return list(itertools.islice(iter(ConsumerStream(plan, 0)), count))


def test_a_flipped_byte_is_refused_naming_the_shard(qwen_cache, tmp_path):
    cache = corrupt_copy(qwen_cache, tmp_path / "cache")
    shard = cache / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=f"{shard_name(1)}.*sha256"):
        first_batches(make_plan(cache))


def test_a_truncated_or_missing_shard_is_refused(qwen_cache, tmp_path):
    cache = corrupt_copy(qwen_cache, tmp_path / "cache")
    shard = cache / shard_name(2)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CacheError, match=f"{shard_name(2)}.*bytes"):
        first_batches(make_plan(cache))
    shard.unlink()
    with pytest.raises(CacheError, match=f"{shard_name(2)}.*missing"):
        first_batches(make_plan(cache))


def test_text_that_does_not_match_its_hash_is_refused(tmp_path):
    docs = corpus_documents(4)
    build_cache(tmp_path, documents=docs, docs_per_shard=4)
    # A shard whose manifest checksum is right but whose row lies about its text.
    import pyarrow.parquet as pq

    from pipeline.cache.manifest import ShardRecord, write_manifest
    from pipeline.cache.schema import TEXT, read_shard_metadata, write_shard

    path = tmp_path / shard_name(0)
    table = pq.read_table(path)
    texts = table.column(TEXT).to_pylist()
    texts[2] = texts[2].replace("Question", "Puzzle")
    table = table.set_column(table.schema.get_field_index(TEXT), TEXT, [texts])
    size, digest = write_shard(path, table, read_shard_metadata(path))
    manifest = load_manifest(tmp_path)
    manifest.shards = [
        ShardRecord(0, shard_name(0), 4, manifest.shards[0].teacher_tokens, size, digest)
    ]
    write_manifest(tmp_path, manifest)
    with pytest.raises(CacheError, match="text_sha256"):
        first_batches(make_plan(tmp_path))


def test_a_worker_error_reaches_the_trainer_as_itself(qwen_cache, tmp_path):
    cache = corrupt_copy(qwen_cache, tmp_path / "cache")
    (cache / shard_name(0)).unlink()
    plan = make_plan(cache, num_workers=1)
    with pytest.raises(CacheError, match="missing"):  # (documents packing at seq_len 48 splits
        # most documents, re-reading half a window of context: it needs more batches per shard)
        list(itertools.islice(batches(make_loader(plan, 0, DataState.fresh(plan, 0))), 400))


def test_every_consumer_gets_documents_or_the_plan_is_refused(tmp_path):
    build_cache(tmp_path, num_documents=9, docs_per_shard=8)  # shards of 8 and 1 rows
    plan = make_plan(tmp_path, consumers=4, world_size=2, num_workers=2)
    for epoch in range(20):
        for consumer in range(plan.consumers):
            assert work_items(plan, consumer, epoch)
    with pytest.raises(CacheError, match="9 documents, fewer than the 10 data consumers"):
        make_plan(tmp_path, consumers=10, world_size=2, num_workers=5)


def step_documents(plan: DataPlan, steps: range, per_step: int, states: list[DataState]):
    """The documents each global step of `per_step` micro-batches begins, over all ranks (as the
    trainer deals them: `per_step // world` micro-batches per rank), and the ranks' states."""
    accumulation = per_step // plan.world_size
    streams = [
        batches(make_loader(plan, rank, states[rank], (steps.start - 1) * accumulation))
        for rank in range(plan.world_size)
    ]
    found = []
    for _ in steps:
        documents = []
        for rank, stream in enumerate(streams):
            for batch in itertools.islice(stream, accumulation):
                states[rank].observe(batch)
                documents += [tuple(d) for d in batch["documents"]]
        found.append(sorted(documents))
    return found, states


def test_each_step_reads_the_same_documents_on_any_world_size_and_after_a_reshard(qwen_cache):
    """4 consumers, 4 micro-batches per step: a step's documents do not depend on ranks or
    workers, and positions saved on 4 ranks continue on 2 (and 2 on 4, and 1) reading exactly the
    documents the uninterrupted run reads next, none twice, none lost."""

    def plan(world, workers=1):
        return make_plan(qwen_cache, consumers=4, world_size=world, num_workers=workers)

    def fresh(p):
        return [DataState.fresh(p, rank) for rank in range(p.world_size)]

    whole, _ = step_documents(plan(4), range(1, 9), 4, fresh(plan(4)))
    assert sum(len(d) for d in whole) > 8  # every step began documents
    for world, workers in ((2, 2), (1, 2), (1, 0), (4, 0)):
        assert step_documents(plan(world, workers), range(1, 9), 4, fresh(plan(world)))[0] == whole
    for before, after in ((4, 2), (2, 4), (4, 1)):
        first, states = step_documents(plan(before), range(1, 4), 4, fresh(plan(before)))
        saved = [DataState.from_dict(s.to_dict()) for s in states]
        taken = [DataState.take(plan(after), rank, saved) for rank in range(after)]
        rest, _ = step_documents(plan(after, 2), range(4, 9), 4, taken)
        assert first + rest == whole, (before, after)


def test_a_world_size_that_does_not_divide_the_consumers_is_refused(qwen_cache):
    with pytest.raises(ConfigError, match=r"--data-consumers \(4\) must be a multiple of the "):
        make_plan(qwen_cache, consumers=4, world_size=3)
    assert make_plan(qwen_cache, consumers=4, world_size=2, num_workers=3).workers == 2
