"""RoPE (models/rope.py): the one-node rotation equals the textbook composition, forward and
backward, for shared and per-sequence position tables, 16-bit inputs and strided views."""

import torch

from meshtron.models.rope import apply_rope, rope_tables


def _composed(x, cos, sin):
    """x*cos + rotate_half(x)*sin written out with torch ops (the definition)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    wide = torch.promote_types(x.dtype, torch.float32)
    return (x.to(wide) * cos + rotated.to(wide) * sin).to(x.dtype)


def _strided_q(b=2, heads=3, s=16, d=8, dtype=torch.float32):
    """A [b, heads, s, d] view of a fused qkv activation [s, b, 3*heads*d], as attention takes it."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(s, b, heads * 3 * d, generator=gen).to(dtype).requires_grad_()
    q = qkv.view(s, b, heads, 3, d)[:, :, :, 0].permute(1, 2, 0, 3)
    return qkv, q


def test_tables_are_the_llama_frequencies():
    cos, sin = rope_tables(5, 4, 100.0, "cpu")
    inv_freq = torch.tensor([1.0, 100.0**-0.5])
    angles = torch.arange(5.0)[:, None] * inv_freq
    torch.testing.assert_close(cos, torch.cat([angles.cos()] * 2, dim=-1))
    torch.testing.assert_close(sin, torch.cat([angles.sin()] * 2, dim=-1))


def test_forward_and_gradient_equal_the_composition_on_a_strided_view():
    cos, sin = rope_tables(16, 8, 10000.0, "cpu")
    grad_out = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (apply_rope, _composed):
        qkv, q = _strided_q()
        out = fn(q, cos, sin)
        out.backward(grad_out)
        results.append((out, qkv.grad))
    (got, got_grad), (want, want_grad) = results
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    assert got_grad.view(16, 2, 3, 3, 8)[:, :, :, 1:].abs().sum() == 0  # k and v rows got nothing


def test_gradcheck_with_per_sequence_positions():
    """fp64 stays fp64, so torch's numerical gradient check applies; [b, 1, s, d] tables."""
    cos, sin = rope_tables(12, 6, 500.0, "cpu")
    positions = torch.tensor([[0, 1, 2, 3, 0, 1], [5, 6, 7, 8, 9, 10]])
    cos, sin = cos[positions][:, None].double(), sin[positions][:, None].double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(apply_rope, (x, cos, sin))
    torch.testing.assert_close(apply_rope(x, cos, sin), _composed(x, cos, sin), rtol=0, atol=1e-12)


def test_bf16_input_is_rotated_in_fp32_and_returned_in_bf16():
    cos, sin = rope_tables(16, 8, 10000.0, "cpu")
    qkv, q = _strided_q(dtype=torch.bfloat16)
    out = apply_rope(q, cos, sin)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _composed(q, cos, sin), rtol=0, atol=0)
    out.float().sum().backward()
    assert qkv.grad.dtype == torch.bfloat16


def test_scores_depend_only_on_the_relative_position():
    """<rope(q at m), rope(k at n)> is a function of m - n: shifting both positions keeps it."""
    cos, sin = rope_tables(32, 8, 10000.0, "cpu")
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(8, generator=gen), torch.randn(8, generator=gen)

    def score(m, n):
        rq = apply_rope(q.view(1, 1, 1, 8), cos[m : m + 1], sin[m : m + 1])
        rk = apply_rope(k.view(1, 1, 1, 8), cos[n : n + 1], sin[n : n + 1])
        return (rq * rk).sum()

    torch.testing.assert_close(score(7, 3), score(27, 23), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(7, 3), score(7, 4), atol=1e-3)
