"""Multi-node rendezvous on one host: two torchrun agents (`--nnodes=2`, c10d rendezvous on
127.0.0.1) form one job of train.py; it logs one process's losses and rank 0 prints where
the mesh's groups lie over the two nodes (and warns when a tp group spans them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.test_dead_peer import free_port

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.progress=false",
    "model.num_layers=2",
    "model.seq_len=64",
    "trainer.global_batch_size=8",
]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def two_agents(args: list[str], timeout: float, nproc: tuple[int, int] = (1, 1)) -> list[subprocess.CompletedProcess]:
    """Run `train.py args` under two torchrun agents on this host forming one 2-node job
    (`nproc` ranks on each); returns both agents' results. c10d, not start order (and not
    --node_rank, which it ignores), decides which agent is node 0 and runs rank 0."""
    port, job = free_port(), f"meshtron-test-{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--nproc_per_node={n}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id={job}",
                "train.py",
                *args,
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in nproc
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results


@pytest.fixture(scope="module")
def serial_losses(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("serial")
    out = subprocess.run(
        [sys.executable, "train.py", *COMMON, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return metrics(run_dir)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_agents_dp2_give_the_single_process_losses(tmp_path, serial_losses):
    results = two_agents([*COMMON, f"hydra.run.dir={tmp_path}"], timeout=240)
    for out in results:
        assert out.returncode == 0, out.stderr[-3000:]
    got = metrics(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, serial_losses):
        assert abs(g["loss"] - w["loss"]) <= 1e-6 * abs(w["loss"]), (g, w)
    stdout = results[0].stdout + results[1].stdout  # whichever agent c10d made node 0 runs rank 0
    describe = [line for line in stdout.splitlines() if "placement" in line]
    assert len(describe) == 1 and describe[0].endswith(
        "placement 2 nodes x 1 rank: tp=1 dp=2 (spans 2 nodes) pp=1 | edp=2 (spans 2 nodes) ep=1 etp=1"
    ), describe
    assert "warning: parallel." not in stdout


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_agents_tp2_warn_that_tp_spans_nodes(tmp_path, serial_losses):
    results = two_agents([*COMMON, "parallel.tp=2", f"hydra.run.dir={tmp_path}"], timeout=240)
    for out in results:
        assert out.returncode == 0, out.stderr[-3000:]
    stdout = results[0].stdout + results[1].stdout
    warnings = [line for line in stdout.splitlines() if "warning: parallel." in line]  # once, by rank 0
    assert warnings == [
        "meshtron: warning: parallel.tp=2 spans 2 nodes of 1 rank: TP all-reduces cross the "
        "inter-node link; use tp <= 1"
    ], stdout[-3000:]
    assert "tp=2 (spans 2 nodes)" in stdout
    for g, w in zip(metrics(tmp_path), serial_losses):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (g, w)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_nodes_with_different_rank_counts_fail_with_one_line(tmp_path):
    """--nproc_per_node=2 on one agent and 1 on the other: every rank stops after the one
    startup all-gather with the same line, instead of placing ranks on the wrong nodes."""
    results = two_agents(
        [
            "trainer.max_steps=1",
            "trainer.global_batch_size=6",
            "model.num_layers=1",
            "trainer.progress=false",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=150,
        nproc=(2, 1),
    )
    for out in results:
        assert out.returncode != 0
    # counted in the text, not per line: the ranks of one agent share its stderr pipe
    message = (
        "meshtron: configuration error: nodes run different numbers of ranks (node 0: 2, node 1: 1); "
        "meshtron places ranks by node = rank // LOCAL_WORLD_SIZE: start every node with the same "
        "--nproc_per_node"
    )
    assert sum(out.stderr.count(message) for out in results) == 3, results[0].stderr[-3000:] + results[1].stderr[-3000:]
