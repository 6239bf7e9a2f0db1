"""Ahead-of-time compile check of every Triton kernel for Ampere (sm_80) and Hopper (sm_90),
without a GPU: Triton compiles for a CUDA target on any machine.

    python -m meshtron.kernels.aot                       # every (kernel, dtype, arch) once + a seeded sample
    python -m meshtron.kernels.aot --all                 # every config the per-device pruning keeps
    python -m meshtron.kernels.aot --json out.json       # also write the per-case results

A *case* is one kernel compiled with one config, one operand dtype (as the wrappers feed it:
fp32 with IEEE or TF32 dots, bf16 and fp16 compute with fp32 main weights) for one arch.
The configs are each kernel's GPU candidates after the same per-device pruning the
autotuner applies (kernels/configs.py for the GEMMs, the norms' own per-thread pruning).
Each compiled case reports its shared memory (Triton's metadata), registers and stack frame
(cuobjdump of the cubin Triton produced) and the tensor-core and copy instructions of its
PTX (`wgmma`, `mma.sync`, TMA's `cp.async.bulk.tensor`).

`check(results)` lists the failures: a compile error, a kept config over the arch's shared
memory, a GEMM whose shared-memory estimate is below the compiled size (the pruning bound
would be unsafe), a (kernel, dtype, arch) left with no config, a 16-bit GEMM without wgmma on
sm_90 or without mma.sync on sm_80, an `FP8_KERNELS` kernel (e4m3 operands, dtype label "fp8")
without an e4m3 wgmma on sm_90, a `TMA_KERNELS` kernel without TMA bulk copies on sm_90,
and a stack frame over the kernel's stated `SPILL_BUDGET`. `KERNEL_ARCHS` names the kernels
compiled for some archs only (the TMA GEMMs: sm_90).

Must run with TRITON_INTERPRET unset (the interpreter replaces the jitted functions);
`tests/test_kernels_aot.py` runs this module in a clean subprocess.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

ARCHS = (80, 90)
# Operand dtypes the wrappers feed, as (label, compute type, dot precision).
PRECISIONS = (
    ("fp32-ieee", "fp32", "ieee"),
    ("fp32-tf32", "fp32", "tf32"),
    ("bf16", "bf16", "ieee"),
    ("fp16", "fp16", "ieee"),
)
NORM_WIDTHS = (2048, 8192)  # gpt_1b's hidden size, and a wide model's
# Kernels compiled for some archs only: the TMA GEMMs run on sm_90+ with 16-bit operands.
KERNEL_ARCHS = {
    "_matmul_tma_kernel": (90,),
    "linear_gelu_tma_kernel": (90,),
    "linear_swiglu_tma_kernel": (90,),
    "_grouped_gemm_tma_kernel": (90,),
    "_grouped_gemm_fp8_kernel": (90,),  # e4m3 tensor cores: sm_89+ (Ada's sm_89 is not an ARCHS target)
}
# Kernels whose sm_90 PTX must load through TMA bulk tensor copies.
TMA_KERNELS = frozenset(
    {"_matmul_tma_kernel", "linear_gelu_tma_kernel", "linear_swiglu_tma_kernel", "_grouped_gemm_tma_kernel"}
)

# Kernels fed float8_e4m3fn operands (dtype label "fp8", captured by `_fp8_workload`): their
# sm_90 PTX must multiply with an e4m3 wgmma (not the operands converted to 16 bits first).
FP8_KERNELS = frozenset({"_grouped_gemm_fp8_kernel"})

# Stack-frame bytes per thread each kernel may use on the configs the pruning keeps (spills
# or local arrays), measured over every kept config with `python -m meshtron.kernels.aot --all`
# (triton 3.9, 2026-11-23) and by tests/test_kernels_aot.py under triton 3.6, the GPU image's
# (2026-11-26): a few bytes at most, where the configs before the pruning had 0.3-7 KB frames
# (IEEE fp32 GEMMs with wide K tiles, norm backward at H=8192). A kernel whose frame grows
# past its budget fails the suite.
SPILL_BUDGET = {
    # The one-program-per-tile forwards (the interpreter's default and persistent=False since the
    # persistent ones run on CUDA), re-measured with --all on both Tritons (2026-12): 16-bit
    # 128x128x32 (GeLU) / 128x64x32 and 64x128x32 (SwiGLU) on 4 warps with SAVE_PRE, sm_90,
    # 32-72 B, as on the code before the persistent kernels (the earlier budgets predate SAVE_PRE).
    "linear_gelu_fwd_kernel": 72,
    "linear_gelu_bwd_kernel": 0,
    "linear_swiglu_fwd_kernel": 72,
    "linear_swiglu_bwd_kernel": 56,  # 16-bit 128x64x32 on 4 warps, sm_90 (two accumulators + dy)
    # The persistent forwards, --all on both Tritons (2026-12): the TMA kernels 0 B on every kept
    # config (epilogue in column slices, linear_act_kernels.subtiles; whole 128x256 tiles spilled 80-184 B);
    # pointer loads 8 B (triton 3.9: 16-bit 256x128x64 / 128x128x32 on sm_90, IEEE fp32 64x64x16),
    # SwiGLU 72 B on IEEE fp32 64x64x16 on 4 warps, sm_90 (CUDA-core dots; 24 B with triton 3.6).
    "linear_gelu_persistent_kernel": 8,
    "linear_gelu_tma_kernel": 0,
    "linear_swiglu_persistent_kernel": 72,
    "linear_swiglu_tma_kernel": 0,
    "_matmul_kernel": 8,
    "_matmul_persistent_kernel": 16,  # triton 3.9: IEEE fp32 dual 128x64x16 on 8 warps, sm_90
    "_matmul_tma_kernel": 0,
    "_splitk_reduce_kernel": 0,
    "linear_gelu_grad_kernel": 0,
    "linear_swiglu_grad_kernel": 0,
    "_grouped_gemm_kernel": 16,  # IEEE fp32 128x128x16 on sm_90
    "_grouped_gemm_dw_kernel": 0,
    # The grouped GEMM's persistent forward / dx and ordered dW, --all on their launches with both
    # Tritons (2026-12): pointer loads 32 B with triton 3.9 on 16-bit 128x256x64 on 3 stages, sm_90
    # (where 16-bit operands normally take the TMA kernel), 24 B IEEE fp32 128x128x16 on sm_90;
    # 8 B with triton 3.6. TMA and the ordered dW 0 B (a persistent dW had 168-672 B on sm_90 tf32).
    "_grouped_gemm_persistent_kernel": 32,
    "_grouped_gemm_tma_kernel": 0,
    "_grouped_gemm_dw_ordered_kernel": 0,
    "_grouped_gemm_fp8_kernel": 0,
    "_norm_fwd_kernel": 8,  # triton 3.6 (the GPU image's): fp32 H=8192, 2 rows on 16 warps, sm_80
    "_norm_bwd_kernel": 8,
    # The fused residual norms: 0 B on all 334 kept configs (triton 3.9, --all on their launches);
    # 8 B as the plain norms' for triton 3.6. The forward at 64 elements per thread spilled
    # 112-192 B, so its pruning stops at 32 (kernels/norms.py _prune_residual_configs).
    "_residual_norm_fwd_kernel": 8,
    "_swiglu_fwd_kernel": 0,
    "_swiglu_bwd_kernel": 0,
    "_ce_partials_kernel": 0,
    "_ce_backward_kernel": 0,
}


@dataclass
class Case:
    """One compile: kernel, operand dtype label, arch, config and the launch's constexprs."""

    kernel: str
    dtype: str
    arch: int
    config: dict  # block sizes + num_warps + num_stages
    constexprs: dict
    signature: dict  # argument name -> Triton type ("*bf16", "i32", "constexpr")
    gemm: dict | None = None  # shared-memory estimate inputs for GEMMs (kernels/configs.py)
    variant: str = ""
    divisible: list = field(default_factory=list)  # argument indices Triton marks divisible by 16


