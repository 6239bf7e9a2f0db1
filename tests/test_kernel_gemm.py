"""Plain GEMMs (kernels/gemm.py `matmul`): the Triton kernels under the CPU interpreter and the
torch engine against a float64 product, on odd shapes, strided (transposed) operands, two
products in one launch, a 16-bit product written into fp32, and bad arguments. The persistent
kernels (pointer loads and TMA descriptors) with split-K on and off, the split-K plan against
its in-kernel twin, the choice of kernel, and the cached launches."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from meshtron.kernels import gemm  # noqa: E402
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


# ----------------------------------------------------------------------------- persistent kernels


@pytest.fixture
def reductions(monkeypatch):
    """Counts the split-K reductions `matmul` launches."""
    calls = []
    reduce = gemm._reduce

    def counting(ws, out, cfg, full, tail, split, tuned):
        calls.append(split)
        return reduce(ws, out, cfg, full, tail, split, tuned)

    monkeypatch.setattr(gemm, "_reduce", counting)
    return calls


def test_split_plan_cuts_the_last_wave_only_below_two_waves():
    # gpt_1b tp=4 dW (1408x2048 out, K 4096): 176 tiles of 128x128 on 132 SMs -> 132 whole,
    # 44 in 3 pieces; 88 tiles of 128x256 -> all in 3 pieces (2 full waves of pieces).
    assert gemm.split_plan(176, 64, 132, 16) == (132, 3)
    assert gemm.split_plan(88, 64, 132, 16) == (0, 3)
    assert gemm.split_plan(176, 64, 132, 1) == (176, 1)  # split_k=False
    assert gemm.split_plan(264, 64, 132, 16) == (264, 1)  # whole waves: nothing to fill
    assert gemm.split_plan(352, 32, 132, 16) == (352, 1)  # x·Wᵀ 4096x1408: >= 2 waves
    assert gemm.split_plan(7168, 64, 132, 16) == (7168, 1)  # the 8B-class shape
    assert gemm.split_plan(3, 2, 4, 16) == (3, 1)  # short K: a piece would cost more than it saves
    for tiles in range(1, 40):
        for k_tiles in (1, 3, 8, 64):
            full, split = gemm.split_plan(tiles, k_tiles, 8, 16)
            assert split == 1 or (tiles < 16 and full == tiles // 8 * 8 and split <= 16)
            assert split > 1 or full == tiles


def test_in_kernel_split_plan_is_the_host_plan():
    """The kernels' `_split_plan` (elementwise here, over 512 random (tiles, K tiles, SMs)) and
    the host's `split_plan`, which sizes the workspace and the reduction, agree."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(tiles_ptr, k_ptr, sms_ptr, out_ptr, max_split, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tiles, k_tiles, sms = tl.load(tiles_ptr + i), tl.load(k_ptr + i), tl.load(sms_ptr + i)
        full, split = gemm._split_plan(tiles, k_tiles, sms, max_split, gemm._SPLIT_OVERHEAD)
        tl.store(out_ptr + 2 * i, full)
        tl.store(out_ptr + 2 * i + 1, split)

    gen = torch.Generator().manual_seed(0)
    sms = torch.randint(1, 140, (512,), generator=gen, dtype=torch.int32)
    tiles = (torch.rand(512, generator=gen) * 2.5 * sms).to(torch.int32) + 1
    k_tiles = torch.randint(1, 80, (512,), generator=gen, dtype=torch.int32)
    for max_split in (16, 3):
        out = torch.zeros(512, 2, dtype=torch.int32)
        probe[(1,)](tiles, k_tiles, sms, out, max_split, BLOCK=512)
        host = [gemm.split_plan(t, k, n, max_split) for t, k, n in zip(tiles.tolist(), k_tiles.tolist(), sms.tolist())]
        assert out.tolist() == [list(p) for p in host]
        assert max_split == 3 or sum(p[1] > 1 for p in host) > 100  # the sample exercises splitting


