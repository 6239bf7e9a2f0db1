"""Hugging Face configs <-> GPTConfig (GPT-2, Llama 2/3.x, Mistral, Qwen2, Mixtral), the
conversion error and the optional-dependency checks. No torch.distributed, no files."""

from __future__ import annotations

import dataclasses

from meshtron.models.config import GPTConfig
from meshtron.models.rope import ROPE_SCALING_KEYS, ROPE_SCALING_OPTIONAL

SUPPORTED_MODEL_TYPES = (
    "gpt2",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
)
QWEN_MOE = ("qwen2_moe", "qwen3_moe")


class HFConversionError(ValueError):
    """A Hugging Face config or state dict that meshtron cannot convert; the message names
    the field or tensor."""


def require_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Hugging Face interop needs `transformers` (and `safetensors`); "
            "install the optional extra: pip install 'meshtron[hf]'"
        ) from exc
    return transformers


def require_safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover
        raise ImportError(
            "Hugging Face interop needs `safetensors`; install the optional extra: pip install 'meshtron[hf]'"
        ) from exc
    return safetensors.torch


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def _get(hf, name, default=None):
    return hf.get(name, default) if isinstance(hf, dict) else getattr(hf, name, default)


def _fail(model_type: str, field: str, value, why: str) -> HFConversionError:
    return HFConversionError(f"{model_type} config field {field}={value!r} is not supported by meshtron: {why}")


def _scaling_from_hf(params: dict, field: str, model_type: str, max_positions) -> dict | None:
    """GPTConfig.rope_scaling of an HF rope_parameters / rope_scaling dict (None: plain RoPE);
    a rope type meshtron does not compute raises naming `field`."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALING_KEYS:
        raise _fail(
            model_type,
            f"{field}.rope_type",
            rope_type,
            f"meshtron computes plain RoPE and {', '.join(ROPE_SCALING_KEYS)} scaling",
        )
    keys = ROPE_SCALING_KEYS[rope_type]
    scaling = {"rope_type": rope_type, **{k: params.get(k) for k in keys}}
    # yarn's optional keys as the config holds them (absent or null: transformers' default)
    scaling.update({k: params[k] for k in ROPE_SCALING_OPTIONAL[rope_type] if params.get(k) is not None})
    if scaling.get("original_max_position_embeddings") is None:  # transformers' fallback
        scaling["original_max_position_embeddings"] = max_positions
    if rope_type == "yarn" and scaling["factor"] is None and max_positions:  # transformers' fallback
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    missing = [k for k in keys if scaling[k] is None]
    if missing:
        raise _fail(model_type, f"{field}.{missing[0]}", None, f"{rope_type} RoPE scaling needs it")
    return scaling


def _rope(hf, model_type: str) -> tuple[float, dict | None]:
    """(theta, GPTConfig.rope_scaling) of the config's RoPE; partial rotary or a scaling
    meshtron does not compute raises naming the field."""
    max_positions = _get(hf, "max_position_embeddings")
    params = _get(hf, "rope_parameters")
    theta, scaling = None, None
    if isinstance(params, dict):
        factor = params.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise _fail(model_type, "rope_parameters.partial_rotary_factor", factor, "RoPE covers the whole head")
        scaling = _scaling_from_hf(params, "rope_parameters", model_type, max_positions)
        theta = params.get("rope_theta")
    old = _get(hf, "rope_scaling")
    if old and not isinstance(params, dict):
        scaling = _scaling_from_hf(old, "rope_scaling", model_type, max_positions)
    factor = _get(hf, "partial_rotary_factor", 1.0)
    if factor not in (None, 1.0):
        raise _fail(model_type, "partial_rotary_factor", factor, "RoPE covers the whole head")
    return float(theta if theta is not None else _get(hf, "rope_theta", 10000.0)), scaling


def _sliding_window(hf, model_type: str) -> tuple[int | None, bool]:
    """(the attention window of a Mistral / Mixtral / Qwen2 / Qwen3 config, None: full causal;
    whether every layer slides). Qwen's window needs use_sliding_window and applies to the
    layers whose layer_types entry is sliding_attention (without layer_types: the layers from
    max_window_layers on, as transformers builds them)."""
    window = _get(hf, "sliding_window")
    qwen = model_type in ("qwen2", "qwen3", *QWEN_MOE)
    if window is None or not _get(hf, "use_sliding_window", not qwen):
        return None, True
    if not qwen:
        return window, True
    layer_types = _get(hf, "layer_types")
    if layer_types is None:
        layers, first = _get(hf, "num_hidden_layers"), _get(hf, "max_window_layers", 0) or 0
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    sliding = [kind == "sliding_attention" for kind in layer_types]
    if not any(sliding):
        return None, True
    return window, all(sliding)


def aux_loss_coef_from_hf(router: dict, top_k: int) -> float:
    """meshtron's `aux_loss_coef` for a Mixtral config's `router` fields
    {"router_aux_loss_coef", "output_router_logits"}: transformers trains the aux loss only
    with output_router_logits=True, and its (one-layer) aux is top_k x meshtron's."""
    return float(router["router_aux_loss_coef"]) * top_k if router["output_router_logits"] else 0.0


