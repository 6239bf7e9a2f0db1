"""The run's gradient reducer and optimizer from its `optim` config: replicated AdamW,
ZeRO-1/2/3 (`ShardedAdamW`, with `dp.zero3` for 3) or CPU-offloaded AdamW (`OffloadedAdamW`), every one a
`TrainingOptimizer` (dp/adamw.py), with decoupled weight decay on matrices only."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.dp import zero3
from meshtron.dp.adamw import ReplicatedAdamW, TrainingOptimizer, adamw
from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.offload import OffloadedAdamW
from meshtron.dp.resident import ResidentAdamW
from meshtron.kernels.operands import forget_weight_copies
from meshtron.mpu.mesh import Mesh
from meshtron.training.config import OptimConfig
from meshtron.training.local_sgd import LocalGradReducer, local_sgd_enabled


def build_optimizer(
    model: nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8
) -> ReplicatedAdamW:
    """AdamW over `model`'s trainable parameters; weight decay applies to parameters with ndim >= 2.

    The update is element-wise, so it gives the same result on any shard of a parameter
    (torch's fused kernel where it applies: dp/adamw.py).
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


def build_reducer_and_optimizer(
    o: OptimConfig, chunks: list[nn.Module], mesh: Mesh
) -> tuple[DataParallelGradReducer, TrainingOptimizer]:
    """The data-parallel gradient reducer of `chunks` (reduce-scattering with `o.zero` >= 2,
    in bf16 with `o.grad_comm_dtype == "bf16"`) and the optimizer `o` asks for:
    `OffloadedAdamW` with `o.offload` (at ZeRO stage `o.zero`), else `ShardedAdamW` with
    `o.zero` 1, 2 or 3 (3: the parameters are sharded too and gathered per unit by
    `dp.zero3.Zero3`, which this installs on the model), else the replicated AdamW of
    `build_optimizer`. `o.param_dtype == "bf16"`: `ResidentAdamW` (dp/resident.py), which casts
    the parameters to bf16 and keeps fp32 main weights for this rank's shard (on the host with
    `o.offload`); the reducer then accumulates into fp32 `main_grad`s."""
    resident = o.param_dtype == "bf16"
    # local SGD / DiLoCo: gradients summed inside a data replica only (training/local_sgd.py)
    kind = LocalGradReducer if local_sgd_enabled(o.local_steps, o.outer_optimizer) else DataParallelGradReducer
    reducer = kind(
        [(n, p) for c in chunks for n, p in c.named_parameters()],
        mesh,
        bucket_mb=o.bucket_mb,
        shard_grads=o.zero >= 2,
        comm_dtype=torch.bfloat16 if o.grad_comm_dtype == "bf16" else None,
        unit_of=zero3.unit_of if o.zero == 3 else None,
        main_grads=resident,
    )
    if o.zero == 3:  # shards the parameters (one sharder per model chunk) before the optimizer takes the shards
        for chunk in chunks:
            zero3.Zero3(chunk, reducer, on_free=forget_weight_copies, param_dtype=torch.bfloat16 if resident else None)
    if resident:
        optimizer = ResidentAdamW(
            reducer, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps, zero=o.zero, offload=o.offload
        )
    elif o.offload:
        optimizer = OffloadedAdamW(reducer, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps, zero=o.zero)
    elif o.zero:
        optimizer = ShardedAdamW(reducer, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps)
    else:
        optimizer = build_optimizer(
            nn.ModuleList(chunks), lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps
        )
    return reducer, optimizer
