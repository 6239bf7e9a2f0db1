"""The Engine: one object that builds a run from its config and steps it.

Every caller that trains a model (the training loop, `python -m meshtron.verify`, the
parameter-server workers, `bench/throughput.py`, `bench/memory.py`) builds its run here, in
the one order that works for every layout:

    mesh -> model chunks (layout-independent init) -> gradient reducer + optimizer
         -> ZeRO parameter-gather overlap -> pipeline executor (pp > 1)

and steps it with `Engine.step` (microbatch accumulation, or the pipeline schedule at pp > 1).
What differs between callers is data (where batches come from), logging, and what happens
between steps; none of that lives here. Checkpoint save and load go through the engine too, so
a run's state (chunks, optimizer, mesh) is named in one place.

Collectives: building the mesh creates every process group (the world's); the step talks over
the mesh's groups (training/step.py says which).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from meshtron.dp import zero3
from meshtron.dp.adamw import TrainingOptimizer
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.param_gather import finish_param_gather
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mappings import all_reduce_stats, world_group
from meshtron.mpu.mesh import Mesh, ParallelConfig, build_mesh
from meshtron.pipeline.executor import PipelineExecutor, activation_shape
from meshtron.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from meshtron.training.config import OptimConfig
from meshtron.training.hf_start import load_hf_into
from meshtron.training.optim import build_reducer_and_optimizer
from meshtron.training.precision import FP32, Precision
from meshtron.training.step import StepResult, evaluate, pipeline_train_step, train_step

# (chunks, mesh) -> (reducer, optimizer): a caller's own optimizer (the parameter-server client)
OptimizerFactory = Callable[[list[nn.Module], Mesh], tuple[DataParallelGradReducer, TrainingOptimizer]]


@dataclass
class EngineConfig:
    """What an engine is built from: the model, how it executes, the optimizer, the seed of
    its initial weights and the step's constants. The layout is the mesh (or the
    `ParallelConfig` the mesh is built from) given beside it."""

    model: GPTConfig
    micro_batch_size: int
    seed: int = 1234
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    max_grad_norm: float = 1.0
    eos_id: int | None = None  # packed documents: attention and positions restart after it

    @classmethod
    def from_run(
        cls, run, execution: ExecutionConfig, micro_batch_size: int, eos_id: int | None = None
    ) -> EngineConfig:
        """The engine config of a training run (`RunConfig`)."""
        return cls(
            model=run.model,
            micro_batch_size=micro_batch_size,
            seed=run.trainer.seed,
            execution=execution,
            optim=run.optim,
            max_grad_norm=run.trainer.max_grad_norm,
            eos_id=eos_id,
        )


class Engine:
    """A built run: this rank's `mesh`, model `chunks` (one per virtual pipeline stage), the
    data-parallel gradient `reducer`, the `optimizer`, the pipeline `executor` (pp > 1) and the
    ZeRO-1/2 `param_gather` overlap (None unless asked for). Build it with `Engine.build`.
    `precision` may be replaced before the first step: the training loop sets it after loading
    a checkpoint, whose train state carries the fp16 loss scale."""

    def __init__(
        self,
        config: EngineConfig,
        mesh: Mesh,
        chunks: list[nn.Module],
        reducer: DataParallelGradReducer,
        optimizer: TrainingOptimizer,
        device: torch.device,
        *,
        precision: Precision = FP32,
        param_gather=None,
    ):
        self.config, self.mesh, self.chunks = config, mesh, chunks
        self.reducer, self.optimizer, self.device = reducer, optimizer, torch.device(device)
        self.precision, self.param_gather = precision, param_gather
        self.executor = None
        if mesh.pp_size > 1:
            cfg = config.model
            self.executor = PipelineExecutor(
                chunks,
                mesh,
                activation_shape(mesh, cfg.seq_len, config.micro_batch_size, cfg.hidden_size),
                torch.float32,
                self.device,
            )

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        layout: Mesh | ParallelConfig,
        device: torch.device | str = "cpu",
        *,
        precision: Precision = FP32,
        ranks_per_node: int | None = None,
        overlap_param_gather: bool = False,
        optimizer_factory: OptimizerFactory | None = None,
        adjust_model: Callable[[list[nn.Module]], None] | None = None,
        init_weights: bool = True,
    ) -> Engine:
        """Build the run of `config` on `layout` (a built mesh, or the `ParallelConfig` to build
        one over the current world: creates every process group), on `device`.

        `optimizer_factory` replaces the `config.optim` reducer and optimizer
        (training/optim.py); `adjust_model` sees the chunks before the reducer takes their
        parameters (the verifier's fault injection); `overlap_param_gather` leaves ZeRO-1/2
        parameter all-gathers in flight after each update (dp/param_gather.py);
        `init_weights=False` leaves the weights zero for a caller that loads every one next."""
        device = torch.device(device)
        mesh = (
            layout
            if isinstance(layout, Mesh)
            else build_mesh(layout, config.model, device_type=device.type, ranks_per_node=ranks_per_node)
        )
        chunks = init_model_chunks(
            config.model, mesh, config.seed, device=device, execution=config.execution, initialize=init_weights
        )
        if adjust_model is not None:
            adjust_model(chunks)
        if optimizer_factory is None:
            reducer, optimizer = build_reducer_and_optimizer(config.optim, chunks, mesh)
        else:
            reducer, optimizer = optimizer_factory(chunks, mesh)
        param_gather = None
        if overlap_param_gather and hasattr(optimizer, "overlap_param_gather"):
            param_gather = optimizer.overlap_param_gather(chunks)
        return cls(config, mesh, chunks, reducer, optimizer, device, precision=precision, param_gather=param_gather)

    @property
    def model(self) -> nn.Module:
        """The model chunks as one module (parameters of every chunk)."""
        return self.chunks[0] if len(self.chunks) == 1 else nn.ModuleList(self.chunks)

    def step(
        self,
        microbatches: list[tuple[torch.Tensor, torch.Tensor]],
        lr: float,
        *,
        token_count: torch.Tensor | None = None,
        outer_replicas: int = 1,
    ) -> StepResult:
        """One optimizer step over this rank's `microbatches` (full sequences) at learning rate
        `lr`: `train_step`, or `pipeline_train_step` over the mesh's schedule at pp > 1
        (training/step.py; the collectives are theirs), and returns their `StepResult`.
        `token_count` and `outer_replicas`: parameter-server workers only (their mesh holds one
        of several data replicas)."""
        c = self.config
        if self.executor is None:
            return train_step(
                self.chunks[0],
                self.reducer,
                self.optimizer,
                microbatches,
                self.mesh,
                lr=lr,
                max_grad_norm=c.max_grad_norm,
                precision=self.precision,
                eos_id=c.eos_id,
                token_count=token_count,
                outer_replicas=outer_replicas,
            )
        if token_count is not None or outer_replicas != 1:
            raise ValueError("token_count and outer_replicas apply without pipeline parallelism only")
        return pipeline_train_step(
            self.chunks,
            self.reducer,
            self.optimizer,
            microbatches,
            self.mesh,
            self.executor,
            schedule=self.mesh.par.schedule,
            lr=lr,
            max_grad_norm=c.max_grad_norm,
            precision=self.precision,
            eos_id=c.eos_id,
        )

    def evaluate(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Mean LM cross-entropy of held-out microbatches, reduced over dp x cp and pp."""
        return evaluate(self.chunks, microbatches, self.mesh, self.executor, self.precision, eos_id=self.config.eos_id)

    def weights_are_finite(self) -> bool:
        """Whether every weight of every rank is finite: one flag all-reduced (max) over the world."""
        finish_param_gather(self.chunks)  # ZeRO-1/2 with optim.overlap_param_gather: gathers may be in flight
        with zero3.gathered(self.chunks):  # ZeRO-3: the parameters are sharded between steps
            flags = [torch.isfinite(p).all() for chunk in self.chunks for p in chunk.parameters()]
        bad = torch.stack(flags).logical_not().any().float().reshape(1) if flags else torch.zeros(1)
        return all_reduce_stats(bad, world_group(), op="max").item() == 0

    def load(self, path: Path, *, weights_only: bool = False) -> TrainState:
        """Load a checkpoint of any layout into this one (training/checkpoint.py); every rank."""
        return load_checkpoint(path, self.chunks, self.optimizer, self.mesh, weights_only=weights_only)

    def load_hf(self, folder: Path) -> int:
        """Read this rank's shards of the Hugging Face model in `folder` (training/hf_start.py);
        returns the bytes this rank read. Every rank, no communication."""
        return load_hf_into(folder, self.chunks, self.optimizer)

    def save(
        self,
        directory: str | Path,
        state: TrainState,
        *,
        keep: int | None,
        checkpointer=None,
        on_done: Callable[[Path], None] | None = None,
    ) -> None:
        """Save this rank's shards with `state` under `directory` (every rank), keeping the newest
        `keep`; through `checkpointer` (AsyncCheckpointer) in the background when given."""
        model_config = dataclasses.asdict(self.config.model)
        if checkpointer is not None:
            checkpointer.save(
                directory,
                state,
                self.chunks,
                self.optimizer,
                self.mesh,
                model_config=model_config,
                keep=keep,
                on_done=on_done,
            )
            return
        path = save_checkpoint(
            directory, state, self.chunks, self.optimizer, self.mesh, model_config=model_config, keep=keep
        )
        if on_done is not None:
            on_done(path)

    def close(self) -> None:
        """Remove the reducer's hooks and finish the last update's parameter gathers (before the
        process groups are torn down). An error already on its way stays the one reported."""
        self.reducer.remove_hooks()
        if self.param_gather is None:
            return
        failing = sys.exc_info()[1] is not None
        try:
            self.param_gather.finish()
        except Exception:  # noqa: BLE001 - an error already on its way is the one to report
            if not failing:
                raise
        self.param_gather.remove_hooks()
