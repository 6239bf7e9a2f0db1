"""The training run: validated config -> process groups -> mesh -> sharded model -> steps.

Everything that can be checked (config, layout against the world size, model shape, batch
sizes) is checked before any process group is created, so a bad configuration fails on
every rank with the same one-line message instead of hanging in a collective.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

from torch import nn

from meshtron.kernels import selfcheck
from meshtron.kernels.backend import CHECKED, resolve_backend
from meshtron.kernels.tf32 import set_tf32_mode
from meshtron.models.config import ExecutionConfig
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.hierarchical import resolve_hierarchical
from meshtron.mpu.mappings import all_reduce_stats, gather_object, world_group
from meshtron.mpu.mesh import ParallelConfigError, build_mesh, check_model_fits
from meshtron.mpu.pipeline import PipelineExecutor, activation_shape
from meshtron.mpu.param_gather import finish_param_gather
from meshtron.mpu.pipeline_trace import measured_bubble, theoretical_bubble, write_trace
from meshtron.mpu import zero3
from meshtron.training.checkpoint import (AsyncCheckpointer, CheckpointError, TrainState, check_compatible,
                                         hold_checkpoint_dir, load_checkpoint, new_checkpoint_group, resolve_resume,
                                         save_checkpoint)
from meshtron.training.config import ConfigError, RunConfig
from meshtron.textdata.data import ByteTokenizer, TokenDataset, build_dataset, document_end_id
from meshtron.training.distributed import agree_on_run_dir, init_distributed, launcher_env, teardown_distributed
from meshtron.planning.flops import model_flops_per_token
from meshtron.training.host_malloc import keep_freed_host_memory
from meshtron.observability.memory import peak_memory_per_rank
from meshtron.observability.metrics import MetricsWriter, ProgressBar, TensorBoardWriter, format_step_line, require_tensorboard
from meshtron.training.local_sgd import build_local_sgd
from meshtron.training.optim import build_reducer_and_optimizer
from meshtron.training.precision import LossScaler, Precision
from meshtron.training.preemption import StopRequest
from meshtron.planning.peak import peak_flops
from meshtron.training.schedule import lr_at
from meshtron.rules import batch_checks, compile_moe_checks, microbatches, raise_first
from meshtron.training.step import evaluate, pipeline_train_step, train_step
from meshtron.observability.watchdog import StepWatchdog, is_collective_failure, mesh_coords


def weights_are_finite(chunks) -> bool:
    """Whether every weight of every rank is finite: one flag all-reduced (max) over the world."""
    finish_param_gather(chunks)  # ZeRO-1/2 with optim.overlap_param_gather: gathers may be in flight
    with zero3.gathered(chunks):  # ZeRO-3: the parameters are sharded between steps
        flags = [torch.isfinite(p).all() for chunk in chunks for p in chunk.parameters()]
    bad = torch.stack(flags).logical_not().any().float().reshape(1) if flags else torch.zeros(1)
    return all_reduce_stats(bad, world_group(), op="max").item() == 0


def check_run_config(run: RunConfig, world_size: int, ranks_per_node: int | None = None) -> tuple:
    """Validate layout, model shape and batch sizes for `world_size` (`ranks_per_node`: torchrun's
    LOCAL_WORLD_SIZE, for parallel.dp_hierarchical); return (parallel, micro, n_micro).

    Raises ConfigError (one line, names the numbers and what to change).
    """
    try:
        par = run.parallel.resolved(world_size)
        check_model_fits(par, run.model)
        resolve_hierarchical(par.dp_hierarchical, par, world_size, ranks_per_node or world_size,
                             shard_grads=run.optim.zero >= 2)
    except ParallelConfigError as err:
        raise ConfigError(str(err)) from err
    t = run.trainer
    raise_first(batch_checks(t.global_batch_size, t.micro_batch_size, par.dp, pp=par.pp, schedule=par.schedule),
                ConfigError)
    m = run.model
    raise_first(compile_moe_checks(t.compile_moe, num_experts=m.num_experts, hidden_size=m.hidden_size,
                                   moe_ffn_hidden_size=m.moe_ffn_hidden_size, precision=t.precision,
                                   kernel_backend=run.kernels.backend, recompute=t.recompute, zero=run.optim.zero),
                ConfigError)
    micro, n_micro = microbatches(t.global_batch_size, t.micro_batch_size, par.dp)
    if t.tensorboard and not t.dry_run:
        require_tensorboard()  # ConfigError naming `pip install tensorboard` / the viz extra
    if not t.dry_run and run.model.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={run.model.vocab_size} is smaller than the byte tokenizer's "
                          f"{ByteTokenizer.vocab_size}; use model.vocab_size >= {ByteTokenizer.vocab_size}")
    return par, micro, n_micro


def run_training(run: RunConfig, run_dir: str | Path) -> dict:
    """Train (or plan, with trainer.dry_run) as configured; returns a summary dict.

    Talks over the default process group when launched by torchrun (WORLD_SIZE > 1).
    """
    if run.parallel.dp_mode == "ps":  # parameter servers: their own world layout and loop
        from meshtron.training.param_server import run_parameter_server

        return run_parameter_server(run, run_dir)
    world_size, _, _, local_world = launcher_env()
    par, micro, n_micro = check_run_config(run, world_size, local_world)
    wants_cuda = run.trainer.device == "cuda" or (run.trainer.device == "auto" and torch.cuda.is_available())
    if run.trainer.device == "cuda" and not run.trainer.dry_run and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but this machine has no usable CUDA device "
                          "(torch.cuda.is_available() is False); use trainer.device=auto or cpu")
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
    start_from = None if run.trainer.dry_run else _checkpoint_to_start_from(run)
    env = init_distributed(run.trainer.device, timeout_s=run.trainer.collective_timeout_s,
                           num_threads=run.trainer.num_threads)
    try:
        run_dir = agree_on_run_dir(run_dir)
        if run.trainer.dry_run:
            return _dry_run(run, par, env, run_dir, micro, execution)
        with hold_checkpoint_dir(run.checkpoint.dir):  # one writer per dir, writable: before any step
            return _train(run, par, env, run_dir, dataset, micro, n_micro, start_from, execution, eos_id)
    finally:
        teardown_distributed()


def _checkpoint_to_start_from(run: RunConfig) -> tuple[str, Path] | None:
    """("resume" | "init_from", path) after checking the checkpoint is complete and holds the
    tensors this model needs, or None for a fresh start. Runs before any process group, on
    every rank alike, so a bad checkpoint fails with one line instead of a hang."""
    c = run.checkpoint
    try:
        if c.init_from:
            path, kind = resolve_resume(None, c.init_from), "init_from"
        else:
            path, kind = resolve_resume(c.dir, c.resume), "resume"
        if path is None:
            return None
        meta = check_compatible(path, run.model)
        if kind == "resume" and meta.get("weights_only"):
            raise CheckpointError(f"{path} holds weights only (no optimizer state or step); start from it with "
                                  f"checkpoint.init_from={path}")
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.{'init_from' if c.init_from else 'resume'}: {err}") from err
    return kind, path


def _dry_run(run: RunConfig, par, env, run_dir: Path, micro: int, execution: ExecutionConfig) -> dict:
    from meshtron.planning.plan import format_rank_line, plan_all_ranks, write_plan

    plan = plan_all_ranks(run.model, par, env.world_size, micro_batch_size=micro,
                          global_batch_size=run.trainer.global_batch_size, precision=run.trainer.precision,
                          zero=run.optim.zero, offload=run.optim.offload, param_dtype=run.optim.param_dtype,
                          device=env.device.type,
                          execution=execution)
    mine = plan["ranks"][env.rank]
    print(f"[dry run] rank {env.rank}: {format_rank_line(mine)}", flush=True)
    if env.is_main:
        write_plan(run_dir / "plan.json", plan)
        print(f"[dry run] plan for {env.world_size} rank(s) written to {run_dir / 'plan.json'}", flush=True)
    return {"dry_run": True, "plan": plan, "run_dir": str(run_dir)}


def _train(run: RunConfig, par, env, run_dir: Path, dataset: TokenDataset, micro: int, n_micro: int,
           start_from: tuple[str, Path] | None, execution: ExecutionConfig, eos_id: int | None) -> dict:
    cfg, t = run.model, run.trainer
    tokens = dataset.split_tokens("train")

    mesh = build_mesh(par, cfg, device_type=env.device.type, ranks_per_node=env.local_world_size)
    # checkpoint.async: the writer thread coordinates over its own gloo group, made here, at
    # startup, by every rank alike (training/checkpoint.py AsyncCheckpointer)
    checkpointer = (AsyncCheckpointer(new_checkpoint_group(t.collective_timeout_s))
                    if run.checkpoint.dir and run.checkpoint.async_ else None)
    chunks = init_model_chunks(cfg, mesh, t.seed, device=env.device, execution=execution)
    model = nn.ModuleList(chunks)
    reducer, optimizer = build_reducer_and_optimizer(run.optim, chunks, mesh)
    # ZeRO-1/2: parameter all-gathers left in flight by each update, waited for in the next forward
    # (mpu/param_gather.py); readers of the parameters outside forward call finish_param_gather first.
    param_gather = (optimizer.overlap_param_gather(chunks)
                    if run.optim.overlap_param_gather and hasattr(optimizer, "overlap_param_gather") else None)
    executor = None
    if mesh.pp_size > 1:
        executor = PipelineExecutor(chunks, mesh, activation_shape(mesh, cfg.seq_len, micro, cfg.hidden_size),
                                    torch.float32, env.device)

    state = TrainState()
    if start_from is not None:
        kind, path = start_from
        state = load_checkpoint(path, chunks, optimizer, mesh, weights_only=kind == "init_from")
        if env.is_main:
            print(f"meshtron: {'resumed from' if kind == 'resume' else 'initial weights from'} {path}"
                  + (f" at step {state.step} ({state.consumed_samples:,} samples consumed)" if kind == "resume" else ""),
                  flush=True)

    # None unless optim.local_steps > 1 or an outer optimizer; after loading: DiLoCo keeps the start weights
    local_sgd = build_local_sgd(run.optim, chunks, mesh)
    scaler = LossScaler(scale=state.loss_scale or t.initial_loss_scale, growth_interval=t.loss_scale_window,
                        good_steps=state.loss_scale_good_steps)
    precision = Precision(t.precision, env.device.type, scaler)

    flops_per_token = model_flops_per_token(cfg)
    # MFU against the compute dtype's peak on GPUs; CPUs have no fast 16-bit matmul, so fp32's.
    peak_dtype = precision.dtype if precision.dtype is not None and env.device.type == "cuda" else torch.float32
    peak_per_process, peak_source = peak_flops(env.device, peak_dtype)
    peak_total = peak_per_process * env.world_size
    tokens_per_step = t.global_batch_size * cfg.seq_len
    if env.is_main:
        n_params = sum(p.numel() for p in model.parameters())  # this rank's shards
        print(f"meshtron: {mesh.describe()}", flush=True)
        for warning in mesh.placement_warnings():  # spanning nodes is allowed, only slower (mpu/mesh.py)
            print(f"meshtron: warning: {warning}", flush=True)
        if reducer.hierarchy is not None:
            print(f"meshtron: hierarchical dp all-reduce: {reducer.hierarchy.nodes} nodes x "
                  f"{reducer.hierarchy.local} ranks (parallel.dp_hierarchical={par.dp_hierarchical})", flush=True)
        print(f"meshtron: {cfg.arch} {cfg.num_layers}L h={cfg.hidden_size} heads={cfg.num_heads} "
              f"seq={cfg.seq_len} vocab={cfg.vocab_size}; {n_params:,} parameters on rank 0; "
              f"{len(tokens):,} tokens of text; global batch {t.global_batch_size} = dp {par.dp} x "
              f"{n_micro} microbatches x {micro}; peak {peak_total / 1e9:.1f} GFLOP/s ({peak_source}) "
              f"x{env.world_size}; run dir {run_dir}", flush=True)

    writer = MetricsWriter(run_dir, enabled=env.is_main)
    tb = TensorBoardWriter(run_dir, enabled=env.is_main and t.tensorboard)
    watchdog = StepWatchdog(env.rank, mesh_coords(mesh), t.collective_timeout_s / 2
                            if t.watchdog_timeout_s is None else t.watchdog_timeout_s)
    bar = ProgressBar(t.max_steps, enabled=env.is_main and t.progress)
    history: list[dict] = []
    window_start, window_steps = time.perf_counter(), 0
    ckpt = run.checkpoint
    stopper = StopRequest(enabled=ckpt.dir is not None)
    stopped_early = False

    def save() -> None:
        watchdog.phase(f"step {state.step}: checkpoint save")
        if not weights_are_finite(chunks):
            raise CheckpointError(f"the weights after step {state.step} are not finite (an update overflowed: "
                                  f"optim.lr={run.optim.lr:g} is likely too large); they were not saved, so the "
                                  "last checkpoint stays the newest: lower optim.lr and resume from it")
        if checkpointer is not None:  # waits for the previous save, stages to host memory, writes in the background
            watchdog.phase(f"step {state.step}: checkpoint save (waiting for the previous one, staging)")
            checkpointer.save(ckpt.dir, state, chunks, optimizer, mesh, model_config=dataclasses.asdict(cfg),
                              keep=ckpt.keep, on_done=announce)
            return
        announce(save_checkpoint(ckpt.dir, state, chunks, optimizer, mesh, model_config=dataclasses.asdict(cfg),
                                 keep=ckpt.keep))

    def announce(path: Path) -> None:
        if env.is_main:
            print(f"meshtron: checkpoint of step {_step_of_dir(path)} saved to {path}", flush=True)

    first_step = state.step
    try:
        for step in range(state.step, t.max_steps):
            lr = lr_at(step, lr=run.optim.lr, warmup_steps=run.warmup_steps, max_steps=t.max_steps,
                       min_lr_ratio=run.optim.min_lr_ratio, decay=run.optim.decay)
            inputs, targets = dataset.local_batch_at(state.consumed_samples, t.global_batch_size, mesh.dp_rank,
                                                     mesh.dp_size)
            inputs, targets = inputs.to(env.device), targets.to(env.device)
            microbatches = _split_microbatches(inputs, targets, micro)
            watchdog.phase(f"step {step + 1}: forward/backward/grad reduce/optimizer"
                           + (f" ({par.schedule} pipeline)" if executor is not None else ""))
            if param_gather is not None and t.trace_step in (step + 1, step + 2) and not param_gather.recording:
                param_gather.record(True)  # the traced step's gathers are launched by the step before it
            step_start = time.perf_counter()
            if executor is None:
                out = train_step(chunks[0], reducer, optimizer, microbatches, mesh, lr=lr,
                                 max_grad_norm=t.max_grad_norm, precision=precision, eos_id=eos_id)
            else:
                out = pipeline_train_step(chunks, reducer, optimizer, microbatches, mesh, executor,
                                          schedule=par.schedule, lr=lr, max_grad_norm=t.max_grad_norm,
                                          precision=precision, eos_id=eos_id)
                if t.trace_step == step + 1:
                    watchdog.phase(f"step {step + 1}: pipeline trace gather_object")
                    _export_pipeline_trace(out["pipeline"], mesh, par, len(microbatches), run_dir, env,
                                           param_gather, step_start)
            if executor is None and param_gather is not None and t.trace_step == step + 1:
                watchdog.phase(f"step {step + 1}: parameter-gather trace gather_object")
                _export_pipeline_trace(None, mesh, par, len(microbatches), run_dir, env, param_gather, step_start)
            if step == first_step and execution.kernel_backend == CHECKED:
                # Every kernel of the model ran (and was checked) in this step: make the
                # verdicts final and the same on every rank (a collective, every rank, here).
                watchdog.phase(f"step {step + 1}: kernel self-check agreement all_reduce")
                selfcheck.agree(env.device)
            if local_sgd is not None:  # every optim.local_steps steps: parameters averaged over dp
                watchdog.phase(f"step {step + 1}: local SGD parameter sync over dp")
                local_sgd.after_step(step + 1, final=step + 1 == t.max_steps)
            window_steps += 1
            state.step, state.consumed_samples = step + 1, state.consumed_samples + t.global_batch_size
            if precision.scaler is not None:
                state.loss_scale, state.loss_scale_good_steps = precision.scaler.scale, precision.scaler.good_steps
            if local_sgd is not None:  # each replica judged its own gradients: abort (max_skipped) together
                out["skipped"] = local_sgd.agree_skipped(out["skipped"])
            if out["skipped"]:
                state.skipped_total += 1
                state.skipped_in_a_row += 1
                if env.is_main:
                    print(f"meshtron: step {step + 1} skipped: non-finite loss or gradient norm"
                          + (f" (fp16 overflow: loss scale now {precision.loss_scale:g})" if precision.scaler else "")
                          + " "
                          f"({state.skipped_in_a_row} in a row, {state.skipped_total} in total)", flush=True)
                if state.skipped_in_a_row > t.max_skipped:
                    raise RuntimeError(f"{state.skipped_in_a_row} consecutive steps had a non-finite loss or "
                                       f"gradient norm (trainer.max_skipped={t.max_skipped}); lower optim.lr or "
                                       f"check the data")
            else:
                state.skipped_in_a_row = 0
            eval_now = t.eval_every > 0 and ((step + 1) % t.eval_every == 0 or step + 1 == t.max_steps)
            if step == 0 or (step + 1) % t.log_every == 0 or step + 1 == t.max_steps or eval_now:
                watchdog.phase(f"step {step + 1}: metrics")
                loss, grad_norm = out["loss"].item(), out["grad_norm"].item()  # host sync only when logging
                elapsed = time.perf_counter() - window_start
                tokens_per_s = tokens_per_step * window_steps / elapsed
                record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak_total,
                          "step_time_s": elapsed / window_steps}
                record["skipped_steps"] = state.skipped_total
                if local_sgd is not None:
                    record["local_sgd_syncs"] = local_sgd.syncs
                if precision.scaler is not None:
                    record["loss_scale"] = precision.loss_scale
                if eval_now:
                    watchdog.phase(f"step {step + 1}: evaluation")
                    record["val_loss"] = evaluate(chunks, _val_microbatches(dataset, t, mesh, micro, env), mesh,
                                                  executor, precision, eos_id=eos_id).item()
                if "moe_layers" in out:
                    record.update(moe_metrics(out))
                watchdog.phase(f"step {step + 1}: peak-memory all_gather")
                peak_mem = peak_memory_per_rank(env.device)  # a collective: every rank, same steps
                record["peak_mem_bytes"], record["peak_mem_max_bytes"] = peak_mem, max(peak_mem)
                history.append(record)
                writer.log(record)
                tb.log(record)
                if env.is_main:
                    shown = {k: v for k, v in record.items() if k != "skipped_steps" or v}
                    print(format_step_line(shown, total=t.max_steps), flush=True)
                window_start, window_steps = time.perf_counter(), 0
            bar.update(step + 1)
            watchdog.phase(f"step {step + 1}: stop-request all_reduce")
            stopped_early = ckpt.dir is not None and stopper.agreed(env.device) and step + 1 < t.max_steps
            if ckpt.dir and (stopped_early or step + 1 == t.max_steps or (ckpt.every and (step + 1) % ckpt.every == 0)):
                save()
            if stopped_early:
                if env.is_main:
                    print(f"meshtron: SIGTERM: stopped after step {step + 1}; resume with checkpoint.resume=auto",
                          flush=True)
                break
        if checkpointer is not None:
            watchdog.phase(f"step {state.step}: waiting for the background checkpoint write")
            checkpointer.wait()  # its failure is this run's failure
        watchdog.idle()
    except Exception as err:
        if is_collective_failure(err):
            print(watchdog.describe_error(err, timeout_s=t.collective_timeout_s), file=sys.stderr, flush=True)
        raise
    finally:
        if checkpointer is not None:
            checkpointer.close()  # an error on its way: still finish (or report) the write in flight
        watchdog.close()
        stopper.close()
        tb.close()
        bar.close()
        writer.close()
        reducer.remove_hooks()
        if param_gather is not None:  # the last update's gathers: done before the groups are torn down
            failing = sys.exc_info()[1] is not None
            try:
                param_gather.finish()
            except Exception:  # noqa: BLE001 - an error already on its way is the one to report
                if not failing:
                    raise
            param_gather.remove_hooks()
    summary = {"first_loss": history[0]["loss"] if history else None,
               "last_loss": history[-1]["loss"] if history else None, "steps": state.step,
               "stopped_early": stopped_early, "run_dir": str(run_dir), "history": history}
    if env.is_main:
        if history:
            print(f"meshtron: {'stopped' if stopped_early else 'done'}; loss {summary['first_loss']:.4f} -> "
                  f"{summary['last_loss']:.4f}; metrics in {run_dir / 'metrics.jsonl'}", flush=True)
        else:
            print(f"meshtron: nothing to do: the run is already at step {state.step} = trainer.max_steps", flush=True)
    return summary


def _step_of_dir(path: Path) -> int:
    return int(path.name.split("_")[1])


def _split_microbatches(inputs: torch.Tensor, targets: torch.Tensor, micro: int) -> list:
    """Consecutive rows of this rank's batch, `micro` at a time."""
    return [(inputs[i: i + micro], targets[i: i + micro]) for i in range(0, len(inputs), micro)]


