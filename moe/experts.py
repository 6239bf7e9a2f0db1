"""Local experts: the FFNs of this rank's experts, run as grouped GEMMs over variable-size
token groups (one launch per matrix, not a Python loop over experts).

Weights are stored expert-major, [E_local, in, out], so `grouped_matmul` multiplies each
contiguous token group by its expert's matrix. The full (layout-independent) weights are
[E, h, f] / [E, f, h]; experts are split over the ep group along dim 0 and each expert's ffn
dim over the etp group (column-parallel first matrix, row-parallel second: the caller sums
the etp partial outputs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.eager import eager
from meshtron.kernels import selfcheck
from meshtron.kernels.backend import CHECKED
from meshtron.kernels.operands import compute_dtype
from meshtron.moe.fp8_experts import fp8_grouped_eligible, fp8_grouped_matmul
from meshtron.mpu.init import normal_init, tag
from meshtron.mpu.mesh import expert_shard_checks
from meshtron.rules import raise_first


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: torch.Tensor,
    backend: str = "torch",
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[rows of group g] = x[rows of group g] @ weight[g] for consecutive row groups.

    x [N, in] sorted by group; weight [G, in, out]; group_sizes [G] (on device, no host sync).
    Uses torch's grouped GEMM (`F.grouped_mm`) where it applies: CPU, or CUDA with 16-bit
    dtypes, and row strides that are multiples of 16 bytes (its requirement). Otherwise (CUDA
    fp32, odd sizes) it pads the groups into one batched matmul: same result, more memory.
    backend="triton" runs `kernels.grouped_gemm` instead (one launch for all groups);
    "triton_checked" (kernels.backend=auto) does after the kernel passed its self-check
    (`kernels.selfcheck`), except where torch's own grouped GEMM is the faster choice
    (`grouped_backend`). Under autocast both paths compute in the autocast dtype (y has it;
    gradients return in x's and weight's own dtypes), like a matmul under autocast.
    `offsets`: `group_offsets(group_sizes)` when the caller has it (several GEMMs over the same
    groups compute it once; torch's path computes it when not given, Triton's needs none).
    Inside an `fp8_scope` (trainer.precision=fp8), with in/out widths multiples of 16, the GEMM
    runs by the FP8 recipe instead (moe/fp8_experts.py: e4m3 operands with row / column scales,
    fp32 accumulation, bf16 output, a bf16 weight gradient). No communication.
    """
    if fp8_grouped_eligible(x, weight, backend):
        return fp8_grouped_matmul(x, weight, group_sizes, backend, offsets)
    return selfcheck.dispatch(
        "grouped_gemm",
        grouped_backend(x, weight, backend),
        _grouped_gemm_triton,
        _grouped_matmul_torch,
        x,
        weight,
        group_sizes,
        offsets,
    )


def grouped_backend(x: torch.Tensor, weight: torch.Tensor, backend: str) -> str:
    """The grouped GEMM's path for `backend`: "torch" in place of the checked Triton kernel
    (kernels.backend=auto) where `native_grouped_mm_preferred` holds, else `backend` itself
    (a strict "triton" always runs the Triton kernel). This choice depends on the operands'
    dtype and shape, so it lives here with torch's grouped-GEMM rule, not in the name-only
    table of kernels/backend.py."""
    if backend == CHECKED and native_grouped_mm_preferred(x.device.type, compute_dtype(x), *weight.shape[1:]):
        return "torch"
    return backend


