"""Analytic FLOP, parameter and memory counts for meshtron's GPT (dense and MoE).

Everything here is pure arithmetic on a `GPTConfig`: no torch, no process groups. The
formulas follow the model as built in `models/` (pre-norm blocks, fused QKV, GQA, gelu or
swiglu MLP, optional MoE layers every `moe_every` layers, optional tied LM head):

* `model_flops_per_token` is the number MFU is computed from
  (MFU = flops_per_token * tokens_per_s / peak_flops).
* `param_count` counts unique parameters of the unsharded model.
* `params_per_rank` / `model_state_bytes` give the per-rank weights, gradients and optimizer
  state under tp / ep / etp / pp / ZeRO sharding.
* `activation_bytes_per_microbatch` estimates the activations kept for backward
  (Korthikanti et al. 2022, adapted term by term to this block).
"""

from __future__ import annotations

import math
from fractions import Fraction

from meshtron.models.config import GPTConfig

__all__ = [
    "model_flops_per_token",
    "param_count",
    "params_per_rank",
    "model_state_bytes",
    "activation_bytes_per_microbatch",
    "moe_layer_indices",
]


# --------------------------------------------------------------------------- helpers


def moe_layer_indices(cfg: GPTConfig) -> list[int]:
    """Indices i of the layers whose MLP is a MoE layer: (i + 1) % moe_every == 0 (none if dense)."""
    if not cfg.is_moe:
        return []
    if cfg.moe_every < 1:
        raise ValueError(f"model.moe_every={cfg.moe_every} must be >= 1")
    return [i for i in range(cfg.num_layers) if (i + 1) % cfg.moe_every == 0]


def _check_moe(cfg: GPTConfig) -> None:
    if cfg.is_moe and not 1 <= cfg.top_k <= cfg.num_experts:
        raise ValueError(f"model.top_k={cfg.top_k} must be in [1, model.num_experts={cfg.num_experts}]")


def _mlp_matrices(cfg: GPTConfig, ffn: int) -> int:
    """Weight elements of one MLP's matrices: gelu h*f + f*h; swiglu gate + up + down."""
    h = cfg.hidden_size
    return (2 if cfg.activation == "gelu" else 3) * h * ffn


def _mlp_biases(cfg: GPTConfig, ffn: int) -> int:
    """Bias elements of one dense MLP (0 without cfg.bias): up (and gate) f each, down h."""
    if not cfg.bias:
        return 0
    return (1 if cfg.activation == "gelu" else 2) * ffn + cfg.hidden_size


def _norm_params(cfg: GPTConfig) -> int:
    """LayerNorm: weight (+ bias when cfg.bias); RMSNorm: weight only."""
    h = cfg.hidden_size
    return 2 * h if (cfg.norm == "layernorm" and cfg.bias) else h


def _qkv_out(cfg: GPTConfig) -> int:
    return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim


def _act_hidden(cfg: GPTConfig, ffn: int) -> int:
    """Hidden-size activations one MLP keeps per token: gelu fc1 out + gelu out (2f);
    swiglu gate out + up out + product (3f, i.e. a fused swiglu / saved-input silu)."""
    return (2 if cfg.activation == "gelu" else 3) * ffn


# --------------------------------------------------------------------------- FLOPs


