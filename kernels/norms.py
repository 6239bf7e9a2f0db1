"""Fused LayerNorm and RMSNorm (forward and backward) in Triton, beside plain-torch references.

Public API (all over the last dimension H of an input of any leading shape [..., H]):

* ``layer_norm_reference(x, weight, bias, eps)`` / ``rms_norm_reference(x, weight, eps)``:
  plain torch (``F.layer_norm`` / ``F.rms_norm``), differentiable by torch autograd.
* ``LayerNormFunction`` / ``RMSNormFunction``: ``torch.autograd.Function`` wrappers over the
  Triton kernels (``LayerNormFunction.apply(x, weight, bias, eps)``,
  ``RMSNormFunction.apply(x, weight, eps)``).
* ``layer_norm(x, weight, bias, eps, backend="torch")`` / ``rms_norm(x, weight, eps,
  backend="torch")``: dispatch on ``backend`` ("torch" -> reference, "triton" -> the autograd
  Function), like every kernel module's function: the config's ``auto`` and the self-checked
  mode are resolved above the kernels (``kernels.backend``, ``kernels.selfcheck``).
* ``residual_layer_norm(x, delta, weight, bias, eps, backend="torch")`` /
  ``residual_rms_norm(x, delta, weight, eps, backend="torch")`` -> ``(s, y)``: the residual add
  fused in front of the norm, ``s = x + delta`` (the new residual stream) and ``y = norm(s)``;
  "torch" is exactly the unfused ``s = x + delta; F.layer_norm / F.rms_norm(s)``, "triton" the
  ``ResidualLayerNormFunction`` / ``ResidualRMSNormFunction`` kernels below. The model's blocks
  use it for the attention residual and the MLP's norm (``models/gpt.py`` ``Block``). The MLP
  residual is not fused with the *next* block's norm: the block boundary is where pipeline
  stages split (a stage's output must be the residual stream alone, sent as one tensor) and
  where full recomputation checkpoints its input, so a cross-block fusion would have to hand
  (s, y) over the boundary or recompute the norm; left for later.

Numerics: inputs may be fp32, fp16 or bf16; statistics and all arithmetic are in fp32, the
output has ``x.dtype`` and the gradients have the dtype of the tensor they belong to.
``weight`` is required; ``bias`` may be None (LayerNorm only).

Kernel structure (one forward and one backward kernel, shared by both norms via the
``IS_RMS`` / ``HAS_BIAS`` constexpr flags):

* forward: one program per block of ``BLOCK_M`` rows, a [BLOCK_M, BLOCK_H] tile with
  ``BLOCK_H = next_power_of_2(H)`` (columns >= H and rows >= M are masked). Computes
  mean (LayerNorm only) and rstd in fp32, writes y and stores mean/rstd [M] (fp32) for the
  backward.
* backward: one program per *row block* of ``rows_per_prog`` consecutive rows (a multiple of
  ``_ROW_ALIGN``; about two blocks per SM on CUDA), walked in tiles of BLOCK_M rows. Each
  program recomputes xhat from the saved mean/rstd, writes dx for its rows and accumulates
  dweight (and dbias) over its rows in fp32 registers, then writes one row of a
  [num_blocks, H] fp32 partials buffer. The partials are reduced with ``partials.sum(0)``
  in torch (num_blocks is small, ~2*SMs, so a second kernel buys nothing) and cast to the
  parameter dtype.

Fused residual + norm (``_residual_norm_fwd_kernel``, and ``_norm_bwd_kernel`` with HAS_DS: the
same structure and configs as the plain norm's; the forward pruned to 32 elements per thread):

* forward: reads x and delta once, adds them in fp32 and rounds once to s's dtype (torch's
  type promotion of x + delta, so exactly torch's add), writes s, normalises the rounded s
  (what the backward reads back) and writes y = norm(s) * w (+ b); mean/rstd [M] fp32 saved.
  Bytes moved: x, delta in; s, y out, where unfused torch also reads s again for the norm.
* backward: takes the gradients of both outputs, ``ds_in`` (of s, from the rest of the
  residual stream) and ``dy``: ``d_x = d_delta = ds_in + norm_backward(dy)``, in one pass
  over s, dy and ds_in per row block, with the weight (and bias) gradient partials as above.
  Either gradient may be None (``set_materialize_grads(False)``): without dy no kernel runs
  (d_x = ds_in, no weight gradient); without ds_in the kernel skips its load.

Autotuning: the config lists (BLOCK_M, num_warps) are built when the kernels are first
used, from ``kernels.backend.interpreting()``: a single config under TRITON_INTERPRET=1
(multi-config autotune needs a driver), a few Hopper/Ampere configs pruned by tile size
otherwise. Kernels are built lazily (and cached per interpreting() value) rather than at
import, so importing this module before TRITON_INTERPRET is set does not bake in the wrong
mode. Autotune key: H and the flags (plus tensor dtypes, which triton adds itself); row
count is not in the key so varying sequence lengths do not retune.

Limits of the Triton path: H <= 65536 (one row must fit a tile), the last dim of x must be
addressable with unit stride after ``reshape(-1, H)`` (otherwise x is made contiguous).
"""

