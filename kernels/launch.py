"""Autotuned Triton launches with the autotuner off the hot path.

`launch(kernel, grid, key, *args, args_for=None, **constexprs)`: the first call of a `key` runs
`kernel` (a `triton.autotune`d function) through its autotuner, which picks (and on a GPU
benchmarks) a config; the config is remembered under `key` and every later call launches the
jitted function with it directly. That skips the autotuner's per-call work -- a dict of every
argument, the key built from the arguments and the dtype string of each tensor, the hooks -- a
few microseconds of host time per launch, which is what a norm's whole device time is at
h 2048. `grid` is a tuple or, as Triton takes it, a function of the launch's constexprs (the
config's included). `key` must hold whatever the autotuner's own key would distinguish: the
autotune key arguments, the dtypes and the constexprs that change the kernel.

Kernels whose arguments depend on the config -- TMA descriptors, whose block shapes are the
config's tiles -- pass `args_for(meta)` instead of `args`: the positional arguments for the
config constexprs `meta`, or, for `meta` None, those of the autotuned first call (where the
configs' pre-hook sets each candidate's blocks). Other configs with a `pre_hook` always go
through the autotuner. `clear()` forgets the choices (tests that watch the autotuner's
launches call it first). kernels/gemm.py keeps a launch cache of its own: its launches carry a
split-K plan, a workspace and a reduction. No communication.
"""

from __future__ import annotations

_chosen: dict = {}


def launch(kernel, grid, key: tuple, *args, args_for=None, **constexprs) -> None:
    """Launch autotuned `kernel` over `grid` with `args` (or `args_for(meta)`) and `constexprs`:
    the autotuner on the first call of `key`, the remembered config afterwards."""
    config = _chosen.get((kernel, key))
    if config is None:
        kernel[grid](*(args if args_for is None else args_for(None)), **constexprs)
        best = kernel.best_config
        if best.pre_hook is None or args_for is not None:
            _chosen[(kernel, key)] = best
        return
    if args_for is not None:
        args = args_for({**constexprs, **config.kwargs})
    kernel.fn[grid](*args, **constexprs, **config.all_kwargs())


def clear() -> None:
    """Forget every remembered config: the next launch of each key runs the autotuner again."""
    _chosen.clear()
