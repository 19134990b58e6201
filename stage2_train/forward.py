"""The student's forward pass and per-token loss for a micro-batch, by `--loss-kernel`:

- plain: the model's logits for every position, then `pipeline.distillation.student_token_loss`
  (float32 log-softmax over the whole micro-batch's logits).
- chunked: the decoder's last hidden states and the head's weight go to
  `pipeline.chunked_loss.chunked_token_loss`, which never holds more than one chunk's logits.
  It needs a model whose logits are the bare product of a bias-free linear head (the families in
  `CHUNKED_FAMILIES`), no distillation term (those read the logits themselves), and no --fsdp
  (whose sharded head weight exists whole only inside the model's forward pass).
- auto (default): chunked on a GPU where it applies, plain otherwise.

The distillation's extras of a micro-batch (`extras_of`) go to the device here too.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.chunked_loss import chunked_token_loss
from pipeline.distillation import Distillation, student_token_loss
from pipeline.errors import ConfigError
from stage2_train.attention import model_inputs, student_logits
from stage2_train.config import TrainConfig, on_device
from stage2_train.parallel import unwrapped

# transformers model types whose causal-LM logits are lm_head(hidden states) and nothing more
# (Gemma's soft-capping or Cohere's and Granite's logit scaling would be lost).
CHUNKED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def chunked_loss_blocker(config: TrainConfig, student: nn.Module) -> str | None:
    """Why the chunked loss cannot train this run, or None."""
    if config.distillation() is not None:
        return f"--guidance {config.guidance} trains a term that reads the student's whole logits"
    if config.fsdp:
        return "--fsdp shards the head's weight outside the model's forward pass"
    head = student.get_output_embeddings()
    family = student.config.model_type
    if family not in CHUNKED_FAMILIES or type(head) is not nn.Linear or head.bias is not None:
        return (
            f"a {family!r} student's logits are not known to be a bias-free linear head's "
            f"product (supported: {', '.join(CHUNKED_FAMILIES)})"
        )
    return None


def resolve_loss_kernel(config: TrainConfig, student: nn.Module, device: torch.device) -> str:
    """`chunked` or `plain` for `--loss-kernel`; a chunked that cannot apply is refused."""
    blocker = chunked_loss_blocker(config, student)
    if config.loss_kernel == "chunked" and blocker:
        raise ConfigError(f"--loss-kernel chunked: {blocker}; use --loss-kernel plain")
    return on_device(config.loss_kernel, device, gpu="plain" if blocker else "chunked", cpu="plain")


def student_forward(
    model: nn.Module,
    batch: dict,
    labels: torch.Tensor,
    subset: torch.Tensor | None,
    compute,
    loss_kernel: str,
    device: torch.device,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(logits or None when chunked, per-token loss, the subset's log-probability or None) of a
    micro-batch; the forward pass runs under `compute` (autocast)."""
    if loss_kernel == "plain":
        with compute:
            logits = student_logits(model, batch, device)
        return (logits, *student_token_loss(logits, labels, subset))
    captured = []  # the decoder's output, caught on its way to the head
    hook = unwrapped(model).get_decoder().register_forward_hook(
        lambda module, args, output: captured.append(output.last_hidden_state)
    )
    try:
        with compute:
            # the head runs on no position: its weight is used by the chunked loss instead
            none = torch.empty(0, dtype=torch.long, device=device)
            model(**model_inputs(model, batch, device), logits_to_keep=none)
            head = unwrapped(model).get_output_embeddings().weight
            return None, chunked_token_loss(captured[0], head, labels), None
    finally:
        hook.remove()


def extras_of(
    batch: dict, distillation: Distillation, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The distillation's extras of a micro-batch (pipeline.distillation), on `device`."""
    return {name: batch[name].to(device, non_blocking=True) for name in distillation.extra_names}
