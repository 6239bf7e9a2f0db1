"""What an MoE layer is: `MoEConfig`, and every rule on its fields with its one message.

`models.config.GPTConfig.moe()` derives the config of the model's MoE layers, and
`GPTConfig.validate` runs `routing_checks` with the rest of the model's rules; the router
(`moe/router.py`) and the aux-loss scopes (`moe/scope.py`) raise from the same checks when built
directly. Messages name the user-facing keys (`model.top_k`, ...). No torch, no process groups.

The routing fields (`ROUTING_FIELDS`: capacity, loss coefficients, router score, scopes,
groups, shared experts) are declared here once, default and help (meshtron/schema.py
`setting`); the user writes them as `model.<name>` keys, and `GPTConfig` copies these
declarations (`schema.declared_in`) rather than declaring them again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.rules import Check, raise_first
from meshtron.schema import help_of, setting

ROUTER_SCORES = ("softmax", "sigmoid")
# Which tokens one load-balancing statistic pools (moe/scope.py).
AUX_LOSS_SCOPES = ("microbatch", "sequence", "global")
# One aux loss per MoE layer, summed, or one over the statistics pooled across MoE layers.
AUX_LOSS_LAYERS = ("sum", "pooled")


def score_check(score: str) -> Check:
    """The router score function is one meshtron implements."""
    return score in ROUTER_SCORES, f"model.router_score={score!r} must be softmax or sigmoid"


def routing_checks(
    num_experts: int,
    top_k: int,
    *,
    score: str = "softmax",
    renormalize: bool = True,
    groups: int = 0,
    topk_groups: int = 0,
    aux_loss_coef: float = 0.0,
    z_loss_coef: float = 0.0,
    bias_update_rate: float = 0.0,
) -> list[Check]:
    """The router's rules as (holds, message) pairs: score, top_k range, group-limited routing,
    non-negative coefficients."""
    checks = [
        score_check(score),
        (1 <= top_k <= num_experts, f"model.top_k={top_k} must be between 1 and model.num_experts={num_experts}"),
        (
            score != "sigmoid" or renormalize,
            "sigmoid router weights are always normalized over the chosen k: set model.router_renormalize=true "
            "(or model.router_score=softmax for raw weights)",
        ),
    ]
    for name, value in (
        ("aux_loss_coef", aux_loss_coef),
        ("z_loss_coef", z_loss_coef),
        ("router_bias_update_rate", bias_update_rate),
    ):
        checks.append((value >= 0, f"model.{name}={value} must be >= 0"))
    if groups or topk_groups:
        per_group = num_experts // groups if groups > 0 else 0
        checks += [
            (
                groups >= 1 and num_experts % groups == 0,
                f"model.router_groups={groups} must divide model.num_experts={num_experts} "
                "(or set both router_groups and router_topk_groups to 0: no group limit)",
            ),
            (
                1 <= topk_groups <= groups,
                f"model.router_topk_groups={topk_groups} must be between 1 and model.router_groups={groups}",
            ),
            (
                top_k <= topk_groups * per_group,
                f"model.top_k={top_k} experts do not fit in router_topk_groups={topk_groups} groups of "
                f"{per_group} experts; raise router_topk_groups",
            ),
        ]
    return checks


def scope_checks(aux_loss_scope: str, aux_loss_layers: str = "sum") -> list[Check]:
    """The aux-loss scope and layer-pooling rules."""
    return [
        (
            aux_loss_scope in AUX_LOSS_SCOPES,
            f"model.aux_loss_scope={aux_loss_scope!r} must be one of {', '.join(AUX_LOSS_SCOPES)}",
        ),
        (
            aux_loss_layers in AUX_LOSS_LAYERS,
            f"model.aux_loss_layers={aux_loss_layers!r} must be one of {', '.join(AUX_LOSS_LAYERS)}",
        ),
    ]


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: router, experts of width `ffn_hidden_size`, capacity, shared experts.

    `hidden_size`, `num_experts`, `top_k`, `ffn_hidden_size` (model.moe_ffn_hidden_size),
    `activation`, `init_std` and `num_layers` (the scaled init of the second expert matrix) come
    from the model (`GPTConfig.moe()`), so they have no default here; the fields after them are
    the routing fields, declared here only (module docstring).
    """

    hidden_size: int
    num_experts: int
    top_k: int
    ffn_hidden_size: int
    activation: str
    init_std: float
    num_layers: int
    capacity_factor: float | None = setting(
        None,
        in_train_yaml=False,
        help="expert capacity per sequence: ceil(cf * seq_len * top_k / num_experts) pairs (null = dropless)",
    )
    aux_loss_coef: float = setting(0.01, in_train_yaml=False, help="load-balancing (aux) loss coefficient")
    z_loss_coef: float = setting(0.0, in_train_yaml=False, help="router z-loss coefficient")
    router_score: str = setting("softmax", in_train_yaml=False, help="softmax | sigmoid: the router's score function")
    router_renormalize: bool = setting(
        True, in_train_yaml=False, help="the chosen top_k weights renormalized to sum to 1 (sigmoid needs true)"
    )
    router_bias_update_rate: float = setting(
        0.0, in_train_yaml=False, help="aux-loss-free balancing: expert-bias step after each update (0 = off)"
    )
    # Which tokens one load-balancing statistic pools (moe/scope.py): "microbatch" (each rank's
    # microbatch), "sequence" (DeepSeek sequence-wise) or "global" (one microbatch of every dp rank).
    aux_loss_scope: str = setting(
        "microbatch",
        in_train_yaml=False,
        help="microbatch | sequence | global: which tokens one balance statistic pools (moe/scope.py)",
    )
    # "sum": one aux loss per MoE layer, summed (Switch, Megatron-Core, DeepSeek). "pooled": one
    # aux loss over the statistics pooled across all MoE layers (transformers' Mixtral/Qwen-MoE
    # load_balancing_loss_func); needs parallel.pp=1.
    aux_loss_layers: str = setting(
        "sum",
        in_train_yaml=False,
        help="sum: one aux loss per MoE layer | pooled: one over all layers' statistics (Mixtral; parallel.pp=1)",
    )
    # Group-limited routing (DeepSeek-V3): experts form `router_groups` equal groups; each token
    # picks its top-k experts inside its best `router_topk_groups` groups (0 = no limit).
    router_groups: int = setting(
        0, in_train_yaml=False, ge=0, help="> 0: group-limited routing (DeepSeek-V3) over this many equal expert groups"
    )
    router_topk_groups: int = setting(
        0, in_train_yaml=False, ge=0, help="with router_groups: each token's top_k experts lie in its best N groups"
    )
    shared_experts: int = setting(
        0, in_train_yaml=False, ge=0, help="experts every token passes through besides its routed ones"
    )
    # Fine-grained MoE models' extras: DeepSeek-V3 scales the routed experts' combine weights by
    # routed_scaling_factor (2.5); Qwen2-MoE's shared expert is one MLP of its own width whose
    # output each token scales by sigmoid(x . w) (shared_expert_gate).
    router_scaling_factor: float = setting(
        1.0, in_train_yaml=False, gt=0, help="the routed experts' combine weights multiplied by this (DeepSeek-V3: 2.5)"
    )
    shared_ffn_hidden_size: int | None = setting(
        None,
        in_train_yaml=False,
        ge=1,
        help="width of the shared experts' MLP (null = shared_experts * moe_ffn_hidden_size; Qwen2-MoE's own size)",
    )
    shared_expert_gate: bool = setting(
        False, in_train_yaml=False, help="the shared experts' output scaled per token by sigmoid(x . w) (Qwen2-MoE)"
    )

    @property
    def shared_width(self) -> int:
        """Width of the shared experts' MLP (0: none)."""
        if not self.shared_experts:
            return 0
        return self.shared_ffn_hidden_size or self.shared_experts * self.ffn_hidden_size

    def validate(self) -> None:
        """Raise ValueError naming the field of the first rule that does not hold."""
        raise_first(self.checks())

    def checks(self) -> list[Check]:
        """Every rule of an MoE layer's fields."""
        return [
            *routing_checks(
                self.num_experts,
                self.top_k,
                score=self.router_score,
                renormalize=self.router_renormalize,
                groups=self.router_groups,
                topk_groups=self.router_topk_groups,
                aux_loss_coef=self.aux_loss_coef,
                z_loss_coef=self.z_loss_coef,
                bias_update_rate=self.router_bias_update_rate,
            ),
            *scope_checks(self.aux_loss_scope, self.aux_loss_layers),
            (self.shared_experts >= 0, f"model.shared_experts={self.shared_experts} must be >= 0"),
            (
                self.shared_experts or not (self.shared_expert_gate or self.shared_ffn_hidden_size),
                "model.shared_expert_gate and model.shared_ffn_hidden_size apply to shared experts: set "
                "model.shared_experts >= 1",
            ),
            (
                self.capacity_factor is None or self.capacity_factor > 0,
                f"model.capacity_factor={self.capacity_factor} must be > 0 or null (dropless)",
            ),
        ]


# The routing fields: those declared with a help line (the model-derived fields above them have none).
ROUTING_FIELDS = tuple(f.name for f in dataclasses.fields(MoEConfig) if help_of(f) is not None)
