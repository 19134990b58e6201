"""The chunked cross-entropy (`--loss-kernel chunked`) against the one definition: the loss and
the gradients of the hidden states and the head's weight equal `token_loss` of the full logits,
for any chunk size, with ignored labels, and a tied head."""

from __future__ import annotations

import pytest
import torch

from pipeline.chunked_loss import CHUNK_LOGITS, chunk_rows, chunked_token_loss
from pipeline.cross_entropy import IGNORE_INDEX, token_loss


def inputs(generator):
    hidden = torch.randn(3, 13, 16, generator=generator)
    weight = torch.randn(500, 16, generator=generator) / 4
    labels = torch.randint(0, 500, (3, 13), generator=generator)
    labels[0, :4] = labels[2, -1] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("rows", [1, 5, 39, 100])  # 39 positions: one chunk, uneven, each alone
def test_values_and_gradients_equal_the_full_logits_path(rows):
    generator = torch.Generator().manual_seed(rows)
    hidden, weight, labels = inputs(generator)
    upstream = torch.randn(labels.shape, generator=generator)  # any use of the per-token losses
    results = []
    for compute in (
        lambda h, w: token_loss(h @ w.T, labels),
        lambda h, w: chunked_token_loss(h, w, labels, rows=rows),
    ):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = compute(h, w)
        (loss * upstream).sum().backward()
        results.append((loss.detach(), h.grad, w.grad))
    (plain_loss, plain_h, plain_w), (loss, h, w) = results
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    assert (loss[labels == IGNORE_INDEX] == 0).all()
    # float32 rounding: the log-sum-exp computed two ways, the weight's gradient summed by chunk
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, plain_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, plain_w, rtol=1e-5, atol=1e-5)


def test_a_tied_head_gets_both_gradients():
    """The head's weight is also the input embedding: its gradient is the lookup's plus the
    head's, as with the full logits."""
    generator = torch.Generator().manual_seed(1)
    _, weight, labels = inputs(generator)
    ids = torch.randint(0, 500, labels.shape, generator=generator)
    grads = []
    for compute in (
        lambda h, w: token_loss(h @ w.T, labels),
        lambda h, w: chunked_token_loss(h, w, labels, rows=7),
    ):
        w = weight.clone().requires_grad_()
        compute(torch.tanh(w[ids]), w).sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocabulary", [10, 32_000, 151_936, CHUNK_LOGITS * 2])
def test_a_chunk_is_the_most_rows_whose_logits_fit_the_budget(vocabulary):
    rows = chunk_rows(vocabulary)
    assert rows == 1 or rows * vocabulary <= CHUNK_LOGITS < (rows + 1) * vocabulary
