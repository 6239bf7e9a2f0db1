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
    LR,
    STEPS,
    UNFUSED,
    assert_close,
    build,
    check_layout,
    compare_parameters,
    global_batch,
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


def _keys(moe: bool) -> tuple[str, ...]:
    return ("loss", "grad_norm", "mtp_loss", "mtp_depth_losses") + (("aux_loss", "z_loss") if moe else ())


def _compare_step(step: int, out, ref_out, moe: bool) -> None:
    for key in _keys(moe):
        assert_close(f"step {step} {key}", getattr(out, key), getattr(ref_out, key))


def check_mtp_layout(tp: int, sp: bool, tie: bool, moe: bool = False, packed: bool = False) -> None:
    """One pp=1 layout (dp = world / tp) against the serial model (dense_cases.check_layout),
    both on microbatches of one sequence (MoE statistics are per microbatch); `packed`: an id
    of the first batch ends documents."""
    cfg = mtp_model_config(tie, moe)
    eos_id = int(global_batch(cfg, 0)[0][0, 5]) if packed else None
    check_layout("mtp", tp, sp, 1, cfg=cfg, serial_micro=1, eos_id=eos_id, keys=_keys(moe))


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
