"""Fused column-parallel linear + activation: the first MLP layer, with the activation in
the matmul epilogue.

* `linear_gelu(x, weight, bias, approximate)`   = gelu(x @ weight.T + bias)
* `linear_swiglu(x, w_gate, b_gate, w_up, b_up)` = silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)

x is [..., K], weights are [N, K], biases [N] or None; the output is [..., N] in the compute
dtype. `backend="torch"` runs the plain-torch reference (`*_reference`), `backend="triton"`
the Triton kernels (on CPU only under TRITON_INTERPRET=1).

Triton path (fp32 accumulation throughout), by default without recomputation:

forward   one matmul of x with W^T (W [N, K] row-major: the GEMM's B operand transposed;
          for SwiGLU two accumulators, gate and up, fed by the same x tile), bias add and
          activation in fp32 in the epilogue; writes the activated output and the
          pre-activation(s) z (SwiGLU: [z_gate | z_up], [M, 2N]) in the compute dtype. Saved
          for backward: x, the weight copies and z -- torch eager saves the same for GeLU
          (x, W, z) and one more [M, N] tensor for SwiGLU (silu(z_gate) beside z_gate and z_up).
          Which kernel (`forward_plan`):
          - on CUDA, persistent (kernels/gemm.py's schedule): a grid of min(#SMs, #tiles)
            programs, program p computing output tiles p, p + grid, ... in grouped order (runs
            of GROUP_M tiles share W's tile in L2); the epilogue cut into `SUBTILES` column
            slices (<= 32 accumulator values per thread each: 128 accumulators plus gelu's
            temporaries of a whole 128x256 tile spill). The first call of a (kernel, shapes,
            dtype, flags, SMs) key autotunes, later ones launch the cached config directly.
            `linear_gelu_tma_kernel` / `linear_swiglu_tma_kernel` on sm_90+ when x and the
            weights are 16-bit and TMA-loadable (unit stride, 16-byte aligned base and rows:
            K % 8 == 0 for contiguous operands; both SwiGLU weights laid out alike): tiles
            loaded through host-side TensorDescriptors, W's [BLOCK_N, BLOCK_K] tile
            transposed in shared memory; otherwise `_linear_*_persistent_kernel` with masked
            pointer loads (sm_80, fp32, odd K or strides). Candidates: GeLU the persistent
            GEMMs' (Hopper 128x256 / 256x128 / BK 128 tiles kept on sm_90 for 16-bit), SwiGLU
            the dual tiles plus 128x128 per accumulator on 8 warps (sm_90, 16-bit: its two
            accumulators are counted by the pruning). No split-K: the activation needs whole
            dot products, and the forward has enough tiles for whole waves to dominate
            (gpt_1b tp=4 [4096, 1408]: 192 tiles of 128x256 = 1.45 waves on 132 SMs, 352 of
            128x128 = 2.7, the autotuner weighs the tail; 8B-class [8192, 14336]: 3584 of
            128x256, SwiGLU 7168 of 128x128).
          - `linear_gelu_fwd_kernel` / `linear_swiglu_fwd_kernel`, one program per tile
            through the autotuner: the interpreter's default and `persistent=False`.
          Test switches of `linear_gelu` / `linear_swiglu`: `persistent`, `tma` (True: the
          descriptor kernel wherever the operands allow, also off Hopper), `num_sms`.
backward  (1) `linear_gelu_grad_kernel` / `linear_swiglu_grad_kernel`, elementwise: the pre-activation
          gradient g = dy * act'(z) ([M, N]; SwiGLU [M, 2N] = [g_gate | g_up]);
          (2) two plain GEMMs (kernels/gemm.py `matmul`, Triton or cuBLAS by `gemm_backend`):
          dx = g @ W (SwiGLU: g_gate @ W_gate + g_up @ W_up, one launch) and dW = g^T @ x
          (SwiGLU: one GEMM over [g_gate | g_up]^T giving [dW_gate; dW_up]), dW written in
          the main weights' dtype; db = g.sum(0) is a torch reduction.
          Three GEMMs per linear, as torch runs.

`recompute=True` (opt-in memory mode): the forward (the same kernel choice, SAVE_PRE off)
writes only the output and saves x; the backward's one-program-per-tile `_linear_*_bwd_kernel`
recomputes the pre-activation tile(s) with the forward's matmul and writes g from it (a fourth
GEMM, no [M, N] tensor kept between the passes).

Precision: under autocast (trainer.precision=bf16|fp16) x and the weights are cast to the
autocast dtype (16-bit weight copies made once per step, kernels/operands.py) and every
matmul multiplies 16-bit tiles with fp32 accumulation (tensor cores); z is stored rounded
to 16 bits, as torch's F.linear output is. fp32 inputs use tf32 dots only when
`kernels.tf32` allows it (kernels/tf32.py); the dot precision is part of the autotune key.
On the interpreter tiles are cast to fp32 before `tl.dot` (bf16 dots are wrong there) and a
single autotune config is used (the persistent kernels' with 4 epilogue slices); on a GPU the
configs (kernels/gemm.py `gpu_configs`, `persistent_gpu_configs` here) are pruned per device
(kernels/configs.py) and autotuned.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from meshtron.kernels import gemm
from meshtron.kernels.backend import interpreting
from meshtron.kernels.gemm import GEMM_BACKENDS, dot_flags, grid_2d, matmul
from meshtron.kernels.launch import launch
from meshtron.kernels.linear_act_kernels import ACT_GELU_NONE, ACT_GELU_TANH, ACT_SWIGLU, tma_block_shapes
from meshtron.kernels.operands import compute_dtype, weight_copy

try:  # the torch backend works without triton
    import triton
    import triton.language as tl

    from meshtron.kernels.linear_act_kernels import (
        linear_gelu_bwd_kernel,
        linear_gelu_fwd_kernel,
        linear_gelu_grad_kernel,
        linear_gelu_persistent_kernel,
        linear_gelu_tma_kernel,
        linear_swiglu_bwd_kernel,
        linear_swiglu_fwd_kernel,
        linear_swiglu_grad_kernel,
        linear_swiglu_persistent_kernel,
        linear_swiglu_tma_kernel,
    )
except ImportError:  # pragma: no cover
    triton = None
    tl = None

__all__ = [
    "linear_gelu",
    "linear_swiglu",
    "linear_gelu_reference",
    "linear_swiglu_reference",
]

GELU_APPROXIMATIONS = ("tanh", "none")

# ----------------------------------------------------------------------------- references


def linear_gelu_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, approximate: str = "tanh"
) -> torch.Tensor:
    """gelu(x @ weight.T + bias) in plain torch; x [..., K], weight [N, K], bias [N] or None,
    `approximate` "tanh" or "none" (erf). Output [..., N]."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} must be one of {GELU_APPROXIMATIONS}")
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def linear_swiglu_reference(
    x: torch.Tensor, w_gate: torch.Tensor, b_gate: torch.Tensor | None, w_up: torch.Tensor, b_up: torch.Tensor | None
) -> torch.Tensor:
    """silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up) in plain torch; x [..., K], weights
    [N, K], biases [N] or None. Output [..., N]."""
    return F.silu(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)


