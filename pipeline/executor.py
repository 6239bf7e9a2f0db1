"""Pipeline execution: run a schedule's actions on this rank's model chunks, passing
activations forward and their gradients backward with point-to-point messages to the
neighbouring pipeline stages.

Which message goes when is `pipeline.p2p`'s plan, derived from every rank's action list:
each directed channel between two ranks has one message order that both ends follow, so
pairing never depends on tags (NCCL ignores them), and the sends and receives two neighbours
exchange at one step are posted as one `batch_isend_irecv` on each side, so no rank blocks in
a receive while its peer blocks in another. Tensor shapes are known from the config
([s (/tp under SP), micro_batch, h]), so there is no shape handshake. A timeline of every
forward, backward and communication wait is kept for Chrome-trace export and bubble
measurement (`pipeline.trace`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshtron.mpu.mesh import Mesh, collective_device
from meshtron.mpu.waits import wait_for
from meshtron.pipeline.p2p import GRADIENT, Batch, Message, RankPlan, cached_plan, needed_message, produced_message
from meshtron.pipeline.schedules import Action

# loss_fn(chunk, output, microbatch_index) -> scalar loss to back-propagate (already scaled)
LossFn = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
# extra_fn(chunk) -> differentiable extra terms of the last forward (MoE aux losses) or None
ExtraFn = Callable[[nn.Module], torch.Tensor | None]


@dataclass
class TimelineEvent:
    """One span of work on this rank: name F or B (compute), recv_F / recv_B (the message batch
    waited for before that action) or send (the batch after the last action); microbatch,
    chunk, start/end seconds."""

    name: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class PipelineResult:
    losses: list[torch.Tensor] = field(default_factory=list)
    timeline: list[TimelineEvent] = field(default_factory=list)
    peak_live_activations: int = 0


def activation_shape(mesh: Mesh, seq_len: int, micro_batch: int, hidden: int) -> tuple[int, int, int]:
    """Shape of the activations passed between stages: [s/cp (/tp under SP), micro_batch, h]."""
    local = seq_len // mesh.cp_size
    return (local // mesh.tp_size if mesh.sequence_parallel else local, micro_batch, hidden)


@dataclass
class _RunState:
    """One `PipelineExecutor.run`: its result so far, the forwards kept for backward by
    (microbatch, chunk), and the messages produced but not yet sent (`outbox`) or received but
    not yet used (`inbox`)."""

    result: PipelineResult
    saved: dict[tuple[int, int], tuple] = field(default_factory=dict)
    outbox: dict[Message, torch.Tensor] = field(default_factory=dict)
    inbox: dict[Message, torch.Tensor] = field(default_factory=dict)


class PipelineExecutor:
    """Runs schedules over `chunks` (this rank's model chunks; chunk c is virtual stage
    c * pp + pp_rank), exchanging activations and gradients with the neighbouring stages by
    point-to-point messages on the default (world) group, addressed by global rank.

    The world group rather than `mesh.pp`: batched point-to-point on NCCL must not be the
    first operation of its group unless every rank of the group joins it, and the world has
    run collectives (and, with `device_id`, been initialized eagerly) before any step.
    `tags=False` posts every message with tag 0: pairing is then by order alone on every
    backend, as on NCCL (the multi-process tests run that way); the default keeps distinct
    tags, which gloo checks and NCCL ignores.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        mesh: Mesh,
        activation_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        *,
        tags: bool = True,
    ):
        self.chunks, self.mesh = chunks, mesh
        self.pp, self.rank, self.v = mesh.pp_size, mesh.pp_rank, len(chunks)
        self.shape, self.dtype, self.device = activation_shape, dtype, torch.device(device)
        self.tags = tags
        # True: each timeline stamp waits for the device first, so a span is the device's time
        # for that action, not its launch (`meshtron.rehearse` on CUDA; costs the overlap of
        # the host running ahead, so training runs leave it off)
        self.device_timed = False
        self.num_virtual = self.pp * self.v
        self.stage_ranks = dist.get_process_group_ranks(mesh.pp)
        wanted = collective_device()
        if self.device.type != wanted.type:
            raise ValueError(
                f"pipeline messages on {self.device} cannot travel over the {dist.get_backend()} "
                f"backend, which moves {wanted.type} tensors"
            )

    def _clock(self) -> float:
        if self.device_timed and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _tag(self, message: Message) -> int:
        if not self.tags:
            return 0
        return (message.microbatch * self.num_virtual + message.dst_stage) * 2 + int(message.kind == GRADIENT)

    def plan(self, schedules: Sequence[Sequence[Action]]) -> RankPlan:
        """This rank's batches of sends and receives for `schedules` (`plan_p2p`, memoised)."""
        if len(schedules) != self.pp:
            raise ValueError(f"need the action lists of all {self.pp} pipeline ranks, got {len(schedules)}")
        return cached_plan(tuple(tuple(actions) for actions in schedules), self.v)[self.rank]

    def _exchange(
        self, batch: Batch, outbox: dict, inbox: dict, result: PipelineResult, name: str, microbatch: int, chunk: int
    ) -> None:
        """Post one batch (sends from `outbox`, receives into new buffers put in `inbox`) with
        `batch_isend_irecv` to the neighbouring stages and wait for all of it."""
        ops = []
        for op in batch.ops:
            peer = self.stage_ranks[op.peer]
            if op.op == "send":
                tensor = outbox.pop(op.message)
                ops.append(dist.P2POp(dist.isend, tensor, peer, tag=self._tag(op.message)))
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                inbox[op.message] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, peer, tag=self._tag(op.message)))
        start = self._clock()
        peers = ", ".join(str(op) for op in batch.ops)
        for work in dist.batch_isend_irecv(ops):
            wait_for(work, f"pipeline p2p over pp ({peers})")
        result.timeline.append(TimelineEvent(name, microbatch, chunk, start, self._clock()))

    def run(
        self,
        schedules: Sequence[Sequence[Action]],
        inputs: list[torch.Tensor],
        loss_fn: LossFn,
        extra_fn: ExtraFn | None = None,
        before_backward=None,
        forward_only: bool = False,
        forward_kwargs: Sequence[dict] | None = None,
    ) -> PipelineResult:
        """Execute this rank's actions `schedules[pp_rank]` (`schedules`: every pipeline rank's
        action list, from which both ends of each channel derive one message order; see
        `pipeline.p2p`). `inputs[m]` is microbatch m's input of virtual stage 0 (token ids;
        used only there). `before_backward(index, action)` may return a context manager wrapped
        around that backward (gradient-reduction sync). Returns the last stage's
        per-microbatch losses (detached), the timeline and the peak of live activations.
        `forward_only` (evaluation): forwards only, nothing kept for backward.
        `forward_kwargs[m]`: keyword arguments of every chunk's forward of microbatch m (per-token
        positions and document ids of packed sequences)."""
        actions = schedules[self.rank]
        batches = self.plan(schedules)
        run = _RunState(PipelineResult())
        next_batch = 0
        for index, action in enumerate(actions):
            m, c = action.microbatch, action.chunk
            while next_batch < len(batches) and batches[next_batch].before == index:
                self._exchange(batches[next_batch], run.outbox, run.inbox, run.result, f"recv_{action.kind}", m, c)
                next_batch += 1
            if action.kind == "F":
                kwargs = forward_kwargs[m] if forward_kwargs else {}
                self._forward(action, run, inputs, kwargs, loss_fn, extra_fn, forward_only)
            else:
                self._backward(index, action, run, before_backward)
        for batch in batches[next_batch:]:  # the last action's message
            self._exchange(batch, run.outbox, run.inbox, run.result, "send", actions[-1].microbatch, actions[-1].chunk)
        if run.saved:
            raise RuntimeError(
                f"pipeline schedule left {len(run.saved)} forward(s) without backward: {sorted(run.saved)}"
            )
        if run.outbox or run.inbox:
            raise RuntimeError(
                f"pipeline messages left unsent or unused: {sorted(map(str, {**run.outbox, **run.inbox}))}"
            )
        return run.result

    def _forward(
        self,
        action: Action,
        run: _RunState,
        inputs: list[torch.Tensor],
        kwargs: dict,
        loss_fn: LossFn,
        extra_fn: ExtraFn | None,
        forward_only: bool,
    ) -> None:
        """Forward of `action`'s chunk (keyword arguments `kwargs`) on the received activation, or
        on `inputs[microbatch]` at virtual stage 0: the last stage's loss is recorded, any other output goes to the outbox, and
        what backward needs is kept in `run.saved` (nothing with `forward_only`). No
        communication."""
        m, c = action.microbatch, action.chunk
        chunk = self.chunks[c]
        need = needed_message(action, self.rank, self.pp, self.v)
        produced = produced_message(action, self.rank, self.pp, self.v)
        if need is None:
            x = inputs[m]
        else:
            x = run.inbox.pop(need)
            x.requires_grad_(not forward_only)
        start = self._clock()
        out = chunk(x, **kwargs)
        extra = extra_fn(chunk) if extra_fn is not None else None
        if produced is None:
            loss = loss_fn(chunk, out, m)
            run.result.losses.append(loss.detach())
            objective = loss if extra is None else loss + extra
            if not forward_only:
                run.saved[(m, c)] = (x, objective, None)
        else:
            # Activations travel in the executor's dtype (autocast may hand back 16-bit ones).
            run.outbox[produced] = out.detach().to(self.dtype).contiguous()
            if not forward_only:
                run.saved[(m, c)] = (x, out, extra)
        run.result.timeline.append(TimelineEvent("F", m, c, start, self._clock()))
        run.result.peak_live_activations = max(run.result.peak_live_activations, len(run.saved))

    def _backward(self, index: int, action: Action, run: _RunState, before_backward) -> None:
        """Backward of `action`'s chunk from the received output gradient (the loss on the last
        stage), inside `before_backward(index, action)` when given; the input's gradient goes to
        the outbox. No communication here (gradient reduction hooks may start some)."""
        m, c = action.microbatch, action.chunk
        need = needed_message(action, self.rank, self.pp, self.v)
        produced = produced_message(action, self.rank, self.pp, self.v)
        x, out, extra = run.saved.pop((m, c))
        grad = None if need is None else run.inbox.pop(need)
        start = self._clock()
        with before_backward(index, action) if before_backward else contextlib.nullcontext():
            if grad is None:
                out.backward()
            elif extra is None:
                torch.autograd.backward(out, grad.to(out.dtype))
            else:
                torch.autograd.backward([out, extra], [grad.to(out.dtype), torch.ones_like(extra)])
        if produced is not None:
            run.outbox[produced] = x.grad.contiguous()
        run.result.timeline.append(TimelineEvent("B", m, c, start, self._clock()))
