"""The student's per-token loss, and what the distillation terms read beside it
(pipeline.head_outputs), computed from the hidden states and a linear output head in row chunks,
so that no float32 (or any) logits of the whole micro-batch ever exist.

`pipeline.head_outputs.head_outputs` takes logits [N, V]: the head's output for every position,
copied to float32, and log-softmax keeps another float32 copy for the backward pass (at 8 x 2048
positions and a 152k vocabulary, 10 GB each). `chunked_head_outputs` takes the hidden states
[N, H] and the head's weight [V, H] instead: per chunk of rows it computes that chunk's logits,
their float32 log-sum-exp, the label's logit and whatever `HeadReads` asks for (a subset's mass,
the logits of given ids, the top k), and keeps only those per row. The backward pass recomputes
each chunk's logits from the same inputs and builds their gradient from the softmax, so memory is
one chunk's logits, not N x V.

The quantities are those of the plain pass in float32 (the loss 0 where the label is
IGNORE_INDEX); the head's matrix products, forward and backward, run in the ambient autocast
dtype, as the model's own head's do. Only a bias-free linear head qualifies (no soft-capping or
scaling of the logits); the caller checks that (stage2_train.forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.cross_entropy import IGNORE_INDEX
from pipeline.head_outputs import HeadOutputs, HeadReads, safe_ids

# Logits per chunk: 2^26 float32 values are 256 MiB (2,097 rows at a 32k vocabulary, 441 at
# 152k); larger chunks re-read the head's weight fewer times.
CHUNK_LOGITS = 1 << 26


def chunk_rows(vocabulary: int, chunk_logits: int = CHUNK_LOGITS) -> int:
    return max(1, chunk_logits // vocabulary)


class _ChunkedHeadOutputs(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, labels, subset, ids, top, rows):
        ctx.set_materialize_grads(False)  # an output nobody used gets no gradient pass
        n = labels.numel()

        def empty(*shape, dtype=torch.float32):
            return torch.empty(shape, dtype=dtype, device=hidden.device)

        loss, log_z = empty(n), empty(n)
        subset_logprob, subset_mass = (None, None) if subset is None else (empty(n), empty(n))
        at_ids = None if ids is None else empty(*ids.shape)
        top_logits, top_ids = (empty(n, top), empty(n, top, dtype=torch.long)) if top else (None, None)
        target = labels != IGNORE_INDEX
        safe = torch.where(target, labels, 0)
        tiny = torch.finfo(torch.float32).tiny
        for start in range(0, n, rows):
            part = slice(start, start + rows)
            logits = F.linear(hidden[part], weight).float()
            # pipeline.cross_entropy's arithmetic: shifted exponentials give log Z and p(S)
            shift = logits.amax(dim=-1, keepdim=True)
            exp = (logits - shift).exp_()
            total = exp.sum(dim=-1)
            log_z[part] = total.log() + shift.squeeze(-1)
            picked = logits.gather(-1, safe[part, None]).squeeze(-1)
            loss[part] = torch.where(target[part], log_z[part] - picked, 0.0)
            if subset is not None:
                in_subset = (exp @ subset).clamp(min=tiny)  # a mass under fp32's normals: the bound
                subset_logprob[part] = in_subset.log() - total.log()
                subset_mass[part] = in_subset / total
            if ids is not None:
                at_ids[part] = logits.gather(-1, ids[part])
            if top:
                top_logits[part], top_ids[part] = logits.topk(top, dim=-1)
        ctx.save_for_backward(hidden, weight, safe, target, log_z, subset, subset_mass, ids, top_ids)
        ctx.rows = rows
        return loss, log_z, subset_logprob, at_ids, top_logits

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_loss, grad_log_z, grad_subset, grad_at_ids, grad_top):
        hidden, weight, safe, target, log_z, subset, subset_mass, ids, top_ids = ctx.saved_tensors
        zero = torch.zeros_like(log_z)
        grad_loss = zero if grad_loss is None else torch.where(target, grad_loss, 0.0)
        # d/dz: loss p - onehot(label); log Z p; log p(S) p·1_S / p(S) - p; a read logit onehot
        per_total = grad_loss + (zero if grad_log_z is None else grad_log_z)
        per_subset = None
        if grad_subset is not None:
            per_total = per_total - grad_subset
            per_subset = grad_subset / subset_mass
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, log_z.numel(), ctx.rows):
            part = slice(start, start + ctx.rows)
            logits = F.linear(hidden[part], weight).float()
            probs = (logits - log_z[part, None]).exp_()
            if per_subset is None:
                grad_logits = probs.mul_(per_total[part, None])
            else:
                factor = torch.addcmul(per_total[part, None], per_subset[part, None], subset)
                grad_logits = probs.mul_(factor)
            grad_logits.scatter_add_(-1, safe[part, None], -grad_loss[part, None])
            if grad_at_ids is not None:
                grad_logits.scatter_add_(-1, ids[part], grad_at_ids[part])
            if grad_top is not None:
                grad_logits.scatter_add_(-1, top_ids[part], grad_top[part])
            # both products in the autocast dtype where one is on (custom_bwd), as the head's own
            grad_hidden[part] = grad_logits @ weight
            grad_weight += grad_logits.t() @ hidden[part]
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def chunked_head_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    reads: HeadReads,
    rows: int | None = None,
) -> HeadOutputs:
    """`pipeline.head_outputs.head_outputs(hidden @ weight.T, labels, reads)` for hidden [..., H],
    weight [V, H] and labels [...], in chunks of `rows` positions (default: `chunk_rows(V)`); log Z
    here is the log-sum-exp itself, so exact at every slot."""
    vocabulary = weight.shape[0]
    rows = rows or chunk_rows(vocabulary)
    subset = reads.subset
    if subset is not None:  # a float indicator over the whole vocabulary, as the plain pass pads it
        subset = F.pad(subset.float(), (0, vocabulary - subset.numel()))
    ids = None if reads.ids is None else safe_ids(reads.ids, vocabulary).flatten(0, -2)
    top = min(reads.top, vocabulary)
    flat = _ChunkedHeadOutputs.apply(
        hidden.flatten(0, -2), weight, labels.flatten(), subset, ids, top, rows
    )
    loss, log_z, subset_logprob, at_ids, top_logits = flat
    shape = labels.shape
    return HeadOutputs(
        loss=loss.view(shape),
        vocabulary=vocabulary,
        subset_logprob=None if subset_logprob is None else subset_logprob.view(shape),
        log_z=log_z.view(shape) if reads.normalizer else None,
        at_ids=None if at_ids is None else at_ids.view(*shape, -1),
        top=None if top_logits is None else top_logits.view(*shape, -1),
    )


def chunked_token_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """-log softmax(hidden @ weight.T)[label] in float32 for hidden [..., H], weight [V, H] and
    labels [...], shaped like `labels` (0 where the label is IGNORE_INDEX)."""
    return chunked_head_outputs(hidden, weight, labels, HeadReads(), rows).loss
