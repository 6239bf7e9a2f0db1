"""The flat parameter buffers of gradient buckets, shared by every sharded optimizer.

A bucket of `grad_reduce.DataParallelGradReducer` lays its gradients out in one flat buffer;
`flatten_bucket_params` makes the bucket's parameters views into one flat buffer laid out the
same way (so a shard of it is a shard of the gradient), `cast_bucket_params` swaps it for a
16-bit copy, and `bucket_moment_shards` lists the AdamW moments a rank holds for its ranges of
buckets. Used by ZeRO-1/2 (`distributed_optimizer`), ZeRO-3 (`zero3`) and CPU offload
(`offload`); kept here, below all three, so none of them imports another for these.
"""

from __future__ import annotations

import torch


def flatten_bucket_params(bucket) -> torch.Tensor:
    """Make the parameters of a gradient bucket views into one flat buffer laid out like the
    bucket's gradients (so a shard of it is a shard of the gradient); returns the buffer,
    also kept as `bucket.param_buffer`."""
    flat = torch.zeros(bucket.numel, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
    offset = 0
    for p in bucket.params:
        n = p.numel()
        flat[offset : offset + n].copy_(p.detach().reshape(-1))
        p.data = flat[offset : offset + n].view_as(p)
        offset += n
    bucket.param_buffer = flat
    return flat


@torch.no_grad()
def cast_bucket_params(bucket, dtype: torch.dtype) -> torch.Tensor:
    """Replace a flattened bucket's parameter buffer (`flatten_bucket_params`) by one of
    `dtype` holding the rounded values, the parameters becoming views into it; returns it."""
    flat = bucket.param_buffer.to(dtype)
    offset = 0
    for p in bucket.params:
        n = p.numel()
        p.data = flat[offset : offset + n].view(p.shape)
        offset += n
    bucket.param_buffer = flat
    return flat


def bucket_moment_shards(slots) -> tuple[list, float]:
    """`moment_shards` of an optimizer whose state for elements [start, start + size) of each
    bucket lives in one AdamW state dict: `slots` yields (bucket, start, size, state)."""
    out, step = [], 0.0
    for bucket, start, size, state in slots:
        if "step" in state:
            step = float(state["step"])
        flats = [
            state[key] if key in state else torch.zeros(size, dtype=torch.float32) for key in ("exp_avg", "exp_avg_sq")
        ]
        offset = 0
        for p in bucket.params:
            n = p.numel()
            lo, hi = max(offset, start), min(offset + n, start + size)
            if lo < hi:
                out.append((p, lo - offset, tuple(f[lo - start : hi - start] for f in flats)))
            offset += n
    return out, step
