"""Global gradient norm and clipping, each parameter of the full model counted once.

Gradients are already reduced over data-parallel replicas (identical on every dp / edp
rank), so: TP-sharded parameters contribute their local squares summed over the TP group;
expert shards their squares summed over one replica's ep x etp group; TP-replicated
parameters (norms, row-parallel biases, routers) are counted once, from the local copy;
pipeline stages add their sums over the pp group.
No host synchronization: the norm stays a tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mpu.mesh import Mesh, group_size


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
    device = with_grad[0].grad.device if with_grad else torch.device("cpu")
    expert = [p.grad for p in with_grad if getattr(p, "expert", False)]
    dense = [p for p in with_grad if not getattr(p, "expert", False)]
    sharded = [p.grad for p in dense if getattr(p, "tp_shard_dim", None) is not None]
    replicated = [p.grad for p in dense if getattr(p, "tp_shard_dim", None) is None]
    total = _sum_squares(sharded, device)
    if group_size(mesh.tp) > 1:
        dist.all_reduce(total, group=mesh.tp)
    if expert:
        expert_total = _sum_squares(expert, device)
        if group_size(mesh.ep_etp) > 1:
            dist.all_reduce(expert_total, group=mesh.ep_etp)
        total = total + expert_total
    total = total + _sum_squares(replicated, device)
    if group_size(mesh.pp) > 1:
        dist.all_reduce(total, group=mesh.pp)
    return total.sqrt()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, mesh: Mesh) -> torch.Tensor:
    """Scale gradients so the global norm is at most `max_norm` (<= 0 disables); return the norm."""
    norm = global_grad_norm(params, mesh)
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)
    return norm