def hf_router_fields(cfg: GPTConfig) -> dict:
    """The Mixtral config's {"router_aux_loss_coef", "output_router_logits"} for `cfg`: the
    imported ones (cfg.hf_router_fields) while they still import as cfg.aux_loss_coef (so a
    Mixtral imported and trained exports its own fields, output_router_logits=False with a
    nonzero coefficient included), else aux_loss_coef / top_k, trained iff aux_loss_coef > 0."""
    original = cfg.hf_router_fields
    if original is not None and aux_loss_coef_from_hf(original, cfg.top_k) == cfg.aux_loss_coef:
        return {
            "router_aux_loss_coef": float(original["router_aux_loss_coef"]),
            "output_router_logits": bool(original["output_router_logits"]),
        }
    return {"router_aux_loss_coef": cfg.aux_loss_coef / cfg.top_k, "output_router_logits": cfg.aux_loss_coef > 0}


def check_model_type(model_type) -> None:
    """Raise HFConversionError unless `model_type` is one of SUPPORTED_MODEL_TYPES."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConversionError(
            f"config field model_type={model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
        )


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2, Llama, Mistral, Qwen2 or Mixtral config (a
    `PretrainedConfig` or its dict). Dropout is 0; `overrides` replace any GPTConfig field afterwards
    (e.g. seq_len, dropout, kernel_backend); a `seq_len` override must lie in 1..the model's
    maximum positions. Raises HFConversionError naming the field for any HF feature meshtron
    would not reproduce exactly, or for values that make no valid model."""
    model_type = _get(hf_config, "model_type")
    check_model_type(model_type)
    try:
        cfg = _gpt_config_from_hf(hf_config, model_type)
    except HFConversionError:
        raise
    except ValueError as err:  # GPTConfig.validate: the HF shape makes no valid model
        raise HFConversionError(f"{model_type} config describes a model meshtron cannot build: {err}") from None
    seq_len = overrides.get("seq_len")
    if seq_len is not None and not 1 <= seq_len <= cfg.seq_len:
        field = "n_positions" if model_type == "gpt2" else "max_position_embeddings"
        raise HFConversionError(
            f"seq_len={seq_len} (meshtron-hf import --seq-len) must be between 1 and the "
            f"{model_type} config field {field}={cfg.seq_len}: the model has no positions "
            f"beyond it"
        )
    window, every_layer = (None, True) if model_type == "gpt2" else _sliding_window(hf_config, model_type)
    if window is not None:
        used = seq_len if seq_len is not None else cfg.seq_len
        if window < used and not every_layer:
            raise _fail(
                model_type,
                "max_window_layers",
                _get(hf_config, "max_window_layers"),
                f"meshtron's sliding_window={window} applies to every layer, and this config slides only "
                f"some (layer_types / max_window_layers); a window >= the sequence length ({used}) is full "
                f"causal attention and imports (--seq-len {window})",
            )
        overrides = {**overrides, "sliding_window": window}
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _qwen_moe_fields(hf, model_type: str) -> dict:
    """The MoE fields of a Qwen2-MoE / Qwen3-MoE config: softmax top-k routing renormalized
    iff norm_topk_prob, MoE layers every decoder_sparse_step-th but mlp_only_layers, the
    router losses as Mixtral's (pooled across layers); Qwen2-MoE's shared expert, one MLP of
    shared_expert_intermediate_size behind a sigmoid gate."""
    top_k = _get(hf, "num_experts_per_tok")
    router = {
        "router_aux_loss_coef": float(_get(hf, "router_aux_loss_coef", 0.001)),
        "output_router_logits": bool(_get(hf, "output_router_logits", False)),
    }
    shared = _get(hf, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return dict(
        num_experts=_get(hf, "num_experts"),
        top_k=top_k,
        moe_every=_get(hf, "decoder_sparse_step", 1) or 1,
        moe_dense_layers=list(_get(hf, "mlp_only_layers", None) or []) or None,
        moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"),
        capacity_factor=None,
        aux_loss_coef=aux_loss_coef_from_hf(router, top_k),
        z_loss_coef=0.0,
        router_score="softmax",
        router_renormalize=bool(_get(hf, "norm_topk_prob", False)),
        router_bias_update_rate=0.0,
        shared_experts=1 if shared else 0,
        shared_ffn_hidden_size=shared or None,
        shared_expert_gate=bool(shared),
        aux_loss_scope="microbatch",
        aux_loss_layers="pooled",
        hf_router_fields=router,
    )


def _deepseek_v3_config(hf) -> GPTConfig:
    """DeepSeek-V3: multi-head latent attention (model.attention=mla), the first
    first_k_dense_replace layers dense, then MoE layers of n_routed_experts sigmoid-scored
    experts (top-k renormalized, times routed_scaling_factor; e_score_correction_bias is the
    router's expert_bias) inside the best topk_group of n_group groups, plus n_shared_experts
    ungated shared experts. transformers trains no balancing loss and never moves the bias:
    aux, z and the bias update rate are 0 (set model.router_bias_update_rate to train it)."""
    t = "deepseek_v3"
    if _get(hf, "hidden_act", "silu") != "silu":
        raise _fail(t, "hidden_act", _get(hf, "hidden_act"), "meshtron's MLP and experts are SwiGLU (silu)")
    if _get(hf, "attention_bias", False):
        raise _fail(t, "attention_bias", True, "meshtron's latent attention has no biases")
    if not _get(hf, "norm_topk_prob", True):
        raise _fail(t, "norm_topk_prob", False, "sigmoid router weights are always renormalized over the k")
    eps = float(_get(hf, "rms_norm_eps", 1e-6))
    if eps != 1e-6:  # transformers' latent norms keep the default 1e-6; meshtron's use model.norm_eps
        raise _fail(t, "rms_norm_eps", eps, "the latent RMSNorms use 1e-6 in transformers: meshtron needs equal eps")
    heads, groups, topk_groups = _get(hf, "num_attention_heads"), _get(hf, "n_group") or 1, _get(hf, "topk_group") or 1
    top_k = _get(hf, "num_experts_per_tok")
    if groups > 1 and top_k // topk_groups != 2:
        raise _fail(
            t,
            "topk_group",
            topk_groups,
            f"transformers scores a group by its best 2 experts; meshtron by its best "
            f"num_experts_per_tok // topk_group = {top_k // topk_groups}: they agree only at 2",
        )
    theta, scaling = _rope(hf, t)
    return GPTConfig(
        arch="llama",
        num_layers=_get(hf, "num_hidden_layers"),
        hidden_size=_get(hf, "hidden_size"),
        num_heads=heads,
        num_kv_heads=heads,
        ffn_hidden_size=_get(hf, "intermediate_size"),
        vocab_size=_get(hf, "vocab_size"),
        seq_len=_get(hf, "max_position_embeddings"),
        dropout=0.0,
        bias=False,
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        init_std=float(_get(hf, "initializer_range", 0.02)),
        norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        attention="mla",
        q_lora_rank=_get(hf, "q_lora_rank"),
        kv_lora_rank=_get(hf, "kv_lora_rank"),
        qk_nope_head_dim=_get(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(hf, "qk_rope_head_dim"),
        v_head_dim=_get(hf, "v_head_dim"),
        num_experts=_get(hf, "n_routed_experts") or _get(hf, "num_local_experts"),
        top_k=top_k,
        moe_first_dense=_get(hf, "first_k_dense_replace", 0) or 0,
        moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"),
        capacity_factor=None,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
        router_score="sigmoid",
        router_renormalize=True,
        router_bias_update_rate=0.0,
        router_groups=groups if groups > 1 else 0,
        router_topk_groups=topk_groups if groups > 1 else 0,
        router_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0)),
        shared_experts=_get(hf, "n_shared_experts", 0) or 0,
    )


