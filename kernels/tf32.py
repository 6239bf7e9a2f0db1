"""The TF32 policy of the Triton GEMM kernels: whether fp32 dots may use TF32 tensor cores.

`kernels.tf32` (set with `set_tf32_mode`) is one of
* "auto"  (default): follow torch's own policy for fp32 CUDA matmuls, so the Triton kernels
  round exactly when `torch.matmul` would;
* "on" / "off": force TF32 / IEEE fp32 dots in the Triton kernels (torch's matmuls keep
  their own setting).

torch 2.13 has two APIs for its policy: the legacy `torch.backends.cuda.matmul.allow_tf32`
and the newer `torch.backends.cuda.matmul.fp32_precision` ("ieee" | "tf32" | "none" =
inherit `torch.backends.fp32_precision`). Once the newer one has been used, reading the
legacy flag raises RuntimeError ("mix of the legacy and new APIs"), so `torch_allows_tf32`
reads the newer API first and touches the legacy flag only when the newer one says nothing.

The resulting dot precision ("ieee" or "tf32") is a constexpr of every GEMM kernel and part
of its autotune key: a config tuned (and pruned for shared memory) under one precision is
never reused under the other. 16-bit inputs always use the tensor cores; the policy only
concerns fp32 inputs.
"""

from __future__ import annotations

import torch

TF32_MODES = ("auto", "on", "off")
_mode = "auto"


def set_tf32_mode(mode: str) -> None:
    """Set the process-wide policy (`kernels.tf32`): "auto", "on" or "off"."""
    global _mode
    if mode not in TF32_MODES:
        raise ValueError(f"kernels.tf32={mode!r} must be one of {', '.join(TF32_MODES)}")
    _mode = mode


def tf32_mode() -> str:
    """The current `kernels.tf32` policy."""
    return _mode


def torch_allows_tf32() -> bool:
    """True when torch's fp32 CUDA matmuls may use TF32, under either torch API, never raising."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # the newer API was used somewhere: it said "none", so IEEE
        return False


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` for `tl.dot` on operands of `dtype`: "tf32" for fp32 when the policy
    allows it, else "ieee" (ignored by Triton for 16-bit operands)."""
    if dtype != torch.float32:
        return "ieee"
    allowed = torch_allows_tf32() if _mode == "auto" else _mode == "on"
    return "tf32" if allowed else "ieee"
