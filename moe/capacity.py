"""Expert capacity with deterministic, layout-independent token dropping (GShard/Switch).

The keep/drop decision is made per sample (per sequence): each expert accepts at most
`capacity` (token, choice) pairs from one sequence, so whether a token is dropped never
depends on which other samples share its data-parallel or expert-parallel rank.
Priority follows GShard: every first choice of the sequence (in sequence order) before every
second choice (in sequence order), and so on.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from meshtron.mpu.context_parallel import shard_sequence, unshard_sequence
from meshtron.mpu.mappings import all_gather_stats
from meshtron.mpu.mesh import group_rank


def capacity_for(seq_len: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Per-sample expert capacity: ceil(capacity_factor * seq_len * top_k / num_experts).

    The factor is read as the decimal it is written as (1.1 means 11/10), so float rounding
    can't push an exact product up by one (1.1 * 100 / 10 gives 11, not 12).
    """
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
    if num_experts < 1 or top_k < 1 or seq_len < 1:
        raise ValueError(f"seq_len={seq_len}, num_experts={num_experts}, top_k={top_k} must be >= 1")
    return math.ceil(Fraction(repr(float(capacity_factor))) * seq_len * top_k / num_experts)


def capacity_keep_mask(topk_idx: torch.Tensor, num_experts: int, capacity: int, seq_group) -> torch.Tensor:
    """Keep mask [s_local, b, k] for the routed pairs `topk_idx` [s_local, b, k].

    Pair (t, j) of sample b routed to expert e is kept iff its rank among the pairs of
    sample b routed to e, ordered by (choice j, position t), is < `capacity`.
    The sequence may be sharded over `seq_group` (rank r holds positions
    [r*s_local, (r+1)*s_local)); the per-rank counts [b, k, E] are exchanged with one
    `all_gather_stats` over `seq_group`, so the mask equals the one computed on the full
    sequence. `seq_group=None` means the whole sequence is local.
    """
    if topk_idx.dim() != 3:
        raise ValueError(f"topk_idx must be [s_local, b, k], got shape {tuple(topk_idx.shape)}")
    s, b, k = topk_idx.shape
    # One-hot of every choice at once, [s, b, k, E] (no loop over the k choices: the layer's op
    # count does not grow with top_k or the expert count); scatter instead of F.one_hot: no
    # device-side index check, so no host sync on GPU.
    idx = topk_idx.unsqueeze(-1)  # [s, b, k, 1]
    hot = torch.zeros(s, b, k, num_experts, dtype=torch.int64, device=topk_idx.device).scatter_(-1, idx, 1)
    cum = hot.cumsum(dim=0)  # pairs up to and including t within this shard, per (sample, choice, expert)
    counts_local = cum[-1] if s > 0 else hot.sum(dim=0)  # [b, k, E]

    gathered = all_gather_stats(counts_local, seq_group)  # [W, b, k, E], rank order
    rank = group_rank(seq_group)
    total = gathered.sum(dim=0)  # [b, k, E], whole sequence
    earlier_choices = total.cumsum(dim=1) - total  # choices j' < j, all ranks
    lower_ranks = gathered[:rank].sum(dim=0)  # choice j, positions on lower ranks
    offset = earlier_choices + lower_ranks  # [b, k, E]
    # each pair's rank among its (sample, expert)'s pairs, read at its own expert only: the
    # pairs before t in this shard (its own one-hot is the 1 taken off) plus the offset
    before = cum.gather(-1, idx).squeeze(-1) - 1  # [s, b, k]
    pos = before + offset.unsqueeze(0).expand(s, b, k, num_experts).gather(-1, idx).squeeze(-1)
    return pos < capacity


def capacity_keep_mask_cp(topk_idx: torch.Tensor, num_experts: int, capacity: int, mesh) -> torch.Tensor:
    """`capacity_keep_mask` under context parallelism, where this rank's rows of `topk_idx`
    [s_local, b, k] are its tp piece of its cp shard (2 of the 2*cp load-balanced chunks), not a
    consecutive range. The routed experts of every rank are all-gathered over `mesh.tp_cp` (s*b*k
    integers: small beside the hidden states); in group order they are the cp shards, each its
    tp pieces in order, which `unshard_sequence` puts back in sequence order. The mask is
    computed on the whole sequence and this rank's rows are returned."""
    s = topk_idx.shape[0]
    every = all_gather_stats(topk_idx, mesh.tp_cp)  # [cp * tp, s, b, k]
    shards = every.reshape((mesh.cp_size, mesh.tp_size * s) + tuple(topk_idx.shape[1:])).unbind(0)
    keep = capacity_keep_mask(unshard_sequence(list(shards), 0), num_experts, capacity, None)
    mine = shard_sequence(keep, 0, mesh.cp_size, mesh.cp_rank)
    return mine[mesh.tp_rank * s : (mesh.tp_rank + 1) * s]
