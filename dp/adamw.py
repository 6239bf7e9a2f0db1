"""The optimizer interface of a training step (`TrainingOptimizer`) and the replicated AdamW.

`TrainingOptimizer` is everything training/step.py, training/checkpoint.py and
training/loop.py use of an optimizer. Three classes implement it:

  ReplicatedAdamW   every parameter in full on every rank (below; also the per-shard AdamW
                    inside the other two)
  ShardedAdamW      ZeRO-1/2: this rank's shard of every gradient bucket (dp/distributed_optimizer.py)
  OffloadedAdamW    main weights and moments in host memory, any ZeRO stage (dp/offload.py)

Gradients belong to the `DataParallelGradReducer`: it zeroes them (`reducer.zero_grad()`
before a step's first backward) and reduces them (`reducer.finish()`). An optimizer only reads
the reduced gradients (`gradients`, the same tensors `clip_grad_norm` measures and scales,
or, fused, has the update scale as it reads them: `scale_gradients`)
and never zeroes or frees them: do not call torch's `zero_grad` on a training optimizer.

torch's fused AdamW (one multi-tensor kernel for the whole update, on CPU and CUDA) where
it applies: every parameter floating point on a CPU or CUDA device. On this 2-core CPU it
steps the 15M-parameter MoE benchmark model in 9 ms instead of 32 ms (single-tensor loop).
The update is element-wise, so results still agree on any shard of a parameter; against the
single-tensor implementation they differ by fp32 rounding only.
"""

from __future__ import annotations

import abc
import contextlib

import torch
from torch import nn

from meshtron.dp.grad_norm import clip_coefficient, global_grad_norm, sharded_grad_norm
from meshtron.mpu.mesh import Mesh


