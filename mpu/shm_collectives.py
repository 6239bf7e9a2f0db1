"""All-reduce (sum), all-gather, reduce-scatter (sum) and all-to-all through shared memory, for process groups of CPU
ranks on one host: the tensor-parallel (and blocking MoE) collectives of a CPU run without
gloo's TCP round trips.

On the 2-core CPU host, gloo takes ~1.5 ms for any all-reduce however small and ~2.5 ms for
the 1 MiB activations of the reference shape; through shared memory the same all-reduce
takes ~0.2 ms (bench/README.md). A group's ranks map one /dev/shm segment (created by the
group's first rank, unlinked as soon as every rank mapped it, so nothing is left behind):
per rank an int64 sequence flag and two data slots used alternately. A collective copies
this rank's tensor into its slot, publishes the call's sequence number, waits until every
rank has published it and reads the slots. Two slots suffice: a rank writes the slot of call
n + 1 only after every rank published call n, i.e. finished reading call n - 1. Every rank
sums the slots in rank order, so all ranks get bit-identical results.

Used by `mpu.mappings` for groups where `eligible` holds: CPU tensors of at most SLOT_BYTES,
a gloo group whose ranks all run on this (x86-64) host, room in /dev/shm, and the environment
variable MESHTRON_SHM_COLLECTIVES not "0" (0 measures gloo instead, as
bench/dense_vs_megatron.py --gloo does). Larger tensors go through gloo; an all-to-all, whose
sizes differ per rank, first agrees on them. Waiting yields, then sleeps between checks, and
raises after `TIMEOUT_S` naming the collective and the missing ranks.

A dead peer is noticed in about a second, not after `TIMEOUT_S`: every rank publishes its
process identity (pid, start time, pid namespace: `mpu.waits.process_identity`) in the
segment, and a wait that has lasted `PROBE_S` checks every `PROBE_S` whether the ranks it
still waits for are alive (`mpu.waits.process_gone`: all of a segment's ranks run on this
host); one that exited (killed, crashed; a zombie not yet reaped counts) fails the wait with
`PeerGoneError` naming its group and global rank, as gloo's "Connection closed by peer" does.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
import uuid

import torch
import torch.distributed as dist
from torch.profiler import record_function

from meshtron.mpu.waits import PeerGoneError, process_gone, process_identity, wait_for

# Publishing relies on x86's in-order stores (data visible before the flag); elsewhere gloo.
_ENV_ENABLED = os.environ.get("MESHTRON_SHM_COLLECTIVES", "1") != "0" and platform.machine() in ("x86_64", "AMD64")
ENABLED = _ENV_ENABLED
TIMEOUT_S = 600.0  # a late peer fails the wait after this long; set_timeout() follows the process group's
SLOT_BYTES = 4 << 20  # per rank and call parity; larger tensors go through gloo
_FLAG_BYTES = 4096  # one int64 flag per rank, up to 512 ranks
_INFO_BYTES = 3 * _FLAG_BYTES  # per rank (pid, start ticks, pid namespace), int64 each
PROBE_S = 1.0  # a wait this long checks, every PROBE_S, that the ranks it waits for are alive
_SPINS = 20  # yields (a few microseconds each) before sleeping between checks: a spinning
# rank stays runnable and takes CPU from whatever else runs, the late peer included
_SLEEP_S = 50e-6

_states: dict[int, tuple] = {}  # id(group) -> (group, _Segment or None when not eligible)


def set_timeout(seconds: float) -> None:
    """Fail a shared-memory wait after `seconds`, like the process group's collectives
    (called where the group is created with its timeout: trainer.collective_timeout_s)."""
    global TIMEOUT_S
    TIMEOUT_S = float(seconds)


def set_enabled(flag: bool | None) -> None:
    """Turn shared-memory collectives off (False: a rehearsal's groups have no peers to map a
    segment with) or back to the environment's choice (None)."""
    global ENABLED
    ENABLED = _ENV_ENABLED if flag is None else bool(flag)


def reset() -> None:
    """Forget (and unmap) every group's segment: called when the process groups are destroyed,
    so a later job's groups, even one whose object or id repeats, start afresh."""
    _states.clear()


