"""Hugging Face interop: configs, weight import/export and safetensors folders.

Supported families (transformers 4.40+ and 5.x naming):
    GPT-2    (`GPT2Config`, `GPT2LMHeadModel`)          <-> arch="gpt2"
    Llama    (`LlamaConfig`, `LlamaForCausalLM`)        <-> arch="llama"
    Mixtral  (`MixtralConfig`, `MixtralForCausalLM`)    <-> arch="llama" with num_experts > 0

    config_from_hf(hf_config, **overrides) -> GPTConfig
    hf_config_from_gpt(cfg, **overrides) -> transformers config
    load_hf_state_dict(model, state_dict)            every rank loads its shards from the full HF dict
    export_hf_state_dict(model, mesh) -> dict | None the full HF dict on global rank 0
    save_hf_folder(state_dict, hf_config, out_dir)   model.safetensors + config.json
    read_hf_folder(src_dir) -> (hf_config, state_dict)

Layout conversions (all exact, so import -> export is bitwise the identity):
- GPT-2 Conv1D weights are [in, out]: transposed into meshtron's [out, in].
- Attention: HF stores q, k, v (GPT-2: one [q; k; v] c_attn); meshtron's fused QKV rows are
  grouped per KV head, [q heads of group 0, k_0, v_0 | q heads of group 1, k_1, v_1 | ...]
  (see models/gpt.py). Both use rotate-half RoPE (HF Llama convention), so q/k rows are not
  permuted.
- Llama MLP: gate_proj/up_proj/down_proj are meshtron's mlp.gate/up/down (silu(gate) * up).
- Mixtral experts: transformers 5.x fused `mlp.experts.gate_up_proj` [E, 2f, h] (gate rows
  first) and `down_proj` [E, h, f]; transformers 4.x / original checkpoints
  `block_sparse_moe.experts.<e>.w1` (gate) / `w3` (up) / `w2` (down). Both load; export
  writes the installed transformers' format unless `moe_format` says otherwise. Meshtron's
  experts are [E, h, f] (w_gate, w_up) and [E, f, h] (w_down). The router (softmax over all
  experts, top-k, renormalized over the k) is `router_score="softmax", router_renormalize=True`.
- Vocabulary-sized tensors (embedding, untied LM head) are zero-padded to
  `cfg.padded_vocab_size(tp)` on import and cut back on export.

Mixtral router losses. transformers' MixtralForCausalLM adds `router_aux_loss_coef * aux` to
the loss only when `output_router_logits=True` (its default, False, trains no balancing loss).
Its aux pools the router statistics of all layers (`load_balancing_loss_func` concatenates
every layer's gate logits): aux = E * sum_i tokens_per_expert_i * router_prob_i, where
tokens_per_expert counts (token, choice) pairs over layers x tokens, so it sums to top_k. That
is exactly top_k times meshtron's pooled Switch aux (`model.aux_loss_layers="pooled"`,
moe.router.pooled_aux_loss, f summing to 1). Import therefore sets aux_loss_layers = "pooled",
aux_loss_coef = router_aux_loss_coef * top_k (0.0 when output_router_logits is False),
z_loss_coef = 0 and aux_loss_scope = "microbatch" (transformers pools one forward call's
tokens: one rank's microbatch). The source fields are kept in `GPTConfig.hf_router_fields`
and exported unchanged while aux_loss_coef still imports from them (`hf_router_fields()`), so
an imported, trained Mixtral exports its own router_aux_loss_coef and output_router_logits
(False with a nonzero coefficient included); a native model exports aux_loss_coef / top_k,
trained iff aux_loss_coef > 0. An imported Mixtral trains transformers' objective: per step
totals agree to ~1e-7 and weights to ~1e-6 after 4 AdamW steps with 1 and 2 MoE layers, in one
process (tests/test_hf.py::test_mixtral_trains_like_transformers) and at ep=2 against
transformers' gradient accumulation (tests/distributed/hf_cases.py::mixtral_train_ep2).

With meshtron's default aux_loss_layers = "sum" (one aux per layer, summed: Switch,
Megatron-Core, DeepSeek) a multi-layer Mixtral trains another objective. Measured by
`pooling_gap` (tests/distributed/hf_cases.py) on a 2-layer tiny Mixtral (hidden 64, top-2 of 4
experts, 4 x 16 tokens per step, AdamW lr 1e-3, coef 0.02):
- value: the sum is about L times transformers' aux / top_k (+100.1% to +103.1% over 10 steps
  at L = 2); the per-layer mean differs from the pooled value by +0.04% to +1.5%;
- gradient: pooled statistics make every router balance the pooled load, not its own layer's:
  router-weight gradients at the initial weights differ by 46% and 83% (layers 0, 1);
  2.3% and 4.3% at coef 0.001;
- training: the total objective is 0.6% to 0.85% above transformers', and the LM loss drifts
  by up to 7e-4 relative within 4 steps and 1.5e-3 within 10.
Export writes a "sum" model as Mixtral all the same (the weights are what transformers loads);
training it further in transformers then balances the pooled load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from meshtron.models.config import GPTConfig
from meshtron.mpu.init import local_shard
from meshtron.mpu.mappings import gather_from_region as _gather
from meshtron.mpu.mesh import Mesh

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mixtral")
# Tensors of real checkpoints that are not weights (causal-mask buffers, cached RoPE tables).
_IGNORED_KEYS = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$|\.rotary_emb\.inv_freq$")
_VOCAB_PARAMS = ("embed.weight", "head.weight")


class HFConversionError(ValueError):
    """A Hugging Face config or state dict that meshtron cannot convert; the message names
    the field or tensor."""


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("Hugging Face interop needs `transformers` (and `safetensors`); "
                          "install the optional extra: pip install 'meshtron[hf]'") from exc
    return transformers


def _require_safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:  # pragma: no cover
        raise ImportError("Hugging Face interop needs `safetensors`; install the optional extra: "
                          "pip install 'meshtron[hf]'") from exc
    return safetensors.torch


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

def _get(hf, name, default=None):
    return hf.get(name, default) if isinstance(hf, dict) else getattr(hf, name, default)


def _fail(model_type: str, field: str, value, why: str) -> HFConversionError:
    return HFConversionError(f"{model_type} config field {field}={value!r} is not supported by meshtron: {why}")


def _rope_theta(hf, model_type: str) -> float:
    """theta of plain RoPE; any scaling / partial rotary raises naming the field."""
    params = _get(hf, "rope_parameters")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise _fail(model_type, "rope_parameters.rope_type", rope_type, "only plain RoPE (rope_type='default')")
        factor = params.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise _fail(model_type, "rope_parameters.partial_rotary_factor", factor, "RoPE covers the whole head")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    scaling = _get(hf, "rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise _fail(model_type, "rope_scaling", scaling, "only plain RoPE (no scaling)")
    factor = _get(hf, "partial_rotary_factor", 1.0)
    if factor not in (None, 1.0):
        raise _fail(model_type, "partial_rotary_factor", factor, "RoPE covers the whole head")
    return float(_get(hf, "rope_theta", 10000.0))


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
        return {"router_aux_loss_coef": float(original["router_aux_loss_coef"]),
                "output_router_logits": bool(original["output_router_logits"])}
    return {"router_aux_loss_coef": cfg.aux_loss_coef / cfg.top_k, "output_router_logits": cfg.aux_loss_coef > 0}


def config_from_hf(hf_config, **overrides) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2, Llama or Mixtral config (a `PretrainedConfig`
    or its dict). Dropout is 0; `overrides` replace any GPTConfig field afterwards
    (e.g. seq_len, dropout, kernel_backend). Raises HFConversionError naming the field for
    any HF feature meshtron would not reproduce exactly."""
    hf = hf_config
    model_type = _get(hf, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConversionError(f"config field model_type={model_type!r} is not supported; "
                                f"use one of {SUPPORTED_MODEL_TYPES}")
    if _get(hf, "is_encoder_decoder", False) or _get(hf, "add_cross_attention", False):
        raise _fail(model_type, "add_cross_attention", True, "decoder-only models only")
    tie = bool(_get(hf, "tie_word_embeddings", model_type == "gpt2"))
    if model_type == "gpt2":
        act = _get(hf, "activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise _fail(model_type, "activation_function", act, "meshtron's GPT-2 MLP uses tanh-approximate GeLU "
                        "(gelu_new / gelu_pytorch_tanh)")
        if not _get(hf, "scale_attn_weights", True):
            raise _fail(model_type, "scale_attn_weights", False, "attention is always scaled by 1/sqrt(head_dim)")
        if _get(hf, "scale_attn_by_inverse_layer_idx", False):
            raise _fail(model_type, "scale_attn_by_inverse_layer_idx", True, "no per-layer attention scaling")
        h = _get(hf, "n_embd")
        cfg = GPTConfig(
            arch="gpt2", num_layers=_get(hf, "n_layer"), hidden_size=h, num_heads=_get(hf, "n_head"),
            ffn_hidden_size=_get(hf, "n_inner") or 4 * h, vocab_size=_get(hf, "vocab_size"),
            seq_len=_get(hf, "n_positions"), dropout=0.0, tie_embeddings=tie,
            init_std=float(_get(hf, "initializer_range", 0.02)), norm_eps=float(_get(hf, "layer_norm_epsilon", 1e-5)),
        )
    else:
        act = _get(hf, "hidden_act", "silu")
        if act != "silu":
            raise _fail(model_type, "hidden_act", act, "meshtron's Llama MLP is SwiGLU (silu)")
        h, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
        head_dim = _get(hf, "head_dim")
        if head_dim is not None and head_dim * heads != h:
            raise _fail(model_type, "head_dim", head_dim, f"meshtron needs head_dim = hidden_size / "
                        f"num_attention_heads = {h}/{heads}")
        attn_bias = bool(_get(hf, "attention_bias", False))
        mlp_bias = bool(_get(hf, "mlp_bias", False))
        if attn_bias != mlp_bias:
            raise _fail(model_type, "attention_bias", attn_bias, f"meshtron has one bias switch for attention and "
                        f"MLP, and mlp_bias={mlp_bias}")
        seq_len = _get(hf, "max_position_embeddings")
        window = _get(hf, "sliding_window")
        if window is not None and _get(hf, "use_sliding_window", True) and window < seq_len:
            raise _fail(model_type, "sliding_window", window, "meshtron attention is full causal")
        extra = {}
        if model_type == "mixtral":
            if _get(hf, "router_jitter_noise", 0.0):
                raise _fail(model_type, "router_jitter_noise", _get(hf, "router_jitter_noise"),
                            "meshtron's router has no input jitter")
            if attn_bias:
                raise _fail(model_type, "attention_bias", attn_bias, "meshtron's experts have no biases")
            top_k = _get(hf, "num_experts_per_tok")
            router = {"router_aux_loss_coef": float(_get(hf, "router_aux_loss_coef", 0.001)),
                      "output_router_logits": bool(_get(hf, "output_router_logits", False))}
            extra = dict(num_experts=_get(hf, "num_local_experts"), top_k=top_k,
                         moe_every=1, moe_ffn_hidden_size=_get(hf, "intermediate_size"), capacity_factor=None,
                         aux_loss_coef=aux_loss_coef_from_hf(router, top_k), z_loss_coef=0.0,
                         router_score="softmax", router_renormalize=True, router_bias_update_rate=0.0,
                         shared_experts=0, aux_loss_scope="microbatch", aux_loss_layers="pooled",
                         hf_router_fields=router)
        cfg = GPTConfig(
            arch="llama", num_layers=_get(hf, "num_hidden_layers"), hidden_size=h, num_heads=heads,
            num_kv_heads=_get(hf, "num_key_value_heads") or heads, ffn_hidden_size=_get(hf, "intermediate_size"),
            vocab_size=_get(hf, "vocab_size"), seq_len=seq_len, dropout=0.0, bias=attn_bias, tie_embeddings=tie,
            init_std=float(_get(hf, "initializer_range", 0.02)), norm_eps=float(_get(hf, "rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf, model_type), **extra,
        )
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def hf_family(cfg: GPTConfig) -> str:
    """"gpt2", "llama" or "mixtral": the HF architecture that holds exactly `cfg`'s model;
    raises HFConversionError naming the GPTConfig field that no HF family can express."""
    def bad(field, value, why):
        return HFConversionError(f"model.{field}={value!r} has no Hugging Face equivalent: {why}")

    if cfg.arch == "gpt2":
        wanted = dict(norm="layernorm", activation="gelu", position="learned", bias=True)
    else:
        wanted = dict(norm="rmsnorm", activation="swiglu", position="rope")
    for field, value in wanted.items():
        if getattr(cfg, field) != value:
            raise bad(field, getattr(cfg, field), f"arch={cfg.arch} in Hugging Face needs {value!r}")
    if cfg.arch == "gpt2":
        if cfg.num_kv_heads != cfg.num_heads:
            raise bad("num_kv_heads", cfg.num_kv_heads, "GPT-2 has no grouped-query attention")
        if cfg.is_moe:
            raise bad("num_experts", cfg.num_experts, "GPT-2 has no MoE variant (use arch=llama: Mixtral)")
        return "gpt2"
    if not cfg.is_moe:
        return "llama"
    checks = [("moe_every", 1), ("shared_experts", 0), ("router_score", "softmax"), ("router_renormalize", True),
              ("bias", False), ("router_groups", 0)]
    for field, value in checks:
        if getattr(cfg, field) != value:
            raise bad(field, getattr(cfg, field), f"Mixtral needs {value!r}")
    return "mixtral"


def hf_config_from_gpt(cfg: GPTConfig, **overrides):
    """A transformers config (GPT2Config, LlamaConfig or MixtralConfig) describing `cfg`'s
    model; `overrides` are passed to the config class (e.g. bos_token_id)."""
    transformers = _require_transformers()
    family = hf_family(cfg)
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std)
    if family == "gpt2":
        kw = dict(n_positions=cfg.seq_len, n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                  n_inner=cfg.ffn_hidden_size, activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
                  resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                  architectures=["GPT2LMHeadModel"], **common)
        return transformers.GPT2Config(**{**kw, **overrides})
    kw = dict(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.seq_len, rms_norm_eps=cfg.norm_eps,
              hidden_act="silu", attention_dropout=cfg.dropout, **common)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:
        kw["rope_theta"] = cfg.rope_theta
    if family == "llama":
        kw.update(intermediate_size=cfg.ffn_hidden_size, attention_bias=cfg.bias, mlp_bias=cfg.bias,
                  head_dim=cfg.head_dim, architectures=["LlamaForCausalLM"])
        return transformers.LlamaConfig(**{**kw, **overrides})
    kw.update(intermediate_size=cfg.moe_ffn_hidden_size, num_local_experts=cfg.num_experts,
              num_experts_per_tok=cfg.top_k, sliding_window=None, architectures=["MixtralForCausalLM"],
              **hf_router_fields(cfg))
    return transformers.MixtralConfig(**{**kw, **overrides})


# --------------------------------------------------------------------------------------------
# Name / layout map between meshtron full parameters and HF tensors
# --------------------------------------------------------------------------------------------

@dataclass
class _Unit:
    """Meshtron full tensors `mt` <-> HF tensors `hf` (shapes `hf_shapes`), converted exactly."""

    mt: tuple[str, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_mt: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    to_hf: Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _same(mt: str, hf: str, shape) -> _Unit:
    return _Unit((mt,), (hf,), (tuple(shape),), lambda t: list(t), lambda t: list(t))


def _transposed(mt: str, hf: str, hf_shape) -> _Unit:
    return _Unit((mt,), (hf,), (tuple(hf_shape),), lambda t: [t[0].t()], lambda t: [t[0].t()])


def _qkv_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int) -> torch.Tensor:
    rest = tuple(q.shape[1:])
    parts = [x.reshape((kv_heads, -1) + rest) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape((-1,) + rest)


def _qkv_split(fused: torch.Tensor, cfg: GPTConfig) -> list[torch.Tensor]:
    d, g = cfg.head_dim, cfg.num_kv_heads
    q_rows = cfg.num_heads // g * d
    rest = tuple(fused.shape[1:])
    grouped = fused.reshape((g, q_rows + 2 * d) + rest)
    q, k, v = grouped.split([q_rows, d, d], dim=1)
    return [x.reshape((-1,) + rest) for x in (q, k, v)]


def _qkv_unit(cfg: GPTConfig, mt: str, hf_keys: tuple[str, ...], is_bias: bool, gpt2: bool) -> _Unit:
    d, nq, nkv, h = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    if gpt2:  # one Conv1D [h, 3h] ([q | k | v] columns) or bias [3h]
        shape = (3 * h,) if is_bias else (h, 3 * h)

        def to_mt(t):
            full = t[0] if is_bias else t[0].t()
            return [_qkv_grouped(*full.split(h, dim=0), kv_heads=nkv)]

        def to_hf(t):
            full = torch.cat(_qkv_split(t[0], cfg), dim=0)
            return [full if is_bias else full.t()]

        return _Unit((mt,), hf_keys, (shape,), to_mt, to_hf)
    shapes = tuple((n * d,) if is_bias else (n * d, h) for n in (nq, nkv, nkv))
    return _Unit((mt,), hf_keys, shapes, lambda t: [_qkv_grouped(*t, kv_heads=nkv)], lambda t: _qkv_split(t[0], cfg))


def _units(cfg: GPTConfig, moe_format: str = "fused") -> list[_Unit]:
    """Every meshtron parameter of `cfg`'s full model (unpadded vocabulary) with its HF source."""
    family = hf_family(cfg)
    h, f, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    units: list[_Unit] = []
    if family == "gpt2":
        p = "transformer."
        units += [_same("embed.weight", p + "wte.weight", (V, h)),
                  _same("pos_embed", p + "wpe.weight", (cfg.seq_len, h))]
        for i in range(cfg.num_layers):
            L, m = f"{p}h.{i}.", f"layers.{i}."
            units += [
                _same(m + "norm1.weight", L + "ln_1.weight", (h,)), _same(m + "norm1.bias", L + "ln_1.bias", (h,)),
                _qkv_unit(cfg, m + "attn.qkv.weight", (L + "attn.c_attn.weight",), False, True),
                _qkv_unit(cfg, m + "attn.qkv.bias", (L + "attn.c_attn.bias",), True, True),
                _transposed(m + "attn.proj.weight", L + "attn.c_proj.weight", (h, h)),
                _same(m + "attn.proj.bias", L + "attn.c_proj.bias", (h,)),
                _same(m + "norm2.weight", L + "ln_2.weight", (h,)), _same(m + "norm2.bias", L + "ln_2.bias", (h,)),
                _transposed(m + "mlp.up.weight", L + "mlp.c_fc.weight", (h, f)),
                _same(m + "mlp.up.bias", L + "mlp.c_fc.bias", (f,)),
                _transposed(m + "mlp.down.weight", L + "mlp.c_proj.weight", (f, h)),
                _same(m + "mlp.down.bias", L + "mlp.c_proj.bias", (h,)),
            ]
        units += [_same("final_norm.weight", p + "ln_f.weight", (h,)),
                  _same("final_norm.bias", p + "ln_f.bias", (h,))]
    else:
        units.append(_same("embed.weight", "model.embed_tokens.weight", (V, h)))
        d, nq = cfg.head_dim, cfg.num_heads
        for i in range(cfg.num_layers):
            L, m = f"model.layers.{i}.", f"layers.{i}."
            a = L + "self_attn."
            units += [
                _same(m + "norm1.weight", L + "input_layernorm.weight", (h,)),
                _qkv_unit(cfg, m + "attn.qkv.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                          False, False),
                _same(m + "attn.proj.weight", a + "o_proj.weight", (h, nq * d)),
                _same(m + "norm2.weight", L + "post_attention_layernorm.weight", (h,)),
            ]
            if cfg.bias:
                units += [_qkv_unit(cfg, m + "attn.qkv.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                                    True, False),
                          _same(m + "attn.proj.bias", a + "o_proj.bias", (h,))]
            if family == "llama":
                units += [_same(m + "mlp.gate.weight", L + "mlp.gate_proj.weight", (f, h)),
                          _same(m + "mlp.up.weight", L + "mlp.up_proj.weight", (f, h)),
                          _same(m + "mlp.down.weight", L + "mlp.down_proj.weight", (h, f))]
                if cfg.bias:
                    units += [_same(m + "mlp.gate.bias", L + "mlp.gate_proj.bias", (f,)),
                              _same(m + "mlp.up.bias", L + "mlp.up_proj.bias", (f,)),
                              _same(m + "mlp.down.bias", L + "mlp.down_proj.bias", (h,))]
            else:
                units += _expert_units(cfg, m + "mlp.", L, moe_format)
        units.append(_same("final_norm.weight", "model.norm.weight", (h,)))
    if not cfg.tie_embeddings:
        units.append(_same("head.weight", "lm_head.weight", (V, h)))
    return units


def _expert_units(cfg: GPTConfig, m: str, L: str, moe_format: str) -> list[_Unit]:
    E, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
    if moe_format == "fused":  # transformers 5.x: [E, 2f, h] gate rows then up rows; down [E, h, f]
        x = L + "mlp."

        def gate_up_to_mt(t):
            gate, up = t[0].split(f, dim=1)
            return [gate.transpose(1, 2), up.transpose(1, 2)]

        return [
            _same(m + "router.weight", x + "gate.weight", (E, h)),
            _Unit((m + "experts.w_gate", m + "experts.w_up"), (x + "experts.gate_up_proj",), ((E, 2 * f, h),),
                  gate_up_to_mt, lambda t: [torch.cat([t[0], t[1]], dim=2).transpose(1, 2)]),
            _Unit((m + "experts.w_down",), (x + "experts.down_proj",), ((E, h, f),),
                  lambda t: [t[0].transpose(1, 2)], lambda t: [t[0].transpose(1, 2)]),
        ]
    # transformers 4.x / original checkpoints: one nn.Linear per expert and matrix.
    x = L + "block_sparse_moe."

    def stacked(mt: str, w: str, shape) -> _Unit:
        keys = tuple(f"{x}experts.{e}.{w}.weight" for e in range(E))
        return _Unit((mt,), keys, (tuple(shape),) * E, lambda t: [torch.stack([w_.t() for w_ in t])],
                     lambda t: [w_.t() for w_ in t[0].unbind(0)])

    return [_same(m + "router.weight", x + "gate.weight", (E, h)),
            stacked(m + "experts.w_gate", "w1", (f, h)), stacked(m + "experts.w_up", "w3", (f, h)),
            stacked(m + "experts.w_down", "w2", (h, f))]


def _default_moe_format() -> str:
    try:
        import transformers
    except ImportError:
        return "fused"
    return "fused" if int(transformers.__version__.split(".")[0]) >= 5 else "per_expert"


def _chunks(model) -> list[nn.Module]:
    if isinstance(model, (list, tuple, nn.ModuleList)):
        return list(model)
    return [model]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))], dim=0)


def _normalize_keys(state_dict: dict, family: str) -> dict:
    """Drop non-weight buffers; accept GPT-2 checkpoints saved without the `transformer.` prefix."""
    out = {k: v for k, v in state_dict.items() if not _IGNORED_KEYS.search(k)}
    if family == "gpt2" and "transformer.wte.weight" not in out and "wte.weight" in out:
        out = {(k if k.startswith("lm_head.") else "transformer." + k): v for k, v in out.items()}
    return out


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def load_hf_state_dict(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a FULL Hugging Face state dict into a meshtron model built for any layout.

    `model` is one `GPT` chunk or this rank's list of pipeline chunks; every rank passes the
    same full dict and keeps its own shards (tp / ep / etp), vocabulary tensors zero-padded.
    Tied embedding copies on the last pipeline stage get the embedding too. Router expert
    biases (aux-loss-free balancing state, not in HF) are reset to zero. Missing, unexpected
    or wrongly shaped tensors raise HFConversionError naming the tensor (on every rank, before
    anything is copied).
    """
    chunks = _chunks(model)
    cfg: GPTConfig = chunks[0].cfg
    mesh: Mesh = chunks[0].mesh
    family = hf_family(cfg)
    sd = _normalize_keys(state_dict, family)
    moe_format = "per_expert" if any(".block_sparse_moe." in k for k in sd) else "fused"
    units = _units(cfg, moe_format)

    expected = {key: shape for u in units for key, shape in zip(u.hf, u.hf_shapes)}
    embed_key = units[0].hf[0]
    optional = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_embeddings else {}
    missing = [k for k in expected if k not in sd]
    if missing:
        raise HFConversionError(f"missing tensor {missing[0]} in the Hugging Face state dict"
                                + (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else ""))
    unexpected = [k for k in sd if k not in expected and k not in optional]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise HFConversionError(f"unexpected tensor {unexpected[0]} in the Hugging Face state dict for a "
                                f"{family} model{more}")
    for key, shape in {**expected, **{k: s for k, s in optional.items() if k in sd}}.items():
        got = tuple(sd[key].shape)
        if got != tuple(shape):
            raise HFConversionError(f"tensor {key} has shape {got}, expected {tuple(shape)} for this config")
    if cfg.tie_embeddings and "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd[embed_key]):
        raise HFConversionError(f"tensor lm_head.weight differs from {embed_key} but the config ties the "
                                f"embeddings (tie_word_embeddings=True)")

    by_mt = {name: u for u in units for name in u.mt}
    converted: dict[int, dict[str, torch.Tensor]] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            unit = by_mt.get(name)
            if unit is None:
                raise HFConversionError(f"meshtron parameter {name} has no Hugging Face counterpart")
            if id(unit) not in converted:
                converted[id(unit)] = dict(zip(unit.mt, unit.to_mt([sd[k] for k in unit.hf])))
            full = converted[id(unit)][name]
            if name in _VOCAB_PARAMS:
                full = _pad_rows(full, chunk.padded_vocab_size)
            local = local_shard(full, param.shards, mesh)
            if local.shape != param.shape:
                raise HFConversionError(f"tensor {', '.join(unit.hf)} gives meshtron {name} a shard of shape "
                                        f"{tuple(local.shape)}, expected {tuple(param.shape)}")
            param.copy_(local)
        for name, buf in chunk.named_buffers():
            if name.endswith("router.expert_bias"):
                buf.zero_()


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def _gather_full(param: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    t = param.detach()
    for dim, axis in reversed(param.shards):
        t = _gather(t, dim, getattr(mesh, axis))
    return t


@torch.no_grad()
def export_hf_state_dict(model, mesh: Mesh, moe_format: str | None = None) -> dict[str, torch.Tensor] | None:
    """The full Hugging Face state dict of a meshtron model in any layout, on global rank 0
    (None on every other rank). Collective: every rank of the world must call it.

    Shards are all-gathered over tp / ep / etp, pipeline stages are gathered to rank 0 over
    the pp group; vocabulary padding is dropped and every layout conversion inverted. Tied
    models also get `lm_head.weight` (a copy of the embedding), as HF's `state_dict()` has.
    `moe_format`: "fused" (transformers 5.x Mixtral) or "per_expert" (4.x / original
    checkpoints); default: the installed transformers' format. Tensors are on the CPU.
    """
    chunks = _chunks(model)
    cfg: GPTConfig = chunks[0].cfg
    moe_format = moe_format or _default_moe_format()
    if moe_format not in ("fused", "per_expert"):
        raise ValueError(f"moe_format={moe_format!r} must be 'fused' or 'per_expert'")
    units = _units(cfg, moe_format)  # validates the family before any collective
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            full = _gather_full(param, mesh)  # collective over the shard groups: every rank
            if getattr(param, "tied_embedding_copy", False):
                continue
            if name in _VOCAB_PARAMS:
                full = full[: cfg.vocab_size]
            local[name] = full.cpu().clone()

    full_params = local
    if mesh.pp_size > 1:
        if mesh.dp_rank != 0 or mesh.tp_rank != 0:
            return None
        import torch.distributed as dist
        gathered = [None] * mesh.pp_size if mesh.rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=mesh.pp)
        if mesh.rank != 0:
            return None
        full_params = {k: v for part in gathered for k, v in part.items()}
    elif mesh.rank != 0:
        return None

    out: dict[str, torch.Tensor] = {}
    for unit in units:
        absent = [n for n in unit.mt if n not in full_params]
        if absent:
            raise HFConversionError(f"meshtron parameter {absent[0]} was not found in the model chunks")
        for key, tensor in zip(unit.hf, unit.to_hf([full_params[n] for n in unit.mt])):
            out[key] = tensor.contiguous().clone()
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out[units[0].hf[0]].clone()
    return out


# --------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------

def save_hf_folder(state_dict: dict[str, torch.Tensor], hf_config, out_dir) -> Path:
    """Write `model.safetensors` and `config.json` into `out_dir` so that
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads the model. A tied
    `lm_head.weight` is left out (as `save_pretrained` does)."""
    _require_transformers()
    st = _require_safetensors()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()
               if not (tied and k == "lm_head.weight")}
    st.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(str(out))
    return out


def read_hf_folder(src_dir) -> tuple[object, dict[str, torch.Tensor]]:
    """(config, full state dict) of a local Hugging Face model folder: `config.json` and
    `model.safetensors`, or the shards listed in `model.safetensors.index.json` (or every
    `*.safetensors`). Local files only, no network."""
    transformers = _require_transformers()
    st = _require_safetensors()
    src = Path(src_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}/config.json not found (not a Hugging Face model folder)")
    hf_config = transformers.AutoConfig.from_pretrained(str(src), local_files_only=True)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {src} (convert .bin checkpoints to safetensors first)")
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        part = st.load_file(os.fspath(src / name))
        overlap = state_dict.keys() & part.keys()
        if overlap:
            raise HFConversionError(f"tensor {sorted(overlap)[0]} appears in more than one shard of {src}")
        state_dict.update(part)
    return hf_config, state_dict


# --------------------------------------------------------------------------------------------
# Command line: HF folder <-> meshtron checkpoint
# --------------------------------------------------------------------------------------------

def import_to_checkpoint(src_dir, out_dir, seq_len: int | None = None) -> Path:
    """Convert a `save_pretrained` folder into a weights-only meshtron checkpoint in `out_dir`
    (`out_dir/step_00000000`, loadable under any layout with `checkpoint.init_from`), plus
    `out_dir/model/imported.yaml`, the Hydra model config of it. Single process."""
    from meshtron.mpu.mesh import single_process_mesh
    from meshtron.models.gpt import GPT
    from meshtron.training.checkpoint import TrainState, save_checkpoint

    hf_config, state_dict = read_hf_folder(src_dir)
    cfg = config_from_hf(hf_config, **({"seq_len": seq_len} if seq_len else {}))
    mesh = single_process_mesh()
    model = GPT(cfg, mesh)
    load_hf_state_dict(model, state_dict)
    out = Path(out_dir)
    path = save_checkpoint(out, TrainState(), [model], None, mesh, model_config=dataclasses.asdict(cfg))
    (out / "model").mkdir(parents=True, exist_ok=True)
    lines = ["# @package model", f"# imported from {Path(src_dir).resolve()} by python -m meshtron.models.hf import"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in dataclasses.asdict(cfg).items()
              if k not in ("kernel_backend", "recompute", "recompute_layers")]
    (out / "model" / "imported.yaml").write_text("\n".join(lines) + "\n")
    return path


def export_from_checkpoint(src, out_dir) -> Path:
    """Write the weights of a meshtron checkpoint (a step_N folder, or a checkpoint.dir: its
    newest) as a Hugging Face folder loadable by `AutoModelForCausalLM.from_pretrained`."""
    from meshtron.mpu.mesh import single_process_mesh
    from meshtron.models.gpt import GPT
    from meshtron.training.checkpoint import load_checkpoint, read_meta, resolve_resume

    path = resolve_resume(None, str(src))
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    saved = read_meta(path)["model"]
    cfg = GPTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields})
    hf_family(cfg)  # fails early, naming the field, for models transformers cannot hold
    mesh = single_process_mesh()
    model = GPT(cfg, mesh)
    load_checkpoint(path, [model], None, mesh, weights_only=True)
    return save_hf_folder(export_hf_state_dict(model, mesh), hf_config_from_gpt(cfg), out_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="meshtron-hf", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> meshtron checkpoint (weights only)")
    imp.add_argument("--src", required=True, help="a save_pretrained folder (config.json + *.safetensors)")
    imp.add_argument("--out", required=True, help="checkpoint directory to create")
    imp.add_argument("--seq-len", type=int, default=None, help="training sequence length (default: the "
                                                               "model's maximum positions)")
    exp = sub.add_parser("export", help="meshtron checkpoint -> Hugging Face folder")
    exp.add_argument("--src", required=True, help="a step_N checkpoint folder or a checkpoint.dir (newest)")
    exp.add_argument("--out", required=True, help="folder to write config.json + model.safetensors into")
    args = parser.parse_args(argv)
    from meshtron.training.checkpoint import CheckpointError

    try:
        if args.command == "import":
            path = import_to_checkpoint(args.src, args.out, args.seq_len)
            print(f"meshtron: wrote {path}; train from it with\n  python train.py --config-dir {Path(args.out)} "
                  f"+model=imported checkpoint.init_from={path}")
        else:
            out = export_from_checkpoint(args.src, args.out)
            print(f"meshtron: wrote {out} (transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    except (HFConversionError, CheckpointError, FileNotFoundError) as err:
        print(f"meshtron: {args.command} failed: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
