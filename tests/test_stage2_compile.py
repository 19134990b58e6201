"""--compile layers stays compiled: a trainer step of a student deeper than torch's recompile limit
(8) compiles one graph for all its decoder layers, not one per layer. A training forward that
builds a DynamicCache (transformers' default `use_cache`) makes each compiled layer guard on its
own cache entry (`past_key_values.layers[i].is_initialized`): 8 graphs, then the recompile limit,
and the remaining layers run eagerly. Dynamo's `eager` backend keeps the test to seconds: the
graphs and guards are dynamo's, whichever backend compiles them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from stage2_train.train import main
from tests.cache_fixtures import build_cache
from tests.stage2_runs import train_args

LAYERS = 10  # past torch's recompile limit of 8 graphs per frame


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    build_cache(path, teacher_tokenizer="qwen2.5", num_documents=8, docs_per_shard=8)
    return path


def deep_student(folder: Path) -> Path:
    config = folder / "student.json"
    shape = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
             "num_key_value_heads": 2}  # fmt: skip
    config.write_text(json.dumps(shape))
    return config


def test_a_compiled_deep_student_compiles_one_graph_for_all_its_layers(
    cache, tmp_path, monkeypatch
):
    from torch._dynamo.utils import counters

    compile_module = nn.Module.compile
    monkeypatch.setattr(
        nn.Module, "compile", lambda self, **options: compile_module(self, backend="eager")
    )
    torch._dynamo.reset()  # other tests' compiled layers share the layer's code object
    counters.clear()
    args = train_args(cache, tmp_path / "out", "--compile", "layers", "--num-workers", "0",
                      "--max-steps", "2", "--data-consumers", "1")  # fmt: skip
    args[args.index("--student") + 1] = str(deep_student(tmp_path))
    assert main(args) == 0
    # 2 steps x 2 micro-batches, each [2, 32] (one shape): one graph, every frame compiled
    limit_hits = [reason for reason in counters["unimplemented"] if "recompile limit" in reason]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["frames"]["total"] == counters["frames"]["ok"] == 1, dict(counters["frames"])
    assert not limit_hits
