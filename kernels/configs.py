"""Per-device pruning of the GEMM autotune configs, before Triton compiles any of them.

A config that needs more shared memory than a block may have on the device, or more
accumulator registers than a thread can hold without spilling, is dropped before
autotuning (the autotuner would otherwise compile every candidate and discard it at
launch). The estimates are upper bounds checked against real compiles for sm_80 and sm_90
by tests/test_kernels_aot.py: a kept config must fit.

Shared memory of a pipelined K loop: `num_stages` buffers of every operand tile loaded per
K step (A tiles [BLOCK_M, BLOCK_K], B tiles [BLOCK_K, BLOCK_N]) in the operand dtype, plus
1 KiB for the pipeline's barriers; tf32 dots stage fp32 operands (4 bytes) like IEEE ones.
The epilogue's layout conversion reuses that space (also in the persistent kernels, whose
K-loop buffers are allocated per tile). Hopper-sized tiles (128x256x64 on 4 stages, 192 KiB
in 16-bit) fit sm_90's 227 KiB; their 128 accumulators per thread are kept by sm_90's
register limit and dropped by sm_80's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceLimits:
    """What one thread block may use on a GPU architecture (the register limits are ours:
    measured by `python -m meshtron.kernels.aot` to keep every kept config free of spills)."""

    arch: int  # compute capability major * 10 + minor (80 = A100, 90 = H100)
    shared_bytes: int  # dynamic shared memory per block (opt-in maximum)
    max_acc_regs: int = 128  # fp32 accumulator registers per thread, 16-bit tensor-core dots
    max_acc_regs_fp32: int = 64  # the same with 4-byte operands (tf32 and IEEE dots)
    fma_max_block_k: int = 16  # IEEE fp32 dots run on CUDA cores with a K slice per thread:
    #                             wider K tiles spill; tensor-core configs use K tiles >= 32


# Datasheet opt-in shared memory per block: A100 163 KiB, H100 227 KiB. Ampere's mma.sync
# spills at 128 accumulators per thread with 16-bit operands; Hopper's wgmma does not.
ARCH_LIMITS = {80: DeviceLimits(80, 163 * 1024, max_acc_regs=64), 90: DeviceLimits(90, 227 * 1024)}


def device_limits(device: torch.device) -> DeviceLimits:
    """Limits of a CUDA device: our table's for its arch (the nearest older one for newer
    chips), with the shared memory read from the device's properties."""
    props = torch.cuda.get_device_properties(device)
    arch = props.major * 10 + props.minor
    known = ARCH_LIMITS[max((a for a in ARCH_LIMITS if a <= arch), default=80)]
    shared = getattr(props, "shared_memory_per_block_optin", None) or known.shared_bytes
    return DeviceLimits(arch, int(shared), known.max_acc_regs, known.max_acc_regs_fp32, known.fma_max_block_k)


# Beyond the operand stages: the mbarriers of a TMA / wgmma pipeline (8 bytes per stage and
# barrier kind) and alignment padding, 24-64 B in the sm_90 compiles of kernels/gemm.py's TMA
# kernel (Triton 3.6 and 3.9); a round bound.
SYNC_BYTES = 1024


def gemm_shared_bytes(
    block_m: int, block_n: int, block_k: int, num_stages: int, elem_bytes: int, a_tiles: int = 1, b_tiles: int = 1
) -> int:
    """Upper bound of the shared memory of a pipelined GEMM K loop with `a_tiles` A tiles and
    `b_tiles` B tiles loaded per K step (plus `SYNC_BYTES`)."""
    per_stage = (a_tiles * block_m * block_k + b_tiles * block_k * block_n) * elem_bytes
    return max(num_stages, 1) * per_stage + SYNC_BYTES


def gemm_acc_regs(block_m: int, block_n: int, num_warps: int, accumulators: int = 1) -> int:
    """fp32 accumulator registers per thread of a [block_m, block_n] tile (times accumulators)."""
    return accumulators * block_m * block_n // (32 * num_warps)


