"""Run many test cases inside one multi-process gloo world.

`run_world(world_size, cases)` starts `world_size` worker processes once (each with
OMP_NUM_THREADS=1), rendezvous through a temporary FileStore, runs every case
("package.module:function") in order on every rank, and returns per-case results. The whole world has a
wall-clock timeout and every collective a gloo timeout, so a hang fails in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_world(
    world_size: int, cases: list[str], timeout: float = 600.0, collective_timeout: float = 60.0, backend: str = "gloo"
) -> dict[str, dict]:
    """Return {case: {"ok": bool, "errors": {rank: traceback}}} after running all cases.
    `backend` "recorded_gloo": gloo groups that log every call (mpu/rehearsal_groups.py)."""
    with tempfile.TemporaryDirectory(prefix=f"meshtron-w{world_size}-") as tmp:
        store = os.path.join(tmp, "store")
        # TRITON_INTERPRET must be set before triton is first imported in a worker (some cases
        # run the Triton kernels on CPU), so it is set for the whole process, not per case.
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            TRITON_INTERPRET="1",
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        procs = []
        for rank in range(world_size):
            cmd = [
                sys.executable,
                "-m",
                "tests.distributed.worker",
                "--world-size",
                str(world_size),
                "--rank",
                str(rank),
                "--store",
                store,
                "--out",
                tmp,
                "--collective-timeout",
                str(collective_timeout),
                "--cases",
                ",".join(cases),
                "--backend",
                backend,
                "--dump-stacks-after",
                str(max(timeout - 20.0, 1.0)),
            ]
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        timed_out = False
        for proc, _ in procs:
            remaining = deadline - time.monotonic()
            try:
                proc.wait(timeout=max(remaining, 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            for proc, _ in procs:
                proc.kill()
        for proc, log in procs:
            proc.wait()
            log.close()
        results = {case: {"ok": True, "errors": {}} for case in cases}
        for rank in range(world_size):
            path = Path(tmp) / f"result{rank}.json"
            per_rank = json.loads(path.read_text()) if path.exists() else {}
            tail = (Path(tmp) / f"rank{rank}.log").read_text()[-3000:]
            for case in cases:
                status = per_rank.get(case)
                if status is None:
                    why = "timed out" if timed_out else "did not run (worker died)"
                    results[case]["ok"] = False
                    results[case]["errors"][rank] = f"{why}; worker log tail:\n{tail}"
                elif status != "ok":
                    results[case]["ok"] = False
                    results[case]["errors"][rank] = status
        return results
