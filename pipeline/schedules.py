"""Pipeline schedules as per-rank lists of actions (no communication here).

An action is a forward or backward of one microbatch through one model chunk of this rank.
Chunk c of rank r is virtual stage c * pp + r (Megatron's interleaved layout: each rank holds
v non-contiguous chunks). The executor (`pipeline.executor`) turns the list into compute and
point-to-point messages (planned in `pipeline.p2p`, which derives one message order per
channel from all ranks' lists and checks that the lists do not deadlock).

    gpipe        all forwards, then all backwards: m microbatches of activations in flight
    1f1b         PipeDream-Flush: pp - rank - 1 warm-up forwards, then one forward / one
                 backward, then the remaining backwards: at most pp in flight on stage 0
    interleaved  1F1B over virtual stages (v chunks per rank, m divisible by pp): warm-up
                 (pp - rank - 1) * 2 + (v - 1) * pp virtual microbatches
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshtron.mpu.mesh import SCHEDULES


@dataclass(frozen=True)
class Action:
    """`kind` "F" (forward) or "B" (backward) of `microbatch` through this rank's `chunk`."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def gpipe(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """All forwards then all backwards (backwards in reverse microbatch order)."""
    m = num_microbatches
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]


def one_f_one_b(pp: int, rank: int, num_microbatches: int) -> list[Action]:
    """PipeDream-Flush: warm-up forwards, steady 1F1B, cool-down backwards."""
    m = num_microbatches
    warmup = min(pp - rank - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_forward < m:
        actions.append(Action("F", next_forward))
        next_forward += 1
        actions.append(Action("B", next_backward))
        next_backward += 1
    actions += [Action("B", i) for i in range(next_backward, m)]
    return actions


def _virtual(k: int, pp: int, v: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of this rank's k-th forward (or backward) virtual microbatch."""
    group, within = divmod(k, pp * v)
    chunk = within // pp
    if not forward:
        chunk = v - 1 - chunk
    return group * pp + within % pp, chunk


def interleaved(pp: int, rank: int, num_microbatches: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B over v model chunks per rank (m must be divisible by pp)."""
    m = num_microbatches
    if m % pp:
        raise ValueError(f"the interleaved schedule needs the number of microbatches ({m}) divisible by pp={pp}")
    total = m * v
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    actions = [Action("F", *_virtual(k, pp, v, True)) for k in range(warmup)]
    backward = 0
    for k in range(warmup, total):
        actions.append(Action("F", *_virtual(k, pp, v, True)))
        actions.append(Action("B", *_virtual(backward, pp, v, False)))
        backward += 1
    actions += [Action("B", *_virtual(k, pp, v, False)) for k in range(backward, total)]
    return actions


def build_schedule(name: str, pp: int, rank: int, num_microbatches: int, vpp: int = 1) -> list[Action]:
    """The action list of `rank` for schedule `name`; raises ValueError for bad combinations."""
    if name not in SCHEDULES:
        raise ValueError(f"parallel.schedule={name!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if vpp > 1 and name != "interleaved":
        raise ValueError(f"parallel.vpp={vpp} needs parallel.schedule=interleaved (got {name})")
    if name == "gpipe":
        return gpipe(pp, rank, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(pp, rank, num_microbatches)
    return interleaved(pp, rank, num_microbatches, vpp)


@functools.lru_cache(maxsize=32)
def build_all_ranks(
    name: str, pp: int, num_microbatches: int, vpp: int = 1, forward_only: bool = False
) -> tuple[tuple[Action, ...], ...]:
    """Every pipeline rank's action list (index = pp rank), as the executor needs them to plan
    its messages. `forward_only` (evaluation, any microbatch count): forwards only, chunk by
    chunk (every microbatch through chunk 0, then chunk 1, ...), whatever `name` is.
    Cached: the same tuple comes back for the same arguments (the executor caches its plan
    by that object)."""
    if forward_only:
        order = tuple(Action("F", m, c) for c in range(vpp) for m in range(num_microbatches))
        return (order,) * pp
    return tuple(tuple(build_schedule(name, pp, rank, num_microbatches, vpp)) for rank in range(pp))


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of microbatch-chunks whose activations are held (forward done, backward not)."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak
