"""Pipeline execution: run a schedule's actions on this rank's model chunks, passing
activations forward and their gradients backward with point-to-point messages over the
pipeline group.

Messages are non-blocking sends and blocking receives of tensors whose shape is known from
the config ([s (/tp under SP), micro_batch, h]), so there is no shape handshake. Each message
carries a tag (microbatch, chunk, direction), so several in flight between the same pair of
ranks never get mixed up. A timeline of every forward, backward and receive wait is kept
for Chrome-trace export and bubble measurement (`mpu.pipeline_trace`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from mpu.mesh import Mesh
from mpu.pipeline_schedules import Action

# loss_fn(chunk, output, microbatch_index) -> scalar loss to back-propagate (already scaled)
LossFn = Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
# extra_fn(chunk) -> differentiable extra terms of the last forward (MoE aux losses) or None
ExtraFn = Callable[[nn.Module], torch.Tensor | None]


@dataclass
class TimelineEvent:
    """One span of work on this rank: name F/B/recv, microbatch, chunk, start/end seconds."""

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
    """Shape of the activations passed between stages: [s (/tp under SP), micro_batch, h]."""
    return (seq_len // mesh.tp_size if mesh.sequence_parallel else seq_len, micro_batch, hidden)


class PipelineExecutor:
    """Runs schedules over `chunks` (this rank's model chunks; chunk c is virtual stage
    c * pp + pp_rank) with P2P over `mesh.pp` (global ranks of the neighbouring stages)."""

    def __init__(self, chunks: list[nn.Module], mesh: Mesh, activation_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        self.chunks, self.mesh = chunks, mesh
        self.pp, self.rank, self.v = mesh.pp_size, mesh.pp_rank, len(chunks)
        self.shape, self.dtype, self.device = activation_shape, dtype, device
        self.num_virtual = self.pp * self.v
        stage_ranks = dist.get_process_group_ranks(mesh.pp)
        self.prev_rank = stage_ranks[(self.rank - 1) % self.pp]
        self.next_rank = stage_ranks[(self.rank + 1) % self.pp]

    def _virtual_stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _tag(self, microbatch: int, virtual_stage: int, backward: bool) -> int:
        return (microbatch * self.num_virtual + virtual_stage) * 2 + int(backward)

    def _recv(self, src: int, tag: int, result: PipelineResult, name: str, microbatch: int, chunk: int):
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        dist.irecv(buffer, src=src, tag=tag).wait()
        result.timeline.append(TimelineEvent(name, microbatch, chunk, start, time.perf_counter()))
        return buffer

    def run(self, actions: list[Action], inputs: list[torch.Tensor], loss_fn: LossFn,
            extra_fn: ExtraFn | None = None, before_backward=None, forward_only: bool = False) -> PipelineResult:
        """Execute `actions`. `inputs[m]` is microbatch m's input of virtual stage 0 (token ids;
        used only there). `before_backward(index, action)` may return a context manager wrapped
        around that backward (gradient-reduction sync). Returns the last stage's
        per-microbatch losses (detached), the timeline and the peak of live activations.
        `forward_only` (evaluation): forwards only, nothing kept for backward."""
        result = PipelineResult()
        saved: dict[tuple[int, int], tuple] = {}
        pending_sends = []
        for index, action in enumerate(actions):
            m, c = action.microbatch, action.chunk
            stage = self._virtual_stage(c)
            chunk = self.chunks[c]
            if action.kind == "F":
                if stage == 0:
                    x = inputs[m]
                else:
                    x = self._recv(self.prev_rank, self._tag(m, stage, False), result, "recv_F", m, c)
                    x.requires_grad_(not forward_only)
                start = time.perf_counter()
                out = chunk(x)
                extra = extra_fn(chunk) if extra_fn is not None else None
                if stage == self.num_virtual - 1:
                    loss = loss_fn(chunk, out, m)
                    result.losses.append(loss.detach())
                    objective = loss if extra is None else loss + extra
                    if not forward_only:
                        saved[(m, c)] = (x, objective, None)
                else:
                    # Activations travel in the executor's dtype (autocast may hand back 16-bit ones).
                    pending_sends.append((dist.isend(out.detach().to(self.dtype).contiguous(), dst=self.next_rank,
                                                     tag=self._tag(m, stage + 1, False)), out))
                    if not forward_only:
                        saved[(m, c)] = (x, out, extra)
                result.timeline.append(TimelineEvent("F", m, c, start, time.perf_counter()))
                result.peak_live_activations = max(result.peak_live_activations, len(saved))
            else:
                x, out, extra = saved.pop((m, c))
                grad = None
                if stage != self.num_virtual - 1:
                    grad = self._recv(self.next_rank, self._tag(m, stage, True), result, "recv_B", m, c)
                start = time.perf_counter()
                with before_backward(index, action) if before_backward else contextlib.nullcontext():
                    if grad is None:
                        out.backward()
                    elif extra is None:
                        torch.autograd.backward(out, grad.to(out.dtype))
                    else:
                        torch.autograd.backward([out, extra], [grad.to(out.dtype), torch.ones_like(extra)])
                if stage > 0:
                    pending_sends.append((dist.isend(x.grad.contiguous(), dst=self.prev_rank,
                                                     tag=self._tag(m, stage - 1, True)), x))
                result.timeline.append(TimelineEvent("B", m, c, start, time.perf_counter()))
            pending_sends = [(w, t) for w, t in pending_sends if not w.is_completed()]
        for work, _ in pending_sends:
            work.wait()
        if saved:
            raise RuntimeError(f"pipeline schedule left {len(saved)} forward(s) without backward: {sorted(saved)}")
        return result
