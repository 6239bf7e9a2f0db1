"""Tests for observability/watchdog.py: the hang report and the collective error message."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from meshtron.observability.watchdog import StepWatchdog, describe_collective_error, is_collective_failure, mesh_coords

pytestmark = pytest.mark.serial  # a watchdog's firing time is bounded (1.5-10 s)

REPO = pathlib.Path(__file__).resolve().parents[1]


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _sleepy_collective(seconds: float) -> None:
    time.sleep(seconds)


def test_slow_phase_is_reported_with_rank_phase_and_stack():
    stream = io.StringIO()
    with StepWatchdog(3, "tp=1, pp=0, dp=1", timeout_s=0.2, stream=stream) as watchdog:
        worker = threading.Thread(target=_sleepy_collective, args=(1.5,), name="stuck-worker")
        with watchdog.phase("step 12: grad all_reduce"):
            worker.start()
            assert _wait_for(lambda: watchdog.reports == 1)
        worker.join()
        time.sleep(0.3)
    text = stream.getvalue()
    first = text.splitlines()[0]
    assert first.startswith("meshtron: rank 3 (tp=1, pp=0, dp=1) stuck for ")
    assert "s in step 12: grad all_reduce" in first
    assert "stuck-worker" in text and "_sleepy_collective" in text and "test_watchdog.py" in text
    assert watchdog.reports == 1  # one report per phase, however long it lasts


def test_fast_phases_and_idle_are_not_reported():
    stream = io.StringIO()
    with StepWatchdog(0, "tp=0, pp=0, dp=0", timeout_s=0.3, stream=stream) as watchdog:
        for step in range(6):
            watchdog.phase(f"step {step}: forward/backward")  # re-armed well within the timeout
            time.sleep(0.1)
        watchdog.idle()
        assert watchdog.current_phase is None
        time.sleep(0.5)
    assert stream.getvalue() == "" and watchdog.reports == 0


def test_disabled_watchdog_has_no_thread():
    watchdog = StepWatchdog(0, "", timeout_s=0)
    assert not watchdog.enabled and watchdog._thread is None
    with watchdog.phase("anything"):
        assert watchdog.current_phase == "anything"
    watchdog.close()


def test_mesh_coords():
    mesh = SimpleNamespace(tp_rank=1, pp_rank=2, dp_rank=0, ep_rank=3, etp_rank=0, par=SimpleNamespace(ep=4, etp=1))
    assert mesh_coords(mesh) == "tp=1, pp=2, dp=0, ep=3"


def test_describe_collective_error_names_rank_coords_phase_and_original():
    err = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation")
    assert is_collective_failure(err)
    msg = describe_collective_error(err, 5, "tp=1, pp=1, dp=0", "step 7: pipeline send/recv", timeout_s=2)
    assert msg.startswith("meshtron: rank 5 (tp=1, pp=1, dp=0) failed in a collective during step 7: pipeline")
    assert "did not join within trainer.collective_timeout_s=2" in msg
    assert msg.endswith("Original error: RuntimeError: " + str(err))
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1")
    assert is_collective_failure(closed)
    assert "closed its connection" in describe_collective_error(closed, 0, "tp=0, pp=0, dp=0", "step 1")
    assert not is_collective_failure(RuntimeError("shape mismatch"))
    assert not is_collective_failure(ValueError("timed out"))


_WORKER = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
from meshtron.mpu.mappings import all_reduce_stats
from meshtron.observability.watchdog import StepWatchdog, is_collective_failure
rank, store_path = int(sys.argv[1]), sys.argv[2]
store = dist.FileStore(store_path, 2)
store.set(f"ready{rank}", "1")  # both started (imports can be seconds apart) before the short timeout applies
store.wait(["ready0", "ready1"], datetime.timedelta(seconds=40))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
if rank == 1:  # never joins the all_reduce (the test kills it once rank 0 has failed)
    time.sleep(60)
    os._exit(0)
watchdog = StepWatchdog(rank, "tp=0, pp=0, dp=0", timeout_s=1.0)
watchdog.phase("step 3: routing stats")
start = time.monotonic()
try:
    all_reduce_stats(torch.ones(4), dist.group.WORLD)
except Exception as err:
    assert is_collective_failure(err), err
    print(watchdog.describe_error(err, timeout_s=2), file=sys.stderr, flush=True)
    print(f"failed after {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    os._exit(3)
os._exit(0)
"""


