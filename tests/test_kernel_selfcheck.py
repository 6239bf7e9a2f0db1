"""The self-checked kernel backend (`triton_checked`, what kernels.backend=auto gives on CUDA),
forced on CPU under the Triton interpreter: correct kernels pass their check and then run
Triton; a kernel returning wrong values (forward or backward) or raising is replaced by the
torch path with exactly one warning naming it, and the training steps still equal the torch
backend's; the strict `triton` backend raises instead; ranks agree (2-process gloo world)."""

from __future__ import annotations

import os
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import json

import pytest  # noqa: E402
import torch  # noqa: E402

from meshtron.kernels import (  # noqa: E402
    backend,  # noqa: E402
    cross_entropy,
    linear_act,
    norms,
    selfcheck,
)
from meshtron.kernels.backend import (  # noqa: E402
    CHECKED,
    auto_runs_torch,
    plain_gemm_backend,
    resolve_backend,
)
from meshtron.models.config import ExecutionConfig, GPTConfig  # noqa: E402
from meshtron.training.step import train_step  # noqa: E402
from tests.distributed.harness import run_world  # noqa: E402
from tests.distributed.selfcheck_cases import TripledGrad  # noqa: E402
from tests.test_kernels_in_model import build_training  # noqa: E402

LLAMA = GPTConfig(
    arch="llama",
    num_layers=1,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=48,
    vocab_size=200,
    seq_len=8,
    tie_embeddings=False,
)


@pytest.fixture(autouse=True)
def _fresh_selfcheck():
    selfcheck.reset()
    yield
    selfcheck.reset()


def two_steps(backend: str) -> tuple[list[torch.Tensor], dict]:
    """Losses of two training steps of the tiny llama with `backend`, and its final weights."""
    model, reducer, optimizer, mesh = build_training(LLAMA, backend)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
        out = train_step(model, reducer, optimizer, [(tokens[:, :-1], tokens[:, 1:])], mesh, lr=1e-3, max_grad_norm=1.0)
        losses.append(out.loss.detach())
    reducer.remove_hooks()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_run(got, want) -> None:
    """Losses and weights equal to the tolerance test_kernels_in_model allows Triton vs torch."""
    for g, w in zip(got[0], want[0]):
        assert torch.allclose(g, w, rtol=1e-5), (g, w)
    for name, weight in want[1].items():
        assert torch.allclose(got[1][name], weight, rtol=1e-5, atol=1e-6), name


def selfcheck_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, selfcheck.KernelSelfCheckWarning)]


@pytest.fixture(scope="module")
def torch_run():
    return two_steps("torch")


