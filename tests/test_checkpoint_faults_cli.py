"""train.py when checkpoints meet faults (issue 14, "nothing saved is lost"): a corrupt shard is
named (exit 2) or, under resume=auto, skipped for the previous checkpoint with the uninterrupted
run's losses; a second run on a checkpoint.dir in use is refused in one line; a stale lock is
taken over; an unusable checkpoint.dir fails before the first step; a save cut short by a
file-size limit names the file and the cause and leaves the previous checkpoint loadable."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.training.checkpoint import LOCK_FILE
from meshtron.training.checkpoint_files import check_checkpoint_crcs, list_checkpoints
from tests.test_checkpoint import _corrupt, _dead_pid
from tests.test_resume_cli import COMMON, _losses, _start, _wait_for
from tests.test_train_cli import TORCHRUN, metrics, run

SHORT = [*COMMON, "trainer.max_steps=4"]


def _train(ckpt: Path, run_dir: Path, *extra: str, shell_prefix: str = "") -> subprocess.CompletedProcess:
    """train.py with SHORT and checkpoint.dir=ckpt; `shell_prefix` runs it under bash after
    that command (e.g. a ulimit)."""
    args = [sys.executable, "train.py", *SHORT, f"checkpoint.dir={ckpt}", *extra, f"hydra.run.dir={run_dir}"]
    if shell_prefix:
        args = ["bash", "-c", f"{shell_prefix}; exec {shlex.join(args)}"]
    return run(args, timeout=200)


def _one_error_line(out: subprocess.CompletedProcess, kind: str) -> str:
    """The single `meshtron: <kind> error: ...` line of a run that exited with status 2."""
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith(f"meshtron: {kind} error")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


def _no_step_ran(run_dir: Path) -> None:
    assert not (run_dir / "metrics.jsonl").exists() or metrics(run_dir) == []


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """Checkpoints of steps 2 and 4 of a 4-step run and that run's losses."""
    ckpt, run_dir = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("run")
    out = _train(ckpt, run_dir, "checkpoint.every=2", "checkpoint.keep=null")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_00000002", "step_00000004"]
    assert not (ckpt / LOCK_FILE).exists()
    return ckpt, _losses(run_dir)


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    return copy


@pytest.mark.timeout(300)
def test_corrupt_shard_is_named(tmp_path, saved_run):
    ckpt = _copy(saved_run[0], tmp_path)
    shard = ckpt / "step_00000004" / "__0_0.distcp"
    size = shard.stat().st_size
    _corrupt(shard)  # 64 KiB of random bytes, size unchanged
    assert shard.stat().st_size == size
    out = _train(ckpt, tmp_path / "run", f"checkpoint.resume={ckpt / 'step_00000004'}")
    line = _one_error_line(out, "checkpoint")  # found by the rank reading it, as it loads
    assert f"checkpoint file {shard} is corrupt: its CRC32 is" in line, line
    _no_step_ran(tmp_path / "run")


