"""16-bit resident weights: bf16 model weights, fp32 main weights only in the optimizer.

`optim.param_dtype=bf16` (needs `trainer.precision=bf16`) makes the weights the model computes
with bf16 and keeps the fp32 main weights only where the update needs them, as Megatron's
distributed optimizer does. The decisions:

* Initialisation: the model is built and initialised in fp32 (layout-independent, mpu/init.py);
  `ResidentAdamW` copies the fp32 values of its part of every gradient bucket into its main
  weights, then casts the bucket's parameters to bf16 (`cast_bucket_params`). So the main
  weights start exactly where an fp32 run starts and the bf16 weights are their rounding.
* Gradients: autograd produces bf16 `.grad`s; the reducer (`main_grads=True`,
  dp/grad_reduce.py) adds each into its fp32 bucket slice `p.main_grad` and drops `.grad`,
  so microbatch accumulation and the dp all-reduce / reduce-scatter stay fp32.
* Optimizer: `ResidentAdamW` is `dp.offload.OffloadedAdamW` with the main weights on the
  training device (`host=False`; with `optim.offload=true` they stay on the host, as before):
  per bucket, fp32 main weights and AdamW moments for this rank's shard (ZeRO-1/2) or the whole
  bucket (zero=0); after the update the main weights are rounded to bf16 into the parameters,
  all-gathered in bf16 over the bucket's replica group under ZeRO-1/2 (half the bytes of fp32).
  ZeRO-3: `dp.zero3.Zero3(param_dtype=bf16)` casts the flat buffers and shards to bf16 and
  hands the fp32 values of this rank's shard over (`bucket.main_init`); the update rounds the
  main weights into the bf16 shard, and each unit gathers bf16. Pipeline parallelism is refused
  at config time (the tied embedding's cross-stage sum is untested with `main_grad`s).
* Clipping: the norm is taken from the reduced fp32 bucket shards (`sharded_grad_norm`); the
  clipping factor is applied to the gradients the optimizer reads (shards, or whole buckets at
  zero=0) inside the fused update (`OffloadedAdamW.scale_gradients`).
* Checkpoints save the fp32 main weights under the usual `model/<name>` keys (each rank its
  shard, as ZeRO moments are saved), so a bf16-resident checkpoint loads into an fp32 run and
  back; the loader reads fp32 values and `load_main_weights` writes the main weights and the
  bf16 copies (training/checkpoint.py).

Bytes per parameter on the device (R = replicas of the parameter's bucket), with fp32 gradients:
  zero=0: 2 + 4 (grads) + 4 (main) + 8 (moments)          = 18
  zero=1: 2 + 4 + 12 / R                                   (Megatron: 6 + 12/dp)
  zero=2: 2 + (4 + 12) / R                                 (+ a transient 4 during backward)
  zero=3: (2 + 4 + 12) / R                                 (+ two bf16 units gathered, unit grad buffers)
  offload: 2 + 4 (grads) on the device, 12 / R on the host.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.dp.grad_norm import clip_coefficient, sharded_grad_norm
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.offload import OffloadedAdamW
from meshtron.mpu.mesh import Mesh


class ResidentAdamW(OffloadedAdamW):
    """AdamW with fp32 main weights for this rank's part of every bucket and bf16 parameters
    (module doc). Build it on a reducer with `main_grads=True`, while the parameters are still
    fp32: it casts them. Communicates like `OffloadedAdamW` (bf16 all-gathers at zero 1/2)."""

    def __init__(
        self,
        reducer: DataParallelGradReducer,
        *,
        lr: float,
        weight_decay: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        zero: int = 0,
        offload: bool = False,
        param_dtype: torch.dtype = torch.bfloat16,
    ):
        if not reducer.main_grads:
            raise ValueError("16-bit resident weights need a reducer built with main_grads=True")
        super().__init__(
            reducer,
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
            zero=zero,
            host=offload,
            param_dtype=param_dtype,
        )
        self.offloaded = offload
        self._reducer = reducer

    def gradients(self, chunks: list[nn.Module]) -> list[torch.Tensor]:
        """The reduced fp32 gradients `step` reads: this rank's bucket shards (zero 1/2) or
        whole buckets (zero=0). No communication."""
        return [self._device_grads(slot) for slot in self._slots]

    def clip_grad_norm(self, chunks: list[nn.Module], max_norm: float, mesh: Mesh) -> torch.Tensor:
        """Global L2 norm from the reduced bucket shards (summed over each bucket's replica
        group, then tp/ep/pp as dp/grad_norm.py does); scales `gradients` to at most `max_norm`."""
        norm = sharded_grad_norm(self._reducer, mesh)
        self.scale_gradients(chunks, clip_coefficient(norm, max_norm))
        return norm

    def state_bytes(self) -> int:
        """Device bytes of optimizer state: moments and fp32 main weights (0 with offload)."""
        return 0 if self.offloaded else self.host_state_bytes()

    def main_weight_bytes(self) -> int:
        """Bytes of fp32 main weights this rank holds (device or host)."""
        return sum(slot.main.numel() * slot.main.element_size() for slot in self._slots)

    def state_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(fp32 main weights, AdamW moment tensors) this rank holds, for memory accounting."""
        moments = [
            t
            for slot in self._slots
            for t in slot.optimizer.state.get(slot.main, {}).values()
            if torch.is_tensor(t) and t.dim() > 0
        ]
        return [slot.main for slot in self._slots], moments

    def main_weight_shards(self) -> list:
        """[(param, first, fp32 values)]: this rank's slice of each parameter's flattened main
        weights, starting at element `first`; for checkpoints (as `moment_shards`). No communication."""
        out = []
        for slot in self._slots:
            offset = 0
            for p in slot.bucket.params:
                n = p.numel()
                lo, hi = max(offset, slot.start), min(offset + n, slot.start + slot.size)
                if lo < hi:
                    out.append((p, lo - offset, slot.main.detach()[lo - slot.start : hi - slot.start]))
                offset += n
        return out

    @torch.no_grad()
    def load_main_weights(self, weights: dict) -> None:
        """Install fp32 values {param: tensor shaped like the local parameter} (a checkpoint
        load): this rank's part goes into the main weights, every parameter gets their bf16
        rounding. No communication."""
        for slot in self._slots:
            offset, end = 0, slot.start + slot.size
            for p in slot.bucket.params:
                n = p.numel()
                flat = weights[p].reshape(-1)
                lo, hi = max(offset, slot.start), min(offset + n, end)
                if lo < hi:
                    slot.main[lo - slot.start : hi - slot.start].copy_(flat[lo - offset : hi - offset])
                p.copy_(flat.view(p.shape))
                offset += n
        self._weights_stale = False

    def load_param_moments(self, moments: dict, step: float) -> None:
        """As `OffloadedAdamW`, but the main weights stay as loaded (`load_main_weights`):
        the bf16 parameters cannot restore them."""
        stale = self._weights_stale
        super().load_param_moments(moments, step)
        self._weights_stale = stale
