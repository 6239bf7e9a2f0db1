"""Issue 39's Hugging Face families, single process: tiny random (fp32) Mistral, Llama 3.1
(rope_type llama3) and Qwen2 (q/k/v biases only) models from `transformers` load into meshtron
with transformers' logits (max abs error <= 1e-5), export back bitwise and through a folder
that `AutoModelForCausalLM` loads as the same class, follow transformers' AdamW trajectory for
a few steps, and configs round-trip. YaRN RoPE and sliding windows smaller than the sequence:
tests/test_hf_yarn_window.py; a RoPE type meshtron does not compute is refused in one line
naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshtron.models.config import GPTConfig
from meshtron.models.gpt import GPT
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from meshtron.models import hf as mhf  # noqa: E402
from tests.distributed import hf_cases as hc  # noqa: E402

FAMILIES = ["mistral", "llama3", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3"]
ATOL = 1e-5


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, hc.VOCAB, (2, hc.SEQ), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model.full_logits(model(ids))


@pytest.fixture(scope="module", params=FAMILIES)
def imported(request):
    hf = hc.hf_model(request.param)
    model = GPT(mhf.config_from_hf(hf.config), single_process_mesh()).eval()
    mhf.load_hf_state_dict(model, hf.state_dict())
    return request.param, hf, model


def test_logits_match_transformers(imported):
    family, hf, model = imported
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
    err = (_logits(model, ids) - want).abs().max().item()
    assert err <= ATOL, (family, err)


def test_family_features_are_imported(imported):
    family, hf, model = imported
    cfg = model.cfg
    if family == "mistral":
        assert cfg.hf_model_type == "mistral" and mhf.hf_family(cfg) == "mistral"
    elif family == "llama3":
        assert cfg.rope_scaling == {k: v for k, v in hc.LLAMA3_ROPE.items() if k != "rope_theta"}
    elif family == "qwen3":
        assert cfg.qk_norm and cfg.kv_channels == 24 and cfg.head_dim == 24 and mhf.hf_family(cfg) == "qwen3"
        attn = model.layers["0"].attn
        assert attn.q_norm.shape == attn.k_norm.shape == (24,) and attn.proj.weight.shape == (64, 4 * 24)
    elif family == "deepseek_v3":
        assert cfg.attention == "mla" and mhf.hf_family(cfg) == "deepseek_v3"
        assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True] and cfg.router_score == "sigmoid"
        assert (cfg.router_groups, cfg.router_topk_groups, cfg.router_scaling_factor) == (4, 2, 2.5)
        bias = model.layers["1"].mlp.router.expert_bias
        assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias) and bias.abs().sum() > 0
    elif family in ("qwen3_moe", "qwen2_moe"):
        assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True] and mhf.hf_family(cfg) == family
        assert cfg.num_experts == 8 and cfg.top_k == 3 and cfg.aux_loss_layers == "pooled"
        assert cfg.router_renormalize == (family == "qwen3_moe") and cfg.qk_norm == (family == "qwen3_moe")
        assert cfg.shared_expert_gate == (family == "qwen2_moe") and cfg.qkv_bias == (family == "qwen2_moe")
        assert cfg.moe().shared_width == (48 if family == "qwen2_moe" else 0)
    else:
        assert cfg.qkv_bias and not cfg.bias
        assert model.layers["0"].attn.qkv.bias is not None and model.layers["0"].attn.proj.bias is None


def test_export_round_trip(imported, tmp_path):
    """Bitwise state dict, and a folder transformers loads as the same class with the same
    logits and whose config imports as the same GPTConfig."""
    family, hf, model = imported
    state = mhf.export_hf_state_dict(model, model.mesh)
    want = hf.state_dict()
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k], v) for k, v in want.items())
    mhf.save_hf_folder(state, mhf.hf_config_from_gpt(model.cfg), tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(loaded) is type(hf)
    ids = _ids(2)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hf(ids).logits)
    assert mhf.config_from_hf(loaded.config) == model.cfg


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_like_transformers(family):
    """4 AdamW steps (one process, one microbatch, no clipping) from the imported weights:
    per-step losses to 1e-6 relative (hc.STEP_RTOL; measured <= 2e-7) and every weight tensor
    afterwards to 1e-5 relative (measured <= 1.5e-6: rarely seen embedding rows gather fp32
    summation-order noise, see hf_cases.TRAIN_EPS), except Qwen2's k_proj biases at 1e-4 (measured 2.3e-5):
    a key bias only shifts scores through RoPE, so its gradient is tiny and AdamW's
    normalization turns that noise into full-size steps. The same loop runs at tp=2, pp=2 and
    cp=2 in tests/distributed/hf_cases.py."""
    hf = hc.hf_model(family, vocab_size=hc.TRAIN_VOCAB).train()
    hc.train_like_transformers(hf, None, loose=("k_proj.bias",) if family in ("qwen2", "qwen2_moe") else ())


# ------------------------------------------------------------------------------- Mistral


def test_mistral_window_at_least_the_sequence_is_full_attention():
    """A window >= the sequence length is full causal attention: accepted (also through a
    shorter --seq-len), kept in the config and exported back; the logits are transformers'."""
    hf = hc.hf_model("mistral", sliding_window=hc.SEQ)
    cfg = mhf.config_from_hf(hf.config, seq_len=hc.SEQ)
    assert cfg.sliding_window == hc.SEQ
    model = GPT(cfg, single_process_mesh()).eval()
    mhf.load_hf_state_dict(model, hf.state_dict())
    ids = _ids()
    with torch.no_grad():
        assert (_logits(model, ids) - hf(ids).logits).abs().max().item() <= ATOL
    assert mhf.hf_config_from_gpt(cfg).sliding_window == hc.SEQ
    assert mhf.config_from_hf(mhf.hf_config_from_gpt(cfg)) == cfg


