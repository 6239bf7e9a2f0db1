"""ZeRO-1: sharding AdamW state over the replicas gives the weights of replicated AdamW after
5 steps (dense dp, tp x dp with SP, MoE experts over edp), with 1/replicas of the state."""

from __future__ import annotations

import torch.distributed as dist

from mpu.distributed_optimizer import ShardedAdamW
from mpu.mesh import ParallelConfig, build_mesh
from tests.distributed.dense_cases import ADAM_EPS, LR, assert_close, build, microbatches, model_config
from tests.distributed.moe_cases import moe_config
from training.step import train_step

STEPS_ZERO = 5


def _run(cfg, par, zero: bool):
    mesh = build_mesh(par, cfg)
    model, reducer, optimizer = build(cfg, mesh)
    if zero:
        optimizer = ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    for step in range(STEPS_ZERO):
        train_step(model, reducer, optimizer, microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1), mesh,
                   lr=LR, max_grad_norm=1.0)
    reducer.remove_hooks()
    return model, reducer, optimizer


def _check(cfg, par) -> None:
    plain, _, plain_opt = _run(cfg, par, zero=False)
    sharded, reducer, zero_opt = _run(cfg, par, zero=True)
    for (name, a), (_, b) in zip(sharded.named_parameters(), plain.named_parameters()):
        assert_close(f"zero=1 weight {name}", a, b, rtol=1e-6)
    replicated_state = sum(8 * p.numel() for p in plain.parameters())
    want = sum(8 * bucket.buffer.numel() // (1 if bucket.group is None else dist.get_world_size(bucket.group))
               for bucket in reducer.buckets)
    got = zero_opt.state_bytes()
    if got != want:
        raise AssertionError(f"optimizer state {got} B, want {want} B (replicated: {replicated_state} B)")
    replicas = [1 if b.group is None else dist.get_world_size(b.group) for b in reducer.buckets]
    if max(replicas) > 1 and not got < replicated_state:
        raise AssertionError("sharding did not reduce the optimizer state")


def zero1_dense_dp() -> None:
    _check(model_config("gpt2"), ParallelConfig(tp=1))


def zero1_llama_tp2_sp_dp() -> None:
    _check(model_config("llama"), ParallelConfig(tp=2, sp=True))


def zero1_moe_edp() -> None:
    _check(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=2))


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return ["zero1_dense_dp"]
    if world_size == 4:
        return ["zero1_dense_dp", "zero1_llama_tp2_sp_dp", "zero1_moe_edp"]
    return []