def _gpt_config_from_hf(hf, model_type: str) -> GPTConfig:
    """config_from_hf without overrides, for a supported `model_type`."""
    if model_type == "deepseek_v3":
        return _deepseek_v3_config(hf)
    if _get(hf, "is_encoder_decoder", False) or _get(hf, "add_cross_attention", False):
        raise _fail(model_type, "add_cross_attention", True, "decoder-only models only")
    tie = bool(_get(hf, "tie_word_embeddings", model_type == "gpt2"))
    if model_type == "gpt2":
        return _gpt2_config(hf, tie)
    return _llama_like_config(hf, model_type, tie)


def _gpt2_config(hf, tie: bool) -> GPTConfig:
    """The GPTConfig of a GPT-2 config (tanh GeLU, attention scaled by 1/sqrt(head_dim) only);
    `tie` is its tie_word_embeddings."""
    model_type = "gpt2"
    act = _get(hf, "activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _fail(
            model_type,
            "activation_function",
            act,
            "meshtron's GPT-2 MLP uses tanh-approximate GeLU (gelu_new / gelu_pytorch_tanh)",
        )
    if not _get(hf, "scale_attn_weights", True):
        raise _fail(model_type, "scale_attn_weights", False, "attention is always scaled by 1/sqrt(head_dim)")
    if _get(hf, "scale_attn_by_inverse_layer_idx", False):
        raise _fail(model_type, "scale_attn_by_inverse_layer_idx", True, "no per-layer attention scaling")
    h = _get(hf, "n_embd")
    return GPTConfig(
        arch="gpt2",
        num_layers=_get(hf, "n_layer"),
        hidden_size=h,
        num_heads=_get(hf, "n_head"),
        ffn_hidden_size=_get(hf, "n_inner") or 4 * h,
        vocab_size=_get(hf, "vocab_size"),
        seq_len=_get(hf, "n_positions"),
        dropout=0.0,
        tie_embeddings=tie,
        init_std=float(_get(hf, "initializer_range", 0.02)),
        norm_eps=float(_get(hf, "layer_norm_epsilon", 1e-5)),
    )


