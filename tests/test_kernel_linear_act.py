"""Fused linear + activation kernels (kernels/linear_act.py): Triton (under the CPU
interpreter) vs the plain-torch reference, forward and every gradient, fp32, in each mode:
the pre-activation saved (default) or recomputed, the backward GEMMs on Triton or torch."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

pytest.importorskip("triton")

from meshtron.kernels.linear_act import (  # noqa: E402
    linear_gelu,
    linear_gelu_reference,
    linear_swiglu,
    linear_swiglu_reference,
)

RTOL = 1e-5


def _close(actual, expected, name):
    """Max-abs error within RTOL of the reference's scale (elementwise rtol is meaningless
    for entries that cancel to ~0)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    scale = expected.abs().max().clamp_min(1e-6)
    err = (actual - expected).abs().max()
    assert err <= RTOL * scale, f"{name}: max err {err:.3e} vs scale {scale:.3e}"


def _leaves(shape_x, n, k, biases, nweights, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape_x, k, generator=g)
    ws = [torch.randn(n, k, generator=g) / k**0.5 for _ in range(nweights)]
    bs = [torch.randn(n, generator=g) if has else None for has in biases]
    dy = torch.randn(*shape_x, n, generator=g)
    return x, ws, bs, dy


def _run(fn, tensors, dy):
    """Forward + backward on fresh leaf copies; returns [out, grad of each tensor (None stays None)]."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(dy)
    return [out.detach()] + [None if t is None else t.grad for t in leaves]


def _compare(fn_ref, fn_tri, tensors, dy, names):
    ref = _run(fn_ref, tensors, dy)
    tri = _run(fn_tri, tensors, dy)
    for name, r, t in zip(["out", *names], ref, tri):
        if r is None:
            assert t is None, name
        else:
            _close(t, r, name)


# (shape of x without K, K, N): masking in M (1, 7, 37 rows), K (16, 33) and N (8, 50)
GELU_CASES = [
    ((1,), 16, 8, True, "tanh"),
    ((7,), 33, 50, False, "none"),
    ((37,), 33, 50, True, "none"),
    ((37,), 16, 8, False, "tanh"),
    ((5, 3), 33, 50, True, "tanh"),  # 3-D input [s, b, k]
]


# (recompute, gemm_backend): the default, the opt-in memory mode, cuBLAS for the plain GEMMs
MODES = [(False, "triton"), (True, "triton"), (False, "torch")]


@pytest.mark.parametrize("recompute,gemm", MODES)
@pytest.mark.parametrize("lead,k,n,bias,approximate", GELU_CASES)
def test_linear_gelu_matches_reference(lead, k, n, bias, approximate, recompute, gemm):
    x, (w,), (b,), dy = _leaves(lead, n, k, [bias], 1, seed=k * n + len(lead))
    _compare(
        lambda x, w, b: linear_gelu_reference(x, w, b, approximate),
        lambda x, w, b: linear_gelu(x, w, b, approximate, backend="triton", recompute=recompute, gemm_backend=gemm),
        [x, w, b],
        dy,
        ["dx", "dweight", "dbias"],
    )


# (shape of x without K, K, N, (gate bias?, up bias?))
SWIGLU_CASES = [
    ((1,), 33, 8, (True, False)),
    ((7,), 16, 50, (False, False)),
    ((37,), 33, 50, (True, True)),
    ((5, 3), 16, 50, (False, True)),  # 3-D input [s, b, k]
]


@pytest.mark.parametrize("recompute,gemm", MODES)
@pytest.mark.parametrize("lead,k,n,biases", SWIGLU_CASES)
def test_linear_swiglu_matches_reference(lead, k, n, biases, recompute, gemm):
    x, (wg, wu), (bg, bu), dy = _leaves(lead, n, k, list(biases), 2, seed=k + n + len(lead))
    _compare(
        linear_swiglu_reference,
        lambda x, wg, bg, wu, bu: linear_swiglu(
            x, wg, bg, wu, bu, backend="triton", recompute=recompute, gemm_backend=gemm
        ),
        [x, wg, bg, wu, bu],
        dy,
        ["dx", "dw_gate", "db_gate", "dw_up", "db_up"],
    )


@pytest.mark.parametrize("recompute", [False, True])
def test_large_preactivations_and_partial_grads(recompute):
    """Saturating activations (|pre-activation| ~ 30) stay finite and exact; only x needs a grad."""
    x, (w, w2), (b, b2), dy = _leaves((9,), 8, 16, [True, True], 2, seed=3)
    x = x * 10
    for ref, tri in [
        (
            lambda x: linear_gelu_reference(x, w, b, "tanh"),
            lambda x: linear_gelu(x, w, b, "tanh", backend="triton", recompute=recompute),
        ),
        (
            lambda x: linear_swiglu_reference(x, w, b, w2, b2),
            lambda x: linear_swiglu(x, w, b, w2, b2, backend="triton", recompute=recompute),
        ),
    ]:
        _compare(ref, tri, [x], dy, ["dx"])


def _saved_numel(fn, tensors):
    """Elements autograd saves for backward beyond the leaves themselves."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*leaves)
    leaf_ids = {id(t) for t in leaves}
    return sum(t.numel() for t in saved if id(t) not in leaf_ids and t.data_ptr() not in {x.data_ptr() for x in leaves})


