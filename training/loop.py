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

from kernels.backend import resolve_backend
from models.gpt import init_model_chunks
from mpu.distributed_optimizer import ShardedAdamW
from mpu.grad_reduce import DataParallelGradReducer
from mpu.mesh import ParallelConfigError, build_mesh, check_model_fits
from mpu.pipeline import PipelineExecutor, activation_shape
from mpu.pipeline_trace import measured_bubble, theoretical_bubble, write_trace
from training.config import ConfigError, RunConfig
from training.data import ByteTokenizer, TokenDataset, load_corpus
from training.distributed import agree_on_run_dir, init_distributed, launcher_env, teardown_distributed
from training.flops import model_flops_per_token
from training.metrics import MetricsWriter, ProgressBar, format_step_line
from training.optim import build_optimizer
from training.peak import peak_flops
from training.schedule import lr_at
from training.step import evaluate, pipeline_train_step, train_step


def check_run_config(run: RunConfig, world_size: int) -> tuple:
    """Validate layout, model shape and batch sizes for `world_size`; return (parallel, micro, n_micro).

    Raises ConfigError (one line, names the numbers and what to change).
    """
    try:
        par = run.parallel.resolved(world_size)
        check_model_fits(par, run.model)
    except ParallelConfigError as err:
        raise ConfigError(str(err)) from err
    t = run.trainer
    if t.global_batch_size % par.dp:
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size} is not divisible by dp={par.dp}; "
            f"use a multiple of {par.dp}"
        )
    per_rank = t.global_batch_size // par.dp
    micro = t.micro_batch_size or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"trainer.micro_batch_size={micro} does not divide the per-rank batch {per_rank} "
            f"(global_batch_size={t.global_batch_size} / dp={par.dp})"
        )
    if par.schedule == "interleaved" and par.pp > 1 and (per_rank // micro) % par.pp:
        raise ConfigError(
            f"the interleaved schedule needs the microbatches per rank ({per_rank // micro} = global_batch_size "
            f"{t.global_batch_size} / dp {par.dp} / micro_batch_size {micro}) divisible by pp={par.pp}"
        )
    if not t.dry_run and run.model.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={run.model.vocab_size} is smaller than the byte tokenizer's "
                          f"{ByteTokenizer.vocab_size}; use model.vocab_size >= {ByteTokenizer.vocab_size}")
    return par, micro, per_rank // micro


