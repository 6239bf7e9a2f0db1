"""trainer.compile_moe: the dropless MoE block at ep = 1 compiles whole (`torch.compile(
fullgraph=True)`: no graph break, no host sync) and the compiled forward + backward equals
eager: output, input and weight gradients, balancing statistics. Elsewhere (a capacity, ep,
tp) the router and experts compile and equal eager too. That is what `bench/moe_layer.py
--compile` times on a GPU (fused elementwise kernels; CUDA graphs with mode="reduce-overhead").
bf16, because the meta function of torch's grouped GEMM accepts only bf16 (eager fp32 runs on
the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.models.config import GPTConfig
from meshtron.moe.counts import add_counts
from meshtron.moe.layer import MoELayer
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh

REPO = Path(__file__).resolve().parents[1]


def _run(layer, fn, x, gy):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    routed = layer.last_router
    torch.autograd.backward([out, routed.aux_loss + routed.z_loss], [gy, torch.ones((), dtype=out.dtype)])
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    stats = (routed.aux_value, routed.z_value, routed.tokens_per_expert)
    return out.detach(), x.grad, grads, stats


def run_isolated(case: str) -> None:
    """Run `case` (a function of this module) in a fresh interpreter, so that torch.compile's
    process state (dynamo, inductor, the triton it imports) never meets the Triton
    interpreter's tests in the pytest process."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_moe_compile", case],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.timeout(300)
def test_dropless_block_compiles_whole_and_equals_eager():
    run_isolated("check_dropless_block_compiles_whole")


def _bf16_block(capacity_factor=None):
    """A bf16 MoE block (8 experts, top-2, a shared expert, aux and z losses) and its input and
    upstream gradient."""
    cfg = GPTConfig(
        arch="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=2,
        num_experts=8,
        top_k=2,
        moe_ffn_hidden_size=32,
        shared_experts=1,
        seq_len=32,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        capacity_factor=capacity_factor,
    )
    mesh = single_process_mesh()
    layer = MoELayer(cfg.moe(), mesh)
    initialize_parameters(layer, 5, mesh)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 2, 64, generator=gen).bfloat16()
    gy = torch.randn(32, 2, 64, generator=gen).bfloat16()
    return layer.bfloat16().train(), x, gy


def _assert_close_runs(got, want):
    """Two `_run` results agree to bf16 accuracy; the expert counts exactly."""

    def close(a, b):
        return torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())

    assert close(got[0], want[0]) and close(got[1], want[1])
    assert want[2].keys() == got[2].keys() and all(close(got[2][n], want[2][n]) for n in want[2])
    assert torch.equal(got[3][2], want[3][2])  # expert counts: exact
    assert close(got[3][0], want[3][0]) and close(got[3][1], want[3][1])


def check_dropless_block_compiles_whole():
    layer, x, gy = _bf16_block()
    want = _run(layer, layer, x, gy)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # raises on any graph break
    got = _run(layer, compiled, x, gy)
    torch._dynamo.reset()
    _assert_close_runs(got, want)


@pytest.mark.timeout(300)
def test_capacity_block_compiles_in_parts_and_equals_eager():
    run_isolated("check_capacity_block_compiles_in_parts")


def check_capacity_block_compiles_in_parts():
    """With a capacity the layer syncs the host (the kept pairs), so `compile_moe` compiles its
    router and experts ("parts", three graphs: the routing, the router's statistics, the
    experts; the capacity, dispatch and shared expert stay eager): output, gradients and
    statistics equal eager's, the same pairs dropped."""
    from torch._dynamo.utils import counters

    layer, x, gy = _bf16_block(capacity_factor=1.0)
    want = _run(layer, layer, x, gy)
    want_dropped = layer.last_dropped.clone()
    torch._dynamo.reset()
    counters.clear()
    assert layer.compile_moe() == "parts"
    got = _run(layer, layer, x, gy)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])  # routing, statistics, experts
    assert 0 < float(want_dropped) < 1 and torch.equal(layer.last_dropped, want_dropped)
    torch._dynamo.reset()
    _assert_close_runs(got, want)


def test_add_counts_counts_every_index():
    idx = torch.tensor([3, 0, 3, 1, 3])
    assert add_counts(torch.zeros(5, dtype=torch.long), idx).tolist() == [1, 1, 0, 3, 0]
    assert add_counts(torch.ones(4, dtype=torch.float64), idx[idx < 4]).tolist() == [2.0, 2.0, 1.0, 4.0]


# ---------------------------------------------------------------- trainer.compile_moe


