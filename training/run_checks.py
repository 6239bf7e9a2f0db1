"""Everything a training run checks before any process group exists: the layout against the
world size, the model shape against the layout, batch splits, compiled MoE, the data's
tokenizer, and the checkpoint to start from. A bad configuration fails here, on every rank
alike, with one line (`ConfigError`) instead of hanging in a collective.

Used by the training loop and, with the workers' world size, by the parameter-server run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import torch

from meshtron.dp.hierarchical import resolve_hierarchical
from meshtron.errors import ConfigError, say_one_line
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
from meshtron.textdata.data import INDEX_FILE, ByteTokenizer
from meshtron.training.checkpoint import check_compatible
from meshtron.training.checkpoint_files import CheckpointError, check_complete, load_newest_intact, start_folders
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
    if not t.dry_run:  # a dry run plans models bigger than this machine on purpose
        check_execution_bounds(run, par, micro)
        check_batch_against_data(run)
        check_fits_device(run, par, world_size, micro, n_micro, ranks_per_node or world_size)
    return par, micro, n_micro


# A dispatch chunk pays one all-to-all exchange and one host sync; below this many tokens per chunk
# that fixed cost, not the experts' work, sets the step time (1,000 chunks ran 30-70x slower).
MIN_TOKENS_PER_DISPATCH_CHUNK = 64


def check_execution_bounds(run: RunConfig, par, micro: int) -> None:
    """Settings that would otherwise be accepted and silently clipped or slow: trainer.recompute_layers
    beyond model.num_layers (it names layers that do not exist); trainer.moe_dispatch_chunks beyond
    the tokens a rank dispatches per microbatch (ConfigError: moe/layer.py would cut it to one token
    per chunk), or with chunks of fewer than MIN_TOKENS_PER_DISPATCH_CHUNK tokens (a warning, from
    rank 0)."""
    t, m = run.trainer, run.model
    if t.recompute_layers is not None and t.recompute_layers > m.num_layers:
        raise ConfigError(
            f"trainer.recompute_layers={t.recompute_layers} exceeds model.num_layers={m.num_layers}: it counts "
            f"the first layers to recompute; use at most {m.num_layers} (or null for all layers)"
        )
    chunks = t.moe_dispatch_chunks
    if chunks <= 1 or not m.is_moe or (par.ep == 1 and par.etp == 1):
        return
    tokens = micro * m.seq_len // max(1, par.cp) // (par.tp if par.sp and par.tp > 1 else 1)
    if chunks > tokens:
        raise ConfigError(
            f"trainer.moe_dispatch_chunks={chunks} exceeds the {tokens:,} tokens a rank dispatches per microbatch "
            f"(micro_batch_size {micro} x model.seq_len {m.seq_len} / cp {par.cp}"
            + (f" / tp {par.tp} with sp" if par.sp and par.tp > 1 else "")
            + f"): chunks would hold one token each, each paying an all-to-all and a host sync; use at most "
            f"{max(1, tokens // MIN_TOKENS_PER_DISPATCH_CHUNK)}"
        )
    if tokens // chunks < MIN_TOKENS_PER_DISPATCH_CHUNK and os.environ.get("RANK", "0") == "0":
        say_one_line(
            f"meshtron: warning: trainer.moe_dispatch_chunks={chunks} leaves {tokens // chunks} tokens per chunk "
            f"({tokens:,} tokens per microbatch per rank): each chunk pays an all-to-all and a host sync, so the "
            f"step is latency-bound; use at most {max(1, tokens // MIN_TOKENS_PER_DISPATCH_CHUNK)}"
        )


def train_windows_at_most(run: RunConfig) -> tuple[int, str] | None:
    """An upper bound on the train split's windows (sequences one epoch holds) and where it comes
    from, without reading the data: a prepared directory's index.json n_tokens, else
    data.max_bytes (the byte corpus is at most that long). None when the index cannot be read
    (the data loader reports that, with the file's name)."""
    d, seq = run.data, run.model.seq_len
    if d.prepared:
        try:
            n = int(json.loads((Path(d.prepared).expanduser() / INDEX_FILE).read_text())["n_tokens"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        where = f"data.prepared={d.prepared} holds {n:,} tokens"
    else:
        n = int(d.max_bytes)
        where = f"data.max_bytes={n:,} bounds the byte corpus"
    n_train = n - int(round(n * d.val_fraction))
    return max(0, (n_train - 1) // seq), where


# A step reading the train split more than this many times over is a typo, not a plan (tiny
# corpora in smoke runs and tests legitimately repeat their few sequences within a step).
MAX_EPOCHS_PER_STEP = 64
# Llama 3 trained on 16M tokens per step; 64 times that in one step is no real run.
MAX_TOKENS_PER_STEP = 2**30


def check_batch_against_data(run: RunConfig) -> None:
    """Refuse a global batch no run means: more than MAX_TOKENS_PER_STEP tokens per step, or
    one step holding the train split's sequences more than MAX_EPOCHS_PER_STEP times over
    (trainer.global_batch_size=1e8 otherwise reads and tries to compute 1e8 sequences per
    step, silently, for hours)."""
    t, seq = run.trainer, run.model.seq_len
    tokens = t.global_batch_size * seq
    if tokens > MAX_TOKENS_PER_STEP:
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size:,} sequences of model.seq_len={seq} is "
            f"{tokens:,} tokens per step, over {MAX_TOKENS_PER_STEP:,} (64 x Llama 3's 16M): lower "
            f"trainer.global_batch_size"
        )
    bound = train_windows_at_most(run)
    if bound is None:
        return
    windows, where = bound
    if windows >= 1 and t.global_batch_size > MAX_EPOCHS_PER_STEP * windows:
        raise ConfigError(
            f"trainer.global_batch_size={t.global_batch_size:,} sequences of model.seq_len={seq} "
            f"({tokens:,} tokens per step) exceeds {MAX_EPOCHS_PER_STEP} times the train split's "
            f"{windows:,} sequences ({where}): every step would repeat the whole data set; use "
            f"trainer.global_batch_size <= {MAX_EPOCHS_PER_STEP * windows:,} or more data"
        )


def device_memory_bytes(device_type: str, local_rank: int = 0) -> tuple[int, str]:
    """(bytes, description) of the memory one rank computes in: a CUDA device's total memory, or
    on a CPU the machine's physical memory (MemTotal, or a smaller cgroup memory limit)."""
    if device_type == "cuda":
        index = local_rank % max(1, torch.cuda.device_count())
        props = torch.cuda.get_device_properties(index)
        return int(props.total_memory), f"cuda:{index} ({props.name}) has"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    what = "this machine has"
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit() and int(limit) < total:
            total, what = int(limit), "this container's memory limit (/sys/fs/cgroup/memory.max) is"
    except OSError:
        pass
    return int(total), what


# The planner replays a pipeline schedule action by action; beyond this many microbatches per rank
# it is planned with this many (a lower bound of the peak: 1F1B and interleaved hold at most about
# pp*vpp in flight, GPipe holds all, so a capped plan never refuses what would fit).
PLAN_MICROBATCHES_CAP = 256


def check_fits_device(run: RunConfig, par, world_size: int, micro: int, n_micro: int, ranks_per_node: int) -> None:
    """Refuse, before any process group or allocation, a model whose planned peak memory per rank
    (planning/plan.py plan_rank, built on the meta device: nothing is allocated) exceeds the
    device's memory: a CUDA device's total memory, or on a CPU the machine's physical memory
    shared by the ranks_per_node ranks on it. One line with the numbers."""
    t, m = run.trainer, run.model
    on_cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    if on_cuda and not torch.cuda.is_available():
        return  # trainer.device=cuda on a machine without one: the loop says so
    device_type = "cuda" if on_cuda else "cpu"
    capacity, what = device_memory_bytes(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    sharing = 1 if on_cuda else max(1, ranks_per_node)
    if _rough_bytes_per_rank(run, par, micro, n_micro) * sharing * 4 < capacity:
        return  # clearly fits: skip the planner's meta build and activation trace (a second or two)
    try:
        plans = _stage_plans(run, par, world_size, micro, min(n_micro, PLAN_MICROBATCHES_CAP), device_type)
    except RuntimeError:  # a planner disagreement (planning/plan.py) is not the run's fault: no verdict
        return
    heaviest = max(plans, key=lambda p: p["memory"]["bytes"]["total"])
    b = heaviest["memory"]["bytes"]
    need = b["total"] * sharing
    if need <= capacity:
        return
    gib = 2**30
    per = f"{b['total'] / gib:,.1f} GiB per rank x {sharing} ranks on this machine = " if sharing > 1 else ""
    raise ConfigError(
        f"the model does not fit: the planner puts {per}{need / gib:,.1f} GiB on rank {heaviest['rank']} "
        f"(weights {b['weights'] / gib:,.1f}, grads {b['grads'] / gib:,.1f}, optimizer {b['optimizer'] / gib:,.1f}, "
        f"activations {b['activations'] / gib:,.1f} GiB at micro_batch_size {micro}) but {what} "
        f"{capacity / gib:,.1f} GiB; model.vocab_size={m.vocab_size}, model.hidden_size={m.hidden_size}, "
        f"model.ffn_hidden_size={m.ffn_hidden_size}, model.num_layers={m.num_layers}, model.seq_len={m.seq_len}: "
        "use a smaller model or micro batch, or shard it (parallel.tp/pp, optim.zero); trainer.dry_run=true "
        "prints the plan"
    )


def _rough_bytes_per_rank(run: RunConfig, par, micro: int, n_micro: int) -> float:
    """A generous analytic estimate of a rank's peak bytes (no meta build): 20 bytes per parameter
    of this rank (fp32 weights, grads, two AdamW moments, a 16-bit copy) plus fp32 activations of
    every layer's tensors for the microbatches a pipeline can hold. Only used to skip the planner
    when even 4x this fits."""
    from meshtron.planning.flops import params_per_rank

    m = run.model
    params = params_per_rank(m, tp=par.tp, ep=par.ep, etp=par.etp, pp=par.pp)
    tokens = micro * m.seq_len / max(1, par.cp)
    ffn = max(m.ffn_hidden_size or 0, (m.moe_ffn_hidden_size or 0) * max(1, m.top_k if m.is_moe else 1))
    per_layer = 24 * m.hidden_size + 4 * ffn + 4 * m.num_heads * m.seq_len
    layers = -(-m.num_layers // par.pp)
    in_flight = min(n_micro, par.pp * par.vpp) if par.schedule != "gpipe" else n_micro
    acts = 4 * tokens * (layers * per_layer / par.tp + 4 * m.padded_vocab_size(par.tp) / par.tp) * max(1, in_flight)
    return 20 * params + acts


def _stage_plans(run: RunConfig, par, world_size: int, micro: int, planned_micro: int, device_type: str) -> list:
    """plan_rank of one rank per pipeline stage (ranks are laid out pp x dp x cp x tp)."""
    from meshtron.planning.plan import plan_rank

    t, o = run.trainer, run.optim
    precision = t.precision
    if precision == "auto":  # the loop resolves it before these checks; direct callers may not have
        from meshtron.training.precision import device_has_fast_bf16

        precision = run.with_precision_for(device_type, device_has_fast_bf16(device_type))[0].trainer.precision
    stride = world_size // par.pp
    return [
        plan_rank(
            run.model,
            par,
            world_size,
            stage * stride,
            micro_batch_size=micro,
            global_batch_size=micro * par.dp * planned_micro,
            precision=precision,
            zero=o.zero,
            offload=o.offload,
            param_dtype=o.param_dtype,
            device=device_type,
            execution=run.execution("torch"),
        )
        for stage in range(par.pp)
    ]


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


class StartPoint(NamedTuple):
    """What a run starts from: `kind` ("resume" | "init_from" | "init_from_hf"), the checkpoints
    to try newest first (`paths`: the newest complete one and those before it under
    resume=auto; one for an explicit path or a Hugging Face folder), and whether the path was
    given explicitly (then its failure is an error, not a fallback to an older one)."""

    kind: str
    paths: tuple[Path, ...]
    explicit: bool = True


def check_start(path: Path, model_cfg, kind: str, meta: dict | None = None) -> dict:
    """`check_complete` (files at their sizes, the DCP metadata's checksum; skipped when its
    `meta` is given), then that `kind` can start from it: a resume needs the optimizer state
    (not a weights-only checkpoint) and the same model (`check_compatible`: every field but
    RESUME_MAY_CHANGE), init_from the WEIGHT_READING_FIELDS. Returns its meta;
    CheckpointError naming the problem."""
    meta = check_complete(path) if meta is None else meta
    if kind == "resume" and meta.get("weights_only"):  # before the model check: its hint is init_from's
        raise CheckpointError(
            f"{path} holds weights only (no optimizer state or step); start from it with checkpoint.init_from={path}"
        )
    check_compatible(path, model_cfg, resume=kind == "resume")
    return meta


def checkpoint_to_start_from(run: RunConfig) -> StartPoint | None:
    """Where the run starts (`StartPoint`), or None for a fresh start, after checking the
    newest candidate is complete (`check_complete`) and fits the run (`check_start`; a Hugging
    Face folder: its safetensors headers hold the tensors this model needs). The data files'
    checksums are verified by the ranks that read them, as they load (training/checkpoint_files.py).
    With checkpoint.resume=auto a checkpoint in checkpoint.dir wins over checkpoint.init_from,
    which starts a run that has none. Runs before any process group, on every rank alike, so a
    bad checkpoint fails with one line instead of a hang."""
    c = run.checkpoint
    kind = "resume"
    try:
        candidates, explicit = start_folders(c.dir, c.resume)
        if not candidates and c.init_from:
            kind = "init_from"
            folder = hf_folder(c.init_from)
            if folder is not None:
                check_hf_weights(folder, run.model)
                return StartPoint("init_from_hf", (folder,))
            candidates, explicit = start_folders(None, c.init_from)
        if not candidates:
            return None
        newest, meta = load_newest_intact(candidates, check_complete, explicit=explicit)
        check_start(newest, run.model, kind, meta)
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.{kind}: {err}") from err
    return StartPoint(kind, tuple(candidates[candidates.index(newest) :]), explicit)
