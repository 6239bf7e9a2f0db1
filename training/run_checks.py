"""Everything a training run checks before any process group exists: the layout against the
world size, the model shape against the layout, batch splits, compiled MoE, the data's
tokenizer, and the checkpoint to start from. A bad configuration fails here, on every rank
alike, with one line (`ConfigError`) instead of hanging in a collective.

Used by the training loop and, with the workers' world size, by the parameter-server run."""

from __future__ import annotations

from pathlib import Path

import torch

from meshtron.dp.hierarchical import resolve_hierarchical
from meshtron.errors import ConfigError
from meshtron.models.fits import check_model_fits
from meshtron.mpu.mesh import ParallelConfigError
from meshtron.observability.metrics import require_tensorboard
from meshtron.rules import (
    Check,
    batch_checks,
    compile_checks,
    compile_moe_checks,
    cuda_graph_checks,
    microbatches,
    raise_first,
)
from meshtron.textdata.data import ByteTokenizer
from meshtron.training.checkpoint import CheckpointError, check_compatible, resolve_resume
from meshtron.training.config import RunConfig
from meshtron.training.hf_start import check_hf_weights, hf_folder


def check_run_config(run: RunConfig, world_size: int, ranks_per_node: int | None = None) -> tuple:
    """Validate layout, model shape and batch sizes for `world_size` (`ranks_per_node`: torchrun's
    LOCAL_WORLD_SIZE, for parallel.dp_hierarchical); return (parallel, micro, n_micro).

    Raises ConfigError (one line, names the numbers and what to change).
    """
    try:
        par = run.parallel.resolved(world_size)
        check_model_fits(par, run.model)
        resolve_hierarchical(
            par.dp_hierarchical, par, world_size, ranks_per_node or world_size, shard_grads=run.optim.zero >= 2
        )
    except ParallelConfigError as err:
        raise ConfigError(str(err)) from err
    t = run.trainer
    raise_first(
        batch_checks(t.global_batch_size, t.micro_batch_size, par.dp, pp=par.pp, schedule=par.schedule), ConfigError
    )
    m = run.model
    raise_first(
        compile_moe_checks(
            t.compile_moe,
            num_experts=m.num_experts,
            hidden_size=m.hidden_size,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size,
            precision=t.precision,
            kernel_backend=run.kernels.backend,
            recompute=t.recompute,
            zero=run.optim.zero,
        )
        + compiled_block_checks(run, par),
        ConfigError,
    )
    micro, n_micro = microbatches(t.global_batch_size, t.micro_batch_size, par.dp)
    if t.tensorboard and not t.dry_run:
        require_tensorboard()  # ConfigError naming `pip install tensorboard` / the viz extra
    if not t.dry_run and run.model.vocab_size < ByteTokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={run.model.vocab_size} is smaller than the byte tokenizer's "
            f"{ByteTokenizer.vocab_size}; use model.vocab_size >= {ByteTokenizer.vocab_size}"
        )
    return par, micro, n_micro


def compiled_block_checks(run: RunConfig, par) -> list[Check]:
    """trainer.compile's and trainer.compile_mode's rules (meshtron/rules.py compile_checks,
    cuda_graph_checks) for this run, on the device it will compute on."""
    t, m = run.trainer, run.model
    on_cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    return compile_checks(
        t.compile,
        compile_mode=t.compile_mode,
        compile_moe=t.compile_moe,
        precision=t.precision,
        kernel_backend=run.kernels.backend,
        zero=run.optim.zero,
        dropout=max(m.dropout, m.attention_dropout_p),
    ) + cuda_graph_checks(
        t.compile_mode,
        device_type="cuda" if on_cuda else "cpu",
        num_experts=m.num_experts,
        ep=par.ep,
        etp=par.etp,
        capacity_factor=m.capacity_factor,
        precision=t.precision,
        pp=par.pp,
    )


def checkpoint_to_start_from(run: RunConfig) -> tuple[str, Path] | None:
    """("resume" | "init_from" | "init_from_hf", path) after checking the checkpoint is complete
    and holds the tensors this model needs (a Hugging Face folder: from its safetensors
    headers), or None for a fresh start. With checkpoint.resume=auto a checkpoint in
    checkpoint.dir wins over checkpoint.init_from, which starts a run that has none. Runs
    before any process group, on every rank alike, so a bad checkpoint fails with one line
    instead of a hang."""
    c = run.checkpoint
    kind = "resume"
    try:
        path = resolve_resume(c.dir, c.resume)
        if path is None and c.init_from:
            kind = "init_from"
            folder = hf_folder(c.init_from)
            if folder is not None:
                check_hf_weights(folder, run.model)
                return "init_from_hf", folder
            path = resolve_resume(None, c.init_from)
        if path is None:
            return None
        meta = check_compatible(path, run.model)
        if kind == "resume" and meta.get("weights_only"):
            raise CheckpointError(
                f"{path} holds weights only (no optimizer state or step); start from it with "
                f"checkpoint.init_from={path}"
            )
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.{kind}: {err}") from err
    return kind, path
