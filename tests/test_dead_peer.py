"""A killed rank is noticed in seconds, on every CPU transport, and the job ends with
meshtron's one line rather than torchrun's SIGKILL of the survivors.

torchrun runs train.py on 2 ranks (dp=2, a checkpoint every step, so the SIGTERM handler is
installed); the test hook MESHTRON_TEST_KILL_AT_STEP makes rank 1 SIGKILL itself as step 3
begins. Rank 0 must fail within a few seconds with one line naming rank 1 and the collective
it waited in, exit 1 (not torchrun's -9 after its 30 s grace, nor -15), and leave no Python
traceback of meshtron's. `trainer.collective_timeout_s=60`: without the liveness check the
shared-memory wait would sit there far past this test's deadline. Through shared memory the
wait notices the dead pid (mpu/shm_collectives.py); through gloo the closed connection fails
the collective and the rank registry names the dead rank (mpu/waits.py). Then the pieces
in-process: `process_gone` on live, exited, zombie and other users' processes, and the
SIGTERM deadline of training/preemption.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshtron.mpu import waits
from meshtron.mpu.waits import PeerGoneError, process_gone, process_identity
from meshtron.observability.watchdog import describe_collective_error, is_collective_failure

pytestmark = pytest.mark.serial  # a dead peer must be noticed within seconds

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "trainer.global_batch_size=8",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "data.max_bytes=2000000",
]
HOOK_LINE = "meshtron: test hook MESHTRON_TEST_KILL_AT_STEP: rank 1 SIGKILLs itself before step 3"


class Streamed:
    """A subprocess whose stderr lines are read as they come, each with its arrival time."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
        )
        self.lines: list[tuple[float, str]] = []
        self.stdout = ""
        self._readers = [
            threading.Thread(target=self._read_err, daemon=True),
            threading.Thread(target=self._read_out, daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _read_out(self) -> None:
        self.stdout = self.proc.stdout.read()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"torchrun still running after {timeout} s:\n{self.stderr[-3000:]}") from None
        finally:
            for t in self._readers:
                t.join(timeout=10)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, text: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if text in line), None)


def torchrun_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.update(extra)
    return env


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_killed_rank_makes_the_survivor_exit_in_seconds_naming_it(tmp_path, shm):
    job = Streamed(
        [
            *TORCHRUN,
            "--nproc_per_node=2",
            "train.py",
            *TINY,
            "trainer.max_steps=6",
            "trainer.collective_timeout_s=60",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "checkpoint.every=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        torchrun_env(MESHTRON_SHM_COLLECTIVES=shm, MESHTRON_TEST_KILL_AT_STEP="1:3"),
    )
    rc = job.wait(timeout=100)
    err = job.stderr
    assert rc != 0, err[-3000:]
    killed = job.first(HOOK_LINE)
    assert killed is not None, err[-3000:]
    failed = job.first("meshtron: rank 0 (tp=0, pp=0, dp=0) failed in collective ")
    assert failed is not None, f"no collective failure line from rank 0:\n{err[-3000:]}"
    line = failed[1]
    # the dead rank, the collective and the phase, in one line
    assert "peer rank 1 died (killed or crashed" in line, line
    assert "during step 3: forward/backward/grad reduce/optimizer" in line, line
    if shm == "1":
        assert "collective all_reduce over a shared-memory group of 2 (call " in line, line
        assert "PeerGoneError: shared-memory collective " in line and "(global rank 1, pid " in line, line
    else:
        assert "collective all_reduce (from " in line, line
    noticed = failed[0] - killed[0]
    assert noticed < 10, f"rank 0 noticed the dead rank only after {noticed:.1f} s"
    # rank 0 exited on its own with meshtron's status, not torchrun's SIGKILL (-9) or SIGTERM (-15)
    assert "exitcode  : 1 (pid" in err, err[-3000:]
    assert "exitcode  : -9" in err and "Signal 9 (SIGKILL) received" in err  # rank 1, the hook's kill
    assert err.count("exitcode  : -9") == 1, err[-3000:]
    assert 'training/loop.py", line' not in err, "rank 0 printed a traceback besides its one line"
    assert "did not agree to stop" not in err  # the SIGTERM deadline was not needed
    # checkpoints up to step 2 stay; nothing newer was started
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))[-1] == "step_00000002"


