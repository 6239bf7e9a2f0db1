"""Grouped GEMM over variable-size row groups: one launch for all groups.

    y[rows of group g] = x[rows of group g] @ weight[g]

x [N, in] has its rows sorted by group (group g owns the `group_sizes[g]` consecutive rows
after the rows of groups < g); weight [G, in, out]; group_sizes [G] integer, on the same
device as x. The group offsets never leave the device: no host sync per group, no Python
loop over groups.

Forward (and dx) kernel: a grid over (tile, N tile). Each group g is cut into
ceil(group_sizes[g] / BLOCK_M) row tiles; tiles are numbered consecutively over the groups.
Every program loads all G group sizes at once (a G_BLOCK-wide vector), takes their
per-group tile counts and cumulative sums with `tl.cumsum`, and finds its group as the number
of groups whose cumulative tile end is <= its tile index. The grid is launched with an upper
bound of tiles, ceil(N / BLOCK_M) + G (sum_g ceil(n_g / BLOCK_M) <= N / BLOCK_M + G); programs
past the real count exit at once. Empty groups produce no tiles. Because the tile map is built
inside the kernel, BLOCK_M can be autotuned like the other block sizes.

Backward: dx = the same kernel on dy with weight[g]^T (a transposed view through strides, no
copy); dW[g] = x[rows of g]^T @ dy[rows of g] with a kernel gridded over (group, K tile,
N tile) that loops over the group's rows (empty groups write zeros).

All kernels accumulate in fp32 and accept fp32 / bf16 / fp16 inputs. Under autocast x and
the weight are cast to the autocast dtype first (16-bit weight copies made once per step,
kernels/operands.py), so y and dx come out 16-bit while dW is written in the main weight's
dtype from the fp32 accumulator. Under TRITON_INTERPRET=1 (CPU tests) tiles are cast to fp32
before `tl.dot` (the interpreter's bf16 dot is wrong) and a single autotune config is used
(several need a driver); on a GPU the configs are pruned per device (kernels/configs.py)
before autotuning. For fp32 inputs `tl.dot` uses TF32 exactly when `kernels.tf32` allows it
(kernels/tf32.py; by default when torch's own fp32 matmuls would); the dot precision is
part of the autotune key.

Precondition (not checked on device, it would need a host sync): sum(group_sizes) == N.
The reference raises when it does not hold; the Triton path leaves rows past the last group
uninitialized in y and dx.
"""

from __future__ import annotations

import torch

from meshtron.kernels.backend import interpreting
from meshtron.kernels.configs import gemm_prune
from meshtron.kernels.operands import compute_dtype, weight_copy
from meshtron.kernels.tf32 import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works without triton
    triton = None
    tl = None


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 3 or group_sizes.dim() != 1:
        raise ValueError(
            f"grouped_gemm wants x [N, in], weight [G, in, out], group_sizes [G]; got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(group_sizes.shape)}"
        )
    if x.shape[1] != weight.shape[1] or group_sizes.shape[0] != weight.shape[0]:
        raise ValueError(
            f"grouped_gemm shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"group_sizes {tuple(group_sizes.shape)}"
        )
    if group_sizes.dtype.is_floating_point or group_sizes.dtype == torch.bool:
        raise ValueError(f"group_sizes must be integer, got {group_sizes.dtype}")


