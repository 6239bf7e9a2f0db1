"""Hugging Face interop (models/hf/), single process: tiny random GPT-2, Llama (GQA) and
Mixtral (4 experts, top-2) models from `transformers` load into meshtron with the same
logits (max abs error <= 1e-4 in fp32), export back bitwise, and go through a safetensors
folder that `AutoModelForCausalLM.from_pretrained` loads. Bad inputs raise naming the tensor
or config field. Mixtral's router loss fields import as the objective transformers trains
(aux_loss_coef = router_aux_loss_coef x top_k, or 0 without output_router_logits), export back
unchanged, and one- and two-layer Mixtrals (aux pooled across layers, as transformers) train
the same per-step objective and weights as transformers; the gap of the per-layer "sum" aux
is pinned at its documented size."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from meshtron.models.config import GPTConfig
from meshtron.models.gpt import GPT
from meshtron.mpu.init import local_shard
from meshtron.mpu.mesh import ParallelConfig, single_process_mesh, virtual_mesh

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from meshtron.models import hf as mhf  # noqa: E402
from meshtron.training import hf_cli  # noqa: E402
from tests.distributed.hf_cases import SEQ, VOCAB, hf_config, hf_model  # noqa: E402

ATOL = 1e-4  # max abs error of fp32 logits (|logits| ~ 1)


@pytest.fixture(scope="module", params=["gpt2", "llama", "mixtral"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def models(family):
    """(hf model, meshtron model loaded from it, token ids, HF logits)."""
    hf = hf_model(family)
    model = GPT(mhf.config_from_hf(hf.config), single_process_mesh()).eval()
    mhf.load_hf_state_dict(model, hf.state_dict())
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    return hf, model, ids, want


def logits(model, ids):
    with torch.no_grad():
        return model.full_logits(model(ids))


def assert_state_dicts_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_logits_match_hf(models):
    hf, model, ids, want = models
    got = logits(model, ids)
    assert got.shape == want.shape == (2, SEQ, VOCAB)
    assert (got - want).abs().max().item() <= ATOL


def test_export_is_bitwise_identity(models):
    hf, model, _, _ = models
    assert_state_dicts_equal(mhf.export_hf_state_dict(model, model.mesh), hf.state_dict())


def test_save_folder_loads_in_transformers(models, tmp_path):
    hf, model, ids, want = models
    state = mhf.export_hf_state_dict(model, model.mesh)
    mhf.save_hf_folder(state, hf.config, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(loaded) is type(hf)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    config, read = mhf.read_hf_folder(tmp_path)
    assert mhf.config_from_hf(config) == model.cfg
    again = GPT(model.cfg, single_process_mesh()).eval()
    mhf.load_hf_state_dict(again, read)  # tied lm_head absent on disk: fine
    assert torch.equal(logits(again, ids), logits(model, ids))


def test_read_sharded_folder(tmp_path):
    from safetensors.torch import save_file

    hf = hf_model("llama")
    state = hf.state_dict()
    keys = sorted(state)
    parts = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in parts.items():
        save_file({k: state[k].contiguous() for k in part}, str(tmp_path / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in parts.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf.config.save_pretrained(tmp_path)
    config, read = mhf.read_hf_folder(tmp_path)
    assert config.model_type == "llama"
    assert_state_dicts_equal(read, state)


def test_mixtral_per_expert_checkpoint_format():
    """Original Mixtral / transformers 4.x per-expert w1/w2/w3 tensors load and export too."""
    hf = hf_model("mixtral")
    cfg = mhf.config_from_hf(hf.config)
    model = GPT(cfg, single_process_mesh()).eval()
    mhf.load_hf_state_dict(model, hf.state_dict())
    legacy = mhf.export_hf_state_dict(model, model.mesh, moe_format="per_expert")
    assert legacy["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (64, 96)
    assert not any(".mlp.experts." in k for k in legacy)
    other = GPT(cfg, single_process_mesh()).eval()
    mhf.load_hf_state_dict(other, legacy)
    assert_state_dicts_equal(mhf.export_hf_state_dict(other, other.mesh, moe_format="fused"), hf.state_dict())


def test_gpt2_hub_naming_without_prefix():
    """Hub GPT-2 checkpoints have no `transformer.` prefix and keep causal-mask buffers."""
    hf = hf_model("gpt2")
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    model = GPT(mhf.config_from_hf(hf.config), single_process_mesh())
    mhf.load_hf_state_dict(model, state)
    assert_state_dicts_equal(mhf.export_hf_state_dict(model, model.mesh), hf.state_dict())


@pytest.mark.parametrize(
    "par,ranks", [(ParallelConfig(tp=2), 2), (ParallelConfig(tp=2, ep=2), 2), (ParallelConfig(tp=1, ep=2, etp=2), 4)]
)
def test_load_shards_match_serial(par, ranks):
    """Each rank's shard (no process group: virtual meshes) is its piece of the serial parameter."""
    hf = hf_model("mixtral")
    cfg = mhf.config_from_hf(hf.config)
    serial = GPT(cfg, single_process_mesh())
    mhf.load_hf_state_dict(serial, hf.state_dict())
    full = dict(serial.named_parameters())
    for rank in range(ranks):
        mesh = virtual_mesh(par, ranks, rank)
        model = GPT(cfg, mesh)
        mhf.load_hf_state_dict(model, hf.state_dict())
        for name, p in model.named_parameters():
            want = full[name]
            if name in ("embed.weight", "head.weight"):
                want = torch.cat([want, want.new_zeros(model.padded_vocab_size - want.shape[0], want.shape[1])])
            assert torch.equal(p, local_shard(want, p.shards, mesh)), (rank, name)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral"])
