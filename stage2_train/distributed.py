"""The process's place in a torchrun job: rank, world size, device, and the collectives of
pipeline.collectives run on its device (no-ops in a single plain process)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeline import collectives


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def start(cls) -> Runtime:
        """Join the torchrun job named by the environment (gloo on CPU, nccl on GPU), if any."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if world_size > 1:
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(minutes=30),
            )
        return cls(rank, local_rank, world_size, device)

    def stop(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def barrier(self) -> None:
        collectives.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce_sum(tensor, self.device)

    def all_gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order."""
        return collectives.all_gather_objects(obj)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack of every rank's tensor, in rank order (shape [world, ...])."""
        return collectives.all_gather(tensor, self.device)