def _val_microbatches(dataset: TokenDataset, t, mesh, micro: int, env) -> list:
    """This rank's microbatches of `trainer.eval_batches` fixed held-out global batches."""
    out = []
    for index in range(t.eval_batches):
        inputs, targets = dataset.local_batch(index, t.global_batch_size, mesh.dp_rank, mesh.dp_size, split="val")
        inputs, targets = inputs.to(env.device), targets.to(env.device)
        out += _split_microbatches(inputs, targets, micro)
    return out


def _export_pipeline_trace(result, mesh, par, num_microbatches: int, run_dir: Path, env, param_gather=None,
                           step_start: float = 0.0) -> None:
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
    path = write_trace(run_dir / "trace.json", {r: g[0] for r, g in enumerate(gathered)},
                       {r: g[1] for r, g in enumerate(gathered)})
    if result is None:
        overlapped = sum(s.lane == "param all-gather" and s.end > min((u.start for u in g[1] if u.lane == "compute"),
                                                                      default=s.end)
                         for g in gathered for s in g[1])
        print(f"meshtron: trace of this step in {path}: {overlapped} ZeRO parameter all-gather(s) still running "
              "after the forward started", flush=True)
        return
    gathered = [g[0] for g in gathered]
    measured = [measured_bubble(events) for events in gathered]
    expected = theoretical_bubble(par.pp, num_microbatches, par.vpp)
    print(f"meshtron: pipeline trace of this step in {path}; bubble measured "
          f"{sum(measured) / len(measured):.1%} (ranks: {', '.join(f'{b:.0%}' for b in measured)}) vs "
          f"theoretical {expected:.1%} = (p-1)/v / (m + (p-1)/v) with p={par.pp}, m={num_microbatches}, "
          f"v={par.vpp}", flush=True)


