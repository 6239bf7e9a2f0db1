"""Aux-loss scope: which tokens one load-balancing statistic pools, and which process groups
that means for a layout.

- "microbatch" (default, Megatron-Core's default): the statistics f_i, P_i of the Switch aux
  loss pool the tokens of one rank's microbatch. The microbatch's sequence may be split over
  the tensor-parallel ranks inside the MoE layer (always: with or without SP) and over the
  context-parallel ranks (cp chunks), so the pooled statistics are all-reduced over
  `mesh.tp_cp` (cp x tp). The step's objective is the mean over every
  microbatch of the global batch (dp x local microbatches).
  Invariance: any tp/sp/dp/ep/etp/pp layout equals one process run at the same
  micro_batch_size (the same microbatches, in any order).
- "sequence" (DeepSeek-V2/V3 sequence-wise balance loss): one statistic per sequence,
  averaged over the sequences of the microbatch, then over microbatches; statistics are
  all-reduced over `mesh.tp_cp` (the sequence shards).
  Invariance: any layout and any micro_batch_size equal one process with any micro batch.
- "global" (the all-ranks pooling of Qwen's global-batch balancing at one microbatch): the
  statistics pool microbatch j of every dp rank (all-reduced over `mesh.tp_dp`); the step's
  objective is the mean over the local microbatch index j.
  Invariance: a layout equals one process whose microbatch j is the concatenation of
  microbatch j of every dp rank (micro_batch_size x dp), whatever tp/sp/ep/etp/pp.

z-loss is a mean over tokens, so it has the same value in every scope; it follows the aux
loss's grouping. Expert loads (tokens per expert, the aux-free bias update, logged stats)
are summed over `replica_group` (the ranks holding the step's other microbatches) where the
scope does not already pool them.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.moe.config import scope_checks
from meshtron.mpu.mesh import Mesh, group_size
from meshtron.rules import raise_first


@dataclass(frozen=True)
class AuxLossScope:
    """The process groups of one scope on one layout.

    stats_group: the ranks holding shards of one pooled token set (routing stats all-reduced).
    replica_group: the ranks holding the step's other pooled sets (loads summed, the losses'
        mean taken); None when the stats group already spans the data-parallel ranks.
    per_sequence: one statistic per sequence (dim 1 of the [s, b, h] tokens) instead of one
        per microbatch.
    stats_ranks: the number of ranks in `stats_group` (from the layout, so also on a
        planning mesh without process groups).
    """

    name: str
    stats_group: object
    replica_group: object
    per_sequence: bool
    stats_ranks: int

    @property
    def replicas(self) -> int:
        return group_size(self.replica_group)

    def objective_divisor(self, local_microbatches: int) -> int:
        """How many pooled sets the step's aux objective averages over: the rank's summed
        per-microbatch terms are divided by this (gradients are then summed over dp)."""
        return local_microbatches * self.replicas


def aux_loss_scope(name: str, mesh: Mesh) -> AuxLossScope:
    """The groups of scope `name` ("microbatch", "sequence" or "global") on `mesh`."""
    raise_first(scope_checks(name))
    p = mesh.par
    if name == "global":
        return AuxLossScope(name, mesh.tp_dp, None, per_sequence=False, stats_ranks=p.tp * p.cp * p.dp)
    return AuxLossScope(name, mesh.tp_cp, mesh.dp, per_sequence=name == "sequence", stats_ranks=p.tp * p.cp)
