"""Fused (vocab-parallel) cross-entropy with an online log-sum-exp; the softmax is never stored.

Each TP rank holds logits for its slice [vocab_start, vocab_start + V_local) of the padded
vocabulary; columns at or past `vocab_size` (the real vocabulary) are padding and behave as
-inf (no loss contribution, exactly zero gradient).

    kernel 1 (`_ce_partials_kernel`, one program per row): loops over the local vocab in
        blocks with an online max / sum-exp -> local max, sum_exp (relative to the local
        max) and the raw target logit (0 when the target is not in this shard or ignored).
    combine (`combine_partials`, plain torch): ONE all-gather of the stacked [3, N] partials
        over the TP group, then every rank rescales each rank's sum_exp to the global max and
        sums -> one collective per forward, as in `mpu.cross_entropy`.
    kernel 2 (`_ce_backward_kernel`, one program per row): grad = (softmax - onehot) * dloss,
        recomputed from the logits and the saved per-row log-sum-exp, written in place
        into the logits' storage by default (`inplace_backward=True`).

Autotune configs are chosen when this module is imported: set TRITON_INTERPRET=1 before the
import (one config under the interpreter, several Ampere/Hopper block sizes otherwise).

Backward needs no communication: each rank's gradient slice depends only on its own logits
and the already-global per-row log-sum-exp.
"""

from __future__ import annotations

import torch

from meshtron.kernels.backend import interpreting, triton_available
from meshtron.kernels.launch import launch
from meshtron.mpu.cross_entropy import (
    IGNORE_INDEX,
    combine_gathered_partials,
    loss_from_stats,
    vocab_parallel_cross_entropy,
)
from meshtron.mpu.mappings import all_gather_stats

__all__ = [
    "IGNORE_INDEX",
    "fused_cross_entropy",
    "cross_entropy_reference",
    "cross_entropy_partials",
    "combine_partials",
    "combine_gathered_partials",
    "loss_from_stats",
    "softmax_minus_onehot_",
]


# --------------------------------------------------------------------------- reference


def cross_entropy_reference(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0, vocab_size: int | None = None, group=None
) -> torch.Tensor:
    """Plain-torch reference: per-token fp32 cross-entropy of target's shape for logits
    [..., V_local] holding vocab columns [vocab_start, vocab_start + V_local); columns at or
    past `vocab_size` are padding. Communicates over `group` (TP): one all-gather of [3, N]
    statistics forward, none backward. Stores the fp32 exponentials (the unnormalised softmax)."""
    return vocab_parallel_cross_entropy(logits, target, vocab_start=vocab_start, vocab_size=vocab_size, group=group)


# --------------------------------------------------------------------------- combine (torch)


