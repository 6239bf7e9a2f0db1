"""trainer.compile: every transformer block's body under torch.compile (models/gpt.py
`Block.compile_body`), compiled == eager in fp32, and its refusals.

The compiled checks run in fresh interpreters (torch.compile's process state never meets the
Triton interpreter's tests of the pytest process): the single-process ones one after another
in one child (`single_process_results`), the two-rank layouts in one gloo world
(tests/distributed/compile_cases.py). Each single-process check trains one step (two
microbatches) of a 2-layer model built compiled and the same model eager, and compares the
loss and gradient norm and every gradient at 1e-5 relative (fp32), and what dynamo compiled.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.mesh import single_process_mesh

REPO = Path(__file__).resolve().parents[1]
RTOL = 1e-5
SINGLE = ("gpt2_dense", "llama_full_recompute", "llama_selective_recompute", "llama_moe")


def _config(arch: str, moe: bool = False) -> GPTConfig:
    """A 2-layer fp32 model; with `moe` the second layer is an MoE layer (aux and z losses)."""
    extra = dict(num_experts=4, top_k=2, moe_ffn_hidden_size=16, moe_every=2, aux_loss_coef=0.01, z_loss_coef=1e-3)
    return GPTConfig(
        arch=arch, num_layers=2, hidden_size=32, num_heads=4, vocab_size=64, seq_len=16, **(extra if moe else {})
    )


def _step(cfg: GPTConfig, execution: ExecutionConfig):
    """One training step of two microbatches: (step result, gradients, MoE loads, the model)."""
    from meshtron.dp.grad_reduce import DataParallelGradReducer
    from meshtron.models.gpt import init_model_chunks
    from meshtron.moe.layer import MoELayer
    from meshtron.training.optim import build_optimizer
    from meshtron.training.step import train_step

    mesh = single_process_mesh()
    (model,) = init_model_chunks(cfg, mesh, 7, execution=execution)
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, eps=1e-8)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(2))
    micro = [(tokens[:2, :-1], tokens[:2, 1:]), (tokens[2:, :-1], tokens[2:, 1:])]
    out = train_step(model, reducer, optimizer, micro, mesh, lr=1e-3, max_grad_norm=1.0)
    reducer.remove_hooks()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    loads = [m.router.step_load.clone() for m in model.modules() if isinstance(m, MoELayer)]
    return out, grads, loads, model


def _cuda_bf16_losses(cfg: GPTConfig, execution: ExecutionConfig, steps: int = 3) -> list[float]:
    """`steps` bf16 training steps on the GPU (the same batch each step): their losses."""
    from meshtron.dp.grad_reduce import DataParallelGradReducer
    from meshtron.models.gpt import init_model_chunks
    from meshtron.training.optim import build_optimizer
    from meshtron.training.precision import Precision
    from meshtron.training.step import train_step

    mesh = single_process_mesh()
    (model,) = init_model_chunks(cfg, mesh, 7, device="cuda", execution=execution)
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, eps=1e-8)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(2)).cuda()
    micro = [(tokens[:2, :-1], tokens[:2, 1:]), (tokens[2:, :-1], tokens[2:, 1:])]
    precision = Precision("bf16", "cuda")
    losses = [
        float(train_step(model, reducer, optimizer, micro, mesh, lr=1e-3, max_grad_norm=1.0, precision=precision).loss)
        for _ in range(steps)
    ]
    reducer.remove_hooks()
    return losses


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_blocks_on_the_gpu_train_as_eager_in_bf16(mode):
    """On the GPU in bf16, blocks compiled (default: inductor kernels; reduce-overhead: CUDA
    graphs too) train three steps as eager within bf16 tolerance (1e-2 relative per loss)."""
    cfg = _config("llama")
    want = _cuda_bf16_losses(cfg, ExecutionConfig())
    torch._dynamo.reset()
    got = _cuda_bf16_losses(cfg, ExecutionConfig(compile=True, compile_mode=mode))
    torch._dynamo.reset()
    assert all(abs(g - w) <= 1e-2 * abs(w) for g, w in zip(got, want)), (got, want)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12)).item()


def _compiled_equals_eager(cfg: GPTConfig, recompute: str) -> dict:
    """Train one step eager and compiled; assert they agree; return dynamo's counters."""
    from torch._dynamo.utils import counters

    want, want_grads, want_loads, _ = _step(cfg, ExecutionConfig(recompute=recompute))
    torch._dynamo.reset()
    counters.clear()
    got, got_grads, got_loads, model = _step(cfg, ExecutionConfig(recompute=recompute, compile=True))
    assert all(block.compiled for block in model.layers.values())
    for key in ("loss", "grad_norm") + (("aux_loss", "z_loss") if cfg.num_experts else ()):
        error = _relative_error(getattr(got, key), getattr(want, key))
        assert error <= RTOL, (key, error)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert _relative_error(got_grads[name], grad) <= RTOL, (name, _relative_error(got_grads[name], grad))
    assert len(got_loads) == len(want_loads) and all(torch.equal(g, w) for g, w in zip(got_loads, want_loads))
    seen = {"graphs": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"])}
    torch._dynamo.reset()
    return seen


def check_gpt2_dense() -> None:
    """Both GPT-2 blocks run one shared graph (dynamo inlines the modules), no graph break."""
    seen = _compiled_equals_eager(_config("gpt2"), "none")
    assert seen == {"graphs": 1, "breaks": {}}, seen


def check_llama_full_recompute() -> None:
    """Full recomputation wraps the compiled body: two graphs, the first pass without grad and
    the replay with it (RoPE traced whole: no graph break)."""
    seen = _compiled_equals_eager(_config("llama"), "full")
    assert seen == {"graphs": 2, "breaks": {}}, seen


def check_llama_selective_recompute() -> None:
    """Selective recomputation's RNG snapshot is a graph break; the results stay eager's."""
    seen = _compiled_equals_eager(_config("llama"), "selective")
    assert seen["graphs"] > 1 and any("get_rng_state" in why for why in seen["breaks"]), seen


def check_llama_moe() -> None:
    """A dense and an MoE block (aux and z losses, the router's loads equal); fp32's grouped
    GEMM runs eagerly between graphs (its meta function takes bf16 only)."""
    seen = _compiled_equals_eager(_config("llama", moe=True), "none")
    assert seen["graphs"] > 1 and all("torch.compiler.disable" in why for why in seen["breaks"]), seen


def run_single_process_checks(names: list[str]) -> dict[str, str]:
    """Run the named checks in this process one after another: {name: "ok" or the traceback}."""
    results = {}
    for name in names:
        try:
            globals()[f"check_{name}"]()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    return results


@functools.cache
def single_process_results() -> dict[str, str]:
    """Every single-process check, run once per pytest session in one fresh interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_compile_blocks", *SINGLE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SINGLE)
def test_compiled_blocks_train_like_eager(name):
    result = single_process_results()[name]
    assert result == "ok", result


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case",
    [
        "gpt2_tp2_sp_compiled",
        "llama_cp2_compiled",
        "llama_moe_ep2_compiled",
        "llama_zero2_dp2_compiled",
        "gpt2_pp2_1f1b_compiled",
    ],
)
def test_compiled_blocks_in_two_rank_layouts_equal_serial(case):
    """tests/distributed/compile_cases.py in one gloo world of 2 (per-collective timeout 60 s)."""
    result = _two_rank_results()[f"tests.distributed.compile_cases:{case}"]
    details = "\n".join(f"--- rank {r} ---\n{e}" for r, e in result["errors"].items())
    assert result["ok"], details


@functools.cache
def _two_rank_results() -> dict:
    from tests.distributed.compile_cases import cases_for_world
    from tests.distributed.harness import run_world

    cases = [f"tests.distributed.compile_cases:{c}" for c in cases_for_world(2)]
    return run_world(2, cases, timeout=280.0, collective_timeout=60.0)


# ---------------------------------------------------------------- plumbing and refusals


def test_every_block_is_compiled_with_the_mode_and_shapes(monkeypatch):
    """ExecutionConfig(compile=True) puts each block's body under torch.compile with the mode;
    dense blocks with static shapes, MoE blocks with automatic dynamic ones; compile_moe is
    superseded (not applied on top)."""
    from meshtron.models.gpt import GPT
    from meshtron.moe.layer import MoELayer

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append((fn.__name__, kw)) or fn)
    monkeypatch.setattr(MoELayer, "compile_moe", lambda self: calls.append(("compile_moe", {})))
    execution = ExecutionConfig(compile=True, compile_mode="max-autotune-no-cudagraphs", compile_moe=True)
    model = GPT(_config("llama", moe=True), single_process_mesh(), device="meta", execution=execution)
    mode = "max-autotune-no-cudagraphs"
    assert calls == [
        ("_forward", {"mode": mode, "dynamic": False}),
        ("_forward", {"mode": mode, "dynamic": None}),
    ]
    assert [b.compiled for b in model.layers.values()] == [True, True]
    calls.clear()
    GPT(_config("llama", moe=True), single_process_mesh(), device="meta", execution=ExecutionConfig())
    assert calls == []


@pytest.mark.parametrize(
    "par, eager_dispatch, eager_stats",
    [(dict(), False, False), (dict(ep=2), True, False), (dict(tp=2), False, True)],
    ids=["single", "ep2", "tp2"],
)
def test_moe_communication_stays_eager_in_compiled_blocks(monkeypatch, par, eager_dispatch, eager_stats):
    """MoELayer.keep_collectives_eager (on a virtual mesh of 2 ranks; nothing runs): the
    dispatcher's four steps where it communicates, the statistics' all-reduce where it has ranks
    to reduce over, and the capacity's count always become graph breaks (torch.compiler.disable)."""
    from meshtron.moe.layer import MoELayer
    from meshtron.mpu.mesh import ParallelConfig, virtual_mesh

    monkeypatch.setattr(torch.compiler, "disable", lambda fn: ("eager", fn))
    mesh = virtual_mesh(ParallelConfig(**par), 2 if par else 1, 0)
    layer = MoELayer(_config("llama", moe=True).moe(), mesh, device="meta")
    layer.keep_collectives_eager()
    steps = [getattr(layer.dispatcher, n) for n in ("dispatch_chunks", "receive", "combine", "finish")]
    assert [isinstance(f, tuple) for f in steps] == [eager_dispatch] * 4
    assert isinstance(layer.router.reduce_stats, tuple) == eager_stats
    assert layer.reduce_counts[0] == "eager"


def test_run_config_carries_compile_to_the_model_and_the_banner():
    from meshtron.training.config import RunConfig
    from meshtron.training.loop import compiled_what

    run = RunConfig.from_dict({"trainer": {"compile": True, "compile_mode": "reduce-overhead"}})
    execution = run.execution()
    assert (execution.compile, execution.compile_mode) == (True, "reduce-overhead")
    assert compiled_what(True, "reduce-overhead") == (
        "compiled: every transformer block under torch.compile (trainer.compile, mode reduce-overhead, CUDA graphs)"
    )
    assert compiled_what(False, "default") == "compiled: the MoE layers under torch.compile (trainer.compile_moe)"


COMPILE_OK = dict(compile_mode="default", compile_moe=False, precision="fp32", kernel_backend="auto", zero=2, dropout=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"compile_moe": True},
            "trainer.compile=true already compiles the MoE layers inside every block; "
            "set trainer.compile_moe=false (trainer.compile supersedes it)",
        ),
        (
            {"precision": "fp8"},
            "trainer.compile=true does not support trainer.precision=fp8 yet (the FP8 GEMMs' scaling is "
            "untested under torch.compile); use fp32, bf16 or fp16",
        ),
        (
            {"kernel_backend": "triton"},
            "trainer.compile=true lets inductor generate the blocks' kernels; use kernels.backend=auto or "
            "torch (triton forces the hand-written kernels)",
        ),
        (
            {"zero": 3},
            "trainer.compile=true does not support optim.zero=3 (its gathers free the weights' storage "
            "between uses, untested under a compiled block); use optim.zero<=2",
        ),
        (
            {"dropout": 0.1},
            "trainer.compile=true needs model.dropout=0 and model.attention_dropout=0 (got 0.1): inductor "
            "draws dropout masks from its own random stream, which eager runs and recomputation do not replay",
        ),
    ],
)
def test_compile_refuses_with_one_line(change, message):
    from meshtron.rules import compile_checks, first_failure

    assert first_failure(compile_checks(True, **COMPILE_OK)) is None
    assert first_failure(compile_checks(False, **dict(COMPILE_OK, **change))) is None  # off: nothing to check
    assert first_failure(compile_checks(True, **dict(COMPILE_OK, **change))) == message