def _train(compile_moe: bool, steps: int = 2):
    """`steps` bf16 training steps of a tiny llama MoE (2 layers, the second MoE) with the MoE
    layer compiled or not; returns the per-step outputs, the weights and the routers' loads."""
    from torch._dynamo.utils import counters  # imported here: dynamo imports triton, kept out of collection

    from meshtron.dp.grad_reduce import DataParallelGradReducer
    from meshtron.models.config import ExecutionConfig
    from meshtron.models.gpt import init_model_chunks
    from meshtron.training.optim import build_optimizer
    from meshtron.training.precision import Precision
    from meshtron.training.step import train_step

    torch._dynamo.reset()
    counters.clear()
    cfg = GPTConfig(
        arch="llama",
        num_layers=2,
        hidden_size=32,
        num_heads=2,
        num_experts=4,
        top_k=2,
        moe_ffn_hidden_size=16,
        moe_every=2,
        vocab_size=64,
        seq_len=16,
        z_loss_coef=1e-3,
    )
    mesh = single_process_mesh()
    (model,) = init_model_chunks(cfg, mesh, 7, execution=ExecutionConfig(compile_moe=compile_moe))
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1, eps=1e-8)
    gen = torch.Generator().manual_seed(2)
    outs, grads = [], None
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
        outs.append(
            train_step(
                model,
                reducer,
                optimizer,
                [(tokens[:2, :-1], tokens[:2, 1:]), (tokens[2:, :-1], tokens[2:, 1:])],
                mesh,
                lr=1e-2,
                max_grad_norm=1.0,
                precision=Precision("bf16", "cpu"),
            )
        )
        if grads is None:  # the first step's: the same weights and routing on both sides
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            loads = [m.router.step_load.clone() for m in model.modules() if isinstance(m, MoELayer)]
    reducer.remove_hooks()
    assert counters["stats"]["unique_graphs"] == (1 if compile_moe else 0)  # the MoE layer, one graph
    torch._dynamo.reset()
    return outs, grads, loads


@pytest.mark.timeout(600)
def test_compiled_moe_layers_train_like_eager():
    run_isolated("check_compiled_moe_layers_train_like_eager")


def check_compiled_moe_layers_train_like_eager():
    """trainer.compile_moe: two bf16 steps of two microbatches each (aux and z losses on) match
    the eager model's: the first step's gradients and router loads (exact), and both steps'
    losses and gradient norms (the second also checks the first update). Later gradients are
    not compared: bf16 rounding can route a token to another expert once the weights moved
    (eager bf16 against fp32 differs by 40% in the expert gradients of step 2 here)."""
    want, want_g, want_loads = _train(False)
    got, got_g, got_loads = _train(True)
    for w, g in zip(want, got):
        assert torch.allclose(g.loss, w.loss, rtol=1e-4), (g.loss, w.loss)
        assert torch.allclose(g.grad_norm, w.grad_norm, rtol=5e-2), (g.grad_norm, w.grad_norm)
    assert want_g.keys() == got_g.keys()
    for name in want_g:
        error = ((got_g[name] - want_g[name]).norm() / want_g[name].norm()).item()
        assert error < 2e-2, (name, error)
    assert len(want_loads) == 1 and all(torch.equal(g, w) for g, w in zip(got_loads, want_loads))


GOOD = dict(
    num_experts=8,
    hidden_size=64,
    moe_ffn_hidden_size=128,
    precision="bf16",
    kernel_backend="auto",
    recompute="none",
    zero=1,
)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts": 0}, "this model has none"),
        ({"precision": "fp32"}, "needs trainer.precision=bf16 (got fp32)"),
        ({"precision": "fp16"}, "traces in bf16 only"),
        ({"moe_ffn_hidden_size": 100}, "divisible by 8 (got 64 and 100)"),
        ({"kernel_backend": "triton"}, "use kernels.backend=auto or torch"),
        ({"recompute": "full"}, "does not support trainer.recompute=full yet"),
        ({"zero": 3}, "does not support optim.zero=3"),
    ],
)
def test_compile_moe_refuses_what_it_cannot_trace(change, message):
    from meshtron.rules import compile_moe_checks, first_failure

    assert first_failure(compile_moe_checks(True, **GOOD)) is None
    assert first_failure(compile_moe_checks(False, **dict(GOOD, **change))) is None  # off: nothing to check
    failure = first_failure(compile_moe_checks(True, **dict(GOOD, **change)))
    assert failure is not None and failure.startswith("trainer.compile_moe=true") and message in failure, failure


