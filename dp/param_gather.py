"""ZeRO-1/2 parameter all-gathers overlapped with the next forward (`optim.overlap_param_gather`).

After its update each rank holds the new values of only its shard of every gradient bucket;
every replica needs the whole bucket before it next reads those parameters. Gathering every
bucket with a blocking collective at the end of the step leaves the compute idle while the
network works. `ParamGather` does what Megatron-Core's distributed optimizer does instead:

  * the optimizer issues one asynchronous all-gather per bucket over the bucket's replica
    group (dp x cp; tp x dp for sequence-parallel replicated parameters; edp for experts),
    in the order of the buckets' first use in forward (`order`: the bucket holding the
    embedding first, although the reducer builds buckets in reverse registration order for
    backward);
  * a forward pre-hook on each unit of each model chunk waits (once per gather) for the
    buckets holding that unit's parameters, so the gathers of later layers' buckets run
    while earlier layers compute. Units are those of dp/zero3.py (`unit_of`): the embedding
    with the learned positions (hooked on `embed`), each block, and the final norm with the
    LM head (hooked on `final_norm`; with tied embeddings it also waits for the embedding's
    buckets: on a last pipeline stage the embedding copy is read only by the head). A unit,
    not each module owning parameters, because a module may read a child's weights without
    calling it (the fused MLP reads `up.weight`). A forward post-hook on the chunk waits for
    whatever of its buckets is still pending (a parameter outside every unit).
  * anything that reads parameters outside forward (the finite-weights check, checkpoint
    save and load, direct readers in tests) first calls `finish_param_gather(chunks)`; the
    optimizer's own `step()` finishes any gather still pending before it updates.

The gathers run on process groups of their own, one per distinct replica group (same ranks,
created once by every rank together): a collective issued on the replica group itself during
the next forward (the global token count over dp x cp at the start of the step) must not queue
behind them. On NCCL one communicator's collectives run in issue order on one stream, so that
count, and with it the compute stream, would otherwise wait for every bucket's gather.

Memory: the shard each rank sends is a copy (gloo may not take an input inside its output),
kept until the bucket's wait, so up to 1/R of the parameters' bytes (R replicas) stays
allocated into the next forward, where the blocking gather frees each copy at once. (NCCL
could gather in place from the shard's own slice of the bucket; not done, untested here.)

Values are those of the blocking gather: the same bytes move, and nothing reads a bucket
before its gather is waited for, so training is bit-identical (tests/distributed/zero_cases.py).
Each unit waits only for its own buckets, in whatever order the collectives finish; on NCCL
the wait orders the compute stream after the gather, as `work.wait()` does.

Tracing (`record(True)`, used by `trainer.trace_step`): spans of every gather (launch to
completion, from the collective's future) and of every unit's forward, with the number of
gathers still in flight when the unit started (`Span`, written by `pipeline.trace`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshtron.dp.zero3 import unit_of
from meshtron.mpu.mappings import all_gather_into, world_group
from meshtron.mpu.mesh import group_size
from meshtron.mpu.waits import wait_for


@dataclass
class Span:
    """One recorded interval: `lane` "compute" (unit forwards, waits) or "param all-gather";
    `args` go into the Chrome trace event."""

    name: str
    lane: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


@dataclass
class _Pending:
    work: object
    source: torch.Tensor  # the shard sent: kept alive until the gather is done
    span: Span | None = None


class ParamGather:
    """Asynchronous per-bucket parameter all-gathers of a ZeRO-1/2 optimizer, waited for by
    forward pre-hooks on the units of `chunks` (module doc). `buckets` are the optimizer's
    (the reducer's) buckets; `launch` is called by the optimizer for each bucket of `order`."""

    def __init__(self, chunks: list[nn.Module], buckets: list):
        self.chunks = list(chunks)
        self.buckets = list(buckets)
        self.groups = gather_groups([b.group for b in self.buckets])  # {ranks: own group}
        bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._pending: dict[int, _Pending] = {}
        self.recording = False
        self.spans: list[Span] = []
        self._hooks = []
        first_use: dict[int, tuple[int, int]] = {}
        self.unit_buckets: dict[tuple[int, str], list[int]] = {}  # (chunk, hooked unit) -> bucket indices
        self.leftover: dict[int, list[int]] = {}  # chunk -> buckets of parameters outside every hooked unit
        for ci, chunk in enumerate(self.chunks):
            hooked = self._hooked_units(chunk)
            position = {name: i for i, (name, _) in enumerate(hooked)}
            per_unit: dict[str, set[int]] = {name: set() for name, _ in hooked}
            leftover: set[int] = set()
            for name, p in chunk.named_parameters():
                if id(p) not in bucket_of:
                    continue  # not trained (no gradient bucket): never gathered
                unit = self._waiting_unit(chunk, unit_of(name))
                (per_unit[unit] if unit in per_unit else leftover).add(bucket_of[id(p)])
            for unit, indices in per_unit.items():
                for i in indices:
                    first_use[i] = min(first_use.get(i, (ci, position[unit])), (ci, position[unit]))
            for i in leftover:
                first_use.setdefault(i, (ci, len(hooked)))
            for unit, module in hooked:
                self.unit_buckets[(ci, unit)] = sorted(per_unit[unit])
                self._hooks.append(
                    module.register_forward_pre_hook(lambda m, args, key=(ci, unit): self._before_unit(key))
                )
                self._hooks.append(
                    module.register_forward_hook(lambda m, args, out, key=(ci, unit): self._after_unit(key))
                )
            self.leftover[ci] = sorted(leftover)
            everything = sorted(set().union(leftover, *per_unit.values()))
            self._hooks.append(chunk.register_forward_hook(lambda m, args, out, idx=everything: self._wait(idx)))
            chunk._param_gather = self
        last = (len(self.chunks), 0)
        # Buckets in the order forward first reads them (ties: the reducer's order).
        self.order: list[int] = sorted(range(len(self.buckets)), key=lambda i: (first_use.get(i, last), i))
        self._open: dict[tuple[int, str], Span] = {}

    @staticmethod
    def _hooked_units(chunk: nn.Module) -> list[tuple[str, nn.Module]]:
        """(unit, module whose forward pre-hook waits for it), in forward order."""
        units = []
        if getattr(chunk, "embed", None) is not None and chunk.pre_process:
            units.append(("embed", chunk.embed))
        units += [(f"layers.{i}", block) for i, block in chunk.layers.items()]
        if getattr(chunk, "final_norm", None) is not None:
            units.append(("head", chunk.final_norm))
        return units

    @staticmethod
    def _waiting_unit(chunk: nn.Module, unit: str) -> str:
        """The hooked unit that first reads a parameter of `unit`: the embedding of a chunk
        without the input (a last stage's tied copy) is read by the head."""
        if unit == "embed" and not chunk.pre_process:
            return "head"
        return unit

    # ---- launching and waiting -------------------------------------------------------------
    def launch(self, index: int, output: torch.Tensor, own: torch.Tensor, group) -> None:
        """All-gather `own` (this rank's shard of bucket `index`) into `output` over `group`,
        asynchronously; waited for by the first unit reading the bucket or `finish()`."""
        if index in self._pending:
            self._wait([index])
        if group_size(group) <= 1:
            output.view(-1).copy_(own.reshape(-1))
            return
        start = time.perf_counter()
        work = all_gather_into(output, own, self.groups.get(_ranks(group), group), async_op=True)
        span = None
        if self.recording:
            names = self.buckets[index].names if getattr(self.buckets[index], "names", None) else []
            span = Span(
                f"all-gather bucket {index}",
                "param all-gather",
                start,
                start,
                {"bucket": index, "numel": output.numel(), "first": names[:1], "last": names[-1:]},
            )
            self.spans.append(span)
            _record_completion(work, span)
        self._pending[index] = _Pending(work, own, span)

    def _wait(self, indices) -> None:
        for index in indices:
            pending = self._pending.pop(index, None)
            if pending is None:
                continue
            bucket = self.buckets[index]
            mib = pending.source.numel() * pending.source.element_size() * group_size(bucket.group) / 2**20
            wait_for(
                pending.work,
                f"ZeRO parameter all-gather of bucket {index + 1}/{len(self.buckets)} over "
                f"{bucket.key} ({mib:.1f} MiB)",
            )
            if pending.span is not None and pending.span.end == pending.span.start:
                pending.span.end = time.perf_counter()  # no completion callback on this backend

    def finish(self) -> None:
        """Wait for every gather in flight (in launch order)."""
        self._wait(list(self._pending))

    def pending(self) -> list[int]:
        """Indices of the buckets whose gather was launched and not yet waited for."""
        return list(self._pending)

    def in_flight(self) -> list[int]:
        """Indices of the buckets whose gather has not completed yet (no waiting)."""
        return [i for i, p in self._pending.items() if not p.work.is_completed()]

    # ---- hooks -----------------------------------------------------------------------------
    def _before_unit(self, key: tuple[int, str]) -> None:
        needed = [i for i in self.unit_buckets[key] if i in self._pending]
        if not self.recording:
            self._wait(needed)
            return
        start = time.perf_counter()
        self._wait(needed)
        now = time.perf_counter()
        if needed:
            self.spans.append(Span(f"wait params {key[1]}", "compute", start, now, {"buckets": needed}))
        self._open[key] = Span(
            f"F {key[1]}" + (f" chunk{key[0]}" if key[0] else ""),
            "compute",
            now,
            now,
            {"gathers_in_flight": len(self.in_flight()), "gathers_pending": len(self._pending)},
        )

    def _after_unit(self, key: tuple[int, str]) -> None:
        span = self._open.pop(key, None)
        if span is not None:
            span.end = time.perf_counter()
            self.spans.append(span)

    def record(self, enabled: bool) -> None:
        """Start (clearing earlier spans) or stop recording spans."""
        if enabled:
            self.spans = []
        self.recording = enabled
        self._open = {}

    def spans_of_step(self, since: float) -> list[Span]:
        """The recorded spans of the step that began at `since`: its unit forwards and waits,
        and the gathers they waited for (launched by the previous step's update, before `since`)."""
        return [s for s in self.spans if (s.lane == "param all-gather") == (s.start < since)]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for chunk in self.chunks:
            if getattr(chunk, "_param_gather", None) is self:
                del chunk._param_gather


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def gather_groups(groups) -> dict[tuple[int, ...], object]:
    """{global ranks: a new process group of those ranks} for each distinct group of `groups`
    with more than one member, on every rank that belongs to it. Every rank must call this
    together: the rank lists are all-gathered over the world (each rank knows only its own
    groups) and every rank takes part in creating each group, in one sorted order."""
    world = world_group()
    if world is None:
        return {}
    mine = sorted({_ranks(g) for g in groups if group_size(g) > 1})
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=world)
    created = {}
    for ranks in sorted({r for rows in everyone for r in rows}):
        group = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            created[ranks] = group
    return created


def _record_completion(work, span: Span) -> None:
    """Set `span.end` when `work` completes (its future's callback; the backend's thread)."""
    try:
        future = work.get_future()
    except (RuntimeError, AttributeError):
        return

    def done(_):
        span.end = time.perf_counter()

    future.then(done)


def gatherer_of(chunks) -> ParamGather | None:
    """The `ParamGather` installed on `chunks` (one model chunk or a list), or None."""
    chunks = chunks if isinstance(chunks, (list, tuple, nn.ModuleList)) else [chunks]
    for chunk in chunks:
        gather = getattr(chunk, "_param_gather", None)
        if gather is not None:
            return gather
    return None


def finish_param_gather(chunks) -> None:
    """Wait for every parameter all-gather still in flight on `chunks` (no-op without
    `optim.overlap_param_gather` or when none is pending): call before reading parameters
    outside forward. Waits on each bucket's replica group."""
    gather = gatherer_of(chunks)
    if gather is not None:
        gather.finish()
