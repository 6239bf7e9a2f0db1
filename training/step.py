"""One optimizer step over a global batch: microbatch accumulation (or a pipeline schedule),
bucketed DP reduction, global-norm clipping and the AdamW update."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from meshtron.dp.adamw import TrainingOptimizer
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.kernels.operands import weight_copy_scope
from meshtron.models.mtp import depth_target_counts
from meshtron.moe.scope import AuxLossScope, aux_loss_scope
from meshtron.mpu.cross_entropy import IGNORE_INDEX
from meshtron.mpu.mappings import all_reduce_stats
from meshtron.mpu.mesh import Mesh
from meshtron.pipeline.executor import PipelineExecutor, PipelineResult
from meshtron.pipeline.schedules import build_all_ranks
from meshtron.training.packing import LocalMicrobatch, local_microbatches
from meshtron.training.precision import FP32, Precision


@dataclass
class MoELayerStats:
    """One MoE layer's routing figures over the step, global over the aux-loss scope (see
    `MoEStepStats`): `layer` is the global layer index; `aux_loss`, `z_loss` (unweighted) and
    `dropped_fraction` are averaged over microbatches, `tokens_per_expert` ([num_experts]) is
    summed over them."""

    layer: int
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    dropped_fraction: torch.Tensor
    tokens_per_expert: torch.Tensor


@dataclass
class StepResult:
    """What one optimizer step returns (`train_step`, `pipeline_train_step`, `Engine.step`).
    `loss`, `grad_norm` and `skipped` are the same on every rank; the MoE figures cover the
    global batch (`MoEStepStats.summary`)."""

    loss: torch.Tensor  # global-batch mean LM cross-entropy (reduced over dp x cp and pp), no aux terms
    grad_norm: torch.Tensor  # global gradient norm, before clipping
    skipped: bool  # non-finite loss or gradient norm: no update (nor expert-bias update) on any rank
    # MoE models only (None / empty otherwise): aux and z-loss, unweighted, summed over the MoE
    # layers (with aux_loss_layers="pooled", `aux_loss` is the pooled loss that was trained),
    # and each MoE layer's routing figures in layer order.
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    moe_layers: list[MoELayerStats] = field(default_factory=list)
    pipeline: PipelineResult | None = None  # pp > 1: the executor's result (timeline, peak live activations)
    # Multi-token prediction only (model.mtp_depths > 0, models/mtp.py): each depth's mean
    # cross-entropy over its counted labels of the global batch [D], and their mean over depths
    # (`mtp_loss`, unweighted: the objective added model.mtp_loss_weight * mtp_loss).
    mtp_loss: torch.Tensor | None = None
    mtp_depth_losses: torch.Tensor | None = None


class MTPObjective:
    """The MTP term of one step: each depth's summed cross-entropy divided by the global count
    of its labels (sum over dp x cp), weighted by mtp_loss_weight / D; `add` returns the
    differentiable term of one microbatch and accumulates the per-depth means for the report."""

    def __init__(self, cfg, microbatches: list[LocalMicrobatch], mesh: Mesh, device):
        self.depths, self.weight = cfg.mtp_depths, cfg.mtp_loss_weight
        self.counts = None
        self.total = None
        if self.depths:
            counts = depth_target_counts(microbatches, self.depths).to(device)
            self.counts = all_reduce_stats(counts, mesh.dp_cp).clamp(min=1.0)
            self.total = torch.zeros(self.depths, dtype=torch.float32, device=device)

    def add(self, sums: torch.Tensor | None) -> torch.Tensor | None:
        if sums is None or not self.depths:
            return None
        means = sums / self.counts.to(sums.device)
        self.total = self.total + means.detach().float().to(self.total.device)
        return means.sum() * (self.weight / self.depths)

    def report(self, out: StepResult, mesh: Mesh) -> None:
        """Per-depth means reduced over dp x cp and pp (only the last stage has them)."""
        if not self.depths:
            return
        per_depth = all_reduce_stats(all_reduce_stats(self.total, mesh.dp_cp), mesh.pp)
        out.mtp_depth_losses, out.mtp_loss = per_depth, per_depth.mean()


def global_token_count(microbatches: list[LocalMicrobatch], mesh: Mesh) -> torch.Tensor:
    """Number of non-ignored target tokens in the global batch (sum over dp x cp: each cp rank
    holds its chunks of the sequences)."""
    count = sum((mb.targets != IGNORE_INDEX).sum() for mb in microbatches).to(torch.float32)
    return all_reduce_stats(count, mesh.dp_cp).clamp(min=1.0)


def loss_forward_kwargs(microbatches: list[LocalMicrobatch]) -> list[dict]:
    """Each microbatch's forward keywords with its targets: the last model chunk then returns
    its summed LM loss (fused with the head under trainer.fused_lm_loss), the others ignore them.
    The MTP depths' inputs and labels (`mtp_inputs`, `mtp_labels`) are among the keywords when
    the microbatches were cut with mtp_depths (the last stage's depths read them)."""
    return [dict(mb.forward_kwargs, targets=mb.targets) for mb in microbatches]


def train_step(
    model: nn.Module,
    reducer: DataParallelGradReducer,
    optimizer: TrainingOptimizer,
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    mesh: Mesh,
    *,
    lr: float,
    max_grad_norm: float,
    precision: Precision = FP32,
    eos_id: int | None = None,
    token_count: torch.Tensor | None = None,
    outer_replicas: int = 1,
) -> StepResult:
    """Forward/backward every microbatch of this rank's share of the global batch, then update.

    `microbatches` hold full sequences; each rank runs its context-parallel shard of them, with
    document masks and positions restarting after `eos_id` when given (training/packing.py).

    The loss of each microbatch is its summed token cross-entropy divided by the number of
    tokens in the *global* batch, so accumulated gradients summed over dp equal the
    single-process gradient of the mean loss. MoE models add their routers' aux and z-loss
    terms, each pooled over the tokens of its aux-loss scope (moe/scope.py), averaged over the
    step's pooled sets (`AuxLossScope.objective_divisor`). Multi-token prediction
    (model.mtp_depths > 0) adds mtp_loss_weight / D times the sum of each depth's mean
    cross-entropy over its labels of the global batch (`MTPObjective`; reported as `mtp_loss`).
    Returns a `StepResult`: `loss` (global-batch mean LM cross-entropy, reduced over dp, no aux
    terms) and `grad_norm` (before clipping) as tensors, and `skipped`: True when the loss or
    the gradient norm is not finite, in which case the optimizer step (and the expert-bias
    update) is skipped on every rank and the weights stay as they were. MoE adds `aux_loss`,
    `z_loss` (unweighted, summed over layers) and per-layer `moe_layers` statistics.
    `precision` runs the forward under autocast and scales the loss (fp16; see
    training/precision.py); an overflow skips the step like any non-finite gradient.
    Parameter-server workers (training/param_server.py), whose mesh holds one of
    `outer_replicas` data replicas, pass the global batch's `token_count` (counted by the
    caller) and have the aux objective averaged over the replicas outside the mesh too.
    """
    model.train()
    microbatches = local_microbatches(microbatches, mesh, eos_id, model.cfg.mtp_depths)
    tokens = global_token_count(microbatches, mesh) if token_count is None else token_count
    reducer.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float32, device=tokens.device)
    n_micro = len(microbatches)
    scope = aux_loss_scope(model.cfg.aux_loss_scope, mesh)
    aux_divisor = scope.objective_divisor(n_micro) * outer_replicas
    moe = MoEStepStats(model.cfg, scope)
    mtp = MTPObjective(model.cfg, microbatches, mesh, tokens.device)
    with weight_copy_scope():  # the Triton GEMMs' 16-bit weight copies: made once per step
        for i, mb in enumerate(microbatches):
            with reducer.sync(i == n_micro - 1):
                with precision.autocast():
                    loss = model(mb.inputs, **mb.forward_kwargs, targets=mb.targets) / tokens
                    aux = model.aux_loss()
                    mtp_term = mtp.add(model.mtp_loss_sums())
                objective = loss if aux is None else loss + aux / aux_divisor
                if mtp_term is not None:
                    objective = objective + mtp_term
                (objective * precision.loss_scale).backward()
            loss_sum = loss_sum + loss.detach().to(loss_sum.device)
            moe.add(model.moe_stats(), n_micro, model.pooled_aux_value)
    reducer.finish()
    out = _finish_step([model], optimizer, mesh, loss_sum, moe, lr=lr, max_grad_norm=max_grad_norm, precision=precision)
    mtp.report(out, mesh)
    return out


