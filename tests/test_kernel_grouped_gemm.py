"""Triton grouped GEMM (kernels/grouped_gemm.py) under the CPU interpreter vs the plain-torch
reference: forward and both gradients with both kernel families -- one program per tile (the
interpreter's default) and CUDA's default (the persistent forward / dx with pointer loads, and
with TMA descriptors for 16-bit operands; the cache-ordered dW) -- with empty groups, single-token groups, row counts that are
not multiples of BLOCK_M and K / N that are not multiples of their blocks, fp32 and 16-bit.
Also: the persistent schedule's unit order, its grid sized without a host sync, and launches
that skip the autotuner after the first call of a key."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from meshtron.kernels import grouped_gemm as gg  # noqa: E402
from meshtron.kernels.grouped_gemm import GroupedGemmFunction, grouped_gemm, grouped_gemm_reference  # noqa: E402

# The kernel families under test, as `grouped_gemm` switches: one program per tile; persistent
# on the interpreter's 4 "SMs" (several units per program); persistent on 1 SM (one program
# walks every unit, across all groups) and on more SMs than units (programs with no unit).
VARIANTS = {
    "tile": dict(persistent=False),
    "persistent": dict(persistent=True, tma=False),
    "persistent-1sm": dict(persistent=True, tma=False, num_sms=1),
    "persistent-64sm": dict(persistent=True, tma=False, num_sms=64),
}
KERNELS = {  # forward (and dx), dW kernel of each variant
    "tile": ("_grouped_gemm_kernel", "_grouped_gemm_dw_kernel"),
    "tma": ("_grouped_gemm_tma_kernel", "_grouped_gemm_dw_ordered_kernel"),
}


def _kernels_of(variant):
    return KERNELS.get(variant, ("_grouped_gemm_persistent_kernel", "_grouped_gemm_dw_ordered_kernel"))


def _loop(x, weight, sizes):
    outs, start = [], 0
    for g, n in enumerate(sizes):
        outs.append(x[start : start + n] @ weight[g])
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[2])


def _run(fn, x, weight, sizes, dy):
    x = x.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    y = fn(x, weight, sizes)
    y.backward(dy)
    return y.detach(), x.grad, weight.grad


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def tuned(monkeypatch):
    """Names of the kernels launched through the autotuner (every launch cache emptied first)."""
    from triton.runtime.autotuner import Autotuner

    from meshtron.kernels import launch

    launch.clear()
    names = []
    original = Autotuner.run
    monkeypatch.setattr(
        Autotuner, "run", lambda self, *a, **k: names.append(self.base_fn.__name__) or original(self, *a, **k)
    )
    yield names
    launch.clear()


# The interpreter configs use 16x16x16 blocks: sizes 17 / 33 span two / three row tiles with a
# partial last one, K=20 / N=12 and K=40 / N=36 leave partial K and N tiles.
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("sizes", [[0, 1, 17, 0, 5], [3], [0, 0, 0], [33, 0, 16, 1]])
@pytest.mark.parametrize("k,n", [(20, 12), (40, 36)])
def test_grouped_gemm_triton_matches_reference(sizes, k, n, variant, tuned):
    gen = torch.Generator().manual_seed(len(sizes) * 100 + k)
    groups, rows = len(sizes), sum(sizes)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(groups, k, n, generator=gen)
    dy = torch.randn(rows, n, generator=gen)
    group_sizes = torch.tensor(sizes, dtype=torch.int64)

    y_ref, dx_ref, dw_ref = _run(grouped_gemm_reference, x, weight, group_sizes, dy)
    kw = VARIANTS[variant]
    y, dx, dw = _run(lambda a, b, s: grouped_gemm(a, b, s, backend="triton", **kw), x, weight, group_sizes, dy)

    assert y.shape == (rows, n) and y.dtype == torch.float32
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(dw, dw_ref)
    for g, size in enumerate(sizes):  # empty groups get exactly zero weight gradient
        if size == 0:
            assert torch.count_nonzero(dw[g]) == 0
    # The reference itself agrees with the naive per-group loop.
    _close(y_ref, _loop(x, weight, sizes))
    fwd, dw_kernel = _kernels_of(variant)  # the family asked for is the one that ran
    assert set(tuned) == ({fwd} if rows else set()) | {dw_kernel}, tuned


@pytest.mark.parametrize("variant", ["tile", "persistent"])
def test_grouped_gemm_triton_strided_inputs(variant):
    """Non-contiguous x and weight (transposed views) are read through their strides."""
    gen = torch.Generator().manual_seed(7)
    sizes = [5, 0, 18]
    x = torch.randn(20, sum(sizes), generator=gen).t()  # [23, 20], stride (1, 23)
    weight = torch.randn(3, 12, 20, generator=gen).transpose(1, 2)  # [3, 20, 12]
    dy = torch.randn(sum(sizes), 12, generator=gen)
    group_sizes = torch.tensor(sizes, dtype=torch.int32)
    y_ref, dx_ref, dw_ref = _run(grouped_gemm_reference, x, weight, group_sizes, dy)
    switches = (VARIANTS[variant]["persistent"], False, None)
    y, dx, dw = _run(
        lambda a, b, s: GroupedGemmFunction.apply(a, b, s, b.detach(), switches), x, weight, group_sizes, dy
    )
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(dw, dw_ref)


def test_grouped_gemm_function_takes_the_four_argument_form():
    """`GroupedGemmFunction.apply(x, weight, sizes, w_c)` (no switches): the plan's defaults."""
    x, weight = torch.randn(6, 8), torch.randn(2, 8, 4)
    sizes = torch.tensor([2, 4])
    _close(GroupedGemmFunction.apply(x, weight, sizes, weight), _loop(x, weight, [2, 4]))


