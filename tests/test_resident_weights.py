"""16-bit resident weights (optim.param_dtype=bf16, dp/resident.py): training loss against
bf16 autocast over fp32 weights, config refusals, the planner's bytes per parameter, and the
2-rank cases (ZeRO stages equal one process, memory, checkpoints: tests/distributed/resident_cases.py)."""

from __future__ import annotations

import pytest
import torch

from meshtron.errors import ConfigError
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import single_process_mesh
from meshtron.planning.plan import model_state_bytes
from meshtron.training.config import OptimConfig, RunConfig
from meshtron.training.optim import build_reducer_and_optimizer
from meshtron.training.precision import Precision
from meshtron.training.step import train_step
from tests.distributed.dense_cases import SEED, microbatches, model_config
from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params


def _losses(param_dtype: str, steps: int = 4) -> list[float]:
    cfg, mesh = model_config("gpt2"), single_process_mesh()
    (model,) = init_model_chunks(cfg, mesh, SEED)
    reducer, optimizer = build_reducer_and_optimizer(OptimConfig(lr=1e-2, param_dtype=param_dtype), [model], mesh)
    out = [
        float(
            train_step(
                model,
                reducer,
                optimizer,
                microbatches(cfg, 0, 0, 1, 2),
                mesh,
                lr=1e-2,
                max_grad_norm=1.0,
                precision=Precision("bf16"),
            ).loss
        )
        for step in range(steps)
    ]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16 if param_dtype == "bf16" else torch.float32}
    reducer.remove_hooks()
    return out


def test_resident_loss_matches_bf16_autocast_over_fp32_weights() -> None:
    """Same loss within 1e-3 relative for 4 steps. Both compute the matmuls on bf16-rounded
    weights; resident weights also round embeddings, norm weights and biases (and hence the
    residual stream) to bf16, each a relative rounding <= 2**-9 that the token mean averages
    down (measured: at most 4.4e-4 over these steps). One batch, trained on repeatedly, moves the loss by several % over these steps, so a
    missing or mis-scaled update would exceed the tolerance."""
    fp32, resident = _losses("fp32"), _losses("bf16")
    assert (fp32[0] - fp32[-1]) / fp32[0] > 1e-2  # training moves the loss: the check can fail
    for step, (a, b) in enumerate(zip(resident, fp32)):
        assert abs(a - b) <= 1e-3 * abs(b), (step, a, b)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(precision="fp32"), "optim.param_dtype=bf16 needs trainer.precision=bf16 (got 'fp32')"),
        (dict(precision="fp16"), "optim.param_dtype=bf16 needs trainer.precision=bf16 (got 'fp16')"),
        (dict(pp=2), "optim.param_dtype=bf16 does not support parallel.pp=2 yet"),
    ],
)
def test_resident_refusals(overrides: dict, message: str) -> None:
    cfg = RunConfig()
    cfg.trainer.precision = overrides.get("precision", "bf16")
    cfg.optim.param_dtype = "bf16"
    cfg.optim.zero = overrides.get("zero", 0)
    cfg.parallel.pp = overrides.get("pp", 1)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_resident_defaults_unchanged() -> None:
    cfg = RunConfig()
    assert cfg.optim.param_dtype == "fp32"
    cfg.trainer.precision = "bf16"
    cfg.optim.param_dtype = "bf16"
    cfg.validate()