@pytest.mark.parametrize("family", ["mistral", "mixtral", "qwen2"])
def test_smaller_sliding_window_imports(family):
    """A window shorter than the sequence imports (numerics: tests/test_hf_yarn_window.py)."""
    kw = dict(sliding_window=8, **({"use_sliding_window": True, "max_window_layers": 0} if family == "qwen2" else {}))
    assert mhf.config_from_hf(hc.hf_config(family, **kw)).attention_window == 8
    assert mhf.config_from_hf(hc.hf_config(family, **kw), seq_len=8).attention_window is None
    assert GPTConfig(arch="llama", seq_len=16, sliding_window=8).attention_window == 8


def test_qwen2_window_off_is_full_attention():
    """Qwen2's sliding_window only counts with use_sliding_window (its default is off)."""
    assert mhf.config_from_hf(hc.hf_config("qwen2", sliding_window=8)).sliding_window is None


# ------------------------------------------------------------------------------- RoPE scaling


def test_llama3_rope_from_the_4x_rope_scaling_spelling():
    """A transformers 4.x config.json (rope_theta + rope_scaling with `type`) imports the same
    scaling, and export written over it keeps both spellings equal."""
    new = hc.hf_config("llama3").to_dict()
    scaling = {k: v for k, v in hc.LLAMA3_ROPE.items() if k not in ("rope_theta", "rope_type")}
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=100.0, rope_scaling={"type": "llama3", **scaling})
    cfg = mhf.config_from_hf(old)
    assert cfg == mhf.config_from_hf(new)
    merged = mhf.hf_config_dict_over(cfg, old)
    assert merged["rope_scaling"] == {"rope_type": "llama3", **scaling} and merged["rope_theta"] == 100.0


