"""Resume guards on the all-reduce path (issue 41, "nothing lost, nothing silently wrong"):
a truncated newest checkpoint is skipped with a warning naming the file under
checkpoint.resume=auto and under checkpoint.resume=DIR (a folder of step_N folders), and
refused naming the file as an explicit step_N; none intact is an error; a checkpoint saved for another model with the
same tensor shapes (4 vs 8 heads at hidden 64) is refused in one line naming the fields
before any process group; a lock held by another user's live process (kill(pid, 0) raises
PermissionError) is refused, not taken over."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from meshtron.training.checkpoint import LOCK_FILE, hold_checkpoint_dir
from meshtron.training.checkpoint_files import CheckpointError, check_checkpoint_crcs, resolve_resume
from tests.test_checkpoint import _dead_pid
from tests.test_checkpoint_faults_cli import SHORT, _one_error_line, _train
from tests.test_resume_cli import COMMON, _losses
from tests.test_train_cli import run

OLDER, NEWEST = "step_00000002", "step_00000004"


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """Checkpoints of steps 2 and 4 of a 4-step run (SHORT) and that run's losses."""
    ckpt, run_dir = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("run")
    out = _train(ckpt, run_dir, "checkpoint.every=2", "checkpoint.keep=null")
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == [OLDER, NEWEST]
    return ckpt, _losses(run_dir)


