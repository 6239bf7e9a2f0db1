"""Elastic restarts (hooks: training/fault_hooks.py).

`torchrun --max-restarts=1` with `checkpoint.resume=auto` survives a SIGKILLed rank: the hook
MESHTRON_TEST_KILL_AT_STEP=1:4 kills rank 1 as step 4 begins (after the checkpoint of step 3;
only in the first attempt, TORCHELASTIC_RESTART_COUNT=0); rank 0 fails its collective within
seconds naming rank 1 (tests/test_dead_peer.py), torchrun restarts both ranks, resume=auto
picks step 3, and the job finishes (exit 0) with the losses of an uninterrupted run, bit for
bit (metrics.jsonl holds both attempts' records).

With `--nnodes=1:2` the job survives the loss of a whole node (two agents on this host, the
hook's `node:4` form): the other agent restarts alone at the smaller world.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_dead_peer import ROOT, TINY, TORCHRUN, Streamed, free_port, torchrun_env

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


def _agent(port: int, is_host: bool, args: list[str], **env: str) -> subprocess.Popen:
    """One torchrun agent ("node") of 2 ranks in an elastic job of 1 to 2 nodes on this host,
    rendezvousing through `port` (the host agent serves the store). A node that vanishes is
    declared dead after 2 s of missed keep-alives; a round closes 10 s after its first node
    (time for the other agent to start and join under a loaded host)."""
    rdzv = [
        "--nnodes=1:2",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
        "--rdzv-id=meshtron-elastic-test",
        f"--rdzv-conf=is_host={str(is_host).lower()},last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=2",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", *rdzv, "train.py", *args]
    return subprocess.Popen(
        command, cwd=ROOT, env=torchrun_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_lost_node_restarts_at_the_smaller_world_with_the_same_global_batch(tmp_path, uninterrupted):
    """Two agents of 2 ranks each (world 4, dp 4); the second node's agent and its local rank 0
    are SIGKILLed as step 4 begins. The surviving agent restarts alone: world 2, dp 2 with the
    global batch of 8 made of 4 microbatches per rank instead of 2, resumed from step 3 (the
    checkpoints are layout-free), and finishes. Every step's loss equals the uninterrupted world-2
    run's within float summation order (dp 4 and its two-level all-reduce vs dp 2)."""
    ckpt, run_dir, port = tmp_path / "ckpt", tmp_path / "run", free_port()
    args = [
        *TINY,
        f"trainer.max_steps={STEPS}",
        "trainer.collective_timeout_s=60",
        f"checkpoint.dir={ckpt}",
        "checkpoint.every=1",
        "checkpoint.resume=auto",
        f"hydra.run.dir={run_dir}",
    ]
    lost = _agent(port, False, args, MESHTRON_TEST_KILL_AT_STEP="node:4")  # a client: waits for the store
    survivor = _agent(port, True, args)
    try:
        out, err = survivor.communicate(timeout=170)
    finally:
        for agent in (lost, survivor):
            if agent.poll() is None:
                agent.kill()
        lost_out, _ = lost.communicate(timeout=60)  # EOF once its orphaned rank has failed too
    assert survivor.returncode == 0, err[-3000:]
    assert lost.returncode == -9, lost.returncode
    first, restart = out.split(f"meshtron: resumed from {ckpt / 'step_00000003'} at step 3")
    first += lost_out  # global rank 0 of the first attempt was on either node
    assert "meshtron: rank 0/4:" in first and "global batch 8 = dp 4 x 1 microbatches x 2" in first, first[-3000:]
    assert "meshtron: rank 0/2:" in restart and "global batch 8 = dp 2 x 1 microbatches x 4" in restart, restart
    assert "meshtron: done;" in restart
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    for step, loss in losses.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), (step, losses, uninterrupted)
