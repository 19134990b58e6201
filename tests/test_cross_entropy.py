"""The cross-entropy's variants against the one definition: token_loss against F.cross_entropy,
stage 1's loss read from a log-softmax (one code path: bit for bit), and the one-pass
cross-entropy and subset log-probability (ALM's student space probability) against the two
separate computations it replaces, in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.cross_entropy import (
    IGNORE_INDEX,
    token_log_probs_and_loss,
    token_loss,
    token_loss_and_subset_logprob,
)


def separately(logits, labels, subset):
    """F.cross_entropy, and a log-sum-exp over the subset's logits minus one over all."""
    padded = F.pad(subset, (0, logits.shape[-1] - subset.numel()))
    logits = logits.float()
    space = torch.logsumexp(logits[..., padded], -1) - torch.logsumexp(logits, -1)
    return token_loss(logits, labels), space


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_subset_logprob_match_the_separate_computations(dtype):
    generator = torch.Generator().manual_seed(0)
    vocab = 50
    logits = (torch.randn(3, 7, vocab, generator=generator) * 4).to(dtype)
    labels = torch.randint(0, vocab, (3, 7), generator=generator)
    labels[0, :2] = labels[2, -1] = IGNORE_INDEX
    subset = torch.rand(vocab - 5, generator=generator) < 0.4  # shorter than the head
    weights = torch.randn(2, 3, 7, generator=generator)

    results = []
    for compute in (token_loss_and_subset_logprob, separately):
        leaf = logits.detach().clone().requires_grad_()
        loss, space = compute(leaf, labels, subset)
        ((loss * weights[0]).sum() + (space * weights[1]).sum()).backward()
        results.append((loss.detach(), space.detach(), leaf.grad.float()))
    (loss, space, grad), (loss_ref, space_ref, grad_ref) = results
    assert loss.dtype == space.dtype == torch.float32
    assert (loss[labels == IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(space, space_ref, rtol=1e-5, atol=1e-5)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 rounds the gradient it returns
    torch.testing.assert_close(grad, grad_ref, rtol=tolerance, atol=tolerance)


def test_a_subset_far_below_the_largest_logit_reads_as_the_bound_without_nan():
    logits = torch.tensor([[0.0, -200.0, -200.0, 5.0]], requires_grad=True)
    loss, space = token_loss_and_subset_logprob(
        logits, torch.tensor([3]), torch.tensor([False, True, True, False])
    )
    (loss.sum() + space.sum()).backward()
    assert -95 < float(space.detach()) < -87  # exactly: -200 + log 2 - logsumexp: about -204.3
    assert torch.isfinite(logits.grad).all()


def test_the_loss_read_from_the_log_softmax_is_the_cross_entropy():
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 9, 300, generator=generator) * 6).to(torch.bfloat16)
    labels = torch.randint(0, 300, (5, 9), generator=generator)
    log_probs, loss = token_log_probs_and_loss(logits, labels)
    # stage 1 stores the loss and reads its extra columns from the same log-softmax: the loss is
    # exactly minus the label's log-probability there, and the log-softmax is torch's own
    picked = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(loss, picked)
    reference_log_probs = F.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(log_probs, reference_log_probs, rtol=0, atol=3e-5)
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(5, 9))
    # F.cross_entropy, another kernel, may sum the exponentials in another order: log Z (under 25
    # here) moves by a few float32 ulps (eps x 25 = 3e-6), and the loss with it; 3e-5 allows ten
    labels[0, :3] = IGNORE_INDEX
    reference = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    loss = token_loss(logits, labels)
    torch.testing.assert_close(loss, reference.view(5, 9), rtol=0, atol=3e-5)
    assert (loss[0, :3] == 0).all()
