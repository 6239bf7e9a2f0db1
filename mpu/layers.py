"""Tensor-parallel layers: column/row-parallel linear and vocab-parallel embedding.

All activations are laid out [s, b, h]. With sequence parallelism (SP) the tensors between
TP regions are sequence shards [s/tp, b, h]: a column-parallel layer all-gathers its input
along the sequence and a row-parallel layer reduce-scatters its output, instead of the
copy / all-reduce pair used without SP. Every collective goes over the mesh's TP group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.mpu.init import constant_init, normal_init, tag
from meshtron.mpu.mappings import (
    column_parallel_linear,
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    row_parallel_linear,
)
from meshtron.mpu.mesh import Mesh


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tp={d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows over the TP group.

    Input is replicated over TP (or a sequence shard under SP, all-gathered here); output is
    this rank's slice of the features unless `gather_output` all-gathers it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.mesh = mesh
        self.gather_output = gather_output
        local_out = _divide(out_features, mesh.tp_size, "out_features")
        self.weight = tag(
            nn.Parameter(torch.empty(local_out, in_features, device=device, dtype=dtype)),
            normal_init((out_features, in_features), init_std),
            tp_shard_dim=0,
        )
        self.bias = None
        if bias:
            self.bias = tag(
                nn.Parameter(torch.empty(local_out, device=device, dtype=dtype)),
                constant_init((out_features,), 0.0),
                tp_shard_dim=0,
            )

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        # One autograd node for the region entry and the GEMM: its backward overlaps the input
        # gradient's TP collective with the weight-gradient GEMM.
        y = column_parallel_linear(
            x,
            self.weight if weight is None else weight,
            self.bias,
            self.mesh.tp,
            sequence_parallel=self.mesh.sequence_parallel,
        )
        if self.gather_output:
            y = gather_from_region(y, -1, self.mesh.tp)
        return y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; x arrives already split over TP.

    The partial products are all-reduced over TP (reduce-scattered along the sequence under
    SP); the bias is replicated and added after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        *,
        bias: bool = True,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.mesh = mesh
        local_in = _divide(in_features, mesh.tp_size, "in_features")
        self.weight = tag(
            nn.Parameter(torch.empty(out_features, local_in, device=device, dtype=dtype)),
            normal_init((out_features, in_features), init_std),
            tp_shard_dim=1,
        )
        self.bias = None
        if bias:
            self.bias = tag(
                nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)),
                constant_init((out_features,), 0.0),
                sequence_parallel=mesh.sequence_parallel,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = row_parallel_linear(x, self.weight, self.mesh.tp, sequence_parallel=self.mesh.sequence_parallel)
        return y if self.bias is None else y + self.bias


def enter_tp_region(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Make a replicated (or SP-sharded) [s, b, h] input usable by column-parallel weights."""
    if mesh.sequence_parallel:
        return gather_from_sequence(x, mesh.tp)
    return copy_to_region(x, mesh.tp)


def exit_tp_region(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Sum row-parallel partial outputs over TP (reduce-scatter along the sequence under SP)."""
    if mesh.sequence_parallel:
        return reduce_scatter_to_sequence(x, mesh.tp)
    return reduce_from_region(x, mesh.tp)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the padded vocabulary) are split over the TP group.

    Each rank looks up the ids in its vocab range, zeros the rest, and the partial results
    are summed over TP (reduce-scattered along the sequence under SP). Rows past the real
    vocabulary are initialized to zero and never looked up.
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        hidden_size: int,
        mesh: Mesh,
        *,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.mesh = mesh
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        local = _divide(padded_vocab_size, mesh.tp_size, "padded_vocab_size")
        self.vocab_start = mesh.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = tag(
            nn.Parameter(torch.empty(local, hidden_size, device=device, dtype=dtype)),
            normal_init((padded_vocab_size, hidden_size), init_std, valid_rows=vocab_size),
            tp_shard_dim=0,
        )
        self.weight.valid_rows = vocab_size  # rows past it are padding (not checkpointed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [s, b] (global vocabulary) -> embeddings [s, b, h] (sequence shard under SP)."""
        if self.mesh.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(partial, self.mesh)
