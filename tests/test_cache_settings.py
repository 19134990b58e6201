"""CacheSettings (pipeline/cache/settings.py), the one reading of a manifest's settings: every
shape stage 1 writes, and every shape it wrote before (no optional column, a top-k cache before
the compact encoding, a sampled one before its head size was recorded), loads with the meaning
its absent keys had and writes back to the same bytes and producer fingerprint; anything stage 1
would not have written is refused in one line."""

from __future__ import annotations

import itertools
import json

import pytest

from pipeline.cache.manifest import MANIFEST_NAME, load_manifest, write_manifest
from pipeline.cache.settings import CacheSettings
from pipeline.config import parse_config
from pipeline.errors import CacheError
from pipeline.io import fingerprint, json_text
from stage1_score.config import SECTION, ScoreConfig, result_settings

WINDOWS = {"max_length": 2048, "stride": 1024, "loss_dtype": "float32", "docs_per_shard": 1000}
SPACE = {"mode": "space+tab+newline+special", "size": 49152, "sha256": "ab" * 32}
# A manifest's settings as stage 1 wrote them, with the commit that first wrote each shape, and
# what each absent key means
LEGACY = {
    "no optional column (9beed0f)": (WINDOWS, {}),
    "top-k and the space column before the compact encoding (c555be9)": (
        WINDOWS | {"topk_probs": 32, "topk_ids": True, "topk_id_dtype": "int32",
                   "space_logprob": SPACE},
        {"topk_encoding": "float16", "compact": False, "topk_mode": "top", "sampled": False},
    ),
    "top-k without ids (c555be9)": (
        WINDOWS | {"topk_probs": 8, "topk_ids": False},
        {"topk_id_dtype": None, "topk_encoding": "float16"},
    ),
    "sampled, before its head size was recorded (422273e)": (
        WINDOWS | {"topk_probs": 32, "topk_ids": True, "topk_id_dtype": "uint16",
                   "topk_mode": "sampled", "sample_seed": 3, "sample_temperature": 1.0},
        {"sampled": True, "sample_head_size": None, "sample_seed": 3},
    ),
    "target spans": (WINDOWS | {"target_spans": True}, {"target_spans": True, "topk_probs": 0}),
}  # fmt: skip


def manifest_as_written(settings: dict) -> dict:
    """A whole manifest.json of an empty cache with these settings, as stage 1 writes one."""
    producer = {
        "schema_version": 1,
        "teacher": {"name": "t", "dtype": "float32"},
        "tokenizer": {"fingerprint": "f" * 16, "vocab_size": 49152},
        "settings": settings,
        "corpus": {"documents": 0},
    }
    return producer | {
        "shards": [], "skipped": [], "software": {"torch": "2"}, "switches": {},
        "producer_fingerprint": fingerprint(producer),
        "totals": {"shards": 0, "rows": 0, "teacher_tokens": 0, "skipped": 0},
    }  # fmt: skip


@pytest.mark.parametrize("shape", LEGACY)
def test_each_shape_stage_1_wrote_loads_with_its_meaning_and_writes_back_the_same_bytes(
    tmp_path, shape
):
    settings, meaning = LEGACY[shape]
    written = json_text(manifest_as_written(settings))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / MANIFEST_NAME).write_text(written)
    manifest = load_manifest(tmp_path / "old")
    for name, value in meaning.items():
        assert getattr(manifest.settings, name) == value, name
    assert manifest.producer_fingerprint == json.loads(written)["producer_fingerprint"]
    write_manifest(tmp_path / "again", manifest)
    assert (tmp_path / "again" / MANIFEST_NAME).read_text() == written


REQUIRED = ["--teacher", "t", "--corpus", "c.jsonl", "--out", "o"]
OPTIONS = [  # each group's alternatives, every combination of them a run stage 1 accepts
    [[], ["--topk-probs", "8"], ["--topk-probs", "8", "--no-topk-ids"],
     ["--topk-probs", "8", "--topk-encoding", "float16"],
     ["--topk-probs", "8", "--topk-mode", "sampled", "--sample-seed", "5"]],
    [[], ["--space-logprob"]],
    [[], ["--targets", "spans"]],
    [[], ["--loss-dtype", "float32"]],
]  # fmt: skip


def test_what_stage_1_writes_now_reads_back_as_what_it_wrote():
    """For every combination of the options that shape the settings, the settings a manifest
    reads back are the ones stage 1 made (an option that does not apply, as the encoding of
    draws, keeps its default) and its JSON is unchanged by the reading."""
    for parts in itertools.product(*OPTIONS):
        config = parse_config(ScoreConfig, REQUIRED + sum(parts, []), "", SECTION)
        for head in (49152, 151936):
            ours = result_settings(config, 64, 32, head, SPACE if config.output.space_logprob else None)
            read = CacheSettings.from_json(json.loads(json.dumps(ours.to_json())))
            assert read == ours and read.to_json() == ours.to_json(), parts


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (WINDOWS | {"topk_probs": 8, "topk_ids": False, "topk_style": "x"},
         "hold topk_style, which this vocagno does not know"),
        (WINDOWS | {"topk_probs": "8", "topk_ids": False}, "setting topk_probs is '8', not a count"),
        (WINDOWS | {"loss_dtype": "bfloat16"}, "setting loss_dtype is 'bfloat16', not one of"),
        (WINDOWS | {"topk_probs": 8, "topk_ids": True}, "needs their topk_id_dtype"),
        (WINDOWS | {"topk_probs": 8, "topk_ids": False, "topk_encoding": "float16"},
         r"not as stage 1 writes them \(topk_encoding\)"),
        (WINDOWS | {"topk_probs": 8, "topk_ids": True, "topk_id_dtype": "uint16",
                    "topk_mode": "sampled", "sample_seed": 0, "sample_temperature": 1},
         "setting sample_temperature is 1, not a positive number"),
    ],
)  # fmt: skip
def test_settings_stage_1_would_not_write_are_refused_in_one_line(tmp_path, settings, message):
    """A key of a newer vocagno, a value of the wrong kind, or a spelling stage 1 never writes
    (it would change the fingerprint when written back) is named, not dropped."""
    (tmp_path / MANIFEST_NAME).write_text(json_text(manifest_as_written(settings)))
    with pytest.raises(CacheError, match=message) as error:
        load_manifest(tmp_path)
    assert "\n" not in str(error.value) and str(error.value).startswith(str(tmp_path))
