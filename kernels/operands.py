"""The operands the Triton GEMM kernels compute on: autocast's dtype and cached 16-bit weights.

Autocast does not reach custom kernels, so the GEMM wrappers (fused linear+activation,
grouped expert GEMM) apply its rule themselves: under `torch.autocast(device, dtype=bf16|fp16)`
the activation is cast to the autocast dtype (a differentiable cast, so its gradient returns
in the caller's dtype) and each weight is replaced by a 16-bit copy; the kernels multiply
16-bit operands with fp32 accumulation and write 16-bit outputs, as `F.linear` under
autocast would. Weight gradients are written straight into the fp32 main weight's dtype
from the fp32 accumulator (no 16-bit rounding of dW, unlike autocast's matmul).

Weight copies: inside a `weight_copy_scope()` (the training step opens one around all its
microbatches, forward and backward) each parameter is cast once and the copy is reused by
every microbatch and by recomputation; the scope drops the copies when it closes, before the
optimizer changes the weights. Outside a scope every call casts afresh (always correct,
never stale). The copies hold 2 bytes per weight element of the layers that use these
kernels, for the length of the step. With 16-bit resident weights (`optim.param_dtype=bf16`,
dp/resident.py) the weights already have the compute dtype: no copy is made or cached, and
their gradients are bf16 (autograd's rule), accumulated into fp32 `main_grad`s by the reducer.
"""

from __future__ import annotations

import contextlib

import torch

_scope: dict[int, tuple[torch.Tensor, torch.dtype, torch.Tensor]] | None = None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on `x` computes in: autocast's dtype when autocast is on for x's
    device type (and x is floating point), else x.dtype."""
    device_type = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


@contextlib.contextmanager
def weight_copy_scope():
    """Cache the compute-dtype copies of weights for the duration of the block (one step).
    Nested scopes share the outer cache."""
    global _scope
    if _scope is not None:
        yield
        return
    _scope = {}
    try:
        yield
    finally:
        _scope = None


def weight_copy(weight: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """`weight` detached and cast to `dtype` (no copy when it already has it); inside a
    `weight_copy_scope` the cast is made once per parameter and reused."""
    if weight is None:
        return None
    if weight.dtype == dtype:
        return weight.detach()
    if _scope is None:
        return weight.detach().to(dtype)
    entry = _scope.get(id(weight))
    if entry is not None and entry[0] is weight and entry[1] == dtype:
        return entry[2]
    copy = weight.detach().to(dtype)
    _scope[id(weight)] = (weight, dtype, copy)  # holding `weight` keeps its id from being reused
    return copy


def forget_weight_copies(weights) -> None:
    """Drop the cached copies of `weights` (ZeRO-3 frees a unit's full weights after use; a
    later use casts the re-gathered weights afresh, with the same values)."""
    if _scope is not None:
        for weight in weights:
            _scope.pop(id(weight), None)


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """out (+)= a @ b with torch (`accumulate`: added to out's values). 16-bit operands into an
    fp32 `out` are accumulated in fp32 without a 16-bit rounding on CUDA (`out_dtype`, in
    place); elsewhere the product is computed in the operands' dtype and then cast."""
    if out.dtype == a.dtype:
        out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    elif a.is_cuda:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        product = torch.mm(a, b).to(out.dtype)
        out.add_(product) if accumulate else out.copy_(product)
