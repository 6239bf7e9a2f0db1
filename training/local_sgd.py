"""Local SGD and DiLoCo: data replicas that train apart and meet every H steps.

With `optim.local_steps=H` each data replica (the dp index: its tp/sp ranks and pipeline
stages together) takes H optimizer steps on its own data without the data-parallel gradient
sum, then the replicas' parameters are averaged over `mesh.dp`:

  * `LocalGradReducer` sums gradients only inside a replica (the sequence-parallel buckets
    over `mesh.tp_cp`, ordinary ones over `mesh.cp`; the tied embedding over the pipeline as
    always) and multiplies them by the replica count R: the training loss is divided by the
    *global* token count (training/step.py), so R x the local sum is the replica's own
    estimate of the mean-loss gradient (exactly its local mean when replicas hold equal token
    counts), and the mean of the R replicas' gradients is the data-parallel one.
  * `LocalSGD.after_step` (training/loop.py, after every step) all-reduces the parameters over
    `mesh.dp` every H steps (and after the run's last step) and divides by R.
  * DiLoCo (`optim.outer_optimizer=nesterov`): the outer (global) parameters are kept; the
    outer gradient delta = global - average is applied with Nesterov SGD (torch's SGD
    formula: buf = mu * buf + delta; global -= outer_lr * (delta + mu * buf)) and every
    replica loads the new global parameters. `none` loads the average.

Bytes over dp: an ordinary step all-reduces every gradient bucket (the parameters' size, padded
to a multiple of dp) over dp; local SGD all-reduces the parameters once per H steps, so H x
fewer. What stays per step is the global token count and the logged loss (two fp32 scalars,
`training/step.py`) and, in the training loop, whether any replica skipped the step (one more).

H=1 with plain averaging equals data parallelism for an inner optimizer linear in the
gradient (SGD) and no active clipping; AdamW is not linear (its update divides by the root
of the squared-gradient average), so AdamW local SGD at H=1 differs from AdamW DP.

Not supported (refused by `meshtron.rules.local_sgd_checks` with one line): ZeRO >= 1 and
offload/16-bit resident weights (the optimizer state, gradients or main weights are sharded
over or kept apart from the replicas this averages), MoE (expert replicas, edp, mix data
replicas with ranks of one replica), parameter servers (parallel.dp_mode=ps)
and checkpoints (the outer state and the replicas' differing AdamW moments are not saved yet).
Between syncs an evaluation (trainer.eval_every) averages each replica's loss on its own share
of the held-out batch; right after a sync all replicas hold the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.mpu.mappings import all_reduce_stats
from meshtron.mpu.mesh import Mesh, collective_device, group_size

OUTER_OPTIMIZERS = ("none", "nesterov")
_SYNC_CHUNK = 1 << 24  # elements all-reduced at once: bounds the flat temporary to 64 MiB of fp32


def local_sgd_enabled(local_steps: int, outer_optimizer: str) -> bool:
    """Whether a run trains with local SGD / DiLoCo instead of per-step data parallelism."""
    return local_steps > 1 or outer_optimizer != "none"


def local_replica_groups(mesh: Mesh) -> dict:
    """The groups gradients are summed over inside one data replica: {"dp": cp, "tp_dp": tp x cp}."""
    return {"dp": mesh.cp, "tp_dp": mesh.tp_cp}


class LocalGradReducer(DataParallelGradReducer):
    """`DataParallelGradReducer` that leaves the data replicas (`mesh.dp`) out of every sum and
    scales the result by their number R (module doc). Communicates over `mesh.cp`,
    `mesh.tp_cp` and `mesh.embedding` only."""

    def __init__(self, named_params, mesh: Mesh, bucket_mb: float = 25.0, **kwargs):
        if kwargs.get("shard_grads") or kwargs.get("main_grads"):
            raise ValueError("local SGD keeps every gradient on its replica: no shard_grads/main_grads")
        super().__init__(named_params, mesh, bucket_mb, replica_groups=local_replica_groups(mesh), **kwargs)
        self.replicas = mesh.dp_size

    def finish(self) -> None:
        """Sum inside the replica (`DataParallelGradReducer.finish`), then multiply by R."""
        super().finish()
        if self.replicas > 1:
            torch._foreach_mul_([b.buffer for b in self.buckets], float(self.replicas))


class LocalSGD:
    """Every `local_steps` steps, average the parameters of `chunks` over the data replicas
    (`mesh.dp`) and apply the outer optimizer (module doc). `bytes_sent` counts the bytes
    handed to the all-reduces (fp32 parameters), `syncs` the syncs done."""

    def __init__(
        self,
        chunks: list[nn.Module],
        mesh: Mesh,
        *,
        local_steps: int,
        outer_optimizer: str = "none",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
    ):
        if outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer_optimizer={outer_optimizer!r}: use one of {', '.join(OUTER_OPTIMIZERS)}")
        if local_steps < 1:
            raise ValueError(f"local_steps={local_steps} must be >= 1")
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.group, self.replicas = mesh.dp, mesh.dp_size
        self.local_steps, self.outer = local_steps, outer_optimizer
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.bytes_sent, self.syncs = 0, 0
        self.global_params: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor] = []
        if outer_optimizer == "nesterov":  # the outer state: global parameters and the momentum buffer
            self.global_params = [p.detach().clone() for p in self.params]
            self.momentum = [torch.zeros_like(p) for p in self.params]

    def after_step(self, step: int, final: bool = False) -> bool:
        """Call after inner step `step` (1-based) on every rank; syncs when H divides it or at
        the run's `final` step. Returns whether it synced."""
        if step % self.local_steps and not final:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Parameters <- mean over the replicas (then the outer step with DiLoCo); all-reduces
        over `mesh.dp`."""
        average = [p.detach().clone() for p in self.params] if self.outer != "none" else [p.data for p in self.params]
        self._all_reduce_mean(average)
        if self.outer == "none":
            self.syncs += 1
            return
        mu, lr = self.outer_momentum, self.outer_lr
        delta = torch._foreach_sub(self.global_params, average)  # outer gradient
        torch._foreach_mul_(self.momentum, mu)
        torch._foreach_add_(self.momentum, delta)
        torch._foreach_add_(delta, self.momentum, alpha=mu)  # Nesterov: delta + mu * buf
        torch._foreach_add_(self.global_params, delta, alpha=-lr)
        for p, g in zip(self.params, self.global_params):
            p.data.copy_(g)
        self.syncs += 1

    def _all_reduce_mean(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor <- its mean over `mesh.dp`, flattened into chunks of at most _SYNC_CHUNK elements."""
        if group_size(self.group) <= 1 or not tensors:
            return
        batch: list[torch.Tensor] = []
        size = 0
        for t in tensors + [None]:
            if t is not None and (not batch or (size + t.numel() <= _SYNC_CHUNK and t.dtype == batch[0].dtype)):
                batch.append(t)
                size += t.numel()
                continue
            flat = all_reduce_stats(torch.cat([x.reshape(-1) for x in batch]), self.group)
            self.bytes_sent += flat.numel() * flat.element_size()
            flat.div_(self.replicas)
            offset = 0
            for x in batch:
                x.copy_(flat[offset : offset + x.numel()].view_as(x))
                offset += x.numel()
            if t is not None:
                batch, size = [t], t.numel()

    def agree_skipped(self, skipped: bool) -> bool:
        """Whether any replica skipped this step (non-finite loss or gradient norm): replicas
        decide on their own gradients, and the loop's abort after trainer.max_skipped must be
        taken by every rank alike. One 4-byte all-reduce (max) over `mesh.dp`."""
        if group_size(self.group) <= 1:
            return skipped
        flag = torch.tensor([1.0 if skipped else 0.0], device=collective_device(self.group))
        return bool(all_reduce_stats(flag, self.group, op="max").item())

    def state_bytes(self) -> int:
        """Bytes of the outer state (DiLoCo: global parameters and momentum; none: 0)."""
        return sum(t.numel() * t.element_size() for t in self.global_params + self.momentum)


def build_local_sgd(o, chunks: list[nn.Module], mesh: Mesh) -> LocalSGD | None:
    """The `LocalSGD` of an `optim` config (`training.config.OptimConfig`), or None when off."""
    if not local_sgd_enabled(o.local_steps, o.outer_optimizer):
        return None
    return LocalSGD(
        chunks,
        mesh,
        local_steps=o.local_steps,
        outer_optimizer=o.outer_optimizer,
        outer_lr=o.outer_lr,
        outer_momentum=o.outer_momentum,
    )
