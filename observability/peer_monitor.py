"""A dead peer noticed whatever the transport: `DeadPeerMonitor` ends this rank when a rank on
its host has died and the training loop has stopped making progress.

gloo and the shared-memory collectives notice a dead peer in a second or two (a closed
socket; `mpu/waits.py`'s liveness check) and the loop reports it in one line. A transport
that does not (NCCL between GPUs of one host keeps waiting in its kernel until the process
group's timeout, `trainer.collective_timeout_s`, 300 s by default; so would any rank blocked
outside a collective) would leave the survivors hanging until then and torchrun's SIGKILL.
The monitor, a daemon thread, polls `mpu.waits.dead_peers()` (through the watchdog's `safe_dead_peers`) (the registered ranks of this
host whose process is gone: a few /proc reads) every `poll_s`; once one is dead, if the loop's
armed phase (`StepWatchdog.armed`) is still the same `grace_s` later, it writes one line naming
the dead ranks, this rank, the phase and what it waits in, and exits the process with status 1
(`os._exit`: the blocked main thread cannot unwind). The grace leaves the transports that do
notice time to report it their way first. An idle loop (between phases, after the last step)
is never ended: a peer that finished first is not a failure. Ranks on other hosts cannot be
checked from here; their loss reaches this rank through its transport (NCCL's network
transport and gloo report a closed connection). No communication.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TextIO

from meshtron.mpu.waits import current_wait
from meshtron.observability.watchdog import StepWatchdog, collective_in_stack, safe_dead_peers, who

GRACE_S = 10.0  # after a death is seen: gloo/shared memory report theirs within ~2 s
POLL_S = 1.0


class DeadPeerMonitor:
    """Watch this host's peers while `watchdog` (the loop's phases) runs; see the module doc.
    `exit` and `stream` are for tests (default: `os._exit`, stderr at report time)."""

    def __init__(
        self,
        rank: int,
        coords: str,
        watchdog: StepWatchdog,
        *,
        poll_s: float = POLL_S,
        grace_s: float = GRACE_S,
        exit: Callable[[int], None] = os._exit,
        stream: TextIO | None = None,
    ) -> None:
        self.rank, self.coords, self.watchdog = rank, coords, watchdog
        self.poll_s, self.grace_s = poll_s, grace_s
        self._exit, self._stream = exit, stream
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"meshtron-peer-monitor-rank{rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching (the loop's end, or its own report of a failure); harmless twice."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            dead = safe_dead_peers()
            phase = self.watchdog.armed()
            if not dead or phase is None:
                continue
            if self._stop.wait(self.grace_s):
                return
            if self.watchdog.armed() == phase:
                self._report(dead, phase[1])
                self._exit(1)
                return

    def _report(self, dead: list[int], phase: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        waiting = current_wait() or collective_in_stack()
        where = f"{phase}, waiting in {waiting}" if waiting else phase
        ranks = ", ".join(str(r) for r in dead)
        plural = "s" if len(dead) > 1 else ""
        stream.write(
            f"meshtron: {who(self.rank, self.coords)} stops: peer rank{plural} {ranks} died (killed or crashed; look "
            f"for {'their' if plural else 'its'} error above) and this rank has made no progress for "
            f"{self.grace_s:g} s since, in {where}; the transport did not notice (NCCL within a host waits for "
            f"trainer.collective_timeout_s); exiting with status 1\n"
        )
        stream.flush()
