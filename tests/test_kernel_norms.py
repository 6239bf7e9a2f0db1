"""Triton LayerNorm/RMSNorm (kernels.norms) against the plain-torch references, run on CPU by
the Triton interpreter. Shapes are small (the interpreter is slow) but chosen to hit the
masking paths: H not a power of two, rows not a multiple of BLOCK_M, several backward row
blocks (rows_per_prog is a multiple of 16 under the interpreter, so 33 rows -> 3 blocks)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from meshtron.kernels import norms  # noqa: E402

EPS = 1e-5
ROWS = (1, 7, 33)
HS = (5, 48, 100)


def _assert_close(a, b, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _run(fn, x, params, dy):
    """Forward with fresh leaves, backward with dy; returns (y, [grad of x, *params])."""
    leaves = [x.detach().clone().requires_grad_(True)]
    leaves += [None if p is None else p.detach().clone().requires_grad_(True) for p in params]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [None if t is None else t.grad for t in leaves]


def _ln(backend):
    return lambda x, w, b: norms.layer_norm(x, w, b, EPS, backend=backend)


def _rms(backend):
    return lambda x, w: norms.rms_norm(x, w, EPS, backend=backend)


def _inputs(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    w = (torch.randn(h, generator=g) * 0.5 + 1).to(dtype)
    b = (torch.randn(h, generator=g) * 0.1).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, dy


def _compare(fn_ref, fn_tri, x, params, dy, **tol):
    y_ref, g_ref = _run(fn_ref, x, params, dy)
    y_tri, g_tri = _run(fn_tri, x, params, dy)
    assert y_tri.dtype == x.dtype and y_tri.shape == x.shape
    _assert_close(y_tri, y_ref, **tol)
    for gt, gr, t in zip(g_tri, g_ref, [x, *params]):
        if t is None:
            assert gt is None
        else:
            assert gt.dtype == t.dtype and gt.shape == t.shape
            _assert_close(gt, gr, **tol)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("h", HS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_fp32(rows, h, with_bias):
    x, w, b, dy = _inputs((rows, h), seed=rows * 1000 + h)
    _compare(_ln("torch"), _ln("triton"), x, [w, b if with_bias else None], dy)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("h", HS)
def test_rms_norm_fp32(rows, h):
    x, w, _, dy = _inputs((rows, h), seed=rows * 1000 + h)
    _compare(_rms("torch"), _rms("triton"), x, [w], dy)


def test_many_row_blocks():
    # 100 rows -> rows_per_prog 32 -> 4 backward programs, the last one partial.
    x, w, b, dy = _inputs((100, 5), seed=3)
    _compare(_ln("torch"), _ln("triton"), x, [w, b], dy)
    _compare(_rms("torch"), _rms("triton"), x, [w], dy)


def test_3d_input_sbh():
    x, w, b, dy = _inputs((5, 3, 48), seed=4)  # [s, b, h]
    _compare(_ln("torch"), _ln("triton"), x, [w, b], dy)
    _compare(_rms("torch"), _rms("triton"), x, [w], dy)


def test_non_contiguous_input_and_grad():
    x, w, b, _ = _inputs((6, 4, 20), seed=5)
    x = x.transpose(0, 1)  # [4, 6, 20], non-contiguous rows
    dy = torch.randn(1, 1, 20).expand(4, 6, 20)  # stride-0 grad
    _compare(_ln("torch"), _ln("triton"), x, [w, b], dy)
    _compare(_rms("torch"), _rms("triton"), x, [w], dy)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_dtypes(dtype, tol):
    x, w, b, dy = _inputs((7, 40), dtype=dtype, seed=6)
    # Triton computes in fp32: compare with the fp32 reference on the same (rounded) inputs.
    x32, w32, b32, dy32 = (t.float() for t in (x, w, b, dy))
    y_ref, g_ref = _run(_ln("torch"), x32, [w32, b32], dy32)
    y_tri, g_tri = _run(_ln("triton"), x, [w, b], dy)
    assert y_tri.dtype == dtype and all(g.dtype == dtype for g in g_tri)
    _assert_close(y_tri.float(), y_ref, rtol=tol, atol=tol)
    for gt, gr in zip(g_tri, g_ref):
        _assert_close(gt.float(), gr, rtol=tol, atol=tol * 4)
    y_ref, g_ref = _run(_rms("torch"), x32, [w32], dy32)
    y_tri, g_tri = _run(_rms("triton"), x, [w], dy)
    _assert_close(y_tri.float(), y_ref, rtol=tol, atol=tol)
    for gt, gr in zip(g_tri, g_ref):
        _assert_close(gt.float(), gr, rtol=tol, atol=tol * 4)


def test_mixed_dtype_bf16_input_fp32_weight():
    x, w, b, dy = _inputs((7, 24), seed=7)
    xb, dyb = x.bfloat16(), dy.bfloat16()
    y, (gx, gw, gb) = _run(_ln("triton"), xb, [w, b], dyb)
    assert y.dtype == torch.bfloat16 and gx.dtype == torch.bfloat16
    assert gw.dtype == torch.float32 and gb.dtype == torch.float32
    y_ref, (_, gw_ref, gb_ref) = _run(_ln("torch"), xb, [w, b], dyb)
    assert y_ref.dtype == torch.bfloat16
    _assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    _assert_close(gw, gw_ref, rtol=1e-4, atol=1e-4)
    _assert_close(gb, gb_ref, rtol=1e-4, atol=1e-4)


def test_zero_rows():
    x = torch.randn(0, 3, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = norms.rms_norm(x, w, EPS, backend="triton")
    assert y.shape == x.shape
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(16))


def test_dispatch():
    x, w, b, _ = _inputs((3, 8), seed=8)
    assert torch.equal(norms.layer_norm(x, w, b, EPS), norms.layer_norm_reference(x, w, b, EPS))
    assert torch.equal(norms.rms_norm(x, w, EPS, backend="torch"), norms.rms_norm_reference(x, w, EPS))
    with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):  # auto is resolved above the kernels
        norms.rms_norm(x, w, EPS, backend="auto")
    y = norms.layer_norm(x, w.requires_grad_(), b, EPS, backend="triton")
    assert y.grad_fn is not None and "LayerNormFunction" in type(y.grad_fn).__name__
    with pytest.raises(ValueError):
        norms.layer_norm(x, w, b, EPS, backend="cuda")


def test_interpreter_uses_single_config():
    fwd, bwd = norms._kernels(True)
    assert len(fwd.configs) == 1 and len(bwd.configs) == 1


def test_gpu_config_pruning():
    # The multi-config GPU list is never launched here; check the pruning keeps sane tiles.
    fwd, _ = norms._kernels(False)
    assert len(fwd.configs) > 1
    for block_h in (8, 128, 1024, 8192, 65536):
        kept = norms._prune_configs(fwd.configs, {}, BLOCK_H=block_h)
        assert kept
        for c in kept:  # <= 64 fp32 per thread, except the one-row fallback for huge H
            assert c.kwargs["BLOCK_M"] * block_h <= 64 * 32 * c.num_warps or c.kwargs["BLOCK_M"] == 1
