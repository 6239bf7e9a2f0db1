"""Tests for observability/memory.py: peak memory of this process and of every rank."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from meshtron.observability.memory import format_bytes, peak_memory_bytes, peak_memory_per_rank

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_cpu_peak_is_rss_in_bytes_and_grows():
    before = peak_memory_bytes("cpu")
    # The test process holds torch: well over 10 MiB of resident memory, in bytes (not KiB).
    assert before > 10 * 2**20
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    block += 1
    after = peak_memory_bytes(torch.device("cpu"))
    assert after >= before
    assert after >= 64 * 2**20
    del block


def test_per_rank_without_process_group_is_own():
    assert not torch.distributed.is_initialized()
    (own,) = peak_memory_per_rank("cpu")
    assert abs(own - peak_memory_bytes("cpu")) < 2**20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_is_max_allocated():
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.empty(2**20, device=device)
    assert peak_memory_bytes(device) == torch.cuda.max_memory_allocated(device) >= x.numel() * 4


def test_format_bytes():
    assert format_bytes(None) == "n/a"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"
    assert format_bytes(123.4 * 2**20) == "123 MiB"


_WORKER = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from meshtron.observability.memory import peak_memory_bytes, peak_memory_per_rank
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))
if rank == 1:  # rank 1 touches 384 MiB more than rank 0
    block = torch.ones(384 * 2**20 // 4); block += 1
before = peak_memory_bytes("cpu")
gathered = peak_memory_per_rank("cpu")
print(json.dumps({"rank": rank, "gathered": gathered, "before": before, "own": peak_memory_bytes("cpu")}))
dist.destroy_process_group()
"""


@pytest.mark.timeout(60)
def test_per_rank_all_gathers_over_gloo(tmp_path: pathlib.Path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "store")],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=50)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    g0, g1 = results[0]["gathered"], results[1]["gathered"]
    assert g0 == g1 and len(g0) == 2
    for r in results:  # entry r is rank r's own peak, read between its two local readings
        assert r["before"] <= g0[r["rank"]] <= r["own"]
    # Rank 1's peak includes its 384 MiB block (peaks of whole processes differ by more than
    # that block alone, so only this lower bound is stable).
    assert g0[1] >= 384 * 2**20
