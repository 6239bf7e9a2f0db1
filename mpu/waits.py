"""What this rank is blocked on: every wait on an asynchronous collective is labelled.

A rank stuck in `work.wait()` shows only `wait` in its stack, not which collective or group
it waits for. `wait_for(work, label)` records the label while waiting
(`current_wait()`, read by the hang watchdog from its own thread) and attaches it to an error
the wait raises (`wait_label(err)`), so hang reports and collective failures name e.g.
"all_reduce of gradient bucket 2/3 over dp (24.0 MiB)". No communication of its own.
"""

from __future__ import annotations

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
