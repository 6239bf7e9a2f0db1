"""Fused column-parallel linear + activation: the first MLP layer, with the activation in
the matmul epilogue.

* `linear_gelu(x, weight, bias, approximate)`   = gelu(x @ weight.T + bias)
* `linear_swiglu(x, w_gate, b_gate, w_up, b_up)` = silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)

x is [..., K], weights are [N, K], biases [N] or None; the output is [..., N] in the compute
dtype. `backend="torch"` runs the plain-torch reference (`*_reference`), `backend="triton"`
the Triton kernels (on CPU only under TRITON_INTERPRET=1).

Triton path (fp32 accumulation throughout), by default without recomputation:

forward   one matmul of x with W^T (W [N, K] row-major: the GEMM's B operand transposed;
          for SwiGLU two accumulators, gate and up, fed by the same x tile), bias add and
          activation in fp32 in the epilogue; writes the activated output and the
          pre-activation(s) z (SwiGLU: [z_gate | z_up], [M, 2N]) in the compute dtype. Saved
          for backward: x, the weight copies and z -- torch eager saves the same for GeLU
          (x, W, z) and one more [M, N] tensor for SwiGLU (silu(z_gate) beside z_gate and z_up).
          Which kernel (`forward_plan`):
          - on CUDA, persistent (kernels/gemm.py's schedule): a grid of min(#SMs, #tiles)
            programs, program p computing output tiles p, p + grid, ... in grouped order (runs
            of GROUP_M tiles share W's tile in L2); the epilogue cut into `SUBTILES` column
            slices (<= 32 accumulator values per thread each: 128 accumulators plus gelu's
            temporaries of a whole 128x256 tile spill). The first call of a (kernel, shapes,
            dtype, flags, SMs) key autotunes, later ones launch the cached config directly.
            `_linear_gelu_tma_kernel` / `_linear_swiglu_tma_kernel` on sm_90+ when x and the
            weights are 16-bit and TMA-loadable (unit stride, 16-byte aligned base and rows:
            K % 8 == 0 for contiguous operands; both SwiGLU weights laid out alike): tiles
            loaded through host-side TensorDescriptors, W's [BLOCK_N, BLOCK_K] tile
            transposed in shared memory; otherwise `_linear_*_persistent_kernel` with masked
            pointer loads (sm_80, fp32, odd K or strides). Candidates: GeLU the persistent
            GEMMs' (Hopper 128x256 / 256x128 / BK 128 tiles kept on sm_90 for 16-bit), SwiGLU
            the dual tiles plus 128x128 per accumulator on 8 warps (sm_90, 16-bit: its two
            accumulators are counted by the pruning). No split-K: the activation needs whole
            dot products, and the forward has enough tiles for whole waves to dominate
            (gpt_1b tp=4 [4096, 1408]: 192 tiles of 128x256 = 1.45 waves on 132 SMs, 352 of
            128x128 = 2.7, the autotuner weighs the tail; 8B-class [8192, 14336]: 3584 of
            128x256, SwiGLU 7168 of 128x128).
          - `_linear_gelu_fwd_kernel` / `_linear_swiglu_fwd_kernel`, one program per tile
            through the autotuner: the interpreter's default and `persistent=False`.
          Test switches of `linear_gelu` / `linear_swiglu`: `persistent`, `tma` (True: the
          descriptor kernel wherever the operands allow, also off Hopper), `num_sms`.
backward  (1) `_linear_gelu_grad_kernel` / `_linear_swiglu_grad_kernel`, elementwise: the pre-activation
          gradient g = dy * act'(z) ([M, N]; SwiGLU [M, 2N] = [g_gate | g_up]);
          (2) two plain GEMMs (kernels/gemm.py `matmul`, Triton or cuBLAS by `gemm_backend`):
          dx = g @ W (SwiGLU: g_gate @ W_gate + g_up @ W_up, one launch) and dW = g^T @ x
          (SwiGLU: one GEMM over [g_gate | g_up]^T giving [dW_gate; dW_up]), dW written in
          the main weights' dtype; db = g.sum(0) is a torch reduction.
          Three GEMMs per linear, as torch runs.

`recompute=True` (opt-in memory mode): the forward (the same kernel choice, SAVE_PRE off)
writes only the output and saves x; the backward's one-program-per-tile `_linear_*_bwd_kernel`
recomputes the pre-activation tile(s) with the forward's matmul and writes g from it (a fourth
GEMM, no [M, N] tensor kept between the passes).

Precision: under autocast (trainer.precision=bf16|fp16) x and the weights are cast to the
autocast dtype (16-bit weight copies made once per step, kernels/operands.py) and every
matmul multiplies 16-bit tiles with fp32 accumulation (tensor cores); z is stored rounded
to 16 bits, as torch's F.linear output is. fp32 inputs use tf32 dots only when
`kernels.tf32` allows it (kernels/tf32.py); the dot precision is part of the autotune key.
On the interpreter tiles are cast to fp32 before `tl.dot` (bf16 dots are wrong there) and a
single autotune config is used (the persistent kernels' with 4 epilogue slices); on a GPU the
configs (kernels/gemm.py `gpu_configs`, `persistent_gpu_configs` here) are pruned per device
(kernels/configs.py) and autotuned.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from meshtron.kernels import gemm
from meshtron.kernels.backend import interpreting
from meshtron.kernels.configs import gemm_prune
from meshtron.kernels.gemm import GEMM_BACKENDS, autotune_configs, dot_flags, grid_2d, matmul
from meshtron.kernels.operands import compute_dtype, weight_copy

try:  # the torch backend works without triton
    import triton
    import triton.language as tl

    from meshtron.kernels.gemm import (
        _ptr_k_loop,
        _tma_k_loop,
        dot,
        ptr_k_loop_shared_a,
        tile_coords,
        tile_ids,
        tma_k_loop_shared_a,
    )
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


# SwiGLU's Hopper-sized tiles: 128x128 per accumulator, gate and up, is a 128x256 GEMM tile's
# output work; 128 accumulator registers per thread on 8 warps (sm_90's limit, above sm_80's)
# and 144 / 193 KiB of stages (one x tile and two W tiles per K step) on 3 / 4 stages.
SWIGLU_HOPPER_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4)]
EPILOGUE_REGS = 32  # accumulator values per thread one epilogue slice may hold (`SUBTILES`)


def subtiles(block_m: int, block_n: int, num_warps: int) -> int:
    """Column slices (1, 2 or 4) the persistent forwards' epilogue cuts a tile into: one per
    `EPILOGUE_REGS` accumulator values per thread and accumulator. With the whole tile at once,
    128 fp32 accumulators per thread plus gelu's temporaries spill (sm_90 AOT: 80-184 B)."""
    return max(1, min(4, block_m * block_n // (32 * num_warps) // EPILOGUE_REGS, block_n // 16))


def _with_subtiles(configs: list, interpreter: bool = False) -> list:
    """`configs` with their `SUBTILES` constexpr (the interpreter's 32x32 tile: 4 slices of 8
    columns, so that the tests run the sliced epilogue)."""
    return [
        triton.Config(
            {
                **c.kwargs,
                "SUBTILES": 4 if interpreter else subtiles(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps),
            },
            num_warps=c.num_warps,
            num_stages=c.num_stages,
            pre_hook=c.pre_hook,
        )
        for c in configs
    ]


def persistent_gpu_configs(swiglu: bool = False, pre_hook=None) -> list:
    """GPU candidates of the persistent forward kernels before the per-device pruning: GeLU
    takes the persistent GEMMs' (kernels/gemm.py `persistent_configs`, Hopper tiles included),
    SwiGLU the dual tiles of `gpu_configs(dual=True)` plus `SWIGLU_HOPPER_TILES` (its pruning
    counts two accumulators and two W tiles per K step); each with its epilogue `subtiles`."""
    if not swiglu:
        return _with_subtiles(gemm.persistent_configs(pre_hook))
    tiles = [
        (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
        for c in gemm.gpu_configs(dual=True)
    ]
    return _with_subtiles(gemm.configs_of(tiles + SWIGLU_HOPPER_TILES, pre_hook))


def _persistent_autotune_configs(swiglu: bool, pre_hook=None) -> list:
    """One small config under the interpreter, else `persistent_gpu_configs`."""
    if interpreting():
        return _with_subtiles(gemm.persistent_autotune_configs(pre_hook), interpreter=True)
    return persistent_gpu_configs(swiglu, pre_hook)


def tma_block_shapes(constexprs: dict) -> dict:
    """The block shape of each descriptor argument of the TMA forward kernels under a config's
    constexprs (BLOCK_*, A_T, B_T): x is kernels/gemm.py's A operand, each weight its B = W^T
    (a row-major W is B transposed: block [BLOCK_N, BLOCK_K]). Also read by kernels/aot.py."""
    blocks = gemm.tma_block_shapes(constexprs)
    return {
        "x_desc": blocks["a_desc"],
        "w_desc": blocks["b_desc"],
        "wg_desc": blocks["b_desc"],
        "wu_desc": blocks["b_desc"],
    }


def _set_tma_blocks(nargs: dict) -> None:
    """Config pre-hook of the TMA forward kernels: each descriptor's block for the config tried."""
    for name, shape in tma_block_shapes(nargs).items():
        if name in nargs:
            nargs[name].block_shape = shape


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

    @triton.jit
    def _gelu_store(
        acc,
        b_ptr,
        out_ptr,
        pre_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_om,
        stride_on,
        stride_pm,
        stride_pn,
        SAVE_PRE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        APPROX_TANH: tl.constexpr,
    ):
        """The GeLU forward epilogue of the fp32 tile acc = x W^T (rows offs_m, cols offs_n):
        z = acc + b, out = gelu(z) in fp32, stored (masked) in the output's dtype; with
        SAVE_PRE also z in pre's."""
        acc = _add_bias(acc, b_ptr, offs_n, N, HAS_BIAS)
        y, _dy = _gelu_and_grad(acc, APPROX_TANH)
        rows = offs_m[:, None].to(tl.int64)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + rows * stride_om + offs_n[None, :] * stride_on, y.to(out_ptr.dtype.element_ty), mask=mask)
        if SAVE_PRE:
            pre = acc.to(pre_ptr.dtype.element_ty)
            tl.store(pre_ptr + rows * stride_pm + offs_n[None, :] * stride_pn, pre, mask=mask)

    @triton.jit
    def _swiglu_store(
        a,
        u,
        bg_ptr,
        bu_ptr,
        out_ptr,
        pre_gate_ptr,
        pre_up_ptr,
        offs_m,
        offs_n,
        M,
        N,
        stride_om,
        stride_on,
        stride_pm,
        stride_pn,
        SAVE_PRE: tl.constexpr,
        HAS_BG: tl.constexpr,
        HAS_BU: tl.constexpr,
    ):
        """The SwiGLU forward epilogue of the fp32 tiles a = x Wg^T, u = x Wu^T: out =
        silu(a + bg) * (u + bu) in fp32, stored (masked) in the output's dtype; with SAVE_PRE
        also the two pre-activations (pre_gate, pre_up share strides)."""
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
        _gelu_store(
            acc,
            b_ptr,
            out_ptr,
            pre_ptr,
            offs_m,
            offs_n,
            M,
            N,
            stride_om,
            stride_on,
            stride_pm,
            stride_pn,
            SAVE_PRE,
            HAS_BIAS,
            APPROX_TANH,
        )

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
        _swiglu_store(
            a,
            u,
            bg_ptr,
            bu_ptr,
            out_ptr,
            pre_gate_ptr,
            pre_up_ptr,
            offs_m,
            offs_n,
            M,
            N,
            stride_om,
            stride_on,
            stride_pm,
            stride_pn,
            SAVE_PRE,
            HAS_BG,
            HAS_BU,
        )

    @triton.jit
    def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The left and right [BLOCK_M, BLOCK_N // 2] column halves of a tile."""
        return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))

    @triton.jit
    def _gelu_epilogue(
        acc,
        b_ptr,
        out_ptr,
        pre_ptr,
        pid_m,
        pid_n,
        M,
        N,
        stride_om,
        stride_on,
        stride_pm,
        stride_pn,
        SAVE_PRE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        APPROX_TANH: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SUBTILES: tl.constexpr,
    ):
        """`_gelu_store` of output tile (pid_m, pid_n) in SUBTILES (1, 2 or 4) column slices, one
        after the other: the activation's temporaries of one slice live beside the accumulator,
        not of the whole tile (128 accumulators per thread and gelu's of 64 more spill)."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if SUBTILES == 1:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _gelu_store(
                acc, b_ptr, out_ptr, pre_ptr, offs_m, offs_n, M, N, stride_om, stride_on, stride_pm, stride_pn,
                SAVE_PRE, HAS_BIAS, APPROX_TANH,
            )  # fmt: skip
        elif SUBTILES == 2:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            s0, s1 = _halves(acc, BLOCK_M, BLOCK_N)
            _gelu_store(
                s0, b_ptr, out_ptr, pre_ptr, offs_m, offs_n, M, N, stride_om, stride_on, stride_pm, stride_pn,
                SAVE_PRE, HAS_BIAS, APPROX_TANH,
            )  # fmt: skip
            _gelu_store(
                s1, b_ptr, out_ptr, pre_ptr, offs_m, offs_n + BLOCK_N // 2, M, N, stride_om, stride_on, stride_pm,
                stride_pn, SAVE_PRE, HAS_BIAS, APPROX_TANH,
            )  # fmt: skip
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 4)
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            s0, s1 = _halves(left, BLOCK_M, BLOCK_N // 2)
            s2, s3 = _halves(right, BLOCK_M, BLOCK_N // 2)
            _gelu_store(
                s0, b_ptr, out_ptr, pre_ptr, offs_m, offs_n, M, N, stride_om, stride_on, stride_pm, stride_pn,
                SAVE_PRE, HAS_BIAS, APPROX_TANH,
            )  # fmt: skip
            _gelu_store(
                s1, b_ptr, out_ptr, pre_ptr, offs_m, offs_n + BLOCK_N // 4, M, N, stride_om, stride_on, stride_pm,
                stride_pn, SAVE_PRE, HAS_BIAS, APPROX_TANH,
            )  # fmt: skip
            _gelu_store(
                s2, b_ptr, out_ptr, pre_ptr, offs_m, offs_n + 2 * (BLOCK_N // 4), M, N, stride_om, stride_on,
                stride_pm, stride_pn, SAVE_PRE, HAS_BIAS, APPROX_TANH,
            )  # fmt: skip
            _gelu_store(
                s3, b_ptr, out_ptr, pre_ptr, offs_m, offs_n + 3 * (BLOCK_N // 4), M, N, stride_om, stride_on,
                stride_pm, stride_pn, SAVE_PRE, HAS_BIAS, APPROX_TANH,
            )  # fmt: skip

    @triton.jit
    def _swiglu_epilogue(
        a,
        u,
        bg_ptr,
        bu_ptr,
        out_ptr,
        pre_gate_ptr,
        pre_up_ptr,
        pid_m,
        pid_n,
        M,
        N,
        stride_om,
        stride_on,
        stride_pm,
        stride_pn,
        SAVE_PRE: tl.constexpr,
        HAS_BG: tl.constexpr,
        HAS_BU: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SUBTILES: tl.constexpr,
    ):
        """`_swiglu_store` of output tile (pid_m, pid_n) in SUBTILES (1 or 2) column slices."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if SUBTILES == 1:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _swiglu_store(
                a, u, bg_ptr, bu_ptr, out_ptr, pre_gate_ptr, pre_up_ptr, offs_m, offs_n, M, N, stride_om,
                stride_on, stride_pm, stride_pn, SAVE_PRE, HAS_BG, HAS_BU,
            )  # fmt: skip
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
            a0, a1 = _halves(a, BLOCK_M, BLOCK_N)
            u0, u1 = _halves(u, BLOCK_M, BLOCK_N)
            _swiglu_store(
                a0, u0, bg_ptr, bu_ptr, out_ptr, pre_gate_ptr, pre_up_ptr, offs_m, offs_n, M, N, stride_om,
                stride_on, stride_pm, stride_pn, SAVE_PRE, HAS_BG, HAS_BU,
            )  # fmt: skip
            _swiglu_store(
                a1, u1, bg_ptr, bu_ptr, out_ptr, pre_gate_ptr, pre_up_ptr, offs_m, offs_n + BLOCK_N // 2, M, N,
                stride_om, stride_on, stride_pm, stride_pn, SAVE_PRE, HAS_BG, HAS_BU,
            )  # fmt: skip

    @triton.autotune(
        configs=_persistent_autotune_configs(swiglu=False),
        key=["M", "N", "K", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1)},
    )
    @triton.jit
    def _linear_gelu_persistent_kernel(
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
        SUBTILES: tl.constexpr,
    ):
        """`_linear_gelu_fwd_kernel` persistent: program p computes output tiles p, p + grid, ...
        in grouped order (masked pointer loads, W^T as B by its strides), each with the same
        epilogue. No split-K: the activation needs whole dot products."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _ptr_k_loop(
                acc,
                x_ptr,
                w_ptr,
                pid_m,
                pid_n,
                M,
                N,
                K,
                0,
                k_tiles,
                stride_xm,
                stride_xk,
                stride_wk,
                stride_wn,
                CAST_F32,
                PRECISION,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            _gelu_epilogue(
                acc, b_ptr, out_ptr, pre_ptr, pid_m, pid_n, M, N, stride_om, stride_on, stride_pm, stride_pn,
                SAVE_PRE, HAS_BIAS, APPROX_TANH, BLOCK_M, BLOCK_N, SUBTILES,
            )  # fmt: skip

    @triton.autotune(
        configs=_persistent_autotune_configs(swiglu=False, pre_hook=_set_tma_blocks),
        key=["M", "N", "K", "A_T", "B_T", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_desc", a_tiles=1, b_tiles=1)},
    )
    @triton.jit
    def _linear_gelu_tma_kernel(
        x_desc,
        w_desc,
        b_ptr,
        out_ptr,
        pre_ptr,
        M,
        N,
        K,
        stride_om,
        stride_on,
        stride_pm,
        stride_pn,
        SAVE_PRE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        APPROX_TANH: tl.constexpr,
        A_T: tl.constexpr,
        B_T: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SUBTILES: tl.constexpr,
    ):
        """`_linear_gelu_persistent_kernel` with the x and W tiles loaded by TMA through host-side
        descriptors (zero-filled past the edges; blocks set per config by `_set_tma_blocks`):
        B_T for a row-major W (its [BLOCK_N, BLOCK_K] tile transposed in shared memory), A_T
        for a column-major x."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _tma_k_loop(
                acc,
                x_desc,
                w_desc,
                pid_m * BLOCK_M,
                pid_n * BLOCK_N,
                0,
                k_tiles,
                A_T,
                B_T,
                CAST_F32,
                PRECISION,
                BLOCK_K,
            )
            _gelu_epilogue(
                acc, b_ptr, out_ptr, pre_ptr, pid_m, pid_n, M, N, stride_om, stride_on, stride_pm, stride_pn,
                SAVE_PRE, HAS_BIAS, APPROX_TANH, BLOCK_M, BLOCK_N, SUBTILES,
            )  # fmt: skip

    @triton.autotune(
        configs=_persistent_autotune_configs(swiglu=True),
        key=["M", "N", "K", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=2, accumulators=2)},
    )
    @triton.jit
    def _linear_swiglu_persistent_kernel(
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
        SUBTILES: tl.constexpr,
    ):
        """`_linear_swiglu_fwd_kernel` persistent: program p computes output tiles p, p + grid,
        ... in grouped order, gate and up accumulated from the same x tile (masked pointer
        loads), the same epilogue. No split-K."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            a, u = ptr_k_loop_shared_a(
                a,
                u,
                x_ptr,
                wg_ptr,
                wu_ptr,
                pid_m,
                pid_n,
                M,
                N,
                K,
                0,
                k_tiles,
                stride_xm,
                stride_xk,
                stride_wgk,
                stride_wgn,
                stride_wuk,
                stride_wun,
                CAST_F32,
                PRECISION,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            _swiglu_epilogue(
                a, u, bg_ptr, bu_ptr, out_ptr, pre_gate_ptr, pre_up_ptr, pid_m, pid_n, M, N, stride_om, stride_on,
                stride_pm, stride_pn, SAVE_PRE, HAS_BG, HAS_BU, BLOCK_M, BLOCK_N, SUBTILES,
            )  # fmt: skip

    @triton.autotune(
        configs=_persistent_autotune_configs(swiglu=True, pre_hook=_set_tma_blocks),
        key=["M", "N", "K", "A_T", "B_T", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_desc", a_tiles=1, b_tiles=2, accumulators=2)},
    )
    @triton.jit
    def _linear_swiglu_tma_kernel(
        x_desc,
        wg_desc,
        bg_ptr,
        wu_desc,
        bu_ptr,
        out_ptr,
        pre_gate_ptr,
        pre_up_ptr,
        M,
        N,
        K,
        stride_om,
        stride_on,
        stride_pm,
        stride_pn,
        SAVE_PRE: tl.constexpr,
        HAS_BG: tl.constexpr,
        HAS_BU: tl.constexpr,
        A_T: tl.constexpr,
        B_T: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SUBTILES: tl.constexpr,
    ):
        """`_linear_swiglu_persistent_kernel` with TMA loads (one x tile and the two W tiles per
        K step; the weights' descriptors laid out alike)."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            a, u = tma_k_loop_shared_a(
                a,
                u,
                x_desc,
                wg_desc,
                wu_desc,
                pid_m * BLOCK_M,
                pid_n * BLOCK_N,
                0,
                k_tiles,
                A_T,
                B_T,
                CAST_F32,
                PRECISION,
                BLOCK_K,
            )
            _swiglu_epilogue(
                a, u, bg_ptr, bu_ptr, out_ptr, pre_gate_ptr, pre_up_ptr, pid_m, pid_n, M, N, stride_om, stride_on,
                stride_pm, stride_pn, SAVE_PRE, HAS_BG, HAS_BU, BLOCK_M, BLOCK_N, SUBTILES,
            )  # fmt: skip

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

