"""`shrink_model` (training/verify.py) keeps the features of the families a user verifies:
Qwen3's kv_channels and qk_norm, Qwen2's qkv_bias, Llama 3's and YaRN's rope-scaling bands,
sliding windows, multi-head latent attention, fine-grained MoE with group-limited routing,
scaling factor and shared experts, dense-layer patterns and multi-token prediction; the shrunk
model fits the layout. In process, no workers (fast)."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.models.config import GPTConfig
from meshtron.models.fits import check_model_fits
from meshtron.mpu.mesh import ParallelConfig
from meshtron.training.verify import HEAD_DIM, describe_model, rope_bands, shrink_model

LLAMA = dict(arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336)
LLAMA.update(vocab_size=128256, seq_len=8192, rope_theta=500000.0, tie_embeddings=False)
DEEPSEEK = dict(
    arch="llama",
    num_layers=61,
    hidden_size=7168,
    num_heads=128,
    ffn_hidden_size=18432,
    vocab_size=129280,
    seq_len=4096,
    attention="mla",
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=256,
    top_k=8,
    moe_first_dense=3,
    moe_ffn_hidden_size=2048,
    router_score="sigmoid",
    router_groups=8,
    router_topk_groups=4,
    router_scaling_factor=2.5,
    router_bias_update_rate=0.001,
    shared_experts=1,
    mtp_depths=1,
    tie_embeddings=False,
)


def shrink(cfg: GPTConfig, world: int = 1, **par) -> GPTConfig:
    layout = ParallelConfig(**par).resolved(world)
    small, small_par = shrink_model(cfg, layout)
    check_model_fits(small_par, small)
    describe_model(small, small_par)  # prints every feature without raising
    return small


def test_qwen3_kv_channels_and_qk_norm():
    """kv_channels twice hidden / heads stays twice it; equal stays equal (kept set)."""
    qwen3 = GPTConfig(**dict(LLAMA, num_kv_heads=8, kv_channels=256, hidden_size=4096), qk_norm=True)
    small = shrink(qwen3, 2, tp=2)
    assert small.qk_norm and small.kv_channels == 2 * HEAD_DIM == 2 * small.hidden_size // small.num_heads
    same = shrink(dataclasses.replace(qwen3, kv_channels=128))
    assert same.kv_channels == HEAD_DIM == small.hidden_size // small.num_heads
    narrow = shrink(dataclasses.replace(qwen3, kv_channels=96))  # 0.75 x: rounds to 8, kept != hidden/heads
    assert narrow.kv_channels != narrow.hidden_size // narrow.num_heads and narrow.kv_channels % 2 == 0


def test_qwen2_qkv_bias_and_flags_copied():
    qwen2 = GPTConfig(**LLAMA, bias=False, qkv_bias=True, norm_eps=1e-6, init_std=0.01)
    small = shrink(qwen2)
    assert (small.bias, small.qkv_bias, small.norm_eps, small.init_std, small.rope_theta) == (
        False,
        True,
        1e-6,
        0.01,
        500000.0,
    )


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0},
        {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    ],
)
def test_rope_scaling_keeps_every_band(scaling):
    """original_max_position_embeddings rescaled so the shrunk rope dims still fall in all
    three bands (kept, mixed, scaled); the other keys copied."""
    big = GPTConfig(**LLAMA, rope_scaling=dict(scaling, original_max_position_embeddings=8192))
    assert rope_bands(big) == {"kept", "mixed", "scaled"}
    small = shrink(big)
    assert rope_bands(small) == {"kept", "mixed", "scaled"}, small.rope_scaling
    assert {k: v for k, v in small.rope_scaling.items() if k != "original_max_position_embeddings"} == scaling
    assert isinstance(small.rope_scaling["original_max_position_embeddings"], int)


def test_sliding_window_stays_shorter_than_seq():
    mistral = GPTConfig(**dict(LLAMA, seq_len=32768), sliding_window=4096)
    small = shrink(mistral, 4, cp=2, cp_comm="a2a", tp=2)
    assert small.attention_window is not None and 1 < small.sliding_window < small.seq_len
    full = shrink(dataclasses.replace(mistral, sliding_window=65536))  # never restricts: stays so
    assert full.sliding_window is not None and full.attention_window is None


def test_mla_dims_and_ranks():
    """q_lora_rank null or not as it was, the rope dim even, v as wide as nope or not."""
    big = GPTConfig(**DEEPSEEK)
    small = shrink(big, 2, tp=2, ep=2)
    assert small.attention == "mla" and small.num_kv_heads == small.num_heads and small.num_heads % 2 == 0
    assert small.q_lora_rank is not None and small.kv_lora_rank < big.kv_lora_rank
    assert (small.qk_nope_head_dim, small.qk_rope_head_dim, small.v_head_dim) == (HEAD_DIM, HEAD_DIM // 2, HEAD_DIM)
    lite = shrink(dataclasses.replace(big, q_lora_rank=None, v_head_dim=192))
    assert lite.q_lora_rank is None and lite.v_head_dim != lite.qk_nope_head_dim
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}
    scaled = shrink(dataclasses.replace(big, rope_scaling=yarn, seq_len=163840))
    assert scaled.qk_rope_head_dim % 2 == 0 and rope_bands(scaled) == {"kept", "mixed", "scaled"}


def test_fine_grained_moe_routing():
    """256 experts top-8 in 4 of 8 groups: fewer experts, still divided by the groups and ep,
    top_k // topk_groups kept; scaling factor, sigmoid score, bias rate, shared experts copied."""
    big = GPTConfig(**DEEPSEEK)
    small = shrink(big, 4, tp=2, ep=4)
    assert small.num_experts < big.num_experts and small.num_experts % small.router_groups == 0
    assert small.num_experts % 4 == 0 and small.top_k == 8
    assert (small.router_groups, small.router_topk_groups) == (8, 4)
    assert small.top_k // small.router_topk_groups == 2 <= small.num_experts // small.router_groups
    assert (small.router_score, small.router_scaling_factor, small.router_bias_update_rate) == ("sigmoid", 2.5, 0.001)
    assert small.shared_experts == 1 and small.moe().shared_width % 2 == 0
    qwen3_moe = GPTConfig(**dict(LLAMA, num_experts=128, top_k=8, moe_ffn_hidden_size=768), kv_channels=128)
    small = shrink(qwen3_moe, 2, ep=2)
    assert (small.num_experts, small.top_k, small.router_groups) == (16, 8, 0)


