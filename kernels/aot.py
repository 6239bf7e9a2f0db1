"""Ahead-of-time compile check of every Triton kernel for Ampere (sm_80) and Hopper (sm_90),
without a GPU: Triton compiles for a CUDA target on any machine.

    python -m kernels.aot                       # every (kernel, dtype, arch) once + a seeded sample
    python -m kernels.aot --all                 # every config the per-device pruning keeps
    python -m kernels.aot --json out.json       # also write the per-case results

A *case* is one kernel compiled with one config, one operand dtype (as the wrappers feed it:
fp32 with IEEE or TF32 dots, bf16 and fp16 compute with fp32 main weights) for one arch.
The configs are each kernel's GPU candidates after the same per-device pruning the
autotuner applies (kernels/configs.py for the GEMMs, the norms' own per-thread pruning).
Each compiled case reports its shared memory (Triton's metadata), registers and stack frame
(cuobjdump of the cubin Triton produced) and whether a 16-bit sm_90 GEMM uses `wgmma`.

`check(results)` lists the failures: a compile error, a kept config over the arch's shared
memory, a GEMM whose shared-memory estimate is below the compiled size (the pruning bound
would be unsafe), a (kernel, dtype, arch) left with no config, a 16-bit sm_90 GEMM without
wgmma, and a stack frame over the kernel's stated `SPILL_BUDGET`.

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
PRECISIONS = (("fp32-ieee", "fp32", "ieee"), ("fp32-tf32", "fp32", "tf32"), ("bf16", "bf16", "ieee"),
              ("fp16", "fp16", "ieee"))
ELEMENTWISE_DTYPES = ("fp32", "bf16", "fp16")
NORM_WIDTHS = (2048, 8192)  # gpt_1b's hidden size, and a wide model's

# Stack-frame bytes per thread each kernel may use on the configs it can pick (spills or
# local arrays). The fp32 IEEE GEMMs run on CUDA cores, where big tiles need many registers:
# the pruning keeps them within these budgets; everything else must not spill at all.
SPILL_BUDGET = {
    "_linear_gelu_fwd_kernel": 0,
    "_linear_gelu_bwd_kernel": 0,
    "_linear_swiglu_fwd_kernel": 0,
    "_linear_swiglu_bwd_kernel": 0,
    "_matmul_kernel": 0,
    "_grouped_gemm_kernel": 0,
    "_grouped_gemm_dw_kernel": 0,
    "_norm_fwd_kernel": 0,
    "_norm_bwd_kernel": 0,
    "_ce_partials_kernel": 0,
    "_ce_backward_kernel": 0,
}


@dataclass
class Case:
    """One compile: kernel, operand dtype label, arch, config and the launch's constexprs."""

    kernel: str
    dtype: str
    arch: int
    config: dict            # block sizes + num_warps + num_stages
    constexprs: dict
    signature: dict         # argument name -> Triton type ("*bf16", "i32", "constexpr")
    gemm: dict | None = None  # shared-memory estimate inputs for GEMMs (kernels/configs.py)
    variant: str = ""


@dataclass
class Result:
    case: Case
    ok: bool
    error: str = ""
    shared: int = 0
    registers: int = 0
    stack: int = 0
    wgmma: bool = False
    estimate: int | None = None
    seconds: float = 0.0
    limits: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- the cases


def _jit(fn):
    """The JITFunction under any autotune/heuristics wrappers."""
    import triton
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn
    return fn


def _kernel_fns() -> dict:
    """name -> JITFunction of every Triton kernel in kernels/."""
    import triton
    from kernels import cross_entropy, grouped_gemm, linear_act, norms
    fns = {}
    for module in (linear_act, grouped_gemm, cross_entropy):
        for name in dir(module):
            obj = getattr(module, name)
            if name.endswith("_kernel") and hasattr(obj, "run"):
                fns[name] = _jit(obj)
    fns["_norm_fwd_kernel"] = triton.jit(norms._norm_fwd_kernel)
    fns["_norm_bwd_kernel"] = triton.jit(norms._norm_bwd_kernel)
    return fns


NORM_POINTERS = {"X", "W", "B", "Y", "Mean", "Rstd", "DY", "DX", "DW_part", "DB_part"}


