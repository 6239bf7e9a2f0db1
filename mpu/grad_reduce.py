"""Data-parallel gradient reduction in buckets, overlapped with backward.

Each parameter's `.grad` is a view into a flat bucket buffer. A post-accumulate-grad hook
counts the parameters of a bucket that are ready; when the last one is, the bucket's
all-reduce is launched asynchronously while backward keeps running. `finish()` waits for
all of them. Buckets are filled in reverse registration order, roughly the order in which
backward produces gradients.

Reductions are sums, not averages: the training loss is already divided by the number of
tokens in the global batch, so summing over data-parallel replicas (and accumulating over
microbatches) gives exactly the single-process gradient.

Groups:
  * ordinary parameters: the data-parallel group `mesh.dp`;
  * sequence-parallel replicated parameters (norms, row-parallel biases, position
    embeddings under SP; MoE routers and shared experts at tp > 1), whose gradient on each
    TP rank covers only its tokens: the flattened `mesh.tp_dp` group, summing over TP and DP
    in one collective;
  * expert parameters: the expert-data-parallel group `mesh.edp` (replicas of the same
    expert shard that saw different tokens).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mpu.mesh import Mesh, group_size


@dataclass
class _Bucket:
    group: object
    buffer: torch.Tensor
    params: list[nn.Parameter]
    ready: int = 0
    work: object = None
    launched: bool = False
    names: list[str] = field(default_factory=list)
    decay: bool = True


class DataParallelGradReducer:
    """Owns the gradient buffers of `params` and sums them over their replica groups.

    Usage per optimizer step:
        reducer.zero_grad()
        for i, micro in enumerate(microbatches):
            with reducer.sync(i == last):
                loss(micro).backward()
        reducer.finish()      # all bucket collectives done; grads are final
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], mesh: Mesh, bucket_mb: float = 25.0):
        self.mesh = mesh
        self._sync_enabled = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        by_group: dict[tuple[str, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, p in named_params:
            if not p.requires_grad:
                continue
            if getattr(p, "expert", False):
                key = "edp"
            else:
                key = "tp_dp" if getattr(p, "sequence_parallel", False) else "dp"
            # Buckets are also split by weight decay (matrices vs vectors), so a shard of a
            # bucket (ZeRO) belongs to one optimizer group.
            by_group.setdefault((key, p.ndim >= 2), []).append((name, p))
        limit = int(bucket_mb * 2**20)
        for (key, decay), items in by_group.items():
            group = getattr(mesh, key)
            current: list[tuple[str, nn.Parameter]] = []
            size = 0
            for name, p in reversed(items):
                current.append((name, p))
                size += p.numel() * 4
                if size >= limit:
                    self._make_bucket(group, current, decay)
                    current, size = [], 0
            if current:
                self._make_bucket(group, current, decay)
        self._hooks = []
        for bucket in self.buckets:
            if group_size(bucket.group) > 1:
                for p in bucket.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _make_bucket(self, group, items: list[tuple[str, nn.Parameter]], decay: bool) -> None:
        params = [p for _, p in items]
        dtype = torch.float32 if params[0].dtype in (torch.float16, torch.bfloat16) else params[0].dtype
        numel = sum(p.numel() for p in params)
        replicas = group_size(group)
        padded = -(-numel // replicas) * replicas  # divisible into equal shards per replica
        buffer = torch.zeros(padded, dtype=dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        bucket = _Bucket(group=group, buffer=buffer, params=params, names=[n for n, _ in items], decay=decay)
        for p in params:
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync_enabled:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.launched:
            return
        bucket.launched = True
        if group_size(bucket.group) > 1:
            bucket.work = dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)

    @contextlib.contextmanager
    def sync(self, enabled: bool):
        """Within the block, launch reductions as gradients become ready only if `enabled`
        (the last microbatch of a step); earlier microbatches just accumulate locally."""
        previous, self._sync_enabled = self._sync_enabled, enabled
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish(self) -> None:
        """Launch any bucket not yet reduced (in a fixed order on every rank) and wait for all."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work, bucket.ready, bucket.launched = None, 0, False

    def zero_grad(self) -> None:
        """Zero every gradient buffer (gradients stay views into the buckets)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready, bucket.launched, bucket.work = 0, False, None

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
