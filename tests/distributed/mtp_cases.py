"""Parallel == serial cases for multi-token prediction (models/mtp.py, model.mtp_depths=2), run
inside one gloo world by the harness, as dense_cases' `check_layout`: logits, loss, the MTP
losses per depth, grad norm, every gradient (all-gathered to full shape) after the first step
and every weight after 3 AdamW steps agree with the single-process model to 1e-5.

Layouts: tp=2 with and without sequence parallelism (the replicated projection's gradient is
summed over tp under SP), dp=2 with packed documents (the per-depth label counts are global),
a MoE main model at tp=2 SP (the depths are MoE blocks), and pp=2 with the depths on the last
stage, untied (the last stage holds a copy of the embedding for the shifted tokens, summed
with the first stage's like a tied embedding) and tied.
"""

from __future__ import annotations

import dataclasses

import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.training.step import pipeline_train_step, train_step
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


def mtp_model_config(tie: bool, moe: bool = False, num_layers: int = 2) -> GPTConfig:
    extra = dict(num_experts=4, top_k=2, moe_ffn_hidden_size=16, aux_loss_coef=0.01, z_loss_coef=0.001) if moe else {}
    return GPTConfig(
        arch="llama",
        num_layers=num_layers,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        vocab_size=200,
        seq_len=16,
        tie_embeddings=tie,
        mtp_depths=2,
        mtp_loss_weight=0.3,
        **extra,
    )


def _compare_step(step: int, out, ref_out, moe: bool) -> None:
    for key in ("loss", "grad_norm", "mtp_loss", "mtp_depth_losses") + (("aux_loss", "z_loss") if moe else ()):
        assert_close(f"step {step} {key}", getattr(out, key), getattr(ref_out, key))


def check_mtp_layout(tp: int, sp: bool, tie: bool, moe: bool = False, packed: bool = False) -> None:
    """One pp=1 layout (dp = world / tp) against the serial model."""
    cfg = mtp_model_config(tie, moe)
    mesh = build_mesh(ParallelConfig(tp=tp, sp=sp), cfg)
    serial_mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh)
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh, UNFUSED)
    # packed documents: an id that occurs in the first batch ends documents
    eos_id = int(global_batch(cfg, 0)[0][0, 5]) if packed else None

    inputs, _ = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, GLOBAL_BATCH)[0]
    full_inputs, _ = global_batch(cfg, 0)
    with torch.no_grad():
        got = model.full_logits(model(inputs))
        want = ref.full_logits(ref(full_inputs))
    rows = slice(mesh.dp_rank * inputs.shape[0], (mesh.dp_rank + 1) * inputs.shape[0])
    assert_close("logits", got, want[rows])

    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for step in range(STEPS):
        batches = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1)
        out = train_step(model, reducer, optimizer, batches, mesh, lr=LR, max_grad_norm=1.0, eos_id=eos_id)
        # the same microbatches of one sequence (MoE statistics are per microbatch)
        ref_batches = microbatches(cfg, step, 0, 1, 1)
        ref_out = train_step(
            ref, ref_reducer, ref_optimizer, ref_batches, serial_mesh, lr=LR, max_grad_norm=1.0, eos_id=eos_id
        )
        _compare_step(step, out, ref_out, moe)
        if step == 0:
            compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, "grad")
    compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, f"weight after {STEPS} steps")
    reducer.remove_hooks()


def check_mtp_pipeline(tie: bool, schedule: str = "1f1b", micro: int = 4) -> None:
    """pp = world size: the MTP depths on the last stage; `micro` microbatches of one sequence."""
    from tests.distributed.pipeline_cases import build_pipeline

    cfg = mtp_model_config(tie, num_layers=4)
    pp = torch.distributed.get_world_size()
    mesh = build_mesh(ParallelConfig(pp=pp, schedule=schedule), cfg)
    chunks, named, reducer, optimizer, executor = build_pipeline(cfg, mesh, 1)
    last = chunks[-1]
    if mesh.pp_rank == pp - 1:
        assert last.mtp is not None and last.embed is not None and last.embed.weight.tied_embedding_copy
    else:
        assert chunks[0].mtp is None
    serial_mesh = single_process_mesh()
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh, UNFUSED)
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        inputs, targets = global_batch(cfg, step, micro)
        mine = [(inputs[j : j + 1], targets[j : j + 1]) for j in range(micro)]
        out = pipeline_train_step(
            chunks, reducer, optimizer, mine, mesh, executor, schedule=schedule, lr=LR, max_grad_norm=1.0
        )
        ref_out = train_step(ref, ref_reducer, ref_optimizer, mine, serial_mesh, lr=LR, max_grad_norm=1.0)
        _compare_step(step, out, ref_out, False)
        if step == 0:
            compare_parameters(named, ref_params, mesh, cfg, "grad")
    compare_parameters(named, ref_params, mesh, cfg, f"weight after {STEPS} steps")
    reducer.remove_hooks()


def mtp_untied_tp2_sp() -> None:
    check_mtp_layout(2, True, tie=False)


def mtp_tied_tp2_nosp() -> None:
    check_mtp_layout(2, False, tie=True)


def mtp_untied_dp2_packed() -> None:
    check_mtp_layout(1, False, tie=False, packed=True)


def mtp_moe_tp2_sp() -> None:
    check_mtp_layout(2, True, tie=False, moe=True)


def mtp_untied_pp2() -> None:
    check_mtp_pipeline(tie=False)


def mtp_tied_pp2() -> None:
    check_mtp_pipeline(tie=True)


def mtp_cp2_refused() -> None:
    """Context parallelism is refused in one line (the shifted tokens cross cp shards)."""
    from meshtron.errors import ConfigError
    from meshtron.models.gpt import GPT

    cfg = dataclasses.replace(mtp_model_config(False), sliding_window=None)
    mesh = build_mesh(ParallelConfig(cp=2), cfg)
    try:
        GPT(cfg, mesh, execution=ExecutionConfig())
    except ConfigError as err:
        assert "mtp_depths" in str(err) and "\n" not in str(err), err
    else:
        raise AssertionError("MTP with cp=2 was not refused")


def cases_for_world(world_size: int) -> list[str]:
    if world_size != 2:
        return []
    return [
        "mtp_untied_tp2_sp",
        "mtp_tied_tp2_nosp",
        "mtp_untied_dp2_packed",
        "mtp_moe_tp2_sp",
        "mtp_untied_pp2",
        "mtp_tied_pp2",
        "mtp_cp2_refused",
    ]
