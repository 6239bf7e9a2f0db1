"""Fused column-parallel linear + activation: the first MLP layer, with the activation in
the matmul epilogue.

* `linear_gelu(x, weight, bias, approximate)`   = gelu(x @ weight.T + bias)
* `linear_swiglu(x, w_gate, b_gate, w_up, b_up)` = silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)

x is [..., K], weights are [N, K], biases [N] or None; the output is [..., N] in the compute
dtype. `backend="torch"` runs the plain-torch reference (`*_reference`), `backend="triton"`
the Triton kernels (on CPU only under TRITON_INTERPRET=1).

Triton path (fp32 accumulation throughout), by default without recomputation:

forward   `_linear_gelu_fwd_kernel` / `_linear_swiglu_fwd_kernel`: tiled matmul of x with W^T
          (for SwiGLU two accumulators, gate and up, fed by the same x tile), bias add and
          activation in the epilogue; writes the activated output and the pre-activation(s)
          z (SwiGLU: [z_gate | z_up], [M, 2N]) in the compute dtype. Saved for backward: x, the
          weight copies and z -- torch eager saves the same for GeLU (x, W, z) and one more
          [M, N] tensor for SwiGLU (silu(z_gate) beside z_gate and z_up).
backward  (1) `_linear_gelu_grad_kernel` / `_linear_swiglu_grad_kernel`, elementwise: the pre-activation
          gradient g = dy * act'(z) ([M, N]; SwiGLU [M, 2N] = [g_gate | g_up]);
          (2) two plain GEMMs (kernels/gemm.py `matmul`, Triton or cuBLAS by `gemm_backend`):
          dx = g @ W (SwiGLU: g_gate @ W_gate + g_up @ W_up, one launch) and dW = g^T @ x
          (SwiGLU: one GEMM over [g_gate | g_up]^T giving [dW_gate; dW_up]), dW written in
          the main weights' dtype; db = g.sum(0) is a torch reduction.
          Three GEMMs per linear, as torch runs.

`recompute=True` (opt-in memory mode): the forward writes only the output and saves x; the
backward's `_linear_*_bwd_kernel` recomputes the pre-activation tile(s) with the forward's
matmul and writes g from it (a fourth GEMM, no [M, N] tensor kept between the passes).

Precision: under autocast (trainer.precision=bf16|fp16) x and the weights are cast to the
autocast dtype (16-bit weight copies made once per step, kernels/operands.py) and every
matmul multiplies 16-bit tiles with fp32 accumulation (tensor cores); z is stored rounded
to 16 bits, as torch's F.linear output is. fp32 inputs use tf32 dots only when
`kernels.tf32` allows it (kernels/tf32.py); the dot precision is part of the autotune key.
On the interpreter tiles are cast to fp32 before `tl.dot` (bf16 dots are wrong there) and a
single autotune config is used; on a GPU the configs of kernels/gemm.py `gpu_configs` are
pruned per device (kernels/configs.py) and autotuned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels.backend import interpreting
from meshtron.kernels.configs import gemm_prune
from meshtron.kernels.gemm import GEMM_BACKENDS, autotune_configs, dot_flags, grid_2d, matmul
from meshtron.kernels.operands import compute_dtype, weight_copy

try:  # the torch backend works without triton
    import triton
    import triton.language as tl

    from meshtron.kernels.gemm import dot, tile_ids
except ImportError:  # pragma: no cover
    triton = None
    tl = None

__all__ = [
    "linear_gelu",
    "linear_swiglu",
    "linear_gelu_reference",
    "linear_swiglu_reference",
]

GELU_APPROXIMATIONS = ("tanh", "none")


# ----------------------------------------------------------------------------- references


def linear_gelu_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh"
) -> torch.Tensor:
    """gelu(x @ weight.T + bias) in plain torch; x [..., K], weight [N, K], bias [N] or None,
    `approximate` "tanh" or "none" (erf). Output [..., N]."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} must be one of {GELU_APPROXIMATIONS}")
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def linear_swiglu_reference(
    x: torch.Tensor, w_gate: torch.Tensor, b_gate: torch.Tensor | None, w_up: torch.Tensor, b_up: torch.Tensor | None
) -> torch.Tensor:
    """silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up) in plain torch; x [..., K], weights
    [N, K], biases [N] or None. Output [..., N]."""
    return F.silu(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)


