"""Peak memory of this process, and of every rank, for ``metrics.jsonl``.

``peak_memory_bytes`` is the high-water mark of the device this rank trains on: on CUDA the
caching allocator's ``max_memory_allocated`` (tensors only, not the allocator's reserve or
the CUDA context), on CPU the process's peak resident set size (everything the process ever
held in RAM: tensors, the Python heap, loaded libraries). ``peak_memory_per_rank`` gathers
one number per rank so rank 0 can log them all.
"""

from __future__ import annotations

import sys

import torch

from meshtron.mpu.mappings import all_gather_stats, world_group
from meshtron.mpu.mesh import collective_device, group_size

__all__ = ["peak_memory_bytes", "peak_memory_per_rank", "format_bytes"]


def _max_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (0 where the OS cannot tell)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux (and the BSDs) report ru_maxrss in KiB; macOS reports bytes.
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory of this process on ``device``, in bytes.

    CUDA: ``torch.cuda.max_memory_allocated(device)`` (peak bytes held by tensors since the
    start or the last ``torch.cuda.reset_peak_memory_stats``). CPU (and any other device):
    the process's peak resident set size from ``resource.getrusage``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _max_rss_bytes()


def peak_memory_per_rank(device: torch.device | str, group=None) -> list[int]:
    """``peak_memory_bytes(device)`` of every rank of ``group`` (default: the world), in rank order.

    A collective: every rank of the group must call it (e.g. on the same logging steps).
    Without an initialised process group (a single process) it returns ``[own]``.
    """
    device = torch.device(device)
    own = peak_memory_bytes(device)
    group = world_group() if group is None else group
    if group_size(group) == 1:
        return [own]
    mine = torch.tensor([own], dtype=torch.int64, device=collective_device(group))  # NCCL: CUDA, gloo: CPU
    return [int(n) for n in all_gather_stats(mine, group).view(-1).tolist()]


def format_bytes(n: float | int | None) -> str:
    """``1536 -> '1.5 KiB'``, ``3 * 2**30 -> '3 GiB'``; ``None -> 'n/a'``."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
