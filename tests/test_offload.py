"""CPU offload of the optimizer (`optim.offload=true`): the same weights as device AdamW, no
optimizer state on the device, and checkpoints that round-trip (single process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtron.dp.offload import OffloadedAdamW
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from meshtron.training.step import train_step
from tests.distributed.dense_cases import ADAM_EPS, LR, assert_close, build, microbatches, model_config
from tests.distributed.moe_cases import moe_config
from tests.distributed.offload_cases import assert_same_weights, checkpoint_dispatch, reference_kind, run, step_once

MICRO = 2  # 4 rows per step: 2 microbatches of 2


def _config(arch: str):
    return moe_config("gpt2", 2, "sigmoid", None) if arch == "moe" else model_config(arch)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "moe"])
@pytest.mark.parametrize("kind", ["offload", "offload_zero", "offload_zero2"])
def test_offload_gives_the_weights_of_device_adamw(arch, kind):
    cfg, mesh = _config(arch), single_process_mesh()
    plain, _, _, want = run(cfg, mesh, reference_kind(kind), micro=MICRO)
    offload, _, optimizer, got = run(cfg, mesh, kind, micro=MICRO)
    assert got == want
    assert_same_weights(offload, plain, kind)  # bit for bit: same element-wise ops on the CPU


def test_foreach_cpu_adamw_within_rounding():
    """fused=False takes torch's foreach AdamW on the host: the device's fused AdamW within rounding."""
    cfg, mesh = model_config("llama"), single_process_mesh()
    plain, _, _, _ = run(cfg, mesh, "plain", micro=MICRO)
    model, reducer, _ = build(cfg, mesh)
    optimizer = OffloadedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS, fused=False)
    assert all(group["foreach"] for group in optimizer.param_groups)
    for s in range(5):
        step_once(model, reducer, optimizer, mesh, cfg, s, MICRO)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert_close(f"foreach {name}", a, b, rtol=1e-6)


@pytest.mark.parametrize("zero", [0, 1])
def test_state_lives_on_the_host(zero):
    cfg, mesh = model_config("gpt2"), single_process_mesh()
    model, reducer, _ = build(cfg, mesh)
    optimizer = OffloadedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS, zero=zero)
    n = sum(p.numel() for p in model.parameters())
    assert optimizer.state_bytes() == 0
    assert optimizer.host_state_bytes() == 4 * n  # main weights; moments are created by the first step
    step_once(model, reducer, optimizer, mesh, cfg, 0, MICRO)
    assert optimizer.state_bytes() == 0
    assert optimizer.host_state_bytes(main_weights=False) == 8 * n
    assert optimizer.host_state_bytes() == 12 * n
    assert optimizer.host_grad_bytes() == 4 * n
    device = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad)}
    for slot in optimizer._slots:  # host copies are separate tensors, even when the device is the CPU
        assert slot.main.untyped_storage().data_ptr() not in device
        assert slot.host_grad.untyped_storage().data_ptr() not in device
    assert all(group["fused"] for group in optimizer.param_groups)


def test_param_groups_follow_build_optimizer():
    cfg, mesh = model_config("llama"), single_process_mesh()
    model, reducer, reference = build(cfg, mesh)
    optimizer = OffloadedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    decay_of = {id(p): g["weight_decay"] for g in reference.param_groups for p in g["params"]}
    for group, slot in zip(optimizer.param_groups, optimizer._slots):
        assert {decay_of[id(p)] for p in slot.bucket.params} == {group["weight_decay"]}
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, reducer, optimizer, microbatches(cfg, 0, 0, 1, MICRO), mesh, lr=0.0, max_grad_norm=1.0)
    assert all(group["lr"] == 0.0 for group in optimizer.param_groups)  # set by the step, as the schedule's lr
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["offload", "offload_zero"])
def test_checkpoint_resume_continues_bit_for_bit(tmp_path, arch, kind):
    cfg = dataclasses.replace(model_config(arch), dropout=0.1)  # exercises the saved RNG streams
    mesh = single_process_mesh()
    with checkpoint_dispatch():
        model, reducer, optimizer, _ = run(cfg, mesh, kind, steps=2, micro=MICRO)
        path = save_checkpoint(
            tmp_path,
            TrainState(step=2, consumed_samples=8),
            [model],
            optimizer,
            mesh,
            model_config=dataclasses.asdict(cfg),
        )
        want = [step_once(model, reducer, optimizer, mesh, cfg, s, MICRO) for s in (2, 3)]
        torch.manual_seed(999)  # a different RNG state: the checkpoint restores it
        fresh, fresh_reducer, _ = build(cfg, mesh)
        fresh_opt = OffloadedAdamW(fresh_reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS, zero=int(kind != "offload"))
        assert load_checkpoint(path, [fresh], fresh_opt, mesh) == TrainState(step=2, consumed_samples=8)
        got = [step_once(fresh, fresh_reducer, fresh_opt, mesh, cfg, s, MICRO) for s in (2, 3)]
    assert got == want
    assert_same_weights(fresh, model, "resumed")


def test_checkpoint_interchangeable_with_device_adamw(tmp_path):
    """Offloaded -> device AdamW and device AdamW -> offloaded give the same continuation."""
    cfg, mesh = model_config("gpt2"), single_process_mesh()
    with checkpoint_dispatch():
        plain, plain_reducer, plain_opt, _ = run(cfg, mesh, "plain", steps=2, micro=MICRO)
        off, off_reducer, off_opt, _ = run(cfg, mesh, "offload", steps=2, micro=MICRO)
        moments, step = off_opt.param_moments()
        assert step == 2.0
        for p, q in zip(off.parameters(), plain.parameters()):
            assert torch.equal(moments[p][0], plain_opt.state[q]["exp_avg"])
            assert torch.equal(moments[p][1], plain_opt.state[q]["exp_avg_sq"])
        from_plain = save_checkpoint(
            tmp_path / "plain", TrainState(step=2), [plain], plain_opt, mesh, model_config=dataclasses.asdict(cfg)
        )
        from_off = save_checkpoint(
            tmp_path / "off", TrainState(step=2), [off], off_opt, mesh, model_config=dataclasses.asdict(cfg)
        )
        want = step_once(plain, plain_reducer, plain_opt, mesh, cfg, 2, MICRO)
        a, a_reducer, _ = build(cfg, mesh)
        a_opt = OffloadedAdamW(a_reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
        load_checkpoint(from_plain, [a], a_opt, mesh)
        b, b_reducer, b_opt = build(cfg, mesh)
        load_checkpoint(from_off, [b], b_opt, mesh)
        assert step_once(a, a_reducer, a_opt, mesh, cfg, 2, MICRO) == want
        assert step_once(b, b_reducer, b_opt, mesh, cfg, 2, MICRO) == want
    assert_same_weights(a, plain, "device checkpoint -> offloaded")
    assert_same_weights(b, plain, "offloaded checkpoint -> device")


def test_weights_written_before_the_first_step_are_picked_up(tmp_path):
    """checkpoint.init_from loads weights only, after the optimizer exists and without
    `load_param_moments`: the host main weights must follow the device weights."""
    cfg, mesh = model_config("llama"), single_process_mesh()
    trained, _, trained_opt, _ = run(cfg, mesh, "plain", steps=2, micro=MICRO)
    path = save_checkpoint(tmp_path, TrainState(step=2), [trained], None, mesh, model_config=dataclasses.asdict(cfg))
    plain, plain_reducer, plain_opt = build(cfg, mesh)
    load_checkpoint(path, [plain], plain_opt, mesh, weights_only=True)
    off, off_reducer, _ = build(cfg, mesh)
    off_opt = OffloadedAdamW(off_reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    load_checkpoint(path, [off], off_opt, mesh, weights_only=True)
    for s in range(2):
        assert step_once(off, off_reducer, off_opt, mesh, cfg, s, MICRO) == step_once(
            plain, plain_reducer, plain_opt, mesh, cfg, s, MICRO
        )
    assert_same_weights(off, plain, "init_from")
