"""RNG streams for dropout under tensor and sequence parallelism.

The default generator is seeded identically on every rank of a TP group, so dropout on
replicated activations (outside TP regions) draws the same mask on every TP rank. Inside a
TP region (attention heads split over TP, or sequence shards under SP) dropout must differ
per shard: `RNGTracker.fork("tensor-parallel")` swaps in a generator seeded per TP rank.
Both streams are also offset per pipeline stage and per context-parallel rank (cp ranks hold
other tokens of the same sequences).
"""

from __future__ import annotations

import contextlib

import torch

TENSOR_PARALLEL = "tensor-parallel"
_TP_SEED_OFFSET = 2718
_PP_SEED_OFFSET = 100
_CP_SEED_OFFSET = 7919


class RNGTracker:
    """Named RNG states for one device type; `fork(name)` runs a block on that state."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self.states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device_type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        """Create the named state seeded with `seed`, leaving the current state untouched."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = self._get()
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL):
        """Run the block with the named RNG state, then store it back and restore the default."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} was never added; call seed_parallel_rng first")
        saved = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


_TRACKER = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    """The process-wide tracker used by the model's dropout."""
    return _TRACKER


def seed_parallel_rng(seed: int, tp_rank: int, pp_rank: int = 0, device_type: str = "cpu", cp_rank: int = 0) -> None:
    """Seed the default generator (same on all TP ranks of a stage and cp rank) and the
    per-TP-rank stream. Context-parallel ranks hold other tokens of the sequence, so both
    streams differ per cp rank (else every cp shard would draw the same dropout mask)."""
    global _TRACKER
    base = seed + _PP_SEED_OFFSET * pp_rank + _CP_SEED_OFFSET * cp_rank
    torch.manual_seed(base)
    if device_type == "cuda":
        torch.cuda.manual_seed(base)
    _TRACKER = RNGTracker(device_type)
    _TRACKER.add(TENSOR_PARALLEL, base + _TP_SEED_OFFSET + tp_rank)
