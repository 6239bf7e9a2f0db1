"""Metrics and console logging: ``metrics.jsonl`` writer, TensorBoard scalars, a step line,
a progress bar.

Only global rank 0 writes (callers pass ``enabled=(rank == 0)``); nothing here
communicates.
"""

from __future__ import annotations

import json
import math
import numbers
import pathlib
import sys
import time
from typing import Any, TextIO

import torch

__all__ = [
    "METRICS_FILENAME",
    "TENSORBOARD_DIRNAME",
    "MetricsWriter",
    "ProgressBar",
    "TensorBoardWriter",
    "format_step_line",
    "record_scalars",
    "require_tensorboard",
    "to_jsonable",
]

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tb"


def to_jsonable(value: Any, key: str = "value") -> Any:
    """Return ``value`` as plain JSON data: tensors/numpy values become Python numbers or lists.

    0-dim tensors and numpy scalars become ``int``/``float``/``bool``; tensors and arrays
    with a dimension become (nested) lists; dicts, lists and tuples are converted
    element-wise. Non-finite floats (NaN, +-inf) become ``None`` (JSON ``null``).
    Anything else (other than str/None) raises TypeError naming ``key``.
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return to_jsonable(value.item() if value.dim() == 0 else value.tolist(), key)
    # numpy scalars and arrays, without importing numpy here.
    if type(value).__module__ == "numpy":
        if hasattr(value, "tolist"):
            return to_jsonable(value.tolist(), key)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, f"{key}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"metric {key!r} has type {type(value).__name__}, which cannot be written to "
        f"{METRICS_FILENAME}; log numbers, strings, tensors, or lists/dicts of them"
    )


class MetricsWriter:
    """Append one JSON object per ``log`` call to ``run_dir/metrics.jsonl``.

    Only the writer built with ``enabled=True`` (global rank 0) touches the file; a
    disabled writer does nothing and creates nothing. Each line is flushed as it is
    written so other tools can tail the file during training. Tensors and numpy values
    are converted to Python numbers (see ``to_jsonable``); **non-finite floats (NaN, inf)
    are written as ``null``** so every line is strict JSON. The file is opened in append
    mode, so a resumed run continues the same file.
    """

    def __init__(self, run_dir: str | pathlib.Path, enabled: bool) -> None:
        self.enabled = bool(enabled)
        self.path = pathlib.Path(run_dir) / METRICS_FILENAME
        self._file: TextIO | None = None
        self._closed = False
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one JSON line and flush it (no-op when disabled)."""
        if self._closed:
            raise RuntimeError(f"MetricsWriter for {self.path} is closed")
        if not self.enabled:
            return
        if not isinstance(record, dict):
            raise TypeError(f"a metrics record must be a dict, got {type(record).__name__}")
        line = json.dumps(to_jsonable(record, "record"), allow_nan=False, separators=(",", ":"))
        assert self._file is not None
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; calling it again is harmless."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._closed = True

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real) or (type(value).__module__ == "numpy" and getattr(value, "ndim", 1) == 0)


def _num(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().reshape(()).item())
    return float(value)


def _fmt(value: Any, spec: str) -> str:
    f = _num(value)
    if f is None:
        return "n/a"
    if not math.isfinite(f):
        return str(f)
    return format(f, spec)


# (key, label, format spec) in display order; loss-like values first, then optimizer, speed.
_KNOWN_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("loss", "loss", ".4f"),
    ("val_loss", "val_loss", ".4f"),
    ("aux_loss", "aux_loss", ".4f"),
    ("z_loss", "z_loss", ".4f"),
    ("lr", "lr", ".2e"),
    ("grad_norm", "grad_norm", ".3f"),
)
_SKIP_EXTRA = {"step", "max_steps", "tokens_per_s", "mfu", "peak_mem_max_bytes"}


def format_step_line(record: dict[str, Any], total: int | None = None) -> str:
    """Return one human-readable line for a metrics record.

    Example: ``step   10/100 | loss 3.4521 | lr 3.00e-04 | grad_norm 1.234 |
    12,345 tok/s | mfu 12.3%``. ``total`` (or ``record["max_steps"]``) gives the
    ``/100`` part. ``mfu`` is a fraction (0.123 prints as ``12.3%``);
    ``peak_mem_max_bytes`` prints last as ``peak mem 1.2 GiB``. Missing keys are
    skipped; other scalar fields (e.g. ``step_time_s``) are appended as ``key value``;
    list/dict fields (per-layer expert load) are left to the JSON file. ``None`` prints as
    ``n/a``.
    """
    parts: list[str] = []
    total = total if total is not None else record.get("max_steps")
    if "step" in record:
        step = int(_num(record["step"]) or 0)
        if total is not None:
            width = max(4, len(str(int(total))))
            parts.append(f"step {step:>{width}}/{int(total)}")
        else:
            parts.append(f"step {step:>4}")
    for key, label, spec in _KNOWN_FIELDS:
        if key in record:
            parts.append(f"{label} {_fmt(record[key], spec)}")
    known = {k for k, _, _ in _KNOWN_FIELDS}
    for key, value in record.items():
        if key in known or key in _SKIP_EXTRA:
            continue
        if value is None or _is_number(value):
            parts.append(f"{key} {_fmt(value, '.4g')}")
    if "tokens_per_s" in record:
        parts.append(f"{_fmt(record['tokens_per_s'], ',.0f')} tok/s")
    if "mfu" in record:
        mfu = _num(record["mfu"])
        parts.append("mfu n/a" if mfu is None else f"mfu {_fmt(mfu * 100.0, '.1f')}%")
    if "peak_mem_max_bytes" in record:
        from meshtron.observability.memory import format_bytes

        parts.append(f"peak mem {format_bytes(_num(record['peak_mem_max_bytes']))}")
    return " | ".join(parts)


