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
from meshtron.rules import batch_size_checks, first_failure, precision_check
from meshtron.kernels.tf32 import TF32_MODES
from meshtron.models.config import GPTConfig
from meshtron.mpu.mesh import ParallelConfig, ParallelConfigError
from meshtron.mpu.pipeline_schedules import SCHEDULES


@dataclass
class TrainerConfig:
    max_steps: int = 200
    seed: int = 1234
    device: str = "auto"
    global_batch_size: int = 16
    micro_batch_size: int | None = None
    dry_run: bool = False
    log_every: int = 10
    max_grad_norm: float = 1.0
    precision: str = "fp32"                  # fp32 | bf16 | fp16 (autocast compute, fp32 main weights and grads)
    initial_loss_scale: float = 65536.0      # fp16 only: dynamic loss scale to start from
    loss_scale_window: int = 1000            # fp16 only: clean steps before the scale doubles
    num_threads: int | None = None
    progress: bool = True
    trace_step: int | None = None
    recompute: str = "none"
    recompute_layers: int | None = None
    eval_every: int = 0
    eval_batches: int = 2
    max_skipped: int = 5
    collective_timeout_s: float = 300.0
    watchdog_timeout_s: float | None = None  # report a phase stuck this long (None = collective_timeout_s / 2; 0 = off)
    tensorboard: bool = False                # also write TensorBoard events to <run dir>/tb


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    decay: str = "cosine"
    zero: int = 0
    offload: bool = False   # AdamW state and fp32 main weights in CPU memory; the update runs on the CPU
    grad_comm_dtype: str = "fp32"  # fp32 | bf16: dtype gradients are reduced in over dp (compression)


@dataclass
class DataConfig:
    paths: list[str] | None = None
    max_bytes: int = 16_000_000
    val_fraction: float = 0.01
    # A directory written by `python -m meshtron.textdata.prepare` (tokens.bin + index.json), memory-
    # mapped; when set, `paths` and `max_bytes` are ignored. See textdata.data.build_dataset.
    prepared: str | None = None


@dataclass
class CheckpointConfig:
    dir: str | None = None          # where step_N folders are written (shared by all ranks)
    every: int = 0                  # save every N steps (0 = only at the end and on SIGTERM)
    keep: int | None = 3            # newest checkpoints kept (null = all)
    resume: str | None = None       # null | auto (newest valid in dir, else fresh) | a step_N folder
    init_from: str | None = None    # start from these weights only (step 0, fresh optimizer)


