"""Triton grouped GEMM (kernels/grouped_gemm.py) under the CPU interpreter vs the plain-torch
reference: forward and both gradients, fp32, with empty groups, single-token groups, row
counts that are not multiples of BLOCK_M and K / N that are not multiples of their blocks."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

from meshtron.kernels.grouped_gemm import GroupedGemmFunction, grouped_gemm, grouped_gemm_reference  # noqa: E402


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


# The interpreter config uses 16x16x16 blocks: sizes 17 / 33 span two / three row tiles with a
# partial last one, K=20 / N=12 and K=40 / N=36 leave partial K and N tiles.
@pytest.mark.parametrize("sizes", [[0, 1, 17, 0, 5], [3], [0, 0, 0], [33, 0, 16, 1]])
@pytest.mark.parametrize("k,n", [(20, 12), (40, 36)])
def test_grouped_gemm_triton_matches_reference(sizes, k, n):
    gen = torch.Generator().manual_seed(len(sizes) * 100 + k)
    groups, rows = len(sizes), sum(sizes)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(groups, k, n, generator=gen)
    dy = torch.randn(rows, n, generator=gen)
    group_sizes = torch.tensor(sizes, dtype=torch.int64)

    y_ref, dx_ref, dw_ref = _run(grouped_gemm_reference, x, weight, group_sizes, dy)
    y, dx, dw = _run(lambda a, b, s: grouped_gemm(a, b, s, backend="triton"), x, weight, group_sizes, dy)

    assert y.shape == (rows, n) and y.dtype == torch.float32
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(dw, dw_ref)
    for g, size in enumerate(sizes):  # empty groups get exactly zero weight gradient
        if size == 0:
            assert torch.count_nonzero(dw[g]) == 0
    # The reference itself agrees with the naive per-group loop.
    _close(y_ref, _loop(x, weight, sizes))


def test_grouped_gemm_triton_strided_inputs():
    """Non-contiguous x and weight (transposed views) are read through their strides."""
    gen = torch.Generator().manual_seed(7)
    sizes = [5, 0, 18]
    x = torch.randn(20, sum(sizes), generator=gen).t()  # [23, 20], stride (1, 23)
    weight = torch.randn(3, 12, 20, generator=gen).transpose(1, 2)  # [3, 20, 12]
    dy = torch.randn(sum(sizes), 12, generator=gen)
    group_sizes = torch.tensor(sizes, dtype=torch.int32)
    y_ref, dx_ref, dw_ref = _run(grouped_gemm_reference, x, weight, group_sizes, dy)
    y, dx, dw = _run(lambda a, b, s: GroupedGemmFunction.apply(a, b, s, b.detach()), x, weight, group_sizes, dy)
    _close(y, y_ref)
    _close(dx, dx_ref)
    _close(dw, dw_ref)


def test_grouped_gemm_torch_backend_is_reference_and_bad_backend_raises():
    x, weight = torch.randn(4, 3), torch.randn(2, 3, 5)
    sizes = torch.tensor([1, 3])
    _close(grouped_gemm(x, weight, sizes), _loop(x, weight, [1, 3]))
    with pytest.raises(ValueError):
        grouped_gemm(x, weight, sizes, backend="cuda")
    with pytest.raises(ValueError):
        grouped_gemm_reference(x, weight, torch.tensor([1, 2]))  # sums to 3, not 4


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1.6e-2), (torch.float16, 1e-3)])
def test_grouped_gemm_triton_16bit(dtype, tol):
    """16-bit inputs, fp32 accumulation: outputs keep the input dtype and match the reference
    (which also accumulates in fp32) to about one rounding of the output dtype."""
    gen = torch.Generator().manual_seed(3)
    sizes = [0, 1, 17, 0, 5]
    x = torch.randn(sum(sizes), 20, generator=gen).to(dtype)
    weight = torch.randn(len(sizes), 20, 12, generator=gen).to(dtype)
    dy = torch.randn(sum(sizes), 12, generator=gen).to(dtype)
    group_sizes = torch.tensor(sizes)
    ref = _run(grouped_gemm_reference, x, weight, group_sizes, dy)
    out = _run(lambda a, b, s: grouped_gemm(a, b, s, backend="triton"), x, weight, group_sizes, dy)
    for a, e in zip(out, ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a, e, rtol=tol, atol=tol)