def native_grouped_mm_preferred(device_type: str, dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """Whether kernels.backend=auto multiplies with torch's own grouped GEMM rather than the
    Triton kernel: on CUDA with bf16 compute and 16-byte aligned rows, where `F.grouped_mm`
    runs a CUTLASS grouped GEMM. Measured on an H200 (2026-11-27, bench/moe_layer.py, bf16):
    the block's forward + backward at Mixtral-8x7B width (h 4096, ffn 14336, 4,096 tokens)
    took 17.1 ms with it against 24.6 ms with the Triton kernel, and 2.9 against 4.8 ms at
    h 256 (each pair on one machine). fp32 and fp16 on CUDA keep the Triton kernel (torch has
    no fast path there; its fp32 path pads the groups into a bmm); the CPU keeps whatever was
    asked for (the Triton interpreter is for tests)."""
    return (
        device_type == "cuda"
        and dtype == torch.bfloat16
        and _grouped_mm_applies(device_type, dtype, in_features, out_features)
    )


def _grouped_mm_applies(device_type: str, dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """`F.grouped_mm` takes these operands: rows of 16-byte multiples, on the CPU or in 16 bits."""
    aligned = all((n * dtype.itemsize) % 16 == 0 for n in (in_features, out_features))
    return aligned and (device_type == "cpu" or dtype in (torch.bfloat16, torch.float16))


def group_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """int32 end offset of every group (inclusive cumulative sum), as `F.grouped_mm` takes them."""
    return torch.cumsum(group_sizes, 0, dtype=torch.int32)


def _grouped_gemm_triton(
    x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    """`offsets` unused: the kernel sums the group sizes itself."""
    from meshtron.kernels import grouped_gemm

    return grouped_gemm.grouped_gemm(x, weight, group_sizes, backend="triton")


def _grouped_matmul_torch(
    x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, offsets: torch.Tensor | None
) -> torch.Tensor:
    # Autocast does not list grouped_mm: apply its matmul rule here (both operands in the
    # autocast dtype, differentiable casts), as the Triton path does (kernels/operands.py).
    # Without it a bf16 step mixes bf16 rows with fp32 weights and grouped_mm refuses them.
    dtype = compute_dtype(x)
    x, weight = x.to(dtype), weight.to(dtype)
    if _grouped_mm_applies(x.device.type, dtype, weight.shape[1], weight.shape[2]):
        if offsets is None:
            offsets = group_offsets(group_sizes)
        if dtype != torch.bfloat16 and torch.compiler.is_compiling():
            return _grouped_mm_eager(x, weight, offsets)
        return _grouped_mm(x, weight, offsets)
    return _padded_bmm(x, weight, group_sizes)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(F.grouped_mm(x.contiguous(), weight, offs=offsets))


# Outside bf16, grouped_mm's meta function refuses the operands (torch 2.13) though the CPU
# kernel takes them: under torch.compile (`trainer.compile`, fp32 on CPU) it runs eagerly, a
# graph break on each side of the GEMM.
_grouped_mm_eager = eager(_grouped_mm)


def _padded_bmm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    groups = weight.shape[0]
    starts = torch.cumsum(group_sizes, 0) - group_sizes
    group_of_row = torch.repeat_interleave(torch.arange(groups, device=x.device), group_sizes, output_size=x.shape[0])
    slot = torch.arange(x.shape[0], device=x.device) - starts[group_of_row]
    longest = int(group_sizes.max()) if groups else 0
    padded = x.new_zeros(groups, longest, x.shape[1])
    padded = padded.index_put((group_of_row, slot), x)
    out = torch.bmm(padded, weight)
    return out[group_of_row, slot]


class GroupedExperts(nn.Module):
    """This rank's `num_local_experts` FFNs (GeLU or SwiGLU, no biases), etp-sharded ffn dim.

    forward(x [N, h] sorted by local expert, group_sizes [E_local]) -> [N, h] partial sums over
    the etp group (the caller reduces them).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str,
        mesh,
        *,
        init_std: float,
        out_init_std: float,
        backend: str = "torch",
        device=None,
        dtype=None,
    ):
        super().__init__()
        ep, etp = mesh.par.ep, mesh.par.etp
        raise_first(expert_shard_checks(num_experts, ffn_hidden_size, 0, ep=ep, etp=etp, tp=1))
        self.activation = activation
        self.backend = backend
        local_e, local_f = num_experts // ep, ffn_hidden_size // etp
        h = hidden_size

        def weight(shape_full, shape_local, std, ffn_dim):
            return tag(
                nn.Parameter(torch.empty(shape_local, device=device, dtype=dtype)),
                normal_init(shape_full, std),
                expert_shards=((0, "ep"), (ffn_dim, "etp")),
            )

        self.w_up = weight((num_experts, h, ffn_hidden_size), (local_e, h, local_f), init_std, 2)
        self.w_gate = None
        if activation == "swiglu":
            self.w_gate = weight((num_experts, h, ffn_hidden_size), (local_e, h, local_f), init_std, 2)
        self.w_down = weight((num_experts, ffn_hidden_size, h), (local_e, local_f, h), out_init_std, 1)

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        # the same for all three GEMMs; the FP8 recipe picks its own path from the configured mode
        # (w_up's widths are w_down's, swapped: one FP8 verdict for all three)
        backend = (
            self.backend
            if fp8_grouped_eligible(x, self.w_up, self.backend)
            else grouped_backend(x, self.w_up, self.backend)
        )
        # shared by the torch path's three GEMMs (the Triton kernel sums the sizes itself)
        offsets = group_offsets(group_sizes) if backend == "torch" else None

        def gemm(rows, weight):  # a resolved backend resolves to itself: no second choice
            return grouped_matmul(rows, weight, group_sizes, backend, offsets)

        up = gemm(x, self.w_up)
        hidden = (
            F.gelu(up, approximate="tanh")
            if self.w_gate is None
            else expert_swiglu(gemm(x, self.w_gate), up, self.backend)
        )
        return gemm(hidden, self.w_down)


def expert_swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str) -> torch.Tensor:
    """silu(gate) * up: the fused Triton kernels (`kernels.swiglu`) under kernels.backend=triton,
    and under auto (checked once) from `kernels.backend.AUTO_TRITON_MIN_ELEMENTS` elements up;
    torch's ops otherwise and inside torch.compile, whose inductor fuses them itself. No
    communication."""
    if torch.compiler.is_compiling():
        return _swiglu_torch(gate, up)
    return selfcheck.dispatch("swiglu", backend, _swiglu_triton, _swiglu_torch, gate, up)


def _swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from meshtron.kernels import swiglu  # imports Triton: only when a Triton backend runs (see _grouped_gemm_triton)

    return swiglu.swiglu(gate, up, backend="triton")


def expert_out_init_std(init_std: float, num_layers: int) -> float:
    """Scaled init of the second expert matrix, as for the dense MLP's row-parallel output."""
    return init_std / math.sqrt(2 * num_layers)