def grouped_gemm_reference(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Plain-torch grouped GEMM: y[rows of g] = x[rows of g] @ weight[g], one matmul per group.

    Computes in fp32 and returns x's dtype; differentiable through autograd. Loops over the
    groups on the host (reads group_sizes back): a reference, not a fast path.
    """
    _check_shapes(x, weight, group_sizes)
    sizes = [int(n) for n in group_sizes.tolist()]
    if any(n < 0 for n in sizes) or sum(sizes) != x.shape[0]:
        raise ValueError(f"group_sizes {sizes} must be >= 0 and sum to the {x.shape[0]} rows of x")
    outs, start = [], 0
    for g, n in enumerate(sizes):
        # Empty groups still contribute a [0, out] piece so the graph reaches every input.
        outs.append((x[start : start + n].float() @ weight[g].float()).to(x.dtype))
        start += n
    if not outs:  # G == 0 (then N == 0)
        return x.new_zeros(0, weight.shape[2])
    return torch.cat(outs)


if triton is not None:

    def gpu_gemm_configs() -> list:
        """Ampere/Hopper candidates of the forward/dx kernel, before per-device pruning."""
        return [
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
            # IEEE fp32 (CUDA cores): thin K tiles
            triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 16}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16}, num_warps=4, num_stages=3),
        ]

    def gpu_dw_configs() -> list:
        """Ampere/Hopper candidates of the dW kernel, before per-device pruning."""
        return [
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
            triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
            # IEEE fp32 (CUDA cores): a thin reduction (BLOCK_M rows per step)
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
        ]

    def _interpreter_configs() -> list:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4, num_stages=1)]

    def _gemm_configs():
        return _interpreter_configs() if interpreting() else gpu_gemm_configs()

    def _dw_configs():
        return _interpreter_configs() if interpreting() else gpu_dw_configs()

    # y = x @ w: A tiles [BLOCK_M, BLOCK_K] of x, B tiles [BLOCK_K, BLOCK_N] of w.
    @triton.autotune(
        configs=_gemm_configs(),
        key=["K", "N_OUT", "G_BLOCK", "INPUT_PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1)},
    )
    @triton.jit
    def _grouped_gemm_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        sizes_ptr,
        G,
        K,
        N_OUT,
        stride_xm,
        stride_xk,
        stride_wg,
        stride_wk,
        stride_wn,
        stride_ym,
        stride_yn,
        G_BLOCK: tl.constexpr,
        CAST_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """y[rows of g, n tile] = x[rows of g] @ w[g][:, n tile] for the row tile of this program.

        Program (t, n): t is a global row-tile index over all groups (tiles numbered group by
        group, ceil(size_g / BLOCK_M) per group), n an output-column tile. Programs with
        t >= total tiles return at once.
        """
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)

        # Map the tile index to (group, row block) from the group sizes, all on device.
        gidx = tl.arange(0, G_BLOCK)
        sizes = tl.load(sizes_ptr + gidx, mask=gidx < G, other=0)
        tiles = (sizes + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, axis=0)  # inclusive
        row_end = tl.cumsum(sizes, axis=0)
        g = tl.sum((tile_end <= tile).to(tl.int32), axis=0)
        if g >= G:
            return
        sel = gidx == g
        g_tile_start = tl.sum(tl.where(sel, tile_end - tiles, 0), axis=0)
        g_row_start = tl.sum(tl.where(sel, row_end - sizes, 0), axis=0)
        g_size = tl.sum(tl.where(sel, sizes, 0), axis=0)

        local_m = (tile - g_tile_start) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = local_m < g_size
        rows = (g_row_start + local_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N_OUT
        ks = tl.arange(0, BLOCK_K)

        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w_ptr + g.to(tl.int64) * stride_wg + ks[:, None] * stride_wk + cols[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if CAST_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk

        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

    # dW = x^T @ dy: output tiles [BLOCK_K, BLOCK_N], reduction over BLOCK_M rows.
    @triton.autotune(
        configs=_dw_configs(),
        key=["K", "N_OUT", "G_BLOCK", "INPUT_PRECISION"],
        prune_configs_by={
            "early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1, dims=("BLOCK_K", "BLOCK_N", "BLOCK_M"))
        },
    )
    @triton.jit
    def _grouped_gemm_dw_kernel(
        x_ptr,
        dy_ptr,
        dw_ptr,
        sizes_ptr,
        G,
        K,
        N_OUT,
        stride_xm,
        stride_xk,
        stride_dym,
        stride_dyn,
        stride_dwg,
        stride_dwk,
        stride_dwn,
        G_BLOCK: tl.constexpr,
        CAST_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """dW[g][k tile, n tile] = x[rows of g][:, k tile]^T @ dy[rows of g][:, n tile].

        Program (g, k, n) loops over the rows of group g in BLOCK_M steps; an empty group
        runs no iteration and writes zeros.
        """
        g = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_n = tl.program_id(2)

        gidx = tl.arange(0, G_BLOCK)
        sizes = tl.load(sizes_ptr + gidx, mask=gidx < G, other=0)
        row_end = tl.cumsum(sizes, axis=0)
        sel = gidx == g
        g_row_start = tl.sum(tl.where(sel, row_end - sizes, 0), axis=0)
        g_size = tl.sum(tl.where(sel, sizes, 0), axis=0)

        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N_OUT
        ms = tl.arange(0, BLOCK_M)

        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for m0 in range(0, g_size, BLOCK_M):
            local_m = m0 + ms
            row_mask = local_m < g_size
            rows = (g_row_start + local_m).to(tl.int64)
            # x^T tile [BLOCK_K, BLOCK_M] loaded directly through strides.
            a = tl.load(
                x_ptr + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
                mask=k_mask[:, None] & row_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn,
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if CAST_FP32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

        dw_ptrs = dw_ptr + g.to(tl.int64) * stride_dwg + ks[:, None] * stride_dwk + cols[None, :] * stride_dwn
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def _require_triton(t: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("grouped_gemm backend='triton' needs the triton package (pip install triton)")
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError("grouped_gemm backend='triton' on CPU runs only under TRITON_INTERPRET=1 (tests)")


def _kernel_flags(dtype: torch.dtype) -> dict:
    # input_precision only changes fp32 dots; 16-bit inputs always use the tensor cores.
    return {"CAST_FP32": interpreting(), "INPUT_PRECISION": dot_precision(dtype)}


def _g_block(groups: int) -> int:
    return max(triton.next_power_of_2(groups), 2)


def _launch_gemm(x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y[rows of g] = x[rows of g] @ w[g] for w viewed [G, K, N_OUT] (any strides)."""
    rows, k = x.shape
    groups, _, n_out = w.shape
    y = torch.empty(rows, n_out, device=x.device, dtype=out_dtype)
    if rows == 0 or n_out == 0 or groups == 0:
        return y

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]) + groups, triton.cdiv(n_out, meta["BLOCK_N"]))

    _grouped_gemm_kernel[grid](
        x,
        w,
        y,
        sizes,
        groups,
        k,
        n_out,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        y.stride(0),
        y.stride(1),
        G_BLOCK=_g_block(groups),
        **_kernel_flags(x.dtype),
    )
    return y


