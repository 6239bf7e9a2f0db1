"""FP8 GEMMs for the dense linears: e4m3 operands with per-row (or per-tensor) scales and
fp32 accumulation, bf16 everywhere else (`trainer.precision=fp8`).

Recipe (torchao's "rowwise with a high-precision weight gradient"; Transformer Engine and
DeepSeek-V3 train in FP8 the same way, with finer scale blocks):

    forward   y  = x W^T      x quantized per row over K, W per row over K (its output
                              channels): y[m, n] = s_x[m] s_w[n] sum_k q_x[m, k] q_w[n, k]
    backward  dx = dy W       dy quantized per row over N, W per column over N
              dW = dy^T x     in bf16 (a 16-bit GEMM: the weight gradient keeps its precision)

Each scale is the amax of the numbers it covers over e4m3's largest finite value (448), so
the largest one maps to 448 and nothing saturates; an all-zero row gets scale 1. With
`per_tensor` one scale covers the whole operand (sm_89's only mode in torch). Scales are
fp32; the product of the two scales is applied to the fp32 accumulator before the bf16
output is rounded, by `torch._scaled_mm` (cuBLASLt on sm_89/sm_90; on the CPU torch
computes the same numbers with a reference kernel, which is how the tests check the
numerics without a GPU).

`fp8_scope(per_tensor)` turns the FP8 path on for the linears of mpu/mappings.py inside it
(the training step opens it inside bf16 autocast, training/precision.py); outside a scope,
or for operands `_scaled_mm` cannot take (a dimension not a multiple of 16), the GEMM runs
in the autocast dtype as before. The LM head, the embeddings and attention's own matmuls stay
bf16. The routed experts' grouped GEMMs follow the same recipe per expert inside the scope
(moe/fp8_experts.py: rows per row, each expert's weight per output column forward and per
input row for dx, dW in bf16; torch's `_scaled_grouped_mm` on sm_90, a Triton FP8 grouped
kernel elsewhere on CUDA, a dequantized fp32 emulation on the CPU). No communication.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: FP8 tensor cores
_ALIGN = 16  # _scaled_mm needs every GEMM dimension to be a multiple of 16

_active: dict | None = None  # {"per_tensor": bool} inside an fp8_scope


@contextlib.contextmanager
def fp8_scope(per_tensor: bool = False):
    """Run the dense linears' GEMMs in FP8 inside the block (per-row scales, or one per
    operand with `per_tensor`). Nested scopes keep the outer one's setting."""
    global _active
    if _active is not None:
        yield
        return
    _active = {"per_tensor": per_tensor}
    try:
        yield
    finally:
        _active = None


@contextlib.contextmanager
def fp8_paused():
    """Inside an `fp8_scope`, run the block's linears in the compute dtype (the LM head)."""
    global _active
    saved, _active = _active, None
    try:
        yield
    finally:
        _active = saved


def fp8_active() -> bool:
    """True inside an `fp8_scope`."""
    return _active is not None


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """(whether FP8 GEMMs run on `device`, why not): CUDA of compute capability 8.9 or newer,
    or the CPU (torch's reference kernel, for tests and smoke runs)."""
    if device.type == "cpu":
        return True, ""
    if device.type != "cuda":
        return False, f"FP8 GEMMs run on CUDA GPUs of compute capability >= 8.9 (not {device.type})"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        major, minor = capability
        return False, f"FP8 GEMMs need compute capability >= 8.9 (Ada, Hopper); this GPU has {major}.{minor}"
    return True, ""


def quantize(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x ~= q.float() * scale with q in e4m3. `dim` is the reduction dimension each
    scale covers (-1: one scale per row, kept as [rows, 1]; 0: one per column, [1, cols]);
    None: one scale for the whole tensor (a 0-d tensor). scale = amax / 448 in fp32 (1 where
    the amax is 0)."""
    x32 = x.float()
    amax = x32.abs().amax() if dim is None else x32.abs().amax(dim=dim, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x32 / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def _fits(*dims: int) -> bool:
    return all(d % _ALIGN == 0 and d > 0 for d in dims)


def _scaled_mm(a_q, a_scale, b_q, b_scale, out_dtype):
    """a_q [M, K] row-major times b_q [K, N] column-major, each with its scale, into out_dtype."""
    return torch._scaled_mm(a_q, b_q, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


def fp8_matmul_nt(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, per_tensor: bool) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T in FP8: both quantized over K (per row, or one scale each with
    `per_tensor`), fp32 accumulation, out_dtype output."""
    a_q, a_s = quantize(a, None if per_tensor else -1)
    b_q, b_s = quantize(b, None if per_tensor else -1)
    return _scaled_mm(a_q, a_s, b_q.t(), b_s if per_tensor else b_s.t(), out_dtype)


def fp8_mode(x: torch.Tensor, weight: torch.Tensor) -> bool | None:
    """How a linear of x [..., K] and weight [N, K] runs here: None (not in FP8: outside a scope,
    or a GEMM dimension -- rows, K or N -- not a multiple of 16), else the scope's `per_tensor`.
    Decided in forward and kept for the backward (which may run outside the scope)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if _active is None or not _fits(rows, weight.shape[0], weight.shape[1]):
        return None
    return _active["per_tensor"]


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: bool | None) -> torch.Tensor:
    """x W^T + b: FP8 under `mode` (see `fp8_mode`), else F.linear."""
    if mode is None:
        return F.linear(x, weight, bias)
    y = fp8_matmul_nt(x.reshape(-1, x.shape[-1]), weight, x.dtype, mode)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, mode: bool | None) -> torch.Tensor:
    """dy W for dy [..., N], weight [N, K]: FP8 under `mode` (dy per row over N, W per column
    over N), else a matmul in dy's dtype."""
    if mode is None:
        return grad.matmul(weight)
    g2 = grad.reshape(-1, grad.shape[-1])
    return fp8_matmul_nt(g2, weight.t().contiguous(), grad.dtype, mode).view(*grad.shape[:-1], weight.shape[1])


class Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with the FP8 forward and input-gradient GEMMs and a 16-bit weight
    gradient; x and W arrive in the compute dtype (autocast's copies). Saves x and W."""

    @staticmethod
    def forward(ctx, x, weight, bias, mode):
        ctx.has_bias, ctx.mode = bias is not None, mode
        ctx.save_for_backward(x, weight)
        return linear_forward(x, weight, bias, mode)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_input = linear_input_grad(grad, weight, ctx.mode) if ctx.needs_input_grad[0] else None
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or inside an `fp8_scope` (eligible shapes) the FP8 recipe above, the operands
    cast to autocast's dtype first as F.linear under autocast would."""
    mode = fp8_mode(x, weight)
    if mode is None:
        return F.linear(x, weight, bias)
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    x, weight = x.to(dtype), weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device_type, enabled=False):
        return Fp8Linear.apply(x, weight, bias, mode)
