"""Parallel == serial for fine-grained MoE GPTs (issue 40): 64 experts of width 8, top-8, over
ep/etp folded on tp x dp (x sp) and pp, against the single-process model.

The DeepSeek-V3 routing (sigmoid score, 8 groups with each token's experts inside its best 4,
routed_scaling_factor 2.5, aux-loss-free expert bias), Qwen2-MoE's gated shared expert of its
own width, and the dense-layer patterns (`moe_first_dense`, `moe_dense_layers`) run under
dropless and capacity (1.0: 2 pairs per sequence and expert, so tokens drop) dispatch and
under every aux-loss scope. Each case compares, as moe_cases does (and with its helpers and
tolerances), the logits, every step's loss, gradient norm, aux and z-loss, load and dropped
fraction, every gradient after the first step and every weight after STEPS AdamW steps; the
aux-free expert bias is compared bit for bit after every step and must have moved. Cases
also prove that what they test binds: the group limit changes some token's choice, capacity
drops some pairs.
"""

from __future__ import annotations

import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.training.step import pipeline_train_step, train_step
from tests.distributed.dense_cases import (
    LR,
    UNFUSED,
    assert_close,
    build,
    global_batch,
    microbatches,
)
from tests.distributed.moe_cases import (
    MICRO,
    MICRO_PER_RANK,
    count_group_limited_choices,
    train_against_serial,
)
from tests.distributed.pipeline_cases import build_pipeline

# DeepSeek-V3 routing: sigmoid, 8 groups of 8 experts, each token's top-8 inside its best 4
# groups (a group scores by its best 8 // 4 = 2 experts), combine weights times 2.5, and the
# aux-loss-free expert bias stepping after every update.
DEEPSEEK = dict(
    router_score="sigmoid",
    router_groups=8,
    router_topk_groups=4,
    router_scaling_factor=2.5,
    router_bias_update_rate=0.01,
)
# Qwen2-MoE's shared expert: one MLP of its own width, its output gated per token.
QWEN2_SHARED = dict(shared_experts=1, shared_ffn_hidden_size=24, shared_expert_gate=True)
# Four layers, the first dense (moe_first_dense) and layer 2 dense (moe_dense_layers): MoE at 1 and 3.
PATTERN = dict(num_layers=4, moe_first_dense=1, moe_dense_layers=[2])


def fine_config(arch: str, scope: str, capacity_factor: float | None = None, **extra) -> GPTConfig:
    """The fine-grained MoE model: hidden 32, 64 experts of width 8, top-8, every layer MoE
    (unless `extra` sets a pattern), aux and z-loss on, the aux-loss `scope`."""
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        vocab_size=200,
        seq_len=16,
        num_experts=64,
        top_k=8,
        moe_ffn_hidden_size=8,
        moe_every=1,
        capacity_factor=capacity_factor,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        aux_loss_scope=scope,
    )
    if arch == "llama":
        fields.update(arch="llama", num_kv_heads=2, ffn_hidden_size=48, tie_embeddings=False)
    else:
        fields.update(arch="gpt2", ffn_hidden_size=64)
    fields.update(extra)
    return GPTConfig(**fields)


# name -> (world, arch, ParallelConfig fields, aux scope, capacity factor, config extras, dispatch chunks)
LAYOUTS = {
    "fine_gpt2_ep2_dropless_microbatch": (2, "gpt2", dict(ep=2), "microbatch", None, {}, 2),
    "fine_llama_tp2sp_ep2_qwen2_shared_gate_sequence": (
        2,
        "llama",
        dict(tp=2, sp=True, ep=2),
        "sequence",
        None,
        QWEN2_SHARED,
        1,
    ),
    "fine_gpt2_ep2_first_dense_dense_layers_global": (2, "gpt2", dict(ep=2), "global", None, PATTERN, 1),
    "fine_gpt2_ep4_etp1_cap1_microbatch": (4, "gpt2", dict(ep=4, etp=1), "microbatch", 1.0, {}, 1),
    "fine_gpt2_ep2_etp2_deepseek_grouped_microbatch": (4, "gpt2", dict(ep=2, etp=2), "microbatch", None, DEEPSEEK, 1),
    "fine_llama_tp2sp_ep2_qwen2_shared_gate_global": (
        4,
        "llama",
        dict(tp=2, sp=True, ep=2),
        "global",
        None,
        QWEN2_SHARED,
        1,
    ),
    "fine_llama_tp2sp_ep4_etp2_deepseek_grouped_cap1_sequence": (
        8,
        "llama",
        dict(tp=2, sp=True, ep=4, etp=2),
        "sequence",
        1.0,
        {**DEEPSEEK, **QWEN2_SHARED},
        2,
    ),
}
# name -> (world, arch, ParallelConfig fields, aux scope, config extras): through pp=2 stages (1f1b).
PIPELINE_LAYOUTS = {
    "fine_gpt2_pp2_ep2_deepseek_grouped_first_dense_sequence": (
        4,
        "gpt2",
        dict(pp=2, ep=2),
        "sequence",
        {**DEEPSEEK, **PATTERN},
    ),
}


