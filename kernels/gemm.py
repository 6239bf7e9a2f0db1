"""Plain GEMMs for the fused kernels' unfused products: C = A @ B (+ A2 @ B2), any strides.

`matmul(a, b, out=None, a2=None, b2=None, backend=...)` is what the fused linear+activation
backward (kernels/linear_act.py: dX = G W, dW = G^T X) and the benchmarks call:
* backend "torch": cuBLAS / the CPU BLAS through `torch.mm` (`addmm_` for the second
  product). A 16-bit product written into an fp32 `out` is accumulated in fp32 without a
  16-bit rounding where torch can (`mm(..., out_dtype=float32)` on CUDA); elsewhere it is
  computed in the operands' dtype and then cast.
* backend "triton": `_matmul_kernel`, one program per [BLOCK_M, BLOCK_N] tile in grouped
  order (consecutive programs share rows of A in L2), a pipelined K loop with masked pointer
  loads, fp32 accumulation, C written once in its own dtype (fp32 dW straight from the
  accumulator). On CPU only under TRITON_INTERPRET=1.

Which engine runs a plain GEMM under kernels.backend=auto is `kernels.backend.auto_runs_torch
("gemm", ...)`'s call, from GPU measurements (bench/kernels.py). No communication.

The tile configs (`gpu_configs`) and the jitted helpers `tile_ids` and `dot` are shared with
the fused GEMM kernels of kernels/linear_act.py.
"""

from __future__ import annotations

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

__all__ = ["matmul", "gpu_configs"]

GEMM_BACKENDS = ("torch", "triton")


def configs_of(bm_bn_bk_warps_stages) -> list:
    """`triton.Config`s of (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tuples, GROUP_M 8."""
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
    return configs_of(tensor_core + cuda_core)


def autotune_configs(dual: bool = False) -> list:
    """One small config under the interpreter (more need a driver to benchmark), else `gpu_configs`."""
    if interpreting():
        return configs_of([(32, 32, 16, 4, 1)])
    return gpu_configs(dual)


if triton is not None:

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
    def dot(a, b, acc, CAST_F32: tl.constexpr, PRECISION: tl.constexpr):
        """acc + a @ b (fp32 tiles under the interpreter, whose 16-bit dots are wrong)."""
        if CAST_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision=PRECISION)

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
        """C = A @ B (+ A2 @ B2 when DUAL), any strides (transposes are stride swaps), fp32
        accumulation, C in its own dtype."""
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


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    a2: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    backend: str = "triton",
) -> torch.Tensor:
    """out[M, N] = a[M, K] @ b[K, N] (+ a2[M, K2] @ b2[K2, N]), fp32 accumulation, written in
    out's dtype (default: a's). Strided views allowed (a transpose is a stride swap); a, b, a2,
    b2 share one dtype. backend "triton" (`_matmul_kernel`, one launch for both products) or
    "torch" (`torch.mm`, then `addmm_` for the second). Not differentiable. No communication."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"matmul backend={backend!r} must be one of {GEMM_BACKENDS}")
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=a.dtype)
    _check(a, b, out, a2, b2)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0 and a2 is None:
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
    _triton_mm(a, b, out, a2, b2)
    return out
