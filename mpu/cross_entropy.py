"""Cross-entropy over vocab-parallel logits, without materializing full logits on any rank.

Each TP rank holds logits for its slice [start, start + V/tp) of the padded vocabulary.
Two all-reduces over the TP group: the max (for a stable log-sum-exp), then the sum of
exponentials together with the target logit. Columns past the real vocabulary (padding)
are masked to -inf, so they never take part in the loss and get zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtron.mpu.mesh import group_size

IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        local_vocab = logits.shape[-1]
        if vocab_start + local_vocab > vocab_size:  # this shard holds padding (decided on the host, no sync)
            cols = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device)
            logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
        distributed = group_size(group) > 1

        logits_max = logits.max(dim=-1).values
        if distributed:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        ignored = target == IGNORE_INDEX
        local_target = target - vocab_start
        in_range = (local_target >= 0) & (local_target < local_vocab) & ~ignored
        safe_target = local_target.masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~in_range, 0.0)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        if distributed:
            both = torch.stack([sum_exp, target_logit])
            dist.all_reduce(both, group=group)
            sum_exp, target_logit = both[0], both[1]

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_target, in_range, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_target, in_range, ignored = ctx.saved_tensors
        grad = softmax.clone()
        hit = in_range.to(grad.dtype)
        grad.scatter_add_(-1, safe_target.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int = 0,
                                 vocab_size: int | None = None, group=None) -> torch.Tensor:
    """Per-token cross-entropy (no reduction) for logits split over the vocab across `group`.

    logits: [..., V_local] this rank's vocabulary slice starting at `vocab_start`;
    target: [...] global token ids (IGNORE_INDEX = -100 gives loss 0 and no gradient);
    vocab_size: the real vocabulary size, columns at or past it are padding and excluded.
    Returns fp32 losses of the target's shape, identical on every rank of `group`.
    """
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, group)
