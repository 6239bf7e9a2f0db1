"""Rotary position embeddings (RoPE, rotate-half convention of Hugging Face's Llama).

Frequency scaling (`GPTConfig.rope_scaling`, Hugging Face's rope_scaling dict without
rope_theta): `llama3` (Llama 3.1 / 3.2) divides the low frequencies (wavelength above
original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones
(wavelength below original_max_position_embeddings / high_freq_factor) and interpolates
linearly in 1/wavelength between them, as transformers' `_compute_llama3_parameters`.

`apply_rope` is one autograd node: the forward writes x*cos + rotate_half(x)*sin into a new
tensor with two fused multiply-adds per half, and the backward applies the transposed rotation
to the gradient the same way. torch's composition of slices, a negation, a concatenation and
two products (and their backward: slice scatters into zeros, a concatenation split) took
1.7-2.0 ms per layer for q and k at [8, 4, 128, 64] on the 2-core CPU; this takes 1.0-1.2 ms.
Only the cos/sin tables are saved for backward, as before. No communication.
"""

from __future__ import annotations

import math

import torch

# rope_type -> the keys its scaling dict must hold (each a number > 0), besides rope_type.
ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_scaling_checks(scaling: dict | None, position: str | None = "rope") -> list[tuple[bool, str]]:
    """(holds, message) for `model.rope_scaling`: null, or a dict with a known rope_type and
    exactly its keys, each a finite number > 0 (llama3: high_freq_factor > low_freq_factor)."""
    if scaling is None:
        return []
    kind = scaling.get("rope_type")
    where = f"model.rope_scaling={scaling!r}"
    if kind not in ROPE_SCALING_KEYS:
        return [(False, f"{where}: rope_type must be one of {', '.join(ROPE_SCALING_KEYS)}")]
    keys = ROPE_SCALING_KEYS[kind]
    extra = sorted(set(scaling) - set(keys) - {"rope_type"})
    missing = [k for k in keys if k not in scaling]
    numbers = all(
        isinstance(scaling.get(k), (int, float))
        and not isinstance(scaling.get(k), bool)
        and math.isfinite(scaling[k])
        and scaling[k] > 0
        for k in keys
        if k in scaling
    )
    checks = [
        (position == "rope", f"{where} needs model.position=rope, not {position}"),
        (not missing, f"{where}: {kind} needs the keys {', '.join(keys)}; missing {', '.join(missing)}"),
        (not extra, f"{where}: {kind} takes only the keys {', '.join(keys)}; unknown {', '.join(extra)}"),
        (numbers, f"{where}: {', '.join(keys)} must be finite numbers > 0"),
    ]
    if kind == "llama3" and not missing and numbers:
        checks.append(
            (
                scaling["high_freq_factor"] > scaling["low_freq_factor"],
                f"{where}: high_freq_factor must be > low_freq_factor",
            )
        )
    return checks


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """RoPE's head_dim/2 inverse frequencies theta^(-2i/head_dim) (fp32), rescaled by `scaling`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope_scaling rope_type={scaling['rope_type']!r} is not implemented")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's rescaling: with L = original_max_position_embeddings, wavelengths 2*pi/f
    above L / low_freq_factor are stretched by `factor` (f / factor), those below
    L / high_freq_factor kept, and the ones between get (1 - a) f / factor + a f with
    a = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    # blend is 0 for wavelength >= L/low (fully stretched), 1 for wavelength <= L/high (kept);
    # the endpoints are taken from the plain formulas so the values are transformers' bitwise.
    mixed = (1 - blend) * inv_freq / factor + blend * inv_freq
    stretched = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, mixed, stretched)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq_len, head_dim] for rotate-half RoPE (the Hugging Face Llama convention),
    frequencies rescaled by `scaling` (GPTConfig.rope_scaling)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, heads, s, d] by position: x*cos + rotate_half(x)*sin, computed in fp32 (fp64
    for fp64 input) and returned in x's dtype (cos/sin [s, d], or [b, 1, s, d] for per-sequence positions).
    Under torch.compile (`trainer.compile`) the same math as plain ops, which inductor fuses:
    the eager node's `out=` products into halves of one tensor are a graph break there."""
    if torch.compiler.is_compiling():
        return _rotate_functional(x.to(_compute_dtype(x)), cos, sin).to(x.dtype)
    return _Rope.apply(x, cos, sin)


def _rotate_functional(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x*cos + rotate_half(x)*sin without `out=` writes (autograd differentiates it)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotate(x.to(_compute_dtype(x)), cos, sin, transpose=False).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad.to(_compute_dtype(grad)), cos, sin, transpose=True).to(ctx.dtype), None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit inputs, else the input's own dtype (fp64 stays fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, transpose: bool) -> torch.Tensor:
    """With halves x = [x1, x2] (and cos = [c1, c2], sin = [s1, s2]):
    forward    [x1*c1 - x2*s1, x2*c2 + x1*s2]   (= x*cos + rotate_half(x)*sin),
    transpose  [x1*c1 + x2*s2, x2*c2 - x1*s1]   (its adjoint, the gradient w.r.t. x)."""
    half = x.shape[-1] // 2
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c1, out=o1)
    torch.mul(x2, c2, out=o2)
    if transpose:
        o1.addcmul_(x2, s2)
        o2.addcmul_(x1, s1, value=-1.0)
    else:
        o1.addcmul_(x2, s1, value=-1.0)
        o2.addcmul_(x1, s2)
    return out