def _launch_dw(
    x: torch.Tensor, dy: torch.Tensor, sizes: torch.Tensor, groups: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """dW[g] = x[rows of g]^T @ dy[rows of g], [G, K, N_OUT]; zeros for empty groups."""
    k, n_out = x.shape[1], dy.shape[1]
    dw = torch.empty(groups, k, n_out, device=x.device, dtype=out_dtype)
    if groups == 0 or k == 0 or n_out == 0:
        return dw

    def grid(meta):
        return (groups, triton.cdiv(k, meta["BLOCK_K"]), triton.cdiv(n_out, meta["BLOCK_N"]))

    _grouped_gemm_dw_kernel[grid](
        x,
        dy,
        dw,
        sizes,
        groups,
        k,
        n_out,
        x.stride(0),
        x.stride(1),
        dy.stride(0),
        dy.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
        G_BLOCK=_g_block(groups),
        **_kernel_flags(x.dtype),
    )
    return dw


class GroupedGemmFunction(torch.autograd.Function):
    """Autograd Function of the Triton grouped GEMM.

    forward(x [N, in], weight [G, in, out], group_sizes [G], w_c) -> y [N, out] with
    y[rows of g] = x[rows of g] @ w_c[g], where w_c is the copy of `weight` in x's dtype (the
    compute dtype; `weight` itself when it already has it);
    backward: dx[rows of g] = dy[rows of g] @ w_c[g]^T (forward kernel, weight transposed
    through strides), dW[g] = x[rows of g]^T @ dy[rows of g] in weight's dtype (zeros for
    empty groups); group_sizes and w_c get no gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, group_sizes, w_c):
        _require_triton(x)
        _check_shapes(x, weight, group_sizes)
        if w_c.dtype != x.dtype or w_c.shape != weight.shape:
            raise ValueError(f"grouped_gemm wants the weight copy in x's dtype {x.dtype}, got {w_c.dtype}")
        sizes = group_sizes.to(device=x.device, dtype=torch.int32)
        ctx.save_for_backward(x, w_c, sizes)
        ctx.w_dtype = weight.dtype
        return _launch_gemm(x, w_c, sizes, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w_c, sizes = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _launch_gemm(dy, w_c.transpose(1, 2), sizes, x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _launch_dw(x, dy, sizes, w_c.shape[0], ctx.w_dtype)
        return dx, dw, None, None


def grouped_gemm(
    x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, backend: str = "torch"
) -> torch.Tensor:
    """y[rows of group g] = x[rows of group g] @ weight[g] for consecutive row groups.

    x [N, in] sorted by group; weight [G, in, out]; group_sizes [G] on x's device, summing to N.
    backend "torch": `grouped_gemm_reference` (the fast torch path lives in
    moe/experts.py `grouped_matmul`); "triton": `GroupedGemmFunction` (one launch for all
    groups forward, two in backward; CUDA, or CPU under TRITON_INTERPRET=1).
    Differentiable in x and weight; fp32 accumulation for fp32 / bf16 / fp16 inputs. The
    Triton path computes in autocast's dtype under autocast (x and weight cast to it, the
    weight copy cached per step: kernels/operands.py), else in x.dtype; y has the compute
    dtype and dW weight's dtype.
    """
    if backend == "torch":
        return grouped_gemm_reference(x, weight, group_sizes)
    if backend == "triton":
        dtype = compute_dtype(x)
        return GroupedGemmFunction.apply(x.to(dtype), weight, group_sizes, weight_copy(weight, dtype))
    raise ValueError(f"grouped_gemm backend={backend!r} must be 'torch' or 'triton'")
