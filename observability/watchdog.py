"""Hang reports: which rank is stuck, where in the step, and in which collective.

A collective that one rank never joins blocks the others until the process group's timeout
(``trainer.collective_timeout_s``) fires, and the resulting gloo/NCCL error names neither the
rank's place in the mesh nor what the step was doing. Two tools fix that:

* ``StepWatchdog``: a daemon thread. The loop arms it with a label at the start of each phase
  (``watchdog.phase("step 12: forward/backward")``); if one phase lasts longer than
  ``timeout_s`` it writes one line ``meshtron: rank R (tp=.., pp=.., dp=..) stuck for T s in
  <phase>`` followed by the stack of every thread, so the frame of the blocking collective
  (e.g. ``all_reduce`` called from ``mpu/mappings.py``) is visible; a rank blocked in a wait
  on an asynchronous collective is named by its label (``mpu/waits.py``: "waiting in
  all_reduce of gradient bucket 2/3 over dp (24.0 MiB)"). It only reports; the
  process group's timeout still ends the run.
* ``describe_collective_error``: turns the timeout / connection error a collective raises
  into one message naming the rank, its mesh coordinates, the phase, the collective and the
  original error.
"""

from __future__ import annotations

import faulthandler
import io
import sys
import threading
import time
import traceback
from typing import TextIO

from meshtron.mpu.waits import PeerGoneError, current_wait, dead_peers, peers_registered, wait_label

__all__ = [
    "StepWatchdog",
    "collective_in_stack",
    "collective_in_traceback",
    "describe_collective_error",
    "is_collective_failure",
    "mesh_coords",
    "safe_dead_peers",
    "who",
]


def mesh_coords(mesh) -> str:
    """``'tp=0, pp=1, dp=0'`` for a ``mpu.mesh.Mesh`` (plus ``cp=`` with context parallelism, ``ep=``/``etp=`` when the expert mesh is split)."""
    parts = [f"tp={mesh.tp_rank}", f"pp={mesh.pp_rank}", f"dp={mesh.dp_rank}"]
    par = getattr(mesh, "par", None)
    if par is not None and getattr(par, "cp", 1) > 1:
        parts.append(f"cp={mesh.cp_rank}")
    if par is not None and getattr(par, "ep", 1) > 1:
        parts.append(f"ep={mesh.ep_rank}")
    if par is not None and getattr(par, "etp", 1) > 1:
        parts.append(f"etp={mesh.etp_rank}")
    return ", ".join(parts)


def who(rank: int, coords: str) -> str:
    """'rank R (tp=.., pp=.., dp=..)', how every report names this process."""
    return f"rank {rank} ({coords})" if coords else f"rank {rank}"


