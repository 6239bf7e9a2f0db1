"""Model presets per Hugging Face family (issue 39): configs/model/{llama3_8b, qwen3_8b, qwen2_7b,
mistral_7b}.yaml are the public models' architectures exactly (their published config.json,
below, imports as the preset; the parameter counts are the released checkpoints'), export as the
family's transformers config and import back unchanged, and plan memory per rank at a
realistic layout; the tiny presets keep each family's distinguishing feature and train on CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from meshtron.models.config import GPTConfig
from meshtron.models.hf.config import config_from_hf, hf_config_from_gpt, hf_family
from meshtron.models.rope import inverse_frequencies
from meshtron.planning.flops import attention_width, param_count
from meshtron.training.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]

# The fields of each model's published config.json that describe the architecture (token ids,
# dtype and use_cache left out), as released on the Hugging Face Hub.
PUBLISHED = {
    "llama3_8b": {  # meta-llama/Llama-3.1-8B
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    "qwen3_8b": {  # Qwen/Qwen3-8B
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "qwen2_7b": {  # Qwen/Qwen2.5-7B
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "mistral_7b": {  # mistralai/Mistral-7B-v0.3
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 32768,
    },
}
# The released checkpoints' parameter counts (the sum of their safetensors' tensor sizes).
RELEASED_PARAMS = {
    "llama3_8b": 8_030_261_248,
    "qwen3_8b": 8_190_735_360,
    "qwen2_7b": 7_615_616_512,
    "mistral_7b": 7_248_023_552,
}
SEQ_LEN = {"llama3_8b": 8192, "qwen3_8b": 4096, "qwen2_7b": 4096, "mistral_7b": 4096}
CONFIG_CLASS = {
    "llama3_8b": "LlamaConfig",
    "qwen3_8b": "Qwen3Config",
    "qwen2_7b": "Qwen2Config",
    "mistral_7b": "MistralConfig",
    "llama3_tiny": "LlamaConfig",
    "qwen3_tiny": "Qwen3Config",
    "qwen2_tiny": "Qwen2Config",
    "mistral_tiny": "MistralConfig",
}
REAL = sorted(PUBLISHED)
TINY = ["llama3_tiny", "mistral_tiny", "qwen2_tiny", "qwen3_tiny"]
# A realistic layout per real preset: tp 8 over one node (Qwen2.5-7B's 28 heads and 4 KV heads: tp 4).
TP = {"llama3_8b": 8, "qwen3_8b": 8, "qwen2_7b": 4, "mistral_7b": 8}


def composed(*overrides: str) -> RunConfig:
    """The run config train.py builds from these overrides."""
    with initialize_config_module(config_module="meshtron.configs", version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(overrides))
    return RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))


def preset(name: str) -> GPTConfig:
    return composed(f"+model={name}").model


def node_plan(tmp_path, *overrides: str, world: int = 8) -> dict:
    """plan.json of train.py's dry run (training/loop.py _dry_run) as rank 0 of `world` on one
    node, as under torchrun --nproc_per_node=8 (its process group faked: the plan needs none),
    micro batch 1, global batch 16, bf16 on CUDA, with `overrides`."""
    from meshtron.training.distributed import DistEnv
    from meshtron.training.loop import _dry_run
    from meshtron.training.run_checks import check_run_config

    run = composed(
        *overrides,
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=16",
        "trainer.precision=bf16",
        "trainer.device=cuda",
    )
    run, _ = run.with_precision_for("cuda", True)
    par, micro, _ = check_run_config(run, world, world)
    env = DistEnv(world, 0, 0, world, torch.device("cuda", 0), 1)  # rank 0 plans every rank
    _dry_run(run, par, env, tmp_path, micro, run.execution("torch"))
    return json.loads((tmp_path / "plan.json").read_text())


@pytest.mark.parametrize("name", REAL)
def test_real_preset_is_the_published_architecture(name):
    """The published config.json imports as the preset (at the preset's training seq_len), and the
    preset has the released checkpoint's parameter count."""
    cfg = preset(name)
    assert cfg.seq_len == SEQ_LEN[name] < PUBLISHED[name]["max_position_embeddings"]
    assert config_from_hf(PUBLISHED[name], seq_len=cfg.seq_len) == cfg
    assert param_count(cfg)["total"] == RELEASED_PARAMS[name]
    assert cfg.head_dim == 128 and attention_width(cfg) == cfg.hidden_size


@pytest.mark.parametrize("name", REAL + TINY)
def test_preset_exports_as_its_family_and_imports_back(name):
    """hf_config_from_gpt gives the family's transformers config class; config_from_hf of it is
    the preset again, field for field."""
    cfg = preset(name)
    hf = hf_config_from_gpt(cfg)
    assert type(hf).__name__ == CONFIG_CLASS[name]
    assert hf.head_dim == cfg.head_dim and hf.num_key_value_heads == cfg.num_kv_heads
    assert config_from_hf(hf) == cfg
    if name in PUBLISHED:
        published = PUBLISHED[name]
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "rms_norm_eps"):
            assert getattr(hf, key) == published[key], key
        assert hf.tie_word_embeddings is False


