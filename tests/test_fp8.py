"""FP8 dense GEMMs (mpu/fp8.py, trainer.precision=fp8) on the CPU, where torch's reference
`_scaled_mm` computes what the GPU's FP8 tensor cores would: the scales' formula, the GEMMs
equal to the product of the dequantized operands, the weight gradient left in bf16, which
linears take FP8 (not the LM head), a short training run that tracks bf16, and the refusal
on a GPU without FP8. Then the FP8 expert grouped GEMMs (moe/fp8_experts.py): forward and
input gradient equal to the product of the dequantized operands (rows per row, each expert's
weight per column / per row) and close to bf16, the weight gradient the bf16 one, empty groups
and odd row counts, the `_scaled_grouped_mm` operands accepted by torch's own checks (on the
meta device: the CPU has no such kernel), the path chosen per device, and an MoE model that
trains under Precision("fp8") with its expert GEMMs in FP8. (The Triton FP8 grouped kernel is
tested under the interpreter in tests/test_kernel_grouped_gemm.py.)"""

from __future__ import annotations

import pytest
import torch

from meshtron.errors import ConfigError
from meshtron.moe import experts, fp8_experts
from meshtron.moe.experts import grouped_matmul
from meshtron.mpu import fp8
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.precision import Precision
from meshtron.training.step import train_step
from tests.distributed.dense_cases import build, microbatches, model_config
from tests.distributed.moe_cases import moe_config

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


# ---------------------------------------------------------------- FP8 expert grouped GEMMs


def _grouped_loop(a, b, sizes):
    """float64 a[rows of g] @ b[g], one matmul per group."""
    outs, start = [], 0
    for g, n in enumerate(sizes):
        outs.append(a[start : start + n] @ b[g])
        start += n
    return torch.cat(outs)


def _expert_run(x, w, sizes, dy, fp8_on=True, device="cpu"):
    leaves = [t.to(device, copy=True).requires_grad_() for t in (x, w)]
    scope = fp8.fp8_scope() if fp8_on else fp8.fp8_paused()
    with torch.autocast(device, dtype=torch.bfloat16), scope:
        y = grouped_matmul(leaves[0], leaves[1], torch.tensor(sizes, device=device))
    y.backward(dy.to(device))
    return y.cpu(), leaves[0].grad.cpu(), leaves[1].grad.cpu()


def _within_bf16(got, want, ulps=2):
    """|got - want| <= ulps bf16 units of |want| (plus a hair for values near 0)."""
    return ((got.double() - want).abs() <= want.abs() * ulps * BF16_ULP + 1e-6).all()


# groups of 0 rows, row counts that are not multiples of 16, a single-row group, all rows in one
EXPERT_SIZES = [[5, 0, 21, 3], [0, 0, 29, 0], [1, 9, 0, 19]]


@pytest.mark.parametrize("sizes", EXPERT_SIZES)
def test_expert_gemms_equal_the_product_of_dequantized_operands(sizes):
    """y = x W_g and dx = dy W_g^T from e4m3 operands (x, dy per row; W_g per output column,
    resp. per input row), fp32 accumulation, one bf16 rounding; dW_g = x_g^T dy_g in bf16."""
    n, k, f = sum(sizes), 48, 32
    x, w, dy = _rand(n, k, seed=11), _rand(4, k, f, seed=12) * 0.2, _rand(n, f, seed=13).bfloat16()
    y, dx, dw = _expert_run(x, w, sizes, dy)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert y.dtype == torch.bfloat16 and dx.dtype == dw.dtype == torch.float32
    assert _within_bf16(y, _grouped_loop(_dequantized(xb, -1), _dequantized(wb, 1), sizes))
    assert _within_bf16(dx, _grouped_loop(_dequantized(dy, -1), _dequantized(wb, -1).transpose(1, 2), sizes))
    want_dw = torch.stack([xb[g].double().t() @ dy[g].double() for g in _row_slices(sizes)])
    assert _within_bf16(dw, want_dw)


