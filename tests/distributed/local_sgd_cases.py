"""Local SGD / DiLoCo (training/local_sgd.py) and the hierarchical all-reduce (dp/hierarchical.py).

Local SGD: H=1 with plain averaging equals data parallelism (SGD inner optimizer, no
clipping: the equality needs an update linear in the gradient); with H=4 and AdamW every
replica holds the same bits right after each sync and different weights in between; the bytes
all-reduced over dp over 8 steps fall exactly 4x from H=1 to H=4 (the per-step scalar
statistics aside), and H=1 moves the bytes of ordinary DP's gradient buckets; the DiLoCo outer
Nesterov step equals a hand computation on a tiny tensor.

Hierarchical all-reduce, in 4 ranks simulated as 2 nodes of 2 (ranks_per_node=2): equal to the
flat all-reduce (1e-6) on a tensor and after 3 AdamW steps, at ZeRO 0 and 1.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import meshtron.mpu.shm_collectives as shm_mod
from meshtron.dp.adamw import TrainingOptimizer
from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.hierarchical import dp_hierarchy
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import ParallelConfig, build_mesh
from meshtron.pipeline.executor import PipelineExecutor, activation_shape
from meshtron.training.local_sgd import LocalGradReducer, LocalSGD
from meshtron.training.optim import build_optimizer
from meshtron.training.step import pipeline_train_step, train_step
from tests.distributed.dense_cases import ADAM_EPS, LR, SEED, assert_close, microbatches, model_config
from tests.distributed.pipeline_cases import pipeline_config

STEPS = 8


class _SGD(torch.optim.SGD, TrainingOptimizer):
    """Plain SGD as a training optimizer: an update linear in the gradient. These cases never
    checkpoint, so the moment accessors of the protocol refuse."""

    def param_moments(self):
        raise NotImplementedError("the local SGD cases' SGD has no moments to checkpoint")

    def load_param_moments(self, moments, step):
        raise NotImplementedError("the local SGD cases' SGD has no moments to checkpoint")

    def state_bytes(self) -> int:
        return 0


def _run(
    cfg,
    par,
    *,
    local_steps: int | None,
    optimizer: str = "sgd",
    steps: int = 4,
    outer: str = "none",
    count: bool = False,
):
    """Train `steps` steps; local_steps=None: ordinary DP. Returns (model, losses, per-step flat
    weights, bytes per group kind, local SGD object)."""
    mesh = build_mesh(par, cfg)
    chunks = init_model_chunks(cfg, mesh, SEED)
    model = chunks[0]
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    kind = DataParallelGradReducer if local_steps is None else LocalGradReducer
    reducer = kind(named, mesh, bucket_mb=0.01)
    if optimizer == "sgd":
        opt = _SGD([p for _, p in named], lr=0.05)
    else:
        opt = build_optimizer(nn.ModuleList(chunks), lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    local = (
        None
        if local_steps is None
        else LocalSGD(chunks, mesh, local_steps=local_steps, outer_optimizer=outer, outer_lr=0.7, outer_momentum=0.9)
    )
    executor = None
    if mesh.pp_size > 1:
        executor = PipelineExecutor(
            chunks, mesh, activation_shape(mesh, cfg.seq_len, 1, cfg.hidden_size), torch.float32, torch.device("cpu")
        )
    losses, weights = [], []
    sent = {"model": 0, "stats": 0}
    with _count_dp_bytes(mesh.dp, sent) if count else contextlib.nullcontext():
        for step in range(steps):
            lr = 0.05 if optimizer == "sgd" else LR
            if executor is not None:  # two microbatches per replica through the 1F1B pipeline
                micro = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1, batch=2 * mesh.dp_size)
                out = pipeline_train_step(
                    chunks, reducer, opt, micro, mesh, executor, schedule="1f1b", lr=lr, max_grad_norm=0.0
                )
            else:
                out = train_step(
                    model,
                    reducer,
                    opt,
                    microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1),
                    mesh,
                    lr=lr,
                    max_grad_norm=0.0,
                )
            if local is not None:
                local.after_step(step + 1)
            losses.append(out.loss.detach().clone())
            weights.append(torch.cat([p.detach().reshape(-1) for _, p in named]).clone())
    reducer.remove_hooks()
    return model, torch.stack(losses), weights, sent, local


@contextlib.contextmanager
def _count_dp_bytes(group, sent: dict):
    """Count the bytes handed to all-reduces over `group` (gloo and shared memory): tensors of
    one element are the step's statistics (token count, loss), the rest model state."""
    originals = dist.all_reduce, shm_mod.all_reduce

    def tally(tensor, g):
        if g is group:
            sent["stats" if tensor.numel() == 1 else "model"] += tensor.numel() * tensor.element_size()

    def gloo(tensor, *args, group=None, **kwargs):
        tally(tensor, group)
        return originals[0](tensor, *args, group=group, **kwargs)

    def shared(tensor, g):
        tally(tensor, g)
        return originals[1](tensor, g)

    dist.all_reduce, shm_mod.all_reduce = gloo, shared
    try:
        yield
    finally:
        dist.all_reduce, shm_mod.all_reduce = originals


