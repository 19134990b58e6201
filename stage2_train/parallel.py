"""Put the student on this rank's device, checkpoint and compile its layers, and wrap it for data
parallelism (DDP or FSDP2), plus the few helpers the loop needs around the wrapper: gradient-sync
control, full state. What each switch's `auto` means on the device: stage2_train.resolve."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.errors import ConfigError
from pipeline.models.layers import compile_layers, decoder_layers
from stage2_train.distributed import Runtime


def wrap(
    model: nn.Module,
    runtime: Runtime,
    fsdp: bool,
    compile_student: str,
    param_dtype: str,
    activation_checkpointing: bool,
) -> nn.Module:
    """Move to the device, checkpoint and compile its layers if asked; DDP across ranks, or
    FSDP (per decoder layer, then the root) gathering its parameters in `param_dtype`
    (stage2_train.resolve) and reducing gradients in float32."""
    model = model.to(runtime.device)
    if activation_checkpointing:
        checkpoint_layers(model)
    # before wrapping, as torchtitan orders it
    compile_layers(model, compile_student, "the student")
    if fsdp:
        if not runtime.distributed:
            raise ConfigError(
                "--fsdp shards the student across ranks: run it under torchrun "
                "with --nproc-per-node 2 or more"
            )
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy()  # the parameters' own float32 throughout
        if param_dtype == "bfloat16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    if runtime.distributed:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    return model


def checkpoint_layers(model: nn.Module) -> None:
    """--activation-checkpointing: each decoder layer keeps only its inputs for the backward pass,
    which runs its forward again (torch.utils.checkpoint, non-reentrant, RNG state restored).

    The checkpoint goes inside the layer, around its forward: FSDP's gathering hooks stay
    outside it, and `--compile layers`, which compiles from the layer's forward on, traces the
    checkpoint as one region it may recompute (torchtitan's order: compile(checkpoint(layer))).
    The layer keeps its class and parameter names, so checkpoints and exports do not change, and
    it applies whether or not the model is in training mode (transformers' own switch needs it).
    """
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(
            "--activation-checkpointing: the student has no decoder layers at model.layers; "
            "drop --activation-checkpointing"
        )
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward):
    # a function of its own, not a functools.partial of checkpoint: dynamo starts tracing a
    # compiled layer at its forward, and would skip torch's checkpoint (marked not to be traced)
    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if hasattr(model, "no_sync") and not enabled:  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def full_state_dict(model: nn.Module) -> dict:
    """The whole model on CPU on rank 0 (gathered from FSDP shards if sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        unwrapped(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
