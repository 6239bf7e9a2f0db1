"""Pipeline timelines: Chrome-trace export and bubble measurement (no communication).

`chrome_trace` turns one rank's `TimelineEvent`s into the Trace Event Format that
chrome://tracing and Perfetto open (one process per rank, complete "X" events in µs);
`write_trace` writes the ranks' traces into one file, with any other recorded spans
(`dp.param_gather.Span`: unit forwards and ZeRO parameter all-gathers, one thread per lane)
beside them. `measured_bubble` is the idle
fraction of a rank's span between its first and last event (waits for receives and any
other gap count as idle); `theoretical_bubble` is (p - 1) / (m + p - 1), divided by v for the
interleaved schedule.
"""

from __future__ import annotations

import json
from pathlib import Path


def chrome_trace(events, rank: int, origin: float | None = None) -> list[dict]:
    """Trace events of one rank; times are relative to `origin` (default: first event start)."""
    if not events:
        return []
    origin = min(e.start for e in events) if origin is None else origin
    trace = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}]
    for e in events:
        label = f"{e.name} mb{e.microbatch}" + (f" chunk{e.chunk}" if e.chunk else "")
        trace.append(
            {
                "name": label,
                "cat": e.name,
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "ts": (e.start - origin) * 1e6,
                "dur": max(e.end - e.start, 0.0) * 1e6,
                "args": {"microbatch": e.microbatch, "chunk": e.chunk},
            }
        )
    return trace


LANES = ("compute", "param all-gather")  # Chrome-trace thread of each span lane, in this order


def span_trace(spans, rank: int, origin: float) -> list[dict]:
    """Trace events of one rank's `Span`s (name, lane, start, end, args), one thread per lane,
    times relative to `origin`."""
    trace = [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}}
        for tid, lane in enumerate(LANES)
    ]
    for s in spans:
        tid = LANES.index(s.lane) if s.lane in LANES else len(LANES)
        trace.append(
            {
                "name": s.name,
                "cat": s.lane,
                "ph": "X",
                "pid": rank,
                "tid": tid,
                "ts": (s.start - origin) * 1e6,
                "dur": max(s.end - s.start, 0.0) * 1e6,
                "args": dict(s.args),
            }
        )
    return trace


def write_trace(
    path: str | Path, per_rank_events: dict[int, list], per_rank_spans: dict[int, list] | None = None
) -> Path:
    """Write {rank: events} (pipeline `TimelineEvent`s) and {rank: spans} (`Span`s) as one
    Chrome trace JSON file (a common time origin for all ranks and both kinds)."""
    per_rank_spans = per_rank_spans or {}
    starts = [e.start for events in per_rank_events.values() for e in events] + [
        s.start for spans in per_rank_spans.values() for s in spans
    ]
    origin = min(starts) if starts else 0.0
    trace = [event for rank, events in sorted(per_rank_events.items()) for event in chrome_trace(events, rank, origin)]
    for rank, spans in sorted(per_rank_spans.items()):
        if rank not in per_rank_events or not per_rank_events[rank]:
            trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        trace += span_trace(spans, rank, origin)
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return path


def measured_bubble(events) -> float:
    """Idle fraction of this rank between its first and last event: 1 - compute / span."""
    compute = [e for e in events if e.name in ("F", "B")]
    if not compute:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in compute)
    return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


def theoretical_bubble(pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Idle fraction of a balanced pipeline: (p - 1) / (m + p - 1); interleaving v chunks cuts
    the idle time (p - 1) to (p - 1) / v, giving ((p - 1) / v) / (m + (p - 1) / v)."""
    idle = (pp - 1) / vpp
    return idle / (num_microbatches + idle)