# ----------------------------------------------------------------------------- Triton kernels

# activation codes (constexpr ACT)
_GELU_NONE, _GELU_TANH, _SWIGLU = 0, 1, 2


def elementwise_gpu_configs() -> list:
    """Ampere/Hopper candidates of the elementwise gradient kernels: [rows, cols] per program."""
    return [
        triton.Config({"BLOCK_M": 8, "BLOCK_N": 256}, num_warps=4),
        triton.Config({"BLOCK_M": 16, "BLOCK_N": 256}, num_warps=8),
        triton.Config({"BLOCK_M": 4, "BLOCK_N": 512}, num_warps=4),
    ]


def _elementwise_configs() -> list:
    # 16 x 32 under the interpreter: odd test shapes still cross program borders both ways.
    return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4)] if interpreting() else elementwise_gpu_configs()


if triton is not None:

    @triton.jit
    def _xwt(
        x_ptr,
        w_ptr,
        w2_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_w2n,
        stride_w2k,
        offs_m,
        offs_n,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DUAL: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """fp32 tiles x[offs_m] @ W[offs_n]^T (and, when DUAL, x[offs_m] @ W2[offs_n]^T from the
        same x tile; otherwise the second result is zeros)."""
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        w2_ptrs = w2_ptr + offs_n[None, :].to(tl.int64) * stride_w2n + offs_k[:, None] * stride_w2k
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            wk_mask = (offs_k[:, None] < k_left) & n_mask[None, :]
            w = tl.load(w_ptrs, mask=wk_mask, other=0.0)
            acc = dot(x, w, acc, CAST_F32, PRECISION)
            if DUAL:
                w2 = tl.load(w2_ptrs, mask=wk_mask, other=0.0)
                acc2 = dot(x, w2, acc2, CAST_F32, PRECISION)
                w2_ptrs += BLOCK_K * stride_w2k
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        return acc, acc2

    @triton.jit
    def _add_bias(acc, b_ptr, offs_n, N, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        return acc

    @triton.jit
    def _tanh(u):
        # overflow-free: e = exp(-2|u|) in (0, 1]
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(u < 0, -t, t)

    @triton.jit
    def _gelu_and_grad(u, APPROX_TANH: tl.constexpr):
        """(gelu(u), gelu'(u)) in fp32."""
        if APPROX_TANH:
            k0 = 0.7978845608028654  # sqrt(2 / pi)
            k1 = 0.044715
            t = _tanh(k0 * (u + k1 * u * u * u))
            y = 0.5 * u * (1.0 + t)
            dy = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * u * u)
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))
            y = u * cdf
            dy = cdf + u * 0.3989422804014327 * tl.exp(-0.5 * u * u)  # 1/sqrt(2 pi)
        return y, dy

    @triton.autotune(
        configs=autotune_configs(),
        key=["M", "N", "K", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1)},
    )
    @triton.jit
    def _linear_gelu_fwd_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        pre_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_om,
        stride_on,
        stride_pm,
        stride_pn,
        SAVE_PRE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        APPROX_TANH: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """out = gelu(x @ W^T + b); with SAVE_PRE also pre = x @ W^T + b (the backward's input)."""
        pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, _unused = _xwt(
            x_ptr,
            w_ptr,
            w_ptr,
            M,
            N,
            K,
            stride_xm,
            stride_xk,
            stride_wn,
            stride_wk,
            stride_wn,
            stride_wk,
            offs_m,
            offs_n,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            False,
            CAST_F32,
            PRECISION,
        )
        acc = _add_bias(acc, b_ptr, offs_n, N, HAS_BIAS)
        y, _dy = _gelu_and_grad(acc, APPROX_TANH)
        rows = offs_m[:, None].to(tl.int64)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + rows * stride_om + offs_n[None, :] * stride_on, y.to(out_ptr.dtype.element_ty), mask=mask)
        if SAVE_PRE:
            pre = acc.to(pre_ptr.dtype.element_ty)
            tl.store(pre_ptr + rows * stride_pm + offs_n[None, :] * stride_pn, pre, mask=mask)

    @triton.autotune(
        configs=autotune_configs(dual=True),
        key=["M", "N", "K", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=2, accumulators=2)},
    )
    @triton.jit
    def _linear_swiglu_fwd_kernel(
        x_ptr,
        wg_ptr,
        bg_ptr,
        wu_ptr,
        bu_ptr,
        out_ptr,
        pre_gate_ptr,
        pre_up_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wgn,
        stride_wgk,
        stride_wun,
        stride_wuk,
        stride_om,
        stride_on,
        stride_pm,
        stride_pn,
        SAVE_PRE: tl.constexpr,
        HAS_BG: tl.constexpr,
        HAS_BU: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """out = silu(x @ Wg^T + bg) * (x @ Wu^T + bu), gate and up from the same x tiles; with
        SAVE_PRE also the two pre-activations (pre_gate, pre_up share strides)."""
        pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a, u = _xwt(
            x_ptr,
            wg_ptr,
            wu_ptr,
            M,
            N,
            K,
            stride_xm,
            stride_xk,
            stride_wgn,
            stride_wgk,
            stride_wun,
            stride_wuk,
            offs_m,
            offs_n,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            True,
            CAST_F32,
            PRECISION,
        )
        a = _add_bias(a, bg_ptr, offs_n, N, HAS_BG)
        u = _add_bias(u, bu_ptr, offs_n, N, HAS_BU)
        y = a * tl.sigmoid(a) * u
        rows = offs_m[:, None].to(tl.int64)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + rows * stride_om + offs_n[None, :] * stride_on, y.to(out_ptr.dtype.element_ty), mask=mask)
        if SAVE_PRE:
            pre_off = rows * stride_pm + offs_n[None, :] * stride_pn
            tl.store(pre_gate_ptr + pre_off, a.to(pre_gate_ptr.dtype.element_ty), mask=mask)
            tl.store(pre_up_ptr + pre_off, u.to(pre_up_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(configs=_elementwise_configs(), key=["N"])
    @triton.jit
    def _linear_gelu_grad_kernel(
        z_ptr,
        dy_ptr,
        g_ptr,
        M,
        N,
        stride_zm,
        stride_dym,
        stride_gm,
        APPROX_TANH: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """g = dy * gelu'(z), rows of unit column stride."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        rows = offs_m[:, None].to(tl.int64)
        z = tl.load(z_ptr + rows * stride_zm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows * stride_dym + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        _y, dact = _gelu_and_grad(z, APPROX_TANH)
        tl.store(g_ptr + rows * stride_gm + offs_n[None, :], (dy * dact).to(g_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(configs=_elementwise_configs(), key=["N"])
    @triton.jit
    def _linear_swiglu_grad_kernel(
        z_ptr,
        dy_ptr,
        g_ptr,
        M,
        N,
        stride_zm,
        stride_dym,
        stride_gm,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """[g_gate | g_up] from z = [z_gate | z_up] (both [M, 2N], unit column stride):
        g_gate = dy * z_up * silu'(z_gate), g_up = dy * silu(z_gate)."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        rows = offs_m[:, None].to(tl.int64)
        z_off = rows * stride_zm + offs_n[None, :]
        g_off = rows * stride_gm + offs_n[None, :]
        a = tl.load(z_ptr + z_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(z_ptr + z_off + N, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows * stride_dym + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        tl.store(g_ptr + g_off, (dy * u * (s * (1.0 + a * (1.0 - s)))).to(g_ptr.dtype.element_ty), mask=mask)
        tl.store(g_ptr + g_off + N, (dy * (a * s)).to(g_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(
        configs=autotune_configs(),
        key=["M", "N", "K", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1, accumulators=2)},
    )
    @triton.jit
    def _linear_gelu_bwd_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        dy_ptr,
        g_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_dym,
        stride_dyn,
        stride_gm,
        stride_gn,
        HAS_BIAS: tl.constexpr,
        APPROX_TANH: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """g = dy * gelu'(x @ W^T + b), the pre-activation recomputed here."""
        pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, _unused = _xwt(
            x_ptr,
            w_ptr,
            w_ptr,
            M,
            N,
            K,
            stride_xm,
            stride_xk,
            stride_wn,
            stride_wk,
            stride_wn,
            stride_wk,
            offs_m,
            offs_n,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            False,
            CAST_F32,
            PRECISION,
        )
        acc = _add_bias(acc, b_ptr, offs_n, N, HAS_BIAS)
        _y, dact = _gelu_and_grad(acc, APPROX_TANH)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        rows = offs_m[:, None].to(tl.int64)
        dy = tl.load(dy_ptr + rows * stride_dym + offs_n[None, :] * stride_dyn, mask=mask, other=0.0)
        g = dy.to(tl.float32) * dact
        tl.store(g_ptr + rows * stride_gm + offs_n[None, :] * stride_gn, g.to(g_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(
        configs=autotune_configs(dual=True),
        key=["M", "N", "K", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=2, accumulators=2)},
    )
    @triton.jit
    def _linear_swiglu_bwd_kernel(
        x_ptr,
        wg_ptr,
        bg_ptr,
        wu_ptr,
        bu_ptr,
        dy_ptr,
        gg_ptr,
        gu_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wgn,
        stride_wgk,
        stride_wun,
        stride_wuk,
        stride_dym,
        stride_dyn,
        stride_gm,
        stride_gn,
        HAS_BG: tl.constexpr,
        HAS_BU: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """With a = x Wg^T + bg, u = x Wu^T + bu recomputed here:
        g_gate = dy * u * silu'(a), g_up = dy * silu(a) (gg and gu share strides)."""
        pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a, u = _xwt(
            x_ptr,
            wg_ptr,
            wu_ptr,
            M,
            N,
            K,
            stride_xm,
            stride_xk,
            stride_wgn,
            stride_wgk,
            stride_wun,
            stride_wuk,
            offs_m,
            offs_n,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            True,
            CAST_F32,
            PRECISION,
        )
        a = _add_bias(a, bg_ptr, offs_n, N, HAS_BG)
        u = _add_bias(u, bu_ptr, offs_n, N, HAS_BU)
        s = tl.sigmoid(a)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        rows = offs_m[:, None].to(tl.int64)
        dy = tl.load(dy_ptr + rows * stride_dym + offs_n[None, :] * stride_dyn, mask=mask, other=0.0).to(tl.float32)
        g_gate = dy * u * (s * (1.0 + a * (1.0 - s)))
        g_up = dy * (a * s)
        g_off = rows * stride_gm + offs_n[None, :] * stride_gn
        tl.store(gg_ptr + g_off, g_gate.to(gg_ptr.dtype.element_ty), mask=mask)
        tl.store(gu_ptr + g_off, g_up.to(gu_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launch helpers


def _check(x, weights, biases):
    """Operands as the kernels take them: x and the weight copies in one compute dtype on one
    device; biases (fp32 main or 16-bit, read in fp32) on that device."""
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("backend='triton' on CPU runs only under TRITON_INTERPRET=1 (tests); use backend='torch'")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"linear_act: unsupported dtype {x.dtype} (fp32/fp16/bf16)")
    for w in weights:
        if w.dtype != x.dtype or w.device != x.device:
            raise TypeError(f"linear_act: weight {w.dtype} on {w.device} does not match x {x.dtype} on {x.device}")
    for b in biases:
        if b is not None and (not b.is_floating_point() or b.device != x.device):
            raise TypeError(f"linear_act: bias {b.dtype} on {b.device} must be floating point on {x.device}")


def _linear_act_fwd(x2, weights, biases, act, save_pre):
    """Triton forward on 2-D x2 [M, K]: (out [M, N], z) in x2.dtype, z the pre-activation
    ([M, N]; SwiGLU [M, 2N] = [z_gate | z_up]) when `save_pre`, else None."""
    M, K = x2.shape
    N = weights[0].shape[0]
    out = torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    z = torch.empty((M, len(weights) * N), device=x2.device, dtype=x2.dtype) if save_pre else None
    if M == 0 or N == 0:
        return out, z
    cast, prec = dot_flags(x2.dtype)
    pre = out if z is None else z  # an unused pointer without SAVE_PRE
    if act == _SWIGLU:
        (wg, wu), (bg, bu) = weights, biases
        _linear_swiglu_fwd_kernel[grid_2d(M, N)](
            x2,
            wg,
            bg if bg is not None else wg,
            wu,
            bu if bu is not None else wu,
            out,
            pre,
            pre[:, N:] if save_pre else pre,
            M,
            N,
            K,
            x2.stride(0),
            x2.stride(1),
            wg.stride(0),
            wg.stride(1),
            wu.stride(0),
            wu.stride(1),
            out.stride(0),
            out.stride(1),
            pre.stride(0),
            pre.stride(1),
            SAVE_PRE=save_pre,
            HAS_BG=bg is not None,
            HAS_BU=bu is not None,
            CAST_F32=cast,
            PRECISION=prec,
        )
    else:
        (w,), (b,) = weights, biases
        _linear_gelu_fwd_kernel[grid_2d(M, N)](
            x2,
            w,
            b if b is not None else w,
            out,
            pre,
            M,
            N,
            K,
            x2.stride(0),
            x2.stride(1),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            out.stride(1),
            pre.stride(0),
            pre.stride(1),
            SAVE_PRE=save_pre,
            HAS_BIAS=b is not None,
            APPROX_TANH=act == _GELU_TANH,
            CAST_F32=cast,
            PRECISION=prec,
        )
    return out, z


def _grad_from_saved(z, dy, g, act, N):
    """g = dy * act'(z) by the elementwise kernels (z, g: [M, N] or, SwiGLU, [M, 2N])."""
    M = z.shape[0]
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()

    def grid(meta):
        return triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"])

    if act == _SWIGLU:
        _linear_swiglu_grad_kernel[grid](z, dy, g, M, N, z.stride(0), dy.stride(0), g.stride(0))
    else:
        _linear_gelu_grad_kernel[grid](
            z, dy, g, M, N, z.stride(0), dy.stride(0), g.stride(0), APPROX_TANH=act == _GELU_TANH
        )


def _grad_recomputed(x2, weights, biases, act, dy, g):
    """g = dy * act'(z) with z recomputed from x2 and the weights by the recompute kernels."""
    M, K = x2.shape
    N = weights[0].shape[0]
    cast, prec = dot_flags(x2.dtype)
    if act == _SWIGLU:
        (wg, wu), (bg, bu) = weights, biases
        _linear_swiglu_bwd_kernel[grid_2d(M, N)](
            x2,
            wg,
            bg if bg is not None else wg,
            wu,
            bu if bu is not None else wu,
            dy,
            g[:, :N],
            g[:, N:],
            M,
            N,
            K,
            x2.stride(0),
            x2.stride(1),
            wg.stride(0),
            wg.stride(1),
            wu.stride(0),
            wu.stride(1),
            dy.stride(0),
            dy.stride(1),
            g.stride(0),
            g.stride(1),
            HAS_BG=bg is not None,
            HAS_BU=bu is not None,
            CAST_F32=cast,
            PRECISION=prec,
        )
    else:
        (w,), (b,) = weights, biases
        _linear_gelu_bwd_kernel[grid_2d(M, N)](
            x2,
            w,
            b if b is not None else w,
            dy,
            g,
            M,
            N,
            K,
            x2.stride(0),
            x2.stride(1),
            w.stride(0),
            w.stride(1),
            dy.stride(0),
            dy.stride(1),
            g.stride(0),
            g.stride(1),
            HAS_BIAS=b is not None,
            APPROX_TANH=act == _GELU_TANH,
            CAST_F32=cast,
            PRECISION=prec,
        )


def _linear_act_bwd(x2, weights, biases, act, dy, z, needs, dw_dtype, gemm_backend):
    """Triton backward on 2-D tensors: (dx, *dweights, *dbiases), None where not needed.
    `weights` are the compute-dtype copies the forward used, `z` its saved pre-activation (None:
    recompute it); dW is written in `dw_dtype` (the main weights' dtype) by the GEMM engine
    `gemm_backend`, db in each bias's dtype. `needs` = (x, *weights, *biases) flags in that order."""
    M, K = x2.shape
    N = weights[0].shape[0]
    nw = len(weights)
    g = torch.empty((M, nw * N), device=x2.device, dtype=x2.dtype)  # [g_gate | g_up] for SwiGLU
    if M > 0 and N > 0:
        if z is not None:
            _grad_from_saved(z, dy, g, act, N)
        else:
            _grad_recomputed(x2, weights, biases, act, dy, g)
    dx = None
    if needs[0]:  # dx = g @ W  (SwiGLU: g_gate @ W_gate + g_up @ W_up)
        dx = torch.empty((M, K), device=x2.device, dtype=x2.dtype)
        if N == 0:
            dx.zero_()
        elif nw == 2:
            matmul(g[:, :N], weights[0], dx, g[:, N:], weights[1], backend=gemm_backend)
        else:
            matmul(g, weights[0], dx, backend=gemm_backend)
    dws = [None] * nw
    if any(needs[1 : 1 + nw]):  # dW = g^T @ x  (SwiGLU: one GEMM giving [dW_gate; dW_up])
        dw = torch.empty((nw * N, K), device=x2.device, dtype=dw_dtype)
        if M == 0:
            dw.zero_()
        else:
            matmul(g.t(), x2, dw, backend=gemm_backend)
        dws = [dw[i * N : (i + 1) * N] if needs[1 + i] else None for i in range(nw)]
    dbs = [None] * nw  # db = sum over rows of g (torch reduction, fp32 accumulation)
    for i, b in enumerate(biases):
        if b is not None and needs[1 + nw + i]:
            dbs[i] = g[:, i * N : (i + 1) * N].sum(0, dtype=torch.float32).to(b.dtype)
    return (dx, *dws, *dbs)


# ----------------------------------------------------------------------------- autograd


class _LinearGeluFn(torch.autograd.Function):
    """Triton gelu(x @ W^T + b) on x and the compute-dtype copy `w_c` of W; saves x, w_c and
    the pre-activation (only x and w_c with `recompute`) and returns the main weight's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_c, approximate, recompute, gemm_backend):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        act = _GELU_TANH if approximate == "tanh" else _GELU_NONE
        out, z = _linear_act_fwd(x2, (w_c,), (bias,), act, save_pre=not recompute)
        ctx.save_for_backward(x2, w_c, bias, z)
        ctx.act, ctx.shape, ctx.w_dtype, ctx.gemm_backend = act, shape, weight.dtype, gemm_backend
        return out.view(*shape[:-1], w_c.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w_c, bias, z = ctx.saved_tensors
        dy2 = dy.reshape(-1, w_c.shape[0])
        needs = ctx.needs_input_grad[:3]
        dx, dw, db = _linear_act_bwd(x2, (w_c,), (bias,), ctx.act, dy2, z, needs, ctx.w_dtype, ctx.gemm_backend)
        if dx is not None:
            dx = dx.view(ctx.shape)
        return dx, dw, db, None, None, None, None


class _LinearSwigluFn(torch.autograd.Function):
    """Triton silu(x Wg^T + bg) * (x Wu^T + bu) on x and the compute-dtype copies of the
    weights; saves x, the copies and [z_gate | z_up] (not z with `recompute`) and returns the
    gradients of the main weights."""

    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, wg_c, wu_c, recompute, gemm_backend):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out, z = _linear_act_fwd(x2, (wg_c, wu_c), (b_gate, b_up), _SWIGLU, save_pre=not recompute)
        ctx.save_for_backward(x2, wg_c, b_gate, wu_c, b_up, z)
        ctx.shape, ctx.w_dtype, ctx.gemm_backend = shape, w_gate.dtype, gemm_backend
        return out.view(*shape[:-1], wg_c.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, wg_c, b_gate, wu_c, b_up, z = ctx.saved_tensors
        dy2 = dy.reshape(-1, wg_c.shape[0])
        n = ctx.needs_input_grad
        needs = (n[0], n[1], n[3], n[2], n[4])  # (x, w_gate, w_up, b_gate, b_up)
        dx, dwg, dwu, dbg, dbu = _linear_act_bwd(
            x2, (wg_c, wu_c), (b_gate, b_up), _SWIGLU, dy2, z, needs, ctx.w_dtype, ctx.gemm_backend
        )
        if dx is not None:
            dx = dx.view(ctx.shape)
        return dx, dwg, dbg, dwu, dbu, None, None, None, None


# ----------------------------------------------------------------------------- public API


def _check_modes(backend: str, gemm_backend: str) -> None:
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend={backend!r} must be 'torch' or 'triton'")
    if gemm_backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm_backend={gemm_backend!r} must be one of {GEMM_BACKENDS}")


def linear_gelu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    approximate: str = "tanh",
    backend: str = "torch",
    *,
    recompute: bool = False,
    gemm_backend: str = "triton",
) -> torch.Tensor:
    """gelu(x @ weight.T + bias), differentiable in x, weight and bias.

    x [..., K], weight [N, K], bias [N] or None; approximate "tanh" or "none"; output
    [..., N] in the compute dtype (fp32 accumulation): autocast's dtype under autocast (x and
    weight cast to it, see kernels/operands.py), else x.dtype. backend "torch" runs
    `linear_gelu_reference`; "triton" the fused kernels: the activation in the forward
    matmul's epilogue, which also stores the pre-activation for the backward (with
    `recompute`: not stored, recomputed by the backward); the backward's dX and dW GEMMs run
    on `gemm_backend` ("triton" or "torch"), dW and db in the dtypes of weight and bias.
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} must be one of {GELU_APPROXIMATIONS}")
    _check_modes(backend, gemm_backend)
    if backend == "torch":
        return linear_gelu_reference(x, weight, bias, approximate)
    dtype = compute_dtype(x)
    x, w_c = x.to(dtype), weight_copy(weight, dtype)
    _check(x, (w_c,), (bias,))
    return _LinearGeluFn.apply(x, weight, bias, w_c, approximate, recompute, gemm_backend)


def linear_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    backend: str = "torch",
    *,
    recompute: bool = False,
    gemm_backend: str = "triton",
) -> torch.Tensor:
    """silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up), differentiable in all inputs.

    x [..., K], w_gate/w_up [N, K], b_gate/b_up [N] or None; output [..., N] in the compute
    dtype (autocast's under autocast, else x.dtype; fp32 accumulation). backend "torch" runs
    `linear_swiglu_reference`; "triton" the fused kernels: gate and up accumulated from the
    same x tiles, the product and the two pre-activations written (2 [M, N] tensors saved,
    torch saves 3; with `recompute` none, both recomputed by the backward); the backward's
    dX and dW GEMMs run on `gemm_backend` ("triton" or "torch").
    """
    _check_modes(backend, gemm_backend)
    if backend == "torch":
        return linear_swiglu_reference(x, w_gate, b_gate, w_up, b_up)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must have the same shape")
    dtype = compute_dtype(x)
    x, wg_c, wu_c = x.to(dtype), weight_copy(w_gate, dtype), weight_copy(w_up, dtype)
    _check(x, (wg_c, wu_c), (b_gate, b_up))
    return _LinearSwigluFn.apply(x, w_gate, b_gate, w_up, b_up, wg_c, wu_c, recompute, gemm_backend)