@dataclass
class KernelsConfig:
    backend: str = "auto"
    tf32: str = "auto"  # fp32 dots of the Triton GEMMs: auto (follow torch's matmul policy) | on | off


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
        kinds = {"model": GPTConfig, "parallel": ParallelConfig, "trainer": TrainerConfig,
                 "optim": OptimConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
                 "kernels": KernelsConfig}
        built = {}
        for key, value in tree.items():
            if key == "hydra":
                continue
            if key not in kinds:
                raise ConfigError(f"unknown config section {key!r}; known: {', '.join(kinds)}")
            built[key] = _build_section(key, kinds[key], value or {})
        run = RunConfig(**built)
        try:  # execution choices the model needs to know about
            run.model = dataclasses.replace(run.model, recompute=run.trainer.recompute,
                                            recompute_layers=run.trainer.recompute_layers)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        run.validate()
        return run

    def validate(self) -> None:
        t, o = self.trainer, self.optim
        if t.max_steps < 1:
            raise ConfigError(f"trainer.max_steps={t.max_steps} must be >= 1")
        if t.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"trainer.device={t.device!r} must be auto, cpu or cuda")
        ok, message = precision_check(t.precision)
        if not ok:
            raise ConfigError(message)
        if t.initial_loss_scale < 1 or t.loss_scale_window < 1:
            raise ConfigError(f"trainer.initial_loss_scale={t.initial_loss_scale} and trainer.loss_scale_window="
                              f"{t.loss_scale_window} must be >= 1")
        message = first_failure(batch_size_checks(t.global_batch_size, t.micro_batch_size))
        if message:  # how the batch splits needs the layout: training/loop.py checks batch_checks
            raise ConfigError(message)
        if t.eval_every < 0 or t.eval_batches < 1:
            raise ConfigError(f"trainer.eval_every={t.eval_every} must be >= 0 (0 = off) and "
                              f"trainer.eval_batches={t.eval_batches} >= 1")
        if t.collective_timeout_s <= 0:
            raise ConfigError(f"trainer.collective_timeout_s={t.collective_timeout_s} must be > 0")
        if t.watchdog_timeout_s is not None and t.watchdog_timeout_s < 0:
            raise ConfigError(f"trainer.watchdog_timeout_s={t.watchdog_timeout_s} must be >= 0 (0 = off)")
        if t.max_skipped < 0:
            raise ConfigError(f"trainer.max_skipped={t.max_skipped} must be >= 0")
        if t.log_every < 1:
            raise ConfigError(f"trainer.log_every={t.log_every} must be >= 1")
        if o.lr <= 0:
            raise ConfigError(f"optim.lr={o.lr} must be > 0")
        if o.zero not in (0, 1, 2):
            raise ConfigError(f"optim.zero={o.zero}: choose 0 (replicated AdamW), 1 (optimizer state sharded over "
                              f"the replicas) or 2 (optimizer state and gradients sharded)")
        if o.grad_comm_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"optim.grad_comm_dtype={o.grad_comm_dtype!r} must be fp32 or bf16")
        if o.warmup_steps is not None and o.warmup_steps > t.max_steps:
            raise ConfigError(f"optim.warmup_steps={o.warmup_steps} exceeds trainer.max_steps={t.max_steps}")
        c = self.checkpoint
        if c.every < 0:
            raise ConfigError(f"checkpoint.every={c.every} must be >= 0 (0 = save only at the end and on SIGTERM)")
        if c.every and not c.dir:
            raise ConfigError(f"checkpoint.every={c.every} needs checkpoint.dir (where to write the checkpoints)")
        if c.keep is not None and c.keep < 1:
            raise ConfigError(f"checkpoint.keep={c.keep} must be >= 1 (or null to keep all)")
        if c.resume == "auto" and not c.dir:
            raise ConfigError("checkpoint.resume=auto needs checkpoint.dir (where to look for checkpoints)")
        if c.resume and c.init_from:
            raise ConfigError("checkpoint.resume and checkpoint.init_from are exclusive: resume continues a run "
                              "(optimizer, step, data position), init_from only takes weights; set one of them")
        if self.kernels.backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"kernels.backend={self.kernels.backend!r} must be auto, torch or triton")
        if self.kernels.tf32 not in TF32_MODES:
            raise ConfigError(f"kernels.tf32={self.kernels.tf32!r} must be one of {', '.join(TF32_MODES)}")
        if self.parallel.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule={self.parallel.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
        if self.parallel.vpp > 1 and self.parallel.schedule != "interleaved":
            raise ConfigError(f"parallel.vpp={self.parallel.vpp} needs parallel.schedule=interleaved")
        if t.trace_step is not None and not 1 <= t.trace_step <= t.max_steps:
            raise ConfigError(f"trainer.trace_step={t.trace_step} must be a step in 1..trainer.max_steps={t.max_steps}")

    @property
    def warmup_steps(self) -> int:
        """Warm-up length: optim.warmup_steps, or 10% of trainer.max_steps when unset."""
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return max(1, self.trainer.max_steps // 10)


def _build_section(section: str, kind: type, values: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"unknown key {section}.{unknown[0]}; known keys: {', '.join(sorted(names))}")
    if kind is ParallelConfig and not isinstance(values.get("sp", False), bool):
        raise ConfigError(f"parallel.sp={values['sp']!r} must be true or false")
    try:
        if kind is OptimConfig and "betas" in values:
            values = dict(values, betas=tuple(values["betas"]))
        return kind(**values)
    except (ValueError, TypeError, ParallelConfigError) as err:
        raise ConfigError(f"{section}: {err}") from err
