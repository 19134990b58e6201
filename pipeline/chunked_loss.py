"""The per-token cross-entropy of a linear output head, computed from the hidden states in row
chunks, so that no float32 (or any) logits of the whole micro-batch ever exist.

`pipeline.cross_entropy.token_loss` takes logits [N, V]: the head's output for every position,
copied to float32, and log-softmax keeps another float32 copy for the backward pass (at 8 x 2048
positions and a 152k vocabulary, 10 GB each). `chunked_token_loss` takes the hidden states [N, H]
and the head's weight [V, H] instead: per chunk of rows it computes that chunk's logits, their
float32 log-sum-exp and the label's logit, and keeps only the log-sum-exp per row. The backward
pass recomputes each chunk's logits from the same inputs and builds the gradients from
softmax - onehot, so memory is one chunk's logits, not N x V.

It is the same quantity as `token_loss(hidden @ weight.T, labels)`: log Z - logit[label] in
float32, 0 where the label is IGNORE_INDEX; the head's matrix products, forward and backward, run
in the ambient autocast dtype, as the model's own head's do. Only a bias-free linear head
qualifies (no soft-capping or scaling of the logits); the caller checks that
(stage2_train.forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.cross_entropy import IGNORE_INDEX

# Logits per chunk: 2^26 float32 values are 256 MiB (2,097 rows at a 32k vocabulary, 441 at
# 152k); larger chunks re-read the head's weight fewer times.
CHUNK_LOGITS = 1 << 26


def chunk_rows(vocabulary: int, chunk_logits: int = CHUNK_LOGITS) -> int:
    return max(1, chunk_logits // vocabulary)


class _ChunkedTokenLoss(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, labels, rows):
        loss = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)
        log_total = torch.empty_like(loss)
        target = labels != IGNORE_INDEX
        safe = torch.where(target, labels, 0)
        for start in range(0, labels.numel(), rows):
            part = slice(start, start + rows)
            logits = F.linear(hidden[part], weight).float()
            log_total[part] = logits.logsumexp(dim=-1)
            picked = logits.gather(-1, safe[part, None]).squeeze(-1)
            loss[part] = torch.where(target[part], log_total[part] - picked, 0.0)
        ctx.save_for_backward(hidden, weight, safe, target, log_total)
        ctx.rows = rows
        return loss

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_loss):
        hidden, weight, safe, target, log_total = ctx.saved_tensors
        grad_loss = torch.where(target, grad_loss, 0.0)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, grad_loss.numel(), ctx.rows):
            part = slice(start, start + ctx.rows)
            logits = F.linear(hidden[part], weight).float()
            # d loss / d logits = (softmax - onehot(label)) x the loss's gradient
            grad_logits = (logits - log_total[part, None]).exp_().mul_(grad_loss[part, None])
            grad_logits.scatter_add_(-1, safe[part, None], -grad_loss[part, None])
            # both products in the autocast dtype where one is on (custom_bwd), as the head's own
            grad_hidden[part] = grad_logits @ weight
            grad_weight += grad_logits.t() @ hidden[part]
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def chunked_token_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """-log softmax(hidden @ weight.T)[label] in float32 for hidden [..., H], weight [V, H] and
    labels [...], shaped like `labels` (0 where the label is IGNORE_INDEX), in chunks of `rows`
    positions (default: `chunk_rows(V)`)."""
    rows = rows or chunk_rows(weight.shape[0])
    flat = _ChunkedTokenLoss.apply(hidden.flatten(0, -2), weight, labels.flatten(), rows)
    return flat.view(labels.shape)