def test_a_compile_mode_without_compile_is_refused():
    from meshtron.rules import compile_checks, first_failure

    assert first_failure(compile_checks(False, **dict(COMPILE_OK, compile_mode="reduce-overhead"))) == (
        "trainer.compile_mode=reduce-overhead is a mode of trainer.compile, which is off; "
        "set trainer.compile=true or leave trainer.compile_mode=default"
    )


GRAPHS_OK = dict(device_type="cuda", num_experts=8, ep=1, etp=1, capacity_factor=None, precision="bf16", pp=1)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"device_type": "cpu"},
            "trainer.compile_mode=reduce-overhead captures CUDA graphs; this run computes on cpu: use "
            "trainer.compile_mode=default or max-autotune-no-cudagraphs",
        ),
        (
            {"ep": 2},
            "trainer.compile_mode=reduce-overhead needs a step without host syncs; the MoE all-to-all at "
            "parallel.ep=2, parallel.etp=1 reads its split sizes on the host: use parallel.ep=etp=1 or "
            "trainer.compile_mode=default",
        ),
        (
            {"etp": 2},
            "trainer.compile_mode=reduce-overhead needs a step without host syncs; the MoE all-to-all at "
            "parallel.ep=1, parallel.etp=2 reads its split sizes on the host: use parallel.ep=etp=1 or "
            "trainer.compile_mode=default",
        ),
        (
            {"capacity_factor": 1.25},
            "trainer.compile_mode=reduce-overhead needs a step without host syncs; model.capacity_factor=1.25 "
            "counts the kept pairs on the host: use model.capacity_factor=null (dropless) or "
            "trainer.compile_mode=default",
        ),
        (
            {"precision": "fp32"},
            "trainer.compile_mode=reduce-overhead needs trainer.precision=bf16 for MoE models (got fp32): the "
            "experts' grouped GEMM pads its groups with a host sync in other precisions",
        ),
        (
            {"pp": 2},
            "trainer.compile_mode=reduce-overhead does not support parallel.pp=2 yet (microbatches' forwards "
            "before their backwards are untested with CUDA graphs); use parallel.pp=1 or "
            "trainer.compile_mode=default",
        ),
    ],
)
def test_cuda_graphs_are_refused_where_the_step_syncs_the_host(change, message):
    from meshtron.rules import cuda_graph_checks, first_failure

    assert first_failure(cuda_graph_checks("reduce-overhead", **GRAPHS_OK)) is None
    assert first_failure(cuda_graph_checks("default", **dict(GRAPHS_OK, **change))) is None
    assert first_failure(cuda_graph_checks("reduce-overhead", **dict(GRAPHS_OK, **change))) == message