def counting(monkeypatch, module, name: str) -> dict:
    """Wrap module.name so its calls are counted; returns the counter."""
    original, count = getattr(module, name), {"calls": 0}

    def wrapper(*args, **kwargs):
        count["calls"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return count


def test_backend_modes():
    assert resolve_backend("auto", "cuda") == CHECKED
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("triton", "cpu") == "triton"  # strict, interpreter
    assert resolve_backend(CHECKED, "cpu") == CHECKED  # tests force the checked mode on CPU
    assert ExecutionConfig(kernel_backend=CHECKED).kernel_backend == CHECKED
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("fast", "cuda")


def test_auto_runs_the_measured_slower_kernels_with_torch_on_cuda_only():
    measured = {m["kernel"] for m in json.loads(backend.MEASURED.read_text())["measurements"]}
    assert measured <= set(selfcheck.KERNELS) | {"gemm"}, "measured.json names a kernel nobody dispatches"
    assert auto_runs_torch("rms_norm", "cuda") and auto_runs_torch("linear_swiglu", "cuda")
    assert not auto_runs_torch("cross_entropy", "cuda")  # 33x its torch path on an H200
    assert not auto_runs_torch("grouped_gemm", "cuda")  # decided per dtype in moe/experts.py
    assert not any(auto_runs_torch(k, "cpu") for k in selfcheck.KERNELS)  # tests keep the interpreter
    # the fused SwiGLU only from AUTO_TRITON_MIN_ELEMENTS elements, on any device
    assert auto_runs_torch("swiglu", "cuda", (1 << 26) - 1) and auto_runs_torch("swiglu", "cpu", 240)
    assert not auto_runs_torch("swiglu", "cuda", 1 << 26) and not auto_runs_torch("swiglu", "cuda")
    assert not auto_runs_torch("cross_entropy", "cuda", 1)  # no size rule for the others
    # the fused kernels' plain GEMMs: cuBLAS under auto on CUDA, Triton when strict or interpreted
    assert plain_gemm_backend(CHECKED, "cuda") == "torch" and plain_gemm_backend("triton", "cuda") == "triton"
    assert plain_gemm_backend(CHECKED, "cpu") == "triton" and plain_gemm_backend("torch", "cpu") == "torch"


def test_auto_follows_the_newest_measurement_of_this_gpu(monkeypatch, request):
    """kernels/measured.json decides: the newest date wins, this GPU's entries before other
    GPUs', the slowest dtype of a date counts, and a kernel never measured runs torch."""

    def entry(kernel, device, date, speedup, dtype="bf16"):
        return {"kernel": kernel, "device": device, "date": date, "dtype": dtype, "speedup": speedup, "source": "t"}

    table = (
        entry("rms_norm", "H200", "2026-11-27", 0.3),
        entry("rms_norm", "H200", "2026-12-01", 1.4),  # newer and faster: Triton
        entry("layer_norm", "H200", "2026-12-01", 1.2),
        entry("layer_norm", "H200", "2026-12-01", 0.9, "fp32"),  # the slower dtype of that date counts
        entry("linear_gelu", "H200", "2026-12-01", 1.5),
        entry("linear_gelu", "A100", "2026-11-01", 0.8),  # this GPU's own (older) figure wins
    )
    monkeypatch.setattr(backend, "_measurements", lambda: table)
    monkeypatch.setattr(backend, "_cuda_device_name", lambda: "A100")
    backend.prefers_torch_on_cuda.cache_clear()  # decided once per process: forget the real table's
    request.addfinalizer(backend.prefers_torch_on_cuda.cache_clear)  # and this one's, afterwards
    assert not backend.prefers_torch_on_cuda("rms_norm")  # no A100 entry: the H200's newest
    assert backend.prefers_torch_on_cuda("layer_norm") and backend.prefers_torch_on_cuda("linear_gelu")
    assert backend.prefers_torch_on_cuda("residual_rms_norm")  # never measured
    assert not backend.prefers_torch_on_cuda("grouped_gemm")  # decided by the operands, elsewhere
    assert backend.measured_speedup("linear_gelu", "H200") == 1.5 and backend.measured_speedup("x") is None


def test_checked_dispatch_neither_tries_nor_checks_a_kernel_auto_runs_with_torch(monkeypatch):
    monkeypatch.setattr(selfcheck, "auto_runs_torch", lambda kernel, device_type, numel=None: kernel == "rms_norm")

    def triton_fn(x):
        raise AssertionError("the Triton kernel ran")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no self-check warning either
        out = selfcheck.dispatch("rms_norm", CHECKED, triton_fn, lambda x: x * 2, torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    assert selfcheck.verdict("rms_norm") is None and selfcheck.local_result("rms_norm") is None
    assert selfcheck.dispatch("layer_norm", CHECKED, lambda x: x * 3, lambda x: x * 3, torch.ones(3)) is not None
    assert selfcheck.verdict("layer_norm") is True  # the others are still checked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_checked_dispatch_runs_torch_for_the_slower_kernels_on_cuda():
    def triton_fn(x):
        raise AssertionError("the Triton kernel ran")

    for kernel in [k for k in selfcheck.KERNELS if backend.prefers_torch_on_cuda(k)]:
        x = torch.ones(3, device="cuda")
        assert torch.equal(selfcheck.dispatch(kernel, CHECKED, triton_fn, lambda a: a + 1, x), x + 1)


def test_tolerance_follows_dtype_and_autocast():
    f32, b16 = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)
    assert selfcheck.tolerance_for((f32, f32), "cpu") == (selfcheck.TOLERANCES["fp32"], "fp32")
    assert selfcheck.tolerance_for((b16, f32), "cpu") == (selfcheck.TOLERANCES["bf16"], "bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert selfcheck.tolerance_for((f32,), "cpu")[1] == "bf16"
        # The check runs both sides under the caller's autocast: a bf16 matmul compared to
        # itself passes, one compared to fp32 math fails the fp32 tolerance but passes bf16's.
        x, w = torch.randn(8, 16), torch.randn(4, 16)
        result = selfcheck.check(lambda a, b: a @ b.t(), torch.nn.functional.linear, (x, w))
        assert result.passed and result.dtype == "bf16"
    nan = selfcheck.check(lambda a: a * float("nan"), lambda a: a * 1.0, (torch.ones(3),))
    assert not nan.passed and nan.error == float("inf")


def test_correct_kernels_pass_and_then_run_triton(monkeypatch, torch_run, recwarn):
    rms = counting(monkeypatch, norms, "rms_norm")
    residual = counting(monkeypatch, norms, "residual_rms_norm")
    swiglu = counting(monkeypatch, linear_act, "linear_swiglu")
    ce_checked = counting(monkeypatch, cross_entropy, "fused_cross_entropy")
    ce_chunks = counting(monkeypatch, cross_entropy, "softmax_minus_onehot_")
    got = two_steps(CHECKED)
    assert not selfcheck_warnings(recwarn)
    for kernel in ("rms_norm", "residual_rms_norm", "linear_swiglu", "cross_entropy"):
        assert selfcheck.verdict(kernel) is True, kernel
        assert selfcheck.local_result(kernel).error <= selfcheck.TOLERANCES["fp32"]
    # Per step 2 norms (norm1, the final norm), 1 residual norm (the block's attention residual
    # + norm2), 1 MLP, 1 loss (the fused LM loss: one chunk of 16 rows). Step 1: each kernel's
    # first call is the check (one Triton call on clones, the real call on torch), later calls
    # Triton; step 2 all Triton. The loss's check runs the Triton cross-entropy on the chunk's
    # logits (fused_cross_entropy); step 2's chunk runs the Triton chunk kernels.
    assert (rms["calls"], residual["calls"], swiglu["calls"]) == (1 + 1 + 2, 1 + 1, 1 + 1)
    assert (ce_checked["calls"], ce_chunks["calls"]) == (1, 1)
    assert_same_run(got, torch_run)


def test_wrong_kernel_is_replaced_with_one_warning(monkeypatch, torch_run, recwarn):
    original = norms.rms_norm
    bad = {"calls": 0}

    def wrong(x, weight, eps, backend="torch"):
        bad["calls"] += 1
        return original(x, weight, eps, backend=backend) * 1.5

    monkeypatch.setattr(norms, "rms_norm", wrong)
    got = two_steps(CHECKED)
    messages = selfcheck_warnings(recwarn)
    assert len(messages) == 1, messages
    assert "'rms_norm'" in messages[0] and "max error" in messages[0] and "tolerance 0.0001" in messages[0]
    assert bad["calls"] == 1  # the check only
    assert selfcheck.verdict("rms_norm") is False and selfcheck.verdict("linear_swiglu") is True
    assert_same_run(got, torch_run)


def test_wrong_backward_is_caught(monkeypatch, torch_run, recwarn):
    original = cross_entropy.fused_cross_entropy

    def wrong_grad(logits, *args, **kwargs):
        return original(TripledGrad.apply(logits), *args, **kwargs)

    monkeypatch.setattr(cross_entropy, "fused_cross_entropy", wrong_grad)
    got = two_steps(CHECKED)
    messages = selfcheck_warnings(recwarn)
    assert len(messages) == 1 and "'cross_entropy'" in messages[0], messages
    assert_same_run(got, torch_run)


def _raising(*args, **kwargs):
    raise RuntimeError("no kernel image is available for execution on the device")


def test_raising_kernel_is_replaced_with_one_warning(monkeypatch, torch_run, recwarn):
    monkeypatch.setattr(linear_act, "linear_swiglu", _raising)
    got = two_steps(CHECKED)
    messages = selfcheck_warnings(recwarn)
    assert len(messages) == 1, messages
    assert "'linear_swiglu'" in messages[0] and "raised RuntimeError: no kernel image" in messages[0]
    assert_same_run(got, torch_run)


def test_strict_triton_backend_raises(monkeypatch):
    monkeypatch.setattr(linear_act, "linear_swiglu", _raising)
    with pytest.raises(RuntimeError, match="no kernel image"):
        two_steps("triton")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_ranks_agree_on_every_kernel():
    cases = [
        "tests.distributed.selfcheck_cases:verdicts_agree_without_a_model",
        "tests.distributed.selfcheck_cases:llama_tp2_cross_entropy_broken_on_rank1",
    ]
    results = run_world(2, cases, timeout=500.0, collective_timeout=60.0)
    for case, result in results.items():
        assert result["ok"], f"{case}: " + "\n".join(f"rank {r}: {e}" for r, e in result["errors"].items())


@pytest.mark.timeout(300)
def test_training_loop_agrees_after_its_first_step(monkeypatch, tmp_path, recwarn):
    """run_training resolves to the checked mode (forced here; auto does it on CUDA), checks
    each kernel in step 1, calls `agree` once right after it, and runs Triton from step 2."""
    from meshtron.training import loop
    from meshtron.training.config import RunConfig

    monkeypatch.setattr(loop, "resolve_backend", lambda name, device_type: CHECKED)
    agreed = counting(monkeypatch, selfcheck, "agree")
    ln = counting(monkeypatch, norms, "layer_norm")
    run = RunConfig.from_dict(
        {
            "model": {
                "arch": "gpt2",
                "num_layers": 1,
                "hidden_size": 32,
                "num_heads": 2,
                "vocab_size": 256,
                "seq_len": 16,
            },
            "trainer": {
                "max_steps": 3,
                "global_batch_size": 2,
                "device": "cpu",
                "eval_every": 0,
                "progress": False,
                "log_every": 1,
            },
        }
    )
    summary = loop.run_training(run, tmp_path)
    assert agreed["calls"] == 1
    assert not selfcheck_warnings(recwarn)
    assert {k: selfcheck.verdict(k) for k in ("layer_norm", "linear_gelu", "cross_entropy")} == {
        "layer_norm": True,
        "linear_gelu": True,
        "cross_entropy": True,
    }
    # norm1 and the final norm (norm2 is the block's residual norm): step 1 the check and the
    # final norm; steps 2, 3 both Triton
    assert ln["calls"] == 1 + 1 + 2 + 2
    assert summary is not None
