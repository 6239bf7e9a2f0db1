"""train.py checkpoints end to end: a run killed with SIGKILL or stopped with SIGTERM and
resumed logs the uninterrupted run's losses bit for bit; bad checkpoints fail with one line
before any process group forms."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_train_cli import ROOT, metrics, run

COMMON = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "trainer.global_batch_size=8",
    "trainer.max_steps=12",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "data.max_bytes=2000000",
]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("reference")
    out = run([sys.executable, "train.py", *COMMON, f"hydra.run.dir={run_dir}"], timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 13))
    return losses


def _start(ckpt: Path, run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="2", **(env or {}))
    return subprocess.Popen(
        [sys.executable, "train.py", *COMMON, f"checkpoint.dir={ckpt}", *extra, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 150.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"train.py ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.05)


def _resume(ckpt: Path, run_dir: Path) -> subprocess.CompletedProcess:
    out = run(
        [
            sys.executable,
            "train.py",
            *COMMON,
            f"checkpoint.dir={ckpt}",
            "checkpoint.resume=auto",
            f"hydra.run.dir={run_dir}",
        ],
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkill_then_resume_gives_the_uninterrupted_losses(tmp_path, reference):
    ckpt = tmp_path / "ckpt"
    proc = _start(ckpt, tmp_path / "killed", "checkpoint.every=3", "checkpoint.keep=null")
    _wait_for(lambda: (ckpt / "step_00000006" / "meshtron.json").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert "step_00000006" in saved and "step_00000012" not in saved, saved
    out = _resume(ckpt, tmp_path / "resumed")
    start = int(saved[-1].split("_")[1])
    assert f"resumed from {ckpt / saved[-1]} at step {start}" in out.stdout
    resumed = _losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(start + 1, 13))
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)  # bit for bit


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_saves_then_resume_gives_the_uninterrupted_losses(tmp_path, reference):
    ckpt, stopped = tmp_path / "ckpt", tmp_path / "stopped"
    proc = _start(ckpt, stopped)  # checkpoint.every=0: saves only at the end or on SIGTERM
    _wait_for(lambda: (stopped / "metrics.jsonl").exists() and len(metrics(stopped)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    step = max(r["step"] for r in metrics(stopped))
    assert step < 12 and f"SIGTERM: stopped after step {step}" in stdout, stdout[-2000:]
    assert [p.name for p in ckpt.iterdir()] == [f"step_{step:08d}"]
    _resume(ckpt, tmp_path / "resumed")
    resumed = _losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(step + 1, 13))
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)


@pytest.fixture(scope="module")
def finished_checkpoint(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("ckpt")
    out = run(
        [
            sys.executable,
            "train.py",
            *COMMON,
            "trainer.max_steps=2",
            f"checkpoint.dir={ckpt}",
            f"hydra.run.dir={tmp_path_factory.mktemp('run')}",
        ],
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return ckpt / "step_00000002"


def _fails_before_process_group(tmp_path, overrides, message) -> None:
    env = {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    out = run([sys.executable, "train.py", *COMMON, *overrides, f"hydra.run.dir={tmp_path}"], timeout=100, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("meshtron: configuration error")]
    assert len(lines) == 1 and message in lines[0], out.stderr[-3000:]


@pytest.mark.timeout(200)
def test_mismatched_checkpoint_names_the_tensor(tmp_path, finished_checkpoint):
    _fails_before_process_group(
        tmp_path,
        ["model.hidden_size=32", f"checkpoint.resume={finished_checkpoint}"],
        "tensor pos_embed has shape [128, 64] but the model needs [128, 32] "
        "(model config differs from the checkpoint's: ffn_hidden_size 256 -> 128, "
        "hidden_size 64 -> 32",
    )


@pytest.mark.timeout(200)
def test_corrupt_checkpoint_is_refused(tmp_path, finished_checkpoint):
    broken = tmp_path / "broken" / "step_00000002"
    broken.parent.mkdir()
    import shutil

    shutil.copytree(finished_checkpoint, broken)
    data = next(p for p in broken.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:1000])
    _fails_before_process_group(tmp_path, [f"checkpoint.resume={broken}"], "has 1000 bytes")
    meta = json.loads((broken / "meshtron.json").read_text())
    (broken / "meshtron.json").unlink()
    _fails_before_process_group(tmp_path, [f"checkpoint.resume={broken}"], "not a complete meshtron checkpoint")
    assert meta["train_state"]["step"] == 2


@pytest.mark.timeout(100)
def test_checkpoint_config_errors(tmp_path):
    _fails_before_process_group(tmp_path, ["checkpoint.every=5"], "checkpoint.every=5 needs checkpoint.dir")
    _fails_before_process_group(tmp_path, ["checkpoint.resume=auto"], "checkpoint.resume=auto needs checkpoint.dir")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_checkpoint_of_a_tp2_run_resumes_in_one_process(tmp_path):
    """Saved by torchrun tp=2 x pp=2 (4 ranks), resumed by a single process: steps 3 and 4 log the
    losses of the uninterrupted 4-rank run (resharding on load; data position and schedule carried)."""
    from tests.test_train_cli import TORCHRUN

    ckpt = tmp_path / "ckpt"
    common = [*COMMON, "trainer.max_steps=4", "trainer.micro_batch_size=4"]
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=4",
            "train.py",
            *common,
            "parallel.tp=2",
            "parallel.pp=2",
            f"checkpoint.dir={ckpt}",
            "checkpoint.every=2",
            "checkpoint.keep=null",
            f"hydra.run.dir={tmp_path / 'parallel'}",
        ],
        timeout=300,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    want = _losses(tmp_path / "parallel")
    out = run(
        [
            sys.executable,
            "train.py",
            *common,
            f"checkpoint.resume={ckpt / 'step_00000002'}",
            f"hydra.run.dir={tmp_path / 'serial'}",
        ],
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = _losses(tmp_path / "serial")
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-5 * want[step], (step, got, want)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_sigterm_to_torchrun_saves_on_every_rank(tmp_path, background):
    """torchrun forwards SIGTERM to its workers; they agree on the step, save one complete
    checkpoint (both ranks' files) and stop (torchrun itself then reports the signal). With
    checkpoint.async=true (and a save every 2 steps, written while training goes on) the stop
    waits for the save in flight, then writes the last one."""
    from meshtron.training.checkpoint_files import list_checkpoints, read_meta
    from tests.test_train_cli import TORCHRUN

    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    args = [
        *TORCHRUN,
        "--nproc_per_node=2",
        "train.py",
        *COMMON,
        "trainer.max_steps=5000",
        "parallel.tp=2",
        f"checkpoint.dir={ckpt}",
        f"hydra.run.dir={run_dir}",
        *(["checkpoint.async=true", "checkpoint.every=2"] if background else []),
    ]
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)  # to the torchrun agent only
    stdout, stderr = proc.communicate(timeout=120)
    step = max(r["step"] for r in metrics(run_dir))
    assert step < 5000 and f"SIGTERM: stopped after step {step}" in stdout, (stdout[-2000:], stderr[-2000:])
    saved = list_checkpoints(ckpt)
    assert saved[-1] == ckpt / f"step_{step:08d}" and (background or len(saved) == 1), saved
    assert not any(p.name.startswith(".tmp-") for p in ckpt.iterdir())
    meta = read_meta(ckpt / f"step_{step:08d}")
    assert meta["train_state"]["step"] == step and meta["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])