def test_saved_activations_against_torch():
    """Per [M, N] output: GeLU saves one pre-activation, as torch does; SwiGLU saves two where
    torch saves three; the recompute mode saves none (only x and the weights)."""
    m, k, n = 6, 8, 16
    x, (wg, wu), (bg, bu), _ = _leaves((m,), n, k, [True, True], 2, seed=4)
    tensors = [x, wg, bg, wu, bu]
    swiglu_torch = _saved_numel(linear_swiglu_reference, tensors)
    swiglu_fused = _saved_numel(lambda *t: linear_swiglu(*t, backend="triton"), tensors)
    swiglu_recompute = _saved_numel(lambda *t: linear_swiglu(*t, backend="triton", recompute=True), tensors)
    assert (swiglu_torch, swiglu_fused, swiglu_recompute) == (3 * m * n, 2 * m * n, 0)
    gelu_torch = _saved_numel(lambda x, w, b: linear_gelu_reference(x, w, b, "tanh"), tensors[:3])
    gelu_fused = _saved_numel(lambda x, w, b: linear_gelu(x, w, b, backend="triton"), tensors[:3])
    assert (gelu_torch, gelu_fused) == (m * n, m * n)


def test_torch_backend_is_reference_and_bad_args_raise():
    x, (w, w2), (b, _), _ = _leaves((4,), 8, 16, [True, False], 2, seed=5)
    assert torch.equal(linear_gelu(x, w, b), linear_gelu_reference(x, w, b, "tanh"))
    assert torch.equal(linear_swiglu(x, w, b, w2, None), linear_swiglu_reference(x, w, b, w2, None))
    with pytest.raises(ValueError):
        linear_gelu(x, w, b, approximate="erf")
    with pytest.raises(ValueError):
        linear_gelu(x, w, b, backend="cuda")
    with pytest.raises(ValueError, match="gemm_backend"):
        linear_swiglu(x, w, b, w2, None, backend="triton", gemm_backend="cublas")


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("recompute", [False, True])
def test_16bit_operands_on_odd_shapes(dtype, tol, recompute):
    """16-bit x and weights (odd M, K, N): output, dx in 16 bits and dW in the weights' dtype
    against the fp32 reference on the same rounded values (error of 16-bit intermediates)."""
    x, (wg, wu), (bg, bu), dy = _leaves((37,), 50, 33, [True, False], 2, seed=11)
    x, wg, wu, dy = (t.to(dtype) for t in (x, wg, wu, dy))
    cases = [
        (
            lambda x, w, b: linear_gelu_reference(x.float(), w.float(), b, "tanh"),
            lambda x, w, b: linear_gelu(x, w, b, "tanh", backend="triton", recompute=recompute),
            [x, wg, bg],
        ),
        (
            lambda x, wg, wu: linear_swiglu_reference(x.float(), wg.float(), None, wu.float(), None),
            lambda x, wg, wu: linear_swiglu(x, wg, None, wu, None, backend="triton", recompute=recompute),
            [x, wg, wu],
        ),
    ]
    for ref_fn, tri_fn, tensors in cases:
        ref = _run(ref_fn, tensors, dy.float())
        tri = _run(tri_fn, tensors, dy)
        assert tri[0].dtype == dtype
        for name, r, t in zip(["out", "dx", "dw", "db/dw2"], ref, tri):
            err = (t.float() - r.float()).abs().max()
            scale = r.float().abs().max()
            assert err <= tol * scale, f"{name}: max err {err:.3e} vs scale {scale:.3e}"