# ----------------------------------------------------------------------------- launch helpers

# the forward kernels by name (`ForwardPlan.kernel`)
_FWD_KERNELS = (
    {
        "linear_gelu_fwd_kernel": linear_gelu_fwd_kernel,
        "linear_gelu_persistent_kernel": linear_gelu_persistent_kernel,
        "linear_gelu_tma_kernel": linear_gelu_tma_kernel,
        "linear_swiglu_fwd_kernel": linear_swiglu_fwd_kernel,
        "linear_swiglu_persistent_kernel": linear_swiglu_persistent_kernel,
        "linear_swiglu_tma_kernel": linear_swiglu_tma_kernel,
    }
    if triton is not None
    else {}
)


def _check(x, weights, biases):
    """Operands as the kernels take them: x and the weight copies in one compute dtype on one
    device; biases (fp32 main or 16-bit, read in fp32) on that device."""
    if triton is None:
        raise RuntimeError("backend='triton' needs the triton package")
    if x.device.type != "cuda" and not interpreting():
        raise RuntimeError("backend='triton' on CPU runs only under TRITON_INTERPRET=1 (tests); use backend='torch'")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"linear_act: unsupported dtype {x.dtype} (fp32/fp16/bf16)")
    for w in weights:
        if w.dtype != x.dtype or w.device != x.device:
            raise TypeError(f"linear_act: weight {w.dtype} on {w.device} does not match x {x.dtype} on {x.device}")
    for b in biases:
        if b is not None and (not b.is_floating_point() or b.device != x.device):
            raise TypeError(f"linear_act: bias {b.dtype} on {b.device} must be floating point on {x.device}")