def pipeline_train_step(
    chunks: list[nn.Module],
    reducer: DataParallelGradReducer,
    optimizer: TrainingOptimizer,
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    mesh: Mesh,
    executor: PipelineExecutor,
    *,
    schedule: str,
    lr: float,
    max_grad_norm: float,
    precision: Precision = FP32,
    eos_id: int | None = None,
) -> StepResult:
    """`train_step` for pipeline parallelism: run `schedule` over this rank's model chunks.

    Losses are normalised exactly as in `train_step` (the last stage divides by the global
    token count; MoE terms on any stage by the scope's number of pooled sets). Gradient buckets are
    reduced as the last backward of each chunk runs; the tied embedding's two copies (first
    and last stage) then have their gradients summed. The result's `pipeline` holds the
    executor's result (timeline, peak live activations).
    """
    for chunk in chunks:
        chunk.train()
    microbatches = local_microbatches(microbatches, mesh, eos_id, chunks[0].cfg.mtp_depths)
    tokens = global_token_count(microbatches, mesh)
    reducer.zero_grad()
    n_micro = len(microbatches)
    schedules = build_all_ranks(schedule, mesh.pp_size, n_micro, mesh.par.vpp)
    actions = schedules[mesh.pp_rank]
    last_backward = {a.chunk: i for i, a in enumerate(actions) if a.kind == "B"}
    scope = aux_loss_scope(chunks[0].cfg.aux_loss_scope, mesh)
    aux_divisor = scope.objective_divisor(n_micro)
    moe = MoEStepStats(chunks[0].cfg, scope)
    mtp = MTPObjective(chunks[0].cfg, microbatches, mesh, tokens.device)
    scale = precision.loss_scale

    def loss_fn(chunk, loss_sum, m):  # the last chunk's forward got the targets: its output is the summed loss
        return loss_sum / tokens * scale

    def extra_fn(chunk):
        aux = chunk.aux_loss()
        mtp_term = mtp.add(chunk.mtp_loss_sums())  # the last stage's MTP depths
        if aux is not None:
            moe.add(chunk.moe_stats(), n_micro)
            aux = aux / aux_divisor * scale
        if mtp_term is not None:
            mtp_term = mtp_term * scale
            aux = mtp_term if aux is None else aux + mtp_term
        return aux

    def before_backward(index, action):
        return reducer.sync(last_backward[action.chunk] == index)

    with weight_copy_scope(), precision.autocast():
        result = executor.run(
            schedules,
            [mb.inputs for mb in microbatches],
            loss_fn,
            extra_fn,
            before_backward,
            forward_kwargs=loss_forward_kwargs(microbatches),
        )
    reducer.finish()  # also sums the tied embedding's two copies over the first and last stage
    loss_sum = torch.stack(result.losses).sum() / scale if result.losses else torch.zeros((), device=tokens.device)
    out = _finish_step(chunks, optimizer, mesh, loss_sum, moe, lr=lr, max_grad_norm=max_grad_norm, precision=precision)
    out.pipeline = result
    mtp.report(out, mesh)
    return out


