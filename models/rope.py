"""Rotary position embeddings (RoPE, rotate-half convention of Hugging Face's Llama).

Frequency scaling (`GPTConfig.rope_scaling`, Hugging Face's rope_scaling dict without
rope_theta): `llama3` (Llama 3.1 / 3.2) divides the low frequencies (wavelength above
original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones
(wavelength below original_max_position_embeddings / high_freq_factor) and interpolates
linearly in 1/wavelength between them, as transformers' `_compute_llama3_parameters`. `yarn`
(YaRN: Qwen2.5 / Qwen3 long context, DeepSeek) blends the plain frequencies (dims below the
correction range, rotating more than beta_fast times over original_max_position_embeddings) with
those divided by `factor` (dims above it, fewer than beta_slow rotations) along a linear ramp
over the range (bounds floored / ceiled unless truncate is false), and multiplies cos and sin by
the attention factor (`attention_factor`, else 0.1 ln(factor) + 1, or with mscale and
mscale_all_dim the ratio of the two such terms), as transformers' `_compute_yarn_parameters`.

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
    "yarn": ("factor", "original_max_position_embeddings"),
}
# rope_type -> the keys its scaling dict may also hold (absent: transformers' default), each
# with what it must be: "positive" (a finite number > 0), "nonnegative" (finite, >= 0) or "bool".
ROPE_SCALING_OPTIONAL = {
    "llama3": {},
    "yarn": {
        "attention_factor": "positive",
        "beta_fast": "positive",
        "beta_slow": "positive",
        "mscale": "nonnegative",
        "mscale_all_dim": "nonnegative",
        "truncate": "bool",
    },
}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_OPTIONAL_KINDS = {
    "positive": (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
    "nonnegative": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
}


def rope_scaling_checks(scaling: dict | None, position: str | None = "rope") -> list[tuple[bool, str]]:
    """(holds, message) for `model.rope_scaling`: null, or a dict with a known rope_type, its
    required keys (each a finite number > 0) and only the optional ones it knows
    (ROPE_SCALING_OPTIONAL; llama3: high_freq_factor > low_freq_factor; yarn: beta_fast >=
    beta_slow, which transformers only warns about)."""
    if scaling is None:
        return []
    kind = scaling.get("rope_type")
    where = f"model.rope_scaling={scaling!r}"
    if kind not in ROPE_SCALING_KEYS:
        return [(False, f"{where}: rope_type must be one of {', '.join(ROPE_SCALING_KEYS)}")]
    keys, optional = ROPE_SCALING_KEYS[kind], ROPE_SCALING_OPTIONAL[kind]
    known = (*keys, *optional)
    extra = sorted(set(scaling) - set(known) - {"rope_type"})
    missing = [k for k in keys if k not in scaling]
    numbers = all(_is_number(scaling[k]) and scaling[k] > 0 for k in keys if k in scaling)
    checks = [
        (position == "rope", f"{where} needs model.position=rope, not {position}"),
        (not missing, f"{where}: {kind} needs the keys {', '.join(keys)}; missing {', '.join(missing)}"),
        (not extra, f"{where}: {kind} takes only the keys {', '.join(known)}; unknown {', '.join(extra)}"),
        (numbers, f"{where}: {', '.join(keys)} must be finite numbers > 0"),
    ]
    for key, what in optional.items():
        holds, text = _OPTIONAL_KINDS[what]
        checks.append((key not in scaling or holds(scaling[key]), f"{where}: {key} must be {text}"))
    if kind == "llama3" and not missing and numbers:
        checks.append(
            (
                scaling["high_freq_factor"] > scaling["low_freq_factor"],
                f"{where}: high_freq_factor must be > low_freq_factor",
            )
        )
    if kind == "yarn" and all(ok for ok, _ in checks):
        fast, slow = _yarn_betas(scaling)
        checks.append((fast >= slow, f"{where}: beta_fast={fast} must be >= beta_slow={slow}"))
    return checks


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """RoPE's head_dim/2 inverse frequencies theta^(-2i/head_dim) (fp32), rescaled by `scaling`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if scaling["rope_type"] == "yarn":
        return _yarn_scaled(head_dim, theta, scaling, device)
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


def _yarn_betas(scaling: dict) -> tuple[float, float]:
    """(beta_fast, beta_slow) with transformers' defaults 32 and 1."""
    return scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1


def _yarn_scaled(head_dim: int, theta: float, scaling: dict, device=None) -> torch.Tensor:
    """YaRN's inverse frequencies, op for op transformers' `_compute_yarn_parameters`: with
    L = original_max_position_embeddings, the dims whose frequency turns between beta_slow and
    beta_fast times over L (the correction range [low, high], floored / ceiled unless truncate
    is false) ramp linearly from plain (dims <= low) to divided by `factor` (dims >= high)."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = _yarn_betas(scaling)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over L
        return (head_dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    kept = 1 - ramp.to(device=device, dtype=torch.float)  # 1: the plain frequency, 0: divided by factor
    return interpolation * (1 - kept) + extrapolation * kept


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor RoPE's cos and sin are multiplied by (transformers' `attention_scaling`): 1
    except for yarn: attention_factor, else mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set (nonzero), else mscale(factor) with mscale(s, m) =
    0.1 m ln(s) + 1 (1 for s <= 1)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq_len, head_dim] for rotate-half RoPE (the Hugging Face Llama convention),
    frequencies rescaled by `scaling` (GPTConfig.rope_scaling), both multiplied by its
    attention factor (`rope_attention_factor`: yarn's; 1 otherwise)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    attention = rope_attention_factor(scaling)
    if attention == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention, angles.sin() * attention


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
