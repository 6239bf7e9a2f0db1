"""The three optimizers of a run (replicated AdamW, ZeRO-1/2 `ShardedAdamW`, CPU-offloaded
`OffloadedAdamW`) as `training.optim.build_reducer_and_optimizer` builds them from the optim
config, each driven through the `TrainingOptimizer` interface only (single process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtron.dp.adamw import ReplicatedAdamW, TrainingOptimizer
from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.dp.offload import OffloadedAdamW
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from meshtron.training.config import OptimConfig
from meshtron.training.optim import build_reducer_and_optimizer
from tests.distributed.dense_cases import ADAM_EPS, LR, SEED, microbatches, model_config

# kind -> (optim config, class it builds)
KINDS = {
    "replicated": (OptimConfig(lr=LR, eps=ADAM_EPS), ReplicatedAdamW),
    "zero1": (OptimConfig(lr=LR, eps=ADAM_EPS, zero=1), ShardedAdamW),
    "zero2": (OptimConfig(lr=LR, eps=ADAM_EPS, zero=2), ShardedAdamW),
    "offload": (OptimConfig(lr=LR, eps=ADAM_EPS, offload=True), OffloadedAdamW),
    "offload_zero2": (OptimConfig(lr=LR, eps=ADAM_EPS, zero=2, offload=True), OffloadedAdamW),
}
CFG = model_config("gpt2")


def _build(kind: str):
    mesh = single_process_mesh()
    (model,) = init_model_chunks(CFG, mesh, SEED)
    reducer, optimizer = build_reducer_and_optimizer(KINDS[kind][0], [model], mesh)
    return model, reducer, optimizer, mesh


def _backward(model, reducer, step: int) -> None:
    """Reduced gradients of one global batch (the reducer owns and zeroes them)."""
    reducer.zero_grad()
    batches = microbatches(CFG, step, 0, 1, 2)
    for i, (x, y) in enumerate(batches):
        with reducer.sync(i == len(batches) - 1):
            model.loss_per_token(model(x), y).sum().backward()
    reducer.finish()


def _protocol_step(model, reducer, optimizer, mesh, step: int, lr: float = LR) -> torch.Tensor:
    _backward(model, reducer, step)
    norm = optimizer.clip_grad_norm([model], 1.0, mesh)
    optimizer.update(lr)
    return norm


def test_factory_builds_the_optimizer_of_the_config():
    for kind, (config, cls) in KINDS.items():
        model, reducer, optimizer, _ = _build(kind)
        assert type(optimizer) is cls and isinstance(optimizer, TrainingOptimizer), kind
        assert reducer.shard_grads is (config.zero == 2), kind
        assert optimizer.offloaded is config.offload, kind
        assert (optimizer.grad_shards_of is reducer) is (config.zero == 2), kind
        assert all(g["fused"] for g in optimizer.param_groups), kind
        assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, config.weight_decay}, kind
    _, reducer, _, _ = _build("replicated")
    assert reducer.comm_dtype is None
    mesh = single_process_mesh()
    (model,) = init_model_chunks(CFG, mesh, SEED)
    reducer, _ = build_reducer_and_optimizer(OptimConfig(grad_comm_dtype="bf16"), [model], mesh)
    assert reducer.comm_dtype is torch.bfloat16


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "replicated"])
def test_gradients_norm_and_update_match_the_replicated_optimizer(kind):
    """`gradients` holds every reduced gradient element once, `clip_grad_norm` measures them,
    `update(lr)` sets every group's lr and steps: the weights of the replicated AdamW."""
    ref, ref_reducer, ref_opt, mesh = _build("replicated")
    model, reducer, optimizer, _ = _build(kind)
    for step, lr in enumerate((LR, LR / 2)):
        _backward(ref, ref_reducer, step)
        want_norm = ref_opt.clip_grad_norm([ref], 1.0, mesh)
        ref_opt.update(lr)
        _backward(model, reducer, step)
        squares = sum(g.double().pow(2).sum() for g in optimizer.gradients([model]))
        norm = optimizer.clip_grad_norm([model], 1.0, mesh)
        torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
        torch.testing.assert_close(squares.sqrt().float(), want_norm, rtol=1e-5, atol=0)
        optimizer.update(lr)
        assert all(g["lr"] == lr for g in optimizer.param_groups)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_moments_round_trip_through_a_checkpoint(tmp_path, kind):
    """`param_moments` -> checkpoint dict -> `load_param_moments` of a fresh optimizer of the
    same kind: the same moments and step count, and the next update gives the same weights."""
    model, reducer, optimizer, mesh = _build(kind)
    for step in range(2):
        _protocol_step(model, reducer, optimizer, mesh, step)
    moments, count = optimizer.param_moments()
    assert count == 2.0
    assert set(moments) == set(model.parameters())
    assert all(m.shape == p.shape for p in model.parameters() for m in moments[p])
    path = save_checkpoint(tmp_path, TrainState(step=2), [model], optimizer, mesh, model_config=dataclasses.asdict(CFG))

    fresh, fresh_reducer, fresh_opt, _ = _build(kind)
    assert fresh_opt.param_moments()[1] == 0.0
    load_checkpoint(path, [fresh], fresh_opt, mesh)
    loaded, loaded_count = fresh_opt.param_moments()
    assert loaded_count == count
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(q, p)
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(loaded[q], moments[p]))
    _protocol_step(model, reducer, optimizer, mesh, 2)
    _protocol_step(fresh, fresh_reducer, fresh_opt, mesh, 2)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", list(KINDS))
def test_updates_start_from_weights_written_outside_the_optimizer(kind):
    """After `mark_weights_changed` an update at lr 0 keeps weights written between steps (an
    offloaded optimizer would otherwise write back its stale host copy)."""
    model, reducer, optimizer, mesh = _build(kind)
    _protocol_step(model, reducer, optimizer, mesh, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    written = [p.detach().clone() for p in model.parameters()]
    optimizer.mark_weights_changed()
    _protocol_step(model, reducer, optimizer, mesh, 1, lr=0.0)
    for p, want in zip(model.parameters(), written):
        assert torch.equal(p, want)


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_bytes_count_the_moments_on_the_device(kind):
    model, reducer, optimizer, mesh = _build(kind)
    _protocol_step(model, reducer, optimizer, mesh, 0)
    elements = (
        sum(p.numel() for p in model.parameters())
        if kind == "replicated"
        else sum(bucket.shard.numel() for bucket in reducer.buckets)
    )
    assert optimizer.state_bytes() == (0 if optimizer.offloaded else 8 * elements)
