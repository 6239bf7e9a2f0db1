"""Self-checked Triton kernels: the `triton_checked` backend that `kernels.backend=auto` gives on CUDA.

The model's kernel call sites go through `dispatch(kernel, backend, triton_fn, torch_fn, *args)`:

* backend "torch": `torch_fn(*args)` (the model's plain-torch path);
* backend "triton" (strict): `triton_fn(*args)`; a kernel that fails raises;
* backend "triton_checked": the first call of each kernel in this process runs `check`: the
  Triton function and the torch reference on clones of the real inputs (forward, then backward
  with a random upstream gradient, every floating input differentiable), under the caller's
  autocast and device state, and compares outputs and input gradients. A kernel that raises,
  or whose error exceeds `TOLERANCES` for the compute dtype, is routed to `torch_fn` for the
  rest of the process with ONE `KernelSelfCheckWarning` naming it, the max error and the
  tolerance. That replacement is the only fallback in meshtron and it is never silent.
  Kernels not measured faster than their torch paths on CUDA (kernels/measured.json, read by
  `kernels.backend.prefers_torch_on_cuda`) are not tried there: the checked backend runs their
  torch paths (a choice of speed, not a fallback; no check, no warning).

Error measure: for every output and input gradient, max |triton - torch| divided by the
reference's largest finite magnitude (floored at 1e-12); the kernel's error is the largest
of these. NaN/inf where the reference is finite counts as a failure. Tolerances by compute
dtype (the autocast dtype when autocast is on for the device, else the lowest-precision
floating input; fp32 on CUDA uses the tf32 entry when torch's matmuls or the Triton GEMMs
(`kernels.tf32`) may round to TF32):
fp32 1e-4, tf32 1e-2, fp16 1e-2, bf16 5e-2. Broken kernels give errors of order 1.

Every rank takes the same path for every kernel:
* No check communicates. Kernels that communicate are checked on this rank's own shard (the
  vocab-parallel cross-entropy is checked with group=None on the local logits: both Triton
  kernels run, only the plain-torch combine is skipped), so a kernel that raises on one rank
  cannot leave the other ranks waiting in a collective.
* With one process (torch.distributed not initialized, or world size 1) the local verdict
  is final at once: later calls use it.
* With several processes a local verdict is only provisional: until `agree()` the checked
  kernel keeps running `torch_fn` on every rank (so every rank runs the same code whatever its
  local result). `agree()` is a collective over the default group that every rank calls at
  the same point (the training loop calls it after its first step, where every kernel of
  the model has been reached): it sums [checked, failed] per kernel over all ranks (one
  all-reduce SUM, plus one all-reduce MAX of the errors for the message). A kernel failed on
  any rank runs torch on all ranks; one checked somewhere and failed nowhere runs Triton on
  all ranks. A kernel reached for the first time after the agreement cannot be agreed on any
  more and runs torch on every rank that reaches it (one warning saying so): the decision is
  still the same on all ranks.

Verdicts are keyed by kernel name (`KERNELS`), per process; `reset()` clears them (tests).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshtron.kernels.backend import CHECKED, auto_runs_torch
from meshtron.kernels.tf32 import dot_precision, torch_allows_tf32
from meshtron.mpu.mappings import all_reduce_stats, world_group
from meshtron.mpu.mesh import collective_device, group_size

__all__ = [
    "CHECKED",
    "KERNELS",
    "TOLERANCES",
    "KernelSelfCheckWarning",
    "CheckResult",
    "dispatch",
    "check",
    "agree",
    "verdict",
    "local_result",
    "reset",
    "tolerance_for",
]

# Every kernel name a call site may pass: the agreement vector has one slot per name, in this
# order, on every rank.
KERNELS = (
    "layer_norm",
    "rms_norm",
    "linear_gelu",
    "linear_swiglu",
    "cross_entropy",
    "grouped_gemm",
    "swiglu",
    "residual_layer_norm",
    "residual_rms_norm",
)

TOLERANCES = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 5e-2}

_DTYPE_LABEL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp32"}
_PRECISION_ORDER = {"bf16": 0, "fp16": 1, "tf32": 2, "fp32": 3}
_SCALE_FLOOR = 1e-12
_SEED = 20240611  # upstream gradients of the check: the same on every rank, no global RNG touched


class KernelSelfCheckWarning(RuntimeWarning):
    """A Triton kernel failed its self-check and was replaced by the torch path."""


@dataclass
class CheckResult:
    """Outcome of one kernel's check on this rank: `error` is the max scaled error (inf when
    the Triton function raised), `reason` the exception text or an empty string."""

    passed: bool
    error: float
    tolerance: float
    dtype: str
    reason: str = ""

    def describe(self) -> str:
        if self.reason:
            return f"raised {self.reason}"
        return (
            f"max error {self.error:.3g} {'<=' if self.passed else '>'} tolerance {self.tolerance:.3g} ({self.dtype})"
        )


@dataclass
class _State:
    local: dict[str, CheckResult]
    verdicts: dict[str, bool]  # True: Triton, False: torch; final
    agreed: bool
    warned: set[str]


_state = _State({}, {}, False, set())


def reset() -> None:
    """Forget every check, verdict and warning of this process (for tests)."""
    global _state
    _state = _State({}, {}, False, set())


def verdict(kernel: str) -> bool | None:
    """True (Triton) / False (torch) once decided for `kernel` in this process, else None."""
    return _state.verdicts.get(kernel)


def local_result(kernel: str) -> CheckResult | None:
    """This rank's own check of `kernel`, if it ran."""
    return _state.local.get(kernel)


