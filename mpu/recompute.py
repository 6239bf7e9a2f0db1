"""Activation recomputation that replays dropout exactly, including the TP RNG streams.

`recompute(fn, *tensors)` runs `fn` without keeping its intermediate activations and runs it
again in backward. Before the first run it snapshots the default CPU (and CUDA) generator
and every stream of the `mpu.random` tracker; the replay restores them, so dropout masks —
inside and outside tensor-parallel regions — are identical to the first run and the
gradients equal those of running without recomputation. Collectives inside `fn` simply run
again in backward (for a TP layer: its forward all-reduces once more).
"""

from __future__ import annotations

import contextlib

import torch

from meshtron.mpu.random import get_rng_tracker

_REPLAYING = [False]


def is_replaying() -> bool:
    """True while a recomputed region runs again in backward: code with side effects that must
    happen once per forward (statistics accumulators) skips them then."""
    return _REPLAYING[0]


@contextlib.contextmanager
def _replaying():
    previous, _REPLAYING[0] = _REPLAYING[0], True
    try:
        yield
    finally:
        _REPLAYING[0] = previous


def _rng_snapshot(device_type: str):
    cuda = torch.cuda.get_rng_state() if device_type == "cuda" else None
    return torch.get_rng_state(), cuda, get_rng_tracker().get_states()


def _rng_restore(snapshot) -> None:
    cpu, cuda, tracker = snapshot
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_rng_tracker().set_states(tracker)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.device_type = next((t.device.type for t in inputs if torch.is_tensor(t)), "cpu")
        ctx.rng = _rng_snapshot(ctx.device_type)
        ctx.save_for_backward(*[t if torch.is_tensor(t) else None for t in inputs])
        ctx.non_tensors = [None if torch.is_tensor(t) else t for t in inputs]
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs = [
            s.detach().requires_grad_(s.requires_grad) if s is not None else n for s, n in zip(saved, ctx.non_tensors)
        ]
        current = _rng_snapshot(ctx.device_type)
        _rng_restore(ctx.rng)
        try:
            with torch.enable_grad(), _replaying():
                outputs = ctx.fn(*inputs)
        finally:
            _rng_restore(current)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(t.grad if torch.is_tensor(t) and t.requires_grad else None for t in inputs)


def recompute(fn, *inputs):
    """fn(*inputs) whose activations are recomputed in backward (same dropout masks).

    At least one tensor input must require grad; non-tensor inputs are passed through.
    """
    return _Recompute.apply(fn, *inputs)
