"""The training run: validated config -> process groups -> Engine (mesh, sharded model,
reducer, optimizer, executor) -> the step loop.

Everything that can be checked (config, layout against the world size, model shape, batch
sizes, the checkpoint to start from) is checked before any process group is created
(training/run_checks.py), so a bad configuration fails on every rank with the same one-line
message instead of hanging in a collective. `Trainer` runs the steps of a built engine: data,
learning rate, metrics (training/reporting.py), checkpoints, SIGTERM, the hang watchdog.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import torch

from meshtron.errors import say_one_line
from meshtron.kernels import selfcheck
from meshtron.kernels.backend import CHECKED, resolve_backend
from meshtron.kernels.tf32 import set_tf32_mode
from meshtron.models.config import ExecutionConfig
from meshtron.mpu.mappings import gather_object, world_group
from meshtron.mpu.waits import current_wait
from meshtron.observability.memory import peak_memory_per_rank
from meshtron.observability.metrics import ProgressBar
from meshtron.observability.peer_monitor import DeadPeerMonitor
from meshtron.observability.watchdog import StepWatchdog, collective_in_stack, is_collective_failure, mesh_coords
from meshtron.pipeline.trace import measured_bubble, theoretical_bubble, write_trace
from meshtron.planning.flops import model_flops_per_token
from meshtron.planning.peak import peak_flops
from meshtron.textdata.data import TokenDataset, build_dataset, document_end_id
from meshtron.training.checkpoint import AsyncCheckpointer, TrainState, hold_checkpoint_dir, new_checkpoint_group
from meshtron.training.checkpoint_files import CheckpointError, list_checkpoints, load_newest_intact
from meshtron.training.config import ConfigError, RunConfig
from meshtron.training.distributed import (
    agree_on_run_dir,
    init_distributed,
    launcher_env,
    release_process_groups,
    teardown_distributed,
)
from meshtron.training.engine import Engine, EngineConfig
from meshtron.training.fault_hooks import hang_if_asked, kill_if_asked
from meshtron.training.host_malloc import keep_freed_host_memory
from meshtron.training.local_sgd import build_local_sgd
from meshtron.training.param_server import run_parameter_server
from meshtron.training.precision import LossScaler, Precision, device_has_fast_bf16
from meshtron.training.preemption import StopRequest
from meshtron.training.reporting import StepReporter, lr_schedule, split_microbatches, val_microbatches
from meshtron.training.run_checks import StartPoint, check_run_config, check_start, checkpoint_to_start_from
from meshtron.training.step import StepResult


def run_training(run: RunConfig, run_dir: str | Path) -> dict:
    """Train (or plan, with trainer.dry_run) as configured; returns a summary dict.

    Talks over the default process group when launched by torchrun (WORLD_SIZE > 1).
    """
    wants_cuda = run.trainer.device == "cuda" or (run.trainer.device == "auto" and torch.cuda.is_available())
    device_type = "cuda" if wants_cuda else "cpu"
    run, precision_why = run.with_precision_for(device_type, device_has_fast_bf16(device_type))
    if run.parallel.dp_mode == "ps":  # parameter servers: their own world layout and loop
        return run_parameter_server(run, run_dir)
    world_size, _, _, local_world = launcher_env()
    par, micro, n_micro = check_run_config(run, world_size, local_world)
    if run.trainer.device == "cuda" and not run.trainer.dry_run and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda but this machine has no usable CUDA device "
            "(torch.cuda.is_available() is False); use trainer.device=auto or cpu"
        )
    try:
        backend = resolve_backend(run.kernels.backend, "cuda" if wants_cuda else "cpu")
    except (RuntimeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    execution = run.execution(backend)
    set_tf32_mode(run.kernels.tf32)
    dataset = None
    eos_id = document_end_id(run.data, run.model.vocab_size)  # None unless data.reset_at_eos; fails before any group
    if not run.trainer.dry_run:
        try:
            dataset = build_dataset(run.data, run.model.seq_len, run.trainer.seed, run.model.vocab_size)
        except (OSError, ValueError) as err:
            raise ConfigError(f"data: {err}") from err
    start_from = None if run.trainer.dry_run else checkpoint_to_start_from(run)
    env = init_distributed(
        run.trainer.device, timeout_s=run.trainer.collective_timeout_s, num_threads=run.trainer.num_threads
    )
    try:
        run_dir = agree_on_run_dir(run_dir)
        if run.trainer.dry_run:
            return _dry_run(run, par, env, run_dir, micro, execution)
        with hold_checkpoint_dir(run.checkpoint.dir):  # one writer per dir, writable: before any step
            engine = Engine.build(
                EngineConfig.from_run(run, execution, micro, eos_id),
                par,
                env.device,
                ranks_per_node=env.local_world_size,
                overlap_param_gather=run.optim.overlap_param_gather,
                init_weights=start_from is None,  # a start checkpoint replaces every weight
            )
            try:
                trainer = Trainer(run, engine, env, run_dir, dataset, n_micro, precision_why=precision_why)
                return trainer.train(start_from)
            finally:
                engine.close()
    finally:
        teardown_distributed()


def _dry_run(run: RunConfig, par, env, run_dir: Path, micro: int, execution: ExecutionConfig) -> dict:
    from meshtron.planning.plan import format_rank_line, plan_all_ranks, write_plan

    plan = plan_all_ranks(
        run.model,
        par,
        env.world_size,
        micro_batch_size=micro,
        global_batch_size=run.trainer.global_batch_size,
        precision=run.trainer.precision,
        zero=run.optim.zero,
        offload=run.optim.offload,
        param_dtype=run.optim.param_dtype,
        device=env.device.type,
        execution=execution,
    )
    mine = plan["ranks"][env.rank]
    print(f"[dry run] rank {env.rank}: {format_rank_line(mine)}", flush=True)
    if env.is_main:
        write_plan(run_dir / "plan.json", plan)
        print(f"[dry run] plan for {env.world_size} rank(s) written to {run_dir / 'plan.json'}", flush=True)
    return {"dry_run": True, "plan": plan, "run_dir": str(run_dir)}


class Trainer:
    """The steps of one training job on a built `Engine`: this rank's slice of each global
    batch, the learning rate, local SGD, skipped-step accounting, metrics, evaluation,
    checkpoints (every `checkpoint.every`, at the end and on SIGTERM) and hang reports.
    Collectives: the engine's step, and the logging, stop-request and checkpoint agreements
    every rank runs at the same steps."""

    def __init__(
        self,
        run: RunConfig,
        engine: Engine,
        env,
        run_dir: Path,
        dataset: TokenDataset,
        n_micro: int,
        *,
        precision_why: str = "",
    ):
        self.run, self.engine, self.env, self.run_dir, self.dataset = run, engine, env, run_dir, dataset
        self.n_micro, self.precision_why = n_micro, precision_why or f"trainer.precision={run.trainer.precision}"
        t, ckpt = run.trainer, run.checkpoint
        # checkpoint.async: the writer thread coordinates over its own gloo group, made here, at
        # startup, by every rank alike (training/checkpoint.py AsyncCheckpointer)
        self.checkpointer = (
            AsyncCheckpointer(new_checkpoint_group(t.collective_timeout_s)) if ckpt.dir and ckpt.async_ else None
        )
        self.lr_at = lr_schedule(run)
        self.watchdog = StepWatchdog(
            env.rank,
            mesh_coords(engine.mesh),
            t.collective_timeout_s / 2 if t.watchdog_timeout_s is None else t.watchdog_timeout_s,
        )
        # a dead peer of this host ends this rank even where the transport never notices (NCCL)
        self.peer_monitor = (
            DeadPeerMonitor(env.rank, mesh_coords(engine.mesh), self.watchdog) if env.world_size > 1 else None
        )
        self.stopper = StopRequest(
            enabled=ckpt.dir is not None, rank=env.rank, where=self._blocked_in, newest=self._newest_checkpoint
        )
        self.state, self.local_sgd, self.reporter, self.bar = TrainState(), None, None, None
        self._collective_failed = False

    def _blocked_in(self) -> str | None:
        """What the main thread is doing, for the SIGTERM deadline's line: phase and wait."""
        phase = self.watchdog.current_phase
        waiting = current_wait() or collective_in_stack()
        if phase and waiting:
            return f"{phase}, waiting in {waiting}"
        return phase or waiting

    def _newest_checkpoint(self) -> str | None:
        found = list_checkpoints(self.run.checkpoint.dir) if self.run.checkpoint.dir else []
        return str(found[-1]) if found else None

    def train(self, start_from: StartPoint | None) -> dict:
        """Load `start_from` (run_checks.StartPoint, or None for a fresh start), then step to
        trainer.max_steps or a SIGTERM; returns the summary (logged records in `history`)."""
        stopped_early = False
        try:
            self._start(start_from)
            first_step = self.state.step
            for step in range(first_step, self.run.trainer.max_steps):
                out = self._step(step, first_step)
                self._account(step, out)
                self._log(step, out)
                self.bar.update(step + 1)
                stopped_early = self._save_or_stop(step)
                if stopped_early:
                    break
            if self.checkpointer is not None:
                self.watchdog.phase(f"step {self.state.step}: waiting for the background checkpoint write")
                self.checkpointer.wait()  # its failure is this run's failure
            self.watchdog.idle()
        except Exception as err:
            self._close_peer_monitor()  # this error is the one to report, not the monitor's line
            if is_collective_failure(err):
                say_one_line(self.watchdog.describe_error(err, timeout_s=self.run.trainer.collective_timeout_s))
                err.meshtron_reported = True  # main_entry exits 1 on it without a traceback
                self._collective_failed = True
            raise
        finally:
            self._close()
        return self._summary(stopped_early)

    def _load_start(self, start: StartPoint) -> str:
        """Load the weights (and state, for "resume") to start from; returns what was loaded, for
        the log. A candidate whose files fail their checksums on any rank is skipped on every
        rank alike for the one before it (resume=auto), an explicit path's failure is an error
        (training/checkpoint_files.py `load_newest_intact`)."""
        if start.kind == "init_from_hf":
            read = self.engine.load_hf(start.paths[0])
            return (
                f"initial weights from the Hugging Face folder {start.paths[0]} "
                f"(this rank read {read / 2**20:,.1f} MiB: its shards)"
            )

        def load(path: Path) -> TrainState:
            if path != start.paths[0]:  # checked before any process group
                check_start(path, self.run.model, start.kind)
            return self.engine.load(path, weights_only=start.kind == "init_from")

        path, self.state = load_newest_intact(list(start.paths), load, explicit=start.explicit)
        if start.kind == "init_from":
            return f"initial weights from {path}"
        return f"resumed from {path} at step {self.state.step} ({self.state.consumed_samples:,} samples consumed)"

    def _start(self, start_from: StartPoint | None) -> None:
        """Load the checkpoint to start from, then build what depends on the loaded state."""
        run, engine, env, t = self.run, self.engine, self.env, self.run.trainer
        if start_from is not None:
            loaded = self._load_start(start_from)
            if env.is_main:
                print(f"meshtron: {loaded}", flush=True)
        # None unless optim.local_steps > 1 or an outer optimizer; after loading: DiLoCo keeps the start weights
        self.local_sgd = build_local_sgd(run.optim, engine.chunks, engine.mesh)
        scaler = LossScaler(
            scale=self.state.loss_scale or t.initial_loss_scale,
            growth_interval=t.loss_scale_window,
            good_steps=self.state.loss_scale_good_steps,
        )
        engine.precision = Precision(t.precision, env.device.type, scaler)
        # MFU against the device's bf16 peak on GPUs whatever the run computes in (the design's
        # one definition, as torchtitan and Megatron report it); CPUs have no fast 16-bit matmul,
        # so fp32's there.
        peak_per_process, peak_source = peak_flops(
            env.device, torch.bfloat16 if env.device.type == "cuda" else torch.float32
        )
        self.reporter = StepReporter(
            self.run_dir,
            t,
            tokens_per_step=t.global_batch_size * run.model.seq_len,
            flops_per_token=model_flops_per_token(run.model),
            peak_flops=peak_per_process * env.world_size,
            first=1,
            write=env.is_main,
            show=env.is_main,
            tensorboard=t.tensorboard,
        )
        self.bar = ProgressBar(t.max_steps, enabled=env.is_main and t.progress)
        if env.is_main:
            self._banner(peak_per_process * env.world_size, peak_source)

    def _banner(self, peak_total: float, peak_source: str) -> None:
        """Rank 0's lines before the first step: the mesh, placement warnings, the run's shape."""
        engine, env, cfg, t = self.engine, self.env, self.run.model, self.run.trainer
        mesh, par = engine.mesh, engine.mesh.par
        n_params = sum(p.numel() for p in engine.model.parameters())  # this rank's shards
        print(f"meshtron: {mesh.describe()}", flush=True)
        for warning in mesh.placement_warnings():  # spanning nodes is allowed, only slower (mpu/mesh.py)
            print(f"meshtron: warning: {warning}", flush=True)
        if engine.reducer.hierarchy is not None:
            print(
                f"meshtron: hierarchical dp all-reduce: {engine.reducer.hierarchy.nodes} nodes x "
                f"{engine.reducer.hierarchy.local} ranks (parallel.dp_hierarchical={par.dp_hierarchical})",
                flush=True,
            )
        print(
            f"meshtron: {cfg.arch} {cfg.num_layers}L h={cfg.hidden_size} heads={cfg.num_heads} "
            f"seq={cfg.seq_len} vocab={cfg.vocab_size}; {n_params:,} parameters on rank 0; "
            f"{len(self.dataset.split_tokens('train')):,} tokens of text; global batch {t.global_batch_size} = "
            f"dp {par.dp} x {self.n_micro} microbatches x {engine.config.micro_batch_size}; peak "
            f"{peak_total / 1e9:.1f} GFLOP/s ({peak_source}) x{env.world_size}; run dir {self.run_dir}",
            flush=True,
        )
        print(f"meshtron: compute {t.precision} ({self.precision_why})", flush=True)
        if t.compile or t.compile_moe:
            print(f"meshtron: {compiled_what(t.compile, t.compile_mode)}", flush=True)

    def _step(self, step: int, first_step: int) -> StepResult:
        """Step index `step`: this rank's microbatches through the engine, the traces asked for,
        the kernel self-check agreement after the first step, local SGD's parameter sync."""
        engine, t, mesh, env = self.engine, self.run.trainer, self.engine.mesh, self.env
        kill_if_asked(env.rank, step + 1)
        inputs, targets = self.dataset.local_batch_at(
            self.state.consumed_samples, t.global_batch_size, mesh.dp_rank, mesh.dp_size
        )
        microbatches = split_microbatches(inputs.to(env.device), targets.to(env.device), engine.config.micro_batch_size)
        self.watchdog.phase(
            f"step {step + 1}: forward/backward/grad reduce/optimizer"
            + (f" ({mesh.par.schedule} pipeline)" if engine.executor is not None else "")
        )
        hang_if_asked(env.rank, step + 1)
        gather = engine.param_gather
        traced = t.trace_step == step + 1
        if gather is not None and t.trace_step in (step + 1, step + 2) and not gather.recording:
            gather.record(True)  # the traced step's gathers are launched by the step before it
        step_start = time.perf_counter()
        out = engine.step(microbatches, self.lr_at(step))
        if traced and (engine.executor is not None or gather is not None):
            self.watchdog.phase(
                f"step {step + 1}: {'pipeline' if engine.executor is not None else 'parameter-gather'} "
                "trace gather_object"
            )
            _export_pipeline_trace(out.pipeline, mesh, len(microbatches), self.run_dir, env, gather, step_start)
        if step == first_step and engine.config.execution.kernel_backend == CHECKED:
            # Every kernel of the model ran (and was checked) in this step: make the
            # verdicts final and the same on every rank (a collective, every rank, here).
            self.watchdog.phase(f"step {step + 1}: kernel self-check agreement all_reduce")
            selfcheck.agree(env.device)
        if self.local_sgd is not None:  # every optim.local_steps steps: parameters averaged over dp
            self.watchdog.phase(f"step {step + 1}: local SGD parameter sync over dp")
            self.local_sgd.after_step(step + 1, final=step + 1 == t.max_steps)
        return out

    def _account(self, step: int, out: StepResult) -> None:
        """Advance the train state past step index `step`; count a skipped step, and stop the
        run after more than trainer.max_skipped in a row."""
        state, t, precision = self.state, self.run.trainer, self.engine.precision
        self.reporter.tick()
        state.step, state.consumed_samples = step + 1, state.consumed_samples + t.global_batch_size
        if precision.scaler is not None:
            state.loss_scale, state.loss_scale_good_steps = precision.scaler.scale, precision.scaler.good_steps
        if self.local_sgd is not None:  # each replica judged its own gradients: abort (max_skipped) together
            out.skipped = self.local_sgd.agree_skipped(out.skipped)
        if not out.skipped:
            state.skipped_in_a_row = 0
            return
        state.skipped_total += 1
        state.skipped_in_a_row += 1
        if self.env.is_main:
            print(
                f"meshtron: step {step + 1} skipped: non-finite loss or gradient norm"
                + (f" (fp16 overflow: loss scale now {precision.loss_scale:g})" if precision.scaler else "")
                + f" ({state.skipped_in_a_row} in a row, {state.skipped_total} in total)",
                flush=True,
            )
        if state.skipped_in_a_row > t.max_skipped:
            raise RuntimeError(
                f"{state.skipped_in_a_row} consecutive steps had a non-finite loss or "
                f"gradient norm (trainer.max_skipped={t.max_skipped}); lower optim.lr or "
                f"check the data"
            )

    def _log(self, step: int, out: StepResult) -> None:
        """At a logged step: the record of metrics.jsonl (evaluation and peak memory are
        collectives: every rank computes them at the same steps)."""
        n, t, engine, reporter = step + 1, self.run.trainer, self.engine, self.reporter
        if not reporter.log_due(n):
            return
        self.watchdog.phase(f"step {n}: metrics")
        loss, grad_norm = out.loss.item(), out.grad_norm.item()  # host sync only when logging
        record = {
            "step": n,
            "loss": loss,
            "lr": self.lr_at(step),
            "grad_norm": grad_norm,
            **reporter.throughput(),
            "skipped_steps": self.state.skipped_total,
        }
        if self.local_sgd is not None:
            record["local_sgd_syncs"] = self.local_sgd.syncs
        if engine.precision.scaler is not None:
            record["loss_scale"] = engine.precision.loss_scale
        if reporter.eval_due(n):
            self.watchdog.phase(f"step {n}: evaluation")
            mesh = engine.mesh
            record["val_loss"] = engine.evaluate(
                val_microbatches(
                    self.dataset, t, mesh.dp_rank, mesh.dp_size, engine.config.micro_batch_size, self.env.device
                )
            ).item()
        if out.moe_layers:
            record.update(moe_metrics(out))
        if out.mtp_loss is not None:  # multi-token prediction: mean over depths, unweighted
            record["mtp_loss"] = float(out.mtp_loss)
        self.watchdog.phase(f"step {n}: peak-memory all_gather")
        peak_mem = peak_memory_per_rank(self.env.device)  # a collective: every rank, same steps
        record["peak_mem_bytes"], record["peak_mem_max_bytes"] = peak_mem, max(peak_mem)
        reporter.emit(record, {k: v for k, v in record.items() if k != "skipped_steps" or v})

    def _save_or_stop(self, step: int) -> bool:
        """Save when a checkpoint is due (every checkpoint.every, the last step, a SIGTERM every
        rank agreed on); True when the run stops early for the SIGTERM."""
        ckpt, t, n = self.run.checkpoint, self.run.trainer, step + 1
        self.watchdog.phase(f"step {n}: stop-request all_reduce")
        stopped_early = ckpt.dir is not None and self.stopper.agreed(self.env.device) and n < t.max_steps
        if ckpt.dir and (stopped_early or n == t.max_steps or (ckpt.every and n % ckpt.every == 0)):
            self._save()
        if stopped_early and self.env.is_main:
            print(f"meshtron: SIGTERM: stopped after step {n}; resume with checkpoint.resume=auto", flush=True)
        return stopped_early

    def _save(self) -> None:
        """Save a checkpoint of the current state, unless an update left non-finite weights."""
        step, ckpt = self.state.step, self.run.checkpoint
        self.watchdog.phase(f"step {step}: checkpoint save")
        if not self.engine.weights_are_finite():
            raise CheckpointError(
                f"the weights after step {step} are not finite (an update overflowed: "
                f"optim.lr={self.run.optim.lr:g} is likely too large); they were not saved, so the "
                "last checkpoint stays the newest: lower optim.lr and resume from it"
            )
        if (
            self.checkpointer is not None
        ):  # waits for the previous save, stages to host memory, writes in the background
            self.watchdog.phase(f"step {step}: checkpoint save (waiting for the previous one, staging)")
        self.engine.save(ckpt.dir, self.state, keep=ckpt.keep, checkpointer=self.checkpointer, on_done=self._announce)

    def _announce(self, path: Path) -> None:
        if self.env.is_main:
            print(f"meshtron: checkpoint of step {int(path.name.split('_')[1])} saved to {path}", flush=True)

    def _close_peer_monitor(self) -> None:
        if self.peer_monitor is not None:
            self.peer_monitor.close()

    def _close(self) -> None:
        self._close_peer_monitor()
        if self.checkpointer is not None:
            self.checkpointer.close()  # an error on its way: still finish (or report) the write in flight
        self.watchdog.close()
        self.stopper.close(keep_handler=self._collective_failed)  # torchrun's SIGTERM: still exit 1, ours
        for closable in (self.reporter, self.bar):
            if closable is not None:
                closable.close()

    def _summary(self, stopped_early: bool) -> dict:
        summary = self.reporter.summary(self.state.step, self.run_dir, stopped_early=stopped_early)
        if self.env.is_main:
            if summary["history"]:
                print(
                    f"meshtron: {'stopped' if stopped_early else 'done'}; loss {summary['first_loss']:.4f} -> "
                    f"{summary['last_loss']:.4f}; metrics in {self.run_dir / 'metrics.jsonl'}",
                    flush=True,
                )
            else:
                print(
                    f"meshtron: nothing to do: the checkpoint is at step {self.state.step} and trainer.max_steps="
                    f"{self.run.trainer.max_steps}; to train further, raise trainer.max_steps above {self.state.step}",
                    flush=True,
                )
        return summary


