"""ZeRO-1/2/3 distributed optimizer: AdamW state for one shard of every gradient bucket.

Each bucket of `DataParallelGradReducer` is homogeneous (one replica group, one weight-decay
class) and padded to a multiple of its replica count, so it splits into equal contiguous
shards, one per replica (dp for dense parameters, tp x dp for sequence-parallel replicated
ones, edp for experts). The parameters of a bucket become views into one flat buffer; this
rank's AdamW updates only its shard of that buffer (state: exp_avg and exp_avg_sq for 1/R of
the bucket), then the shards are all-gathered over the bucket's group so every replica holds
the updated parameters. The update is element-wise, hence identical to unsharded AdamW.

ZeRO-1 (reducer without `shard_grads`): gradients are all-reduced in full and the shard's
gradient is a view of the bucket buffer, so the gradient norm is unchanged.
ZeRO-2 (reducer with `shard_grads=True`): the gradient is the reducer's reduce-scattered
`bucket.shard`; the norm is taken over the shards (`dp.grad_norm.sharded_grad_norm`).
Either way the clipping factor goes into the shard AdamW's fused update (`scale_gradients`):
only the shard this rank updates is scaled (at ZeRO-1 the rest of the all-reduced buffer keeps
its unclipped values; nothing reads it before the next `zero_grad`).
ZeRO-3 (`dp.zero3.Zero3` built on the reducer first): the parameter shards are the buckets'
`param_shard` tensors, updated in place and not all-gathered after the step.

Overlap (`overlap_param_gather(chunks)`, optim.overlap_param_gather): the all-gathers are
issued asynchronously, bucket by bucket in the order of first use in forward, and each is
waited for by the first forward unit reading it (dp/param_gather.py).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.dp.adamw import TrainingOptimizer, adamw
from meshtron.dp.buckets import bucket_moment_shards, flatten_bucket_params
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.param_gather import ParamGather
from meshtron.mpu.mappings import all_gather_into
from meshtron.mpu.mesh import group_size


class ShardedAdamW(TrainingOptimizer):
    """AdamW over this rank's shards of the reducer's buckets; `step` all-gathers the result
    over each bucket's replica group. Exposes `param_groups` and `state` like an optimizer;
    reads the reducer's gradient shards when it reduce-scatters them (ZeRO-2)."""

    def __init__(
        self, reducer: DataParallelGradReducer, *, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8
    ):
        self.buckets = reducer.buckets
        self.grad_shards_of = reducer if reducer.shard_grads else None
        decay, no_decay = [], []
        self._shards = []
        # ZeRO-3 (dp/zero3.py, built before the optimizer): every bucket already keeps only
        # its shard; the optimizer updates it in place and the next forward gathers it.
        self.zero3 = all(getattr(bucket, "param_shard", None) is not None for bucket in self.buckets)
        for bucket in self.buckets:
            start, size = bucket.shard_start, bucket.shard.numel()
            if self.zero3:
                shard = nn.Parameter(bucket.param_shard)
            else:
                flat = flatten_bucket_params(bucket)
                shard = nn.Parameter(flat[start : start + size])
            shard.grad = bucket.shard  # ZeRO-1: a view of the bucket buffer; ZeRO-2: the reduced shard
            self._shards.append((bucket, shard, start, size))
            (decay if bucket.decay else no_decay).append(shard)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = adamw([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
        self.param_gather: ParamGather | None = None  # set by overlap_param_gather

    def overlap_param_gather(self, chunks: list[nn.Module]) -> ParamGather | None:
        """From now on `step` launches the all-gathers asynchronously and forward pre-hooks on
        `chunks` wait for them (dp/param_gather.py); returns the `ParamGather` (None at ZeRO-3,
        which gathers per unit anyway). Whoever reads the parameters outside forward calls
        `param_gather.finish_param_gather(chunks)` first."""
        if self.zero3:
            return None
        if self.param_gather is None:
            self.param_gather = ParamGather(chunks, self.buckets)
        return self.param_gather

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def scale_gradients(self, chunks: list[nn.Module], coef: torch.Tensor | None) -> None:
        """Fold `coef` into the shard AdamW's next update (fused), else scale `gradients` now."""
        if not self.optimizer.fold_grad_scale(coef):
            super().scale_gradients(chunks, coef)

    def step(self) -> None:
        """Update this rank's shards, then all-gather every bucket over its replica group:
        blocking, or launched asynchronously in forward order with `overlap_param_gather`
        (ZeRO-3: not here, the next forward gathers each unit)."""
        gather = self.param_gather
        if gather is not None:
            gather.finish()  # a gather still in flight would overwrite the shards updated now
        self.optimizer.step()
        if self.zero3:
            return
        for index in gather.order if gather is not None else range(len(self._shards)):
            bucket, _, start, size = self._shards[index]
            if group_size(bucket.group) > 1:
                own = bucket.param_buffer[start : start + size].clone()
                if gather is not None:
                    gather.launch(index, bucket.param_buffer, own, bucket.group)
                else:
                    all_gather_into(bucket.param_buffer, own, bucket.group)

    def param_moments(self) -> tuple[dict, float]:
        """({param: (exp_avg, exp_avg_sq)} shaped like each parameter, step count): every
        bucket's state shards all-gathered over its replica group (checkpoints save
        `moment_shards` instead, without gathering)."""
        moments, step = {}, 0.0
        for bucket, shard, _start, _size in self._shards:
            state = self.optimizer.state.get(shard, {})
            full = []
            for key in ("exp_avg", "exp_avg_sq"):
                flat = torch.zeros_like(bucket.param_buffer)
                if key in state:
                    own = state[key]
                    if group_size(bucket.group) > 1:
                        all_gather_into(flat, own.contiguous(), bucket.group)
                    else:
                        flat.copy_(own)
                full.append(flat)
            if "step" in state:
                step = float(state["step"])
            offset = 0
            for p in bucket.params:
                n = p.numel()
                moments[p] = tuple(f[offset : offset + n].view_as(p) for f in full)
                offset += n
        return moments, step

    def load_param_moments(self, moments: dict, step: float) -> None:
        """Install per-parameter moments (as returned by `param_moments`): this rank keeps
        its shard of every bucket. No communication."""
        for bucket, shard, start, size in self._shards:
            flats = [torch.zeros_like(bucket.param_buffer) for _ in range(2)]
            offset = 0
            for p in bucket.params:
                n = p.numel()
                for flat, tensor in zip(flats, moments[p]):
                    flat[offset : offset + n].copy_(tensor.reshape(-1))
                offset += n
            self.optimizer.state[shard] = {
                "step": torch.tensor(step, dtype=torch.float32),
                "exp_avg": flats[0][start : start + size].clone(),
                "exp_avg_sq": flats[1][start : start + size].clone(),
            }

    def moment_shards(self) -> tuple[list, float]:
        """([(param, first, (exp_avg, exp_avg_sq))], step count): this rank's slice of each
        parameter's flattened moments (1-D views of the shard state, zeros before the first
        step), starting at element `first` of the flattened local parameter; for checkpoints
        that save shards without gathering them. No communication."""
        return bucket_moment_shards(
            (bucket, start, size, self.optimizer.state.get(shard, {})) for bucket, shard, start, size in self._shards
        )

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank."""
        return sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
