"""Autograd collectives over a tensor-parallel group, each with its conjugate backward.

    copy_to_region          fwd: identity            bwd: all-reduce
    reduce_from_region      fwd: all-reduce          bwd: identity
    scatter_to_region       fwd: keep own chunk      bwd: all-gather
    gather_from_region      fwd: all-gather          bwd: keep own chunk
    gather_from_sequence    fwd: all-gather (dim 0)  bwd: reduce-scatter (dim 0)
    reduce_scatter_to_sequence fwd: reduce-scatter   bwd: all-gather (dim 0)
    sequence_gathered       fwd: none (the gathered tensor is at hand)  bwd: reduce-scatter (dim 0)
    all_to_all              fwd: all-to-all          bwd: the reverse all-to-all
    all_to_all_start / all_to_all_wait: the same all-to-all, asynchronous (fwd and bwd)
    column_parallel_linear  fwd: copy (SP: all-gather) + linear   bwd: all-reduce (SP: reduce-scatter)
                            of the input gradient, asynchronous beside the weight-gradient GEMM
    row_parallel_linear     fwd: linear + all-reduce (SP: reduce-scatter) in place   bwd: identity
                            (SP: all-gather) + linear
    (under trainer.precision=fp8 both linears run their forward and input-gradient GEMMs in FP8,
    mpu/fp8.py; the weight-gradient GEMM stays 16-bit)

and the non-differentiable collectives that code outside mpu/ (and the pipeline/ and dp/
folders above it) calls instead of torch.distributed's (tests/test_module_boundaries.py
checks that it does):

    all_reduce_stats, all_gather_stats, all_to_all_stats   statistics (returns new tensors)
    all_gather_into, reduce_scatter_into                   into preallocated flat buffers
    barrier, broadcast_object, gather_object               synchronisation, Python objects

Transport: CPU tensors of at most 4 MiB over a gloo group whose ranks share one x86-64 host
go through shared memory (`mpu/shm_collectives.py`: all-reduce, all-gather, reduce-scatter,
blocking all-to-all; MESHTRON_SHM_COLLECTIVES=0 turns it off); everything else through torch.distributed.

Sequence-parallel tensors are laid out [s, b, h] so a sequence shard is a contiguous chunk
of dim 0. Every function is the identity (or a local copy) when the group has one member or
is None: None is the trivial group of one process, as everywhere in mpu (torch reads None as
the default group); `world_group()` is the default group when several processes run.

Shape-only mode: over a `mpu.mesh.VirtualGroup` (the groups of `virtual_mesh`, a layout
without processes) the autograd collectives and `all_gather_stats`, given a tensor without
data (meta, or fake while `planning.activations` traces a model), allocate their output as
over `size` ranks and skip the communication: a gather multiplies the dim by the size, a
reduce-scatter or scatter keeps this rank's share, an all-to-all returns the rows its split
sizes name. Tensors with data pass a virtual group as the trivial group (as before).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from meshtron.mpu import fp8
from meshtron.mpu import shm_collectives as shm
from meshtron.mpu.mesh import VirtualGroup, group_rank, group_size
from meshtron.mpu.waits import wait_for

# torch >= 2.13 renames the tensor collectives; keep working on older releases. The
# functions of this file call them through these names (the collective-count test of
# tests/distributed/dense_cases.py patches them); elsewhere use `all_gather_into` and
# `reduce_scatter_into`.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _shape_only(group) -> bool:
    """A virtual group: outputs are allocated, nothing is communicated (see the module doc)."""
    return isinstance(group, VirtualGroup)


def _size(group, x: torch.Tensor) -> int:
    """Ranks a collective of `x` over `group` spans: `group_size`, or a virtual group's planned
    size when `x` has no data (meta or fake tensors)."""
    if _shape_only(group):
        return group.size if (x.is_meta or is_fake(x)) else 1
    return group_size(group)


def _rank(group) -> int:
    """This rank's place in `group` (a virtual group's planned one)."""
    return group.rank if _shape_only(group) else group_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group, x) == 1:
        return x
    x = x.contiguous()
    if _shape_only(group):
        return x
    if shm.eligible(group, x):  # CPU ranks of one host: through shared memory
        shm.all_reduce(x, group)
    else:
        dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _size(group, x)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over {world} ranks")
    return x.chunk(world, dim=dim)[_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _size(group, x)
    if world == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if _shape_only(group):
        pass
    elif shm.eligible(group, x):
        shm.all_gather_into(out, x, group)
    else:
        _all_gather_into(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _size(group, x)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {world} ranks")
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if _shape_only(group):
        pass
    elif shm.eligible(group, x):  # CPU ranks of one host (SP's reduce-scatters): shared memory
        shm.reduce_scatter_into(out, x, group)
    else:
        _reduce_scatter_into(out, x, group=group)
    return out.movedim(0, dim)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 0, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


def _autocast_dtype(device_type: str):
    """The autocast compute dtype active for `device_type`, or None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _ColumnParallelLinear(torch.autograd.Function):
    """enter the TP region (copy, or the SP all-gather) + y = x W^T + b, with the backward
    collective of the input gradient issued asynchronously and overlapped with the weight and
    bias gradient GEMMs (Megatron's async grad all-reduce / reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        dtype = _autocast_dtype(x.device.type)
        if dtype is not None:  # what autocast does for F.linear: compute and save 16-bit copies
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        if sequence_parallel:
            x = _gather(x, 0, group)
        ctx.fp8 = fp8.fp8_mode(x, weight)  # trainer.precision=fp8: FP8 GEMMs (mpu/fp8.py)
        with torch.autocast(x.device.type, enabled=False):
            y = fp8.linear_forward(x, weight, bias, ctx.fp8)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, sp = ctx.group, ctx.sequence_parallel
        grad = grad.contiguous()
        grad_input = work = label = full = None
        in_shm = False  # shared memory is synchronous: reduce after the weight gradient
        if ctx.needs_input_grad[0]:
            grad_input = fp8.linear_input_grad(grad, weight, ctx.fp8)
            if _shape_only(group):
                grad_input = _reduce_scatter(grad_input, 0, group) if sp else grad_input
            elif sp:
                full = grad_input
                grad_input = torch.empty(
                    (full.shape[0] // _size(group, full),) + tuple(full.shape[1:]), dtype=full.dtype, device=full.device
                )
                in_shm = shm.eligible(group, full)
                if not in_shm:
                    work = _reduce_scatter_into(grad_input, full, group=group, async_op=True)
                    label = "reduce_scatter of a column-parallel input gradient over tp"
            else:
                in_shm = shm.eligible(group, grad_input)
                if not in_shm:
                    work = dist.all_reduce(grad_input, group=group, async_op=True)
                    label = "all_reduce of a column-parallel input gradient over tp"
        # Independent of the collective in flight: the weight and bias gradients.
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if work is not None:
            wait_for(work, label)
        elif in_shm and sp:  # by now the other ranks have their part ready too
            shm.reduce_scatter_into(grad_input, full, group)
        elif in_shm:
            shm.all_reduce(grad_input, group)
        return grad_input, grad_weight, grad_bias, None, None


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group, *, sequence_parallel: bool = False
) -> torch.Tensor:
    """`F.linear(enter(x), weight, bias)` for a weight split by output rows over `group`, where
    enter is `copy_to_region` (or `gather_from_sequence` with `sequence_parallel`: x is a
    sequence shard [s/tp, b, h]). Same values and gradients as those two calls; backward starts
    the input gradient's all-reduce (reduce-scatter) over `group` asynchronously and computes
    the weight and bias gradients while it is in flight. A group of one is plain F.linear."""
    if _size(group, x) == 1:
        return fp8.linear(x, weight, bias)
    return _ColumnParallelLinear.apply(x, weight, bias, group, sequence_parallel)


class _RowParallelLinear(torch.autograd.Function):
    """y = all-reduce(x W^T) over the TP group (SP: reduce-scatter along dim 0), the GEMM's
    output reduced in place (no copy); backward: identity (SP: all-gather) of the output
    gradient, then the input and weight gradient GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, group, sequence_parallel):
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        dtype = _autocast_dtype(x.device.type)
        if dtype is not None:
            x, weight = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.fp8 = fp8.fp8_mode(x, weight)  # trainer.precision=fp8: FP8 GEMMs (mpu/fp8.py)
        # Splitting the GEMM into row chunks whose all-reduces overlap the next chunk's GEMM
        # was measured no faster at tp=2 on the 2-core CPU (bench/README.md), so one GEMM.
        with torch.autocast(x.device.type, enabled=False):
            y = fp8.linear_forward(x, weight, None, ctx.fp8)
        return _reduce_scatter(y, 0, group) if sequence_parallel else _all_reduce(y, group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = _gather(grad, 0, ctx.group) if ctx.sequence_parallel else grad.contiguous()
        grad_input = fp8.linear_input_grad(grad, weight, ctx.fp8) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return grad_input, grad_weight, None, None


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, group, *, sequence_parallel: bool = False
) -> torch.Tensor:
    """`reduce_from_region(F.linear(x, weight))` (with `sequence_parallel`:
    `reduce_scatter_to_sequence`) for a weight split by input columns over `group`, x this
    rank's slice of the features; same values and gradients, without the copy of the GEMM's
    output. A group of one is plain F.linear."""
    if _size(group, x) == 1:
        return fp8.linear(x, weight)
    return _RowParallelLinear.apply(x, weight, group, sequence_parallel)


