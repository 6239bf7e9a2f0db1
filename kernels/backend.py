"""Kernel backend selection: `kernels.backend` = auto | triton | torch.

`resolve_backend` turns the configured name into the mode the model runs:
* "torch": the plain-torch paths (torch, and auto off CUDA);
* "triton_checked" (`CHECKED`): what auto gives on CUDA: Triton kernels, each checked once
  per process against its torch reference on the first real inputs and replaced by the torch
  path, with one warning, if it raises or disagrees (`kernels.selfcheck`); kernels not
  measured faster than their torch paths on a GPU (kernels/measured.json) run torch there;
* "triton": strict, no check; a failing kernel raises (on CPU only under TRITON_INTERPRET=1,
  the numpy interpreter, for tests).
Tests force the checked mode on CPU by asking for it by name under TRITON_INTERPRET=1.
Two vocabularies, on purpose: the config's (`BACKENDS`: auto | triton | torch) and the mode a
run resolves it to (`RESOLVED`: torch | triton | triton_checked), which the model and the fused
LM loss take. The kernel modules' own `backend=` arguments take the strict modes torch | triton
only (anything else raises): the self-check lives at the model's call sites.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

BACKENDS = ("auto", "triton", "torch")
CHECKED = "triton_checked"
RESOLVED = ("torch", "triton", CHECKED)

# Which Triton kernels kernels.backend=auto runs on CUDA is data, not a list: kernels/measured.json
# holds each kernel's measured speed over the torch path it replaces, per GPU and date (generated
# from bench/results/gpu/*-kernels.json by `python bench/results_table.py`; the first H200 figures
# of 2026-11-27 are kept there by hand). A kernel runs Triton under auto on CUDA only where its
# newest measurement -- on this GPU model if it has any, else on any GPU, the slowest dtype of
# that date -- is at least 1.0; a kernel never measured runs torch. "gemm" is the plain GEMM
# engine inside the fused kernels (kernels/gemm.py: the fused linear+activation's dX and dW),
# cuBLAS until the Triton GEMM is measured at torch.mm's speed. Kernels whose choice depends on
# the operands are decided where the operands are known (`DECIDED_ELSEWHERE`): the grouped GEMM
# (moe/experts.py grouped_backend: torch's grouped_mm in bf16 with aligned rows) and the
# experts' SwiGLU (by size, AUTO_TRITON_MIN_ELEMENTS below). kernels.backend=triton still runs
# every Triton kernel (strict), to measure or test them.
MEASURED = Path(__file__).with_name("measured.json")
DECIDED_ELSEWHERE = frozenset({"grouped_gemm", "swiglu"})

# Kernels that auto runs with Triton only on inputs of at least this many elements. The MoE
# experts' fused SwiGLU (kernels/swiglu.py) saves ~12 bytes of memory traffic per element: 0.36
# ms of kernel time per layer forward + backward at Mixtral-8x7B's width (117M elements) on an
# H200, where it helped the block to 1.18-1.21x the Mixtral block. In the same A/B (2026-11-27,
# bench/README.md session 16) a bf16 MoE training step with 23M-element activations, which is
# host-bound, ran 10-20% slower with it and the permutation dispatch on; the profiler saw no
# single cause (a Triton launch cost the host about what an aten op did). Until a GPU A/B
# separates the two, auto keeps the kernel to activations of that width: the saving is
# ~0.03 ms below 2^26 elements, a few host-side calls' worth.
AUTO_TRITON_MIN_ELEMENTS = {"swiglu": 1 << 26}


def triton_available() -> bool:
    """True when the triton package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _measurements() -> tuple[dict, ...]:
    return tuple(json.loads(MEASURED.read_text())["measurements"])


def measured_speedup(kernel: str, device_name: str | None = None) -> float | None:
    """`kernel`'s newest measured speed over its torch path (kernels/measured.json): on
    `device_name` if measured there, else on any GPU; the slowest dtype of the newest date;
    None when never measured."""
    entries = [m for m in _measurements() if m["kernel"] == kernel]
    entries = [m for m in entries if m["device"] == device_name] or entries
    if not entries:
        return None
    newest = max(m["date"] for m in entries)
    return min(m["speedup"] for m in entries if m["date"] == newest)


@functools.cache
def _cuda_device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


@functools.cache
def prefers_torch_on_cuda(kernel: str) -> bool:
    """Whether auto runs `kernel`'s torch path on this process's GPU: never measured there or
    anywhere, or measured slower than torch (`measured_speedup` < 1). Decided once per kernel
    and process (the checked dispatch asks at every call); `cache_clear()` after changing the
    table."""
    if kernel in DECIDED_ELSEWHERE:
        return False
    speedup = measured_speedup(kernel, _cuda_device_name())
    return speedup is None or speedup < 1.0


def auto_runs_torch(kernel: str, device_type: str, numel: int | None = None) -> bool:
    """Whether the checked backend (kernels.backend=auto) runs `kernel`'s torch path without
    trying Triton: on CUDA where `prefers_torch_on_cuda` (the CPU keeps Triton: there the
    checked mode exists only for tests, under the interpreter), and on any device for an input
    of `numel` elements below the kernel's `AUTO_TRITON_MIN_ELEMENTS`."""
    if device_type == "cuda" and prefers_torch_on_cuda(kernel):
        return True
    return numel is not None and numel < AUTO_TRITON_MIN_ELEMENTS.get(kernel, 0)


def plain_gemm_backend(mode: str, device_type: str) -> str:
    """The engine ("torch" or "triton") of the plain GEMMs inside the fused kernels under the
    resolved kernel `mode`: all Triton when strict ("triton"), under auto Triton except where
    auto prefers torch (`auto_runs_torch("gemm", ...)`: on CUDA until measured faster), and
    torch for the "torch" mode."""
    if mode == "triton" or (mode == CHECKED and not auto_runs_torch("gemm", device_type)):
        return "triton"
    return "torch"


def resolve_backend(name: str, device_type: str) -> str:
    """ "torch", "triton" or "triton_checked" for the configured `name` on `device_type`
    (auto -> triton_checked on CUDA, torch elsewhere; `name` may also be "triton_checked",
    which tests use on CPU under TRITON_INTERPRET=1); raises with the reason when Triton is
    asked for but cannot run."""
    if name not in BACKENDS + (CHECKED,):
        raise ValueError(f"kernels.backend={name!r} must be one of {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and device_type != "cuda"):
        return "torch"
    if not triton_available():
        if name == "auto":
            raise RuntimeError(
                "kernels.backend=auto on CUDA needs the triton package; install it or set kernels.backend=torch"
            )
        raise RuntimeError(f"kernels.backend={name} needs the triton package (pip install triton)")
    if device_type != "cuda" and not interpreting():
        raise RuntimeError(
            f"kernels.backend={name} on CPU runs only under TRITON_INTERPRET=1 (tests); use kernels.backend=torch"
        )
    return CHECKED if name in ("auto", CHECKED) else "triton"
