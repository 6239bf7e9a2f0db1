"""bench/gpu_ab.sh, the one-call A/B of two meshtron versions on a lent GPU machine, rehearsed
on the CPU: `prepare` puts a commit's tree beside the working tree, `run` runs each command in
both, alternating, and records which version answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_ab.sh"

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `run` is the real A/B"),
    pytest.mark.timeout(240),
]

# Which version's code answers: the experts module's file, and the base tree's marker.
WHICH = (
    'python3 -c "import json, os, meshtron.moe.experts as m; '
    "print(json.dumps({'file': m.__file__, 'base': os.path.exists('.ab_rev')}))\""
)


def ab(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(
        os.environ,
        OUT=str(tmp_path / "out"),
        GPU_AB_DIR=str(tmp_path / "ab"),
        GPU_SESSION_SITE=str(tmp_path / "site"),
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        **env,
    )
    full.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=230)


def test_usage_and_refusals(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: bench/gpu_ab.sh prepare REV | run" in proc.stderr
    assert "not a commit" in ab(tmp_path, "prepare", "no-such-rev").stderr
    proc = ab(tmp_path, "run", GPU_AB_COMMANDS="true")
    assert proc.returncode == 2 and "run 'bench/gpu_ab.sh prepare REV' first" in proc.stderr


def test_rehearsal_runs_each_command_in_both_trees_alternately(tmp_path):
    prepared = ab(tmp_path, "prepare", "HEAD")
    assert prepared.returncode == 0, prepared.stderr
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    proc = ab(tmp_path, "run", GPU_AB_COMMANDS=f"{WHICH}\nexit 3", GPU_AB_ROUNDS="2")
    out = tmp_path / "out"
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the `exit 3` runs failed
    runs = [json.loads(line) for line in (out / "ab.jsonl").read_text().splitlines()]
    assert [(r["round"], r["label"], r["exit"]) for r in runs] == [
        (1, "base", 0),
        (1, "head", 0),
        (1, "base", 3),
        (1, "head", 3),
        (2, "head", 0),
        (2, "base", 0),
        (2, "head", 3),
        (2, "base", 3),
    ]
    assert all(r["base_rev"] == head for r in runs)
    for r in runs[:2] + runs[4:6]:
        file = Path(r["result"]["file"])
        if r["label"] == "base":
            assert r["result"]["base"] and file.is_relative_to(tmp_path / "ab" / "base"), r
        else:
            assert not r["result"]["base"] and not file.is_relative_to(tmp_path / "ab"), r
    assert runs[2]["result"] is None  # no JSON printed
    assert "total" in (out / "log.txt").read_text()