def _llama_bias(hf, model_type: str) -> bool:
    """The config's attention_bias, which must equal its mlp_bias (meshtron has one switch)."""
    attn_bias = bool(_get(hf, "attention_bias", False))
    mlp_bias = bool(_get(hf, "mlp_bias", False))
    if attn_bias != mlp_bias:
        raise _fail(
            model_type,
            "attention_bias",
            attn_bias,
            f"meshtron has one bias switch for attention and MLP, and mlp_bias={mlp_bias}",
        )
    return attn_bias


def _mixtral_fields(hf, model_type: str, attn_bias: bool) -> dict:
    """The MoE fields of a Mixtral config: every layer MoE, softmax top-k routing renormalized,
    no router jitter nor expert biases, the router losses pooled across layers."""
    if _get(hf, "router_jitter_noise", 0.0):
        raise _fail(
            model_type,
            "router_jitter_noise",
            _get(hf, "router_jitter_noise"),
            "meshtron's router has no input jitter",
        )
    if attn_bias:
        raise _fail(model_type, "attention_bias", attn_bias, "meshtron's experts have no biases")
    top_k = _get(hf, "num_experts_per_tok")
    router = {
        "router_aux_loss_coef": float(_get(hf, "router_aux_loss_coef", 0.001)),
        "output_router_logits": bool(_get(hf, "output_router_logits", False)),
    }
    return dict(
        num_experts=_get(hf, "num_local_experts"),
        top_k=top_k,
        moe_every=1,
        moe_ffn_hidden_size=_get(hf, "intermediate_size"),
        capacity_factor=None,
        aux_loss_coef=aux_loss_coef_from_hf(router, top_k),
        z_loss_coef=0.0,
        router_score="softmax",
        router_renormalize=True,
        router_bias_update_rate=0.0,
        shared_experts=0,
        aux_loss_scope="microbatch",
        aux_loss_layers="pooled",
        hf_router_fields=router,
    )


