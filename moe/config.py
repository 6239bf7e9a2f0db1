"""What an MoE layer is: `MoEConfig`, and every rule on its fields with its one message.

`models.config.GPTConfig.moe()` derives the config of the model's MoE layers, and
`GPTConfig.validate` runs `routing_checks` with the rest of the model's rules; the router
(`moe/router.py`) and the aux-loss scopes (`moe/scope.py`) raise from the same checks when built
directly. Messages name the user-facing keys (`model.top_k`, ...). No torch, no process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.rules import Check, raise_first

ROUTER_SCORES = ("softmax", "sigmoid")
# Which tokens one load-balancing statistic pools (moe/scope.py).
AUX_LOSS_SCOPES = ("microbatch", "sequence", "global")
# One aux loss per MoE layer, summed, or one over the statistics pooled across MoE layers.
AUX_LOSS_LAYERS = ("sum", "pooled")

def score_check(score: str) -> Check:
    """The router score function is one meshtron implements."""
    return score in ROUTER_SCORES, f"model.router_score={score!r} must be softmax or sigmoid"


def routing_checks(num_experts: int, top_k: int, *, score: str = "softmax", renormalize: bool = True,
                   groups: int = 0, topk_groups: int = 0, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                   bias_update_rate: float = 0.0) -> list[Check]:
    """The router's rules as (holds, message) pairs: score, top_k range, group-limited routing,
    non-negative coefficients."""
    checks = [
        score_check(score),
        (1 <= top_k <= num_experts, f"model.top_k={top_k} must be between 1 and model.num_experts={num_experts}"),
        (score != "sigmoid" or renormalize,
         "sigmoid router weights are always normalized over the chosen k: set model.router_renormalize=true "
         "(or model.router_score=softmax for raw weights)"),
    ]
    for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef),
                        ("router_bias_update_rate", bias_update_rate)):
        checks.append((value >= 0, f"model.{name}={value} must be >= 0"))
    if groups or topk_groups:
        per_group = num_experts // groups if groups > 0 else 0
        checks += [
            (groups >= 1 and num_experts % groups == 0,
             f"model.router_groups={groups} must divide model.num_experts={num_experts} "
             "(or set both router_groups and router_topk_groups to 0: no group limit)"),
            (1 <= topk_groups <= groups,
             f"model.router_topk_groups={topk_groups} must be between 1 and model.router_groups={groups}"),
            (top_k <= topk_groups * per_group,
             f"model.top_k={top_k} experts do not fit in router_topk_groups={topk_groups} groups of "
             f"{per_group} experts; raise router_topk_groups"),
        ]
    return checks


def scope_checks(aux_loss_scope: str, aux_loss_layers: str = "sum") -> list[Check]:
    """The aux-loss scope and layer-pooling rules."""
    return [
        (aux_loss_scope in AUX_LOSS_SCOPES,
         f"model.aux_loss_scope={aux_loss_scope!r} must be one of {', '.join(AUX_LOSS_SCOPES)}"),
        (aux_loss_layers in AUX_LOSS_LAYERS,
         f"model.aux_loss_layers={aux_loss_layers!r} must be one of {', '.join(AUX_LOSS_LAYERS)}"),
    ]


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer: router, experts of width `ffn_hidden_size`, capacity, shared experts.

    `hidden_size`, `activation`, `init_std` and `num_layers` (the scaled init of the second
    expert matrix) come from the model.
    """

    hidden_size: int
    num_experts: int
    top_k: int
    ffn_hidden_size: int
    activation: str = "swiglu"
    init_std: float = 0.02
    num_layers: int = 1
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    router_score: str = "softmax"
    router_renormalize: bool = True
    router_bias_update_rate: float = 0.0
    aux_loss_scope: str = "microbatch"
    aux_loss_layers: str = "sum"
    router_groups: int = 0
    router_topk_groups: int = 0
    shared_experts: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the field of the first rule that does not hold."""
        raise_first(self.checks())

    def checks(self) -> list[Check]:
        """Every rule of an MoE layer's fields."""
        return [
            *routing_checks(self.num_experts, self.top_k, score=self.router_score,
                            renormalize=self.router_renormalize, groups=self.router_groups,
                            topk_groups=self.router_topk_groups, aux_loss_coef=self.aux_loss_coef,
                            z_loss_coef=self.z_loss_coef, bias_update_rate=self.router_bias_update_rate),
            *scope_checks(self.aux_loss_scope, self.aux_loss_layers),
            (self.shared_experts >= 0, f"model.shared_experts={self.shared_experts} must be >= 0"),
            (self.capacity_factor is None or self.capacity_factor > 0,
             f"model.capacity_factor={self.capacity_factor} must be > 0 or null (dropless)"),
        ]
