"""optim.overlap_param_gather in a real run: `trainer.trace_step` writes a Chrome trace in which
the ZeRO-1 parameter all-gathers launched by the previous update overlap the forward of the
traced step's first layers; `write_trace` puts such spans on lanes of their own."""

from __future__ import annotations

import json
import sys

import pytest

from meshtron.dp.param_gather import Span
from meshtron.pipeline.trace import write_trace
from tests.test_train_cli import TORCHRUN, metrics, run


def _spans(trace: list[dict], rank: int) -> tuple[list[dict], list[dict]]:
    """(all-gather spans, unit forward spans) of one rank, as [start, end] in µs."""
    spans = [e for e in trace if e.get("ph") == "X" and e["pid"] == rank]
    return (
        [e for e in spans if e["cat"] == "param all-gather"],
        [e for e in spans if e["cat"] == "compute" and e["name"].startswith("F ")],
    )


def _overlap(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


def test_write_trace_puts_spans_on_their_lanes(tmp_path):
    spans = {
        0: [
            Span("all-gather bucket 3", "param all-gather", 10.0, 10.5, {"bucket": 3}),
            Span("F layers.0", "compute", 10.2, 10.4, {"gathers_in_flight": 1}),
        ],
        1: [Span("F embed", "compute", 10.1, 10.3)],
    }
    trace = json.loads(write_trace(tmp_path / "trace.json", {}, spans).read_text())["traceEvents"]
    events = {(e["pid"], e["name"]): e for e in trace if e["ph"] == "X"}
    gather, forward = events[(0, "all-gather bucket 3")], events[(0, "F layers.0")]
    assert (gather["tid"], forward["tid"]) == (1, 0)
    assert gather["ts"] == 0.0 and gather["dur"] == pytest.approx(0.5e6)
    assert forward["ts"] == pytest.approx(0.2e6) and forward["args"] == {"gathers_in_flight": 1}
    assert events[(1, "F embed")]["ts"] == pytest.approx(0.1e6)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert names[(0, 1)] == "param all-gather" and names[(1, 0)] == "compute"
    assert {e["pid"] for e in trace if e["name"] == "process_name"} == {0, 1}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_zero1_trace_shows_gathers_overlapping_the_first_layers(tmp_path):
    """zero=1 on 2 data-parallel ranks, 8 narrow layers in small buckets (37 gathers: on gloo
    they take 20-100 ms together, against gaps of 1-60 ms measured between an update and the
    next forward on the loaded 2-core host), trace of step 3 (no logging between step 2's update
    and step 3's forward): on some rank an all-gather of the buckets launched by step 2 is still
    running while the embedding or the first block computes. (Bit-identity with blocking
    gathers: tests/distributed/zero_cases.py; through the loop against zero=0:
    test_train_cli.test_torchrun_zero1_logs_the_replicated_adamw_losses, overlapped by default.)"""
    common = [
        "trainer.max_steps=4",
        "trainer.log_every=10",
        "trainer.progress=false",
        "trainer.eval_every=0",
        "optim.zero=1",
        "optim.bucket_mb=0.01",
        "trainer.global_batch_size=8",
        "model.num_layers=8",
        "model.hidden_size=64",
    ]
    run_dir = tmp_path / "run"
    out = run(
        [*TORCHRUN, "--nproc_per_node=2", "train.py", *common, "trainer.trace_step=3", f"hydra.run.dir={run_dir}"],
        timeout=200,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert [m["step"] for m in metrics(run_dir)] == [1, 4]
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    overlapping = {}
    for rank in (0, 1):
        gathers, forwards = _spans(trace, rank)
        assert len(gathers) > 30, f"rank {rank}: {len(gathers)} gather spans"
        names = [f["name"] for f in forwards]
        assert names == ["F embed", *(f"F layers.{i}" for i in range(8)), "F head"], names
        first = [f for f in forwards if f["name"] in ("F embed", "F layers.0")]
        overlapping[rank] = [(g["name"], f["name"]) for g in gathers for f in first if _overlap(g, f)]
        # every gather was launched (by step 2's update) before the traced step's forward began
        assert max(g["ts"] for g in gathers) < forwards[0]["ts"]
    assert overlapping[0] or overlapping[1], f"no all-gather overlaps the first layers' forward: {trace}"
    assert "ZeRO parameter all-gather(s) still running after the forward started" in out.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
