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
    single-process gradient of the mean loss. MoE models add their routers' aux and z-loss
    terms (global over the microbatch's tokens on all ranks) averaged over microbatches.
    Returns tensors (no host sync): `loss` (global-batch mean LM cross-entropy, reduced over
    dp, no aux terms) and `grad_norm` (before clipping); MoE adds `aux_loss`, `z_loss`
    (unweighted, summed over layers) and per-layer `moe_layers` statistics.
    """
    model.train()
    tokens = global_token_count(microbatches, mesh)
    reducer.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float32, device=tokens.device)
    n_micro = len(microbatches)
    moe = MoEStepStats()
    for i, (inputs, targets) in enumerate(microbatches):
        with reducer.sync(i == n_micro - 1):
            logits = model(inputs)
            loss = model.loss_per_token(logits, targets).sum() / tokens
            aux = model.aux_loss() if hasattr(model, "aux_loss") else None
            (loss if aux is None else loss + aux / n_micro).backward()
        loss_sum = loss_sum + loss.detach().to(loss_sum.device)
        if aux is not None:
            moe.add(model.moe_stats(), n_micro)
    reducer.finish()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = clip_grad_norm(params, max_grad_norm, mesh)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    if moe.layers:
        model.update_expert_bias()
    if group_size(mesh.dp) > 1:
        dist.all_reduce(loss_sum, group=mesh.dp)
    return {"loss": loss_sum, "grad_norm": grad_norm, **moe.summary()}


class MoEStepStats:
    """Routing statistics of one step: aux/z-loss averaged over microbatches (summed over
    MoE layers), tokens per expert summed over microbatches, dropped fraction averaged."""

    def __init__(self):
        self.layers: list[dict] = []

    def add(self, per_layer: list[dict], n_micro: int) -> None:
        if not self.layers:
            self.layers = [{"aux_loss": 0.0, "z_loss": 0.0, "tokens_per_expert": 0, "dropped_fraction": 0.0}
                           for _ in per_layer]
        for acc, stats in zip(self.layers, per_layer):
            acc["aux_loss"] = acc["aux_loss"] + stats["aux_loss"] / n_micro
            acc["z_loss"] = acc["z_loss"] + stats["z_loss"] / n_micro
            acc["tokens_per_expert"] = acc["tokens_per_expert"] + stats["tokens_per_expert"]
            acc["dropped_fraction"] = acc["dropped_fraction"] + stats["dropped_fraction"] / n_micro

    def summary(self) -> dict:
        if not self.layers:
            return {}
        return {"aux_loss": sum(layer["aux_loss"] for layer in self.layers),
                "z_loss": sum(layer["z_loss"] for layer in self.layers),
                "moe_layers": self.layers}
