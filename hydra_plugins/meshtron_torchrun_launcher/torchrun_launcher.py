"""A Hydra launcher that runs each sweep point under its own `torchrun`:

    python train.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=2 parallel.tp=1,2

Each point is one `torchrun --standalone` subprocess (a fresh rendezvous on a free port, so
points with different layouts never share process groups), run one after another in the
point's own dir under the sweep dir. A point that fails (exit code, or `timeout_s`) is
recorded and the sweep goes on; `sweep_summary.jsonl` in the sweep dir gets one line per
point: overrides, status, exit code, the error line, final loss, tokens/s, peak memory and
run dir. The parent exits 1 after the sweep when any point failed.

This module imports no torch: Hydra imports every plugin module on every start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)

SUMMARY = "sweep_summary.jsonl"
JOB_LOG = "torchrun.log"
# Hydra's own command-line options the child needs to find the same config.
_CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")
# Hydra overrides that belong to the sweep, not to a point's run.
_SWEEP_ONLY = (
    "hydra/launcher=",
    "hydra.launcher.",
    "hydra/sweeper=",
    "hydra.sweeper.",
    "hydra.sweep.",
    "hydra.mode=",
    "hydra.run.dir=",
)
# A launcher's variables must not leak into the children's own torchrun.
_LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_ERROR_FILE",
)


class TorchrunLauncher(Launcher):
    """Runs sweep points one at a time, each as `torchrun --standalone --nproc_per_node=N SCRIPT
    OVERRIDES hydra.run.dir=POINT_DIR` (configs/hydra/launcher/torchrun.yaml)."""

    def __init__(
        self,
        nproc_per_node: int = 1,
        timeout_s: float | None = None,
        torchrun_args: Sequence[str] = (),
        script: str | None = None,
    ) -> None:
        # train.py refuses these in one line before Hydra builds the launcher (Hydra reports an
        # error here in several lines); the script is checked by `setup`, in one line
        error = option_error(nproc_per_node, timeout_s, torchrun_args)
        if error:
            raise ValueError(error)
        self.nproc_per_node = nproc_per_node
        self.timeout_s = timeout_s
        self.torchrun_args = [str(a) for a in torchrun_args]
        self.script = script
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        script = self.script or sys.argv[0]
        if not os.path.isfile(script):  # before any point runs, not at the first point's torchrun
            _refuse(_script_error(script, self.script is None))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Run each point's torchrun to its end, append its record to the summary, and exit 1
        once all are done if any failed."""
        assert self.config is not None and self.hydra_context is not None
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank would run the whole sweep
            _refuse(
                "hydra/launcher=torchrun starts one torchrun per sweep point; "
                "start the sweep with python, not under torchrun"
            )
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        summary = sweep_dir / SUMMARY
        if initial_job_idx == 0:
            summary.write_text("")
        log.info(f"Launching {len(job_overrides)} jobs, each under torchrun --nproc_per_node={self.nproc_per_node}")
        returns, failed = [], []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            record = self._run_point(idx, list(overrides), sweep_dir)
            with summary.open("a") as f:
                f.write(json.dumps(record) + "\n")
            ok = record["status"] == "completed"
            if not ok:
                failed.append(record)
            returns.append(
                JobReturn(
                    overrides=list(overrides),
                    working_dir=record["run_dir"],
                    task_name=str(self.config.hydra.job.name),
                    status=JobStatus.COMPLETED if ok else JobStatus.FAILED,
                    _return_value=record if ok else RuntimeError(record["error"]),
                )
            )
        for record in failed:
            print(
                f"meshtron: sweep point #{record['job']} ({' '.join(record['overrides'])}) {record['status']} "
                f"(exit code {record['exit_code']}): {record['error']}",
                file=sys.stderr,
                flush=True,
            )
        if failed:
            print(
                f"meshtron: {len(failed)} of {len(job_overrides)} sweep points failed; see {summary}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1)
        return returns

    def _run_point(self, idx: int, overrides: list[str], sweep_dir: Path) -> dict[str, Any]:
        """Compose the point's config (for its dir), run its torchrun, and read its metrics."""
        record: dict[str, Any] = {
            "job": idx,
            "overrides": overrides,
            "status": "failed",
            "exit_code": None,
            "error": None,
            "final_step": None,
            "final_loss": None,
            "tokens_per_s": None,
            "peak_mem_bytes": None,
            "run_dir": str(sweep_dir / str(idx)),
            "wall_s": None,
        }
        try:
            point = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(point):
                point.hydra.job.id = idx
                point.hydra.job.num = idx
            run_dir = Path(str(point.hydra.sweep.dir)) / str(point.hydra.sweep.subdir)
        except Exception as err:  # noqa: BLE001 - Hydra cannot compose this point: record why
            record["error"] = _first_line(str(err)) or type(err).__name__
            return record
        run_dir.mkdir(parents=True, exist_ok=True)
        record["run_dir"] = str(run_dir)
        start = time.perf_counter()
        code, timed_out = self._torchrun(overrides, run_dir)
        record["wall_s"] = round(time.perf_counter() - start, 3)
        record["exit_code"] = code
        record["status"] = "timeout" if timed_out else "completed" if code == 0 else "failed"
        if record["status"] != "completed":
            record["error"] = (
                f"no exit within hydra.launcher.timeout_s={self.timeout_s}"
                if timed_out
                else _error_line(run_dir / JOB_LOG)
            )
        record.update(_metrics_summary(run_dir / "metrics.jsonl"))
        return record

    def _command(self, overrides: list[str], run_dir: Path) -> list[str]:
        script = self.script or sys.argv[0]
        hydra_overrides = [o for o in self.config.hydra.overrides.hydra if not o.startswith(_SWEEP_ONLY)]
        return [
            sys.executable,
            "-m",
            "hydra_plugins.meshtron_torchrun_launcher._torchrun",
            "--standalone",
            f"--nproc_per_node={self.nproc_per_node}",
            *self.torchrun_args,
            os.path.abspath(script),
            *_config_flags(sys.argv[1:]),
            *overrides,
            *hydra_overrides,
            f"hydra.run.dir={run_dir}",
        ]

    def _torchrun(self, overrides: list[str], run_dir: Path) -> tuple[int | None, bool]:
        """(exit code, timed out) of the point's torchrun; its output goes to the console and
        to RUN_DIR/torchrun.log. On timeout the whole process group is ended."""
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
        cmd = self._command(overrides, run_dir)
        with (run_dir / JOB_LOG).open("w") as logfile:
            logfile.write(" ".join(cmd) + "\n")
            logfile.flush()
            proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
            pump = threading.Thread(target=_tee, args=(proc.stdout, logfile), daemon=True)
            pump.start()
            try:
                proc.wait(timeout=self.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _end_group(proc)
                timed_out = True
            pump.join(timeout=10)
        return (None if timed_out else proc.returncode), timed_out


def option_error(nproc_per_node: Any, timeout_s: Any = None, torchrun_args: Any = (), script: Any = None) -> str | None:
    """The one-line error for the first bad option of configs/hydra/launcher/torchrun.yaml, None
    if all are fine. train.py checks the command line with it before Hydra starts
    (`launcher_override_error` in training/distributed.py); the launcher checks its options
    again when Hydra builds it (ValueError) and the script when Hydra sets it up (one line)."""
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        return (
            f"hydra.launcher.nproc_per_node={nproc_per_node!r} must be an integer >= 1 "
            f"(the processes of each sweep point's torchrun), e.g. hydra.launcher.nproc_per_node=2"
        )
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
    ):
        return f"hydra.launcher.timeout_s={timeout_s!r} must be > 0 or null (seconds a point may run; null: no limit)"
    if isinstance(torchrun_args, (str, bytes)) or not isinstance(torchrun_args, Sequence):
        return (
            f"hydra.launcher.torchrun_args={torchrun_args!r} must be a list, "
            f"e.g. hydra.launcher.torchrun_args=[--max-restarts=1]"
        )
    if script is not None and not os.path.isfile(str(script)):
        return _script_error(str(script), False)
    return None


def _script_error(script: str, from_argv: bool) -> str:
    if from_argv:
        return (
            f"hydra/launcher=torchrun runs the sweep's own script {script!r} under torchrun, but it is not a "
            f"file; set hydra.launcher.script=PATH to the training script (e.g. train.py)"
        )
    return (
        f"hydra.launcher.script={script!r} is not a file; set it to the training script, "
        f"e.g. hydra.launcher.script=train.py"
    )


def _refuse(error: str) -> None:
    """Exit 2 with one line, as meshtron's entries do for a configuration error (SystemExit
    passes through Hydra's error reporting, which would add a traceback or a multi-line report)."""
    sys.stderr.write(f"meshtron: configuration error: {error}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def _tee(stream, logfile) -> None:
    for line in stream:
        logfile.write(line)
        logfile.flush()
        sys.stdout.write(line)
        sys.stdout.flush()


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM the point's process group (torchrun forwards it; meshtron checkpoints on it),
    then SIGKILL what is left after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _config_flags(argv: list[str]) -> list[str]:
    """Hydra's --config-dir/--config-path/--config-name options (either spelling) in argv."""
    out, take_next = [], False
    for arg in argv:
        if take_next:
            out.append(arg)
            take_next = False
        elif arg in _CONFIG_FLAGS:
            out.append(arg)
            take_next = True
        elif arg.startswith(tuple(f"{flag}=" for flag in _CONFIG_FLAGS)):
            out.append(arg)
    return out


def _first_line(text: str) -> str | None:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else None


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(: .*)?$")


def _error_line(job_log: Path) -> str | None:
    """The run's one-line error (`meshtron: ... error: ...`), else the last exception line of a
    traceback (torchrun's own failure report follows it), else the log's last line."""
    try:
        lines = [line.strip() for line in job_log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    for line in lines:
        if line.startswith("meshtron: ") and "error" in line.split(":", 2)[1]:
            return line
    exceptions = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return exceptions[-1] if exceptions else lines[-1] if lines else None


def _metrics_summary(path: Path) -> dict[str, Any]:
    """final_step, final_loss, tokens_per_s of the last logged step and the peak memory over
    all records (max over ranks) from a run's metrics.jsonl; {} without one."""
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return {}
    if not records:
        return {}
    last = {r["step"]: r for r in records}  # a resumed run may log a step twice: keep the last
    final = last[max(last)]
    peaks = [r["peak_mem_max_bytes"] for r in records if "peak_mem_max_bytes" in r]
    return {
        "final_step": final["step"],
        "final_loss": final.get("loss"),
        "tokens_per_s": final.get("tokens_per_s"),
        "peak_mem_bytes": max(peaks) if peaks else None,
    }
