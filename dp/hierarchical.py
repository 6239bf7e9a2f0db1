"""Hierarchical (topology-aware) all-reduce of data-parallel gradient buckets across nodes.

A flat ring all-reduce of B bytes over n = N*L ranks (N nodes, L ranks of the group on each)
sends 2(n-1)/n * B per rank; in a ring laid out node by node, N of its n links cross nodes and
each carries 2(n-1)/n * B, so the busiest inter-node link moves 2(n-1)/n * B. The hierarchical
all-reduce does

  1. reduce-scatter inside the node (the L ranks of the group on one node): each holds the
     node's sum of 1/L of the bucket;
  2. all-reduce across nodes, between the ranks with the same local index (N ranks, B/L bytes
     each): 2(N-1)/N * B/L per rank crosses nodes;
  3. all-gather inside the node: every rank holds the full sum.

so per rank only 2(N-1)/N * B/L bytes cross nodes, L x fewer (and the inter-node links of a
node run in parallel, one per local rank). The sum is the same as the flat one up to the order
of the fp32 additions.

Groups: for every data-replica group (`dp x cp`, `dp.grad_reduce.replica_group(mesh, "dp")`)
of the world, its per-node subgroups ("intra") and its same-local-index subgroups ("inter"),
with node = rank // ranks_per_node (torchrun's placement, `mpu.mesh`). Every process creates
every group, in the same order, as torch requires; `dp_hierarchy(mesh)` creates them once per
mesh and caches them on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron.mpu.mappings import all_gather_into, reduce_scatter_into
from meshtron.mpu.mesh import Mesh, ParallelConfig, ParallelConfigError, group_size
from meshtron.mpu.waits import wait_for

MODES = (True, False, "auto")


def replica_rank_lists(par: ParallelConfig, world_size: int) -> list[list[int]]:
    """The rank lists of every dp x cp group (the data replicas of one (pp, tp) position), in
    the order `Mesh` forms them (cp fastest inside a group)."""
    ranks = torch.arange(world_size).view(par.pp, par.dp, par.cp, par.tp)
    return ranks.permute(0, 3, 1, 2).reshape(-1, par.dp * par.cp).tolist()


def split_by_node(ranks: list[int], ranks_per_node: int) -> list[list[int]]:
    """`ranks` split into the runs held by one node each (node = rank // ranks_per_node), in order."""
    parts: dict[int, list[int]] = {}
    for r in ranks:
        parts.setdefault(r // ranks_per_node, []).append(r)
    return list(parts.values())


def hierarchy_shape(par: ParallelConfig, world_size: int, ranks_per_node: int) -> tuple[int, int] | None:
    """(N nodes, L ranks per node) of every data-replica group, or None when the groups hold a
    different number of ranks on different nodes (no hierarchical all-reduce then)."""
    shapes = set()
    for ranks in replica_rank_lists(par, world_size):
        parts = split_by_node(ranks, ranks_per_node)
        sizes = {len(p) for p in parts}
        if len(sizes) != 1:
            return None
        shapes.add((len(parts), sizes.pop()))
    return shapes.pop() if len(shapes) == 1 else None


def resolve_hierarchical(
    mode, par: ParallelConfig, world_size: int, ranks_per_node: int, *, shard_grads: bool = False
) -> bool:
    """Whether the "dp" gradient buckets are all-reduced hierarchically. `mode` True: yes, or
    ParallelConfigError saying why it cannot be (reduce-scattered buckets: ZeRO-2/3; groups with
    unequal ranks per node); "auto": yes exactly when every data-replica group spans N > 1 nodes
    with the same L > 1 ranks on each and buckets are all-reduced (ZeRO 0/1) — with L = 1 or
    N = 1 the two are the same collective; False: no."""
    if mode is False or mode == "false":
        return False
    if getattr(par, "dp_mode", "allreduce") != "allreduce":  # parameter servers: no dp all-reduce to split
        if mode is True or mode == "true":
            raise ParallelConfigError(
                f"parallel.dp_hierarchical=true applies to all-reduce data parallelism; "
                f"parallel.dp_mode={par.dp_mode} has none: set parallel.dp_hierarchical=false"
            )
        return False
    shape = hierarchy_shape(par, world_size, ranks_per_node)
    if mode is True or mode == "true":
        if shard_grads:
            raise ParallelConfigError(
                "parallel.dp_hierarchical=true is built for all-reduced gradient buckets "
                "(optim.zero 0 or 1); ZeRO-2/3 reduce-scatter them: set optim.zero<=1 or "
                "parallel.dp_hierarchical=false"
            )
        if shape is None:
            raise ParallelConfigError(
                f"parallel.dp_hierarchical=true needs every data-replica group (dp x cp) to "
                f"hold the same number of ranks on each node ({ranks_per_node} ranks per "
                f"node); use parallel.dp_hierarchical=false or change the layout"
            )
        return True
    if mode != "auto":
        raise ParallelConfigError(f"parallel.dp_hierarchical={mode!r} must be one of true, false, auto")
    return not shard_grads and shape is not None and shape[0] > 1 and shape[1] > 1


class HierarchicalAllReduce:
    """Sum a flat tensor over this rank's data-replica group in three stages (module doc):
    reduce-scatter over `intra` (this node's ranks of the group), all-reduce over `inter` (the
    group's ranks with this rank's local index), all-gather over `intra`."""

    def __init__(self, intra, inter, nodes: int, local: int):
        self.intra, self.inter, self.nodes, self.local = intra, inter, nodes, local

    def all_reduce(self, x: torch.Tensor, async_op: bool = False):
        """In-place sum of the contiguous flat `x` (numel a multiple of the local size L). With
        `async_op` the intra-node reduce-scatter is launched now and the returned handle's
        `wait()` runs the other two stages; without, all three run now and None is returned."""
        if x.numel() % self.local:
            raise ValueError(
                f"a hierarchical all-reduce needs a numel divisible by {self.local} ranks per node, got {x.numel()}"
            )
        part = torch.empty(x.numel() // self.local, dtype=x.dtype, device=x.device)
        work = reduce_scatter_into(part, x, group=self.intra, async_op=True)
        pending = _Pending(self, x, part, work)
        if async_op:
            return pending
        pending.wait()
        return None


@dataclass
class _Pending:
    """A hierarchical all-reduce in flight: `stage` 1 reduce-scatter, 2 inter-node all-reduce,
    3 all-gather, 4 done. `advance()` waits for the stage in flight and launches the next one
    asynchronously; `wait()` advances to the end."""

    owner: HierarchicalAllReduce
    x: torch.Tensor
    part: torch.Tensor
    work: object
    stage: int = 1

    def advance(self) -> None:
        if self.stage >= 4:
            return
        if self.work is not None:
            what = ("intra-node reduce_scatter", "inter-node all_reduce", "intra-node all_gather")[self.stage - 1]
            wait_for(self.work, f"{what} of a hierarchical all-reduce ({self.part.numel()} elements per rank)")
            self.work = None
        if self.stage == 1 and group_size(self.owner.inter) > 1:
            self.work = dist.all_reduce(self.part, group=self.owner.inter, async_op=True)
        elif self.stage == 2:
            self.work = all_gather_into(self.x, self.part, group=self.owner.intra, async_op=True)
        self.stage += 1

    def wait(self) -> None:
        while self.stage < 4:
            self.advance()


def pipeline_stages(works) -> None:
    """Advance every hierarchical all-reduce among `works` (in their order, the same on every
    rank) to its inter-node stage, then all to their all-gather, so the buckets' stages overlap
    one another instead of running one bucket at a time; other work handles are left alone."""
    pending = [w for w in works if isinstance(w, _Pending)]
    for stage in (2, 3):
        for w in pending:
            if w.stage < stage:
                w.advance()


def dp_hierarchy(mesh: Mesh) -> HierarchicalAllReduce:
    """The `HierarchicalAllReduce` of this rank's data-replica group: creates (once per mesh,
    every process, same order) the intra-node and inter-node subgroups of every dp x cp group."""
    cached = mesh.__dict__.get("_dp_hierarchy")
    if cached is not None:
        return cached
    par, rpn = mesh.par, mesh.ranks_per_node
    shape = hierarchy_shape(par, mesh.world_size, rpn)
    if shape is None:
        raise ParallelConfigError("the data-replica groups hold unequal numbers of ranks per node")
    nodes, local = shape
    lists = replica_rank_lists(par, mesh.world_size)
    intra = inter = None
    for ranks in lists:  # all intra-node groups first, then all inter-node ones: the same order everywhere
        for part in split_by_node(ranks, rpn):
            group = dist.new_group(part) if len(part) > 1 else None
            if mesh.rank in part:
                intra = group
    for ranks in lists:
        parts = split_by_node(ranks, rpn)
        for index in range(local):
            members = [p[index] for p in parts]
            group = dist.new_group(members) if len(members) > 1 else None
            if mesh.rank in members:
                inter = group
    hierarchy = HierarchicalAllReduce(intra, inter, nodes, local)
    mesh.__dict__["_dp_hierarchy"] = hierarchy
    return hierarchy
