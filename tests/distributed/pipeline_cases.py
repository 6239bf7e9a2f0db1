"""Parallel == serial with pipeline parallelism: pp in {2, 4} with gpipe, 1f1b and interleaved
(vpp 2) schedules, alone and combined with tp, sp, dp and an MoE model with ep.

Each case compares the loss, the global gradient norm, every gradient after the first step
(all parameters of this rank's chunks, all-gathered over tp/ep, against the serial
parameter of the same name, including the tied embedding's copy on the last stage) and every
weight after three AdamW steps; and the peak number of live activations on this rank against
the schedule's bound. Every message is sent with tag 0, so pipeline messages pair by order
alone, as on NCCL.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.pipeline.executor import PipelineExecutor, activation_shape
from meshtron.training.optim import build_optimizer
from meshtron.training.step import evaluate, pipeline_train_step, train_step
from tests.distributed.dense_cases import (
    ADAM_EPS,
    FAMILIES,
    LR,
    SEED,
    STEPS,
    UNFUSED,
    assert_close,
    build,
    compare_parameters,
    family_config,
    global_batch,
)
from tests.distributed.moe_dispatch_cases import forced_exchanges

# (arch, moe, pp, vpp, schedule, tp, sp, ep)
LAYOUTS = {
    2: [
        ("gpt2", False, 2, 1, "gpipe", 1, False, 1),
        ("gpt2", False, 2, 1, "1f1b", 1, False, 1),
        ("llama", False, 2, 2, "interleaved", 1, False, 1),
    ],
    4: [
        ("gpt2", False, 4, 1, "gpipe", 1, False, 1),
        ("llama", False, 4, 1, "1f1b", 1, False, 1),
        ("gpt2", False, 4, 2, "interleaved", 1, False, 1),
        ("llama", False, 2, 1, "1f1b", 2, True, 1),
        ("gpt2", False, 2, 2, "interleaved", 1, False, 1),
        ("gpt2", True, 2, 1, "1f1b", 1, False, 2),
    ],
    8: [
        ("llama", False, 2, 2, "interleaved", 2, True, 1),
        ("gpt2", False, 4, 1, "1f1b", 2, False, 1),
        ("llama", True, 2, 1, "1f1b", 2, True, 2),
        ("gpt2", True, 2, 2, "interleaved", 2, False, 4),
    ],
}
MICRO_PER_RANK = 4


def pipeline_config(arch: str, moe: bool) -> GPTConfig:
    if arch in FAMILIES:
        return family_config(arch, lambda a: pipeline_config(a, moe))
    extra = (
        dict(num_experts=4, top_k=2, moe_every=2, moe_ffn_hidden_size=32, aux_loss_coef=0.01, z_loss_coef=0.001)
        if moe
        else {}
    )
    if arch == "llama":
        return GPTConfig(
            arch="llama",
            num_layers=8,
            hidden_size=32,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=48,
            vocab_size=200,
            seq_len=16,
            tie_embeddings=False,
            **extra,
        )
    return GPTConfig(
        arch="gpt2",
        num_layers=8,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        vocab_size=200,
        seq_len=16,
        tie_embeddings=True,
        **extra,
    )


def _name(layout) -> str:
    arch, moe, pp, vpp, schedule, tp, sp, ep = layout
    return (f"{arch}{'_moe' if moe else ''}_pp{pp}_v{vpp}_{schedule}_tp{tp}{'sp' if sp else ''}_ep{ep}").replace(
        "-", "_"
    )


def build_pipeline(cfg: GPTConfig, mesh, micro: int, execution: ExecutionConfig = ExecutionConfig()):
    """This rank's model chunks, their (name, parameter) list, gradient reducer, AdamW and a
    pipeline executor for microbatches of `micro` sequences. Every message is sent with tag 0:
    gloo then pairs by order alone, as NCCL does (tags are not needed)."""
    chunks = init_model_chunks(cfg, mesh, SEED, execution=execution)
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
    reducer = DataParallelGradReducer(named, mesh, bucket_mb=0.01)
    optimizer = build_optimizer(nn.ModuleList(chunks), lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    executor = PipelineExecutor(
        chunks,
        mesh,
        activation_shape(mesh, cfg.seq_len, micro, cfg.hidden_size),
        torch.float32,
        torch.device("cpu"),
        tags=False,
    )
    return chunks, named, reducer, optimizer, executor


def check_pipeline_layout(layout, stage_layers=None, execution: ExecutionConfig = ExecutionConfig()) -> None:
    """The pipeline layout (arch, moe, pp, vpp, schedule, tp, sp, ep) run with `execution`
    trains like the serial eager model: losses, gradients, weights, live activations, eval."""
    arch, moe, pp, vpp, schedule, tp, sp, ep = layout
    cfg = pipeline_config(arch, moe)
    mesh = build_mesh(
        ParallelConfig(tp=tp, pp=pp, vpp=vpp, sp=sp, ep=ep, schedule=schedule, stage_layers=stage_layers), cfg
    )
    dp = mesh.dp_size
    batch = dp * MICRO_PER_RANK
    chunks, named, reducer, optimizer, executor = build_pipeline(cfg, mesh, 1, execution)

    serial_mesh = single_process_mesh()
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh, UNFUSED)
    ref_params = dict(ref.named_parameters())

    for step in range(STEPS):
        inputs, targets = global_batch(cfg, step, batch)
        rows = lambda r: slice(r * MICRO_PER_RANK, (r + 1) * MICRO_PER_RANK)  # noqa: E731
        mine = [
            (inputs[rows(mesh.dp_rank)][j : j + 1], targets[rows(mesh.dp_rank)][j : j + 1])
            for j in range(MICRO_PER_RANK)
        ]
        # The serial run takes the same microbatches (MoE statistics are per rank-microbatch).
        serial = [
            (inputs[rows(r)][j : j + 1], targets[rows(r)][j : j + 1]) for r in range(dp) for j in range(MICRO_PER_RANK)
        ]
        out = pipeline_train_step(
            chunks, reducer, optimizer, mine, mesh, executor, schedule=schedule, lr=LR, max_grad_norm=1.0
        )
        ref_out = train_step(ref, ref_reducer, ref_optimizer, serial, serial_mesh, lr=LR, max_grad_norm=1.0)
        keys = ("loss", "grad_norm") + (("aux_loss", "z_loss") if moe else ())
        for key in keys:
            assert_close(f"step {step} {key}", getattr(out, key), getattr(ref_out, key))
        if step == 0:
            peak = out.pipeline.peak_live_activations
            bound = {"gpipe": MICRO_PER_RANK * vpp, "1f1b": min(pp - mesh.pp_rank, MICRO_PER_RANK)}.get(schedule)
            if bound is not None and peak != bound:
                raise AssertionError(f"{schedule}: {peak} live activations on stage {mesh.pp_rank}, want {bound}")
            compare_parameters(named, ref_params, mesh, cfg, "grad")
    compare_parameters(named, ref_params, mesh, cfg, f"weight after {STEPS} steps")
    # Forward-only evaluation through the pipeline equals the serial evaluation.
    assert_close("eval loss", evaluate(chunks, mine, mesh, executor), evaluate([ref], serial, serial_mesh))
    reducer.remove_hooks()


def _make(layout):
    def case() -> None:
        check_pipeline_layout(layout)

    case.__name__ = _name(layout)
    return case


for _layouts in LAYOUTS.values():
    for _layout in _layouts:
        globals()[_name(_layout)] = _make(_layout)


def gpt2_moe_pp2_v2_interleaved_tp2_ep4_async_exchanges() -> None:
    """The layout whose hang turned asynchronous backward all-to-alls off on 2026-11-23, with
    the MoE exchanges asynchronous both ways as over NCCL (mpu.mappings.ASYNC_EXCHANGES, forced
    on gloo): equal to one process, no hang."""
    with forced_exchanges(True):
        check_pipeline_layout(("gpt2", True, 2, 2, "interleaved", 2, False, 4))


def gpt2_pp2_uneven_stages_3_5() -> None:
    """Explicit per-stage layer counts: 3 layers on stage 0 (with the embedding), 5 on stage 1."""
    check_pipeline_layout(("gpt2", False, 2, 1, "1f1b", 1, False, 1), stage_layers=[3, 5])


def cases_for_world(world_size: int) -> list[str]:
    extra = {2: ["gpt2_pp2_uneven_stages_3_5"], 8: ["gpt2_moe_pp2_v2_interleaved_tp2_ep4_async_exchanges"]}
    extra = extra.get(world_size, [])
    return [_name(layout) for layout in LAYOUTS.get(world_size, [])] + extra
