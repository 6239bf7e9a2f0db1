"""Layout-independent parameter initialization.

Every parameter carries an `init_fn(generator) -> full tensor` describing its *full*
(unsharded) value and `shards`: the (dim, mesh axis) pairs it is split along, in equal
contiguous chunks ("tp" for dense tensor parallelism, "ep" and "etp" for experts).
`initialize_parameters` seeds one generator per parameter from (seed, parameter name),
builds the full value and keeps this rank's shard, so a parameter's full value depends only
on the seed and its name, never on the layout. The cost is generating each full tensor once
per rank.

Other tags read by the gradient code: `sequence_parallel` (replicated over TP but fed by
distinct tokens on each TP rank: gradient summed over tp x dp) and `expert` (lives on the
expert mesh: gradient summed over the expert-data-parallel group).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

InitFn = Callable[[torch.Generator], torch.Tensor]


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from (seed, name) that is the same in every process and run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def normal_init(shape: tuple[int, ...], std: float, valid_rows: int | None = None) -> InitFn:
    """N(0, std) over `shape`; rows at or past `valid_rows` (vocabulary padding) are zero."""

    def fn(gen: torch.Generator) -> torch.Tensor:
        rows = shape[0] if valid_rows is None else valid_rows
        full = torch.zeros(shape)
        full[:rows] = torch.randn((rows,) + tuple(shape[1:]), generator=gen) * std
        return full

    return fn


def constant_init(shape: tuple[int, ...], value: float) -> InitFn:
    """A tensor of `shape` filled with `value`."""
    return lambda gen: torch.full(shape, float(value))


def tag(
    param: nn.Parameter,
    init_fn: InitFn,
    tp_shard_dim: int | None = None,
    sequence_parallel: bool = False,
    expert_shards: tuple[tuple[int, str], ...] | None = None,
) -> nn.Parameter:
    """Attach sharding metadata to `param` and return it.

    tp_shard_dim: the dim split in equal contiguous chunks over the TP group (None = replicated).
    sequence_parallel: replicated over TP but fed by distinct tokens per TP rank (sequence
    shards), so its gradient must be summed over the TP group.
    expert_shards: for expert weights, ((dim, "ep"), (dim, "etp")) splits on the expert mesh.
    """
    param.init_fn = init_fn
    param.tp_shard_dim = tp_shard_dim
    param.sequence_parallel = sequence_parallel
    param.expert = expert_shards is not None
    param.shards = (
        tuple(expert_shards)
        if expert_shards is not None
        else (((tp_shard_dim, "tp"),) if tp_shard_dim is not None else ())
    )
    return param


def shard_of(full: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """This rank's contiguous chunk of `full` along `dim` (the whole tensor when dim is None)."""
    if dim is None or size == 1:
        return full
    return full.chunk(size, dim=dim)[rank]


def local_shard(full: torch.Tensor, shards, mesh) -> torch.Tensor:
    """This rank's piece of `full` for the (dim, axis) splits in `shards` on `mesh`."""
    for dim, axis in shards:
        full = shard_of(full, dim, getattr(mesh, f"{axis}_rank"), getattr(mesh.par, axis))
    return full


def local_offsets(param: torch.Tensor, mesh) -> tuple[int, ...]:
    """Where this rank's piece of `param` (shaped like the local parameter, split along
    `param.shards` on `mesh` as `local_shard` splits) starts in the full tensor, per dim."""
    offsets = [0] * param.dim()
    block = list(param.shape)
    for dim, axis in getattr(param, "shards", ()):
        block[dim] *= getattr(mesh.par, axis)
    for dim, axis in getattr(param, "shards", ()):
        block[dim] //= getattr(mesh.par, axis)
        offsets[dim] += getattr(mesh, f"{axis}_rank") * block[dim]
    return tuple(offsets)


@torch.no_grad()
def full_tensor(local: torch.Tensor, shards, mesh) -> torch.Tensor:
    """Inverse of `local_shard`: the full tensor of this rank's piece `local` (a parameter, its
    gradient or any tensor split like it), all-gathered over the group of each (dim, axis)
    split in `shards` on `mesh` (tp / ep / etp). Every rank of those groups must call it."""
    from meshtron.mpu.mappings import gather_from_region

    full = local.detach()
    for dim, axis in reversed(shards):
        full = gather_from_region(full, dim, getattr(mesh, axis))
    return full


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int, mesh) -> None:
    """Fill every tagged parameter of `model` with this rank's shard (on `mesh`) of its
    layout-independent value."""
    for name, param in model.named_parameters():
        init_fn = getattr(param, "init_fn", None)
        if init_fn is None:
            raise RuntimeError(f"parameter {name} has no init_fn; create it with mpu.init.tag")
        gen = torch.Generator().manual_seed(stable_seed(seed, name))
        local = local_shard(init_fn(gen), param.shards, mesh)
        if local.shape != param.shape:
            raise RuntimeError(f"init of {name}: shard shape {tuple(local.shape)} != parameter {tuple(param.shape)}")
        param.copy_(local.to(param.dtype))
