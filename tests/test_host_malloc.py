"""training/host_malloc.py: with keep_freed_host_memory a repeated step (a 32 MiB logits
matmul, log-softmax and backward) reuses the pages freed by the previous one; with the
opt-out (MESHTRON_SYSTEM_MALLOC=1) glibc maps and faults in fresh pages every step. Each side
runs in a fresh interpreter and counts minor page faults over the last 5 of 10 steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import resource, torch
from meshtron.training.host_malloc import keep_freed_host_memory
applied = keep_freed_host_memory()
torch.set_num_threads(2)
x, w = torch.randn(1024, 256), torch.randn(8192, 256, requires_grad=True)
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.log_softmax(x @ w.t(), -1).sum().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sum(faults[5:]))
"""


def steady_state_faults(system_malloc: str) -> tuple[bool, int]:
    env = {**os.environ, "MESHTRON_SYSTEM_MALLOC": system_malloc, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_pages_are_reused_across_steps():
    kept, kept_faults = steady_state_faults("0")
    system, system_faults = steady_state_faults("1")
    assert kept and not system
    # 5 steps x (32 MiB logits + their gradient) / 4 KiB pages: ~160,000 faults without reuse
    assert system_faults > 100_000, system_faults
    assert kept_faults < system_faults / 4, (kept_faults, system_faults)
