"""Elastic restarts: `torchrun --max-restarts=1` with `checkpoint.resume=auto` survives a
SIGKILLed rank. The test hook MESHTRON_TEST_KILL_AT_STEP=1:4 kills rank 1 as step 4 begins
(after the checkpoint of step 3; only in the first attempt, TORCHELASTIC_RESTART_COUNT=0);
rank 0 fails its collective within seconds naming rank 1 (tests/test_dead_peer.py), torchrun
restarts both ranks, resume=auto picks step 3, and the job finishes (exit 0) with the
losses of an uninterrupted run, bit for bit (metrics.jsonl holds both attempts' records)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_dead_peer import TINY, TORCHRUN, Streamed, torchrun_env

STEPS = 6


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def _torchrun(*args: str, **env: str) -> Streamed:
    return Streamed([*TORCHRUN, "--nproc_per_node=2", *args], torchrun_env(**env))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    job = _torchrun("train.py", *TINY, f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}")
    assert job.wait(timeout=100) == 0, job.stderr[-3000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_max_restarts_resumes_a_sigkilled_rank_with_the_uninterrupted_losses(tmp_path, uninterrupted):
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    job = _torchrun(
        "--max-restarts=1",
        "train.py",
        *TINY,
        f"trainer.max_steps={STEPS}",
        "trainer.collective_timeout_s=60",
        f"checkpoint.dir={ckpt}",
        "checkpoint.every=1",
        "checkpoint.keep=null",
        "checkpoint.resume=auto",
        f"hydra.run.dir={run_dir}",
        MESHTRON_TEST_KILL_AT_STEP="1:4",
    )
    rc = job.wait(timeout=130)
    err = job.stderr
    assert rc == 0, err[-3000:]
    # the first attempt: rank 1 killed before step 4, rank 0 names it and leaves on its own
    assert "rank 1 SIGKILLs itself before step 4" in err, err[-3000:]
    (failed,) = [line for line in err.splitlines() if " failed in collective " in line]
    assert failed.startswith("meshtron: rank 0 (tp=0, pp=0, dp=0)") and "peer rank 1 died" in failed, failed
    # the restart resumed from the newest complete checkpoint and finished
    assert f"resumed from {ckpt / 'step_00000003'} at step 3" in job.stdout, job.stdout[-3000:]
    assert "meshtron: done;" in job.stdout
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert saved == [f"step_{s:08d}" for s in range(1, STEPS + 1)], saved
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    assert losses == uninterrupted  # bit for bit, before and after the restart
    assert sys.executable  # (the same interpreter ran both jobs)
