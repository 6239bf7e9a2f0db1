"""Sizes that cannot run are refused before any allocation or process group, with the numbers:
a model the planner (meta device) puts above the device's memory, a global batch larger than the
data, trainer.recompute_layers beyond the layers, dispatch chunks beyond the tokens; and
`meshtron.verify`'s own options out of range."""

from __future__ import annotations

import sys
import time

import pytest

from meshtron.errors import ConfigError
from meshtron.training import run_checks
from meshtron.training.config import RunConfig
from meshtron.training.run_checks import check_run_config, device_memory_bytes
from tests.test_train_cli import TORCHRUN, run

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=32", "trainer.max_steps=1"]


def _cfg(**sections) -> RunConfig:
    return RunConfig.from_dict(sections).with_precision_for("cpu", False)[0]


def _config_error(out, *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-1500:], out.stderr[-3000:])
    lines = [line for line in out.stderr.splitlines() if "configuration error" in line]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- in process


@pytest.mark.parametrize(
    "model",
    [{"vocab_size": 10**9}, {"hidden_size": 1048576}, {"ffn_hidden_size": 4 * 10**9}],
    ids=["vocab-1e9", "hidden-1M", "ffn-4e9"],
)
def test_the_planner_refuses_what_cannot_fit_without_allocating(model: dict):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"the model does not fit: the planner puts [\d,.]+ GiB on rank 0 .* GiB; "):
        check_run_config(_cfg(model=model), 1)
    assert time.perf_counter() - start < 20  # meta device: no allocation, fast even at vocab 1e9


def test_a_model_that_fits_skips_the_planner(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the planner ran for a model that clearly fits")

    monkeypatch.setattr(run_checks, "_stage_plans", boom)
    check_run_config(_cfg(), 1)


def test_memory_is_shared_by_the_ranks_of_a_cpu_node(monkeypatch):
    capacity, _ = device_memory_bytes("cpu")
    assert capacity > 2**28
    run_cfg = _cfg(
        model={"hidden_size": 1024, "num_heads": 8, "num_layers": 4, "seq_len": 512},
        trainer={"global_batch_size": 16, "micro_batch_size": 8},
    )
    plan = run_checks._stage_plans(run_cfg, run_cfg.parallel.resolved(1), 1, 8, 2, "cpu")[0]["memory"]["bytes"]
    # a capacity between one rank's plan and two ranks' plans: one rank fits, two on the node do not
    monkeypatch.setattr(run_checks, "device_memory_bytes", lambda *a: (int(plan["total"] * 1.5), "the test has"))
    check_run_config(run_cfg, 1)
    with pytest.raises(ConfigError, match=r"GiB per rank x 2 ranks on this machine"):
        check_run_config(run_cfg, 2, ranks_per_node=2)


def test_dry_run_still_plans_models_bigger_than_the_machine():
    check_run_config(_cfg(model={"vocab_size": 10**9}, trainer={"dry_run": True}), 1)


def test_global_batch_beyond_the_data_is_refused():
    with pytest.raises(ConfigError, match=r"trainer.global_batch_size=100,000,000 .* tokens per step, over"):
        check_run_config(_cfg(trainer={"global_batch_size": 10**8, "micro_batch_size": 1}), 1)
    tiny_corpus = {"max_bytes": 100_000}  # 703 training sequences of 128 bytes: 64 x 703 = 44,992 per step at most
    with pytest.raises(ConfigError, match=r"trainer.global_batch_size=65,536 .* exceeds 64 times the train split's"):
        check_run_config(_cfg(trainer={"global_batch_size": 2**16, "micro_batch_size": 1}, data=tiny_corpus), 1)
    check_run_config(_cfg(trainer={"global_batch_size": 2**15, "micro_batch_size": 1}, data=tiny_corpus), 1)
    check_run_config(_cfg(trainer={"global_batch_size": 64}), 1)


def test_recompute_layers_beyond_num_layers():
    with pytest.raises(ConfigError, match=r"trainer.recompute_layers=5 exceeds model.num_layers=4"):
        check_run_config(_cfg(trainer={"recompute": "full", "recompute_layers": 5}), 1)
    check_run_config(_cfg(trainer={"recompute": "full", "recompute_layers": 4}), 1)


def test_dispatch_chunks_beyond_the_tokens(capsys):
    moe = {"num_experts": 4, "top_k": 2}
    par = {"ep": 2}
    # gbs 16 over dp 2: microbatches of 8 x seq 128 = 1,024 tokens per rank
    with pytest.raises(ConfigError, match=r"trainer.moe_dispatch_chunks=2000 exceeds the 1,024 tokens a rank"):
        check_run_config(_cfg(model=moe, parallel=par, trainer={"moe_dispatch_chunks": 2000}), 2)
    check_run_config(_cfg(model=moe, parallel=par, trainer={"moe_dispatch_chunks": 1000}), 2)
    assert "warning: trainer.moe_dispatch_chunks=1000 leaves 1 tokens per chunk" in capsys.readouterr().err
    check_run_config(_cfg(model=moe, parallel=par, trainer={"moe_dispatch_chunks": 4}), 2)
    assert "moe_dispatch_chunks" not in capsys.readouterr().err


# ---------------------------------------------------------------- subprocesses


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.vocab_size=1000000000", "model.vocab_size=1000000000"),
        ("model.hidden_size=1048576", "model.hidden_size=1048576"),
        ("model.ffn_hidden_size=4000000000", "model.ffn_hidden_size=4000000000"),
        ("trainer.global_batch_size=100000000", "trainer.global_batch_size=100,000,000"),
        ("trainer.recompute_layers=3", "trainer.recompute_layers=3 exceeds model.num_layers=1"),
    ],
)
def test_train_refuses_huge_sizes_in_one_line(tmp_path, override: str, needle: str):
    args = [*TINY, override] if "hidden_size=1048576" not in override else [*TINY[:1], *TINY[2:], override]
    out = run([sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path}"], timeout=180, threads=1)
    _config_error(out, needle)


@pytest.mark.timeout(200)
def test_torchrun_refuses_before_the_process_group(tmp_path):
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            "train.py",
            *TINY,
            "model.vocab_size=1000000000",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=180,
        threads=1,
    )
    assert out.returncode != 0 and "exitcode  : 2" in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "configuration error: the model does not fit" in line]
    assert len(lines) == 2, out.stderr[-3000:]
    assert "meshtron: rank" not in out.stdout  # no mesh was built: no process group existed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flag,needle",
    [
        (["--world", "0"], "--world 0: the layout needs at least 1 process"),
        (["--world", "-2"], "--world -2: the layout needs at least 1 process"),
        (["--tol", "-1"], "--tol -1: a tolerance must be a finite number >= 0"),
        (["--steps", "0"], "--steps 0: give at least 1"),
    ],
)
def test_verify_refuses_out_of_range_options(flag: list[str], needle: str):
    out = run([sys.executable, "-m", "meshtron.verify", *flag, *TINY], timeout=100, threads=1)
    assert out.returncode == 2, (out.stdout[-1500:], out.stderr[-3000:])
    assert (
        out.stderr.strip().splitlines() == [f"meshtron verify: configuration error: {needle}"] or needle in out.stderr
    )
    assert "Traceback" not in out.stderr