def _llama_like_config(hf, model_type: str, tie: bool) -> GPTConfig:
    """The GPTConfig of a Llama, Mistral, Qwen2/Qwen3 or Mixtral / Qwen-MoE config (SwiGLU,
    RMSNorm, RoPE); `tie` is its tie_word_embeddings."""
    act = _get(hf, "hidden_act", "silu")
    if act != "silu":
        raise _fail(model_type, "hidden_act", act, "meshtron's Llama MLP is SwiGLU (silu)")
    h, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    head_dim = _get(hf, "head_dim")
    # a head width of its own (Qwen3's 128 at hidden 1024 / 16 heads): model.kv_channels
    kv_channels = head_dim if head_dim is not None and head_dim * heads != h else None
    attn_bias = _llama_bias(hf, model_type)
    seq_len = _get(hf, "max_position_embeddings")
    theta, scaling = _rope(hf, model_type)
    extra = {}
    if model_type == "mixtral":
        extra = _mixtral_fields(hf, model_type, attn_bias)
    if model_type in QWEN_MOE:
        extra = _qwen_moe_fields(hf, model_type)
    return GPTConfig(
        arch="llama",
        num_layers=_get(hf, "num_hidden_layers"),
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=_get(hf, "num_key_value_heads") or heads,
        ffn_hidden_size=_get(hf, "intermediate_size"),
        vocab_size=_get(hf, "vocab_size"),
        seq_len=seq_len,
        dropout=0.0,
        bias=attn_bias,
        tie_embeddings=tie,
        init_std=float(_get(hf, "initializer_range", 0.02)),
        norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
        # Qwen2 (and Qwen2-MoE, its own qkv_bias field): q/k/v biases only
        qkv_bias=attn_bias or model_type == "qwen2" or (model_type == "qwen2_moe" and bool(_get(hf, "qkv_bias", True))),
        kv_channels=kv_channels,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_theta=theta,
        rope_scaling=scaling,
        hf_model_type="mistral" if model_type == "mistral" else None,
        **extra,
    )