def _multi_process() -> bool:
    return world_group() is not None


def tolerance_for(args: tuple, device_type: str) -> tuple[float, str]:
    """(tolerance, dtype label) for a kernel call on `args` under the current autocast state."""
    labels = [_DTYPE_LABEL.get(a.dtype, "fp32") for a in args if torch.is_tensor(a) and a.is_floating_point()]
    if torch.is_autocast_enabled(device_type):
        labels.append(_DTYPE_LABEL.get(torch.get_autocast_dtype(device_type), "fp32"))
    label = min(labels, key=_PRECISION_ORDER.__getitem__) if labels else "fp32"
    if label == "fp32" and device_type == "cuda" and (torch_allows_tf32() or dot_precision(torch.float32) == "tf32"):
        label = "tf32"  # torch's fp32 matmuls or the Triton GEMMs (kernels.tf32) round to TF32
    return TOLERANCES[label], label


def _scaled_error(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| / max |want| (finite entries of want, floored); inf on a shape mismatch."""
    if got is None and want is None:
        return 0.0
    if got is None or want is None:
        ref = want if got is None else got
        got = torch.zeros_like(ref) if got is None else got
        want = torch.zeros_like(ref) if want is None else want
    if got.shape != want.shape:
        return math.inf
    if want.numel() == 0:
        return 0.0
    got, want = got.detach().float(), want.detach().float()
    same = (got == want) | (got.isnan() & want.isnan())  # equal infinities count as agreement
    diff = torch.where(same, torch.zeros_like(got), (got - want).abs())
    finite = want[want.isfinite()]
    scale = max(float(finite.abs().max()) if finite.numel() else 0.0, _SCALE_FLOOR)
    err = float(diff.max()) / scale
    return math.inf if math.isnan(err) else err


def _clone_inputs(args: tuple) -> tuple[tuple, list[torch.Tensor]]:
    """Detached clones of the floating tensors (differentiable), other arguments as they are."""
    cloned, diff = [], []
    for a in args:
        if torch.is_tensor(a) and a.is_floating_point():
            c = a.detach().clone().requires_grad_(True)
            cloned.append(c)
            diff.append(c)
        else:
            cloned.append(a)
    return tuple(cloned), diff


def _forward_backward(fn: Callable, args: tuple) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """fn on fresh clones of args, then gradients of <out, g> w.r.t. every floating input,
    with g a fixed-seed random upstream gradient of out's shape."""
    cloned, diff = _clone_inputs(args)
    out = fn(*cloned)
    if not torch.is_tensor(out):
        raise TypeError(f"self-check expects one output tensor, got {type(out).__name__}")
    gen = torch.Generator(device=out.device).manual_seed(_SEED)
    grad_out = torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float32).to(out.dtype)
    grads: list[torch.Tensor | None] = [None] * len(diff)
    if diff and out.requires_grad:
        grads = list(torch.autograd.grad(out, diff, grad_out, allow_unused=True))
    return out.detach(), grads


def check(triton_fn: Callable, torch_fn: Callable, args: tuple) -> CheckResult:
    """Compare `triton_fn(*args)` with `torch_fn(*args)` on clones of `args`, forward and
    backward, under the caller's autocast state; no communication, inputs left untouched.
    An exception from the Triton side is a failed check; one from the reference propagates."""
    device = next((a.device.type for a in args if torch.is_tensor(a)), "cpu")
    tol, label = tolerance_for(args, device)
    with torch.enable_grad():
        want, want_grads = _forward_backward(torch_fn, args)
        try:
            got, got_grads = _forward_backward(triton_fn, args)
        except Exception as err:  # noqa: BLE001 - any launch/compile failure fails the check
            text = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            return CheckResult(False, math.inf, tol, label, text)
    error = max([_scaled_error(got, want)] + [_scaled_error(g, w) for g, w in zip(got_grads, want_grads)])
    return CheckResult(error <= tol, error, tol, label)


