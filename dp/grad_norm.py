"""Global gradient norm and clipping, each parameter of the full model counted once.

Gradients are already reduced over data-parallel replicas (identical on every dp / edp
rank), so: TP-sharded parameters contribute their local squares summed over the TP group;
expert shards their squares summed over one replica's ep x etp group; TP-replicated
parameters (norms, row-parallel biases, routers) are counted once, from the local copy;
pipeline stages add their sums over the pp group.
With ZeRO-2 (`sharded_grad_norm`) the gradients are reduce-scattered shards of the buckets:
the squares of each shard are first summed over the bucket's replica group.
No host synchronization: the norm stays a tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtron.mpu.mappings import all_reduce_stats
from meshtron.mpu.mesh import Mesh, collective_device, group_size


def _sum_squares(grads: list[torch.Tensor], device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([g.float() for g in grads], 2.0)
    return torch.stack(norms).pow(2).sum()


def global_grad_norm(params: list[nn.Parameter], mesh: Mesh) -> torch.Tensor:
    """L2 norm of all gradients of the full (unsharded) model; all-reduces over `mesh.tp`,
    `mesh.ep_etp` (experts) and `mesh.pp` (stages; a tied embedding's copy on the last stage
    is skipped, so it counts once)."""
    with_grad = [p for p in params if p.grad is not None and not getattr(p, "tied_embedding_copy", False)]
    # A rank without gradients still joins the all-reduces, with a zero on the group's device.
    device = with_grad[0].grad.device if with_grad else collective_device()
    expert = [p.grad for p in with_grad if getattr(p, "expert", False)]
    dense = [p for p in with_grad if not getattr(p, "expert", False)]
    sharded = [p.grad for p in dense if getattr(p, "tp_shard_dim", None) is not None]
    replicated = [p.grad for p in dense if getattr(p, "tp_shard_dim", None) is None]
    total = _sum_squares(sharded, device)
    if group_size(mesh.tp) > 1:
        total = all_reduce_stats(total, mesh.tp)  # shared memory for CPU ranks of one host
    if expert:
        expert_total = _sum_squares(expert, device)
        if group_size(mesh.ep_etp) > 1:
            dist.all_reduce(expert_total, group=mesh.ep_etp)
        total = total + expert_total
    total = total + _sum_squares(replicated, device)
    if group_size(mesh.pp) > 1:
        dist.all_reduce(total, group=mesh.pp)
    return total.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """min(1, max_norm / (norm + 1e-6)): the factor that brings gradients of global L2 norm
    `norm` to at most `max_norm`, as a tensor (no host sync); None when `max_norm` <= 0
    (clipping disabled)."""
    if max_norm <= 0:
        return None
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def scale_to_max_norm(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Multiply `grads` in place by `clip_coefficient(norm, max_norm)`, so gradients whose global
    L2 norm is `norm` end at most `max_norm`; `max_norm` <= 0 disables clipping. No communication."""
    coef = clip_coefficient(norm, max_norm)
    if coef is not None and grads:
        torch._foreach_mul_(grads, coef)


# Element classes of a sharded bucket for the norm (index into the per-group sum vector).
_TP_SHARDED, _REPLICATED, _EXPERT = 0, 1, 2


def _shard_segments(bucket) -> list[tuple[int, int, int]]:
    """(lo, hi, class) ranges of `bucket.shard` (indices relative to the shard), one per
    parameter overlapping this rank's range; a tied embedding's last-stage copy is skipped."""
    start, end = bucket.shard_start, bucket.shard_start + bucket.shard.numel()
    segments, offset = [], 0
    for p in bucket.params:
        lo, hi = max(offset, start), min(offset + p.numel(), end)
        offset += p.numel()
        if lo >= hi or getattr(p, "tied_embedding_copy", False):
            continue
        if getattr(p, "expert", False):
            cls = _EXPERT
        elif getattr(p, "tp_shard_dim", None) is not None:
            cls = _TP_SHARDED
        else:
            cls = _REPLICATED
        segments.append((lo - start, hi - start, cls))
    return segments


def sharded_grad_norm(reducer, mesh: Mesh) -> torch.Tensor:
    """`global_grad_norm` from ZeRO-2 gradient shards (`reducer.shard_grads`, after `finish()`).

    Every element of a bucket lies in exactly one rank's shard, so per class (tp-sharded dense,
    replicated dense incl. sequence-parallel, expert) the squares of this rank's shards are
    summed over each bucket's replica group (dp, tp x dp, edp); the tp-sharded sum is then
    summed over `mesh.tp`, the expert sum over `mesh.ep_etp`, the total over `mesh.pp`."""
    buckets = reducer.buckets
    device = buckets[0].shard.device if buckets else collective_device()
    per_key: dict[str, list] = {}
    for bucket in buckets:
        entry = per_key.setdefault(bucket.key, [bucket.group, [[], [], []]])
        for lo, hi, cls in _shard_segments(bucket):
            entry[1][cls].append(bucket.shard[lo:hi])
    sums = torch.zeros(3, dtype=torch.float32, device=device)
    for key in ("dp", "tp_dp", "edp"):  # same order on every rank
        if key not in per_key:
            continue
        group, classes = per_key[key]
        local = torch.stack([_sum_squares(grads, device) for grads in classes])
        if group_size(group) > 1:
            dist.all_reduce(local, group=group)
        sums = sums + local
    sharded, replicated, expert = sums.unbind()
    if group_size(mesh.tp) > 1:
        sharded = sharded.clone()
        dist.all_reduce(sharded, group=mesh.tp)
    total = sharded
    if "edp" in per_key:
        expert = expert.clone()
        if group_size(mesh.ep_etp) > 1:
            dist.all_reduce(expert, group=mesh.ep_etp)
        total = total + expert
    total = total + replicated
    if group_size(mesh.pp) > 1:
        dist.all_reduce(total, group=mesh.pp)
    return total.sqrt()
