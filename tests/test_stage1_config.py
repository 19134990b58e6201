"""Stage-1 options: the example manifest parses, bad values are refused, window defaults."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from pipeline.config import build_parser, declared, parse_config, replaced
from pipeline.errors import ConfigError
from stage1_score.config import SECTION, ScoreConfig, result_settings

EXAMPLE = Path(__file__).resolve().parents[1] / "manifests" / "stage1-example.toml"
REQUIRED = ["--teacher", "t", "--corpus", "c.jsonl", "--out", "o"]


def test_the_example_manifest_sets_real_options_and_documents_every_option():
    config = parse_config(ScoreConfig, ["--manifest", str(EXAMPLE)], "", SECTION)
    assert config.batching.docs_per_shard == 1000 and config.corpus.id_column == "id"
    assert config.batching.windows(None) == (512, 256)
    text = EXAMPLE.read_text()
    keys = [option.key for option in declared(ScoreConfig)]
    assert set(tomllib.loads(text)[SECTION]) <= set(keys)
    for key in keys:
        assert key in text, f"{key} is not documented in {EXAMPLE.name}"


def test_command_line_wins_over_the_manifest():
    config = parse_config(ScoreConfig, ["--manifest", str(EXAMPLE), "--stride", "100"], "", SECTION)
    assert config.batching.windows(None) == (512, 100)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--docs-per-shard", "0"], "docs_per_shard must be positive"),
        (["--max-length", "64", "--stride", "64"], r"less than max_length \(64\), not 64"),
        (["--max-length", "1"], "max_length must be at least 2"),
        (["--num-workers", "-1"], "num_workers must be 0"),
        (["--text-column", ""], "text_column must not be empty"),
        (["--vllm-gpu-memory-utilization", "1.5"], "vllm_gpu_memory_utilization"),
        (["--topk-probs", "129"], r"topk_probs must be 0 \(off\) or 1..128, not 129"),
        (["--topk-probs", "-1"], "topk_probs must be 0"),
        (["--backend", "vllm", "--space-logprob"], "--space-logprob needs --backend hf: vLLM"),
        (["--head-kernel", "triton"], "--head-kernel: invalid choice: 'triton'"),  # removed
        (["--topk-mode", "sampled"], "--topk-mode sampled draws --topk-probs K ids: give K"),
        (["--topk-mode", "sampled", "--topk-probs", "8", "--backend", "vllm"],
         "--topk-mode sampled needs --backend hf: vLLM returns the top K"),
        (["--topk-mode", "sampled", "--topk-probs", "8", "--head-kernel", "onepass"],
         "--topk-mode sampled draws from the plain head's softmax: use --head-kernel plain"),
        (["--topk-mode", "sampled", "--topk-probs", "8", "--no-topk-ids"],
         "--topk-mode sampled stores the ids it draws: drop --no-topk-ids"),
    ],
)
def test_bad_values_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(ScoreConfig, REQUIRED + extra, "", SECTION)


def test_missing_required_options_are_named():
    with pytest.raises(ConfigError, match="missing required option.s. --corpus, --out, --teacher"):
        parse_config(ScoreConfig, [], "", SECTION)


def test_window_defaults_come_from_the_teacher():
    config = parse_config(ScoreConfig, REQUIRED, "", SECTION)
    assert config.batching.windows(2048) == (2048, 1024)
    with pytest.raises(ValueError, match="pass --max-length"):
        config.batching.windows(None)
    assert result_settings(config, 2048, 1024).to_json() == {
        "max_length": 2048,
        "stride": 1024,
        "loss_dtype": "float16",
        "docs_per_shard": 1000,
    }


def test_optional_columns_join_the_identity_only_when_asked_for():
    config = parse_config(ScoreConfig, REQUIRED, "", SECTION)
    output = config.output
    assert output.topk_probs == 0 and output.topk_ids and not output.space_logprob
    plain = result_settings(config, 64, 32, 49152, {"sha256": "x"}).to_json()
    assert plain == result_settings(config, 64, 32).to_json()  # no new keys: old caches keep their identity
    asked = parse_config(ScoreConfig, [*REQUIRED, "--topk-probs", "8", "--space-logprob"], "", SECTION)
    settings = result_settings(asked, 64, 32, 49152, {"sha256": "x"}).to_json()
    assert settings == plain | {
        "topk_probs": 8, "topk_ids": True, "topk_id_dtype": "uint16", "space_logprob": {"sha256": "x"},
        "topk_encoding": "compact",
    }  # fmt: skip
    assert result_settings(asked, 64, 32, 151936, {}).topk_id_dtype == "int32"
    no_ids = parse_config(ScoreConfig, [*REQUIRED, "--topk-probs", "8", "--no-topk-ids"], "", SECTION)
    assert result_settings(no_ids, 64, 32, 151936).to_json() == plain | {
        "topk_probs": 8, "topk_ids": False, "topk_encoding": "compact"
    }  # fmt: skip
    drawn = [*REQUIRED, "--topk-probs", "8", "--topk-mode", "sampled", "--sample-seed", "3"]
    drawn_settings = result_settings(parse_config(ScoreConfig, drawn, "", SECTION), 64, 32, 49152)
    assert drawn_settings.to_json() == plain | {
        "topk_probs": 8, "topk_ids": True, "topk_id_dtype": "uint16", "topk_mode": "sampled",
        "sample_seed": 3, "sample_temperature": 1.0, "sample_head_size": 49152,
    }  # fmt: skip
    # float16, the encoding of every top-k cache before the compact one: their settings as then
    half = [*REQUIRED, "--topk-probs", "8", "--topk-encoding", "float16"]
    half_settings = result_settings(parse_config(ScoreConfig, half, "", SECTION), 64, 32, 49152)
    assert half_settings.to_json() == plain | {
        "topk_probs": 8, "topk_ids": True, "topk_id_dtype": "uint16"
    }  # fmt: skip


# each section's field names as the option keys they are (`--teacher` is TeacherOptions' `model`)
KEYS = {(d.section, d.field.name): d.key for d in declared(ScoreConfig)}


class _Reads:
    """A ScoreConfig or one of its sections whose option reads are recorded by option key,
    methods included (they run on the proxy)."""

    def __init__(self, config, read: set[str], section: str | None = None):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_read", read)
        object.__setattr__(self, "_section", section)

    def __getattr__(self, name: str):
        member = getattr(type(self._config), name, None)
        if callable(member):
            return member.__get__(self)
        value = getattr(self._config, name)
        if dataclasses.is_dataclass(value):
            return _Reads(value, self._read, name)
        self._read.add(KEYS.get((self._section, name), name))
        return value


def test_the_options_marked_identity_are_those_the_cache_identity_reads():
    from stage1_score.identity import CACHE_IDENTITY

    read: set[str] = set()
    base = parse_config(ScoreConfig, REQUIRED, "", SECTION)
    shapes = [{}, {"topk_probs": 8}, {"topk_probs": 8, "topk_mode": "sampled"},
              {"space_logprob": True}]  # fmt: skip
    for shape in shapes:
        config = _Reads(replaced(base, **shape), read)
        result_settings(config, *config.batching.windows(2048), 49_152, {"mask": "m"})
        config.corpus_options()
    # read by plan() straight into the teacher, tokenizer and corpus records
    plan_reads = {"teacher", "teacher_revision", "dtype", "backend", "tokenizer",
                  "student_tokenizer", "corpus"}  # fmt: skip
    assert read | plan_reads == CACHE_IDENTITY
    shown = parse_help(ScoreConfig)
    for option in declared(ScoreConfig):
        mark = "[identity]" if option.key in CACHE_IDENTITY else "[run only]"
        assert mark in shown[option.key], option.key


def parse_help(cls) -> dict[str, str]:
    """Each option's --help text, by option name."""
    return {a.dest: a.help for a in build_parser(cls, "", SECTION)._actions if a.dest != "help"}