def _export_pipeline_trace(
    result, mesh, num_microbatches: int, run_dir: Path, env, param_gather=None, step_start: float = 0.0
) -> None:
    """Gather every rank's timeline of this step (pipeline `result`, and with `param_gather`
    the unit forwards and the ZeRO parameter all-gathers they waited for) to rank 0, write
    trace.json (Chrome trace) and print the measured bubble beside the theoretical one."""
    spans = []
    if param_gather is not None:
        spans = param_gather.spans_of_step(step_start)
        param_gather.record(False)
    gathered = gather_object((result.timeline if result is not None else [], spans), world_group(), dst=0)
    if not env.is_main:
        return
    path = write_trace(
        run_dir / "trace.json", {r: g[0] for r, g in enumerate(gathered)}, {r: g[1] for r, g in enumerate(gathered)}
    )
    if result is None:
        overlapped = sum(
            s.lane == "param all-gather" and s.end > min((u.start for u in g[1] if u.lane == "compute"), default=s.end)
            for g in gathered
            for s in g[1]
        )
        print(
            f"meshtron: trace of this step in {path}: {overlapped} ZeRO parameter all-gather(s) still running "
            "after the forward started",
            flush=True,
        )
        return
    par = mesh.par
    measured = [measured_bubble(g[0]) for g in gathered]
    expected = theoretical_bubble(par.pp, num_microbatches, par.vpp)
    print(
        f"meshtron: pipeline trace of this step in {path}; bubble measured "
        f"{sum(measured) / len(measured):.1%} (ranks: {', '.join(f'{b:.0%}' for b in measured)}) vs "
        f"theoretical {expected:.1%} = (p-1)/v / (m + (p-1)/v) with p={par.pp}, m={num_microbatches}, "
        f"v={par.vpp}",
        flush=True,
    )


