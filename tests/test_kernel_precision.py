"""16-bit compute in the Triton kernels (Triton interpreter on CPU): under
trainer.precision=bf16|fp16 the GEMM kernels receive 16-bit operands (fp32 accumulation,
dW written in fp32), the norms run on the dtype the model feeds them, a training step
matches the torch path under the same autocast, and each weight is cast once per step.
Also the TF32 policy (kernels/tf32.py) under both torch APIs."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from meshtron.kernels import operands, tf32  # noqa: E402
from meshtron.models.config import GPTConfig  # noqa: E402
from meshtron.training.precision import LossScaler, Precision  # noqa: E402
from meshtron.training.step import train_step  # noqa: E402
from tests.test_kernels_in_model import CONFIGS, build_training  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative distance of the triton step from the torch step under the same autocast: both
# compute in 16 bits with fp32 accumulation but round at different places (the fused kernel
# keeps the pre-activation in fp32; autocast rounds it to 16 bits, and its dW too).
STEP_RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 3e-3}

GEMM_KERNELS = {
    "linear_gelu_fwd_kernel",
    "linear_gelu_bwd_kernel",
    "linear_swiglu_fwd_kernel",
    "linear_swiglu_bwd_kernel",
    "_matmul_kernel",
    "_grouped_gemm_kernel",
    "_grouped_gemm_dw_kernel",
}


@pytest.fixture
def launches(monkeypatch):
    """Every autotuned kernel launch as (kernel name, {tensor argument: dtype})."""
    from triton.runtime.autotuner import Autotuner

    from meshtron.kernels import launch

    launch.clear()  # every launch through the autotuner again, where this fixture sees it
    seen = []
    original = Autotuner.run

    def run(self, *args, **kwargs):
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        seen.append((self.base_fn.__name__, {k: v.dtype for k, v in named.items() if isinstance(v, torch.Tensor)}))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", run)
    return seen


def _step(cfg: GPTConfig, backend: str, precision: str, n_micro: int = 1):
    model, reducer, optimizer, mesh = build_training(cfg, backend)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(n_micro):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    out = train_step(
        model,
        reducer,
        optimizer,
        batches,
        mesh,
        lr=1e-3,
        max_grad_norm=1.0,
        precision=Precision(precision, "cpu", LossScaler(scale=1024.0)),
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    reducer.remove_hooks()
    return out, grads


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", CONFIGS)
def test_kernels_receive_the_compute_dtype_and_match_torch(name, precision, launches):
    got, got_grads = _step(CONFIGS[name], "triton", precision)
    compute = DTYPES[precision]
    kernels = {k for k, _ in launches}
    expected = {"_ce_partials_kernel", "_ce_backward_kernel", "_norm_fwd_kernel", "_norm_bwd_kernel"}
    expected |= {"_grouped_gemm_kernel", "_grouped_gemm_dw_kernel"} if name == "moe" else {"_matmul_kernel"}
    expected |= {"linear_gelu_fwd_kernel"} if name == "gpt2" else set()
    expected |= {"linear_swiglu_fwd_kernel"} if name == "llama" else set()
    assert expected <= kernels, expected - kernels
    for kernel, dtypes in launches:
        if kernel in GEMM_KERNELS:
            # Operands in the compute dtype; the weight-gradient outputs in the fp32 main dtype.
            outputs = {"dw_ptr"} | ({"c_ptr"} if dtypes.get("c_ptr") == torch.float32 else set())
            operands_ = {
                k: v for k, v in dtypes.items() if k not in outputs and k != "sizes_ptr" and not k.startswith("b")
            }
            assert set(operands_.values()) == {compute}, (kernel, dtypes)
            assert all(dtypes[k] == torch.float32 for k in outputs & set(dtypes)), (kernel, dtypes)
        elif kernel.startswith("_norm"):
            # The residual stream stays fp32 under autocast, as F.layer_norm would see it.
            assert dtypes["X"] == torch.float32, (kernel, dtypes)
        elif kernel.startswith("_ce"):
            assert dtypes["logits_ptr"] == compute, (kernel, dtypes)
    mixed = [
        d
        for k, d in launches
        if (k == "_matmul_kernel" and d["a_ptr"] != d["c_ptr"])
        or (k == "_grouped_gemm_dw_kernel" and d["x_ptr"] != d["dw_ptr"])
    ]
    assert (precision == "fp32") == (not mixed), "16-bit runs write dW from 16-bit operands into fp32"

    want, want_grads = _step(CONFIGS[name], "torch", precision)
    rtol = STEP_RTOL[precision]
    assert abs(got.loss.item() - want.loss.item()) <= rtol * want.loss.item()
    for param, grad in want_grads.items():
        diff = (got_grads[param] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert diff <= 10 * rtol, f"{param}: relative gradient difference {diff:.2e}"


def test_weights_are_cast_once_per_step(monkeypatch):
    """Two microbatches, forward and backward: every GEMM weight is cast to bf16 once."""
    casts = []

    def counting_copy(weight, dtype):
        if (
            weight is not None
            and weight.dtype != dtype
            and (operands._scope is None or id(weight) not in operands._scope)
        ):
            casts.append(weight.shape)
        return original(weight, dtype)

    original = operands.weight_copy
    for module in ("meshtron.kernels.linear_act", "meshtron.kernels.grouped_gemm"):
        monkeypatch.setattr(f"{module}.weight_copy", counting_copy)
    _step(CONFIGS["moe"], "triton", "bf16", n_micro=2)
    mlp_weights = 3  # the MoE layer's expert w_gate, w_up, w_down
    assert len(casts) == mlp_weights, casts


def test_weight_copy_scope_caches_and_releases():
    w = torch.randn(4, 4, requires_grad=True)
    assert operands.weight_copy(w, torch.float32) is not w  # detached view, same dtype: no copy
    assert operands.weight_copy(w, torch.bfloat16) is not operands.weight_copy(w, torch.bfloat16)
    with operands.weight_copy_scope():
        first = operands.weight_copy(w, torch.bfloat16)
        assert operands.weight_copy(w, torch.bfloat16) is first
        assert operands.weight_copy(w, torch.float16) is not first  # another dtype, another copy
    with operands.weight_copy_scope():
        with torch.no_grad():
            w.add_(1.0)  # the optimizer ran between steps
        assert torch.equal(operands.weight_copy(w, torch.bfloat16), w.detach().to(torch.bfloat16))
    assert operands._scope is None


def test_compute_dtype_follows_autocast():
    x = torch.randn(2, 3)
    assert operands.compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert operands.compute_dtype(x) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert operands.compute_dtype(x) == torch.float16
    assert operands.compute_dtype(x.to(torch.float16)) == torch.float16


@pytest.fixture
def restore_tf32():
    matmul = torch.backends.cuda.matmul
    saved = (matmul.fp32_precision, torch.backends.fp32_precision, tf32.tf32_mode())
    yield
    matmul.fp32_precision, torch.backends.fp32_precision = saved[0], saved[1]
    tf32.set_tf32_mode(saved[2])


def test_tf32_policy_reads_both_torch_apis_without_raising(restore_tf32):
    matmul = torch.backends.cuda.matmul
    matmul.fp32_precision = "tf32"  # the newer API: reading allow_tf32 now raises in torch 2.13
    with pytest.raises(RuntimeError):
        _ = matmul.allow_tf32
    assert tf32.torch_allows_tf32() and tf32.dot_precision(torch.float32) == "tf32"
    matmul.fp32_precision = "ieee"
    assert not tf32.torch_allows_tf32() and tf32.dot_precision(torch.float32) == "ieee"
    matmul.fp32_precision = "none"
    torch.backends.fp32_precision = "tf32"  # inherited from the global setting
    assert tf32.torch_allows_tf32()
    torch.backends.fp32_precision = "none"
    matmul.allow_tf32 = True  # the legacy API
    assert tf32.torch_allows_tf32()
    matmul.allow_tf32 = False
    assert not tf32.torch_allows_tf32()
    assert tf32.dot_precision(torch.bfloat16) == "ieee"  # 16-bit: tensor cores regardless


def test_tf32_knob_overrides_torch_and_rejects_bad_values(restore_tf32):
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    tf32.set_tf32_mode("on")
    assert tf32.dot_precision(torch.float32) == "tf32"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    tf32.set_tf32_mode("off")
    assert tf32.dot_precision(torch.float32) == "ieee"
    with pytest.raises(ValueError, match="kernels.tf32"):
        tf32.set_tf32_mode("maybe")


def test_autotune_key_includes_the_dot_precision():
    from meshtron.kernels import gemm, grouped_gemm, linear_act

    for kernel in (
        linear_act.linear_gelu_fwd_kernel,
        linear_act.linear_swiglu_fwd_kernel,
        linear_act.linear_gelu_bwd_kernel,
        linear_act.linear_swiglu_bwd_kernel,
        gemm._matmul_kernel,
    ):
        assert "PRECISION" in kernel.keys
    for kernel in (grouped_gemm._grouped_gemm_kernel, grouped_gemm._grouped_gemm_dw_kernel):
        assert "INPUT_PRECISION" in kernel.keys