def hf_family(cfg: GPTConfig) -> str:
    """ "gpt2", "llama", "mistral", "qwen2", "qwen3" or "mixtral": the HF architecture that holds
    exactly `cfg`'s model (Mistral: Llama's, named by cfg.hf_model_type; Qwen2: q/k/v biases
    without the others; Qwen3: QK-norm); raises HFConversionError naming the GPTConfig field
    that no HF family can express."""

    def bad(field, value, why):
        return HFConversionError(f"model.{field}={value!r} has no Hugging Face equivalent: {why}")

    if cfg.arch == "gpt2":
        wanted = dict(norm="layernorm", activation="gelu", position="learned", bias=True)
    else:
        wanted = dict(norm="rmsnorm", activation="swiglu", position="rope")
    for field, value in wanted.items():
        if getattr(cfg, field) != value:
            raise bad(field, getattr(cfg, field), f"arch={cfg.arch} in Hugging Face needs {value!r}")
    if cfg.attention == "mla":
        return _deepseek_family(cfg, bad)
    qwen_moe = cfg.is_moe and (cfg.qk_norm or cfg.shared_experts > 0)  # Qwen3-MoE / Qwen2-MoE
    if cfg.rope_scaling is not None and cfg.is_moe and not qwen_moe:
        raise bad("rope_scaling", cfg.rope_scaling, "Mixtral has plain RoPE")
    if cfg.qkv_bias != cfg.bias and (cfg.bias or cfg.hf_model_type is not None or (cfg.is_moe and not qwen_moe)):
        raise bad("qkv_bias", cfg.qkv_bias, "q/k/v biases alone are Qwen2's and Qwen2-MoE's: model.bias=false")
    if cfg.qk_norm and (cfg.bias or cfg.qkv_bias or cfg.hf_model_type is not None or cfg.shared_experts):
        raise bad("qk_norm", cfg.qk_norm, "QK-norm is Qwen3's and Qwen3-MoE's: no biases, no shared experts")
    if cfg.arch == "gpt2":
        if cfg.kv_channels is not None:
            raise bad("kv_channels", cfg.kv_channels, "GPT-2's heads are hidden_size / n_head wide")
        if cfg.num_kv_heads != cfg.num_heads:
            raise bad("num_kv_heads", cfg.num_kv_heads, "GPT-2 has no grouped-query attention")
        if cfg.is_moe:
            raise bad("num_experts", cfg.num_experts, "GPT-2 has no MoE variant (use arch=llama: Mixtral)")
        return "gpt2"
    if not cfg.is_moe:
        if cfg.qk_norm:
            return "qwen3"
        if cfg.qkv_bias and not cfg.bias:
            return "qwen2"
        if cfg.hf_model_type == "mistral" and cfg.bias:
            raise bad("bias", cfg.bias, "Mistral has no biases")
        return cfg.hf_model_type or "llama"
    family = "qwen3_moe" if cfg.qk_norm else "qwen2_moe" if cfg.shared_experts else "mixtral"
    name = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral"}[family]
    checks = [
        ("router_score", "softmax"),
        ("bias", False),
        ("router_groups", 0),
        ("router_scaling_factor", 1.0),
        ("moe_first_dense", 0),
    ]
    if family == "mixtral":
        checks += [("moe_every", 1), ("moe_dense_layers", None), ("router_renormalize", True)]
    if family == "qwen2_moe":
        checks += [("shared_experts", 1), ("shared_expert_gate", True)]
    for field, value in checks:
        if getattr(cfg, field) != value:
            raise bad(field, getattr(cfg, field), f"{name} needs {value!r}")
    return family


def _deepseek_family(cfg: GPTConfig, bad) -> str:
    """ "deepseek_v3" for a latent-attention model DeepSeek-V3's config can hold, else the field."""
    checks = [
        ("arch", "llama"),
        ("bias", False),
        ("router_score", "sigmoid"),
        ("moe_every", 1),
        ("moe_dense_layers", None),
        ("shared_expert_gate", False),
        ("shared_ffn_hidden_size", None),
        ("norm_eps", 1e-6),
    ]
    if not cfg.is_moe:
        raise bad("num_experts", cfg.num_experts, "DeepSeek-V3's latent attention comes with MoE layers")
    for field, value in checks:
        if getattr(cfg, field) != value:
            raise bad(field, getattr(cfg, field), f"DeepSeek-V3 needs {value!r}")
    if cfg.router_groups and cfg.top_k // cfg.router_topk_groups != 2:
        raise bad("router_topk_groups", cfg.router_topk_groups, "DeepSeek-V3 scores a group by its best 2 experts")
    return "deepseek_v3"


