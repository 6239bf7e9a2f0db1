"""Cross-entropy over vocab-parallel logits, without materializing full logits on any rank.

Each TP rank holds logits for its slice [start, start + V/tp) of the padded vocabulary; the
columns past the real vocabulary (padding) are simply not read, so they never take part in
the loss and get exactly zero gradient.

One pass over the logits, in row chunks small enough to stay in cache between the passes
over a chunk (max, then exp(x - local max) written once, then its row sum): per row the
local max, the sum of exponentials relative to it and the raw target logit. ONE all-gather of
those [3, rows] statistics over the TP group replaces separate max and sum all-reduces; each
rank combines them (`combine_gathered_partials`). The stored exponentials, rescaled per row,
are the softmax the backward needs; backward writes the gradient in one pass and needs no
communication.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from meshtron.mpu.mappings import all_gather_stats
from meshtron.mpu.mesh import group_size

IGNORE_INDEX = -100

# Elements per chunk of rows. CPU: 128 Ki fp32 = 512 KiB, read by the max and the exp pass and
# summed while still in a core's L2 cache. GPU: no cache to stay in, and every chunk costs a
# handful of kernel launches, so one chunk covers 64 Mi elements (a 4,096-token microbatch of
# a 16k-column vocabulary shard in one pass, where the CPU size made ~410 chunks of 10 rows).
CHUNK_ELEMENTS = 1 << 17
GPU_CHUNK_ELEMENTS = 1 << 26


def chunk_elements_for(device_type: str) -> int:
    """Elements per row chunk of `local_statistics` on a device type (CPU cache-sized, else GPU)."""
    return CHUNK_ELEMENTS if device_type == "cpu" else GPU_CHUNK_ELEMENTS


def combine_gathered_partials(
    local_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global per-row (max, sum_exp relative to it, target logit) from every rank's partials,
    each [world, N] (rank-major): sum_exp of rank k is relative to its local_max. A rank whose
    shard is all padding has local_max -inf and sum_exp 0 and adds nothing. No communication."""
    global_max = local_max.max(dim=0).values
    scaled = sum_exp * torch.exp(local_max - global_max.unsqueeze(0))
    return global_max, scaled.sum(dim=0), target_logit.sum(dim=0)