def _dump_stacks(stream: TextIO, skip_thread: int | None = None) -> None:
    """Write every thread's stack to ``stream``.

    A stream backed by a file descriptor (stderr, a log file) gets ``faulthandler``'s dump,
    which needs nothing from the interpreter's state; any other stream (``io.StringIO`` in
    tests) gets the same information formatted by ``traceback``.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        fd = None
    if fd is not None:
        stream.flush()
        faulthandler.dump_traceback(file=stream, all_threads=True)
        return
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident == skip_thread:
            continue
        stream.write(f'Thread 0x{ident:x} "{names.get(ident, "?")}" (most recent call last):\n')
        stream.write("".join(traceback.format_stack(frame)))
    stream.flush()


class _Phase:
    """Returned by ``StepWatchdog.phase``; as a context manager it disarms the watchdog on exit."""

    def __init__(self, watchdog: StepWatchdog, token: int) -> None:
        self._watchdog, self._token = watchdog, token

    def __enter__(self) -> _Phase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._watchdog._disarm(self._token)


class StepWatchdog:
    """Report a phase of the step that takes longer than ``timeout_s`` (a likely hang).

    ``rank`` and ``coords`` (``mesh_coords(mesh)``, e.g. ``"tp=0, pp=1, dp=0"``) name this
    process in the report. ``phase(label)`` (re)arms the watchdog: the clock restarts and
    ``label`` names what is running; ``idle()`` disarms it (also done by leaving
    ``with watchdog.phase(...):``). A phase is reported once, however long it lasts.
    ``timeout_s`` of ``None`` or ``<= 0`` disables the watchdog (no thread; ``phase`` is
    cheap either way). The report goes to ``stream`` (default: ``sys.stderr`` at report time).
    """

    def __init__(self, rank: int, coords: str, timeout_s: float | None, stream: TextIO | None = None) -> None:
        self.rank = int(rank)
        self.coords = coords
        self.timeout_s = float(timeout_s) if timeout_s else 0.0
        self.enabled = self.timeout_s > 0
        self._stream = stream
        self._cond = threading.Condition()
        self._label: str | None = None
        self._started = 0.0
        self._token = 0
        self._reported_token = -1
        self._stopped = False
        self.reports = 0
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name=f"meshtron-watchdog-rank{self.rank}", daemon=True)
            self._thread.start()

    @property
    def current_phase(self) -> str | None:
        """The label of the armed phase, or None when idle."""
        return self._label

    def armed(self) -> tuple[int, str] | None:
        """(token, label) of the armed phase, None when idle; the token changes with every
        `phase`/`idle`, so an unchanged token means the loop has not moved on."""
        with self._cond:
            return None if self._label is None else (self._token, self._label)

    def phase(self, label: str) -> _Phase:
        """Start timing a new phase called ``label`` (replaces the previous one)."""
        with self._cond:
            self._token += 1
            self._label = label
            self._started = time.monotonic()
            self._cond.notify()
            return _Phase(self, self._token)

    def idle(self) -> None:
        """Stop timing (between phases that may legitimately take long, e.g. checkpointing)."""
        with self._cond:
            self._token += 1
            self._label = None
            self._cond.notify()

    def _disarm(self, token: int) -> None:
        with self._cond:
            if token == self._token:
                self.idle()

    def close(self) -> None:
        """Stop the thread; calling it again is harmless."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None

    def __enter__(self) -> StepWatchdog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def describe_error(self, err: BaseException, timeout_s: float | None = None) -> str:
        """``describe_collective_error`` for this rank and the phase that is armed now
        (``timeout_s``: the process group's collective timeout, quoted in the message)."""
        return describe_collective_error(err, self.rank, self.coords, self._label or "(no phase armed)", timeout_s)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                if self._label is None or self._reported_token == self._token:
                    self._cond.wait()
                    continue
                remaining = self._started + self.timeout_s - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                token, label, elapsed = self._token, self._label, time.monotonic() - self._started
                self._reported_token = token
                # Report without the lock so the main thread can move on meanwhile.
                self._cond.release()
                try:
                    self._report(label, elapsed)
                finally:
                    self._cond.acquire()

    def _report(self, label: str, elapsed: float) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        try:
            waiting = current_wait() or collective_in_stack()
            where = f"{label}, waiting in {waiting}" if waiting else label
            stream.write(
                f"meshtron: {who(self.rank, self.coords)} stuck for {elapsed:.1f} s in {where} "
                f"(watchdog timeout {self.timeout_s:g} s); stacks of all threads follow\n"
            )
            _dump_stacks(stream, skip_thread=threading.get_ident())
            self.reports += 1
        except Exception:  # never let a report kill the watchdog or the run
            pass


# Public torch.distributed functions that talk to other ranks.
_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_object",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "barrier",
        "monitored_barrier",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "send_object_list",
        "recv_object_list",
        "init_process_group",
        "new_group",
    }
)

_FAILURE_MARKERS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "peer",
    "nccl error",
    "watchdog caught collective",
    "socket",
    "unhandled system error",
)


def is_collective_failure(err: BaseException) -> bool:
    """True for the errors a stuck or dead peer produces in a collective (gloo/NCCL timeouts,
    closed connections, ``torch.distributed`` ``DistError`` subclasses)."""
    if isinstance(err, PeerGoneError):
        return True
    try:
        import torch.distributed as dist

        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(err, dist_error):
            return True
    except ImportError:  # pragma: no cover
        pass
    if not isinstance(err, (RuntimeError, TimeoutError, ConnectionError)):
        return False
    text = str(err).lower()
    return any(marker in text for marker in _FAILURE_MARKERS)