def _hf_fields(cfg: GPTConfig) -> tuple[str, dict]:
    """(family, the transformers config fields that describe `cfg`'s model)."""
    transformers = require_transformers()
    family = hf_family(cfg)
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std)
    if family == "gpt2":
        return family, _gpt2_hf_fields(cfg, common)
    kw = dict(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        attention_dropout=cfg.attention_dropout_p,
        **common,
    )
    kw.update(_hf_rope_fields(cfg, transformers))
    if family in ("mistral", "qwen2", "qwen3"):
        kw.update(_dense_hf_fields(cfg, family))
    elif family == "llama":
        kw.update(_llama_hf_fields(cfg))
    elif family == "deepseek_v3":
        kw.update(_deepseek_v3_hf_fields(cfg))
    elif family in QWEN_MOE:
        kw.update(_qwen_moe_hf_fields(cfg, family))
    else:
        kw.update(_mixtral_hf_fields(cfg))
    return family, kw


def _gpt2_hf_fields(cfg: GPTConfig, common: dict) -> dict:
    """The GPT2Config fields of `cfg`, `common` (vocabulary, tying, init) included."""
    return dict(
        n_positions=cfg.seq_len,
        n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        n_inner=cfg.ffn_hidden_size,
        activation_function="gelu_new",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.attention_dropout_p,
        architectures=["GPT2LMHeadModel"],
        **common,
    )