def test_config_round_trip(family):
    cfg = mhf.config_from_hf(hf_config(family))
    assert mhf.config_from_hf(mhf.hf_config_from_gpt(cfg)) == cfg


# ---------------------------------------------------------------------------------- errors


def _fresh(family):
    hf = hf_model(family)
    return hf, GPT(mhf.config_from_hf(hf.config), single_process_mesh())


def test_missing_tensor_is_named():
    hf, model = _fresh("llama")
    state = hf.state_dict()
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(mhf.HFConversionError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight"):
        mhf.load_hf_state_dict(model, state)


def test_unexpected_tensor_is_named():
    hf, model = _fresh("gpt2")
    state = hf.state_dict()
    state["transformer.h.2.ln_1.weight"] = torch.ones(64)
    with pytest.raises(mhf.HFConversionError, match=r"unexpected tensor transformer\.h\.2\.ln_1\.weight"):
        mhf.load_hf_state_dict(model, state)


def test_wrong_shape_is_named():
    hf, model = _fresh("mixtral")
    state = hf.state_dict()
    state["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 96, 64)
    want = r"model\.layers\.0\.mlp\.experts\.gate_up_proj has shape \(4, 96, 64\), expected \(4, 192, 64\)"
    with pytest.raises(mhf.HFConversionError, match=want):
        mhf.load_hf_state_dict(model, state)


def test_tied_head_must_equal_embedding():
    hf, model = _fresh("gpt2")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    state["lm_head.weight"] += 1.0
    with pytest.raises(mhf.HFConversionError, match="lm_head.weight"):
        mhf.load_hf_state_dict(model, state)


@pytest.mark.parametrize(
    "family,kw,field",
    [
        (
            "llama",
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
            "rope_parameters.rope_type",
        ),
        ("llama", dict(hidden_act="gelu"), "hidden_act"),
        ("llama", dict(attention_bias=True), "attention_bias"),
        ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1), "max_window_layers"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
        ("gpt2", dict(activation_function="gelu"), "activation_function"),
        ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ],
)
def test_unsupported_config_names_field(family, kw, field):
    with pytest.raises(mhf.HFConversionError, match=field.replace(".", r"\.")):
        mhf.config_from_hf(hf_config(family, **kw))


def test_unsupported_model_type():
    with pytest.raises(mhf.HFConversionError, match="model_type"):
        mhf.config_from_hf(transformers.BertConfig())


def test_unexpressible_meshtron_config_names_field():
    cfg = GPTConfig(arch="llama", num_experts=4, top_k=2, shared_experts=1)  # Qwen2-MoE's gates its shared expert
    with pytest.raises(mhf.HFConversionError, match="model.shared_expert_gate=False .*Qwen2-MoE needs True"):
        mhf.hf_family(cfg)
    with pytest.raises(mhf.HFConversionError, match="model.moe_every=2 .*Mixtral needs 1"):
        mhf.hf_family(GPTConfig(arch="llama", num_layers=4, num_experts=4, top_k=2, moe_every=2))
    with pytest.raises(mhf.HFConversionError, match="model.router_scaling_factor=2.5 .*Qwen3-MoE needs 1.0"):
        mhf.hf_family(GPTConfig(arch="llama", num_experts=4, top_k=2, qk_norm=True, router_scaling_factor=2.5))
    grouped = GPTConfig(arch="llama", num_experts=4, top_k=2, router_groups=2, router_topk_groups=1)
    with pytest.raises(mhf.HFConversionError, match="model.router_groups"):
        mhf.hf_family(grouped)
    with pytest.raises(mhf.HFConversionError, match="model.num_kv_heads"):
        mhf.hf_family(dataclasses.replace(GPTConfig(arch="gpt2", num_heads=4), num_kv_heads=2))


@pytest.mark.parametrize(
    "cfg",
    [
        GPTConfig(arch="gpt2", num_layers=2, hidden_size=32, num_heads=4, vocab_size=200, seq_len=16),
        GPTConfig(
            arch="llama",
            num_layers=2,
            hidden_size=64,
            num_heads=8,
            num_kv_heads=4,
            ffn_hidden_size=48,
            vocab_size=200,
            seq_len=16,
            tie_embeddings=False,
            rope_theta=500.0,
            norm_eps=1e-6,
        ),
        GPTConfig(
            arch="llama",
            num_layers=2,
            hidden_size=32,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=48,
            vocab_size=200,
            seq_len=16,
            num_experts=4,
            top_k=2,
            moe_ffn_hidden_size=32,
        ),
    ],
    ids=["gpt2", "llama", "mixtral"],
)
def test_meshtron_model_exports_to_transformers(cfg, tmp_path):
    """A meshtron-initialized model saved with `hf_config_from_gpt` runs in transformers with
    the same logits."""
    from meshtron.models.gpt import init_model_chunks

    (model,) = init_model_chunks(cfg, single_process_mesh(), seed=5)
    model.eval()
    mhf.save_hf_folder(mhf.export_hf_state_dict(model, model.mesh), mhf.hf_config_from_gpt(cfg), tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (loaded(ids).logits - logits(model, ids)).abs().max().item()
    assert err <= ATOL


# ------------------------------------------------------------ Mixtral router loss fidelity


@pytest.mark.parametrize("output_router_logits,want", [(True, 0.02 * 2), (False, 0.0)])
def test_mixtral_router_loss_import(output_router_logits, want):
    """transformers trains router_aux_loss_coef x aux only with output_router_logits=True, and
    its one-layer aux is top_k x meshtron's: aux_loss_coef = coef x top_k, or 0; no z-loss."""
    cfg = mhf.config_from_hf(hf_config("mixtral", output_router_logits=output_router_logits, router_aux_loss_coef=0.02))
    assert cfg.top_k == 2 and cfg.aux_loss_coef == want and cfg.z_loss_coef == 0.0
    assert cfg.hf_router_fields == {"router_aux_loss_coef": 0.02, "output_router_logits": output_router_logits}


@pytest.mark.parametrize("output_router_logits", [True, False])
def test_mixtral_router_fields_round_trip(output_router_logits, tmp_path):
    """An imported Mixtral, trained a step and exported (in memory and through the
    `meshtron-hf import/export` checkpoint path), writes back the source config's
    router_aux_loss_coef and output_router_logits (False with a nonzero coefficient too)."""
    from omegaconf import OmegaConf

    from meshtron.dp.grad_reduce import DataParallelGradReducer
    from meshtron.training.optim import build_optimizer
    from meshtron.training.step import train_step

    hf = hf_model("mixtral", output_router_logits=output_router_logits, router_aux_loss_coef=0.02)
    want = {"router_aux_loss_coef": 0.02, "output_router_logits": output_router_logits}
    cfg = mhf.config_from_hf(hf.config)
    model = GPT(cfg, single_process_mesh())
    mhf.load_hf_state_dict(model, hf.state_dict())
    reducer = DataParallelGradReducer(list(model.named_parameters()), model.mesh)
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    train_step(
        model,
        reducer,
        build_optimizer(model, lr=1e-3, weight_decay=0.0),
        [(ids[:, :-1], ids[:, 1:])],
        model.mesh,
        lr=1e-3,
        max_grad_norm=1.0,
    )
    reducer.remove_hooks()
    exported = mhf.hf_config_from_gpt(model.cfg)
    assert {k: getattr(exported, k) for k in want} == want
    assert mhf.config_from_hf(exported) == cfg

    hf.save_pretrained(tmp_path / "src")
    ckpt = hf_cli.import_to_checkpoint(tmp_path / "src", tmp_path / "ckpt")
    yaml_cfg = OmegaConf.to_container(OmegaConf.load(tmp_path / "ckpt" / "model" / "imported.yaml"))
    assert GPTConfig(**yaml_cfg) == mhf.config_from_hf(hf.config)  # what train.py +model=imported builds
    hf_cli.export_from_checkpoint(ckpt, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written[k] for k in want} == want


def test_mixtral_router_fields_of_native_and_changed_models():
    """A meshtron-native Mixtral exports router_aux_loss_coef = aux_loss_coef / top_k, trained
    iff aux_loss_coef > 0; an imported one whose aux_loss_coef was changed exports the same way
    (its source fields no longer describe it)."""
    native = GPTConfig(
        arch="llama",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        vocab_size=200,
        seq_len=16,
        num_experts=4,
        top_k=2,
        aux_loss_coef=0.01,
    )
    assert mhf.hf_router_fields(native) == {"router_aux_loss_coef": 0.005, "output_router_logits": True}
    off = dataclasses.replace(native, aux_loss_coef=0.0)
    assert mhf.hf_router_fields(off) == {"router_aux_loss_coef": 0.0, "output_router_logits": False}
    imported = mhf.config_from_hf(hf_config("mixtral", output_router_logits=False, router_aux_loss_coef=0.02))
    changed = dataclasses.replace(imported, aux_loss_coef=0.1)
    assert mhf.hf_router_fields(changed) == {"router_aux_loss_coef": 0.05, "output_router_logits": True}
    for cfg in (native, off, changed):
        assert mhf.config_from_hf(mhf.hf_config_from_gpt(cfg)).aux_loss_coef == cfg.aux_loss_coef


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("output_router_logits", [True, False], ids=["aux", "no_aux"])
def test_mixtral_trains_like_transformers(output_router_logits, layers):
    """A one- or two-layer Mixtral (4 experts, top-2, fp32) trained 4 AdamW steps by transformers
    (objective: outputs.loss, with router_aux_loss_coef=0.02 x aux when output_router_logits)
    and by meshtron's train_step from the imported weights (one process, one microbatch per
    step, no clipping) trains the same objective: per-step totals LM + aux_loss_coef x aux
    agree to 1e-5 relative, and so do the weights after the steps."""
    from meshtron.training.step import train_step
    from tests.distributed import hf_cases as hc

    hf = hc.tiny_mixtral(output_router_logits, layers=layers)
    model, reducer, optimizer, mesh = hc.meshtron_trainer(hf)
    assert model.cfg.aux_loss_layers == "pooled"
    assert model.cfg.aux_loss_coef == (hc.AUX_COEF * 2 if output_router_logits else 0.0)
    hf_opt = hc.hf_adamw(hf)
    for step in range(hc.TRAIN_STEPS):
        batch = hc.train_batch(step)
        out = train_step(model, reducer, optimizer, [batch], mesh, lr=hc.TRAIN_LR, max_grad_norm=0.0)
        got, want = hc.meshtron_objective(out, model.cfg), hc.hf_train_step(hf, hf_opt, [batch])
        assert hc.relative(got, want) <= hc.TRAIN_RTOL, (step, got, want)
        if output_router_logits:  # the aux term is really in there
            assert hc.relative(float(out.loss), want) > 1e-3
    reducer.remove_hooks()
    assert hc.compare_trained_weights(mhf.export_hf_state_dict(model, mesh), hf, 1e-5) is None


def test_mixtral_cross_layer_pooling_gap_is_as_documented():
    """transformers pools all layers' router statistics into one aux; meshtron's default
    aux_loss_layers="sum" adds per-layer aux values (the gap documented in models/hf/ with
    hf_cases.pooling_gap's numbers). One layer: no gap. Two layers: the sum is ~2x the pooled
    aux / top_k, its per-layer mean within 2%, and the router gradients visibly differ, while
    "pooled" (what import picks) has the router gradients of transformers."""
    from tests.distributed.hf_cases import pooling_gap

    pooled = pooling_gap(layers=2, aux_loss_layers="pooled")
    assert max(pooled["router_grad_err"]) < 1e-5, pooled["router_grad_err"]
    assert abs(pooled["total_mt"][0] / pooled["total_hf"][0] - 1) < 1e-6
    one = pooling_gap(layers=1)
    assert abs(one["layers"][0][0] / one["pooled"][0] - 1) < 1e-6 and one["router_grad_err"][0] < 1e-5
    assert abs(one["total_mt"][0] / one["total_hf"][0] - 1) < 1e-6
    two = pooling_gap(layers=2)
    pooled, per_layer = two["pooled"][0], two["layers"][0]
    assert 1.9 < sum(per_layer) / pooled < 2.1
    assert abs(sum(per_layer) / 2 / pooled - 1) < 0.02
    # the router-gradient gaps models/hf/__init__.py documents (46% and 83%, layers 0 and 1)
    assert [round(e, 2) for e in two["router_grad_err"]] == [0.46, 0.83], two["router_grad_err"]
    assert abs(two["lm_mt"][0] / two["lm_hf"][0] - 1) < 1e-6  # same weights, same LM loss: only the aux differs


# ------------------------------------------------------------ shorter seq_len, original config fields


def test_gpt2_imported_at_a_shorter_seq_len_keeps_the_first_positions():
    """seq_len below n_positions: meshtron's table is wpe[:seq_len] and the logits on
    seq_len tokens are HF's; above n_positions it still refuses."""
    hf = hf_model("gpt2")
    cfg = mhf.config_from_hf(hf.config, seq_len=8)
    model = GPT(cfg, single_process_mesh()).eval()
    mhf.load_hf_state_dict(model, hf.state_dict())
    assert torch.equal(model.pos_embed, hf.state_dict()["transformer.wpe.weight"][:8])
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids).logits - logits(model, ids)).abs().max().item() <= ATOL
    with pytest.raises(mhf.HFConversionError, match="n_positions=32"):
        mhf.config_from_hf(hf.config, seq_len=33)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral"])