def moe_metrics(out: dict) -> dict:
    """Routing metrics of a step for metrics.jsonl: aux and z-loss (unweighted, summed over MoE
    layers), per-layer tokens per expert with max/mean imbalance and dropped fraction."""
    layers = []
    for layer in out["moe_layers"]:
        load = layer["tokens_per_expert"].tolist()
        mean = sum(load) / len(load)
        layers.append({"layer": layer["layer"], "tokens_per_expert": [int(x) for x in load],
                       "imbalance": max(load) / mean if mean else 0.0,
                       "dropped_fraction": float(layer["dropped_fraction"])})
    return {"aux_loss": float(out["aux_loss"]), "z_loss": float(out["z_loss"]),
            "expert_imbalance": max(layer["imbalance"] for layer in layers),
            "dropped_fraction": sum(layer["dropped_fraction"] for layer in layers) / len(layers),
            "moe": layers}


def main_entry(tree: dict, run_dir: str) -> dict:
    """Entry for train.py: turn a config or checkpoint error into one clear line and exit code 2."""
    keep_freed_host_memory()  # CPU steps reuse the previous step's pages (training/host_malloc.py)
    try:
        run = RunConfig.from_dict(tree)
        return run_training(run, run_dir)
    except ConfigError as err:
        say_one_line(f"meshtron: configuration error: {err}")
        raise SystemExit(2) from None
    except CheckpointError as err:
        say_one_line(f"meshtron: checkpoint error: {err}")
        raise SystemExit(2) from None


def say_one_line(line: str) -> None:
    """Write `line` to stderr in one write: ranks sharing a pipe (torchrun) never interleave
    inside it (print writes the text and the newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()

