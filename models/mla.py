"""Multi-head latent attention (MLA, DeepSeek-V2/V3) with heads split over tensor parallelism.

Per token x (width h), with a heads, nope / rope / v head widths dn, dr, dv (dq = dn + dr):

    q      = W_qb rms(W_qa x)  (q_lora_rank set)  or  W_q x               [a, dq]
    c, kr  = split(W_kva x, [kv_lora_rank, dr])                           latent, rope key
    k_n, v = split(W_kvb rms(c), per head [dn, dv])                       [a, dn], [a, dv]
    q      = [q_nope, rope(q_rope)];  k = [k_n, rope(kr) for every head]
    out    = W_o softmax(q k^T * scale + causal) v,   scale = dq^-1/2 (x yarn's mscale^2)

the numerics of transformers' DeepseekV3Attention. RoPE is the rotate-half convention of
models/rope.py over the dr rope dims; DeepSeek's checkpoints use the interleaved convention
(`rope_interleave`, pairs (x0, x1), (x2, x3), ...), which is rotate-half of the rope dims
de-interleaved (evens first, then odds): importing permutes the rope rows of q_b_proj (or
q_proj) per head and of kv_a_proj_with_mqa once (`deinterleave_rope_rows`), and the model
computes the same scores. The softmax scale follows transformers' `yarn_apply_mscale`: with a
scaling dict holding a nonzero mscale_all_dim, dq^-1/2 * (0.1 mscale_all_dim ln(factor) + 1)^2
(the RoPE tables carry yarn's attention factor as for every model, models/rope.py).

Tensor parallelism: the block input enters the TP region once (all-gathered along the
sequence under SP, else copied: backward sums its gradient over tp), then the down projections
W_qa, W_kva and the latent norms run replicated on the whole sequence (their outputs are
small); the up projections W_qb (or W_q) and W_kvb are column-parallel by heads (rows grouped
per head: [head 0: nope, rope | head 1: ...] and [head 0: k_nope, v | ...], transformers'
layout) and W_o row-parallel (reduce-scattered under SP). Each rank uses only its heads'
share of the latents and of the rope key, so the gradients of the replicated weights are
partial sums per rank: they are tagged `sequence_parallel` when tp > 1 (summed over tp x dp,
as the norms under SP). No extra collective beyond the dense attention's pair.

Refused (one line, ConfigError): context parallelism (cp > 1: the ring / all-to-all kernels
assume one head width for q, k and v and the default scale); the config refuses grouped-query
heads, q/k norm, q/k/v biases and a sliding window with MLA (models/config.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from meshtron.errors import ConfigError
from meshtron.models.attention_core import causal_attention
from meshtron.models.config import GPTConfig
from meshtron.models.rope import apply_rope
from meshtron.mpu import fp8
from meshtron.mpu.init import constant_init, normal_init, tag
from meshtron.mpu.layers import ColumnParallelLinear, RowParallelLinear, enter_tp_region
from meshtron.mpu.mesh import Mesh
from meshtron.mpu.recompute import recompute
from meshtron.rules import raise_first

__all__ = [
    "MLAttention",
    "Replicated",
    "mla_softmax_scale",
    "mla_checks",
    "deinterleave_rope_rows",
    "interleave_rope_rows",
]


def mla_checks(cp: int) -> list[tuple[bool, str]]:
    """What MLA's layer refuses of the layout: nothing now (context parallelism runs its core
    through mpu.context_parallel; kept as the one place for future rules)."""
    return []


def mla_softmax_scale(cfg: GPTConfig) -> float:
    """softmax scale: (qk_nope + qk_rope)^-1/2, times mscale(factor, mscale_all_dim)^2 with
    mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1) when rope_scaling has a nonzero
    mscale_all_dim (transformers' DeepSeek-V3 `yarn_apply_mscale`, any non-default rope type)."""
    scale = cfg.head_dim**-0.5
    scaling = cfg.rope_scaling
    if scaling and scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        factor = scaling["factor"]
        m = 1.0 if factor <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0
        scale = scale * m * m
    return scale


def deinterleave_rope_rows(weight: torch.Tensor, rope_dim: int, head_width: int, rope_offset: int) -> torch.Tensor:
    """`weight` [heads * head_width, in] (or [head_width, in] for one head) with each head's rope
    rows, at `rope_offset` within its `head_width` rows, reordered from DeepSeek's interleaved
    pairs to rotate-half order (rows 0, 2, 4, ... then 1, 3, 5, ...): transformers'
    `apply_rotary_pos_emb_interleave` on the original rows equals meshtron's rotate-half RoPE
    on the returned ones. Import: q_b_proj / q_proj (head_width dq, offset dn) and
    kv_a_proj_with_mqa (one head of kv_lora_rank + dr rows, offset kv_lora_rank)."""
    return weight[_rope_rows(weight.shape[0], rope_dim, head_width, rope_offset)]


def interleave_rope_rows(weight: torch.Tensor, rope_dim: int, head_width: int, rope_offset: int) -> torch.Tensor:
    """The inverse of `deinterleave_rope_rows` (export to rope_interleave=true checkpoints)."""
    return weight[torch.argsort(_rope_rows(weight.shape[0], rope_dim, head_width, rope_offset))]


def _rope_rows(total: int, rope_dim: int, head_width: int, rope_offset: int) -> torch.Tensor:
    """Row order of `deinterleave_rope_rows` for `total` rows of heads `head_width` wide."""
    heads = total // head_width
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)]) + rope_offset
    rows = torch.arange(head_width).repeat(heads, 1)
    rows[:, rope_offset : rope_offset + rope_dim] = order
    return (rows + torch.arange(heads).unsqueeze(1) * head_width).reshape(-1)


