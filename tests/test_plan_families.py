"""The planner on the Hugging Face families' attention (issue 39): heads of a width of their own
(model.kv_channels: Qwen3, the attention num_heads x head_dim wide, not hidden_size), QK-norm and
q/k/v biases. Planned saved activations equal a real forward's to the byte, as
tests/test_memory_plan.py's cases do; the FLOP terms (model_flops_per_token, the step-time
model's selective-recompute replay) equal torch's FLOP counter on the real model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import ParallelConfig, virtual_mesh
from meshtron.planning.activations import saved_activation_bytes
from meshtron.planning.flops import (
    attention_core_flops_per_token,
    attention_width,
    model_flops_per_token,
    param_count,
    params_per_rank,
)
from meshtron.planning.plan import chunk_activations
from meshtron.planning.step_time import Layout, cluster_preset, compute_time, step_time


def qwen3_like(**kw) -> GPTConfig:
    """h=64, a=4 heads of d=24 (attention 96 wide != h), g=2 kv heads, QK-norm, f=160, V=300
    (padded 384 / 512), s=16: every shape that hidden / heads would get wrong differs."""
    args = dict(
        arch="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        kv_channels=24,
        qk_norm=True,
        ffn_hidden_size=160,
        vocab_size=300,
        seq_len=16,
        tie_embeddings=False,
    )
    return GPTConfig(**{**args, **kw})


SHAPES = [
    # (config, recompute, micro batch, tp)
    (qwen3_like(), "none", 2, 1),
    (qwen3_like(attention_dropout=0.1), "selective", 2, 1),  # the CPU math path: [a, s, s] saved
    (qwen3_like(kv_channels=32, seq_len=32), "full", 3, 1),
    (qwen3_like(), "none", 2, 2),
    (qwen3_like(kv_channels=None, qk_norm=False, qkv_bias=True, bias=False), "selective", 2, 2),  # Qwen2
]


@pytest.mark.parametrize("cfg,recompute,micro,tp", SHAPES)
def test_saved_activations_equal_measured(cfg, recompute, micro, tp):
    """The planner's traced bytes equal a real forward's to the byte, on every tp rank."""
    execution = ExecutionConfig(recompute=recompute)
    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    for rank in range(tp):
        (model,) = init_model_chunks(cfg, virtual_mesh(ParallelConfig(tp=tp), tp, rank), 0, execution=execution)
        model.train()
        measured = saved_activation_bytes(model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        planned = chunk_activations(
            cfg,
            micro,
            layers=range(cfg.num_layers),
            pre_process=True,
            post_process=True,
            tp=tp,
            tp_rank=rank,
            execution=execution,
        ).saved
        assert planned == measured, (recompute, tp, rank)


def test_head_width_changes_the_saved_bytes():
    """The case above is sensitive: the same model with heads hidden / heads wide saves less."""
    cfg = qwen3_like()
    narrow = dataclasses.replace(cfg, kv_channels=None)
    chunk = dict(layers=range(2), pre_process=True, post_process=True)
    assert (
        chunk_activations(cfg, 2, **chunk).terms["layer_attn"]
        > chunk_activations(narrow, 2, **chunk).terms["layer_attn"]
    )


def _measured_flops(cfg: GPTConfig, recompute: str, micro: int) -> int:
    """torch's FLOP count of one forward + backward (CPU math attention: matmuls and bmm)."""
    (model,) = init_model_chunks(
        cfg,
        virtual_mesh(ParallelConfig(), 1, 0),
        0,
        execution=ExecutionConfig(recompute=recompute, fused_lm_loss=False),
    )
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    return counter.get_total_flops()


def test_flops_and_selective_replay_equal_torchs_count():
    """model_flops_per_token x tokens is torch's count of a training step (attention dropout on:
    the math path, whose q k^T and p v are counted bmm's, over the full s x s square), and the
    FLOPs selective recompute adds are the attention core's forward 4*s*a*d per token per layer
    with a*d = 96 (h = 64 in its place would be a third short); the step-time model replays exactly that."""
    cfg = qwen3_like(attention_dropout=0.1, vocab_size=256)  # 256: no padded vocabulary rows
    micro, tokens = 2, 2 * cfg.seq_len
    assert attention_width(cfg) == 96 != cfg.hidden_size
    none = _measured_flops(cfg, "none", micro)
    assert model_flops_per_token(cfg) * tokens == none
    replay = _measured_flops(cfg, "selective", micro) - none
    assert attention_core_flops_per_token(cfg) == 4 * cfg.seq_len * 96
    assert replay == cfg.num_layers * attention_core_flops_per_token(cfg) * tokens

    cluster = cluster_preset("h100", 1, 1)
    modelled = {
        mode: step_time(
            cfg,
            Layout(recompute=mode, micro_batch_size=micro),
            cluster,
            global_batch_size=micro,
            grad_elements={"dp": param_count(cfg)["total"]},
        ).compute_per_microbatch
        for mode in ("none", "selective")
    }
    assert modelled["selective"] - modelled["none"] == pytest.approx(compute_time(replay, cluster), rel=1e-12)


def test_qk_norm_and_qkv_bias_parameters_are_the_built_models():
    """QK-norm: two weights of head_dim per layer, replicated over tp; q/k/v bias: the fused QKV's
    rows, split over tp. Counted exactly (the meta-built model), at tp 1 and 2."""
    for cfg in (qwen3_like(), qwen3_like(kv_channels=None, qk_norm=False, qkv_bias=True, bias=False)):
        for tp in (1, 2):
            for rank in range(tp):
                (model,) = init_model_chunks(cfg, virtual_mesh(ParallelConfig(tp=tp), tp, rank), 0, device="meta")
                built = sum(p.numel() for p in model.parameters())
                assert params_per_rank(cfg, tp=tp) == built, (cfg.qk_norm, tp)
