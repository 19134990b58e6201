"""The chunked pass (`--loss-kernel chunked`) against the plain one: the loss and the gradients of
the hidden states and the head's weight equal `token_loss` of the full logits, for any chunk
size, with ignored labels, and a tied head; and every read a distillation term makes (a subset's
log-probability, the logits of given ids, the top k, log Z) equals the plain pass's, values and
gradients."""

from __future__ import annotations

import pytest
import torch

from pipeline.chunked_loss import (
    CHUNK_LOGITS,
    chunk_rows,
    chunked_head_outputs,
    chunked_token_loss,
)
from pipeline.cross_entropy import IGNORE_INDEX, token_loss
from pipeline.head_outputs import HeadReads, head_outputs


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


OUTPUTS = ("loss", "subset_logprob", "log_z", "at_ids", "top")


def reads_of(name: str, labels: torch.Tensor, generator) -> HeadReads:
    """Each term's reads (pipeline.distillation): ALM a subset narrower than the vocabulary (a
    student tokenizer's space mask), KLD teacher ids with -1 and ids past the student's logits,
    ULD the top 8 and a top wider than the vocabulary."""
    if name == "subset":
        return HeadReads(subset=torch.rand(480, generator=generator) < 0.2)
    if name == "ids":
        ids = torch.randint(0, 500, (*labels.shape, 6), generator=generator)
        ids[0, 0, :2] = -1
        ids[1, 3, 4] = 512
        return HeadReads(ids=ids)
    return HeadReads(top=8 if name == "top" else 600)


@pytest.mark.parametrize("read", ["subset", "ids", "top", "top past the vocabulary"])
@pytest.mark.parametrize("rows", [5, 39])
def test_every_read_and_its_gradient_equal_the_plain_pass(read, rows):
    generator = torch.Generator().manual_seed(rows)
    hidden, weight, labels = inputs(generator)
    reads = reads_of(read, labels, generator)
    results = []
    for compute in (
        lambda h, w: head_outputs(h @ w.T, labels, reads),
        lambda h, w: chunked_head_outputs(h, w, labels, reads, rows=rows),
    ):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        outputs = compute(h, w)
        used = {name: getattr(outputs, name) for name in OUTPUTS}
        used = {name: value for name, value in used.items() if value is not None}
        if "log_z" in used:  # the plain pass's log Z is defined at targets, where terms read it
            used["log_z"] = torch.where(labels != IGNORE_INDEX, used["log_z"], 0.0)
        upstream = torch.Generator().manual_seed(0)  # a gradient arriving on every output
        objective = sum(
            (value * torch.randn(value.shape, generator=upstream)).sum() for value in used.values()
        )
        objective.backward()
        results.append(({k: v.detach() for k, v in used.items()}, h.grad, w.grad))
    (plain, plain_h, plain_w), (chunked, h, w) = results
    expected = {"subset": {"subset_logprob"}, "ids": {"at_ids", "log_z"}}.get(read, {"top", "log_z"})
    assert chunked.keys() == plain.keys() == {"loss", *expected}
    for name, value in plain.items():
        torch.testing.assert_close(chunked[name], value, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(h, plain_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, plain_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocabulary", [10, 32_000, 151_936, CHUNK_LOGITS * 2])
def test_a_chunk_is_the_most_rows_whose_logits_fit_the_budget(vocabulary):
    rows = chunk_rows(vocabulary)
    assert rows == 1 or rows * vocabulary <= CHUNK_LOGITS < (rows + 1) * vocabulary
