"""Grouped GEMM over variable-size row groups: one launch for all groups.

    y[rows of group g] = x[rows of group g] @ weight[g]

x [N, in] has its rows sorted by group (group g owns the `group_sizes[g]` consecutive rows
after the rows of groups < g); weight [G, in, out]; group_sizes [G] integer, on the same
device as x. The group offsets never leave the device: no host sync per group, no Python
loop over groups. Every kernel loads all G group sizes at once (a G_BLOCK-wide vector) and
takes their per-group tile counts and cumulative sums with `tl.cumsum`; a program finds the
group of a tile index as the number of groups whose cumulative tile end is <= that index.
Empty groups produce no forward work; the grids are sized from N, G and the out/in widths,
which the host knows, never from the group sizes.

Who calls it: moe/experts.py `grouped_matmul`. Under kernels.backend=auto a CUDA step in bf16
with 16-byte aligned rows multiplies with torch's `F.grouped_mm` (CUTLASS), fp32 / fp16 steps
with these kernels; kernels.backend=triton runs these kernels for every dtype.

What runs here (`grouped_plan`):
* CUDA default:
  - forward / dx, `_grouped_gemm_persistent_kernel`: persistent, a grid of min(#SMs, work
    bound) programs, program p taking work units p, p + grid, ... until the unit count the
    group sizes give (read on device) is reached. A unit is (group, row tile, column tile);
    units run group by group, and inside a group in kernels/gemm.py's grouped tile order
    (`tile_coords`: GROUP_M row tiles down one column of the expert's weight, then the next
    column), so the units in flight at once read the same expert's weight columns and the
    same GROUP_M row tiles of x: B (and A) tiles are served from L2. The work bound is
    (ceil(N / BLOCK_M) + min(G, N)) * ceil(out / BLOCK_N) units (sum_g ceil(n_g / BLOCK_M) <=
    N / BLOCK_M + #non-empty groups); programs past the real count do no unit. K loop:
    kernels/gemm.py's `ptr_k_loop` on the group's rows (masked, software-pipelined pointer
    loads), any strides.
  - forward / dx on sm_90+ with 16-bit operands, `_grouped_gemm_tma_kernel`: the same
    schedule with x's tiles loaded by TMA through a 2-D descriptor and the weight's through a
    3-D descriptor [G, K, N] (box [1, BLOCK_K, BLOCK_N]; dx's w^T: the box [1, BLOCK_N,
    BLOCK_K] on the [G, N, K] storage, transposed in shared memory). The 3-D box clips at each
    expert's K and N edges, so a partial tile never reads the next expert; x's row tile may
    run past the group into the next group's rows, which only feed output rows the masked
    store drops. Needs x row-major and the weight with a unit stride, 16-byte aligned base and
    strides (`_w_layout`); otherwise the pointer kernel runs.
  - dW, `_grouped_gemm_dw_ordered_kernel`: one program per dW tile on a 1-D grid of
    G x ceil(in / BLOCK_K) x ceil(out / BLOCK_N) programs (known on the host: empty groups
    write zeros), numbered group by group and in grouped tile order inside a group (GROUP_M K
    tiles down an N column: the programs in flight share one group's x and dy columns); each
    loops over its group's rows. Not persistent, on purpose: a unit's length is its group's
    row count, so the hardware's dynamic scheduling balances skewed routing that a static
    round-robin would not, and a persistent loop cost 255 registers and 168-672 B of spills
    on sm_90 tf32 (triton 3.9) where this kernel compiles to 128 registers and none. No
    TMA either: a box of the reduction rows would run into the next group's rows, which are
    summed here, not dropped.
* `persistent=False`, and the default under TRITON_INTERPRET=1, the original one-program-per-
  tile kernels: `_grouped_gemm_kernel`, a grid over (tile, N tile) launched with the same
  row-tile bound (programs past the real count exit at once), and `_grouped_gemm_dw_kernel`,
  gridded over (group, K tile, N tile). The interpreter tests run both families
  (`persistent=True`, `tma=True` and `num_sms=` are `grouped_gemm`'s test switches; the
  interpreter counts 4 "SMs", so small shapes reach the persistent loop).
* FP8, `grouped_gemm_fp8` (moe/fp8_experts.py's Triton path under trainer.precision=fp8),
  `_grouped_gemm_fp8_kernel`: the persistent schedule above on float8_e4m3fn operands (pointer
  loads, any strides; the caller feeds the weight K-major, the layout an fp8 wgmma reads),
  `tl.dot` into an fp32 accumulator, then x's row scales and the expert's column scales
  multiplied into it before the store. Forward and dx only (the recipe's dW is a bf16 GEMM);
  not differentiable itself. Compiles to an e4m3 wgmma on sm_90 (kernels/aot.py FP8_KERNELS).
Launches: the first call of a key (kernel, in/out widths, G_BLOCK, dtypes, dot precision,
which weight stride is the unit one, SMs, TMA layouts) goes through the autotuner; later
calls launch the jitted kernel with the remembered config (kernels/launch.py; the TMA
descriptors built for that config's tiles), the grid computed from that config. N is not in
the key: the routing changes the row count every step.

Backward: dx = the forward kernel on dy with weight[g]^T (a transposed view through strides,
no copy); dW[g] = x[rows of g]^T @ dy[rows of g].

All kernels accumulate in fp32 and accept fp32 / bf16 / fp16 inputs. Under autocast x and
the weight are cast to the autocast dtype first (16-bit weight copies made once per step,
kernels/operands.py), so y and dx come out 16-bit while dW is written in the main weight's
dtype from the fp32 accumulator. Under TRITON_INTERPRET=1 (CPU tests) tiles are cast to fp32
before `tl.dot` (the interpreter's bf16 dot is wrong) and a single 16x16x16 autotune config is
used (several need a driver); on a GPU the configs are pruned per device (kernels/configs.py)
before autotuning. For fp32 inputs `tl.dot` uses TF32 exactly when `kernels.tf32` allows it
(kernels/tf32.py; by default when torch's own fp32 matmuls would); the dot precision is
part of the autotune key.

Precondition (not checked on device, it would need a host sync): sum(group_sizes) == N.
The reference raises when it does not hold; the Triton path leaves rows past the last group
uninitialized in y and dx.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshtron.kernels import gemm
from meshtron.kernels.backend import interpreting
from meshtron.kernels.configs import gemm_prune
from meshtron.kernels.launch import launch
from meshtron.kernels.operands import compute_dtype, weight_copy
from meshtron.kernels.tf32 import dot_precision

try:
    import triton
    import triton.language as tl

    from meshtron.kernels.gemm import dot, ptr_k_loop, tile_coords
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

    # Hopper-sized dW output tiles (BLOCK_K x BLOCK_N, rows of 64 per step) for the ordered dW
    # kernel: 128 accumulators per thread on 8 warps and 144-192 KiB of stages in 16 bits,
    # which the pruning keeps on sm_90 only (kernels/gemm.py HOPPER_TILES for the forward).
    DW_HOPPER_TILES = [(64, 256, 128, 8, 3), (64, 256, 128, 8, 4), (64, 128, 256, 8, 3)]

    def _with_group_m(configs: list, group_m: int = 8, pre_hook=None) -> list:
        return [
            triton.Config(
                {**c.kwargs, "GROUP_M": group_m}, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=pre_hook
            )
            for c in configs
        ]

    def gpu_persistent_configs(pre_hook=None) -> list:
        """GPU candidates of the persistent forward/dx kernels (pointer and TMA), before per-device
        pruning: kernels/gemm.py's persistent GEMM tiles, Hopper-sized ones included, GROUP_M 8."""
        return gemm.persistent_configs(pre_hook)

    def gpu_dw_ordered_configs() -> list:
        """GPU candidates of the ordered dW kernel, before per-device pruning: the dW tiles plus
        `DW_HOPPER_TILES` ((BLOCK_M, BLOCK_N, BLOCK_K): reduction rows, output columns, output
        rows), GROUP_M 8."""
        hopper = [
            triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for m, n, k, w, s in DW_HOPPER_TILES
        ]
        return _with_group_m(gpu_dw_configs() + hopper)

    def _persistent_interpreter_configs(pre_hook=None) -> list:
        # GROUP_M 2: odd test shapes have partial bands of row tiles in a group
        return _with_group_m(_interpreter_configs(), group_m=2, pre_hook=pre_hook)

    def _persistent_configs(pre_hook=None):
        return _persistent_interpreter_configs(pre_hook) if interpreting() else gpu_persistent_configs(pre_hook)

    def _dw_ordered_configs():
        return _persistent_interpreter_configs() if interpreting() else gpu_dw_ordered_configs()

    def tma_block_shapes(constexprs: dict) -> dict:
        """The block shape of each descriptor argument of `_grouped_gemm_tma_kernel` under a
        config's constexprs (BLOCK_*, W_T): x's [BLOCK_M, BLOCK_K]; the weight's 3-D box, on its
        storage ([G, N, K] when W_T). Also read by kernels/aot.py."""
        bm, bn, bk = constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_K"]
        return {"x_desc": [bm, bk], "w_desc": [1, bn, bk] if constexprs["W_T"] else [1, bk, bn]}

    def _set_tma_blocks(nargs: dict) -> None:
        """Config pre-hook of the TMA kernel: the descriptors' block shapes for the config tried."""
        for name, shape in tma_block_shapes(nargs).items():
            nargs[name].block_shape = shape

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
        CAST_F32: tl.constexpr,
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
            if CAST_F32:
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
        CAST_F32: tl.constexpr,
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
            if CAST_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

        dw_ptrs = dw_ptr + g.to(tl.int64) * stride_dwg + ks[:, None] * stride_dwk + cols[None, :] * stride_dwn
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _group_table(sizes_ptr, G, BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr):
        """The group vectors from the sizes on device: (group index, size, row tiles, inclusive
        cumulative row tiles, inclusive cumulative rows), G_BLOCK wide (zero past G)."""
        gidx = tl.arange(0, G_BLOCK)
        sizes = tl.load(sizes_ptr + gidx, mask=gidx < G, other=0)
        tiles = (sizes + BLOCK_M - 1) // BLOCK_M
        return gidx, sizes, tiles, tl.cumsum(tiles, axis=0), tl.cumsum(sizes, axis=0)

    @triton.jit
    def _unit_of(u, sizes_ptr, G, num_n, BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr, GROUP_M: tl.constexpr):
        """Work unit u of the persistent forward: (group, its first row, its rows, row tile in
        the group, column tile). Units are numbered group by group (the group's row tiles x
        num_n each), in grouped tile order inside a group (`tile_coords`). The group table is
        rebuilt per unit (G_BLOCK sizes from L1): nothing but scalars stays live across units."""
        gidx, sizes, tiles, tile_end, row_end = _group_table(sizes_ptr, G, BLOCK_M, G_BLOCK)
        g = tl.sum((tile_end * num_n <= u).to(tl.int32), axis=0)
        sel = gidx == g
        g_tiles = tl.sum(tl.where(sel, tiles, 0), axis=0)
        g_first_unit = (tl.sum(tl.where(sel, tile_end, 0), axis=0) - g_tiles) * num_n
        g_size = tl.sum(tl.where(sel, sizes, 0), axis=0)
        g_row_start = tl.sum(tl.where(sel, row_end, 0), axis=0) - g_size
        pid_m, pid_n = tile_coords(u - g_first_unit, g_tiles, num_n, GROUP_M)
        return g, g_row_start, g_size, pid_m, pid_n

    @triton.jit
    def _store_rows(
        acc,
        y_ptr,
        row_start,
        rows,
        pid_m,
        pid_n,
        N_OUT,
        stride_ym,
        stride_yn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Output tile (pid_m, pid_n) of a group into y (rows past the group's `rows` masked)."""
        local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = y_ptr + (row_start + local_m)[:, None].to(tl.int64) * stride_ym + cols[None, :] * stride_yn
        mask = (local_m[:, None] < rows) & (cols[None, :] < N_OUT)
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.autotune(
        configs=_persistent_configs(),
        key=["K", "N_OUT", "G_BLOCK", "INPUT_PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1)},
    )
    @triton.jit
    def _grouped_gemm_persistent_kernel(
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
        CAST_F32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """Persistent y[rows of g] = x[rows of g] @ w[g]: program p computes units p, p + grid,
        ... (`_unit_of`: group by group, grouped tile order inside a group) until the unit count
        the group sizes give, read on device."""
        sizes = tl.load(sizes_ptr + tl.arange(0, G_BLOCK), mask=tl.arange(0, G_BLOCK) < G, other=0)
        num_n = tl.cdiv(N_OUT, BLOCK_N)
        units = tl.sum((sizes + BLOCK_M - 1) // BLOCK_M, axis=0) * num_n
        k_tiles = tl.cdiv(K, BLOCK_K)
        for u in tl.range(tl.program_id(0), units, tl.num_programs(0)):
            g, row_start, rows, pid_m, pid_n = _unit_of(u, sizes_ptr, G, num_n, BLOCK_M, G_BLOCK, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = ptr_k_loop(
                acc,
                x_ptr + row_start.to(tl.int64) * stride_xm,
                w_ptr + g.to(tl.int64) * stride_wg,
                pid_m,
                pid_n,
                rows,
                N_OUT,
                K,
                0,
                k_tiles,
                stride_xm,
                stride_xk,
                stride_wk,
                stride_wn,
                CAST_F32,
                INPUT_PRECISION,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            _store_rows(acc, y_ptr, row_start, rows, pid_m, pid_n, N_OUT, stride_ym, stride_yn, BLOCK_M, BLOCK_N)

    @triton.autotune(
        configs=_persistent_configs(pre_hook=_set_tma_blocks),
        key=["K", "N_OUT", "G_BLOCK", "W_T", "INPUT_PRECISION"],
        prune_configs_by={"early_config_prune": gemm_prune("x_desc", a_tiles=1, b_tiles=1)},
    )
    @triton.jit
    def _grouped_gemm_tma_kernel(
        x_desc,
        w_desc,
        y_ptr,
        sizes_ptr,
        G,
        K,
        N_OUT,
        stride_ym,
        stride_yn,
        G_BLOCK: tl.constexpr,
        W_T: tl.constexpr,
        CAST_F32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """`_grouped_gemm_persistent_kernel` with TMA loads: x's tile [BLOCK_M, BLOCK_K] at the
        group's row tile (rows past the group feed only rows the store masks), the weight's from
        a 3-D descriptor ([G, K, N]; [G, N, K] when W_T, the tile transposed in shared memory)
        whose box clips at the expert's edges."""
        sizes = tl.load(sizes_ptr + tl.arange(0, G_BLOCK), mask=tl.arange(0, G_BLOCK) < G, other=0)
        num_n = tl.cdiv(N_OUT, BLOCK_N)
        units = tl.sum((sizes + BLOCK_M - 1) // BLOCK_M, axis=0) * num_n
        for u in tl.range(tl.program_id(0), units, tl.num_programs(0)):
            g, row_start, rows, pid_m, pid_n = _unit_of(u, sizes_ptr, G, num_n, BLOCK_M, G_BLOCK, GROUP_M)
            off_m = row_start + pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range(0, tl.cdiv(K, BLOCK_K)):
                off_k = kt * BLOCK_K
                a = x_desc.load([off_m, off_k])
                if W_T:
                    b = w_desc.load([g, off_n, off_k]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b = w_desc.load([g, off_k, off_n]).reshape(BLOCK_K, BLOCK_N)
                acc = dot(a, b, acc, CAST_F32, INPUT_PRECISION)
            _store_rows(acc, y_ptr, row_start, rows, pid_m, pid_n, N_OUT, stride_ym, stride_yn, BLOCK_M, BLOCK_N)

    @triton.jit
    def _dw_rows_loop(
        x_ptr,
        dy_ptr,
        rows,
        pid_k,
        pid_n,
        K,
        N_OUT,
        stride_xm,
        stride_xk,
        stride_dym,
        stride_dyn,
        CAST_F32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """x[:rows, K tile]^T @ dy[:rows, N tile] over the rows in BLOCK_M steps (x^T loaded
        through swapped strides), the tile pointers rebuilt from the row offsets every step."""
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_mask = ks < K
        col_mask = cols < N_OUT
        ms = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for m0 in range(0, rows, BLOCK_M):
            local_m = (m0 + ms).to(tl.int64)
            row_mask = local_m < rows
            a = tl.load(
                x_ptr + local_m[None, :] * stride_xm + ks[:, None] * stride_xk,
                mask=k_mask[:, None] & row_mask[None, :],
                other=0.0,
            )
            b = tl.load(
                dy_ptr + local_m[:, None] * stride_dym + cols[None, :] * stride_dyn,
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc = dot(a, b, acc, CAST_F32, INPUT_PRECISION)
        return acc

    # dW = x^T @ dy in cache-aware order: output tiles [BLOCK_K, BLOCK_N], reduction over BLOCK_M rows.
    @triton.autotune(
        configs=_dw_ordered_configs(),
        key=["K", "N_OUT", "G_BLOCK", "INPUT_PRECISION"],
        prune_configs_by={
            "early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1, dims=("BLOCK_K", "BLOCK_N", "BLOCK_M"))
        },
    )
    @triton.jit
    def _grouped_gemm_dw_ordered_kernel(
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
        CAST_F32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """dW[g] = x[rows of g]^T @ dy[rows of g], one program per dW tile on a 1-D grid of
        G x K tiles x N tiles, numbered group by group and in grouped tile order inside a group
        (GROUP_M K tiles down an N column): the programs the hardware runs at once share one
        group's x and dy columns. A program loops over its group's rows (none for an empty
        group: it writes zeros)."""
        num_k = tl.cdiv(K, BLOCK_K)
        num_n = tl.cdiv(N_OUT, BLOCK_N)
        per_group = num_k * num_n
        u = tl.program_id(0)
        g = u // per_group
        pid_k, pid_n = tile_coords(u - g * per_group, num_k, num_n, GROUP_M)
        gidx, sizes, _, _, row_end = _group_table(sizes_ptr, G, BLOCK_M, G_BLOCK)
        sel = gidx == g
        rows = tl.sum(tl.where(sel, sizes, 0), axis=0)
        row_start = tl.sum(tl.where(sel, row_end, 0), axis=0) - rows
        acc = _dw_rows_loop(
            x_ptr + row_start.to(tl.int64) * stride_xm,
            dy_ptr + row_start.to(tl.int64) * stride_dym,
            rows,
            pid_k,
            pid_n,
            K,
            N_OUT,
            stride_xm,
            stride_xk,
            stride_dym,
            stride_dyn,
            CAST_F32,
            INPUT_PRECISION,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        _store_rows(
            acc,
            dw_ptr + g.to(tl.int64) * stride_dwg,
            0,
            K,
            pid_k,
            pid_n,
            N_OUT,
            stride_dwk,
            stride_dwn,
            BLOCK_K,
            BLOCK_N,
        )

    # FP8 tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): 1-byte operands take K tiles of 128
    # bytes (fp8 wgmma reads k32 per instruction), the stages cost half what 16-bit ones do.
    FP8_TILES = [
        (128, 128, 128, 8, 3),
        (128, 256, 128, 8, 3),
        (128, 128, 64, 4, 4),
        (64, 128, 128, 4, 4),
        (128, 64, 128, 4, 4),
        (64, 64, 128, 4, 3),
    ]

    def gpu_fp8_configs() -> list:
        """GPU candidates of the FP8 grouped kernel, before per-device pruning (`FP8_TILES`, GROUP_M 8)."""
        return gemm.configs_of(FP8_TILES)

    def _fp8_configs():
        return _persistent_interpreter_configs() if interpreting() else gpu_fp8_configs()

    @triton.autotune(
        configs=_fp8_configs(),
        key=["K", "N_OUT", "G_BLOCK"],
        prune_configs_by={"early_config_prune": gemm_prune("x_ptr", a_tiles=1, b_tiles=1)},
    )
    @triton.jit
    def _grouped_gemm_fp8_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        sizes_ptr,
        x_scale_ptr,
        w_scale_ptr,
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
        stride_wsg,
        G_BLOCK: tl.constexpr,
        CAST_F32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """Persistent FP8 y[rows of g] = (s_x[rows] s_w[g][cols]) * (q_x[rows of g] @ q_w[g]):
        e4m3 tiles into `tl.dot` with an fp32 accumulator, the row scales of x and the column
        scales of expert g's weight applied to the accumulator in the epilogue, then rounded to
        y's dtype. The schedule is `_grouped_gemm_persistent_kernel`'s (`_unit_of`)."""
        sizes = tl.load(sizes_ptr + tl.arange(0, G_BLOCK), mask=tl.arange(0, G_BLOCK) < G, other=0)
        num_n = tl.cdiv(N_OUT, BLOCK_N)
        units = tl.sum((sizes + BLOCK_M - 1) // BLOCK_M, axis=0) * num_n
        offs_k = tl.arange(0, BLOCK_K)
        for u in tl.range(tl.program_id(0), units, tl.num_programs(0)):
            g, row_start, rows, pid_m, pid_n = _unit_of(u, sizes_ptr, G, num_n, BLOCK_M, G_BLOCK, GROUP_M)
            local_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            m_mask = local_m < rows
            n_mask = cols < N_OUT
            a_ptrs = x_ptr + (row_start + local_m)[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
            b_ptrs = w_ptr + g.to(tl.int64) * stride_wg + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kt in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - kt * BLOCK_K
                a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & n_mask[None, :], other=0.0)
                if CAST_F32:  # the interpreter: exact fp32 products of the e4m3 values
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K * stride_xk
                b_ptrs += BLOCK_K * stride_wk
            s_x = tl.load(x_scale_ptr + row_start + local_m, mask=m_mask, other=0.0)
            s_w = tl.load(w_scale_ptr + g.to(tl.int64) * stride_wsg + cols, mask=n_mask, other=0.0)
            acc = acc * s_x[:, None] * s_w[None, :]
            _store_rows(acc, y_ptr, row_start, rows, pid_m, pid_n, N_OUT, stride_ym, stride_yn, BLOCK_M, BLOCK_N)


def _require_triton(t: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("grouped_gemm backend='triton' needs the triton package (pip install triton)")
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError("grouped_gemm backend='triton' on CPU runs only under TRITON_INTERPRET=1 (tests)")


def _kernel_flags(dtype: torch.dtype) -> dict:
    # input_precision only changes fp32 dots; 16-bit inputs always use the tensor cores.
    return {"CAST_F32": interpreting(), "INPUT_PRECISION": dot_precision(dtype)}


def _g_block(groups: int) -> int:
    return max(triton.next_power_of_2(groups), 2)


class GroupedPlan(NamedTuple):
    """What the forward / dx launch runs (`grouped_plan`): the kernel's name, the TMA layouts
    (x's, the weight's: "n" row-major, "t" transposed; None off the TMA kernel) and the SMs of
    the persistent grid (0: one program per tile, also for dW)."""

    kernel: str
    layouts: tuple | None
    num_sms: int


def _w_layout(w: torch.Tensor) -> str | None:
    """The TMA layout of a weight view w [G, K, N]: "n" when N has the unit stride, "t" when K
    has it (w^T of a row-major weight: the descriptor is on its [G, N, K] storage), None when a
    descriptor cannot load it (other strides, a base or stride not 16-byte aligned)."""
    sg, sk, sn = w.stride()
    elem = w.element_size()
    if w.data_ptr() % 16 or (sg * elem) % 16:
        return None
    if sn == 1 and (sk * elem) % 16 == 0:
        return "n"
    if sk == 1 and (sn * elem) % 16 == 0:
        return "t"
    return None


def grouped_plan(x, w, persistent=None, tma=None, num_sms=None) -> GroupedPlan:
    """The forward / dx kernel for x [N, K] and the weight view w [G, K, N_OUT] (see the module
    docstring): persistent by default on CUDA (`persistent=False`, and the interpreter's
    default, is one program per tile); through TMA descriptors by default on sm_90+ (`tma=True`
    also elsewhere, e.g. the interpreter) when x and w are 16-bit, x row-major and w
    TMA-loadable (`_w_layout`), with pointer loads otherwise. `num_sms` overrides the SM count."""
    if persistent is None:
        persistent = x.device.type == "cuda"
    if not persistent:
        return GroupedPlan("_grouped_gemm_kernel", None, 0)
    sms, major = gemm.device_info(x.device)
    sms = num_sms or sms
    if tma is None:
        tma = major >= 9
    if tma and gemm.TensorDescriptor is not None and x.dtype in gemm.TMA_DTYPES and x.shape[1] > 0:
        lw = _w_layout(w)
        if lw is not None and gemm.tma_layout(x) == "n":
            return GroupedPlan("_grouped_gemm_tma_kernel", ("n", lw), sms)
    return GroupedPlan("_grouped_gemm_persistent_kernel", None, sms)


def _programs(num_sms: int, rows: int, groups: int, n_out: int, cfg: dict) -> int:
    """Persistent forward grid: min(SMs, the unit bound (ceil(N / BLOCK_M) + min(G, N)) x column tiles)."""
    bound = (triton.cdiv(rows, cfg["BLOCK_M"]) + min(groups, rows)) * triton.cdiv(n_out, cfg["BLOCK_N"])
    return max(1, min(num_sms, bound))


def _launch_gemm(
    x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor, out_dtype: torch.dtype, plan: GroupedPlan
) -> torch.Tensor:
    """y[rows of g] = x[rows of g] @ w[g] for w viewed [G, K, N_OUT] (any strides), by `plan`'s kernel."""
    rows, k = x.shape
    groups, _, n_out = w.shape
    y = torch.empty(rows, n_out, device=x.device, dtype=out_dtype)
    if rows == 0 or n_out == 0 or groups == 0:
        return y
    flags = {"G_BLOCK": _g_block(groups), **_kernel_flags(x.dtype)}
    # the weight's unit stride (forward: N, dx: K) in the launch keys: its own specialisation
    w_unit = (w.stride(1) == 1, w.stride(2) == 1)
    if plan.num_sms == 0:

        def grid(meta):
            return (triton.cdiv(rows, meta["BLOCK_M"]) + groups, triton.cdiv(n_out, meta["BLOCK_N"]))

        key = (k, n_out, x.dtype, w.dtype, out_dtype, *flags.values(), w_unit, x.device)
        args = (x, w, y, sizes, groups, k, n_out, *x.stride(), *w.stride(), *y.stride())
        launch(_grouped_gemm_kernel, grid, key, *args, **flags)
        return y
    tma = plan.layouts is not None
    if tma:
        flags["W_T"] = plan.layouts[1] == "t"
        kernel = _grouped_gemm_tma_kernel
    else:
        kernel = _grouped_gemm_persistent_kernel

    def args(blocks):
        if not tma:
            return (x, w, y, sizes, groups, k, n_out, *x.stride(), *w.stride(), *y.stride())
        x_desc = gemm.tensor_descriptor(x, [rows, k], [x.stride(0), 1], blocks["x_desc"])
        if flags["W_T"]:
            w_desc = gemm.tensor_descriptor(w, [groups, n_out, k], [w.stride(0), w.stride(2), 1], blocks["w_desc"])
        else:
            w_desc = gemm.tensor_descriptor(w, [groups, k, n_out], [w.stride(0), w.stride(1), 1], blocks["w_desc"])
        return (x_desc, w_desc, y, sizes, groups, k, n_out, *y.stride())

    key = (plan.kernel, plan.layouts, k, n_out, x.dtype, out_dtype, *flags.values(), w_unit, plan.num_sms, x.device)

    def programs(meta):
        return (_programs(plan.num_sms, rows, groups, n_out, meta),)

    def args_for(meta):  # the first, autotuned call: placeholder blocks (the configs' pre-hook sets them)
        if not tma:
            return args(None)
        return args(tma_block_shapes(meta or {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, **flags}))

    launch(kernel, programs, key, args_for=args_for, **flags)
    return y


def _launch_dw(
    x: torch.Tensor, dy: torch.Tensor, sizes: torch.Tensor, groups: int, out_dtype: torch.dtype, ordered: bool
) -> torch.Tensor:
    """dW[g] = x[rows of g]^T @ dy[rows of g], [G, K, N_OUT]; zeros for empty groups. `ordered`:
    the cache-aware 1-D grid (`_grouped_gemm_dw_ordered_kernel`), else the (group, K tile, N
    tile) grid of `_grouped_gemm_dw_kernel`."""
    k, n_out = x.shape[1], dy.shape[1]
    dw = torch.empty(groups, k, n_out, device=x.device, dtype=out_dtype)
    if groups == 0 or k == 0 or n_out == 0:
        return dw
    flags = {"G_BLOCK": _g_block(groups), **_kernel_flags(x.dtype)}
    args = (x, dy, dw, sizes, groups, k, n_out, *x.stride(), *dy.stride(), *dw.stride())
    key = (k, n_out, x.dtype, dy.dtype, out_dtype, *flags.values(), x.device)
    if ordered:

        def grid(meta):
            return (groups * triton.cdiv(k, meta["BLOCK_K"]) * triton.cdiv(n_out, meta["BLOCK_N"]),)

        launch(_grouped_gemm_dw_ordered_kernel, grid, key, *args, **flags)
    else:

        def grid(meta):
            return (groups, triton.cdiv(k, meta["BLOCK_K"]), triton.cdiv(n_out, meta["BLOCK_N"]))

        launch(_grouped_gemm_dw_kernel, grid, key, *args, **flags)
    return dw


class GroupedGemmFunction(torch.autograd.Function):
    """Autograd Function of the Triton grouped GEMM.

    forward(x [N, in], weight [G, in, out], group_sizes [G], w_c, switches=None) -> y [N, out]
    with y[rows of g] = x[rows of g] @ w_c[g], where w_c is the copy of `weight` in x's dtype
    (the compute dtype; `weight` itself when it already has it); `switches`: None or
    (persistent, tma, num_sms), `grouped_plan`'s test switches, for all three products;
    backward: dx[rows of g] = dy[rows of g] @ w_c[g]^T (forward kernel, weight transposed
    through strides), dW[g] = x[rows of g]^T @ dy[rows of g] in weight's dtype (zeros for
    empty groups); group_sizes and w_c get no gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, group_sizes, w_c, switches=None):
        _require_triton(x)
        _check_shapes(x, weight, group_sizes)
        if w_c.dtype != x.dtype or w_c.shape != weight.shape:
            raise ValueError(f"grouped_gemm wants the weight copy in x's dtype {x.dtype}, got {w_c.dtype}")
        sizes = group_sizes.to(device=x.device, dtype=torch.int32)
        ctx.save_for_backward(x, w_c, sizes)
        ctx.w_dtype = weight.dtype
        ctx.switches = tuple(switches or ())
        return _launch_gemm(x, w_c, sizes, x.dtype, grouped_plan(x, w_c, *ctx.switches))

    @staticmethod
    def backward(ctx, dy):
        x, w_c, sizes = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_t = w_c.transpose(1, 2)
            dx = _launch_gemm(dy, w_t, sizes, x.dtype, grouped_plan(dy, w_t, *ctx.switches))
        if ctx.needs_input_grad[1]:
            ordered = grouped_plan(x, w_c, *ctx.switches).num_sms > 0
            dw = _launch_dw(x, dy, sizes, w_c.shape[0], ctx.w_dtype, ordered)
        return dx, dw, None, None, None


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: torch.Tensor,
    backend: str = "torch",
    *,
    persistent: bool | None = None,
    tma: bool | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """y[rows of group g] = x[rows of group g] @ weight[g] for consecutive row groups.

    x [N, in] sorted by group; weight [G, in, out]; group_sizes [G] on x's device, summing to N.
    backend "torch": `grouped_gemm_reference` (the fast torch path lives in
    moe/experts.py `grouped_matmul`); "triton": `GroupedGemmFunction` (one launch for all
    groups forward, two in backward; CUDA, or CPU under TRITON_INTERPRET=1), persistent on CUDA
    (`grouped_plan`; the switches `persistent`, `tma`, `num_sms` are for tests and benchmarks).
    Differentiable in x and weight; fp32 accumulation for fp32 / bf16 / fp16 inputs. The
    Triton path computes in autocast's dtype under autocast (x and weight cast to it, the
    weight copy cached per step: kernels/operands.py), else in x.dtype; y has the compute
    dtype and dW weight's dtype.
    """
    if backend == "torch":
        return grouped_gemm_reference(x, weight, group_sizes)
    if backend == "triton":
        dtype = compute_dtype(x)
        switches = None if (persistent, tma, num_sms) == (None, None, None) else (persistent, tma, num_sms)
        return GroupedGemmFunction.apply(x.to(dtype), weight, group_sizes, weight_copy(weight, dtype), switches)
    raise ValueError(f"grouped_gemm backend={backend!r} must be 'torch' or 'triton'")


def grouped_gemm_fp8(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """y[rows of g] = x_scale[rows] * w_scale[g] * (x_q[rows of g] @ w_q[g]) in one persistent
    launch (`_grouped_gemm_fp8_kernel`; CUDA, or CPU under TRITON_INTERPRET=1): x_q [N, K] and
    w_q [G, K, N_OUT] (any strides) in float8_e4m3fn, x_scale [N] and w_scale [G, N_OUT] fp32
    (one per row of x, one per output column of each expert), fp32 accumulation, y [N, N_OUT]
    in out_dtype. Not differentiable (moe/fp8_experts.py builds the FP8 recipe's backward on it)."""
    _require_triton(x_q)
    _check_shapes(x_q, w_q, group_sizes)
    rows, k = x_q.shape
    groups, _, n_out = w_q.shape
    y = torch.empty(rows, n_out, device=x_q.device, dtype=out_dtype)
    if rows == 0 or n_out == 0 or groups == 0:
        return y
    sizes = group_sizes.to(device=x_q.device, dtype=torch.int32)
    x_scale, w_scale = x_scale.reshape(rows).float().contiguous(), w_scale.reshape(groups, n_out).float().contiguous()
    flags = {"G_BLOCK": _g_block(groups), "CAST_F32": interpreting()}
    sms = gemm.device_info(x_q.device)[0]
    w_unit = (w_q.stride(1) == 1, w_q.stride(2) == 1)
    key = ("fp8", k, n_out, out_dtype, *flags.values(), w_unit, sms, x_q.device)
    args = (x_q, w_q, y, sizes, x_scale, w_scale, groups, k, n_out, *x_q.stride(), *w_q.stride(), *y.stride())

    def programs(meta):
        return (_programs(sms, rows, groups, n_out, meta),)

    launch(_grouped_gemm_fp8_kernel, programs, key, *args, w_scale.stride(0), **flags)
    return y