def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over `group` backward."""
    return x if _size(group, x) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) over `group` forward; identity backward."""
    return x if _size(group, x) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Keep this rank's chunk of `dim` forward; all-gather the gradient over `group` backward."""
    return x if _size(group, x) == 1 else _ScatterToRegion.apply(x, dim, group)


def gather_from_region(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather chunks along `dim` over `group` forward; keep own gradient chunk backward."""
    return x if _size(group, x) == 1 else _GatherFromRegion.apply(x, dim, group)


def gather_from_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """SP: all-gather sequence shards ([s/tp, b, h] -> [s, b, h]); reduce-scatter backward."""
    return x if _size(group, x) == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """SP: sum partial [s, b, h] over `group` and keep own sequence shard; all-gather backward."""
    return x if _size(group, x) == 1 else _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """SP: keep own sequence shard of a replicated [s, b, h]; all-gather backward."""
    return scatter_to_region(x, 0, group)


# ------------------------------------------------------------ non-differentiable collectives


@torch.no_grad()
def all_reduce_stats(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """Non-differentiable all-reduce of statistics (counts, maxima) over `group`; returns a new tensor."""
    out = x.detach().clone(memory_format=torch.contiguous_format)
    if group_size(group) > 1:
        if op == "sum" and shm.eligible(group, out):
            shm.all_reduce(out, group)
        else:
            dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=group)
    return out


@torch.no_grad()
def all_gather_stats(x: torch.Tensor, group) -> torch.Tensor:
    """Non-differentiable all-gather of equal-shape statistics: [group_size, *x.shape], in rank order."""
    x = x.detach().contiguous()
    world = _size(group, x)
    if world == 1:
        return x.unsqueeze(0).clone()
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    if _shape_only(group):
        pass
    elif shm.eligible(group, x):
        shm.all_gather_into(out, x.reshape(-1), group)
    else:
        _all_gather_into(out, x.reshape(-1), group=group)
    return out.view((world,) + tuple(x.shape))


@torch.no_grad()
def all_to_all_stats(x: torch.Tensor, group) -> torch.Tensor:
    """Non-differentiable all-to-all of equal chunks along dim 0 (e.g. token counts per expert):
    chunk i goes to rank i of `group`; returns the chunks received, in source-rank order."""
    world = group_size(group)
    if world == 1:
        return x.clone()
    out = torch.empty_like(x.contiguous())
    chunk = x.shape[0] // world
    if not (shm.eligible(group, out[:0]) and shm.all_to_all(out, x, [chunk] * world, [chunk] * world, group)):
        dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def world_group():
    """The default (world) process group when more than one process runs, else None (the
    trivial group: the functions here then do no communication)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """Fill the flat `output` with the equal-size `input` of every rank of `group`, in rank
    order (`output.numel() == group size * input.numel()`). Returns the work handle with
    `async_op`, else None; a group of one copies `input` into `output`."""
    if group_size(group) == 1:
        output.view(-1).copy_(input.reshape(-1))
        return None
    return _all_gather_into(output, input, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """Sum the flat `input` over `group` and write this rank's chunk (rank order, `output.numel()`
    elements each) into `output`. Returns the work handle with `async_op`, else None; a group
    of one copies `input` into `output`."""
    if group_size(group) == 1:
        output.view(-1).copy_(input.reshape(-1))
        return None
    return _reduce_scatter_into(output, input, group=group, async_op=async_op)


def barrier(group) -> None:
    """Return once every rank of `group` has called it."""
    if group_size(group) > 1:
        dist.barrier(group=group)


def broadcast_object(obj, group, src: int = 0):
    """Rank `src`'s (global rank) picklable `obj`, on every rank of `group`."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_object(obj, group, dst: int = 0) -> list | None:
    """On rank `dst` (global rank): the picklable `obj` of every rank of `group`, in group rank
    order; None on the other ranks."""
    if group_size(group) == 1:
        return [obj]
    gathered = [None] * group_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst, group=group)
    return gathered


# ----------------------------------------------------------------- differentiable all-to-all


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((sum(output_splits),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if _shape_only(group):
        pass
    elif not (shm.eligible(group, x[:0]) and shm.all_to_all(out, x, output_splits, input_splits, group)):
        dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows of `x` in chunks of `input_splits` go to the ranks of `group` in order; returns the
    rows received (`output_splits` from each rank). Backward: the reverse all-to-all."""
    if _size(group, x) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


def _gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """All-gather row blocks of different lengths (padded to the longest for the collective)."""
    longest = max(sizes)
    padded = x.new_zeros((longest,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    out = torch.empty((len(sizes) * longest,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if not _shape_only(group):
        _all_gather_into(out, padded.contiguous(), group=group)
    blocks = out.split(longest)
    return torch.cat([block[:n] for block, n in zip(blocks, sizes)])


def _own_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    start = sum(sizes[: _rank(group)])
    return x[start : start + sizes[_rank(group)]].contiguous()


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_rows(_all_reduce(grad.contiguous().clone(), ctx.group), ctx.sizes, ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _own_rows(_all_reduce(x.contiguous().clone(), group), sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad.contiguous(), ctx.sizes, ctx.group), None, None


def gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """All-gather row blocks of uneven lengths (`sizes[r]` rows from rank r) over `group`;
    backward: sum the gradient over `group` and keep own rows (a reduce-scatter)."""
    return x if _size(group, x) == 1 else _GatherRows.apply(x, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum partial results over `group` and keep own block of `sizes[rank]` rows;
    backward: all-gather the row blocks."""
    return x if _size(group, x) == 1 else _ReduceScatterRows.apply(x, sizes, group)


class _SequenceGathered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, full, group):
        ctx.group = group
        return full

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 0, ctx.group), None, None


def sequence_gathered(local: torch.Tensor, full: torch.Tensor, group) -> torch.Tensor:
    """`gather_from_sequence(local, group)` when its result is already at hand: `full` must be
    the all-gather of the sequence shards `local` over `group` (tp > 1 without SP, where the
    shard was cut from a replicated input). Forward returns `full` without communication (no
    gradient flows into `full` itself); backward reduce-scatters the gradient into `local`."""
    if _size(group, local) == 1:
        return local
    return _SequenceGathered.apply(local, full.detach(), group)


# ----------------------------------------------------------------- asynchronous all-to-all

# Forward overlap: `all_to_all_start` issues the exchange and returns; the caller runs
# independent work (the MoE layer: its shared experts) before `all_to_all_wait`.
# Backward overlap: `all_to_all_wait`'s backward starts the reverse all-to-all of the gradients
# and returns; autograd runs the nodes recorded between start and wait (the shared experts)
# while they travel; `all_to_all_start`'s backward awaits them. Every rank issues its
# collectives in the same order: the CPU autograd engine runs ready nodes in decreasing order
# of creation, and a node's prerequisites are all created after it, so backward runs in
# reverse creation order, the same on every rank whose forward ran the same program (empty
# tensors on some ranks remove no collective). A rank blocked in another collective (tp) has
# already started the all-to-all its ep peers wait for, so no wait can close a cycle. (The
# 8-rank interleaved pipeline ep=4 x tp=2 "hang" that turned this off on 2026-11-23 came with
# ~640 busy-polling gloo threads per rank, removed in the same commit. On 2026-11-26, with
# asynchronous backward exchanges forced on, every case of the 2-, 4- and 8-rank test worlds
# passed, that pipeline case three times alone; it keeps running that way in
# tests/distributed/pipeline_cases, and moe_dispatch_cases checks overlap and bit-equality.)
# ASYNC_EXCHANGES None: by transport, both directions. NCCL: asynchronous (the exchange runs on
# NCCL's stream beside the compute). gloo: blocking, because a blocking exchange between ranks
# of one host goes through shared memory (shm_collectives.all_to_all), faster on CPUs than
# gloo's asynchronous one, and the shared-expert work it could hide is small there (measured
# 2026-11-26, issue-12 MoE model at ep=2 on the 2-core host, 6 alternating 30-step runs of
# bench/throughput.py: +7% tokens/s for blocking forward exchanges; gloo between hosts keeps
# the asynchronous exchange). True / False force it (tests).
ASYNC_EXCHANGES: bool | None = None


def async_exchanges(group) -> bool:
    """Whether the MoE all-to-alls over `group`, forward and backward, run asynchronously
    (see ASYNC_EXCHANGES); otherwise each completes where it starts."""
    if ASYNC_EXCHANGES is not None:
        return ASYNC_EXCHANGES
    return group_size(group) > 1 and "nccl" in str(dist.get_backend(group)).lower()


class AllToAllHandle:
    """One asynchronous all-to-all over `group` (`all_to_all_start`), and in backward the
    reverse all-to-all of its gradients (started by `all_to_all_wait`'s backward, awaited by
    `all_to_all_start`'s backward). Holds the in-flight work handles and keeps the tensors
    they read and write alive until they are awaited."""

    def __init__(self, output_splits: list[int], input_splits: list[int], group):
        self.output_splits, self.input_splits, self.group = list(output_splits), list(input_splits), group
        self.asynchronous = async_exchanges(group)  # both directions of this exchange
        self.works: list = []
        self.keep: list = []
        self.differentiable: tuple[bool, ...] = ()
        self.grad_works: list = []
        self.grads: tuple = ()

    def label(self, direction: str) -> str:
        """What a wait on this exchange is for, in hang reports (mpu/waits.py)."""
        return (
            f"all_to_all ({direction}) of {sum(self.input_splits)} rows out, {sum(self.output_splits)} in "
            f"over a group of {len(self.input_splits)}"
        )

    def wait(self) -> None:
        for work in self.works:
            wait_for(work, self.label("forward"))
        self.works, self.keep = [], []

    def wait_grads(self) -> tuple:
        for work in self.grad_works:
            wait_for(work, self.label("backward"))
        grads, self.grad_works, self.grads = self.grads, [], ()
        return grads


def _start_all_to_all(tensors, output_splits: list[int], input_splits: list[int], group, *, blocking: bool = False):
    """Issue one asynchronous `all_to_all_single` per tensor (same splits); (outputs, works).
    `blocking` (no overlap wanted): complete it here through shared memory where eligible
    (no work handle); elsewhere it stays asynchronous."""
    outs, works = [], []
    for x in tensors:
        x = x.contiguous()
        out = torch.empty((sum(output_splits),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        if _shape_only(group):
            pass
        elif blocking and shm.eligible(group, x[:0]) and shm.all_to_all(out, x, output_splits, input_splits, group):
            pass
        else:
            works.append(
                dist.all_to_all_single(
                    out, x, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group, async_op=True
                )
            )
        outs.append((out, x))
    return outs, works


class _AllToAllStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle, *tensors):
        ctx.handle = handle
        handle.differentiable = tuple(ctx.needs_input_grad[1:])
        outs, handle.works = _start_all_to_all(
            tensors, handle.output_splits, handle.input_splits, handle.group, blocking=not handle.asynchronous
        )
        handle.keep = outs
        results = tuple(out for out, _ in outs)
        ctx.mark_non_differentiable(*[r for r, d in zip(results, handle.differentiable) if not d])
        return results

    @staticmethod
    def backward(ctx, *grads):
        # _AllToAllWait.backward started the reverse all-to-all of these gradients; await it.
        return (None,) + ctx.handle.wait_grads()


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle, *tensors):
        ctx.handle = handle
        handle.wait()
        ctx.mark_non_differentiable(*[t for t, d in zip(tensors, handle.differentiable) if not d])
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        handle = ctx.handle
        send = [g for g, d in zip(grads, handle.differentiable) if d]
        outs, handle.grad_works = _start_all_to_all(
            send, handle.input_splits, handle.output_splits, handle.group, blocking=not handle.asynchronous
        )
        received = iter(outs)
        handle.grads = tuple(next(received)[0] if d else None for d in handle.differentiable)
        handle.keep = outs  # the gradients being sent stay alive until wait_grads
        if not handle.asynchronous:
            # Complete the exchange here, at the point a blocking all-to-all would run, so
            # collectives in backward keep the order they have in a blocking graph.
            for work in handle.grad_works:
                wait_for(work, handle.label("backward"))
            handle.grad_works = []
        # Identity: the gradients flow on unchanged to _AllToAllStart.backward, which returns
        # the received buffers (waiting first if the exchange is still in flight).
        return (None,) + tuple(g if d else None for g, d in zip(grads, handle.differentiable))


def all_to_all_start(
    tensors: list[torch.Tensor], output_splits: list[int], input_splits: list[int], group
) -> tuple[tuple[torch.Tensor, ...], AllToAllHandle]:
    """Start the all-to-all of `all_to_all` for each of `tensors` (rows in chunks of
    `input_splits` to the ranks of `group`; `output_splits` rows from each) and return (the
    receive buffers, the handle). Where exchanges are asynchronous (`async_exchanges`: NCCL)
    the buffers hold nothing until `all_to_all_wait` has been called on them: run independent
    work in between. Over gloo between ranks of one host the exchange completes here, through
    shared memory (gloo between hosts: asynchronous).

    Backward: `all_to_all_wait`'s backward starts the reverse all-to-all of the gradients and,
    where exchanges are asynchronous, returns at once and this function's backward awaits it,
    so the nodes recorded between start and wait run while the gradients are in flight; over
    gloo it completes the exchange at once (through shared memory on one host). Tensors that
    do not require grad (e.g. integer metadata) travel forward only. Every rank of `group`
    must start and wait in the same order, as for any collective.
    """
    handle = AllToAllHandle(output_splits, input_splits, group)
    if _size(group, tensors[0]) == 1:
        return tuple(tensors), handle
    return _AllToAllStart.apply(handle, *tensors), handle


def all_to_all_wait(tensors: tuple[torch.Tensor, ...], handle: AllToAllHandle) -> tuple[torch.Tensor, ...]:
    """Wait for the all-to-all `handle` (from `all_to_all_start`) and return its received
    `tensors`, now filled; see `all_to_all_start` for the backward."""
    if _size(handle.group, tensors[0]) == 1:
        return tuple(tensors)
    return _AllToAllWait.apply(handle, *tensors)
