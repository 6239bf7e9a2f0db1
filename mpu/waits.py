"""What this rank is blocked on: every wait on an asynchronous collective is labelled.

A rank stuck in `work.wait()` shows only `wait` in its stack, not which collective or group
it waits for. `wait_for(work, label)` records the label while waiting
(`current_wait()`, read by the hang watchdog from its own thread) and attaches it to an error
the wait raises (`wait_label(err)`), so hang reports and collective failures name e.g.
"all_reduce of gradient bucket 2/3 over dp (24.0 MiB)". No communication of its own.

Whether a peer is still alive: `process_identity()` is what a rank publishes about itself
(pid, start time, pid namespace); `process_gone(identity)` tells, on the same host, whether
that process has exited (no such pid, a zombie, or the pid reused by a later process). The
shared-memory collectives (`mpu/shm_collectives.py`) check the ranks they wait for this way;
`register_peers` keeps every rank's identity, gathered once at startup
(`training/distributed.py`), so a failure on any transport can name the ranks of this host
that died (`dead_peers`). `PeerGoneError` is the error a wait raises for a dead peer.
"""

from __future__ import annotations

import os
import socket
import threading

_waits: dict[int, str] = {}  # thread id -> label of the wait in progress
_lock = threading.Lock()


def wait_for(work, label: str) -> None:
    """`work.wait()` with `label` naming the collective and its group for hang reports."""
    ident = threading.get_ident()
    with _lock:
        _waits[ident] = label
    try:
        work.wait()
    except BaseException as err:  # noqa: B036 - labels any failure of the wait, then re-raises it
        if wait_label(err) is None:
            err.meshtron_wait = label
        raise
    finally:
        with _lock:
            _waits.pop(ident, None)


def current_wait(thread_id: int | None = None) -> str | None:
    """The label of the wait `thread_id` (default: the main thread) is blocked in, or None."""
    ident = threading.main_thread().ident if thread_id is None else thread_id
    with _lock:
        return _waits.get(ident)


def wait_label(err: BaseException) -> str | None:
    """The label `wait_for` attached to `err`, if it came out of a labelled wait."""
    return getattr(err, "meshtron_wait", None)


class PeerGoneError(ConnectionError):
    """A collective cannot complete: a peer it waits for has exited (killed or crashed).
    `ranks`: their global ranks. A ConnectionError mentioning the peer, like gloo's
    "Connection closed by peer", so `observability.watchdog.is_collective_failure` holds."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = list(ranks)


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat); None without it."""
    info = _stat(pid)
    return None if info is None else info[0]


def _stat(pid: int) -> tuple[int, str] | None:
    """(start ticks, state letter) of `pid` from /proc/<pid>/stat; None without it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    try:
        return int(fields[19]), fields[0].decode()
    except (IndexError, ValueError):
        return None


def process_identity() -> tuple[int, int, int]:
    """(pid, start ticks or 0, pid namespace inode or 0) of this process: what a rank
    publishes so that peers on its host can tell whether it is still running."""
    pid = os.getpid()
    return pid, _start_ticks(pid) or 0, _pid_namespace()


def process_gone(identity: tuple[int, int, int]) -> bool:
    """Whether the process `identity` (from `process_identity()` on this host) has exited: no
    such pid, a zombie not yet reaped by its launcher, or the pid now belongs to a process
    started later. False when it cannot be told (another pid namespace, no /proc): the caller
    then relies on its timeout. A pid of another user (kill's EPERM) is alive."""
    pid, start, namespace = (int(v) for v in identity)
    if pid <= 0 or (namespace and namespace != _pid_namespace()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # a process of another user: it exists
    info = _stat(pid)
    if info is None:
        return not os.path.isdir("/proc/self")  # no /proc at all: cannot tell; else it vanished
    ticks, state = info
    return state in ("Z", "X") or bool(start and ticks != start)


_peers: dict[int, tuple[str, tuple[int, int, int]]] = {}  # global rank -> (host, identity)


def register_peers(table: list[tuple[str, tuple[int, int, int]]]) -> None:
    """Remember every global rank's (host, `process_identity()`), in rank order (replaces
    the previous job's; an empty list forgets them)."""
    _peers.clear()
    _peers.update(enumerate(table))


def peers_registered() -> bool:
    """Whether `register_peers` holds a job's ranks (a distributed run on its way)."""
    return bool(_peers)


def dead_peers() -> list[int]:
    """The registered global ranks on this host whose process has exited (ranks on other
    hosts cannot be checked from here and are never listed)."""
    host = socket.gethostname()
    return [rank for rank, (h, identity) in sorted(_peers.items()) if h == host and process_gone(identity)]
