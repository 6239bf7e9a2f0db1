"""trainer.compile (every transformer block under torch.compile) in parallel layouts equals the
serial eager model: tp=2 with sequence parallelism (the TP collectives inside the compiled
blocks), cp=2 (the context-parallel ring's point-to-point exchanges inside the attention core)
and an MoE model at ep=2 (the dispatcher's all-to-alls, kept eager by
`MoELayer.keep_collectives_eager`), run by tests/test_compile_blocks.py in one gloo world of
its own.

Each case trains the compiled layout and, in the same process, the serial eager model on the
same global batch (4 sequences in microbatches of 2), and compares the loss and gradient norm
of every step (MoE: aux and z losses too), every gradient after the first step and every
weight after the last, at 1e-5 (dense_cases.py explains the tolerance and the AdamW eps); and
checks that dynamo compiled the blocks (graphs captured, every block built compiled).
"""

from __future__ import annotations

import torch

from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.models.config import ExecutionConfig
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.training.step import train_step
from tests.distributed.dense_cases import (
    ADAM_EPS,
    LR,
    UNFUSED,
    assert_close,
    build,
    compare_parameters,
    microbatches,
    model_config,
)
from tests.distributed.moe_cases import moe_config
from tests.distributed.pipeline_cases import check_pipeline_layout

STEPS = 2
MICRO = 2  # sequences per microbatch (the serial run takes every replica's, in order)


def check_compiled_layout(arch: str, moe: bool = False, zero: int = 0, **layout) -> None:
    """The compiled model in `layout` (ParallelConfig fields) trains like the serial eager one
    (`moe`: 8 experts, top-2, dropless, aux and z losses; `zero` 1 or 2: the sharded AdamW over
    dp, gradients reduce-scattered at 2, so only the loss, norm and weights are compared)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = moe_config(arch, 2, "softmax", None) if moe else model_config(arch)
    mesh = build_mesh(ParallelConfig(**layout), cfg)
    serial_mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh, ExecutionConfig(compile=True))
    if zero:
        reducer.remove_hooks()
        reducer = DataParallelGradReducer(list(model.named_parameters()), mesh, bucket_mb=0.01, shard_grads=zero == 2)
        optimizer = ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh, UNFUSED)
    assert all(block.compiled for block in model.layers.values())
    for step in range(STEPS):
        mine = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, MICRO)
        out = train_step(model, reducer, optimizer, mine, mesh, lr=LR, max_grad_norm=1.0)
        serial = microbatches(cfg, step, 0, 1, MICRO)
        ref_out = train_step(ref, ref_reducer, ref_optimizer, serial, serial_mesh, lr=LR, max_grad_norm=1.0)
        for key in ("loss", "grad_norm") + (("aux_loss", "z_loss") if moe else ()):
            assert_close(f"step {step} {key}", getattr(out, key), getattr(ref_out, key))
        if step == 0 and not zero:
            compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, "grad")
    # Inductor's fused kernels round differently from eager; AdamW's normalisation amplifies that
    # on the small, zero-initialized biases (1.27e-5 measured on gpt2_tp2_sp's attn.proj.bias).
    compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, "weight", rtol=3e-5)
    reducer.remove_hooks()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, f"nothing was compiled: {dict(counters['stats'])}"
    torch._dynamo.reset()


def gpt2_tp2_sp_compiled() -> None:
    """tp=2 with sequence parallelism: the all-gathers and reduce-scatters inside the blocks."""
    check_compiled_layout("gpt2", tp=2, sp=True)


def llama_cp2_compiled() -> None:
    """cp=2: ring attention, RoPE at the shards' global positions."""
    check_compiled_layout("llama", cp=2)


def llama_moe_ep2_compiled() -> None:
    """ep=2 (dp=2): the experts' graphs between the dispatcher's eager all-to-alls, whose row
    counts differ by rank and step."""
    check_compiled_layout("llama", moe=True, ep=2)


def llama_zero2_dp2_compiled() -> None:
    """ZeRO-2 at dp=2: gradient buckets reduce-scattered by hooks on the compiled blocks'
    parameters, each rank's AdamW shard, the weights all-gathered after the step."""
    check_compiled_layout("llama", zero=2)


def gpt2_pp2_1f1b_compiled() -> None:
    """pp=2 (1F1B): each stage's compiled blocks between the pipeline's point-to-point
    messages; losses, gradients, weights and the pipelined evaluation equal the serial model."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    check_pipeline_layout(("gpt2", False, 2, 1, "1f1b", 1, False, 1), execution=ExecutionConfig(compile=True))
    assert counters["stats"]["unique_graphs"] > 0, f"nothing was compiled: {dict(counters['stats'])}"
    torch._dynamo.reset()


CASES = (
    "gpt2_tp2_sp_compiled",
    "llama_cp2_compiled",
    "llama_moe_ep2_compiled",
    "llama_zero2_dp2_compiled",
    "gpt2_pp2_1f1b_compiled",
)


def cases_for_world(world_size: int) -> list[str]:
    """The cases of a world of `world_size` processes (two-rank layouts only)."""
    return list(CASES) if world_size == 2 else []
