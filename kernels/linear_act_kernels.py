"""The Triton kernels of the fused linear + activation (kernels/linear_act.py launches them
and holds the autograd functions and the public API; its docstring says what runs when).

* forward, one program per tile: `linear_gelu_fwd_kernel`, `linear_swiglu_fwd_kernel`
  (the interpreter's default, `persistent=False`, and the recompute mode's forward);
* forward, persistent (kernels/gemm.py's schedule): `_linear_*_persistent_kernel` (pointer
  loads) and `_linear_*_tma_kernel` (TMA descriptors, sm_90, 16-bit), the epilogue in column
  slices (`subtiles`);
* backward: the elementwise gradients `_linear_*_grad_kernel` from the saved pre-activations,
  or `_linear_*_bwd_kernel` recomputing them (the recompute mode);
* their autotune candidates (`elementwise_gpu_configs`, `persistent_gpu_configs`) and the TMA
  block shapes of a config (`tma_block_shapes`). No communication.
"""

from __future__ import annotations

from meshtron.kernels import gemm
from meshtron.kernels.backend import interpreting
from meshtron.kernels.configs import gemm_prune
from meshtron.kernels.gemm import autotune_configs

try:  # the torch backend works without triton
    import triton
    import triton.language as tl

    from meshtron.kernels.gemm import (
        dot,
        ptr_k_loop,
        ptr_k_loop_shared_a,
        tile_coords,
        tile_ids,
        tma_k_loop,
        tma_k_loop_shared_a,
    )
except ImportError:  # pragma: no cover
    triton = None
    tl = None


# ----------------------------------------------------------------------------- Triton kernels

# activation codes (constexpr ACT)
ACT_GELU_NONE, ACT_GELU_TANH, ACT_SWIGLU = 0, 1, 2


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
    def linear_gelu_fwd_kernel(
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
    def linear_swiglu_fwd_kernel(
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
    def linear_gelu_persistent_kernel(
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
        """`linear_gelu_fwd_kernel` persistent: program p computes output tiles p, p + grid, ...
        in grouped order (masked pointer loads, W^T as B by its strides), each with the same
        epilogue. No split-K: the activation needs whole dot products."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = ptr_k_loop(
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
    def linear_gelu_tma_kernel(
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
        """`linear_gelu_persistent_kernel` with the x and W tiles loaded by TMA through host-side
        descriptors (zero-filled past the edges; blocks set per config by `_set_tma_blocks`):
        B_T for a row-major W (its [BLOCK_N, BLOCK_K] tile transposed in shared memory), A_T
        for a column-major x."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = tma_k_loop(
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
    def linear_swiglu_persistent_kernel(
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
        """`linear_swiglu_fwd_kernel` persistent: program p computes output tiles p, p + grid,
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
    def linear_swiglu_tma_kernel(
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
        """`linear_swiglu_persistent_kernel` with TMA loads (one x tile and the two W tiles per
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
    def linear_gelu_grad_kernel(
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
    def linear_swiglu_grad_kernel(
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
    def linear_gelu_bwd_kernel(
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
    def linear_swiglu_bwd_kernel(
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
