"""Process groups that record every collective a rank issues, and one that emulates its peers.

`python -m meshtron.rehearse` runs one rank of a large layout in one process: the mesh is
built over the full world size on the *rehearsal* backend, whose collectives never talk to
another process. Each call completes at once, shape-correct and deterministic:

    all-reduce, broadcast, barrier   the local tensor is left as it is (every peer "holds the same")
    all-gather                       the local input lands in every peer's slot
    reduce-scatter                   this rank's own chunk of the input
    all-to-all                       every peer sends what this rank sends itself (its own
                                     chunk, repeated or cut to the requested split size)
    recv                             a fixed-seed normal sample (the same every run)
    send                             nothing

So an expert all-to-all's counts come from this rank's own routing, as if every rank of the
ep group routed its tokens alike (balanced traffic on the rank's own routing skew).
`EXPERT_LOAD` (`meshtron.rehearse --expert-load F`) scales what arrives: the integer
all-to-alls, which are the MoE dispatchers' count exchanges, deliver F times (rounded) the
counts this rank sends itself, and the rows follow those counts: a rank whose experts are F
times busier than its own routing says.

The *recorded* backend wraps a real gloo group and does the same bookkeeping, so a real
multi-process run logs exactly what the rehearsal logs (tests/distributed/rehearse_cases.py
compares them). Both register under backend names that tell the code above which transport
they stand for: `rehearsal_nccl` (CUDA tensors: NCCL's code paths, asynchronous MoE exchanges)
and `rehearsal_gloo` / `recorded_gloo` (CPU tensors). Shared-memory collectives are off in both
(`shm_collectives.set_enabled(False)`): a rehearsal models NCCL, or gloo through TCP.

Every call appends a `Call` (op, the group's global ranks, bytes sent and received, peer) to
the process's `CALLS` log; `calls_since(mark)` reads a step's share.
"""

from __future__ import annotations

import datetime
import time
import weakref
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future
from torch.utils._pytree import tree_leaves, tree_map

REHEARSAL_CUDA, REHEARSAL_CPU, RECORDED_CPU = "rehearsal_nccl", "rehearsal_gloo", "recorded_gloo"
RECV_SEED = 20261128  # the seed of what an emulated receive delivers
EXPERT_LOAD = 1.0  # scale of the counts an emulated integer all-to-all delivers (module doc)


@dataclass(frozen=True)
class Call:
    """One collective or point-to-point message of this rank: `op`, the global ranks of its
    group (for send/recv: this rank and the peer), bytes this rank sends and receives."""

    op: str
    group: tuple[int, ...]
    send_bytes: int
    recv_bytes: int

    def as_dict(self) -> dict:
        out = asdict(self)
        out["group"] = list(self.group)
        return out


CALLS: list[Call] = []


def calls_since(mark: int) -> list[Call]:
    """The calls logged after `mark` (a former `len(CALLS)`)."""
    return CALLS[mark:]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _done(tensors: list):
    """A completed work holding `tensors` until it is dropped, as a real backend's work holds
    the tensors of its call (the caller's memory is then the same as with NCCL or gloo)."""
    future = Future()
    future.set_result(tensors)
    return _create_work_from_future(future)


class _LoggingGroup(dist.ProcessGroup):
    """Bookkeeping shared by both backends: the group's global ranks and the call log. The
    torch >= 2.13 method names, with the older ones as aliases (torch 2.11 calls those)."""

    def __init__(self, rank: int, size: int, global_ranks: list[int], name: str):
        super().__init__(rank, size)
        self._rank, self._size, self._name = rank, size, name
        self._ranks = tuple(global_ranks) if global_ranks else tuple(range(size))
        self._group_name = self._group_desc = ""

    def size(self):
        return self._size

    def getBackendName(self):
        return self._name

    # torch names every group it creates (DeviceMesh reads the names back)
    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return self._group_name

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return self._group_desc

    def _log(self, op: str, send: int, recv: int, group: tuple[int, ...] | None = None) -> None:
        CALLS.append(Call(op, group or self._ranks, int(send), int(recv)))

    def _log_p2p(self, op: str, tensors, peer: int) -> None:
        me, other = self._ranks[self._rank], self._ranks[peer]
        nbytes = _nbytes(tensors)
        self._log(op, nbytes if op == "send" else 0, nbytes if op == "recv" else 0, (me, other))