def _same_on_all_ranks(flat: torch.Tensor, group) -> bool:
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, flat, group=group)
    return all(torch.equal(everyone[0], t) for t in everyone[1:])


def _h1_equals_dp(cfg, par) -> None:
    _, dp_losses, dp_weights, _, _ = _run(cfg, par, local_steps=None)
    _, losses, weights, _, _ = _run(cfg, par, local_steps=1)
    for step in range(len(losses)):
        assert_close(f"step {step + 1} loss, local SGD H=1 vs DP", losses[step], dp_losses[step], rtol=1e-6)
        assert_close(f"step {step + 1} weights, local SGD H=1 vs DP", weights[step], dp_weights[step], rtol=1e-6)
    if torch.equal(weights[-1], weights[0]):
        raise AssertionError("the weights did not change: the comparison proves nothing")


def local_sgd_h1_equals_dp() -> None:
    """dp = world: H=1 with plain averaging gives DP's losses and weights (SGD, no clipping)."""
    _h1_equals_dp(model_config("gpt2"), ParallelConfig(tp=1))


def local_sgd_h1_equals_dp_tp2_sp() -> None:
    """tp=2 with SP x dp=2: the norm gradients are still summed over tp inside each replica."""
    _h1_equals_dp(model_config("llama"), ParallelConfig(tp=2, sp=True))


def local_sgd_h1_equals_dp_pp2_tied() -> None:
    """pp=2 x dp=2 (1F1B) with the tied embedding summed over the first and last stage."""
    _h1_equals_dp(
        dataclasses.replace(pipeline_config("gpt2", False), num_layers=2), ParallelConfig(tp=1, pp=2, schedule="1f1b")
    )


def local_sgd_h1_equals_dp_cp2() -> None:
    """cp=2 (ring) x dp=2: gradients are summed over the cp shards inside each replica."""
    _h1_equals_dp(model_config("llama"), ParallelConfig(cp=2))


def local_sgd_h4_sync_and_bytes() -> None:
    """AdamW, 8 steps: H=4 replicas agree bit for bit after steps 4 and 8 only, and differ from
    DP; dp bytes: H=1 moves 8x the parameters (= DP's padded buckets up to padding), H=4 a quarter."""
    cfg, par = model_config("gpt2"), ParallelConfig(tp=1)
    _, _, dp_weights, dp_sent, _ = _run(cfg, par, local_steps=None, optimizer="adamw", steps=STEPS, count=True)
    _, _, w1, sent1, local1 = _run(cfg, par, local_steps=1, optimizer="adamw", steps=STEPS, count=True)
    model, _, w4, sent4, local4 = _run(cfg, par, local_steps=4, optimizer="adamw", steps=STEPS, count=True)
    mesh_dp = local4.group
    for step, flat in enumerate(w4, start=1):
        same = _same_on_all_ranks(flat, mesh_dp)
        if same != (step % 4 == 0):
            raise AssertionError(
                f"H=4 after step {step}: replicas {'identical' if same else 'different'}, "
                f"want {'identical' if step % 4 == 0 else 'different'}"
            )
    if not all(_same_on_all_ranks(flat, mesh_dp) for flat in w1):
        raise AssertionError("H=1: replicas differ after a sync")
    if torch.allclose(w4[-1], dp_weights[-1], rtol=1e-4, atol=0):
        raise AssertionError("H=4 gave DP's weights: the local steps were not local")
    n_params = sum(p.numel() for p in model.parameters())
    if sent1["model"] != STEPS * 4 * n_params or local1.bytes_sent != sent1["model"]:
        raise AssertionError(f"H=1 sent {sent1['model']} B of model state over dp, want {STEPS} x 4 x {n_params}")
    if sent4["model"] * 4 != sent1["model"] or local4.syncs != STEPS // 4:
        raise AssertionError(f"bytes over dp: H=4 {sent4['model']} x 4 != H=1 {sent1['model']}")
    if not (STEPS * 4 * n_params <= dp_sent["model"] < STEPS * 4 * (n_params + 64)):  # buckets padded to dp
        raise AssertionError(f"DP sent {dp_sent['model']} B of gradients, want about {STEPS * 4 * n_params}")
    if not sent1["stats"] == sent4["stats"] == dp_sent["stats"] == STEPS * 2 * 4:  # token count and loss
        raise AssertionError(f"per-step statistics over dp: {sent1['stats']}, {sent4['stats']}, {dp_sent['stats']}")


