"""Kernel backend selection: `kernels.backend` = auto | triton | torch.

`resolve_backend` turns the configured name into the mode the model runs:
* "torch": the plain-torch paths (torch, and auto off CUDA);
* "triton_checked" (`CHECKED`): what auto gives on CUDA: Triton kernels, each checked once
  per process against its torch reference on the first real inputs and replaced by the torch
  path, with one warning, if it raises or disagrees (`kernels.selfcheck`);
* "triton": strict, no check; a failing kernel raises (on CPU only under TRITON_INTERPRET=1,
  the numpy interpreter, for tests).
Tests force the checked mode on CPU by asking for it by name under TRITON_INTERPRET=1.
The kernel modules' own `backend=` arguments know only torch | triton (their "auto" means
unchecked Triton on CUDA): the self-check lives at the model's call sites.
"""

from __future__ import annotations

import importlib.util
import os

BACKENDS = ("auto", "triton", "torch")
CHECKED = "triton_checked"
RESOLVED = ("torch", "triton", CHECKED)


def triton_available() -> bool:
    """True when the triton package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(name: str, device_type: str) -> str:
    """"torch", "triton" or "triton_checked" for the configured `name` on `device_type`
    (auto -> triton_checked on CUDA, torch elsewhere; `name` may also be "triton_checked",
    which tests use on CPU under TRITON_INTERPRET=1); raises with the reason when Triton is
    asked for but cannot run."""
    if name not in BACKENDS + (CHECKED,):
        raise ValueError(f"kernels.backend={name!r} must be one of {', '.join(BACKENDS)}")
    if name == "torch" or (name == "auto" and device_type != "cuda"):
        return "torch"
    if not triton_available():
        if name == "auto":
            raise RuntimeError("kernels.backend=auto on CUDA needs the triton package; install it or set kernels.backend=torch")
        raise RuntimeError(f"kernels.backend={name} needs the triton package (pip install triton)")
    if device_type != "cuda" and not interpreting():
        raise RuntimeError(f"kernels.backend={name} on CPU runs only under TRITON_INTERPRET=1 (tests); use kernels.backend=torch")
    return CHECKED if name in ("auto", CHECKED) else "triton"
