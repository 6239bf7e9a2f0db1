"""Graceful stop on SIGTERM (preemption, `scancel`, torchrun shutting its workers down).

The handler only sets a flag; the loop asks `StopRequest.agreed()` after every step, which
all-reduces the flag (MAX) over the default group so every rank stops after the same step
(signals reach ranks at different moments), then saves a checkpoint and exits cleanly.

A SIGTERM can also mean that a peer is gone: torchrun stops the other workers with SIGTERM
as soon as one rank exits, and a collective with that rank never completes (NCCL has no way
to tell a dead peer from a slow one before its timeout). The agreement (and the save behind
it) then cannot happen, so the handler also arms a deadline: unless the ranks agree to stop
within `grace_s` (default 20 s, the environment variable MESHTRON_SIGTERM_GRACE_S; torchrun
and Slurm send SIGKILL 30 s after SIGTERM), the process writes one line (rank, what it is
blocked in, dead ranks of this host, the newest checkpoint, which is kept) and exits with
status 1 without saving. Once the ranks agree, the deadline is off and the save proceeds:
every peer was alive a moment ago, and a peer that dies during the save fails it the usual
way (gloo's closed connection, the shared-memory liveness check, the collective timeout).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import torch

from meshtron.errors import say_one_line
from meshtron.mpu.mappings import all_reduce_stats, world_group
from meshtron.mpu.mesh import collective_device
from meshtron.mpu.waits import dead_peers

GRACE_ENV = "MESHTRON_SIGTERM_GRACE_S"
DEFAULT_GRACE_S = 20.0
EXIT_STATUS = 1  # the run did not stop cleanly: no checkpoint of its last steps


def grace_seconds() -> float:
    """Seconds a SIGTERM'd rank waits for the stop agreement (MESHTRON_SIGTERM_GRACE_S, else 20)."""
    try:
        value = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
    except ValueError:
        value = DEFAULT_GRACE_S
    return value if value > 0 else DEFAULT_GRACE_S


class StopRequest:
    """Catches SIGTERM while enabled (main thread only); `agreed()` is collective over the
    default group when more than one process runs. `rank`, `where()` (what the main thread is
    doing, e.g. the watchdog's phase and wait) and `newest()` (the newest checkpoint, or None)
    go into the line written when the agreement does not come within `grace_s`."""

    def __init__(
        self,
        enabled: bool = True,
        *,
        rank: int = 0,
        grace_s: float | None = None,
        where: Callable[[], str | None] | None = None,
        newest: Callable[[], str | None] | None = None,
    ):
        self.requested = False
        self.rank, self.grace_s = rank, grace_seconds() if grace_s is None else float(grace_s)
        self._where, self._newest = where, newest
        self._previous = None
        self._deadline: threading.Timer | None = None
        if enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True
        if self._deadline is None:
            self._deadline = threading.Timer(self.grace_s, self._give_up)
            self._deadline.name = "meshtron-sigterm-deadline"
            self._deadline.daemon = True
            self._deadline.start()

    def _give_up(self) -> None:
        """The ranks did not agree to stop in time: one line, then exit without saving."""
        try:
            where = self._where() if self._where is not None else None
        except Exception:
            where = None
        try:
            dead = dead_peers()
        except Exception:
            dead = []
        try:
            newest = self._newest() if self._newest is not None else None
        except Exception:
            newest = None
        gone = (
            f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} of this host died"
            if dead
            else "a peer rank is likely dead or stuck"
        )
        kept = f"the newest checkpoint, {newest}, is kept" if newest else "no checkpoint was saved yet"
        try:
            sys.stdout.flush()
        except Exception:
            pass
        say_one_line(
            f"meshtron: rank {self.rank}: SIGTERM, but the ranks did not agree to stop within "
            f"{self.grace_s:g} s ({GRACE_ENV}){f'; blocked in {where}' if where else ''}: {gone}; "
            f"exiting without saving: {kept}"
        )
        os._exit(EXIT_STATUS)

    def agreed(self, device: torch.device | str | None = None) -> bool:
        """True on every rank when any rank has been asked to stop; one all-reduce over the
        default group (`device`: where its collectives run; default `collective_device()`).
        Agreeing to stop disarms the SIGTERM deadline (the save that follows may take long)."""
        group = world_group()
        if group is None:
            stop = self.requested
        else:
            flag = torch.tensor(
                [1 if self.requested else 0],
                dtype=torch.int32,
                device=collective_device() if device is None else device,
            )
            stop = bool(all_reduce_stats(flag, group, "max").item())
        if stop:
            self.disarm()
        return stop

    def disarm(self) -> None:
        """Cancel the SIGTERM deadline (the ranks agreed, or the caller finishes on its own)."""
        if self._deadline is not None:
            self._deadline.cancel()

    def close(self, keep_handler: bool = False) -> None:
        """Restore the previous SIGTERM handler, unless `keep_handler` (a rank leaving on a failed
        collective: torchrun's SIGTERM to the survivors must not cut short its own exit status
        and line). An armed deadline stays: a rank that got SIGTERM and is leaving on an error
        still exits within the grace if its teardown blocks."""
        if self._previous is not None and not keep_handler:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