def combine_partials(
    local_max: torch.Tensor, sum_exp: torch.Tensor, target_logit: torch.Tensor, group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine per-rank kernel-1 partials over the TP `group` into global per-row statistics.

    local_max, sum_exp (relative to local_max), target_logit: fp32 [N] from this rank.
    Returns (global_max, global_sum_exp relative to global_max, global target logit).
    Communication: ONE all-gather of the stacked [3, N] partials over `group` (a local copy
    when `group` is None or has one member), then `combine_gathered_partials` on every rank.
    Non-differentiable; the autograd Function owns grads.
    """
    gathered = all_gather_stats(torch.stack([local_max, sum_exp, target_logit]), group)  # [world, 3, N]
    return combine_gathered_partials(*gathered.unbind(1))


# --------------------------------------------------------------------------- Triton kernels

if triton_available():
    import triton
    import triton.language as tl

    def gpu_configs() -> list:
        """Ampere/Hopper candidates (vocabulary block per loop step)."""
        return [
            triton.Config({"BLOCK_V": 1024}, num_warps=4),
            triton.Config({"BLOCK_V": 2048}, num_warps=8),
            triton.Config({"BLOCK_V": 4096}, num_warps=8),
            triton.Config({"BLOCK_V": 8192}, num_warps=16),
        ]

    def _configs() -> list:
        if interpreting():
            # More than one config needs a driver to benchmark; 128 keeps masking exercised
            # across several blocks in the CPU tests.
            return [triton.Config({"BLOCK_V": 128}, num_warps=4)]
        return gpu_configs()

    @triton.autotune(configs=_configs(), key=["V_local"])
    @triton.jit
    def _ce_partials_kernel(
        logits_ptr,
        target_ptr,
        max_ptr,
        sumexp_ptr,
        tgt_logit_ptr,
        stride_row,
        V_local,
        vocab_start,
        vocab_size,
        ignore_index,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        # Columns this shard holds that belong to the real vocabulary.
        n_valid = tl.minimum(V_local, vocab_size - vocab_start)
        m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
        for start in range(0, V_local, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # While everything seen is -inf (padding), shift by 0 to avoid (-inf) - (-inf).
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
            m = m_new
        t = tl.load(target_ptr + row)
        local_t = t - vocab_start
        hit = (local_t >= 0) & (local_t < V_local) & (t != ignore_index)
        safe_t = tl.where(hit, local_t, 0)
        t_logit = tl.load(row_ptr + safe_t, mask=hit, other=0.0).to(tl.float32)
        tl.store(max_ptr + row, m)
        tl.store(sumexp_ptr + row, s)
        tl.store(tgt_logit_ptr + row, t_logit)

    # Autotuning reruns the kernel: restore the logits it may overwrite (in-place backward).
    @triton.autotune(configs=_configs(), key=["V_local"], restore_value=["logits_ptr", "grad_ptr"])
    @triton.jit
    def _ce_backward_kernel(
        logits_ptr,
        grad_ptr,
        target_ptr,
        lse_ptr,
        dloss_ptr,
        stride_row,
        stride_grad_row,
        stride_dloss,
        V_local,
        vocab_start,
        vocab_size,
        ignore_index,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        grad_row_ptr = grad_ptr + row * stride_grad_row
        n_valid = tl.minimum(V_local, vocab_size - vocab_start)
        t = tl.load(target_ptr + row)
        lse = tl.load(lse_ptr + row)
        g = tl.load(dloss_ptr + row * stride_dloss).to(tl.float32)
        g = tl.where(t == ignore_index, 0.0, g)
        local_t = t - vocab_start
        for start in range(0, V_local, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < n_valid
            x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
            p = tl.where(valid, tl.exp(x - lse), 0.0)
            p = p - tl.where(cols == local_t, 1.0, 0.0)
            # Padding columns get an exact 0 (p is 0 there and local_t never points at them
            # for a valid target).
            tl.store(grad_row_ptr + cols, (p * g).to(grad_ptr.dtype.element_ty), mask=cols < V_local)


def _check_triton(logits: torch.Tensor) -> None:
    if not triton_available():
        raise RuntimeError("fused_cross_entropy(backend='triton') needs the triton package")
    if logits.device.type != "cuda" and not interpreting():
        raise RuntimeError("fused_cross_entropy(backend='triton') on CPU runs only under TRITON_INTERPRET=1")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"fused_cross_entropy: logits dtype {logits.dtype} not in fp32/bf16/fp16")


def _as_rows(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on leading dims")
    v = logits.shape[-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows = logits.reshape(-1, v)  # a view when possible: in-place backward then writes the caller's tensor
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, target.reshape(-1).contiguous()


def cross_entropy_partials(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel 1 on this rank's shard only: fp32 (local_max, sum_exp relative to local_max,
    target_logit) per row, flattened to [N]; no communication. target_logit is the raw logit
    of the target when it lies in [vocab_start, vocab_start + V_local) and is not ignored, else 0.
    Ignored rows (target == IGNORE_INDEX) are recognised from `target` by the caller."""
    _check_triton(logits)
    rows, tgt = _as_rows(logits, target)
    n, v = rows.shape
    if vocab_size is None:
        vocab_size = vocab_start + v
    out = torch.empty(3, n, dtype=torch.float32, device=rows.device)
    if n:
        key = (v, rows.dtype, tgt.dtype, rows.device)
        args = (rows, tgt, out[0], out[1], out[2], rows.stride(0), v, vocab_start, vocab_size, IGNORE_INDEX)
        launch(_ce_partials_kernel, (n,), key, *args)
    return out[0], out[1], out[2]


def softmax_minus_onehot_(
    logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, vocab_start: int = 0
) -> torch.Tensor:
    """Kernel 2 with a unit loss gradient, in place: each row of `logits` [N, V_local] (all
    columns real vocabulary) becomes softmax - onehot(target) given the row's global fp32
    log-sum-exp `lse` [N]; rows whose target is IGNORE_INDEX become 0. Returns `logits`.
    No communication (the chunked LM-head loss, kernels/linear_cross_entropy.py)."""
    _check_triton(logits)
    if logits.stride(-1) != 1 or logits.dim() != 2:
        raise ValueError("softmax_minus_onehot_: logits must be a row-major [N, V_local] matrix")
    n, v = logits.shape
    if n:
        ones = torch.ones(1, dtype=torch.float32, device=logits.device)
        launch(
            _ce_backward_kernel,
            (n,),
            (v, logits.dtype, logits.dtype, target.dtype, ones.dtype, logits.device),
            logits,
            logits,
            target.contiguous(),
            lse.contiguous(),
            ones,
            logits.stride(0),
            logits.stride(0),
            0,
            v,
            vocab_start,
            vocab_start + v,
            IGNORE_INDEX,
        )
    return logits


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group, inplace_backward):
        rows, tgt = _as_rows(logits, target)
        local_max, sum_exp, tgt_logit = cross_entropy_partials(rows, tgt, vocab_start, vocab_size)
        global_max, sum_exp, tgt_logit = combine_partials(local_max, sum_exp, tgt_logit, group)
        loss, lse = loss_from_stats(global_max, sum_exp, tgt_logit, tgt)
        ctx.save_for_backward(rows, tgt, lse)
        ctx.meta = (vocab_start, vocab_size, inplace_backward, logits.shape)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        rows, tgt, lse = ctx.saved_tensors
        vocab_start, vocab_size, inplace, shape = ctx.meta
        n, v = rows.shape
        grad = rows if inplace else torch.empty_like(rows)
        dloss = grad_loss.reshape(-1)
        if n:
            launch(
                _ce_backward_kernel,
                (n,),
                (v, rows.dtype, grad.dtype, tgt.dtype, dloss.dtype, rows.device),
                rows,
                grad,
                tgt,
                lse,
                dloss,
                rows.stride(0),
                grad.stride(0),
                dloss.stride(0),
                v,
                vocab_start,
                vocab_size,
                IGNORE_INDEX,
            )
        if inplace:
            # Triton wrote behind autograd's back: bump the version so any other saved use of
            # these logits fails loudly instead of silently reading gradients.
            torch.autograd.graph.increment_version(rows)
        return grad.view(shape), None, None, None, None, None