class ForwardPlan(NamedTuple):
    """Which forward kernel runs (`forward_plan`): its name, the TMA layouts of (x, W^T)
    ("n": row-major, "t": transposed; None off the TMA kernels) and the SMs of a persistent
    grid (0: one program per tile)."""

    kernel: str
    layouts: tuple | None
    num_sms: int


def forward_plan(x2, weights, persistent=None, tma=None, num_sms=None) -> ForwardPlan:
    """The forward kernel for 2-D x2 [M, K] and the weight copies (one: GeLU, two: SwiGLU):
    persistent (default on CUDA; `persistent=False`, and the interpreter's default, is one
    program per tile), through TMA descriptors (default on sm_90+; `tma=True` also elsewhere,
    e.g. the interpreter) when x and the weights are 16-bit and TMA-loadable (kernels/gemm.py
    `tma_layout`: unit stride, 16-byte aligned base and row stride; both weights laid out
    alike), with pointer loads otherwise. `num_sms` overrides the SM count of the grid."""
    name = "swiglu" if len(weights) == 2 else "gelu"
    if persistent is None:
        persistent = x2.device.type == "cuda"
    if not persistent:
        return ForwardPlan(f"linear_{name}_fwd_kernel", None, 0)
    sms, major = gemm.device_info(x2.device)
    sms = num_sms or sms
    if tma is None:
        tma = major >= 9
    if tma and gemm.TensorDescriptor is not None and x2.dtype in gemm.TMA_DTYPES and x2.shape[1] > 0:
        lx = gemm.tma_layout(x2)
        lw = {gemm.tma_layout(w.t()) for w in weights}
        if lx is not None and len(lw) == 1 and None not in lw:
            return ForwardPlan(f"linear_{name}_tma_kernel", (lx, lw.pop()), sms)
    return ForwardPlan(f"linear_{name}_persistent_kernel", None, sms)


def _linear_act_fwd(x2, weights, biases, act, save_pre, persistent=None, tma=None, num_sms=None):
    """Triton forward on 2-D x2 [M, K]: (out [M, N], z) in x2.dtype, z the pre-activation
    ([M, N]; SwiGLU [M, 2N] = [z_gate | z_up]) when `save_pre`, else None. The kernel is
    `forward_plan`'s (`persistent`, `tma`, `num_sms` as there)."""
    M, K = x2.shape
    N = weights[0].shape[0]
    out = torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    z = torch.empty((M, len(weights) * N), device=x2.device, dtype=x2.dtype) if save_pre else None
    if M == 0 or N == 0:
        return out, z
    plan = forward_plan(x2, weights, persistent, tma, num_sms)
    cast, prec = dot_flags(x2.dtype)
    flags = dict(SAVE_PRE=save_pre, CAST_F32=cast, PRECISION=prec)
    if act == ACT_SWIGLU:
        flags.update(HAS_BG=biases[0] is not None, HAS_BU=biases[1] is not None)
    else:
        flags.update(HAS_BIAS=biases[0] is not None, APPROX_TANH=act == ACT_GELU_TANH)
    if plan.layouts is not None:
        flags.update(A_T=plan.layouts[0] == "t", B_T=plan.layouts[1] == "t")
    pre = out if z is None else z  # an unused pointer without SAVE_PRE
    pre_up = z[:, N:] if save_pre and act == ACT_SWIGLU else pre
    sizes = (M, N, K)
    tail = (out.stride(0), out.stride(1), pre.stride(0), pre.stride(1))

    def args(blocks):
        """The kernel's arguments; x and the weights as TMA descriptors with `blocks`, or as
        pointers with their strides (blocks None). A missing bias: a stand-in pointer."""
        if blocks is None:
            operands = (x2, *weights)
            strides = (x2.stride(0), x2.stride(1), *(s for w in weights for s in w.stride()))
        else:
            lx, lw = plan.layouts
            operands = (gemm.descriptor(x2, lx, blocks["x_desc"]),)
            operands += tuple(gemm.descriptor(w.t(), lw, blocks["w_desc"]) for w in weights)
            strides = ()
        bs = tuple(out if b is None else b for b in biases)
        if act == ACT_SWIGLU:
            head = (operands[0], operands[1], bs[0], operands[2], bs[1], out, pre, pre_up)
        else:
            head = (operands[0], operands[1], bs[0], out, pre)
        return (*head, *sizes, *strides, *tail)

    kernel = _FWD_KERNELS[plan.kernel]
    if plan.num_sms == 0:  # one program per tile, through the autotuner
        kernel[grid_2d(M, N)](*args(None), **flags)
    else:
        _launch_persistent(kernel, plan, args, flags, x2, N)
    return out, z