# the forward kernels by name (`ForwardPlan.kernel`)
_FWD_KERNELS = (
    {
        "_linear_gelu_fwd_kernel": _linear_gelu_fwd_kernel,
        "_linear_gelu_persistent_kernel": _linear_gelu_persistent_kernel,
        "_linear_gelu_tma_kernel": _linear_gelu_tma_kernel,
        "_linear_swiglu_fwd_kernel": _linear_swiglu_fwd_kernel,
        "_linear_swiglu_persistent_kernel": _linear_swiglu_persistent_kernel,
        "_linear_swiglu_tma_kernel": _linear_swiglu_tma_kernel,
    }
    if triton is not None
    else {}
)


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


class ForwardPlan(NamedTuple):
    """Which forward kernel runs (`forward_plan`): its name, the TMA layouts of (x, W^T)
    ("n": row-major, "t": transposed; None off the TMA kernels) and the SMs of a persistent
    grid (0: one program per tile)."""

    kernel: str
    layouts: tuple | None
    num_sms: int


class _Launch(NamedTuple):
    kwargs: dict  # the constexpr flags and the tuned config (block sizes, num_warps, num_stages)
    grid: int
    blocks: dict | None  # TMA descriptor blocks under that config (None: pointer loads)


_LAUNCHES: dict = {}  # launch key -> _Launch: the persistent forwards' tuned configs


