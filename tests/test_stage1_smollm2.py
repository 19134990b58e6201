"""Stage 1 with the real SmolLM2-135M-Instruct teacher (prepared offline from PyPI, never a hub):
the cache's losses equal a direct forward pass and are those of a model that knows the text."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.cache.verify import verify_cache
from pipeline.corpus import Corpus, CorpusOptions
from pipeline.models.teacher_assets import prepare_smollm2_teacher
from pipeline.tokenizer import load_tokenizer
from stage1_score.run import main
from tests.stage1_helpers import SHIPPED_CORPUS, direct_losses, load_model

pytestmark = pytest.mark.slow


def test_real_teacher_scores_a_few_documents(tmp_path):
    ray = pytest.importorskip("ray")
    teacher = prepare_smollm2_teacher()
    docs = list(Corpus(SHIPPED_CORPUS, CorpusOptions(id_column="id")))[:6]
    corpus = tmp_path / "six.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in docs))
    out = tmp_path / "cache"
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        command = ["--teacher", str(teacher), "--corpus", str(corpus), "--out", str(out)]
        assert (
            main(
                [*command, "--id-column", "id", "--docs-per-shard", "3", "--loss-dtype", "float32"]
            )
            == 0
        )
    finally:
        ray.shutdown()
    manifest, problems = verify_cache(out)
    assert problems == [] and manifest.total_rows == 6
    assert manifest.teacher["architecture"]["model_type"] == "llama"
    assert manifest.settings.max_length == 8192  # SmolLM2's context, from its config
    rows = [r for s in manifest.shards for r in pq.read_table(out / s.file).to_pylist()]
    tokenizer = load_tokenizer(str(teacher))
    model = load_model(teacher)
    scored = []
    for row in rows[:2]:
        ids = tokenizer.encode(row["text"]).ids
        expected = direct_losses(model, ids)
        np.testing.assert_allclose(np.array(row["loss"], np.float32), expected, atol=1e-4, rtol=0)
    for row in rows:
        loss = np.array(row["loss"], np.float32)
        assert np.isnan(loss[0]) and np.isfinite(loss[1:]).all()
        scored.append(loss[1:])
    mean = float(np.concatenate(scored).mean())
    # A trained model reads these math word problems far better than chance (ln |V| = 10.8 nats).
    assert mean < 0.3 * math.log(tokenizer.vocab_size), mean
