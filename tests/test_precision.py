"""Mixed precision: bf16/fp16 autocast training tracks fp32 on a short CPU run (stated
tolerance), fp16 overflows are skipped without touching weights or optimizer state while the
loss scale backs off, and the scaler's rule is exact."""

from __future__ import annotations

import pytest
import torch

from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.precision import LossScaler, Precision
from meshtron.training.step import train_step
from tests.distributed.dense_cases import build, microbatches, model_config

# A 10-step run of the tiny test models on one batch (loss 5.3 -> 4.2 / 3.1): bf16 keeps 8
# mantissa bits, fp16 11; per-step losses stay within this relative distance of the fp32 run
# (measured worst step: 2.9e-4 bf16, 1.8e-5 fp16; the bounds leave ~7-10x room).
TRACKING_RTOL = {"bf16": 2e-3, "fp16": 2e-4}


def _run(cfg, precision: Precision, steps: int = 10) -> list[float]:
    mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh)
    losses = []
    for _ in range(steps):
        # One batch over and over: the loss must fall (memorisation), in every precision.
        out = train_step(
            model,
            reducer,
            optimizer,
            microbatches(cfg, 0, 0, 1, 2),
            mesh,
            lr=3e-3,
            max_grad_norm=1.0,
            precision=precision,
        )
        assert not out.skipped
        losses.append(out.loss.item())
    reducer.remove_hooks()
    return losses


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(arch, name):
    cfg = model_config(arch)
    reference = _run(cfg, Precision("fp32"))
    got = _run(cfg, Precision(name, "cpu", LossScaler(scale=1024.0)))
    assert got != reference, "the 16-bit run must actually compute in 16 bits"
    for step, (a, b) in enumerate(zip(got, reference)):
        assert abs(a - b) <= TRACKING_RTOL[name] * b, (step, a, b)
    assert got[-1] < got[0] - 0.1 and reference[-1] < reference[0] - 0.1


def test_fp16_overflow_is_skipped_and_the_scale_backs_off():
    cfg = model_config("gpt2")
    mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh)
    # 2**30 times the loss overflows fp16 gradients (max 65504) in the first backward.
    precision = Precision("fp16", "cpu", LossScaler(scale=2.0**30, growth_interval=2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = train_step(
        model, reducer, optimizer, microbatches(cfg, 0, 0, 1, 2), mesh, lr=1e-3, max_grad_norm=1.0, precision=precision
    )
    assert out.skipped and torch.isfinite(out.loss), "an overflowing gradient, not the loss, skips the step"
    assert precision.loss_scale == 2.0**29
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed in a skipped step"
    assert not optimizer.state
    skipped = 1
    while True:
        out = train_step(
            model,
            reducer,
            optimizer,
            microbatches(cfg, 0, 0, 1, 2),
            mesh,
            lr=1e-3,
            max_grad_norm=1.0,
            precision=precision,
        )
        if not out.skipped:
            break
        skipped += 1
        assert skipped < 30
    assert precision.loss_scale == 2.0 ** (30 - skipped)
    assert torch.isfinite(out.grad_norm) and optimizer.state
    # The gradient norm is reported unscaled: it matches the fp32 norm of the same batch.
    fp32_model, fp32_reducer, fp32_opt = build(cfg, mesh)
    ref = train_step(
        fp32_model, fp32_reducer, fp32_opt, microbatches(cfg, 0, 0, 1, 2), mesh, lr=1e-3, max_grad_norm=1.0
    )
    assert abs(out.grad_norm.item() - ref.grad_norm.item()) <= 1e-2 * ref.grad_norm.item()


def test_loss_scaler_rule():
    scaler = LossScaler(scale=8.0, growth_interval=3)
    scaler.update(False)
    assert scaler.scale == 4.0 and scaler.good_steps == 0
    for _ in range(2):
        scaler.update(True)
    assert scaler.scale == 4.0 and scaler.good_steps == 2
    scaler.update(True)
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    tiny = LossScaler(scale=1.0)
    tiny.update(False)
    assert tiny.scale == 1.0  # never below min_scale


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="trainer.precision='fp4' is unknown"):
        Precision("fp4")
