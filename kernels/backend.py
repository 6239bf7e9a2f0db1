"""Kernel backend selection: `kernels.backend` = auto | triton | torch.

auto picks Triton on CUDA and the plain-torch reference elsewhere; triton forces the Triton
kernels (on CPU only under TRITON_INTERPRET=1, the numpy interpreter, for tests); torch
forces the references. Every kernel module exposes the same signature for both.
"""

from __future__ import annotations

import importlib.util
import os

BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    """True when the triton package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(name: str, device_type: str) -> str:
    """"triton" or "torch" for the configured `name` on `device_type`; raises with the reason
    when Triton is asked for but cannot run."""
    if name not in BACKENDS:
        raise ValueError(f"kernels.backend={name!r} must be one of {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and device_type != "cuda"):
        return "torch"
    if not triton_available():
        if name == "auto":
            raise RuntimeError("kernels.backend=auto on CUDA needs the triton package; install it or set kernels.backend=torch")
        raise RuntimeError("kernels.backend=triton needs the triton package (pip install triton)")
    if device_type != "cuda" and not interpreting():
        raise RuntimeError("kernels.backend=triton on CPU runs only under TRITON_INTERPRET=1 (tests); use kernels.backend=torch")
    return "triton"
