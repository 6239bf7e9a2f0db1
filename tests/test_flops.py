"""Hand-checked FLOP and parameter counts (planning/flops.py); the model states and activation
properties that flops.py's second memory model was checked for, now against planning/plan.py's."""

from __future__ import annotations

import pytest

from meshtron.models.config import GPTConfig
from meshtron.models.gpt import GPT
from meshtron.mpu.mesh import ParallelConfig, single_process_mesh
from meshtron.planning.flops import model_flops_per_token, param_count, params_per_rank
from meshtron.planning.plan import chunk_activations, meta_param_counts, model_state_bytes


def gpt2_tiny(**kw) -> GPTConfig:
    # h=64, a=4, f=256, V=256 (already a multiple of 128), s=32, LayerNorm with bias, tied.
    args = dict(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=256, seq_len=32, arch="gpt2")
    return GPTConfig(**{**args, **kw})


def llama_gqa_tiny(**kw) -> GPTConfig:
    # h=64, a=4, g=2 kv heads, d=16, f=160, V=300 -> padded 384, s=16, RMSNorm, no bias, untied.
    args = dict(
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=160,
        vocab_size=300,
        seq_len=16,
        arch="llama",
        tie_embeddings=False,
    )
    return GPTConfig(**{**args, **kw})


def moe_tiny(**kw) -> GPTConfig:
    # Llama flavour, h=32, a=4, f=64, V=128, s=8; layer 1 (of 0, 1) is MoE (moe_every=2):
    # 4 experts of F=48, top_k=2, 1 shared expert; tied embeddings.
    args = dict(
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        vocab_size=128,
        seq_len=8,
        arch="llama",
        num_experts=4,
        top_k=2,
        moe_every=2,
        moe_ffn_hidden_size=48,
        shared_experts=1,
    )
    return GPTConfig(**{**args, **kw})


# ----------------------------------------------------------------------------- params


def test_param_count_gpt2():
    wte = 256 * 64
    wpe = 32 * 64
    ln = 64 + 64  # weight + bias
    qkv = 64 * 192 + 192  # (4 + 2*4) heads * 16
    proj = 64 * 64 + 64
    fc1 = 64 * 256 + 256
    fc2 = 256 * 64 + 64
    layer = ln + qkv + proj + ln + fc1 + fc2
    assert layer == 49984
    total = wte + wpe + 2 * layer + ln  # tied head counted once, final LayerNorm
    assert total == 118528
    pc = param_count(gpt2_tiny())
    assert pc["total"] == total
    assert pc["active_per_token"] == total
    assert pc["embedding"] == wte + wpe


def test_param_count_llama_gqa_untied():
    vocab = 384  # 300 padded to a multiple of 128
    emb = vocab * 64
    norm = 64  # RMSNorm: weight only
    qkv = 64 * (4 + 2 * 2) * 16  # no bias
    proj = 64 * 64
    mlp = 3 * 64 * 160  # gate, up, down
    layer = 2 * norm + qkv + proj + mlp
    total = emb + 2 * layer + norm + emb  # untied LM head
    assert total == 135488
    assert param_count(llama_gqa_tiny())["total"] == total


def test_param_count_llama_with_bias_and_layernorm():
    cfg = llama_gqa_tiny(bias=True, norm="layernorm")
    base = param_count(llama_gqa_tiny())["total"]
    # Every norm (5) gains a bias of h; QKV bias 128, proj bias 64, gate+up bias 2*160, down bias 64.
    extra = 5 * 64 + 2 * (128 + 64 + 2 * 160 + 64)
    assert param_count(cfg)["total"] == base + extra


def test_param_count_qkv_bias_only():
    """Qwen2: the fused QKV gains its bias (128 per layer), nothing else does; the count is the
    built model's."""
    cfg = llama_gqa_tiny(qkv_bias=True)
    assert param_count(cfg)["total"] == param_count(llama_gqa_tiny())["total"] + 2 * 128
    model = GPT(cfg, single_process_mesh())
    assert param_count(cfg)["total"] == sum(p.numel() for p in model.parameters())


