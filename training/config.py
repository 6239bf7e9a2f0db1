"""Typed run configuration: the Hydra/OmegaConf tree converted into dataclasses at the edge.

`RunConfig.from_omegaconf(cfg)` checks types and unknown keys and raises `ConfigError` with
one line naming the key and what to change. Everything below `train.py` only sees these
dataclasses (plus `GPTConfig` and `ParallelConfig`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from meshtron.errors import ConfigError
from meshtron.kernels.tf32 import TF32_MODES
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.mesh import ParallelConfig
from meshtron.rules import batch_size_checks, local_sgd_checks, param_dtype_checks, precision_check, raise_first
from meshtron.schema import Allowed, allowed, field_checks, nearest_key
from meshtron.training.schedule import DECAY_STYLES


def _field(default, **rule):
    """A config field with its default and its declared range/choices (meshtron/schema.py)."""
    return field(default=default, metadata=allowed(**rule) if rule else {})


@dataclass
class TrainerConfig:
    max_steps: int = _field(200, ge=1)
    seed: int = _field(1234, ge=0)
    device: str = _field("auto", choices=("auto", "cpu", "cuda"))
    global_batch_size: int = 16             # ranges: meshtron/rules.py batch_size_checks (shared with the planner)
    micro_batch_size: int | None = None
    dry_run: bool = False
    log_every: int = _field(10, ge=1)
    max_grad_norm: float = _field(1.0, ge=0)                  # 0 = no clipping
    precision: str = "fp32"    # fp32 | bf16 | fp16 (meshtron/rules.py): autocast compute, fp32 main weights and grads
    initial_loss_scale: float = _field(65536.0, ge=1)        # fp16 only: dynamic loss scale to start from
    loss_scale_window: int = _field(1000, ge=1)              # fp16 only: clean steps before the scale doubles
    num_threads: int | None = _field(None, ge=1)
    progress: bool = True
    trace_step: int | None = _field(None, ge=1)
    recompute: str = "none"                  # none | selective | full (rules: models.config.ExecutionConfig)
    recompute_layers: int | None = None      # full recompute for the first N layers only (None = all)
    fused_lm_loss: bool = True               # LM head + cross-entropy in row chunks: no whole logits (kernels/linear_cross_entropy.py)
    lm_loss_chunk_rows: int | None = _field(None, ge=1)  # rows per chunk of the fused loss (None: by device, chunk_rows_for)
    compile_moe: bool = False                # torch.compile each MoE layer, or its router and experts (meshtron/rules.py compile_moe_checks)
    moe_dispatch_chunks: int = _field(1, ge=1)  # MoE tokens dispatched in chunks: one chunk's experts overlap another's all-to-alls (moe/layer.py)
    eval_every: int = _field(0, ge=0)                        # 0 = off
    eval_batches: int = _field(2, ge=1)
    max_skipped: int = _field(5, ge=0)
    collective_timeout_s: float = _field(300.0, gt=0)
    watchdog_timeout_s: float | None = _field(None, ge=0)    # a phase stuck this long is reported (None = collective_timeout_s / 2; 0 = off)
    tensorboard: bool = False                                # also write TensorBoard events to <run dir>/tb


@dataclass
class OptimConfig:
    lr: float = _field(3e-3, gt=0)
    weight_decay: float = _field(0.1, ge=0)
    betas: tuple[float, float] = _field((0.9, 0.95), items=Allowed(ge=0, lt=1))
    eps: float = _field(1e-8, gt=0)
    warmup_steps: int | None = _field(None, ge=0)
    min_lr_ratio: float = _field(0.1, ge=0, le=1)
    decay: str = _field("cosine", choices=DECAY_STYLES)
    zero: int = _field(0, choices=(0, 1, 2, 3))  # 0 replicated AdamW, 1 optimizer state sharded over the replicas, 2 + gradients, 3 + parameters (mpu/zero3.py)
    offload: bool = False   # AdamW state and fp32 main weights in CPU memory; the update runs on the CPU
    grad_comm_dtype: str = _field("fp32", choices=("fp32", "bf16"))  # dtype gradients are reduced in over dp
    # ZeRO-1/2: each bucket's parameter all-gather runs asynchronously, waited for by the first
    # layer that reads it in the next forward (mpu/param_gather.py); false = blocking after the step
    overlap_param_gather: bool = True
    bucket_mb: float = _field(25.0, gt=0)  # gradient (and ZeRO parameter-gather) bucket size, MiB of fp32
    # bf16 = 16-bit resident weights: bf16 model weights, fp32 main weights only in the optimizer (mpu/resident.py)
    param_dtype: str = _field("fp32", choices=("fp32", "bf16"))
    # local SGD / DiLoCo (training/local_sgd.py): inner steps each data replica takes alone between
    # parameter averages over dp; an outer Nesterov step on the averaged delta with nesterov
    local_steps: int = _field(1, ge=1)
    outer_optimizer: str = _field("none", choices=("none", "nesterov"))
    outer_lr: float = _field(0.7, gt=0)
    outer_momentum: float = _field(0.9, ge=0, lt=1)
    # parameter-server synchronisation (parallel.dp_mode=ps; training/param_server.py): bsp waits for
    # every worker, ssp lets a worker run at most `staleness` steps ahead of the slowest, asp never waits
    sync: str = _field("bsp", choices=("bsp", "ssp", "asp"))
    staleness: int = _field(0, ge=0)


@dataclass
class DataConfig:
    paths: list[str] | None = None
    max_bytes: int = _field(16_000_000, ge=1)
    val_fraction: float = _field(0.01, ge=0, lt=1)
    # A directory written by `meshtron-prepare` (tokens.bin + index.json), memory-mapped; when
    # set, `paths` and `max_bytes` are ignored. See textdata.data.build_dataset.
    prepared: str | None = None
    # Packed documents: attention and positions restart after every end-of-document token
    # (textdata.data.document_end_id: data.eos_id, or the prepared tokenizer's single EOS id).
    reset_at_eos: bool = False
    eos_id: int | None = _field(None, ge=0)


@dataclass
class CheckpointConfig:
    dir: str | None = None                      # where step_N folders are written (shared by all ranks)
    every: int = _field(0, ge=0)                # save every N steps (0 = only at the end and on SIGTERM)
    keep: int | None = _field(3, ge=1)          # newest checkpoints kept (null = all)
    resume: str | None = None                   # null | auto (newest valid in dir, else fresh) | a step_N folder
    init_from: str | None = None                # start from these weights only (step 0, fresh optimizer)
    # checkpoint.async (a Python keyword, hence the field name): stage to host memory, write in
    # a background thread while training goes on (training/checkpoint.py AsyncCheckpointer)
    async_: bool = field(default=False, metadata={"key": "async"})


@dataclass
class KernelsConfig:
    backend: str = _field("auto", choices=("auto", "torch", "triton"))
    tf32: str = _field("auto", choices=TF32_MODES)  # fp32 dots of the Triton GEMMs: follow torch's policy | on | off


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
    def from_dict(tree: dict[str, Any]) -> "RunConfig":
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
        return run

    def execution(self, kernel_backend: str = "torch") -> ExecutionConfig:
        """How the model runs (not part of what is saved): trainer.recompute,
        trainer.recompute_layers, trainer.fused_lm_loss, trainer.lm_loss_chunk_rows and
        trainer.compile_moe, trainer.moe_dispatch_chunks, and the kernel backend `kernels.backend`
        resolved to."""
        return ExecutionConfig(recompute=self.trainer.recompute, recompute_layers=self.trainer.recompute_layers,
                               kernel_backend=kernel_backend, fused_lm_loss=self.trainer.fused_lm_loss,
                               lm_loss_chunk_rows=self.trainer.lm_loss_chunk_rows,
                               compile_moe=self.trainer.compile_moe,
                               moe_dispatch_chunks=self.trainer.moe_dispatch_chunks)

    def validate(self) -> None:
        """Every field's type and range (meshtron/schema.py; model and parallel check their own
        when built), then the rules that tie fields together. Raises ConfigError."""
        t, o, c = self.trainer, self.optim, self.checkpoint
        raise_first([check for name in ("trainer", "optim", "data", "checkpoint", "kernels")
                     for check in field_checks(name, getattr(self, name))], ConfigError)
        try:
            self.execution()
        except ValueError as err:
            raise ConfigError(str(err)) from err
        checks = [
            precision_check(t.precision),
            *batch_size_checks(t.global_batch_size, t.micro_batch_size),
            (o.warmup_steps is None or o.warmup_steps <= t.max_steps,
             f"optim.warmup_steps={o.warmup_steps} exceeds trainer.max_steps={t.max_steps}"),
            (t.trace_step is None or t.trace_step <= t.max_steps,
             f"trainer.trace_step={t.trace_step} must be a step in 1..trainer.max_steps={t.max_steps}"),
            (not c.every or bool(c.dir),
             f"checkpoint.every={c.every} needs checkpoint.dir (where to write the checkpoints)"),
            *param_dtype_checks(o.param_dtype, t.precision, o.zero, self.parallel.pp),
            *local_sgd_checks(o.local_steps, o.outer_optimizer, zero=o.zero, offload=o.offload,
                              param_dtype=o.param_dtype, num_experts=self.model.num_experts, checkpoint_dir=c.dir, dp_mode=getattr(self.parallel, "dp_mode", "allreduce")),
            (not (self.parallel.dp_hierarchical is True and o.zero >= 2),
             f"parallel.dp_hierarchical=true is built for all-reduced gradient buckets; optim.zero={o.zero} "
             "reduce-scatters them: use optim.zero<=1 or parallel.dp_hierarchical=false"),
            (c.resume != "auto" or bool(c.dir), "checkpoint.resume=auto needs checkpoint.dir (where to look for checkpoints)"),
            (o.sync == "bsp" or self.parallel.dp_mode == "ps",
             f"optim.sync={o.sync} needs parameter servers (parallel.dp_mode=ps parallel.servers=N); all-reduce "
             "data parallelism is bulk-synchronous (optim.sync=bsp)"),
            (o.staleness == 0 or o.sync == "ssp",
             f"optim.staleness={o.staleness} applies only to optim.sync=ssp (got optim.sync={o.sync})"),
            (not c.async_ or bool(c.dir), "checkpoint.async=true needs checkpoint.dir (where to write the checkpoints)"),
            (not (c.resume and c.init_from),
             "checkpoint.resume and checkpoint.init_from are exclusive: resume continues a run (optimizer, step, data "
             "position), init_from only takes weights; set one of them"),
        ]
        raise_first(checks, ConfigError)

    @property
    def warmup_steps(self) -> int:
        """Warm-up length: optim.warmup_steps, or 10% of trainer.max_steps when unset."""
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return max(1, self.trainer.max_steps // 10)


SECTIONS = {"model": GPTConfig, "parallel": ParallelConfig, "trainer": TrainerConfig, "optim": OptimConfig,
            "data": DataConfig, "checkpoint": CheckpointConfig, "kernels": KernelsConfig}


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
