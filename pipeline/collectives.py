"""Collectives that are no-ops in a single plain process, for library code (guidance's global
selection) and the stage 2 runtime alike. The library never imports a stage, so they live here.

nccl only reduces and gathers GPU tensors: `device` is where the collective runs; results come
back on the tensor's own device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialized process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The elementwise sum over all ranks."""
    if rank_and_world()[1] == 1:
        return tensor
    on_device = tensor.to(device or tensor.device)
    dist.all_reduce(on_device)
    return on_device.to(tensor.device)


def all_gather(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Stack of every rank's tensor, in rank order (shape [world, ...])."""
    world = rank_and_world()[1]
    if world == 1:
        return tensor.unsqueeze(0)
    on_device = tensor.to(device or tensor.device)
    parts = [torch.empty_like(on_device) for _ in range(world)]
    dist.all_gather(parts, on_device)
    return torch.stack(parts).to(tensor.device)


def all_gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order ([obj] in a single process)."""
    world = rank_and_world()[1]
    if world == 1:
        return [obj]
    gathered = [None] * world
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if rank_and_world()[1] > 1:
        dist.barrier()