@pytest.mark.parametrize("split_k", [None, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_pointer_kernel_odd_shapes_transposes_and_split_k(split_k, dtype, reductions):
    """Odd sizes, A transposed (dW), B transposed (x·Wᵀ), fp32 out; on 3 "SMs" 4 output tiles
    leave one tail tile that split-K cuts into K pieces (K = 300: 19 K tiles of 16)."""
    tol = 1e-5
    g, x, w = _rand(300, 37, seed=10, dtype=dtype), _rand(300, 50, seed=11, dtype=dtype), _rand(50, 300, seed=12)
    kw = dict(persistent=True, tma=False, split_k=split_k, num_sms=3)
    assert gemm.gemm_plan(g.t(), x, None, **kw).kernel == "_matmul_persistent_kernel"
    for _ in range(2):  # the first call autotunes, the second launches the cached config
        out = matmul(g.t(), x, out=torch.empty(37, 50), **kw)
        _assert_close(out, g.double().t() @ x.double(), tol)
    a, b = x[:37], w.to(dtype).t()[:50, :40]  # B column-major (x·Wᵀ)
    out = matmul(a, b, out=torch.empty(37, 40), **kw)
    _assert_close(out, a.double() @ b.double(), tol)
    assert (len(reductions) > 0) == (split_k is None)
    assert all(s > 1 for s in reductions)


@pytest.mark.parametrize("split_k", [None, False])
def test_persistent_dual_product_and_unequal_k(split_k):
    """dX = g1 W1 + g2 W2 in one persistent launch, also with K2 != K (split or not)."""
    both = _rand(37, 100, seed=13)
    g1, g2 = both[:, :50], both[:, 50:]
    w1, w2 = _rand(50, 33, seed=14), _rand(50, 33, seed=15)
    kw = dict(persistent=True, tma=False, split_k=split_k, num_sms=3)
    out = matmul(g1, w1, a2=g2, b2=w2, **kw)
    _assert_close(out, g1.double() @ w1.double() + g2.double() @ w2.double(), 1e-5)
    g3, w3 = _rand(37, 200, seed=16), _rand(200, 33, seed=17)
    out = matmul(g1, w1, a2=g3, b2=w3, **kw)
    _assert_close(out, g1.double() @ w1.double() + g3.double() @ w3.double(), 1e-5)
    # the one-program-per-tile kernel takes equal K only: unequal K runs persistent
    assert gemm.gemm_plan(g1, w1, None, g3, w3).kernel == "_matmul_persistent_kernel"
    _assert_close(matmul(g1, w1, a2=g3, b2=w3), g1.double() @ w1.double() + g3.double() @ w3.double(), 1e-5)


@pytest.mark.parametrize("split_k", [None, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_tma_kernel_on_transposed_16bit_operands(split_k, out_dtype, reductions):
    """The descriptor kernel (the interpreter runs TensorDescriptor loads): dW = g^T x with g
    row-major (A's descriptor on g, tiles transposed), x·Wᵀ (B's on W), dual dX, odd M and N
    (zero-filled edges), K 320 split on 3 "SMs"; bf16 or fp32 out."""
    bf = torch.bfloat16
    g, x, w = _rand(320, 40, seed=20, dtype=bf), _rand(320, 56, seed=21, dtype=bf), _rand(40, 56, seed=22, dtype=bf)
    kw = dict(persistent=True, tma=True, split_k=split_k, num_sms=3)
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2
    plan = gemm.gemm_plan(g.t()[:37], x, None, **kw)
    assert plan.kernel == "_matmul_tma_kernel" and plan.layouts == ("t", "n")
    for _ in range(2):
        out = matmul(g.t()[:37], x, out=torch.empty(37, 56, dtype=out_dtype), **kw)
        _assert_close(out, g.double().t()[:37] @ x.double(), tol)
    assert gemm.gemm_plan(x[:37], w.t(), None, **kw).layouts == ("n", "t")
    out = matmul(x[:37], w.t(), out=torch.empty(37, 40, dtype=out_dtype), **kw)
    _assert_close(out, x[:37].double() @ w.double().t(), tol)
    both = _rand(37, 80, seed=23, dtype=bf)
    w1, w2 = _rand(40, 56, seed=24, dtype=bf), _rand(40, 56, seed=25, dtype=bf)
    assert gemm.gemm_plan(both[:, :40], w1, None, both[:, 40:], w2, **kw).kernel == "_matmul_tma_kernel"
    out = matmul(both[:, :40], w1, torch.empty(37, 56, dtype=out_dtype), both[:, 40:], w2, **kw)
    _assert_close(out, both[:, :40].double() @ w1.double() + both[:, 40:].double() @ w2.double(), tol)
    assert (len(reductions) > 0) == (split_k is None)


def test_kernel_choice():
    """The one-program-per-tile kernel by default on CPU; TMA only for 16-bit operands TMA can
    load (unit stride, 16-byte aligned base and row stride), the pointer kernel otherwise."""
    bf = torch.bfloat16
    a, b = _rand(48, 64, seed=30, dtype=bf), _rand(64, 32, seed=31, dtype=bf)
    assert gemm.gemm_plan(a, b, None).kernel == "_matmul_kernel"
    assert gemm.gemm_plan(a, b, None, persistent=True).kernel == "_matmul_persistent_kernel"  # not sm_90
    assert gemm.gemm_plan(a, b, None, persistent=True, tma=True).layouts == ("n", "n")
    assert gemm.gemm_plan(a.float(), b.float(), None, persistent=True, tma=True).kernel == "_matmul_persistent_kernel"
    odd = _rand(48, 70, seed=32, dtype=bf)[:, :64]  # row stride 70 elements: 140 B, not 16-byte aligned
    assert gemm.gemm_plan(odd, b, None, persistent=True, tma=True).kernel == "_matmul_persistent_kernel"
    shifted = _rand(48 * 64 + 1, seed=33, dtype=bf)[1:].view(48, 64)  # base 2 bytes off
    assert gemm.gemm_plan(shifted, b, None, persistent=True, tma=True).kernel == "_matmul_persistent_kernel"
    assert gemm.gemm_plan(a, b, None, a[:, :32], b[:32], persistent=True, tma=True).layouts == ("n", "n")
    a_cm = a.t().contiguous().t()  # column-major: "t"; a2 laid out unlike a -> pointer loads for both
    assert gemm.gemm_plan(a_cm, b, None, persistent=True, tma=True).layouts == ("t", "n")
    assert gemm.gemm_plan(a, b, None, a_cm, b, persistent=True, tma=True).kernel == "_matmul_persistent_kernel"
    assert gemm.gemm_plan(a, b, None, persistent=True, split_k=False, num_sms=7)[2:] == (7, 1)


def test_device_properties_read_once_and_launches_cached(monkeypatch):
    """The SM count is read once per device; a repeated GEMM launches the jitted kernel with
    the cached config, not through the autotuner."""
    reads = []

    def props(device):
        reads.append(device)
        return types.SimpleNamespace(multi_processor_count=132, major=9)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    fake = torch.device("cuda", 7)
    try:
        assert gemm.device_info(fake) == (132, 9) and gemm.device_info(fake) == (132, 9)
        assert reads == [fake]
    finally:
        gemm._SMS.pop(fake, None)
    a, b = _rand(40, 48, seed=40), _rand(48, 24, seed=41)
    matmul(a, b, persistent=True, num_sms=5)

    def no_autotuner(*args, **kwargs):
        raise AssertionError("a cached launch went through the autotuner")

    monkeypatch.setattr(gemm._matmul_persistent_kernel, "run", no_autotuner)
    _assert_close(matmul(a, b, persistent=True, num_sms=5), a.double() @ b.double(), 1e-5)