import functools
import math

import torch
import torch.nn.functional as F

from meshtron.kernels.backend import interpreting, triton_available
from meshtron.kernels.launch import launch

__all__ = [
    "layer_norm_reference",
    "rms_norm_reference",
    "LayerNormFunction",
    "RMSNormFunction",
    "layer_norm",
    "rms_norm",
    "ResidualLayerNormFunction",
    "ResidualRMSNormFunction",
    "residual_layer_norm",
    "residual_rms_norm",
]

_MAX_BLOCK_H = 65536
# Backward row blocks are a multiple of this (>= every BLOCK_M in the configs) so that the
# BLOCK_M tiles of one program never straddle two programs' rows.
_ROW_ALIGN = 16

# --------------------------------------------------------------------------- references


def _ref_dtype_ok(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    return all(p is None or p.dtype == x.dtype for p in params)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased
    variance; ``bias`` may be None), via ``F.layer_norm``. Output has x.dtype; when the
    parameters' dtype differs from x's, computes in fp32 and casts back."""
    h = x.shape[-1]
    if _ref_dtype_ok(x, weight, bias):
        return F.layer_norm(x, (h,), weight, bias, eps)
    return F.layer_norm(x.float(), (h,), weight.float(), None if bias is None else bias.float(), eps).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x**2) + eps) * weight`` via ``F.rms_norm``.
    Output has x.dtype; when weight's dtype differs from x's, computes in fp32 and casts back."""
    h = x.shape[-1]
    if _ref_dtype_ok(x, weight):
        return F.rms_norm(x, (h,), weight, eps)
    return F.rms_norm(x.float(), (h,), weight.float(), eps).to(x.dtype)


# --------------------------------------------------------------------------- triton kernels