def test_tiny_presets_keep_each_familys_feature():
    """llama3: the llama3 RoPE scaling, with frequencies kept, smoothed and scaled at head dim 16;
    qwen2: a q/k/v bias only; qwen3: QK-norm and heads of their own width; mistral: exported as
    model_type mistral."""
    llama3 = preset("llama3_tiny")
    assert hf_family(llama3) == "llama" and llama3.rope_scaling["rope_type"] == "llama3"
    plain = inverse_frequencies(llama3.head_dim, llama3.rope_theta)
    scaled = inverse_frequencies(llama3.head_dim, llama3.rope_theta, llama3.rope_scaling)
    ratio = (scaled / plain).tolist()
    assert ratio[0] == 1.0 and math.isclose(ratio[-1], 1 / 8) and any(1 / 8 < r < 1 for r in ratio)
    qwen2 = preset("qwen2_tiny")
    assert hf_family(qwen2) == "qwen2" and qwen2.qkv_bias and not qwen2.bias
    qwen3 = preset("qwen3_tiny")
    assert hf_family(qwen3) == "qwen3" and qwen3.qk_norm
    assert qwen3.kv_channels == 32 and attention_width(qwen3) == 128 != qwen3.hidden_size
    mistral = preset("mistral_tiny")
    assert hf_family(mistral) == "mistral" and mistral.sliding_window is None
    for name in TINY:
        cfg = preset(name)
        assert cfg.vocab_size == 256 and param_count(cfg)["total"] < 200_000, name


@pytest.mark.parametrize("name", REAL)
def test_real_preset_dry_run_plans_every_rank_of_a_node(name, tmp_path):
    """The dry run of train.py (training/loop.py _dry_run) as rank 0 of 8 on one node runs it
    under torchrun --nproc_per_node=8 (its process group faked: the plan needs none), bf16 on
    CUDA at tp 8 (qwen2_7b: tp 4, dp 2) with sequence parallelism and selective recompute: every
    rank is planned, holds 1/tp of the weights and fits an 80 GiB device."""
    tp, world = TP[name], 8
    plan = node_plan(
        tmp_path, f"+model={name}", f"parallel.tp={tp}", "parallel.sp=true", "trainer.recompute=selective", world=world
    )
    assert plan["layout"]["tp"] == tp and plan["layout"]["dp"] == world // tp and len(plan["ranks"]) == world
    assert plan["model"]["total_params"] == RELEASED_PARAMS[name]
    for r in plan["ranks"]:
        mem = r["memory"]["bytes"]
        assert r["params"]["count"] < 1.2 * RELEASED_PARAMS[name] / tp
        assert mem["activations"] > 0 and 0 < mem["total"] < 80 * 2**30, (r["coords"], mem["total"] / 2**30)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.timeout(180)
