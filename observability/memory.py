"""Peak memory of this process, and of every rank, for ``metrics.jsonl``.

``peak_memory_bytes`` is the high-water mark of the device this rank trains on: on CUDA the
caching allocator's ``max_memory_allocated`` (tensors only, not the allocator's reserve or
the CUDA context), on CPU the process's peak resident set size (everything the process ever
held in RAM: tensors, the Python heap, loaded libraries). ``peak_memory_per_rank`` gathers
one number per rank so rank 0 can log them all.
"""

from __future__ import annotations

import gc
import sys

import torch

from meshtron.mpu.mappings import all_gather_stats, world_group
from meshtron.mpu.mesh import collective_device, group_size

__all__ = [
    "peak_memory_bytes",
    "peak_memory_per_rank",
    "format_bytes",
    "held_state_bytes",
    "PeakMeter",
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


class PeakMeter:
    """Peak tensor bytes above the start of each call measured inside one `with` block
    (`measure(fn)`; `peaks` in call order once the block ends).

    CUDA: the caching allocator's peak per call. CPU: one profiler session spans the whole
    block, and a call's peak is the running sum of the allocations and frees it makes, in
    order; a free counts only when the block saw that address allocated. The profiler sizes a
    free from a table that frees outside a session leave stale (an address allocated under an
    earlier session, freed and reused without one, is reported freed at the old size: a CI run
    measured one rank's peak 1.1 MB low that way), so frees of memory from before the block are
    left out, and successive calls leave no gap in which their own frees go unseen. Python's
    cycle collector is off inside the block: what a cycle holds is freed at a fixed point, not
    whenever the collector happens to run. Frees made on threads the profiler does not record
    are never seen, so with a gloo process group a CPU reading can only be high: a tensor whose
    last reference a gloo worker drops with its finished Work stays counted (seen: +32-128 KiB
    a step on random ranks of a world of 4; tests/distributed/rehearse_cases.py)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peaks: list[int] = []
        self._marks: list[str] = []
        self._profile = None
        self._collector_was_on = False

    def __enter__(self) -> PeakMeter:
        self._collector_was_on = gc.isenabled()
        gc.disable()
        if self.device.type != "cuda":
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=False)
            self._profile.__enter__()
        return self

    def measure(self, fn) -> None:
        """Call `fn()`, measuring its peak."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            self.peaks.append(torch.cuda.max_memory_allocated(self.device) - base)
            return
        mark = f"meshtron.measured.{len(self._marks)}"
        self._marks.append(mark)
        with torch.profiler.record_function(mark):
            fn()

    def __exit__(self, *exc) -> None:
        try:
            if self._profile is not None:
                self._profile.__exit__(*exc)
                if exc[0] is None:
                    self.peaks = _peaks_per_mark(self._profile, self._marks)
        finally:
            if self._collector_was_on:
                gc.enable()


def _peaks_per_mark(prof, marks: list[str]) -> list[int]:
    """Per `record_function` mark of `prof`, the high-water mark of the running sum of its
    allocations and of its frees of addresses allocated earlier in the session."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    peaks = dict.fromkeys(marks, 0)
    spans, allocations = {}, []
    stack = list(roots)
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.name in peaks:
            spans[e.name] = (e.start_time_ns, e.end_time_ns)
        elif type(e.extra_fields).__name__ == "_ExtraFields_Allocation" and e.extra_fields.device.type == "cpu":
            allocations.append(e)
    allocations.sort(key=lambda e: e.start_time_ns)
    live: dict[int, int] = {}
    running = dict(peaks)
    for e in allocations:
        ptr, size = e.extra_fields.ptr, e.extra_fields.alloc_size
        if size > 0:
            live[ptr] = size
        elif ptr in live:
            size = -live.pop(ptr)
        else:
            continue  # memory from before the session (the profiler's size may be stale)
        for mark, (start, end) in spans.items():
            if start <= e.start_time_ns <= end:
                running[mark] += size
                peaks[mark] = max(peaks[mark], running[mark])
    return [peaks[mark] for mark in marks]


def profiled_peak(fn, device: torch.device) -> int:
    """High-water mark of tensor bytes allocated by `fn()` above those allocated when it
    starts (`PeakMeter` for one call)."""
    with PeakMeter(device) as meter:
        meter.measure(fn)
    return meter.peaks[0]