def test_qwen3_heads_of_their_own_width_and_qk_norm():
    """Qwen3: heads 24 wide at hidden 64 / 4 heads (model.kv_channels) change the fused QKV
    ((4 + 2*2) x 24 rows), the out proj (4 x 24 columns) and the attention FLOPs (a*d = 96 for
    h = 64); QK-norm adds two weights of 24 per layer, replicated over tp. Counts equal the
    built model's, at tp = 1 and on each of 2 ranks."""
    cfg = llama_gqa_tiny(kv_channels=24, qk_norm=True)
    h, s, f, v, ad, qkv = 64, 16, 160, 384, 4 * 24, (4 + 2 * 2) * 24
    expected = 3 * (2 * (2 * h * qkv + 4 * s * ad + 2 * ad * h + 2 * 3 * h * f) + 2 * h * v)
    assert model_flops_per_token(cfg) == expected
    base = llama_gqa_tiny()
    per_layer = h * qkv + ad * h + 2 * 24 - (h * (4 + 2 * 2) * 16 + h * h)
    assert param_count(cfg)["total"] == param_count(base)["total"] + 2 * per_layer
    assert param_count(cfg)["total"] == sum(p.numel() for p in GPT(cfg, single_process_mesh()).parameters())
    tp2 = params_per_rank(cfg, tp=2)
    assert tp2 - params_per_rank(base, tp=2) == 2 * (h * qkv // 2 + ad * h // 2 + 2 * 24 - (h * 128 // 2 + h * h // 2))


def test_param_count_moe():
    emb = 128 * 32
    attn = 2 * 32 + 32 * 96 + 32 * 32  # two RMSNorms, QKV, proj
    dense = attn + 3 * 32 * 64
    expert = 3 * 32 * 48
    moe = attn + 4 * 32 + 4 * expert + 1 * expert  # router [4, 32], 4 experts, 1 shared
    total = emb + dense + moe + 32
    assert total == 41760
    pc = param_count(moe_tiny())
    assert pc["total"] == total
    assert pc["active_per_token"] == total - (4 - 2) * expert == 32544


# ----------------------------------------------------------------------------- flops


def test_flops_gpt2():
    h, s, f, v = 64, 32, 256, 256
    qkv = 2 * h * 3 * h
    attn = 2 * s * h + 2 * s * h  # QK^T and AV over the full s x s square
    proj = 2 * h * h
    mlp = 2 * (h * f + f * h)
    head = 2 * h * v
    expected = 3 * (2 * (qkv + attn + proj + mlp) + head)
    assert expected == 737280
    assert model_flops_per_token(gpt2_tiny()) == expected


def test_flops_llama_gqa():
    h, s, f, v, d = 64, 16, 160, 384, 16
    qkv = 2 * h * (4 + 2 * 2) * d
    attn = 4 * s * h
    proj = 2 * h * h
    mlp = 2 * 3 * h * f
    head = 2 * h * v  # padded vocab
    expected = 3 * (2 * (qkv + attn + proj + mlp) + head)
    assert expected == 688128
    assert model_flops_per_token(llama_gqa_tiny()) == expected


def test_flops_moe():
    h, s, f, fm, v, e = 32, 8, 64, 48, 128, 4
    attn = 2 * h * 3 * h + 4 * s * h + 2 * h * h
    dense = attn + 2 * 3 * h * f
    moe = attn + 2 * h * e + (2 + 1) * 2 * 3 * h * fm  # router + top_k routed + 1 shared
    expected = 3 * (dense + moe + 2 * h * v)
    assert expected == 200448
    assert model_flops_per_token(moe_tiny()) == expected
    assert model_flops_per_token(moe_tiny(top_k=1)) == expected - 3 * 2 * 3 * h * fm


def test_flops_close_to_6n_plus_attention():
    # Dense, untied: 6 * matmul params + 3 * 2 * (2*s*h) per layer (attention), exactly.
    cfg = llama_gqa_tiny()
    matmul_params = param_count(cfg)["total"] - 5 * 64 - 384 * 64  # minus norms and embedding lookup
    assert model_flops_per_token(cfg) == 6 * matmul_params + 3 * 2 * 4 * 16 * 64


# ----------------------------------------------------------------------------- sharded state


def test_params_per_rank_tp_pp():
    # tp=2: embedding rows, QKV, fc1 (weight+bias), proj/fc2 weights halve; norms, wpe, row biases don't.
    layer = 2 * 128 + (12480 // 2) + (4096 // 2 + 64) + (16640 // 2) + (16384 // 2 + 64)
    assert params_per_rank(gpt2_tiny(), tp=2) == 256 // 2 * 64 + 32 * 64 + 2 * layer + 128 == 60736
    # pp=2: first stage embeddings + layer 0; last stage layer 1 + final norm + tied head copy.
    first = 256 * 64 + 32 * 64 + 49984
    last = 49984 + 128 + 256 * 64
    assert params_per_rank(gpt2_tiny(), pp=2) == max(first, last) == 68416
    assert params_per_rank(gpt2_tiny()) == param_count(gpt2_tiny())["total"]
    with pytest.raises(ValueError, match="num_heads"):
        params_per_rank(gpt2_tiny(), tp=3)


def test_params_per_rank_moe_ep():
    expert = 3 * 32 * 48
    total = param_count(moe_tiny())["total"]
    assert params_per_rank(moe_tiny(), ep=2) == total - 2 * expert
    assert params_per_rank(moe_tiny(), ep=4, etp=2) == total - 3 * expert - expert // 2
    with pytest.raises(ValueError, match="num_experts"):
        params_per_rank(moe_tiny(), ep=3)


def _states(cfg: GPTConfig, dp: int = 1, **kw) -> dict[str, int]:
    counts = meta_param_counts(cfg, ParallelConfig().resolved(dp), dp, 0)
    return model_state_bytes(counts, {"dp": dp, "tp_dp": dp, "edp": dp}, **kw)


def test_model_state_bytes():
    n = param_count(gpt2_tiny())["total"]
    fp32 = _states(gpt2_tiny())
    assert (fp32["params"], fp32["weights"], fp32["grads"], fp32["main_params"], fp32["optimizer"], fp32["total"]) == (
        n,
        4 * n,
        4 * n,
        0,
        8 * n,
        16 * n,
    )
    # bf16 autocast: fp32 main weights and grads, plus 2-byte copies of the matmul weights.
    bf16 = _states(gpt2_tiny(), precision="bf16")
    assert (bf16["weights"], bf16["grads"], bf16["main_params"], bf16["optimizer"]) == (4 * n, 4 * n, 0, 8 * n)
    assert 0 < bf16["autocast_weight_copies"] < 2 * n
    assert _states(gpt2_tiny(), dp=2, zero=1)["total"] == 4 * n + 4 * n + 4 * n
    with pytest.raises(ValueError, match="precision"):
        _states(gpt2_tiny(), precision="fp4")


# ----------------------------------------------------------------------------- activations


def saved(cfg: GPTConfig, micro: int, tp: int = 1, sp: bool = False, precision: str = "fp32") -> int:
    """The planner's saved bytes of one microbatch through the whole model on TP rank 0."""
    return chunk_activations(
        cfg, micro, layers=range(cfg.num_layers), pre_process=True, post_process=True, tp=tp, sp=sp, precision=precision
    ).saved


def test_activations_scale_with_tp_sp_and_batch():
    # 512 = multiple of 128*4: no extra padding at tp<=4; 8 query heads over 4 KV heads: tp=4 divides both
    cfg = llama_gqa_tiny(vocab_size=512, num_heads=8, num_kv_heads=4)
    base = saved(cfg, 4)
    for t in (2, 4):
        assert saved(cfg, 4, tp=t, sp=True) < saved(cfg, 4, tp=t) < base

    def per_sample(micro: int) -> int:
        """Saved bytes that scale with the batch: all but the RoPE tables (one copy per chunk) and
        the fused LM loss's fp32 weight gradient [V/tp, h] (one per microbatch)."""
        act = chunk_activations(
            cfg, micro, layers=range(cfg.num_layers), pre_process=True, post_process=True, tp=2, sp=True
        )
        return act.saved - act.terms["rope_tables"] - 4 * (512 // 2) * cfg.hidden_size

    for b in (1, 2, 8):
        assert per_sample(b) * 4 == per_sample(4) * b
    # Monotone in model size and in dropout; 16-bit halves the tensors but not the fp32 loss.
    assert saved(llama_gqa_tiny(num_kv_heads=4), 4) > saved(llama_gqa_tiny(), 4)
    assert saved(gpt2_tiny(dropout=0.1), 1) > saved(gpt2_tiny(), 1)
    half = saved(cfg, 4, precision="bf16")
    assert base // 2 < half < base


def test_activations_moe():
    dense = saved(moe_tiny(num_experts=0), 2)
    moe = saved(moe_tiny(), 2)
    assert moe > dense
    assert saved(moe_tiny(top_k=1), 2) < moe