class RehearsalGroup(_LoggingGroup):
    """A process group whose collectives complete locally (module doc: what each delivers)."""

    _recv_generator: dict[torch.device, torch.Generator] = {}

    def allreduce(self, tensors, opts=None):
        self._log("all_reduce", _nbytes(tensors), _nbytes(tensors))
        return _done(list(tensors))

    allreduce_coalesced = allreduce

    def broadcast(self, tensors, opts=None):
        self._log("broadcast", _nbytes(tensors), _nbytes(tensors))
        return _done(list(tensors))

    def barrier(self, opts=None):
        self._log("barrier", 0, 0)
        return _done([])

    def allgather(self, output_lists, inputs, opts=None):
        for outputs, x in zip(output_lists, inputs, strict=True):
            for out in outputs:
                out.copy_(x)
        self._log("all_gather", _nbytes(inputs), sum(_nbytes(o) for o in output_lists))
        return _done(list(inputs) + [t for outputs in output_lists for t in outputs])

    def all_gather_single(self, output, x, opts=None):
        output.view(self._size, -1).copy_(x.reshape(1, -1).expand(self._size, -1))
        self._log("all_gather", _nbytes([x]), _nbytes([output]))
        return _done([output, x])

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, chunks in zip(outputs, input_lists, strict=True):
            out.copy_(chunks[self._rank])
        self._log("reduce_scatter", sum(_nbytes(c) for c in input_lists), _nbytes(outputs))
        return _done(list(outputs) + [t for chunks in input_lists for t in chunks])

    def reduce_scatter_single(self, output, x, opts=None):
        output.copy_(x.reshape(self._size, -1)[self._rank].view_as(output))
        self._log("reduce_scatter", _nbytes([x]), _nbytes([output]))
        return _done([output, x])

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, x, output_splits, input_splits, opts=None):
        n = self._size
        in_rows = list(input_splits) or [x.shape[0] // n] * n
        out_rows = list(output_splits) or [output.shape[0] // n] * n
        own = x.narrow(0, sum(in_rows[: self._rank]), in_rows[self._rank]) if x.dim() else x
        start = 0
        for rows in out_rows:
            if rows:
                piece = output.narrow(0, start, rows)
                if own.shape[0]:
                    index = torch.arange(rows, device=own.device) % own.shape[0]
                    piece.copy_(own.index_select(0, index))
                else:
                    piece.zero_()
            start += rows
        if EXPERT_LOAD != 1.0 and not output.is_floating_point():
            output.copy_((output.double() * EXPERT_LOAD).round().to(output.dtype))
        self._log("all_to_all", _nbytes([x]), _nbytes([output]))
        return _done([output, x])

    alltoall_base = all_to_all_single

    def send(self, tensors, peer, tag):
        self._log_p2p("send", tensors, peer)
        return _done(list(tensors))

    def recv(self, tensors, peer, tag):
        for t in tensors:
            t.copy_(self._sample(t))
        self._log_p2p("recv", tensors, peer)
        return _done(list(tensors))

    def _sample(self, like: torch.Tensor) -> torch.Tensor:
        """A deterministic normal sample shaped like `like` (integers: zeros)."""
        if not like.is_floating_point():
            return torch.zeros_like(like)
        gen = self._recv_generator.get(like.device)
        if gen is None:
            gen = self._recv_generator[like.device] = torch.Generator(like.device).manual_seed(RECV_SEED)
        return torch.randn(like.shape, generator=gen, device=like.device, dtype=torch.float32).to(like.dtype)


class _SettlingWork(dist.Work):
    """A gloo call started on aliases of its tensors (`start(*aliases)`, `args` as the call
    takes them, lists nested). `wait` waits for it, then until gloo has dropped every alias (an
    alias's Python object outlives the caller's references while gloo's C++ side holds it, so
    a weak reference to it dies exactly when gloo lets go): the work's last reference to a
    tensor then never goes on gloo's worker thread, where the profiler would not see the tensor
    freed. Counting the storage's uses instead was racy: the caller dropping another view of the
    same buffer meanwhile made the count look settled while gloo still held the alias.
    Point-to-point messages return this work unwaited (a send may need its peer's receive
    posted first)."""

    SETTLE_S = 30.0

    def __init__(self, start, args):
        super().__init__()
        self.leaves = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        aliases = tree_map(lambda t: t.view_as(t) if isinstance(t, torch.Tensor) else t, args)
        self._alias_refs = [weakref.ref(a) for a in tree_leaves(aliases) if isinstance(a, torch.Tensor)]
        self._inner = start(*aliases)

    def wait(self, timeout=None):
        if self._inner is None:
            return True
        self._inner.wait()
        self._inner = None
        deadline = time.monotonic() + self.SETTLE_S
        while any(ref() is not None for ref in self._alias_refs):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"recorded_gloo: gloo still holds a finished call's tensors after {self.SETTLE_S:.0f} s"
                )
            time.sleep(0)
        return True

    def is_completed(self):
        return self._inner is None or self._inner.is_completed()


class RecordedGroup(_LoggingGroup):
    """A real gloo group that logs each call as `RehearsalGroup` does (the rehearsal's
    reference). Each call completes before it returns, like a rehearsal's, and only once gloo's
    worker thread has let go of its tensors: a buffer is then freed on the calling thread,
    where the profiler that measures the rank's peak sees it (a free on gloo's thread is never
    counted, and the reference peak would drift up by whatever gloo freed last)."""

    def __init__(self, inner, rank: int, size: int, global_ranks: list[int]):
        super().__init__(rank, size, global_ranks, RECORDED_CPU)
        self._inner = inner

    def _settled(self, start, *args):
        """`start(*aliases)` on aliases of the tensors in `args` (lists nest), waited for here."""
        work = _SettlingWork(start, args)
        work.wait()
        return _done(work.leaves)

    def allreduce(self, tensors, opts=None):
        self._log("all_reduce", _nbytes(tensors), _nbytes(tensors))
        return self._settled(lambda a: self._inner.allreduce(a, opts or dist.AllreduceOptions()), tensors)

    def broadcast(self, tensors, opts=None):
        self._log("broadcast", _nbytes(tensors), _nbytes(tensors))
        return self._settled(lambda a: self._inner.broadcast(a, opts or dist.BroadcastOptions()), tensors)

    def barrier(self, opts=None):
        self._log("barrier", 0, 0)
        return self._inner.barrier(opts or dist.BarrierOptions())

    def allgather(self, output_lists, inputs, opts=None):
        self._log("all_gather", _nbytes(inputs), sum(_nbytes(o) for o in output_lists))
        start = lambda o, i: self._inner.allgather(o, i, opts or dist.AllgatherOptions())  # noqa: E731
        return self._settled(start, output_lists, inputs)

    def all_gather_single(self, output, x, opts=None):
        self._log("all_gather", _nbytes([x]), _nbytes([output]))
        return self._settled(lambda o, i: self._inner._allgather_base(o, i, opts or dist.AllgatherOptions()), output, x)

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        self._log("reduce_scatter", sum(_nbytes(c) for c in input_lists), _nbytes(outputs))
        start = lambda o, i: self._inner.reduce_scatter(o, i, opts or dist.ReduceScatterOptions())  # noqa: E731
        return self._settled(start, outputs, input_lists)

    def reduce_scatter_single(self, output, x, opts=None):
        """An all-reduce of the input in place, this rank's chunk copied out: gloo's own
        reduce-scatter clones the input on this thread and frees the clone on its worker, where
        the profiler never sees it go (the reference peak would grow by one input per call).
        The input's other chunks are left summed: none of meshtron's callers reads them again."""
        self._log("reduce_scatter", _nbytes([x]), _nbytes([output]))
        summed = dist.AllreduceOptions()
        if opts is not None:
            summed.reduceOp = opts.reduceOp
        self._settled(lambda i: self._inner.allreduce([i], summed), x)
        output.copy_(x.reshape(self._size, -1)[self._rank].view_as(output))
        return _done([output, x])

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, x, output_splits, input_splits, opts=None):
        self._log("all_to_all", _nbytes([x]), _nbytes([output]))
        splits = list(output_splits), list(input_splits)
        start = lambda o, i: self._inner.alltoall_base(o, i, *splits, opts or dist.AllToAllOptions())  # noqa: E731
        return self._settled(start, output, x)

    alltoall_base = all_to_all_single

    def send(self, tensors, peer, tag):
        self._log_p2p("send", tensors, peer)
        return _SettlingWork(lambda a: self._inner.send(a, peer, tag), (tensors,))

    def recv(self, tensors, peer, tag):
        self._log_p2p("recv", tensors, peer)
        return _SettlingWork(lambda a: self._inner.recv(a, peer, tag), (tensors,))


