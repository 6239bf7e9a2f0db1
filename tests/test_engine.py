"""The Engine (training/engine.py) is the one place a run is assembled, and it steps, saves and
loads a run exactly; the StepReporter (training/reporting.py) logs the steps the config says,
with throughput from the steps it was told about."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from meshtron.models.config import GPTConfig
from meshtron.mpu.mesh import ParallelConfig, single_process_mesh
from meshtron.training import reporting
from meshtron.training.checkpoint import TrainState
from meshtron.training.config import OptimConfig, TrainerConfig
from meshtron.training.engine import Engine, EngineConfig

ROOT = Path(__file__).resolve().parents[1]
# What building a run means: only training/engine.py may call these.
ASSEMBLY = {
    "init_model_chunks",
    "build_reducer_and_optimizer",
    "PipelineExecutor",
    "train_step",
    "pipeline_train_step",
    "build_mesh",
}
# Every caller that trains a model, and builds it through Engine.build.
CALLERS = [
    "training/loop.py",
    "training/verify.py",
    "training/param_server.py",
    "bench/throughput.py",
    "bench/memory.py",
]


def _called_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None))
    return names


@pytest.mark.parametrize("caller", CALLERS)
def test_every_caller_builds_its_run_through_the_engine(caller):
    called = _called_names(ROOT / caller)
    assert "build" in called and "Engine" in (ROOT / caller).read_text(), f"{caller} does not call Engine.build"
    assert not called & (ASSEMBLY - {"build_mesh"}), f"{caller} assembles a run itself: {sorted(called & ASSEMBLY)}"


def test_no_other_module_in_training_assembles_a_run():
    offenders = {}
    for path in sorted((ROOT / "training").glob("*.py")):
        if path.name in ("engine.py", "step.py"):  # the Engine, and the step functions it calls
            continue
        found = _called_names(path) & ASSEMBLY
        if found:
            offenders[path.name] = sorted(found)
    assert not offenders, offenders


def _tiny(seed: int = 7) -> EngineConfig:
    cfg = GPTConfig(
        arch="llama",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        vocab_size=128,
        seq_len=16,
        dropout=0.0,
    )
    return EngineConfig(model=cfg, micro_batch_size=2, seed=seed, optim=OptimConfig(lr=1e-2))


def _batches(count: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, 128, (4, 17), generator=gen)
        out.append([(tokens[i : i + 2, :-1], tokens[i : i + 2, 1:]) for i in (0, 2)])
    return out


def test_engine_builds_from_a_parallel_config_and_steps():
    engine = Engine.build(_tiny(), ParallelConfig(), "cpu")
    try:
        assert engine.executor is None and engine.mesh.world_size == 1 and len(engine.chunks) == 1
        batch = _batches(1)[0]
        losses = [float(engine.step(batch, 1e-2).loss) for _ in range(4)]
        assert losses[-1] < losses[0] - 0.1  # the same batch four times: it learns it
        held_out = engine.evaluate(_batches(1)[0])
        assert held_out.ndim == 0 and torch.isfinite(held_out)
    finally:
        engine.close()


def test_a_loaded_engine_steps_as_the_saved_one(tmp_path):
    """Save after two steps, load into an engine of another seed: the next steps are bit-equal."""
    batches = _batches(4)
    saved = Engine.build(_tiny(seed=7), single_process_mesh(), "cpu")
    for b in batches[:2]:
        saved.step(b, 1e-2)
    done = []
    saved.save(tmp_path, TrainState(step=2, consumed_samples=8), keep=None, on_done=done.append)
    assert [p.name for p in done] == ["step_00000002"]
    loaded = Engine.build(_tiny(seed=8), single_process_mesh(), "cpu")
    first = next(loaded.model.parameters()).detach().clone()
    state = loaded.load(done[0])
    assert state.step == 2 and state.consumed_samples == 8
    assert not torch.equal(first, next(loaded.model.parameters()))  # other seed: the load changed it
    for b in batches[2:]:
        want, got = saved.step(b, 1e-2), loaded.step(b, 1e-2)
        assert torch.equal(want.loss, got.loss) and torch.equal(want.grad_norm, got.grad_norm)
    for p, q in zip(saved.model.parameters(), loaded.model.parameters()):
        assert torch.equal(p, q)
    assert saved.weights_are_finite()
    saved.close()
    loaded.close()


def test_optimizer_factory_and_adjust_model_replace_the_defaults():
    seen = []

    def factory(chunks, mesh):
        from meshtron.dp.grad_reduce import DataParallelGradReducer
        from meshtron.training.optim import build_optimizer

        seen.append("factory")
        return (
            DataParallelGradReducer([(n, p) for c in chunks for n, p in c.named_parameters()], mesh),
            build_optimizer(chunks[0], lr=0.0, weight_decay=0.0),
        )

    engine = Engine.build(
        _tiny(),
        single_process_mesh(),
        "cpu",
        optimizer_factory=factory,
        adjust_model=lambda chunks: seen.append(("adjust", len(chunks))),
    )
    assert seen == [("adjust", 1), "factory"]
    before = [p.detach().clone() for p in engine.model.parameters()]
    engine.step(_batches(1)[0], 0.0)  # lr 0: the factory's optimizer leaves the weights alone
    assert all(torch.equal(p, q) for p, q in zip(before, engine.model.parameters()))
    engine.close()


def test_reporter_logs_first_every_eval_and_last(tmp_path):
    t = TrainerConfig(max_steps=10, log_every=4, eval_every=3)
    r = reporting.StepReporter(
        tmp_path, t, tokens_per_step=1, flops_per_token=1.0, peak_flops=1.0, first=1, write=False, show=False
    )
    assert [n for n in range(1, 11) if r.log_due(n)] == [1, 3, 4, 6, 8, 9, 10]
    assert [n for n in range(1, 11) if r.eval_due(n)] == [3, 6, 9, 10]
    resumed = reporting.StepReporter(
        tmp_path,
        TrainerConfig(max_steps=10, log_every=4, eval_every=0),
        tokens_per_step=1,
        flops_per_token=1.0,
        peak_flops=1.0,
        first=6,
        write=False,
        show=False,
    )
    assert [n for n in range(6, 11) if resumed.log_due(n)] == [6, 8, 10]


def test_reporter_throughput_covers_the_window(tmp_path, monkeypatch):
    clock = iter([100.0, 103.0, 103.0, 104.0, 104.0])
    monkeypatch.setattr(reporting.time, "perf_counter", lambda: next(clock))
    r = reporting.StepReporter(
        tmp_path,
        TrainerConfig(),
        tokens_per_step=600,
        flops_per_token=10.0,
        peak_flops=4000.0,
        first=1,
        write=True,
        show=False,
    )
    for _ in range(3):
        r.tick()
    assert r.throughput() == {"tokens_per_s": 600.0, "mfu": 1.5, "step_time_s": 1.0}  # 3 steps in 3 s
    r.tick()
    assert r.throughput()["tokens_per_s"] == 600.0  # a new window: 1 step in 1 s
    r.emit({"step": 1, "loss": 2.0})
    r.close()
    assert (tmp_path / "metrics.jsonl").read_text().strip() == '{"step":1,"loss":2.0}'
    assert r.summary(1, tmp_path)["first_loss"] == 2.0