def _on_fp8_grouped_gpu() -> bool:
    return torch.cuda.is_available() and (
        torch.cuda.get_device_capability() in fp8_experts.SCALED_GROUPED_MM_CAPABILITIES
    )


@pytest.mark.cuda
@pytest.mark.skipif(not _on_fp8_grouped_gpu(), reason="needs an sm_90 / sm_100 GPU (torch's FP8 grouped GEMM)")
@pytest.mark.parametrize("sizes", EXPERT_SIZES)
def test_scaled_grouped_mm_on_the_gpu_equals_the_dequantized_product(sizes):
    """On the GPU the experts take torch's _scaled_grouped_mm (groups of 0 rows and rows not a
    multiple of 16 included) and give the product of the dequantized operands as the CPU's
    emulation does (2 bf16 units); dW the bf16 product."""
    assert fp8_experts.fp8_grouped_path(torch.device("cuda"), "triton_checked") == "scaled_grouped_mm"
    n, k, f = sum(sizes), 48, 32
    x, w, dy = _rand(n, k, seed=11), _rand(4, k, f, seed=12) * 0.2, _rand(n, f, seed=13).bfloat16()
    y, dx, dw = _expert_run(x, w, sizes, dy, device="cuda")
    xb, wb = x.bfloat16(), w.bfloat16()
    assert _within_bf16(y, _grouped_loop(_dequantized(xb, -1), _dequantized(wb, 1), sizes))
    assert _within_bf16(dx, _grouped_loop(_dequantized(dy, -1), _dequantized(wb, -1).transpose(1, 2), sizes))
    want_dw = torch.stack([xb[g].double().t() @ dy[g].double() for g in _row_slices(sizes)])
    assert _within_bf16(dw, want_dw)


def _row_slices(sizes):
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    return [slice(s, s + n) for s, n in zip(starts, sizes)]


def test_expert_gemms_are_close_to_bf16():
    """Against the bf16 grouped GEMM: forward and dx within 5% (relative Frobenius; e4m3 keeps
    3 mantissa bits, ~3% measured here), dW identical (both bf16 grouped GEMMs)."""
    sizes = [7, 0, 33, 24]
    x, w, dy = _rand(64, 64, seed=14), _rand(4, 64, 48, seed=15) / 8, _rand(64, 48, seed=16).bfloat16()
    got, ref = _expert_run(x, w, sizes, dy), _expert_run(x, w, sizes, dy, fp8_on=False)
    for a, b in zip(got[:2], ref[:2]):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert 0 < err < 0.05, err
    assert torch.equal(got[2], ref[2])


def test_expert_gemms_take_fp8_only_inside_a_scope_and_for_widths_of_16():
    """Outside an fp8_scope, or with an in / out width not a multiple of 16 (here 24): the bf16
    grouped GEMM, bit for bit."""
    sizes = [3, 0, 13]
    x, w, dy = _rand(16, 24, seed=17), _rand(3, 24, 32, seed=18), _rand(16, 32, seed=19).bfloat16()
    for a, b in zip(_expert_run(x, w, sizes, dy), _expert_run(x, w, sizes, dy, fp8_on=False)):
        assert torch.equal(a, b)
    with fp8.fp8_scope():
        assert not fp8_experts.fp8_grouped_eligible(x, w)
        assert fp8_experts.fp8_grouped_eligible(x, _rand(3, 32, 16, seed=20))
    assert not fp8_experts.fp8_grouped_eligible(x, _rand(3, 32, 16, seed=20))


