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

__all__ = [
    "peak_memory_bytes",
    "peak_memory_per_rank",
    "format_bytes",
    "held_state_bytes",
    "profiled_peak",
    "storage_bytes",
]


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


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for t in tensors:
        if torch.is_tensor(t) and t.dim() > 0:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def held_state_bytes(chunks, reducer, optimizer) -> dict[str, int]:
    """Exact bytes of weights, gradients and optimizer state held now (unique storages; under
    ZeRO-3 the parameters' full storages are empty between steps and the shards hold them)."""
    params = [p for c in chunks for p in c.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in reducer.buckets:
        grads += [getattr(bucket, "buffer", None), getattr(bucket, "shard", None)]
    state = optimizer.state.values() if hasattr(optimizer, "state") else []
    opt = [t for s in state for t in s.values() if torch.is_tensor(t)]
    main = []
    if hasattr(optimizer, "state_tensors"):  # 16-bit resident weights: fp32 main weights + moments
        main, opt = optimizer.state_tensors()
    shards = [getattr(bucket, "param_shard", None) for bucket in reducer.buckets]
    return {
        "weights": storage_bytes(params + [s for s in shards if s is not None]),
        "grads": storage_bytes(g for g in grads if g is not None),
        "optimizer": storage_bytes(opt),
        "main_params": storage_bytes(main),
    }


def profiled_peak(fn, device: torch.device) -> int:
    """High-water mark of tensor bytes allocated by `fn()` above those allocated when it starts:
    CUDA from the caching allocator's peak; CPU from the profiler's memory events (every
    allocation and free of `fn`, summed in time order)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=False) as prof:
        fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    running = high = 0
    for e in events:
        running += e.nbytes()
        high = max(high, running)
    return high
