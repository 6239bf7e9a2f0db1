"""CPU offload of the AdamW update: main weights and moments live in host memory.

`OffloadedAdamW` is how a single-GPU user fits a model whose optimizer state does not fit on
the device: the device keeps only the weights the model computes with and the gradient
buckets; the fp32 main weights, exp_avg and exp_avg_sq live in CPU memory and the AdamW update
runs on the CPU. Every step, per gradient bucket of `DataParallelGradReducer`:

  1. the (all-reduced) gradients are copied device -> host (into a pinned staging
     buffer when the device is CUDA, `non_blocking`, one CUDA event per bucket);
  2. torch AdamW (fused, as the device optimizers: dp/adamw.py) updates the host main weights as soon as
     that bucket's copy has landed, so the CPU update of bucket i overlaps the copies of the
     others; the clipping factor is applied inside that kernel (its `grad_scale`, as
     `ReplicatedAdamW` does), so the device gradients are never rescaled;
  3. the updated main weights are copied host -> device (`non_blocking` from pinned memory).

Like `dp.distributed_optimizer.ShardedAdamW`, the parameters of each bucket become views
into one flat device buffer, so each transfer is one contiguous copy. With `zero=1` (ZeRO-1
composition; `zero=2` over a reducer built with `shard_grads=True`) only this rank's shard of
every bucket (`bucket.shard_start`, `bucket.shard`) lives on the host and is updated; the
shard is copied to the device and all-gathered over the bucket's replica group.

The update is element-wise and uses the same param groups (weight decay on ndim >= 2 only,
as `training.optim.build_optimizer`) and hyper-parameters, so on the CPU the weights are bit
for bit those of the device AdamW (both fused; `fused=False` takes torch's foreach
implementation, which rounds differently, ~1e-7).

On a CPU-only machine the "device" is the CPU: the host copies are still separate tensors
and the same code runs (plain copies, no pinning).

Overlap (`overlap_param_gather(chunks)`, optim.overlap_param_gather, zero=1/2): buckets are
updated in the order of their first use in forward and each bucket's all-gather is launched
asynchronously right after its update (so it also overlaps the CPU update of the buckets after
it); the first forward unit reading a bucket waits for it (dp/param_gather.py).

Main weights are (re)read from the device weights at the first `step()`, and again after
`load_param_moments` (a checkpoint load writes the device weights) or `mark_weights_changed()`
(anyone else who writes the device weights between steps must call it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtron.dp.adamw import TrainingOptimizer, dividing_gradients, grad_divisor
from meshtron.dp.buckets import bucket_moment_shards, cast_bucket_params, flatten_bucket_params
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.param_gather import ParamGather
from meshtron.mpu.mappings import all_gather_into
from meshtron.mpu.mesh import group_size


@dataclass
class _Slot:
    """The part [start, start + size) of one bucket that this rank updates on the host."""

    bucket: object
    start: int
    size: int
    sharded: bool  # all-gather over bucket.group after the update
    device_weights: torch.Tensor  # view of bucket.param_buffer
    main: nn.Parameter  # host fp32 main weights (pinned on CUDA)
    host_grad: torch.Tensor | None  # host staging buffer for the gradients (pinned on CUDA); None when
    # the main weights live on the device (dp/resident.py): main.grad
    # is then the reduced gradient itself
    optimizer: torch.optim.AdamW
    event: object = None


class OffloadedAdamW(TrainingOptimizer):
    """AdamW whose main weights and moments live in (pinned) CPU memory; see the module doc.

    `zero=0`: every bucket in full on the host (replicated AdamW). `zero=1`/`2`: this rank's
    shard of every bucket (`bucket.shard_start`, `bucket.shard`), all-gathered after the update
    (ZeRO-1; ZeRO-2 when the reducer was built with `shard_grads=True`). `zero=3`: the same
    shard, copied into the bucket's `param_shard` (dp/zero3.py) and not all-gathered. A `TrainingOptimizer`
    (dp/adamw.py) with `offloaded` True and `state_bytes()` (device bytes of optimizer
    state) 0; `host_state_bytes()` and `host_grad_bytes()` count what lives on the host.
    """

    offloaded = True

    def __init__(
        self,
        reducer: DataParallelGradReducer,
        *,
        lr: float,
        weight_decay: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        zero: int = 0,
        fused: bool = True,
        pin_memory: bool | None = None,
        host: bool = True,
        param_dtype: torch.dtype | None = None,
    ):
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={zero}: OffloadedAdamW supports 0 (replicated), 1, 2 and 3 (sharded over replicas)")
        self.zero = zero
        self.buckets = reducer.buckets
        self._slots: list[_Slot] = []
        self._param_groups: list[dict] = []
        self._weights_stale = True  # main weights are read from the device at the first step
        # `host=False` keeps the main weights on the training device; `param_dtype` (16-bit
        # resident weights, dp/resident.py) reads them now, from the fp32 parameters, and then
        # casts each bucket's parameters to `param_dtype`.
        self.host, self.param_dtype = host, param_dtype
        self._fused = fused
        self._grad_divisor: torch.Tensor | None = None  # 1 / clipping factor, applied by the next step
        kwargs = dict(lr=lr, betas=tuple(betas), eps=eps, **({"fused": True} if fused else {"foreach": True}))
        if reducer.shard_grads and zero == 0:
            raise ValueError("the reducer shards gradients (ZeRO-2): use OffloadedAdamW(zero=2)")
        self.grad_shards_of = reducer if reducer.shard_grads else None
        for bucket in self.buckets:
            device = bucket.shard.device
            pin = host and ((device.type == "cuda") if pin_memory is None else bool(pin_memory))
            # ZeRO-3 (dp/zero3.py sharded the parameters first): the device keeps only the
            # bucket's `param_shard`; the update is copied into it, the next forward gathers it.
            zero3 = getattr(bucket, "param_shard", None) is not None
            flat = bucket.param_buffer if zero3 else flatten_bucket_params(bucket)
            sharded = zero >= 1 and group_size(bucket.group) > 1
            start, size = (bucket.shard_start, bucket.shard.numel()) if sharded else (0, bucket.numel)
            main_device = torch.device("cpu") if host else device
            main = nn.Parameter(torch.empty(size, dtype=torch.float32, device=main_device, pin_memory=pin))
            host_grad = torch.zeros(size, dtype=torch.float32, pin_memory=pin) if host else None
            main.grad = host_grad
            optimizer = torch.optim.AdamW(
                [{"params": [main], "weight_decay": weight_decay if bucket.decay else 0.0}], **kwargs
            )
            self._param_groups += optimizer.param_groups
            if param_dtype is not None and zero3:  # Zero3 cast the shards and kept their fp32 values
                with torch.no_grad():
                    main.copy_(bucket.main_init)
                del bucket.main_init
            elif param_dtype is not None:
                with torch.no_grad():
                    main.copy_(flat[start : start + size])
                flat = cast_bucket_params(bucket, param_dtype)
            device_weights = bucket.param_shard if zero3 else flat[start : start + size]
            self._slots.append(_Slot(bucket, start, size, sharded, device_weights, main, host_grad, optimizer))
        self._pin = any(s.main.is_pinned() for s in self._slots)
        if param_dtype is not None:
            self._weights_stale = False
        self.param_gather: ParamGather | None = None  # set by overlap_param_gather

    def overlap_param_gather(self, chunks: list[nn.Module]) -> ParamGather | None:
        """zero=1/2: from now on `step` launches each bucket's all-gather asynchronously after
        its update and forward pre-hooks on `chunks` wait for them (dp/param_gather.py);
        returns the `ParamGather`, None when nothing is gathered (zero 0 and 3). Whoever reads
        the parameters outside forward calls `param_gather.finish_param_gather(chunks)` first."""
        if not any(slot.sharded for slot in self._slots) or self.zero == 3:
            return None
        if self.param_gather is None:
            self.param_gather = ParamGather(chunks, self.buckets)
        return self.param_gather

    # ------------------------------------------------------------------ optimizer interface

    @property
    def param_groups(self) -> list[dict]:
        """One group per bucket (each bucket is one weight-decay class); set "lr" here."""
        return self._param_groups

    def mark_weights_changed(self) -> None:
        """The device weights were written outside `step()`: re-read the main weights from
        them before the next update."""
        self._weights_stale = True

    @torch.no_grad()
    def _refresh_main_weights(self) -> None:
        for slot in self._slots:
            slot.main.copy_(slot.device_weights)
        self._weights_stale = False

    @staticmethod
    def _device_grads(slot: _Slot) -> torch.Tensor:
        """The reduced gradients of the slot's range, looked up at each step (with ZeRO-2 the
        reducer re-creates its buffers every step): this rank's shard, or the whole bucket."""
        grads = slot.bucket.shard if slot.sharded else slot.bucket.buffer
        if grads is None or grads.numel() != slot.size:
            raise RuntimeError("OffloadedAdamW.step() needs the reduced gradients: call it after reducer.finish()")
        return grads

    def scale_gradients(self, chunks: list[nn.Module], coef: torch.Tensor | None) -> None:
        """Fused: the next `step` divides the gradients it copied by 1/`coef` inside each
        bucket's AdamW kernel (torch's `grad_scale`; no pass over the device gradients), else
        they are scaled in place now."""
        if not self._fused:
            return super().scale_gradients(chunks, coef)
        self._grad_divisor = grad_divisor(coef)

    @torch.no_grad()
    def step(self) -> None:
        """Gradients device -> host, AdamW on the host, weights host -> device (+ all-gather,
        asynchronous with `overlap_param_gather`)."""
        divisor, self._grad_divisor = self._grad_divisor, None
        divisors = {}  # the clipping divisor on each main-weight device (one copy per device)
        gather = self.param_gather
        if gather is not None:
            gather.finish()  # a gather still in flight would overwrite the weights read or written now
        if self._weights_stale:
            self._refresh_main_weights()
        for slot in self._slots:
            grads = self._device_grads(slot)
            if slot.host_grad is None:  # main weights on the device: no staging copy
                slot.main.grad = grads
                continue
            slot.host_grad.copy_(grads, non_blocking=self._pin)
            if grads.is_cuda:
                slot.event = torch.cuda.Event()
                slot.event.record(torch.cuda.current_stream(grads.device))
        # Updated (and gathered) in the order forward reads the buckets when gathers overlap.
        for index in gather.order if gather is not None else range(len(self._slots)):
            slot = self._slots[index]
            if slot.event is not None:
                slot.event.synchronize()  # this bucket's gradients are on the host
                slot.event = None
            on_device = None if divisor is None else divisors.setdefault(slot.main.device, divisor.to(slot.main.device))
            with dividing_gradients(slot.optimizer, on_device):
                slot.optimizer.step()
            main = slot.main.detach()
            if slot.sharded and self.zero != 3:
                # in the parameters' dtype: a bf16 gather moves half the bytes of an fp32 one
                own = main.to(slot.device_weights.device, dtype=slot.device_weights.dtype, non_blocking=self._pin)
                if gather is not None:
                    gather.launch(index, slot.bucket.param_buffer, own, slot.bucket.group)
                else:
                    all_gather_into(slot.bucket.param_buffer, own, slot.bucket.group)
            else:
                slot.device_weights.copy_(main, non_blocking=self._pin)
        # The next writer of a pinned host buffer is the next step(), which first waits for its
        # gradient copies, queued on the same stream after these weight copies.

    # ----------------------------------------------------------------------- checkpoints

    def _gather_to_host(self, slot: _Slot, own: torch.Tensor) -> torch.Tensor:
        """The whole bucket's values of a per-shard host tensor (all-gathered through the
        device: NCCL only moves device tensors)."""
        if not slot.sharded:
            return own
        device = slot.device_weights.device
        full = torch.empty(slot.bucket.param_buffer.numel(), dtype=own.dtype, device=device)
        all_gather_into(full, own.to(device), slot.bucket.group)
        return full.cpu()

    def param_moments(self) -> tuple[dict, float]:
        """({param: (exp_avg, exp_avg_sq)} shaped like each device parameter, step count), on
        the host. With zero=0 these are views of the live state (read them before stepping
        again); with zero=1 the shards are all-gathered over each bucket's replica group."""
        moments, step = {}, 0.0
        for slot in self._slots:
            state = slot.optimizer.state.get(slot.main, {})
            full = []
            for key in ("exp_avg", "exp_avg_sq"):
                own = state[key] if key in state else torch.zeros(slot.size, dtype=torch.float32)
                full.append(self._gather_to_host(slot, own))
            if "step" in state:
                step = float(state["step"])
            offset = 0
            for p in slot.bucket.params:
                n = p.numel()
                moments[p] = tuple(f[offset : offset + n].view(p.shape) for f in full)
                offset += n
        return moments, step

    def moment_shards(self) -> tuple[list, float]:
        """([(param, first, (exp_avg, exp_avg_sq))], step count) on the host: the part of each
        parameter's flattened moments this rank updates (its shard with zero=1/2, all of it with
        zero=0), starting at element `first`; for checkpoints that save shards without
        gathering them. No communication."""
        return bucket_moment_shards(
            (slot.bucket, slot.start, slot.size, slot.optimizer.state.get(slot.main, {})) for slot in self._slots
        )

    @torch.no_grad()
    def load_param_moments(self, moments: dict, step: float) -> None:
        """Install per-parameter moments (as returned by `param_moments`, on any device): this
        rank keeps its part of every bucket, on the host. No communication. The main weights
        are re-read from the device weights (just loaded by the checkpoint) at the next step."""
        for slot in self._slots:
            exp_avg = torch.zeros(slot.size, dtype=torch.float32)
            exp_avg_sq = torch.zeros(slot.size, dtype=torch.float32)
            offset, end = 0, slot.start + slot.size
            for p in slot.bucket.params:
                n = p.numel()
                lo, hi = max(offset, slot.start), min(offset + n, end)
                if lo < hi:
                    for dst, src in zip((exp_avg, exp_avg_sq), moments[p]):
                        dst[lo - slot.start : hi - slot.start].copy_(src.reshape(-1)[lo - offset : hi - offset])
                offset += n
            slot.optimizer.state[slot.main] = {
                "step": torch.tensor(step, dtype=torch.float32),
                "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq,
            }
        self.mark_weights_changed()

    # ---------------------------------------------------------------------------- memory

    def state_bytes(self) -> int:
        """Bytes of optimizer state on the device: none (it all lives on the host)."""
        return 0

    def host_state_bytes(self, main_weights: bool = True) -> int:
        """Host bytes of the AdamW moments (8 per updated element once stepped) plus, unless
        `main_weights=False`, the fp32 main weights (4 per element)."""
        total = sum(
            t.numel() * t.element_size()
            for slot in self._slots
            for t in slot.optimizer.state.get(slot.main, {}).values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        if main_weights:
            total += sum(slot.main.numel() * slot.main.element_size() for slot in self._slots)
        return total

    def host_grad_bytes(self) -> int:
        """Host bytes of the gradient staging buffers (4 per updated element)."""
        return sum(
            slot.host_grad.numel() * slot.host_grad.element_size() for slot in self._slots if slot.host_grad is not None
        )
