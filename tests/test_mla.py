"""Multi-head latent attention (models/mla.py, model.attention=mla): equal to transformers'
DeepseekV3Attention (q latent or plain q, default RoPE and YaRN with mscale, interleaved or
rotate-half rope weights) in output and every gradient; the config's rules; the planner's
parameter and FLOP counts; recomputation and packed documents in the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import GPT, init_model_chunks
from meshtron.models.mla import MLAttention, deinterleave_rope_rows, interleave_rope_rows, mla_softmax_scale
from meshtron.models.rope import rope_tables
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import ParallelConfig, single_process_mesh, virtual_mesh
from meshtron.planning.flops import model_flops_per_token, param_count, params_per_rank

HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V = 64, 4, 24, 16, 8, 4, 12
SEQ, BATCH = 16, 2
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,  # != mscale: the RoPE tables' attention factor is not 1 either
}


def mla_config(q_lora_rank: int | None = Q_RANK, rope_scaling: dict | None = None, **overrides) -> GPTConfig:
    """The tiny MLA model: hidden 64, 4 heads, q rank 24 (or a plain q), kv rank 16, nope 8,
    rope 4, v 12; eps 1e-6 (transformers' latent norms always use 1e-6)."""
    fields = dict(
        arch="llama",
        num_layers=2,
        hidden_size=HIDDEN,
        num_heads=HEADS,
        ffn_hidden_size=48,
        vocab_size=200,
        seq_len=SEQ,
        norm_eps=1e-6,
        attention="mla",
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        rope_scaling=rope_scaling,
        rope_theta=100.0,
    )
    return GPTConfig(**{**fields, **overrides})


# --------------------------------------------------------------------------- transformers


def hf_attention(cfg: GPTConfig, interleave: bool):
    """transformers' DeepseekV3Attention and rotary embedding for `cfg` (eager attention)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    config = transformers.DeepseekV3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.seq_len * 2,
        rope_parameters=rope,
        rope_interleave=interleave,
        attention_bias=False,
        num_hidden_layers=1,
        vocab_size=cfg.vocab_size,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = ds.DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for name, p in attn.named_parameters():  # latent norms away from 1, the rest N(0, 0.1)
            p.copy_(1 + 0.2 * torch.randn_like(p) if "layernorm" in name else 0.1 * torch.randn_like(p))
    return attn, ds.DeepseekV3RotaryEmbedding(config)


def hf_to_meshtron(hf_state: dict[str, torch.Tensor], cfg: GPTConfig, interleave: bool) -> dict[str, torch.Tensor]:
    """The weight mapping of one attention layer, transformers' names -> MLAttention's (the
    same names); interleaved rope rows (rope_interleave) reordered to rotate-half order. Maps
    gradients the same way (a row permutation)."""
    out = dict(hf_state)
    if interleave:
        dn, dr, dq = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.head_dim
        q = "q_b_proj.weight" if cfg.q_lora_rank is not None else "q_proj.weight"
        out[q] = deinterleave_rope_rows(hf_state[q], dr, dq, dn)
        kv = "kv_a_proj_with_mqa.weight"
        out[kv] = deinterleave_rope_rows(hf_state[kv], dr, cfg.kv_lora_rank + dr, cfg.kv_lora_rank)
    return out


def causal_mask(batch: int, seq: int) -> torch.Tensor:
    mask = torch.full((seq, seq), float("-inf")).triu(1)
    return mask.expand(batch, 1, seq, seq)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate_half"])
@pytest.mark.parametrize("scaling", [None, YARN], ids=["rope", "yarn"])
@pytest.mark.parametrize("q_lora_rank", [Q_RANK, None], ids=["q_lora", "plain_q"])
def test_mla_equals_transformers(q_lora_rank, scaling, interleave):
    cfg = mla_config(q_lora_rank, scaling)
    hf, rotary = hf_attention(cfg, interleave)
    ours = MLAttention(cfg, single_process_mesh())
    state = hf_to_meshtron(dict(hf.state_dict()), cfg, interleave)
    assert sorted(state) == sorted(n for n, _ in ours.named_parameters())
    ours.load_state_dict(state)
    assert mla_softmax_scale(cfg) == pytest.approx(hf.scaling, rel=1e-12)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    positions = torch.arange(SEQ).unsqueeze(0) + torch.tensor([[0], [7]])  # a different start per sequence
    cos, sin = rotary(x, positions)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, _ = hf(x_hf, (cos, sin), causal_mask(BATCH, SEQ))

    table_cos, table_sin = rope_tables(2 * SEQ, cfg.rope_dim, cfg.rope_theta, "cpu", cfg.rope_scaling)
    rope = table_cos[positions].unsqueeze(1), table_sin[positions].unsqueeze(1)
    got = ours(x_ours.transpose(0, 1), rope).transpose(0, 1)
    err = (got - want).abs().max().item()
    assert err <= 1e-5, f"output max abs difference {err:.2e}"

    grad_out = torch.randn(want.shape, generator=gen)
    want.backward(grad_out)
    got.backward(grad_out)
    assert (x_ours.grad - x_hf.grad).abs().max().item() <= 1e-5
    hf_grads = hf_to_meshtron({n: p.grad for n, p in hf.named_parameters()}, cfg, interleave)
    for name, p in ours.named_parameters():
        diff = (p.grad - hf_grads[name]).abs().max().item()
        assert diff <= 1e-5, f"grad {name}: max abs difference {diff:.2e}"


def test_deinterleave_rope_rows_orders_each_heads_rope_rows():
    w = torch.arange(2 * 6).float().unsqueeze(1)  # 2 heads of 6 rows: nope 2, rope 4
    got = deinterleave_rope_rows(w, 4, 6, 2).squeeze(1).tolist()
    assert got == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]
    w = torch.randn(3 * 12, 5)  # export inverts import
    assert torch.equal(interleave_rope_rows(deinterleave_rope_rows(w, 4, 12, 8), 4, 12, 8), w)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides,words",
    [
        (dict(kv_lora_rank=None), "model.kv_lora_rank"),
        (dict(qk_rope_head_dim=3), "model.qk_rope_head_dim=3 must be even"),
        (dict(num_kv_heads=2), "model.num_kv_heads=2"),
        (dict(position="learned"), "model.position=rope"),
        (dict(arch="gpt2", position=None, bias=None), "model.position=rope"),
        (dict(qkv_bias=True), "model.qkv_bias=false"),
        (dict(qk_norm=True), "model.qk_norm"),
        (dict(kv_channels=16), "model.kv_channels"),
        (dict(sliding_window=4), "model.sliding_window=4"),
        (dict(attention="gqa"), "model.attention"),
        (dict(q_lora_rank=0), "model.q_lora_rank"),
    ],
)
def test_bad_mla_configs_fail_in_one_line(overrides, words):
    with pytest.raises(ValueError) as err:
        mla_config(**overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_mla_fields_need_attention_mla():
    with pytest.raises(ValueError, match=r"^model.kv_lora_rank is an mla field; set model.attention=mla"):
        GPTConfig(arch="llama", kv_lora_rank=16)


def test_mla_defaults_and_widths():
    cfg = mla_config(v_head_dim=None)
    assert cfg.v_head_dim == NOPE and cfg.head_dim == NOPE + ROPE and cfg.rope_dim == ROPE
    assert GPTConfig(arch="llama").rope_dim == GPTConfig(arch="llama").head_dim
    # MLA's heads need not divide hidden_size
    assert mla_config(hidden_size=66, num_heads=4).head_dim == NOPE + ROPE


# --------------------------------------------------------------------------- planner


@pytest.mark.parametrize("q_lora_rank", [Q_RANK, None])
@pytest.mark.parametrize("tie", [True, False])
def test_param_count_equals_built_parameters(q_lora_rank, tie):
    cfg = mla_config(q_lora_rank, tie_embeddings=tie, bias=tie, qkv_bias=False)  # o_proj bias with bias=true
    (model,) = init_model_chunks(cfg, single_process_mesh(), 0)
    assert param_count(cfg)["total"] == sum(p.numel() for p in model.parameters())
    for tp in (2, 4):
        mesh = virtual_mesh(ParallelConfig(tp=tp, sp=True), tp, 0)
        built = GPT(cfg, mesh, device="meta")
        assert params_per_rank(cfg, tp=tp) == sum(p.numel() for p in built.parameters())


def test_mla_flops_per_token_by_hand():
    for q in (Q_RANK, None):
        cfg = mla_config(q)
        h, a, s, dq = HIDDEN, HEADS, SEQ, NOPE + ROPE
        q_proj = 2 * (h * q + q * a * dq) if q else 2 * h * a * dq
        attn = q_proj + 2 * h * (KV_RANK + ROPE) + 2 * KV_RANK * a * (NOPE + V) + 2 * s * a * (dq + V) + 2 * a * V * h
        mlp = 2 * 3 * h * 48
        head = 2 * h * cfg.padded_vocab_size(1)
        assert model_flops_per_token(cfg) == 3 * (cfg.num_layers * (attn + mlp) + head)


# --------------------------------------------------------------------------- in the model


def _grads(cfg: GPTConfig, execution: ExecutionConfig, doc_ids=None):
    (model,) = init_model_chunks(cfg, single_process_mesh(), 3, execution=execution)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
    loss = model(tokens[:, :-1], targets=tokens[:, 1:], doc_ids=doc_ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_gradients(recompute):
    cfg = mla_config()
    loss, grads = _grads(cfg, ExecutionConfig())
    loss_r, grads_r = _grads(cfg, ExecutionConfig(recompute=recompute))
    assert torch.equal(loss, loss_r)
    for name, g in grads.items():
        assert torch.allclose(grads_r[name], g, rtol=0, atol=1e-7), name


def test_packed_documents_attend_within_each_document():
    """Two documents packed in one row give the logits of each document run alone."""
    cfg = mla_config()
    (model,) = init_model_chunks(cfg, single_process_mesh(), 3)
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=gen)
    cut = 6
    doc_ids = (torch.arange(SEQ) >= cut).long().unsqueeze(0)
    positions = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, positions=positions, doc_ids=doc_ids)
        first, second = model(tokens[:, :cut]), model(tokens[:, cut:])
    assert (packed[:, :cut] - first).abs().max() <= 1e-5
    assert (packed[:, cut:] - second).abs().max() <= 1e-5


def test_replicated_weights_sum_gradients_over_tp():
    """At tp > 1 the down projections and latent norms are tagged for a gradient sum over tp;
    the up projections are split by heads, o_proj by its input."""
    mesh = virtual_mesh(ParallelConfig(tp=2), 2, 0)
    attn = MLAttention(mla_config(), mesh, device="meta")
    shards = {n: (p.tp_shard_dim, p.sequence_parallel) for n, p in attn.named_parameters()}
    assert shards == {
        "q_a_proj.weight": (None, True),
        "q_a_layernorm.weight": (None, True),
        "q_b_proj.weight": (0, False),
        "kv_a_proj_with_mqa.weight": (None, True),
        "kv_a_layernorm.weight": (None, True),
        "kv_b_proj.weight": (0, False),
        "o_proj.weight": (1, False),
    }
    serial = MLAttention(mla_config(), single_process_mesh(), device="meta")
    assert not any(p.sequence_parallel for p in serial.parameters())


def test_mla_model_initializes_layout_independently():
    cfg = mla_config()
    model = GPT(cfg, single_process_mesh())
    initialize_parameters(model, 0, single_process_mesh())
    again = GPT(dataclasses.replace(cfg), single_process_mesh())
    initialize_parameters(again, 0, single_process_mesh())
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("recompute,tp", [("none", 1), ("selective", 2), ("full", 2)])
def test_planned_activations_equal_measured(recompute, tp):
    """The planner traces the MLA block (its rope tables qk_rope_head_dim wide): planned saved
    bytes equal a real forward's to the byte, at tp=1 and on each rank of tp=2."""
    from meshtron.planning.activations import saved_activation_bytes
    from meshtron.planning.plan import chunk_activations

    cfg = mla_config(seq_len=32, dropout=0.1)
    execution = ExecutionConfig(recompute=recompute)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    for rank in range(tp):
        (model,) = init_model_chunks(cfg, virtual_mesh(ParallelConfig(tp=tp), tp, rank), 0, execution=execution)
        model.train()
        measured = saved_activation_bytes(model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        planned = chunk_activations(
            cfg, 2, layers=range(cfg.num_layers), pre_process=True, post_process=True, tp=tp, tp_rank=rank,
            execution=execution,
        ).saved  # fmt: skip
        assert planned == measured


def test_plan_rank_handles_mla():
    """A whole plan (its meta-built parameter count checked against params_per_rank)."""
    from meshtron.planning.plan import plan_rank

    plan = plan_rank(mla_config(), ParallelConfig(tp=2, sp=True), 4, 0, micro_batch_size=1, global_batch_size=4)
    assert plan["memory"]["bytes"]["total"] > 0
