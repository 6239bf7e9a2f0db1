"""Bytes autograd saves for backward, measured with saved-tensor hooks (`saved_activation_bytes`):
the measurement `bench/memory.py`, `bench/activation_memory.py` and the planner's tests compare
the plan with."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward and loss
    (parameters excluded); runs the backward afterwards to free them."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss_per_token(model(inputs), targets).sum()
        aux = model.aux_loss()
    (loss if aux is None else loss + aux).backward()
    return sum(seen.values())