def test_real_presets_dry_run_from_the_command_line(tmp_path):
    """python train.py +model=<each real preset> trainer.dry_run=true exits 0 and plans its rank
    (one Hydra multirun: one interpreter for the four)."""
    out = _run(
        [
            "-m",
            f"+model={','.join(REAL)}",
            "trainer.dry_run=true",
            "trainer.global_batch_size=1",
            f"hydra.sweep.dir={tmp_path}",
        ],
        timeout=160,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("[dry run] rank 0:") == len(REAL)
    for job, name in enumerate(REAL):
        plan = json.loads((tmp_path / str(job) / "plan.json").read_text())
        assert plan["model"]["total_params"] == RELEASED_PARAMS[name], name
        assert plan["ranks"][0]["memory"]["bytes"]["total"] > 0


@pytest.mark.timeout(180)
def test_tiny_presets_train_on_cpu(tmp_path):
    """python train.py +model=<each tiny preset> trainer.max_steps=3: finite losses, going down."""
    out = _run(
        [
            "-m",
            f"+model={','.join(TINY)}",
            "trainer.max_steps=3",
            "trainer.log_every=1",
            "trainer.eval_every=0",
            "trainer.progress=false",
            "trainer.device=cpu",
            f"hydra.sweep.dir={tmp_path}",
        ],
        timeout=160,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for job, name in enumerate(TINY):
        records = [json.loads(line) for line in (tmp_path / str(job) / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in records if "loss" in r]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), (name, losses)
        assert losses[-1] < losses[0] - 0.2, (name, losses)


# ------------------------------------------------------------------------- fine-grained MoE (issue 40)

QWEN3_MOE_30B = {  # Qwen/Qwen3-30B-A3B's config.json, the architecture fields
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_moe_preset_is_qwen3_30b_a3b_and_plans_on_eight_gpus(tmp_path):
    """qwen3_moe_30b_a3b has the published architecture (imported, its aux-loss choice aside),
    transformers' parameter count (30,532,122,624, counted on the meta device) and exports as
    Qwen3MoeConfig; at tp=2 (SP) x ep=8 with ZeRO-1, bf16 and full recompute every rank of one
    node plans under 80 GiB (ep=8 alone: 81.1 GiB). The tiny twin keeps its shape: QK-norm, 128-wide attention, a dense layer."""
    cfg = preset("qwen3_moe_30b_a3b")
    imported = config_from_hf(QWEN3_MOE_30B, seq_len=cfg.seq_len)
    assert dataclasses.replace(imported, aux_loss_coef=0.001, aux_loss_layers="sum", hf_router_fields=None) == cfg
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(hf_config_from_gpt(cfg))
    assert param_count(cfg)["total"] == sum(p.numel() for p in hf.parameters()) == 30_532_122_624
    back = config_from_hf(hf.config, seq_len=cfg.seq_len)  # an import trains transformers' pooled aux
    assert type(hf.config).__name__ == "Qwen3MoeConfig"
    assert dataclasses.replace(back, aux_loss_layers="sum", hf_router_fields=None) == cfg
    plan = node_plan(
        tmp_path, "+model=qwen3_moe_30b_a3b", "parallel.tp=2", "parallel.sp=true", "parallel.ep=8", "optim.zero=1",
        "trainer.recompute=full",
    )  # fmt: skip
    assert plan["layout"]["ep"] == 8 and len(plan["ranks"]) == 8
    for r in plan["ranks"]:
        assert 0 < r["memory"]["bytes"]["total"] < 80 * 2**30, r["memory"]["bytes"]["total"] / 2**30
    tiny = preset("qwen3_moe_tiny")
    assert hf_family(tiny) == "qwen3_moe" and attention_width(tiny) == 128 != tiny.hidden_size
    assert [tiny.is_moe_layer(i) for i in range(3)] == [True, False, True] and param_count(tiny)["total"] < 400_000


@pytest.mark.timeout(120)
def test_qwen3_moe_tiny_trains_on_cpu(tmp_path):
    out = _run(
        ["+model=qwen3_moe_tiny", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0"]
        + ["trainer.progress=false", "trainer.device=cpu", f"hydra.run.dir={tmp_path}"],
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_deepseek_v3_preset_exports_as_deepseek_v3_and_plans_on_eight_gpus(tmp_path):
    """deepseek_v3_16b (DeepSeek-V3's architecture at ~16B) exports as DeepseekV3Config with
    transformers' own parameter count (its MTP depth aside: transformers builds none) and, at
    ep=8 with ZeRO-1, bf16 and selective recompute, every rank of one node plans under 80 GiB;
    the tiny twin keeps the shape."""
    transformers = pytest.importorskip("transformers")
    cfg = preset("deepseek_v3_16b")
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(hf_config_from_gpt(cfg))
    hf_params = sum(p.numel() for p in hf.parameters())
    assert param_count(dataclasses.replace(cfg, mtp_depths=0))["total"] == hf_params == 15_527_984_896
    assert param_count(cfg)["total"] > hf_params  # + the MTP depth
    back = config_from_hf(hf.config, seq_len=cfg.seq_len)
    assert back.attention == "mla" and (back.router_groups, back.router_topk_groups) == (8, 4)
    assert (back.num_experts, back.top_k, back.moe_first_dense, back.router_scaling_factor) == (64, 8, 1, 2.5)
    plan = node_plan(tmp_path, "+model=deepseek_v3_16b", "parallel.ep=8", "optim.zero=1", "trainer.recompute=selective")
    assert len(plan["ranks"]) == 8
    for r in plan["ranks"]:
        assert 0 < r["memory"]["bytes"]["total"] < 80 * 2**30, r["memory"]["bytes"]["total"] / 2**30
    tiny = preset("deepseek_v3_tiny")
    assert hf_family(tiny) == "deepseek_v3" and tiny.mtp_depths == 1 and param_count(tiny)["total"] < 500_000


@pytest.mark.timeout(120)
def test_deepseek_v3_tiny_trains_on_cpu(tmp_path):
    out = _run(
        ["+model=deepseek_v3_tiny", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0"]
        + ["trainer.progress=false", "trainer.device=cpu", f"hydra.run.dir={tmp_path}"],
        timeout=100,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(r["mtp_loss"] > 0 for r in records)