def _hf_rope_fields(cfg: GPTConfig, transformers) -> dict:
    """The RoPE fields of `cfg`: rope_parameters for transformers 5, rope_theta + rope_scaling
    for 4.x."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {**(cfg.rope_scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": None if cfg.rope_scaling is None else dict(cfg.rope_scaling)}


def _dense_hf_fields(cfg: GPTConfig, family: str) -> dict:
    """The Mistral / Qwen2 / Qwen3 fields of `cfg` beyond the Llama-style common ones."""
    kw = dict(
        intermediate_size=cfg.ffn_hidden_size,
        head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window,
        architectures=[_CONFIG_CLASSES[family].replace("Config", "ForCausalLM")],
    )
    if family == "qwen3":
        kw.update(attention_bias=False)
    if family in ("qwen2", "qwen3"):
        kw.update(use_sliding_window=cfg.sliding_window is not None, max_window_layers=0)
    return kw


def _llama_hf_fields(cfg: GPTConfig) -> dict:
    """The Llama fields of `cfg` beyond the Llama-style common ones."""
    return dict(
        intermediate_size=cfg.ffn_hidden_size,
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
        head_dim=cfg.head_dim,
        architectures=["LlamaForCausalLM"],
    )


def _deepseek_v3_hf_fields(cfg: GPTConfig) -> dict:
    """The DeepSeek-V3 fields of `cfg` beyond the Llama-style common ones: MoE routing,
    latent-attention (MLA) widths and the multi-token-prediction depth."""
    return dict(
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        n_shared_experts=cfg.shared_experts,
        routed_scaling_factor=cfg.router_scaling_factor,
        n_group=cfg.router_groups or 1,
        topk_group=cfg.router_topk_groups or 1,
        first_k_dense_replace=cfg.moe_first_dense,
        norm_topk_prob=True,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=True,
        attention_bias=False,
        num_nextn_predict_layers=cfg.mtp_depths,  # the MTP layers the exported weights hold
        architectures=["DeepseekV3ForCausalLM"],
    )


def _qwen_moe_hf_fields(cfg: GPTConfig, family: str) -> dict:
    """The Qwen2-MoE / Qwen3-MoE fields of `cfg` beyond the Llama-style common ones (Qwen2-MoE:
    its shared expert and q/k/v bias switch)."""
    kw = dict(
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.router_renormalize,
        decoder_sparse_step=cfg.moe_every,
        mlp_only_layers=list(cfg.moe_dense_layers or []),
        head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window,
        use_sliding_window=cfg.sliding_window is not None,
        max_window_layers=0,
        architectures=[_CONFIG_CLASSES[family].replace("Config", "ForCausalLM")],
        **hf_router_fields(cfg),
    )
    if family == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=cfg.moe().shared_width, qkv_bias=bool(cfg.qkv_bias))
    else:
        kw.update(attention_bias=False)
    return kw


def _mixtral_hf_fields(cfg: GPTConfig) -> dict:
    """The Mixtral fields of `cfg` beyond the Llama-style common ones."""
    return dict(
        intermediate_size=cfg.moe_ffn_hidden_size,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        sliding_window=cfg.sliding_window,
        architectures=["MixtralForCausalLM"],
        **hf_router_fields(cfg),
        **({"head_dim": cfg.head_dim} if cfg.kv_channels else {}),  # else transformers' own (None)
    )


_CONFIG_CLASSES = {
    "gpt2": "GPT2Config",
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "mixtral": "MixtralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
}


def hf_config_from_gpt(cfg: GPTConfig, **overrides):
    """A transformers config (GPT2Config, LlamaConfig or MixtralConfig) describing `cfg`'s
    model; `overrides` are passed to the config class (e.g. bos_token_id)."""
    family, kw = _hf_fields(cfg)
    return getattr(require_transformers(), _CONFIG_CLASSES[family])(**{**kw, **overrides})


# Fields of the original config.json that export keeps although meshtron has a value for them:
# training-only hyperparameters (an imported model trains with dropout 0 unless told otherwise,
# which says nothing about the checkpoint) and the maximum positions (below).
_KEEP_ORIGINAL = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "initializer_range")
MAX_POSITION_FIELDS = {"gpt2": "n_positions", **{t: "max_position_embeddings" for t in SUPPORTED_MODEL_TYPES[1:]}}


def hf_config_dict_over(cfg: GPTConfig, original: dict) -> dict:
    """The config.json of `cfg`'s model written over `original`, the imported model's own
    config.json: every original field is kept (dtype, bos/eos/pad ids, output_router_logits,
    fields meshtron does not know) except those that describe the model's shape, which come
    from `cfg`; dropout and initializer_range stay the original's, and the maximum positions
    are max(original, cfg.seq_len) (a model imported at a shorter seq_len keeps its context:
    GPT-2's untrained rows come from the original table, see training/hf_cli.py). Raises
    HFConversionError when `original` is of another model_type than `cfg`'s family."""
    family, kw = _hf_fields(cfg)
    if original.get("model_type") != family:
        raise HFConversionError(
            f"the original config.json has model_type={original.get('model_type')!r} but "
            f"this model exports as {family!r}: --base names another model"
        )
    merged = dict(original)
    merged.update({k: v for k, v in kw.items() if k not in _KEEP_ORIGINAL or k not in original})
    if family == "gpt2" and original.get("n_inner") is None and cfg.ffn_hidden_size == 4 * cfg.hidden_size:
        merged["n_inner"] = None  # the original's spelling of 4 x n_embd
    positions = MAX_POSITION_FIELDS[family]
    if isinstance(original.get(positions), int):
        merged[positions] = max(original[positions], cfg.seq_len)
    if family != "gpt2" and "rope_parameters" in kw and "rope_theta" in original:
        merged["rope_theta"] = cfg.rope_theta  # a 4.x config: keep both spellings equal
    if family != "gpt2" and "rope_parameters" in kw and original.get("rope_scaling") is not None:
        merged["rope_scaling"] = None if cfg.rope_scaling is None else dict(cfg.rope_scaling)
    return merged
