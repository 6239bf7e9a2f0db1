"""Parallel == serial cases for multi-token prediction (models/mtp.py, model.mtp_depths=2), run
inside one gloo world by the harness, as dense_cases' `check_layout`: logits, loss, the MTP
losses per depth, grad norm, every gradient (all-gathered to full shape) after the first step
and every weight after 3 AdamW steps agree with the single-process model to 1e-5.

Layouts: tp=2 with and without sequence parallelism (the replicated projection's gradient is
summed over tp under SP), dp=2 with packed documents (the per-depth label counts are global),
a MoE main model at tp=2 SP (the depths are MoE blocks), pp=2 with the depths on the last
stage, untied (the last stage holds a copy of the embedding for the shifted tokens, summed
with the first stage's like a tied embedding) and tied, and context parallelism: cp=2 ring and
a2a, tied and untied, with and without packed documents, and (world 4) cp=2 x tp=2 with SP,
cp=2 x pp=2 and a DeepSeek-shaped model (latent attention, MoE with ep=2) at cp=2 with packed
documents (the depths' shifted ids and labels cut from the full sequences before the cp split).
"""

from __future__ import annotations

import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.training.step import pipeline_train_step, train_step
from tests.distributed.dense_cases import (
    FAMILIES,
    LR,
    STEPS,
    UNFUSED,
    assert_close,
    build,
    check_layout,
    compare_parameters,
    global_batch,
    microbatches,
)


def mtp_model_config(tie: bool, moe: bool = False, num_layers: int = 2, mla: bool = False) -> GPTConfig:
    extra = dict(num_experts=4, top_k=2, moe_ffn_hidden_size=16, aux_loss_coef=0.01, z_loss_coef=0.001) if moe else {}
    if mla:  # DeepSeek's latent attention (dense_cases.FAMILIES["mla"])
        extra.update(FAMILIES["mla"])
    base = dict(
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
    )
    return GPTConfig(**{**base, **extra})


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


def check_mtp_pipeline(tie: bool, schedule: str = "1f1b", micro: int = 4, cp: int = 1) -> None:
    """pp = world size / `cp`: the MTP depths on the last stage (under cp their cut inputs and
    labels reach it with the forward keywords); `micro` microbatches of one sequence."""
    from tests.distributed.pipeline_cases import build_pipeline

    cfg = mtp_model_config(tie, num_layers=4)
    pp = torch.distributed.get_world_size() // cp
    mesh = build_mesh(ParallelConfig(pp=pp, schedule=schedule, cp=cp), cfg)
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


def check_mtp_cp(
    comm: str,
    *,
    tie: bool = False,
    docs: bool = False,
    tp: int = 1,
    sp: bool = False,
    moe: bool = False,
    mla: bool = False,
    ep: int = 1,
) -> None:
    """cp=2 over `comm` (x `tp`, dp = the rest of the world) against the serial model, both on
    microbatches of one sequence: the StepResult keys of every step (loss, grad norm, the MTP
    loss and each depth's), every gradient after the first step and every weight after STEPS
    AdamW steps; `docs`: an id of the first batch ends documents (position 5: the depths' label
    chains cross the cp chunk border at 4 and stop at the document's end); `moe`, `mla`, `ep`:
    a DeepSeek-shaped model (MoE blocks, experts over `ep`; latent attention)."""
    cfg = mtp_model_config(tie, moe=moe, mla=mla)
    mesh = build_mesh(ParallelConfig(tp=tp, sp=sp, cp=2, cp_comm=comm, ep=ep), cfg)
    assert mesh.cp_size == 2 and mesh.tp_size == tp
    eos_id = int(global_batch(cfg, 0)[0][0, 5]) if docs else None
    model, reducer, optimizer = build(cfg, mesh)
    serial_mesh = single_process_mesh()
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh, UNFUSED)
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        mine = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1)
        out = train_step(model, reducer, optimizer, mine, mesh, lr=LR, max_grad_norm=1.0, eos_id=eos_id)
        serial = microbatches(cfg, step, 0, 1, 1)
        ref_out = train_step(
            ref, ref_reducer, ref_optimizer, serial, serial_mesh, lr=LR, max_grad_norm=1.0, eos_id=eos_id
        )
        _compare_step(step, out, ref_out, moe)
        if step == 0:
            compare_parameters(model.named_parameters(), ref_params, mesh, cfg, "grad")
    compare_parameters(model.named_parameters(), ref_params, mesh, cfg, f"weight after {STEPS} steps")
    reducer.remove_hooks()


def mtp_untied_cp2_ring_pp2() -> None:
    check_mtp_pipeline(tie=False, cp=2)


def mtp_untied_cp2_ring() -> None:
    check_mtp_cp("ring")


def mtp_untied_cp2_ring_docs() -> None:
    check_mtp_cp("ring", docs=True)


def mtp_tied_cp2_a2a() -> None:
    check_mtp_cp("a2a", tie=True)


def mtp_untied_cp2_a2a_docs() -> None:
    check_mtp_cp("a2a", docs=True)


def mtp_untied_cp2_ring_tp2_sp_docs() -> None:
    check_mtp_cp("ring", docs=True, tp=2, sp=True)


def mtp_tied_cp2_a2a_tp2_sp() -> None:
    check_mtp_cp("a2a", tie=True, tp=2, sp=True)


def mtp_deepseek_like_cp2_ring_ep2_docs() -> None:
    """Latent attention, MoE blocks with their experts over ep=2 (dp=2) and MTP depths, under
    cp=2 ring with packed documents: the layout DeepSeek-V3-shaped runs combine."""
    check_mtp_cp("ring", docs=True, moe=True, mla=True, ep=2)


def mtp_cp2_needs_the_step_cut() -> None:
    """A direct forward under cp without the depths' full-sequence cut (`mtp_inputs`,
    `mtp_labels`) is refused in one line naming the fields."""
    from meshtron.models.gpt import GPT

    cfg = mtp_model_config(False)
    model = GPT(cfg, build_mesh(ParallelConfig(cp=2), cfg), execution=ExecutionConfig())
    ids = global_batch(cfg, 0, 1)[0][:, : cfg.seq_len // 2]
    try:
        model(ids, targets=ids)
    except ValueError as err:
        assert "mtp_depths" in str(err) and "parallel.cp" in str(err) and "\n" not in str(err), err
    else:
        raise AssertionError("MTP under cp=2 without mtp_inputs was not refused")


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 4:
        return [
            "mtp_untied_cp2_ring_tp2_sp_docs",
            "mtp_tied_cp2_a2a_tp2_sp",
            "mtp_untied_cp2_ring_pp2",
            "mtp_deepseek_like_cp2_ring_ep2_docs",
        ]
    if world_size != 2:
        return []
    return [
        "mtp_untied_tp2_sp",
        "mtp_tied_tp2_nosp",
        "mtp_untied_dp2_packed",
        "mtp_moe_tp2_sp",
        "mtp_untied_pp2",
        "mtp_tied_pp2",
        "mtp_untied_cp2_ring",
        "mtp_untied_cp2_ring_docs",
        "mtp_tied_cp2_a2a",
        "mtp_untied_cp2_a2a_docs",
        "mtp_cp2_needs_the_step_cut",
    ]
