"""ULD and KLD from the cached teacher top-k (pipeline/distillation/uld.py, kld.py,
docs/distillation.md): both losses by hand on small tensors and against full-vocabulary
references, the pairing of student tokens with teacher positions, and both terms driving a tiny
model towards the teacher on a repeated batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.distillation import AlignedRead
from pipeline.distillation.kld import TopkKLDistillation, topk_kl
from pipeline.distillation.topk import IDS, PROBS, REST, paired_topk
from pipeline.distillation.uld import UniversalLogitDistillation, uld_distance
from pipeline.head_outputs import head_outputs, safe_ids, valid_ids

STUDENT = torch.tensor([0.5, 0.25, 0.15, 0.10])


def logits_of(probs) -> torch.Tensor:
    return torch.as_tensor(probs, dtype=torch.float32).log()


def uld_of(logits, probs, rest) -> torch.Tensor:
    """`uld_distance` from the whole logits: what the term reads of them (the top min(K, V), log Z)."""
    top = logits.topk(min(probs.shape[-1], logits.shape[-1]), dim=-1).values
    return uld_distance(top, logits.logsumexp(-1), probs, torch.as_tensor(rest))


def kl_of(logits, probs, ids, rest) -> torch.Tensor:
    """`topk_kl` from the whole logits: what the term reads of them (the ids' logits, log Z)."""
    vocabulary = logits.shape[-1]
    at_ids = logits.gather(-1, safe_ids(ids, vocabulary))
    valid = valid_ids(ids, vocabulary)
    return topk_kl(at_ids, logits.logsumexp(-1), valid, probs, torch.as_tensor(rest))


def test_uld_is_wasserstein_1_of_sorted_top_k_plus_the_rest_by_hand():
    # student sorted top-2 = 0.5, 0.25 (rest 0.25); teacher top-2 = 0.6, 0.3 (rest 0.1)
    d = uld_of(logits_of(STUDENT), torch.tensor([0.6, 0.3]), torch.tensor(0.1))
    assert d.item() == pytest.approx(0.1 + 0.05 + 0.15, abs=1e-6)
    # order of the student's vocabulary does not matter: ranks are compared, not ids
    shuffled = uld_of(logits_of(STUDENT[[2, 0, 3, 1]]), torch.tensor([0.6, 0.3]), 0.1)
    assert shuffled.item() == pytest.approx(d.item(), abs=1e-6)
    # a student vocabulary smaller than K is padded with zeros, as ULD pads: |.7-.5|+0+|0-.2|
    small = uld_of(logits_of([0.3, 0.7]), torch.tensor([0.5, 0.3, 0.2]), torch.tensor(0.0))
    assert small.item() == pytest.approx(0.4, abs=1e-6)


def boizard_uld(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Boizard et al.'s ULD of two full distributions: sort both, pad the shorter, sum |diff|."""
    s = student.sort(dim=-1, descending=True).values
    t = teacher.sort(dim=-1, descending=True).values
    size = max(s.shape[-1], t.shape[-1])
    s, t = F.pad(s, (0, size - s.shape[-1])), F.pad(t, (0, size - t.shape[-1]))
    return (s - t).abs().sum(-1)


def test_uld_is_the_full_distance_when_k_covers_the_vocabulary_and_a_lower_bound_below():
    torch.manual_seed(0)
    logits = torch.randn(5, 12) * 2
    teacher = torch.softmax(torch.randn(5, 20) * 2, dim=-1)
    full = boizard_uld(torch.softmax(logits, -1), teacher)
    top = teacher.sort(dim=-1, descending=True).values
    exact = uld_of(logits, top, torch.zeros(5))  # K = 20 >= both vocabularies
    torch.testing.assert_close(exact, full, atol=1e-6, rtol=0)
    for k in (1, 4, 8):
        cut = uld_of(logits, top[:, :k], 1 - top[:, :k].sum(-1))
        assert (cut <= full + 1e-6).all()
        assert (cut >= (top[:, :k] - torch.softmax(logits, -1).topk(k).values).abs().sum(-1)).all()


def test_kld_is_kl_student_to_teacher_over_top_k_ids_and_the_rest_by_hand():
    # teacher top-2 ids 2 and 0 with 0.6 and 0.3, rest 0.1; student there 0.15 and 0.5, rest 0.35
    kl = kl_of(logits_of(STUDENT), torch.tensor([0.6, 0.3]), torch.tensor([2, 0]), 0.1)
    expected = 0.15 * math.log(0.15 / 0.6) + 0.5 * math.log(0.5 / 0.3) + 0.35 * math.log(3.5)
    assert kl.item() == pytest.approx(expected, abs=1e-6)
    # an id past the student's logits (a padded teacher head) joins the rest: 0.1 + 0.3
    kl = kl_of(logits_of(STUDENT), torch.tensor([0.6, 0.3]), torch.tensor([2, 7]), 0.1)
    expected = 0.15 * math.log(0.15 / 0.6) + 0.85 * math.log(0.85 / 0.4)
    assert kl.item() == pytest.approx(expected, abs=1e-6)


def test_kld_is_the_full_kl_when_k_covers_the_vocabulary_and_a_lower_bound_below():
    torch.manual_seed(1)
    logits = torch.randn(6, 10) * 2
    teacher = torch.softmax(torch.randn(6, 10) * 2, dim=-1)
    student = torch.log_softmax(logits, -1)
    full = (student.exp() * (student - teacher.log())).sum(-1)  # KL(p_S || p_T), eq. 5's order
    probs, ids = teacher.sort(dim=-1, descending=True)
    exact = kl_of(logits, probs, ids, torch.zeros(6))
    torch.testing.assert_close(exact, full, atol=1e-5, rtol=0)
    for k in (1, 3, 6):
        cut = kl_of(logits, probs[:, :k], ids[:, :k], 1 - probs[:, :k].sum(-1))
        assert (cut >= -1e-6).all() and (cut <= full + 1e-5).all()
    # a teacher bucket stored as 0 (below float16) costs a finite log-ratio
    zero = kl_of(logits, torch.tensor([[1.0, 0.0]] * 6), ids[:, :2], torch.zeros(6))
    assert torch.isfinite(zero).all()


def test_each_student_token_meets_the_teacher_position_of_its_first_aligned_token():
    # 4 teacher tokens (position 0 unscored), K = 2; student tokens map to teacher starts below
    probs = np.array([[np.nan, np.nan], [0.7, 0.2], [0.5, 0.4], [0.9, 0.05]], np.float32)
    ids = np.array([[-1, -1], [3, 1], [2, 5], [4, 0]], np.int64)
    rest = np.array([np.nan, 0.1, 0.1, 0.05], np.float32)
    map_start = np.array([-1, 0, 2, 2, 1, 3])
    empty = np.zeros(0, np.int64)
    read = AlignedRead(
        np.arange(6, dtype=np.int32), empty, empty, np.array([6]), empty, empty, np.array([4]),
        np.array([np.nan, 1, 1, 1], np.float32), np.array([20]), map_start, map_start + 1,
        {"topk_probs": probs, "topk_ids": ids, "topk_rest": rest},
    )  # fmt: skip
    extras = paired_topk(read, with_ids=True)
    assert extras[PROBS].dtype == np.float16 and extras[IDS].dtype == np.int32
    unpaired = [0, 1]  # unmapped, and the document's unscored first teacher position
    assert np.isnan(extras[PROBS][unpaired]).all() and (extras[IDS][unpaired] == -1).all()
    assert np.isnan(extras[REST][unpaired]).all()
    for student, teacher in ((2, 2), (3, 2), (4, 1), (5, 3)):
        np.testing.assert_array_equal(extras[PROBS][student], probs[teacher].astype(np.float16))
        np.testing.assert_array_equal(extras[IDS][student], ids[teacher])
        assert extras[REST][student] == np.float16(rest[teacher])
    assert UniversalLogitDistillation().extras(read).keys() == {PROBS, REST}  # ranks need no ids


def full_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(p_S || p_T) of two full distributions, eq. 5's order."""
    return (student * (student.log() - teacher.log())).sum(-1)


def descend(distillation, weight: float, distance) -> list[tuple[float, float]]:
    """Cross-entropy + weight x the term's mean over paired tokens, as the trainer forms it: 40
    Adam steps on one seeded batch. Per step: the objective, and `distance` from the student to
    the teacher's full distribution (not the cached top-k the term reads) averaged over the paired
    tokens. Unpaired tokens (NaN teacher, padding) must add nothing, not even a NaN gradient."""
    torch.manual_seed(0)
    vocab, k = 40, 8
    inputs = torch.randint(0, vocab, (2, 12))
    labels = torch.randint(0, vocab, (2, 12))
    labels[1, -3:] = -100  # padding
    teacher = torch.softmax(torch.randn(2, 12, vocab) * 3, dim=-1)
    probs, ids = teacher.topk(k, dim=-1)
    extras = {
        PROBS: probs.half(),
        IDS: ids.int(),
        REST: (1 - probs.sum(-1)).half(),
    }
    extras[PROBS][0, :2] = float("nan")  # unmapped student tokens: cross-entropy only
    extras[IDS][0, :2] = -1
    extras[REST][0, :2] = float("nan")
    units = distillation.units(labels, extras)
    assert units.item() == 24 - 3 - 2
    paired = labels != -100
    paired[0, :2] = False
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    history = []
    for _ in range(40):
        logits = model(inputs)
        student = head_outputs(logits, labels, distillation.reads(extras, None))
        term = distillation.loss_sum(student, labels, extras)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + weight * term / units
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        student = torch.softmax(logits.detach()[paired], dim=-1)
        history.append((loss.item(), distance(student, teacher[paired]).mean().item()))
    return history


# ULD at lambda 1.5 (the paper's largest). At 0.5 the term pulls a label's probability p down by
# at most 2 lambda = 1 (its rank and the rest), never more than the cross-entropy pulls it up
# (1/p): where the model can fit the label both share the one-hot optimum, and the term can only
# slow the sharpening that already shrinks its distance.
@pytest.mark.parametrize(
    ("distillation", "distance"),
    [(UniversalLogitDistillation(weight=1.5), boizard_uld), (TopkKLDistillation(), full_kl)],
    ids=["uld", "kld"],
)
def test_the_term_pulls_a_tiny_model_to_the_teacher_on_a_repeated_batch(distillation, distance):
    guided = descend(distillation, distillation.weight, distance)
    control = descend(distillation, 0.0, distance)  # the same steps on the cross-entropy alone
    assert guided[0][1] == control[0][1]  # one start: the same seeded model and batch
    assert guided[-1][0] < guided[0][0]
    # Cross-entropy alone moves the student too (sharpening shrinks ULD's distance); the term's
    # gradient must take it well past that. Required: below 70% of the control's end distance.
    # Seeds 0-7 end at 0.36-0.47 (ULD) and 0.36-0.55 (KLD) of it; a zero gradient ends at 1, a
    # wrong-signed one at 0.99-1.4.
    assert guided[-1][1] < 0.7 * control[-1][1]
