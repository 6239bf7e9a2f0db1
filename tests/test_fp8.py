"""FP8 dense GEMMs (mpu/fp8.py, trainer.precision=fp8) on the CPU, where torch's reference
`_scaled_mm` computes what the GPU's FP8 tensor cores would: the scales' formula, the GEMMs
equal to the product of the dequantized operands, the weight gradient left in bf16, which
linears take FP8 (not the LM head), a short training run that tracks bf16, and the refusal
on a GPU without FP8."""

from __future__ import annotations

import pytest
import torch

from meshtron.errors import ConfigError
from meshtron.mpu import fp8
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.precision import Precision
from meshtron.training.step import train_step
from tests.distributed.dense_cases import build, microbatches, model_config

BF16_ULP = 2.0**-8  # relative rounding of a bf16 output


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_scales_map_each_rows_amax_to_448():
    x = _rand(5, 32, seed=0)
    x[2] = 0.0  # an all-zero row: scale 1, zeros
    q, scale = fp8.quantize(x, -1)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    amax = x.abs().amax(dim=1, keepdim=True)
    expected = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    assert torch.equal(scale, expected)
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 3, 4]], torch.full((4,), 448.0))
    assert torch.equal(q[2].float(), torch.zeros(32))
    # e4m3 keeps 3 mantissa bits: each value within half a unit in the last place (2^-4 relative)
    deq = q.float() * scale
    normal = x.abs() >= scale * 2.0**-6  # e4m3's smallest normal, in x's units
    assert ((deq - x).abs() <= x.abs() * 2.0**-4 + 1e-12)[normal].all()
    _, column_scale = fp8.quantize(x, 0)
    assert column_scale.shape == (1, 32)
    _, tensor_scale = fp8.quantize(x, None)
    assert tensor_scale.dim() == 0 and tensor_scale == x.abs().max() / 448.0


def _dequantized(x, dim):
    q, s = fp8.quantize(x, dim)
    return q.double() * s.double()


@pytest.mark.parametrize("per_tensor", [False, True])
def test_linear_equals_the_product_of_dequantized_operands(per_tensor):
    """Forward x W^T and input gradient dy W from FP8 operands (scales along the reduction
    dimension), accumulated in fp32, rounded once to bf16; dW = dy^T x in bf16 as without FP8."""
    x, w, b = _rand(48, 64, seed=1), _rand(32, 64, seed=2) * 0.1, _rand(32, seed=3)
    dy = _rand(48, 32, seed=4).bfloat16()
    dim = None if per_tensor else -1
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8.fp8_scope(per_tensor=per_tensor):
        y = fp8.linear(*leaves)
    y.backward(dy)
    xb, wb = x.bfloat16(), w.bfloat16()
    product, bias = _dequantized(xb, dim) @ _dequantized(wb, dim).t(), b.bfloat16().double()
    assert y.dtype == torch.bfloat16  # rounded twice: the GEMM's output, then the bias add
    assert ((y.double() - (product + bias)).abs() <= (product.abs() + bias.abs()) * 2 * BF16_ULP).all()
    w_cols = _dequantized(wb.t().contiguous(), None if per_tensor else -1).t()  # W scaled per column
    want_dx = _dequantized(dy, dim) @ w_cols
    assert ((leaves[0].grad.double() - want_dx).abs() <= want_dx.abs() * 2 * BF16_ULP + 1e-5).all()
    assert torch.equal(leaves[1].grad, (dy.t() @ xb).float())  # the weight gradient: a bf16 GEMM
    assert torch.equal(leaves[2].grad, dy.float().sum(0).bfloat16().float())


def test_fp8_error_is_small_against_fp32():
    x, w = _rand(64, 128, seed=5), _rand(96, 128, seed=6) / 128**0.5
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8.fp8_scope():
        y = fp8.linear(x, w)
    exact = x @ w.t()
    assert (y.float() - exact).norm() / exact.norm() < 0.05


def test_only_eligible_shapes_and_only_inside_a_scope():
    """A GEMM dimension that is not a multiple of 16 (here K = 24), or no scope: plain bf16."""
    x, w = _rand(32, 24, seed=7), _rand(16, 24, seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = torch.nn.functional.linear(x, w)
        with fp8.fp8_scope():
            assert fp8.fp8_mode(x, w) is None
            assert torch.equal(fp8.linear(x, w), plain)
        x2, w2 = _rand(32, 32, seed=9), _rand(16, 32, seed=10)
        assert torch.equal(fp8.linear(x2, w2), torch.nn.functional.linear(x2, w2))
        with fp8.fp8_scope(), fp8.fp8_paused():
            assert fp8.fp8_mode(x2, w2) is None


def _count_fp8_gemms(monkeypatch):
    calls = []
    real = fp8._scaled_mm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8, "_scaled_mm", spy)
    return calls


def _train(cfg, precision, steps):
    mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh)
    losses = []
    for _ in range(steps):
        batches = microbatches(cfg, 0, 0, 1, 2)
        out = train_step(model, reducer, optimizer, batches, mesh, lr=3e-3, max_grad_norm=1.0, precision=precision)
        assert not out.skipped
        losses.append(out.loss.item())
    reducer.remove_hooks()
    return losses


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fp8_training_tracks_bf16_and_uses_fp8_for_the_dense_linears_only(arch, monkeypatch):
    cfg = model_config(arch)
    reference = _train(cfg, Precision("bf16", "cpu"), steps=8)
    calls = _count_fp8_gemms(monkeypatch)
    got = _train(cfg, Precision("fp8", "cpu"), steps=8)
    # per layer and microbatch: qkv, proj, the MLP's 2 (gpt2) or 3 (llama) linears forward, each
    # again for its input gradient; the LM head (fused with the loss) and the embeddings stay bf16
    linears = 4 if arch == "gpt2" else 5
    assert len(calls) == 8 * 2 * cfg.num_layers * linears * 2
    assert got != reference
    for step, (a, b) in enumerate(zip(got, reference)):
        assert abs(a - b) <= 0.02 * b, (step, a, b)  # FP8 keeps 3 mantissa bits: ~1% per step here
    assert got[-1] < got[0] - 0.1


def test_fp8_is_refused_on_a_gpu_without_fp8(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ok, why = fp8.fp8_supported(torch.device("cuda"))
    assert not ok and "8.9" in why and "8.0" in why
    with pytest.raises(ConfigError, match="trainer.precision=fp8: .*use trainer.precision=bf16"):
        Precision("fp8", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.fp8_supported(torch.device("cuda")) == (True, "")
    assert not fp8.fp8_supported(torch.device("mps"))[0]
