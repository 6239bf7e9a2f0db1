"""Fused linear + activation kernels (kernels/linear_act.py): Triton (under the CPU
interpreter) vs the plain-torch reference, forward and every gradient, fp32, in each mode:
the pre-activation saved (default) or recomputed, the backward GEMMs on Triton or torch.
The persistent forwards (pointer loads in fp32 and bf16, TMA descriptors in bf16 and fp16)
on odd shapes with and without biases, SAVE_PRE on and off, the choice of forward kernel,
their cached launches and their configs."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from meshtron.kernels import configs, linear_act, linear_act_kernels  # noqa: E402
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


# ----------------------------------------------------------------------------- persistent forwards


# (kernel, operand dtype, K): the pointer kernel in fp32 and bf16 with an odd K (masked K tiles),
# the TMA kernel in bf16 and fp16 with K = 40 (16-byte rows; the last K tile zero-filled past 40)
PERSISTENT_CASES = [
    ("persistent", torch.float32, 33),
    ("persistent", torch.bfloat16, 33),
    ("tma", torch.bfloat16, 40),
    ("tma", torch.float16, 40),
]
TOLERANCE = {torch.float32: RTOL, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _persistent_kw(kind):
    # 4 "SMs" for 3 x 2 output tiles of 32 x 32 (M 70, N 50): programs 0 and 1 take two tiles each
    return dict(persistent=True, tma=kind == "tma", num_sms=4)


def _check_against_reference(ref_fn, tri_fn, tensors, dy, dtype, names):
    """Output and every gradient of `tri_fn` (16-bit operands) against `ref_fn` on the same
    rounded values in fp32: max-abs error within the dtype's tolerance of the reference's scale."""
    ref = _run(ref_fn, [None if t is None else t.float() for t in tensors], dy.float())
    tri = _run(tri_fn, tensors, dy)
    assert tri[0].dtype == dtype
    for name, r, t in zip(["out", *names], ref, tri):
        if r is None:
            assert t is None, name
            continue
        err = (t.float() - r.float()).abs().max()
        scale = r.float().abs().max().clamp_min(1e-6)
        assert err <= TOLERANCE[dtype] * scale, f"{name}: max err {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("recompute", [False, True])  # SAVE_PRE on (the default) and off
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind,dtype,k", PERSISTENT_CASES)
def test_persistent_gelu_forward_matches_reference(kind, dtype, k, bias, recompute):
    """The persistent GeLU forward (pointer loads or TMA descriptors) on odd M and N, its sliced
    epilogue and every gradient of the saved (or recomputed) pre-activation, against torch."""
    x, (w,), (b,), dy = _leaves((70,), 50, k, [bias], 1, seed=k + bias)
    x, w, dy = x.to(dtype), w.to(dtype), dy.to(dtype)
    kw = _persistent_kw(kind)
    assert linear_act.forward_plan(x, (w,), **kw).kernel == f"linear_gelu_{kind}_kernel"
    _check_against_reference(
        lambda x, w, b: linear_gelu_reference(x, w, b, "tanh"),
        lambda x, w, b: linear_gelu(x, w, b, "tanh", backend="triton", recompute=recompute, **kw),
        [x, w, b],
        dy,
        dtype,
        ["dx", "dweight", "dbias"],
    )


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("biases", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("kind,dtype,k", PERSISTENT_CASES)
def test_persistent_swiglu_forward_matches_reference(kind, dtype, k, biases, recompute):
    """The persistent SwiGLU forward (gate and up from one x tile, pointer loads or TMA), odd M
    and N, either bias alone or none, SAVE_PRE on and off, forward and every gradient."""
    x, (wg, wu), (bg, bu), dy = _leaves((70,), 50, k, list(biases), 2, seed=k + 2 * biases[0] + biases[1])
    x, wg, wu, dy = x.to(dtype), wg.to(dtype), wu.to(dtype), dy.to(dtype)
    kw = _persistent_kw(kind)
    assert linear_act.forward_plan(x, (wg, wu), **kw).kernel == f"linear_swiglu_{kind}_kernel"
    _check_against_reference(
        linear_swiglu_reference,
        lambda x, wg, bg, wu, bu: linear_swiglu(x, wg, bg, wu, bu, backend="triton", recompute=recompute, **kw),
        [x, wg, bg, wu, bu],
        dy,
        dtype,
        ["dx", "dw_gate", "db_gate", "dw_up", "db_up"],
    )


@pytest.mark.parametrize("kind,dtype,k", PERSISTENT_CASES)
def test_persistent_forward_stores_the_pre_activations(kind, dtype, k):
    """z as the backward reads it: GeLU's [M, N] and SwiGLU's [z_gate | z_up] ([M, 2N]) equal
    x W^T + b rounded to the compute dtype (exactly in fp32 up to summation order), the output
    the activation of it; a 3-D x (flattened rows) and a 2-row x (one partial row tile)."""
    for lead in ((5, 3), (2,)):
        x, (wg, wu), (bg, _), _ = _leaves(lead, 50, k, [True, False], 2, seed=7 + len(lead))
        x2 = x.reshape(-1, k).to(dtype)
        wg, wu = wg.to(dtype), wu.to(dtype)
        zg = F.linear(x2.float(), wg.float(), bg)
        zu = F.linear(x2.float(), wu.float())
        tol = TOLERANCE[dtype]
        out, z = linear_act._linear_act_fwd(x2, (wg,), (bg,), linear_act.ACT_GELU_NONE, True, **_persistent_kw(kind))
        assert z.shape == (x2.shape[0], 50) and z.dtype == dtype
        _close_to(z, zg, tol, "z")
        _close_to(out, F.gelu(z.float()), tol, "gelu out")
        out, z = linear_act._linear_act_fwd(
            x2, (wg, wu), (bg, None), linear_act.ACT_SWIGLU, True, **_persistent_kw(kind)
        )
        assert z.shape == (x2.shape[0], 100)
        _close_to(z, torch.cat([zg, zu], 1), tol, "[z_gate | z_up]")
        _close_to(out, F.silu(zg) * zu, 2 * tol, "swiglu out")
        out2, none = linear_act._linear_act_fwd(
            x2, (wg, wu), (bg, None), linear_act.ACT_SWIGLU, False, **_persistent_kw(kind)
        )
        assert none is None and torch.equal(out2, out)  # SAVE_PRE off: the same output


def _close_to(actual, expected, tol, name):
    err = (actual.float() - expected.float()).abs().max()
    scale = expected.float().abs().max()
    assert err <= tol * scale, f"{name}: max err {err:.3e} vs scale {scale:.3e}"


def test_forward_plan_picks_the_kernel():
    """One program per tile by default on CPU (and with persistent=False); persistent with
    pointer loads, or TMA descriptors when asked and the operands allow it: 16-bit, unit
    stride, 16-byte aligned base and rows, both SwiGLU weights laid out alike."""
    bf = torch.bfloat16
    x, w, w2 = torch.randn(48, 64, dtype=bf), torch.randn(40, 64, dtype=bf), torch.randn(40, 64, dtype=bf)
    plan = linear_act.forward_plan
    assert plan(x, (w,)) == ("linear_gelu_fwd_kernel", None, 0)
    assert plan(x, (w, w2), persistent=False, tma=True).kernel == "linear_swiglu_fwd_kernel"
    assert plan(x, (w,), persistent=True) == ("linear_gelu_persistent_kernel", None, 4)  # not sm_90
    assert plan(x, (w,), persistent=True, tma=True, num_sms=7) == ("linear_gelu_tma_kernel", ("n", "t"), 7)
    assert plan(x, (w, w2), persistent=True, tma=True).layouts == ("n", "t")
    tma = dict(persistent=True, tma=True)
    assert plan(x.float(), (w.float(),), **tma).kernel == "linear_gelu_persistent_kernel"  # fp32: no TMA
    odd_k = torch.randn(48, 66, dtype=bf)[:, :60]  # rows of 132 B: not 16-byte aligned
    assert plan(odd_k, (w[:, :60],), **tma).kernel == "linear_gelu_persistent_kernel"
    w_cm = w.t().contiguous().t()  # column-major W: W^T row-major ("n")
    assert plan(x, (w_cm,), **tma).layouts == ("n", "n")
    assert plan(x, (w, w_cm), **tma).kernel == "linear_swiglu_persistent_kernel"  # laid out unlike
    assert plan(x, (w_cm, w2.t().contiguous().t()), **tma).layouts == ("n", "n")
    x_cm = x.t().contiguous().t()
    assert plan(x_cm, (w,), **tma).layouts == ("t", "t")
    assert plan(x[:, :0], (w[:, :0],), **tma).kernel == "linear_gelu_persistent_kernel"  # K = 0


@pytest.mark.parametrize("kind", ["persistent", "tma"])
def test_persistent_launch_cached_after_the_first_call(kind, monkeypatch):
    """The first call of a key goes through the autotuner, later ones launch the jitted kernel
    with the cached config on min(SMs, tiles) programs; another key (SAVE_PRE off) tunes again."""
    bf = torch.bfloat16
    x, w = torch.randn(70, 40, dtype=bf), torch.randn(50, 40, dtype=bf)
    kw = dict(persistent=True, tma=kind == "tma", num_sms=5)
    name = f"linear_gelu_{kind}_kernel"
    from meshtron.kernels import launch

    monkeypatch.setattr(launch, "_chosen", {})
    kernel = getattr(linear_act, name)
    first, _ = linear_act._linear_act_fwd(x, (w,), (None,), linear_act.ACT_GELU_TANH, True, **kw)
    ((tuned_kernel, key),) = launch._chosen
    assert tuned_kernel is kernel and key[0] == name
    config = launch._chosen[(kernel, key)]

    def no_autotuner(*args, **kwargs):
        raise AssertionError("a cached launch went through the autotuner")

    grids, jitted = [], kernel.fn

    class GridRecorder:  # the cached launch's grid, kept to evaluate under the remembered config
        def __getitem__(self, grid):
            grids.append(grid)
            return jitted[grid]

    monkeypatch.setattr(kernel, "run", no_autotuner)
    monkeypatch.setattr(kernel, "fn", GridRecorder())
    again, _ = linear_act._linear_act_fwd(x, (w,), (None,), linear_act.ACT_GELU_TANH, True, **kw)
    assert torch.equal(again, first)
    (grid,) = grids
    assert grid(config.kwargs) == (min(5, 3 * 2),)  # min(SMs, tiles) programs
    with pytest.raises(AssertionError, match="autotuner"):  # a new key: SAVE_PRE off
        linear_act._linear_act_fwd(x, (w,), (None,), linear_act.ACT_GELU_TANH, False, **kw)


def test_persistent_configs_and_epilogue_slices():
    """GeLU's persistent candidates are the persistent GEMMs' (Hopper tiles kept on sm_90 only,
    16-bit), SwiGLU's the dual tiles plus 128x128 per accumulator on 8 warps (kept on sm_90 for
    16-bit operands only: two accumulators); each config's epilogue slices hold <= 32
    accumulator values per thread and accumulator (the interpreter's: 4 slices)."""
    h100, a100 = configs.ARCH_LIMITS[90], configs.ARCH_LIMITS[80]

    def tiles(cs):
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps) for c in cs}

    gelu, swiglu = linear_act_kernels.persistent_gpu_configs(False), linear_act_kernels.persistent_gpu_configs(True)
    hopper = {(128, 256, 64, 8), (256, 128, 64, 8), (128, 128, 128, 8)}
    assert hopper <= tiles(configs.prune_gemm_configs(gelu, h100, 2, 1, 1))
    assert not hopper & tiles(configs.prune_gemm_configs(gelu, a100, 2, 1, 1))
    kept = tiles(configs.prune_gemm_configs(swiglu, h100, 2, 1, 2, accumulators=2))
    assert (128, 128, 64, 8) in kept and not any(bm * bn > 128 * 128 for bm, bn, _, _ in kept)
    assert (128, 128, 64, 8) not in tiles(configs.prune_gemm_configs(swiglu, a100, 2, 1, 2, accumulators=2))
    assert (128, 128, 64, 8) not in tiles(configs.prune_gemm_configs(swiglu, h100, 4, 1, 2, accumulators=2))
    for c in gelu + swiglu:
        bm, bn, warps, sub = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.kwargs["SUBTILES"]
        assert sub in (1, 2, 4) and bm * bn // (32 * warps) // sub <= linear_act_kernels.EPILOGUE_REGS
    assert [linear_act_kernels.subtiles(*t) for t in ((128, 256, 8), (128, 128, 8), (128, 128, 4), (64, 64, 4))] == [
        4,
        2,
        4,
        1,
    ]
    # the interpreter's one config slices its 32x32 tiles in 4 (GeLU; SwiGLU's epilogue in 2),
    # so that the tests above run the sliced epilogues
    for kernel in (linear_act_kernels.linear_gelu_persistent_kernel, linear_act_kernels.linear_swiglu_tma_kernel):
        assert [c.kwargs["SUBTILES"] for c in kernel.configs] == [4]
    for kernel in (
        linear_act_kernels.linear_gelu_persistent_kernel,
        linear_act_kernels.linear_gelu_tma_kernel,
        linear_act_kernels.linear_swiglu_persistent_kernel,
        linear_act_kernels.linear_swiglu_tma_kernel,
    ):
        assert "PRECISION" in kernel.keys  # tf32 and IEEE fp32 tuned apart
