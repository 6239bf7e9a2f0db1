"""Layout-independent parameter initialization, generated in proportion to the shard.

Every parameter carries an `init_fn` (a `ParamInit`: `normal_init`, `constant_init`)
describing its *full* (unsharded) value and `shards`: the (dim, mesh axis) pairs it is split
along, in equal contiguous chunks ("tp" for dense tensor parallelism, "ep" and "etp" for
experts). A random full value is defined tile by tile: the tensor is cut into fixed tiles
(`tile_shape`: 256 x 256 over the last two dims, one index of every dim before them;
65,536 elements of a vector), and each tile is drawn from its own generator seeded by (seed,
parameter name, tile index). `initialize_parameters` fills this rank's block of the full
tensor by drawing only the tiles that block overlaps, straight into the parameter, so a
parameter's full value depends only on the seed and its name, never on the layout, and a
rank's cost (time and memory) is its shard's plus at most one tile around each block edge.

Other tags read by the gradient code: `sequence_parallel` (replicated over TP but fed by
distinct tokens on each TP rank: gradient summed over tp x dp) and `expert` (lives on the
expert mesh: gradient summed over the expert-data-parallel group).
"""

from __future__ import annotations

import abc
import hashlib
import itertools

import torch
from torch import nn

TILE_2D = (256, 256)  # tile of the last two dims of a tensor
TILE_1D = 65536  # tile of a vector


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from (seed, name) that is the same in every process and run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tile_shape(ndim: int) -> tuple[int, ...]:
    """The tile of a tensor with `ndim` dims: one index of each leading dim, TILE_2D over the last two."""
    if ndim == 0:
        return ()
    if ndim == 1:
        return (TILE_1D,)
    return (1,) * (ndim - 2) + TILE_2D


class ParamInit(abc.ABC):
    """A parameter's full value of `shape`, any block of which can be produced alone."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = tuple(int(n) for n in shape)

    @abc.abstractmethod
    def fill_block(self, out: torch.Tensor, seed: int, name: str, offsets: tuple[int, ...]) -> None:
        """Write the block of the full value that starts at `offsets` (shaped like `out`) into `out`."""

    def __call__(self, seed: int = 0, name: str = "") -> torch.Tensor:
        """The full value (a standalone module's default; models fill blocks per rank)."""
        full = torch.empty(self.shape)
        self.fill_block(full, seed, name, (0,) * len(self.shape))
        return full


class _Normal(ParamInit):
    def __init__(self, shape, std: float, valid_rows: int | None):
        super().__init__(shape)
        self.std, self.valid_rows = float(std), valid_rows

    def fill_block(self, out, seed, name, offsets):
        tile = tile_shape(out.dim())
        spans = [range(o // t, (o + n - 1) // t + 1) for o, n, t in zip(offsets, out.shape, tile)]
        for index in itertools.product(*spans):
            start = [i * t for i, t in zip(index, tile)]
            size = [min(t, full - s) for t, full, s in zip(tile, self.shape, start)]
            gen = torch.Generator().manual_seed(stable_seed(seed, f"{name}@{index}"))
            values = torch.randn(size, generator=gen).mul_(self.std)
            lo = [max(s, o) for s, o in zip(start, offsets)]
            hi = [min(s + n, o + m) for s, n, o, m in zip(start, size, offsets, out.shape)]
            src = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
            out[dst].copy_(values[src])
        if self.valid_rows is not None:  # vocabulary padding rows are zero
            out[max(0, self.valid_rows - offsets[0]) :].zero_()


class _Constant(ParamInit):
    def __init__(self, shape, value: float):
        super().__init__(shape)
        self.value = float(value)

    def fill_block(self, out, seed, name, offsets):
        out.fill_(self.value)


def normal_init(shape: tuple[int, ...], std: float, valid_rows: int | None = None) -> ParamInit:
    """N(0, std) over `shape`, drawn tile by tile; rows at or past `valid_rows` (vocabulary padding) are zero."""
    return _Normal(shape, std, valid_rows)


def constant_init(shape: tuple[int, ...], value: float) -> ParamInit:
    """A tensor of `shape` filled with `value`."""
    return _Constant(shape, value)


def tag(
    param: nn.Parameter,
    init_fn: ParamInit,
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
    layout-independent value, drawing only the tiles the shard overlaps."""
    for name, param in model.named_parameters():
        init = getattr(param, "init_fn", None)
        if init is None:
            raise RuntimeError(f"parameter {name} has no init_fn; create it with mpu.init.tag")
        full = list(param.shape)
        for dim, axis in param.shards:
            full[dim] *= getattr(mesh.par, axis)
        if tuple(full) != init.shape:
            raise RuntimeError(
                f"init of {name}: the shard {tuple(param.shape)} makes a full tensor {tuple(full)}, "
                f"its init describes {init.shape}"
            )
        out = param if param.dtype == torch.float32 and param.device.type == "cpu" else torch.empty(param.shape)
        init.fill_block(out, seed, name, local_offsets(param, mesh))
        if out is not param:
            param.copy_(out)
