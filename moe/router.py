"""MoE router: linear gate -> scores -> top-k experts per token, with balancing losses.

All router math runs in fp32 whatever the activation dtype, under autocast too (the gate
GEMM [T, h] x [h, E] is small, and 16-bit logits would tie and flip top-k choices). The
balancing statistics (expert counts, mean router probabilities, token count) pool one token
set (a microbatch, a sequence, or microbatch j of every dp rank: the aux-loss scope,
moe/scope.py) and are *global over the stats group* (the ranks holding shards of that set),
obtained with one non-differentiable `all_reduce_stats` per forward; no activations are
communicated. Each rank returns a differentiable *contribution* to each loss such that the
contributions sum (over the stats group) to the single-process loss, so gradients summed
over the group equal the single-process gradient.

Tie-breaking: experts are chosen by a stable descending sort of the selection scores, so
among equal scores the lower expert index wins, on every device and layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.moe.config import routing_checks
from meshtron.moe.counts import add_counts
from meshtron.mpu.init import normal_init, tag
from meshtron.mpu.mappings import all_reduce_stats
from meshtron.mpu.recompute import is_replaying
from meshtron.rules import raise_first


@dataclass
class Routing:
    """What `TopKRouter.route` returns: the expert choice, and what its statistics read.

    topk_idx: LongTensor [..., k], chosen experts, best first.
    topk_weight: fp32 [..., k], combine weights (differentiable w.r.t. router weight and x).
    logits / probs: fp32 [T, E] (T = tokens), the gate logits and the router probabilities
        P of the aux loss (differentiable).
    """

    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


@dataclass
class RouterOutput:
    """What `TopKRouter.statistics` (and so `forward`) returns.

    topk_idx: LongTensor [..., k], chosen experts, best first.
    topk_weight: fp32 [..., k], combine weights (differentiable w.r.t. router weight and x).
    aux_loss / z_loss: 0-dim differentiable: this rank's contribution, times the coefficient,
        divided by num_microbatches (a zero tensor when the coefficient is 0).
    aux_value / z_value: 0-dim, no grad: the loss values without coefficient over the pooled
        tokens (identical on every rank of the stats group).
    tokens_per_expert: fp32 [E], no grad: (token, choice) assignments per expert over the
        stats group.
    num_tokens: 0-dim int64, no grad: number of tokens over the stats group (a property, from
        `tokens_total`, the same count in fp64).
    set_counts / set_prob_sum_global: fp64 [S, E], no grad: per pooled set (S sequences, or 1)
        the assignments and summed router probabilities over the stats group.
    set_prob_sum: fp32 [S, E], differentiable: this rank's share of the summed probabilities.
    tokens_per_set: 0-dim fp64, no grad: tokens of one pooled set over the stats group.
    (The set statistics let `pooled_aux_loss` pool several layers' routers.)
    """

    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    aux_value: torch.Tensor
    z_value: torch.Tensor
    tokens_per_expert: torch.Tensor
    tokens_total: torch.Tensor
    set_counts: torch.Tensor
    set_prob_sum: torch.Tensor
    set_prob_sum_global: torch.Tensor
    tokens_per_set: torch.Tensor

    @property
    def num_tokens(self) -> torch.Tensor:
        return self.tokens_total.round().long()


class TopKRouter(nn.Module):
    """Top-k gate: logits = x W^T (W: [E, h], replicated), scores, expert choice and losses.

    score="softmax": probs = softmax(logits); choose top-k of probs (+ expert_bias when
        bias_update_rate > 0); weights = chosen probs, renormalized over the k when
        `renormalize` (Mixtral) else raw (Switch/GShard).
    score="sigmoid" (DeepSeek-V3): s = sigmoid(logits); choose top-k of s + expert_bias;
        weights = chosen s (no bias) normalized over the k (always; renormalize must be True).
    groups > 0 (DeepSeek-V3 group-limited routing): the choice is restricted to each token's
        best `topk_groups` of `groups` consecutive expert groups (`_limit_to_top_groups`).

    Losses (global over `stats_group`, see module docstring): Switch load-balancing
    aux = E * sum_i f_i P_i (f_i: fraction of (token, choice) assignments to expert i,
    P_i: mean router probability of expert i; for sigmoid the per-token normalized scores)
    and ST-MoE z-loss z = mean_t logsumexp(logits_t)^2.

    `expert_bias` (persistent) drives DeepSeek-V3 aux-loss-free balancing through
    `update_expert_bias`; `step_load` (non-persistent) accumulates the per-expert load of the
    current optimizer step over the stats group while training (the caller sums it over the
    replica group of the scope before the update).
    The only communication is one `all_reduce_stats` over `stats_group` per forward.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score: str = "softmax",
        renormalize: bool = True,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0,
        groups: int = 0,
        topk_groups: int = 0,
        pooled_aux: bool = False,
        scaling_factor: float = 1.0,
        init_std: float = 0.02,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        raise_first(
            routing_checks(
                num_experts,
                top_k,
                score=score,
                renormalize=renormalize,
                groups=groups,
                topk_groups=topk_groups,
                aux_loss_coef=aux_loss_coef,
                z_loss_coef=z_loss_coef,
                bias_update_rate=bias_update_rate,
            )
        )
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.score = score
        self.renormalize = renormalize
        self.aux_loss_coef = float(aux_loss_coef)
        self.z_loss_coef = float(z_loss_coef)
        self.bias_update_rate = float(bias_update_rate)
        self.groups, self.topk_groups = int(groups), int(topk_groups)
        self.pooled_aux = bool(pooled_aux)  # the aux loss is formed across layers (pooled_aux_loss)
        self.scaling_factor = float(scaling_factor)  # DeepSeek-V3's routed_scaling_factor
        init_fn = normal_init((num_experts, hidden_size), init_std)
        self.weight = tag(
            nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype)),
            init_fn,
            tp_shard_dim=None,
            sequence_parallel=sequence_parallel,
        )
        if self.weight.device.type != "meta":
            # A usable value when built standalone; initialize_parameters overwrites it with the
            # (seed, name)-derived value in a model.
            with torch.no_grad():
                self.weight.copy_(init_fn(0, "router.weight").to(self.weight.dtype))
        # The statistics' all-reduce; MoELayer.compile_moe swaps in a copy that torch.compile
        # runs eagerly (a graph break), since a collective does not trace.
        self.reduce_stats = all_reduce_stats
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        self.register_buffer(
            "step_load", torch.zeros(num_experts, device=device, dtype=torch.float32), persistent=False
        )

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score={self.score}, renormalize={self.renormalize}, aux_loss_coef={self.aux_loss_coef}, "
            f"z_loss_coef={self.z_loss_coef}, bias_update_rate={self.bias_update_rate}"
            + (f", scaling_factor={self.scaling_factor}" if self.scaling_factor != 1.0 else "")
            + (f", groups={self.groups}, topk_groups={self.topk_groups}" if self.groups else "")
        )

    def forward(
        self, x: torch.Tensor, stats_group, num_microbatches: int = 1, *, per_sequence: bool = False
    ) -> RouterOutput:
        """Route the tokens x [..., h] of this rank and compute their balancing statistics:
        `statistics(route(x), ...)`. The MoE layer calls the two halves apart, so that the
        statistics are issued after the expert GEMMs (see `statistics`)."""
        return self.statistics(self.route(x), stats_group, num_microbatches, per_sequence=per_sequence)

    def route(self, x: torch.Tensor) -> Routing:
        """The expert choice of the tokens x [..., h] (the MoE layer passes [s, b, h]): top-k
        experts and combine weights per token. No communication."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"router input has hidden size {x.shape[-1]}, expected {self.hidden_size}")
        k = self.top_k
        with _without_autocast(x.device.type):  # the gate GEMM in fp32 under autocast too
            logits = F.linear(x.reshape(-1, self.hidden_size).float(), self.weight.float())  # [T, E]

        if self.score == "softmax":
            scores = torch.softmax(logits, dim=-1)
            probs = scores  # the P of the aux loss
            use_bias = self.bias_update_rate > 0
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)
            use_bias = True  # zero unless updated
        select = scores.detach() + self.expert_bias if use_bias else scores.detach()
        if self.groups:
            select = self._limit_to_top_groups(select)
        # Stable descending sort: equal scores keep index order, so the lower expert wins.
        # Contiguous once here: the statistics and the dispatch both flatten it.
        topk_idx = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
        topk_weight = scores.gather(-1, topk_idx)
        if self.score == "sigmoid" or self.renormalize:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        if self.scaling_factor != 1.0:
            topk_weight = topk_weight * self.scaling_factor
        return Routing(topk_idx.view(*x.shape[:-1], k), topk_weight.view(*x.shape[:-1], k), logits, probs)

    def statistics(
        self, routing: Routing, stats_group, num_microbatches: int = 1, *, per_sequence: bool = False
    ) -> RouterOutput:
        """The balancing statistics and losses of `routing` (this rank's `route` output).

        `stats_group` holds the ranks with the other shards of the pooled tokens (None: this
        rank holds them all); the statistics are all-reduced over it (one `all_reduce_stats`,
        through the `reduce_stats` hook). `per_sequence` pools one statistic per sequence (dim
        1 of [s, b, h] tokens; the aux loss is their mean) instead of one over all tokens.
        Losses are divided by `num_microbatches` so that summing them over microbatches gives
        the mean over the step. Nothing in the expert computation needs these, so the MoE
        layer issues them after the expert GEMMs: on a GPU that starts a layer idle, the first
        large kernel then waits only for the routing's ops.
        """
        lead, logits, probs = routing.topk_idx.shape[:-1], routing.logits, routing.probs
        if per_sequence and len(lead) != 2:
            raise ValueError(f"per-sequence statistics need tokens [s, b, h], got {len(lead) + 1} dims")
        E, k = self.num_experts, self.top_k
        topk_idx = routing.topk_idx.view(-1, k)

        # Local statistics per pooled set ([S, E]: S = sequences, or 1), written straight into
        # the one fp64 vector that is all-reduced: [counts | prob_sum | sum lse^2 | tokens].
        # Every step below is one tensor op (a kernel launch on a GPU), so they are few.
        T_local = logits.shape[0]
        S = lead[1] if per_sequence else 1
        local = torch.zeros(2 * S * E + 2, device=logits.device, dtype=torch.float64)
        cell = topk_idx  # [T, k] -> cell of the [S, E] counts; tokens are [s, b] flattened, sequence b = t % S
        if S > 1:
            cell = topk_idx + E * (torch.arange(T_local, device=logits.device) % S).unsqueeze(1)
        add_counts(local[: S * E], cell.view(-1))  # exact integer counts
        prob_sum = probs.view(-1, S, E).sum(0)  # [S, E], differentiable
        local[S * E : 2 * S * E].copy_(prob_sum.detach().view(-1))
        lse_sq_sum = torch.logsumexp(logits, dim=-1).square().sum()  # differentiable
        local[2 * S * E].copy_(lse_sq_sum.detach())
        local[-1:].fill_(T_local)
        glob = local if stats_group is None else self.reduce_stats(local, stats_group)
        counts_g, prob_sum_g = glob[: S * E].view(S, E), glob[S * E : 2 * S * E]
        lse_sq_g, T_g = glob[2 * S * E], glob[-1]

        # aux = E * sum_i f_i P_i per set, averaged over the S sets, with f = counts / (T_set k)
        # (no grad, as in Switch) and P = prob_sum / T_set, T_set = T_g / S:
        # sum(weight * prob_sum) with weight = counts * E S / (k T_g^2).
        weight = counts_g.view(-1) / (T_g.square() * (k / (E * S)))  # fp64, no grad
        with torch.no_grad():
            values = torch.stack([torch.dot(weight, prob_sum_g), lse_sq_g / T_g, T_g]).float()
            aux_value, z_value, T_g32 = values.unbind()
            tokens_per_expert = counts_g.sum(0, dtype=torch.float32)
            if self.training and not is_replaying():  # a recomputation must not count the load twice
                self.step_load += tokens_per_expert

        per_layer_aux = self.aux_loss_coef > 0 and not self.pooled_aux
        zero = None if per_layer_aux and self.z_loss_coef > 0 else logits.new_zeros(())
        aux_loss = (
            torch.dot(weight.float(), prob_sum.view(-1)) * (self.aux_loss_coef / num_microbatches)
            if per_layer_aux
            else zero
        )
        z_loss = lse_sq_sum * (self.z_loss_coef / num_microbatches) / T_g32 if self.z_loss_coef > 0 else zero
        return RouterOutput(
            topk_idx=routing.topk_idx,
            topk_weight=routing.topk_weight,
            aux_loss=aux_loss,
            z_loss=z_loss,
            aux_value=aux_value,
            z_value=z_value,
            tokens_per_expert=tokens_per_expert,
            tokens_total=T_g,
            set_counts=counts_g,
            set_prob_sum=prob_sum,
            set_prob_sum_global=prob_sum_g.view(S, E),
            tokens_per_set=T_g if S == 1 else T_g / S,
        )

    def _limit_to_top_groups(self, select: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (DeepSeek-V3 node-limited): experts form `groups` equal
        consecutive groups; a group's score is the sum of its best `per_group` selection scores
        (per_group = top_k // topk_groups, at least 1); the experts outside each token's best
        `topk_groups` groups get -inf. Ties go to the lower group index."""
        T, E = select.shape
        size = E // self.groups
        per_group = min(size, max(1, self.top_k // self.topk_groups))
        ranked = torch.sort(select.view(T, self.groups, size), dim=-1, descending=True, stable=True).values
        group_score = ranked[..., :per_group].sum(-1)  # [T, groups]
        best = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, : self.topk_groups]
        allowed = torch.zeros(T, self.groups, dtype=torch.bool, device=select.device).scatter_(1, best, True)
        return select.masked_fill(~allowed.repeat_interleave(size, dim=1), float("-inf"))

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """DeepSeek-V3 aux-loss-free balancing; call once per optimizer step, after the optimizer.

        expert_bias += rate * sign(mean(step_load) - step_load) when bias_update_rate > 0,
        then step_load is zeroed (always). No communication: the caller has made step_load
        global (summed over the scope's replica group), so every rank computes the same bias.
        """
        if self.bias_update_rate > 0:
            self.expert_bias += self.bias_update_rate * torch.sign(self.step_load.mean() - self.step_load)
        self.step_load.zero_()


def _without_autocast(device_type: str):
    """A context that turns autocast off on `device_type` where it is on (else does nothing)."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def pooled_aux_loss(
    outputs: list[RouterOutput], prob_sums: list[torch.Tensor], num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Switch aux loss over the statistics pooled across L routers (transformers' Mixtral
    `load_balancing_loss_func`, divided by top_k to meshtron's normalisation):
    aux = E * sum_i f_i P_i with f_i = sum_l counts_l,i / (L T k) and P_i = sum_l probs_l,i / (L T),
    per pooled set (averaged over sets). `prob_sums` are the routers' differentiable
    `set_prob_sum` (or their recomputed copies). Returns (this rank's differentiable
    contribution, the value over the stats group); no communication."""
    L = len(outputs)
    S = outputs[0].set_counts.shape[0]
    T_set = outputs[0].tokens_per_set
    f = sum(o.set_counts for o in outputs) / (L * T_set * top_k)  # [S, E], no grad
    contribution = num_experts * (f.float() * sum(prob_sums)).sum() / (L * T_set.float() * S)
    with torch.no_grad():
        value = (num_experts * (f * sum(o.set_prob_sum_global for o in outputs)).sum() / (L * T_set * S)).float()
    return contribution, value
