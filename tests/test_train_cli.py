"""End-to-end runs of train.py in subprocesses: learning on real text, the output contract,
fail-fast configuration errors, torchrun layouts, Hydra sweeps and the dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
CONTRACT_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"}


def run(args: list[str], timeout: float, env: dict | None = None, threads: int = 2) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OMP_NUM_THREADS=str(threads), HYDRA_FULL_ERROR="1")
    full_env.update(env or {})
    return subprocess.run(args, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(240)
def test_default_training_learns_on_real_text(tmp_path):
    out = run(
        [
            sys.executable,
            "train.py",
            "trainer.max_steps=40",
            "trainer.log_every=10",
            "trainer.eval_every=20",
            "trainer.progress=false",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=220,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40]
    for r in records:
        assert CONTRACT_KEYS <= r.keys()
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1.5
    first, last = records[0]["loss"], records[-1]["loss"]
    assert first > 5.0, f"an untrained byte model starts near ln(256)=5.55, got {first}"
    assert last < first - 1.5, f"loss did not fall clearly: {first} -> {last}"
    val = [r["val_loss"] for r in records if "val_loss" in r]
    # (val at step 20 can sit above ln(256) when a loss spike is under way at this lr; the end must be low)
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40] and val[1] < 3.6
    assert all(r["skipped_steps"] == 0 for r in records)
    assert "step   40/40 | loss" in out.stdout
    # trainer.precision=auto (the default) picks fp32 on a CPU and the banner says why
    assert "meshtron: compute fp32 (trainer.precision=auto picked fp32: cpu has no fast 16-bit matmul)" in out.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.tp=4"], 6, "world size 6 is not divisible by tp*pp=4"),
        (["parallel.tp=3"], 3, "tp=3 does not divide num_heads=4"),
        (["trainer.global_batch_size=6"], 4, "trainer.global_batch_size=6 is not divisible by dp=4"),
        (["+model=gpt_1b", "parallel.tp=4", "parallel.ep=3"], 12, "ep=3 does not divide num_experts=8"),
        (["model.num_experts=4", "model.top_k=5"], 1, "model.top_k=5 must be between 1 and model.num_experts=4"),
        (["model.num_experts=4", "parallel.ep=2", "parallel.etp=2"], 2, "ep*etp=2*2=4 does not divide the 2 ranks"),
        (["model.num_heads=5"], 1, "hidden_size=128 is not divisible by model.num_heads=5"),
        (["data.paths=[/nonexistent/corpus]"], 1, "/nonexistent/corpus"),
        (["kernels.tf32=yes"], 2, "kernels.tf32='yes' must be one of auto, on, off"),
        (["optim.lr=inf"], 1, "optim.lr=inf must be a finite number > 0"),
        (["parallel.tp=true"], 1, "parallel.tp=True must be an integer >= 1"),
        (["parallel.tpp=2"], 2, "unknown key parallel.tpp; did you mean parallel.tp?"),
        (["trainer.global_batch_size=16.5"], 1, "trainer.global_batch_size=16.5 must be an integer"),
    ],
)
def test_bad_config_fails_before_any_process_group(tmp_path, overrides, world, message):
    """Validation runs before init_process_group: a lone rank of a world that never forms
    exits with one clear line instead of waiting for its peers."""
    assert_one_config_error_line(tmp_path, overrides, world, message)


def assert_one_config_error_line(tmp_path, overrides: list[str], world: int, message: str) -> None:
    """train.py with `overrides` as rank 0 of a `world` that never forms (no peer, port 1) exits 2
    with exactly one "meshtron: configuration error" line containing `message`."""
    env = {
        "WORLD_SIZE": str(world),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    out = run([sys.executable, "train.py", *overrides, f"hydra.run.dir={tmp_path}"], timeout=100, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("meshtron: configuration error")]
    assert len(lines) == 1 and message in lines[0], out.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_requested_without_a_gpu_is_one_line(tmp_path):
    out = run([sys.executable, "train.py", "trainer.device=cuda", f"hydra.run.dir={tmp_path}"], timeout=100)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("meshtron: configuration error")]
    assert lines == [
        "meshtron: configuration error: trainer.device=cuda but this machine has no usable CUDA "
        "device (torch.cuda.is_available() is False); use trainer.device=auto or cpu"
    ], out.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_bad_layout_under_torchrun_exits_without_hanging(tmp_path):
    out = run(
        [*TORCHRUN, "--nproc_per_node=2", "train.py", "parallel.tp=4", f"hydra.run.dir={tmp_path}"],
        timeout=150,
        threads=1,
    )
    assert out.returncode != 0
    # Every rank fails validation on its own; torchrun stops the other worker as soon as the
    # first one exits, so the second message may or may not get printed first.
    assert 1 <= out.stderr.count("world size 2 is not divisible by tp*pp=4") <= 2, out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr, out.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_tp_sp_dp_matches_single_process_and_agrees_on_run_dir(tmp_path):
    """4 ranks (tp=2, sp, dp=2, microbatches) log the single-process losses; each rank's own
    clock-based run dir collapses into rank 0's."""
    common = [
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "trainer.progress=false",
        "model.num_layers=2",
        "model.seq_len=64",
        "trainer.global_batch_size=8",
    ]
    serial_dir = tmp_path / "serial"
    out = run([sys.executable, "train.py", *common, f"hydra.run.dir={serial_dir}"], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    parallel_root = tmp_path / "parallel"
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=4",
            "train.py",
            *common,
            "parallel.tp=2",
            "parallel.sp=true",
            "trainer.micro_batch_size=2",
            f"hydra.run.dir={parallel_root}/" + "${now:%H-%M-%S-%f}",
        ],
        timeout=250,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    dirs = [d for d in parallel_root.iterdir() if d.is_dir()]
    assert len(dirs) == 1, f"ranks did not agree on one run dir: {dirs}"
    got, want = metrics(dirs[0]), metrics(serial_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-4 * abs(w["grad_norm"]), (g, w)


@pytest.mark.timeout(180)
def test_hydra_sweep_gives_each_run_its_own_dir(tmp_path):
    out = run(
        [
            sys.executable,
            "train.py",
            "-m",
            "trainer.seed=1,2",
            "trainer.max_steps=2",
            "trainer.progress=false",
            "model.num_layers=1",
            f"hydra.sweep.dir={tmp_path}",
        ],
        timeout=160,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {d.name: metrics(d) for d in tmp_path.iterdir() if (d / "metrics.jsonl").exists()}
    assert sorted(runs) == ["0", "1"]
    assert runs["0"][0]["loss"] != runs["1"][0]["loss"], "different seeds must give different runs"


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_card_command_dry_run_on_8_processes(tmp_path):
    """torchrun --nproc_per_node=8 train.py +model=gpt_1b parallel.tp=4 parallel.ep=8, dry run."""
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=8",
            "train.py",
            "+model=gpt_1b",
            "parallel.tp=4",
            "parallel.ep=8",
            "trainer.dry_run=true",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=220,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["ranks"]) == 8
    assert plan["layout"]["tp"] == 4 and plan["layout"]["ep"] == 8 and plan["layout"]["dp"] == 2
    assert all(f"[dry run] rank {r}:" in out.stdout for r in range(8))
    assert plan["model"]["total_params"] > 1.5e9


@pytest.mark.timeout(240)
def test_moe_training_learns_and_logs_expert_load(tmp_path):
    out = run(
        [
            sys.executable,
            "train.py",
            "+model=moe_tiny",
            "trainer.max_steps=30",
            "trainer.log_every=10",
            "trainer.progress=false",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=220,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = metrics(tmp_path)
    assert records[-1]["loss"] < records[0]["loss"] - 1.5
    tokens_per_step = 16 * 128  # trainer.global_batch_size x model.seq_len
    for r in records:
        assert {"aux_loss", "z_loss", "expert_imbalance", "dropped_fraction", "moe"} <= r.keys()
        assert len(r["moe"]) == 2  # moe_every=2 of 4 layers
        for layer in r["moe"]:
            assert len(layer["tokens_per_expert"]) == 8
            assert sum(layer["tokens_per_expert"]) == tokens_per_step * 2  # dropless, top-2
            assert layer["dropped_fraction"] == 0.0
            assert layer["imbalance"] == max(layer["tokens_per_expert"]) / (tokens_per_step * 2 / 8)
    assert "aux_loss" in out.stdout


SHRUNKEN_GPT_1B = [
    "+model=gpt_1b",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.ffn_hidden_size=128",
    "model.moe_ffn_hidden_size=64",
    "model.vocab_size=256",
    "model.seq_len=32",
    "trainer.global_batch_size=4",
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.progress=false",
]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_card_layout_trains_shrunken_gpt_1b_like_one_process(tmp_path):
    """torchrun --nproc_per_node=8 train.py +model=gpt_1b parallel.tp=4 parallel.ep=8 with small
    sizes: trains, and logs the single-process losses (MoE aux terms included in training) at
    the same micro batch size (2: the parallel run has dp=2), the aux-loss scope's invariance."""
    serial = tmp_path / "serial"
    out = run(
        [sys.executable, "train.py", *SHRUNKEN_GPT_1B, "trainer.micro_batch_size=2", f"hydra.run.dir={serial}"],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    parallel = tmp_path / "parallel"
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=8",
            "train.py",
            *SHRUNKEN_GPT_1B,
            "parallel.tp=4",
            "parallel.ep=8",
            f"hydra.run.dir={parallel}",
        ],
        timeout=270,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got, want = metrics(parallel), metrics(serial)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for key in ("loss", "aux_loss", "z_loss"):
            assert abs(g[key] - w[key]) <= 1e-5 * abs(w[key]), (key, g, w)
        assert [m["tokens_per_expert"] for m in g["moe"]] == [m["tokens_per_expert"] for m in w["moe"]]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_pipeline_interleaved_matches_single_process_and_writes_trace(tmp_path):
    """pp=2 x tp=2 with SP, interleaved schedule over 2 virtual stages per rank: the logged
    losses equal the single-process run, and trace.json is a valid Chrome trace of 4 ranks."""
    common = ["trainer.max_steps=2", "trainer.log_every=1", "trainer.progress=false", "trainer.global_batch_size=8"]
    serial_dir, pipe_dir = tmp_path / "serial", tmp_path / "pipe"
    out = run([sys.executable, "train.py", *common, f"hydra.run.dir={serial_dir}"], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=4",
            "train.py",
            *common,
            "parallel.pp=2",
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.vpp=2",
            "parallel.schedule=interleaved",
            "trainer.micro_batch_size=2",
            "trainer.trace_step=2",
            f"hydra.run.dir={pipe_dir}",
        ],
        timeout=270,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for g, w in zip(metrics(pipe_dir), metrics(serial_dir), strict=True):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * w["loss"], (g, w)
    trace = json.loads((pipe_dir / "trace.json").read_text())["traceEvents"]
    compute = [e for e in trace if e.get("ph") == "X" and e["cat"] in ("F", "B")]
    assert {e["pid"] for e in compute} == {0, 1, 2, 3}
    # 4 microbatches x 2 chunks, forward and backward, on each of the 4 ranks
    assert len(compute) == 4 * 2 * 2 * 4
    assert "bubble measured" in out.stdout and "theoretical" in out.stdout


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_zero1_logs_the_replicated_adamw_losses(tmp_path):
    """optim.zero=1 on 2 data-parallel ranks trains exactly like replicated AdamW."""
    common = [
        "trainer.max_steps=4",
        "trainer.log_every=1",
        "trainer.progress=false",
        "model.num_layers=2",
        "trainer.eval_every=0",
    ]
    logs = {}
    for zero in (0, 1):
        run_dir = tmp_path / f"zero{zero}"
        out = run(
            [*TORCHRUN, "--nproc_per_node=2", "train.py", *common, f"optim.zero={zero}", f"hydra.run.dir={run_dir}"],
            timeout=140,
            threads=1,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        logs[zero] = metrics(run_dir)
    for a, b in zip(logs[1], logs[0], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * b["loss"], (a, b)


_EXIT_PROBE = """import atexit, os, sys

def gloo_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:
            pass
    return sum("gloo" in name for name in names)

atexit.register(lambda: print(f"gloo threads at exit: {gloo_threads()}", flush=True))
sys.argv = ["train.py", *sys.argv[1:]]
from meshtron.training.cli import main
main()
"""


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_no_gloo_worker_thread_outlives_a_finished_run(tmp_path):
    """When the interpreter starts shutting down (atexit), every process group of the run is
    gone with its gloo worker threads: a group left to the shutdown's collection had its workers
    take the GIL after finalization began, and the rank died of SIGABRT ("terminate called
    without an active exception") after a successful run. ZeRO-1's overlapped gathers: the
    engine's reference cycles hold extra groups."""
    probe = tmp_path / "probe.py"
    probe.write_text(_EXIT_PROBE)
    run_dir = tmp_path / "run"
    args = ["trainer.max_steps=2", "trainer.progress=false", "trainer.eval_every=0", "optim.zero=1"]
    out = run(
        [*TORCHRUN, "--nproc_per_node=2", str(probe), "model.num_layers=2", *args, f"hydra.run.dir={run_dir}"],
        timeout=150,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    counts = [line for line in out.stdout.splitlines() if line.startswith("gloo threads at exit")]
    assert counts == ["gloo threads at exit: 0"] * 2, out.stdout[-2000:]


@pytest.mark.timeout(120)
def test_overflowing_update_is_not_saved_over_the_last_checkpoint(tmp_path):
    """Issue 14: a step whose update overflows the weights (lr beyond fp32's range) must not
    be checkpointed: exit 2 with one line, and the checkpoint saved before it stays the newest."""
    ckpt = tmp_path / "ckpt"
    common = [
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.num_heads=2",
        "model.seq_len=32",
        "trainer.global_batch_size=2",
        "trainer.progress=false",
        "trainer.eval_every=0",
        f"checkpoint.dir={ckpt}",
        "checkpoint.every=1",
        "data.max_bytes=200000",
    ]
    good = run(
        [sys.executable, "train.py", *common, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'a'}"], timeout=100
    )
    assert good.returncode == 0, good.stderr[-3000:]
    bad = run(
        [
            sys.executable,
            "train.py",
            *common,
            "trainer.max_steps=2",
            "checkpoint.resume=auto",
            "optim.lr=1e39",
            "optim.warmup_steps=0",
            f"hydra.run.dir={tmp_path / 'b'}",
        ],
        timeout=100,
    )
    assert bad.returncode == 2, bad.stderr[-3000:]
    lines = [line for line in bad.stderr.splitlines() if line.startswith("meshtron: checkpoint error")]
    assert len(lines) == 1 and "the weights after step 2 are not finite" in lines[0], bad.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000001"]
