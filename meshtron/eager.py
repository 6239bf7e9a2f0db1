"""Functions that run outside torch.compile graphs, without importing the compiler at import.

`torch.compiler.disable(fn)` imports torch._dynamo (and with it Triton) when it is applied, so
a module that applied it at import time would load the compiler into every process that only
imports meshtron, and load Triton before a test process chose its interpreter mode. `eager`
marks a function instead; `prepare_for_compile()` (called by whatever puts meshtron modules
under torch.compile, before tracing) applies torch.compiler.disable to every marked function,
so that a trace meets only the one graph break around each call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_MARKED: list[tuple[Callable, list[Callable]]] = []  # (fn, [its disabled form, once built])


def eager(fn: Callable) -> Callable:
    """`fn`, kept out of compiled graphs (a graph break around it under torch.compile, where
    it runs eagerly) and called directly otherwise."""
    disabled: list[Callable] = []
    _MARKED.append((fn, disabled))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:  # compiled without prepare_for_compile: building it breaks the graph too
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call


def prepare_for_compile() -> None:
    """Build the disabled form of every `eager` function now, before torch.compile traces."""
    for fn, disabled in _MARKED:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