def forward_plan(x2, weights, persistent=None, tma=None, num_sms=None) -> ForwardPlan:
    """The forward kernel for 2-D x2 [M, K] and the weight copies (one: GeLU, two: SwiGLU):
    persistent (default on CUDA; `persistent=False`, and the interpreter's default, is one
    program per tile), through TMA descriptors (default on sm_90+; `tma=True` also elsewhere,
    e.g. the interpreter) when x and the weights are 16-bit and TMA-loadable (kernels/gemm.py
    `_tma_layout`: unit stride, 16-byte aligned base and row stride; both weights laid out
    alike), with pointer loads otherwise. `num_sms` overrides the SM count of the grid."""
    name = "swiglu" if len(weights) == 2 else "gelu"
    if persistent is None:
        persistent = x2.device.type == "cuda"
    if not persistent:
        return ForwardPlan(f"_linear_{name}_fwd_kernel", None, 0)
    sms, major = gemm._device_info(x2.device)
    sms = num_sms or sms
    if tma is None:
        tma = major >= 9
    if tma and gemm.TensorDescriptor is not None and x2.dtype in gemm.TMA_DTYPES and x2.shape[1] > 0:
        lx = gemm._tma_layout(x2)
        lw = {gemm._tma_layout(w.t()) for w in weights}
        if lx is not None and len(lw) == 1 and None not in lw:
            return ForwardPlan(f"_linear_{name}_tma_kernel", (lx, lw.pop()), sms)
    return ForwardPlan(f"_linear_{name}_persistent_kernel", None, sms)


