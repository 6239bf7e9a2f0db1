"""Plain GEMMs (kernels/gemm.py `matmul`): the Triton kernel under the CPU interpreter and the
torch engine against a float64 product, on odd shapes, strided (transposed) operands, two
products in one launch, a 16-bit product written into fp32, and bad arguments."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

pytest.importorskip("triton")

from meshtron.kernels.gemm import matmul  # noqa: E402


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_close(out, expected, tol):
    err = (out.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"max err {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("m,k,n", [(1, 16, 8), (37, 33, 50), (64, 17, 31)])
def test_matmul_matches_float64(backend, m, k, n):
    a, b = _rand(m, k, seed=1), _rand(k, n, seed=2)
    _assert_close(matmul(a, b, backend=backend), a.double() @ b.double(), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_transposed_operands_and_dual_product(backend):
    """dW = g^T x from a row-major g (a stride swap), and dx = g1 W1 + g2 W2 in one call."""
    g, x = _rand(37, 50, seed=3), _rand(37, 33, seed=4)
    _assert_close(matmul(g.t(), x, backend=backend), g.double().t() @ x.double(), 1e-5)
    both = _rand(37, 100, seed=5)
    g1, g2 = both[:, :50], both[:, 50:]  # column slices: row stride 100
    w1, w2 = _rand(50, 33, seed=6), _rand(50, 33, seed=7)
    out = matmul(g1, w1, a2=g2, b2=w2, backend=backend)
    _assert_close(out, g1.double() @ w1.double() + g2.double() @ w2.double(), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_16bit_operands_into_fp32_out(backend):
    """bf16 operands, fp32 out: the product of the rounded operands, accumulated in fp32."""
    a, b = _rand(40, 96, seed=8, dtype=torch.bfloat16), _rand(96, 24, seed=9, dtype=torch.bfloat16)
    out = matmul(a, b, out=torch.empty(40, 24), backend=backend)
    assert out.dtype == torch.float32
    _assert_close(out, a.double() @ b.double(), 1e-2 if backend == "torch" else 1e-5)


def test_empty_and_bad_shapes():
    assert matmul(torch.empty(0, 4), torch.empty(4, 3)).shape == (0, 3)
    assert torch.equal(matmul(torch.empty(5, 0), torch.empty(0, 3)), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="not \\[M, K\\] and \\[K, N\\]"):
        matmul(torch.empty(5, 4), torch.empty(3, 2))
    with pytest.raises(ValueError, match="out"):
        matmul(torch.empty(5, 4), torch.empty(4, 2), out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="a2 and b2"):
        matmul(torch.empty(5, 4), torch.empty(4, 2), a2=torch.empty(5, 4))
    with pytest.raises(ValueError, match="backend"):
        matmul(torch.empty(5, 4), torch.empty(4, 2), backend="cublas")
