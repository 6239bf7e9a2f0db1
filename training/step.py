"""One optimizer step over a global batch: microbatch accumulation, bucketed DP reduction,
global-norm clipping and the AdamW update."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mpu.cross_entropy import IGNORE_INDEX
from mpu.grad_norm import clip_grad_norm
from mpu.grad_reduce import DataParallelGradReducer
from mpu.mesh import Mesh, group_size


def global_token_count(microbatches: list[tuple[torch.Tensor, torch.Tensor]], mesh: Mesh) -> torch.Tensor:
    """Number of non-ignored target tokens in the global batch (sum over the dp group)."""
    count = sum((y != IGNORE_INDEX).sum() for _, y in microbatches).to(torch.float32)
    if group_size(mesh.dp) > 1:
        dist.all_reduce(count, group=mesh.dp)
    return count.clamp(min=1.0)


def train_step(model: nn.Module, reducer: DataParallelGradReducer, optimizer: torch.optim.Optimizer,
               microbatches: list[tuple[torch.Tensor, torch.Tensor]], mesh: Mesh, *,
               lr: float, max_grad_norm: float) -> dict[str, torch.Tensor]:
    """Forward/backward every microbatch of this rank's share of the global batch, then update.

    The loss of each microbatch is its summed token cross-entropy divided by the number of
    tokens in the *global* batch, so accumulated gradients summed over dp equal the
    single-process gradient of the mean loss. Returns tensors (no host sync): `loss`
    (global-batch mean cross-entropy, reduced over dp) and `grad_norm` (before clipping).
    """
    model.train()
    tokens = global_token_count(microbatches, mesh)
    reducer.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float32, device=tokens.device)
    last = len(microbatches) - 1
    for i, (inputs, targets) in enumerate(microbatches):
        with reducer.sync(i == last):
            logits = model(inputs)
            loss = model.loss_per_token(logits, targets).sum() / tokens
            loss.backward()
        loss_sum = loss_sum + loss.detach().to(loss_sum.device)
    reducer.finish()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = clip_grad_norm(params, max_grad_norm, mesh)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    if group_size(mesh.dp) > 1:
        dist.all_reduce(loss_sum, group=mesh.dp)
    return {"loss": loss_sum, "grad_norm": grad_norm}