def global_statistics(stats: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (global max, sum_exp relative to it, target logit) from this rank's [3, N] local
    statistics (`local_statistics`): ONE all-gather of them over `group` when it has more than
    one member, else this rank's own."""
    if group_size(group) > 1:
        return combine_gathered_partials(*all_gather_stats(stats, group).unbind(1))
    return stats[0], stats[1], stats[2]


def loss_from_stats(
    global_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) per row: lse = log(sum_exp) + global_max, loss = lse - target_logit, and
    loss 0 where target == IGNORE_INDEX. No communication."""
    lse = torch.log(sum_exp) + global_max
    loss = (lse - target_logit).masked_fill(target == IGNORE_INDEX, 0.0)
    return loss, lse


def softmax_minus_onehot(
    exp: torch.Tensor, row_scale: torch.Tensor, safe_target: torch.Tensor, hit_weight: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The logits' cross-entropy gradient from stored exponentials, written into `out` [N, n]
    (may be `exp` itself): exp * row_scale per row, minus hit_weight at column safe_target
    (hit_weight 0 where the target is not in these columns; no columns: nothing to subtract).
    Returns `out`. No communication."""
    torch.mul(exp, row_scale.unsqueeze(1), out=out)
    return out.scatter_add_(1, safe_target.unsqueeze(1), -hit_weight.unsqueeze(1)) if out.shape[1] else out


def local_statistics(
    rows: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    exp_out: torch.Tensor | None = None,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """fp32 [3, N] per-row (local max, sum of exp(x - local max), raw target logit) of this
    rank's shard `rows` [N, V_local], reading only its first `n_valid` (non-padding) columns.
    The target logit is 0 where the target is ignored or in another shard, -inf where it
    points at padding. With `exp_out` ([N, n_valid] fp32) the exponentials are left there;
    it may be `rows` itself (read before it is overwritten). `chunk_elements`: elements per row
    chunk (default `chunk_elements_for` the device). No communication."""
    n = rows.shape[0]
    stats = torch.empty(3, n, dtype=torch.float32, device=rows.device)
    # The target logits first: `exp_out` may be `rows` itself (the fused loss's own logits).
    local_t = target - vocab_start
    in_shard = (local_t >= 0) & (local_t < rows.shape[1]) & (target != IGNORE_INDEX)
    safe_t = local_t.masked_fill(~in_shard, 0)
    t_logit = rows.gather(1, safe_t.unsqueeze(1)).squeeze(1).float()
    t_logit = t_logit.masked_fill(~in_shard, 0.0).masked_fill(in_shard & (local_t >= n_valid), float("-inf"))
    stats[2] = t_logit
    if n_valid <= 0:  # a shard of padding only
        stats[0].fill_(float("-inf"))
        stats[1].zero_()
    else:
        # Tensors without data (the planner's traces) take one chunk: same buffers, few ops.
        chunk_elements = chunk_elements or chunk_elements_for(rows.device.type)
        step = n if (rows.is_meta or is_fake(rows)) else max(1, chunk_elements // n_valid)
        scratch = None
        for i in range(0, n, step):
            x = rows[i : i + step, :n_valid]
            x = x if x.dtype == torch.float32 else x.float()
            m = x.amax(dim=1, keepdim=True)
            if exp_out is not None:
                e = exp_out[i : i + step]
            else:
                if scratch is None:
                    scratch = torch.empty(min(step, n), n_valid, dtype=torch.float32, device=rows.device)
                e = scratch[: x.shape[0]]
            torch.sub(x, m, out=e).exp_()
            torch.sum(e, dim=1, out=stats[1, i : i + step])
            stats[0, i : i + step] = m.squeeze(1)
    return stats


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        ctx.input_dtype, ctx.shape = logits.dtype, logits.shape
        local_vocab = logits.shape[-1]
        rows = logits.reshape(-1, local_vocab)
        tgt = target.reshape(-1)
        n_valid = max(0, min(local_vocab, vocab_size - vocab_start))  # decided on the host, no sync
        exp = torch.empty(rows.shape[0], n_valid, dtype=torch.float32, device=logits.device)
        stats = local_statistics(rows, tgt, vocab_start, n_valid, exp_out=exp)
        global_max, sum_exp, target_logit = global_statistics(stats, group)
        ignored = tgt == IGNORE_INDEX
        loss, _ = loss_from_stats(global_max, sum_exp, target_logit, tgt)
        # softmax = exp * row_scale: exp is relative to this rank's max, the sum to the global one.
        row_scale = torch.exp(stats[0] - global_max) / sum_exp
        local_t = tgt - vocab_start
        hit = (local_t >= 0) & (local_t < n_valid) & ~ignored
        ctx.save_for_backward(exp, row_scale, local_t.masked_fill(~hit, 0), hit, ignored)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        exp, row_scale, safe_target, hit, ignored = ctx.saved_tensors
        n, n_valid = exp.shape
        local_vocab = ctx.shape[-1]
        g = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
        grad = torch.empty(n, local_vocab, dtype=torch.float32, device=exp.device)
        softmax_minus_onehot(exp, row_scale * g, safe_target, g * hit, out=grad[:, :n_valid])
        grad[:, n_valid:].zero_()
        return grad.to(ctx.input_dtype).view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int = 0, vocab_size: int | None = None, group=None
) -> torch.Tensor:
    """Per-token cross-entropy (no reduction) for logits split over the vocab across `group`.

    logits: [..., V_local] this rank's vocabulary slice starting at `vocab_start`;
    target: [...] global token ids (IGNORE_INDEX = -100 gives loss 0 and no gradient);
    vocab_size: the real vocabulary size, columns at or past it are padding and excluded.
    Returns fp32 losses of the target's shape, identical on every rank of `group`.
    Communication over `group` (TP): one all-gather of [3, N] statistics forward, none backward.
    """
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group)