class TrainingOptimizer(abc.ABC):
    """AdamW as a training step drives it; see the module doc for who owns the gradients.

    `param_groups`: torch-style groups; `update(lr)` sets their "lr".
    `offloaded`: the moments live in host memory (checkpoints load them there).
    `grad_shards_of`: the reducer whose reduce-scattered bucket shards are the gradients this
    optimizer reads (ZeRO-2), or None when it reads every parameter's `.grad`.
    """

    param_groups: list[dict]
    offloaded: bool = False
    grad_shards_of = None

    @abc.abstractmethod
    def step(self) -> None:
        """One AdamW update from the reduced gradients at the groups' current "lr"."""

    def update(self, lr: float) -> None:
        """Set every group's learning rate to `lr`, then `step()`."""
        for group in self.param_groups:
            group["lr"] = lr
        self.step()

    def gradients(self, chunks: list[nn.Module]) -> list[torch.Tensor]:
        """The reduced gradients `step` reads: the bucket shards of `grad_shards_of` (ZeRO-2),
        else the `.grad` of every parameter of `chunks` that has one. No communication."""
        if self.grad_shards_of is not None:
            return [bucket.shard for bucket in self.grad_shards_of.buckets]
        return [p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None]

    def clip_grad_norm(self, chunks: list[nn.Module], max_norm: float, mesh: Mesh) -> torch.Tensor:
        """Global L2 norm of the full model's gradients (before clipping), computed from the
        tensors of `gradients`; `scale_gradients` then brings them to at most `max_norm`
        (<= 0: no clipping). All-reduces over tp, ep x etp and pp (ZeRO-2 first over each
        bucket's replica group): dp/grad_norm.py."""
        if self.grad_shards_of is not None:
            norm = sharded_grad_norm(self.grad_shards_of, mesh)
        else:
            params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
            norm = global_grad_norm(params, mesh)
        self.scale_gradients(chunks, clip_coefficient(norm, max_norm))
        return norm

    def scale_gradients(self, chunks: list[nn.Module], coef: torch.Tensor | None) -> None:
        """Multiply the gradients the next `step` reads by `coef` (a scalar tensor; None: leave
        them): here in place, now. Fused AdamW optimizers instead fold the factor into their
        next `step` (one pass over the gradients less; see `ReplicatedAdamW`). No communication."""
        if coef is not None:
            grads = self.gradients(chunks)
            if grads:
                torch._foreach_mul_(grads, coef)

    @abc.abstractmethod
    def param_moments(self) -> tuple[dict, float]:
        """({param: (exp_avg, exp_avg_sq)} shaped like each local parameter, step count) for a
        checkpoint: zeros for a parameter not stepped yet. May all-gather over replica groups."""

    @abc.abstractmethod
    def load_param_moments(self, moments: dict, step: float) -> None:
        """Install per-parameter moments shaped as `param_moments` returns them (from a
        checkpoint, on any device). No communication."""

    def mark_weights_changed(self) -> None:  # noqa: B027 - a no-op is the right default
        """The parameters were written outside `step()` (a checkpoint load): an optimizer
        holding its own copy of the weights re-reads them. The others read the parameters at
        every step: nothing to do."""

    @abc.abstractmethod
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds on the training device."""


def grad_divisor(coef: torch.Tensor | None) -> torch.Tensor | None:
    """1 / `coef` in fp32, the `grad_scale` that makes torch's fused AdamW multiply the
    gradients by `coef` (None stays None)."""
    return None if coef is None else (1.0 / coef).to(torch.float32)


@contextlib.contextmanager
def dividing_gradients(optimizer: torch.optim.Optimizer, divisor: torch.Tensor | None):
    """Within the block, `optimizer.step()` (torch's fused Adam/AdamW) divides every gradient by
    `divisor` as it reads it and writes the quotient back: torch's `grad_scale` attribute, which
    its GradScaler sets the same way. None: a plain step."""
    if divisor is None:
        yield
        return
    optimizer.grad_scale = divisor  # read by torch's Adam.step (getattr(self, "grad_scale"))
    try:
        yield
    finally:
        del optimizer.grad_scale


def fused_supported(params) -> bool:
    """True when torch's fused AdamW takes every one of `params`."""
    params = list(params)
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


class ReplicatedAdamW(torch.optim.AdamW, TrainingOptimizer):
    """torch's AdamW over local tensors, with the `TrainingOptimizer` interface; build it with
    `adamw`. Its state is torch's (`state[param]`: step, exp_avg, exp_avg_sq). No communication.

    Fused, it takes the clipping factor into the update: `scale_gradients` keeps 1/coef, which
    the next `step` hands to torch's fused kernel as its `grad_scale` (the divisor torch's
    GradScaler passes there). The kernel divides each gradient by it as it reads it and writes
    the quotient back, so after `step` the gradients are the clipped ones, as with the in-place
    product, for one pass over them instead of two. g / (1/coef) may differ from g * coef in
    the last bit."""

    _grad_divisor: torch.Tensor | None = None

    def scale_gradients(self, chunks: list[nn.Module], coef: torch.Tensor | None) -> None:
        if not self.fold_grad_scale(coef):
            super().scale_gradients(chunks, coef)

    def fold_grad_scale(self, coef: torch.Tensor | None) -> bool:
        """Multiply the gradients of this optimizer's own parameters by `coef` inside the next
        `step` (None: by nothing) when fused: True. Unfused: False, nothing done."""
        if not self.defaults.get("fused"):
            return False
        self._grad_divisor = grad_divisor(coef)
        return True

    def step(self, closure=None):
        divisor, self._grad_divisor = self._grad_divisor, None
        with dividing_gradients(self, divisor):
            return super().step(closure)

    def _params(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def param_moments(self) -> tuple[dict, float]:
        """The live moments of every parameter (zeros before its first step) and the step count."""
        moments, step = {}, 0.0
        for param in self._params():
            state = self.state.get(param, {})
            if "exp_avg" in state:
                moments[param] = (state["exp_avg"], state["exp_avg_sq"])
                step = float(state["step"])
            else:
                moments[param] = (torch.zeros_like(param), torch.zeros_like(param))
        return moments, step

    def load_param_moments(self, moments: dict, step: float) -> None:
        for param in self._params():
            exp_avg, exp_avg_sq = moments[param]
            self.state[param] = {
                "step": torch.tensor(step, dtype=torch.float32),
                "exp_avg": exp_avg.to(param.device),
                "exp_avg_sq": exp_avg_sq.to(param.device),
            }

    def state_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for s in self.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        )


def adamw(param_groups: list[dict], *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8) -> ReplicatedAdamW:
    """`ReplicatedAdamW` over `param_groups` (dicts with "params" and "weight_decay"), fused
    when `fused_supported`. No communication."""
    params = [p for g in param_groups for p in g["params"]]
    return ReplicatedAdamW(
        param_groups, lr=lr, betas=tuple(betas), eps=eps, fused=True if fused_supported(params) else None
    )
