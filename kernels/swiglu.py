"""SwiGLU of two equal-shape tensors, silu(gate) * up, forward and backward in one pass each.

The MoE experts' activation (moe/experts.py) between their grouped GEMMs. In torch it is
three kernels forward (silu, mul; plus the mul's saved inputs) and three backward (two muls,
silu_backward), each reading or writing a [rows, ffn] tensor; at Mixtral-8x7B's width that
is ~0.8 ms of an 18 ms block on an H200 (bench/README.md, session 16). Here:

    `_swiglu_fwd_kernel`  out = silu(g) * u                     reads g, u; writes out
    `_swiglu_bwd_kernel`  du = dout * silu(g)                    reads g, u, dout;
                          dg = dout * u * s * (1 + g (1 - s))    writes dg, du  (s = sigmoid(g))

in fp32 registers, rounded once to the operands' dtype; only g and u are saved for backward
(torch saves silu(g) too). Elementwise on contiguous memory; autotuned once per dtype (no
size in the key: row counts change from step to step at ep > 1). No communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels.backend import interpreting, triton_available
from meshtron.kernels.launch import launch

__all__ = ["swiglu", "swiglu_reference"]


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in plain torch (the `torch` backend)."""
    return F.silu(gate) * up


if triton_available():
    import triton
    import triton.language as tl

    def gpu_configs() -> list:
        """Ampere/Hopper candidates: elements per program."""
        return [
            triton.Config({"BLOCK": 1024}, num_warps=4),
            triton.Config({"BLOCK": 2048}, num_warps=8),
            triton.Config({"BLOCK": 4096}, num_warps=8),
        ]

    def _configs() -> list:
        # One config under the interpreter (more need a driver to benchmark); 128 keeps the
        # masking exercised over several programs in the CPU tests.
        return [triton.Config({"BLOCK": 128}, num_warps=4)] if interpreting() else gpu_configs()

    @triton.autotune(configs=_configs(), key=[])
    @triton.jit
    def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)

    # Autotuning reruns the kernel: it only writes dgate / dup, which every run overwrites.
    @triton.autotune(configs=_configs(), key=[])
    @triton.jit
    def _swiglu_bwd_kernel(gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(dup_ptr + offs, (d * g * s).to(dup_ptr.dtype.element_ty), mask=mask)
        tl.store(dgate_ptr + offs, (d * u * s * (1.0 + g * (1.0 - s))).to(dgate_ptr.dtype.element_ty), mask=mask)

    def _grid(n: int):
        return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up by the two Triton kernels; saves gate and up."""

    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        if gate.numel():
            launch(_swiglu_fwd_kernel, _grid(gate.numel()), (gate.dtype, gate.device), gate, up, out, gate.numel())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        if gate.numel():
            key = (gate.dtype, dout.dtype, gate.device)
            launch(_swiglu_bwd_kernel, _grid(gate.numel()), key, gate, up, dout, dgate, dup, gate.numel())
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """silu(gate) * up for equal-shape, equal-dtype tensors; backend "torch"
    (`swiglu_reference`) or "triton" (the fused kernels; on CPU only under TRITON_INTERPRET=1).
    Differentiable in both. No communication."""
    if backend == "torch":
        return swiglu_reference(gate, up)
    if backend != "triton":
        raise ValueError(f"swiglu backend={backend!r} must be 'torch' or 'triton'")
    if not triton_available():
        raise RuntimeError("swiglu backend='triton' needs the triton package (pip install triton)")
    if gate.device.type != "cuda" and not interpreting():
        raise RuntimeError("swiglu backend='triton' on CPU runs only under TRITON_INTERPRET=1 (tests)")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu needs gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    return _SwiGLU.apply(gate, up)
