"""Dry-run planner (planning/plan.py): meta-built per-rank counts, memory, FLOPs, bad layouts."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from meshtron.models.config import GPTConfig
from meshtron.mpu import init as mpu_init
from meshtron.mpu.mesh import ParallelConfig, ParallelConfigError
from meshtron.planning.flops import model_flops_per_token, param_count, params_per_rank
from meshtron.planning.plan import (
    chunk_activations,
    format_plan,
    format_rank_line,
    meta_param_counts,
    plan_all_ranks,
    plan_rank,
    write_plan,
)

BATCH = dict(micro_batch_size=2, global_batch_size=8)


def gpt2_tiny(**kw) -> GPTConfig:
    # h=64, a=4, f=256, V=256 (multiple of 128; padded to 512 at tp=4), s=32, LayerNorm + biases, tied.
    args = dict(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=256, vocab_size=256, seq_len=32, arch="gpt2")
    return GPTConfig(**{**args, **kw})


def llama_tiny(**kw) -> GPTConfig:
    # h=64, a=4, g=4 kv heads, f=160, V=300 (padded 384 at tp=1, 512 at tp=2/4), s=16, RMSNorm, untied.
    args = dict(
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=160,
        vocab_size=300,
        seq_len=16,
        arch="llama",
        tie_embeddings=False,
    )
    return GPTConfig(**{**args, **kw})


def hand_count_gpt2(tp: int) -> tuple[int, int]:
    """(tp-sharded, replicated) parameters one rank holds for gpt2_tiny, by hand."""
    h, f, s, qkv = 64, 256, 32, 192
    vocab_local = GPTConfig(vocab_size=256).padded_vocab_size(tp) // tp
    sharded = vocab_local * h  # tied embedding / head, counted once
    replicated = s * h + 2 * h  # learned positions, final LayerNorm
    per_layer_sharded = (h * qkv + qkv) + h * h + (h * f + f) + f * h  # qkv w+b, proj w, fc1 w+b, fc2 w
    per_layer_replicated = 2 * (2 * h) + h + h  # two LayerNorms (w+b), proj bias, fc2 bias
    return sharded + 2 * per_layer_sharded // tp, replicated + 2 * per_layer_replicated


def hand_count_llama(tp: int) -> tuple[int, int]:
    h, f, qkv = 64, 160, 192
    vocab_local = GPTConfig(vocab_size=300).padded_vocab_size(tp) // tp
    sharded = 2 * vocab_local * h  # untied embedding and LM head
    replicated = h  # final RMSNorm
    per_layer_sharded = h * qkv + h * h + 3 * h * f
    per_layer_replicated = 2 * h
    return sharded + 2 * per_layer_sharded // tp, replicated + 2 * per_layer_replicated


@pytest.fixture(autouse=True)
def _no_initialization(monkeypatch):
    """Planning must never materialize a parameter."""

    def boom(*args, **kwargs):
        raise AssertionError("initialize_parameters called while planning")

    monkeypatch.setattr(mpu_init, "initialize_parameters", boom)


@pytest.mark.parametrize("make,hand", [(gpt2_tiny, hand_count_gpt2), (llama_tiny, hand_count_llama)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_meta_count_matches_hand_and_analytic(make, hand, tp):
    cfg = make()
    sharded, replicated = hand(tp)
    for rank in range(4):
        plan = plan_rank(cfg, ParallelConfig(tp=tp), 4, rank, **BATCH)
        p = plan["params"]
        assert p["meta"] == p["analytic"] == p["count"] == sharded + replicated
        assert p["analytic"] == params_per_rank(cfg, tp=tp)
        assert (p["tp_sharded"], p["replicated"]) == (sharded, replicated)
        assert p["padded_vocab_size"] == cfg.padded_vocab_size(tp)
        assert p["vocab_per_rank"] == cfg.padded_vocab_size(tp) // tp
        assert plan["param_source"].startswith("meta")
        c = plan["coords"]
        assert (c["pp_rank"], c["dp_rank"], c["tp_rank"]) == (0, rank // tp, rank % tp)
        assert plan["layout"]["dp"] == 4 // tp


@pytest.mark.parametrize("make", [gpt2_tiny, llama_tiny])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shards_sum_to_unsharded(make, tp):
    """Summed over a TP group the sharded parameters equal the tp=1 ones (up to the vocab padding,
    which grows with tp); replicated parameters are the same on every rank and counted once."""
    cfg = make()
    one = meta_param_counts(cfg, ParallelConfig(tp=1).resolved(4), 4, 0)
    shards = [meta_param_counts(cfg, ParallelConfig(tp=tp).resolved(4), 4, r) for r in range(tp)]
    vocab_tables = 1 if cfg.tie_embeddings else 2
    extra_padding = vocab_tables * (cfg.padded_vocab_size(tp) - cfg.padded_vocab_size(1)) * cfg.hidden_size
    assert sum(s["tp_sharded"] for s in shards) == one["tp_sharded"] + extra_padding
    assert {s["replicated"] for s in shards} == {one["replicated"]}
    assert one["total"] == param_count(cfg)["total"]


@pytest.mark.parametrize("make", [gpt2_tiny, llama_tiny])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_memory_and_flops(make, tp):
    cfg = make()
    plan = plan_rank(cfg, ParallelConfig(tp=tp), 4, 1, **BATCH)
    n, b = plan["params"]["count"], plan["memory"]["bytes"]
    assert (b["weights"], b["grads"], b["main_params"], b["optimizer"]) == (4 * n, 4 * n, 0, 8 * n)
    assert b["model_states"] == n * (4 + 4 + 8)
    assert b["host"] == b["grad_buffers_backward"] == b["autocast_weight_copies"] == 0
    act = chunk_activations(
        cfg, 2, layers=range(cfg.num_layers), pre_process=True, post_process=True, tp=tp, tp_rank=1 % tp
    ).saved
    assert b["activations_per_microbatch"] == act
    assert b["activations"] >= b["activations_peak"] >= act  # the peak adds logits and backward transients
    assert b["total"] == n * 16 + b["activations"]
    assert plan["memory"]["gib"]["total"] == pytest.approx(b["total"] / 2**30)
    dp = 4 // tp
    assert plan["batch"]["num_microbatches"] == 8 // (dp * 2)
    f = plan["flops"]
    assert f["global_per_step"] == model_flops_per_token(cfg) * 8 * cfg.seq_len
    assert f["rank_per_step"] == pytest.approx(f["global_per_step"] / 4)
    assert "world_size" in f["convention"]

    # bf16 / fp16: fp32 weights (the main weights), fp32 grads, AdamW 8 B, plus autocast's
    # 2-byte copies of the matmul weights; 16-bit activations.
    for precision in ("bf16", "fp16"):
        half = plan_rank(cfg, ParallelConfig(tp=tp), 4, 1, precision=precision, **BATCH)["memory"]["bytes"]
        assert (half["weights"], half["grads"], half["main_params"], half["optimizer"]) == (4 * n, 4 * n, 0, 8 * n)
        assert 0 < half["autocast_weight_copies"] < 2 * n
        assert half["activations_per_microbatch"] < b["activations_per_microbatch"]


def test_sequence_parallel_activations():
    cfg = gpt2_tiny()
    plain = plan_rank(cfg, ParallelConfig(tp=2), 4, 0, **BATCH)["memory"]["bytes"]
    sp = plan_rank(cfg, ParallelConfig(tp=2, sp=True), 4, 0, **BATCH)["memory"]["bytes"]
    assert (
        sp["activations_per_microbatch"]
        == chunk_activations(cfg, 2, layers=range(2), pre_process=True, post_process=True, tp=2, sp=True).saved
    )
    assert sp["activations_per_microbatch"] < plain["activations_per_microbatch"]
    assert sp["activations"] < plain["activations"]
    assert sp["weights"] == plain["weights"] and sp["optimizer"] == plain["optimizer"]


def test_bad_layouts_raise_clear_messages():
    # tp=3 does not divide 4 heads (world 6 so that the world size itself splits).
    with pytest.raises(ParallelConfigError, match=r"tp=3 does not divide num_heads=4"):
        plan_rank(gpt2_tiny(), ParallelConfig(tp=3), 6, 0, **BATCH)
    with pytest.raises(ParallelConfigError, match=r"world size 4 is not divisible by tp\*pp=3"):
        plan_all_ranks(gpt2_tiny(), ParallelConfig(tp=3), 4, **BATCH)
    # 10 samples over dp=2 x micro 2 = 4 per microbatch round.
    with pytest.raises(ValueError, match=r"trainer\.global_batch_size=10 .*trainer\.micro_batch_size=2 \* dp=2"):
        plan_rank(gpt2_tiny(), ParallelConfig(tp=2), 4, 0, micro_batch_size=2, global_batch_size=10)
    with pytest.raises(ValueError, match="precision"):
        plan_rank(gpt2_tiny(), ParallelConfig(), 4, 0, precision="fp4", **BATCH)
    with pytest.raises(ParallelConfigError, match="need an MoE model"):
        plan_rank(gpt2_tiny(), ParallelConfig(ep=2), 4, 0, **BATCH)


def test_meta_mismatch_is_a_runtime_error(monkeypatch):
    import meshtron.planning.plan as plan_mod

    monkeypatch.setattr(plan_mod, "params_per_rank", lambda *a, **k: 12345)
    with pytest.raises(RuntimeError, match="12345"):
        plan_mod.plan_rank(gpt2_tiny(), ParallelConfig(tp=2), 4, 0, **BATCH)


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_meta_build_matches_analytic(shared):
    """MoE ranks are built on meta (experts split over ep, routers replicated, shared
    experts split over tp) and the count equals the analytic one."""
    cfg = llama_tiny(num_experts=8, top_k=2, num_kv_heads=4, ffn_hidden_size=128, shared_experts=shared)
    plan = plan_all_ranks(cfg, ParallelConfig(tp=4, ep=8), 8, micro_batch_size=1, global_batch_size=4)
    assert plan["layout"] == plan["ranks"][0]["layout"]
    assert (plan["layout"]["dp"], plan["layout"]["edp"]) == (2, 1)
    for r, p in enumerate(plan["ranks"]):
        assert p["param_source"].startswith("meta")
        assert p["params"]["meta"] == p["params"]["count"] == params_per_rank(cfg, tp=4, ep=8)
        assert p["coords"]["ep_rank"] == r and p["coords"]["tp_rank"] == r % 4
    pc = param_count(cfg)
    assert plan["model"]["total_params"] == pc["total"]
    assert plan["model"]["active_params_per_token"] == pc["active_per_token"] < pc["total"]


def test_pipeline_stages_are_built_on_meta():
    """Each rank counts its own stage (meta); the most loaded equals the analytic count."""
    cfg = gpt2_tiny()
    plans = [plan_rank(cfg, ParallelConfig(tp=2, pp=2), 4, r, **BATCH) for r in range(4)]
    assert all("pipeline chunks" in p["param_source"] for p in plans)
    counts = [p["params"]["meta"] for p in plans]
    assert max(counts) == params_per_rank(cfg, tp=2, pp=2)
    assert counts[0] == counts[1] and counts[2] == counts[3]  # tp ranks of a stage hold equal shards
    plan = plans[3]
    assert plan["params"]["count"] == counts[3]
    assert plan["coords"]["pp_rank"] == 1
    # 1F1B keeps min(pp - pp_rank, microbatches) in flight: 1 on the last stage, 2 on the first.
    assert plan["memory"]["microbatches_in_flight"] == 1
    assert plans[0]["memory"]["microbatches_in_flight"] == 2


def gpt_1b(**kw) -> GPTConfig:
    args = dict(
        hidden_size=2048, num_layers=24, num_heads=16, vocab_size=50257, seq_len=2048, num_experts=8, arch="gpt2"
    )
    return GPTConfig(**{**args, **kw})


@pytest.mark.parametrize("experts", [8, 0])
def test_gpt_1b_all_ranks_fast(experts, tmp_path):
    cfg = gpt_1b(num_experts=experts)
    par = ParallelConfig(tp=4, ep=8) if experts else ParallelConfig(tp=4)
    start = time.perf_counter()
    plan = plan_all_ranks(cfg, par, 8, micro_batch_size=1, global_batch_size=16)
    assert time.perf_counter() - start < 10.0
    assert len(plan["ranks"]) == 8
    if not experts:  # eight meta builds of the 1.3B model agree with the analytic count
        assert all(p["params"]["meta"] == p["params"]["analytic"] for p in plan["ranks"])
        assert plan["ranks"][0]["params"]["vocab_per_rank"] == 50688 // 4
    line = format_rank_line(plan["ranks"][5])
    assert line.startswith("rank   5") and "TFLOP/step" in line and "total" in line
    assert len(format_plan(plan).splitlines()) == 2 + 8
    out = tmp_path / "sub" / "plan.json"
    write_plan(out, plan)
    assert json.loads(out.read_text()) == json.loads(json.dumps(plan))
    assert out.read_text().startswith('{\n  "layout"')


def test_context_parallel_divides_saved_activations():
    """Each cp rank holds seq/cp tokens: every saved term but attention falls by exactly cp; the
    attention term by a little less (the ring keeps its fp32 output apart from the projection's
    input, which SDPA's output shares); the model states do not change, and the AdamW state
    is sharded over dp x cp under ZeRO-1."""
    cfg = dataclasses.replace(gpt2_tiny(), dropout=0.0)
    full = chunk_activations(cfg, 2, layers=range(2), pre_process=True, post_process=True).terms
    one = plan_rank(cfg, ParallelConfig(), 4, 0, **BATCH)["memory"]["bytes"]
    for cp in (2, 4):
        terms = chunk_activations(cfg, 2, layers=range(2), pre_process=True, post_process=True, cp=cp).terms
        for name in ("layer_norm1", "layer_norm2", "layer_mlp", "final_norm"):
            assert terms[name] * cp == full[name], (cp, name)
        # The fused LM loss keeps the input gradient (per token) and the weight gradient (not).
        weight_grad = 4 * cfg.padded_vocab_size(1) * cfg.hidden_size
        assert (terms["loss"] - weight_grad) * cp == full["loss"] - weight_grad
        assert full["layer_attn"] / cp < terms["layer_attn"] < 1.25 * full["layer_attn"] / cp
        got = plan_rank(cfg, ParallelConfig(cp=cp), 4, 0, **BATCH)["memory"]["bytes"]
        assert got["weights"] == one["weights"] and got["activations"] < one["activations"]
    zero1 = plan_rank(cfg, ParallelConfig(cp=2), 4, 0, zero=1, **BATCH)["memory"]["bytes"]
    assert abs(zero1["optimizer"] - one["optimizer"] / 4) <= 8 * 4  # AdamW state over dp*cp = 4 replicas