@pytest.mark.parametrize(
    "zero,offload,want",
    [(0, False, 18.0), (1, False, 6 + 12 / 8), (2, False, 2 + 16 / 8), (3, False, 18 / 8), (1, True, 6.0)],
)
def test_planner_bytes_per_parameter(zero: int, offload: bool, want: float) -> None:
    """Device bytes per parameter of the model states at dp=8 (Megatron's 6 + 12/dp at zero=1);
    ZeRO-3 halves the gathered units too."""
    n = 8_000
    counts = {"total": n, "matmul": n, "group_dp": n, "group_tp_dp": 0, "group_edp": 0}
    out = model_state_bytes(
        counts, {"dp": 8, "tp_dp": 8, "edp": 8}, zero=zero, offload=offload, precision="bf16", param_dtype="bf16"
    )
    assert out["total"] / n == want, out
    assert out["autocast_weight_copies"] == 0  # resident bf16 weights need no per-step copies
    assert out["host"] == (12 * n // 8 if offload else 0)
    gathered = model_state_bytes(
        {**counts, "zero3_gathered": 4000},
        {"dp": 8, "tp_dp": 8, "edp": 8},
        zero=3,
        precision="bf16",
        param_dtype="bf16",
    )["weights_gathered"]
    assert gathered == 2000


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.resident_cases"))
def test_resident_cases(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)


@pytest.mark.parametrize("offload", [False, True])
def test_resident_lr0_step_keeps_main_weights_bit_equal(offload: bool) -> None:
    """One step at lr=0 (weight decay 0.1: decoupled, so also scaled by lr) leaves the fp32 main
    weights bit-equal (torch.equal) to the fp32 initialisation, and the bf16 parameters equal
    to its rounding: the main weights must come from the fp32 values before the cast, never
    from the bf16 parameters (a re-read would round every weight). One process."""
    cfg, mesh = model_config("gpt2"), single_process_mesh()
    (model,) = init_model_chunks(cfg, mesh, SEED)
    initial = {p: p.detach().clone() for p in model.parameters()}
    assert all(t.dtype == torch.float32 for t in initial.values())
    reducer, optimizer = build_reducer_and_optimizer(
        OptimConfig(lr=1e-2, weight_decay=0.1, param_dtype="bf16", offload=offload), [model], mesh
    )
    result = train_step(
        model,
        reducer,
        optimizer,
        microbatches(cfg, 0, 0, 1, 2),
        mesh,
        lr=0.0,
        max_grad_norm=1.0,
        precision=Precision("bf16"),
    )
    assert not result.skipped and float(result.grad_norm) > 0  # gradients flowed: the update ran
    shards = optimizer.main_weight_shards()
    assert {id(p) for p, _, _ in shards} == {id(p) for p in initial}  # zero=0: every parameter whole
    for p, first, main in shards:
        assert first == 0 and main.dtype == torch.float32 and main.numel() == p.numel()
        assert torch.equal(main.cpu().view(p.shape), initial[p]), tuple(p.shape)
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), initial[p].to(torch.bfloat16))
    # the test can fail: the initial weights are not all bf16-representable
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in initial.values())
    reducer.remove_hooks()


def _three_linears():
    torch.manual_seed(0)
    return torch.nn.ModuleDict(
        {"a": torch.nn.Linear(5, 4), "b": torch.nn.Linear(4, 3), "unused": torch.nn.Linear(3, 2)}
    )


def test_resident_untouched_parameters_get_zero_gradients_and_no_update() -> None:
    """bf16 resident weights, lr > 0, weight decay 0, three steps: `unused` never gets a
    gradient, `b` gets one in step 0 only. After every step the fp32 `main_grad` of a parameter
    without a gradient in that step is exactly zero (not stale from step 0, not the
    uninitialised buffer), `unused` keeps its weights bit for bit (bf16 and fp32 main), and `b`'s
    main weights follow AdamW fed its step-0 gradient, then zeros (its moments still move it)."""
    from meshtron.dp.grad_reduce import DataParallelGradReducer
    from meshtron.dp.resident import ResidentAdamW

    model = _three_linears()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = single_process_mesh()
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh, main_grads=True)
    for bucket in reducer.buckets:  # the first-touch buffers start as garbage, not zeros
        bucket.buffer.fill_(float("nan"))
    lr, betas, eps = 1e-2, (0.9, 0.95), 1e-8
    optimizer = ResidentAdamW(reducer, lr=lr, weight_decay=0.0, betas=betas, eps=eps)
    ref_b = {n: initial[n].clone().requires_grad_(True) for n in ("b.weight", "b.bias")}
    ref_opt = torch.optim.AdamW(list(ref_b.values()), lr=lr, betas=betas, eps=eps, weight_decay=0.0)
    params = dict(model.named_parameters())
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for step in range(3):
        use_b = step == 0
        reducer.zero_grad()
        h = model["a"](x).tanh()
        (model["b"](h) if use_b else h).float().square().sum().backward()
        reducer.finish()
        untouched = ["unused.weight", "unused.bias"] + ([] if use_b else ["b.weight", "b.bias"])
        for name in untouched:
            assert params[name].grad is None
            assert torch.equal(params[name].main_grad, torch.zeros_like(params[name].main_grad)), (step, name)
        assert params["a.weight"].main_grad.abs().sum() > 0
        for name, r in ref_b.items():
            r.grad = params[name].main_grad.detach().clone()
        optimizer.step()
        ref_opt.step()
        main = {id(p): m.view(p.shape) for p, _, m in optimizer.main_weight_shards()}
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(main[id(params[name])], initial[name]), (step, name)
            assert torch.equal(params[name].detach(), initial[name].to(torch.bfloat16)), (step, name)
        for name, r in ref_b.items():
            torch.testing.assert_close(main[id(params[name])], r.detach(), rtol=1e-6, atol=1e-7, msg=f"{step} {name}")
            assert not torch.equal(main[id(params[name])], initial[name])  # b moved: the check can fail
    reducer.remove_hooks()