GEMM_DIMS = ("BLOCK_M", "BLOCK_N", "BLOCK_K")  # (output rows, output cols, reduction) block names


def config_shared_bytes(config, elem_bytes: int, a_tiles: int = 1, b_tiles: int = 1, dims=GEMM_DIMS) -> int:
    """`gemm_shared_bytes` of a `triton.Config`; `dims` names its (rows, cols, reduction) blocks."""
    m, n, k = (config.kwargs[d] for d in dims)
    return gemm_shared_bytes(m, n, k, config.num_stages, elem_bytes, a_tiles, b_tiles)


def config_fits(
    config,
    limits: DeviceLimits,
    elem_bytes: int,
    a_tiles: int,
    b_tiles: int,
    accumulators: int = 1,
    dims=GEMM_DIMS,
    fma: bool = False,
) -> bool:
    """True when a GEMM `triton.Config` fits `limits`: shared memory, accumulator registers and
    the K tile of its dot kind (`fma`: IEEE fp32 on CUDA cores, else tensor cores)."""
    m, n, k = (config.kwargs[d] for d in dims)
    shared = config_shared_bytes(config, elem_bytes, a_tiles, b_tiles, dims)
    regs = gemm_acc_regs(m, n, config.num_warps, accumulators)
    max_regs = limits.max_acc_regs_fp32 if elem_bytes == 4 else limits.max_acc_regs
    k_ok = k <= limits.fma_max_block_k if fma else k > limits.fma_max_block_k
    return shared <= limits.shared_bytes and regs <= max_regs and k_ok


def prune_gemm_configs(
    configs: list,
    limits: DeviceLimits,
    elem_bytes: int,
    a_tiles: int,
    b_tiles: int,
    accumulators: int = 1,
    dims=GEMM_DIMS,
    fma: bool = False,
) -> list:
    """The configs that fit `limits`; raises when none does (a kernel left without a config
    must fail loudly, not autotune over nothing)."""
    kept = [c for c in configs if config_fits(c, limits, elem_bytes, a_tiles, b_tiles, accumulators, dims, fma)]
    if not kept:
        raise RuntimeError(
            f"no GEMM config fits sm_{limits.arch} ({limits.shared_bytes} B shared, "
            f"{elem_bytes}-byte operands, {a_tiles}+{b_tiles} tiles per step"
            f"{', IEEE fp32' if fma else ''})"
        )
    return kept


PRECISION_ARGS = ("PRECISION", "INPUT_PRECISION")  # the dot-precision constexpr of our GEMM kernels


def gemm_prune(
    elem_arg: str, a_tiles: int, b_tiles: int, dual: str | None = None, accumulators: int = 1, dims=GEMM_DIMS
):
    """An `early_config_prune` hook for `triton.autotune`: prunes for the device of the tensor
    (or tensor descriptor) argument `elem_arg`, its element size and the dot precision constexpr. `dual` names a
    constexpr that, when true, doubles the A and B tiles per K step (two products
    accumulated per step); `dims` names the (rows, cols, reduction) block sizes."""

    def prune(configs, named_args, **kwargs):
        x = named_args[elem_arg]
        x = getattr(x, "base", x)  # a TMA tensor descriptor: the tensor it describes
        if not getattr(x, "is_cuda", False):  # interpreter: nothing to prune
            return configs
        args = {**named_args, **kwargs}
        factor = 2 if dual is not None and args.get(dual) else 1
        fma = x.element_size() == 4 and any(args.get(p) == "ieee" for p in PRECISION_ARGS)
        return prune_gemm_configs(
            configs,
            device_limits(x.device),
            x.element_size(),
            a_tiles * factor,
            b_tiles * factor,
            accumulators,
            dims,
            fma,
        )

    prune.gemm_shape = dict(
        elem_arg=elem_arg, a_tiles=a_tiles, b_tiles=b_tiles, dual=dual, accumulators=accumulators, dims=dims
    )  # read by kernels/aot.py
    return prune