class Replicated(nn.Module):
    """A weight (`.weight`) replicated over tp whose gradient is a partial sum per tp rank
    (each rank backpropagates its own heads only): summed over tp x dp when tp > 1."""

    def __init__(self, shape: tuple[int, ...], init, mesh: Mesh, device=None, dtype=None):
        super().__init__()
        param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.weight = tag(param, init, sequence_parallel=mesh.tp_size > 1)


class MLAttention(nn.Module):
    """Causal multi-head latent attention with heads split over TP (module docstring).
    Parameter names follow transformers' DeepseekV3Attention (q_a_proj, q_a_layernorm, q_b_proj
    or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; `.weight` each).
    `selective`: recompute the attention core in backward instead of saving its internals."""

    def __init__(
        self,
        cfg: GPTConfig,
        mesh: Mesh,
        device=None,
        dtype=None,
        *,
        selective: bool = False,
        backend: str = "auto",
    ):
        super().__init__()
        raise_first(mla_checks(mesh.cp_size), ConfigError)
        self.cfg, self.mesh, self.selective, self.backend = cfg, mesh, selective, backend
        h, a = cfg.hidden_size, cfg.num_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.dq, self.rank = self.dn + self.dr, cfg.kv_lora_rank
        self.scale = mla_softmax_scale(cfg)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        column = dict(bias=False, init_std=std, device=device, dtype=dtype)
        self.q_a_proj = self.q_a_layernorm = self.q_b_proj = self.q_proj = None
        if cfg.q_lora_rank is not None:
            r = cfg.q_lora_rank
            self.q_a_proj = Replicated((r, h), normal_init((r, h), std), mesh, device, dtype)
            self.q_a_layernorm = Replicated((r,), constant_init((r,), 1.0), mesh, device, dtype)
            self.q_b_proj = ColumnParallelLinear(r, a * self.dq, mesh, **column)
        else:
            self.q_proj = ColumnParallelLinear(h, a * self.dq, mesh, **column)
        kv_a = self.rank + self.dr
        self.kv_a_proj_with_mqa = Replicated((kv_a, h), normal_init((kv_a, h), std), mesh, device, dtype)
        self.kv_a_layernorm = Replicated((self.rank,), constant_init((self.rank,), 1.0), mesh, device, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.rank, a * (self.dn + self.dv), mesh, **column)
        self.o_proj = RowParallelLinear(
            a * self.dv, h, mesh, bias=cfg.bias, init_std=out_std, device=device, dtype=dtype
        )

    def _norm(self, x: torch.Tensor, norm: Replicated) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), norm.weight.to(x.dtype), self.cfg.norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [s(/tp), b, h] (a sequence shard under SP) -> [s(/tp), b, h]; `rope` the cos/sin
        tables of the dr rope dims ([s, dr] or [b, 1, s, dr]); `doc_ids` as Attention's."""
        x = enter_tp_region(x, self.mesh)  # [s, b, h]: the whole sequence, replicated over tp
        if self.q_proj is not None:
            q = fp8.linear(x, self.q_proj.weight)
        else:
            q = fp8.linear(self._norm(fp8.linear(x, self.q_a_proj.weight), self.q_a_layernorm), self.q_b_proj.weight)
        q = rearrange(q, "s b (a d) -> b a s d", d=self.dq)  # this rank's heads
        q_nope, q_rope = q.split([self.dn, self.dr], dim=-1)
        latent, k_rope = fp8.linear(x, self.kv_a_proj_with_mqa.weight).split([self.rank, self.dr], dim=-1)
        kv = fp8.linear(self._norm(latent, self.kv_a_layernorm), self.kv_b_proj.weight)
        kv = rearrange(kv, "s b (a d) -> b a s d", d=self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k_rope = rearrange(k_rope, "s b d -> b 1 s d")
        if rope is not None:
            cos, sin = rope
            q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if self.training and self.selective:
            out = recompute(self._core, q, k, v.contiguous(), doc_ids)
        else:
            out = self._core(q, k, v.contiguous(), doc_ids)
        return self.o_proj(rearrange(out, "b a s d -> s b (a d)"))

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """softmax(q k^T * scale + causal mask) v over this rank's heads, q/k dq wide and v dv
        wide (models/attention_core.py: dropout, packed documents `doc_ids` [b, s], context
        parallelism over mesh.cp)."""
        p = self.cfg.attention_dropout_p if self.training else 0.0
        return causal_attention(
            q, k, v, self.mesh, doc_ids=doc_ids, dropout_p=p, backend=self.backend, scale=self.scale
        )
