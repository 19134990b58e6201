"""Per-token cross-entropy: the one definition of a token's loss, for the teacher's losses that
stage 1 caches (pipeline.scoring.hf) and the student's that stage 2 selects and trains on
(pipeline.guidance, stage2_train.trainer).

It is F.cross_entropy in fp32, the same computation as transformers' causal-LM loss, so a run
with every token kept trains on exactly the loss transformers reports.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a label that is no target (padding); transformers uses the same value


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[label] in fp32 for logits [..., V] and labels [...], shaped like
    `labels`; 0 where the label is IGNORE_INDEX."""
    per_token = F.cross_entropy(
        logits.float().flatten(0, -2),
        labels.flatten(),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    )
    return per_token.view(labels.shape)