def _signature(fn, pointer_types: dict, constexprs: dict, default_pointer: str) -> dict:
    """Triton types of `fn`'s arguments: pointers `default_pointer` unless `pointer_types`
    says otherwise, `eps` fp32, other scalars i32, constexprs marked."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = pointer_types[name]
        elif name.endswith("_ptr") or name in NORM_POINTERS:
            sig[name] = default_pointer
        elif name == "eps":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _config_dict(config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _gemm_cases(arch: int) -> list[Case]:
    """The GEMM kernels of linear_act and grouped_gemm, for every precision and kept config."""
    from kernels import configs as cfgs
    from kernels import grouped_gemm, linear_act
    fns = _kernel_fns()
    limits = cfgs.ARCH_LIMITS[arch]
    cases = []
    # (kernel, variant, candidate configs, pointer dtypes given the compute type, constexprs, prune shape)
    def la(dual):
        return linear_act.gpu_configs(dual)
    specs = [
        ("_linear_gelu_fwd_kernel", "", la(False), lambda c: {"b_ptr": "*fp32"},
         dict(HAS_BIAS=True, APPROX_TANH=True), dict(a_tiles=1, b_tiles=1)),
        ("_linear_gelu_bwd_kernel", "", la(False), lambda c: {"b_ptr": "*fp32"},
         dict(HAS_BIAS=True, APPROX_TANH=True), dict(a_tiles=1, b_tiles=1)),
        ("_linear_swiglu_fwd_kernel", "", la(True), lambda c: {"bg_ptr": "*fp32", "bu_ptr": "*fp32"},
         dict(HAS_BG=True, HAS_BU=True), dict(a_tiles=1, b_tiles=2, accumulators=2)),
        ("_linear_swiglu_bwd_kernel", "", la(True), lambda c: {"bg_ptr": "*fp32", "bu_ptr": "*fp32"},
         dict(HAS_BG=True, HAS_BU=True), dict(a_tiles=1, b_tiles=2, accumulators=2)),
        ("_matmul_kernel", "dx", la(False), lambda c: {}, dict(DUAL=False), dict(a_tiles=1, b_tiles=1)),
        ("_matmul_kernel", "dx-dual", la(False), lambda c: {}, dict(DUAL=True), dict(a_tiles=2, b_tiles=2)),
        ("_matmul_kernel", "dw", la(False), lambda c: {"c_ptr": "*fp32"}, dict(DUAL=False),
         dict(a_tiles=1, b_tiles=1)),
        ("_grouped_gemm_kernel", "", grouped_gemm.gpu_gemm_configs(), lambda c: {"sizes_ptr": "*i32"},
         dict(G_BLOCK=8), dict(a_tiles=1, b_tiles=1)),
        ("_grouped_gemm_dw_kernel", "", grouped_gemm.gpu_dw_configs(),
         lambda c: {"sizes_ptr": "*i32", "dw_ptr": "*fp32"}, dict(G_BLOCK=8),
         dict(a_tiles=1, b_tiles=1, dims=("BLOCK_K", "BLOCK_N", "BLOCK_M"))),
    ]
    for kernel, variant, candidates, pointers, flags, shape in specs:
        fn = fns[kernel]
        precision_arg = "INPUT_PRECISION" if "grouped" in kernel else "PRECISION"
        cast_arg = "CAST_FP32" if "grouped" in kernel else "CAST_F32"
        for label, ctype, precision in PRECISIONS:
            elem = 4 if ctype == "fp32" else 2
            try:
                kept = cfgs.prune_gemm_configs(candidates, limits, elem, **shape)
            except RuntimeError:
                kept = []
            if not kept:
                cases.append(Case(kernel, label, arch, {}, {}, {}, variant=variant))  # reported as "no config"
            for config in kept:
                constexprs = {**flags, cast_arg: False, precision_arg: precision, **config.kwargs}
                ptrs = pointers(ctype)
                sig = _signature(fn, ptrs, constexprs, "*" + ctype)
                estimate = cfgs.config_shared_bytes(config, elem, shape["a_tiles"], shape["b_tiles"],
                                                    shape.get("dims", cfgs.GEMM_DIMS))
                cases.append(Case(kernel, label, arch, _config_dict(config), constexprs, sig,
                                  gemm={"estimate": estimate}, variant=variant))
    return cases


def _norm_cases(arch: int) -> list[Case]:
    import triton
    from kernels import norms
    fns = _kernel_fns()
    cases = []
    fwd_cfgs, bwd_cfgs = norms.gpu_norm_configs()
    for kernel, candidates in (("_norm_fwd_kernel", fwd_cfgs), ("_norm_bwd_kernel", bwd_cfgs)):
        fn = fns[kernel]
        for width in NORM_WIDTHS:
            block_h = triton.next_power_of_2(width)
            for dtype in ELEMENTWISE_DTYPES:
                for config in norms._prune_configs(candidates, {"BLOCK_H": block_h}):
                    constexprs = dict(IS_RMS=False, HAS_BIAS=True, BLOCK_H=block_h, **config.kwargs)
                    ptrs = {"W": "*fp32", "B": "*fp32", "Mean": "*fp32", "Rstd": "*fp32",
                            "DW_part": "*fp32", "DB_part": "*fp32"}
                    sig = _signature(fn, ptrs, constexprs, "*" + dtype)
                    cases.append(Case(kernel, dtype, arch, _config_dict(config), constexprs, sig,
                                      variant=f"H{width}"))
    return cases


def _ce_cases(arch: int) -> list[Case]:
    from kernels import cross_entropy
    fns = _kernel_fns()
    cases = []
    for kernel in ("_ce_partials_kernel", "_ce_backward_kernel"):
        fn = fns[kernel]
        for dtype in ELEMENTWISE_DTYPES:
            for config in cross_entropy.gpu_configs():
                constexprs = dict(config.kwargs)
                ptrs = {"target_ptr": "*i64", "max_ptr": "*fp32", "sumexp_ptr": "*fp32", "tgt_logit_ptr": "*fp32",
                        "lse_ptr": "*fp32", "dloss_ptr": "*fp32"}
                sig = _signature(fn, ptrs, constexprs, "*" + dtype)
                cases.append(Case(kernel, dtype, arch, _config_dict(config), constexprs, sig))
    return cases


def all_cases(archs=ARCHS) -> list[Case]:
    """Every (kernel, dtype, arch, kept config) case."""
    return [c for arch in archs for c in _gemm_cases(arch) + _norm_cases(arch) + _ce_cases(arch)]


def select(cases: list[Case], sample: int, seed: int) -> list[Case]:
    """Per (kernel, variant, dtype, arch): the kept config with the largest shared-memory
    estimate (the riskiest; the first otherwise), plus `sample` further cases drawn with `seed`."""
    chosen, rest = {}, []
    for case in cases:
        key = (case.kernel, case.variant, case.dtype, case.arch)
        best = chosen.get(key)
        weight = (case.gemm or {}).get("estimate", 0)
        if best is None or weight > (best.gemm or {}).get("estimate", 0):
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
        out = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1


def compile_case(case: Case) -> Result:
    """Compile one case for its arch; never raises (errors are part of the result)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels import configs as cfgs
    limits = asdict(cfgs.ARCH_LIMITS[case.arch])
    estimate = (case.gemm or {}).get("estimate")
    if not case.config:
        return Result(case, False, "no config left after pruning", limits=limits)
    start = time.time()
    try:
        fn = _kernel_fns()[case.kernel]
        options = {"num_warps": case.config["num_warps"], "num_stages": case.config["num_stages"]}
        # Pointers are 16-byte aligned at run time (torch allocations); Triton specialises on it.
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if case.signature.get(name, "").startswith("*")}
        kernel = triton.compile(ASTSource(fn=fn, signature=case.signature, constexprs=case.constexprs, attrs=attrs),
                                target=GPUTarget("cuda", case.arch, 32), options=options)
        regs, stack = _resource_usage(kernel.asm["cubin"])
        wgmma = "wgmma" in kernel.asm["ptx"]
        return Result(case, True, shared=int(kernel.metadata.shared), registers=regs, stack=stack, wgmma=wgmma,
                      estimate=estimate, seconds=time.time() - start, limits=limits)
    except Exception as exc:  # noqa: BLE001 - a compile error is a finding, reported by check()
        return Result(case, False, f"{type(exc).__name__}: {str(exc)[:300]}", estimate=estimate,
                      seconds=time.time() - start, limits=limits)


def compile_all(cases: list[Case], workers: int = 2) -> list[Result]:
    """Compile the cases in `workers` processes (slowest first, for a short tail)."""
    order = sorted(cases, key=lambda c: (c.dtype != "fp32-ieee", -(c.gemm or {}).get("estimate", 0)))
    if workers <= 1:
        return [compile_case(c) for c in order]
    with futures.ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_case, order, chunksize=1))


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="compile every kept config")
    parser.add_argument("--sample", type=int, default=24, help="extra cases beyond one per (kernel, dtype, arch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write every case's result here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("run with TRITON_INTERPRET unset: the interpreter replaces the jitted kernels")
    cases = all_cases()
    chosen = cases if args.all else select(cases, args.sample, args.seed)
    start = time.time()
    results = compile_all(chosen, args.workers)
    failures = check(results)
    report = {"cases_total": len(cases), "compiled": len(results), "seconds": round(time.time() - start, 1),
              "failures": failures, "per_kernel": summary(results)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "results": [asdict(r) for r in results]}, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "per_kernel"}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
