"""bench/plan_table.py: docs/planning.md's gpt_1b memory table is the planner's, and its rows move
the way the layout choices say they must."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_plan_table_prints_the_planned_layouts():
    out = subprocess.run([sys.executable, "bench/plan_table.py"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {row["layout"]: row["bytes"] for row in json.loads(out.stdout)["rows"]}
    card, zero1, zero2 = rows["tp=4 ep=8 (card)"], rows["tp=4 ep=8, zero=1"], rows["tp=4 ep=8, zero=2"]
    assert zero1["optimizer"] < card["optimizer"] and zero1["weights"] == card["weights"]  # states shard over dp
    assert zero2["grads"] < zero1["grads"]  # and gradients too
    zero3 = rows["tp=4 ep=8, zero=3"]
    assert zero3["weights"] < zero2["weights"] and zero3["grads"] <= zero2["grads"]  # and parameters too
    resident1, resident3 = rows["tp=4 ep=8, zero=1, bf16 weights"], rows["tp=4 ep=8, zero=3, bf16 weights"]
    assert resident1["weights"] < zero1["weights"] and resident3["weights"] < zero3["weights"]  # 16-bit weights
    assert rows["tp=1 dp=8 ep=8, zero=3"]["weights"] < rows["tp=1 dp=8 ep=8, zero=1"]["weights"] / 3
    assert rows["tp=4 ep=8, zero=1, recompute=full"]["activations"] < zero1["activations"]
    assert rows["tp=8 ep=8"]["weights"] < card["weights"] < rows["tp=1 dp=8 ep=8, zero=1"]["weights"]
    for row in rows.values():
        assert row["total"] >= row["weights"] + row["grads"] + row["optimizer"]
