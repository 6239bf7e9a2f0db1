"""CPU-offloaded AdamW (`OffloadedAdamW`) gives the weights of device AdamW after 5 steps,
replicated (zero=0) and composed with ZeRO-1/2 (zero=1/2: only this rank's shard of every
bucket on the host), and its checkpoints continue bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile

import torch
import torch.distributed as dist

import meshtron.training.checkpoint as checkpoint
from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.offload import OffloadedAdamW
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import ParallelConfig, build_mesh
from meshtron.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from meshtron.training.step import train_step
from tests.distributed.dense_cases import ADAM_EPS, LR, SEED, build, microbatches, model_config
from tests.distributed.moe_cases import moe_config

STEPS_OFFLOAD = 5


@contextlib.contextmanager
def checkpoint_dispatch():
    """Make training/checkpoint.py hand `OffloadedAdamW` its `param_moments` /
    `load_param_moments` while it still dispatches with `isinstance(optimizer, ShardedAdamW)`.
    Harmless once it duck-types on `hasattr(optimizer, "param_moments")`."""
    had = hasattr(checkpoint, "ShardedAdamW")
    old = getattr(checkpoint, "ShardedAdamW", None)
    checkpoint.ShardedAdamW = (ShardedAdamW, OffloadedAdamW)
    try:
        yield
    finally:
        if had:
            checkpoint.ShardedAdamW = old
        else:
            del checkpoint.ShardedAdamW


def make_optimizer(reducer, kind: str):
    """kind: "plain" (training.optim AdamW, from `build`), "zero" (ShardedAdamW),
    "offload" / "offload_zero" (OffloadedAdamW zero=0 / zero=1); `run` also takes
    "zero2" / "offload_zero2" (ShardedAdamW / OffloadedAdamW zero=2 over a reducer with
    shard_grads=True)."""
    if kind == "zero":
        return ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    return OffloadedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS, zero=int(kind == "offload_zero"))


def run(cfg, mesh, kind: str, steps: int = STEPS_OFFLOAD, micro: int = 1):
    """(model, reducer, optimizer, losses) after `steps` steps with optimizer `kind`."""
    if kind in ("zero2", "offload_zero2"):  # the reducer reduce-scatters gradients into shards
        (model,) = init_model_chunks(cfg, mesh, SEED)
        reducer = DataParallelGradReducer(list(model.named_parameters()), mesh, bucket_mb=0.01, shard_grads=True)
        optimizer = (
            OffloadedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS, zero=2)
            if kind == "offload_zero2"
            else ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
        )
    else:
        model, reducer, optimizer = build(cfg, mesh)
        if kind != "plain":
            optimizer = make_optimizer(reducer, kind)
    losses = [step_once(model, reducer, optimizer, mesh, cfg, s, micro) for s in range(steps)]
    return model, reducer, optimizer, losses


def step_once(model, reducer, optimizer, mesh, cfg, step: int, micro: int = 1) -> float:
    out = train_step(
        model,
        reducer,
        optimizer,
        microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, micro),
        mesh,
        lr=LR,
        max_grad_norm=1.0,
    )
    return out.loss.item()


def assert_same_weights(got_model, want_model, what: str) -> None:
    for (name, a), (_, b) in zip(got_model.named_parameters(), want_model.named_parameters()):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: weight {name} differs, max |diff| {(a - b).abs().max().item():.3e}")


def reference_kind(kind: str) -> str:
    """The device optimizer an offloaded `kind` must match bit for bit. ZeRO-2 computes the
    gradient norm from the shards (another summation order, ~1 ulp), so it is compared with
    device ZeRO-2; the others with replicated device AdamW."""
    return "zero2" if kind == "offload_zero2" else "plain"


def _check(cfg, par, kind: str) -> None:
    mesh = build_mesh(par, cfg)
    plain, plain_reducer, _, want = run(cfg, mesh, reference_kind(kind))
    offload, reducer, optimizer, got = run(cfg, mesh, kind)
    plain_reducer.remove_hooks()
    reducer.remove_hooks()
    if got != want:
        raise AssertionError(f"{kind}: losses {got} != {want}")
    assert_same_weights(offload, plain, kind)
    if optimizer.state_bytes() != 0:
        raise AssertionError(f"device optimizer state {optimizer.state_bytes()} B, want 0")
    elements = sum(b.numel // (group_size_of(b.group) if kind != "offload" else 1) for b in reducer.buckets)
    if optimizer.host_state_bytes() != 12 * elements:
        raise AssertionError(f"host state {optimizer.host_state_bytes()} B, want 12 x {elements}")


def group_size_of(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _check_checkpoint(cfg, par) -> None:
    """zero=1 offload: save after 2 steps, load into a fresh offloaded optimizer, continue bit for bit."""
    mesh = build_mesh(par, cfg)
    tmp = [tempfile.mkdtemp(prefix="meshtron-offload-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tmp)
    try:
        with checkpoint_dispatch():
            model, reducer, optimizer, _ = run(cfg, mesh, "offload_zero", steps=2)
            path = save_checkpoint(
                tmp[0], TrainState(step=2), [model], optimizer, mesh, model_config=dataclasses.asdict(cfg)
            )
            want = [step_once(model, reducer, optimizer, mesh, cfg, s) for s in (2, 3)]
            fresh, fresh_reducer, _ = build(cfg, mesh)
            fresh_opt = make_optimizer(fresh_reducer, "offload_zero")
            load_checkpoint(path, [fresh], fresh_opt, mesh)
            got = [step_once(fresh, fresh_reducer, fresh_opt, mesh, cfg, s) for s in (2, 3)]
        reducer.remove_hooks()
        fresh_reducer.remove_hooks()
        if got != want:
            raise AssertionError(f"resumed losses {got} != {want}")
        assert_same_weights(fresh, model, "resumed offload zero=1")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)


def offload_dense_dp() -> None:
    _check(model_config("gpt2"), ParallelConfig(tp=1), "offload")


def offload_zero1_dense_dp() -> None:
    _check(model_config("gpt2"), ParallelConfig(tp=1), "offload_zero")


def offload_zero2_dense_dp() -> None:
    _check(model_config("llama"), ParallelConfig(tp=1), "offload_zero2")


def offload_zero1_checkpoint_dp() -> None:
    _check_checkpoint(model_config("llama"), ParallelConfig(tp=1))


def offload_zero1_llama_tp2_sp_dp() -> None:
    _check(model_config("llama"), ParallelConfig(tp=2, sp=True), "offload_zero")


def offload_zero1_moe_edp() -> None:
    _check(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=2), "offload_zero")


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return ["offload_dense_dp", "offload_zero1_dense_dp", "offload_zero2_dense_dp", "offload_zero1_checkpoint_dp"]
    if world_size == 4:
        return ["offload_zero1_llama_tp2_sp_dp", "offload_zero1_moe_edp"]
    return []
