"""The LM head and the cross-entropy in one pass over row chunks: the [tokens, V/tp] logits
never exist at full size.

For each chunk of rows: logits = x_c W^T (this rank's vocabulary slice, padding columns not
computed), per-row local statistics, ONE all-gather of the [3, rows] statistics over the TP
group (`combine_gathered_partials` on every rank), the summed loss, and, when a gradient is
wanted, the chunk's softmax-minus-one-hot turned at once into its share of the input gradient
(g_c W) and of the weight gradient (g_c^T x_c). The chunk's logits are then dropped. Backward
only scales the two gradients kept from forward by the incoming scalar: the loss is returned
summed (a scalar), so the per-token gradient factor is one number and the weight gradient
can be formed in forward. Three GEMMs in all, as the unfused head, and one chunk of logits at
a time instead of all of them. Kept from forward to backward: the fp32 input gradient
[tokens, h] and weight gradient [V/tp, h], in place of the fp32 softmax [tokens, V/tp] the
unfused loss keeps: less memory once a microbatch has more tokens than h.

Communication over `group` (TP): one all-gather of [3, rows] per chunk in forward, none in
backward. The input gradient is this rank's partial over its vocabulary slice: the caller
enters x through the TP region (copy -> all-reduce of the gradient, or the SP all-gather ->
reduce-scatter) exactly as for the unfused head.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from meshtron.kernels import selfcheck
from meshtron.kernels.backend import CHECKED
from meshtron.kernels.operands import compute_dtype, mm_into, weight_copy
from meshtron.mpu.cross_entropy import (
    IGNORE_INDEX,
    global_statistics,
    local_statistics,
    loss_from_stats,
    softmax_minus_onehot,
    vocab_parallel_cross_entropy,
)

# Chunk size by device: rows = max(MIN_CHUNK_ROWS, CHUNK_LOGITS // (V/tp)). Every chunk adds
# its share into the fp32 [V/tp, h] weight gradient, a pass over V/tp * h, and runs its GEMMs
# with as many rows as it has, so chunks need a floor of rows whatever the vocabulary; above
# the floor, CHUNK_LOGITS bounds their logits. Under the torch chunk operations the
# exponentials and then the gradient overwrite the fp32 logits (16-bit logits are widened
# first), so a chunk's transient is one fp32 buffer (16-bit: plus the logits or the gradient's
# 16-bit copy). CPU (2-core host, fp32, h 256): 256 rows beat 64 (+25-30% time) and whole
# logits at 4,096 tokens x V 32,000 (1,492 vs 1,806 ms unfused); at V 8,192 the issue-12 MoE
# training step ran 4-11% faster with 8 Mi logits per chunk (1,024 rows) and the exponentials
# in place than with 2 Mi (256 rows) and a separate buffer (`bench/throughput.py`, 6-8
# alternating runs of 30 steps, 2026-11-26). CUDA: 1,024 rows at least and 128 Mi logits (256
# MiB in 16 bits, plus their 512 MiB fp32 widening under the torch chunk operations), so the
# dW accumulation costs little next to the GEMMs; not measured on a GPU yet.
# `trainer.lm_loss_chunk_rows` overrides.
CHUNK_LOGITS = {"cpu": 1 << 23, "cuda": 1 << 27}
MIN_CHUNK_ROWS = {"cpu": 256, "cuda": 1024}


def chunk_rows_for(local_vocab: int, device_type: str = "cpu") -> int:
    """Rows per chunk on `device_type`: max(MIN_CHUNK_ROWS, CHUNK_LOGITS // local_vocab)."""
    kind = device_type if device_type in CHUNK_LOGITS else "cpu"
    return max(MIN_CHUNK_ROWS[kind], CHUNK_LOGITS[kind] // max(1, local_vocab))


def _ce_kernels():
    """kernels.cross_entropy, imported on first use: importing it imports triton and fixes its
    autotune configs, which must happen after a test has set TRITON_INTERPRET. Its functions
    are looked up per call (the self-check tests patch them)."""
    from meshtron.kernels import cross_entropy

    return cross_entropy


class _TorchChunkLoss:
    """Per-chunk statistics and softmax-minus-one-hot with plain torch ops (the reference): the
    exponentials, then the gradient, overwrite the chunk's logits, widened to fp32 first."""

    @staticmethod
    def working(logits: torch.Tensor) -> torch.Tensor:
        """The buffer the chunk's statistics and gradient overwrite: its fp32 logits."""
        return logits.float()

    @staticmethod
    def statistics(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
        # The chunk is already the unit of work: one pass per statistic over all its rows.
        return local_statistics(
            logits, target, vocab_start, logits.shape[1], exp_out=logits, chunk_elements=logits.numel()
        )

    @staticmethod
    def gradient(
        exp: torch.Tensor, local_max: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, vocab_start: int
    ) -> torch.Tensor:
        """softmax - onehot over this shard's columns (ignored rows: zero), in the storage of
        `exp`, the exponentials `statistics` left in the logits."""
        local_t = target - vocab_start
        ignored = target == IGNORE_INDEX
        hit = (local_t >= 0) & (local_t < exp.shape[1]) & ~ignored
        # softmax = exp(x - local max) * exp(local max - lse)
        scale = torch.exp(local_max - lse).masked_fill_(ignored, 0.0)
        return softmax_minus_onehot(exp, scale, local_t.masked_fill(~hit, 0), hit.to(exp.dtype), out=exp)


class _TritonChunkLoss:
    """Per-chunk statistics and gradient with the Triton cross-entropy kernels (GPU, or the
    interpreter): the gradient overwrites the chunk's logits (any dtype), no exponentials are
    stored."""

    @staticmethod
    def working(logits: torch.Tensor) -> torch.Tensor:
        return logits

    @staticmethod
    def statistics(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
        vocab_end = vocab_start + logits.shape[1]
        return torch.stack(_ce_kernels().cross_entropy_partials(logits, target, vocab_start, vocab_end))

    @staticmethod
    def gradient(logits, local_max, lse, target, vocab_start) -> torch.Tensor:
        return _ce_kernels().softmax_minus_onehot_(logits, target, lse, vocab_start)


BACKENDS = ("torch", "triton", CHECKED)


def _chunk_ops(backend: str, logits: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """The chunk operations for `backend`. Under triton_checked the cross-entropy kernels are
    self-checked (kernels/selfcheck.py, kernel "cross_entropy") on the first chunk's own logits,
    this shard alone (no communication), exactly as the unfused loss checks them on whole logits."""
    if backend == "torch":
        return _TorchChunkLoss
    if backend == "triton":
        return _TritonChunkLoss
    vocab_end = vocab_start + logits.shape[1]

    def triton_local(lg, tg):
        return _ce_kernels().fused_cross_entropy(
            lg, tg, vocab_start=vocab_start, vocab_size=vocab_end, group=None, backend="triton", inplace_backward=False
        )

    def torch_local(lg, tg):
        return vocab_parallel_cross_entropy(lg, tg, vocab_start=vocab_start, vocab_size=vocab_end, group=None)

    return selfcheck.dispatch(
        "cross_entropy",
        CHECKED,
        lambda *_: _TritonChunkLoss,
        lambda *_: _TorchChunkLoss,
        logits,
        target,
        check_fns=(triton_local, torch_local),
    )


def _chunk_loss(
    xc: torch.Tensor,
    w: torch.Tensor,
    tgt: torch.Tensor,
    vocab_start: int,
    local_vocab: int,
    group,
    backend: str,
    dtype: torch.dtype,
    grad_x: torch.Tensor | None,
    grad_w: torch.Tensor | None,
) -> torch.Tensor:
    """Summed loss of one chunk of rows xc [rows, h] (already in the GEMM dtype) against `w`,
    this shard's real vocabulary rows [n_valid, h]; with `grad_x` [rows, h] and `grad_w`
    [n_valid, h] (fp32) given, writes the chunk's input gradient and adds its weight-gradient
    share (unit loss gradient). One all-gather of [3, rows] statistics over `group`."""
    rows, n_valid = tgt.shape[0], w.shape[0]
    local_t = tgt - vocab_start
    ignored = tgt == IGNORE_INDEX
    in_padding = (local_t >= n_valid) & (local_t < local_vocab)
    logits = ops = None
    if n_valid == 0:  # a shard of padding only: no logits, no gradient
        stats = torch.zeros(3, rows, dtype=torch.float32, device=xc.device)
        stats[0].fill_(float("-inf"))
    else:
        logits = xc @ w.t()  # [rows, n_valid]
        ops = _chunk_ops(backend, logits, tgt, vocab_start)
        # The chunk's own buffer: its statistics and then its gradient overwrite it.
        logits = ops.working(logits)
        stats = ops.statistics(logits, tgt, vocab_start)
    # A target in this shard's padding: an impossible token, loss +inf as unfused.
    stats[2].masked_fill_(in_padding & ~ignored, float("-inf"))
    loss, lse = loss_from_stats(*global_statistics(stats, group), tgt)
    if grad_x is not None and logits is not None:
        grad = ops.gradient(logits, stats[0], lse, tgt, vocab_start)
        if dtype == torch.float32:
            torch.mm(grad, w, out=grad_x)
            grad_w.addmm_(grad.t(), xc)
        else:  # 16-bit GEMMs, the weight gradient accumulated across chunks in fp32
            grad = grad.to(dtype)
            mm_into(grad, w, grad_x)
            mm_into(grad.t(), xc, grad_w, accumulate=True)
    return loss.sum()


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, vocab_start, vocab_size, group, chunk_rows, backend, want_grad):
        n, hidden = x.shape
        local_vocab = weight.shape[0]
        n_valid = max(0, min(local_vocab, vocab_size - vocab_start))  # decided on the host, no sync
        dtype = compute_dtype(x)  # autocast's, as F.linear would use (the planner's fake tensors too)
        xc_all = x if x.dtype == dtype else x.to(dtype)
        w = weight_copy(weight, dtype)[:n_valid]  # a 16-bit copy made once per step (kernels/operands.py)
        shape_only = x.is_meta or is_fake(x)
        step = n if shape_only else chunk_rows
        # Every row of grad_x is written by its chunk, unless the shard is all padding.
        new = torch.zeros if n_valid == 0 else torch.empty
        grad_x = new(n, hidden, dtype=torch.float32, device=x.device) if want_grad else None
        grad_w = torch.zeros(local_vocab, hidden, dtype=torch.float32, device=x.device) if want_grad else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for i in range(0, n, step):
            # One chunk per call: its logits and exponentials are freed before the next is made.
            total += _chunk_loss(
                xc_all[i : i + step],
                w,
                target[i : i + step],
                vocab_start,
                local_vocab,
                group,
                backend,
                dtype,
                None if grad_x is None else grad_x[i : i + step],
                None if grad_w is None else grad_w[:n_valid],
            )
        ctx.x_dtype, ctx.w_dtype, ctx.want_grad = x.dtype, weight.dtype, want_grad
        if want_grad:
            ctx.save_for_backward(grad_x, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if not ctx.want_grad:
            return (None,) * 9
        grad_x, grad_w = ctx.saved_tensors
        g = grad_total.float()
        gx = (grad_x * g).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * g).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None, None, None, None


def linear_cross_entropy_sum(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group=None,
    chunk_rows: int | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Summed cross-entropy (fp32 scalar, identical on every rank of `group`) of the logits
    x W^T without materializing them: x [..., h] the LM head's input (already entered into the
    TP region), weight [V_local, h] this rank's vocabulary rows starting at `vocab_start`,
    target [...] global token ids (IGNORE_INDEX = -100: no loss, no gradient). Rows at or past
    `vocab_size` (the real vocabulary) are padding: never computed, zero gradient.
    `chunk_rows` rows per chunk (default: `chunk_rows_for(V_local, device)`); backend "torch",
    "triton" (the Triton cross-entropy kernels per chunk) or "triton_checked" (those kernels
    once they passed their self-check, `_chunk_ops`).
    Communication over `group` (TP): one all-gather of [3, chunk_rows] per chunk forward, none backward.
    The value equals vocab_parallel_cross_entropy(x @ weight.T, ...).sum() to fp32 rounding."""
    if backend not in BACKENDS:
        raise ValueError(f"linear_cross_entropy_sum: backend={backend!r} must be one of {sorted(BACKENDS)}")
    if x.shape[:-1] != target.shape:
        raise ValueError(
            f"linear_cross_entropy_sum: x {tuple(x.shape)} and target {tuple(target.shape)} "
            "disagree on the leading dims"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy_sum: x has {x.shape[-1]} features, weight {tuple(weight.shape)} "
            f"expects {weight.shape[1]}"
        )
    if vocab_size is None:
        vocab_size = vocab_start + weight.shape[0]
    rows = chunk_rows if chunk_rows is not None else chunk_rows_for(weight.shape[0], x.device.type)
    if rows < 1:
        raise ValueError(f"linear_cross_entropy_sum: chunk_rows={rows} must be >= 1")
    x2 = x.reshape(-1, x.shape[-1])
    # Inside forward autograd has turned grad mode off: decide here whether to build gradients.
    want_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _LinearCrossEntropySum.apply(
        x2, weight, target.reshape(-1), vocab_start, vocab_size, group, rows, backend, want_grad
    )
