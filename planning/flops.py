"""Analytic FLOP and parameter counts for meshtron's GPT (dense and MoE).

Everything here is pure arithmetic on a `GPTConfig` (the sharding rules are mpu.mesh's): no
process groups. The
formulas follow the model as built in `models/` (pre-norm blocks, fused QKV, GQA or MLA, gelu or
swiglu MLP, optional MoE layers every `moe_every` layers, optional tied LM head):

* `model_flops_per_token` is the number MFU is computed from
  (MFU = flops_per_token * tokens_per_s / peak_flops).
* `param_count` counts unique parameters of the unsharded model.
* `params_per_rank` gives the per-rank parameters under tp / ep / etp / pp sharding.

Memory (model states, activations) has one model: `planning.plan`.
"""

from __future__ import annotations

from meshtron.models.config import GPTConfig
from meshtron.models.fits import tensor_shard_checks
from meshtron.mpu.mesh import expert_shard_checks
from meshtron.rules import raise_first

__all__ = [
    "model_flops_per_token",
    "attention_width",
    "attention_core_flops_per_token",
    "mla_projection_matrices",
    "param_count",
    "params_per_rank",
    "moe_layer_indices",
]


# --------------------------------------------------------------------------- helpers


def _mtp_blocks(cfg: GPTConfig) -> list[int]:
    """Global block indices of the MTP depths (models/mtp.py): num_layers .. num_layers + D - 1
    (MoE or dense by cfg.is_moe_layer, as the model builds them)."""
    return list(range(cfg.num_layers, cfg.num_layers + cfg.mtp_depths))


def moe_layer_indices(cfg: GPTConfig) -> list[int]:
    """Indices i of the layers whose MLP is a MoE layer (`GPTConfig.is_moe_layer`; none if dense)."""
    if cfg.moe_every < 1:
        raise ValueError(f"model.moe_every={cfg.moe_every} must be >= 1")
    return [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]


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


def attention_width(cfg: GPTConfig) -> int:
    """Width of the attention's q and output, num_heads * head_dim: hidden_size unless
    model.kv_channels gives the heads a width of their own (Qwen3-0.6B: 16 x 128 = 2048 at
    hidden 1024). K and V are num_kv_heads * head_dim wide. Every planner term on the attention's
    q, scores or output uses this width, never hidden_size."""
    return cfg.num_heads * cfg.head_dim


def attention_core_flops_per_token(cfg: GPTConfig) -> float:
    """Forward FLOPs per token of one layer's attention core, q k^T and probabilities x v over
    the full s x s square (causal mask ignored): 2 * 2 * s * a * d, a * d the attention width;
    under MLA 2 * s * a * (dq + dv) (q and k dq = qk_nope + qk_rope wide, v dv wide).
    What selective recompute replays in backward, and what context-parallel attention overlaps
    its ring passes with."""
    if cfg.attention == "mla":
        return float(2 * cfg.seq_len * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim))
    return float(4 * cfg.seq_len * attention_width(cfg))


def mla_projection_matrices(cfg: GPTConfig, tp: int = 1) -> tuple[int, int]:
    """Weight elements of one MLA layer's projections as (replicated, split over tp) at tp:
    h hidden, a heads, dq = qk_nope + qk_rope, dn, dr, dv the head widths, rq / rkv the ranks:
    * replicated: q_a_proj rq*h (q_lora_rank set), kv_a_proj_with_mqa (rkv + dr)*h;
    * column / row-parallel, split by heads: q_b_proj a*dq*rq (or q_proj a*dq*h), kv_b_proj
      a*(dn + dv)*rkv, o_proj a*dv*h.
    Also the forward multiply-adds per token of the projections (each weight element once)."""
    h, a = cfg.hidden_size, cfg.num_heads
    dq, rkv, rq = cfg.head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    replicated = (rkv + cfg.qk_rope_head_dim) * h + (rq * h if rq is not None else 0)
    split = a * dq * (rq if rq is not None else h) + a * (cfg.qk_nope_head_dim + cfg.v_head_dim) * rkv
    split += a * cfg.v_head_dim * h
    return replicated, split // tp