def _linear_act_fwd(x2, weights, biases, act, save_pre, persistent=None, tma=None, num_sms=None):
    """Triton forward on 2-D x2 [M, K]: (out [M, N], z) in x2.dtype, z the pre-activation
    ([M, N]; SwiGLU [M, 2N] = [z_gate | z_up]) when `save_pre`, else None. The kernel is
    `forward_plan`'s (`persistent`, `tma`, `num_sms` as there)."""
    M, K = x2.shape
    N = weights[0].shape[0]
    out = torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    z = torch.empty((M, len(weights) * N), device=x2.device, dtype=x2.dtype) if save_pre else None
    if M == 0 or N == 0:
        return out, z
    plan = forward_plan(x2, weights, persistent, tma, num_sms)
    cast, prec = dot_flags(x2.dtype)
    flags = dict(SAVE_PRE=save_pre, CAST_F32=cast, PRECISION=prec)
    if act == _SWIGLU:
        flags.update(HAS_BG=biases[0] is not None, HAS_BU=biases[1] is not None)
    else:
        flags.update(HAS_BIAS=biases[0] is not None, APPROX_TANH=act == _GELU_TANH)
    if plan.layouts is not None:
        flags.update(A_T=plan.layouts[0] == "t", B_T=plan.layouts[1] == "t")
    pre = out if z is None else z  # an unused pointer without SAVE_PRE
    pre_up = z[:, N:] if save_pre and act == _SWIGLU else pre
    sizes = (M, N, K)
    tail = (out.stride(0), out.stride(1), pre.stride(0), pre.stride(1))

    def args(blocks):
        """The kernel's arguments; x and the weights as TMA descriptors with `blocks`, or as
        pointers with their strides (blocks None). A missing bias: a stand-in pointer."""
        if blocks is None:
            operands = (x2, *weights)
            strides = (x2.stride(0), x2.stride(1), *(s for w in weights for s in w.stride()))
        else:
            lx, lw = plan.layouts
            operands = (gemm._descriptor(x2, lx, blocks["x_desc"]),)
            operands += tuple(gemm._descriptor(w.t(), lw, blocks["w_desc"]) for w in weights)
            strides = ()
        bs = tuple(out if b is None else b for b in biases)
        if act == _SWIGLU:
            head = (operands[0], operands[1], bs[0], operands[2], bs[1], out, pre, pre_up)
        else:
            head = (operands[0], operands[1], bs[0], out, pre)
        return (*head, *sizes, *strides, *tail)

    kernel = _FWD_KERNELS[plan.kernel]
    if plan.num_sms == 0:  # one program per tile, through the autotuner
        kernel[grid_2d(M, N)](*args(None), **flags)
    else:
        _launch_persistent(kernel, plan, args, flags, x2, N)
    return out, z