def bias_snapshot(chunks) -> dict[str, torch.Tensor]:
    return {n: b.clone() for chunk in chunks for n, b in chunk.named_buffers() if n.endswith("expert_bias")}


def train_fine(cfg: GPTConfig, mesh, scope: str, chunks, named, train, serial) -> list:
    """moe_cases.train_against_serial with the expert bias compared after every step, and
    proved to move when the config updates it. Returns every step's StepResult pair."""
    results = train_against_serial(cfg, mesh, scope, chunks, named, train, serial, bias_every_step=True)
    if cfg.router_bias_update_rate > 0 and not any(bool(b.any()) for b in bias_snapshot([serial[0]]).values()):
        raise AssertionError("the serial expert bias never moved: the case does not test its updates")
    return results


def check_binding(cfg: GPTConfig, results, group_limited) -> None:
    """What the case claims to test changed something: the group limit some token's choice,
    the capacity some (token, expert) pair (serial and parallel dropped the same fraction)."""
    if group_limited is not None and group_limited[0] == 0:
        raise AssertionError("the group limit changed no token's choice: the grouped case tests nothing")
    if cfg.capacity_factor is not None:
        dropped = sum(float(layer.dropped_fraction) for _, ref_out in results for layer in ref_out.moe_layers)
        if dropped == 0:
            raise AssertionError("capacity dropped no pair: the capacity case tests nothing")


def check_fine_layout(name: str) -> None:
    world, arch, par, scope, cf, extra, chunks = LAYOUTS[name]
    cfg = fine_config(arch, scope, cf, **extra)
    mesh = build_mesh(ParallelConfig(**par), cfg)
    model, reducer, optimizer = build(cfg, mesh, ExecutionConfig(moe_dispatch_chunks=chunks))
    if chunks > 1:
        assert all(m.dispatch_chunk_count(2) == chunks for m in model.moe_layers())
    serial = build(cfg, single_process_mesh(), UNFUSED)
    ref = serial[0]
    group_limited = count_group_limited_choices(ref) if cfg.router_groups else None

    batch = mesh.dp_size * MICRO * MICRO_PER_RANK
    inputs, _ = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, batch, batch)[0]
    full_inputs, _ = global_batch(cfg, 0, batch)
    with torch.no_grad():
        got = model.full_logits(model(inputs))
        want = ref.full_logits(ref(full_inputs))
    rows = slice(mesh.dp_rank * inputs.shape[0], (mesh.dp_rank + 1) * inputs.shape[0])
    assert_close("logits", got, want[rows])

    results = train_fine(
        cfg,
        mesh,
        scope,
        [model],
        list(model.named_parameters()),
        lambda mine: train_step(model, reducer, optimizer, mine, mesh, lr=LR, max_grad_norm=1.0),
        serial,
    )
    check_binding(cfg, results, group_limited)
    reducer.remove_hooks()


def check_fine_pipeline_layout(name: str) -> None:
    world, arch, par, scope, extra = PIPELINE_LAYOUTS[name]
    cfg = fine_config(arch, scope, None, **extra)
    mesh = build_mesh(ParallelConfig(**par, schedule="1f1b"), cfg)
    chunks, named, reducer, optimizer, executor = build_pipeline(cfg, mesh, MICRO)
    serial = build(cfg, single_process_mesh(), UNFUSED)
    group_limited = count_group_limited_choices(serial[0]) if cfg.router_groups else None
    results = train_fine(
        cfg,
        mesh,
        scope,
        chunks,
        named,
        lambda mine: pipeline_train_step(
            chunks, reducer, optimizer, mine, mesh, executor, schedule="1f1b", lr=LR, max_grad_norm=1.0
        ),
        serial,
    )
    check_binding(cfg, results, group_limited)
    reducer.remove_hooks()


def _register(layouts: dict, check) -> None:
    for name in layouts:

        def case(name=name) -> None:
            check(name)

        case.__name__ = name
        globals()[name] = case


_register(LAYOUTS, check_fine_layout)
_register(PIPELINE_LAYOUTS, check_fine_pipeline_layout)


def cases_for_world(world_size: int) -> list[str]:
    return [
        name for layouts in (LAYOUTS, PIPELINE_LAYOUTS) for name, layout in layouts.items() if layout[0] == world_size
    ]
