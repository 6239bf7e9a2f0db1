"""Every Triton kernel compiles for Ampere (sm_80) and Hopper (sm_90) without a GPU
(kernels/aot.py): each (kernel, dtype, arch) at least once with its riskiest kept config plus
a seeded sample, checked for shared memory, the pruning bound, spills, wgmma (16-bit GEMMs on
sm_90), mma.sync (16-bit GEMMs on sm_80), an e4m3 wgmma (the FP8 grouped GEMM, sm_90 only) and
TMA bulk copies (the TMA GEMMs, sm_90 only). The
checks themselves are proven to fail on synthetic results, and the per-device pruning on
known configs (the Hopper-sized GEMM tiles kept on sm_90 only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from meshtron.kernels import aot, configs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
A100, H100 = configs.ARCH_LIMITS[80], configs.ARCH_LIMITS[90]


def _config(bm, bn, bk, warps, stages):
    import triton

    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The wrappers' kernel launches at every precision, captured once under the interpreter."""
    path = tmp_path_factory.mktemp("aot") / "launches.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(
        [sys.executable, "-m", "meshtron.kernels.aot", "--capture", str(path)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=900,
    )
    return path


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_kernel_compiles_for_sm80_and_sm90_within_limits(tmp_path, launches):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    seed = os.environ.get("MESHTRON_AOT_SEED", "0")
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtron.kernels.aot",
            "--seed",
            seed,
            "--sample",
            "12",
            "--launches",
            str(launches),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1450,
    )
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [], "\n".join(report["failures"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["missing"] == [], f"(kernel, dtype, arch) never compiled: {report['missing']}"
    compiled = {(r["case"]["kernel"], r["case"]["dtype"], r["case"]["arch"]) for r in report["results"]}
    kernels = {k for k, _, _ in compiled}
    assert kernels == set(aot.SPILL_BUDGET), kernels ^ set(aot.SPILL_BUDGET)
    for kernel in kernels:
        dtypes = {d for k, d, _ in compiled if k == kernel}
        if kernel in aot.FP8_KERNELS:  # e4m3 operands only, sm_90 only
            assert dtypes == {"fp8"}, (kernel, dtypes)
            assert {a for k, _, a in compiled if k == kernel} == set(aot.KERNEL_ARCHS[kernel])
            continue
        sixteen_bit_only = kernel in aot.TMA_KERNELS
        assert {"bf16", "fp16"} <= dtypes and (sixteen_bit_only or dtypes & {"fp32", "fp32-ieee"}), (kernel, dtypes)
        assert {a for k, _, a in compiled if k == kernel} == set(aot.KERNEL_ARCHS.get(kernel, (80, 90)))
    # 16-bit GEMMs use wgmma on Hopper, mma.sync on Ampere, the TMA kernels TMA bulk copies
    # (check() fails otherwise): make sure some of each were compiled.
    results = report["results"]
    assert any(r["wgmma"] for r in results if r["case"]["arch"] == 90 and r["case"]["dtype"] == "bf16")
    assert any(r["mma_sync"] for r in results if r["case"]["arch"] == 80 and r["case"]["dtype"] == "bf16")
    assert any(r["tma"] for r in results if r["case"]["kernel"] in aot.TMA_KERNELS)
    assert any(r["wgmma_e4m3"] for r in results if r["case"]["kernel"] in aot.FP8_KERNELS)


def _result(
    kernel="_matmul_kernel",
    dtype="bf16",
    arch=90,
    shared=1024,
    estimate=2048,
    stack=0,
    wgmma=True,
    ok=True,
    gemm=True,
    mma_sync=True,
    tma=True,
    wgmma_e4m3=False,
):
    case = aot.Case(
        kernel,
        dtype,
        arch,
        {"BLOCK_M": 64, "num_warps": 4, "num_stages": 3},
        {},
        {},
        gemm={"estimate": estimate} if gemm else None,
    )
    limits = {"arch": arch, "shared_bytes": configs.ARCH_LIMITS[arch].shared_bytes}
    return aot.Result(
        case,
        ok,
        "" if ok else "CompilationError: boom",
        shared=shared,
        stack=stack,
        wgmma=wgmma,
        mma_sync=mma_sync,
        tma=tma,
        wgmma_e4m3=wgmma_e4m3,
        estimate=estimate if gemm else None,
        limits=limits,
    )


def test_check_accepts_a_clean_result_and_flags_each_defect():
    assert aot.check([_result()]) == []
    cases = {
        "compile error": _result(ok=False),
        "over shared memory": _result(arch=80, shared=A100.shared_bytes + 1, estimate=A100.shared_bytes + 1),
        "estimate below compiled": _result(shared=4096, estimate=2048),
        "spills": _result(stack=64),
        "no wgmma": _result(wgmma=False),
        "no mma.sync": _result(arch=80, wgmma=False, mma_sync=False),
        "no TMA copy": _result(kernel="_matmul_tma_kernel", tma=False),
        "no e4m3 wgmma": _result(kernel="_grouped_gemm_fp8_kernel", dtype="fp8", wgmma_e4m3=False),
    }
    for defect, result in cases.items():
        assert len(aot.check([result])) == 1, defect
    # wgmma is required of 16-bit GEMMs on sm_90 only, mma.sync of 16-bit GEMMs on sm_80 only,
    # TMA copies of the TMA kernels on sm_90 only.
    assert aot.check([_result(kernel="_grouped_gemm_fp8_kernel", dtype="fp8", wgmma_e4m3=True)]) == []
    assert (
        aot.check(
            [
                _result(arch=80, wgmma=False, tma=False),
                _result(dtype="fp32-tf32", wgmma=False, mma_sync=False),
                _result(arch=80, dtype="fp32-ieee", wgmma=False, mma_sync=False),
                _result(mma_sync=False, tma=False),
                _result(kernel="_norm_fwd_kernel", gemm=False, wgmma=False, mma_sync=False),
                _result(kernel="_matmul_tma_kernel", arch=80, wgmma=False, tma=False),
            ]
        )
        == []
    )
    empty = aot.Case("_matmul_kernel", "bf16", 80, {}, {}, {})
    assert "no config" in aot.check([aot.compile_case(empty)])[0]


def test_pruning_drops_configs_over_the_device_and_keeps_the_rest():
    big = _config(128, 128, 64, 8, 3)  # dual fp32: 3 x (2*128*64 + 2*64*128) * 4 B = 384 KiB
    small = _config(64, 64, 32, 4, 3)
    sync = configs.SYNC_BYTES  # the pipeline's barriers
    assert configs.config_shared_bytes(big, 4, 2, 2) == 3 * (2 * 128 * 64 + 2 * 64 * 128) * 4 + sync
    assert configs.prune_gemm_configs([big, small], H100, 4, 2, 2) == [small]
    assert configs.prune_gemm_configs([big, small], H100, 2, 1, 1) == [big, small]  # 96 KiB in bf16
    with pytest.raises(RuntimeError, match="no GEMM config fits sm_80"):
        configs.prune_gemm_configs([big], A100, 4, 2, 2)
    # IEEE fp32 dots (CUDA cores) take only thin K tiles, tensor-core dots only wide ones.
    thin = _config(128, 128, 16, 8, 3)
    assert configs.prune_gemm_configs([big, small, thin], H100, 4, 1, 1, fma=True) == [thin]
    assert thin not in configs.prune_gemm_configs([big, small, thin], H100, 4, 1, 1)
    # Accumulator registers: 128x128 on 4 warps is 128 per thread: Hopper 16-bit only.
    wide = _config(128, 128, 32, 4, 3)
    assert configs.prune_gemm_configs([wide, small], H100, 2, 1, 1) == [wide, small]
    assert configs.prune_gemm_configs([wide, small], A100, 2, 1, 1) == [small]
    assert configs.prune_gemm_configs([wide, small], H100, 4, 1, 1) == [small]
    # The dW roles: rows BLOCK_K, reduction BLOCK_M.
    dw = _config(32, 64, 128, 4, 3)
    assert (
        configs.config_shared_bytes(dw, 2, dims=("BLOCK_K", "BLOCK_N", "BLOCK_M"))
        == 3 * (128 * 32 + 32 * 64) * 2 + sync
    )


def test_hopper_sized_tiles_kept_on_sm90_only():
    """The persistent GEMMs' 128x256x64, 256x128x64 and 128x128x128 tiles on 8 warps: kept on
    sm_90 for 16-bit operands, dropped on sm_80 (128 accumulators per thread, or 192 KiB of
    stages) and for fp32 operands (tf32: registers; IEEE: K tile)."""
    from meshtron.kernels import gemm

    hopper = {tuple(c.kwargs[d] for d in configs.GEMM_DIMS) for c in gemm.configs_of(gemm.HOPPER_TILES)}
    assert {(128, 256, 64), (256, 128, 64), (128, 128, 128)} == hopper

    def kept(limits, elem, **kw):
        pruned = configs.prune_gemm_configs(gemm.persistent_configs(), limits, elem, 1, 1, **kw)
        return {(tuple(c.kwargs[d] for d in configs.GEMM_DIMS), c.num_stages) for c in pruned}

    h100_16 = kept(H100, 2)
    assert {((bm, bn, bk), s) for bm, bn, bk, _, s in gemm.HOPPER_TILES} <= h100_16
    assert not {t for t, _ in kept(A100, 2)} & hopper
    assert not {t for t, _ in kept(H100, 4)} & hopper
    assert not {t for t, _ in kept(H100, 4, fma=True)} & hopper
    # The dual product stages two A and two B tiles: 128x128x64 on 3 stages fits sm_90 only.
    dual = {
        tuple(c.kwargs[d] for d in configs.GEMM_DIMS)
        for c in configs.prune_gemm_configs(gemm.persistent_configs(), H100, 2, 2, 2)
    }
    assert (128, 128, 64) in dual and not dual & hopper


@pytest.mark.timeout(900)
def test_selection_covers_every_kernel_dtype_arch_and_is_seeded(launches):
    cases = aot.all_cases(launches=json.loads(launches.read_text()))
    keys = {(c.kernel, c.dtype, c.arch) for c in cases}
    chosen = aot.select(cases, sample=8, seed=1)
    assert {(c.kernel, c.dtype, c.arch) for c in chosen} == keys
    assert len(chosen) == len(keys) + 8
    again = aot.select(cases, sample=8, seed=1)
    assert [(c.kernel, c.variant, c.config) for c in again] == [(c.kernel, c.variant, c.config) for c in chosen]
    for c in chosen[: len(keys)]:  # the riskiest case of each key
        same = [o for o in cases if (o.kernel, o.dtype, o.arch) == (c.kernel, c.dtype, c.arch)]
        assert aot.risk(c) == max(aot.risk(o) for o in same)
    # Every GEMM kernel is fed fp32 (IEEE and TF32), bf16 and fp16; the others fp32, bf16, fp16.
    gemm = {c.kernel for c in cases if c.gemm is not None}
    # 9 + the persistent linear+activation forwards (pointer, TMA) + the grouped GEMM's
    # persistent forwards (pointer, TMA) and ordered dW + the FP8 grouped GEMM
    assert len(gemm) == 17 and aot.FP8_KERNELS <= gemm
    assert {"_matmul_persistent_kernel", "_matmul_tma_kernel"} <= gemm
    for kernel in {c.kernel for c in cases}:
        dtypes = {d for k, d, _ in keys if k == kernel}
        want = {"fp32-ieee", "fp32-tf32", "bf16", "fp16"} if kernel in gemm else {"fp32", "bf16", "fp16"}
        if kernel in aot.TMA_KERNELS:
            want = {"bf16", "fp16"}
        if kernel in aot.FP8_KERNELS:
            want = {"fp8"}
        assert dtypes == want, (kernel, dtypes)
        assert {a for k, _, a in keys if k == kernel} == set(aot.KERNEL_ARCHS.get(kernel, aot.ARCHS))


# The Triton the GPU machines' image carries (/work/.library/device/KINDS.md, 2026-11): the
# suite's Triton is newer, and a kernel that compiles on one may not on the other.
GPU_IMAGE_TRITON = "3.6.0"
GPU_IMAGE_TRITON_DIR = ROOT / ".triton-gpu-image"  # git-ignored: installed once, reused


def _gpu_image_triton() -> Path:
    """A folder holding the GPU image's Triton (pip-installed there on first use)."""
    marker = GPU_IMAGE_TRITON_DIR / f"triton-{GPU_IMAGE_TRITON}.dist-info"
    if not marker.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target",
             str(GPU_IMAGE_TRITON_DIR), f"triton=={GPU_IMAGE_TRITON}"],
            check=True, timeout=600,
        )  # fmt: skip
    return GPU_IMAGE_TRITON_DIR


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_kernel_compiles_with_the_gpu_images_triton(tmp_path, launches):
    """The same compile check under the GPU image's Triton (the launches captured by the
    suite's Triton: argument kinds do not depend on the version), a smaller sample."""
    site = _gpu_image_triton()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compiled kernels of one Triton only
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "meshtron.kernels.aot", "--sample", "4", "--launches", str(launches), "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1450,
    )  # fmt: skip
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report.get("triton") == GPU_IMAGE_TRITON, report.get("triton")
    assert report["failures"] == [] and report["missing"] == [], report["failures"] + report["missing"]
    assert proc.returncode == 0, proc.stderr[-3000:]