def _warn(kernel: str, detail: str) -> None:
    if kernel in _state.warned:
        return
    _state.warned.add(kernel)
    warnings.warn(
        f"kernels: Triton kernel '{kernel}' failed its self-check against the torch reference "
        f"({detail}); using the torch path for '{kernel}' for the rest of this process",
        KernelSelfCheckWarning,
        stacklevel=3,
    )


def _first_tensor(args: tuple) -> torch.Tensor | None:
    """The first tensor in `args` (None when there is none): its device and size stand for the call's."""
    return next((a for a in args if torch.is_tensor(a)), None)


def _has_empty_input(args: tuple) -> bool:
    return any(torch.is_tensor(a) and a.is_floating_point() and a.numel() == 0 for a in args)


def dispatch(
    kernel: str,
    backend: str,
    triton_fn: Callable,
    torch_fn: Callable,
    *args: Any,
    check_fns: tuple[Callable, Callable] | None = None,
) -> Any:
    """Run `kernel` on `args` with `backend` ("torch", "triton" or "triton_checked"; see the
    module docstring). `check_fns` = (triton, torch) functions to check instead of the real
    pair, for kernels whose real call communicates (they must not). The check itself talks to
    no process group; the verdict is agreed later by `agree()` when there are several processes."""
    if backend == "torch":
        return torch_fn(*args)
    if backend == "triton":
        return triton_fn(*args)
    if backend != CHECKED:
        raise ValueError(f"kernel backend {backend!r} must be torch, triton or {CHECKED}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not in kernels.selfcheck.KERNELS; add it there")
    first = _first_tensor(args)
    if auto_runs_torch(kernel, "cpu" if first is None else first.device.type, None if first is None else first.numel()):
        # measured slower than torch there (or at that size): no check either
        return torch_fn(*args)
    decided = _state.verdicts.get(kernel)
    if decided is not None:
        return triton_fn(*args) if decided else torch_fn(*args)
    if kernel in _state.local:  # checked here, waiting for agree(): torch on every rank meanwhile
        return torch_fn(*args)
    if _state.agreed and _multi_process():
        # First reached after the agreement: no rank checked it before, so no rank can be on
        # Triton for it; every rank that reaches it takes torch.
        _state.verdicts[kernel] = False
        _warn(
            kernel,
            "first used after the ranks agreed on the self-checks, so it cannot be checked consistently on every rank",
        )
        return torch_fn(*args)
    if _has_empty_input(args):  # nothing to compare yet: check on the first non-empty call
        return torch_fn(*args)
    result = check(*(check_fns or (triton_fn, torch_fn)), args)
    _state.local[kernel] = result
    if not _multi_process():
        _state.verdicts[kernel] = result.passed
        if not result.passed:
            _warn(kernel, result.describe())
    return torch_fn(*args)


def agree(device: torch.device | str | None = None) -> dict[str, bool]:
    """Make the self-check verdicts final and identical on every rank; returns them.

    Collective over the default process group (every rank must call it at the same point):
    one all-reduce SUM of [checked, failed] per kernel and one all-reduce MAX of the errors.
    `device` is where the default group's collectives run (default `mpu.mesh.collective_device()`).
    Without several processes it only marks the agreement as done (verdicts are already final).
    """
    group = world_group()
    if group is not None:
        if device is None:
            device = collective_device()
        counts = torch.zeros(len(KERNELS), 2, dtype=torch.float64)
        errors = torch.zeros(len(KERNELS), dtype=torch.float64)
        for i, name in enumerate(KERNELS):
            result = _state.local.get(name)
            if result is not None and name not in _state.verdicts:
                counts[i] = torch.tensor([1.0, 0.0 if result.passed else 1.0])
                errors[i] = min(result.error, 1e300)
        counts = all_reduce_stats(counts.to(device), group, "sum").cpu().tolist()
        errors = all_reduce_stats(errors.to(device), group, "max").cpu().tolist()
        world = group_size(group)
        for i, name in enumerate(KERNELS):
            checked, failed = counts[i]
            if name in _state.verdicts or checked == 0:
                continue
            _state.verdicts[name] = failed == 0
            if failed:
                mine = _state.local.get(name)
                err = "raised" if errors[i] >= 1e300 else f"max error over ranks {errors[i]:.3g}"
                here = f"; this rank: {mine.describe()}" if mine is not None else "; not reached on this rank"
                tol = f" (tolerance {mine.tolerance:.3g}, {mine.dtype})" if mine is not None else ""
                _warn(name, f"failed on {int(failed)} of {world} ranks, {err}{tol}{here}")
    _state.agreed = True
    return dict(_state.verdicts)
