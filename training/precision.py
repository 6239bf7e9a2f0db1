"""Mixed precision: bf16/fp16 compute with fp32 main weights and fp32 gradients.

`trainer.precision=auto` (the default) is resolved before anything is built, per device:
bf16 on CUDA with bf16 support, fp32 elsewhere (meshtron/rules.py `pick_precision`,
`RunConfig.with_precision_for`); `Precision` takes the resolved name only.

`trainer.precision=bf16|fp16` runs forward (and so backward) under `torch.autocast`: matmuls,
attention and the expert GEMMs compute in the 16-bit type while the parameters stay fp32 and
are the main weights, gradients accumulate in the reducer's fp32 buckets, and the optimizer
updates fp32 values. Reductions autocast keeps in fp32 (softmax, norms, the cross-entropy)
stay fp32. The cost is a 16-bit copy of each weight used in a matmul, held by autocast while
the forward runs; the saving is in activations and matmul time (tensor cores on GPUs).

`optim.param_dtype=bf16` (only with bf16) makes the weights themselves bf16 and keeps the fp32
main weights in the optimizer (16-bit resident weights, dp/resident.py): autocast then has
no weight copies to make, gradients are still accumulated and reduced in fp32.

`trainer.precision=fp8` is bf16 autocast plus FP8 GEMMs for the dense linears (attention's
qkv and output projections, the MLPs, shared experts) and the routed experts' grouped GEMMs
(moe/fp8_experts.py; on GPUs with torch's FP8 grouped GEMM, sm_90/sm_100): e4m3 operands with
per-row scales, fp32 accumulation, a bf16 weight-gradient GEMM (mpu/fp8.py has the recipe);
everything else is bf16 as above. It needs a GPU of compute capability 8.9 or newer (or the CPU, where torch
computes the same numbers slowly: tests and smoke runs).

fp16 has a narrow exponent range, so its gradients are computed on a scaled loss
(`LossScaler`): the loss is multiplied by the scale before backward and the gradients are
divided by it before clipping; a step whose gradients overflow (non-finite norm) is skipped
on every rank and the scale halves; after `growth_interval` clean steps it doubles. bf16 has
fp32's range and needs no scaling.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from meshtron.errors import ConfigError
from meshtron.mpu.fp8 import fp8_scope, fp8_supported
from meshtron.rules import compute_precision_check, raise_first

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclass
class LossScaler:
    """Dynamic loss scale for fp16 (the rule torch's GradScaler uses)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow (the step was skipped), grow after a clean run."""
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


class Precision:
    """The compute precision of a run: `autocast()` for forward passes and the loss scale."""

    def __init__(self, name: str = "fp32", device_type: str = "cpu", scaler: LossScaler | None = None):
        raise_first([compute_precision_check(name)])
        if name == "fp8":
            ok, why = fp8_supported(torch.device(device_type))
            if not ok:
                raise ConfigError(f"trainer.precision=fp8: {why}; use trainer.precision=bf16")
        self.name, self.device_type = name, device_type
        self.dtype = COMPUTE_DTYPES[name]
        self.scaler = (scaler or LossScaler()) if name == "fp16" else None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def autocast(self):
        """Context for forward passes: autocast to the compute dtype (nothing for fp32), and
        for fp8 the FP8 GEMMs of the dense linears inside it."""
        if self.dtype is None:
            return contextlib.nullcontext()
        if self.name == "fp8":
            return _fp8_autocast(self.device_type)
        return torch.autocast(self.device_type, dtype=self.dtype)

    def update(self, finite: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(finite)


FP32 = Precision("fp32")


def device_has_fast_bf16(device_type: str) -> bool:
    """Whether `device_type` computes bf16 at tensor-core speed here (a CUDA device with bf16
    support): what `trainer.precision=auto` asks (RunConfig.with_precision_for)."""
    return device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@contextlib.contextmanager
def _fp8_autocast(device_type: str):
    with torch.autocast(device_type, dtype=torch.bfloat16), fp8_scope():
        yield