def compiled_what(compile_blocks: bool, mode: str) -> str:
    """The banner's line on what runs under torch.compile (trainer.compile, trainer.compile_mode;
    else trainer.compile_moe)."""
    if not compile_blocks:
        return "compiled: the MoE layers under torch.compile (trainer.compile_moe)"
    graphs = ", CUDA graphs" if mode == "reduce-overhead" else ""
    return f"compiled: every transformer block under torch.compile (trainer.compile, mode {mode}{graphs})"


def moe_metrics(out: StepResult) -> dict:
    """Routing metrics of a step for metrics.jsonl: aux and z-loss (unweighted, summed over MoE
    layers), per-layer tokens per expert with max/mean imbalance and dropped fraction."""
    layers = []
    for layer in out.moe_layers:
        load = layer.tokens_per_expert.tolist()
        mean = sum(load) / len(load)
        layers.append(
            {
                "layer": layer.layer,
                "tokens_per_expert": [int(x) for x in load],
                "imbalance": max(load) / mean if mean else 0.0,
                "dropped_fraction": float(layer.dropped_fraction),
            }
        )
    return {
        "aux_loss": float(out.aux_loss),
        "z_loss": float(out.z_loss),
        "expert_imbalance": max(layer["imbalance"] for layer in layers),
        "dropped_fraction": sum(layer["dropped_fraction"] for layer in layers) / len(layers),
        "moe": layers,
    }


