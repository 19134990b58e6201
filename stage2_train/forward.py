"""The student's forward pass and what its losses read of its distribution for a micro-batch
(pipeline.head_outputs: the per-token cross-entropy, and a distillation term's reads), by
`--loss-kernel`:

- plain: the model's logits for every position, then `pipeline.head_outputs.head_outputs`
  (float32 log-softmax over the whole micro-batch's logits).
- chunked: the decoder's last hidden states and the head's weight go to
  `pipeline.chunked_loss.chunked_head_outputs`, which never holds more than one chunk's logits.
  It runs inside the model's forward pass, as the decoder's output leaves it: there --fsdp's
  sharded head weight is whole, and its gradient reaches FSDP's reduce-scatter like any other.
  It needs a model whose logits are the bare product of a bias-free linear head (the families in
  `CHUNKED_FAMILIES`).
- auto (default): chunked on a GPU where it applies, plain otherwise (stage2_train.resolve).

The distillation's extras of a micro-batch (`extras_of`) go to the device here too.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.chunked_loss import chunked_head_outputs
from pipeline.distillation import Distillation
from pipeline.head_outputs import HeadOutputs, HeadReads, head_outputs
from stage2_train.attention import model_inputs, student_logits
from stage2_train.parallel import unwrapped

# transformers model types whose causal-LM logits are lm_head(hidden states) and nothing more
# (Gemma's soft-capping or Cohere's and Granite's logit scaling would be lost).
CHUNKED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def chunked_loss_blocker(student: nn.Module) -> str | None:
    """Why the chunked loss cannot train this student, or None."""
    head = student.get_output_embeddings()
    family = student.config.model_type
    if family not in CHUNKED_FAMILIES or type(head) is not nn.Linear or head.bias is not None:
        return (
            f"a {family!r} student's logits are not known to be a bias-free linear head's "
            f"product (supported: {', '.join(CHUNKED_FAMILIES)})"
        )
    return None


def student_forward(
    model: nn.Module,
    batch: dict,
    labels: torch.Tensor,
    reads: HeadReads,
    compute,
    loss_kernel: str,
    device: torch.device,
) -> HeadOutputs:
    """The per-token loss of a micro-batch and what `reads` asks for; the forward pass runs under
    `compute` (autocast)."""
    if loss_kernel == "plain":
        with compute:
            logits = student_logits(model, batch, device)
        return head_outputs(logits, labels, reads)
    head, outputs = unwrapped(model).get_output_embeddings(), []

    def on_decoder_output(module, args, output) -> None:
        # inside the model's forward pass, where an FSDP-sharded head's weight is whole
        outputs.append(chunked_head_outputs(output.last_hidden_state, head.weight, labels, reads))

    hook = unwrapped(model).get_decoder().register_forward_hook(on_decoder_output)
    try:
        with compute:
            # the head runs on no position: its weight is used by the chunked pass instead
            none = torch.empty(0, dtype=torch.long, device=device)
            model(**model_inputs(model, batch, device), logits_to_keep=none)
        return outputs[0]
    finally:
        hook.remove()


def extras_of(
    batch: dict, distillation: Distillation, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The distillation's extras of a micro-batch (pipeline.distillation), on `device`."""
    return {name: batch[name].to(device, non_blocking=True) for name in distillation.extra_names}
