"""Plain GEMMs for the fused kernels' unfused products: C = A @ B (+ A2 @ B2), any strides.

`matmul(a, b, out=None, a2=None, b2=None, backend=...)` is what the fused linear+activation
backward (kernels/linear_act.py: dX = G W, dW = G^T X) and the benchmarks call:
* backend "torch": cuBLAS / the CPU BLAS through `torch.mm` (`addmm_` for the second
  product). A 16-bit product written into an fp32 `out` is accumulated in fp32 without a
  16-bit rounding where torch can (`mm(..., out_dtype=float32)` on CUDA); elsewhere it is
  computed in the operands' dtype and then cast.
* backend "triton", three kernels, all with fp32 accumulation and C written once in its own
  dtype (fp32 dW straight from the accumulator), both products of a dual call in one launch:
  - `_matmul_persistent_kernel` (the CUDA default): a grid of min(#SMs, #work units)
    programs; program p takes units p, p + grid, ... in grouped tile order (runs of GROUP_M
    tiles down a column share B's tile, a group's GROUP_M rows of A serve all its columns:
    the tiles in flight at once share operands in L2), masked pointer loads with a
    software-pipelined K loop. Any strides, fp32/tf32/16-bit.
  - `_matmul_tma_kernel`: the same schedule with the operand tiles loaded by TMA through
    host-side tensor descriptors (`triton.tools.tensor_descriptor.TensorDescriptor`, Triton
    >= 3.6). Runs on sm_90+ for 16-bit operands whose every operand (a, b, a2, b2) has a unit
    stride, a 16-byte aligned base and a 16-byte aligned other stride; a transposed operand
    (dW's G^T, x·Wᵀ's Wᵀ) gets its descriptor on the row-major storage and the tile is
    transposed in shared memory (`A_T`, `B_T`); a2/b2 must be laid out as a/b. Otherwise the
    pointer kernel runs.
  - `_matmul_kernel`: one program per tile (grouped order, masked pointer loads): the
    interpreter's default and `persistent=False` (a dual call with K2 != K runs persistent).
  Split-K (persistent kernels): when the output has fewer tiles than 2x the SMs, the tiles
  past the last full wave (all of them when tiles < SMs) are cut into `split` K ranges, with
  `split` minimising waves x (K tiles per piece + 3) (`split_plan`; at most `max_split`, 16 by
  default); the pieces store fp32 partials into a workspace and `_splitk_reduce_kernel` sums
  them in piece order into C: deterministic (no atomics), any C dtype. dW at gpt_1b tp=4
  (1408x2048 out, 176 tiles of 128x128 on 132 SMs) runs 132 whole tiles then 44 tiles in 3
  pieces: 1.33 waves instead of 2. `split_k=False` turns it off. On CPU only under
  TRITON_INTERPRET=1; the number of SMs is read once per device and cached (4 under the
  interpreter, `num_sms=` overrides it for tests).
  The launch: the first call of a (kernel, shapes, dtypes, flags) key goes through the
  autotuner (pruned per device by kernels/configs.py, the split-K reduction included in the
  timings); later calls launch the jitted kernel with the cached config directly.

Which engine runs a plain GEMM under kernels.backend=auto is `kernels.backend.auto_runs_torch
("gemm", ...)`'s call, from GPU measurements (bench/kernel_speed.py). No communication.

The tile configs (`gpu_configs`) and the jitted helpers `tile_ids` and `dot` are shared with
the fused GEMM kernels of kernels/linear_act_kernels.py; `persistent_configs` adds the Hopper-sized
tiles (128x256, 256x128, BK 128) for the persistent kernels. Its persistent forward kernels
also take `tile_coords`, the K loops `ptr_k_loop` / `tma_k_loop`, their two-product twins
`ptr_k_loop_shared_a` / `tma_k_loop_shared_a` (one A tile feeding two accumulators: SwiGLU's
gate and up), `tma_block_shapes` and the launch plumbing (`device_info`, `tma_layout`,
`descriptor`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshtron.kernels.backend import interpreting
from meshtron.kernels.configs import gemm_prune
from meshtron.kernels.operands import mm_into
from meshtron.kernels.tf32 import dot_precision

try:  # the torch backend works without triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

try:  # host-side TMA descriptors: Triton >= 3.6
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

__all__ = ["matmul", "gpu_configs", "persistent_configs", "split_plan", "gemm_plan"]

GEMM_BACKENDS = ("torch", "triton")
MAX_SPLIT = 16  # most K pieces of one split-K tile
SPLIT_OVERHEAD = 3  # K tiles' worth of time a piece costs beyond its K loop (prologue, partial store)
INTERPRETER_SMS = 4  # "SMs" of the CPU interpreter: small, so tests reach the persistent loop and split-K
TMA_DTYPES = (torch.bfloat16, torch.float16)


def configs_of(bm_bn_bk_warps_stages, pre_hook=None) -> list:
    """`triton.Config`s of (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tuples, GROUP_M 8."""
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s, pre_hook=pre_hook
        )
        for bm, bn, bk, w, s in bm_bn_bk_warps_stages
    ]


def _tiles(dual: bool) -> list:
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
    return tensor_core + cuda_core


# Hopper-sized tiles for the persistent kernels: 128 fp32 accumulators per thread on 8 warps
# and 192 KiB of operand stages. The pruning keeps them on sm_90 for 16-bit operands and drops
# them on sm_80 (accumulator registers or shared memory) and for fp32 operands.
HOPPER_TILES = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (256, 128, 64, 8, 4),
    (128, 128, 128, 8, 3),
]


def gpu_configs(dual: bool = False) -> list:
    """The Ampere/Hopper autotune candidates (before the per-device pruning of
    `kernels.configs.gemm_prune`). `dual`: two B operands per K step (SwiGLU, dual dx)."""
    return configs_of(_tiles(dual))


def persistent_configs(pre_hook=None) -> list:
    """`gpu_configs()` plus the Hopper-sized tiles: the persistent kernels' GPU candidates, for
    one product or two (a dual call stages two A and two B tiles per K step, which the pruning
    counts: of the Hopper tiles only 128x128x64 on 3 stages fits it, on sm_90)."""
    return configs_of(_tiles(False) + HOPPER_TILES, pre_hook)


def autotune_configs(dual: bool = False) -> list:
    """One small config under the interpreter (more need a driver to benchmark), else `gpu_configs`."""
    if interpreting():
        return configs_of([(32, 32, 16, 4, 1)])
    return gpu_configs(dual)


def tma_block_shapes(constexprs: dict) -> dict:
    """The block shape of each descriptor argument of `_matmul_tma_kernel` under a config
    (its BLOCK_* and A_T/B_T constexprs): a transposed operand's descriptor is on its
    row-major storage, so its block is the tile transposed. Also read by kernels/aot.py."""
    bm, bn, bk = constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_K"]
    a = [bk, bm] if constexprs["A_T"] else [bm, bk]
    b = [bn, bk] if constexprs["B_T"] else [bk, bn]
    return {"a_desc": a, "b_desc": b, "a2_desc": a, "b2_desc": b}


def _set_tma_blocks(nargs: dict) -> None:
    """Config pre-hook of the TMA kernel: each descriptor's block shape for the config tried
    (a2/b2 are None unless DUAL)."""
    for name, shape in tma_block_shapes(nargs).items():
        if nargs[name] is not None:
            nargs[name].block_shape = shape


def persistent_autotune_configs(pre_hook=None) -> list:
    """`autotune_configs` of the persistent kernels."""
    if interpreting():
        return configs_of([(32, 32, 16, 4, 1)], pre_hook)
    return persistent_configs(pre_hook)


def split_plan(tiles: int, k_tiles: int, num_sms: int, max_split: int) -> tuple[int, int]:
    """(full, split): the first `full` tiles run whole, the other `tiles - full` in `split`
    K pieces each. Split only when tiles < 2 x num_sms and a wave is left partly idle: the
    split of the tail minimises waves x (K tiles per piece + SPLIT_OVERHEAD). The host mirror
    of the kernels' `_split_plan` (same integer arithmetic)."""
    waves = tiles // num_sms
    tail = tiles - waves * num_sms
    best, best_cost = 1, k_tiles + SPLIT_OVERHEAD
    for s in range(2, max_split + 1):
        cost = -(-tail * s // num_sms) * (-(-k_tiles // s) + SPLIT_OVERHEAD)
        if cost < best_cost:
            best, best_cost = s, cost
    split = best if (tiles < 2 * num_sms and tail > 0) else 1
    return (waves * num_sms if split > 1 else tiles), split


if triton is not None:
    _SPLIT_OVERHEAD = tl.constexpr(SPLIT_OVERHEAD)

    @triton.jit
    def tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
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
    def tile_coords(tile, num_m, num_n, group_m):
        """(pid_m, pid_n) of linear tile index `tile` in grouped order (`tile_ids` of any tile)."""
        per_group = group_m * num_n
        first_m = (tile // per_group) * group_m
        group_size = tl.minimum(num_m - first_m, group_m)
        return first_m + (tile % per_group) % group_size, (tile % per_group) // group_size

    @triton.jit
    def dot(a, b, acc, CAST_F32: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ b (fp32 tiles under the interpreter, whose 16-bit dots are wrong)."""
        if CAST_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _split_plan(tiles, k_tiles, num_sms, max_split, OVERHEAD: tl.constexpr):
        """In-kernel `split_plan` (same arithmetic): (full, split)."""
        waves = tiles // num_sms
        tail = tiles - waves * num_sms
        best = tail * 0 + 1
        best_cost = tail * 0 + k_tiles + OVERHEAD
        for s in range(2, max_split + 1):
            cost = tl.cdiv(tail * s, num_sms) * (tl.cdiv(k_tiles, s) + OVERHEAD)
            better = cost < best_cost
            best = tl.where(better, s, best)
            best_cost = tl.where(better, cost, best_cost)
        split = tl.where((tiles < 2 * num_sms) & (tail > 0), best, 1)
        full = tl.where(split > 1, waves * num_sms, tiles)
        return full, split

    @triton.jit
    def _unit(u, full, tail, split, num_m, num_n, k_tiles, k2_tiles, GROUP_M: tl.constexpr):
        """Work unit `u`: (pid_m, pid_n, K-tile range of A@B, of A2@B2, workspace slot or -1).
        Units below `full` are whole tiles; unit full + s*tail + r is piece s of tile full + r."""
        v = u - full
        pieces = tl.where(v >= 0, split, 1)
        piece = tl.where(v >= 0, v // tl.maximum(tail, 1), 0)
        tile = tl.where(v >= 0, full + v % tl.maximum(tail, 1), u)
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        per = tl.cdiv(k_tiles, pieces)
        per2 = tl.cdiv(k2_tiles, pieces)
        lo = piece * per
        lo2 = piece * per2
        hi = tl.minimum(lo + per, k_tiles)
        hi2 = tl.minimum(lo2 + per2, k2_tiles)
        return pid_m, pid_n, lo, hi, lo2, hi2, v

    @triton.jit
    def _epilogue(
        acc, c_ptr, ws_ptr, slot, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """A whole tile into C (masked, in C's dtype); a split-K piece into its fp32 workspace slot."""
        if slot < 0:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
            tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        else:
            base = ws_ptr + slot.to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(base + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], acc)

    @triton.autotune(
        configs=autotune_configs(),
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
        """C = A @ B (+ A2 @ B2 when DUAL, same K), any strides (transposes are stride swaps),
        fp32 accumulation, C in its own dtype."""
        pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
            acc = dot(a, b, acc, CAST_F32, PRECISION)
            if DUAL:
                a2 = tl.load(a2_ptrs, mask=a_mask, other=0.0)
                b2 = tl.load(b2_ptrs, mask=b_mask, other=0.0)
                acc = dot(a2, b2, acc, CAST_F32, PRECISION)
                a2_ptrs += BLOCK_K * stride_a2k
                b2_ptrs += BLOCK_K * stride_b2k
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        tl.store(
            c_ptr + rows * stride_cm + cols * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )

    @triton.jit
    def ptr_k_loop(
        acc,
        a_ptr,
        b_ptr,
        pid_m,
        pid_n,
        M,
        N,
        K,
        lo,
        hi,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """acc + A[tile rows, K tiles lo..hi) @ B[K tiles lo..hi), tile cols], masked pointer loads."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m[:, None] < M
        n_mask = offs_n[None, :] < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (lo * BLOCK_K + offs_k[None, :]) * stride_ak
        b_ptrs = b_ptr + (lo * BLOCK_K + offs_k[:, None]) * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
        for kt in range(lo, hi):
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=m_mask & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & n_mask, other=0.0)
            acc = dot(a, b, acc, CAST_F32, PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        return acc

    @triton.jit
    def ptr_k_loop_shared_a(
        acc,
        acc2,
        a_ptr,
        b_ptr,
        b2_ptr,
        pid_m,
        pid_n,
        M,
        N,
        K,
        lo,
        hi,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        stride_b2k,
        stride_b2n,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """(acc + A @ B, acc2 + A @ B2) over K tiles lo..hi) of one output tile, each A tile
        loaded once for both products (masked pointer loads; B and B2 of one shape)."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m[:, None] < M
        n_mask = offs_n[None, :] < N
        cols = offs_n[None, :].to(tl.int64)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (lo * BLOCK_K + offs_k[None, :]) * stride_ak
        b_ptrs = b_ptr + (lo * BLOCK_K + offs_k[:, None]) * stride_bk + cols * stride_bn
        b2_ptrs = b2_ptr + (lo * BLOCK_K + offs_k[:, None]) * stride_b2k + cols * stride_b2n
        for kt in range(lo, hi):
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=m_mask & (offs_k[None, :] < k_left), other=0.0)
            b_mask = (offs_k[:, None] < k_left) & n_mask
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            b2 = tl.load(b2_ptrs, mask=b_mask, other=0.0)
            acc = dot(a, b, acc, CAST_F32, PRECISION)
            acc2 = dot(a, b2, acc2, CAST_F32, PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            b2_ptrs += BLOCK_K * stride_b2k
        return acc, acc2

    @triton.autotune(
        configs=persistent_autotune_configs(),
        key=["M", "N", "K", "K2", "DUAL", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("a_ptr", a_tiles=1, b_tiles=1, dual="DUAL")},
        post_hook=lambda nargs, exception: _bench_reduce(nargs, exception),
    )
    @triton.jit(do_not_specialize=["num_sms", "max_split"])
    def _matmul_persistent_kernel(
        a_ptr,
        b_ptr,
        a2_ptr,
        b2_ptr,
        c_ptr,
        ws_ptr,
        M,
        N,
        K,
        K2,
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
        num_sms,
        max_split,
        DUAL: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """Persistent C = A @ B (+ A2 @ B2 when DUAL, K2 long): program p takes work units p,
        p + grid, ... in grouped tile order; split-K pieces (`_split_plan`) go to `ws_ptr`."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        k2_tiles = 0
        if DUAL:
            k2_tiles = tl.cdiv(K2, BLOCK_K)
        full, split = _split_plan(num_m * num_n, k_tiles + k2_tiles, num_sms, max_split, _SPLIT_OVERHEAD)
        tail = num_m * num_n - full
        for u in tl.range(tl.program_id(0), full + tail * split, tl.num_programs(0)):
            pid_m, pid_n, lo, hi, lo2, hi2, slot = _unit(u, full, tail, split, num_m, num_n, k_tiles, k2_tiles, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = ptr_k_loop(
                acc,
                a_ptr,
                b_ptr,
                pid_m,
                pid_n,
                M,
                N,
                K,
                lo,
                hi,
                stride_am,
                stride_ak,
                stride_bk,
                stride_bn,
                CAST_F32,
                PRECISION,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            if DUAL:
                acc = ptr_k_loop(
                    acc,
                    a2_ptr,
                    b2_ptr,
                    pid_m,
                    pid_n,
                    M,
                    N,
                    K2,
                    lo2,
                    hi2,
                    stride_a2m,
                    stride_a2k,
                    stride_b2k,
                    stride_b2n,
                    CAST_F32,
                    PRECISION,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                )
            _epilogue(acc, c_ptr, ws_ptr, slot, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)

    @triton.jit
    def tma_k_loop(
        acc,
        a_desc,
        b_desc,
        off_m,
        off_n,
        lo,
        hi,
        A_T: tl.constexpr,
        B_T: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """acc + the A and B tiles of K tiles lo..hi) loaded by TMA (zero-filled past the edges);
        a transposed operand's tile comes from its row-major storage and is transposed in shared memory."""
        for kt in range(lo, hi):
            off_k = kt * BLOCK_K
            if A_T:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_T:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = dot(a, b, acc, CAST_F32, PRECISION)
        return acc

    @triton.jit
    def tma_k_loop_shared_a(
        acc,
        acc2,
        a_desc,
        b_desc,
        b2_desc,
        off_m,
        off_n,
        lo,
        hi,
        A_T: tl.constexpr,
        B_T: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """(acc + A @ B, acc2 + A @ B2) over K tiles lo..hi), each A tile loaded once by TMA for
        both products (`tma_k_loop`'s layouts; B2's descriptor laid out as B's)."""
        for kt in range(lo, hi):
            off_k = kt * BLOCK_K
            if A_T:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_T:
                b = b_desc.load([off_n, off_k]).T
                b2 = b2_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
                b2 = b2_desc.load([off_k, off_n])
            acc = dot(a, b, acc, CAST_F32, PRECISION)
            acc2 = dot(a, b2, acc2, CAST_F32, PRECISION)
        return acc, acc2

    @triton.autotune(
        configs=persistent_autotune_configs(pre_hook=_set_tma_blocks),
        key=["M", "N", "K", "K2", "DUAL", "A_T", "B_T", "PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("a_desc", a_tiles=1, b_tiles=1, dual="DUAL")},
        post_hook=lambda nargs, exception: _bench_reduce(nargs, exception),
    )
    @triton.jit(do_not_specialize=["num_sms", "max_split"])
    def _matmul_tma_kernel(
        a_desc,
        b_desc,
        a2_desc,
        b2_desc,
        c_ptr,
        ws_ptr,
        M,
        N,
        K,
        K2,
        stride_cm,
        stride_cn,
        num_sms,
        max_split,
        DUAL: tl.constexpr,
        A_T: tl.constexpr,
        B_T: tl.constexpr,
        CAST_F32: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """`_matmul_persistent_kernel` with TMA loads of 16-bit tiles through host-side tensor
        descriptors (blocks set per config by `_set_tma_blocks`); A_T / B_T: the descriptor is on
        the operand's transpose (row-major storage of a column-major operand)."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        k2_tiles = 0
        if DUAL:
            k2_tiles = tl.cdiv(K2, BLOCK_K)
        full, split = _split_plan(num_m * num_n, k_tiles + k2_tiles, num_sms, max_split, _SPLIT_OVERHEAD)
        tail = num_m * num_n - full
        for u in tl.range(tl.program_id(0), full + tail * split, tl.num_programs(0)):
            pid_m, pid_n, lo, hi, lo2, hi2, slot = _unit(u, full, tail, split, num_m, num_n, k_tiles, k2_tiles, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tma_k_loop(acc, a_desc, b_desc, off_m, off_n, lo, hi, A_T, B_T, CAST_F32, PRECISION, BLOCK_K)
            if DUAL:
                acc = tma_k_loop(acc, a2_desc, b2_desc, off_m, off_n, lo2, hi2, A_T, B_T, CAST_F32, PRECISION, BLOCK_K)
            _epilogue(acc, c_ptr, ws_ptr, slot, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)

    @triton.autotune(configs=[triton.Config({"SUB_M": 32, "SUB_N": 128}, num_warps=4)], key=[])
    @triton.jit
    def _splitk_reduce_kernel(
        ws_ptr,
        c_ptr,
        M,
        N,
        stride_cm,
        stride_cn,
        full,
        tail,
        split,
        block_m,
        block_n,
        group_m,
        SUB_M: tl.constexpr,
        SUB_N: tl.constexpr,
    ):
        """C[tile full + r] = sum over pieces s = 0..split-1, in that order, of workspace slot
        s*tail + r ([block_m, block_n] fp32 each): the deterministic split-K reduction. Program
        (r, i, j) sums the [SUB_M, SUB_N] chunk (i, j) of tail tile r."""
        r = tl.program_id(0)
        pid_m, pid_n = tile_coords(full + r, tl.cdiv(M, block_m), tl.cdiv(N, block_n), group_m)
        rows = tl.program_id(1) * SUB_M + tl.arange(0, SUB_M)
        cols = tl.program_id(2) * SUB_N + tl.arange(0, SUB_N)
        in_tile = (rows[:, None] < block_m) & (cols[None, :] < block_n)
        offs = rows[:, None] * block_n + cols[None, :]
        acc = tl.zeros((SUB_M, SUB_N), dtype=tl.float32)
        for s in range(split):
            slot = (s * tail + r).to(tl.int64)
            acc += tl.load(ws_ptr + slot * block_m * block_n + offs, mask=in_tile, other=0.0)
        out_m = pid_m * block_m + rows
        out_n = pid_n * block_n + cols
        mask = in_tile & (out_m[:, None] < M) & (out_n[None, :] < N)
        ptrs = c_ptr + out_m[:, None].to(tl.int64) * stride_cm + out_n[None, :] * stride_cn
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def grid_2d(M: int, N: int):
    """The launch grid of a tiled [M, N] output: one program per tile."""
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(CAST_F32, PRECISION): fp32 tiles under the interpreter (bf16 tl.dot is wrong there);
    the dot precision from `kernels.tf32` (tf32 or ieee for fp32, ignored for 16-bit)."""
    return interpreting(), dot_precision(dtype)


def _check(a, b, out, a2, b2) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: a {tuple(a.shape)} and b {tuple(b.shape)} are not [M, K] and [K, N]")
    if out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"matmul: out {tuple(out.shape)} must be [{a.shape[0]}, {b.shape[1]}]")
    if (a2 is None) != (b2 is None):
        raise ValueError("matmul: a2 and b2 come together")
    if a2 is not None and (a2.shape[0] != a.shape[0] or b2.shape[1] != b.shape[1] or a2.shape[1] != b2.shape[0]):
        raise ValueError(f"matmul: a2 {tuple(a2.shape)} @ b2 {tuple(b2.shape)} does not add to {tuple(out.shape)}")


def _triton_mm(a, b, out, a2, b2) -> None:
    """One program per tile (`_matmul_kernel`); a dual call has K2 == K (`gemm_plan`)."""
    M, K = a.shape
    N = b.shape[1]
    dual = a2 is not None
    a2 = a if a2 is None else a2
    b2 = b if b2 is None else b2
    cast, prec = dot_flags(a.dtype)
    _matmul_kernel[grid_2d(M, N)](
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


# --------------------------------------------------------------------------- persistent launches

_SMS: dict = {}  # device -> (SM count, compute capability major), read once per device
_DUMMY_WS: dict = {}  # device -> a 1-element fp32 tensor: the workspace argument when nothing is split
_LAUNCHES: dict = {}  # launch key -> _Launch: the tuned config, its split plan and launch arguments


class _Launch(NamedTuple):
    kwargs: dict  # the kernel's constexpr flags and the config (block sizes, num_warps, num_stages)
    grid: int
    full: int  # split-K plan (`split_plan`): whole tiles, pieces per tail tile, tail tiles
    split: int
    tail: int
    blocks: tuple  # TMA descriptor blocks of a and b (the TMA kernel)


class GemmPlan(NamedTuple):
    """What `matmul(backend="triton")` runs: the kernel's name, the TMA layouts ("n": row-major,
    "t": transposed, per operand a and b; None off the TMA kernel), SMs and the split-K cap."""

    kernel: str
    layouts: tuple | None
    num_sms: int
    max_split: int


def device_info(device: torch.device) -> tuple[int, int]:
    """(SMs, compute capability major) of a CUDA device, read once per device (a property
    look-up per launch costs host time); the interpreter's stand-in on CPU."""
    info = _SMS.get(device)
    if info is None:
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            info = (props.multi_processor_count, props.major)
        else:
            info = (INTERPRETER_SMS, 0)
        _SMS[device] = info
    return info


def tma_layout(t: torch.Tensor) -> str | None:
    """The TMA layout of operand `t`: "n" when it is row-major ([rows, cols] with unit column
    stride), "t" when it is the transpose of a row-major tensor, None when TMA cannot load it
    (other strides, a base or row stride not 16-byte aligned; the caller checks the dtype)."""
    s0, s1 = t.stride()
    if t.data_ptr() % 16:
        return None
    if s1 == 1 and s0 % 8 == 0 and s0 >= t.shape[1]:
        return "n"
    if s0 == 1 and s1 % 8 == 0 and s1 >= t.shape[0]:
        return "t"
    return None


def gemm_plan(a, b, out, a2=None, b2=None, persistent=None, tma=None, split_k=None, num_sms=None) -> GemmPlan:
    """The Triton kernel `matmul` runs for these operands (see the module docstring):
    persistent (default: on CUDA; the one-program-per-tile kernel under the interpreter, except
    for a dual call with K2 != K), TMA (default: on sm_90+; `tma=True` also off Hopper, e.g.
    under the interpreter) when the operands are 16-bit and TMA-loadable, split-K unless
    `split_k=False`."""
    sms, major = device_info(a.device)
    if persistent is None:
        persistent = a.device.type == "cuda"
    if not persistent and (a2 is None or a2.shape[1] == a.shape[1]):
        return GemmPlan("_matmul_kernel", None, 0, 1)
    sms = num_sms or sms
    max_split = 1 if split_k is False else MAX_SPLIT
    if tma is None:
        tma = major >= 9
    if tma and TensorDescriptor is not None and a.dtype in TMA_DTYPES and a.shape[1] and (a2 is None or a2.shape[1]):
        la, lb = tma_layout(a), tma_layout(b)
        if la and lb and (a2 is None or (tma_layout(a2) == la and tma_layout(b2) == lb)):
            return GemmPlan("_matmul_tma_kernel", (la, lb), sms, max_split)
    return GemmPlan("_matmul_persistent_kernel", None, sms, max_split)


def _fast_descriptors() -> bool:
    """Whether `TensorDescriptor`s can be made without their __post_init__ checks (~1 us each
    on the host, and `tma_layout` has made them): its fields start with base, shape, strides,
    block_shape and the others have defaults (Triton 3.6 and 3.9)."""
    import dataclasses

    try:
        fields = dataclasses.fields(TensorDescriptor)
    except TypeError:  # pragma: no cover - not a dataclass
        return False
    names = [f.name for f in fields]
    rest_default = all(f.default is not dataclasses.MISSING for f in fields[4:])
    return names[:4] == ["base", "shape", "strides", "block_shape"] and rest_default


_FAST_DESCRIPTORS = TensorDescriptor is not None and _fast_descriptors()


def tensor_descriptor(t: torch.Tensor, shape: list, strides: list, block: list):
    """A host-side TMA descriptor on t's storage, made without TensorDescriptor's checks where
    that is safe (`_fast_descriptors`; the callers' layout checks stand in for them)."""
    if not _FAST_DESCRIPTORS:
        return TensorDescriptor(t, shape, strides, list(block))
    desc = object.__new__(TensorDescriptor)  # the defaults of the other fields are class attributes
    desc.base, desc.shape, desc.strides, desc.block_shape = t, shape, strides, list(block)
    return desc


def descriptor(t: torch.Tensor, layout: str, block: list):
    """A TMA descriptor of operand `t` on its row-major storage (`t.T` for layout "t")."""
    if layout == "t":
        return tensor_descriptor(t, [t.shape[1], t.shape[0]], [t.stride(1), 1], block)
    return tensor_descriptor(t, [t.shape[0], t.shape[1]], [t.stride(0), 1], block)


def _plan_of(M, N, K, K2, cfg, num_sms, max_split) -> tuple[int, int, int, int]:
    """(full, split, tail, grid) of a persistent launch under config kwargs `cfg`."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = -(-M // bm) * -(-N // bn)
    k_tiles = -(-K // bk) + -(-K2 // bk)
    full, split = split_plan(tiles, k_tiles, num_sms, max_split)
    tail = tiles - full
    return full, split, tail, min(num_sms, full + tail * split)


def _workspace(device, elems: int) -> torch.Tensor:
    """The split-K workspace (fp32), or a 1-element stand-in when nothing is split."""
    if elems > 1:
        return torch.empty(elems, device=device, dtype=torch.float32)
    ws = _DUMMY_WS.get(device)
    if ws is None:
        ws = _DUMMY_WS[device] = torch.zeros(1, device=device, dtype=torch.float32)
    return ws


def _bench_reduce(nargs: dict, exception) -> None:
    """Autotuner post-hook of the persistent kernels: run the split-K reduction after each
    benchmarked launch, so that the timings include it."""
    if exception is not None:
        return
    K2 = nargs["K2"] if nargs["DUAL"] else 0
    full, split, tail, _ = _plan_of(nargs["M"], nargs["N"], nargs["K"], K2, nargs, nargs["num_sms"], nargs["max_split"])
    if split > 1:
        _reduce(nargs["ws_ptr"], nargs["c_ptr"], nargs, full, tail, split, tuned=True)


def _reduce(ws, out, cfg, full, tail, split, tuned) -> None:
    """Launch `_splitk_reduce_kernel` over the tail tiles (through its one-config autotuner
    when `tuned`, as the ahead-of-time capture records launches; directly otherwise)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    sub = _splitk_reduce_kernel.configs[0]
    grid = (tail, triton.cdiv(bm, sub.kwargs["SUB_M"]), triton.cdiv(bn, sub.kwargs["SUB_N"]))
    args = (
        ws,
        out,
        out.shape[0],
        out.shape[1],
        out.stride(0),
        out.stride(1),
        full,
        tail,
        split,
        bm,
        bn,
        cfg["GROUP_M"],
    )
    if tuned:
        _splitk_reduce_kernel[grid](*args)
    else:
        _splitk_reduce_kernel.fn[grid](*args, **sub.all_kwargs())


def _persistent_mm(a, b, out, a2, b2, plan: GemmPlan, cast: bool, prec: str) -> None:
    """Launch the persistent kernel of `plan` (and the split-K reduction when it splits): the
    first call of a key through the autotuner, later ones straight to the jitted kernel."""
    M, K = a.shape
    N = b.shape[1]
    dual = a2 is not None
    K2 = a2.shape[1] if dual else 0
    layouts = plan.layouts
    key = (layouts, M, N, K, K2, a.dtype, out.dtype, dual, prec, cast, plan.num_sms, plan.max_split, a.device)
    launch = _LAUNCHES.get(key)
    if launch is None:
        _first_launch(a, b, out, a2, b2, plan, cast, prec, key)
        return
    if layouts is not None:
        (la, lb), (block_a, block_b) = layouts, launch.blocks
        operands = (
            descriptor(a, la, block_a),
            descriptor(b, lb, block_b),
            descriptor(a2, la, block_a) if dual else None,
            descriptor(b2, lb, block_b) if dual else None,
        )
        kernel = _matmul_tma_kernel
    else:
        operands = (a, b, a2, b2, *a.stride(), *b.stride(), *(a2.stride() if dual else (0, 0)))
        operands += b2.stride() if dual else (0, 0)
        kernel = _matmul_persistent_kernel
    ws_elems = launch.tail * launch.split * launch.kwargs["BLOCK_M"] * launch.kwargs["BLOCK_N"]
    ws = _workspace(a.device, ws_elems if launch.split > 1 else 0)
    kernel.fn[(launch.grid,)](
        *operands[:4], out, ws, M, N, K, K2, *operands[4:], *out.stride(), plan.num_sms, plan.max_split, **launch.kwargs
    )
    if launch.split > 1:
        _reduce(ws, out, launch.kwargs, launch.full, launch.tail, launch.split, tuned=False)


def _first_launch(a, b, out, a2, b2, plan: GemmPlan, cast: bool, prec: str, key: tuple) -> None:
    """Through the autotuner (it picks the config, with descriptor blocks set by the config
    pre-hook and the split-K reduction timed by its post-hook); caches the `_Launch`."""
    M, K = a.shape
    N = b.shape[1]
    dual = a2 is not None
    K2 = a2.shape[1] if dual else 0
    flags = dict(DUAL=dual, CAST_F32=cast, PRECISION=prec)
    if plan.layouts is not None:
        kernel = _matmul_tma_kernel
        la, lb = plan.layouts
        flags.update(A_T=la == "t", B_T=lb == "t")
        blocks = tma_block_shapes({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, **flags})  # set per config
        operands = (
            descriptor(a, la, blocks["a_desc"]),
            descriptor(b, lb, blocks["b_desc"]),
            descriptor(a2, la, blocks["a2_desc"]) if dual else None,
            descriptor(b2, lb, blocks["b2_desc"]) if dual else None,
        )
    else:
        kernel = _matmul_persistent_kernel
        operands = (a, b, a2, b2, *a.stride(), *b.stride(), *(a2.stride() if dual else (0, 0)))
        operands += b2.stride() if dual else (0, 0)
    most = 0
    for c in kernel.configs:
        full, split, tail, _ = _plan_of(M, N, K, K2, c.kwargs, plan.num_sms, plan.max_split)
        if split > 1:
            most = max(most, tail * split * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])
    ws = _workspace(a.device, most)

    def grid(meta):
        return (_plan_of(M, N, K, K2, meta, plan.num_sms, plan.max_split)[3],)

    kernel[grid](
        *operands[:4], out, ws, M, N, K, K2, *operands[4:], *out.stride(), plan.num_sms, plan.max_split, **flags
    )
    cfg = kernel.best_config
    full, split, tail, size = _plan_of(M, N, K, K2, cfg.kwargs, plan.num_sms, plan.max_split)
    blocks = tma_block_shapes({**cfg.kwargs, **flags}) if plan.layouts is not None else {}
    _LAUNCHES[key] = _Launch(
        {**flags, **cfg.all_kwargs()}, size, full, split, tail, (blocks.get("a_desc"), blocks.get("b_desc"))
    )
    if split > 1:
        _reduce(ws, out, cfg.kwargs, full, tail, split, tuned=True)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    a2: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    backend: str = "triton",
    *,
    persistent: bool | None = None,
    tma: bool | None = None,
    split_k: bool | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """out[M, N] = a[M, K] @ b[K, N] (+ a2[M, K2] @ b2[K2, N]), fp32 accumulation, written in
    out's dtype (default: a's). Strided views allowed (a transpose is a stride swap); a, b, a2,
    b2 share one dtype. backend "triton" (one launch for both products, plus the split-K
    reduction when it splits) or "torch" (`torch.mm`, then `addmm_` for the second). Not
    differentiable. No communication.

    Which Triton kernel (`gemm_plan`): on CUDA the persistent kernel, through TMA descriptors on
    sm_90+ when a, b (a2, b2) are 16-bit and TMA-loadable (unit stride, 16-byte aligned base
    and row stride; a2/b2 laid out as a/b), with pointer loads otherwise; under the interpreter
    the one-program-per-tile kernel. Test switches: `persistent` (True/False), `tma` (True: the
    descriptor kernel wherever the operands allow it, also off Hopper), `split_k=False`,
    `num_sms` (the SM count the schedule assumes)."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"matmul backend={backend!r} must be one of {GEMM_BACKENDS}")
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=a.dtype)
    _check(a, b, out, a2, b2)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0 and (a2 is None or a2.shape[1] == 0):
        return out.zero_()
    if backend == "torch":
        mm_into(a, b, out, accumulate=False)
        if a2 is not None:
            mm_into(a2, b2, out, accumulate=True)
        return out
    if triton is None:
        raise RuntimeError("matmul backend='triton' needs the triton package")
    if a.device.type != "cuda" and not interpreting():
        raise RuntimeError("matmul backend='triton' on CPU runs only under TRITON_INTERPRET=1 (tests)")
    plan = gemm_plan(a, b, out, a2, b2, persistent, tma, split_k, num_sms)
    if plan.kernel == "_matmul_kernel":
        _triton_mm(a, b, out, a2, b2)
    else:
        _persistent_mm(a, b, out, a2, b2, plan, *dot_flags(a.dtype))
    return out
