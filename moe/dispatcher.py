"""Token dispatch to experts over the expert-parallel group, and the way back.

dispatch: sort the (token, choice) pairs by expert, exchange per-expert counts with an
all-to-all over `ep`, send the pairs' activations with an uneven all-to-all over `ep`
(`all_to_all_single` with split sizes), all-gather them over `etp` when experts are
tensor-parallel, and regroup the received rows by local expert for the grouped GEMM.
combine: the exact reverse (ungroup, reduce-scatter over etp, all-to-all back), returning
rows aligned with the sorted pairs. The split sizes are the one host sync of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpu.mappings import all_gather_stats, all_to_all, all_to_all_stats, gather_rows, reduce_scatter_rows
from mpu.mesh import Mesh


@dataclass
class DispatchState:
    """What `combine` needs to undo a dispatch."""

    pair_order: torch.Tensor          # sorted position -> original pair index
    pair_token: torch.Tensor          # token index of each sorted pair
    regroup: torch.Tensor | None      # received row order -> expert-major order (None = identity)
    input_splits: list[int]
    output_splits: list[int]
    etp_sizes: list[int]


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class AllToAllDispatcher:
    """Moves (token, choice) pairs to the ranks owning their experts (groups `mesh.ep`,
    `mesh.etp`) and back."""

    def __init__(self, num_experts: int, mesh: Mesh):
        self.mesh = mesh
        self.num_experts = num_experts
        self.ep, self.etp = mesh.par.ep, mesh.par.etp
        self.num_local = num_experts // self.ep

    def dispatch(self, tokens: torch.Tensor, pair_expert: torch.Tensor, pair_token: torch.Tensor):
        """Returns (rows [N, h] grouped by local expert, group sizes [E_local], state).

        tokens [T, h]; pair_expert / pair_token [P]: expert and token index of each kept pair.
        """
        order = torch.argsort(pair_expert, stable=True)
        pair_token = pair_token[order]
        counts = torch.bincount(pair_expert, minlength=self.num_experts)
        rows = tokens.index_select(0, pair_token)
        input_splits = output_splits = etp_sizes = []
        by_block = counts.view(1, self.num_experts)
        if self.ep > 1:
            by_block = all_to_all_stats(counts.view(self.ep, self.num_local), self.mesh.ep)
            input_splits = counts.view(self.ep, self.num_local).sum(1).tolist()
            output_splits = by_block.sum(1).tolist()
            rows = all_to_all(rows, output_splits, input_splits, self.mesh.ep)
        if self.etp > 1:
            gathered = all_gather_stats(by_block, self.mesh.etp)  # [etp, blocks, E_local]
            etp_sizes = gathered.sum((1, 2)).tolist()
            rows = gather_rows(rows, etp_sizes, self.mesh.etp)
            by_block = gathered.reshape(-1, self.num_local)
        regroup = None
        if by_block.shape[0] > 1:
            block_expert = torch.arange(self.num_local, device=rows.device).repeat(by_block.shape[0])
            row_expert = torch.repeat_interleave(block_expert, by_block.flatten(), output_size=rows.shape[0])
            regroup = torch.argsort(row_expert, stable=True)
            rows = rows.index_select(0, regroup)
        state = DispatchState(order, pair_token, regroup, input_splits, output_splits, etp_sizes)
        return rows, by_block.sum(0), state

    def combine(self, rows: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Expert outputs [N, h] (etp partial sums) -> one row per sorted pair, back on its rank."""
        if state.regroup is not None:
            rows = rows.index_select(0, _inverse(state.regroup))
        if self.etp > 1:
            rows = reduce_scatter_rows(rows, state.etp_sizes, self.mesh.etp)
        if self.ep > 1:
            rows = all_to_all(rows, state.input_splits, state.output_splits, self.mesh.ep)
        return rows
