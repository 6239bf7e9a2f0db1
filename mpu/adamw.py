"""The AdamW of the replicated and the ZeRO-sharded optimizers (host offload, mpu/offload.py,
chooses fused or foreach itself).

torch's fused AdamW (one multi-tensor kernel for the whole update, on CPU and CUDA) where
it applies: every parameter floating point on a CPU or CUDA device. On this 2-core CPU it
steps the 15M-parameter MoE benchmark model in 9 ms instead of 32 ms (single-tensor loop).
The update is element-wise, so results still agree on any shard of a parameter; against the
single-tensor implementation they differ by fp32 rounding only.
"""

from __future__ import annotations

import torch


def fused_supported(params) -> bool:
    """True when torch's fused AdamW takes every one of `params`."""
    params = list(params)
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def adamw(param_groups: list[dict], *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """torch.optim.AdamW over `param_groups` (dicts with "params" and "weight_decay"), fused
    when `fused_supported`. No communication."""
    params = [p for g in param_groups for p in g["params"]]
    return torch.optim.AdamW(param_groups, lr=lr, betas=tuple(betas), eps=eps,
                             fused=True if fused_supported(params) else None)
