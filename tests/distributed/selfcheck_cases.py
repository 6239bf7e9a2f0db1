"""Multi-process cases for the kernel self-check (`kernels.selfcheck`): every rank ends on the
same path for every kernel even when the check fails on one rank only.

Run by tests/test_kernel_selfcheck.py in its own 2-process gloo world (harness.run_world,
TRITON_INTERPRET=1 set by the harness); not part of the shared registry worlds.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from meshtron.kernels import cross_entropy, selfcheck
from meshtron.kernels.backend import CHECKED
from meshtron.models.config import ExecutionConfig
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.training.step import train_step
from tests.distributed.dense_cases import (
    GLOBAL_BATCH,
    LR,
    assert_close,
    build,
    compare_parameters,
    microbatches,
    model_config,
)


def _all_verdicts() -> list[dict]:
    mine = {k: selfcheck.verdict(k) for k in selfcheck.KERNELS}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def verdicts_agree_without_a_model() -> None:
    """Plain functions as 'kernels': a mismatch on rank 1 only and an exception on rank 0
    only send that kernel to torch on both ranks after `agree()`; until then both run torch;
    a kernel checked and passed everywhere runs Triton everywhere; one first reached after
    the agreement runs torch."""
    selfcheck.reset()
    rank = dist.get_rank()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    w = torch.randn(8)
    reference = lambda a, b: a * b  # noqa: E731
    calls = {"triton": 0}

    def good(a, b):
        calls["triton"] += 1
        return a * b

    def wrong_on_rank1(a, b):
        return a * b * (1.5 if rank == 1 else 1.0)

    def raises_on_rank0(a, b):
        if rank == 0:
            raise RuntimeError("no kernel image is available for execution on the device")
        return a * b

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        selfcheck.dispatch("rms_norm", CHECKED, good, reference, x, w)
        selfcheck.dispatch("layer_norm", CHECKED, wrong_on_rank1, reference, x, w)
        selfcheck.dispatch("grouped_gemm", CHECKED, raises_on_rank0, reference, x, w)
        # Checked but not agreed: torch on every rank, whatever the local result.
        assert all(selfcheck.verdict(k) is None for k in selfcheck.KERNELS)
        before = calls["triton"]
        selfcheck.dispatch("rms_norm", CHECKED, good, reference, x, w)
        assert calls["triton"] == before, "a kernel ran Triton before the ranks agreed"
        verdicts = selfcheck.agree()
        after = selfcheck.dispatch("linear_gelu", CHECKED, good, reference, x, w)  # first use after agree
        selfcheck.dispatch("rms_norm", CHECKED, good, reference, x, w)
    assert torch.equal(after, x * w)
    assert verdicts == {"rms_norm": True, "layer_norm": False, "grouped_gemm": False}, verdicts
    assert calls["triton"] == before + 1, "rms_norm passed everywhere but did not run Triton"
    every = _all_verdicts()
    assert all(v == every[0] for v in every), f"ranks disagree: {every}"
    assert every[0]["linear_gelu"] is False
    names = sorted(
        str(w.message).split("'")[1] for w in caught if issubclass(w.category, selfcheck.KernelSelfCheckWarning)
    )
    assert names == ["grouped_gemm", "layer_norm", "linear_gelu"], names
    text = " ".join(str(w.message) for w in caught)
    assert "failed on 1 of 2 ranks" in text
    selfcheck.reset()


class TripledGrad(torch.autograd.Function):
    """Identity forward, gradient times 3: a cross-entropy whose backward is wrong."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


def llama_tp2_cross_entropy_broken_on_rank1() -> None:
    """tp=2 (SP) llama with triton_checked where rank 1's fused cross-entropy has a wrong
    backward: after the first step's agreement both ranks run the torch cross-entropy (and
    the Triton norm and SwiGLU), nothing hangs, and three steps equal the serial torch model."""
    selfcheck.reset()
    original = cross_entropy.fused_cross_entropy
    if dist.get_rank() == 1:

        def broken(logits, *args, **kwargs):
            return original(TripledGrad.apply(logits), *args, **kwargs)

        cross_entropy.fused_cross_entropy = broken
    try:
        cfg = model_config("llama")
        mesh = build_mesh(ParallelConfig(tp=dist.get_world_size(), sp=True), cfg)
        model, reducer, optimizer = build(cfg, mesh, ExecutionConfig(kernel_backend=CHECKED))
        serial = single_process_mesh()
        ref, ref_reducer, ref_optimizer = build(cfg, serial)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                out = train_step(
                    model,
                    reducer,
                    optimizer,
                    microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 2),
                    mesh,
                    lr=LR,
                    max_grad_norm=1.0,
                )
                ref_out = train_step(
                    ref,
                    ref_reducer,
                    ref_optimizer,
                    microbatches(cfg, step, 0, 1, GLOBAL_BATCH),
                    serial,
                    lr=LR,
                    max_grad_norm=1.0,
                )
                if step == 0:
                    selfcheck.agree()
                assert_close(f"step {step} loss", out.loss, ref_out.loss)
        compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, "weight after 3 steps")
        every = _all_verdicts()
        assert all(v == every[0] for v in every), f"ranks disagree: {every}"
        assert (
            every[0]["cross_entropy"] is False and every[0]["rms_norm"] is True and every[0]["linear_swiglu"] is True
        ), every[0]
        ours = [str(w.message) for w in caught if issubclass(w.category, selfcheck.KernelSelfCheckWarning)]
        assert len(ours) == 1 and "'cross_entropy'" in ours[0], ours
        reducer.remove_hooks()
        ref_reducer.remove_hooks()
    finally:
        cross_entropy.fused_cross_entropy = original
        selfcheck.reset()
