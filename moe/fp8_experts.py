"""FP8 grouped GEMMs of the routed experts (`trainer.precision=fp8`): the dense recipe of
mpu/fp8.py applied per expert.

Recipe, for the token rows x [N, K] sorted by expert and an expert's weight W_g [K, N_out]:

    forward   y  = x W_g      x quantized per row over K, W_g per output column over K (one
                              scale per expert and column): y[m, n] = s_x[m] s_w[g, n]
                              sum_k q_x[m, k] q_w[g, k, n], fp32 accumulation, bf16 output
    backward  dx = dy W_g^T   dy quantized per row over N_out, W_g per input row (a column of
                              W_g^T) over N_out: the same product on W_g^T
              dW_g = x_g^T dy_g   in bf16 (a 16-bit grouped GEMM, as the dense recipe's dW)

Scales are mpu/fp8.py `quantize`'s: amax / 448 in fp32 (1 for an all-zero row). The GEMMs
take FP8 inside an `fp8_scope` when K and N_out are multiples of 16 (the rows may be any
number, groups of 0 rows included); otherwise they stay in the compute dtype, as the dense
linears do. The scope's `per_tensor` setting does not apply here: expert GEMMs always scale
per row / per column.

Where the FP8 product runs (`fp8_grouped_path`):
* "scaled_grouped_mm": CUDA compute capability 9.0 / 10.0 -- torch's `_scaled_grouped_mm`
  (CUTLASS rowwise FP8 grouped GEMM): x row-major [N, K], the weight column-major
  ([G, K, N_out] viewed on [G, N_out, K] storage), scales [N] and [G, N_out] fp32, offsets
  int32 inclusive ends, bf16 output; K and N_out multiples of 16. torch checks no alignment of
  the group boundaries in this 2-D x 3-D form (each group's start moves x's pointer by whole
  rows of K bytes, 16-byte aligned when K is), so groups are neither padded nor refused.
* "triton": kernels/grouped_gemm.py `grouped_gemm_fp8` (e4m3 tiles into `tl.dot`, fp32
  accumulator, scales in the epilogue) -- kernels.backend=triton everywhere (the CPU under
  TRITON_INTERPRET=1), and under kernels.backend=auto on CUDA without `_scaled_grouped_mm`
  (sm_89) once kernels/measured.json records it faster there ("grouped_gemm_fp8"; not yet:
  it has not run on a GPU, and no self-check is wired for it either).
* "emulated": the operands dequantized to fp32 and multiplied in fp32, rounded to bf16 --
  the CPU (tests, smoke runs) and the reference the other two are tested against. Same
  quantized numbers, only the fp32 summation order differs.
* "bf16": CUDA without `_scaled_grouped_mm` and without a measured Triton kernel (sm_89
  today): no FP8 for the experts there, they stay bf16 (an emulation would only be slower).
No communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.kernels.backend import CHECKED, auto_runs_torch, triton_available
from meshtron.mpu.fp8 import fp8_active, quantize

PATHS = ("scaled_grouped_mm", "triton", "emulated")
SCALED_GROUPED_MM_CAPABILITIES = ((9, 0), (10, 0))  # torch's _scaled_grouped_mm_cuda accepts these


def fp8_grouped_eligible(x: torch.Tensor, weight: torch.Tensor, backend: str = "torch") -> bool:
    """Whether the grouped GEMM of x [N, K] and weight [G, K, N_out] runs in FP8 here: inside
    an `fp8_scope`, with K and N_out multiples of 16, on a device with a fast FP8 path under the
    resolved kernel `backend` (`fp8_grouped_path` not "bf16")."""
    return (
        fp8_active()
        and all(d > 0 and d % 16 == 0 for d in weight.shape[1:])
        and fp8_grouped_path(x.device, backend) != "bf16"
    )


def fp8_grouped_path(device: torch.device, backend: str) -> str:
    """Which implementation multiplies the FP8 operands on `device` under the resolved kernel
    `backend` (torch | triton | triton_checked): see the module docstring."""
    if backend == "triton":
        return "triton"
    if device.type != "cuda":
        return "emulated"
    capability = torch.cuda.get_device_capability(device)
    if capability in SCALED_GROUPED_MM_CAPABILITIES and hasattr(torch, "_scaled_grouped_mm"):
        return "scaled_grouped_mm"
    if backend == CHECKED and triton_available() and not auto_runs_torch("grouped_gemm_fp8", "cuda"):
        return "triton"
    return "bf16"  # a GPU with no fast FP8 grouped GEMM: the experts stay bf16 (emulating is slower)


def group_ends(group_sizes: torch.Tensor) -> torch.Tensor:
    """int32 inclusive end offset of every group (torch's grouped GEMMs' `offs`)."""
    return torch.cumsum(group_sizes, 0, dtype=torch.int32)


def grouped_fp8_product(
    a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, offsets: torch.Tensor, path: str
) -> torch.Tensor:
    """bf16 y[rows of g] = a[rows of g] @ b[g] in FP8: a [N, K] quantized per row over K, b
    [G, K, N_out] per column over K (per expert), fp32 accumulation, by `path` (`PATHS`)."""
    a_q, a_s = quantize(a, -1)  # [N, K], [N, 1]
    # b per column over K = b^T per row, stored [G, N_out, K]: b_q is then column-major (K-major),
    # the layout _scaled_grouped_mm requires and the one fp8 wgmma reads without a transpose
    bt_q, bt_s = quantize(b.transpose(1, 2).contiguous(), -1)
    b_q, b_s = bt_q.transpose(1, 2), bt_s.transpose(1, 2)  # [G, K, N_out], [G, 1, N_out]
    if path == "scaled_grouped_mm":
        groups, n_out = bt_s.shape[:2]
        return torch._scaled_grouped_mm(
            a_q, b_q, a_s.view(-1), bt_s.view(groups, n_out), offs=offsets, out_dtype=torch.bfloat16
        )
    if path == "triton":
        from meshtron.kernels import grouped_gemm  # imports Triton: only when this path runs

        return grouped_gemm.grouped_gemm_fp8(a_q, a_s, b_q, b_s, group_sizes, torch.bfloat16)
    if path != "emulated":
        raise ValueError(f"FP8 grouped GEMM path {path!r} must be one of {', '.join(PATHS)}")
    return emulated_grouped_mm(a_q.float() * a_s, b_q.float() * b_s, group_sizes, offsets).to(torch.bfloat16)


def emulated_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """fp32 y[rows of g] = a[rows of g] @ b[g]: torch's grouped GEMM on the CPU, a padded
    batched matmul elsewhere (fp32 grouped GEMMs exist on the CPU only)."""
    if a.device.type == "cpu":
        return F.grouped_mm(a, b, offs=offsets)
    groups = b.shape[0]
    group_of_row = torch.repeat_interleave(torch.arange(groups, device=a.device), group_sizes, output_size=a.shape[0])
    slot = torch.arange(a.shape[0], device=a.device) - (offsets.long() - group_sizes)[group_of_row]
    padded = a.new_zeros(groups, int(group_sizes.max()) if groups else 0, a.shape[1])
    padded = padded.index_put((group_of_row, slot), a)
    return torch.bmm(padded, b)[group_of_row, slot]


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """dW[g] = x[rows of g]^T @ dy[rows of g], [G, K, N_out], in x's (16-bit) dtype: torch's
    grouped GEMM with the rows as the grouped reduction (zeros for an empty group)."""
    return F.grouped_mm(x.t(), dy, offs=offsets)


class Fp8GroupedMatmul(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ weight[g] with the FP8 forward and input-gradient grouped
    GEMMs and a bf16 weight gradient; x and weight arrive in bf16 (the compute dtype)."""

    @staticmethod
    def forward(ctx, x, weight, group_sizes, offsets, path):
        ctx.path = path
        ctx.save_for_backward(x, weight, group_sizes, offsets)
        return grouped_fp8_product(x, weight, group_sizes, offsets, path)

    @staticmethod
    def backward(ctx, dy):
        x, weight, group_sizes, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_fp8_product(dy, weight.transpose(1, 2), group_sizes, offsets, ctx.path).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = grouped_weight_grad(x, dy.to(x.dtype), offsets).to(weight.dtype)
        return dx, dw, None, None, None


def fp8_grouped_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: torch.Tensor,
    backend: str = "torch",
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' grouped GEMM y[rows of g] = x[rows of g] @ weight[g] by the FP8 recipe
    above (x [N, K] sorted by group, weight [G, K, N_out], group_sizes [G] on device): the
    operands are cast to bf16 first (differentiably, as autocast would), y is bf16, gradients
    return in x's and weight's own dtypes. `backend`: the resolved kernels backend, which picks
    the path (`fp8_grouped_path`). No communication."""
    path = fp8_grouped_path(x.device, backend)
    if offsets is None:
        offsets = group_ends(group_sizes)
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    with torch.autocast(x.device.type, enabled=False):
        return Fp8GroupedMatmul.apply(x.contiguous(), weight, group_sizes, offsets, path)
