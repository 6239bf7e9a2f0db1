"""Fused column-parallel linear + activation: the first MLP layer, with the activation in
the matmul epilogue.

* `linear_gelu(x, weight, bias, approximate)`   = gelu(x @ weight.T + bias)
* `linear_swiglu(x, w_gate, b_gate, w_up, b_up)` = silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)

x is [..., K], weights are [N, K], biases [N] or None; the output is [..., N] in x.dtype
(fp32/fp16/bf16; weights and biases are cast to x.dtype, like autocast does for F.linear).
`backend="torch"` runs the plain-torch reference (`*_reference`), `backend="triton"` the
Triton kernels (on CPU only under TRITON_INTERPRET=1).

Triton path (fp32 accumulation throughout):

forward   `_linear_act_fwd_kernel`: tiled matmul of x with W^T (for SwiGLU two accumulators,
          gate and up, fed by the same x tile), bias add and activation in the epilogue;
          writes only the activated output. Saved for backward: x and the weights (and which
          biases exist) -- not the pre-activation.
backward  (1) `_linear_act_bwd_kernel` recomputes the pre-activation tile(s) with the same
          matmul and multiplies the incoming gradient by the activation derivative, giving the
          pre-activation gradient g, written once ([M, N]; for SwiGLU [M, 2N] = [g_gate | g_up]),
          in x.dtype;
          (2) `_matmul_kernel` (a strided Triton matmul): dx = g @ W (for SwiGLU
          g_gate @ W_gate + g_up @ W_up in one kernel, two accumulating products), and
          dW = g^T @ x (for SwiGLU one launch over [g_gate | g_up]^T giving [dW_gate; dW_up]);
          db = g.sum(0) is a torch reduction (not a Triton kernel).

Precision: under autocast (trainer.precision=bf16|fp16) x and the weights are cast to the
autocast dtype (16-bit weight copies made once per step, kernels/operands.py) and every
matmul multiplies 16-bit tiles with fp32 accumulation (tensor cores); dW is written in the
main weights' dtype. fp32 inputs use tf32 dots only when `kernels.tf32` allows it
(kernels/tf32.py, matching torch's policy by default); the dot precision is part of the
autotune key. On the interpreter tiles are cast to fp32 before `tl.dot` (bf16 dots are wrong
there) and a single autotune config is used; on a GPU the Ampere/Hopper configs of
`gpu_configs` are pruned per device (kernels/configs.py) and autotuned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels.backend import interpreting
from meshtron.kernels.configs import gemm_prune
from meshtron.kernels.operands import compute_dtype, weight_copy
from meshtron.kernels.tf32 import dot_precision

try:  # the torch backend works without triton
    import triton
    import triton.language as tl
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


def _configs(bm_bn_bk_warps_stages):
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in bm_bn_bk_warps_stages
    ]


def gpu_configs(dual: bool = False) -> list:
    """The Ampere/Hopper autotune candidates (before the per-device pruning of
    `kernels.configs.gemm_prune`). `dual`: two B operands per K step (SwiGLU, dual dx)."""
    if dual:  # two accumulators or two products per step: smaller tiles keep registers in check
        tensor_core = [
            (128, 64, 64, 8, 3),
            (128, 64, 32, 4, 4),
            (64, 64, 64, 4, 4),
            (64, 128, 32, 4, 4),
            (64, 64, 32, 4, 3),
        ]
        cuda_core = [(128, 64, 16, 8, 3), (64, 64, 16, 4, 3)]  # IEEE fp32: thin K tiles
    else:
        tensor_core = [
            (128, 128, 64, 8, 3),
            (128, 128, 32, 4, 4),
            (128, 64, 32, 4, 4),
            (64, 128, 32, 4, 4),
            (64, 64, 64, 4, 4),
            (64, 64, 32, 4, 3),
        ]
        cuda_core = [(128, 128, 16, 8, 3), (128, 64, 16, 8, 3), (64, 64, 16, 4, 3)]
    return _configs(tensor_core + cuda_core)


def _autotune_configs(dual: bool = False):
    if interpreting():
        return _configs([(32, 32, 16, 4, 1)])
    return gpu_configs(dual)


if triton is not None:

    @triton.jit
    def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) in grouped order, so consecutive programs share rows of A (L2 reuse)."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        group = pid // per_group
        first_m = group * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
        return pid_m, pid_n

    @triton.jit
    def _dot(a, b, acc, CAST_F32: tl.constexpr, PRECISION: tl.constexpr):
        if CAST_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

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
            acc = _dot(x, w, acc, CAST_F32, PRECISION)
            if DUAL:
                w2 = tl.load(w2_ptrs, mask=wk_mask, other=0.0)
                acc2 = _dot(x, w2, acc2, CAST_F32, PRECISION)
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
        configs=_autotune_configs(),
        key=["M", "N", "K", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1)},
    )
    @triton.jit
    def _linear_gelu_fwd_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_xk,
        stride_wn,
        stride_wk,
        stride_om,
        stride_on,
        HAS_BIAS: tl.constexpr,
        APPROX_TANH: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """out = gelu(x @ W^T + b)."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    @triton.autotune(
        configs=_autotune_configs(dual=True),
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
        HAS_BG: tl.constexpr,
        HAS_BU: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """out = silu(x @ Wg^T + bg) * (x @ Wu^T + bu), gate and up from the same x tiles."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    # The epilogue holds the dy tile beside the accumulator: budgeted as a second accumulator.
    @triton.autotune(
        configs=_autotune_configs(),
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
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
        configs=_autotune_configs(dual=True),
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
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
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

    @triton.autotune(
        configs=_autotune_configs(),
        key=["M", "N", "K", "DUAL", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("a_ptr", a_tiles=1, b_tiles=1, dual="DUAL")},
    )
    @triton.jit
    def _matmul_kernel(
        a_ptr,
        b_ptr,
        a2_ptr,
        b2_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        stride_a2m,
        stride_a2k,
        stride_b2k,
        stride_b2n,
        stride_cm,
        stride_cn,
        DUAL: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """C = A @ B (+ A2 @ B2 when DUAL), any strides (transposes are stride swaps), fp32
        accumulation, C in its own dtype."""
        pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        rows = offs_m[:, None].to(tl.int64)
        cols = offs_n[None, :].to(tl.int64)
        a_ptrs = a_ptr + rows * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols * stride_bn
        a2_ptrs = a2_ptr + rows * stride_a2m + offs_k[None, :] * stride_a2k
        b2_ptrs = b2_ptr + offs_k[:, None] * stride_b2k + cols * stride_b2n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a_mask = m_mask[:, None] & (offs_k[None, :] < k_left)
            b_mask = (offs_k[:, None] < k_left) & n_mask[None, :]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            acc = _dot(a, b, acc, CAST_F32, PRECISION)
            if DUAL:
                a2 = tl.load(a2_ptrs, mask=a_mask, other=0.0)
                b2 = tl.load(b2_ptrs, mask=b_mask, other=0.0)
                acc = _dot(a2, b2, acc, CAST_F32, PRECISION)
                a2_ptrs += BLOCK_K * stride_a2k
                b2_ptrs += BLOCK_K * stride_b2k
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        tl.store(
            c_ptr + rows * stride_cm + cols * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )


# ----------------------------------------------------------------------------- launch helpers


def _grid(M, N):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


def _dot_flags(dtype: torch.dtype):
    """(CAST_F32, PRECISION): fp32 tiles under the interpreter (bf16 tl.dot is wrong there);
    the dot precision from `kernels.tf32` (tf32 or ieee for fp32, ignored for 16-bit)."""
    return interpreting(), dot_precision(dtype)


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


def _matmul(a, b, out, a2=None, b2=None):
    """out[M, N] = a[M, K] @ b[K, N] (+ a2 @ b2) with the Triton kernel; strided views allowed."""
    M, K = a.shape
    N = b.shape[1]
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    dual = a2 is not None
    a2 = a if a2 is None else a2
    b2 = b if b2 is None else b2
    cast, prec = _dot_flags(a.dtype)
    _matmul_kernel[_grid(M, N)](
        a,
        b,
        a2,
        b2,
        out,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        a2.stride(0),
        a2.stride(1),
        b2.stride(0),
        b2.stride(1),
        out.stride(0),
        out.stride(1),
        DUAL=dual,
        CAST_F32=cast,
        PRECISION=prec,
    )
    return out


def _linear_act_fwd(x2, weights, biases, act):
    """Triton forward on 2-D x2 [M, K]: the activated output [M, N] in x2.dtype."""
    M, K = x2.shape
    N = weights[0].shape[0]
    out = torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    if M == 0 or N == 0:
        return out
    cast, prec = _dot_flags(x2.dtype)
    if act == _SWIGLU:
        (wg, wu), (bg, bu) = weights, biases
        _linear_swiglu_fwd_kernel[_grid(M, N)](
            x2,
            wg,
            bg if bg is not None else wg,
            wu,
            bu if bu is not None else wu,
            out,
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
            HAS_BG=bg is not None,
            HAS_BU=bu is not None,
            CAST_F32=cast,
            PRECISION=prec,
        )
    else:
        (w,), (b,) = weights, biases
        _linear_gelu_fwd_kernel[_grid(M, N)](
            x2,
            w,
            b if b is not None else w,
            out,
            M,
            N,
            K,
            x2.stride(0),
            x2.stride(1),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_BIAS=b is not None,
            APPROX_TANH=act == _GELU_TANH,
            CAST_F32=cast,
            PRECISION=prec,
        )
    return out


def _linear_act_bwd(x2, weights, biases, act, dy, needs, dw_dtype):
    """Triton backward on 2-D tensors: (dx, *dweights, *dbiases), None where not needed.
    `weights` are the compute-dtype copies the forward used; dW is written in `dw_dtype` (the
    main weights' dtype) straight from the fp32 accumulator, db in each bias's dtype.
    `needs` = (x, *weights, *biases) flags in that order."""
    M, K = x2.shape
    N = weights[0].shape[0]
    nw = len(weights)
    cast, prec = _dot_flags(x2.dtype)
    # (1) pre-activation gradient(s), the pre-activation recomputed in the kernel
    g = torch.empty((M, nw * N), device=x2.device, dtype=x2.dtype)  # [g_gate | g_up] for SwiGLU
    if M > 0 and N > 0:
        if act == _SWIGLU:
            (wg, wu), (bg, bu) = weights, biases
            gg, gu = g[:, :N], g[:, N:]
            _linear_swiglu_bwd_kernel[_grid(M, N)](
                x2,
                wg,
                bg if bg is not None else wg,
                wu,
                bu if bu is not None else wu,
                dy,
                gg,
                gu,
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
            _linear_gelu_bwd_kernel[_grid(M, N)](
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
    # (2) dx = g @ W  (SwiGLU: g_gate @ W_gate + g_up @ W_up in one kernel)
    dx = None
    if needs[0]:
        dx = torch.empty((M, K), device=x2.device, dtype=x2.dtype)
        if N == 0:
            dx.zero_()
        elif nw == 2:
            _matmul(g[:, :N], weights[0], dx, g[:, N:], weights[1])
        else:
            _matmul(g, weights[0], dx)
    # dW = g^T @ x  (SwiGLU: one launch giving [dW_gate; dW_up])
    dws = [None] * nw
    if any(needs[1 : 1 + nw]):
        dw = torch.empty((nw * N, K), device=x2.device, dtype=dw_dtype)
        if M == 0:
            dw.zero_()
        else:
            _matmul(g.t(), x2, dw)
        dws = [dw[i * N : (i + 1) * N] if needs[1 + i] else None for i in range(nw)]
    # db = sum over rows of g (torch reduction, fp32 accumulation)
    dbs = [None] * nw
    for i, b in enumerate(biases):
        if b is not None and needs[1 + nw + i]:
            dbs[i] = g[:, i * N : (i + 1) * N].sum(0, dtype=torch.float32).to(b.dtype)
    return (dx, *dws, *dbs)


# ----------------------------------------------------------------------------- autograd


class _LinearGeluFn(torch.autograd.Function):
    """Triton gelu(x @ W^T + b) on x and the compute-dtype copy `w_c` of W; saves x and w_c
    (not the pre-activation) and returns the gradient of the main weight W."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_c, approximate):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        act = _GELU_TANH if approximate == "tanh" else _GELU_NONE
        out = _linear_act_fwd(x2, (w_c,), (bias,), act)
        ctx.save_for_backward(x2, w_c, bias)
        ctx.act, ctx.shape, ctx.w_dtype = act, shape, weight.dtype
        return out.view(*shape[:-1], w_c.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w_c, bias = ctx.saved_tensors
        dy2 = dy.reshape(-1, w_c.shape[0])
        needs = ctx.needs_input_grad[:3]
        dx, dw, db = _linear_act_bwd(x2, (w_c,), (bias,), ctx.act, dy2, needs, ctx.w_dtype)
        if dx is not None:
            dx = dx.view(ctx.shape)
        return dx, dw, db, None, None


class _LinearSwigluFn(torch.autograd.Function):
    """Triton silu(x Wg^T + bg) * (x Wu^T + bu) on x and the compute-dtype copies of the
    weights; saves x and the copies (not the pre-activations) and returns the gradients of
    the main weights."""

    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, wg_c, wu_c):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out = _linear_act_fwd(x2, (wg_c, wu_c), (b_gate, b_up), _SWIGLU)
        ctx.save_for_backward(x2, wg_c, b_gate, wu_c, b_up)
        ctx.shape, ctx.w_dtype = shape, w_gate.dtype
        return out.view(*shape[:-1], wg_c.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, wg_c, b_gate, wu_c, b_up = ctx.saved_tensors
        dy2 = dy.reshape(-1, wg_c.shape[0])
        n = ctx.needs_input_grad
        needs = (n[0], n[1], n[3], n[2], n[4])  # (x, w_gate, w_up, b_gate, b_up)
        dx, dwg, dwu, dbg, dbu = _linear_act_bwd(x2, (wg_c, wu_c), (b_gate, b_up), _SWIGLU, dy2, needs, ctx.w_dtype)
        if dx is not None:
            dx = dx.view(ctx.shape)
        return dx, dwg, dbg, dwu, dbu, None, None


# ----------------------------------------------------------------------------- public API


def linear_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh", backend: str = "torch"
) -> torch.Tensor:
    """gelu(x @ weight.T + bias), differentiable in x, weight and bias.

    x [..., K], weight [N, K], bias [N] or None; approximate "tanh" or "none"; output
    [..., N] in the compute dtype (fp32 accumulation): autocast's dtype under autocast (x and
    weight cast to it, see kernels/operands.py), else x.dtype. backend "torch" runs
    `linear_gelu_reference`; "triton" the fused kernels (forward with the activation in the
    matmul epilogue; backward recomputes the pre-activation instead of storing it; dW and db
    in the dtypes of weight and bias).
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} must be one of {GELU_APPROXIMATIONS}")
    if backend == "torch":
        return linear_gelu_reference(x, weight, bias, approximate)
    if backend != "triton":
        raise ValueError(f"backend={backend!r} must be 'torch' or 'triton'")
    dtype = compute_dtype(x)
    x, w_c = x.to(dtype), weight_copy(weight, dtype)
    _check(x, (w_c,), (bias,))
    return _LinearGeluFn.apply(x, weight, bias, w_c, approximate)


def linear_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    backend: str = "torch",
) -> torch.Tensor:
    """silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up), differentiable in all inputs.

    x [..., K], w_gate/w_up [N, K], b_gate/b_up [N] or None; output [..., N] in the compute
    dtype (autocast's under autocast, else x.dtype; fp32 accumulation). backend "torch" runs
    `linear_swiglu_reference`; "triton" the fused kernels (gate and up accumulated from the
    same x tiles, only the product written; backward recomputes both pre-activations instead
    of storing them).
    """
    if backend == "torch":
        return linear_swiglu_reference(x, w_gate, b_gate, w_up, b_up)
    if backend != "triton":
        raise ValueError(f"backend={backend!r} must be 'torch' or 'triton'")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must have the same shape")
    dtype = compute_dtype(x)
    x, wg_c, wu_c = x.to(dtype), weight_copy(w_gate, dtype), weight_copy(w_up, dtype)
    _check(x, (wg_c, wu_c), (b_gate, b_up))
    return _LinearSwigluFn.apply(x, w_gate, b_gate, w_up, b_up, wg_c, wu_c)