def test_grouped_gemm_torch_backend_is_reference_and_bad_backend_raises():
    x, weight = torch.randn(4, 3), torch.randn(2, 3, 5)
    sizes = torch.tensor([1, 3])
    _close(grouped_gemm(x, weight, sizes), _loop(x, weight, [1, 3]))
    with pytest.raises(ValueError):
        grouped_gemm(x, weight, sizes, backend="cuda")
    with pytest.raises(ValueError):
        grouped_gemm_reference(x, weight, torch.tensor([1, 2]))  # sums to 3, not 4


# 16-bit: K=24 / N=40 keep every row stride a multiple of 16 bytes, so the TMA kernel takes the
# forward (weight row-major) and dx (w^T: its descriptor on the [G, N, K] storage); the last K
# tile and N tiles are partial and a 3-D descriptor box must not read the next expert's weights
# (the empty experts' weights are NaN: a read of them would reach the outputs as 0 * NaN).
@pytest.mark.parametrize("variant", ["tile", "persistent", "tma"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1.6e-2), (torch.float16, 1e-3)])
def test_grouped_gemm_triton_16bit(dtype, tol, variant, tuned):
    """16-bit inputs, fp32 accumulation: outputs keep the input dtype and match the reference
    (which also accumulates in fp32) to about one rounding of the output dtype."""
    gen = torch.Generator().manual_seed(3)
    sizes = [0, 1, 17, 0, 5, 33]
    k, n = 24, 40
    x = torch.randn(sum(sizes), k, generator=gen).to(dtype)
    weight = torch.randn(len(sizes), k, n, generator=gen).to(dtype)
    weight[[0, 3]] = float("nan")  # the empty groups' experts: never read (a box past K would)
    dy = torch.randn(sum(sizes), n, generator=gen).to(dtype)
    group_sizes = torch.tensor(sizes)
    kw = VARIANTS.get(variant, dict(persistent=True, tma=True))
    if variant == "tma":
        assert gg.grouped_plan(x, weight, **kw).layouts == ("n", "n")
        assert gg.grouped_plan(dy, weight.transpose(1, 2), **kw).layouts == ("n", "t")
    ref = _run(grouped_gemm_reference, x, weight, group_sizes, dy)
    out = _run(lambda a, b, s: grouped_gemm(a, b, s, backend="triton", **kw), x, weight, group_sizes, dy)
    for a, e in zip(out, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)
    assert set(tuned) == set(_kernels_of(variant)), tuned


def test_plan_falls_back_to_pointer_loads():
    """TMA only for 16-bit, row-major x and a weight with a unit stride and 16-byte aligned strides."""
    x, w = torch.randn(8, 24, dtype=torch.bfloat16), torch.randn(3, 24, 40, dtype=torch.bfloat16)
    tma = dict(persistent=True, tma=True)
    assert gg.grouped_plan(x, w, **tma).kernel == "_grouped_gemm_tma_kernel"
    assert gg.grouped_plan(x.float(), w.float(), **tma).kernel == "_grouped_gemm_persistent_kernel"
    assert gg.grouped_plan(x, w[:, :, :36], **tma).kernel == "_grouped_gemm_tma_kernel"  # row stride still 80 B
    assert gg.grouped_plan(x, w[:, :, :36].contiguous(), **tma).kernel == "_grouped_gemm_persistent_kernel"
    assert gg.grouped_plan(x[:, :20].contiguous(), w[:, :20], **tma).kernel == "_grouped_gemm_persistent_kernel"
    assert gg.grouped_plan(x.t().contiguous().t(), w, **tma).kernel == "_grouped_gemm_persistent_kernel"
    assert gg.grouped_plan(x, w).kernel == "_grouped_gemm_kernel"  # the interpreter's default
    assert gg.grouped_plan(x, w, persistent=True).kernel == "_grouped_gemm_persistent_kernel"  # not sm_90


