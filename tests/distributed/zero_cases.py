"""ZeRO-1 / ZeRO-2: sharding AdamW state (and, for ZeRO-2, the reduced gradients) over the
replicas gives the weights of replicated AdamW after 5 steps (dense dp, tp x dp with SP, MoE
experts over edp, pp with tied embeddings), with 1/replicas of the state (and gradients)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.distributed_optimizer import ShardedAdamW
from meshtron.mpu.grad_reduce import DataParallelGradReducer
from meshtron.mpu.mesh import ParallelConfig, build_mesh, group_size
from meshtron.mpu.pipeline import PipelineExecutor, activation_shape
from tests.distributed.dense_cases import ADAM_EPS, LR, SEED, assert_close, build, microbatches, model_config
from tests.distributed.moe_cases import moe_config
from tests.distributed.pipeline_cases import pipeline_config
from meshtron.training.optim import build_optimizer
from meshtron.training.step import pipeline_train_step, train_step

STEPS_ZERO = 5
MICRO_PER_RANK = 2  # pipeline cases


def _run(cfg, par, zero: int):
    """Train 5 steps; return (named params, reducer, optimizer, grad norms, grad bytes after the last step)."""
    mesh = build_mesh(par, cfg)
    if mesh.pp_size > 1:
        chunks = init_model_chunks(cfg, mesh, SEED)
        named = [(n, p) for c in chunks for n, p in c.named_parameters()]
        reducer = DataParallelGradReducer(named, mesh, bucket_mb=0.01, shard_grads=zero == 2)
        executor = PipelineExecutor(chunks, mesh, activation_shape(mesh, cfg.seq_len, 1, cfg.hidden_size),
                                    torch.float32, torch.device("cpu"))
        optimizer = build_optimizer(nn.ModuleList(chunks), lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    else:
        model, reducer, optimizer = build(cfg, mesh)
        chunks = [model]
        named = list(model.named_parameters())
        if zero == 2:
            reducer.remove_hooks()
            reducer = DataParallelGradReducer(named, mesh, bucket_mb=0.01, shard_grads=True)
    if zero:
        optimizer = ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    norms = []
    for step in range(STEPS_ZERO):
        if mesh.pp_size > 1:
            micro = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1, batch=mesh.dp_size * MICRO_PER_RANK)
            out = pipeline_train_step(chunks, reducer, optimizer, micro, mesh, executor, schedule="1f1b",
                                      lr=LR, max_grad_norm=1.0)
        else:
            out = train_step(chunks[0], reducer, optimizer, microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1),
                             mesh, lr=LR, max_grad_norm=1.0)
        norms.append(out["grad_norm"])
    grad_bytes = reducer.grad_bytes()
    reducer.remove_hooks()
    return named, reducer, optimizer, norms, grad_bytes


def _check(cfg, par, zero: int = 1) -> None:
    plain, _, plain_opt, plain_norms, _ = _run(cfg, par, zero=0)
    sharded, reducer, zero_opt, norms, grad_bytes = _run(cfg, par, zero=zero)
    for (name, a), (_, b) in zip(sharded, plain):
        assert_close(f"zero={zero} weight {name}", a, b, rtol=1e-6)
    # The per-parameter moments checkpoints save equal replicated AdamW's state.
    moments, step = zero_opt.param_moments()
    for (name, a), (_, b) in zip(sharded, plain):
        for got, key in zip(moments[a], ("exp_avg", "exp_avg_sq")):
            assert_close(f"zero={zero} {key} {name}", got, plain_opt.state[b][key], rtol=1e-6)
    if step != STEPS_ZERO:
        raise AssertionError(f"zero={zero}: optimizer step count {step}, want {STEPS_ZERO}")
    for step, (a, b) in enumerate(zip(norms, plain_norms)):
        assert_close(f"zero={zero} step {step} grad norm", a, b, rtol=1e-6)
    replicas = [group_size(b.group) for b in reducer.buckets]
    replicated_state = sum(8 * p.numel() for _, p in plain)
    want = sum(8 * b.numel // r for b, r in zip(reducer.buckets, replicas))
    got = zero_opt.state_bytes()
    if got != want:
        raise AssertionError(f"optimizer state {got} B, want {want} B (replicated: {replicated_state} B)")
    if max(replicas) > 1 and not got < replicated_state:
        raise AssertionError("sharding did not reduce the optimizer state")
    # Gradient memory held between steps: the full buckets (ZeRO-1) or 1/replicas of them (ZeRO-2).
    want_grads = sum(4 * b.numel // (r if zero == 2 else 1) for b, r in zip(reducer.buckets, replicas))
    if grad_bytes != want_grads:
        raise AssertionError(f"zero={zero}: {grad_bytes} B of gradients after a step, want {want_grads} B")
    if zero == 2 and max(replicas) > 1:
        for bucket, r in zip(reducer.buckets, replicas):
            if r > 1 and (bucket.buffer is not None or any(p.grad is not None for p in bucket.params)):
                raise AssertionError("zero=2: a sharded bucket's full gradient buffer is still allocated")


def zero1_dense_dp() -> None:
    _check(model_config("gpt2"), ParallelConfig(tp=1))


def zero1_llama_tp2_sp_dp() -> None:
    _check(model_config("llama"), ParallelConfig(tp=2, sp=True))


def zero1_moe_edp() -> None:
    _check(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=2))


def zero2_dense_dp() -> None:
    _check(model_config("gpt2"), ParallelConfig(tp=1), zero=2)


def zero2_llama_tp2_sp_dp() -> None:
    _check(model_config("llama"), ParallelConfig(tp=2, sp=True), zero=2)


def zero2_moe_ep2_edp2() -> None:
    _check(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=2), zero=2)


def zero2_gpt2_pp2_tied_1f1b() -> None:
    """pp=2 (x dp=world/2) with tied embeddings: the two copies are summed before the scatter."""
    _check(pipeline_config("gpt2", False), ParallelConfig(tp=1, pp=2, schedule="1f1b"), zero=2)


def zero1_gpt2_pp2_tied_1f1b() -> None:
    """ZeRO-1 with the reducer summing the tied embedding after the all-reduce."""
    _check(pipeline_config("gpt2", False), ParallelConfig(tp=1, pp=2, schedule="1f1b"), zero=1)


def zero2_zero_grad_required() -> None:
    """A backward after finish() without zero_grad() fails instead of silently losing grads."""
    cfg = model_config("gpt2")
    mesh = build_mesh(ParallelConfig(tp=1), cfg)
    model, = init_model_chunks(cfg, mesh, SEED)
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh, bucket_mb=0.01, shard_grads=True)
    try:
        ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
        inputs, targets = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, 1)[0]
        model.loss_per_token(model(inputs), targets).sum().backward()
        reducer.finish()
        try:
            model.loss_per_token(model(inputs), targets).sum().backward()
        except RuntimeError as err:
            assert "zero_grad" in str(err), err
        else:
            raise AssertionError("backward after finish() without zero_grad() did not fail")
    finally:
        reducer.remove_hooks()
    dist.barrier()


def bf16_gradient_compression() -> None:
    """optim.grad_comm_dtype=bf16: each bucket is summed over dp in bf16 (all-reduce, and the
    ZeRO-2 reduce-scatter) and written back to the fp32 gradient: the result is exactly the
    bf16 sum of the bf16-rounded local gradients, which is within bf16 precision of the fp32 sum."""
    cfg = model_config("gpt2")
    for shard in (False, True):
        mesh = build_mesh(ParallelConfig(tp=1), cfg)
        model, = init_model_chunks(cfg, mesh, SEED)
        results = {}
        for comm in (None, torch.bfloat16):
            reducer = DataParallelGradReducer(list(model.named_parameters()), mesh, bucket_mb=0.01,
                                              shard_grads=shard, comm_dtype=comm)
            reducer.zero_grad()
            inputs, targets = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, 2)[0]
            with reducer.sync(True):
                model.loss_per_token(model(inputs), targets).mean().backward()
            local = [b.buffer.clone() for b in reducer.buckets]
            reducer.finish()
            results[comm] = [b.shard.clone() for b in reducer.buckets]
            reducer.remove_hooks()
        for bucket, mine, fp32, bf16 in zip(reducer.buckets, local, results[None], results[torch.bfloat16]):
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            exact = torch.stack([t.to(torch.bfloat16).float() for t in everyone]).sum(0).to(torch.bfloat16).float()
            want = exact[bucket.shard_start: bucket.shard_start + bucket.shard.numel()]
            if not torch.equal(bf16, want):
                raise AssertionError(f"shard_grads={shard}: the bf16 reduction is not the bf16 sum")
            # bf16 keeps 8 mantissa bits (relative rounding <= 2**-8 per value).
            assert_close(f"shard_grads={shard}: bf16-reduced gradients vs the fp32 sum", bf16, fp32, rtol=2 ** -8)
        if all(torch.equal(a, b) for a, b in zip(results[None], results[torch.bfloat16])):
            raise AssertionError("compression changed nothing: the test would prove nothing")


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return ["zero1_dense_dp", "zero2_dense_dp", "zero2_zero_grad_required", "bf16_gradient_compression"]
    if world_size == 4:
        return ["zero1_dense_dp", "zero1_llama_tp2_sp_dp", "zero1_moe_edp", "zero2_dense_dp",
                "zero2_llama_tp2_sp_dp", "zero2_moe_ep2_edp2", "zero2_gpt2_pp2_tied_1f1b", "zero1_gpt2_pp2_tied_1f1b"]
    return []
