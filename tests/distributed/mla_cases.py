"""Parallel == serial cases for multi-head latent attention (models/mla.py, model.attention=mla),
run inside one gloo world by the harness, as dense_cases' `check_layout`: the parallel model
and the serial one (world of one) get the same global batch; logits, loss, every gradient
(all-gathered to full shape) after the first step and every weight after 3 AdamW steps agree
to 1e-5 (relative, tensor-level).

The model: Llama-shaped, 2 layers, hidden 64, 4 heads, q rank 24 (or a plain q), kv rank 16,
nope 8, rope 4, v 12, YaRN with mscale (so the softmax scale is not the default one). At tp=2
the heads split 2 + 2, and the replicated down projections and latent norms get partial
gradients per rank that must be summed over tp (planted: dropping that tag fails the grads).
"""

from __future__ import annotations

import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.training.step import train_step
from tests.distributed.dense_cases import (
    GLOBAL_BATCH,
    LR,
    STEPS,
    UNFUSED,
    assert_close,
    build,
    compare_parameters,
    global_batch,
    microbatches,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.8}


def mla_model_config(q_lora_rank: int | None = 24) -> GPTConfig:
    return GPTConfig(
        arch="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        ffn_hidden_size=48,
        vocab_size=200,
        seq_len=16,
        tie_embeddings=False,
        attention="mla",
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        rope_theta=100.0,
        rope_scaling=YARN,
    )


def check_mla_layout(tp: int, sp: bool, micro: int = 1, q_lora_rank: int | None = 24, recompute: str = "none") -> None:
    """One layout (dp = world / tp) against the serial model, dense_cases.check_layout's checks."""
    cfg = mla_model_config(q_lora_rank)
    mesh = build_mesh(ParallelConfig(tp=tp, sp=sp), cfg)
    serial_mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh, ExecutionConfig(recompute=recompute))
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh, UNFUSED)

    inputs, _ = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, GLOBAL_BATCH)[0]
    full_inputs, _ = global_batch(cfg, 0)
    with torch.no_grad():
        got = model.full_logits(model(inputs))
        want = ref.full_logits(ref(full_inputs))
    rows = slice(mesh.dp_rank * inputs.shape[0], (mesh.dp_rank + 1) * inputs.shape[0])
    assert_close("logits", got, want[rows])

    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for step in range(STEPS):
        batches = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, micro)
        out = train_step(model, reducer, optimizer, batches, mesh, lr=LR, max_grad_norm=1.0)
        ref_batches = microbatches(cfg, step, 0, 1, GLOBAL_BATCH)
        ref_out = train_step(ref, ref_reducer, ref_optimizer, ref_batches, serial_mesh, lr=LR, max_grad_norm=1.0)
        assert_close(f"step {step} loss", out.loss, ref_out.loss)
        assert_close(f"step {step} grad_norm", out.grad_norm, ref_out.grad_norm)
        if step == 0:
            compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, "grad")
    compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, f"weight after {STEPS} steps")
    reducer.remove_hooks()


def mla_tp2_nosp() -> None:
    check_mla_layout(2, False)


def mla_tp2_sp() -> None:
    check_mla_layout(2, True)


def mla_tp2_sp_mb2_plain_q() -> None:
    check_mla_layout(2, True, micro=2, q_lora_rank=None)


def mla_tp2_sp_selective() -> None:
    check_mla_layout(2, True, recompute="selective")


def mla_tp2_nosp_full() -> None:
    check_mla_layout(2, False, recompute="full")


def mla_tp1_dp2() -> None:
    check_mla_layout(1, False)


def cases_for_world(world_size: int) -> list[str]:
    if world_size != 2:
        return []
    return [
        "mla_tp2_nosp",
        "mla_tp2_sp",
        "mla_tp2_sp_mb2_plain_q",
        "mla_tp2_sp_selective",
        "mla_tp2_nosp_full",
        "mla_tp1_dp2",
    ]