def free_port() -> int:
    """A TCP port of this host that nothing listens on now (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_the_transport_never_wakes_is_ended_by_the_peer_monitor(tmp_path):
    """Two ranks started as srun or mpirun start them (one process each, env:// rendezvous, no
    torchrun agent to terminate the survivors). Rank 0 blocks outside any collective in step 3
    (the hang hook: what NCCL within a host does, waiting in its kernel, unaware of a dead peer)
    and rank 1 is killed as step 3 begins. No transport error can reach rank 0;
    observability/peer_monitor.py sees rank 1's process gone, waits its grace (10 s) for the
    loop to move on, then writes one line naming rank 1 and the phase and exits 1, long before
    trainer.collective_timeout_s=300."""
    args = [sys.executable, "train.py", *TINY, "trainer.max_steps=6", "trainer.collective_timeout_s=300"]
    launch = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    hooks = {"MESHTRON_TEST_KILL_AT_STEP": "1:3", "MESHTRON_TEST_HANG_AT_STEP": "0:3"}
    ranks = [
        Streamed(
            [*args, f"hydra.run.dir={tmp_path / f'run{rank}'}"],
            torchrun_env(**launch, **hooks, RANK=str(rank), LOCAL_RANK=str(rank)),
        )
        for rank in (0, 1)
    ]
    assert ranks[1].wait(timeout=100) == -9, ranks[1].stderr[-3000:]
    killed = time.monotonic()
    assert ranks[0].wait(timeout=60) == 1, ranks[0].stderr[-3000:]
    stops = ranks[0].first("meshtron: rank 0 (tp=0, pp=0, dp=0) stops: peer rank 1 died (killed or crashed")
    assert stops is not None, ranks[0].stderr[-3000:]
    assert "made no progress for 10 s since, in step 3: forward/backward/grad reduce/optimizer" in stops[1], stops
    assert 9 <= stops[0] - killed < 25, f"ended {stops[0] - killed:.1f} s after the kill"
    assert "Traceback" not in ranks[0].stderr, ranks[0].stderr[-3000:]


# ------------------------------------------------------------------------------ in-process


def test_process_gone_tells_live_exited_zombie_and_reused_pids_apart():
    assert not process_gone(process_identity())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pid = child.pid
        start = waits._start_ticks(pid) or 0
        identity = (pid, start, process_identity()[2])
        assert not process_gone(identity)
        assert process_gone((pid, start + 1, identity[2])) == bool(start)  # a later process with this pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while waits._stat(pid) is not None and waits._stat(pid)[1] not in "ZX" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_gone(identity)  # a zombie: killed, not yet reaped by its parent (us)
    finally:
        child.kill()
        child.wait()
    assert process_gone(identity)  # reaped: no such pid
    # another pid namespace cannot be checked from here: never called dead
    assert not process_gone((pid, start, identity[2] + 1))


def test_process_of_another_user_is_alive(monkeypatch):
    """kill(pid, 0) raising EPERM means the process exists (another user's)."""

    def denied(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    identity = process_identity()
    monkeypatch.setattr(waits.os, "kill", denied)
    assert not process_gone(identity)


class _Exits:
    """A stand-in for os._exit that records the status instead of ending the test process."""

    def __init__(self):
        self.codes, self.done = [], threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


@pytest.mark.parametrize("loop", ["stuck", "idle", "moves_on"])
def test_peer_monitor_ends_only_a_loop_stuck_in_a_phase(loop):
    """A registered peer of this host is dead. The monitor ends the rank (status 1, one line)
    only when an armed phase stays the same through its grace; an idle loop (a peer that
    finished first) and a loop that moves to its next phase are left alone."""
    import io

    from meshtron.observability.peer_monitor import DeadPeerMonitor
    from meshtron.observability.watchdog import StepWatchdog

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    waits.register_peers([(socket.gethostname(), process_identity()), (socket.gethostname(), (child.pid, 0, 0))])
    watchdog, exits, stream = StepWatchdog(0, "tp=0", None), _Exits(), io.StringIO()
    if loop != "idle":
        watchdog.phase("step 3: forward")
    monitor = DeadPeerMonitor(0, "tp=0", watchdog, poll_s=0.05, grace_s=1.0, exit=exits, stream=stream)
    try:
        if loop == "moves_on":
            for step in range(4, 20):  # a new phase every 0.1 s: progress within every grace
                time.sleep(0.1)
                watchdog.phase(f"step {step}: forward")
            ended = exits.done.is_set()
        else:
            ended = exits.done.wait(timeout=5.0 if loop == "stuck" else 1.5)
    finally:
        monitor.close()
        waits.register_peers([])
    if loop != "stuck":
        assert not ended and stream.getvalue() == "", stream.getvalue()
        return
    assert ended and exits.codes == [1]
    line = stream.getvalue()
    assert (
        line.startswith("meshtron: rank 0 (tp=0) stops: peer rank 1 died (killed or crashed") and line.count("\n") == 1
    )
    assert "no progress for 1 s since, in step 3: forward" in line, line


def test_registered_dead_peers_are_named_in_any_transports_failure():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    host = __import__("socket").gethostname()
    gone = (child.pid, 0, process_identity()[2])
    try:
        waits.register_peers([(host, process_identity()), (host, gone), ("elsewhere", gone)])
        assert waits.dead_peers() == [1]  # rank 2 is on another host: not checkable, not named
        closed = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
        msg = describe_collective_error(closed, 0, "tp=0, pp=0, dp=0", "step 3")
        assert "peer rank 1 died (killed or crashed" in msg
    finally:
        waits.register_peers([])
    err = PeerGoneError("shared-memory collective 5: peer rank 1 of the group (global rank 3, pid 9) is dead", [3])
    assert is_collective_failure(err)
    assert "peer rank 3 died" in describe_collective_error(err, 0, "tp=0, pp=0, dp=0", "step 3")


_SIGTERM_SCRIPT = r"""
import os, signal, sys, time
from meshtron.training.preemption import StopRequest
stop = StopRequest(rank=4, grace_s=1.0, where=lambda: "step 7: forward/backward, waiting in all_reduce over dp",
                   newest=lambda: "/ckpt/step_00000006")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
if sys.argv[1] == "agree":
    assert stop.agreed()  # no process group: the flag itself; agreeing disarms the deadline
    time.sleep(2.5)  # past the grace: a long save after the agreement is not cut short
    print("saved", flush=True)
    sys.exit(0)
time.sleep(30)  # blocked for good (a collective with a dead peer under NCCL)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["blocked", "agree"])
def test_sigterm_deadline_exits_with_one_line_unless_the_ranks_agree(tmp_path, mode):
    script = tmp_path / "sigterm.py"
    script.write_text(_SIGTERM_SCRIPT)
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script), mode],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=50,
    )
    took = time.monotonic() - start
    if mode == "agree":
        assert out.returncode == 0 and out.stdout == "saved\n", out.stderr[-2000:]
        assert out.stderr == ""
        return
    assert out.returncode == 1, out.stderr[-2000:]
    assert took < 20, took
    assert out.stderr.splitlines() == [
        "meshtron: rank 4: SIGTERM, but the ranks did not agree to stop within 1 s (MESHTRON_SIGTERM_GRACE_S); "
        "blocked in step 7: forward/backward, waiting in all_reduce over dp: a peer rank is likely dead or stuck; "
        "exiting without saving: the newest checkpoint, /ckpt/step_00000006, is kept"
    ]