def _rank0_failure(tmp_path: pathlib.Path, worker: str, *, shm: str) -> str:
    """Run `worker` as ranks 0 and 1 (MESHTRON_SHM_COLLECTIVES=`shm`); rank 0 must fail with
    exit 3 while rank 1 stays away; returns rank 0's stderr."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MESHTRON_SHM_COLLECTIVES": shm}
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
    try:
        _, err0 = procs[0].communicate(timeout=40)
    finally:
        for p in procs:  # rank 1 is still asleep: end it
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode == 3, err0
    return err0


@pytest.mark.timeout(60)
def test_rank_stuck_in_all_reduce_over_gloo(tmp_path: pathlib.Path):
    # gloo itself: the shared-memory path (mpu/shm_collectives.py) has its own test below
    err0 = _rank0_failure(tmp_path, _WORKER, shm="0")
    lines = err0.splitlines()
    # 1) The watchdog report (at 1 s, before the 2 s collective timeout), then faulthandler's
    #    stacks with the blocking collective and where the code called it.
    (report,) = [line for line in lines if " stuck for " in line]
    assert report.startswith("meshtron: rank 0 (tp=0, pp=0, dp=0) stuck for ") and "in step 3: routing stats" in report
    # the one line names the blocking collective and its caller (read from the live stack)
    assert "in step 3: routing stats, waiting in all_reduce (from mpu/mappings.py:" in report
    stacks = "\n".join(lines[lines.index(report) :])
    assert "in all_reduce" in stacks and "mpu/mappings.py" in stacks
    # 2) The failure message: rank, coordinates, phase, collective and the original gloo error.
    (failure,) = [line for line in lines if " failed in " in line]
    assert failure.startswith(
        "meshtron: rank 0 (tp=0, pp=0, dp=0) failed in collective all_reduce (from mpu/mappings.py:"
    )
    assert "during step 3: routing stats" in failure and "Original error: " in failure
    assert "did not join within trainer.collective_timeout_s=2 " in failure and "timed out" in failure.lower()
    seconds = float(lines[-1].split()[2])
    assert 1.5 <= seconds < 10


_SHM_WORKER = _WORKER.replace(
    "if rank == 1:  # never joins",
    "from meshtron.mpu import shm_collectives\n"
    "shm_collectives.set_timeout(2)\n"
    "all_reduce_stats(torch.ones(4), dist.group.WORLD)  # both ranks: the group's segment is made\n"
    "if rank == 1:  # never joins",
)


@pytest.mark.timeout(60)
def test_rank_stuck_in_a_shared_memory_all_reduce_fails_after_the_collective_timeout(tmp_path: pathlib.Path):
    """CPU ranks of one host all-reduce through shared memory: a peer that never arrives is
    named by the watchdog and fails the wait after the process group's timeout, as gloo would."""
    err0 = _rank0_failure(tmp_path, _SHM_WORKER, shm="1")
    lines = err0.splitlines()
    (report,) = [line for line in lines if " stuck for " in line]
    assert "in step 3: routing stats, waiting in all_reduce over a shared-memory group of 2 (call 2)" in report
    (failure,) = [line for line in lines if " failed in " in line]
    assert "all_reduce over a shared-memory group of 2 (call 2)" in failure
    assert "timed out: ranks [1] of the group did not arrive within 2 s" in failure
    seconds = float(lines[-1].split()[2])
    assert 1.5 <= seconds < 10


class _BlockingWork:
    """An asynchronous collective's work handle that completes when `done` is set (or fails)."""

    def __init__(self, error: Exception | None = None):
        self.done, self.error = threading.Event(), error

    def wait(self):
        if self.error is not None:
            raise self.error
        self.done.wait(10)


def test_report_names_the_labelled_wait_the_rank_is_blocked_in():
    from meshtron.mpu.waits import current_wait, wait_for

    stream = io.StringIO()
    work = _BlockingWork()
    with StepWatchdog(1, "tp=0, pp=0, dp=1", timeout_s=0.2, stream=stream) as watchdog:
        with watchdog.phase("step 4: gradient reduction"):
            threading.Timer(1.0, work.done.set).start()
            wait_for(work, "all_reduce of gradient bucket 2/3 over dp (24.0 MiB)")
    assert current_wait() is None  # cleared once the wait returns
    first = stream.getvalue().splitlines()[0]
    assert (
        "s in step 4: gradient reduction, waiting in all_reduce of gradient bucket 2/3 over dp (24.0 MiB) "
        "(watchdog timeout 0.2 s)" in first
    )


def test_failed_wait_names_its_collective():
    from meshtron.mpu.waits import current_wait, wait_for

    work = _BlockingWork(RuntimeError("[gloo] Timed out waiting 2000ms for recv operation to complete"))
    with pytest.raises(RuntimeError) as caught:
        wait_for(work, "reduce_scatter of gradient bucket 1/1 over edp (1.0 MiB)")
    assert current_wait() is None
    message = describe_collective_error(caught.value, 0, "tp=0, pp=0, dp=0", "step 2: finish", timeout_s=2)
    assert (
        "failed in collective reduce_scatter of gradient bucket 1/1 over edp (1.0 MiB) during step 2: finish: "
        "a peer rank did not join within trainer.collective_timeout_s=2"
    ) in message


def test_gradient_reducer_labels_its_bucket_waits(monkeypatch):
    """Every bucket wait of `finish()` carries the op, bucket index, group key and size."""
    import torch
    from torch import nn

    from meshtron.dp import grad_reduce
    from meshtron.mpu.mesh import single_process_mesh

    labels = []
    monkeypatch.setattr(grad_reduce, "wait_for", lambda work, label: labels.append(label))
    model = nn.Linear(256, 256)
    reducer = grad_reduce.DataParallelGradReducer(list(model.named_parameters()), single_process_mesh())
    for bucket in reducer.buckets:  # a group of one launches nothing: hand each bucket a pending work
        bucket.work = _BlockingWork()
    model(torch.ones(2, 256)).sum().backward()
    reducer.finish()
    assert labels == [
        "all_reduce of gradient bucket 1/2 over dp (0.2 MiB)",
        "all_reduce of gradient bucket 2/2 over dp (0.0 MiB)",
    ]


def test_all_to_all_waits_are_labelled(monkeypatch):
    """The MoE dispatcher's asynchronous all-to-alls wait through wait_for with their sizes."""
    from meshtron.mpu import mappings

    labels = []
    monkeypatch.setattr(mappings, "wait_for", lambda work, label: labels.append(label))
    handle = mappings.AllToAllHandle(output_splits=[3, 1], input_splits=[2, 4], group=None)
    handle.works, handle.grad_works = [_BlockingWork()], [_BlockingWork()]
    handle.wait()
    handle.wait_grads()
    assert labels == [
        "all_to_all (forward) of 6 rows out, 4 in over a group of 2",
        "all_to_all (backward) of 6 rows out, 4 in over a group of 2",
    ]