def fused_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group=None,
    backend: str = "torch",
    inplace_backward: bool = True,
) -> torch.Tensor:
    """Per-token cross-entropy (no reduction) over a vocab-parallel logits shard.

    logits: [..., V_local] (fp32/bf16/fp16, computed in fp32), this rank's vocabulary columns
    [vocab_start, vocab_start + V_local); target: [...] global token ids, IGNORE_INDEX (-100)
    gives loss 0 and zero gradient; vocab_size: the real vocabulary, columns at or past it are
    padding (treated as -inf, exactly zero gradient); default vocab_start + V_local.
    Returns fp32 losses of target's shape, identical on every rank of `group`.

    Communication over `group` (TP; None = single rank): forward one all-gather of the [3, N]
    per-row partials (max, sum-exp, target logit); backward none.

    backend: "torch" -> `cross_entropy_reference` (stores the fp32 exponentials);
    "triton" -> fused kernels with an online log-sum-exp (saves only the logits and per-row
    fp32 lse). With inplace_backward=True (default, triton only) the gradient is written into
    the logits' own storage and returned as their gradient: the forward's input logits are
    CONSUMED (overwritten) by backward. This is valid only because nothing else reads them
    after the loss (the usual LM head -> loss). The version counter is bumped, so another
    autograd use whose backward would read them afterwards raises a version error; a plain
    Python read of the tensor after backward silently sees gradients. Pass
    inplace_backward=False to allocate a separate gradient.
    """
    if backend == "torch":
        return cross_entropy_reference(logits, target, vocab_start, vocab_size, group)
    if backend != "triton":
        raise ValueError(f"fused_cross_entropy: backend={backend!r} must be 'torch' or 'triton'")
    _check_triton(logits)
    if vocab_size is None:
        vocab_size = vocab_start + logits.shape[-1]
    return _FusedCrossEntropy.apply(logits, target, vocab_start, vocab_size, group, inplace_backward)
