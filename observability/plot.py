"""Plot a run's training curves from ``metrics.jsonl`` into a PNG.

    python -m meshtron.observability.plot RUN_DIR [--out PNG]

Reads ``RUN_DIR/metrics.jsonl`` and writes ``RUN_DIR/curves.png`` (or ``--out``): loss (and
``val_loss`` where logged) and tokens/s against the step, plus the learning rate, the
gradient norm, the peak memory and the MoE expert imbalance when the records have them.
Errors (missing directory or file, an empty or unreadable file, a malformed line, an
unwritable ``--out``) print one line ``meshtron-plot: error: ...`` and exit with status 2.
Needs matplotlib (the ``viz`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any

# Not imported from observability.metrics: keep `python -m meshtron.observability.plot` free of torch (fast to start).
METRICS_FILENAME = "metrics.jsonl"
__all__ = ["PlotError", "load_metrics", "plot_run", "main"]

DEFAULT_PNG = "curves.png"
_PROG = "meshtron-plot"


class PlotError(Exception):
    """A run directory or metrics file that cannot be plotted; the message is one line."""


def load_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, one per step (the last one logged for it), in
    step order. Blank lines are ignored.

    Raises PlotError for a missing or unreadable file, a file without records, a line that is
    not UTF-8 or not a JSON object (naming the line number) or a record without a numeric
    ``step``.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise PlotError(f"{path} not found (is this a meshtron run directory?)")
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as err:
        raise PlotError(f"cannot read {path}: {err.strerror}") from None
    records: list[dict[str, Any]] = []
    for lineno, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise PlotError(
                f"{path} line {lineno}: not UTF-8 text (byte {err.start + 1}); the file is corrupt"
            ) from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PlotError(f"{path} line {lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise PlotError(f"{path} line {lineno}: expected a JSON object, got {type(record).__name__}")
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            raise PlotError(f"{path} line {lineno}: the record has no numeric 'step'")
        if not math.isfinite(step):
            raise PlotError(f"{path} line {lineno}: step={step} is not a finite number")
        records.append(record)
    if not records:
        raise PlotError(f"{path} is empty: no metrics were logged yet")
    # A resumed run appends to the file and logs the steps after its checkpoint again: the
    # last record of a step wins, in step order.
    latest = {record["step"]: record for record in records}
    return [latest[step] for step in sorted(latest)]


def _series(records: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    """(steps, values) of the records where ``key`` is a finite number (``null`` = NaN/inf: skipped)."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        steps.append(float(record["step"]))
        values.append(float(value) * scale)
    return steps, values


# (title, y label, [(key, legend label, scale)], log y) in display order; a panel is drawn
# when at least one of its keys has a value. Loss and throughput are always drawn.
_PANELS: tuple[tuple[str, str, tuple[tuple[str, str, float], ...], bool], ...] = (
    ("loss", "cross-entropy", (("loss", "train", 1.0), ("val_loss", "val", 1.0)), False),
    ("throughput", "tokens/s", (("tokens_per_s", "tokens/s", 1.0),), False),
    ("learning rate", "lr", (("lr", "lr", 1.0),), False),
    ("gradient norm (before clipping)", "grad norm", (("grad_norm", "grad norm", 1.0),), True),
    ("peak memory (max over ranks)", "GiB", (("peak_mem_max_bytes", "peak", 1.0 / 2**30),), False),
    ("MoE expert imbalance (worst layer)", "max/mean tokens", (("expert_imbalance", "imbalance", 1.0),), False),
)
_ALWAYS = {"loss", "throughput"}


def plot_run(run_dir: str | pathlib.Path, out: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write the curves of ``run_dir/metrics.jsonl`` to ``out`` (default ``run_dir/curves.png``)."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.exists():
        raise PlotError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir} is not a directory: give the run directory that holds {METRICS_FILENAME}")
    records = load_metrics(run_dir / METRICS_FILENAME)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PlotError(
            f"plotting needs matplotlib ({err}); pip install matplotlib (or pip install -e '.[viz]')"
        ) from None

    panels = []
    for title, ylabel, keys, log_y in _PANELS:
        lines = [(label, *_series(records, key, scale)) for key, label, scale in keys]
        lines = [line for line in lines if line[1]]
        if lines or title in _ALWAYS:
            panels.append((title, ylabel, lines, log_y))
    ncols = 2
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 3.4 * nrows), squeeze=False)
    for ax, (title, ylabel, lines, log_y) in zip(axes.flat, panels):
        for label, steps, values in lines:
            marker = "o" if len(steps) <= 20 or label == "val" else None
            ax.plot(steps, values, label=label, marker=marker, markersize=3, linewidth=1.2)
        if not lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        elif log_y and all(v > 0 for _, _, values in lines for v in values):
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)  # plain values, no "1e-7+1" offset
        if len(lines) > 1:
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"{run_dir.resolve().name}: {len(records)} logged steps, last step {records[-1]['step']}")
    fig.tight_layout()
    out_path = pathlib.Path(out) if out is not None else run_dir / DEFAULT_PNG
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_path, dpi=100, format="png")
    except OSError as err:
        raise PlotError(f"cannot write {out_path}: {err}") from None
    finally:
        plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=_PROG, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help=f"PNG to write (default RUN_DIR/{DEFAULT_PNG})")
    args = parser.parse_args(argv)
    try:
        path = plot_run(args.run_dir, args.out)
    except PlotError as err:
        print(f"{_PROG}: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"{_PROG}: wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