def test_llama3_rope_falls_back_to_max_positions():
    """Without original_max_position_embeddings transformers uses max_position_embeddings."""
    params = {k: v for k, v in hc.LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    cfg = mhf.config_from_hf({**hc.hf_config("llama").to_dict(), "rope_parameters": params})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_unknown_rope_type_is_refused_in_one_line(field):
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    config = hc.hf_config("llama").to_dict()
    if field == "rope_parameters":
        config[field] = {**dynamic, "rope_theta": 1e4}
    else:
        config.pop("rope_parameters", None)
        config[field] = dynamic
    with pytest.raises(mhf.HFConversionError, match=rf"{field}\.rope_type='dynamic'") as err:
        mhf.config_from_hf(config)
    assert "\n" not in str(err.value) and "llama3, yarn" in str(err.value)


@pytest.mark.parametrize(
    "scaling,match",
    [
        ({"rope_type": "linear", "factor": 2.0}, "rope_type must be one of llama3, yarn"),
        ({"rope_type": "yarn", "factor": 2.0}, "missing original_max_position_embeddings"),
        ({"rope_type": "llama3", "factor": 8.0}, "missing low_freq_factor"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 64,
            },
            "high_freq_factor must be > low_freq_factor",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": -1.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "finite numbers > 0",
        ),
    ],
)
def test_rope_scaling_is_validated(scaling, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(arch="llama", rope_scaling=scaling)


# ------------------------------------------------------------------------------- Qwen2


def test_qwen2_qkv_bias_alone_has_no_other_family():
    """q/k/v biases with the other biases on have no HF family (Llama's attention_bias also
    biases o_proj); the native Qwen2 shape exports as Qwen2."""
    native = GPTConfig(arch="llama", num_layers=1, hidden_size=32, num_heads=4, qkv_bias=True)
    assert mhf.hf_family(native) == "qwen2"
    with pytest.raises(mhf.HFConversionError, match="model.qkv_bias"):
        mhf.hf_family(dataclasses.replace(native, bias=True, qkv_bias=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_import_export_keeps_the_family(family, tmp_path):
    """`meshtron-hf import` writes a model preset that builds the imported GPTConfig (the
    rope_scaling dict, qkv_bias, hf_model_type included) and `export` writes the source's
    model_type, architecture and RoPE fields back, with the original tensors."""
    import json

    from omegaconf import OmegaConf

    from meshtron.training import hf_cli

    hf = hc.hf_model(family)
    hf.save_pretrained(tmp_path / "src")
    ckpt = hf_cli.import_to_checkpoint(tmp_path / "src", tmp_path / "ckpt")
    preset = OmegaConf.to_container(OmegaConf.load(tmp_path / "ckpt" / "model" / "imported.yaml"))
    assert GPTConfig(**preset) == mhf.config_from_hf(hf.config)
    hf_cli.export_from_checkpoint(ckpt, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((tmp_path / "src" / "config.json").read_text())
    for key in ("model_type", "architectures", "rope_parameters", "sliding_window"):
        assert written.get(key) == source.get(key), key
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in hf.state_dict().items())


def test_llama_heads_of_their_own_width():
    """Any Llama-family config's head_dim other than hidden / heads (32 at 64 / 4) imports as
    model.kv_channels: logits equal transformers', and export writes the head_dim back."""
    hf = hc.hf_model("llama", head_dim=32)
    cfg = mhf.config_from_hf(hf.config)
    assert cfg.kv_channels == 32 and cfg.head_dim == 32 and not cfg.qk_norm
    model = GPT(cfg, single_process_mesh()).eval()
    mhf.load_hf_state_dict(model, hf.state_dict())
    ids = _ids()
    with torch.no_grad():
        assert (_logits(model, ids) - hf(ids).logits).abs().max().item() <= ATOL
    assert mhf.hf_config_from_gpt(cfg).head_dim == 32 and mhf.config_from_hf(mhf.hf_config_from_gpt(cfg)) == cfg


def test_deepseek_v3_mtp_module_in_the_checkpoint_is_ignored():
    """A DeepSeek-V3 checkpoint's MTP module (model.layers.<num_layers>.*, which transformers
    does not build either) loads without it; any other unknown tensor is still refused."""
    hf = hc.hf_model("deepseek_v3")
    cfg = mhf.config_from_hf(hf.config)
    state = dict(hf.state_dict())
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    state["model.layers.3.enorm.weight"] = torch.ones(64)
    model = GPT(cfg, single_process_mesh()).eval()
    mhf.load_hf_state_dict(model, state)
    ids = _ids()
    with torch.no_grad():
        assert (_logits(model, ids) - hf(ids).logits).abs().max().item() <= ATOL
    state["model.layers.1.surprise.weight"] = torch.zeros(2)
    with pytest.raises(mhf.HFConversionError, match="unexpected tensor model.layers.1.surprise.weight"):
        mhf.load_hf_state_dict(model, state)


def _deepseek_with_mtp(depths: int, seed: int) -> GPT:
    cfg = dataclasses.replace(mhf.config_from_hf(hc.hf_model("deepseek_v3").config), mtp_depths=depths)
    model = GPT(cfg, single_process_mesh())
    initialize_parameters(model, seed, model.mesh)
    return model


def _mtp_layer_keys(state: dict, index: int) -> set[str]:
    prefix = f"model.layers.{index}."
    return {k[len(prefix) :] for k in state if k.startswith(prefix)}


def test_deepseek_v3_mtp_depths_export_in_its_layout_and_import_back_exactly():
    """model.mtp_depths=2 exports as DeepSeek-V3's released checkpoint lays its MTP module out:
    layers 3 and 4 (past the model's 3) each hold enorm, hnorm, eh_proj, shared_head.norm, the
    copies of the embedding and head, and a whole (MoE) decoder layer; config.json says
    num_nextn_predict_layers=2. Read back into a differently initialized model, every parameter
    and buffer is equal."""
    source = _deepseek_with_mtp(2, seed=1)
    with torch.no_grad():  # norms told apart (all ones at initialization)
        for depth in source.mtp:
            for fill, norm in enumerate((depth.enorm, depth.hnorm, depth.norm), start=2):
                norm.weight.fill_(fill + 10 * depth.depth)
    state = mhf.export_hf_state_dict(source, single_process_mesh())
    for index, depth in ((3, 12), (4, 22)):
        assert [
            state[f"model.layers.{index}.{n}.weight"][0].item() for n in ("enorm", "hnorm", "shared_head.norm")
        ] == [
            depth,
            depth + 1,
            depth + 2,
        ]
    main_layer = _mtp_layer_keys(state, 2)  # the last main layer, an MoE layer
    mtp_own = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
    copies = {"embed_tokens.weight", "shared_head.head.weight"}
    for index in (3, 4):
        assert _mtp_layer_keys(state, index) == main_layer | mtp_own | copies
        assert torch.equal(state[f"model.layers.{index}.embed_tokens.weight"], state["model.embed_tokens.weight"])
        assert torch.equal(state[f"model.layers.{index}.shared_head.head.weight"], state["lm_head.weight"])
    assert torch.equal(state["model.layers.4.eh_proj.weight"], source.mtp[1].proj.detach())
    assert mhf.hf_config_from_gpt(source.cfg).num_nextn_predict_layers == 2
    target = _deepseek_with_mtp(2, seed=2)
    mhf.load_hf_state_dict(target, state)
    vocab = source.cfg.vocab_size  # the padding rows past it are not exported
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items(), strict=True):
        if name in ("embed.weight", "head.weight"):
            a, b = a[:vocab], b[:vocab]
        if not name.endswith("step_load"):
            assert torch.equal(a, b), name


def test_deepseek_v3_mtp_depths_the_checkpoint_lacks_start_fresh():
    """A checkpoint with one MTP depth read into a model with two: depth 1 is the checkpoint's,
    depth 2 keeps its initial values (and its router's expert bias starts at zero); a
    checkpoint's depths past the model's are not read."""
    one = mhf.export_hf_state_dict(_deepseek_with_mtp(1, seed=1), single_process_mesh())
    fresh = _deepseek_with_mtp(2, seed=2)
    initial = {k: v.clone() for k, v in fresh.mtp[1].state_dict().items()}
    mhf.load_hf_state_dict(fresh, one)
    assert torch.equal(fresh.mtp[0].proj.detach(), one["model.layers.3.eh_proj.weight"])
    for name, value in fresh.mtp[1].state_dict().items():
        if not name.endswith(("expert_bias", "step_load")):
            assert torch.equal(value, initial[name]), name
    without = _deepseek_with_mtp(0, seed=3)
    mhf.load_hf_state_dict(without, one)  # layer 3 is skipped, as transformers skips it


def test_mtp_weights_of_a_family_without_an_mtp_layout_are_refused_on_export():
    hf = hc.hf_model("qwen3")
    model = GPT(dataclasses.replace(mhf.config_from_hf(hf.config), mtp_depths=1), single_process_mesh())
    with pytest.raises(mhf.HFConversionError, match="model.mtp_depths=1: .* deepseek_v3 only, not qwen3"):
        mhf.export_hf_state_dict(model, single_process_mesh())
    mhf.load_hf_state_dict(model, hf.state_dict())  # import: the depth starts fresh


def test_training_from_a_deepseek_folder_chooses_its_mtp_depths(tmp_path):
    """checkpoint.init_from=hf:FOLDER with model.mtp_depths=1: the depth is the run's choice
    (not a contradiction of the folder's architecture), and a folder that holds no MTP layer
    (transformers saves none) passes the weight check: the depth starts fresh."""
    from meshtron.models.config import GPTConfig as Given
    from meshtron.training.hf_start import check_hf_weights, model_from_hf_folder

    hc.hf_model("deepseek_v3").save_pretrained(tmp_path)
    cfg = model_from_hf_folder(tmp_path, dataclasses.replace(Given(), mtp_depths=1, mtp_loss_weight=0.3))
    assert (cfg.mtp_depths, cfg.mtp_loss_weight, cfg.attention) == (1, 0.3, "mla")
    check_hf_weights(tmp_path, cfg)