def test_shared_expert_gate_and_width():
    """Qwen2-MoE: a gated shared expert of its own width (scaled, divisible by tp)."""
    qwen2_moe = GPTConfig(
        **dict(LLAMA, num_experts=60, top_k=4, moe_ffn_hidden_size=1408),
        shared_experts=1,
        shared_ffn_hidden_size=5632,
        shared_expert_gate=True,
    )
    small = shrink(qwen2_moe, 2, tp=2)
    assert small.shared_expert_gate and small.shared_ffn_hidden_size % 2 == 0
    ratio = qwen2_moe.shared_ffn_hidden_size / qwen2_moe.hidden_size
    assert abs(small.shared_ffn_hidden_size / small.hidden_size - ratio) < 0.1


@pytest.mark.parametrize(
    "pattern, world, par",
    [
        (dict(moe_first_dense=3), 1, {}),
        (dict(moe_first_dense=3), 4, dict(pp=4)),
        (dict(moe_dense_layers=[1]), 2, dict(ep=2)),
        (dict(moe_dense_layers=[0, 1, 2, 3, 4, 5, 6]), 1, {}),
        (dict(moe_first_dense=1, moe_every=2), 2, dict(pp=2, stage_layers=[10, 20])),
    ],
)
def test_dense_layer_patterns_keep_both_kinds(pattern, world, par):
    big = GPTConfig(**dict(LLAMA, num_experts=8, top_k=2), **pattern)
    small = shrink(big, world, **par)
    kinds = [small.is_moe_layer(i) for i in range(small.num_layers)]
    assert set(kinds) == {True, False}, (small.num_layers, pattern)  # dense and MoE layers both
    if "moe_first_dense" in pattern:
        assert small.moe_first_dense >= 1 and not kinds[0]
    if "moe_dense_layers" in pattern:
        assert small.moe_dense_layers and all(0 <= i < small.num_layers for i in small.moe_dense_layers)


def test_mtp_depths_kept():
    for depths, kept in ((1, 1), (2, 2), (3, 2)):
        small = shrink(GPTConfig(**LLAMA, mtp_depths=depths, mtp_loss_weight=0.1), 2, pp=2)
        assert (small.mtp_depths, small.mtp_loss_weight) == (kept, 0.1)
