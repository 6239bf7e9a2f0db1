"""Dry-run planner memory (planning/plan.py): model states against exact formulas (ZeRO 0/1/2,
offload, precision), activations against saved-tensor measurements, a whole step's peak against
the profiler (bench/memory.py), and pipeline microbatches in flight. Single process, fp32 CPU."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import ParallelConfig, virtual_mesh
from meshtron.pipeline.schedules import build_schedule, max_in_flight
from meshtron.planning.activations import saved_activation_bytes
from meshtron.planning.plan import chunk_activations, plan_all_ranks, plan_rank
from tests.test_plan import BATCH, gpt2_tiny
from tests.test_plan import llama_tiny as _llama_tiny


def llama_tiny(**kw) -> GPTConfig:
    # test_plan's tiny Llama with GQA: h=64, a=4, g=2, f=160, V=300 (padded 384 / 512), s=16.
    return _llama_tiny(**{"num_kv_heads": 2, **kw})


# ----------------------------------------------------------------------------- model states


def gpt2_groups_by_hand(tp: int, sp: bool) -> tuple[int, int, int]:
    """(dp-group, tp x dp-group, matmul) parameters of one gpt2_tiny rank, by hand."""
    h, f, s, qkv, v_local = 64, 256, 32, 192, 256 // tp
    sharded = v_local * h + 2 * ((h * qkv + qkv) + h * h + (h * f + f) + f * h) // tp
    norms = 2 * (2 * 2 * h) + 2 * h  # two LayerNorms per layer (w + b) + the final one
    row_biases = 2 * (h + h)  # proj and fc2 biases, replicated over tp
    positions = s * h
    replicated = norms + row_biases + positions
    # Linears (weights, biases); not the tied LM head: the fused LM loss (the default) casts it
    # inside its own forward and keeps no 16-bit copy for backward.
    matmul = sharded + row_biases - v_local * h
    if sp:  # SP-replicated parameters reduce over tp x dp
        return sharded, replicated, matmul
    return sharded + replicated, 0, matmul


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_model_states_match_exact_formulas(zero, offload, tp, sp):
    world = 4
    dp = world // tp
    g_dp, g_tp_dp, matmul = gpt2_groups_by_hand(tp, sp)
    n = g_dp + g_tp_dp
    for precision in ("fp32", "bf16"):
        plan = plan_rank(
            gpt2_tiny(),
            ParallelConfig(tp=tp, sp=sp),
            world,
            1,
            zero=zero,
            offload=offload,
            precision=precision,
            **BATCH,
        )
        p, b = plan["params"], plan["memory"]["bytes"]
        assert p["count"] == n
        assert p["by_replica_group"] == {"dp": g_dp, "tp_dp": g_tp_dp, "edp": 0}
        assert p["matmul"] == matmul
        share = n if zero == 0 else math.ceil(g_dp / dp) + math.ceil(g_tp_dp / (tp * dp))
        grads = 4 * n if zero < 2 else 4 * (math.ceil(g_dp / dp) + math.ceil(g_tp_dp / (tp * dp)))
        assert b["weights"] == 4 * n  # fp32 main weights in every precision
        assert b["grads"] == grads  # ZeRO-2: only the reduced shards persist
        assert b["grad_buffers_backward"] == (4 * n if zero == 2 else 0)
        assert b["optimizer"] == (0 if offload else 8 * share)
        assert b["host"] == (12 * share if offload else 0)
        assert b["main_params"] == 0
        assert b["autocast_weight_copies"] == (2 * matmul if precision == "bf16" else 0)
        assert b["model_states"] == b["weights"] + b["grads"] + b["optimizer"]
        assert b["total"] == b["model_states"] + b["activations"]
        # The forward/backward peak holds ZeRO-2's full buckets and autocast's copies on top.
        assert b["total"] >= (
            b["model_states"] + b["grad_buffers_backward"] + b["autocast_weight_copies"] + b["activations_peak"]
        )


def test_zero1_numbers_by_hand():
    """gpt2_tiny at tp=1 over 4 data-parallel ranks: 118528 parameters, all in the dp group."""
    b = plan_rank(gpt2_tiny(), ParallelConfig(), 4, 0, zero=1, **BATCH)["memory"]["bytes"]
    assert (b["weights"], b["grads"], b["optimizer"]) == (4 * 118528, 4 * 118528, 8 * 29632)
    b = plan_rank(gpt2_tiny(), ParallelConfig(), 4, 0, zero=1, offload=True, **BATCH)["memory"]["bytes"]
    assert (b["optimizer"], b["host"]) == (0, 12 * 29632)


def test_moe_experts_shard_over_edp():
    cfg = llama_tiny(num_experts=4, top_k=2, num_kv_heads=4, ffn_hidden_size=128)
    plan = plan_rank(cfg, ParallelConfig(ep=2), 4, 0, zero=1, micro_batch_size=1, global_batch_size=4)
    groups, res = plan["params"]["by_replica_group"], plan["layout"]
    assert groups["edp"] == 2 * (4 // 2) * 3 * 64 * 128  # two MoE layers, 2 local experts of gate/up/down
    assert res["edp"] == 2 and res["dp"] == 4
    expected = 8 * (math.ceil(groups["dp"] / 4) + math.ceil(groups["edp"] / 2))
    assert plan["memory"]["bytes"]["optimizer"] == expected


def test_legacy_zero_dp_argument_and_defaults():
    cfg = gpt2_tiny()
    legacy = plan_all_ranks(
        cfg, ParallelConfig(), 4, micro_batch_size=2, global_batch_size=8, precision="fp32", zero_dp=4
    )
    new = plan_all_ranks(cfg, ParallelConfig(), 4, micro_batch_size=2, global_batch_size=8, zero=1)
    assert legacy["ranks"][0]["memory"] == new["ranks"][0]["memory"]
    plain = plan_rank(cfg, ParallelConfig(), 4, 0, **BATCH)["memory"]
    assert (plain["zero"], plain["offload"], plain["precision"], plain["device"]) == (0, False, "fp32", "cpu")
    with pytest.raises(ValueError, match="optim.zero"):
        plan_rank(cfg, ParallelConfig(), 4, 0, zero=4, **BATCH)
    with pytest.raises(ValueError, match="device"):
        plan_rank(cfg, ParallelConfig(), 4, 0, device="tpu", **BATCH)


def test_precision_and_device_terms():
    cfg = gpt2_tiny(dropout=0.1)
    chunk = dict(layers=range(2), pre_process=True, post_process=True)
    fp32 = chunk_activations(cfg, 2, **chunk)
    bf16 = chunk_activations(cfg, 2, precision="bf16", **chunk)
    assert bf16.saved < fp32.saved and bf16.logits * 2 == fp32.logits
    assert bf16.terms["loss"] == fp32.terms["loss"]  # the loss's softmax stays fp32
    assert bf16.terms["final_norm"] == fp32.terms["final_norm"]  # norm inputs stay fp32
    cuda = chunk_activations(cfg, 2, device="cuda", **chunk)
    assert cuda.terms["layer_block"] * 4 == fp32.terms["layer_block"]  # bool vs float masks
    assert cuda.terms["layer_attn"] < fp32.terms["layer_attn"]  # fused kernel vs math path


# ----------------------------------------------------------------------------- activations


SHAPES = [
    # (config, recompute, micro batch, tp): GPT-2 / Llama, recompute none / selective / full, dropout
    # on / off, GQA, a padded vocabulary, tp = 2 through a virtual mesh (collectives are skipped,
    # shapes are those of a real tp=2 rank without SP; tests/test_plan_trace.py has SP).
    (gpt2_tiny(hidden_size=128, seq_len=64, vocab_size=1000, dropout=0.1), "none", 2, 1),
    (gpt2_tiny(hidden_size=128, seq_len=64, vocab_size=1000, dropout=0.1), "selective", 2, 1),
    (gpt2_tiny(num_layers=3, hidden_size=96, num_heads=6, seq_len=48, vocab_size=512), "full", 3, 1),
    (llama_tiny(hidden_size=128, seq_len=64, vocab_size=500), "none", 3, 1),
    (llama_tiny(hidden_size=128, seq_len=64, vocab_size=500, dropout=0.1), "selective", 2, 1),
    (gpt2_tiny(hidden_size=128, seq_len=64, vocab_size=1000, dropout=0.1), "none", 2, 2),
    (llama_tiny(hidden_size=128, seq_len=64, vocab_size=500), "selective", 2, 2),
]


@pytest.mark.parametrize("fused", [True, False], ids=["fused_lm_loss", "unfused_lm_loss"])
@pytest.mark.parametrize("cfg,recompute,micro,tp", SHAPES)
def test_saved_activations_equal_measured(cfg, recompute, micro, tp, fused):
    """The planner's traced bytes equal a real forward's to the byte (inputs contiguous: a
    sliced view would keep the whole token window's storage), with the LM head and loss fused
    (the default) or not."""
    execution = ExecutionConfig(recompute=recompute, fused_lm_loss=fused)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), generator=gen)
    for rank in range(tp):
        mesh = virtual_mesh(ParallelConfig(tp=tp), tp, rank)
        (model,) = init_model_chunks(cfg, mesh, 0, execution=execution)
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
        assert planned == measured


@pytest.mark.parametrize(
    "cfg",
    [
        gpt2_tiny(hidden_size=128, seq_len=64, vocab_size=1000, dropout=0.1),
        llama_tiny(hidden_size=128, seq_len=64, vocab_size=500),
    ],
)
def test_bf16_saved_activations_within_half_percent(cfg):
    """Under CPU bf16 autocast; autocast's weight copies (also saved by the matmuls) are the
    planner's `autocast_weight_copies`, so they are taken out of the measurement."""
    from meshtron.planning.plan import meta_param_counts

    (model,) = init_model_chunks(cfg, virtual_mesh(ParallelConfig(), 1, 0), 0)
    model.train()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = saved_activation_bytes(model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    measured -= 2 * meta_param_counts(cfg, ParallelConfig().resolved(1), 1, 0)["matmul"]
    planned = chunk_activations(
        cfg, 2, layers=range(cfg.num_layers), pre_process=True, post_process=True, precision="bf16"
    ).saved
    assert abs(planned / measured - 1) < 0.005, (planned, measured)


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "gpt2", "--layers", "2", "--hidden", "128", "--seq", "64", "--vocab", "1000"],
        ["--model", "gpt2", "--layers", "2", "--hidden", "128", "--seq", "64", "--vocab", "1000", "--unfused-lm-loss"],
        [
            "--model",
            "llama",
            "--layers",
            "2",
            "--hidden",
            "128",
            "--kv-heads",
            "2",
            "--seq",
            "64",
            "--vocab",
            "500",
            "--dropout",
            "0",
            "--recompute",
            "selective",
            "--microbatches",
            "2",
        ],
    ],
)
def test_step_peak_within_10_percent(argv):
    """bench/memory.py's measurement of a whole fp32 CPU training step (profiler peak, exact
    state bytes) against the planner's per-rank total."""
    from bench import memory as bench

    args = bench.parse_args(argv)
    report = bench.run(args, 1, 0, torch.device("cpu"))
    for key in ("weights", "grads", "optimizer"):
        assert report["rel_error"][key] == pytest.approx(0.0, abs=1e-3), key
    assert abs(report["rel_error"]["total"]) < 0.10, report
    assert abs(report["rel_error"]["activations_saved"]) < 0.10, report


# ----------------------------------------------------------------------------- pipelines


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_microbatches_in_flight_follow_the_schedule(schedule, vpp):
    cfg = gpt2_tiny(num_layers=8)
    pp, m = 4, 8
    plans = plan_all_ranks(
        cfg, ParallelConfig(pp=pp, vpp=vpp, schedule=schedule), pp, micro_batch_size=1, global_batch_size=m
    )["ranks"]
    for p in plans:
        r = p["coords"]["pp_rank"]
        flight = p["memory"]["microbatches_in_flight"]
        if schedule == "1f1b":
            assert flight == min(pp - r, m)
        elif schedule == "gpipe":
            assert flight == m
        else:
            assert flight == max_in_flight(build_schedule(schedule, pp, r, m, vpp))
    # Earlier stages keep more microbatches in flight under 1F1B.
    if schedule == "1f1b":
        per_mb = [p["memory"]["bytes"]["activations_peak"] for p in plans]
        assert per_mb[0] > per_mb[1] > per_mb[2]
