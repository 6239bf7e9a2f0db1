"""Counting expert assignments on the device (no host sync), in one operator where possible."""

from __future__ import annotations

import torch


def add_counts(counts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """counts[i] += the number of times i occurs in the 1-d `index`, in place; returns `counts`.

    Eager: one scatter with a scalar source (no ones tensor: one kernel launch on a GPU). Under
    torch.compile: a scatter_add_ of ones, because inductor (torch 2.13) lowers the scalar-source
    scatter with reduce="add" into a scatter_reduce_ whose source has the wrong size and fails
    at run time. No communication."""
    if torch.compiler.is_compiling():
        return counts.scatter_add_(0, index, torch.ones_like(index, dtype=counts.dtype))
    return counts.scatter_(0, index, 1, reduce="add")
