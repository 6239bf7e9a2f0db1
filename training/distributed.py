"""Process-group setup and teardown for a run, and agreement on one run directory.

Under torchrun every rank runs Hydra, and Hydra names the run dir from each rank's clock,
which can differ by a second between ranks. `agree_on_run_dir` makes every rank use rank
0's directory and removes a rank's own stray directory when it holds nothing but Hydra's
bookkeeping.
"""

from __future__ import annotations

import datetime
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.mpu.mappings import broadcast_object, world_group


@dataclass
class DistEnv:
    """Where this process sits: world size, ranks from the launcher, and its device."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launcher_env() -> tuple[int, int, int, int]:
    """(world, rank, local_rank, local_world) from torchrun's variables; (1, 0, 0, 1) without."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return world, rank, local_rank, local_world


def resolve_device(preference: str, local_rank: int) -> torch.device:
    """auto -> cuda:<local_rank> when CUDA is available, else cpu; cuda without CUDA is an error."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_preference: str, timeout_s: float = 300.0, num_threads: int | None = None) -> DistEnv:
    """Initialize the default process group when launched with WORLD_SIZE > 1 (NCCL on CUDA,
    gloo on CPU) and set the CPU thread count (cores shared by the local processes)."""
    world, rank, local_rank, local_world = launcher_env()
    device = resolve_device(device_preference, local_rank)
    if num_threads is None and "OMP_NUM_THREADS" not in os.environ:
        num_threads = max(1, (os.cpu_count() or 1) // local_world)
    if num_threads:
        torch.set_num_threads(num_threads)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(world, rank, local_rank, local_world, device)


def teardown_distributed() -> None:
    """Destroy the default process group (between Hydra multirun jobs, and at exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_HYDRA_ONLY = {".hydra", "train.log", "main.log"}


def agree_on_run_dir(local_dir: str | os.PathLike) -> Path:
    """Broadcast rank 0's run dir to all ranks; drop this rank's own dir if it differs and
    contains only Hydra's files (nothing a user could lose)."""
    local = Path(local_dir)
    group = world_group()
    if group is None:
        return local
    agreed = Path(broadcast_object(str(local), group, src=0))
    if agreed.resolve() != local.resolve() and local.is_dir():
        entries = {p.name for p in local.iterdir()}
        if entries <= _HYDRA_ONLY:
            shutil.rmtree(local, ignore_errors=True)
    agreed.mkdir(parents=True, exist_ok=True)
    return agreed
