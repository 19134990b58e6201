"""Put the student on this rank's device and wrap it for data parallelism (DDP or FSDP2), plus
the few helpers the loop needs around the wrapper: gradient-sync control, autocast, full state."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from pipeline.errors import ConfigError
from stage2_train.distributed import Runtime


def wrap(model: nn.Module, runtime: Runtime, fsdp: bool) -> nn.Module:
    """Move to the device; DDP across ranks, or FSDP (per decoder layer, then the root)."""
    model = model.to(runtime.device)
    if fsdp:
        if not runtime.distributed:
            raise ConfigError(
                "--fsdp shards the student across ranks: run it under torchrun "
                "with --nproc-per-node 2 or more"
            )
        from torch.distributed.fsdp import fully_shard

        for layer in getattr(getattr(model, "model", None), "layers", []):
            fully_shard(layer)
        return fully_shard(model)
    if runtime.distributed:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    return model


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


def autocast(runtime: Runtime, dtype: str):
    """bfloat16 autocast on GPU; CPU runs in float32."""
    if dtype == "bfloat16" and runtime.device.type != "cuda":
        raise ConfigError("--dtype bfloat16 needs a GPU; on CPU use --dtype float32 (or auto)")
    if runtime.device.type == "cuda" and dtype in ("auto", "bfloat16"):
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
