"""Put the student on this rank's device, checkpoint and compile its layers, and wrap it for data
parallelism (DDP or FSDP2), plus the few helpers the loop needs around the wrapper: gradient-sync control,
autocast, full state."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.choices import on_device
from pipeline.errors import ConfigError
from pipeline.models.layers import compile_layers, decoder_layers
from stage2_train.config import TrainConfig
from stage2_train.distributed import Runtime


def resolve_fsdp_param_dtype(config: TrainConfig, device: torch.device) -> str:
    """`bfloat16` or `float32` for `--fsdp-param-dtype` (float32 without --fsdp: the parameters
    as they are); an explicit bfloat16 without --fsdp is refused."""
    if not config.fsdp:
        if config.fsdp_param_dtype == "bfloat16":
            raise ConfigError(
                "--fsdp-param-dtype bfloat16 applies to --fsdp; add --fsdp or drop it"
            )
        return "float32"
    return on_device(
        config.fsdp_param_dtype, device, gpu=compute_dtype(device, config.dtype), cpu="float32"
    )


def wrap(
    model: nn.Module, runtime: Runtime, fsdp: bool, compile_student: str, param_dtype: str
) -> nn.Module:
    """Move to the device, compile its layers if asked (`resolve_compile`); DDP across ranks, or
    FSDP (per decoder layer, then the root) gathering its parameters in `param_dtype`
    (`resolve_fsdp_param_dtype`) and reducing gradients in float32."""
    model = model.to(runtime.device)
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


def compute_dtype(device: torch.device, dtype: str) -> str:
    """What `--dtype` computes in on `device`: bfloat16 (autocast) or float32."""
    if dtype == "bfloat16" and device.type != "cuda":
        raise ConfigError("--dtype bfloat16 needs a GPU; on CPU use --dtype float32 (or auto)")
    return on_device(dtype, device, gpu="bfloat16", cpu="float32")


def autocast(runtime: Runtime, dtype: str):
    """bfloat16 autocast on GPU; CPU runs in float32."""
    if compute_dtype(runtime.device, dtype) == "bfloat16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def full_state_dict(model: nn.Module) -> dict:
    """The whole model on CPU on rank 0 (gathered from FSDP shards if sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        unwrapped(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