@dataclass
class Result:
    case: Case
    ok: bool
    error: str = ""
    shared: int = 0
    registers: int = 0
    stack: int = 0
    wgmma: bool = False
    mma_sync: bool = False  # Ampere's mma.sync in the PTX
    tma: bool = False  # TMA bulk tensor copies (cp.async.bulk.tensor) in the PTX
    wgmma_e4m3: bool = False  # an FP8 (e4m3 x e4m3) wgmma in the PTX
    estimate: int | None = None
    seconds: float = 0.0
    limits: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- the cases


def _jit(fn):
    """The jitted function under any autotune/heuristics wrappers (an InterpretedFunction under
    TRITON_INTERPRET=1: enough to enumerate cases, not to compile them)."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    while not isinstance(fn, (triton.runtime.jit.JITFunction, InterpretedFunction)):
        fn = fn.fn
    return fn


def _kernel_fns() -> dict:
    """name -> JITFunction of every Triton kernel in kernels/."""
    import triton

    from meshtron.kernels import cross_entropy, gemm, grouped_gemm, linear_act_kernels, norms, swiglu

    fns = {}
    for module in (gemm, linear_act_kernels, grouped_gemm, cross_entropy, swiglu):
        for name in dir(module):
            obj = getattr(module, name)
            if name.endswith("_kernel") and hasattr(obj, "run"):
                fns[name] = _jit(obj)
    fns["_norm_fwd_kernel"] = triton.jit(norms._norm_fwd_kernel)
    fns["_norm_bwd_kernel"] = triton.jit(norms._norm_bwd_kernel)
    fns["_residual_norm_fwd_kernel"] = triton.jit(norms._residual_norm_fwd_kernel)
    return fns


def _config_dict(config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


# Shapes of the capture workload: every size a multiple of 16 (as real model sizes are), so
# the arguments specialise the way they do at run time (unit strides become constexpr 1,
# sizes and strides divisible by 16 get Triton's divisibility hint, pointers are aligned).
CAPTURE_ROWS, CAPTURE_IN, CAPTURE_OUT, CAPTURE_VOCAB, CAPTURE_EXPERTS = 64, 64, 64, 512, 8


def _describe(value):
    """How Triton specialises one launch argument: pointer type (+ alignment), int class or fp32."""
    import torch

    if isinstance(value, torch.Tensor):
        name = {
            torch.float32: "fp32",
            torch.bfloat16: "bf16",
            torch.float16: "fp16",
            torch.int32: "i32",
            torch.int64: "i64",
            torch.float8_e4m3fn: "fp8e4nv",
        }[value.dtype]
        return {"type": "*" + name, "aligned": value.data_ptr() % 16 == 0}
    if type(value).__name__ == "TensorDescriptor":  # its block shape is the config's (`_cases_of`)
        return {"type": "tensordesc", "dtype": _describe(value.base)["type"][1:]}
    if isinstance(value, bool) or value is None:
        return {"type": "constexpr", "value": value}
    if isinstance(value, int):
        return {"type": "i32", "one": value == 1, "div16": value % 16 == 0}
    if isinstance(value, float):
        return {"type": "fp32"}
    return {"type": "constexpr", "value": value}


def _workload(label: str) -> None:
    """Call every public Triton wrapper forward and backward as a model step at precision
    `label` feeds it (under the interpreter: small tensors shaped like real ones)."""
    import contextlib

    import torch

    from meshtron.kernels import cross_entropy, grouped_gemm, linear_act, norms, swiglu, tf32

    compute = {"fp32-ieee": None, "fp32-tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[label]
    tf32.set_tf32_mode("on" if label == "fp32-tf32" else "off")
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen) * 0.1).to(dtype).requires_grad_(True)

    autocast = torch.autocast("cpu", dtype=compute) if compute else contextlib.nullcontext()
    fed = compute or torch.float32  # the norms and the cross-entropy: fed the compute dtype too
    rows, k, n = CAPTURE_ROWS, CAPTURE_IN, CAPTURE_OUT
    with autocast:
        x = leaf(rows, k)
        outs = [
            linear_act.linear_gelu(x, leaf(n, k), leaf(n), backend="triton"),
            linear_act.linear_swiglu(x, leaf(n, k), leaf(n), leaf(n, k), leaf(n), backend="triton"),
            # the opt-in recompute mode: its backward kernels recompute the pre-activations
            linear_act.linear_gelu(x, leaf(n, k), leaf(n), backend="triton", recompute=True),
            linear_act.linear_swiglu(x, leaf(n, k), leaf(n), leaf(n, k), leaf(n), backend="triton", recompute=True),
        ]
        # the persistent forwards, as CUDA runs them: TMA descriptors for 16-bit operands (sm_90;
        # the pointer kernel for fp32), pointer loads (sm_80's), and the recompute mode's SAVE_PRE off
        for tma, recompute in ((True, False), (False, False), (True, True)):
            kw = dict(backend="triton", recompute=recompute, persistent=True, tma=tma)
            outs += [
                linear_act.linear_gelu(x, leaf(n, k), leaf(n), **kw),
                linear_act.linear_swiglu(x, leaf(n, k), leaf(n), leaf(n, k), None, **kw),
            ]
        sizes = torch.tensor([16, 0, 16, 0, 16, 0, 16, 0])
        outs.append(grouped_gemm.grouped_gemm(x, leaf(CAPTURE_EXPERTS, k, n), sizes, backend="triton"))
        # the persistent grouped GEMMs, as CUDA runs them: TMA forward / dx for 16-bit operands
        # (sm_90; the pointer kernel for fp32), pointer loads (sm_80's), the ordered dW
        for tma in (True, False):
            w = leaf(CAPTURE_EXPERTS, k, n)
            outs.append(grouped_gemm.grouped_gemm(x, w, sizes, backend="triton", persistent=True, tma=tma))
        outs.append(swiglu.swiglu(leaf(rows, n, dtype=fed), leaf(rows, n, dtype=fed), backend="triton"))
        for width in NORM_WIDTHS:
            h = leaf(16, width, dtype=fed)
            outs += [
                norms.layer_norm(h, leaf(width), leaf(width), 1e-5, backend="triton"),
                norms.rms_norm(h, leaf(width), 1e-5, backend="triton"),
            ]
            # The block's residual + norm2: the fp32 stream plus the branch output in the compute
            # dtype (as autocast feeds it), and a stream in the compute dtype (16-bit resident
            # weights); both outputs in the loss (HAS_DS), and once only the normed one.
            stream, branch = leaf(16, width), leaf(16, width, dtype=fed)
            outs += norms.residual_layer_norm(stream, branch, leaf(width), leaf(width), 1e-5, backend="triton")
            outs += norms.residual_rms_norm(leaf(16, width, dtype=fed), branch, leaf(width), 1e-5, backend="triton")
            outs.append(norms.residual_rms_norm(stream, branch, leaf(width), 1e-5, backend="triton")[1])
        logits = leaf(rows, CAPTURE_VOCAB, dtype=fed)
        target = torch.randint(0, CAPTURE_VOCAB, (rows,), generator=gen)
        outs.append(cross_entropy.fused_cross_entropy(logits.clone(), target, backend="triton"))
    sum(o.float().sum() for o in outs).backward()
    _gemm_workload(compute or torch.float32, gen)


def _gemm_workload(dtype, gen) -> None:
    """kernels/gemm.py's persistent GEMMs as the CUDA default runs them (the interpreter's
    default is the one-program-per-tile kernel the wrappers above reach): dW = g^T x into fp32
    (A transposed; a [32, 64] output in 32x32 tiles with 8 K tiles on the interpreter's 4 SMs,
    so split-K and its reduction run), x·Wᵀ (B transposed) and the dual dX, through TMA
    descriptors for 16-bit operands (the pointer kernel for fp32), and dW once with pointer
    loads in 16-bit (sm_80's path)."""
    import torch

    from meshtron.kernels import gemm

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.1).to(dtype)

    g, x, w = rand(128, 32), rand(128, 64), rand(32, 64)
    dw = torch.empty(32, 64)
    gemm.matmul(g.t(), x, dw, persistent=True, tma=True)
    gemm.matmul(g.t(), x, dw, persistent=True, tma=False)
    gemm.matmul(x[:64], w.t(), persistent=True, tma=True)
    gg = rand(64, 64)
    gemm.matmul(gg[:, :32], w, a2=gg[:, 32:], b2=rand(32, 64), persistent=True, tma=True)


