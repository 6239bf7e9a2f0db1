"""Typed run configuration: the Hydra/OmegaConf tree converted into dataclasses at the edge.

`RunConfig.from_dict(tree)` checks types and unknown keys and raises `ConfigError` with
one line naming the key and what to change. Everything below `train.py` only sees these
dataclasses (plus `GPTConfig` and `ParallelConfig`).

Every field is declared with its default and its one-line help (`meshtron.schema.setting`);
configs/train.yaml is generated from `SECTIONS` (`python -m meshtron.configs.generate`), so the
yaml and the dataclasses cannot disagree. Decision: where they did (trainer.eval_every 0 here,
50 in train.yaml; the model sizes, see `GPTConfig`), the run's value became the default, so
`python train.py` trains and evaluates as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshtron.errors import ConfigError
from meshtron.kernels.tf32 import TF32_MODES
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.document_attention import attention_backend_checks
from meshtron.mpu.mesh import ParallelConfig
from meshtron.rules import (
    Check,
    batch_size_checks,
    local_sgd_checks,
    param_dtype_checks,
    pick_precision,
    precision_check,
    raise_first,
)
from meshtron.schema import Allowed, declared_in, field_checks, nearest_key, setting
from meshtron.training.hf_start import hf_folder, model_from_hf_folder
from meshtron.training.schedule import DECAY_STYLES


def _execution(name: str):
    """The trainer key `name` as ExecutionConfig declares it (default, range, help)."""
    return declared_in(ExecutionConfig, name)


@dataclass
class TrainerConfig:
    max_steps: int = setting(200, ge=1, help="optimizer steps")
    seed: int = setting(1234, ge=0, help="seed of the weights, the data order and dropout")
    device: str = setting("auto", choices=("auto", "cpu", "cuda"), help="auto | cpu | cuda")
    # ranges: meshtron/rules.py batch_size_checks (shared with the planner)
    global_batch_size: int = setting(16, help="sequences per optimizer step, over all data-parallel replicas")
    micro_batch_size: int | None = setting(None, help="null = global_batch_size / dp (no accumulation)")
    dry_run: bool = setting(False, help="plan memory per rank (plan.json) and exit without training")
    log_every: int = setting(10, ge=1, help="log metrics every N steps")
    max_grad_norm: float = setting(1.0, ge=0, help="gradient clipping norm (0 = no clipping)")
    # auto | fp32 | bf16 | fp16 | fp8 (meshtron/rules.py precision_check, pick_precision; fp8:
    # training/precision.py). auto: bf16 on a CUDA device with bf16, fp32 on CPUs.
    precision: str = setting(
        "auto",
        help="auto (bf16 on CUDA with bf16, else fp32) | fp32 | bf16 | fp16 | fp8: autocast compute "
        "(fp8: FP8 dense GEMMs), fp32 main weights and grads",
    )
    initial_loss_scale: float = setting(
        65536.0, ge=1, in_train_yaml=False, help="fp16 only: dynamic loss scale to start from"
    )
    loss_scale_window: int = setting(
        1000, ge=1, in_train_yaml=False, help="fp16 only: clean steps before the loss scale doubles"
    )
    num_threads: int | None = setting(None, ge=1, help="CPU threads per process; null = cores / local processes")
    progress: bool = setting(True, help="a progress bar on the main rank")
    trace_step: int | None = setting(
        None,
        ge=1,
        help="pipeline runs and ZeRO-1/2 with overlap_param_gather: write trace.json (Chrome trace) of this step",
    )
    recompute: str = _execution("recompute")  # rules: models.config.ExecutionConfig
    recompute_layers: int | None = _execution("recompute_layers")
    fused_lm_loss: bool = _execution("fused_lm_loss")  # kernels/linear_cross_entropy.py
    lm_loss_chunk_rows: int | None = _execution("lm_loss_chunk_rows")  # None: by device, chunk_rows_for
    compile: bool = _execution("compile")  # meshtron/rules.py compile_checks
    compile_mode: str = _execution("compile_mode")  # meshtron/rules.py cuda_graph_checks
    compile_moe: bool = _execution("compile_moe")  # meshtron/rules.py compile_moe_checks
    moe_dispatch_chunks: int = _execution("moe_dispatch_chunks")  # moe/layer.py
    attention_backend: str = _execution("attention_backend")  # mpu/document_attention.py
    eval_every: int = setting(50, ge=0, help="validation loss on the held-out split every N steps (0 = off)")
    eval_batches: int = setting(2, ge=1, help="global batches of held-out text per evaluation")
    max_skipped: int = setting(5, ge=0, help="abort after this many consecutive steps with a non-finite loss/grad norm")
    collective_timeout_s: float = setting(
        300.0, gt=0, help="a collective waiting longer than this raises instead of hanging"
    )
    watchdog_timeout_s: float | None = setting(
        None, ge=0, help="print rank, phase and stacks of a phase stuck this long (null = half the above; 0 = off)"
    )
    tensorboard: bool = setting(False, help="also write TensorBoard events to <run dir>/tb (needs the viz extra)")


@dataclass
class OptimConfig:
    lr: float = setting(3e-3, gt=0, help="peak learning rate (after warm-up)")
    weight_decay: float = setting(0.1, ge=0, help="AdamW decoupled weight decay")
    betas: tuple[float, float] = setting((0.9, 0.95), items=Allowed(ge=0, lt=1), help="AdamW betas")
    eps: float = setting(1e-8, gt=0, help="AdamW epsilon")
    warmup_steps: int | None = setting(None, ge=0, help="null = 10% of max_steps")
    min_lr_ratio: float = setting(0.1, ge=0, le=1, help="the decay ends at lr * min_lr_ratio")
    decay: str = setting("cosine", choices=DECAY_STYLES, help="cosine | linear | constant: the decay after warm-up")
    zero: int = setting(
        0,
        choices=(0, 1, 2, 3),
        help="0 = replicated AdamW; 1 = ZeRO-1: AdamW state sharded over the replicas (dp; edp for "
        "experts); 2 = also gradients; 3 = also parameters, gathered per layer (dp/zero3.py)",
    )
    offload: bool = setting(False, help="true = AdamW state and fp32 main weights in CPU memory, update on the CPU")
    grad_comm_dtype: str = setting(
        "fp32",
        choices=("fp32", "bf16"),
        help="bf16 = gradients reduced over dp in bf16 (compression), accumulated in fp32",
    )
    # dp/param_gather.py
    overlap_param_gather: bool = setting(
        True,
        help="ZeRO-1/2: parameter all-gathers run during the next forward, each bucket waited for by the "
        "first layer reading it (false = blocking after the step)",
    )
    bucket_mb: float = setting(
        25.0, gt=0, help="gradient bucket size (MiB of fp32): the unit of dp reduction and of ZeRO parameter gathers"
    )
    # bf16 resident weights: dp/resident.py
    param_dtype: str = setting(
        "fp32",
        choices=("fp32", "bf16"),
        help="bf16 = 16-bit resident weights (needs trainer.precision=bf16): fp32 main weights only in the optimizer",
    )
    # local SGD / DiLoCo (training/local_sgd.py): inner steps each data replica takes alone between
    # parameter averages over dp; an outer Nesterov step on the averaged delta with nesterov
    local_steps: int = setting(
        1,
        ge=1,
        help="local SGD: > 1 = each dp replica takes this many steps alone, then parameters are averaged over dp",
    )
    outer_optimizer: str = setting(
        "none",
        choices=("none", "nesterov"),
        help="nesterov = DiLoCo: an outer Nesterov SGD step on (global - averaged) parameters at each sync",
    )
    outer_lr: float = setting(0.7, gt=0, help="DiLoCo outer learning rate")
    outer_momentum: float = setting(0.9, ge=0, lt=1, help="DiLoCo outer Nesterov momentum")
    # parameter-server synchronisation (parallel.dp_mode=ps; training/param_server.py)
    sync: str = setting(
        "bsp",
        choices=("bsp", "ssp", "asp"),
        help="parameter servers: bsp (wait for all: equals all-reduce) | ssp (bounded staleness) | asp (never wait)",
    )
    staleness: int = setting(0, ge=0, help="ssp: a worker may run at most this many steps ahead of the slowest")


@dataclass
class DataConfig:
    paths: list[str] | None = setting(None, help="null = the Python standard library's .py sources; or files/folders")
    max_bytes: int = setting(16_000_000, ge=1, help="bytes of text read at most (the byte corpus)")
    val_fraction: float = setting(0.01, ge=0, lt=1, help="share of the text held out for validation")
    # A directory written by `meshtron-prepare` (tokens.bin + index.json), memory-mapped; when
    # set, `paths` and `max_bytes` are ignored. See textdata.data.build_dataset.
    prepared: str | None = setting(
        None, help="a dir from `python -m meshtron.textdata.prepare` (overrides paths/max_bytes)"
    )
    # Packed documents (textdata.data.document_end_id: data.eos_id, or the prepared tokenizer's single EOS id).
    reset_at_eos: bool = setting(
        False, help="packed documents: attention and positions restart after each end-of-document token"
    )
    eos_id: int | None = setting(
        None, ge=0, help="that token (null = the prepared tokenizer's EOS; the byte corpus has none)"
    )


@dataclass
class CheckpointConfig:
    dir: str | None = setting(
        None, help="where step_N folders go (e.g. checkpoints/run1), shared by all ranks; null = no checkpoints"
    )
    every: int = setting(0, ge=0, help="also save every N steps (always at the end and on SIGTERM when dir is set)")
    keep: int | None = setting(3, ge=1, help="newest checkpoints kept (null = all)")
    resume: str | None = setting(
        None, help="auto = newest valid checkpoint in dir (fresh start if none); or a step_N path"
    )
    init_from: str | None = setting(
        None, help="weights only (e.g. from `meshtron-hf import`), any layout: step 0, fresh optimizer"
    )
    # checkpoint.async (a Python keyword, hence the field name): training/checkpoint.py AsyncCheckpointer
    async_: bool = setting(
        False, key="async", help="true = staged to host memory, written in the background while training goes on"
    )


@dataclass
class KernelsConfig:
    backend: str = setting("auto", choices=("auto", "torch", "triton"), help="auto | torch | triton")
    tf32: str = setting(
        "auto", choices=TF32_MODES, help="Triton GEMMs' fp32 dots: auto (as torch's matmuls) | on (TF32) | off (IEEE)"
    )


@dataclass
class RunConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)

    @staticmethod
    def from_dict(tree: dict[str, Any]) -> RunConfig:
        """Build from a plain nested dict (e.g. `OmegaConf.to_container(cfg, resolve=True)`)."""
        kinds = SECTIONS
        built = {}
        for key, value in tree.items():
            if key == "hydra":
                continue
            if key not in kinds:
                raise ConfigError(_unknown(key, list(kinds)).replace("unknown key", "unknown config section", 1))
            built[key] = _build_section(key, kinds[key], value or {})
        run = RunConfig(**built)
        run.validate()
        folder = hf_folder(run.checkpoint.init_from)
        if folder is None:
            return run
        run = dataclasses.replace(run, model=model_from_hf_folder(folder, run.model))
        run.validate()
        return run

    def with_precision_for(self, device_type: str, bf16_supported: bool) -> tuple[RunConfig, str]:
        """This run with `trainer.precision=auto` resolved for the device it computes on
        (meshtron/rules.py pick_precision), checked again with the picked precision; returns
        (run, why), the why for the banner. Raises ConfigError naming the pick when a rule
        that auto satisfied fails for it (optim.param_dtype=bf16 on a CPU)."""
        picked, why = pick_precision(self.trainer.precision, device_type, bf16_supported)
        raise_first(self.attention_checks(device_type, picked), ConfigError)
        if picked == self.trainer.precision:
            return self, why
        run = dataclasses.replace(self, trainer=dataclasses.replace(self.trainer, precision=picked))
        try:
            run.validate()
        except ConfigError as err:
            raise ConfigError(f"{err} ({why})") from err
        return run, why

    def execution(self, kernel_backend: str = "torch") -> ExecutionConfig:
        """How the model runs (not part of what is saved): trainer.recompute,
        trainer.recompute_layers, trainer.fused_lm_loss, trainer.lm_loss_chunk_rows and
        trainer.compile, trainer.compile_mode, trainer.compile_moe, trainer.moe_dispatch_chunks,
        and the kernel backend `kernels.backend` resolved to."""
        return ExecutionConfig(
            recompute=self.trainer.recompute,
            recompute_layers=self.trainer.recompute_layers,
            kernel_backend=kernel_backend,
            fused_lm_loss=self.trainer.fused_lm_loss,
            lm_loss_chunk_rows=self.trainer.lm_loss_chunk_rows,
            compile=self.trainer.compile,
            compile_mode=self.trainer.compile_mode,
            compile_moe=self.trainer.compile_moe,
            moe_dispatch_chunks=self.trainer.moe_dispatch_chunks,
            attention_backend=self.trainer.attention_backend,
        )

    def validate(self) -> None:
        """Every field's type and range (meshtron/schema.py; model and parallel check their own
        when built), then the rules that tie fields together. Raises ConfigError."""
        t, o, c = self.trainer, self.optim, self.checkpoint
        raise_first(
            [
                check
                for name in ("trainer", "optim", "data", "checkpoint", "kernels")
                for check in field_checks(name, getattr(self, name))
            ],
            ConfigError,
        )
        try:
            self.execution()
        except ValueError as err:
            raise ConfigError(str(err)) from err
        checks = [
            precision_check(t.precision),
            *self.attention_checks(t.device if t.device != "auto" else None),
            *batch_size_checks(t.global_batch_size, t.micro_batch_size),
            (
                o.warmup_steps is None or o.warmup_steps <= t.max_steps,
                f"optim.warmup_steps={o.warmup_steps} exceeds trainer.max_steps={t.max_steps}",
            ),
            (
                t.trace_step is None or t.trace_step <= t.max_steps,
                f"trainer.trace_step={t.trace_step} must be a step in 1..trainer.max_steps={t.max_steps}",
            ),
            (
                not c.every or bool(c.dir),
                f"checkpoint.every={c.every} needs checkpoint.dir (where to write the checkpoints)",
            ),
            *param_dtype_checks(o.param_dtype, t.precision, o.zero, self.parallel.pp),
            *local_sgd_checks(
                o.local_steps,
                o.outer_optimizer,
                zero=o.zero,
                offload=o.offload,
                param_dtype=o.param_dtype,
                num_experts=self.model.num_experts,
                checkpoint_dir=c.dir,
                dp_mode=getattr(self.parallel, "dp_mode", "allreduce"),
            ),
            (
                not (self.parallel.dp_hierarchical is True and o.zero >= 2),
                f"parallel.dp_hierarchical=true is built for all-reduced gradient buckets; optim.zero={o.zero} "
                "reduce-scatters them: use optim.zero<=1 or parallel.dp_hierarchical=false",
            ),
            (
                c.resume != "auto" or bool(c.dir),
                "checkpoint.resume=auto needs checkpoint.dir (where to look for checkpoints)",
            ),
            (
                o.sync == "bsp" or self.parallel.dp_mode == "ps",
                f"optim.sync={o.sync} needs parameter servers (parallel.dp_mode=ps parallel.servers=N); all-reduce "
                "data parallelism is bulk-synchronous (optim.sync=bsp)",
            ),
            (
                o.staleness == 0 or o.sync == "ssp",
                f"optim.staleness={o.staleness} applies only to optim.sync=ssp (got optim.sync={o.sync})",
            ),
            (
                not c.async_ or bool(c.dir),
                "checkpoint.async=true needs checkpoint.dir (where to write the checkpoints)",
            ),
            (
                not c.init_from or c.resume in (None, "auto"),
                f"checkpoint.resume={c.resume} and checkpoint.init_from are exclusive: resume continues a run "
                "(optimizer, step, data position), init_from only takes weights; set one of them (with "
                "checkpoint.resume=auto, init_from is where a run with no checkpoint in checkpoint.dir starts)",
            ),
        ]
        raise_first(checks, ConfigError)

    def attention_checks(self, device_type: str | None, precision: str | None = None) -> list[Check]:
        """trainer.attention_backend's rules (mpu/document_attention.py attention_backend_checks)
        for a run on `device_type` (None: not resolved yet) in `precision` (None: trainer.precision)."""
        return attention_backend_checks(
            self.trainer.attention_backend,
            device_type=device_type,
            precision=precision or self.trainer.precision,
            attention_dropout=self.model.attention_dropout_p,
            cp=self.parallel.cp,
            cp_comm=self.parallel.cp_comm,
            sliding_window=self.model.attention_window,
        )

    @property
    def warmup_steps(self) -> int:
        """Warm-up length: optim.warmup_steps, or 10% of trainer.max_steps when unset."""
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return max(1, self.trainer.max_steps // 10)


SECTIONS = {
    "model": GPTConfig,
    "parallel": ParallelConfig,
    "trainer": TrainerConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "kernels": KernelsConfig,
}


def unknown_override(overrides: list[str]) -> str | None:
    """The error for the first command-line override `section.key=value` naming no config key
    (Hydra would refuse it with a multi-line struct error), suggesting the nearest key; None
    if all are known. Appending (`+`), deleting (`~`), flags and `hydra.*` are Hydra's."""
    known = [f"{section}.{config_key(f)}" for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)]
    for arg in overrides:
        key = arg.split("=", 1)[0]
        if "=" not in arg or arg.startswith(("+", "~", "-")) or key.startswith("hydra.") or "." not in key:
            continue
        if key not in known and key.split(".")[0] in SECTIONS:
            return _unknown(key, known)
        if key.split(".")[0] not in SECTIONS:
            return _unknown(key.split(".")[0], list(SECTIONS)).replace("unknown key", "unknown config section", 1)
    return None


def config_key(f: dataclasses.Field) -> str:
    """The config key of a dataclass field: its name, or `metadata["key"]` where the key is a
    Python keyword (`checkpoint.async` is the field `async_`)."""
    return f.metadata.get("key", f.name)


def _build_section(section: str, kind: type, values: dict[str, Any]):
    """The dataclass of one config section; unknown keys name the nearest known one."""
    names = {config_key(f): f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(_unknown(f"{section}.{unknown[0]}", [f"{section}.{n}" for n in names]))
    values = {names[key]: value for key, value in values.items()}
    if kind is OptimConfig and isinstance(values.get("betas"), list):
        values = dict(values, betas=tuple(values["betas"]))
    try:
        return kind(**values)
    except (ValueError, TypeError) as err:  # GPTConfig / ParallelConfig check their fields when built
        message = str(err)
        raise ConfigError(message if message.startswith(f"{section}.") else f"{section}: {message}") from err


def _unknown(key: str, known: list[str]) -> str:
    """One line for an unknown key: the nearest known key, or all of them."""
    near = nearest_key(key, known)
    hint = f"did you mean {near}?" if near else f"known: {', '.join(sorted(known))}"
    return f"unknown key {key}; {hint}"
