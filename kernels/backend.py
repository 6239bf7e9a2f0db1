"""Kernel backend selection: `kernels.backend` = auto | triton | torch.

`resolve_backend` turns the configured name into the mode the model runs:
* "torch": the plain-torch paths (torch, and auto off CUDA);
* "triton_checked" (`CHECKED`): what auto gives on CUDA: Triton kernels, each checked once
  per process against its torch reference on the first real inputs and replaced by the torch
  path, with one warning, if it raises or disagrees (`kernels.selfcheck`); kernels measured
  slower than their torch paths on a GPU (`AUTO_PREFERS_TORCH_ON_CUDA`) run torch there;
* "triton": strict, no check; a failing kernel raises (on CPU only under TRITON_INTERPRET=1,
  the numpy interpreter, for tests).
Tests force the checked mode on CPU by asking for it by name under TRITON_INTERPRET=1.
Two vocabularies, on purpose: the config's (`BACKENDS`: auto | triton | torch) and the mode a
run resolves it to (`RESOLVED`: torch | triton | triton_checked), which the model and the fused
LM loss take. The kernel modules' own `backend=` arguments take the strict modes torch | triton
only (anything else raises): the self-check lives at the model's call sites.
"""

from __future__ import annotations

import importlib.util
import os

BACKENDS = ("auto", "triton", "torch")
CHECKED = "triton_checked"
RESOLVED = ("torch", "triton", CHECKED)

# The kernels that kernels.backend=auto runs with their torch paths on CUDA, because they were
# measured slower there than torch's own (cuBLAS GEMMs, torch's fused norms). H200, torch 2.11,
# Triton 3.6, 2026-11-27 (`python bench/gpu_acceptance.py --sections bench`): forward + backward
# at gpt_1b's tp=4 shapes, 4,096 tokens, Triton's speed over torch's (bench/kernels.py):
#   bf16: linear_gelu 0.53, linear_swiglu 0.59, rms_norm 0.31, layer_norm 0.41
#   fp32: linear_gelu 0.40, linear_swiglu 0.32, rms_norm 0.32, layer_norm 0.23
# and a dense llama training step (bench/throughput.py, 8 layers, h 1024, bf16) made 173k
# tokens/s with them against 254k with kernels.backend=torch. The fused cross-entropy stays
# Triton (33-35x its torch path there). The grouped GEMM is not in this table: its choice
# depends on the operands (torch's grouped_mm in bf16 with aligned rows, Triton otherwise;
# moe/experts.py grouped_backend). kernels.backend=triton still runs every Triton kernel
# (strict), to measure or test them.
# The fused residual add + norm (kernels/norms.py residual_rms_norm / residual_layer_norm, the
# blocks' attention residual and norm2) is unmeasured on a GPU so far: auto keeps torch's
# `x + delta; norm(x)` on CUDA until bench/kernels.py measures `norms.residual_rms_norm` /
# `norms.residual_layer_norm` against it.
AUTO_PREFERS_TORCH_ON_CUDA = frozenset(
    {"linear_gelu", "linear_swiglu", "rms_norm", "layer_norm", "residual_rms_norm", "residual_layer_norm"}
)
# The plain GEMMs inside the fused kernels (kernels/gemm.py: the fused linear+activation's
# backward dX and dW) run cuBLAS under auto on these device types, until bench/kernels.py
# records the Triton GEMM at or above torch.mm there (its one-program-per-tile 128x128 kernel
# was the core of the linear kernels measured above).
AUTO_PLAIN_GEMM_TORCH_ON = frozenset({"cuda"})

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


def auto_runs_torch(kernel: str, device_type: str, numel: int | None = None) -> bool:
    """Whether the checked backend (kernels.backend=auto) runs `kernel`'s torch path without
    trying Triton: on CUDA for `AUTO_PREFERS_TORCH_ON_CUDA` (the CPU keeps Triton: there the
    checked mode exists only for tests, under the interpreter), and on any device for an input
    of `numel` elements below the kernel's `AUTO_TRITON_MIN_ELEMENTS`."""
    if device_type == "cuda" and kernel in AUTO_PREFERS_TORCH_ON_CUDA:
        return True
    return numel is not None and numel < AUTO_TRITON_MIN_ELEMENTS.get(kernel, 0)


def plain_gemm_backend(mode: str, device_type: str) -> str:
    """The engine ("torch" or "triton") of the plain GEMMs inside the fused kernels under the
    resolved kernel `mode`: all Triton when strict ("triton"), else torch where auto prefers it
    (`AUTO_PLAIN_GEMM_TORCH_ON`), and torch for the "torch" mode."""
    if mode == "triton" or (mode == CHECKED and device_type not in AUTO_PLAIN_GEMM_TORCH_ON):
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
