"""Tests for `python -m meshtron.observability.plot RUN_DIR`: the PNG and the one-line errors."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

REPO = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plot(*args: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("MPLBACKEND", None)  # the module itself must pick Agg
    return subprocess.run(
        [sys.executable, "-m", "meshtron.observability.plot", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _write_run(run_dir: pathlib.Path, moe: bool = False) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in [1, *range(10, 101, 10)]:
        rec = {
            "step": step,
            "loss": 5.0 - step / 40,
            "lr": 1e-3 * min(1.0, step / 20),
            "grad_norm": 2.0 / step**0.5,
            "tokens_per_s": 1000.0 + step,
            "mfu": 0.1,
            "step_time_s": 0.2,
            "skipped_steps": 0,
            "peak_mem_bytes": [2**30, 2**30 + step],
            "peak_mem_max_bytes": 2**30 + step,
        }
        if step % 50 == 0:
            rec["val_loss"] = 5.1 - step / 40
        if moe:
            rec |= {
                "expert_imbalance": 1.5,
                "moe": [{"layer": 0, "tokens_per_expert": [3, 1], "imbalance": 1.5, "dropped_fraction": 0.0}],
            }
        if step == 20:
            rec["grad_norm"] = None  # a non-finite value written as null
        lines.append(json.dumps(rec))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n\n")


@pytest.mark.timeout(60)
def test_plot_writes_png_default_and_out(tmp_path: pathlib.Path):
    run = tmp_path / "run"
    _write_run(run, moe=True)
    result = _plot(run, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    png = run / "curves.png"
    assert str(png) in result.stdout
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000

    out = tmp_path / "elsewhere" / "c.png"
    result = _plot(run, "--out", out, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_plot_in_process_minimal_records(tmp_path: pathlib.Path):
    from meshtron.observability.metrics import METRICS_FILENAME
    from meshtron.observability.plot import METRICS_FILENAME as plot_name
    from meshtron.observability.plot import plot_run

    assert plot_name == METRICS_FILENAME

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')  # no lr/grad norm/throughput
    path = plot_run(tmp_path)
    assert path == tmp_path / "curves.png" and path.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_dir", "run directory .* does not exist"),
        ("missing_file", r"metrics.jsonl not found"),
        ("empty_file", r"metrics.jsonl is empty"),
        ("bad_json", r"metrics.jsonl line 2: not valid JSON"),
        ("not_object", r"metrics.jsonl line 3: expected a JSON object, got list"),
        ("no_step", r"metrics.jsonl line 1: the record has no numeric 'step'"),
        ("not_utf8", r"metrics.jsonl line 2: not UTF-8 text \(byte 13\); the file is corrupt"),
        ("nan_step", r"metrics.jsonl line 1: step=nan is not a finite number"),
        ("run_is_a_file", r"run is not a directory: give the run directory that holds metrics.jsonl"),
        ("metrics_is_a_dir", r"metrics.jsonl not found"),
    ],
)
def test_plot_errors_are_one_line_exit_2(tmp_path: pathlib.Path, case: str, expected: str):
    import re

    run = tmp_path / "run"
    if case == "run_is_a_file":
        run.write_text("not a run")
    elif case != "missing_dir":
        run.mkdir()
    contents = {
        "empty_file": "\n",
        "bad_json": '{"step": 1, "loss": 2}\n{"step": 2, "loss": \n',
        "not_object": '{"step": 1}\n\n[1, 2]\n',
        "no_step": '{"loss": 2.0}\n',
        "nan_step": '{"step": NaN, "loss": 2.0}\n',
    }
    if case in contents:
        (run / "metrics.jsonl").write_text(contents[case])
    elif case == "not_utf8":
        (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, \xff}\n')
    elif case == "metrics_is_a_dir":
        (run / "metrics.jsonl").mkdir()
    result = _plot(run, tmp_path=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtron-plot: error: "), result.stderr
    assert re.search(expected, lines[0]), lines[0]
    assert case == "run_is_a_file" or not (run / "curves.png").exists()


def test_resumed_runs_keep_the_last_record_of_each_step(tmp_path: pathlib.Path):
    from meshtron.observability.plot import load_metrics

    lines = [
        {"step": 1, "loss": 5.0},
        {"step": 2, "loss": 4.0},
        {"step": 3, "loss": 3.9},
        {"step": 3, "loss": 3.5},
        {"step": 4, "loss": 3.0},
    ]  # killed after 3, resumed from 2
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [(r["step"], r["loss"]) for r in load_metrics(path)] == [(1, 5.0), (2, 4.0), (3, 3.5), (4, 3.0)]


@pytest.mark.timeout(60)
def test_unwritable_out_is_one_line_and_the_old_png_stays(tmp_path: pathlib.Path):
    run = tmp_path / "run"
    _write_run(run)
    (run / "curves.png").write_bytes(b"old png")
    (tmp_path / "afile").write_text("a file")
    for out in (tmp_path / "afile" / "c.png", run):  # parent is a file; out is a directory
        result = _plot(run, "--out", out, tmp_path=tmp_path)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"meshtron-plot: error: cannot write {out}: "), result.stderr
    assert (run / "curves.png").read_bytes() == b"old png"
    assert (tmp_path / "afile").read_text() == "a file"