def require_tensorboard() -> None:
    """Raise ``ConfigError`` (one line, says what to install) if TensorBoard cannot be imported.

    Call it while validating the config (``trainer.tensorboard=true``), before any process
    group exists, so every rank fails the same way with exit status 2.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as err:
        from meshtron.errors import ConfigError

        raise ConfigError(
            f"trainer.tensorboard=true needs the tensorboard package ({err}); "
            "pip install tensorboard (or pip install -e '.[viz]'), or set trainer.tensorboard=false"
        ) from err


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a metrics record as ``{tag: value}`` for TensorBoard.

    Every numeric top-level field except ``step`` (ints, floats, 0-dim tensors and numpy
    scalars; bools, strings, ``None``, lists and dicts are skipped), plus the per-layer MoE
    routing of ``record["moe"]`` as ``moe/layer{i}/imbalance`` and
    ``moe/layer{i}/dropped_fraction`` (``i`` is the entry's ``layer``, else its position).
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not _is_number(value):
            continue
        out[str(key)] = float(_num(value))
    moe = record.get("moe")
    if isinstance(moe, (list, tuple)):
        for position, layer in enumerate(moe):
            if not isinstance(layer, dict):
                continue
            index = layer.get("layer", position)
            for field in ("imbalance", "dropped_fraction"):
                value = layer.get(field)
                if value is not None and not isinstance(value, bool) and _is_number(value):
                    out[f"moe/layer{int(_num(index))}/{field}"] = float(_num(value))
    return out


class TensorBoardWriter:
    """Write the scalars of each metrics record to TensorBoard event files in ``run_dir/tb/``.

    ``log(record)`` adds every scalar of ``record_scalars(record)`` at ``record["step"]``
    and flushes, so ``tensorboard --logdir RUN_DIR/tb`` shows the run while it trains.
    A disabled writer (``enabled=False``: ``trainer.tensorboard=false``, or any rank but 0)
    imports nothing, creates nothing and ignores ``log``. An enabled writer without the
    tensorboard package raises ``ConfigError`` saying what to install.
    """

    def __init__(self, run_dir: str | pathlib.Path, enabled: bool) -> None:
        self.enabled = bool(enabled)
        self.log_dir = pathlib.Path(run_dir) / TENSORBOARD_DIRNAME
        self._writer = None
        if self.enabled:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, record: dict[str, Any]) -> None:
        """Add the record's scalars at its ``step`` (no-op when disabled or closed)."""
        if self._writer is None:
            return
        if "step" not in record:
            raise ValueError("a metrics record needs a 'step' to be written to TensorBoard")
        step = int(_num(record["step"]))
        for tag, value in record_scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; calling it again is harmless."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    hours, rem = divmod(s, 3600)
    minutes, secs = divmod(rem, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class ProgressBar:
    """A one-line text progress bar with percentage, steps, elapsed time and ETA.

    On a TTY it redraws in place with ``\\r``; otherwise (a log file, a pipe) it prints a
    full line only when progress crosses another 10% (and at the end), so logs stay short.
    Disabled bars (``enabled=False``, every rank but 0) print nothing.
    """

    WIDTH = 24

    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr) -> None:
        if total <= 0:
            raise ValueError(f"ProgressBar total must be positive, got {total}")
        self.total = int(total)
        self.enabled = bool(enabled)
        self.stream = stream
        self.start_time = time.monotonic()
        try:
            self.is_tty = bool(stream.isatty())
        except (AttributeError, ValueError):
            self.is_tty = False
        self._last_len = 0
        self._last_decile = -1
        self._last_printed_step: int | None = None
        self._last_step: int | None = None
        self._last_postfix = ""
        self._closed = False

    def render(self, step: int, postfix: str = "", elapsed: float | None = None) -> str:
        """Return the bar text for ``step`` completed steps (no ``\\r`` or newline)."""
        step = max(0, min(int(step), self.total))
        if elapsed is None:
            elapsed = time.monotonic() - self.start_time
        frac = step / self.total
        filled = int(frac * self.WIDTH)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        eta = elapsed / step * (self.total - step) if step > 0 else float("nan")
        width = len(str(self.total))
        text = (
            f"{frac * 100:5.1f}% [{bar}] {step:>{width}}/{self.total} "
            f"elapsed {_format_duration(elapsed)} eta {_format_duration(eta)}"
        )
        return f"{text} | {postfix}" if postfix else text

    def update(self, step: int, postfix: str = "") -> None:
        """Show progress after ``step`` completed steps (1..total); ``postfix`` is appended."""
        if not self.enabled or self._closed:
            return
        self._last_step, self._last_postfix = int(step), postfix
        text = self.render(step, postfix)
        if self.is_tty:
            pad = " " * max(0, self._last_len - len(text))
            self.stream.write("\r" + text + pad)
            self._last_len = len(text)
            self.stream.flush()
            return
        decile = min(10, int(10 * max(0, step) / self.total))
        if decile > self._last_decile or step >= self.total and self._last_printed_step != step:
            self._last_decile = decile
            self._last_printed_step = int(step)
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Finish the bar: end the TTY line, or print the last state if it was not shown."""
        if not self.enabled or self._closed:
            self._closed = True
            return
        if self.is_tty:
            if self._last_len:
                self.stream.write("\n")
        elif self._last_step is not None and self._last_printed_step != self._last_step:
            self.stream.write(self.render(self._last_step, self._last_postfix) + "\n")
        self.stream.flush()
        self._closed = True

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