def _launch_persistent(kernel, plan: ForwardPlan, args, flags: dict, x2, N: int) -> None:
    """Launch a persistent forward kernel on min(SMs, output tiles) programs: the first call of a
    key through the autotuner (descriptor blocks set per config by its pre-hook), later calls
    straight to the jitted kernel with the cached config. `args(blocks)` builds the arguments
    (`blocks` None for the pointer kernels)."""
    M, K = x2.shape
    key = (plan.kernel, plan.layouts, M, N, K, x2.dtype, tuple(flags.items()), plan.num_sms, x2.device)
    launch = _LAUNCHES.get(key)
    if launch is not None:
        kernel.fn[(launch.grid,)](*args(launch.blocks), **launch.kwargs)
        return
    tma = plan.layouts is not None

    def programs(meta):
        return min(plan.num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]))

    blocks = tma_block_shapes({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, **flags}) if tma else None
    kernel[lambda meta: (programs(meta),)](*args(blocks), **flags)
    cfg = kernel.best_config
    blocks = tma_block_shapes({**cfg.kwargs, **flags}) if tma else None
    _LAUNCHES[key] = _Launch({**flags, **cfg.all_kwargs()}, programs(cfg.kwargs), blocks)


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
    def forward(ctx, x, weight, bias, w_c, approximate, recompute, gemm_backend, fwd_kernel):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        act = _GELU_TANH if approximate == "tanh" else _GELU_NONE
        out, z = _linear_act_fwd(x2, (w_c,), (bias,), act, not recompute, *fwd_kernel)
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
        return dx, dw, db, None, None, None, None, None


