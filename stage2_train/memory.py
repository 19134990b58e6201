"""What one rank's training step needs in memory, estimated before the student is placed: the
model's state (float32 weights, gradients and AdamW's two moments), what the compute dtype and
FSDP add around it, and a micro-batch's activations. A pure function of the student's shape and
the run's options, so that it can be checked on a CPU for any student (`StudentShape.from_config`
counts a config's parameters on the meta device, without weights). An estimate, meant to catch
runs that cannot fit, not to plan memory to the last GiB."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.chunked_loss import chunk_rows
from pipeline.models.layers import decoder_layers

# Per parameter, float32 training with AdamW: the weight, its gradient, exp_avg and exp_avg_sq.
MODEL_STATE_BYTES = 16
# DDP (without gradient_as_bucket_view) keeps a float32 bucket copy of every gradient.
DDP_BUCKET_BYTES = 4
# Bytes per target token of the logits, their softmax and its gradient (3 x float32 x vocabulary).
LOGIT_BYTES_PER_ENTRY = 12
# Per layer and token, what a 16-bit forward keeps for its backward: 34 bytes per unit of hidden
# size (Korthikanti et al., 2022, less the attention-score term no fused kernel keeps); twice
# that in float32.
ACTIVATION_BYTES_16BIT = 34
# Under checkpointing a layer keeps only its input, the float32 residual stream.
CHECKPOINTED_BYTES_PER_HIDDEN_PER_LAYER = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class StudentShape:
    parameters: int  # each shared (tied) tensor once
    largest_layer: int  # the parameters of the largest decoder layer: FSDP gathers one at a time
    outside_layers: int  # embedding, final norm, head: FSDP's root unit, whole from forward on
    vocab_size: int
    hidden_size: int
    layers: int

    @classmethod
    def of(cls, model: nn.Module) -> StudentShape:
        text = model.config.get_text_config()
        sizes = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
        total = sum(p.numel() for p in model.parameters())
        return cls(
            parameters=total,
            largest_layer=max(sizes, default=0),
            outside_layers=total - sum(sizes),
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            layers=text.num_hidden_layers,
        )

    @classmethod
    def from_config(cls, model_config) -> StudentShape:
        """The shape of a transformers config's causal LM, built on the meta device (no memory,
        no initialization): exact for any family transformers builds."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return cls.of(AutoModelForCausalLM.from_config(model_config))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by part."""

    model_state: int  # float32 weights, gradients, AdamW moments (sharded under FSDP)
    ddp_buckets: int
    compute_copies: int  # bfloat16 casts kept for the backward, FSDP's gathered parameters
    activations: int

    @property
    def total(self) -> int:
        return self.model_state + self.ddp_buckets + self.compute_copies + self.activations

    def parts(self) -> str:
        """'16.4 GiB of float32 weights, gradients and AdamW moments, ...' (the non-zero parts)."""
        named = [
            (self.model_state, "float32 weights, gradients and AdamW moments"),
            (self.ddp_buckets, "DDP's gradient buckets"),
            (self.compute_copies, "weight copies in the compute dtype"),
            (self.activations, "activations"),
        ]
        return ", ".join(f"{gib(size)} of {name}" for size, name in named if size)


def gib(size: int) -> str:
    """'16.4 GiB', or below one GiB '380 MiB'."""
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def estimate_memory(
    shape: StudentShape,
    *,
    micro_batch_size: int,
    seq_len: int,
    world_size: int,
    fsdp: bool,
    compute_dtype: str,
    fsdp_param_dtype: str,
    loss_kernel: str,
    activation_checkpointing: bool,
) -> MemoryEstimate:
    """One rank's peak of a training step. `compute_dtype` is what --dtype resolved to, and
    `fsdp_param_dtype` and `loss_kernel` what theirs resolved to."""
    shards = world_size if fsdp else 1
    copies = 0
    if fsdp:  # the root unit stays gathered from forward to backward; a layer and the next one
        copies += DTYPE_BYTES[fsdp_param_dtype] * (shape.outside_layers + 2 * shape.largest_layer)
    if compute_dtype == "bfloat16" and fsdp_param_dtype == "float32":
        copies += 2 * shape.parameters  # autocast's bfloat16 casts, held until their backward
    tokens = micro_batch_size * seq_len
    logit_rows = tokens if loss_kernel == "plain" else min(tokens, chunk_rows(shape.vocab_size))
    layer = ACTIVATION_BYTES_16BIT * DTYPE_BYTES[compute_dtype] // 2 * shape.hidden_size
    if activation_checkpointing:  # every layer's input, and one layer's activations recomputed
        per_token = CHECKPOINTED_BYTES_PER_HIDDEN_PER_LAYER * shape.hidden_size * shape.layers
        per_token += layer
    else:
        per_token = layer * shape.layers
    return MemoryEstimate(
        model_state=-(-MODEL_STATE_BYTES * shape.parameters // shards),
        ddp_buckets=DDP_BUCKET_BYTES * shape.parameters if world_size > 1 and not fsdp else 0,
        compute_copies=copies,
        activations=per_token * tokens + LOGIT_BYTES_PER_ENTRY * shape.vocab_size * logit_rows,
    )
