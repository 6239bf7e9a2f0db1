"""Sweeps (issue 17): Hydra multirun inside one torchrun (a fresh process group per job), the
torchrun launcher (one torchrun per sweep point, failures recorded, sweep_summary.jsonl), and
that the launcher plugin is discoverable from the installed package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hydra_plugins.meshtron_torchrun_launcher.torchrun_launcher import _config_flags, _error_line, _metrics_summary

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# Tiny and short: one layer, two steps, a 1 MB slice of the default text.
COMMON = [
    "trainer.max_steps=2",
    "trainer.progress=false",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "model.num_layers=1",
    "data.max_bytes=1000000",
]


def run(args: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def launcher_sweep(tmp_path_factory):
    """One sweep of 3 layouts on 2 processes each, the middle one bad (tp=3 on 2 ranks)."""
    sweep_dir = tmp_path_factory.mktemp("launcher_sweep")
    out = run(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            "parallel.tp=1,3,2",
            *COMMON,
            f"hydra.sweep.dir={sweep_dir}",
        ],
        timeout=400,
    )
    return sweep_dir, out


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_launcher_records_a_failed_point_and_finishes_the_sweep(launcher_sweep):
    sweep_dir, out = launcher_sweep
    assert out.returncode == 1, out.stderr[-3000:]  # the sweep ran to its end, then reports the failure
    assert (
        out.stderr.strip().splitlines()[-1]
        == f"meshtron: 1 of 3 sweep points failed; see {sweep_dir / 'sweep_summary.jsonl'}"
    )
    summary = [json.loads(line) for line in (sweep_dir / "sweep_summary.jsonl").read_text().splitlines()]
    assert [(r["job"], r["overrides"][0], r["status"], r["exit_code"]) for r in summary] == [
        (0, "parallel.tp=1", "completed", 0),
        (1, "parallel.tp=3", "failed", 2),
        (2, "parallel.tp=2", "completed", 0),
    ]
    bad = summary[1]
    assert bad["error"] == (
        "meshtron: configuration error: world size 2 is not divisible by tp*pp=3 (tp=3, pp=1); "
        "change parallel.tp/parallel.pp or the number of processes"
    )
    assert bad["final_loss"] is None and not (sweep_dir / "1" / "metrics.jsonl").exists()
    for record in (summary[0], summary[2]):
        run_dir = Path(record["run_dir"])
        assert run_dir == sweep_dir / str(record["job"])
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2] and record["final_step"] == 2
        assert record["final_loss"] == records[-1]["loss"] and record["tokens_per_s"] == records[-1]["tokens_per_s"]
        assert record["peak_mem_bytes"] == max(r["peak_mem_max_bytes"] for r in records) > 0
        assert len(record["overrides"]) == 1 + len(COMMON) and record["wall_s"] > 0
    # parallel == serial across the sweep: tp=2 gives tp=1's losses
    assert losses(sweep_dir / "2") == pytest.approx(losses(sweep_dir / "0"), rel=1e-5, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_multirun_inside_torchrun_gives_each_job_its_own_process_group(tmp_path, launcher_sweep):
    """torchrun ... train.py -m: 3 jobs in the same 2 processes, one process group each; the
    job at the default lr gives the losses of the launcher's single-job tp=1 run (same 2-rank
    dp layout, same overrides), the other lrs differ. The sweep dir is named from each rank's
    clock (microseconds: the ranks disagree); all jobs land in rank 0's and rank 1's is gone."""
    out = run(
        [
            *TORCHRUN,
            "train.py",
            "-m",
            "optim.lr=1e-3,2e-3,3e-3",
            *COMMON,
            f"hydra.sweep.dir={tmp_path}/${{now:%H-%M-%S-%f}}",
        ],
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    [sweep_dir] = list(tmp_path.iterdir())
    runs = [losses(sweep_dir / str(job)) for job in range(3)]
    assert all(len(r) == 2 for r in runs)
    assert runs[0][1] != runs[1][1] != runs[2][1], "each job must train with its own lr"
    single_job = losses(launcher_sweep[0] / "0")
    assert runs[2] == pytest.approx(single_job, rel=1e-6, abs=1e-7)
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["0", "1", "2", "multirun.yaml"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_process_group_per_job_survives_ranks_out_of_step(tmp_path):
    """The bug behind issue 17's multirun failure, made deterministic: with torch's default
    init, a rank starting its next group late reads the previous group's gloo addresses from
    the launcher's store (connection refused/reset). init_distributed's per-job store prefix
    makes 4 init/teardown cycles with skewed ranks work."""
    script = tmp_path / "cycles.py"
    script.write_text(
        textwrap.dedent("""
        import time
        import torch
        import torch.distributed as dist
        from meshtron.training.distributed import init_distributed, teardown_distributed
        for job in range(4):
            init_distributed("cpu", timeout_s=30, num_threads=1)
            t = torch.full((1,), float(job + dist.get_rank()))
            dist.all_reduce(t)
            time.sleep(0.2 * dist.get_rank())  # rank 1 tears down (and re-inits) later than rank 0
            teardown_distributed()
            print(f"job {job}: {t.item()}", flush=True)
    """)
    )
    out = run([*TORCHRUN, str(script)], timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("job")) == sorted(
        f"job {j}: {2 * j + 1.0}" for j in range(4) for _ in range(2)
    )


def test_launcher_plugin_is_discovered_from_the_install(tmp_path):
    """Hydra finds launchers only in the `hydra_plugins` namespace package; from a directory
    outside the repository this sees what `pip install -e .` installed."""
    probe = (
        "from hydra.core.plugins import Plugins\nfrom hydra.plugins.launcher import Launcher\n"
        "print(sorted(c.__module__ + '.' + c.__name__ for c in Plugins.instance().discover(Launcher)))"
    )
    out = run([sys.executable, "-c", probe], timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hydra_plugins.meshtron_torchrun_launcher.torchrun_launcher.TorchrunLauncher" in out.stdout


def test_launcher_helpers(tmp_path):
    assert _config_flags(["-m", "--config-dir", "ckpt/hf", "+model=imported", "-cn=train", "parallel.tp=1,2"]) == [
        "--config-dir",
        "ckpt/hf",
        "-cn=train",
    ]
    log = tmp_path / "torchrun.log"
    log.write_text(
        "W1124 warning\nmeshtron: configuration error: tp=3 does not divide num_heads=4\n"
        "meshtron: configuration error: tp=3 does not divide num_heads=4\nE1124 failed (exitcode: 2)\n"
    )
    assert _error_line(log) == "meshtron: configuration error: tp=3 does not divide num_heads=4"
    log.write_text(
        "Traceback (most recent call last):\n  ...\nAttributeError: 'X' object has no attribute 'y'\n"
        "E1124 22:12:13.250000 2153 api.py:1002] failed (exitcode: 1) local_rank: 0\n"
    )
    assert _error_line(log) == "AttributeError: 'X' object has no attribute 'y'"
    log.write_text("something odd\nthe end\n")
    assert _error_line(log) == "the end"
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 1, "loss": 5.0, "tokens_per_s": 10.0, "peak_mem_max_bytes": 7},
        {"step": 2, "loss": 4.0, "tokens_per_s": 12.0, "peak_mem_max_bytes": 9},
        {"step": 2, "loss": 3.9, "tokens_per_s": 11.0, "peak_mem_max_bytes": 8},
    ]  # step 2 redone after a resume
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _metrics_summary(metrics) == {"final_step": 2, "final_loss": 3.9, "tokens_per_s": 11.0, "peak_mem_bytes": 9}
    assert _metrics_summary(tmp_path / "missing.jsonl") == {}


@pytest.mark.timeout(120)
def test_launcher_ends_a_point_past_its_timeout(tmp_path):
    """hydra.launcher.timeout_s: a hung point's torchrun and its worker are ended and the
    point is recorded as timeout (the script hangs instead of training)."""
    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('hanging', flush=True)\ntime.sleep(600)\n")
    sweep_dir = tmp_path / "sweep"
    out = run(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.timeout_s=5",
            f"hydra.launcher.script={script}",
            "trainer.seed=1",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        timeout=110,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    [record] = [json.loads(line) for line in (sweep_dir / "sweep_summary.jsonl").read_text().splitlines()]
    assert (record["status"], record["exit_code"]) == ("timeout", None)
    assert record["error"] == "no exit within hydra.launcher.timeout_s=5" and 5 <= record["wall_s"] < 60
    assert (sweep_dir / "0" / "torchrun.log").read_text().startswith(sys.executable)  # the command, first


def test_launcher_refuses_to_run_under_torchrun_and_bad_options(monkeypatch, capsys):
    from hydra_plugins.meshtron_torchrun_launcher.torchrun_launcher import TorchrunLauncher

    launcher = TorchrunLauncher(nproc_per_node=2)
    launcher.config = launcher.hydra_context = object()  # refused before either is read
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        launcher.launch([["trainer.seed=1"]], 0)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("meshtron: configuration error: hydra/launcher=torchrun starts")
    with pytest.raises(ValueError, match=r"hydra.launcher.nproc_per_node=0 must be an integer >= 1"):
        TorchrunLauncher(nproc_per_node=0)
    with pytest.raises(ValueError, match=r"hydra.launcher.timeout_s=-1 must be > 0 or null"):
        TorchrunLauncher(timeout_s=-1)
