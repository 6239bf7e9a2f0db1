"""What a training job reports, written once for the training loop and the parameter-server
workers: the learning-rate schedule of a run, a rank's microbatches (training and held-out),
which steps are logged, tokens/s and MFU over the steps since the last log, and where a logged
record goes (metrics.jsonl and TensorBoard on rank 0, the console line).

Nothing here communicates; the records' values (loss, grad norm, peak memory) are reduced by
their callers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshtron.observability.metrics import MetricsWriter, TensorBoardWriter, format_step_line
from meshtron.training.schedule import lr_at


def lr_schedule(run) -> Callable[[int], float]:
    """The learning rate of step index k (0-based) of `run` (RunConfig): warm-up, then decay."""
    o, t = run.optim, run.trainer

    def schedule(step: int) -> float:
        return lr_at(
            step,
            lr=o.lr,
            warmup_steps=run.warmup_steps,
            max_steps=t.max_steps,
            min_lr_ratio=o.min_lr_ratio,
            decay=o.decay,
        )

    return schedule


def split_microbatches(inputs: torch.Tensor, targets: torch.Tensor, micro: int) -> list:
    """Consecutive rows of a rank's batch, `micro` at a time."""
    return [(inputs[i : i + micro], targets[i : i + micro]) for i in range(0, len(inputs), micro)]


def val_microbatches(dataset, trainer, dp_rank: int, dp_size: int, micro: int, device) -> list:
    """Replica `dp_rank` of `dp_size`'s microbatches of the `trainer.eval_batches` fixed
    held-out global batches."""
    out = []
    for index in range(trainer.eval_batches):
        inputs, targets = dataset.local_batch(index, trainer.global_batch_size, dp_rank, dp_size, split="val")
        out += split_microbatches(inputs.to(device), targets.to(device), micro)
    return out


class StepReporter:
    """Logging cadence, throughput and the sinks of one training job.

    A step (1-based number `n`) is logged when it is the first one logged (`first`), every
    `trainer.log_every`, the last, or an evaluation step (`trainer.eval_every`, and the last).
    `throughput()` gives tokens/s, MFU (model FLOPs per token x tokens/s over `peak_flops`,
    the whole job's peak) and the mean step time over the steps `tick`ed since the last call.
    `emit` writes a record to metrics.jsonl and TensorBoard when `write` (rank 0's writers) and
    prints its line when `show`.
    """

    def __init__(
        self,
        run_dir: Path,
        trainer,
        *,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float,
        first: int,
        write: bool,
        show: bool,
        tensorboard: bool = False,
    ):
        self.trainer, self.first, self.show = trainer, first, show
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.writer = MetricsWriter(run_dir, enabled=write)
        self.tb = TensorBoardWriter(run_dir, enabled=write and tensorboard)
        self.history: list[dict] = []
        self._window_start, self._window_steps = time.perf_counter(), 0

    def eval_due(self, n: int) -> bool:
        every = self.trainer.eval_every
        return every > 0 and (n % every == 0 or n == self.trainer.max_steps)

    def log_due(self, n: int) -> bool:
        t = self.trainer
        return n == self.first or n % t.log_every == 0 or n == t.max_steps or self.eval_due(n)

    def tick(self) -> None:
        """One more step in the current throughput window."""
        self._window_steps += 1

    def throughput(self) -> dict:
        """tokens/s, MFU and step time over the window; starts a new window."""
        elapsed = time.perf_counter() - self._window_start
        tokens_per_s = self.tokens_per_step * self._window_steps / elapsed
        out = {
            "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / self.peak_flops,
            "step_time_s": elapsed / self._window_steps,
        }
        self._window_start, self._window_steps = time.perf_counter(), 0
        return out

    def emit(self, record: dict, line: dict | None = None) -> None:
        """Keep `record` in `history`, write it, and print `line` (default: the record)."""
        self.history.append(record)
        self.writer.log(record)
        self.tb.log(record)
        if self.show:
            print(format_step_line(record if line is None else line, total=self.trainer.max_steps), flush=True)

    def summary(self, steps: int, run_dir: Path, **extra) -> dict:
        """The job's summary: first and last logged loss, steps, run dir and every record."""
        h = self.history
        return {
            "first_loss": h[0]["loss"] if h else None,
            "last_loss": h[-1]["loss"] if h else None,
            "steps": steps,
            **extra,
            "run_dir": str(run_dir),
            "history": h,
        }

    def close(self) -> None:
        self.tb.close()
        self.writer.close()