class _Segment:
    """One group's mapped shared memory: flags [world] int64 and slots [2, world, SLOT_BYTES]."""

    def __init__(self, group, path: str):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        raw = torch.from_file(path, shared=True, size=_segment_bytes(self.world), dtype=torch.uint8)
        self.flags = raw[:_FLAG_BYTES].view(torch.int64)[: self.world]
        # Who each rank is (written by each rank before the barrier that follows the mapping),
        # so that a waiter can tell a dead peer from a late one.
        self.info = raw[_FLAG_BYTES : _FLAG_BYTES + _INFO_BYTES].view(torch.int64).view(3, -1)[:, : self.world]
        self.info[:, self.rank] = torch.tensor(process_identity(), dtype=torch.int64)
        self.slots = raw[_FLAG_BYTES + _INFO_BYTES :].view(2, self.world, SLOT_BYTES)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.seq = 0

    def publish(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Copy x (at byte `offset`) into this rank's slot of the next call and publish the
        call; return the call's slots [world, SLOT_BYTES] (bytes)."""
        self.seq += 1
        slots = self.slots[self.seq & 1]
        slots[self.rank, offset : offset + x.numel() * x.element_size()].view(x.dtype).copy_(x.reshape(-1))
        self.flags[self.rank] = self.seq  # x86 keeps these stores in order: data before flag
        return slots

    def wait(self) -> None:
        """Return once every rank published the current call (a work handle for `wait_for`);
        raises PeerGoneError when a rank it waits for has exited, TimeoutError after TIMEOUT_S."""
        spins, start = 0, time.monotonic()
        deadline, probe_at = start + TIMEOUT_S, start + PROBE_S
        while int(self.flags.min()) < self.seq:
            spins += 1
            if spins < _SPINS:
                os.sched_yield()
                continue
            # A peer is late (descheduled, or still computing): sleep so that it, and every
            # other process of an oversubscribed host, gets the core.
            time.sleep(_SLEEP_S)
            now = time.monotonic()
            if now > probe_at:
                probe_at = now + PROBE_S
                self._check_alive(now - start)
            if now > deadline:
                late = [r for r in range(self.world) if int(self.flags[r]) < self.seq]
                raise TimeoutError(
                    f"shared-memory collective {self.seq} timed out: ranks {late} of the group "
                    f"did not arrive within {TIMEOUT_S:g} s"
                )

    def _check_alive(self, waited: float) -> None:
        """Raise PeerGoneError if a rank that has not published the current call has exited."""
        late = [r for r in range(self.world) if int(self.flags[r]) < self.seq]
        dead = [r for r in late if process_gone(tuple(self.info[:, r].tolist()))]
        if dead:
            who = ", ".join(
                f"rank {r} of the group (global rank {self.global_ranks[r]}, pid {int(self.info[0, r])})" for r in dead
            )
            raise PeerGoneError(
                f"shared-memory collective {self.seq}: peer {who} is dead (killed or crashed) and will "
                f"never arrive; noticed after {waited:.1f} s of waiting",
                [self.global_ranks[r] for r in dead],
            )


def _segment_bytes(world: int) -> int:
    return _FLAG_BYTES + _INFO_BYTES + 2 * world * SLOT_BYTES


def _create(group) -> _Segment | None:
    """Collective over `group`: the group's first rank creates the segment if /dev/shm has
    room for it (twice over) and every rank maps it; None on every rank otherwise."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    box = [None]
    if rank == 0:
        st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        if st is not None and st.f_bavail * st.f_frsize >= 2 * _segment_bytes(world):
            box[0] = f"/dev/shm/meshtron-{uuid.uuid4().hex}"
            with open(box[0], "wb") as f:
                f.truncate(_segment_bytes(world))
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if box[0] is None:
        return None
    segment = _Segment(group, box[0])
    dist.barrier(group=group)  # every rank mapped it: the name is no longer needed
    if rank == 0:
        os.unlink(box[0])
    return segment


def _segment_of(group, x: torch.Tensor) -> _Segment | None:
    """The group's segment if collectives of CPU tensors over it use shared memory."""
    if x.device.type != "cpu" or not ENABLED:
        return None
    entry = _states.get(id(group))
    if entry is None:
        segment = None
        if "gloo" in str(dist.get_backend(group)):
            hosts = [None] * dist.get_world_size(group)
            dist.all_gather_object(hosts, socket.gethostname(), group=group)
            if len(set(hosts)) == 1:
                segment = _create(group)
        # The entry holds the group object, so its id is not reused while the entry exists.
        entry = _states[id(group)] = (group, segment)
    return entry[1]


def eligible(group, x: torch.Tensor) -> bool:
    """Whether an all-reduce or all-gather of `x` over `group` (a real group of > 1 ranks)
    goes through shared memory: a CPU tensor of at most SLOT_BYTES (the same size on every
    rank, as these collectives require), a gloo group whose ranks all run on this host, room
    in /dev/shm. Decided per group by a collective at its first call (host names compared)."""
    segment = _segment_of(group, x)
    return segment is not None and x.numel() * x.element_size() <= SLOT_BYTES


def all_reduce(x: torch.Tensor, group) -> None:
    """In-place sum of the contiguous CPU tensor x over `group` (`eligible` must hold); every
    rank adds the slots in rank order, so all get the same bits."""
    with record_function("shm::all_reduce"):
        seg = _states[id(group)][1]
        slots = seg.publish(x)
        wait_for(seg, f"all_reduce over a shared-memory group of {seg.world} (call {seg.seq})")
        torch.sum(slots[:, : x.numel() * x.element_size()].view(x.dtype), dim=0, out=x.view(-1))


def all_reduce_in_slots(x: torch.Tensor, group) -> None:
    """In-place sum of the contiguous CPU tensor x of any size over `group`, one slot-sized
    piece after another (`eligible(group, x[:0])` must hold: the group has a segment). Used for
    gradient buckets, which exceed a slot; each piece sums in rank order as `all_reduce`."""
    flat = x.view(-1)
    step = SLOT_BYTES // x.element_size()
    for start in range(0, flat.numel(), step):
        all_reduce(flat[start : start + step], group)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """out (contiguous, group size * x.numel() elements) <- every rank's x in rank order
    (`eligible(group, x)` must hold)."""
    with record_function("shm::all_gather"):
        seg = _states[id(group)][1]
        slots = seg.publish(x.contiguous())
        wait_for(seg, f"all_gather over a shared-memory group of {seg.world} (call {seg.seq})")
        out.view(seg.world, -1).copy_(slots[:, : x.numel() * x.element_size()].view(x.dtype))


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """out (contiguous, x.numel() / group size elements) <- the sum over the group's ranks of
    this rank's chunk of x (x split into equal chunks in rank order; `eligible(group, x)` must
    hold). Each rank sums its chunk of every rank's slot."""
    with record_function("shm::reduce_scatter"):
        seg = _states[id(group)][1]
        slots = seg.publish(x.contiguous())
        wait_for(seg, f"reduce_scatter over a shared-memory group of {seg.world} (call {seg.seq})")
        nbytes = out.numel() * out.element_size()
        mine = slots[:, seg.rank * nbytes : (seg.rank + 1) * nbytes].view(x.dtype)
        torch.sum(mine, dim=0, out=out.view(-1))


def all_to_all(out: torch.Tensor, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> bool:
    """`dist.all_to_all_single` over `group` if every rank's rows fit a slot: rows of x in
    chunks of `input_splits` go to the ranks in order, `out` (contiguous) receives
    `output_splits[j]` rows from rank j; returns False (nothing exchanged: use gloo) when some
    rank's rows do not fit. Two calls: the byte counts (so every rank decides alike), then the
    rows behind each rank's split sizes, where every reader finds its chunk. `group` must
    have a segment (`eligible` on any CPU tensor)."""
    with record_function("shm::all_to_all"):
        seg = _states[id(group)][1]
        x = x.contiguous()
        world = len(input_splits)
        head = -(-8 * world // 64) * 64  # split sizes, padded to a cache line
        need = torch.tensor([head + x.numel() * x.element_size()], dtype=torch.int64)
        sizes = seg.publish(need)
        wait_for(seg, f"all_to_all sizes over a shared-memory group of {seg.world} (call {seg.seq})")
        if int(sizes[:, :8].view(torch.int64).max()) > SLOT_BYTES:
            return False
        # The rows, behind this rank's split sizes, then the flag (as publish() does).
        seg.seq += 1
        slots = seg.slots[seg.seq & 1]
        mine, nbytes = slots[seg.rank], x.numel() * x.element_size()
        mine[: 8 * world].view(torch.int64).copy_(torch.tensor(input_splits, dtype=torch.int64))
        mine[head : head + nbytes].view(x.dtype).copy_(x.reshape(-1))
        seg.flags[seg.rank] = seg.seq
        wait_for(seg, f"all_to_all over a shared-memory group of {seg.world} (call {seg.seq})")
        row = x[0].numel() if x.shape[0] else math.prod(x.shape[1:])
        out_rows = out.view(-1, row) if row else out.view(out.shape[0], 0)
        start = 0
        for j in range(world):
            n = output_splits[j]
            if n:
                splits = slots[j, : 8 * world].view(torch.int64).tolist()
                offset = head + sum(splits[: seg.rank]) * row * x.element_size()
                out_rows[start : start + n].copy_(
                    slots[j, offset : offset + n * row * x.element_size()].view(x.dtype).view(n, row)
                )
            start += n
        return True
