"""Graceful stop on SIGTERM (preemption, `scancel`, torchrun shutting its workers down).

The handler only sets a flag; the loop asks `StopRequest.agreed()` after every step, which
all-reduces the flag (MAX) over the default group so every rank stops after the same step
(signals reach ranks at different moments), then saves a checkpoint and exits cleanly.
"""

from __future__ import annotations

import signal
import threading

import torch

from meshtron.mpu.mappings import all_reduce_stats, world_group
from meshtron.mpu.mesh import collective_device


class StopRequest:
    """Catches SIGTERM while enabled (main thread only); `agreed()` is collective over the
    default group when more than one process runs."""

    def __init__(self, enabled: bool = True):
        self.requested = False
        self._previous = None
        if enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device | str | None = None) -> bool:
        """True on every rank when any rank has been asked to stop; one all-reduce over the
        default group (`device`: where its collectives run; default `collective_device()`)."""
        group = world_group()
        if group is None:
            return self.requested
        flag = torch.tensor(
            [1 if self.requested else 0], dtype=torch.int32, device=collective_device() if device is None else device
        )
        return bool(all_reduce_stats(flag, group, "max").item())

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