def test_dense_cuda_graphs_need_neither_bf16_nor_dropless_settings():
    """The MoE conditions do not apply to a dense model (fp32, ep unused)."""
    from meshtron.rules import cuda_graph_checks, first_failure

    dense = dict(GRAPHS_OK, num_experts=0, precision="fp32", capacity_factor=1.0)
    assert first_failure(cuda_graph_checks("reduce-overhead", **dense)) is None


@pytest.mark.parametrize(
    "trainer, message",
    [
        (
            {"compile": True, "compile_moe": True},
            "trainer.compile=true already compiles the MoE layers inside every block; "
            "set trainer.compile_moe=false (trainer.compile supersedes it)",
        ),
        (
            {"compile": True, "compile_mode": "reduce-overhead", "device": "cpu"},
            "trainer.compile_mode=reduce-overhead captures CUDA graphs; this run computes on cpu: use "
            "trainer.compile_mode=default or max-autotune-no-cudagraphs",
        ),
    ],
)
def test_the_run_refuses_before_any_process_group(trainer, message):
    """check_run_config (every rank, before any collective) raises ConfigError with the line."""
    from meshtron.training.config import ConfigError, RunConfig
    from meshtron.training.run_checks import check_run_config

    run = RunConfig.from_dict({"trainer": {"precision": "bf16", **trainer}, "model": {"num_experts": 4, "top_k": 2}})
    with pytest.raises(ConfigError) as err:
        check_run_config(run, 1)
    assert str(err.value) == message


if __name__ == "__main__":  # single_process_results' child: the named checks, then one JSON line
    print(json.dumps(run_single_process_checks(sys.argv[1:])))
