"""Hugging Face interop: configs (`config`), weight import/export (`weights`) and safetensors
folders (`files`); the command line that turns folders into checkpoints is training/hf_cli.py.

Supported families (transformers 4.40+ and 5.x naming):
    GPT-2    (`GPT2Config`, `GPT2LMHeadModel`)          <-> arch="gpt2"
    Llama    (`LlamaConfig`, `LlamaForCausalLM`)        <-> arch="llama" (Llama 3.1/3.2: rope_scaling llama3 or yarn)
    Mistral  (`MistralConfig`, `MistralForCausalLM`)    <-> arch="llama", hf_model_type="mistral"
    Qwen2    (`Qwen2Config`, `Qwen2ForCausalLM`)        <-> arch="llama", qkv_bias=True (bias=False)
    Qwen3    (`Qwen3Config`, `Qwen3ForCausalLM`)        <-> arch="llama", qk_norm=True (kv_channels: head_dim)
    Mixtral  (`MixtralConfig`, `MixtralForCausalLM`)    <-> arch="llama" with num_experts > 0
    Qwen2-MoE (`Qwen2MoeConfig`)   <-> MoE + shared_experts=1, shared_ffn_hidden_size, shared_expert_gate
    Qwen3-MoE (`Qwen3MoeConfig`)   <-> MoE + qk_norm (moe_every / moe_dense_layers: mlp_only_layers)
    DeepSeek-V3 (`DeepseekV3Config`) <-> attention="mla", sigmoid groups routing, router_scaling_factor,
                                       moe_first_dense, shared experts, expert_bias (e_score_correction_bias)
A sliding window (Mistral, Mixtral; Qwen2/Qwen3 with use_sliding_window when every layer
slides) imports as model.sliding_window (parallel.cp=1, dense or flex attention); rope_scaling
llama3 and yarn import as model.rope_scaling; Qwen3's QK-norm as model.qk_norm.

    config_from_hf(hf_config, **overrides) -> GPTConfig
    hf_config_from_gpt(cfg, **overrides) -> transformers config
    load_hf_state_dict(model, state_dict)            every rank loads its shards from the full HF dict
    load_hf_weights(model, source, targets=None)     every rank reads only its shards' slices
    open_hf_weights(folder, family) -> source        a folder's safetensors, memory-mapped
    read_hf_config(folder)                           its config.json as a transformers config
    export_hf_state_dict(model, mesh) -> dict | None the full HF dict on global rank 0
    save_hf_folder(state_dict | TensorStream, hf_config, out_dir, dtype=, max_file_bytes=)
                                                     safetensors (streamed, sharded with an index) + config.json
    stream_hf_tensors(cfg, read_full) -> (key, tensor)...  export one conversion unit at a time
    read_hf_folder(src_dir) -> (hf_config, state_dict)
    save_import_base / read_import_base              the imported folder's own config.json,
                                                     generation config, tokenizer and positions
    hf_config_dict_over(cfg, original) -> dict       config.json written over the original one

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

from meshtron.models.hf.config import (
    MAX_POSITION_FIELDS,
    SUPPORTED_MODEL_TYPES,
    HFConversionError,
    aux_loss_coef_from_hf,
    config_from_hf,
    hf_config_dict_over,
    hf_config_from_gpt,
    hf_family,
    hf_router_fields,
)
from meshtron.models.hf.files import (
    TensorStream,
    open_hf_weights,
    read_hf_config,
    read_hf_folder,
    read_import_base,
    save_hf_folder,
    save_import_base,
)
from meshtron.models.hf.sources import DictSource, SafetensorsSource
from meshtron.models.hf.weights import (
    checked_units,
    export_hf_state_dict,
    hf_tensor_shapes,
    load_hf_state_dict,
    load_hf_weights,
    stream_hf_tensors,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFConversionError",
    "aux_loss_coef_from_hf",
    "config_from_hf",
    "hf_config_from_gpt",
    "hf_family",
    "hf_router_fields",
    "read_hf_folder",
    "save_hf_folder",
    "MAX_POSITION_FIELDS",
    "hf_config_dict_over",
    "read_import_base",
    "save_import_base",
    "export_hf_state_dict",
    "load_hf_state_dict",
    "load_hf_weights",
    "checked_units",
    "open_hf_weights",
    "read_hf_config",
    "DictSource",
    "TensorStream",
    "hf_tensor_shapes",
    "stream_hf_tensors",
    "SafetensorsSource",
]
