"""Layout-independent sharded state for `torch.distributed.checkpoint` (DCP).

A tensor in a checkpoint is stored under its *global* shape: the full, unsharded value, with
the vocabulary padding removed (the padded vocabulary depends on tp, the real one does not).
Each rank contributes `ShardPiece`s: its local tensor plus the offsets of that block in the
global tensor. DCP writes every piece once (replicas of the same block, e.g. over dp, are
de-duplicated) and on load each rank reads exactly the block it owns from whichever files
hold it, so a checkpoint saved under one layout loads under any other (tp, pp, ep, etp, dp).

Pieces are described with DCP's own chunk metadata (`ChunkStorageMetadata`), so no DTensor
or DeviceMesh is needed and uneven blocks (a TP rank whose vocabulary slice is partly or
wholly padding) are fine. `ShardSavePlanner` / `ShardLoadPlanner` teach DCP's default
planners about pieces; everything else in a state dict (plain tensors = replicated values,
other objects = pickled bytes) keeps DCP's default handling.

A value may also be a list of pieces of one tensor (saving only): `flat_range_pieces` turns a
contiguous range of a local tensor's flattened elements (a ZeRO shard of a gradient bucket
cuts parameters that way) into the boxes of the global tensor it covers: a partial first row,
the full rows in between and a partial last row, recursively over the trailing dims (at most
2·ndim - 1 boxes). Decision: boxes rather than 1-D flattened tensors, so a ZeRO shard is
stored under the same name and global shape as the unsharded moments and any layout, ZeRO
stage or optimizer reads it back with the same load code (DCP reads a block from however many
saved boxes overlap it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshtron.mpu.init import local_offsets


@dataclass
class ShardPiece:
    """`local` is the block of a global tensor of shape `global_shape` starting at `offsets`."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.local.shape)


def _mesh_size(mesh, axis: str) -> int:
    return getattr(mesh.par, axis)


def global_shape(param: nn.Parameter, mesh) -> tuple[int, ...]:
    """Shape of the full value of `param` (sharded along `param.shards` on `mesh`), with the
    vocabulary padding of `param.valid_rows` (first dim) removed."""
    shape = list(param.shape)
    for dim, axis in getattr(param, "shards", ()):
        shape[dim] *= _mesh_size(mesh, axis)
    valid_rows = getattr(param, "valid_rows", None)
    if valid_rows is not None:
        shape[0] = valid_rows
    return tuple(shape)


def shard_piece(param: nn.Parameter, local: torch.Tensor, mesh) -> ShardPiece | None:
    """The piece of the global tensor that `local` (shaped like `param` on this rank) holds,
    or None when it holds only vocabulary padding.

    Offsets follow `mpu.init.local_shard`: equal contiguous chunks, one split per (dim, axis)
    of `param.shards`, applied in order (experts: ep first, then etp inside it).
    """
    offsets = local_offsets(param, mesh)
    valid_rows = getattr(param, "valid_rows", None)
    if valid_rows is not None:
        keep = min(local.shape[0], valid_rows - offsets[0])
        if keep <= 0:
            return None
        local = local[:keep]
    return ShardPiece(local, offsets, global_shape(param, mesh))


def _boxes(shape: tuple[int, ...], first: int, last: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(start index, box shape) of the boxes that elements [first, last) of a row-major tensor
    of `shape` make up, in flat order (each box is a contiguous run of those elements)."""
    if first >= last:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if first % inner == 0 and last % inner == 0:  # whole rows
        return [((first // inner,) + (0,) * (len(shape) - 1), (last // inner - first // inner,) + tuple(shape[1:]))]
    row = first // inner
    if row == (last - 1) // inner:  # inside one row
        return [
            ((row,) + start, (1,) + box)
            for start, box in _boxes(tuple(shape[1:]), first - row * inner, last - row * inner)
        ]
    head_end, tail_start = (row + 1) * inner, (last // inner) * inner
    return _boxes(shape, first, head_end) + _boxes(shape, head_end, tail_start) + _boxes(shape, tail_start, last)


def flat_range_pieces(param: nn.Parameter, first: int, values: torch.Tensor, mesh) -> list[ShardPiece]:
    """The pieces of the global tensor of `param` that `values` covers: `values` (1-D) holds
    elements [first, first + len) of this rank's flattened local tensor of `param` (e.g. its
    slice of a ZeRO bucket shard). Vocabulary padding is left out; each piece's `local` is a
    view of `values`."""
    whole = shard_piece(param, param.data, mesh)
    if whole is None:
        return []
    shape = tuple(whole.local.shape)  # padding rows trimmed: they are the flat tail
    last = min(first + values.numel(), math.prod(shape))
    pieces, at = [], first
    for start, box in _boxes(shape, first, last):
        n = math.prod(box)
        local = values[at - first : at - first + n].view(box)
        pieces.append(ShardPiece(local, tuple(o + s for o, s in zip(whole.offsets, start)), whole.global_shape))
        at += n
    return pieces


def _as_pieces(value) -> list[ShardPiece] | None:
    if isinstance(value, ShardPiece):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, ShardPiece) for v in value):
        return value
    return None


class ShardSavePlanner(DefaultSavePlanner):
    """DCP save planner that writes `ShardPiece` values (or lists of pieces of one tensor) as
    chunks of their global tensor."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self._pieces = {k: p for k, v in state_dict.items() if (p := _as_pieces(v)) is not None}
        self._by_index = {MetadataIndex(k, torch.Size(p.offsets)): p for k, ps in self._pieces.items() for p in ps}
        plain = {
            k: (self._pieces[k][0].local if k in self._pieces else v)
            for k, v in state_dict.items()
            if k in self._pieces or not isinstance(v, list) or v
        }
        super().set_up_planner(plain, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            for piece in self._pieces.get(item.index.fqn, [None]):
                if piece is not None:
                    offsets = torch.Size(piece.offsets)
                    tensor_data = dataclasses.replace(
                        item.tensor_data, chunk=piece.chunk(), size=torch.Size(piece.global_shape)
                    )
                    item = dataclasses.replace(
                        item,
                        index=MetadataIndex(item.index.fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=tensor_data,
                    )
                items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self._pieces:
            return self._by_index[MetadataIndex(index.fqn, index.offset)].local
        return super().lookup_object(index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that fills `ShardPiece` values with their block of the global tensor
    (reading it from however the checkpoint was split). Shapes are checked beforehand by the
    caller (a mismatch is reported by name there)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self._pieces = {k: v for k, v in state_dict.items() if isinstance(v, ShardPiece)}
        self._caller_state = state_dict
        plain = {k: v for k, v in state_dict.items() if not isinstance(v, ShardPiece)}
        super().set_up_planner(plain, metadata, is_coordinator)

    def load_bytes(self, read_item, value) -> None:
        """Non-tensor values are handed back in the caller's dict (not a private copy)."""
        super().load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        self._caller_state[fqn] = self.state_dict[fqn]

    def create_local_plan(self) -> LoadPlan:
        plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, piece in self._pieces.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"tensor {fqn} is missing from the checkpoint")
            if tuple(md.size) != tuple(piece.global_shape):
                raise ValueError(f"tensor {fqn}: checkpoint shape {tuple(md.size)} != expected {piece.global_shape}")
            items += create_read_items_for_chunk_list(fqn, md, [piece.chunk()])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._pieces:
            return self._pieces[index.fqn].local
        return super().lookup_tensor(index)