@pytest.mark.timeout(300)
def test_resume_auto_skips_a_corrupt_newest(tmp_path, saved_run):
    ckpt = _copy(saved_run[0], tmp_path)
    shard = ckpt / "step_00000004" / "__0_0.distcp"
    _corrupt(shard)
    out = _train(ckpt, tmp_path / "run", "checkpoint.resume=auto", "checkpoint.every=1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        f"meshtron: warning: skipping checkpoint {ckpt / 'step_00000004'}: checkpoint file {shard} is corrupt"
        in out.stderr
    ), out.stderr[-3000:]
    assert f"resumed from {ckpt / 'step_00000002'} at step 2" in out.stdout
    resumed, uninterrupted = _losses(tmp_path / "run"), saved_run[1]
    assert sorted(resumed) == [3, 4] and all(resumed[s] == uninterrupted[s] for s in resumed), (resumed, uninterrupted)
    check_checkpoint_crcs(ckpt / "step_00000004")  # saved again over the corrupt one


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_torchrun_resume_auto_falls_back_when_one_rank_finds_its_shard_corrupt(tmp_path):
    """tp=2, rank 1's shard file of step 4 corrupted: the ranks that read it find it as their
    load begins (each rank verifies only the files it loads: tests/distributed/checkpoint_cases.py
    each_rank_verifies_only_the_files_it_loads); both ranks skip step 4 together (DCP gathers
    the failure), resume from step 2 and log the uninterrupted run's losses for steps 3 and 4."""
    ckpt = tmp_path / "ckpt"
    common = [*SHORT, "parallel.tp=2", f"checkpoint.dir={ckpt}"]
    first = run(
        [*TORCHRUN, "--nproc_per_node=2", "train.py", *common, "checkpoint.every=2", f"hydra.run.dir={tmp_path / 'a'}"],
        timeout=200,
        threads=1,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    shard = ckpt / "step_00000004" / "__1_0.distcp"
    _corrupt(shard)
    resumed_dir = tmp_path / "b"
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            "train.py",
            *common,
            "checkpoint.resume=auto",
            f"hydra.run.dir={resumed_dir}",
        ],
        timeout=200,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    warning = f"meshtron: warning: skipping checkpoint {ckpt / 'step_00000004'}: checkpoint file {shard} is corrupt"
    assert out.stderr.count(warning) == 1 and "(found by rank " in out.stderr, out.stderr[-3000:]
    assert f"resumed from {ckpt / 'step_00000002'} at step 2" in out.stdout, out.stdout[-2000:]
    resumed, uninterrupted = _losses(resumed_dir), _losses(tmp_path / "a")
    assert sorted(resumed) == [3, 4] and all(abs(resumed[s] - uninterrupted[s]) <= 1e-6 for s in resumed), (
        resumed,
        uninterrupted,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_second_run_on_a_dir_in_use_is_refused(tmp_path):
    """(checkpoint.keep=null in the first run: with keep=3 its rotation can remove the newest
    checkpoint between the second run's listing and its check of it, and the second run then
    stops on that instead of the lock; seen once in CI. That race is the product's: a run
    started beside a rotating one may stop on a vanished checkpoint before it reaches the lock.)"""
    ckpt, first_dir = tmp_path / "ckpt", tmp_path / "first"
    first = _start(ckpt, first_dir, "trainer.max_steps=5000", "checkpoint.every=2", "checkpoint.keep=null")
    try:
        _wait_for(lambda: (ckpt / "step_00000002" / "meshtron.json").exists(), first)
        out = _train(ckpt, tmp_path / "second", "checkpoint.resume=auto")
        line = _one_error_line(out, "checkpoint")
        assert (
            f"checkpoint.dir {ckpt} is in use by another run (pid {first.pid} on host {socket.gethostname()}" in line
        ), line
        _no_step_ran(tmp_path / "second")
    finally:
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0 and "SIGTERM: stopped after step" in stdout, stderr[-3000:]
    saved = list_checkpoints(ckpt)
    assert saved and all(check_checkpoint_crcs(path) for path in saved)
    assert not (ckpt / LOCK_FILE).exists()


@pytest.mark.timeout(200)
def test_stale_lock_is_taken_over(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    pid = _dead_pid()
    (ckpt / LOCK_FILE).write_text(
        json.dumps(
            {"pid": pid, "pid_start": None, "host": socket.gethostname(), "started": "2020-01-01 00:00:00 +0000"}
        )
    )
    out = _train(ckpt, tmp_path / "run", "trainer.max_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"meshtron: warning: taking over the stale lock {ckpt / LOCK_FILE} of pid {pid}" in out.stderr
    assert [p.name for p in ckpt.iterdir()] == ["step_00000002"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["file", "under_a_file", "read_only"])
def test_unusable_checkpoint_dir_fails_before_training(tmp_path, kind):
    target = tmp_path / "target"
    if kind == "read_only":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders (tests/test_checkpoint.py simulates EACCES)")
        target.mkdir(mode=0o555)
        want = f"checkpoint.dir {target} is not writable: {target / LOCK_FILE}: Permission denied"
    else:
        target.write_text("not a folder")
        if kind == "under_a_file":
            target = target / "ckpt"
            want = f"checkpoint.dir {target} cannot be created: "
        else:
            want = f"checkpoint.dir {target} is a file, not a directory"
    out = _train(target, tmp_path / "run")
    line = _one_error_line(out, "checkpoint")
    assert want in line, line
    _no_step_ran(tmp_path / "run")


@pytest.mark.timeout(300)
def test_save_cut_by_a_file_size_limit_keeps_the_previous(tmp_path, saved_run):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run[0] / "step_00000002", ckpt / "step_00000002")
    shard_bytes = (ckpt / "step_00000002" / "__0_0.distcp").stat().st_size
    limit_kib = shard_bytes // 2048  # half a shard: the logs and metrics fit, the next shard does not
    out = _train(ckpt, tmp_path / "limited", "checkpoint.resume=auto", shell_prefix=f"ulimit -f {limit_kib}")
    line = _one_error_line(out, "checkpoint")
    assert (
        f"could not save the checkpoint of step 4 (earlier checkpoints are intact): rank 0: "
        f"{ckpt / '.tmp-step_00000004' / '__0_0.distcp'}: File too large"
    ) in line, line
    assert sorted(_losses(tmp_path / "limited")) == [3, 4]
    assert [p.name for p in ckpt.iterdir()] == ["step_00000002"]  # no partial folder, no lock left
    check_checkpoint_crcs(ckpt / "step_00000002")
    out = _train(ckpt, tmp_path / "resumed", "checkpoint.resume=auto", "trainer.max_steps=3")
    assert out.returncode == 0 and f"resumed from {ckpt / 'step_00000002'} at step 2" in out.stdout, out.stderr[-3000:]