def _launch_persistent(kernel, plan: ForwardPlan, args, flags: dict, x2, N: int) -> None:
    """Launch a persistent forward kernel on min(SMs, output tiles) programs through
    kernels/launch.py (the autotuner on a key's first call, the remembered config afterwards).
    `args(blocks)` builds the arguments: TMA descriptors with `blocks` (the config's tiles;
    placeholders on the first call, the configs' pre-hook sets each candidate's), or pointers
    (`blocks` None)."""
    M, K = x2.shape
    key = (plan.kernel, plan.layouts, M, N, K, x2.dtype, tuple(flags.items()), plan.num_sms, x2.device)

    def grid(meta):
        return (min(plan.num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)

    def args_for(meta):
        if plan.layouts is None:
            return args(None)
        return args(tma_block_shapes(meta or {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, **flags}))

    launch(kernel, grid, key, args_for=args_for, **flags)


def _grad_from_saved(z, dy, g, act, N):
    """g = dy * act'(z) by the elementwise kernels (z, g: [M, N] or, SwiGLU, [M, 2N])."""
    M = z.shape[0]
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()

    def grid(meta):
        return triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"])

    key = (N, act, z.dtype, dy.dtype, g.dtype, z.device)
    if act == ACT_SWIGLU:
        launch(linear_swiglu_grad_kernel, grid, key, z, dy, g, M, N, z.stride(0), dy.stride(0), g.stride(0))
    else:
        args = (z, dy, g, M, N, z.stride(0), dy.stride(0), g.stride(0))
        launch(linear_gelu_grad_kernel, grid, key, *args, APPROX_TANH=act == ACT_GELU_TANH)


def _grad_recomputed(x2, weights, biases, act, dy, g):
    """g = dy * act'(z) with z recomputed from x2 and the weights by the recompute kernels."""
    M, K = x2.shape
    N = weights[0].shape[0]
    cast, prec = dot_flags(x2.dtype)
    if act == ACT_SWIGLU:
        (wg, wu), (bg, bu) = weights, biases
        linear_swiglu_bwd_kernel[grid_2d(M, N)](
            x2,
            wg,
            bg if bg is not None else wg,
            wu,
            bu if bu is not None else wu,
            dy,
            g[:, :N],
            g[:, N:],
            M,
            N,
            K,
            x2.stride(0),
            x2.stride(1),
            wg.stride(0),
            wg.stride(1),
            wu.stride(0),
            wu.stride(1),
            dy.stride(0),
            dy.stride(1),
            g.stride(0),
            g.stride(1),
            HAS_BG=bg is not None,
            HAS_BU=bu is not None,
            CAST_F32=cast,
            PRECISION=prec,
        )
    else:
        (w,), (b,) = weights, biases
        linear_gelu_bwd_kernel[grid_2d(M, N)](
            x2,
            w,
            b if b is not None else w,
            dy,
            g,
            M,
            N,
            K,
            x2.stride(0),
            x2.stride(1),
            w.stride(0),
            w.stride(1),
            dy.stride(0),
            dy.stride(1),
            g.stride(0),
            g.stride(1),
            HAS_BIAS=b is not None,
            APPROX_TANH=act == ACT_GELU_TANH,
            CAST_F32=cast,
            PRECISION=prec,
        )


def _linear_act_bwd(x2, weights, biases, act, dy, z, needs, dw_dtype, gemm_backend):
    """Triton backward on 2-D tensors: (dx, *dweights, *dbiases), None where not needed.
    `weights` are the compute-dtype copies the forward used, `z` its saved pre-activation (None:
    recompute it); dW is written in `dw_dtype` (the main weights' dtype) by the GEMM engine
    `gemm_backend`, db in each bias's dtype. `needs` = (x, *weights, *biases) flags in that order."""
    M, K = x2.shape
    N = weights[0].shape[0]
    nw = len(weights)
    g = torch.empty((M, nw * N), device=x2.device, dtype=x2.dtype)  # [g_gate | g_up] for SwiGLU
    if M > 0 and N > 0:
        if z is not None:
            _grad_from_saved(z, dy, g, act, N)
        else:
            _grad_recomputed(x2, weights, biases, act, dy, g)
    dx = None
    if needs[0]:  # dx = g @ W  (SwiGLU: g_gate @ W_gate + g_up @ W_up)
        dx = torch.empty((M, K), device=x2.device, dtype=x2.dtype)
        if N == 0:
            dx.zero_()
        elif nw == 2:
            matmul(g[:, :N], weights[0], dx, g[:, N:], weights[1], backend=gemm_backend)
        else:
            matmul(g, weights[0], dx, backend=gemm_backend)
    dws = [None] * nw
    if any(needs[1 : 1 + nw]):  # dW = g^T @ x  (SwiGLU: one GEMM giving [dW_gate; dW_up])
        dw = torch.empty((nw * N, K), device=x2.device, dtype=dw_dtype)
        if M == 0:
            dw.zero_()
        else:
            matmul(g.t(), x2, dw, backend=gemm_backend)
        dws = [dw[i * N : (i + 1) * N] if needs[1 + i] else None for i in range(nw)]
    dbs = [None] * nw  # db = sum over rows of g (torch reduction, fp32 accumulation)
    for i, b in enumerate(biases):
        if b is not None and needs[1 + nw + i]:
            dbs[i] = g[:, i * N : (i + 1) * N].sum(0, dtype=torch.float32).to(b.dtype)
    return (dx, *dws, *dbs)


# ----------------------------------------------------------------------------- autograd


class _LinearGeluFn(torch.autograd.Function):
    """Triton gelu(x @ W^T + b) on x and the compute-dtype copy `w_c` of W; saves x, w_c and
    the pre-activation (only x and w_c with `recompute`) and returns the main weight's gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_c, approximate, recompute, gemm_backend, fwd_kernel):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        act = ACT_GELU_TANH if approximate == "tanh" else ACT_GELU_NONE
        out, z = _linear_act_fwd(x2, (w_c,), (bias,), act, not recompute, *fwd_kernel)
        ctx.save_for_backward(x2, w_c, bias, z)
        ctx.act, ctx.shape, ctx.w_dtype, ctx.gemm_backend = act, shape, weight.dtype, gemm_backend
        return out.view(*shape[:-1], w_c.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w_c, bias, z = ctx.saved_tensors
        dy2 = dy.reshape(-1, w_c.shape[0])
        needs = ctx.needs_input_grad[:3]
        dx, dw, db = _linear_act_bwd(x2, (w_c,), (bias,), ctx.act, dy2, z, needs, ctx.w_dtype, ctx.gemm_backend)
        if dx is not None:
            dx = dx.view(ctx.shape)
        return dx, dw, db, None, None, None, None, None


class _LinearSwigluFn(torch.autograd.Function):
    """Triton silu(x Wg^T + bg) * (x Wu^T + bu) on x and the compute-dtype copies of the
    weights; saves x, the copies and [z_gate | z_up] (not z with `recompute`) and returns the
    gradients of the main weights."""

    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, wg_c, wu_c, recompute, gemm_backend, fwd_kernel):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        out, z = _linear_act_fwd(x2, (wg_c, wu_c), (b_gate, b_up), ACT_SWIGLU, not recompute, *fwd_kernel)
        ctx.save_for_backward(x2, wg_c, b_gate, wu_c, b_up, z)
        ctx.shape, ctx.w_dtype, ctx.gemm_backend = shape, w_gate.dtype, gemm_backend
        return out.view(*shape[:-1], wg_c.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, wg_c, b_gate, wu_c, b_up, z = ctx.saved_tensors
        dy2 = dy.reshape(-1, wg_c.shape[0])
        n = ctx.needs_input_grad
        needs = (n[0], n[1], n[3], n[2], n[4])  # (x, w_gate, w_up, b_gate, b_up)
        dx, dwg, dwu, dbg, dbu = _linear_act_bwd(
            x2, (wg_c, wu_c), (b_gate, b_up), ACT_SWIGLU, dy2, z, needs, ctx.w_dtype, ctx.gemm_backend
        )
        if dx is not None:
            dx = dx.view(ctx.shape)
        return dx, dwg, dbg, dwu, dbu, None, None, None, None, None


# ----------------------------------------------------------------------------- public API


def _check_modes(backend: str, gemm_backend: str) -> None:
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend={backend!r} must be 'torch' or 'triton'")
    if gemm_backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm_backend={gemm_backend!r} must be one of {GEMM_BACKENDS}")


def linear_gelu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    approximate: str = "tanh",
    backend: str = "torch",
    *,
    recompute: bool = False,
    gemm_backend: str = "triton",
    persistent: bool | None = None,
    tma: bool | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """gelu(x @ weight.T + bias), differentiable in x, weight and bias.

    x [..., K], weight [N, K], bias [N] or None; approximate "tanh" or "none"; output
    [..., N] in the compute dtype (fp32 accumulation): autocast's dtype under autocast (x and
    weight cast to it, see kernels/operands.py), else x.dtype. backend "torch" runs
    `linear_gelu_reference`; "triton" the fused kernels: the activation in the forward
    matmul's epilogue, which also stores the pre-activation for the backward (with
    `recompute`: not stored, recomputed by the backward); the backward's dX and dW GEMMs run
    on `gemm_backend` ("triton" or "torch"), dW and db in the dtypes of weight and bias.
    The forward kernel (`forward_plan`): persistent on CUDA, through TMA descriptors on sm_90+
    where the operands allow, one program per tile under the interpreter; test switches
    `persistent`, `tma` (True: the descriptor kernel wherever the operands allow it) and
    `num_sms` (the SM count of the persistent grid).
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} must be one of {GELU_APPROXIMATIONS}")
    _check_modes(backend, gemm_backend)
    if backend == "torch":
        return linear_gelu_reference(x, weight, bias, approximate)
    dtype = compute_dtype(x)
    x, w_c = x.to(dtype), weight_copy(weight, dtype)
    _check(x, (w_c,), (bias,))
    fwd_kernel = (persistent, tma, num_sms)
    return _LinearGeluFn.apply(x, weight, bias, w_c, approximate, recompute, gemm_backend, fwd_kernel)