def run_training(run: RunConfig, run_dir: str | Path) -> dict:
    """Train (or plan, with trainer.dry_run) as configured; returns a summary dict.

    Talks over the default process group when launched by torchrun (WORLD_SIZE > 1).
    """
    world_size, _, _, _ = launcher_env()
    par, micro, n_micro = check_run_config(run, world_size)
    wants_cuda = run.trainer.device == "cuda" or (run.trainer.device == "auto" and torch.cuda.is_available())
    try:
        backend = resolve_backend(run.kernels.backend, "cuda" if wants_cuda else "cpu")
    except (RuntimeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    run.model = dataclasses.replace(run.model, kernel_backend=backend)
    dataset = None
    if not run.trainer.dry_run:
        try:
            tokens = load_corpus(run.data.paths, run.data.max_bytes)
            dataset = TokenDataset(tokens, run.model.seq_len, run.trainer.seed, run.data.val_fraction)
        except (OSError, ValueError) as err:
            raise ConfigError(f"data: {err}") from err
    env = init_distributed(run.trainer.device, timeout_s=run.trainer.collective_timeout_s,
                           num_threads=run.trainer.num_threads)
    try:
        run_dir = agree_on_run_dir(run_dir)
        if run.trainer.dry_run:
            return _dry_run(run, par, env, run_dir, micro)
        return _train(run, par, env, run_dir, dataset, micro, n_micro)
    finally:
        teardown_distributed()


def _dry_run(run: RunConfig, par, env, run_dir: Path, micro: int) -> dict:
    from training.plan import format_rank_line, plan_all_ranks, write_plan

    plan = plan_all_ranks(run.model, par, env.world_size, micro_batch_size=micro,
                          global_batch_size=run.trainer.global_batch_size, precision=run.trainer.precision,
                          zero_dp=par.dp if run.optim.zero else 1)
    mine = plan["ranks"][env.rank]
    print(f"[dry run] rank {env.rank}: {format_rank_line(mine)}", flush=True)
    if env.is_main:
        write_plan(run_dir / "plan.json", plan)
        print(f"[dry run] plan for {env.world_size} rank(s) written to {run_dir / 'plan.json'}", flush=True)
    return {"dry_run": True, "plan": plan, "run_dir": str(run_dir)}


def _train(run: RunConfig, par, env, run_dir: Path, dataset: TokenDataset, micro: int, n_micro: int) -> dict:
    cfg, t = run.model, run.trainer
    tokens = dataset.split_tokens("train")

    mesh = build_mesh(par, cfg, device_type=env.device.type)
    chunks = init_model_chunks(cfg, mesh, t.seed, device=env.device)
    model = nn.ModuleList(chunks)
    reducer = DataParallelGradReducer([(n, p) for c in chunks for n, p in c.named_parameters()], mesh)
    if run.optim.zero == 1:
        optimizer = ShardedAdamW(reducer, lr=run.optim.lr, weight_decay=run.optim.weight_decay,
                                 betas=run.optim.betas, eps=run.optim.eps)
    else:
        optimizer = build_optimizer(model, lr=run.optim.lr, weight_decay=run.optim.weight_decay,
                                    betas=run.optim.betas, eps=run.optim.eps)
    executor = None
    if mesh.pp_size > 1:
        executor = PipelineExecutor(chunks, mesh, activation_shape(mesh, cfg.seq_len, micro, cfg.hidden_size),
                                    torch.float32, env.device)

    flops_per_token = model_flops_per_token(cfg)
    peak_per_process, peak_source = peak_flops(env.device, torch.float32)
    peak_total = peak_per_process * env.world_size
    tokens_per_step = t.global_batch_size * cfg.seq_len
    if env.is_main:
        n_params = sum(p.numel() for p in model.parameters())  # this rank's shards
        print(f"meshtron: {mesh.describe()}", flush=True)
        print(f"meshtron: {cfg.arch} {cfg.num_layers}L h={cfg.hidden_size} heads={cfg.num_heads} "
              f"seq={cfg.seq_len} vocab={cfg.vocab_size}; {n_params:,} parameters on rank 0; "
              f"{len(tokens):,} tokens of text; global batch {t.global_batch_size} = dp {par.dp} x "
              f"{n_micro} microbatches x {micro}; peak {peak_total / 1e9:.1f} GFLOP/s ({peak_source}) "
              f"x{env.world_size}; run dir {run_dir}", flush=True)

    writer = MetricsWriter(run_dir, enabled=env.is_main)
    bar = ProgressBar(t.max_steps, enabled=env.is_main and t.progress)
    history: list[dict] = []
    window_start, window_steps = time.perf_counter(), 0
    skipped_total = skipped_in_a_row = 0
    try:
        for step in range(t.max_steps):
            lr = lr_at(step, lr=run.optim.lr, warmup_steps=run.warmup_steps, max_steps=t.max_steps,
                       min_lr_ratio=run.optim.min_lr_ratio, decay=run.optim.decay)
            inputs, targets = dataset.local_batch(step, t.global_batch_size, mesh.dp_rank, mesh.dp_size)
            inputs, targets = inputs.to(env.device), targets.to(env.device)
            microbatches = _split_microbatches(inputs, targets, micro)
            if executor is None:
                out = train_step(chunks[0], reducer, optimizer, microbatches, mesh, lr=lr,
                                 max_grad_norm=t.max_grad_norm)
            else:
                out = pipeline_train_step(chunks, reducer, optimizer, microbatches, mesh, executor,
                                          schedule=par.schedule, lr=lr, max_grad_norm=t.max_grad_norm)
                if t.trace_step == step + 1:
                    _export_pipeline_trace(out["pipeline"], mesh, par, len(microbatches), run_dir, env)
            window_steps += 1
            if out["skipped"]:
                skipped_total += 1
                skipped_in_a_row += 1
                if env.is_main:
                    print(f"meshtron: step {step + 1} skipped: non-finite loss or gradient norm "
                          f"({skipped_in_a_row} in a row, {skipped_total} in total)", flush=True)
                if skipped_in_a_row > t.max_skipped:
                    raise RuntimeError(f"{skipped_in_a_row} consecutive steps had a non-finite loss or gradient "
                                       f"norm (trainer.max_skipped={t.max_skipped}); lower optim.lr or check the data")
            else:
                skipped_in_a_row = 0
            eval_now = t.eval_every > 0 and ((step + 1) % t.eval_every == 0 or step + 1 == t.max_steps)
            if step == 0 or (step + 1) % t.log_every == 0 or step + 1 == t.max_steps or eval_now:
                loss, grad_norm = out["loss"].item(), out["grad_norm"].item()  # host sync only when logging
                elapsed = time.perf_counter() - window_start
                tokens_per_s = tokens_per_step * window_steps / elapsed
                record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak_total,
                          "step_time_s": elapsed / window_steps}
                record["skipped_steps"] = skipped_total
                if eval_now:
                    record["val_loss"] = evaluate(chunks, _val_microbatches(dataset, t, mesh, micro, env), mesh,
                                                  executor).item()
                if "moe_layers" in out:
                    record.update(moe_metrics(out))
                history.append(record)
                writer.log(record)
                if env.is_main:
                    shown = {k: v for k, v in record.items() if k != "skipped_steps" or v}
                    print(format_step_line(shown, total=t.max_steps), flush=True)
                window_start, window_steps = time.perf_counter(), 0
            bar.update(step + 1)
    finally:
        bar.close()
        writer.close()
        reducer.remove_hooks()
    summary = {"first_loss": history[0]["loss"], "last_loss": history[-1]["loss"], "steps": t.max_steps,
               "run_dir": str(run_dir), "history": history}
    if env.is_main:
        print(f"meshtron: done; loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}; "
              f"metrics in {run_dir / 'metrics.jsonl'}", flush=True)
    return summary


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


def _export_pipeline_trace(result, mesh, par, num_microbatches: int, run_dir: Path, env) -> None:
    """Gather every rank's timeline of this step to rank 0, write trace.json (Chrome trace)
    and print the measured bubble beside the theoretical one."""
    gathered = [None] * env.world_size if env.is_main else None
    torch.distributed.gather_object(result.timeline, gathered, dst=0)
    if not env.is_main:
        return
    path = write_trace(run_dir / "trace.json", dict(enumerate(gathered)))
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
    """Entry for train.py: turn a config error into one clear line and exit code 2."""
    try:
        run = RunConfig.from_dict(tree)
        return run_training(run, run_dir)
    except ConfigError as err:
        print(f"meshtron: configuration error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None