def _fp8_workload() -> None:
    """The FP8 grouped GEMM (kernels/grouped_gemm.py `grouped_gemm_fp8`) as moe/fp8_experts.py
    feeds it under trainer.precision=fp8, forward and input gradient alike: e4m3 rows and the
    expert weight K-major ([G, K, N] viewed on [G, N, K] storage)."""
    import torch

    from meshtron.kernels import grouped_gemm

    gen = torch.Generator().manual_seed(0)
    rows, k, n, g = CAPTURE_ROWS, CAPTURE_IN, CAPTURE_OUT, CAPTURE_EXPERTS
    sizes = torch.tensor([16, 0, 16, 0, 16, 0, 16, 0])
    x = torch.randn(rows, k, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(g, n, k, generator=gen).to(torch.float8_e4m3fn).transpose(1, 2)
    grouped_gemm.grouped_gemm_fp8(x, torch.ones(rows), w, torch.ones(g, n), sizes)


def capture_launches() -> list[dict]:
    """Every autotuned kernel launch of `_workload` at each precision, as
    {"kernel", "dtype", "args": {name: description}, "constexprs"}; needs TRITON_INTERPRET=1."""
    from triton.runtime.autotuner import Autotuner

    launches = []
    original = Autotuner.run
    label = None

    def record(self, *args, **kwargs):
        named = dict(zip(self.arg_names, args))
        launches.append(
            {
                "kernel": self.base_fn.__name__,
                "dtype": label,
                "args": {k: _describe(v) for k, v in named.items()},
                "constexprs": {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")},
            }
        )
        return original(self, *args, **kwargs)

    Autotuner.run = record
    try:
        for label, _, _ in PRECISIONS:
            _workload(label)
        label = "fp8"
        _fp8_workload()
    finally:
        Autotuner.run = original
    return launches


def _captured() -> list[dict]:
    """`capture_launches` run in an interpreter subprocess (this process compiles)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        subprocess.run([sys.executable, "-m", "meshtron.kernels.aot", "--capture", path], env=env, check=True)
        with open(path) as f:
            return json.load(f)


def _candidates(kernel: str, launch: dict) -> tuple[list, dict | None]:
    """(GPU candidate configs, GEMM prune shape or None) of a kernel before the GEMM pruning
    (the norms' per-thread pruning already applied)."""
    from meshtron.kernels import cross_entropy, gemm, grouped_gemm, linear_act_kernels, norms, swiglu

    if kernel == "_splitk_reduce_kernel":
        return gemm._splitk_reduce_kernel.configs, None
    if kernel in ("_norm_fwd_kernel", "_norm_bwd_kernel", "_residual_norm_fwd_kernel"):
        fwd, bwd = norms.gpu_norm_configs()
        block_h = launch["constexprs"]["BLOCK_H"]
        if kernel == "_residual_norm_fwd_kernel":
            return norms._prune_residual_configs(fwd, {"BLOCK_H": block_h}), None
        if kernel == "_norm_fwd_kernel":
            return norms._prune_configs(fwd, {"BLOCK_H": block_h}), None
        return norms._prune_bwd_configs(bwd, {"BLOCK_H": block_h}), None
    if kernel.startswith("_ce_"):
        return cross_entropy.gpu_configs(), None
    if kernel.startswith("_swiglu_"):
        return swiglu.gpu_configs(), None
    if kernel in ("linear_gelu_grad_kernel", "linear_swiglu_grad_kernel"):
        return linear_act_kernels.elementwise_gpu_configs(), None
    module = (
        grouped_gemm if kernel.startswith("_grouped") else gemm if kernel.startswith("_matmul") else linear_act_kernels
    )
    shape = dict(getattr(module, kernel).early_config_prune.gemm_shape)
    if kernel in ("_matmul_persistent_kernel", "_matmul_tma_kernel"):
        candidates = gemm.persistent_configs()
    elif kernel.startswith("linear_") and kernel.endswith(("_persistent_kernel", "_tma_kernel")):
        # the persistent linear+activation forwards
        candidates = linear_act_kernels.persistent_gpu_configs(swiglu=kernel.startswith("linear_swiglu"))
    elif kernel == "_grouped_gemm_kernel":
        candidates = grouped_gemm.gpu_gemm_configs()
    elif kernel == "_grouped_gemm_dw_kernel":
        candidates = grouped_gemm.gpu_dw_configs()
    elif kernel in ("_grouped_gemm_persistent_kernel", "_grouped_gemm_tma_kernel"):
        candidates = grouped_gemm.gpu_persistent_configs()
    elif kernel == "_grouped_gemm_dw_ordered_kernel":
        candidates = grouped_gemm.gpu_dw_ordered_configs()
    elif kernel == "_grouped_gemm_fp8_kernel":
        candidates = grouped_gemm.gpu_fp8_configs()
    else:
        candidates = gemm.gpu_configs(dual=shape["b_tiles"] == 2)
    return candidates, shape


def _variant(launch: dict, compute: str) -> str:
    """What distinguishes launches of one kernel at one precision: flags and mixed dtypes."""
    flags = [
        f"{k}={v}"
        for k, v in sorted(launch["constexprs"].items())
        if k not in ("CAST_F32", "CAST_FP32", "PRECISION", "INPUT_PRECISION")
    ]
    mixed = [
        f"{k}:{d['type'][1:]}"
        for k, d in sorted(launch["args"].items())
        if d["type"].startswith("*") and d["type"][1:] != compute
    ]
    unit = [k for k, d in sorted(launch["args"].items()) if d["type"] == "i32" and d["one"]]
    return " ".join(flags + mixed + ([f"unit={','.join(unit)}"] if unit else []))


def _cases_of(launch: dict, arch: int) -> list[Case]:
    """The compile cases of one captured launch on `arch`: one per config kept after pruning,
    its arguments specialised as Triton does at run time."""
    from meshtron.kernels import configs as cfgs

    kernel, label = launch["kernel"], launch["dtype"]
    if arch not in KERNEL_ARCHS.get(kernel, ARCHS):
        return []
    compute = {**{lbl: ctype for lbl, ctype, _ in PRECISIONS}, "fp8": "fp8"}[label]
    candidates, shape = _candidates(kernel, launch)
    if shape is None:
        label = compute  # no dot: the fp32 launches are one whatever the TF32 policy
    base = dict(launch["constexprs"])
    for flag in ("CAST_F32", "CAST_FP32"):
        if flag in base:
            base[flag] = False  # the interpreter's fp32 cast: never on a GPU
    variant = _variant(launch, compute)
    gemm_args = elem = None
    if shape is not None:
        elem = {"fp32": 4, "fp8": 1}.get(compute, 2)
        gemm_args = _gemm_prune_args(shape, base)
        candidates = _prune_for_arch(candidates, arch, elem, gemm_args, fma=label == "fp32-ieee")
    if not candidates:
        return [Case(kernel, label, arch, {}, {}, {}, variant=variant)]  # reported as "no config"
    cases = []
    for config in candidates:
        constexprs = {**base, **config.kwargs}
        signature, divisible = _specialise(kernel, launch, constexprs)
        gemm = None
        if gemm_args is not None:
            dims = (gemm_args["a_tiles"], gemm_args["b_tiles"], gemm_args["dims"])
            gemm = {"estimate": cfgs.config_shared_bytes(config, elem, *dims)}
        cases.append(
            Case(
                kernel,
                label,
                arch,
                _config_dict(config),
                constexprs,
                signature,
                gemm=gemm,
                variant=variant,
                divisible=divisible,
            )
        )
    return cases


def _gemm_prune_args(shape: dict, constexprs: dict) -> dict:
    """`prune_gemm_configs`' operand description of a GEMM kernel's launch: its A/B tile counts
    (doubled when the launch's dual-operand flag is on), accumulators and dims."""
    factor = 2 if shape["dual"] and constexprs.get(shape["dual"]) else 1
    return dict(
        a_tiles=shape["a_tiles"] * factor,
        b_tiles=shape["b_tiles"] * factor,
        accumulators=shape["accumulators"],
        dims=shape["dims"],
    )


def _prune_for_arch(candidates: list, arch: int, elem: int, gemm_args: dict, fma: bool) -> list:
    """The GEMM configs that fit `arch`'s shared memory and registers; none when the pruning
    refuses every one (reported as "no config")."""
    from meshtron.kernels import configs as cfgs

    try:
        return cfgs.prune_gemm_configs(candidates, cfgs.ARCH_LIMITS[arch], elem, **gemm_args, fma=fma)
    except RuntimeError:
        return []


def _specialise(kernel: str, launch: dict, constexprs: dict) -> tuple[dict, list]:
    """(signature, divisible argument indices) of a launch under one config, as Triton
    specialises at run time; adds the arguments it turns constexpr to `constexprs`."""
    fn = _kernel_fns()[kernel]
    signature, divisible = {}, []
    # `do_not_specialize` arguments: never constexpr 1 nor hinted divisible (an interpreted
    # function, when the capture runs in this process, does not say: none then)
    generic = {fn.arg_names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ()) or ()}
    for i, name in enumerate(fn.arg_names):
        desc = launch["args"].get(name)
        if name in constexprs:
            signature[name] = "constexpr"
        elif desc is None:
            raise RuntimeError(f"{kernel}: argument {name} was not captured")
        elif desc["type"] == "constexpr":  # None (an unused operand) or a bool passed positionally
            signature[name] = "constexpr"
            constexprs[name] = desc["value"]
        elif desc["type"] == "tensordesc":  # block shape of this config (kernels/gemm.py)
            block = gemm_blocks(kernel, constexprs)[name]
            signature[name] = f"tensordesc<{desc['dtype']}[{', '.join(map(str, block))}]>"
        elif name in generic:
            signature[name] = desc["type"]
        elif desc["type"] == "i32" and desc["one"]:
            signature[name] = "constexpr"
            constexprs[name] = 1  # Triton specialises ints equal to 1
        else:
            signature[name] = desc["type"]
            if desc.get("aligned") or desc.get("div16"):
                divisible.append(i)
    return signature, divisible


def gemm_blocks(kernel: str, constexprs: dict) -> dict:
    """Descriptor argument -> block shape of a TMA kernel under a config's constexprs."""
    from meshtron.kernels import gemm, grouped_gemm, linear_act_kernels

    blocks = {
        "_matmul_tma_kernel": gemm.tma_block_shapes,
        "_grouped_gemm_tma_kernel": grouped_gemm.tma_block_shapes,
        "linear_gelu_tma_kernel": linear_act_kernels.tma_block_shapes,
        "linear_swiglu_tma_kernel": linear_act_kernels.tma_block_shapes,
    }
    return blocks[kernel](constexprs)


def all_cases(archs=ARCHS, launches: list[dict] | None = None) -> list[Case]:
    """Every (kernel, launch variant, dtype, arch, kept config) case of the captured launches."""
    launches = _captured() if launches is None else launches
    unique = {}
    for arch in archs:
        for launch in launches:
            for case in _cases_of(launch, arch):
                key = json.dumps(
                    [case.kernel, case.dtype, case.arch, case.config, case.constexprs, case.signature], sort_keys=True
                )
                unique.setdefault(key, case)
    return list(unique.values())


def risk(case: Case) -> float:
    """How likely a case is to break a limit: a GEMM's shared-memory estimate, otherwise the
    elements per thread of its widest tile."""
    if case.gemm is not None:
        return case.gemm["estimate"]
    c = case.constexprs
    width = c.get("BLOCK_M", 1) * c.get("BLOCK_H", 1) * c.get("BLOCK_V", 1)
    return width / (32 * case.config.get("num_warps", 4)) if case.config else 0.0


def select(cases: list[Case], sample: int, seed: int) -> list[Case]:
    """Per (kernel, dtype, arch): the riskiest kept case (`risk`), plus `sample` further cases
    (other configs and launch variants) drawn with `seed`."""
    chosen, rest = {}, []
    for case in cases:
        key = (case.kernel, case.dtype, case.arch)
        best = chosen.get(key)
        if best is None or risk(case) > risk(best):
            if best is not None:
                rest.append(best)
            chosen[key] = case
        else:
            rest.append(case)
    rng = random.Random(seed)
    return list(chosen.values()) + rng.sample(rest, min(sample, len(rest)))


# --------------------------------------------------------------------------- compiling


def _bin(name: str) -> str:
    import triton.backends.nvidia as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", name)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread of the kernel in `cubin`, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [_bin("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def compile_case(case: Case) -> Result:
    """Compile one case for its arch; never raises (errors are part of the result)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from meshtron.kernels import configs as cfgs

    limits = asdict(cfgs.ARCH_LIMITS[case.arch])
    estimate = (case.gemm or {}).get("estimate")
    if not case.config:
        return Result(case, False, "no config left after pruning", limits=limits)
    start = time.time()
    try:
        fn = _kernel_fns()[case.kernel]
        options = {"num_warps": case.config["num_warps"], "num_stages": case.config["num_stages"]}
        attrs = {(i,): [["tt.divisibility", 16]] for i in case.divisible}
        kernel = triton.compile(
            ASTSource(fn=fn, signature=case.signature, constexprs=case.constexprs, attrs=attrs),
            target=GPUTarget("cuda", case.arch, 32),
            options=options,
        )
        regs, stack = _resource_usage(kernel.asm["cubin"])
        ptx = kernel.asm["ptx"]
        return Result(
            case,
            True,
            shared=int(kernel.metadata.shared),
            registers=regs,
            stack=stack,
            wgmma="wgmma" in ptx,
            mma_sync="mma.sync" in ptx,
            tma="cp.async.bulk.tensor" in ptx,
            wgmma_e4m3=re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx) is not None,
            estimate=estimate,
            seconds=time.time() - start,
            limits=limits,
        )
    except Exception as exc:  # noqa: BLE001 - a compile error is a finding, reported by check()
        return Result(
            case,
            False,
            f"{type(exc).__name__}: {str(exc)[:300]}",
            estimate=estimate,
            seconds=time.time() - start,
            limits=limits,
        )


def compile_all(cases: list[Case], workers: int = 2) -> list[Result]:
    """Compile the cases in `workers` processes (slowest first, for a short tail)."""
    order = sorted(cases, key=lambda c: (c.dtype != "fp32-ieee", -risk(c)))
    if workers <= 1:
        return [compile_case(c) for c in order]
    results = []
    with futures.ProcessPoolExecutor(workers) as pool:
        for result in pool.map(compile_case, order, chunksize=1):
            c = result.case
            print(
                f"{c.kernel}{'/' + c.variant if c.variant else ''} {c.dtype} sm_{c.arch} {c.config}: "
                f"{'ok' if result.ok else result.error[:80]} shared={result.shared} est={result.estimate} "
                f"regs={result.registers} stack={result.stack} wgmma={result.wgmma} mma.sync={result.mma_sync} "
                f"tma={result.tma} e4m3={result.wgmma_e4m3} {result.seconds:.1f}s",
                file=sys.stderr,
                flush=True,
            )
            results.append(result)
    return results


# --------------------------------------------------------------------------- checks


def check(results: list[Result]) -> list[str]:
    """Every failure found, one line each (empty when all is well)."""
    failures = []
    for r in results:
        c = r.case
        where = f"{c.kernel}{'/' + c.variant if c.variant else ''} {c.dtype} sm_{c.arch} {c.config}"
        if not r.ok:
            failures.append(f"{where}: {r.error}")
            continue
        if r.shared > r.limits["shared_bytes"]:
            failures.append(f"{where}: {r.shared} B shared > {r.limits['shared_bytes']} B (pruning let it through)")
        if r.estimate is not None and r.estimate < r.shared:
            failures.append(f"{where}: shared-memory estimate {r.estimate} B < compiled {r.shared} B")
        budget = SPILL_BUDGET.get(c.kernel, 0)
        if r.stack > budget:
            failures.append(f"{where}: {r.stack} B stack frame > budget {budget} B ({r.registers} registers)")
        if c.arch >= 90 and c.gemm is not None and c.dtype in ("bf16", "fp16") and not r.wgmma:
            failures.append(f"{where}: 16-bit GEMM PTX for sm_{c.arch} has no wgmma")
        if c.arch < 90 and c.gemm is not None and c.dtype in ("bf16", "fp16") and not r.mma_sync:
            failures.append(f"{where}: 16-bit GEMM PTX for sm_{c.arch} has no mma.sync")
        if c.arch >= 90 and c.kernel in FP8_KERNELS and not r.wgmma_e4m3:
            failures.append(f"{where}: FP8 GEMM PTX for sm_{c.arch} has no e4m3 wgmma")
        if c.arch >= 90 and c.kernel in TMA_KERNELS and not r.tma:
            failures.append(f"{where}: PTX for sm_{c.arch} has no TMA bulk copy (cp.async.bulk.tensor)")
    return failures


def summary(results: list[Result]) -> dict:
    """Counts per (kernel, dtype, arch) and the worst figures, for the JSON report."""
    table = {}
    for r in results:
        key = f"{r.case.kernel} {r.case.dtype} sm_{r.case.arch}"
        row = table.setdefault(key, {"cases": 0, "max_shared": 0, "max_stack": 0, "max_registers": 0})
        row["cases"] += 1
        row["max_shared"] = max(row["max_shared"], r.shared)
        row["max_stack"] = max(row["max_stack"], r.stack)
        row["max_registers"] = max(row["max_registers"], r.registers)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="meshtron-aot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--all", action="store_true", help="compile every kept config")
    parser.add_argument("--sample", type=int, default=24, help="extra cases beyond one per (kernel, dtype, arch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write every case's result here")
    parser.add_argument("--launches", help="reuse launches captured by --capture (JSON) instead of capturing")
    parser.add_argument("--capture", help="capture the launches to this JSON file and stop (needs TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.capture:
        with open(args.capture, "w") as f:
            json.dump(capture_launches(), f)
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("run with TRITON_INTERPRET unset: the interpreter replaces the jitted kernels")
    launches = None
    if args.launches:
        with open(args.launches) as f:
            launches = json.load(f)
    cases = all_cases(launches=launches)
    chosen = cases if args.all else select(cases, args.sample, args.seed)
    start = time.time()
    results = compile_all(chosen, args.workers)
    failures = check(results)
    every = {(c.kernel, c.dtype, c.arch) for c in cases}
    missing = sorted(every - {(r.case.kernel, r.case.dtype, r.case.arch) for r in results if r.ok})
    import triton

    report = {
        "triton": triton.__version__,  # the compiler these results come from
        "cases_total": len(cases),
        "compiled": len(results),
        "seconds": round(time.time() - start, 1),
        "failures": failures,
        "missing": [list(m) for m in missing],
        "per_kernel": summary(results),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "results": [asdict(r) for r in results]}, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "per_kernel"}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