def diloco_outer_step_by_hand() -> None:
    """Two syncs of a 3-element parameter whose value differs per rank: the outer Nesterov
    step (lr 0.7, momentum 0.9) gives the hand-computed values."""
    mesh = build_mesh(ParallelConfig(tp=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    module = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[1.0, 2.0, 4.0]]))
    local = LocalSGD([module], mesh, local_steps=2, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    g = [1.0, 2.0, 4.0]
    buf = [0.0, 0.0, 0.0]
    for round_ in range(2):
        # local training moved each rank's weights by its own amount
        moves = [0.1 * (r + 1) * (round_ + 1) * torch.tensor([1.0, -2.0, 0.5]) for r in range(world)]
        with torch.no_grad():
            module.weight.add_(moves[rank])
        mean_move = sum(moves) / world
        avg = [g[i] + float(mean_move[i]) for i in range(3)]
        delta = [g[i] - avg[i] for i in range(3)]
        buf = [0.9 * buf[i] + delta[i] for i in range(3)]
        g = [g[i] - 0.7 * (delta[i] + 0.9 * buf[i]) for i in range(3)]
        if local.after_step(1):
            raise AssertionError("synced after step 1 of H=2")
        if not local.after_step(2):
            raise AssertionError("did not sync after step 2 of H=2")
        assert_close(
            f"DiLoCo round {round_ + 1}",
            module.weight.detach().reshape(-1).double(),
            torch.tensor(g, dtype=torch.float64),
            rtol=1e-6,
        )
    if local.state_bytes() != 2 * 3 * 4:
        raise AssertionError(f"outer state {local.state_bytes()} B, want 24")
    # one replica's non-finite step counts as skipped on every rank (the loop's abort is taken alike)
    if local.agree_skipped(rank == 0) is not True or local.agree_skipped(False) is not False:
        raise AssertionError("the replicas do not agree on a skipped step")


def _check_tensor_all_reduce(h, numel: int, what: str) -> None:
    """The hierarchy `h` all-reduces a tensor of `numel` values of this rank's scale (10^rank)
    to what the flat all-reduce gives, to 1e-6."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank())) * 10 ** dist.get_rank()
    want = x.clone()
    dist.all_reduce(want)
    got = x.clone()
    h.all_reduce(got)
    assert_close(what, got, want, rtol=1e-6)


def hierarchical_equals_flat() -> None:
    """4 ranks as 2 nodes x 2: the three-stage all-reduce of a tensor, and 3 AdamW steps at
    ZeRO 0 and 1 with hierarchically reduced buckets, equal the flat all-reduce to 1e-6."""
    cfg = model_config("gpt2")
    hier = build_mesh(ParallelConfig(tp=1, dp_hierarchical=True), cfg, ranks_per_node=2)
    flat_mesh = build_mesh(ParallelConfig(tp=1, dp_hierarchical=False), cfg, ranks_per_node=2)
    h = dp_hierarchy(hier)
    if (h.nodes, h.local) != (2, 2) or dist.get_process_group_ranks(h.inter) != [
        dist.get_rank() % 2,
        dist.get_rank() % 2 + 2,
    ]:
        raise AssertionError(
            f"hierarchy {h.nodes} nodes x {h.local}, inter group {dist.get_process_group_ranks(h.inter)}"
        )
    _check_tensor_all_reduce(h, 1000, "hierarchical all-reduce of a tensor")
    for zero in (0, 1):
        results = [_weights_after_steps(cfg, mesh, mesh is hier, 3, zero) for mesh in (hier, flat_mesh)]
        assert_close(f"zero={zero}: weights after 3 steps, hierarchical vs flat", results[0], results[1], rtol=1e-6)
    auto = build_mesh(ParallelConfig(tp=1), cfg, ranks_per_node=2)  # auto: dp spans 2 nodes with 2 ranks on each
    (model,) = init_model_chunks(cfg, auto, SEED)
    reducer = DataParallelGradReducer(list(model.named_parameters()), auto)
    on = reducer.hierarchy is not None
    reducer.remove_hooks()
    if not on:
        raise AssertionError("parallel.dp_hierarchical=auto stayed flat across 2 nodes of 2")


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return ["local_sgd_h1_equals_dp", "local_sgd_h4_sync_and_bytes", "diloco_outer_step_by_hand"]
    if world_size == 4:
        return [
            "local_sgd_h1_equals_dp_tp2_sp",
            "local_sgd_h1_equals_dp_pp2_tied",
            "local_sgd_h1_equals_dp_cp2",
            "hierarchical_equals_flat",
            "hierarchical_one_rank_per_node",
        ]
    if world_size == 8:
        return ["local_sgd_h1_equals_dp_tp2_sp_cp2"]
    return []


def local_sgd_h1_equals_dp_tp2_sp_cp2() -> None:
    """tp=2 with SP x cp=2 (ring) x dp=2, all together: H=1 with plain averaging still gives
    DP's losses and weights; the sequence-parallel (norm) gradients are summed over tp x cp
    inside each replica, the others over cp (local_replica_groups), never over dp."""
    _h1_equals_dp(model_config("llama"), ParallelConfig(tp=2, sp=True, cp=2))


def _weights_after_steps(cfg, mesh, hierarchical: bool, steps: int, zero: int) -> torch.Tensor:
    """This rank's weights, flattened, after `steps` AdamW steps (ZeRO `zero`) of the model on
    `mesh`, whose reducer must be hierarchical exactly when `hierarchical`."""
    (model,) = init_model_chunks(cfg, mesh, SEED)
    named = list(model.named_parameters())
    reducer = DataParallelGradReducer(named, mesh, bucket_mb=0.01)
    if (reducer.hierarchy is not None) != hierarchical:
        raise AssertionError("parallel.dp_hierarchical did not select the all-reduce")
    opt = (
        ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
        if zero
        else build_optimizer(model, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    )
    for step in range(steps):
        batch = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1)
        train_step(model, reducer, opt, batch, mesh, lr=LR, max_grad_norm=1.0)
    reducer.remove_hooks()
    return torch.cat([p.detach().reshape(-1) for _, p in named])


def hierarchical_one_rank_per_node() -> None:
    """parallel.dp_hierarchical=true with one rank per node (4 nodes x 1): the intra-node
    stages are of one rank (no group), the inter-node all-reduce is the whole sum; a tensor's
    all-reduce and 2 AdamW steps (ZeRO 0) equal the flat all-reduce to 1e-6, and `auto`
    stays flat (L = 1: the same collective)."""
    cfg = model_config("gpt2")
    hier = build_mesh(ParallelConfig(tp=1, dp_hierarchical=True), cfg, ranks_per_node=1)
    flat_mesh = build_mesh(ParallelConfig(tp=1, dp_hierarchical=False), cfg, ranks_per_node=1)
    h = dp_hierarchy(hier)
    world = dist.get_world_size()
    if (h.nodes, h.local) != (world, 1) or h.intra is not None:
        raise AssertionError(f"hierarchy {h.nodes} nodes x {h.local}, intra {h.intra}")
    if dist.get_process_group_ranks(h.inter) != list(range(world)):
        raise AssertionError(f"inter group {dist.get_process_group_ranks(h.inter)}")
    _check_tensor_all_reduce(h, 1001, "hierarchical all-reduce, one rank per node")
    results = [_weights_after_steps(cfg, mesh, mesh is hier, 2, 0) for mesh in (hier, flat_mesh)]
    assert_close("weights after 2 steps, hierarchical (1 rank per node) vs flat", results[0], results[1], rtol=1e-6)
    if torch.equal(
        results[0], torch.cat([p.detach().reshape(-1) for p in init_model_chunks(cfg, hier, SEED)[0].parameters()])
    ):
        raise AssertionError("the weights did not change: the comparison proves nothing")
    auto = build_mesh(ParallelConfig(tp=1), cfg, ranks_per_node=1)
    (model,) = init_model_chunks(cfg, auto, SEED)
    reducer = DataParallelGradReducer(list(model.named_parameters()), auto)
    on = reducer.hierarchy is not None
    reducer.remove_hooks()
    if on:
        raise AssertionError("parallel.dp_hierarchical=auto went hierarchical with one rank per node")
