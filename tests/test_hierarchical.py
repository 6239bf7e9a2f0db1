"""Hierarchical all-reduce of the dp gradient buckets (dp/hierarchical.py,
parallel.dp_hierarchical): when it is selected, its groups, equality with the flat all-reduce
(tests/distributed/local_sgd_cases.py: hierarchical_equals_flat, 4 ranks as 2 nodes of 2), and
the bytes crossing nodes counted by bench/hierarchical_allreduce.py in a two-agent localhost
torchrun run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from meshtron.dp.hierarchical import hierarchy_shape, replica_rank_lists, resolve_hierarchical, split_by_node
from meshtron.mpu.mesh import ParallelConfig, ParallelConfigError
from meshtron.training.config import ConfigError, RunConfig
from meshtron.training.run_checks import check_run_config
from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params
from tests.test_dead_peer import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "world_size,case",
    [(w, c) for w, c in params("tests.distributed.local_sgd_cases") if c.split(":")[1].startswith("hierarchical")],
)
def test_hierarchical_cases(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)


def test_groups_of_a_layout():
    par = ParallelConfig(tp=2).resolved(8)  # dp=4 groups {0,2,4,6}, {1,3,5,7}
    assert replica_rank_lists(par, 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert split_by_node([0, 2, 4, 6], 4) == [[0, 2], [4, 6]]
    assert hierarchy_shape(par, 8, 4) == (2, 2)
    assert hierarchy_shape(par, 8, 2) == (4, 1)  # one rank of each dp group per node
    assert hierarchy_shape(ParallelConfig().resolved(3), 3, 2) is None  # nodes of 2 and 1 ranks


@pytest.mark.parametrize(
    "mode, world, rpn, shard, want",
    [
        ("auto", 8, 4, False, True),  # dp spans 2 nodes, 4 ranks on each
        ("auto", 8, 8, False, False),  # one node
        ("auto", 8, 1, False, False),  # one rank per node: the flat all-reduce already is the inter-node one
        ("auto", 8, 4, True, False),  # ZeRO-2/3 reduce-scatter: stays flat
        (False, 8, 4, False, False),
        (True, 8, 8, False, True),  # forced, even on one node
    ],
)
def test_when_hierarchical_is_selected(mode, world, rpn, shard, want):
    assert resolve_hierarchical(mode, ParallelConfig().resolved(world), world, rpn, shard_grads=shard) is want


def test_forced_hierarchical_refuses_what_it_cannot_do():
    with pytest.raises(ParallelConfigError, match="optim.zero 0 or 1"):
        resolve_hierarchical(True, ParallelConfig().resolved(8), 8, 4, shard_grads=True)
    with pytest.raises(ParallelConfigError, match="same number of ranks on each node"):
        resolve_hierarchical(True, ParallelConfig().resolved(3), 3, 2)
    with pytest.raises(ConfigError, match="parallel.dp_hierarchical=true is built for all-reduced"):
        RunConfig.from_dict({"parallel": {"dp_hierarchical": True}, "optim": {"zero": 2}})
    with pytest.raises(ConfigError, match="parallel.dp_hierarchical='yes' must be"):
        RunConfig.from_dict({"parallel": {"dp_hierarchical": "yes"}})
    run = RunConfig.from_dict({"parallel": {"dp_hierarchical": True}, "trainer": {"global_batch_size": 6}})
    with pytest.raises(ConfigError, match="same number of ranks on each node"):
        check_run_config(run, 3, ranks_per_node=2)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_agent_bench_counts_the_inter_node_bytes_of_the_formulas():
    """Two torchrun agents of 2 ranks each (2 nodes, node = rank // LOCAL_WORLD_SIZE): the flat
    ring sends 2(n-1)/n x B across nodes from each node's last rank, the hierarchical one
    2(N-1)/N x B/L from every rank (3x less at the busiest rank, 1.5x less in total), with the
    same reduced gradients."""
    port, job = free_port(), f"meshtron-hier-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=2",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id={job}",
                "bench/hierarchical_allreduce.py",
                "--steps",
                "1",
                "--hidden",
                "64",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    report = json.loads("".join(outs))  # rank 0 runs on whichever agent c10d made node 0
    b, f = report["bucket_bytes_per_step"], report["formula"]
    assert (report["nodes"], report["ranks_per_node"]) == (2, 2) and b > 0
    assert f["flat_per_boundary_rank"] == 2 * 3 / 4 * b and f["hierarchical_per_rank"] == 2 * 1 / 2 * b / 2
    assert report["flat"]["inter_node_bytes_per_rank"] == [0.0, f["flat_per_boundary_rank"]] * 2
    assert report["hierarchical"]["inter_node_bytes_per_rank"] == [f["hierarchical_per_rank"]] * 4
    assert report["flat"]["total"] == 1.5 * report["hierarchical"]["total"]
    assert report["max_rel_diff_of_reduced_gradients"] < 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_agent_training_selects_it_and_gives_the_single_process_losses(tmp_path):
    """train.py under two agents of 2 ranks (dp=4 over 2 nodes): parallel.dp_hierarchical=auto
    turns the hierarchical all-reduce on (rank 0 says so) and the losses are one process's."""
    common = [
        "trainer.max_steps=2",
        "trainer.log_every=1",
        "trainer.progress=false",
        "model.num_layers=1",
        "model.seq_len=32",
        "trainer.global_batch_size=8",
        "trainer.eval_every=0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    serial = subprocess.run(
        [sys.executable, "train.py", *common, f"hydra.run.dir={tmp_path / 'serial'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert serial.returncode == 0, serial.stderr[-3000:]
    port, job = free_port(), f"meshtron-hier-{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=2",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                f"--rdzv_id={job}",
                "train.py",
                *common,
                f"hydra.run.dir={tmp_path / 'hier'}",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    stdout = ""
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
            stdout += out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert "meshtron: hierarchical dp all-reduce: 2 nodes x 2 ranks (parallel.dp_hierarchical=auto)" in stdout

    def losses(run_dir: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    want, got = losses(tmp_path / "serial"), losses(tmp_path / "hier")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-6 * abs(w), (got, want)