class _LinearSwigluFn(torch.autograd.Function):
    """Triton silu(x Wg^T + bg) * (x Wu^T + bu) on x and the compute-dtype copies of the
    weights; saves x, the copies and [z_gate | z_up] (not z with `recompute`) and returns the
    gradients of the main weights."""

    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, wg_c, wu_c, recompute, gemm_backend, fwd_kernel):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out, z = _linear_act_fwd(x2, (wg_c, wu_c), (b_gate, b_up), _SWIGLU, not recompute, *fwd_kernel)
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
        return dx, dwg, dbg, dwu, dbu, None, None, None, None, None


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
    persistent: bool | None = None,
    tma: bool | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """gelu(x @ weight.T + bias), differentiable in x, weight and bias.

    x [..., K], weight [N, K], bias [N] or None; approximate "tanh" or "none"; output
    [..., N] in the compute dtype (fp32 accumulation): autocast's dtype under autocast (x and
    weight cast to it, see kernels/operands.py), else x.dtype. backend "torch" runs
    `linear_gelu_reference`; "triton" the fused kernels: the activation in the forward
    matmul's epilogue, which also stores the pre-activation for the backward (with
    `recompute`: not stored, recomputed by the backward); the backward's dX and dW GEMMs run
    on `gemm_backend` ("triton" or "torch"), dW and db in the dtypes of weight and bias.
    The forward kernel (`forward_plan`): persistent on CUDA, through TMA descriptors on sm_90+
    where the operands allow, one program per tile under the interpreter; test switches
    `persistent`, `tma` (True: the descriptor kernel wherever the operands allow it) and
    `num_sms` (the SM count of the persistent grid).
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} must be one of {GELU_APPROXIMATIONS}")
    _check_modes(backend, gemm_backend)
    if backend == "torch":
        return linear_gelu_reference(x, weight, bias, approximate)
    dtype = compute_dtype(x)
    x, w_c = x.to(dtype), weight_copy(weight, dtype)
    _check(x, (w_c,), (bias,))
    fwd_kernel = (persistent, tma, num_sms)
    return _LinearGeluFn.apply(x, weight, bias, w_c, approximate, recompute, gemm_backend, fwd_kernel)


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
    persistent: bool | None = None,
    tma: bool | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up), differentiable in all inputs.

    x [..., K], w_gate/w_up [N, K], b_gate/b_up [N] or None; output [..., N] in the compute
    dtype (autocast's under autocast, else x.dtype; fp32 accumulation). backend "torch" runs
    `linear_swiglu_reference`; "triton" the fused kernels: gate and up accumulated from the
    same x tiles, the product and the two pre-activations written (2 [M, N] tensors saved,
    torch saves 3; with `recompute` none, both recomputed by the backward); the backward's
    dX and dW GEMMs run on `gemm_backend` ("triton" or "torch"). The forward kernel and the
    switches `persistent`, `tma`, `num_sms`: as `linear_gelu`'s.
    """
    _check_modes(backend, gemm_backend)
    if backend == "torch":
        return linear_swiglu_reference(x, w_gate, b_gate, w_up, b_up)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must have the same shape")
    dtype = compute_dtype(x)
    x, wg_c, wu_c = x.to(dtype), weight_copy(w_gate, dtype), weight_copy(w_up, dtype)
    _check(x, (wg_c, wu_c), (b_gate, b_up))
    fwd_kernel = (persistent, tma, num_sms)
    return _LinearSwigluFn.apply(x, w_gate, b_gate, w_up, b_up, wg_c, wu_c, recompute, gemm_backend, fwd_kernel)