def main_entry(tree: dict, run_dir: str) -> dict:
    """Entry for train.py: turn a config or checkpoint error into one clear line and exit code 2
    (1 for a failed collective, already reported in one line), after `release_process_groups`."""
    keep_freed_host_memory()  # CPU steps reuse the previous step's pages (training/host_malloc.py)
    code, summary = _exit_code_of(tree, run_dir)
    release_process_groups()  # the traceback's frames (and their engine) are gone by now
    if code:
        raise SystemExit(code)
    return summary


def _exit_code_of(tree: dict, run_dir: str) -> tuple[int, dict]:
    """(0, summary) of the run, or (exit code, {}) for an error already reported in one line;
    any other error propagates."""
    try:
        run = RunConfig.from_dict(tree)
        return 0, run_training(run, run_dir)
    except ConfigError as err:
        say_one_line(f"meshtron: configuration error: {err}")
        return 2, {}
    except CheckpointError as err:
        say_one_line(f"meshtron: checkpoint error: {err}")
        return 2, {}
    except Exception as err:
        if getattr(err, "meshtron_reported", False):  # a failed collective, already one line (Trainer.train)
            # torchrun SIGTERMs the survivors of a dead rank: ignore it from here on, as the
            # interpreter's shutdown restores the default action (death by -15), not SIG_IGN
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return 1, {}
        raise
