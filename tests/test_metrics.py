"""Tests for observability/metrics.py: metrics.jsonl writer, step line, progress bar."""

from __future__ import annotations

import io
import json
import pathlib

import numpy as np
import pytest
import torch

from meshtron.observability.metrics import MetricsWriter, ProgressBar, format_step_line, to_jsonable


def _read_lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_writer_round_trips_through_json(tmp_path: pathlib.Path):
    run_dir = tmp_path / "run" / "0"  # created on demand
    records = [
        {"step": 1, "loss": 3.5, "lr": 3e-4, "grad_norm": 1.25, "tokens_per_s": 1234.5, "mfu": 0.12},
        {
            "step": 2,
            "loss": 3.25,
            "lr": 2.5e-4,
            "grad_norm": 1.0,
            "tokens_per_s": 1300.0,
            "mfu": 0.13,
            "aux_loss": 0.01,
        },
    ]
    with MetricsWriter(run_dir, enabled=True) as writer:
        for r in records:
            writer.log(r)
        # Flushed per line: readable before close.
        assert _read_lines(run_dir / "metrics.jsonl") == records
    assert _read_lines(run_dir / "metrics.jsonl") == records


def test_writer_appends_on_reopen(tmp_path: pathlib.Path):
    with MetricsWriter(tmp_path, enabled=True) as w:
        w.log({"step": 1})
    with MetricsWriter(str(tmp_path), enabled=True) as w:
        w.log({"step": 2})
    assert _read_lines(tmp_path / "metrics.jsonl") == [{"step": 1}, {"step": 2}]


def test_writer_converts_tensors_and_numpy(tmp_path: pathlib.Path):
    with MetricsWriter(tmp_path, enabled=True) as w:
        w.log(
            {
                "step": np.int64(3),
                "loss": torch.tensor(2.5),
                "lr": np.float32(0.5),
                "tokens": torch.tensor(7),
                "expert_load": torch.tensor([[1, 2], [3, 4]]),
                "per_layer": {"l0": np.array([0.25, 0.75])},
                "ok": True,
                "name": "run",
            }
        )
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(line)
    assert rec == {
        "step": 3,
        "loss": 2.5,
        "lr": 0.5,
        "tokens": 7,
        "expert_load": [[1, 2], [3, 4]],
        "per_layer": {"l0": [0.25, 0.75]},
        "ok": True,
        "name": "run",
    }
    assert type(rec["step"]) is int and type(rec["tokens"]) is int and type(rec["loss"]) is float


def test_non_finite_values_become_null(tmp_path: pathlib.Path):
    with MetricsWriter(tmp_path, enabled=True) as w:
        w.log(
            {
                "step": 1,
                "loss": float("nan"),
                "grad_norm": torch.tensor(float("inf")),
                "lr": np.float64(-np.inf),
                "load": [1.0, float("nan")],
            }
        )
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    # Strict JSON parse: reject the non-standard NaN/Infinity tokens.
    rec = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert rec == {"step": 1, "loss": None, "grad_norm": None, "lr": None, "load": [1.0, None]}


def test_disabled_writer_writes_nothing(tmp_path: pathlib.Path):
    run_dir = tmp_path / "not_created"
    with MetricsWriter(run_dir, enabled=False) as w:
        w.log({"step": 1, "loss": 1.0})
    assert not run_dir.exists()


def test_unsupported_value_and_closed_writer(tmp_path: pathlib.Path):
    w = MetricsWriter(tmp_path, enabled=True)
    with pytest.raises(TypeError, match="'record.bad' has type object"):
        w.log({"bad": object()})
    w.close()
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.log({"step": 1})


def test_to_jsonable_scalars():
    assert to_jsonable(torch.tensor(1.5, dtype=torch.bfloat16)) == 1.5
    assert to_jsonable(np.bool_(True)) is True
    assert to_jsonable((1, 2)) == [1, 2]


def test_format_step_line_full():
    rec = {"step": 10, "loss": 3.45214, "lr": 3e-4, "grad_norm": 1.2344, "tokens_per_s": 12345.4, "mfu": 0.123}
    assert format_step_line(rec, total=100) == (
        "step   10/100 | loss 3.4521 | lr 3.00e-04 | grad_norm 1.234 | 12,345 tok/s | mfu 12.3%"
    )


def test_format_step_line_aux_missing_and_extras():
    rec = {
        "step": 7,
        "max_steps": 20000,
        "loss": torch.tensor(2.0),
        "aux_loss": 0.0123,
        "step_time_s": 0.25,
        "expert_load": [[1, 2]],
    }
    assert format_step_line(rec) == "step     7/20000 | loss 2.0000 | aux_loss 0.0123 | step_time_s 0.25"
    assert format_step_line({"step": 3}) == "step    3"
    assert format_step_line({"loss": None, "grad_norm": float("nan")}) == "loss n/a | grad_norm nan"


def test_format_step_line_peak_memory_last_and_per_rank_list_hidden():
    rec = {
        "step": 5,
        "loss": 2.5,
        "tokens_per_s": 1000.0,
        "peak_mem_bytes": [3 * 2**30, 1536 * 2**20],
        "peak_mem_max_bytes": 3 * 2**30,
    }
    assert format_step_line(rec) == "step    5 | loss 2.5000 | 1,000 tok/s | peak mem 3 GiB"


class _TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_non_tty_prints_about_every_ten_percent():
    out = io.StringIO()
    bar = ProgressBar(total=100, enabled=True, stream=out)
    for step in range(1, 101):
        bar.update(step, postfix=f"loss {1.0 / step:.3f}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # Step 1, then each decile 10, 20, ..., 100.
    assert len(lines) == 11
    assert lines[0].startswith("  1.0% [")
    assert " 1/100 " in lines[0] and "elapsed " in lines[0] and "eta " in lines[0]
    assert lines[-1].startswith("100.0% [" + "#" * ProgressBar.WIDTH + "]")
    assert lines[-1].endswith("| loss 0.010")


def test_progress_bar_non_tty_close_prints_final_state():
    out = io.StringIO()
    bar = ProgressBar(total=100, enabled=True, stream=out)
    bar.update(1)
    bar.update(5)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and " 5/100 " in lines[1]


def test_progress_bar_tty_redraws_in_place():
    out = _TTY()
    bar = ProgressBar(total=4, enabled=True, stream=out)
    bar.update(1, "loss 10.0000")
    bar.update(2)
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    first, second = text.split("\r")[1:]
    # The shorter second draw pads over the longer first one.
    assert len(second.rstrip("\n")) >= len(first)
    assert "50.0%" in second and "2/4" in second


def test_progress_bar_render_eta():
    bar = ProgressBar(total=10, enabled=True, stream=io.StringIO())
    assert bar.render(5, elapsed=30.0) == " 50.0% [############............]  5/10 elapsed 00:30 eta 00:30"
    assert "eta ?" in bar.render(0, elapsed=1.0)
    assert "elapsed 1:01:01" in bar.render(1, elapsed=3661.0)


def test_progress_bar_disabled_prints_nothing():
    out = _TTY()
    bar = ProgressBar(total=10, enabled=False, stream=out)
    for s in range(1, 11):
        bar.update(s)
    bar.close()
    assert out.getvalue() == ""