def test_config_written_over_the_original_keeps_its_fields(family):
    """Every original field is kept (dtype, ids, dropout, unknown fields, Mixtral's
    output_router_logits, the longer maximum positions); the shape comes from the model."""
    original = hf_config(
        family,
        pad_token_id=2,
        **({"output_router_logits": False, "router_aux_loss_coef": 0.02} if family == "mixtral" else {}),
    ).to_dict()
    arch = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
    original.update(dtype="bfloat16", custom_field=[1, {"a": None}], architectures=[arch])  # as save_pretrained
    cfg = dataclasses.replace(mhf.config_from_hf(original), seq_len=16)
    merged = mhf.hf_config_dict_over(cfg, original)
    assert merged == original | ({"rope_theta": cfg.rope_theta} if "rope_theta" in original else {})
    wider = dataclasses.replace(cfg, hidden_size=128)
    assert mhf.hf_config_dict_over(wider, original)["n_embd" if family == "gpt2" else "hidden_size"] == 128
    longer = dataclasses.replace(cfg, seq_len=48)
    assert mhf.hf_config_dict_over(longer, original)[mhf.MAX_POSITION_FIELDS[family]] == 48
    other = "llama" if family == "gpt2" else "gpt2"
    with pytest.raises(mhf.HFConversionError, match=f"model_type='{other}'"):
        mhf.hf_config_dict_over(cfg, dict(original, model_type=other))


def test_export_without_base_writes_seq_len_positions_and_in_vocab_ids(tmp_path):
    """Without --base the config is meshtron's alone: n_positions = seq_len, and
    generation_config.json keeps only ids inside the vocabulary."""
    cfg = GPTConfig(arch="gpt2", num_layers=1, hidden_size=32, num_heads=4, vocab_size=200, seq_len=16)
    model = GPT(cfg, single_process_mesh())
    path = hf_cli.save_checkpoint(
        tmp_path / "ckpt", hf_cli.TrainState(), [model], None, model.mesh, model_config=dataclasses.asdict(cfg)
    )
    out = hf_cli.export_from_checkpoint(path, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["n_positions"] == 16
    gen = json.loads((out / "generation_config.json").read_text())
    assert "eos_token_id" not in gen and "pad_token_id" not in gen  # GPT2Config's 50256 is no id of this model