def _create_rehearsal(name: str):
    def create(common, options):
        return RehearsalGroup(common.group_rank, common.group_size, list(common.global_ranks_in_group), name)

    return create


def _create_recorded(common, options):
    timeout = common.timeout if isinstance(common.timeout, datetime.timedelta) else datetime.timedelta(seconds=300)
    inner = dist.ProcessGroupGloo(common.store, common.group_rank, common.group_size, timeout)
    return RecordedGroup(inner, common.group_rank, common.group_size, list(common.global_ranks_in_group))


def register_backends() -> None:
    """Make the three backends known to torch.distributed (once per process)."""
    known = {str(b).lower() for b in dist.Backend.backend_list}
    for name, create, devices in (
        (REHEARSAL_CUDA, _create_rehearsal(REHEARSAL_CUDA), ["cpu", "cuda"]),
        (REHEARSAL_CPU, _create_rehearsal(REHEARSAL_CPU), ["cpu"]),
        (RECORDED_CPU, _create_recorded, ["cpu"]),
    ):
        if name not in known:
            dist.Backend.register_backend(name, create, extended_api=True, devices=devices)


def check_routes(device: torch.device) -> None:
    """Call each collective the code above uses once on the world group: a torch whose Python
    process groups cannot take one (older releases route some tensor collectives past
    Python) fails here with its name, not deep inside a model's step."""
    if dist.get_world_size() == 1:
        return
    n, x = dist.get_world_size(), torch.ones(2, device=device)
    peer = (dist.get_rank() + 1) % n
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13's names
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        gather.__name__: lambda: gather(torch.empty(2 * n, device=device), x),
        scatter.__name__: lambda: scatter(x[:1], torch.ones(n, device=device)),
        "all_to_all_single": lambda: dist.all_to_all_single(
            torch.empty(n, device=device), torch.ones(n, device=device)
        ),
        "batch_isend_irecv": lambda: [w.wait() for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer)])],
    }
    mark = len(CALLS)
    for name, call in calls.items():
        try:
            call()
        except Exception as err:  # noqa: BLE001 - named with the torch release, then raised
            raise RuntimeError(f"torch {torch.__version__}: {name} does not reach the rehearsal group ({err})") from err
    del CALLS[mark:]
