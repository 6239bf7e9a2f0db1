"""The MoE layer: router -> (capacity) -> dispatch -> grouped experts -> combine (+ shared experts).

Tokens inside the layer are always distinct per rank: under sequence parallelism they
arrive as sequence shards; at tp > 1 without SP the layer keeps its TP rank's sequence chunk
on the way in and all-gathers the output on the way out (so ep can fold over the TP ranks,
e.g. tp=4 attention with ep=8 experts on 8 ranks). Routing statistics (aux loss, z-loss,
load) pool the tokens of the aux-loss scope (moe/scope.py) over its stats group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import GPTConfig
from moe.capacity import capacity_for, capacity_keep_mask
from moe.dispatcher import AllToAllDispatcher
from moe.experts import GroupedExperts, expert_out_init_std
from moe.router import RouterOutput, TopKRouter
from moe.scope import aux_loss_scope
from mpu.init import normal_init, tag
from mpu.mappings import all_reduce_stats, gather_from_region, scatter_to_sequence
from mpu.mesh import Mesh


class SharedExperts(nn.Module):
    """`n` always-visited experts as one MLP of width n * moe_ffn_hidden_size, replicated on
    every rank (gradient summed over tp x dp at tp > 1, since each rank sees its own tokens)."""

    def __init__(self, cfg: GPTConfig, mesh: Mesh, device=None, dtype=None):
        super().__init__()
        h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size * cfg.shared_experts
        sp = mesh.tp_size > 1
        out_std = expert_out_init_std(cfg.init_std, cfg.num_layers)

        def weight(shape, std):
            return tag(nn.Parameter(torch.empty(shape, device=device, dtype=dtype)), normal_init(shape, std),
                       sequence_parallel=sp)

        self.up = weight((f, h), cfg.init_std)
        self.gate = weight((f, h), cfg.init_std) if cfg.activation == "swiglu" else None
        self.down = weight((h, f), out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = F.linear(x, self.up)
        hidden = F.gelu(up, approximate="tanh") if self.gate is None else F.silu(F.linear(x, self.gate)) * up
        return F.linear(hidden, self.down)


class MoELayer(nn.Module):
    """Top-k routed experts over the expert mesh; input/output [s(/tp), b, h] like the dense MLP.

    After each forward, `last_router` holds the router's output (aux/z-loss terms and load)
    and `last_dropped` the global fraction of (token, choice) pairs dropped by capacity.
    """

    def __init__(self, cfg: GPTConfig, mesh: Mesh, device=None, dtype=None):
        super().__init__()
        self.cfg, self.mesh = cfg, mesh
        self.scope = aux_loss_scope(cfg.aux_loss_scope, mesh)
        self.router = TopKRouter(
            cfg.hidden_size, cfg.num_experts, cfg.top_k, score=cfg.router_score,
            renormalize=cfg.router_renormalize, aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef,
            bias_update_rate=cfg.router_bias_update_rate, groups=cfg.router_groups,
            topk_groups=cfg.router_topk_groups, pooled_aux=cfg.aux_loss_layers == "pooled", init_std=cfg.init_std,
            sequence_parallel=mesh.tp_size > 1, device=device, dtype=dtype,
        )
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.activation, mesh,
                                      init_std=cfg.init_std,
                                      out_init_std=expert_out_init_std(cfg.init_std, cfg.num_layers),
                                      backend=cfg.kernel_backend, device=device, dtype=dtype)
        self.shared = SharedExperts(cfg, mesh, device, dtype) if cfg.shared_experts else None
        self.dispatcher = AllToAllDispatcher(cfg.num_experts, mesh)
        self.last_router: RouterOutput | None = None
        self.last_dropped: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh, k = self.mesh, self.cfg.top_k
        gather_back = mesh.tp_size > 1 and not mesh.sequence_parallel
        if gather_back:
            x = scatter_to_sequence(x, mesh.tp)
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routed = self.router(x, self.scope.stats_group, per_sequence=self.scope.per_sequence)
        pair_expert = routed.topk_idx.reshape(-1)
        pair_weight = routed.topk_weight.reshape(-1)
        pair_token = torch.arange(s * b, device=x.device).repeat_interleave(k)
        kept = torch.tensor(float(pair_expert.numel()), device=x.device)
        if self.cfg.capacity_factor is not None:
            full_seq = s * mesh.tp_size
            capacity = capacity_for(full_seq, self.cfg.num_experts, k, self.cfg.capacity_factor)
            keep = capacity_keep_mask(routed.topk_idx.view(s, b, k), self.cfg.num_experts, capacity, mesh.tp)
            keep = keep.reshape(-1)
            pair_expert, pair_weight, pair_token = pair_expert[keep], pair_weight[keep], pair_token[keep]
            kept = keep.sum().to(torch.float32)
        counts = all_reduce_stats(torch.stack([kept, torch.tensor(float(s * b * k), device=x.device)]), mesh.tp_dp)
        self.last_dropped = 1.0 - counts[0] / counts[1]
        self.last_router = routed

        rows, group_sizes, state = self.dispatcher.dispatch(tokens, pair_expert, pair_token)
        expert_out = self.experts(rows, group_sizes)
        pair_out = self.dispatcher.combine(expert_out, state)
        weights = pair_weight[state.pair_order].unsqueeze(-1)
        out = torch.zeros_like(tokens).index_add(0, state.pair_token, (pair_out * weights).to(tokens.dtype))
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(s, b, h)
        if gather_back:
            out = gather_from_region(out, 0, mesh.tp)
        return out