def linear_swiglu(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    backend: str = "torch",
    *,
    recompute: bool = False,
    gemm_backend: str = "triton",
    persistent: bool | None = None,
    tma: bool | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """silu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up), differentiable in all inputs.

    x [..., K], w_gate/w_up [N, K], b_gate/b_up [N] or None; output [..., N] in the compute
    dtype (autocast's under autocast, else x.dtype; fp32 accumulation). backend "torch" runs
    `linear_swiglu_reference`; "triton" the fused kernels: gate and up accumulated from the
    same x tiles, the product and the two pre-activations written (2 [M, N] tensors saved,
    torch saves 3; with `recompute` none, both recomputed by the backward); the backward's
    dX and dW GEMMs run on `gemm_backend` ("triton" or "torch"). The forward kernel and the
    switches `persistent`, `tma`, `num_sms`: as `linear_gelu`'s.
    """
    _check_modes(backend, gemm_backend)
    if backend == "torch":
        return linear_swiglu_reference(x, w_gate, b_gate, w_up, b_up)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must have the same shape")
    dtype = compute_dtype(x)
    x, wg_c, wu_c = x.to(dtype), weight_copy(w_gate, dtype), weight_copy(w_up, dtype)
    _check(x, (wg_c, wu_c), (b_gate, b_up))
    fwd_kernel = (persistent, tma, num_sms)
    return _LinearSwigluFn.apply(x, w_gate, b_gate, w_up, b_up, wg_c, wu_c, recompute, gemm_backend, fwd_kernel)
