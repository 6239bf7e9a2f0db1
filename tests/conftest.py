"""Loaded by pytest before any test module.

Triton's mode: on a machine without CUDA, Triton runs under its interpreter
(TRITON_INTERPRET=1) for the whole session, decided here rather than by whichever kernel test
file is collected first: a kernel module imported in compile mode beside one imported in
interpreter mode fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
Subprocesses that must compile (kernels/aot.py, the benches' GPU paths) drop the variable from
their own environment.

Serial tests: every `distributed` test is also `serial`. The README's test command runs the
tests that are not serial on 2 pytest-xdist workers (`-m "not serial"`, a file per worker at a
time) and then the serial ones alone (`-m serial`): gloo worlds with short collective
timeouts, and bounds on elapsed time, must not share the CPU with another test."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.serial)
