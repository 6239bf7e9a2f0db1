"""The tests' fault hooks in the training loop, set through environment variables and read
at the start of every step: a rank (or a whole torchrun agent, a lost node) SIGKILLed, or a
rank blocked outside any collective. They act only in a job's first attempt (torchrun's
TORCHELASTIC_RESTART_COUNT unset or 0), so an elastic restart runs on. Not user settings;
tests/test_dead_peer.py and tests/test_elastic_restart.py drive them.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from meshtron.errors import say_one_line

KILL_ENV = "MESHTRON_TEST_KILL_AT_STEP"  # "RANK:STEP" or "node:STEP" (kill_if_asked)


def kill_if_asked(rank: int, step: int) -> None:
    """The tests' fault hook (MESHTRON_TEST_KILL_AT_STEP): "RANK:STEP" (e.g. "1:4"): global
    rank RANK SIGKILLs itself as step STEP (1-based) begins, i.e. after the checkpoint of step
    STEP - 1; "node:STEP": the local rank 0 of every torchrun agent whose environment holds the
    hook SIGKILLs its agent (its parent) and then itself, a lost node (the agent's other workers
    then fail on the dead peer). Only in a job's first attempt (torchrun's
    TORCHELASTIC_RESTART_COUNT unset or 0), so that an elastic restart runs on. Not a user setting."""
    spec = os.environ.get(KILL_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    who, want_step = spec.split(":")
    if step != int(want_step):
        return
    if who == "node" and os.environ.get("LOCAL_RANK") == "0":
        say_one_line(
            f"meshtron: test hook {KILL_ENV}: rank {rank} SIGKILLs its torchrun agent and itself before step {step}"
        )
        os.kill(os.getppid(), signal.SIGKILL)
    elif who != str(rank):
        return
    else:
        say_one_line(f"meshtron: test hook {KILL_ENV}: rank {rank} SIGKILLs itself before step {step}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


HANG_ENV = "MESHTRON_TEST_HANG_AT_STEP"  # "RANK:STEP" (hang_if_asked)


def hang_if_asked(rank: int, step: int) -> None:
    """The tests' stand-in for a transport that never notices a dead peer (NCCL within a host):
    with MESHTRON_TEST_HANG_AT_STEP="RANK:STEP", global rank RANK blocks forever at the start of
    step STEP's forward, outside any collective (observability/peer_monitor.py must end it).
    Only in a job's first attempt. Not a user setting."""
    spec = os.environ.get(HANG_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if tuple(int(v) for v in spec.split(":")) == (rank, step):
        say_one_line(f"meshtron: test hook {HANG_ENV}: rank {rank} blocks in step {step}")
        while True:
            time.sleep(1.0)