@pytest.mark.parametrize("sizes", [[5, 0, 21, 3], [0, 0, 0, 0]])
def test_scaled_grouped_mm_operands_pass_torchs_checks(sizes):
    """The sm_90 path hands `torch._scaled_grouped_mm` what its checks (the meta kernel mirrors
    the CUDA ones) accept: x row-major e4m3, the weight column-major e4m3, scales [N] and
    [G, N_out] fp32, int32 offsets, bf16 out -- forward and input gradient, any group sizes."""
    n = sum(sizes)
    meta = dict(device="meta", dtype=torch.bfloat16)
    x, w, dy = torch.empty(n, 48, **meta), torch.empty(4, 48, 32, **meta), torch.empty(n, 32, **meta)
    sizes = torch.empty(4, dtype=torch.int64, device="meta")
    offs = torch.empty(4, dtype=torch.int32, device="meta")
    y = fp8_experts.grouped_fp8_product(x, w, sizes, offs, "scaled_grouped_mm")
    dx = fp8_experts.grouped_fp8_product(dy, w.transpose(1, 2), sizes, offs, "scaled_grouped_mm")
    assert (y.shape, y.dtype, dx.shape) == ((n, 32), torch.bfloat16, (n, 48))
    q = torch.empty(4, 48, 32, device="meta", dtype=torch.float8_e4m3fn)  # row-major: refused
    with pytest.raises(RuntimeError, match="column major"):
        torch._scaled_grouped_mm(
            torch.empty(n, 48, device="meta", dtype=torch.float8_e4m3fn),
            q,
            torch.empty(n, device="meta"),
            torch.empty(4, 32, device="meta"),
            offs=offs,
            out_dtype=torch.bfloat16,
        )


def test_fp8_grouped_path_per_device(monkeypatch):
    """sm_90: torch's _scaled_grouped_mm; sm_89: bf16 experts, not FP8 (under auto the Triton
    kernel only once measured faster: kernels/measured.json has no figure for it yet);
    kernels.backend=triton: Triton; the CPU: the emulation."""
    cuda = torch.device("cuda")
    path = fp8_experts.fp8_grouped_path
    assert path(torch.device("cpu"), "torch") == path(torch.device("cpu"), "triton_checked") == "emulated"
    assert path(torch.device("cpu"), "triton") == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert path(cuda, "torch") == path(cuda, "triton_checked") == "scaled_grouped_mm"
    assert path(cuda, "triton") == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert path(cuda, "triton_checked") == path(cuda, "torch") == "bf16"
    assert path(cuda, "triton") == "triton"
    with pytest.raises(ValueError, match="must be one of"):
        fp8_experts.grouped_fp8_product(_rand(4, 16, seed=0), _rand(1, 16, 16, seed=0), torch.tensor([4]), None, "x")


def _train_moe(precision, steps, expert_fp8=True, monkeypatch=None):
    if not expert_fp8:
        monkeypatch.setattr(experts, "fp8_grouped_eligible", lambda x, w, backend="torch": False)
    cfg = moe_config("llama", 2, "softmax", None)
    losses = _train(cfg, precision, steps)
    if not expert_fp8:
        monkeypatch.undo()
    return cfg, losses


def test_moe_training_runs_its_expert_gemms_in_fp8(monkeypatch):
    """A llama MoE (hidden 64, expert ffn 32, 8 experts, top-2) trains 5 steps under
    Precision("fp8"): every expert GEMM (up, gate, down forward, each again for dx) goes
    through the FP8 grouped product, the losses differ from the same run with bf16 expert
    GEMMs (dense linears in FP8 in both), track bf16 within 2% and fall."""
    calls = []
    real = fp8_experts.grouped_fp8_product

    def spy(a, b, sizes, offsets, path):
        calls.append(path)
        return real(a, b, sizes, offsets, path)

    _, bf16 = _train_moe(Precision("bf16", "cpu"), 5)
    _, dense_only = _train_moe(Precision("fp8", "cpu"), 5, expert_fp8=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(fp8_experts, "grouped_fp8_product", spy)
    cfg, got = _train_moe(Precision("fp8", "cpu"), 5)
    moe_layers = cfg.num_layers // cfg.moe_every
    assert calls == ["emulated"] * (5 * 2 * moe_layers * 3 * 2)  # steps x microbatches x layers x GEMMs x (fwd, dx)
    assert got != dense_only and got != bf16
    for step, (a, b) in enumerate(zip(got, bf16)):
        assert abs(a - b) <= 0.02 * b, (step, a, b)
    assert got[-1] < got[0]
