"""Loaded by pytest before any test module. On a machine without CUDA, Triton runs under its
interpreter (TRITON_INTERPRET=1) for the whole session, decided here rather than by whichever
kernel test file is collected first: a kernel module imported in compile mode beside one
imported in interpreter mode fails ("Cannot call @triton.jit'd outside of the scope of a
kernel"). Subprocesses that must compile (kernels/aot.py, the benches' GPU paths) drop the
variable from their own environment."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