def _truncated_newest(two_checkpoints, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the checkpoint folder whose newest checkpoint has its shard cut to 1000 bytes."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints[0], ckpt)
    shard = ckpt / NEWEST / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    return ckpt, shard


@pytest.mark.timeout(200)
def test_truncated_newest_is_skipped_with_a_warning(tmp_path, two_checkpoints):
    ckpt, shard = _truncated_newest(two_checkpoints, tmp_path)
    out = _train(ckpt, tmp_path / "run", "checkpoint.resume=auto")
    assert out.returncode == 0, out.stderr[-3000:]
    warning = [line for line in out.stderr.splitlines() if line.startswith("meshtron: warning: skipping checkpoint")]
    assert warning == [
        f"meshtron: warning: skipping checkpoint {ckpt / NEWEST}: checkpoint file {shard} has 1000 bytes, "
        f"{two_checkpoints[0].joinpath(NEWEST, shard.name).stat().st_size} were written (truncated or modified); "
        "the checkpoint is corrupt, use another"
    ], out.stderr[-3000:]
    assert f"meshtron: warning: resuming from the previous checkpoint {ckpt / OLDER}" in out.stderr
    assert f"resumed from {ckpt / OLDER} at step 2" in out.stdout, out.stdout[-2000:]
    resumed, uninterrupted = _losses(tmp_path / "run"), two_checkpoints[1]
    assert sorted(resumed) == [3, 4] and all(resumed[s] == uninterrupted[s] for s in resumed), (resumed, uninterrupted)
    check_checkpoint_crcs(ckpt / NEWEST)  # saved again over the truncated one


def test_resume_naming_the_folder_is_auto_there_and_a_step_must_be_intact(tmp_path, two_checkpoints, capsys):
    """In process (the same resolve_resume train.py runs before any process group):
    checkpoint.resume=DIR, a folder of step_N folders, takes its newest intact one with
    auto's warning; checkpoint.resume=DIR/step_N must be intact; none intact is an error, not
    a fresh start."""
    ckpt, shard = _truncated_newest(two_checkpoints, tmp_path)
    assert resolve_resume(None, str(ckpt)) == ckpt / OLDER
    err = capsys.readouterr().err
    assert f"meshtron: warning: skipping checkpoint {ckpt / NEWEST}: checkpoint file {shard} has 1000 bytes" in err
    assert f"meshtron: warning: resuming from the previous checkpoint {ckpt / OLDER}" in err
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {shard} has 1000 bytes, \d+ were written"):
        resolve_resume(None, str(ckpt / NEWEST))
    (ckpt / OLDER / "meshtron.json").unlink()
    for resume in ("auto", str(ckpt)):
        with pytest.raises(
            CheckpointError, match=rf"^no intact checkpoint in {ckpt} \(newest: checkpoint file {shard} has 1000 bytes"
        ):
            resolve_resume(str(ckpt), resume)


@pytest.mark.timeout(100)
def test_same_shapes_other_heads_is_refused_before_any_process_group(tmp_path, two_checkpoints):
    """hidden 64 as 8 heads instead of 4: every tensor has the checkpoint's shape. Launched as
    rank 0 of 2 with no peer and an unreachable master: reaching a process group would hang."""
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    newest = two_checkpoints[0] / NEWEST
    args = [sys.executable, "train.py", *COMMON, "model.num_heads=8", f"checkpoint.resume={newest}"]
    out = run([*args, f"hydra.run.dir={tmp_path}"], timeout=80, env=env)
    line = _one_error_line(out, "configuration")
    assert (
        f"checkpoint.resume: checkpoint {newest} was saved with model.num_heads=4 model.num_kv_heads=4 but this "
        f"run configures model.num_heads=8 model.num_kv_heads=8: same tensor shapes, another model; resume with "
        f"model.num_heads=4 model.num_kv_heads=4" in line
    ), line


@pytest.mark.timeout(100)
def test_fields_a_resume_may_change_and_may_not(tmp_path, two_checkpoints):
    """In process: dropout may change on resume; rope_theta (same shapes) may not, but may
    under checkpoint.init_from; the head split may change under neither."""
    from meshtron.models.config import GPTConfig
    from meshtron.training.checkpoint import check_compatible

    newest = two_checkpoints[0] / NEWEST
    saved = json.loads((newest / "meshtron.json").read_text())["model"]
    base = {k: saved[k] for k in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size")}
    check_compatible(newest, GPTConfig(**base, dropout=0.1))
    check_compatible(newest, GPTConfig(**base, rope_theta=5e5), resume=False)
    with pytest.raises(CheckpointError, match=r"saved with model.rope_theta=10000.0 but this run configures "):
        check_compatible(newest, GPTConfig(**base, rope_theta=5e5))
    with pytest.raises(CheckpointError, match=r"checkpoint.init_from needs num_heads, num_kv_heads"):
        check_compatible(newest, GPTConfig(**{**base, "num_heads": 8}), resume=False)


def _proc_start(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


@pytest.mark.parametrize("holder", ["live", "unknown start"])
def test_lock_of_another_users_process_is_refused(tmp_path, monkeypatch, capsys, holder):
    """kill(pid, 0) on another user's process raises PermissionError: the process is alive,
    whether its start time matches the lock's ("live", the parent of this process) or cannot
    be told ("unknown start": no /proc entry to compare)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    pid = os.getppid() if holder == "live" else _dead_pid()
    record = {
        "pid": pid,
        "pid_start": _proc_start(pid) if holder == "live" else None,
        "host": socket.gethostname(),
        "started": "2020-01-01 00:00:00 +0000",
    }
    (root / LOCK_FILE).write_text(json.dumps(record))

    def kill(target, sig):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(os, "kill", kill)
    with pytest.raises(CheckpointError) as refused:
        with hold_checkpoint_dir(root):
            pass
    assert str(refused.value) == (
        f"checkpoint.dir {root} is in use by another run (pid {pid} on host {socket.gethostname()} since "
        f"2020-01-01 00:00:00 +0000); give this run another checkpoint.dir or stop that one"
    )
    assert json.loads((root / LOCK_FILE).read_text()) == record
    assert sorted(p.name for p in root.iterdir()) == [LOCK_FILE]
    assert "stale lock" not in capsys.readouterr().err


def test_resume_naming_a_folder_with_no_checkpoint_says_so(tmp_path):
    """checkpoint.resume=FOLDER where FOLDER holds neither meshtron.json nor step_N folders:
    the line says what the folder is not and what to point at (not 'the save did not finish')."""

    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"neither a checkpoint \(no meshtron.json\) nor a folder of step_N"):
        resolve_resume(None, str(tmp_path))


def test_resuming_weights_only_points_at_init_from_even_for_a_changed_model(tmp_path, two_checkpoints):
    """A weights-only checkpoint given to checkpoint.resume, by a run whose model differs too: the
    line is the weights-only one (start with init_from), not the model mismatch, which a resume
    would refuse but init_from may allow."""
    from meshtron.errors import ConfigError
    from meshtron.training.cli import compose_run
    from meshtron.training.run_checks import checkpoint_to_start_from

    weights = tmp_path / "step_00000004"
    shutil.copytree(two_checkpoints[0] / NEWEST, weights)
    meta = json.loads((weights / "meshtron.json").read_text())
    (weights / "meshtron.json").write_text(json.dumps({**meta, "weights_only": True}))
    run = compose_run([*SHORT, f"checkpoint.resume={weights}", "model.num_heads=8"])
    with pytest.raises(ConfigError, match=r"holds weights only .* checkpoint.init_from="):
        checkpoint_to_start_from(run)