def model_flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), matmuls only.

    A multiply-add is 2 FLOPs. Per layer, forward, per token (h hidden, s seq_len,
    a heads, g kv heads, d head_dim, f ffn_hidden_size):

    * fused QKV:        2 * h * (a + 2g) * d
    * attention scores: 2 * s * a * d = 2*s*h   (Q K^T against all s keys)
    * attention x V:    2 * s * h
      The causal mask is ignored: both attention matmuls are counted over the full s x s
      square (the common Megatron / PaLM convention), so this is ~2*s*h more than the
      useful work of a causal model.
    * output proj:      2 * h * h
    * MLP:              gelu 2 * 2*h*f;  swiglu 2 * 3*h*f
    * MoE layer instead of MLP: router 2*h*E + (top_k + shared_experts) MLPs of
      moe_ffn_hidden_size each (the tokens' routed experts and the shared experts).

    plus the LM head 2 * h * V, with V = cfg.padded_vocab_size(1) (the padded logits are
    computed; using tp=1's padding keeps the figure independent of the layout).
    Norms, softmax, activations, RoPE and the embedding lookup are not counted.
    """
    _check_moe(cfg)
    h, s = cfg.hidden_size, cfg.seq_len
    moe = set(moe_layer_indices(cfg))
    attn = 2 * h * _qkv_out(cfg) + 4 * s * h + 2 * h * h
    dense_mlp = 2 * _mlp_matrices(cfg, cfg.ffn_hidden_size)
    moe_mlp = 2 * h * cfg.num_experts + 2 * (cfg.top_k + cfg.shared_experts) * _mlp_matrices(
        cfg, cfg.moe_ffn_hidden_size
    )
    forward = sum(attn + (moe_mlp if i in moe else dense_mlp) for i in range(cfg.num_layers))
    forward += 2 * h * cfg.padded_vocab_size(1)
    return float(3 * forward)


# --------------------------------------------------------------------------- parameters


def _layer_params(cfg: GPTConfig, is_moe: bool, tp: int = 1, ep: int = 1, etp: int = 1) -> int:
    """Parameters of one block held by one rank (tp/ep/etp = 1: the full block)."""
    h = cfg.hidden_size
    qkv = _qkv_out(cfg)
    n = 2 * _norm_params(cfg)  # norm1, norm2: replicated over tp
    n += h * qkv // tp + (qkv // tp if cfg.bias else 0)  # column-parallel fused QKV
    n += h * h // tp + (h if cfg.bias else 0)  # row-parallel out proj, replicated bias
    if not is_moe:
        f = cfg.ffn_hidden_size
        n += _mlp_matrices(cfg, f) // tp
        if cfg.bias:
            n += (1 if cfg.activation == "gelu" else 2) * f // tp + h  # column biases split, row bias replicated
        return n
    fm = cfg.moe_ffn_hidden_size
    n += cfg.num_experts * h  # router, replicated
    n += (cfg.num_experts // ep) * _mlp_matrices(cfg, fm) // etp  # routed experts, no biases
    n += cfg.shared_experts * _mlp_matrices(cfg, fm) // tp  # shared experts: tensor-parallel like the MLP (moe/layer.py)
    return n


def param_count(cfg: GPTConfig) -> dict[str, int]:
    """Parameter counts of the unsharded model.

    Returns a dict with
    * `total`: unique parameters: token embedding [V, h] with V = cfg.padded_vocab_size(1),
      learned position embedding [seq_len, h] (only for position == "learned"), the blocks
      (norms, fused QKV, out proj, MLP or router + experts + shared experts, biases when
      cfg.bias, none in experts), the final norm, and the LM head [V, h] unless it is tied
      to the embedding (then counted once);
    * `active_per_token`: `total` minus the routed experts a token does not visit
      ((num_experts - top_k) experts per MoE layer); equals `total` for a dense model;
    * `embedding`: token + position embedding + untied LM head (for "non-embedding" counts).
    """
    _check_moe(cfg)
    h = cfg.hidden_size
    vocab = cfg.padded_vocab_size(1)
    moe = set(moe_layer_indices(cfg))
    embedding = vocab * h + (cfg.seq_len * h if cfg.position == "learned" else 0)
    embedding += 0 if cfg.tie_embeddings else vocab * h
    total = embedding + _norm_params(cfg)
    total += sum(_layer_params(cfg, i in moe) for i in range(cfg.num_layers))
    idle = len(moe) * (cfg.num_experts - cfg.top_k) * _mlp_matrices(cfg, cfg.moe_ffn_hidden_size)
    return {"total": total, "active_per_token": total - idle, "embedding": embedding}


def _stage_layers(num_layers: int, pp: int) -> list[range]:
    if not 1 <= pp <= num_layers:
        raise ValueError(f"parallel.pp={pp} must be in [1, model.num_layers={num_layers}]")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for stage in range(pp):
        n = base + (1 if stage < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def params_per_rank(cfg: GPTConfig, tp: int = 1, ep: int = 1, etp: int = 1, pp: int = 1) -> int:
    """Parameters held by the most loaded rank under tp / ep / etp / pp sharding.

    tp splits QKV, out proj, MLP, shared experts, embedding and LM head rows over the
    padded vocab cfg.padded_vocab_size(tp); norms, position embedding, router and
    row-parallel biases are replicated. Each rank holds num_experts/ep routed experts with
    their ffn split over etp. Pipeline stages get contiguous layer ranges (the first
    num_layers % pp stages one layer more); the first stage holds the embeddings, the last
    the final norm and LM head (with tied embeddings and pp > 1, a copy of the embedding).
    Returns the maximum over stages. Raises ValueError when a size does not divide.
    """
    _check_moe(cfg)
    h = cfg.hidden_size
    checks = [
        (tp >= 1 and ep >= 1 and etp >= 1, f"parallel sizes must be >= 1 (tp={tp}, ep={ep}, etp={etp})"),
        (cfg.num_heads % tp == 0, f"model.num_heads={cfg.num_heads} is not divisible by parallel.tp={tp}"),
        (cfg.num_kv_heads % tp == 0, f"model.num_kv_heads={cfg.num_kv_heads} is not divisible by parallel.tp={tp}"),
        (cfg.ffn_hidden_size % tp == 0,
         f"model.ffn_hidden_size={cfg.ffn_hidden_size} is not divisible by parallel.tp={tp}"),
    ]
    if cfg.is_moe:
        checks += [
            (cfg.num_experts % ep == 0, f"model.num_experts={cfg.num_experts} is not divisible by parallel.ep={ep}"),
            (cfg.moe_ffn_hidden_size % etp == 0,
             f"model.moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} is not divisible by parallel.etp={etp}"),
            (cfg.moe_ffn_hidden_size * cfg.shared_experts % tp == 0,
             f"shared experts: model.moe_ffn_hidden_size * model.shared_experts = "
             f"{cfg.moe_ffn_hidden_size * cfg.shared_experts} is not divisible by parallel.tp={tp}"),
        ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    moe = set(moe_layer_indices(cfg))
    vocab_local = cfg.padded_vocab_size(tp) // tp
    stages = _stage_layers(cfg.num_layers, pp)
    best = 0
    for idx, layers in enumerate(stages):
        n = sum(_layer_params(cfg, i in moe, tp, ep, etp) for i in layers)
        first, last = idx == 0, idx == len(stages) - 1
        if first:
            n += vocab_local * h + (cfg.seq_len * h if cfg.position == "learned" else 0)
        if last:
            n += _norm_params(cfg)
            if not cfg.tie_embeddings or not first:
                n += vocab_local * h
        best = max(best, n)
    return best


_PRECISION_BYTES = {
    # precision: (weight bytes, grad bytes, fp32 main-param bytes, optimizer bytes) per param
    "fp32": (4, 4, 0, 8),
    "bf16": (2, 2, 4, 8),
}


def model_state_bytes(
    cfg: GPTConfig,
    tp: int = 1,
    ep: int = 1,
    etp: int = 1,
    pp: int = 1,
    zero_dp: int = 1,
    precision: str = "fp32",
) -> dict[str, int]:
    """Bytes of weights, gradients and AdamW state on the most loaded rank (no activations).

    Per parameter (N = params_per_rank(cfg, tp, ep, etp, pp)):
    * "fp32": weights 4 B, grads 4 B, AdamW exp_avg + exp_avg_sq 8 B;
    * "bf16": weights 2 B, grads 2 B, fp32 main params 4 B, AdamW 8 B.
    `zero_dp` is the number of data-parallel ranks the optimizer state and main params are
    sharded over (ZeRO-1 / distributed optimizer; 1 = unsharded). Returns a dict with
    `params`, `weights`, `grads`, `main_params`, `optimizer` and `total` (bytes).
    """
    return state_bytes_for(params_per_rank(cfg, tp=tp, ep=ep, etp=etp, pp=pp), zero_dp, precision)


def state_bytes_for(n: int, zero_dp: int = 1, precision: str = "fp32") -> dict[str, int]:
    """`model_state_bytes` for a known per-rank parameter count `n`."""
    if precision not in _PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} is unknown; use one of {sorted(_PRECISION_BYTES)}")
    if zero_dp < 1:
        raise ValueError(f"zero_dp={zero_dp} must be >= 1")
    wb, gb, mb, ob = _PRECISION_BYTES[precision]
    out = {
        "params": n,
        "weights": wb * n,
        "grads": gb * n,
        "main_params": math.ceil(mb * n / zero_dp),
        "optimizer": math.ceil(ob * n / zero_dp),
    }
    out["total"] = out["weights"] + out["grads"] + out["main_params"] + out["optimizer"]
    return out


# --------------------------------------------------------------------------- activations


def activation_bytes_per_microbatch(
    cfg: GPTConfig,
    micro_batch_size: int,
    tp: int = 1,
    sp: bool = False,
    bytes_per_elem: int = 4,
    *,
    flash_attention: bool = False,
) -> int:
    """Estimated bytes of activations saved for backward for ONE microbatch on one rank.

    Covers all layers (pp = 1), the embedding, and the LM head / loss. Follows Korthikanti
    et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), whose
    16-bit GPT layer keeps s*b*h*(34 + 5*a*s/h) bytes, rederived for this block. Tensors
    cost `bytes_per_elem` per element, dropout masks 1 B (torch.bool). Per layer, per token
    (s = seq_len, b = micro_batch_size, a heads, g kv heads, d head_dim, f ffn size):

    Replicated over tp (divided by tp only when `sp`, where each rank keeps s/tp tokens):
      norm1 input h, QKV input (norm1 output) h, norm2 input h, MLP input (norm2 output) h;
      when cfg.dropout > 0 the two residual-dropout masks h + h (bytes).
    Split over tp (divided by tp always):
      Q a*d (= h), K g*d, V g*d (GQA keeps only the kv heads), attention context / out-proj
      input h; softmax probabilities a*s, plus (dropout > 0) their mask a*s bytes and the
      dropped probabilities a*s. With `flash_attention` the three s-sized terms become the
      fp32 log-sum-exp, a values of 4 B (the context is already counted);
      MLP hidden: gelu fc1 output + gelu output = 2f; swiglu gate + up + product = 3f
      (a fused swiglu; the unfused torch path also keeps silu(gate), one more f).
    MoE layer (replaces the MLP; input still counted above): router probabilities E, and
      per routed expert (top_k per token) its permuted input h, hidden (2 or 3)*F and output
      h kept for the probability-weighted combine, all on the tokens this rank holds: the
      MoE layer always works on distinct tokens per TP rank (s*b/tp, with or without sp;
      balanced routing makes the count independent of ep; etp is not modelled); shared
      experts add (2 or 3)*F each on the same tokens.
    Outside the layers: embedding dropout mask h bytes (dropout > 0); final-norm input h and
      LM-head input h (sp-split); logits/softmax of the local vocab shard
      padded_vocab_size(tp)/tp, kept once in fp32 (4 B) for the vocab-parallel
      cross-entropy, as in Megatron.

    With bytes_per_elem=2, gelu, f=4h, g=a and dropout > 0 each layer is exactly the paper's
    s*b*h*(34 + 5*a*s/h) at tp=1, s*b*h*(10 + 24/tp + 5*a*s/(h*tp)) with tp, and
    s*b*h*(34 + 5*a*s/h)/tp with tp + sp. Small O(s*b) tensors (norm statistics, token ids,
    routing indices, per-token loss terms) are ignored. Monotone in every size, linear in b.
    """
    if micro_batch_size < 1 or tp < 1 or bytes_per_elem < 1:
        raise ValueError(
            f"micro_batch_size={micro_batch_size}, tp={tp}, bytes_per_elem={bytes_per_elem} must all be >= 1"
        )
    _check_moe(cfg)
    h, s, a, g, d = cfg.hidden_size, cfg.seq_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    e = bytes_per_elem
    drop = cfg.dropout > 0
    moe = set(moe_layer_indices(cfg))
    sp_div = tp if sp else 1

    # Per-token bytes before dividing by tp (split) or sp_div (replicated).
    rep_layer = 4 * h * e + (2 * h if drop else 0)
    split_attn = (2 * h + 2 * g * d) * e
    if flash_attention:
        split_attn += 4 * a
    else:
        split_attn += a * s * e + ((a * s + a * s * e) if drop else 0)
    split_dense_mlp = _act_hidden(cfg, cfg.ffn_hidden_size) * e
    fm = cfg.moe_ffn_hidden_size
    rep_moe = 0  # MoE tokens are split over tp inside the layer (moe/layer.py), with or without sp
    split_moe = (cfg.num_experts + cfg.top_k * (2 * h + _act_hidden(cfg, fm))) * e
    split_moe += cfg.shared_experts * _act_hidden(cfg, fm) * e

    rep = Fraction(0)
    split = Fraction(0)
    for i in range(cfg.num_layers):
        rep += rep_layer
        split += split_attn
        if i in moe:
            rep += rep_moe
            split += split_moe
        else:
            split += split_dense_mlp
    rep += (h if drop else 0) + 2 * h * e  # embedding dropout mask; final norm + LM-head inputs
    tokens = s * micro_batch_size
    logits = Fraction(4 * cfg.padded_vocab_size(tp), tp)
    total = tokens * (rep / sp_div + split / tp + logits)
    return math.ceil(total)