if triton_available():
    import triton
    import triton.language as tl

    def _norm_fwd_kernel(
        X,
        W,
        B,
        Y,
        Mean,
        Rstd,
        M,
        H,
        stride_x,
        stride_y,
        eps,
        IS_RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """y = norm(x) * w (+ b) for BLOCK_M rows; stores mean (LayerNorm) and rstd per row."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_H)
        row_mask = rows < M
        col_mask = cols < H
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / H
            xc = tl.where(mask, x - mean[:, None], 0.0)
            tl.store(Mean + rows, mean, mask=row_mask)
        var = tl.sum(xc * xc, axis=1) / H
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(Rstd + rows, rstd, mask=row_mask)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
            y += b[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    def _norm_bwd_kernel(
        X,
        W,
        DY,
        DS,
        DX,
        Mean,
        Rstd,
        DW_part,
        DB_part,
        M,
        H,
        stride_x,
        stride_dy,
        stride_ds,
        stride_dx,
        rows_per_prog,
        IS_RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_DS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """dx = norm_backward(dy) (+ ds, read only if HAS_DS: the fused residual norm's stream
        gradient) for rows [pid*rows_per_prog, ...) and this row block's partial dw (db) sums.
        X is the norm's input (the residual stream s for the fused norm)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        col_mask = cols < H
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        row_start = pid * rows_per_prog
        row_end = tl.minimum(row_start + rows_per_prog, M)
        for start in range(row_start, row_end, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows.to(tl.int64)
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
            if IS_RMS:
                xhat = x * rstd[:, None]
            else:
                mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            wdy = w[None, :] * dy
            c1 = tl.sum(xhat * wdy, axis=1) / H
            if IS_RMS:
                dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
            else:
                c2 = tl.sum(wdy, axis=1) / H
                dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if HAS_DS:
                dx += tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
        tl.store(DW_part + pid * H + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if HAS_BIAS:
            tl.store(DB_part + pid * H + cols, tl.sum(db_acc, axis=0), mask=col_mask)

    def _residual_norm_fwd_kernel(
        X,
        D,
        W,
        B,
        S,
        Y,
        Mean,
        Rstd,
        M,
        H,
        stride_x,
        stride_d,
        stride_out,
        eps,
        IS_RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """s = x + delta (rounded once to S's dtype) and y = norm(s) * w (+ b) for BLOCK_M rows;
        stores mean (LayerNorm) and rstd per row. S and Y are [M, H] with row stride stride_out."""
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_H)
        row_mask = rows < M
        col_mask = cols < H
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.load(D + rows64[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        out = rows64[:, None] * stride_out + cols[None, :]
        s = (x + d).to(S.dtype.element_ty)
        tl.store(S + out, s, mask=mask)
        s = s.to(tl.float32)  # normalise the stored (rounded) stream, as torch and the backward see it
        if IS_RMS:
            sc = s
        else:
            mean = tl.sum(s, axis=1) / H
            sc = tl.where(mask, s - mean[:, None], 0.0)
            tl.store(Mean + rows, mean, mask=row_mask)
        var = tl.sum(sc * sc, axis=1) / H
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(Rstd + rows, rstd, mask=row_mask)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = sc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
            y += b[None, :]
        tl.store(Y + out, y.to(Y.dtype.element_ty), mask=mask)

    def _keep_per_thread(configs, block_h, most):
        kept = [c for c in configs if 2 <= c.kwargs["BLOCK_M"] * block_h / (32 * c.num_warps) <= most]
        if not kept:
            kept = [max((c for c in configs if c.kwargs["BLOCK_M"] == 1), key=lambda c: c.num_warps)]
        return kept

    def _prune_configs(configs, named_args, **kwargs):
        """Forward: keep configs whose tile gives each thread 2..64 fp32 elements per tensor; if
        none qualifies (very large H), keep the widest single-row config."""
        return _keep_per_thread(configs, kwargs.get("BLOCK_H", named_args.get("BLOCK_H")), 64)

    def _prune_residual_configs(configs, named_args, **kwargs):
        """Fused residual forward (x, delta and s live at once): 2..32 elements per thread; at 64
        (the plain forward's bound) it spills 112-192 B per thread on sm_80/sm_90 with 16 warps
        (kernels/aot.py measures it)."""
        return _keep_per_thread(configs, kwargs.get("BLOCK_H", named_args.get("BLOCK_H")), 32)

    def _prune_bwd_configs(configs, named_args, **kwargs):
        """Backward (x, dy, x-hat, dx and two accumulators live at once): 2..16 elements per
        thread, which keeps it free of spills up to H = 8192 (kernels/aot.py measures it)."""
        return _keep_per_thread(configs, kwargs.get("BLOCK_H", named_args.get("BLOCK_H")), 16)

    def gpu_norm_configs() -> tuple[list, list]:
        """(forward, backward) Hopper/Ampere candidates: several rows per program for small H,
        one row with many warps for large H; pruned by elements per thread (`_prune_configs`)."""
        fwd = [triton.Config({"BLOCK_M": bm}, num_warps=nw) for bm in (1, 2, 4, 8, 16) for nw in (2, 4, 8, 16)]
        bwd = [triton.Config({"BLOCK_M": bm}, num_warps=nw) for bm in (1, 2, 4, 8) for nw in (4, 8, 16)]
        return fwd, bwd

    def _autotune_args(interp: bool, fwd_prune=None) -> tuple[list, list, dict | None, dict | None]:
        """(forward configs, backward configs, forward prune, backward prune) for interpreter
        mode `interp`, shared by the plain and the fused residual norms (`fwd_prune`: the
        forward's pruning function, default `_prune_configs`)."""
        if interp:
            # One config: multi-config autotune needs a GPU driver. BLOCK_M=4 (< the test
            # row counts) exercises the row masking and the backward row loop.
            return (
                [triton.Config({"BLOCK_M": 4}, num_warps=4)],
                [triton.Config({"BLOCK_M": 4}, num_warps=4)],
                None,
                None,
            )
        fwd_cfgs, bwd_cfgs = gpu_norm_configs()
        prune = {"early_config_prune": fwd_prune or _prune_configs}
        return fwd_cfgs, bwd_cfgs, prune, {"early_config_prune": _prune_bwd_configs}

    @functools.cache
    def _kernels(interp: bool):
        """(forward, backward) autotuned kernels for interpreter mode `interp`."""
        fwd_cfgs, bwd_cfgs, prune, bwd_prune = _autotune_args(interp)
        key = ["H", "IS_RMS", "HAS_BIAS"]
        fwd = triton.autotune(configs=fwd_cfgs, key=key, prune_configs_by=prune)(triton.jit(_norm_fwd_kernel))
        bwd = triton.autotune(configs=bwd_cfgs, key=key, prune_configs_by=bwd_prune)(triton.jit(_norm_bwd_kernel))
        return fwd, bwd

    @functools.cache
    def _residual_kernels(interp: bool):
        """(forward, backward) autotuned fused residual + norm kernels for interpreter mode
        `interp`: the plain norm's configs and pruning, the forward's to 32 elements per thread."""
        fwd_cfgs, bwd_cfgs, prune, bwd_prune = _autotune_args(interp, _prune_residual_configs)
        key = ["H", "IS_RMS", "HAS_BIAS"]
        fwd = triton.autotune(configs=fwd_cfgs, key=key, prune_configs_by=prune)(triton.jit(_residual_norm_fwd_kernel))
        bwd = triton.autotune(configs=bwd_cfgs, key=key + ["HAS_DS"], prune_configs_by=bwd_prune)(
            triton.jit(_norm_bwd_kernel)
        )
        return fwd, bwd


def _require_triton():
    if not triton_available():
        raise RuntimeError("the Triton norm kernels need the triton package (pip install triton)")


def _rows(t: torch.Tensor, h: int) -> torch.Tensor:
    """View as [M, h] with unit stride on the last dim (copies only when needed)."""
    t2 = t.reshape(-1, h)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _device_guard(t: torch.Tensor):
    """Make t's GPU the current one for the launch (only when it is not already: the guard
    itself costs host time)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NullCtx()


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _block_h(h: int) -> int:
    bh = triton.next_power_of_2(h)
    if bh > _MAX_BLOCK_H:
        raise ValueError(f"Triton norm supports H <= {_MAX_BLOCK_H}, got H={h}; use backend='torch'")
    return bh


def _num_row_blocks(x2: torch.Tensor) -> int:
    """Rows per backward program (a multiple of _ROW_ALIGN) giving ~2 programs per SM."""
    m = x2.shape[0]
    if x2.is_cuda:
        from meshtron.kernels.gemm import device_info  # imports triton: only once kernels run

        target = 2 * device_info(x2.device)[0]
    else:
        target = 4
    rows_per_prog = math.ceil(m / target)
    rows_per_prog = max(_ROW_ALIGN, math.ceil(rows_per_prog / _ROW_ALIGN) * _ROW_ALIGN)
    return rows_per_prog


def _norm_forward(x, weight, bias, eps, is_rms):
    _require_triton()
    h = x.shape[-1]
    if weight.shape != (h,) or (bias is not None and bias.shape != (h,)):
        raise ValueError(
            f"weight/bias must have shape ({h},), got {tuple(weight.shape)}"
            f"{'' if bias is None else ' / ' + str(tuple(bias.shape))}"
        )
    x2 = _rows(x, h)
    m = x2.shape[0]
    y = torch.empty((m, h), dtype=x.dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    mean = rstd if is_rms else torch.empty(m, dtype=torch.float32, device=x.device)
    weight = weight.contiguous()
    bias_c = bias.contiguous() if bias is not None else None
    if m > 0:
        fwd, _ = _kernels(interpreting())
        block_h = _block_h(h)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)  # noqa: E731
        key = (h, is_rms, x2.dtype, weight.dtype, None if bias_c is None else bias_c.dtype, x.device)
        with _device_guard(x):
            launch(
                fwd,
                grid,
                key,
                x2,
                weight,
                bias_c if bias_c is not None else weight,
                y,
                mean,
                rstd,
                m,
                h,
                x2.stride(0),
                y.stride(0),
                float(eps),
                IS_RMS=is_rms,
                HAS_BIAS=bias_c is not None,
                BLOCK_H=block_h,
            )
    return y.view(x.shape), x2, weight, bias_c, mean, rstd


def _norm_backward(dy, x2, weight, has_bias, mean, rstd, is_rms):
    h = x2.shape[-1]
    m = x2.shape[0]
    dy2 = _rows(dy, h)
    dx = torch.empty((m, h), dtype=x2.dtype, device=x2.device)
    if m == 0:
        dw = torch.zeros(h, dtype=torch.float32, device=x2.device)
        db = torch.zeros_like(dw) if has_bias else None
        return dx, dw, db
    _, bwd = _kernels(interpreting())
    block_h = _block_h(h)
    rows_per_prog = _num_row_blocks(x2)
    num_blocks = triton.cdiv(m, rows_per_prog)
    dw_part = torch.empty((num_blocks, h), dtype=torch.float32, device=x2.device)
    db_part = torch.empty((num_blocks, h), dtype=torch.float32, device=x2.device) if has_bias else dw_part
    key = (h, is_rms, has_bias, x2.dtype, dy2.dtype, weight.dtype, x2.device)
    with _device_guard(x2):
        launch(
            bwd,
            (num_blocks,),
            key,
            x2,
            weight,
            dy2,
            dy2,  # DS: not read without HAS_DS
            dx,
            mean,
            rstd,
            dw_part,
            db_part,
            m,
            h,
            x2.stride(0),
            dy2.stride(0),
            0,
            dx.stride(0),
            rows_per_prog,
            IS_RMS=is_rms,
            HAS_BIAS=has_bias,
            HAS_DS=False,
            BLOCK_H=block_h,
        )
    # Reduction of the per-row-block partials: num_blocks (~2*SMs) x H, done in torch.
    dw = dw_part.sum(0)
    db = db_part.sum(0) if has_bias else None
    return dx, dw, db


class LayerNormFunction(torch.autograd.Function):
    """Triton LayerNorm with a Triton backward: ``LayerNormFunction.apply(x, weight, bias, eps)``
    computes ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (bias may be
    None) and returns gradients for x, weight and bias."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, x2, w, _, mean, rstd = _norm_forward(x, weight, bias, eps, is_rms=False)
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w, mean, rstd = ctx.saved_tensors
        dx, dw, db = _norm_backward(dy, x2, w, ctx.has_bias, mean, rstd, is_rms=False)
        return (
            dx.view(ctx.x_shape),
            dw.to(ctx.w_dtype),
            db.to(ctx.b_dtype) if db is not None else None,
            None,
        )


class RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm with a Triton backward: ``RMSNormFunction.apply(x, weight, eps)`` computes
    ``x / sqrt(mean(x**2) + eps) * weight`` over the last dim and returns gradients for x and
    weight."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x2, w, _, _, rstd = _norm_forward(x, weight, None, eps, is_rms=True)
        ctx.save_for_backward(x2, w, rstd)
        ctx.x_shape = x.shape
        ctx.w_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        dx, dw, _ = _norm_backward(dy, x2, w, False, rstd, rstd, is_rms=True)
        return dx.view(ctx.x_shape), dw.to(ctx.w_dtype), None


def _residual_norm_forward(x, delta, weight, bias, eps, is_rms):
    """(s, y, mean, rstd) of the fused residual + norm forward: s = x + delta in
    promote_types(x, delta) (torch's add), y = norm(s) * weight (+ bias) in s's dtype."""
    _require_triton()
    h = x.shape[-1]
    if delta.shape != x.shape:
        raise ValueError(f"residual norm: x {tuple(x.shape)} and delta {tuple(delta.shape)} must have one shape")
    if weight.shape != (h,) or (bias is not None and bias.shape != (h,)):
        raise ValueError(
            f"weight/bias must have shape ({h},), got {tuple(weight.shape)}"
            f"{'' if bias is None else ' / ' + str(tuple(bias.shape))}"
        )
    x2, d2 = _rows(x, h), _rows(delta, h)
    m = x2.shape[0]
    dtype = torch.promote_types(x.dtype, delta.dtype)
    s = torch.empty((m, h), dtype=dtype, device=x.device)
    y = torch.empty((m, h), dtype=dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    mean = rstd if is_rms else torch.empty(m, dtype=torch.float32, device=x.device)
    weight = weight.contiguous()
    bias_c = bias.contiguous() if bias is not None else None
    if m > 0:
        fwd, _ = _residual_kernels(interpreting())
        block_h = _block_h(h)
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)  # noqa: E731
        key = (h, is_rms, x2.dtype, d2.dtype, weight.dtype, None if bias_c is None else bias_c.dtype, x.device)
        with _device_guard(x):
            launch(
                fwd,
                grid,
                key,
                x2,
                d2,
                weight,
                bias_c if bias_c is not None else weight,
                s,
                y,
                mean,
                rstd,
                m,
                h,
                x2.stride(0),
                d2.stride(0),
                s.stride(0),
                float(eps),
                IS_RMS=is_rms,
                HAS_BIAS=bias_c is not None,
                BLOCK_H=block_h,
            )
    return s.view(x.shape), y.view(x.shape), mean, rstd


def _residual_norm_backward(ds, dy, s, weight, has_bias, mean, rstd, is_rms):
    """(d_s, dw, db): d_s = ds + norm_backward(dy) [M, H] in s's dtype, the fp32 weight (bias)
    gradients. dy must be given; ds may be None."""
    h = s.shape[-1]
    s2 = _rows(s, h)
    m = s2.shape[0]
    dy2 = _rows(dy, h)
    ds2 = _rows(ds, h) if ds is not None else None
    dx = torch.empty((m, h), dtype=s.dtype, device=s.device)
    if m == 0:
        dw = torch.zeros(h, dtype=torch.float32, device=s.device)
        return dx, dw, torch.zeros_like(dw) if has_bias else None
    _, bwd = _residual_kernels(interpreting())
    rows_per_prog = _num_row_blocks(s2)
    num_blocks = triton.cdiv(m, rows_per_prog)
    dw_part = torch.empty((num_blocks, h), dtype=torch.float32, device=s.device)
    db_part = torch.empty((num_blocks, h), dtype=torch.float32, device=s.device) if has_bias else dw_part
    key = (h, is_rms, has_bias, s2.dtype, dy2.dtype, None if ds2 is None else ds2.dtype, weight.dtype, s2.device)
    with _device_guard(s2):
        launch(
            bwd,
            (num_blocks,),
            key,
            s2,
            weight,
            dy2,
            ds2 if ds2 is not None else dy2,
            dx,
            mean,
            rstd,
            dw_part,
            db_part,
            m,
            h,
            s2.stride(0),
            dy2.stride(0),
            ds2.stride(0) if ds2 is not None else 0,
            dx.stride(0),
            rows_per_prog,
            IS_RMS=is_rms,
            HAS_BIAS=has_bias,
            HAS_DS=ds2 is not None,
            BLOCK_H=_block_h(h),
        )
    return dx, dw_part.sum(0), db_part.sum(0) if has_bias else None


def _residual_grads(ctx, ds, dy, is_rms):
    """(d_x, d_delta, d_weight, d_bias) of a fused residual norm from the gradients of s and y
    (either may be None: the Functions do not materialise them)."""
    s, w, mean, rstd = ctx.saved_tensors
    if dy is None:  # only the residual stream's gradient flows: the norm is not in the loss
        if ds is None:
            return None, None, None, None
        return ds.to(ctx.x_dtype), ds.to(ctx.d_dtype), None, None
    dx, dw, db = _residual_norm_backward(ds, dy, s, w, ctx.has_bias, mean, rstd, is_rms)
    dx = dx.view(s.shape)
    return dx.to(ctx.x_dtype), dx.to(ctx.d_dtype), dw.to(ctx.w_dtype), db.to(ctx.b_dtype) if db is not None else None


class ResidualLayerNormFunction(torch.autograd.Function):
    """Triton residual add + LayerNorm: ``ResidualLayerNormFunction.apply(x, delta, weight, bias,
    eps)`` returns ``(s, y)``, ``s = x + delta`` and ``y = layer_norm(s) * weight + bias`` (bias may
    be None), with gradients for x, delta, weight and bias from the gradients of s and y."""

    @staticmethod
    def forward(ctx, x, delta, weight, bias, eps):
        ctx.set_materialize_grads(False)
        s, y, mean, rstd = _residual_norm_forward(x, delta, weight, bias, eps, is_rms=False)
        ctx.save_for_backward(s, weight.contiguous(), mean, rstd)
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.d_dtype, ctx.w_dtype = x.dtype, delta.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        return (*_residual_grads(ctx, ds, dy, is_rms=False), None)


class ResidualRMSNormFunction(torch.autograd.Function):
    """Triton residual add + RMSNorm: ``ResidualRMSNormFunction.apply(x, delta, weight, eps)``
    returns ``(s, y)``, ``s = x + delta`` and ``y = rms_norm(s) * weight``, with gradients for x,
    delta and weight from the gradients of s and y."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps):
        ctx.set_materialize_grads(False)
        s, y, _, rstd = _residual_norm_forward(x, delta, weight, None, eps, is_rms=True)
        ctx.save_for_backward(s, weight.contiguous(), rstd, rstd)
        ctx.has_bias = False
        ctx.x_dtype, ctx.d_dtype, ctx.w_dtype = x.dtype, delta.dtype, weight.dtype
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        dx, dd, dw, _ = _residual_grads(ctx, ds, dy, is_rms=True)
        return dx, dd, dw, None


# --------------------------------------------------------------------------- public API


def _kernel_backend(backend: str, name: str) -> str:
    if backend not in ("torch", "triton"):
        raise ValueError(f"{name} backend={backend!r} must be 'torch' or 'triton'")
    return backend


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, backend: str = "torch"
) -> torch.Tensor:
    """LayerNorm over the last dim of x ([..., H]): ``(x - mean) / sqrt(var + eps) * weight +
    bias`` (bias may be None). ``backend``: "torch" (reference) or "triton" (fused kernels via
    LayerNormFunction)."""
    if _kernel_backend(backend, "layer_norm") == "torch":
        return layer_norm_reference(x, weight, bias, eps)
    return LayerNormFunction.apply(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch") -> torch.Tensor:
    """RMSNorm over the last dim of x ([..., H]): ``x / sqrt(mean(x**2) + eps) * weight``.
    ``backend``: "torch" (reference) or "triton" (fused kernels via RMSNormFunction)."""
    if _kernel_backend(backend, "rms_norm") == "torch":
        return rms_norm_reference(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


def residual_layer_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    backend: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + LayerNorm over the last dim: ``(s, y)`` with ``s = x + delta`` (x and delta
    of one shape; s in their promoted dtype) and ``y = layer_norm(s) * weight + bias`` (bias may
    be None). ``backend``: "torch" (``x + delta`` then the reference) or "triton" (one fused
    kernel each way, ResidualLayerNormFunction)."""
    if _kernel_backend(backend, "residual_layer_norm") == "torch":
        s = x + delta
        return s, layer_norm_reference(s, weight, bias, eps)
    return ResidualLayerNormFunction.apply(x, delta, weight, bias, eps)


def residual_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm over the last dim: ``(s, y)`` with ``s = x + delta`` (x and delta of
    one shape; s in their promoted dtype) and ``y = rms_norm(s) * weight``. ``backend``: "torch"
    (``x + delta`` then the reference) or "triton" (one fused kernel each way,
    ResidualRMSNormFunction)."""
    if _kernel_backend(backend, "residual_rms_norm") == "torch":
        s = x + delta
        return s, rms_norm_reference(s, weight, eps)
    return ResidualRMSNormFunction.apply(x, delta, weight, eps)