def _attention_projection_flops(cfg: GPTConfig) -> int:
    """Forward FLOPs per token of one layer's attention projections: fused QKV + out proj, or
    MLA's five (two multiply-adds per weight element, `mla_projection_matrices`)."""
    if cfg.attention == "mla":
        return 2 * sum(mla_projection_matrices(cfg))
    return 2 * cfg.hidden_size * _qkv_out(cfg) + 2 * attention_width(cfg) * cfg.hidden_size


# --------------------------------------------------------------------------- FLOPs


def model_flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), matmuls only.

    A multiply-add is 2 FLOPs. Per layer, forward, per token (h hidden, s seq_len,
    a heads, g kv heads, d head_dim, f ffn_hidden_size):

    * fused QKV:        2 * h * (a + 2g) * d
    * attention scores: 2 * s * a * d   (Q K^T against all s keys; a * d = h unless
      model.kv_channels sets d)
    * attention x V:    2 * s * a * d
      The causal mask is ignored: both attention matmuls are counted over the full s x s
      square (the common Megatron / PaLM convention), so this is ~2*s*h more than the
      useful work of a causal model.
    * output proj:      2 * a * d * h
    * MLP:              gelu 2 * 2*h*f;  swiglu 2 * 3*h*f
    * MLA (model.attention=mla) instead of QKV, scores, x V and output proj, with dq =
      qk_nope + qk_rope, dn, dr, dv the head widths, rq / rkv the latent ranks:
      q: 2*h*rq + 2*rq*a*dq (q_lora_rank set) or 2*h*a*dq; kv down: 2*h*(rkv + dr);
      kv up: 2*rkv*a*(dn + dv); scores 2*s*a*dq; x V 2*s*a*dv; output 2*a*dv*h
      (latent norms and RoPE not counted; Megatron-Core's num_floating_point_operations has the
      same matrices, plus rq + rkv for the norms, and halves the core for the causal mask).
    * MoE layer instead of MLP: router 2*h*E + top_k MLPs of moe_ffn_hidden_size (the
      tokens' routed experts) + the shared experts' MLP (its width: shared_ffn_hidden_size or
      shared_experts * moe_ffn_hidden_size) and output gate 2*h (Qwen2-MoE).

    plus the LM head 2 * h * V, with V = cfg.padded_vocab_size(1) (the padded logits are
    computed; using tp=1's padding keeps the figure independent of the layout).
    Norms, softmax, activations, RoPE and the embedding lookup are not counted.
    Each multi-token prediction depth (model.mtp_depths, models/mtp.py) adds one block (MoE or
    dense as cfg.is_moe_layer of its index num_layers + k - 1), its projection 2 * 2h * h and
    one more LM head 2 * h * V (every token runs every depth; the ignored tail is computed).
    """
    cfg.validate()
    h = cfg.hidden_size
    moe = set(moe_layer_indices(cfg))
    attn = _attention_projection_flops(cfg) + attention_core_flops_per_token(cfg)
    dense_mlp = 2 * _mlp_matrices(cfg, cfg.ffn_hidden_size)
    shared = _mlp_matrices(cfg, cfg.moe().shared_width) + (h if cfg.shared_expert_gate else 0)
    moe_mlp = 2 * h * cfg.num_experts + 2 * cfg.top_k * _mlp_matrices(cfg, cfg.moe_ffn_hidden_size) + 2 * shared
    forward = sum(attn + (moe_mlp if i in moe else dense_mlp) for i in range(cfg.num_layers))
    forward += 2 * h * cfg.padded_vocab_size(1)
    for i in _mtp_blocks(cfg):
        forward += (
            attn + (moe_mlp if cfg.is_moe_layer(i) else dense_mlp) + 2 * 2 * h * h + 2 * h * cfg.padded_vocab_size(1)
        )
    return float(3 * forward)


# --------------------------------------------------------------------------- parameters


def _layer_params(cfg: GPTConfig, is_moe: bool, tp: int = 1, ep: int = 1, etp: int = 1) -> int:
    """Parameters of one block held by one rank (tp/ep/etp = 1: the full block)."""
    h = cfg.hidden_size
    n = 2 * _norm_params(cfg)  # norm1, norm2: replicated over tp
    if cfg.attention == "mla":  # models/mla.py: down projections and latent norms replicated
        replicated, split = mla_projection_matrices(cfg, tp)
        n += replicated + split + cfg.kv_lora_rank + (cfg.q_lora_rank or 0) + (h if cfg.bias else 0)
    else:
        qkv = _qkv_out(cfg)
        n += 2 * cfg.head_dim if cfg.qk_norm else 0  # q and k norms: replicated over tp
        n += h * qkv // tp + (qkv // tp if cfg.qkv_bias else 0)  # column-parallel fused QKV
        n += attention_width(cfg) * h // tp + (h if cfg.bias else 0)  # row-parallel out proj, replicated bias
    if not is_moe:
        f = cfg.ffn_hidden_size
        n += _mlp_matrices(cfg, f) // tp
        if cfg.bias:
            n += (1 if cfg.activation == "gelu" else 2) * f // tp + h  # column biases split, row bias replicated
        return n
    fm = cfg.moe_ffn_hidden_size
    n += cfg.num_experts * h  # router, replicated
    n += (cfg.num_experts // ep) * _mlp_matrices(cfg, fm) // etp  # routed experts, no biases
    n += _mlp_matrices(cfg, cfg.moe().shared_width) // tp  # shared experts: tensor-parallel like the MLP
    n += h if cfg.shared_expert_gate else 0  # their output gate (Qwen2-MoE), replicated
    return n


def _mtp_params(cfg: GPTConfig, tp: int = 1, ep: int = 1, etp: int = 1) -> int:
    """Parameters of the MTP depths held by one rank of the last stage: per depth enorm, hnorm
    and the final norm (replicated), the projection [h, 2h] (replicated over tp) and one block."""
    h = cfg.hidden_size
    return sum(
        3 * _norm_params(cfg) + 2 * h * h + _layer_params(cfg, cfg.is_moe_layer(i), tp, ep, etp)
        for i in _mtp_blocks(cfg)
    )


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
    The MTP depths (model.mtp_depths) are counted in `total`: three norms, the projection
    [h, 2h] and one block each (they share the embedding and the head).
    """
    cfg.validate()
    h = cfg.hidden_size
    vocab = cfg.padded_vocab_size(1)
    moe = set(moe_layer_indices(cfg))
    embedding = vocab * h + (cfg.seq_len * h if cfg.position == "learned" else 0)
    embedding += 0 if cfg.tie_embeddings else vocab * h
    total = embedding + _norm_params(cfg)
    total += sum(_layer_params(cfg, i in moe) for i in range(cfg.num_layers))
    total += _mtp_params(cfg)
    routed = len(moe) + sum(cfg.is_moe_layer(i) for i in _mtp_blocks(cfg))
    idle = routed * (cfg.num_experts - cfg.top_k) * _mlp_matrices(cfg, cfg.moe_ffn_hidden_size)
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
    the final norm and LM head (with tied embeddings and pp > 1, a copy of the embedding) and
    the MTP depths (with pp > 1 and untied embeddings, the embedding's copy they read).
    Returns the maximum over stages. Raises ValueError when a size does not divide.
    """
    h = cfg.hidden_size
    if min(tp, ep, etp, pp) < 1:
        raise ValueError(f"parallel sizes must be >= 1 (tp={tp}, ep={ep}, etp={etp}, pp={pp})")
    checks = tensor_shard_checks(cfg, tp)
    if cfg.is_moe:
        checks += expert_shard_checks(
            cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.shared_experts, ep=ep, etp=etp, tp=tp
        )
    raise_first(checks)
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
            n += _mtp_params(cfg, tp, ep, etp)
            if cfg.mtp_depths and not cfg.tie_embeddings and not first:
                n += vocab_local * h  # the embedding's copy on the last stage
        best = max(best, n)
    return best