def _finish_step(
    chunks,
    optimizer: TrainingOptimizer,
    mesh: Mesh,
    loss_sum: torch.Tensor,
    moe: MoEStepStats,
    *,
    lr: float,
    max_grad_norm: float,
    precision: Precision = FP32,
) -> StepResult:
    """Unscale and clip the reduced gradients, reduce the loss over dp and pp (only the last
    stage has it), then update unless the loss or the gradient norm is not finite."""
    _unscale_gradients(chunks, optimizer, precision.loss_scale)
    grad_norm = optimizer.clip_grad_norm(chunks, max_grad_norm, mesh)
    loss_sum = all_reduce_stats(all_reduce_stats(loss_sum, mesh.dp_cp), mesh.pp)
    # Both values are global (identical on every rank), so every rank takes the same decision.
    # This is the step's one host sync outside logging (as in torch's GradScaler).
    finite = bool(torch.isfinite(grad_norm) & torch.isfinite(loss_sum))
    if finite:
        optimizer.update(lr)
        for chunk in chunks:
            chunk.update_expert_bias()
    else:
        for chunk in chunks:
            for m in chunk.moe_layers():
                m.router.step_load.zero_()
    precision.update(finite)
    out = StepResult(loss=loss_sum, grad_norm=grad_norm, skipped=not finite)
    moe_summary = moe.summary(mesh, loss_sum.device)
    if moe_summary is not None:
        out.aux_loss, out.z_loss, out.moe_layers = moe_summary
    return out


def _unscale_gradients(chunks, optimizer: TrainingOptimizer, scale: float) -> None:
    """Divide the reduced gradients the optimizer reads by the loss scale (fp16). The scale is
    a power of two, so this is exact and commutes with the data-parallel sums."""
    if scale == 1.0:
        return
    torch._foreach_mul_(optimizer.gradients(chunks), 1.0 / scale)


