"""The dropless MoE block at ep = 1 compiles whole (`torch.compile(fullgraph=True)`: no graph
break, no host sync) and the compiled forward + backward equals eager: output, input and
weight gradients, balancing statistics. That is what `bench/moe_layer.py --compile` times on a
GPU (fused elementwise kernels; CUDA graphs with mode="reduce-overhead"). bf16, because the
meta function of torch's grouped GEMM accepts only bf16 (eager fp32 runs on the CPU)."""

from __future__ import annotations

import os
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
    proc = subprocess.run([sys.executable, "-m", "tests.test_moe_compile", case], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.timeout(300)
def test_dropless_block_compiles_whole_and_equals_eager():
    run_isolated("check_dropless_block_compiles_whole")


def check_dropless_block_compiles_whole():
    cfg = GPTConfig(arch="llama", hidden_size=64, num_heads=2, num_experts=8, top_k=2, moe_ffn_hidden_size=32,
                    shared_experts=1, seq_len=32, aux_loss_coef=0.01, z_loss_coef=0.001)
    mesh = single_process_mesh()
    layer = MoELayer(cfg.moe(), mesh)
    initialize_parameters(layer, 5, mesh)
    layer = layer.bfloat16().train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 2, 64, generator=gen).bfloat16()
    gy = torch.randn(32, 2, 64, generator=gen).bfloat16()
    want = _run(layer, layer, x, gy)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # raises on any graph break
    got = _run(layer, compiled, x, gy)
    torch._dynamo.reset()

    def close(a, b):
        return torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())

    assert close(got[0], want[0]) and close(got[1], want[1])
    assert want[2].keys() == got[2].keys() and all(close(got[2][n], want[2][n]) for n in want[2])
    assert torch.equal(got[3][2], want[3][2])  # expert counts: exact
    assert close(got[3][0], want[3][0]) and close(got[3][1], want[3][1])


def test_add_counts_counts_every_index():
    idx = torch.tensor([3, 0, 3, 1, 3])
    assert add_counts(torch.zeros(5, dtype=torch.long), idx).tolist() == [1, 1, 0, 3, 0]
    assert add_counts(torch.ones(4, dtype=torch.float64), idx[idx < 4]).tolist() == [2.0, 2.0, 1.0, 4.0]


# ---------------------------------------------------------------- trainer.compile_moe


def _train(compile_moe: bool, steps: int = 2):
    """`steps` bf16 training steps of a tiny llama MoE (2 layers, the second MoE) with the MoE
    layer compiled or not; returns the per-step outputs, the weights and the routers' loads."""
    from meshtron.models.config import ExecutionConfig
    from meshtron.models.gpt import init_model_chunks
    from meshtron.mpu.grad_reduce import DataParallelGradReducer
    from meshtron.training.optim import build_optimizer
    from meshtron.training.precision import Precision
    from meshtron.training.step import train_step
    from torch._dynamo.utils import counters  # imported here: importing dynamo at collection imports
    # triton before the kernel tests set TRITON_INTERPRET, which breaks them when collected later

    torch._dynamo.reset()
    counters.clear()
    cfg = GPTConfig(arch="llama", num_layers=2, hidden_size=32, num_heads=2, num_experts=4, top_k=2,
                    moe_ffn_hidden_size=16, moe_every=2, vocab_size=64, seq_len=16, z_loss_coef=1e-3)
    mesh = single_process_mesh()
    model, = init_model_chunks(cfg, mesh, 7, execution=ExecutionConfig(compile_moe=compile_moe))
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1, eps=1e-8)
    gen = torch.Generator().manual_seed(2)
    outs, grads = [], None
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
        outs.append(train_step(model, reducer, optimizer, [(tokens[:2, :-1], tokens[:2, 1:]),
                                                           (tokens[2:, :-1], tokens[2:, 1:])],
                               mesh, lr=1e-2, max_grad_norm=1.0, precision=Precision("bf16", "cpu")))
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
        assert torch.allclose(g["loss"], w["loss"], rtol=1e-4), (g["loss"], w["loss"])
        assert torch.allclose(g["grad_norm"], w["grad_norm"], rtol=5e-2), (g["grad_norm"], w["grad_norm"])
    assert want_g.keys() == got_g.keys()
    for name in want_g:
        error = ((got_g[name] - want_g[name]).norm() / want_g[name].norm()).item()
        assert error < 2e-2, (name, error)
    assert len(want_loads) == 1 and all(torch.equal(g, w) for g, w in zip(got_loads, want_loads))


