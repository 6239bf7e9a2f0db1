"""Peak FLOP/s of the device a run trains on: the denominator of MFU.

On CPU the peak is measured (best square matmul rate on this process's torch threads),
on a known NVIDIA GPU it comes from the datasheet (dense, no structured sparsity), and on
an unknown GPU it is measured with a CUDA matmul. Every figure comes with a string that
says how it was obtained, so logs can show it beside the MFU.
"""

from __future__ import annotations

import re
import time

import torch

__all__ = ["measure_cpu_peak_flops", "known_gpu_peak_flops", "gpu_peak_entry", "peak_flops", "tf32_enabled"]

_T = 1e12

# Dense peak TFLOP/s from NVIDIA datasheets (sparsity figures halved). Keys:
# "fp32" = plain FP32 (CUDA cores), "tf32" = TF32 tensor cores, "bf16"/"fp16" = tensor
# cores with fp32 accumulation (what torch matmuls use). None = not supported in hardware.
# Patterns are tried in order against the device name (case-insensitive): the most
# specific variant of a family comes first.
_GPU_TABLE: list[tuple[str, str, dict[str, float | None]]] = [
    (r"H200\s*NVL", "NVIDIA H200 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H200", "NVIDIA H200 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"H100\s*NVL", "NVIDIA H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H100\s*PCI", "NVIDIA H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB": the SXM part.
    (r"H100", "NVIDIA H100 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    # SXM4 and PCIe A100s share the tensor-core peaks.
    (r"A100", "NVIDIA A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"\bL4\b", "NVIDIA L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    # \b keeps "A100" and "A10G" (a different part) out.
    (r"\bA10\b", "NVIDIA A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    # GeForce: fp16/bf16 with fp32 accumulation run at half the fp16-accumulate rate.
    (r"RTX\s*4090", "NVIDIA GeForce RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    # Volta: no TF32, no bf16 tensor cores.
    (r"V100S", "NVIDIA V100S PCIe", {"fp32": 16.4, "tf32": None, "bf16": None, "fp16": 130.0}),
    (r"V100.*PCI", "NVIDIA V100 PCIe", {"fp32": 14.0, "tf32": None, "bf16": None, "fp16": 112.0}),
    (r"V100", "NVIDIA V100 SXM2", {"fp32": 15.7, "tf32": None, "bf16": None, "fp16": 125.0}),
]

_DTYPE_KEYS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}

_cpu_cache: dict[tuple[torch.dtype, int], float] = {}
_gpu_cache: dict[tuple[str, torch.dtype], tuple[float, str]] = {}

_CPU_SIZE = 1024
_CUDA_SIZE = 8192


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def tf32_enabled() -> bool:
    """Whether torch currently runs fp32 CUDA matmuls on TF32 tensor cores.

    torch's default is no (float32_matmul_precision "highest"), so fp32 peaks are plain FP32
    unless the run called torch.set_float32_matmul_precision("high"/"medium") or set
    torch.backends.cuda.matmul.allow_tf32 / fp32_precision = "tf32".
    """
    if torch.get_float32_matmul_precision() != "highest":
        return True
    try:
        if getattr(torch.backends.cuda.matmul, "fp32_precision", None) == "tf32":
            return True
    except (AttributeError, RuntimeError):
        pass
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except (AttributeError, RuntimeError):
        return False


def gpu_peak_entry(device_name: str, dtype: torch.dtype, tf32: bool | None = None) -> tuple[float, str] | None:
    """(dense peak FLOP/s, description) from the datasheet table, or None when it has no figure.

    `tf32` picks the TF32 tensor-core peak for fp32 (None: follow `tf32_enabled()`; on a
    V100, which has no TF32, fp32 stays plain FP32 as torch runs it). The description names
    the part, the dtype and "dense", e.g. "datasheet: NVIDIA H100 SXM bf16 dense". None for
    an unknown GPU, a dtype outside fp32/bf16/fp16, or a dtype the part has no tensor cores
    for (bf16 on a V100): `peak_flops` then measures instead.
    """
    if dtype not in _DTYPE_KEYS:
        return None
    key = _DTYPE_KEYS[dtype]
    for pattern, label, peaks in _GPU_TABLE:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if key == "fp32" and (tf32_enabled() if tf32 is None else tf32) and peaks["tf32"] is not None:
                key = "tf32"
            tflops = peaks[key]
            if tflops is None:
                return None
            what = "fp32 (TF32 tensor cores)" if key == "tf32" else key
            return tflops * _T, f"datasheet: {label} {what} dense"
    return None


def known_gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool | None = None) -> float | None:
    """Dense datasheet peak of a known NVIDIA GPU in FLOP/s (the table holds TFLOP/s), or None.

    None when the name is unknown or the table has no figure for the dtype (see
    `gpu_peak_entry`).

    Covers A100 (SXM/PCIe), H100 SXM/PCIe/NVL, H200 (SXM/NVL), L4, A10, RTX 4090, V100
    (SXM2/PCIe/V100S) for torch.float32, torch.bfloat16 and torch.float16, matching names such
    as "NVIDIA H100 80GB HBM3" or "NVIDIA A100-SXM4-80GB". For fp32 the figure is plain FP32
    unless TF32 is enabled (torch's default is not; `tf32=None` follows the current torch
    setting, True/False forces it). bf16/fp16 are tensor-core rates with fp32 accumulation.
    """
    entry = gpu_peak_entry(device_name, dtype, tf32=tf32)
    return None if entry is None else entry[0]


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5) -> float:
    """Measured FLOP/s of a square `size` x `size` `torch.mm` on CPU with this process's threads.

    Warms up, then times single matmuls for about `seconds` and returns the best rate,
    2 * size**3 / t (the closest thing to a peak the process can reach). Not cached; see
    `peak_flops` for the cached figure.
    """
    if size < 1 or seconds <= 0:
        raise ValueError(f"size={size} and seconds={seconds} must be positive")
    a = torch.randn(size, size, dtype=torch.float32).to(dtype)
    b = torch.randn(size, size, dtype=torch.float32).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    for _ in range(2):
        torch.mm(a, b, out=out)
    flop = 2.0 * size**3
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return flop / max(best, 1e-9)


def _measure_cuda_peak_flops(
    device: torch.device, dtype: torch.dtype, size: int = _CUDA_SIZE, seconds: float = 0.5
) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        start.record()
        for _ in range(5):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / 5)
        runs += 1
    return 2.0 * size**3 / best


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """Peak FLOP/s to divide achieved FLOP/s by for MFU, and how it was obtained.

    * CPU: `measure_cpu_peak_flops` at 1024x1024, cached per (dtype, torch threads) in this
      process; description like "measured: 1024x1024 fp32 matmul on 2 threads".
    * CUDA, known GPU: datasheet dense peak, e.g. "datasheet: NVIDIA H100 SXM bf16 dense".
    * CUDA, unknown GPU: best rate of an 8192x8192 CUDA matmul, cached per (name, dtype),
      e.g. "measured: 8192x8192 bf16 matmul on NVIDIA XYZ".
    Other device types raise ValueError.
    """
    device = torch.device(device)
    if device.type == "cpu":
        threads = torch.get_num_threads()
        key = (dtype, threads)
        if key not in _cpu_cache:
            _cpu_cache[key] = measure_cpu_peak_flops(dtype, size=_CPU_SIZE)
        what = f"measured: {_CPU_SIZE}x{_CPU_SIZE} {_dtype_name(dtype)} matmul on {threads} thread" + (
            "s" if threads != 1 else ""
        )
        return _cpu_cache[key], what
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        entry = gpu_peak_entry(name, dtype)
        if entry is not None:
            return entry
        tf32 = dtype == torch.float32 and tf32_enabled()
        key = (f"{name}|tf32={tf32}", dtype)
        if key not in _gpu_cache:
            flops = _measure_cuda_peak_flops(device, dtype)
            kind = "fp32 (TF32 enabled)" if tf32 else _dtype_name(dtype)
            _gpu_cache[key] = (flops, f"measured: {_CUDA_SIZE}x{_CUDA_SIZE} {kind} matmul on {name}")
        return _gpu_cache[key]
    raise ValueError(f"no peak FLOP/s for device type {device.type!r}; meshtron runs on cpu or cuda")
