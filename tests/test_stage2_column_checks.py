"""Stage 2 runs the checks `vocagno cache verify` runs on every optional column it reads
(pipeline.cache.rows.check_extra_columns), on every read of every shard, in the first cache and
in each --more-caches one: a cache verify rejects never trains. Each test damages one column of a
shard and records the shard's new size and hash in the manifest (what a bug in another writer
would leave: the bytes are whole, the values wrong), so only the column checks can catch it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from apps.cli import main as vocagno
from pipeline.cache.manifest import load_manifest
from pipeline.cache.schema import SAMPLE_IDS, SAMPLE_LOGPROBS, TOPK_CODES
from pipeline.distillation.sampled import SampledKLDistillation, SampledULDistillation
from pipeline.distillation.uld import UniversalLogitDistillation
from pipeline.errors import CacheError
from stage2_train.data.plan import DataPlan
from stage2_train.data.streams import consumer_stream
from stage2_train.train import main as train
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args
from tests.test_cache_verify import rewrite_shard

K = 4


def changed(table: pa.Table, name: str, change) -> pa.Table:
    """`table` with list column `name`'s first row's first scored entry replaced by
    `change(entry)`."""
    rows = table.column(name).to_pylist()
    token = next(i for i, entry in enumerate(rows[0]) if entry is not None)
    rows[0][token] = change(rows[0][token])
    index = table.schema.get_field_index(name)
    field = table.schema.field(index)
    return table.set_column(index, field, pa.array(rows, field.type))


def first_batch(cache: Path, distillation, **settings) -> dict:
    plan = DataPlan.from_cache(cache, seq_len=32, micro_batch_size=2, distillation=distillation,
                               **{"student_tokenizer": "tinyllama", **settings})  # fmt: skip
    return next(iter(consumer_stream(plan, 0)))


@pytest.fixture(scope="module")
def compact(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("compact") / "cache"
    build_cache(cache, num_documents=4, docs_per_shard=4, topk=K, topk_encoding="compact")
    return cache


def test_compact_codes_that_decode_to_probabilities_of_one_are_refused_by_stage_2(
    compact, tmp_path, capsys
):
    """Before: verify refused them, stage 2 distilled from them (distill loss 1.10 against
    3e-5, exit 0)."""
    uld = UniversalLogitDistillation()
    first_batch(compact, uld)  # whole, the cache trains
    rewrite_shard(compact, 0, lambda t: changed(t, TOPK_CODES, lambda codes: bytes(K + 1)))
    said = "top-k mass + topk_rest is not 1"
    assert vocagno(["cache", "verify", str(compact)]) == 1
    assert said in capsys.readouterr().out
    refusal = rf"shard-000000.parquet row 0 token \d+: {re.escape(said)}"
    with pytest.raises(CacheError, match=refusal):
        first_batch(compact, uld)
    # the whole command: one line, exit 2
    args = train_args(compact, tmp_path / "out", "--guidance", "uld", "--num-workers", "0")
    assert train(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and said in err[0], err


def sampled(cache: Path) -> Path:
    build_cache(cache, num_documents=4, docs_per_shard=4, topk=K, topk_mode="sampled")
    return cache


def test_a_drawn_log_probability_above_0_is_refused_by_stage_2(tmp_path):
    """Before: verify refused it, stage 2 trained on it."""
    copy = sampled(tmp_path / "cache")
    rewrite_shard(copy, 0, lambda t: changed(t, SAMPLE_LOGPROBS, lambda v: [5.0, *v[1:]]))
    head = load_manifest(copy).settings.sample_head_size
    with pytest.raises(CacheError, match=r"row 0 token [0-9]+: sample_logprobs out of range"):
        first_batch(copy, SampledULDistillation(teacher_vocab=head))


def test_a_drawn_id_beyond_the_teachers_head_is_refused_by_verify_and_stage_2(tmp_path, capsys):
    """Before: neither checked drawn ids against the head size the cache records."""
    copy = sampled(tmp_path / "cache")
    head = load_manifest(copy).settings.sample_head_size
    rewrite_shard(copy, 0, lambda t: changed(t, SAMPLE_IDS, lambda v: [head + 3, *v[1:]]))
    said = f"{SAMPLE_IDS} out of range (below 0 or from {head:,}, the teacher's head size)"
    assert vocagno(["cache", "verify", str(copy)]) == 1
    assert said in capsys.readouterr().out
    with pytest.raises(CacheError, match=r"row 0 token \d+: " + re.escape(said)):
        first_batch(copy, SampledKLDistillation(), student_tokenizer="qwen2.5",
                    alignment="identity")  # fmt: skip
    assert np.iinfo(np.uint32).max > head + 3  # the id fits its column: only the check sees it