GOOD = dict(num_experts=8, hidden_size=64, moe_ffn_hidden_size=128, capacity_factor=None, aux_loss_scope="microbatch",
            precision="bf16", kernel_backend="auto", recompute="none", zero=1, tp=1, cp=1, ep=1, etp=1, dp=4)


@pytest.mark.parametrize("change, message", [
    ({"num_experts": 0}, "this model has none"),
    ({"ep": 2}, "needs parallel.tp=cp=ep=etp=1 (got tp=1 cp=1 ep=2 etp=1)"),
    ({"tp": 2}, "the sequence collectives break the graph"),
    ({"capacity_factor": 1.25}, "needs dropless experts (model.capacity_factor=null, got 1.25)"),
    ({"aux_loss_scope": "global"}, "over dp=4 inside the layer; use model.aux_loss_scope=microbatch or sequence"),
    ({"precision": "fp32"}, "needs trainer.precision=bf16 (got fp32)"),
    ({"precision": "fp16"}, "traces in bf16 only"),
    ({"moe_ffn_hidden_size": 100}, "divisible by 8 (got 64 and 100)"),
    ({"kernel_backend": "triton"}, "use kernels.backend=auto or torch"),
    ({"recompute": "full"}, "does not support trainer.recompute=full yet"),
    ({"zero": 3}, "does not support optim.zero=3"),
])
def test_compile_moe_refuses_what_breaks_the_graph(change, message):
    from meshtron.rules import compile_moe_checks, first_failure

    assert first_failure(compile_moe_checks(True, **GOOD)) is None
    assert first_failure(compile_moe_checks(False, **dict(GOOD, **change))) is None  # off: nothing to check
    failure = first_failure(compile_moe_checks(True, **dict(GOOD, **change)))
    assert failure is not None and failure.startswith("trainer.compile_moe=true") and message in failure, failure


def test_global_aux_scope_compiles_with_one_data_replica():
    from meshtron.rules import compile_moe_checks, first_failure

    assert first_failure(compile_moe_checks(True, **dict(GOOD, aux_loss_scope="global", dp=1))) is None


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_torchrun_dp2_with_compiled_moe_layers_logs_the_eager_losses(tmp_path):
    """trainer.compile_moe over 2 data-parallel ranks (moe_tiny, bf16): the compiled run logs the
    eager run's losses and gradient norms to bf16 accuracy."""
    from tests.test_train_cli import TORCHRUN, metrics, run

    common = ["+model=moe_tiny", "trainer.precision=bf16", "trainer.max_steps=3", "trainer.log_every=1",
              "trainer.eval_every=0", "trainer.progress=false"]
    logs = {}
    for compile_moe in ("false", "true"):
        run_dir = tmp_path / compile_moe
        out = run([*TORCHRUN, "--nproc_per_node=2", "train.py", *common, f"trainer.compile_moe={compile_moe}",
                   f"hydra.run.dir={run_dir}"], timeout=300, threads=1)
        assert out.returncode == 0, out.stderr[-3000:]
        logs[compile_moe] = metrics(run_dir)
    assert [r["step"] for r in logs["true"]] == [1, 2, 3]
    for got, want in zip(logs["true"], logs["false"]):
        assert abs(got["loss"] - want["loss"]) <= 1e-3 * want["loss"], (got, want)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 2e-2 * want["grad_norm"], (got, want)


if __name__ == "__main__":  # run_isolated's child: one check function by name
    globals()[sys.argv[1]]()