@pytest.mark.parametrize(
    "par, capacity_factor, scope, want",
    [
        (dict(), None, "microbatch", "layer"),
        (dict(dp=2), None, "microbatch", "layer"),
        (dict(dp=2), None, "global", "parts"),  # the statistics are all-reduced over dp
        (dict(), 1.0, "microbatch", "parts"),  # capacity counts the kept pairs with a host sync
        (dict(ep=2), None, "microbatch", "parts"),
        (dict(tp=2), None, "microbatch", "parts"),
    ],
)
def test_compile_moe_compiles_the_whole_layer_only_where_it_traces(monkeypatch, par, capacity_factor, scope, want):
    """MoELayer.compile_moe's choice, on a virtual mesh of 2 ranks (nothing traced or run here):
    whole ("layer") without collectives or host syncs, else "parts", with the router's
    all-reduce made a graph break exactly where there are ranks to reduce over."""
    from meshtron.mpu.mappings import all_reduce_stats
    from meshtron.mpu.mesh import ParallelConfig
    from meshtron.planning.plan import virtual_mesh

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append((type(self).__name__, kw)))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append((fn.__name__, kw)) or fn)
    monkeypatch.setattr(torch.compiler, "disable", lambda fn: ("eager", fn))
    mesh = virtual_mesh(ParallelConfig(**par), 2 if par else 1, 0)
    cfg = GPTConfig(
        arch="llama",
        hidden_size=64,
        num_heads=2,
        num_experts=8,
        top_k=2,
        moe_ffn_hidden_size=32,
        seq_len=32,
        capacity_factor=capacity_factor,
        aux_loss_scope=scope,
    )
    layer = MoELayer(cfg.moe(), mesh, device="meta")
    assert layer.compile_moe() == want
    if want == "layer":
        assert compiled == [("MoELayer", {"fullgraph": True})]
        return
    reduced = (scope == "global" and par.get("dp", 1) > 1) or par.get("tp", 1) > 1
    assert compiled == [
        ("route", {"fullgraph": True}),
        ("statistics", {"fullgraph": not reduced}),
        ("GroupedExperts", {"fullgraph": True}),
    ]
    assert layer.router.reduce_stats == (("eager", all_reduce_stats) if reduced else all_reduce_stats)


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "layout, traced",
    [
        ([], {"forward"}),  # each MoE layer one graph
        # the router's two halves and the experts; the statistics resume after their eager all-reduce
        (["parallel.tp=2", "parallel.ep=2"], {"route", "statistics", "resume in statistics", "forward"}),
        (["parallel.cp=2"], {"route", "statistics", "resume in statistics", "forward"}),
        (["parallel.pp=2", "trainer.recompute=selective"], {"forward"}),
    ],
    ids=["dp2", "tp2_ep2", "cp2", "pp2_selective"],
)
def test_torchrun_with_compiled_moe_layers_logs_the_eager_losses(tmp_path, layout, traced):
    """trainer.compile_moe on 2 ranks (moe_tiny, bf16): over 2 data-parallel ranks (each layer
    one graph); at tp=2 with ep=2 and at cp=2 (router and experts compiled; the router's
    statistics all-reduced over tp or cp between its graphs, the all-to-alls eager); over 2
    pipeline stages with selective recompute (each layer one graph, on its stage). The
    compiled run logs the eager run's losses and gradient norms to bf16 accuracy, and dynamo
    traced the functions the mode compiles (its log; none in the eager run)."""
    from tests.test_train_cli import TORCHRUN, metrics, run

    common = [
        "+model=moe_tiny",
        "trainer.precision=bf16",
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.progress=false",
        *layout,
    ]
    logs = {}
    for compile_moe in ("false", "true"):
        run_dir = tmp_path / compile_moe
        out = run(
            [
                *TORCHRUN,
                "--nproc_per_node=2",
                "train.py",
                *common,
                f"trainer.compile_moe={compile_moe}",
                f"hydra.run.dir={run_dir}",
            ],
            timeout=300,
            env={"TORCH_LOGS": "dynamo"},
            threads=1,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        logs[compile_moe] = metrics(run_dir)
        seen = {
            re.sub(r"^torch_dynamo_resume_in_(\w+?)_at_\d+$", r"resume in \1", name)
            for name in re.findall(r"torchdynamo start tracing (\w+)", out.stderr)
        }
        assert seen == (traced if compile_moe == "true" else set()), seen
    assert [r["step"] for r in logs["true"]] == [1, 2, 3]
    for got, want in zip(logs["true"], logs["false"]):
        assert abs(got["loss"] - want["loss"]) <= 1e-3 * want["loss"], (got, want)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 2e-2 * want["grad_norm"], (got, want)


if __name__ == "__main__":  # run_isolated's child: one check function by name
    globals()[sys.argv[1]]()