class MoEStepStats:
    """Routing statistics of one step, per MoE layer (global index): aux/z-loss averaged over
    microbatches, tokens per expert summed over microbatches, dropped fraction averaged.
    `summary` takes the mean (loss values) and sum (loads) over the aux-loss scope's replica
    group, so the figures cover the global batch; under pipeline parallelism each stage fills
    its own layers and `summary` sums over pp. With aux_loss_layers="pooled" the reported
    `aux_loss` is the pooled loss that was trained (the per-layer rows keep each layer's own)."""

    def __init__(self, cfg, scope: AuxLossScope):
        self.layer_ids = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        self.num_experts = cfg.num_experts
        self.scope = scope
        self.pooled = None  # pooled aux value averaged over microbatches (aux_loss_layers="pooled")
        self.table = None  # [moe layers, 3 + E]: aux, z, dropped, tokens per expert

    def add(self, per_layer: list[dict], n_micro: int, pooled_aux: torch.Tensor | None = None) -> None:
        if pooled_aux is not None:
            self.pooled = pooled_aux / n_micro + (0.0 if self.pooled is None else self.pooled)
        if not per_layer:
            return
        if self.table is None:
            device = per_layer[0]["tokens_per_expert"].device
            self.table = torch.zeros(len(self.layer_ids), 3 + self.num_experts, device=device)
        for stats in per_layer:
            row = self.table[self.layer_ids.index(stats["layer"])]
            row[0] += stats["aux_loss"] / n_micro
            row[1] += stats["z_loss"] / n_micro
            row[2] += stats["dropped_fraction"] / n_micro
            row[3:] += stats["tokens_per_expert"]

    def summary(self, mesh: Mesh, device) -> tuple[torch.Tensor, torch.Tensor, list[MoELayerStats]] | None:
        """The step's (aux_loss, z_loss, per-layer stats) of `StepResult`; None without MoE layers."""
        if not self.layer_ids:
            return None
        table = self.table
        if table is None:  # a pipeline stage without MoE layers
            table = torch.zeros(len(self.layer_ids), 3 + self.num_experts, device=device)
        pooled = self.pooled
        if self.scope.replicas > 1:  # other microbatches' figures live on the replica ranks
            table = all_reduce_stats(table, self.scope.replica_group)
            table[:, :3] /= self.scope.replicas
            if pooled is not None:
                pooled = all_reduce_stats(pooled, self.scope.replica_group) / self.scope.replicas
        table = all_reduce_stats(table, mesh.pp)
        layers = [
            MoELayerStats(
                layer=layer, aux_loss=row[0], z_loss=row[1], dropped_fraction=row[2], tokens_per_expert=row[3:]
            )
            for layer, row in zip(self.layer_ids, table)
        ]
        aux = table[:, 0].sum() if pooled is None else pooled
        return aux, table[:, 1].sum(), layers


@torch.no_grad()
def evaluate(
    chunks: list[nn.Module],
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    mesh: Mesh,
    executor: PipelineExecutor | None = None,
    precision: Precision = FP32,
    eos_id: int | None = None,
) -> torch.Tensor:
    """Mean LM cross-entropy of a held-out global batch (this rank's microbatches of full
    sequences, cut to its cp shard as in `train_step`), without gradients; reduced over dp x cp
    (and pp: only the last stage computes it)."""
    for chunk in chunks:
        chunk.eval()
    microbatches = local_microbatches(microbatches, mesh, eos_id)
    tokens = global_token_count(microbatches, mesh)
    if executor is None:
        model = chunks[0]
        with weight_copy_scope(), precision.autocast():
            loss = sum(model(mb.inputs, **mb.forward_kwargs, targets=mb.targets) for mb in microbatches) / tokens
    else:
        schedules = build_all_ranks(mesh.par.schedule, mesh.pp_size, len(microbatches), len(chunks), forward_only=True)
        with weight_copy_scope(), precision.autocast():
            result = executor.run(
                schedules,
                [mb.inputs for mb in microbatches],
                lambda chunk, loss_sum, m: loss_sum / tokens,
                forward_only=True,
                forward_kwargs=loss_forward_kwargs(microbatches),
            )
        loss = torch.stack(result.losses).sum() if result.losses else torch.zeros((), device=tokens.device)
    loss = all_reduce_stats(all_reduce_stats(loss.to(torch.float32), mesh.dp_cp), mesh.pp)
    for chunk in chunks:
        chunk.train()
    return loss