def collective_in_traceback(err: BaseException) -> str | None:
    """``'all_reduce (from mpu/mappings.py:31 in _all_reduce)'``: the innermost
    ``torch.distributed`` collective in ``err``'s traceback and the first caller outside
    torch, or None when the traceback holds no collective."""
    return _collective_in_frames(traceback.extract_tb(err.__traceback__))


def collective_in_stack(thread_id: int | None = None) -> str | None:
    """The same for the live stack of thread ``thread_id`` (default: the main thread): the
    blocking collective it is inside right now, or None."""
    ident = threading.main_thread().ident if thread_id is None else thread_id
    frame = sys._current_frames().get(ident)
    return None if frame is None else _collective_in_frames(traceback.extract_stack(frame))


def _collective_in_frames(frames) -> str | None:
    found = None
    for index, frame in enumerate(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/distributed/" in path and frame.name in _COLLECTIVES:
            found = index
    if found is None:
        return None
    name = frames[found].name
    for frame in reversed(frames[:found]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path:
            short = "/".join(path.split("/")[-2:])
            return f"{name} (from {short}:{frame.lineno} in {frame.name})"
    return name


def safe_dead_peers(settle_s: float = 0.0) -> list[int]:
    """`dead_peers()` ([] when the probe itself fails), polled for up to `settle_s`: a peer's
    sockets close while its process is still exiting, a moment before it shows as gone (a
    zombie)."""
    deadline = time.monotonic() + (settle_s if peers_registered() else 0.0)
    while True:
        try:
            dead = dead_peers()
        except Exception:  # a report must not fail on the liveness probe
            return []
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def describe_collective_error(
    err: BaseException, rank: int, coords: str, phase: str, timeout_s: float | None = None
) -> str:
    """One message for a failed collective: who (rank, mesh coordinates), where (the phase and
    the collective, when the traceback shows it), the likely cause and the original error.

    Example: ``meshtron: rank 0 (tp=0, pp=0, dp=0) failed in collective all_reduce (from
    mpu/mappings.py:31 in _all_reduce) during step 12: forward/backward: a peer rank did
    not join in time (stuck, slower, or dead; see its watchdog report). Original error:
    RuntimeError: [...] Timed out waiting 2000ms for recv operation to complete``. When a peer
    is known dead (``mpu.waits.PeerGoneError`` from a shared-memory wait, or a registered
    rank of this host whose process is gone: ``mpu.waits.dead_peers``), the cause names it:
    ``peer rank 1 died (killed or crashed; ...)``.
    """
    text = str(err).strip().replace("\n", " | ")
    lowered = text.lower()
    collective = collective_in_traceback(err) or wait_label(err)
    where = f"collective {collective}" if collective else "a collective"
    # Ranks known dead: named by the shared-memory wait, else any registered rank of this host
    # whose process is gone (training/distributed.py registers them; other hosts unknown).
    closed = any(m in lowered for m in ("connection closed", "connection reset", "broken pipe", "peer"))
    dead = err.ranks if isinstance(err, PeerGoneError) else safe_dead_peers(2.0 if closed else 0.0)
    if dead:
        ranks = ", ".join(str(r) for r in dead)
        cause = (
            f"peer rank{'s' if len(dead) > 1 else ''} {ranks} died (killed or crashed; look for "
            f"{'their' if len(dead) > 1 else 'its'} error above, or the launcher's report of {'their' if len(dead) > 1 else 'its'} exit)"
        )
    elif "timed out" in lowered or "timeout" in lowered:
        limit = f" within trainer.collective_timeout_s={timeout_s:g}" if timeout_s else ""
        cause = (
            f"a peer rank did not join{limit} (it is stuck, much slower, or dead; look for its 'stuck' watchdog report)"
        )
    elif closed:
        cause = "a peer rank closed its connection (it crashed or exited; look for its error above)"
    else:
        cause = "the communication backend reported an error"
    return (
        f"meshtron: {who(rank, coords)} failed in {where} during {phase}: {cause}. "
        f"Original error: {type(err).__name__}: {text}"
    )
