"""The process's place in a torchrun job: rank, world size, device, and the collectives of
pipeline.collectives run on its device (no-ops in a single plain process)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeline import collectives
from pipeline.errors import ConfigError

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT")  # fmt: skip
FIX = (
    "run under torchrun, which sets them all, or unset "
    + ", ".join(LAUNCH_VARIABLES)
    + " to train as one process"
)


def launch_environment(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(world size, rank, local rank) from torchrun's variables, checked like a flag: one that is
    not an integer, out of range, or set without the others is a ConfigError naming it and the
    fix, before anything is written."""

    def integer(name: str, default: int) -> int:
        value = env.get(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not an integer: {FIX}") from None

    world, rank, local_rank = integer("WORLD_SIZE", 1), integer("RANK", 0), integer("LOCAL_RANK", 0)
    local_world = integer("LOCAL_WORLD_SIZE", world)
    port = integer("MASTER_PORT", 0)
    if world < 1:
        raise ConfigError(f"WORLD_SIZE={env['WORLD_SIZE']!r} must be at least 1: {FIX}")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} must be in [0, WORLD_SIZE={world}): {FIX}")
    if not 1 <= local_world <= world:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={local_world} must be in [1, WORLD_SIZE={world}]: {FIX}"
        )
    if not 0 <= local_rank < local_world:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} must be in [0, LOCAL_WORLD_SIZE={local_world}): {FIX}"
        )
    if "MASTER_PORT" in env and not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a port (1 to 65535): {FIX}")
    if world > 1:
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={world} is set but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: {FIX}"
            )
    elif "RANK" in env and "WORLD_SIZE" not in env:
        raise ConfigError(f"RANK is set but WORLD_SIZE is not: {FIX}")
    return world, rank, local_rank


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
        world_size, rank, local_rank = launch_environment(os.environ)
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
