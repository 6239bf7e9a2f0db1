"""AdamW with decoupled weight decay on matrices only (not norms, biases)."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.mpu.adamw import adamw


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                    eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters; weight decay applies to parameters with ndim >= 2.

    The update is element-wise, so it gives the same result on any shard of a parameter
    (torch's fused kernel where it applies: mpu/adamw.py).
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return adamw([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
