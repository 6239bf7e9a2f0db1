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


# --------------------------------------------------------------------------- fused residual + norm


def _res_ln(backend):
    return lambda x, d, w, b: norms.residual_layer_norm(x, d, w, b, EPS, backend=backend)


def _res_rms(backend):
    return lambda x, d, w: norms.residual_rms_norm(x, d, w, EPS, backend=backend)


def _res_inputs(shape, dtype=torch.float32, seed=0):
    """x, delta, weight, bias and the upstream gradients of s and y."""
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    d = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(h, generator=g) * 0.5 + 1).to(dtype)
    b = (torch.randn(h, generator=g) * 0.1).to(dtype)
    ds, dy = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    return x, d, w, b, ds, dy


def _run_res(fn, inputs, ds, dy):
    """(s, y, grads of every input) after backward through s with ds and y with dy (None: that
    output takes no part in the loss)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    s, y = fn(*leaves)
    outs, grads = zip(*[(o, g) for o, g in ((s, ds), (y, dy)) if g is not None])
    torch.autograd.backward(list(outs), list(grads))
    return s.detach(), y.detach(), [None if t is None else t.grad for t in leaves]


def _compare_res(fn_ref, fn_tri, inputs, ds, dy, **tol):
    s_ref, y_ref, g_ref = _run_res(fn_ref, inputs, ds, dy)
    s_tri, y_tri, g_tri = _run_res(fn_tri, inputs, ds, dy)
    for got, want in ((s_tri, s_ref), (y_tri, y_ref)):
        assert got.dtype == want.dtype and got.shape == inputs[0].shape
        _assert_close(got, want, **tol)
    for gt, gr, t in zip(g_tri, g_ref, inputs):
        if gr is None:  # the reference never reached it (no input, or no gradient through y)
            assert gt is None or not gt.any()
        else:
            assert gt.dtype == t.dtype and gt.shape == t.shape
            _assert_close(gt, gr, **tol)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("h", HS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_residual_layer_norm_fp32(rows, h, with_bias):
    x, d, w, b, ds, dy = _res_inputs((rows, h), seed=rows * 1000 + h)
    _compare_res(_res_ln("torch"), _res_ln("triton"), [x, d, w, b if with_bias else None], ds, dy)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("h", HS)
def test_residual_rms_norm_fp32(rows, h):
    x, d, w, _, ds, dy = _res_inputs((rows, h), seed=rows * 1000 + h)
    _compare_res(_res_rms("torch"), _res_rms("triton"), [x, d, w], ds, dy)


def _assert_is_the_add(s, x, d):
    """s is x + delta computed in fp32 and rounded once, bit for bit torch's add; except that the
    interpreter casts fp32 to bf16 by truncation (numpy bit shifts) where a GPU rounds to nearest
    even (cvt.rn.bf16.f32), so bf16 is only within one unit in the last place here."""
    want = x + d
    if s.dtype != torch.bfloat16:
        assert torch.equal(s, want)
    else:
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert ((s.float() - want.float()).abs() <= ulp).all()


def test_residual_forward_is_the_add():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, d, w, b, _, _ = _res_inputs((33, 100), dtype=dtype, seed=9)
        s_ln, _ = norms.residual_layer_norm(x, d, w, b, EPS, backend="triton")
        s_rms, _ = norms.residual_rms_norm(x, d, w, EPS, backend="triton")
        _assert_is_the_add(s_ln, x, d)
        _assert_is_the_add(s_rms, x, d)


@pytest.mark.parametrize("flowing", ["s", "y"])
def test_residual_one_output_gradient(flowing):
    # Only one output in the loss: the other's gradient is None inside the Function.
    x, d, w, b, ds, dy = _res_inputs((33, 48), seed=10)
    ds, dy = (ds, None) if flowing == "s" else (None, dy)
    _compare_res(_res_ln("torch"), _res_ln("triton"), [x, d, w, b], ds, dy)
    _compare_res(_res_rms("torch"), _res_rms("triton"), [x, d, w], ds, dy)
    if flowing == "s":  # no weight gradient at all: the norm is not in the loss
        _, _, grads = _run_res(_res_rms("triton"), [x, d, w], ds, dy)
        assert grads[2] is None and torch.equal(grads[0], ds) and torch.equal(grads[1], ds)


def test_residual_many_row_blocks_and_3d():
    x, d, w, b, ds, dy = _res_inputs((100, 5), seed=11)  # 4 backward programs, the last partial
    _compare_res(_res_ln("torch"), _res_ln("triton"), [x, d, w, b], ds, dy)
    _compare_res(_res_rms("torch"), _res_rms("triton"), [x, d, w], ds, dy)
    x, d, w, b, ds, dy = _res_inputs((5, 3, 48), seed=12)  # [s, b, h]
    _compare_res(_res_ln("torch"), _res_ln("triton"), [x, d, w, b], ds, dy)
    _compare_res(_res_rms("torch"), _res_rms("triton"), [x, d, w], ds, dy)


def test_residual_non_contiguous_inputs_and_grads():
    x, d, w, b, _, _ = _res_inputs((6, 4, 20), seed=13)
    x, d = x.transpose(0, 1), d.transpose(0, 1)  # [4, 6, 20], non-contiguous rows
    ds = torch.randn(6, 4, 20).transpose(0, 1)
    dy = torch.randn(1, 1, 20).expand(4, 6, 20)  # stride-0 grad
    _compare_res(_res_ln("torch"), _res_ln("triton"), [x, d, w, b], ds, dy)
    _compare_res(_res_rms("torch"), _res_rms("triton"), [x, d, w], ds, dy)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_residual_half_dtypes(dtype, tol):
    x, d, w, b, ds, dy = _res_inputs((33, 40), dtype=dtype, seed=14)
    for fn_ref, fn_tri, n in ((_res_ln("torch"), _res_ln("triton"), 4), (_res_rms("torch"), _res_rms("triton"), 3)):
        s_tri, y_tri, g_tri = _run_res(fn_tri, [x, d, w, b][:n], ds, dy)
        assert s_tri.dtype == y_tri.dtype == dtype and all(g.dtype == dtype for g in g_tri)
        _assert_is_the_add(s_tri, x, d)
        # Triton normalises the 16-bit s in fp32: compare with the fp32 reference on that s
        # (widened) plus a zero delta, which has the same gradients.
        ref_in = [s_tri.float(), torch.zeros_like(s_tri, dtype=torch.float32), w.float(), b.float()]
        s_ref, y_ref, g_ref = _run_res(fn_ref, ref_in[:n], ds.float(), dy.float())
        _assert_close(y_tri.float(), y_ref, rtol=tol, atol=tol)
        _assert_close(g_tri[0].float(), g_ref[0], rtol=tol, atol=tol * 4)  # d_x
        assert torch.equal(g_tri[1], g_tri[0])  # d_delta = d_x
        for gt, gr in zip(g_tri[2:], g_ref[2:]):
            _assert_close(gt.float(), gr, rtol=tol, atol=tol * 4)


def test_residual_mixed_dtypes_fp32_stream_bf16_branch():
    # What autocast feeds the block: the fp32 residual stream plus a bf16 branch output, fp32
    # weights. s and y are fp32 (torch's promotion), delta's gradient is bf16.
    x, d, w, b, ds, dy = _res_inputs((7, 24), seed=15)
    inputs = [x, d.bfloat16(), w, b]
    _compare_res(_res_ln("torch"), _res_ln("triton"), inputs, ds, dy)
    _compare_res(_res_rms("torch"), _res_rms("triton"), inputs[:3], ds, dy)
    s, y, grads = _run_res(_res_rms("triton"), inputs[:3], ds, dy)
    assert s.dtype == y.dtype == torch.float32 and grads[1].dtype == torch.bfloat16


def test_residual_under_autocast():
    # Autocast does not reach the kernel (as for the plain norms): it sees the dtypes it is fed.
    x, d, w, b, ds, dy = _res_inputs((7, 24), seed=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _compare_res(_res_ln("torch"), _res_ln("triton"), [x, d.bfloat16(), w, b], ds, dy)
        _compare_res(_res_rms("torch"), _res_rms("triton"), [x, d.bfloat16(), w], ds, dy)


def test_residual_zero_rows_and_checks():
    x = torch.randn(0, 3, 16, requires_grad=True)
    d = torch.randn(0, 3, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    s, y = norms.residual_rms_norm(x, d, w, EPS, backend="triton")
    assert s.shape == y.shape == x.shape
    (s.sum() + y.sum()).backward()
    assert torch.equal(w.grad, torch.zeros(16)) and x.grad.shape == x.shape
    with pytest.raises(ValueError, match="one shape"):
        norms.residual_rms_norm(torch.randn(3, 16), torch.randn(1, 16), w, EPS, backend="triton")
    with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):
        norms.residual_layer_norm(torch.randn(3, 16), torch.randn(3, 16), w, None, EPS, backend="auto")


def test_residual_dispatch():
    x, d, w, b, _, _ = _res_inputs((3, 8), seed=17)
    s, y = norms.residual_layer_norm(x, d, w, b, EPS)
    assert torch.equal(s, x + d) and torch.equal(y, norms.layer_norm_reference(x + d, w, b, EPS))
    s, y = norms.residual_rms_norm(x, d, w.requires_grad_(), EPS, backend="triton")
    assert "ResidualRMSNormFunction" in type(y.grad_fn).__name__ and s.grad_fn is y.grad_fn


def test_residual_interpreter_uses_single_config():
    fwd, bwd = norms._residual_kernels(True)
    assert len(fwd.configs) == 1 and len(bwd.configs) == 1
    fwd, bwd = norms._residual_kernels(False)
    assert len(fwd.configs) > 1 and fwd.configs[0].kwargs == norms._kernels(False)[0].configs[0].kwargs


def test_residual_gpu_config_pruning():
    # The fused forward holds x, delta and s: at most 32 fp32 elements per thread (64 spilled
    # in kernels/aot.py's compiles), except the one-row fallback.
    fwd, bwd = norms._residual_kernels(False)
    for block_h in (8, 128, 1024, 8192, 65536):
        kept = norms._prune_residual_configs(fwd.configs, {}, BLOCK_H=block_h)
        assert kept
        for c in kept:
            assert c.kwargs["BLOCK_M"] * block_h <= 32 * 32 * c.num_warps or c.kwargs["BLOCK_M"] == 1
    assert fwd.early_config_prune is norms._prune_residual_configs
    assert bwd.early_config_prune is norms._prune_bwd_configs


def test_repeated_launches_skip_the_autotuner_with_the_same_result(monkeypatch):
    """kernels/launch.py: the first call of a key goes through the autotuner, later calls of
    that key launch the remembered config directly (same numbers); a new key (here a new
    dtype) and `clear()` go through the autotuner again."""
    from triton.runtime.autotuner import Autotuner

    from meshtron.kernels import launch

    launch.clear()
    tuned = []
    original = Autotuner.run
    monkeypatch.setattr(
        Autotuner, "run", lambda self, *a, **k: tuned.append(self.base_fn.__name__) or original(self, *a, **k)
    )
    x, w = torch.randn(9, 40), torch.randn(40)
    first = norms.rms_norm(x, w, 1e-5, backend="triton")
    assert tuned == ["_norm_fwd_kernel"]
    again = norms.rms_norm(x * 1.0, w, 1e-5, backend="triton")
    assert tuned == ["_norm_fwd_kernel"] and torch.equal(first, again)
    norms.rms_norm(x.to(torch.bfloat16), w, 1e-5, backend="triton")  # another dtype: another key
    assert tuned == ["_norm_fwd_kernel"] * 2
    launch.clear()
    norms.rms_norm(x, w, 1e-5, backend="triton")
    assert tuned == ["_norm_fwd_kernel"] * 3