@triton.jit
def _schedule_kernel(sizes_ptr, out_ptr, G, N_OUT, G_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Unit u -> (group, first row, rows, row tile, column tile) by the persistent kernels' own
    helper, for every unit of the group sizes (column tiles of 16)."""
    sizes = tl.load(sizes_ptr + tl.arange(0, G_BLOCK), mask=tl.arange(0, G_BLOCK) < G, other=0)
    num_n = tl.cdiv(N_OUT, 16)
    units = tl.sum((sizes + BLOCK_M - 1) // BLOCK_M, axis=0) * num_n
    for u in range(0, units):
        g, row_start, rows, pid_m, pid_n = gg._unit_of(u, sizes_ptr, G, num_n, BLOCK_M, G_BLOCK, GROUP_M)
        tl.store(out_ptr + u * 5, g)
        tl.store(out_ptr + u * 5 + 1, row_start)
        tl.store(out_ptr + u * 5 + 2, rows)
        tl.store(out_ptr + u * 5 + 3, pid_m)
        tl.store(out_ptr + u * 5 + 4, pid_n)


def test_persistent_unit_order_is_group_major_and_cache_aware():
    """The persistent forward's units: every (group, row tile, column tile) exactly once, group
    by group, and inside a group GROUP_M row tiles down one weight column before the next
    column (consecutive units share the expert's B tile), the same band of row tiles for every
    column (the A tiles in flight stay the same)."""
    sizes = [33, 0, 5, 70, 0, 16]  # 3, 0, 1, 5, 0, 1 row tiles of 16
    n_out, block_m, group_m = 40, 16, 2  # 3 column tiles
    tiles = [-(-s // block_m) for s in sizes]
    units = sum(tiles) * 3
    out = torch.full((units, 5), -1, dtype=torch.int32)
    _schedule_kernel[(1,)](torch.tensor(sizes, dtype=torch.int32), out, len(sizes), n_out, 8, block_m, group_m)
    rows = [tuple(r) for r in out.tolist()]
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    want = {(g, starts[g], sizes[g], m, c) for g, t in enumerate(tiles) for m in range(t) for c in range(3)}
    assert sorted(rows) == sorted(want) and len(rows) == len(want)
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)  # group-major
    group3 = [(m, c) for g, _, _, m, c in rows if g == 3]  # 5 row tiles: bands {0, 1}, {2, 3}, {4}
    assert group3 == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (2, 0), (3, 0), (2, 1), (3, 1)] + [
        (2, 2),
        (3, 2),
        (4, 0),
        (4, 1),
        (4, 2),
    ]


def test_persistent_grid_is_sized_without_a_host_sync(monkeypatch):
    """The persistent launches read no group size on the host: the grid comes from N, G and the
    widths (every program finds its units from the sizes on device)."""
    x, weight = torch.randn(40, 20), torch.randn(4, 20, 12)
    sizes = torch.tensor([0, 17, 23, 0])
    want = _loop(x, weight, [0, 17, 23, 0])
    gg.grouped_gemm(x, weight, sizes, backend="triton", persistent=True)  # tuned once (the autotuner may read)

    def no_sync(*args, **kwargs):
        raise AssertionError("host read of a device tensor")

    for name in ("item", "tolist", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    y = gg._launch_gemm(x, weight, sizes.to(torch.int32), x.dtype, gg.grouped_plan(x, weight, persistent=True))
    dw = gg._launch_dw(x, torch.ones(40, 12), sizes.to(torch.int32), 4, x.dtype, True)
    monkeypatch.undo()
    _close(y, want)
    _close(dw[1], x[:17].t() @ torch.ones(17, 12))
    assert gg._programs(132, 40, 4, 12, {"BLOCK_M": 16, "BLOCK_N": 16}) == (3 + 4) * 1  # bound below the SMs
    assert gg._programs(4, 40, 4, 12, {"BLOCK_M": 16, "BLOCK_N": 16}) == 4
    assert gg._programs(132, 3, 8, 12, {"BLOCK_M": 16, "BLOCK_N": 16}) == 1 + 3  # non-empty groups <= rows


def test_repeated_launches_skip_the_autotuner(tuned):
    """The first call of a key goes through the autotuner; a later call with other group sizes
    (another row count and grid, the same key) launches the remembered config directly."""
    from meshtron.kernels import launch

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(3, 24, 40, generator=gen, dtype=torch.bfloat16)
    for variant in ("tile", "persistent", "tma"):
        kw = VARIANTS.get(variant, dict(persistent=True, tma=True))
        launch.clear()  # the dW kernel of "persistent" and "tma" is one key
        tuned.clear()
        for sizes in ([5, 0, 18], [40, 2, 0], [1, 1, 1]):
            x = torch.randn(sum(sizes), 24, generator=gen, dtype=torch.bfloat16).requires_grad_(True)
            y = grouped_gemm(x, weight.requires_grad_(True), torch.tensor(sizes), backend="triton", **kw)
            y.float().sum().backward()
            torch.testing.assert_close(y.float(), _loop(x.float(), weight.float(), sizes), rtol=2e-2, atol=2e-2)
        fwd, dw = _kernels_of(variant)
        assert sorted(tuned) == sorted([fwd, fwd, dw]), (variant, tuned)  # forward and dx: two keys


def test_new_kernels_autotune_on_the_dot_precision():
    for kernel in (gg._grouped_gemm_persistent_kernel, gg._grouped_gemm_tma_kernel, gg._grouped_gemm_dw_ordered_kernel):
        assert "INPUT_PRECISION" in kernel.keys and "G_BLOCK" in kernel.keys


# The FP8 grouped GEMM (`grouped_gemm_fp8`, moe/fp8_experts.py's "triton" path): the interpreter
# loads e4m3 tiles and multiplies them exactly in fp32 (checked against the float64 product).
FP8_SIZES = [[5, 0, 21, 3], [0, 0, 0, 0], [17, 1, 0, 40]]


@pytest.mark.parametrize("sizes", FP8_SIZES)
@pytest.mark.parametrize("k_major", [False, True])
def test_fp8_grouped_kernel_matches_the_scaled_product(sizes, k_major):
    """y[rows of g] = s_x[rows] s_w[g] (q_x @ q_w[g]) in bf16: empty groups, rows and K (40)
    not multiples of the 16-wide interpreter tiles, the weight row-major or K-major (the layout
    moe/fp8_experts.py feeds)."""
    gen = torch.Generator().manual_seed(7)
    n, k, f = sum(sizes), 40, 24
    x_q = torch.randn(n, k, generator=gen).mul(20).to(torch.float8_e4m3fn)
    w = torch.randn(4, f, k, generator=gen).mul(20).to(torch.float8_e4m3fn)
    w_q = w.transpose(1, 2) if k_major else w.transpose(1, 2).contiguous()
    x_s, w_s = torch.rand(n, generator=gen) + 0.5, torch.rand(4, f, generator=gen) + 0.5
    y = gg.grouped_gemm_fp8(x_q, x_s, w_q, w_s, torch.tensor(sizes))
    want = _loop(x_q.double() * x_s.double()[:, None], w_q.double() * w_s.double()[:, None, :], sizes)
    assert y.dtype == torch.bfloat16 and y.shape == (n, f)
    # one bf16 rounding (half a unit: 2^-8 relative) of an fp32 sum whose own error may tip it over
    assert ((y.double() - want).abs() <= want.abs() * 2.0**-7 + 1e-9).all()


def test_fp8_expert_gemms_on_triton_equal_the_emulation():
    """moe/fp8_experts.py under kernels.backend=triton (this kernel) against its emulated path
    (dequantize, fp32 matmul): forward and dx within one bf16 unit of each other, dW equal."""
    from meshtron.moe import fp8_experts
    from meshtron.mpu.fp8 import fp8_scope

    gen = torch.Generator().manual_seed(8)
    sizes = torch.tensor([5, 0, 21, 3])
    x, w = torch.randn(29, 48, generator=gen), torch.randn(4, 48, 32, generator=gen) * 0.2
    dy = torch.randn(29, 32, generator=gen).bfloat16()
    outs = {}
    for backend in ("triton", "torch"):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8_scope():
            y = fp8_experts.fp8_grouped_matmul(xl, wl, sizes, backend)
        y.backward(dy)
        outs[backend] = (y.double(), xl.grad.double(), wl.grad)
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = outs["triton"], outs["torch"]
    # the same fp32 products summed in another order, each rounded once to bf16: at most one
    # bf16 unit apart (2^-7 relative)
    assert ((y - y_ref).abs() <= y_ref.abs() * 2.0**-7 + 1e-6).all()
    assert ((dx - dx_ref).abs() <= dx_ref.abs() * 2.0**-7 + 1e-6).all()
    assert torch.equal(dw, dw_ref)
